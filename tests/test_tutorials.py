"""Tutorials: each jupytext .py is in sync with its .ipynb, and every notebook executes on CPU.

A notebook that stops running, or drifts from its .py twin, fails CI instead of rotting.
"""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))

pytestmark = [pytest.mark.cpu, pytest.mark.tutorials]


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_every_notebook_has_its_jupytext_twin():
    pys = sorted(p.with_suffix(".ipynb") for p in TUTORIALS.glob("[0-9][0-9]_*.py"))
    assert pys == NOTEBOOKS and NOTEBOOKS, f".py {pys} vs .ipynb {NOTEBOOKS}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_pair_in_sync(notebook):
    jupytext = pytest.importorskip("jupytext")
    import nbformat

    from_py = jupytext.read(notebook.with_suffix(".py"))
    stored = nbformat.read(notebook, as_version=4)
    assert _cells(from_py) == _cells(stored), (
        f"{notebook.name} differs from its .py: run `jupytext --sync tutorials/{notebook.stem}.py`")
    assert all(not c.get("outputs") for c in stored.cells if c.cell_type == "code"), (
        f"{notebook.name}: commit notebooks without outputs (jupyter nbconvert --clear-output)")


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(notebook, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError naming the failing cell
