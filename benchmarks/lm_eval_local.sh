#!/usr/bin/env bash
# lm-evaluation-harness against our server, checked against lm-eval's own `hf` backend on the same
# checkpoint (results/cpu-lm-eval.md), on the local tasks in benchmarks/lm_eval_task/ (no download).
# Loglikelihood tasks through /v1/completions `echo: true` + `logprobs` (prompt logprobs):
#   rs_local_mc     multiple_choice, 40 questions x 4 choices: acc, acc_norm
#   rs_local_greedy loglikelihood of the right answer: perplexity, acc (= is_greedy, from top_logprobs)
#   rs_local_ppl    loglikelihood_rolling over 7 documents, one split into 2 windows: word_perplexity ...
# Generation (generate_until, greedy, stop strings "\n\n" and "Q:", at most 48 tokens):
#   rs_local_gen    32 short prompts: exact_match, and every generated string compared with hf's,
#                   twice: local-completions (/v1/completions) vs hf, and local-chat-completions
#                   (/v1/chat/completions) with --apply_chat_template vs hf with --apply_chat_template.
#                   Identical, except where the two sides part at a greedy choice between two tokens
#                   whose logits are within 1e-4 (a tie in float noise: checked with transformers and
#                   printed); no text may still hold a stop string.
#
# usage: benchmarks/lm_eval_local.sh VENV [OUT_DIR]
#   VENV     lm-eval's virtual environment, created (lm_eval[api], torch 2.13.0 CPU, transformers,
#            accelerate) when it does not exist; the project's .venv is left alone
#   OUT_DIR  lm-eval's outputs (default /tmp/lmeval-out): server/, server-chat/, hf/ and hf-chat/ with
#            --log_samples files
# env: MODEL (default .models/smollm2-135m-instruct), PORT (18750), MAX_LENGTH (768: the hf backend's
#   window; local-completions gets MAX_LENGTH+2, as it keeps one token for generation and one for
#   context), DIAG_IGNORE_EOS=1 also runs local-completions with `ignore_eos: true` added to its
#   requests (a diagnostic: see results/cpu-lm-eval.md)
# Prints both metric tables and the per-sample comparison; exits 1 when they disagree.
set -euo pipefail

VENV=${1:?usage: $0 VENV [OUT_DIR]}
OUT=${2:-/tmp/lmeval-out}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=$(cd "$ROOT" && realpath "${MODEL:-.models/smollm2-135m-instruct}")
PORT=${PORT:-18750}
MAX_LENGTH=${MAX_LENGTH:-768}
LL_TASKS=(rs_local_mc rs_local_greedy rs_local_ppl)
GEN_TASKS=(rs_local_gen)
PY=$VENV/bin/python

if [ ! -x "$VENV/bin/lm_eval" ]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
    # torch first and pinned: an unpinned one pulls a multi-GB CUDA build
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q "lm_eval[api]" torch==2.13.0 transformers accelerate  # accelerate: the hf backend
fi

rm -rf "$OUT"/server "$OUT"/server-ignore-eos "$OUT"/server-chat "$OUT"/hf "$OUT"/hf-chat "$OUT"/tasks  # this script's outputs only
mkdir -p "$OUT"
# the task YAMLs name their data files by absolute path under /work/main: point them at this checkout
cp -r "$ROOT/benchmarks/lm_eval_task" "$OUT/tasks"
sed -i "s#/work/main/benchmarks/lm_eval_task#$ROOT/benchmarks/lm_eval_task#" "$OUT"/tasks/*.yaml

SERVER_PID=
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    local children
    children=$(ps -o pid= --ppid "$SERVER_PID" || true)  # its children run in their own sessions
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    for c in $children; do kill -KILL "$c" 2>/dev/null || true; done
    SERVER_PID=
}
trap stop_server EXIT

echo "== starting the server (log: $OUT/server.log)"
cd "$ROOT"
setsid .venv/bin/radixserve serve --model "$MODEL" --port "$PORT" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
for i in $(seq 300); do
    curl -sf "localhost:$PORT/health" >/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT/server.log"; echo "server died"; exit 1; }
    [ "$i" = 300 ] && { echo "server not ready after 300 s"; exit 1; }
    sleep 1
done
SERVED=$(curl -sf "localhost:$PORT/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "served model id: $SERVED"

API_ARGS="model=$SERVED,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=$((MAX_LENGTH + 2))"
# chat: lm-eval sends the messages (--apply_chat_template builds them); the server renders the template
CHAT_ARGS="model=$SERVED,base_url=http://127.0.0.1:$PORT/v1/chat/completions,num_concurrent=1,max_retries=1"
COMMON=(--include_path "$OUT/tasks" --log_samples)

timed() {  # timed NAME CMD...: runs CMD, output to $OUT/NAME.log, wall seconds to $OUT/NAME.wall
    local name=$1 t0 rc=0
    shift
    echo "== $name: $*"
    t0=$(date +%s.%N)
    "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' >"$OUT/$name.wall"
    echo "   exit $rc, wall $(cat "$OUT/$name.wall") s"
    [ "$rc" = 0 ] || { tail -30 "$OUT/$name.log"; exit 1; }
}

timed server "$VENV/bin/lm_eval" run --model local-completions --model_args "$API_ARGS" "${COMMON[@]}" \
    --tasks "${LL_TASKS[@]}" "${GEN_TASKS[@]}" --output_path "$OUT/server"
timed server-chat "$VENV/bin/lm_eval" run --model local-chat-completions --model_args "$CHAT_ARGS" --apply_chat_template \
    "${COMMON[@]}" --tasks "${GEN_TASKS[@]}" --output_path "$OUT/server-chat"

if [ "${DIAG_IGNORE_EOS:-0}" = 1 ]; then
    cat >"$OUT/lmeval_ignore_eos.py" <<'EOF'
# lm-eval's local-completions with `ignore_eos: true` on its loglikelihood requests (our extension)
import sys
from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

@register_model("local-completions-ignore-eos")
class IgnoreEos(LocalCompletionsAPI):
    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kw):
        body = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos, **kw)
        if not generate:
            body["ignore_eos"] = True
        return body

from lm_eval.__main__ import cli_evaluate
sys.exit(cli_evaluate())
EOF
    timed server-ignore-eos "$PY" "$OUT/lmeval_ignore_eos.py" run --model local-completions-ignore-eos --model_args "$API_ARGS" \
        "${COMMON[@]}" --tasks "${LL_TASKS[@]}" --output_path "$OUT/server-ignore-eos"
fi

stop_server
echo "== server stopped"

HF_ARGS="pretrained=$MODEL,dtype=float32,max_length=$MAX_LENGTH"
timed hf "$VENV/bin/lm_eval" run --model hf --model_args "$HF_ARGS" --device cpu "${COMMON[@]}" \
    --tasks "${LL_TASKS[@]}" "${GEN_TASKS[@]}" --output_path "$OUT/hf"
timed hf-chat "$VENV/bin/lm_eval" run --model hf --model_args "$HF_ARGS" --device cpu --apply_chat_template \
    "${COMMON[@]}" --tasks "${GEN_TASKS[@]}" --output_path "$OUT/hf-chat"

for name in server server-ignore-eos server-chat hf hf-chat; do
    [ -f "$OUT/$name.log" ] || continue
    echo
    echo "== $name ($(cat "$OUT/$name.wall") s)"
    grep '^|' "$OUT/$name.log"
done

echo
"$PY" - "$OUT" "$MODEL" "${LL_TASKS[*]}" "${GEN_TASKS[*]}" <<'EOF'
import functools, glob, json, sys

out, model = sys.argv[1], sys.argv[2]
LL_TASKS, GEN_TASKS = sys.argv[3].split(), sys.argv[4].split()
TIE = 1e-4  # two tokens whose logits are this close: either greedy choice is right (fp32 noise)


def run(name):
    d = {}
    for t in LL_TASKS + GEN_TASKS:
        files = glob.glob(f"{out}/{name}/*/samples_{t}_*.jsonl")
        d[t] = {json.loads(l)["doc_id"]: json.loads(l) for l in open(sorted(files)[-1])} if files else None
    res = sorted(glob.glob(f"{out}/{name}/*/results_*.json"))
    d["results"] = json.load(open(res[-1]))["results"] if res else None
    return d


def compare(a, b, label):
    ok = True
    print(f"-- {label}")
    for t in LL_TASKS:
        for m, va in a["results"][t].items():
            if "," not in m or "stderr" in m:
                continue
            vb = b["results"][t][m]
            # acc / acc_norm must be identical; the perplexities agree to 1e-4 relative (fp32, batching differs)
            same = va == vb if m.startswith("acc") else abs(va - vb) <= 1e-4 * abs(vb)
            ok &= same
            print(f"   {t:16s} {m.split(',')[0]:16s} server {va:<20.10g} hf {vb:<20.10g} {'same' if same else 'DIFFERENT'}")
    n = over = greedy_diff = 0
    for t in LL_TASKS:
        sa, sb = a[t], b[t]
        worst, worst_at, diffs = 0.0, None, []
        for k in sa:
            for i, (x, y) in enumerate(zip(sa[k]["resps"], sb[k]["resps"])):
                xr, yr = (x[0], y[0]) if isinstance(x[0], list) else (x, y)
                lla, llb = float(xr[0]), float(yr[0])
                d = abs(lla - llb)
                diffs.append(d)
                over += d > max(1e-3, 1e-6 * abs(llb))  # 1e-3, or 1e-6 relative for a long document's sum
                if len(xr) > 1 and xr[1] != yr[1]:
                    greedy_diff += 1
                if d > worst:
                    worst, worst_at = d, f"doc {k} request {i}: server {lla:.6f} hf {llb:.6f}"
        n += len(diffs)
        under = [d for d in diffs if d <= 1e-3]
        print(f"   {t:16s} {len(diffs):3d} loglikelihoods, max |diff| {worst:.3g} ({worst_at}); "
              f"{len(diffs) - len(under)} over 1e-3, max |diff| of the rest {max(under, default=0):.3g}")
    ok &= over == 0 and greedy_diff == 0
    print(f"   {n} compared: {over} over tolerance; is_greedy differs in {greedy_diff}")
    return ok


def gen_args(sample):
    """(context, gen_kwargs) of a generate_until sample, as lm-eval logged them."""
    a = sample["arguments"]
    a = a["gen_args_0"] if isinstance(a, dict) else a[0]
    return (a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a)


@functools.cache
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def parting(prompt, x, y):
    """Where two greedy generations of `prompt` part: (token index, logit of x's token minus y's
    there), from transformers; None when one text is a prefix of the other (they ended apart)."""
    import torch

    tok, lm = hf_model()
    tx, ty = (tok(s, add_special_tokens=False).input_ids for s in (x, y))
    i = next((i for i, (u, v) in enumerate(zip(tx, ty)) if u != v), None)
    if i is None:
        return None
    with torch.no_grad():
        logits = lm(torch.tensor([tok(prompt, add_special_tokens=False).input_ids + tx[:i]])).logits[0, -1]
    return i, float(logits[tx[i]] - logits[ty[i]])


def compare_gen(a, b, label):
    """Generated strings, sample by sample (b is hf: its logged context is the exact prompt text)."""
    ok, same, total, ties = True, 0, 0, 0
    print(f"-- {label}")
    for t in GEN_TASKS:
        for m, va in a["results"][t].items():
            if "," in m and "stderr" not in m:
                vb = b["results"][t][m]
                ok &= va == vb
                print(f"   {t:16s} {m:22s} server {va:<12.6g} hf {vb:<12.6g} {'same' if va == vb else 'DIFFERENT'}")
        cut_wrong, notes = 0, []
        for k, sb in sorted(b[t].items()):
            sa = a[t][k]
            prompt, kwargs = gen_args(sb)
            x, y = sa["resps"][0][0], sb["resps"][0][0]
            for side, text in (("server", x), ("hf", y)):
                if any(u in text for u in kwargs.get("until", [])):  # must be cut before the first stop string
                    cut_wrong += 1
                    notes.append(f"doc {k}: {side}'s text still holds a stop string: {text!r}")
            total += 1
            if x == y and sa["filtered_resps"] == sb["filtered_resps"]:
                same += 1
                continue
            apart = parting(prompt, x, y)
            if apart is None:
                ok = False
                notes.append(f"doc {k}: they end apart (EOS, stop string or max_gen_toks): server {x!r} hf {y!r}")
                continue
            i, d = apart
            tie = abs(d) <= TIE
            ok &= tie
            ties += tie
            notes.append(f"doc {k}: they part at generated token {i}, logit(server's) - logit(hf's) = {d:.3g}, "
                         f"{'a tie within float noise' if tie else 'NOT a tie'}: server {x!r} hf {y!r}")
        ok &= cut_wrong == 0
        print(f"   {t:16s} {same} of {len(b[t])} generations identical; stop strings left in the text: {cut_wrong}")
        for note in notes:
            print(f"     {note}")
    return ok, f"{same}/{total} identical" + (f" ({ties} tie(s) in float noise)" if ties else "")


hf = run("hf")
ll_ok = compare(run("server"), hf, "local-completions vs hf")
if glob.glob(f"{out}/server-ignore-eos/*"):
    compare(run("server-ignore-eos"), hf, "local-completions + ignore_eos (diagnostic) vs hf")
gen_ok, gen_said = compare_gen(run("server"), hf, "generation: local-completions vs hf")
chat_ok, chat_said = compare_gen(run("server-chat"), run("hf-chat"),
                                 "generation: local-chat-completions vs hf, both with --apply_chat_template")
verdict = ll_ok and gen_ok and chat_ok
print("RESULT:", "MATCH" if verdict else "MISMATCH",
      f"(loglikelihood: {'match' if ll_ok else 'MISMATCH'}; generations: completions {gen_said}, chat {chat_said})")
sys.exit(0 if verdict else 1)
EOF
