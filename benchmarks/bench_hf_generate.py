"""Greedy generation from a left-padded batch through transformers: ms per new token, fa4 against torch SDPA.

    python -m benchmarks.bench_hf_generate [--batch 8] [--prompt 4096] [--new 64] [--layers 4] [--rounds 3]
                                           [--fresh-lengths] [--peers fa4,fa4_plans] [--cache static]
                                           [--out benchmarks/results/bench_hf_generate_h100.json]

A Llama of random weights (hidden 4096, 32 query / 8 KV heads of 128, `--layers` layers, bf16, a
DynamicCache: the cache grows every step) generates `--new` tokens greedily from `--batch` prompts of
`--prompt` tokens, row b left-padded by a random 0 to prompt / 2 tokens. Peers, as attn_implementation:

* fa4: the decode steps read the cache in place (flash_attn_with_kvcache with cache_leftpad), without
  launch plans, since the cache grows every step (the integration's `_cache_grew`);
* fa4_plans: the same with launch plans (`_cache_grew` False). Every round generates from the same
  prompts, so its cache lengths repeat: its rounds replay the plans the warm-up recorded (as a server
  does once its requests have passed every cache length: plans stay on disk). With `--fresh-lengths`,
  round r drops the prompts' first (r + 1) (new + 1) columns, so no decode step of a round has the
  cache length of another round's or the warm-up's, and fa4_plans records a plan a step, as a first
  generation over new lengths does. The plans each peer recorded and replayed are reported per round
  (a plan directory that already holds these lengths, from an earlier run, shows as replays), with the
  garbage collector's time in each round's generate(new + 1);
* fa4_gathered: the same with that path closed (`_split_launch_takes` False): every step gathers the
  cache's valid keys and values into a packed copy (what right padding gets);
* sdpa: torch SDPA with transformers' own mask.

`--cache static` runs generate(cache_implementation="static") instead: a StaticCache, whose decode steps
transformers compiles (torch.compile, mode "reduce-overhead": CUDA graphs) after an eager prefill,
building each step's mask eagerly first. Peers: fa4 (compiled; its steps read the cache in place through
fa4_mask's LeftPadding), fa4_eager (the same cache, generate(disable_compile=True)) and sdpa (compiled).
The first generate() of each peer compiles (the warm-up); the largest cache comes first, so later calls
reuse it and its compiled graph.

ms per new token = (time of generate(new + 1 tokens) - time of generate(1 token)) / new, so the prefill
cancels; CUDA-synchronized wall clock, host time included (eager with the default dynamic cache: no CUDA
graphs, what a plain generate() loop does), in paired rounds (every round times every peer once, in a
fresh random order).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import sys
import time

import torch

from .bench_fwd import write_doc
from .inspect.host_overhead import plans_setting


def _model(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()


def model_and_prompts(layers: int, batch: int, prompt: int):
    """(the model, prompt ids (batch, prompt), attention mask (batch, prompt)) with fa4 registered in
    transformers: row b left-padded by a random 0 to prompt / 2 tokens (a fixed seed)."""
    from fa4.integrations import transformers as integ

    integ.register_fa4_attention()
    model = _model(layers)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, 32000, (batch, prompt), device="cuda", generator=g)
    pad = torch.randint(0, prompt // 2 + 1, (batch,), device="cuda", generator=g)
    mask = (torch.arange(prompt, device="cuda")[None, :] >= pad[:, None]).long()
    return model, ids, mask


def add_model_arguments(ap, new: int) -> None:
    """The model and prompt options this benchmark and benchmarks.inspect.profile_generate share."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=new)
    ap.add_argument("--layers", type=int, default=4)


def model_shapes(args) -> str:
    """The results file's description of the model and prompts the options chose."""
    return (f"Llama hidden 4096, {args.layers} layers, GQA 32/8, d=128, bf16, batch {args.batch}, "
            f"prompt {args.prompt} left-padded by 0..{args.prompt // 2}, {args.new} new tokens")


def check_counts(ap, args, *names) -> None:
    """argparse error unless the model options and each of `names` (dests) are >= 1."""
    for name in ("batch", "prompt", "new", "layers") + names:
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected >= 1, got {getattr(args, name)}")


@contextlib.contextmanager
def collector_time():
    """Yields [ms spent in Python's garbage collector, collections], filled in while the block runs."""
    spent, starts = [0.0, 0], []

    def hook(phase, info):
        if phase == "start":
            starts.append(time.perf_counter())
        elif starts:
            spent[0] += 1e3 * (time.perf_counter() - starts.pop())
            spent[1] += 1

    gc.callbacks.append(hook)
    try:
        yield spent
    finally:
        gc.callbacks.remove(hook)


def generate_s(model, impl, ids, mask, tokens, **generate_kw) -> float:
    """Seconds of one greedy generate() of `tokens` new tokens through attn_implementation `impl`."""
    model.set_attn_implementation(impl)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0, **generate_kw)
    torch.cuda.synchronize()
    return time.perf_counter() - start


PEERS = ("fa4", "fa4_plans", "fa4_gathered", "sdpa")
STATIC_PEERS = ("fa4", "fa4_eager", "sdpa")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap, new=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh-lengths", action="store_true",
                    help="round r drops the prompts' first (r + 1) (new + 1) columns: no round repeats another's "
                         "cache lengths")
    ap.add_argument("--peers", default=None,
                    help=f"a comma list from {', '.join(PEERS)} ({', '.join(STATIC_PEERS)} with --cache static); "
                         "fa4 (the ratios' base) always runs; default: all")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                    help="static: a StaticCache, whose decode steps transformers compiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    check_counts(ap, args, "rounds")
    offered = STATIC_PEERS if args.cache == "static" else PEERS
    chosen = [p.strip() for p in (args.peers or ",".join(offered)).split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(offered))
    if unknown:
        ap.error(f"--peers: unknown {', '.join(unknown)} with --cache {args.cache}; choose from {', '.join(offered)}")
    if args.fresh_lengths and args.prompt <= args.rounds * (args.new + 1):
        ap.error(f"--fresh-lengths: --prompt ({args.prompt}) must exceed --rounds x (--new + 1) "
                 f"({args.rounds * (args.new + 1)})")
    if not torch.cuda.is_available():
        print("bench_hf_generate needs a CUDA GPU")
        return 2
    from fa4.integrations import transformers as integ

    model, ids, mask = model_and_prompts(args.layers, args.batch, args.prompt)
    takes, grew = integ._split_launch_takes, integ._cache_grew
    static = dict(cache_implementation="static") if args.cache == "static" else {}
    peers = {"fa4": ("fa4", takes, grew, static), "fa4_plans": ("fa4", takes, lambda module, keys: False, {}),
             "fa4_gathered": ("fa4", lambda *a: False, grew, {}), "sdpa": ("sdpa", takes, grew, static),
             "fa4_eager": ("fa4", takes, grew, dict(static, disable_compile=True))}
    peers = {name: peers[name] for name in offered if name == "fa4" or name in chosen}

    from fa4 import _plans

    def per_token(name, drop=0):
        impl, integ._split_launch_takes, integ._cache_grew, generate_kw = peers[name]
        before = _plans.stats()
        try:
            with plans_setting("1"):
                with collector_time() as collector:
                    long_s = generate_s(model, impl, ids[:, drop:], mask[:, drop:], args.new + 1, **generate_kw)
                short_s = generate_s(model, impl, ids[:, drop:], mask[:, drop:], 1, **generate_kw)
                ms = 1e3 * (long_s - short_s) / args.new
        finally:
            integ._split_launch_takes, integ._cache_grew = takes, grew
        after = _plans.stats()
        used = {k: after.get(k, 0) - before.get(k, 0) for k in ("recorded", "replays")}
        return ms, used, {"ms": round(collector[0], 3), "collections": collector[1]}

    for name in peers:  # warm-up: compiles (kernels; a static cache's decode graph), allocator, launch plans
        print(f"warm-up: {name}", flush=True)
        per_token(name)
    rng = random.Random(0)
    times, plan_use, collected = ({n: [] for n in peers} for _ in range(3))
    for r in range(args.rounds):
        for name in rng.sample(list(peers), len(peers)):
            ms, used, gc_spent = per_token(name, (r + 1) * (args.new + 1) if args.fresh_lengths else 0)
            times[name].append(ms)
            plan_use[name].append(used)
            collected[name].append(gc_spent)
    rows = [{"peer": n, "ms_per_token": statistics.median(ts), "rounds_ms": ts, "rounds_plans": plan_use[n],
             "rounds_gc": collected[n],
             "over_fa4": statistics.median(t / f for t, f in zip(ts, times["fa4"]))} for n, ts in times.items()]
    for r in rows:
        recorded = sum(u["recorded"] for u in r["rounds_plans"])
        replays = sum(u["replays"] for u in r["rounds_plans"])
        gc_ms = sum(g["ms"] for g in r["rounds_gc"])
        print(f"{r['peer']:13} {r['ms_per_token']:8.2f} ms / token  ({r['over_fa4']:.2f}x fa4's)  "
              f"plans over the rounds: {recorded} recorded, {replays} replayed; garbage collector "
              f"{gc_ms:.1f} ms in the generate(new + 1) calls", flush=True)

    plan_files = sorted(_plans.plan_dir("sm_90a").glob("*.json")) if torch.cuda.get_device_capability()[0] == 9 else []
    plans = dict(_plans.stats(), on_disk=len(plan_files), limit=_plans.max_on_disk())
    print(f"fa4 launch plans: {plans}")
    if args.out:
        write_doc(args.out, "benchmarks.bench_hf_generate", argv, rows,
                  shapes=model_shapes(args) + (", a StaticCache (compiled decode steps)" if static else ""),
                  method=f"{'' if static else 'eager '}generate(), (t(new + 1) - t(1)) / new, "
                         f"{args.rounds} paired rounds"
                         + (", round r without the prompts' first (r + 1) (new + 1) columns" if args.fresh_lengths
                            else ""),
                  plans=plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
