# The scheduler tick: per-slot sequence state in numpy arrays and the batch builder.
cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t


# decode_commit's verdict per entry (TickState.finish_codes). Python: cext.tick.FinishCode.
cpdef enum FinishCode:
    FINISH_NONE = 0      # keeps running (as far as ids and lengths tell: stop strings are the text's)
    FINISH_STOP_ID = 1   # its new id is one of its stop ids, past min_tokens
    FINISH_LENGTH = 2    # max_tokens generated, or max_model_len reached
    FINISH_UNKNOWN = 3   # more stop ids than the slot's table holds: the caller decides

cdef enum:
    MAX_STOP_IDS = 8     # stop ids a slot's finish rule holds


# What TickState.plan decided for the running sequences.
@cython.final
cdef class TickPlan:
    cdef readonly int num_decodes            # entries 0..num_decodes-1 run one token each
    cdef readonly int prefill_tokens_left    # prefill budget the running chunks left over
    cdef readonly int num_new_blocks         # blocks the entries need beyond those they hold


# The model inputs of one tick, written back to back into one int64 array by TickState.build;
# every array attribute is a view of `flat` (B = num_seqs, T = num_tokens, W = width).
@cython.final
cdef class BatchLayout:
    cdef readonly object flat                # [3T + (B+1) + 2B + B*W + T] int64 (logit rows: room for T)
    cdef readonly int num_seqs               # B
    cdef readonly int num_tokens             # T
    cdef readonly int width                  # W, block table columns
    cdef readonly int num_logit_rows
    cdef readonly int num_samples            # sequences sampled: the first entries of sample_entries
    cdef readonly int num_spans              # prompt logprob spans: the first entries of span_*
    cdef readonly object input_ids           # [T]
    cdef readonly object positions           # [T]
    cdef readonly object slot_mapping        # [T]
    cdef readonly object query_starts        # [B+1]
    cdef readonly object context_lens        # [B]
    cdef readonly object prompt_lens         # [B]
    cdef readonly object block_tables        # [B, W], -1 padded
    cdef readonly object logit_rows          # [num_logit_rows]


@cython.final
cdef class TickState:
    cdef readonly int max_num_seqs
    cdef readonly int max_model_len
    cdef readonly int block_size
    cdef readonly int max_blocks_per_seq

    # Per-slot state, as numpy arrays for Python and typed memoryviews for the loops.
    cdef readonly object tokens              # [max_num_seqs, max_model_len] int32
    cdef readonly object num_tokens          # [max_num_seqs] int32
    cdef readonly object num_computed        # [max_num_seqs] int32
    cdef readonly object num_prompt_tokens   # [max_num_seqs] int32
    cdef readonly object next_logprob_pos    # [max_num_seqs] int32, -1: no prompt logprobs wanted
    cdef readonly object block_tables        # [max_num_seqs, max_blocks_per_seq] int32, -1 padded
    cdef readonly object num_blocks          # [max_num_seqs] int32
    cdef readonly object epochs              # [max_num_seqs] int64, bumped on every bind
    cdef int32_t[:, ::1] _tokens
    cdef int32_t[::1] _num_tokens
    cdef int32_t[::1] _num_computed
    cdef int32_t[::1] _num_prompt_tokens
    cdef int32_t[::1] _next_logprob_pos
    cdef int32_t[:, ::1] _block_tables
    cdef int32_t[::1] _num_blocks
    cdef int64_t[::1] _epochs

    # The batch being planned: entry i runs num_new[i] tokens of slot slots[i].
    cdef readonly int num_entries
    cdef readonly int num_batch_tokens
    cdef readonly object entry_slots         # [max_num_seqs] int32
    cdef readonly object entry_num_new       # [max_num_seqs] int32
    cdef readonly object entry_num_new_blocks  # [max_num_seqs] int32
    cdef int32_t[::1] _entry_slots
    cdef int32_t[::1] _entry_num_new
    cdef int32_t[::1] _entry_num_new_blocks

    # Build results (valid until the next build).
    cdef readonly object sample_entries      # [max_num_seqs] int32, entry index of each sampled seq
    cdef readonly object sample_logit_idx    # [max_num_seqs] int32, its row in forward()'s logits
    cdef readonly object span_entries        # [max_num_seqs] int32, prompt logprob spans
    cdef readonly object span_firsts         # [max_num_seqs] int32
    cdef readonly object span_counts         # [max_num_seqs] int32
    cdef readonly object span_positions      # [max_num_seqs] int32
    cdef int32_t[::1] _sample_entries
    cdef int32_t[::1] _sample_logit_idx
    cdef int32_t[::1] _span_entries
    cdef int32_t[::1] _span_firsts
    cdef int32_t[::1] _span_counts
    cdef int32_t[::1] _span_positions

    # Finish rules per slot (set_finish_rule), read by decode_commit.
    cdef readonly object max_generated       # [max_num_seqs] int32, max_tokens
    cdef readonly object min_generated       # [max_num_seqs] int32, min_tokens (stop ids end only past it)
    cdef readonly object stop_ids            # [max_num_seqs, MAX_STOP_IDS] int32
    cdef readonly object num_stop_ids        # [max_num_seqs] int32
    cdef int32_t[::1] _max_generated
    cdef int32_t[::1] _min_generated
    cdef int32_t[:, ::1] _stop_ids
    cdef int32_t[::1] _num_stop_ids

    # The decode-only steady state: one layout reused while the batch size and width stay.
    cdef BatchLayout _decode_layout
    cdef readonly object finish_codes        # [max_num_seqs] int8, FINISH_* per entry of decode_commit
    cdef int8_t[::1] _finish_codes

    cpdef TickPlan plan(self, const int32_t[::1] running, int num_running, int budget, int max_prefill_tokens,
                     int max_chunk)
    cpdef int top_up(self, int first, int last, int left) except -1
    cpdef int grow(self, const int32_t[::1] block_ids) except -1
    cpdef int add_entry(self, int slot, int num_new) except -1
    cpdef BatchLayout build(self)
    cpdef int commit(self, const int32_t[::1] slots, const int32_t[::1] num_new, const int64_t[::1] epochs,
                     const int32_t[::1] sample_entries, const int64_t[::1] sampled_ids) except -1
    cpdef int set_finish_rule(self, int slot, int max_tokens, int min_tokens, stop_ids) except -1
    cpdef int decode_plan(self, const int32_t[::1] running, int num_running) except -2
    cpdef BatchLayout decode_build(self)
    cdef BatchLayout _new_layout(self, int B, int width)
    cpdef int decode_commit(self, const int64_t[::1] sampled_ids) except -1
    cdef inline int _blocks_for(self, int num_tokens) noexcept nogil
