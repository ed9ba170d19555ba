"""The forward roofline reproduces the paper's B200 table and gives the Hopper equivalent."""
import pytest

from stage3_fwd_kernel.roofline import B200, H100, forward_tile_cycles, roofline_table

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


@pytest.mark.parametrize("m, expected", [(128, (1024, 768, 1024)), (256, (2048, 1536, 2048))])
def test_paper_forward_table_b200(m, expected):
    c = forward_tile_cycles(m, 128, 128, B200)
    assert (c.mma, c.smem, c.exp) == expected
    assert c.bound == "MMA+exp"


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_hopper_exp_to_mma_ratio_is_64_over_d(d):
    c = forward_tile_cycles(128, 128, d, H100)
    assert c.exp / c.mma == pytest.approx(64 / d)


def test_hopper_tile_smem_counts_every_warpgroup_rereading_k_and_v():
    # two 64-row warpgroups: K and V are each read twice, Q once: (128 + 2*128 + 2*128) * 128 el
    c = forward_tile_cycles(128, 128, 128, H100)
    assert c.smem == (128 * 128 + 2 * 128 * 128 + 2 * 128 * 128) * 2 / 128


def test_emulating_part_of_the_exponentials_moves_hdim64_off_the_exp_bound():
    full = forward_tile_cycles(128, 128, 64, H100)
    partial = forward_tile_cycles(128, 128, 64, H100, exp_fraction_on_mufu=0.75)
    assert full.bound == "MMA+exp" and partial.bound == "MMA" and partial.exp == 0.75 * full.exp


def test_192_128_uses_both_head_dims():
    c = forward_tile_cycles(128, 128, 192, H100, d_v=128)
    assert c.mma == 2 * 128 * 128 * (192 + 128) / 4096


def test_table_renders_rows():
    t = roofline_table([(128, 128, 128)], B200)
    assert "| 128 x 128 x 128 | 1024 | 768 | 1024 | MMA+exp |" in t


def test_causal_flops_count_the_pairs_a_bottom_right_mask_keeps():
    """The kernels' CLIs print TFLOP/s from runner.attention_flops: causal halves only when sq = sk; with
    sq != sk it counts the kept pairs (it used to halve there too: 0.53x the work at sq = 1k, sk = 8k)."""
    import random

    from stage3_fwd_kernel.runner import attention_flops, visible_pairs

    def brute(sq, sk):
        return sum(min(max(sk - sq + 1 + i, 0), sk) for i in range(sq))

    rng = random.Random(3)
    for sq, sk in [(0, 5), (5, 0), (1, 1), (3, 3), (64, 1), (1, 64), (113, 203), (799, 3)] + \
            [(rng.randrange(300), rng.randrange(300)) for _ in range(200)]:
        assert visible_pairs(sq, sk, None, None, True) == brute(sq, sk), (sq, sk)
    per_pair = 2.0 * 2 * 4 * (128 + 64)
    assert attention_flops(2, 1024, 8192, 4, 128, 64, True) == per_pair * brute(1024, 8192)
    assert attention_flops(2, 4096, 4096, 4, 128, 64, True) == per_pair * 4096 * 4096 / 2
    assert attention_flops(2, 1024, 8192, 4, 128, 64, False) == per_pair * 1024 * 8192
