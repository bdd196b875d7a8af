# Sourced by device scripts (after setup.sh): `qwen_prof TAG [VAR=VALUE ...]` runs the Qwen3-30B-A3B batch-1 quick
# profile (`qwen3moe_profile.py --quick`, graph replay) with those environment switches and appends one summary line
# (graph replay ms, fraction of the HBM limit, the router check, the top kernels inside the replay) to
# $OUT/summary.jsonl; on failure it prints the log's tail.
qwen_prof() {
  local tag=$1; shift
  mkdir -p "$OUT/$tag"
  env "$@" timeout 90 python3 benchmarks/h200/qwen3moe_profile.py --out "$OUT/$tag" --quick > "$OUT/$tag.log" 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tag': sys.argv[2], 'env': sys.argv[3:], 'replay_ms': d['graph_replay_ms'], 'fraction': d['limit']['fraction_of_limit'], 'gate_check': all(v.get('ids_equal_runs') == v.get('of') for v in d.get('fused_gate_check', {}).values()), 'top': {k['name'][:24]: k['ms'] for k in d['graph_top_kernels'][:8]}, 'frontier': d.get('graph_frontier')}))" \
    "$OUT/$tag/qwen3moe_profile.json" "$tag" "$@" | tee -a "$OUT/summary.jsonl" || tail -5 "$OUT/$tag.log"
  rm -rf "$OUT/$tag"
}
