# Session 22, device call 2 (carry .whl .gpu2 .old; .old = `bash benchmarks/h200/old_tree.sh ca850d5`; ~9 min):
# issue 16's Qwen3-30B-A3B batch-1 step after this session's kernel changes (the one-launch experts kernel signals
# launch_dependents so the next layer's PDL qkv GEMV loads under its tail; the one-launch router issues its loads
# first, is PDL-launched after the o_proj GEMV, and routes with one tl.topk instead of top_k argmax rounds):
#   g  GPU greedy parity of tiny Qwen2-MoE / Qwen3-MoE with transformers (the new router on CUDA);
#   k  the expert kernels' checks and tile sweep at 1 token (new variants: K-128 tiles, 8 warps);
#   p  the quick profile, alternating new / old (ca850d5's core) / new with the router's PDL off.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
[ -f .old/REV ] || { echo "no .old/"; exit 1; }
log() { echo "[s22_call2 $(date +%H:%M:%S)] $*"; }
PARTS="g k" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v "^ "
prof() {  # TAG [old] [env...]
  local tag=$1; shift; local pp=$PYTHONPATH
  if [ "${1:-}" = old ]; then pp=$PWD/.old/core:$PYTHONPATH; shift; fi
  mkdir -p $OUT/$tag
  log "profile $tag"
  env PYTHONPATH=$pp "$@" timeout 100 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT/$tag --quick 2>&1 \
    | grep -v Warning | grep -A3 '"graph_replay_ms"\|fraction_of_limit\|Error\|error' | head -12
  python3 - $OUT/$tag/qwen3moe_profile.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"replay_ms": d["graph_replay_ms"], "kernels_ms": d["graph_kernels_ms_per_step"],
                  "gate_check": all(v.get("ids_equal_runs") == v.get("of") for v in d.get("fused_gate_check", {}).values()),
                  "top": {k["name"][:24]: k["ms"] for k in d["graph_top_kernels"][:7]}}))
PY
}
prof new
prof old old
prof new_nopdl RADIXSERVE_MOE_ROUTER_PDL=0  # (renamed RADIXSERVE_MOE_PDL after this call; it now covers the experts kernel too)
prof new2
log done
