# Session 34's second call (carry .whl .gpu2 .fi; run from a `git archive` copy): an H200 -> s25_h200a.sh (issue 18's
# online and batch-1 targets on both backends); any other card -> the CUDA test files not run on CUDA since session 30
# (MLA, fp8 KV, quantized Triton GEMMs, the layer kernels, the extend-graph runner), each file's summary line kept.
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $CARD"
if echo "$CARD" | grep -q H200; then exec bash benchmarks/h200/s25_h200a.sh; fi
source benchmarks/h200/setup.sh || exit 1
export PYTHONUNBUFFERED=1
for f in test_triton_ops test_triton_argmax test_triton_gemv test_norm_gemv test_attention_triton_fp8 test_quant_triton \
         test_attention_mla_triton test_extend_graph_runner; do
  budget=$(( $(left) - 10 )); [ $budget -lt 30 ] && { echo "[s34b] $f skipped: $budget s left"; continue; }
  echo "[s34b $(left) s left] $f"
  timeout $budget python3 -m pytest -q -rfs tests/$f.py 2>&1 | tee $OUT/$f.log | grep -E "passed|failed|error|FAILED|SKIPPED" | tail -6
done
echo "[s34b $(left) s left] done"
