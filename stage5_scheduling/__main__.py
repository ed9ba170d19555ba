"""``python -m stage5_scheduling``: simulated comparison tables for the paper's scheduling claims.

Every number printed here comes from ``simulator.py`` (greedy list scheduling + the coarse L2
model), not from a GPU. Times are in K/V-block steps of one CTA.

    python -m stage5_scheduling                          # tables
    python -m stage5_scheduling --plot-dir DIR           # + one Gantt PNG per comparison
    python -m stage5_scheduling --plot all.png           # + every Gantt in one PNG
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from .simulator import H100_SMS, Problem, compare, gantt, run_backward, run_forward


def varlen_prefills() -> Problem:
    """The brief's skewed batch: 45 short sequences (64..2048 tokens, seed 0) with an 8k
    prefill in the middle and 12k, 16k prefills last (the unfavourable place)."""
    short = [int(x) for x in np.random.default_rng(0).integers(64, 2049, size=45)]
    return Problem.varlen(short[:20] + [8192] + short[20:] + [12288, 16384], heads=16)


def varlen_long_context() -> Problem:
    """The paper's example: square prefills (512..4096, seed 1) followed by four long-context
    requests (256 new tokens against 32k..64k of context, as in chunked prefill)."""
    pre = [int(x) for x in np.random.default_rng(1).integers(512, 4097, size=24)]
    return Problem.varlen(pre + [256] * 4, heads=16, seqlens_k=pre + [32768, 40960, 49152, 65536])


def scenarios(num_sms: int = H100_SMS):
    """(key, title, {label: Schedule}, color_by, labels to plot) for each comparison."""
    fwd = ("naive", "lpt_no_sections", "lpt_causal")
    mha = Problem.fixed(2, 16, 8192)
    mqa = Problem.fixed(4, 8, 8192, heads_kv=1)
    gqa = Problem.fixed(2, 32, 16384, heads_kv=4)
    out = [
        ("fwd_causal_mha",
         f"causal MHA fwd, d=128, batch 2 x 16 heads x 8k, 128x128 tiles, {num_sms} SMs: "
         "load balance only (no L2 model)",
         {o: run_forward(mha, o, num_sms) for o in fwd}, "m_block", ("naive", "lpt_causal")),
        ("fwd_causal_mha_l2",
         f"same, with the L2 model (H100: 50 MiB L2, 3.35 TB/s HBM3); "
         f"sections of {mha.section()} heads",
         {o: run_forward(mha, o, num_sms, mha.l2(num_sms)) for o in fwd}, "head",
         ("lpt_no_sections", "lpt_causal")),
        ("fwd_causal_mqa8",
         "causal MQA-8 fwd (8 query heads share 1 KV head), d=128, batch 4 x 8k, L2 model",
         {o: run_forward(mqa, o, num_sms, mqa.l2(num_sms)) for o in fwd}, "m_block", ()),
        ("fwd_causal_gqa",
         f"causal GQA fwd (32 query heads, 4 KV heads), d=128, batch 2 x 16k, L2 model; "
         f"sections of {gqa.section()} query heads",
         {o: run_forward(gqa, o, num_sms, gqa.l2(num_sms)) for o in fwd}, "head", ()),
    ]
    vl = ("naive", "lpt_unsorted", "lpt_varlen")
    p = varlen_prefills()
    out.append(("fwd_varlen_prefills",
                f"causal varlen fwd, 16 heads: {p.num_batch} sequences, 8k/12k/16k prefills "
                f"placed mid and last among short ones ({sum(p.seqlens_q)} tokens), L2 model",
                {o: run_forward(p, o, num_sms, p.l2(num_sms)) for o in vl}, "batch", ()))
    p = varlen_long_context()
    out.append(("fwd_varlen_long_context",
                "causal varlen fwd, 16 heads: 24 square prefills (512-4096) then 4 requests of "
                "256 queries over 32k-64k keys, L2 model",
                {o: run_forward(p, o, num_sms, p.l2(num_sms)) for o in vl}, "batch",
                ("naive", "lpt_varlen")))
    bwd = Problem.fixed(2, 16, 8192)
    out.append(("bwd_deterministic",
                f"causal bwd, d=128, batch 2 x 16 heads x 8k, 128x128 tiles, {num_sms} SMs "
                "(no L2 model; 1 step = one (K/V block, Q block) pair)",
                {"naive_bwd (deterministic)": run_backward(bwd, "naive_bwd", num_sms),
                 "lpt_bwd (deterministic)": run_backward(bwd, "lpt_bwd", num_sms),
                 "spt_bwd (deterministic)": run_backward(bwd, "spt_bwd", num_sms),
                 "lpt_bwd (atomic adds, not deterministic)":
                     run_backward(bwd, "lpt_bwd", num_sms, deterministic=False)},
                "n_block", ("naive_bwd (deterministic)", "spt_bwd (deterministic)")))
    return out


def _figure(panels, color_by):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 2.6 * len(panels)), squeeze=False)
    xmax = max(s.makespan for _, s in panels) * 1.02
    for ax, (label, sched) in zip(axes[:, 0], panels):
        gantt(sched, ax=ax, color_by=color_by, title=label)
        ax.set_xlim(0, xmax)  # same time axis, so the panels compare by eye
    fig.tight_layout()
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m stage5_scheduling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=H100_SMS, help="number of SMs (H100 SXM5: 132)")
    ap.add_argument("--plot", metavar="PNG", help="save every Gantt chart into one PNG")
    ap.add_argument("--plot-dir", metavar="DIR", help="save one Gantt PNG per comparison")
    ap.add_argument("--dpi", type=int, default=72)
    args = ap.parse_args(argv)

    print("All numbers are SIMULATED (stage5_scheduling/simulator.py): times in K/V-block steps,")
    print("'ideal' = max(total work / SMs, longest tile). No GPU was involved.\n")
    cases = scenarios(args.sms)
    for _, title, scheds, _, _ in cases:
        compare(scheds, title)
        print()

    plotted = [(key, [(lab, scheds[lab]) for lab in labels], color_by)
               for key, _, scheds, color_by, labels in cases if labels]
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
        for key, panels, color_by in plotted:
            fig = _figure(panels, color_by)
            path = os.path.join(args.plot_dir, f"{key}.png")
            fig.savefig(path, dpi=args.dpi)
            print("wrote", path)
    if args.plot:
        import matplotlib.pyplot as plt

        figs = [_figure(panels, color_by) for _, panels, color_by in plotted]
        # one tall image: render each figure and stack the pixels
        imgs = []
        for f in figs:
            f.canvas.draw()
            imgs.append(np.asarray(f.canvas.buffer_rgba()))
            plt.close(f)
        width = max(i.shape[1] for i in imgs)
        pad = [np.pad(i, ((0, 0), (0, width - i.shape[1]), (0, 0)), constant_values=255) for i in imgs]
        plt.imsave(args.plot, np.concatenate(pad, axis=0))
        print("wrote", args.plot)


if __name__ == "__main__":
    main()
