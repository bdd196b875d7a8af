# Route fuzz (issue 12) against a real `radixserve serve` on the H200: SmolLM2-135M's shape and
# tokenizer with random weights (model.load_format=dummy: the 98 MB GGUF cannot travel to the device),
# default stack on CUDA (triton attention, CUDA graphs, overlap). 5,000 requests, then the KV-leak check
# (free == total after /flush_cache) and a clean SIGINT exit. Prepare here:
#     python benchmarks/smollm2_hf.py && mkdir -p .gpu/smollm2-shape &&
#     cp .models/smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2-shape/
# Run through the device tool with carry [".whl", ".gpu"]: bash benchmarks/h200/fuzz_real.sh
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugins/attention/cpu_batched > /dev/null 2>&1
radixserve serve --model .gpu/smollm2-shape model.load_format=dummy --port 18500 > $OUT/fuzz-server.log 2>&1 &
pid=$!
for i in $(seq 600); do curl -sf localhost:18500/health > /dev/null && break; sleep 0.5; done
curl -s localhost:18500/health; echo
t0=$(date +%s)
RADIXSERVE_FUZZ_URL=http://127.0.0.1:18500 RADIXSERVE_FUZZ_EXAMPLES=${EXAMPLES:-5000} timeout 420 python3 -m pytest -q -x \
  --noconftest -p no:cacheprovider tests/test_fuzz_routes.py -s 2>&1 | tail -30 | tee $OUT/fuzz.txt
echo "fuzz wall $(( $(date +%s) - t0 )) s" | tee -a $OUT/fuzz.txt
kill -INT $pid; wait $pid; echo "server exit code $?" | tee -a $OUT/fuzz.txt
{ grep -c Traceback $OUT/fuzz-server.log || true; } | sed 's/^/tracebacks in server log: /' | tee -a $OUT/fuzz.txt
