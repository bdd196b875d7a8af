# EAGLE draft overhead on the H200 (issue 13 target: the draft's work per verify <= 25% of the verify
# step at batch 1), Llama-3.1-8B shape with dummy weights and a random EAGLE head built on the fly;
# then losslessness on CUDA with tiny checkpoints (greedy with speculation == without, fp32 exact).
# Run from the repo root on the device with the wheels carried in .whl/ (about 3-4 minutes):
#   bash benchmarks/h200/spec_eagle.sh
# Writes $OUT/spec_eagle.jsonl, $OUT/spec_eagle.txt, $OUT/spec_lossless.json.
# Rows: EAGLE-3 chain (4 steps), EAGLE-3 tree (topk 4, 4 steps, 16 nodes), EAGLE-2 chain; the target's
# decode graphs record the draft's hidden rows (chain verifies replay them), the draft's steps replay
# its own graphs. Exit status: 1 when the fp32 losslessness check fails.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
{
echo "== [1/4] EAGLE-3 chain"
timeout 80 python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle3 --topk 1 --num-steps 4 --num-draft-tokens 4
echo "== [2/4] EAGLE-3 tree"
timeout 80 python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle3 --topk 4 --num-steps 4 --num-draft-tokens 16
echo "== [3/4] EAGLE-2 chain"
timeout 80 python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle2 --topk 1 --num-steps 4 --num-draft-tokens 4
echo "== [4/4] losslessness on CUDA (tiny checkpoints, graphs on both sides)"
timeout 120 python3 benchmarks/h200/spec_lossless.py --out $OUT
} 2>&1 | grep -v 'it/s\]' | tee $OUT/spec_eagle.txt
status=$?
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "spec_eagle.jsonl"))]
print("layout  topk  propose_ms  verify_ms  plain_ms  ratio  verify_graph  draft_replays")
for r in rows:
    print(f"{r['layout']:7} {r['topk']:4} {r['propose_ms']:10.2f} {r['verify_step_ms']:10.2f} {r['plain_decode_step_ms']:9.2f}"
          f" {r['propose_over_verify']:6.3f} {r['verify_steps_graph_replayed']:12.2f} {r['draft_graph_replays']:14}")
PY
exit $status
