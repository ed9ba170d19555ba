"""The persistent Hopper backward's hand-offs, modelled (stage4_bwd_kernel/persistent_protocol.py): random
item lists and schedules end without a deadlock, an over-filled or half-filled named barrier, or a slot
stored before its readers read it, or an mbarrier phase nobody waited for (compute-sanitizer synccheck's
"Missing wait"); and the model catches each planted bug (among them the hang a review
found in the kernel: the producer waiting for item i - 2's readers, and the unwaited item-0 phase
synccheck found on an H200)."""
from __future__ import annotations

import pytest

from stage4_bwd_kernel import persistent_protocol as proto

pytestmark = [pytest.mark.cpu, pytest.mark.stage4]


def test_the_kernels_protocol_passes():
    assert proto.check(400, seed=1) == 400


def test_a_two_slot_record_ring_needs_its_empty_wait():
    """With 2 record slots the producer can run a slot's reuse ahead of the writer; the "empty" wait
    keeps it correct (the planted test below drops the wait and is caught)."""
    assert proto.check(200, seed=4, records=2) == 200


def test_no_items_and_one_item():
    import random

    rng = random.Random(2)
    for walks in ([], [None], [0], [3], [None, 2, None]):
        for buffers in (1, 2):
            proto.Model(walks, buffers).run(rng)


@pytest.mark.parametrize("planted,match", [
    ({"wait_parity_lag": 2, "missing_waits": True}, "deadlock"),
    ({"first_items_wait": 2}, "items read: missing wait"),
    ({"end_syncs": False}, "partial generation"),
    ({"record_empty_wait": False, "records": 2, "missing_waits": True}, "stored"),
    ({"record_empty_wait": False, "records": 2}, "record empty .: missing wait"),
], ids=["items-read-parity", "item-0-unwaited", "no-end-syncs", "record-overwrite", "record-unwaited"])
def test_planted_bugs_are_caught(planted, match):
    with pytest.raises(proto.ProtocolError, match=match):
        proto.check(400, seed=3, **planted)
