# Qwen3-30B-A3B batch-1 decode on the H200 (session 6, issue 16). Carry: .whl .gpu2 (wheels, SmolLM2 tokenizer).
#   PARTS="g b p" bash benchmarks/h200/s6_qwen.sh    (default "g b p": ~2.5 min; "s" ~30 s more; "c" ~6 min more)
# Parts (progress lines on stdout, JSON under $OUT, a summary in $OUT/summary.jsonl):
#   g   greedy parity with transformers on the GPU (bf16, triton attention, CUDA graphs): tiny Llama and Qwen3
#       (q/k norms in the rotary + KV-store kernel); FAMILIES=1 adds the families (Qwen2/3-MoE, Gemma 3, ...)
#   s   qwen3_shapes.py: the attention projections on cuBLAS vs the Triton GEMV tiles, the router 2 vs 1 launch
#   b   Engine batch-1 decode, 128 in / 512 out (dummy bf16, triton attention, CUDA graphs) and the HBM
#       limit measured in the same call (moe_limit.py): the issue's >= 70% target
#   p   qwen3moe_profile.py --quick: the one-launch router / fused expert sum checked on the GPU, graph replay
#       time and its kernels, the scheduler loop's host time per step and graph use (PROFILE_ARGS= for the
#       full profile with eager kernels and the no-overlap run)
#   (session 6's AB=1 run with the one-launch MoE router and the fused expert sum off went with their
#   environment switches in session 8; qwen3moe_profile.py still checks both fusions against the unfused path)
#   c   offline 1000 x 1024/256 (ours) and the HF transformers peer (s5_moe.sh PARTS=c)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
PARTS=" ${PARTS:-g b p} "
has() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
log() { echo "[s6_qwen $(date +%H:%M:%S)] $*"; }
QWEN=benchmarks/model-configs/qwen3-30b-a3b
T=.gpu2/tok-smollm2
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
last_json() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])[sys.argv[2]])" "$1" "$2"; }

if has g; then
  log "g: GPU parity (tiny Llama / Qwen3, then the families incl. Qwen2/3-MoE)"
  timeout 100 python3 benchmarks/gpu_parity.py 2>&1 | grep -v Warning | tail -6
  echo "{\"part\": \"g-tiny\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
  if [ "${FAMILIES:-0}" = 1 ]; then
    timeout 150 python3 benchmarks/gpu_parity.py --families 2>&1 | grep -v Warning | tail -12
    echo "{\"part\": \"g-families\", \"exit\": $?}" | tee -a $OUT/summary.jsonl
  fi
fi
if has b; then
  log "b: Engine batch-1 decode, 128 in / 512 out"
  timeout 240 python3 benchmarks/offline_throughput.py --model $QWEN --load-format dummy --tokenizer $T --num-prompts 1 \
    --input-len 128 --output-len 512 --vocab-high 30000 --result-file $OUT/qwen3_batch1.jsonl $B1 2>&1 \
    | grep -v "it/s\]" | tail -3 | cut -c1-300
  if [ -s $OUT/qwen3_batch1.jsonl ]; then
    python3 benchmarks/h200/moe_limit.py $QWEN --measured-tok-s "$(last_json $OUT/qwen3_batch1.jsonl output_tok_s)" \
      | tee $OUT/qwen3_limit.jsonl | tee -a $OUT/summary.jsonl
  else
    log "b: no batch-1 result"
  fi
fi
if has p; then
  log "p: per-kernel profile of the batch-1 step"
  timeout 150 python3 benchmarks/h200/qwen3moe_profile.py --out $OUT ${PROFILE_ARGS---quick} 2>&1 | grep -v Warning
  python3 - <<'PY' | tee -a $OUT/summary.jsonl
import json, os
p = os.path.join(os.environ["OUT"], "qwen3moe_profile.json")
row = json.load(open(p)) if os.path.exists(p) else {}
print(json.dumps({"part": "p", **{k: row.get(k) for k in ("static_sync_step_ms", "graph_replay_ms",
                 "graph_kernels_ms_per_step", "sched_overlap", "fused_gate_check")}}))
PY
fi
if has s; then
  log "s: Qwen3 projection shapes, cuBLAS vs the Triton GEMV tiles; the router, two launches vs one"
  timeout 90 python3 benchmarks/h200/qwen3_shapes.py --out $OUT 2>&1 | grep -v Warning | tail -8
fi
if has c; then
  log "c: offline 1000 x 1024/256 and the HF peer (s5_moe.sh)"
  PARTS=c bash benchmarks/h200/s5_moe.sh 2>&1 | grep -v "^\[s5_moe.*setup" | tail -12
fi
log "done"
cat $OUT/summary.jsonl 2>/dev/null
