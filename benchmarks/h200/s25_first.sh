# Session 25's first device call (carry .whl .gpu2 .fi): on an H200, issue 18's online and batch-1 runs
# (s25_h200a.sh: its targets are stated for the H200, last lent in session 23); on any other card, issue 16's
# Qwen3 profile and the Llama A/B of session 24's decode switches (s25_call1.sh).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/h200/s25_h200a.sh
else
  bash benchmarks/h200/s25_call1.sh
fi
