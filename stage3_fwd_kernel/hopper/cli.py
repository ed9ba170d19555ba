"""`run`: check against the stage-0 reference and time on a Hopper GPU, or compile and print the
resource report without one (``python -m stage3_fwd_kernel.hopper``)."""
from __future__ import annotations

from stage3_fwd_kernel import host_io, runner
from stage3_fwd_kernel.compile_cache import cached
from stage3_fwd_kernel.sass_report import format_report
from stage3_fwd_kernel.hopper.config import (
    DEFAULT_EMULATION_FRACTION, STEP, TILE_MS, _check_tile_m, make_policy)
from stage3_fwd_kernel.hopper.host import _key, attention_forward, attention_varlen_forward, compile_only
from stage3_fwd_kernel.hopper.scheduling import _resolve_scheduler
from stage3_fwd_kernel.softmax_policy import DEFAULT_RESCALE_THRESHOLD


def _format(name, rep):
    return format_report(name, rep) + f", FADD.RM={rep.get('FADD.RM')}, VOTE.ANY={rep.get('VOTE.ANY')}"


def _random_varlen(batch, max_seqlen_q, max_seqlen_k, heads, heads_kv, d, dv, dtype, gen):
    """A random packed batch with lengths in [0, max], both kinds of empty sequence included."""
    import torch

    lq = torch.randint(0, max_seqlen_q + 1, (batch,), generator=gen, device="cuda")
    lk = torch.randint(0, max_seqlen_k + 1, (batch,), generator=gen, device="cuda")
    if batch >= 3:
        lq[0], lk[1], lq[2], lk[2] = 0, 0, max_seqlen_q, max_seqlen_k  # q-empty, k-empty, longest
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_q[1:], cu_k[1:] = lq.cumsum(0), lk.cumsum(0)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, heads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(tk, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(tk, heads_kv, dv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, cu_q, cu_k


def _problem(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v, causal, dtype, varlen, fwd_kwargs):
    """(fwd, ref, flops, varlen flags) of a random problem on the GPU."""
    import torch
    from stage0_reference.torch_reference import attention_ref, attention_varlen_ref

    tdt = host_io.torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if varlen:
        q, k, v, cu_q, cu_k = _random_varlen(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v,
                                             tdt, gen)
        out = torch.full((q.shape[0], heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
        lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda", dtype=torch.float32)
        lens = zip((cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist())
        flops = float(sum(runner.attention_flops(1, a, b, heads, head_dim, head_dim_v, causal) for a, b in lens))
        return ((lambda: attention_varlen_forward(q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, causal=causal, out=out,
                                                  lse=lse, **fwd_kwargs)),
                (lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=upcast)),
                out, lse, flops, (True, False, False))
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
    out = torch.full((batch, seqlen_q, heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda", dtype=torch.float32)
    flops = runner.attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal)
    return ((lambda: attention_forward(q, k, v, causal=causal, out=out, lse=lse, **fwd_kwargs)),
            (lambda upcast: attention_ref(q, k, v, causal=causal, upcast=upcast)),
            out, lse, flops, (False, False, False))


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", check=True, *, varlen=False, rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
        emulation_fraction=DEFAULT_EMULATION_FRACTION, tile_m=None, verbose=True) -> dict:
    """On a Hopper GPU: check against the stage-0 reference (FA4 rule) and time. Otherwise: compile
    for sm_90a and print the resource report. varlen=True runs a random packed batch of `batch`
    sequences with lengths up to seqlen_q / seqlen_k (empty ones included)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tile_m = _check_tile_m(tile_m, head_dim, head_dim_v, causal, seqlen_k=None if varlen else seqlen_k)
    heads_kv = heads if heads_kv is None else heads_kv
    policy = make_policy(rescale_threshold, emulation_fraction)
    tag = (f"{STEP} [{host_io.ARCH}, {dtype}, d={head_dim}/{head_dim_v}, causal={causal}, varlen={varlen}, "
           f"tile_m={tile_m}, {policy.describe()}]")
    result: dict = {"step": STEP, "policy": policy}
    if not runner.hopper_gpu_available():
        comp = compile_only(dtype, head_dim, head_dim_v, causal, varlen=varlen, policy=policy, tile_m=tile_m)
        result.update(mode="compile-only", report=comp.report)
        if verbose:
            print(_format(tag + " (no Hopper GPU: compiled only)", comp.report))
        return result

    import torch
    from stage0_reference.torch_reference import assert_fa4_close

    fwd, ref, out, lse, flops, flags = _problem(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v,
                                                causal, dtype, varlen, dict(policy=policy, tile_m=tile_m))
    fwd()
    torch.cuda.synchronize()
    if check:
        (ref_o, ref_lse), (base_o, base_lse) = ref(True), ref(False)
        assert_fa4_close(f"{STEP} out", out, ref_o, base_o)
        assert_fa4_close(f"{STEP} lse", lse, ref_lse, base_lse)
    ms = runner.benchmark_ms(fwd)
    tflops = flops / (ms * 1e-3) / 1e12
    scheduler = _resolve_scheduler(None, None, head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m)
    rep = cached(_key("gpu", host_io.cutlass_dtype(dtype), head_dim, head_dim_v, causal, policy, scheduler,
                             flags, tile_m)).report
    result.update(mode="gpu", ms=ms, tflops=tflops, report=rep)
    if verbose:
        status = "PASS" if check else "(unchecked)"
        print(f"{status} {STEP} b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} d={head_dim}/{head_dim_v} "
              f"causal={causal} varlen={varlen} tile_m={tile_m} {dtype} {policy.describe()}: {ms:.3f} ms, "
              f"{tflops:.1f} TFLOP/s")
        print(format_report("  resources", rep))
    return result


def main(argv=None):
    ap = runner.shape_parser(__doc__)
    ap.add_argument("--varlen", action="store_true", help="a random packed batch of --batch sequences")
    ap.add_argument("--rescale_threshold", type=float, default=DEFAULT_RESCALE_THRESHOLD)
    ap.add_argument("--emulation_fraction", type=float, default=DEFAULT_EMULATION_FRACTION)
    ap.add_argument("--tile_m", type=int, default=None, choices=TILE_MS, help="default: default_tile_m(d, dv, causal)")
    a = ap.parse_args(argv)
    run(**runner.shape_kwargs(a), varlen=a.varlen, rescale_threshold=a.rescale_threshold,
        emulation_fraction=a.emulation_fraction, tile_m=a.tile_m)
