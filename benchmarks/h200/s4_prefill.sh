# Session-4 call 1 on the H200 (~9 min): issue 18's offline gap. The triton backend's fresh-prompt
# prefill through PyTorch's flash SDPA vs its own extend kernel, and mixed prefill+decode batches.
#   1. the HBM limit; extend kernel vs SDPA vs the backend's SDPA path (attention_kernels --quick)
#   2. the triton test file's extend cases on CUDA (both paths against the fp32 reference)
#   3. offline 1000 x 1024/256 (Llama-3.1-8B shape, dummy bf16): default (SDPA path), mixed chunks,
#      and the kernel-only prefill (the installed file's default flipped with sed: A/B of one switch)
# Carry: .whl .gpu2
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
timeout 170 python3 benchmarks/attention_kernels.py --quick --out $OUT/attention_kernels.md 2>&1 | grep -i "extend\|sdpa\||" | tail -25
timeout 120 python3 -m pytest tests/test_attention_triton.py -q -k "extend" --noconftest -p no:cacheprovider -o addopts="" 2>&1 | tail -3 | tee $OUT/tests.txt
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
offline() {  # $1 label, rest: extra overrides
  local label=$1; shift
  timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 30000 --result-file $OUT/offline_$label.jsonl $STACK "$@" 2>&1 | grep '^{' \
    | python3 -c "import json,sys; [print(json.dumps({'label': '$label', **{k: v for k, v in json.loads(l).items() if k not in ('config',)}})) for l in sys.stdin]" \
    | tee -a $OUT/summary.txt
}
offline sdpa
offline sdpa_mixed scheduler.enable_mixed_chunk=true
sed -i 's/prefill_sdpa: bool = True/prefill_sdpa: bool = False/' plugins/attention/triton/radixserve_attention_triton/backend.py
grep -c "prefill_sdpa: bool = False" plugins/attention/triton/radixserve_attention_triton/backend.py | sed 's/^/kernel-only default flipped: /' | tee -a $OUT/summary.txt
offline kernel_only
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $OUT/summary.txt
