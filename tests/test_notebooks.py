"""Every teaching notebook runs top to bottom on a CPU, and is what its builder writes."""

import importlib.util
from pathlib import Path

import pytest



@pytest.fixture(scope="module")
def nbformat():
    # skipped per test, not at collection: `pytest -m gpu` (the GPU lane) then deselects this module cleanly
    return pytest.importorskip("nbformat")


@pytest.fixture(scope="module")
def nbclient():
    return pytest.importorskip("nbclient")


NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


def test_notebooks_are_the_builders_output(nbformat):
    """The builder writes the parity tolerances into the notebooks' asserts: a notebook that
    differs from its builder holds stale bounds (or a hand edit the next build would lose)."""
    spec = importlib.util.spec_from_file_location("_build_notebooks", NOTEBOOK_DIR / "build_notebooks.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    built = builder.build()
    assert sorted(built) == [p.stem for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        committed = nbformat.read(path, as_version=4)
        assert [(c.cell_type, c.source) for c in committed.cells] == \
            [(c.cell_type, c.source) for c in built[path.stem].cells], \
            f"{path.name} is stale: run `.venv/bin/python notebooks/build_notebooks.py`"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, nbformat, nbclient):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
