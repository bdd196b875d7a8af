# Session 29's first device call (carry .whl .gpu2 .fi). An H200: s25_h200a.sh (issue 18's online and batch-1
# targets on triton and FlashInfer; never run on an H200 since session 23), then s25_h200b.sh in the next call.
# Any other card: the attention kit's new scenarios (strided q/k/v views, key positions past 64/128/256) on CUDA
# for triton and FlashInfer, then one decode step at 320 rows x 1100 context on both backends by kernel kind
# (profile_decode_rows.py: where triton's offline decode loses ~1.8 ms a step to FlashInfer's on an H100), the
# triton split kernel with and without its new work list (decode_work_list).
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }  # CALL_LEFT: seconds this call may run
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  CALL_LEFT=${CALL_LEFT:-585} bash benchmarks/h200/s25_h200a.sh
  exit
fi
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || echo "flashinfer setup failed: its rows will say so"
echo "[s29 $(left) s left] decode step at 320 rows"
timeout $(( $(left) < 300 ? $(left) : 300 )) python3 benchmarks/h200/profile_decode_rows.py --rows 320 --context 1100 \
  --attention triton,triton:work-list,flashinfer --out $OUT 2>&1 | grep '^{' | cut -c1-2500
echo "[s29 $(left) s left] triton kit (tree verify, strided views, long scenario)"
timeout $(( $(left) - 100 )) python3 -m pytest -q -x -s tests/test_attention_triton.py -k "tree_mask_verify or kit_checks_the_extend_graph or work_list" \
  2>&1 | grep -v "^  scenario" | tail -6
echo "[s29 $(left) s left] flashinfer kit 32/8/128 bf16"
timeout $(( $(left) - 5 )) python3 benchmarks/h200/flashinfer_device.py kit 32 8 128 bfloat16 2>&1 | tail -4
echo "[s29 $(left) s left] done"
