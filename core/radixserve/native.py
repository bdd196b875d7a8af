"""Build and load the C++ CPU kernels that the core and plugins ship as source.

Why JIT: a compiled wheel would tie every plugin to one torch ABI, and building at `pip install`
time needs torch inside pip's isolated build environment (which would pull a multi-GB CUDA torch).
Compiling on first use against the torch that is running avoids both; the result is cached per
source, torch version and machine, so only the first process on a machine pays (~1 minute).

Callers get None when no compiler is available (or `RADIXSERVE_NATIVE=0`, for A/B runs) and keep
their plain-torch path; the reason is logged once."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")  # -fopenmp: at::parallel_for uses torch's OpenMP
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get("RADIXSERVE_NATIVE", "1") != "0"


def cache_root() -> Path:
    base = os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    return Path(base) / "native"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: -march=native code built on one CPU may not run on another (a home
    directory shared between machines), so they are part of the cache key."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


def _build_dir(name: str, source: Path, cflags: tuple[str, ...]) -> Path:
    key = hashlib.sha256()
    parts = (source.read_bytes(), torch.__version__.encode(), platform.machine().encode(), _cpu_flags(),
             " ".join(cflags).encode())
    for part in parts:
        key.update(part)
    return cache_root() / f"{name}-{key.hexdigest()[:16]}"


def load_extension(name: str, source: str | os.PathLike, defines: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module for one .cpp file (a pybind11 module named `name`), or None.

    `defines`: preprocessor macros for this build (e.g. a test forcing a fallback code path); a
    different set needs a different `name`, since a process holds one module per name.
    Compiles on the first call on this machine (logged, about a minute on 2 cores); later calls,
    in this or any process, load the cached library. Safe to call from several processes at once
    (torch's build lock serialises them)."""
    if name in _loaded:  # the per-call path of the layers: a dict read, no lock
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name, Path(source), CFLAGS + tuple(f"-D{d}" for d in defines))
        return _loaded[name]


def _load(name: str, source: Path, cflags: tuple[str, ...]) -> ModuleType | None:
    if not enabled():
        logger.info("native CPU kernel %s disabled by RADIXSERVE_NATIVE=0", name)
        return None
    from torch.utils import cpp_extension

    build_dir = _build_dir(name, source, cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.warning("compiling the native CPU kernel %s (first use on this machine, about a minute)", name)
    # the venv's own ninja (the `ninja` requirement) when the venv is not activated
    venv_bin, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
    if venv_bin not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([venv_bin, path])
    try:
        return cpp_extension.load(
            name=name, sources=[str(source)], extra_cflags=list(cflags), build_directory=str(build_dir), verbose=False
        )
    except Exception as e:  # no compiler or ninja: the caller's torch path still works, only slower
        logger.warning("native CPU kernel %s unavailable (%s); using the plain-torch path", name, e)
        return None
