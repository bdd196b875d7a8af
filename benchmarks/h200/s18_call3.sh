# Session 18, device call 3 (~6 min on a cold machine, carry .whl .gpu2 .fi): is the extend CUDA graph safe beyond
# the dense Llama (a sparse MoE, int4 AWQ and fp8 block-quantized linears, real CUDA graphs: the four models of
# tests/test_extend_graph_runner.py), and issue 18's batch-1 and offline figures with stack.attention=flashinfer
# beside triton on the same machine (the online run with flashinfer was call 2).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s18_call3 $(date +%H:%M:%S)] $*"; }
log "GPU tests: extend graphs on Llama, Qwen3-MoE, AWQ g64, fp8 block"
timeout 200 python3 -m pytest -q --noconftest -p no:cacheprovider -o addopts="" tests/test_extend_graph_runner.py 2>&1 \
  | tail -15 | tee $ROOT/tests.txt
source benchmarks/h200/flashinfer_setup.sh || { echo "flashinfer setup failed"; exit 1; }
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok128k
STACK="runtime.device=cuda runtime.dtype=bfloat16 scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"  # stacks/h200-llama.yaml
for attn in flashinfer triton; do
  log "Engine batch-1 1024/512, $attn"
  timeout 90 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 1024 --output-len 512 --result-file $ROOT/batch1_$attn.jsonl runtime.device=cuda \
    runtime.dtype=bfloat16 stack.attention=$attn runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8 \
    2>&1 | grep '^{' | cut -c1-300
done
for attn in flashinfer triton; do
  log "offline 1000 x 1024/256, $attn"
  timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 128000 --result-file $ROOT/offline_$attn.jsonl $STACK \
    stack.attention=$attn 2>&1 | grep '^{' | cut -c1-300
done
log done
