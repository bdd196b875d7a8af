# Issue 18 (Llama-3.1-8B batch-1 decode through the Engine, target 240 tok/s): programmatic dependent launch for
# the batch-1 GEMVs (runtime.batch1_gemv_pdl, plain + norm-fused) and the greedy sampler's Triton argmax.
# Needs branch b1's code. Carry: .whl .gpu2 (the tokenizer .gpu2/tok-smollm2).   ~3 min
#   bash benchmarks/h200/b1_pdl.sh
# 1. per-kernel us PDL off/on (qkv/gate_up norm-fused, o/down plain; bit-equal), one 8B layer's chain, argmax us
#    torch vs Triton; the 8B runner's graph replay ms/step PDL off/on (x2) and greedy tokens identical (b1_pdl.json)
# 2. Engine batch-1 1024 in / 512 out, PDL off then on: output_tok_s (the old figure: prefill + first token
#    included) and decode.decode_tok_s (streamed: (tokens - 1) / (last token time - first token time))
# 3. greedy parity vs transformers with every projection on the GEMV (PDL as served) + PDL on/off tokens identical
set -o pipefail
source benchmarks/h200/setup.sh || exit 1
log() { echo "[b1_pdl.sh $(date +%H:%M:%S)] $*"; }
F='it/s\]\|tensor/s\]\|Warning'
log "1. kernels + runner"
timeout 100 python3 benchmarks/h200/b1_pdl.py --out $OUT 2>&1 | grep -v "$F" | tee $OUT/b1_pdl.txt | grep "b1_pdl\|Error\|error" | head -30
log "2. engine batch-1 1024/512"
M=benchmarks/model-configs/llama-3.1-8b
B1="runtime.device=cuda runtime.dtype=bfloat16 stack.attention=triton runtime.cuda_graph_max_bs=8 scheduler.max_running_requests=8"
for pdl in off on; do
  timeout 60 python3 benchmarks/offline_throughput.py --model $M --load-format dummy --tokenizer .gpu2/tok-smollm2 \
    --num-prompts 1 --input-len 1024 --output-len 512 --result-file $OUT/batch1_engine_pdl_$pdl.jsonl $B1 \
    runtime.batch1_gemv_pdl=$pdl > $OUT/engine_pdl_$pdl.log 2>&1
  grep "pdl=" $OUT/engine_pdl_$pdl.log | tail -1 | cut -c1-220
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); d=r.get('decode') or {}; print('PDL', sys.argv[2], \
'output_tok_s (old: incl. prefill)', r['output_tok_s'], '| decode_tok_s', d.get('decode_tok_s'), 'ms/token', d.get('ms_per_token'), \
'ttft_s', d.get('ttft_s'), 'stream_output_tok_s', d.get('stream_output_tok_s'))" $OUT/batch1_engine_pdl_$pdl.jsonl $pdl \
    || tail -5 $OUT/engine_pdl_$pdl.log
done
log "3. parity"
timeout 75 python3 benchmarks/gpu_parity.py --batch1-gemv-all 2>&1 | grep "SUMMARY\|BROKEN\|Error\|GEMV" | tee $OUT/parity.txt
log done
