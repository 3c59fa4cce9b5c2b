"""examples/quickstart.ipynb runs headless in a real Jupyter kernel (nbclient), inside the
kernel's own event loop: load, a streamed chat reply in one updating output, a batch with a
progress bar, a logprobs table, the async API with a cancelled request. Bounded: each cell
has a timeout (examples/run_notebook.py). The committed notebook carries its outputs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
EXECUTED = REPO / ".cache" / "notebooks" / "quickstart.ipynb"
sys.path.insert(0, str(REPO / "examples"))

from run_notebook import execute_notebook  # noqa: E402


def cell_text(cell) -> str:
    """Everything a code cell shows, as one string (stream text and every mime bundle)."""
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append(output["text"])
        for value in output.get("data", {}).values():
            parts.append(value if isinstance(value, str) else json.dumps(value))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def executed():
    return execute_notebook(NOTEBOOK, EXECUTED)


@pytest.mark.slow
def test_quickstart_runs_and_shows_what_it_says(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    load, stream, batch, logprobs, async_chat, async_cancel, close = (cell_text(c) for c in code)
    assert "<table>" in load and "KV usage" in load and "SmolLM2-135M-Instruct" in load
    [update] = [o for o in code[1].outputs if o.output_type == "display_data"]  # one output, updated in place
    assert len(update["data"]["text/markdown"]) > 20
    widget = "application/vnd.jupyter.widget-view+json"
    assert any(widget in o.get("data", {}) for o in code[2].outputs)  # the progress bar is a widget
    assert batch.count("->") == 4 and "finish_reason" in batch
    assert "<th>logprob</th>" in logprobs and logprobs.count("<tr>") == 6
    assert async_chat.strip()
    assert "cancelled" in async_cancel and "'num_running': 0" in async_cancel and "'kv_usage': 0.0" in async_cancel
    assert "closed" in close


def test_committed_notebook_carries_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None and c.outputs for c in code)
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
