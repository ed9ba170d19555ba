"""flash_attn_with_kvcache: attention against a KV cache (dense or paged), for prefill and decode.

One mechanism serves every layout: the varlen forward kernel reads sequence i's keys from row
cu_seqlens_k[i] of a flat key tensor and uses seqused_k[i] of them, and nothing else constrains
those offsets. So a cache is cut into *segments* -- (query rows, first cache row, keys used) --
that index the cache in place, with no copy:

* dense cache (B_cache, S_cache, Hkv, D), one segment per sequence: prefill with a causal mask;
* dense, split-KV: n segments per sequence, each a chunk of the keys, so a decode step with a
  small batch runs n x as many CTAs; the partial (out, lse) pairs are merged through their
  log-sum-exp (stage 1's rescale) by one small kernel (stage 3's split_combine.PartsCombine);
* paged cache (num_pages, page_size, Hkv, D) with block_table (B, pages_per_seq) read in place
  (fa4._paged: TMA boxes for multiples and 16-row divisors of the key tile, pages of 16 keys only
  below fa4._dispatch.SMALL_PAGE_COPY_HEAD_ROWS query-head rows attending each key; a cp.async row
  gather for the other page sizes up to fa4._dispatch.GATHER_MAX_QUERY_ROWS kernel rows -- query
  tokens times the group when GQA heads are packed): it is cut into chunks exactly like a dense
  cache, only the chunks' first keys are logical positions and each segment gets its sequence's
  page-table row;
* a paged cache the kernel does not read in place (longer queries over gathered page sizes or over
  pages of 16, head dims that run padded, an arch without the paged forward): one segment per page,
  merged the same way, from MIN_SEGMENT_PAGE keys up; smaller pages are gathered into a dense copy
  first (many tiny segments cost far more).

Where a call has at most 64 kernel rows (decode) over a dense cache (sequence b in cache row b,
or cache_batch_idx[b]) or pages read in place, an eager call on the device skips the segments: the
Hopper forward's split-KV launch (stage 3's components.key_split) gives chunk j of sequence b its
own CTAs, which find the chunk's keys from (b, j, the chunk size, cache_seqlens[b], its cache row)
themselves and read the queries where they are; a causal diagonal or a window stays where it is at
the sequence's end, so a few causal query tokens (speculative decoding) split too, and a window's
chunks hold only its last left + Sq keys (range_keys). A decode step is then the attention kernel
and the merge, without the segment offsets' and the replicated queries' small kernels (`fa4_split`).
Traced calls (torch.compile, fake or meta tensors) run the attention over the cache as one custom op,
fa4::kvcache_attention, whose implementation is this eager path (the append and the rotary embedding
stay torch functions in the graph): no graph break, the same kernels.

The varlen kernel's segments change each segment's key count, and fa4's masks are bottom-right
aligned to it, so segments split only where the mask does not depend on alignment: no window, and
causal only for single-token queries (which see every key anyway). One query token with a window
sees the last left + 1 keys of its sequence: that is a key range, not a mask, so the split launch
(range_keys = left + 1) or the segments start at the window's first key and split like no window
(`key_range_window`; dense caches, and paged ones gathered). Otherwise (a causal prefill) a cache runs
unsplit, and a paged one with another page size is gathered into a dense copy first.

cache_leftpad (a dense cache, FlashAttention-2's): sequence b's keys start at its row p_b, a left-padded
batch. The split launch starts its chunks there (components.key_split's key_starts) and the segments
add p_b to their first rows; the masks count from the sequence's end, so they do not change.

GQA packing (decode): with one query token, the g = Hq / Hkv query heads of a group become g rows
attending to their KV head, so each KV head is read once per segment instead of g times; with a few
causal or windowed tokens the split launch reads them as rows by token from q itself.

The learnable sink joins the denominator once, after the merge (so it is not counted per segment).

Blackwell (sm_100) has no split launch (`Backend.SPLIT_KV_LAUNCH`), so its calls take the segments
above through its own varlen forward (seqused_k) and the merge kernel; it reads pages of a multiple of
128 keys, and of 16, 32 or 64 keys outside head dims (192, 128), in place (chunked like a dense cache;
fa4._dispatch.BlackwellBackend.paged_in_place) and copies the others. Compiled for sm_100a only,
never run on hardware.

An eager step on the device, once checked, replays a launch plan (fa4._plans) from its third call with
the same shapes: the same torch functions and kernels without this module's host logic (a one-token
decode step's host time on an H200: 127-146 us, was 222-405; docs/measurements.md). Without a plan
(a cache growing every step) the split launch and its merge take stage 3's unchecked launches, whose
checks this module's imply (`fa4_split`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from . import _dispatch, _ops, _paged, _plans
from ._layouts import gather_kv_pages, shape_constant
from ._lse_merge import add_sink, merge_parts
from ._validate import (MAX_GRID_YZ, _check_flag, check_grid, check_learnable_sink, check_softcap, check_softmax_scale,
                        check_window)

TILE_M = 128              # query rows of one CTA tile in the Hopper forward
KEY_TILE = 128            # the Hopper forward's widest key block: chunks are its multiples, paged ranges start on one
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (prologue, epilogue, merge) dominates
MAX_SPLITS = 64
MAX_GRID_Z = MAX_GRID_YZ  # a CUDA grid's z extent: the split launch's batch x splits
PACKED_CAUSAL_ROWS = 64   # the split launch's rows (one short-query tile, fa4._dispatch), causal ones packed
# Pages the kernel does not read in place become one segment each only from this size on; smaller ones
# are gathered into a dense copy first: a segment per page of 16 keys ran at 0.06x of a dense cache
# on an H200 (138 GB/s at 1 x 16k), while a copy costs about two more passes over the keys.
MIN_SEGMENT_PAGE = 128


def _sm_count(device) -> int:
    """The device's SM count, looked up once per device (a per-call property query is host time; and
    no kernel module is imported, so a replayed launch plan runs without CuTe-DSL)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(batch: int, head_tiles: int, max_keys: int, sm_count: int) -> int:
    """Split-KV count for num_splits=0: as many splits as fill the SMs once (sm_count // CTAs), each
    keeping at least MIN_KEYS_PER_SPLIT keys. head_tiles = CTAs per sequence without splitting (heads
    x query tiles). A function of (batch, heads, cache length, SM count) only: no device values.
    One wave, not two: swept on an H200 (GQA 32 / 8, d = 128, one token; docs/measurements.md,
    2026-11-29), sm_count // CTAs was the fastest count at every shape from 1 x 8k to 32 x 8k
    (1 x 16k: 16 splits 2112 GB/s, 33 splits 1833), and counts that do not divide the keys evenly
    (3, 5, 6, 12) lost 5-10% to their neighbours."""
    ctas = max(1, batch * head_tiles)
    if ctas >= sm_count or max_keys <= MIN_KEYS_PER_SPLIT:
        return 1
    want = sm_count // ctas
    return max(1, min(want, math.ceil(max_keys / MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def identity_rows(b: int, device):
    """Cache row b for sequence b (no cache_batch_idx): (B,) int32."""
    return shape_constant(("rows", device, b), lambda: torch.arange(b, device=device, dtype=torch.int32))


class Segments(NamedTuple):
    """Per segment i (ordered batch-major, n per batch row): cache row cu_k[i], keys used[i]."""
    cu_k: torch.Tensor    # (B * n + 1,) int32; the last entry is unused by the kernel (kept = flat length)
    used: torch.Tensor    # (B * n,) int32
    n: int
    max_keys: int


def dense_segments(seqlens_k, cache_rows, s_cache: int, n: int, left: int | None = None,
                   key_starts=None) -> Segments:
    """n chunks of each sequence's keys in a dense cache viewed as (B_cache * S_cache, Hkv, D).
    Chunks are rounded up to 128 keys (the kernel's key block) so only the last one is partial.
    int32 throughout (the kernel's offsets are int32). cache_rows None: sequence b in cache row b, so
    the first rows are a constant of the shapes and only the keys used are computed per call.
    left: only the last left + 1 keys of each sequence (one query token's window): the chunks start
    at key max(L_b - 1 - left, 0), computed on the device (no host sync). key_starts p (B,) int32
    (cache_leftpad): sequence b's keys are [p_b, L_b), chunked from p_b (every mask counts from the end)."""
    dev, b = seqlens_k.device, seqlens_k.shape[0]
    if key_starts is not None:   # the keys past p_b, counted from there; p_b joins each first row below
        seqlens_k = (seqlens_k - key_starts).clamp_(min=0)
    shift = 0 if key_starts is None else key_starts.view(-1, 1)                           # (B, 1)
    rows = identity_rows(b, dev) if cache_rows is None else cache_rows
    if left is not None:
        chunk, n = _chunks(min(s_cache, left + 1), n)
        starts = _chunk_keys(seqlens_k, n, chunk)[0]
        first_key = (seqlens_k.view(-1, 1) - 1 - left).clamp_(min=0) + starts            # (B, n)
        used = (seqlens_k.view(-1, 1) - first_key).clamp_(0, chunk)
        return _pack(rows.view(-1, 1) * s_cache + shift + first_key, used, n, chunk)
    chunk, n = _chunks(s_cache, n)
    starts, used = _chunk_keys(seqlens_k, n, chunk)
    if cache_rows is None and key_starts is None:
        cu_k = shape_constant(("dense_cu_k", dev, b, n, chunk, s_cache),
                              lambda: _pad_one(identity_rows(b, dev).view(-1, 1) * s_cache + starts))  # (B n + 1,)
        return Segments(cu_k, used.reshape(-1), n, chunk)
    first = rows.view(-1, 1) * s_cache + shift + starts                                    # (B, n)
    return _pack(first, used, n, chunk)


def _chunk_keys(seqlens_k, n: int, chunk: int):
    """Chunk j of every sequence starts at key j * chunk: (starts (n,), a constant of the shapes; the
    keys each chunk uses (B, n), clamped to [0, chunk])."""
    dev = seqlens_k.device
    starts = shape_constant(("starts", dev, n, chunk),
                            lambda: torch.arange(0, n * chunk, chunk, device=dev, dtype=torch.int32))  # (n,)
    return starts, (seqlens_k.view(-1, 1) - starts).clamp_(0, chunk)


def _chunks(s_cache: int, n: int) -> tuple[int, int]:
    """(keys per chunk, chunks) for about n chunks of s_cache keys, a chunk a multiple of KEY_TILE keys."""
    chunk = max(1, math.ceil(s_cache / n))
    chunk = min(s_cache, math.ceil(chunk / KEY_TILE) * KEY_TILE) if s_cache >= KEY_TILE else chunk
    return chunk, max(1, math.ceil(s_cache / chunk))


def paged_chunks(seqlens_k, block_table, page_size: int, n: int) -> tuple[Segments, torch.Tensor]:
    """n chunks of each sequence's keys in a paged cache read in place (fa4._paged): segment (b, j)
    starts at logical key j * chunk of sequence b (cu_k holds logical starts, multiples of 128, which
    the kernel turns into pages through its page-table row), so the table is block_table with each
    row repeated n times: (B n, P) int32."""
    b, p = block_table.shape
    chunk, n = split_chunks(p * page_size, n)
    starts, used = _chunk_keys(seqlens_k, n, chunk)
    cu_k = shape_constant(("paged_cu_k", seqlens_k.device, b, n, chunk),
                          lambda: _pad_one(starts.expand(b, n)))                                        # (B n + 1,)
    table = block_table if n == 1 else block_table.repeat_interleave(n, dim=0)                    # (B n, P)
    return Segments(cu_k, used.reshape(-1), n, chunk), table


def paged_segments(seqlens_k, block_table, page_size: int) -> Segments:
    """One segment per page of block_table (B, P): pages are rows of a (num_pages * page_size) cache."""
    p = block_table.shape[1]
    _, used = _chunk_keys(seqlens_k, p, page_size)                                         # a page per chunk
    first = block_table * page_size                                                        # (B, P)
    return _pack(first, used, p, page_size)


def _pack(first, used, n, max_keys) -> Segments:
    # With seqused_k the kernel reads only cu_k[i] (the first row) and used[i]; the last entry (0)
    # just completes the (segments + 1,) shape. So cu_k need not rise (pages, cache_batch_idx) and a
    # segment may use more rows than the next offset leaves: a relaxation of the public varlen
    # contract that this module relies on and fa4's own value checks would reject.
    return Segments(_pad_one(first), used.reshape(-1), n, max_keys)


def _pad_one(first):
    return torch.nn.functional.pad(first.reshape(-1), (0, 1))


def merge_segments(out, lse, n: int, kernel: bool = False, into=None, unpack: int = 1):
    """(B n, R, H, Dv) partial outs and (H, B n, R) lse (the varlen kernel's layouts, n segments per
    batch row) -> merged out (B, R, H, Dv) and lse (B, H, R). One segment needs no merge (views);
    otherwise stage 3's PartsCombine kernel (kernel=True: one launch, out in the input dtype, written
    into `into` when given; its lanes take dv / 32 columns, so other dv use torch) or the same formula
    in torch (the CPU tests' float64 stand-in), copied into `into` when given. unpack g > 1 (n > 1):
    the rows are GQA groups packed by token (row t g + j), and the result comes unpacked, out
    (B, R / g, H g, Dv) and lse (B, H g, R / g), `into` that shape."""
    bn, r, h, dv = out.shape
    if n == 1:
        if unpack > 1:
            raise ValueError("unpack: one segment is not merged (the caller unpacks)")
        return out, lse.permute(1, 0, 2)
    if kernel and dv % 32 == 0:
        from stage3_fwd_kernel import split_combine

        # the layouts are this module's own (the varlen kernel's or the split launch's parts): combine_parts'
        # checks would hold, so its unchecked launch spares a decode step their host time
        g = unpack
        into = out.new_empty(bn // n, r // g, h * g, dv) if into is None else into
        merged_lse = torch.empty(bn // n, h * g, r // g, device=out.device, dtype=torch.float32)
        return split_combine.merge_launch(out, lse, n, into, merged_lse, g)
    out, lse = merge_parts(out.view(bn // n, n, r, h, dv), lse.permute(1, 2, 0).reshape(bn // n, n, r, h), dim=1)
    lse = lse.transpose(1, 2)                                                               # (B, H, R)
    if unpack > 1:
        out, lse = unpack_out(out, unpack), unpack_lse(lse, unpack)
    return (out if into is None else into.copy_(out)), lse


def packed_rows(x, hkv: int):
    """x (B, Sq, Hq, D) as (B, Sq g, Hkv, D) rows, g = Hq / Hkv: row t g + j of KV head kv is token t of
    query head kv g + j. One token: a single strided view (no copy); more: a copy."""
    b, sq, hq, d = x.shape
    g = hq // hkv
    if sq == 1:
        s_b, _, s_h, s_d = x.stride()
        return x.as_strided((b, g, hkv, d), (s_b, s_h, g * s_h, s_d))
    return x.view(b, sq, hkv, g, d).transpose(2, 3).reshape(b, sq * g, hkv, d)


def unpack_out(out, g: int):
    """Packed rows (row t g + j of head h: token t of GQA head h g + j) -> the call's layout:
    (B, R, H, Dv) -> (B, R / g, H g, Dv)."""
    b, r, h, dv = out.shape
    return out.view(b, r // g, g, h, dv).transpose(2, 3).reshape(b, r // g, h * g, dv)


def unpack_lse(lse, g: int):
    """unpack_out's rows for the lse: (B, H, R) -> (B, H g, R / g)."""
    b, h, r = lse.shape
    if r == g:  # one token: the same reshape without the transpose (one torch call, not three)
        return lse.reshape(b, h * g, 1)
    return lse.view(b, h, r // g, g).transpose(2, 3).reshape(b, h * g, r // g)


# ---------------------------------------------------------------------------------------------
# rotary embedding and the in-place append
# ---------------------------------------------------------------------------------------------
def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """x (B, S, H, D); cos / sin (seqlen_ro, rd / 2); positions (B, S) int64. Rotates the first rd
    dims: pairs (0, 1), (2, 3), ... when interleaved, else (i, i + rd / 2) (GPT-NeoX)."""
    rd = cos.shape[-1] * 2
    acc = torch.promote_types(x.dtype, torch.float32)
    c = cos[positions].unsqueeze(2).to(acc)                                               # (B, S, 1, rd/2)
    s = sin[positions].unsqueeze(2).to(acc)
    head, tail = x[..., :rd].to(acc), x[..., rd:]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = head[..., :rd // 2], head[..., rd // 2:]
        rot = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([rot.to(x.dtype), tail], dim=-1)


def append_to_cache(k_cache, v_cache, k, v, cache_rows, seqlens, block_table):
    """Write k, v (B, Sn, Hkv, *) at positions seqlens[b] .. + Sn of each sequence, in place."""
    b, sn = k.shape[:2]
    pos = seqlens.to(torch.int64).view(-1, 1) + torch.arange(sn, device=k.device)          # (B, Sn)
    if block_table is None:
        cache_rows = identity_rows(b, k.device) if cache_rows is None else cache_rows
        rows = cache_rows.to(torch.int64).view(-1, 1).expand(b, sn)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        ps = k_cache.shape[1]
        page = torch.gather(block_table.to(torch.int64), 1, pos // ps)
        k_cache[page, pos % ps] = k
        v_cache[page, pos % ps] = v


# ---------------------------------------------------------------------------------------------
# the whole call
# ---------------------------------------------------------------------------------------------
def fa4_varlen(q, k, v, cu_q, cu_k, used, max_q, max_k, scale, causal, window, softcap, page_table=None):
    """fa4's varlen forward (the custom op when tracing, its implementation in eager mode); with
    page_table, k / v are the paged cache read in place (fa4._paged) and cu_k logical first keys."""
    from . import _ops

    if page_table is not None:
        return _ops.paged_varlen_attention(q, k, v, page_table, cu_q, cu_k, used, max_q, max_k, scale, causal,
                                           window, softcap)

    args = (q, k, v, cu_q, cu_k, used, max_q, max_k, scale, causal, False, True, window[0], window[1], softcap, None)
    if _ops.eager_ok(q, k, v):
        return _ops._varlen_fwd_impl(*args)
    return _ops.varlen_fwd(*args)


def fa4_split(rows, k_cache, v_cache, seqlens_k, n: int, chunk: int, scale, softcap, page_table=None, out=None,
              causal=False, rows_per_query=1, unpack=1, range_keys=None, window=(None, None), cache_rows=None,
              key_starts=None):
    """The Hopper forward's split-KV launch (stage3 hopper.attention_split_forward): rows (B, R, H', D)
    -- or, rows_per_query g > 1, q itself (B, Sq, Hq, D), whose GQA groups the kernel reads as
    R = Sq g rows of H' = Hq / g heads -- against n chunks of `chunk` keys of each sequence's dense
    cache, or of its pages (page_table) ->
    out (B, R, H', Dv) (into `out` when given) and lse (B, H', R) fp32, merged. No segment offsets,
    no replicated queries: the kernel finds each chunk itself. n > 1: the parts go to the merge
    kernel (PartsCombine); n = 1: the kernel writes the result, and its lse buffer is (B, H', R).
    causal: bottom-right aligned to each sequence's end, in every chunk; rows_per_query: the packed
    GQA group, whose rows the causal mask takes by token; unpack g > 1 (n > 1): the merge writes the
    token-packed rows unpacked (merge_segments), out (B, R / g, H' g, Dv) and lse (B, H' g, R / g).
    window: (left, right) as the kernel's, aligned to each sequence's end like causal; range_keys W:
    each sequence reads its last W keys, the chunks counted from key max(L_b - W, 0) (rounded down to
    the key tile with pages, where the window must hide the keys before it). cache_rows (int32 (B,)):
    sequence b's row of a dense cache (cache_batch_idx; None: row b); key_starts (int32 (B,)): its first
    key (cache_leftpad; None: 0), the chunks counted from max(that, the range's first key)."""
    from . import _dispatch

    b, r, h, _ = rows.shape
    r, h = r * rows_per_query, h // rows_per_query                                      # the kernel's rows, heads
    dv = v_cache.shape[-1]
    if n == 1 and unpack > 1:
        raise ValueError("unpack: an unsplit launch writes the packed rows (the caller unpacks them)")
    mod = _dispatch.backend_for(rows.device).forward_module()
    # with_kvcache's checks imply the split launch's own (stage 3's attention_split_forward): its unchecked
    # launch spares a decode step their host time
    kw = dict(softmax_scale=scale, causal=causal, window=_kernel_window(causal, tuple(window)), softcap=softcap,
              rows_per_query=rows_per_query, tile_m=_dispatch.short_query_tile(r), seqused_k=seqlens_k,
              page_table=page_table, cache_rows=cache_rows, key_starts=key_starts, range_keys=range_keys)
    if n == 1:
        out = torch.empty(b, r, h, dv, device=rows.device, dtype=rows.dtype) if out is None else out
        lse = torch.empty(b, h, r, device=rows.device, dtype=torch.float32)
        return mod.split_launch(rows, k_cache, v_cache, out, lse, 1, chunk, **kw)
    lse = torch.empty(h, b * n, r, device=rows.device, dtype=torch.float32)                # the merge's layout
    parts = torch.empty(b * n, r, h, dv, device=rows.device, dtype=rows.dtype)
    mod.split_launch(rows, k_cache, v_cache, parts, lse.permute(1, 0, 2), n, chunk, **kw)
    return merge_segments(parts, lse, n, kernel=True, into=out, unpack=unpack)


@functools.lru_cache(maxsize=64)
def _kernel_window(causal: bool, window: tuple):
    """The split launch's window (stage 3's components.window.beyond_causal) of fa4's (left, right)."""
    from stage3_fwd_kernel.components.window import beyond_causal

    return beyond_causal(causal, window)


def split_chunks(s_cache: int, n: int) -> tuple[int, int]:
    """(keys per chunk, chunks) where every chunk must start on a key-tile border (the split launch,
    paged chunks): _chunks', but a cache of under 128 keys is one chunk."""
    chunk, n = _chunks(s_cache, n)
    return (s_cache, 1) if n > 1 and chunk % KEY_TILE else (chunk, n)


def plan_layout(sq: int, group: int, causal: bool, window, pack_gqa,
                token_rows: bool = False) -> tuple[bool, bool, bool]:
    """(causal, free, pack): free = the mask ignores key alignment (segments may split and page);
    pack = GQA packing of the query heads into rows. One query token with no window sees every
    key, so causal is dropped for it. token_rows: the kernel masks packed rows by their query token
    (the split launch), so a causal or windowed call packs too while its rows fill at most one
    short-query tile (PACKED_CAUSAL_ROWS, the group dividing it): speculative decoding."""
    no_window = tuple(window) == (None, None)
    if sq == 1 and no_window:
        causal = False
    free = no_window and not causal
    by_token = token_rows and sq * group <= PACKED_CAUSAL_ROWS and PACKED_CAUSAL_ROWS % group == 0
    if pack_gqa and not (free or by_token):
        raise ValueError("pack_gqa: packing the query heads needs a mask that is the same for every row (no window, "
                         "and causal only with one query token), or a split launch that masks them by token (rows "
                         "of at most one 64-row tile, eager on the device); pass None or False")
    pack = (group > 1 and (free or by_token)) if pack_gqa is None else bool(pack_gqa) and group > 1
    return causal, free, pack


def key_range_window(sq: int, window, paged_in_place: bool):
    """(window, left) for the kernel: one query token at the sequence's end sees keys
    [L - 1 - left, L) whatever the window's right edge, so its window is dropped -- a free mask,
    packed and split like no window -- and, with a left edge, `left` makes the split launch or the
    segments start at the window's first key (dense caches; pages read in place start on a key
    block, so they keep the window to mask the keys before it). Longer queries keep their window
    (left None)."""
    if sq != 1 or tuple(window) == (None, None):
        return window, None
    if window[0] is None:
        return (None, None), None
    return (window, None) if paged_in_place else ((None, None), window[0])


def attention_with_cache(q, k_cache, v_cache, seqlens_k, cache_rows, block_table, scale, causal, window, softcap,
                         sink, num_splits, pack_gqa, sm_count, varlen=fa4_varlen, paged_in_place=False, split=None,
                         key_starts=None):
    """q (B, Sq, Hq, D) against the first seqlens_k[b] keys of each sequence's cache -- from key
    key_starts[b] on where given (cache_leftpad, a dense cache: the masks still count from the end).
    paged_in_place: the kernel reads the pages through the table (fa4._paged), so a paged cache is
    chunked like a dense one (logical chunks, any mask) instead of one segment per page.
    split: a split-KV launch with its merge (`fa4_split`'s contract), taken by calls of at most
    PACKED_CAUSAL_ROWS kernel rows over a dense cache (cache_rows: each sequence's row) or pages read in
    place (a left window: the chunks hold the last left + Sq keys, range_keys); else the varlen kernel
    runs segments (which split only free masks).
    Returns out (B, Sq, Hq, Dv) in q's dtype and lse (B, Hq, Sq) fp32."""
    b, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    paged_in_place = paged_in_place and block_table is not None
    window, left = key_range_window(sq, window, paged_in_place)
    causal, free, pack = plan_layout(sq, hq // hkv, causal, window, pack_gqa, token_rows=split is not None)
    if block_table is not None and not paged_in_place and (not free or left is not None
                                                           or k_cache.shape[1] < MIN_SEGMENT_PAGE
                                                           or b * block_table.shape[1] > MAX_GRID_Z):
        # page segments would misalign the mask, or not start at the window, or be too short, or outnumber
        # a grid's z extent (one per page): a dense copy
        k_cache, v_cache = gather_kv_pages(k_cache, v_cache, block_table)
        cache_rows, block_table = None, None  # the copy holds sequence b at row b
    heads = hkv if pack else hq
    r = sq * (hq // hkv) if pack else sq                                                  # rows per segment
    table, kw = None, {}
    # a split launch finds its chunks itself (a causal diagonal too: it sees each chunk's distance to the
    # sequence's end); the varlen kernel needs segment offsets (and replicated queries). Short queries
    # only (decode: one 64-row tile, what was measured); prefills keep the varlen kernel
    use_split = split is not None and r <= PACKED_CAUSAL_ROWS and (block_table is None or paged_in_place)
    # the keys a split launch reads from each sequence's end: the window of one token (its mask
    # dropped) or of Sq tokens (masked), left + Sq; a paged range starts up to a key block earlier
    range_keys = left + 1 if left is not None else (window[0] + sq if use_split and window[0] is not None else None)
    if block_table is not None and not paged_in_place:
        seg = paged_segments(seqlens_k, block_table, k_cache.shape[1])
    else:
        s_cache = cache_capacity(k_cache, block_table)
        span = s_cache if range_keys is None else min(s_cache, range_keys + (KEY_TILE - 1 if paged_in_place else 0))
        n = 1 if not (free or use_split) else (num_splits if num_splits > 0 else
                                               choose_num_splits(b, heads * math.ceil(r / TILE_M), span, sm_count))
        n = min(n, max(1, MAX_GRID_Z // b))  # B n sequences (virtual ones or segments): a grid's z extent
        if use_split:
            chunk, n = split_chunks(span, n)
        elif block_table is None:
            seg = dense_segments(seqlens_k, cache_rows, s_cache, n, left, key_starts)
        else:
            seg, table = paged_chunks(seqlens_k, block_table, k_cache.shape[1], n)
            kw = {"page_table": table}
    n = n if use_split else seg.n
    g, final, into = hq // hkv, None, None
    # the split launch reads a causal or windowed call's GQA groups as rows by token from q itself;
    # otherwise packed rows: row t * g + j is query token t of head kv * g + j (a view for one token)
    by_token = use_split and pack and (causal or tuple(window) != (None, None))
    rows = q if by_token or not pack else packed_rows(q, hkv)
    # several packed tokens, split: the merge writes the call's layouts itself (no copies after it)
    unpack = g if pack and sq > 1 and n > 1 else 1
    if pack and sq == 1 and ((n > 1 and varlen is fa4_varlen) or use_split):
        # the merge (a split launch: its kernel) writes the packed rows straight into the (B, 1, Hq, Dv)
        # result: row j of KV head kv is query head kv * g + j, so no transpose copy follows
        final = q.new_empty(b, 1, hq, dv)
        into = packed_rows(final, hkv)                                                  # (B, g, Hkv, Dv)
    if use_split:
        out, lse = split(rows, k_cache, v_cache, seqlens_k, n, chunk, scale, softcap,
                         block_table if paged_in_place else None, out=into, causal=causal,
                         rows_per_query=g if by_token else 1, unpack=unpack,
                         range_keys=range_keys, window=window, cache_rows=cache_rows, key_starts=key_starts)
        # (B, R, H', Dv), (B, H', R); unpacked: (B, Sq, Hq, Dv), (B, Hq, Sq)
    else:
        q_seg = rows.unsqueeze(1).expand(b, n, r, heads, d).reshape(b * n * r, heads, d)    # (B n R, H', D)
        cu_q = shape_constant(("cu_q", q.device, b * n, r),
                              lambda: torch.arange(0, (b * n + 1) * r, r, device=q.device, dtype=torch.int32))
        keys, values = (k_cache, v_cache) if table is not None else (k_cache.reshape(-1, hkv, d),
                                                                     v_cache.reshape(-1, hkv, dv))
        out, lse = varlen(q_seg, keys, values, cu_q, seg.cu_k, seg.used, r, seg.max_keys, scale, causal, window,
                          softcap, **kw)
        out, lse = merge_segments(out.view(b * n, r, heads, dv), lse.view(heads, b * n, r), n,
                                  kernel=varlen is fa4_varlen, into=into, unpack=unpack)  # as the split's
    if final is not None:
        out = final
    elif pack and unpack == 1:
        out = unpack_out(out, g)                                                        # (B, Sq, Hq, Dv)
    if pack and unpack == 1:
        lse = unpack_lse(lse, g)                                                        # (B, Hq, Sq)
    if sink is not None:
        out, lse_t = add_sink(out, lse.transpose(1, 2), sink)                          # lse as (B, Sq, Hq)
        lse = lse_t.transpose(1, 2)
    lse = lse.contiguous()                                                              # (B, Hq, Sq)
    # (no conversion calls where none is needed: each is host time, and a step of a launch plan)
    out = out if out.dtype == q.dtype else out.to(q.dtype)
    return out, lse if lse.dtype in (torch.float32, torch.float64) else lse.float()


# ---------------------------------------------------------------------------------------------
# validation (before anything is written to the cache or launched)
# ---------------------------------------------------------------------------------------------
def _int_vector(name, t, length, device):
    """t checked as an int32 / int64 (length,) vector on `device`, as int32 (itself where it is one: a
    conversion call is host time on every decode step)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an int32 / int64 vector of length {length}, got {t.dtype} "
                        f"{tuple(t.shape)}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: expected an int32 / int64 vector of length {length}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but q is on {device}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def check_leftpad(cache_leftpad, q, block_table, seqlens):
    """cache_leftpad (B,) int32 / int64 or None -> each sequence's first key, int32 (B,) or None. Its
    values are read only under FA4_VALIDATE=1 (one sync): 0 <= cache_leftpad[b] <= cache_seqlens[b]."""
    from ._validate import values_check_enabled

    if cache_leftpad is None:
        return None
    if block_table is not None:
        raise ValueError("cache_leftpad: not with block_table (as in FlashAttention-2: a paged sequence starts on "
                         "its first page); pass None")
    starts = _int_vector("cache_leftpad", cache_leftpad, q.shape[0], q.device)
    if q.shape[0] and values_check_enabled():
        bad = (starts < 0) | (starts > seqlens)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"cache_leftpad: [{i}] = {int(starts[i])} is outside [0, cache_seqlens[{i}] = "
                             f"{int(seqlens[i])}]")
    return starts


def check_native_head_dims(backend, d: int, dv: int):
    """flash_attn_with_kvcache reads the cache in place, so it takes only the kernels' own head-dim pairs
    (padding them would copy the whole cache each call): a ValueError naming the tensor at fault."""
    native = backend.arch.head_dims
    if (d, dv) in native:
        return
    name = "v_cache" if any(qk == d for qk, _ in native) else "q"
    pairs = ", ".join(f"{a}" if a == b else f"({a}, {b})" for a, b in native)
    raise ValueError(f"{name}: head dims (qk={d}, v={dv}) have no kernel of their own on {backend.arch.key}; "
                     f"flash_attn_with_kvcache reads the cache in place and takes only the native pairs ({pairs}). "
                     "flash_attn_func / flash_attn_varlen_func run other pairs zero-padded")


def cache_capacity(k_cache, block_table) -> int:
    """Rows a sequence's cache holds: a dense cache's rows, or a paged one's pages per sequence x page size."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def rotary_q_steps(causal: bool, window, capacity: int) -> bool:
    """Whether q's rotary positions run from cache_seqlens up, one per token, rather than all sitting at
    cache_seqlens: FlashAttention-2's rule, causal or local, where a window side of at least the cache's
    rows per sequence (`capacity`) masks nothing and counts as unlimited."""
    return causal or any(side is not None and side < capacity for side in window)


def full_lengths(device, b: int, keys: int):
    """Cache lengths (B,) int32 all `keys`, one shape constant per (device, B, keys): no tensor made a call."""
    return shape_constant(("full", device, b, keys),
                          lambda: torch.full((b,), keys, dtype=torch.int32, device=device))


def clamped_window(left, right, capacity: int, sq: int) -> tuple:
    """(left, right) with a side past the cache's rows clamped, so no key offset overflows int32: it sees
    all of the cache anyway. The right edge goes to the rows plus the queries: query row 0 sits Sq - 1 rows
    before the last key, so a right edge up to capacity + Sq still decides what it sees when the queries
    outnumber the keys."""
    return (None if left is None else min(left, capacity), None if right is None else min(right, capacity + sq))


def check_cache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     block_table, cuda=True, causal=False, window=(None, None)):
    """Shapes, dtypes, devices; returns (seqlens_k before the append (B,) int32, cache_rows (B,) or None:
    sequence b in cache row b, the cache's rows per sequence). causal / window: where q's rotary positions
    step with its tokens (rotary_q_steps), rotary_cos must reach the last of them too.
    cuda: fa4's dtype / device rules (False: any float dtype on one device, for the CPU stand-in)."""
    from ._validate import _check_dtypes_devices, check_pages_used, values_check_enabled

    if cuda:
        _check_dtypes_devices(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions, got shape {tuple(t.shape)}")
    b, sq, hq, d = q.shape
    slots, per_slot, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache: head_dim {dk} differs from q's head_dim {d} (k_cache {tuple(k_cache.shape)}, "
                         f"q {tuple(q.shape)})")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} in "
                         "its first three dims")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k_cache: heads_kv ({hkv}) must divide q's heads ({hq})")
    if sq == 0:
        raise ValueError("q: needs at least one query token (seqlen_q = 0)")
    for name, t in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                        ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: flash_attn_with_kvcache is forward only (inference); it requires grad -- "
                                 "use torch.no_grad() / inference_mode(), or fa4.flash_attn_func for training")
    if slots * per_slot >= 2 ** 31:  # dense rows or pages x page size: the kernel's row offsets are int32
        raise ValueError(f"k_cache: {slots} x {per_slot} rows exceed the kernel's int32 row offsets")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not with block_table (the table already maps each sequence)")
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table: expected an int32 tensor (batch={b}, pages per sequence), got "
                            f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            got = f"{getattr(block_table, 'dtype', type(block_table))} {tuple(getattr(block_table, 'shape', ()))}"
            raise ValueError(f"block_table: expected int32 (batch={b}, pages per sequence), got {got}")
        if block_table.device != q.device:
            raise ValueError(f"block_table: is on {block_table.device} but q is on {q.device}")
        if slots == 0 or per_slot == 0:
            raise ValueError(f"k_cache: a paged cache needs at least one page of at least one row, got "
                             f"{tuple(k_cache.shape)}")
        capacity, rows = cache_capacity(k_cache, block_table), None
        if capacity >= 2 ** 31:  # the split launch's key range and chunk offsets are int32 too
            raise ValueError(f"block_table: {block_table.shape[1]} pages of {per_slot} rows a sequence ({capacity} "
                             "keys) exceed the kernel's int32 key offsets")
    else:
        capacity = per_slot
        if cache_batch_idx is not None and b and slots == 0:
            raise ValueError(f"k_cache: cache_batch_idx names rows of a cache that has none ({tuple(k_cache.shape)})")
        rows = None if cache_batch_idx is None else \
            _int_vector("cache_batch_idx", cache_batch_idx, b, q.device)
        if rows is not None and b and values_check_enabled():  # FA4_VALIDATE=1: one host sync
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= slots:
                raise ValueError(f"cache_batch_idx: values in [{lo}, {hi}] name rows outside the cache's {slots}")
        if cache_batch_idx is None and slots < b:
            raise ValueError(f"k_cache: holds {slots} sequences but q has batch {b} (pass cache_batch_idx)")
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both (new keys and values to append) or neither")
    new = 0 if k is None else k.shape[1]
    if new > capacity:
        raise ValueError(f"k: {new} new tokens do not fit a cache of {capacity} rows per sequence")
    if cache_seqlens is None:
        seqlens = full_lengths(q.device, b, capacity - new)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"cache_seqlens: {cache_seqlens} keys plus {new} new ones do not fit a cache of "
                             f"{capacity} per sequence")
        seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, b, q.device)
        if values_check_enabled():  # FA4_VALIDATE=1: one host sync
            lo, hi = int(seqlens.min()) if b else 0, int(seqlens.max()) if b else 0
            if lo < 0 or hi + new > capacity:
                raise ValueError(f"cache_seqlens: values in [{lo}, {hi}] plus {new} new keys leave the cache's "
                                 f"{capacity} rows per sequence")
    if k is not None:
        for name, t, want in (("k", k, (b, None, hkv, d)), ("v", v, (b, None, hkv, v_cache.shape[-1]))):
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
            if t.device != q.device or t.dim() != 4 or \
                    any(w is not None and w != s for w, s in zip(want, t.shape)) or t.shape[1] != k.shape[1]:
                raise ValueError(f"{name}: expected {q.dtype} on {q.device} shaped (batch={b}, new tokens, {hkv}, "
                                 f"{want[3]}), got {t.dtype} on {t.device} {tuple(t.shape)}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos: rotary embedding is applied to q and the new k, so it needs k and v")
        if not rotary_cos.dtype.is_floating_point or rotary_sin.dtype != rotary_cos.dtype:
            raise TypeError(f"rotary_cos, rotary_sin: expected one floating dtype, got {rotary_cos.dtype}, "
                            f"{rotary_sin.dtype}")
        # the positions rotated: the new keys' up to the cache's end; q's past them when it has more tokens
        # (exact for an int cache_seqlens, else a full cache's worst case)
        reach = capacity
        if rotary_q_steps(causal, window, capacity) and q.shape[1] > new:
            exact = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
            reach = max(reach, (cache_seqlens if exact else capacity - new) + q.shape[1])
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t.dim() != 2 or t.shape != rotary_cos.shape or 2 * t.shape[1] > d or t.device != q.device \
                    or t.shape[0] < reach:
                raise ValueError(f"{name}: expected (seqlen_ro >= {reach}, rotary_dim / 2) with rotary_dim <= {d} "
                                 f"on {q.device} (the last position it rotates is {reach - 1}), got "
                                 f"{tuple(t.shape)} on {t.device}")
    if block_table is not None and b and values_check_enabled():  # FA4_VALIDATE=1: one more sync
        check_pages_used("block_table", block_table, seqlens + new, per_slot, slots)
    return seqlens, rows, capacity


def with_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                 window_size=(None, None), softcap=0.0, learnable_sink=None, rotary_interleaved=True, num_splits=0,
                 pack_gqa=None, return_softmax_lse=False, varlen=fa4_varlen, sm_count=None, paged_in_place=False,
                 split=None):
    """fa4.flash_attn_with_kvcache's work (varlen / split / sm_count / paged_in_place: the kernels,
    the SM count and whether pages are read in place; the CPU tests pass torch stand-ins). On the
    device, eager calls take the split-KV launch where it applies (`attention_with_cache`); traced
    ones (torch.compile, fake or meta tensors) the same path as one custom op (`kvcache_attention`)."""
    for name, flag in (("causal", causal), ("rotary_interleaved", rotary_interleaved),
                       ("return_softmax_lse", return_softmax_lse)):
        _check_flag(name, flag)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected an int (0 or less = automatic), got {type(num_splits).__name__} "
                        f"{num_splits!r}")
    num_splits = max(num_splits, 0)  # FlashAttention-2 takes any value below 1 as its heuristic
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa: expected None or a bool, got {type(pack_gqa).__name__} {pack_gqa!r}")
    left, right, causal = check_window(window_size, causal)
    seqlens, rows, capacity = check_cache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                               cache_batch_idx, block_table, cuda=varlen is fa4_varlen,
                                               causal=causal, window=(left, right))
    starts = check_leftpad(cache_leftpad, q, block_table, seqlens)
    left, right = clamped_window(left, right, capacity, q.shape[1])
    softcap = check_softcap(softcap)
    sink = check_learnable_sink(learnable_sink, q)
    if sink is not None and sink.requires_grad and torch.is_grad_enabled():
        raise ValueError("learnable_sink: flash_attn_with_kvcache is forward only (inference); it requires grad -- "
                         "use torch.no_grad() / inference_mode(), or fa4.flash_attn_func for training")
    scale = check_softmax_scale("softmax_scale", softmax_scale, q.shape[-1])
    traced, backend = False, None
    if varlen is fa4_varlen:  # refuse what the device cannot run before writing to the cache
        # meta tensors trace shapes only: no device to ask, so they are held to the Hopper kernels' rules
        backend = _dispatch.backend_for(q.device) if q.device.type != "meta" else \
            _dispatch.make_backend(_dispatch.ARCHS["sm_90"])
        check_native_head_dims(backend, q.shape[-1], v_cache.shape[-1])
        backend.check_variants((left, right), softcap, None)
        check_grid("q", q.shape[0], q.shape[2])  # every route's grid (y, z): before the append
        traced, sm_count, split, paged_in_place = _route(q, k_cache, v_cache, block_table, causal, (left, right),
                                                         pack_gqa)
    if pack_gqa:  # what attention_with_cache would refuse (plan_layout), refused before anything is appended
        group = q.shape[2] // k_cache.shape[2]
        if traced and block_table is not None:  # the op routes it after the append: _device_route's check, now
            paged_packing(q.shape[1], group, causal, (left, right), pack_gqa, split_launch=backend.SPLIT_KV_LAUNCH)
        else:
            plan_layout(q.shape[1], group, causal,
                        key_range_window(q.shape[1], (left, right), paged_in_place and block_table is not None)[0],
                        pack_gqa, token_rows=split is not None or (traced and backend.SPLIT_KV_LAUNCH))
    if q.shape[0] == 0:  # nothing to append or attend
        out = q.new_empty(*q.shape[:3], v_cache.shape[-1])
        lse = q.new_empty(0, q.shape[2], q.shape[1], dtype=torch.float32)
        return (out, lse) if return_softmax_lse else out
    step = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, rows, block_table, sink, starts)
    flags = (scale, causal, (left, right), softcap, rotary_interleaved, num_splits, pack_gqa, return_softmax_lse,
             paged_in_place)
    if varlen is not fa4_varlen:  # the CPU tests' stand-ins
        return _cache_step(step, flags, sm_count, varlen, split)
    return _run_step(backend, step, flags, traced, sm_count, split)


def _route(q, k_cache, v_cache, block_table, causal: bool, window, pack_gqa) -> tuple:
    """(traced, SM count, the split launch, pages read in place) of a call on the device: torch.compile,
    fake or meta tensors are traced (the attention is one custom op, kvcache_attention, whose
    implementation is the eager path), eager calls take _device_route's answer."""
    if not _ops.eager_ok(q, k_cache, v_cache, block_table):
        return True, None, None, False
    return (False,) + _device_route(q, k_cache, v_cache, block_table, causal, window, pack_gqa)


def _run_step(backend, step: tuple, flags: tuple, traced: bool, sm_count, split):
    """A checked call on the device (with_kvcache, dense_decode): traced, the custom op; eager, a launch
    plan (fa4._plans) replaying the step's torch functions and kernels, or the step itself."""
    if traced:
        return _cache_step(step, flags, sm_count, fa4_varlen, split, traced)
    sig = backend._plan_signature("kvcache", step, flags)
    if sig is None:  # plans off: no replay, nothing to record
        return _cache_step(step, flags, sm_count, fa4_varlen, split)
    done = _plans.replay(sig, backend.arch.cute_arch, step)
    if done is not None:
        return done
    with _plans.recording(sig, backend.arch.cute_arch, step) as record:
        result = _cache_step(step, flags, sm_count, fa4_varlen, split)
        record(result)
    return result


def dense_decode(q, k, v, scale: float, causal: bool, left, right, softcap: float, sink):
    """flash_attn_func's decode route (fa4._decode_route): q (B, Sq, Hq, D) against every key of a dense
    k / v (B, Sk, Hkv, *), as flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=causal,
    window_size=(left, right), softcap=softcap, learnable_sink=sink, return_softmax_lse=True) computes
    it, without that function's checks: flash_attn_func's (check_fixed, check_variants) and the route's
    (_decode_route.takes: sm_90, no gradient, 1 <= Sq, int32 row offsets) imply them, and the head dims
    are a native pair (the route pads them first). Each check would be host time on every step.
    Returns (out (B, Sq, Hq, Dv), lse (B, Hq, Sq) fp32)."""
    b, sq = q.shape[:2]
    capacity = k.shape[1]
    seqlens = full_lengths(q.device, b, capacity)
    window = clamped_window(left, right, capacity, sq)
    backend = _dispatch.backend_for(q.device)
    traced, sm_count, split, in_place = _route(q, k, v, None, causal, window, None)
    step = (q, k, v, None, None, None, None, seqlens, None, None, sink, None)
    flags = (scale, causal, window, softcap, True, 0, None, True, in_place)
    return _run_step(backend, step, flags, traced, sm_count, split)


def _cache_step(step: tuple, flags: tuple, sm_count, varlen, split, traced: bool = False):
    """with_kvcache after its checks: the append (rotary first), then attention over the cache. Every
    decision in here follows from the tensors' shapes, strides and dtypes and from `flags`, the
    signature of a launch plan (with_kvcache). traced: the attention as the kvcache_attention op."""
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, rows, block_table, sink, starts = step
    scale, causal, (left, right), softcap, rotary_interleaved, num_splits, pack_gqa, return_softmax_lse, \
        paged_in_place = flags
    if k is not None:
        if rotary_cos is not None:
            sn = k.shape[1]
            new_pos = seqlens.to(torch.int64).view(-1, 1) + torch.arange(sn, device=q.device)
            steps = rotary_q_steps(causal, (left, right), cache_capacity(k_cache, block_table))
            q_pos = (seqlens.to(torch.int64).view(-1, 1) + torch.arange(q.shape[1], device=q.device) if steps
                     else seqlens.to(torch.int64).view(-1, 1).expand(-1, q.shape[1]))
            q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
            k = apply_rotary(k, rotary_cos, rotary_sin, new_pos, rotary_interleaved)
        append_to_cache(k_cache, v_cache, k, v, rows, seqlens, block_table)
        seqlens = seqlens + k.shape[1]
    if traced:
        out, lse = kvcache_attention(q, k_cache, v_cache, seqlens, rows, block_table, sink, scale, causal, left, right,
                                     softcap, num_splits, pack_gqa, starts)
        return (out, lse) if return_softmax_lse else out
    out, lse = attention_with_cache(q, k_cache, v_cache, seqlens, rows, block_table, scale, causal, (left, right),
                                    softcap, sink, num_splits, pack_gqa, sm_count or 132, varlen, paged_in_place,
                                    split, starts)
    return (out, lse) if return_softmax_lse else out


# ---------------------------------------------------------------------------------------------
# traced calls: the attention over the cache as one custom op
# ---------------------------------------------------------------------------------------------
def paged_packing(sq: int, group: int, causal: bool, window, pack_gqa, split_launch: bool) -> bool:
    """Whether a paged call's GQA heads are packed into rows (plan_layout; a ValueError for a pack_gqa it
    cannot serve), decided from shapes alone: the split launch masks packed rows by token and keeps the
    window as a mask; key segments see one token's window as a key range on a copy of the pages."""
    seen = window if split_launch else key_range_window(sq, window, False)[0]
    return plan_layout(sq, group, causal, seen, pack_gqa, token_rows=split_launch)[2]


def _device_route(q, k_cache, v_cache, block_table, causal, window, pack_gqa) -> tuple:
    """(SM count, the split launch or None, pages read in place) of an eager call on the device --
    with_kvcache's and kvcache_attention's. Whether a paged cache is read in place (fa4._paged) follows the kernel's
    rows per sequence (the query tokens, times the group where the heads are packed) and the query-head
    rows attending each key of the table's span (fa4._paged.head_rows)."""
    from . import _dispatch

    backend = _dispatch.backend_for(q.device)
    # an arch without the split launch (sm_100) runs key segments of its varlen forward
    split = fa4_split if backend.SPLIT_KV_LAUNCH else None
    in_place = False
    if block_table is not None:
        sq, group = q.shape[1], q.shape[2] // k_cache.shape[2]
        pack = paged_packing(sq, group, causal, window, pack_gqa, split_launch=split is not None)
        # the cache's lengths are device values: the keys count as the queries' own (fa4._paged.head_rows)
        in_place = _paged.in_place(q, k_cache, v_cache, sq, span=cache_capacity(k_cache, block_table),
                                   causal=causal, window=window, packed=bool(pack))
        if in_place and split is None and pack_gqa:
            # pages read in place keep one token's window as a mask (chunks start on a key block), which
            # packed segments cannot take: such a call reads a copy of the pages instead
            _, free, _ = plan_layout(sq, group, causal, key_range_window(sq, window, True)[0], None)
            in_place = free
    return _sm_count(q.device), split, in_place


@torch.library.custom_op("fa4::kvcache_attention", mutates_args=(), device_types="cuda")
def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                      cache_rows: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                      sink: Optional[torch.Tensor], scale: float, causal: bool, window_left: Optional[int],
                      window_right: Optional[int], softcap: float, num_splits: int,
                      pack_gqa: Optional[bool], key_starts: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache's attention (after the append) as torch.compile sees it: one opaque op,
    out (B, Sq, Hq, Dv) and lse (B, Hq, Sq), run by the eager path (the split launch where it applies),
    so a compiled decode step has no graph break and launches the kernels an eager one does. The checks
    ran before it, in traced Python."""
    window = (window_left, window_right)
    sm_count, split, in_place = _device_route(q, k_cache, v_cache, block_table, causal, window, pack_gqa)
    out, lse = attention_with_cache(q, k_cache, v_cache, seqlens_k, cache_rows, block_table, scale, causal, window,
                                    softcap, sink, num_splits, pack_gqa, sm_count, fa4_varlen, in_place, split,
                                    key_starts)
    return out.contiguous(), lse.contiguous()  # the strides the fake below promises


@kvcache_attention.register_fake
def _(q, k_cache, v_cache, seqlens_k, cache_rows, block_table, sink, scale, causal, window_left, window_right,
      softcap, num_splits, pack_gqa, key_starts=None):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v_cache.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)

