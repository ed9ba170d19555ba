"""benchmarks.bench_variants on CPU: its markdown table, and the stage 3 README's copy of it."""
import json
import pathlib

import pytest

from benchmarks import bench_variants

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = [ROOT / "benchmarks" / "results" / f"variants_{n}_0c3e279_h200.json" for n in ("4k", "8k", "16k")]

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


def _row(case, d, direction, ratio):
    return {"case": case, "head_dim": d, "direction": direction, "seqlen": 4096, "ratio_median": ratio}


def test_table_joins_the_files_in_order_and_marks_missing_points():
    first = {"results": [_row("causal", 128, "fwd", 1.104), _row("causal", 128, "bwd", 0.951),
                         _row("softcap30", 128, "fwd", 2.0), {"case": "window1024_cost", "head_dim": 128}]}
    second = {"results": [_row("causal", 128, "fwd", 1.066), _row("causal", 64, "bwd", 0.98)]}
    second["results"][0]["seqlen"] = 16384
    lines = bench_variants.markdown_table([first, second]).splitlines()
    assert lines[0] == ("| case (4k / 16k) | d = 128 forward | d = 128 backward | d = 64 forward | d = 64 backward |")
    assert lines[2] == "| causal (no variant) | 1.10 / 1.07x | 0.95 / -x | - | - / 0.98x |"
    assert lines[3].startswith("| softcap 30, not causal | 2.00 / -x | - |")
    assert len(lines) == 4 and len({line.count("|") for line in lines}) == 1


def test_stage3_readme_holds_the_table_of_the_committed_results(capsys):
    assert bench_variants.main(["--table", *map(str, RESULTS)]) == 0
    table = capsys.readouterr().out.strip()
    readme = (ROOT / "stage3_fwd_kernel" / "README.md").read_text()
    block = readme.split("<!-- variants:start -->", 1)[1].split("<!-- variants:end -->", 1)[0]
    assert table in block, "run: python -m benchmarks.bench_variants --table " + " ".join(p.name for p in RESULTS)
    docs = [json.loads(p.read_text()) for p in RESULTS]
    assert [d["results"][0]["seqlen"] for d in docs] == [4096, 8192, 16384]


@pytest.mark.parametrize("seqlen, window", [(16384, 1024), (4096, 1024), (2000, 37), (8, 100)])
def test_window_pair_shares_count_the_pairs_row_by_row(seqlen, window):
    """Row i of causal + (window, 0) sees keys [max(i - window, 0), i]: min(i, window) + 1 pairs."""
    pairs = sum(min(i, window) + 1 for i in range(seqlen))
    shares = bench_variants.window_pair_shares(seqlen, window)
    assert shares["causal"] == pytest.approx(pairs / (seqlen * (seqlen + 1) // 2), rel=1e-12)
    assert shares["full"] == pytest.approx(pairs / seqlen ** 2, rel=1e-12)


def test_stage3_readme_quotes_the_window_shares_and_the_committed_runs_against_them():
    """The stage 3 README's window paragraph: the (1024, 0) window's shares of the pairs at 16k, and the committed
    runs' time over the causal time as a multiple of the causal share (its "1.33-1.48x")."""
    shares = bench_variants.window_pair_shares(16384, 1024)
    doc = json.loads((ROOT / "benchmarks" / "results" / "variants_window_cost_0c3e279_h200.json").read_text())
    over = [row["window_over_causal"] / shares["causal"] for row in doc["results"]]
    readme = (ROOT / "stage3_fwd_kernel" / "README.md").read_text()
    quoted = (f"{shares['full']:.4f} of the\nnon-causal call's and {shares['causal']:.4f} of the causal call's",
              f"{min(over):.2f}-{max(over):.2f}x the\npairs' share")
    for text in quoted:
        assert " ".join(text.split()) in " ".join(readme.split()), text
