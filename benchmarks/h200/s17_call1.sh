# Session 17, first device call (~8 min, carry .whl): the extend CUDA graphs (runtime.cuda_graph_extend_max_tokens)
# on the GPU: the triton attention tests (the extend kernel now reads a work table) and the extend-graph runner's
# tests with real graphs, then profile_mixed.py's mixed step (24 decode rows + a 512 / 1024-token prompt) eager
# (with cProfile's host breakdown) and replayed from extend graphs.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s17_call1 $(date +%H:%M:%S)] $*"; }
log "GPU tests: extend graphs with real CUDA graphs; triton attention (extend work tables)"
timeout 240 python3 -m pytest -x -q --noconftest -p no:cacheprovider -o addopts="" tests/test_extend_graph_runner.py \
  tests/test_attention_triton.py -k "extend or tree or window or graph or runner or plan or sizes or fit or refused" 2>&1 | tail -4 | tee $ROOT/tests.txt
log "profile_mixed: eager"
timeout 200 python3 benchmarks/h200/profile_mixed.py --out $ROOT --decoding 24 --prompts 512,1024 --tag _eager 2>&1 \
  | grep -v "^    host" | tail -60
log "profile_mixed: extend graphs up to 1280 tokens"
timeout 200 python3 benchmarks/h200/profile_mixed.py --out $ROOT --decoding 24 --prompts 512,1024 \
  --extend-graph-tokens 1280 --tag _graphs 2>&1 | grep -v "^    host\|^    py" | tail -40
log done
