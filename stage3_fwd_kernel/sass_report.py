"""What a compiled kernel holds: registers, spills and stack from ptxas, the SASS (nvdisasm) and
its instruction counts (HGMMA, MUFU.EX2, local-memory traffic), and the hot loops to read: by
label and backward branch for the Hopper kernels, by control flow (``natural_loops``) for sm_100.

The report is static (instructions in the code, not executed ones); it is what a compile-only
machine can say about a kernel, and what the compile-time tests check.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Optional

from stage2_emulated_exp.gpu_kernel import loop_listings, sass_opcodes
from stage2_emulated_exp.sass import disassemble as _disassemble

# the remark may wrap onto the next line; "(" starts the next remark
_WGMMA_SERIALIZED = re.compile(r"\((C75\d\d)\)[^(]{0,300}?serializ", re.IGNORECASE)


def wgmma_serialization(ptxas_log: str) -> list[str]:
    """The codes of ptxas's "wgmma ... serialized" remarks in a compile log (C7510, C7512, C7520, ...),
    in order, each once; [] when every wgmma stays asynchronous."""
    return list(dict.fromkeys(_WGMMA_SERIALIZED.findall(ptxas_log or "")))


def disassemble(cubin: bytes) -> str:
    """SASS text, or "" when nvdisasm is missing (the resource report then omits SASS counts)."""
    return _disassemble(cubin, required=False)


def _wgmma_loops(sass: str) -> list:
    """(opcodes, text) of every backward-branch loop (label .L_x_N ... BRA .L_x_N) holding an HGMMA,
    shortest first."""
    loops = ((sass_opcodes(text), text) for text in loop_listings(sass))
    return sorted((loop for loop in loops if any(op.startswith("HGMMA") for op in loop[0])), key=lambda x: len(x[0]))


def wgmma_loop_bodies(sass: str) -> list:
    """Opcodes of every backward-branch loop holding an HGMMA, shortest first: in the backward's step 3
    the first is the unmasked tile body, the walk's hot loop."""
    return [ops for ops, _ in _wgmma_loops(sass)]


def _key_block(sass: str) -> tuple:
    """(opcodes, text) of the shortest wgmma loop that also holds MUFU.EX2; ([], "") when none."""
    return next((loop for loop in _wgmma_loops(sass) if any(op.startswith("MUFU.EX2") for op in loop[0])), ([], ""))


def key_block_loop(sass: str) -> list:
    """Opcodes of a forward kernel's hot loop: the shortest wgmma loop that also holds MUFU.EX2, i.e.
    the unmasked key-block step (masked steps and outer tile loops are longer; a loop with wgmmas but
    no exponentials is not a softmax step). [] when there is none."""
    return _key_block(sass)[0]


def key_block_loop_listing(sass: str) -> str:
    """The same loop as text to read: one instruction per line, without addresses and encodings."""
    out = []
    for line in _key_block(sass)[1].splitlines():
        line = re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)).strip()
        if line:
            out.append(line)
    return "\n".join(out)


def _elf_register_count(cubin: bytes) -> Optional[int]:
    """Registers per thread from the cubin: the top byte of the kernel's .text section sh_info."""
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
            return None
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        strtab_off = sections[shstrndx][4]
        for sh in sections:
            name_end = cubin.index(b"\0", strtab_off + sh[0])
            name = cubin[strtab_off + sh[0]:name_end].decode()
            if name.startswith(".text.kernel"):
                return sh[7] >> 24
    except Exception:  # a report helper must never break a compile
        return None
    return None


def parse_resources(ptxas_log: str, sass: str, cubin: Optional[bytes]) -> dict:
    rep: dict = {}
    m = re.search(r"Used (\d+) registers", ptxas_log)
    rep["registers"] = int(m.group(1)) if m else (_elf_register_count(cubin) if cubin else None)
    rep["wgmma_serialized"] = wgmma_serialization(ptxas_log)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if m:
        rep["stack_frame"], rep["spill_stores"], rep["spill_loads"] = map(int, m.groups())
    else:
        rep["stack_frame"] = rep["spill_stores"] = rep["spill_loads"] = None
    rep.update(sass_counts(sass))
    rep["ptxas_log"] = ptxas_log
    return rep


def sass_counts(sass: Optional[str]) -> dict:
    """Static SASS instruction counts of the resource report (None without SASS)."""
    def count(pat):
        return len(re.findall(pat, sass)) if sass else None
    return {"HGMMA": count(r"\bHGMMA\."), "MUFU.EX2": count(r"\bMUFU\.EX2\b"),
            "LDL/STL": count(r"\b(?:LDL|STL)(?:\.|\s)"), "UTMALDG": count(r"\bUTMALDG\b"),
            "LDGSTS": count(r"\bLDGSTS\b")}


def format_report(name: str, rep: dict) -> str:
    keys = ["threads", "registers", "smem_bytes", "stack_frame", "spill_stores", "spill_loads",
            "HGMMA", "MUFU.EX2", "LDGSTS", "UTMALDG", "LDL/STL"]
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in keys)



# ------------------------------------------------------------------------------------------------
# Loops by control flow (any kernel, any arch): natural loops of the SASS control-flow graph
# ------------------------------------------------------------------------------------------------
# `loop_listings` above pairs a label with a later branch back to it, which is right for a loop laid
# out in one piece (the Hopper forward) but not for an sm_100 kernel: ptxas moves the retry path of
# every mbarrier wait behind the kernel's EXIT, and that stub's jump back into the code looks like a
# loop spanning half the kernel. The functions below build the control-flow graph instead and take
# the textbook natural loops (a back edge u -> h, h dominating u; the body is every block that
# reaches u without passing h), so an out-of-line stub belongs to the loop whose code it serves.
_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*)")
_LABEL = re.compile(r"^\s*([.$][\w.$]*):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
_ENDS_BLOCK = ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL")


@dataclass(frozen=True)
class Instruction:
    op: str          # full opcode, "FFMA2", "MUFU.EX2", "BRA.U"
    pred: str        # guard predicate, "" / "@P0" / "@!UP1"
    operands: str    # text after the opcode, up to the ";"


@dataclass(frozen=True)
class SassLoop:
    """One natural loop. `ops` is its inline part: the run of consecutive (address-order) blocks of
    the loop around its header, i.e. the loop as ptxas laid it out; `out_of_line` counts the loop's
    other instructions (wait retries placed elsewhere). `blocks` is the whole body, for nesting."""
    label: str                # the header's label ("" if it has none)
    start: int                # index of the inline part's first instruction in the listing
    ops: tuple                # inline opcodes, in address order
    out_of_line: int
    blocks: frozenset
    text: str                 # the inline part, one instruction per line

    def contains(self, other: "SassLoop") -> bool:
        return other.blocks < self.blocks


def parse_sass(sass: str) -> tuple[list, dict]:
    """(instructions in address order, {label: index of the instruction it names})."""
    insns, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(line)
        if m:
            labels.update((name, len(insns)) for name in pending)
            pending = []
            insns.append(Instruction(m.group(3), (m.group(2) or "").strip(), m.group(4).strip()))
    return insns, labels


def _branch_target(ins: Instruction, labels: dict) -> Optional[int]:
    m = _TARGET.search(ins.operands)
    return labels.get(m.group(1)) if m else None


def _is_conditional(ins: Instruction) -> bool:
    """Guarded (@P0, @!UP1; @PT is no guard), or a branch with a condition operand (BRA.U UP0, ...)."""
    return ins.pred not in ("", "@PT") or (ins.op.startswith("BRA") and not ins.operands.startswith("`"))


def control_flow_graph(insns: list, labels: dict) -> tuple[list, list]:
    """(blocks as [start, end) instruction ranges, successor sets). A block ends at a label or after
    a branch / exit / return / call. An indirect branch (BRX, the warp-role dispatch through a jump
    table) has no known successor: its targets become roots in `_dominator_tree`."""
    n = len(insns)
    starts = {0} | {i for i in labels.values() if i < n}
    starts |= {i + 1 for i, ins in enumerate(insns) if ins.op.split(".")[0] in _ENDS_BLOCK and i + 1 < n}
    starts = sorted(starts)
    blocks = [(s, starts[k + 1] if k + 1 < len(starts) else n) for k, s in enumerate(starts)]
    block_at = {s: k for k, s in enumerate(starts)}
    succ = [set() for _ in blocks]
    for k, (_, end) in enumerate(blocks):
        last = insns[end - 1]
        kind = last.op.split(".")[0]
        falls_through = True
        if kind in ("BRA", "JMP"):
            target = _branch_target(last, labels)
            if target in block_at:
                succ[k].add(block_at[target])
            falls_through = _is_conditional(last)
        elif kind in ("EXIT", "RET", "BRX", "JMX"):
            falls_through = kind in ("EXIT", "RET") and _is_conditional(last)
        if falls_through and k + 1 < len(blocks):
            succ[k].add(k + 1)
    return blocks, succ


def _dominator_tree(succ: list) -> tuple[dict, list]:
    """(immediate dominators, predecessor sets) under a virtual root (id len(succ)) whose children
    are block 0 and every block nothing else reaches: the jump-table targets and subroutines
    (Cooper, Harvey & Kennedy's iterative algorithm on reverse postorder)."""
    nb, root = len(succ), len(succ)
    pred = [set() for _ in range(nb)]
    for u in range(nb):
        for v in succ[u]:
            pred[v].add(u)
    entries, seen, order = [], {root}, []
    while True:  # add roots, lowest address first, until every block is reached
        todo = [b for b in range(nb) if b not in seen]
        if not todo:
            break
        fresh = [b for b in todo if not pred[b] or b == 0] or todo[:1]
        entries.append(fresh[0])
        stack = [(fresh[0], iter(sorted(succ[fresh[0]])))]
        seen.add(fresh[0])
        while stack:  # iterative DFS, postorder
            node, children = stack[-1]
            child = next((c for c in children if c not in seen), None)
            if child is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(child)
                stack.append((child, iter(sorted(succ[child]))))
    rpo = [root] + order[::-1]
    number = {b: i for i, b in enumerate(rpo)}
    preds = {b: pred[b] | ({root} if b in entries else set()) for b in range(nb)}
    idom = {root: root}

    def meet(a, b):
        while a != b:
            while number[a] > number[b]:
                a = idom[a]
            while number[b] > number[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            done = sorted((p for p in preds[b] if p in idom), key=number.get)
            new = done[0]
            for p in done[1:]:
                new = meet(p, new)
            if idom.get(b) != new:
                idom[b], changed = new, True
    return idom, pred


def _dominates(idom: dict, a: int, b: int) -> bool:
    while a != b:
        if idom[b] == b:
            return False
        b = idom[b]
    return True


def _listing_lines(sass: str) -> list:
    """The listing's instruction lines, without addresses and encodings (parse_sass's order)."""
    out = []
    for line in sass.splitlines():
        if _INSN.match(line):
            out.append(re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)).strip())
    return out


def natural_loops(sass: str) -> list:
    """Every natural loop of a SASS listing (back edges to one header merged), as SassLoop, in
    address order of their inline parts. Irreducible cycles (none in these kernels) are not loops."""
    insns, labels = parse_sass(sass)
    if not insns:
        return []
    blocks, succ = control_flow_graph(insns, labels)
    idom, pred = _dominator_tree(succ)
    bodies: dict = {}
    for u in range(len(blocks)):
        for h in succ[u]:
            if _dominates(idom, h, u):
                body, work = {h}, [u]
                while work:
                    x = work.pop()
                    if x not in body:
                        body.add(x)
                        work.extend(pred[x])
                bodies.setdefault(h, set()).update(body)
    names = {i: name for name, i in sorted(labels.items(), reverse=True)}
    lines = _listing_lines(sass)
    loops = []
    for h, body in bodies.items():
        lo = hi = h
        while lo - 1 in body:
            lo -= 1
        while hi + 1 in body:
            hi += 1
        first, last = blocks[lo][0], blocks[hi][1]
        total = sum(blocks[b][1] - blocks[b][0] for b in body)
        loops.append(SassLoop(names.get(blocks[h][0], ""), first, tuple(ins.op for ins in insns[first:last]),
                              total - (last - first), frozenset(body), "\n".join(lines[first:last])))
    return sorted(loops, key=lambda lp: lp.start)


def innermost(loops: list, keep) -> list:
    """The loops for which keep(loop) holds and no loop nested in them holds it too."""
    chosen = [lp for lp in loops if keep(lp)]
    return [lp for lp in chosen if not any(lp.contains(other) for other in chosen)]


def opcode_count(ops, name: str) -> int:
    """How many of `ops` are `name`: a dotted name ("MUFU.EX2") matches as a prefix, a bare one
    ("FFMA") the opcode before its first dot, so FFMA does not count FFMA2."""
    if "." in name:
        return sum(op == name or op.startswith(name + ".") for op in ops)
    return sum(op.split(".")[0] == name for op in ops)
