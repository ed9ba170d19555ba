"""`python -m fa4 firstcall`: where a fresh process's first fa4 call spends its time.

Each measurement runs in a fresh Python process (what a training job or a test run pays), whose
steps are timed in the order a real first call takes them:

    import torch         the interpreter already started (its start and exit are the 'process' row)
    import fa4           lazy: the package itself imports nothing heavy
    cuda init + inputs   (GPU) the CUDA context, the inputs on the device
    import cutlass       the CuTe-DSL, after the arch is chosen (fa4._dispatch)
    import kernels       the dispatch's kernel module (stage3_fwd_kernel.hopper, ...), disk cache installed
    cache fingerprint    hashing the kernel sources etc. (fa4._cache.build_id): paid once per process
    first forward        (GPU) fa4.flash_attn_func + synchronize; (CPU) the launch's build through
                         compile_launchable, the same cache key and trace. Split into:
        cache lookup     finding and verifying the disk entry (fa4._cache.DiskCache.read_verified)
        load from disk   JIT-linking the object into a callable (cute.runtime.load_module)
        compile          tracing, MLIR, PTX, ptxas (cute.compile) -- 0 on a cache hit
        compile report   nvdisasm of the fresh cubin (SASS counts): only when something asks for the
                         SASS or the report (precompile's summary does, a launch does not)
        store to disk    export_to_c + atomic write
        rest             the call's own work: validation, launch, the cubin's module load, sync
    second forward       (GPU) the steady state, for scale
    first backward       (GPU, --backward) split the same way

Runs: cold (an empty FA4_CACHE_DIR), warm (a fresh process after `python -m fa4 precompile --shapes
...` filled another empty directory with exactly this call's kernels) and, on a GPU, plans (a fresh
process on the cold run's directory, where the cold run's second forward and backward recorded
launch plans, fa4/_plans.py: the calls replay without importing CuTe-DSL, so the "import cutlass"
and "import kernels" rows are absent) and precompiled (the same, on a directory that only
`precompile --shapes ... --plans BATCH` filled: kernels and plans without the model having run). The table shows all; --json writes every
number. "first calls above torch" is the goal's measure: the steps from `import fa4` to the finished
first forward (and backward), without the second calls and without the measuring child's own
bookkeeping ("in process" has both).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

# the child's first lines: nothing imported yet, so `import torch` is timed from a clean start
_BOOT = """\
import time
_t0 = time.perf_counter()
import sys, json, importlib.util
import torch
_t1 = time.perf_counter()
_spec = importlib.util.spec_from_file_location("_fa4_firstcall_child", sys.argv[2])
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.child(json.loads(sys.argv[1]), [("import torch", _t1 - _t0)], _t0)
"""

# the instrumented functions: (row, module, attribute path)
_PROBES = (("cache lookup", "fa4._cache", "DiskCache.read_verified"),
           ("load from disk", "fa4._cache", "load_object"),
           ("compile", "cutlass.cute", "compile"),
           ("compile report", "stage3_fwd_kernel.compile_cache", "disassemble"),
           ("store to disk", "fa4._cache", "DiskCache.export"))
# with launch plans nothing of the kernel modules is imported: only the plan's own load is probed
_PLAN_PROBES = (("plan + kernel load", "fa4._plans", "lookup"),)


class _Probes:
    """Time spent in the probed functions, per phase (first forward, backward, ...)."""

    def __init__(self, probes=_PROBES):
        self.phase = None
        self.acc: dict = {}
        self.probes = probes

    def install(self):
        import importlib

        for row, module, path in self.probes:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            setattr(owner, name, self._wrap(row, getattr(owner, name)))

    def _wrap(self, row, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.phase is not None:
                    slot = self.acc.setdefault(self.phase, {}).setdefault(row, [0.0, 0])
                    slot[0] += time.perf_counter() - t0
                    slot[1] += 1
        return timed

    def split(self, phase: str, total: float) -> list:
        """(row, seconds, calls) of a phase, the unprobed rest last."""
        rows = [(f"  {row}", *self.acc.get(phase, {}).get(row, (0.0, 0))) for row, *_ in self.probes]
        return rows + [("  rest", max(total - sum(r[1] for r in rows), 0.0), 1)]  # the probes never nest


def _timed(steps: list, name: str, fn):
    t0 = time.perf_counter()
    value = fn()
    steps.append((name, time.perf_counter() - t0))
    return value


def _inputs(cfg: dict, device):
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dtype"]]
    b, s, hq, hkv, d, dv = cfg["batch"], cfg["seqlen"], cfg["heads_q"], cfg["heads_kv"], cfg["head_dim"], cfg["head_dim_v"]
    grad = cfg["backward"]
    return (torch.randn(b, s, hq, d, device=device, dtype=dt, requires_grad=grad),
            torch.randn(b, s, hkv, d, device=device, dtype=dt, requires_grad=grad),
            torch.randn(b, s, hkv, dv, device=device, dtype=dt, requires_grad=grad))


def _first_calls(cfg: dict, steps: list, probes: _Probes, backend, gpu: bool, qkv):
    """The first forward (and backward): on a GPU the real call; without one the launch's build."""
    import fa4
    from fa4 import _dispatch

    d, dv, causal = cfg["head_dim"], cfg["head_dim_v"], cfg["causal"]

    def phase(name, fn):
        probes.phase = name
        t0 = time.perf_counter()
        value = fn()
        total = time.perf_counter() - t0
        probes.phase = None
        steps.append((name, total))
        steps.extend((row, secs) for row, secs, _ in probes.split(name, total))
        return value

    if gpu:
        import torch

        q, k, v = qkv

        def forward():
            out = fa4.flash_attn_func(q, k, v, causal=causal)
            torch.cuda.synchronize()
            return out

        out = phase("first forward", forward)
        out2 = _timed(steps, "second forward", forward)
        if cfg["backward"]:
            phase("first backward", lambda: (out.float().sum().backward(), torch.cuda.synchronize()))
            # a second call of each signature records its launch plan (for the "plans" run)
            _timed(steps, "second backward", lambda: (out2.float().sum().backward(), torch.cuda.synchronize()))
        return
    sched = _dispatch.causal_forward_scheduler(backend.arch.key, causal, cfg["seqlen"], d, dv, cfg["heads_q"],
                                               cfg["heads_kv"])
    fwd = backend.forward_module()
    phase("first forward", lambda: fwd.compile_only(cfg["dtype"], d, dv, causal, launchable=True, scheduler=sched,
                                                    seqlen_k=cfg["seqlen"]))
    if cfg["backward"]:
        bwd = backend.backward_module()
        # what a call of this length and GQA group launches (the Hopper backward's main kernel depends on it)
        phase("first backward", lambda: bwd.compile_launchable(cfg["dtype"], d, dv, causal, seqlen_k=cfg["seqlen"],
                                                               group=cfg["heads_q"] // cfg["heads_kv"]))


def child(cfg: dict, steps: list, t_start: float):
    """The measured process (run by `_BOOT`): prints one JSON line. cfg["plans"]: the calls are
    expected to replay launch plans, so nothing imports the DSL or the kernel modules up front."""
    planned = cfg.get("plans", False)
    probes = _Probes(_PLAN_PROBES if planned else _PROBES)
    import torch

    def import_fa4():
        import fa4

        return fa4.flash_attn_func  # the lazy attribute imports the API modules
    _timed(steps, "import fa4", import_fa4)
    from fa4 import _cache, _dispatch

    gpu = torch.cuda.is_available()
    qkv, backend = None, None
    if gpu:
        def cuda():
            inputs = _inputs(cfg, torch.device("cuda"))
            torch.cuda.synchronize()
            return inputs
        qkv = _timed(steps, "cuda init + inputs", cuda)
        backend = _dispatch.backend_for(qkv[0].device)
    else:
        backend = _dispatch.make_backend(_dispatch.ARCHS["sm_90"])

    def cutlass():
        _dispatch._ensure_cute_arch(backend.arch)
        import cutlass.cute  # noqa: F401

    def kernels():
        backend.forward_module()
        if cfg["backward"]:
            backend.backward_module()
    if not planned:
        _timed(steps, "import cutlass", cutlass)
        _timed(steps, "import kernels", kernels)
    probes.install()
    _timed(steps, "cache fingerprint", _cache.cache_dir)
    _first_calls(cfg, steps, probes, backend, gpu, qkv)
    from fa4 import _plans

    stats = dict(_cache.stats(), plan_replays=_plans.stats()["replays"],
                 cutlass_imported=any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules))
    device = torch.cuda.get_device_name() if gpu else "no GPU (the first call's build via compile_launchable)"
    print("FA4_FIRSTCALL " + json.dumps({"steps": steps, "in_process_s": time.perf_counter() - t_start,
                                         "stats": stats, "device": device, "gpu": gpu,
                                         "probe_calls": {p: {r: n for r, (_, n) in rows.items()}
                                                         for p, rows in probes.acc.items()}}), flush=True)


class MeasureFailed(RuntimeError):
    """A measured or precompiling child process failed; the message holds its output's tail."""


def run_child(cfg: dict, cache_dir: pathlib.Path, timeout: int = 900) -> dict:
    """One fresh process with FA4_CACHE_DIR=cache_dir; its measurements plus its wall time."""
    env = dict(os.environ, FA4_CACHE_DIR=str(cache_dir))
    env.pop("FA4_CACHE", None)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _BOOT, json.dumps(cfg), __file__], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    wall = time.perf_counter() - t0
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("FA4_FIRSTCALL ")), None)
    if res.returncode != 0 or line is None:
        raise MeasureFailed(f"the measured process failed (exit {res.returncode}):\n{res.stdout[-2000:]}"
                           f"\n{res.stderr[-4000:]}")
    data = json.loads(line.split(" ", 1)[1])
    data["process_s"] = wall
    return data


def shape_spec(cfg: dict) -> str:
    """This call as a `precompile --shapes` item."""
    d = f"{cfg['head_dim']}" + (f"/{cfg['head_dim_v']}" if cfg["head_dim_v"] != cfg["head_dim"] else "")
    return (f"d={d},heads={cfg['heads_q']}/{cfg['heads_kv']},{'causal' if cfg['causal'] else 'noncausal'},"
            f"seqlen={cfg['seqlen']},dtype={cfg['dtype']}")


def precompile(cfg: dict, cache_dir: pathlib.Path, timeout: int = 1800, plans: bool = False) -> float:
    """`python -m fa4 precompile --shapes` for exactly this call, in its own process; its wall time.
    plans: also `--plans BATCH` (a GPU): the call's launch plans are recorded too."""
    cmd = [sys.executable, "-m", "fa4", "precompile", "--shapes", shape_spec(cfg)]
    if plans:
        cmd += ["--plans", str(cfg["batch"])]
    if not cfg["backward"]:
        cmd.append("--no-backward")
    env = dict(os.environ, FA4_CACHE_DIR=str(cache_dir))
    env.pop("FA4_CACHE", None)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    if res.returncode != 0:
        raise MeasureFailed(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n"
                            f"{res.stderr[-2000:]}")
    return time.perf_counter() - t0


def table(runs: dict) -> str:
    """Rows: the steps in order; columns: the runs (seconds)."""
    names = list(runs)
    order: list = []
    for r in runs.values():
        for step, _ in r["steps"]:
            if step not in order:
                order.append(step)
    w = 26
    lines = [f"{'step':<{w}}" + "".join(f"{n:>10}" for n in names)]
    for step in order:
        vals = [dict(r["steps"]).get(step) for r in runs.values()]
        lines.append(f"{step:<{w}}" + "".join(f"{v:>10.3f}" if v is not None else f"{'-':>10}" for v in vals))
    for label, fn in (("in process", lambda r: r["in_process_s"]),
                      ("first calls above torch", first_calls_s),
                      ("process (with start/exit)", lambda r: r["process_s"])):
        lines.append(f"{label:<{w}}" + "".join(f"{fn(r):>10.3f}" for r in runs.values()))
    lines.append(f"{'compiles / disk hits':<{w}}" + "".join(
        f"{str(r['stats']['misses']) + ' / ' + str(r['stats']['disk_hits']):>10}" for r in runs.values()))
    return "\n".join(lines)


# the steps a process spends after `import torch` until its first forward (and backward) finished;
# the second calls (which record launch plans) and the measuring child's own bookkeeping are not in it
_FIRST_CALL_STEPS = ("import fa4", "cuda init + inputs", "import cutlass", "import kernels", "cache fingerprint",
                     "first forward", "first backward")


def first_calls_s(run: dict) -> float:
    """Seconds from the end of `import torch` to the finished first calls of a run (the issue's
    "above import torch"): the sum of _FIRST_CALL_STEPS that the run has."""
    steps = dict(run["steps"])
    return sum(steps.get(name, 0.0) for name in _FIRST_CALL_STEPS)


def bytecode_hint(package: str = "cutlass") -> Optional[str]:
    """A sentence when `package`'s modules have no byte-compiled files for this interpreter (None when
    they have, or when it is not installed). Python then compiles every module again in every
    process: on an H200 that was 2.6 s of a 4.6 s warm first call for CuTe-DSL (docs/measurements.md,
    2026-11-29), and a read-only install cannot keep the result."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    tag = sys.implementation.cache_tag
    if (root / "__pycache__" / f"__init__.{tag}.pyc").exists():
        return None
    return (f"{package}'s modules in {root} are not byte-compiled for {tag}: every process compiles them "
            f"again (seconds per first call); run `{pathlib.Path(sys.executable).name} -m compileall -q {root}` "
            "once (it needs write access there)")


def _check_args(args):
    """The options' values, before the cold process runs (minutes): an error naming the option."""
    from ._dispatch import all_head_dims

    for name, value, low in (("--repeat", args.repeat, 1), ("--batch", args.batch, 1), ("--seqlen", args.seqlen, 1)):
        if value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value}")
    dims = (args.head_dim, args.head_dim_v or args.head_dim)
    if dims not in all_head_dims():
        raise ValueError(f"--head-dim / --head-dim-v: {dims} has no kernel of its own; native pairs: "
                         f"{sorted(all_head_dims())}")
    if args.json:  # written after the runs: a path that cannot take it fails now, not minutes later
        check_output_path("--json", args.json)


def check_output_path(flag: str, where: str):
    """ValueError naming `flag` when a file cannot be written at `where` (its folder missing, not a folder
    or not writable, or the path a folder): for outputs written only after minutes of work."""
    path = pathlib.Path(where)
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: {parent} " + ("is not a directory" if parent.exists() else "does not exist"))
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: {parent} is not writable")


def main(args) -> int:
    try:
        _check_args(args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    dv = args.head_dim_v or args.head_dim
    hq, hkv = args.heads
    cfg = dict(dtype=args.dtype, head_dim=args.head_dim, head_dim_v=dv, causal=args.causal, batch=args.batch,
               seqlen=args.seqlen, heads_q=hq, heads_kv=hkv, backward=args.backward)
    root = pathlib.Path(tempfile.mkdtemp(prefix="fa4_firstcall_"))
    try:
        runs: dict = {}
        print(f"first call of {shape_spec(cfg)}{' + backward' if args.backward else ''}, fresh processes; "
              f"caches under {root}", flush=True)
        runs["cold"] = run_child(cfg, root / "cold")
        print(f"cold: {runs['cold']['in_process_s']:.2f} s in process ({runs['cold']['device']})", flush=True)
        pre = precompile(cfg, root / "warm")
        print(f"precompile --shapes {shape_spec(cfg)}: {pre:.2f} s", flush=True)
        for i in range(args.repeat):
            runs["warm" if i == 0 else f"warm{i + 1}"] = run_child(cfg, root / "warm")
        if runs["cold"]["gpu"]:
            runs["plans"] = run_child(dict(cfg, plans=True), root / "cold")
            # kernels and plans from `precompile --plans` alone, the model never having run
            pre_plans = precompile(cfg, root / "precompiled", plans=True)
            print(f"precompile --shapes {shape_spec(cfg)} --plans {cfg['batch']}: {pre_plans:.2f} s", flush=True)
            runs["precompiled"] = run_child(dict(cfg, plans=True), root / "precompiled")
        print(table(runs))
        warm = runs["warm"]
        print(f"cold: {first_calls_s(runs['cold']):.2f} s from `import fa4` to the finished first calls")
        above = first_calls_s(warm)
        print(f"warm: {above:.2f} s above `import torch` (goal <= 0.5 s); "
              f"{warm['stats']['misses']} compile(s), {warm['stats']['disk_hits']} disk hit(s)")
        for name in ("plans", "precompiled"):
            if name in runs:
                p = runs[name]
                print(f"{name}: {first_calls_s(p):.2f} s above `import torch` (goal <= 0.5 s); "
                      f"{p['stats']['plan_replays']} replayed call(s), CuTe-DSL "
                      f"{'imported' if p['stats']['cutlass_imported'] else 'not imported'}")
        hint = bytecode_hint()
        if hint:
            print("note: " + hint)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({"config": cfg, "precompile_s": pre, "runs": runs},
                                                          indent=1))
            print(f"wrote {args.json}")
        return 0 if warm["stats"]["misses"] == 0 else 1
    except (MeasureFailed, subprocess.TimeoutExpired) as exc:  # said in a line or two, not as a traceback
        print(f"firstcall: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _one_heads_pair(parse_heads):
    """--heads' type: one HQ[/HKV] pair (the measured call has one shape), not a list."""
    import argparse

    def parse(text):
        pairs = parse_heads(text)
        if len(pairs) != 1:
            raise argparse.ArgumentTypeError(f"expected one HQ[/HKV] pair (the call measured has one shape), got "
                                             f"{text!r}")
        return pairs[0]
    return parse


def add_arguments(p):
    from .precompile import parse_heads

    p.add_argument("--head-dim", type=int, default=96)
    p.add_argument("--head-dim-v", type=int, default=None, help="V's head dim (default --head-dim)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=1024, help="query and key length")
    p.add_argument("--heads", type=_one_heads_pair(parse_heads), default=(16, 16), metavar="HQ[/HKV]")
    p.add_argument("--backward", action="store_true", help="also the first backward")
    p.add_argument("--repeat", type=int, default=1, help="warm processes to run (default 1)")
    p.add_argument("--json", default="fa4_firstcall.json", help="where to write the numbers ('' = nowhere)")
    p.add_argument("--keep", action="store_true", help="keep the temporary cache directories")


def run(argv: Optional[list] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fa4 firstcall", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(run())
