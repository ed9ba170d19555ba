"""Input checks that run before anything is launched.

Every failure is a TypeError (wrong kind of thing: not a tensor, wrong dtype) or a ValueError
(right kind, wrong value: shape, device, head dim), and its message starts with the name of the
argument at fault, so a user of a 30-layer model can tell which tensor of which call is wrong.

Cheap checks (metadata only: dtype, device, rank, shape, strides) always run; they cost
microseconds of Python and no GPU work, and they run at trace time under torch.compile.

Checks of *values* inside cu_seqlens / seqused_k need the numbers on the host, i.e. a device to
host copy, which synchronises the stream (tens of microseconds plus draining all queued work),
is illegal during CUDA-graph capture, and breaks a torch.compile graph. So they are opt-in:
set FA4_VALIDATE=1 while debugging (they are skipped during compile tracing and graph capture
even then). Without them a malformed cu_seqlens gives wrong output or an illegal memory access,
exactly as in FlashAttention.

Layout decision: a last dimension with stride != 1 is made contiguous (one copy) rather than
refused -- it is always correct, it is what FlashAttention does, and it is differentiable. The
kernels need 16-byte aligned strides for TMA; the stage-3 host code copies misaligned inputs.
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from ._dispatch import all_head_dims, supported_devices_text
from ._layouts import HEAD_DIM_STEP, MAX_HEAD_DIM, VarlenLayout, arch_of, head_dim_ok, refuse_pair_without_backward

_DTYPES = (torch.float16, torch.bfloat16)
MAX_GRID_YZ = 65535  # a CUDA grid's y / z extent: the kernels put heads and sequences there


def values_check_enabled() -> bool:
    """FA4_VALIDATE=1 turns on the checks that read cu_seqlens / seqused_k values (one sync)."""
    if torch.compiler.is_compiling():
        return False  # .tolist() would break the graph; the eager run validates instead
    if os.environ.get("FA4_VALIDATE", "0") in ("", "0", "false", "False"):
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # a sync inside CUDA-graph capture is an error
    return True


def _is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_flag(name, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")


# The smallest softmax_scale accepted. The forward's rescale vote keeps m + tau / (scale * log2 e)
# per row in fp32 (tau <= 64): finite for every scale from here up. Real scales are ~1/sqrt(d).
# The Hopper forward checks the same bound (MIN_SOFTMAX_SCALE there; a cpu test keeps them equal).
MIN_SOFTMAX_SCALE = 2.0 ** -100
# The largest softmax_scale / softcap accepted: the kernels hold them (times log2 e) in fp32, finite below 2**128.
MAX_FP32_SCALE = 2.0 ** 100


def _finite_real(x) -> float:
    """float(x), or inf where it does not fit a double (a huge int): compared, never raised."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def check_softmax_scale(name, scale, head_dim) -> float:
    """None -> 1/sqrt(head_dim); otherwise a finite real number >= MIN_SOFTMAX_SCALE (bool is
    refused: it is an int in Python, and `scale=True` is certainly a bug)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name}: expected a float or None, got {type(scale).__name__}")
    if isinstance(scale, numbers.Real) and not MIN_SOFTMAX_SCALE <= _finite_real(scale) <= MAX_FP32_SCALE:
        # the kernels track the row maximum of the raw scores: a negative scale would turn it
        # into the minimum, so only finite positive scales are meaningful
        raise ValueError(f"{name}: must be finite and >= 2**-100 and <= 2**100 (> 0, and the kernels' fp32 "
                         f"softmax divides by it and holds it times log2 e), got {scale}")
    return float(scale)


def _check_dtypes_devices(names, tensors):
    for n, t in zip(names, tensors):
        _is_tensor(n, t)
    q = tensors[0]
    if q.dtype not in _DTYPES:
        raise TypeError(f"{names[0]}: dtype {q.dtype} is not supported; fa4 takes torch.float16 or torch.bfloat16")
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise TypeError(f"{n}: dtype {t.dtype} differs from {names[0]}'s {q.dtype}; all three must match")
    # meta tensors are accepted: they trace shapes (torch.compile, FakeTensor, model surgery)
    # through the fake kernels and never reach a launch.
    if q.device.type not in ("cuda", "meta"):
        raise ValueError(f"{names[0]}: fa4 runs on CUDA GPUs only, got a {q.device.type} tensor. "
                         f"Supported: {supported_devices_text()}.")
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != q.device:
            raise ValueError(f"{n}: is on {t.device} but {names[0]} is on {q.device}; "
                             "all tensors must share one device")


def _check_head_dims(names, d, dv):
    """Any (qk, v) pair of multiples of 8 up to 256 (the official interface's rule on Hopper); pairs
    without a kernel of their own run zero-padded on a native one (fa4._layouts.pad_head_dims)."""
    for name, x in ((names[0], d), (names[2], dv)):
        if not head_dim_ok(x):
            native = ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in all_head_dims())
            raise ValueError(f"{name}: head_dim {x} is not supported; fa4 takes head dims that are multiples of "
                             f"{HEAD_DIM_STEP} up to {MAX_HEAD_DIM} (native kernels, qk/v: {native})")


def _check_heads(names, hq, hkv):
    if hkv == 0 and hq != 0:
        raise ValueError(f"{names[1]}: has 0 heads but {names[0]} has {hq}")
    if hkv and hq % hkv != 0:
        raise ValueError(f"{names[1]}: heads_kv ({hkv}) must divide {names[0]}'s heads ({hq}) (GQA/MQA)")


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def check_grid(name: str, sequences: int, heads: int, what: str = "batch"):
    """Before any copy or launch: the kernels' grids take the sequences and the query heads on their y / z
    axes, each at most MAX_GRID_YZ. `what` says how `sequences` came from the caller's arguments."""
    if sequences > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"{name}: {what} ({sequences}) and heads ({heads}) must be <= {MAX_GRID_YZ} (the kernels' "
                         "grid y / z limit); split the batch into calls of fewer sequences")


def check_fixed(q, k, v, softmax_scale, causal, deterministic=False, return_lse=False,
                names=("q", "k", "v"), scale_name="softmax_scale"):
    """(B, S, H, D) inputs of flash_attn_func. Returns (q, k, v, scale) ready for the op."""
    _check_dtypes_devices(names, (q, k, v))
    for n, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected rank 4 (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"{names[1]}: batch {bk} differs from {names[0]}'s batch {b}")
    if dk != d:
        raise ValueError(f"{names[1]}: head_dim {dk} differs from {names[0]}'s head_dim {d}")
    if tuple(v.shape[:3]) != (bk, sk, hkv):
        raise ValueError(f"{names[2]}: shape {tuple(v.shape)} must match {names[1]} {tuple(k.shape)} "
                         "in (batch, seqlen, heads)")
    _check_heads(names, hq, hkv)
    _check_head_dims(names, d, v.shape[3])
    check_grid(names[0], b, hq)
    _check_flag("causal", causal)
    _check_flag("deterministic", deterministic)
    _check_flag("return_lse", return_lse)
    scale = check_softmax_scale(scale_name, softmax_scale, d)
    return _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), scale


def _window_side(side, value):
    """One side of window_size -> None (unlimited) or an int >= 0; -1 is FlashAttention-2's None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"window_size: expected a pair (left, right) of ints or None, got {type(value).__name__} "
                        f"{value!r} on the {side}")
    if isinstance(value, torch.SymInt):
        return value
    value = int(value)
    if value == -1:
        return None
    if value < 0:
        raise ValueError(f"window_size: {side} must be >= 0, -1 or None (unlimited), got {value}")
    return value


def check_window(window_size, causal: bool):
    """window_size (left, right) + causal -> (left, right, causal) as the kernels take them.

    Query i sees key j iff i + off - left <= j <= i + off + right (off = seqlen_k - seqlen_q, the
    bottom-right alignment of causal); None (or -1) is unlimited on that side. causal=True is a
    right side of 0, so it combines with right in (None, -1, 0) only; a non-causal right of 0 *is*
    causal. The result always spells that one way: causal=True and right=None."""
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints or None, got {window_size!r}")
    left, right = _window_side("left", window_size[0]), _window_side("right", window_size[1])
    if causal and right not in (None, 0):
        raise ValueError(f"window_size: causal=True means a right window of 0, got right = {right} "
                         "(pass None, -1 or 0, or causal=False)")
    if isinstance(right, int) and right == 0:
        causal = True
    return left, None if causal else right, causal


def check_softcap(softcap) -> float:
    """softcap -> a float >= 0 (0 or None: no capping; > 0: scores become softcap * tanh(s / softcap))."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if isinstance(softcap, (torch.SymFloat, torch.SymInt)):
        return softcap
    if not 0 <= _finite_real(softcap) <= MAX_FP32_SCALE:
        raise ValueError(f"softcap: must be finite and >= 0 and <= 2**100 (0 = no capping; the kernels hold it "
                         f"in fp32), got {softcap}")
    return float(softcap)


def check_learnable_sink(learnable_sink, q):
    """None, or one logit per query head: shape (heads_q,), float32 or q's dtype, on q's device.
    heads_q is q.shape[-2] for both layouts ((B, S, H, D) and packed (T, H, D))."""
    if learnable_sink is None:
        return None
    _is_tensor("learnable_sink", learnable_sink)
    if learnable_sink.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"learnable_sink: dtype {learnable_sink.dtype} is not supported; use torch.float32 or "
                        f"q's dtype {q.dtype}")
    hq = q.shape[-2]
    if tuple(learnable_sink.shape) != (hq,):
        raise ValueError(f"learnable_sink: expected shape ({hq},) (one logit per query head), got "
                         f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != q.device:
        raise ValueError(f"learnable_sink: is on {learnable_sink.device} but q is on {q.device}; keep it on "
                         "q's device")
    return learnable_sink.contiguous()


def check_variants(q, causal, window_size, softcap, learnable_sink):
    """The attention variants of flash_attn_func / flash_attn_varlen_func (after the main checks,
    which have vetted q and the causal flag) -> (left, right, causal, softcap, learnable_sink)."""
    left, right, causal = check_window(window_size, causal)
    return left, right, causal, check_softcap(softcap), check_learnable_sink(learnable_sink, q)


def check_unservable(num_splits=1, pack_gqa=None, dropout_p=0.0):
    """The official interface's (and FlashAttention-2's) keywords that fa4 takes only at their
    no-op values: num_splits <= 1 (1 = no split; 0 or negative = the official's automatic choice:
    fa4's own), pack_gqa None, dropout_p 0. Anything else is a ValueError
    naming the argument (a TypeError for the wrong kind), raised before a launch."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__} {num_splits!r}")
    if isinstance(num_splits, numbers.Integral) and num_splits > 1:
        raise ValueError(f"num_splits: flash_attn_func / flash_attn_varlen_func take no split count, got "
                         f"{num_splits}; pass 1, or 0 for the automatic choice (fa4 splits keys itself where "
                         "that pays; flash_attn_with_kvcache takes num_splits)")
    if pack_gqa is not None:
        if not isinstance(pack_gqa, bool):
            raise TypeError(f"pack_gqa: expected None or a bool, got {type(pack_gqa).__name__} {pack_gqa!r}")
        raise ValueError(f"pack_gqa: fa4 picks its GQA layout itself (each query head reads its KV head; there is "
                         f"no packed-GQA switch to force), got {pack_gqa}; pass None")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__} {dropout_p!r}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: fa4 does not support attention dropout, got {dropout_p}; pass 0.0 (the "
                         "FlashAttention-2 keyword is accepted only at its no-op value)")


def check_varlen_arch(q, seqused_k):
    """seqused_k on an arch whose varlen forward lacks it (fa4._dispatch.ArchInfo.lacks): a ValueError
    naming it before any page gather, import or launch."""
    if seqused_k is None or not isinstance(q, torch.Tensor):
        return
    arch = arch_of(q.device)
    if "seqused_k" in arch.lacks:
        raise ValueError(f"seqused_k: not implemented by the {arch.key} varlen forward; pass k / v with only the "
                         "used keys (cu_seqlens_k), or run on an arch that has it")


def _check_int(name, x, *, minimum=0):
    if isinstance(x, bool) or not isinstance(x, (int, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__} {x!r}")
    if isinstance(x, int) and x < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {x}")


def _check_index_tensor(name, t, q, length=None, what="batch + 1", dims=1, layout="1-D"):
    _is_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: dtype must be torch.int32, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: must be {layout}, got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name}: is on {t.device} but q is on {q.device}; keep it on q's device")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name}: length {t.shape[0]} != {what} = {length}")


def check_varlen_sides(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, page_table=None,
                       seqused_q=None, seqused_k=None, learnable_sink=None):
    """The two sides of a flash_attn_varlen_func call, each packed ((total, H, D) with its cu_seqlens)
    or padded ((batch, seqlen, H, D) with cu_seqlens None), checked and brought to the packed form.
    A paged k / v (page_table) is gathered into the padded form first (`VarlenLayout.unpage`).
    Returns (q, k, v, cu_q, cu_k, max_q, max_k, padded_q, seqlen_k): a padded side's max_seqlen defaults
    to its seqlen, padded_q is (batch, seqlen_q) when q came padded, seqlen_k k's seqlen when k came
    padded; else None."""
    names = ("q", "k", "v")
    _check_dtypes_devices(names, (q, k, v))
    if page_table is not None:
        check_page_table(q, k, v, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k)
        refuse_pair_without_backward(q, k, v, sink=learnable_sink)  # before the pages are copied
        k, v = VarlenLayout.unpage(k, v, page_table)
    sides = {"q": (q, cu_seqlens_q), "k": (k, cu_seqlens_k), "v": (v, cu_seqlens_k)}
    for n, (t, cu) in sides.items():
        cu_name = "cu_seqlens_" + ("q" if n == "q" else "k")
        if cu is None and t.dim() != 4:
            raise ValueError(f"{n}: expected rank 4 (batch, seqlen, heads, head_dim) with {cu_name}=None (a padded "
                             f"batch), or rank 3 (total_tokens, heads, head_dim) with {cu_name}; got shape "
                             f"{tuple(t.shape)}")
        if cu is not None and t.dim() != 3:
            raise ValueError(f"{n}: expected rank 3 (total_tokens, heads, head_dim) with {cu_name} given (pass "
                             f"{cu_name}=None for a padded (batch, seqlen, heads, head_dim) batch); got shape "
                             f"{tuple(t.shape)}")
    if cu_seqlens_k is None and tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v: shape {tuple(v.shape)} must match k {tuple(k.shape)} in (batch, seqlen, heads)")
    _check_side_batches(q, k, cu_seqlens_q, cu_seqlens_k)
    padded_q = None if cu_seqlens_q is not None else (q.shape[0], q.shape[1])
    q, cu_q, sq = VarlenLayout.pack(q, cu_seqlens_q)
    k, cu_k, sk = VarlenLayout.pack(k, cu_seqlens_k)
    v, _, _ = VarlenLayout.pack(v, cu_seqlens_k)
    return q, k, v, cu_q, cu_k, _padded_bound("max_seqlen_q", max_seqlen_q, sq, seqused_q), \
        _padded_bound("max_seqlen_k", max_seqlen_k, sk, seqused_k), padded_q, sk


def _side_batch(t, cu, name: str, cu_name: str):
    """(sequences, what names them) of one varlen side: a padded side's batch, a packed side's
    len(cu_seqlens) - 1; None where cu is not a 1-D tensor (its own check refuses it later)."""
    if cu is None:
        return t.shape[0], f"{name}'s padded batch"
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.shape[0] >= 1:
        return cu.shape[0] - 1, f"{cu_name}'s {cu.shape[0]} entries"
    return None


def _check_side_batches(q, k, cu_seqlens_q, cu_seqlens_k):
    """The two sides describe the same number of sequences; the message names the arguments that
    set each count (a padded side's batch, or a packed side's cu_seqlens)."""
    side_q = _side_batch(q, cu_seqlens_q, "q", "cu_seqlens_q")
    side_k = _side_batch(k, cu_seqlens_k, "k", "cu_seqlens_k")
    if side_q is None or side_k is None or side_q[0] == side_k[0]:
        return
    name = "k" if cu_seqlens_k is None else "cu_seqlens_k"  # (a page table's rows: check_page_table's)
    raise ValueError(f"{name}: {side_k[0]} sequences ({side_k[1]}) but q describes {side_q[0]} ({side_q[1]})")


def _padded_bound(name, given, padded, used):
    """A side's max_seqlen for the kernels: the given one (a packed side, or one not an int: check_varlen
    refuses it); a padded side's seqlen when None. A padded side without seqused_* uses every row, so a
    smaller bound would leave rows uncomputed: refused. With seqused_* the caller may give the longest
    *used* length (the official bound), but the grids must still cover every padded row (the forward
    writes a row past seqused_q as out 0 / lse -inf, the backward a key past seqused_k as dk = dv = 0)."""
    if padded is None:
        return given
    if given is None:
        return padded
    if isinstance(given, bool) or not isinstance(given, int):
        return given
    if used is None and given < padded:
        raise ValueError(f"{name}: {given} is below the padded side's seqlen {padded}, whose every row is used "
                         f"(pass seqused_{name[-1]} for shorter sequences)")
    return given if used is None else max(given, padded)


def check_page_table(q, k, v, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k=None):
    """A paged k / v -- (num_pages, page_size, Hkv, D) with page_table (batch, pages per sequence)
    int32, as in the official interface. Entries past a sequence's seqused_k keys may hold any value
    (`VarlenLayout.unpage` clamps them); FA4_VALIDATE=1 checks the entries each sequence uses (all of
    a row without seqused_k)."""
    _check_index_tensor("page_table", page_table, q, dims=2, layout="(batch, pages per sequence)")
    if cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k: must be None with page_table (a paged k / v is one page list per sequence)")
    for n, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected (num_pages, page_size, heads, head_dim) with page_table, got shape "
                             f"{tuple(t.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v: shape {tuple(v.shape)} must match k {tuple(k.shape)} in (num_pages, page_size, heads)")
    if cu_seqlens_q is not None:
        _is_tensor("cu_seqlens_q", cu_seqlens_q)
    elif q.dim() != 4:  # the batch below would be q's token count
        raise ValueError(f"q: expected rank 4 (batch, seqlen, heads, head_dim) with cu_seqlens_q=None (a padded "
                         f"batch), or rank 3 (total_tokens, heads, head_dim) with cu_seqlens_q; got shape "
                         f"{tuple(q.shape)}")
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1  # its values: checked later
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table: {page_table.shape[0]} rows != batch = {batch}")
    if k.shape[0] == 0:
        raise ValueError("k: a paged cache needs at least one page")
    if k.shape[1] == 0:
        raise ValueError("k: a paged cache's page_size (dim 1) must be >= 1")
    if q.device.type == "cuda" and values_check_enabled() and page_table.numel():
        whole = seqused_k is None or tuple(seqused_k.shape) != (batch,)  # (a bad seqused_k is refused later)
        keys = torch.full((batch,), page_table.shape[1] * k.shape[1], device=page_table.device) if whole \
            else seqused_k
        check_pages_used("page_table", page_table, keys, k.shape[1], k.shape[0])


def check_pages_used(name, table, keys, page_size: int, num_pages: int):
    """FA4_VALIDATE's check of a page table (one sync): every page sequence b reads or appends to -- the
    first ceil(keys[b] / page_size) entries of its row -- names a page of the pool; entries past them
    may hold anything (-1 padding, say)."""
    used = (keys.to(torch.int64) + page_size - 1) // page_size                            # (B,)
    cols = torch.arange(table.shape[1], device=table.device)
    bad = ((table < 0) | (table >= num_pages)) & (cols[None, :] < used[:, None])
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}: entry [{row}, {col}] = {int(table[row, col])} is a page sequence {row} reads or "
                         f"appends to, but the pool has pages [0, {num_pages})")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 deterministic=False, return_lse=False, seqused_k=None, seqused_q=None):
    """Packed (total_tokens, H, D) inputs of flash_attn_varlen_func (`check_varlen_sides` packs
    padded ones first). Returns
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, scale); seqused_q is
    only checked (`fa4._layouts.VarlenLayout` serves it).

    max_seqlen_q / max_seqlen_k None become the total token counts of q / k, as in the official
    interface: always an upper bound, known without reading cu_seqlens (no sync), but the kernels
    size their grids from it, so a batch of many short sequences launches CTAs that exit at once;
    pass the real bounds when you have them."""
    names = ("q", "k", "v")
    _check_dtypes_devices(names, (q, k, v))
    for n, t in zip(names, (q, k, v)):
        if t.dim() != 3:
            raise ValueError(f"{n}: expected rank 3 (total_tokens, heads, head_dim) for varlen, got shape "
                             f"{tuple(t.shape)}")
    tq, hq, d = q.shape
    tk, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k: head_dim {dk} differs from q's head_dim {d}")
    if tuple(v.shape[:2]) != (tk, hkv):
        raise ValueError(f"v: shape {tuple(v.shape)} must match k {tuple(k.shape)} in (total_tokens, heads)")
    _check_heads(names, hq, hkv)
    _check_head_dims(names, d, v.shape[2])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise TypeError(f"{name}: required (int32, length batch + 1) for packed (total_tokens, heads, "
                            "head_dim) tensors")
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, q)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: needs at least one entry (batch + 1 >= 1)")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, q, batch + 1, "len(cu_seqlens_q)")
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None:
            _check_index_tensor(name, used, q, batch, "batch")
    max_seqlen_q = tq if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = tk if max_seqlen_k is None else max_seqlen_k
    _check_int("max_seqlen_q", max_seqlen_q)
    _check_int("max_seqlen_k", max_seqlen_k)
    _check_flag("causal", causal)
    _check_flag("deterministic", deterministic)
    _check_flag("return_lse", return_lse)
    scale = check_softmax_scale("softmax_scale", softmax_scale, d)
    if q.device.type == "cuda" and values_check_enabled():
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k, seqused_k, seqused_q)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    used = None if seqused_k is None else seqused_k.contiguous()
    return (_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), cu_q, cu_k, used, max_seqlen_q,
            max_seqlen_k, scale)


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                        seqused_q=None):
    """The value checks (one device->host copy). Public so tests and users can call them directly.
    max_seqlen_* bounds the sequences, or with seqused_* the used lengths (the official bound)."""
    for name, cu, total, mx, used in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, seqused_q),
                                      ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, seqused_k)):
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {vals[0]}")
        lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
        if any(n < 0 for n in lens):
            i = next(i for i, n in enumerate(lens) if n < 0)
            raise ValueError(f"{name}: must be non-decreasing, but entry {i + 1} ({vals[i + 1]}) "
                             f"< entry {i} ({vals[i]})")
        if vals[-1] != total:
            raise ValueError(f"{name}: last value {vals[-1]} must equal the total number of tokens {total}")
        if used is not None:
            lens = [min(max(u, 0), n) for u, n in zip(used.tolist(), lens)]  # range-checked below
        longest = max(lens, default=0)
        if longest > mx:
            what = "sequence" if used is None else f"used length (seqused_{name[-1]})"
            raise ValueError(f"max_seqlen_{name[-1]}: {mx} is smaller than the longest {what} ({longest}); "
                             "the kernel would skip the rows beyond it")
    for side, used, cu in (("k", seqused_k, cu_seqlens_k), ("q", seqused_q, cu_seqlens_q)):
        if used is None:
            continue
        c = cu.tolist()
        for b, u in enumerate(used.tolist()):
            if not 0 <= u <= c[b + 1] - c[b]:
                raise ValueError(f"seqused_{side}: entry {b} = {u} is outside [0, seqlen_{side} of sequence {b} = "
                                 f"{c[b + 1] - c[b]}]")
