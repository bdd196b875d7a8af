# Session 8, device call 1 (main as committed): the constrained batch-64 step's timeline (issue 15), Qwen3-30B-A3B
# offline 1000 x 1024/256 and Mixtral-8x7B batch-1 with its limit (issue 16). Carry: .whl .gpu2.  ~8 min
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s8_call1 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/grammar $ROOT/moe
log "grammar timeline (batch 64, plain vs constrained)"
timeout 230 python3 benchmarks/h200/grammar_timeline.py --out $ROOT/grammar 2>&1 | grep -v Warning | tail -40
rm -f $ROOT/grammar/*.gz
log "moe: qwen3 offline (ours), mixtral batch-1 + limit"
OUT=$ROOT/moe PARTS="c-ours d-batch1" timeout 330 bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v Warning | tail -20
log done
