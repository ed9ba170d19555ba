"""Which keys a query row sees: the sequence, causality and a sliding window, as one value.

Rows and keys are aligned at the bottom-right corner (off = seqlen_k - seqlen_q, so the last query
is the last key). Query row i sees key j when j < seqlen_k and

    i + off - left  <=  j  <=  i + off + right

where a side that is None is unlimited. Causal attention is right = 0; a sliding window of w
tokens behind the diagonal (Mistral, Gemma) is (w, 0); FlashAttention's `window_size=(-1, -1)` and
FA4's `(None, None)` are no window. The values are compile-time constants of a kernel: a model uses
one or two windows, and a constant bound folds into the block arithmetic.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from stage0_reference.validation import normalize_window


class Window(NamedTuple):
    """Visible keys of row i: [i + off - left, i + off + right]; None = unlimited that side."""

    left: Optional[int] = None
    right: Optional[int] = None

    @property
    def limited(self) -> bool:
        return self.left is not None or self.right is not None


NO_WINDOW = Window()


def make_window(causal: bool, window_size=(None, None)) -> Window:
    """(causal, window_size) -> Window, checked by the oracle's rule (stage0_reference.validation:
    -1 and None unlimited; causal is right = 0, so it may add a left window but not a right one;
    TypeError / ValueError naming window_size)."""
    return Window(*normalize_window(window_size, causal))


def beyond_causal(causal: bool, window_size=(None, None)) -> Window:
    """The window a call adds to its causal flag: make_window without causal's own right edge, so
    a causal call with no left window is NO_WINDOW (the kernels put the edge back from `causal`,
    and plain calls keep their compile-cache keys)."""
    window = make_window(causal, window_size)
    return Window(window.left, None if causal else window.right)
