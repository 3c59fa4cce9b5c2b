"""Execute a notebook headless with nbclient, from the repo root, and write the executed copy.

    python examples/run_notebook.py examples/quickstart.ipynb [OUT]   # OUT defaults to in place

`make notebook` refreshes the committed outputs of examples/quickstart.ipynb this way;
tests/test_notebook.py runs the same function into .cache/ and checks what it shows.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 600  # seconds per cell: the model load on a busy machine


def execute_notebook(path: str | Path, out_path: str | Path | None = None, cell_timeout: int = CELL_TIMEOUT):
    """Run every cell in a fresh python3 kernel (cwd: the repo root); raise on a cell's error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}})
    client.execute()
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_path)
    return nb


if __name__ == "__main__":
    source = sys.argv[1]
    execute_notebook(source, sys.argv[2] if len(sys.argv) > 2 else source)
