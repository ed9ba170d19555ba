"""Hugging Face transformers: use fa4 as a model's attention with attn_implementation="fa4".

    from fa4.integrations.transformers import register_fa4_attention
    register_fa4_attention()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa4", dtype=torch.bfloat16)

Recent transformers models call their attention through `AttentionInterface`: a function
`(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)` with query
(B, Hq, S, D) and key/value (B, Hkv, S, D) -- *before* any repeat of the KV heads -- returning
(attn_output (B, S, Hq, Dv), attn_weights or None). `fa4_attention_forward` is that function.

Masks. transformers builds a mask per attention implementation through `AttentionMaskInterface`;
an implementation without a registered mask function gets attention_mask=None always, which
would silently ignore padding. So registration also installs `fa4_mask`, which returns None when
nothing is padded (the pure causal / bidirectional case, served by flash_attn_func) and the 2-D
boolean padding mask otherwise (served by unpadding to flash_attn_varlen_func). Causal alignment
is bottom-right, which is what decoding with a KV cache needs: the queries are the last tokens.
Sliding windows (`sliding_window`: at most that many keys back, the current one included, as the
transformers FlashAttention path reads it), logit softcapping (`softcap`) and attention sinks
(`s_aux`, gpt-oss) go to fa4's window_size / softcap / learnable_sink. 4-D masks (custom
patterns) and dropout are refused with a ValueError rather than ignored.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._api import flash_attn_func, flash_attn_varlen_func


def _refuse_unsupported(dropout):
    if dropout:
        raise ValueError(f"dropout: fa4 does not support attention dropout (got {dropout}); set the model's "
                         "attention_dropout to 0.0")


def _variants(kwargs, is_causal, q, seqlen_k):
    """transformers' sliding_window / softcap / s_aux -> fa4's window_size / softcap / learnable_sink.
    sliding_window w keeps w keys back, the current one included (transformers' FlashAttention path
    passes window_size (w - 1, w - 1), and only when the keys outnumber w: otherwise the window cuts
    nothing). The sink goes in q's dtype unless it is fp32, as fa4 takes it."""
    w = kwargs.get("sliding_window")
    window = (None, None)
    if w is not None and seqlen_k > w:
        window = (w - 1, 0 if is_causal else w - 1)
    sink = kwargs.get("s_aux")
    if sink is not None and sink.dtype not in (torch.float32, q.dtype):
        sink = sink.to(q.dtype)
    return dict(window_size=window, softcap=kwargs.get("softcap") or 0.0, learnable_sink=sink)


def _cast_for_kernel(t):
    """Models that keep norms in fp32 (PEFT) can hand us fp32 activations under autocast: run in
    the autocast dtype, like the transformers FlashAttention integration. Outside autocast an fp32
    input is an error (fa4 validation names it)."""
    if t.dtype == torch.float32 and t.is_cuda and torch.is_autocast_enabled("cuda"):
        return t.to(torch.get_autocast_dtype("cuda"))
    return t


def _unpad(x, idx):
    """(B, S, H, D) -> (tokens, H, D): the rows whose mask entry is True."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, idx)


def _cu_seqlens(mask):
    lens = mask.sum(dim=-1, dtype=torch.int32)                              # (B,)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return cu, int(lens.max()) if lens.numel() else 0                       # one host sync, as in HF's FA2 path


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs):
    """transformers AttentionInterface function. query (B, Hq, Sq, D), key/value (B, Hkv, Sk, *)
    -> (out (B, Sq, Hq, Dv), None)."""
    _refuse_unsupported(dropout)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    # (B, H, S, D) -> (B, S, H, D): views, last dim stays contiguous
    q, k, v = (_cast_for_kernel(t).transpose(1, 2) for t in (query, key, value))
    variants = _variants(kwargs, is_causal, q, k.shape[1])
    if attention_mask is None:
        return flash_attn_func(q, k, v, softmax_scale=scaling, causal=is_causal, **variants), None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"attention_mask: fa4 takes None or a 2-D (batch, kv_len) padding mask, got {shape}; "
                         "register the fa4 mask function with register_fa4_attention()")
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    mask_k = attention_mask[:, -sk:].to(torch.bool)
    mask_q = mask_k[:, -sq:]  # the queries are the last sq tokens (left padding / KV cache)
    idx_q = torch.nonzero(mask_q.reshape(-1), as_tuple=False).flatten()
    idx_k = torch.nonzero(mask_k.reshape(-1), as_tuple=False).flatten()
    cu_q, max_q = _cu_seqlens(mask_q)
    cu_k, max_k = _cu_seqlens(mask_k)
    out = flash_attn_varlen_func(_unpad(q, idx_q), _unpad(k, idx_k), _unpad(v, idx_k), cu_q, cu_k, max_q, max_k,
                                 softmax_scale=scaling, causal=is_causal, **variants)  # (tokens_q, Hq, Dv)
    full = out.new_zeros((b * sq, hq, out.shape[-1])).index_copy(0, idx_q, out)  # padded rows: 0
    return full.view(b, sq, hq, out.shape[-1]), None


def fa4_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers AttentionMaskInterface function: None when nothing is padded (the kernels do
    causal themselves), else the boolean (batch, kv_length) padding mask."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def register_fa4_attention(name: str = "fa4") -> str:
    """Register fa4 in transformers' AttentionInterface (and its mask function in
    AttentionMaskInterface when this transformers version has one) under `name`."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError("register_fa4_attention: Hugging Face transformers is not installed (or too old to have "
                          "AttentionInterface, added in 4.48): pip install 'transformers>=4.48'. fa4 itself does "
                          "not need it.") from exc
    AttentionInterface.register(name, fa4_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass  # older versions build 4-D masks themselves; fa4_attention_forward refuses those clearly
    else:
        AttentionMaskInterface.register(name, fa4_mask)
    return name
