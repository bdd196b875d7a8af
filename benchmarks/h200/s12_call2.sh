# Session 12, device call 2 (~9 min, carry .whl .gpu2): issue 14's int4 kernels, second round, and the decode rows
# with what this call's sweeps pick. Call 1 found the 8-dots-per-chunk tensor-core kernel ("planes") ~2.2-3x
# faster than the split-K kernel at 8-64 rows but flat in the batch size (bound by unpacking and fixed costs, not by
# bytes or MMAs). The kernels can now add K splits inside the launch (the last split of a tile adds the partials:
# one launch instead of three; opt-in, untimed), so:
#  1. the batch-1 int4 GEMV with K cut into 2/4/8 ranges (more programs in flight) beside its whole-row configs;
#  2. int4_rows_gemm: "planes" beside the one-dot-per-chunk variants ("chunk", "chunk_xfirst", "joined"), splits
#     added by torch or inside the kernel, at 2-32 rows;
#  3. pick_int4_configs.py: the best GEMV config, the best GEMM config at 4-32 rows, and up to which batch the GEMV
#     is faster; then the decode rows (bf16 / AWQ / GPTQ at batch 1, 4, 16, 32) and the fidelity runs with them.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s12_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "int4 GEMV: whole rows vs K splits, batch 1 (and 2, 4 on each shape's best)"
timeout 150 python3 benchmarks/h200/lowbit_gemv.py --out $ROOT/quant --skip-fp8 2>&1 | tee $ROOT/quant/lowbit_gemv.log \
  | grep "int4 best\|per_layer\|speedup\|failed\|rror" | cut -c1-420
log "int4 rows GEMM: variants, Llama-3.1-8B shapes, 2-32 rows"
timeout 170 python3 benchmarks/h200/int4_rows_gemm.py --out $ROOT/quant --rows 2 4 16 32 2>&1 \
  | tee $ROOT/quant/int4_rows_gemm.log | grep "summed\|failed\|rror" | cut -c1-420
python3 benchmarks/h200/pick_int4_configs.py $ROOT/quant || exit 1
log "decode: batch 1 / 4 / 16 / 32, bf16 AWQ GPTQ, the picked kernel configs"
timeout 150 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline --methods bf16 awq gptq \
  --decode-batches 1 4 16 32 --kernel-config $ROOT/quant/kernel_config.json 2>&1 | grep -v Warning | tail -17
log "fidelity: 12 prompts together, the picked kernel configs"
timeout 80 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant --prompts 12 \
  --kernel-config $ROOT/quant/kernel_config.json 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-200
log done
