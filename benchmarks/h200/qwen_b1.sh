# Qwen3-30B-A3B batch-1 experts on the H200: one launch vs two (session 7, issue 16). Carry: .whl .gpu2.
#   bash benchmarks/h200/qwen_b1.sh            (PARTS="g k b" default, ~4 min; PARTS=p: the quick profile alone, < 2 min)
# Parts (progress lines on stdout, JSON under $OUT, a summary in $OUT/summary.jsonl):
#   g   qwen_b1_parity.py: GPU greedy parity of tiny Qwen2-MoE / Qwen3-MoE with transformers, prompts alone
#       (batch-1 decode: the small MoE path with the post-attention norm inside the router's launch)
#   k   qwen_b1_kernels.py: the experts at 1/2/4/8 tokens, two launches vs one (bit-equality, fp32 error,
#       graph replay = eager, determinism), per-call graph-replay times, the HBM floor, tile variants at
#       1 token ($OUT/qwen_b1_choice.json: the fastest; the defaults are session 7's: one launch at <= 2 tokens)
#   b   Engine batch-1 decode, 128 in / 512 out (dummy bf16, triton attention, CUDA graphs), the defaults, and
#       the HBM limit measured in the same call (moe_limit.py; its fraction from the decode-only tok/s)
#   p   qwen3moe_profile.py --quick (graph replay ms and its kernels per step)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
PARTS=" ${PARTS:-g k b} "
has() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
log() { echo "[qwen_b1 $(date +%H:%M:%S)] $*"; }
QWEN=benchmarks/model-configs/qwen3-30b-a3b
T=.gpu2/tok-smollm2
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
# the decode-only rate of the last run (the limit is a decode step's bytes; output_tok_s also counts the first token)
decode_tok_s() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['decode']['decode_tok_s'])" "$1"; }

if has g; then
  log "g: GPU parity, tiny Qwen2-MoE / Qwen3-MoE, batch-1 decode"
  timeout 100 python3 benchmarks/h200/qwen_b1_parity.py 2>&1 | grep -v Warning | grep "SUMMARY\|parity\|Error\|error" | tail -8
  echo "{\"part\": \"g\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
fi
if has k; then
  log "k: expert kernels, two launches vs one"
  timeout 150 python3 benchmarks/h200/qwen_b1_kernels.py --out $OUT 2>&1 | grep -v Warning | tail -40
  echo "{\"part\": \"k\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
fi
if has b; then
  log "b: Engine batch-1 decode, 128 in / 512 out"
  timeout 200 python3 benchmarks/offline_throughput.py --model $QWEN \
    --load-format dummy --tokenizer $T --num-prompts 1 --input-len 128 --output-len 512 --vocab-high 30000 \
    --result-file $OUT/qwen3_batch1.jsonl $B1 2>&1 | grep -v "it/s\]" | tail -3 | cut -c1-300
  if [ -s $OUT/qwen3_batch1.jsonl ]; then
    python3 benchmarks/h200/moe_limit.py $QWEN --measured-tok-s "$(decode_tok_s $OUT/qwen3_batch1.jsonl)" \
      | tee $OUT/qwen3_limit.jsonl | tee -a $OUT/summary.jsonl
  else
    log "b: no batch-1 result"
  fi
fi
if has p; then
  log "p: quick profile of the batch-1 step"
  timeout 150 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT --quick \
    2>&1 | grep -v Warning | tail -30
fi
log "done"
cat $OUT/summary.jsonl 2>/dev/null
