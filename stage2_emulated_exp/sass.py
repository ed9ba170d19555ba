"""Disassembling cubins (nvdisasm) for the structural checks of every kernel stage.

Kept free of cutlass imports so any stage can use it before choosing its CuTe-DSL arch.
nvdisasm comes from PATH or from the `nvidia-cuda-nvdisasm` wheel (the `dev` extra).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for cand in sorted(Path(base).glob("*/bin/nvdisasm")):
                return str(cand)
    except ImportError:
        pass
    return None


def disassemble(cubin: bytes, *, required: bool = True) -> str:
    """SASS text of a cubin. Without nvdisasm: RuntimeError if `required`, else ""."""
    tool = find_nvdisasm()
    if tool is None:
        if required:
            raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True,
                              timeout=120).stdout
    finally:
        os.unlink(path)
