# Session-6 second call (issue 18, batch-1 decode): the GEMV kernel restored to session 5's code for its
# default path (the first call, s6_gemv.sh -> results/h200-2026-12-04-s6/gemv-a, measured a ~8% slower build),
# the silu fold unwired, the tile rule widened to Qwen3-30B-A3B's attention shapes. Needs branch gemv's code.
# Carry: .whl .gpu2
#   bash benchmarks/h200/s6_gemv2.sh                 (~3.5 min)
#   PROFILE=rotary,rotary+gemv bash benchmarks/h200/s6_gemv2.sh   (~3 min: without the PDL variant)
# 1. auto's tiles vs cuBLAS on the 8B / Qwen3-8B / Qwen3-30B-A3B shapes (+ alternates for the 30B ones), bit-equal
#    fraction vs F.linear, the gated (silu-folded) down vs two launches, one call with / without PDL bit-equal, and
#    a chain of the 8B layer's 4 GEMVs with / without PDL (gemv_selected.json)
# 2. greedy parity of tiny Llama/Qwen3 vs transformers with every projection forced onto the GEMV (batch-1 decode)
# 3. Engine batch-1 decode 1024 in / 512 out with the defaults (first call: 210.1 tok/s with the slower build)
# 4. per-kernel profile of a batch-1 step (8B) on the attention backend's defaults: cuBLAS (`rotary`) vs the GEMV
#    (`rotary+gemv`, the default) vs PDL tiles (`rotary+gemv+pdl`, opt-in)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
F='it/s\]\|tensor/s\]\|Warning'
echo "== 1. auto's tiles vs cuBLAS / F.linear"
timeout 80 python3 benchmarks/h200/gemv_vs_cublas.py --selected --out $OUT 2>&1 | grep -v "$F" | tee $OUT/gemv_selected.txt
echo "== 2. parity (every projection on the GEMV, batch-1 decode) vs transformers"
timeout 90 python3 benchmarks/gpu_parity.py --batch1-gemv-all 2>&1 | grep "SUMMARY\|BROKEN\|Error\|GEMV" | tee $OUT/parity.txt
echo "== 3. Engine batch-1 (defaults: GEMV on)"
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
timeout 80 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
  --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine_gemv.jsonl $B1 2>&1 | grep '^{' | cut -c1-200
echo "== 4. profile (${PROFILE:=rotary,rotary+gemv,rotary+gemv+pdl})"
timeout 170 python3 benchmarks/h200/profile_decode.py --out $OUT --variants $PROFILE \
  2>&1 | grep -v "$F" | tee $OUT/profile_decode.txt | grep -v "^ .*0\.00[0-9][0-9] ms" | head -60
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
