# Session-5 call (issue 18, batch-1 decode): the triton backend's decode fusions, rotary fused into the
# KV store and one-launch decode attention, A/B in one call (~4.5 min). Carry: .whl .gpu2
#   bash benchmarks/h200/s5_decode.sh
# 1. the HBM limit (copy bandwidth) in the same call
# 2. the triton test file's decode/fusion cases on CUDA (bit-equality of fused vs unfused, graphs)
# 3. greedy parity of tiny Llama/Qwen3 (bf16, triton attention, CUDA graphs) vs transformers with the
#    fusions on (the defaults); the same runners regenerate with them off: tokens compared exactly
# 4. batch-1 projections, cuBLAS vs the Triton GEMV over a few configs (gemv_vs_cublas.json)
# 5. per-kernel profile of a batch-1 step on one runner: fusions off, on, and on + the Triton GEMV for
#    the shapes where step 4 found it faster (profile_decode.json)
# 6. Engine batch-1 decode 1024 in / 512 out (warm-up on other prompts), fusions on (the defaults); the
#    unfused figure is the recorded 200.6 tok/s, and step 5 has both variants' graph replay times
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
F='it/s\]\|tensor/s\]\|Warning'
echo "== 1. limit"; python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
echo "== 2. tests"
timeout 90 python3 -m pytest tests/test_attention_triton.py -q -k "rotary or one_launch or graph or decoder_layers" \
  --noconftest -p no:cacheprovider -o addopts="" 2>&1 | tail -4 | tee $OUT/tests.txt
echo "== 3. parity (fusions on vs transformers; the same runners with the fusions off: tokens must be equal)"
timeout 90 python3 benchmarks/gpu_parity.py --decode-fusions-ab 2>&1 | grep "SUMMARY\|BROKEN\|Error" | tee $OUT/parity.txt
echo "== 4. batch-1 projections: cuBLAS vs the Triton GEMV (no split-K)"
timeout 75 python3 benchmarks/h200/gemv_vs_cublas.py --out $OUT 2>&1 | grep -v "$F" | tee $OUT/gemv_vs_cublas.txt
echo "== 5. profile (variants off, on, on+gemv)"
timeout 150 python3 benchmarks/h200/profile_decode.py --out $OUT --variants off,on,on+gemv --gemv-json $OUT/gemv_vs_cublas.json \
  2>&1 | grep -v "$F" | tee $OUT/profile_decode.txt | head -90
echo "== 6. Engine batch-1"
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
engine() {
  timeout 90 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine_$1.jsonl $B1 2>&1 | grep '^{' | cut -c1-200
}
engine on
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
