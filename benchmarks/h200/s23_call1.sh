# Written in session 22 for the next device call (carry .whl .gpu2; ~8 min once the machine is up): measure the two
# PDL launches session 22 wrote and left off by default, and decide their defaults (NEXT.md items 1-2):
#   RADIXSERVE_MOE_EXPERTS_PDL=1      the one-launch experts kernel PDL-launched after the router (ticket after the wait)
#   RADIXSERVE_DECODE_ATTENTION_PDL=1 the triton decode split kernel PDL-launched after the rotary + KV store kernel
# 1. on CUDA: the decode PDL plumbing test (the split kernel really PDL-launched, bits equal) and the decode tests
#    around it; the MoE tests; the mla_triton tests (its fp32 path now uses exact fp32 products, NEXT.md item 4);
# 2. Qwen3-MoE GPU parity and the expert kernels' checks with the experts PDL on (part k replays the kernel back to
#    back in a graph: the case that hit an illegal address in session 22's racy form);
# 3. Qwen3-30B-A3B batch-1 profile: neither switch / each / both (graph replay ms; session 22's main: 3.107 ms, H100);
# 4. Llama-3.1-8B batch-1 graph replay with the decode PDL off / on (issue 18's step).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s23_call1 $(date +%H:%M:%S)] $*"; }
log "tests on CUDA"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention_triton.py tests/test_moe_small_m.py \
  -k "pdl or rotary or decode_matches or split_count or cuda_graph or small_path or fused_router" > $OUT/tests.log 2>&1
echo "{\"part\": \"tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention_mla_triton.py > $OUT/mla.log 2>&1
echo "{\"part\": \"mla-tests (fp32 now IEEE)\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/mla.log
RADIXSERVE_MOE_EXPERTS_PDL=1 PARTS="g k" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ \|"blocks"' | cut -c1-300
prof() {  # TAG EXPERTS_PDL DECODE_PDL
  mkdir -p $OUT/$1
  RADIXSERVE_MOE_EXPERTS_PDL=$2 RADIXSERVE_DECODE_ATTENTION_PDL=$3 timeout 100 \
    python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$1 --quick > $OUT/$1.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tag': sys.argv[2], 'replay_ms': d['graph_replay_ms'], 'fraction': d['limit']['fraction_of_limit'], 'gate_check': all(v.get('ids_equal_runs') == v.get('of') for v in d.get('fused_gate_check', {}).values()), 'top': {k['name'][:24]: k['ms'] for k in d['graph_top_kernels'][:7]}}))" \
    $OUT/$1/qwen3moe_profile.json $1 | tee -a $OUT/summary.jsonl
  rm -rf $OUT/$1.log $OUT/$1
}
prof neither 0 0
prof experts 1 0
prof decode 0 1
prof both 1 1
prof neither2 0 0
for pdl in 0 1; do  # b1_pdl.py's runner part: graph replay with the GEMVs' PDL off / on; compare its "on" rows
  log "Llama-3.1-8B batch-1 graph replay, decode attention PDL $pdl"
  RADIXSERVE_DECODE_ATTENTION_PDL=$pdl timeout 150 python3 benchmarks/h200/b1_pdl.py --out $OUT --parts runner 2>&1 \
    | grep -i "graph replay best\|error" | tail -3
done
log done
