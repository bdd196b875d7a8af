# Written in session 27 for what is left of a session's device time (~440 s after a machine's start; carry .whl .gpu2):
# issue 18's online latency target (the latency stack on triton, 300 requests at 8 req/s, full-vocabulary tokenizer)
# and the Engine batch-1 1024/512 on triton, s25_h200a.sh's first and last parts. The targets are stated for an H200;
# on another card the figures are a check of the current code against that card's earlier ones (session 18's H100
# online: TTFT p99 106.3 ms, ITL p50 7.42, p99 19.98 ms).
set -o pipefail
T0=$(date +%s)
LIMIT=${LIMIT:-420}
left() { echo $(( LIMIT - $(date +%s) + T0 )); }
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s27_issue18 $(date +%H:%M:%S), $(left) s left] $*"; }
source benchmarks/h200/online_8b.sh
online triton_latency scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=768 \
  runtime.cuda_graph_extend_max_tokens=896
find $ROOT -name "*.gz" -delete
budget=$(( $(left) - 5 )); [ $budget -gt 150 ] && budget=150
if [ $budget -lt 60 ]; then log "batch-1 skipped: $budget s left"; exit 0; fi
log "Engine batch-1 1024/512, triton (limit ${budget}s)"
timeout $budget python3 benchmarks/offline_throughput.py --model benchmarks/model-configs/llama-3.1-8b --load-format dummy \
  --tokenizer .gpu2/tok128k --num-prompts 1 --input-len 1024 --output-len 512 --result-file $ROOT/batch1_triton.jsonl \
  runtime.device=cuda runtime.dtype=bfloat16 runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8 \
  2>&1 | grep '^{' | cut -c1-400
log done
