"""The physical limit measured in the same run: device-to-device copy bandwidth (bytes read + written)."""

import torch

n = 2 * 1024**3  # 2 GiB per buffer, well past the 60 MB L2
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
iters = 20
for _ in range(iters):
    b.copy_(a)
end.record()
torch.cuda.synchronize()
s = start.elapsed_time(end) / 1e3 / iters
bw = 2 * n / s / 1e12
weights = 16.06e9
print(f"HBM copy bandwidth {bw:.2f} TB/s; Llama-3.1-8B bf16 weights {weights / 1e9:.2f} GB -> batch-1 decode floor "
      f"{weights / (bw * 1e12) * 1e3:.2f} ms/step = {bw * 1e12 / weights:.0f} tok/s")
# What a batch-1 decode step really reads (issue 18): the weights less the input embedding (one row is read), plus
# the KV cache at the mean context of the 1024-in / 512-out run (32 layers x 8 KV heads x 128 x K and V x 2 bytes).
embedding = 128256 * 4096 * 2
kv_per_token = 32 * 8 * 128 * 2 * 2
read = weights - embedding + kv_per_token * (1024 + 256)
print(f"bytes read per step {read / 1e9:.2f} GB -> batch-1 limit {bw * 1e12 / read:.0f} tok/s "
      f"(85% = {0.85 * bw * 1e12 / read:.0f})")
