"""A model of the K/V ring that two CTAs share under step 4's `kv_multicast`, run event by event.

Plain Python, no GPU: the pair protocol is made of barrier counts that a compiler cannot check
and a wrong one does not show until two CTAs race on real hardware. Each CTA of the cluster has
`stages` K/V slots with a "full" and an "empty" mbarrier each. For block i (slot i % stages,
lap i // stages):

    producer of CTA r   wait until slot's empty barrier completed lap - 1 ... (its lap-th phase)
                        arrive on its own full barrier, expecting both halves of the block
                        TMA-multicast half r of the block into slot s of *both* CTAs; each half
                        lands later and completes its bytes on that CTA's full barrier
    consumer warp       wait for its CTA's full barrier (phase lap), read the slot,
                        release it: arrive on the empty barrier of *both* CTAs

and three rules make it correct:

    EMPTY_COUNTS_BOTH   a slot's empty barrier expects the consumer warps of both CTAs, since the
                        next load into it, by either CTA, overwrites both copies
    FULL_EXPECTS_BOTH   a CTA's full barrier expects the whole block (both halves)
    CLUSTER_EXIT        no CTA exits before the other is done (a cluster barrier at the end):
                        its partner may still arrive on its barriers

`simulate` runs both CTAs' producers and consumer warps as coroutines under a random interleaving
(TMA halves land after random delays, reads take random time) and returns the first violation it
sees, or None:

    "race"          a half lands in a slot while a consumer of that CTA still reads another block
    "torn read"     a consumer reads a slot that does not hold both halves of its block
    "wrong phase"   an arrival or a half lands on a barrier phase it does not belong to
    "after exit"    an arrival or a half lands in a CTA that has exited
    "deadlock"      nothing can move and the work is not done

`rules` drops one rule at a time (tests/test_stage3_step4.py: each one is needed, and together
they hold over many interleavings). The kernel's side of the same counts is checked in its PTX
(the mbarrier.init arrival counts) by the compile tier.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

RULES = ("EMPTY_COUNTS_BOTH", "FULL_EXPECTS_BOTH", "CLUSTER_EXIT")
CLUSTER = 2  # CTAs per cluster, each loading one half of every block


@dataclass
class Barrier:
    """An mbarrier: a phase completes when its pending arrivals and its transaction count both
    reach zero (bytes may land before the arrival that expects them: the count goes negative)."""
    expected: int
    pending: int = -1
    tx: int = 0
    completed: int = 0  # phases completed so far

    def __post_init__(self):
        self.pending = self.expected

    def arrive(self, tx: int = 0):
        self.pending -= 1
        self.tx += tx
        self._complete()

    def complete_tx(self, n: int):
        self.tx -= n
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.expected


@dataclass
class Cta:
    full: list
    empty: list
    slots: list                      # slot -> (block, set of halves landed)
    readers: dict = field(default_factory=dict)  # slot -> set of blocks being read
    exited: bool = False


class Violation(Exception):
    pass


def simulate(stages: int, blocks: int, consumer_warps: int, seed: int, rules=RULES) -> str | None:
    """Run one random interleaving of the pair's protocol; the first violation ("race: ...",
    "torn read: ...", ...), or None when both CTAs consumed every block in order and exited."""
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"rules: unknown {sorted(unknown)}; expected a subset of {RULES}")
    rng = random.Random(seed)
    empty_expected = consumer_warps * (CLUSTER if "EMPTY_COUNTS_BOTH" in rules else 1)
    ctas = [Cta(full=[Barrier(1) for _ in range(stages)], empty=[Barrier(empty_expected) for _ in range(stages)],
                slots=[(None, set()) for _ in range(stages)]) for _ in range(CLUSTER)]
    in_flight = []  # TMA halves on their way: [delay, target, slot, block, half, lap]
    done = {(r, who): False for r in range(CLUSTER) for who in ["producer"] + list(range(consumer_warps))}

    def check_alive(t: int, what: str):
        if ctas[t].exited:
            raise Violation(f"after exit: {what} reaches CTA {t}, which has exited")

    def producer(r: int):
        for i in range(blocks):
            s, lap = i % stages, i // stages
            yield lambda: ctas[r].empty[s].completed >= lap
            bar = ctas[r].full[s]
            if bar.completed != lap:
                raise Violation(f"wrong phase: CTA {r} arms slot {s} for lap {lap} in phase {bar.completed}")
            bar.arrive(tx=CLUSTER if "FULL_EXPECTS_BOTH" in rules else 1)
            for t in range(CLUSTER):
                in_flight.append([rng.randint(0, 3), t, s, i, r, lap])
        done[(r, "producer")] = True

    def consumer(r: int, w: int):
        for i in range(blocks):
            s, lap = i % stages, i // stages
            yield lambda: ctas[r].full[s].completed >= lap + 1
            block, halves = ctas[r].slots[s]
            if block != i or len(halves) != CLUSTER:
                raise Violation(f"torn read: CTA {r} warp {w} reads slot {s} for block {i}, holding block {block} "
                                f"halves {sorted(halves)}")
            ctas[r].readers.setdefault(s, set()).add((w, i))
            for _ in range(rng.randint(0, 3)):
                yield None  # reading
            ctas[r].readers[s].discard((w, i))
            for t in (range(CLUSTER) if "EMPTY_COUNTS_BOTH" in rules else [r]):
                check_alive(t, f"warp {w}'s release of slot {s}")
                bar = ctas[t].empty[s]
                if bar.completed != lap:
                    raise Violation(f"wrong phase: warp {w} of CTA {r} releases slot {s} of lap {lap} on CTA {t} "
                                    f"in phase {bar.completed}")
                bar.arrive()
        done[(r, w)] = True

    def land(t: int, s: int, block: int, half: int, lap: int):
        check_alive(t, f"half {half} of block {block}")
        cta = ctas[t]
        reading = {b for _, b in cta.readers.get(s, ())}
        if reading - {block}:
            raise Violation(f"race: half {half} of block {block} lands in CTA {t} slot {s} while block "
                            f"{sorted(reading)} is being read there")
        held, halves = cta.slots[s]
        cta.slots[s] = (block, (halves if held == block else set()) | {half})
        bar = cta.full[s]
        if bar.completed != lap:
            raise Violation(f"wrong phase: a half of lap {lap} lands on CTA {t} slot {s} in phase {bar.completed}")
        bar.complete_tx(1)

    agents = [(("producer", r), producer(r)) for r in range(CLUSTER)]
    agents += [((w, r), consumer(r, w)) for r in range(CLUSTER) for w in range(consumer_warps)]
    waiting = {name: None for name, _ in agents}  # the predicate each agent waits on
    live = dict(agents)
    try:
        while True:
            for r in range(CLUSTER):  # exit: once this CTA's agents (or, with CLUSTER_EXIT, all) are done
                mine = [v for (cta, _), v in done.items() if cta == r]
                if not ctas[r].exited and all(done.values() if "CLUSTER_EXIT" in rules else mine):
                    ctas[r].exited = True
            ready = [n for n in live if waiting[n] is None or waiting[n]()]
            if not ready and not in_flight:
                if all(done.values()):
                    return None
                return f"deadlock: waiting {sorted(str(n) for n in live)}"
            if in_flight and (not ready or rng.random() < 0.4):
                for ev in in_flight:
                    ev[0] -= 1
                due = [ev for ev in in_flight if ev[0] < 0]
                if due:
                    ev = rng.choice(due)
                    in_flight.remove(ev)
                    land(*ev[1:])
                continue
            name = rng.choice(ready)
            try:
                waiting[name] = next(live[name])
            except StopIteration:
                del live[name]
                del waiting[name]
    except Violation as v:
        return str(v)


def first_violation(rules=RULES, seeds=range(300), configs=((2, 7, 2), (3, 9, 2), (2, 5, 3), (4, 4, 1))):
    """The first violation over `seeds` x `configs` (stages, blocks, consumer warps), or None."""
    for stages, blocks, warps in configs:
        for seed in seeds:
            found = simulate(stages, blocks, warps, seed, rules)
            if found:
                return f"stages={stages} blocks={blocks} warps={warps} seed={seed}: {found}"
    return None


if __name__ == "__main__":
    print("all three rules:", first_violation() or "no violation")
    for dropped in RULES:
        print(f"without {dropped}:", first_violation(tuple(r for r in RULES if r != dropped)))
