"""Hugging Face transformers: use fa4 as a model's attention with attn_implementation="fa4".

    from fa4.integrations.transformers import register_fa4_attention
    register_fa4_attention()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa4", dtype=torch.bfloat16)

Recent transformers models call their attention through `AttentionInterface`: a function
`(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)` with query
(B, Hq, S, D) and key/value (B, Hkv, S, D) -- *before* any repeat of the KV heads -- returning
(attn_output (B, S, Hq, Dv), attn_weights or None). `fa4_attention_forward` is that function.

What transformers hands a custom implementation (5.x). The name "fa4" does not contain "flash",
so `is_flash_attention_requested` is False for it: transformers does not try to import a
FlashAttention package for it, and flash-only model branches (e.g. the Qwen-VL vision towers'
cu_seqlens calls) take their generic path (per-chunk calls, which fa4 serves). Everything else
arrives as for flash_attention_2/3: the kwargs the decoder layers pass on (`position_ids`,
`use_cache`, ...), the caller's own kwargs (`cu_seq_lens_q/k`, `max_length_q/k` from
`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), `sliding_window`, `softcap`,
`s_aux`, `is_causal`, and the mask built by the mask function registered for the name.

Masks. transformers builds a mask per attention implementation through `AttentionMaskInterface`;
an implementation without a registered mask function gets attention_mask=None always, which
would silently ignore padding and packing. So registration also installs `fa4_mask`. It reads the
*structure* of the mask transformers describes (the mask_function closure: causal / bidirectional
base, sliding-window overlay, packed-sequence overlay) and returns what fa4 serves exactly:
  * None: causal or bidirectional attention with nothing padded (flash_attn_func; the kernel does
    causal itself, bottom-right aligned, which is what decoding with a KV cache needs);
  * the boolean (batch, kv_len) padding mask (flash_attn_varlen_func over a sync-free layout);
  * a `LeftPadding` when every row's padding is at its start (left padding, as generation pads): the
    mask with each row's first valid key, so a call of a few query tokens that needs no gradient (a
    decode step) runs flash_attn_with_kvcache with cache_leftpad on the cache as it is, where the
    general padded path would gather every valid key and value into a packed copy each step. It
    also reaches generate()'s compiled steps over a static cache (LeftPadding says how);
  * a `PackedSequences` (position_ids restarting inside a row, no attention_mask, no cache:
    transformers' padding-free training format; one varlen call over the documents);
  * for a static cache with nothing padded (its buffer's slots past the tokens so far hold nothing;
    generate() drops an all-ones mask): a LeftPadding of nothing padded over the filled slots, or,
    while tracing (q_offset a tensor that cannot be read), a `KeyPrefix` served with seqused_k;
or raises ValueError for a pattern it cannot serve (custom or_mask / and_mask functions, chunked
attention, block-wise overlays, ...), instead of dropping it.
Sliding windows (`sliding_window`: at most that many keys back, the current one included, as the
transformers FlashAttention path reads it), logit softcapping (`softcap`) and attention sinks
(`s_aux`, gpt-oss) go to fa4's window_size / softcap / learnable_sink; the window overlay in the
mask is served by that kwarg, exactly as in transformers' own FlashAttention paths. A tensor-valued
kwarg outside those (T5's position_bias, block indices, a head mask) would change the attention:
it is refused, naming it, rather than dropped. Non-causal layers (encoders, cross-attention) attend
from every query position, as eager and sdpa do; the padding mask marks keys only.

Packed sequences, in the order fa4_attention_forward looks for them (the first found wins):
  1. `cu_seq_lens_q/k` + `max_length_q/k` kwargs (all four, as transformers' flash path needs):
     q/k/v are flattened to (B*S, H, D) and passed with those boundaries (int32);
  2. a `PackedSequences` from fa4_mask: the boundaries are where transformers' own
     packed-sequence ids change (the segmentation its eager / sdpa masks use);
  3. `position_ids` of a batch of one, no attention mask: transformers' flash-path rule
     (`_is_packed_sequence`: the ids are not one increasing run; a sequence starts wherever the
     id equals the row's minimum). This is what catches packing when a KV cache exists (the
     default `use_cache=True`), where transformers' mask builder does not look for packing.

Host syncs and tracing. Varlen needs sequence boundaries and a max length as host integers, and
deciding "padded or not" / "packed or not" reads data; each of those is done at most once per
model forward, never per layer: fa4_mask's all-ones and left-padding check (one sync, as
transformers' own sdpa and flash masks do) or a static cache's q_offset, a PackedSequences'
boundaries (computed on first use, then kept), the position_ids check (remembered for the same,
unmodified position_ids tensor). The padded path itself never
syncs. On tensors without data (meta, FakeTensor) nothing is read: the checks are skipped and
the boundaries take an exact fixed-shape form (every token may start a sequence; the max length
is the row length), so shape inference, meta-device models and FakeTensor tracing run.
Under torch.compile, opening a composed mask (sliding windows, the packed pattern: dynamo cannot
read a closure's cells) and every data-dependent step on real tensors are graph breaks, as in
transformers' own flash path; and while tracing, transformers cannot tell a packed batch from an
unpacked one, so without an attention_mask and a cache it always hands the packed pattern over.
Causal / bidirectional layers given an attention_mask trace with no break (fullgraph). A mask
fa4_mask gets inside a compiled forward is not read, so it never becomes a LeftPadding there; one
built eagerly (generate() builds a static cache's step mask so) is handed on as it is.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import _decode_route, _plans
from .._api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

_I32 = torch.int32


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
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


def _no_data(t: torch.Tensor) -> bool:
    """True for tensors whose values cannot be read: meta, or FakeTensor (shape propagation,
    torch.export, FakeTensorMode). Under torch.compile dynamo sees the real tensor's type, so real
    inputs take the data path there (a graph break where values are read)."""
    if t.device.type == "meta":
        return True
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(t, FakeTensor)


def _flat(x):
    """(B, S, H, D) -> (B*S, H, D)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _varlen_from_starts(starts: torch.Tensor, bound: int):
    """starts: (N,) bool, True where a sequence begins (starts[0] must be True) -> (cu_seqlens
    int32, max_seqlen int). With data: the exact boundaries (one sync). Without (meta / fake): the
    fixed-shape form, N + 1 entries, the tokens that start nothing giving empty sequences at the
    end, and `bound` (the row length) as max_seqlen -- the same attention for every value."""
    n = starts.numel()
    end = torch.full((1,), n, dtype=_I32, device=starts.device)
    if _no_data(starts):
        idx = torch.arange(n, dtype=_I32, device=starts.device)
        cu = torch.cat([torch.sort(torch.where(starts, idx, end)).values, end])
        return cu, bound
    cu = torch.cat([torch.nonzero(starts).flatten().to(_I32), end])
    return cu, int((cu[1:] - cu[:-1]).max())


# ---------------------------------------------------------------------------------------------
# reading transformers' mask_function
# ---------------------------------------------------------------------------------------------
_PARTS: Optional[dict] = None


def _mask_parts() -> dict:
    """The pieces transformers builds mask functions from, keyed by the function (the two bases)
    or by the code object of the closure its factory returns (the same for every instance)."""
    global _PARTS
    if _PARTS is None:
        from transformers import masking_utils as mu

        parts = {}
        for name, kind in (("causal_mask_function", "causal"), ("bidirectional_mask_function", "bidirectional")):
            if hasattr(mu, name):
                parts[getattr(mu, name)] = kind
        for name, args, kind in (("and_masks", (), "and"), ("sliding_window_overlay", (1,), "window_causal"),
                                 ("sliding_window_bidirectional_overlay", (1,), "window_bidirectional"),
                                 ("packed_sequence_mask_function", (None,), "packed"),
                                 ("remap_positions_for_packed_sequence", (None, None), "remap")):
            try:
                parts[getattr(mu, name)(*args).__code__] = kind
            except (AttributeError, TypeError, ValueError):
                pass  # not in this transformers version (or changed): masks using it are refused, not dropped
        _PARTS = parts
    return _PARTS


def _closure_vars(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _collect_parts(fn, found: list, remapped: bool):
    parts = _mask_parts()
    kind = parts.get(fn) or parts.get(getattr(fn, "__code__", None))
    if kind == "and":
        for sub in _closure_vars(fn)["mask_functions"]:
            _collect_parts(sub, found, remapped)
    elif kind == "remap":
        _collect_parts(_closure_vars(fn)["mask_function"], found, True)
    elif kind is None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ValueError(f"mask_function: fa4 serves causal or bidirectional attention with padding, a sliding window "
                         f"or packed sequences; this mask contains {name}, a pattern it cannot serve exactly "
                         "(custom or_mask / and_mask functions, chunked or block-wise attention): use "
                         "attn_implementation='sdpa' or 'eager' for this model")
    else:
        found.append((kind, fn, remapped))


def _parse_mask_function(mask_function) -> dict:
    """Structure only (no tensor is read): {"causal": bool, "seq_ids": the (B, S) packed-sequence
    ids or None}. A sliding-window overlay is accepted: the attention's sliding_window kwarg serves
    it. Raises ValueError for anything else."""
    kind = "causal" if mask_function is None else _mask_parts().get(mask_function)
    if kind in ("causal", "bidirectional"):  # a plain base: nothing to open (and no graph break under compile)
        return {"causal": kind == "causal", "seq_ids": None, "window": False}
    return _parse_closure(mask_function)


@torch.compiler.disable
def _parse_closure(mask_function) -> dict:
    """_parse_mask_function for composed masks. Reading a closure's cells is something dynamo
    cannot trace, so under torch.compile this is a graph break (once per mask the model builds);
    eagerly, and on meta / fake tensors, it is a plain call."""
    found: list = []
    _collect_parts(mask_function, found, False)
    kinds = [k for k, _, _ in found]
    bases = [k for k in kinds if k in ("causal", "bidirectional")]
    windows = [fn for k, fn, _ in found if k.startswith("window")]
    packed = [fn for k, fn, _ in found if k == "packed"]
    remapped = any(r for _, _, r in found)
    problem = None
    if len(bases) != 1:
        problem = f"{len(bases)} base patterns (causal / bidirectional)"
    elif len(windows) > 1 or len(packed) > 1:
        problem = "more than one sliding window or packed-sequence overlay"
    elif windows and not any(k == f"window_{bases[0]}" for k in kinds):
        problem = f"a sliding window of the other kind on a {bases[0]} mask"
    elif (remapped and not packed) or (packed and bases[0] != "causal"):
        # transformers 5.17 ANDs causal with the same-document ids and remaps no positions; later
        # versions also remap them. Either way the mask is causal within each document.
        problem = "position remapping without its packed-sequence overlay (or on a bidirectional mask)"
    if problem:
        raise ValueError(f"mask_function: fa4 cannot serve this mask exactly: {problem}")
    return {"causal": bases[0] == "causal",
            "seq_ids": _closure_vars(packed[0])["packed_sequence_mask"] if packed else None, "window": bool(windows)}


# ---------------------------------------------------------------------------------------------
# what the mask function returns
# ---------------------------------------------------------------------------------------------
class PackedSequences:
    """fa4_mask's value for a packed batch: `seq_ids` (B, S), transformers' packed-sequence ids
    (equal ids = one document; a row start also starts one). `varlen()` gives (cu_seqlens int32,
    max_seqlen) over the flattened B*S tokens, computed on first use and kept, so a model forward
    pays for it once, not once per layer."""

    def __init__(self, seq_ids: torch.Tensor):
        if seq_ids.dim() != 2:
            raise ValueError(f"seq_ids: expected (batch, seqlen), got shape {tuple(seq_ids.shape)}")
        self.seq_ids = seq_ids
        self._varlen = None

    @property
    def shape(self):
        return self.seq_ids.shape

    def varlen(self):
        if self._varlen is None:
            ids = self.seq_ids
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            self._varlen = _varlen_from_starts(starts.flatten(), ids.shape[1])
        return self._varlen

    def __repr__(self):
        return f"PackedSequences(seq_ids={tuple(self.seq_ids.shape)})"


class KeyPrefix:
    """fa4_mask's value, while tracing, for a static KV cache with nothing padded: of its buffer's
    kv_length slots the first q_offset + q_length hold tokens (the queries the last q_length of them),
    and transformers hands q_offset as a tensor that cannot be read there. `length`: int32 (batch,).
    transformers may pass a mask it made back to its mask builder (generate does): `ndim` keeps it from
    being taken for a 2-D padding mask, and fa4_mask returns it as it is."""

    ndim = 1

    def __init__(self, length: torch.Tensor):
        self.length = length

    def __repr__(self):
        return f"KeyPrefix(length={tuple(self.length.shape)})"


class LeftPadding:
    """fa4_mask's value for a left-padded batch: the boolean (batch, cols) padding mask `mask` (cols
    <= the layer's `kv_length` keys, at least the queries: the queries are each row's last tokens),
    with each row's first valid key `first` and `lengths` (cols), int32 (batch,) each. An object, not
    a marked tensor, for generate() over a static cache: it builds each step's mask eagerly and passes
    it to the compiled forward, where transformers hands it back to the mask builder, and dynamo
    drops a tensor's attributes through the `.to()` transformers applies to a 2-D mask. A decode step
    reads only first and lengths, whose shapes stay fixed as the mask grows, so a compiled step is one
    graph. `ndim` as KeyPrefix's; `to()` moves the tensors (a model split over devices). Any other
    attribute is the mask's: a model forward that reshapes the mask generate() hands it (GPT-2 views
    it as (batch, -1)) gets a plain tensor, whose steps take the general path."""

    ndim = 1

    def __init__(self, mask: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor, kv_length: int):
        self.mask, self.first, self.lengths, self.kv_length = mask, first, lengths, kv_length

    @classmethod
    def of(cls, mask: torch.Tensor, kv_length: int) -> "LeftPadding":
        """A left-padded boolean (batch, cols) mask's LeftPadding, its marks computed without a sync."""
        batch, cols = mask.shape
        first = cols - mask.sum(dim=1, dtype=_I32)                                                # (batch,)
        return cls(mask, first, torch.full((batch,), cols, dtype=_I32, device=mask.device), kv_length)

    def to(self, *args, **kwargs):
        mask = self.mask.to(*args, **kwargs)
        if mask is self.mask:
            return self
        return LeftPadding(mask, self.first.to(mask.device), self.lengths.to(mask.device), self.kv_length)

    def __getattr__(self, name):  # only for names the object lacks
        if name == "mask":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.mask, name)

    def __repr__(self):
        return f"LeftPadding(mask={tuple(self.mask.shape)})"


def _key_prefix(batch_size, q_length, kv_length, q_offset, kv_offset, device):
    """A static cache with nothing padded: None when every key slot holds a token (q_offset + q_length
    >= kv_length); else an all-True (batch, q_offset + q_length) padding mask -- the padded path then
    takes only those keys, and the mask survives transformers passing it back to its mask builder --
    or, for a tensor q_offset that cannot be read (tracing), a KeyPrefix. A tensor q_offset with data
    is read once per forward (outside torch.compile), as the all-ones check reads a padding mask."""
    if not isinstance(kv_offset, int) or kv_offset != 0:
        return None  # a sliding cache's window of slots: its keys are its tokens
    if isinstance(q_offset, torch.Tensor) and not _no_data(q_offset) and not torch.compiler.is_compiling():
        q_offset = int(q_offset)
    if isinstance(q_offset, int):
        valid = q_offset + q_length
        if valid >= kv_length:
            return None
        return LeftPadding.of(torch.ones(batch_size, valid, dtype=torch.bool, device=device), kv_length)
    used = (q_offset.reshape(-1)[:1] + q_length).to(device=device, dtype=_I32)
    return KeyPrefix(used.expand(batch_size))


def fa4_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers AttentionMaskInterface function: None (nothing padded, not packed), the boolean
    (batch, kv_length) padding mask, a LeftPadding (that mask, left-padded), a PackedSequences, or a
    KeyPrefix (a static cache with nothing padded); ValueError for a pattern fa4 cannot serve exactly.
    mask_function None means causal (transformers' default).

    Reads no tensor value except one check of a real, eager padding mask per model forward (one
    sync; transformers' sdpa and flash masks read it too): all ones spares every layer the varlen
    layout; left padding makes a LeftPadding, for in-place decode steps (_left_padded_decode); with a
    sliding window, whether each row's valid tokens form one run. And a static cache's tensor
    q_offset, once per mask built. Skipped on meta / fake tensors
    and under torch.compile, where the mask is returned as is (the padded path is exact for an
    all-ones mask as well)."""
    pattern = _parse_mask_function(mask_function)
    if attention_mask is None:
        if pattern["seq_ids"] is not None:
            return PackedSequences(pattern["seq_ids"])
        # a static cache's empty slots are keys that no token holds yet
        return _key_prefix(batch_size, q_length, kv_length, q_offset, kv_offset, kwargs.get("device"))
    if isinstance(attention_mask, KeyPrefix):  # made by this function, handed back by transformers
        return attention_mask
    if isinstance(attention_mask, LeftPadding):  # made by this function, handed back by transformers
        if attention_mask.kv_length == kv_length:
            return attention_mask
        attention_mask = attention_mask.mask  # a layer of another size (a sliding cache): its own columns
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"attention_mask: fa4_mask takes a 2-D (batch, kv_len) padding mask, got {shape}")
    if pattern["seq_ids"] is not None:
        raise ValueError("attention_mask: fa4 cannot serve a padding mask and packed sequences together")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if _no_data(mask) or torch.compiler.is_compiling():
        return mask
    all_ones, left_padded, one_run = _mask_facts(mask)  # one sync
    if mask.shape[1] == kv_length and all_ones:
        return None
    if pattern["window"] and not one_run:
        # the padded path packs each row's valid keys together, so a window would count valid tokens,
        # not positions: exact only when they form one run (left or right padding)
        raise ValueError("attention_mask: padding inside a row (not only at its ends) with a sliding window: "
                         "fa4's padded path would count the window over the valid tokens, not their "
                         "positions; use attn_implementation='sdpa' or 'eager' for such masks")
    # every row's tokens at its end: its layers' decode steps read the cache in place. More queries than
    # columns (they could not all be the rows' last tokens) keep the general path, which refuses them
    return LeftPadding.of(mask, kv_length) if left_padded and q_length <= mask.shape[1] else mask


def _mask_facts(mask: torch.Tensor) -> tuple[bool, bool, bool]:
    """(every key valid, each row's valid keys at its end (left padding), each row's valid keys one run)
    of a boolean (batch, kv_len) mask, read with one sync. No columns: not left-padded (nothing to read)."""
    if mask.shape[1] == 0:
        return True, False, True
    m = mask.to(torch.int8)
    rises = (m[:, 1:] > m[:, :-1]).sum(dim=1)
    falls = (m[:, 1:] < m[:, :-1]).sum(dim=1)
    facts = torch.stack([m.all(), (falls == 0).all(), (m[:, 0] + rises <= 1).all()])
    return tuple(bool(x) for x in facts.tolist())


# ---------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------
_FA_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _as_int(x, bound: int) -> int:
    """A max length from the caller: an int, or a 0-d tensor (transformers' own helpers return
    tensors; one sync) -- on a tensor without data, the static bound."""
    if isinstance(x, torch.Tensor):
        return bound if _no_data(x) else int(x)
    return int(x)


def _varlen_from_kwargs(kwargs, q, k):
    """cu_seq_lens_q/k + max_length_q/k, as transformers' flash path takes them; None if absent."""
    given = [kwargs.get(n) is not None for n in _FA_KWARGS]
    if not any(given):
        return None
    if not all(given):
        missing = ", ".join(n for n, g in zip(_FA_KWARGS, given) if not g)
        raise ValueError(f"{missing}: fa4 serves packed sequences from cu_seq_lens_q, cu_seq_lens_k, max_length_q "
                         "and max_length_k together (as transformers' FlashAttention path does); "
                         f"got only {', '.join(n for n, g in zip(_FA_KWARGS, given) if g)}")
    cu_q, cu_k = (kwargs[n].to(device=q.device, dtype=_I32) for n in _FA_KWARGS[:2])
    return (cu_q, cu_k, _as_int(kwargs["max_length_q"], q.shape[0] * q.shape[1]),
            _as_int(kwargs["max_length_k"], k.shape[0] * k.shape[1]))


# the last position_ids check: (weakref to the tensor, its version counter, the result)
_LAST_POSITIONS: list = [None]


def _varlen_from_position_ids(position_ids, q, k):
    """transformers' flash-path rule for a batch of one without a mask: packed when the ids are
    not one increasing run (`_is_packed_sequence`), a sequence starting wherever the id equals
    the minimum (and at token 0). None when not packed. The answer for a given, unmodified
    position_ids tensor is remembered, so the layers of one forward share one check."""
    if position_ids is None or q.shape[0] != 1 or q.shape[1] == 1 or position_ids.numel() != q.shape[1]:
        return None  # not a batch of one, one token (decoding), or not flat ids (e.g. multimodal rope rows)
    pos = position_ids.reshape(-1)
    if _no_data(pos):
        found = _position_starts(pos)
    else:
        last = _LAST_POSITIONS[0]
        if last is not None and last[0]() is position_ids and last[1] == position_ids._version:
            found = last[2]
        else:
            packed = bool((pos != torch.arange(pos.numel(), device=pos.device) + pos.min()).any())
            found = _position_starts(pos) if packed else None
            _LAST_POSITIONS[0] = (weakref.ref(position_ids), position_ids._version, found)
    if found is not None and k.shape[1] != q.shape[1]:
        raise ValueError(f"position_ids: packed sequences (ids restart inside the row) with {k.shape[1]} keys for "
                         f"{q.shape[1]} queries (a KV cache holding earlier tokens): fa4 cannot tell which keys "
                         "belong to which sequence; run packed batches without a cache (use_cache=False)")
    return None if found is None else (found[0], found[0], found[1], found[1])


def _position_starts(pos):
    starts = pos == pos.min()
    starts = torch.cat([torch.ones_like(starts[:1]), starts[1:]])
    return _varlen_from_starts(starts, pos.numel())


def _packed_call(q, k, v, varlen, common):
    cu_q, cu_k, max_q, max_k = varlen
    out = flash_attn_varlen_func(_flat(q), _flat(k), _flat(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max_q, max_seqlen_k=max_k, **common)  # (B*S, Hq, Dv)
    return out.view(q.shape[0], q.shape[1], *out.shape[1:])


def _padded_call(q, k, v, mask, common):
    """Padding mask (B, >= Sk or fewer columns for a static cache) -> one varlen call, no sync.
    Layout: sequence b holds row b's queries, its padding first and then its valid queries in
    order (so the bottom-right causal alignment lines the valid queries up with the valid keys;
    padding queries see no key, or are discarded), and row b's valid keys; sequences B..2B-1 hold
    each row's padding keys and no query. Every length is <= the row's, so max_seqlen is static."""
    if k.shape[1] > mask.shape[1]:  # static cache: slots past the mask hold nothing yet (as transformers does)
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    causal = common["causal"]
    if causal and sq > sk:
        raise ValueError(f"attention_mask: {sq} causal queries but {sk} keys; fa4's padded path takes the queries as "
                         "the last tokens of the keys' sequence")
    mask_k = mask[:, -sk:].to(torch.bool)
    # causal: the queries are the last sq tokens (left padding, a KV cache), a padding query gets 0;
    # non-causal (an encoder, cross-attention: the mask says nothing about the queries) every query
    # attends to the valid keys, as in transformers' eager / sdpa
    mask_q = mask_k[:, -sq:] if causal else torch.ones_like(mask_k[:, :1]).expand(b, sq)
    dev = q.device
    rows_q = torch.arange(b, device=dev)[:, None] * sq
    order_q = (torch.argsort(mask_q.to(torch.uint8), dim=1, stable=True) + rows_q).flatten()
    order_k = torch.argsort((~mask_k).flatten().to(torch.uint8), stable=True)
    nk = mask_k.sum(dim=1, dtype=_I32)
    zero = torch.zeros(1, dtype=_I32, device=dev)
    cu_q = torch.cat([torch.arange(b + 1, dtype=_I32, device=dev) * sq, torch.full((b,), b * sq, dtype=_I32,
                                                                                     device=dev)])
    cu_k = torch.cat([zero, torch.cumsum(torch.cat([nk, sk - nk]), 0, dtype=_I32)])
    out = flash_attn_varlen_func(_flat(q).index_select(0, order_q), _flat(k).index_select(0, order_k),
                                 _flat(v).index_select(0, order_k), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=sq, max_seqlen_k=sk, **common)  # (B*Sq, Hq, Dv), layout order
    out = torch.empty_like(out).index_copy(0, order_q, out).view(b, sq, *out.shape[1:])
    return torch.where(mask_q[:, :, None, None], out, out.new_zeros(()))  # padding queries: 0


def _split_launch_takes(q, k, v, sink, tokens: int, keys: int) -> bool:
    """Whether flash_attn_with_kvcache serves the call on its split launch (fa4._decode_route.takes:
    a few query tokens, no gradient, sm_90) at a head-dim pair the kernels have (the others run padded,
    and padding would copy the whole cache: the general path pads only what it gathers)."""
    return _decode_route.takes(q, k, v, sink, tokens, keys, q.shape[0]) and _decode_route.native_head_dims(q, v)


# a layer module's __dict__ entry: the cache rows of its last few in-place decode steps
_RECENT_KEYS = "_fa4_decode_keys"
RECENT_KEY_COUNTS = 4


def _cache_grew(module, keys: int) -> bool:
    """Whether this layer's cache has a number of rows none of its last few in-place decode steps had: a
    DynamicCache grows one a step, so each step's shapes are new and a launch plan would be recorded (and
    a plan file written) a step, replayed only by that step's later layers: measured no faster at 4-32
    layers (fa4/README.md, "Hugging Face transformers"). A static cache keeps its rows (two caches taking
    turns too): plans serve it after its first step."""
    state = getattr(module, "__dict__", None)
    if not isinstance(state, dict):  # no per-instance state (a class, a slotted object): plans as usual
        return False
    recent = state.get(_RECENT_KEYS, ())
    if keys in recent:
        return False
    state[_RECENT_KEYS] = (keys,) + recent[:RECENT_KEY_COUNTS - 1]
    return True


def _left_padded_decode(q, k, v, left, common, module=None):
    """A decode step (a few query tokens, no gradient) of a left-padded batch (left: fa4_mask's
    LeftPadding for this layer's keys; its queries are the rows' last tokens, its columns fit k):
    flash_attn_with_kvcache on the cache as it is, row b's keys from its first valid one (cache_leftpad),
    with no copy (the general padded path gathers every key and value of the cache each step). Causal
    queries are the row's last tokens, as there. None where it does not apply: the general path runs.
    A layer whose cache grew since its last step runs without launch plans (_cache_grew); in a compiled
    forward the graph holds the launch. Reads no mask shape: a compiled step is one graph as it grows."""
    if k.shape[1] != left.kv_length or not _split_launch_takes(q, k, v, common["learnable_sink"], q.shape[1],
                                                               k.shape[1]):
        return None
    step = dict(cache_seqlens=left.lengths, cache_leftpad=left.first, **common)
    if not torch.compiler.is_compiling() and _cache_grew(module, k.shape[1]):
        return _plans.call_without_plans(flash_attn_with_kvcache, q, k, v, **step)
    return flash_attn_with_kvcache(q, k, v, **step)


def _prefix_call(q, k, v, length, common):
    """Keys [0, length[b]) of row b of a static cache's buffer: the padded varlen call with seqused_k
    (no sync, traceable; the causal diagonal aligned to the used keys)."""
    return flash_attn_varlen_func(q, k, v, seqused_k=length, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                                  **common)


# kwargs transformers' layers pass that fa4 serves, or that do not change the attention (positions,
# caches, flags); any other tensor-valued kwarg (T5's position_bias, block indices, per-token sinks, a
# head mask) would change the result, so it is refused rather than dropped
_KNOWN_KWARGS = frozenset(("sliding_window", "softcap", "s_aux", "is_causal", "position_ids", "cache_position",
                           "past_key_values", "past_key_value", "use_cache", "output_attentions", "layer_idx",
                           "position_embeddings") + _FA_KWARGS)


def _refuse_unknown_tensors(kwargs):
    for name, value in kwargs.items():
        if name not in _KNOWN_KWARGS and isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: fa4's attention does not take this model's {name!r} (a tensor that would change "
                             "the attention); use attn_implementation='sdpa' or 'eager' for this model")


_KWARGS_AND_MASK = "cu_seq_lens_q: fa4 takes packed-sequence kwargs or a padding attention_mask, not both"


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: Optional[float] = None, dropout: float = 0.0, **kwargs):
    """transformers AttentionInterface function. query (B, Hq, Sq, D), key/value (B, Hkv, Sk, *)
    -> (out (B, Sq, Hq, Dv), None). attention_mask: None, a 2-D padding mask, a LeftPadding, a KeyPrefix
    or a PackedSequences (fa4_mask's values); packed batches are also taken from cu_seq_lens_q/k +
    max_length_q/k or position_ids (see the module docstring)."""
    _refuse_unsupported(dropout)
    _refuse_unknown_tensors(kwargs)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    # (B, H, S, D) -> (B, S, H, D): views, last dim stays contiguous
    q, k, v = (_cast_for_kernel(t).transpose(1, 2) for t in (query, key, value))
    common = dict(softmax_scale=scaling, causal=is_causal, **_variants(kwargs, is_causal, q, k.shape[1]))
    varlen = _varlen_from_kwargs(kwargs, q, k)
    if isinstance(attention_mask, LeftPadding):
        if varlen is not None:
            raise ValueError(_KWARGS_AND_MASK)
        # before its mask is touched: a compiled step that reads only the marks is one graph as the mask grows
        served = _left_padded_decode(q, k, v, attention_mask, common, module)
        if served is not None:
            return served, None
        attention_mask = attention_mask.mask
    is_padding = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    if isinstance(attention_mask, KeyPrefix):
        return _prefix_call(q, k, v, attention_mask.length, common), None
    if attention_mask is not None and not is_padding and not isinstance(attention_mask, PackedSequences):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"attention_mask: fa4 takes None or a 2-D (batch, kv_len) padding mask (or fa4_mask's "
                         f"PackedSequences), got {shape}; register the fa4 mask function with "
                         "register_fa4_attention()")
    if varlen is not None and is_padding:
        raise ValueError(_KWARGS_AND_MASK)
    if varlen is None and isinstance(attention_mask, PackedSequences):
        if tuple(attention_mask.shape) != (q.shape[0], q.shape[1]) or k.shape[1] != q.shape[1]:
            raise ValueError(f"attention_mask: PackedSequences of shape {tuple(attention_mask.shape)} for queries "
                             f"{tuple(q.shape[:2])} and {k.shape[1]} keys")
        cu, mx = attention_mask.varlen()
        varlen = (cu, cu, mx, mx)
    if varlen is None and attention_mask is None:
        varlen = _varlen_from_position_ids(kwargs.get("position_ids"), q, k)
    if varlen is not None:
        return _packed_call(q, k, v, varlen, common), None
    if is_padding:
        return _padded_call(q, k, v, attention_mask, common), None
    return flash_attn_func(q, k, v, **common), None


def register_fa4_attention(name: str = "fa4") -> str:
    """Register fa4 in transformers' AttentionInterface (and its mask function in
    AttentionMaskInterface when this transformers version has one) under `name`. Keep "flash"
    out of the name: transformers treats such names as FlashAttention packages to import."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError("register_fa4_attention: Hugging Face transformers is not installed (or too old to have "
                          "AttentionInterface, added in 4.48): pip install 'transformers>=4.48'. fa4 itself does "
                          "not need it.") from exc
    if "flash" in name:
        raise ValueError(f"name: {name!r} contains 'flash', which makes transformers treat it as a FlashAttention "
                         "package (is_flash_attention_requested) and try to import one; pick another name")
    AttentionInterface.register(name, fa4_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass  # older versions build 4-D masks themselves; fa4_attention_forward refuses those clearly
    else:
        _mask_parts()  # built now, outside any torch.compile trace
        AttentionMaskInterface.register(name, fa4_mask)
    return name
