"""Disassembling cubins (nvdisasm) for the structural checks of every kernel stage.

Kept free of cutlass imports so any stage can use it before choosing its CuTe-DSL arch.
nvdisasm comes from PATH or from the `nvidia-cuda-nvdisasm` wheel (the `dev` extra).
"""
from __future__ import annotations

import os
import re
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


def sass_opcodes(sass: str) -> list:
    """Opcodes of an nvdisasm listing in order, predicates stripped ('@!P0 BRA' -> 'BRA')."""
    ops = []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops


def loop_listings(sass: str) -> list:
    """The text of every backward-branch loop (label .L_x_N ... BRA .L_x_N) in a SASS listing, in
    the order their branches appear (outer loops contain inner ones). Any branch form closes one:
    `@P0 BRA`, and sm_100's uniform `BRA.U UP0, ...`."""
    lines = sass.splitlines()
    labels, bodies = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        b = re.search(r"\bBRA(?:\.[A-Z0-9_]+)*\s[^`]*`\((\.L_x_\d+)\)", line)
        if b and b.group(1) in labels:
            bodies.append("\n".join(lines[labels[b.group(1)]:i + 1]))
    return bodies
