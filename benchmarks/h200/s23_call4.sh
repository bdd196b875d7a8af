# Session 23, call 4 (carry .whl .gpu2; ~3 min): the expert kernels' checks and tile sweep at 1 token with the
# one-launch kernel's gate_up steps as tl.dot (SmallMBlocks.gate_up_dot: the weight tiles pipelined through shared
# memory, num_stages deep; off by default): is the experts kernel's distance from its bytes' floor (78% on an H100)
# the one register-held step of weights per program?
set -o pipefail
PARTS="k" bash benchmarks/h200/qwen_b1.sh 2>&1 | grep -v '^ ' | cut -c1-400
python3 -c "
import json
d = json.load(open('$OUT/qwen_b1_choice.json'))
for r in d['all']: print(json.dumps(r))" 2>&1 | head -40
