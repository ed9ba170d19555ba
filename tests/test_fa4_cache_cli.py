"""fa4's compile cache and command line: everything that can be checked without a GPU.

cpu tier: the compile cache (keys, directory, atomic writes, corruption, concurrency, the store behind
the stages' compile cache, info and clear); the CLI in subprocesses (info, bench outside the
repository, precompile without a GPU) and the README's generated support matrix.

compile tier: a real CuTe-DSL object written to and reloaded from the disk cache; the CLI
`precompile` and `demo` compile the production forward for sm_90a.

The CLI across processes (what one command leaves on disk, the next reads): tests/test_fa4_cli.py.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

import fa4
from fa4 import _cache, _dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "fa4", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=e)


# ================================================================================ compile cache
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FA4_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_dir_and_keys(cache_dir, monkeypatch):
    assert _cache.root_dir() == cache_dir
    d = _cache.cache_dir()
    assert d.parent == cache_dir / _cache.FORMAT and len(d.name) == 16
    assert _cache.fingerprint("sm_90a") != _cache.fingerprint("sm_100a")  # per-arch generations
    monkeypatch.delenv("FA4_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert _cache.root_dir() == pathlib.Path("/xdg/fa4")
    key = ("step", "gpu", "BFloat16", 128, 128, True, ("policy", 8.0))
    assert _cache.key_hash(key) == _cache.key_hash(tuple(key)) and len(_cache.key_hash(key)) == 32
    assert _cache.persistable(key)
    assert not _cache.persistable(("step", "fake", "BFloat16", 128, 128, True))  # compile-only: memory only
    assert not _cache.persistable(("step", "gpu", object()))  # repr holds an address: unstable across processes
    monkeypatch.setenv("FA4_CACHE", "0")
    assert not _cache.enabled() and _cache.disk() is None


@pytest.mark.cpu
@pytest.mark.fa4
def test_disk_cache_atomic_write_and_corruption(cache_dir):
    dc = _cache.DiskCache(cache_dir / "gen")
    p1 = dc.write("k" * 32, b"first")
    os.utime(p1, (1e9, 1e9))  # make it unambiguously the older entry
    p2 = dc.write("k" * 32, b"second")
    assert p1 != p2 and p1.exists() and p2.exists()  # writers never delete (see read_verified)
    assert dc.read_verified("k" * 32) == p2 and not p1.exists()  # the reader keeps the newest, prunes the rest
    assert not list((cache_dir / "gen").glob("*.tmp"))  # no temporary files left behind
    p2.write_bytes(b"secomd")  # a corrupted (e.g. truncated or edited) file
    with pytest.warns(RuntimeWarning, match="content hash mismatch"):
        assert dc.read_verified("k" * 32) is None
    assert not p2.exists()  # removed, so the next run rebuilds it


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_reader_whose_entry_another_reader_pruned_takes_the_newer(cache_dir, monkeypatch):
    """Reader A verifies the only entry of a key; before A links it, reader B -- which saw a newer entry
    that a third process wrote -- prunes it. A must link the newer entry, without a warning or a
    recompile (it used to discard the vanished file as a failed load)."""
    import warnings

    dc = _cache.DiskCache(cache_dir / "gen")
    older = dc.write("k" * 32, b"first")
    os.utime(older, (1e9, 1e9))
    linked = []

    def load_object(path, symbol):
        if not linked:  # meanwhile: the newer entry appears and another reader prunes this one
            linked.append(dc.write("k" * 32, b"second"))
            path.unlink()
            raise OSError(f"cannot open {path}")
        linked.append(path)
        return "kernel"
    monkeypatch.setattr(_cache, "load_object", load_object)
    monkeypatch.setattr(_cache, "key_hash", lambda key: "k" * 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dc.load("key") == ("kernel", linked[0])
    assert linked == [linked[0], linked[0]] and linked[0].exists() and not older.exists()
    # a file that is still there but does not link is discarded, as before
    monkeypatch.setattr(_cache, "load_object", lambda path, symbol: (_ for _ in ()).throw(OSError("bad object")))
    with pytest.warns(RuntimeWarning, match="load failed: OSError: bad object"):
        assert dc.load("key") is None
    assert not linked[0].exists()


_WRITER = """
import sys
from fa4._cache import DiskCache
DiskCache(sys.argv[1]).write("c" * 32, sys.argv[2].encode() * 100000)
"""


@pytest.mark.cpu
@pytest.mark.fa4
def test_disk_cache_concurrent_writers(cache_dir):
    """Processes racing on one key each leave a complete, verified file or none: never a torn one."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(cache_dir), f"writer{i}"], cwd=ROOT)
             for i in range(6)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    dc = _cache.DiskCache(cache_dir)
    path = dc.read_verified("c" * 32)
    assert path is not None
    assert path.read_bytes() in {f"writer{i}".encode() * 100000 for i in range(6)}
    assert not list(cache_dir.glob("*.tmp"))


class _FakeCompiled:
    """Stands in for a CuTe JitCompiledFunction: callable, exportable."""

    def __init__(self, tag, fail=False):
        self.tag, self.fail = tag, fail

    def __call__(self, *args):
        if self.fail:
            raise RuntimeError("bad object")
        return self.tag

    def export_to_c(self, object_file_path, function_name):
        with open(object_file_path, "wb") as f:
            f.write(f"OBJ:{self.tag}:{function_name}".encode())


@pytest.fixture
def stage_cache(monkeypatch):
    """The stages' real compile cache with fa4's store behind it, compiling fake objects: `build()`
    returns the object itself, and every compile is recorded in `.builds`."""
    from stage3_fwd_kernel import compile_cache

    cc = compile_cache
    builds, detached = [], []

    def fake_compile(key, build, detach=False):
        builds.append(key)
        detached.append(detach)  # every fake build counts as launchable
        return cc.Compiled(build(), {"registers": 1}, "sass", "ptx"), detach

    monkeypatch.setattr(cc, "_compile", fake_compile)
    monkeypatch.setattr(cc, "_CACHE", {})
    monkeypatch.setattr(cc, "_STORE", None)
    cc.set_store(_cache.STORE)
    return types.SimpleNamespace(cc=cc, builds=builds, detached=detached)


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_store_memory_disk_and_rebuild(cache_dir, monkeypatch, stage_cache):
    loads = []

    def fake_load(path, symbol):
        data = path.read_bytes().decode()
        assert data.endswith(symbol)
        loads.append(path)
        return _FakeCompiled("from-disk:" + data.split(":")[1], fail="poison" in data)

    monkeypatch.setattr(_cache, "load_object", fake_load)
    cc, builds = stage_cache.cc, stage_cache.builds
    assert cc.get_store() is _cache.STORE
    key = ("stepX", "gpu", "BFloat16", 64, 64, False)

    # process 1: compiled without the DSL's engine, written to disk, and run from that object
    comp = cc.compile_cached(key, lambda: _FakeCompiled("compiled"))
    assert comp.fn() == "from-disk:compiled" and builds == [key] and stage_cache.detached == [True]
    assert len(list(_cache.cache_dir().glob("*.o"))) == 1 and len(loads) == 1
    hits = _cache.stats()["memory_hits"]
    assert cc.compile_cached(key, lambda: 1 / 0).fn() == "from-disk:compiled"  # memory hit, no build
    assert _cache.stats()["memory_hits"] == hits + 1
    # process 2 (empty memory): loaded from disk, no compile; the first call is guarded
    cc._CACHE.clear()
    comp = cc.compile_cached(key, lambda: 1 / 0)
    assert comp.report["loaded_from"] and comp.fn() == "from-disk:compiled" and builds == [key]
    assert comp.report["registers"] == 1  # the compile's report travels with the object
    assert cc.cached(key).fn.tag == "from-disk:compiled"  # the guard stepped aside after success
    # a fake-tensor compile is never written, and keeps the DSL's engine
    cc.compile_cached(("stepX", "fake", "BFloat16", 64, 64, False), lambda: _FakeCompiled("fake"))
    assert len(list(_cache.cache_dir().glob("*.o"))) == 1 and stage_cache.detached[-1] is False
    # an object that loads but fails on its first call: dropped, recompiled, the call retried
    cc._CACHE.clear()
    key2 = ("stepX", "gpu", "BFloat16", 128, 128, True)
    cc.compile_cached(key2, lambda: _FakeCompiled("poison"))
    cc._CACHE.clear()
    with pytest.warns(RuntimeWarning, match="failed on first call"):
        assert cc.compile_cached(key2, lambda: _FakeCompiled("good")).fn() == "from-disk:good"
    assert builds[-1] == key2 and cc.cached(key2).fn() == "from-disk:good"
    # a corrupt file on disk: discarded and rebuilt, not fatal
    cc._CACHE.clear()
    for p in _cache.cache_dir().glob("*.o"):
        p.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="content hash mismatch"):
        assert cc.compile_cached(key, lambda: _FakeCompiled("rebuilt")).fn() == "from-disk:rebuilt"
    # FA4_CACHE=0: memory only
    monkeypatch.setenv("FA4_CACHE", "0")
    cc._CACHE.clear()
    n_loads = len(loads)
    assert cc.compile_cached(key, lambda: _FakeCompiled("memory-only")).fn() == "memory-only"
    assert len(loads) == n_loads and stage_cache.detached[-1] is False


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_links_fresh_kernels_even_when_the_disk_fails(cache_dir, monkeypatch, stage_cache):
    """A kernel compiled without the DSL's engine still runs when its object cannot be written (linked
    from memory) and is compiled again with the engine when it cannot be exported or linked."""
    monkeypatch.setattr(_cache, "load_object",
                        lambda path, symbol: _FakeCompiled("linked:" + path.read_bytes().decode().split(":")[1]))
    cc, builds = stage_cache.cc, stage_cache.builds

    def unwritable(self, khash, data):
        return None  # what write() returns after it warned about an OSError

    monkeypatch.setattr(_cache.DiskCache, "write", unwritable)
    key = ("stepX", "gpu", "BFloat16", 64, 64, False)
    assert cc.compile_cached(key, lambda: _FakeCompiled("k")).fn() == "linked:k"
    assert builds == [key] and stage_cache.detached == [True]

    class NoExport(_FakeCompiled):
        def export_to_c(self, object_file_path, function_name):
            raise RuntimeError("no export here")

    key2 = ("stepX", "gpu", "BFloat16", 128, 128, False)
    with pytest.warns(RuntimeWarning, match="compiling it again with the DSL's engine"):
        comp = cc.compile_cached(key2, lambda: NoExport("engine"))
    assert comp.fn() == "engine" and builds[-2:] == [key2, key2] and stage_cache.detached[-2:] == [True, False]


@pytest.mark.cpu
@pytest.mark.fa4
def test_stages_never_patched_by_fa4():
    """The disk cache is passed in as a store: no stage module's compile_cached is replaced."""
    from stage3_fwd_kernel import compile_cache

    assert compile_cache.compile_cached.__module__ == "stage3_fwd_kernel.compile_cache"
    assert not hasattr(_cache, "install_for")


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_info_and_clear(cache_dir):
    _cache.DiskCache(_cache.cache_dir()).write("a" * 32, b"x" * 10)
    _cache.DiskCache(cache_dir / _cache.FORMAT / "0123456789abcdef").write("b" * 32, b"y" * 5)
    info = _cache.info()
    assert info["entries"] == 2 and info["bytes"] == 15 and info["current_entries"] == 1
    assert _cache.clear(stale_only=True) == (1, []) and _cache.info()["entries"] == 1
    assert _cache.clear() == (1, []) and _cache.info()["entries"] == 0


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_info_names_the_directories_kernel_processes_use(cache_dir, monkeypatch):
    """`cache info` runs without CUTE_DSL_ARCH (fa4 sets it from the device before compiling), so it has
    no directory of its own: it used to print the "auto" arch's, which no kernel process writes. It
    lists each target arch's instead, the one a process with that CUTE_DSL_ARCH uses."""
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    info = _cache.info(["sm_90a", "sm_100a"])
    assert info["process_dir"] is None
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    hopper = str(_cache.cache_dir())
    assert info["arch_dirs"] == {"sm_90a": hopper, "sm_100a": str(_cache.cache_dir("sm_100a"))}
    assert _cache.info(["sm_100a"])["process_dir"] == hopper == _cache.info(["sm_100a"])["arch_dirs"]["sm_90a"]


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_files_follow_the_umask(cache_dir):
    """tempfile.mkstemp makes 0600 files: an entry, its report and a plan get the mode open() would give
    under the umask instead, so a cache one user builds serves another who can read the directory."""
    want = 0o666 & ~_cache._UMASK
    dc = _cache.DiskCache(cache_dir / "gen")
    entry = dc.write("e" * 32, b"kernel")
    dc.write_report("e" * 32, {"registers": 128})
    for path in (entry, cache_dir / "gen" / f"{'e' * 32}.report.json"):
        assert path.stat().st_mode & 0o777 == want, oct(path.stat().st_mode)


@pytest.mark.cpu
@pytest.mark.fa4
def test_build_id_holds_the_dsl_settings_that_change_code(monkeypatch):
    """CUTE_DSL_LINEINFO (profiling builds) and the other settings the DSL keys its own JIT cache on change
    the generated objects, so they name a build of their own; logging, dumps and the DSL's caching do not."""
    for name in [n for n in os.environ if n.startswith("CUTE_DSL_") and n != "CUTE_DSL_ARCH"]:
        monkeypatch.delenv(name)
    plain = _cache.build_id()
    for neutral in ("CUTE_DSL_LOG_LEVEL", "CUTE_DSL_KEEP", "CUTE_DSL_KEEP_PTX", "CUTE_DSL_DUMP_DIR",
                    "CUTE_DSL_NO_CACHE"):
        monkeypatch.setenv(neutral, "1")
    assert _cache.build_id() == plain
    ids = set()
    for setting in ("CUTE_DSL_LINEINFO", "CUTE_DSL_DEBUG", "CUTE_DSL_COMPILER_OPT", "CUTE_DSL_ENABLE_ASSERTIONS"):
        monkeypatch.setenv(setting, "1")
        ids.add(_cache.build_id())
        monkeypatch.delenv(setting)
    assert len(ids) == 4 and plain not in ids


@pytest.mark.cpu
@pytest.mark.fa4
def test_earlier_cache_formats_are_shown_and_cleared(cache_dir):
    old = cache_dir / "kernels-v1" / "0123456789abcdef"
    old.mkdir(parents=True)
    (old / "x.o").write_bytes(b"z" * 1000)
    _cache.DiskCache(_cache.cache_dir()).write("a" * 32, b"x" * 10)
    info = _cache.info()
    assert info["old_formats"] == {"kernels-v1": 1000} and info["current_entries"] == 1
    assert _cache.clear(stale_only=True) == (1, []) and not (cache_dir / "kernels-v1").exists()
    assert _cache.info()["current_entries"] == 1  # this build's kept


@pytest.mark.cpu
@pytest.mark.fa4
def test_switches_and_a_cache_dir_of_no_such_user(cache_dir, monkeypatch):
    """FA4_CACHE / FA4_PLANS turn off for 0 / false / off / no in any case and spacing; a FA4_CACHE_DIR
    of ~user where no such user exists is taken as written (a cache that fails to write), not an error."""
    from fa4 import _plans

    for value in ("OFF", " no", "FALSE ", "0 "):
        monkeypatch.setenv("FA4_CACHE", value)
        assert not _cache.enabled() and not _plans.enabled()
    monkeypatch.setenv("FA4_CACHE", "1")
    monkeypatch.setenv("FA4_PLANS", "No")
    assert _cache.enabled() and not _plans.enabled()
    monkeypatch.setenv("FA4_CACHE_DIR", "~no_such_user_fa4/cache")
    assert _cache.root_dir() == pathlib.Path("~no_such_user_fa4/cache")


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_info_refuses_stale():
    res = run_cli("cache", "info", "--stale")
    assert res.returncode == 2 and "--stale: only with `cache clear`" in res.stderr


@pytest.mark.compile
@pytest.mark.fa4
def test_disk_cache_roundtrip_real_cute_object(cache_dir):
    """A real CuTe-DSL TVM-FFI compile (sm_90a, fake tensors) exported with export_to_c and
    reloaded with cute.runtime.load_module: the mechanism the cache relies on works in DSL 4.8.1."""
    from stage3_fwd_kernel import host_io  # first: the package sets CUTE_DSL_ARCH before cutlass loads

    import cutlass
    import cutlass.cute as cute

    # (no annotations: this file uses postponed annotations, which the DSL would evaluate in the
    # module namespace, where `cute` is not imported)
    @cute.kernel
    def scale_kernel(x, y):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < cute.size(x):
            y[i] = x[i] * cutlass.Float32(2.0)

    @cute.jit
    def scale(x, y, stream):
        scale_kernel(x, y).launch(grid=((cute.size(x) + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    fake = lambda: cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),))  # noqa: E731
    compiled = cute.compile(scale, fake(), fake(), host_io.launch_stream(),
                            options="--enable-tvm-ffi")
    dc = _cache.DiskCache(_cache.cache_dir())
    key = ("fa4_test_scale", "gpu", "Float32")
    path = dc.store(key, compiled)
    assert path is not None and path.stat().st_size > 1000
    fn, loaded_path = dc.load(key)
    assert loaded_path == path and callable(fn) and type(fn).__name__ == "Function"  # a tvm_ffi.Function


# ================================================================================ CLI + README
@pytest.mark.cpu
@pytest.mark.fa4
def test_cli_info(tmp_path):
    res = run_cli("info", env={"FA4_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "torch" in out and "nvidia-cutlass-dsl" in out and "sm_90" in out and "sm_100" in out
    assert "<!--" not in out and f"compile cache (enabled): {tmp_path}" in out
    md = run_cli("info", "--markdown", timeout=120)
    assert md.returncode == 0 and md.stdout.strip() == _dispatch.support_markdown().strip()
    js = run_cli("info", "--json", timeout=120)
    assert json.loads(js.stdout) == json.loads(json.dumps(fa4.supported()))
    cache = run_cli("cache", "info", env={"FA4_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert json.loads(cache.stdout)["root"] == str(tmp_path / _cache.FORMAT)


@pytest.mark.cpu
@pytest.mark.fa4
def test_cli_bench_works_outside_the_repository(tmp_path):
    """`python -m fa4 bench` ships in the package: its help runs from any directory, bad arguments are
    refused, and without a GPU it says so instead of timing."""
    res = run_cli("bench", "--help", cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and "paired rounds" in res.stdout and "--head-dims" in res.stdout, res.stderr
    res = run_cli("bench", "--seqlens", "3000", cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "--seqlens must divide 32768" in res.stderr, res.stderr
    res = run_cli("bench", "--head-dims", "x", cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "--head-dims" in res.stderr, res.stderr
    res = run_cli("bench", "--json", str(tmp_path / "missing" / "b.json"), cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "bench: --json:" in res.stderr and "does not exist" in res.stderr, res.stderr
    if not torch.cuda.is_available():
        res = run_cli("bench", "--head-dims", "64", cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, res.stderr


@pytest.mark.cpu
@pytest.mark.fa4
def test_readme_support_matrix_is_generated():
    """fa4/README.md's matrix is the output of `python -m fa4 info --markdown`, never typed by hand."""
    text = (ROOT / "fa4" / "README.md").read_text()
    assert _dispatch.support_markdown() in text, (
        "fa4/README.md's support matrix is stale: run `python -m fa4 info --markdown --update-readme`")


@pytest.mark.compile
@pytest.mark.fa4
def test_cli_precompile_without_a_gpu_fills_the_disk_cache(tmp_path):
    """No GPU: the Hopper forward, backward (preprocess, main, postprocess) and varlen forward are
    built as the GPU path launches them and written to the disk cache; a second run loads them."""
    env = {"FA4_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    res = run_cli("precompile", "--head-dims", "64", "--causal", "yes", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no GPU: compiling for sm_90a" in res.stdout and "[####################] 3/3" in res.stdout
    assert res.stdout.count("written to disk") == 3 and "spills=0/0" in res.stdout
    assert "5 kernels written" in res.stdout and len(list(tmp_path.rglob("*.o"))) == 5
    again = run_cli("precompile", "--head-dims", "64", "--causal", "yes", env=env)
    assert again.returncode == 0 and again.stdout.count("already on disk") == 3, again.stdout + again.stderr
    assert "0 kernels written" in again.stdout


@pytest.mark.compile
@pytest.mark.fa4
def test_cli_precompile_heads_builds_the_lpt_forwards(tmp_path):
    """--heads adds the LPT-ordered causal forwards (one per section size up to --max-seqlen) under the
    GPU path's cache keys; without --heads a note says they exist."""
    env = {"FA4_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    res = run_cli("precompile", "--head-dims", "64", "--causal", "yes", "--no-backward", "--heads", "16,12/4",
                  "--max-seqlen", "16384", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    expect = _dispatch.lpt_forward_schedulers("sm_90", 64, 64, 16, 16, 16384)
    expect_gqa = _dispatch.lpt_forward_schedulers("sm_90", 64, 64, 12, 4, 16384)
    lines = [ln for ln in res.stdout.splitlines() if "fwd lpt bf16 d=64 causal" in ln]
    assert len(lines) == len(expect) + len(expect_gqa) >= 3, res.stdout
    for (first, last, sched), line in zip(expect, lines):
        assert f"{sched.heads_per_section} heads/section, keys {first}-{last}, heads 16/16" in line, line
    assert all("written to disk" in ln and "spills=0/0" in ln for ln in lines), res.stdout
    assert len(list(tmp_path.rglob("*.o"))) == 2 + len(lines)  # fwd + varlen + the LPT kernels
    plain = run_cli("precompile", "--head-dims", "64", "--causal", "yes", "--no-backward", env=env)
    assert plain.returncode == 0 and "add --heads HQ[/HKV]" in plain.stdout, plain.stdout + plain.stderr


@pytest.mark.compile
@pytest.mark.fa4
def test_cli_demo_compiles_the_production_forward():
    res = run_cli("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compiled for sm_90a with fake tensors" in res.stdout
    assert "builds for sm_90a, no spills" in res.stdout and "FAIL" not in res.stdout
