"""Versions of the core distribution and of the plugin API it offers."""

__version__ = "0.1.0"

# The plugin API version: plugins declare the range they were built for (e.g. ">=1,<2").
# Bump the major number on any breaking change to a hook or an interface in radixserve.interfaces.
# 1.1: Model.greedy_token_ids; tree drafts (DraftProposal.parents, ForwardBatch.tree_mask,
#      AttentionBackend.supports_tree_mask, decode_rows_share_requests); Drafter construction with DrafterInfo,
#      on_finished; AttentionBackend.build_native_kernels; QuantMethod.from_config/check_device/min_capability,
#      packed parameters
#      the grammar kind (GrammarBackend, GrammarMatcher)
# 1.2: kinds tool_parser (ToolParser) and reasoning_parser (ReasoningParser)
# 1.3: tensor parallelism: `supports_tensor_parallel` on every kind, Model(..., tp_group=TPGroup),
#      radixserve.layers.distributed.TPGroup; per-layer attention options: AttentionLayerSpec.sliding_window
#      and .logit_cap (RadixAttention arguments), AttentionBackend.supports_sliding_window / supports_logit_cap;
#      MoE: QuantMethod.create_moe_weights/process_moe_weights_after_loading/apply_moe;
#      radixserve.layers.moe (FusedMoE, RoutingConfig, select_experts); Model.attention_dims (a model's
#      KV-cache shape when its HF config does not give it); the transformers fallback (`model.impl`)
# 1.4: latent attention (MLA): Model.attention_type ("standard" | "latent") and latent_attention_dims();
#      radixserve.interfaces.LatentAttentionDims / LatentAttentionLayerSpec; radixserve.memory.LatentKVPool;
#      radixserve.layers.latent_attention.RadixLatentAttention; AttentionRunnerInfo.latent;
#      AttentionBackend.supports_latent_attention / supports_standard_attention and forward_latent_extend /
#      forward_latent_decode / forward_latent; radixserve.testing.check_latent_attention_backend;
#      the model shell radixserve.layers.causal_lm.DecoderOnlyCausalLM, radixserve.layers.decoder_blocks and
#      weight_utils.load_stacked_weights; drafter helpers radixserve.scheduler.speculative.draft_slots /
#      draft_state (DraftSlotStack, PooledDrafter); WeightSource.prepare_model and its options
#      (`model.weight_source_options`); FusedMoE.map_checkpoint_name maps per-expert `weight_scale_inv`
# 1.5: radixserve.testing.check_quant_method_moe (the conformance kit's MoE step);
#      radixserve.cuda_graph_runner.CudaGraph / EagerGraph for drafters capturing their own steps (the
#      decode graphs record the hidden rows TargetStates hands out);
#      FP8 KV pools (runtime.kv_cache_dtype: fp8_e4m3): KVPool in float8_e4m3fn with per-layer k/v scales
#      (KVPool.is_fp8 / kv_scales / quantize_kv / read_kv, radixserve.memory.fp8_kv);
#      AttentionBackend.supports_fp8_kv_cache;
#      rotary fused with the KV store: AttentionBackend.fuses_rotary_with_kv_store / forward_decode_rotary,
#      RadixAttention.forward_rotary, RotaryEmbedding.cos_sin_tables, radixserve.layers.rotary.is_stock_rotary
# 1.6: GrammarBackend.fill_bitmasks (every constrained row of a step in one call; xgrammar fills them in
#      parallel threads); per-head q/k norms in the decode rotary + KV-store kernel:
#      radixserve.layers.attention.QKNorm, RadixAttention.forward_rotary(..., qk_norm=),
#      AttentionBackend.fuses_qk_norm_with_rotary; FusedMoE.forward_with_gate,
#      radixserve.layers.moe.small_m.fused_gate_select_experts; WeightSource.hf_config may return a plain
#      config object with to_transformers() (GGUF: no transformers import when serving); linear layers
#      may carry a `gemv_config` tile set by the runner (runtime.batch1_gemv, layers/gemv_selection.py)
# 1.7: GrammarBackend.accept_tokens (every constrained row's token of a step in one call);
#      decoder blocks for model authors: DecoderAttention.forward_qkv, SwiGLUMLP.forward_gate_up and
#      radixserve.layers.norm_gemv (norm_linear / norm_linear_fusable: a plain RMSNorm inside the batch-1
#      GEMV of the projection after it, runtime.batch1_gemv_fuse_norm / _fuse_silu); linear layers may
#      carry `gemv_fuse_norm`; runtime.lowbit_gemv (int4 / FP8 whole-row GEMVs, layers/lowbit_gemv.py);
#      decoder_blocks.FusesPostAttentionNorm (an MLP block that runs the post-attention norm in its own
#      first kernel: Qwen-MoE, FusedMoE.forward_with_norm_gate); the small-M MoE experts in one launch
#      at <= 2 tokens (layers/moe/one_launch.py)
# 1.8: bf16 KV pools of fp32 models (runtime.kv_cache_dtype: bfloat16): AttentionBackend.supports_bf16_kv_cache
# 1.9: AttentionRunnerInfo.matmul_precision (runtime.cpu_matmul_precision: "medium" allows a backend bf16
#      products with fp32 sums); check_attention_backend(matmul_precision=...)
# 1.10: CUDA graphs of EXTEND batches (runtime.cuda_graph_extend_max_tokens):
#      AttentionBackend.supports_extend_cuda_graph / init_extend_graph_state / init_extend_metadata_capture /
#      init_extend_metadata_replay, radixserve.extend_graph_runner.ExtendGraphRunner
# 1.11: check_attention_backend(progress=): a line as each scenario starts (where a slow backend spends the kit)
# 1.12: radixserve.testing.check_weight_source (and check_model_parity(weight_source=)) and check_drafter_on_model;
#      ReasoningParser.end_tag declared on the base class (the server read it by name before; default "" unchanged);
#      verified_rows public in radixserve.interfaces.target_states
# 1.13: check_attention_backend / check_latent_attention_backend(long_positions=): a scenario past 64, 128 and 256
#      key positions by default; the kits pass q/k/v as the runner does (strided column views of one fused buffer)
# 1.14: FusedMoE.map_checkpoint_name maps a per-expert tensor of any suffix to `w13_<suffix>` / `w2_<suffix>` (a
#      pre-quantized MoE checkpoint's own scale names load; before: `weight` and `weight_scale_inv` only); a float
#      checkpoint tensor for an integer parameter is refused (weight_utils.CheckpointDtypeError), never cast;
#      plugins.registry.PluginCodeError / PluginRefusal (a quantization method's hook failing or refusing at start-up)
# 1.15: Req.arrival_time is time.monotonic() seconds at the scheduler's receipt (strictly increasing; before: a
#      counter), so a policy can age requests; a policy's order() that raises or returns a non-permutation makes
#      that step admit in arrival order (logged naming the policy) instead of ending the scheduler process
# 1.16: Model.context_limit(hf_config) (a classmethod: the longest context the model computes exactly, and why;
#      the runner caps model.context_length at it); the transformers fallback caps at Llama 4's attention_chunk_size
# 1.17: radixserve.interfaces.grammar.resolve_json_pointer (a schema's local `$ref` followed, one walk for the
#      core's checks and the backends' rewrites; LookupError when it is not local or names nothing)
# 1.18: WeightSource.file_tensor_name (load errors name a tensor as the file does too: GGUF's blk.1.ffn_down.weight)
# 1.19: check_schedule_policy(waits=, clock=): its requests' arrival_time are recent time.monotonic() seconds (they
#      were small counters, hours old against the clock); the kits check a class as the stack resolution does
#      (plugins.registry.class_problem: subclass, not abstract, a drafter's __init__ taking the info) and say a
#      failure to build as an AssertionError; a policy's or drafter's abstract class is refused at stack resolution,
#      and a constructor's exception other than ValueError is a PluginCodeError naming the component
#      (plugins.registry.build_component); register(devices=) takes only a tuple/list of "cpu" / "cuda";
#      a policy's order() / drafter's propose() of the wrong type is named in the kit's words (floats and strings
#      as draft tokens are refused), out-of-vocabulary drafts are counted (spec_invalid_draft_tokens), order() is
#      not called while no waiting request can be admitted; /server_info's resolved_stack
# 1.20: stack.prefix_cache_options: a prefix cache is built as Cache(req_to_token_pool, allocator, **options), its
#      option names checked at stack resolution (plugins.stack.check_prefix_cache_options) and a refusal named
#      (build_prefix_cache); /flush_cache is a 500 when the emptied cache leaves leaked KV slots taken
PLUGIN_API_VERSION = "1.20"
