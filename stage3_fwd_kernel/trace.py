"""Clock stamps from inside the Hopper kernels, for timelines (the repository's trace tools read them).

Off by default, and then every stamp compiles to nothing (the production SASS does not change).
``enable(address, events)`` before a build turns them on for the kernels compiled from then on:
the address of an int64 buffer (``buffer_elems(num_ctas)`` elements) is baked into the code, so a
traced kernel must never outlive its buffer. Step 4 adds ``key()`` to its compile-cache key, and
fa4's disk cache refuses keys marked "traced".

Layout: one record of ``RECORD`` int64 per (CTA, warpgroup), CTA = the linear block index
``bx + gx * (by + gy * bz)`` of a one-tile-per-CTA grid (a persistent CTA overwrites its records
tile after tile):

* ``CTA_EVENTS`` x 3 slots: (SM id, ``%globaltimer`` ns, ``clock64``) at the kernel's entry (a
  Hopper split-KV launch's after its griddepcontrol.wait, so it excludes the wait), at the
  consumer's start on its tile, after its walk (the backward's; before the epilogue) and at its end
  (after the O, or dK / dV, store);
* ``MAX_BLOCKS`` x ``NUM_EVENTS`` slots: ``clock64`` at each per-key-block event (``EVENTS``)
  of key block ``n_block`` (blocks from ``MAX_BLOCKS - 1`` on share the last slot); the spare slot
  of block 0 (``NOTE``) holds a value the kernel reports with ``note`` (the backward's walk length).

Every thread of a warpgroup stores the same slot (no branch in the hot loop; the warps' clocks
differ by a few cycles, the last store wins). A stamp is a clock read and a global store, and
it pins the code around it: per-block stamps change the schedule ptxas picks (the official
kernel's block period moved by up to 9% with a stamp after its P V wait, ours by 2%), so
compare kernels with the same stamps, and use ``events=()`` (CTA stamps only, outside the
hot loop) for per-block costs from the CTA durations.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

CTA_EVENTS = ("entry", "start", "walked", "end")
EVENTS = ("top", "turn", "issued", "s_landed", "softmax", "pv_landed", "end")
NUM_EVENTS = 8                 # slots per block (EVENTS plus one spare)
MAX_BLOCKS = 128
RECORD = len(CTA_EVENTS) * 3 + MAX_BLOCKS * NUM_EVENTS
NOTE = len(CTA_EVENTS) * 3 + NUM_EVENTS - 1   # block 0's spare slot

_address = 0
_events: tuple = ()


def enable(address: int, events=()) -> None:
    """Trace the kernels built from now on into the buffer at `address`; `events`: the names of
    the per-block events to stamp (a subset of EVENTS; () = CTA stamps only)."""
    if not isinstance(address, int) or address <= 0 or address % 8:
        raise ValueError(f"address: expected the 8-byte aligned device address of an int64 buffer, got {address!r}")
    unknown = set(events) - set(EVENTS)
    if unknown:
        raise ValueError(f"events: expected names from {EVENTS}, got {sorted(unknown)}")
    global _address, _events
    _address, _events = address, tuple(EVENTS.index(e) for e in events)


def disable() -> None:
    global _address, _events
    _address, _events = 0, ()


def key() -> tuple:
    """What a compile-cache key must add: () when off."""
    return ("traced", _address, _events) if _address else ()


def buffer_elems(num_ctas: int) -> int:
    return num_ctas * 4 * RECORD


def _records():
    ptr = cute.make_ptr(Int64, _address, cute.AddressSpace.gmem, assumed_align=8)
    return cute.make_tensor(ptr, cute.make_layout(1 << 40))


def _cta_linear():
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return Int64(bx + gx * (by + gy * bz))


@cute.jit
def cta_stamp(event: cutlass.Constexpr[str]):
    """SM id, global timer and clock of this warpgroup at a CTA event (CTA_EVENTS)."""
    if cutlass.const_expr(_address != 0):
        wg = cute.arch.thread_idx()[0] // 128
        base = (_cta_linear() * 4 + wg) * RECORD + CTA_EVENTS.index(event) * 3
        t = _records()
        t[base] = Int64(cute.arch.smid())
        t[base + 1] = Int64(cute.arch.globaltimer())
        t[base + 2] = cute.arch.clock64()


@cute.jit
def stamp(n_block: Int32, event: cutlass.Constexpr[str]):
    """clock64 of this warpgroup at a per-block event (EVENTS) of key block n_block."""
    if cutlass.const_expr(_address != 0 and EVENTS.index(event) in _events):
        wg = cute.arch.thread_idx()[0] // 128
        base = (_cta_linear() * 4 + wg) * RECORD + len(CTA_EVENTS) * 3
        slot = cutlass.min(n_block, MAX_BLOCKS - 1) * NUM_EVENTS + EVENTS.index(event)
        t = _records()
        t[base + Int64(slot)] = cute.arch.clock64()


@cute.jit
def note(value: Int32):
    """Record one integer for this warpgroup's CTA (slot NOTE), e.g. how many tiles its walk has."""
    if cutlass.const_expr(_address != 0):
        wg = cute.arch.thread_idx()[0] // 128
        t = _records()
        t[(_cta_linear() * 4 + wg) * RECORD + NOTE] = Int64(value)
