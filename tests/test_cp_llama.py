"""examples/cp_llama.py on CPU: a small Llama trained with its sequence sharded over 2 gloo
processes (ring attention with the torch reference kernels) matches the same model trained on the
whole sequence, step for step, and the loss falls; a sharded run that rotates its tokens by their
*local* positions (the classic context-parallel bug) is caught by the example's own verdict, in
the losses and, far more clearly, in the step-0 gradients of the q / k projections.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import sys
import tempfile

import pytest
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cp_llama.py"

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


def _load_example():
    spec = importlib.util.spec_from_file_location("cp_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _train_worker(rank, world, init_file, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rc = _load_example().main(["--cpu", "--steps", "8", "--out", out])
        dist.barrier()  # no rank tears its connections down while another still reads from them
        assert rc == 0, f"rank {rank}: the example's verdict failed"
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def _exit_cleanly():
    """A finished rank leaves without running C++ static destructors: one of them (a joinable
    thread, "terminate called without an active exception") aborted about 1 passing run in 4 on a
    loaded 2-core machine, with or without a barrier first. Not yet traced to its owner."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_sharded_training_matches_the_whole_sequence_and_learns(tmp_path):
    """The example's main() in 2 gloo processes (a file:// rendezvous: torchrun's agent once
    aborted a finished, passing run at teardown on a loaded 2-core machine), exit code 0 on
    every rank and the JSON's losses. The GPU command line is torchrun's (the docstring)."""
    out = tmp_path / "cp_llama_cpu.json"
    mp.spawn(_train_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["device"] == "cpu" and doc["layout"] == "zigzag"
    steps = doc["steps"]
    assert [s["step"] for s in steps] == list(range(8))
    cp_losses = [s["loss_cp"] for s in steps]
    full = [s["loss_1gpu"] for s in steps]
    assert all(math.isfinite(x) for x in cp_losses + full)
    # fp32 throughout: the ring (lse merge, summed gradients) changes only the rounding
    worst = max(abs(a - b) / abs(b) for a, b in zip(cp_losses, full))
    assert worst <= 1e-5, f"sharded vs whole-sequence losses differ by {worst:.2e} relative"
    assert max(abs(s["loss_sdpa"] - b) for s, b in zip(steps, full)) <= 1e-4  # the two whole-sequence runs agree
    # it trains: from about ln(vocab) at init clearly down (the data's floor is ln 4)
    assert abs(cp_losses[0] - math.log(doc["config"]["vocab"])) < 0.3
    assert cp_losses[-1] < cp_losses[0] - 0.5, cp_losses
    # the step-0 gradient of every parameter tensor, summed over the ranks, is the whole sequence's
    grads = doc["grad_step0_rel_err"]
    assert len(grads) == 3 + 9 * doc["config"]["n_layers"] and "blocks.0.attn.q_proj.weight" in grads
    assert max(g["cp"] for g in grads.values()) <= 1e-4, grads
    assert doc["verdict"]["passed"] is True and doc["verdict"]["max_rel_diff"] == pytest.approx(worst)
    assert doc["git_commit"] and doc["torch"] and doc["command"]


def _local_positions_worker(rank, world, init_file, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        example = _load_example()
        # the bug: rotary angles from the shard's own 0..S/P-1 instead of the tokens' global positions
        example.cp.positions = lambda seqlen, **kw: torch.arange(seqlen // dist.get_world_size())
        rc = example.main(["--cpu", "--steps", "2", "--out", out])
        dist.barrier()
        assert rc == 1, f"rank {rank}: the verdict passed a run with local rotary positions"
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def test_local_rotary_positions_fail_the_verdict():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bad.json")
        mp.spawn(_local_positions_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        v = json.loads(pathlib.Path(out).read_text())["verdict"]
    assert not v["passed"] and not v["matches"] and v["max_rel_diff"] > 1e-4, v  # 10x the tolerance
    # the sharp symptom: the rotary (q / k) gradients are far off
    assert not v["grads_match"] and v["grad_worst_tensor"].endswith(("q_proj.weight", "k_proj.weight"))
    assert v["grad_worst_err_cp"] > 1e-2, v
