"""Stage 4, Blackwell 2-CTA backward: the pair's hand-overs checked element by element at trace time
(stage4_bwd_kernel/blackwell_2cta_check.py). No Blackwell GPU: layouts only, never a run.

(a) the two CTAs' dQ drains add every element of a 128 x d dQ tile exactly once, each the value the
pair MMA left at that TMEM address in that CTA; (b) every dS element written by either CTA (own rows
into sdS, the peer's through sXchg and the bulk copy) lands at the offset the peer's dQ MMA operand
layout reads, each sdS element once. Negative controls must count. One trace per head dim (~2 s),
plus the PTX of the compiled kernel for the bulk copy's size and per-rank offset (~10 s each d,
shared with test_stage4_blackwell_2cta's cache when run together).
"""
from __future__ import annotations

import functools

import pytest

from stage4_bwd_kernel import blackwell_2cta_check as ck

DIMS = [64, 128]   # the head dims the 2-CTA backward supports


@functools.lru_cache(maxsize=None)
def _traced(d):
    kernel = ck.make_kernel(d)
    return kernel, ck.trace(kernel)


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_dq_rows_partition_the_tile(d):
    kernel, traced = _traced(d)
    assert ck.dq_rows_mismatches(kernel, None, traced) == dict(wrong_element=0, lane_quadrant=0, not_written=0,
                                                               coverage=0)


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_dq_rows_negative_controls(d):
    kernel, traced = _traced(d)
    tile = kernel.tm * d
    same = ck.dq_rows_mismatches(kernel, "same_rows", traced)
    assert same["coverage"] == tile and same["wrong_element"] == tile // 2   # CTA 1's rows lost, CTA 0's twice
    swapped = ck.dq_rows_mismatches(kernel, "swapped_rows", traced)
    assert swapped["coverage"] == 0 and swapped["wrong_element"] == tile     # a partition, of the wrong values


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_ds_exchange_lands_where_the_peer_reads(d):
    kernel, traced = _traced(d)
    assert ck.ds_exchange_mismatches(kernel, None, traced) == dict(misplaced=0, outside_copy=0, coverage=0,
                                                                   samples=0)


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_ds_exchange_negative_controls(d):
    kernel, traced = _traced(d)
    half = kernel.tm // 2 * kernel.tn                # elements one CTA sends
    wrong_offset = ck.ds_exchange_mismatches(kernel, "peer_offset", traced)
    assert wrong_offset["misplaced"] == half and wrong_offset["coverage"] > 0
    same_half = ck.ds_exchange_mismatches(kernel, "same_half", traced)
    assert same_half["misplaced"] == 2 * half                  # all of CTA 1's writes, none of CTA 0's


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_ptx_bulk_copy_matches_the_checked_offsets(d):
    from stage4_bwd_kernel import blackwell_bwd_2cta as two
    kernel, _ = _traced(d)
    got = ck.ptx_exchange(two.compile_only("bf16", d).ptx)
    assert got == {"bytes": kernel.xchg_bytes, "rank_shift": (2 * kernel.xchg_dst_offset(1)).bit_length() - 1,
                   "peer_xor": 1}
    assert 1 << got["rank_shift"] == 2 * kernel.xchg_dst_offset(1)   # bytes, 16-bit elements


@pytest.mark.cpu
@pytest.mark.stage4
def test_ptx_reader_refuses_other_shapes():
    assert ck.ptx_exchange("no bulk copy here") is None
