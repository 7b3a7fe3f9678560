"""Every shipped notebook runs top to bottom, headless, without a cell error.

The kernel is a fresh `python3` process; it inherits this environment, and PYTHONPATH is
extended so that it imports the very qwencuda that the tests import (a source checkout, a
private dev build or an installed wheel alike)."""
import os

import pytest

import qwencuda

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.join(os.path.dirname(HERE), "notebooks")
NAMES = ["01_quickstart.ipynb", "02_debugging.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, monkeypatch, tmp_path):
    path = os.path.join(NOTEBOOKS, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not written yet")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(qwencuda.__file__)))
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", package_root + (os.pathsep + old if old else ""))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},   # run where scratch files may land
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{name}: a cell failed:\n{exc}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
