# Session 7, device call 6: GPU greedy parity with the fused norm GEMV on by default (issue 18), and the
# EAGLE-3 draft cost with all draft work counted, fused norm on and off (issue 13). Carry: .whl .gpu2. ~5 min
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
ROOT=$OUT
log() { echo "[s7_call6 $(date +%H:%M:%S)] $*"; }
log "gpu parity (tiny Llama / Qwen3, bf16, triton, graphs; runtime defaults incl. batch1_gemv_fuse_norm=true)"
timeout 75 python3 benchmarks/gpu_parity.py --batch1-gemv-all 2>&1 | grep -v Warning | tail -6
mkdir -p $ROOT/eagle $ROOT/eagle/nofuse
log "eagle (fused norm on: the default)"
timeout 95 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -3
log "eagle (fused norm off)"
timeout 95 python3 benchmarks/h200/spec_eagle.py --out $ROOT/eagle/nofuse --runtime batch1_gemv_fuse_norm=false --rows eagle3:1:4:4 2>&1 | grep -v Warning | tail -3
log done
