"""A barrier-protocol model checker for the Blackwell (sm_100a) kernels, which have never run on hardware.

Input. The program of every warp role is *extracted from the kernel source*
(``blackwell_protocol_extract.py``): the Python AST of the kernel's ``kernel`` method, and of every
``self`` method, lambda and ``functools.partial`` it reaches, is interpreted abstractly once per role
(warp index, CTA rank), with the loop trip counts as parameters. Tensors and runtime scalars are
``Unknown``; what is recorded, in program order, is what the protocol is made of:

* mbarrier waits with their parity, arrives (all threads of the role, or one inside ``elect_one`` /
  ``if tidx == 0``), ``arrive_and_expect_tx``, remote arrives, and the counts of ``mbarrier_init``;
* ``tcgen05.commit`` (multicast too), the MMAs (``cute.gemm``) with the buffers they read and write,
  TMA loads (``cute.copy(..., tma_bar_ptr=)``) and the peer bulk copy of the 2-CTA backward;
* a role's own TMEM / SMEM accesses (``cute.copy``, ``cute.autovec_copy``) and ``tmem.free``;
* named barriers (``barrier``, ``barrier_arrive``, ``sync_threads``) and the cluster barrier.

A barrier operation under a condition or loop the interpreter cannot decide is an ExtractionError,
not a guess. The per-kernel mapping (``forward_spec`` etc.) says which warps are which role, binds
the trip counts, and names the buffer behind a few tensor variables (``tStS`` -> the S columns of
the TMEM plan, ``tKsK`` -> the K/V ring); TMEM column ranges come from the kernel's config plan.

Model. Each role is a process; the tensor cores (of a CTA, or of the pair) are one more process that
executes the queued MMAs and commits in issue order; each TMA / bulk copy is in flight until it
lands. A wait is for the phase its parity selects (the first completion count, not below the role's
previous wait on that barrier, that the parity accepts). Vector clocks give happens-before. Reported:

* deadlock: no step possible and some role unfinished (each blocked role and barrier shown);
* race: a buffer cell read or written while a copy into (or out of) it is in flight, or an access not
  ordered after the conflicting earlier access (write -> read, read -> overwrite, write -> write) by
  a chain of barrier hand-overs; MMAs and TMA landings are accesses too;
* overrun: a barrier completes phase k + 1 without being ordered after some wait for phase k -- in
  some run it laps that waiter, whose parity test then sees the wrong phase;
* overflow (one step arrives more than a barrier's count) and leftover (arrivals that no phase
  consumed when every role has finished).

Search. Depth-first over interleavings, states hashed. Waits only ever become enabled (an early
completion is an overrun, reported), and the race and overrun checks depend on happens-before only,
never on the order in which unordered steps ran; so accesses, issues and enabled waits are taken
alone, and of the remaining steps (arrivals, commits, copy landings) only those that complete a
phase on a shared barrier are interleaved against the other arrivers of that barrier. ``reduce=False``
explores every interleaving (small cases; the tests compare both).

A pass proves, for the given trip counts: the extracted protocol cannot deadlock, no barrier can lap
a waiter, and every hand-over of the buffers the mapping names is ordered -- ASSUMING MMAs issued by
one thread complete in issue order, every TMA / bulk copy completes, a tcgen05.commit arrives after
all MMAs issued before it, expect_tx byte counts match the copies (modelled as one unit per copy; a
2-SM TMA counts for both CTAs), tcgen05 loads / stores complete at their fences, and arrivals on one
barrier within a phase commute. It says nothing about data layouts, arithmetic, the byte counts
themselves, timing, the TMEM allocator's own barrier, register or SMEM budgets, or any access made
through a tensor the mapping does not name (such an access is invisible to the race check).

    python -m stage3_fwd_kernel.blackwell_protocol --kernel fwd --blocks 4 --tiles 2
    python -m stage3_fwd_kernel.blackwell_protocol --kernel fwd --blocks 4 --persistent 2
    python -m stage3_fwd_kernel.blackwell_protocol --kernel fwd --blocks 4 --head-dim 256   # one Q tile
    python -m stage4_bwd_kernel.blackwell_protocol --kernel bwd --blocks 4   # the backward kernels' specs

``--persistent N`` checks the persistent forward (blackwell_persistent.py): every role's tile loop is
interpreted for N work tiles of one CTA, tile k walking blocks - 1 key blocks for even k and `blocks`
for odd k (at least 1). An odd first walk makes a count not carried from one tile to the next show up
as a wrong parity; the buffers reused by the next tile (sQ, sO, the S / O columns of TMEM) are named
as in the one-tile build, so a missing hand-over between tiles is a race.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field

from stage3_fwd_kernel.blackwell_protocol_extract import (  # noqa: F401  (re-exported)
    UNKNOWN, BarPtr, ExtractionError, KernelSpec, Region, RegionPtr, Role, extract_ops, smem, tmem)


def extract(spec: KernelSpec) -> "Program":
    """The kernel's Program: its roles' operations, extracted from source, and the barrier counts."""
    ops, inits = extract_ops(spec)
    return Program(spec, ops, inits)


# ------------------------------------------------------------------------------------------------
# ------------------------------------------------------------------------------------------------
# the extracted program, resolved to barrier indices and buffer cells
# ------------------------------------------------------------------------------------------------
class Program:
    """ops[role] = the extracted operations in program order; inits[offset] = arrival count."""

    def __init__(self, spec: KernelSpec, ops: dict, inits: dict):
        self.spec, self.ops, self.inits = spec, ops, inits

    def copy(self) -> "Program":
        return Program(self.spec, {r: list(o) for r, o in self.ops.items()}, dict(self.inits))

    def bar_name(self, bar) -> str:
        cta, off = bar
        name = self.spec.bar_names.get(off, f"bar{off}")
        return name if self.spec.ctas == 1 else f"{name}@cta{cta}"

    def summary(self) -> str:
        lines = []
        for role in self.spec.roles:
            ops = self.ops[role.name]
            kinds = {}
            for op in ops:
                kinds[op[0]] = kinds.get(op[0], 0) + 1
            lines.append(f"  {role.name:12s} {len(ops):4d} ops  " +
                         ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
        return "\n".join(lines)


def _cells_of(spec: KernelSpec, region: Region, ctas, universe: dict, bounds: list) -> tuple:
    """A region -> cell ids: SMEM (cta, name, index), TMEM elementary column intervals."""
    out = []
    for cta in ctas:
        if region.key[0] == "tmem":
            lo, hi = region.key[1:]
            out += [universe[(cta, "tmem", a)] for a, b in zip(bounds, bounds[1:]) if lo <= a and b <= hi]
        else:
            name = spec.smem_alias.get(region.key[1], region.key[1])
            idx = region.key[2:3]
            keys = [k for k in universe if k[0] == cta and k[1] == name and (not idx or k[2] == idx[0])]
            out += [universe[k] for k in keys]
    return tuple(sorted(set(out)))


class Compiled:
    """The Program in the form the explorer steps: barrier / named-barrier / cell indices."""

    def __init__(self, prog: Program):
        spec = self.spec = prog.spec
        self.prog = prog
        self.roles = [r.name for r in spec.roles]
        self.ntc = spec.ctas if not spec.pair_mma else 1
        self.procs = self.roles + [f"tensor cores{'' if self.ntc == 1 else i}" for i in range(self.ntc)]
        role_of = {r.name: r for r in spec.roles}
        # every region with the CTAs it lives in
        regs = []
        for rname, ops in prog.ops.items():
            own = (role_of[rname].cta,)
            for op in ops:
                for r in _op_regions(op):
                    ctas = (r.cta,) if r.cta is not None else \
                        (tuple(range(spec.ctas)) if spec.pair_mma and op[0] == "mma" else own)
                    regs.append((r, ctas))
        bounds = sorted({0, 512} | {b for r, _ in regs if r.key[0] == "tmem" for b in r.key[1:]})
        keys = set()
        for r, ctas in regs:
            for cta in ctas:
                if r.key[0] == "smem" and len(r.key) > 2:
                    keys.add((cta, spec.smem_alias.get(r.key[1], r.key[1]), r.key[2]))
        for r, ctas in regs:
            for cta in ctas:
                name = spec.smem_alias.get(r.key[1], r.key[1]) if r.key[0] == "smem" else None
                if name is not None and not any(k[0] == cta and k[1] == name for k in keys):
                    keys.add((cta, name, None))
        for cta in range(spec.ctas):
            keys |= {(cta, "tmem", a) for a in bounds[:-1]}
        self.cell_names = sorted(keys, key=str)
        universe = {k: i for i, k in enumerate(self.cell_names)}
        cells = functools.lru_cache(maxsize=None)(lambda r, ctas: _cells_of(spec, r, ctas, universe, bounds))
        self.bars, self.counts = [], []
        self.named, self.named_expected = [], []
        self.code = []
        for role in spec.roles:
            self.code.append([self._op(role, op, cells) for op in prog.ops[role.name]])
        self._bounds = bounds

    def cell_label(self, i) -> str:
        cta, name, idx = self.cell_names[i]
        if name == "tmem":
            j = self._bounds.index(idx)
            idx = f"cols {idx}..{self._bounds[j + 1] - 1}"
        where = "" if self.spec.ctas == 1 else f"@cta{cta}"
        return f"{name}[{idx}]{where}" if idx is not None else f"{name}{where}"

    def cells_text(self, cells) -> str:
        """Cell ids -> text, adjacent TMEM columns of one CTA merged into one range."""
        out, run = [], None
        for i in sorted(cells, key=lambda i: (self.cell_names[i][0], self.cell_names[i][1] != "tmem",
                                              str(self.cell_names[i][2]))):
            cta, name, lo = self.cell_names[i]
            if name == "tmem":
                hi = self._bounds[self._bounds.index(lo) + 1]
                if run and run[0] == cta and run[2] == lo:
                    run[2] = hi
                    continue
                if run:
                    out.append(run)
                run = [cta, lo, hi]
                continue
            out.append(self.cell_label(i))
        if run:
            out.append(run)
        where = lambda c: "" if self.spec.ctas == 1 else f"@cta{c}"  # noqa: E731
        return ", ".join(x if isinstance(x, str) else f"tmem[cols {x[1]}..{x[2] - 1}]{where(x[0])}" for x in out)

    def _bar(self, bar):
        if bar[0] is UNKNOWN:
            raise ExtractionError(f"a remote barrier operation on an unknown CTA: {bar}")
        if bar not in self.bars:
            if bar[1] not in self.prog.inits:
                raise ExtractionError(f"mbarrier {self.prog.bar_name(bar)} is used but never initialised")
            self.bars.append(bar)
            self.counts.append(self.prog.inits[bar[1]])
        return self.bars.index(bar)

    def _named(self, key, expected):
        if key not in self.named:
            self.named.append(key)
            self.named_expected.append(expected)
        i = self.named.index(key)
        if self.named_expected[i] != expected:
            raise ExtractionError(f"named barrier {key} used with {expected} and {self.named_expected[i]} threads")
        return i

    def _op(self, role, op, cells):
        kind, where = op[0], op[-1]
        own = (role.cta,)
        pair = tuple(range(self.spec.ctas)) if self.spec.pair_mma else own
        tc = self.ntc - 1 if self.ntc == 1 else role.cta
        c = lambda r, ctas=own: cells(r, (r.cta,) if r.cta is not None else ctas)  # noqa: E731
        if kind == "wait":
            return ("wait", self._bar(op[1]), op[2], where)
        if kind == "arrive":
            return ("arrive", self._bar(op[1]), op[2], where)
        if kind == "expect":
            return ("expect", self._bar(op[1]), op[2], 0, where)
        if kind == "commit":
            return ("commit", tuple(self._bar(b) for b in op[1]), op[2], tc, where)
        if kind == "mma":
            rc = tuple(sorted(set(x for r in op[1] for x in c(r, pair))))
            wc = tuple(sorted(set(x for r in op[2] for x in c(r, pair))))
            return ("mma", rc, wc, tc, where)
        if kind == "tma":
            return ("tma", c(op[1]), self._bar(op[2]), where)
        if kind == "bulk":
            return ("bulk", c(op[1]), c(op[2]), self._bar(op[3]), where)
        if kind == "access":
            rc = tuple(sorted(set(x for r in op[1] for x in c(r))))
            wc = tuple(sorted(set(x for r in op[2] for x in c(r))))
            return ("access", rc, wc, where)
        if kind == "narrive":
            return ("narrive", self._named(op[1], op[2]), op[2], op[3], where)
        if kind == "nwait":
            if op[1] not in self.named:
                raise ExtractionError(f"{where}: waits on named barrier {op[1]} before arriving on it")
            return ("nwait", self.named.index(op[1]), where)
        raise ExtractionError(f"unknown op {op}")

    def assign_tx(self):
        """An expect_tx covers the copies its role issues on that barrier until its next expect: one
        tx unit per copy, doubled for a 2-SM TMA (both CTAs' halves complete on CTA 0). Also numbers
        the copies (each gets its own vector-clock component) and the barriers each role may still
        wait on / arrive on from each program point (for the partial-order reduction)."""
        self.copies = []
        for p, code in enumerate(self.code):
            for i, op in enumerate(code):
                if op[0] == "expect":
                    units = 0
                    for nxt in code[i + 1:]:
                        if nxt[0] == "expect" and nxt[1] == op[1]:
                            break
                        if nxt[0] == "tma" and nxt[2] == op[1]:
                            units += 2 if self.spec.pair_mma else 1
                        if nxt[0] == "bulk" and nxt[3] == op[1]:
                            units += 1
                    code[i] = ("expect", op[1], op[2], units, op[4])
                elif op[0] in ("tma", "bulk"):
                    code[i] = op[:-1] + (len(self.copies), op[-1])
                    self.copies.append((p, i))
        # the phase each wait is for: the first completion count, not below the role's previous wait
        # on that barrier, whose parity the wait accepts (the hardware test is completions % 2 != parity)
        self.wait_sites = [dict() for _ in self.bars]
        for p, code in enumerate(self.code):
            last = {}
            for i, op in enumerate(code):
                if op[0] == "wait":
                    t = last.get(op[1], 0)
                    if t % 2 == op[2]:
                        t += 1
                    last[op[1]] = t
                    code[i] = ("wait", op[1], op[2], t, op[3])
                    self.wait_sites[op[1]].setdefault(t, []).append((p, i))
        self.fut_wait, self.fut_arrive = [], []
        for code in self.code:
            fw, fa = [frozenset()], [frozenset()]
            for op in reversed(code):
                w, a = set(fw[-1]), set(fa[-1])
                k = op[0]
                if k == "wait":
                    w.add(("b", op[1]))
                elif k == "nwait":
                    w.add(("n", op[1]))
                elif k in ("arrive", "expect"):
                    a.add(("b", op[1]))
                elif k == "narrive":
                    a.add(("n", op[1]))
                elif k == "commit":
                    a.update(("b", b) for b in op[1])
                elif k == "tma":
                    a.add(("b", op[2]))
                elif k == "bulk":
                    a.add(("b", op[3]))
                fw.append(frozenset(w))
                fa.append(frozenset(a))
            self.fut_wait.append(fw[::-1])
            self.fut_arrive.append(fa[::-1])
        return self


def _op_regions(op):
    kind = op[0]
    if kind == "mma" or kind == "access":
        return list(op[1]) + list(op[2])
    if kind == "tma":
        return [op[1]]
    if kind == "bulk":
        return [op[1], op[2]]
    return []


# ------------------------------------------------------------------------------------------------
# exhaustive exploration
# ------------------------------------------------------------------------------------------------
class Violation(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass
class Result:
    kernel: str
    blocks: int
    tiles: int
    states: int
    ok: bool
    kind: str = ""               # deadlock | race | overrun | overflow | leftover | state-limit
    message: str = ""
    trace: list = field(default_factory=list)
    walks: tuple = ()            # persistent: the key blocks each work tile of the CTA walks

    def report(self, tail: int = 40) -> str:
        tiles = f" tiles={self.tiles}" if self.tiles else ""
        if self.walks:
            tiles += f" persistent={len(self.walks)} work tiles ({' + '.join(map(str, self.walks))} key blocks)"
        head = (f"{self.kernel}: blocks={self.blocks}{tiles}: {self.states} states explored: "
                + ("OK (no deadlock, no race)" if self.ok else f"{self.kind.upper()}"))
        if self.ok:
            return head
        steps = self.trace[-tail:]
        skipped = len(self.trace) - len(steps)
        lines = [head, self.message, f"trace ({len(self.trace)} steps" +
                 (f", last {len(steps)} shown" if skipped else "") + "):"]
        lines += [f"  {skipped + i + 1:5d}  {s}" for i, s in enumerate(steps)]
        return "\n".join(lines)


def _join(a, b):
    return tuple(x if x >= y else y for x, y in zip(a, b))


class Explorer:
    """Depth-first search over the interleavings, states hashed (the module docstring: Search).

    State: (pcs, barriers, named barriers, named-barrier tokens, MMA queues, copies in flight,
    vector clocks, cells). A barrier is (completed phases, arrivals, tx units, clock of the phase
    being filled, clocks of the completed phases); a named barrier (arrivals, generation, clock
    being filled, clock of the last release); a cell (last write, reads since). An epoch is
    (clock component, value): roles, then tensor cores, then one component per copy (its landing).
    The state graph is acyclic: every step advances a program counter, an MMA queue or a copy."""

    def __init__(self, comp: Compiled, max_states: int = 2_000_000, reduce: bool = True):
        self.c, self.max_states, self.reduce = comp, max_states, reduce
        self.R, self.T = len(comp.roles), comp.ntc
        self.ncomp = self.R + self.T + len(comp.copies)
        self.zero = (0,) * self.ncomp

    def initial(self):
        c = self.c
        bars = tuple((0, 0, 0, self.zero, ()) for _ in c.bars)
        named = tuple((0, 0, self.zero, self.zero) for _ in c.named)
        cells = tuple((None, ()) for _ in c.cell_names)
        vcs = tuple(self.zero for _ in range(self.R + self.T))
        return ((0,) * self.R, bars, named, (0,) * self.R, ((),) * self.T, (), vcs, cells)

    # ----------------------------------------------------------------------------- naming
    def _proc(self, p):
        return self.c.procs[p]

    def _epoch_where(self, ep) -> str:
        comp, val = ep
        if comp < self.R:
            return f"{self._proc(comp)} at {self.c.code[comp][val - 1][-1]}"
        if comp < self.R + self.T:
            return f"{self._proc(comp)} (MMA #{val})"
        p, i = self.c.copies[comp - self.R - self.T]
        return f"the copy issued by {self._proc(p)} at {self.c.code[p][i][-1]}"

    def _bn(self, b):
        return self.c.prog.bar_name(self.c.bars[b])

    # ----------------------------------------------------------------------------- checks
    def _check(self, cells, vc, ep, reads, writes, who, flying=()):
        """Reads must follow the last write, writes the last write and every read since."""
        busy = {}
        for f in flying:
            for i in f[0]:
                busy[i] = "into"
            for i in f[1]:
                busy.setdefault(i, "from")
        cells = list(cells)
        for i in reads:
            lw, rs = cells[i]
            if busy.get(i) == "into":
                raise Violation("race", f"{who} reads {self.c.cell_label(i)} while a copy into it is in flight")
            if lw is not None and vc[lw[0]] < lw[1]:
                raise Violation("race", f"{who} reads {self.c.cell_label(i)}, not ordered after its write by "
                                        f"{self._epoch_where(lw)}")
            cells[i] = (lw, tuple(r for r in rs if r[0] != ep[0]) + (ep,))
        for i in writes:
            lw, rs = cells[i]
            if i in busy:
                raise Violation("race", f"{who} writes {self.c.cell_label(i)} while a copy {busy[i]} it is in flight")
            if lw is not None and lw[0] != ep[0] and vc[lw[0]] < lw[1]:
                raise Violation("race", f"{who} overwrites {self.c.cell_label(i)}, not ordered after its write "
                                        f"by {self._epoch_where(lw)}")
            for r in rs:
                if r[0] != ep[0] and vc[r[0]] < r[1]:
                    raise Violation("race", f"{who} overwrites {self.c.cell_label(i)} before the read by "
                                            f"{self._epoch_where(r)} is ordered before it")
            cells[i] = (ep, ())
        return tuple(cells)

    def _arrive(self, bars, b, n, vc, tx, who, pcs):
        cnt = self.c.counts[b]
        if n > cnt:
            raise Violation("overflow", f"{who}: {n} arrivals in one step on {self._bn(b)} (count {cnt})")
        ph, a, t, acc, done = bars[b]
        a, t, acc = a + n, t + tx, _join(acc, vc)
        if a >= cnt and t == 0:
            # completion ph + 1: every wait for completion ph must be ordered before it, or in some
            # run the barrier laps that waiter (its parity test then sees the wrong phase)
            for p, i in self.c.wait_sites[b].get(ph, ()):
                if pcs[p] <= i or acc[p] < i + 1:
                    raise Violation("overrun", f"{who} completes phase {ph + 1} of {self._bn(b)}, not ordered "
                                               f"after {self._proc(p)}'s wait for phase {ph} at "
                                               f"{self.c.code[p][i][-1]}: the barrier can lap that waiter")
            ph, a, done, acc = ph + 1, a - cnt, done + (acc,), self.zero
        return bars[:b] + ((ph, a, t, acc, done),) + bars[b + 1:]

    # ----------------------------------------------------------------------------- steps
    def _next(self, st, p):
        """(op, enabled) of role p, or None when it has finished."""
        pcs, bars, named, ntok = st[0], st[1], st[2], st[3]
        code = self.c.code[p]
        if pcs[p] >= len(code):
            return None
        op = code[pcs[p]]
        if op[0] == "wait":
            return op, bars[op[1]][0] >= op[3]
        if op[0] == "nwait":
            return op, named[op[1]][1] > ntok[p]
        return op, True

    def successors(self, st):
        """[(step, state)]: one eager step, or the enabled steps of the smallest persistent set."""
        nxt = [self._next(st, p) for p in range(self.R)]
        if not self.reduce:
            return [self._step(st, step) for step in self._enabled(st, nxt)]
        for p, n in enumerate(nxt):
            if n is not None and n[1] and n[0][0] in ("access", "mma", "tma", "bulk", "commit", "wait", "nwait"):
                return [self._step(st, ("role", p))]
        tcq = st[4]
        for t, q in enumerate(tcq):
            if q and q[0][0] == "mma":
                return [self._step(st, ("tc", t))]
        best = None
        for seed in self._enabled(st, nxt):
            s = self._persistent(st, nxt, seed)
            if best is None or len(s) < len(best):
                best = s
            if len(best) == 1:
                break
        return [self._step(st, step) for step in (best or [])]

    def _enabled(self, st, nxt):
        out = [("role", p) for p, n in enumerate(nxt) if n is not None and n[1]]
        out += [("tc", t) for t, q in enumerate(st[4]) if q]
        out += [("land", f[4]) for f in st[5]]
        return out

    def _touches(self, st, nxt, proc):
        """(barriers it may still wait on, barriers it may still arrive on, its next step's)."""
        kind, i = proc
        if kind == "role":
            pc = st[0][i]
            return self.c.fut_wait[i][pc], self.c.fut_arrive[i][pc]
        if kind == "tc":
            return frozenset(), frozenset(("b", b) for item in st[4][i] if item[0] == "commit" for b in item[1])
        f = next(f for f in st[5] if f[4] == i)
        return frozenset(), frozenset({("b", f[2])})

    def _completes(self, st, key, n, tx=0):
        """Would n arrivals (tx change) on barrier `key` finish its phase now? Arrivals that do not
        commute with every wait (they change neither the phase nor its clock)."""
        kind, b = key
        if kind == "n":
            arrived, *_r = st[2][b]
            return arrived + n >= self.c.named_expected[b]
        ph, a, t, *_r = st[1][b]
        return a + n >= self.c.counts[b] and t + tx == 0

    def _now(self, st, nxt, proc):
        """The barriers the process's next step waits on / completes a phase of."""
        kind, i = proc
        if kind == "role":
            if nxt[i] is None:
                return (), ()
            op = nxt[i][0]
            if op[0] == "wait":
                return (("b", op[1]),), ()
            if op[0] == "nwait":
                return (("n", op[1]),), ()
            if op[0] in ("arrive", "expect"):
                key = ("b", op[1])
                return (), (key,) if self._completes(st, key, op[2], op[3] if op[0] == "expect" else 0) else ()
            if op[0] == "narrive":
                key = ("n", op[1])
                return (), (key,) if self._completes(st, key, op[3]) else ()
            return (), ()
        if kind == "tc":
            item = st[4][i][0]
            if item[0] != "commit":
                return (), ()
            return (), tuple(("b", b) for b in item[1] if self._completes(st, ("b", b), item[2]))
        f = next(f for f in st[5] if f[4] == i)
        return (), (("b", f[2]),) if self._completes(st, ("b", f[2]), 0, -1) else ()

    def _persistent(self, st, nxt, seed):
        procs = [("role", p) for p in range(self.R)] + [("tc", t) for t in range(self.T)] + \
            [("land", f[4]) for f in st[5]]
        fut = {q: self._touches(st, nxt, q) for q in procs}
        member, work = {seed}, [seed]
        while work:
            q = work.pop()
            waits, arrives = self._now(st, nxt, q)
            for r in procs:
                if r in member:
                    continue
                fa = fut[r][1]
                if any(b in fa for b in waits) or any(b in fa for b in arrives):
                    member.add(r)
                    work.append(r)
        enabled = set(self._enabled(st, nxt))
        return [q for q in procs if q in member and q in enabled]

    def _step(self, st, step):
        try:
            if step[0] == "role":
                return step, self._role_step(st, step[1])
            if step[0] == "tc":
                return step, self._tc_step(st, step[1])
            return step, self._land(st, step[1])
        except Violation as v:
            v.step = (step, st)
            raise

    def _role_step(self, st, p):
        pcs, bars, named, ntok, tcq, flying, vcs, cells = st
        op = self.c.code[p][pcs[p]]
        kind = op[0]
        vc = vcs[p][:p] + (pcs[p] + 1,) + vcs[p][p + 1:]
        ep = (p, pcs[p] + 1)
        who = f"{self._proc(p)} at {op[-1]}"
        if kind == "wait":
            if op[3]:
                vc = _join(vc, bars[op[1]][4][op[3] - 1])
        elif kind == "arrive":
            bars = self._arrive(bars, op[1], op[2], vc, 0, who, pcs)
        elif kind == "expect":
            bars = self._arrive(bars, op[1], op[2], vc, op[3], who, pcs)
        elif kind == "access":
            cells = self._check(cells, vc, ep, op[1], op[2], who, flying)
        elif kind in ("mma", "commit"):
            item = (kind, op[1], op[2], vc, op[-1])
            tcq = tcq[:op[3]] + (tcq[op[3]] + (item,),) + tcq[op[3] + 1:]
        elif kind in ("tma", "bulk"):
            writes, reads, b, cid = (op[1], (), op[2], op[3]) if kind == "tma" else op[1:5]
            cells = self._check(cells, vc, ep, reads, writes, who, flying)
            k = self.R + self.T + cid
            lc = vc[:k] + (1,) + vc[k + 1:]
            flying = tuple(sorted(flying + ((writes, reads, b, lc, cid),), key=lambda f: f[4]))
        elif kind == "narrive":
            i = op[1]
            arrived, gen, acc, rel = named[i]
            arrived, acc = arrived + op[3], _join(acc, vc)
            if arrived > op[2]:
                raise Violation("overflow", f"{who}: named barrier {self.c.named[i]} gets {arrived} of "
                                            f"{op[2]} thread arrivals")
            ntok = ntok[:p] + (gen,) + ntok[p + 1:]
            if arrived == op[2]:
                arrived, gen, rel, acc = 0, gen + 1, acc, self.zero
            named = named[:i] + ((arrived, gen, acc, rel),) + named[i + 1:]
        elif kind == "nwait":
            vc = _join(vc, named[op[1]][3])
        vcs = vcs[:p] + (vc,) + vcs[p + 1:]
        pcs = pcs[:p] + (pcs[p] + 1,) + pcs[p + 1:]
        return (pcs, bars, named, ntok, tcq, flying, vcs, cells)

    def _tc_step(self, st, t):
        pcs, bars, named, ntok, tcq, flying, vcs, cells = st
        item = tcq[t][0]
        p = self.R + t
        vc = _join(vcs[p], item[3])
        vc = vc[:p] + (vc[p] + 1,) + vc[p + 1:]
        who = f"{self._proc(p)} executing the MMA issued at {item[-1]}"
        if item[0] == "mma":
            cells = self._check(cells, vc, (p, vc[p]), item[1], item[2], who, flying)
        else:
            for b in item[1]:
                bars = self._arrive(bars, b, item[2], vc, 0, who, pcs)
        tcq = tcq[:t] + (tcq[t][1:],) + tcq[t + 1:]
        return (pcs, bars, named, ntok, tcq, flying, vcs[:p] + (vc,) + vcs[p + 1:], cells)

    def _land(self, st, cid):
        pcs, bars, named, ntok, tcq, flying, vcs, cells = st
        k = next(j for j, f in enumerate(flying) if f[4] == cid)
        writes, reads, b, lc, _ = flying[k]
        flying = flying[:k] + flying[k + 1:]
        ep = (self.R + self.T + cid, 1)
        cells = list(cells)
        for i in writes:
            cells[i] = (ep, ())
        for i in reads:
            lw, rs = cells[i]
            cells[i] = (lw, rs + (ep,))
        bars = self._arrive(bars, b, 0, lc, -1, "a copy", pcs)
        return (pcs, bars, named, ntok, tcq, flying, vcs, tuple(cells))

    # ----------------------------------------------------------------------------- reporting
    def describe(self, step, st) -> str:
        kind, i = step
        if kind == "role":
            op = self.c.code[i][st[0][i]]
            return f"{self._proc(i)}: {self._describe(op)}  [{op[-1]}]"
        if kind == "tc":
            item = st[4][i][0]
            if item[0] == "mma":
                return f"{self._proc(self.R + i)}: execute MMA issued at {item[-1]}"
            return (f"{self._proc(self.R + i)}: commit (issued at {item[-1]}) arrives on "
                    + ", ".join(self._bn(b) for b in item[1]))
        p, j = self.c.copies[i]
        f = next(f for f in st[5] if f[4] == i)
        return (f"copy issued by {self._proc(p)} at {self.c.code[p][j][-1]} lands in "
                + self.c.cells_text(f[0]) + f"; tx on {self._bn(f[2])}")

    def _describe(self, op):
        cl = lambda cs: self.c.cells_text(cs) or "-"  # noqa: E731
        bn = self._bn
        text = {
            "wait": lambda: f"wait {bn(op[1])} parity {op[2]}",
            "arrive": lambda: f"arrive {bn(op[1])} x{op[2]}",
            "expect": lambda: f"arrive + expect_tx {bn(op[1])} x{op[2]} ({op[3]} copies)",
            "commit": lambda: "issue commit -> " + ", ".join(bn(b) for b in op[1]),
            "mma": lambda: f"issue MMA reading {cl(op[1])}, writing {cl(op[2])}",
            "tma": lambda: f"issue TMA load -> {cl(op[1])} on {bn(op[2])}",
            "bulk": lambda: f"issue bulk copy {cl(op[2])} -> {cl(op[1])} on {bn(op[3])}",
            "access": lambda: f"read {cl(op[1])}; write {cl(op[2])}",
            "narrive": lambda: f"named barrier {self.c.named[op[1]]} arrive x{op[3]} (of {op[2]})",
        }.get(op[0])
        return text() if text else f"named barrier {self.c.named[op[1]]} wait"

    def _final_check(self, st):
        for i, (arrived, *_r) in enumerate(st[2]):
            if arrived:
                raise Violation("leftover", f"named barrier {self.c.named[i]} ends with {arrived} thread "
                                            f"arrivals that no barrier consumed")
        for b, (ph, a, t, *_r) in enumerate(st[1]):
            if a or t:
                raise Violation("leftover", f"mbarrier {self._bn(b)} ends with {a} of {self.c.counts[b]} "
                                            f"arrivals (tx {t}) in an unfinished phase")

    def _deadlock(self, st):
        lines = []
        for p in range(self.R):
            code = self.c.code[p]
            if st[0][p] < len(code):
                op = code[st[0][p]]
                lines.append(f"  {self._proc(p)} blocked at op {st[0][p]}: {self._describe(op)}  [{op[-1]}]")
        blocked_on = {code[st[0][p]][1] for p, code in enumerate(self.c.code)
                      if st[0][p] < len(code) and code[st[0][p]][0] == "wait"}
        for b, (ph, a, t, *_r) in enumerate(st[1]):
            if a or t or b in blocked_on:
                lines.append(f"  {self._bn(b)}: {ph} phases completed"
                             + (f", {a} of {self.c.counts[b]} arrivals, tx {t} pending" if a or t else ""))
        return "no role can move:\n" + "\n".join(lines)

    def run(self):
        """(states, Violation | None, trace of step descriptions)."""
        start = self.initial()
        seen = {start}
        stack = [(start, None)]
        while stack:
            st, trace = stack.pop()
            try:
                succ = self.successors(st)
            except Violation as v:
                step, at = v.step
                return len(seen), v, _unwind(trace) + [self.describe(step, at) + "   <-- here"]
            if not succ:
                if any(st[0][p] < len(self.c.code[p]) for p in range(self.R)):
                    return len(seen), Violation("deadlock", self._deadlock(st)), _unwind(trace)
                try:
                    self._final_check(st)
                except Violation as v:
                    return len(seen), v, _unwind(trace)
                continue
            for step, nst in succ:
                if nst not in seen:
                    seen.add(nst)
                    if len(seen) > self.max_states:
                        return len(seen), Violation("state-limit", f"more than {self.max_states} states"), []
                    stack.append((nst, (self, step, st, trace)))
        return len(seen), None, []


def _unwind(trace):
    """The trace is a linked list (explorer, step, state before it, parent); describe it lazily."""
    out = []
    while trace is not None:
        ex, step, st, trace = trace
        out.append(ex.describe(step, st))
    return out[::-1]


def explore(prog: Program, max_states: int = 2_000_000, blocks: int = 0, tiles: int = 0,
            reduce: bool = True) -> Result:
    """Every interleaving of the extracted program; the first violation found, with its trace.
    reduce=False turns the partial-order reduction off (every interleaving, for cross-checking)."""
    comp = Compiled(prog).assign_tx()
    ex = Explorer(comp, max_states, reduce)
    n, v, trace = ex.run()
    walks = tuple(trip["n_blocks"] for trip in prog.spec.tile_loop)
    if v is None:
        return Result(prog.spec.name, blocks, tiles, n, True, walks=walks)
    return Result(prog.spec.name, blocks, tiles, n, False, v.kind, v.message, trace, walks=walks)


# ------------------------------------------------------------------------------------------------
# the per-kernel mappings
# ------------------------------------------------------------------------------------------------
def bar_names(kernel, names_counts) -> dict:
    out = {}
    for name, n in names_counts:
        for i in range(n):
            out[kernel._bar(BarPtr(0), name, i).off] = name if n == 1 else f"{name}[{i}]"
    return out


def persistent_walks(blocks: int, work_tiles: int) -> list:
    """The key blocks of each work tile in a persistent check: blocks - 1 for even k, blocks for odd k."""
    return [max(1, blocks - 1 if k % 2 == 0 else blocks) for k in range(work_tiles)]


def forward_spec(blocks: int = 4, tiles: int | None = None, head_dim: int = 128, persistent: int = 0,
                 varlen: bool = False) -> KernelSpec:
    """stage3_fwd_kernel/blackwell_fwd.py (+ blackwell_load_mma.py, blackwell_softmax.py,
    blackwell_output.py): 2 softmax WGs, correction WG,
    MMA / load / epilogue / idle warps; `blocks` key blocks. The kernel's CTA holds 2 Q tiles, or 1 at
    head_dim 256 (one softmax WG; warpgroup 1 idles and is a role too); tiles None: the build's.
    persistent = N > 0: the persistent build (+ blackwell_persistent.py), N work tiles per CTA of
    persistent_walks(blocks, N) key blocks. varlen: the varlen build, whose load warp zeroes the last
    V's rows past the sequence's keys between its own v_tail barrier and kv_full (blackwell_paged.py)."""
    from stage3_fwd_kernel import tile_scheduler
    from stage3_fwd_kernel.blackwell_config import q_tiles_for
    from stage3_fwd_kernel.blackwell_fwd import FlashAttentionForwardSm100, make_config

    cfg = make_config("bf16", head_dim, head_dim, False, q_tiles_per_cta=q_tiles_for(head_dim))
    tiles = cfg.q_tiles_per_cta if tiles is None else tiles
    if tiles != cfg.q_tiles_per_cta:
        raise ValueError(f"the forward CTA holds {cfg.q_tiles_per_cta} Q tiles (one per softmax warpgroup)")
    sched = tile_scheduler.PersistentScheduler() if persistent else tile_scheduler.StaticTileScheduler
    k = FlashAttentionForwardSm100(cfg, varlen=varlen, scheduler=sched)
    t, r = cfg.tmem, cfg.roles
    S = [tmem(t.s[i], t.s[i] + t.s_cols) for i in range(k.num_q)]
    O = [tmem(t.o[i], t.o[i] + t.o_cols) for i in range(k.num_q)]
    P = [tmem(t.p[i], t.p[i] + t.p_cols) for i in range(k.num_q)]
    roles = [Role(f"softmax{i}", w[0], 128) for i, w in enumerate(r.softmax)]
    if r.idle_warpgroup is not None:
        roles.append(Role("idle_wg", 4 * r.idle_warpgroup, 128))
    roles += [Role("correction", r.correction[0], 128), Role("mma", r.mma, 32), Role("load", r.load, 32),
              Role("epilogue", r.epilogue, 32), Role("idle", r.idle, 32)]
    names = {
        "tmem_ptr": RegionPtr(tmem(0, 512)), "sO": smem("sO"),
        "load:tQsQ": smem("sQ"), "load:tKsK": smem("sKV"), "load:tVsV": smem("sKV"), "load:sV": smem("sKV"),
        "mma:tSrQ": smem("sQ"), "mma:tSrK": smem("sKV"), "mma:tOrV": smem("sKV"),
        "mma:tStS": S, "mma:tOtO": O, "mma:tOrP": P,
        "softmax:tStS": lambda env: S[env["stage"]],
        "correction:tStS": S, "correction:tOtO": O, "epilogue:tOsO": smem("sO"),
    }
    if varlen:  # the varlen epilogue's tOsO is tile i's slice of sO (made by varlen_o_partitions)
        names["epilogue:tOsO"] = lambda env: smem("sO", env["i"])
    per_q = k.PER_Q_BARRIERS + (k.PERSISTENT_BARRIERS if persistent else ())
    bars = bar_names(k, [(n, k.num_q) for n in per_q] + [("kv_full", k.stages), ("kv_empty", k.stages),
                                                          ("tmem_dealloc", 1)]
                     + ([("v_tail", 1)] if varlen else []))
    trips = [{"n_blocks": n, "n_unmasked": n} for n in persistent_walks(blocks, persistent)]
    return KernelSpec(("fwd" if not persistent else "fwd-persistent") + ("-varlen" if varlen else ""), k, roles,
                      {"n_blocks": blocks, "tile_valid": True, "n_unmasked": blocks, "num_k": cfg.tile_n // 16},
                      names, {"tStP_r2t": cfg.p_store_chunks, "tOrP": cfg.tile_n // 16}, cfg.num_threads,
                      smem_alias={"sO": "sQ"} if cfg.smem.o_overlaps_q else {}, bar_names=bars, tile_loop=trips)


def forward_2cta_spec(blocks: int = 4, head_dim: int = 128) -> KernelSpec:
    """stage3_fwd_kernel/blackwell_fwd_2cta.py: a cluster of 2 CTAs, each the 1-CTA forward's roles
    (softmax x 2, correction, epilogue: blackwell_softmax.py unchanged); pair MMAs issued by CTA 0's
    MMA warp, CTA 1's MMA warp relays its p_full / p_full_2 to CTA 0; 2-SM TMA of Q / K / V halves;
    `blocks` key blocks (non-causal: both CTAs walk the same). Imported at call time."""
    from stage3_fwd_kernel.blackwell_fwd_2cta import PER_Q, FlashAttentionForwardSm100TwoCta, make_config

    cfg = make_config("bf16", head_dim, head_dim, False)
    k = FlashAttentionForwardSm100TwoCta(cfg)
    t, r = cfg.tmem, cfg.roles
    S = [tmem(t.s[i], t.s[i] + t.s_cols) for i in range(k.num_q)]
    O = [tmem(t.o[i], t.o[i] + t.o_cols) for i in range(k.num_q)]
    P = [tmem(t.p[i], t.p[i] + t.p_cols) for i in range(k.num_q)]
    roles = []
    for c in range(2):
        roles += [Role(f"softmax{i}.{c}", w[0], 128, c) for i, w in enumerate(r.softmax)]
        roles += [Role(f"correction.{c}", r.correction[0], 128, c),
                  Role(f"{'mma' if c == 0 else 'relay'}.{c}", r.mma, 32, c), Role(f"load.{c}", r.load, 32, c),
                  Role(f"epilogue.{c}", r.epilogue, 32, c), Role(f"idle.{c}", r.idle, 32, c)]
    names = {
        "tmem_ptr": RegionPtr(tmem(0, 512)), "sO": smem("sO"),
        "load_pair:tQsQ": smem("sQ"), "load_pair:tKsK": smem("sKV"), "load_pair:tVsV": smem("sKV"),
        "mma_pair:tSrQ": smem("sQ"), "mma_pair:tSrK": smem("sKV"), "mma_pair:tOrV": smem("sKV"),
        "mma_pair:tStS": S, "mma_pair:tOtO": O, "mma_pair:tOrP": P,
        "softmax:tStS": lambda env: S[env["stage"]],
        "correction:tStS": S, "correction:tOtO": O, "epilogue:tOsO": smem("sO"),
    }
    bars = bar_names(k, [(n, k.num_q) for n in PER_Q] + [("kv_full", k.stages), ("kv_empty", k.stages),
                                                          ("tmem_dealloc", 1), ("tmem_pair", 1)])
    return KernelSpec("fwd2cta", k, roles, {"n_blocks": blocks, "n_unmasked": blocks, "num_k": cfg.tile_n // 16},
                      names, {"tStP_r2t": cfg.p_store_chunks, "tOrP": cfg.tile_n // 16}, cfg.num_threads,
                      ctas=2, pair_mma=True, bar_names=bars)


# the kernels this module checks; stage 4's backward kernels have theirs in
# stage4_bwd_kernel/blackwell_protocol.py (stage 3 does not import stage 4)
SPECS = {"fwd": forward_spec, "fwd2cta": forward_2cta_spec}


def build(kernel: str, blocks: int = 4, tiles: int | None = None, persistent: int = 0,
          head_dim: int = 128) -> Program:
    """The extracted Program of `kernel` ("fwd", "fwd2cta") for the given trip counts;
    persistent = N > 0: the persistent forward, N work tiles per CTA; head_dim: the forward's build
    (256: one Q tile per CTA)."""
    if kernel == "fwd":
        return extract(forward_spec(blocks, tiles, head_dim=head_dim, persistent=persistent))
    if head_dim != 128:
        raise ValueError("head_dim: only the forward (--kernel fwd) is checked at other head dims here")
    if persistent:
        raise ValueError("persistent: only the forward (--kernel fwd) has a persistent build")
    return extract(SPECS[kernel](blocks))


def check(kernel: str, blocks: int = 4, tiles: int | None = None, max_states: int = 2_000_000, persistent: int = 0,
          head_dim: int = 128) -> Result:
    prog = build(kernel, blocks, tiles, persistent, head_dim)
    return explore(prog, max_states, blocks, _fwd_tiles(prog) if kernel == "fwd" else 0)


def _fwd_tiles(prog: "Program") -> int:
    """The Q tiles per CTA of an extracted forward (for the report)."""
    return prog.spec.kernel.num_q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(SPECS), default="fwd")
    ap.add_argument("--blocks", type=int, default=4, help="main-loop trips: key blocks")
    ap.add_argument("--tiles", type=int, default=None, help="Q tiles per CTA (fwd; the build's: 2, 1 at head dim 256)")
    ap.add_argument("--head-dim", type=int, default=128, help="fwd: the build's head dim (64, 96, 128; 256 = one Q "
                    "tile per CTA)")
    ap.add_argument("--persistent", type=int, default=0, metavar="N",
                    help="fwd: the persistent build, N work tiles per CTA (blocks - 1, blocks, ... key blocks)")
    ap.add_argument("--max-states", type=int, default=2_000_000)
    ap.add_argument("--ops", action="store_true", help="print the extracted operations per role")
    a = ap.parse_args(argv)
    prog = build(a.kernel, a.blocks, a.tiles, a.persistent, a.head_dim)
    return run_and_report(prog, a.kernel, a.blocks, _fwd_tiles(prog) if a.kernel == "fwd" else 0, a.max_states, a.ops)


def run_and_report(prog: Program, name: str, blocks: int, tiles: int, max_states: int, show_ops: bool) -> int:
    """The command line's report of one extracted program: its summary (and operations), then the
    search's verdict; the exit code (0: no violation)."""
    print(f"extracted from source ({name}):\n{prog.summary()}")
    if show_ops:
        for role, ops in prog.ops.items():
            print(f"-- {role}")
            for op in ops:
                print("   ", op)
    res = explore(prog, max_states, blocks, tiles)
    print(res.report())
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
