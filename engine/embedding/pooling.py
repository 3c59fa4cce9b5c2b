"""Pooling: a sequence's hidden rows -> one vector, as sentence-transformers' Pooling and
llama.cpp's ``--pooling`` define them; then Matryoshka truncation and L2 normalisation."""

from __future__ import annotations

import numpy as np
import torch

from ..config import POOLINGS
from ..errors import InvalidParameterError


def check_pooling(pooling, param: str = "pooling") -> str:
    if pooling not in POOLINGS:
        raise InvalidParameterError(f"{param} must be one of {', '.join(POOLINGS)}, got {pooling!r}", param)
    return pooling


def pooled_rows(pooling: str, starts: list[int]) -> list[int] | None:
    """The rows a pooling reads (None: all of them), so a decoder's head runs on no more."""
    if pooling == "cls":
        return starts[:-1]
    if pooling == "last":
        return [end - 1 for end in starts[1:]]
    return None


def pool(hidden: torch.Tensor, starts: list[int], pooling: str) -> torch.Tensor:
    """hidden [T, E] (all rows, or only those ``pooled_rows`` names) -> [B, E] float32."""
    hidden = hidden.float()
    if pooling in ("cls", "last"):
        if hidden.shape[0] == len(starts) - 1:  # already the pooled rows
            return hidden
        index = pooled_rows(pooling, starts)
        return hidden.index_select(0, torch.tensor(index, dtype=torch.int64))
    lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.int64)
    if pooling == "mean":
        seq_of_row = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
        sums = torch.zeros((len(lens), hidden.shape[1]), dtype=torch.float32).index_add_(
            0, seq_of_row, hidden
        )
        return sums / lens[:, None].to(torch.float32)
    return torch.stack([hidden[a:b].amax(0) for a, b in zip(starts, starts[1:])])  # max


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """[N, D] -> [N, dimensions or D] float32: truncated first, then (if asked) L2-normalised."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors /= np.maximum(norms, 1e-12)  # torch.nn.functional.normalize's eps
    return vectors


def check_dimensions(dimensions, size: int, param: str = "dimensions") -> int | None:
    if dimensions is None:
        return None
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= size:
        raise InvalidParameterError(
            f"{param} must be an integer in 1..{size} (the model's embedding size), got {dimensions!r}", param
        )
    return dimensions
