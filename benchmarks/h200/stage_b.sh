# Stage B on the H200: offline throughput and online serving on the Llama-3.1-8B shape; SmolLM2 GPU parity.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts ${NUM_PROMPTS:-1000} \
  --input-len 1024 --output-len 256 --result-file $OUT/offline.jsonl $STACK 2>&1 | grep -v "it/s\]" | tail -5 | cut -c1-3000
(setsid radixserve serve --model $M --tokenizer $T --port 30100 model.load_format=dummy model.context_length=1296 $STACK > $OUT/server.log 2>&1 &)
for i in $(seq 1 120); do curl -sf localhost:30100/health > /dev/null && break; sleep 2; done
radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 --output-len 256 \
  --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | tail -40
pkill -f "port 30100"
if [ -f /tmp/smollm2.gguf.part-a ]; then
  cat /tmp/smollm2.gguf.part-a .gpu2/smollm2.gguf.part-b > /tmp/smollm2.gguf
  echo "sha256 $(sha256sum /tmp/smollm2.gguf)"
  timeout 240 python3 benchmarks/gpu_parity.py --skip-tiny --gguf /tmp/smollm2.gguf 2>&1 | grep -v Warning | grep smollm2 | tee $OUT/parity_smollm2.txt
fi
