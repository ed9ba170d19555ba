"""Stage 4: the attention backward pass in CuTe-DSL (Hopper), with a deterministic mode.

Public entry points live in ``stage4_bwd_kernel.hopper`` (the only module ``fa4`` imports):
``attention_backward`` and ``attention_varlen_backward``. The ladder: ``hopper_step1`` (a first
correct kernel) and ``hopper_step2_warpspec`` (TMA pipeline + warp specialization), with
``preprocess`` / ``postprocess`` around them; ``schedule`` / ``model`` replay the kernels' tile walk
on the CPU and ``roofline`` prices a tile. See README.md.

Importing this package sets CUTE_DSL_ARCH (default sm_90a) but does not import cutlass, so the
CPU-only modules stay cheap and the kernel modules import cutlass in the ordinary order.
"""
from stage2_emulated_exp import cute_arch

cute_arch.select()
