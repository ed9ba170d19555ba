"""`python -m fa4 demo`: run every stage that exists on this machine and report.

On CPU it checks the NumPy stages against the oracle (and the oracle against torch autograd),
showing what FA4's conditional rescaling skips; stages with GPU kernels add their own section.
"""
from __future__ import annotations

import math
import time

import numpy as np


def _row(*cols, widths=(34, 14, 14, 10)):
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths))


def _stage0_section(rng, report):
    import torch

    from stage0_reference import attention_backward, attention_forward

    b, sq, sk, hq, hkv, d = 2, 97, 131, 4, 2, 32
    q, k, v = rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sk, hkv, d))
    out, lse = attention_forward(q, k, v, causal=True)
    dout = rng.standard_normal(out.shape)
    grads = attention_backward(q, k, v, out, dout, lse, causal=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    s = torch.einsum("bqhd,bkhd->bhqk", tq, tk.repeat_interleave(2, 2)) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(j > i + sk - sq, -math.inf), -1)
    tout = torch.einsum("bhqk,bkhd->bqhd", p, tv.repeat_interleave(2, 2))
    tout.backward(torch.tensor(dout))
    errs = [np.abs(out - tout.detach().numpy()).max()] + [
        np.abs(g - t.grad.numpy()).max() for g, t in zip(grads, (tq, tk, tv))]
    ok = max(errs) < 1e-10
    report.append(("stage 0", "oracle vs torch autograd (fp64), causal GQA-2", f"max err {max(errs):.1e}", ok))
    return ok


def _stage1_section(rng, report):
    from stage0_reference import attention_backward, attention_forward
    from stage1_online_softmax import flash_backward, flash_forward

    b, sq, sk, h, d = 1, 256, 4096, 4, 64
    q, k, v = (rng.standard_normal((b, s, h, d)) for s in (sq, sk, sk))
    out, lse = attention_forward(q, k, v, causal=True)
    print("\nstage 1: tiled online softmax (128 x 128 tiles), rescales per (row, K block) where the max grew")
    print("  " + _row("threshold tau (log2 units)", "rescaled", "skipped", "max err"))
    ok = True
    for tau in (0.0, 2.0, 8.0):
        o1, l1, st = flash_forward(q, k, v, causal=True, rescale_threshold=tau)
        err = np.abs(o1 - out).max()
        ok &= err < 1e-12
        label = f"{tau:g}" + ("  (classic FlashAttention)" if tau == 0 else "  (FA4 default)" if tau == 8 else "")
        print("  " + _row(label, st.done, st.skipped, f"{err:.1e}"))
    report.append(("stage 1", "tiled forward == oracle for tau 0, 2, 8", "fp64 round-off", ok))
    qs, ks, vs = q[:, :64], k[:, :512], v[:, :512]
    o_s, l_s = attention_forward(qs, ks, vs)
    dout = rng.standard_normal(o_s.shape)
    ref = attention_backward(qs, ks, vs, o_s, dout, l_s)
    mine = flash_backward(qs, ks, vs, o_s, dout, l_s, block_m=32, block_n=64)
    err = max(np.abs(a - r).max() for a, r in zip(mine, ref))
    report.append(("stage 1", "tiled backward == oracle", f"max err {err:.1e}", err < 1e-12))
    return ok and err < 1e-12


def run_demo() -> int:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    report: list[tuple[str, str, str, bool]] = []
    print("fa4 demo: FlashAttention-4 from scratch; every stage checked against the float64 oracle")
    _stage0_section(rng, report)
    _stage1_section(rng, report)
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    print("\nsummary")
    for stage, what, detail, ok in report:
        print("  " + _row(stage, what, detail, "PASS" if ok else "FAIL", widths=(8, 48, 18, 4)))
    if not gpu:
        print("\nno CUDA device here: GPU kernels (stage 3+) are not run; see README's support matrix.")
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0 if all(r[3] for r in report) else 1
