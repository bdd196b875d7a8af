# Session 29's call for less than a whole call's device time (carry .whl .gpu2 .fi; any card): the 320-row decode
# step by kernel kind on triton, triton with the split kernel's work list, and FlashInfer (profile_decode_rows.py),
# then the work-list tests on CUDA with what is left. CALL_LEFT: seconds this call may run; ATTN: the backends.
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${CALL_LEFT:-585} - $(date +%s) + T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
source benchmarks/h200/setup.sh || exit 1
ATTN=${ATTN:-triton,triton:work-list,flashinfer}  # the backends to profile, in order
case $ATTN in *flashinfer*) source benchmarks/h200/flashinfer_setup.sh || echo "flashinfer setup failed: its row will say so";; esac
echo "[s29 $(left) s left] decode step at 320 rows"
timeout $(( $(left) - 40 )) python3 benchmarks/h200/profile_decode_rows.py --rows 320 --context 1100 \
  --attention $ATTN --out $OUT 2>&1 | grep '^{' | cut -c1-2500
echo "[s29 $(left) s left] work-list tests on CUDA"
timeout $(( $(left) - 3 )) python3 -m pytest -q -x tests/test_attention_triton.py -k "work_list or batch_one_keeps" 2>&1 | tail -3
echo "[s29 $(left) s left] done"
