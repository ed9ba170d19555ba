"""Stage 2, GPU half: the emulated exp2 kernel, MUFU.EX2, and the throughput microbenchmark.

compile tier (no GPU): both kernels build for sm_90a and sm_100a, and the SASS is the
sequence the lesson promises -- FMNMX, FADD.RM, 2 FADD, n FFMA, LEA per value, no MUFU, no
float->int conversion, no local memory. gpu tier: bit-exact against host_model and the
MUFU.EX2 accuracy bound.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.stage2

ARCHES = ("sm_90a", "sm_100a")
VALUES_PER_THREAD = 4  # gpu_kernel.VALUES: every per-value count below is multiplied by it


def _opcodes(sass: str) -> list:
    from stage2_emulated_exp.gpu_kernel import sass_opcodes

    return sass_opcodes(sass)


@pytest.fixture(scope="module")
def gk():
    return pytest.importorskip("stage2_emulated_exp.gpu_kernel")  # skips where cutlass is missing


@pytest.fixture(scope="module")
def exp2_builds(gk):
    """{arch: compile_only(arch)}: mufu + emulated degree 3 (and degree 5 on sm_90a)."""
    return {arch: gk.compile_only(arch, degrees=(3, 5) if arch == "sm_90a" else (3,))
            for arch in ARCHES}


@pytest.fixture(scope="module")
def bench_builds(gk):
    from stage2_emulated_exp import gpu_bench

    return gpu_bench.bench_compile_only("sm_90a", names=("mufu", "emu25_d3", "emu100_d5"))


# ----------------------------------------------------------------------------------------
# compile tier
# ----------------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHES)
def test_both_kernels_compile(exp2_builds, arch):
    builds = exp2_builds[arch]
    assert {"mufu", "emulated_d3"} <= set(builds)
    for name, b in builds.items():
        assert f".target {arch}" in b["ptx"], name
        assert _opcodes(b["sass"]), f"{name}: empty SASS"


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHES)
def test_emulated_sass_is_the_fma_sequence(exp2_builds, arch):
    for name, b in exp2_builds[arch].items():
        if not name.startswith("emulated"):
            continue
        degree = int(name.rsplit("_d", 1)[1])
        ops = _opcodes(b["sass"])
        n = VALUES_PER_THREAD
        assert "MUFU.EX2" not in ops and not any(o.startswith("MUFU") for o in ops), name
        assert not any(o.startswith(("F2I", "I2F")) for o in ops), f"{name}: a conversion"
        # the clamp and the floor: ftz is the default, so the FTZ forms
        assert ops.count("FMNMX.FTZ") == n, ops
        assert ops.count("FADD.FTZ.RM") == n, ops
        assert ops.count("FADD.FTZ") == 2 * n, ops  # j - magic, xc - floor
        assert ops.count("FFMA.FTZ") == degree * n, ops  # Horner
        combine = re.findall(r"LEA R\d+, R\d+, R\d+, 0x17", b["sass"])
        assert len(combine) == n, "shl 23 + add should fuse into one LEA per value"


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHES)
def test_mufu_sass_is_one_ex2_per_value(exp2_builds, arch):
    ops = _opcodes(exp2_builds[arch]["mufu"]["sass"])
    assert ops.count("MUFU.EX2") == VALUES_PER_THREAD
    assert "FFMA" not in ops


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHES)
def test_no_local_memory(exp2_builds, arch):
    for name, b in exp2_builds[arch].items():
        ops = _opcodes(b["sass"])
        assert not any(o.startswith(("STL", "LDL")) for o in ops), name
        for kernel, res in b["resources"].items():
            assert res.get("frame_bytes", 0) == 0, (name, kernel, res)


@pytest.mark.compile
def test_vectorized_global_access(exp2_builds):
    ops = _opcodes(exp2_builds["sm_90a"]["emulated_d3"]["sass"])
    assert "LDG.E.128" in ops and "STG.E.128" in ops


@pytest.mark.compile
def test_coefficients_reach_ptx_exactly(gk, exp2_builds):
    """Each float32 coefficient must appear in the PTX with its exact bit pattern (the
    DSL could otherwise round a Python double twice)."""
    from stage2_emulated_exp.minimax import minimax_coefficients

    ptx = exp2_builds["sm_90a"]["emulated_d5"]["ptx"]
    for c in minimax_coefficients(5)[1:]:
        bits = int(np.float32(c).view(np.uint32))
        spelled = (str(bits), f"0f{bits:08X}", f"0f{bits:08x}")
        assert any(s in ptx for s in spelled), f"coefficient {c!r} (0x{bits:08X}) not in PTX"


@pytest.mark.compile
def test_bench_kernels_no_spills_and_model_counts(bench_builds):
    """The benchmark's inner loop holds exactly what gpu_bench.model_rate assumes."""
    from stage2_emulated_exp import gpu_bench

    for name, b in bench_builds.items():
        res = next(iter(b["resources"].values()))
        assert res["frame_bytes"] == 0 and res["registers"] <= 64, (name, res)
        ops = _opcodes(b["sass"])
        assert not any(o.startswith(("STL", "LDL")) for o in ops), name
    from stage2_emulated_exp.gpu_kernel import hot_loop_opcodes

    g2 = 2 * gpu_bench.G  # the mainloop is unrolled by 2: 40 values per trip
    mufu = hot_loop_opcodes(bench_builds["mufu"]["sass"])
    # per value: FFMA (x * scale - max), MUFU.EX2, FADD (row sum); + max update, loop control
    assert mufu.count("MUFU.EX2") == g2 and mufu.count("FFMA") == g2
    assert len(mufu) <= 3 * g2 + 6, mufu
    emu = hot_loop_opcodes(bench_builds["emu25_d3"]["sass"])
    assert emu.count("MUFU.EX2") == 2 * (gpu_bench.G - 5) and emu.count("FADD.FTZ.RM") == 2 * 5
    # model: 3 instr per MUFU value, 5 + 3 + 2 per emulated value
    assert len(emu) <= 3 * 30 + 10 * 10 + 6, emu
    full = hot_loop_opcodes(bench_builds["emu100_d5"]["sass"])
    assert "MUFU.EX2" not in full and full.count("FFMA.FTZ") == g2 * 5


@pytest.mark.compile
def test_throughput_model():
    from stage2_emulated_exp.gpu_bench import model_rate

    assert model_rate(0.0) == pytest.approx(16.0)  # MUFU-bound
    assert model_rate(1.0, degree=3) == pytest.approx(12.8)  # issue-bound, 10 instr / value
    best = max(np.linspace(0, 1, 101), key=model_rate)
    assert best == pytest.approx(1 / 3, abs=0.01) and model_rate(1 / 3) == pytest.approx(24.0)


# ----------------------------------------------------------------------------------------
# gpu tier
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mix_1m():
    from stage2_emulated_exp.device_main import bitexact_inputs

    x, cls = bitexact_inputs(scale=0.05, seed=1)  # ~177k structured + 800k random
    return x, cls


@pytest.mark.gpu
@pytest.mark.parametrize("degree,ftz", [(3, True), (4, True), (5, True), (3, False)])
def test_bitexact_vs_host_model(gk, mix_1m, degree, ftz):
    import torch

    from stage2_emulated_exp.device_main import compare_bits
    from stage2_emulated_exp.host_model import exp2_emulated

    x, cls = mix_1m
    y_gpu = gk.exp2_gpu(torch.from_numpy(x).cuda(), "emulated", degree, ftz=ftz).cpu().numpy()
    y_host = exp2_emulated(x, degree, ftz=ftz)
    rep = compare_bits(x, cls, y_gpu, y_host, degree, ftz)
    assert rep["mismatches"] == 0, rep


@pytest.mark.gpu
def test_mufu_accuracy_on_unit_interval(gk):
    import torch

    from stage2_emulated_exp.device_main import rel_errors

    x = np.random.default_rng(0).random(1 << 20, dtype=np.float32)
    y = gk.exp2_gpu(torch.from_numpy(x).cuda(), "mufu").cpu().numpy()
    err = rel_errors(y, x)
    assert err["fp32_max"] < 2e-7, err
    assert err["bf16_max"] < 4e-3, err


@pytest.mark.gpu
def test_exp2_gpu_any_shape_and_size(gk):
    import torch

    x = torch.linspace(-20, 20, 3 * 1001, device="cuda").reshape(3, 1001)  # not a tile multiple
    for method in gk.METHODS:
        y = gk.exp2_gpu(x, method)
        assert y.shape == x.shape
        torch.testing.assert_close(y.double(), torch.exp2(x.double()), rtol=2e-4, atol=0)
