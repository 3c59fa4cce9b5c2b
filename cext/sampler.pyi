"""Type stubs for the compiled sampler kernel (cext/sampler.pyx)."""
from typing import Any

import numpy as np

class RandomStream:
    """torch.Generator's MT19937 stream and float64 uniforms, in C."""
    def __init__(self, seed: int) -> None: ...
    def random(self) -> float: ...
    def snapshot(self) -> RandomStream: ...
    def restore(self, snapshot: RandomStream, num_draws: int = ...) -> None: ...

def sample_rows(
    logits: np.ndarray, params: list[Any], streams: list[RandomStream | None], adjusters: list[Any] | None = ...,
    process_only: bool = ...,
) -> tuple[list[int], list[tuple[float, int, list[int], list[float]] | None]] | None: ...
def logprob_rows(
    logits: np.ndarray, target_ids: np.ndarray, num_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...

class TouchedIds:
    """One request's touched ids with bias, scale and sub per id; add() counts a generated id."""
    ids: np.ndarray  # [capacity] int64
    bias: np.ndarray  # [capacity] float32
    scale: np.ndarray  # [capacity] float32
    sub: np.ndarray  # [capacity] float32
    counts: np.ndarray  # [capacity] int32
    num_ids: int
    capacity: int
    def __init__(self, touched_ids: list[int], bias_values: list[float], seen_ids: set[int], capacity: int,
                 repetition_penalty: float, frequency_penalty: float, presence_penalty: float) -> None: ...
    def add(self, token_id: int) -> None: ...
