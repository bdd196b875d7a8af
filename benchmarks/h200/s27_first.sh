# Session 27's first device call (carry .whl .gpu2 .fi): on an H200, issue 18's online and batch-1 runs
# (s25_h200a.sh, never yet run: no H200 was lent in sessions 24-26); on any other card the decode PDL table
# (s26_pdl_table.sh, ~4 min; s26_prefill.sh is the next call).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/h200/s25_h200a.sh
else
  bash benchmarks/h200/s26_pdl_table.sh
fi
