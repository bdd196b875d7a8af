"""ModelRunner: owns the model, the KV memory pools, the attention backend and the sampler, and
runs one scheduled batch at a time (same process as the scheduler)."""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

import torch

from radixserve import native
from radixserve.config import Config
from radixserve.interfaces import AttentionRunnerInfo, LatentAttentionDims
from radixserve.interfaces.model import attention_dims_of
from radixserve.interfaces.target_states import HiddenRows, TargetStates
from radixserve.layers import lowbit_gemv
from radixserve.layers.attention import check_backend_supports_layers, check_kv_layout
from radixserve.layers.distributed import TPGroup
from radixserve.layers.gemv_selection import attach_batch1_gemv, batch1_gemv_pdl_enabled
from radixserve.layers.logits import select_logit_rows
from radixserve.layers.rotary import reserve_rotary_caches
from radixserve.memory import (
    KVPool,
    LatentKVPool,
    ReqToTokenPool,
    TokenAllocator,
    kv_bytes_per_token,
    latent_bytes_per_token,
)
from radixserve.memory.fp8_kv import FP8_KV_DTYPE, KV_CACHE_DTYPES, KVScaleCollector
from radixserve.model_loader import load_model
from radixserve.model_loader.sources import open_checkpoint
from radixserve.plugins.attention_class import check_attention_class, head_dim_before_loading
from radixserve.plugins.registry import Registry
from radixserve.plugins.stack import check_backend_attention_type, resolve_stack
from radixserve.sampling import SampleOutput, Sampler, SamplingBatch
from radixserve.sampling.batch import DraftHistory
from radixserve.state import (
    BatchResult,
    ForwardBatch,
    ForwardMode,
    LaunchedBatch,
    PromptLogprobRows,
    ScheduledBatch,
    SpecVerify,
    tree_block,
)
from radixserve.tokenizer import eos_token_ids, load_tokenizer
from radixserve.tree_decode_rows import TreeDecodeRows, node_depths

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REQ_POOL_EXTRA_ROWS = 4  # spare rows so a request can be admitted while another is being freed
PROMPT_SCORE_BLOCK = 256  # prompt rows scored per logits block (256 x a 128k vocabulary: 128 MB of fp32)


class _PromptScores(NamedTuple):
    """A batch's prompt logprobs on the device (ScheduledBatch.prompt_logprob_rows, in row order)."""

    token_logprobs: torch.Tensor  # [rows] fp32
    token_ranks: torch.Tensor  # [rows] int64: vocabulary entries at least as likely (1: the likeliest)
    top_logprobs: torch.Tensor | None  # [rows, top] fp32, best first; None when top == 0
    top_ids: torch.Tensor | None  # [rows, top] int64




class ModelRunner:
    """Loads the model named by `config.model.path` and serves `run_batch` / `forward_logits`.

    Public attributes read by the scheduler: hf_config, model, device, dtype, req_to_token_pool,
    token_allocator, kv_pool, max_total_tokens, context_len, vocab_size, eos_token_ids, tokenizer."""

    def __init__(self, config: Config, registry: Registry | None = None, show_progress: bool = True,
                 tp_group: TPGroup | None = None) -> None:
        """`registry`: the process's plugin registry (None: built from `config`). `tp_group`: this
        rank's tensor-parallel group (needed when runtime.tp_size > 1; see radixserve/tensor_parallel.py): rank 0
        broadcasts every forward to the others, which run it through `tensor_parallel.follow`."""
        self.config = config
        self.registry = registry if registry is not None else Registry.from_config(config)
        rt = config.runtime
        rt.check_device_usable()  # a clear line, not torch's "not compiled with CUDA" from deep inside
        if rt.num_threads:
            torch.set_num_threads(rt.num_threads)
        self.device = torch.device(rt.resolved_device())
        self.dtype = _DTYPES[rt.resolved_dtype(self.device.type)]
        # the KV pool's element type (runtime.kv_cache_dtype; "auto": the model dtype)
        self.kv_dtype = KV_CACHE_DTYPES.get(rt.kv_cache_dtype, self.dtype)
        self._kv_scales = KVScaleCollector()  # the checkpoint's k_scale / v_scale, filled while loading
        self.tp_group = tp_group if tp_group is not None else TPGroup.single()
        if rt.tp_size != self.tp_group.size:
            raise ValueError(f"runtime.tp_size={rt.tp_size} needs a TPGroup of that size (got {self.tp_group!r}): "
                             "tensor-parallel ranks are started by `radixserve serve --tp N` or Engine(tp_size=N)")
        if self.tp_group.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU

        # every component checked before the model path is even resolved (a Hub id may download),
        # then the quantization against the checkpoint, all before loading
        early = resolve_stack(config, self.registry, self.device.type)
        # first start: the backend's kernels compile while the weights load, not after
        attention_cls = self.registry.load("attention", early.attention.name)
        # a class the runner could not build fails now, not after the load (and before a Hub download)
        check_attention_class(attention_cls, early.attention.name, self.device.type,
                              rt.resolved_dtype(self.device.type))
        native.build_in_background([lambda: attention_cls.build_native_kernels(self.device.type)])
        checkpoint = open_checkpoint(config, self.registry)
        self.model_path, source, self.hf_config, choice = (checkpoint.path, checkpoint.source, checkpoint.hf_config,
                                                           checkpoint.choice)
        arch = choice.architecture
        logger.info("model %s", choice.describe())
        self.context_len = self._context_len(choice)  # a context beyond the model's positions fails before loading
        model_cls = choice.cls
        # the model's declared KV memory picks the pool and the default backend (docs/mla.md)
        self.attention_type = getattr(model_cls, "attention_type", "standard")
        model_name = f"model architecture {arch!r} ({model_cls.__module__}.{model_cls.__name__})"
        self.stack = resolve_stack(config, self.registry, self.device.type, self.model_path,
                                   attention_type=self.attention_type, model_name=model_name,
                                   head_dim=head_dim_before_loading(model_cls, self.hf_config, self.attention_type))
        self._model_name = model_name
        quant = self._quant = self._quant_method(source)
        logger.info("stack: %s; weights: %s", self._stack_summary(),
                    "unquantized" if quant is None else f"{type(quant).__name__} ({type(quant).__module__})")
        tp = self.tp_group if self.tp_group.size > 1 else None
        if tp is not None:
            check_model_tensor_parallel(arch, model_cls, quant, self.hf_config, tp.size, quant_label=self.quant_label,
                                        quant_built_by=self._quant_built_by)
        torch.manual_seed(rt.seed)
        gemv_pdl = batch1_gemv_pdl_enabled(rt.batch1_gemv_pdl, self.device)  # an unusable `on` fails before loading
        self.model = load_model(
            source, self.hf_config, model_cls, self.device, self.dtype, quant, seed=rt.seed, show_progress=show_progress,
            tp_group=tp, kv_scales=self._kv_scales, lowbit_gemv=lowbit_gemv.resolve(rt.lowbit_gemv, self.device),
            cpu_matmul_precision=rt.cpu_matmul_precision, quant_label=self.quant_label,
            check_built=self._check_attention_options,  # windows, soft-capping: refused before the weights load
            model_label=choice.describe(),  # "architecture X: native plugin 'x' (distribution version)"
        )
        n_gemv = attach_batch1_gemv(self.model, rt.batch1_gemv, self.device,  # per-layer choice, before graphs
                                    pdl=gemv_pdl,
                                    fuse_norm=rt.batch1_gemv_fuse_norm, fuse_silu=rt.batch1_gemv_fuse_silu)
        if n_gemv:
            logger.info("batch-1 Triton GEMV on %d linear layers (runtime.batch1_gemv=%s, fuse_norm=%s, fuse_silu=%s, "
                        "pdl=%s)", n_gemv, rt.batch1_gemv, rt.batch1_gemv_fuse_norm, rt.batch1_gemv_fuse_silu, gemv_pdl)
        self.latent_dims = self._latent_dims() if self.attention_type == "latent" else None
        self.vocab_size = int(self.hf_config.vocab_size)
        reserve_rotary_caches(self.model, self.context_len, self.device)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.model_path)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._init_memory()
        self._init_attention()
        self.sampler = Sampler()
        self.graph_runner = None
        self.extend_graph_runner = None  # ExtendGraphRunner when runtime.cuda_graph_extend_max_tokens > 0
        self.tree_rows: TreeDecodeRows | None = None  # scratch rows: tree verifies as decode rows (graphs)
        self.last_run_used_cuda_graph = False
        self.target_states = self._target_states()
        if self.device.type == "cuda" and rt.cuda_graph:
            self._init_cuda_graphs()
        elif rt.cuda_graph_extend_max_tokens:  # set, but nothing will capture: say so rather than ignore it
            logger.info("runtime.cuda_graph_extend_max_tokens=%d has no effect: CUDA graphs run on CUDA devices "
                        "with runtime.cuda_graph on (device %s, cuda_graph %s)", rt.cuda_graph_extend_max_tokens,
                        self.device.type, rt.cuda_graph)

    # ---- setup ----------------------------------------------------------------------------
    def _quant_method(self, source):
        """The layers' QuantMethod. Also sets `quant_label` (how errors name it: the registered component
        and its distribution), `_quant_origin` (where its name came from, for the start-up log) and
        `_quant_built_by` (the from_config call that built it)."""
        from radixserve.model_loader.quant_select import build_quant_method, chosen_quant_method, quant_label

        self._quant_built_by = None
        if source.weight_source is not None:  # the file's reader is also its layers' QuantMethod
            spec = self.registry.weight_source_named(source.format)  # open_source named it so
            self.quant_label = quant_label(spec)
            self._quant_origin = ("weight source", spec.name)
            return source.weight_source
        choice = chosen_quant_method(self.registry, self.stack, self.hf_config)
        method = build_quant_method(self.registry, choice, self.device, self.dtype)
        self.quant_label = quant_label(choice.spec)
        self._quant_origin = (choice.origin, choice.spec.name)
        self._quant_built_by = choice.built_by
        return method

    def _stack_summary(self) -> str:
        """The start-up log's `stack:` list: each selected component with the options it was built with, and the
        quantization wherever its name came from (stack.quantization; else "(checkpoint)" or "(weight source)")."""
        parts = []
        for kind, entry in self.resolved_stack_info().items():
            if entry is None or (kind == "quantization" and entry["origin"] == "default"):
                continue
            origin = f" ({entry['origin']})" if kind == "quantization" and entry["origin"] != "stack" else ""
            options = f" {entry['options']}" if entry.get("options") else ""
            parts.append(f"{kind} {entry['name']}{origin}{options}")
        return ", ".join(parts)

    def resolved_stack_info(self) -> dict[str, dict[str, Any] | None]:
        """The components this runtime runs, by kind (as `config show`'s resolved_stack, and /server_info's):
        name, distribution, version and, for the prefix cache, the policy, the drafter and a weight source, the options they are
        built with; the quantization's `origin` says where its name came from ("stack" for stack.quantization,
        "checkpoint", "weight source" or "default"). None: no component of that kind (no drafter, no grammar)."""
        options = {"policy": self.stack.policy_options, "drafter": self.stack.drafter_options,
                   "prefix_cache": self.stack.prefix_cache_options}
        out: dict[str, dict[str, Any] | None] = {}
        for kind, spec in self.stack.by_kind().items():
            if kind == "quantization":
                origin, name = getattr(self, "_quant_origin", ("stack", spec.name if spec else None))
                spec = spec if spec is not None and spec.name == name else self._spec_or_none("quantization", name)
                if spec is None:
                    out[kind] = None
                    continue
                out[kind] = {**_spec_info(spec), "origin": origin}
                if origin == "weight source":
                    out[kind]["options"] = dict(self.config.model.weight_source_options)
                continue
            out[kind] = None if spec is None else _spec_info(spec)
            if spec is not None and kind in options:
                out[kind]["options"] = dict(options[kind])
        return out

    def _spec_or_none(self, kind: str, name: str | None) -> Any:
        try:
            return self.registry.get(kind, name) if name else None
        except Exception:
            return None

    def quant_hooks_named(self, when: str = ""):
        """A context in which an exception out of the layers' QuantMethod hooks becomes one line naming
        the quantization component, hook and layer (`quant_select.quant_hooks_named`). For the warm-up
        and `generate`'s forwards; the loader does the same for building and preparing the layers."""
        from radixserve.model_loader.quant_select import quant_hooks_named

        return quant_hooks_named(self._quant, self.quant_label, self.model, when)

    def _context_len(self, choice: Any) -> int:
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 4096))
        scaling = getattr(self.hf_config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "dynamic":  # models audit 32: a ChildStartError with NotImplementedError natively; wrong tokens batched
            raise ValueError(
                f"{choice.describe()}: rope_scaling type 'dynamic' (dynamic NTK) is not supported: its frequencies follow "
                "the length of the sequence being computed, which neither the native rotary nor the transformers "
                "fallback (which sees a batch as one flattened sequence, so a long request would change a short one's "
                "tokens) reproduces per request; serve a checkpoint with rope_scaling linear, yarn or llama3, or none")
        if kind in ("linear", "yarn") and scaling.get("factor"):  # positions stretched past the trained ones
            model_max = int(model_max * float(scaling["factor"]))  # (llama3's max_position_embeddings already is)
        wanted = self.config.model.context_length
        if wanted is not None and wanted > model_max:  # as vLLM and SGLang: positions it never saw are refused
            raise ValueError(f"model.context_length={wanted} is beyond what this model's positions cover ({model_max}: "
                             "max_position_embeddings with its rope scaling); give at most that")
        context_limit = getattr(choice.cls, "context_limit", None)  # Model contract, API 1.16 (a class may predate it)
        limit = context_limit(self.hf_config) if context_limit is not None else None
        if limit is not None:
            tokens, why = int(limit[0]), limit[1]
            if wanted is not None and wanted > tokens:
                raise ValueError(f"model.context_length={wanted} is beyond what {choice.describe()} computes exactly "
                                 f"({tokens}: {why}); give at most that")
            if wanted is None and tokens < model_max:
                logger.warning("context capped at %d tokens (of the %d the positions cover): %s", tokens, model_max, why)
                model_max = tokens
        # a sliding window does not cap the context: the attention backends apply it per layer
        return int(wanted or model_max)

    def _latent_dims(self) -> LatentAttentionDims:
        dims = self.model.latent_attention_dims()
        if not isinstance(dims, LatentAttentionDims):
            raise TypeError(f"{self._model_name}: latent_attention_dims() must return a "
                            f"radixserve.interfaces.LatentAttentionDims, got {type(dims).__name__}")
        return dims

    def _attention_dims(self) -> tuple[int, int, int, int]:
        """(layers, heads, KV heads, head dim) on this rank: the model's own (Model.attention_dims),
        else the config's. A rank holds heads / tp_size query heads and kv_heads / tp_size KV heads,
        or one replicated KV head when there are fewer KV heads than ranks."""
        dims = self.model.attention_dims()
        layers, heads, kv_heads, head_dim = dims if dims is not None else attention_dims_of(self.hf_config)
        tp = self.tp_group.size
        if tp > 1:
            heads //= tp
            kv_heads = kv_heads // tp if kv_heads >= tp else 1
        return layers, heads, kv_heads, head_dim

    def _kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of the pool rows; a latent pool is one "head" of the latent
        row width per layer and token."""
        if self.latent_dims is not None:
            return self.latent_dims.num_layers, 1, self.latent_dims.latent_width
        layers, _, kv_heads, head_dim = self._attention_dims()
        return layers, kv_heads, head_dim

    def _num_heads(self) -> int:
        return self.latent_dims.num_heads if self.latent_dims is not None else self._attention_dims()[1]

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV memory takes across all layers (latent rows for a latent model)."""
        if self.latent_dims is not None:
            d = self.latent_dims
            return latent_bytes_per_token(d.num_layers, d.kv_lora_rank, d.qk_rope_head_dim, self.dtype)
        layers, kv_heads, head_dim = self._kv_shape()
        return kv_bytes_per_token(layers, kv_heads, head_dim, self.kv_dtype)

    def allocator_retries(self) -> int:
        """How often the CUDA caching allocator had to free its cached blocks and retry an allocation
        since start (each retry synchronises the device: a step whose activations barely fit slows
        down); 0 on the CPU."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def _kv_tokens(self) -> int:
        sched = self.config.scheduler
        if sched.max_total_tokens:
            return sched.max_total_tokens
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * sched.mem_fraction - (total - free)  # what the fraction leaves after weights
        else:
            budget = sched.cpu_kv_cache_gb * 2**30
        if budget <= 0:
            raise RuntimeError("no memory left for the KV cache after loading weights; raise mem_fraction")
        return max(1, int(budget // self.kv_bytes_per_token()))  # as tokens_for_budget, for either pool

    def _fit_context_to_pool(self) -> None:
        """A request (prompt + output) never holds more KV slots than the pool has: a context above that was
        advertised (/v1/models' max_model_len) and taken as the default output budget (the rest of the context),
        so every chat request without max_tokens was refused naming max_new_tokens (long-context audit 34).
        A context asked for in model.context_length is an error; the model's own is capped, with a warning."""
        if self.max_total_tokens >= self.context_len:
            return
        fix = ("raise scheduler.cpu_kv_cache_gb (CPU), scheduler.mem_fraction (GPU) or scheduler.max_total_tokens")
        if self.config.model.context_length:
            raise ValueError(f"model.context_length={self.context_len} exceeds the KV pool's {self.max_total_tokens} "
                             f"token slots (one request's prompt and output must fit it): lower it, or {fix}")
        logger.warning("the KV pool holds %d tokens, fewer than the model's context of %d: the context is capped at %d "
                       "(prompt + output of one request); %s", self.max_total_tokens, self.context_len,
                       self.max_total_tokens, fix)
        self.context_len = self.max_total_tokens

    def _init_memory(self) -> None:
        layers, kv_heads, head_dim = self._kv_shape()
        if self.latent_dims is None:
            check_kv_layout(self.model, layers, kv_heads, head_dim, self._model_name)
        # every rank's pool has the same slots (rank 0 allocates for all): the smallest one decides
        self.max_total_tokens = self.tp_group.min_int(self._kv_tokens()) if self.tp_group.size > 1 else self._kv_tokens()
        self._fit_context_to_pool()
        pool_cls = ReqToTokenPool
        if self.tp_group.size > 1 and self.tp_group.is_leader:
            from radixserve.tensor_parallel import JournaledReqToTokenPool

            pool_cls = JournaledReqToTokenPool  # its writes are replayed on the other ranks
        self.max_running_requests = self.config.scheduler.max_running_requests
        self._tree_scratch = self._tree_scratch_rows()
        self.req_to_token_pool = pool_cls(
            self.max_running_requests + REQ_POOL_EXTRA_ROWS + self._tree_scratch, self.context_len, self.device
        )
        # scheduler.debug_kv_checks: double frees raise at once (a prefix cache's bug, named by the scheduler)
        self.token_allocator = TokenAllocator(self.max_total_tokens,
                                              debug_checks=self.config.scheduler.debug_kv_checks)
        if self.latent_dims is not None:
            d = self.latent_dims
            self.kv_pool = LatentKVPool(self.max_total_tokens, d.num_layers, d.kv_lora_rank, d.qk_rope_head_dim,
                                        self.dtype, self.device)
        else:
            scales = {}
            if self.kv_dtype == FP8_KV_DTYPE:  # per-layer scales from the checkpoint, else 1.0
                k_scales, v_scales = self._kv_scales.scales(layers)
                scales = {"k_scales": k_scales, "v_scales": v_scales}
                logger.info("KV cache %s: k/v scales %s", self.config.runtime.kv_cache_dtype,
                            "from the checkpoint" if self._kv_scales else "1.0 (the checkpoint has none)")
            self.kv_pool = KVPool(self.max_total_tokens, layers, kv_heads, head_dim, self.kv_dtype, self.device,
                                  **scales)
        logger.info("KV pool: %s attention, %d token slots, %d bytes per token, %.2f GiB", self.attention_type,
                    self.max_total_tokens, self.kv_bytes_per_token(), self.kv_pool.nbytes() / 2**30)

    def _tree_scratch_rows(self) -> int:
        """Pool rows to reserve so tree verifies replay the decode graphs (tree_decode_rows.py):
        with CUDA graphs and a drafter that may propose trees (speculative.topk > 1), one per graph
        row a node off its request's first chain can take: the largest graph batch less one (each
        request's root reads its own row)."""
        cfg, rt = self.config, self.config.runtime
        if not (self.device.type == "cuda" and rt.cuda_graph and cfg.stack.speculative and cfg.speculative.topk > 1):
            return 0
        from radixserve.cuda_graph_runner import default_capture_sizes

        max_bs = default_capture_sizes(min(rt.cuda_graph_max_bs, cfg.scheduler.max_running_requests))[-1]
        return max_bs - 1

    def _check_attention_options(self, model) -> None:
        """The built model's per-layer attention options (sliding windows, soft-capping) against what the
        stack's attention backend declares, before the weights and the KV pool take time and memory."""
        name = self.stack.attention.name
        check_backend_supports_layers(model, self.registry.load("attention", name), name)

    def _init_attention(self) -> None:
        name = self.stack.attention.name
        cls = self.registry.load("attention", name)
        layers, kv_heads, head_dim = self._kv_shape()
        dtype_name = str(self.dtype).removeprefix("torch.")
        # the head size a model decides itself (latent rows, its own attention_dims) is only known now
        check_attention_class(cls, name, self.device.type, dtype_name, head_dim)
        check_backend_attention_type(cls, name, self.attention_type, self._model_name)  # standard / latent
        self.attn_backend_name = name
        self.attn_backend = cls(
            AttentionRunnerInfo(
                device=self.device, dtype=self.dtype, num_layers=layers,
                num_heads=self._num_heads(), num_kv_heads=kv_heads, head_dim=head_dim,
                req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool,
                max_bs=self.req_to_token_pool.size, context_len=self.context_len, latent=self.latent_dims,
                matmul_precision=self.config.runtime.cpu_matmul_precision if self.device.type == "cpu" else "highest",
            )
        )

    def _init_cuda_graphs(self) -> None:
        from radixserve.cuda_graph_runner import DecodeGraphRunner, default_capture_sizes

        if not self.attn_backend.supports_cuda_graph():
            logger.info("attention backend %r has no CUDA-graph support; decode runs eagerly", self.attn_backend_name)
            return
        # a row no request ever gets: padded graph rows read it (all zeros -> the pool's dummy slot 0)
        dummy_row = self.req_to_token_pool.alloc()
        sizes = default_capture_sizes(min(self.config.runtime.cuda_graph_max_bs, self.max_running_requests))
        if self._tree_scratch:  # rows _init_memory added to the pool for them
            self.tree_rows = TreeDecodeRows([self.req_to_token_pool.alloc() for _ in range(self._tree_scratch)])
            logger.info("tree verifies as decode rows: %d scratch rows of the ReqToTokenPool (%.1f MiB)",
                        self._tree_scratch, self._tree_scratch * self.context_len * 8 / 2**20)
        logger.info("capturing decode CUDA graphs for batch sizes %s", sizes)
        try:
            self.graph_runner = DecodeGraphRunner(
                self.model, self.attn_backend, self.req_to_token_pool, self.kv_pool, self.device, sizes, dummy_row
            )
            self._record_in_graphs()  # a drafter that asked before the graphs existed
        except Exception as e:  # keep serving, but loudly: decode is then several times slower
            logger.error("CUDA graph capture failed (%r); decode runs eagerly. Disable with runtime.cuda_graph=false", e)
            torch.cuda.synchronize(self.device)
        if self.config.runtime.cuda_graph_extend_max_tokens:
            self._init_extend_graphs(dummy_row)

    def _init_extend_graphs(self, dummy_row: int) -> None:
        from radixserve.extend_graph_runner import ExtendGraphRunner, default_extend_token_sizes

        rt = self.config.runtime
        if not self.attn_backend.supports_extend_cuda_graph():
            logger.warning("runtime.cuda_graph_extend_max_tokens=%d: attention backend %r has no extend CUDA-graph "
                           "support; prefill runs eagerly", rt.cuda_graph_extend_max_tokens, self.attn_backend_name)
            return
        # the padding request holds up to that many tokens in one ReqToTokenPool row: the context length at most
        sizes = default_extend_token_sizes(min(rt.cuda_graph_extend_max_tokens,
                                               int(self.req_to_token_pool.req_to_token.shape[1])))
        max_reqs = min(rt.cuda_graph_extend_max_requests, self.max_running_requests + 1)
        logger.info("capturing extend CUDA graphs for %d token counts up to %d (%d request slots)", len(sizes),
                    sizes[-1], max_reqs)
        try:
            self.extend_graph_runner = ExtendGraphRunner(self.model, self.attn_backend, self.req_to_token_pool,
                                                         self.kv_pool, self.device, sizes, max_reqs, dummy_row)
        except Exception as e:  # keep serving: prefill then runs eagerly, as without the option
            logger.error("extend CUDA graph capture failed (%r); prefill runs eagerly. Disable with "
                         "runtime.cuda_graph_extend_max_tokens=0", e)
            torch.cuda.synchronize(self.device)

    def _target_states(self) -> TargetStates:
        """What a drafter may read of the model (docs/contracts.md, "Target hidden states")."""
        model = self.model
        capable = bool(getattr(model, "supports_aux_hidden_states", False))

        def enable(final: bool, aux_layers: tuple[int, ...]) -> None:
            if aux_layers:
                model.set_aux_hidden_state_layers(tuple(aux_layers))
            self._record_in_graphs()

        def embed(ids: torch.Tensor) -> torch.Tensor:
            if not capable:
                raise NotImplementedError(f"{type(model).__name__} does not expose its input embedding")
            with torch.inference_mode():
                return model.embed_input_ids(ids)

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(hidden)

        return TargetStates(
            int(self.hf_config.num_hidden_layers), int(self.hf_config.hidden_size), self.vocab_size, self.dtype, capable,
            enable, embed, logits,
        )

    def _record_in_graphs(self) -> None:
        """Recapture the decode graphs so they write the hidden rows the drafter asked for (a
        failure drops the graphs, as at start-up: decode then runs eagerly). Not under tensor
        parallelism: capturing runs the forward's collectives, which the other ranks would not join
        (there the recording forwards stay eager on rank 0, as before)."""
        ts, gr = self.target_states, self.graph_runner
        if gr is None or not ts.recording or self.tp_group.size > 1:
            return
        try:
            gr.set_recording(ts.final, ts.aux_layers, int(self.hf_config.hidden_size), self.dtype)
        except Exception as e:
            logger.error("recapturing the decode CUDA graphs with hidden-state recording failed (%r); "
                         "decode runs eagerly", e)
            self.graph_runner = None
            torch.cuda.synchronize(self.device)

    def _record_hidden(self, sb: ScheduledBatch, hidden: torch.Tensor | None, aux: torch.Tensor | None) -> None:
        """Hand each request's rows of this forward to the drafter (only while one asked): `hidden`
        the final rows, `aux` the requested layers' rows concatenated, one row per new token."""
        ts = self.target_states
        at = 0
        for i, (req, p, n) in enumerate(zip(sb.reqs, sb.prefix_lens, sb.extend_lens, strict=True)):
            parents = sb.spec.parents[i] if sb.spec is not None else None
            positions = [p + d for d in node_depths(parents)] if parents is not None else list(range(p, p + n))
            tokens = list(sb.input_ids[at : at + n]) if sb.future_inputs is None else []
            ts.record(req.rid, HiddenRows(
                positions, tokens, list(parents) if parents is not None else None,
                hidden[at : at + n].clone() if ts.final else None,
                aux[at : at + n].clone() if aux is not None else None,
            ))
            at += n

    def warmup(self) -> None:
        """Tiny prefills + decodes before serving: JIT-compiled kernels (the fused layers, Triton's
        extend kernel) compile here instead of inside the first requests' time to first token. The
        prompt of 4 tokens is a fresh prefill (triton: its SDPA path); the two of 48 and 45 tokens are
        prefilled in 32-token chunks, so their second chunks extend a cached prefix (the extend kernel
        every chunked or prefix-cached prompt runs: on the H200 its first compile cost the first served
        requests ~1.8 s of TTFT, session 11). Leaves the pools as it found them."""
        from radixserve.static_batch import run_static_batch

        with self.quant_hooks_named(" during the warm-up"):  # a quantization plugin's apply: one line naming it
            run_static_batch(self, [[1, 2, 3, 4]], max_new_tokens=2)
            # bounded by small contexts and KV pools (tests, tiny configs): the chunked pair only where it fits
            if self.context_len >= 51 and self.max_total_tokens >= 2 * 51:
                run_static_batch(self, [list(range(1, 49)), list(range(1, 46))], max_new_tokens=2, prefill_chunk=32)

    @property
    def supports_tree_mask(self) -> bool:
        """Whether verify batches may carry tree drafts (the attention backend honours tree masks)."""
        return bool(getattr(self.attn_backend, "supports_tree_mask", False))

    @property
    def tokenizer(self):
        """Loaded on first use (tiny test checkpoints have none; GGUF tokenizers take seconds), once:
        the scheduler's thread (stop strings) and a grammar thread may ask at the same time."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_path, self.config.model.tokenizer)
        return self._tokenizer

    # ---- running --------------------------------------------------------------------------
    def prepare(self, sb: ScheduledBatch) -> ForwardBatch:
        """ForwardBatch (device tensors plus host length lists) for a scheduled batch."""
        prefix, ext = list(sb.prefix_lens), list(sb.extend_lens)
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        if self._verify_as_decode_rows(sb):
            return self._prepare_decode_rows(sb)
        tree_blocks = None
        if sb.spec is not None:  # a draft token sits at prefix + its depth in the draft tree
            depths = [node_depths(ps) for ps in sb.spec.parents]
            positions = torch.tensor([p + d for p, ds in zip(prefix, depths, strict=True) for d in ds], dtype=torch.int64)
            if sb.spec.has_tree:
                tree_blocks = [tree_block(ps) for ps in sb.spec.parents]
        else:
            positions = torch.cat([torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix, ext, strict=True)])
        dev = self.device

        def to_dev(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        if sb.future_inputs is not None:  # overlap: the previous step's tokens, still on the device
            f = sb.future_inputs
            input_ids = f.tokens[torch.tensor(f.rows, dtype=torch.int64).to(f.tokens.device, non_blocking=True)]
        else:
            input_ids = to_dev(sb.input_ids)
        tree_mask = None
        if tree_blocks is not None:
            if not self.supports_tree_mask:
                raise ValueError(f"attention backend {self.attn_backend_name!r} cannot verify tree drafts")
            flat = [x for block in tree_blocks for row in block for x in row]
            tree_mask = torch.tensor(flat, dtype=torch.bool).to(dev, non_blocking=True)
        return ForwardBatch(
            tree_mask=tree_mask,
            tree_mask_cpu=tree_blocks,
            mode=sb.mode,
            batch_size=sb.batch_size,
            input_ids=input_ids,
            positions=positions.to(dev, non_blocking=True),
            req_pool_indices=to_dev(sb.req_pool_indices),
            seq_lens=to_dev(seq),
            prefix_lens=to_dev(prefix),
            extend_lens=to_dev(ext),
            out_cache_loc=sb.out_cache_loc.to(dev, torch.int64, non_blocking=True),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=ext,
        )

    def _verify_as_decode_rows(self, sb: ScheduledBatch) -> bool:
        """Whether a verify runs as a DECODE batch of one row per new token (CUDA graphs apply):
        on a backend whose decode rows may share a request, chain drafts while the rows fit the
        captured graphs (or always without graphs), tree drafts only while they fit the graphs and
        the reserved scratch rows (`tree_rows`, see tree_decode_rows.py); otherwise the verify is
        an EXTEND batch (trees: with the tree mask), eager, with the same logits."""
        if sb.spec is None or not getattr(self.attn_backend, "decode_rows_share_requests", False):
            return False
        gr = self.graph_runner
        fits_graphs = gr is None or sum(sb.extend_lens) <= gr.max_bs
        if not sb.spec.has_tree:
            return fits_graphs
        return gr is not None and fits_graphs and self.tree_rows is not None and self.tree_rows.fits(sb.spec.parents)

    def _prepare_decode_rows(self, sb: ScheduledBatch) -> ForwardBatch:
        """A verify as a DECODE batch. Chain: token j of a request with prefix p is a row of its
        request at position p + j that sees its first p + j + 1 slots (the row holds the tokens'
        slots in order, and the backend stores every row's KV before any row attends). Tree: node j
        at depth d is a row at position p + d that sees p + d + 1 slots of its request's row (nodes
        on the first chain) or of a scratch row holding the prefix and the node's path, written here
        on the device before the forward (tree_decode_rows.py)."""
        dev = self.device
        out_cache_loc = sb.out_cache_loc.to(dev, torch.int64, non_blocking=True)
        if sb.spec.has_tree:
            plan = self.tree_rows.plan(list(sb.req_pool_indices), list(sb.prefix_lens), sb.spec.parents)
            rows, prefix, seq = plan.rows, plan.positions, plan.seq_lens
            self.tree_rows.write(plan, self.req_to_token_pool.req_to_token, out_cache_loc)
        else:
            rows, seq, prefix = [], [], []
            for idx, p, e in zip(sb.req_pool_indices, sb.prefix_lens, sb.extend_lens, strict=True):
                rows += [idx] * e
                prefix += range(p, p + e)
                seq += range(p + 1, p + e + 1)

        def to_dev(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=to_dev(sb.input_ids),
            positions=to_dev(prefix),
            req_pool_indices=to_dev(rows),
            seq_lens=to_dev(seq),
            prefix_lens=to_dev(prefix),
            extend_lens=to_dev([1] * len(rows)),
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=[1] * len(rows),
        )

    @torch.inference_mode()
    def forward_logits(self, sb: ScheduledBatch) -> torch.Tensor:
        """fp32 next-token logits [bs, vocab], one row per request (writes the batch's KV)."""
        return self._forward(sb, greedy_ids=False)[0]

    def _forward(self, sb: ScheduledBatch, greedy_ids: bool) -> tuple[torch.Tensor, bool, _PromptScores | None]:
        """(logits as `forward_logits`, False, prompt scores); or, when `greedy_ids` and the model offers
        it, (the argmax token ids [bs] int64 straight from the hidden rows, True, prompt scores). The
        prompt scores are those of `sb.prompt_logprob_rows` (None when it is None)."""
        if sb.mode is ForwardMode.DECODE and any(e != 1 for e in sb.extend_lens):
            raise ValueError("DECODE batches must have extend_lens == 1 for every request")
        tp = self.tp_group
        if tp.size > 1 and tp.is_leader:  # the followers run the same forward (tensor_parallel.py)
            self._broadcast_step(sb, greedy_ids)
        fb = self.prepare(sb)
        if tp.size > 1 and sb.future_inputs is not None:  # overlap: ids still on rank 0's device
            tp.broadcast_tensor(fb.input_ids)
        # a verify prepared as decode rows (chain or tree) is a DECODE batch and may replay a decode graph;
        # the graphs record the hidden rows a drafter reads (recaptured when it asked, see
        # _record_in_graphs); graphs recording something else are not used
        ts = self.target_states
        recording = ts.recording
        gr = self.graph_runner
        self.last_run_used_cuda_graph = (
            gr is not None and gr.can_run(fb) and (not recording or gr.recording == (ts.final, ts.aux_layers))
        )
        if self.last_run_used_cuda_graph:
            logits = gr.run(fb)[:, : self.vocab_size]
            if recording and sb.reqs:
                self._record_hidden(sb, *gr.recorded_rows(fb.batch_size))
            return logits, False, None
        er = self.extend_graph_runner  # prefill chunks (and mixed batches) of a bounded token count
        scored = sb.prompt_logprob_rows  # the graphs keep only each request's last row: score eagerly
        if er is not None and not recording and sb.spec is None and scored is None and er.can_run(fb):
            self.last_run_used_cuda_graph = True
            return er.run(fb)[:, : self.vocab_size], False, None
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if recording and sb.reqs:
            aux = torch.cat(list(self.model.aux_hidden_states), dim=-1) if ts.aux_layers else None
            self._record_hidden(sb, hidden, aux)
        scores = self._score_prompt_rows(hidden, scored) if scored is not None else None
        if sb.spec is None or fb.mode is ForwardMode.DECODE:  # a verify scores every new token
            hidden = select_logit_rows(hidden, fb)
        if greedy_ids:
            ids = self.model.greedy_token_ids(hidden, self.vocab_size)
            if ids is not None:
                return ids, True, scores
        return self.model.compute_logits(hidden)[:, : self.vocab_size], False, scores

    def _score_prompt_rows(self, hidden: torch.Tensor, scored: PromptLogprobRows) -> _PromptScores:
        """Each scored row's logprob of its next prompt token, and the top alternatives: log_softmax of
        the model's raw logits. Made PROMPT_SCORE_BLOCK rows at a time: a long prompt's [rows, vocab]
        fp32 logits would not fit at once."""
        rows = torch.tensor(scored.rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
        targets = torch.tensor(scored.targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
        token_lps, ranks, top_lps, top_ids = [], [], [], []
        for at in range(0, len(scored.rows), PROMPT_SCORE_BLOCK):
            block = slice(at, at + PROMPT_SCORE_BLOCK)
            logits = self.model.compute_logits(hidden.index_select(0, rows[block]))[:, : self.vocab_size]
            lps = torch.log_softmax(logits.float(), dim=-1)
            token_lps.append(lps.gather(1, targets[block, None]).squeeze(1))
            ranks.append((lps >= token_lps[-1][:, None]).sum(dim=1))
            if scored.top:
                vals, ids = lps.topk(scored.top, dim=-1)
                top_lps.append(vals)
                top_ids.append(ids)
        return _PromptScores(torch.cat(token_lps), torch.cat(ranks), torch.cat(top_lps) if top_lps else None,
                             torch.cat(top_ids) if top_ids else None)

    def _broadcast_step(self, sb: ScheduledBatch, greedy_ids: bool) -> None:
        from radixserve.tensor_parallel import TPRankLost, TPStep

        try:
            self.tp_group.broadcast_object(TPStep.of(sb, greedy_ids, self.req_to_token_pool.take_journal()))
        except RuntimeError as e:
            raise TPRankLost(e) from e

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow` loops (they exit 0)."""
        if self.tp_group.size > 1 and self.tp_group.is_leader:
            try:
                self.tp_group.broadcast_object(None)
            except RuntimeError as e:
                logger.warning("tensor parallelism: could not stop the other ranks (%r)", e)

    @torch.inference_mode()
    def run_batch(self, sb: ScheduledBatch) -> BatchResult:
        """Forward the batch and sample one token per request whose sample_mask is True."""
        return self.launch_batch(sb).result()

    @torch.inference_mode()
    def launch_batch(self, sb: ScheduledBatch) -> LaunchedBatch:
        """Queue the forward and the sampling of `sb` on the device and return without waiting for
        them (on CPU the work is done on return). The tokens reach the host in `result()`."""
        if sb.mode is ForwardMode.IDLE or sb.batch_size == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return LaunchedBatch(empty, lambda: BatchResult(next_token_ids=[]))
        if sb.spec is not None:
            return self._launch_verify(sb)
        mask = list(sb.sample_mask) or [True] * sb.batch_size
        keep = [i for i, m in enumerate(mask) if m]
        if not keep:  # intermediate prefill chunks: their KV (and prompt logprobs) only
            _, _, scores = self._forward(sb, greedy_ids=False)
            scores_host, ready = self._copy_to_host(*scores) if scores is not None else ([], None)
            return LaunchedBatch(torch.zeros(sb.batch_size, dtype=torch.int64, device=self.device),
                                 lambda: _with_prompt_scores(BatchResult(next_token_ids=[None] * sb.batch_size),
                                                             scores_host, ready))
        reqs = [sb.reqs[i] for i in keep]
        sampling = SamplingBatch.from_reqs(reqs, self.vocab_size, self.device)
        masked = sb.token_bitmask is not None  # structured output: the grammar decides, not the argmax
        logits, are_token_ids, scores = self._forward(sb, greedy_ids=sampling.is_plain_greedy and not masked)
        keep_dev = None  # rows to sample when some are intermediate prefill chunks
        if len(keep) != sb.batch_size:
            keep_dev = torch.tensor(keep).to(self.device, non_blocking=True)  # never a blocking copy: overlap
            logits = logits[keep_dev]
        if masked:
            if sb.token_bitmask_ready is not None:
                sb.token_bitmask_ready()  # filled on the host while the forward ran
            bitmask = sb.token_bitmask if keep_dev is None else sb.token_bitmask[keep]
            sb.apply_bitmask(logits, bitmask.to(self.device, non_blocking=True))
        if are_token_ids:  # the model's greedy ids: nothing left to sample
            out = SampleOutput(next_token_ids=logits)
        else:
            out = self.sampler.sample(logits, sampling)
        token_ids = out.next_token_ids
        if keep_dev is not None:
            token_ids = torch.zeros(sb.batch_size, dtype=torch.int64, device=self.device)
            token_ids[keep_dev] = out.next_token_ids
        (ids_host, lps_host, *scores_host), ready = self._copy_to_host(out.next_token_ids, out.token_logprobs,
                                                                        *(scores or ()))

        def resolve() -> BatchResult:
            if ready is not None:
                ready.synchronize()
            result = _with_prompt_scores(BatchResult(next_token_ids=[None] * sb.batch_size), scores_host, None)
            for j, tok in zip(keep, ids_host.tolist(), strict=True):
                result.next_token_ids[j] = int(tok)
            if lps_host is not None:
                result.token_logprobs = [None] * sb.batch_size
                for j, lp in zip(keep, lps_host.tolist(), strict=True):
                    result.token_logprobs[j] = float(lp)
            if out.top_logprobs is not None:
                result.top_logprobs = [None] * sb.batch_size
                for j, alts in zip(keep, out.top_logprobs, strict=True):
                    result.top_logprobs[j] = alts
            return result

        return LaunchedBatch(token_ids, resolve, ready.query if ready is not None else None)

    def _launch_verify(self, sb: ScheduledBatch) -> LaunchedBatch:
        """A speculative verify: one token per new token, each sampled as plain decoding would
        sample it after the draft path leading there (see DraftHistory)."""
        spec: SpecVerify = sb.spec
        rows: list[DraftHistory] = []
        start = 0
        for req, parents, n in zip(sb.reqs, spec.parents, sb.extend_lens, strict=True):
            tokens = sb.input_ids[start : start + n]
            start += n
            paths: list[list[int]] = [[]]
            for j in range(1, n):
                paths.append(paths[parents[j]] + [tokens[j]])
            rows.extend(DraftHistory(req, path) for path in paths)
        sampling = SamplingBatch.from_reqs(rows, self.vocab_size, self.device)
        logits, are_token_ids, _ = self._forward(sb, greedy_ids=sampling.is_plain_greedy)  # a verify scores no prompt
        out = SampleOutput(next_token_ids=logits) if are_token_ids else self.sampler.sample(logits, sampling)
        (ids_host, lps_host), ready = self._copy_to_host(out.next_token_ids, out.token_logprobs)
        lens = list(sb.extend_lens)

        def split(values: list) -> list[list]:
            res, at = [], 0
            for n in lens:
                res.append(values[at : at + n])
                at += n
            return res

        def resolve() -> BatchResult:
            if ready is not None:
                ready.synchronize()
            result = BatchResult(next_token_ids=[None] * sb.batch_size, spec_token_ids=split(ids_host.tolist()))
            if lps_host is not None:
                result.spec_logprobs = split(lps_host.tolist())
            if out.top_logprobs is not None:
                result.spec_top_logprobs = split(out.top_logprobs)
            return result

        return LaunchedBatch(out.next_token_ids, resolve)

    def _copy_to_host(self, *tensors: torch.Tensor | None) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
        """Start device->host copies without blocking: (the tensors' host copies, None for None;
        the event to wait on before reading them, or None)."""
        if self.device.type != "cuda":
            return list(tensors), None

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        copies = [pinned(t) for t in tensors]
        ready = torch.cuda.Event()
        ready.record()
        return copies, ready


def _spec_info(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "distribution": spec.distribution, "version": spec.version}


def _with_prompt_scores(result: BatchResult, scores_host: list, ready) -> BatchResult:
    """`result` with the batch's prompt logprobs (the host copies of a _PromptScores, or an empty list)."""
    if not scores_host:
        return result
    if ready is not None:
        ready.synchronize()
    token_lps, ranks, top_lps, top_ids = scores_host
    result.prompt_token_logprobs = token_lps.tolist()
    result.prompt_token_ranks = ranks.tolist()
    if top_lps is not None:
        result.prompt_top_logprobs = [list(zip(ids, lps, strict=True))
                                      for ids, lps in zip(top_ids.tolist(), top_lps.tolist(), strict=True)]
    return result


def check_quant_tensor_parallel(quant, tp_size: int, quant_label: str | None = None,
                                quant_built_by: str | None = None) -> None:
    """Refuse tp_size > 1 for a built quantization method (None: unquantized) whose instance does not
    declare `supports_tensor_parallel` (a class may set True and one mode of it, e.g. online
    quantization, False). Arguments as `check_model_tensor_parallel`'s."""
    from radixserve.plugins.registry import PluginError

    if tp_size <= 1 or quant is None or getattr(quant, "supports_tensor_parallel", False):
        return
    label = quant_label or f"quantization method {type(quant).__name__}"
    why = "supports_tensor_parallel is False"
    if getattr(type(quant), "supports_tensor_parallel", False):  # a mode of the method, e.g. its online one
        why = (f"the instance built by {quant_built_by or 'from_config'} sets supports_tensor_parallel False, "
               f"though its class {type(quant).__name__} sets True")
    raise PluginError(f"runtime.tp_size={tp_size}: {label} does not support tensor parallelism in this mode "
                      f"({why}); set runtime.tp_size=1")


def check_model_tensor_parallel(arch: str, model_cls: type, quant, hf_config, tp_size: int,
                                quant_label: str | None = None, quant_built_by: str | None = None) -> None:
    """Refuse tp_size > 1 for a model class or quantization method that does not declare
    `supports_tensor_parallel`, or a model whose heads do not split over the ranks. `quant_label`
    names the method as registered ("quantization method 'x' (its distribution)"; default: its class),
    `quant_built_by` how the instance was built (said when the instance's flag differs from its class's)."""
    from radixserve.plugins.registry import PluginError

    if not getattr(model_cls, "supports_tensor_parallel", False):
        raise PluginError(f"runtime.tp_size={tp_size}: model architecture {arch!r} ({model_cls.__module__}) does not "
                          "support tensor parallelism (supports_tensor_parallel is False); set runtime.tp_size=1")
    check_quant_tensor_parallel(quant, tp_size, quant_label, quant_built_by)
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if getattr(model_cls, "attention_type", "standard") == "latent":
        kv = heads  # latent attention: every rank stores the whole latent row; only the query heads split
    if heads % tp_size or (kv % tp_size if kv >= tp_size else tp_size % kv):
        raise ValueError(f"runtime.tp_size={tp_size} does not divide the model's attention heads ({heads} query, {kv} "
                         "key/value): choose a tp_size that divides both (or that the KV head count divides)")
