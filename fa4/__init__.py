"""fa4: the production attention package of this project.

The kernels it will export are being built in stages 3-5; today the package holds the CLI
(`python -m fa4 demo | info`), which runs what exists: the CPU stages and their checks.
"""
__version__ = "0.1.0"
