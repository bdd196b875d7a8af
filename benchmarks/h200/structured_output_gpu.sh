# Structured output on the H200 (issue 15): batch-64 decode tok/s with a JSON-schema constraint on
# every request vs none (target: within 5%), on the Llama-3.1-8B shape with dummy bf16 weights and a
# synthetic 128,256-token byte-level tokenizer (built here: no hub access), default xgrammar backend,
# overlap scheduling on (the CUDA default; the log says how many constrained decode batches were
# launched ahead); TTFT with an uncached grammar vs none (target: within 50 ms); plus the validity of
# 64 bounded constrained outputs. ~4 min. Carry: .whl
#     bash benchmarks/h200/structured_output_gpu.sh        # results: $OUT/structured_output_gpu.{json,txt}
#     SO_ARGS=--skip=throughput,validity bash benchmarks/h200/structured_output_gpu.sh   # the TTFT part only (~1 min)
#     SERVER_ARGS="runtime.batch1_gemv=off" ...   # extra config overrides for the server (an A/B)
set -o pipefail
[ -n "$RS_H200_SETUP_DONE" ] || { source benchmarks/h200/setup.sh || exit 1; }  # set by a wrapper that already ran it
M=benchmarks/model-configs/llama-3.1-8b
T=/tmp/tok128k
PORT=30200
python3 benchmarks/h200/structured_output_gpu.py --make-tokenizer $T || exit 1
(setsid radixserve serve --model $M --tokenizer $T --port $PORT --config stacks/h200-llama.yaml model.load_format=dummy \
  model.context_length=2048 $SERVER_ARGS > $OUT/so-server.log 2>&1 &)
for i in $(seq 1 240); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
curl -sf localhost:$PORT/health > /dev/null || { echo "the server did not come up"; tail -40 $OUT/so-server.log; exit 1; }
timeout 420 python3 benchmarks/h200/structured_output_gpu.py --base-url http://127.0.0.1:$PORT --out $OUT $SO_ARGS 2>&1 \
  | tee $OUT/structured_output_gpu.txt
pkill -INT -f "port $PORT"; sleep 3
{ grep -c Traceback $OUT/so-server.log || true; } | sed 's/^/tracebacks in server log: /' | tee -a $OUT/structured_output_gpu.txt
