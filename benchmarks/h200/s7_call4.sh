# Session 7, device call 4: the grammar path's host cost and the batch-64 constrained ratio (issue 15).
# Carry: .whl .gpu2.   bash benchmarks/h200/s7_call4.sh   (~6 min)
set -o pipefail
ROOT=$OUT
log() { echo "[s7_call4 $(date +%H:%M:%S)] $*"; }
log "grammar host"; mkdir -p $ROOT/host
OUT=$ROOT/host timeout 150 bash benchmarks/h200/grammar_host.sh 2>&1 | grep -v Warning | tail -30
log "grammar batch-64"; mkdir -p $ROOT/b64
OUT=$ROOT/b64 timeout 330 bash benchmarks/h200/structured_output_gpu.sh 2>&1 | grep -v Warning | tail -25
log done
