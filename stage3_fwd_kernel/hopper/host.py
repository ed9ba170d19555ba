"""The host API of the Hopper forward: argument checks, the compile cache key, compilation against
fake tensors, and the launches (dense and varlen)."""
from __future__ import annotations

import functools
import re
from typing import NamedTuple

from cutlass import Float32, Int32
import cutlass.cute as cute

from stage3_fwd_kernel import host_io, trace
from stage3_fwd_kernel.components.key_split import RANGE_ALL
from stage3_fwd_kernel.components.paged_kv import check_page_size, gathered
from stage3_fwd_kernel.components.score_mod import Softcap, check_softcap
from stage3_fwd_kernel.components.window import NO_WINDOW, Window, beyond_causal
from stage3_fwd_kernel.compile_cache import Compiled, compile_cached
from stage3_fwd_kernel.hopper.config import (
    DEFAULT_EMULATION_FRACTION, DEFAULT_POLICY, STEP, _check_head_dims, _check_scale, _check_tile_m,
    default_tile_n, make_policy)
from stage3_fwd_kernel.hopper.kernel import FlashAttentionForwardSm90
from stage3_fwd_kernel.hopper.scheduling import (
    _launch_ctas, _resolve_scheduler, _tile_counter, default_persistent)
from stage3_fwd_kernel.hopper.split_tail import split_tail_combine, split_tail_plan
from stage3_fwd_kernel.softmax_policy import DEFAULT_RESCALE_THRESHOLD, SoftmaxPolicy
from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler, check_grid


class Variant(NamedTuple):
    """The compile-time shape of a call's score function beyond causal: the window (components.window,
    causal excluded), the softcap and whether a learnable sink is passed."""

    window: Window = NO_WINDOW
    softcap: float = 0.0
    sink: bool = False

    def key(self) -> tuple:
        """Cache-key suffix: empty for plain attention, so its keys (and disk cache) are unchanged."""
        return () if self == PLAIN else (("variant",) + tuple(self.window) + (self.softcap, self.sink))


PLAIN = Variant()


def make_variant(causal, window_size, softcap, learnable_sink, heads_q: int, device) -> tuple:
    """(Variant, the sink as fp32 (Hq,) or None), checked: window_size as components.window, softcap
    a float >= 0, learnable_sink a floating (Hq,) tensor on q's device."""
    import torch

    host_io.check_causal(causal)
    window = beyond_causal(causal, window_size)  # causal stays the kernel's flag
    if learnable_sink is not None:
        if not isinstance(learnable_sink, torch.Tensor):
            raise TypeError(f"learnable_sink: expected a torch tensor, got {type(learnable_sink).__name__}")
        if learnable_sink.shape != (heads_q,) or not learnable_sink.is_floating_point():
            raise ValueError(f"learnable_sink: expected a floating tensor of shape ({heads_q},) (one logit per "
                             f"query head), got {learnable_sink.dtype} {tuple(learnable_sink.shape)}")
        if learnable_sink.device != device:
            raise ValueError(f"learnable_sink: expected a tensor on {device}, got {learnable_sink.device}")
        learnable_sink = learnable_sink.detach().float().contiguous()
    return Variant(window, check_softcap(softcap), learnable_sink is not None), learnable_sink


def _build_tile_m(tile_m, d, dv, causal, variant: Variant, cache: bool, seqlen_k: int | None = None) -> int:
    """tile_m of a build: `tile_m` checked, or (None) config.default_tile_m of its head dims, variant,
    key source (cache: a paged cache or a key split) and key count (seqlen_k of a dense call; None: short)."""
    return _check_tile_m(tile_m, d, dv, causal, variant.window, softcap=bool(variant.softcap), cache=cache,
                         seqlen_k=seqlen_k, sink=variant.sink)


def make_kernel(dtype, head_dim, head_dim_v, causal, *, policy: SoftmaxPolicy = DEFAULT_POLICY,
                scheduler=StaticTileScheduler, tile_m: int | None = None, split_tail: bool = False,
                variant: Variant = PLAIN, page_size: int | None = None, key_split: bool = False,
                rows_per_query: int = 1):
    """The kernel object; tile_m None = default_tile_m(head_dim, head_dim_v, causal, window) of a short call
    (the entry points resolve a long call's tile from its key count first); page_size:
    built for a paged K/V cache (components.paged_kv); key_split: split-KV (components.key_split);
    rows_per_query: q's rows are query tokens times this (packed GQA heads, a key split only)."""
    tile_m = _build_tile_m(tile_m, head_dim, head_dim_v, causal, variant, page_size is not None or key_split)
    return FlashAttentionForwardSm90(dtype, head_dim, head_dim_v, causal, policy=policy, scheduler=scheduler,
                                     tile_m=tile_m, split_tail=split_tail, window=variant.window,
                                     softcap=variant.softcap, page_size=page_size, key_split=key_split,
                                     rows_per_query=rows_per_query)


def _key(mode, dtype, d, dv, causal, policy, scheduler, varlen_flags=(False, False, False), tile_m=None,
         split_tail=False, variant: Variant = PLAIN, page_size: int | None = None, key_split: bool = False,
         rows_per_query: int = 1):
    """Compile-cache key: everything that is a compile-time constant of the kernel. varlen_flags =
    (varlen, has seqused_k, has batch_map[, a key split's has key_starts]): each present/absent optional
    tensor is its own kernel.
    tile_m enters resolved (None: a short call's default; the entry points resolve a long call's from
    its key count first), so a default and its explicit value share one kernel."""
    tile_m = _build_tile_m(tile_m, d, dv, causal, variant, page_size is not None or key_split)
    return (STEP, mode, str(dtype), d, dv, bool(causal), policy, scheduler, tuple(varlen_flags), tile_m) + \
        (("split_tail",) if split_tail else ()) + variant.key() + (() if page_size is None else ("paged", page_size)) \
        + (("key_split",) if key_split else ()) + (("rows_per_query", rows_per_query) if rows_per_query != 1 else ()) \
        + trace.key()


def _call_args(q4, k4, v4, out4, lse3, softmax_scale, max_seqlen_q, cu_seqlens_q=None, cu_seqlens_k=None,
               seqused_k=None, batch_map=None, max_ctas=1, tile_counter=None, split=None, split_chunks=1,
               softcap=0.0, sink=None, page_table=None, num_splits=1, chunk_keys=0, range_keys=RANGE_ALL):
    """The launch's arguments, in ``__call__`` order without the stream, from torch tensors (dense
    (B, S, H, D) or packed viewed as (1, T, H, D)): TVM-FFI takes them as they are (see
    host_io.launch_stream)."""
    opt = host_io.launch_view
    scale_log2, score_scale = Softcap(softcap).kernel_scales(softmax_scale)
    return (opt(q4), opt(k4), opt(v4), opt(out4), opt(lse3), scale_log2,
            score_scale, opt(cu_seqlens_q), opt(cu_seqlens_k), opt(seqused_k), opt(batch_map), tile_counter,
            max_seqlen_q, max_ctas, split, split_chunks, sink, opt(page_table), num_splits, chunk_keys, range_keys)


def _fake_args(dtype, d, dv, varlen_flags, *, launchable: bool = False, dynamic: bool = False,
               split_tail: bool = False, sink: bool = False, paged: bool = False):
    """``__call__``'s arguments for cute.compile; launchable=True for a kernel `_call_args` runs;
    dynamic: the scheduler takes a tile counter; split_tail: the split workspace; paged: a page table."""
    varlen, has_used, has_map, *key_starts = varlen_flags   # a key split's 4th flag: first keys in cu_seqlens_k
    i32 = host_io.fake_i32_vector
    return (host_io.fake_bshd(dtype, d), host_io.fake_bshd(dtype, d), host_io.fake_bshd(dtype, dv),
            host_io.fake_bshd(dtype, dv), host_io.fake_lse(), Float32(1.0), Float32(1.0),
            i32() if varlen else None, i32() if varlen or any(key_starts) else None, i32() if has_used else None,
            i32() if has_map else None, i32() if dynamic else None, Int32(1), Int32(1),
            host_io.fake_lse() if split_tail else None, Int32(1), host_io.fake_f32_vector() if sink else None,
            host_io.fake_i32_matrix() if paged else None, Int32(1), Int32(1), Int32(1),
            host_io.launch_stream() if launchable else cute.runtime.make_fake_stream())


def _compile(launchable: bool, dt, d, dv, causal, policy, scheduler, varlen_flags, tile_m, split_tail=False,
             variant: Variant = PLAIN, page_size: int | None = None, key_split: bool = False, rows_per_query: int = 1,
             key: tuple | None = None):
    """The one place the kernel is compiled (against fake tensors): launchable=True builds what
    attention_forward launches (TVM-FFI, key "gpu"), False a compile-only build (key "fake"). key: the
    arguments' _key where the caller has it already."""
    key = key or _key("gpu" if launchable else "fake", dt, d, dv, causal, policy, scheduler, varlen_flags, tile_m,
               split_tail, variant, page_size, key_split, rows_per_query)
    return compile_cached(key, lambda: (
        make_kernel(dt, d, dv, causal, policy=policy, scheduler=scheduler, tile_m=tile_m, split_tail=split_tail,
                    variant=variant, page_size=page_size, key_split=key_split, rows_per_query=rows_per_query),
        _fake_args(dt, d, dv, varlen_flags, launchable=launchable, dynamic=getattr(scheduler, "dynamic", False),
                   split_tail=split_tail, sink=variant.sink, paged=page_size is not None)))


def _check_call(q, d, dv, tile_m, softmax_scale, causal, variant: Variant, cache: bool = False,
                seqlen_k: int | None = None):
    """(tile_m, cutlass dtype, softmax_scale) of a call whose head dims are checked, checked (variant:
    the call's window -- its beyond_causal -- and softcap; cache: keys from a paged cache or a key split)."""
    return _build_tile_m(tile_m, d, dv, causal, variant, cache, seqlen_k), host_io.cutlass_dtype(q.dtype), \
        _check_scale(softmax_scale, d)


def _outputs(out, lse, out_shape, lse_shape, q):
    """out / lse: allocated when None, else checked (shape, dtype, device, 16-byte / 4-byte alignment)."""
    import torch

    # a tensor allocated here is right by construction: only the caller's are checked (host time)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        host_io.check_out_tensor("out", out, out_shape, q.dtype, q.device, align_bytes=16)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        host_io.check_out_tensor("lse", lse, lse_shape, torch.float32, q.device, align_bytes=4)
    return out, lse


def _no_split_with(variant: Variant, split_tail):
    """split_tail for a call: the chunks' merge knows neither a window's block ranges nor the sink."""
    if variant == PLAIN:
        return split_tail
    if split_tail:
        raise ValueError("split_tail: not available with window_size, softcap or learnable_sink")
    return False


def _nothing_visible(out, lse, sink, head_dim: int):
    """No key anywhere: O = 0 and lse = -inf, or the head's sink (lse's head mode is head_dim)."""
    out.zero_()
    if sink is None:
        lse.fill_(float("-inf"))
    else:
        shape = [1] * lse.dim()
        shape[head_dim] = -1
        lse.copy_(sink.view(shape).expand_as(lse))
    return out, lse


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                      learnable_sink=None, out=None, lse=None,
                      rescale_threshold=DEFAULT_RESCALE_THRESHOLD, emulation_fraction=DEFAULT_EMULATION_FRACTION,
                      policy: SoftmaxPolicy | None = None, scheduler=None, tile_m: int | None = None,
                      persistent: bool | None = None, split_tail: bool | None = None):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) CUDA fp16/bf16 -> (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32).

    rescale_threshold (tau, log2 units) and emulation_fraction pick the softmax policy (compile-time:
    each distinct pair is its own kernel); `policy` overrides both. `scheduler` (default
    StaticTileScheduler) is a tile order with the StaticTileScheduler interface. tile_m: query rows
    per CTA, 128 or 192 (2 or 3 consumer warpgroups); None = default_tile_m(D, Dv, causal, window, ...,
    seqlen_k=Sk).
    persistent: one CTA per SM walks the scheduler's tile order (causal and windowed calls take their
    tiles from an atomic counter; above head dim 128 O goes from registers to global memory); None =
    default_persistent(D, Dv, causal, seqlen_k=Sk, tile_m=tile_m, left_window=...). split_tail: the last partial wave
    of a static persistent non-causal call cut along the keys (split_tail_plan; None = its default;
    never with a window or a sink).

    Variants: window_size (left, right), None or -1 = unlimited (components.window; causal is right
    = 0); softcap > 0 caps the scaled scores at softcap * tanh(s / softcap) (components.score_mod);
    learnable_sink, (Hq,) floating: a logit per head in every row's denominator (components.sink).
    """
    import torch

    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    q, k, v = host_io.prepare_inputs(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    _check_head_dims(d, dv)
    variant, sink = make_variant(causal, window_size, softcap, learnable_sink, hq, q.device)
    tile_m, dt, softmax_scale = _check_call(q, d, dv, tile_m, softmax_scale, causal, variant, seqlen_k=k.shape[1])
    policy.check_dtype(dt)
    split_tail = _no_split_with(variant, split_tail)
    if b > 65535 or hq > 65535:
        raise ValueError(f"batch ({b}) and heads ({hq}) must be <= 65535 (grid y / z limit)")
    scheduler = _resolve_scheduler(scheduler, persistent, d, dv, causal, seqlen_k=k.shape[1], tile_m=tile_m,
                                   left_window=variant.window.left is not None, windowed=variant.window.limited)
    check_grid(scheduler, -(-sq // tile_m), hq, b)
    out, lse = _outputs(out, lse, (b, sq, hq, dv), (b, hq, sq), q)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:  # nothing visible anywhere (and a TMA map cannot have a 0 extent)
        return _nothing_visible(out, lse, sink, head_dim=1)
    ctas = _launch_ctas(scheduler, q.device)
    plan = split_tail_plan(split_tail, scheduler, causal, b, sq, hq, k.shape[1], tile_m, default_tile_n(d, dv), ctas)
    split = None
    if plan is not None:
        split = torch.empty((plan[0] * plan[1], tile_m, dv + 1), dtype=torch.float32, device=q.device)
    args = _call_args(q, k, v, out, lse, softmax_scale, sq, max_ctas=ctas,
                      tile_counter=_tile_counter(scheduler, q.device), split=split,
                      split_chunks=plan[1] if plan else 1, softcap=variant.softcap, sink=sink)
    _compile(True, dt, d, dv, causal, policy, scheduler, (False, False, False), tile_m, plan is not None,
             variant).fn(*args)
    if plan is not None:
        split_tail_combine(split, *plan, out, lse, -(-sq // tile_m))
    return out, lse


def check_paged_values(page_table, first_keys, seqused_k, num_pages: int, page_size: int, tile_n: int):
    """The value half of a paged call's contract (copies the small index tensors to the host): each
    sequence's first logical key a multiple of tile_n, its keys within its table row, and the pages
    it uses in [0, num_pages)."""
    table, starts, used = page_table.tolist(), first_keys.tolist(), seqused_k.tolist()
    for b, (row, start, n) in enumerate(zip(table, starts, used)):
        if start % tile_n or start < 0:
            raise ValueError(f"cu_seqlens_k: with page_table, entry {b} ({start}) must be a multiple of {tile_n}")
        if n < 0 or start + n > len(row) * page_size:
            raise ValueError(f"seqused_k: sequence {b} uses keys {start} .. {start + n} but its table row holds "
                             f"{len(row) * page_size}")
        bad = [p for p in row[start // page_size:-(-(start + n) // page_size)] if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"page_table: row {b} uses page {bad[0]}, outside [0, {num_pages})")


def paged_cache_inputs(k, v, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, tile_n: int):
    """A paged cache's k (num_pages, page_size, Hkv, D) / v (..., Dv) as the flat varlen rows
    (num_pages * page_size, Hkv, D) the kernel reads through page_table (components.paged_kv), checked.
    cu_seqlens_k None: every sequence starts at its first key. Returns (k, v, cu_seqlens_k, page_size,
    page_table)."""
    import torch

    flat_k, flat_v, page_size, page_table = flat_paged_cache(k, v, page_table, cu_seqlens_q.shape[0] - 1, seqused_k,
                                                             tile_n)
    if cu_seqlens_k is None:
        cu_seqlens_k = torch.zeros_like(cu_seqlens_q)
    return flat_k, flat_v, cu_seqlens_k, page_size, page_table


def flat_paged_cache(k, v, page_table, batch: int, seqused_k, tile_n: int):
    """The checks of a paged cache (k / v (num_pages, page_size, Hkv, *), page_table int32 (batch,
    pages) on k's device, seqused_k given) -> (k, v as (num_pages * page_size, Hkv, *), page_size,
    page_table contiguous). Allocates nothing."""
    import torch

    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: with page_table, expected a (num_pages, page_size, heads_kv, head_dim) tensor, "
                             f"got {tuple(getattr(t, 'shape', ()))}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k {tuple(k.shape)}")
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2 \
            or page_table.shape[0] != batch:
        raise ValueError(f"page_table: expected int32 (batch={batch}, pages per sequence), got "
                         f"{getattr(page_table, 'dtype', type(page_table))} {tuple(getattr(page_table, 'shape', ()))}")
    if page_table.device != k.device:
        raise ValueError(f"page_table: is on {page_table.device} but k is on {k.device}")
    if seqused_k is None:
        raise ValueError("seqused_k: required with page_table (the keys each sequence has in its pages)")
    page_size = check_page_size(k.shape[1], tile_n)
    flat_k = k.reshape(-1, k.shape[2], k.shape[3])                  # (pages * page_size, Hkv, D)
    flat_v = v.reshape(-1, v.shape[2], v.shape[3])
    return flat_k, flat_v, page_size, page_table.contiguous()


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                             softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                             learnable_sink=None, out=None, lse=None, page_table=None,
                             rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                             emulation_fraction=DEFAULT_EMULATION_FRACTION, policy: SoftmaxPolicy | None = None,
                             batch_map=None, scheduler=None, check_values=False, tile_m: int | None = None,
                             persistent: bool | None = None):
    """Packed q (Tq,Hq,D), k (Tk,Hkv,D), v (Tk,Hkv,Dv) with int32 cu_seqlens_q / cu_seqlens_k (batch+1,)
    -> (out (Tq,Hq,Dv), lse (Hq,Tq) fp32).

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against the first seqused_k[b] (default: all)
    keys of k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]; causal is bottom-right aligned per sequence. Empty
    sequences are fine; a sequence with queries but no keys gets out 0 and lse -inf. Rows of out/lse
    outside every sequence are not written. max_seqlen_q must be >= every query length (it sizes
    the grid); max_seqlen_k is accepted for API compatibility. batch_map (int32 (batch,)): the
    sequence each virtual batch index computes (stage 5's reordering; identity when None).
    check_values=True verifies the index tensors' values on the host (costs a device sync).
    tile_m, persistent, window_size, softcap, learnable_sink: as in attention_forward. (When k has
    no rows at all nothing is launched and out / lse are filled with 0 / -inf, or the sink, entirely.)
    page_table (int32 (batch, pages per sequence)): k / v are a paged cache (num_pages, page_size,
    Hkv, D) of any page size, read in place (components.paged_kv: TMA boxes for multiples of the key
    tile and its divisors of 16 rows or more, a cp.async row gather otherwise); seqused_k is then
    required, and cu_seqlens_k
    (None = zeros) holds each sequence's first logical key, a multiple of the key tile (not
    necessarily rising: split segments of one sequence share its table row). check_values then
    checks those starts, start + seqused_k <= pages x page_size and the page indices used.

    The host views every packed tensor as a batch of one, (1, total, H, D), so the TMA tensor maps
    are the dense ones; a CTA shifts its coordinates by its sequence's row offset. Extra Q rows of a
    tile are never stored, extra K columns are masked, and the V rows of a partial last block are
    zeroed in shared memory before its P V (unused KV-cache slots may hold NaN, and 0 * NaN = NaN).
    """
    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    page_size = None
    if page_table is not None:
        k, v, cu_seqlens_k, page_size, page_table = paged_cache_inputs(
            k, v, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, default_tile_n(q.shape[-1], v.shape[-1]))
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, batch_map = host_io.prepare_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k, batch_map=batch_map)
    tq, hq, d = q.shape
    dv = v.shape[-1]
    _check_head_dims(d, dv)
    variant, sink = make_variant(causal, window_size, softcap, learnable_sink, hq, q.device)
    tile_m, dt, softmax_scale = _check_call(q, d, dv, tile_m, softmax_scale, causal, variant,
                                            cache=page_size is not None)
    policy.check_dtype(dt)
    scheduler = _resolve_scheduler(scheduler, persistent, d, dv, causal, varlen=True, tile_m=tile_m,
                                   gathered_pages=gathered(page_size, default_tile_n(d, dv)))
    check_grid(scheduler, -(-int(max_seqlen_q) // tile_m), hq, len(cu_seqlens_q) - 1)
    out, lse = _outputs(out, lse, (tq, hq, dv), (hq, tq), q)
    if check_values and page_table is not None:
        no_offsets = cu_seqlens_q.new_zeros(cu_seqlens_q.shape)  # the key checks are check_paged_values
        host_io.check_varlen_values(tq, k.shape[0], cu_seqlens_q, no_offsets, max_seqlen_q, batch_map=batch_map)
        check_paged_values(page_table, cu_seqlens_k, seqused_k, k.shape[0] // page_size, page_size,
                           default_tile_n(d, dv))
    elif check_values:
        host_io.check_varlen_values(tq, k.shape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   seqused_k=seqused_k, batch_map=batch_map)
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or tq == 0 or hq == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key (and a TMA map cannot have a 0 extent)
        return _nothing_visible(out, lse, sink, head_dim=0)
    # a batch of one: the dense kernel's tensor maps and (B, ...) indexing serve the packed tensors
    args = _call_args(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0),
                      softmax_scale, max_seqlen_q, cu_seqlens_q, cu_seqlens_k, seqused_k, batch_map,
                      max_ctas=_launch_ctas(scheduler, q.device), tile_counter=_tile_counter(scheduler, q.device),
                      softcap=variant.softcap, sink=sink, page_table=page_table)
    flags = (True, seqused_k is not None, batch_map is not None)
    _compile(True, dt, d, dv, causal, policy, scheduler, flags, tile_m, variant=variant, page_size=page_size).fn(*args)
    return out, lse


def _check_per_sequence(name, t, batch: int, device):
    """An int32 (batch,) tensor on q's device (seqused_k, cache_rows of a split launch)."""
    host_io._check_i32_vector(name, t, batch)
    if t.device != device:
        raise ValueError(f"{name}: expected a CUDA tensor on {device}, got {t.device}")


def varlen_flags(varlen: bool, seqused_k: bool, batch_map: bool, key_starts: bool = False) -> tuple:
    """The compile key's optional-tensor flags (_key): (varlen, seqused_k, batch_map), and a 4th -- a key
    split's first keys in its cu_seqlens_k slot -- only when present, so the builds without it keep
    their keys."""
    return (bool(varlen), bool(seqused_k), bool(batch_map)) + ((True,) if key_starts else ())


def attention_split_forward(q, k, v, num_splits: int, chunk_keys: int, *, seqused_k=None, page_table=None,
                            softmax_scale=None, causal=False, rows_per_query=1, softcap=0.0, out=None, lse=None,
                            rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                            emulation_fraction=DEFAULT_EMULATION_FRACTION, policy: SoftmaxPolicy | None = None,
                            tile_m: int | None = None, range_keys: int | None = None, window_size=(None, None),
                            cache_rows=None, key_starts=None):
    """Split-KV (components.key_split): q (B, R, Hq, D) against num_splits chunks of chunk_keys keys
    of each sequence's cache -> the parts, out (B * n, R, Hq, Dv) in q's dtype (chunk j of sequence
    b at row b * n + j, O divided by the chunk's own row sums) and lse (B * n, Hq, R) fp32 (-inf
    where a chunk has no key in use). stage3_fwd_kernel.split_combine merges them.

    k / v: a dense cache (>= B, S, Hkv, D) / (..., Dv), sequence b in row b -- or in row cache_rows[b]
    (int32 (B,) on q's device, FlashAttention-2's cache_batch_idx; the rows are not checked on the
    host, which would synchronize) -- or with page_table (int32 (B, pages)) a paged one
    (num_pages, page_size, Hkv, *) read in place (components.paged_kv). seqused_k (int32
    (B,)): the keys sequence b uses, from its first (None: all S; required with page_table).
    key_starts (int32 (B,), a dense cache): sequence b's first key (FlashAttention-2's cache_leftpad),
    so it reads keys [key_starts[b], seqused_k[b]); the masks still count from the sequence's end.
    chunk_keys: a multiple of the key tile when num_splits > 1, and num_splits * chunk_keys must
    cover the keys a sequence reads (S, or pages * page_size; min(S, range_keys)). causal:
    bottom-right aligned to each sequence's end (row i of R sees its first L_b - R + 1 + i keys), in
    every chunk; rows_per_query g > 1: q is (B, T, Hq, D) as the call holds it and the kernel reads
    each group of g query heads as rows, row t g + j token t of head j of the group (Q's TMA box spans
    g heads and 64 / g tokens: no packing copy), masked by its token; the parts then have R = T g rows
    and Hq / g heads (g divides the tile's rows).
    window_size: a sliding window (as attention_forward's), bottom-right aligned like causal; no sink
    (a sink joins the merged row once). range_keys W: each sequence reads only its last W keys, chunk
    j from key max(L_b - W, 0) + j chunk_keys (T tokens with a left edge `left` need W = left + T;
    components.key_split); with a page table that first key is rounded down to the key tile, so a
    paged range needs a left window with left + T <= W to hide the keys before it. out / lse: where
    the parts go (any strides with a unit last one; lse may be a view of an (Hq, B * n, R) buffer,
    the layout the merge reads).
    One CTA per tile; with g = 1 q's rows may be a strided view (one token's GQA heads packed as rows)."""
    import torch

    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a rank-4 torch tensor, got {getattr(t, 'shape', type(t).__name__)}")
    for name, n in (("num_splits", num_splits), ("chunk_keys", chunk_keys)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v: expected CUDA tensors on one device, got {q.device}, {k.device}, {v.device}")
    b, r, hq, d = q.shape
    dv = v.shape[-1]
    _check_head_dims(d, dv)
    if b * num_splits > 65535 or hq > 65535:
        raise ValueError(f"num_splits: batch x num_splits ({b} x {num_splits}) and the heads ({hq}) must be <= 65535 "
                         "(grid z / y)")
    tile_n = default_tile_n(d, dv)
    page_size = None
    if cache_rows is not None:
        if page_table is not None:
            raise ValueError("cache_rows: a paged cache's rows are its page table's; pass one of the two")
        _check_per_sequence("cache_rows", cache_rows, b, q.device)
    if key_starts is not None:
        if page_table is not None:
            raise ValueError("key_starts: a dense cache's first keys; a paged range starts on its pages")
        _check_per_sequence("key_starts", key_starts, b, q.device)
    if page_table is not None:  # (the checks: split_launch flattens the pages itself)
        _, _, page_size, page_table = flat_paged_cache(k, v, page_table, b, seqused_k, tile_n)
        cache_keys = page_table.shape[1] * page_size
    elif k.shape[0] < (b if cache_rows is None else min(b, 1)) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected (>= B={b}, S, Hkv, *) caches (sequence b in row b; any rows with "
                         f"cache_rows), got {tuple(k.shape)}, {tuple(v.shape)}")
    else:
        cache_keys = k.shape[1]
    if num_splits > 1 and chunk_keys % tile_n:
        raise ValueError(f"chunk_keys: must be a multiple of the key tile ({tile_n}) when splitting, got {chunk_keys}")
    if range_keys is not None and (isinstance(range_keys, bool) or not isinstance(range_keys, int)
                                   or not 1 <= range_keys < RANGE_ALL):
        raise ValueError(f"range_keys: expected an int >= 1 (keys read from each sequence's end) or None, "
                         f"got {range_keys!r}")
    host_io.check_causal(causal)
    window = beyond_causal(causal, window_size)
    # packed rows: a 64-row TMA box of Q spans g heads x 64 / g tokens, so g divides 64 as well
    if isinstance(rows_per_query, bool) or not isinstance(rows_per_query, int) or rows_per_query < 1 \
            or hq % rows_per_query or 64 % rows_per_query:
        raise ValueError(f"rows_per_query: expected an int >= 1 dividing q's {hq} heads and 64, got {rows_per_query!r}")
    if range_keys is not None and page_table is not None and (window.left is None or window.left + r > range_keys):
        raise ValueError(f"range_keys: a paged range starts on a key block, so it needs a left window that hides "
                         f"the keys before it (left + query tokens <= range_keys), got {range_keys} with "
                         f"window_size {tuple(window_size)} and {r} tokens")
    r, hq = r * rows_per_query, hq // rows_per_query   # the kernel's rows and heads
    # a paged range's first key is rounded down: up to a key tile less one more keys
    span = cache_keys if range_keys is None else min(cache_keys, range_keys + (tile_n - 1 if page_table is not None
                                                                                else 0))
    if num_splits * chunk_keys < span:
        raise ValueError(f"num_splits * chunk_keys ({num_splits} x {chunk_keys}) does not cover the "
                         f"{span} keys a sequence reads")
    if seqused_k is not None:
        _check_per_sequence("seqused_k", seqused_k, b, q.device)
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v: expected one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[-1] != d or k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"k: head dim {k.shape[-1]} and {k.shape[2]} heads do not match q's {d} and {hq}")
    variant = Variant(window, check_softcap(softcap), False)
    tile_m, dt, softmax_scale = _check_call(q, d, dv, tile_m, softmax_scale, causal, variant, cache=True)
    policy.check_dtype(dt)
    bn = b * num_splits
    check_grid(StaticTileScheduler, -(-r // tile_m), hq, bn)
    out, lse = _outputs(out, lse, (bn, r, hq, dv), (bn, hq, r), q)
    return split_launch(q, k, v, out, lse, num_splits, chunk_keys, softmax_scale=softmax_scale, causal=causal,
                        window=window, softcap=variant.softcap, rows_per_query=rows_per_query, tile_m=tile_m,
                        seqused_k=seqused_k, page_table=page_table, cache_rows=cache_rows, key_starts=key_starts,
                        range_keys=range_keys, policy=policy)


def split_launch(q, k, v, out, lse, num_splits: int, chunk_keys: int, *, softmax_scale: float, causal=False,
                 window: Window = NO_WINDOW, softcap: float = 0.0, rows_per_query: int = 1, tile_m: int | None = None,
                 seqused_k=None, page_table=None, cache_rows=None, key_starts=None, range_keys: int | None = None,
                 policy: SoftmaxPolicy = DEFAULT_POLICY):
    """attention_split_forward's launch, after its checks, into outputs the caller made: out
    (B n, R, Hq', Dv) and lse (B n, Hq', R) as there. No argument is checked -- each check is host
    time on every decode step -- so the caller's own checks must imply attention_split_forward's
    (fa4 calls this after flash_attn_with_kvcache's). The arguments are attention_split_forward's,
    resolved: softmax_scale a float, window the kernel's (components.window.beyond_causal of the
    window_size), tile_m None for the short-query default; k / v as the caller holds them (with
    page_table: the pages)."""
    b, r, hq, d = q.shape
    dv = v.shape[-1]
    r, hq = r * rows_per_query, hq // rows_per_query                                      # the kernel's rows, heads
    if b == 0 or r == 0 or hq == 0:
        return out, lse
    page_size = None
    if page_table is not None:
        page_size = k.shape[1]
        cache_keys = page_table.shape[1] * page_size
        k = k.reshape(1, -1, k.shape[2], k.shape[3])                                    # (1, pages * page_size, Hkv, D)
        v = v.reshape(1, -1, v.shape[2], v.shape[3])
        page_table = page_table.contiguous()
    else:
        cache_keys = k.shape[1]
    if cache_keys == 0:
        return _nothing_visible(out, lse, None, head_dim=1)
    q, k, v = host_io.align_16B(q), host_io.align_16B(k), host_io.align_16B(v)
    used = None if seqused_k is None else seqused_k.contiguous()
    rows = None if cache_rows is None else cache_rows.contiguous()
    starts = None if key_starts is None else key_starts.contiguous()
    # the kernel's batch_map and cu_seqlens_k slots carry the cache rows and first keys under a key split
    # (components.key_split)
    args = _call_args(q, k, v, out, lse, softmax_scale, r, cu_seqlens_k=starts, seqused_k=used, batch_map=rows,
                      softcap=softcap, page_table=page_table, num_splits=num_splits, chunk_keys=chunk_keys,
                      range_keys=RANGE_ALL if range_keys is None else range_keys)
    flags = varlen_flags(False, used is not None, rows is not None, starts is not None)
    dt = host_io.cutlass_dtype(q.dtype)
    variant = Variant(window, float(softcap), False)  # (an int softcap would name another disk entry)
    key = _split_key(dt, d, dv, bool(causal), policy, flags, tile_m, variant, page_size, rows_per_query, trace.key())
    _compile(True, dt, d, dv, causal, policy, StaticTileScheduler, flags, tile_m, variant=variant,
             page_size=page_size, key_split=True, rows_per_query=rows_per_query, key=key).fn(*args)
    return out, lse


@functools.lru_cache(maxsize=256)
def _split_key(dt, d, dv, causal, policy, flags, tile_m, variant, page_size, rows_per_query, traced) -> tuple:
    """A split launch's compile key (_key), memoized: building it resolves the tile and reads the
    trace switch (`traced`, trace.key(), is part of the memo's key for that reason)."""
    return _key("gpu", dt, d, dv, causal, policy, StaticTileScheduler, flags, tile_m, variant=variant,
                page_size=page_size, key_split=True, rows_per_query=rows_per_query)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False, seqused_k=False,
                 batch_map=False, rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                 emulation_fraction=DEFAULT_EMULATION_FRACTION, policy: SoftmaxPolicy | None = None,
                 scheduler=None, tile_m: int | None = None, launchable: bool = False,
                 persistent: bool | None = None, seqlen_k: int | None = None,
                 split_tail: bool = False, window_size=(None, None), softcap: float = 0.0,
                 learnable_sink: bool = False, page_size: int | None = None, key_split: bool = False,
                 rows_per_query: int = 1, key_starts: bool = False) -> Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report.
    varlen / seqused_k / batch_map select which optional tensors the kernel is built for; tile_m
    and persistent as in attention_forward (None = default_tile_m / default_persistent, which takes
    seqlen_k: the key count of the calls the build is for, None = short). launchable=True builds
    what attention_forward launches (TVM-FFI, the same cache key). window_size / softcap /
    learnable_sink (a bool: built for a sink) select the variant as attention_forward does; page_size:
    built for a paged cache (needs varlen and seqused_k); key_split: what attention_split_forward
    launches (dense, one CTA per tile; seqused_k, page_size, rows_per_query, batch_map -- its
    cache_rows -- and key_starts as its call passes them)."""
    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    variant = Variant(beyond_causal(causal, window_size), check_softcap(softcap), bool(learnable_sink))
    split_tail = _no_split_with(variant, split_tail)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    _check_head_dims(head_dim, head_dim_v)
    # a dense build's tile may depend on the key count (config.default_tile_m); a varlen one's does not
    tile_m = _build_tile_m(tile_m, head_dim, head_dim_v, causal, variant, page_size is not None or key_split,
                           None if varlen else seqlen_k)
    if key_split and (varlen or learnable_sink or split_tail or (batch_map and page_size is not None)):
        raise ValueError("key_split: a dense build (batch_map: each sequence's cache row, not with page_size) without "
                         "a sink or a split tail")
    if key_split and persistent:
        raise ValueError("persistent: a key split runs one CTA per tile")
    if key_starts and (not key_split or page_size is not None):
        raise ValueError("key_starts: a key split's first keys of a dense cache (key_split=True, no page_size)")
    if (seqused_k or batch_map) and not (varlen or key_split):
        raise ValueError("seqused_k / batch_map: only with varlen=True")
    if page_size is not None and not ((varlen or key_split) and seqused_k):
        raise ValueError("page_size: a paged build needs varlen=True (or key_split=True) and seqused_k=True")
    dt = host_io.cutlass_dtype(dtype)
    policy.check_dtype(dt)
    if key_split:
        persistent = False
    scheduler = _resolve_scheduler(scheduler, persistent, head_dim, head_dim_v, causal, bool(varlen), seqlen_k, tile_m,
                                   variant.window.left is not None,
                                   gathered_pages=gathered(page_size, default_tile_n(head_dim, head_dim_v)),
                                   windowed=variant.window.limited)
    flags = varlen_flags(varlen, seqused_k, batch_map, key_starts)
    comp = _compile(launchable, dt, head_dim, head_dim_v, causal, policy, scheduler, flags, tile_m, split_tail,
                    variant, page_size, key_split, rows_per_query)
    comp.report.setdefault("FADD.RM", len(re.findall(r"\bFADD(?:\.\w+)*\.RM\b", comp.sass)) if comp.sass else None)
    comp.report.setdefault("VOTE.ANY", len(re.findall(r"\bVOTE\.ANY\b", comp.sass)) if comp.sass else None)
    # the mask's selects: FSEL in bf16 builds, integer SEL on the same registers in fp16 ones
    comp.report.setdefault("FSEL", len(re.findall(r"\bFSEL\b", comp.sass)) if comp.sass else None)
    comp.report.setdefault("SEL", len(re.findall(r"\bSEL\b", comp.sass)) if comp.sass else None)
    return comp


def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False,
                       seqused_k=False, scheduler=None, seqlen_k=None, window_size=(None, None),
                       softcap: float = 0.0, learnable_sink: bool = False, tile_m: int | None = None) -> list:
    """What attention_forward (varlen=True: attention_varlen_forward) launches with its defaults and
    `scheduler`, compiled without a GPU under the launch's cache key (TVM-FFI, fake tensors): a list
    of Compiled records -- the kernel, and for non-causal dense calls on persistent CTAs also what
    long ones launch, the split-tail build and its combine kernel. seqlen_k: the key count of the
    calls (None = short ones), as default_persistent takes it; tile_m as attention_forward's. With
    fa4's disk cache installed this fills it on a CPU machine."""
    from stage3_fwd_kernel import split_combine

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    variant = dict(window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
    builds = [compile_only(dtype, head_dim, head_dim_v, causal, varlen=varlen, seqused_k=seqused_k,
                           scheduler=scheduler, launchable=True, seqlen_k=seqlen_k, tile_m=tile_m, **variant)]
    plain = beyond_causal(causal, window_size) == NO_WINDOW and not (softcap or learnable_sink)
    if plain and not (causal or varlen or scheduler is not None) and default_persistent(head_dim, head_dim_v, False,
                                                                                         tile_m=tile_m):
        builds.append(compile_only(dtype, head_dim, head_dim_v, False, persistent=True, split_tail=True,
                                   launchable=True, tile_m=tile_m))
        builds.append(split_combine.compile_only(dtype, head_dim_v, launchable=True))
    return builds
