# Sourced by device scripts (after benchmarks/h200/setup.sh, with ROOT and log set): issue 18's online run.
# online NAME [config overrides]: a fresh server on the Llama-3.1-8B shape (dummy weights, stacks/h200-llama.yaml,
# the full-vocabulary tokenizer .gpu2/tok128k), 300 requests at 8 req/s of 1024 prompt ids drawn over the whole
# vocabulary and 256 output tokens (radixserve bench serve), then the server stopped; results in $ROOT/NAME/.
online() {
  local name=$1; shift
  mkdir -p $ROOT/$name
  log "$name: server start ($*)"
  (setsid radixserve serve --model benchmarks/model-configs/llama-3.1-8b --tokenizer .gpu2/tok128k --port 30100 \
    --config stacks/h200-llama.yaml model.load_format=dummy model.context_length=1296 "$@" > $ROOT/$name/server.log 2>&1 &)
  for i in $(seq 1 180); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
  log "$name: ready after ${i}s; 300 requests at 8 req/s"
  timeout 90 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
    --output-len 256 --vocab-high 128000 --result-file $ROOT/$name/online.jsonl 2>&1 \
    | grep -A3 '"ttft_ms"\|"tpot_ms"\|"itl_ms"\|"completed"\|"failed"'
  pkill -f "port 30100"; sleep 2
  grep -i "error\|traceback" $ROOT/$name/server.log | head -5
}
