# Session 24, call 4 (carry .whl .gpu2; ~8 min): issue 16's Engine figure with this session's defaults (the rotary
# + KV store kernel and the decode merge PDL-launched), then the triton file's tree-mask conformance test alone with
# its smaller GPU set (bf16 on seeds 0-1, fp32 on seed 0 and one layer option; the full set ran past 250 s).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s24_call4 $(date +%H:%M:%S)] $*"; }
PARTS="b" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | cut -c1-400
log "the tree-mask conformance test alone"
timeout 240 python3 -m pytest -v -p no:cacheprovider --durations=3 \
  "tests/test_attention_triton.py::test_tree_mask_verify_matches_exact_attention" > $OUT/tree.log 2>&1
echo "{\"part\": \"tree-mask conformance\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -E "passed|failed|PASSED|FAILED|s call|Error" $OUT/tree.log | tail -5
log done
