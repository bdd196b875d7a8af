# Stage A on the H200: parity (tiny models), kernel tests, one-batch on the Llama-3.1-8B shape, HF peer.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
cp .gpu/smollm2.gguf.part-a /tmp/ 2>/dev/null
M=benchmarks/model-configs/llama-3.1-8b
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
python3 benchmarks/gpu_parity.py 2>&1 | grep -v Warning | tee $OUT/parity.txt
radixserve bench one-batch --model $M --load-format dummy --device cuda --dtype bfloat16 --batch-size 1 8 32 128 \
  --input-len 1024 --output-len 128 --result-file $OUT/one_batch.jsonl model.context_length=2048 stack.attention=triton 2>&1 | grep -v "it/s\]\|tensor/s\]" | tail -20
radixserve bench one-batch --model $M --load-format dummy --device cuda --dtype bfloat16 --batch-size 1 \
  --input-len 1024 --output-len 128 --disable-cuda-graph --result-file $OUT/one_batch.jsonl model.context_length=2048 stack.attention=triton 2>&1 | tail -3
python3 benchmarks/hf_peer.py --config-dir $M --batch-size 1 --input-len 1024 --output-len 128 --result-file $OUT/hf_peer.jsonl 2>&1 | tail -3
python3 benchmarks/hf_peer.py --config-dir $M --batch-size 128 --input-len 1024 --output-len 256 --result-file $OUT/hf_peer.jsonl 2>&1 | tail -3
