# Session-3 call 2 (~9 min). Carry: .whl .gpu2
#   bash benchmarks/h200/s3_call2.sh
# 1) TP=1 speed unchanged after tensor parallelism (tp_regression.sh: Engine batch-1 and offline
#    1000 x 1024/256 against the recorded figures, 3%), 2) speculative lossless on CUDA
#    (spec_lossless.py), 3) sliding-window / soft-cap Triton kernels vs torch_native and their time
#    (window_attention.py).
set -o pipefail
F='it/s\]\|tensor/s\]'
timeout 330 bash benchmarks/h200/tp_regression.sh 2>&1 | grep -v "$F" | tail -30
source benchmarks/h200/setup.sh > /dev/null || exit 1
timeout 120 python3 benchmarks/h200/spec_lossless.py --out $OUT 2>&1 | grep -v "$F" | grep '^{\|ALL\|MISMATCH\|Error' | cut -c1-260 | tee $OUT/spec_lossless.txt
timeout 100 python3 benchmarks/h200/window_attention.py 2>&1 | grep -v "$F" | tail -25
