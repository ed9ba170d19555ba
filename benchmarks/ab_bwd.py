"""Paired A/B of backward kernels: interleaved rounds, each timed against the official FA4 in the same round.

    python -m benchmarks.ab_bwd --variants production,step3_rs,step3_rs@64x128:kv_descending \\
        [--dims 64,192x128] [--seqlens 8192,16384] [--causal 0,1] [--rounds 7] [--cudnn] [--window L[,R]] [--softcap C]
        [--varlen] [--out ab.json]

The method of benchmarks.ab_fwd (why: see there), for the backward kernels alone (preprocess + main
+ postprocess from a fixed forward) against the official kernel's autograd backward.

A variant is ``name[@MxN][:order][~keyword=int...][+det]``: a kernel of bench_bwd.STEPS (the lessons and
``production``, the backward fa4 runs) or a module path with ``attention_backward`` (e.g. an untracked
copy at the repository root with its own STEP name), an optional tile override, an optional dQ order of
``stage4_bwd_kernel.schedule`` by its ``name``, optional integer keyword arguments of the kernel's
``attention_backward`` (for a copy that adds one) or, for ``production``, of its ``BackwardOptions``
(``production~persistent=1``: the kernel built with that option, under its own compile key), and
``+det`` for deterministic mode. Every
variant's dq/dk/dv are checked against the first variant's before timing. ``--cudnn`` adds cuDNN
through torch SDPA as a third peer (its autograd backward, like the official one's). ``--varlen``
packs the batch's equal-length sequences into one varlen call (cu_seqlens) for every kernel.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import random
import sys

import torch

from .ab_fwd import add_grid_args, head_dims, paired_rounds, ratio_rows, varlen_call, write_results
from .bench_bwd import PRODUCTION, STEPS
from .bench_fwd import flops


# FlashAttention's convention: a backward does 2.5x the forward's FLOPs (five GEMMs against two; exact
# at d = dv, under the exact 2 (3 d + 2 dv) per pair by 4% at (192, 128) and 6.25% at (128, 64)).
BWD_FLOPS_PER_FWD = 2.5
FLOPS_NOTE = ("tflops_median: 2.5x the forward's FLOPs (FlashAttention's convention; under the exact count by "
              "4% at (192, 128), 6.25% at (128, 64)), the causal half or a window's visible pairs "
              "(benchmarks.bench_fwd.flops)")


def dq_orders() -> dict:
    from stage4_bwd_kernel import schedule

    return {c.name: c for c in vars(schedule).values()
            if inspect.isclass(c) and isinstance(getattr(c, "name", None), str)}


def make_variant(spec: str):
    """spec -> fn(q, k, v, out, dout, lse, causal, **call) -> (dq, dk, dv); call: the call's own keywords
    (e.g. window_size), passed through."""
    rest, det = (spec[:-4], True) if spec.endswith("+det") else (spec, False)
    rest, *option_specs = rest.split("~")
    try:
        options = {k: int(v) for k, v in (o.split("=") for o in option_specs)}
    except ValueError:
        raise SystemExit(f"--variants: keyword arguments in {spec!r} must read ~name=int, e.g. ~dq_buffers=1") from None
    rest, _, order_name = rest.partition(":")
    step, _, tiles = rest.partition("@")
    module = STEPS.get(step, step if "." in step else None)  # a name of STEPS, or a module path (e.g. a copy)
    if module is None:
        raise SystemExit(f"--variants: unknown kernel {step!r} in {spec!r}; expected one of {', '.join(STEPS)} "
                         "or a module path")
    orders = dq_orders()
    if order_name and order_name not in orders:
        raise SystemExit(f"--variants: unknown dQ order {order_name!r} in {spec!r}; "
                         f"expected one of {', '.join(orders)}")
    mod = importlib.import_module(module)
    if tiles:
        options["tiles"] = tuple(int(x) for x in tiles.split("x"))
    if order_name:
        options["dq_order"] = orders[order_name]
    accepted = inspect.signature(mod.attention_backward).parameters
    kernel_options = option_fields(mod)
    # with a kernel option, stage 4's host takes the dQ order and the tile itself
    host_keys = {"dq_order", "tiles"} if any(k in kernel_options for k in options) else set()
    refused = [k for k in options if k not in accepted and k not in kernel_options and k not in host_keys]
    if refused:
        raise SystemExit(f"--variants: {step}'s attention_backward takes no {', '.join(refused)} ({spec!r})")
    built = {k: kernel_options[k](options.pop(k)) for k in list(options) if k in kernel_options and k not in accepted}
    if built:
        return with_kernel_options(mod, built, det, options)
    def run(q, k, v, o, do, lse, c, **call):
        # --varlen: packed (T, H, D) tensors, call holding varlen_call's keywords
        entry = mod.attention_varlen_backward if "cu_seqlens_q" in call else mod.attention_backward
        return entry(q, k, v, o, do, lse, causal=c, deterministic=det, **options, **call)
    return run


def option_fields(mod) -> dict:
    """{field name: its type} of a kernel module's BackwardOptions (the production backward), else {}."""
    import dataclasses

    if not (hasattr(mod, "BackwardOptions") and hasattr(mod, "with_options")):
        return {}
    return {f.name: bool if f.type in (bool, "bool") else int for f in dataclasses.fields(mod.BackwardOptions)}


def with_kernel_options(mod, built: dict, det: bool, options: dict):
    """The production backward built with BackwardOptions fields overridden (``~persistent=1``), through
    stage 4's host under its own compile key; options: attention_backward's other keywords (dQ order)."""
    from stage4_bwd_kernel import host

    key, make = mod.with_options(**built)

    def run(q, k, v, o, do, lse, c, window_size=(None, None), softcap=0.0, **call):
        return host.backward(key, make, q, k, v, o, do, lse, causal=c, deterministic=det,
                             variant=host.variant_of(c, window_size, softcap), **options, **call)
    return run


def parse_window(text, causal: bool):
    """--window LEFT[,RIGHT] -> (left, right), or None without one."""
    if text is None:
        return None
    try:
        edges = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--window: expected LEFT or LEFT,RIGHT (integers), got {text!r}") from None
    if len(edges) not in (1, 2) or min(edges) < 0:
        raise SystemExit(f"--window: expected one or two key counts >= 0, got {text!r}")
    return edges[0], edges[1] if len(edges) == 2 else (0 if causal else edges[0])


def variant_call(window, softcap: float = 0.0) -> dict:
    """The keyword arguments a call takes for a variant: `parse_window`'s result and a softcap (none without them)."""
    call = {} if window is None else {"window_size": window}
    return dict(call, softcap=softcap) if softcap else call


def backward_case(d: int, dv: int, s: int, causal: bool, cudnn: bool = False, window=None, softcap: float = 0.0,
                  varlen: bool = False):
    """One grid point of the benchmarks (bf16, 32k tokens per batch, hidden 2048) -> (batch, heads,
    (q, k, v, out, dout, lse) from our forward, the peers' backwards as no-argument calls: the
    official FA4's, and cuDNN's through SDPA when asked). The peers run through ``autograd.grad``:
    ``.backward`` would also add into ``.grad`` on every call (see benchmarks.bench_bwd). window:
    None or (left, right) for our forward and the official call (cuDNN through SDPA has none); softcap
    likewise. varlen: the b sequences packed as (b s, h, d) tensors; the returned calls' keywords then
    come from ``varlen_call``."""
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    from stage3_fwd_kernel.hopper import attention_forward, attention_varlen_forward

    b, h = 32768 // s, 2048 // d
    shape = (b * s,) if varlen else (b, s)
    q, k = (torch.randn(*shape, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(*shape, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = variant_call(window, softcap)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if varlen:
        packed = varlen_call(b, s)
        out, lse = attention_varlen_forward(q, k, v, **packed, causal=causal, **call)
        o = flash_attn_varlen_func(qg, kg, vg, **packed, causal=causal, **call)
    else:
        out, lse = attention_forward(q, k, v, causal=causal, **call)
        o = flash_attn_func(qg, kg, vg, causal=causal, **call)
    o = o[0] if isinstance(o, tuple) else o
    peers = {"official": lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)}
    if cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qc, kc, vc = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
        peers["cuDNN (SDPA)"] = lambda: torch.autograd.grad(oc, (qc, kc, vc), do.transpose(1, 2), retain_graph=True)
    return b, h, (q, k, v, out, do, lse), peers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", required=True, help="comma-separated step[@MxN][:order][~option=int][+det]")
    add_grid_args(ap, dims="64", dims_help="head dims, d or dxdv (e.g. 64,192x128)", seqlens="8192,16384", rounds=7)
    ap.add_argument("--cudnn", action="store_true", help="also time cuDNN through torch SDPA")
    ap.add_argument("--window", default=None, metavar="LEFT[,RIGHT]",
                    help="a sliding window for every kernel: (LEFT, RIGHT), RIGHT defaulting to 0 when causal, else "
                         "LEFT (the FLOP rate counts the (query, key) pairs the window sees)")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap > 0 for every kernel (0: none)")
    ap.add_argument("--varlen", action="store_true",
                    help="pack the batch's sequences into one varlen call (cu_seqlens) for every kernel")
    args = ap.parse_args(argv)
    if args.window is not None and args.cudnn:
        raise SystemExit("--cudnn: torch SDPA has no sliding window; leave out --cudnn or --window")
    if args.softcap < 0 or (args.softcap and args.cudnn):
        raise SystemExit("--softcap: expected a value >= 0, and no --cudnn with it (torch SDPA has no softcap)")
    if args.varlen and args.cudnn:
        raise SystemExit("--varlen: torch SDPA takes no cu_seqlens; leave out --cudnn or --varlen")
    if not torch.cuda.is_available():
        print("ab_bwd needs a CUDA GPU")
        return 2
    specs = [s for s in args.variants.split(",") if s]
    variants = {s: make_variant(s) for s in specs}
    rng = random.Random(args.seed)
    rows = []
    for d, dv in head_dims(args.dims):
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                window = parse_window(args.window, causal)
                b, h, inputs, peers = backward_case(d, dv, s, causal, args.cudnn, window, args.softcap, args.varlen)
                call = dict(variant_call(window, args.softcap), **(varlen_call(b, s) if args.varlen else {}))
                fns = dict(peers)
                ref = None
                for n in specs:
                    fns[n] = lambda n=n: variants[n](*inputs, causal, **call)
                    got = [g.float() for g in fns[n]()]
                    if ref is None:
                        ref = got
                    err = max((a - r).abs().max().item() for a, r in zip(got, ref))
                    if not err < 0.05:
                        raise SystemExit(f"{n}: max |grad - {specs[0]}'s| = {err} at d={d} s={s} causal={causal}")
                times = paired_rounds(fns, args.rounds, rng)
                rows += ratio_rows(times, BWD_FLOPS_PER_FWD * flops(b, h, s, d, dv, causal, window),
                                   {"head_dim": d, "head_dim_v": dv, "causal": causal, "seqlen": s, "window": window,
                                    "softcap": args.softcap, "varlen": args.varlen},
                                   f"d={d}x{dv} causal={causal!s:5} s={s:5}")
                del inputs, peers, fns
    if args.out:
        write_results(args.out, "benchmarks.ab_bwd", rows, args.rounds, production_variant=PRODUCTION,
                      flops=FLOPS_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
