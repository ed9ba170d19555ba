"""What the public functions do to a call before the kernels see it, and undo after: two layout
components, both plain torch ops (differentiable, traceable by torch.compile, no host sync) but for one
kernel: an eager paged call's page gather (`gather_kv_pages`).

1. Head dims (`pad_head_dims`). The kernels exist for a few (qk, v) head-dim pairs per arch
   (fa4._dispatch.ARCHS). Any other pair of multiples of 8 up to 256 runs on the cheapest native
   pair that covers it, with zeros appended to the head dims:

       q k^T is unchanged by zero columns in q and k (each score gains 0 * 0 terms),
       P v' = [P v, 0] when v' = [v, 0], so out = (P v')[..., :dv],

   and the gradients of the padded columns are dropped by the slice's and the pad's autograd
   formulas. softmax_scale defaults to 1/sqrt(qk) of the *caller's* head dim (validation resolves
   it before the padding). Cost: a copy of each padded input and of out, and the kernel's work at
   the padded size (measured in docs/measurements.md, "Head-dim padding").

2. Varlen batches (`VarlenLayout`). flash_attn_varlen_func takes each side either packed
   ((total, H, D) with cu_seqlens) or padded ((batch, seqlen, H, D) with cu_seqlens None), plus
   seqused_q / seqused_k. The kernels take packed tensors, cu_seqlens and seqused_k. So:
     * a padded side is viewed as packed, with cu_seqlens = seqlen * arange(batch + 1);
     * seqused_q (use the first seqused_q[b] query rows of sequence b) is served by splitting each
       sequence in two: sequence 2b is its used rows against its keys, sequence 2b + 1 its unused
       rows against no keys. The kernels define a row without keys (out 0, lse -inf, or the sink's
       logit), and those rows add nothing to dk / dv and get dq = 0. Causal and window masks align
       to seqused_q[b], as in the official kernel, because the used rows are a sequence of that
       length. The cost is a grid of 2 x batch sequences, half of them without keys.
     * max_seqlen_q / max_seqlen_k may be the longest *used* length (the official bound): the kernels'
       grids then need not reach every row past seqused_*. So the rows past seqused_q are set to out
       0, lse -inf after the kernel (whatever it wrote there, with or without a sink).
     * when a backward may follow, the kernels get copies of q / k / v whose rows just past seqused_q /
       seqused_k are zeros (`ZeroedTail`): a backward tile straddling a used length reads those rows,
       which hold the caller's padding (NaN in it would reach the used rows' gradients). Where a grid
       may stop short, the copies' backward gives the rows past them dq = 0 / dk = dv = 0.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _dispatch

# head dims the official interface accepts on Hopper: multiples of 8 up to 256
HEAD_DIM_STEP, MAX_HEAD_DIM = 8, 256


def head_dim_ok(d) -> bool:
    return (not isinstance(d, bool) and isinstance(d, (int, torch.SymInt)) and 0 < d <= MAX_HEAD_DIM
            and d % HEAD_DIM_STEP == 0)


def arch_of(device) -> _dispatch.ArchInfo:
    """The arch whose head-dim pairs a call on `device` runs: the GPU's; Hopper's for meta tensors or
    when no GPU can be asked (shape tracing on a CPU machine, where nothing launches)."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _dispatch.arch_for_capability(torch.cuda.get_device_capability(index))
    return _dispatch.ARCHS["sm_90"]


def native_pair(arch: _dispatch.ArchInfo, d: int, dv: int):
    """The native (qk, v) pair that runs (d, dv): itself when native, else the covering pair with the
    least work (qk + v: the two matmuls' inner / outer dims), ties to the smaller largest dim.
    None when no pair covers it."""
    if (d, dv) in arch.head_dims:
        return (d, dv)
    covering = [p for p in arch.head_dims if p[0] >= d and p[1] >= dv]
    return min(covering, key=lambda p: (p[0] + p[1], max(p)), default=None)


def gather_pages(cache, block_table):
    """A dense (B, P * page_size, H, D) copy of a paged cache's sequences (block_table (B, P) page
    indices): flash_attn_with_kvcache's fallback and varlen's page_table. Entries past a sequence's
    keys may hold anything (a server pads its tables): they are clamped to a valid page, whose rows
    the call never uses."""
    b, p = block_table.shape
    pages = block_table.clamp(0, cache.shape[0] - 1).to(torch.int64)                       # (B, P)
    return cache[pages].reshape(b, p * cache.shape[1], *cache.shape[2:])


def gather_kv_pages(k_cache, v_cache, block_table):
    """(k, v): gather_pages of both caches. An eager call on Hopper with nothing needing a gradient
    takes one page-gather kernel for K and V (stage3_fwd_kernel.page_gather: contiguous pages at
    near-copy bandwidth, where torch's indexing is an offset per element); autograd, torch.compile
    tracing and other archs keep the torch indexing."""
    grad = torch.is_grad_enabled() and (k_cache.requires_grad or v_cache.requires_grad)
    if not grad and all(type(t) is torch.Tensor and t.is_cuda for t in (k_cache, v_cache, block_table)) \
            and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None \
            and arch_of(k_cache.device).key == "sm_90":
        from stage3_fwd_kernel import page_gather

        pair = page_gather.gather_pages(k_cache, v_cache, block_table)
        if pair is not None:
            return pair
    return gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)


def _pad_last(t, size):
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def refuse_pair_without_backward(q, k, v, names=("q", "k", "v"), sink=None):
    """A ValueError naming names[0] when q's and v's head dims run on a native pair that has no
    backward on q's arch while an input (or the sink) requires grad -- before anything is gathered,
    padded or launched. Returns the pair (None: none covers the head dims; the caller reports it)."""
    d, dv = q.shape[-1], v.shape[-1]
    arch = arch_of(q.device)
    pair = native_pair(arch, d, dv)
    if pair is not None and not _dispatch.has_backward(arch, *pair) and torch.is_grad_enabled() and \
            any(t is not None and t.requires_grad for t in (q, k, v, sink)):
        raise ValueError(f"{names[0]}: head dims (qk={d}, v={dv}) run on {arch.key}'s {pair[0]}/{pair[1]} forward, "
                         f"which has no backward there (backward pairs: "
                         f"{', '.join(f'{a}/{b}' for a, b in arch.backward_head_dims)}); inputs that require grad "
                         "are refused before the forward launches: call it under torch.no_grad()")
    return pair


def pad_head_dims(q, k, v, names=("q", "k", "v"), sink=None):
    """(q, k, v, unpad): inputs at a native head-dim pair of q's arch, and the function that takes
    the kernel's out back to the caller's v head dim (identity when nothing was padded). sink: the
    learnable sink, whose gradient needs the backward too."""
    d, dv = q.shape[-1], v.shape[-1]
    pair = refuse_pair_without_backward(q, k, v, names, sink)
    if pair is None:
        arch = arch_of(q.device)
        ok = ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in arch.head_dims)
        raise ValueError(f"{names[0]}: head dims (qk={d}, v={dv}) exceed every kernel on {arch.key} (native qk/v: "
                         f"{ok}); a pair runs on a native one at least as large in both")
    if pair == (d, dv):
        return q, k, v, _identity
    pd, pdv = pair
    q, k, v = _pad_last(q, pd), _pad_last(k, pd), _pad_last(v, pdv)
    if pdv == dv:
        return q, k, v, _identity
    return q, k, v, lambda out: out[..., :dv].contiguous()


def _identity(out):
    return out


_SHAPE_CONSTANTS: dict = {}   # (what, device, sizes...) -> a small int32 tensor that depends on sizes only
MAX_SHAPE_CONSTANTS = 256     # then new ones are made per call: a kept one is never dropped (a graph may read it)


def shape_constant(key: tuple, make):
    """The tensor `make()` builds for `key` (whose second item is the device), built once per process:
    offsets that depend on shapes alone (a decode step's segments, a padded side's cu_seqlens), each
    made afresh a tiny kernel on the call's path (1-2 us apiece; 7 of a 1 x 128k decode step's 14
    kernels on an H200 were such). One made while a CUDA graph is captured is not kept (its kernel runs
    only at replay: the tensor holds no values yet), nor one made while traced or under a dispatch mode
    (a user's FakeTensorMode: its tensors are fake, and a kept real one would not mix with them); a
    graph captured after an eager call uses the kept one. Kept ones are made outside inference mode (a
    later training call may save them for its backward) and never dropped: a captured graph reads them
    without holding a reference."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return make()
    t = _SHAPE_CONSTANTS.get(key)
    if t is not None:
        return t
    device = key[1]
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if len(_SHAPE_CONSTANTS) >= MAX_SHAPE_CONSTANTS or capturing:
        return make()
    with torch.inference_mode(False):
        t = _SHAPE_CONSTANTS[key] = make()
    return t


class VarlenLayout:
    """A flash_attn_varlen_func call turned into the kernels' packed form, and back.

    Build it with `VarlenLayout.of(...)` after the metadata checks; then `q, k, v, cu_q, cu_k,
    seqused_k, max_q, max_k` are what the varlen op takes, and `restore(out, lse)` gives the
    caller's layout: out (B, Sq, H, Dv) and lse (B, H, Sq) for a padded q, else packed."""

    def __init__(self, q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, padded_q, rows_past_q=None, sink_grad_here=None):
        self.q, self.k, self.v = q, k, v
        self.cu_q, self.cu_k, self.seqused_k = cu_q, cu_k, seqused_k
        self.max_q, self.max_k = max_q, max_k
        self.padded_q = padded_q   # (batch, seqlen_q) of a padded q, else None
        self.rows_past_q = rows_past_q  # bool (total_q,): the rows past seqused_q, else None
        self.sink_grad_here = sink_grad_here  # a sink whose gradient `restore` forms (the op gets it detached)

    @staticmethod
    def pack(t, cu):
        """A side given padded (cu None): its packed view and cu_seqlens = seqlen * arange(batch + 1)."""
        if cu is not None:
            return t, cu, None
        b, s = t.shape[0], t.shape[1]
        # kept per shape (no kernel a call); symbolic sizes only occur while traced, where it makes one
        cu = shape_constant(("padded_cu", t.device, b, s),
                            lambda: torch.arange(0, b + 1, dtype=torch.int32, device=t.device) * s)
        return t.reshape(b * s, *t.shape[2:]), cu, s

    @staticmethod
    def unpage(k, v, page_table):
        """A paged k / v (num_pages, page_size, H, *) as padded (batch, pages * page_size, H, *) copies
        (flash_attn_with_kvcache's page gather); entries past a sequence's keys are clamped to a
        valid page, whatever they held (gather_pages). A copy per call: the path for page sizes and
        calls the kernel cannot read in place (fa4/_paged.py)."""
        return gather_kv_pages(k, v, page_table)

    @classmethod
    def of(cls, q, k, v, cu_q, cu_k, seqused_q, seqused_k, max_q, max_k, padded_q, sink=None, seqlen_k=None):
        """q / k / v / cu_* already packed (see `pack`), validated; seqused_q (batch,) int32 or None;
        seqlen_k: a padded k's seqlen (no sequence is longer), None for a packed k.
        When a backward may follow, the rows just past seqused_q in q and past seqused_k in k / v are
        zeros in the copies the kernels get (`ZeroedTail`); a learnable sink's gradient, which the op forms
        from every row's out and lse as the kernel left them, is formed by `restore` over the used
        rows where a grid bounded by max_seqlen_q may not reach the others (the op gets it detached)."""
        longest_q = q.shape[0] if padded_q is None else padded_q[1]  # no sequence is longer
        rows_past_q, short_q = None, False
        if seqused_q is not None:
            rows_past_q = rows_past_used(cu_q, seqused_q, q.shape[0])
            short_q = _may_stop_short(max_q, longest_q)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink)):
            if seqused_q is not None:
                q = ZeroedTail.apply(q, tail_rows(cu_q, seqused_q, q.shape[0]), rows_past_q if short_q else None)
            if seqused_k is not None:
                tail_k = tail_rows(cu_k, seqused_k, k.shape[0])
                short_k = _may_stop_short(max_k, k.shape[0] if seqlen_k is None else seqlen_k)
                rows_past_k = rows_past_used(cu_k, seqused_k, k.shape[0]) if short_k else None
                k, v = (ZeroedTail.apply(t, tail_k, rows_past_k) for t in (k, v))
        if seqused_q is not None:
            cu_q, cu_k, seqused_k = split_unused_rows(cu_q, cu_k, seqused_q, seqused_k)
        sink_here = sink if short_q and sink is not None and sink.requires_grad and torch.is_grad_enabled() else None
        return cls(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, padded_q, rows_past_q, sink_here)

    def kernel_sink(self, sink):
        """The sink the op gets: detached when `restore` forms its gradient."""
        return sink.detach() if self.sink_grad_here is not None else sink

    def restore(self, out, lse):
        if self.rows_past_q is not None:
            out = out.masked_fill(self.rows_past_q.view(-1, 1, 1), 0)                 # (total_q, H, Dv)
            lse = lse.masked_fill(self.rows_past_q.view(1, -1), float("-inf"))        # (H, total_q)
        if self.sink_grad_here is not None:
            out, lse = SinkGradient.apply(out, lse, self.sink_grad_here)
        return restore_padded_q(out, lse, self.padded_q)


class SinkGradient(torch.autograd.Function):
    """Identity on out (T, H, Dv) and lse (H, T), which the op formed with the sink detached; the
    backward adds the sink's gradient (fa4._dispatch.sink_grad) from them as restored -- the rows past
    seqused_q hold out 0 / lse -inf there, which contribute nothing."""

    @staticmethod
    def forward(ctx, out, lse, sink):
        ctx.save_for_backward(out, lse, sink)
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, sink = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        return dout, dlse, _dispatch.sink_grad(out, dout, lse, sink, dlse)


def _may_stop_short(bound, longest) -> bool:
    """Whether a grid sized by `bound` rows per sequence may miss rows of a sequence that can be
    `longest` rows long (a traced bound: assume it may)."""
    return not isinstance(bound, int) or bound < longest


def rows_past_used(cu, used, total):
    """bool (total,): True for the rows of sequence b at or past used[b] (cu (batch + 1,), used (batch,)
    on one device; computed there, no host sync)."""
    rows = torch.arange(total, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:].to(torch.int64), rows, right=True).clamp_(max=max(cu.shape[0] - 2, 0))
    return rows - cu.to(torch.int64)[seq] >= used.to(torch.int64)[seq]


# rows past a used length that a backward tile may load: its tiles are at most 128 rows (Hopper and
# Blackwell, queries and keys); twice that leaves room for a larger tile
TAIL_ROWS = 256


def tail_rows(cu, used, total):
    """int64 (batch * TAIL_ROWS,): for sequence b, the rows cu[b] + used[b] + j (j < TAIL_ROWS) that lie
    before its end, and `total` (one scratch row past the tensor) for the others. A fixed size, computed
    on the device: no host sync, capturable."""
    j = torch.arange(TAIL_ROWS, device=cu.device, dtype=torch.int64)
    start = cu[:-1].to(torch.int64) + used.to(torch.int64)                  # (batch,)
    rows = start[:, None] + j[None, :]                                       # (batch, TAIL_ROWS)
    return torch.where(rows < cu[1:].to(torch.int64)[:, None], rows, total).flatten()


class ZeroedTail(torch.autograd.Function):
    """A copy of t (rows, ...) whose rows past a used length that a backward tile may load hold zeros,
    for a call a backward may follow. Such a tile loads them with the rest (TMA reads whole tiles), and
    they hold the caller's padding: P and dS are 0 there, but dK += dS^T Q and dQ = dS K multiply them,
    and 0 * NaN is NaN (the forward zeroes V's tail itself and masks K's by select: forward-only calls
    get no copy). The copy is one pass over t (a plain copy into a buffer one scratch row longer, then
    zeros into at most TAIL_ROWS rows a sequence). The backward passes the gradient through, or, given
    `rows_past` (bool (rows,): the rows past the used lengths, where a grid bounded by max_seqlen may
    stop short of them and the kernels leave them unwritten), zeroes those rows. Measured:
    docs/measurements.md, "NaN past seqused_q / seqused_k"."""

    @staticmethod
    def forward(ctx, t, tail, rows_past):
        ctx.zero_rows_past = rows_past is not None
        if ctx.zero_rows_past:
            ctx.save_for_backward(rows_past)
        buf = t.new_empty((t.shape[0] + 1, *t.shape[1:]))                     # (rows + 1, H, D)
        buf[:-1].copy_(t)
        buf.index_fill_(0, tail, 0)
        return buf[:-1]

    @staticmethod
    def backward(ctx, grad):
        if ctx.zero_rows_past:
            (rows_past,) = ctx.saved_tensors
            grad = grad.masked_fill(rows_past.view(-1, *([1] * (grad.dim() - 1))), 0)
        return grad, None, None


def restore_padded_q(out, lse, padded_q):
    """A packed call's out (B*Sq, H, Dv) and lse (H, B*Sq) in a padded q's layout, padded_q = (B, Sq);
    unchanged when padded_q is None."""
    if padded_q is None:
        return out, lse
    b, s = padded_q
    out = out.view(b, s, *out.shape[1:])                              # (B, Sq, H, Dv)
    lse = lse.view(lse.shape[0], b, s).permute(1, 0, 2).contiguous()  # (H, B*Sq) -> (B, H, Sq)
    return out, lse


def split_unused_rows(cu_q, cu_k, seqused_q, seqused_k=None):
    """seqused_q as 2 x batch sequences (module docstring): sequence 2b = rows cu_q[b] ..
    cu_q[b] + seqused_q[b] against sequence b's keys, sequence 2b + 1 = the rest of its rows against
    none. Returns (cu_q', cu_k', seqused_k'), int32 on cu_q's device, computed on the device."""
    starts_q = cu_q[:-1]
    cu_q2 = torch.cat((torch.stack((starts_q, starts_q + seqused_q), 1).flatten(), cu_q[-1:]))
    cu_k2 = torch.cat((torch.stack((cu_k[:-1], cu_k[1:]), 1).flatten(), cu_k[-1:]))
    used_k2 = None
    if seqused_k is not None:
        used_k2 = torch.stack((seqused_k, torch.zeros_like(seqused_k)), 1).flatten()
    return cu_q2.to(torch.int32), cu_k2.to(torch.int32), used_k2
