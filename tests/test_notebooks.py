"""The notebooks run top to bottom (their own asserts check what they show): executed with
nbclient in a fresh kernel, as a reader would run them."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_found():
    assert [p.name for p in NOTEBOOKS] == ["01_batch_invariance.ipynb", "02_on_policy_rl.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_stored_outputs_are_this_numerics_version(path):
    """A reader sees the stored outputs: they must come from the bits this tree computes
    (``python notebooks/execute.py`` refreshes them after a change of bits)."""
    from bijax import NUMERICS_VERSION

    ran_at = nbformat.read(path, as_version=4).metadata.get("bijax", {}).get("numerics_version")
    assert ran_at == NUMERICS_VERSION, (
        f"{path.name}: outputs from NUMERICS_VERSION {ran_at}; run notebooks/execute.py"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "display_data" for o in outputs)  # the plot was drawn
