"""`python -m fa4` across processes: what one command leaves on disk, the next one reads.

cpu tier: the cache generation is one definition for every command (a directory written for an
arch by one process is "this build's" in a process that targets another arch or none, so
`cache clear --stale` keeps it and removes only other builds'); `info` prints the support matrix
without the README's HTML comment markers, which `--markdown` / `--update-readme` keep; a reader
that closes the pipe early ends a command quietly (no BrokenPipeError traceback); `--help` of the
CLI and of each command.

compile tier: `precompile` (no GPU, sm_90a), then `cache clear --stale`, then `cache info` and a
second `precompile`: the kernels survive the clear and are loaded, not rebuilt.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from fa4 import __main__ as cli
from fa4 import _cache, _dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "info", "bench", "precompile", "cache", "firstcall")
SIGPIPE_STATUS = 141  # 128 + SIGPIPE


def run_cli(*args, env=None, timeout=300, cwd=ROOT, drop=()):
    """`python -m fa4 ARGS` in a fresh process; `drop` removes variables from its environment."""
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "fa4", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=e)


_WRITE_AS = """
import sys
from fa4 import _cache
print(_cache.DiskCache(_cache.cache_dir()).write(sys.argv[1] * 32, b"kernel"))
"""


def write_as(arch, key_char, env):
    """A kernel written by a process whose CUTE_DSL_ARCH is `arch` (None: unset), the way the
    runtime and precompile write: into `cache_dir()` of that process."""
    e = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    e.update(env, **({"CUTE_DSL_ARCH": arch} if arch else {}))
    res = subprocess.run([sys.executable, "-c", _WRITE_AS, key_char], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=e)
    assert res.returncode == 0, res.stderr
    return pathlib.Path(res.stdout.strip())


# ================================================================================ cache generations
@pytest.mark.cpu
@pytest.mark.fa4
def test_generation_is_the_build_and_the_arch_is_a_tag():
    """One build id for all archs; the directory name adds an arch tag that tells the known archs
    (and an unset CUTE_DSL_ARCH) apart, whatever the build."""
    archs = [a.cute_arch for a in _dispatch.ARCHS.values()] + ["auto"]
    names = {a: _cache.fingerprint(a) for a in archs}
    assert len(set(names.values())) == len(archs)
    assert len({_cache.arch_tag(a) for a in archs}) == len(archs)
    for name in names.values():
        assert len(name) == 16 and name.startswith(_cache.build_id()) and _cache.is_current(name)
    assert not _cache.is_current("0123456789abcdef") and not _cache.is_current(_cache.build_id())


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_clear_stale_keeps_every_arch_of_this_build_across_processes(tmp_path):
    """Processes that target sm_90a, sm_100a and no arch write kernels; `cache clear --stale` run
    with yet another CUTE_DSL_ARCH (and one with none) keeps all three and removes only the
    directories of other builds, made by hand here."""
    env = {"FA4_CACHE_DIR": str(tmp_path)}
    mine = {arch: write_as(arch, c, env) for arch, c in (("sm_90a", "a"), ("sm_100a", "b"), (None, "c"))}
    assert len({p.parent for p in mine.values()}) == 3
    root = tmp_path / _cache.FORMAT
    other_build = root / ("f" * 12 + _cache.arch_tag("sm_90a"))  # same arch tag, another build
    if other_build.name[:12] == _cache.build_id():
        other_build = root / ("e" * 12 + _cache.arch_tag("sm_90a"))
    stale = [other_build, root / "0123456789abcdef", root / "not-a-generation"]
    for d in stale:
        _cache.DiskCache(d).write("d" * 32, b"old kernel")

    info = json.loads(run_cli("cache", "info", env=env, drop=("CUTE_DSL_ARCH",), timeout=120).stdout)
    assert sorted(info["stale"]) == sorted(d.name for d in stale)
    assert info["current_entries"] == 3 and info["entries"] == 6
    assert {g["arch"] for g in info["current"].values()} == {"sm_90a", "sm_100a", "auto"}

    res = run_cli("cache", "clear", "--stale", env=dict(env, CUTE_DSL_ARCH="sm_100a"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "removed 3 cache directories" in res.stdout and "sm_90a" in res.stdout, res.stdout
    assert all(p.exists() for p in mine.values()) and not any(d.exists() for d in stale)
    res = run_cli("cache", "clear", "--stale", env=env, drop=("CUTE_DSL_ARCH",), timeout=120)
    assert "removed 0 cache directories" in res.stdout and all(p.exists() for p in mine.values())

    human = run_cli("info", env=env, drop=("CUTE_DSL_ARCH",), timeout=120)
    assert human.returncode == 0, human.stderr
    assert f"this build ({_cache.build_id()}): 3 kernels" in human.stdout, human.stdout
    for arch in ("sm_90a", "sm_100a"):
        assert f"{arch:<10} {_cache.fingerprint(arch)}  1 kernels" in human.stdout, human.stdout
    assert "0 of other builds" in human.stdout

    res = run_cli("cache", "clear", env=env, timeout=120)  # without --stale: everything
    assert "removed 3 cache directories" in res.stdout and not any(p.exists() for p in mine.values())


@pytest.mark.compile
@pytest.mark.fa4
def test_cli_precompiled_kernels_survive_cache_clear_stale(tmp_path):
    """The reported defect: `precompile` (no GPU: sm_90a) wrote kernels that a following `cache
    clear --stale` (no CUTE_DSL_ARCH) deleted. Now they stay, `cache info` counts them as this
    build's, and a second precompile finds them on disk."""
    env = {"FA4_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    args = ("precompile", "--head-dims", "64", "--causal", "yes", "--no-backward")
    res = run_cli(*args, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no GPU: compiling for sm_90a" in res.stdout and res.stdout.count("written to disk") == 2, res.stdout
    written = sorted(tmp_path.rglob("*.o"))
    assert len(written) == 2 and {p.parent.name for p in written} == {_cache.fingerprint("sm_90a")}
    stale = tmp_path / _cache.FORMAT / "0123456789abcdef"
    _cache.DiskCache(stale).write("d" * 32, b"old kernel")

    res = run_cli("cache", "clear", "--stale", env=env, drop=("CUTE_DSL_ARCH",), timeout=120)
    assert res.returncode == 0 and "removed 1 cache directory" in res.stdout, res.stdout + res.stderr
    assert sorted(tmp_path.rglob("*.o")) == written and not stale.exists()

    info = json.loads(run_cli("cache", "info", env=env, drop=("CUTE_DSL_ARCH",), timeout=120).stdout)
    assert info["current_entries"] == 2 and info["stale"] == []
    assert [g["arch"] for g in info["current"].values()] == ["sm_90a"]
    again = run_cli(*args, env=env)
    assert again.returncode == 0 and again.stdout.count("already on disk") == 2, again.stdout + again.stderr
    assert "0 kernels written" in again.stdout


# ================================================================================ info output
@pytest.mark.cpu
@pytest.mark.fa4
def test_info_prints_the_matrix_without_html_markers_and_markdown_keeps_them(tmp_path):
    res = run_cli("info", env={"FA4_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "<!--" not in res.stdout and "-->" not in res.stdout, res.stdout
    table = [ln for ln in _dispatch.support_markdown().splitlines() if ln.startswith("|")]
    assert table and all(ln in res.stdout.splitlines() for ln in table)  # the matrix itself is all there
    md = run_cli("info", "--markdown", timeout=120)
    assert md.returncode == 0 and md.stdout.strip() == _dispatch.support_markdown().strip()
    assert md.stdout.startswith(_dispatch.README_BEGIN) and md.stdout.strip().endswith(_dispatch.README_END)


@pytest.mark.cpu
@pytest.mark.fa4
def test_update_readme_keeps_the_markers(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# fa4\n\nbefore\n\n{_dispatch.README_BEGIN}\nold table\n{_dispatch.README_END}\n\nafter\n")
    monkeypatch.setattr(cli, "README", readme)
    assert cli.main(["info", "--markdown", "--update-readme"]) == 0
    text = readme.read_text()
    assert f"before\n\n{_dispatch.support_markdown()}\n\nafter\n" in text and "old table" not in text
    assert text.count(_dispatch.README_BEGIN) == 1 and text.count(_dispatch.README_END) == 1
    assert cli.main(["info", "--update-readme"]) == 0 and readme.read_text() == text  # idempotent
    assert "updated the support matrix" in capsys.readouterr().out


# ================================================================================ closed pipes
def _traceback_free(stderr: str) -> bool:
    return not any(s in stderr for s in ("Traceback", "BrokenPipeError", "Exception ignored"))


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux pipes (F_SETPIPE_SZ) for a deterministic "
                    "early close")
def test_reader_closing_the_pipe_early_ends_info_json_quietly():
    """`python -m fa4 info --json | head -c 16`, made deterministic: the pipe holds one page, the
    output is longer, the reader takes a few bytes and closes."""
    rd, wr = os.pipe()
    fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, 4096)
    assert fcntl.fcntl(wr, fcntl.F_GETPIPE_SZ) < len(json.dumps(_dispatch.supported(), indent=1))
    proc = subprocess.Popen([sys.executable, "-m", "fa4", "info", "--json"], cwd=ROOT, stdout=wr,
                            stderr=subprocess.PIPE, text=True)
    os.close(wr)
    try:
        assert os.read(rd, 16).startswith(b"{")
    finally:
        os.close(rd)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == SIGPIPE_STATUS and _traceback_free(err), (proc.returncode, err)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("args", [("info",), ("info", "--json"), ("info", "--markdown"), ("cache", "info"),
                                  ("--help",), ("precompile", "--help"), ("bench", "--help")])
def test_every_printing_command_survives_a_closed_stdout(args, tmp_path):
    """stdout is a pipe whose reader is already gone: quiet exit, success or 141, never a traceback."""
    rd, wr = os.pipe()
    os.close(rd)
    try:
        res = subprocess.run([sys.executable, "-m", "fa4", *args], cwd=ROOT, stdout=wr, stderr=subprocess.PIPE,
                             text=True, timeout=120, env=dict(os.environ, FA4_CACHE_DIR=str(tmp_path)))
    finally:
        os.close(wr)
    assert res.returncode in (0, SIGPIPE_STATUS) and _traceback_free(res.stderr), (res.returncode, res.stderr)


@pytest.mark.cpu
@pytest.mark.fa4
def test_shell_pipeline_into_head_has_no_traceback():
    res = subprocess.run(f"'{sys.executable}' -m fa4 info --json | head -c 16 >/dev/null", shell=True, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and _traceback_free(res.stderr), res.stderr


# ================================================================================ help
@pytest.mark.cpu
@pytest.mark.fa4
def test_help_lists_every_command_and_each_command_has_help():
    res = run_cli("--help", timeout=120)
    assert res.returncode == 0, res.stderr
    for cmd in COMMANDS:
        assert f"    {cmd}" in res.stdout, (cmd, res.stdout)
    for cmd in COMMANDS:
        sub = run_cli(cmd, "--help", timeout=120)
        assert sub.returncode == 0 and sub.stdout.startswith("usage:"), (cmd, sub.stdout, sub.stderr)
        assert f"python -m fa4 {cmd}" in sub.stdout, (cmd, sub.stdout)
    cache = run_cli("cache", "--help", timeout=120).stdout
    assert "info" in cache and "clear" in cache and "--stale" in cache
    assert run_cli(timeout=120).returncode == 2  # no command: a usage error, not a crash


BAD_OPTIONS = {  # id -> (argv, what stderr says)
    "precompile-head-dims-word": (["precompile", "--arch", "sm_90a", "--head-dims", "abc"],
                                  r"--head-dims: expected comma-separated"),
    "precompile-head-dims-pair": (["precompile", "--arch", "sm_90a", "--head-dims", "64/abc"],
                                  r"--head-dims: expected comma-separated"),
    "precompile-head-dims-unserved": (["precompile", "--arch", "sm_90a", "--head-dims", "1000"],
                                      r"head_dims: \[\(1000, 1000\)\] not supported"),
    "precompile-shapes-empty": (["precompile", "--arch", "sm_90a", "--shapes", ""], r"--shapes: the spec is empty"),
    "precompile-shapes-unserved": (["precompile", "--arch", "sm_90a", "--shapes", "d=1000,heads=8"],
                                   r"--shapes / --model-config: .*head_dim"),
    "precompile-shapes-dtype": (["precompile", "--arch", "sm_90a", "--shapes", "d=128,heads=32/8", "--dtype", "fp16"],
                                r"leave out --dtype"),
    "precompile-head-dims-three": (["precompile", "--arch", "sm_90a", "--head-dims", "64/64/64"],
                                   r"--head-dims: expected comma-separated"),
    "precompile-head-dims-zero": (["precompile", "--arch", "sm_90a", "--head-dims", "0"],
                                  r"--head-dims: expected comma-separated"),
    "precompile-dtype": (["precompile", "--arch", "sm_90a", "--head-dims", "64", "--dtype", "xx"],
                         r"--dtype: expected a comma list of bf16, fp16"),
    "precompile-decode-alone": (["precompile", "--arch", "sm_90a", "--head-dims", "64", "--decode"],
                                r"--decode: only with --shapes / --model-config"),
    "precompile-varlen-alone": (["precompile", "--arch", "sm_90a", "--varlen"],
                                r"--varlen: only with --shapes / --model-config"),
    "firstcall-repeat-0": (["firstcall", "--repeat", "0"], r"--repeat: expected an int >= 1"),
    "firstcall-seqlen-0": (["firstcall", "--seqlen", "0"], r"--seqlen: expected an int >= 1"),
    "firstcall-head-dim": (["firstcall", "--head-dim", "1000"],
                           r"--head-dim / --head-dim-v: \(1000, 1000\) has no kernel"),
}


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option_values_end_before_any_work(case, tmp_path, capsys, monkeypatch):
    """precompile and firstcall: a bad value ends in one line on stderr and exit status 2, before
    anything is built or a child process runs."""
    import re

    from fa4 import firstcall, precompile

    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    for module, name in ((precompile, "compile_only"), (precompile, "build_derived"), (firstcall, "run_child")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("worked despite a bad option"))
    argv, message = BAD_OPTIONS[case]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


@pytest.mark.cpu
@pytest.mark.fa4
def test_precompile_on_a_gpu_fa4_does_not_serve_says_so(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert cli.main(["precompile"]) == 2
    err = capsys.readouterr().err
    assert "compute capability 8.0" in err and "--arch sm_90a" in err and "Traceback" not in err


@pytest.mark.cpu
@pytest.mark.fa4
def test_model_config_checks_its_heads_and_dtype(tmp_path, capsys, monkeypatch):
    """--model-config: query heads that are no multiple of the KV heads, and more than one --dtype, end
    with exit status 2 before anything is built."""
    import json

    from fa4 import precompile

    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "build_derived", lambda *a, **k: pytest.fail("built despite a bad config"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 64}))
    assert cli.main(["precompile", "--arch", "sm_90a", "--model-config", str(bad)]) == 2
    assert "num_attention_heads (32) must be a positive multiple of num_key_value_heads (5)" in capsys.readouterr().err
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}))
    assert cli.main(["precompile", "--arch", "sm_90a", "--model-config", str(ok), "--dtype", "fp16,bf16"]) == 2
    assert "--dtype: one of bf16, fp16 with --model-config" in capsys.readouterr().err


@pytest.mark.cpu
@pytest.mark.fa4
def test_precompile_says_when_the_disk_cache_could_not_store_a_build():
    """A build whose kernels the cache failed to write reads 'NOT all written' (it said 'not written
    (cache off?)', and precompile exited 0 with nothing on disk)."""
    from fa4 import precompile

    zero = dict(stores=0, disk_hits=0, misses=0, memory_hits=0, store_errors=0)
    assert precompile._state(zero, dict(zero, misses=3, stores=1, store_errors=2), True).startswith("NOT all written")
    assert precompile._state(zero, dict(zero, misses=3, stores=3), True) == "written to disk"


@pytest.mark.cpu
@pytest.mark.fa4
def test_an_unreadable_cache_directory_is_a_miss_not_an_error(tmp_path, capsys, monkeypatch):
    """A cache root this process cannot read (no permission, a name too long) must not fail a call or
    a command: the kernel store and the plan lookup see nothing, `info` and `cache clear` report."""
    import pathlib

    from fa4 import _cache, _plans

    locked = tmp_path / "locked"
    monkeypatch.setenv("FA4_CACHE_DIR", str(locked / "inner"))
    monkeypatch.delenv("FA4_CACHE", raising=False)
    for name in ("is_dir", "exists"):
        real = getattr(pathlib.Path, name)

        def denied(self, real=real):
            if str(self).startswith(str(locked)):
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)
        monkeypatch.setattr(pathlib.Path, name, denied)
    with pytest.warns(RuntimeWarning, match="fa4 cache: could not read"):
        assert _cache.DiskCache(_cache.cache_dir("sm_90a")).entries("0" * 32) == []
    _plans.forget()
    assert _plans.lookup("0" * 64, "sm_90a") is None
    assert _cache.info()["generations"] == []
    n, failed = _cache.clear()
    assert n == 0 and failed and "Permission denied" in failed[0]
    _plans.forget()


@pytest.mark.cpu
@pytest.mark.fa4
def test_cache_clear_reports_what_it_could_not_remove(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    gen = tmp_path / _cache.FORMAT / "some-generation"
    gen.mkdir(parents=True)
    (gen / "x.o").write_bytes(b"0")

    def refuse(path, **kw):  # a read-only file system, say
        handler = kw.get("onexc") or kw.get("onerror")
        handler(os.unlink, str(gen / "x.o"), PermissionError("read-only"))
    monkeypatch.setattr(_cache.shutil, "rmtree", refuse)
    assert cli.main(["cache", "clear"]) == 1
    err = capsys.readouterr().err
    assert "could not remove" in err and "read-only" in err and (gen / "x.o").exists()


@pytest.mark.cpu
@pytest.mark.fa4
def test_firstcall_takes_one_heads_pair(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["firstcall", "--heads", "32/8,16"])
    assert exc.value.code == 2 and "expected one HQ[/HKV] pair" in capsys.readouterr().err
