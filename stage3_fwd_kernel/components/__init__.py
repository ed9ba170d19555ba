"""Pieces of the attention forward that do not depend on the tensor-core generation.

A kernel composes them; none of them knows about wgmma, TMEM or a register layout:

* `work_tile`   -- the named work tile (`AttentionTile`) and the sequence information a CTA reads
                   to find its rows (dense, varlen offsets, seqused_k, stage 5's batch map, q_shift).
* `block_range` -- which key blocks a query tile walks: all of them, the causal prefix, the ones
                   that need a mask, a split-tail chunk of them.
* `mask`        -- the score mask (sequence end, causal bottom-right), the "lean" form; window,
                   softcap and sinks plug in here.
* `tile_walk`   -- the one tile-scheduler protocol of a persistent CTA: which work item comes next
                   (static striding, the dynamic atomic hand-out, split-tail chunks).

The Hopper kernel (`stage3_fwd_kernel.hopper`) uses all four; the Blackwell forward uses
`work_tile`, `block_range` and `mask` (it runs one tile per CTA, so it has no walk).
"""
