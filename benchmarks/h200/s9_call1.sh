# Session 9, device call 1: bisecting the EAGLE-3 chain regression found in session 8's call 5 (issue 13: one
# chain graph replayed once, then a 92.9 ms eager propose). Whole logs of the chain row with the defaults,
# with PDL off and with the batch-1 GEMV paths off, and a per-kernel profile of the eager draft.
# Not run in session 9: the machine stopped answering while starting and no device was lent after that;
# it is the first call for the next device session. Carry: .whl. ~6 min.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s9_call1 $(date +%H:%M:%S)] $*"; }
run_row() {  # NAME [spec_eagle args]
  local name=$1; shift
  mkdir -p $ROOT/$name
  log "eagle chain 1:4:4 ($name)"
  timeout 110 python3 benchmarks/h200/spec_eagle.py --out $ROOT/$name --rows eagle3:1:4:4 "$@" > $ROOT/$name/log.txt 2>&1
  echo "rc=$?"
  grep -n "EAGLE\|rror\|raceback\|failed" $ROOT/$name/log.txt | grep -v Warning | head -20 | cut -c1-600
  tail -1 $ROOT/$name/log.txt | cut -c1-1500
}
run_row defaults
run_row pdl_off --runtime batch1_gemv_pdl=off
run_row gemv_off --runtime batch1_gemv=off
mkdir -p $ROOT/profile
log "eager draft profile"
timeout 120 python3 benchmarks/h200/eagle_profile.py --out $ROOT/profile --output-len 12 > $ROOT/profile/log.txt 2>&1
echo "rc=$?"; grep -v Warning $ROOT/profile/log.txt | tail -60 | cut -c1-300
find $ROOT -name "*.gz" -delete
log done
