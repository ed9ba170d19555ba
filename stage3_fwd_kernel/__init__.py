"""Stage 3: the attention forward in CuTe-DSL, as a ladder of Hopper steps plus the production
kernels (``stage3_fwd_kernel.hopper``: the stable entry points ``fa4`` uses). See README.md.

Host-side modules shared by the steps and by stage 4:
``tile_scheduler`` (work tiles, static and persistent grids), ``compile_cache`` (one compile per
configuration, with a hook for a persistent store), ``sass_report`` (registers, spills, SASS),
``host_io`` (fake tensors, input checks, launch), ``runner`` (check + time, command line).

Importing the package sets CUTE_DSL_ARCH (default sm_90a) before any submodule imports cutlass.
"""
from stage2_emulated_exp import cute_arch

cute_arch.select()
