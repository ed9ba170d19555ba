"""What fa4's zeroed copies for seqused_* cost a training step (fa4/_layouts.py, `ZeroedTail`).

    python -m benchmarks.bench_seqused_copy [--out seqused_copy_h200.json] [--rounds 7]

Padded (B, S, H, D) q / k / v with seqused_q and seqused_k (random used lengths of S/2..S), causal,
GQA 32 / 8, d = 128, bf16: forward + backward through flash_attn_varlen_func, with the copies and with
them replaced by the identity (which is what the kernels got before; NaN padding is then unsafe), in
paired rounds of 20 steps each, alternating which goes first. Prints and writes the medians and each
round's ms.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import fa4
from fa4 import _layouts
from fa4.bench import time_ms

SHAPES = ((32, 1024), (8, 4096), (2, 16384))


class _Identity:
    apply = staticmethod(lambda t, *rest: t)


def _step(q, k, v, dout, used):
    out = fa4.flash_attn_varlen_func(q, k, v, seqused_q=used, seqused_k=used, causal=True)
    torch.autograd.grad(out, (q, k, v), dout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="seqused_copy.json")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    builds = {"copy": _layouts.ZeroedTail, "no_copy": _Identity}
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    try:
        for bsz, s in SHAPES:
            make = lambda h: torch.randn(bsz, s, h, 128, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                         generator=g).requires_grad_()
            q, k, v = make(32), make(8), make(8)
            dout = torch.randn_like(q)
            used = torch.randint(s // 2, s + 1, (bsz,), device="cuda", generator=g, dtype=torch.int32)
            times = {name: [] for name in builds}
            for r in range(-1, args.rounds):  # round -1 warms up (compiles)
                for name in (("copy", "no_copy") if r % 2 == 0 else ("no_copy", "copy")):
                    _layouts.ZeroedTail = builds[name]
                    ms = time_ms(lambda: _step(q, k, v, dout, used), 20)
                    if r >= 0:
                        times[name].append(ms)
            ratio = statistics.median(c / n for c, n in zip(times["copy"], times["no_copy"]))
            rows.append({"batch": bsz, "seqlen": s, "heads": [32, 8], "head_dim": 128, "causal": True,
                         "ms_copy": statistics.median(times["copy"]), "ms_no_copy": statistics.median(times["no_copy"]),
                         "copy_over_no_copy": ratio, "rounds": times})
            print(f"{bsz} x {s}: copy {rows[-1]['ms_copy']:.3f} ms, no copy {rows[-1]['ms_no_copy']:.3f} ms, "
                  f"ratio {ratio:.4f}", flush=True)
    finally:
        _layouts.ZeroedTail = builds["copy"]
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
