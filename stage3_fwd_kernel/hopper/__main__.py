"""python -m stage3_fwd_kernel.hopper [--d 128 --causal ...]: see cli.run."""
from stage3_fwd_kernel.hopper.cli import main

main()
