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
