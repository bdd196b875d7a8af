# Session 17, device call 4 (~6 min, carry .whl .gpu2): the extend kernel with one-token requests packed by KV-head
# group (decode rows riding in mixed steps), checked on the GPU, then issue 18's online run at 768- and 1024-token
# chunks with extend CUDA graphs (calls 2-3 of h100-session17.md: ITL p99 30.87 and 33.59 ms before the packing).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s17_call4 $(date +%H:%M:%S)] $*"; }
log "GPU tests: extend graphs; triton extend kernel (packed one-token requests)"
timeout 120 python3 -m pytest -x -q --noconftest -p no:cacheprovider -o addopts="" tests/test_extend_graph_runner.py \
  tests/test_attention_triton.py -k "extend or graph or runner or plan or sizes or fit or refused" 2>&1 | tail -3 | tee $ROOT/tests.txt
source benchmarks/h200/online_8b.sh
online mixed768_graphs_packed scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=768 \
  runtime.cuda_graph_extend_max_tokens=896
online mixed1024_graphs_packed scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=1024 \
  runtime.cuda_graph_extend_max_tokens=1280
find $ROOT -name "*.gz" -delete
log "profile_mixed: extend graphs, packed one-token requests"
timeout 120 python3 benchmarks/h200/profile_mixed.py --out $ROOT --decoding 24 --prompts 512,1024 \
  --extend-graph-tokens 1280 --tag _graphs_packed 2>&1 | grep '^{' | cut -c1-220
log done
