"""Batched-decode attention for CPU (registered in `radixserve_attention_cpu_batched.plugin`)."""
