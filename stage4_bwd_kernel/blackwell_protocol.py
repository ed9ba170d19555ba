"""The barrier-protocol model checker (stage3_fwd_kernel/blackwell_protocol.py: what it models, what a
pass proves and what it cannot) applied to stage 4's Blackwell backward kernels: the mapping of each
kernel's warps to roles, its buffers to TMEM / SMEM regions and its barriers to names. COMPILED AND
CHECKED ONLY: these kernels have never run on hardware.

    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd --blocks 4        # the 1-CTA backward
    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd-dqtma --blocks 4  # dQ by TMA reduce-add
    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd2cta --blocks 4    # the 2-CTA backward
    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd-wide --blocks 4   # (192, 128): the serial schedule
    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd-wide256 --blocks 4   # 256: one CTA of the split
"""
from __future__ import annotations

import argparse
import functools

from stage3_fwd_kernel.blackwell_protocol import KernelSpec, Program, RegionPtr, Result, Role, bar_names, explore, \
    extract, run_and_report, smem, tmem
from stage4_bwd_kernel import blackwell_bwd, blackwell_bwd_2cta, blackwell_bwd_wide


def _bwd_tmem(t, d):
    span = lambda lo, w: tmem(lo, lo + w)  # noqa: E731
    return {"accS": span(t.s, t.s_cols), "accdP": span(t.dp, t.dp_cols), "accdV": span(t.dv, t.dv_cols),
            "accdK": span(t.dk, t.dk_cols), "accdQ": span(t.dq, getattr(t, "dq_cols", d)),
            "tP": span(t.p, t.p_cols), "tdSt": span(t.ds, t.s_cols // 2)}


def _one_cta_names(T) -> dict:
    """The buffer names shared by the 1-CTA and the wide kernel (load / MMA fragments, WG 0's views)."""
    names = {"tmem_ptr": RegionPtr(tmem(0, 512)), "sdS": smem("sdS"),
             "load:tKsK": smem("sK"), "load:tVsV": smem("sV"), "load:tQsQ": smem("sQ"), "load:tOsO": smem("sdO"),
             "mma:tK": smem("sK"), "mma:tQ": smem("sQ"), "mma:tV": smem("sV"), "mma:tdO": smem("sdO"),
             "mma:tdOt": smem("sdO"), "mma:tQt": smem("sQ"), "mma:tdS": smem("sdS"), "mma:tKt": smem("sK"),
             "elementwise:accS": T["accS"], "elementwise:accdP": T["accdP"], "dq_drain:accdQ": T["accdQ"],
             "_store_dkdv:acc": lambda env: tmem(env["col0"], env["col0"] + env["width"])}
    names.update({f"mma:{n}": r for n, r in T.items()})
    return names


def wide_spec(blocks: int = 4, head_dim: int = 192) -> KernelSpec:
    """stage4_bwd_kernel/blackwell_bwd_wide.py: the serial schedule; (192, 128) (two dQ^T windows over
    S^T and dP^T) or 256 (one window on columns of its own; one CTA of the head-dim split, the other runs
    the same program on its own SMEM / TMEM)."""
    wide = blackwell_bwd_wide
    cfg = wide.make_config("bf16", head_dim, None, False)
    k = wide.FlashAttentionBackwardSm100Wide(cfg)
    T = _bwd_tmem(cfg.tmem, head_dim)
    roles = [Role("elementwise", 0, 128), Role("mma", blackwell_bwd.MMA_WARP, 32),
             Role("load", blackwell_bwd.LOAD_WARP, 32), Role("idle6", 6, 32), Role("idle7", 7, 32),
             Role("dq_drain", 8, 128)]
    names = _one_cta_names(T)
    names.update({"mma:tdSt_b": smem("sdS"), "mma:tKw": smem("sK"), "mma:accQ": T["accdQ"],
                  "dq_drain:acc": T["accdQ"]})
    rings = [("qdo_full", k.stages), ("qdo_empty", k.stages)]
    bars = bar_names(k, [(n, 1) for n in blackwell_bwd.BARRIERS] + rings)
    return KernelSpec("bwd-wide256" if head_dim == 256 else "bwd-wide", k, roles, {"n_iter": blocks, "n_m": blocks}, names, {}, cfg.num_threads,
                      bar_names=bars)


def backward_spec(blocks: int = 4, head_dim: int = 128, dq_tma: bool = False) -> KernelSpec:
    """stage4_bwd_kernel/blackwell_bwd.py (+ blackwell_elementwise.py, blackwell_dq.py): the 1-CTA backward; `blocks`
    Q tiles walked by the CTA's K/V tile.
    dq_tma: the build whose WG 2 stages dQ in sdQ for a TMA reduce-add; at d = 128 its dO ring has one
    stage and barriers of its own (do_full / do_empty), which this checks. sdQ itself is not named:
    its reuse is ordered by one thread's bulk async-group waits, which the model does not have."""
    bwd = blackwell_bwd
    cfg = bwd.make_config("bf16", head_dim, head_dim, False, dq_tma=dq_tma)
    k = bwd.FlashAttentionBackwardSm100(cfg)
    T = _bwd_tmem(cfg.tmem, head_dim)
    roles = [Role("elementwise", 0, 128), Role("mma", bwd.MMA_WARP, 32), Role("load", bwd.LOAD_WARP, 32),
             Role("idle6", 6, 32), Role("idle7", 7, 32), Role("dq_drain", 8, 128)]
    names = _one_cta_names(T)
    rings = [("qdo_full", k.stages), ("qdo_empty", k.stages)]
    if k.split_do:
        rings += [("do_full", k.do_stages), ("do_empty", k.do_stages)]
    bars = bar_names(k, [(n, 1) for n in bwd.BARRIERS] + rings)
    return KernelSpec("bwd-dqtma" if dq_tma else "bwd", k, roles, {"n_iter": blocks, "n_m": blocks}, names, {},
                      cfg.num_threads, bar_names=bars)


def backward_2cta_spec(blocks: int = 4, head_dim: int = 128) -> KernelSpec:
    """stage4_bwd_kernel/blackwell_bwd_2cta.py: a cluster of 2 CTAs, pair MMAs issued by CTA 0, the
    relay warp in CTA 1, the dS exchange by bulk copy; `blocks` Q tiles."""
    two = blackwell_bwd_2cta
    cfg = two.make_config("bf16", head_dim, head_dim, False)
    k = two.FlashAttentionBackwardSm100TwoCta(cfg)
    T = _bwd_tmem(cfg.tmem, head_dim)
    roles = []
    for c in range(2):
        roles += [Role(f"elementwise.{c}", 0, 128, c), Role(f"{'mma' if c == 0 else 'relay'}.{c}", two.MMA_WARP, 32, c),
                  Role(f"load.{c}", two.LOAD_WARP, 32, c), Role(f"idle6.{c}", 6, 32, c),
                  Role(f"idle7.{c}", 7, 32, c), Role(f"dq_drain.{c}", 8, 128, c)]
    names = {"tmem_ptr": RegionPtr(tmem(0, 512)),
             "load:tKsK": smem("sK"), "load:tVsV": smem("sV"), "load:tKtsKt": smem("sKt"), "load:tQsQ": smem("sQ"),
             "load:tOsO": smem("sdO"), "load:tOtsOt": smem("sdOt"), "load:tQtsQt": smem("sQt"),
             "mma:tK": smem("sK"), "mma:tQ": smem("sQ"), "mma:tV": smem("sV"), "mma:tdO": smem("sdO"),
             "mma:tdOt": smem("sdOt"), "mma:tQt": smem("sQt"), "mma:tdS": smem("sdS", sub=False),
             "mma:tKt": smem("sKt"),
             "elementwise_pair:accS": T["accS"], "elementwise_pair:accdP": T["accdP"],
             "elementwise_pair:sdS_col": lambda env: smem("sdS", env["rank"], sub=False),
             "elementwise_pair:sX_col": smem("sXchg", sub=False),
             "elementwise_pair:sdS_ptr": lambda env: smem("sdS", env["rank"], sub=False),
             "elementwise_pair:sXchg_ptr": smem("sXchg", sub=False),
             "dq_drain_pair:accQ": T["accdQ"],
             "_store_dkdv:acc": lambda env: tmem(env["col0"], env["col0"] + env["width"])}
    names.update({f"mma:{n}": r for n, r in T.items()})
    bars = bar_names(k, [(n, 1) for n in two.BARRIERS] + [(n, k.stages) for n in two.STAGED])
    return KernelSpec("bwd2cta", k, roles, {"n_iter": blocks, "n_m": blocks}, names, {}, cfg.num_threads,
                      ctas=2, pair_mma=True, bar_names=bars)


SPECS = {"bwd": backward_spec, "bwd-dqtma": functools.partial(backward_spec, dq_tma=True),
         "bwd2cta": backward_2cta_spec, "bwd-wide": wide_spec, "bwd-wide256": functools.partial(wide_spec, head_dim=256)}


def build(kernel: str, blocks: int = 4) -> Program:
    """The extracted Program of `kernel` (a key of SPECS) for `blocks` Q tiles."""
    if kernel not in SPECS:
        raise ValueError(f"kernel: expected one of {sorted(SPECS)}, got {kernel!r}")
    return extract(SPECS[kernel](blocks))


def check(kernel: str, blocks: int = 4, max_states: int = 2_000_000) -> Result:
    return explore(build(kernel, blocks), max_states, blocks, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(SPECS), default="bwd")
    ap.add_argument("--blocks", type=int, default=4, help="Q tiles walked by the CTA's K/V tile")
    ap.add_argument("--max-states", type=int, default=2_000_000)
    ap.add_argument("--ops", action="store_true", help="print the extracted operations per role")
    a = ap.parse_args(argv)
    return run_and_report(build(a.kernel, a.blocks), a.kernel, a.blocks, 0, a.max_states, a.ops)


if __name__ == "__main__":
    raise SystemExit(main())
