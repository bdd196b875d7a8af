# Session 11, device call 2b (~9 min, carry .whl .gpu2): calls 2 and 3 merged into one (the device was hard to get).
#  1. issue 14: fidelity on the GPU (tiny quantized checkpoints vs their dequantized weights, low-bit GEMVs off/on),
#     then the decode rows with the new default runtime.lowbit_gemv=auto (on for CUDA);
#  2. issue 18 online: 300 requests at 8 req/s, Llama-3.1-8B shape, stacks/h200-llama.yaml, a tokenizer covering
#     the 128,256-id vocabulary (.gpu2/tok128k) and prompt ids over it, with the fresh-prompt SDPA off cuDNN;
#  3. issue 14 FP8 vs bf16 offline 1000 x 1024/256 through the Engine (issue 18's offline figure is the bf16 row);
#  4. the online run again with 512-token prefill chunks (a decode step then waits for at most one chunk).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call2b $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant $ROOT/offline
M=benchmarks/model-configs/llama-3.1-8b
log "fidelity: tiny quantized checkpoints vs their dequantized weights, CUDA bf16, low-bit GEMVs off and on"
timeout 100 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
log "quant: decode batch 1 / 32, all methods, defaults (runtime.lowbit_gemv=auto)"
timeout 90 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline 2>&1 | grep -v Warning | tail -11
source benchmarks/h200/online_8b.sh
online online
log "offline: bf16 vs FP8, 1000 x 1024/256 through the Engine"
timeout 250 python3 benchmarks/h200_quant.py --out $ROOT/offline --skip kernels,decode --methods bf16 fp8 \
  --tokenizer .gpu2/tok-smollm2 --offline-prompts 1000 --offline-budget-s 90 2>&1 | grep -v Warning | tail -8
online online_chunk512 scheduler.chunked_prefill_size=512
find $ROOT -name "*.gz" -delete
log done
