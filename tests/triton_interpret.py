"""The interpreter switch of the Triton kernel test modules (test_attention_triton,
test_attention_mla_triton): without a GPU they run under TRITON_INTERPRET=1, set before the
kernels' @triton.jit decoration, and put the previous value back after the module. torch-only, so
those modules still run on the bare GPU image. Also `round_bf16_like_gpu` (test_triton_ops,
test_transformers_fallback_fused): the interpreter's fp32 -> bf16 cast made to round as a GPU does.

Use: `ON_GPU, restore_triton_interpret = use_interpreter_without_gpu()` at the top of the module,
before importing any kernel, then `_restore = pytest.fixture(autouse=True, scope="module")(
restore_triton_interpret)`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch


def use_interpreter_without_gpu() -> tuple[bool, Callable[[], Iterator[None]]]:
    """(whether a GPU is there, a generator function for a module-scoped fixture that restores
    TRITON_INTERPRET to its value before this call)."""
    on_gpu = torch.cuda.is_available()
    previous = os.environ.get("TRITON_INTERPRET")
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"

    def restore_triton_interpret() -> Iterator[None]:
        """Keep the interpreter switch for this module's tests only (later tests may spawn processes)."""
        yield
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous

    return on_gpu, restore_triton_interpret


def round_bf16_like_gpu() -> Callable[[], None]:
    """Patch Triton's CPU interpreter so that its fp32 -> bf16 cast rounds to nearest even, as a GPU
    (and torch) does, where the interpreter truncates; bf16 kernel results can then be compared with
    torch bitwise. Returns the function that undoes the patch."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        import triton.language as tl

        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    return lambda: setattr(builder, "cast_impl", original)
