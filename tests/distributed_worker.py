"""fa4.distributed on GPUs, one process per GPU (NCCL). Run by tests/test_fa4_distributed.py's gpu
tests, or by hand:

    torchrun --nproc-per-node 2 tests/distributed_worker.py

Every rank builds the same global inputs (seeded), then checks its own rows against

* truth: dense fp32 attention with torch autograd on the whole sequence (the same math on every rank);
* baseline: single-GPU fa4 (fa4.flash_attn_func / flash_attn_varlen_func) on the whole sequence, bf16,
  itself first held to FA4's rule against PyTorch in bf16 (so a world of one, where the ring and the
  baseline are the same computation, still checks the kernels).

FA4's rule, per tensor (out, lse, dq, dk, dv): max |ring - truth| <= 2 max |baseline - truth| + 1e-5.
The deterministic case runs the ring twice and asks for bitwise-equal gradients. Prints one line
per case and rank; exits non-zero on the first failure.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fa4  # noqa: E402
import fa4.distributed as cp  # noqa: E402
from stage0_reference.torch_reference import attention_ref, attention_varlen_ref  # noqa: E402

BF16 = torch.bfloat16


def truth(q, k, v, scale, causal, softcap=0.0, sink=None, docs=None, upcast=True, window=(None, None)):
    """Dense attention with autograd (stage 0's torch reference): (out, lse); docs = global
    cu_seqlens (each document attends within itself). Pass fp32 tensors for an fp32 out; upcast=False
    with bf16 tensors is PyTorch in the input precision (the rule's baseline)."""
    if docs is None:
        return attention_ref(q, k, v, softmax_scale=scale, causal=causal, softcap=softcap, learnable_sink=sink,
                             upcast=upcast, window_size=window)
    cu = docs.to(q.device)
    out, lse = attention_varlen_ref(q[0], k[0], v[0], cu, cu, softmax_scale=scale, causal=causal, upcast=upcast)
    return out[None], lse[None]


def grads_of(fn, leaves, dout, dlse):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out, lse = fn(*leaves)
    ((out.float() * dout).sum() + (lse * dlse).sum()).backward()
    return [out.detach().float(), lse.detach()] + [t.grad.float() for t in leaves]


def check(name, got, base, want, rank):
    names = ("out", "lse", "dq", "dk", "dv", "dsink")
    for n, a, b, w in zip(names, got, base, want):
        err, ref = (a.float() - w).abs().max().item(), (b.float() - w).abs().max().item()
        if not err <= 2 * ref + 1e-5:
            raise AssertionError(f"{name} rank {rank}: {n} error {err:.3e} > 2 x baseline {ref:.3e} + 1e-5")
    print(f"ok {name} rank {rank}: " + ", ".join(
        f"{n} {(a.float() - w).abs().max().item():.2e}/{(b.float() - w).abs().max().item():.2e}"
        for n, a, b, w in zip(names, got, base, want)), flush=True)


def fixed_case(rank, world, s, hq, hkv, d, causal, layout, softcap=0.0, sink=False, window=(None, None)):
    gen = torch.Generator(device="cuda").manual_seed(s + hq + d)
    q, k, v, dout = (torch.randn(1, s, h, d, device="cuda", generator=gen).to(BF16) for h in (hq, hkv, hkv, hq))
    dlse = torch.randn(1, hq, s, device="cuda", generator=gen)
    sink_t = torch.linspace(-1, 1, hq, device="cuda") if sink else None
    leaves = [q, k, v] + ([sink_t] if sink else [])
    scale = d ** -0.5
    kw = dict(causal=causal, softcap=softcap, window_size=window)
    want = grads_of(lambda *t: truth(*t[:3], scale, causal, softcap, t[3] if sink else None, window=window),
                    [t.float() for t in leaves], dout, dlse)
    base = grads_of(lambda *t: fa4.flash_attn_func(*t[:3], return_lse=True, learnable_sink=t[3] if sink else None,
                                                   **kw), leaves, dout, dlse)
    torch_bf16 = grads_of(lambda *t: truth(*t[:3], scale, causal, softcap, t[3] if sink else None, upcast=False,
                                           window=window), leaves, dout, dlse)
    check(f"single-GPU fa4 s={s} h={hq}/{hkv} d={d} causal={causal} softcap={softcap} sink={sink} window={window}",
          base, torch_bf16, want, rank)
    sh = lambda t, dim=1: cp.shard(t, dim=dim, layout=layout)  # noqa: E731
    got = grads_of(lambda *t: cp.ring_attention(*t[:3], layout=layout, return_lse=True,
                                                learnable_sink=t[3] if sink else None, **kw),
                   [sh(t) for t in (q, k, v)] + ([sink_t] if sink else []), sh(dout).float(), sh(dlse, 2))
    if sink:
        dist.all_reduce(got[5])  # each rank's share of the replicated sink's gradient
    rows = [sh(want[0]), sh(want[1], 2)] + [sh(t) for t in want[2:5]] + want[5:]
    base_rows = [sh(base[0]), sh(base[1], 2)] + [sh(t) for t in base[2:5]] + base[5:]
    check(f"s={s} h={hq}/{hkv} d={d} causal={causal} {layout} softcap={softcap} sink={sink} window={window}",
          got, base_rows, rows, rank)


def varlen_case(rank, world, rows, hq, hkv, d, causal, left=None):
    total = rows * world
    gen = torch.Generator(device="cuda").manual_seed(total + d)
    q, k, v, dout = (torch.randn(1, total, h, d, device="cuda", generator=gen).to(BF16) for h in (hq, hkv, hkv, hq))
    cuts = {0, total, 77, 77, rows - 5, rows + 300, total - 1}
    docs = torch.tensor(sorted(c for c in cuts if 0 <= c <= total) + [77], dtype=torch.int32).sort().values
    scale = d ** -0.5
    dlse = torch.randn(1, hq, total, device="cuda", generator=gen)
    if left is not None:
        raise ValueError("the truth here has no window; keep left=None")
    want = grads_of(lambda *t: truth(*t, scale, causal, docs=docs), [q.float(), k.float(), v.float()], dout, dlse)
    cu = docs.cuda()
    base = grads_of(lambda *t: [x.unsqueeze(0) for x in fa4.flash_attn_varlen_func(
        *(x[0] for x in t), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal, return_lse=True)], [q, k, v], dout, dlse)
    torch_bf16 = grads_of(lambda *t: truth(*t, scale, causal, docs=docs, upcast=False), [q, k, v], dout, dlse)
    check(f"single-GPU fa4 varlen docs={docs.tolist()} causal={causal}", base, torch_bf16, want, rank)
    sl = slice(rank * rows, (rank + 1) * rows)
    got = grads_of(lambda *t: [x.unsqueeze(0) for x in cp.ring_attention_varlen(
        *(x[0] for x in t), cu_seqlens=docs, causal=causal, return_lse=True)],
        [t[:, sl] for t in (q, k, v)], dout[:, sl].float(), dlse[:, :, sl])
    mine = lambda g: [g[0][:, sl], g[1][:, :, sl]] + [t[:, sl] for t in g[2:]]  # noqa: E731
    check(f"varlen rows={rows} docs={docs.tolist()} causal={causal}", got, mine(base), mine(want), rank)


def deterministic_case(rank, world):
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, dout = (torch.randn(1, 2048 * world, h, 128, device="cuda", generator=gen).to(BF16) for h in (8, 2, 2, 8))
    runs = []
    for _ in range(3):
        leaves = [cp.shard(t, dim=1).requires_grad_() for t in (q, k, v)]
        out = cp.ring_attention(*leaves, causal=True, deterministic=True)
        out.backward(cp.shard(dout, dim=1))
        runs.append([out] + [t.grad for t in leaves])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b), "deterministic ring: a rerun changed the bits"
    print(f"ok deterministic rank {rank}: 3 runs bitwise equal", flush=True)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        for causal, layout in ((True, "zigzag"), (True, "contiguous"), (False, "zigzag")):
            fixed_case(rank, world, 2048, 8, 2, 128, causal, layout)
        fixed_case(rank, world, 1024 * world, 4, 4, 64, True, "zigzag")
        fixed_case(rank, world, 1024, 8, 1, 96, True, "zigzag", softcap=20.0, sink=True)
        fixed_case(rank, world, 2048, 8, 2, 128, True, "zigzag", window=(300, None))      # a sliding window
        fixed_case(rank, world, 2048, 8, 2, 128, False, "contiguous", window=(700, 200))
        varlen_case(rank, world, 1024, 8, 2, 128, causal=True)
        varlen_case(rank, world, 1024, 8, 2, 128, causal=False)
        deterministic_case(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: all cases passed", flush=True)


if __name__ == "__main__":
    main()
