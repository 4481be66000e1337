"""The example notebook executes top to bottom, so it never rots."""

import nbformat
from nbclient import NotebookClient

from tests.conftest import REPO


def test_compose_phases_notebook_runs():
    nb = nbformat.read(REPO / "examples" / "notebooks" / "compose_phases.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()
    last = nb.cells[-1].outputs[-1]
    assert "step_20" in str(last.get("data", {}).get("text/plain", ""))
