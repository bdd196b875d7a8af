# Session 8, device call 4 (integration branch dev6 = main (tidy, grammar@118adf6-, treegraph, served) + b1 + grammar):
# Engine batch-1 with PDL off/on and both figures (issue 18), the grammar branch's batch-64 server run and timeline
# (issue 15), the EAGLE-3 chain draft cost on this tree (issue 13). Carry: .whl .gpu2. ~8 min
set -o pipefail
ROOT=$OUT
log() { echo "[s8_call4 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/b1 $ROOT/grammar $ROOT/eagle
log "b1 engine"
OUT=$ROOT/b1 timeout 200 bash benchmarks/h200/b1_engine.sh 2>&1 | grep -v Warning | tail -16
log "grammar"
OUT=$ROOT/grammar timeout 230 bash benchmarks/h200/s8_grammar.sh 2>&1 | grep -v Warning | tail -40
log "eagle chain 1:4:4"
timeout 110 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -2 | cut -c1-1500
find $ROOT -name "*.gz" -delete
log done
