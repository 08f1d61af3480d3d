"""Every notebook under notebooks/ runs top to bottom in a fresh kernel without a cell raising.

The training notebook runs under -m slow: its 120 optimizer steps are run time, not compile time,
and the train steps it shows are covered by tests/models/test_train.py and test_train_cli.py."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


SLOW = {"02_training.ipynb"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
        for p in NOTEBOOKS
    ],
)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()  # raises CellExecutionError on the first cell that raises
