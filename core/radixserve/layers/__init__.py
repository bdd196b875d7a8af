"""Layers shared by every model plugin (linear, embedding, norms, rotary, attention, logits, sampler)."""
