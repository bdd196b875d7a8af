# Written in session 26 (carry .whl .gpu2 .fi; ~4 min on a warm machine): issue 18's offline prefill gap. One
# 8192-token prefill chunk of the 8B shape (8 prompts x 1024, as the offline run's chunks) on triton and
# FlashInfer, its kernel time by kind and the GEMMs' rate beside the GEMM rate measured at the same rows.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || echo "flashinfer setup failed: its row will say so"
timeout 400 python3 benchmarks/h200/profile_prefill.py --model benchmarks/model-configs/llama-3.1-8b --prompts 8 \
  --input-len 1024 --attention triton,flashinfer --out $OUT 2>&1 | grep '^{' | cut -c1-1500
