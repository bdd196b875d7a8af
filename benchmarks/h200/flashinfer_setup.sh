# Source on the H200 from the repo root, after benchmarks/h200/setup.sh (carry: .fi, made here by
# benchmarks/h200/flashinfer_pack.sh). Unpacks the trimmed FlashInfer and the apache-tvm-ffi wheel
# into build/flashinfer-site (git-ignored `build/`, kept on a warm machine; re-unpacked only when
# the archive changes), points FlashInfer's JIT workspace at build/flashinfer-jit (compiled kernels
# survive between calls on a warm machine) and JIT-compiles what the plugin uses unless
# FI_SKIP_JIT=1 (flashinfer_jit_warm below: four parallel builds, progress every 20 s, timed).
FI_SITE=$PWD/build/flashinfer-site
FI_STAMP=$(cat .fi/*.whl .fi/flashinfer-trim.tar.xz | md5sum | cut -c1-12)
if [ ! -f "$FI_SITE/.stamp-$FI_STAMP" ]; then
  t0=$(date +%s)
  rm -rf "$FI_SITE" && mkdir -p "$FI_SITE"
  tar -xJf .fi/flashinfer-trim.tar.xz -C "$FI_SITE" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$FI_SITE" .fi/apache_tvm_ffi-*.whl || return 1
  touch "$FI_SITE/.stamp-$FI_STAMP"
  echo "flashinfer: unpacked in $(( $(date +%s) - t0 ))s: $(du -sh "$FI_SITE" | cut -f1)"
else
  echo "flashinfer: already unpacked (warm machine)"
fi
export PYTHONPATH=$FI_SITE:$PYTHONPATH
export FLASHINFER_WORKSPACE_BASE=$PWD/build/flashinfer-jit  # JIT cache: $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer
export FLASHINFER_DISABLE_VERSION_CHECK=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # H200 only: one gencode per kernel
export MAX_JOBS=${MAX_JOBS:-6}  # ninja jobs per build; up to four builds run at once on the 16 cores
export FLASHINFER_NVCC_THREADS=${FLASHINFER_NVCC_THREADS:-2}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
python3 -c "import flashinfer.prefill, flashinfer.decode, flashinfer; print('flashinfer', flashinfer.__version__, 'imports OK')" || return 1
# JIT-compile (or load from the cache) every module the plugin uses, in parallel processes (one per
# kernel family; FlashInfer's file locks keep two builds of one module apart); each part also runs
# the attention conformance kit on CUDA against exact attention (fi_kit.jsonl under $OUT).
flashinfer_jit_warm() {
  local t0=$(date +%s) pids=() rc=0
  mkdir -p "${OUT:-/tmp}"
  local kit="timeout ${FI_JIT_TIMEOUT:-480} python3 benchmarks/h200/flashinfer_device.py kit"
  # 8B shape, bf16 head_dim 128: fa3 ragged/paged prefill (auto on sm90), then fa2 (tensor-core
  # decode, tree masks) and the mask bit-packing module
  $kit 32 8 128 bfloat16 > "${OUT:-/tmp}/jit_8b.log" 2>&1 & pids+=($!)
  # the same shape with every prefill on fa2: starts that module's build beside the fa3 one
  $kit 32 8 128 bfloat16 fa2 > "${OUT:-/tmp}/jit_8b_fa2.log" 2>&1 & pids+=($!)
  # tiny checkpoints, head_dim 64 with GQA group 2 (the non-tensor-core decode kernel): fa3 and fa2
  $kit 4 2 64 bfloat16 > "${OUT:-/tmp}/jit_tiny.log" 2>&1 & pids+=($!)
  $kit 4 2 64 bfloat16 fa2 > "${OUT:-/tmp}/jit_tiny_fa2.log" 2>&1 & pids+=($!)
  while [ -n "$(jobs -rp)" ]; do
    sleep 20
    echo "flashinfer JIT: $(( $(date +%s) - t0 ))s, $(find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' 2>/dev/null | wc -l) modules built, $(pgrep -c nvcc || true) nvcc running"
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "flashinfer JIT + kit parity: $(( $(date +%s) - t0 ))s (rc $rc)"
  tail -n 3 "${OUT:-/tmp}"/jit_*.log
  return $rc
}
if [ "${FI_SKIP_JIT:-0}" != 1 ]; then flashinfer_jit_warm; fi
