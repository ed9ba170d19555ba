"""The compile cache: CuTe-DSL kernels compiled once per configuration, in memory and on disk.

Why: a CuTe-DSL kernel is traced and compiled (MLIR -> PTX -> ptxas) the first time a
configuration (dtype, head dims, causal, ...) is used: seconds per kernel, paid again by every
new process -- every training job, every test run, every rank of a multi-GPU job.

What CuTe-DSL 4.8.1 offers (researched in nvidia-cutlass-dsl 4.8.1 and the official FA4's
cache_utils.py, which uses the same mechanism): the stage kernels fa4 runs are compiled with
TVM-FFI (``--enable-tvm-ffi``, see stage3_fwd_kernel.host_io.launch_stream), and such a compiled
function's ``export_to_c(object_file_path, function_name)`` writes a relocatable ELF object holding
the host launch code *and* the cubin; ``cutlass.cute.runtime.load_module(path, enable_tvm_ffi=True)``
JIT-links it back (milliseconds) and ``getattr(module, function_name)`` is a callable
``tvm_ffi.Function`` with the original signature. So an on-disk cache is feasible with this DSL
version; this module implements it.

Layout: ``$FA4_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fa4`` or ``~/.cache/fa4``) /
``kernels-v2/<fingerprint>/<key hash>-<content hash>.o``. The fingerprint (16 hex digits) is
``<build id><arch tag>``: the build id (12 digits) hashes everything of this build that changes
generated code -- the kernel sources (stage 2-5 packages), the DSL and TVM-FFI versions, the Python
minor version -- and the arch tag (4 digits) hashes CUTE_DSL_ARCH. Editing a kernel therefore
starts a fresh directory instead of loading stale code, and each arch has its own. The key hash is
the stage module's own in-memory cache key (step name, dtype, head dims, causal, ...).

Generations: a *generation* is a build id; its directories (one per arch) are "current" when the
build id is this build's (`is_current`). Deciding that needs no arch, so every command agrees
whatever arch it targets or knows: ``precompile --arch sm_90a`` writes under ``fingerprint("sm_90a")``
and a later ``cache clear --stale`` in a process with no CUTE_DSL_ARCH (or another one) keeps it;
only directories of other builds (or of no build: names of another form) are stale.

Concurrency and corruption: an entry is written to a temporary file in the same directory and
renamed into place (atomic on POSIX), so readers see a complete file or none; two processes
compiling the same key both write a valid file. Writers never delete; a reader uses the newest
verified entry and prunes the older ones, so a race always leaves at least one complete file
(no lock files needed); a reader whose verified entry another reader pruned before it was linked
looks again and finds the newer one. The content hash in the file name is checked before loading, so a
truncated or edited file is detected, removed and rebuilt, never fatal. A file that passes the
hash but fails to load or to run on its first call is also removed and the kernel recompiled.

What is cached: only compiles a stage module marks as launchable (keys containing "gpu": TVM-FFI
builds, the ones a launch calls). Compile-only builds (CI, key "fake") stay in memory: their
value is the resource report (registers, SASS), which a reloaded object does not carry.

Hooking in: stage modules compile through ``stage3_fwd_kernel.compile_cache.compile_cached(key,
build)``, which keeps one memory cache and consults an optional store behind it. `STORE` is
that store: fa4 passes it in with ``compile_cache.set_store(STORE)`` before its first kernel
import, so a miss in memory consults the disk before compiling, and a fresh compile is written
back. The stage modules stay unaware of fa4 (the layering rule: fa4 composes the stages, never
the reverse).

A fresh kernel bound for the disk is compiled without the DSL's own JIT engine and launched from
the object written for the disk (`DiskStore.links` / `adopt`): the DSL would otherwise generate the
host code three times on a cold call (an MCJIT engine, the object its TVM-FFI function links, and
the export), where one is enough -- the same object the next process loads.

Environment: FA4_CACHE=0 (or false, False, off) disables the disk (memory only); FA4_CACHE_DIR moves it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import warnings
from typing import Any, Callable, Iterable, Optional

FORMAT = "kernels-v2"  # bump when the file layout or the object format changes (v2: TVM-FFI objects)
KERNEL_PACKAGES = ("stage2_emulated_exp", "stage3_fwd_kernel", "stage4_bwd_kernel", "stage5_scheduling")

_STATS = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "stores": 0, "corrupt": 0, "store_errors": 0,
          "unreadable": 0}
_LOCK = threading.Lock()


OFF_VALUES = ("0", "false", "off", "no")  # FA4_CACHE / FA4_PLANS values that turn them off, any case


def switched_off(name: str) -> bool:
    """Whether the environment variable `name` turns its feature off (0 / false / off / no)."""
    return os.environ.get(name, "1").strip().lower() in OFF_VALUES


def enabled() -> bool:
    return not switched_off("FA4_CACHE")


_UNREADABLE_WARNED: set = set()


def _warn_unreadable(path: pathlib.Path, exc: OSError):
    """Once per directory: an entry this process may not read is compiled again here (and its new file
    replaces the unreadable one where the directory allows)."""
    with _LOCK:
        _STATS["unreadable"] += 1
        if path.parent in _UNREADABLE_WARNED:
            return
        _UNREADABLE_WARNED.add(path.parent)
    warnings.warn(f"fa4 cache: cannot read {path} ({exc.strerror}); its kernel is compiled in this process. "
                  "Entries another user wrote must be readable to you (chmod -R a+r the cache)", RuntimeWarning,
                  stacklevel=4)


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: setting it back and forth races other threads' file creation


def share_file(target, executable: bool = False):
    """Give a file made by tempfile.mkstemp (always 0600) the mode open() would have given it under the
    umask, so a cache directory others can read serves them too (a cache built by one user and used by
    another). target: an open file descriptor or a path. Best effort."""
    mode = (0o777 if executable else 0o666) & ~_UMASK
    try:
        if isinstance(target, int):
            os.fchmod(target, mode)
        else:
            os.chmod(target, mode)
    except OSError:
        pass


def root_dir() -> pathlib.Path:
    """The cache root (FA4_CACHE_DIR, else the XDG cache dir); nothing is created here."""
    env = os.environ.get("FA4_CACHE_DIR")
    if env:
        try:
            return pathlib.Path(env).expanduser()
        except RuntimeError:  # "~user/..." of no such user: the path as written (a cache there fails to write)
            return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "fa4"


@functools.lru_cache(maxsize=None)
def _dsl_version() -> str:
    """The CuTe-DSL version, without importing cutlass (which would fix the arch). Where the
    distribution metadata is missing (a DSL unpacked straight into site-packages, as on the GPU
    machine), the bytes of cutlass/__init__.py stand in for it."""
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:
        pass
    try:
        spec = importlib.util.find_spec("cutlass")
        if spec is not None and spec.origin:
            return "src-" + hashlib.sha256(pathlib.Path(spec.origin).read_bytes()).hexdigest()[:12]
    except (ImportError, ValueError, OSError):
        pass
    return "unknown"


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """sha256 over every .py file of the kernel packages (path + bytes), found without importing
    them (importing would import cutlass and fix the arch)."""
    h = hashlib.sha256()
    for pkg in KERNEL_PACKAGES:
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            h.update(f"{pkg}:absent".encode())
            continue
        for loc in spec.submodule_search_locations:
            for path in sorted(pathlib.Path(loc).rglob("*.py")):
                h.update(f"{pkg}/{path.relative_to(loc).as_posix()}".encode())
                data = path.read_bytes()
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _tvm_ffi_version() -> str:
    try:
        from importlib.metadata import version

        return version("apache-tvm-ffi")
    except Exception:
        return "unknown"


BUILD_DIGITS = 12  # of the 16-digit fingerprint: the build id; the rest is the arch tag

# CuTe-DSL settings (CUTE_DSL_<name>) that change only logs, dumps or the DSL's own caching, per its
# env_manager's affects_compile flags (4.8.1); the arch has its own tag. Every other CUTE_DSL_ variable
# (LINEINFO, DEBUG, COMPILER_OPT, ENABLE_ASSERTIONS, ...) is part of the build id: an unknown one costs
# a separate directory, never a kernel built under other settings.
DSL_NEUTRAL_SETTINGS = frozenset((
    "ARCH", "CACHE_DIR", "DISABLE_FILE_CACHING", "DUMP_DIR", "ENABLE_OPTIMIZATION_WARNINGS", "FILTER_STACKTRACE",
    "JIT_CACHE_MAX_ELEMS", "JIT_TIME_PROFILING", "LOG_LEVEL", "LOG_TO_CONSOLE", "LOG_TO_FILE", "NO_CACHE",
    "PRINT_AFTER_PREPROCESSOR", "PRINT_IR", "SHOW_STACKTRACE", "WARNINGS_IGNORE", "KEEP"))


def dsl_settings() -> str:
    """The CUTE_DSL_ variables set in this process that can change generated code ('' when none)."""
    prefix = "CUTE_DSL_"
    return ";".join(f"{name}={value}" for name, value in sorted(os.environ.items())
                    if name.startswith(prefix) and name[len(prefix):] not in DSL_NEUTRAL_SETTINGS
                    and not name[len(prefix):].startswith("KEEP_"))


def build_id() -> str:
    """This build's generation: a hash of everything but the arch that changes generated code."""
    parts = [FORMAT, f"dsl={_dsl_version()}", f"tvm_ffi={_tvm_ffi_version()}",
             f"py={sys.version_info[0]}.{sys.version_info[1]}", f"src={_sources_digest()}"]
    settings = dsl_settings()
    if settings:  # absent by default, so the usual build id does not depend on this addition
        parts.append(f"dsl_env={settings}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:BUILD_DIGITS]


def arch_tag(arch: Optional[str] = None) -> str:
    """The arch's part of a directory name (default: this process's CUTE_DSL_ARCH, "auto" if unset).
    It hashes the arch alone, so tags of the known archs can be checked distinct once and for all."""
    arch = arch or os.environ.get("CUTE_DSL_ARCH") or "auto"
    return hashlib.sha256(f"arch={arch}".encode()).hexdigest()[:16 - BUILD_DIGITS]


def fingerprint(arch: Optional[str] = None) -> str:
    """16 hex digits naming the directory of this build's kernels for `arch` (see module docstring)."""
    return build_id() + arch_tag(arch)


def is_current(name: str) -> bool:
    """Whether a generation directory's name is this build's (for any arch)."""
    return len(name) == 16 and name.startswith(build_id())


def cache_dir(arch: Optional[str] = None) -> pathlib.Path:
    """Where this build's kernels for `arch` (default: this process's CUTE_DSL_ARCH) live."""
    return root_dir() / FORMAT / fingerprint(arch)


def key_hash(key) -> Optional[str]:
    """A stable name for a stage cache key, or None if the key cannot be named stably (its repr
    holds an object address, which would differ in the next process)."""
    text = repr(key)
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def persistable(key) -> bool:
    """Only runnable compiles go to disk (see module docstring), and never a traced one (its buffer
    address is baked into the code: stage3_fwd_kernel.trace)."""
    return isinstance(key, tuple) and "gpu" in key and "traced" not in key and key_hash(key) is not None


class DiskCache:
    """Content-verified object files in one directory. All methods swallow I/O and load errors
    (a cache must never make a working program fail); they count them in `stats()` instead."""

    def __init__(self, directory: pathlib.Path):
        self.dir = pathlib.Path(directory)

    @staticmethod
    def symbol(khash: str) -> str:
        return f"fa4_{khash[:24]}"  # a C identifier: the object's function prefix

    def entries(self, khash: str):
        def mtime(p):
            try:
                return p.stat().st_mtime
            except OSError:  # removed by another process meanwhile
                return 0.0
        try:  # an unreadable directory (permissions, a name too long) is a miss, never the caller's error
            if not self.dir.is_dir():
                return []
            return sorted(self.dir.glob(f"{khash}-*.o"), key=mtime, reverse=True)
        except OSError as exc:
            with _LOCK:
                _STATS["store_errors"] += 1
            warnings.warn(f"fa4 cache: could not read {self.dir}: {exc}", RuntimeWarning, stacklevel=3)
            return []

    def read_verified(self, khash: str) -> Optional[pathlib.Path]:
        """The newest entry whose bytes match the hash in its name. Mismatching entries are
        removed (with a warning), and so are entries older than the one returned: only readers
        prune, never writers, so the newest complete file of a key always survives a race."""
        entries = self.entries(khash)
        for i, path in enumerate(entries):
            try:
                data = path.read_bytes()
            except PermissionError as exc:  # another user's entry (made before entries followed the umask)
                _warn_unreadable(path, exc)
                continue
            except OSError:
                continue  # removed by another process in between: try the next
            want = path.stem.split("-", 1)[1]
            if hashlib.sha256(data).hexdigest()[:16] != want:
                self._discard(path, "content hash mismatch (truncated or modified file)")
                continue
            for older in entries[i + 1:]:
                try:
                    older.unlink()
                except OSError:
                    pass
            return path
        return None

    def _discard(self, path: pathlib.Path, why: str):
        with _LOCK:
            _STATS["corrupt"] += 1
        warnings.warn(f"fa4 cache: discarding {path.name}: {why}; the kernel will be recompiled", RuntimeWarning,
                      stacklevel=3)
        try:
            path.unlink()
        except OSError:
            pass

    def write(self, khash: str, data: bytes) -> Optional[pathlib.Path]:
        """Atomically add an entry: a temporary file in the same directory, fsync'ed, renamed into
        place. Older entries of the key are left for `read_verified` to prune (see there)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            final = self.dir / f"{khash}-{hashlib.sha256(data).hexdigest()[:16]}.o"
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{khash}.", suffix=".tmp")
            share_file(fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            return final
        except OSError as exc:
            with _LOCK:
                _STATS["store_errors"] += 1
            warnings.warn(f"fa4 cache: could not write to {self.dir}: {exc}", RuntimeWarning, stacklevel=3)
            return None

    # -- CuTe-DSL objects -------------------------------------------------------------------------
    def load(self, key) -> Optional[tuple[Any, pathlib.Path]]:
        khash = key_hash(key)
        if not khash:
            return None
        # Another reader that saw a newer entry may prune this one between its check and its link: the
        # newer entry then exists, so look again (once) instead of discarding and recompiling.
        for attempt in range(2):
            path = self.read_verified(khash)
            if path is None:
                return None
            try:
                return load_object(path, self.symbol(khash)), path
            except Exception as exc:  # e.g. an object from another DSL build: rebuild it
                if attempt == 0 and not path.exists():
                    continue
                self._discard(path, f"load failed: {type(exc).__name__}: {str(exc)[:200]}")
                return None

    def write_report(self, khash: str, report: Optional[dict]):
        """Keep the compile's resource report (registers, smem, SASS counts) next to the object,
        so a kernel loaded from disk still reports them. Best effort: JSON-able values only."""
        if not report:
            return
        clean = {k: v for k, v in report.items()
                 if k != "ptxas_log" and isinstance(v, (int, float, str, bool, type(None)))}
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{khash}.", suffix=".tmp")
            share_file(fd)
            with os.fdopen(fd, "w") as f:
                json.dump(clean, f)
            os.replace(tmp, self.dir / f"{khash}.report.json")
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def read_report(self, khash: str) -> dict:
        try:
            with open(self.dir / f"{khash}.report.json") as f:
                rep = json.load(f)
            return rep if isinstance(rep, dict) else {}
        except (OSError, ValueError):
            return {}

    def store(self, key, compiled_fn, report: Optional[dict] = None) -> Optional[pathlib.Path]:
        exported = self.export(key, compiled_fn, report, "it stays cached in memory only")
        return None if exported is None else exported[1]

    def export(self, key, compiled_fn, report: Optional[dict], fallback: str):
        """Export a compiled kernel and write it with its report: (object bytes, path or None if the
        write failed), or None if it could not be exported (`fallback` says what happens then)."""
        khash = key_hash(key)
        if khash is None:
            return None
        self.write_report(khash, report)
        try:
            data = export_object(compiled_fn, self.symbol(khash))
        except Exception as exc:
            with _LOCK:
                _STATS["store_errors"] += 1
            warnings.warn(f"fa4 cache: could not export a compiled kernel ({type(exc).__name__}: {str(exc)[:200]}); "
                          f"{fallback}", RuntimeWarning, stacklevel=4)
            return None
        path = self.write(khash, data)
        if path is not None:
            with _LOCK:
                _STATS["stores"] += 1
        return data, path


_RUNTIME_PRELOADED = False


def export_object(compiled_fn, symbol: str) -> bytes:
    """The ELF object of a TVM-FFI compiled function, its entry point named `symbol`."""
    with tempfile.TemporaryDirectory(prefix="fa4_export_") as tmp:
        path = os.path.join(tmp, f"{symbol}.o")
        compiled_fn.export_to_c(object_file_path=path, function_name=symbol)
        with open(path, "rb") as f:
            data = f.read()
    if not data:
        raise OSError("export_to_c wrote an empty object")
    return data


def load_object_bytes(data: bytes, symbol: str):
    """`load_object` for an object that is not on disk (its write failed)."""
    with tempfile.TemporaryDirectory(prefix="fa4_link_") as tmp:
        path = pathlib.Path(tmp) / f"{symbol}.o"
        path.write_bytes(data)
        return load_object(path, symbol)


def load_object(path: pathlib.Path, symbol: str):
    """JIT-link an object written by `export_object` and return its function."""
    global _RUNTIME_PRELOADED
    import cutlass.cute as cute

    if not _RUNTIME_PRELOADED:
        # The DSL's runtime libraries are opened without RTLD_GLOBAL by load_module; a reloaded
        # object resolves its CUDA-library symbols against the global namespace, so make them
        # visible there first (the official FA4 cache does the same).
        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _RUNTIME_PRELOADED = True
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, symbol)


def disk() -> Optional[DiskCache]:
    return DiskCache(cache_dir()) if enabled() else None


# ---------------------------------------------------------------------------------------------
# the store behind the stages' compile cache
# ---------------------------------------------------------------------------------------------
class _FirstCallGuard:
    """The function loaded from disk, until its first call succeeds. If that call raises (an
    object that loads but does not run here), the entry is dropped, the kernel recompiled and the
    call retried -- once. After a success the raw function replaces this wrapper in the cache."""

    def __init__(self, fn, path, on_success: Callable, recompile: Callable):
        self.fn, self.path, self._on_success, self._recompile = fn, path, on_success, recompile

    def __call__(self, *args, **kwargs):
        try:
            res = self.fn(*args, **kwargs)
        except Exception as exc:
            warnings.warn(f"fa4 cache: {self.path.name} loaded but failed on first call ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); recompiling", RuntimeWarning, stacklevel=2)
            try:
                self.path.unlink()
            except OSError:
                pass
            fn = self._recompile()
            return fn(*args, **kwargs)
        self._on_success(self.fn)
        return res


class DiskStore:
    """fa4's disk cache as the stages' compile-cache store (`stage3_fwd_kernel.compile_cache.Store`):
    ``compile_cache.set_store(STORE)`` puts it behind the memory cache. It reads the environment on
    every call, so FA4_CACHE / FA4_CACHE_DIR changes take effect at once."""

    def memory_hit(self, key) -> None:
        with _LOCK:
            _STATS["memory_hits"] += 1

    def load(self, key, rebuild: Callable):
        """The kernel of `key` from disk, as a compile-cache entry whose function is guarded for its
        first call (see `_FirstCallGuard`); None on a miss or for keys that never go to disk."""
        store = disk() if persistable(key) else None
        hit = store.load(key) if store is not None else None
        if hit is None:
            return None
        from stage3_fwd_kernel import compile_cache

        fn, path = hit
        report = dict(store.read_report(key_hash(key)), loaded_from=str(path))
        with _LOCK:
            _STATS["disk_hits"] += 1
        return _guarded(key, compile_cache.Compiled(None, report, "", ""), fn, path, lambda: rebuild().fn)

    def offer(self, key, compiled) -> None:
        with _LOCK:
            _STATS["misses"] += 1
        store = disk() if persistable(key) else None
        if store is not None:
            store.store(key, compiled.fn, compiled.log_report)

    def links(self, key) -> bool:
        """A kernel bound for the disk is launched from its own exported object, as the next process
        will: its compile skips the DSL's JIT engine (two of the three host-code generations a cold
        kernel cost when the engine was built and the object exported besides)."""
        return persistable(key) and enabled()

    def adopt(self, key, compiled, rebuild: Callable):
        """Export a kernel compiled without an engine, write it, and return it linked from that object
        (guarded for its first call, as a disk hit is); `rebuild()` if it cannot be exported or linked."""
        with _LOCK:
            _STATS["misses"] += 1
        store = DiskCache(cache_dir())
        exported = store.export(key, compiled.fn, compiled.log_report, "compiling it again with the DSL's engine")
        if exported is None:
            return rebuild()
        data, path = exported
        symbol = store.symbol(key_hash(key))
        try:
            fn = load_object(path, symbol) if path is not None else load_object_bytes(data, symbol)
        except Exception as exc:
            warnings.warn(f"fa4 cache: a kernel exported for the disk did not link ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); compiling it again with the DSL's engine", RuntimeWarning,
                          stacklevel=3)
            return rebuild()
        from stage3_fwd_kernel import compile_cache

        def recompile():
            fresh = rebuild()
            compile_cache.remember(key, fresh)
            return fresh.fn

        guard_path = path if path is not None else pathlib.Path(f"(unwritten) {symbol}.o")
        return _guarded(key, compiled, fn, guard_path, recompile)


def _guarded(key, entry, fn, path, recompile: Callable):
    """`entry` (a compile-cache entry) with `fn`, an object just linked, guarded for its first call;
    after a success the raw function replaces the guard in the memory cache."""
    from stage3_fwd_kernel import compile_cache

    def on_success(raw):
        compile_cache.remember(key, entry.with_function(raw))

    return entry.with_function(_FirstCallGuard(fn, path, on_success, recompile))


STORE = DiskStore()


# ---------------------------------------------------------------------------------------------
# reporting / housekeeping
# ---------------------------------------------------------------------------------------------
def stats() -> dict:
    with _LOCK:
        return dict(_STATS)


def _tree_size(path: pathlib.Path) -> tuple[int, int, int]:
    """(kernel objects, launch plans, bytes of every file: objects, their linked libraries, plans,
    reports) under path."""
    objects = plans = size = 0
    if not _readable_dir(path):
        return objects, plans, size
    try:
        for p in path.rglob("*"):
            try:
                if p.is_file():
                    size += p.stat().st_size
                    objects += p.suffix == ".o"
                    plans += p.suffix == ".json" and p.parent.name == "plans"
            except OSError:
                pass
    except OSError:  # a subdirectory this process cannot list: what was counted so far
        pass
    return objects, plans, size


def _readable_dir(path: pathlib.Path) -> bool:
    """A directory this process can list (False for a missing, unreadable or unnamable one)."""
    try:
        return path.is_dir() and os.access(path, os.R_OK | os.X_OK)
    except OSError:
        return False


def old_formats() -> list:
    """Directories of earlier cache formats beside this one's (kernels-v1, ...): never read, only removed
    by `clear` (with or without stale_only)."""
    base = root_dir()
    try:
        return sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("kernels-v") and p.name != FORMAT)
    except OSError:
        return []


def info(archs: Iterable[str] = ()) -> dict:
    """Where the cache is and what it holds (for `python -m fa4 info` and `cache info`).
    current: this build's generation directories on disk, name -> arch (the one of `archs` or this
    process's CUTE_DSL_ARCH whose tag it carries; None if neither), dir, entries (kernels), plans
    (fa4/_plans.py), bytes; current_entries / current_plans / current_bytes: their totals; stale:
    the other directories' names; old_formats: earlier formats' directories, name -> bytes; arch_dirs: the
    directory each of `archs` (and this process's CUTE_DSL_ARCH) writes to, arch -> path, on disk or
    not; process_dir: this process's, or None where CUTE_DSL_ARCH is unset (fa4 sets it from the
    device before it compiles anything: a process that has not yet run a kernel has no directory)."""
    root = root_dir() / FORMAT
    files, _, size = _tree_size(root)
    gens = sorted(p.name for p in root.iterdir() if p.is_dir()) if _readable_dir(root) else []
    own = os.environ.get("CUTE_DSL_ARCH") or "auto"
    labels = {arch_tag(a): a for a in (own, *archs)}
    current = {}
    for name in filter(is_current, gens):
        n, plans, b = _tree_size(root / name)
        current[name] = {"arch": labels.get(name[BUILD_DIGITS:]), "dir": str(root / name), "entries": n,
                         "plans": plans, "bytes": b}
    arch_dirs = {a: str(cache_dir(a)) for a in dict.fromkeys((*archs, *([own] if own != "auto" else [])))}
    return {"enabled": enabled(), "root": str(root), "build": build_id(),
            "process_dir": str(cache_dir()) if own != "auto" else None, "arch_dirs": arch_dirs,
            "current": current, "current_entries": sum(c["entries"] for c in current.values()),
            "current_plans": sum(c["plans"] for c in current.values()),
            "current_bytes": sum(c["bytes"] for c in current.values()), "entries": files, "bytes": size,
            "generations": gens, "stale": [g for g in gens if not is_current(g)],
            "old_formats": {p.name: _tree_size(p)[2] for p in old_formats()}, "stats": stats()}


def clear(stale_only: bool = False) -> tuple:
    """Delete cached kernels: every generation directory, or with stale_only those of other builds
    (this build's are kept for every arch: `is_current`). Returns (directories removed, [directories
    that could not be removed, with the first error]). Earlier formats' directories (old_formats) go
    either way, each counted as one."""
    root = root_dir() / FORMAT
    try:
        children = list(root.iterdir()) if root.is_dir() else []
    except OSError as exc:  # exists but cannot be read: nothing removed, and said so
        return 0, [f"{root} ({exc})"]
    n, failed = 0, []
    for p in children + old_formats():
        if p.is_dir() and not (stale_only and p.parent == root and is_current(p.name)):
            errors: list = []

            def note(fn, path, exc, errors=errors):  # exc: an exception (onexc) or exc_info (onerror)
                errors.append(f"{path}: {exc[1] if isinstance(exc, tuple) else exc}")
            shutil.rmtree(p, **({"onexc": note} if sys.version_info >= (3, 12) else {"onerror": note}))
            if errors or p.exists():
                failed.append(f"{p} ({errors[0] if errors else 'still there'})")
            else:
                n += 1
    return n, failed
