# Session 24, call 5 (carry .whl .gpu2; ~3 min): call 4's Engine batch-1 figure (299.1 tok/s) was below session 23's
# (321.7) although the graph replay got faster: the Engine run with this session's two decode PDL switches off, then
# on (the defaults), in one call.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
for on in 0 1 0; do
  echo "[s24_call5 $(date +%H:%M:%S)] rotary/merge PDL $on"
  RADIXSERVE_ROTARY_STORE_PDL=$on RADIXSERVE_DECODE_MERGE_PDL=$on PARTS="b" bash benchmarks/h200/qwen_b1.sh 2>&1 \
    | grep '"measured_tok_s"' | tail -1 | cut -c300-460
done
