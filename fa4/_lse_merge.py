"""Merging partial attention results through their log-sum-exp (stage 1's rescale, in torch).

Attention over keys split into parts gives each part (out_j, lse_j), out_j normalised by its own
row sum. The whole row is lse = log sum_j exp(lse_j), out = sum_j exp(lse_j - lse) out_j. A part
that saw no key has lse_j = -inf and weighs nothing; a row no part saw stays (0, -inf) with no NaN.
Shared by fa4.distributed's ring (one part at a time, in place) and flash_attn_with_kvcache's
split-KV (all parts at once). Layout: out (..., H, Dv), lse (..., H) with the same leading dims
(callers pass transposed views where their lse is (B, H, S)).
"""
from __future__ import annotations

import torch


def merge_into(out, lse, out_s, lse_s):
    """Fold one part (out_s, lse_s) into the running (out, lse), in place (views are fine)."""
    new = torch.logaddexp(lse, lse_s.to(lse.dtype))
    out.mul_(torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1))
    out.add_(out_s.to(out.dtype) * torch.exp(lse_s - new).nan_to_num(0.0).unsqueeze(-1))
    lse.copy_(new)


def merge_parts(out, lse, dim: int):
    """All parts at once along `dim` (out (..., n, ..., H, Dv), lse likewise without Dv) -> the
    merged (out in fp32, or fp64 for fp64 input; lse) with `dim` removed."""
    acc = torch.promote_types(out.dtype, torch.float32)
    total = torch.logsumexp(lse, dim=dim)
    w = torch.exp(lse - total.unsqueeze(dim)).nan_to_num(0.0)
    return (out.to(acc) * w.unsqueeze(-1)).sum(dim), total


def add_sink(out, lse, sink):
    """A learnable sink (one logit per head, (H,)) joins each row's denominator once: returns the
    rescaled (out, lse), not in place."""
    new = torch.logaddexp(lse, sink.to(lse.dtype).expand_as(lse))
    # a row with no key and a -inf sink: exp(-inf - (-inf)) is NaN; its out stays 0, as merge_into's
    return out * torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1), new
