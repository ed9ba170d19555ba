"""The first call of a fresh process and what `precompile` warms for it (fa4/firstcall.py, fa4/precompile.py).

* `--shapes` / `--model-config` derive exactly the builds a model's calls launch (unit tests on the
  derivation, no compile);
* the cache keys a launch computes -- fa4's dispatch with real torch tensors, down to the stage
  modules' `compile_cached` -- are the keys `precompile` builds under (forward, backward, varlen,
  LPT, split tail, variants): a launch is stubbed by a recording compile-cache store, so nothing
  compiles and no GPU is needed;
* (compile tier) the launch's own build traces the same kernel as `compile_launchable` (same SASS,
  same kernel symbol), a derived build lands in the disk cache under the launch's key, and a warm
  fresh process compiles nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import types

import pytest
import torch

from fa4 import _cache, _dispatch, firstcall, precompile
from fa4.precompile import Workload

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def run_cli(*args, env=None, timeout=600):
    import os

    return subprocess.run([sys.executable, "-m", "fa4", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


# ================================================================================ derivation
@pytest.mark.cpu
@pytest.mark.fa4
def test_shape_specs_parse_and_reject():
    w = precompile.parse_shape("d=128,heads=32/8,causal,seqlen=4096")
    assert w == Workload(head_dim=128, head_dim_v=128, heads_q=32, heads_kv=8, causal=True, max_seqlen=4096)
    w = precompile.parse_shape("d=192/128,heads=16,noncausal,dtype=fp16,window=64/32,softcap=30,sink")
    assert (w.head_dim, w.head_dim_v, w.heads_kv, w.causal, w.dtype) == (192, 128, 16, False, "fp16")
    assert (w.window, w.softcap, w.sink) == ((64, 32), 30.0, True)
    assert precompile.parse_shape("d=64,window=127").window == (127, 0)  # causal (the default): right = 0
    assert len(precompile.parse_shapes("d=64; d=128,noncausal")) == 2
    import argparse

    for bad in ("heads=8", "d=x", "d=64,heads=6/4", "d=64,seqlen=0", "d=64,color=red", "d=64,window=-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            precompile.parse_shapes(bad)


@pytest.mark.cpu
@pytest.mark.fa4
def test_precompile_plans_needs_shapes_and_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precompile.run(["--head-dims", "64", "--plans", "1"]) == 2
    assert "--plans: only with --shapes" in capsys.readouterr().err
    assert precompile.run(["--shapes", "d=64,seqlen=128", "--plans", "1,2"]) == 2
    assert "--plans: needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        precompile.run(["--shapes", "d=64,seqlen=128", "--plans", "0"])
    assert "--plans: expected an integer >= 1, got '0'" in capsys.readouterr().err
    for empty in (",", ""):  # an unset shell variable: refused, not read as "no --plans"
        with pytest.raises(SystemExit):
            precompile.run(["--shapes", "d=64,seqlen=128", "--plans", empty])
        assert "--plans: expected batch sizes B[,B...]" in capsys.readouterr().err


def _kinds(builds):
    return [(b["kind"], b["head_dim"], b["causal"], tuple(b["variant"].get("window_size", (None, None))),
             b["variant"].get("softcap", 0.0), b["variant"].get("learnable_sink", False)) for b in builds]


@pytest.mark.cpu
@pytest.mark.fa4
def test_model_config_derivation():
    """Head dims, GQA, causal, dtype, sliding windows per layer type, softcap, sinks and the LPT range
    from small Hugging Face configs (no downloads)."""
    llama = dict(model_type="llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, torch_dtype="bfloat16")
    (w,) = precompile.workloads_from_config(llama)
    assert w == Workload("bf16", 128, 128, 32, 8, True, 8192)
    builds = precompile.derive_builds([w])
    lpt = _dispatch.lpt_forward_schedulers("sm_90", 128, 128, 32, 8, 8192)
    assert [b["kind"] for b in builds] == ["fwd"] + ["fwd lpt"] * len(lpt) + ["bwd"]
    assert [b["scheduler"] for b in builds if b["kind"] == "fwd lpt"] == [s for *_, s in lpt]
    assert [b["seqlen_k"] for b in builds if b["kind"] == "fwd lpt"] == [f for f, *_ in lpt]
    assert [b["kind"] for b in precompile.derive_builds([w], backward=False, varlen=True)] == \
        ["fwd"] + ["fwd lpt"] * len(lpt) + ["varlen", "page gather"]
    # --max-seqlen below the LPT threshold: no LPT kernel
    assert [b["kind"] for b in precompile.derive_builds(precompile.workloads_from_config(llama, max_seqlen=2048))] \
        == ["fwd", "bwd"]

    # Phi-3-mini-like (d = 96): the LPT order serves 4096-8191 keys, the 192 x 144 tile in the grid's order
    # from 8192 (stage3 config.grid_order_causal): one "fwd long" build from there, also with --heads
    phi = dict(model_type="phi3", hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
               max_position_embeddings=16384, torch_dtype="bfloat16")
    builds = precompile.derive_builds(precompile.workloads_from_config(phi), backward=False)
    lpt96 = _dispatch.lpt_forward_schedulers("sm_90", 96, 96, 32, 32, 16384)
    assert lpt96 and lpt96[-1][1] == 8191 and all(s is not None for *_, s in lpt96)
    assert [b["kind"] for b in builds] == ["fwd"] + ["fwd lpt"] * len(lpt96) + ["fwd long"]
    assert builds[-1]["seqlen_k"] == 8192
    tail = precompile.lpt_builds([("bf16", 96, 96, True)], [(32, 32)], 16384, "sm_90")
    assert [(b["seqlen_k"], b["scheduler"]) for b in tail][-1] == ((8192, 16384), None)
    cfg, build, label, row = precompile._lpt_task(types.SimpleNamespace(compile_launchable=dict), tail[-1])
    assert cfg == ("bf16", 96, 96, True) and label.startswith("grid order, keys 8192-16384")
    assert build() == dict(dtype="bf16", head_dim=96, head_dim_v=96, causal=True, scheduler=None, seqlen_k=8192)
    assert row["heads_per_section"] is None
    assert all(b["scheduler"] is not None for b in precompile.lpt_builds([("bf16", 128, 128, True)], [(32, 32)],
                                                                         16384, "sm_90"))

    # Mistral: every layer sliding (4096 keys); calls up to 4096 keys are plain, longer ones windowed
    mistral = dict(model_type="mistral", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                   sliding_window=4096, max_position_embeddings=32768, torch_dtype="float16")
    ws = precompile.workloads_from_config(mistral)
    assert [(x.max_seqlen, x.window, x.min_seqlen, x.dtype) for x in ws] == \
        [(4096, None, 1, "fp16"), (32768, (4095, 0), 4097, "fp16")]
    kinds = _kinds(precompile.derive_builds(ws, backward=False))
    assert kinds[0] == ("fwd", 128, True, (None, None), 0.0, False)
    # the windowed calls (all >= 4097 keys) take the short calls' build: a left window keeps a forward
    # on persistent CTAs at every length, so no "fwd long" build of their own
    assert kinds[1][0] == "fwd lpt" and kinds[-1] == ("fwd", 128, True, (4095, 0), 0.0, False)
    assert not any(k[0] == "fwd long" for k in kinds)

    # Gemma 2: alternating layers (no layer_types in the file), softcap, head_dim given
    gemma = dict(model_type="gemma2", hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 sliding_window=4096, attn_logit_softcapping=50.0, max_position_embeddings=8192)
    ws = precompile.workloads_from_config(gemma)
    assert {x.window for x in ws} == {None, (4095, 0)} and all(x.softcap == 50.0 and x.head_dim == 256 for x in ws)
    assert max(x.max_seqlen for x in ws if x.window is None) == 8192  # the full layers' LPT range
    # gpt-oss: layer_types, sinks (forward only: the sink's gradient is torch's), a text_config nesting
    oss = {"text_config": dict(model_type="gpt_oss", hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                               head_dim=64, sliding_window=128, max_position_embeddings=2048,
                               layer_types=["sliding_attention", "full_attention"])}
    builds = precompile.derive_builds(precompile.workloads_from_config(oss))
    assert ("fwd", 64, True, (127, 0), 0.0, True) in _kinds(builds)
    assert ("bwd", 64, True, (127, 0), 0.0, False) in _kinds(builds)
    assert all(b["variant"]["learnable_sink"] for b in builds if b["kind"] == "fwd")
    # Qwen2 with use_sliding_window false: no window; an encoder: not causal; full layers only
    qwen = dict(model_type="qwen2", hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                sliding_window=4096, use_sliding_window=False, max_position_embeddings=1024)
    assert [x.window for x in precompile.workloads_from_config(qwen)] == [None]
    bert = dict(model_type="bert", hidden_size=768, num_attention_heads=12, max_position_embeddings=512)
    assert precompile.workloads_from_config(bert) == [Workload("bf16", 64, 64, 12, 12, False, 512)]


# ================================================================================ launch key == precompile key
class _Recorder:
    """A compile-cache store that answers every lookup with a no-op kernel and records the key: the
    launch path runs to its kernel call without compiling (or a GPU)."""

    def __init__(self):
        self.keys, self.rebuilds = [], {}

    def memory_hit(self, key):
        self.keys.append(key)

    def load(self, key, rebuild):
        from stage3_fwd_kernel.compile_cache import Compiled

        self.keys.append(key)
        self.rebuilds[key] = rebuild
        return Compiled(lambda *a, **k: None, {}, "", "")

    def offer(self, key, compiled):
        pass


@pytest.fixture
def recorder(monkeypatch):
    """(backend, recorder): the sm_90 modules imported, then the recorder behind an empty memory cache;
    CPU tensors pass the kernels' CUDA checks and the persistent grid gets an H100's 132 SMs."""
    from stage3_fwd_kernel import compile_cache, tile_scheduler

    be = _dispatch.make_backend(_dispatch.ARCHS["sm_90"])
    be.forward_module(), be.backward_module()  # installs fa4's store: replaced below
    rec = _Recorder()
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    monkeypatch.setattr(compile_cache, "_STORE", rec)
    monkeypatch.setattr(tile_scheduler, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    return be, rec


def _launch(be, w: Workload, seqlen: int, *, backward=True, varlen=False):
    """What fa4's dispatch launches for one call of `w` with `seqlen` queries and keys (CPU tensors)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[w.dtype]
    q = torch.randn(1, seqlen, w.heads_q, w.head_dim, dtype=dt)
    k = torch.randn(1, seqlen, w.heads_kv, w.head_dim, dtype=dt)
    v = torch.randn(1, seqlen, w.heads_kv, w.head_dim_v, dtype=dt)
    window = (None, None) if w.window is None else (w.window[0], None if w.causal else w.window[1])
    sink = torch.zeros(w.heads_q) if w.sink else None
    var = dict(window=window, softcap=w.softcap)
    scale = w.head_dim ** -0.5
    if varlen:
        cu = torch.tensor([0, seqlen], dtype=torch.int32)
        out, lse = be.varlen_forward(q[0], k[0], v[0], cu, cu, None, seqlen, seqlen, scale, w.causal, **var,
                                     learnable_sink=sink)
        if backward:
            be.varlen_backward(out, q[0], k[0], v[0], out, lse, cu, cu, None, seqlen, seqlen, scale, w.causal, False,
                               **var)
        return
    out, lse = be.forward(q, k, v, scale, w.causal, **var, learnable_sink=sink)
    if backward:
        be.backward(out, q, k, v, out, lse, scale, w.causal, False, **var)


WORKLOADS = [  # (shape spec, key lengths of the launches)
    ("d=96,heads=16/16,causal,seqlen=1024", (1024,)),                       # the first call
    ("d=128,heads=32/8,causal,seqlen=8192", (512, 4096, 8192)),              # LPT, GQA
    ("d=64,heads=16,causal,seqlen=8192", (1024, 8192)),                      # d = 64: long calls not persistent
    ("d=96,heads=8/2,causal,seqlen=16384", (1000, 4096, 8191, 8192, 16384)),  # d = 96: 192 x 144 from 8192
    ("d=96,heads=8/2,causal,sink,seqlen=16384", (4096, 8192)),                 # ... but not with a sink
    ("d=128,heads=16,noncausal,seqlen=8192", (256, 8192)),                   # split tail on long ones
    ("d=192/128,heads=8/2,causal", (640,)),
    ("d=64,heads=8,noncausal,dtype=fp16", (300,)),
    ("d=128,heads=8/2,causal,window=255,softcap=30,sink,seqlen=4096", (1000, 4096)),
    ("d=64,heads=4,noncausal,window=100/20,seqlen=512", (512,)),
]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("spec,lengths", WORKLOADS, ids=[w[0] for w in WORKLOADS])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_launch_keys_are_the_precompiled_keys(recorder, spec, lengths, varlen):
    """Every kernel key a launch asks the compile cache for (forward and backward, fa4's dispatch with
    torch tensors) is one that `precompile --shapes SPEC` builds: a warm disk cache serves it."""
    be, rec = recorder
    (w,) = precompile.parse_shapes(spec)
    fwd_mod, bwd_mod = be.forward_module(), be.backward_module()
    for b in precompile.derive_builds([w], varlen=varlen):
        precompile.derived_task(fwd_mod, bwd_mod, b)[1]()
    built = set(rec.keys)
    assert built and all(_cache.persistable(k) for k in built)
    rec.keys.clear()
    for n in lengths:
        if varlen:
            _launch(be, w, n, varlen=True)
        else:
            _launch(be, w, n)
    launched = set(rec.keys)
    assert launched and launched <= built, sorted(map(repr, launched - built))
    assert any(k[:2] == ("hopper_forward", "gpu") for k in launched)  # the forward was reached
    assert sum(1 for k in launched if k[0] != "hopper_forward") >= 3  # preprocess, main, postprocess


@pytest.fixture
def blackwell_recorder(monkeypatch, recorder):
    """(sm_100 backend, recorder): the Blackwell modules put in place without retargeting this sm_90a
    process (nothing compiles: the recorder answers), their GPU checks told a B200 is here."""
    from stage3_fwd_kernel import blackwell_fwd
    from stage4_bwd_kernel import blackwell

    _, rec = recorder
    be = _dispatch.make_backend(_dispatch.ARCHS["sm_100"])
    be._mods.update(fwd=blackwell_fwd, bwd=blackwell)
    monkeypatch.setattr(blackwell_fwd, "blackwell_gpu_available", lambda: True)
    monkeypatch.setattr(blackwell, "_capability", lambda: (10, 0))
    monkeypatch.setattr(_dispatch, "_BLACKWELL_WARNED", True)
    monkeypatch.setattr(_dispatch, "_l2_bytes", lambda device: 126 << 20)
    return be, rec


BLACKWELL_WORKLOADS = [  # (shape spec, key lengths of the launches): causal calls below the LPT lengths
    ("d=128,heads=32/8,causal,seqlen=2048", (300, 2048)),
    ("d=64,heads=8,noncausal,seqlen=16384", (256, 16384)),                   # persistent CTAs
    ("d=128/64,heads=8/2,noncausal,seqlen=1024", (1024,)),
    ("d=192/128,heads=8/2,causal", (640,)),                                  # the wide backward
    ("d=256,heads=4,noncausal,dtype=fp16", (300,)),                          # one Q tile, not persistent
    ("d=128,heads=8/2,causal,window=255,softcap=30,sink,seqlen=4096", (1000, 4096)),
    ("d=64,heads=4,noncausal,window=100/20,seqlen=512", (512,)),
    ("d=128,heads=4,noncausal,sink", (384,)),                                # a sink at dv = 128: the static grid
]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("spec,lengths", BLACKWELL_WORKLOADS, ids=[w[0] for w in BLACKWELL_WORKLOADS])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_blackwell_launch_keys_are_the_precompiled_keys(blackwell_recorder, spec, lengths, varlen):
    """sm_100 (never run here): every key fa4's Blackwell dispatch asks the compile cache for, forward
    and backward, is one `precompile --arch sm_100a --shapes SPEC` builds."""
    be, rec = blackwell_recorder
    (w,) = precompile.parse_shapes(spec)
    builds = precompile.derive_builds([w], "sm_100", varlen=varlen)
    assert {b["kind"] for b in builds} <= {"fwd", "bwd", "varlen", "bwd varlen"}, builds
    for b in builds:
        precompile.derived_task(be.forward_module(), be.backward_module(), b)[1]()
    built = set(rec.keys)
    assert built and all(_cache.persistable(k) for k in built)
    rec.keys.clear()
    for n in lengths:
        _launch(be, w, n, varlen=varlen)
    launched = set(rec.keys)
    assert launched and launched <= built, sorted(map(repr, launched - built))
    assert any(k[:2] == ("blackwell_fwd", "gpu") for k in launched)  # the forward was reached
    assert any(k[0] == "gpu" and k[1] == "blackwell_bwd" for k in launched)  # and the backward's main kernel


@pytest.mark.cpu
@pytest.mark.fa4
def test_blackwell_long_causal_calls_compile_their_lpt_kernel_on_first_use(blackwell_recorder, capsys):
    """sm_100's long causal forwards take LPT sections sized by the device's L2: precompile leaves them
    out and says so; the only key such a launch adds is that LPT forward."""
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    be, rec = blackwell_recorder
    (w,) = precompile.parse_shapes("d=128,heads=16,causal,seqlen=8192")
    builds = precompile.derive_builds([w], "sm_100")
    assert [b["kind"] for b in builds] == ["fwd", "bwd"]  # the short calls' forward (static grid), the backward
    (note,) = precompile.arch_notes([w], "sm_100")
    assert "compile them on first use" in note and precompile.arch_notes([w], "sm_90") == []
    decode = precompile.parse_shapes("d=128,heads=32/8,causal,seqlen=1024,decode")
    kinds = [b["kind"] for b in precompile.derive_builds(decode, "sm_100")]
    assert kinds == ["fwd", "bwd", "kvcache", "kvcache", "combine"]  # decoding's segments: derived too
    assert precompile.arch_notes(decode, "sm_100") == []
    for b in builds:
        precompile.derived_task(be.forward_module(), be.backward_module(), b)[1]()
    built = set(rec.keys)
    rec.keys.clear()
    _launch(be, w, 8192)
    (missing,) = set(rec.keys) - built
    assert missing[:2] == ("blackwell_fwd", "gpu") and missing[4] is not StaticTileScheduler
    assert missing[4].heads_per_section >= 1  # stage 5's LPT order


@pytest.mark.cpu
@pytest.mark.fa4
def test_blackwell_lpt_kernels_are_precompiled_given_the_l2_size(blackwell_recorder, capsys):
    """`--arch sm_100a --l2-bytes N` (the fixture's device reports 126 MiB): the LPT sections of long
    causal calls follow that L2, so precompile builds them and every key the launches ask for was built
    (no note); a different L2 gives other sections, whose keys a launch on this device would miss."""
    be, rec = blackwell_recorder
    (w,) = precompile.parse_shapes("d=128,heads=16,causal,seqlen=16384")
    l2 = _dispatch._l2_bytes(None)
    builds = precompile.derive_builds([w], "sm_100", l2_bytes=l2)
    assert [b["kind"] for b in builds].count("fwd lpt") >= 2 and precompile.arch_notes([w], "sm_100", l2) == []
    for b in builds:
        precompile.derived_task(be.forward_module(), be.backward_module(), b)[1]()
    built = set(rec.keys)
    rec.keys.clear()
    for n in (2048, 8192, 16384):
        _launch(be, w, n)
    launched = set(rec.keys)
    assert launched <= built, sorted(map(repr, launched - built))
    assert sum(hasattr(k[4], "heads_per_section") for k in launched if k[:2] == ("blackwell_fwd", "gpu")) >= 2
    other = {b["scheduler"] for b in precompile.derive_builds([w], "sm_100", l2_bytes=l2 // 4, backward=False)
             if b["kind"] == "fwd lpt"}
    assert other and not other <= {k[4] for k in launched if k[:2] == ("blackwell_fwd", "gpu")}
    assert precompile.main(precompile_args(["--arch", "sm_90a", "--l2-bytes", "1000"])) == 2
    assert "--l2-bytes: only with --arch sm_100a" in capsys.readouterr().err


def precompile_args(argv):
    import argparse

    p = argparse.ArgumentParser()
    precompile.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("spec", ["d=128,heads=32/8,causal,seqlen=8192,decode",
                                  "d=64,heads=8/8,noncausal,softcap=30,window=256,seqlen=2048,decode"])
def test_blackwell_decode_launch_keys_are_the_precompiled_keys(blackwell_recorder, spec):
    """sm_100 has no split launch: flash_attn_with_kvcache runs key segments of the varlen forward with
    seqused_k and merges them. With `decode`, `precompile --arch sm_100a` builds every key those launches
    and flash_attn_func's one-row calls ask for: the segments one token reads (no causal mask, a window
    as a key range), several causal tokens' (the group packed by token, unpacked by the merge), and both
    merges."""
    from fa4 import _kvcache

    be, rec = blackwell_recorder
    (w,) = precompile.parse_shapes(spec)
    for b in precompile.derive_builds([w], "sm_100", backward=False):
        precompile.derived_task(be.forward_module(), be.backward_module(), b)[1]()
    built = set(rec.keys)
    assert sum(k[0] == "fwd_parts_combine" for k in built) == 2
    rec.keys.clear()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[w.dtype]
    g, scale = w.heads_q // w.heads_kv, w.head_dim ** -0.5
    for sk in (300, w.max_seqlen):
        k = torch.randn(2, sk, w.heads_kv, w.head_dim, dtype=dt)
        full = (None, None) if w.window is None else (w.window[0], None if w.causal else w.window[1])
        be.forward(torch.randn(2, 1, w.heads_q, w.head_dim, dtype=dt), k, k, scale, w.causal, window=full,
                   softcap=w.softcap)
        kf = k.reshape(-1, w.heads_kv, w.head_dim)
        lens = torch.tensor([sk, sk // 2], dtype=torch.int32)
        for tokens in [1] + ([4] if w.causal else []):
            # one token: a free mask, its window a key range (segments from the window's first key);
            # several causal tokens: one segment a sequence, causal and windowed, the group packed by token
            window, left = _kvcache.key_range_window(tokens, w.window or (None, None), False)
            causal = w.causal and tokens > 1
            n = 3 if tokens == 1 else 1
            seg = _kvcache.dense_segments(lens, torch.arange(2, dtype=torch.int32), sk, n, left)
            rows = tokens * g
            cu_q = torch.arange(0, (2 * seg.n + 1) * rows, rows, dtype=torch.int32)
            out, lse = be.varlen_forward(torch.randn(2 * seg.n * rows, w.heads_kv, w.head_dim, dtype=dt), kf, kf,
                                         cu_q, seg.cu_k, seg.used, rows, seg.max_keys, scale, causal, window=window,
                                         softcap=w.softcap)
            _kvcache.merge_segments(out.view(2 * seg.n, rows, w.heads_kv, -1), lse.view(w.heads_kv, 2 * seg.n, rows),
                                    seg.n, kernel=True, unpack=g if tokens > 1 and seg.n > 1 else 1)
        # several tokens split into segments too (a non-causal call), merged unpacked
        seg = _kvcache.dense_segments(lens, torch.arange(2, dtype=torch.int32), sk, 3)
        cu_q = torch.arange(0, (2 * seg.n + 1) * 2 * g, 2 * g, dtype=torch.int32)
        out, lse = be.varlen_forward(torch.randn(2 * seg.n * 2 * g, w.heads_kv, w.head_dim, dtype=dt), kf, kf, cu_q,
                                     seg.cu_k, seg.used, 2 * g, seg.max_keys, scale, False, softcap=w.softcap)
        _kvcache.merge_segments(out.view(2 * seg.n, 2 * g, w.heads_kv, -1), lse.view(w.heads_kv, 2 * seg.n, 2 * g),
                                seg.n, kernel=True, unpack=g)
    launched = set(rec.keys)
    # a long causal flash_attn_func call takes an LPT kernel sized by the device's L2, compiled on first
    # use (arch_notes); everything else was built
    lpt = {k for k in launched - built if hasattr(k[4], "heads_per_section")}
    assert launched and launched - lpt <= built, sorted(map(repr, launched - built))
    assert bool(lpt) == w.causal and len(precompile.arch_notes([w], "sm_100")) == int(w.causal)
    assert sum(k[0] == "fwd_parts_combine" for k in launched) == (2 if g > 1 else 1)  # unpacking needs a group
    assert any(k[:2] == ("blackwell_fwd", "gpu") and "seqused_k" in k for k in launched)


@pytest.mark.compile
@pytest.mark.fa4
@pytest.mark.slow
def test_precompile_for_sm100a_writes_launchable_kernels(tmp_path):
    """`precompile --arch sm_100a` on a CPU machine: the forward, the backward's three kernels and the
    varlen forward are written to the disk cache (compiled only: no Blackwell GPU loads them here), and a
    second run finds every one of them there."""
    env = {"FA4_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    args = ("precompile", "--arch", "sm_100a", "--head-dims", "64", "--causal", "yes")
    first = run_cli(*args, env=env, timeout=1200)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("written to disk") == 3 and "not runnable" not in first.stdout, first.stdout
    assert "compile them on first use" in first.stdout  # causal: the LPT kernels' note
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) == 5, objects  # forward, preprocess, main, postprocess, varlen forward
    second = run_cli(*args, env=env, timeout=600)
    assert second.returncode == 0 and second.stdout.count("already on disk") == 3, second.stdout + second.stderr


@pytest.mark.cpu
@pytest.mark.fa4
def test_firstcall_table_and_help():
    runs = {name: {"steps": [("import torch", 1.0), ("first forward", t)], "in_process_s": 1.5 + t, "process_s": 2 + t,
                   "stats": {"misses": int(t > 1), "disk_hits": int(t < 1)}} for name, t in (("cold", 4.0), ("warm", 0.02))}
    text = firstcall.table(runs)
    assert "first forward" in text and "4.000" in text and "0.020" in text and "1 / 0" in text and "0 / 1" in text
    assert firstcall.shape_spec(dict(head_dim=96, head_dim_v=96, heads_q=16, heads_kv=4, causal=True, seqlen=1024,
                                     dtype="bf16")) == "d=96,heads=16/4,causal,seqlen=1024,dtype=bf16"
    # the goal's measure: after import torch, up to the finished first calls -- sub-rows, the second
    # calls (they record plans) and the child's own bookkeeping (in_process_s beyond the steps) left out
    run = {"steps": [("import torch", 2.0), ("import fa4", 0.05), ("cuda init + inputs", 0.1), ("first forward", 0.08),
                     ("  load from disk", 0.07), ("second forward", 0.5), ("first backward", 0.04),
                     ("second backward", 0.3)], "in_process_s": 4.0}
    assert firstcall.first_calls_s(run) == pytest.approx(0.05 + 0.1 + 0.08 + 0.04)
    assert "first calls above torch" in text
    res = run_cli("firstcall", "--help", timeout=120)
    assert res.returncode == 0 and "python -m fa4 firstcall" in res.stdout and "--head-dim" in res.stdout
    res = run_cli("--help", timeout=120)
    assert "    firstcall" in res.stdout
    res = run_cli("precompile", "--shapes", "d=64", "--head-dims", "64", timeout=120)
    assert res.returncode == 2 and "leave out --head-dims" in res.stderr, res.stderr


# ================================================================================ compile tier
def _kernel_symbols(comp) -> list:
    from stage3_fwd_kernel.compile_cache import _artifact

    cubin = _artifact(comp.fn.__cubin__, "rb")
    return sorted(set(re.findall(rb"\.text\.(kernel_\w+)", cubin)))


@pytest.mark.compile
@pytest.mark.fa4
def test_launch_traces_the_precompiled_kernel(recorder, monkeypatch):
    """The launch's own build (the closure its compile_cached call carries) and compile_launchable
    trace the same kernel: same symbol (including its gmemalign16 argument mangling) and the same
    SASS after benchmarks.inspect.sass_fingerprint.normalise."""
    from benchmarks.inspect.sass_fingerprint import normalise
    from stage3_fwd_kernel import compile_cache

    be, rec = recorder
    (w,) = precompile.parse_shapes("d=96,heads=16,causal,seqlen=1024")
    _launch(be, w, 1024, backward=False)
    (key,) = [k for k in rec.keys if k[:2] == ("hopper_forward", "gpu")]
    monkeypatch.setattr(compile_cache, "_STORE", None)
    launch_build = rec.rebuilds[key]()                       # compiles what the launch would have
    monkeypatch.setattr(compile_cache, "_CACHE", {})
    (pre,) = be.forward_module().compile_launchable("bf16", 96, 96, True)
    assert pre.fn is not launch_build.fn  # two compiles
    assert _kernel_symbols(pre) == _kernel_symbols(launch_build) and b"gmemalign16" in _kernel_symbols(pre)[0]
    digest = lambda c: hashlib.sha256(normalise(c.sass).encode()).hexdigest()  # noqa: E731
    assert pre.sass and digest(pre) == digest(launch_build)


@pytest.mark.compile
@pytest.mark.fa4
def test_precompile_model_config_lands_under_the_launch_key(tmp_path, recorder):
    """`precompile --model-config` on a small config: the derived forward is written to the disk cache
    under the hash of the key a launch of that model computes."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2048, torch_dtype="bfloat16")))
    env = {"FA4_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    res = run_cli("precompile", "--model-config", str(cfg), "--no-backward", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 build(s)" in res.stdout and "fwd bf16 d=64 causal" in res.stdout and "written to disk" in res.stdout
    be, rec = recorder
    _launch(be, Workload("bf16", 64, 64, 4, 2, True), 2048, backward=False)
    (key,) = rec.keys
    files = [p.name for p in (tmp_path / "cache").rglob("*.o")]
    assert [f.split("-")[0] for f in files] == [_cache.key_hash(key)], files


@pytest.mark.compile
@pytest.mark.fa4
def test_firstcall_warm_process_compiles_nothing(tmp_path):
    """`python -m fa4 firstcall`: a cold process compiles the forward; after `precompile --shapes` of
    the same call a fresh process loads it from disk and compiles nothing."""
    out = tmp_path / "fc.json"
    res = run_cli("firstcall", "--head-dim", "64", "--causal", "--seqlen", "256", "--json", str(out), timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    cold, warm = data["runs"]["cold"], data["runs"]["warm"]
    assert cold["stats"]["misses"] == 1 and warm["stats"]["misses"] == 0 and warm["stats"]["disk_hits"] == 1
    steps = dict(warm["steps"])
    assert steps["  compile"] == 0 and steps["  load from disk"] > 0 and dict(cold["steps"])["  compile"] > 0


@pytest.mark.cpu
@pytest.mark.fa4
def test_firstcall_json_path_is_checked_before_any_run(tmp_path, capsys, monkeypatch):
    """--json is written after the runs (minutes): a directory that does not exist, or a file in
    its place, ends in exit status 2 naming --json before anything runs; a writable one is taken."""
    started = []
    monkeypatch.setattr(firstcall, "run_child", lambda *a, **k: started.append(a) or pytest.fail("a run started"))
    monkeypatch.setattr(firstcall, "precompile", lambda *a, **k: pytest.fail("a run started"))
    (tmp_path / "a_file").write_text("")
    for path, why in ((tmp_path / "missing" / "fc.json", "does not exist"),
                      (tmp_path / "a_file" / "fc.json", "is not a directory"),
                      (tmp_path, "is a directory")):
        assert firstcall.run(["--head-dim", "64", "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert "--json" in err and why in err, err
    assert started == [] and not (tmp_path / "missing").exists()

    class Started(Exception):
        pass

    monkeypatch.setattr(firstcall, "run_child", lambda *a, **k: (_ for _ in ()).throw(Started()))
    with pytest.raises(Started):
        firstcall.run(["--head-dim", "64", "--json", str(tmp_path / "fc.json")])


@pytest.mark.cpu
@pytest.mark.fa4
def test_firstcall_says_a_failed_child_in_a_line(capsys, monkeypatch):
    """A measuring or precompiling process that fails ends firstcall with exit status 1 and its output's
    tail on stderr, not a traceback of the parent."""
    def fail(*a, **k):
        raise firstcall.MeasureFailed("the measured process failed (exit 1):\nchild said no")

    monkeypatch.setattr(firstcall, "run_child", fail)
    assert firstcall.run(["--head-dim", "64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("firstcall: the measured process failed (exit 1)") and "child said no" in err
    assert "Traceback" not in err


@pytest.mark.cpu
@pytest.mark.fa4
def test_bytecode_hint_names_an_uncompiled_package(tmp_path, monkeypatch):
    """A package without __pycache__ gets the compileall hint; one with it (and a missing one) none."""
    from fa4.firstcall import bytecode_hint

    pkg = tmp_path / "fa4_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    hint = bytecode_hint("fa4_probe_pkg")
    assert hint and "not byte-compiled" in hint and "compileall" in hint and str(pkg) in hint
    import compileall

    compileall.compile_dir(str(pkg), quiet=1)
    assert bytecode_hint("fa4_probe_pkg") is None
    assert bytecode_hint("fa4_no_such_package") is None


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("spec", ["d=128,heads=32/8,causal,seqlen=8192,decode",
                                  "d=64,heads=8/8,noncausal,softcap=30,seqlen=2048,decode"])
def test_decode_launch_keys_are_the_precompiled_keys(recorder, spec, monkeypatch):
    """`decode` in a --shapes spec builds what decoding launches: flash_attn_func with one query row
    (64-row tiles, short and long keys) and flash_attn_with_kvcache's varlen forward with seqused_k
    (split-KV segments), its split launch (one token; 4 causal tokens), its merge kernel and the page
    gather of a paged cache that is copied."""
    from fa4 import _kvcache

    be, rec = recorder
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: be)  # fa4_split's lookup, on CPU tensors
    (w,) = precompile.parse_shapes(spec)
    assert w.decode
    fwd_mod, bwd_mod = be.forward_module(), be.backward_module()
    builds = precompile.derive_builds([w], backward=False)
    for b in builds:
        precompile.derived_task(fwd_mod, bwd_mod, b)[1]()
    built = set(rec.keys)
    assert any(k[0] == "fwd_parts_combine" for k in built)
    rec.keys.clear()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[w.dtype]
    for sk in (300, w.max_seqlen):
        q = torch.randn(2, 1, w.heads_q, w.head_dim, dtype=dt)
        k = torch.randn(2, sk, w.heads_kv, w.head_dim, dtype=dt)
        be.forward(q, k, k, w.head_dim ** -0.5, w.causal, softcap=w.softcap)
        # flash_attn_with_kvcache's kernel call: one token, GQA packed, n segments per sequence
        n, rows = 3, w.heads_q // w.heads_kv
        cu_q = torch.arange(0, (2 * n + 1) * rows, rows, dtype=torch.int32)
        seg = _kvcache.dense_segments(torch.tensor([sk, sk // 2], dtype=torch.int32),
                                      torch.arange(2, dtype=torch.int32), sk, n)
        kf = k.reshape(-1, w.heads_kv, w.head_dim)
        be.varlen_forward(torch.randn(2 * n * rows, w.heads_kv, w.head_dim, dtype=dt), kf, kf, cu_q, seg.cu_k,
                          seg.used, rows, seg.max_keys, w.head_dim ** -0.5, False, softcap=w.softcap)
        # ... and its split launch, through fa4's own call: one token, and (causal) 4 tokens, the GQA
        # group packed as rows where fa4 packs it
        lens = torch.tensor([sk, sk // 2], dtype=torch.int32)
        for tokens in [1] + ([4] if w.causal else []):
            causal, _, pack = _kvcache.plan_layout(tokens, rows, w.causal, (None, None), None, token_rows=True)
            by_token = pack and causal  # q itself, its groups read as rows; else packed rows (one token)
            shape = (2, tokens * rows, w.heads_kv, w.head_dim) if pack and not by_token else \
                (2, tokens, w.heads_q, w.head_dim)
            chunk, n = _kvcache.split_chunks(sk, 3)
            _kvcache.fa4_split(torch.randn(*shape, dtype=dt), k, k, lens, n, chunk, w.head_dim ** -0.5, w.softcap,
                               causal=causal, rows_per_query=rows if by_token else 1,
                               unpack=rows if pack and tokens > 1 and n > 1 else 1)
    launched = set(rec.keys)
    if w.causal and w.heads_q > w.heads_kv:  # the merge that unpacks several tokens' packed rows
        assert any(k[0] == "fwd_parts_combine" and "token_rows" in k for k in launched)
    from stage3_fwd_kernel import page_gather

    pages = torch.randn(6, 16, w.heads_kv, w.head_dim, dtype=dt)
    assert page_gather.gather_pages(pages, pages, torch.tensor([[4, 1, 0]], dtype=torch.int32)) is not None
    launched = set(rec.keys)
    assert ("page_gather", "gpu") in launched
    assert launched and launched <= built, sorted(map(repr, launched - built))
    assert any(k[:2] == ("hopper_forward", "gpu") and 64 in k for k in launched)
    assert sum("key_split" in k for k in launched) == (2 if w.causal else 1)


@pytest.mark.cpu
@pytest.mark.fa4
def test_decode_window_key_range_launch_is_precompiled(recorder, monkeypatch):
    """One query token with a window reads a key range (fa4._kvcache.key_range_window): the split
    launch with range_keys, or with cache_batch_idx the varlen forward with a free mask over segments
    that start at the window; several tokens split with the window's mask. A windowed decode spec
    builds all three."""
    from fa4 import _kvcache

    be, rec = recorder
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: be)  # fa4_split's lookup, on CPU tensors
    (w,) = precompile.parse_shapes("d=128,heads=32/8,causal,window=1024,seqlen=8192,decode")
    fwd_mod, bwd_mod = be.forward_module(), be.backward_module()
    for b in precompile.derive_builds([w], backward=False):
        precompile.derived_task(fwd_mod, bwd_mod, b)[1]()
    built = set(rec.keys)
    rec.keys.clear()
    window, left = _kvcache.key_range_window(1, w.window, False)
    assert window == (None, None) and left == 1024
    rows, lens = w.heads_q // w.heads_kv, torch.tensor([8192, 300], dtype=torch.int32)
    seg = _kvcache.dense_segments(lens, None, 8192, 3, left)
    kf = torch.randn(2 * 8192, w.heads_kv, w.head_dim, dtype=torch.bfloat16)
    cu_q = torch.arange(0, (2 * seg.n + 1) * rows, rows, dtype=torch.int32)
    be.varlen_forward(torch.randn(2 * seg.n * rows, w.heads_kv, w.head_dim, dtype=torch.bfloat16), kf, kf, cu_q,
                      seg.cu_k, seg.used, rows, seg.max_keys, w.head_dim ** -0.5, False)
    k = kf.view(2, 8192, w.heads_kv, w.head_dim)
    chunk, n = _kvcache.split_chunks(left + 1, 3)
    _kvcache.fa4_split(torch.randn(2, rows, w.heads_kv, w.head_dim, dtype=torch.bfloat16), k, k, lens, n, chunk,
                       w.head_dim ** -0.5, 0.0, range_keys=left + 1)
    # several tokens (speculative decoding) keep the window's mask, the group packed by token
    chunk, n = _kvcache.split_chunks(left + 4, 3)
    _kvcache.fa4_split(torch.randn(2, 4, w.heads_q, w.head_dim, dtype=torch.bfloat16), k, k, lens, n, chunk,
                       w.head_dim ** -0.5, 0.0, range_keys=left + 4, window=(left, None), causal=True,
                       rows_per_query=rows, unpack=rows)
    launched = set(rec.keys)
    assert launched and launched <= built, sorted(map(repr, launched - built))
    assert sum("key_split" in k for k in launched) == 2
