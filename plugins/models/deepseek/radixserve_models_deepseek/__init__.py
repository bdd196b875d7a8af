"""RadixServe plugin: models deepseek (DeepSeek-V2, V2-Lite and V3: multi-head latent attention
and mixture of experts)."""
