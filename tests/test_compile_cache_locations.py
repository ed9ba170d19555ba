"""Stage 3: kernels compile without per-op Python source locations (stage3_fwd_kernel/compile_cache.py).

`remarks{ptx}` (how the compile cache gets ptxas's resource lines) makes the DSL record a Python
source location for every op it builds; compile_cache switches that off because it costs ~20% of a
cold compile and the kernel does not depend on it. compile tier: the split-tail combine kernel
(a small one) compiled through the cache with and without the switch -- the switch stops the stack
walks, the PTX is byte-identical, and the ptxas report still arrives; CUTE_DSL_LINEINFO=1 keeps
the locations.
"""
from __future__ import annotations

import contextlib

import pytest

pytestmark = [pytest.mark.compile, pytest.mark.stage3]


def _compile_counting_walks(monkeypatch, with_locations: bool):
    """Compile the combine kernel under a fresh cache key; (its Compiled, how many ops asked for a
    caller frame)."""
    from stage3_fwd_kernel import compile_cache, host_io, split_combine  # sets the arch before cutlass loads
    from cutlass._mlir_helpers import op as dsl_op

    walks = []
    real = dsl_op._get_caller_frame_info
    monkeypatch.setattr(dsl_op, "_get_caller_frame_info", lambda: walks.append(1) or real())
    if with_locations:
        monkeypatch.setattr(compile_cache, "without_source_locations", contextlib.nullcontext)
    dt = host_io.cutlass_dtype("bf16")
    build = (lambda: (split_combine.SplitTailCombine(dt, 64), split_combine._fake_args(dt, 64, launchable=False)))
    compiled, _ = compile_cache._compile(("test_locations", with_locations), build)
    monkeypatch.undo()
    return compiled, len(walks)


def test_no_stack_walks_and_the_same_ptx(monkeypatch):
    lean, lean_walks = _compile_counting_walks(monkeypatch, with_locations=False)
    full, full_walks = _compile_counting_walks(monkeypatch, with_locations=True)
    assert full_walks > 100, "remarks{ptx} no longer turns the per-op locations on: the switch may be moot"
    assert lean_walks == 0
    assert lean.ptx and lean.ptx == full.ptx
    assert lean.report["registers"] == full.report["registers"] > 0


def test_lineinfo_keeps_the_locations(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    from stage3_fwd_kernel import compile_cache

    with compile_cache.without_source_locations():
        import cutlass.base_dsl.dsl as dsl
        from cutlass._mlir_helpers import op as dsl_op

        dsl._set_enable_frame_filtering(True)
        assert dsl_op._ENABLE_FRAME_FILTERING is True
    dsl._set_enable_frame_filtering(False)
