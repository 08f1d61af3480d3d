"""Every notebook under notebooks/ runs top to bottom in a fresh kernel without a cell raising.

Under -m slow: each notebook starts a kernel that imports and compiles afresh (20-50 s apiece on
two cores), and what they show runs by default elsewhere (the README example, the plan and
collectives tests, tests/models/training/test_train.py and test_train_cli.py)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()  # raises CellExecutionError on the first cell that raises
