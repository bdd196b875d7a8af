# Session 22, device call 3 (carry .whl .gpu2 .old; .old = `bash benchmarks/h200/old_tree.sh 70d5795`; ~7 min):
# issue 16's Qwen3-30B-A3B batch 1 with the experts kernel PDL-launched after the router (the router signals
# launch_dependents at its start: the experts' programs are resident, tickets taken, when the ids land):
#   g, k  GPU parity of tiny Qwen MoE models with transformers; the experts kernels' checks (graph replay = eager,
#         determinism, counters zero) with the PDL launch;
#   p     the quick profile alternating new / old (70d5795: router PDL, experts trigger, no experts PDL) /
#         new with RADIXSERVE_MOE_PDL=0;
#   b     the Engine's batch-1 figure (128 in / 512 out) and the HBM limit in the same call;
# then the tail of tests/test_attention_triton.py on CUDA (what ran: benchmarks/results/h100-session22.md, call 3:
# part k hit an illegal address, the experts kernel took its ticket before its PDL wait while the previous launch of
# it was still running; that PDL launch was taken out again, see NEXT.md) (sessions 21-22 stopped at ~87% of the whole file at
# 200 / 330 s: -v names the slow test).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
[ -f .old/REV ] || { echo "no .old/"; exit 1; }
log() { echo "[s22_call3 $(date +%H:%M:%S)] $*"; }
PARTS="g k" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ \|"blocks"' | cut -c1-400
prof() {  # TAG [old] [env...]
  local tag=$1; shift; local pp=$PYTHONPATH
  if [ "${1:-}" = old ]; then pp=$PWD/.old/core:$PYTHONPATH; shift; fi
  mkdir -p $OUT/$tag
  log "profile $tag"
  env PYTHONPATH=$pp "$@" timeout 100 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$tag --quick > $OUT/$tag.log 2>&1
  python3 - $OUT/$tag/qwen3moe_profile.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"replay_ms": d["graph_replay_ms"], "kernels_ms": d["graph_kernels_ms_per_step"],
                  "fraction": d["limit"]["fraction_of_limit"],
                  "gate_check": all(v.get("ids_equal_runs") == v.get("of") for v in d.get("fused_gate_check", {}).values()),
                  "top": {k["name"][:24]: k["ms"] for k in d["graph_top_kernels"][:7]}}))
PY
  rm -f $OUT/$tag.log
}
prof new
prof old old
prof new_nopdl RADIXSERVE_MOE_PDL=0
rm -rf $OUT/new_nopdl
prof new2
rm -rf $OUT/new2
PARTS="b" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | cut -c1-600
log "tests/test_attention_triton.py tail on CUDA"
timeout 150 python3 -m pytest -v -x -p no:cacheprovider --durations=8 tests/test_attention_triton.py \
  -k "not test_extend_matches_reference_and_writes_kv and not test_decode_matches_reference_with_several_splits" 2>&1 \
  | grep -v "^$" | tail -45
echo "{\"part\": \"triton-tail\", \"exit\": $?}"
log done
