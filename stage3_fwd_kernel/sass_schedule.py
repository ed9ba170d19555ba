"""A static issue-cycle estimate of a SASS loop, read from the scheduling control bits that ptxas
writes into every instruction (sm_70 and later, sm_100a included). COMPILE-ONLY: nothing here ran on
a GPU; the numbers say what the schedule encodes, not what the hardware does.

Every sm_7x+ instruction is one 128-bit word. Its top 23 bits (105..127; bits 41..63 of the upper
64-bit half, which ``nvdisasm -hex`` prints on the line after the instruction) are control bits, low
to high: stall (4 bits, cycles until the warp may issue its next instruction), yield (1 bit;
CuAssembler prints "Y" when it is 0), write scoreboard (3 bits: the scoreboard 0..5 the result
releases, 7 = none), read scoreboard (3 bits: released once the sources are read, 7 = none), wait
mask (6 bits: scoreboards that must be released before issue), reuse (4 bits, operand-reuse cache).
Layout from Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking"
(arXiv:1804.06826, its control-information table) and CuAssembler (``CuAsm/common.py``
``decodeCtrlCodes``; ``CuSMVersion.splitControlCodes_7x_8x``: control = upper half >> 41). Those
describe sm_70 - sm_86; that sm_100a keeps the layout is checked, not documented:
``tests/test_sass_schedule.py`` finds on this ptxas's output no scoreboard index 6, every waited-on
scoreboard set somewhere, the S row's LDTM results waited on before the row max, and most stalls
1 or 2 cycles (a misplaced field would spread them).

What the estimate is: the sum of stall counts along a path through one loop iteration = the cycles
one warp needs to issue it when no scoreboard wait blocks, no pipe is busy and no other warp takes
the issue slot. What it cannot see: how long a scoreboard wait lasts (variable-latency results:
MUFU, LDTM, shared memory), barrier waits (BAR.SYNC, mbarrier try-waits), pipe throughput
(``mufu_cycles`` adds the MUFU pipe's own bound) and the other warps on the same sub-partition.

    python -m stage3_fwd_kernel.sass_schedule [--head_dim 128] [--dtype bf16] [--rows]

compiles the Blackwell forward (non-causal and causal) and prints its softmax loops beside a key
block's MMA cycles. The same measure costed the softmax warpgroups' exp2 turn (a named-barrier
ping-pong) before it was removed: its BAR.SYNC .. BAR.ARV section (``turn_cycles``) was ~1210 cycles,
two in series more than the 2048 MMA cycles at d = 128 (docs/measurements.md, 2026-11-29).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from stage2_emulated_exp.sass import find_nvdisasm
from stage3_fwd_kernel import sass_report

CONTROL_SHIFT = 41          # control bits start at bit 105 of 128 = bit 41 of the upper half
NO_SCOREBOARD = 7
MUFU_LANES_PER_SMSP = 4     # MUFU.EX2 16 / clock / SM (roofline.py) over 4 sub-partitions
BARRIER_OPS = ("BAR", "SYNCS", "DEPBAR")   # named barriers, mbarrier ops, explicit scoreboard waits


@dataclass(frozen=True)
class Control:
    stall: int
    yield_hint: bool
    write_sb: int           # 0..5, or NO_SCOREBOARD
    read_sb: int
    wait_mask: int          # bit i: waits for scoreboard i
    reuse: int


def decode_control(upper: int) -> Control:
    """The control bits of one instruction from the upper 64 bits of its encoding."""
    c = upper >> CONTROL_SHIFT
    return Control(stall=c & 0xF, yield_hint=not (c >> 4) & 1, write_sb=(c >> 5) & 7, read_sb=(c >> 8) & 7,
                   wait_mask=(c >> 11) & 0x3F, reuse=(c >> 17) & 0xF)


@dataclass(frozen=True)
class Row:
    """One instruction of a loop: its place in the loop, its text and control bits."""
    index: int              # within the loop's inline part
    text: str
    op: str
    ctrl: Control
    on_path: bool           # on the longest iteration path


# ---------------------------------------------------------------------------------- the listing
_ENC_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+.*;\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_ENC_UPPER = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")


def disassemble_encoded(cubin: bytes) -> str:
    """SASS with encodings (``nvdisasm -c -hex``): each instruction line carries its lower 64 bits,
    the next line the upper 64. RuntimeError without nvdisasm."""
    tool = find_nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-c", "-hex", path], capture_output=True, text=True, check=True,
                              timeout=300).stdout
    finally:
        os.unlink(path)


def controls(listing: str) -> list:
    """Control of every instruction, in sass_report.parse_sass's order (so a SassLoop's `start`
    indexes it). ValueError when the listing carries no encodings or they do not pair up."""
    out, pending = [], False
    for line in listing.splitlines():
        if _ENC_INSN.match(line):
            if pending:
                raise ValueError(f"no upper half before: {line.strip()}")
            pending = True
        elif pending and _ENC_UPPER.match(line):
            out.append(decode_control(int(_ENC_UPPER.match(line).group(1), 16)))
            pending = False
    insns, _ = sass_report.parse_sass(listing)
    if pending or len(out) != len(insns):
        raise ValueError(f"{len(out)} encodings for {len(insns)} instructions: not an `nvdisasm -hex` listing?")
    return out


# ----------------------------------------------------------------------------- one iteration's paths
def _inline_blocks(listing: str, loop) -> tuple:
    """(blocks [start, end) of the loop's inline part, successors within it, the header's and the
    back edges' sources' block numbers). Edges into out-of-line retry stubs are dropped: a stub
    returns to the code after its branch, which the fall-through edge already reaches."""
    insns, labels = sass_report.parse_sass(listing)
    blocks, succ = sass_report.control_flow_graph(insns, labels)
    first, last = loop.start, loop.start + len(loop.ops)
    inside = [k for k, (s, e) in enumerate(blocks) if first <= s and e <= last]
    if not inside or blocks[inside[0]][0] != first or blocks[inside[-1]][1] != last:
        raise ValueError("the loop's inline part does not start and end on block boundaries")
    # the header: the one block of a natural loop entered from outside it
    entered = {v for u in range(len(blocks)) if u not in loop.blocks for v in succ[u]}
    header = next((k for k in inside if k in entered), inside[0])
    keep = set(inside)
    edges = {k: {v for v in succ[k] if v in keep and v != header} for k in inside}
    back = [u for u in inside if header in succ[u]]
    return blocks, edges, header, back


def _longest(blocks, edges, header, back, weight, sign=1):
    """The path header -> a back-edge source of largest (sign=1) or smallest (sign=-1) weight, as a
    list of block numbers. The inline blocks without the back edges must be acyclic (an innermost loop)."""
    order, state = [], {}

    def visit(b):  # iterative DFS, postorder; a grey node met again is a cycle
        stack = [(b, iter(sorted(edges[b])))]
        state[b] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                order.append(node)
                stack.pop()
            elif state.get(nxt) == 1:
                raise ValueError("the loop's inline part has an inner cycle: not an innermost loop")
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges[nxt]))))
    visit(header)
    best, prev = {header: sign * weight(header)}, {header: None}
    for b in reversed(order):
        if b not in best:
            continue
        for v in edges[b]:
            cand = best[b] + sign * weight(v)
            if v not in best or cand > best[v]:
                best[v], prev[v] = cand, b
    ends = [u for u in back if u in best]
    if not ends:
        raise ValueError("no back edge reachable from the header")
    end = max(ends, key=best.get)
    path = []
    while end is not None:
        path.append(end)
        end = prev[end]
    return path[::-1]


# --------------------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class LoopSchedule:
    rows: tuple                 # Row per inline instruction, in address order
    stall_total: int            # every inline instruction (all branches taken through)
    stall_longest: int          # the longest header -> back-edge path
    stall_shortest: int         # the shortest (skippable blocks skipped)
    barriers: tuple             # (loop index, opcode, issue cycle on the longest path or None)
    waits_on_path: int          # instructions on the longest path with a scoreboard wait
    wait_producers: dict        # "OP (write|read)" -> waits on the path that it releases
    mufu: int                   # MUFU.EX2 in the loop
    turn_cycles: Optional[int]  # issue cycles from a BAR.SYNC to the next BAR.ARV on the longest path
    mufu_in_turn: Optional[int]  # MUFU.EX2 between them

    @property
    def mufu_cycles(self) -> int:
        """The MUFU pipe's bound for one warp's iteration: 32 lanes / MUFU_LANES_PER_SMSP a clock."""
        return self.mufu * 32 // MUFU_LANES_PER_SMSP

    def table(self, path_only: bool = False) -> str:
        """The per-instruction table: loop index, stall, yield, scoreboards, wait mask, text."""
        lines = ["  idx stall Y wr rd wait   text"]
        for r in self.rows:
            if path_only and not r.on_path:
                continue
            c = r.ctrl
            sb = lambda i: "-" if i == NO_SCOREBOARD else str(i)  # noqa: E731
            wait = "".join(str(i) if c.wait_mask >> i & 1 else "-" for i in range(6))
            lines.append(f"{'*' if r.on_path else ' '}{r.index:4d} {c.stall:5d} {'Y' if c.yield_hint else '-'} "
                         f"{sb(c.write_sb):>2} {sb(c.read_sb):>2} {wait} {r.text}")
        return "\n".join(lines)


def _producer_name(op: str) -> str:
    return op if op.startswith("MUFU") else op.split(".")[0]


def _wait_producers(path: list, insns: list, ctl: list) -> tuple:
    """(waiting instructions on the path, {producer: count}). A wait on scoreboard b is charged to
    the nearest earlier instruction on the path (wrapping round: loop-carried) that set b;
    "outside" when none on the path did (set before the loop, or in a skipped block)."""
    n, waits, producers = len(path), 0, {}
    for p, i in enumerate(path):
        mask = ctl[i].wait_mask
        if not mask:
            continue
        waits += 1
        for b in range(6):
            if not mask >> b & 1:
                continue
            name = "outside"
            for back in range(1, n + 1):
                j = path[(p - back) % n]
                if ctl[j].write_sb == b or ctl[j].read_sb == b:
                    kind = "write" if ctl[j].write_sb == b else "read"
                    name = f"{_producer_name(insns[j].op)} ({kind})"
                    break
            producers[name] = producers.get(name, 0) + 1
    return waits, dict(sorted(producers.items(), key=lambda kv: (-kv[1], kv[0])))


def loop_schedule(listing: str, loop) -> LoopSchedule:
    """The static schedule of one natural loop (a sass_report.SassLoop found in the same encoded
    listing): stall sums over every inline instruction and over the longest and shortest paths
    through one iteration, where the barrier instructions issue, and the scoreboard waits on the
    longest path with what they wait for."""
    insns, _ = sass_report.parse_sass(listing)
    ctl = controls(listing)
    blocks, edges, header, back = _inline_blocks(listing, loop)

    def weight(b):
        return sum(ctl[i].stall for i in range(*blocks[b]))
    longest = [i for b in _longest(blocks, edges, header, back, weight) for i in range(*blocks[b])]
    shortest = [i for b in _longest(blocks, edges, header, back, weight, -1) for i in range(*blocks[b])]
    on_path = set(longest)
    texts = loop.text.splitlines()
    first = loop.start
    rows = tuple(Row(i - first, texts[i - first], insns[i].op, ctl[i], i in on_path)
                 for i in range(first, first + len(loop.ops)))
    cycle, at = 0, {}
    for i in longest:
        at[i] = cycle
        cycle += ctl[i].stall
    barriers = tuple((r.index, r.op, at.get(r.index + first)) for r in rows
                     if r.op.split(".")[0] in BARRIER_OPS)
    waits, producers = _wait_producers(longest, insns, ctl)
    # a named-barrier section (a ping-pong turn): BAR.SYNC, then the next BAR.ARV
    ops = [insns[i].op for i in longest]
    sync = next((k for k, op in enumerate(ops) if op.startswith("BAR.SYNC")), None)
    arv = None if sync is None else next((k for k in range(sync, len(ops)) if ops[k].startswith("BAR.ARV")), None)
    turn = (None, None) if arv is None else \
        (at[longest[arv]] - at[longest[sync]], sass_report.opcode_count(ops[sync:arv], "MUFU.EX2"))
    return LoopSchedule(rows=rows, stall_total=sum(r.ctrl.stall for r in rows), stall_longest=cycle,
                        stall_shortest=sum(ctl[i].stall for i in shortest), barriers=barriers,
                        waits_on_path=waits, wait_producers=producers,
                        mufu=sass_report.opcode_count(loop.ops, "MUFU.EX2"), turn_cycles=turn[0],
                        mufu_in_turn=turn[1])


# ------------------------------------------------------------- the Blackwell forward's softmax loops
LOOPS = ("softmax_unmasked", "softmax_masked")


def forward_listing(cfg) -> tuple:
    """(resource report, encoded listing) of the Blackwell forward for `cfg` (dense, fake tensors,
    compiled for sm_100a)."""
    from stage3_fwd_kernel import blackwell_fwd as bw

    fn, report, _, _ = bw.compile_sm100(bw.FlashAttentionForwardSm100(cfg), bw.fake_args(cfg, False))
    return report, disassemble_encoded(fn.__cubin__)


def loop_summary(listing: str, tile_n: int = 128) -> dict:
    """{loop role: (SassLoop, LoopSchedule) or None} for the two softmax loops (blackwell_compare's rules)."""
    from stage3_fwd_kernel import blackwell_compare

    roles = blackwell_compare.role_loops(listing, tile_n)
    return {role: (roles[role][0], loop_schedule(listing, roles[role][0])) if roles[role][0] else None
            for role in LOOPS}


def _where(sched: LoopSchedule, n: int) -> str:
    """The BAR instructions' places: 'BAR.SYNC@100 (cycle 248), BAR.ARV@522 (cycle 1458) of 531'."""
    bars = [f"{op.split('.')[0]}.{op.split('.')[1]}@{i} (cycle {c})" for i, op, c in sched.barriers
            if op.startswith("BAR.")]
    return ", ".join(bars) + f" of {n}" if bars else "none"


def loop_table(head_dim: int = 128, dtype: str = "bf16", rows: bool = False) -> str:
    """Markdown: the softmax loops of the forward at (head_dim, dtype), non-causal and causal, against
    the MMA cycles of a key block; static counts and stall sums. RuntimeError on spills."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.roofline import forward_tile_cycles

    lines = [f"{dtype} d = {head_dim}, softmax loops (static SASS, compiled for sm_100a, never run)", "",
             "| build | loop | instructions | stall cycles (longest / shortest path) | MUFU.EX2 (pipe cycles) "
             "| waits on path | BAR instructions |",
             "|---|---|---:|---:|---:|---:|---|"]
    listings, builds, mma = [], [], None
    for causal in (False, True):
        cfg = bw.make_config(dtype, head_dim, causal=causal)
        mma = forward_tile_cycles(cfg.tile_m, cfg.tile_n, cfg.head_dim, d_v=cfg.head_dim_v).mma * cfg.q_tiles_per_cta
        report, listing = forward_listing(cfg)
        if report["spill_stores"] or report["spill_loads"] or report["stack_frame"]:
            raise RuntimeError(f"spills, causal={causal}: {report['ptxas_log'][-600:]}")
        name = "causal" if causal else "non-causal"
        builds.append(f"{name}: {report['registers']} registers at launch, spills {report['spill_stores']}"
                      f" / {report['spill_loads']} B")
        for role, found in loop_summary(listing, cfg.tile_n).items():
            if found is None:
                lines.append(f"| {name} | {role} | - | - | - | - | - |")
                continue
            lp, s = found
            lines.append(f"| {name} | {role} | {len(lp.ops)} | {s.stall_longest} / {s.stall_shortest} | "
                         f"{s.mufu} ({s.mufu_cycles}) | {s.waits_on_path} | {_where(s, len(lp.ops))} |")
            listings.append((name, role, s))
    lines.append("")
    lines.append(f"MMA per key block, both Q tiles (roofline.py, B200): {mma:.0f} cycles. "
                 "Stall cycles: one warp's issue latency per iteration with no waits; pipe cycles: one warp's "
                 f"MUFU.EX2 at {MUFU_LANES_PER_SMSP} lanes / clock / sub-partition. Builds: "
                 + "; ".join(builds) + ".")
    if rows:
        for name, role, s in listings:
            lines += ["", f"{name}, {role}:", s.table()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--rows", action="store_true", help="also print every loop's per-instruction table")
    a = ap.parse_args(argv)
    print(loop_table(a.head_dim, a.dtype, a.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
