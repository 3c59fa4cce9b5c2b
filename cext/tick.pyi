"""Type stubs for the compiled scheduler tick (cext/tick.pyx)."""
import numpy as np

class TickState:
    max_num_seqs: int
    max_model_len: int
    block_size: int
    max_blocks_per_seq: int
    tokens: np.ndarray  # [max_num_seqs, max_model_len] int32
    num_tokens: np.ndarray  # [max_num_seqs] int32
    num_computed: np.ndarray  # [max_num_seqs] int32
    num_prompt_tokens: np.ndarray  # [max_num_seqs] int32
    next_logprob_pos: np.ndarray  # [max_num_seqs] int32
    block_tables: np.ndarray  # [max_num_seqs, max_blocks_per_seq] int32
    num_blocks: np.ndarray  # [max_num_seqs] int32
    epochs: np.ndarray  # [max_num_seqs] int64
    num_entries: int
    num_batch_tokens: int
    entry_slots: np.ndarray
    entry_num_new: np.ndarray
    entry_num_new_blocks: np.ndarray
    sample_entries: np.ndarray
    sample_logit_idx: np.ndarray
    span_entries: np.ndarray
    span_firsts: np.ndarray
    span_counts: np.ndarray
    span_positions: np.ndarray
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None: ...
    def plan(
        self, running: np.ndarray, num_running: int, budget: int, max_prefill_tokens: int, max_chunk: int
    ) -> tuple[int, int, int]: ...
    def top_up(self, first: int, last: int, left: int) -> int: ...
    def grow(self, block_ids: np.ndarray) -> int: ...
    def add_entry(self, slot: int, num_new: int) -> int: ...
    def build(self) -> tuple[np.ndarray, int, int, int, int, int]: ...
    def commit(
        self,
        slots: np.ndarray,
        num_new: np.ndarray,
        epochs: np.ndarray,
        sample_entries: np.ndarray,
        sampled_ids: np.ndarray,
    ) -> int: ...
