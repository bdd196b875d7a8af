# Session 11, device call 1 (~8 min, carry .whl .gpu2): issue 13's EAGLE-3 checks (s9_call1.sh without its
# PDL-off row), then issue 14's decode rows (bf16 / AWQ / GPTQ / FP8 at batch 1 and 32).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s11_call1 $(date +%H:%M:%S)] $*"; }
mkdir -p $ROOT/probes $ROOT/quant
log "probe: a cyclic graph collected during a capture (torch.cuda.graph vs CudaGraph.capture)"
timeout 60 python3 benchmarks/h200/capture_gc_probe.py --out $ROOT/probes 2>&1 | grep -v Warning | tail -4 | cut -c1-700
log "probe: eager draft SDPA widths; fresh-prompt prefill SDPA at new lengths"
timeout 60 python3 benchmarks/h200/draft_sdpa_shapes.py --out $ROOT/probes 2>&1 | grep -v Warning | tail -2 | cut -c1-3000
mkdir -p $ROOT/eagle
log "eagle chain 1:4:4 (graphs, eager)"
timeout 170 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4,eagle3:1:4:4:eager > $ROOT/eagle/log.txt 2>&1
echo "rc=$?"
grep -n "EAGLE\|rror\|raceback\|failed" $ROOT/eagle/log.txt | grep -v Warning | head -20 | cut -c1-600
grep '^{' $ROOT/eagle/log.txt | cut -c1-1500
log "quant: decode batch 1 / 32, all methods"
timeout 200 python3 benchmarks/h200_quant.py --out $ROOT/quant --skip kernels,offline 2>&1 | grep -v Warning | tail -12
find $ROOT -name "*.gz" -delete
log done
