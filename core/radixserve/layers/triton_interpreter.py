"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) accept loop bounds read at run time.

Triton 3.6's interpreter keeps every scalar as a 1-element numpy array and converts it for
`range(...)` with `int(array)`, which numpy >= 2 rejects for arrays that are not 0-d. Our kernels
loop to per-request lengths loaded from tensors (the GPU-efficient form), so under the interpreter
we re-install that single conversion using the array's only element. Nothing changes on a GPU:
`apply()` is a no-op unless the interpreter is on, and it leaves Triton alone if its internals
are not where we expect (then the original error surfaces unchanged).
"""

from __future__ import annotations

import os

_MARK = "_radixserve_scalar_index_fix"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def apply() -> None:
    if not interpreter_enabled():
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, _MARK, False):
        return

    def patch_lang_tensor(tensor, scope):  # same signature as the interpreter's function
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    setattr(patch_lang_tensor, _MARK, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
