# Session 8, device call 2 (main with branches tidy + grammar merged): the MoE/rotary kernel equalities after the
# tidy (issue 16 leftovers), then the grammar branch's timeline and batch-64 server run (issue 15). Carry: .whl .gpu2. ~7 min
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
export RS_H200_SETUP_DONE=1
ROOT=$OUT
log() { echo "[s8_call2 $(date +%H:%M:%S)] $*"; }
log "tidy check"
OUT=$ROOT bash benchmarks/h200/tidy_check.sh 2>&1 | tail -30
log "grammar"
mkdir -p $ROOT/grammar
OUT=$ROOT/grammar timeout 400 bash benchmarks/h200/s8_grammar.sh 2>&1 | grep -v Warning | tail -60
rm -f $ROOT/grammar/timeline/*.gz
log done
