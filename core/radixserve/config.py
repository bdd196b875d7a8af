"""The one configuration model: YAML stack file < command line, validated by pydantic.

Precedence: command line > YAML > defaults. Unknown keys are errors (extra="forbid") and unknown
component names are errors that list the installed choices (`radixserve.plugins.stack.resolve_stack`).
Configs are frozen: derive a changed copy with `Config.with_overrides`, never mutate one."""

from __future__ import annotations

import ctypes
import datetime
import importlib.util
import logging
import os
import re
import sys
import tempfile
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message names the bad key or value."""


class _Section(BaseModel):
    # coerce_numbers_to_str: an override's value is read as YAML, so `server.api_key=123` arrives as 123
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


def _none_is_no_options(v: Any) -> Any:
    """A component's options given as null (`policy_options:` with no value, `stack.policy_options=null`) are no
    options, as `{}` is (merge_layers: either replaces an earlier layer's options)."""
    return {} if v is None else v


# the keyword arguments a component is built with (COMPONENT_OPTIONS); null is none
ComponentOptions = Annotated[dict[str, Any], BeforeValidator(_none_is_no_options)]


class ModelSection(_Section):
    path: str | None = None  # HF directory, .gguf file; None: the embedded default (SmolLM2) if installed
    tokenizer: str | None = None  # default: from the model
    # auto | safetensors | dummy | an installed weight source's name ("gguf", a plugin's): checked against the
    # registry by resolve_stack (a third-party source could not be named while this was a fixed list)
    load_format: str = "auto"
    context_length: int | None = Field(default=None, gt=0)  # default: the model's max_position_embeddings
    served_model_name: str | None = None
    # which implementation runs the architecture: auto (its native plugin, else the transformers
    # fallback), native (the plugin only), transformers (the fallback, radixserve-models-transformers)
    impl: Literal["auto", "native", "transformers"] = "auto"
    # keyword arguments of the weight source that reads a checkpoint file (e.g. {dequantize: true}
    # for GGUF), checked against its constructor at start-up (unknown option -> error listing the valid ones)
    weight_source_options: ComponentOptions = Field(default_factory=dict)

    @field_validator("served_model_name")
    @classmethod
    def _served_name_not_blank(cls, v: str | None) -> str | None:
        # "" fell back to the file name unseen, while an empty API key is refused (operator audit 30)
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave it unset to serve under the model's own name)")
        return v


class StackSection(_Section):
    attention: str | None = None  # None: the best installed backend for the device
    prefix_cache: str = "radix"
    # keyword arguments of the prefix cache's constructor, after the ReqToTokenPool and TokenAllocator it is
    # built with (e.g. {capacity: 4096} for a plugin's cache); checked against the constructor at start-up
    # (unknown option -> error listing the valid ones)
    prefix_cache_options: ComponentOptions = Field(default_factory=dict)
    policy: str = "fcfs"
    # keyword arguments of the policy's constructor, e.g. {fcfs_threshold: 64} for lpm; checked
    # against the constructor at start-up (unknown option -> error listing the valid ones)
    policy_options: ComponentOptions = Field(default_factory=dict)
    quantization: str | None = None  # None: from the checkpoint (quantization_config / file format)
    # selects a component of kind "drafter" (None: no speculative decoding); the `speculative`
    # section sets its limits and options
    speculative: str | None = None
    # the grammar backend (kind "grammar") enforcing json_schema/regex/ebnf constraints; None: the
    # highest-priority installed one (none installed: constrained requests are refused with a 400);
    # "none": structured output off
    grammar: str | None = None
    grammar_compile_threads: int = Field(default=2, ge=1, le=64)  # threads compiling grammars off the scheduler loop
    grammar_cache_size: int = Field(default=256, ge=1)  # compiled grammars kept (least recently used dropped)
    # seconds a constrained request waits for its grammar (queued for a thread and compiling) before it
    # is refused: a slow or adversarial constraint must not hold its client, or those behind it, forever
    grammar_compile_timeout_s: float = Field(default=60.0, gt=0)


class SpeculativeSection(_Section):
    """Speculative decoding, used when `stack.speculative` names a drafter (docs/speculative.md)."""

    num_draft_tokens: int = Field(default=4, ge=1, le=64)  # most draft tokens (tree nodes) per request per step
    topk: int = Field(default=1, ge=1, le=16)  # branching of tree drafts (1: chains)
    num_steps: int | None = Field(default=None, ge=1)  # draft depth of model drafters; None: num_draft_tokens
    draft_model_path: str | None = None  # a draft model's checkpoint, for drafters that need one
    # keyword arguments of the drafter's constructor, checked against it at start-up
    options: ComponentOptions = Field(default_factory=dict)
    # low-acceptance safeguard: at decode batches of at least this many requests (0: never) drafts
    # follow the measured acceptance, and speculation pauses while it is below min_accepted_drafts
    adaptive_batch_size: int = Field(default=8, ge=0)
    min_accepted_drafts: float = Field(default=0.5, ge=0)  # mean accepted drafts per verify


CPU_CHUNKED_PREFILL_SIZE = 512  # scheduler.chunked_prefill_size's default on the CPU


class SchedulerSection(_Section):
    # prompt tokens per prefill chunk; -1 or 0: off; None: CPU_CHUNKED_PREFILL_SIZE on the CPU, else 2048
    chunked_prefill_size: int | None = Field(default=None, ge=-1)
    max_prefill_tokens: int = Field(default=16384, gt=0)  # new-token budget of one prefill batch
    max_running_requests: int = Field(default=256, gt=0)
    max_total_tokens: int | None = Field(default=None, gt=0)  # KV pool size in tokens; None: from memory
    mem_fraction: float = Field(default=0.85, gt=0, le=1)  # GPU: fraction of memory for weights + KV
    cpu_kv_cache_gb: float = Field(default=2.0, gt=0)  # CPU: KV pool byte budget
    # run decodes inside prefill batches; None: on for the CPU, off for CUDA (see resolved_enable_mixed_chunk)
    enable_mixed_chunk: bool | None = None
    # after every prefill batch, one decode step of the running requests before the next prefill batch
    # (not only after a chunk of an unfinished prompt): a decode waits for at most one prefill batch
    interleave_decode: bool = False
    # hold back a waiting request for one step when it shares at least this many not-yet-cached
    # prompt tokens with a request admitted in the same batch: next step it reads them from the
    # prefix cache instead of computing them again (0: off)
    in_batch_prefix_threshold: int = Field(default=16, ge=0)
    schedule_conservativeness: float = Field(default=1.0, gt=0)
    stream_interval: int = Field(default=1, ge=1)  # send streamed tokens every N steps
    # check every free of a KV slot (one already free or out of range raises at once, the request
    # doing it ends with a 500 and the log names the prefix cache): for developing a prefix cache;
    # each free then costs O(pool size)
    debug_kv_checks: bool = False

    def resolved_chunked_prefill_size(self, device: str) -> int | None:
        """Prompt tokens per prefill chunk on `device`, None when chunking is off. The CPU default is
        smaller: a CPU prefill is compute-bound at a few thousand tokens a second, so a 2048-token
        chunk holds every request that arrives meanwhile for seconds before its own prefill starts
        (benchmarks/results/cpu-served-vs-vllm.md, session 9)."""
        size = self.chunked_prefill_size
        if size is None:
            size = CPU_CHUNKED_PREFILL_SIZE if device.startswith("cpu") else 2048
        return size if size > 0 else None

    def resolved_enable_mixed_chunk(self, device: str, speculative: bool = False) -> bool:
        """Whether decode rows ride in prefill batches on `device`. On the CPU they cost about one
        prompt token each inside a prefill step and so keep decoding while prompts are prefilled; on
        CUDA the mixed batch's decode rows go through the extend kernel, which reads the KV far less
        efficiently than the decode kernel (session 4: offline 25.2k vs 29.4k tok/s), so it is off.
        Off by default with a drafter too (`speculative`): a row in a mixed batch gains one token
        where its verify step would gain up to num_draft_tokens + 1."""
        if self.enable_mixed_chunk is not None:
            return self.enable_mixed_chunk
        return device.startswith("cpu") and not speculative


class RuntimeSection(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    # the KV pool's element type: auto (the model dtype) or fp8_e4m3 (half the bytes of bf16 per
    # token, per-layer scales; attention backends that declare supports_fp8_kv_cache; docs/quantization.md)
    # bfloat16: half the bytes of an fp32 model's pool (the CPU; backends that declare
    # supports_bf16_kv_cache: cpu_batched, torch_native)
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3"] = "auto"
    tp_size: int = Field(default=1, ge=1)  # tensor-parallel ranks (docs/parallelism.md)
    nnodes: int = Field(default=1, ge=1)  # machines the TP ranks span (tp_size / nnodes ranks each)
    node_rank: int = Field(default=0, ge=0)  # this machine's index; node 0 serves HTTP and runs rank 0
    dist_init_addr: str | None = None  # host:port of the TP rendezvous (rank 0's node); None: a free local port
    cuda_graph: bool = True
    cuda_graph_max_bs: int = Field(default=160, ge=1)
    # EXTEND batches (prefill chunks, with decode rows mixed in) of up to this many new tokens replay
    # CUDA graphs too (extend_graph_runner.py; backends with supports_extend_cuda_graph: triton);
    # 0: off, they run eagerly (host-bound for short prompts on Hopper: h100-session16.md)
    cuda_graph_extend_max_tokens: int = Field(default=0, ge=0)
    # request slots of each extend graph (one is the padding request's); larger batches run eagerly
    cuda_graph_extend_max_requests: int = Field(default=64, ge=2)
    overlap: bool | None = None  # overlap scheduling; None: on for CUDA, off for CPU (nothing to overlap)
    # batch-1 projections of plain-weight layers on the Triton GEMV (layers/gemv_selection.py): auto
    # (CUDA GPUs where it was measured faster than cuBLAS: sm90), on (any CUDA GPU), off
    batch1_gemv: Literal["auto", "on", "off"] = "auto"
    # where batch1_gemv routes the projection after an RMSNorm (qkv, gate_up), run the norm (and the
    # residual add) inside that GEMV: one launch instead of two (layers/norm_gemv.py; H200 Llama-3.1-8B
    # batch 1: 233.9 vs 228.3 tok/s, session 7); false for an A/B
    batch1_gemv_fuse_norm: bool = True
    # where batch1_gemv routes a SwiGLU MLP's down projection, compute silu_and_mul in that GEMV's
    # prologue (one launch instead of two); off: measured slower on the H200 (8B down: best gated tile
    # 31.5 us vs 30.3 for silu_and_mul + GEMV; Engine 228.5 vs 233.9 tok/s, session 7)
    batch1_gemv_fuse_silu: bool = False
    # programmatic dependent launch for the batch-1 GEMVs (and their norm-fused form): each starts
    # while the kernel before it drains, loading its first weight tile before waiting for its input
    # (layers/gemv_selection.py); auto: on for sm90 GPUs whose Triton has it, on: an error elsewhere
    batch1_gemv_pdl: Literal["auto", "on", "off"] = "auto"
    # int4 (AWQ/GPTQ) and per-row FP8 linears of <= 4 rows on the whole-row low-bit GEMVs
    # (layers/lowbit_gemv.py); auto: on for CUDA models, on: an error elsewhere
    lowbit_gemv: Literal["auto", "on", "off"] = "auto"
    # CPU GEMMs of fp32 models (the native kernel's packed weights, layers/cpu_gemm.py): highest keeps
    # them fp32; medium, wherever the native GEMM runs (AVX2 and up), rounds the weights to bf16
    # (half the weight bytes) and sums the products in fp32 (torch's "medium" float32 matmul
    # precision), inputs rounded to bf16 where vdpbf16ps is the faster product (Zen 4: 1.6-1.8x the
    # GEMM rate), else kept fp32 (the weights widened); on AMX CPUs the decoder's linears run on AMX
    # tiles (inputs rounded to bf16); elsewhere a warning and fp32
    cpu_matmul_precision: Literal["highest", "medium"] = "highest"
    seed: int = 0
    num_threads: int | None = Field(default=None, ge=1)  # CPU torch threads; None: all cores
    # data parallelism: this many full engine replicas behind a router (the `router` section)
    dp_size: int = Field(default=1, ge=1)

    @field_validator("batch1_gemv", "batch1_gemv_pdl", "lowbit_gemv", mode="before")
    @classmethod
    def _yaml_bool_is_on_off(cls, v: Any) -> Any:
        # YAML (files and `runtime.key=off` overrides) reads a bare on/off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check_parallel_layout(self) -> RuntimeSection:
        if self.tp_size % self.nnodes:
            raise ValueError(f"runtime.tp_size={self.tp_size} must be a multiple of runtime.nnodes={self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"runtime.node_rank={self.node_rank} must be below runtime.nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("runtime.nnodes > 1 needs runtime.dist_init_addr (host:port of node 0, e.g. 10.0.0.1:29500)")
        if self.nnodes > 1 and self.dp_size > 1:  # every replica would take the one rendezvous address (audit 31)
            raise ValueError(f"runtime.dp_size={self.dp_size} with runtime.nnodes={self.nnodes}: data-parallel replicas "
                             "run on one machine, each with its own tensor-parallel ranks; multi-node tensor "
                             "parallelism serves one replica (run one server per group of nodes behind your own "
                             "load balancer)")
        if self.dist_init_addr is not None:
            port = self.dist_init_addr.rpartition(":")[2]
            if not port.isdigit():
                raise ValueError(f"runtime.dist_init_addr={self.dist_init_addr!r} must look like host:port")
            if not 1 <= int(port) <= 65535:  # else the rendezvous fails only once the ranks start
                raise ValueError(f"runtime.dist_init_addr={self.dist_init_addr!r}: the port must be 1-65535")
        return self

    def resolved_overlap(self, device: str) -> bool:
        if self.overlap is not None:
            return self.overlap
        return device.startswith("cuda")

    def resolved_device(self) -> str:
        """`device`, or for "auto" "cuda" when torch sees a GPU, else "cpu". Torch is imported only
        when the answer can be "cuda" (see `torch_cannot_use_cuda`): the HTTP front end stays torch-free on a CPU machine."""
        if self.device != "auto":
            return self.device
        if "torch" not in sys.modules and torch_cannot_use_cuda():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def check_device_usable(self) -> None:
        """Raise ConfigError when `device` is cuda and this torch cannot use it: said before any
        process starts, not as torch's assertion from inside the scheduler."""
        if self.device != "cuda":
            return
        if torch_cannot_use_cuda():
            why = "this torch is a CPU-only build (or the CUDA driver library is missing)"
        else:
            import torch

            if torch.cuda.is_available():
                return
            why = "torch sees no CUDA device"
        raise ConfigError(f"runtime.device=cuda, but {why}; use runtime.device=cpu (or auto)")

    def resolved_dtype(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device == "cuda" else "float32"


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None  # None: $RADIXSERVE_API_KEY if set (`with_env_api_key`), else no authentication
    max_request_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_requests: bool = True
    # SIGINT/SIGTERM: seconds in-flight requests may still run before they end with an error
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    # chat output parsers (components of kinds tool_parser / reasoning_parser): a name, "none"
    # (off), or None: the parser whose markers are in the model's chat template, if any
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # a chat template that ignores `tools`: describe them in a system message (Hermes format)
    # instead of refusing the request
    generic_tool_prompt: bool = False

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_refused(cls, v: str | None) -> str | None:
        # "" would turn authentication off while the ready line says a key is required
        if v is not None and not v.strip():
            raise ValueError("the API key is empty (it would turn authentication off): give a key, or leave "
                             "server.api_key out (null) to serve without one")
        return v


class RouterSection(_Section):
    """The data-parallel router in front of `runtime.dp_size` > 1 replicas (docs/parallelism.md)."""

    # cache_aware: the replica whose (approximate) prefix cache holds the longest prefix of the
    # request, unless the load is uneven; round_robin: in turn; least_load: fewest in flight
    policy: Literal["cache_aware", "round_robin", "least_load"] = "cache_aware"
    # follow the cache when the matched prefix covers at least this fraction of the request's
    # text; below it, the replica with the smallest prefix tree (the most room) gets it
    cache_threshold: float = Field(default=0.5, ge=0, le=1)
    # the load is uneven (cache_aware then picks the least-loaded replica) when the most and the
    # least loaded replicas differ by more than abs requests in flight AND by more than rel times
    balance_abs_threshold: int = Field(default=32, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1)
    # size bound of each replica's prefix tree, in characters of request text (LRU beyond it)
    max_tree_chars: int = Field(default=8_000_000, gt=0)
    tree_block_chars: int = Field(default=16, ge=1, le=4096)  # granularity of the prefix tree
    replica_start_timeout_s: float = Field(default=900.0, gt=0)


class PluginsSection(_Section):
    prefer: dict[str, str] = Field(default_factory=dict)  # {"kind/name": distribution} on conflicts
    disable: list[str] = Field(default_factory=list)  # plugin names never loaded


class Config(_Section):
    model: ModelSection = ModelSection()
    stack: StackSection = StackSection()
    speculative: SpeculativeSection = SpeculativeSection()
    scheduler: SchedulerSection = SchedulerSection()
    runtime: RuntimeSection = RuntimeSection()
    server: ServerSection = ServerSection()
    router: RouterSection = RouterSection()
    plugins: PluginsSection = PluginsSection()

    @field_validator(
        "model", "stack", "speculative", "scheduler", "runtime", "server", "router", "plugins", mode="before"
    )
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return {} if v is None else v  # an empty YAML section ("stack:") means defaults

    @classmethod
    def build(cls, data: dict[str, Any]) -> Config:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e)) from None

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
        """YAML file (optional) merged under `overrides` (nested dict, e.g. {"scheduler": {...}}) by
        `merge_layers`."""
        data: dict[str, Any] = {}
        if path is not None:
            data = read_yaml(path)
            _check_file_api_key(data, path)
        return cls.build(merge_layers(data, overrides or {}))

    def check_speculative_settings_used(self) -> None:
        """Raise ConfigError when the `speculative` section differs from its defaults while `stack.speculative`
        names no drafter: the settings would be ignored without a word (audit 34). Entry points call it on
        the config they run (after every override), since a drafter may come from a later flag."""
        if self.stack.speculative not in (None, "none"):
            return
        changed = sorted(k for k, v in self.speculative.model_dump().items()
                         if v != SpeculativeSection.model_fields[k].get_default(call_default_factory=True))
        if changed:
            raise ConfigError(f"speculative settings ({', '.join(changed)}) have no effect without a drafter: "
                              "name one in stack.speculative (e.g. stack.speculative=ngram; `radixserve plugins` "
                              "lists the installed drafters)")

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """This config under `overrides`, a later layer (`merge_layers`). Only the keys some layer set are
        carried (the rest are defaults either way), so a later layer still sees which component an earlier
        one named and which one it left to the default."""
        return Config.build(merge_layers(self.model_dump(exclude_unset=True), overrides))

    def to_yaml(self) -> str:
        """The config as a stack file that reads back as the same config. An unset `server.api_key` is left out:
        a file's `api_key: null` is refused (`_check_file_api_key`: it reads as a key given with no value)."""
        data = self.model_dump()
        if data["server"].get("api_key") is None:
            data["server"].pop("api_key", None)
        return yaml.safe_dump(data, sort_keys=False)


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: YAML keeps the last silently, so a
    repeated `stack:` section would drop the first one's settings without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise _DuplicateKey(f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory, not a YAML file")
    if not p.exists():  # a device or a pipe (/dev/null, bash's <(...)) is read like a file
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    except (UnicodeDecodeError, OSError) as e:  # a binary file, or one this user cannot read
        raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# (section, key) naming a component -> (section, key) of the keyword arguments it is built with. Their options
# belong to the component an earlier layer named: merge_layers drops them when a later layer names another one
COMPONENT_OPTIONS: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
    (("stack", "prefix_cache"), ("stack", "prefix_cache_options")),
    (("stack", "policy"), ("stack", "policy_options")),
    (("stack", "speculative"), ("speculative", "options")),
    (("model", "load_format"), ("model", "weight_source_options")),
)
_UNSET = object()


def _get(data: dict[str, Any], section: str, key: str) -> Any:
    part = data.get(section)
    return part.get(key, _UNSET) if isinstance(part, dict) else _UNSET


def _same_component(key: str, old: Any, new: Any) -> bool:
    if key == "load_format" and "auto" in (old, new):
        # auto: the weight source that declares the file's suffix, unknown here; its options are checked
        # against whichever it is at start-up
        return True
    return old == new


def merge_layers(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` (a later layer: command-line overrides over the YAML file, flags over those, Engine keywords over
    `config=`) merged over `base`, key by key as `deep_merge` does, except for components' options
    (`COMPONENT_OPTIONS`: `stack.prefix_cache_options`, `stack.policy_options`, `speculative.options`,
    `model.weight_source_options`):
    - an explicit `{}` or null replaces the earlier options instead of adding nothing to them;
    - where `top` names another component than `base` named (`stack.policy=lpm` over a file's `spf-aging`),
      `base`'s options are dropped (logged): they are the old component's; `top`'s own options, if any, are
      the new one's. Options whose component `base` left to the default are kept (a file may hold the options
      of a drafter the command line names)."""
    out = deep_merge(base, top)
    for (section, key), (opt_section, opt_key) in COMPONENT_OPTIONS:
        given = _get(top, opt_section, opt_key)
        if given is not _UNSET and (given is None or given == {}):
            out[opt_section] = {**out[opt_section], opt_key: {}}
            continue
        old, new, earlier = _get(base, section, key), _get(top, section, key), _get(base, opt_section, opt_key)
        # an earlier null (no drafter) or unset key named no component: its options wait for a later one's
        if (old is _UNSET or old is None or new is _UNSET or _same_component(key, old, new)
                or not isinstance(earlier, dict) or not earlier or not isinstance(out.get(opt_section), dict)):
            continue
        out[opt_section] = {**out[opt_section], opt_key: dict(given) if isinstance(given, dict) else {}}
        logger.warning("%s.%s is now %r (was %r): the options given for %r (%s.%s %s) are dropped%s", section, key,
                       new, old, old, opt_section, opt_key, earlier,
                       f"; {new!r} gets {given}" if isinstance(given, dict) else "")
    return out


def api_key_or_env(api_key: str | None) -> str | None:
    """The API key `bench serve` sends: the one given, else $RADIXSERVE_API_KEY when set and not empty."""
    return api_key if api_key is not None else os.environ.get("RADIXSERVE_API_KEY") or None


def with_env_api_key(config: Config) -> Config:
    """`config` with $RADIXSERVE_API_KEY as server.api_key when neither the YAML nor the command line set
    one: the environment is a default (defaults < environment < YAML < command line), so a key given
    explicitly always wins. An empty variable is refused where it would apply, as `--api-key ""` is:
    `RADIXSERVE_API_KEY=$KEY` with KEY unset must not serve every route without authentication."""
    env = os.environ.get("RADIXSERVE_API_KEY")
    if config.server.api_key is None and env is None and os.environ.get("VLLM_API_KEY"):
        # a vLLM unit file or secret carried over: serving without the key it meant would be an open server
        raise ConfigError("VLLM_API_KEY is set, but RadixServe reads its API key from RADIXSERVE_API_KEY or "
                          "--api-key (server.api_key): set one of them, or unset VLLM_API_KEY to serve "
                          "without authentication")
    if config.server.api_key is not None or env is None:
        return config
    if not env.strip():
        raise ConfigError("RADIXSERVE_API_KEY is set but empty (an unset variable?): give a key, or unset it "
                          "to serve without authentication")
    return config.with_overrides({"server": {"api_key": env}})


def _check_file_api_key(data: dict[str, Any], path: str | Path) -> None:
    """A YAML file's `server.api_key` must be a string: `api_key:` with no value (null) turned authentication
    off without a word, and a number was rewritten (`0x1F` -> "31"; operator audit 34)."""
    server = data.get("server")
    if not isinstance(server, dict) or "api_key" not in server or isinstance(server["api_key"], str):
        return
    if server["api_key"] is None:
        raise ConfigError(f"{path}: server.api_key is given with no value (it would turn authentication off): give a "
                          "key, or remove the line to serve without one")
    raise ConfigError(f"{path}: server.api_key must be a string, but YAML read the value as "
                      f"{type(server['api_key']).__name__} {server['api_key']!r}: quote it (api_key: '...')")


def parse_dotted_overrides(items: list[str]) -> dict[str, Any]:
    """["scheduler.chunked_prefill_size=16", "stack.policy=lpm"] -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            path_hint = f"; to serve a model give it as --model {item}" if not sep and ("/" in item or Path(item).exists()) else ""
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. stack.policy=lpm){path_hint}")
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if key == "server.api_key":  # taken as typed, never as YAML (operator audit 34: `=0x1F` became "31",
            # `=` of an unset variable or `=null` turned authentication off): "" is refused as an empty key
            node[leaf] = raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            problem = str(getattr(e, "problem", None) or e).strip()
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
        if isinstance(value, int | float | bool | datetime.date) and _is_string_key(parents, leaf):
            value = raw  # as typed: YAML read `0x1F` as 31, `1.50` as 1.5, `yes` as True (operator audit 34)
        node[leaf] = value
    return out


def _is_string_key(parents: list[str], leaf: str) -> bool:
    """Whether `section.key` (`parents` + `leaf`) is a string field of Config (str or str | None)."""
    model: Any = Config
    for name in parents:
        field = getattr(model, "model_fields", {}).get(name)
        model = field.annotation if field is not None else None
    field = getattr(model, "model_fields", {}).get(leaf) if model is not None else None
    if field is None:
        return False
    return field.annotation is str or (str in typing.get_args(field.annotation)
                                       and all(a in (str, type(None)) for a in typing.get_args(field.annotation)))


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            section = err["loc"][:-1]
            valid = _valid_keys(section)
            lines.append(f"unknown key {loc!r}" + (f"; valid keys here: {', '.join(valid)}" if valid else ""))
        elif isinstance(err.get("input"), dict) and err["type"] == "value_error":
            # a cross-field check (a section's model validator): its message names the fields and their
            # values; the whole section's dict would only bury it
            lines.append(f"{loc}: {err['msg']}")
        else:
            lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)


def _valid_keys(section: tuple) -> list[str]:
    model: Any = Config
    for part in section:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(model.model_fields)


def cache_dir() -> str:
    """The root of RadixServe's on-disk caches (built native kernels, GGUF tokenizer conversions,
    prepared serving tokenizers): $RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    return os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def check_cache_dir() -> str:
    """`cache_dir()`, created if missing; a ConfigError naming it (and RADIXSERVE_CACHE_DIR) where it
    cannot be written. Why up front: the children found it mid-start (kernel builds, the tokenizer)
    with a traceback and a message about the tokenizer (a read-only home under systemd or Kubernetes)."""
    path = cache_dir()
    source = "RADIXSERVE_CACHE_DIR" if os.environ.get("RADIXSERVE_CACHE_DIR") else "the default cache directory"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{source} {path!r} cannot be written ({e.strerror or e}): RadixServe keeps its built "
                          "native kernels and prepared tokenizers there; set RADIXSERVE_CACHE_DIR to a writable "
                          "directory") from None
    return path


def torch_cannot_use_cuda() -> bool:
    """True when `torch.cuda.is_available()` is certainly False, found without importing torch: no
    torch, a torch built without CUDA or ROCm (its version.py says so), or a CUDA build without the
    CUDA driver library to load. False means "ask torch"."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            version = f.read()
    except OSError:
        return False
    builds = dict(re.findall(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", version, re.MULTILINE))
    if builds.get("hip", "None") != "None":
        return False  # ROCm: torch.cuda drives AMD GPUs through its own runtime
    if builds.get("cuda") == "None":
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False
