"""Host-side argument checks of the stage entry points, found by review (cpu tier, no launch).

Each case failed before its fix: an argument the kernels cannot serve reached a launch, or raised
an error that did not name it, or was silently ignored.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("stage3_fwd_kernel.host_io")  # cutlass, imported after the arch is set

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


def test_combine_parts_refuses_parts_and_lse_parts_it_would_read_out_of_bounds():
    from stage3_fwd_kernel import split_combine

    out_parts = torch.zeros(6, 8, 1, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 6, 8)
    for parts in (4, 0, -2, True, 2.0):  # 4 does not divide the 6 rows of parts
        with pytest.raises(ValueError, match="parts"):
            split_combine.combine_parts(out_parts, lse, parts)
    for bad in (torch.zeros(6, 1, 8), torch.zeros(1, 2, 8), torch.zeros(1, 6, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="lse_parts"):
            split_combine.combine_parts(out_parts, bad, 3)
    with pytest.raises(ValueError, match="out"):
        split_combine.combine_parts(out_parts, lse, 3, out=torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16,
                                                                       device="meta"))


def test_step_entry_points_check_out_lse_scale_and_causal(monkeypatch):
    from stage3_fwd_kernel import host_io

    monkeypatch.setattr(host_io, "prepare_inputs", lambda q, k, v: (q, k, v))  # CPU tensors stand in
    monkeypatch.setattr(host_io, "compile_cached", lambda *a: pytest.fail("reached the compile"))
    q = torch.zeros(2, 256, 8, 128, dtype=torch.bfloat16)
    call = lambda **kw: host_io.attention_forward_impl("t", None, q, q, q, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="out"):
        call(out=torch.zeros(2, 100, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse"):
        call(lse=torch.zeros(1, 1, 1))
    for scale in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="softmax_scale"):
            call(softmax_scale=scale)
    with pytest.raises(TypeError, match="causal"):
        call(causal="False")


def test_zero_kv_heads_and_non_bool_causal_are_named():
    from stage3_fwd_kernel import host_io
    from stage3_fwd_kernel.hopper import host

    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="heads"):
        host_io.prepare_inputs(q, q[:, :, :0], q[:, :, :0])
    for causal in ("False", 0.5, None):
        with pytest.raises(TypeError, match="causal"):
            host.make_variant(causal, (None, None), 0.0, None, 2, q.device)


def test_align_16B_restrides_a_size_one_mode_the_launch_would_refuse():
    from stage3_fwd_kernel import host_io
    from stage4_bwd_kernel import common

    base = torch.arange(2 * 8 * 64, dtype=torch.float32).to(torch.bfloat16).view(2, 8, 64)
    t = base.as_strided((2, 8, 1, 64), (512, 64, 1, 1))    # an MQA view torch calls contiguous
    for fix in (host_io.align_16B, common._aligned):
        u = fix(t)
        assert u.stride() == (512, 64, 64, 1) and u.data_ptr() == t.data_ptr() and torch.equal(u, t)
    aligned = torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)
    assert host_io.align_16B(aligned) is aligned


@pytest.mark.stage4
def test_stage4_backward_refuses_grid_limits_dense_varlen_only_values_and_a_bool_scale(monkeypatch):
    from stage4_bwd_kernel import common, host

    with pytest.raises(ValueError, match="softmax_scale"):
        common.default_scale(True, 64)
    monkeypatch.setattr(common, "check_backward_inputs", lambda *t, varlen: t)   # CPU tensors stand in
    q = torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 2, 4)
    call = lambda *a, **kw: host.backward("t", None, *a, **kw)  # noqa: E731
    for kw, name in ((dict(max_seqlen_q=4), "max_seqlen_q"), (dict(max_seqlen_k=4), "max_seqlen_k"),
                     (dict(check_values=True), "check_values")):
        with pytest.raises(ValueError, match=name):
            call(q, q, q, q, q, lse, **kw)
    big = torch.zeros(65536, 1, 1, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="65535"):
        call(big, big, big, big, big, torch.zeros(65536, 1, 1, device="meta"))
