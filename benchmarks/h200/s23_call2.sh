# Session 23, call 2 (carry .whl .gpu2; ~8 min; ran on an H100 at b8f4687, whose merge switch was then taken out:
# benchmarks/results/h100-session23.md): the decode attention's merge in the split kernel
# (RADIXSERVE_DECODE_MERGE_LAST=1: no stage-2 launch; a one-split request writes its output in the split kernel,
# otherwise the split that finishes last merges, through an atomic count per (request, KV head)), with both PDL
# launches now on by default (call 1):
# 1. on CUDA: the triton decode tests (merge bit-equality with the two launches, CUDA graph replay with merge),
#    the mla_triton file (its chain-as-tree check now relative on GPU), test_moe_small_m (skips off the interpreter);
# 2. Qwen3-30B-A3B batch-1 profile, merge off / on alternating (graph replay ms);
# 3. Llama-3.1-8B batch-1 graph replay, merge off / on;
# 4. Qwen3-30B-A3B Engine batch-1 decode (128 in / 512 out) with the faster of 2.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s23_call2 $(date +%H:%M:%S)] $*"; }
log "tests on CUDA"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_triton.py \
  -k "merge or pdl or cuda_graph or split_count or decode_rotary" > $OUT/tests.log 2>&1
echo "{\"part\": \"triton decode tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_mla_triton.py tests/test_moe_small_m.py \
  > $OUT/mla.log 2>&1
echo "{\"part\": \"mla + moe_small_m tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -4 $OUT/mla.log
prof() {  # TAG MERGE
  mkdir -p $OUT/$1
  RADIXSERVE_DECODE_MERGE_LAST=$2 timeout 100 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$1 --quick \
    > $OUT/$1.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tag': sys.argv[2], 'replay_ms': d['graph_replay_ms'], 'fraction': d['limit']['fraction_of_limit'], 'top': {k['name'][:24]: k['ms'] for k in d['graph_top_kernels'][:8]}}))" \
    $OUT/$1/qwen3moe_profile.json $1 | tee -a $OUT/summary.jsonl
  rm -rf $OUT/$1.log $OUT/$1
}
prof merge0 0
prof merge1 1
prof merge0b 0
prof merge1b 1
for m in 0 1; do
  log "Llama-3.1-8B batch-1 graph replay, merge $m"
  RADIXSERVE_DECODE_MERGE_LAST=$m timeout 150 python3 benchmarks/h200/b1_pdl.py --out $OUT --parts runner 2>&1 \
    | grep -i "graph replay best\|error" | tail -3
done
BEST=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$OUT/summary.jsonl') if '\"tag\"' in l]
ms = {m: min(r['replay_ms'] for r in rows if r['tag'].startswith('merge' + m)) for m in '01'}
print(min(ms, key=ms.get))")
log "Engine batch-1 with RADIXSERVE_DECODE_MERGE_LAST=$BEST"
RADIXSERVE_DECODE_MERGE_LAST=$BEST PARTS="b" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v "^\[setup" | tail -6 | cut -c1-400
log done
