"""Stage 5: tile schedulers as index maps (LPT for causal and varlen, SPT for the deterministic
backward) and a makespan simulator that shows what each order buys. See README.md.

    python -m stage5_scheduling                    # comparison tables (simulated)
    python -m stage5_scheduling --plot-dir DIR     # + Gantt charts as PNGs

Importing the package sets CUTE_DSL_ARCH (default sm_90a) before ``device`` / ``metadata`` import
cutlass; the orders and the simulator are plain Python.
"""
from stage2_emulated_exp import cute_arch

from . import orders
from .orders import (
    H100_L2_BYTES,
    Tiles,
    VarlenMeta,
    dq_rank,
    first_q_block,
    heads_per_section,
    kv_blocks_visited,
    list_order,
    lpt_bwd,
    lpt_causal,
    lpt_causal_flat,
    lpt_no_sections,
    lpt_varlen,
    naive,
    naive_bwd,
    sectioned,
    spt_bwd,
    varlen_metadata,
)
from .simulator import (
    H100_SMS,
    L2Model,
    Problem,
    Schedule,
    compare,
    gantt,
    lower_bound,
    run_backward,
    run_forward,
    simulate,
    simulate_striding,
    simulate_bwd,
    tile_costs,
)

cute_arch.select()

__all__ = [
    "orders", "H100_L2_BYTES", "H100_SMS", "Tiles", "VarlenMeta", "L2Model", "Problem",
    "Schedule", "dq_rank", "first_q_block", "heads_per_section", "kv_blocks_visited",
    "list_order", "naive", "sectioned", "lpt_causal", "lpt_causal_flat", "lpt_no_sections", "lpt_varlen",
    "varlen_metadata", "naive_bwd", "lpt_bwd", "spt_bwd", "tile_costs", "lower_bound",
    "simulate", "simulate_striding", "simulate_bwd", "run_forward", "run_backward", "compare", "gantt",
]
