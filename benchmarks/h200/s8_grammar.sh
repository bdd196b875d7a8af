# Session 8, issue 15 (needs the grammar branch merged). (1) structured_output_gpu.sh, the server:
# batch-64 tok/s constrained / unconstrained (target >= 0.95; each round now also prints the scheduler's
# ms/step; the server log names any GC pause > 5 ms), TTFT, validity; (2) grammar_timeline.py, the
# in-process Scheduler over the real runner: ms per decode step plain vs constrained, device idle, host
# phases per step, mask-fill start delay. Both build the synthetic 128,256-token tokenizer in /tmp (only
# .whl is carried). ~3 min.
#     bash benchmarks/h200/s8_grammar.sh        # results: $OUT/b64/, $OUT/timeline/
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
export RS_H200_SETUP_DONE=1
mkdir -p "$OUT/timeline" "$OUT/b64"
echo "== 1/2 structured_output_gpu.sh (server, batch 64) =="
OUT="$OUT/b64" bash benchmarks/h200/structured_output_gpu.sh
grep -i "garbage collection" "$OUT/b64/so-server.log" | tail -20
echo "== 2/2 grammar_timeline.py (in-process, profiler windows) =="
timeout 120 python3 benchmarks/h200/grammar_timeline.py --kinds "${KINDS:-plain,constrained}" --out "$OUT/timeline" 2>&1 \
  | tee "$OUT/timeline/grammar_timeline.txt"
