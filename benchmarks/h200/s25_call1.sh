# Written in session 24 for the next device call (carry .whl .gpu2; ~9 min once the machine is up): NEXT.md items 1-3.
# 1. the Qwen3-30B-A3B batch-1 profile in full (no --quick): graph replay, the kernels by device time and by finish
#    frontier (benchmarks/kernel_frontier.py), the scheduler loop in this process with and without overlap (host
#    time inside launch_batch, time blocked on the result), the static-batch and eager steps;
# 2. the Engine figure beside it (PARTS=b: decode-only tok/s and TTFT; session 24's TTFT 0.13 s against 0.08 in 23);
# 3. the triton file's tree-mask conformance test alone with -s (progress) and every duration, a 300 s limit.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s25_call1 $(date +%H:%M:%S)] $*"; }
log "Qwen3-30B-A3B batch-1 profile, full"
timeout 200 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/profile > $OUT/profile.log 2>&1
echo "{\"part\": \"profile\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -E "graph replayed|by finish frontier|scheduler \(|static batch|eager decode step|limit:" $OUT/profile.log | cut -c1-600
PARTS="b" bash benchmarks/h200/qwen_b1.sh > $OUT/engine.log 2>&1
python3 -c "import json; d=json.loads(open('$OUT/qwen3_batch1.jsonl').readlines()[-1]); print(json.dumps(d['decode']))"
log "the tree-mask conformance test alone, with progress"
timeout 300 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
  "tests/test_attention_triton.py::test_tree_mask_verify_matches_exact_attention" > $OUT/tree.log 2>&1
echo "{\"part\": \"tree-mask conformance\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -E "passed|failed|PASSED|FAILED|s call|Error" $OUT/tree.log | tail -5
log done
