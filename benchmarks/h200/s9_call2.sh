# Prepared in session 9 for the next device session (no device was lent after call 1 failed to start):
# issue 14's GPU rows not measured since session 3 and issue 16's missing peer, in one call (~9 min).
#  1. bf16 / AWQ / GPTQ / FP8 decode at batch 1 and 32 (runner, CUDA graphs) with runtime.lowbit_gemv
#     as configured, and FP8 vs bf16 offline 1000 x 1024/256 through the Engine (issue 14: FP8 >= 1.35x).
#  2. Qwen3-30B-A3B: the HF transformers offline peer (issue 16: ours >= 3x; ours 25,195 in session 8).
# Carry: .whl .gpu2 (the tokenizer .gpu2/tok-smollm2).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s9_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant $ROOT/moe
log "quant: decode batch 1 / 32, all methods"
timeout 200 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline 2>&1 | grep -v Warning | tail -12
log "quant: FP8 vs bf16 offline 1000 x 1024/256 through the Engine"
timeout 200 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,decode --methods bf16 fp8 \
  --tokenizer .gpu2/tok-smollm2 --offline-prompts 1000 --offline-budget-s 90 2>&1 | grep -v Warning | tail -8
log "Qwen3-30B-A3B HF transformers peer"
OUT=$ROOT/moe PARTS="c-hf" timeout 150 bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v Warning | tail -8
find $ROOT -name "*.gz" -delete
log done
