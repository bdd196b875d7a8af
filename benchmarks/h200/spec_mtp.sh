# MTP drafter on the H200 (issue 17): lossless greedy outputs on CUDA (fp32 and bf16, k = 2 and 3) on
# tiny DeepSeek-V3 checkpoints with an MTP layer, and the acceptance of an MTP layer that copies the
# target. Run from the repo root with the wheels carried in .whl/ (as the other stages):
#   bash benchmarks/h200/spec_mtp.sh     (writes $OUT/spec_mtp.json and $OUT/spec_mtp.txt; ~2 min)
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
for p in ./plugins/models/deepseek ./plugins/speculative/mtp; do
  python3 -m pip install -q --no-deps --no-build-isolation -e $p > /tmp/pip-mtp.log 2>&1 || { cat /tmp/pip-mtp.log; exit 1; }
done
timeout 500 python3 benchmarks/h200/spec_mtp.py --out $OUT 2>&1 | grep -v 'it/s\]' | tee $OUT/spec_mtp.txt
