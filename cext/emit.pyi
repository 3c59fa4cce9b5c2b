"""Type stubs for the compiled output loop of a steady-state decode tick (cext/emit.pyx)."""
from collections.abc import Callable
from typing import Any

import numpy as np

def emit_rows(
    reqs: list[Any],
    token_ids: list[int],
    codes: np.ndarray,
    event_type: Callable[..., Any],
    end_row: Callable[[int, str | None, str | None], None],
    fail_row: Callable[[int, BaseException], None],
) -> int: ...
