"""Command line: python -m fa4 {demo, info, bench, precompile, firstcall, cache}.

    demo        run every stage available here and print a report (GPU: fa4 vs reference + timing)
    info        versions, devices, the support matrix, the compile cache
                --markdown prints the README support-matrix block; --update-readme rewrites it
    bench       fa4 against torch SDPA (and the official FA4 if installed), paired rounds (GPU)
    precompile  build the common kernel configs ahead of time, or exactly a model's (see fa4/precompile.py)
    firstcall   time a fresh process's first call, step by step, cold and warm (see fa4/firstcall.py)
    cache       cache info | clear [--stale]

Output closed early (`python -m fa4 info --json | head`) ends the command quietly with status 141
(128 + SIGPIPE, what a shell reports for a writer whose reader went away), not a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import sys

README = pathlib.Path(__file__).resolve().parent / "README.md"


def _version(pkg):
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _info(args) -> int:
    from . import _cache
    from ._dispatch import supported, support_markdown

    if args.markdown or args.update_readme:
        block = support_markdown()
        if args.update_readme:
            return _update_readme(block)
        print(block)
        return 0
    if args.json:
        print(json.dumps(supported(), indent=1))
        return 0
    import numpy

    print(f"python {platform.python_version()}  numpy {numpy.__version__}")
    try:
        import torch

        print(f"torch {torch.__version__}  CUDA runtime {torch.version.cuda}")
        if torch.cuda.is_available():
            from ._dispatch import UnsupportedDeviceError, arch_for_capability

            for i in range(torch.cuda.device_count()):
                cap = torch.cuda.get_device_capability(i)
                try:
                    a = arch_for_capability(cap)
                    status = "verified" if a.hardware_status == "verified" else "UNVERIFIED on hardware"
                    served = f"fa4 {a.key} kernels ({status})"
                except UnsupportedDeviceError:
                    served = "no fa4 kernel for this capability"
                print(f"CUDA device {i}: {torch.cuda.get_device_name(i)} "
                      f"(compute capability {cap[0]}.{cap[1]}): {served}")
        else:
            print("CUDA device: none (fa4 kernels need a GPU; compile-only builds still work)")
    except ImportError:
        print("torch: not installed")
    print(f"nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl') or 'not installed'}")
    from .firstcall import bytecode_hint

    hint = bytecode_hint()
    if hint:
        print("  note: " + hint)
    tf = _version("transformers")
    print(f"transformers {tf or 'not installed (fa4.integrations.transformers needs it)'}")
    print()
    print(_without_markers(support_markdown()))
    print()
    _print_cache(_cache.info(_target_archs()))
    return 0


def _target_archs() -> list[str]:
    """The CUTE_DSL_ARCH values fa4 compiles for, to name the cache's directories by arch."""
    from ._dispatch import ARCHS

    return [a.cute_arch for a in ARCHS.values()]


def _without_markers(block: str) -> str:
    """The support matrix for people: the README's HTML comment markers (which `--markdown` and
    `--update-readme` keep, so the README block can be found and rewritten) left out."""
    from ._dispatch import README_BEGIN, README_END

    return "\n".join(ln for ln in block.splitlines() if ln.strip() not in (README_BEGIN, README_END)).strip("\n")


def _print_cache(ci: dict):
    state = "enabled" if ci["enabled"] else "disabled (FA4_CACHE=0)"
    print(f"compile cache ({state}): {ci['root']}")
    print(f"  this build ({ci['build']}): {ci['current_entries']} kernels, {ci['current_plans']} launch plans, "
          f"{_human(ci['current_bytes'])}" + ("" if ci["current"] else ", none on disk yet"))
    for name, gen in ci["current"].items():
        print(f"    {gen['arch'] or 'other arch':<10} {name}  {gen['entries']} kernels, {gen['plans']} launch plans, "
              f"{_human(gen['bytes'])}")
    stale = len(ci["stale"])
    old = ci.get("old_formats") or {}
    print(f"  all directories: {len(ci['generations'])} ({ci['entries']} kernels, {_human(ci['bytes'])}), "
          f"{stale} of other builds" + (f"; earlier cache formats: {', '.join(old)} ({_human(sum(old.values()))})"
                                         if old else "")
          + ("; `python -m fa4 cache clear --stale` removes those" if stale or old else ""))


def _update_readme(block: str) -> int:
    from ._dispatch import README_BEGIN, README_END

    text = README.read_text()
    if README_BEGIN not in text or README_END not in text:
        print(f"{README}: markers not found; add {README_BEGIN!r} ... {README_END!r}", file=sys.stderr)
        return 1
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    README.write_text(head + block + tail)
    print(f"updated the support matrix in {README}")
    return 0


def _cache_cmd(args) -> int:
    from . import _cache

    if args.action == "info" and args.stale:
        print("--stale: only with `cache clear` (`cache info` lists the stale directories under \"stale\")",
              file=sys.stderr)
        return 2
    if args.action == "clear":
        n, failed = _cache.clear(stale_only=args.stale)
        print(f"removed {n} cache director{'y' if n == 1 else 'ies'} (one per build and arch) under "
              f"{_cache.root_dir() / _cache.FORMAT}")
        for what in failed:
            print(f"could not remove {what}", file=sys.stderr)
        if args.stale:
            kept = _cache.info(_target_archs())["current"]
            print(f"kept this build's ({_cache.build_id()}): "
                  + (", ".join(f"{g['arch'] or 'other arch'} {name}" for name, g in kept.items()) or "none on disk"))
        return 1 if failed else 0
    print(json.dumps(_cache.info(_target_archs()), indent=1))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to fa4.bench's own parser
        from .bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fa4", description="FlashAttention-4 from scratch",
                                     epilog="`python -m fa4 COMMAND --help` shows a command's options")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="run every stage available here and print a report")
    p_info = sub.add_parser("info", help="versions, devices, support matrix, compile cache")
    p_info.add_argument("--markdown", action="store_true", help="print the README support-matrix block only")
    p_info.add_argument("--update-readme", action="store_true", help="rewrite that block in fa4/README.md")
    p_info.add_argument("--json", action="store_true", help="fa4.supported() as JSON")
    sub.add_parser("bench", help="time fa4 against torch SDPA on this GPU (`python -m fa4 bench --help`)")
    from .precompile import add_arguments

    add_arguments(sub.add_parser("precompile", help="build the common kernel configs ahead of time, or a model's "
                                                    "(--shapes / --model-config)"))
    from .firstcall import add_arguments as firstcall_arguments

    firstcall_arguments(sub.add_parser("firstcall", help="time a fresh process's first call step by step, "
                                                         "cold and warm cache"))
    p_cache = sub.add_parser("cache", help="show or clear the on-disk compile cache")
    p_cache.add_argument("action", choices=["info", "clear"],
                         help="info: the cache as JSON; clear: delete cached kernels")
    p_cache.add_argument("--stale", action="store_true",
                         help="clear only other builds' generations (this build's are kept for every arch)")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo()
    if args.cmd == "precompile":
        from .precompile import main as precompile_main

        return precompile_main(args)
    if args.cmd == "firstcall":
        from .firstcall import main as firstcall_main

        return firstcall_main(args)
    if args.cmd == "cache":
        return _cache_cmd(args)
    return _info(args)


def run(argv=None) -> int:
    """`main`, with a reader that closes our stdout early (`| head`) ending it quietly: the
    standard recipe (Python docs, signal module, "Note on SIGPIPE") -- catch BrokenPipeError, point
    stdout at devnull so the interpreter's final flush cannot raise again, exit 128 + SIGPIPE."""
    try:
        try:
            return main(argv)
        finally:  # flush here, inside the handler: a buffered tail would otherwise fail at exit
            sys.stdout.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 128 + getattr(signal, "SIGPIPE", 13)


if __name__ == "__main__":
    sys.exit(run())
