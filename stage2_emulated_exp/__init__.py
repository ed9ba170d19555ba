"""Stage 2: exp2 on the FMA units (Cody-Waite range reduction + minimax polynomial).

CPU half: minimax (Remez in mpmath), host_model (bit-exact float32 model of the PTX sequence),
exact_model (the same with Fractions), accuracy (the paper's table).
GPU half: gpu_kernel (CuTe-DSL kernels), gpu_bench (throughput), device_main (check + time).
See README.md in this folder.

Importing the package sets CUTE_DSL_ARCH (`cute_arch.select`, default sm_90a) before any submodule
imports cutlass.
"""
from . import cute_arch
from .host_model import exp2_emulated
from .minimax import minimax_coefficients

cute_arch.select()

__all__ = ["exp2_emulated", "minimax_coefficients"]
