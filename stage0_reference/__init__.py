"""Stage 0: the NumPy float64 oracle. See README.md in this folder."""
from .reference import (
    attention_backward,
    attention_forward,
    attention_varlen_backward,
    attention_varlen_forward,
    default_softmax_scale,
    visible_mask,
)

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "default_softmax_scale",
    "visible_mask",
]
