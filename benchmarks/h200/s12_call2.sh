# Session 12, device call 2 (~6 min, carry .whl .gpu2): issue 14's int4 kernels, second round. Call 1 found the
# 8-dots-per-chunk tensor-core kernel ("planes") ~2.2-3x faster than the split-K kernel but flat in the batch size
# (bound by unpacking and fixed costs, not by bytes or MMAs). Now K splits are summed inside the kernels (the last
# split of a tile adds the partials: one launch instead of three), so:
#  1. int4_rows_gemm: "planes" beside the one-dot-per-chunk variants ("chunk", "chunk_xfirst") at 1-64 rows;
#  2. the batch-1 int4 GEMV with K cut into 2/4/8 ranges (more programs in flight) beside its whole-row configs.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s12_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "int4 rows GEMM: variants, Llama-3.1-8B shapes, 1-64 rows"
timeout 280 python3 benchmarks/h200/int4_rows_gemm.py --out $ROOT/quant 2>&1 | tee $ROOT/quant/int4_rows_gemm.log \
  | grep "summed\|failed\|rror" | cut -c1-420
log "int4 GEMV: whole rows vs K splits, batch 1"
timeout 150 python3 benchmarks/h200/lowbit_gemv.py --out $ROOT/quant --skip-fp8 2>&1 | tee $ROOT/quant/lowbit_gemv.log \
  | grep "int4 best\|per_layer\|speedup\|failed\|rror" | cut -c1-420
log done
