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


class Window(NamedTuple):
    """Visible keys of row i: [i + off - left, i + off + right]; None = unlimited that side."""

    left: Optional[int] = None
    right: Optional[int] = None

    @property
    def limited(self) -> bool:
        return self.left is not None or self.right is not None


NO_WINDOW = Window()


def make_window(causal: bool, window_size=(None, None)) -> Window:
    """(causal, window_size) -> Window. -1 and None are unlimited; causal means right = 0, so a
    causal call may add a left window but not a right one. Raises TypeError / ValueError naming
    window_size."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints or None, got {window_size!r}")
    sides = []
    for name, w in zip(("left", "right"), window_size):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise TypeError(f"window_size: the {name} size must be an int or None, got {type(w).__name__}")
        if w is not None and w < -1:
            raise ValueError(f"window_size: the {name} size must be >= 0, or -1 / None for unlimited, got {w}")
        sides.append(None if w is None or w == -1 else int(w))
    left, right = sides
    if causal:
        if right not in (None, 0):
            raise ValueError(f"window_size: causal=True already limits the right side to 0; got right = {right}")
        right = 0
    return Window(left, right)

