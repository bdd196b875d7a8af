# Session-3 last call (~9 min). Carry: .whl .gpu2
#   bash benchmarks/h200/s3_call4.sh
# 1) native families beyond Llama against transformers on the GPU (gpu_parity.py --families, bf16,
#    triton, CUDA graphs), 2) the transformers fallback's batch-1 decode against the native plugin
#    (fallback_cost.sh PART=decode), 3) structured output at batch 64 (structured_output_gpu.sh).
set -o pipefail
F='it/s\]\|tensor/s\]'
source benchmarks/h200/setup.sh > $OUT/setup.txt || { cat $OUT/setup.txt; exit 1; }
timeout 150 python3 benchmarks/gpu_parity.py --families 2>&1 | grep -v "$F" | tee $OUT/parity_families.txt | grep "SUMMARY\|Error\|BROKEN" | cut -c1-250
PART=decode timeout 240 bash benchmarks/h200/fallback_cost.sh 2>&1 | grep -v "$F" | tail -22
timeout 330 bash benchmarks/h200/structured_output_gpu.sh 2>&1 | grep -v "$F" | tail -25
