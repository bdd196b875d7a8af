# Session 7, device call 3: Qwen3-30B-A3B one-launch experts (issue 16) and the re-laid int4 / FP8 GEMVs
# (issue 14). Carry: .whl .gpu2.   bash benchmarks/h200/s7_call3.sh   (~7 min)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s7_call3 $(date +%H:%M:%S)] $*"; }
log "lowbit kernels"; mkdir -p $ROOT/lowbit
timeout 170 python3 benchmarks/h200/lowbit_gemv.py --out $ROOT/lowbit 2>&1 | grep -v Warning | tail -12
log "qwen b1"; mkdir -p $ROOT/qwen
OUT=$ROOT/qwen timeout 330 bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v "setup" | tail -45
log done
