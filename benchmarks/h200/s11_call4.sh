# Session 11, device call 4 (~3 min, carry .whl .gpu2): issue 14's fidelity on the GPU again after the GPTQ g_idx
# loader fix (call 2b: loading a GPTQ act-order checkpoint on CUDA failed in torch.equal, CPU vs CUDA tensor), then
# issue 18's online run with a decode step between any two prefill batches (scheduler.interleave_decode; call 2b:
# ITL p99 56.8 ms, about two back-to-back 1024-token prefills plus a decode step).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call4 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "fidelity: tiny quantized checkpoints vs their dequantized weights, CUDA bf16, low-bit GEMVs off and on"
timeout 110 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
source benchmarks/h200/online_8b.sh
# a decode step after every prefill batch (scheduler.interleave_decode) of at most 512 tokens: a decode waits for
# at most ~half a prompt's prefill
online online_interleave_512 scheduler.interleave_decode=true scheduler.chunked_prefill_size=512
find $ROOT -name "*.gz" -delete
log done
