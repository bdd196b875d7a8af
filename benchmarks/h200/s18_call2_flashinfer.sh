# Written in session 17 (~10 min on a cold machine, carry .whl .gpu2 .fi; .fi from `bash benchmarks/h200/flashinfer_pack.sh
# WHEEL`, docs/flashinfer.md): the flashinfer backend's extend CUDA graphs (plugin API 1.10), checked on the CPU only
# in session 17. flashinfer_setup.sh JIT-compiles the kernels and runs the attention conformance kit on CUDA, which
# now also runs every extend step through the backend's extend-graph hooks (FlashInfer's paged prefill wrappers in
# CUDA-graph mode, planned into the static buffers); then issue 18's online run with stack.attention=flashinfer and
# the latency stack's settings (real captures and replays of the extend graphs).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || { echo "flashinfer setup failed"; exit 1; }
ROOT=$OUT
log() { echo "[s18_call2 $(date +%H:%M:%S)] $*"; }
source benchmarks/h200/online_8b.sh
online fi_latency stack.attention=flashinfer scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=768 \
  runtime.cuda_graph_extend_max_tokens=896
grep -h "extend CUDA graph\|capturing extend" $ROOT/fi_latency/server.log | head -3
find $ROOT -name "*.gz" -delete
log done
