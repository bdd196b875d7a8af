"""vLLM's and SGLang's option names with what says the same here, so that a flag or an `Engine` keyword
a migrating user types first is refused with its RadixServe spelling instead of a bare "unrecognized".
Keyed by the option's name with underscores (`--max-model-len` and `max_model_len=` are one entry)."""

from __future__ import annotations

PEER_OPTIONS: dict[str, str] = {
    "model_path": "--model PATH (model.path)",
    "tokenizer": "--tokenizer DIR (model.tokenizer)",
    "max_model_len": "model.context_length=N",
    "context_length": "model.context_length=N",
    "dtype": "runtime.dtype=bfloat16|float16|float32|auto",
    "kv_cache_dtype": "runtime.kv_cache_dtype=auto|bfloat16|fp8_e4m3",
    "tensor_parallel_size": "--tp N (runtime.tp_size)",
    "tp_size": "--tp N (runtime.tp_size)",
    "data_parallel_size": "--dp N (runtime.dp_size)",
    "gpu_memory_utilization": "scheduler.mem_fraction=F",
    "mem_fraction_static": "scheduler.mem_fraction=F",
    "max_num_seqs": "scheduler.max_running_requests=N",
    "max_running_requests": "scheduler.max_running_requests=N",
    "max_num_batched_tokens": "scheduler.chunked_prefill_size=N and scheduler.max_prefill_tokens=N",
    "chunked_prefill_size": "scheduler.chunked_prefill_size=N",
    "max_prefill_tokens": "scheduler.max_prefill_tokens=N",
    "seed": "runtime.seed=N",
    "random_seed": "runtime.seed=N",
    "schedule_policy": "stack.policy=NAME (radixserve plugins lists them)",
    "enable_prefix_caching": "not needed: prefix caching is on by default (stack.prefix_cache=radix)",
    "no_enable_prefix_caching": "stack.prefix_cache=chunk",
    "disable_radix_cache": "stack.prefix_cache=chunk",
    "enforce_eager": "--disable-cuda-graph (runtime.cuda_graph=false)",
    "quantization": "stack.quantization=NAME (radixserve plugins lists them)",
    "disable_log_requests": "server.log_requests=false",
    "uvicorn_log_level": "--log-level LEVEL",
    "chat_template": "--tokenizer DIR, a copy of the tokenizer directory with your chat_template.jinja",
    "trust_remote_code": "not needed: a model's own Python code is never run; its architecture runs through a native "
                         "plugin or the transformers fallback (radixserve plugins)",
    "generation_config": "not needed: sampling defaults come from each request",
    "attention_backend": "stack.attention=NAME",
    "speculative_algorithm": "--speculative NAME (stack.speculative)",
    "speculative_config": "--speculative NAME with --speculative-num-draft-tokens K (docs/speculative.md)",
    "tool_call_parser": "--tool-call-parser NAME",
    "enable_auto_tool_choice": "not needed: tools are on when the request has them (--tool-call-parser NAME)",
    "tp": "--tp N (runtime.tp_size)",
    "load_format": "model.load_format=auto|safetensors|dummy|NAME (NAME: an installed weight source, e.g. gguf; auto: a "
                   "file's weight source by its suffix)",
    "revision": "--model ORG/NAME@REVISION",
    "download_dir": "the HF_HUB_CACHE environment variable",
    "enable_chunked_prefill": "not needed: prefill is chunked by default (scheduler.chunked_prefill_size=N)",
    "disable_log_stats": "not needed: statistics go to /metrics, not to the log",
    "enable_log_requests": "server.log_requests=true",
    "max_log_len": "not needed: request logs carry no prompt text",
    "swap_space": "not needed: no CPU swap of the KV cache (requests are retracted and recomputed)",
    "tokenizer_mode": "not needed: the tokenizer directory's own tokenizer.json is used",
    "response_role": "not needed: chat replies have the role assistant",
}


def hint_for(option: str) -> str | None:
    """What says `option` here (`--max-model-len`, `--max-model-len=512` or `max_model_len`), else None."""
    name = option.split("=", 1)[0].lstrip("-").replace("-", "_")
    equivalent = PEER_OPTIONS.get(name)
    return None if equivalent is None else f"{option.split('=', 1)[0]} (vLLM/SGLang) -> {equivalent}"
