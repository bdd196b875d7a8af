"""Tiny checkpoint configurations of the native families beyond Llama, shared by their CPU tests
(test_dense_families.py, test_moe_models.py) and the GPU parity run (benchmarks/gpu_parity.py
--families). Each case: (transformers model_type, config overrides for tiny_checkpoint)."""

WINDOW = 4  # shorter than every test sequence but the 2-token prompt's first steps
GEMMA = dict(query_pre_attn_scalar=24, attn_logit_softcapping=1.0, final_logit_softcapping=3.0, sliding_window=WINDOW)
DENSE_CASES = {
    # layer 0 sliding, layer 1 global (transformers' default alternation); both caps bite at these scales
    # head_dim 64: cpu_batched runs its native kernel (window and cap inside it)
    "gemma2-softcap-window": ("gemma2", dict(GEMMA, tie_word_embeddings=True, head_dim=64)),
    "gemma3-text-local-rope": ("gemma3_text", dict(
        GEMMA, tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0}})),
    "phi3-window-longrope": ("phi3", dict(
        tie_word_embeddings=False, sliding_window=WINDOW + 1, original_max_position_embeddings=64, pad_token_id=0,
        eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
                         "long_factor": [2.0 + i for i in range(8)]})),
    "olmo2-qknorm-postnorm": ("olmo2", dict(tie_word_embeddings=False)),
    "mistral-window": ("mistral", dict(tie_word_embeddings=False, sliding_window=WINDOW)),
}

MOE = dict(num_experts_per_tok=2, initializer_range=0.1)
MOE_CASES = {
    # arch: (model_type, config overrides)
    "MixtralForCausalLM": ("mixtral", dict(MOE, num_local_experts=4, tie_word_embeddings=False)),
    # a shared expert behind its gate; layer 0 dense (mlp_only_layers), q/k/v bias
    "Qwen2MoeForCausalLM": ("qwen2_moe", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, mlp_only_layers=[0],
                                              norm_topk_prob=False, tie_word_embeddings=False)),
    # q/k norm, renormalised top-k, every second layer sparse (decoder_sparse_step)
    "Qwen3MoeForCausalLM": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                              decoder_sparse_step=2, num_hidden_layers=3, tie_word_embeddings=True)),
}
