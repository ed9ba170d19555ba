"""Input checks shared by the NumPy stages: every bad input names the argument at fault."""
from __future__ import annotations

import numpy as np


def as_float64(name: str, x) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except Exception as exc:  # e.g. a CUDA tensor, which NumPy cannot read
        raise TypeError(f"{name}: expected an array-like of numbers, got {type(x).__name__} ({exc})") from exc
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def check_dense(q, k, v):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) -> the three as float64 arrays."""
    q, k, v = as_float64("q", q), as_float64("k", k), as_float64("v", v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, seqlen, heads, head_dim), got shape {arr.shape}")
    _check_common(q, k, v, batch_axes=1)
    return q, k, v


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """Packed q (Tq,Hq,D), k (Tk,Hkv,D), v (Tk,Hkv,Dv) with int32 cu_seqlens (batch+1,)."""
    q, k, v = as_float64("q", q), as_float64("k", k), as_float64("v", v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 3:
            raise ValueError(f"{name}: expected rank 3 (total_tokens, heads, head_dim) for varlen, got shape {arr.shape}")
    _check_common(q[None], k[None], v[None], batch_axes=1)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the same length as cu_seqlens_q ({cu_q.shape[0]}), got {cu_k.shape[0]}")
    return q, k, v, cu_q, cu_k


def check_cu_seqlens(name: str, cu, total: int) -> np.ndarray:
    arr = np.asarray(cu)
    if arr.dtype != np.int32:
        raise TypeError(f"{name}: expected dtype int32, got {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D array of length batch + 1 >= 2, got shape {arr.shape}")
    if arr[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {arr[0]}")
    if np.any(np.diff(arr) < 0):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {arr.tolist()}")
    if arr[-1] != total:
        raise ValueError(f"{name}: last offset {arr[-1]} must equal the packed length {total}")
    return arr


def _check_common(q, k, v, batch_axes):
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b or v.shape[0] != b:
        raise ValueError(f"k, v: batch {bk}, {v.shape[0]} must equal q's batch {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} must equal q's head_dim {d}")
    if v.shape[1] != sk or v.shape[2] != hkv:
        raise ValueError(f"v: expected (seqlen_k, heads_kv) = ({sk}, {hkv}) like k, got ({v.shape[1]}, {v.shape[2]})")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: heads_kv = {hkv} must divide q's heads = {hq} (GQA/MQA)")
    if d == 0 or v.shape[3] == 0:
        raise ValueError("q, v: head_dim must be positive")


def _window_side(side, value):
    """One side of window_size -> a non-negative python int, or None for unlimited."""
    if value is None:
        return None
    # bool is an int subclass, but window_size=(True, False) is a bug, not a width
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"window_size: expected a pair of ints or None, got {type(value).__name__} on the {side}")
    value = int(value)
    if value == -1:  # FlashAttention-2's spelling of "unlimited"
        return None
    if value < 0:
        raise ValueError(f"window_size: {side} must be >= 0, -1 or None, got {value}")
    return value


def normalize_window(window_size, causal: bool = False):
    """window_size (left, right) -> (left, right) of python ints or None (= unlimited).

    -1 is read as None. causal=True is the window's right side at 0, so it may be combined
    with a right of None / -1 / 0 only. Query i sees key j iff
    i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q.
    """
    if window_size is None:
        window_size = (None, None)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints or None, got {window_size!r}")
    left, right = _window_side("left", window_size[0]), _window_side("right", window_size[1])
    if causal:
        if right not in (None, 0):
            raise ValueError(f"window_size: causal=True means right = 0, got right = {right}")
        right = 0
    return left, right


def check_softcap(softcap) -> float:
    """softcap -> a python float >= 0; 0 (or None) means no capping."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (0.0 <= softcap < float("inf")):  # also rejects NaN
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap}")
    return softcap


def check_learnable_sink(learnable_sink, heads_q: int):
    """learnable_sink (heads_q,) -> float64 array, or None when no sink is used."""
    if learnable_sink is None:
        return None
    sink = as_float64("learnable_sink", learnable_sink)
    if sink.shape != (heads_q,):
        raise ValueError(f"learnable_sink: expected shape ({heads_q},) (one logit per query head), got {sink.shape}")
    return sink
