"""What a compiled kernel holds: registers, spills and stack from ptxas, the SASS (nvdisasm) and
its instruction counts (HGMMA, MUFU.EX2, local-memory traffic), and the hot loops to read.

The report is static (instructions in the code, not executed ones); it is what a compile-only
machine can say about a kernel, and what the compile-time tests check.
"""
from __future__ import annotations

import re
import struct
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
    # SASS instruction counts (static, i.e. in the code, not executed)
    def count(pat):
        return len(re.findall(pat, sass)) if sass else None
    rep["HGMMA"] = count(r"\bHGMMA\.")
    rep["MUFU.EX2"] = count(r"\bMUFU\.EX2\b")
    rep["LDL/STL"] = count(r"\b(?:LDL|STL)(?:\.|\s)")
    rep["UTMALDG"] = count(r"\bUTMALDG\b")
    rep["LDGSTS"] = count(r"\bLDGSTS\b")
    rep["ptxas_log"] = ptxas_log
    return rep


def format_report(name: str, rep: dict) -> str:
    keys = ["threads", "registers", "smem_bytes", "stack_frame", "spill_stores", "spill_loads",
            "HGMMA", "MUFU.EX2", "LDGSTS", "UTMALDG", "LDL/STL"]
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in keys)

