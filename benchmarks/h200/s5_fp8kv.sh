# Session-5 (issue 14, FP8 KV cache) on one H200, ~4 min. Carry: .whl .gpu2 (the SmolLM2 tokenizer
# for the offline runs, as s4_prefill.sh). Results: $OUT/fp8kv.jsonl, $OUT/summary.txt.
#   1. tests/test_attention_triton_fp8.py on CUDA: the triton decode/extend kernels on an fp8 pool
#      vs torch_native on the same pool (bf16, real fp8 loads)
#   2. tiny random Llama, triton + decode CUDA graphs: greedy fp8 vs bf16 KV (top-5 rule)
#   3. Llama-3.1-8B shape (dummy bf16): KV pool token capacity (expect ~2x) and batch-64 decode step
#      at 4k context, bf16 then fp8 (each in a fresh process)
#   4. offline 300 x 1024/256 through the Engine, bf16 then fp8 KV
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
echo "== 1. kernel tests on CUDA"
timeout 150 python3 -m pytest tests/test_attention_triton_fp8.py -q --noconftest -p no:cacheprovider -o addopts="" 2>&1 \
  | tail -3 | tee $OUT/tests.txt
echo "== 2. tiny greedy fp8 vs bf16"
timeout 120 python3 benchmarks/h200/fp8kv.py tiny $OUT 2>&1 | grep '^{' | tee -a $OUT/summary.txt
echo "== 3. Llama-3.1-8B shape: capacity and decode"
for kv in auto fp8_e4m3; do
  timeout 120 python3 benchmarks/h200/fp8kv.py llama $kv $OUT 2>&1 | grep '^{\|Error' | tee -a $OUT/summary.txt
done
echo "== 4. offline 300 x 1024/256"
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
for kv in auto fp8_e4m3; do
  timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 300 \
    --input-len 1024 --output-len 256 --vocab-high 30000 --result-file $OUT/offline_$kv.jsonl $STACK runtime.kv_cache_dtype=$kv 2>&1 \
    | grep '^{' | python3 -c "import json,sys; [print(json.dumps({'test': 'offline_300x1024/256', 'kv': '$kv', **{k: v for k, v in json.loads(l).items() if k in ('seconds', 'output_tok_s', 'total_tok_s')}})) for l in sys.stdin]" \
    | tee -a $OUT/summary.txt
done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $OUT/summary.txt
