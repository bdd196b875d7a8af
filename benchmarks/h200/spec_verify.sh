# Speculative verify path on the H200 (issue 13), Llama-3.1-8B shape with dummy weights, triton attention.
# Run from the repo root on the device with the wheels carried in .whl/:
#   bash benchmarks/h200/spec_verify.sh        (writes $OUT/spec.jsonl and $OUT/spec.txt)
# Rows: plain decode (CUDA graphs) at batch 1 and 32; the oracle drafter with 4 drafts, all right
# (acceptance 5 tokens/step) and all wrong (accept_len=0) with the low-acceptance safeguard on
# (default) and off (adaptive_batch_size=0). Targets: batch 1 speculative decode_tok_s >= 3.5x plain;
# the verify step ms within 1.15x of a plain decode step; batch 32 high acceptance not slower than
# plain; batch 32 low acceptance with the safeguard close to plain (and better than without it).
# Chain verifies replay the decode CUDA graphs only when the attention backend sets
# `decode_rows_share_requests = True` (plugin API 1.1): the triton backend's forward_decode stores
# every row's k, v (set_kv) before its kernel reads the pool, so it qualifies, but its owner must
# set the flag; without it every verify runs eagerly (the rows then show cuda_graph=false).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
C="--model $M --load-format dummy --device cuda --dtype bfloat16 --input-len 1024 --output-len 129 --result-file $OUT/spec.jsonl"
S="model.context_length=2048 stack.attention=triton"
F='it/s\]\|tensor/s\]'
{
radixserve bench one-batch $C $S --batch-size 1 32 2>&1 | grep -v "$F" | tail -3
radixserve bench one-batch $C --batch-size 1 32 --speculative oracle --speculative-num-draft-tokens 4 $S 2>&1 | grep -v "$F" | tail -3
radixserve bench one-batch $C --batch-size 1 32 --speculative oracle --speculative-num-draft-tokens 4 \
  speculative.options.accept_len=0 $S 2>&1 | grep -v "$F" | tail -3
radixserve bench one-batch $C --batch-size 32 --speculative oracle --speculative-num-draft-tokens 4 \
  speculative.options.accept_len=0 speculative.adaptive_batch_size=0 $S 2>&1 | grep -v "$F" | tail -3
} | tee $OUT/spec.txt
