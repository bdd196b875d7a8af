# Written in session 22 for the next device call (carry .whl .gpu2; ~6 min once the machine is up): measure the
# decode attention's PDL launch (RADIXSERVE_DECODE_ATTENTION_PDL=1, off by default until this runs) and decide its
# default:
#   1. on CUDA, the new plumbing test (the split kernel really PDL-launched with its L2 prefetch, bits equal to the
#      plain launch) and the decode tests around it;
#   2. Qwen3-30B-A3B batch-1 profile, alternating off / on (graph replay ms; session 22's main: 3.107 ms on an H100);
#   3. Llama-3.1-8B batch-1 graph replay off / on (issue 18's batch-1 step: 32 layers of rotary+store -> decode).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s23_call1 $(date +%H:%M:%S)] $*"; }
log "decode PDL tests on CUDA"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention_triton.py \
  -k "pdl_switch or rotary or decode_matches or split_count or cuda_graph" > $OUT/tests.log 2>&1
echo "{\"part\": \"tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
prof() {  # TAG PDL(0|1)
  mkdir -p $OUT/$1
  RADIXSERVE_DECODE_ATTENTION_PDL=$2 timeout 100 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$1 --quick \
    > $OUT/$1.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tag': sys.argv[2], 'replay_ms': d['graph_replay_ms'], 'fraction': d['limit']['fraction_of_limit'], 'top': {k['name'][:24]: k['ms'] for k in d['graph_top_kernels'][:7]}}))" \
    $OUT/$1/qwen3moe_profile.json $1 | tee -a $OUT/summary.jsonl
  rm -f $OUT/$1.log
}
for round in 1 2; do prof qwen_off$round 0; prof qwen_on$round 1; done
rm -rf $OUT/qwen_off2 $OUT/qwen_on2
for pdl in 0 1; do  # b1_pdl.py's runner part: graph replay with the GEMVs' PDL off / on; compare its "on" rows
  log "Llama-3.1-8B batch-1 graph replay, decode attention PDL $pdl"
  RADIXSERVE_DECODE_ATTENTION_PDL=$pdl timeout 150 python3 benchmarks/h200/b1_pdl.py --out $OUT --parts runner 2>&1 \
    | grep -i "graph replay best\|error" | tail -3
done
log done
