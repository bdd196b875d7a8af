# Written in session 18 for the next device session (~6 min once the machine is up; first make .old with
# `bash benchmarks/h200/old_tree.sh 13a9612`, carry .whl .gpu2 .old): issue 18's offline run, 1000 x 1024/256
# (stacks/h200-llama.yaml's settings, triton), alternating on one machine:
#   - the scheduler's host-time cut (88f492b: radix-cache eviction candidates kept in a heap, cheaper prefix
#     compares, fill_ids not rebuilt) and the lookahead while the queue waits for memory (9aa55c9; both in
#     benchmarks/results/cpu-scheduler-host.md) against the tree before them (.old = 13a9612's core and radix
#     cache on PYTHONPATH): overlapped_batches should go from 256 to ~666 of 806;
#   - the extend graphs at 1024 tokens, with the new stats field cuda_alloc_retries (were session 18's slow runs
#     the caching allocator freeing and retrying?).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s19_call1 $(date +%H:%M:%S)] $*"; }
[ -f .old/REV ] || { echo "no .old/ (bash benchmarks/h200/old_tree.sh 13a9612)"; exit 1; }
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok128k
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"  # stacks/h200-llama.yaml
offline() {  # offline TAG GRAPH_TOKENS [old]
  local tag=$1 graphs=$2 pp=$PYTHONPATH
  [ "${3:-}" = old ] && pp=$PWD/.old/core:$PWD/.old/plugins/cache/radix:$PYTHONPATH
  log "offline 1000 x 1024/256: $tag (extend graphs $graphs)"
  PYTHONPATH=$pp timeout 110 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T \
    --num-prompts 1000 --input-len 1024 --output-len 256 --vocab-high 128000 --result-file $ROOT/offline_$tag.jsonl \
    $STACK runtime.cuda_graph_extend_max_tokens=$graphs 2>&1 | grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line); s = d['stats']
    print(json.dumps({k: d[k] for k in ('seconds', 'total_tok_s')} | {k: s.get(k) for k in (
        'steps', 'prefill_batches', 'decode_batches', 'overlapped_batches', 'retractions', 'cuda_alloc_retries')}))"
}
offline new_g0_a 0
offline old_g0_a 0 old
offline new_g1024_a 1024
offline new_g0_b 0
offline old_g0_b 0 old
log done
