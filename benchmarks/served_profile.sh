#!/usr/bin/env bash
# Where a served step's time goes (issue 12's served-throughput target), on this CPU: our server on
# SmolLM2-135M-Instruct (fp32) under the same client and workload as served_vs_vllm.sh, with
#  - the scheduler's own split of its busy time (forward vs host work) and its batch counts, from
#    /server_info stats before and after the timed run (idle = wall time minus busy steps);
#  - CPU seconds and thread counts of every server process and of the client (/proc/<pid>/stat);
#  - the load average (the machine may be shared: compare A/B runs made in the same minutes).
#     N=32 benchmarks/served_profile.sh [extra `radixserve serve` args, e.g. --set runtime.num_threads=2]
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=.models/smollm2-135m-instruct
VLLM=benchmarks/.peers/vllm-venv/bin/python
N=${N:-32}; IN=${IN:-200}; OUTLEN=${OUTLEN:-128}; CONC=${CONC:-16}; PORT=${PORT:-18621}
TMP=$(mktemp -d)
TICK=$(getconf CLK_TCK)

setsid .venv/bin/radixserve serve --model "$MODEL" --port "$PORT" "$@" > "$TMP/server.log" 2>&1 & SP=$!
t0=$SECONDS
for _ in $(seq 2400); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SP" 2> /dev/null || { tail -30 "$TMP/server.log"; exit 1; }
  sleep 0.5
done
echo "== ready after $((SECONDS - t0)) s, load $(cut -d' ' -f1-3 /proc/loadavg)"

NAME=$(curl -s "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

cpu() {  # label: pid threads cpu seconds (utime+stime) of the server and its children (own sessions)
  for p in "$SP" $(pgrep -P "$SP"); do
    [ -r "/proc/$p/stat" ] || continue
    awk -v l="$1" -v t="$TICK" -v th="$(ls "/proc/$p/task" | wc -l)" -v a="$(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-70)" \
      '{sub(/^.*\) /, ""); printf "%s %s threads=%d cpu_s=%.2f  %s\n", l, '"$p"', th, ($12 + $13) / t, a}' "/proc/$p/stat"
  done
}
stats() { curl -s "http://127.0.0.1:$PORT/server_info" > "$TMP/$1.json"; }

client() {  # seed, num_prompts
  "$VLLM" -c 'import sys; from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))' --backend openai \
    --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model "$NAME" --tokenizer "$MODEL" \
    --dataset-name random --random-input-len "$IN" --random-output-len "$OUTLEN" --ignore-eos \
    --num-prompts "$2" --max-concurrency "$CONC" --seed "$1" 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|Duration|Successful"
}

client 1 16 > /dev/null  # warm-up, other prompts
cpu before > "$TMP/cpu_before"; stats before
echo "== timed run: N=$N, load $(cut -d' ' -f1-3 /proc/loadavg)"
w0=$(date +%s.%N)
client 0 "$N" & CP=$!
# the client's own CPU time (it shares the cores): sample it while it runs
while kill -0 "$CP" 2> /dev/null; do
  for p in $(pgrep -P "$CP") $CP; do awk -v t="$TICK" '{sub(/^.*\) /, ""); print ($12 + $13 + $14 + $15) / t}' "/proc/$p/stat" 2> /dev/null; done \
    | sort -n | tail -1 > "$TMP/client_cpu.tmp" && mv "$TMP/client_cpu.tmp" "$TMP/client_cpu"
  sleep 1
done
wait "$CP"
w1=$(date +%s.%N)
cpu after > "$TMP/cpu_after"; stats after
echo "== done, load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP" "$w0" "$w1" <<'PY'
import json, sys
tmp, w0, w1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
wall = w1 - w0
b, a = (json.load(open(f"{tmp}/{k}.json"))["stats"] for k in ("before", "after"))
d = {k: a[k] - b[k] for k in a if isinstance(a[k], (int, float)) and not isinstance(a[k], bool) and k in b}
steps, busy, fwd = d.get("steps", 0), d.get("step_seconds", 0.0), d.get("forward_seconds", 0.0)
print(f"wall {wall:.1f} s; scheduler busy {busy:.1f} s ({busy / wall:.0%}) in {steps} steps "
      f"({1000 * busy / max(steps, 1):.1f} ms/step): forward {fwd:.1f} s, host {busy - fwd:.1f} s; idle {wall - busy:.1f} s (includes the client's start-up, ~15 s CPU)")
print("batches: prefill {prefill_batches} decode {decode_batches} mixed {mixed_batches}; prefill tokens {prefill_tokens_computed}, "
      "generated {generated_tokens}".format(**{k: d.get(k, 0) for k in
      ("prefill_batches", "decode_batches", "mixed_batches", "prefill_tokens_computed", "generated_tokens")}))
before = {l.split()[1]: l for l in open(f"{tmp}/cpu_before")}
for line in open(f"{tmp}/cpu_after"):
    f = line.split()
    pid, threads, cpu_s = f[1], f[2], float(f[3].split("=")[1])
    cpu0 = float(before[pid].split()[3].split("=")[1]) if pid in before else 0.0
    print(f"pid {pid} {threads} cpu {cpu_s - cpu0:6.1f} s ({(cpu_s - cpu0) / wall:.2f} cores)  {' '.join(f[4:])[:60]}")
try:
    print(f"client (vllm bench serve) cpu {float(open(f'{tmp}/client_cpu').read()):.1f} s (whole life, incl. start-up)")
except (OSError, ValueError):
    pass
PY
kill -INT -- -"$SP"; wait "$SP"
rm -rf "$TMP"
