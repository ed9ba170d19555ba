"""Host side of the backward: checks, buffers, and the three launches (preprocess -> main -> postprocess).

Every main kernel (the ladder steps, the production kernel of ``stage4_bwd_kernel.hopper``) plugs in
through ``make_kernel(dtype, d, dv, causal, deterministic, varlen, has_seqused_k, dq_order) -> kernel
object``; everything else is shared:

    lse2, D, dQaccum = preprocess(out, dout, lse, dlse)  D = rowsum(dO * O) (- dlse), lse * log2(e), dQaccum = 0
    semaphores       = zeros(B, Hq, m_blocks) int32      deterministic only (a persistent build: its tile counter)
    main kernel                                          dK, dV written; dQaccum += dS K
    dq               = postprocess(dQaccum)              softmax_scale * dQaccum -> q.dtype

A kernel with ``dq_frag`` keeps dQaccum in its fragment order: the preprocess zeroes it as one flat buffer and
``postprocess_frag`` (which reads the layout from the kernel object) writes dq. With first stores
(``dq_first_store``, hopper/dq_writer.py) the preprocess zeroes the tiles' int32 arrival counters instead
(``dq_arrivals``), the main kernel's first arrival at a tile stores it, and ``postprocess_frag`` writes
zeros for a tile nobody reached; a persistent build's tile counter then shares that buffer
(``zeroed_words``), so the preprocess zeroes it too and no fill kernel runs before the main kernel. This
module imports no kernel module: the kernel's own entry points pass ``make_kernel`` in.

Scratch per call: dQaccum (4 bytes x q's elements, fragment order: whole tiles) + 2 fp32 (B, Hq, Sq) + the
semaphores or the arrival counters (one int32 per dQ tile and head).
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

from cutlass import Float32, Int32

from stage3_fwd_kernel import trace
from stage3_fwd_kernel.intdiv import FAST_DIV_MAX
from stage4_bwd_kernel import common
from stage4_bwd_kernel import postprocess as post
from stage4_bwd_kernel import preprocess as pre


def variant_of(causal, window_size, softcap):
    """(Window without causal's edge, softcap) of a call, or None for plain attention (checked:
    TypeError / ValueError naming window_size or softcap)."""
    from stage0_reference.validation import check_softcap
    from stage3_fwd_kernel.components.window import NO_WINDOW, beyond_causal

    window = beyond_causal(causal, window_size)
    softcap = check_softcap(softcap)
    if window == NO_WINDOW and not softcap:
        return None
    return window, softcap


def compile_key(step, dtype, d, dv, causal, deterministic, varlen, has_seqused_k, dq_order, tiles):
    return (step, str(dtype), d, dv, bool(causal), bool(deterministic), bool(varlen), bool(has_seqused_k),
            getattr(dq_order, "name", repr(dq_order)), tiles) + trace.key()  # a traced build: never shared


def fake_main_args(dt, d, dv, *, launchable: bool = False, with_arrivals: bool = False):
    """Arguments a compile traces a main kernel with (same order as ``main_args``, plus the
    stream); launchable=True for a kernel ``main_args`` runs (TVM-FFI, see common.launch_stream);
    with_arrivals=True for a kernel that takes the dQ tiles' arrival counters (``takes_dq_arrivals``)."""
    F = common.fake_tensor
    counters = (F(Int32, 3, align=4),) if with_arrivals else ()
    return (F(dt, 4, d), F(dt, 4, d), F(dt, 4, dv), F(dt, 4, dv),
            F(Float32, 3), F(Float32, 3), F(Float32, 4, d), F(dt, 4, d), F(dt, 4, dv),
            F(Int32, 1, align=4), F(Int32, 1, align=4), F(Int32, 1, align=4), F(Int32, 3, align=4), *counters,
            Int32(1), Float32(1.0), Float32(1.0), common.launch_stream() if launchable else common.fake_stream())


def main_args(q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, *, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k,
              semaphores, num_n_blocks, softmax_scale, arrivals=None):
    """The main kernel's launch arguments from torch tensors, in ``__call__`` order without the
    stream. Varlen tensors are packed (T, H, D) / (H, T) and become a batch of one; the int32
    tensors a launch does not read are 1-element stand-ins. arrivals: the dQ tiles' int32 arrival
    counters (3-D) of a kernel that takes them, else None."""
    tensors = (q, k, v, dout, lse2, dpsum, dq_accum, dk, dv)
    if varlen:
        tensors = tuple(t.unsqueeze(0) for t in tensors)
    counters = () if arrivals is None else (arrivals,)
    return (*(common.launch_view(t) for t in tensors), cu_seqlens_q, cu_seqlens_k, seqused_k, semaphores, *counters,
            num_n_blocks, softmax_scale * common.LOG2_E, softmax_scale)


def takes_dq_arrivals(kernel) -> bool:
    """Whether a main kernel's launch takes the dQ tiles' arrival counters (the production kernel's
    does, whether or not its build uses them: ``dq_first_store``)."""
    return getattr(kernel, "takes_dq_arrivals", False)


def compile_main(step: str, make_kernel: Callable, dt, d, dv, causal, deterministic, *, varlen=False,
                 has_seqused_k=False, dq_order=None, tiles=None, launchable=True, variant=None):
    """The one place a main kernel is compiled (against fake tensors, so no GPU is needed) ->
    (kernel object, Compiled). launchable=True builds what ``backward`` launches (TVM-FFI, cache key
    "gpu"; ``hopper.compile_launchable`` uses it to fill fa4's disk cache on a CPU machine), False a
    compile-only build (key "fake"). variant: None, or (Window, softcap) for a kernel that takes them
    (the production kernel; ``backward`` refuses them for the others)."""
    dq_order = dq_order or common.default_dq_order(causal, deterministic, head_dim=d)
    extra = {} if variant is None else dict(window=variant[0], softcap=variant[1])
    kernel = make_kernel(dt, d, dv, causal, deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                         dq_order=dq_order, tiles=tiles, **extra)
    key = ("gpu" if launchable else "fake",) + compile_key(step, dt, d, dv, causal, deterministic, varlen,
                                                           has_seqused_k, dq_order, tiles)
    if variant is not None:
        key += ("variant",) + tuple(variant[0]) + (variant[1],)
    return kernel, common.compile_cached(key, lambda: (kernel, fake_main_args(dt, d, dv, launchable=launchable,
                                                                               with_arrivals=takes_dq_arrivals(kernel))))


def uses_dq_frag(kernel) -> bool:
    """A fragment-order dQ accumulator (``dq_frag``): zeroed by the preprocess as one flat buffer (with
    first stores, its arrival counters instead), and turned into dq by ``postprocess_frag`` instead of
    ``postprocess``."""
    return getattr(kernel, "dq_frag", False)


def compile_pre_post(kernel, dtype: str, d: int, dv: int, varlen: bool) -> tuple:
    """The launchable (preprocess, postprocess) that ``backward`` runs around `kernel`."""
    from stage4_bwd_kernel import postprocess_frag as post_frag

    if uses_dq_frag(kernel):
        return (pre.compile_only(dtype, d, dv, varlen, launchable=True, dq_zeroing="flat"),
                post_frag.compile_launchable(kernel, varlen))
    return pre.compile_only(dtype, d, dv, varlen, launchable=True), post.compile_only(dtype, d, varlen, launchable=True)


def compile_fake(step: str, make_kernel: Callable, *, dtype, head_dim, head_dim_v, causal, deterministic,
                 varlen=False, has_seqused_k=False, dq_order=None, tiles=None) -> common.Compiled:
    """A step's compile_only: compile_main's compile-only build, from a dtype name."""
    return compile_main(step, make_kernel, common.cutlass_dtype(dtype), head_dim, head_dim_v, causal, deterministic,
                        varlen=varlen, has_seqused_k=has_seqused_k, dq_order=dq_order, tiles=tiles,
                        launchable=False)[1]


def backward(step: str, make_kernel: Callable, q, k, v, out, dout, lse, *, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, softmax_scale=None, causal=False,
             deterministic=False, dq=None, dk=None, dv=None, dq_order=None, tiles=None, variant=None,
             return_d: bool = False, check_values: bool = False, persistent_ctas: Optional[int] = None,
             dlse=None):
    """Dense: (B, S, H, D) tensors, lse (B, Hq, Sq). Varlen: packed (T, H, D), lse (Hq, Tq), int32
    cu_seqlens_q / cu_seqlens_k (batch + 1,), max_seqlen_q / max_seqlen_k, optional seqused_k (batch,).
    check_values=True also reads the index tensors' values on the host and checks them (offsets from 0,
    non-decreasing, ending at the packed length; max_seqlen_* at least the longest sequence; 0 <=
    seqused_k[b] <= its length): a device sync, which a training step pays on every layer and CUDA-graph
    capture forbids, so off by default, as in stage 3's varlen forward.
    variant: None, or (Window, softcap) from ``variant_of`` (kernels that support them). Returns
    (dq, dk, dv) in q's dtype; return_d=True adds D = rowsum(dO * O) (minus dlse, below) in lse's layout,
    fp32 (the preprocess computes it anyway; a learnable sink's gradient needs it). persistent_ctas: the grid of a
    persistent kernel (hopper/persistent.py; None: one CTA per SM), e.g. a few CTAs in a test, so that
    each walks many K/V tiles. dlse: the gradient flowing in through lse (lse's shape, fp32), or None;
    since d lse_i / d S_ij = P_ij it adds P * dlse to dS, i.e. the main kernel's D becomes D - dlse,
    which the preprocess stores (rows with lse = -inf keep D); return_d returns those D rows, the ones
    the main kernel used."""
    import torch

    if persistent_ctas is not None and (isinstance(persistent_ctas, bool) or not isinstance(persistent_ctas, int)
                                        or persistent_ctas < 1):
        raise ValueError(f"persistent_ctas: expected None or an int >= 1, got {persistent_ctas!r}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    common.check_causal(causal)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    q, k, v, out, dout, lse = common.check_backward_inputs(q, k, v, out, dout, lse, varlen=varlen)
    if dlse is not None:
        if not isinstance(dlse, torch.Tensor):
            raise TypeError(f"dlse: expected a torch.Tensor or None, got {type(dlse).__name__}")
        if tuple(dlse.shape) != tuple(lse.shape) or dlse.device != lse.device or not dlse.is_floating_point():
            raise ValueError(f"dlse: expected a floating tensor shaped like lse {tuple(lse.shape)} on {lse.device}, "
                             f"got {tuple(dlse.shape)} {dlse.dtype} on {dlse.device}")
    softmax_scale = common.default_scale(softmax_scale, q.shape[-1])
    cu_q, cu_k, seqused_k, batch, max_seqlen_q, max_seqlen_k = _check_lengths(
        q, k, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, check_values)
    if batch > 65535 or q.shape[-2] > 65535:  # the launches' grid y / z: (blocks, heads, sequences)
        raise ValueError(f"batch ({batch}) and heads ({q.shape[-2]}) must be <= 65535 (grid y / z limit)")
    dq = common.check_grad_out("dq", dq, q)
    dk = common.check_grad_out("dk", dk, k)
    dv = common.check_grad_out("dv", dv, v)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv

    hq = q.shape[-2]
    d, d_v = q.shape[-1], v.shape[-1]
    # degenerate sizes: nothing to launch, but every output is defined
    if batch == 0 or hq == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return (dq, dk, dv, _d_rows_with_torch(out, dout, lse, dlse, varlen)) if return_d else (dq, dk, dv)

    dt = common.cutlass_dtype(q.dtype)
    if dq_order is None and common.cdiv(max_seqlen_k, 64) * k.shape[-2] * batch >= FAST_DIV_MAX:
        # the default orders' sectioned launch map divides with fast_div, exact below 2^22 CTAs (counted
        # with the smallest key tile); a bigger grid launches in plain blockIdx order instead of failing
        dq_order = common.default_dq_order(causal, deterministic, sections=False, head_dim=d)
    kernel, comp = compile_main(step, make_kernel, dt, d, d_v, causal, deterministic, varlen=varlen,
                                has_seqused_k=seqused_k is not None, dq_order=dq_order, tiles=tiles,
                                variant=variant)
    dq_frag = uses_dq_frag(kernel)
    if hasattr(kernel.dq_order, "check_grid"):  # before the first launch (the preprocess)
        kernel.dq_order.check_grid(common.cdiv(max_seqlen_k, kernel.tile_n), k.shape[-2], batch)

    # 1. preprocess: lse2, D, and zeroes (the dQ accumulator, or its tiles' arrival counters, and the
    # main kernel's semaphores where they need it)
    dq_accum, to_zero, arrivals, semaphores = _scratch(kernel, q, varlen, deterministic, batch, max_seqlen_q,
                                                       persistent_ctas)
    lse2, dpsum = pre.preprocess(out, dout, lse, to_zero, head_dim=d,
                                 cu_seqlens_q=cu_q if varlen else None, max_seqlen_q=max_seqlen_q,
                                 dq_zeroing="flat" if dq_frag else "rows", dlse=dlse)
    num_n_blocks = common.cdiv(max_seqlen_k, kernel.tile_n)
    d_rows = _d_in_lse_layout(dpsum, lse, cu_q if varlen else None) if return_d else None

    # 2. main kernel
    dummy = pre._dummy_int32(q.device)
    comp.fn(*main_args(q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, varlen=varlen,
                       cu_seqlens_q=cu_q if varlen else dummy, cu_seqlens_k=cu_k if varlen else dummy,
                       seqused_k=seqused_k if seqused_k is not None else dummy, semaphores=semaphores,
                       num_n_blocks=num_n_blocks, softmax_scale=softmax_scale, arrivals=arrivals))

    # 3. postprocess: dq = scale * dQaccum in q's dtype (first stores: zeros where no K/V tile arrived)
    if dq_frag:
        from stage4_bwd_kernel import postprocess_frag as post_frag

        post_frag.postprocess(kernel, dq_accum.unsqueeze(0) if varlen else dq_accum, dq, softmax_scale,
                              cu_seqlens_q=cu_q if varlen else None, max_seqlen_q=max_seqlen_q, arrivals=arrivals)
    else:
        post.postprocess(dq_accum, dq, softmax_scale, cu_seqlens_q=cu_q if varlen else None,
                         max_seqlen_q=max_seqlen_q)
    if return_d:
        return dq, dk, dv, d_rows
    return dq, dk, dv


def _check_lengths(q, k, varlen: bool, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                   check_values: bool) -> tuple:
    """backward's sequence arguments, checked: (cu_q, cu_k, seqused_k, batch, max_seqlen_q, max_seqlen_k);
    a dense call's come from its tensors (cu_q, cu_k None)."""
    import torch

    if not varlen:
        for name, given in (("seqused_k", seqused_k), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if given is not None:
                raise ValueError(f"{name}: only with varlen (cu_seqlens_q / cu_seqlens_k); a dense call's lengths "
                                 "are its tensors'")
        if check_values:
            raise ValueError("check_values: only with varlen (a dense call has no index tensors to check)")
        return None, None, None, q.shape[0], q.shape[1], k.shape[1]
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q, cu_seqlens_k: varlen needs both")
    cu_q = common.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], check_values)
    cu_k = common.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], check_values)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected length {cu_q.shape[0]} like cu_seqlens_q, got {cu_k.shape[0]}")
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(given, numbers.Integral) or isinstance(given, bool):
            raise TypeError(f"{name}: expected an int, got {type(given).__name__}")
        if given < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {given!r}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    batch = cu_q.shape[0] - 1
    if seqused_k is not None:
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32:
            raise TypeError("seqused_k: expected an int32 torch.Tensor")
        if tuple(seqused_k.shape) != (batch,) or not seqused_k.is_cuda:
            raise ValueError(f"seqused_k: expected a CUDA tensor of shape ({batch},), got {tuple(seqused_k.shape)}")
        seqused_k = seqused_k.contiguous()
    if check_values:
        _check_varlen_values(cu_q, cu_k, max_seqlen_q, max_seqlen_k, seqused_k)
    return cu_q, cu_k, seqused_k, batch, max_seqlen_q, max_seqlen_k


def _scratch(kernel, q, varlen: bool, deterministic: bool, batch: int, max_seqlen_q: int, persistent_ctas) -> tuple:
    """(dq_accum, what the preprocess zeroes, arrivals, semaphores) of one backward. The dQ accumulator
    is in fragment order (postprocess_frag: one flat buffer, zeroed whole) or, with first stores
    (hopper/dq_writer.py), not zeroed: only its tiles' arrival counters are. The main kernel's
    semaphores are zeroed before the preprocess (or by it: a persistent grid's tile counter), since the
    main kernel follows the preprocess directly as its programmatic dependent (PDL)."""
    import torch

    hq, d = q.shape[-2], q.shape[-1]
    arrivals, to_zero, tile_counter = None, None, None
    persistent = getattr(kernel, "persistent", False)
    if persistent:
        from stage3_fwd_kernel.tile_scheduler import sm_count

        ctas = sm_count(q.device) if persistent_ctas is None else persistent_ctas
    if uses_dq_frag(kernel):
        rows = kernel.dq_frag_accum_rows(q.shape[0] if varlen else max_seqlen_q, batch)
        dq_accum = torch.empty((*q.shape[:-3], hq, rows, d), dtype=torch.float32, device=q.device)
        to_zero = dq_accum
        if getattr(kernel, "dq_first_store", False):
            counters = (1 if varlen else batch, hq, rows // kernel.tile_m)
            if persistent:  # its tile counter zeroed by the same pass: one kernel less a call
                arrivals, tile_counter, to_zero = zeroed_words(q.device, counters, (1, 1, ctas))
            else:
                arrivals, to_zero = dq_arrivals(*counters, q.device)
    else:
        dq_accum = to_zero = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if arrivals is None and takes_dq_arrivals(kernel):
        arrivals = pre._dummy(q.device, (1, 1, 1), "int32")
    if deterministic:
        semaphores = torch.zeros((batch, hq, common.cdiv(max_seqlen_q, kernel.tile_m)), dtype=torch.int32,
                                 device=q.device)
    elif persistent:  # a persistent grid's tile counter (hopper/persistent.py): its length is the grid's width
        semaphores = tile_counter if tile_counter is not None else \
            torch.zeros((1, 1, ctas), dtype=torch.int32, device=q.device)
    else:
        semaphores = pre._dummy(q.device, (1, 1, 1), "int32")  # made once, not a view per call
    return dq_accum, to_zero, arrivals, semaphores


def dq_arrivals(batch: int, heads: int, tiles: int, device) -> tuple:
    """(counters, flat): the dQ accumulator's per-tile int32 arrival counters (batch, heads, tiles) for
    first stores, and the same memory as a flat fp32 buffer of a multiple of 4 elements, which the
    preprocess zeroes (its "flat" zeroing)."""
    return zeroed_words(device, (batch, heads, tiles))


def zeroed_words(device, *shapes) -> tuple:
    """(one int32 tensor per shape, flat): the tensors carved one after another from one buffer, each
    starting on a 16-byte boundary, and the whole buffer as flat fp32 of a multiple of 4 elements: what the
    preprocess's "flat" zeroing clears, all of them in its one pass."""
    import torch

    spans, end = [], 0
    for shape in shapes:  # (start, words): each tensor starts on a 4-word (16-byte) boundary
        spans.append((end, math.prod(shape)))
        end += common.cdiv(spans[-1][1], 4) * 4
    flat = torch.empty(max(end, 4), dtype=torch.int32, device=device)
    views = [flat[start:start + n].view(shape) for (start, n), shape in zip(spans, shapes)]
    return (*views, flat.view(torch.float32))


def _check_varlen_values(cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, seqused_k):
    """backward(check_values=True)'s host-side checks of the index tensors' values (one device sync;
    check_cu_seqlens has checked the offsets themselves)."""
    host_q, host_k = cu_q.tolist(), cu_k.tolist()
    lens_q = [b - a for a, b in zip(host_q, host_q[1:])]
    lens_k = [b - a for a, b in zip(host_k, host_k[1:])]
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if given < max(lens):
            raise ValueError(f"{name}: expected an int >= the longest sequence ({max(lens)}), got {given!r}")
    if seqused_k is not None:
        used = seqused_k.tolist()
        if any(u < 0 or u > n for u, n in zip(used, lens_k)):
            raise ValueError(f"seqused_k: expected 0 <= seqused_k[b] <= seqlen_k[b], got {used} for {lens_k}")


def _d_rows_with_torch(out, dout, lse, dlse, varlen: bool):
    """What return_d hands back when nothing launches: D = rowsum(dO * O) in lse's layout, minus dlse
    where the row's lse > -inf (as the preprocess stores it)."""
    import torch

    d_rows = (dout.float() * out).sum(-1).movedim(-1, -2 if varlen else 1)
    if dlse is not None:
        d_rows = d_rows - torch.where(lse == float("-inf"), 0.0, dlse.float())
    return d_rows.contiguous()


def _varlen_d_rows(lse, cu_seqlens_q, num_rows: int):
    """Varlen: the preprocess's D row of each packed token (common.stats_offset), int64 (Tq,). A token
    past cu_seqlens_q[-1] (unchecked without check_values) is in no sequence; its row, clamped to the
    last of `num_rows`, lies past every sequence's rows, so it reads a padding row and cannot fault."""
    import torch

    tokens = torch.arange(lse.shape[-1], device=lse.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_q[1:], tokens, right=True)         # sequence of each token
    start = cu_seqlens_q[seq]
    return (common.stats_offset(start, seq) + tokens - start).long().clamp_(max=num_rows - 1)


def _d_in_lse_layout(dpsum, lse, cu_seqlens_q):
    """The preprocess's D rows (16-byte padded per sequence, common.stats_offset) in lse's layout:
    dense (B, Hq, Sq) a slice; varlen (Hq, Tq) a gather of token t of sequence b from row
    stats_offset(cu_seqlens_q[b], b) + t - cu_seqlens_q[b]."""
    if cu_seqlens_q is None:
        return dpsum[..., :lse.shape[-1]]
    return dpsum[:, _varlen_d_rows(lse, cu_seqlens_q, dpsum.shape[-1])]


# ------------------------------------------------------------------------------------------------
# GPU check helpers shared by run() and the tests
# ------------------------------------------------------------------------------------------------
def reference_grads(q, k, v, dout, *, causal=False, softmax_scale=None):
    """(fp32 reference grads, low-precision baseline grads) by torch autograd through the stage-0
    attention_ref: the two sides of FA4's tolerance rule."""
    import torch
    from stage0_reference.torch_reference import attention_ref

    def grads(dtype, upcast):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_ref(*leaves, softmax_scale=softmax_scale, causal=causal, upcast=upcast)
        o.backward(dout.to(dtype))
        return tuple(t.grad for t in leaves)

    ref = grads(torch.float32, True)
    base = grads(q.dtype, False)
    return ref, base


def reference_varlen_grads(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None, causal=False,
                           softmax_scale=None):
    """Varlen version: per-sequence autograd (keys past seqused_k get zero gradient)."""
    import torch

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(ck, ck[1:])]
    outs = []
    for dtype in (torch.float32, q.dtype):
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
        outs.append((dq, dk, dv))
    for b, (q0, q1, k0) in enumerate(zip(cq[:-1], cq[1:], ck[:-1])):
        k1 = k0 + used[b]
        if q1 == q0 or k1 == k0:
            continue
        ref, base = reference_grads(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1],
                                    causal=causal, softmax_scale=softmax_scale)
        for (dq, dk, dv), g in zip(outs, (ref, base)):
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return outs[0], outs[1]


def forward_for_test(q, k, v, *, causal=False, softmax_scale=None):
    """out, lse from the stage-3 Hopper forward (step 2, verified on an H100)."""
    from stage3_fwd_kernel import hopper_step2_tma

    return hopper_step2_tma.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)


def run_step(step: str, compile_only: Callable, attention_backward: Callable, *, batch, seqlen_q, seqlen_k, heads,
             heads_kv, head_dim, head_dim_v, causal, deterministic, dtype, check, compare_deterministic=True,
             verbose=True) -> dict:
    """The body of every main step's run(): GPU -> check + time (+ deterministic vs default);
    no GPU -> compile + resource report."""
    result: dict = {"step": step}
    if not common.hopper_gpu_available():
        comp = compile_only(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                            deterministic=deterministic)
        result.update(mode="compile-only", report=comp.report)
        if verbose:
            print(common.format_report(f"{step} [{common.ARCH}, {dtype}, d={head_dim}/{head_dim_v}, causal={causal}, "
                                       f"deterministic={deterministic}] (no Hopper GPU: compiled only)", comp.report))
        return result

    import torch
    from stage0_reference.torch_reference import assert_fa4_close

    tdt = common.torch_dtype(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=g)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=g)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=g)
    dout = torch.randn(batch, seqlen_q, heads, head_dim_v, device="cuda", dtype=tdt, generator=g)
    out, lse = forward_for_test(q, k, v, causal=causal)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    run = lambda det: attention_backward(q, k, v, out, dout, lse, causal=causal, deterministic=det,
                                         dq=grads[0], dk=grads[1], dv=grads[2])
    run(deterministic)
    torch.cuda.synchronize()
    if check:
        ref, base = reference_grads(q, k, v, dout, causal=causal)
        for name, a, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
            assert_fa4_close(f"{step} {name}", a, r, b)
    flops = common.backward_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal)
    ms = common.benchmark_ms(lambda: run(deterministic))
    result.update(mode="gpu", ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    if compare_deterministic:
        ms_other = common.benchmark_ms(lambda: run(not deterministic))
        ms_det, ms_def = (ms, ms_other) if deterministic else (ms_other, ms)
        result.update(ms_deterministic=ms_det, ms_default=ms_def, deterministic_slowdown=ms_det / ms_def)
    if verbose:
        print(f"{'PASS' if check else '(unchecked)'} {step} b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} "
              f"d={head_dim}/{head_dim_v} causal={causal} deterministic={deterministic} {dtype}: "
              f"{ms:.3f} ms, {result['tflops']:.1f} TFLOP/s")
        if compare_deterministic:
            print(f"  deterministic {result['ms_deterministic']:.3f} ms vs default {result['ms_default']:.3f} ms "
                  f"({result['deterministic_slowdown']:.2f}x)")
    return result


def cli(run: Callable, doc: str, argv=None):
    """The command line of every main step: `python -m stage4_bwd_kernel.<step> [--causal] ...`."""
    from stage3_fwd_kernel.runner import shape_kwargs, shape_parser

    ap = shape_parser(doc)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--no-check", dest="check", action="store_false")
    a = ap.parse_args(argv)
    return run(**shape_kwargs(a), deterministic=a.deterministic, check=a.check)
