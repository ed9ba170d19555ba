"""Command line: python -m fa4 {demo,info}."""
from __future__ import annotations

import argparse
import platform
import sys


def _info() -> int:
    import numpy

    print(f"python {platform.python_version()}  numpy {numpy.__version__}")
    try:
        import torch

        cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}  CUDA device: {cuda}")
    except ImportError:
        print("torch: not installed")
    try:
        from importlib.metadata import version

        print(f"nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}")
    except Exception:
        print("nvidia-cutlass-dsl: not installed")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4", description="FlashAttention-4 from scratch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run every stage available here and print a report")
    sub.add_parser("info", help="versions and devices")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo()
    return _info()


if __name__ == "__main__":
    sys.exit(main())
