# Session 28's first device call (carry .whl .gpu2 .fi): the triton backend's new varlen fresh-prompt path checked on
# CUDA first (if it fails there, this call's copy of the backend turns it off, said in the log, so the runs below
# still measure the rest), then s25_first.sh (an H200: s25_h200a.sh, issue 18's online and batch-1 targets).
set -o pipefail
T0=$(date +%s)
source benchmarks/h200/setup.sh || exit 1
if ! timeout 120 python3 -m pytest -q -x tests/test_attention_triton.py -k "varlen or fresh_prompt" 2>&1 | tail -4; then
  echo "VARLEN CHECK FAILED on CUDA: prefill_varlen off for this call"
  sed -i 's/prefill_varlen: bool = True/prefill_varlen: bool = False/' plugins/attention/triton/radixserve_attention_triton/backend.py
fi
CALL_LEFT=$(( 585 - $(date +%s) + T0 )) bash benchmarks/h200/s25_first.sh
