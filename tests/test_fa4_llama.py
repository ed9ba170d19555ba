"""A small Llama-style decoder whose attention switches between torch SDPA and fa4.

transformers is not installed on the GPU machine (and it has no internet), so the end-to-end model
check uses this self-contained model instead: token embedding, `n_layers` pre-norm blocks of
RMSNorm -> rotary GQA attention -> residual -> RMSNorm -> SwiGLU MLP -> residual, a final RMSNorm
and an untied LM head, random init. `attn` selects the attention:

    "sdpa"      torch.nn.functional.scaled_dot_product_attention on (B, H, S, D), is_causal, enable_gqa
    "fa4"       fa4.flash_attn_func on (B, S, H, D), causal
    "fa4_sdpa"  fa4.scaled_dot_product_attention, the drop-in for the first

cpu tier: the model runs with SDPA on CPU; with fa4 it refuses CPU tensors clearly; on meta tensors
torch.compile(fullgraph=True) traces forward + backward of the fa4 model with no graph break.

gpu tier (H100): one set of weights in three models -- fp32 SDPA (the reference), bf16 SDPA (the
baseline) and bf16 fa4. Logits and every parameter gradient follow FA4's rule (error vs the fp32
reference at most 2x the bf16 SDPA baseline's, plus 1e-5), and so do the losses of a few AdamW
steps (max over steps). Until the stage-4 backward lands, the gradient tests assert fa4's clear
NotImplementedError instead.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa4

NOT_LANDED = r"Hopper backward kernel has not landed"


@dataclass
class Config:
    vocab: int = 512
    dim: int = 512
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 128
    hidden: int = 1024
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # normalise in fp32, as Llama does, then back to the activation dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(seqlen, head_dim, theta, device, dtype):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv)  # (S, D/2)
    ang = torch.cat([ang, ang], dim=-1)                                                # (S, D)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):  # x (B, S, H, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


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
        q = apply_rope(self.q_proj(x).view(b, s, c.n_heads, c.head_dim), cos, sin)       # (B, S, H, D)
        k = apply_rope(self.k_proj(x).view(b, s, c.n_kv_heads, c.head_dim), cos, sin)    # (B, S, Hkv, D)
        v = self.v_proj(x).view(b, s, c.n_kv_heads, c.head_dim)
        if attn == "fa4":
            o = fa4.flash_attn_func(q, k, v, causal=True)                                 # (B, S, H, D)
        else:
            sdpa = fa4.scaled_dot_product_attention if attn == "fa4_sdpa" else F.scaled_dot_product_attention
            o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                     enable_gqa=True).transpose(1, 2)
        return self.o_proj(o.reshape(b, s, c.n_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x):  # SwiGLU
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim, c.eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.dim, c.eps), MLP(c)

    def forward(self, x, cos, sin, attn):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, c: Config, attn: str = "sdpa"):
        super().__init__()
        self.c, self.attn = c, attn
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        for p in self.parameters():  # small init keeps the logits O(1), like a trained model's
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)                                              # (B, S, dim)
        cos, sin = rope_tables(ids.shape[1], self.c.head_dim, self.c.rope_theta, ids.device, x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin, self.attn)
        return self.lm_head(self.norm(x))                                # (B, S, vocab)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.fa4
def test_model_runs_with_sdpa_and_fa4_refuses_cpu():
    torch.manual_seed(0)
    c = Config(vocab=64, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64, hidden=256)
    model = TinyLlama(c)
    ids = torch.randint(0, c.vocab, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
    model.attn = "fa4_sdpa"  # the SDPA-shaped helper refuses CPU just the same
    with pytest.raises(TypeError, match=r"^query: dtype torch.float32"):
        model(ids)
    model = model.to(torch.bfloat16)
    for attn, pattern in (("fa4", r"^q: fa4 runs on CUDA GPUs only"), ("fa4_sdpa", r"^query: fa4 runs on CUDA")):
        model.attn = attn
        with pytest.raises(ValueError, match=pattern):
            model(ids)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("attn", ["fa4", "fa4_sdpa"])
def test_model_with_fa4_compiles_fullgraph(attn):
    """torch.compile(fullgraph=True) traces a whole model using fa4, forward and backward, on meta
    tensors: no graph break (a break would raise under fullgraph)."""
    c = Config(vocab=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden=512)
    with torch.device("meta"):
        model = TinyLlama(c, attn).to(torch.bfloat16)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    targets = torch.zeros(2, 32, dtype=torch.long, device="meta")

    def step(ids, targets):  # (cross_entropy has no meta autograd kernel: a stand-in loss)
        return model(ids).float().square().mean()

    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(ids, targets)
    loss.backward()
    assert loss.shape == () and model.blocks[0].attn.q_proj.weight.grad.shape == (256, 256)
    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(ids, targets).graph_break_count == 0
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- gpu tier
def _three_models(seed=0, c=Config()):
    torch.manual_seed(seed)
    ref = TinyLlama(c, "sdpa").cuda()                           # fp32 SDPA: the reference
    base = copy.deepcopy(ref).to(torch.bfloat16)                # bf16 SDPA: the baseline
    ours = copy.deepcopy(base)
    ours.attn = "fa4"
    return ref, base, ours


def _batch(c=Config(), b=2, s=512, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randint(0, c.vocab, (b, s), device="cuda", generator=g),
            torch.randint(0, c.vocab, (b, s), device="cuda", generator=g))


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("attn", ["fa4", "fa4_sdpa"])
def test_logits_match_sdpa(attn):
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _three_models()
    ours.attn = attn
    ids, _ = _batch()
    with torch.no_grad():
        err, bound = assert_fa4_close("logits", ours(ids).float(), ref(ids), base(ids).float())
    print(f"\nlogits ({attn}): max err {err:.3e} <= FA4 bound {bound:.3e}")


@pytest.mark.gpu
@pytest.mark.fa4
def test_gradients_match_sdpa():
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _three_models()
    ids, targets = _batch()
    loss_fn(ref(ids), targets).backward()
    loss_fn(base(ids), targets).backward()
    loss = loss_fn(ours(ids), targets)
    if not fa4.supported()["archs"]["sm_90"]["backward"]:
        with pytest.raises(NotImplementedError, match=NOT_LANDED):
            loss.backward()
        return
    loss.backward()
    worst = 0.0
    for (name, p_ref), p_base, p_ours in zip(ref.named_parameters(), base.parameters(), ours.parameters()):
        err, bound = assert_fa4_close(f"grad {name}", p_ours.grad.float(), p_ref.grad, p_base.grad.float())
        worst = max(worst, err / bound)
    print(f"\ngradients: worst error / FA4 bound over {len(list(ref.parameters()))} parameters = {worst:.2f}")


@pytest.mark.gpu
@pytest.mark.fa4
def test_training_steps_losses_match():
    ref, base, ours = _three_models()
    c = Config()
    steps = 5
    losses = {}
    ids, targets = _batch(c, seed=10)  # one batch, memorised step by step: the loss must fall
    for name, model in (("ref", ref), ("base", base), ("ours", ours)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses[name] = []
        for _ in range(steps):
            loss = loss_fn(model(ids), targets)
            if name == "ours" and not fa4.supported()["archs"]["sm_90"]["backward"]:
                with pytest.raises(NotImplementedError, match=NOT_LANDED):
                    loss.backward()
                return
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    err = max(abs(a - r) for a, r in zip(losses["ours"], losses["ref"]))
    base_err = max(abs(a - r) for a, r in zip(losses["base"], losses["ref"]))
    for name, label in (("ref", "fp32 SDPA"), ("base", "bf16 SDPA"), ("ours", "bf16 fa4 ")):
        print(f"\nlosses {label}: " + " ".join(f"{x:.5f}" for x in losses[name]), end="")
    print(f"\nmax |loss - fp32 loss| over {steps} steps: fa4 {err:.2e}, bf16 SDPA {base_err:.2e}")
    assert losses["ours"][-1] < losses["ours"][0], "training did not reduce the loss"
    assert err <= 2 * base_err + 1e-5, f"fa4 loss trajectory error {err:.3e} > 2 x bf16 SDPA's {base_err:.3e} + 1e-5"
    assert all(math.isfinite(x) for x in losses["ours"])


@pytest.mark.gpu
@pytest.mark.fa4
def test_compiled_model_matches_reference():
    """torch.compile(fullgraph=True) with inductor on the real GPU: the whole model, fa4 inside."""
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _three_models()
    ids, _ = _batch()
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        err, bound = assert_fa4_close("compiled logits", compiled(ids).float(), ref(ids), base(ids).float())
    torch._dynamo.reset()
    print(f"\ncompiled model logits: max err {err:.3e} <= {bound:.3e}")
