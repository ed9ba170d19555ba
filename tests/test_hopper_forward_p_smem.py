"""The Hopper forward's 192-row tile at head dim 96 (`tile_m=192`): P V reads P from each consumer's
shared-memory slab, since 160 registers a thread hold S and O there but not P too
(`stage3_fwd_kernel/hopper/config.py: p_through_smem`), with 144-key tiles where it walks one CTA per tile
without a window or softcap (`default_tile_n`; causal ones in the grid's order). The default of d = 96
calls without a window, softcap or cache that are not causal, or causal with >= 8192 keys and no sink; the
others keep 128 rows unless asked.

compile tier (sm_90a): every P V wgmma takes both operands by descriptor (V transposed), the hot loop
publishes P with 36 four-byte stores a thread (144 keys), the async-proxy fence and a barrier, without
spills but the causal build's 8 bytes outside the key-block loop (the other compile checks of these
builds: test_hopper_forward.py's COMPILE_CASES).

gpu tier (H100/H200): out and lse under FA4's rule on the shapes of the d = 64 tile tests, causal or
not, GQA 1 / 2 / 8, fp16 once, one CTA per tile and (the big case) several tiles per persistent CTA on
128-key tiles, a varlen batch with an empty sequence on poisoned outputs, a learnable sink, and long
causal calls on the default tile through fa4.
"""
from __future__ import annotations

import pytest
import test_hopper_forward as hf  # the forward tests' helpers and compile cases (tests/ is on the path)

P_SMEM_CASES = [c for c in hf.COMPILE_CASES if c[7] == 192 and c[1] > 64]


@pytest.mark.cpu
@pytest.mark.stage3
def test_where_p_goes_through_shared_memory():
    """Only 192 rows above d = 64 (up to 96) take it, with 144-key tiles one CTA per tile without a window
    or softcap outside a cache (persistent, softcap, paged and key-split builds keep 128); 32 / 160
    registers; the default for non-causal calls without a window and causal ones of >= 8192 keys, walked
    one CTA per tile (O through Q's buffer)."""
    from stage3_fwd_kernel.components.window import Window
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    import cutlass

    mod = hf._mod()
    assert [mod.p_through_smem(tm, d, d) for tm, d in ((192, 96), (192, 64), (128, 96))] == [True, False, False]
    k96 = mod.make_kernel(cutlass.BFloat16, 96, 96, False, tile_m=192)
    assert k96.p_smem and (k96.regs_producer, k96.regs_consumer) == (32, 160)
    assert not mod.make_kernel(cutlass.BFloat16, 64, 64, False, tile_m=192).p_smem
    assert not getattr(mod._resolve_scheduler(None, None, 96, 96, True, seqlen_k=1024, tile_m=192), "persistent", False)
    assert getattr(mod._resolve_scheduler(None, None, 64, 64, True, seqlen_k=1024, tile_m=192), "persistent", False)
    walks = [getattr(mod._resolve_scheduler(None, None, 96, 96, False, seqlen_k=8192, tile_m=tm), "persistent", False)
             for tm in (192, 128)]
    assert walks == [False, True]
    narrow = [mod.make_kernel(cutlass.BFloat16, 96, 96, False, tile_m=192, **kw).tile_n
              for kw in (dict(page_size=16), dict(key_split=True), dict(scheduler=PersistentScheduler()))]
    narrow += [mod.FlashAttentionForwardSm90(cutlass.BFloat16, 96, 96, False, tile_m=192, softcap=30.0).tile_n]
    assert k96.tile_n == 144 and narrow == [128] * 4
    assert mod.make_kernel(cutlass.BFloat16, 96, 96, True, tile_m=192).tile_n == 144   # a causal mask fits
    from fa4 import _dispatch   # ... in the grid's order: an LPT order's causal build spills in its loop

    lpt = _dispatch.causal_forward_scheduler.__wrapped__("sm_90", True, 4096, 96, 96, 16, 16)
    assert lpt is not None and mod.make_kernel(cutlass.BFloat16, 96, 96, True, tile_m=192, scheduler=lpt).tile_n == 128
    # a sink changes only the denominator: its default d = 96 kernel is the 192 x 144 one
    sink = mod.make_kernel(cutlass.BFloat16, 96, 96, False, variant=mod.host.Variant(sink=True))
    assert (sink.tile_m, sink.tile_n) == (192, 144)
    assert [mod.default_tile_m(96, 96, causal) for causal in (False, True)] == [192, 128]
    assert mod.default_tile_m(96, 96, True, seqlen_k=8192) == 192   # long causal calls (config.D96_CAUSAL_...)
    assert mod.default_tile_m(96, 96, False, Window(512, 512)) == mod.default_tile_m(128, 128) == 128


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("build", [dict(split_tail=True, persistent=True),
                                   dict(page_size=16, varlen=True, seqused_k=True),
                                   dict(key_split=True, batch_map=True), dict(learnable_sink=True),
                                   dict(learnable_sink=True, varlen=True, seqused_k=True)],
                         ids=["split-tail", "paged16", "key-split", "sink", "sink-varlen"])
def test_p_through_shared_memory_in_the_other_builds(build):
    """The split tail (its epilogue), paged K / V (its producer) and the key split (both) leave the main
    loop as it is, so P goes through shared memory there too: no spills, no serialized wgmma, and every
    P V wgmma reads both operands by descriptor."""
    import re

    comp = hf._mod().compile_only("bf16", 96, 96, False, tile_m=192, **build)
    rep = comp.report
    assert rep["spill_stores"] == rep["spill_loads"] == 0 and not rep["wgmma_serialized"], rep["ptxas_log"]
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n96k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*([^;]*);", comp.ptx)
    assert pv and all(ops.strip().endswith("p, 1, 1, 0, 1") and not ops.lstrip().startswith("{") for ops in pv)


def _compiled(case):
    dt, d, dv, causal, flags, tau, frac, tile_m = case
    return hf._mod().compile_only(dt, d, dv, causal, varlen="varlen" in flags, seqused_k="seqused_k" in flags,
                                  batch_map="batch_map" in flags, rescale_threshold=tau, emulation_fraction=frac,
                                  tile_m=tile_m)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", P_SMEM_CASES, ids=[hf._case_id(c) for c in P_SMEM_CASES])
def test_p_through_shared_memory_sm90a(case):
    """192 rows at d = 96: every P V wgmma (m64n96k16) reads both operands from shared memory (two
    descriptors, V transposed: "p, 1, 1, 0, 1"), none from registers; each warpgroup stores its P
    slab (64 x 144) once per key block before its barrier, within 160 registers and no spill (the
    causal build: 8 bytes outside the key-block loop, 12 varlen, none in it)."""
    import re

    comp = _compiled(case)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n96k16\.f32\.(?:bf16|f16)\.(?:bf16|f16)\s+\{[^}]*\},\s*([^;]*);",
                    comp.ptx)
    assert pv and all(re.fullmatch(r"%rd\d+,\s*%rd\d+,\s*p,\s*1,\s*1,\s*0,\s*1", ops.strip()) for ops in pv), pv[:3]
    rep = comp.report
    hf._check_spills(case, comp)
    assert not rep["wgmma_serialized"]
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", comp.sass)) + 1 <= 160
    # the hot loop publishes P: 36 four-byte stores a thread (64 x 144 x 2 B over 128 threads), then
    # the async-proxy fence and a barrier before the next P V reads the slab
    from stage3_fwd_kernel.sass_report import key_block_loop

    hot = key_block_loop(comp.sass)
    dt, d, dv, causal, *_ = case
    tn = hf._key_tile(d, dv, causal, 192)
    assert sum(o.startswith("STS") for o in hot) == 64 * tn * 2 // 512
    tail = hot[max(i for i, o in enumerate(hot) if o.startswith("STS")):]
    fence = tail.index("FENCE.VIEW.ASYNC.S")
    assert any(o.startswith("BAR.SYNC") for o in tail[fence:]), tail



@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", hf.TILE_M_SEQLENS, ids=[f"{a}x{b}" for a, b in hf.TILE_M_SEQLENS])
def test_d96_192_rows_p_through_smem_matches_reference(causal, sq, sk):
    """tile_m = 192 at d = 96: P V reads P from each warpgroup's shared-memory slab (config.p_through_smem).
    One CTA per tile (144 keys); in the big case also persistent CTAs on 128-key
    tiles, several tiles each (the slab reused across tiles); fp16 once and a varlen batch with an empty
    sequence."""
    big = sq * sk > 2_000_000
    # the big case: 4 x 16 heads of 22 tiles
    batch, heads = (4, 16) if big else (3, 8)
    ratio = 2 if big else [1, 2, 8][(sq + sk) % 3]
    q, k, v = hf._randn_qkv(batch, sq, sk, heads, heads // ratio, 96, 96, seed=sq + sk + 96,
                         dtype="fp16" if sq == 799 else "bf16")
    hf._dense(q, k, v, causal=causal, tile_m=192)
    if big:
        hf._dense(q, k, v, causal=causal, tile_m=192, persistent=True)
    if sq * sk >= 1024 * 1024:  # a varlen batch: a long sequence, an empty one, a short one
        import torch

        from stage0_reference.torch_reference import assert_fa4_close, attention_ref

        lens = [sq, 0, 77]
        g = torch.Generator(device="cuda").manual_seed(sq + 961)
        qp, kp, vp = (torch.randn(sum(lens), h, 96, device="cuda", dtype=torch.bfloat16, generator=g)
                      for h in (8, 4, 4))
        cu = torch.tensor([0, lens[0], lens[0], sum(lens)], dtype=torch.int32, device="cuda")
        out = torch.full_like(qp, float("nan"))
        lse = torch.full((8, sum(lens)), float("nan"), device="cuda", dtype=torch.float32)
        hf._mod().attention_varlen_forward(qp, kp, vp, cu, cu, max(lens), max(lens), causal=causal, tile_m=192,
                                        out=out, lse=lse)
        torch.cuda.synchronize()
        for b0, b1 in ((0, lens[0]), (lens[0], sum(lens))):
            args = (qp[None, b0:b1], kp[None, b0:b1], vp[None, b0:b1])
            ref, base = attention_ref(*args, causal=causal), attention_ref(*args, causal=causal, upcast=False)
            assert_fa4_close(f"varlen out [{b0}, {b1})", out[None, b0:b1], ref[0], base[0])
            assert_fa4_close(f"varlen lse [{b0}, {b1})", lse[None, :, b0:b1], ref[1], base[1])


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("sq,sk,hq,hkv", [(113, 203, 4, 2), (1023, 1024, 6, 2)], ids=["113x203", "1023x1024"])
def test_learnable_sink_on_the_d96_default_tile(sq, sk, hq, hkv):
    """A sink changes only the softmax's denominator, so d = 96 non-causal calls with one keep the
    192 x 144 tile (default_tile_m): out and lse under FA4's rule on poisoned outputs."""
    import test_hopper_variants as hv

    assert hf._mod().default_tile_m(96, 96) == 192
    q, k, v = hv._qkv(2, sq, sk, hq, hkv, 96, 96, "bf16", sq + sk)
    hv.run_dense(q, k, v, causal=False, window_size=(None, None), softcap=0.0, sink=hv._sink(hq, sq + sk))



@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("b,sq,sk,hq,hkv", [(1, 8320, 8320, 4, 2), (2, 250, 9000, 6, 2)], ids=["8320", "250x9000"])
def test_long_causal_d96_default_tile(b, sq, sk, hq, hkv):
    """Causal d = 96 calls with >= 8192 keys default to the 192 x 144 tile in the grid's order (not
    stage 5's LPT order, whose build spills in the key-block loop): out and lse under FA4's rule on
    poisoned outputs (8320 rows: the last tile is partial, counted from the sequence's end), and
    fa4.flash_attn_func launches that same kernel (bitwise the same result)."""
    import torch

    import fa4
    from fa4 import _dispatch

    mod = hf._mod()
    assert mod.default_tile_m(96, 96, True, seqlen_k=sk) == 192 and mod.grid_order_causal(96, 96, sk)
    assert _dispatch.causal_forward_scheduler("sm_90", True, sk, 96, 96, hq, hkv) is None
    q, k, v = hf._randn_qkv(b, sq, sk, hq, hkv, 96, 96, seed=sq + sk)
    out, lse = hf._dense(q, k, v, causal=True)
    out_api, lse_api = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out_api, out) and torch.equal(lse_api, lse)
