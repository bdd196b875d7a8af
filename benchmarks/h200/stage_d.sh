# Session-2 call 2 on the H200 (~9 min, right after stage_c so /tmp still holds part a): SmolLM2 GPU parity,
# offline 1000 x 1024/256, online 300 req at 8 req/s (overlap on), HF static-cache peer. Carry: .whl .gpu2 .gpu3
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
if [ -f /tmp/smollm2.gguf.part-a ]; then
  cat /tmp/smollm2.gguf.part-a .gpu3/smollm2.gguf.part-b > /tmp/smollm2.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c - \
    && timeout 150 python3 benchmarks/gpu_parity.py --gguf /tmp/smollm2.gguf --skip-tiny 2>&1 | grep -v "Warning\|it/s\]" | tee $OUT/parity_smollm2.txt
else
  echo "part a of the GGUF is gone (a fresh machine): SmolLM2 parity skipped"
fi
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
  --input-len 1024 --output-len 256 --result-file $OUT/offline.jsonl $STACK 2>&1 | grep -v "it/s\]" | tail -3 | cut -c1-1500
(setsid radixserve serve --model $M --tokenizer $T --port 30100 model.load_format=dummy model.context_length=1296 $STACK ${ONLINE_EXTRA} > $OUT/server.log 2>&1 &)
for i in $(seq 1 90); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
timeout 90 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
  --output-len 256 --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | tail -30
pkill -f "port 30100"; sleep 2
tail -3 $OUT/server.log
timeout 150 python3 benchmarks/hf_peer.py --config-dir $M --batch-size 128 --input-len 1024 --output-len 256 --result-file $OUT/hf_peer.jsonl 2>&1 | tail -3
