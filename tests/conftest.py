"""Test tiers and stage markers.

Every test carries exactly one tier marker (cpu, compile, gpu) and at least one lesson
marker (stage0..stage5, fa4, tutorials), so `pytest -m stage1` runs one lesson and a failing
run names the lesson that broke. A test without them is a collection error, not a silent gap.
"""
import functools
import os

import pytest

TIERS = ("cpu", "compile", "gpu")
LESSONS = ("stage0", "stage1", "stage2", "stage3", "stage4", "stage5", "fa4", "tutorials")


@functools.lru_cache(maxsize=1)
def cuda_device_reason() -> str | None:
    """None when a CUDA device is usable, else why not (shown as the skip reason)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (the gpu tier needs an H100/H200)"
    return None


def pytest_collection_modifyitems(config, items):
    errors = []
    for item in items:
        names = {m.name for m in item.iter_markers()}
        tiers = [t for t in TIERS if t in names]
        if len(tiers) != 1:
            errors.append(f"{item.nodeid}: needs exactly one tier marker of {TIERS}, has {tiers}")
        if not any(lesson in names for lesson in LESSONS):
            errors.append(f"{item.nodeid}: needs a lesson marker of {LESSONS}")
        if "gpu" in names:
            reason = cuda_device_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    if errors:
        raise pytest.UsageError("tests with missing markers:\n  " + "\n  ".join(errors))


GPU_MEMORY_HOG_BYTES = 44 * 2**30   # the 2^31-element backward's peak (q, k, v, out, grads, the fp32 dQ sum)


@pytest.fixture
def gpu_memory_hog():
    """For a test that needs about half of an 80 GB GPU (the 2^31-element backward): runs it alone among
    the tests that take this fixture, across pytest-xdist workers (a lock file, one per machine), and
    then waits up to two minutes for GPU_MEMORY_HOG_BYTES to be free, skipping with the reason if the
    other workers' tests keep holding it. Under `-n 16` on an H100 the two such tests ran out of
    memory together, and once alone it still found 3.8 GiB free (the other workers held ~46 GiB)."""
    import fcntl
    import tempfile
    import time

    import torch

    with open(os.path.join(tempfile.gettempdir(), "fa4-tests-gpu-memory-hog.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            deadline = time.monotonic() + 120
            while torch.cuda.mem_get_info()[0] < GPU_MEMORY_HOG_BYTES and time.monotonic() < deadline:
                torch.cuda.empty_cache()
                time.sleep(2)
            free = torch.cuda.mem_get_info()[0]
            if free < GPU_MEMORY_HOG_BYTES:
                pytest.skip(f"needs {GPU_MEMORY_HOG_BYTES / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.1f} "
                            "free after two minutes (other test processes hold the rest): run it alone")
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def rng(request):
    """A fresh, reproducible generator per test (seeded from the test's name)."""
    import numpy as np
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("FA4_TEST_SEED", "0"))
    return np.random.default_rng(seed)


@pytest.fixture
def fa4_ops_on_cpu(monkeypatch):
    """A function install(backend, ops): fa4's public functions then run end to end on CPU tensors --
    validation sees meta stand-ins for the device check (fa4 refuses CPU tensors), and the named
    fa4 ops ("fwd", "bwd", "varlen_fwd", "varlen_bwd") run their real implementations, registered
    for CPU, over `backend` (a stand-in for fa4._dispatch's Backend). Undone after the test."""
    import torch

    from fa4 import _dispatch, _ops, _validate

    libs = []

    def install(backend, ops=("fwd", "bwd")):
        real = _validate._check_dtypes_devices
        monkeypatch.setattr(_validate, "_check_dtypes_devices",
                            lambda names, ts: real(names, tuple(t.to("meta") if isinstance(t, torch.Tensor) else t
                                                                for t in ts)))
        monkeypatch.setattr(_dispatch, "backend_for", lambda device: backend)
        lib = torch.library.Library("fa4", "FRAGMENT")
        for name in ops:
            torch.library.register_kernel(f"fa4::{name}", "cpu", getattr(_ops, f"_{name}_impl"), lib=lib)
        libs.append(lib)
        return backend

    yield install
    for lib in libs:
        lib._destroy()
