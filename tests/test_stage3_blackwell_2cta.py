"""Stage 3, Blackwell (sm_100a): the 2-CTA forward (blackwell_fwd_2cta.py), checked without hardware.

No Blackwell GPU exists in this project; these tests are the whole verification of the kernel.

cpu tier: the per-CTA plan (blackwell_2cta_config) against budgets computed by hand: TMEM as the
1-CTA plan, SMEM with half-size K / V ring slots; refusals naming the budget.

compile tier: bf16 d = 128 non-causal, fp16 d = 128 causal and bf16 (192, 128) causal compile for
sm_100a with a cluster launch of 2 (one compile each, module scope; ~30 s on 2 cores). The SASS holds
only CTA-pair MMAs (UTCHMMA.2CTA: S = Q K^T from SMEM, O += P V with P in TMEM) and 2-SM TMA loads;
the PTX the pair's forms (tcgen05.mma / alloc / dealloc / commit .cta_group::2, every commit
multicast to both CTAs, the 2-SM TMA's barrier address masked to the even CTA, the relay's 4
cluster-scope remote arrives, the cluster barriers after init and before exit); no local memory;
SMEM = plan <= 232448; the MMA thread waits on its own and the relayed barrier before each part of
P V; the rows each CTA's Q load takes (a trace-time check on an identity tensor); refusals
(ValueError naming the argument) before compiling.

gpu tier: only on a device of compute capability 10.x (skipped everywhere else, i.e. here).
"""
from __future__ import annotations

import re

import pytest

from stage3_fwd_kernel.blackwell_2cta_config import blackwell_fwd_2cta_config
from stage3_fwd_kernel.blackwell_config import SMEM_CAPACITY, TMEM_COLUMNS, blackwell_fwd_config

KB = 1024


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_d128_plan_per_cta():
    c = blackwell_fwd_2cta_config(128, 128, "bf16", causal=False)
    one = blackwell_fwd_config(128, 128, "bf16", causal=False)
    # TMEM: the 1-CTA plan (the pair MMA leaves each CTA's 128 rows of S_i / O_i in its own TMEM)
    assert c.tmem == one.tmem and c.tmem.used == c.tmem.alloc == TMEM_COLUMNS
    # SMEM: a slot holds half of K (64 keys x 128) or half of V (64 columns x 128 keys): 16 KB
    s = c.smem
    assert s.kv_slot == 64 * 128 * 2 == one.smem.kv_slot // 2
    assert c.kv_stages == 6 and s.q == one.smem.q == 64 * KB and s.o == 64 * KB and not s.o_overlaps_q
    assert s.total == KB + 64 * KB + 64 * KB + 6 * 16 * KB == 230400 <= SMEM_CAPACITY
    # the same K/V bytes in flight as the 1-CTA ring (3 x 32 KB)
    assert s.kv == one.smem.kv
    # barriers: the 1-CTA 29 (6 slots) + p_full_peer, p_full_2_peer per tile + tmem_pair
    assert s.num_barriers == (2 + 2 * 6 + 7 * 2 + 1) + 2 * 2 + 1 == 34 and 8 * 34 + 4 <= s.header == KB
    assert (c.regs.softmax, c.regs.correction, c.regs.other) == (192, 72, 56)


@pytest.mark.cpu
@pytest.mark.stage3
def test_d192_plan_and_budget_refusals():
    c = blackwell_fwd_2cta_config(192, 128, "fp16", causal=True)
    # a K half is 64 keys x 192 (24 KB), a V half 64 x 128 (16 KB); sO separate (1-CTA: over sQ)
    assert c.smem.kv_slot == 64 * 192 * 2 and c.kv_stages == 2 and not c.smem.o_overlaps_q
    assert c.smem.total == KB + 96 * KB + 64 * KB + 2 * 24 * KB == 214016 <= SMEM_CAPACITY
    assert c.tmem.used == 512
    with pytest.raises(ValueError, match=r"SMEM does not fit per CTA"):
        blackwell_fwd_2cta_config(128, 128, "bf16", causal=False, kv_stages=7)
    with pytest.raises(ValueError, match=r"kv_stages"):
        blackwell_fwd_2cta_config(128, 128, "bf16", causal=False, kv_stages=1)
    with pytest.raises(ValueError, match=r"head_dim"):
        blackwell_fwd_2cta_config(64, 64, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"head_dim"):
        blackwell_fwd_2cta_config(256, 256, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"dtype"):
        blackwell_fwd_2cta_config(128, 128, "fp8", causal=False)


@pytest.mark.cpu
@pytest.mark.stage3
def test_barrier_protocol_of_the_pair():
    """blackwell_protocol's fwd2cta spec: both CTAs' roles extracted from this kernel's source, 4 key
    blocks: no deadlock, race or lapped waiter; bugs planted into the extracted program are caught."""
    import test_blackwell_protocol as tp  # its planting helpers (pytest puts tests/ on the path)

    from stage3_fwd_kernel import blackwell_protocol as bp

    res = bp.check("fwd2cta", 4)
    assert res.ok and res.states > 1000, res.report()
    base = bp.build("fwd2cta", 2)
    relay = [tp._offset(base, f"{n}[{i}]") for n in ("p_full", "p_full_2") for i in range(2)]
    assert sum(op[0] == "wait" and op[1][1] in relay for op in base.ops["relay.1"]) == 2 * 4
    planted = [  # (planting, kinds)
        (lambda p: tp.drop_arrive(p, "relay.1", "p_full_2_peer[1]", 1), {"deadlock"}),   # a relay lost
        (lambda p: tp.flip_wait(p, "mma.0", "p_full_peer[0]", 1), {"race", "overrun"}),  # wrong parity
        (lambda p: tp.set_count(p, "p_full_peer[0]", 2), {"deadlock"}),
        (lambda p: tp.flip_wait(p, "softmax1.1", "s_full[1]", 1), {"race", "overrun"}),  # the odd CTA's S
    ]
    for plant, kinds in planted:
        prog = base.copy()
        plant(prog)
        res = bp.explore(prog, blocks=2)
        assert not res.ok and res.kind in kinds, res.report()


# ------------------------------------------------------------------------------------ compile tier
CASES = [("bf16", 128, 128, False), ("fp16", 128, 128, True), ("bf16", 192, 128, True)]


@pytest.fixture(scope="module")
def compiled():
    """Each configuration compiled once for the module (blackwell_fwd_2cta caches by plan)."""
    from stage3_fwd_kernel import blackwell_fwd_2cta as m

    return {case: m.compile_only(*case) for case in CASES}


def _n(pat, text):
    return len(re.findall(pat, text))


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}x{c[2]}-{'causal' if c[3] else 'full'}" for c in CASES])
def test_compiles_cta_pair_forward(compiled, case):
    dt, d, dv, causal = case
    comp = compiled[case]
    r, sass, ptx = comp.report, comp.sass, comp.ptx
    assert r["ptx_target"] == "sm_100a" and sass
    # a cluster of 2 CTAs (the launch's), and code that depends on it
    assert r["cluster"] == (2, 1, 1) and r["ptx_cluster_ctarank"] >= 1
    # every MMA is a CTA-pair MMA: 2 tiles x d/16 of S (SS) and 2 tiles x 128/16 of O += P V (TS), twice
    # (prologue S + loop, loop + tail O)
    assert _n(r"\bUTCHMMA\b(?!\.2CTA)", sass) == 0 and r["UTCHMMA.2CTA"] == r["UTCHMMA"]
    assert r["UTCHMMA.2CTA.SS"] == 4 * (d // 16) and r["UTCHMMA.2CTA.TS"] == 4 * (128 // 16)
    assert r["ptx_mma_cta2"] == 4 * (d // 16) + 4 * 8 and r["ptx_mma_cta1"] == 0
    # the pair allocates TMEM together; every commit arrives on both CTAs' barriers
    assert r["ptx_alloc_cta2"] == 1 and _n(r"\btcgen05\.dealloc\.cta_group::2\b", ptx) == 1
    commits = re.findall(r"\btcgen05\.commit\.[^\s]+", ptx)
    # s_full x 4, kv_empty x 3 (none for the last V: no load waits for it), o_full x 2
    assert len(commits) == r["ptx_commit_mc"] == r["UTCBAR"] == 9
    assert all(".cta_group::2." in c and "multicast::cluster" in c for c in commits)
    assert set(re.findall(r"\bUTCBAR[\w.]*", sass)) == {"UTCBAR.2CTA.MULTICAST"}
    # 2-SM TMA loads only; the barrier address masked to the even CTA (& 0xFEFFFFFF)
    tma = re.findall(r"\bUTMALDG\.\dD(\.2CTA)?\b", sass)
    assert tma and all(t == ".2CTA" for t in tma) and len(tma) == r["ptx_tma_cta2"]
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, -16777217;", ptx)
    # the odd CTA's relay: p_full / p_full_2 of both tiles, cluster-scope release arrives on the leader
    assert r["ptx_remote_arrive"] == 4
    assert r["ptx_barrier_cluster"] >= 4 and _n(r"\bUCGABAR_ARV\b", sass) >= 2
    # the warpgroups are the 1-CTA kernel's: its TMEM traffic, its exponentials, its register split
    assert (r["LDTM"], r["STTM"], r["MUFU.EX2"]) == (28, 19, 226)
    assert sorted(r["ptx_setmaxnreg"]) == [("dec", "56"), ("dec", "72"), ("inc", "192")]
    # no local memory anywhere; SMEM = plan
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, r["ptxas_log"][-600:]
    assert r["LDL/STL"] == 0 and not re.search(r"\b(STL|LDL)\b", sass)
    plan = blackwell_fwd_2cta_config(d, dv, dt, causal=causal)
    assert r["smem_bytes"] == plan.smem.total <= SMEM_CAPACITY


@pytest.mark.compile
@pytest.mark.stage3
def test_pv_waits_for_both_ctas(compiled):
    """In the MMA thread's stream every O += P V is: 2 waits (own p_full, the relayed p_full_peer), 6
    TS pair MMAs, 2 waits (p_full_2, p_full_2_peer), 2 more -- 2 tiles x (main loop + tail)."""
    tokens = []
    for line in compiled[CASES[0]].sass.splitlines():
        m = re.search(r"\b(UTCHMMA)\.2CTA\s+(gdesc|tmem)\[|\b(SYNCS\.PHASECHK)\b", line)
        if m:
            tokens.append("T" if m.group(2) == "tmem" else "S" if m.group(1) else "W")
    stream = "".join(tokens)
    assert stream.count("WWTTTTTTWWTT") == 4, stream
    assert "T" * 7 not in stream and stream.count("S" * 8) == 4


@pytest.mark.compile
@pytest.mark.stage3
def test_each_cta_loads_its_own_q_rows():
    """CTA c of a pair computes m_block 2p + c as a 1-CTA kernel would; its 2-SM TMA half of the pair
    MMA's 256 rows must be its own 128-row tile (checked on an identity tensor at trace time), and a
    view without the per-CTA shift is caught."""
    import cutlass.cute as cute

    from stage3_fwd_kernel import blackwell_fwd_2cta as m

    assert all(wrong == 0 for _, _, wrong in m.check_q_rows().values())
    kernel = m.FlashAttentionForwardSm100TwoCta(m.make_config("bf16", 128))

    def unshifted(thr, mQ, rank, i):
        return thr.partition_A(cute.local_tile(cute.domain_offset((kernel.tm * i, 0), mQ), (256, kernel.d), (None, 0)))

    bad = m.check_q_rows(kernel, view=unshifted)
    assert bad[(0, 0)][2] == 0 and bad[(1, 0)][2] > 0


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("kw,name", [
    (dict(varlen=True), "varlen"), (dict(persistent=True), "persistent"), (dict(window_size=(64, 0)), "window_size"),
    (dict(softcap=15.0), "softcap"), (dict(learnable_sink=True), "learnable_sink"), (dict(head_dim=64), "head_dim"),
    (dict(dtype="fp8"), "dtype"), (dict(scheduler=object()), "scheduler"),
])
def test_refused_naming_the_argument(kw, name):
    from stage3_fwd_kernel import blackwell_fwd_2cta as m

    args = dict(dtype="bf16", head_dim=128)
    args.update(kw)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        m.compile_only(**args)


@pytest.mark.compile
@pytest.mark.stage3
def test_entry_point_refuses_without_blackwell():
    import torch

    from stage3_fwd_kernel import blackwell_fwd_2cta as m

    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):   # argument checks come before the device check
        m.attention_forward_2cta(q, q, q, softcap=5.0)
    if not m._one.blackwell_gpu_available():
        with pytest.raises(RuntimeError, match="sm_100"):
            m.attention_forward_2cta(q, q, q)


# ---------------------------------------------------------------------------------------- gpu tier
@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_on_blackwell(d, dv, causal):
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10):
        pytest.skip("needs a Blackwell GPU (compute capability 10.x); none exists in this project")
    from stage3_fwd_kernel import blackwell_fwd_2cta as m

    # an odd number of 256-row blocks (the pair's second CTA past the end), a ragged key block, GQA
    for sq, sk, h, hkv in ((1, 1, 2, 1), (300, 203, 4, 2), (799, 3, 2, 2), (1024, 1024, 4, 1)):
        m.run(batch=2, seqlen_q=sq, seqlen_k=sk, heads=h, heads_kv=hkv, head_dim=d, head_dim_v=dv,
              causal=causal, check=True, verbose=False)
