"""fa4.distributed on CPU: the ring's plan, the lse merge, sharding, and whole runs on the gloo
backend with several processes (the reference kernels stand in for fa4's).

Every multi-process run checks, on each rank, out / lse / dq / dk / dv (and the sink's gradient,
summed over ranks) against dense float64 attention with torch autograd on the whole sequence --
an implementation that shares nothing with the ring (no lse merge, no analytic backward).
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fa4.distributed as cp
from stage0_reference.torch_reference import attention_ref
from fa4.distributed import _plan
from fa4._lse_merge import merge_into, merge_parts
from fa4.distributed._varlen import local_docs

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


# ------------------------------------------------------------------------------ the plan, no processes
@pytest.mark.parametrize("layout", _plan.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_ring_steps_cover_the_causal_mask_exactly_once(world, layout):
    """Every (query, key) pair the global causal mask allows is computed by exactly one rank in
    exactly one step, and no forbidden pair is; under zigzag every rank computes as many pairs."""
    seqlen = 4 * world
    local = seqlen // world
    pos = [_plan.local_positions(r, world, seqlen, layout) for r in range(world)]
    assert sorted(itertools.chain(*pos)) == list(range(seqlen))
    hits = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    per_rank = []
    for rank in range(world):
        pairs = 0
        for src in range(world):
            w = _plan.step_work(rank, src, world, local, True, layout)
            if w is None:
                continue
            qs, ks = pos[rank][w.q_rows], pos[src][w.kv_rows]
            for a, i in enumerate(qs):
                for b, j in enumerate(ks):
                    # a masked step is bottom-right causal on a square block
                    if not w.causal or b <= a + len(ks) - len(qs):
                        hits[i, j] += 1
                        pairs += 1
        per_rank.append(pairs)
    assert torch.equal(hits, torch.ones(seqlen, seqlen, dtype=torch.int64).tril())
    if layout == "zigzag":
        assert len(set(per_rank)) == 1, per_rank
    elif world > 1:
        assert per_rank[-1] > per_rank[0]


def _block_pairs(blk, q_pos, k_pos):
    """The global (query, key) pairs one BlockWork computes, by fa4's bottom-right mask on its rows."""
    rows, cols = q_pos[blk.q_rows], k_pos[blk.kv_rows]
    off = len(cols) - len(rows)
    wl, wr = blk.window
    assert not (blk.causal and wr is not None), "a causal block's right side is the diagonal (None)"
    wr = 0 if blk.causal else wr
    return [(i, j) for a, i in enumerate(rows) for b, j in enumerate(cols)
            if (wl is None or a + off - wl <= b) and (wr is None or b <= a + off + wr)]


def test_band_block_is_the_band():
    """band_block on random placements, sizes and windows: exactly the band's (query, key) pairs, on a
    sub-block whose window sides are >= 0 (what fa4 takes); None exactly when the band misses the block."""
    rng = torch.Generator().manual_seed(4)
    pick = lambda n: int(torch.randint(0, n, (1,), generator=rng))  # noqa: E731
    blocks = 0
    for _ in range(4000):
        lq, lk, qs, ks = 1 + pick(9), 1 + pick(9), pick(31), pick(31)
        left, right = (None if pick(5) == 0 else pick(15) for _ in range(2))
        want = {(qs + r, ks + c) for r in range(lq) for c in range(lk)
                if (left is None or qs + r - left <= ks + c) and (right is None or ks + c <= qs + r + right)}
        blk = _plan.band_block(qs, lq, ks, lk, left, right)
        assert (blk is None) == (not want)
        if blk is not None:
            blocks += 1
            assert all(w is None or w >= 0 for w in blk.window), blk
            assert set(_block_pairs(blk, list(range(qs, qs + lq)), list(range(ks, ks + lk)))) == want
    assert blocks > 1000


@pytest.mark.parametrize("layout", _plan.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_windowed_ring_steps_cover_the_band_exactly_once(world, layout):
    """With a sliding window (causal or not, narrower and wider than a chunk, one-sided), every
    (query, key) pair of the global band is computed by exactly one block of one step of one rank,
    and nothing else is."""
    seqlen = 8 * world
    local = seqlen // world
    pos = [_plan.local_positions(r, world, seqlen, layout) for r in range(world)]
    for causal, window in ((True, (3, None)), (True, (9, None)), (True, (0, None)), (False, (2, 5)),
                           (False, (None, 4)), (False, (11, 0)), (False, (6, None))):
        hits = torch.zeros(seqlen, seqlen, dtype=torch.int64)
        for rank in range(world):
            for src in range(world):
                for blk in _plan.step_blocks(rank, src, world, local, causal, layout, window):
                    for i, j in _block_pairs(blk, pos[rank], pos[src]):
                        hits[i, j] += 1
        i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
        left, right = window[0], 0 if causal else window[1]
        band = torch.ones(seqlen, seqlen, dtype=torch.bool)
        if left is not None:
            band &= j >= i - left
        if right is not None:
            band &= j <= i + right
        assert torch.equal(hits, band.to(torch.int64)), (causal, window)


def test_merge_of_blocks_is_the_softmax_of_their_union():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 5, 12, dtype=torch.float64)          # (B, H, Sq, Sk)
    v = torch.randn(2, 12, 3, 4, dtype=torch.float64)
    s[0, 0, 1] = float("-inf")                                 # a row no block sees
    s[1, 2, 3, :6] = float("-inf")                             # a row the first block does not see
    out = torch.zeros(2, 5, 3, 4, dtype=torch.float64)                 # (B, S, H, Dv)
    lse = torch.full((2, 5, 3), float("-inf"), dtype=torch.float64)    # (B, S, H)
    parts = []
    for cols in (slice(0, 6), slice(6, 9), slice(9, 12)):
        blk = s[..., cols]
        l = torch.logsumexp(blk, -1).transpose(1, 2)                   # (B, S, H)
        p = torch.exp(blk - l.transpose(1, 2).unsqueeze(-1)).nan_to_num(0.0)
        parts.append((torch.einsum("bhqk,bkhd->bqhd", p, v[:, cols]), l))
        merge_into(out, lse, *parts[-1])
    all_out, all_lse = merge_parts(torch.stack([o for o, _ in parts], 1), torch.stack([l for _, l in parts], 1), 1)
    want_lse = torch.logsumexp(s, -1).transpose(1, 2)
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v)
    for got_out, got_lse in ((out, lse), (all_out, all_lse)):
        assert torch.equal(got_lse.isinf(), want_lse.isinf()) and not got_out.isnan().any()
        torch.testing.assert_close(got_lse[~got_lse.isinf()], want_lse[~want_lse.isinf()], rtol=0, atol=1e-12)
        torch.testing.assert_close(got_out, want, rtol=0, atol=1e-12)


def test_local_docs_cut_documents_at_rank_boundaries():
    bounds = [0, 3, 3, 10, 16]     # docs of 3, 0, 7, 6 tokens over 2 ranks of 8
    d = local_docs(bounds, 8, 16, causal=True, left=None, device="cpu")
    assert d.cu_q.tolist() == [0, 2, 8] and d.cu_k.tolist() == [0, 7, 13]
    assert d.kv_index.tolist() == list(range(3, 10)) + list(range(10, 16))
    d = local_docs(bounds, 0, 8, causal=False, left=None, device="cpu")
    assert d.cu_q.tolist() == [0, 3, 8] and d.cu_k.tolist() == [0, 3, 10] and (d.max_q, d.max_k) == (5, 7)
    d = local_docs(bounds, 8, 16, causal=True, left=2, device="cpu")
    assert d.kv_index.tolist() == [6, 7, 8, 9] + list(range(10, 16))


def test_errors_before_any_process_group():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^group: torch.distributed is not initialised"):
        cp.ring_attention(q, q, q, kernels=cp.ReferenceKernels())


# ------------------------------------------------------------------------------ dense autograd truth
def dense(q, k, v, scale, causal=False, softcap=0.0, sink=None, left=None, window=None):
    """(B, S, H, D) attention with torch autograd over the whole sequence (stage 0's torch reference,
    float64 in, float64 out): (out, lse). window (left, right) replaces `left` when given."""
    return attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=window or (left, None),
                         softcap=softcap, learnable_sink=sink)


def _inputs(b, s, hq, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _fixed_case(rank, world, layout, causal, softcap=0.0, sink=False, gqa=True, lse_grad=True, window=(None, None)):
    b, s, hq, hkv, d = 2, 8 * world, 4, (2 if gqa else 4), 16
    q, k, v, dout = _inputs(b, s, hq, hkv, d, seed=world * 100 + 7)
    sink_t = torch.linspace(-1.0, 1.0, hq, dtype=torch.float64) if sink else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink_t.clone().requires_grad_()] if sink else [])
    out, lse = dense(*leaves[:3], 0.3, causal, softcap, leaves[3] if sink else None, window=window)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ((out * dout).sum() + ((lse * dlse).sum() if lse_grad else 0)).backward()
    want = [out, lse] + [t.grad for t in leaves]

    mine = [cp.shard(t, dim=1, layout=layout).requires_grad_() for t in (q, k, v)]
    sink_mine = sink_t.clone().requires_grad_() if sink else None
    o, l = cp.ring_attention(*mine, causal=causal, softmax_scale=0.3, layout=layout, softcap=softcap,
                             learnable_sink=sink_mine, return_lse=True, kernels=cp.ReferenceKernels(),
                             window_size=window)
    loss = (o * cp.shard(dout, dim=1, layout=layout)).sum()
    if lse_grad:
        loss = loss + (l * cp.shard(dlse, dim=2, layout=layout)).sum()
    loss.backward()
    what = f"rank {rank}/{world} {layout} causal={causal} softcap={softcap} sink={sink} window={window}"
    close = lambda a, b, n: torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what} {n}: {m}")  # noqa: E731,E501
    close(o, cp.shard(want[0], dim=1, layout=layout), "out")
    close(l, cp.shard(want[1], dim=2, layout=layout), "lse")
    for t, w, n in zip(mine, want[2:5], ("dq", "dk", "dv")):
        close(t.grad, cp.shard(w, dim=1, layout=layout), n)
    if sink:
        total = sink_mine.grad.clone()
        dist.all_reduce(total)
        close(total, want[5], "dsink (summed over ranks)")
    close(cp.unshard(o.detach(), dim=1, layout=layout), want[0].detach(), "unshard(out)")


def _deterministic_case(rank, world):
    q, k, v, dout = _inputs(1, 8 * world, 4, 2, 16, seed=3)
    runs = []
    for _ in range(2):
        mine = [cp.shard(t, dim=1).to(torch.float32).requires_grad_() for t in (q, k, v)]
        o = cp.ring_attention(*mine, causal=True, deterministic=True, kernels=cp.ReferenceKernels())
        (o * cp.shard(dout, dim=1).float()).sum().backward()
        runs.append([o.detach()] + [t.grad for t in mine])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _varlen_case(rank, world, causal, left):
    rows = 12
    total = rows * world
    cuts = sorted({0, total, 5, 9, 17, total - 1} & set(range(total + 1)))  # [9, 17) and [17, T-1) cross ranks
    bounds = torch.tensor(sorted(cuts + [5]), dtype=torch.int32)  # 5 twice: an empty document
    q, k, v, dout = [t[0] for t in _inputs(1, total, 4, 2, 16, seed=11)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for a, b in zip(bounds.tolist()[:-1], bounds.tolist()[1:]):
        if b > a:
            o, l = dense(*(t[None, a:b] for t in leaves), 0.25, causal, left=left)
            outs.append(o[0])
            lses.append(l[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    sl = slice(rank * rows, (rank + 1) * rows)
    mine = [t[sl].clone().requires_grad_() for t in (q, k, v)]
    o, l = cp.ring_attention_varlen(*mine, cu_seqlens=bounds, causal=causal, softmax_scale=0.25,
                                    window_size=(left, 0 if causal else None), return_lse=True,
                                    kernels=cp.ReferenceKernels())
    ((o * dout[sl]).sum() + (l * dlse[:, sl]).sum()).backward()
    what = f"varlen rank {rank}/{world} causal={causal} left={left}"
    for got, want, n in ((o, out[sl], "out"), (l, lse[:, sl], "lse"), (mine[0].grad, leaves[0].grad[sl], "dq"),
                         (mine[1].grad, leaves[1].grad[sl], "dk"), (mine[2].grad, leaves[2].grad[sl], "dv")):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what} {n}: {m}")


class _FailingKernels(cp.ReferenceKernels):
    """The reference kernels, failing in the forward of the first ring step (after its shift is posted)."""

    def forward(self, *args, **kw):
        raise RuntimeError("a step that fails on every rank")


def _failed_step_case(rank, world):
    """A step that raises on every rank leaves no send / receive posted: the next call goes through
    (before, gloo timed out waiting for the abandoned exchange)."""
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 8, seed=11)
    mine = [cp.shard(t, dim=1) for t in (q, k, v)]
    try:
        cp.ring_attention(*mine, causal=True, kernels=_FailingKernels())
        raise AssertionError("the failing kernels did not fail")
    except RuntimeError as e:
        assert "fails on every rank" in str(e), e
    out = cp.ring_attention(*mine, causal=True, kernels=cp.ReferenceKernels())
    want = dense(q, k, v, q.shape[-1] ** -0.5, causal=True)[0]
    torch.testing.assert_close(out, cp.shard(want, dim=1), rtol=1e-9, atol=1e-9)


def _worker(rank, world, init_file, quick):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails the test instead
    try:
        if world > 1:
            _failed_step_case(rank, world)
        for layout in _plan.LAYOUTS:
            _fixed_case(rank, world, layout, causal=True)
            _fixed_case(rank, world, layout, causal=False, gqa=False, lse_grad=False)
        if not quick:
            _fixed_case(rank, world, "zigzag", causal=True, softcap=0.7, sink=True)
            for layout in _plan.LAYOUTS:  # sliding windows: narrower and wider than a chunk (4 tokens)
                _fixed_case(rank, world, layout, causal=True, window=(5, None))
                _fixed_case(rank, world, layout, causal=False, window=(3, 6), sink=True)
            _deterministic_case(rank, world)
            for causal, left in ((True, None), (False, None), (True, 3)):
                _varlen_case(rank, world, causal, left)
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_on_gloo_matches_dense_autograd(world):
    """Whole runs in `world` processes: forward, lse, backward with an lse gradient, GQA, both
    layouts, causal and not; softcap + sink, sliding windows in both layouts (causal, and two-sided
    with a sink), deterministic reruns and packed documents crossing ranks (with an empty one, and a
    sliding window) at 1, 2 and 4 processes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), world == 3), nprocs=world, join=True)


@contextlib.contextmanager
def _group_of_one():
    """This process as a gloo world of one, torn down after the block."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_argument_errors_in_a_group_of_one():
    with _group_of_one():
        q = torch.zeros(1, 6, 2, 8)
        ref = cp.ReferenceKernels()
        with pytest.raises(ValueError, match=r"^q: fa4 runs on CUDA GPUs only"):
            cp.ring_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
        with pytest.raises(ValueError, match=r"^layout: expected one of"):
            cp.ring_attention(q, q, q, layout="striped", kernels=ref)
        odd = q[:, :5]
        with pytest.raises(ValueError, match=r"^q: the local sequence length 5 must be a multiple of 2"):
            cp.ring_attention(odd, odd, odd, causal=True, kernels=ref)
        cp.ring_attention(odd, odd, odd, causal=True, layout="contiguous", kernels=ref)
        with pytest.raises(ValueError, match=r"^k: holds 4 tokens but q holds 6"):
            cp.ring_attention(q, q[:, :4], q[:, :4], kernels=ref)
        with pytest.raises(TypeError, match=r"^kernels: expected"):
            cp.ring_attention(q, q, q, kernels="fast")
        with pytest.raises(ValueError, match=r"^x: the global sequence length 5 must be a multiple of 2"):
            cp.shard(odd, dim=1)
        with pytest.raises(ValueError, match=r"^window_size: only a causal window .* got \(2, 3\)"):
            cp.ring_attention_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 6]), window_size=(2, 3),
                                     kernels=ref)
        with pytest.raises(ValueError, match=r"^cu_seqlens: must rise from 0 to the global token count 6"):
            cp.ring_attention_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 5]), kernels=ref)
        with pytest.raises(ValueError, match=r"^window_size: only a causal window"):
            cp.ring_attention_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 6]), window_size=(2, None),
                                     kernels=ref)
        with pytest.raises(TypeError, match=r"^cu_seqlens: expected int32 or int64"):
            cp.ring_attention_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0.0, 6.0]), kernels=ref)
        _padding_of_native_kernels(ref)
        with pytest.raises(ValueError, match=r"^x: the local sequence length 3 must be a multiple of 2"):
            cp.unshard(q[:, :3], dim=1)
        with pytest.raises(ValueError, match=r"^softcap: must be finite and >= 0"):
            cp.ring_attention(q, q, q, softcap=float("nan"), kernels=ref)
        with pytest.raises(ValueError, match=r"^window_size: left must be >= 0, -1 or None"):
            cp.ring_attention(q, q, q, window_size=(-3, None), kernels=ref)
        with pytest.raises(ValueError, match=r"^window_size: causal=True means a right window of 0"):
            cp.ring_attention(q, q, q, causal=True, window_size=(2, 5), kernels=ref)
        with pytest.raises(ValueError, match=r"^k: heads_kv \(3\) must divide"):
            cp.ring_attention(q, torch.zeros(1, 6, 3, 8), torch.zeros(1, 6, 3, 8), kernels=ref)
        assert cp.positions(8, layout="zigzag").tolist() == list(range(8))


def test_more_argument_errors_before_any_communication(monkeypatch):
    """What a review found accepted (a wrong result, an error naming nothing, or a failure after the
    ring's first exchange): each is a ValueError / TypeError naming the argument, before communicating."""
    from fa4.distributed import _checks

    with _group_of_one():
        try:
            q = torch.zeros(1, 6, 2, 8)
            ref = cp.ReferenceKernels()
            with pytest.raises(ValueError, match=r"^v: holds \(1, 8\) \(batch, tokens\) but k holds \(1, 6\)"):
                cp.ring_attention(q, q, torch.zeros(1, 8, 2, 8), kernels=ref)
            with pytest.raises(ValueError, match=r"^k: head_dim 4 differs from q's head_dim 8"):
                cp.ring_attention(q, torch.zeros(1, 6, 2, 4), torch.zeros(1, 6, 2, 4), kernels=ref)
            with pytest.raises(TypeError, match=r"^q: expected a floating dtype"):
                cp.ring_attention(q.long(), q.long(), q.long(), kernels=ref)
            meta = torch.empty(1, 6, 2, 64, device="meta", dtype=torch.bfloat16)
            with pytest.raises(ValueError, match=r"^q: meta tensors cannot be sent around the ring"):
                cp.ring_attention(meta, meta, meta)
            with pytest.raises(TypeError, match=r"^group: expected a torch.distributed ProcessGroup"):
                cp.ring_attention(q, q, q, group="x", kernels=ref)
            with pytest.raises(ValueError, match=r"^cu_seqlens: expected documents \+ 1 >= 2 offsets, got 0"):
                cp.ring_attention_varlen(q[0], q[0], q[0], cu_seqlens=torch.zeros(0, dtype=torch.int32), kernels=ref)
            with pytest.raises(TypeError, match=r"^seqlen: expected an int"):
                cp.positions(True, layout="contiguous")
            with pytest.raises(ValueError, match=r"^seqlen: expected an int >= 0"):
                cp.positions(-4)
            with pytest.raises(TypeError, match=r"^dim: expected an int"):
                cp.unshard(q, dim=True)
            with pytest.raises(ValueError, match=r"^dim: 7 is out of range for x of shape"):
                cp.shard(q, dim=7)
            with pytest.raises(TypeError, match=r"^kernels: expected .* got the class ReferenceKernels"):
                cp.ring_attention(q, q, q, kernels=cp.ReferenceKernels)
            with pytest.raises(ValueError, match=r"^q: meta tensors cannot be sent around the ring"):
                cp.ring_attention_varlen(meta[0], meta[0], meta[0], cu_seqlens=torch.tensor([0, 6]), kernels=ref)
            with pytest.raises(ValueError, match=r"^group: this process \(global rank 0\) is not a member"):
                cp.ring_attention(q, q, q, group=dist.GroupMember.NON_GROUP_MEMBER, kernels=ref)
            for empty in (torch.zeros(1, 0, 2, 8), torch.zeros(0, 6, 2, 8)):  # no tokens, no batch
                leaves = [empty.clone().requires_grad_() for _ in range(3)]
                cp.ring_attention(*leaves, causal=True, kernels=ref).sum().backward()
                assert all(t.grad is not None and t.grad.shape == empty.shape for t in leaves)
            group = dist.new_group([0])
            monkeypatch.setattr(_checks.dist, "get_rank", lambda group=None: -1 if group is not None else 0)
            with pytest.raises(ValueError, match=r"^group: this process \(global rank 0\) is not a member"):
                cp.ring_attention(q, q, q, group=group, kernels=ref)
        finally:
            monkeypatch.undo()


class _NativeReference(cp.ReferenceKernels):
    """The reference kernels declaring fa4's native head dims, recording what they are handed."""

    native_head_dims = True

    def __init__(self):
        self.dims = []

    def forward(self, q, k, v, *args, **kw):
        self.dims.append((q.shape[-1], v.shape[-1]))
        return super().forward(q, k, v, *args, **kw)


def _padding_of_native_kernels(ref):
    """Kernels with native head dims get (16, 24) zero-padded onto (64, 64) (ring and varlen); the out
    and the gradients are the unpadded reference's."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 6, 2, d, generator=g, dtype=torch.float64) for d in (16, 16, 24))
    native = _NativeReference()
    for call in (lambda qq, kk, vv, kern: cp.ring_attention(qq, kk, vv, causal=True, kernels=kern),
                 lambda qq, kk, vv, kern: cp.ring_attention_varlen(qq[0], kk[0], vv[0], cu_seqlens=torch.tensor([0, 6]),
                                                                   causal=True, kernels=kern)):
        outs = []
        for kern in (native, ref):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = call(*leaves, kern)
            outs.append((out, *torch.autograd.grad(out.sum(), leaves)))
        for a, b in zip(*outs):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert native.dims and all(d == (64, 64) for d in native.dims)
