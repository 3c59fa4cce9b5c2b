"""Type stubs for the compiled n-gram index (cext/ngram.pyx)."""
import numpy as np

class NgramIndex:
    """One sequence's incremental n-gram index; ``propose`` returns at most k ids."""
    k: int
    ngram_min: int
    ngram_max: int
    num_ids: int
    num_indexed: int
    num_entries: int
    def __init__(self, k: int, ngram_min: int = ..., ngram_max: int = ...) -> None: ...
    def propose(self, tokens: np.ndarray) -> list[int]: ...
