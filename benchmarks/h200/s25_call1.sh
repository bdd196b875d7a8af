# Written in session 24 for the next device call (carry .whl .gpu2; ~9 min once the machine is up, within one call): NEXT.md items 1-3.
# 1. the Qwen3-30B-A3B batch-1 profile in full (no --quick): graph replay, the kernels by device time and by finish
#    frontier (benchmarks/kernel_frontier.py), the scheduler loop in this process with and without overlap (host
#    time inside launch_batch, time blocked on the result), the static-batch and eager steps;
# 2. the Engine figure beside it (PARTS=b: decode-only tok/s and TTFT; session 24's TTFT 0.13 s against 0.08 in 23);
# 3. Llama-3.1-8B batch-1 graph replay with session 24's two decode switches off / on: session 24 measured them on
#    the Qwen3 step only, and its Llama run (both on) had the GEMV PDL costing 0.08 ms where session 23 saved
#    0.07-0.18 ms with it;
# 4. the triton file's tree-mask conformance test alone with -s (progress) and every duration, a 200 s limit.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s25_call1 $(date +%H:%M:%S)] $*"; }
log "Qwen3-30B-A3B batch-1 profile, full"
timeout 200 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/profile > $OUT/profile.log 2>&1
echo "{\"part\": \"profile\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -E "graph replayed|by finish frontier|scheduler \(|static batch|eager decode step|limit:" $OUT/profile.log | cut -c1-600
PARTS="b" bash benchmarks/h200/qwen_b1.sh > $OUT/engine.log 2>&1
python3 -c "import json; d=json.loads(open('$OUT/qwen3_batch1.jsonl').readlines()[-1]); print(json.dumps(d['decode']))"
for on in 0 1; do
  log "Llama-3.1-8B batch-1 graph replay, rotary-store and merge PDL $on"
  RADIXSERVE_ROTARY_STORE_PDL=$on RADIXSERVE_DECODE_MERGE_PDL=$on timeout 100 python3 benchmarks/h200/b1_pdl.py \
    --out $OUT/llama$on --parts runner 2>&1 | grep -i "graph replay best\|error" | tail -2
done
log "the tree-mask conformance test alone, with progress"
timeout 200 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
  "tests/test_attention_triton.py::test_tree_mask_verify_matches_exact_attention" > $OUT/tree.log 2>&1
echo "{\"part\": \"tree-mask conformance\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
grep -E "passed|failed|PASSED|FAILED|s call|Error" $OUT/tree.log | tail -5
log done
