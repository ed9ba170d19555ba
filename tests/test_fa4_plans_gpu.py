"""gpu tier of fa4's launch plans (fa4/_plans.py), across fresh processes as a user meets them.

Process A (an empty disk cache) calls forward + backward three times: the first compiles, the second
records a plan per role, the third replays them in process. Process B (same cache) calls twice: both
replay, without importing CuTe-DSL, and every output and gradient is bitwise equal to A's for the same
inputs (deterministic backward); flash_attn_with_kvcache's decode steps the same (dense and paged caches,
appends with rotary embedding, a window). The cpu tier (tests/test_fa4_plans.py) covers the recorder itself.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.fa4, pytest.mark.gpu]

CHILD = r"""
import json, sys
import torch
import fa4
from fa4 import _plans

cfg = json.loads(sys.argv[1])
b, s, hq, hkv, d, dv = cfg["shape"]
results = []
for call in range(cfg["calls"]):
    g = torch.Generator(device="cuda").manual_seed(100 + call)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = make(b, s, hq, d), make(b, s, hkv, d), make(b, s, hkv, dv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    leaves, kw = [q, k, v], {}
    if cfg.get("sink"):
        leaves.append(torch.randn(hq, device="cuda", generator=g).requires_grad_())
        kw["learnable_sink"] = leaves[-1]
    if cfg.get("lse_grad"):  # a loss on lse too: the backward's preprocess shifts D by dlse
        out, lse = fa4.flash_attn_func(q, k, v, causal=cfg["causal"], deterministic=True, return_lse=True, **kw)
        torch.autograd.backward((out, lse), (make(b, s, hq, dv), torch.randn(b, hq, s, device="cuda", generator=g)))
    else:
        out = fa4.flash_attn_func(q, k, v, causal=cfg["causal"], deterministic=True, **kw)
        out.backward(make(b, s, hq, dv))
    results.append([t.detach().cpu() for t in [out] + [x.grad for x in leaves]])
torch.cuda.synchronize()
torch.save(results, cfg["out"])
cutlass = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print("PLANS " + json.dumps({"stats": _plans.stats(), "cutlass": cutlass}))
"""

CASES = [((2, 300, 4, 2, 64, 64), True, {}), ((1, 257, 6, 6, 192, 128), False, {}),
         ((2, 131, 4, 2, 128, 128), True, {"lse_grad": True, "sink": True})]


def _run(cfg: dict, cache: pathlib.Path) -> dict:
    return _run_child(CHILD, cfg, cache)


def _run_child(child: str, cfg: dict, cache: pathlib.Path) -> dict:
    env = dict(os.environ, FA4_CACHE_DIR=str(cache))
    for name in ("FA4_CACHE", "FA4_PLANS"):
        env.pop(name, None)
    res = subprocess.run([sys.executable, "-c", child, json.dumps(cfg)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("PLANS "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize("shape,causal,extra", CASES, ids=["d64-gqa-causal", "d192x128-full", "d128-lse-grad-sink"])
def test_a_fresh_process_replays_bitwise_without_the_dsl(tmp_path, shape, causal, extra):
    """extra: a loss on lse as well (dlse reaches the recorded preprocess) and a learnable sink (whose
    gradient takes the D rows the replayed backward hands back)."""
    import torch

    cache = tmp_path / "cache"
    first = _run(dict(shape=shape, causal=causal, calls=3, out=str(tmp_path / "a.pt"), **extra), cache)
    assert first["stats"]["recorded"] == 2, first          # the forward's and the backward's plan
    assert first["stats"]["replays"] == 2 and first["cutlass"], first
    assert len(list(cache.rglob("plans/*.json"))) == 2 and list(cache.rglob("*.so"))
    second = _run(dict(shape=shape, causal=causal, calls=2, out=str(tmp_path / "b.pt"), **extra), cache)
    assert second["stats"] == dict(replays=4, recorded=0, unrecordable=0, discarded=0), second
    assert not second["cutlass"], "a replayed call imported CuTe-DSL"
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    names = ("out", "dq", "dk", "dv", "dsink")
    for call in range(2):
        assert len(a[call]) == len(b[call]) == 4 + bool(extra.get("sink"))
        for name, x, y in zip(names, a[call], b[call]):
            assert torch.equal(x, y), f"call {call}: {name} differs between the normal path and the replay"


def test_replay_on_a_side_stream_and_with_one_tensor_as_q_k_v(tmp_path, monkeypatch):
    """In process: a plan recorded with q is k is v replays on a side stream (the kernels launch on
    torch's current stream), and separate tensors of the same shapes take their own path."""
    import torch

    import fa4
    from fa4 import _plans

    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA4_PLANS", raising=False)
    monkeypatch.delenv("FA4_CACHE", raising=False)
    _plans.forget()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    want = fa4.flash_attn_func(x, x, x, causal=True)
    fa4.flash_attn_func(x, x, x, causal=True)                     # recorded
    before = _plans.stats()["replays"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = fa4.flash_attn_func(x, x, x, causal=True)
    side.synchronize()
    assert _plans.stats()["replays"] == before + 1 and torch.equal(got, want)
    q, k, v = (x.clone() for _ in range(3))
    k.mul_(0.5)
    sep = fa4.flash_attn_func(q, k, v, causal=True)
    assert _plans.stats()["replays"] == before + 1              # another signature: the normal path
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    assert (sep.float() - ref).abs().max() < 0.05
    _plans.forget()


PRECOMPILED_CALL = r"""
import json, sys
import torch
import fa4
from fa4 import _plans

q, k, v = (torch.randn(2, 256, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
out = fa4.flash_attn_func(q, k, v, causal=True)
out.float().sum().backward()
torch.cuda.synchronize()
cutlass = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print("PLANS " + json.dumps({"stats": _plans.stats(), "cutlass": cutlass, "finite": bool(q.grad.isfinite().all())}))
"""


def test_precompile_plans_serve_a_fresh_process_without_the_dsl(tmp_path):
    """`precompile --shapes ... --plans 2` alone (no model run) leaves kernels and launch plans that a
    fresh process making exactly that call replays for its forward and backward."""
    cache = tmp_path / "cache"
    env = dict(os.environ, FA4_CACHE_DIR=str(cache))
    for name in ("FA4_CACHE", "FA4_PLANS"):
        env.pop(name, None)
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    pre = subprocess.run([sys.executable, "-m", "fa4", "precompile", "--shapes", "d=64,heads=4/2,causal,seqlen=256",
                          "--plans", "2"], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert pre.returncode == 0 and "2 recorded" in pre.stdout, pre.stdout[-3000:] + pre.stderr[-3000:]
    res = subprocess.run([sys.executable, "-c", PRECOMPILED_CALL], env=env, capture_output=True, text=True,
                         timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("PLANS ")).split(" ", 1)[1])
    assert got["stats"]["replays"] == 2 and not got["cutlass"] and got["finite"], got


DECODE_CHILD = r"""
import json, sys
import torch
import fa4
from fa4 import _plans

cfg = json.loads(sys.argv[1])
b, s, hq, hkv, d, sq, page = cfg["shape"]
results = []
for call in range(cfg["calls"]):
    g = torch.Generator(device="cuda").manual_seed(200 + call)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q = make(b, sq, hq, d)
    lens = torch.randint(0, s - sq, (b,), device="cuda", dtype=torch.int32, generator=g)
    kw = dict(cache_seqlens=lens, causal=cfg["causal"], window_size=tuple(cfg["window"]), return_softmax_lse=True)
    if page:  # pages shuffled through the table
        k_cache, v_cache = make(b * s // page, page, hkv, d), make(b * s // page, page, hkv, d)
        kw["block_table"] = torch.randperm(b * s // page, device="cuda", generator=g).to(torch.int32).view(b, -1)
    else:
        k_cache, v_cache = make(b, s, hkv, d), make(b, s, hkv, d)
    if cfg["append"]:  # new tokens, rotary-embedded, appended in place at cache_seqlens
        angle = torch.rand(s, d // 4, device="cuda", generator=g) * 6.28
        kw.update(k=make(b, sq, hkv, d), v=make(b, sq, hkv, d), rotary_cos=angle.cos(), rotary_sin=angle.sin(),
                  rotary_interleaved=False)
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    results.append([t.cpu() for t in (out, lse, k_cache, v_cache)])
torch.cuda.synchronize()
torch.save(results, cfg["out"])
cutlass = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print("PLANS " + json.dumps({"stats": _plans.stats(), "cutlass": cutlass}))
"""

# (batch, cache, Hq, Hkv, d, query tokens, page size or 0), causal, window, append
DECODE_CASES = [((2, 4096, 32, 8, 128, 1, 0), False, (None, None), False),
                ((3, 2048, 16, 2, 64, 4, 64), True, (None, None), True),
                ((1, 8192, 8, 8, 128, 2, 0), True, (300, 0), True)]


@pytest.mark.parametrize("shape,causal,window,append", DECODE_CASES, ids=["dense-one-token", "paged-append-causal",
                                                                          "dense-append-window"])
def test_decode_steps_replay_bitwise(tmp_path, shape, causal, window, append):
    """flash_attn_with_kvcache's eager step on the device takes launch plans too: process A records
    on the second call and replays the third, process B replays both its calls; outputs, lse and the
    appended caches are bitwise the normal path's (A's) for the same inputs."""
    import torch

    cache = tmp_path / "cache"
    cfg = dict(shape=shape, causal=causal, window=window, append=append)
    first = _run_child(DECODE_CHILD, dict(cfg, calls=3, out=str(tmp_path / "a.pt")), cache)
    assert first["stats"]["recorded"] == 1 and first["stats"]["replays"] == 1, first
    second = _run_child(DECODE_CHILD, dict(cfg, calls=2, out=str(tmp_path / "b.pt")), cache)
    assert second["stats"] == dict(replays=2, recorded=0, unrecordable=0, discarded=0), second
    if not shape[-1]:  # a paged call asks the kernels' modules which page sizes they read in place
        assert not second["cutlass"], "a replayed decode step imported CuTe-DSL"
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for call in range(2):
        for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), a[call], b[call]):
            assert torch.equal(x, y), f"call {call}: {name} differs between the normal path and the replay"
    assert all(torch.isfinite(a[c][0]).all() for c in range(2))
