# Session 11, device call 3 (~9 min, carry .whl .gpu2):
#  1. issue 14: the low-bit GEMVs on vs off through the ModelRunner (greedy tokens on vs off, ms per step) and
#     tests/test_lowbit_gemv.py on the GPU: the evidence for runtime.lowbit_gemv's default; the fidelity target on
#     the GPU (benchmarks/h200/quant_fidelity.py);
#  2. issue 16: Qwen3-30B-A3B offline 1000 x 1024/256, ours and the HF transformers peer in the same call.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call3 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/lowbit $ROOT/moe
log "lowbit: tests on the GPU"
timeout 90 python3 -m pytest -q -x tests/test_lowbit_gemv.py 2>&1 | tail -3
log "fidelity: tiny quantized checkpoints vs their dequantized weights, CUDA bf16, low-bit GEMVs off and on"
timeout 120 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/lowbit 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
log "lowbit: ModelRunner batch 1, on vs off"
timeout 200 python3 benchmarks/h200/lowbit_engine.py --out $ROOT/lowbit \
  --runs bf16:0,awq:0,awq:1,gptq:1,fp8:0,fp8:1 2>&1 | grep -v Warning | tail -14
log "Qwen3-30B-A3B offline, ours then HF transformers"
OUT=$ROOT/moe PARTS="c-ours c-hf" HF_TIMEOUT=140 timeout 280 bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v Warning | tail -8
find $ROOT -name "*.gz" -delete
log done
