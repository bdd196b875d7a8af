# Session-2 call 4 on the H200 (~5 min): online 300 req at 8 req/s with per-token ITL (usage on every
# completions chunk), default stack and with mixed prefill+decode batches. Carry: .whl .gpu2
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
for extra in "" "scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=1024"; do
  echo "== online, extra overrides: [$extra]"
  (setsid radixserve serve --model $M --tokenizer $T --port 30100 model.load_format=dummy model.context_length=1296 $STACK $extra > $OUT/server.log 2>&1 &)
  for i in $(seq 1 90); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
  timeout 90 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
    --output-len 256 --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | grep -A3 '"ttft_ms"\|"tpot_ms"\|"itl_ms"\|itl_samples\|"completed"'
  pkill -f "port 30100"; sleep 3
done
