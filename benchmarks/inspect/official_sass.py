"""The official FA4 forward's SASS for one shape, compiled here for sm_90a: no GPU needed.

    pip install --no-deps flash-attn-4==4.0.0b36 quack-kernels==0.6.5     # the official package, without its GPU-only deps
    python -m benchmarks.inspect.official_sass --dim 192 --dim_v 128 --causal --out /tmp/official_192c.sass
    python -m benchmarks.inspect.hot_loop --dim 192 --dim_v 128 --causal --sass /tmp/official_192c.sass --map

It calls `flash_attn.cute.flash_attn_func` under torch's FakeTensorMode: shapes and dtypes only, so
the kernel is traced and compiled for sm_90a but never launched, in a scratch folder where the DSL
keeps the cubin. quack imports triton and flash_attn's testing module imports einops at module
level; neither is used on this path, so both are stand-ins for the duration of the import (torch's
own triton probe runs before, and sees none).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import sys
import tempfile


def set_target() -> None:
    """Before cutlass is imported: compile for sm_90a, and tell the official route which GPU it picks for."""
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["FLASH_ATTENTION_ARCH"] = "sm_90"
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")  # H100 SXM; it picks tiles / schedulers
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # a cache hit keeps no cubin


def compile_official(dim: int, dim_v: int, causal: bool, dtype: str, seqlen: int, heads: int, dump_dir: str) -> str:
    """The cubin path the DSL keeps for this shape's official forward (set_target first; the DSL keeps
    its files in the working directory it was imported from, so main moves there first)."""
    import torch
    import torch._dynamo  # noqa: F401  (torch probes for triton here: before the stand-in exists)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stage3_fwd_kernel.blackwell_compare import stand_ins  # after set_target: it imports cutlass

    with stand_ins("triton", "einops"):
        import flash_attn.cute.interface as official
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, seqlen, heads, dim, dtype=tdt, device="cuda")
        k = torch.empty(1, seqlen, heads, dim, dtype=tdt, device="cuda")
        v = torch.empty(1, seqlen, heads, dim_v, dtype=tdt, device="cuda")
        official.flash_attn_func(q, k, v, causal=causal)
    cubins = sorted(glob.glob(os.path.join(dump_dir, "*flash_fwd_sm90*.cubin")), key=os.path.getmtime)
    if not cubins:
        raise SystemExit("official_sass: the compile kept no forward cubin")
    return cubins[-1]


def main(argv=None) -> int:
    from .hot_loop import add_shape_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap)
    ap.add_argument("--seqlen", type=int, default=4096, help="the call's length (the official route may depend on it)")
    ap.add_argument("--heads", type=int, default=None, help="default: 2048 / dim, as benchmarks.ab_fwd")
    ap.add_argument("--out", required=True, help="where the SASS listing goes")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("flash_attn") is None:
        raise SystemExit("official_sass: flash_attn is not installed; "
                         "pip install --no-deps flash-attn-4==4.0.0b36 quack-kernels==0.6.5")
    set_target()
    scratch = tempfile.mkdtemp(prefix="official_sass_")
    out = os.path.abspath(args.out)
    cwd = os.getcwd()
    print("compiling the official forward for sm_90a (fake tensors) ...", file=sys.stderr, flush=True)
    try:  # the scratch folder goes away however the compile ends
        os.chdir(scratch)  # before cutlass is imported: the DSL keeps its cubins where that happened
        from stage3_fwd_kernel.sass_report import disassemble

        cubin = compile_official(args.dim, args.dim_v or args.dim, args.causal, args.dtype, args.seqlen,
                                 args.heads or max(1, 2048 // args.dim), scratch)
        with open(cubin, "rb") as f:
            sass = disassemble(f.read())
    finally:
        os.chdir(cwd)
        shutil.rmtree(scratch, ignore_errors=True)
    if not sass:
        raise SystemExit("official_sass: no SASS (nvdisasm missing?)")
    with open(out, "w") as f:
        f.write(sass)
    print(f"{out}: {sass.count(chr(10))} lines of SASS ({os.path.basename(cubin)[:80]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
