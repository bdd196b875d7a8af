"""Whether an attention backend class can be built and run as the runner builds it: checked when the
stack is resolved, before any weights load (building it comes only after the load), and by the
conformance kit."""

from __future__ import annotations

import inspect

from radixserve.interfaces.attention import AttentionBackend
from radixserve.plugins.registry import PluginError


def attention_class_problem(cls: object) -> str | None:
    """Why `cls(runner_info)` cannot give a working backend (not an AttentionBackend subclass, abstract,
    an `__init__` that does not take the runner info), or None."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        return f"{cls!r} is not a subclass of radixserve.interfaces.AttentionBackend"
    name = f"{cls.__module__}.{cls.__qualname__}"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        return f"{name} is abstract: it does not implement {missing} (required by AttentionBackend)"
    if cls.__init__ is object.__init__:  # the base class defines none: Backend(runner_info) would fail
        return f"{name} defines no __init__(runner_info): the runner builds it as Backend(runner_info)"
    try:
        inspect.signature(cls.__init__).bind(None, None)  # (self, runner_info)
    except TypeError as e:
        return f"{name}.__init__ cannot take the runner info ({e}): the runner builds it as Backend(runner_info)"
    except ValueError:  # no signature to read (a C type): building it will tell
        pass
    return None


def check_attention_class(cls: type, name: str, device: str, dtype: str, head_dim: int | None = None) -> None:
    """PluginError when the class of `stack.attention` component `name` cannot be built
    (`attention_class_problem`) or, `head_dim` given, its `supports(device, dtype, head_dim)` refuses
    the run (`dtype` without "torch.", as the runner asks)."""
    problem = attention_class_problem(cls)
    if problem is not None:
        raise PluginError(f"attention backend {name!r} cannot be used: {problem}")
    if head_dim is not None and not cls.supports(device, dtype, head_dim):
        raise PluginError(f"attention backend {name!r} does not support {device}/{dtype}/head_dim={head_dim} "
                          f"(its supports() refuses them); choose another with stack.attention")


def head_dim_before_loading(model_cls: type, hf_config, attention_type: str) -> int | None:
    """The `head_dim` the runner will ask `supports()` about, where the HF config alone gives it: a
    standard-attention model keeping the base `Model.attention_dims` (None otherwise: the model
    decides once built, and the runner checks then)."""
    from radixserve.interfaces.model import Model, head_dim_of

    if attention_type != "standard" or getattr(model_cls, "attention_dims", None) is not Model.attention_dims:
        return None
    try:
        return int(head_dim_of(hf_config))
    except (AttributeError, TypeError, ZeroDivisionError):  # a config without the fields: the model decides
        return None
