"""Context parallelism: attention over a sequence sharded across a torch.distributed process group.

    import torch.distributed as dist, fa4.distributed as cp
    dist.init_process_group("nccl")                      # one GPU per rank (torchrun)
    q, k, v = (cp.shard(t, dim=1) for t in (q_full, k_full, v_full))   # this rank's tokens
    out = cp.ring_attention(q, k, v, causal=True)        # (B, S/P, Hq, Dv): this rank's rows
    out_full = cp.unshard(out, dim=1)                    # every rank's rows, in sequence order

Each rank keeps its slice of the queries; the key/value slices travel around a ring of NCCL
sends and receives that overlap the attention (fa4/distributed/_ring.py). Forward and backward go
through autograd; the lse output is differentiable. With `layout="zigzag"` (the default) a causal
mask costs every rank the same: rank r holds the sequence's chunks r and 2P-1-r of 2P
(fa4/distributed/_plan.py); `shard`, `unshard` and `positions` speak the same layout, and every
call of one model must use one layout. `ring_attention_varlen` serves packed documents that cross
rank boundaries by gathering K and V (fa4/distributed/_varlen.py).

The kernels are fa4's. `kernels=ReferenceKernels()` runs the same algorithm with torch math
instead (any device, any float dtype; the CPU tests use it on the gloo backend).

Every rank checks its own arguments, but nothing compares them across ranks: a call whose arguments
differ between ranks is undefined. Different flags or cu_seqlens (causal, layout, ...) give wrong
results on every rank without an error; different shapes or dtypes make the transfers disagree --
the backend may abort a process (gloo does) while a peer returns garbage or waits. As with any
collective, the caller keeps the ranks in step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import check_kernels, check_seq_dim, check_tensor, pad_for, world_of
from ._kernels import Fa4Kernels, ReferenceKernels
from ._plan import LAYOUTS, check_divisible, check_layout, local_positions
from ._ring import Ring, RingAttention, RingCall
from ._varlen import ring_attention_varlen

__all__ = ["ring_attention", "ring_attention_varlen", "shard", "unshard", "positions", "Fa4Kernels",
           "ReferenceKernels", "LAYOUTS"]


def ring_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, layout="zigzag",
                   window_size=(None, None), softcap=0.0, learnable_sink=None, deterministic=False, return_lse=False,
                   kernels=None):
    """Attention of this rank's queries over the whole sharded sequence.

    q (B, S/P, Hq, D), k (B, S/P, Hkv, D), v (B, S/P, Hkv, Dv): this rank's slice of a sequence of
    length S sharded over the P ranks of `group` (default: the world) in `layout` ("zigzag" or
    "contiguous", see `shard`). Every rank must call with the same shapes and arguments.
    Returns out (B, S/P, Hq, Dv), or (out, lse) with lse (B, Hq, S/P) fp32 (fp64 for fp64 inputs on
    ReferenceKernels) -- this rank's rows.
    causal: key position <= query position over the global sequence. GQA, softcap and
    learnable_sink (Hq,) work as in fa4.flash_attn_func; the sink's gradient on each rank is that
    rank's share (sum it over the group with the other replicated parameters' gradients). Head dims
    as in fa4.flash_attn_func: pairs without a kernel of their own are zero-padded onto a native one
    (`_checks.pad_for`).
    window_size (left, right): fa4.flash_attn_func's sliding window over the global positions
    (query i sees keys i - left ..= i + right; None or -1 unlimited; causal is right = 0). Each ring
    step then runs one call per pair of a local chunk and a received one that the band reaches, with
    the window re-expressed on that sub-block (fa4/distributed/_plan.py), in either layout.
    deterministic=True gives bitwise-reproducible gradients.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4)
    world, rank = world_of(group)
    kernels, q, k, v, scale = check_kernels(kernels, q, k, v, softmax_scale, causal, deterministic, return_lse)
    check_layout(layout)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k: holds {k.shape[1]} tokens but q holds {q.shape[1]}; a sharded sequence has the "
                         "same slice of queries and keys on each rank")
    check_divisible("q", q.shape[1], world, layout, local=True)  # whole chunks (unshard needs them too)
    from .._validate import check_learnable_sink, check_softcap, check_window

    left, right, causal = check_window(window_size, causal)
    softcap = check_softcap(softcap)
    learnable_sink = check_learnable_sink(learnable_sink, q)
    call = RingCall(Ring(group), kernels, scale, causal, layout, softcap, deterministic, return_lse, (left, right))
    q, k, v, unpad = pad_for(kernels, q, k, v)
    out, lse = RingAttention.apply(q, k, v, learnable_sink, call)
    out = unpad(out)
    return (out, lse) if return_lse else out


def _chunk_order(world, layout):
    """The global chunk ids in the order the ranks hold them (rank 0's first)."""
    if layout == "contiguous":
        return list(range(world))
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


def shard(x, *, group=None, dim=1, layout="zigzag"):
    """This rank's slice of a full-sequence tensor `x` (sequence along `dim`), in `layout`:
    "contiguous" gives rank r tokens [r S/P, (r+1) S/P); "zigzag" cuts 2P chunks and gives rank r
    chunks r and 2P-1-r, concatenated. Returns a new contiguous tensor (differentiable)."""
    check_tensor("x", x)
    check_seq_dim("x", x, dim)
    world, rank = world_of(group)
    check_layout(layout)
    check_divisible("x", x.shape[dim], world, layout, local=False)
    chunks = x.chunk(len(_chunk_order(world, layout)), dim=dim)
    order = _chunk_order(world, layout)
    per = len(order) // world
    mine = order[rank * per:(rank + 1) * per]
    return torch.cat([chunks[c] for c in mine], dim=dim).contiguous()


def unshard(x, *, group=None, dim=1, layout="zigzag"):
    """The inverse of `shard`: all-gathers every rank's slice and puts the tokens back in sequence
    order (not differentiable: for checking and for outputs)."""
    check_tensor("x", x)
    check_seq_dim("x", x, dim)
    world, _ = world_of(group)
    check_layout(layout)
    check_divisible("x", x.shape[dim], world, layout, local=True)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    order = _chunk_order(world, layout)
    pieces = [c for p in parts for c in p.chunk(len(order) // world, dim=dim)]
    by_chunk = sorted(zip(order, pieces), key=lambda t: t[0])
    return torch.cat([p for _, p in by_chunk], dim=dim)


def positions(seqlen, *, group=None, layout="zigzag", device=None):
    """The global positions (int64, length seqlen / P) of this rank's tokens: what rotary
    embeddings and labels need after `shard`."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int):
        raise TypeError(f"seqlen: expected an int, got {type(seqlen).__name__} {seqlen!r}")
    if seqlen < 0:
        raise ValueError(f"seqlen: expected an int >= 0, got {seqlen}")
    world, rank = world_of(group)
    check_layout(layout)
    check_divisible("seqlen", seqlen, world, layout, local=False)
    return torch.tensor(local_positions(rank, world, seqlen, layout), dtype=torch.long, device=device)
