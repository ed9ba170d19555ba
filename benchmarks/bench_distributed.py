"""Context-parallel attention on 2-8 GPUs, forward + backward in paired rounds: fa4's ring against one GPU,
against itself without transfers, and against torch's own context parallelism.

    torchrun --nproc-per-node 2 -m benchmarks.bench_distributed --seqlens 65536,131072 --rounds 3 \\
        --out benchmarks/results/bench_distributed_h200x2.json [--trace PNG (beside the JSON)]

bf16, batch 1, d = 128, 32 query / 8 KV heads; causal runs shard zigzag, non-causal contiguous. A call
is `out = f(q, k, v); out.backward(dout)`. Peers: fa4_ring (fa4.distributed.ring_attention on the
shards); fa4_1gpu (fa4.flash_attn_func on the whole sequence, every GPU at once; scaling efficiency =
t_1gpu / (P t_ring)); fa4_ring_nocomm (the ring with a Ring whose shift sends nothing: the same
kernels, wrong numbers; exposed communication = t_ring - t_nocomm, per step / (3P - 2), the shifts
of one call: P-1 of K/V forward, P-1 of K/V and P of fp32 dK/dV backward); torch_cp_sdpa
(torch.distributed.tensor.experimental.context_parallel around SDPA on (B, H, S, D) buffers, head-tail
load balancing when causal, once per backend, cuDNN and flash, the faster is the peer; enable_gqa=True,
or K/V repeated to 32 heads where torch refuses it: "gqa": "repeated").

Every round times each peer once in a fresh random order, seeded alike on every rank (every rank must
run the same collectives). A call starts after a sync and dist.barrier(); its time is its CUDA-event
time, the largest over the ranks; one warmup call per peer first (it compiles). fa4_ring's output and
gradients are checked against fa4_1gpu's before timing. A peer that raises on every rank is recorded
with its message and left out (one raising on one rank only would leave the others in a collective).
Rank 0 prints progress and rewrites the JSON after every case. --trace profiles one ring call after
the first case and draws its GPU activity per CUDA stream: do the NCCL transfers run under the
attention? --cpu-smoke (hidden) runs it all on CPU: gloo, fa4's reference kernels, no torch CP.
`python -m benchmarks.bench_distributed --table RESULT.json ...` prints fa4/README.md's table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

HEADS_Q, HEADS_KV, HEAD_DIM, BATCH = 32, 8, 128, 1
CASES = {"causal": (True, "zigzag"), "noncausal": (False, "contiguous")}
PEERS = ("fa4_ring", "fa4_1gpu", "fa4_ring_nocomm", "torch_cp_sdpa")
TORCH_BACKENDS = ("cudnn", "flash")
TRACE_JSON_MAX_BYTES = 2 * 1024 * 1024
TRACE_MARK = "bench_distributed.ring_call"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
EXPOSED_FORMULA = ("exposed = t_fa4_ring - t_fa4_ring_nocomm (per round, median); per_step = exposed / (3P - 2): "
                   "a forward + backward posts P-1 K/V shifts forward, P-1 K/V and P fp32 dK/dV shifts backward")


# ------------------------------------------------------------------------------------ pure parts (CPU tests)
def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what}: expected a comma list of integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise SystemExit(f"{what}: expected positive integers, got {text!r}")
    return values


def _name_list(text: str, what: str, allowed) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise SystemExit(f"{what}: expected some of {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default=None, help="total sequence lengths (default 65536,131072)")
    ap.add_argument("--cases", default="causal,noncausal", help="causal (zigzag) and / or noncausal (contiguous)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"some of {', '.join(PEERS)}")
    ap.add_argument("--torch-backends", default=",".join(TORCH_BACKENDS), help="SDPA backends for torch_cp_sdpa")
    ap.add_argument("--torch-rotate", default="allgather", choices=("allgather", "alltoall"),
                    help="torch CP's K/V rotation (set_rotate_method; allgather is torch's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per peer before the rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results JSON (rank 0 writes it, after every case)")
    ap.add_argument("--trace", default=None, help="PNG: one ring call's kernels per CUDA stream (first case)")
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)   # gloo + reference kernels
    ap.add_argument("--fail", default="", help=argparse.SUPPRESS)                 # a peer that raises (tests)
    args = ap.parse_args(argv)
    args.seqlens = _int_list(args.seqlens or ("64,128" if args.cpu_smoke else "65536,131072"), "--seqlens")
    args.cases = _name_list(args.cases, "--cases", tuple(CASES))
    args.peers = _name_list(args.peers, "--peers", PEERS)
    args.torch_backends = _name_list(args.torch_backends, "--torch-backends", TORCH_BACKENDS)
    if args.rounds < 1 or args.warmup < 0:
        raise SystemExit(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    if args.trace and not args.trace.endswith(".png"):
        raise SystemExit(f"--trace: expected a .png path, got {args.trace!r}")
    return args


def check_grid(seqlens, cases, world: int) -> None:
    """Every sequence must split into equal chunks: 2P of them under zigzag (causal), P otherwise."""
    for case in cases:
        chunks = world * (2 if CASES[case][1] == "zigzag" else 1)
        bad = [s for s in seqlens if s % chunks]
        if bad:
            raise SystemExit(f"--seqlens: {bad} do not split into {chunks} equal chunks ({case}, {world} ranks)")


def round_orders(names, rounds: int, rng: random.Random) -> list[list[str]]:
    """A fresh random order of the peers for every round."""
    return [rng.sample(list(names), len(names)) for _ in range(rounds)]


def ring_shifts(world: int) -> dict:
    """The transfers of one ring forward + backward (fa4/distributed/_ring.py)."""
    return {"forward_kv": world - 1, "backward_kv": world - 1, "backward_dkv": world, "total": 3 * world - 2}


def ring_bytes_per_rank(world: int, seqlen: int, heads_kv=HEADS_KV, head_dim=HEAD_DIM, batch=BATCH,
                        elem_bytes=2) -> int:
    """Bytes one rank sends in a forward + backward: K and V in the inputs' dtype, dK and dV in fp32."""
    kv = 2 * batch * (seqlen // world) * heads_kv * head_dim
    shifts = ring_shifts(world)
    return kv * elem_bytes * (shifts["forward_kv"] + shifts["backward_kv"]) + kv * 4 * shifts["backward_dkv"]


def _stats(values) -> dict | None:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(times: dict, world: int) -> dict:
    """From each peer's per-round times (ms, equal lengths): medians, the best torch backend, and the
    per-round derived numbers (median, min, max over rounds): scaling efficiency, torch / fa4 ring, exposed
    communication in total and per ring shift."""
    med = {n: statistics.median(ts) for n, ts in times.items() if ts}
    out = {"ms_median": med}
    ring, one, nocomm = times.get("fa4_ring"), times.get("fa4_1gpu"), times.get("fa4_ring_nocomm")
    if ring and one:
        out["scaling_efficiency"] = _stats(t1 / (world * tr) for t1, tr in zip(one, ring))
        out["speedup_vs_1gpu"] = _stats(t1 / tr for t1, tr in zip(one, ring))
    torch_peers = {n: m for n, m in med.items() if n.startswith("torch_cp_")}
    if torch_peers:
        best = min(torch_peers, key=torch_peers.get)
        out["torch_cp_sdpa"] = {"backend": best[len("torch_cp_"):], "ms_median": torch_peers[best]}
        if ring:
            out["torch_cp_sdpa_over_fa4_ring"] = _stats(tt / tr for tt, tr in zip(times[best], ring))
    if ring and nocomm:
        steps = ring_shifts(world)["total"]
        exposed = [tr - tn for tr, tn in zip(ring, nocomm)]
        out["exposed_comm"] = {"formula": EXPOSED_FORMULA, "steps": steps, "total_ms": _stats(exposed),
                               "per_step_ms": _stats(e / steps for e in exposed),
                               "fraction_of_ring": _stats(e / tr for e, tr in zip(exposed, ring))}
    return out


def kernel_kind(name: str) -> str:
    """nccl, attention (fa4's CuTe kernels, flash / cuDNN attention) or other (merges, casts, copies)."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(w in low for w in ("cutlass", "flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    return "other"


def kernels_from_chrome_trace(doc: dict, mark: str | None = None) -> list[tuple]:
    """(stream, start_us, dur_us, name) of every GPU activity (kernels, copies, sets) of a torch.profiler
    chrome trace; with `mark`, only those from the start of the record_function range of that name on."""
    raw = doc.get("traceEvents", [])
    starts = [float(ev["ts"]) for ev in raw if mark and ev.get("name") == mark and "ts" in ev]
    t0 = min(starts, default=float("-inf"))
    events = []
    for ev in raw:
        if ev.get("ph") == "X" and ev.get("cat") in GPU_CATS and float(ev["ts"]) >= t0:
            stream = ev.get("args", {}).get("stream", ev.get("tid"))
            events.append((int(stream), float(ev["ts"]), float(ev.get("dur", 0.0)), str(ev.get("name", ""))))
    return sorted(events, key=lambda e: e[1])


def _covered(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        total += max(0.0, hi - max(lo, reach))
        reach = max(reach, hi)
    return total


def overlap_stats(events) -> dict:
    """How much of the NCCL kernels' time runs while an attention kernel runs (any stream). An NCCL
    kernel's time includes its wait for the peer, so this is an upper bound on the hidden transfer."""
    spans = {k: [(s, s + d) for _, s, d, n in events if kernel_kind(n) == k] for k in ("attention", "nccl")}
    att, nccl = _covered(spans["attention"]), _covered(spans["nccl"])
    both = att + nccl - _covered(spans["attention"] + spans["nccl"])      # |A and B| = |A| + |B| - |A or B|
    span = (max(s + d for _, s, d, _ in events) - min(s for _, s, _, _ in events)) if events else 0.0
    return {"span_us": span, "attention_us": att, "nccl_us": nccl, "nccl_under_attention_us": both,
            "nccl_overlap_fraction": both / nccl if nccl else None, "kernels": len(events)}


def draw_timeline(events, path: str, title: str) -> None:
    """One lane per CUDA stream, one box per kernel, colored by kernel_kind; x in ms from the first start."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    colors = {"attention": "tab:blue", "nccl": "tab:red", "other": "tab:gray"}
    streams = sorted({e[0] for e in events})
    t0 = min((e[1] for e in events), default=0.0)
    fig = Figure(figsize=(14, 1.6 + 0.55 * max(len(streams), 1)))
    ax = fig.add_subplot()
    for lane, stream in enumerate(streams):
        mine = [e for e in events if e[0] == stream]
        for kind, color in colors.items():
            boxes = [((s - t0) / 1e3, max(d, 0.5) / 1e3) for _, s, d, n in mine if kernel_kind(n) == kind]
            if boxes:
                ax.broken_barh(boxes, (lane - 0.38, 0.76), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_ylim(-0.6, len(streams) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


# -------------------------------------------------------------------------------------- the distributed run
def setup(args) -> SimpleNamespace:
    import torch.distributed as dist

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # a plain `python -m` run is a world of one
    cpu = args.cpu_smoke
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return SimpleNamespace(dist=dist, cpu=cpu, device=device, rank=dist.get_rank(), world=dist.get_world_size(),
                           dtype=torch.float32 if cpu else torch.bfloat16, mesh=None, args=args)


def say(env, *parts) -> None:
    if env.rank == 0:
        print(*parts, flush=True)


def _sync(env):
    if not env.cpu:
        torch.cuda.synchronize(env.device)


class Timer:
    """Times the body that `around` runs: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, env):
        self.env, self.marks = env, []

    def around(self, body):
        _sync(self.env)
        self.env.dist.barrier()    # every rank starts together: the ring's first transfer waits on no one
        self._mark()
        out = body()
        self._mark()
        return out

    def _mark(self):
        self.marks.append(time.perf_counter() if self.env.cpu else torch.cuda.Event(enable_timing=True))
        if not self.env.cpu:
            self.marks[-1].record()

    def elapsed_ms(self) -> float:
        _sync(self.env)
        a, b = self.marks
        return 1e3 * (b - a) if self.env.cpu else a.elapsed_time(b)


def run_peer(env, call, gather=False):
    """One call on every rank -> (ms: max over ranks, gathered outputs, None) or (None, None, message) when
    any rank raised; every rank gets the same verdict, so all go on down the same path."""
    timer, out, err, ms = Timer(env), None, None, 0.0
    try:
        out = call(timer.around, gather)
        ms = timer.elapsed_ms()
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result
        err = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"[rank {env.rank}] {err}", file=sys.stderr, flush=True)
    flags = torch.tensor([ms, 1.0 if err else 0.0], dtype=torch.float64, device=env.device)
    env.dist.all_reduce(flags, op=env.dist.ReduceOp.MAX)
    if flags[1].item() > 0:
        errors = [None] * env.world
        env.dist.all_gather_object(errors, err)
        first = next((r, e) for r, e in enumerate(errors) if e)
        return None, None, f"rank {first[0]}: {first[1]}"
    return flags[0].item(), out, None


def make_inputs(env, seqlen, layout, seed):
    """The whole sequence (identical on every rank: rank 0's, broadcast) and this rank's shards."""
    import fa4.distributed as cp

    g = torch.Generator(device=env.device).manual_seed(seed)
    shapes = {"q": HEADS_Q, "k": HEADS_KV, "v": HEADS_KV, "dout": HEADS_Q}
    full = {n: torch.randn(BATCH, seqlen, h, HEAD_DIM, generator=g, device=env.device, dtype=env.dtype)
            for n, h in shapes.items()}
    for t in full.values():
        env.dist.broadcast(t, src=0)
    local = {n: cp.shard(t, dim=1, layout=layout) for n, t in full.items()}
    for n in ("q", "k", "v"):
        full[n].requires_grad_(True)
        local[n].requires_grad_(True)
    return SimpleNamespace(full=full, local=local, seqlen=seqlen)


def _autograd_call(attn, leaves, dout, collect):
    """A peer's call: forward attn(), backward of dout, on fresh gradients; collect(out) when gathering."""
    def call(timed, gather):
        for t in leaves:
            t.grad = None

        def body():
            out = attn()
            out.backward(dout)
            return out
        out = timed(body)
        return collect(out) if gather else None
    return call


def peer_one_gpu(env, x, causal):
    q, k, v = (x.full[n] for n in ("q", "k", "v"))
    if env.cpu:  # the stand-in for one GPU: SDPA's math on (B, H, S, D)
        def attn():
            t = [a.transpose(1, 2) for a in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=causal, enable_gqa=True)
            return out.transpose(1, 2)
    else:
        import fa4

        attn = lambda: fa4.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    return _autograd_call(attn, (q, k, v), x.full["dout"],
                          lambda out: {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})


def _nocomm_ring(group=None):
    from fa4.distributed._ring import Ring, _Pending

    class NoCommRing(Ring):
        """The ring's schedule without its transfers: shift hands back what it was given."""

        def shift(self, tensors):
            return _Pending(tuple(tensors))
    return NoCommRing(group)


def peer_ring(env, x, causal, layout, nocomm=False):
    import fa4.distributed as cp
    from fa4.distributed._ring import RingAttention, RingCall

    kernels = cp.ReferenceKernels() if env.cpu else cp.Fa4Kernels()
    q, k, v = (x.local[n] for n in ("q", "k", "v"))
    if nocomm:
        rc = RingCall(_nocomm_ring(), kernels, HEAD_DIM ** -0.5, causal, layout, 0.0, False, False)
        attn = lambda: RingAttention.apply(q, k, v, None, rc)[0]  # noqa: E731
    else:
        attn = lambda: cp.ring_attention(q, k, v, causal=causal, layout=layout, kernels=kernels)  # noqa: E731

    def collect(out):  # every rank's rows, in sequence order
        parts = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        return {n: cp.unshard(t, dim=1, layout=layout) for n, t in parts.items()}
    return _autograd_call(attn, (q, k, v), x.local["dout"], collect)


def _torch_cp_api():
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._attention import (_cp_options, context_parallel_unshard,
                                                                      set_rotate_method)
    except ImportError:  # where the module moved (torch >= 2.10 keeps the old path as a stub)
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options, context_parallel_unshard, set_rotate_method)
    return context_parallel, context_parallel_unshard, _cp_options, set_rotate_method


def peer_torch_cp(env, x, causal, backend, gqa_native):
    """torch's context parallelism: SDPA on global (B, H, S, D) buffers that context_parallel shards in
    place (and restores on exit); forward and backward inside the context, only they are timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    context_parallel, unshard, options, set_rotate = _torch_cp_api()
    set_rotate(env.args.torch_rotate)
    if env.mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        env.mesh = init_device_mesh("cuda", (env.world,))
    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    q, k, v = (x.full[n].detach().transpose(1, 2).contiguous() for n in ("q", "k", "v"))
    if not gqa_native:
        k, v = (t.repeat_interleave(HEADS_Q // HEADS_KV, dim=1) for t in (k, v))
    dout = x.full["dout"].transpose(1, 2)[:, :, : x.seqlen // env.world].contiguous()  # a local-shaped gradient

    def call(timed, gather):
        options.enable_load_balance = causal          # head-tail (zigzag) order; torch refuses it without causal
        with context_parallel(env.mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            ql, kl, vl = (t.detach().requires_grad_(True) for t in (q, k, v))

            def body():
                with sdpa_kernel([sdpa_backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, is_causal=causal,
                                                                           enable_gqa=gqa_native)
                    out.backward(dout)
                return out
            out = timed(body)
            if not gather:
                return None
            try:  # the check only: the same on every rank, so catching it here desyncs nothing
                return {"out": unshard(env.mesh, [out.detach()], [2])[0].transpose(1, 2)}
            except Exception as e:  # noqa: BLE001
                return {"unshard_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return call


def max_diffs(env, ref: dict, got: dict) -> dict:
    """max |got - ref| per common tensor, the largest over the ranks."""
    names = [n for n in ("out", "dq", "dk", "dv") if n in ref and n in got]
    diffs = torch.tensor([(got[n].float() - ref[n].float()).abs().max().item() for n in names],
                         dtype=torch.float64, device=env.device)
    env.dist.all_reduce(diffs, op=env.dist.ReduceOp.MAX)
    return dict(zip(names, diffs.tolist()))


def _maybe_fail(env, name, call):
    """--fail NAME[@N] (hidden, for tests): the peer raises on every rank from its N-th call on."""
    spec = dict((f.split("@") + ["1"])[:2] for f in env.args.fail.split(",") if f)
    if name not in spec:
        return call
    calls = [0]

    def failing(timed, gather):
        calls[0] += 1
        if calls[0] >= int(spec[name]):
            raise RuntimeError(f"{name}: failure injected by --fail")
        return call(timed, gather)
    return failing


def build_peers(env, x, causal, layout, record):
    """name -> call of every peer that survives its warmup; the correctness checks on the first calls.
    record: the case's JSON (errors, checks, torch CP details go into it)."""
    peers, ref = {}, None
    builders = {"fa4_1gpu": lambda: peer_one_gpu(env, x, causal),
                "fa4_ring": lambda: peer_ring(env, x, causal, layout),
                "fa4_ring_nocomm": lambda: peer_ring(env, x, causal, layout, nocomm=True)}
    for name in [n for n in ("fa4_1gpu", "fa4_ring", "fa4_ring_nocomm") if n in env.args.peers]:
        call = _maybe_fail(env, name, builders[name]())
        outs, err = _warm(env, name, call, gather=name in ("fa4_1gpu", "fa4_ring"))
        if err:
            record["peers"][name] = {"error": err, "stage": "warmup"}
            continue
        peers[name] = call
        if name == "fa4_1gpu":
            ref = outs
        elif name == "fa4_ring" and ref is not None:
            record["check"]["fa4_ring_vs_fa4_1gpu"] = d = max_diffs(env, ref, outs)
            say(env, "  check fa4_ring vs fa4_1gpu: max |diff| " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
        del outs
    if "torch_cp_sdpa" in env.args.peers:
        if env.cpu:
            record["torch_cp"] = {"skipped": "--cpu-smoke: torch CP's SDPA handlers are CUDA kernels"}
        else:
            _build_torch_peers(env, x, causal, record, peers, ref)
    return peers


def _warm(env, name, call, gather):
    """The warmup calls (the first one compiles): (outputs of the last, None) or (None, error)."""
    outs = None
    for i in range(max(env.args.warmup, 1 if gather else 0)):
        ms, outs, err = run_peer(env, call, gather=gather and i == 0)
        if err:
            say(env, f"  {name}: FAILED in warmup: {err}")
            return None, err
        say(env, f"  {name}: warmup {ms:.1f} ms")
    return outs, None


def _build_torch_peers(env, x, causal, record, peers, ref):
    info = record["torch_cp"] = {"rotate_method": env.args.torch_rotate, "load_balance": causal, "backends": {}}
    for backend in env.args.torch_backends:
        name, entry = f"torch_cp_{backend}", {}
        for native in (True, False):
            try:
                call = _maybe_fail(env, name, peer_torch_cp(env, x, causal, backend, native))
                build_err = None
            except Exception as e:  # noqa: BLE001 - the same on every rank (no collective ran)
                call, build_err = None, f"{type(e).__name__}: {str(e)[:400]}"
            outs, err = _warm(env, name, call, gather=ref is not None) if call else (None, build_err)
            if err is None:
                entry["gqa"] = "native" if native else "repeated"
                peers[name] = call
                if ref is not None and outs is not None:
                    entry["max_abs_diff_out_vs_fa4_1gpu"] = max_diffs(env, ref, outs).get("out")
                    entry.update({k: v for k, v in outs.items() if k == "unshard_error"})
                break
            entry["gqa_native_error" if native else "error"] = err
        info["backends"][backend] = entry
        if name not in peers:
            record["peers"][name] = {"error": entry.get("error"), "stage": "warmup"}


def time_rounds(env, peers, rounds, rng, label, record) -> dict:
    """Paired rounds: name -> per-round ms of each peer that never failed."""
    times = {n: [] for n in peers}
    for i, order in enumerate(round_orders(list(peers), rounds, rng)):
        line = []
        for name in order:
            if name not in times:
                continue      # failed earlier in this case
            ms, _, err = run_peer(env, peers[name])
            if err:
                record["peers"][name] = {"error": err, "stage": f"round {i + 1}"}
                del times[name]
                line.append(f"{name} FAILED")
                continue
            times[name].append(ms)
            line.append(f"{name} {ms:.2f}")
        say(env, f"  {label} round {i + 1}/{rounds}: " + " | ".join(line) + " ms")
    return times


def run_case(env, seqlen, case, rng, case_index) -> dict:
    causal, layout = CASES[case]
    label = f"s={seqlen} {case}"
    record = {"seqlen": seqlen, "causal": causal, "layout": layout, "tokens_per_rank": seqlen // env.world,
              "ring_bytes_sent_per_rank": ring_bytes_per_rank(env.world, seqlen,
                                                              elem_bytes=torch.finfo(env.dtype).bits // 8),
              "peers": {}, "check": {}}
    say(env, f"{label} ({layout}, {env.world} ranks)")
    x = make_inputs(env, seqlen, layout, seed=env.args.seed * 1000 + case_index)
    peers = build_peers(env, x, causal, layout, record)
    times = time_rounds(env, peers, env.args.rounds, rng, label, record)
    for name, ts in times.items():
        record["peers"][name] = {"ms_rounds": ts, "ms_median": statistics.median(ts)}
    record["summary"] = s = summarize(times, env.world)
    _print_summary(env, label, s)
    if env.args.trace and case_index == 0 and "fa4_ring" in peers:
        record["trace"] = capture_trace(env, peers["fa4_ring"], f"{label}, {env.world} GPUs")
    del x, peers
    if not env.cpu:
        torch.cuda.empty_cache()
    return record


def _print_summary(env, label, s):
    parts = [f"{n} {m:.2f} ms" for n, m in s["ms_median"].items()]
    if "scaling_efficiency" in s:
        parts.append(f"efficiency {s['scaling_efficiency']['median']:.3f}")
    if "torch_cp_sdpa_over_fa4_ring" in s:
        parts.append(f"torch/fa4 ring x{s['torch_cp_sdpa_over_fa4_ring']['median']:.3f}")
    if "exposed_comm" in s:
        e = s["exposed_comm"]
        parts.append(f"exposed comm {e['total_ms']['median']:.2f} ms ({e['per_step_ms']['median']:.3f} ms/step)")
    say(env, f"  {label} medians: " + "; ".join(parts))


def capture_trace(env, call, label) -> dict:
    """One ring call under torch.profiler on every rank; rank 0 draws its kernels (and keeps a GPU-only
    chrome trace beside the PNG when it is small)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(body):  # the window to draw starts after the barrier (its all-reduce is no ring transfer)
        with record_function(TRACE_MARK):
            return body()

    prof = profile(activities=[ProfilerActivity.CPU] + ([] if env.cpu else [ProfilerActivity.CUDA]))
    with prof:
        _, _, err = run_peer(env, lambda timed, gather: call(lambda body: timed(lambda: marked(body)), gather))
    if err:
        return {"error": err}
    if env.rank != 0:
        return {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw) as f:
                doc = json.load(f)
        events = kernels_from_chrome_trace(doc, TRACE_MARK)
        stats = overlap_stats(events)
        frac = stats["nccl_overlap_fraction"]
        title = (f"fa4 ring attention fwd+bwd ({label}), rank 0: overlap of the ring's NCCL transfers with the "
                 f"attention kernels = {'n/a' if frac is None else f'{frac:.0%}'} of NCCL kernel time")
        draw_timeline(events, env.args.trace, title)
        out = {"png": env.args.trace, **stats}
        small = {"traceEvents": [e for e in doc.get("traceEvents", []) if e.get("cat") in GPU_CATS]}
        text = json.dumps(small)
        if len(text) <= TRACE_JSON_MAX_BYTES:
            with open(env.args.trace[:-4] + ".json", "w") as f:
                f.write(text)
            out["chrome_trace"] = env.args.trace[:-4] + ".json"
        say(env, f"  trace: {env.args.trace} ({len(events)} GPU activities, NCCL overlap {frac})")
        return out
    except Exception as e:  # noqa: BLE001 - rank 0 alone here: no collective to miss
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def _git_commit() -> str:
    """$FA4_GIT_COMMIT (a copy without .git), else `git rev-parse --short HEAD`, else "unknown"."""
    try:
        return os.environ.get("FA4_GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata(env, argv) -> dict:
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        nccl = None if env.cpu else torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    except Exception:  # noqa: BLE001 - optional
        versions["nccl"] = None
    return {"benchmark": "benchmarks.bench_distributed",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git_commit(), "device": "cpu (smoke)" if env.cpu else torch.cuda.get_device_name(env.device),
            "world_size": env.world, "backend": env.dist.get_backend(), "versions": versions,
            "command": f"torchrun --nproc-per-node {env.world} -m benchmarks.bench_distributed " + " ".join(argv),
            "shapes": {"dtype": str(env.dtype).replace("torch.", ""), "batch": BATCH, "head_dim": HEAD_DIM,
                       "heads_q": HEADS_Q, "heads_kv": HEADS_KV},
            "method": (f"{env.args.rounds} paired rounds, random order (seed {env.args.seed}), {env.args.warmup} "
                       "warmup call(s) per peer; each call is forward + backward after a sync and dist.barrier(), "
                       "CUDA-event time, max over ranks; scaling_efficiency = t_fa4_1gpu / (P t_fa4_ring); "
                       "derived numbers are per round, then median / min / max"),
            "exposed_comm_formula": EXPOSED_FORMULA}


def write_json(path, doc) -> None:
    """Rank 0 only: a failure is printed, not raised (the other ranks would wait for it forever)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as e:
        print(f"could not write {path}: {e}", file=sys.stderr, flush=True)


def markdown_table(docs) -> str:
    """The README's table from result files: one row per (seqlen, mask), ratios the medians of per-round ones."""
    rows = ["| GPUs | tokens | mask | 1 GPU (ms) | fa4 ring (ms) | scaling efficiency | exposed comm (ms, per step) "
            "| torch CP SDPA (ms, backend) | torch CP / fa4 ring |", "|---" * 9 + "|"]
    for doc in docs:
        for c in sorted(doc["cases"], key=lambda c: (c["seqlen"], not c["causal"])):
            s = c["summary"]
            ms, torch_cp = s["ms_median"], s.get("torch_cp_sdpa") or {}
            ratio = (s.get("torch_cp_sdpa_over_fa4_ring") or {}).get("median")
            rows.append(f"| {doc['world_size']} | {c['seqlen'] // 1024}k | {'causal' if c['causal'] else 'none'} "
                        f"({c['layout']}) | {ms['fa4_1gpu']:.0f} | {ms['fa4_ring']:.0f} "
                        f"| {s['scaling_efficiency']['median']:.3f} "
                        f"| {s['exposed_comm']['total_ms']['median']:.1f} ({s['exposed_comm']['per_step_ms']['median']:.1f}) "
                        f"| {torch_cp.get('ms_median', float('nan')):.0f} ({torch_cp.get('backend', '-')}) "
                        f"| {'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:  # python -m benchmarks.bench_distributed --table RESULT.json ...
        docs = []
        for path in argv[1:]:
            with open(path) as f:
                docs.append(json.load(f))
        print(markdown_table(docs))
        return 0
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_distributed needs CUDA GPUs (run it under torchrun, one GPU per rank)")
        return 2
    check_grid(args.seqlens, args.cases, int(os.environ.get("WORLD_SIZE", "1")))
    env = setup(args)
    doc = {**metadata(env, argv), "cases": []}
    rng = random.Random(args.seed)     # the same on every rank: the same order of calls
    for i, (seqlen, case) in enumerate((s, c) for s in args.seqlens for c in args.cases):
        doc["cases"].append(run_case(env, seqlen, case, rng, i))
        if args.out and env.rank == 0:
            write_json(args.out, doc)
    say(env, f"done: {len(doc['cases'])} case(s)" + (f", {args.out}" if args.out else ""))
    env.dist.barrier()
    env.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
