# EAGLE draft overhead on the H200 (issue 13 target: the draft's work per verify <= 25% of the verify
# step at batch 1), Llama-3.1-8B shape with dummy weights and random EAGLE heads built on the fly;
# then losslessness on CUDA with tiny checkpoints (greedy with speculation == without, fp32 exact).
# Run from the repo root on the device with the wheels carried in .whl/ (about 3-4 minutes):
#   bash benchmarks/h200/spec_eagle.sh
# Writes $OUT/spec_eagle.jsonl, $OUT/spec_eagle.txt, $OUT/spec_lossless.json.
# Rows (one target load): EAGLE-3 chain (4 steps), EAGLE-3 tree (topk 4, 4 steps, 16 nodes), EAGLE-2
# chain, and EAGLE-3 chain and tree with the draft eager (for comparison). The target's decode graphs record
# the draft's hidden rows (chain verifies replay them); the draft's steps replay its own graphs.
# Exit status: 1 when the fp32 losslessness check fails.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
{
echo "== [1/2] EAGLE overhead at batch 1 (8B shape, 1024-token prompt, 96 new tokens)"
timeout 200 python3 benchmarks/h200/spec_eagle.py --out $OUT \
  --rows eagle3:1:4:4,eagle3:4:4:16,eagle2:1:4:4,eagle3:1:4:4:eager,eagle3:4:4:16:eager
echo "== [2/2] losslessness on CUDA (tiny checkpoints, graphs on both sides)"
timeout 150 python3 benchmarks/h200/spec_lossless.py --out $OUT
} 2>&1 | grep -v 'it/s\]' | tee $OUT/spec_eagle.txt
status=$?
python3 - <<'PY' | tee -a $OUT/spec_eagle.txt
import json, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "spec_eagle.jsonl"))]
print("layout  topk  draft_graphs  propose_ms  verify_ms  plain_ms  ratio  verify_graph_share  draft_replays")
for r in rows:
    print(f"{r['layout']:7} {r['topk']:4} {str(r['draft_cuda_graph']):>13} {r['propose_ms']:10.2f} {r['verify_step_ms']:10.2f}"
          f" {r['plain_decode_step_ms']:9.2f} {r['propose_over_verify']:6.3f} {r['verify_steps_graph_replayed']:18.2f}"
          f" {r['draft_graph_replays']:14}")
PY
exit $status
