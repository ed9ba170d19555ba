"""compute-sanitizer over the product kernels on small shapes (gpu tier).

racecheck (shared-memory hazards), memcheck (out-of-bounds and misaligned accesses) and synccheck
(barrier misuse) each run one small call per case in a fresh process (tests/sanitizer_case.py) and
must report nothing. The forward's causal d <= 128 path once reported 48 RAW hazards: all 32 lanes of
the producer warp stored the dynamic scheduler's tile id to shared memory, while only the elected
lane's mbarrier arrive (release semantics) ordered its own store before the consumers' acquire; a
single-lane store made racecheck clean (stage3_fwd_kernel/hopper, the producer's tile-id publish).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _case_names() -> list:
    spec = importlib.util.spec_from_file_location("sanitizer_case", os.path.join(HERE, "sanitizer_case.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # torch only; the kernels are imported when a case runs
    return sorted(mod.CASES)


pytestmark = [pytest.mark.gpu, pytest.mark.stage3]

RACE_CASES = _case_names()
MEM_CASES = ["fwd-d128-causal", "bwd-d128-causal", "bwd-d128-persistent", "bwd-d128-per-tile", "bwd-d128-window",
             "varlen-d128-causal",
             "varlen-d128-per-tile", "paged-d128-page8"]


def sanitizer() -> str:
    found = shutil.which("compute-sanitizer")
    if found is None:
        for base in ("/usr/local/cuda/bin", "/opt/nvidia/cuda/bin"):
            if os.path.exists(os.path.join(base, "compute-sanitizer")):
                return os.path.join(base, "compute-sanitizer")
        pytest.skip("compute-sanitizer is not on this machine")
    return found


def run_sanitized(tool: str, case: str) -> str:
    cmd = [sanitizer(), "--tool", tool, "--print-limit", "8", sys.executable,
           os.path.join(HERE, "sanitizer_case.py"), case]
    if tool == "racecheck":
        cmd[3:3] = ["--racecheck-report", "hazard"]
    # a sanitized case takes ~20 s on an H200; a hang (a protocol bug) fails after 300 s
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    text = proc.stdout + proc.stderr
    assert f"{case} ok" in text, f"{tool} {case}: the call did not finish\n{text[-4000:]}"
    return text


@pytest.mark.parametrize("case", RACE_CASES)
def test_racecheck_clean(case):
    text = run_sanitized("racecheck", case)
    assert "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" in text, text[-4000:]


@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
@pytest.mark.parametrize("case", MEM_CASES)
def test_memcheck_synccheck_clean(tool, case):
    text = run_sanitized(tool, case)
    assert "ERROR SUMMARY: 0 errors" in text, text[-4000:]
