"""``engine.detokenizer.IncrementalDetokenizer``: the public path (README, "Python API") of
engine/text/detokenizer.py, where the implementation lives."""
from .text.detokenizer import IncrementalDetokenizer, TokenPieces

__all__ = ["IncrementalDetokenizer", "TokenPieces"]
