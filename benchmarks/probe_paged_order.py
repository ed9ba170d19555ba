# One-off probe (removed after its run; kept in git history): paged decode with pages in order (the dense
# cache viewed as pages, table = arange) against shuffled pages (bench_paged.build_paged) and the dense
# cache; fa4.flash_attn_with_kvcache, bf16, GQA 32 / 8, d = 128, one token, CUDA graphs of 20 calls,
# 9 paired rounds. Run from the repository root: python benchmarks/probe_paged_order.py
import json, os, random, statistics
import torch
import fa4
from benchmarks import bench_paged as bp
from benchmarks.ab_fwd import paired_rounds
from benchmarks.bench_decode import _graphed, CALLS_PER_GRAPH

rng = random.Random(1)
res = []
for (B, S) in ((8, 32768), (1, 131072), (1, 16384)):
    g = torch.Generator(device="cuda").manual_seed(B + S)
    k = torch.randn(B, S, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for page in (16, 64, 128):
        t = bp.decode_inputs(B, S, page, k, v, g)
        # pages in order: the dense cache itself viewed as pages, sequence b on pages b*P .. b*P + P-1
        P = S // page
        t["k_ord"] = k.view(B * P, page, 8, 128)
        t["v_ord"] = v.view(B * P, page, 8, 128)
        t["tab_ord"] = torch.arange(B * P, device="cuda", dtype=torch.int32).view(B, P)
        peers = {
            "dense": lambda: fa4.flash_attn_with_kvcache(t["q"], t["k"], t["v"], cache_seqlens=t["seqlens"]),
            "paged_shuffled": lambda: fa4.flash_attn_with_kvcache(t["q"], t["k_pages"], t["v_pages"],
                                                                  cache_seqlens=t["seqlens"], block_table=t["table"]),
            "paged_in_order": lambda: fa4.flash_attn_with_kvcache(t["q"], t["k_ord"], t["v_ord"],
                                                                  cache_seqlens=t["seqlens"], block_table=t["tab_ord"]),
        }
        graphs = {}
        with torch.no_grad():
            for name, fn in peers.items():
                graphs[name] = _graphed(fn)
            ref = graphs["dense"][1].float()
            for name, (gr, out) in graphs.items():
                assert (out.float() - ref).abs().max() < 2e-2, name
            times = paired_rounds({n: gr.replay for n, (gr, _) in graphs.items()}, 9, rng)
        byts = 2 * B * S * 8 * 128 * 2
        row = {n: byts / (statistics.median(ts) / CALLS_PER_GRAPH * 1e-3) / 1e9 for n, ts in times.items()}
        print(f"{B}x{S} page {page}: " + " | ".join(f"{n} {x:.0f}" for n, x in row.items()), flush=True)
        res.append({"batch": B, "cache": S, "page": page, "gb_per_s": row,
                    "ms_rounds": {n: [x / CALLS_PER_GRAPH for x in ts] for n, ts in times.items()}})
        graphs.clear(); del t; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "paged_order_diag_h200.json"), "w"), indent=1)
