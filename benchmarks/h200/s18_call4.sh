# Session 18, device call 4 (~4 min on a cold machine, carry .whl .gpu2): offline 1000 x 1024/256 with the extend
# graphs at 1024 tokens and off, in that order (call 1 ran 0, 1024, 0, 1024; its last run was the one slow one):
# whether the graphs can be the CUDA default without costing the offline figure.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s18_call4 $(date +%H:%M:%S)] $*"; }
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok128k
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"  # stacks/h200-llama.yaml
for graphs in 1024 0; do
  log "offline 1000 x 1024/256, cuda_graph_extend_max_tokens=$graphs"
  timeout 100 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 128000 --result-file $ROOT/offline_graphs$graphs.jsonl $STACK \
    runtime.cuda_graph_extend_max_tokens=$graphs 2>&1 | grep '^{' | cut -c1-300
done
log done
