# Session 22's first device call (carry .whl .gpu2 .fi; ~8 min once the machine is up). On an H200 (issue 18's
# targets are stated for it): s19_call2.sh (online latency stack with triton and FlashInfer, then batch-1 and
# offline with both). On an H100 (what the tool lent in sessions 16-21): the CUDA run of
# tests/test_attention_triton.py to its end (session 21 stopped at ~87%), then issue 16's Qwen3-30B-A3B quick
# profile of a batch-1 step (the baseline for this session's kernel work).
set -o pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"
case "$gpu" in
  *H200*) bash benchmarks/h200/s19_call2.sh ;;
  *)
    source benchmarks/h200/setup.sh || exit 1
    echo "[s22_call1 $(date +%H:%M:%S)] tests/test_attention_triton.py on CUDA"
    timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention_triton.py 2>&1 | tail -15
    echo "{\"part\": \"triton-tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
    PARTS="p" bash benchmarks/h200/qwen_b1.sh
    ;;
esac
