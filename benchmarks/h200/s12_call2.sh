# Session 12, device call 2 (~8 min, carry .whl .gpu2). Issue 14's int4 tensor-core GEMM, second round: call 1 found
# the 8-dots-per-chunk kernel ("planes") ~2.2-3x faster than the split-K kernel but flat in the batch size (bound by
# unpacking and fixed costs, not by bytes or MMAs). Now the K splits are summed inside the kernel (the last split of
# a tile adds the partials: one launch instead of three), and the one-dot-per-chunk variants ("chunk",
# "chunk_xfirst") are swept beside it at 1-64 rows; then the decode rows with the defaults (planes, 128 rows,
# 3 stages). Then issue 18's online run with a decode step after every prefill batch of <= 512 tokens (the
# first item of benchmarks/h200/NEXT.md; the warm-up now compiles the extend kernel).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s12_call2 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
log "int4 rows GEMM: variants, Llama-3.1-8B shapes, 1-64 rows"
timeout 280 python3 benchmarks/h200/int4_rows_gemm.py --out $ROOT/quant 2>&1 | tee $ROOT/quant/int4_rows_gemm.log \
  | grep "summed\|failed\|rror" | cut -c1-420
log "decode: batch 1 / 4 / 16 / 32, bf16 and AWQ, defaults"
timeout 120 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline --methods bf16 awq \
  --decode-batches 1 4 16 32 2>&1 | grep -v Warning | tail -10
source benchmarks/h200/online_8b.sh
online online_interleave_512 scheduler.interleave_decode=true scheduler.chunked_prefill_size=512
find $ROOT -name "*.gz" -delete
log done
