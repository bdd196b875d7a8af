# Session 8, branch tidy: the small-batch MoE kernels' equalities on CUDA after the tidy (shared
# @triton.jit steps in layers/moe/small_m_steps.py, the MoE env switches gone): one launch vs two,
# the fused row sum vs the sum_rows launch (bit for bit), the fused routers vs the unfused path; then the
# rotary tests on CUDA (the shared triton_rotary.rotate_halves step: rotary bit-equal to torch, the
# attention plugin's rotary + KV store bit-equal to rotary + store). No timing. Needs the tidy branch
# merged. Run from the repo root after `source benchmarks/h200/setup.sh`:
#   bash benchmarks/h200/tidy_check.sh        (~1.5 min: Triton compiles; results in $OUT/tidy)
# REF=path/to/tidy_digests.json (from the same script on another tree) also compares every output's digest.
set -o pipefail
log() { echo "[tidy_check.sh $(date +%H:%M:%S)] $*"; }
mkdir -p $OUT/tidy
log "MoE kernel equalities (benchmarks/h200/tidy_check.py)"
timeout 100 python3 benchmarks/h200/tidy_check.py --out $OUT/tidy ${REF:+--ref $REF} 2>&1 | grep -v Warning
rc=$?
log "rotary tests on CUDA (tests/test_triton_ops.py, tests/test_attention_triton.py -k rotary)"
timeout 80 python3 -m pytest tests/test_triton_ops.py tests/test_attention_triton.py -q -k rotary \
  --noconftest -p no:cacheprovider -o addopts="" 2>&1 | tail -4 | tee $OUT/tidy/rotary_tests.txt
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
log "done (exit $rc)"
exit $rc
