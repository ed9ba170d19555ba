"""Stage 3, Blackwell (sm_100a): the forward's score variants, checked without hardware.

softcap (tanh on S in the softmax warpgroups), a learnable sink (an fp32 (Hq,) argument; the
correction warpgroup's final O / l and lse include it) and a sliding window (every role walks key
blocks [n_block_min, n_block_max)) reuse stage3_fwd_kernel.components as the Hopper forward does.
No Blackwell GPU exists here, so these builds are compiled for sm_100a and inspected: no spills, the
tanh only where a softcap is, the sink's extra kernel parameter, the plain build untouched by the
variant code, and bad arguments refused with errors that name them. Their numerics are unverified.

Eight compiles of ~10-20 s each on 2 cores.
"""
from __future__ import annotations

import re

import pytest

from stage3_fwd_kernel.blackwell_config import blackwell_fwd_config

SOFTCAP = dict(softcap=30.0)
SINK = dict(learnable_sink=True)
WINDOW = dict(window_size=(512, None))
ALL = dict(softcap=30.0, learnable_sink=True, window_size=(512, None))

# (head_dim, head_dim_v, causal, variant): every variant and head-dim pair at least once, both masks
BUILDS = [
    (128, 128, True, SOFTCAP),
    (64, 64, False, SINK),
    (192, 128, True, WINDOW),
    (128, 128, False, WINDOW),   # the window's loop without a right edge (it once spilled)
    (128, 128, False, ALL),
    (64, 64, True, ALL),
]


def _compile(d=128, dv=128, causal=False, **variant):
    from stage3_fwd_kernel import blackwell_fwd as bw

    return bw.compile_only("bf16", d, dv, causal, **variant)


def _num_params(ptx: str) -> int:
    """Kernel parameters of the (one) entry in the PTX."""
    return max(int(n) for n in re.findall(r"_param_(\d+)\b", ptx)) + 1


def _tanh(ptx: str) -> int:
    return len(re.findall(r"\btanh\.approx\.f32\b", ptx))


@pytest.fixture(scope="module")
def plain():
    return _compile(128, 128, False)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv,causal,variant", BUILDS,
                         ids=[f"d{d}-{dv}-{'causal' if c else 'full'}-{'+'.join(v)}" for d, dv, c, v in BUILDS])
def test_variant_builds_compile_clean(d, dv, causal, variant, plain):
    comp = _compile(d, dv, causal, **variant)
    rep = comp.report
    assert rep["ptx_target"] == "sm_100a"
    assert (rep["spill_stores"], rep["spill_loads"], rep["LDL/STL"]) == (0, 0, 0), rep
    # the tcgen05 pipeline is the plain one: S = Q K^T from SMEM, O += P V with P from TMEM, and two
    # inlined softmax steps (masked, unmasked) of 4 P stores each
    assert rep["UTCHMMA.SS"] > 0 and rep["UTCHMMA.TS"] > 0
    assert rep["ptx_st_32x32b.x16"] == plain.report["ptx_st_32x32b.x16"]
    # softcap: one tanh per score of a row, in each inlined softmax step (masked / unmasked)
    tanh = _tanh(comp.ptx)
    if variant.get("softcap"):
        assert tanh > 0 and tanh % 128 == 0, tanh
    else:
        assert tanh == 0
    # the sink and the softcap's tanh scale are one extra kernel parameter each
    extra = int(bool(variant.get("learnable_sink"))) + int(bool(variant.get("softcap")))
    assert _num_params(comp.ptx) == _num_params(plain.ptx) + extra


@pytest.mark.compile
@pytest.mark.stage3
def test_plain_build_carries_no_variant_code(plain):
    assert plain.report["spill_stores"] == 0 and plain.report["LDL/STL"] == 0
    assert _tanh(plain.ptx) == 0
    sink = _compile(128, 128, False, **SINK)
    # the sink's lse: the plain build has one lg2 per Q tile; the sink adds the shared maximum's ex2s
    ex2 = lambda ptx: len(re.findall(r"\bex2\.approx", ptx))  # noqa: E731
    assert ex2(sink.ptx) > ex2(plain.ptx)
    assert sink.ptx != plain.ptx


@pytest.mark.compile
@pytest.mark.stage3
def test_variant_cache_keys():
    plain = blackwell_fwd_config(128, 128, "bf16", causal=True)
    assert plain.plain and "variant" not in plain.key()  # plain keys (and stored compiles) unchanged
    keys = {blackwell_fwd_config(128, 128, "bf16", causal=True, **v).key() for v in (SOFTCAP, SINK, WINDOW, ALL)}
    assert len(keys) == 4 and plain.key() not in keys
    # causal is the kernel's flag: window_size=(None, 0) with causal is the plain causal build
    assert blackwell_fwd_config(128, 128, "bf16", causal=True, window_size=(None, 0)).key() == plain.key()
    assert blackwell_fwd_config(128, 128, "bf16", causal=False, window_size=(-1, -1)).key() == \
        blackwell_fwd_config(128, 128, "bf16", causal=False).key()


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("kwargs,error,name", [
    (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
    (dict(window_size=(-5, None)), ValueError, "window_size"),
    (dict(window_size=(None, 4), causal=True), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(learnable_sink=1), TypeError, "learnable_sink"),
])
def test_bad_variant_arguments_name_themselves(kwargs, error, name):
    from stage3_fwd_kernel import blackwell_fwd as bw

    causal = kwargs.pop("causal", False)
    with pytest.raises(error, match=name):
        bw.make_config("bf16", 128, 128, causal, **kwargs)
    with pytest.raises(error, match=name):
        bw.compile_only("bf16", 128, 128, causal, **kwargs)  # refused before any compile


@pytest.mark.compile
@pytest.mark.stage3
def test_attention_forward_checks_variants_before_the_gpu():
    torch = pytest.importorskip("torch")
    from stage3_fwd_kernel import blackwell_fwd as bw

    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    cases = [(dict(learnable_sink=torch.zeros(3)), ValueError, "learnable_sink"),
             (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink"),
             (dict(learnable_sink=torch.zeros(4, dtype=torch.int32)), ValueError, "learnable_sink"),
             (dict(softcap=-2.0), ValueError, "softcap"),
             (dict(window_size=(3,)), TypeError, "window_size")]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            bw.attention_forward(q, k, v, **kwargs)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="learnable_sink"):
        bw.attention_varlen_forward(q[0], k[0], v[0], cu, cu, 8, learnable_sink=torch.zeros(2))
    if not bw.blackwell_gpu_available():  # good arguments reach the GPU check
        with pytest.raises(RuntimeError, match="Blackwell"):
            bw.attention_forward(q, k, v, softcap=5.0, learnable_sink=torch.zeros(4), window_size=(16, 0))


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True])
def test_variant_walk_keeps_the_barrier_protocol(causal):
    """The barrier-protocol checker on the build with all three variants: its softmax walk is one
    loop whose step takes the masked or the mask-free body (the same barrier operations either
    way), so the checker is told the branch (`unmasked`); every role must still agree on the walk."""
    import dataclasses

    from stage3_fwd_kernel import blackwell_protocol as bp
    from stage3_fwd_kernel.blackwell_fwd import FlashAttentionForwardSm100, make_config
    from stage3_fwd_kernel.blackwell_protocol_extract import ExtractionError

    kernel = FlashAttentionForwardSm100(make_config("bf16", 128, 128, causal, **ALL))
    spec = dataclasses.replace(bp.forward_spec(3), kernel=kernel)
    with pytest.raises(ExtractionError, match="unmasked"):  # the variant loop is the one extracted
        bp.extract(spec)
    for unmasked in (True, False):
        prog = bp.extract(dataclasses.replace(spec, overrides={**spec.overrides, "unmasked": unmasked}))
        res = bp.explore(prog, 2_000_000, 3, 2)
        assert res.ok, res.report()
