"""Launch plans: a repeated call replayed in a fresh process without importing CuTe-DSL.

Why: with every kernel in the disk cache, a fresh process still paid about 1.7 s above `import torch`
for its first forward + backward on an H200, 1.0-1.1 s of it `import cutlass` (the kernel modules
are CuTe-DSL code, and even a cache hit goes through them to build the launch). But the host side of
a dense call is a fixed sequence once the shapes are fixed: allocate the outputs and the scratch,
view the inputs, launch one to four compiled kernels with those tensors and some numbers.

What a plan is: that sequence, recorded from a real call and written next to the kernels
(``<cache dir>/plans/<signature hash>.json``). The recording sees every torch function of the call
through a TorchFunctionMode (so it knows how each tensor was made: an input, a torch function's
result, or a small external constant such as a cached 1-element stand-in, whose values it keeps) and
every kernel the call takes from the stages' compile cache (``compile_cache.set_launch_observer``).
The kernels are the disk cache's objects, linked once into shared libraries that
``tvm_ffi.load_module`` opens without the DSL (milliseconds). Replaying runs the same torch functions
and calls the same kernels with the new call's tensors.

Who: the dense forward and backward (fa4._dispatch, roles "fwd" / "bwd") and flash_attn_with_kvcache's eager
step on the device (fa4._kvcache, role "kvcache": the append, rotary embedding, split-KV launch and merge),
each after its own argument checks, which a replay never skips.

When: a plan is recorded on the second call of a signature in a process (the first may compile, and
training repeats its shapes), written only if the whole call was recordable, and used by later
processes -- and by this one -- whenever the signature matches exactly.

Bounds: a cache that grows every step (transformers' DynamicCache) is a new signature each step, so a
long generation would otherwise leave a plan file and a decoded plan per step (the transformers
integration runs such steps without plans: `call_without_plans`). A process keeps at most
MEMORY_SIGNATURES signatures' worth of plans, counts and hashes (the least recently used plans go first,
the oldest counts and hashes; a dropped plan loads again from disk), and a plan directory keeps about
FA4_PLANS_MAX plans (2048 by default): a write that would pass it deletes the least recently used
quarter (by modification time, which loading a plan refreshes). A process counts the directory on its
first write and then adds its own writes, so several processes writing at once can pass the limit until
their next count. A plan a CUDA graph was captured over keeps its constants for good (the graph reads
them by address); other plans' constants go with the plan.

The signature is everything the host code decides on: the role ("fwd" / "bwd" / "kvcache"), every tensor's
shape, strides, dtype, device and 16-byte alignment, every scalar argument, the device (name, SMs,
L2), fa4's routing switches, and the sources of fa4 and of the kernel packages (the cache fingerprint
directory). A call that differs in any of them takes the normal path.

Never recorded (the recording gives up, and the call runs normally): a call whose host code reads a
tensor's values (``.item()``, ``.tolist()``: varlen's cu_seqlens), a tensor made by a function the
replay cannot look up by name, an external tensor over 4096 elements or not contiguous, a kernel
that is not on disk, no C compiler to link a kernel, CUDA graph capture. FA4_PLANS=0 turns plans off
(FA4_CACHE=0 does too).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import operator
import os
import pathlib
import shutil
import copy
import subprocess
import tempfile
import threading
import warnings
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import _cache

FORMAT = 1
MAX_CONSTANT_ELEMENTS = 4096
MEMORY_SIGNATURES = 1024       # per table below: a growing cache adds one signature a step
DEFAULT_MAX_ON_DISK = 2048     # plans a directory keeps (FA4_PLANS_MAX); about 3 KB each

_LOCK = threading.Lock()
_PLANS: dict = {}        # signature hash -> _Replay, or None (no plan on disk / not plannable)
_SEEN: dict = {}         # signature hash -> calls that took the normal path in this process
_STATS = {"replays": 0, "recorded": 0, "unrecordable": 0, "discarded": 0}
_NAMES: dict = {}        # a signature's facts -> its hash (the plan's file name)
_LAST_REFUSAL: dict = {}  # signature hash -> why the recording gave up (for tests and `fa4 info`)
# the constants of every plan replayed under CUDA graph capture: the graph reads them by address, so
# they outlive a plan that is dropped or forgotten (as fa4._kvcache keeps its own constants)
_KEPT_CONSTANTS: list = []
_ENTRIES: dict = {}      # (cache dir, kernel hash) -> its library's entry in a plan (hashing it costs ms)
_WRITES = {"on_disk": None}  # the plans this process takes the directory to hold (None: not counted yet)


def _remember(table: dict, key, value) -> None:
    """table[key] = value, dropping the oldest entries past MEMORY_SIGNATURES (call under _LOCK)."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MEMORY_SIGNATURES:
        del table[next(iter(table))]


class Unrecordable(Exception):
    """The call's host side does something a plan cannot replay."""


# set while a caller runs calls it knows to have new shapes each time (call_without_plans)
_SUSPENDED = contextvars.ContextVar("fa4_plans_suspended", default=False)


def enabled() -> bool:
    return not _SUSPENDED.get() and _cache.enabled() and not _cache.switched_off("FA4_PLANS")


def call_without_plans(fn, *args, **kwargs):
    """fn(*args, **kwargs) with no plan replayed or recorded inside it (in its context only): for
    a caller that knows its calls' shapes are new each time, whose plans would be recorded and then
    replayed at most a few times (a cache growing a key a step; benchmarks.inspect.growing_cache_host)."""
    token = _SUSPENDED.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _SUSPENDED.reset(token)


def stats() -> dict:
    with _LOCK:
        return dict(_STATS)


# ---------------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _host_sources() -> str:
    """sha256 of the host code outside the kernel packages (which the cache fingerprint hashes): fa4
    (the routing: schedulers, tiles) and stage0_reference (argument checks the stages call)."""
    import importlib.util

    h = hashlib.sha256()
    for pkg in ("fa4", "stage0_reference"):
        spec = importlib.util.find_spec(pkg)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(pathlib.Path(root).rglob("*.py")):
                h.update(f"{pkg}/{path.relative_to(root).as_posix()}".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, torch.__version__)
    p = torch.cuda.get_device_properties(device)
    return (p.name, p.multi_processor_count, getattr(p, "L2_cache_size", 0), torch.version.cuda, torch.__version__)


def _tensor_facts(t) -> Any:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def signature(role: str, arch: str, tensors: tuple, scalars: tuple, switches: tuple) -> str:
    """A stable hash of everything the host code of this call decides on (module docstring). The
    inputs' identity pattern is part of it: a call recorded with q is k must not serve separate ones."""
    device = next(t.device for t in tensors if t is not None)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    same = tuple(next(j for j, u in enumerate(tensors) if u is t) if t is not None else None for t in tensors)
    facts = (role, arch, tuple(_tensor_facts(t) for t in tensors), same, scalars, switches, _device_facts(device))
    name = _NAMES.get(facts)
    if name is None:  # hashed once per signature and process: this runs on every dense call
        name = hashlib.sha256(repr((FORMAT, facts, _host_sources(), _cache.build_id())).encode()).hexdigest()[:32]
        with _LOCK:
            _remember(_NAMES, facts, name)
    return name


def plan_dir(cute_arch: str) -> pathlib.Path:
    return _cache.cache_dir(cute_arch) / "plans"


# ---------------------------------------------------------------------------------------------
# encoding of op and kernel arguments (JSON)
# ---------------------------------------------------------------------------------------------
_SCALAR_TYPES = (type(None), bool, int, float, str)


def _encode_value(value, slot_of: Callable) -> Any:
    if isinstance(value, torch.Tensor):
        return {"s": slot_of(value)}
    if isinstance(value, _SCALAR_TYPES):
        return value  # json writes and reads inf / nan too
    if isinstance(value, (tuple, list)):
        return {"t" if isinstance(value, tuple) else "l": [_encode_value(v, slot_of) for v in value]}
    if isinstance(value, dict):
        return {"d": {k: _encode_value(v, slot_of) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"sl": [_encode_value(v, slot_of) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"el": 0}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return {"torch": str(value).split(".")[-1]}  # torch.<name>
    if isinstance(value, torch.device):
        return {"dev": str(value)}
    raise Unrecordable(f"an argument of type {type(value).__name__}")


def _decoder(value) -> Callable[[list], Any]:
    """A function slots -> the argument value (built once per plan, run per replay)."""
    if isinstance(value, dict):
        (tag, inner), = value.items()
        if tag == "s":
            return lambda slots, i=inner: slots[i]
        if tag in ("t", "l"):
            parts = [_decoder(v) for v in inner]
            kind = tuple if tag == "t" else list
            return lambda slots: kind(p(slots) for p in parts)
        if tag == "d":
            parts = {k: _decoder(v) for k, v in inner.items()}
            return lambda slots: {k: p(slots) for k, p in parts.items()}
        if tag == "sl":
            parts = [_decoder(v) for v in inner]
            return lambda slots: slice(*(p(slots) for p in parts))
        const = {"el": lambda: Ellipsis, "torch": lambda: getattr(torch, inner),
                 "dev": lambda: torch.device(inner)}[tag]()
        return lambda slots: const
    return lambda slots: value


# torch functions whose non-tensor result is a tensor's *values* (the host code may branch on them);
# other non-tensor results (shape, stride, dtype, device, data_ptr, ...) are fixed by the signature
_VALUE_READERS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                  "equal", "allclose", "is_nonzero", "__iter__", "__array__", "__format__", "__contains__",
                  "__repr__", "__str__", "untyped_storage", "storage", "_typed_storage", "__reduce_ex__"}


def _op_name(func) -> Optional[str]:
    """'Tensor.<name>' / 'torch.<name>' for a function the replay can look up again, else None."""
    name = getattr(func, "__name__", None)
    if name is None:
        return None
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    return None


_NEVER_REPLAYED = {"load", "save", "compile", "set_default_device", "set_default_dtype", "manual_seed", "seed"}


def _op_from_name(name: str):
    owner, attr = name.split(".", 1)
    if owner not in ("Tensor", "torch") or attr in _NEVER_REPLAYED or "." in attr:
        raise ValueError(f"{name}: not a function a plan replays")
    return getattr(torch.Tensor if owner == "Tensor" else torch, attr)


def _tensors_in(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(_tensors_in(v) for v in value)


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------
class _Recorder(TorchFunctionMode):
    """Every torch function of the call that makes or changes a tensor, with its tensors as slots;
    every kernel launch (see `observe`). A TorchFunctionMode, not a TorchDispatchMode: entering the
    latter imported some 800 modules (dynamo, sympy: 2.2 s of a recording call on an H200)."""

    def __init__(self, inputs: tuple):
        super().__init__()
        self.steps: list = []
        self.kernels: list = []          # stage cache keys, in order of first use
        self.constants: list = []        # {"slot", "dtype", "shape", "values", "device"}
        self._constant_slots: set = set()
        self.failure: Optional[str] = None
        self.paused = False              # inside a kernel launch: its own tensor handling is not the host's
        self._slots: dict = {}           # id(tensor) -> slot
        self._alive: list = []           # keeps the tensors (hence their ids) alive while recording
        self.num_inputs = len(inputs)
        for t in inputs:
            self._bind(t)

    def _bind(self, t) -> int:
        slot = len(self._alive)
        self._alive.append(t)
        if t is not None:
            self._slots[id(t)] = slot
        return slot

    def slot_of(self, t) -> int:
        slot = self._slots.get(id(t))
        if slot is not None:
            return slot
        # a tensor made before the call (a cached stand-in): kept by value
        if t.numel() > MAX_CONSTANT_ELEMENTS or not t.is_contiguous():
            raise Unrecordable(f"an external tensor {tuple(t.shape)} {t.dtype} (kept by value only up to "
                               f"{MAX_CONSTANT_ELEMENTS} contiguous elements)")
        with torch._C.DisableTorchFunction():
            values = t.detach().cpu().reshape(-1).tolist()
        slot = self._bind(t)
        self._constant_slots.add(slot)
        self.constants.append({"slot": slot, "dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
                               "values": values, "device": str(t.device)})
        return slot

    def fail(self, why: str):
        if self.failure is None:
            self.failure = why

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.failure is not None or self.paused:
            return func(*args, **kwargs)
        name = _op_name(func)
        out = func(*args, **kwargs)
        label = name or getattr(func, "__name__", repr(func))
        if not _tensors_in(out) and out is not None:
            if label.rsplit(".", 1)[-1] in _VALUE_READERS:
                self.fail(f"{label} reads a tensor's values (the host code may branch on them)")
            return out  # metadata: fixed by the signature
        if name is None:
            self.fail(f"{label}: a function the replay cannot look up")
            return out
        try:
            enc = (_encode_value(tuple(args), self.slot_of), _encode_value(dict(kwargs), self.slot_of))
        except Unrecordable as exc:
            self.fail(f"{name}: {exc}")
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(o, torch.Tensor) or o is None for o in outs):
            self.fail(f"{name} returns tensors mixed with other values")
            return out
        self.steps.append({"op": name, "args": enc[0], "kwargs": enc[1],
                           "out": [None if o is None else self._bind(o) for o in outs],
                           "tuple": isinstance(out, (tuple, list))})
        return out

    def observe(self, key, compiled):
        """compile_cache's launch observer: `compiled` with a fn that records its launches."""
        if key not in self.kernels:
            self.kernels.append(key)
        index = self.kernels.index(key)
        fn = compiled.fn
        recorder = self

        def launch(*args):
            if recorder.failure is None:
                try:
                    recorder.steps.append({"kernel": index, "args": _encode_value(tuple(args), recorder.slot_of)})
                except Unrecordable as exc:
                    recorder.fail(f"a kernel argument: {exc}")
            recorder.paused = True
            try:
                value = fn(*args)
            finally:
                recorder.paused = False
            if value is not None:
                recorder.fail("a kernel returned a value (a replay calls kernels for their effects only)")
            return value

        observed = copy.copy(compiled)
        observed.fn = launch
        return observed


@contextlib.contextmanager
def _observing(recorder: _Recorder):
    from stage3_fwd_kernel import compile_cache

    if compile_cache._LAUNCH_OBSERVER.get() is not None:  # a call inside a recorded call: its kernels
        recorder.fail("a recording inside another one")   # would go to the outer plan only
    token = compile_cache.set_launch_observer(recorder.observe)
    try:
        with recorder:
            yield
    finally:
        compile_cache.reset_launch_observer(token)


def _link(obj: pathlib.Path) -> pathlib.Path:
    """The kernel object linked into a shared library beside it (once), against the DSL's runtime and
    TVM-FFI (their directories as rpaths, so loading needs neither the DSL nor an environment)."""
    import cutlass.cute as cute

    runtime = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p)]
    # the rpaths point into this environment: another one sharing the cache links its own library
    where = hashlib.sha256("|".join(runtime).encode()).hexdigest()[:8]
    lib = obj.with_name(f"{obj.stem}-{where}.so")
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Unrecordable("no C compiler (cc / gcc) to link the kernel objects")
    fd, tmp = tempfile.mkstemp(dir=obj.parent, prefix=f".{obj.stem}.", suffix=".so.tmp")
    os.close(fd)
    cmd = [cc, "-shared", "-o", tmp, str(obj), *runtime,
           *(f"-Wl,-rpath,{d}" for d in sorted({os.path.dirname(p) for p in runtime}))]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise Unrecordable(f"linking {obj.name} failed: {res.stderr.strip()[:300]}")
        _cache.share_file(tmp, executable=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _kernel_entry(key, cute_arch: str) -> dict:
    """The plan's record of a kernel: its library, the library's hash, its symbol. Once per kernel and
    process (verifying the object and hashing the library read both files), while the library is there."""
    khash = _cache.key_hash(key) if _cache.persistable(key) else None
    if khash is None:
        raise Unrecordable(f"kernel {key[:3]!r}... is not kept on disk")
    directory = _cache.cache_dir(cute_arch)
    known = _ENTRIES.get((str(directory), khash))
    if known is not None and (directory / known["lib"]).exists():
        return known
    obj = _cache.DiskCache(directory).read_verified(khash)
    if obj is None:
        raise Unrecordable(f"kernel {khash} is not in the disk cache")
    lib = _link(obj)
    entry = {"lib": lib.name, "sha": hashlib.sha256(lib.read_bytes()).hexdigest()[:16],
             "symbol": _cache.DiskCache.symbol(khash)}
    with _LOCK:
        _ENTRIES[(str(directory), khash)] = entry
    return entry


def _encode_outputs(result, recorder: _Recorder):
    """The call's result as slots: each an input or a tensor a recorded function made (a constant
    would be one shared tensor, returned by every replay)."""
    def slot_of(t):
        slot = recorder._slots.get(id(t))
        if slot is None or slot in recorder._constant_slots:
            raise Unrecordable("an output made outside the recorded functions")
        return slot
    return _encode_value(result, slot_of)


def _write(sig: str, cute_arch: str, recorder: _Recorder, result) -> pathlib.Path:
    plan = {"format": FORMAT, "inputs": recorder.num_inputs, "slots": len(recorder._alive),
            "constants": recorder.constants, "steps": recorder.steps,
            "kernels": [_kernel_entry(k, cute_arch) for k in recorder.kernels],
            "outputs": _encode_outputs(result, recorder)}
    keep = max_on_disk()  # a bad FA4_PLANS_MAX refuses the write (a warning), not the call
    directory = plan_dir(cute_arch)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{sig}.", suffix=".tmp")
    _cache.share_file(fd)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(plan))  # one string: json.dump streams through the pure-Python encoder
        os.replace(tmp, directory / f"{sig}.json")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with _LOCK:
        known = _WRITES["on_disk"]
        due = known is None or known + 1 > keep
        if not due:
            _WRITES["on_disk"] = known + 1
    if due:  # counted on the first write and when the count says the limit is reached, not per write
        _, left = _prune(directory, keep, spare=f"{sig}.json")
        with _LOCK:
            _WRITES["on_disk"] = left
    return directory / f"{sig}.json"


def max_on_disk() -> int:
    """FA4_PLANS_MAX: the plans a plan directory keeps (a whole number >= 1; 2048 by default)."""
    raw = os.environ.get("FA4_PLANS_MAX", "").strip()
    if not raw:
        return DEFAULT_MAX_ON_DISK
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"FA4_PLANS_MAX: expected a whole number >= 1, got {raw!r}")
    return value


def prune(directory: pathlib.Path, keep: Optional[int] = None) -> int:
    """Past `keep` plans (default max_on_disk()) in `directory`, delete the least recently used ones
    (oldest modification time) down to three quarters of it (at least one kept). Returns how many were
    deleted. Their kernels' libraries stay: they are per kernel, as bounded as the kernel cache, and shared."""
    return _prune(directory, max_on_disk() if keep is None else keep)[0]


def _prune(directory: pathlib.Path, keep: int, spare: Optional[str] = None) -> tuple:
    """prune's work: (deleted, plans left). `spare`: a plan just written, never deleted here."""
    try:
        plans = [p for p in directory.iterdir() if p.suffix == ".json"]
    except OSError:
        return 0, 0
    if len(plans) <= keep:
        return 0, len(plans)
    aged = []
    for path in plans:
        if path.name == spare:
            continue
        try:
            aged.append((path.stat().st_mtime, path.name, path))
        except OSError:  # deleted meanwhile (another process pruning)
            pass
    aged.sort()
    deleted = 0
    for _, _, path in aged[:max(0, len(plans) - max(1, keep * 3 // 4))]:
        try:
            path.unlink()
            deleted += 1
        except OSError:
            pass
    return deleted, len(plans) - deleted


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def recording(sig: Optional[str], cute_arch: str, inputs: tuple):
    """Around a call that took the normal path: yields a function to hand the call's result to
    (`done(result)`), which writes the plan when this is the signature's second call here and
    everything was recordable. Recording problems never fail the call: they only mean no plan."""
    with _LOCK:
        seen = _SEEN.get(sig, 0) if sig else 0
        if sig and seen < 2:  # later counts change nothing; a hot signature is not re-inserted per call
            _remember(_SEEN, sig, seen + 1)
    want = sig is not None and seen == 1 and sig not in _LAST_REFUSAL and not _capturing()
    if not want:
        yield lambda result: None
        return
    recorder = _Recorder(inputs)
    box: list = []
    with _observing(recorder):
        yield box.append
    try:
        if recorder.failure is not None:
            raise Unrecordable(recorder.failure)
        if not box:
            raise Unrecordable("the call returned no result")
        if not recorder.kernels:
            raise Unrecordable("the call launched no kernel")
        _write(sig, cute_arch, recorder, box[0])
        with _LOCK:
            _STATS["recorded"] += 1
            _PLANS.pop(sig, None)  # the next call loads it
    except Unrecordable as exc:
        with _LOCK:
            _STATS["unrecordable"] += 1
            _remember(_LAST_REFUSAL, sig, str(exc))
    except Exception as exc:  # never the user's call's failure: its result is already computed
        with _LOCK:
            _remember(_LAST_REFUSAL, sig, f"{type(exc).__name__}: {exc}")
        warnings.warn(f"fa4 plans: could not write a launch plan: {type(exc).__name__}: {str(exc)[:200]}",
                      RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------
_KERNELS: dict = {}  # (library path, sha, symbol) -> the loaded function, once per process


def _kernel(path: str, sha: str, symbol: str):
    fn = _KERNELS.get((path, sha, symbol))
    if fn is None:
        fn = _KERNELS[(path, sha, symbol)] = _load_kernel(path, sha, symbol)
    return fn


def _load_kernel(path: str, sha: str, symbol: str):
    data = pathlib.Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest()[:16] != sha:
        raise OSError(f"{path}: content hash mismatch")
    import tvm_ffi

    return getattr(tvm_ffi.load_module(path), symbol)


def _static_value(value) -> tuple:
    """(True, the decoded value) for an encoded argument that names no slot (a scalar, a shape, a
    dtype, ...), else (False, None): such a value is decoded once per plan, not once per replay."""
    if not isinstance(value, dict):
        return True, value
    (tag, inner), = value.items()
    if tag == "s":
        return False, None
    if tag in ("t", "l", "sl"):
        parts = [_static_value(v) for v in inner]
        if not all(ok for ok, _ in parts):
            return False, None
        values = [v for _, v in parts]
        return True, (tuple(values) if tag == "t" else values if tag == "l" else slice(*values))
    if tag == "d":
        parts = {k: _static_value(v) for k, v in inner.items()}
        if not all(ok for ok, _ in parts.values()):
            return False, None
        return True, {k: v for k, (_, v) in parts.items()}
    return True, _decoder(value)(None)


class _Replay:
    """A plan decoded once: per step a callable over the slot list.

    Host time is the point of a plan, so a step does as little Python as it can: every argument
    that names no tensor (scalars, shapes, dtypes) is decoded once and kept in a slot of its own
    past the plan's slots, so a step's positional arguments are one ``itemgetter`` over the slot
    list, and keyword arguments without tensors are bound once (``functools.partial``). Arguments
    nested around a tensor (a list of tensors, say) take the general decoder."""

    def __init__(self, plan: dict, directory: pathlib.Path):
        if plan.get("format") != FORMAT:
            raise ValueError(f"plan format {plan.get('format')!r}")
        self.num_inputs, self.num_slots = plan["inputs"], plan["slots"]
        if not all(_bare_name(k["lib"]) for k in plan["kernels"]):
            raise ValueError("a kernel library outside the cache directory")
        kernels = [_kernel(str(directory.parent / k["lib"]), k["sha"], k["symbol"]) for k in plan["kernels"]]
        self.constants = plan["constants"]
        self._materialized: Optional[list] = None
        self.warm = False  # replayed once in this process: its kernels are loaded, its constants made
        self.kept = False  # its constants are in _KEPT_CONSTANTS (replayed under capture)
        self._static: list = []  # the decoded tensor-free arguments, slots num_slots.. of every replay
        self.steps = []
        for step in plan["steps"]:
            args = self._positional(step["args"])
            if "kernel" in step:
                self.steps.append(self._kernel_step(kernels[step["kernel"]], args))
            else:
                op = _op_from_name(step["op"])
                static_kw, kwargs = _static_value(step["kwargs"])
                if static_kw:
                    op, kwargs = (functools.partial(op, **kwargs) if kwargs else op), None
                else:
                    kwargs = _decoder(step["kwargs"])
                self.steps.append(self._op_step(op, args, kwargs, step["out"], step["tuple"]))
        self.outputs = _decoder(plan["outputs"])
        self._template = [None] * self.num_slots + self._static

    def _positional(self, encoded) -> Callable[[list], tuple]:
        """slots -> a step's positional arguments (encoded as one tuple)."""
        if isinstance(encoded, dict) and set(encoded) == {"t"}:
            indices = []
            for value in encoded["t"]:
                if isinstance(value, dict) and set(value) == {"s"}:
                    indices.append(value["s"])
                    continue
                static, decoded = _static_value(value)
                if not static:
                    return _decoder(encoded)
                indices.append(self.num_slots + len(self._static))
                self._static.append(decoded)
            if len(indices) > 1:
                return operator.itemgetter(*indices)
            if indices:
                return lambda slots, i=indices[0]: (slots[i],)
            return lambda slots: ()
        return _decoder(encoded)

    @staticmethod
    def _kernel_step(fn, args):
        def run(slots):
            fn(*args(slots))
        return run

    @staticmethod
    def _op_step(op, args, kwargs, outs, is_tuple):
        if kwargs is None and not is_tuple and len(outs) == 1 and outs[0] is not None:
            out = outs[0]

            def run_one(slots):  # the common step: tensor-free keywords, one tensor out
                slots[out] = op(*args(slots))
            return run_one

        def run(slots):
            value = op(*args(slots), **kwargs(slots)) if kwargs is not None else op(*args(slots))
            for slot, v in zip(outs, value if is_tuple else (value,)):
                if slot is not None:
                    slots[slot] = v
        return run

    def _constants(self) -> list:
        """The external tensors, made once and then shared by every replay (as the code that made
        them kept one each)."""
        with _LOCK:  # a second thread must not copy the template before the constants are in it
            if self._materialized is None:
                made = [(c["slot"], torch.tensor(c["values"], dtype=getattr(torch, c["dtype"]),
                                                 device=c["device"]).reshape(c["shape"]))
                        for c in self.constants]
                for slot, t in made:
                    self._template[slot] = t
                self._materialized = made  # last: a replay that sees it finds the template filled
        return self._materialized

    def keep_constants(self) -> None:
        """A CUDA graph is being captured over this plan: its constants must outlive the plan."""
        if not self.kept:
            made = self._constants()  # takes _LOCK itself
            with _LOCK:
                _KEPT_CONSTANTS.extend(t for _, t in made)
            self.kept = True

    def __call__(self, inputs: tuple):
        if len(inputs) != self.num_inputs:
            raise ValueError(f"inputs: the plan takes {self.num_inputs} tensors, got {len(inputs)}")
        if self._materialized is None:
            self._constants()
        slots = self._template.copy()
        slots[:self.num_inputs] = inputs
        for step in self.steps:
            step(slots)
        return self.outputs(slots)


_MISSING = object()


def lookup(sig: str, cute_arch: str) -> Optional[_Replay]:
    """The decoded plan of `sig` (from memory, else disk), or None. A plan that does not load (torn,
    edited, its libraries gone, changed or linked in another environment) is deleted with the
    libraries it names that no other plan names, and the signature takes the normal path (which
    may record it again)."""
    known = _PLANS.get(sig, _MISSING)
    if known is not _MISSING:
        if known is not None:  # in use: the memory's oldest entries are dropped first, so it moves last
            with _LOCK:
                if _PLANS.get(sig) is known:
                    _remember(_PLANS, sig, known)
        return known
    path = plan_dir(cute_arch) / f"{sig}.json"
    replay = None
    try:
        on_disk = path.exists()
    except OSError:  # an unreadable cache directory: no plan, never the caller's error
        on_disk = False
    if on_disk:
        plan = None
        try:
            text = path.read_text()
        except (FileNotFoundError, PermissionError):  # pruned by another process since, or another user's: no plan
            text = None
        except OSError:
            text = ""  # unreadable: discarded below, as a torn plan is
        try:
            if text is not None:
                plan = json.loads(text)
                replay = _Replay(plan, path.parent)
        except Exception as exc:
            kernels = plan.get("kernels", []) if isinstance(plan, dict) else []
            libs = [k.get("lib") for k in kernels if isinstance(k, dict)]
            discard(sig, cute_arch, f"{type(exc).__name__}: {str(exc)[:200]}", libs)
            return None
        if replay is not None:
            try:
                os.utime(path)  # used: the directory's pruning keeps the recently used plans
            except OSError:
                pass
    with _LOCK:
        _remember(_PLANS, sig, replay)
    return replay


def discard(sig: str, cute_arch: str, why: str, libs=()):
    """Delete the plan of `sig` and those of `libs` (the libraries it names) that no other plan names:
    plans of calls that launch the same kernel share its library."""
    with _LOCK:
        _STATS["discarded"] += 1
        _remember(_PLANS, sig, None)
    warnings.warn(f"fa4 plans: discarding launch plan {sig[:12]}: {why}", RuntimeWarning, stacklevel=3)
    directory = plan_dir(cute_arch)
    paths = [directory / f"{sig}.json"]
    libs = {lib for lib in libs if _bare_name(lib)}
    if libs:
        in_use = _libs_in_use(directory, f"{sig}.json")
        if in_use is not None:  # None: not known which are in use, so none is deleted
            paths += [directory.parent / lib for lib in sorted(libs - in_use)]
    for path in paths:
        try:
            path.unlink()
        except OSError:
            pass


def _libs_in_use(directory: pathlib.Path, excluding: str) -> Optional[set]:
    """The libraries the plans in `directory` other than `excluding` name, or None when that cannot
    be told: the directory or a plan unreadable, or a plan being written (a temporary file that does
    not parse yet). A torn plan (``.json`` that does not parse) names none: it never loads."""
    names: set = set()
    try:
        paths = [p for p in directory.iterdir() if p.name != excluding]
    except OSError:
        return None
    for path in paths:
        written = path.suffix == ".json"
        if not written and not path.name.endswith(".tmp"):
            continue
        try:
            plan = json.loads(path.read_text())
        except OSError:
            return None
        except ValueError:  # JSON or UTF-8 decoding
            if written:
                continue
            return None
        kernels = plan.get("kernels") if isinstance(plan, dict) else None
        for k in kernels if isinstance(kernels, list) else ():
            if isinstance(k, dict) and isinstance(k.get("lib"), str):
                names.add(k["lib"])
    return names


def _bare_name(name) -> bool:
    return isinstance(name, str) and name == os.path.basename(name) and name not in ("", ".", "..")


def replay(sig: Optional[str], cute_arch: str, inputs: tuple):
    """The call's result by its plan, or None (no plan: take the normal path). A replay that raises
    (out of memory, say) leaves the plan on disk; this process takes the normal path for the
    signature from then on."""
    if sig is None:
        return None
    # a capture may not load a kernel's module or copy constants to the device: only a plan that
    # has run before in this process replays under it (lookup would load it from disk)
    if _capturing():
        plan = _PLANS.get(sig)
        if plan is None or not plan.warm:
            return None
        plan.keep_constants()
    else:
        plan = lookup(sig, cute_arch)
        if plan is None:
            return None
    try:
        result = plan(inputs)
    except Exception as exc:
        with _LOCK:
            _remember(_PLANS, sig, None)
            _remember(_LAST_REFUSAL, sig, f"replay failed: {type(exc).__name__}")  # not recorded again here
        warnings.warn(f"fa4 plans: launch plan {sig[:12]} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                      "this process takes the normal path for it", RuntimeWarning, stacklevel=3)
        return None
    plan.warm = True
    with _LOCK:
        _STATS["replays"] += 1
    return result


def forget() -> None:
    """Drop this process's plan memory (tests; `fa4 cache clear`)."""
    with _LOCK:
        _PLANS.clear()
        _SEEN.clear()
        _LAST_REFUSAL.clear()
        _KERNELS.clear()
        _ENTRIES.clear()
        _WRITES["on_disk"] = None


def refusal(sig: str) -> Optional[str]:
    return _LAST_REFUSAL.get(sig)


__all__ = ["enabled", "forget", "lookup", "max_on_disk", "prune", "recording", "replay", "signature", "stats",
           "Unrecordable"]
