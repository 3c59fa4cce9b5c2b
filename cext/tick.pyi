"""Type stubs for the compiled scheduler tick (cext/tick.pyx)."""
import enum

import numpy as np

class FinishCode(enum.IntEnum):
    FINISH_NONE = 0  # keeps running (stop strings are the text's business)
    FINISH_STOP_ID = 1  # its new id is one of its stop ids, past min_tokens
    FINISH_LENGTH = 2  # max_tokens generated, or max_model_len reached
    FINISH_UNKNOWN = 3  # more stop ids than the slot's table holds: the caller decides

class TickPlan:
    num_decodes: int  # entries 0..num_decodes-1 run one token each
    prefill_tokens_left: int  # prefill budget the running chunks left over
    num_new_blocks: int  # blocks the entries need beyond those they hold

class BatchLayout:
    """One tick's model inputs; every array is an int64 view of ``flat``."""
    flat: np.ndarray
    num_seqs: int  # B
    num_tokens: int  # T
    width: int  # W
    num_logit_rows: int
    num_samples: int
    num_spans: int
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_starts: np.ndarray  # [B+1]
    context_lens: np.ndarray  # [B]
    prompt_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, W]
    logit_rows: np.ndarray  # [num_logit_rows]

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
    max_generated: np.ndarray  # [max_num_seqs] int32
    min_generated: np.ndarray  # [max_num_seqs] int32
    stop_ids: np.ndarray  # [max_num_seqs, 8] int32
    num_stop_ids: np.ndarray  # [max_num_seqs] int32, -1: more than the table holds
    finish_codes: np.ndarray  # [max_num_seqs] int8, FinishCode per entry of decode_commit
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None: ...
    def plan(
        self, running: np.ndarray, num_running: int, budget: int, max_prefill_tokens: int, max_chunk: int
    ) -> TickPlan: ...
    def top_up(self, first: int, last: int, left: int) -> int: ...
    def grow(self, block_ids: np.ndarray) -> int: ...
    def add_entry(self, slot: int, num_new: int) -> int: ...
    def build(self) -> BatchLayout: ...
    def commit(
        self,
        slots: np.ndarray,
        num_new: np.ndarray,
        epochs: np.ndarray,
        sample_entries: np.ndarray,
        sampled_ids: np.ndarray,
    ) -> int: ...
    def set_finish_rule(self, slot: int, max_tokens: int, min_tokens: int, stop_ids) -> int: ...
    def decode_plan(self, running: np.ndarray, num_running: int) -> int: ...
    def decode_build(self) -> BatchLayout: ...
    def decode_commit(self, sampled_ids: np.ndarray) -> int: ...  # entries whose verdict ends them
