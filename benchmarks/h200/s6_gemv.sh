# Session-6 call (issue 18, batch-1 decode): the Triton GEMV on by default (runtime.batch1_gemv=auto,
# per-layer tiles from layers/gemv_selection.py). Needs branch gemv's code. Carry: .whl .gpu2
#   bash benchmarks/h200/s6_gemv.sh        (~4-4.5 min)
# (the GEMV's CPU tests cover routing/selection; step 3 checks the kernel on the GPU at the real shapes)
# 2. greedy parity of tiny Llama/Qwen3 (bf16, triton attention, CUDA graphs) vs transformers with every
#    projection forced onto the GEMV and each prompt alone (batch-1 decode): top-5 rule
# 3. the tiles auto picks on the 8B shapes (+ Qwen3-8B's unmeasured MLP shapes): time vs cuBLAS, bit-equal
#    fraction and max |diff| vs F.linear; down with silu_and_mul in its prologue vs two launches; a chain
#    of the layer's 4 GEMVs with / without programmatic dependent launch (PDL) (gemv_selected.json)
# 4. per-kernel profile of a batch-1 step: GEMV off (`on`: decode fusions on, cuBLAS) vs on (`on+gemv`,
#    the new default, silu_and_mul folded into down) vs on with PDL tiles (`on+gemv+pdl`, opt-in)
# 5. Engine batch-1 decode 1024 in / 512 out with the defaults (GEMV on); the recorded GEMV-off figure is
#    203.0 tok/s (session 5), and step 4 has both variants' graph replay times
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
F='it/s\]\|tensor/s\]\|Warning'
echo "== 2. parity (every projection on the GEMV, batch-1 decode) vs transformers"
timeout 90 python3 benchmarks/gpu_parity.py --batch1-gemv-all 2>&1 | grep "SUMMARY\|BROKEN\|Error\|GEMV" | tee $OUT/parity.txt
echo "== 3. auto's tiles vs cuBLAS / F.linear"
timeout 75 python3 benchmarks/h200/gemv_vs_cublas.py --selected --out $OUT 2>&1 | grep -v "$F" | tee $OUT/gemv_selected.txt
echo "== 4. profile (on = cuBLAS, on+gemv = the default, on+gemv+pdl = its tiles with programmatic dependent launch)"
timeout 170 python3 benchmarks/h200/profile_decode.py --out $OUT --variants on,on+gemv,on+gemv+pdl \
  2>&1 | grep -v "$F" | tee $OUT/profile_decode.txt | head -70
echo "== 5. Engine batch-1 (defaults: GEMV on)"
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
timeout 80 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
  --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine_gemv.jsonl $B1 2>&1 | grep '^{' | cut -c1-200
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
