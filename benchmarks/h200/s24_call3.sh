# Session 24, call 3 (carry .whl .gpu2; ~9 min): RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1, the triton decode split kernel
# applying rotary (and Qwen3's q/k norm) to the raw q and storing the new token's k, v itself: one kernel fewer a
# layer (no rotary + KV store kernel), off by default until measured here.
# 1. the triton decode tests on CUDA with it on (the new bits-equal test, PDL, splits, graphs);
# 2. tiny Qwen2-MoE / Qwen3-MoE greedy parity with transformers with it on (Qwen3's q/k norm through the new path);
# 3. Qwen3-30B-A3B batch-1 profile: on / off / on (graph replay ms; call 2's default: 2.987 ms);
# 4. Llama-3.1-8B batch-1 graph replay off / on (b1_pdl.py's runner part; greedy tokens identical off/on there).
# Record of what ran on f2a706f. RADIXSERVE_DECODE_ROTARY_IN_SPLIT was taken out after this call (eee134c): the
# switch no longer exists, so a rerun measures the same path twice.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s24_call3 $(date +%H:%M:%S)] $*"; }
log "decode tests on CUDA, rotary in the split kernel"
RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_attention_triton.py -k "pdl or rotary or decode_matches or split_count or cuda_graph" > $OUT/tests.log 2>&1
echo "{\"part\": \"tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1 PARTS="g" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | cut -c1-300
source benchmarks/h200/qwen_prof.sh
qwen_prof in_split RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1
qwen_prof store_kernel RADIXSERVE_DECODE_ROTARY_IN_SPLIT=0
qwen_prof in_split2 RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1
for on in 0 1; do
  log "Llama-3.1-8B batch-1 graph replay, rotary in the split kernel $on"
  RADIXSERVE_DECODE_ROTARY_IN_SPLIT=$on timeout 120 python3 benchmarks/h200/b1_pdl.py --out $OUT --parts runner 2>&1 \
    | grep -i "graph replay best\|identical\|error" | tail -3
done
log done
