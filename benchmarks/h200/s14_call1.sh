# Session 14, device call 1 (~8 min, carry .whl .gpu2): issue 18's online targets in one run with a decode
# step between any two prefill batches of at most 512 tokens (session 11: ITL p99 29.8 ms with it, TTFT p99
# 1,786 ms from a first-request compile that the warm-up now covers); then issue 16's Qwen3-30B-A3B offline
# 1000 x 1024/256 through the Engine (never run yet; the HF peer is call 2).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s14_call1 $(date +%H:%M:%S)] $*"; }
source benchmarks/h200/online_8b.sh
online online_interleave_512 scheduler.interleave_decode=true scheduler.chunked_prefill_size=512
find $ROOT -name "*.gz" -delete
log "issue 16: Qwen3-30B-A3B offline (s5_moe.sh part c-ours)"
mkdir -p $ROOT/moe; OUT=$ROOT/moe PARTS="c-ours" bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v "^Requirement\|^ *$" | tail -12
log done
