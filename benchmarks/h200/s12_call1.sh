# Session 12, device call 1 (~8 min, carry .whl .gpu2): issue 14's batched int4 decode on the new tensor-core GEMM
# over the row layout (radixserve.layers.int4_rows_gemm, 5-64 rows; batch 32 was 0.40x bf16 on the split-K kernel):
#  1. the kernel on the Llama-3.1-8B shapes at 1-64 rows vs bf16 cuBLAS, the split-K kernel and (<= 4 rows) the GEMV, a config sweep;
#  2. fidelity on the GPU with 12 prompts decoding together (the new kernel's path) and 4 (the GEMV's);
#  3. decode at batch 1 / 16 / 32 for bf16, AWQ and GPTQ with the defaults.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s12_call1 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "int4 rows GEMM: Llama-3.1-8B shapes, 8-64 rows, config sweep"
timeout 270 python3 benchmarks/h200/int4_rows_gemm.py --out $ROOT/quant 2>&1 | tee $ROOT/quant/int4_rows_gemm.log \
  | grep "M[0-9]*:\|summed\|failed\|rror" | cut -c1-420
log "fidelity: 12 prompts together (int4 tensor-core GEMM in decode)"
timeout 100 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant --prompts 12 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
log "decode: batch 1 / 16 / 32, bf16 AWQ GPTQ, defaults"
timeout 150 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline --methods bf16 awq gptq \
  --decode-batches 1 16 32 2>&1 | grep -v Warning | tail -12
log done
