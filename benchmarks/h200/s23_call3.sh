# Session 23, call 3 (carry .whl .gpu2; ~5 min): the rest of tests/test_attention_triton.py on CUDA (NEXT.md item 3:
# sessions 21-22 ran the file to ~87% within their limits; the two large parametrized tests they passed are left
# out here), its output written to a file as it runs (no pipe: a cut run keeps what it printed).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s23_call3 $(date +%H:%M:%S)] $*"; }
log "tests/test_attention_triton.py on CUDA without its two large parametrized tests"
timeout 300 python3 -m pytest -v -p no:cacheprovider --durations=8 tests/test_attention_triton.py \
  -k "not test_extend_matches_reference_and_writes_kv and not test_decode_matches_reference_with_several_splits" \
  > $OUT/triton_tail.log 2>&1
echo "{\"part\": \"test_attention_triton tail\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -cE "PASSED" $OUT/triton_tail.log; grep -E "FAILED|ERROR|passed|failed" $OUT/triton_tail.log | tail -12
log done
