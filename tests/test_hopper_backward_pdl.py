"""The Hopper backward's three kernels as programmatic dependent launches (PDL): the preprocess, the main
kernel and the dQ postprocess each launch with the programmatic-serialization attribute, so a kernel's
CTAs may start while the kernel before it still runs. Each then waits (griddepcontrol.wait, SASS
ACQBULK) before it reads what that kernel writes: the preprocess before out / dout / lse, the main
kernel's producer after its K, V and Q loads but before lse2 and D, its dQ writer and its consumers
before their first global access, a CTA without keys before it exits (so the main grid never ends before
the preprocess), the postprocess before the accumulator. The preprocess and the main
kernel signal their dependents (griddepcontrol.launch_dependents, SASS PREEXIT).

compile tier (sm_90a, fake tensors): those waits and signals are in the SASS, the producer's in front
of its first lse2 load.

gpu tier: backwards back to back inside a CUDA graph -- the shapes where the kernels overlap most, each
step's dout written by a torch kernel just before it -- give the eager calls' dk and dv bit for bit and
their dq up to the order of the dQ adds (bit for bit in deterministic mode); a main kernel that read the
previous step's lse2 / D, or a postprocess that read an unfinished accumulator, would not.
"""
from __future__ import annotations

import re

import pytest
import test_stage4_hopper as s4  # the ladder's test helpers

pytestmark = pytest.mark.stage4

WAIT, SIGNAL = r"\bACQBULK\b", r"\bPREEXIT\b"


def _first(pattern: str, sass: str) -> int:
    m = re.search(pattern, sass)
    assert m is not None, f"no {pattern} in the SASS"
    return m.start()


# ======================================================================================== compile tier
@pytest.mark.compile
def test_the_preprocess_waits_then_signals_before_its_loads():
    pre = s4._step("preprocess")
    sass = pre.compile_only("bf16", 128).sass
    assert len(re.findall(WAIT, sass)) == 1 and len(re.findall(SIGNAL, sass)) == 1
    assert _first(WAIT, sass) < _first(SIGNAL, sass) < _first(r"\bLDG\b", sass)


@pytest.mark.compile
def test_both_postprocesses_wait_before_reading_the_accumulator():
    post, post_frag, common = s4._step("postprocess"), s4._step("postprocess_frag"), s4._step("common")
    main = s4._step("hopper.backward").make_kernel(common.cutlass_dtype("bf16"), 128, 128, True, False)
    for sass in (post.compile_only("bf16", 128).sass, post_frag.compile_only(main).sass):
        assert len(re.findall(WAIT, sass)) == 1 and not re.search(SIGNAL, sass)
        assert _first(WAIT, sass) < _first(r"\bLDG\b", sass)


# (head dims, causal, deterministic, persistent, waits): the producer, the consumers, the dQ writer where it
# has one, a CTA without keys (one CTA per tile), and a persistent producer's wait before each tile hand-out
# (its counter is zeroed by the preprocess)
MAIN_BUILDS = [((128, 128), True, False, False, 4), ((64, 64), False, False, False, 4),
               ((128, 128), True, True, False, 4), ((192, 128), True, False, False, 4),
               ((256, 256), False, False, False, 3), ((128, 128), True, False, True, 4)]


@pytest.mark.compile
@pytest.mark.parametrize("dims,causal,det,persistent,waits", MAIN_BUILDS,
                         ids=[f"d{d}x{dv}-{'causal' if c else 'full'}{'-det' if det else ''}"
                              f"{'-persistent' if p else ''}" for (d, dv), c, det, p, _ in MAIN_BUILDS])
def test_every_role_of_the_main_kernel_waits_and_the_producer_before_lse2(dims, causal, det, persistent, waits):
    """256 adds dQ from the consumers' registers: no writer warp, one wait fewer. lse2 and D are the
    only 3-D TMA loads (a (rows, head, batch) box); Q, dO, K and V are 4-D."""
    d, dv = dims
    extra = {"persistent": True} if persistent else {}
    comp = s4._step("hopper.backward").compile_only(head_dim=d, head_dim_v=dv, causal=causal, deterministic=det,
                                                    **extra)
    sass = comp.sass
    assert comp.report["spill_stores"] == 0
    assert len(re.findall(SIGNAL, sass)) == 1 and len(re.findall(WAIT, sass)) == waits
    first_input = _first(r"\bUTMALDG\.4D\b", sass)
    assert first_input < _first(WAIT, sass) < _first(r"\bUTMALDG\.3D\b", sass), \
        "the producer issues an input load, then waits, then loads lse2"


# ======================================================================================== gpu tier
# (b, sq, sk, hq, hkv, d, dv, causal, deterministic): short calls (a persistent build at 1 x 512), GQA,
# deterministic mode, the wide tiles
GRAPH_CASES = [
    (1, 512, 512, 16, 16, 128, 128, True, False),
    (4, 512, 512, 32, 8, 64, 64, True, False),
    (2, 700, 517, 4, 2, 128, 128, True, True),
    (2, 333, 1000, 4, 4, 192, 128, True, False),
    (1, 600, 600, 2, 2, 256, 256, False, False),
    (3, 113, 203, 6, 1, 128, 128, False, False),
]
STEPS = 3


def _graph_case_id(c):
    b, sq, sk, hq, hkv, d, dv, causal, det = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}x{dv}-{'causal' if causal else 'full'}{'-det' if det else ''}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRAPH_CASES, ids=[_graph_case_id(c) for c in GRAPH_CASES])
def test_backwards_back_to_back_in_a_graph_match_eager_calls(case):
    import torch

    b, sq, sk, hq, hkv, d, dv, causal, det = case
    mod = s4._step("hopper.backward")
    q, k, v, do = s4._inputs(b, sq, sk, hq, hkv, d, dv, seed=sq * 7 + sk)
    out = torch.randn_like(do)
    lse = torch.randn(b, hq, sq, device="cuda", dtype=torch.float32) + 4.0
    scales = [1.0, -2.5, 0.375][:STEPS]
    dout = torch.empty_like(do)

    def steps():
        grads = []
        for s in scales:
            torch.mul(do, s, out=dout)  # a torch kernel writes dout right before the preprocess reads it
            grads.append([g.clone() for g in mod.attention_backward(q, k, v, out, dout, lse, causal=causal,
                                                                     deterministic=det)])
        return grads

    eager = []
    for s in scales:
        torch.mul(do, s, out=dout)
        eager.append(mod.attention_backward(q, k, v, out, dout, lse, causal=causal, deterministic=det))
        torch.cuda.synchronize()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        steps()  # compiles, and warms the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = steps()
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, ((dq, dk, dv_), (eq, ek, ev)) in enumerate(zip(captured, eager)):
            where = f"replay {replay}, step {i}"
            assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv_).all(), where
            assert torch.equal(dk, ek) and torch.equal(dv_, ev), f"{where}: dk / dv differ from the eager call"
            if det:
                assert torch.equal(dq, eq), f"{where}: deterministic dq differs from the eager call"
            else:  # the same sums in another order: a few bf16 units in the last place of the largest value
                tol = eq.float().abs().max().item() * 2.0 ** -6
                assert (dq.float() - eq.float()).abs().max().item() <= tol, f"{where}: dq differs from the eager call"


@pytest.mark.cpu
@pytest.mark.parametrize("shapes", [((2, 3, 5), (1, 1, 132)), ((1, 1, 0), (1, 1, 7)), ((1, 4, 3),)])
def test_zeroed_words_carve_one_buffer_the_preprocess_clears(shapes):
    """A persistent first-store build's arrival counters and tile counter share one buffer, so the
    preprocess's one flat pass zeroes both and no fill kernel runs between it and the main kernel."""
    import math

    import torch
    from stage4_bwd_kernel import host

    *views, flat = host.zeroed_words("cpu", *shapes)
    assert flat.dtype == torch.float32 and flat.numel() % 4 == 0
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    base = flat.data_ptr()
    for v in views:
        assert v.dtype == torch.int32 and v.is_contiguous() and (v.data_ptr() - base) % 16 == 0
        assert v.data_ptr() + v.numel() * 4 <= base + flat.numel() * 4
    flat.fill_(-1.0)
    for i, v in enumerate(views):  # disjoint: writing one leaves the others alone
        v.fill_(i + 1)
    assert all(v.eq(i + 1).all() for i, v in enumerate(views))
    assert sum(v.numel() for v in views) <= flat.numel() <= sum(math.ceil(max(v.numel(), 1) / 4) * 4 for v in views)
    flat.fill_(0.0)
    assert all(v.eq(0).all() for v in views)  # 0.0 and int 0 are the same bits
