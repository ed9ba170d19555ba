# One-off probe (removed after its run; kept in git history): split counts of the paged decode step
# against the dense one, fa4.flash_attn_with_kvcache(num_splits=n), bf16, GQA 32 / 8, d = 128, one token,
# CUDA graphs of 20 calls, 7 paired rounds. Run from the repository root: python benchmarks/probe_paged_splits.py
import json, os, random, statistics
import torch
import fa4
from benchmarks import bench_paged as bp
from benchmarks.ab_fwd import paired_rounds
from benchmarks.bench_decode import _graphed, CALLS_PER_GRAPH

rng = random.Random(0)
res = []
for (B, S, splits) in ((8, 32768, (1, 2, 4)), (1, 131072, (8, 16, 32)), (1, 16384, (8, 16))):
    g = torch.Generator(device="cuda").manual_seed(B + S)
    k = torch.randn(B, S, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for page in (16, 64):
        t = bp.decode_inputs(B, S, page, k, v, g)
        peers = {}
        for n in splits:
            peers[f"paged_s{n}"] = (lambda n=n: fa4.flash_attn_with_kvcache(t["q"], t["k_pages"], t["v_pages"],
                                    cache_seqlens=t["seqlens"], block_table=t["table"], num_splits=n))
            if page == 16:
                peers[f"dense_s{n}"] = (lambda n=n: fa4.flash_attn_with_kvcache(t["q"], t["k"], t["v"],
                                        cache_seqlens=t["seqlens"], num_splits=n))
        graphs = {}
        with torch.no_grad():
            for name, fn in peers.items():
                graphs[name] = _graphed(fn)
            ref = graphs[f"paged_s{splits[0]}"][1].float()
            for name, (gr, out) in graphs.items():
                assert (out.float() - ref).abs().max() < 2e-2, name
            times = paired_rounds({n: gr.replay for n, (gr, _) in graphs.items()}, 7, rng)
        byts = 2 * B * S * 8 * 128 * 2
        row = {n: byts / (statistics.median(ts) / CALLS_PER_GRAPH * 1e-3) / 1e9 for n, ts in times.items()}
        print(f"{B}x{S} page {page}: " + " | ".join(f"{n} {x:.0f}" for n, x in row.items()), flush=True)
        res.append({"batch": B, "cache": S, "page": page, "gb_per_s": row,
                    "ms_rounds": {n: [x / CALLS_PER_GRAPH for x in ts] for n, ts in times.items()}})
        graphs.clear(); del t; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "paged_splits_sweep_h200.json"), "w"), indent=1)
