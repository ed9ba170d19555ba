"""fa4 as a drop-in for the official FlashAttention-4 interface (flash_attn.cute.interface).

cpu tier: the keyword names and defaults of fa4.flash_attn_func / flash_attn_varlen_func and of
fa4.compat against the official source (parsed with ast when it is present: the names cannot drift
silently) and against the list written here (always); everything after q, k, v is keyword-only,
and a FlashAttention-2 positional call raises a TypeError that says so; every no-op value of the
official's (and FlashAttention-2's) keywords reaches the op exactly like the default; every value
fa4 cannot serve is a ValueError naming it before any launch; max_seqlen_* default to the total
token counts; fa4.compat returns the official (out, lse) tuple, lse None exactly when the official
gives None, and its lse gradient counts only with return_lse=True (end to end through the ops'
autograd over a float64 reference kernel on CPU).

gpu tier: fa4.compat and fa4 agree bitwise on a GPU; max_seqlen_* None equals the real bounds.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import os
import pathlib

import pytest
import torch

import fa4
import fa4.compat
from fa4 import _api, _dispatch, _ops, _validate

pytestmark = pytest.mark.fa4

BF16 = torch.bfloat16

# The official's keywords that fa4 does not take (Python's unexpected-keyword TypeError). Written out
# so that taking one, or the official dropping one, is a visible change of this list.
NOT_TAKEN = {
    "flash_attn_func": {"qv", "gather_kv_indices", "score_mod", "score_mod_bwd", "mask_mod", "aux_tensors",
                        "aux_scalars", "block_sparse_tensors", "block_sparse_tensors_bwd", "gather_bwd_recompute_p",
                        "gather_bwd_token_chunk"},
    "flash_attn_varlen_func": {"qv", "min_seqlen_k", "gather_kv_indices", "score_mod", "score_mod_bwd",
                               "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars", "scheduler_metadata",
                               "seqlen_k_per_split", "disable_scheduler_metadata", "gather_bwd_recompute_p",
                               "gather_bwd_token_chunk"},
}
# The official's keywords fa4 takes, with the official defaults.
_COMMON = {"softmax_scale": None, "causal": False, "window_size": (None, None), "learnable_sink": None,
           "softcap": 0.0, "num_splits": 1, "pack_gqa": None, "deterministic": False, "return_lse": False}
TAKEN = {
    "flash_attn_func": dict(_COMMON),
    "flash_attn_varlen_func": {"cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None, "max_seqlen_k": None,
                               "seqused_q": None, "seqused_k": None, "page_table": None, **_COMMON},
}
FA4_ONLY = {"dropout_p": 0.0}  # FlashAttention-2's keyword, taken by fa4's functions (not by fa4.compat)
NAMES = ("flash_attn_func", "flash_attn_varlen_func")


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def fixed_args():
    return meta(2, 64, 8, 128), meta(2, 80, 2, 128), meta(2, 80, 2, 128)


def varlen_args():
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    return (meta(100, 8, 128), meta(120, 2, 128), meta(120, 2, 128)), dict(cu_seqlens_q=cu, cu_seqlens_k=cu)


def call(fn_name, module=fa4, **kw):
    """module.fn_name on meta tensors (varlen: with both cu_seqlens)."""
    if fn_name == "flash_attn_func":
        return getattr(module, fn_name)(*fixed_args(), **kw)
    (q, k, v), cu = varlen_args()
    return getattr(module, fn_name)(q, k, v, **{**cu, **kw})


@pytest.fixture
def no_launch(monkeypatch):
    """Validation must raise before anything reaches an op."""
    def boom(*a, **kw):
        raise AssertionError("reached the op: validation should have raised first")

    monkeypatch.setattr(_api._ops, "attention", boom)
    monkeypatch.setattr(_api._ops, "varlen_attention", boom)


@pytest.fixture
def op_args(monkeypatch):
    """The positional arguments each call hands _ops.attention / varlen_attention (no launch)."""
    seen = []

    def record(*args):
        seen.append(args)
        return "out", "lse"

    monkeypatch.setattr(_api._ops, "attention", record)
    monkeypatch.setattr(_api._ops, "varlen_attention", record)
    return seen


# ================================================================================ signatures
def _keywords(fn):
    """(positional parameters, {keyword-only name: default}) of a public function."""
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params), fn
    return positional, {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


@pytest.mark.cpu
@pytest.mark.parametrize("name", NAMES)
def test_signatures_take_the_official_keywords_keyword_only(name):
    positional, kw = _keywords(getattr(fa4, name))
    assert positional == ["q", "k", "v"]
    assert kw == {**TAKEN[name], **FA4_ONLY}
    positional, kw = _keywords(getattr(fa4.compat, name))
    assert positional == ["q", "k", "v"] and kw == TAKEN[name]


def _official_interface() -> pathlib.Path | None:
    """interface.py of the official package: $FA4_OFFICIAL_INTERFACE, an installed flash_attn (found
    without importing it), or the copy extracted at /tmp/fa."""
    candidates = [os.environ.get("FA4_OFFICIAL_INTERFACE")]
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, "cute", "interface.py") for p in spec.submodule_search_locations]
    candidates.append("/tmp/fa/flash_attn/cute/interface.py")
    return next((pathlib.Path(c) for c in candidates if c and pathlib.Path(c).is_file()), None)


def _official_keywords(path: pathlib.Path) -> dict:
    """{function name: {parameter after q, k, v: default}} from the official source, via ast."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in NAMES:
            args = node.args
            assert not args.vararg and [a.arg for a in args.args[:3]] == ["q", "k", "v"], node.name
            defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
            pairs = list(zip(args.args, defaults))[3:] + list(zip(args.kwonlyargs, args.kw_defaults))
            found[node.name] = {a.arg: ast.literal_eval(d) for a, d in pairs}
    return found


@pytest.mark.cpu
@pytest.mark.parametrize("name", NAMES)
def test_keyword_names_and_defaults_match_the_official_source(name):
    path = _official_interface()
    if path is None:
        pytest.skip("the official flash_attn/cute/interface.py is not here (set FA4_OFFICIAL_INTERFACE)")
    official = _official_keywords(path)[name]
    assert NOT_TAKEN[name] <= set(official), f"no longer in the official: {NOT_TAKEN[name] - set(official)}"
    served = {n: d for n, d in official.items() if n not in NOT_TAKEN[name]}
    assert served == TAKEN[name], "the official's keywords changed: update fa4 (and TAKEN / NOT_TAKEN)"
    assert _keywords(getattr(fa4.compat, name))[1] == served
    assert _keywords(getattr(fa4, name))[1] == {**served, **FA4_ONLY}
    assert not set(FA4_ONLY) & set(official)


# ================================================================================ keyword-only
@pytest.mark.cpu
def test_fa2_positional_call_raises_the_keyword_only_type_error(no_launch):
    q, k, v = fixed_args()
    with pytest.raises(TypeError, match=r"^flash_attn_func: the arguments after q, k, v are keyword-only.*"
                                        r"FlashAttention-2's 4th positional argument is dropout_p"):
        fa4.flash_attn_func(q, k, v, 0.1, causal=True)  # FlashAttention-2: dropout_p=0.1
    with pytest.raises(TypeError, match=r"keyword-only.*got 4 more positional"):
        fa4.flash_attn_func(q, k, v, None, True, False, True)  # fa4's earlier positional order
    (q, k, v), cu = varlen_args()
    c = cu["cu_seqlens_q"]
    with pytest.raises(TypeError, match=r"^flash_attn_varlen_func: the arguments after q, k, v are keyword-only.*"
                                        r"cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k.*dropout_p"):
        fa4.flash_attn_varlen_func(q, k, v, c, c, 50, 60)
    for name, args in (("flash_attn_func", fixed_args()), ("flash_attn_varlen_func", (q, k, v))):
        with pytest.raises(TypeError, match=rf"^{name}: .*keyword-only.*4th positional argument is qv"):
            getattr(fa4.compat, name)(*args, None)  # the official's positional qv


@pytest.mark.cpu
def test_python_own_errors_are_kept(no_launch):
    q, k, v = fixed_args()
    with pytest.raises(TypeError, match=r"flash_attn_func\(\) missing 1 required positional argument: 'v'"):
        fa4.flash_attn_func(q, k)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'qv'"):
        fa4.flash_attn_func(q, k, v, qv=q)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'dropout_p'"):
        fa4.compat.flash_attn_func(q, k, v, dropout_p=0.0)  # not an official keyword


@pytest.mark.cpu
def test_q_k_v_by_name():
    q, k, v = fixed_args()
    assert fa4.flash_attn_func(q=q, k=k, v=v).shape == (2, 64, 8, 128)
    assert fa4.compat.flash_attn_func(v=v, k=k, q=q)[0].shape == (2, 64, 8, 128)


# ================================================================================ no-op values
NO_OPS = [
    ("window_size", (-1, -1)), ("window_size", (None, None)), ("window_size", None), ("window_size", [-1, None]),
    ("softcap", 0.0), ("softcap", 0), ("softcap", None), ("learnable_sink", None),
    ("num_splits", 1), ("num_splits", 0), ("num_splits", -1),  # <= 0: the official's automatic choice
    ("pack_gqa", None), ("deterministic", False), ("return_lse", False), ("softmax_scale", None),
    ("dropout_p", 0.0), ("dropout_p", 0),
]
VARLEN_NO_OPS = [("seqused_q", None), ("seqused_k", None)]


def _same(a, b):
    return a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b


def _matrix(both, varlen_only, names_of=lambda item: item[:1]):
    """pytest params (module, function name, item) for both modules and both functions, leaving out
    a varlen-only item for flash_attn_func and FlashAttention-2's keyword for fa4.compat."""
    out = []
    for mod_id, module in (("fa4", fa4), ("compat", fa4.compat)):
        for name in NAMES:
            for item in both + (varlen_only if name == "flash_attn_varlen_func" else []):
                if module is fa4.compat and set(names_of(item)) & set(FA4_ONLY):
                    continue
                out.append(pytest.param(module, name, item, id=f"{mod_id}-{name}-{_item_id(item)}"))
    return out


def _item_id(item):
    kw = item[0] if isinstance(item[0], dict) else dict([item])
    return ",".join(f"{k}={v!r}" if not isinstance(v, torch.Tensor) else f"{k}=tensor" for k, v in kw.items())


@pytest.mark.cpu
@pytest.mark.parametrize("module,name,kw", _matrix(NO_OPS, VARLEN_NO_OPS))
def test_each_no_op_value_reaches_the_op_like_the_default(module, name, kw, op_args):
    fn = getattr(module, name)
    args, base = (fixed_args(), {}) if name == "flash_attn_func" else varlen_args()
    fn(*args, **base)
    fn(*args, **base, **dict([kw]))
    default, given = op_args
    assert len(default) == len(given) and all(_same(a, b) for a, b in zip(default, given)), (default, given)


# ================================================================================ refused values
REFUSED = [
    (dict(num_splits=2), ValueError, r"^num_splits: flash_attn_func / flash_attn_varlen_func take no split count"),
    (dict(num_splits=128), ValueError, r"^num_splits: .* take no split count, got 128"),
    (dict(num_splits=None), TypeError, r"^num_splits: expected an int, got NoneType"),
    (dict(num_splits=True), TypeError, r"^num_splits: expected an int, got bool"),
    (dict(num_splits=1.0), TypeError, r"^num_splits: expected an int, got float"),
    (dict(pack_gqa=True), ValueError, r"^pack_gqa: fa4 picks its GQA layout itself.* got True; pass None"),
    (dict(pack_gqa=False), ValueError, r"^pack_gqa: fa4 picks its GQA layout itself.* got False; pass None"),
    (dict(pack_gqa=1), TypeError, r"^pack_gqa: expected None or a bool"),
    (dict(dropout_p=0.1), ValueError, r"^dropout_p: fa4 does not support attention dropout, got 0.1"),
    (dict(dropout_p=math.nan), ValueError, r"^dropout_p: fa4 does not support attention dropout"),
    (dict(dropout_p=None), TypeError, r"^dropout_p: expected a float, got NoneType"),
    (dict(dropout_p=False), TypeError, r"^dropout_p: expected a float, got bool"),
]
VARLEN_REFUSED = [
    (dict(seqused_q=torch.zeros(2, dtype=torch.int64, device="meta")), TypeError, r"^seqused_q: dtype must be"),
    (dict(cu_seqlens_q=None), ValueError, r"^q: expected rank 4 \(batch, seqlen, heads, head_dim\) with "
     r"cu_seqlens_q=None"),
    (dict(cu_seqlens_k=None), ValueError, r"^k: expected rank 4 .* with cu_seqlens_k=None"),
    (dict(max_seqlen_q=50.0), TypeError, r"^max_seqlen_q: expected an int"),
    (dict(max_seqlen_k=torch.tensor(60)), TypeError, r"^max_seqlen_k: expected an int"),
]


@pytest.mark.cpu
@pytest.mark.parametrize("module,name,case", _matrix(REFUSED, VARLEN_REFUSED, names_of=lambda case: case[0]))
def test_unservable_values_are_refused_naming_the_argument(module, name, case, no_launch):
    kw, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        call(name, module, **kw)


# ================================================================================ max_seqlen
@pytest.mark.cpu
@pytest.mark.parametrize("module", [fa4, fa4.compat], ids=["fa4", "compat"])
def test_max_seqlen_defaults_to_the_total_token_counts(module, op_args):
    """As in the official: None is the total (an upper bound known without reading cu_seqlens, so no
    sync); given values pass through unchanged."""
    (q, k, v), cu = varlen_args()
    module.flash_attn_varlen_func(q, k, v, **cu)
    module.flash_attn_varlen_func(q, k, v, **cu, max_seqlen_q=50)
    module.flash_attn_varlen_func(q, k, v, **cu, max_seqlen_q=50, max_seqlen_k=60)
    # (q, k, v, cu_q, cu_k, seqused_k, max_seqlen_q, max_seqlen_k, ...)
    assert [a[6:8] for a in op_args] == [(100, 120), (50, 120), (50, 60)]


@pytest.mark.cpu
def test_max_seqlen_none_under_torch_compile_has_no_graph_break():
    def varlen(q, k, v, cu_q, cu_k):
        return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True).sum()

    (q, k, v), cu = varlen_args()
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(varlen)(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"])
        assert ex.graph_break_count == 0 and ex.graph_count == 1
    finally:
        torch._dynamo.reset()


# ================================================================================ return conventions
@pytest.mark.cpu
@pytest.mark.parametrize("name", NAMES)
def test_compat_returns_the_official_tuple(name):
    """Always (out, lse); lse is a tensor when return_lse=True or an input (q, k, v, learnable_sink)
    requires grad, and None otherwise -- the official's rule. fa4's own functions: out, or (out, lse)."""
    out_shape = (2, 64, 8, 128) if name == "flash_attn_func" else (100, 8, 128)
    lse_shape = (2, 8, 64) if name == "flash_attn_func" else (8, 100)
    res = call(name, fa4.compat)
    assert type(res) is tuple and len(res) == 2 and res[0].shape == out_shape and res[1] is None
    out, lse = call(name, fa4.compat, return_lse=True)
    assert out.shape == out_shape and lse.shape == lse_shape and lse.dtype == torch.float32
    assert call(name, fa4).shape == out_shape  # fa4's convention: a tensor, not a tuple
    out, lse = call(name, fa4, return_lse=True)
    assert out.shape == out_shape and lse.shape == lse_shape

    sink = meta(8, dtype=torch.float32).requires_grad_()
    with torch.no_grad():  # the official looks at requires_grad, not at the grad mode
        _, lse = call(name, fa4.compat, learnable_sink=sink)
    assert lse is not None and lse.shape == lse_shape
    args = fixed_args() if name == "flash_attn_func" else varlen_args()[0]
    for i in range(3):
        grads = [t.requires_grad_(j == i) for j, t in enumerate(args)]
        kw = {} if name == "flash_attn_func" else varlen_args()[1]
        out, lse = getattr(fa4.compat, name)(*grads, **kw)
        assert lse is not None and lse.shape == lse_shape and out.requires_grad


# ---------------------------------------------------------------------- end to end on a CPU reference
class _ReferenceBackend:
    """A float64 stand-in for a Backend (stage 0's attention_ref), outputs in the kernels' dtypes."""

    arch = _dispatch.ARCHS["sm_90"]

    def __init__(self):
        self.dlse_seen = []

    def check_head_dims(self, d, dv):
        pass

    def forward(self, q, k, v, softmax_scale, causal, window=(None, None), softcap=0.0, learnable_sink=None):
        from stage0_reference.torch_reference import attention_ref

        o, lse = attention_ref(q.double(), k.double(), v.double(), softmax_scale=softmax_scale, causal=causal)
        return o.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dlse=None, window=(None, None),
                 softcap=0.0, want_d=False):
        """dS = P (dP - D + dlse), in float64 (autograd is off inside an op's kernel)."""
        self.dlse_seen.append(dlse is not None)
        q64, k64, v64, do = (t.double() for t in (q, k, v, dout))
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        kk, vv = (t.repeat_interleave(hq // hkv, dim=2) for t in (k64, v64))
        s = torch.einsum("bihd,bjhd->bhij", q64, kk) * softmax_scale
        if causal:
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
        p = torch.softmax(s, dim=-1)
        d = (do * torch.einsum("bhij,bjhd->bihd", p, vv)).sum(-1).permute(0, 2, 1)  # (B, H, Sq)
        if dlse is not None:
            d = d - dlse.double()
        ds = p * (torch.einsum("bihd,bjhd->bhij", do, vv) - d[..., None])
        dq = torch.einsum("bhij,bjhd->bihd", ds, kk) * softmax_scale
        dk = torch.einsum("bhij,bihd->bjhd", ds, q64) * softmax_scale
        dv = torch.einsum("bhij,bihd->bjhd", p, do)
        fold = lambda t: t.view(b, sk, hkv, hq // hkv, t.shape[-1]).sum(3)  # noqa: E731  (GQA: sum the group)
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@pytest.fixture
def cpu_reference(fa4_ops_on_cpu):
    """fa4's public functions run end to end on CPU bf16 tensors (conftest.fa4_ops_on_cpu), fa4::fwd /
    fa4::bwd over _ReferenceBackend."""
    return fa4_ops_on_cpu(_ReferenceBackend())


@pytest.mark.cpu
def test_compat_lse_gradient_counts_only_with_return_lse(cpu_reference):
    """The official returns lse when q requires grad even without return_lse, and then ignores its
    gradient; with return_lse=True the gradient counts. fa4.compat does the same, through the same
    op as fa4.flash_attn_func (out bitwise equal)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 4, 64, generator=g).to(BF16) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA 4 / 2

    def grads(return_lse, use_lse):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fa4.compat.flash_attn_func(*leaves, causal=True, return_lse=return_lse)
        loss = out.float().sum() + (lse.sum() if use_lse else 0)
        return out, lse, torch.autograd.grad(loss, leaves)

    out, lse, plain = grads(False, False)
    assert lse is not None and lse.shape == (1, 4, 9)
    assert torch.equal(out, fa4.flash_attn_func(q, k, v, causal=True))
    _, _, ignored = grads(False, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ignored))  # lse's gradient dropped, as in the official
    _, _, counted = grads(True, True)
    assert not torch.equal(plain[0], counted[0])  # with return_lse=True it reaches dq
    assert cpu_reference.dlse_seen == [False, False, True]
    # and both are the right gradients: torch autograd of stage 0's reference in float64
    from stage0_reference.torch_reference import attention_ref

    for got, use_lse in ((plain, False), (counted, True)):
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        o, lse = attention_ref(*leaves, causal=True)
        want = torch.autograd.grad(o.sum() + (lse.sum() if use_lse else 0), leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)


# ================================================================================ gpu
@pytest.mark.gpu
def test_compat_and_default_max_seqlen_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 256, 8, 128, device="cuda", dtype=BF16, generator=g) for _ in range(3))
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    c_out, c_lse = fa4.compat.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
    assert fa4.compat.flash_attn_func(q, k, v, causal=True)[1] is None
    lens = [1, 200, 37]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp, kp, vp = (t.reshape(-1, 8, 128)[: sum(lens)] for t in (q, k, v))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    exact = fa4.flash_attn_varlen_func(qp, kp, vp, max_seqlen_q=200, max_seqlen_k=200, **kw)
    loose = fa4.flash_attn_varlen_func(qp, kp, vp, **kw)  # max_seqlen_* = the totals
    official = fa4.compat.flash_attn_varlen_func(qp, kp, vp, **kw)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(exact, loose, official))
