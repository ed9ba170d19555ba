"""One compile per kernel configuration, kept in memory, with a hook for a persistent store.

Kernels are compiled against fake tensors whose extents and strides are runtime values, so one
compile serves every problem size; the key is the configuration (step, dtype, head dims, causal,
scheduler, ...). `compile_cached(key, build)` looks in memory first, then in the store if one is
set, and otherwise compiles, keeps the result and offers it to the store.

The store is how a higher layer adds a disk cache without this stage knowing about it: ``fa4``
passes one in with `set_store` (the layering rule: fa4 composes the stages, never the reverse).
It implements the small `Store` protocol below.
"""
from __future__ import annotations

import contextlib
import contextvars
import io
import os
import re
import tempfile
import warnings
from typing import Any, Callable, Optional, Protocol

import cutlass.base_dsl.dsl as _dsl
import cutlass.cute as cute

from .sass_report import disassemble, parse_resources, sass_counts, wgmma_serialization

__all__ = ["Compiled", "Store", "WgmmaSerializedWarning", "cached", "compile_cached", "dump_dir", "get_store",
           "remember", "reset_launch_observer", "set_launch_observer", "set_store", "wgmma_serialization",
           "without_source_locations"]


class Compiled:
    """A compiled kernel: `fn` (what cute.compile returned), its resource `report` (registers,
    spills, smem from ptxas; SASS instruction counts), `sass` (the full SASS text, "" without
    nvdisasm) and `ptx`.

    The SASS comes from disassembling the cubin (nvdisasm: 1.5-2 s of a first forward's 5-7 s on an
    H200, `python -m fa4 firstcall`), which a launch never needs: built with `cubin`, it is made on
    first use of `.sass` or `.report`. `log_report` is the report without forcing it (what ptxas
    said: what a disk cache keeps)."""

    __slots__ = ("fn", "ptx", "_report", "_sass", "_cubin")

    def __init__(self, fn: Any, report: dict, sass: Optional[str], ptx: str, cubin: Optional[bytes] = None):
        self.fn, self.ptx, self._report, self._sass, self._cubin = fn, ptx, report, sass, cubin
        if sass is None and cubin is None:
            self._sass = ""

    @property
    def sass(self) -> str:
        if self._sass is None:
            self._sass = disassemble(self._cubin) if self._cubin else ""
            self._report.update(sass_counts(self._sass))
        return self._sass

    @property
    def report(self) -> dict:
        self.sass  # noqa: B018  (fills the SASS counts on first use)
        return self._report

    @property
    def log_report(self) -> dict:
        return self._report

    def with_function(self, fn: Any) -> "Compiled":
        """The same kernel (report, SASS, PTX) behind another callable: a store's loaded object."""
        return Compiled(fn, self._report, self._sass, self.ptx, self._cubin)


class Store(Protocol):
    """A persistent second level behind the memory cache (fa4's disk cache implements it)."""

    def memory_hit(self, key) -> None:
        """Told about every hit in memory (for statistics)."""

    def load(self, key, rebuild: Callable[[], Compiled]) -> Optional[Compiled]:
        """The kernel of `key` if the store holds it, else None. `rebuild()` compiles it afresh
        (and offers the result again), for an entry that loads but turns out unusable."""

    def offer(self, key, compiled: Compiled) -> None:
        """Told about every fresh compile; the store keeps what it can persist."""

    def links(self, key) -> bool:
        """Optional. True: a fresh launchable compile of `key` goes to `adopt` instead of `offer`, and
        is built without the DSL's own JIT engine, since the store will load its own object anyway."""

    def adopt(self, key, compiled: Compiled, rebuild: Callable[[], Compiled]) -> Compiled:
        """Optional, with `links`. `compiled` has no runnable function: keep it and return it loaded
        (`Compiled.with_function`), or `rebuild()` (a compile with the DSL's engine) if that fails."""


_CACHE: dict = {}
_STORE: Optional[Store] = None
_DUMP_DIR: Optional[str] = None
# (key, Compiled) -> Compiled, seeing every kernel a launch takes from the cache (in this thread / task):
# fa4's launch plans record through it (fa4/_plans.py); None almost always
_LAUNCH_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("launch_observer", default=None)


class WgmmaSerializedWarning(UserWarning):
    """ptxas serialized a kernel's wgmma instructions (each waits for the one before): the kernel is
    correct but far slower than its design (a backward build measured this way lost 10-12%)."""


def set_store(store: Optional[Store]) -> None:
    """Put `store` behind the memory cache (None removes it)."""
    global _STORE
    _STORE = store


def get_store() -> Optional[Store]:
    return _STORE


def set_launch_observer(observer: Callable[[Any, Compiled], Compiled]):
    """Route every kernel `compile_cached` returns in this context through observer(key, compiled);
    returns the token for `reset_launch_observer`."""
    return _LAUNCH_OBSERVER.set(observer)


def reset_launch_observer(token) -> None:
    _LAUNCH_OBSERVER.reset(token)


def cached(key) -> Optional[Compiled]:
    """The compiled kernel of `key` if it is in memory, without compiling."""
    return _CACHE.get(key)


def remember(key, compiled: Compiled) -> None:
    """Put a kernel into the memory cache (a store replaces a loaded entry once it has run)."""
    _CACHE[key] = compiled


def dump_dir() -> str:
    """The directory the DSL keeps PTX and cubins in (one per process)."""
    global _DUMP_DIR
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="fa4_stage3_cute_")
    return _DUMP_DIR


def compile_cached(key, build: Callable[[], tuple]) -> Compiled:
    """Compile once per key. `build()` returns (kernel_object, args_tuple); the kernel object's
    `smem_bytes` attribute (set while tracing) goes into the report."""
    observer = _LAUNCH_OBSERVER.get()
    compiled = _compile_cached(key, build)
    return compiled if observer is None else observer(key, compiled)


def _compile_cached(key, build: Callable[[], tuple]) -> Compiled:
    store = _STORE
    hit = _CACHE.get(key)
    if hit is not None:
        if store is not None:
            store.memory_hit(key)
        return hit
    if store is not None:
        loaded = store.load(key, lambda: _compile_and_offer(key, build))
        if loaded is not None:
            _CACHE[key] = loaded
            return loaded
    return _compile_and_offer(key, build)


def _compile_and_offer(key, build) -> Compiled:
    store = _STORE
    links = store is not None and getattr(store, "links", None) is not None and store.links(key)
    out, detached = _compile(key, build, detach=links)
    if detached:
        out = store.adopt(key, out, lambda: _compile(key, build)[0])
    elif store is not None:
        store.offer(key, out)
    _CACHE[key] = out
    return out


def _is_launchable(args) -> bool:
    return any(getattr(a, "use_tvm_ffi_env_stream", False) for a in args)


def _compile(key, build, detach: bool = False) -> tuple[Compiled, bool]:
    """The kernel and whether it was built detached: without the DSL's JIT engine (`detach`, for a
    launchable build), which generates the host code twice more (an MCJIT engine, then the object
    TVM-FFI links; 0.2-0.5 s each on a cold call) when a store will export and load its own object."""
    kernel, args = build()
    opts = f"--keep-ptx --keep-cubin --dump-dir {dump_dir()} remarks{{ptx}}"
    # a kernel for another arch than the process's (the Blackwell forward or backward in an sm_90a process) names it
    gpu_arch = getattr(kernel, "gpu_arch", None)
    if gpu_arch:
        opts = f"--gpu-arch {gpu_arch} " + opts
    launchable = _is_launchable(args)
    if launchable:
        opts = "--enable-tvm-ffi " + opts
    detached = detach and launchable
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf), without_source_locations():
        fn = cute.compile(kernel, *args, options=opts, no_jit_engine=detached)
    log = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    ptx = _artifact(fn.__ptx__, "r") or ""
    cubin = _artifact(fn.__cubin__, "rb")
    report = parse_resources(log, "", cubin)  # SASS counts: filled when the SASS is first asked for
    report["smem_bytes"] = getattr(kernel, "smem_bytes", None)
    report["threads"] = getattr(kernel, "num_threads", None)
    if report["wgmma_serialized"]:
        warnings.warn(f"{str(key)[:240]}: ptxas serialized its wgmma instructions "
                      f"({', '.join(report['wgmma_serialized'])}); the kernel is correct but runs far below its "
                      "design speed (time it only knowingly)", WgmmaSerializedWarning, stacklevel=4)
    return Compiled(fn, report, None if cubin else "", ptx, cubin), detached


@contextlib.contextmanager
def without_source_locations():
    """Compile without the per-op Python source locations that `remarks{ptx}` turns on.

    The DSL records a source location for every op it builds whenever compiler diagnostics are
    collected (it walks the Python stack for each of ~30k ops). We want the diagnostics only for
    ptxas's resource lines, which carry no Python location, and the walk is ~20% of a cold compile's
    CPU time (d = 96 causal forward: 9.5 -> 7.5 s on a 2-core CPU). The PTX is the same without it
    (tests/test_compile_cache_locations.py). CUTE_DSL_LINEINFO=1 (the DSL's own switch for line info)
    keeps the locations for profilers and debuggers."""
    setter = getattr(_dsl, "_set_enable_frame_filtering", None)
    if setter is None or os.environ.get("CUTE_DSL_LINEINFO", "0").lower() in ("1", "true", "on", "yes"):
        yield
        return
    _dsl._set_enable_frame_filtering = lambda enable: setter(False)
    try:
        yield
    finally:
        _dsl._set_enable_frame_filtering = setter


def _artifact(value, mode: str):
    """A compile artifact's contents: the DSL hands classic compiles' PTX / cubin over as contents
    and TVM-FFI compiles' as the path of the file it kept in the dump directory."""
    if isinstance(value, str) and "\n" not in value and os.path.isfile(value):
        with open(value, mode) as f:
            return f.read()
    return value
