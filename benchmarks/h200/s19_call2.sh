# Written in session 18 (issue 18 on an H200, both attention backends); it never ran (no H200 was lent
# for a whole call) and was split in session 25 into two calls that fit the 600 s limit on a cold machine:
# s25_h200a.sh (online with the latency stack, then batch 1, triton and FlashInfer) and s25_h200b.sh
# (offline 1000 x 1024/256 with both, step traces, and the HF peer). Carry .whl .gpu2 .fi.
echo "superseded: run benchmarks/h200/s25_h200a.sh, then benchmarks/h200/s25_h200b.sh (one call each)" >&2
exit 2
