"""Project-level guarantees: the layering rule, a README per stage, and the demo CLI."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["stage0_reference", "stage1_online_softmax", "stage2_emulated_exp", "stage3_fwd_kernel",
         "stage4_bwd_kernel", "stage5_scheduling", "fa4"]


def _imported_packages(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


@pytest.mark.cpu
@pytest.mark.stage0
@pytest.mark.parametrize("package", ORDER[:-1])
def test_stage_imports_only_earlier_stages(package):
    """Stage N may import stages < N only; fa4 composes them all (DESIGN.md, layering rule)."""
    allowed = set(ORDER[: ORDER.index(package)])
    bad = []
    for path in (ROOT / package).rglob("*.py"):
        for mod in _imported_packages(path):
            if mod in ORDER and mod != package and mod not in allowed:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "layering violated:\n" + "\n".join(bad)


@pytest.mark.cpu
@pytest.mark.stage0
@pytest.mark.parametrize("package", ORDER)
def test_every_package_has_a_readme(package):
    readme = ROOT / package / "README.md"
    assert readme.is_file() and len(readme.read_text().split()) > 30, f"{readme} missing or empty"


@pytest.mark.cpu
@pytest.mark.fa4
def test_demo_cli_reports_every_check_passing():
    res = subprocess.run([sys.executable, "-m", "fa4", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout and res.stdout.count("PASS") >= 3
    assert "classic FlashAttention" in res.stdout


@pytest.mark.cpu
@pytest.mark.fa4
def test_info_cli_names_versions():
    res = subprocess.run([sys.executable, "-m", "fa4", "info"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "torch" in res.stdout and "nvidia-cutlass-dsl" in res.stdout
