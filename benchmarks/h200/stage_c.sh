# Session-2 call 1 on the H200 (~8 min): fused-kernel check, GPU parity incl. overlap, batch-1 decode profile,
# one-batch, and Engine batch-1 decode with and without overlap. Carry: .whl .gpu .gpu2
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
cp .gpu/smollm2.gguf.part-a /tmp/  # the SmolLM2 GGUF is over one call's carry limit: part b comes next call
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
timeout 120 python3 benchmarks/fused_kernels.py --out $OUT/fused_kernels.json 2>&1 | tail -30
timeout 100 python3 benchmarks/gpu_parity.py 2>&1 | grep -v "Warning\|it/s\]" | tee $OUT/parity.txt
timeout 150 python3 benchmarks/h200/profile_decode.py --out $OUT 2>&1 | grep -v "Warning" | tail -45
timeout 100 radixserve bench one-batch --model $M --load-format dummy --device cuda --dtype bfloat16 --batch-size 1 64 \
  --input-len 1024 --output-len 128 --result-file $OUT/one_batch.jsonl model.context_length=2048 stack.attention=triton \
  runtime.cuda_graph_max_bs=64 2>&1 | grep -v "it/s\]\|tensor/s\]" | tail -4
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
for ov in true false; do
  timeout 100 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine.jsonl $B1 runtime.overlap=$ov 2>&1 | grep -v "it/s\]" | tail -2 | cut -c1-600
done
