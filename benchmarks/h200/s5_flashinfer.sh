# Session-5 call on the H200 (issue 18): the flashinfer attention plugin. Carry: .whl .fi
# (.fi made on the CPU machine by `bash benchmarks/h200/flashinfer_pack.sh`: ~18 MB).
#   setup    unpack the trimmed FlashInfer + apache-tvm-ffi, JIT-compile its kernels in three parallel
#            builds, each followed by the attention conformance kit on CUDA (fi_kit.jsonl):
#            32/8/128 bf16 (auto: fa3 prefill on sm90), the same with fa2 prefill, 4/2/64 bf16
#   graph    decode through the CUDA-graph wrappers: capture, replay with longer rows (fi_graph.jsonl)
#   engine   greedy ids through the Engine on a tiny Llama (head_dim 64): flashinfer vs triton vs
#            torch_native, then the same prompts again from the radix cache (fi_engine.jsonl)
#   parity   benchmarks/gpu_parity.py --attention flashinfer: the runner with CUDA graphs vs HF transformers (top-5 rule)
#   kernels  per-layer times beside triton's, Llama-3.1-8B shape (fi_kernels.jsonl)
# PARTS selects (default all). The JIT build takes minutes on a cold machine, so split it in two calls:
#   call 1 (cold, ~8 min): PARTS="graph engine" bash benchmarks/h200/s5_flashinfer.sh
#   call 2 (warm, ~4 min): PARTS="parity kernels" bash benchmarks/h200/s5_flashinfer.sh
# (the second reuses build/flashinfer-site and the compiled kernels in build/flashinfer-jit).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
PARTS=${PARTS:-"graph engine parity kernels"}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
source benchmarks/h200/flashinfer_setup.sh || { echo "flashinfer setup failed"; exit 1; }
if has graph; then
  timeout 120 python3 benchmarks/h200/flashinfer_device.py graph 2>&1 | tail -5
fi
if has engine; then
  timeout 240 python3 benchmarks/h200/flashinfer_device.py engine 2>&1 | grep -v Warning | tail -12
fi
if has parity; then
  timeout 180 python3 benchmarks/gpu_parity.py --attention flashinfer 2>&1 | grep -i "summary\|error" | tee $OUT/parity.txt
fi
if has kernels; then
  timeout 240 python3 benchmarks/h200/flashinfer_device.py kernels 2>&1 | grep -v Warning | tail -12
fi
echo "JIT cache: $(du -sh build/flashinfer-jit 2>/dev/null | cut -f1)"
