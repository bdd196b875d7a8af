# Session-3 call 1 (issue 13 + 15 leftovers, issue 18 baseline profile). Carry: .whl
#   bash benchmarks/h200/s3_spec_grammar.sh
# 1) speculative lossless on CUDA (tiny checkpoints; spec_lossless.json), 2) EAGLE draft overhead at
# batch 1 on the 8B shape (spec_eagle.jsonl), 3) xgrammar's CUDA bitmask kernel vs the torch
# reference (grammar_mask_cuda.json), 4) where a batch-1 decode step's time goes (profile_decode).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
F='it/s\]\|tensor/s\]'
timeout 150 python3 benchmarks/h200/spec_lossless.py --out $OUT 2>&1 | grep -v "$F" | tee $OUT/spec_lossless.txt
timeout 240 bash benchmarks/h200/spec_eagle.sh 2>&1 | grep -v "$F" | tail -15
timeout 60 python3 benchmarks/grammar_mask_cuda.py 2>&1 | tail -8
timeout 120 python3 benchmarks/h200/profile_decode.py --out $OUT 2>&1 | grep -v "$F" | tail -40 | tee $OUT/profile_decode.txt
