"""Build (or load from the cache) each native CPU kernel the tests use.

`python tests/native_builds.py NAME` builds one in its own process: conftest runs several at once,
since one process compiles one kernel at a time."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def _cpu_ops() -> None:
    import torch
    from radixserve.layers import cpu_ops

    cpu_ops.available(torch.zeros(1, 1))


def _cpu_gemm() -> None:
    import torch
    from radixserve.layers import cpu_gemm

    cpu_gemm.pack(torch.zeros(1, 1))


def _cpu_gemm_avx2() -> None:
    from radixserve import native
    from radixserve.layers import cpu_gemm

    native.load_extension("radixserve_cpu_gemm_avx2", cpu_gemm._SOURCE, defines=("RS_NO_AVX512",))


def _cpu_attention_avx2() -> None:
    from radixserve import native
    from radixserve_attention_cpu_batched import backend

    native.load_extension("radixserve_cpu_attention_avx2", backend._SOURCE, defines=("RS_NO_AVX512",))


def _cpu_greedy_head() -> None:
    import torch
    from radixserve.layers import cpu_greedy_head

    cpu_greedy_head.pack(torch.zeros(1, 1))


def _cpu_attention() -> None:
    from radixserve_attention_cpu_batched import backend

    backend.load_kernels()


def _sample_rows() -> None:
    import torch
    from radixserve.sampling import cpu_draw

    cpu_draw.available(torch.zeros(1, 1))


# extension name -> its loader
def _gguf_blocks() -> None:
    from radixserve_quant_gguf import kernels

    kernels.load()


def sources() -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Extension name -> (source, defines) as its loader passes them to native.load_extension: what
    conftest checks against the cache (native.is_cached) before building."""
    from radixserve.layers import cpu_gemm, cpu_greedy_head, cpu_ops
    from radixserve.sampling import cpu_draw
    from radixserve_attention_cpu_batched import backend
    from radixserve_quant_gguf import kernels

    found = {
        "radixserve_cpu_ops": (cpu_ops._SOURCE, ()),
        "radixserve_cpu_gemm": (cpu_gemm._SOURCE, ()),
        "radixserve_cpu_greedy_head": (cpu_greedy_head._SOURCE, ()),
        "radixserve_cpu_attention": (backend._SOURCE, ()),
        "radixserve_sample_rows": (cpu_draw._SOURCE, ()),
        "radixserve_gguf_blocks": (kernels._SOURCE, ()),
        "radixserve_cpu_gemm_avx2": (cpu_gemm._SOURCE, ("RS_NO_AVX512",)),
        "radixserve_cpu_attention_avx2": (backend._SOURCE, ("RS_NO_AVX512",)),
    }
    return {name: found[name] for name in KERNELS}


KERNELS: dict[str, Callable[[], None]] = {
    "radixserve_cpu_ops": _cpu_ops,
    "radixserve_cpu_gemm": _cpu_gemm,
    "radixserve_cpu_greedy_head": _cpu_greedy_head,
    "radixserve_cpu_attention": _cpu_attention,
    "radixserve_sample_rows": _sample_rows,  # the CPU sampler's fused draw (tests/test_sampler.py)
    "radixserve_gguf_blocks": _gguf_blocks,  # GGUF kept blocks (the CPU default for Q4_0/Q4_1/Q8_0 files)
}
if _cpu_has_avx512():  # tests/test_native_cpu_kernels.py also runs the AVX2 GEMM of AVX2-only CPUs
    KERNELS["radixserve_cpu_gemm_avx2"] = _cpu_gemm_avx2
    KERNELS["radixserve_cpu_attention_avx2"] = _cpu_attention_avx2  # and its attention loops


if __name__ == "__main__":
    KERNELS[sys.argv[1]]()
