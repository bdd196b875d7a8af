# Session 11, device call 4 (~3 min, carry .whl .gpu2): issue 14's fidelity on the GPU again after the GPTQ g_idx
# loader fix (call 2b: loading a GPTQ act-order checkpoint on CUDA failed in torch.equal, CPU vs CUDA tensor), then
# issue 18's online run with a decode step between any two prefill batches (scheduler.interleave_decode; call 2b:
# ITL p99 56.8 ms, about two back-to-back 1024-token prefills plus a decode step).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call4 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/quant
M=benchmarks/model-configs/llama-3.1-8b
log "fidelity: tiny quantized checkpoints vs their dequantized weights, CUDA bf16, low-bit GEMVs off and on"
timeout 110 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-300
online() {  # NAME [config overrides]: a fresh server, 300 requests at 8 req/s, the server stopped
  local name=$1; shift
  mkdir -p $ROOT/$name
  log "$name: server start ($*)"
  (setsid radixserve serve --model $M --tokenizer .gpu2/tok128k --port 30100 --config stacks/h200-llama.yaml \
    model.load_format=dummy model.context_length=1296 "$@" > $ROOT/$name/server.log 2>&1 &)
  for i in $(seq 1 90); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
  log "$name: ready after ${i}s; 300 requests at 8 req/s"
  timeout 80 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
    --output-len 256 --vocab-high 128000 --result-file $ROOT/$name/online.jsonl 2>&1 \
    | grep -A3 '"ttft_ms"\|"tpot_ms"\|"itl_ms"\|"completed"\|"failed"'
  pkill -f "port 30100"; sleep 2
}
# a decode step after every prefill batch (scheduler.interleave_decode) of at most 512 tokens: a decode waits for
# at most ~half a prompt's prefill
online online_interleave_512 scheduler.interleave_decode=true scheduler.chunked_prefill_size=512
find $ROOT -name "*.gz" -delete
log done
