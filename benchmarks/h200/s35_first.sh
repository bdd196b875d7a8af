# Session 35's first call (carry .whl .gpu2 .fi; run from a `git archive` copy): an H200 -> s25_h200a.sh (issue 18's
# online and batch-1 targets on both backends); any other card -> the three CUDA test files session 34's
# s34_second.sh ran out of time for (quantized Triton GEMMs, MLA triton, the extend-graph runner), each file's
# summary line kept, with the slowest tests listed so the next call can budget them.
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $CARD"
if echo "$CARD" | grep -q H200; then exec bash benchmarks/h200/s25_h200a.sh; fi
source benchmarks/h200/setup.sh || exit 1
export PYTHONUNBUFFERED=1
for f in test_extend_graph_runner test_attention_mla_triton test_quant_triton; do
  budget=$(( $(left) - 10 )); [ $budget -lt 30 ] && { echo "[s35] $f skipped: $budget s left"; continue; }
  echo "[s35 $(left) s left] $f"
  timeout $budget python3 -m pytest -q -rfs --durations=5 tests/$f.py 2>&1 | tee $OUT/$f.log \
    | grep -E "passed|failed|error|FAILED|SKIPPED|s call" | tail -12
done
echo "[s35 $(left) s left] done"
