# Tree verifies in the decode CUDA graphs on the H200 (issue 13): a verify of an EAGLE tree (topk > 1)
# runs as decode rows (one per node, over scratch ReqToTokenPool rows) replaying the target's decode
# graphs, instead of an eager tree-mask EXTEND. Needs the treegraph branch merged (ModelRunner.tree_rows,
# radixserve/tree_decode_rows.py). Run from the repo root on the device (about 2.5 minutes):
#   bash benchmarks/h200/tree_graphs.sh
# [1/2] Llama-3.1-8B shape, dummy weights, triton attention, a random EAGLE-3 head, batch 1, 1024-token
#   prompt: topk 2 and topk 4 trees (4 levels, 8 nodes -> 9 verify rows, graph of 16), each with the tree
#   verify as decode rows (graphs) and eager ("treeeager"). Reports verify_step_ms for both, and
#   tree_verifies / tree_verifies_graph_replayed (every tree verify should replay a graph in the
#   decode-rows rows, none in the eager rows).
# [2/2] greedy spec-on == spec-off on the tiny checkpoints (fp32 exact, bf16 reported), the tree rows
#   (n-gram tree, EAGLE-3 tree, EAGLE-2 copy tree), with per-run counts of graph-replayed tree verifies.
# Writes $OUT/spec_eagle.jsonl, $OUT/spec_lossless.json, $OUT/tree_graphs.txt. Exit 1 when fp32 differs.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
{
echo "== [1/2] tree verify: decode rows in graphs vs eager tree-mask extend (8B shape, batch 1)"
timeout 150 python3 benchmarks/h200/spec_eagle.py --out $OUT --output-len 64 \
  --rows eagle3:2:4:8,eagle3:2:4:8:treeeager,eagle3:4:4:8,eagle3:4:4:8:treeeager
echo "== [2/2] losslessness of tree verifies on CUDA (tiny checkpoints, graphs on both sides)"
timeout 120 python3 benchmarks/h200/spec_lossless.py --out $OUT --only tree --new-tokens 20
} 2>&1 | grep -v 'it/s\]' | tee $OUT/tree_graphs.txt
status=$?
python3 - <<'PY' | tee -a $OUT/tree_graphs.txt
import json, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "spec_eagle.jsonl"))]
print("topk  tree_verify   verify_ms  step_ms  plain_ms  tree_verifies  graph_replayed  verify_graph_share")
for r in rows:
    print(f"{r['topk']:4}  {r.get('tree_verify', '?'):12} {r['verify_step_ms']:9.2f} {r['step_ms']:8.2f}"
          f" {r['plain_decode_step_ms']:9.2f} {r.get('tree_verifies', 0):14} {r.get('tree_verifies_graph_replayed', 0):15}"
          f" {r['verify_steps_graph_replayed']:19.2f}")
PY
exit $status
