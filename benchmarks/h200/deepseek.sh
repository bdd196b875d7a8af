# DeepSeek on the H200 (issue 17). Carry: .whl .gpu2 (the wheels and the SmolLM2 tokenizer, as the other stages).
# Parts (default all; ~6-8 min):
#   parity   tiny DeepSeek V2-Lite / V2 / V3 checkpoints, our runner vs transformers (top-5 rule): fp32 (the strict
#            check of the GPU paths) and bf16 (informational: on the CPU, transformers' own bf16 run leaves its fp32
#            run after 3 tokens on the V3 case, MoE routing flips on these tiny random models)
#   v2lite   DeepSeek-V2-Lite shape (benchmarks/model-configs/deepseek-v2-lite, dummy bf16): batch-1 decode
#            tok/s (128 in / 512 out) and offline 1000 x 1024/256
# ATTN picks the latent backend (default: the device's default backend). Results in $OUT (summary.txt).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
T=.gpu2/tok-smollm2
PARTS=${PARTS:-"parity v2lite"}
ATTN=${ATTN:-}  # empty: the default backend for the device (stack.attention unset)
A=${ATTN:+stack.attention=$ATTN}
M=benchmarks/model-configs/deepseek-v2-lite
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if has parity; then
  for dt in float32 bfloat16; do
    timeout 300 python3 benchmarks/h200/deepseek_parity.py --dtype $dt ${ATTN:+--attention $ATTN} 2>&1 \
      | grep -E 'SUMMARY|BROKEN|Error' | tee -a $OUT/summary.txt
  done
fi
if has v2lite; then
  B1="runtime.device=cuda runtime.dtype=bfloat16 $A runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
  STACK="runtime.device=cuda runtime.dtype=bfloat16 $A scheduler.max_running_requests=256 runtime.cuda_graph_max_bs=256 scheduler.chunked_prefill_size=8192 scheduler.mem_fraction=0.85"
  timeout 240 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 128 --output-len 512 --vocab-high 30000 --result-file $OUT/v2lite_batch1.jsonl $B1 2>&1 | grep '^{' \
    | cut -c1-300 | tee -a $OUT/summary.txt
  timeout 300 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 30000 --result-file $OUT/v2lite_offline.jsonl $STACK 2>&1 | grep '^{' \
    | cut -c1-400 | tee -a $OUT/summary.txt
fi
