"""The backward roofline reproduces the paper's B200 table (1-CTA and 2-CTA) and prices the
Hopper designs of this stage."""
import pytest

from stage4_bwd_kernel.roofline import (B200, H100, STEP1_TILES, backward_tile_cycles, hopper_registers,
                                        hopper_smem_bytes, hopper_table, hopper_tile_cycles, paper_table)

pytestmark = [pytest.mark.cpu, pytest.mark.stage4]


def test_paper_backward_table_1cta():
    c = backward_tile_cycles(128, 128, 128, B200)
    assert (c.mma, c.smem_operands, c.smem_ds_write, c.smem_ds_exchange, c.smem_dq) == (2560, 2048, 256, 0, 1024)
    assert (c.smem, c.exp) == (3328, 1024)
    assert c.bound == "SMEM"


def test_paper_backward_table_2cta():
    c = backward_tile_cycles(128, 128, 128, B200, two_cta=True)
    assert (c.mma, c.smem_operands, c.smem_ds_write, c.smem_ds_exchange, c.smem_dq) == (2560, 1536, 256, 384, 512)
    assert (c.smem, c.exp) == (2688, 1024)
    assert c.smem / c.mma == pytest.approx(1.05, abs=0.01)  # "exceeds MMA compute time by approximately 5%"


def test_paper_formulas_for_general_tiles():
    m, n, d = 64, 128, 96
    c = backward_tile_cycles(m, n, d, B200)
    assert c.mma == 10 * m * n * d / 8192
    assert c.smem == (4 * m * d + 3 * n * d + m * n) / 64 + m * n / 64 + m * d / 16
    assert c.exp == m * n / 16


def test_head_dim_v_enters_the_dp_and_dv_gemms():
    c = backward_tile_cycles(128, 128, 192, B200, d_v=128)
    assert c.mma == 2 * 128 * 128 * (3 * 192 + 2 * 128) / 8192


def test_hopper_step1_is_smem_bound_and_rs_is_not():
    ss = hopper_tile_cycles(64, 128, 128, "step1_ss")
    rs = hopper_tile_cycles(64, 128, 128, "fa3_rs")
    assert ss.mma == rs.mma == 10 * 64 * 128 * 128 / H100.mma_flops_per_clock
    assert ss.bound == "SMEM" and rs.bound == "MMA"
    assert ss.smem == 3328 and rs.smem == 2176


def test_hopper_step1_tiles_fit_registers_and_smem():
    for design, m, n, d, dv in STEP1_TILES:
        assert hopper_registers(m, n, d, design, dv)["peak"] <= 192
        assert hopper_smem_bytes(m, n, d, dv) <= 227 * 1024


def test_step1_default_tiles_are_the_roofline_rows():
    pytest.importorskip("stage4_bwd_kernel.common")
    from stage4_bwd_kernel.hopper_step1 import default_tiles

    for _, m, n, d, dv in STEP1_TILES:
        assert default_tiles(d, dv) == (m, n)


def test_tables_render():
    assert "| SMEM total | 3328 | 2688 |" in paper_table()
    assert "| step1_ss | 64 x 128, 128/128 | 2560 | 3328 | 512 | SMEM |" in hopper_table([("step1_ss", 64, 128, 128, 128)])


def test_wide_head_dim_designs():
    """The wide-head-dim table's arithmetic: the five GEMMs' FLOPs once (twice S^T / dP^T in
    split_dims), the registers each design keeps, and which ones fit a consumer and SMEM."""
    from stage4_bwd_kernel import roofline as r

    m, d, dv = 64, 192, 128
    once = 2 * m * 64 * (2 * d + 2 * dv + d) / r.H100.mma_flops_per_clock
    assert r.wide_tile_cycles("split_queries", m, d, dv).mma == pytest.approx(once)
    assert r.wide_tile_cycles("exchange_dims", m, d, dv).mma == pytest.approx(once)
    twice_sdp = once + 2 * m * 64 * (d + dv) / r.H100.mma_flops_per_clock
    assert r.wide_tile_cycles("split_dims", m, d, dv).mma == pytest.approx(twice_sdp)
    # split_queries at 64 x 64, (192, 128): dK 96 + dV 64 + S^T 16 + dP^T 16 + P^T 8 = 200 registers
    assert r.wide_registers("split_queries", 64, 192, 128)["total"] == 200
    assert r.wide_registers("split_queries", 64, 256, 256)["total"] > r.WIDE_REGISTER_BUDGET
    assert r.wide_registers("exchange_dims", 128, 256, 256)["total"] <= r.WIDE_REGISTER_BUDGET
    assert r.wide_smem_kb(128, 256, 256, 2) > 227 >= r.wide_smem_kb(64, 256, 256, 2)
    # swap_keys: 96 keys, the same five GEMMs once; dK^T 72 + dV^T 48 + max(S 24 + dP 24, dQ 48) = 168 registers,
    # and per key-query pair less SMEM than exchange_dims (the dQ tile's staging is paid per 96 keys, not 64)
    once96 = 2 * m * 96 * (2 * d + 2 * dv + d) / r.H100.mma_flops_per_clock
    assert r.wide_tile_cycles("swap_keys", m, d, dv, 96).mma == pytest.approx(once96)
    assert r.wide_registers("swap_keys", 64, 192, 128, 96)["total"] == 168
    assert r.wide_registers("swap_keys", 64, 256, 256, 96)["total"] > r.WIDE_REGISTER_BUDGET
    per_pair = {dsg: r.wide_tile_cycles(dsg, m, d, dv, n).smem / n for dsg, n in (("swap_keys", 96), ("exchange_dims", 64))}
    assert per_pair["swap_keys"] < 0.9 * per_pair["exchange_dims"]
    table = r.wide_table(r.WIDE_CASES)
    assert table.count("\n") == len(r.WIDE_CASES) + 1 and "(over)" in table and "| swap_keys | 64 x 96, 192/128 |" in table
    with pytest.raises(ValueError, match="design"):
        r.wide_design("nope", 64, 192, 128)
