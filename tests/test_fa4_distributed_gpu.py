"""fa4.distributed on GPUs: tests/distributed_worker.py under torchrun, one NCCL rank per GPU.

Each rank checks its rows of out, lse, dq, dk, dv (and the sink's gradient) against dense fp32
attention on the whole sequence, with single-GPU fa4 on the whole sequence as the baseline of
FA4's rule; causal (zigzag and contiguous), non-causal, GQA, d = 64 / 96 / 128, softcap + sink,
sliding windows, packed documents crossing ranks, and bitwise-equal deterministic reruns. A world of 1 runs on any
GPU (the ring degenerates to one local step); 2 and 4 need that many GPUs on the machine.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.fa4]

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_on_gpus(world):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world:
        pytest.skip(f"needs {world} GPUs (one NCCL rank each); this machine has {have}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", WORKER]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    print(log[-6000:])
    assert done.returncode == 0, log[-6000:]
    assert log.count("all cases passed") == world, log[-3000:]
