# Stage B on the H200 (one call, ~8 minutes): GPU parity on tiny checkpoints, one-batch with CUDA graphs,
# offline throughput (1000 x 1024/256) and online serving (300 requests at 8 req/s) on the Llama-3.1-8B shape.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
[ -z "$SKIP_EARLY" ] && timeout 60 python3 benchmarks/gpu_parity.py 2>&1 | grep -v "Warning\|it/s\]" | tee $OUT/parity.txt
[ -z "$SKIP_EARLY" ] && timeout 90 radixserve bench one-batch --model $M --load-format dummy --device cuda --dtype bfloat16 --batch-size 1 64 \
  --input-len 1024 --output-len 128 --result-file $OUT/one_batch.jsonl model.context_length=2048 stack.attention=triton \
  2>&1 | grep -v "it/s\]\|tensor/s\]" | tail -6
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
timeout ${OFFLINE_TIMEOUT:-140} python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts ${NUM_PROMPTS:-1000} \
  --input-len 1024 --output-len 256 --result-file $OUT/offline.jsonl $STACK 2>&1 | grep -v "it/s\]" | tail -4 | cut -c1-2500
(setsid radixserve serve --model $M --tokenizer $T --port 30100 model.load_format=dummy model.context_length=1296 $STACK > $OUT/server.log 2>&1 &)
for i in $(seq 1 60); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
timeout 80 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
  --output-len 256 --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | tail -32
pkill -f "port 30100"
tail -5 $OUT/server.log
