# Session 8, device call 3 (integration branch dev5 = main + b1 + treegraph): PDL batch-1 GEMVs and the
# decode-only figure (issue 18), tree verifies replaying the decode graphs (issue 13). Carry: .whl .gpu2. ~6 min
set -o pipefail
ROOT=$OUT
log() { echo "[s8_call3 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/b1 $ROOT/tree
log "b1"
OUT=$ROOT/b1 timeout 270 bash benchmarks/h200/b1_pdl.sh 2>&1 | tail -40
log "tree graphs"
OUT=$ROOT/tree timeout 280 bash benchmarks/h200/tree_graphs.sh 2>&1 | grep -v Warning | tail -40
find $ROOT -name "*.gz" -delete
log done
