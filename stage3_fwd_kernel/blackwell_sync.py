"""tcgen05 ordering fences around thread synchronisation (sm_100).

tcgen05 loads, stores and MMAs are asynchronous to the issuing thread, so an mbarrier or named
barrier alone does not order them against another thread's tcgen05 work: a fence goes before the
arrive and after the wait. Shared by the Blackwell forward (stage 3) and backward (stage 4).
"""
from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def tcgen05_fence_before_sync(*, loc=None, ip=None):
    """Order this thread's earlier tcgen05 ld/st/mma before a following barrier arrive."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after_sync(*, loc=None, ip=None):
    """Order a preceding barrier wait before this thread's later tcgen05 ld/st/mma."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None):
    """x, through an asm mov the compiler may neither move nor look through. A persistent tile loop
    derives per-tile addresses from it so they are recomputed in the loop: hoisted above the loop,
    the addresses of a whole tile stay live across every tile and the small register budgets of the
    correction warpgroup and the MMA warp spill them (blackwell_persistent.py)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
