# MoE small-batch path on the H200 (session 5, issue 16). Carry: .whl .gpu2 (wheels, SmolLM2 tokenizer).
#   PARTS="a b" bash benchmarks/h200/s5_moe.sh        (default "a b": ~4-5 min; then "c" and "d" if time allows)
# Parts (each a few minutes, progress lines on stdout, JSON under $OUT, a summary in $OUT/summary.jsonl):
#   a        one MoE layer, old (torch router + grouped GEMM) vs new (fused router + small path) at
#            M=1..32, Qwen3-30B-A3B and Mixtral-8x7B shapes: correctness vs fp32 torch, CUDA-graph replay
#            us per call, fraction of the experts' HBM floor, tile/split sweep (s5_moe_kernels.py, ~1-2 min)
#   b        Qwen3-30B-A3B shape (dummy bf16, triton attention, CUDA graphs): Engine batch-1 decode
#            (128 in / 512 out, as the 121 tok/s of session 3) and the HBM limit measured in the same call
#            (moe_limit.py); AB=1 also runs the old path (RADIXSERVE_MOE_SMALL_M_MAX_PAIRS=0) for an A/B
#   c        = c-ours c-hf: offline 1000 x 1024/256 (ours), and the HF transformers peer (generate, static
#            cache, bf16) on HF_BS (default 32) prompts of 1024/256; the peer's tok/s at batch HF_BS is
#            what 1000 prompts in batches of HF_BS would get (same per-batch time), stated as such
#   d        = d-batch1 d-offline: Mixtral-8x7B shape, batch-1 with its limit, and offline 1000 x 1024/256
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
T=.gpu2/tok-smollm2
PARTS=" ${PARTS:-a b} "
PARTS=${PARTS// c / c-ours c-hf }
PARTS=${PARTS// d / d-batch1 d-offline }
QWEN=benchmarks/model-configs/qwen3-30b-a3b
MIXTRAL=benchmarks/model-configs/mixtral-8x7b
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
has() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
log() { echo "[s5_moe $(date +%H:%M:%S)] $*"; }
last_json() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])[sys.argv[2]])" "$1" "$2"; }
summ() { python3 - "$@" <<'PY'  # summ NAME FILE [KEY...]: the last JSON line of FILE (KEYs only) into summary.jsonl
import json, os, sys
name, path, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
row = json.loads(open(path).readlines()[-1]) if os.path.exists(path) and os.path.getsize(path) else {"missing": path}
row = {k: row.get(k) for k in keys} if keys and "missing" not in row else row
line = json.dumps({"part": name, **row})
print(line)
open(os.path.join(os.environ["OUT"], "summary.jsonl"), "a").write(line + "\n")
PY
}

batch1_and_limit() {  # $1 name, $2 config dir; extra env (e.g. the A/B knob) passed through
  log "$1: Engine batch-1 decode, 128 in / 512 out"
  timeout 240 python3 benchmarks/offline_throughput.py --model $2 --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 128 --output-len 512 --vocab-high 30000 --result-file $OUT/$1_batch1.jsonl $B1 2>&1 \
    | grep -v "it/s\]" | tail -3 | cut -c1-300
  if [ -s $OUT/$1_batch1.jsonl ]; then
    python3 benchmarks/h200/moe_limit.py $2 --measured-tok-s "$(last_json $OUT/$1_batch1.jsonl output_tok_s)" \
      > $OUT/$1_limit.jsonl
    summ $1_batch1 $OUT/$1_limit.jsonl measured_tok_s limit_tok_s fraction_of_limit floor_ms_per_step bytes_per_step
  else
    log "$1: no batch-1 result"
  fi
}
offline() {  # $1 name, $2 config dir, $3 timeout
  log "$1: offline 1000 x 1024/256"
  timeout $3 python3 benchmarks/offline_throughput.py --model $2 --load-format dummy --tokenizer $T --num-prompts 1000 \
    --input-len 1024 --output-len 256 --vocab-high 30000 --result-file $OUT/$1_offline.jsonl $STACK 2>&1 \
    | grep -v "it/s\]" | tail -2 | cut -c1-300
  summ $1_offline $OUT/$1_offline.jsonl total_tok_s output_tok_s seconds
}

if has a; then
  log "a: layer microbench (old vs small path)"
  timeout 300 python3 benchmarks/h200/s5_moe_kernels.py --out $OUT 2>&1 | grep -v Warning
  echo "{\"part\": \"a\", \"exit\": $?}" >> $OUT/summary.jsonl
fi
if has b; then
  batch1_and_limit qwen3 $QWEN
  if [ "${AB:-0}" = 1 ]; then
    RADIXSERVE_MOE_SMALL_M_MAX_PAIRS=0 batch1_and_limit qwen3_oldpath $QWEN
  fi
fi
if has c-ours; then
  offline qwen3 $QWEN 330
fi
if has c-hf; then
  log "c-hf: HF transformers peer, batch ${HF_BS:-32} x 1024/256 (warm-up run + timed run)"
  timeout ${HF_TIMEOUT:-420} python3 benchmarks/hf_peer.py --config-dir $QWEN --batch-size ${HF_BS:-32} \
    --input-len 1024 --output-len 256 --result-file $OUT/qwen3_hf_peer.jsonl 2>&1 | grep '^{' | cut -c1-300
  summ qwen3_hf_peer $OUT/qwen3_hf_peer.jsonl batch_size total_tok_s output_tok_s
  if [ -s $OUT/qwen3_offline.jsonl ] && [ -s $OUT/qwen3_hf_peer.jsonl ]; then
    python3 - <<'PY' | tee -a $OUT/summary.jsonl
import json, os
out = os.environ["OUT"]
ours = json.loads(open(f"{out}/qwen3_offline.jsonl").readlines()[-1])
hf = json.loads(open(f"{out}/qwen3_hf_peer.jsonl").readlines()[-1])
print(json.dumps({"part": "c", "ours_total_tok_s_1000_prompts": ours["total_tok_s"],
                  "hf_total_tok_s_at_batch": hf["total_tok_s"], "hf_batch": hf["batch_size"],
                  "ratio": round(ours["total_tok_s"] / hf["total_tok_s"], 2),
                  "note": "HF measured on one batch of hf_batch prompts; 1000 prompts in such batches run at "
                          "the same tok/s (HF could batch more: the ratio is against this batch size only)"}))
PY
  fi
fi
if has d-batch1; then
  batch1_and_limit mixtral $MIXTRAL
fi
if has d-offline; then
  offline mixtral $MIXTRAL 360
fi
log "done"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
cat $OUT/summary.jsonl 2>/dev/null
