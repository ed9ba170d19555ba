"""The forward's key-block loop, counted in SASS: compiled here for sm_90a, no GPU needed.

    python -m benchmarks.inspect.hot_loop --dim 64 --causal [--seqlen-k 16384] \\
        [--impls stage3_fwd_kernel.hopper,my_copy] [--sass official.sass] [--opcodes] [--listing] [--map]

For each build: registers, spills, and in its unmasked key-block loop (``sass_report.key_block_loop``)
the instruction count, the uniform-datapath share (``U...`` opcodes: ring slots, barrier addresses,
wgmma descriptors), HGMMA, MUFU.EX2, FADD, FMUL and the sign fix-ups of signed divisions (LEA.HI). A
module in ``--impls`` is the production forward, a lesson, or an untracked copy (its own ``STEP``;
``compile_only`` with the production arguments). ``--sass`` adds SASS listings made elsewhere, e.g.
the official kernel's cubin kept with ``CUTE_DSL_KEEP=cubin`` and disassembled with ``nvdisasm``, or
compiled here by ``benchmarks.inspect.official_sass``. ``--opcodes`` prints the opcodes whose counts
differ from the first build's, ``--listing`` each loop as text, ``--map`` each loop as letters (an
exp2 is ``e``, a pack ``p``, the wait for P V ``[W0]``: MAP_LEGEND). ``--seqlen-k`` picks the build fa4
launches for that key count (persistent or one CTA per tile); leave it out for the short-call build.

Counts explain a change, they do not predict its time: measure with ``benchmarks.inspect.trace_fwd``
and ``benchmarks.ab_fwd`` on a GPU.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys

PRODUCTION = "stage3_fwd_kernel.hopper"
COLUMNS = ("registers", "spills", "loop", "uniform", "HGMMA", "MUFU.EX2", "FADD", "FMUL", "LEA.HI")


def loop_counts(loop: list) -> dict:
    """The summary columns of one loop's opcodes (full opcodes, as loop_opcodes gives them)."""
    return {
        "loop": len(loop),
        "uniform": sum(op.startswith("U") for op in loop),
        "HGMMA": sum(op.startswith("HGMMA") for op in loop),
        "MUFU.EX2": sum(op.startswith("MUFU.EX2") for op in loop),
        "FADD": sum(op.split(".")[0] == "FADD" for op in loop),
        "FMUL": sum(op.split(".")[0] == "FMUL" for op in loop),
        "LEA.HI": sum(op.startswith(("LEA.HI", "ULEA.HI")) for op in loop),
    }


# --map: one character per instruction of the loop, and a line of its own for each sync point
MAP_LETTERS = (("MUFU.EX2", "e"), ("F2FP", "p"), ("HGMMA", "H"), ("FMNMX", "m"), ("FADD", "a"), ("FMUL", "u"),
               ("FFMA", "f"), ("SHFL", "s"), ("SYNCS", "S"))
SYNC_TAGS = (("WARPGROUP.DEPBAR", "W"), ("BAR.", "BAR"), ("VOTE.", "VOTE"), ("BRA", "BRA"),
             ("WARPGROUP.ARRIVE", "ARRIVE"))  # W: the wgmma wait, W0 / W1 by its operand
MAP_LEGEND = ("e exp2 (MUFU), p pack 2 x fp32 -> 16 bits, H wgmma, m max, a add, u multiply, f fma, "
              "s shuffle, S mbarrier; [W1] wait for S, [W0] wait for P V, [BAR]/[VOTE]/[BRA]/[ARRIVE]: "
              "barrier, warp vote, branch, wgmma fence; . anything else")


def loop_map(listing: str) -> str:
    """The loop as a string of letters (MAP_LEGEND): where the exponentials, packs and waits sit."""
    out = []
    for line in listing.splitlines():
        words = line.split()
        if not words or words[0].endswith(":"):
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        tag = next((t for prefix, t in SYNC_TAGS if op.startswith(prefix)), None)
        if tag == "W":
            tag = "W0" if "0x0" in line else "W1"
        out.append(f"\n[{tag}]" if tag else next((c for prefix, c in MAP_LETTERS if op.startswith(prefix)), "."))
    return "".join(out).strip()


def opcode_histogram(loop: list) -> collections.Counter:
    return collections.Counter(op.split(".")[0] for op in loop)


def compile_build(module: str, args) -> tuple[dict, list, str]:
    """(report columns, key-block loop opcodes, its listing) of one module's build for the shape in args."""
    from stage3_fwd_kernel.sass_report import key_block_loop, key_block_loop_listing

    mod = importlib.import_module(module)
    comp = mod.compile_only(args.dtype, args.dim, args.dim_v or args.dim, args.causal, seqlen_k=args.seqlen_k)
    if not comp.sass:
        raise SystemExit("hot_loop: no SASS (nvdisasm missing?)")
    loop = key_block_loop(comp.sass)
    rep = comp.report
    cols = {"registers": rep["registers"], "spills": rep["spill_stores"], **loop_counts(loop)}
    return cols, loop, key_block_loop_listing(comp.sass)


def sass_build(path: str) -> tuple[dict, list, str]:
    from stage3_fwd_kernel.sass_report import key_block_loop, key_block_loop_listing

    with open(path) as f:
        sass = f.read()
    loop = key_block_loop(sass)
    if not loop:
        raise SystemExit(f"hot_loop: {path} has no loop with both HGMMA and MUFU.EX2")
    return {"registers": "-", "spills": "-", **loop_counts(loop)}, loop, key_block_loop_listing(sass)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The forward shape a loop is compiled for (official_sass takes the same)."""
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dim_v", type=int, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap)
    ap.add_argument("--seqlen-k", dest="seqlen_k", type=int, default=None,
                    help="the key count whose fa4 build to count (persistent or not); default: a short call")
    ap.add_argument("--impls", default=PRODUCTION, help="comma-separated module paths (the production forward, "
                                                         "a lesson, or copies)")
    ap.add_argument("--sass", action="append", default=[], help="a SASS listing to count as well (repeatable)")
    ap.add_argument("--opcodes", action="store_true", help="opcodes whose counts differ from the first build's")
    ap.add_argument("--listing", action="store_true", help="print each build's loop, one instruction per line")
    ap.add_argument("--map", action="store_true", help="print each build's loop as a line of letters per stretch "
                                                       "between sync points (where exp2s, packs and waits sit)")
    args = ap.parse_args(argv)

    builds = {}
    for module in filter(None, args.impls.split(",")):
        print(f"compiling {module} ...", file=sys.stderr, flush=True)
        builds[module.rsplit(".", 1)[-1]] = compile_build(module, args)
    for path in args.sass:
        builds[os.path.basename(path)] = sass_build(path)

    shape = f"{args.dtype} d = {args.dim}" + (f"/{args.dim_v}" if args.dim_v else "")
    shape += (" causal" if args.causal else " non-causal") + (f", build for {args.seqlen_k} keys" if args.seqlen_k else "")
    print(f"key-block loop, {shape} (sm_90a SASS, static counts)")
    width = max(len(name) for name in builds) + 2
    print(f"{'build':<{width}}" + "".join(f"{c:>10}" for c in COLUMNS))
    for name, (cols, _, _) in builds.items():
        print(f"{name:<{width}}" + "".join(f"{cols[c]!s:>10}" for c in COLUMNS))

    if args.opcodes and len(builds) > 1:
        (first, (_, base_loop, _)), *others = builds.items()
        base = opcode_histogram(base_loop)
        for name, (_, loop, _) in others:
            hist = opcode_histogram(loop)
            diff = sorted(((op, hist[op] - base[op]) for op in set(base) | set(hist) if hist[op] != base[op]),
                          key=lambda item: -abs(item[1]))
            print(f"\n{name} against {first}: " + (", ".join(f"{op} {d:+d}" for op, d in diff) or "same opcode counts"))
    if args.map:
        print(f"\nloop maps: {MAP_LEGEND}")
        for name, (_, _, listing) in builds.items():
            print(f"\n--- {name} ---\n{loop_map(listing)}")
    if args.listing:
        for name, (_, _, listing) in builds.items():
            print(f"\n--- {name}: key-block loop ---\n{listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
