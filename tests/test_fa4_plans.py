"""fa4's launch plans (fa4/_plans.py): a call's host side recorded once, replayed without the kernel modules.

cpu tier: the recorder and the replayer on CPU tensors, with a Python function standing in for a
compiled kernel (taken from the stages' compile cache as a launch takes it): a replay equals the
normal path on fresh inputs, after a fresh process's view of the cache; calls that read tensor
values, or use large external tensors, get no plan; a corrupt plan is discarded, not fatal.
compile tier: a real kernel object from the disk cache's export, linked into a shared library that a
process without CuTe-DSL loads through TVM-FFI.
gpu tier: tests/test_fa4_plans_gpu.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.fa4

KEY = ("test_plans_kernel", "gpu", 1)
EXTERNAL = {}
FAILURES = {"left": 0}  # the next calls of the stand-in kernel that raise


def _fake_kernel(q, k, out, scratch, scale, n, stand_in):
    """Stands in for a compiled kernel: writes its outputs in place (its ops are not the host's)."""
    if FAILURES["left"]:
        FAILURES["left"] -= 1
        raise RuntimeError("CUDA out of memory (stand-in)")
    out.copy_(q * scale + k)
    scratch.add_(n + stand_in)


def _host(q, k, read_values=False, big_external=False):
    """Shaped like a stage's host code: allocate, view, launch from the compile cache, post-process."""
    from stage3_fwd_kernel import compile_cache

    out = torch.empty_like(q)
    scratch = torch.zeros((q.shape[0], 4), dtype=torch.int32)
    stand_in = EXTERNAL.setdefault("big" if big_external else "one",
                                   torch.ones(5000 if big_external else 1, dtype=torch.int32))
    if read_values:
        _ = int(q.abs().sum().item() > 0)  # a value the host code branches on
    kernel = compile_cache.compile_cached(KEY, lambda: (_ for _ in ()).throw(AssertionError("no compile")))
    kernel.fn(q.detach(), k.detach().view(q.shape), out, scratch, 0.5, 3, stand_in[:1])
    scratch[:, 1:3] += 1                                   # __getitem__ / __setitem__ with slices
    return (out * 2 + 1)[..., ::2], scratch.sum(dim=1)


@pytest.fixture
def plans(tmp_path, monkeypatch):
    from fa4 import _plans
    from stage3_fwd_kernel import compile_cache

    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA4_CACHE", raising=False)
    monkeypatch.delenv("FA4_PLANS", raising=False)
    compile_cache.remember(KEY, compile_cache.Compiled(_fake_kernel, {}, "", ""))
    monkeypatch.setattr(_plans, "_kernel_entry", lambda key, arch: {"lib": "fake.so", "sha": "0", "symbol": repr(key)})
    loads = []
    monkeypatch.setattr(_plans, "_load_kernel", lambda path, sha, symbol: loads.append(symbol) or _fake_kernel)
    _plans.forget()
    yield _plans, loads
    _plans.forget()


def _inputs(seed, shape=(3, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _call(_plans, sig, inputs, **host_kw):
    """What a backend does: replay when there is a plan, else the normal path under the recorder."""
    done = _plans.replay(sig, "sm_90a", inputs)
    if done is not None:
        return done, True
    with _plans.recording(sig, "sm_90a", inputs) as record:
        result = _host(*inputs, **host_kw)
        record(result)
    return result, False


def _recorded(_plans, tmp_path, tag):
    """(signature, plan file) after the two calls that record a plan."""
    sig = _plans.signature("fwd", "sm_90", _inputs(0), (tag,), ())
    for seed in range(2):
        _call(_plans, sig, _inputs(seed))
    path, = tmp_path.rglob("plans/*.json")
    return sig, path


@pytest.mark.cpu
def test_second_call_records_and_a_fresh_process_replays(plans, tmp_path):
    _plans, loads = plans
    sig = _plans.signature("fwd", "sm_90", _inputs(0), (0.5, True), ())
    assert _call(_plans, sig, _inputs(0))[1] is False          # first call: normal path, nothing recorded
    assert not list(tmp_path.rglob("*.json"))
    assert _call(_plans, sig, _inputs(1))[1] is False          # second call: recorded
    plan_files = list(tmp_path.rglob("plans/*.json"))
    assert len(plan_files) == 1 and _plans.stats()["recorded"] == 1
    from fa4 import _cache

    assert _cache.info(["sm_90a"])["current_plans"] == 1                # `python -m fa4 info` counts it
    plan = json.loads(plan_files[0].read_text())
    assert any("kernel" in s for s in plan["steps"]) and plan["constants"][0]["values"] == [1]
    _plans.forget()                                            # a fresh process: memory empty, disk kept
    for seed in (2, 3):
        inputs = _inputs(seed)
        got, replayed = _call(_plans, sig, inputs)
        want = _host(*_inputs(seed))
        assert replayed and loads == [repr(KEY)]               # the kernel is loaded once per process
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the replay's outputs are fresh tensors each call, and the inputs are untouched
    a, _ = _call(_plans, sig, _inputs(4))
    b, _ = _call(_plans, sig, _inputs(4))
    assert a[0].data_ptr() != b[0].data_ptr() and torch.equal(a[0], b[0])


@pytest.mark.cpu
@pytest.mark.parametrize("host_kw,why", [(dict(read_values=True), "reads a tensor's values"),
                                         (dict(big_external=True), "external tensor")])
def test_calls_a_plan_cannot_replay_get_none(plans, tmp_path, host_kw, why):
    _plans, _ = plans
    sig = _plans.signature("fwd", "sm_90", _inputs(0), tuple(sorted(host_kw)), ())
    for seed in range(3):
        result, replayed = _call(_plans, sig, _inputs(seed), **host_kw)
        assert not replayed and torch.equal(result[0], _host(*_inputs(seed))[0])
    assert not list(tmp_path.rglob("*.json")) and why in _plans.refusal(sig)


@pytest.mark.cpu
def test_a_corrupt_plan_is_discarded_and_the_call_runs_normally(plans, tmp_path):
    _plans, _ = plans
    sig, path = _recorded(_plans, tmp_path, "corrupt")
    path.write_text(path.read_text()[:-20])
    _plans.forget()
    with pytest.warns(RuntimeWarning, match="discarding launch plan"):
        result, replayed = _call(_plans, sig, _inputs(5))
    assert not replayed and torch.equal(result[0], _host(*_inputs(5))[0]) and not path.exists()


@pytest.mark.cpu
def test_a_plan_this_process_may_not_read_is_kept(plans, tmp_path, monkeypatch):
    """A plan is written with the umask's mode (another user of the cache reads it); one this process may
    not read (another user's, written before that) is no plan here, and is left on disk for its owner,
    where it used to be deleted as torn."""
    from fa4 import _cache

    _plans, _ = plans
    sig, path = _recorded(_plans, tmp_path, "not-mine")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_cache._UMASK
    _plans.forget()
    real = pathlib.Path.read_text

    def denied(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    result, replayed = _call(_plans, sig, _inputs(6))
    assert not replayed and torch.equal(result[0], _host(*_inputs(6))[0]) and path.exists()


@pytest.mark.cpu
def test_the_signature_sees_shapes_strides_scalars_and_alignment():
    from fa4 import _plans

    q, k = _inputs(0)
    base = _plans.signature("fwd", "sm_90", (q, k), (0.5, True), (1,))
    assert base == _plans.signature("fwd", "sm_90", _inputs(9), (0.5, True), (1,))  # values do not matter
    others = [_plans.signature("bwd", "sm_90", (q, k), (0.5, True), (1,)),
              _plans.signature("fwd", "sm_90", (q.t().contiguous().t(), k), (0.5, True), (1,)),
              _plans.signature("fwd", "sm_90", (q[:, 1:], k), (0.5, True), (1,)),
              _plans.signature("fwd", "sm_90", (q.double(), k), (0.5, True), (1,)),
              _plans.signature("fwd", "sm_90", (q, k), (0.25, True), (1,)),
              _plans.signature("fwd", "sm_90", (q, k), (0.5, True), (2,)),
              _plans.signature("fwd", "sm_90", (q, None), (0.5, True), (1,))]
    assert len({base, *others}) == len(others) + 1


@pytest.mark.compile
def test_a_cached_kernel_links_and_loads_without_the_dsl(tmp_path, monkeypatch):
    """The disk cache's export of a real (tiny) kernel, linked by _plans._link, opens in a fresh
    process through TVM-FFI alone: no cutlass module is imported there."""
    import shutil

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine (plans then stay off)")
    from stage2_emulated_exp import cute_arch

    cute_arch.retarget("sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from fa4 import _cache, _plans

    @cute.kernel
    def bump(a: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        a[tidx] = a[tidx] + 1.0

    @cute.jit
    def launch(a: cute.Tensor):
        bump(a).launch(grid=[1, 1, 1], block=[32, 1, 1])

    fn = cute.compile(launch, make_fake_compact_tensor(cutlass.Float32, (32,)), options="--enable-tvm-ffi")
    obj = tmp_path / "k-0.o"
    obj.write_bytes(_cache.export_object(fn, "fa4_test_bump"))
    lib = _plans._link(obj)
    assert lib.exists() and _plans._link(obj) == lib           # linked once
    probe = textwrap.dedent(f"""
        import sys, tvm_ffi
        f = getattr(tvm_ffi.load_module({str(lib)!r}), "fa4_test_bump")
        print(type(f).__name__, any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules))
    """)
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["Function", "False"]


@pytest.mark.cpu
def test_inputs_that_were_one_tensor_do_not_serve_separate_ones(plans):
    """A call recorded with k is q has its own signature: separate tensors take the normal path."""
    _plans, _ = plans
    x, _ = _inputs(0)
    sig_same = _plans.signature("fwd", "sm_90", (x, x), (), ())
    a, b = _inputs(1)
    assert sig_same != _plans.signature("fwd", "sm_90", (a, b), (), ())
    for seed in range(2):
        y, _ = _inputs(seed)
        _call(_plans, sig_same, (y, y))
    y, _ = _inputs(7)
    got, replayed = _call(_plans, sig_same, (y, y))
    assert replayed and torch.equal(got[0], _host(y, y)[0])


@pytest.mark.cpu
def test_a_failing_recording_never_fails_the_call(plans, tmp_path, monkeypatch):
    import subprocess as sp

    _plans, _ = plans

    def link_times_out(key, arch):
        raise sp.TimeoutExpired("cc", 120)
    monkeypatch.setattr(_plans, "_kernel_entry", link_times_out)
    sig = _plans.signature("fwd", "sm_90", _inputs(0), ("timeout",), ())
    for seed in range(3):
        with pytest.warns(RuntimeWarning, match="could not write") if seed == 1 else _no_warning():
            result, replayed = _call(_plans, sig, _inputs(seed))
        assert not replayed and torch.equal(result[0], _host(*_inputs(seed))[0])
    assert not list(tmp_path.rglob("*.json")) and "TimeoutExpired" in _plans.refusal(sig)


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.cpu
def test_a_replay_that_raises_keeps_the_plan_and_falls_back(plans, tmp_path, monkeypatch):
    _plans, _ = plans
    sig, _ = _recorded(_plans, tmp_path, "raises")
    _plans.forget()
    calls = []

    def out_of_memory(*args):
        calls.append(1)
        raise RuntimeError("CUDA out of memory (stand-in)")
    monkeypatch.setattr(_plans, "_load_kernel", lambda path, sha, symbol: out_of_memory)
    with pytest.warns(RuntimeWarning, match="takes the normal path"):
        result, replayed = _call(_plans, sig, _inputs(3))
    assert not replayed and calls == [1] and torch.equal(result[0], _host(*_inputs(3))[0])
    assert list(tmp_path.rglob("plans/*.json"))                 # a transient failure deletes nothing
    _call(_plans, sig, _inputs(4))
    assert calls == [1]                                          # and this process does not retry it


@pytest.mark.cpu
def test_a_failed_replay_keeps_its_constants_and_the_signature_stays_on_the_normal_path(plans, tmp_path,
                                                                                         monkeypatch):
    """A CUDA graph captured over a replay reads the plan's constants by address: a later failed
    replay (which drops the plan) must not free them. The signature then takes the normal path for
    the rest of the process, without recording the plan again."""
    import gc
    import weakref

    _plans, _ = plans
    sig, _ = _recorded(_plans, tmp_path, "constants")
    _plans.forget()
    assert _call(_plans, sig, _inputs(2))[1]                     # a fresh process replays
    monkeypatch.setattr(_plans, "_capturing", lambda: True)
    assert _call(_plans, sig, _inputs(2))[1]                     # and a graph is captured over it
    monkeypatch.setattr(_plans, "_capturing", lambda: False)
    constant = weakref.ref(_plans._PLANS[sig]._materialized[0][1])
    FAILURES["left"] = 1
    with pytest.warns(RuntimeWarning, match="takes the normal path"):
        assert not _call(_plans, sig, _inputs(3))[1]
    gc.collect()
    assert constant() is not None
    recorded = _plans.stats()["recorded"]
    assert [_call(_plans, sig, _inputs(s))[1] for s in range(4, 8)] == [False] * 4
    assert _plans.stats()["recorded"] == recorded


@pytest.mark.cpu
def test_under_capture_only_a_warm_plan_replays_and_nothing_is_loaded(plans, tmp_path, monkeypatch):
    """torch.cuda.graph capture may not load a kernel's module: a plan not yet replayed in this
    process is not even looked up (nothing loaded, the file kept); a warm one replays."""
    _plans, loads = plans
    sig, path = _recorded(_plans, tmp_path, "capture")
    _plans.forget()
    loads.clear()
    monkeypatch.setattr(_plans, "_capturing", lambda: True)
    assert not _call(_plans, sig, _inputs(2))[1]
    assert loads == [] and path.exists()
    monkeypatch.setattr(_plans, "_capturing", lambda: False)
    assert _call(_plans, sig, _inputs(3))[1]                     # eager: loads, replays, warm
    monkeypatch.setattr(_plans, "_capturing", lambda: True)
    assert _call(_plans, sig, _inputs(4))[1]


@pytest.mark.cpu
def test_two_threads_making_a_plans_first_replay(plans, tmp_path):
    """The constants are in the template before a second thread may copy it (a slow template
    widens the window in which the second thread used to copy empty constant slots)."""
    import threading
    import time

    _plans, _ = plans
    sig, _ = _recorded(_plans, tmp_path, "threads")
    _plans.forget()
    plan = _plans.lookup(sig, "sm_90a")

    class SlowTemplate(list):
        def __setitem__(self, i, v):
            time.sleep(0.1)
            super().__setitem__(i, v)
    plan._template = SlowTemplate(plan._template)
    results = {}

    def worker(name, delay):
        time.sleep(delay)
        results[name] = _call(_plans, sig, _inputs(5))[1]
    threads = [threading.Thread(target=worker, args=(n, d)) for n, d in (("a", 0.0), ("b", 0.02))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"a": True, "b": True} and _plans._PLANS.get(sig) is plan


@pytest.mark.cpu
@pytest.mark.parametrize("bad", ["kernel_returns", "constant_output"])
def test_plans_that_would_replay_wrongly_are_refused(plans, tmp_path, monkeypatch, bad):
    from stage3_fwd_kernel import compile_cache

    _plans, _ = plans
    if bad == "kernel_returns":
        compile_cache.remember(KEY, compile_cache.Compiled(lambda *a: _fake_kernel(*a) or 1, {}, "", ""))
        host = _host
    else:
        def host(q, k):
            out, rest = _host(q, k)
            return EXTERNAL["one"], rest                         # an output that is a shared tensor
    sig = _plans.signature("fwd", "sm_90", _inputs(0), (bad,), ())
    for seed in range(3):
        inputs = _inputs(seed)
        assert _plans.replay(sig, "sm_90a", inputs) is None
        with _plans.recording(sig, "sm_90a", inputs) as record:
            record(host(*inputs))
    assert not list(tmp_path.rglob("*.json"))
    assert ("returned a value" if bad == "kernel_returns" else "outside the recorded") in _plans.refusal(sig)


@pytest.mark.cpu
def test_a_plan_naming_a_library_outside_the_cache_is_not_loaded(plans, tmp_path):
    _plans, loads = plans
    sig, path = _recorded(_plans, tmp_path, "escape")
    plan = json.loads(path.read_text())
    plan["kernels"][0]["lib"] = "../../elsewhere.so"
    path.write_text(json.dumps(plan))
    _plans.forget()
    with pytest.warns(RuntimeWarning, match="outside the cache directory"):
        assert _call(_plans, sig, _inputs(5))[1] is False
    assert loads == [] and not path.exists()


@pytest.mark.cpu
def test_discarding_a_plan_keeps_the_libraries_other_plans_name(plans, tmp_path):
    """Plans of calls that launch the same kernel share its library: a discarded plan deletes only
    the libraries no other plan names (a torn plan names none)."""
    _plans, loads = plans
    directory = _plans.plan_dir("sm_90a")
    directory.mkdir(parents=True)
    bad, good = "a" * 32, "b" * 32
    entry = lambda lib: {"lib": lib, "sha": "0", "symbol": "k"}  # noqa: E731
    # `bad` does not load (another format); `good` names the shared library too
    (directory / f"{bad}.json").write_text(json.dumps({"format": -1, "kernels": [entry("shared.so"),
                                                                                 entry("bad_only.so")]}))
    (directory / f"{good}.json").write_text(json.dumps({"format": 1, "kernels": [entry("shared.so"),
                                                                                 entry("good_only.so")]}))
    (directory / f"{'c' * 32}.json").write_text('{"format": 1, "kernels": [{"lib": "bad_on')  # torn
    for lib in ("shared.so", "bad_only.so", "good_only.so"):
        (directory.parent / lib).write_bytes(b"\x7fELF")
    with pytest.warns(RuntimeWarning, match="discarding launch plan"):
        assert _plans.lookup(bad, "sm_90a") is None
    assert not (directory / f"{bad}.json").exists() and not (directory.parent / "bad_only.so").exists()
    assert (directory.parent / "shared.so").exists() and (directory.parent / "good_only.so").exists()
    assert (directory / f"{good}.json").exists() and loads == []


def _record_many(_plans, tags, seeds=(0, 1)):
    """Two calls (the recording ones) of one signature per tag; returns the signatures."""
    sigs = []
    for tag in tags:
        sig = _plans.signature("kvcache", "sm_90", _inputs(0), (tag,), ())
        for seed in seeds:
            _call(_plans, sig, _inputs(seed))
        sigs.append(sig)
    return sigs


@pytest.mark.cpu
def test_a_plan_directory_keeps_the_recently_used_plans(plans, tmp_path, monkeypatch):
    """A growing cache is a new signature every step: a write that would pass FA4_PLANS_MAX plans deletes
    the least recently used ones (down to three quarters), and loading a plan counts as a use."""
    _plans, _ = plans
    monkeypatch.setenv("FA4_PLANS_MAX", "8")
    first = _record_many(_plans, range(4))
    directory = next(tmp_path.rglob("plans"))
    for age, sig in enumerate(first):                            # written long ago, oldest first
        os.utime(directory / f"{sig}.json", (1e9 + age, 1e9 + age))
    _plans.forget()
    assert _call(_plans, first[0], _inputs(3))[1]                # loaded: the oldest becomes the newest
    later = _record_many(_plans, range(100, 105))                # the 9th plan's write prunes to 6
    names = {p.stem for p in directory.glob("*.json")}
    assert len(names) == 6, names
    assert first[0] in names and not names & set(first[1:4])     # the three unused old ones went
    assert set(later) <= names | {later[0]}
    _plans.forget()
    assert _call(_plans, later[-1], _inputs(4))[1]               # what is kept still replays
    assert not _call(_plans, first[2], _inputs(4))[1]            # a pruned one takes the normal path


@pytest.mark.cpu
def test_prune_deletes_only_plans(tmp_path):
    from fa4 import _plans

    for i in range(10):
        (tmp_path / f"{i:02d}.json").write_text("{}")
        os.utime(tmp_path / f"{i:02d}.json", (1e9 + i, 1e9 + i))
    (tmp_path / ".05.json.tmp").write_text("")
    (tmp_path / "kernel.so").write_text("")
    assert _plans.prune(tmp_path, keep=10) == 0
    assert _plans.prune(tmp_path, keep=8) == 4                  # down to 6, the oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".05.json.tmp", "04.json", "05.json", "06.json",
                                                            "07.json", "08.json", "09.json", "kernel.so"]
    assert _plans.prune(tmp_path / "missing", keep=1) == 0


@pytest.mark.cpu
@pytest.mark.parametrize("raw", ["0", "-3", "many", "1.5"])
def test_a_bad_plan_limit_refuses_the_write_not_the_call(plans, tmp_path, monkeypatch, raw):
    _plans, _ = plans
    monkeypatch.setenv("FA4_PLANS_MAX", raw)
    sig = _plans.signature("fwd", "sm_90", _inputs(0), ("limit",), ())
    _call(_plans, sig, _inputs(0))
    with pytest.warns(RuntimeWarning, match="FA4_PLANS_MAX"):
        result, replayed = _call(_plans, sig, _inputs(1))
    assert not replayed and torch.equal(result[0], _host(*_inputs(1))[0])
    assert not list(tmp_path.rglob("plans/*.json"))
    with pytest.raises(ValueError, match="FA4_PLANS_MAX"):
        _plans.max_on_disk()


@pytest.mark.cpu
def test_a_process_keeps_a_bounded_number_of_signatures(plans, tmp_path, monkeypatch):
    """The process's tables drop their oldest signatures past MEMORY_SIGNATURES; a dropped plan loads
    again from disk, and a plan no graph was captured over frees its constants with it."""
    import gc
    import weakref

    _plans, _ = plans
    monkeypatch.setattr(_plans, "MEMORY_SIGNATURES", 6)
    sigs = _record_many(_plans, range(3))
    assert _call(_plans, sigs[0], _inputs(5))[1]
    constant = weakref.ref(_plans._PLANS[sigs[0]]._materialized[0][1])
    more = _record_many(_plans, range(10, 30), seeds=(0, 1, 2))  # the third call of each replays
    for table in (_plans._PLANS, _plans._SEEN, _plans._NAMES):
        assert 0 < len(table) <= 6
    assert sigs[0] not in _plans._PLANS and more[-1] in _plans._PLANS
    gc.collect()
    assert constant() is None
    assert _call(_plans, sigs[0], _inputs(6))[1]                 # back from disk
    assert len(list(tmp_path.rglob("plans/*.json"))) == 23


@pytest.mark.cpu
def test_a_kernels_plan_entry_is_made_once_while_its_library_exists(tmp_path, monkeypatch):
    """Verifying the kernel object and hashing its library cost milliseconds: once per process,
    unless the library has gone (a cleared cache), when it is linked and hashed again."""
    from fa4 import _cache, _plans

    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA4_CACHE", raising=False)
    _plans.forget()
    directory = _cache.cache_dir("sm_90a")
    directory.mkdir(parents=True, exist_ok=True)
    reads = []

    def read_verified(self, khash):
        reads.append(khash)
        obj = directory / f"{khash}.o"
        obj.write_bytes(b"object")
        return obj

    def link(obj):
        lib = obj.with_name(f"{obj.stem}-env.so")
        lib.write_bytes(b"library")
        return lib
    monkeypatch.setattr(_cache, "persistable", lambda key: True)
    monkeypatch.setattr(_cache, "key_hash", lambda key: "k" + str(key[0]))
    monkeypatch.setattr(_cache.DiskCache, "read_verified", read_verified)
    monkeypatch.setattr(_plans, "_link", link)
    entry = _plans._kernel_entry((1,), "sm_90a")
    assert _plans._kernel_entry((1,), "sm_90a") == entry and reads == ["k1"]
    assert _plans._kernel_entry((2,), "sm_90a")["lib"] == "k2-env.so" and reads == ["k1", "k2"]
    (directory / entry["lib"]).unlink()
    assert _plans._kernel_entry((1,), "sm_90a") == entry and reads == ["k1", "k2", "k1"]
    _plans.forget()


@pytest.mark.cpu
def test_a_limit_of_one_plan_keeps_the_plan_just_written(plans, tmp_path, monkeypatch):
    _plans, _ = plans
    monkeypatch.setenv("FA4_PLANS_MAX", "1")
    sigs = _record_many(_plans, range(3))
    assert [p.stem for p in tmp_path.rglob("plans/*.json")] == [sigs[-1]]
    assert _call(_plans, sigs[-1], _inputs(4))[1]


@pytest.mark.cpu
def test_a_plan_whose_library_is_gone_is_discarded_with_a_warning(plans, tmp_path, monkeypatch):
    _plans, _ = plans
    sig, path = _recorded(_plans, tmp_path, "library gone")
    _plans.forget()

    def gone(path, sha, symbol):
        raise FileNotFoundError(path)
    monkeypatch.setattr(_plans, "_load_kernel", gone)
    with pytest.warns(RuntimeWarning, match="discarding launch plan"):
        result, replayed = _call(_plans, sig, _inputs(2))
    assert not replayed and torch.equal(result[0], _host(*_inputs(2))[0]) and not path.exists()


@pytest.mark.cpu
def test_a_plan_in_use_stays_in_memory_while_new_signatures_pass(plans, monkeypatch):
    """The process's tables drop their least recently used plans: one replayed every step is never
    dropped (and reloaded from disk) however many signatures come and go around it."""
    _plans, _ = plans
    monkeypatch.setattr(_plans, "MEMORY_SIGNATURES", 6)
    hot, = _record_many(_plans, ["hot"])
    assert _call(_plans, hot, _inputs(3))[1]
    plan = _plans._PLANS[hot]
    for tag in range(20):
        _record_many(_plans, [tag])
        assert _call(_plans, hot, _inputs(4))[1] and _plans._PLANS[hot] is plan
    assert len(_plans._PLANS) <= 6
