# Session 20's device call (~4 min once the machine is up, carry .whl .gpu2): prompt logprobs on CUDA against
# transformers (prompt_logprobs_gpu.py, triton attention, extend graphs off and on), then issue 16's
# Qwen3-30B-A3B batch-1 figure and per-kernel profile (qwen_b1.sh parts b and p).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s20_call2 $(date +%H:%M:%S)] $*"; }
log "prompt logprobs on CUDA"
timeout 150 python3 benchmarks/h200/prompt_logprobs_gpu.py --attention triton 2>&1 | grep "^{\|Error" | tee $OUT/prompt_logprobs_gpu.jsonl
PARTS="b p" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v "^Warning"
log done
