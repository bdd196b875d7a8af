# Written in session 26 (carry .whl .gpu2; ~4 min on any card): the four-way table of the batch-1 decode PDL
# switches for both models in one call. Session 26 (H100) found them fighting on Llama-3.1-8B: the rotary + KV
# store and merge launches PDL-launched (RADIXSERVE_ROTARY_STORE_PDL, RADIXSERVE_DECODE_MERGE_PDL, default on)
# together with the batch-1 GEMVs PDL-launched (runtime.batch1_gemv_pdl) gave 5.609 ms a step, the GEMVs alone
# 5.418 ms; session 24 chose all on from the Qwen3-30B-A3B step alone. Each run prints both GEMV settings.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s26_pdl $(date +%H:%M:%S)] $*"; }
for model in llama-3.1-8b qwen3-30b-a3b; do
  for on in 0 1; do
    log "$model batch-1 graph replay, rotary-store and merge PDL $on (GEMV PDL off / on)"
    RADIXSERVE_ROTARY_STORE_PDL=$on RADIXSERVE_DECODE_MERGE_PDL=$on timeout 150 python3 benchmarks/h200/b1_pdl.py \
      --model benchmarks/model-configs/$model --out $OUT/$model-$on --parts runner 2>&1 | grep -i "graph replay\|error" | tail -3
  done
done
log done
