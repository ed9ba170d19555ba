"""The committed device results of stage 2, rendered for the README, the notebook and the CLI.

The numbers live in the package, in stage2_emulated_exp/data/stage2_exp2_*_h100.json, so an
installed wheel has them too. They were written on an H100 by
`python -m stage2_emulated_exp.device_main --out DIR` (copy the three JSON files from DIR into
data/). Nothing here is typed by hand: regenerate the README section with
`python -m stage2_emulated_exp.results`.
"""
from __future__ import annotations

import json
from importlib.resources import files

DATA = files(__package__) / "data"
THROUGHPUT = DATA / "stage2_exp2_throughput_h100.json"
BITEXACT = DATA / "stage2_exp2_bitexact_h100.json"
ACCURACY = DATA / "stage2_exp2_accuracy_h100.json"


def load(path=THROUGHPUT) -> dict:
    """One results document (a path or an importlib.resources Traversable)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the package data of stage2_emulated_exp is missing "
                                "(regenerate it on a GPU with device_main)")
    return json.loads(path.read_text())


def throughput_rows(doc: dict | None = None) -> list[dict]:
    """One row per variant: name, emulated fraction, degree, measured and modelled rate."""
    doc = load(THROUGHPUT) if doc is None else doc
    rows = []
    for r in doc["results"]:
        rows.append({"name": r["name"], "fraction": r["fraction"], "degree": r["degree"],
                     "measured": r["median_per_clk_per_sm"], "model": r["model_per_clk_per_sm"]})
    return rows


def best_mix(doc: dict | None = None) -> dict:
    rows = [r for r in throughput_rows(doc) if r["fraction"] is not None and r["degree"] == 3]
    return max(rows, key=lambda r: r["measured"])


def throughput_table(doc: dict | None = None) -> str:
    doc = load(THROUGHPUT) if doc is None else doc
    rows = throughput_rows(doc)
    mufu = next(r["measured"] for r in rows if r["fraction"] == 0.0)
    lines = [f"exp2 results per clock per SM on {doc['device']} (softmax FFMA + FADD included; "
             f"cutlass-dsl {doc['cutlass_dsl']}, torch {doc['torch']})", "",
             "| variant | emulated | degree | measured | issue model | vs MUFU only |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["fraction"] is None:
            continue  # the FMA-only reference row has no exp2 at all
        model = f"{r['model']:.1f}" if r["model"] is not None else "-"
        lines.append(f"| {r['name']} | {r['fraction']:.0%} | {r['degree']} | {r['measured']:.2f} | {model} | "
                     f"{r['measured'] / mufu:.2f}x |")
    return "\n".join(lines)


def bitexact_summary(doc: dict | None = None) -> str:
    doc = load(BITEXACT) if doc is None else doc
    total = sum(c["n"] for c in doc["configs"])
    bad = sum(c["mismatches"] for c in doc["configs"])
    configs = ", ".join(f"d{c['degree']}{'' if c['ftz'] else ' no-ftz'}{' (FA4 coeffs)' if c['coefficients'] != 'ours' else ''}"
                        for c in doc["configs"])
    return (f"{bad} mismatching results out of {total:,} ({len(doc['configs'])} configurations x "
            f"{doc['configs'][0]['n']:,} inputs: {configs}) on {doc['device']}")


if __name__ == "__main__":
    print(bitexact_summary())
    print()
    print(throughput_table())
    b = best_mix()
    print(f"\nbest degree-3 mix: {b['fraction']:.0%} emulated, {b['measured']:.2f} exp2/clk/SM")
