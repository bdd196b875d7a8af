# Session 24, call 3 (carry .whl .gpu2; ~9 min): RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1, the triton decode split kernel
# applying rotary (and Qwen3's q/k norm) to the raw q and storing the new token's k, v itself: one kernel fewer a
# layer (no rotary + KV store kernel), off by default until measured here.
# 1. the triton decode tests on CUDA with it on (the new bits-equal test, PDL, splits, graphs);
# 2. tiny Qwen2-MoE / Qwen3-MoE greedy parity with transformers with it on (Qwen3's q/k norm through the new path);
# 3. Qwen3-30B-A3B batch-1 profile: on / off / on (graph replay ms; call 2's default: 2.987 ms);
# 4. Llama-3.1-8B batch-1 graph replay off / on (b1_pdl.py's runner part; greedy tokens identical off/on there).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s24_call3 $(date +%H:%M:%S)] $*"; }
log "decode tests on CUDA, rotary in the split kernel"
RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_attention_triton.py -k "pdl or rotary or decode_matches or split_count or cuda_graph" > $OUT/tests.log 2>&1
echo "{\"part\": \"tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
RADIXSERVE_DECODE_ROTARY_IN_SPLIT=1 PARTS="g" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | cut -c1-300
prof() {  # TAG ROTARY_IN_SPLIT
  mkdir -p $OUT/$1
  RADIXSERVE_DECODE_ROTARY_IN_SPLIT=$2 timeout 90 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$1 --quick \
    > $OUT/$1.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tag': sys.argv[2], 'replay_ms': d['graph_replay_ms'], 'fraction': d['limit']['fraction_of_limit'], 'gate_check': all(v.get('ids_equal_runs') == v.get('of') for v in d.get('fused_gate_check', {}).values()), 'top': {k['name'][:24]: k['ms'] for k in d['graph_top_kernels'][:8]}}))" \
    $OUT/$1/qwen3moe_profile.json $1 | tee -a $OUT/summary.jsonl || tail -5 $OUT/$1.log
  rm -rf $OUT/$1
}
prof in_split 1
prof store_kernel 0
prof in_split2 1
for on in 0 1; do
  log "Llama-3.1-8B batch-1 graph replay, rotary in the split kernel $on"
  RADIXSERVE_DECODE_ROTARY_IN_SPLIT=$on timeout 120 python3 benchmarks/h200/b1_pdl.py --out $OUT --parts runner 2>&1 \
    | grep -i "graph replay best\|identical\|error" | tail -3
done
log done
