"""Context parallelism end to end: a small Llama-style decoder trained with its sequence sharded
over P ranks (fa4.distributed.ring_attention), step for step against the same model trained on
the whole sequence on one GPU.

    # 2 H200s, one process per GPU (run from the repository root):
    torchrun --nproc-per-node 2 examples/cp_llama.py --steps 8 --seqlen 16384 --out benchmarks/results/cp_llama_h200x2.json
    # no GPU: gloo, float32, torch reference kernels, a tiny model (what tests/test_cp_llama.py runs)
    torchrun --standalone --nproc-per-node 2 examples/cp_llama.py --cpu --steps 8

The model: token embedding, pre-norm blocks (RMSNorm -> rotary GQA causal attention -> residual ->
RMSNorm -> SwiGLU -> residual), final RMSNorm, untied LM head. The attention is passed in:
fa4.flash_attn_func on the whole sequence, or fa4.distributed.ring_attention (zigzag) on this
rank's shard, whose rotary angles come from its tokens' *global* positions (cp.positions).

Each step every rank draws the same seeded batch, makes next-token labels on the full sequence and
keeps its zigzag shard of tokens and labels. Its loss is its tokens' cross-entropy summed and
divided by *all* the batch's tokens, so the losses summed over ranks are the full-sequence mean and
the replicated parameters' gradients summed over ranks (one fp32 all_reduce) are the full-sequence
gradient. Every rank builds the same init (seeded, on the CPU). GPU precision: bf16 parameters
and activations, AdamW directly on them (no fp32 master copy -- the simplest setup; updates below a
bf16 ulp are lost, e.g. on the RMSNorm weights at 1.0, alike in every run); cross-entropy in fp32.
The data: random walks token -> token + 1..4 (mod vocab), learnable (entropy floor ln 4).

Then rank 0 trains two baselines on the whole sequence on its GPU, same init, data and optimizer:
  "1gpu"  with fa4.flash_attn_func;
  "sdpa"  with torch SDPA (flash backend, GQA heads repeated) -- the noise yardstick: two correct
          bf16 attentions differ only by rounding, which AdamW carries into later steps.
Verdict (bf16), all of:
  losses: max over steps |cp - 1gpu| <= 2 x max over steps |sdpa - 1gpu| + atol (2e-3, ~2e-4 of
    the loss; FA4's "2x the baseline's error" rule). A system check: at this scale the loss is
    mostly the embedding -> head path, and even rotary at local positions (a classic CP bug)
    moved it by only ~2e-3 in a CPU bf16 trial;
  step-0 gradients (same weights in every run: no drift yet, so they show the attention), per
    parameter tensor: ||g_cp - g_1gpu|| / ||g_1gpu|| <= 2 x the same for sdpa + 2^-8 (one bf16
    rounding: each rank's partial gradient is rounded before the sum, a 1-GPU one is not). The
    sharp check: that rotary bug put the q / k projections' gradients 40% off;
  every loss finite, and the last step's loss below the first.
--cpu runs fp32 throughout (baselines: plain torch causal GQA attention and torch SDPA): losses
within 1e-5 relative, step-0 gradients within 1e-4. Rank 0 prints the per-step table and writes
the JSON (--out); every rank exits 1 when the verdict fails.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import fa4
except ImportError:  # torchrun puts examples/ on sys.path, not the repository root
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import fa4
import fa4.distributed as cp

LAYOUT = "zigzag"
CPU_RTOL = 1e-5       # --cpu (fp32): losses, relative
CPU_GRAD_RTOL = 1e-4  # --cpu: step-0 gradients, relative L2 per tensor
BF16_U = 2.0 ** -8    # bf16 unit roundoff: each rank's partial gradient is rounded once more than a 1-GPU one


@dataclass
class Config:
    vocab: int = 8192
    dim: int = 1024
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 128
    hidden: int = 2816
    rope_theta: float = 500000.0
    eps: float = 1e-5


TINY = Config(vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden=128, rope_theta=10000.0)


# --------------------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # normalise in fp32 (as Llama does), back to the activation dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(pos, head_dim, theta, dtype):
    """cos, sin (S, D) at the given global positions. Elementwise in fp32, so a position's row is
    bitwise the same whether it is computed in the full sequence or in a shard."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):  # x (B, S, H, D), rotate-half convention
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[None, :, None, :] + torch.cat([-x2, x1], dim=-1) * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin, attn):
        b, s, _ = x.shape
        c = self.c
        q = apply_rope(self.q_proj(x).view(b, s, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, s, c.n_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(b, s, c.n_kv_heads, c.head_dim)
        return self.o_proj(attn(q, k, v).reshape(b, s, c.n_heads * c.head_dim))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim, c.eps), Attention(c)
        self.mlp_norm = RMSNorm(c.dim, c.eps)
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x, cos, sin, attn):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # SwiGLU


class Llama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        for p in self.parameters():  # small init keeps the logits O(1)
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, pos, attn):
        """ids (B, S) at global positions pos (S,); attn(q, k, v) on (B, S, H, D) -> (B, S, Hq, D)."""
        x = self.embed(ids)
        cos, sin = rope_tables(pos, self.c.head_dim, self.c.rope_theta, x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin, attn)
        return self.lm_head(self.norm(x))


def build_model(c: Config, seed, device, dtype):
    """The same weights on every rank and in every run: built on the CPU from `seed`, then moved."""
    torch.manual_seed(seed)
    return Llama(c).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------- attentions
def _repeat_kv(q, k, v):
    g = q.shape[2] // k.shape[2]
    return k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)


def reference_attention(q, k, v):
    """Causal GQA attention in plain torch math (the --cpu whole-sequence baseline)."""
    k, v = _repeat_kv(q, k, v)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    n = q.shape[1]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    p = s.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def sdpa_attention(q, k, v):
    """torch SDPA, the flash backend on a GPU (the bf16 noise yardstick); GQA by repeating heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = _repeat_kv(q, k, v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


# ------------------------------------------------------------------------------------------ training
def make_batch(vocab, batch, seqlen, seed, step):
    """Inputs and next-token labels (B, S) of the full sequence, the same on every rank: random
    walks token -> token + 1..4 (mod vocab), drawn from a generator seeded by (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    jumps = torch.randint(1, 5, (batch, seqlen), generator=g)
    tokens = (start + torch.cat([torch.zeros_like(start), jumps.cumsum(1)], dim=1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])


def reduce_grads(model):
    """Sum the replicated parameters' gradients over the ranks in one fp32 all_reduce: each rank's
    are its tokens' share, so the sum is the full-sequence gradient."""
    flat = flat_grads(model)
    dist.all_reduce(flat)
    for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
        p.grad.copy_(part.view_as(p))


def train(c: Config, args, attn, device, dtype, sharded):
    """`args.steps` AdamW steps. sharded: this rank's zigzag shard of every batch, losses and
    gradients summed over the ranks. Returns the losses and seconds per step, and the step-0
    gradient (flat fp32: every run starts from the same weights, so no drift hides a difference)."""
    model = build_model(c, args.seed, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.batch * args.seqlen  # every rank divides by all tokens, not its own
    losses, seconds, grad0 = [], [], None
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids, labels = make_batch(c.vocab, args.batch, args.seqlen, args.seed, step)
        pos = torch.arange(args.seqlen)
        if sharded:
            ids, labels = (cp.shard(t, dim=1, layout=LAYOUT) for t in (ids, labels))
            pos = cp.positions(args.seqlen, layout=LAYOUT)
        ids, labels, pos = ids.to(device), labels.to(device), pos.to(device)
        logits = model(ids, pos, attn)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / total
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        if sharded:
            reduce_grads(model)
            dist.all_reduce(loss)
        if step == 0:
            grad0 = flat_grads(model)
        opt.step()
        losses.append(loss.item())  # .item() waits for the GPU: the step's time is complete
        seconds.append(time.perf_counter() - t0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "seconds": seconds, "grad0": grad0, "sizes": sizes}


def grad_errors(runs):
    """{parameter: (cp, sdpa)} relative L2 errors ||g - g_1gpu|| / ||g_1gpu|| of the step-0 gradients."""
    names, sizes = zip(*runs["1gpu"]["sizes"].items())
    ref = runs["1gpu"]["grad0"].split(sizes)
    errs = [[((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(runs[n]["grad0"].split(sizes), ref)]
            for n in ("cp", "sdpa")]
    return dict(zip(names, zip(*errs)))


# ------------------------------------------------------------------------------- verdict and report
def verdict(runs, cpu, atol):
    """The loss rule (the whole training run) and the step-0 gradient rule (per parameter tensor)."""
    cpl, full, sdpa = runs["cp"]["losses"], runs["1gpu"]["losses"], runs["sdpa"]["losses"]
    diff = max(abs(a - b) for a, b in zip(cpl, full))
    rel = max(abs(a - b) / abs(b) for a, b in zip(cpl, full))
    noise = max(abs(a - b) for a, b in zip(sdpa, full))
    grads = grad_errors(runs)
    if cpu:
        rule = (f"fp32: max |cp - 1gpu| / |1gpu| <= {CPU_RTOL:g}; step-0 grads, per tensor: "
                f"||cp - 1gpu|| / ||1gpu|| <= {CPU_GRAD_RTOL:g}")
        bound, matches = CPU_RTOL, rel <= CPU_RTOL
        gbound = {n: CPU_GRAD_RTOL for n in grads}
    else:
        rule = (f"bf16: max |cp - 1gpu| <= 2 x max |sdpa - 1gpu| + {atol:g}; step-0 grads, per tensor: "
                f"||cp - 1gpu|| / ||1gpu|| <= 2 x (the same for sdpa) + {BF16_U:g}")
        bound, matches = 2 * noise + atol, diff <= 2 * noise + atol
        gbound = {n: 2 * e_sdpa + BF16_U for n, (_, e_sdpa) in grads.items()}
    worst = max(grads, key=lambda n: grads[n][0] / gbound[n])
    finite = all(math.isfinite(x) for r in runs.values() for x in r["losses"])
    grads_match = grads[worst][0] <= gbound[worst]
    fell = cpl[-1] < cpl[0]
    return {"rule": rule, "max_abs_diff": diff, "max_rel_diff": rel, "max_abs_diff_sdpa_vs_1gpu": noise,
            "bound": bound, "matches": matches, "grad_worst_tensor": worst, "grad_worst_err_cp": grads[worst][0],
            "grad_worst_err_sdpa": grads[worst][1], "grad_worst_bound": gbound[worst], "grads_match": grads_match,
            "finite": finite, "loss_fell": fell, "passed": bool(matches and grads_match and finite and fell)}


def print_table(runs, v):
    cpl, full, sdpa = runs["cp"]["losses"], runs["1gpu"]["losses"], runs["sdpa"]["losses"]
    print(f"{'step':>4} | {'loss cp':>11} | {'loss 1-GPU':>11} | {'loss sdpa':>11} | {'|cp-1gpu|':>9} | "
          f"{'|sdpa-1gpu|':>11}")
    for i, (a, b, s) in enumerate(zip(cpl, full, sdpa)):
        print(f"{i:>4} | {a:>11.6f} | {b:>11.6f} | {s:>11.6f} | {abs(a - b):>9.2e} | {abs(s - b):>11.2e}")
    print(f"losses: max |cp - 1gpu| = {v['max_abs_diff']:.3e} (relative {v['max_rel_diff']:.3e}); "
          f"max |sdpa - 1gpu| = {v['max_abs_diff_sdpa_vs_1gpu']:.3e}; bound {v['bound']:.3e}")
    print(f"step-0 gradients, closest to its bound: {v['grad_worst_tensor']}: cp {v['grad_worst_err_cp']:.2e}, "
          f"sdpa {v['grad_worst_err_sdpa']:.2e} (relative L2 vs 1gpu; bound {v['grad_worst_bound']:.2e})")
    print(f"rule: {v['rule']}\nloss fell: {v['loss_fell']}; finite: {v['finite']}")
    print("PASS" if v["passed"] else "FAIL")


def git_commit():
    """$FA4_GIT_COMMIT (for a copy without .git), else this checkout's commit (+ "+uncommitted")."""
    git = ["git", "-C", str(pathlib.Path(__file__).resolve().parents[1])]
    try:
        rev = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "fa4", "examples"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        rev = dirty = ""
    return os.environ.get("FA4_GIT_COMMIT") or (rev + ("+uncommitted" if dirty else "") if rev else "unknown")


def write_json(path, args, c, world, runs, v, baselines):
    doc = {"example": "examples/cp_llama.py",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(),
           "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
           "world_size": world, "torch": torch.__version__, "cuda": torch.version.cuda,
           "command": f"torchrun --nproc-per-node {world} examples/cp_llama.py " + " ".join(args.argv),
           "dtype": "float32" if args.cpu else "bfloat16", "layout": LAYOUT,
           "args": {k: getattr(args, k) for k in ("steps", "seqlen", "batch", "lr", "seed", "atol", "cpu")},
           "config": asdict(c), "baselines": baselines,
           "steps": [{"step": i, "loss_cp": a, "loss_1gpu": b, "loss_sdpa": s, "abs_diff_cp": abs(a - b),
                      "abs_diff_sdpa": abs(s - b)}
                     for i, (a, b, s) in enumerate(zip(*(runs[n]["losses"] for n in ("cp", "1gpu", "sdpa"))))],
           "grad_step0_rel_err": {n: {"cp": a, "sdpa": b} for n, (a, b) in grad_errors(runs).items()},
           "seconds_per_step": {n: r["seconds"] for n, r in runs.items()},
           "verdict": v}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


# ------------------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sequence (default 16384; --cpu: 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 1; --cpu: 4)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3; --cpu: 5e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=2e-3, help="absolute slack of the bf16 loss rule")
    p.add_argument("--out", default=None, help="the JSON to write (rank 0)")
    p.add_argument("--cpu", action="store_true", help="gloo, float32, reference kernels, a tiny model")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the JSON's command line
    args.seqlen = args.seqlen or (64 if args.cpu else 16384)
    args.batch = args.batch or (4 if args.cpu else 1)
    args.lr = args.lr or (5e-3 if args.cpu else 1e-3)
    return args


def run(args):
    """Every rank: the sharded run; rank 0 then the whole-sequence baselines, the report and the
    verdict, which every rank returns (0 / 1)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    c = TINY if args.cpu else Config()
    if args.cpu:
        device, dtype, kernels = torch.device("cpu"), torch.float32, cp.ReferenceKernels()
        baselines = {"1gpu": (reference_attention, "plain torch causal GQA attention, float32, whole sequence"),
                     "sdpa": (sdpa_attention, "torch SDPA (math backend), float32, whole sequence")}
    else:
        device, dtype, kernels = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, None
        whole = functools.partial(fa4.flash_attn_func, causal=True)
        baselines = {"1gpu": (whole, "fa4.flash_attn_func, bf16, whole sequence on one GPU"),
                     "sdpa": (sdpa_attention, "torch SDPA (flash backend), bf16, whole sequence on one GPU")}
    # this rank's queries against the keys of the whole sequence, sharded over the ranks
    ring = functools.partial(cp.ring_attention, causal=True, layout=LAYOUT, kernels=kernels)
    runs = {"cp": train(c, args, ring, device, dtype, True)}
    passed = [None]
    if rank == 0:  # the other ranks wait in the broadcast below
        for name, (attn, _) in baselines.items():
            runs[name] = train(c, args, attn, device, dtype, False)
        v = verdict(runs, args.cpu, args.atol)
        print(f"{world} ranks, {'cpu float32' if args.cpu else torch.cuda.get_device_name() + ' bf16'}, "
              f"seqlen {args.seqlen} x batch {args.batch}, {args.steps} steps, {c}")
        print_table(runs, v)
        if args.out:
            write_json(args.out, args, c, world, runs, v, {n: d for n, (_, d) in baselines.items()})
            print(f"wrote {args.out}")
        passed = [v["passed"]]
    dist.broadcast_object_list(passed, src=0)
    return 0 if passed[0] else 1


def main(argv=None):
    """torchrun's entry (the group from its environment); a caller that has already started a
    group (e.g. a test, with a file:// rendezvous) keeps it."""
    args = parse_args(argv)
    if args.cpu:
        torch.set_num_threads(1)  # one core per process: P processes share the machine
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu for the gloo / float32 version")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    own = not dist.is_initialized()
    if own:  # a generous timeout: the first fa4 calls may compile kernels while other ranks wait
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    try:
        rc = run(args)
        if own:
            dist.barrier()  # no rank tears its connections down while another still reads from them
        return rc
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
