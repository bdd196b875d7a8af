# Session-2 call 3 on the H200 (~7 min): re-check after the rotary gather-in-kernel and the
# lookahead-while-waiting changes: tiny GPU parity (incl. overlap), batch-1 profile, Engine batch-1,
# offline 1000 x 1024/256, online 300 at 8 req/s with per-token ITL. Carry: .whl .gpu2
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
M=benchmarks/model-configs/llama-3.1-8b
T=.gpu2/tok-smollm2
python3 benchmarks/h200/hbm_limit.py 2>&1 | tee $OUT/limit.txt
timeout 100 python3 benchmarks/gpu_parity.py 2>&1 | grep SUMMARY | tee $OUT/parity.txt
timeout 150 python3 benchmarks/h200/profile_decode.py --out $OUT 2>&1 | grep -v "Warning" | head -4
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
timeout 100 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1 \
  --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine.jsonl $B1 2>&1 | grep '^{' | cut -c1-300
STACK="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton scheduler.max_running_requests=512 runtime.cuda_graph_max_bs=512 scheduler.chunked_prefill_size=8192 scheduler.max_prefill_tokens=16384 scheduler.mem_fraction=0.88"
timeout 150 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer $T --num-prompts 1000 \
  --input-len 1024 --output-len 256 --result-file $OUT/offline.jsonl $STACK 2>&1 | grep '^{' | cut -c1-900
(setsid radixserve serve --model $M --tokenizer $T --port 30100 model.load_format=dummy model.context_length=1296 $STACK > $OUT/server.log 2>&1 &)
for i in $(seq 1 90); do curl -sf localhost:30100/health > /dev/null && break; sleep 1; done
timeout 90 radixserve bench serve --base-url http://127.0.0.1:30100 --num-prompts 300 --request-rate 8 --input-len 1024 \
  --output-len 256 --vocab-high 30000 --result-file $OUT/online.jsonl 2>&1 | tail -30
pkill -f "port 30100"; sleep 2
