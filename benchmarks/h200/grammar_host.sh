# Issue 15, the host side of constrained decoding at batch 64 on the H200's host CPU (no GPU work):
# benchmarks/grammar_step_cpu.py drives the real scheduler (overlap on) and xgrammar with a fake
# runner, the synthetic 128,256-token tokenizer of structured_output_gpu.sh and its schema (64 rows,
# every step at full batch), plain vs constrained (the mask filled beside the previous step's
# processing, and after it); prints the scheduler's host work per step and its
# pieces (process, accept, fill, bitmask buffer). ~1-2 min. Carry: .whl
#     bash benchmarks/h200/grammar_host.sh        # results: $OUT/grammar_host.{json,txt}
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
echo "host cores: $(nproc)"
timeout 200 python3 benchmarks/grammar_step_cpu.py --tokenizer synthetic --workload long --batch 64 --steps 96 \
  --repeats 3 --no-apply --fill-beside on,off --out $OUT/grammar_host.json 2>&1 | tee $OUT/grammar_host.txt
