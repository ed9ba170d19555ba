"""gpu tier of fa4's launch plans (fa4/_plans.py), across fresh processes as a user meets them.

Process A (an empty disk cache) calls forward + backward three times: the first compiles, the second
records a plan per role, the third replays them in process. Process B (same cache) calls twice: both
replay, without importing CuTe-DSL, and every output and gradient is bitwise equal to A's for the same
inputs (deterministic backward). The cpu tier (tests/test_fa4_plans.py) covers the recorder itself.
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
    out = fa4.flash_attn_func(q, k, v, causal=cfg["causal"], deterministic=True)
    out.backward(make(b, s, hq, dv))
    results.append([t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)])
torch.cuda.synchronize()
torch.save(results, cfg["out"])
cutlass = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print("PLANS " + json.dumps({"stats": _plans.stats(), "cutlass": cutlass}))
"""

CASES = [((2, 300, 4, 2, 64, 64), True), ((1, 257, 6, 6, 192, 128), False)]


def _run(cfg: dict, cache: pathlib.Path) -> dict:
    env = dict(os.environ, FA4_CACHE_DIR=str(cache))
    for name in ("FA4_CACHE", "FA4_PLANS"):
        env.pop(name, None)
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("PLANS "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize("shape,causal", CASES, ids=["d64-gqa-causal", "d192x128-full"])
def test_a_fresh_process_replays_bitwise_without_the_dsl(tmp_path, shape, causal):
    import torch

    cache = tmp_path / "cache"
    first = _run(dict(shape=shape, causal=causal, calls=3, out=str(tmp_path / "a.pt")), cache)
    assert first["stats"]["recorded"] == 2, first          # the forward's and the backward's plan
    assert first["stats"]["replays"] == 2 and first["cutlass"], first
    assert len(list(cache.rglob("plans/*.json"))) == 2 and list(cache.rglob("*.so"))
    second = _run(dict(shape=shape, causal=causal, calls=2, out=str(tmp_path / "b.pt")), cache)
    assert second["stats"] == dict(replays=4, recorded=0, unrecordable=0, discarded=0), second
    assert not second["cutlass"], "a replayed call imported CuTe-DSL"
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for call in range(2):
        for name, x, y in zip(("out", "dq", "dk", "dv"), a[call], b[call]):
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
