"""Committed benchmark results: the README tables are generated from them and stay in sync."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ladder  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


@pytest.mark.parametrize("block", ladder.BLOCKS, ids=lambda b: f"{b[0].parent.name}:{b[1]}")
def test_readme_tables_are_generated_from_the_json(block):
    path, start, end, render = block
    text = path.read_text()
    assert start in text and end in text, f"{path}: markers {start} / {end} missing"
    current = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert current == render().strip(), "run: python benchmarks/ladder.py --write"


def test_forward_results_record_device_versions_commit_and_agree_with_the_official_kernel():
    for path in sorted(ladder.RESULTS.glob("fwd_h100*.json")):
        doc = json.loads(path.read_text())
        assert doc["device"].startswith("NVIDIA H100") and doc["git_commit"] not in ("", "unknown")
        assert doc["versions"]["nvidia-cutlass-dsl"] == "4.8.1" and doc["versions"]["flash-attn-4"]
        diffs = [r["max_abs_diff_vs_fa4"] for r in doc["results"] if "max_abs_diff_vs_fa4" in r]
        assert diffs and max(diffs) < 0.02, f"{path.name}: an implementation disagrees with the official FA4"


def test_backward_ablations_each_cut_exactly_one_piece_of_step3(tmp_path):
    """benchmarks/ablate_bwd.py's text substitutions still match step 3's source, once each,
    and every variant is valid Python with its own STEP name (no compile-cache collision)."""
    import ast

    import ablate_bwd

    steps = ablate_bwd.write_variants(str(tmp_path))
    assert set(steps) == {f"ablate_{n}" for n in ablate_bwd.ABLATIONS}
    original = pathlib.Path(ablate_bwd.SOURCE).read_text()
    for step, module in steps.items():
        text = (tmp_path / f"{module}.py").read_text()
        ast.parse(text)
        assert f'STEP = "{step}"' in text and text != original
