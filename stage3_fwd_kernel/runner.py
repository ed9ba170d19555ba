"""The body of every kernel module's ``run()`` and ``__main__``: check against the stage-0
reference and time on a Hopper GPU; without one, compile and print the resource report.
"""
from __future__ import annotations

from typing import Callable

from .compile_cache import cached
from .host_io import ARCH, compile_fake, cutlass_dtype, torch_dtype
from .sass_report import format_report


def hopper_gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def visible_pairs(seqlen_q: int, seqlen_k: int, left, right, causal: bool) -> int:
    """(query, key) pairs one sequence computes with window (left, right) (None: unbounded; causal:
    right 0), bottom-right aligned (query i's diagonal key is i + seqlen_k - seqlen_q), row by row."""
    import numpy as np

    diag = np.arange(seqlen_q, dtype=np.int64) + (seqlen_k - seqlen_q)
    lo = np.zeros_like(diag) if left is None else np.maximum(diag - left, 0)
    right = 0 if causal else right
    hi = np.full_like(diag, seqlen_k - 1) if right is None else np.minimum(diag + right, seqlen_k - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal) -> float:
    """4*b*h*sq*sk*d (2 for QK^T, 2 for PV, with d the mean of the two head dims). Causal: halved when
    sq = sk (the usual convention), else the pairs a bottom-right mask keeps (visible_pairs)."""
    per_pair = 2.0 * batch * heads * (head_dim + head_dim_v)
    if not causal:
        return per_pair * seqlen_q * seqlen_k
    if seqlen_q == seqlen_k:
        return per_pair * seqlen_q * seqlen_k / 2
    return per_pair * visible_pairs(seqlen_q, seqlen_k, None, None, True)


def benchmark_ms(fn, warmup=5, iters=20) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def run_step(step_name: str, make_kernel: Callable, attention_forward: Callable, *, batch, seqlen_q,
             seqlen_k, heads, heads_kv, head_dim, head_dim_v, causal, dtype, check, verbose=True) -> dict:
    """The body of every step's run(): GPU -> check + time; no GPU -> compile + resource report."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    heads_kv = heads if heads_kv is None else heads_kv
    result: dict = {"step": step_name}
    if not hopper_gpu_available():
        comp = compile_fake(step_name, make_kernel, dtype=dtype, head_dim=head_dim,
                            head_dim_v=head_dim_v, causal=causal)
        result.update(mode="compile-only", report=comp.report)
        if verbose:
            print(format_report(f"{step_name} [{ARCH}, {dtype}, d={head_dim}/{head_dim_v}, "
                                f"causal={causal}] (no Hopper GPU: compiled only)", comp.report))
        return result

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    tdt = torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
    out = torch.full((batch, seqlen_q, heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    if check:
        ref_o, ref_lse = attention_ref(q, k, v, causal=causal, upcast=True)
        base_o, base_lse = attention_ref(q, k, v, causal=causal, upcast=False)
        assert_fa4_close(f"{step_name} out", out, ref_o, base_o)
        assert_fa4_close(f"{step_name} lse", lse, ref_lse, base_lse)
    ms = benchmark_ms(lambda: attention_forward(q, k, v, causal=causal, out=out, lse=lse))
    tflops = attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal) / (ms * 1e-3) / 1e12
    rep = cached((step_name, "gpu", str(cutlass_dtype(dtype)), head_dim, head_dim_v, bool(causal))).report
    result.update(mode="gpu", ms=ms, tflops=tflops, report=rep)
    if verbose:
        status = "PASS" if check else "(unchecked)"
        print(f"{status} {step_name} b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} "
              f"d={head_dim}/{head_dim_v} causal={causal} {dtype}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")
        print(format_report("  resources", rep))
    return result


# --------------------------------------------------------------------------------------------
# command line shared by every kernel module's __main__ (and stage 4's)
# --------------------------------------------------------------------------------------------
def shape_parser(doc: str):
    """argparse parser with the problem-shape options every `python -m <kernel module>` takes."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen_q", type=int, default=1024)
    ap.add_argument("--seqlen_k", type=int, default=None, help="default: seqlen_q")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--heads_kv", type=int, default=None)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--head_dim_v", type=int, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    return ap


def shape_kwargs(a) -> dict:
    """The run(...) keyword arguments of shape_parser's options."""
    return dict(batch=a.batch, seqlen_q=a.seqlen_q, seqlen_k=a.seqlen_k or a.seqlen_q, heads=a.heads,
                heads_kv=a.heads_kv, head_dim=a.head_dim, head_dim_v=a.head_dim_v, causal=a.causal,
                dtype=a.dtype)