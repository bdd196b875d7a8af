# Written in session 15 for the next device call (~7 min, carry .whl .gpu2): issue 18's online targets with a decode
# turn between prefill batches of 1024 and 2048 tokens and with decode rows mixed into 1024-token prefill batches
# (session 15's 512-token interleave queued bursts of arrivals: TTFT p99 920 ms; 8192-token batches: ITL p99 57 ms),
# then issue 14's GPU fidelity run with the new default int4 GEMM (splits added inside the kernel).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s15_next $(date +%H:%M:%S)] $*"; }
source benchmarks/h200/online_8b.sh
online online_interleave_1024 scheduler.interleave_decode=true scheduler.chunked_prefill_size=1024
online online_interleave_2048 scheduler.interleave_decode=true scheduler.chunked_prefill_size=2048
online online_mixed_1024 scheduler.enable_mixed_chunk=true scheduler.chunked_prefill_size=1024
find $ROOT -name "*.gz" -delete
log "issue 14: fidelity, 12 prompts together, default kernel configs"
mkdir -p $ROOT/quant
timeout 80 python3 benchmarks/h200/quant_fidelity.py --out $ROOT/quant --prompts 12 2>&1 | grep '^{\|SUMMARY\|rror' | cut -c1-200
log done
