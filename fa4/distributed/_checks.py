"""Argument checks shared by the fa4.distributed functions (each a ValueError / TypeError naming
the argument, before any communication)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._kernels import Fa4Kernels


def world_of(group):
    """(world size, this rank) of `group` (None: the default group); a ValueError naming `group` when
    torch.distributed is not set up or this process is not a member (torch answers -1 there)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised; call dist.init_process_group first "
                         "(torchrun sets up the environment for it)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to a process outside it
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 1 or rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    return world, rank


def check_seq_dim(name, x, dim):
    """`dim` an int naming one of x's dimensions (negative counts from the end)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is out of range for {name} of shape {tuple(x.shape)}")


def check_tensor(name, t, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")


def check_kernels(kernels, q, k, v, softmax_scale, causal, deterministic, return_lse, varlen=False):
    """Returns (kernels, q, k, v, scale) after the checks fa4's own functions make."""
    from .._validate import check_fixed, check_softmax_scale

    kernels = Fa4Kernels() if kernels is None else kernels
    if isinstance(kernels, type) or not all(hasattr(kernels, m)
                                            for m in ("forward", "backward", "varlen_forward", "varlen_backward")):
        what = f"the class {kernels.__name__} (an instance is needed)" if isinstance(kernels, type) else \
            type(kernels).__name__
        raise TypeError(f"kernels: expected Fa4Kernels(), ReferenceKernels() or None, got {what}")
    if q.device.type == "meta":
        raise ValueError("q: meta tensors cannot be sent around the ring (they have no data to communicate)")
    if getattr(kernels, "needs_cuda", False) and not varlen:
        q, k, v, scale = check_fixed(q, k, v, softmax_scale, causal, deterministic, return_lse)
        return kernels, q, k, v, scale
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q: expected a floating dtype, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: dtype / device ({t.dtype}, {t.device}) differ from q's ({q.dtype}, {q.device})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head_dim {k.shape[-1]} differs from q's head_dim {q.shape[-1]}")
    if v.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"v: holds {tuple(v.shape[:-2])} (batch, tokens) but k holds {tuple(k.shape[:-2])}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv or v.shape[-2] != hkv or (not varlen and not q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"k: heads_kv ({hkv}) must divide q's heads ({hq}), with v's heads and the batch matching "
                         f"(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
    return kernels, q, k, v, check_softmax_scale("softmax_scale", softmax_scale, q.shape[-1])


def pad_for(kernels, q, k, v):
    """(q, k, v, unpad): fa4's kernels exist for a few (qk, v) head-dim pairs, so other pairs are
    zero-padded onto one (fa4._layouts.pad_head_dims, as fa4.flash_attn_func does); kernels that
    take any head dims (ReferenceKernels) get the inputs as they are."""
    if getattr(kernels, "native_head_dims", False):
        from .._layouts import pad_head_dims

        return pad_head_dims(q, k, v)
    return q, k, v, lambda out: out
