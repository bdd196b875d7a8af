# Written in session 25 for an H200 (carry .whl .gpu2 .fi; ~9 min on a fresh machine): issue 18's online targets
# with both attention backends, then batch 1 with both. s19_call2.sh's first half plus its batch-1 runs; the
# offline runs and the HF peer are s25_h200b.sh (one call would run past the 600 s limit on a cold machine).
#   online 300 req @ 8 req/s, latency stack (stacks/h200-llama-latency.yaml's settings): TTFT p99 < 150,
#   ITL p50 < 8, ITL p99 < 30 ms (met on H100s in session 18: triton 106.3 / 7.42 / 19.98, FlashInfer 121.6 /
#   7.86 / 23.97); Engine batch-1 1024/512: >= 240 tok/s (session 8 on an H200: 247.1, triton).
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }  # seconds left of the call's 600 s
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || { echo "flashinfer setup failed"; exit 1; }
ROOT=$OUT
log() { echo "[s25_h200a $(date +%H:%M:%S), $(left) s left] $*"; }
log "HBM limit"; python3 benchmarks/h200/hbm_limit.py | tee $OUT/hbm_limit.txt
source benchmarks/h200/online_8b.sh
LATENCY="scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=768 runtime.cuda_graph_extend_max_tokens=896"
online triton_latency $LATENCY
online fi_latency stack.attention=flashinfer $LATENCY
find $ROOT -name "*.gz" -delete
M=benchmarks/model-configs/llama-3.1-8b
for attn in flashinfer triton; do
  budget=$(( $(left) - 5 )); [ $budget -gt 150 ] && budget=150
  [ $budget -lt 40 ] && { log "batch-1 $attn skipped: $budget s left"; continue; }
  log "Engine batch-1 1024/512, $attn (limit ${budget}s)"
  timeout $budget python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer .gpu2/tok128k \
    --num-prompts 1 --input-len 1024 --output-len 512 --result-file $ROOT/batch1_$attn.jsonl runtime.device=cuda \
    runtime.dtype=bfloat16 stack.attention=$attn runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8 \
    2>&1 | grep '^{' | cut -c1-400
done
log done
