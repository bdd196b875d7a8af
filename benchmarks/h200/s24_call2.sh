# Session 24, call 2 (carry .whl .gpu2; ~9 min): three switches written in session 24, off by default, measured for
# their defaults (issue 16's Qwen3-30B-A3B batch-1 step; session 23: 3.036 ms = 64.1% of the H100 limit):
#   RADIXSERVE_ROTARY_STORE_PDL=1   the rotary + KV store kernel PDL-launched after the qkv GEMV
#   RADIXSERVE_DECODE_MERGE_PDL=1   the decode merge (stage 2) PDL-launched after the split kernel
#   RADIXSERVE_MOE_DOWN_PREFETCH=2  the one-launch experts kernel's down tiles ask L2 for their own and a later
#                                   tile's weights while they wait for their pair's gate_up tiles
# 1. the triton decode tests on CUDA with both decode switches on (bits equal with and without, graphs);
# 2. the expert kernels' checks and tile sweep (down_prefetch 1 / 2 / ahead variants, bit-equal to without);
# 3. the Qwen3 batch-1 profile: neither / decode switches / down prefetch / all / neither again.
# Record of what ran on bfbe021. Since then the two decode switches are on by default and the down prefetch (its
# switch and its sweep rows) is taken out: rerunning this measures the decode switches only.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[s24_call2 $(date +%H:%M:%S)] $*"; }
log "decode tests on CUDA, both new decode switches on"
RADIXSERVE_ROTARY_STORE_PDL=1 RADIXSERVE_DECODE_MERGE_PDL=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_attention_triton.py -k "pdl or rotary or decode_matches or split_count or cuda_graph" > $OUT/tests.log 2>&1
echo "{\"part\": \"tests\", \"exit\": $?}" | tee -a $OUT/summary.jsonl; tail -3 $OUT/tests.log
PARTS="k" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | grep -v '"all"' | cut -c1-400
source benchmarks/h200/qwen_prof.sh
qwen_prof neither RADIXSERVE_ROTARY_STORE_PDL=0 RADIXSERVE_DECODE_MERGE_PDL=0 RADIXSERVE_MOE_DOWN_PREFETCH=0
qwen_prof decode RADIXSERVE_ROTARY_STORE_PDL=1 RADIXSERVE_DECODE_MERGE_PDL=1 RADIXSERVE_MOE_DOWN_PREFETCH=0
qwen_prof prefetch2 RADIXSERVE_ROTARY_STORE_PDL=0 RADIXSERVE_DECODE_MERGE_PDL=0 RADIXSERVE_MOE_DOWN_PREFETCH=2
qwen_prof all RADIXSERVE_ROTARY_STORE_PDL=1 RADIXSERVE_DECODE_MERGE_PDL=1 RADIXSERVE_MOE_DOWN_PREFETCH=2
qwen_prof neither2 RADIXSERVE_ROTARY_STORE_PDL=0 RADIXSERVE_DECODE_MERGE_PDL=0 RADIXSERVE_MOE_DOWN_PREFETCH=0
log done
