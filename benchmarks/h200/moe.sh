# MoE on the H200 (issue 16). Carry: .whl .gpu2 (the wheels and the SmolLM2 tokenizer, as the other stages).
# Parts (default all; the whole run is ~12-15 min, so split it over two calls, e.g.
#   PARTS="kernel qwen3 qwen3-hf" bash benchmarks/h200/moe.sh   then   PARTS=mixtral bash benchmarks/h200/moe.sh):
#   kernel    fused-MoE Triton kernel vs the torch reference at Qwen3-30B-A3B / Mixtral shapes (+ its time)
#   qwen3     Qwen3-30B-A3B shape (dummy bf16): Engine batch-1 decode with the HBM limit of the bytes a step
#             reads, and offline 1000 x 1024/256
#   qwen3-hf  HF transformers on the same shape, batch 128 x 1024/256 (the offline peer, same machine)
#   mixtral   Mixtral-8x7B shape: batch-1 with its limit, and offline 1000 x 1024/256
# Everything lands in $OUT (one .jsonl per measurement, summary.txt).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
T=.gpu2/tok-smollm2
PARTS=${PARTS:-"kernel qwen3 qwen3-hf mixtral"}
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
tok_s() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['output_tok_s'])" "$1"; }

batch1_and_limit() {  # $1 name, $2 config dir, $3 vocab-high
  timeout 240 python3 benchmarks/offline_throughput.py --model $2 --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 128 --output-len 512 --vocab-high $3 --result-file $OUT/$1_batch1.jsonl $B1 2>&1 | grep '^{' | cut -c1-300
  [ -s $OUT/$1_batch1.jsonl ] && python3 benchmarks/h200/moe_limit.py $2 --measured-tok-s "$(tok_s $OUT/$1_batch1.jsonl)" \
    | tee $OUT/$1_limit.jsonl | tee -a $OUT/summary.txt
}
offline() {  # $1 name, $2 config dir, $3 vocab-high, $4 timeout
  timeout $4 python3 benchmarks/offline_throughput.py --model $2 --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high $3 --result-file $OUT/$1_offline.jsonl $STACK 2>&1 | grep '^{' \
    | python3 -c "import json,sys; [print(json.dumps({k: v for k, v in json.loads(l).items() if k not in ('config', 'stats')})) for l in sys.stdin]" \
    | tee -a $OUT/summary.txt
}

if has kernel; then
  timeout 240 python3 benchmarks/h200/moe_kernel_check.py --result-file $OUT/kernel.jsonl 2>&1 | grep -v Warning | tee -a $OUT/summary.txt
  echo "kernel check exit $?" | tee -a $OUT/summary.txt
fi
if has qwen3; then
  M=benchmarks/model-configs/qwen3-30b-a3b
  batch1_and_limit qwen3 $M 30000
  offline qwen3 $M 30000 330
fi
if has qwen3-hf; then
  timeout 420 python3 benchmarks/hf_peer.py --config-dir benchmarks/model-configs/qwen3-30b-a3b --batch-size 128 \
    --input-len 1024 --output-len 256 --result-file $OUT/qwen3_hf_peer.jsonl 2>&1 | grep '^{' | tee -a $OUT/summary.txt
fi
if has mixtral; then
  M=benchmarks/model-configs/mixtral-8x7b
  batch1_and_limit mixtral $M 30000
  offline mixtral $M 30000 360
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $OUT/summary.txt
