# Session 7, device call 1: the measurements session 6 left pending (issues 13, 14, 16). Carry: .whl .gpu2.
#   bash benchmarks/h200/s7_call1.sh     (~9 min; each part under its own timeout, results under $OUT/<part>/)
# Parts: lowbit (int4/FP8 whole-row GEMVs vs cuBLAS, issue 14), eagle (per-kernel propose/verify profile and
# the EAGLE-3 1:4:4 overhead row, issue 13), qwen (Qwen3-30B-A3B Engine batch-1 with the GEMV tiles + profile,
# issue 16).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s7_call1 $(date +%H:%M:%S)] $*"; }
PARTS=" ${PARTS:-lowbit eagle qwen} "
has() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
if has lowbit; then
  log "lowbit"; mkdir -p $ROOT/lowbit
  timeout 120 python3 benchmarks/h200/lowbit_gemv.py --out $ROOT/lowbit 2>&1 | grep -v Warning | tail -30
fi
if has eagle; then
  log "eagle profile"; mkdir -p $ROOT/eagle
  timeout 150 python3 benchmarks/h200/eagle_profile.py --out $ROOT/eagle --output-len 8 2>&1 | grep -v Warning | tail -40
  log "eagle overhead row"
  timeout 120 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -8
fi
if has qwen; then
  log "qwen b p"; mkdir -p $ROOT/qwen
  OUT=$ROOT/qwen PARTS="b p" bash benchmarks/h200/s6_qwen.sh 2>&1 | grep -v "^\[s6_qwen.*setup" | tail -40
fi
log done
