# Session 8, device call 5 (main with every session-8 branch merged): the EAGLE-3 chain draft cost with PDL and tree
# graphs in (issue 13); the TTFT of a single request (plain and uncached grammar) with the batch-1 GEMV paths on
# (default) and off, to place call 4's TTFT rise (issue 15). Carry: .whl .gpu2. ~4.5 min
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
export RS_H200_SETUP_DONE=1
ROOT=$OUT
log() { echo "[s8_call5 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/eagle $ROOT/ttft $ROOT/ttft_gemv_off
log "eagle chain 1:4:4"
timeout 100 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -1 | cut -c1-1800
log "TTFT, defaults"
OUT=$ROOT/ttft SO_ARGS=--skip=throughput,validity timeout 90 bash benchmarks/h200/structured_output_gpu.sh 2>&1 | grep -v Warning | tail -4
log "TTFT, runtime.batch1_gemv=off"
OUT=$ROOT/ttft_gemv_off SERVER_ARGS="runtime.batch1_gemv=off" SO_ARGS=--skip=throughput,validity timeout 90 bash benchmarks/h200/structured_output_gpu.sh 2>&1 | grep -v Warning | tail -4
find $ROOT -name "*.gz" -delete
log done
