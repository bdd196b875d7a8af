# Session-2 call 5 on a fresh H200 (~3 min): online 300 req at 8 req/s, default h200 stack, to check p99
# TTFT with the runner warm-up (call 4 showed 2.4 s on a fresh machine without it). Carry: .whl .gpu2
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
(setsid radixserve serve --model $M --tokenizer $T --port 30100 --config stacks/h200-llama.yaml model.load_format=dummy model.context_length=1296 > $OUT/server.log 2>&1 &)
for i in $(seq 1 90); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
timeout 90 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
  --output-len 256 --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | grep -A3 '"ttft_ms"\|"tpot_ms"\|"itl_ms"\|itl_samples\|"completed"'
pkill -f "port 30100"; sleep 2
