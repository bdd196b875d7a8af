# Session 34's first call (carry .whl .gpu2 .fi; run from a `git archive` copy): an H200 -> s25_h200a.sh (issue 18's
# online and batch-1 targets on both backends); any other card -> the attention kits on CUDA, whose decode-rows phase
# (plugin API 1.17) has run only under the CPU interpreter: FlashInfer's kit and triton's kit tests.
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $CARD"
if echo "$CARD" | grep -q H200; then exec bash benchmarks/h200/s25_h200a.sh; fi
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || echo "flashinfer setup failed: its kit will skip"
echo "[s34 $(left) s left] FlashInfer attention kit on CUDA"
timeout $(( $(left) / 2 )) python3 -m pytest -q -rs tests/test_attention_flashinfer.py 2>&1 | tee $OUT/kit_flashinfer.log | tail -8
echo "[s34 $(left) s left] triton attention kit on CUDA"
timeout $(( $(left) - 3 )) python3 -m pytest -q -rs tests/test_attention_triton.py 2>&1 | tee $OUT/kit_triton.log | tail -8
echo "[s34 $(left) s left] done"
