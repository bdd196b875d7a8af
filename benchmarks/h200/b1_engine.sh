# Issue 18: Engine batch-1 Llama-3.1-8B (dummy weights) 1024 in / 512 out, runtime.batch1_gemv_pdl off then on, both
# figures. Needs branch b1's code (PDL, the Triton greedy argmax, offline_throughput's decode figure, on/off config
# booleans, the LM head on the batch-1 GEMV). Carry: .whl .gpu2 (tokenizer .gpu2/tok-smollm2).   ~2.5 min
#   bash benchmarks/h200/b1_engine.sh
# output_tok_s: the figure of sessions 5-7 (233.9): 512 tokens / wall time of Engine.generate, which includes the
#   1024-token prefill and the first token. decode_tok_s: a second, streamed pass on a fresh prompt:
#   (512 - 1) / (arrival of the last token - arrival of the first), i.e. decode only (llama.cpp "eval tok/s",
#   1 / vLLM's mean ITL).
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[b1_engine.sh $(date +%H:%M:%S)] $*"; }
M=benchmarks/model-configs/llama-3.1-8b
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
for pdl in off on; do
  log "engine batch-1 1024/512, runtime.batch1_gemv_pdl=$pdl"
  timeout 75 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer .gpu2/tok-smollm2 \
    --num-prompts 1 --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine_pdl_$pdl.jsonl $B1 \
    runtime.batch1_gemv_pdl=$pdl > $OUT/engine_pdl_$pdl.log 2>&1
  grep "Triton GEMV on" $OUT/engine_pdl_$pdl.log | tail -1 | cut -c1-220
  python3 -c "
import json, sys
r = json.loads(open(sys.argv[1]).readline()); d = r.get('decode') or {}
print(f'PDL {sys.argv[2]}: OLD figure output_tok_s {r[\"output_tok_s\"]} (512 tokens / {r[\"seconds\"]} s incl. the 1024-token prefill)')
print(f'PDL {sys.argv[2]}: DECODE-ONLY decode_tok_s {d.get(\"decode_tok_s\")} ({d.get(\"ms_per_token\")} ms/token; TTFT {d.get(\"ttft_s\")} s; '
      f'streamed pass old-definition {d.get(\"stream_output_tok_s\")} tok/s)')
" $OUT/batch1_engine_pdl_$pdl.jsonl $pdl || tail -5 $OUT/engine_pdl_$pdl.log
done
log "greedy parity vs transformers, every projection and the LM head on the GEMV (PDL as served)"
timeout 60 python3 benchmarks/gpu_parity.py --batch1-gemv-all 2>&1 | grep "SUMMARY\|BROKEN\|Error\|GEMV" | tee $OUT/parity.txt
log done
