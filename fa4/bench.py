"""`python -m fa4 bench`: time fa4 against torch SDPA (and the official FlashAttention-4 when it is
installed) on this GPU, forward and backward, in paired rounds.

Everything it needs ships with the package, so it runs from an installed wheel:

    python -m fa4 bench                              # d = 64, 128; 4k and 8k tokens; causal and not
    python -m fa4 bench --head-dims 128 --seqlens 8192 --causal yes --rounds 9 --json out.json

Problem grid: bf16, 32k tokens per batch (batch = 32768 / seqlen), hidden 2048 (heads = 2048 /
head_dim). FLOPs: forward 4 * b * h * s^2 * d, halved when causal; backward 2.5x the forward.
Each round times every implementation once, back to back, in the same order (CUDA events over
`--iters` calls); the table reports each one's median over the rounds and the median of the
per-round ratios to fa4, which cancels the GPU clock drifting between rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

TOKENS = 32768
HIDDEN = 2048


def _parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected a comma list of integers, got {text!r}") from None
    if not values or any(x < 1 for x in values):
        raise argparse.ArgumentTypeError(f"{name}: expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fa4 bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--head-dims", default="64,128", type=lambda t: _parse_ints(t, "--head-dims"),
                   help="comma list of head dims (qk = v), default 64,128")
    p.add_argument("--seqlens", default="4096,8192", type=lambda t: _parse_ints(t, "--seqlens"),
                   help="comma list of sequence lengths (each divides 32768), default 4096,8192")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--direction", default="both", choices=["both", "fwd", "bwd"])
    p.add_argument("--rounds", type=int, default=5, help="paired rounds per point (default 5)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per implementation and round (default 10)")
    p.add_argument("--no-official", action="store_true", help="leave the official FlashAttention-4 out")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every round's times as JSON")
    return p


def attention_tflop(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, direction: str) -> float:
    """The stages' FLOP counts (imported here: fa4 has picked the CuTe-DSL arch by then)."""
    from stage3_fwd_kernel.runner import attention_flops
    from stage4_bwd_kernel.common import backward_flops

    count = backward_flops if direction == "bwd" else attention_flops
    return count(batch, seqlen, seqlen, heads, head_dim, head_dim, causal) / 1e12


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call of fn, from CUDA events around `iters` back-to-back calls."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _official_func() -> Optional[Callable]:
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        return None
    # its first forward and backward calls warn that CuTe-DSL cannot adapt one argument (aux_data):
    # the peer's own noise, which would bury the table
    warnings.filterwarnings("ignore", message=r"Argument aux_data", category=UserWarning)

    def official(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return official


def implementations(direction: str, causal: bool, q, k, v, dout, official) -> dict:
    """name -> a no-argument call of one pass (the backward ones reuse one forward graph)."""
    import torch
    import torch.nn.functional as F

    import fa4

    def sdpa(q_, k_, v_, c):
        return F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                                              is_causal=c).transpose(1, 2)

    impls = {"fa4": lambda q_, k_, v_, c: fa4.flash_attn_func(q_, k_, v_, causal=c), "sdpa": sdpa}
    if official is not None:
        impls["official"] = official
    if direction == "fwd":
        return {name: (lambda f=f: f(q, k, v, causal)) for name, f in impls.items()}
    calls = {}
    for name, f in impls.items():
        leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        out = f(*leaves, causal)
        calls[name] = (lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return calls


def run_point(direction: str, head_dim: int, seqlen: int, causal: bool, rounds: int, iters: int, official) -> dict:
    import torch

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    calls = implementations(direction, causal, q, k, v, dout, official)
    for fn in calls.values():  # compile / autotune outside the timed rounds
        fn()
    torch.cuda.synchronize()
    ms = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            ms[name].append(time_ms(fn, iters))
    tflop = attention_tflop(batch, heads, seqlen, head_dim, causal, direction)
    return {"direction": direction, "head_dim": head_dim, "seqlen": seqlen, "causal": causal, "batch": batch,
            "heads": heads, "ms_rounds": ms,
            "tflops": {name: tflop / (statistics.median(t) * 1e-3) for name, t in ms.items()},
            "ratio_to_fa4": {name: statistics.median(a / b for a, b in zip(t, ms["fa4"])) for name, t in ms.items()}}


def _line(point: dict) -> str:
    label = f"{point['direction']} d={point['head_dim']} s={point['seqlen']}" + (" causal" if point["causal"] else "")
    parts = [f"{name} {tf:6.1f}" + ("" if name == "fa4" else f" ({point['ratio_to_fa4'][name]:.2f}x fa4 time)")
             for name, tf in point["tflops"].items()]
    return f"{label:<26} TFLOP/s: " + ", ".join(parts)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        print("bench: --rounds and --iters must be >= 1", file=sys.stderr)
        return 2
    bad = [s for s in args.seqlens if TOKENS % s]
    if bad:
        print(f"bench: --seqlens must divide {TOKENS}, got {bad}", file=sys.stderr)
        return 2
    if args.json:  # written after every point: a path that cannot take it fails now, not after minutes
        from .firstcall import check_output_path

        try:
            check_output_path("--json", args.json)
        except ValueError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (fa4 runs on sm_90 / sm_100); `python -m fa4 info` shows what is here",
              file=sys.stderr)
        return 2
    from ._dispatch import backend_for

    backend_for(torch.device("cuda")).forward_module()  # fa4 picks the arch before anything imports cutlass
    official = None if args.no_official else _official_func()
    directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    points = [(dr, d, s, c) for dr in directions for d in args.head_dims for s in args.seqlens for c in causals]
    print(f"fa4 bench on {torch.cuda.get_device_name()}: bf16, {TOKENS} tokens per batch, hidden {HIDDEN}; "
          f"{args.rounds} paired rounds x {args.iters} calls; peers: sdpa"
          + (", official" if official else " (official FlashAttention-4 not installed)"), flush=True)
    results = []
    t0 = time.perf_counter()
    for i, (dr, d, s, c) in enumerate(points, 1):
        try:
            point = run_point(dr, d, s, c, args.rounds, args.iters, official)
        except Exception as exc:  # report and go on: one unsupported point must not lose the table
            point = {"direction": dr, "head_dim": d, "seqlen": s, "causal": c,
                     "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"[{i}/{len(points)}] {dr} d={d} s={s} causal={c}: FAILED {point['error'][:120]}", flush=True)
        else:
            print(f"[{i}/{len(points)}] {_line(point)}", flush=True)
        results.append(point)
    print(f"done: {len(points)} points in {time.perf_counter() - t0:.1f} s")
    if args.json:
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS,
               "hidden": HIDDEN, "rounds": args.rounds, "iters": args.iters, "points": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if any("error" in p for p in results) else 0
