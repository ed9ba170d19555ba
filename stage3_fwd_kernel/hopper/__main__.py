"""python -m stage3_fwd_kernel.hopper [--head_dim 128 --causal ...]: see cli.run."""
from stage3_fwd_kernel.hopper.cli import main

main()
