# Session 14, device call 2 (~7 min, carry .whl .gpu2): issue 16's HF transformers peer on the Qwen3-30B-A3B shape
# (generate, static cache, bf16, batch HF_BS=32 of 1024/256; s5_moe.sh part c-hf), for the offline ratio against
# call 1's Engine figure (the same card class; the ratio is stated with both calls' cards).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s14_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/moe
OUT=$ROOT/moe PARTS="c-hf" HF_TIMEOUT=480 bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v "^Requirement\|^ *$" | tail -12
log done
