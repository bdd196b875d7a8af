"""Resolve a config's component stack against a registry and check it before any model loads.

Every entry point (`serve`, `generate`, `bench`, `Engine`, the scheduler process, the model
runner) calls `resolve_stack` first, so a bad stack fails in seconds with a message naming the
bad value, never after the weights are read.

Kinds and their config keys: attention <- stack.attention, prefix_cache <- stack.prefix_cache
(+ stack.prefix_cache_options), policy <- stack.policy (+ stack.policy_options), quantization <- stack.quantization,
drafter <- stack.speculative, grammar <- stack.grammar."""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.plugins.registry import (
    BUILTIN_LOAD_FORMATS,
    ComponentSpec,
    PluginError,
    build_component,
    class_problem,
    component_label,
)

if TYPE_CHECKING:
    from radixserve.config import Config
    from radixserve.plugins.registry import Registry

# the config key under `stack` that selects each kind
CONFIG_KEY_OF_KIND = {
    "attention": "attention",
    "prefix_cache": "prefix_cache",
    "policy": "policy",
    "quantization": "quantization",
    "drafter": "speculative",
    "grammar": "grammar",
}

GRAMMAR_OFF = "none"  # stack.grammar value that turns structured output off


@dataclass(frozen=True)
class ResolvedStack:
    """The components a config selects on one device (defaults filled in)."""

    device: str
    attention: ComponentSpec
    prefix_cache: ComponentSpec
    policy: ComponentSpec
    policy_options: dict[str, Any] = field(default_factory=dict)
    prefix_cache_options: dict[str, Any] = field(default_factory=dict)
    quantization: ComponentSpec | None = None  # None: from the checkpoint
    drafter: ComponentSpec | None = None  # None: no speculative decoding
    drafter_options: dict[str, Any] = field(default_factory=dict)
    grammar: ComponentSpec | None = None  # None: no grammar backend (constrained requests get a 400)

    def by_kind(self) -> dict[str, ComponentSpec | None]:
        return {
            "attention": self.attention,
            "prefix_cache": self.prefix_cache,
            "policy": self.policy,
            "quantization": self.quantization,
            "drafter": self.drafter,
            "grammar": self.grammar,
        }


def resolve_stack(config: Config, registry: Registry, device: str, model_path: str | None = None,
                  attention_type: str | None = None, model_name: str = "the model",
                  head_dim: int | None = None) -> ResolvedStack:
    """Resolve `config.stack` for `device`. Raises PluginError for an unknown component (listing the
    installed ones and the package that provides a known one), a component that does not support
    the device, a prefix cache, policy or drafter option the component does not take and, when `model_path`
    exists, a quantization method that cannot apply to it.

    `attention_type`: the model's `Model.attention_type` ("standard" or "latent") once its class is
    known (None before: the default attention backend is then the highest-priority one for the
    device). Given, the default is the highest-priority backend whose class supports that type
    (`supports_standard_attention` / `supports_latent_attention`), and a backend named in
    `stack.attention` that does not is refused, naming it, `model_name` and the type; and the backend's
    class is checked as the runner will build it (`check_attention_class`: an AttentionBackend that is
    not abstract, an `__init__(runner_info)`, and with `head_dim` given, its `supports()` of the
    device, dtype and head size), so a broken class fails before any weights load."""
    stack = config.stack
    if config.model.load_format not in BUILTIN_LOAD_FORMATS:  # a weight source's name: installed, on this device
        _on_device(registry.weight_source_named(config.model.load_format), device)
    drafter = None
    drafter_options: dict[str, Any] = {}
    if stack.speculative is not None:
        drafter = _on_device(registry.get("drafter", stack.speculative), device)
        drafter_options = check_drafter_options(registry, drafter.name, dict(config.speculative.options))
    prefix_cache = _on_device(registry.get("prefix_cache", stack.prefix_cache), device)
    cache_options = check_prefix_cache_options(registry, prefix_cache.name, dict(stack.prefix_cache_options))
    policy = _on_device(registry.get("policy", stack.policy), device)
    options = check_policy_options(registry, policy.name, dict(stack.policy_options))
    quant = None
    if stack.quantization is not None:
        quant = _on_device(registry.get("quantization", stack.quantization), device)
    kv_cache_dtype = effective_kv_cache_dtype(config, device)
    if attention_type is not None:
        check_attention_type(attention_type, model_name)
        check_latent_kv_cache_dtype(attention_type, kv_cache_dtype, model_name)
    if stack.attention is None:
        # an fp8 KV cache prefers the best backend that supports it; none: the check below names them
        attention = (default_attention(registry, device, attention_type, kv_cache_dtype)
                     or default_attention(registry, device, attention_type))
        if attention is None and attention_type is not None and registry.default("attention", device) is not None:
            raise PluginError(
                f"no installed attention backend for device {device!r} supports {attention_type} attention, which "
                f"{model_name} uses (attention_type={attention_type!r}); install one (e.g. radixserve-attention-torch_native)"
            )
        if attention is None:
            installed = ", ".join(f"{s.name} ({'/'.join(s.devices)})" for s in registry.components("attention"))
            raise PluginError(
                f"no installed attention component supports device {device!r} (installed: {installed or 'none'}); "
                "install one, e.g. pip install radixserve-attention-torch_native"
            )
    else:
        attention = _on_device(registry.get("attention", stack.attention), device)
        if attention_type is not None:
            check_backend_attention_type(registry.load("attention", attention.name), attention.name, attention_type,
                                         model_name, registry, device)
    check_backend_kv_cache_dtype(registry, attention.name, kv_cache_dtype, device)
    if attention_type is not None:  # the model's class is known, so torch is in: load and check the backend's
        from radixserve.plugins.attention_class import check_attention_class

        check_attention_class(registry.load("attention", attention.name), attention.name, device,
                              config.runtime.resolved_dtype(device), head_dim)
    resolved = ResolvedStack(
        device=device, attention=attention, prefix_cache=prefix_cache, policy=policy,
        policy_options=options, prefix_cache_options=cache_options, quantization=quant, drafter=drafter, drafter_options=drafter_options,
        grammar=resolve_grammar(config, registry, device),
    )
    if model_path is not None and os.path.exists(model_path):
        check_quantization_fits(resolved, model_path, registry, config.model.load_format)
    if config.runtime.tp_size > 1:
        for spec in resolved.by_kind().values():
            if spec is not None:
                check_tensor_parallel(spec, registry, config.runtime.tp_size)
    return resolved


ATTENTION_TYPES = {"standard": "supports_standard_attention", "latent": "supports_latent_attention"}
"""`Model.attention_type` values and the AttentionBackend class flag that declares support (plugin API 1.4)."""


def check_attention_type(attention_type: str, model_name: str = "the model") -> None:
    """ValueError for an `attention_type` other than "standard" / "latent"."""
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(f"{model_name} declares attention_type={attention_type!r}; a model's attention_type must be "
                         f"one of {', '.join(map(repr, ATTENTION_TYPES))}")


def backend_supports_attention_type(backend_cls: type, attention_type: str) -> bool:
    """Whether an AttentionBackend class declares support for the attention type (its class flag)."""
    default = attention_type == "standard"  # a class without the flag predates 1.4: standard only
    return bool(getattr(backend_cls, ATTENTION_TYPES[attention_type], default))


# runtime.kv_cache_dtype values other than "auto" -> the AttentionBackend flag that declares support
KV_CACHE_DTYPE_FLAGS = {"fp8_e4m3": "supports_fp8_kv_cache", "bfloat16": "supports_bf16_kv_cache"}


def effective_kv_cache_dtype(config, device: str) -> str:
    """runtime.kv_cache_dtype, with "auto" for a bf16 cache of a bf16 model (the pool is then in the
    model dtype, which every backend takes)."""
    kv = config.runtime.kv_cache_dtype
    return "auto" if kv == "bfloat16" and config.runtime.resolved_dtype(device) == "bfloat16" else kv


def supports_kv_cache_dtype(backend_cls: type, kv_cache_dtype: str) -> bool:
    return kv_cache_dtype == "auto" or bool(getattr(backend_cls, KV_CACHE_DTYPE_FLAGS[kv_cache_dtype], False))


def default_attention(registry: Registry, device: str, attention_type: str | None = None,
                      kv_cache_dtype: str = "auto") -> ComponentSpec | None:
    """The highest-priority attention component for `device` (whose class supports `attention_type`
    when given, and a KV cache in `kv_cache_dtype` when it is not "auto"; classes are imported only
    until one fits). None when there is none."""
    for spec in registry.components("attention"):
        if not spec.supports_device(device):
            continue
        if attention_type is None and kv_cache_dtype == "auto":
            return spec
        cls = registry.load("attention", spec.name)
        if attention_type is not None and not backend_supports_attention_type(cls, attention_type):
            continue
        if supports_kv_cache_dtype(cls, kv_cache_dtype):
            return spec
    return None


def check_latent_kv_cache_dtype(attention_type: str, kv_cache_dtype: str, model_name: str = "the model") -> None:
    """PluginError for a KV cache dtype other than the model's on a latent-attention (MLA) model: its
    LatentKVPool stays in the model dtype (plugin API 1.5)."""
    if attention_type == "latent" and kv_cache_dtype != "auto":
        raise PluginError(
            f"runtime.kv_cache_dtype={kv_cache_dtype!r}: {model_name} uses latent attention (MLA), whose KV pool "
            "is kept in the model dtype (a latent cache in another dtype is not supported); set "
            "runtime.kv_cache_dtype=auto"
        )


def check_backend_kv_cache_dtype(registry: Registry, backend_name: str, kv_cache_dtype: str, device: str) -> None:
    """PluginError when `kv_cache_dtype` (`effective_kv_cache_dtype`) is not "auto" and the attention
    backend does not declare the flag for it (KV_CACHE_DTYPE_FLAGS), naming the installed backends
    for `device` that do."""
    # "auto" first: loading the class imports the backend (and torch), which the front end avoids
    if kv_cache_dtype == "auto" or supports_kv_cache_dtype(registry.load("attention", backend_name), kv_cache_dtype):
        return
    flag = KV_CACHE_DTYPE_FLAGS[kv_cache_dtype]
    able = [s.name for s in registry.components("attention") if s.supports_device(device)
            and supports_kv_cache_dtype(registry.load("attention", s.name), kv_cache_dtype)]
    hint = (f"backends that support it on {device}: {', '.join(able)}" if able
            else f"no installed backend supports it on {device}")
    raise PluginError(
        f"runtime.kv_cache_dtype={kv_cache_dtype!r}: attention backend {backend_name!r} does not support a "
        f"{kv_cache_dtype} KV cache ({flag} is False); {hint}. Choose one with stack.attention, or set "
        "runtime.kv_cache_dtype=auto"
    )


def check_backend_attention_type(backend_cls: type, backend_name: str, attention_type: str, model_name: str = "the model",
                                 registry: Registry | None = None, device: str | None = None) -> None:
    """PluginError when the backend cannot serve the model's attention type, naming both (and, given
    the registry and device, the installed backends that can)."""
    check_attention_type(attention_type, model_name)
    if backend_supports_attention_type(backend_cls, attention_type):
        return
    flag = ATTENTION_TYPES[attention_type]
    hint = ""
    if registry is not None and device is not None:
        able = [s.name for s in registry.components("attention") if s.supports_device(device)
                and backend_supports_attention_type(registry.load("attention", s.name), attention_type)]
        hint = f" (installed for {device}: {', '.join(able)})" if able else f" (none is installed for {device})"
    raise PluginError(
        f"stack.attention={backend_name!r}: this attention backend does not support {attention_type} attention "
        f"({flag} is False), which {model_name} uses (attention_type={attention_type!r}); choose a backend that "
        f"does{hint}, or leave stack.attention unset to pick one"
    )


def check_tensor_parallel(spec: ComponentSpec, registry: Registry, tp_size: int) -> None:
    """Refuse `tp_size > 1` with a component whose class leaves `supports_tensor_parallel` False
    (plugin API 1.3; docs/parallelism.md lists the ones that support it)."""
    if tp_size <= 1 or getattr(registry.load(spec.kind, spec.name), "supports_tensor_parallel", False):
        return
    where = f"stack.{CONFIG_KEY_OF_KIND[spec.kind]}={spec.name!r}" if spec.kind in CONFIG_KEY_OF_KIND else (
        f"{spec.kind} {spec.name!r}")
    raise PluginError(
        f"runtime.tp_size={tp_size}: {where} ({spec.kind} component from {spec.distribution}) does not support "
        "tensor parallelism (supports_tensor_parallel is False); choose a component that does "
        "(see docs/parallelism.md) or set runtime.tp_size=1"
    )


def resolve_grammar(config: Config, registry: Registry, device: str) -> ComponentSpec | None:
    """The grammar backend `stack.grammar` selects: a named one (must be installed), "none" (off),
    or by default the highest-priority installed one for the device (None when none is installed)."""
    name = config.stack.grammar
    if name == GRAMMAR_OFF:
        return None
    if name is None:
        return registry.default("grammar", device)
    return _on_device(registry.get("grammar", name), device)


def _on_device(spec: ComponentSpec, device: str) -> ComponentSpec:
    if not spec.supports_device(device):
        key = CONFIG_KEY_OF_KIND[spec.kind]
        raise PluginError(
            f"stack.{key}={spec.name!r}: this {spec.kind} component ({spec.distribution}) does not support "
            f"device {device!r} (it supports {', '.join(spec.devices)})"
        )
    return spec


def policy_option_names(policy_cls: type) -> list[str] | None:
    """The keyword options a policy's constructor takes; None when it takes any (**kwargs)."""
    from radixserve.interfaces.policy import SchedulePolicy

    if policy_cls.__init__ is SchedulePolicy.__init__:
        return []  # the base constructor refuses every option
    params = list(inspect.signature(policy_cls).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def check_component_class(registry: Registry, kind: str, name: str) -> type:
    """Load the class of component `name` and refuse, naming it, one the core could not build
    (`registry.class_problem`: not a subclass of its kind's base class, abstract, a drafter's
    `__init__` without the info): at stack resolution, before any model loads (`config show` too)."""
    cls = registry.load(kind, name)
    problem = class_problem(kind, cls)
    if problem is not None:
        raise PluginError(f"{component_label(registry.get(kind, name))} {problem}")
    return cls


def check_policy_options(registry: Registry, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check the policy's class (`check_component_class`) and `stack.policy_options` against its
    constructor, then build one instance to check the values too (policy constructors are cheap by
    contract): a ValueError is the policy refusing its options, any other exception from its
    constructor a PluginCodeError naming the policy (`build_component`)."""
    cls = check_component_class(registry, "policy", name)
    valid = policy_option_names(cls)
    if valid is not None:
        unknown = sorted(set(options) - set(valid))
        if unknown:
            takes = f"valid options: {', '.join(valid)}" if valid else "it takes no options"
            raise PluginError(f"stack.policy_options: policy {name!r} has no option {', '.join(map(repr, unknown))}; {takes}")
    build_component(registry.get("policy", name), cls, refused=f"stack.policy_options for policy {name!r}", **options)
    return options


def prefix_cache_option_problem(cls: type, name: str, options: dict[str, Any]) -> str | None:
    """Why `stack.prefix_cache_options` cannot be passed to the prefix cache class `cls` (built as
    `cls(req_to_token_pool, allocator, **options)`): an option its constructor does not take. None when
    they fit (or it takes `**options`, or its signature cannot be read)."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C type): building it will tell
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for _ in range(2):  # the ReqToTokenPool and the TokenAllocator, passed by position
        if params and params[0].kind in positional:
            params = params[1:]
    return _unknown_options(f"prefix cache {name!r}", params, options, "the first two parameters of its __init__ take "
                                                                       "the ReqToTokenPool and the TokenAllocator")


def _unknown_options(component: str, params: list[inspect.Parameter], options: dict[str, Any],
                     fixed: str) -> str | None:
    """The options that none of the keyword `params` of `component`'s constructor takes (None: all are
    taken, or it takes `**options`), and the valid ones; `fixed` says which parameters the core fills."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    valid = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(valid))
    if not unknown:
        return None
    takes = f"valid options: {', '.join(valid)}" if valid else f"it takes no options ({fixed})"
    return f"{component} has no option {', '.join(map(repr, unknown))}; {takes}"


def check_prefix_cache_options(registry: Registry, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check `stack.prefix_cache_options` against the prefix cache's constructor
    `Cache(req_to_token_pool, allocator, **options)`, and its class (`check_component_class`), when options
    are given (names only: a cache needs the KV memory to be built, so its values are checked when the
    scheduler builds it, `build_prefix_cache`). Without options the class is not loaded here (a cache
    imports torch, which the HTTP front end does not)."""
    if not options:
        return options
    cls = check_component_class(registry, "prefix_cache", name)
    problem = prefix_cache_option_problem(cls, name, options)
    if problem is not None:
        raise PluginError(f"stack.prefix_cache_options: {problem}")
    return options


def build_prefix_cache(config: Config, registry: Registry, cls: type, req_to_token_pool: Any, allocator: Any) -> Any:
    """The prefix cache `config.stack.prefix_cache` names (its class `cls`), built as
    `cls(req_to_token_pool, allocator, **config.stack.prefix_cache_options)`: a `ValueError` (or a
    `TypeError` when options were set) is a PluginError, the cache refusing its options; any other
    exception a PluginCodeError naming the cache and its distribution (`build_component`)."""
    name = config.stack.prefix_cache
    options = dict(config.stack.prefix_cache_options)
    refused = (f"stack.prefix_cache_options for prefix cache {name!r}" if options
               else f"stack.prefix_cache={name!r}: the prefix cache refused its configuration")
    return build_component(registry.get("prefix_cache", name), cls, req_to_token_pool, allocator, refused=refused,
                           **options)


def drafter_option_problem(cls: type, name: str, options: dict[str, Any]) -> str | None:
    """Why `speculative.options` cannot be passed to the drafter class `cls` (built as
    `cls(info, **options)`): an option its constructor does not take. None when they fit (or it
    takes `**options`). Shared by the stack resolution and `check_drafter`."""
    params = list(inspect.signature(cls).parameters.values())[1:]  # the first one takes DrafterInfo
    return _unknown_options(f"drafter {name!r}", params, options, "the first parameter of its __init__ takes the "
                                                                  "DrafterInfo")


def check_drafter_options(registry: Registry, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check the drafter's class (`check_component_class`: abstract, or an `__init__` that does not
    take the info first, is refused here, before the model loads) and `speculative.options` against
    its constructor `Drafter(info, **options)` (names only: building a drafter may load a draft
    model, so that waits for the scheduler)."""
    cls = check_component_class(registry, "drafter", name)
    problem = drafter_option_problem(cls, name, options)
    if problem is not None:
        raise PluginError(f"speculative.options: {problem}")
    return options


def check_quantization_fits(stack: ResolvedStack, model_path: str, registry: Registry, load_format: str = "auto") -> None:
    """A quantization method selected for a checkpoint it cannot apply to is an error naming both:
    a file belongs to the weight source `load_format` names, else to the one that declared its
    suffix; an HF directory cannot use a weight source, nor a method other than the one its
    quantization_config declares."""
    quant = stack.quantization
    if quant is None:
        return
    if os.path.isfile(model_path):
        reader = registry.weight_source_reading(model_path, load_format)
        if reader is not None and reader.name != quant.name:
            raise PluginError(
                f"stack.quantization={quant.name!r} cannot apply to {model_path!r}: that file is read by the weight "
                f"source {reader.name!r} ({reader.distribution}), which also sets its quantization; "
                f"remove stack.quantization or set it to {reader.name!r}"
            )
        return
    if quant.is_weight_source:
        raise PluginError(
            f"stack.quantization={quant.name!r} reads {', '.join(quant.weight_file_suffixes)} files, but {model_path!r} "
            "is a Hugging Face checkpoint directory; remove stack.quantization or pass a "
            f"{'/'.join(quant.weight_file_suffixes)} file"
        )
    declared = declared_quant_method(model_path)
    if declared is not None and declared != quant.name:
        raise PluginError(
            f"stack.quantization={quant.name!r} cannot apply to {model_path!r}: its config.json declares "
            f"quantization_config.quant_method={declared!r}; remove stack.quantization or set it to {declared!r}"
        )


def declared_quant_method(model_dir: str) -> str | None:
    """`quantization_config.quant_method` from an HF directory's config.json (None if absent)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config.json with its own message
    return qc.get("quant_method") if isinstance(qc, dict) else None
