"""Benchmarks: `radixserve bench one-batch` (static batch, in-process) and `bench serve` (load generator)."""
