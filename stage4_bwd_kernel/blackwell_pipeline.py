"""Stage 4, Blackwell 1-CTA backward: its warp roles and mbarriers, replayed as a discrete-event model.

The kernel (``blackwell_bwd.py``) cannot run here: no Blackwell GPU is reachable. Its risk is not
the math (stage 0 and the Hopper kernels pin that down) but the protocol -- five roles handing TMEM
columns, SMEM buffers and mbarrier phases to each other. This module replays that protocol, role by
role, in the order the kernel issues it (``ORDERS``), over the TMEM plan of ``blackwell_config.py``:

* ``check(...)`` runs one random interleaving of the roles and raises ``ProtocolError`` on a
  deadlock, on an mbarrier wait that would alias (the barrier completed twice before the waiter
  got there: a parity wait then hangs), or on a read of a TMEM column / SMEM buffer that does not
  hold the value the reader expects (tagged with the tile that wrote it). MMAs complete in issue
  order -- the kernel's one assumption beyond its barriers (the official kernel makes it too) --
  and a ``tcgen05.commit`` arrives once every MMA issued before it has completed.
* ``timeline(...)`` runs the same programs with a cost per operation (B200 clocks from the
  paper's roofline: a 128 x 128 x 128 MMA is 512, the 128 x 128 exponentials 1024) and returns
  who was busy when: the tensor cores against the elementwise warpgroup, for the kernel's versions
  (``VERSIONS``: the serial order it started with, the paper's order, and the early release of the
  dQ columns). Tutorial 04 plots it. The costs are illustrative, not measured.

Roles: ``load`` (TMA warp), ``mma`` (the issuing thread), ``tc`` (the tensor cores, executing what
``mma`` queued), ``ew`` (elementwise warpgroup), ``dq`` (dQ drain warpgroup).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from stage4_bwd_kernel.blackwell_config import blackwell_bwd_config

ORDERS = {
    # turn j: S(j); dK(j-1), dQ(j-1); dP(j); dV(j)  -- blackwell_bwd.py since the pipeline change
    "paper": "S(j) dK(j-1) dQ(j-1) dP(j) dV(j)",
    # per tile: S, dP, dV, dK, dQ  -- the first version of the kernel
    "serial": "S(j) dP(j) dV(j) dK(j) dQ(j)",
}


class ProtocolError(AssertionError):
    pass


# ----------------------------------------------------------------------------------------- ops
@dataclass(frozen=True)
class Wait:          # mbarrier wait for completion number `index` (0-based) of `bar`
    bar: object
    index: int


@dataclass(frozen=True)
class Arrive:
    bar: object


@dataclass(frozen=True)
class Mma:           # queued on the tensor cores; reads / writes are (buffer, tag) checks / stores
    name: str
    tile: int
    reads: tuple
    writes: tuple
    cost: int


@dataclass(frozen=True)
class Commit:        # tcgen05.commit: arrives on `bar` when all MMAs queued before it are done
    bar: object


@dataclass(frozen=True)
class Access:        # a synchronous read (check) and/or write by the role itself
    reads: tuple = ()
    writes: tuple = ()
    cost: int = 0
    label: str = ""


# ---------------------------------------------------------------------------------- programs
def _regions(d: int, dv: int):
    """TMEM column ranges of the 1-CTA plan (blackwell_config), as sets of columns."""
    t = blackwell_bwd_config(d, dv, "bf16", causal=False).tmem
    span = lambda lo, w: tuple(range(lo, lo + w))  # noqa: E731
    return {"S": span(t.s, t.s_cols), "P": span(t.p, t.p_cols), "dP": span(t.dp, t.dp_cols),
            "dS": span(t.ds, t.p_cols), "dQ": span(t.dq, t.dk_cols), "dV": span(t.dv, t.dv_cols),
            "dK": span(t.dk, t.dk_cols)}


def _mma_cost(k: int, n: int) -> int:
    return 512 * k * n // (128 * 128)  # a 128-row tcgen05 MMA: 128 x n x k at 8192 FLOP/clk


def mma_program(n: int, order: str, d: int, dv: int, stages: int = 2):
    slot = lambda t: ("slot", t % stages)  # noqa: E731

    def S(j):
        return Mma("S", j, ((slot(j), ("Q", j)),), (("S", ("S", j)),), _mma_cost(d, 128))

    def dP(j):
        return Mma("dP", j, ((slot(j), ("Q", j)),), (("dP", ("dP", j)),), _mma_cost(dv, 128))

    def dV(j):
        return Mma("dV", j, (("P", ("P", j)), (slot(j), ("Q", j))), (), _mma_cost(128, dv))

    def dK(j):
        return Mma("dK", j, (("dS", ("dS", j)), (slot(j), ("Q", j))), (), _mma_cost(128, d))

    def dQ(j):
        return Mma("dQ", j, (("sdS", ("dS", j)),), (("dQ", ("dQ", j)),), _mma_cost(128, d))

    yield Wait("kv_full", 0)
    if order == "paper":
        for j in range(n + 1):
            if j < n:
                yield Wait(("qdo_full", j % stages), j // stages)
                yield S(j)
                yield Commit("s_full")
            if j > 0:
                yield Wait("ds_full", j - 1)
                yield dK(j - 1)
                yield dQ(j - 1)
                yield Commit("dq_full")
                yield Commit(("qdo_empty", (j - 1) % stages))
            if j < n:
                if j > 0:
                    yield Wait("dq_empty", j - 1)
                yield dP(j)
                yield Commit("dp_full")
                yield Wait("p_full", j)
                yield dV(j)
    elif order == "serial":
        for j in range(n):
            yield Wait(("qdo_full", j % stages), j // stages)
            yield S(j)
            yield Commit("s_full")
            if j > 0:
                yield Wait("dq_empty", j - 1)
            yield dP(j)
            yield Commit("dp_full")
            yield Wait("p_full", j)
            yield dV(j)
            yield Wait("ds_full", j)
            yield dK(j)
            yield dQ(j)
            yield Commit("dq_full")
            yield Commit(("qdo_empty", j % stages))
    else:
        raise ValueError(f"order: expected one of {sorted(ORDERS)}, got {order!r}")
    yield Commit("dkv_full")


def load_program(n: int, stages: int = 2):
    yield Arrive("kv_full")   # TMA K, V
    for t in range(n):
        yield Wait(("qdo_empty", t % stages), t // stages - 1)  # the first pass over the ring is free
        yield Access(writes=((("slot", t % stages), ("Q", t)),), label=f"TMA Q, dO {t}")
        yield Arrive(("qdo_full", t % stages))


def ew_program(n: int, d: int, dv: int, chunks: int = 4):
    """Elementwise warpgroup: P from S^T, then dS from dP^T in 32-column chunks (dS^T over them)."""
    R = _regions(d, dv)
    for j in range(n):
        yield Wait("s_full", j)
        yield Access(reads=(("S", ("S", j)),), writes=(("P", ("P", j)),), cost=1024 + 128, label=f"P({j})")
        yield Arrive("p_full")
        yield Wait("dp_full", j)
        if j > 0:
            yield Wait("dq_full", j - 1)   # sdS free again
        w = len(R["dP"]) // chunks
        for c in range(chunks):
            read = tuple(R["dP"][c * w:(c + 1) * w])
            wrote = tuple(R["dS"][c * w // 2:(c + 1) * w // 2])
            yield Access(reads=((read, ("dP", j)),), writes=((wrote, ("dS", j)),), cost=128,
                         label=f"dS({j})" if c == 0 else "")
        yield Access(writes=(("sdS", ("dS", j)),))
        yield Arrive("ds_full")
    if n:
        yield Wait("dkv_full", 0)
    yield Access(label="dK, dV epilogue", cost=256)


def dq_program(n: int, early_release: bool = True):
    """dQ drain. The kernel loads the whole dQ row into registers and releases the TMEM columns
    before its atomics (early_release); the first version released them after the atomics."""
    for j in range(n):
        yield Wait("dq_full", j)
        if early_release:
            yield Access(reads=(("dQ", ("dQ", j)),), cost=64, label=f"dQ({j}) ld")
            yield Arrive("dq_empty")
            yield Access(cost=512, label=f"dQ({j}) atomics")
        else:
            yield Access(reads=(("dQ", ("dQ", j)),), cost=512, label=f"dQ({j}) ld + atomics")
            yield Arrive("dq_empty")


ARRIVALS = {"kv_full": 1, "s_full": 1, "dp_full": 1, "p_full": 1, "ds_full": 1, "dq_full": 1, "dq_empty": 1,
            "dkv_full": 1}  # the kernel's 128-thread arrivals are one warpgroup-wide event here


# ------------------------------------------------------------------------------------- engine
@dataclass
class _State:
    d: int
    dv: int
    regions: dict
    completions: dict = field(default_factory=dict)   # bar -> completion times
    memory: dict = field(default_factory=dict)        # column or buffer -> tag
    busy: list = field(default_factory=list)          # (role, start, end, label)

    def cells(self, buf):
        if isinstance(buf, tuple) and buf and isinstance(buf[0], int):
            return buf                                  # explicit TMEM columns
        if isinstance(buf, str) and buf in self.regions:
            return self.regions[buf]
        return (buf,)                                   # an SMEM buffer (or K / V)

    def read(self, who, buf, tag):
        for c in self.cells(buf):
            if self.memory.get(c) != tag:
                raise ProtocolError(f"{who} reads {buf!r} expecting {tag}, found {self.memory.get(c)} "
                                    f"(column / buffer {c!r})")

    def write(self, buf, tag):
        for c in self.cells(buf):
            self.memory[c] = tag

    def arrive(self, bar, when):
        self.completions.setdefault(bar, []).append(when)

    def passed(self, who, w: Wait):
        """None if still blocked; else the completion time. Raises on a parity alias."""
        done = self.completions.get(w.bar, [])
        if len(done) >= w.index + 2:
            raise ProtocolError(f"{who}: {w.bar!r} completed {len(done)} times before the wait for completion "
                                f"{w.index}: the parity wait would hang")
        if w.index < 0:
            return 0
        return done[w.index] if len(done) > w.index else None


def _without(prog, drop):
    """The program minus its waits on the barriers in `drop` (to show that the checks can fail)."""
    return (op for op in prog if not (isinstance(op, Wait) and op.bar in drop))


def _run(n, order, d, dv, stages, rng, drop=(), early_release=True):
    st = _State(d, dv, _regions(d, dv))
    progs = {"load": load_program(n, stages), "mma": mma_program(n, order, d, dv, stages),
             "ew": ew_program(n, d, dv), "dq": dq_program(n, early_release)}
    progs = {r: _without(p, drop) for r, p in progs.items()}
    nxt = {r: next(p, None) for r, p in progs.items()}
    clock = {r: 0 for r in list(progs) + ["tc"]}
    queue: list = []                                    # (op, issue time) on the tensor cores

    def step_role(r):
        op = nxt[r]
        if isinstance(op, Wait):
            t = st.passed(r, op)
            if t is None:
                return False
            clock[r] = max(clock[r], t)
        elif isinstance(op, Arrive):
            st.arrive(op.bar, clock[r])
        elif isinstance(op, (Mma, Commit)):
            queue.append((op, clock[r]))
        elif isinstance(op, Access):
            for buf, tag in op.reads:
                st.read(r, buf, tag)
            for buf, tag in op.writes:
                st.write(buf, tag)
            if op.cost:
                st.busy.append((r, clock[r], clock[r] + op.cost, op.label))
            clock[r] += op.cost
        nxt[r] = next(progs[r], None)
        return True

    def step_tc():
        op, issued = queue.pop(0)
        start = max(clock["tc"], issued)
        if isinstance(op, Mma):
            for buf, tag in op.reads:
                st.read(f"MMA {op.name}({op.tile})", buf, tag)
            for buf, tag in op.writes:
                st.write(buf, tag)
            st.busy.append(("tc", start, start + op.cost, f"{op.name}({op.tile})"))
            clock["tc"] = start + op.cost
        else:
            clock["tc"] = start
            st.arrive(op.bar, start)
        return True

    while True:
        ready = [r for r in progs if nxt[r] is not None and
                 (not isinstance(nxt[r], Wait) or st.passed(r, nxt[r]) is not None)]
        if queue:
            ready.append("tc")
        if not ready:
            stuck = {r: nxt[r] for r in progs if nxt[r] is not None}
            if stuck:
                raise ProtocolError(f"deadlock with {n} Q tiles ({order}): {stuck}")
            return st, max(clock.values())
        if rng is None:   # timed: the role that is earliest in time goes next
            r = min(ready, key=lambda x: (max(clock[x], queue[0][1]) if x == "tc" else clock[x]))
        else:
            r = rng.choice(ready)
        step_tc() if r == "tc" else step_role(r)


def check(n: int, order: str = "paper", d: int = 128, dv: int | None = None, stages: int = 2, seed: int = 0,
          drop=(), early_release: bool = True):
    """One random interleaving of the roles for a walk of n Q tiles; raises ProtocolError on a
    deadlock, a parity alias or a stale read. Returns the number of MMAs executed. `drop` removes
    every wait on the named barriers (a broken protocol, for the tests)."""
    st, _ = _run(n, order, d, dv or d, stages, random.Random(seed), drop, early_release)
    return sum(1 for b in st.busy if b[0] == "tc")


def timeline(n: int = 6, order: str = "paper", d: int = 128, dv: int | None = None, stages: int = 2,
             early_release: bool = True):
    """(busy intervals [(role, start, end, label)], makespan) with the illustrative costs."""
    st, end = _run(n, order, d, dv or d, stages, None, early_release=early_release)
    return st.busy, end


# the kernel's versions, first to current: (label, order, early_release)
VERSIONS = [("serial order, late dQ release", "serial", False),
            ("paper order, late dQ release", "paper", False),
            ("paper order, early dQ release (current)", "paper", True)]


def per_tile_clocks(d: int = 128, n: int = 16) -> dict:
    """Modelled clocks per Q tile and tensor-core busy fraction of each version (steady state)."""
    out = {}
    for label, order, early in VERSIONS:
        busy, end = timeline(n, order, d, early_release=early)
        out[label] = (end / n, sum(e - s for r, s, e, _ in busy if r == "tc") / end)
    return out


if __name__ == "__main__":
    for d in (64, 128):
        for label, (clk, tc) in per_tile_clocks(d).items():
            print(f"d={d:3} {label:40} {clk:6.0f} clk per Q tile, tensor cores busy {tc:.0%}")
