"""fa4/_decode_route.py on the CPU: which calls take the split launch (shapes, the switch, the arch, a
gradient), a packed varlen q of one token a sequence seen as (B, 1, H, D), and the results put back in
the varlen layouts. The GPU tier runs the route (tests/test_fa4_decode_route_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fa4 import _decode_route as route
from fa4 import _dispatch

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


def _cuda_like(*shape):
    """Shapes on a 'cuda' device, without one: what `takes` reads."""
    return SimpleNamespace(device=torch.device("cuda"), shape=shape, requires_grad=False)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: SimpleNamespace(SPLIT_KV_LAUNCH=True))


@pytest.mark.parametrize("tokens, keys, batch, taken", [(1, 8192, 1, True), (64, 100, 3, True), (65, 8192, 1, False),
                                                        (0, 10, 1, False), (1, 0, 1, False), (1, 10, 0, False),
                                                        (1, 10, 65536, False)])
def test_takes_by_shape(hopper, tokens, keys, batch, taken):
    q, k = _cuda_like(batch, tokens, 32, 128), _cuda_like(batch, keys, 8, 128)
    assert route.takes(q, k, k, None, tokens, keys, batch) is taken


def test_takes_switch_arch_and_device(hopper, monkeypatch):
    q, k = _cuda_like(1, 1, 32, 128), _cuda_like(1, 4096, 8, 128)
    assert route.takes(q, k, k, None, 1, 4096, 1)
    monkeypatch.setattr(_dispatch, "DECODE_ROUTE_MAX_QUERY", 4)
    assert route.takes(q, k, k, None, 4, 4096, 1) and not route.takes(q, k, k, None, 5, 4096, 1)
    monkeypatch.setattr(_dispatch, "DECODE_ROUTE_MAX_QUERY", None)
    assert not route.takes(q, k, k, None, 1, 4096, 1)
    monkeypatch.setattr(_dispatch, "DECODE_ROUTE_MAX_QUERY", 64)
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: SimpleNamespace(SPLIT_KV_LAUNCH=False))
    assert not route.takes(q, k, k, None, 1, 4096, 1)       # sm_100: no split launch
    cpu = torch.zeros(1, 1, 32, 128)
    assert not route.takes(cpu, cpu, cpu, None, 1, 4096, 1)


def test_takes_refuses_calls_that_need_a_gradient(hopper):
    # a real tensor that requires grad (its device is not read before the gradient test)
    q, k = torch.zeros(1, 1, 32, 128, requires_grad=True), _cuda_like(1, 4096, 8, 128)
    assert not route.takes(q, k, k, None, 1, 4096, 1)
    sink = torch.zeros(32, requires_grad=True)
    assert not route.takes(_cuda_like(1, 1, 32, 128), k, k, sink, 1, 4096, 1)
    with torch.no_grad():
        assert route.takes(_cuda_like(1, 1, 32, 128), k, k, sink, 1, 4096, 1)


def test_paged_tokens_and_packed_result():
    padded, packed = torch.randn(3, 2, 8, 64), torch.randn(3, 8, 64)
    assert route.paged_tokens(padded, None, None, 3) is padded
    one = route.paged_tokens(packed, torch.arange(4, dtype=torch.int32), 1, 3)
    assert one.shape == (3, 1, 8, 64) and torch.equal(one[:, 0], packed)
    assert route.paged_tokens(packed, torch.arange(4, dtype=torch.int32), 2, 3) is None  # tokens per sequence unknown
    assert route.paged_tokens(packed, torch.arange(4, dtype=torch.int32), None, 3) is None
    assert route.paged_tokens(torch.randn(4, 8, 64), torch.arange(4, dtype=torch.int32), 1, 3) is None
    out, lse = torch.randn(3, 1, 8, 32), torch.randn(3, 8, 1)
    o, l_ = route.packed_result(out, lse, packed=True)
    assert o.shape == (3, 8, 32) and l_.shape == (8, 3) and torch.equal(l_, lse[:, :, 0].t())
    assert route.packed_result(out, lse, packed=False) == (out, lse)


def test_takes_refuses_zero_heads(hopper):
    """Zero query heads are empty calls that the forward serves (check_fixed takes 0 % Hkv == 0); the
    split launch's packing would divide by them."""
    k = _cuda_like(1, 4096, 2, 128)
    assert not route.takes(_cuda_like(1, 1, 0, 128), k, k, None, 1, 4096, 1)
    none = _cuda_like(1, 4096, 0, 128)
    assert not route.takes(_cuda_like(1, 1, 0, 128), none, none, None, 1, 4096, 1)


def test_paged_pair_leaves_padded_head_dims_to_the_gathering_route(monkeypatch):
    """Padding a paged call's head dims would pad the whole page pool: such calls are not routed."""
    monkeypatch.setattr(route, "takes", lambda *args: True)
    monkeypatch.setattr(_dispatch, "backend_for",
                        lambda device: SimpleNamespace(arch=SimpleNamespace(head_dims=((128, 128),))))
    q, pages = torch.randn(2, 1, 8, 80), torch.randn(10, 16, 2, 80)
    table = torch.zeros(2, 3, dtype=torch.int32)
    assert route.paged_pair(q, pages, pages, table, None, None, None, None, None, None, False, (None, None), None,
                            0.0, False, False) is None


def test_takes_refuses_calls_inside_a_forward_ad_level(hopper):
    import torch.autograd.forward_ad as fwad

    q, k = _cuda_like(1, 1, 32, 128), _cuda_like(1, 4096, 8, 128)
    assert route.takes(q, k, k, None, 1, 4096, 1)
    with fwad.dual_level():
        assert not route.takes(q, k, k, None, 1, 4096, 1)


DENSE_CASES = {  # sq, hq, hkv, sk, d, causal, window_size, softcap, sink
    "one-token": (1, 32, 8, 1000, 128, False, (None, None), 0.0, False),
    "causal-window": (3, 16, 2, 700, 128, True, (100, 0), 0.0, False),
    "two-sided-window": (5, 8, 8, 300, 64, False, (64, 2), 0.0, False),
    "window-past-the-cache": (2, 8, 2, 50, 128, False, (5000, 6000), 0.0, False),
    "softcap-sink": (1, 32, 8, 999, 128, True, (-1, -1), 30.0, True),
}


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_decode_runs_the_step_with_kvcache_would(monkeypatch, name):
    """flash_attn_func's decode route skips flash_attn_with_kvcache's checks (_kvcache.dense_decode): the step it
    hands the launch path -- tensors, cache lengths, flags, route -- is the one with_kvcache builds from the same
    call. Fails if dense_decode drops with_kvcache's window clamp, its cache lengths or a flag."""
    from fa4 import _kvcache, _ops, _validate

    sq, hq, hkv, sk, d, causal, window, softcap, with_sink = DENSE_CASES[name]
    backend = SimpleNamespace(arch=SimpleNamespace(head_dims=((64, 64), (128, 128)), key="sm_90"),
                              SPLIT_KV_LAUNCH=True, check_variants=lambda *args: None)
    routes, steps = [], []
    monkeypatch.setattr(_validate, "_check_dtypes_devices", lambda names, tensors: None)  # CPU tensors stand in
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: backend)
    monkeypatch.setattr(_ops, "eager_ok", lambda *tensors: True)
    monkeypatch.setattr(_kvcache, "_device_route", lambda *args: routes.append(args) or (132, "split", False))
    monkeypatch.setattr(_kvcache, "_run_step", lambda *args: steps.append(args) or (None, None))
    q, k, v = torch.randn(2, sq, hq, d), torch.randn(2, sk, hkv, d), torch.randn(2, sk, hkv, d)
    sink = torch.randn(hq) if with_sink else None
    scale = d ** -0.5
    _kvcache.with_kvcache(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                          learnable_sink=sink, return_softmax_lse=True)
    left, right, causal_v, softcap_v, sink_v = _validate.check_variants(q, causal, window, softcap, sink)
    _kvcache.dense_decode(q, k, v, scale, causal_v, left, right, softcap_v, sink_v)
    assert len(steps) == 2 and len(routes) == 2
    (b0, step0, flags0, *route0), (b1, step1, flags1, *route1) = steps
    assert b0 is b1 and flags0 == flags1 and route0 == route1, (flags0, flags1, route0, route1)
    assert len(step0) == len(step1)
    for i, (x, y) in enumerate(zip(step0, step1)):  # the cache lengths (item 7): one shape constant for both
        assert x is y, f"step item {i} differs"
    assert routes[0][1:] == routes[1][1:] and all(a is b for a, b in zip(routes[0][:3], routes[1][:3]))
