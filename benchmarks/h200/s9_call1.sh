# Session 9/10, device call 1: the EAGLE-3 chain regression of session 8's call 5 (issue 13: one chain
# graph replayed once, a failed capture, then a 92.9 ms eager propose). Session 10 read it from the code
# and the CPU (benchmarks/results/h200-speculative.md, "Session 10 (no GPU)"): (1) the capture most
# likely failed because a dropped drafter's CUDA graphs, held in a reference cycle, were destroyed by
# Python's GC inside the new drafter's capture (CudaGraph.capture now keeps the GC off while capturing);
# (2) the eager draft gave cuDNN's SDPA a new KV width every propose, one plan build each (the eager
# widths are now padded to 256 columns). This call checks both on the device, then runs the chain row
# (graphs and eager) and the PDL A/B with their whole logs.
# Not run in session 9 or 10 (no device lent): the first call of the next device session. Carry: .whl. ~5 min.
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s9_call1 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/probes
log "probe: a cyclic graph collected during a capture (torch.cuda.graph vs CudaGraph.capture)"
timeout 60 python3 benchmarks/h200/capture_gc_probe.py --out $ROOT/probes 2>&1 | grep -v Warning | tail -4 | cut -c1-700
log "probe: eager draft SDPA, new widths vs padded vs cuDNN excluded; fresh-prompt prefill SDPA at new lengths (issue 18 TTFT)"
timeout 60 python3 benchmarks/h200/draft_sdpa_shapes.py --out $ROOT/probes 2>&1 | grep -v Warning | tail -2 | cut -c1-3000
run_row() {  # NAME [spec_eagle args]
  local name=$1; shift
  mkdir -p $ROOT/$name
  log "eagle chain 1:4:4 ($name)"
  timeout 150 python3 benchmarks/h200/spec_eagle.py --out $ROOT/$name "$@" > $ROOT/$name/log.txt 2>&1
  echo "rc=$?"
  grep -n "EAGLE\|rror\|raceback\|failed" $ROOT/$name/log.txt | grep -v Warning | head -20 | cut -c1-600
  grep '^{' $ROOT/$name/log.txt | cut -c1-1500
}
# graphs (expect draft_graph_capture_failed false, propose ~1.2-1.4 ms as in session 7) and the eager
# draft (expect ~5 ms, session 5's eager 5.75 ms; session 8's 92.9 ms had exact widths)
run_row defaults --rows eagle3:1:4:4,eagle3:1:4:4:eager
run_row pdl_off --rows eagle3:1:4:4 --runtime batch1_gemv_pdl=off
find $ROOT -name "*.gz" -delete
log done
