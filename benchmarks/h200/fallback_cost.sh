# Dense fallback cost on the H200 (~9 min): the Llama-3.1-8B shape (dummy bf16 weights) through the native
# Llama plugin and through the transformers fallback (model.impl: transformers, radixserve-models-transformers):
# batch-1 decode (one-batch, CUDA graphs, triton attention) and offline 1000 x 1024/256 (Engine).
# Target (issue 16): the fallback within 15% of native on both figures. Writes $OUT/fallback_cost.json.
# Carry: .whl .gpu2 (the tokenizer the Engine detokenizes with; TOKENIZER=DIR to use another).
# PART=decode or PART=offline runs one half (two calls when one call's time is short).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=${TOKENIZER:-.gpu2/tok-smollm2}
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
if [ "${PART:-all}" != offline ]; then
  for impl in native transformers; do
    timeout ${ONE_BATCH_TIMEOUT:-180} radixserve bench one-batch --model $M --load-format dummy --device cuda --dtype bfloat16 --batch-size 1 \
      --input-len 1024 --output-len 128 --model-impl $impl --result-file $OUT/one_batch_$impl.jsonl \
      model.context_length=2048 stack.attention=triton runtime.cuda_graph_max_bs=8 2>&1 \
      | grep -v "it/s\]\|tensor/s\]" | tail -4
  done
fi
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
if [ "${PART:-all}" != decode ]; then
  for impl in native transformers; do
    timeout ${OFFLINE_TIMEOUT:-200} python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T \
      --num-prompts ${NUM_PROMPTS:-1000} --input-len 1024 --output-len 256 --result-file $OUT/offline_$impl.jsonl \
      $STACK model.impl=$impl 2>&1 | grep -v "it/s\]" | tail -2 | cut -c1-400
  done
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def last(name, key):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    rows = [json.loads(l) for l in open(path) if l.strip()]
    return rows[-1].get(key) if rows else None
res = {}
for figure, (stem, key) in {"batch1_decode_tok_s": ("one_batch", "decode_tok_s"),
                            "offline_total_tok_s": ("offline", "total_tok_s")}.items():
    native, fallback = last(f"{stem}_native.jsonl", key), last(f"{stem}_transformers.jsonl", key)
    ratio = round(fallback / native, 3) if native and fallback else None
    res[figure] = {"native": native, "transformers_fallback": fallback, "fallback_over_native": ratio,
                   "within_15_percent": None if ratio is None else ratio >= 0.85}
print(json.dumps(res, indent=2))
json.dump(res, open(os.path.join(out, "fallback_cost.json"), "w"), indent=2)
PY
