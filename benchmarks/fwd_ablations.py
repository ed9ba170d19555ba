"""Timing ablations of the Hopper forward (step 4), written as untracked copies for ab_fwd.py.

    python benchmarks/fwd_ablations.py nosm nopp select            # writes fwd_abl_nosm.py, ... at the repo root
    python benchmarks/ab_fwd.py --no-check --impls fwd_abl_nosm,stage3_fwd_kernel.hopper.forward ...
    python benchmarks/ab_fwd.py --official-skeleton --impls fwd_abl_nosm ...   # skeleton against skeleton

Each variant is step 4's committed source with one change, under its own STEP (the compile-cache key),
so several builds time side by side in one process. Session 21 used them to split the (192, 128) gap to
the official kernel into the kernel's skeleton (loads, wgmmas, barriers, epilogue) and its softmax
(stage 3 README, "Session 21"). The variants that compute something else (nosm, l2) need ab_fwd's
--no-check. The edits are anchored on step 4's text; when step 4 changes under them, this stops
with the anchor that is missing instead of writing a wrong copy.

Variants:
  nosm     no softmax: P = S (no mask, max, exp or O rescale); what the skeleton costs alone
  l2       K / V always from key blocks 0 and 1: loads from L2, the same shapes and barriers
  order    the producer loads K of block j + 1 before V of block j (the official kernel's order)
  nopp     no consumer turn barrier (the official kernel drops its scheduler barrier above d = 128)
  classic  classic rescaling without the vote or its branch: every row follows its max each block, O is
           multiplied every block (by 2^0 = 1 where the max did not grow), the same result as step 4
           at rescale_threshold=0 (use it with ~rescale_threshold=0.0 so the two agree bit for bit)
  classicnopp  classic and nopp together
  packlate P packed by a plain conversion (step 3's store_P): the compiler sinks the packs past the O
           rescale's branch, all 32 in a row at the end of the step (step 4 before session 23)
  select   the rescale decided by selects, O always multiplied (by 1.0 when the vote says no): one
           basic block, the same bits as step 4
  max4     each row's tile max in 4 interleaved FMNMX chains (8 deep) combined at the end, instead of one
           31-deep chain (tried at d = 128 / 256 in session 10: a tie / slower); the same maxima
  halfvote a warp vote per row slot (8 rows each) instead of one per warp, so a row slot's
           exponentials need not wait for the other slot's max

classic, classicnopp and select have no branch in the step; the P V wait and the packs sit where
they do in step 4 (ptxas hoists the wait above most exponentials, test_pv_wait_placement).

Retired in session 23, when step 4 took pfirstall: pvwait, pvwaitnopp, pvwaitbelow, pfirst and
pfirstall edit text step 4 no longer has; this file at 4a95330 rebuilds them from step 4 there:
    git show 4a95330:benchmarks/fwd_ablations.py > benchmarks/fwd_ablations_4a95330.py
    python benchmarks/fwd_ablations_4a95330.py --rev 4a95330 pvwait pfirstall
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP4 = "stage3_fwd_kernel/hopper/forward.py"
STEP_LINE = 'STEP = "hopper_step4_fa4_softmax"'

_SUBCLASS = "\n\n# ---- fwd_ablations.py: a timing ablation, not a kernel to use ----\n" \
            "_Step4 = FlashAttentionForwardSm90Step4\n\n\nclass FlashAttentionForwardSm90Step4(_Step4):\n"

_NOSM = '''    @cute.jit
    def online_softmax(self, acc_S, n_block, mask: cutlass.Constexpr[bool], row0, seqlen_q, seqlen_k,
                       softmax_scale_log2, tScS_rc, row_max, row_max_new, row_sum, row_scale, row_limit,
                       row_bias, rescale_margin, tScS0_rc=None):
        return False  # P = S: no mask, max, exp or rescale
'''

_L2 = '''    @cute.jit
    def load_kv(self, i, n_block, pipe_K, pipe_V, tma_atom_K, tma_atom_V, tKgK, tKsK, tVgV, tVsV):
        _Step4.load_kv(self, i, n_block & 1, pipe_K, pipe_V, tma_atom_K, tma_atom_V, tKgK, tKsK, tVgV, tVsV)
'''

_ORDER_OLD = '''        for i in cutlass.range(first_kv, n_blocks, unroll=1):
            self.load_kv(kv_base + i, n_block_max - 1 - i, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                         tKgK, tKsK, tVgV, tVsV)
'''
_ORDER_NEW = '''        if const_expr(first_kv == 0):  # one CTA per tile: K_{i} before V_{i-1}
            if n_blocks > 0:
                self.load_one(kv_base, n_block_max - 1, pipe_K, tma_atom_K, tKgK, tKsK)
            for i in cutlass.range(1, n_blocks, unroll=1):
                self.load_one(kv_base + i, n_block_max - 1 - i, pipe_K, tma_atom_K, tKgK, tKsK)
                self.load_one(kv_base + i - 1, n_block_max - i, pipe_V, tma_atom_V, tVgV, tVsV)
            if n_blocks > 0:
                self.load_one(kv_base + n_blocks - 1, n_block_max - n_blocks, pipe_V, tma_atom_V, tVgV, tVsV)
        else:
            for i in cutlass.range(first_kv, n_blocks, unroll=1):
                self.load_kv(kv_base + i, n_block_max - 1 - i, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                             tKgK, tKsK, tVgV, tVsV)

    @cute.jit
    def load_one(self, i: Int32, n_block: Int32, pipe, tma_atom, tXgX, tXsX):
        st = self.kv_state(i, producer=True)
        pipe.producer_acquire(st)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, st.index], tma_bar_ptr=pipe.producer_get_barrier(st),
                  **self.kv_copy_kwargs())
'''

_PINGPONG_OLD = "        self.pingpong = pingpong\n"
_PINGPONG_NEW = "        self.pingpong = False\n"

# packlate: step 3's store_P, a plain conversion the compiler is free to sink to its first use
_PACKLATE = '''    @cute.jit
    def store_P(self, acc_S, tOrP):
        tOrP_as_acc = cute.make_tensor(tOrP.iterator, cute.make_layout(acc_S.shape))
        tOrP_as_acc.store(acc_S.load().to(self.dtype))  # fwd_ablations.py packlate
'''

# max4: the row max as 4 chains over every 4th column, then combined (max is exact: the same bits)
_MAX_CHAIN_OLD = """            m_tile = acc_S_rc[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(acc_S_rc, mode=[1])):
                m_tile = cute.arch.fmax(m_tile, acc_S_rc[r, c])
"""
_MAX_CHAIN_NEW = """            chains = [acc_S_rc[r, k] for k in range(4)]  # fwd_ablations.py max4
            for c in cutlass.range_constexpr(4, cute.size(acc_S_rc, mode=[1])):
                chains[c % 4] = cute.arch.fmax(chains[c % 4], acc_S_rc[r, c])
            m_tile = cute.arch.fmax(cute.arch.fmax(chains[0], chains[1]), cute.arch.fmax(chains[2], chains[3]))
"""

_VOTE_LINE = "        rescale = softmax_policy.rescale_vote_limits(row_max_new, row_limit)\n"
_CLASSIC_LINE = "        rescale = True  # fwd_ablations.py classic: every row follows its max, no vote, no branch\n"
# the rescale's state, moved by a select on `vote` (1.0 / the old value where it says no)
_SELECT_ROW = '''            m_safe = Float32(0.0) if row_max_new[r] == -Float32.inf else row_max_new[r]
            scale = ex2_approx_f32((row_max[r] - m_safe) * softmax_scale_log2)
            row_scale[r] = scale if vote else Float32(1.0)
            row_max[r] = row_max_new[r] if vote else row_max[r]
            row_limit[r] = (row_max_new[r] + rescale_margin) if vote else row_limit[r]
            row_bias[r] = (m_safe * softmax_scale_log2) if vote else row_bias[r]
            row_sum[r] = row_sum[r] * row_scale[r]
'''
# select replaces the vote and its rescale branch: from the vote's line to the branch's last line
_RESCALE_LAST = "                row_sum[r] = row_sum[r] * row_scale[r]\n"
_SELECT_NEW = ("        vote = softmax_policy.rescale_vote_limits(row_max_new, row_limit)\n"
               "        for r in cutlass.range_constexpr(num_rows):\n" + _SELECT_ROW + "        rescale = True\n")

_SOFTMAX_END = "        return rescale\n\n    @cute.jit\n    def store_P"
# halfvote replaces the vote, its branch and the exponentials' loop; the row maxima stay step 4's
_HALFVOTE_NEW = '''        rescale = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(num_rows):
            vote = cute.arch.vote_any_sync(row_max_new[r] > row_limit[r])
''' + _SELECT_ROW + '''            rescale = rescale | vote
            row_sum[r] += softmax_policy.exp2_row(acc_S_rc[r, None], softmax_scale_log2, row_bias[r], self.policy)
'''


def _replace(old: str, new: str):
    """An edit: the one occurrence of `old` becomes `new`."""
    def edit(src: str, variant: str) -> str:
        if src.count(old) != 1:
            raise SystemExit(f"fwd_ablations.py: {variant}: its anchor is not in {STEP4} exactly once; "
                             f"update the variant to the kernel:\n{old}")
        return src.replace(old, new)
    return edit


def _splice(first: str, last: str, new: str, keep_last: bool = False):
    """An edit: the text from `first` through `last` (up to it, keep_last) becomes `new`."""
    def edit(src: str, variant: str) -> str:
        if src.count(first) != 1 or last not in src[src.find(first):]:
            raise SystemExit(f"fwd_ablations.py: {variant}: the block from {first.strip()!r} to {last.strip()!r} "
                             f"is not in {STEP4} (once); update the variant to the kernel")
        i = src.index(first)
        j = src.index(last, i) + (0 if keep_last else len(last))
        return src[:i] + new + src[j:]
    return edit


def _append(text: str):
    """An edit: `text` added at the end of the module (a subclass that overrides a method)."""
    return lambda src, variant: src + text


NOPP = _replace(_PINGPONG_OLD, _PINGPONG_NEW)
CLASSIC = _replace(_VOTE_LINE, _CLASSIC_LINE)

# variant -> its edits, applied in order (a combination is the list of its parts)
VARIANTS = {
    "nosm": [_append(_SUBCLASS + _NOSM)],
    "l2": [_append(_SUBCLASS + _L2)],
    "order": [_replace(_ORDER_OLD, _ORDER_NEW)],
    "nopp": [NOPP],
    "packlate": [_append(_SUBCLASS + _PACKLATE)],
    "classic": [CLASSIC],
    "classicnopp": [CLASSIC, NOPP],
    "select": [_splice(_VOTE_LINE, _RESCALE_LAST, _SELECT_NEW)],
    "max4": [_replace(_MAX_CHAIN_OLD, _MAX_CHAIN_NEW)],
    "halfvote": [_splice(_VOTE_LINE, _SOFTMAX_END, _HALFVOTE_NEW, keep_last=True)],
}


def step4_source(rev: str | None) -> str:
    if rev is None:
        with open(os.path.join(ROOT, STEP4)) as f:
            return f.read()
    return subprocess.run(["git", "show", f"{rev}:{STEP4}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def write_variant(name: str, base: str, out_dir: str) -> str:
    if base.count(STEP_LINE) != 1:
        raise SystemExit(f"fwd_ablations.py: {STEP4} has no line {STEP_LINE!r}")
    src = base.replace(STEP_LINE, f'STEP = "fwd_abl_{name}"')
    for edit in VARIANTS[name]:
        src = edit(src, name)
    path = os.path.join(out_dir, f"fwd_abl_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS), metavar="VARIANT",
                    help=f"one or more of {', '.join(sorted(VARIANTS))}")
    ap.add_argument("--rev", default=None, help="git revision of step 4 to start from (default: the working tree)")
    ap.add_argument("--out-dir", default=ROOT, help="where the copies go (default: the repository root)")
    args = ap.parse_args(argv)
    base = step4_source(args.rev)
    for name in args.variants:
        print(write_variant(name, base, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
