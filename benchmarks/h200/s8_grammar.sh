# Session 8, issue 15 (needs the grammar branch merged): (1) grammar_timeline.py, the in-process
# Scheduler over the real runner (Llama-3.1-8B shape, dummy bf16, graphs, batch 64): ms per decode step
# plain vs constrained, device idle per step, the scheduler thread's phases per step and how long a mask
# fill waited to start (session 8 call 1: 1.15-1.5 ms, the GIL); (2) structured_output_gpu.sh, the server:
# batch-64 tok/s constrained / unconstrained (target >= 0.95), TTFT, validity. Both build the synthetic
# 128,256-token tokenizer in /tmp themselves (nothing carried but .whl). ~5 min.
#     bash benchmarks/h200/s8_grammar.sh        # results: $OUT/timeline/, $OUT/b64/
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
export RS_H200_SETUP_DONE=1
mkdir -p "$OUT/timeline" "$OUT/b64"
echo "== 1/2 grammar_timeline.py (in-process, profiler windows) =="
timeout 300 python3 benchmarks/h200/grammar_timeline.py --steps 128 --out "$OUT/timeline" 2>&1 | tee "$OUT/timeline/grammar_timeline.txt"
echo "== 2/2 structured_output_gpu.sh (server, batch 64) =="
OUT="$OUT/b64" bash benchmarks/h200/structured_output_gpu.sh
