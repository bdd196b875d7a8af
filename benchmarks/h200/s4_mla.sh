# Session-4 MLA call on the H200 (issue 17), ~10 min. Carry: .whl .gpu2 (wheels; .gpu2/tok-102400 is
# a synthetic tokenizer covering DeepSeek-V2-Lite's 102,400 ids: benchmarks/h200/full_vocab_tokenizer.py).
# Parts (default all): kernels parity batch1 offline hf
#   kernels  mla_triton vs the decompressed torch_native path: parity (bf16) and decode time at bs 1/64 x ctx 1k/8k
#   parity   tiny DeepSeek-V2/V3 checkpoints: the Engine on CUDA bf16 with mla_triton vs transformers (top-5 rule)
#   batch1   DeepSeek-V2-Lite shape (dummy bf16), Engine batch-1 decode with the HBM limit of the bytes a step reads
#   offline  the same shape, 1000 x 1024/256; the latent pool's tokens per GB vs an uncompressed pool of the model
#   hf       HF transformers on the same shape (generate, static cache), the offline peer
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
T=.gpu2/tok-102400
M=benchmarks/model-configs/deepseek-v2-lite
PARTS=${PARTS:-"kernels parity batch1 offline hf"}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
tok_s() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['output_tok_s'])" "$1"; }
if has kernels; then
  timeout 240 python3 benchmarks/h200/mla_kernels.py 2>&1 | grep -v Warning | tail -30
fi
if has parity; then
  timeout 240 python3 benchmarks/gpu_parity.py --deepseek --attention mla_triton 2>&1 | grep SUMMARY | tee $OUT/parity.txt
fi
if has batch1; then
  B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=mla_triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
  timeout 240 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 128 --output-len 512 --vocab-high 100000 --result-file $OUT/v2lite_batch1.jsonl $B1 2>&1 | grep '^{' | cut -c1-300
  [ -s $OUT/v2lite_batch1.jsonl ] && python3 benchmarks/h200/moe_limit.py $M --measured-tok-s "$(tok_s $OUT/v2lite_batch1.jsonl)" \
    | tee $OUT/v2lite_limit.jsonl | tee -a $OUT/summary.txt
fi
if has offline; then
  STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=mla_triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
  timeout 330 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 100000 --result-file $OUT/v2lite_offline.jsonl $STACK 2>&1 | grep '^{' \
    | python3 -c "import json,sys; [print(json.dumps({k: v for k, v in json.loads(l).items() if k != 'config'})) for l in sys.stdin]" \
    | tee -a $OUT/summary.txt
  python3 benchmarks/h200/latent_pool_ratio.py $M --offline-result $OUT/v2lite_offline.jsonl | tee -a $OUT/summary.txt
fi
if has hf; then
  timeout 300 python3 benchmarks/hf_peer.py --config-dir $M --batch-size 64 --input-len 1024 --output-len 256 \
    --result-file $OUT/v2lite_hf_peer.jsonl 2>&1 | grep '^{' | tee -a $OUT/summary.txt
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $OUT/summary.txt
