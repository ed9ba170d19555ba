"""Stage 3, Blackwell: our sm_100a forward and the official FA4 forward (flash-attn-4), side by side
in SASS, loop by loop. Compile-only, no GPU: both kernels are compiled here for sm_100a.

    python -m stage3_fwd_kernel.blackwell_fwd --compare [--head_dim 128] [--dtype bf16]

prints, for d = 128 non-causal and causal, the steady-state loop of each role of the two kernels:
instructions per turn, and in the softmax loops the MUFU.EX2 / FFMA / FFMA2 / FADD / FADD2 counts.
Static counts (instructions in the code, not executed ones); they explain a difference, they do not
time it.

The official kernel (``pip install --no-deps flash-attn-4==4.0.0b36 quack-kernels==0.6.5``, or the
``dev`` extra) is built in a child process (``official_sass``): ``CUTE_DSL_ARCH=sm_100a`` and
``FLASH_ATTENTION_ARCH=sm_100`` before cutlass loads (the official interface picks its kernel class
from ``FLASH_ATTENTION_ARCH`` when set, else from ``torch.cuda.get_device_capability()``),
``FLASH_ATTENTION_NUM_SMS=148`` (B200; it picks tile schedulers and 2-CTA routes), the DSL's SM
count query answered with the same 148 (the persistent scheduler asks the driver while it traces),
``flash_attn.cute.flash_attn_func`` called under torch's FakeTensorMode (shapes only: traced and
compiled, never launched), and the cubin kept with ``CUTE_DSL_KEEP=cubin`` in a scratch folder.
quack imports triton and flash_attn's testing module einops at module level although this path uses
neither (and quack-kernels does not declare triton), so both are stand-in modules for the import.
The official route is its own: non-causal d = 128 takes its 2-CTA kernel (``UTCHMMA.2CTA``, a
persistent tile loop), causal the 1-CTA one; the table says which.

How a role's loop is found (``role_loops``; deterministic, the same rules for both kernels):

1. Loops are the natural loops of the SASS control-flow graph (``sass_report.natural_loops``):
   basic blocks split at labels and after branches; dominators from the kernel's entry plus every
   block nothing branches to (the warp-role jump table's targets, subroutines); a back edge u -> h
   where h dominates u; the body is h and every block that reaches u without passing h. Backward
   jumps that are not back edges (the out-of-line retry stub of an mbarrier wait jumping back into
   the code) make no loop.
2. A loop's *instructions* are its inline part: the consecutive blocks of the body around the header,
   as ptxas laid the loop out. The rest of the body (each wait's retry stub, which ptxas puts behind
   the kernel's EXIT and which runs only while a barrier is not yet ready) is reported apart as
   ``out_of_line``.
3. Roles, among the innermost loops with the property (no loop nested in it has it too, so a
   persistent kernel's tile loop never stands in for its key-block loop):
   softmax -- holds MUFU.EX2 and LDTM (S from tensor memory, exponentials);
   masked / unmasked -- the mask's selects: a masked loop holds at least tile_n / 2 FSEL (one per
   masked column; these kernels have >= 128), an unmasked one a handful (<= 4);
   MMA -- holds UTCHMMA (tcgen05.mma): the one with the most, the key-block step of the MMA warp;
   correction -- holds LDTM and STTM but no MUFU.EX2 and no UTCHMMA (O rescaled in tensor memory).
   When several loops qualify, the first in address order is taken and ``candidates`` says how many.

Opcode counts use the opcode's first word (``FFMA`` does not count ``FFMA2``; ``UTCHMMA`` counts
``UTCHMMA.2CTA``), except dotted names such as ``MUFU.EX2``, which match as a prefix.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import types

from stage3_fwd_kernel import sass_report

OFFICIAL_PINS = {"flash-attn-4": "4.0.0b36", "quack-kernels": "0.6.5"}
INSTALL_HINT = ("pip install --no-deps " + " ".join(f"{k}=={v}" for k, v in OFFICIAL_PINS.items())
                + ", or the dev extra")
B200_SMS = 148
ROLES = ("softmax_unmasked", "softmax_masked", "mma", "correction")
COUNTED = ("UTCHMMA", "MUFU.EX2", "FFMA", "FFMA2", "FADD", "FADD2", "FMUL", "FMUL2", "FSEL", "R2P", "LDTM", "STTM")


# ------------------------------------------------------------------------------------ the loops
def _has(loop, *names) -> bool:
    return all(sass_report.opcode_count(loop.ops, n) for n in names)


def _pick(loops: list, key=None):
    """(first loop in address order, or the first with the largest key; how many qualified)."""
    if not loops:
        return None, 0
    best = max(loops, key=key) if key else loops[0]
    return best, len(loops)


def role_loops(sass: str, tile_n: int = 128) -> dict:
    """{role: (SassLoop or None, number of qualifying loops)} for ROLES (rules: module docstring)."""
    loops = sass_report.natural_loops(sass)
    softmax = sass_report.innermost(loops, lambda lp: _has(lp, "MUFU.EX2", "LDTM"))
    masked = [lp for lp in softmax if sass_report.opcode_count(lp.ops, "FSEL") >= tile_n // 2]
    unmasked = [lp for lp in softmax if lp not in masked]
    mma = sass_report.innermost(loops, lambda lp: _has(lp, "UTCHMMA"))
    correction = sass_report.innermost(
        loops, lambda lp: _has(lp, "LDTM", "STTM") and not (_has(lp, "MUFU.EX2") or _has(lp, "UTCHMMA")))
    count = sass_report.opcode_count
    return {
        "softmax_unmasked": _pick(unmasked),
        "softmax_masked": _pick(masked),
        # max keeps the first of equals: the earliest loop with the most UTCHMMA
        "mma": _pick(mma, key=lambda lp: count(lp.ops, "UTCHMMA")),
        "correction": _pick(correction),
    }


def loop_stats(loop, candidates: int = 1) -> dict:
    """What the table shows of one loop: its instruction count, the out-of-line rest, COUNTED."""
    stats = {"instructions": len(loop.ops), "out_of_line": loop.out_of_line, "label": loop.label,
             "candidates": candidates}
    stats.update({name: sass_report.opcode_count(loop.ops, name) for name in COUNTED})
    return stats


def kernel_stats(sass: str, tile_n: int = 128) -> dict:
    """{role: loop_stats or None} of one kernel's SASS, plus "cta_group" (2 if it issues 2-CTA MMAs)."""
    out = {role: (loop_stats(lp, n) if lp else None) for role, (lp, n) in role_loops(sass, tile_n).items()}
    out["cta_group"] = 2 if ".2CTA" in sass else 1
    return out


# --------------------------------------------------------------------- the official kernel, built here
def official_missing() -> str | None:
    """None when the official package is installed, else why not (with the install command)."""
    for dist in OFFICIAL_PINS:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed ({INSTALL_HINT})"
    return None


def official_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


class StandIn(types.ModuleType):
    """A module whose every attribute is a usable base class or callable (the triton / einops that
    quack and flash_attn import at module level, unused on the forward's compile path)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (), {"__init__": lambda self, *a, **k: None})
        return StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return StandIn(self.__name__)


@contextlib.contextmanager
def stand_ins(*names):
    """StandIn modules for those of `names` that are not installed, for the duration of the block
    (the official package's import; benchmarks.inspect.official_sass uses it too)."""
    missing = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]
    for n in missing:
        sys.modules[n] = StandIn(n)
    try:
        yield
    finally:
        for n in missing:
            sys.modules.pop(n, None)


def _official_compile(head_dim: int, causal: bool, dtype: str, seqlen: int, heads: int) -> None:
    """In the child process (environment set by official_sass): trace and compile the official
    forward for this shape under FakeTensorMode. The DSL keeps the cubin in CUTE_DSL_DUMP_DIR."""
    import torch
    import torch._dynamo  # noqa: F401  (torch's own triton probe, before the stand-in exists)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from cutlass.utils import hardware_info

    sms = int(os.environ.get("FLASH_ATTENTION_NUM_SMS", B200_SMS))
    hardware_info.HardwareInfo.__init__ = lambda self, device_id=0: None  # no driver here
    hardware_info.HardwareInfo.get_device_multiprocessor_count = lambda self: sms
    with stand_ins("triton", "einops"):
        import flash_attn.cute.interface as official

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(1, seqlen, heads, head_dim, dtype=tdt, device="cuda") for _ in range(3))
        official.flash_attn_func(q, k, v, causal=causal)


@functools.lru_cache(maxsize=None)
def official_sass(head_dim: int = 128, causal: bool = False, dtype: str = "bf16", seqlen: int = 4096,
                  heads: int | None = None, timeout: int = 900) -> str:
    """SASS of the official forward for (batch 1, seqlen, heads = 2048 / d, head_dim), compiled for
    sm_100a in a child process. RuntimeError when the package is missing or the build fails."""
    missing = official_missing()
    if missing:
        raise RuntimeError(missing)
    heads = heads or max(1, 2048 // head_dim)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="official_sm100_") as scratch:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100",
                   FLASH_ATTENTION_NUM_SMS=str(B200_SMS), CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=scratch,
                   CUTE_DSL_DISABLE_FILE_CACHING="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "stage3_fwd_kernel.blackwell_compare", "--official-build",
               "--head_dim", str(head_dim), "--dtype", dtype, "--seqlen", str(seqlen), "--heads", str(heads)]
        res = subprocess.run(cmd + (["--causal"] if causal else []), env=env, cwd=scratch, capture_output=True,
                             text=True, timeout=timeout)
        cubins = sorted(glob.glob(os.path.join(scratch, "*FlashAttentionForwardSm100*.cubin")),
                        key=os.path.getmtime)
        if res.returncode != 0 or not cubins:
            raise RuntimeError(f"official sm_100a build failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
        with open(cubins[-1], "rb") as f:
            sass = sass_report.disassemble(f.read())
    if not sass:
        raise RuntimeError("no SASS: nvdisasm missing (pip install nvidia-cuda-nvdisasm)")
    return sass


# ----------------------------------------------------------------------------- side by side
def compare(d: int = 128, causal: bool = False, dtype: str = "bf16", *, ours_sass: str, tile_n: int = 128,
            official: bool = True) -> dict:
    """Per-role loop stats of our forward (its SASS, ``ours_sass``: blackwell_fwd.compare_with_official
    compiles it) and of the official forward for the same shape. "official" is None, with the reason
    in "official_note", when the package is missing or official=False."""
    out = {"shape": {"dtype": dtype, "d": d, "causal": causal}, "ours": kernel_stats(ours_sass, tile_n),
           "official": None, "official_note": "not requested"}
    if official:
        missing = official_missing()
        if missing:
            out["official_note"] = missing
        else:
            out["official"] = kernel_stats(official_sass(d, causal, dtype), tile_n)
            out["official_note"] = f"flash-attn-4 {official_version()}"
    return out


def ratio(result: dict, role: str, key: str = "instructions") -> float | None:
    """ours / official for one role's count in a compare() result (None when either is missing)."""
    ours, theirs = result["ours"].get(role), (result["official"] or {}).get(role)
    if not ours or not theirs or not theirs[key]:
        return None
    return ours[key] / theirs[key]


_ROWS = (  # (label, role, keys joined by " / ", show the ratio)
    ("softmax, unmasked loop: instructions", "softmax_unmasked", ("instructions",), True),
    ("  MUFU.EX2", "softmax_unmasked", ("MUFU.EX2",), False),
    ("  FFMA / FFMA2", "softmax_unmasked", ("FFMA", "FFMA2"), False),
    ("  FADD / FADD2", "softmax_unmasked", ("FADD", "FADD2"), False),
    ("softmax, masked loop: instructions", "softmax_masked", ("instructions",), True),
    ("  MUFU.EX2", "softmax_masked", ("MUFU.EX2",), False),
    ("  FFMA / FFMA2", "softmax_masked", ("FFMA", "FFMA2"), False),
    ("  FADD / FADD2", "softmax_masked", ("FADD", "FADD2"), False),
    ("MMA warp loop: instructions / UTCHMMA", "mma", ("instructions", "UTCHMMA"), True),
    ("correction loop: instructions", "correction", ("instructions",), True),
)


def _cell(stats, keys) -> str:
    return "-" if not stats else " / ".join(str(stats[k]) for k in keys)


def format_table(results: list) -> str:
    """Markdown: one row per role count, ours | official | ours / official per compare() result."""
    head, rule = ["| loop (static SASS counts)"], ["|---"]
    for r in results:
        s = r["shape"]
        name = f"{s['dtype']} d={s['d']} {'causal' if s['causal'] else 'non-causal'}"
        group = (r["official"] or {}).get("cta_group")
        official = "official" + (f" ({group}-CTA)" if group else "")
        head += [f"ours {name}", f"{official} {name}", "ratio"]
        rule += ["---:"] * 3
    lines = [" | ".join(head) + " |", "|".join(rule) + "|"]
    for label, role, keys, show_ratio in _ROWS:
        row = [f"| {label}"]
        for r in results:
            q = ratio(r, role) if show_ratio else None
            row += [_cell(r["ours"][role], keys), _cell((r["official"] or {}).get(role), keys),
                    f"{q:.2f}" if q else ""]
        lines.append(" | ".join(row) + " |")
    notes = sorted({r["official_note"] for r in results})
    no_loop = any(r["official"] and r["official"]["softmax_masked"] is None for r in results)
    lines.append("")
    lines.append("official: " + "; ".join(notes) + ". Instructions: each loop's inline part, the "
                 "out-of-line wait retries left out. '-': no such loop or no official build"
                 + (" (the official non-causal kernel masks its last key block outside its loop)." if no_loop
                    else "."))
    return "\n".join(lines)


def main(argv=None) -> int:
    """The child process of official_sass (``--official-build``); the table itself is printed by
    ``python -m stage3_fwd_kernel.blackwell_fwd --compare``."""
    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--official-build", action="store_true", required=True)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args(argv)
    _official_compile(a.head_dim, a.causal, a.dtype, a.seqlen, a.heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
