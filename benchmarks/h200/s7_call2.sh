# Session 7, device call 2: EAGLE draft on the batch-1 GEMV (issue 13) and the RMSNorm fused into the
# batch-1 GEMV (issue 18). Carry: .whl .gpu2.   bash benchmarks/h200/s7_call2.sh   (~7 min)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s7_call2 $(date +%H:%M:%S)] $*"; }
log "gemv: fused norm"; mkdir -p $ROOT/gemv
timeout 260 python3 benchmarks/h200/fused_norm_gemv.py --out $ROOT/gemv 2>&1 | grep -v Warning | tail -25
log "eagle rows"; mkdir -p $ROOT/eagle
timeout 200 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4,eagle3:1:4:4:nogemv 2>&1 | grep -v Warning | tail -8
log "eagle profile"
timeout 110 python3 benchmarks/h200/eagle_profile.py --out $ROOT/eagle --output-len 8 2>&1 | grep -v Warning | head -40
rm -f $ROOT/eagle/*.gz
log done
