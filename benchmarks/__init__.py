"""Benchmarks a user runs from a checkout (repository only: never installed, never imported by the packages).

Run each as a module from the repository root, e.g. ``python -m benchmarks.bench_fwd --out fwd.json``;
README.md here lists them, and ``inspect/`` holds the tools that look inside one kernel.
"""
