# Session 12, device call 2 (~6 min, carry .whl .gpu2): issue 14's int4 tensor-core GEMM, second round. Call 1 found
# the 8-dots-per-chunk kernel ("planes") ~2.2-3x faster than the split-K kernel but flat in the batch size (bound by
# unpacking, not by bytes or MMAs); this sweeps the one-dot-per-chunk variants ("chunk", "chunk_xfirst") beside it
# at 1-64 rows, then the decode rows with the new defaults (planes, 128 rows, 3 stages).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s12_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "int4 rows GEMM: variants, Llama-3.1-8B shapes, 1-64 rows"
timeout 300 python3 benchmarks/h200/int4_rows_gemm.py --out $ROOT/quant 2>&1 | tee $ROOT/quant/int4_rows_gemm.log \
  | grep "summed\|failed\|rror" | cut -c1-420
log "decode: batch 1 / 4 / 16 / 32, bf16 and AWQ, defaults"
timeout 150 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline --methods bf16 awq \
  --decode-batches 1 4 16 32 2>&1 | grep -v Warning | tail -10
log done
