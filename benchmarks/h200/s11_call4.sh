# Session 11, device call 4 (~6 min, carry .whl .gpu2): issue 14's fidelity on the GPU again after the GPTQ g_idx
# loader fix (call 2b: loading a GPTQ act-order checkpoint on CUDA failed in torch.equal, CPU vs CUDA tensor), then
# issue 16's Qwen3-30B-A3B offline, ours and the HF transformers peer in the same call.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call4 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant $ROOT/moe
log "fidelity: tiny quantized checkpoints vs their dequantized weights, CUDA bf16, low-bit GEMVs off and on"
timeout 110 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
log "Qwen3-30B-A3B offline, ours then HF transformers"
OUT=$ROOT/moe PARTS="c-ours c-hf" HF_TIMEOUT=130 timeout 270 bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v Warning | tail -8
find $ROOT -name "*.gz" -delete
log done
