"""One small attention call, run under compute-sanitizer by tests/test_sanitizers.py:

    compute-sanitizer --tool racecheck python tests/sanitizer_case.py fwd-d128-causal

Small shapes (300 x 333 keys, GQA 4/2, batch 2) keep a sanitized run to seconds; the case names say
which product kernel runs. Prints "<case> ok" when every launch returned.
"""
from __future__ import annotations

import sys

import torch

CASES = {
    # name: (head_dim, head_dim_v, causal, backward)
    "fwd-d64": (64, 64, False, False),
    "fwd-d64-causal": (64, 64, True, False),
    "fwd-d128": (128, 128, False, False),
    "fwd-d128-causal": (128, 128, True, False),     # persistent CTAs with the dynamic tile counter
    "fwd-d192x128-causal": (192, 128, True, False),
    "fwd-d256-causal": (256, 256, True, False),
    "bwd-d64-causal": (64, 64, True, True),
    "bwd-d128-causal": (128, 128, True, True),      # attention_backward: persistent here (300 x 2 <= 2048)
    "bwd-d128-deterministic": (128, 128, True, "deterministic"),
    "bwd-d128-persistent": (128, 128, True, "persistent"),  # options.persistent: one CTA per SM (5 here)
    "bwd-d128-per-tile": (128, 128, True, "per-tile"),      # one CTA per K/V tile (the default past 2k keys)
    "bwd-d128-window": (128, 128, True, "window"),  # window (100, 0): half tiles at both walk ends
    "varlen-d128-causal": None,                     # one empty sequence among three (persistent backward)
    "varlen-d128-per-tile": None,                   # the same, one CTA per K/V tile
    "paged-d128-page8": 8,                          # pages read by the producer's cp.async gather
    "paged-d128-page16": 16,                        # pages read by TMA boxes, 8 a key block
}


def bshd(b, s, h, d):
    return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)


def run_case(name: str):
    from stage3_fwd_kernel import hopper as fwd
    from stage4_bwd_kernel import hopper as bwd

    torch.manual_seed(0)
    if name.startswith("paged-"):
        run_paged(CASES[name])
        return
    if name.startswith("varlen-"):
        lens_q, lens_k = [0, 130, 257], [0, 200, 257]
        cu_q = torch.tensor([0, *lens_q], device="cuda").cumsum(0).to(torch.int32)  # (batch + 1,)
        cu_k = torch.tensor([0, *lens_k], device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=torch.bfloat16)  # (Tq, Hq, D)
        k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16)  # (Tk, Hkv, D)
        v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = fwd.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        dout = torch.randn_like(out)
        if name == "varlen-d128-per-tile":
            from stage4_bwd_kernel import host

            host.backward(bwd.STEP, bwd.make_kernel, q, k, v, out, dout, lse, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True)
        else:
            bwd.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        return
    d, dv, causal, backward = CASES[name]
    q, k, v = bshd(2, 300, 4, d), bshd(2, 333, 2, d), bshd(2, 333, 2, dv)  # GQA 4/2
    window = (100, 0) if backward == "window" else (None, None)
    out, lse = fwd.attention_forward(q, k, v, causal=causal, window_size=window)
    if backward == "persistent":  # more K/V tiles (3 x 2 x 2 = 12) than the 5 CTAs it is given
        from stage4_bwd_kernel import host

        host.backward(*bwd.with_options(persistent=True), q, k, v, out, torch.randn_like(out), lse, causal=causal,
                      persistent_ctas=5)
    elif backward == "per-tile":
        from stage4_bwd_kernel import host

        host.backward(bwd.STEP, bwd.make_kernel, q, k, v, out, torch.randn_like(out), lse, causal=causal)
    elif backward:
        dout = torch.randn_like(out)
        bwd.attention_backward(q, k, v, out, dout, lse, causal=causal, window_size=window,
                               deterministic=backward == "deterministic")


def run_paged(page: int):
    """A paged cache read in place: shuffled pages with unused ones between, a partial last page, an
    empty sequence, GQA 4/2, causal."""
    from stage3_fwd_kernel import hopper as fwd

    lens_q, used = [130, 0, 57], [333, 0, 64 + page - 1]
    pages = -(-max(used) // page)
    k = torch.randn(3 * pages + 2, page, 2, 128, device="cuda", dtype=torch.bfloat16)  # (pages, page, Hkv, D)
    v = torch.randn_like(k)
    table = torch.randperm(k.shape[0], device="cuda")[:3 * pages].view(3, pages).to(torch.int32)
    cu_q = torch.tensor([0, *lens_q], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=torch.bfloat16)
    fwd.attention_varlen_forward(q, k, v, cu_q, None, max(lens_q), max(used), causal=True, page_table=table,
                                 seqused_k=torch.tensor(used, device="cuda", dtype=torch.int32))


if __name__ == "__main__":
    case = sys.argv[1]
    if case not in CASES:
        raise SystemExit(f"case: expected one of {sorted(CASES)}, got {case!r}")
    run_case(case)
    torch.cuda.synchronize()
    print(case, "ok")
