"""The launch path of the kernels fa4 runs: TVM-FFI compiles that take torch tensors directly.

Compile tier (CI, no GPU): every kernel of the Hopper forward and backward compiles the way the
GPU path compiles it (fake tensors + ``host_io.launch_stream()`` + ``--enable-tvm-ffi``), is the
same machine code as the compile-only build (same registers, no spills), and exports to an
object the disk cache can load back. GPU tier: a launch follows torch's current stream.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.fa4]


def _launchable_and_plain(key, make_kernel, fake_args):
    """(launchable compile, compile-only build) of one kernel, through the shared compile cache."""
    from stage3_fwd_kernel.compile_cache import compile_cached

    launch = compile_cached(("test-launchable",) + key, lambda: (make_kernel(), fake_args(True)))
    plain = compile_cached(("test-plain",) + key, lambda: (make_kernel(), fake_args(False)))
    return launch, plain


def _fwd(d):
    from stage3_fwd_kernel import hopper, host_io
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    dt = host_io.cutlass_dtype("bf16")
    flags = (True, True, False)  # varlen with seqused_k: the most optional arguments present
    return _launchable_and_plain(
        ("fwd", d), lambda: hopper.make_kernel(dt, d, d, True, policy=hopper.DEFAULT_POLICY,
                                               scheduler=StaticTileScheduler),
        lambda launchable: hopper._fake_args(dt, d, d, flags, launchable=launchable))


def _bwd_main(d):
    from stage4_bwd_kernel import common, host
    from stage4_bwd_kernel import hopper as bwd

    dt = common.cutlass_dtype("bf16")
    step = bwd.step_for(d, True, True)

    def make():
        return step.make_kernel(dt, d, d, True, True, varlen=False, has_seqused_k=False,
                                dq_order=common.default_dq_order(True, True), tiles=None)
    arrivals = host.takes_dq_arrivals(make())
    return _launchable_and_plain(
        ("bwd", d), make, lambda launchable: host.fake_main_args(dt, d, d, launchable=launchable,
                                                                       with_arrivals=arrivals))


def _bwd_pre(d):
    from stage4_bwd_kernel import common
    from stage4_bwd_kernel import preprocess as pre

    dt = common.cutlass_dtype("bf16")
    return _launchable_and_plain(("pre", d), lambda: pre.BackwardPreprocess(dt, d, d, True),
                                 lambda launchable: pre._fake_args(dt, d, d, launchable=launchable))


def _bwd_post(d):
    from stage4_bwd_kernel import common
    from stage4_bwd_kernel import postprocess as post

    dt = common.cutlass_dtype("bf16")
    return _launchable_and_plain(("post", d), lambda: post.BackwardPostprocess(dt, d, True),
                                 lambda launchable: post._fake_args(dt, d, launchable=launchable))


KERNELS = {"forward": _fwd, "backward-main": _bwd_main, "backward-pre": _bwd_pre, "backward-post": _bwd_post}


@pytest.mark.compile
@pytest.mark.parametrize("name", list(KERNELS))
def test_launchable_compile_is_the_compile_only_kernel(name):
    launch, plain = KERNELS[name](64)
    assert "TVMFFI" in type(launch.fn).__name__, type(launch.fn).__name__
    assert "TVMFFI" not in type(plain.fn).__name__
    # same machine code: same registers, no spills, same SASS length
    assert launch.report["registers"] == plain.report["registers"] is not None
    assert launch.report["spill_stores"] == 0 and launch.report["spill_loads"] == 0
    assert launch.sass and len(launch.sass.splitlines()) == len(plain.sass.splitlines())


@pytest.mark.compile
def test_launchable_compile_exports_and_reloads(tmp_path):
    from fa4 import _cache

    launch, _ = _bwd_post(64)
    data = _cache.export_object(launch.fn, "fa4_test_post")
    assert data[:4] == b"\x7fELF"
    path = tmp_path / "post.o"
    path.write_bytes(data)
    fn = _cache.load_object(path, "fa4_test_post")
    assert callable(fn) and type(fn).__name__ == "Function"


def _same_kinds(real, fake):
    """Launch arguments (torch tensors, Python numbers or None; no stream) agree position by
    position with the compiled signature (fake tensors, Float32 / Int32 or None, then the stream):
    tensor vs scalar, element type, rank, contiguous last mode."""
    import torch
    from cutlass import BFloat16, Float16, Float32, Int32

    elem = {torch.bfloat16: BFloat16, torch.float16: Float16, torch.float32: Float32, torch.int32: Int32}
    assert len(real) == len(fake) - 1, (len(real), len(fake))
    assert hasattr(fake[-1], "use_tvm_ffi_env_stream")  # the stream comes last and is not passed
    for i, (a, f) in enumerate(zip(real, fake)):
        if a is None or f is None:  # an absent optional tensor is absent on both sides
            assert a is None and f is None, (i, a, f)
        elif isinstance(a, torch.Tensor):
            assert hasattr(f, "element_type"), (i, type(f).__name__)
            assert elem[a.dtype] == f.element_type, (i, a.dtype, f.element_type)
            assert a.dim() == len(f.shape), (i, a.shape, f.shape)
            assert a.stride(-1) == 1, (i, a.stride())
        else:
            want = {float: Float32, int: Int32}[type(a)]
            assert isinstance(f, want), (i, a, type(f).__name__)


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_launch_arguments_match_the_compiled_signature(varlen):
    """The GPU path launches with torch tensors (host.main_args and friends) a kernel compiled
    against fake tensors; the two lists must line up position by position. Built here from CPU
    tensors (kinds, dtypes and ranks are what is compared)."""
    torch = pytest.importorskip("torch")
    from stage4_bwd_kernel import common, host, postprocess, preprocess

    B, S, H, HK, D = 2, 100, 4, 2, 128
    if varlen:
        q = torch.zeros(S, H, D, dtype=torch.bfloat16)
        k = torch.zeros(S + 7, HK, D, dtype=torch.bfloat16)
        lse = torch.zeros(H, S)
        cu_q = torch.tensor([0, 40, S], dtype=torch.int32)
        cu_k = torch.tensor([0, 50, S + 7], dtype=torch.int32)
        used = torch.tensor([50, 3], dtype=torch.int32)
        sem = torch.zeros(1, dtype=torch.int32).view(1, 1, 1)
    else:
        q = torch.zeros(B, S, H, D, dtype=torch.bfloat16)
        k = torch.zeros(B, S + 7, HK, D, dtype=torch.bfloat16)
        lse = torch.zeros(B, H, S)
        cu_q = cu_k = used = torch.zeros(1, dtype=torch.int32)
        sem = torch.zeros(B, H, 2, dtype=torch.int32)
    acc = torch.zeros(q.shape)
    dt = common.cutlass_dtype("bf16")
    for arrivals in (None, sem.clone()):  # the lessons' kernels, and the production kernel's arrival counters
        real = host.main_args(q, k, k.clone(), q.clone(), lse, lse.clone(), acc, k.clone(), k.clone(), varlen=varlen,
                              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, semaphores=sem, num_n_blocks=2,
                              softmax_scale=0.1, arrivals=arrivals)
        _same_kinds(real, host.fake_main_args(dt, D, D, launchable=True, with_arrivals=arrivals is not None))
    up = (lambda t: t.unsqueeze(0)) if varlen else (lambda t: t)
    for dlse in (up(lse), None):  # None: the 1-element stand-in and the flag 0
        _same_kinds(preprocess.preprocess_args(up(q), up(q), up(lse), up(lse), up(lse), up(acc), cu_q, dlse, 2),
                    preprocess._fake_args(dt, D, D, launchable=True))
    _same_kinds(postprocess.postprocess_args(up(acc), up(q), cu_q, 0.1, 2), postprocess._fake_args(dt, D, launchable=True))


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_forward_launch_arguments_match_the_compiled_signature(varlen):
    torch = pytest.importorskip("torch")
    from stage3_fwd_kernel import hopper, host_io

    q = torch.zeros(1 if varlen else 2, 100, 4, 128, dtype=torch.bfloat16)
    lse = torch.zeros(q.shape[0], 4, 100)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32) if varlen else None
    real = hopper._call_args(q, q, q, q.clone(), lse, 0.1, 100, cu, cu, cu[1:] if varlen else None)
    _same_kinds(real, hopper._fake_args(host_io.cutlass_dtype("bf16"), 128, 128, (varlen, varlen, False),
                                        launchable=True))


# -- host time per call: what a launch does when its kernel is already compiled ---------------------------------
@pytest.mark.cpu
@pytest.mark.parametrize("token_rows", [False, True], ids=["rows", "token_rows"])
def test_parts_merge_memory_hit_builds_no_fake_tensors(monkeypatch, token_rows):
    """A merge whose kernel is in memory returns it without building the compile's fake tensors
    (they cost ~35 us of host time on every decode step)."""
    pytest.importorskip("cutlass")
    from stage3_fwd_kernel import compile_cache, host_io, split_combine

    dt = host_io.cutlass_dtype("bf16")
    key = (split_combine.PARTS_STEP, "gpu", str(dt), 128) + (("token_rows",) if token_rows else ())
    sentinel = object()
    monkeypatch.setitem(compile_cache._CACHE, key, sentinel)

    def no_fakes(*args, **kwargs):
        raise AssertionError("a fake tensor was built for a kernel already in memory")
    for name in ("fake_bshd", "fake_lse"):
        monkeypatch.setattr(host_io, name, no_fakes)
    monkeypatch.setattr(split_combine, "_fake_token_rows", no_fakes)
    assert split_combine.compile_parts(dt, 128, launchable=True, token_rows=token_rows) is sentinel
    with pytest.raises(AssertionError, match="fake tensor"):  # a miss still builds them
        split_combine.compile_parts(dt, 64, launchable=True, token_rows=token_rows)


@pytest.mark.cpu
def test_launch_arguments_detach_only_where_the_launch_cannot_take_grad(monkeypatch):
    """With torch's C DLPack exchange API, TVM-FFI takes a tensor that requires grad as it is (no
    detach on the host path, no detach step in a launch plan); without it, a detached view of the same
    memory. Tensors that need no grad are never touched."""
    torch = pytest.importorskip("torch")
    from stage3_fwd_kernel import hopper, host_io

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    k = q.clone().requires_grad_(True)
    lse = torch.zeros(1, 2, 8)
    monkeypatch.setattr(host_io, "launch_takes_grad_tensors", lambda: True)
    args = hopper._call_args(q, k, q, q, lse, 0.1, 8)
    assert args[0] is q and args[1] is k and args[3] is q and args[4] is lse
    monkeypatch.setattr(host_io, "launch_takes_grad_tensors", lambda: False)
    args = hopper._call_args(q, k, q, q, lse, 0.1, 8)
    assert args[0] is q and args[3] is q and args[4] is lse          # no detach() where none is needed
    assert args[1] is not k and not args[1].requires_grad
    assert args[1].data_ptr() == k.data_ptr()
    assert host_io.launch_view(None) is None


@pytest.mark.cpu
def test_cutlass_dtype_resolves_once_and_refuses_the_rest():
    torch = pytest.importorskip("torch")
    cutlass = pytest.importorskip("cutlass")
    from stage3_fwd_kernel import host_io

    for _ in range(2):  # the second call is the memo's
        assert host_io.cutlass_dtype(torch.bfloat16) is cutlass.BFloat16
        assert host_io.cutlass_dtype("fp16") is cutlass.Float16
    for bad in (torch.float32, "fp8", ["bf16"]):  # a list is unhashable: refused without the memo
        with pytest.raises(TypeError, match="dtype"):
            host_io.cutlass_dtype(bad)
    assert torch.float32 not in host_io._DTYPES


@pytest.mark.cpu
def test_align_16B_keeps_aligned_tensors_and_copies_the_rest():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cutlass")
    from stage3_fwd_kernel import host_io

    t = torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    assert host_io.align_16B(t) is t
    assert host_io.align_16B(t[:, :, 1:3]) is not None and host_io.align_16B(t[:, :, 1:3]).data_ptr() == \
        t[:, :, 1:3].data_ptr()                                           # a head slice: strides still aligned
    for bad in (t[..., 1:33],                                            # base off 16 bytes
                t.transpose(-1, -2),                                     # last stride not 1
                torch.zeros(2, 16, 4, 60, dtype=torch.bfloat16)[..., :56],  # row stride 60: not 16-byte
                torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16).expand(2, 16, 4, 64)):  # broadcast (stride 0)
        fixed = host_io.align_16B(bad)
        assert fixed is not bad and fixed.is_contiguous() and torch.equal(fixed, bad)
    one = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16).expand(1, 16, 1, 64)
    assert host_io.align_16B(one) is one                                 # a size-1 mode's stride does not matter


BLACKWELL_LAUNCHABLE = """
import json
from stage4_bwd_kernel import blackwell_bwd as bb, common, host
dt = common.cutlass_dtype("bf16")
kernel = bb.make_kernel(dt, 128, 128, True, False, varlen=False, has_seqused_k=False,
                        dq_order=common.default_dq_order(True, False), tiles=None)
comp = common.compile_cached(("test", "gpu"), lambda: (kernel, host.fake_main_args(dt, 128, 128, launchable=True)))
print(json.dumps({"type": type(comp.fn).__name__, "arch": common.ARCH, "registers": comp.report["registers"],
                  "spills": comp.report["spill_stores"], "utchmma": comp.sass.count("UTCHMMA")}))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_blackwell_backward_launchable_compile_for_sm100a():
    """fa4 on a B200 runs the Blackwell 1-CTA backward through stage 4's host.backward, i.e. as a
    launchable (TVM-FFI) compile in a process whose CUTE_DSL_ARCH is sm_100a: that build must
    compile (unverified on hardware; this checks it builds, without spills, with its MMAs)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, "-c", BLACKWELL_LAUNCHABLE], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["arch"] == "sm_100a" and "TVMFFI" in rep["type"], rep
    assert rep["registers"] and rep["spills"] == 0 and rep["utchmma"] > 0, rep


@pytest.mark.gpu
def test_launch_follows_torchs_current_stream():
    """fa4 forward + backward issued on a side stream that is still busy writing q: a launch on any
    other stream would read the NaN poison in q before the copy lands."""
    import torch

    import fa4
    from stage0_reference.torch_reference import attention_ref

    g = torch.Generator(device="cuda").manual_seed(3)
    src = [torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    dout = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    fa4.flash_attn_func(*src, causal=True)  # compile outside the timed window
    side = torch.cuda.Stream()
    q = torch.full_like(src[0], float("nan")).requires_grad_(True)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~30 ms of GPU time ahead of the copy
        with torch.no_grad():
            q.copy_(src[0])
        out = fa4.flash_attn_func(q, src[1], src[2], causal=True)
        out.backward(dout)
    side.synchronize()
    ref = attention_ref(src[0], src[1], src[2], causal=True, upcast=True)[0]
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out.float() - ref.float()).abs().max().item() < 0.05

