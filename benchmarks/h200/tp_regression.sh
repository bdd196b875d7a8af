# TP=1 speed regression check after the tensor-parallel change (issue 19), one H200, ~5 min.
# Re-runs the batch-1 and offline commands of benchmarks/results/h200-llama-3.1-8b.md ("Current
# figures", session-2 call 3 = benchmarks/h200/stage_e.sh, same flags) at runtime.tp_size=1 (the
# default) and compares with the recorded figures: Engine batch-1 200.6 output tok/s
# (h200-2026-12-02-s2/call3-batch1_engine.jsonl), offline 1000 x 1024/256 28,747.5 total tok/s
# (call3-offline.jsonl). Pass: each within 3% (or faster). Carry: .whl .gpu2 (as stage_e.sh).
# Writes $OUT/batch1_engine.jsonl, $OUT/offline.jsonl, $OUT/tp_regression.json; exit 1 on a regression.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
timeout 100 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
  --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine.jsonl $B1 2>&1 | grep '^{' | cut -c1-300
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
  --input-len 1024 --output-len 256 --result-file $OUT/offline.jsonl $STACK 2>&1 | grep '^{' | cut -c1-300
python3 - <<'PY'
import json, os, sys
out = os.environ["OUT"]
checks = [  # (result file, field, recorded figure)
    ("batch1_engine.jsonl", "output_tok_s", 200.6),
    ("offline.jsonl", "total_tok_s", 28747.5),
]
report, ok = [], True
for name, field, recorded in checks:
    try:
        with open(os.path.join(out, name)) as f:
            measured = float(json.loads(f.read().strip().splitlines()[-1])[field])
    except (OSError, ValueError, KeyError, IndexError) as e:
        report.append({"run": name, "error": repr(e)})
        ok = False
        continue
    ratio = measured / recorded
    passed = ratio >= 0.97
    ok &= passed
    report.append({"run": name, "field": field, "recorded": recorded, "measured": measured,
                   "ratio": round(ratio, 4), "within_3pct": passed})
json.dump({"passed": ok, "checks": report}, open(os.path.join(out, "tp_regression.json"), "w"), indent=1)
print(json.dumps({"passed": ok, "checks": report}, indent=1))
sys.exit(0 if ok else 1)
PY
