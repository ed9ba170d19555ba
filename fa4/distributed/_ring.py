"""Ring attention: each rank keeps its queries, the key/value slices travel around the ring.

Forward, on rank r of P: at step s it holds the keys and values of rank src = (r - s) mod P. It
posts their send to rank r+1 and the receive of the next slice from rank r-1 *before* computing on
the slice in hand, so the transfer runs under the attention (NCCL runs P2P on its own stream). The
block's (out_s, lse_s) is merged into the running pair through the log-sum-exp (fa4/_lse_merge.py,
stage 1's online-softmax rescale), one block at a time:

    lse = log(exp(lse) + exp(lse_s)),   out = out * exp(lse_old - lse) + out_s * exp(lse_s - lse)

in fp32. P-1 transfers of K and V in all. Under a sliding window a step is up to one call per pair
of a local chunk and a received one (`RingCall.blocks`, fa4/distributed/_plan.py), merged in order;
the slices still go all the way round, even past the steps the window leaves empty.

Backward: the same tour. dq stays home (fp32, added in ring order). The dK / dV partials of a slice
travel *with* it: the rank holding slice src adds its block's dk, dv into the slice's fp32
accumulator and passes it on; one last hop after step P-1 brings each accumulator home. That is
P-1 transfers of K, V and P of the fp32 dK, dV; the dK / dV hop of step s overlaps step s+1's
attention. The order of every addition is fixed, so deterministic=True is bitwise reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .._lse_merge import add_sink, merge_into
from ._plan import step_blocks

NEG_INF = float("-inf")


class _Pending:
    """Tensors on their way in; wait() makes the current stream wait for them and returns them."""

    def __init__(self, tensors, requests=()):
        self.tensors, self.requests = tensors, requests

    def wait(self):
        for r in self.requests:
            r.wait()
        return self.tensors


class Ring:
    """Send to the next rank of `group`, receive from the previous one (torch.distributed P2P)."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group else (self.rank - 1) % self.world

    def shift(self, tensors) -> _Pending:
        """Post the send of `tensors` to the next rank and the receive of the previous rank's."""
        if self.world == 1:
            return _Pending(tuple(tensors))
        tensors = [t.contiguous() for t in tensors]
        incoming = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in incoming]
        return _Pending(incoming, dist.batch_isend_irecv(ops))


@dataclass(frozen=True)
class RingCall:
    ring: Ring
    kernels: object
    scale: float
    causal: bool
    layout: str
    softcap: float
    deterministic: bool
    return_lse: bool
    window: tuple = (None, None)  # (left, right) over the global sequence, right None when causal

    def blocks(self, src: int, local_len: int):
        """The kernel calls against the slice from rank `src` (fa4/distributed/_plan.py)."""
        return step_blocks(self.ring.rank, src, self.ring.world, local_len, self.causal, self.layout, self.window)


def _acc_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _drain(*pending):
    """After a step failed: complete this rank's posted sends / receives, so the process group is
    usable again once every rank has failed alike (a rank that fails alone still leaves its peers
    waiting -- the caller keeps the ranks in step)."""
    for request in pending:
        if request is not None:
            try:
                request.wait()
            except Exception:  # noqa: BLE001 -- the step's own error is the one to report
                pass


def ring_forward(call: RingCall, q, k, v):
    ring, kern = call.ring, call.kernels
    b, sl, hq, _ = q.shape
    out = torch.zeros(b, sl, hq, v.shape[-1], dtype=_acc_dtype(q), device=q.device)
    lse = torch.full((b, hq, sl), NEG_INF, dtype=_acc_dtype(q), device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming = ring.shift(kv) if step + 1 < ring.world else None
        for blk in call.blocks(src, sl):
            qr, kr = blk.q_rows, blk.kv_rows
            try:
                o, l = kern.forward(q[:, qr], kv[0][:, kr], kv[1][:, kr], call.scale, blk.causal, call.softcap,
                                    blk.window)
            except BaseException:
                _drain(incoming)
                raise
            merge_into(out[:, qr], lse[:, :, qr].transpose(1, 2), o, l.transpose(1, 2))
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def ring_backward(call: RingCall, dout, q, k, v, out, lse, dlse):
    ring, kern = call.ring, call.kernels
    sl = q.shape[1]
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    dkv = (torch.zeros(k.shape, dtype=_acc_dtype(k), device=k.device),
           torch.zeros(v.shape, dtype=_acc_dtype(v), device=v.device))
    kv, dkv_incoming = (k, v), None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming = ring.shift(kv) if step + 1 < ring.world else None
        grads = []
        for blk in call.blocks(src, sl):
            qr, kr = blk.q_rows, blk.kv_rows
            try:
                g = kern.backward(dout[:, qr], q[:, qr], kv[0][:, kr], kv[1][:, kr], out[:, qr], lse[:, :, qr],
                                  None if dlse is None else dlse[:, :, qr], call.scale, blk.causal, call.softcap,
                                  call.deterministic, blk.window)
            except BaseException:
                _drain(incoming, dkv_incoming)
                raise
            dq[:, qr] += g[0]
            grads.append((kr, g[1], g[2]))
        if dkv_incoming is not None:
            dkv = dkv_incoming.wait()
        for kr, dk_blk, dv_blk in grads:  # in the blocks' fixed order: deterministic sums
            dkv[0][:, kr] += dk_blk
            dkv[1][:, kr] += dv_blk
        dkv_incoming = ring.shift(dkv)  # toward the slice's next holder; after the last step, its owner
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = dkv_incoming.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, call: RingCall):
        out, lse = ring_forward(call, q, k, v)
        if sink is not None:
            out, lse_t = add_sink(out, lse.transpose(1, 2), sink)
            lse = lse_t.transpose(1, 2).contiguous()
        out = out.to(q.dtype)
        lse = lse.to(torch.float32) if q.dtype in (torch.float16, torch.bfloat16) else lse
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        call: RingCall = ctx.call
        if not call.return_lse:
            dlse = None
        if dout is None and dlse is None:
            return None, None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(call, dout, q, k, v, out, lse, dlse)
        dsink: Optional[torch.Tensor] = None
        if sink is not None and ctx.needs_input_grad[3]:
            from .._dispatch import sink_grad

            dsink = sink_grad(out, dout, lse, sink, dlse)
        return dq, dk, dv, dsink, None
