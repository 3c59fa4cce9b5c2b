"""The scheduler tick: plan which slots run how many tokens, build the flat batch, commit samples.

Sequences that run are bound to slots of a ``TickState``; their tokens, counters and block
tables live in numpy arrays the loops below read through typed memoryviews, so one tick
touches no per-sequence Python object. The policy (which sequences, how many tokens) is
``plan``: every running decode first (one token each), then prefill chunks of the running
sequences in admission order until the token budget is spent. The scheduler then admits
waiting sequences with ``add_entry``, hands what budget is left back to chunks cut short
(``top_up``) and calls ``build`` for the model's arrays.

The decode-only steady state (every running sequence has one token to compute, nothing
waits) has its own three calls, one per tick each: ``decode_plan`` (the same entries as
``plan``, or -1 when the state is not steady), ``decode_build`` (``build`` into one layout
reused across ticks) and ``decode_commit`` (``commit`` plus each entry's finish verdict from
its slot's rule: stop ids past min_tokens, max_tokens, max_model_len).

The loops keep the GIL: they last microseconds, and a release would hand it to a thread waiting
for it (the engine's output worker, a consumer), which the engine thread would then wait on.
"""
cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t

import numpy as np


@cython.final
cdef class TickPlan:
    """What ``TickState.plan`` decided: ``num_decodes`` (entries 0..num_decodes-1 run one token
    each), ``prefill_tokens_left`` (prefill budget the running chunks left over) and
    ``num_new_blocks`` (blocks the entries need beyond those they hold)."""

    def __repr__(self):
        return (f"TickPlan(num_decodes={self.num_decodes}, prefill_tokens_left={self.prefill_tokens_left}, "
                f"num_new_blocks={self.num_new_blocks})")


@cython.final
cdef class BatchLayout:
    """One tick's model inputs, laid out once here: back to back in the int64 array ``flat``,

        input_ids [T] | positions [T] | slot_mapping [T] | query_starts [B+1] | context_lens [B]
        | prompt_lens [B] | block_tables [B*W] | logit_rows [num_logit_rows]

    (B = num_seqs, T = num_tokens, W = width), each exposed as a named numpy view of ``flat``.
    ``num_samples`` / ``num_spans`` count the valid leading entries of the TickState's
    ``sample_*`` / ``span_*`` arrays. Valid until the next ``build``.
    """

    def __repr__(self):
        return (f"BatchLayout(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, width={self.width}, "
                f"num_logit_rows={self.num_logit_rows}, num_samples={self.num_samples}, num_spans={self.num_spans})")


@cython.final
cdef class TickState:
    def __init__(self, int max_num_seqs, int max_model_len, int block_size):
        if max_num_seqs < 1 or max_model_len < 1 or block_size < 1:
            raise ValueError("max_num_seqs, max_model_len and block_size must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.tokens = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.next_logprob_pos = np.full(max_num_seqs, -1, dtype=np.int32)
        self.block_tables = np.full((max_num_seqs, self.max_blocks_per_seq), -1, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self.epochs = np.zeros(max_num_seqs, dtype=np.int64)
        self._tokens = self.tokens
        self._num_tokens = self.num_tokens
        self._num_computed = self.num_computed
        self._num_prompt_tokens = self.num_prompt_tokens
        self._next_logprob_pos = self.next_logprob_pos
        self._block_tables = self.block_tables
        self._num_blocks = self.num_blocks
        self._epochs = self.epochs

        self.num_entries = 0
        self.num_batch_tokens = 0
        self.entry_slots = np.zeros(max_num_seqs, dtype=np.int32)
        self.entry_num_new = np.zeros(max_num_seqs, dtype=np.int32)
        self.entry_num_new_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self._entry_slots = self.entry_slots
        self._entry_num_new = self.entry_num_new
        self._entry_num_new_blocks = self.entry_num_new_blocks

        self.sample_entries = np.zeros(max_num_seqs, dtype=np.int32)
        self.sample_logit_idx = np.zeros(max_num_seqs, dtype=np.int32)
        self.span_entries = np.zeros(max_num_seqs, dtype=np.int32)
        self.span_firsts = np.zeros(max_num_seqs, dtype=np.int32)
        self.span_counts = np.zeros(max_num_seqs, dtype=np.int32)
        self.span_positions = np.zeros(max_num_seqs, dtype=np.int32)
        self._sample_entries = self.sample_entries
        self._sample_logit_idx = self.sample_logit_idx
        self._span_entries = self.span_entries
        self._span_firsts = self.span_firsts
        self._span_counts = self.span_counts
        self._span_positions = self.span_positions

        self.max_generated = np.zeros(max_num_seqs, dtype=np.int32)
        self.min_generated = np.zeros(max_num_seqs, dtype=np.int32)
        self.stop_ids = np.full((max_num_seqs, MAX_STOP_IDS), -1, dtype=np.int32)
        self.num_stop_ids = np.zeros(max_num_seqs, dtype=np.int32)
        self._max_generated = self.max_generated
        self._min_generated = self.min_generated
        self._stop_ids = self.stop_ids
        self._num_stop_ids = self.num_stop_ids
        self.finish_codes = np.zeros(max_num_seqs, dtype=np.int8)
        self._finish_codes = self.finish_codes
        self._decode_layout = None

    cdef inline int _blocks_for(self, int num_tokens) noexcept nogil:
        return (num_tokens + self.block_size - 1) // self.block_size

    cpdef TickPlan plan(self, const int32_t[::1] running, int num_running, int budget, int max_prefill_tokens,
                        int max_chunk):
        """Plan the running slots (admission order): decodes first, then prefill chunks.

        Decodes take one token each; prefill chunks share ``min(budget - num_decodes,
        max_prefill_tokens)`` tokens, at most ``max_chunk`` each. Returns a TickPlan.
        """
        cdef int i, s, rem, k, need, n = 0, num_decodes, left, total_need = 0, num_tokens = 0
        if num_running > self.max_num_seqs or num_running > running.shape[0]:
            raise ValueError("num_running exceeds the slots")
        for i in range(num_running):
            s = running[i]
            if self._num_tokens[s] - self._num_computed[s] == 1:
                need = self._blocks_for(self._num_tokens[s]) - self._num_blocks[s]
                if need < 0:
                    need = 0
                self._entry_slots[n] = s
                self._entry_num_new[n] = 1
                self._entry_num_new_blocks[n] = need
                total_need += need
                n += 1
        num_decodes = n
        num_tokens = n
        left = budget - n
        if left > max_prefill_tokens:
            left = max_prefill_tokens
        for i in range(num_running):
            if left <= 0:
                break
            s = running[i]
            rem = self._num_tokens[s] - self._num_computed[s]
            if rem > 1:
                k = rem if rem < left else left
                if k > max_chunk:
                    k = max_chunk
                need = self._blocks_for(self._num_computed[s] + k) - self._num_blocks[s]
                if need < 0:
                    need = 0
                self._entry_slots[n] = s
                self._entry_num_new[n] = k
                self._entry_num_new_blocks[n] = need
                total_need += need
                left -= k
                num_tokens += k
                n += 1
        self.num_entries = n
        self.num_batch_tokens = num_tokens
        cdef TickPlan result = TickPlan.__new__(TickPlan)
        result.num_decodes = num_decodes
        result.prefill_tokens_left = left
        result.num_new_blocks = total_need
        return result

    cpdef int top_up(self, int first, int last, int left) except -1:
        """Give ``left`` more tokens to entries first..last-1 (prefill chunks cut short), in order.

        Only for sequences whose blocks already cover all their tokens. Returns what is left.
        """
        cdef int i, s, rem, k
        for i in range(first, last):
            if left <= 0:
                break
            s = self._entry_slots[i]
            rem = self._num_tokens[s] - self._num_computed[s] - self._entry_num_new[i]
            if rem <= 0:
                continue
            if self._blocks_for(self._num_tokens[s]) > self._num_blocks[s]:
                raise ValueError(f"slot {s} lacks blocks for a top-up")
            k = rem if rem < left else left
            self._entry_num_new[i] += k
            self.num_batch_tokens += k
            left -= k
        return left

    cpdef int grow(self, const int32_t[::1] block_ids) except -1:
        """Append new blocks to the planned entries that need them, in entry order."""
        cdef int i, k, s, nb, j = 0, total = 0
        for i in range(self.num_entries):
            total += self._entry_num_new_blocks[i]
        if total != block_ids.shape[0]:
            raise ValueError(f"the plan needs {total} blocks, got {block_ids.shape[0]}")
        for i in range(self.num_entries):
            k = self._entry_num_new_blocks[i]
            if k == 0:
                continue
            s = self._entry_slots[i]
            nb = self._num_blocks[s]
            if nb + k > self.max_blocks_per_seq:
                raise ValueError(f"slot {s} would hold more than {self.max_blocks_per_seq} blocks")
            while k > 0:
                self._block_tables[s, nb] = block_ids[j]
                nb += 1
                j += 1
                k -= 1
            self._num_blocks[s] = nb
            self._entry_num_new_blocks[i] = 0
        return 0

    cpdef int add_entry(self, int slot, int num_new) except -1:
        """Append an entry (a newly admitted sequence's first chunk) to the plan."""
        cdef int n = self.num_entries
        if n >= self.max_num_seqs:
            raise ValueError("more entries than slots")
        if num_new < 1 or self._num_computed[slot] + num_new > self._num_tokens[slot]:
            raise ValueError(f"num_new={num_new} does not fit slot {slot}")
        self._entry_slots[n] = slot
        self._entry_num_new[n] = num_new
        self._entry_num_new_blocks[n] = 0
        self.num_entries = n + 1
        self.num_batch_tokens += num_new
        return 0

    cpdef BatchLayout build(self):
        """Write the planned entries' model inputs into one flat int64 array: a BatchLayout.

        Also fills ``sample_entries`` / ``sample_logit_idx`` (the sampled entries and their
        logit rows) and the ``span_*`` arrays (prompt logprob spans).
        """
        cdef int B = self.num_entries, T = self.num_batch_tokens
        cdef int i, j, s, n, c, ctx, nb, k, p, lo, hi, q, pos, t = 0, nl = 0, ns = 0, nsp = 0, width = 1
        cdef int bs = self.block_size
        for i in range(B):
            s = self._entry_slots[i]
            nb = self._blocks_for(self._num_computed[s] + self._entry_num_new[i])
            if nb > self._num_blocks[s]:
                raise RuntimeError(f"slot {s} needs {nb} blocks but holds {self._num_blocks[s]}")
            if nb > width:
                width = nb
        cdef int64_t o_pos = T, o_slot = 2 * T, o_qs = 3 * T
        cdef int64_t o_ctx = o_qs + B + 1, o_plen = o_ctx + B, o_bt = o_plen + B
        cdef int64_t o_logits = o_bt + <int64_t> B * width
        flat = np.empty(o_logits + T, dtype=np.int64)
        cdef int64_t[::1] out = flat
        for i in range(B):
            s = self._entry_slots[i]
            n = self._entry_num_new[i]
            c = self._num_computed[s]
            out[o_qs + i] = t
            for j in range(n):
                pos = c + j
                out[t] = self._tokens[s, pos]
                out[o_pos + t] = pos
                out[o_slot + t] = <int64_t> self._block_tables[s, pos // bs] * bs + pos % bs
                t += 1
            ctx = c + n
            out[o_ctx + i] = ctx
            out[o_plen + i] = self._num_prompt_tokens[s]
            nb = self._blocks_for(ctx)
            for k in range(nb):
                out[o_bt + <int64_t> i * width + k] = self._block_tables[s, k]
            for k in range(nb, width):
                out[o_bt + <int64_t> i * width + k] = -1
            p = self._next_logprob_pos[s]
            if p >= 0:
                lo = c if c > p else p
                hi = ctx if ctx < self._num_prompt_tokens[s] - 1 else self._num_prompt_tokens[s] - 1
                if lo < hi:
                    self._span_entries[nsp] = i
                    self._span_firsts[nsp] = nl
                    self._span_counts[nsp] = hi - lo
                    self._span_positions[nsp] = lo
                    nsp += 1
                    for q in range(lo, hi):
                        out[o_logits + nl] = out[o_qs + i] + (q - c)
                        nl += 1
            if ctx == self._num_tokens[s]:
                self._sample_entries[ns] = i
                self._sample_logit_idx[ns] = nl
                ns += 1
                out[o_logits + nl] = t - 1
                nl += 1
        out[o_qs + B] = t
        cdef BatchLayout layout = BatchLayout.__new__(BatchLayout)
        layout.flat = flat
        layout.num_seqs = B
        layout.num_tokens = T
        layout.width = width
        layout.num_logit_rows = nl
        layout.num_samples = ns
        layout.num_spans = nsp
        layout.input_ids = flat[:T]
        layout.positions = flat[o_pos:o_slot]
        layout.slot_mapping = flat[o_slot:o_qs]
        layout.query_starts = flat[o_qs:o_ctx]
        layout.context_lens = flat[o_ctx:o_plen]
        layout.prompt_lens = flat[o_plen:o_bt]
        layout.block_tables = flat[o_bt:o_logits].reshape(B, width)
        layout.logit_rows = flat[o_logits:o_logits + nl]
        return layout

    cpdef int commit(self, const int32_t[::1] slots, const int32_t[::1] num_new, const int64_t[::1] epochs,
                     const int32_t[::1] sample_entries, const int64_t[::1] sampled_ids) except -1:
        """Advance num_computed of every entry and append each sampled id.

        Entries whose slot was rebound since the plan (epoch changed: aborted or finished in
        between) are skipped. Returns the number of ids appended.
        """
        cdef int B = slots.shape[0], S = sample_entries.shape[0], i, k, s, n, num_appended = 0
        if num_new.shape[0] != B or epochs.shape[0] != B:
            raise ValueError("slots, num_new and epochs differ in length")
        if sampled_ids.shape[0] != S:
            raise ValueError(f"expected {S} sampled ids, got {sampled_ids.shape[0]}")
        for k in range(S):
            i = sample_entries[k]
            s = slots[i]
            if self._epochs[s] == epochs[i] and self._num_tokens[s] >= self.max_model_len:
                raise ValueError(f"slot {s} is full (max_model_len={self.max_model_len})")
        for i in range(B):
            s = slots[i]
            if self._epochs[s] == epochs[i]:
                self._num_computed[s] += num_new[i]
        for k in range(S):
            i = sample_entries[k]
            s = slots[i]
            if self._epochs[s] == epochs[i]:
                n = self._num_tokens[s]
                self._tokens[s, n] = <int32_t> sampled_ids[k]
                self._num_tokens[s] = n + 1
                num_appended += 1
        return num_appended

    # ---- the decode-only steady state ----

    cpdef int set_finish_rule(self, int slot, int max_tokens, int min_tokens, stop_ids) except -1:
        """The rule decode_commit applies to ``slot``: finished at ``max_tokens`` generated ids (or at
        max_model_len), or at one of ``stop_ids`` once more than ``min_tokens`` are generated. More than
        MAX_STOP_IDS stop ids: past min_tokens the verdict is FINISH_UNKNOWN (the caller checks)."""
        cdef int k = 0, num = len(stop_ids)
        if slot < 0 or slot >= self.max_num_seqs:
            raise ValueError(f"slot {slot} is not in [0, {self.max_num_seqs})")
        self._max_generated[slot] = max_tokens
        self._min_generated[slot] = min_tokens
        if num > MAX_STOP_IDS:
            self._num_stop_ids[slot] = -1
            return 0
        for token_id in stop_ids:
            self._stop_ids[slot, k] = token_id
            k += 1
        self._num_stop_ids[slot] = num
        return 0

    cpdef int decode_plan(self, const int32_t[::1] running, int num_running) except -2:
        """``plan`` for the steady state: when every running slot (admission order) has exactly one
        token to compute and owes no prompt logprobs, plan one decode entry each (what ``plan``
        plans then) and return the blocks they need beyond those they hold; else -1, nothing planned."""
        cdef int i, s, need, total_need = 0
        if num_running > self.max_num_seqs or num_running > running.shape[0]:
            raise ValueError("num_running exceeds the slots")
        for i in range(num_running):
            s = running[i]
            if self._num_tokens[s] - self._num_computed[s] != 1 or self._next_logprob_pos[s] >= 0:
                return -1
        for i in range(num_running):
            s = running[i]
            need = self._blocks_for(self._num_tokens[s]) - self._num_blocks[s]
            if need < 0:
                need = 0
            self._entry_slots[i] = s
            self._entry_num_new[i] = 1
            self._entry_num_new_blocks[i] = need
            total_need += need
        self.num_entries = num_running
        self.num_batch_tokens = num_running
        return total_need

    cpdef BatchLayout decode_build(self):
        """``build`` for a plan of decode entries only, written into the previous decode tick's layout
        when the batch size and block-table width are the same (the same BatchLayout object and
        arrays: valid until the next build), else into a new one."""
        cdef int B = self.num_entries, i, s, c, nb, k, width = 1, bs = self.block_size
        for i in range(B):
            s = self._entry_slots[i]
            if self._entry_num_new[i] != 1 or self._num_tokens[s] != self._num_computed[s] + 1:
                raise ValueError(f"entry {i} (slot {s}) is not a decode")
            nb = self._blocks_for(self._num_tokens[s])
            if nb > self._num_blocks[s]:
                raise RuntimeError(f"slot {s} needs {nb} blocks but holds {self._num_blocks[s]}")
            if nb > width:
                width = nb
        cdef BatchLayout layout = self._decode_layout
        if layout is None or layout.num_seqs != B or layout.width != width:
            layout = self._new_layout(B, width)
            self._decode_layout = layout
        cdef int64_t[::1] out = layout.flat
        cdef int64_t o_pos = B, o_slot = 2 * B, o_qs = 3 * B
        cdef int64_t o_ctx = o_qs + B + 1, o_plen = o_ctx + B, o_bt = o_plen + B
        cdef int64_t o_logits = o_bt + <int64_t> B * width
        for i in range(B):
            s = self._entry_slots[i]
            c = self._num_computed[s]
            out[i] = self._tokens[s, c]
            out[o_pos + i] = c
            out[o_slot + i] = <int64_t> self._block_tables[s, c // bs] * bs + c % bs
            out[o_qs + i] = i
            out[o_ctx + i] = c + 1
            out[o_plen + i] = self._num_prompt_tokens[s]
            nb = self._blocks_for(c + 1)
            for k in range(nb):
                out[o_bt + <int64_t> i * width + k] = self._block_tables[s, k]
            for k in range(nb, width):
                out[o_bt + <int64_t> i * width + k] = -1
            out[o_logits + i] = i
            self._sample_entries[i] = i
            self._sample_logit_idx[i] = i
        out[o_qs + B] = B
        return layout

    cdef BatchLayout _new_layout(self, int B, int width):
        """A decode layout of B rows (T = B, one logit row each) and its views."""
        cdef int64_t o_qs = 3 * B, o_ctx = o_qs + B + 1, o_plen = o_ctx + B, o_bt = o_plen + B
        cdef int64_t o_logits = o_bt + <int64_t> B * width
        flat = np.empty(o_logits + B, dtype=np.int64)
        cdef BatchLayout layout = BatchLayout.__new__(BatchLayout)
        layout.flat = flat
        layout.num_seqs = B
        layout.num_tokens = B
        layout.width = width
        layout.num_logit_rows = B
        layout.num_samples = B
        layout.num_spans = 0
        layout.input_ids = flat[:B]
        layout.positions = flat[B:2 * B]
        layout.slot_mapping = flat[2 * B:o_qs]
        layout.query_starts = flat[o_qs:o_ctx]
        layout.context_lens = flat[o_ctx:o_plen]
        layout.prompt_lens = flat[o_plen:o_bt]
        layout.block_tables = flat[o_bt:o_logits].reshape(B, width)
        layout.logit_rows = flat[o_logits:o_logits + B]
        return layout

    cpdef int decode_commit(self, const int64_t[::1] sampled_ids) except -1:
        """``commit`` for the decode plan just built (entry i sampled ``sampled_ids[i]``): every entry
        computed its token and appends the new one; ``finish_codes[i]`` gets entry i's FINISH_*
        verdict from its slot's finish rule. Returns the number of entries whose verdict is not
        FINISH_NONE (0: every entry keeps running by the tick's own rules)."""
        cdef int B = self.num_entries, i, k, s, n, num_generated, code, num_ending = 0
        cdef int32_t token_id
        if sampled_ids.shape[0] != B:
            raise ValueError(f"expected {B} sampled ids, got {sampled_ids.shape[0]}")
        for i in range(B):
            if self._num_tokens[self._entry_slots[i]] >= self.max_model_len:
                raise ValueError(f"slot {self._entry_slots[i]} is full (max_model_len={self.max_model_len})")
        for i in range(B):
            s = self._entry_slots[i]
            token_id = <int32_t> sampled_ids[i]
            n = self._num_tokens[s]
            self._num_computed[s] = n
            self._tokens[s, n] = token_id
            n += 1
            self._num_tokens[s] = n
            num_generated = n - self._num_prompt_tokens[s]
            code = FINISH_NONE
            if num_generated > self._min_generated[s]:
                if self._num_stop_ids[s] < 0:
                    code = FINISH_UNKNOWN
                else:
                    for k in range(self._num_stop_ids[s]):
                        if self._stop_ids[s, k] == token_id:
                            code = FINISH_STOP_ID
                            break
            if code == FINISH_NONE and (num_generated >= self._max_generated[s] or n >= self.max_model_len):
                code = FINISH_LENGTH
            self._finish_codes[i] = code
            num_ending += code != FINISH_NONE
        return num_ending
