"""A model of the persistent Hopper backward's hand-offs (hopper/persistent.py), run under random
schedules on the CPU: the producer warp, the dQ writer warp and the two consumer warpgroups as Python
generators over the kernel's mbarriers (phase parity waits) and named barriers (generations of a thread
count), with the same phases, parities and counts as the kernel.

    python -m stage4_bwd_kernel.persistent_protocol --runs 2000

What a pass shows: for every item list tried (walks of 0..5 tiles, varlen-style dead items skipped by
the producer, no items at all), dQ buffer count and schedule, no role waits forever, no named barrier
is over-filled or left with a partial generation at exit, no mbarrier phase goes unwaited before the
next one's arrivals (synccheck's "Missing wait"), and no slot (the item ring, the writer's
record ring) is stored before every reader of its previous value has read it. What it cannot show: that
the kernel's code does what the model says (the model is written from persistent.py, not extracted
from it), nor anything about memory ordering beyond "read before overwritten".
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

RECORDS = 4      # persistent.RECORDS
STAGES = 2       # the Q / dO ring
SENTINEL = -1


class ProtocolError(AssertionError):
    """A deadlock, an over-filled named barrier, a partial generation at exit or an early overwrite."""


@dataclass
class MBarrier:
    count: int
    name: str = "mbarrier"
    done: int = 0        # completed phases
    pending: int = 0
    waited: int = 0      # completed phases some wait has seen (a wait sees the latest)
    strict: bool = True  # refuse a missing wait (off: to see a planted bug's own failure)

    def arrive(self):
        """compute-sanitizer's synccheck reports "Missing wait" when a phase gets its first arrival
        while the phase before it completed unseen by any wait; the model refuses the same."""
        if self.strict and self.pending == 0 and self.done > self.waited:
            raise ProtocolError(f"{self.name}: missing wait (phase {self.done - 1} completed, never waited for, "
                                f"before phase {self.done}'s arrivals)")
        self.pending += 1
        if self.pending == self.count:
            self.done, self.pending = self.done + 1, 0

    def passed(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed (the current one has the other)."""
        if self.done % 2 != parity:
            self.waited = self.done
            return True
        return False


@dataclass
class NamedBarrier:
    name: str
    threads: int
    count: int = 0
    generation: int = 0

    def add(self, threads: int) -> int:
        """Arrive with `threads`; returns the generation a bar.sync waits for."""
        self.count += threads
        if self.count > self.threads:
            raise ProtocolError(f"{self.name}: {self.count} arrivals for a barrier of {self.threads}")
        gen = self.generation
        if self.count == self.threads:
            self.count, self.generation = 0, self.generation + 1
        return gen


@dataclass
class Slot:
    """A shared-memory slot with the readers its value still waits for."""
    name: str
    value: object = None
    unread: set = field(default_factory=set)

    def store(self, value, readers):
        if self.unread:
            raise ProtocolError(f"{self.name}: stored {value!r} before {sorted(self.unread)} read {self.value!r}")
        self.value, self.unread = value, set(readers)

    def load(self, reader):
        self.unread.discard(reader)
        return self.value


class Model:
    def __init__(self, walks, dq_buffers: int, ds_buffers: int = 2, wait_parity_lag: int = 1,
                 first_items_wait: int = 1, missing_waits: bool = False, end_syncs: bool = True, record_empty_wait: bool = True, records: int = RECORDS):
        """walks: tiles of each item the CTA takes, None for a dead item (skipped by the producer).
        The other arguments plant the kernel's bugs, or ones it could have, for the tests: wait_parity_lag,
        which item's readers the producer waits for before publishing item i (1: item i - 1, the kernel;
        2: item i - 2, the version a review found hanging); first_items_wait: the first item whose publish
        waits (1, the kernel; 2 skips item 0's phase, which synccheck reported as a missing wait);
        missing_waits=True lets such phases pass, so a planted bug shows its own failure;
        end_syncs=False drops end_dq_stream's syncs;
        record_empty_wait=False stores a record without waiting for its slot's last reader (with the
        kernel's 4 slots that never overwrites one: the producer runs at most B + 1 <= 3 walks ahead of
        the writer; with 2 it does); records: the ring's slots."""
        self.walks, self.B, self.ds_buffers, self.lag = walks, dq_buffers, ds_buffers, wait_parity_lag
        self.first_wait = first_items_wait
        self.end_syncs, self.record_empty_wait, self.nrec = end_syncs, record_empty_wait, records
        def mb(count, name):
            return MBarrier(count, name, strict=not missing_waits)
        self.kv_full, self.kv_empty = mb(1, "K/V full"), mb(2, "K/V empty")
        self.q_full = [mb(1, f"Q full {i}") for i in range(STAGES)]
        self.q_empty = [mb(2, f"Q empty {i}") for i in range(STAGES)]
        self.items_read = mb(2, "items read")
        self.rec_full = [mb(1, f"record full {i}") for i in range(records)]
        self.rec_empty = [mb(1, f"record empty {i}") for i in range(records)]
        self.items = [Slot(f"items[{i}]") for i in range(2)]
        self.records = [Slot(f"records[{i}]") for i in range(records)]
        self.consumer_bar = NamedBarrier("consumer", 256)
        self.sdst_free = [NamedBarrier(f"sdSt free {w}", 256) for w in range(2)]
        self.dq_full = [NamedBarrier(f"dQ full {b}", 288) for b in range(dq_buffers)]
        self.dq_empty = [[NamedBarrier(f"dQ empty {b}.{w}", 160) for w in range(2)] for b in range(dq_buffers)]
        self.named = [self.consumer_bar, *self.sdst_free, *self.dq_full, *(x for r in self.dq_empty for x in r)]
        self.live = [n for n in walks if n is not None]
        self.total_tiles = sum(self.live)

    # ------------------------------------------------------------------ roles (generators)
    def wait(self, bar: MBarrier, parity: int):
        while not bar.passed(parity):
            yield

    def sync(self, bar: NamedBarrier, threads: int):
        gen = bar.add(threads)
        while bar.generation == gen:
            yield

    def producer(self):
        item = tiles = recorded = 0
        for n in self.walks:
            if n is None:
                continue
            if item >= self.first_wait:  # publish_item
                yield from self.wait(self.items_read, (item - self.lag) % 2)
            self.items[item % 2].store(item, ("c0", "c1"))
            if n > 0:
                yield from self.post_record(recorded, n)
                recorded += 1
            yield from self.wait(self.kv_empty, (item % 2) ^ 1)
            self.kv_full.arrive()
            for g in range(tiles, tiles + n):
                yield from self.wait(self.q_empty[g % STAGES], ((g // STAGES) % 2) ^ 1)
                self.q_full[g % STAGES].arrive()
            tiles += n
            item += 1
        yield from self.post_record(recorded, SENTINEL)
        if item >= self.first_wait:
            yield from self.wait(self.items_read, (item - self.lag) % 2)
        self.items[item % 2].store(SENTINEL, ("c0", "c1"))
        yield from self.wait(self.kv_empty, (item % 2) ^ 1)
        self.kv_full.arrive()

    def post_record(self, r: int, n: int):
        slot = r % self.nrec
        if r >= self.nrec and self.record_empty_wait:
            yield from self.wait(self.rec_empty[slot], (r // self.nrec - 1) % 2)
        self.records[slot].store(n, ("writer",))
        self.rec_full[slot].arrive()

    def writer(self):
        g = r = 0
        while True:
            slot = r % self.nrec
            yield from self.wait(self.rec_full[slot], (r // self.nrec) % 2)
            n = self.records[slot].load("writer")
            self.rec_empty[slot].arrive()
            if n == SENTINEL:
                return
            for _ in range(n):
                buf = g % self.B
                yield from self.sync(self.dq_full[buf], 32)
                for w in range(2):
                    self.dq_empty[buf][w].add(32)
                    yield
                g += 1
            r += 1

    def consumer(self, w: int):
        me = f"c{w}"
        item = g = 0
        while True:
            yield from self.wait(self.kv_full, item % 2)
            value = self.items[item % 2].load(me)
            self.items_read.arrive()
            if value == SENTINEL:
                break
            for _ in range(self.live[item]):
                yield from self.wait(self.q_full[g % STAGES], (g // STAGES) % 2)
                if self.ds_buffers == 1 and g > 0:
                    yield from self.sync(self.sdst_free[w], 128)
                yield from self.sync(self.consumer_bar, 128)          # B2
                if self.ds_buffers == 1:
                    self.sdst_free[1 - w].add(128)                    # every tile (TILES_CAP)
                if g >= self.B:
                    yield from self.sync(self.dq_empty[g % self.B][w], 128)
                self.dq_full[g % self.B].add(128)
                self.q_empty[g % STAGES].arrive()
                g += 1
            yield from self.sync(self.consumer_bar, 128)              # epilogue: wgmmas done
            self.kv_empty.arrive()
            for _ in range(3):                                        # dK staged, read; dV staged, read
                yield from self.sync(self.consumer_bar, 128)
            item += 1
        for k in range(self.B if self.end_syncs else 0):              # end_dq_stream
            if g - self.B + k >= 0:
                yield from self.sync(self.dq_empty[(g - self.B + k) % self.B][w], 128)
        if self.ds_buffers == 1 and g > 0:
            yield from self.sync(self.sdst_free[w], 128)

    # ------------------------------------------------------------------ scheduler
    def run(self, rng: random.Random, max_steps: int = 200_000):
        roles = {"producer": self.producer(), "writer": self.writer(), "c0": self.consumer(0),
                 "c1": self.consumer(1)}
        blocked_rounds = 0
        for _ in range(max_steps):
            if not roles:
                break
            name = rng.choice(sorted(roles))
            before = self.fingerprint()
            try:
                next(roles[name])
            except StopIteration:
                del roles[name]
                blocked_rounds = 0
                continue
            blocked_rounds = blocked_rounds + 1 if self.fingerprint() == before else 0
            if blocked_rounds > 200 * len(roles):
                raise ProtocolError(f"deadlock: {sorted(roles)} wait (items {self.walks}, dQ buffers {self.B})")
        if roles:
            raise ProtocolError(f"no end after {max_steps} steps: {sorted(roles)}")
        for bar in self.named:
            if bar.count:
                raise ProtocolError(f"{bar.name}: a partial generation ({bar.count} of {bar.threads}) at exit")

    def fingerprint(self):
        mbs = [self.kv_full, self.kv_empty, self.items_read, *self.q_full, *self.q_empty, *self.rec_full,
               *self.rec_empty]
        return (tuple((m.done, m.pending) for m in mbs), tuple((b.count, b.generation) for b in self.named),
                tuple(s.value for s in self.items + self.records))


def random_walks(rng: random.Random):
    """An item list: 0..11 items of 0..5 tiles, some dead (None)."""
    return [None if rng.random() < 0.1 else rng.choice([0, 0, 1, 1, 2, 3, 5]) for _ in range(rng.randrange(12))]


def check(runs: int = 500, seed: int = 0, ds_buffers=(1, 2), **planted) -> int:
    """Random item lists and schedules; raises ProtocolError on the first failure, returns the runs.
    planted: Model's bug switches."""
    rng = random.Random(seed)
    for _ in range(runs):
        walks = random_walks(rng)
        for buffers in (1, 2):
            for ds in ds_buffers:
                Model(walks, buffers, ds, **planted).run(rng)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"OK: {check(args.runs, args.seed)} item lists x dQ buffers (1, 2) x dS^T buffers (1, 2), random schedules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
