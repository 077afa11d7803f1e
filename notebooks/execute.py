"""Runs the notebooks top to bottom in a fresh kernel and saves them with their outputs, so a
reader sees what this tree computes (run after notebooks/make_0*.py, and after any change of
bits: ``python notebooks/execute.py``). The notebook's metadata records the NUMERICS_VERSION it
ran at; tests/test_notebooks.py fails when that is not the current one (stale outputs)."""

from __future__ import annotations

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def execute(path: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bijax import NUMERICS_VERSION

    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    nb.metadata["bijax"] = {"numerics_version": NUMERICS_VERSION}
    nbformat.write(nb, path)
    print(f"{path.name}: executed at NUMERICS_VERSION {NUMERICS_VERSION}")


if __name__ == "__main__":
    for p in sys.argv[1:] or sorted((ROOT / "notebooks").glob("*.ipynb")):
        execute(pathlib.Path(p))
