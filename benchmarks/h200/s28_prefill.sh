# Written in session 28 (carry .whl .gpu2 .fi; ~5 min on a warm machine): the triton backend's fresh prompts as one
# torch varlen flash call a layer (new, `prefill_varlen`) against one SDPA call per prompt (before), checked on CUDA
# against the reference, then one 8192-token prefill chunk of the 8B shape on triton (varlen), triton:per-request
# and FlashInfer, kernel time by kind (session 27 on an H100: attention 17.6 ms per-request, FlashInfer 6.3).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
source benchmarks/h200/flashinfer_setup.sh || echo "flashinfer setup failed: its row will say so"
python3 -c "import torch, inspect; from torch.nn.attention.varlen import varlen_attn; print(torch.__version__, inspect.signature(varlen_attn))"
timeout 200 python3 -m pytest -q -x tests/test_attention_triton.py -k "varlen or fresh or extend_matches" 2>&1 | tail -4
timeout 330 python3 benchmarks/h200/profile_prefill.py --model benchmarks/model-configs/llama-3.1-8b --prompts 8 \
  --input-len 1024 --attention triton,triton:per-request,flashinfer --out $OUT 2>&1 | grep '^{' | cut -c1-1500
