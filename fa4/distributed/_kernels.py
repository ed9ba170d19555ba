"""The attention a ring step runs: fa4's kernels, or a torch reference that runs anywhere.

Both take one block of the ring -- local queries against the keys in hand -- and return what the
ring needs to merge blocks: the block's out and its log-sum-exp (forward), and the block's dq, dk,
dv given the *global* out, lse and dout (backward). The backward is exact per block because the
global lse already holds every block's denominator: P_ij = exp(s_ij - lse_i) is the final softmax
probability, D_i = rowsum(dout_i * out_i) uses the final out, so dS = P (dP - D + dlse) summed over
blocks is the whole gradient.

Shapes: q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), out (B, Sq, Hq, Dv), lse (B, Hq, Sq);
causal and window (left, right) are bottom-right aligned (fa4's convention; a window as fa4's
checks leave it: sides >= 0 or None, a right side of 0 spelled causal).
"""
from __future__ import annotations

import torch


def _c(t):
    return None if t is None else t.contiguous()


class Fa4Kernels:
    """fa4's forward and backward kernels (CUDA, fp16 / bf16), called without autograd."""

    name = "fa4"
    needs_cuda = True
    native_head_dims = True  # kernels exist for a few (qk, v) pairs: the ring pads the others onto them

    def forward(self, q, k, v, scale, causal, softcap, window=(None, None)):
        from .. import _ops

        return _ops._fwd_impl(_c(q), _c(k), _c(v), scale, causal, False, True, *window, softcap, None)

    def backward(self, dout, q, k, v, out, lse, dlse, scale, causal, softcap, deterministic, window=(None, None)):
        from .. import _ops

        dq, dk, dv, _ = _ops._bwd_impl(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), _c(dlse), scale, causal,
                                       deterministic, *window, softcap, None)
        return dq, dk, dv

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
        from .. import _ops

        return _ops._varlen_fwd_impl(_c(q), _c(k), _c(v), cu_q, cu_k, None, max_q, max_k, scale, causal, False,
                                     True, *window, softcap, None)

    def varlen_backward(self, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, causal, window,
                        softcap, deterministic):
        from .. import _ops

        dq, dk, dv, _ = _ops._varlen_bwd_impl(_c(dout), _c(q), _c(k), _c(v), _c(out), _c(lse), _c(dlse), cu_q, cu_k,
                                              None, max_q, max_k,
                                              scale, causal, deterministic, *window, softcap, None)
        return dq, dk, dv


class ReferenceKernels:
    """The same contract in plain torch (any device, any float dtype; math in fp32, or fp64 for fp64
    inputs). Slow and memory-hungry (it forms the score matrix): for tests, CPU process groups
    (gloo) and reading. The forward is stage 0's torch reference; the backward, which takes the
    *global* lse and out, is written here. Pass it as `kernels=` to the fa4.distributed functions."""

    name = "reference"
    needs_cuda = False
    native_head_dims = False  # any head dims

    def forward(self, q, k, v, scale, causal, softcap, window=(None, None)):
        from stage0_reference.torch_reference import attention_ref

        return attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)

    def backward(self, dout, q, k, v, out, lse, dlse, scale, causal, softcap, deterministic, window=(None, None)):
        from stage0_reference.torch_reference import visible_mask
        from stage0_reference.validation import normalize_window

        acc = torch.promote_types(q.dtype, torch.float32)
        group = q.shape[2] // k.shape[2]
        kk, vv = (t.to(acc).repeat_interleave(group, dim=2) for t in (k, v))
        raw = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kk) * scale                    # (B, H, Sq, Sk)
        s = softcap * torch.tanh(raw / softcap) if softcap else raw
        s = s.masked_fill(~visible_mask(q.shape[1], k.shape[1], normalize_window(window, causal), q.device),
                          float("-inf"))
        p = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)                     # global probabilities
        do = dout.to(acc)
        d_row = (do * out.to(acc)).sum(-1).transpose(1, 2)                                # (B, H, Sq)
        if dlse is not None:
            d_row = d_row - dlse.to(acc)
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - d_row.unsqueeze(-1))
        if softcap:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc)) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        b, sk, hkv = k.shape[:3]
        dk = dk.reshape(b, sk, hkv, group, k.shape[-1]).sum(3)  # (-1 cannot be inferred for 0 tokens)
        dv = dv.reshape(b, sk, hkv, group, v.shape[-1]).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
        from stage0_reference.torch_reference import attention_varlen_ref

        return attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal, window_size=window,
                                    softcap=softcap)

    def varlen_backward(self, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, causal, window,
                        softcap, deterministic):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        bounds = list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:]))
        for qa, qb, ka, kb in bounds:
            if qb > qa and kb > ka:
                g = self.backward(dout[None, qa:qb], q[None, qa:qb], k[None, ka:kb], v[None, ka:kb],
                                  out[None, qa:qb], lse[None, :, qa:qb], None if dlse is None else dlse[None, :, qa:qb],
                                  scale, causal, softcap, deterministic, window)
                dq[qa:qb], dk[ka:kb], dv[ka:kb] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv
