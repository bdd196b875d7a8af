# Written in session 17 for the next device call (~9 min once the machine is up, carry .whl .gpu2; an H200 if one is
# lent, else an H100 with its name in the results): the extend CUDA graphs (runtime.cuda_graph_extend_max_tokens)
# measured where session 17 could not.
#   1. GPU tests: extend graphs with real graphs, the triton extend kernel and the kit's extend-graph step.
#   2. Issue 18 online with stacks/h200-llama-latency.yaml's settings (768-token mixed chunks, decode rows now
#      counted against the chunk, extend graphs to 896 tokens): TTFT p99 < 150, ITL p50 < 8, ITL p99 < 30 ms.
#   3. Extend graphs as the CUDA default? Engine batch-1 (1024 in / 512 out) and offline 1000 x 1024/256 with the
#      graphs off and at 1024 tokens, same machine, alternating.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s18_call1 $(date +%H:%M:%S)] $*"; }
log "GPU tests"
timeout 150 python3 -m pytest -x -q --noconftest -p no:cacheprovider -o addopts="" tests/test_extend_graph_runner.py \
  tests/test_attention_triton.py -k "extend or graph or runner or plan or sizes or fit or refused or kit" 2>&1 \
  | tail -3 | tee $ROOT/tests.txt
source benchmarks/h200/online_8b.sh
online latency_stack scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=768 \
  runtime.cuda_graph_extend_max_tokens=896
find $ROOT -name "*.gz" -delete
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok128k
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"  # stacks/h200-llama.yaml
for graphs in 0 1024; do
  log "Engine batch-1 1024/512, cuda_graph_extend_max_tokens=$graphs"
  timeout 90 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 1024 --output-len 512 --result-file $ROOT/batch1_graphs$graphs.jsonl runtime.device=cuda \
    runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8 \
    runtime.cuda_graph_extend_max_tokens=$graphs 2>&1 | grep '^{' | cut -c1-400
done
for graphs in 0 1024 0 1024; do
  log "offline 1000 x 1024/256, cuda_graph_extend_max_tokens=$graphs"
  timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 128000 --result-file $ROOT/offline_graphs$graphs.jsonl $STACK \
    runtime.cuda_graph_extend_max_tokens=$graphs 2>&1 | grep '^{' | cut -c1-300
done
log done
