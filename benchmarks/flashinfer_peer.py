"""FlashInfer's paged decode as a peer of `benchmarks.bench_paged` (flashinfer-python, where it imports).

    python -m benchmarks.flashinfer_peer --check    # build both kernels, check them against fp32 (GPU)

FlashInfer (https://github.com/flashinfer-ai/flashinfer) serves decode steps over a paged cache through
`BatchDecodeWithPagedKVCacheWrapper`: `plan()` on the host once per batch layout (it sizes the KV
splits and copies the page indices into buffers fixed at construction), then `run()` per step,
which a CUDA graph can capture. Its pages are (num_pages, page_size, heads_kv, d) with kv_layout
"NHD", the layout bench_paged builds; its block table is in CSR form (indptr, indices, the last
page's length), built here from bench_paged's (batch, pages) table.

Two variants are timed, each its own peer:

* flashinfer_cc: `use_tensor_cores=False`, its CUDA-core decode kernel (one query token only);
* flashinfer_tc: `use_tensor_cores=True`, its prefill-class kernel run as decode (its docs call it
  faster for large GQA groups; its only path for several query tokens, `q_len_per_req`).

Both use the wrapper's CUDA-graph mode (`use_cuda_graph=True`, the mode a server captures) and
`backend="auto"`; the backend each resolved to is recorded (`step.backend`). The kernels are
JIT-compiled by flashinfer with nvcc at the first `plan()` / `run()`, so the first point pays the build.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

WORKSPACE_BYTES = 128 << 20      # FlashInfer's usual float workspace (split-KV partial results)
VARIANTS = {"flashinfer_cc": {"use_tensor_cores": False}, "flashinfer_tc": {"use_tensor_cores": True}}
CHECK_TOLERANCE = 2e-2           # max |out - fp32 reference| of the --check cases (bf16 outputs)


def load():
    """The flashinfer module, or None (with the reason on stderr) where it does not import."""
    try:
        import flashinfer
    except Exception as exc:   # not installed, or its import fails on this machine
        print(f"flashinfer: not available ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None
    return flashinfer


def version(flashinfer) -> str:
    return getattr(flashinfer, "__version__", "unknown")


def csr_pages(table: torch.Tensor, cache: int, page_size: int):
    """(indptr, indices, last_page_len) int32 for sequences that all hold `cache` keys, from a
    (batch, pages) block table: the first ceil(cache / page_size) entries of every row."""
    if cache < 1:
        raise ValueError(f"cache: FlashInfer's page table needs at least one key, got {cache}")
    batch = table.shape[0]
    pages = math.ceil(cache / page_size)
    if pages > table.shape[1]:
        raise ValueError(f"table: {table.shape[1]} pages a row, {cache} keys need {pages}")
    indptr = torch.arange(batch + 1, device=table.device, dtype=torch.int32) * pages
    indices = table[:, :pages].reshape(-1).to(torch.int32).contiguous()
    last = torch.full((batch,), cache - (pages - 1) * page_size, device=table.device, dtype=torch.int32)
    return indptr, indices, last


def _planned_run(flashinfer, inputs: dict, cache: int, page_size: int, window, tensor_cores: bool):
    """A step function that builds and plans its wrapper at the first call (outside any capture)
    and then only runs; returns (batch, query_len, heads_q, d) like fa4. After the first call,
    step.backend is the backend the wrapper resolved to."""
    q, k_pages, v_pages = inputs["q"], inputs["k_pages"], inputs["v_pages"]
    batch, query_len, heads_q, dim = q.shape
    q_rows = q.reshape(batch * query_len, heads_q, dim)   # (B Sq, Hq, D): FlashInfer's rows
    state = {}
    inputs.setdefault("keep_alive", []).append(state)   # a captured graph reads the wrapper's buffers

    def step():
        if "wrapper" not in state:
            indptr, indices, last = csr_pages(inputs["table"], cache, page_size)
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)  # zeroed: its docs
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=torch.empty_like(indptr), paged_kv_indices_buffer=torch.empty_like(indices),
                paged_kv_last_page_len_buffer=torch.empty_like(last))
            extra = {} if query_len == 1 else {"q_len_per_req": query_len}
            wrapper.plan(indptr, indices, last, heads_q, k_pages.shape[2], dim, page_size,
                         window_left=-1 if window is None else window, q_data_type=q.dtype,
                         kv_data_type=k_pages.dtype, **extra)
            state.update(wrapper=wrapper, workspace=workspace)
            step.backend = getattr(wrapper, "resolved_backend", None)
        out = state["wrapper"].run(q_rows, (k_pages, v_pages))
        return out.view(batch, query_len, heads_q, out.shape[-1])

    step.backend = None
    return step


def decode_peers(flashinfer, inputs: dict, cache: int, page_size: int, query_len: int, window) -> dict:
    """name -> step function for every variant that serves this call (the CUDA-core kernel takes
    one query token)."""
    return {name: _planned_run(flashinfer, inputs, cache, page_size, window, kw["use_tensor_cores"])
            for name, kw in VARIANTS.items() if kw["use_tensor_cores"] or query_len == 1}


def check(batch: int = 2, cache: int = 1000, page_size: int = 16, heads=(32, 8), dim: int = 128) -> int:
    """Build both variants on shuffled pages (bench_paged.build_paged), run them for one and four
    causal query tokens, and compare with the fp32 reference; prints one line per case. Returns the
    number of cases past CHECK_TOLERANCE or failing."""
    from stage0_reference.torch_reference import attention_ref

    from .bench_paged import build_paged

    flashinfer = load()
    if flashinfer is None:
        return 1
    print(f"flashinfer {version(flashinfer)}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(batch, cache, heads[1], dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    k_pages, v_pages, table = build_paged(k, v, [cache] * batch, page_size, g)
    bad = 0
    for query_len in (1, 4):
        q = torch.randn(batch, query_len, heads[0], dim, device="cuda", dtype=torch.bfloat16, generator=g)
        inputs = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "table": table}
        ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=query_len > 1)   # fp32, bottom-right
        for name, step in decode_peers(flashinfer, inputs, cache, page_size, query_len, None).items():
            start = time.time()
            try:
                err = (step().float() - ref).abs().max().item()
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"{name}, {query_len} token(s): failed ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
                bad += 1
                continue
            bad += not err <= CHECK_TOLERANCE
            print(f"{name}, {query_len} token(s): max |out - fp32| {err:.2e} (tolerance {CHECK_TOLERANCE}), "
                  f"backend {step.backend}, first call {time.time() - start:.0f} s", flush=True)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="build FlashInfer's decode kernels and check them (GPU)")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 0
    if not torch.cuda.is_available():
        print("flashinfer_peer --check needs a CUDA GPU", file=sys.stderr)
        return 2
    return 1 if check() else 0


if __name__ == "__main__":
    sys.exit(main())
