"""The interpreter switch of the Triton kernel test modules (test_attention_triton,
test_attention_mla_triton): without a GPU they run under TRITON_INTERPRET=1, set before the
kernels' @triton.jit decoration, and put the previous value back after the module. torch-only, so
those modules still run on the bare GPU image.

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
