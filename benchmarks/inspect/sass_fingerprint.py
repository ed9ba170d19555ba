"""Is the production kernels' SASS unchanged? (no GPU)

Compiles the production Hopper forward and backward (`compile_launchable`: what a launch builds) for a
grid of configurations -- bf16 / fp16, every head dim, causal or not, dense, varlen, seqused_k, long
keys (persistent CTAs, split tail), deterministic, one LPT order per head dim -- and writes each
kernel's SASS normalised (kernel symbol names and instruction addresses removed) with a JSON of
sha256 hashes. A restructuring that must not change the kernels runs it on both commits:

    python -m benchmarks.inspect.sass_fingerprint /tmp/fp_before          # on the old commit
    python -m benchmarks.inspect.sass_fingerprint /tmp/fp_after           # on the new one
    python -m benchmarks.inspect.sass_fingerprint /tmp/fp_after --diff /tmp/fp_before

The diff also says, for each kernel that differs, whether its loops (every backward branch's body,
labels blanked) are the same: a change to the prologue or the epilogue only leaves them alone.

About 10 minutes on 2 cores for the whole grid (`--only fwd,lpt` or `--only bwd` for half).
`--only bw_fwd` compiles the Blackwell forward's 32 configurations for sm_100a instead, `--only bw_bwd`
the Blackwell backward's 1-CTA, wide and 2-CTA builds (never run: no Blackwell GPU is reachable, so
their SASS is the only evidence a change left them alone; some of these builds' SASS differs from run
to run on the same source -- uniform-register numbering -- so compare their loops, or run twice).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

FWD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
BWD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


def normalise(sass: str) -> str:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?);?\s*(/\*.*\*/)?\s*$", line)
        if m:
            out.append(re.sub(r"kernel_cutlass_\w+", "KERNEL", m.group(1)))
        elif line.strip().startswith(".L_x_"):
            out.append(line.strip())
    return "\n".join(out) + "\n"


def loop_bodies(text: str) -> list:
    """Sorted hashes of the loops of a normalised listing (stage 2's `loop_listings`), labels blanked:
    their numbers move when code before them changes."""
    from stage2_emulated_exp.sass import loop_listings

    return sorted(hashlib.sha256(re.sub(r"\.L_x_\d+", "L", body).encode()).hexdigest()[:16]
                  for body in loop_listings(text))


def loops_note(dir_a: str, dir_b: str, key: str) -> str:
    """'every loop the same (n)' / 'loops differ' / 'no loops' for a kernel in both directories' listings."""
    name = key.replace("#", "__") + ".sass"
    paths = [os.path.join(d, name) for d in (dir_a, dir_b)]
    if not all(os.path.exists(q) for q in paths):
        return "listing missing"
    a, b = (loop_bodies(open(q).read()) for q in paths)
    if not a and not b:
        return "no loops"
    return f"every loop the same ({len(a)})" if a == b else "loops differ"


def fwd_configs(quick):
    dts = ["bf16"] if quick else ["bf16", "fp16"]
    for dt in dts:
        for d, dv in FWD_DIMS:
            for causal in (False, True):
                yield ("fwd", dt, d, dv, causal, dict())
                if dt == "bf16":
                    yield ("fwd", dt, d, dv, causal, dict(seqlen_k=16384))
                    yield ("fwd", dt, d, dv, causal, dict(varlen=True))
                    yield ("fwd", dt, d, dv, causal, dict(varlen=True, seqused_k=True))


def bwd_configs(quick):
    dts = ["bf16"] if quick else ["bf16", "fp16"]
    for dt in dts:
        for d, dv in BWD_DIMS:
            for causal in (False, True):
                yield ("bwd", dt, d, dv, causal, dict())
                if dt == "bf16":
                    yield ("bwd", dt, d, dv, causal, dict(deterministic=True))
                    yield ("bwd", dt, d, dv, causal, dict(varlen=True))
                    yield ("bwd", dt, d, dv, causal, dict(varlen=True, has_seqused_k=True))


def lpt_configs():
    from fa4._dispatch import lpt_forward_schedulers
    for d, dv in FWD_DIMS:
        for first, _last, sched in lpt_forward_schedulers("sm_90", d, dv, 16, 16, 16384)[:1]:
            yield ("fwd", "bf16", d, dv, True, dict(scheduler=sched, seqlen_k=first))


def bw_fwd_configs():
    from stage3_fwd_kernel.blackwell_fwd import MATRIX
    for dt, d, dv, causal, varlen in MATRIX:
        yield ("bw_fwd", dt, d, dv, causal, dict(varlen=True) if varlen else dict())


def bw_bwd_configs():
    for d in (64, 128):
        for causal in (False, True):
            for det in (False, True):
                yield ("bw_bwd", "bf16", d, d, causal, dict(deterministic=True) if det else dict())
    yield ("bw_bwd", "bf16", 128, 128, True, dict(varlen=True))
    yield ("bw_bwd", "bf16", 128, 128, True, dict(dq_tma=True))
    for d, dv in ((192, 128), (256, 256)):
        for det in (False, True):
            yield ("bw_bwd_wide", "bf16", d, dv, True, dict(deterministic=True) if det else dict())
    for causal in (False, True):
        yield ("bw_bwd_2cta", "bf16", 128, 128, causal, dict())


def build(kind, dt, d, dv, causal, kw):
    if kind.startswith("bw_bwd"):
        from stage4_bwd_kernel import blackwell_bwd, blackwell_bwd_2cta, blackwell_bwd_wide
        module = {"bw_bwd": blackwell_bwd, "bw_bwd_wide": blackwell_bwd_wide, "bw_bwd_2cta": blackwell_bwd_2cta}[kind]
        return [module.compile_only(dt, d, dv, causal, **kw)]
    if kind == "bw_fwd":
        from stage3_fwd_kernel import blackwell_fwd
        return [blackwell_fwd.compile_config(blackwell_fwd.make_config(dt, d, dv, causal), **kw)]
    if kind == "fwd":
        from stage3_fwd_kernel.hopper import compile_launchable
    else:
        from stage4_bwd_kernel.hopper import compile_launchable
    return compile_launchable(dtype=dt, head_dim=d, head_dim_v=dv, causal=causal, **kw)


def label(kind, dt, d, dv, causal, kw):
    extra = ",".join(f"{k}={getattr(v, 'heads_per_section', v)}" for k, v in sorted(kw.items()))
    return f"{kind}_{dt}_d{d}x{dv}_{'causal' if causal else 'full'}" + (f"_{extra}" if extra else "")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="fwd,bwd,lpt")
    p.add_argument("--diff", metavar="OTHER_DIR")
    a = p.parse_args()
    if a.diff:
        x = json.load(open(os.path.join(a.outdir, "hashes.json")))
        y = json.load(open(os.path.join(a.diff, "hashes.json")))
        same = diff = 0
        for k in sorted(set(x) | set(y)):
            if x.get(k) == y.get(k):
                same += 1
            else:
                diff += 1
                print("DIFFERS:", k, x.get(k, "missing")[:12], y.get(k, "missing")[:12], "--",
                      loops_note(a.outdir, a.diff, k))
        print(f"{same} identical, {diff} different")
        return 1 if diff else 0
    os.makedirs(a.outdir, exist_ok=True)
    hashes = {}
    jobs = []
    only = a.only.split(",")
    if "fwd" in only:
        jobs += list(fwd_configs(a.quick))
    if "bwd" in only:
        jobs += list(bwd_configs(a.quick))
    if "lpt" in only:
        jobs += list(lpt_configs())
    if "bw_fwd" in only:
        jobs += list(bw_fwd_configs())
    if "bw_bwd" in only:
        jobs += list(bw_bwd_configs())
    for i, job in enumerate(jobs):
        t0 = time.time()
        name = label(*job)
        try:
            comps = build(*job)
        except Exception as exc:
            print(f"[{i + 1}/{len(jobs)}] {name}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
            hashes[name] = f"error: {type(exc).__name__}"
            continue
        for j, comp in enumerate(comps):
            text = normalise(comp.sass)
            key = f"{name}#{j}"
            hashes[key] = hashlib.sha256(text.encode()).hexdigest()
            with open(os.path.join(a.outdir, key.replace("#", "__") + ".sass"), "w") as f:
                f.write(text)
        print(f"[{i + 1}/{len(jobs)}] {name}: {len(comps)} kernels {time.time() - t0:.1f}s", flush=True)
        json.dump(hashes, open(os.path.join(a.outdir, "hashes.json"), "w"), indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
