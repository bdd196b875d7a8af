"""Build and load the C++ CPU kernels that the core and plugins ship as source.

Why JIT: a compiled wheel would tie every plugin to one torch ABI, and building at `pip install`
time needs torch inside pip's isolated build environment (which would pull a multi-GB CUDA torch).
Compiling on first use against the torch that is running avoids both; the result is cached per
source, torch build (version and installation) and machine, so only the first process on a
machine pays (~1 minute).

Callers get None when no compiler is available (or `RADIXSERVE_NATIVE=0`, for A/B runs) and keep
their plain-torch path; the reason is logged once."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from radixserve.config import cache_dir

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")  # -fopenmp: at::parallel_for uses torch's OpenMP
LOCK_NAME = "radixserve.lock"  # ours (flock); torch's cpp_extension keeps its own `lock` baton
TORCH_BATON = "lock"
DEFAULT_LOCK_TIMEOUT_S = 900.0  # a cold compile takes about a minute on 2 cores
LOCK_POLL_S = 0.2
_lock = threading.Lock()
_name_locks: dict[str, threading.Lock] = {}
_loaded: dict[str, ModuleType | None] = {}
# [start, end or None while it runs] of each compile in this process, perf_counter() seconds (compiled_since)
_compiles: list[list[float | None]] = []


def enabled() -> bool:
    return os.environ.get("RADIXSERVE_NATIVE", "1") != "0"


def cache_root() -> Path:
    return Path(cache_dir()) / "native"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: -march=native code built on one CPU may not run on another (a home
    directory shared between machines), so they are part of the cache key."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


def _torch_build() -> bytes:
    """The torch installation the kernels are built against: version, commit and location, and the
    Python headers. Two virtualenvs (or checkouts) on one machine then use separate build
    directories instead of rebuilding each other's kernels on every start."""
    parts = (
        torch.__version__,
        str(torch.version.git_version),
        os.path.dirname(os.path.realpath(torch.__file__)),
        sysconfig.get_paths()["include"],
        str(sysconfig.get_config_var("EXT_SUFFIX")),
    )
    return "\0".join(parts).encode()


def build_key(source_text: bytes, cflags: tuple[str, ...]) -> str:
    """The cache key of one build: source, compiler flags, torch build, Python, CPU."""
    key = hashlib.sha256()
    for part in (source_text, _torch_build(), platform.machine().encode(), _cpu_flags(), " ".join(cflags).encode()):
        key.update(part)
        key.update(b"\0")
    return key.hexdigest()[:16]


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> dict[str, bytes]:
    """The headers `source` includes with quotes (`#include "x.h"`), directly or through each
    other, that lie in its directory or below: relative path -> content. They are part of the
    cache key (a header edit rebuilds) and are copied next to the source's copy in the build
    directory. A quoted include found nowhere there is left to the compiler's search path."""
    root = source.parent.resolve()
    found: dict[str, bytes] = {}
    pending = [source.resolve()]
    while pending:
        current = pending.pop()
        for match in _LOCAL_INCLUDE.finditer(current.read_bytes()):
            header = (current.parent / match.group(1).decode()).resolve()
            if not header.is_file() or not header.is_relative_to(root):
                continue
            rel = header.relative_to(root).as_posix()
            if rel not in found:
                found[rel] = header.read_bytes()
                pending.append(header)
    return dict(sorted(found.items()))


def _key_text(source_text: bytes, headers: dict[str, bytes]) -> bytes:
    """What the cache key hashes for a source: its text, then each local header's name and text
    (a source without local headers keeps the key it had before headers were hashed)."""
    return source_text + b"".join(b"\0" + rel.encode() + b"\0" + text for rel, text in headers.items())


def _cflags(defines: tuple[str, ...]) -> tuple[str, ...]:
    return CFLAGS + tuple(f"-D{d}" for d in defines)


def _build_inputs(name: str, source: Path, cflags: tuple[str, ...]) -> tuple[bytes, dict[str, bytes], Path]:
    """(the source's text, its local headers, its build directory): what one build of `source`
    with `cflags` is keyed on, for this torch build and CPU."""
    source_text = source.read_bytes()
    headers = local_headers(source)
    return source_text, headers, cache_root() / f"{name}-{build_key(_key_text(source_text, headers), cflags)}"


def lock_timeout_s() -> float:
    return float(os.environ.get("RADIXSERVE_NATIVE_LOCK_TIMEOUT_S", DEFAULT_LOCK_TIMEOUT_S))


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Exclusive use of `build_dir` across processes: an flock, which the kernel releases when its
    holder dies (torch's own `lock` file stays behind when a compile is killed, and every later
    start would wait on it forever). Waiting is logged (with the holder's pid) and ends with a
    RuntimeError after `timeout_s`."""
    timeout_s = lock_timeout_s() if timeout_s is None else timeout_s
    path = build_dir / LOCK_NAME
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    logger.info("waiting for process %s, which is building %s (lock %s)", holder, what, path)
                    announced = True
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"gave up after {timeout_s:.0f} s waiting for another process to finish building {what} "
                        f"(lock {path}); stop that process or raise RADIXSERVE_NATIVE_LOCK_TIMEOUT_S"
                    ) from None
                time.sleep(LOCK_POLL_S)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            # under our lock nobody else builds here: torch's baton is a leftover of a killed build
            (build_dir / TORCH_BATON).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def load_extension(name: str, source: str | os.PathLike, defines: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module for one .cpp file (a pybind11 module named `name`), or None.

    `defines`: preprocessor macros for this build (e.g. a test forcing a fallback code path); a
    different set needs a different `name`, since a process holds one module per name.
    Compiles on the first call for this torch build on this machine (logged, about a minute on 2
    cores); later calls, in this or any process, load the cached library. Headers the source
    includes with quotes from its own directory (`#include "x.h"`) are hashed into the cache key,
    so editing one rebuilds. Safe to call from several processes at once (they serialise on
    `build_lock`)."""
    if name in _loaded:  # the per-call path of the layers: a dict read, no lock
        return _loaded[name]
    with _lock:  # one lock per kernel: different kernels may build side by side
        name_lock = _name_locks.setdefault(name, threading.Lock())
    with name_lock:
        if name not in _loaded:
            _loaded[name] = _load(name, Path(source), _cflags(defines))
        return _loaded[name]


def compiled_since(t: float) -> int:
    """How many native kernels this process compiled, or is compiling, since `time.perf_counter()`
    was `t`: a phase timed across them shared the cores with the compilers (the weights' load on a
    first start)."""
    return sum(1 for _, end in _compiles if end is None or end > t)


def is_cached(name: str, source: str | os.PathLike, defines: tuple[str, ...] = ()) -> bool:
    """Whether `load_extension` with these arguments would load a built library instead of
    compiling: a build of this source (and its local headers) with these flags, for this torch
    build and CPU. Builds of other versions of the source, left in the cache, do not count."""
    return any(_build_inputs(name, Path(source), _cflags(defines))[2].glob("*.so"))


def build_in_background(loaders: Iterable[Callable[[], object]]) -> list[threading.Thread]:
    """Run each loader (a function that ends up in `load_extension`) in a daemon thread. Why: on a
    first start the kernels then compile side by side and next to the model load, instead of one
    after another where the layers first need them; a layer that needs a kernel before its build
    finished waits for it (the per-kernel lock). Errors are the loaders' to log."""

    def run(loader: Callable[[], object]) -> None:
        try:
            loader()
        except Exception:  # the layer's own later call reports it
            logger.debug("background kernel build failed", exc_info=True)

    threads = [threading.Thread(target=run, args=(loader,), name="native-build", daemon=True) for loader in loaders]
    for t in threads:
        t.start()
    return threads


def _load(name: str, source: Path, cflags: tuple[str, ...]) -> ModuleType | None:
    if not enabled():
        logger.info("native CPU kernel %s disabled by RADIXSERVE_NATIVE=0", name)
        return None
    from torch.utils import cpp_extension

    source_text, headers, build_dir = _build_inputs(name, source, cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    # the venv's own ninja (the `ninja` requirement) when the venv is not activated
    venv_bin, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
    if venv_bin not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([venv_bin, path])
    with build_lock(build_dir, f"the native CPU kernel {name}"):
        # built from a copy inside the build directory: the build files then name no checkout's
        # path, and a second checkout with the same source reuses the library instead of rebuilding
        local_source = build_dir / source.name
        for rel, text in ((source.name, source_text), *headers.items()):
            local = build_dir / rel
            if not local.exists() or local.read_bytes() != text:
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(text)
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            logger.warning("compiling the native CPU kernel %s (first use with this torch: the kernels compile side "
                           "by side, one to three minutes on 2 cores) ...", name)
        start = time.perf_counter()
        compile_span: list[float | None] = [start, None]
        if fresh:
            _compiles.append(compile_span)
        try:
            module = cpp_extension.load(
                name=name,
                sources=[str(local_source)],
                extra_cflags=list(cflags),
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as e:  # no compiler or ninja: the caller's torch path still works, only slower
            logger.warning("native CPU kernel %s unavailable (%s); using the plain-torch path", name, e)
            return None
        finally:
            compile_span[1] = time.perf_counter()
        if fresh:
            logger.warning("native CPU kernel %s compiled in %.1f s", name, compile_span[1] - start)
        return module
