"""Host (CPU) time per call of fa4 and its peers, on a problem too small for the GPU to matter.

    python benchmarks/host_overhead.py

A 1 x 128 x 4 x 128 causal bf16 problem; 300 calls back to back, timed on the host clock (the GPU
work per call is a few microseconds, so the loop measures what Python and the launch path cost).
Rows: fa4 forward, the official flash-attn-4 forward, and forward + backward of fa4, the official
kernel and torch SDPA. The fa4 README's "Host overhead" numbers come from this script.
"""
from __future__ import annotations

import sys
import time


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("host_overhead needs a CUDA GPU")
        return 2
    import fa4
    from flash_attn.cute.interface import flash_attn_func as official

    b, s, h, d = 1, 128, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    def fwd_bwd(attn):
        def run():
            torch.autograd.grad(first(attn()), (q, k, v), g)
        return run

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        torch.autograd.grad(o, (q, k, v), g.transpose(1, 2))

    cases = [("fa4 forward", lambda: fa4.flash_attn_func(q, k, v, causal=True)),
             ("official forward", lambda: official(q, k, v, causal=True)),
             ("fa4 forward + backward", fwd_bwd(lambda: fa4.flash_attn_func(q, k, v, causal=True))),
             ("official forward + backward", fwd_bwd(lambda: official(q, k, v, causal=True))),
             ("torch SDPA forward + backward", sdpa)]
    print(f"device {torch.cuda.get_device_name()}, {b}x{s}x{h}x{d} bf16 causal, 300 calls each")
    for name, fn in cases:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name:30} host {1e6 * (t1 - t0) / n:8.1f} us/call   with the final sync {1e6 * (t2 - t0) / n:8.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
