# Session 8, branch tidy: the small-batch MoE kernels' equalities on CUDA after the tidy (shared
# @triton.jit steps in layers/moe/small_m_steps.py, the MoE env switches gone): one launch vs two,
# the fused row sum vs the sum_rows launch (bit for bit), the fused routers vs the unfused path.
# No timing. Needs the tidy branch merged. Run from the repo root after `source benchmarks/h200/setup.sh`:
#   bash benchmarks/h200/tidy_check.sh        (~1 min: Triton compiles; results in $OUT/tidy)
# REF=path/to/tidy_digests.json (from the same script on another tree) also compares every output's digest.
set -o pipefail
log() { echo "[tidy_check.sh $(date +%H:%M:%S)] $*"; }
mkdir -p $OUT/tidy
log "MoE kernel equalities (benchmarks/h200/tidy_check.py)"
timeout 150 python3 benchmarks/h200/tidy_check.py --out $OUT/tidy ${REF:+--ref $REF} 2>&1 | grep -v Warning
rc=$?
log "done (exit $rc)"
exit $rc
