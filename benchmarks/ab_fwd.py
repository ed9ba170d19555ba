"""Paired A/B of forward kernels: interleaved rounds, each timed against the official FA4 in the same round.

    python -m benchmarks.ab_fwd --impls fa4,stage3_fwd_kernel.hopper,my_copy \\
        [--dims 64,128,192x128] [--seqlens 4096,16384] [--causal 0,1] [--rounds 9] [--varlen] [--out ab.json]

Why not bench_fwd: it times each implementation once, one after the other, and the same kernel
moves by 5-10% between two such passes (clock and temperature drift, and an effect of the
position in the sequence). Here every round times every implementation once, in a fresh random
order, for ~40 ms each, and divides by the official kernel's time *of the same round*; the table
reports the median of those per-round ratios and their spread (min-max), so a difference is real
only when it is wider than the spread. `benchmarks.ab_pair` then compares two builds round by round.

An implementation is `official`, `fa4` (the package's `flash_attn_func`: what a model gets, LPT tile
order included), or a module path with `attention_forward(q, k, v, causal=...)` returning (out, lse):
the production kernel `stage3_fwd_kernel.hopper`, any lesson, or an untracked copy at the repository
root with its own STEP name (its own compile-cache key). A module may be followed by keyword
arguments of its `attention_forward`: `stage3_fwd_kernel.hopper~emulation_fraction=0.125` (numbers or
words, True / False as bools; each distinct set is its own compiled kernel). `fa4` takes route
switches (FA4_SWITCHES: `fa4~persistent=False`, `fa4~lpt_min=0`,
`fa4~lpt_flat=False`, `fa4~lpt_safety=1.0`), each setting one attribute of `fa4._dispatch` for the call
only. Each implementation's output is checked against the official one before timing (`--no-check`
skips it, for a build that computes something else on purpose). `--varlen` packs the batch's
equal-length sequences into one call with cu_seqlens: `flash_attn_varlen_func` for `official` and `fa4`,
`attention_varlen_forward` for a module.
"""
from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time

import torch

from .bench_fwd import flops, write_doc


# fa4's route switches: ab_fwd's keyword -> the fa4._dispatch attribute it sets for the call
FA4_SWITCHES = {"persistent": "FORWARD_PERSISTENT", "lpt_min": "LPT_MIN_SEQLEN_K",
                "lpt_flat": "FORWARD_LPT_FLAT",
                "lpt_safety": "FORWARD_LPT_L2_SAFETY"}
SCHEDULER_SWITCHES = ("LPT_MIN_SEQLEN_K", "FORWARD_LPT_FLAT", "FORWARD_LPT_L2_SAFETY")  # read by the cached causal_forward_scheduler


def parse_impl(spec: str) -> tuple[str, dict]:
    """'module~name=value~...' -> (module, {name: int, float or str}); a clear SystemExit otherwise."""
    module, *kw_specs = spec.split("~")
    kwargs = {}
    for kw in kw_specs:
        name, eq, value = kw.partition("=")
        if not (eq and name.isidentifier()):
            raise SystemExit(f"--impls: {spec!r}: keyword arguments must read ~name=value, got {kw!r}")
        try:
            kwargs[name] = int(value)
        except ValueError:
            try:
                kwargs[name] = float(value)
            except ValueError:
                if not value.isidentifier():
                    raise SystemExit(f"--impls: {spec!r}: {name}={value!r} is neither a number nor a word") from None
                kwargs[name] = {"True": True, "False": False}.get(value, value)
    if module == "official" and kwargs or module == "fa4" and set(kwargs) - set(FA4_SWITCHES):
        raise SystemExit(f"--impls: {module} takes no keyword arguments here but fa4's route switches "
                         f"{', '.join(f'~{k}=...' for k in FA4_SWITCHES)} ({spec!r})")
    return module, kwargs


def make_impl(spec: str):
    module, kwargs = parse_impl(spec)
    if module == "official":
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

        def official(q, k, v, c, varlen=None):
            out = flash_attn_func(q, k, v, causal=c) if varlen is None else \
                flash_attn_varlen_func(q, k, v, **varlen, causal=c)
            return out[0] if isinstance(out, tuple) else out
        return official
    if module == "fa4":
        import fa4  # the production route: its tile order (LPT for long causal calls) and launch path
        from fa4 import _dispatch

        missing = [FA4_SWITCHES[k] for k in kwargs if not hasattr(_dispatch, FA4_SWITCHES[k])]
        if missing:
            raise SystemExit(f"--impls: {spec!r}: fa4._dispatch has no {', '.join(missing)}")

        def route(q, k, v, c, varlen=None):  # the route's switches (FA4_SWITCHES), for this call only
            saved = {FA4_SWITCHES[name]: getattr(_dispatch, FA4_SWITCHES[name]) for name in kwargs}
            for name, value in kwargs.items():
                setattr(_dispatch, FA4_SWITCHES[name], value)
            lpt_changed = any(getattr(_dispatch, a) != saved[a] for a in SCHEDULER_SWITCHES if a in saved)
            if lpt_changed:
                _dispatch.causal_forward_scheduler.cache_clear()
            try:
                if varlen is not None:
                    return fa4.flash_attn_varlen_func(q, k, v, **varlen, causal=c)
                return fa4.flash_attn_func(q, k, v, causal=c)
            finally:
                for attr, value in saved.items():
                    setattr(_dispatch, attr, value)
                if lpt_changed:
                    _dispatch.causal_forward_scheduler.cache_clear()
        return route
    mod = importlib.import_module(module)

    def kernel(q, k, v, c, varlen=None):
        if varlen is None:
            return mod.attention_forward(q, k, v, causal=c, **kwargs)[0]
        return mod.attention_varlen_forward(q, k, v, **varlen, causal=c, **kwargs)[0]
    return kernel


def varlen_call(batch: int, seqlen: int) -> dict:
    """The varlen keywords (cu_seqlens_q / _k, max_seqlen_q / _k) of ``batch`` packed sequences of
    ``seqlen`` tokens each, as the official and fa4 varlen functions and stage 3 / 4's varlen entry points
    take them."""
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen)


def time_ms(fn, target_ms: float = 40.0) -> float:
    """Mean time of back-to-back calls between two events, enough calls for ~target_ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); fn(); end.record(); torch.cuda.synchronize()
    calls = max(3, int(target_ms / max(start.elapsed_time(end), 1e-3)))
    start.record()
    for _ in range(calls):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def paired_rounds(fns: dict, rounds: int, rng: random.Random, warmup: int = 1, spans: list | None = None) -> dict:
    """name -> per-round times (ms): every round times every fn once, in a fresh random order, after
    `warmup` rounds that are timed the same way and dropped (a first round ran up to 3x slower while
    clocks and caches settled, which the min / max spread of the rounds then carried). spans: a list
    that gets (name, round, start, end) in `time.time()` seconds per timed measure (for
    benchmarks.sm_clock)."""
    for _ in range(warmup):
        for fn in fns.values():
            time_ms(fn)
    times = {n: [] for n in fns}
    for r in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        for n in order:
            start = time.time()
            times[n].append(time_ms(fns[n]))
            if spans is not None:
                spans.append((n, r, start, time.time()))
    return times


def ratio_rows(times: dict, flop: float, config: dict, label: str) -> list[dict]:
    """One result row per implementation (medians, and the per-round ratio to "official"), printed."""
    rows = []
    for n, ts in times.items():
        ratios = [t_off / t for t_off, t in zip(times["official"], ts)]
        row = {"impl": n, **config, "ms_median": statistics.median(ts), "tflops_median": flop / statistics.median(ts) / 1e9,
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "ms_rounds": ts}
        rows.append(row)
        print(f"{label} {n[-40:]:40} {row['tflops_median']:6.1f} TFLOP/s  "
              f"x{row['ratio_median']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]", flush=True)
    return rows


def write_results(path: str, module: str, rows: list, rounds: int, **fields):
    """The run's JSON (module: the benchmark that wrote it, e.g. "benchmarks.ab_fwd")."""
    write_doc(path, module, None, rows, **fields,
              method=f"{rounds} interleaved rounds after a dropped warm-up round, random order, ~40 ms of "
                     "back-to-back calls each; ratio = official time / this time, same round")


def head_dims(text: str) -> list:
    """--dims "64,192x128" -> [(64, 64), (192, 128)]: d, or d x dv."""
    return [(int(x.split("x")[0]), int(x.split("x")[-1])) for x in text.split(",")]


def add_grid_args(ap, *, dims: str, dims_help: str, seqlens: str, rounds: int):
    """The problem grid and the rounds, shared by ab_fwd and ab_bwd."""
    ap.add_argument("--dims", default=dims, help=dims_help)
    ap.add_argument("--seqlens", default=seqlens)
    ap.add_argument("--causal", default="0,1", help="which of non-causal (0) / causal (1) to run")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", required=True, help="comma-separated module paths (official is always added)")
    add_grid_args(ap, dims="128", dims_help="head dims, d or dxdv (e.g. 128,192x128)", seqlens="4096,16384", rounds=9)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the output check: for a build that computes something else on purpose (timing only)")
    ap.add_argument("--gqa", type=int, default=1,
                    help="query heads per KV head (2048 / d query heads)")
    ap.add_argument("--varlen", action="store_true",
                    help="pack the batch's sequences into one varlen call (cu_seqlens) for every implementation")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_fwd needs a CUDA GPU")
        return 2
    names = ["official"] + [s for s in args.impls.split(",") if s and s != "official"]
    impls = {n: make_impl(n) for n in names}
    rng = random.Random(args.seed)
    rows = []
    for d, dv in head_dims(args.dims):
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b, h = 32768 // s, 2048 // d
                if h % args.gqa:
                    raise SystemExit(f"--gqa: {args.gqa} does not divide the {h} query heads at d={d}")
                shape = (b * s,) if args.varlen else (b, s)
                q = torch.randn(*shape, h, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(*shape, h // args.gqa, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(*shape, h // args.gqa, dv, device="cuda", dtype=torch.bfloat16)
                packed = varlen_call(b, s) if args.varlen else None
                ref = impls["official"](q, k, v, causal, packed).float()
                checked = {} if args.no_check else impls
                for n, fn in checked.items():
                    err = (fn(q, k, v, causal, packed).float() - ref).abs().max().item()
                    if not err < 0.05:
                        raise SystemExit(f"{n}: max |out - official| = {err} at d={d} s={s} causal={causal}")
                times = paired_rounds({n: (lambda n=n: impls[n](q, k, v, causal, packed)) for n in names},
                                      args.rounds, rng)
                rows += ratio_rows(times, flops(b, h, s, d, dv, causal),
                                   {"head_dim": d, "head_dim_v": dv, "causal": causal, "seqlen": s,
                                    **({"gqa": args.gqa} if args.gqa > 1 else {}),
                                    **({"varlen": True} if args.varlen else {})},
                                   f"d={d}/{dv} causal={causal!s:5} s={s:5}")
                del q, k, v, ref
    if args.out:
        write_results(args.out, "benchmarks.ab_fwd", rows, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
