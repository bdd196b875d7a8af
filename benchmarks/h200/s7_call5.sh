# Session 7, device call 5: EAGLE re-measure (issue 13), fused norm/silu GEMV after the register fix
# (issue 18), int4/FP8 GEMVs and their Engine rows (issue 14). Carry: .whl .gpu2.   ~9 min
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s7_call5 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/eagle $ROOT/gemv $ROOT/lowbit
log "eagle"
timeout 110 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -4
timeout 75 python3 benchmarks/h200/eagle_profile.py --out $ROOT/eagle --output-len 8 --modes graphs 2>&1 | grep -v Warning | head -24
rm -f $ROOT/eagle/*.gz
log "gemv fused norm / silu"
timeout 130 python3 benchmarks/h200/fused_norm_gemv.py --out $ROOT/gemv 2>&1 | grep -v Warning | grep -v "fused with" | tail -14
log "lowbit kernels"
timeout 140 python3 benchmarks/h200/lowbit_gemv.py --out $ROOT/lowbit/gemv 2>&1 | grep -v Warning | grep -v "LowbitConfig" | tail -10
log "lowbit engine"
timeout 110 python3 benchmarks/h200/lowbit_engine.py --runs bf16:0,awq:1,fp8:1 --output-len 32 --out $ROOT/lowbit/engine 2>&1 | grep -v Warning | tail -8
log done
