"""Tools that look inside one kernel (SASS, clock traces, Nsight Compute exports, host overhead).

Run each as a module from the repository root, e.g. ``python -m benchmarks.inspect.hot_loop --dim 64``;
README.md here lists them.
"""
