# EAGLE draft overhead on the H200 (issue 13 target: the draft's work per verify <= 25% of the verify
# step at batch 1), Llama-3.1-8B shape with dummy weights and a random EAGLE head built on the fly.
# Run from the repo root on the device with the wheels carried in .whl/:
#   bash benchmarks/h200/spec_eagle.sh        (writes $OUT/spec_eagle.jsonl and $OUT/spec_eagle.txt)
# Rows: EAGLE-3 chain (4 steps), EAGLE-3 tree (topk 4, 4 steps, 16 nodes), EAGLE-2 chain.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugins/speculative/eagle > /tmp/pip-eagle.log 2>&1 \
  || { cat /tmp/pip-eagle.log; exit 1; }
{
python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle3 --topk 1 --num-steps 4 --num-draft-tokens 4
python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle3 --topk 4 --num-steps 4 --num-draft-tokens 16
python3 benchmarks/h200/spec_eagle.py --out $OUT --layout eagle2 --topk 1 --num-steps 4 --num-draft-tokens 4
} 2>&1 | grep -v 'it/s\]' | tee $OUT/spec_eagle.txt
