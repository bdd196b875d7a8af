# Written in session 25 for an H200, after s25_h200a.sh (carry .whl .gpu2 .fi; ~7 min, less on the warm machine):
# issue 18's offline 1000 x 1024/256 with both attention backends (target 34,000 total tok/s) and the HF
# transformers peer (static cache, batch 128, same shape) in the same call; each offline run's step trace
# (RADIXSERVE_STEP_TRACE, overlap-aware since 014f673) splits its time by batch kind and size.
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || { echo "flashinfer setup failed"; exit 1; }
log() { echo "[s25_h200b $(date +%H:%M:%S), $(left) s left] $*"; }
M=benchmarks/model-configs/llama-3.1-8b
STACK="runtime.device=cuda runtime.dtype=bfloat16 scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"  # stacks/h200-llama.yaml
log "the offline floor: bf16 GEMM rates at the projection shapes and copy bandwidth, measured here"
python3 benchmarks/offline_floor.py --config-dir $M --out $OUT/offline_floor.jsonl | cut -c1-600
for attn in triton flashinfer; do
  budget=$(( $(left) - 100 )); [ $budget -gt 150 ] && budget=150
  [ $budget -lt 60 ] && { log "offline $attn skipped: $budget s left"; continue; }
  log "offline 1000 x 1024/256, $attn (limit ${budget}s)"
  RADIXSERVE_STEP_TRACE=$OUT/offline_$attn.trace timeout $budget python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer .gpu2/tok128k \
    --num-prompts 1000 --input-len 1024 --output-len 256 --vocab-high 128000 --result-file $OUT/offline_$attn.jsonl \
    $STACK stack.attention=$attn 2>&1 | grep '^{' | cut -c1-400
  python3 benchmarks/step_trace_summary.py --bucket 64 $OUT/offline_$attn.trace  # where the run's time went, by step kind
done
budget=$(( $(left) - 5 )); [ $budget -gt 150 ] && budget=150
log "HF transformers peer, batch 128, 1024/256 (limit ${budget}s)"
timeout $budget python3 benchmarks/hf_peer.py --config-dir $M --batch-size 128 --input-len 1024 --output-len 256 \
  --result-file $OUT/hf_peer.jsonl 2>&1 | grep '^{' | cut -c1-400
log done
