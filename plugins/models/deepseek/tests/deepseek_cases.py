"""Tiny DeepSeek checkpoints shared by the plugin's tests: each case is (model_type, config overrides)
for `radixserve.testing.tiny_checkpoint`, plus a writer that gives V3's score-correction bias
non-zero values (transformers initialises that buffer to zeros, which would hide its handling)."""

from __future__ import annotations

import torch

# latent attention at tiny sizes; head_dim is the rotary part transformers' rope sees
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
           num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2)
# DeepSeek-style YaRN (mscale != mscale_all_dim: both the cos/sin factor and the softmax scale move)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

CASES = {
    # V2-Lite shape: no query compression, YaRN, greedy softmax routing scaled
    "v2-lite-yarn": ("deepseek_v2", dict(MLA, q_lora_rank=None, rope_parameters=YARN, routed_scaling_factor=1.5)),
    # V2 shape: compressed queries, group-limited greedy routing
    "v2-qlora-grouped": ("deepseek_v2", dict(MLA, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                            topk_group=2)),
    # V3: sigmoid + correction bias, 4 groups of which 2 eligible, renormalised and scaled, YaRN
    "v3-noaux-yarn": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                         routed_scaling_factor=2.5, rope_parameters=YARN, n_shared_experts=1)),
    # V3 with the rotate-half rope layout and tied embeddings
    "v3-halfrope-tied": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False,
                                            tie_word_embeddings=True)),
}
ARCHS = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def write_checkpoint(case: str, path: str) -> str:
    """The tiny checkpoint of `case` at `path`; V3's `e_score_correction_bias` drawn at the scale of
    the sigmoid scores, so it changes which experts are chosen."""
    from radixserve.testing import tiny_checkpoint
    from safetensors.torch import load_file, save_file

    model_type, overrides = CASES[case]
    tiny_checkpoint(model_type, path, **overrides)
    if model_type == "deepseek_v3":
        file = f"{path}/model.safetensors"
        weights = load_file(file)
        gen = torch.Generator().manual_seed(7)
        for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
            weights[name] = 0.3 * torch.randn(weights[name].shape, generator=gen)
        save_file(weights, file, metadata={"format": "pt"})
    return path
