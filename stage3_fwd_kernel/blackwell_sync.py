"""tcgen05 ordering fences around thread synchronisation (sm_100).

tcgen05 loads, stores and MMAs are asynchronous to the issuing thread, so an mbarrier or named
barrier alone does not order them against another thread's tcgen05 work: a fence goes before the
arrive and after the wait. Shared by the Blackwell forward (stage 3) and backward (stage 4).
"""
from __future__ import annotations

from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def tcgen05_fence_before_sync(*, loc=None, ip=None):
    """Order this thread's earlier tcgen05 ld/st/mma before a following barrier arrive."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after_sync(*, loc=None, ip=None):
    """Order a preceding barrier wait before this thread's later tcgen05 ld/st/mma."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)
