# Session 35's later calls (carry .whl .gpu2 .fi; run from a `git archive` copy): an H200 -> s25_h200a.sh (issue 18's
# online and batch-1 targets on both backends, ~9 min), to be followed by s25_h200b.sh on the warm machine; any other
# card -> nothing (every CUDA test file has passed on an H100 by session 35; the targets left are stated for the H200).
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $CARD"
if echo "$CARD" | grep -q H200; then exec bash benchmarks/h200/s25_h200a.sh; fi
echo "not an H200: nothing to run"
