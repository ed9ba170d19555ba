"""benchmarks.bench_distributed's pure parts on CPU: argument checks, the summary math, the trace parsing and
the timeline picture, and one whole run in this process (a world of one, gloo, fa4's reference kernels)."""
from __future__ import annotations

import json
import random
import socket

import pytest

from benchmarks import bench_distributed as bd

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


def test_arguments_default_to_the_gpu_grid_and_refuse_bad_values():
    args = bd.parse_args([])
    assert args.seqlens == [65536, 131072] and args.cases == ["causal", "noncausal"] and args.rounds == 3
    assert bd.parse_args(["--cpu-smoke"]).seqlens == [64, 128]
    assert args.peers == list(bd.PEERS) and args.torch_backends == ["cudnn", "flash"] and args.out is None
    for bad, match in ((["--seqlens", "4k"], "--seqlens"), (["--seqlens", "0"], "--seqlens"),
                       (["--cases", "causal,sliding"], "--cases"), (["--peers", "fa3"], "--peers"),
                       (["--rounds", "0"], "--rounds"), (["--trace", "t.svg"], "--trace")):
        with pytest.raises(SystemExit, match=match):
            bd.parse_args(bad)


def test_grid_must_split_into_equal_chunks():
    bd.check_grid([65536, 131072], ["causal", "noncausal"], 4)
    bd.check_grid([12], ["noncausal"], 4)              # contiguous: 4 chunks of 3
    with pytest.raises(SystemExit, match="8 equal chunks"):
        bd.check_grid([12], ["causal"], 4)             # zigzag: 2P chunks


def test_round_orders_are_seeded_permutations():
    names = ["a", "b", "c", "d"]
    first, again = (bd.round_orders(names, 5, random.Random(7)) for _ in range(2))
    assert first == again and all(sorted(o) == names for o in first)
    assert len({tuple(o) for o in first}) > 1


def test_ring_traffic_counts_the_shifts_of_one_forward_and_backward():
    assert bd.ring_shifts(2) == {"forward_kv": 1, "backward_kv": 1, "backward_dkv": 2, "total": 4}
    assert bd.ring_shifts(4)["total"] == 10
    kv = 2 * 32768 * 8 * 128                           # K and V elements of one rank's slice at 64k, P = 2
    assert bd.ring_bytes_per_rank(2, 65536) == kv * 2 * 2 + kv * 4 * 2


def test_summary_math_on_made_up_rounds():
    times = {"fa4_ring": [10.0, 12.0, 11.0], "fa4_1gpu": [30.0, 30.0, 33.0], "fa4_ring_nocomm": [8.0, 9.0, 10.0],
             "torch_cp_cudnn": [20.0, 21.0, 22.0], "torch_cp_flash": [15.0, 18.0, 16.5]}
    s = bd.summarize(times, world=2)
    assert s["ms_median"]["fa4_ring"] == 11.0
    assert s["scaling_efficiency"] == {"median": 1.5, "min": 1.25, "max": 1.5}   # 30/20, 30/24, 33/22
    assert s["torch_cp_sdpa"] == {"backend": "flash", "ms_median": 16.5}
    assert s["torch_cp_sdpa_over_fa4_ring"]["median"] == 1.5                     # 15/10, 18/12, 16.5/11
    e = s["exposed_comm"]
    assert e["steps"] == 4 and e["total_ms"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert e["per_step_ms"]["median"] == 0.5 and "3P - 2" in e["formula"]
    only = bd.summarize({"fa4_1gpu": [3.0]}, world=2)                            # peers that failed: no ratios
    assert set(only) == {"ms_median"}


def _fake_trace():
    def kernel(name, stream, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"stream": stream}}
    return {"traceEvents": [
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 800.0, 30.0),
        {"ph": "X", "cat": "user_annotation", "name": bd.TRACE_MARK, "ts": 950.0, "dur": 900.0},
        kernel("kernel_cutlass_kernel_fwd_0", 7, 1000.0, 400.0),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 1100.0, 500.0),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 7, 1400.0, 50.0),
        kernel("kernel_cutlass_kernel_bwd_0", 7, 1450.0, 300.0),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 900.0, "dur": 10.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "tid": 8, "ts": 1800.0, "dur": 5.0}]}


def test_trace_kernels_and_their_overlap():
    assert len(bd.kernels_from_chrome_trace(_fake_trace())) == 6          # the barrier's all-reduce too
    events = bd.kernels_from_chrome_trace(_fake_trace(), bd.TRACE_MARK)    # from the call's start on
    assert [e[0] for e in events] == [7, 20, 7, 7, 8] and events[1][3].startswith("nccl")
    assert [bd.kernel_kind(e[3]) for e in events] == ["attention", "nccl", "other", "attention", "other"]
    st = bd.overlap_stats(events)
    # NCCL 1100-1600 against attention 1000-1400 and 1450-1750: 300 + 150 of its 500 us
    assert st["nccl_us"] == 500.0 and st["nccl_under_attention_us"] == 450.0
    assert st["nccl_overlap_fraction"] == pytest.approx(0.9) and st["span_us"] == 805.0
    assert bd.overlap_stats([])["nccl_overlap_fraction"] is None


def test_timeline_picture_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "ring.png"
    events = bd.kernels_from_chrome_trace(_fake_trace(), bd.TRACE_MARK)
    bd.draw_timeline(events, str(path), "overlap of NCCL with attention")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_a_whole_cpu_run_in_one_process(tmp_path, monkeypatch):
    """--cpu-smoke in a world of one: every peer times, the ring matches the full attention, a peer that
    fails from its third call is recorded and left out, and the JSON holds the summary."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    out = tmp_path / "r.json"
    assert bd.main(["--cpu-smoke", "--seqlens", "32", "--cases", "causal", "--rounds", "2",
                    "--fail", "fa4_ring_nocomm@3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 1 and doc["command"].startswith("torchrun --nproc-per-node 1 ")
    case = doc["cases"][0]
    assert case["layout"] == "zigzag" and len(case["peers"]["fa4_ring"]["ms_rounds"]) == 2
    failed = case["peers"]["fa4_ring_nocomm"]
    assert failed["stage"] == "round 2" and "injected" in failed["error"]
    assert max(case["check"]["fa4_ring_vs_fa4_1gpu"].values()) < 1e-4
    assert "scaling_efficiency" in case["summary"] and "skipped" in case["torch_cp"]


def test_readme_table_is_generated_from_the_committed_results():
    """fa4/README.md's context-parallel table is `--table` over the committed JSON, unedited."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    docs = [json.loads((root / "benchmarks/results" / n).read_text())
            for n in ("bench_distributed_h200x2.json", "bench_distributed_h200x2_256k.json")]
    readme = (root / "fa4/README.md").read_text()
    block = readme.split("<!-- cp-table:start -->\n")[1].split("\n<!-- cp-table:end -->")[0]
    assert block == bd.markdown_table(docs)
    assert "| 2 | 128k | causal (zigzag) |" in block
