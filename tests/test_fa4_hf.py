"""fa4 as a Hugging Face transformers attention implementation, end to end on tiny random models.

cpu tier: Llama, Mistral (sliding window), Gemma 2 (softcap, alternating sliding layers) and
gpt-oss (sinks) built from configs (no download), run with attn_implementation="fa4" while fa4's
kernels are replaced by a CPU stand-in: `ReferenceFA4` takes flash_attn_func /
flash_attn_varlen_func calls with the real keyword-only signatures, checks the varlen arguments
with fa4's own value checks, and computes them with the stage-0 PyTorch oracle, exactly (fa4
itself refuses CPU tensors and fp32, rightly). Logits are compared with "eager" (and "sdpa"
where the model has it) on plain, padded and packed batches -- packed as
DataCollatorWithFlattening makes them, through position_ids and through cu_seq_lens kwargs --
and with greedy generation from a left-padded batch. Patterns fa4 cannot serve raise. The mask
function reads no tensor value under FakeTensorMode or on meta tensors, and whole models run
there with fa4's real functions (validation, fake kernels); data-dependent work happens once per
model forward, not per layer.

gpu tier: a tiny Llama in bf16 with "fa4" against bf16 "sdpa", both judged against fp32 eager
with FA4's rule (error at most 2x sdpa's plus 1e-5), on plain, padded and packed batches.
"""
from __future__ import annotations

import copy
import inspect
import sys
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed here")

from transformers import (DataCollatorWithFlattening, Gemma2Config, GptOssConfig, LlamaConfig,  # noqa: E402
                          MistralConfig)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import fa4  # noqa: E402
from fa4 import _validate  # noqa: E402
from fa4.integrations import transformers as integ  # noqa: E402
from stage0_reference.torch_reference import attention_ref, attention_varlen_ref  # noqa: E402

integ.register_fa4_attention()

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
CONFIGS = {
    "llama": lambda: LlamaConfig(**BASE),
    "mistral": lambda: MistralConfig(**BASE, sliding_window=5),
    "gemma2": lambda: Gemma2Config(**BASE, sliding_window=5, query_pre_attn_scalar=16, attn_logit_softcapping=20.0),
    "gpt_oss": lambda: GptOssConfig(**{**BASE, "intermediate_size": 64}, num_local_experts=2, num_experts_per_tok=1,
                                    sliding_window=5),
}
HAS_SDPA = {"llama", "mistral"}  # Gemma 2 and gpt-oss refuse sdpa in transformers (softcap / sinks)
PACKING_IN_MASK = {"llama", "mistral", "gemma2"}  # models that give position_ids to their mask builder
DOCS = (4, 3, 6)  # a packed row: three documents
ATOL = 2e-5


# ----------------------------------------------------------------------------------- the stand-in
class ReferenceFA4:
    """fa4's two entry points as the integration calls them, on CPU: the call must bind to the
    real signature (everything after q, k, v by keyword), cu_seqlens must be int32 and the max
    lengths ints, and the varlen values must pass fa4's own checks; the result is the stage-0
    oracle's. On tensors without data it returns the right shape only."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _oracle_kwargs(kw):
        return {n: kw[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "learnable_sink") if n in kw}

    def dense(self, q, k, v, **kw):
        inspect.signature(fa4.flash_attn_func).bind(q, k, v, **kw)
        self.calls.append(("dense", kw))
        if integ._no_data(q):
            return q.new_empty(*q.shape[:-1], v.shape[-1])
        return attention_ref(q, k, v, **self._oracle_kwargs(kw))[0]

    def varlen(self, q, k, v, **kw):
        inspect.signature(fa4.flash_attn_varlen_func).bind(q, k, v, **kw)
        if kw.get("cu_seqlens_q") is None:  # padded q / k / v (a KeyPrefix): row b's keys [0, seqused_k[b])
            self.calls.append(("varlen", kw))
            used = kw["seqused_k"]
            return torch.cat([attention_ref(q[b:b + 1], k[b:b + 1, :used[b]], v[b:b + 1, :used[b]],
                                            **self._oracle_kwargs(kw))[0] for b in range(q.shape[0])])
        cu_q, cu_k, max_q, max_k = (kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and type(max_q) is int and type(max_k) is int
        self.calls.append(("varlen", kw))
        if integ._no_data(q):
            return q.new_empty(*q.shape[:-1], v.shape[-1])
        _validate.check_varlen_values(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
        return attention_varlen_ref(q, k, v, cu_q, cu_k, **self._oracle_kwargs(kw))[0]

    def kvcache(self, q, k_cache, v_cache, **kw):
        """flash_attn_with_kvcache's contract where the integration calls it: sequence b attends to cache
        rows [cache_leftpad[b], cache_seqlens[b])."""
        inspect.signature(fa4.flash_attn_with_kvcache).bind(q, k_cache, v_cache, **kw)
        lens, first = kw["cache_seqlens"], kw["cache_leftpad"]
        assert lens.dtype == first.dtype == torch.int32 and lens.shape == first.shape == q.shape[:1]
        self.calls.append(("kvcache", dict(kw, slots=k_cache.shape[1])))   # slots: the buffer's rows
        return torch.cat([attention_ref(q[b:b + 1], k_cache[b:b + 1, first[b]:lens[b]],
                                        v_cache[b:b + 1, first[b]:lens[b]], **self._oracle_kwargs(kw))[0]
                          for b in range(q.shape[0])])

    def kinds(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def ref_fa4(monkeypatch):
    ref = ReferenceFA4()  # opaque to torch.compile, as a kernel is
    monkeypatch.setattr(integ, "flash_attn_func", torch.compiler.disable(ref.dense))
    monkeypatch.setattr(integ, "flash_attn_varlen_func", torch.compiler.disable(ref.varlen))
    monkeypatch.setattr(integ, "flash_attn_with_kvcache", torch.compiler.disable(ref.kvcache))
    monkeypatch.setattr(integ, "_LAST_POSITIONS", [None])
    return ref


# ----------------------------------------------------------------------------------- helpers
def build(kind):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()


def logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= ATOL, f"{what}: max |fa4 - reference| = {err:.3e} > {ATOL:.0e}"


def packed_row(seed=1, docs=DOCS):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, BASE["vocab_size"], (n,), generator=g) for n in docs]
    return parts, torch.cat(parts)[None], torch.cat([torch.arange(n) for n in docs])[None]


def per_document(model, parts):
    """Ground truth for a packed row: each document run alone (eager)."""
    return torch.cat([logits(model, "eager", input_ids=p[None], use_cache=False) for p in parts], dim=1)


def implementations(kind):
    return ["eager", "sdpa"] if kind in HAS_SDPA else ["eager"]


# ----------------------------------------------------------------------------------- cpu: numerics
@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_plain_batch_matches_eager_and_sdpa(ref_fa4, kind):
    model = build(kind)
    ids = torch.randint(0, BASE["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    ours = logits(model, "fa4", input_ids=ids)
    assert set(ref_fa4.kinds()) == {"dense"}  # nothing padded, not packed: flash_attn_func per layer
    for impl in implementations(kind):
        close(ours, logits(model, impl, input_ids=ids), f"{kind} plain vs {impl}")
    windows = {c[1]["window_size"] for c in ref_fa4.calls}
    assert windows == ({(None, None)} if kind == "llama" else {(4, 0)} if kind == "mistral" else {(None, None), (4, 0)})
    assert all(c[1]["softcap"] == (20.0 if kind == "gemma2" else 0.0) for c in ref_fa4.calls)
    assert all((c[1]["learnable_sink"] is not None) == (kind == "gpt_oss") for c in ref_fa4.calls)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_padded_batch_matches_eager_and_sdpa(ref_fa4, kind):
    """Left padding in row 0, right padding in row 1, none in row 2: the valid positions agree."""
    model = build(kind)
    ids = torch.randint(0, BASE["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    ours = logits(model, "fa4", input_ids=ids, attention_mask=mask)
    assert set(ref_fa4.kinds()) == {"varlen"}
    valid = mask.bool()
    for impl in implementations(kind):
        close(ours[valid], logits(model, impl, input_ids=ids, attention_mask=mask)[valid], f"{kind} padded vs {impl}")
    assert torch.isfinite(ours).all()


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_packed_row_matches_eager_and_each_document(ref_fa4, kind):
    """position_ids restarting inside the row, no cache (training): transformers' mask builder
    describes the packed pattern; fa4_mask hands it on as PackedSequences, one varlen call per
    layer over the three documents; eager builds the block-diagonal mask. gpt-oss gives its mask
    builder no position_ids: fa4 finds the packing in the attention's position_ids (the flash
    rule) and still matches the documents run alone, which eager does not."""
    model = build(kind)
    parts, ids, pos = packed_row()
    ours = logits(model, "fa4", input_ids=ids, position_ids=pos, use_cache=False)
    cu = torch.tensor([0, 4, 7, 13], dtype=torch.int32)
    assert ref_fa4.kinds() == ["varlen"] * 2 and all(torch.equal(c[1]["cu_seqlens_q"], cu) for c in ref_fa4.calls)
    truth = per_document(model, parts)
    close(ours, truth, f"{kind} packed vs each document")
    for impl in implementations(kind):
        theirs = logits(model, impl, input_ids=ids, position_ids=pos, use_cache=False)
        if kind in PACKING_IN_MASK:
            close(ours, theirs, f"{kind} packed vs {impl}")
        else:  # gpt-oss builds its masks without position_ids: eager attends across the documents
            assert (theirs - truth).abs().max() > 1e-3


@pytest.mark.cpu
@pytest.mark.fa4
def test_packed_rows_in_a_batch_of_two(ref_fa4):
    """Two packed rows (transformers' flash path would need a batch of one here; the mask's
    packed-sequence ids serve any batch)."""
    model = build("mistral")
    _, a, pa = packed_row(1, (5, 6))
    _, b, pb = packed_row(2, (3, 4, 4))
    ids, pos = torch.cat([a, b]), torch.cat([pa, pb])
    ours = logits(model, "fa4", input_ids=ids, position_ids=pos, use_cache=False)
    assert torch.equal(ref_fa4.calls[0][1]["cu_seqlens_q"], torch.tensor([0, 5, 11, 14, 18, 22], dtype=torch.int32))
    for impl in ("eager", "sdpa"):
        close(ours, logits(model, impl, input_ids=ids, position_ids=pos, use_cache=False), f"2 packed rows vs {impl}")


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_packed_row_with_a_cache_follows_the_flash_rule(ref_fa4, kind):
    """With the default use_cache=True transformers' mask builder does not look for packing
    (eager and sdpa then attend across documents); fa4, like transformers' FlashAttention path,
    reads position_ids of a batch of one and keeps the documents apart."""
    model = build(kind)
    parts, ids, pos = packed_row()
    ours = logits(model, "fa4", input_ids=ids, position_ids=pos)
    assert ref_fa4.kinds() == ["varlen"] * 2
    truth = per_document(model, parts)
    close(ours, truth, f"{kind} packed (cache) vs each document")
    assert (logits(model, "eager", input_ids=ids, position_ids=pos) - truth).abs().max() > 1e-3  # eager mixes them


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("use_cache", [True, False])
def test_flattening_collator_kwargs(ref_fa4, use_cache):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True): cu_seq_lens_q/k and
    max_length_q/k reach the attention through the model's kwargs and are used as given."""
    model = build("llama")
    parts, _, _ = packed_row()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": p.tolist()} for p in parts])
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(batch)
    ours = logits(model, "fa4", **{n: t for n, t in batch.items() if n != "labels"}, use_cache=use_cache)
    got = ref_fa4.calls[0][1]
    assert ref_fa4.kinds() == ["varlen"] * 2
    assert torch.equal(got["cu_seqlens_q"], batch["cu_seq_lens_q"].int()) and got["max_seqlen_q"] == 6
    close(ours, per_document(model, parts), "collator kwargs vs each document")
    ref_fa4.calls.clear()  # without position_ids the kwargs alone carry the packing
    ours = logits(model, "fa4", input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
                  cu_seq_lens_k=batch["cu_seq_lens_k"], max_length_q=torch.tensor(6), max_length_k=6,
                  use_cache=use_cache)
    assert ref_fa4.kinds() == ["varlen"] * 2 and ref_fa4.calls[0][1]["max_seqlen_q"] == 6


@pytest.mark.cpu
@pytest.mark.fa4
def test_greedy_generation_from_left_padding(ref_fa4):
    """generate() with a KV cache: prefill through the padded path, then one query per step
    against the cache (the mask grows each step); scores and tokens as eager's."""
    generate_like_eager(build("llama"), seed=3, pads=(0, 3), what="llama")
    assert "varlen" in ref_fa4.kinds()


def generate_like_eager(model, seed, pads, what, **generate_kw):
    """Greedy generate() of 4 tokens from a batch of 7-token prompts, row b left-padded by pads[b]:
    fa4's tokens equal eager's and its scores are within ATOL at every step."""
    ids = torch.randint(1, BASE["vocab_size"], (len(pads), 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    out = {}
    for impl in ("fa4", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                       **generate_kw)
    assert torch.equal(out["fa4"].sequences, out["eager"].sequences)
    for step, (a, b) in enumerate(zip(out["fa4"].logits, out["eager"].logits)):
        close(a, b, f"{what} generation step {step}")
    return ids


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_static_cache_without_a_padding_mask(ref_fa4, kind):
    """A static cache's buffer holds empty slots past the tokens so far; with no padding mask
    (generate() drops an all-ones one) only the filled slots are keys: prefill and the decode steps
    as eager's, through forward calls and through generate(cache_implementation="static")."""
    from transformers import StaticCache

    model = build(kind)
    g = torch.Generator().manual_seed(0)
    ids, nxt = (torch.randint(0, BASE["vocab_size"], shape, generator=g) for shape in ((2, 6), (2, 1)))
    res = {}
    for impl in ("fa4", "eager"):
        model.set_attn_implementation(impl)
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            res[impl] = [model(input_ids=x, past_key_values=cache, use_cache=True).logits for x in (ids, nxt)]
    for what, a, b in zip(("prefill", "decode"), res["fa4"], res["eager"]):
        close(a, b, f"{kind} static cache {what}")
    gen = {}
    for impl in ("fa4", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            gen[impl] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True,
                                       pad_token_id=0, cache_implementation="static")
    assert torch.equal(gen["fa4"].sequences, gen["eager"].sequences)
    for step, (a, b) in enumerate(zip(gen["fa4"].logits, gen["eager"].logits)):
        close(a, b, f"{kind} static generation step {step}")


@pytest.mark.cpu
@pytest.mark.fa4
def test_key_prefix_from_a_tensor_offset_needs_no_sync():
    """A static cache's q_offset handed as a tensor without data (tracing) becomes a KeyPrefix of a
    length tensor (no value read); with data it is read once and the filled slots become an all-True
    padding mask; filled buffers need nothing."""
    meta = torch.zeros(1, dtype=torch.long, device="meta")
    got = integ.fa4_mask(batch_size=2, q_length=1, kv_length=16, q_offset=meta + 5, device="meta")
    assert isinstance(got, integ.KeyPrefix) and got.length.shape == (2,) and got.length.dtype == torch.int32
    assert integ.fa4_mask(batch_size=2, q_length=1, kv_length=16, attention_mask=got) is got  # handed back
    q, kv = (torch.empty(2, h, s, 64, device="meta", dtype=torch.bfloat16) for h, s in ((4, 1), (2, 16)))
    out, _ = integ.fa4_attention_forward(torch.nn.Module(), q, kv, kv, got)  # fa4's own functions, fake kernels
    assert tuple(out.shape) == (2, 1, 4, 64)
    got = integ.fa4_mask(batch_size=2, q_length=3, kv_length=16, q_offset=torch.tensor(4), device="cpu")
    assert got.dtype == torch.bool and tuple(got.shape) == (2, 7) and bool(got.all())  # the filled slots
    assert integ.fa4_mask(batch_size=2, q_length=3, kv_length=16, q_offset=13) is None
    assert integ.fa4_mask(batch_size=2, q_length=4, kv_length=4) is None


@pytest.mark.cpu
@pytest.mark.fa4
def test_encoder_decoder_cross_attention_with_padding(ref_fa4):
    """Bart: encoder padding, decoder as long as the encoder, longer and shorter. The padding mask says
    which keys exist; a non-causal query is never a padding query (eager and sdpa attend from every
    decoder position), so the logits are eager's at every position."""
    from transformers import BartConfig, BartForConditionalGeneration

    integ.register_fa4_attention()
    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=50, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, -2:] = 0
    for n_dec in (6, 8, 4):
        dec = torch.randint(3, 50, (2, n_dec), generator=g)
        got = logits(model, "fa4", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        want = logits(model, "eager", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        close(got, want, f"bart, {n_dec} decoder tokens")


@pytest.mark.cpu
@pytest.mark.fa4
def test_padding_inside_a_row_with_a_sliding_window_is_refused(ref_fa4):
    """Padding in the middle of a row: exact without a window (the valid keys keep their order), but a
    window would count the valid tokens, not their positions -- refused there, not answered wrongly."""
    ids = torch.randint(0, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 3:6] = 0
    valid = mask.bool()
    llama = build("llama")
    close(logits(llama, "fa4", input_ids=ids, attention_mask=mask)[valid],
          logits(llama, "eager", input_ids=ids, attention_mask=mask)[valid], "llama, padding inside a row")
    with pytest.raises(ValueError, match=r"^attention_mask: padding inside a row .* with a sliding window"):
        logits(build("mistral"), "fa4", input_ids=ids, attention_mask=mask)
    left = torch.ones(2, 12, dtype=torch.long)
    left[1, :4] = 0  # padding at the row's start: one run of valid tokens, served
    mistral = build("mistral")
    close(logits(mistral, "fa4", input_ids=ids, attention_mask=left)[left.bool()],
          logits(mistral, "eager", input_ids=ids, attention_mask=left)[left.bool()], "mistral, left padding")


@pytest.mark.cpu
@pytest.mark.fa4
def test_tensor_kwargs_fa4_does_not_serve_are_refused():
    """A tensor-valued kwarg fa4's attention does not know (T5's position_bias, block indices, a head
    mask) would change the result: refused, naming it, instead of dropped."""
    q = torch.zeros(1, 4, 8, 16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=r"^position_bias: fa4's attention does not take"):
        integ.fa4_attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match=r"^head_mask: fa4's attention does not take"):
        integ.fa4_attention_forward(module, q, q, q, None, head_mask=torch.ones(4))


# ----------------------------------------------------------------------------------- cpu: refusals
@pytest.mark.cpu
@pytest.mark.fa4
def test_patterns_fa4_cannot_serve_raise(ref_fa4):
    model = build("llama")
    model.set_attn_implementation("fa4")
    ids = torch.randint(0, BASE["vocab_size"], (2, 6))
    custom = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"^attention_mask: fa4 takes None or a 2-D"), torch.no_grad():
        model(input_ids=ids, attention_mask=custom)  # a custom 4-D mask goes to the attention as is
    embeds = torch.zeros(2, 6, BASE["hidden_size"])
    prefix = lambda b, h, q, kv: kv < 2  # noqa: E731  (a prefix-LM style overlay)
    for extra in (dict(or_mask_function=prefix), dict(and_mask_function=prefix),
                  dict(block_sequence_ids=torch.zeros(2, 6, dtype=torch.long))):
        with pytest.raises(ValueError, match=r"^mask_function: fa4 "):
            mu.create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                  position_ids=torch.arange(6)[None], **extra)
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^mask_function: fa4 .*chunked"):
        integ.fa4_mask(2, 6, 6, mask_function=chunked)
    pos = torch.arange(6)[None]
    for odd, why in ((mu.and_masks(mu.sliding_window_overlay(3), mu.bidirectional_mask_function), "other kind"),
                     (mu.and_masks(mu.causal_mask_function, mu.bidirectional_mask_function), "2 base patterns"),
                     (mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos), "position remapping")):
        with pytest.raises(ValueError, match=rf"^mask_function: fa4 cannot serve this mask exactly: .*{why}"):
            integ.fa4_mask(1, 6, 6, mask_function=odd)
    with pytest.raises(ValueError, match=r"^max_length_q, max_length_k: fa4 serves packed sequences"), torch.no_grad():
        model(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
              cu_seq_lens_k=torch.tensor([0, 2, 6], dtype=torch.int32))
    q, k = torch.zeros(1, 4, 4, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"^position_ids: packed sequences .* 8 keys for 4 queries"):
        integ.fa4_attention_forward(model.model.layers[0].self_attn, q, k, k, None,
                                    position_ids=torch.tensor([[0, 1, 0, 1]]))
    assert ref_fa4.calls == []


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_left_padded_decode_reads_the_cache_in_place(ref_fa4, monkeypatch, kind):
    """generate() from a left-padded batch where the split launch takes decode steps (as on sm_90; CPU
    tensors here, so its gate is opened): fa4_mask makes the mask a LeftPadding, and every call of at most
    64 query tokens -- the 7-token prefill and each one-token step -- is flash_attn_with_kvcache on the
    cache as transformers holds it, each row from its first valid key (cache_leftpad); tokens and scores
    as eager's, sliding windows, softcap and sinks included. A right-padded batch keeps the varlen path."""
    gate = []
    monkeypatch.setattr(integ, "_split_launch_takes",
                        lambda q, k, v, sink, tokens, keys: gate.append(tokens) or tokens <= 64)
    model = build(kind)
    ids = generate_like_eager(model, seed=5, pads=(0, 3, 6), what=kind)
    layers = BASE["num_hidden_layers"]
    assert ref_fa4.kinds() == ["kvcache"] * (4 * layers) and sorted(set(gate)) == [1, 7]
    for i, (_, kw) in enumerate(ref_fa4.calls):  # forward i // layers sees 7 + i // layers tokens
        cols, keys = 7 + i // layers, int(kw["cache_seqlens"][0])       # a sliding layer's cache: its last keys
        assert kw["cache_leftpad"].tolist() == [max(p - (cols - keys), 0) for p in (0, 3, 6)], (i, keys)
    right = torch.ones_like(ids)
    right[1, -2:] = 0
    ref_fa4.calls.clear()
    logits(model, "fa4", input_ids=ids, attention_mask=right)
    assert ref_fa4.kinds() == ["varlen"] * layers


# architectures with attention modules of their own (q / k norms, sliding and full layers in one model,
# experts, a fused qkv projection, latent attention), by config class name: their keyword arguments over BASE
MORE_ARCHITECTURES = {
    "Qwen3Config": {},
    "Gemma3TextConfig": dict(sliding_window=5, query_pre_attn_scalar=16),
    "Phi3Config": dict(pad_token_id=0),
    "MixtralConfig": dict(num_local_experts=2, num_experts_per_tok=1),
    "Cohere2Config": dict(sliding_window=5),
    # multi-head latent attention: queries and keys of 16 + 8 (rotary) dims, values of 16
    "DeepseekV3Config": dict(num_key_value_heads=4, head_dim=8, q_lora_rank=None, kv_lora_rank=32,
                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2,
                             num_experts_per_tok=1, first_k_dense_replace=2, moe_intermediate_size=32, n_group=1,
                             topk_group=1),
}


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("config_name", sorted(MORE_ARCHITECTURES))
def test_more_architectures_generate_like_eager_reading_the_cache_in_place(ref_fa4, monkeypatch, config_name):
    """A left-padded generate() through fa4 gives eager's tokens and scores, and every call (the short
    prefill and each step) reads the cache in place, for models beyond the four of CONFIGS."""
    import transformers

    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    monkeypatch.setattr(integ, "_split_launch_takes", lambda q, k, v, sink, tokens, keys: tokens <= 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**{**BASE, **MORE_ARCHITECTURES[config_name]})).eval()
    generate_like_eager(model, seed=5, pads=(0, 3, 6), what=config_name)
    assert ref_fa4.kinds() and set(ref_fa4.kinds()) == {"kvcache"}


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_left_padded_static_cache_decode_reads_the_cache_in_place(ref_fa4, monkeypatch, kind):
    """generate(cache_implementation="static") from a left-padded batch: the buffer's slots past the mask
    hold nothing yet, so each step reads slots [first valid key, mask columns) of the buffer in place.
    Gemma 2's sliding layers (a buffer of their own) too, until their window holds no padding: then their
    mask is None and the call flash_attn_func."""
    monkeypatch.setattr(integ, "_split_launch_takes", lambda q, k, v, sink, tokens, keys: tokens <= 64)
    generate_like_eager(build(kind), seed=9, pads=(2, 0, 5), what=f"{kind} static", cache_implementation="static")
    kinds = ref_fa4.kinds()
    assert set(kinds) == {"kvcache"} if kind == "llama" else (kinds[1::2] == ["kvcache"] * 4 and
                                                               kinds[0::2] == ["kvcache"] * 3 + ["dense"])
    assert any(c[1]["cache_seqlens"][0] < c[1]["slots"] for c in ref_fa4.calls)  # a buffer longer than the mask


@pytest.mark.cpu
@pytest.mark.fa4
def test_static_cache_generate_of_a_model_that_reshapes_the_mask(ref_fa4):
    """GPT-2's forward views the mask generate() hands it as (batch, -1) before building its own: a
    LeftPadding answers with its mask (a plain tensor), so the steps take the padded path, as eager's."""
    from transformers import GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=64)).eval()
    generate_like_eager(model, seed=9, pads=(2, 0, 5), what="gpt2 static", cache_implementation="static")


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind, pads", [("llama", (2, 0, 5)), ("gemma2", (2, 0, 5)), ("llama", (0, 0, 0))])
def test_compiled_static_cache_decode_reads_the_cache_in_place(ref_fa4, monkeypatch, kind, pads):
    """generate(cache_implementation="static") compiles its decode steps (transformers does so on a GPU;
    compile_config asks for it here, dynamo's eager backend). It builds each step's mask eagerly, before
    the compiled forward: fa4_mask makes it a LeftPadding, which reaches the compiled layers, so their steps
    read the cache in place (they gathered a copy before). Tokens and scores as eager's. With nothing padded
    generate() passes no mask: the filled slots make the LeftPadding, until the last step fills the buffer
    (then a KeyPrefix: flash_attn_varlen_func with seqused_k, which a GPU runs in place too)."""
    from transformers import CompileConfig

    monkeypatch.setattr(integ, "_split_launch_takes", lambda q, k, v, sink, tokens, keys: tokens <= 64)
    traced, in_place = [], integ._left_padded_decode

    def watched(*args, **kw):  # dynamo replays the append with the value it traced: True in a compiled step
        traced.append(torch.compiler.is_compiling())
        return in_place(*args, **kw)

    monkeypatch.setattr(integ, "_left_padded_decode", watched)
    graphs = []

    def backend(gm, example_inputs, **options):  # dynamo's graphs, run as they are (options: the mode)
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(backend=backend)
    config._compile_all_devices = True  # transformers compiles on accelerators only
    torch._dynamo.reset()
    try:
        generate_like_eager(build(kind), seed=9, pads=pads, what=f"{kind} compiled static",
                            cache_implementation="static", compile_config=config)
    finally:
        torch._dynamo.reset()
    layers = BASE["num_hidden_layers"]
    steps = ref_fa4.calls[layers:4 * layers]  # fa4's three decode forwards (eager's calls come after)
    full = steps if kind == "llama" else steps[1::2]  # Gemma 2's sliding layers: a cache of their own
    if not any(pads):
        full, last = steps[:-layers], steps[-layers:]
        assert [c[0] for c in last] == ["varlen"] * layers and all("seqused_k" in c[1] for c in last)
    else:
        assert "varlen" not in [c[0] for c in steps]
    assert graphs and [c[0] for c in full] == ["kvcache"] * len(full)
    assert all(c[1]["cache_leftpad"].tolist() == list(pads) for c in full)
    in_place_steps = [c for c in steps if c[0] == "kvcache"]
    assert traced == [False] * layers + [True] * len(in_place_steps)  # an eager prefill, then compiled steps


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_decode_skips_launch_plans_while_the_cache_grows(ref_fa4, monkeypatch, cache):
    """A DynamicCache grows a key a step, so every in-place step of every layer runs without launch plans
    (a plan would be recorded per step); a static cache's buffer keeps its rows, so after each layer's
    first step its steps use plans. Plans are on again after each call."""
    from fa4 import _plans

    monkeypatch.setattr(integ, "_split_launch_takes", lambda q, k, v, sink, tokens, keys: tokens <= 64)
    kvcache, plans_on = integ.flash_attn_with_kvcache, []

    def watched(*args, **kw):
        plans_on.append(_plans.enabled())
        return kvcache(*args, **kw)

    monkeypatch.setattr(integ, "flash_attn_with_kvcache", watched)
    monkeypatch.delenv("FA4_PLANS", raising=False)
    monkeypatch.delenv("FA4_CACHE", raising=False)
    model = build("llama")
    kw = {} if cache == "dynamic" else {"cache_implementation": "static"}
    generate_like_eager(model, seed=5, pads=(0, 3, 6), what=f"llama {cache}", **kw)
    layers = BASE["num_hidden_layers"]
    assert len(plans_on) == 4 * layers and _plans.enabled()  # the prefill and 3 steps, each layer once
    assert plans_on == ([False] * (4 * layers) if cache == "dynamic" else [False] * layers + [True] * (3 * layers))


@pytest.mark.cpu
@pytest.mark.fa4
def test_calls_without_plans_leave_other_calls_their_plans(monkeypatch):
    from fa4 import _plans

    monkeypatch.delenv("FA4_PLANS", raising=False)
    monkeypatch.delenv("FA4_CACHE", raising=False)
    seen = []
    assert _plans.enabled()
    assert _plans.call_without_plans(lambda x, y=0: seen.append(_plans.enabled()) or x + y, 2, y=3) == 5
    with pytest.raises(RuntimeError, match="inner"):
        _plans.call_without_plans(lambda: (_ for _ in ()).throw(RuntimeError("inner")))
    other = []
    thread = threading.Thread(target=lambda: other.append(_plans.enabled()))
    _plans.call_without_plans(lambda: (thread.start(), thread.join()))
    inherits = bool(getattr(sys.flags, "thread_inherit_context", 0))  # free-threaded Python: a thread shares it
    assert seen == [False] and other == [inherits is False] and _plans.enabled()


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_cache_grows_when_its_row_count_is_new_to_the_layer():
    module, stateless = torch.nn.Module(), torch.nn.Module
    assert [integ._cache_grew(module, n) for n in (7, 8, 9, 9, 9)] == [True, True, True, False, False]
    assert [integ._cache_grew(module, n) for n in (20, 30, 20, 30)] == [True, True, False, False]  # two caches
    assert [integ._cache_grew(module, n) for n in range(40, 40 + 2 * integ.RECENT_KEY_COUNTS)] == \
        [True] * (2 * integ.RECENT_KEY_COUNTS)
    assert integ._cache_grew(stateless, 5) is False and integ._cache_grew(None, 5) is False


@pytest.mark.cpu
@pytest.mark.fa4
def test_left_padded_path_takes_only_the_kernels_head_dims(monkeypatch):
    """Head dims fa4 runs padded (80: Phi-2; 16) keep the general path: padding them would copy the whole
    cache. The kernels' own pairs take the in-place path (sm_90's backend, the split launch's gate open)."""
    from fa4 import _dispatch

    monkeypatch.setattr(integ._decode_route, "takes", lambda *args: True)
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: _dispatch.make_backend(_dispatch.ARCHS["sm_90"]))
    for d, dv, taken in ((128, 128, True), (64, 64, True), (192, 128, True), (80, 80, False), (16, 16, False)):
        q, k, v = torch.zeros(2, 1, 8, d), torch.zeros(2, 64, 2, d), torch.zeros(2, 64, 2, dv)
        assert integ._split_launch_takes(q, k, v, None, 1, 64) is taken, (d, dv)


@pytest.mark.cpu
@pytest.mark.fa4
def test_mask_function_takes_left_padding_only():
    """fa4_mask makes a LeftPadding of a mask whose rows hold their tokens at the end (first valid key,
    kv_len per row); right padding, padding inside a row, more queries than columns and no columns stay
    plain tensors."""
    left = torch.ones(3, 9, dtype=torch.long)
    left[0, :4] = 0
    left[2, :] = 0
    got = integ.fa4_mask(3, 1, 9, attention_mask=left)
    assert isinstance(got, integ.LeftPadding) and torch.equal(got.mask, left.bool()) and got.kv_length == 9
    assert got.first.tolist() == [4, 0, 9] and got.lengths.tolist() == [9, 9, 9] and got.first.dtype == torch.int32
    for row in ([1, 1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 0]):
        other = left.clone()
        other[1] = torch.tensor(row)
        assert isinstance(integ.fa4_mask(3, 1, 9, attention_mask=other), torch.Tensor)
    assert isinstance(integ.fa4_mask(3, 10, 12, attention_mask=left), torch.Tensor)  # 10 queries, 9 columns
    empty = integ.fa4_mask(3, 1, 4, attention_mask=torch.ones(3, 0, dtype=torch.long))
    assert isinstance(empty, torch.Tensor) and empty.shape == (3, 0)


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_left_padding_handed_back_to_the_mask_function():
    """A LeftPadding over a static cache's buffer (16 slots, 9 columns so far) comes back as it is when
    transformers hands it to fa4_mask again for a layer of the same size, is opened again for one of
    another size (a sliding cache's last 5 columns), and moves whole with to()."""
    left = torch.ones(3, 9, dtype=torch.long)
    left[0, :6] = 0
    got = integ.fa4_mask(3, 1, 16, q_offset=torch.tensor(8), attention_mask=left)
    assert isinstance(got, integ.LeftPadding) and got.kv_length == 16 and torch.equal(got.mask, left.bool())
    assert got.first.tolist() == [6, 0, 0] and got.lengths.tolist() == [9, 9, 9]
    assert integ.fa4_mask(3, 1, 16, q_offset=torch.tensor(8), attention_mask=got) is got
    sliding = integ.fa4_mask(3, 1, 5, q_offset=torch.tensor(8), attention_mask=got)  # its last 5 columns
    assert isinstance(sliding, integ.LeftPadding) and sliding.first.tolist() == [2, 0, 0]
    assert got.to("cpu") is got and got.to(dtype=torch.bool) is got
    moved = got.to("meta")
    assert isinstance(moved, integ.LeftPadding) and {t.device.type for t in (moved.mask, moved.first,
                                                                             moved.lengths)} == {"meta"}


@pytest.mark.cpu
@pytest.mark.fa4
def test_mask_function_values():
    """What fa4_mask returns for each pattern transformers builds."""
    none_cases = [mu.causal_mask_function, mu.bidirectional_mask_function, mu.sliding_window_causal_mask_function(4),
                  mu.sliding_window_bidirectional_mask_function(4), None]
    for fn in none_cases:
        assert integ.fa4_mask(2, 8, 8, mask_function=fn) is None
        assert integ.fa4_mask(2, 8, 8, mask_function=fn, attention_mask=torch.ones(2, 8, dtype=torch.bool)) is None
    padded = torch.ones(2, 10, dtype=torch.bool)
    padded[1, :4] = False
    got = integ.fa4_mask(2, 8, 8, mask_function=mu.sliding_window_causal_mask_function(4), attention_mask=padded)
    assert torch.equal(got.mask, padded[:, -8:])  # sliced to the keys from the right, as transformers' flash mask
    cfg = LlamaConfig(**BASE)
    cfg._attn_implementation = "fa4"
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    packed = mu.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, 8, 64), attention_mask=None, cache=None,
                                   position_ids=pos)
    assert isinstance(packed, integ.PackedSequences) and packed.shape == (1, 8)
    cu, mx = packed.varlen()
    assert torch.equal(cu, torch.tensor([0, 3, 5, 8], dtype=torch.int32)) and mx == 3
    assert packed.varlen()[0] is cu  # computed once, kept for every layer
    plain = mu.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, 8, 64), attention_mask=None, cache=None,
                                  position_ids=torch.arange(8)[None])
    assert plain is None
    with pytest.raises(ValueError, match=r"^name: 'fa4_flash' contains 'flash'"):
        integ.register_fa4_attention("fa4_flash")


# ----------------------------------------------------------------------------------- cpu: no data, once per forward
def _every_pattern(b=2, s=8, device="cpu"):
    ids = torch.zeros(b, s, dtype=torch.long, device=device)
    psm = torch.zeros(b, s, dtype=torch.long, device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
                          mu.packed_sequence_mask_function(psm))
    unmapped = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(psm))  # transformers 5.17
    return [(mu.causal_mask_function, None), (mu.sliding_window_causal_mask_function(3), None), (packed, None),
            (unmapped, None),
            (mu.bidirectional_mask_function, ids.bool()), (mu.causal_mask_function, ids.bool())]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("where", ["fake", "meta"])
def test_mask_function_reads_no_values(where):
    """Under FakeTensorMode any read of a value (bool(), .item(), nonzero) raises; on meta
    tensors it fails. fa4_mask returns for every pattern there, the padding mask as is and the
    packed pattern as PackedSequences whose boundaries take the fixed-shape form."""
    from torch._subclasses import FakeTensorMode

    device = "meta" if where == "meta" else "cpu"
    with (FakeTensorMode() if where == "fake" else torch.device("meta")):
        results = [integ.fa4_mask(2, 8, 8, mask_function=fn, attention_mask=m)
                   for fn, m in _every_pattern(device=device)]
        assert results[0] is None and results[1] is None
        assert isinstance(results[2], integ.PackedSequences)
        cu, mx = results[2].varlen()
        assert cu.shape == (17,) and mx == 8  # every token may start a sequence; the row length bounds them
        assert isinstance(results[3], integ.PackedSequences) and results[3].varlen()[0].shape == (17,)
        assert results[4].shape == (2, 8) and results[5].dtype == torch.bool


@pytest.mark.cpu
@pytest.mark.fa4
def test_whole_model_on_fake_meta_tensors_with_real_fa4(monkeypatch):
    """A Llama under FakeTensorMode on meta: fa4's real functions (validation, fake kernels) take
    every path -- transformers' always-packed pattern while tracing, a padding mask, position_ids
    of a batch of one, cu_seq_lens kwargs -- and no value is read."""
    from torch._subclasses import FakeTensorMode

    calls = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        real = getattr(integ, name)
        monkeypatch.setattr(integ, name, lambda *a, _real=real, _name=name, **kw: calls.append((_name, kw)) or
                            _real(*a, **kw))
    cfg = LlamaConfig(**{**BASE, "hidden_size": 256, "head_dim": 64, "vocab_size": 128})
    cfg._attn_implementation = "fa4"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        cu = torch.zeros(4, dtype=torch.int32, device="meta")
        runs = [dict(input_ids=ids, use_cache=False), dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                dict(input_ids=ids[:1], position_ids=torch.arange(16, device="meta")[None] % 5),
                dict(input_ids=ids[:1], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)]
        for run in runs:
            assert model(**run).logits.shape == (run["input_ids"].shape[0], 16, 128)
    cu_shapes = [tuple(kw["cu_seqlens_q"].shape) for _, kw in calls[::2]]
    assert cu_shapes == [(33,), (5,), (17,), (4,)]  # packed (fixed shape), padded (2B + 1), position_ids, kwargs
    assert all(name == "flash_attn_varlen_func" for name, _ in calls)


@pytest.mark.cpu
@pytest.mark.fa4
def test_data_is_read_once_per_forward_not_per_layer(ref_fa4, monkeypatch):
    """Boundaries come from one place per model forward: a PackedSequences computes them on first
    use, the position_ids check is remembered for the same tensor; the padded path reads
    nothing."""
    seen = []
    real = integ._varlen_from_starts
    monkeypatch.setattr(integ, "_varlen_from_starts", lambda *a: seen.append(1) or real(*a))
    model = build("llama")
    _, ids, pos = packed_row()
    for use_cache in (False, True):  # PackedSequences; then the position_ids rule
        seen.clear()
        logits(model, "fa4", input_ids=ids, position_ids=pos, use_cache=use_cache)
        assert len(seen) == 1
    seen.clear()
    logits(model, "fa4", input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])  # checked once: not packed
    assert seen == [] and integ._LAST_POSITIONS[0][2] is None
    nonzero = []
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: nonzero.append(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0
    logits(model, "fa4", input_ids=ids[:, :9].expand(2, 9), attention_mask=mask)
    assert nonzero == [] and ref_fa4.kinds()[-1] == "varlen"


@pytest.mark.cpu
@pytest.mark.fa4
def test_compiled_model_matches_eager(ref_fa4):
    """torch.compile (dynamo, eager backend) on real CPU tensors: opening the sliding-window and
    packed masks and reading boundaries are graph breaks, and the results stay exact."""
    model = build("mistral")
    parts, ids, pos = packed_row()
    ids2 = torch.randint(0, BASE["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0
    runs = {"plain": dict(input_ids=ids2), "padded": dict(input_ids=ids2, attention_mask=mask),
            "packed": dict(input_ids=ids, position_ids=pos, use_cache=False),
            "packed, cache": dict(input_ids=ids, position_ids=pos)}
    model.set_attn_implementation("fa4")
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="eager")
    try:
        for name, run in runs.items():
            with torch.no_grad():
                got = compiled(**run)
            want = per_document(model, parts) if "packed" in name else logits(model, "eager", **run)
            model.set_attn_implementation("fa4")
            valid = run.get("attention_mask", torch.ones(got.shape[:2])).bool()
            close(got[valid], want[valid], f"compiled {name}")
    finally:
        torch._dynamo.reset()
    assert {"dense", "varlen"} == set(ref_fa4.kinds())


@pytest.mark.cpu
@pytest.mark.fa4
def test_padded_llama_compiles_fullgraph_on_meta():
    """A causal model given an attention_mask: mask function and padded path trace with no graph
    break (fullgraph=True), through fa4's real functions and fake kernels."""
    cfg = LlamaConfig(**{**BASE, "hidden_size": 256, "head_dim": 64, "vocab_size": 128})
    cfg._attn_implementation = "fa4"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False).logits,
                           fullgraph=True, backend="eager")
        assert fn(ids, torch.ones_like(ids)).shape == (2, 16, 128)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------- gpu tier
def _gpu_inputs(case, vocab, s=384):
    g = torch.Generator(device="cuda").manual_seed(7)
    if case == "packed":
        docs = (100, 37, 200, 47)
        ids = torch.randint(0, vocab, (1, sum(docs)), device="cuda", generator=g)
        pos = torch.cat([torch.arange(n, device="cuda") for n in docs])[None]
        return dict(input_ids=ids, position_ids=pos, use_cache=False), torch.ones_like(ids, dtype=torch.bool)
    ids = torch.randint(0, vocab, (2, s), device="cuda", generator=g)
    if case == "plain":
        return dict(input_ids=ids), torch.ones_like(ids, dtype=torch.bool)
    mask = torch.ones_like(ids)
    mask[0, :50] = 0  # left padding
    mask[1, -70:] = 0  # right padding
    return dict(input_ids=ids, attention_mask=mask), mask.bool()


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", ["plain", "padded", "packed"])
def test_llama_on_gpu_matches_sdpa(case):
    from stage0_reference.torch_reference import assert_fa4_close

    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).cuda().eval()  # fp32 eager: the reference
    base = copy.deepcopy(ref).to(torch.bfloat16)                # bf16 sdpa: the baseline
    ours = copy.deepcopy(base)                                  # bf16 fa4
    inputs, valid = _gpu_inputs(case, cfg.vocab_size)
    out = {}
    for name, model, impl in (("ref", ref, "eager"), ("base", base, "sdpa"), ("ours", ours, "fa4")):
        out[name] = logits(model, impl, **inputs).float()[valid]
    err, bound = assert_fa4_close(f"{case} logits", out["ours"], out["ref"], out["base"])
    print(f"\n{case}: fa4 max err {err:.3e} <= FA4 bound {bound:.3e}")


GPU_BASE = dict(vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128)
GPU_CONFIGS = {  # sliding windows shorter than the 384-token rows, so the window masks something
    "mistral": lambda: MistralConfig(**GPU_BASE, sliding_window=128),
    "gemma2": lambda: Gemma2Config(**GPU_BASE, sliding_window=128, query_pre_attn_scalar=128,
                                   attn_logit_softcapping=50.0),
    # every expert on every token: a top-k that bf16 rounding can flip would make the router's
    # gradient discontinuous, which says nothing about attention
    "gpt_oss": lambda: GptOssConfig(**GPU_BASE, num_local_experts=2, num_experts_per_tok=2, sliding_window=128),
}


def _gpu_models(kind):
    """fp32 eager (the reference), bf16 eager (the baseline), bf16 fa4 -- the same weights."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(GPU_CONFIGS[kind]()).cuda().eval()
    base = copy.deepcopy(ref).to(torch.bfloat16)
    return ref, base, copy.deepcopy(base)


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", ["plain", "padded", "packed"])
@pytest.mark.parametrize("kind", list(GPU_CONFIGS))
def test_windowed_softcap_sink_models_on_gpu_match_eager(kind, case):
    """Mistral (sliding window), Gemma 2 (sliding + global layers, softcap) and gpt-oss (sliding +
    global, learnable sinks), tiny and random, on the H200: logits under FA4's rule against fp32
    eager, with bf16 eager as the baseline. Packed rows: the truth is each document run alone."""
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _gpu_models(kind)
    inputs, valid = _gpu_inputs(case, GPU_BASE["vocab_size"])
    if case == "packed":
        docs = (100, 37, 200, 47)
        parts = torch.split(inputs["input_ids"][0], docs)
        alone = lambda m, impl: torch.cat([logits(m, impl, input_ids=p[None], use_cache=False)  # noqa: E731
                                           for p in parts], dim=1).float()
        truth, baseline = alone(ref, "eager"), alone(base, "eager")
        got = logits(ours, "fa4", **inputs).float()
    else:
        truth = logits(ref, "eager", **inputs).float()[valid]
        baseline = logits(base, "eager", **inputs).float()[valid]
        got = logits(ours, "fa4", **inputs).float()[valid]
    err, bound = assert_fa4_close(f"{kind} {case} logits", got, truth, baseline)
    print(f"\n{kind} {case}: fa4 max err {err:.3e} <= FA4 bound {bound:.3e}")


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", list(GPU_CONFIGS))
def test_models_train_on_gpu_like_eager(kind):
    """Gradients and three AdamW steps: each parameter's step-0 gradient (relative error, norm) and
    each step's loss within 2x bf16 eager's distance from fp32 eager, plus a small floor."""
    models = dict(zip(("ref", "base", "ours"), _gpu_models(kind)))
    impls = {"ref": "eager", "base": "eager", "ours": "fa4"}
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, GPU_BASE["vocab_size"], (2, 384), device="cuda", generator=g)
    losses, grads = {n: [] for n in models}, {}
    for name, model in models.items():
        model.train()
        model.set_attn_implementation(impls[name])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 0:
                grads[name] = {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    for step, (r, b, o) in enumerate(zip(losses["ref"], losses["base"], losses["ours"])):
        assert abs(o - r) <= 2 * abs(b - r) + 2e-3, f"{kind} step {step}: loss {o} vs fp32 {r} (bf16 eager {b})"
    for k, gr in grads["ref"].items():
        norm = gr.norm().item() or 1.0
        e_ours = (grads["ours"][k] - gr).norm().item() / norm
        e_base = (grads["base"][k] - gr).norm().item() / norm
        assert e_ours <= 2 * e_base + 1e-3, f"{kind} {k}: gradient error {e_ours:.3e} vs bf16 eager {e_base:.3e}"


def _decode_models(kind):
    """_gpu_models' three for a kind of GPU_CONFIGS or "llama" (GPU_BASE as is)."""
    if kind != "llama":
        return _gpu_models(kind)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**GPU_BASE)).cuda().eval()
    base = copy.deepcopy(ref).to(torch.bfloat16)
    return ref, base, copy.deepcopy(base)


def _left_padded_batch(seed):
    """(prompt ids (3, 300), their mask: rows left-padded by 0 / 37 / 250, 5 new ids a row) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, GPU_BASE["vocab_size"], (3, 300), device="cuda", generator=g)
    new_ids = torch.randint(0, GPU_BASE["vocab_size"], (3, 5), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    mask[2, :250] = 0
    return ids, mask, new_ids


def _decode_logits(model, impl, ids, mask, new_ids):
    """Teacher-forced decoding: a prefill with the cache, then one step per column of new_ids (the mask
    grown by one valid key a step) -> the steps' logits (B, steps, vocab) fp32."""
    model.set_attn_implementation(impl)
    steps = []
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        for t in range(new_ids.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=new_ids[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps, dim=1)


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", ["llama"] + list(GPU_CONFIGS))
def test_left_padded_decode_steps_on_gpu_read_the_cache_in_place(kind, monkeypatch):
    """Decode steps of a left-padded batch: every layer's step is one flash_attn_with_kvcache call on the
    cache transformers holds (cache_leftpad from the mask: no gather of the keys), and the steps' logits
    are within FA4's rule of fp32 eager, with bf16 eager as the baseline; windows, softcap and sinks
    included (the 300-token prefill takes the general padded path)."""
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _decode_models(kind)
    ids, mask, new_ids = _left_padded_batch(seed=11)
    calls = []
    real = integ.flash_attn_with_kvcache
    monkeypatch.setattr(integ, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = _decode_logits(ours, "fa4", ids, mask, new_ids)
    layers = GPU_BASE["num_hidden_layers"]
    assert len(calls) == new_ids.shape[1] * layers
    for i, c in enumerate(calls):  # step i // layers: 301 + i // layers mask columns; a sliding cache its last keys
        cols, keys = 301 + i // layers, int(c["cache_seqlens"][0])
        assert c["cache_leftpad"].tolist() == [max(p - (cols - keys), 0) for p in (0, 37, 250)], (i, keys)
    truth, baseline = (_decode_logits(m, "eager", ids, mask, new_ids) for m in (ref, base))
    err, bound = assert_fa4_close(f"{kind} left-padded decode logits", got, truth, baseline)
    print(f"\n{kind} left-padded decode: fa4 max err {err:.3e} <= FA4 bound {bound:.3e}")


def _static_decode_logits(model, impl, ids, mask, new_ids, compile_with=None):
    """Teacher-forced decoding over a StaticCache, as generate() runs it: an eager prefill, then per step
    the mask built eagerly (create_masks_for_generate) and the forward, compiled with `compile_with`
    (torch.compile's keyword arguments, fullgraph) when given -> the steps' logits (B, steps, vocab) fp32."""
    from transformers import StaticCache
    from transformers.masking_utils import create_masks_for_generate

    model.set_attn_implementation(impl)
    b, s = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=s + new_ids.shape[1] + 5)
    forward = model.forward if compile_with is None else torch.compile(model.forward, fullgraph=True, **compile_with)
    steps = []

    def positions(mask):  # generate()'s: each row's tokens count from 0 (its padding: 1)
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)

    given = not bool(mask.all())  # generate() drops an all-ones mask

    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask if given else None, past_key_values=cache,
              position_ids=positions(mask), cache_position=torch.arange(s, device="cuda"))
        for t in range(new_ids.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            # positional: the cache's keyword is past_key_values before transformers 5.2x, cache after
            step_mask = create_masks_for_generate(model.config, torch.empty(b, 1, 0, dtype=model.dtype, device="cuda"),
                                                  mask if given else None, cache)
            # past_key_values: transformers 5.17's name for the cache (5.2x's `cache` takes it as an alias)
            out = forward(input_ids=new_ids[:, t:t + 1], attention_mask=step_mask, past_key_values=cache,
                          position_ids=positions(mask)[:, -1:].contiguous(),
                          cache_position=torch.tensor([s + t], device="cuda"))
            steps.append(out.logits[:, -1].float().clone())  # a CUDA graph's output is overwritten by its next replay
    return torch.stack(steps, dim=1)


# compiled graphs a static cache's decode steps take: Gemma 2's sliding cache layers keep their length as a
# Python int, which transformers' is_full test makes dynamo specialize on the first step (one recompile);
# llama-unpadded: a batch with no padding (no mask), whose steps read the filled slots
GRAPHS = {"llama": 1, "gemma2": 2, "llama-unpadded": 1}


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("kind", list(GRAPHS))
def test_compiled_static_cache_decode_on_gpu_reads_the_cache_in_place(kind):
    """A left-padded batch's decode steps over a StaticCache, compiled as generate() compiles them (the
    step's mask built eagerly, the forward through inductor, fullgraph; then with CUDA graphs,
    mode="reduce-overhead"): the graphs hold fa4's in-place decode op and no varlen (gathering) op, one
    graph (GRAPHS) serves every step as the mask grows, and the logits are within FA4's rule of fp32 eager.
    Gemma 2: sliding layers (a 128-key window, padding inside it throughout) and softcap."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx
    from stage0_reference.torch_reference import assert_fa4_close

    ref, base, ours = _decode_models(kind.split("-")[0])
    ids, mask, new_ids = _left_padded_batch(seed=13)
    if kind.endswith("unpadded"):
        mask = torch.ones_like(mask)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm.code)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    try:
        compiled = _static_decode_logits(ours, "fa4", ids, mask, new_ids, dict(backend=inductor))
        assert len(graphs) == GRAPHS[kind], f"{len(graphs)} graphs for {new_ids.shape[1]} steps"
        assert all("kvcache_attention" in g and "varlen" not in g for g in graphs)
        torch._dynamo.reset()
        counters.clear()
        graphed = _static_decode_logits(ours, "fa4", ids, mask, new_ids, dict(mode="reduce-overhead"))
        assert counters["stats"]["unique_graphs"] == GRAPHS[kind], dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    truth, baseline = (_static_decode_logits(m, "eager", ids, mask, new_ids) for m in (ref, base))
    for what, got in (("compiled", compiled), ("CUDA graphs", graphed)):
        err, bound = assert_fa4_close(f"{kind} {what} static-cache decode logits", got, truth, baseline)
        print(f"\n{kind} {what} static-cache decode: fa4 max err {err:.3e} <= FA4 bound {bound:.3e}")
