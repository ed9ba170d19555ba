"""Packed documents over a sharded sequence: gather K and V, attend each rank's rows once.

The packed tokens (T of them, documents given by the global cu_seqlens) are split contiguously:
rank r holds tokens [r T/P, (r+1) T/P). Documents may cross rank boundaries. A ring would have to
cut every document at every boundary; instead K and V are all-gathered (GQA keeps them small: at
32/8 heads they are a quarter of Q's bytes) and each rank runs one varlen call over its own rows.

For a document [a, b) and this rank's rows [lo, hi), the query rows are [qa, qb) = [max(a, lo),
min(b, hi)) and the keys are

    non-causal: [a, b)          causal: [a, qb), or [max(a, qa - left), qb) with a window (left, 0)

Causal is bottom-right aligned in fa4, so a key range that ends where the query rows end keeps
every query on its own global position, and the mask (causal, window) is exact. A non-causal call
needs the keys past qb, which moves that alignment, so a window on it is refused.

Backward: dq is local; each rank's dk, dv over the gathered keys are scattered into a full-length
fp32 buffer and reduce-scattered (summed) back to the owners. Nothing is overlapped here: the
gather and the reduce-scatter are exposed. Under a causal mask the last rank has the most work
(contiguous split); balancing it means choosing the split per batch, which is the caller's call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._checks import check_kernels, check_tensor, pad_for, world_of


@dataclass(frozen=True)
class LocalDocs:
    """This rank's share of the packed batch, as one varlen call sees it."""
    cu_q: torch.Tensor      # (n + 1,) int32: the local query rows per document piece
    cu_k: torch.Tensor      # (n + 1,) int32: the gathered key rows per piece
    kv_index: torch.Tensor  # (total_k_local,) int64: which global key rows, in order
    max_q: int
    max_k: int


def local_docs(bounds: list, lo: int, hi: int, causal: bool, left, device) -> LocalDocs:
    """The document pieces of rows [lo, hi) (bounds: the global cu_seqlens as a list)."""
    cu_q, cu_k, ranges = [0], [0], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qa, qb = max(a, lo), min(b, hi)
        if qa >= qb:
            continue
        ka, kb = (a, b) if not causal else (a if left is None else max(a, qa - left), qb)
        cu_q.append(cu_q[-1] + qb - qa)
        cu_k.append(cu_k[-1] + kb - ka)
        ranges.append((ka, kb))
    idx = torch.cat([torch.arange(ka, kb, dtype=torch.long) for ka, kb in ranges]) if ranges else \
        torch.zeros(0, dtype=torch.long)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    max_q = max((y - x for x, y in zip(cu_q[:-1], cu_q[1:])), default=0)
    max_k = max((y - x for x, y in zip(cu_k[:-1], cu_k[1:])), default=0)
    return LocalDocs(as_i32(cu_q), as_i32(cu_k), idx.to(device), max_q, max_k)


@dataclass(frozen=True)
class VarlenCall:
    group: object
    world: int
    rank: int
    kernels: object
    scale: float
    causal: bool
    window: tuple
    softcap: float
    deterministic: bool
    return_lse: bool
    docs: LocalDocs


def _gather(x, call: VarlenCall):
    parts = [torch.empty_like(x) for _ in range(call.world)]
    dist.all_gather(parts, x.contiguous(), group=call.group)
    return torch.cat(parts, dim=0)


def _reduce_scatter(full, call: VarlenCall):
    """Sum `full` (T, ...) over the group and keep this rank's rows."""
    rows = full.shape[0] // call.world
    if dist.get_backend(call.group) == "nccl":
        mine = full.new_empty((rows,) + tuple(full.shape[1:]))
        dist.reduce_scatter_tensor(mine, full, group=call.group)
        return mine
    dist.all_reduce(full, group=call.group)  # gloo has no reduce-scatter
    return full[call.rank * rows:(call.rank + 1) * rows].clone()


class GatheredVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: VarlenCall):
        docs = call.docs
        k_sel = _gather(k, call).index_select(0, docs.kv_index)
        v_sel = _gather(v, call).index_select(0, docs.kv_index)
        out, lse = call.kernels.varlen_forward(q, k_sel, v_sel, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k,
                                               call.scale, call.causal, call.window, call.softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call: VarlenCall = ctx.call
        docs = call.docs
        if not call.return_lse:
            dlse = None
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        k_sel = _gather(k, call).index_select(0, docs.kv_index)  # gathered again: not kept from the forward
        v_sel = _gather(v, call).index_select(0, docs.kv_index)
        dq, dk_sel, dv_sel = call.kernels.varlen_backward(
            dout, q, k_sel, v_sel, out, lse, dlse, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, call.scale,
            call.causal, call.window, call.softcap, call.deterministic)
        acc = torch.promote_types(k.dtype, torch.float32)
        total = k.shape[0] * call.world
        grads = []
        for g, ref in ((dk_sel, k), (dv_sel, v)):
            full = torch.zeros((total,) + tuple(ref.shape[1:]), dtype=acc, device=ref.device)
            full.index_add_(0, docs.kv_index, g.to(acc))  # each key row once per rank: no collisions
            grads.append(_reduce_scatter(full, call).to(ref.dtype))
        return dq, grads[0], grads[1], None


def ring_attention_varlen(q, k, v, *, cu_seqlens, group=None, causal=False, softmax_scale=None,
                          window_size=(None, None), softcap=0.0, deterministic=False, return_lse=False, kernels=None):
    """Attention over packed documents whose tokens are split contiguously over `group`.

    q (T/P, Hq, D), k (T/P, Hkv, D), v (T/P, Hkv, Dv): rows [r T/P, (r+1) T/P) of the packed batch on
    rank r. cu_seqlens: the *global* document boundaries (int32 or int64, length docs + 1, from 0 to
    T, the same on every rank; read on the host once per call). Empty documents are fine.
    window_size (left, 0) / (left, None) with causal=True: a sliding window to the left.
    Returns out (T/P, Hq, Dv), or (out, lse) with lse (Hq, T/P) fp32 (fp64 for fp64 inputs on ReferenceKernels).
    """
    from .._validate import check_softcap, check_window

    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3)
    check_tensor("cu_seqlens", cu_seqlens, 1)
    world, rank = world_of(group)
    kernels, q, k, v, scale = check_kernels(kernels, q, k, v, softmax_scale, causal, deterministic, return_lse,
                                             varlen=True)
    if getattr(kernels, "needs_cuda", False):
        from .._validate import check_varlen

        cu_dev = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        check_varlen(q, k, v, cu_dev, cu_dev, q.shape[0], k.shape[0], scale, causal, deterministic, return_lse, None)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: holds {k.shape[0]} tokens but q holds {q.shape[0]}; each rank holds the same rows "
                         "of queries and keys")
    left, right, causal = check_window(window_size, causal)
    if right is not None or (left is not None and not causal):
        raise ValueError(f"window_size: only a causal window (left, 0) is served across ranks (a document's keys "
                         f"past this rank's rows would shift a non-causal one), got {window_size}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected documents + 1 >= 2 offsets, got {cu_seqlens.shape[0]}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    total = q.shape[0] * world
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens: must rise from 0 to the global token count {total} (= {q.shape[0]} rows x "
                         f"{world} ranks), got {bounds[:4]}...{bounds[-2:]}")
    rows = q.shape[0]
    docs = local_docs(bounds, rank * rows, (rank + 1) * rows, causal, left, q.device)
    call = VarlenCall(group, world, rank, kernels, scale, causal, (left, None), check_softcap(softcap),
                      deterministic, return_lse, docs)
    q, k, v, unpad = pad_for(kernels, q, k, v)
    out, lse = GatheredVarlenAttention.apply(q, k, v, call)
    out = unpad(out)
    return (out, lse) if return_lse else out
