"""A plain-Python model of the scheduling policy, for tests to compare the Cython tick against.

It shares no code with engine/core/scheduler.py or cext/tick.pyx: lists and dicts only, one
obvious loop per rule. ``schedule`` returns the tick as plain lists (the same numbers the
real scheduler puts in its ForwardBatch), so a test can drive both with the same ops and
compare tick by tick, block ids included.

Policy: running decodes first (one token each), then prefill chunks of running sequences
in admission order (each at most half the prefill budget while a request waits for a free
slot), then waiting ones admitted FIFO while there is a slot, budget and the blocks for
all their tokens (whole if they fit the hard budget, else a chunk of the prefill budget);
prefill budget still left goes back to the chunks that were cut. A decode that needs a block
when none is free preempts the newest running sequence (no admissions in that tick). Full
prompt blocks are hashed by (parent hash, tokens); an admission reuses the longest cached
prefix (never its last token; not when prompt logprobs are still owed). Unreferenced cached blocks are evicted
least recently freed first; blocks are freed tail first.
"""
from __future__ import annotations

from collections import OrderedDict


class RefSeq:
    def __init__(self, request_id, prompt, max_tokens, num_prompt_logprobs=None):
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.computed = 0
        self.blocks: list[int] = []
        self.plp_next = 0 if num_prompt_logprobs is not None and len(prompt) > 1 else -1
        self.num_published = 0


class ReferenceScheduler:
    def __init__(self, max_num_seqs, max_num_batched_tokens, num_blocks, block_size, enable_prefix_caching=True):
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.bs = block_size
        self.caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        self.hash_of = [None] * num_blocks
        self.free = list(range(num_blocks))
        self.cached = OrderedDict()
        self.by_hash = {}
        self.waiting: list[RefSeq] = []
        self.running: list[RefSeq] = []
        self.last = None

    # -- blocks --
    def num_free(self):
        return len(self.free) + len(self.cached)

    def alloc(self):
        if self.free:
            b = self.free.pop(0)
        else:
            b, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hash_of[b]]
            self.hash_of[b] = None
        self.refs[b] = 1
        return b

    def release(self, seq):
        for b in reversed(seq.blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.hash_of[b] is not None:
                    self.cached[b] = None
                else:
                    self.free.append(b)
        seq.blocks = []

    def prompt_hashes(self, seq):
        out, parent = [], None
        for k in range(seq.num_prompt // self.bs):
            parent = hash((parent, tuple(seq.tokens[k * self.bs : (k + 1) * self.bs])))
            out.append(parent)
        return out

    # -- requests --
    def add(self, seq):
        self.waiting.append(seq)

    def remove(self, request_id):
        for seq in self.running:
            if seq.request_id == request_id:
                self.release(seq)
                self.running.remove(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    # -- the tick --
    def schedule(self, prefill_budget=None):
        prefill_budget = self.budget if prefill_budget is None else prefill_budget
        max_chunk = prefill_budget
        preempted = []
        while True:
            if self.waiting and len(self.running) < self.max_num_seqs:
                max_chunk = max(1, min(prefill_budget, self.budget - len(self.running)) // 2)
            else:
                max_chunk = prefill_budget
            decodes = [s for s in self.running if len(s.tokens) - s.computed == 1]
            need = sum(max(0, -(-len(s.tokens) // self.bs) - len(s.blocks)) for s in decodes)
            if need <= self.num_free():
                break
            victim = self.running.pop()
            self.release(victim)
            victim.computed = 0
            self.waiting.insert(0, victim)
            preempted.append(victim.request_id)
        if not decodes:  # no stream to keep pace for: the whole budget
            prefill_budget = self.budget
            if self.waiting and len(self.running) < self.max_num_seqs:
                max_chunk = max(1, min(prefill_budget, self.budget - len(self.running)) // 2)
            else:
                max_chunk = prefill_budget
        for s in decodes:
            while len(s.blocks) < -(-len(s.tokens) // self.bs):
                s.blocks.append(self.alloc())
        entries = [(s, 1) for s in decodes]
        left = min(self.budget - len(decodes), prefill_budget)
        for s in self.running:
            rem = len(s.tokens) - s.computed
            if rem > 1 and left > 0:
                entries.append((s, min(rem, left, max_chunk)))
                left -= min(rem, left, max_chunk)
        num_planned = len(entries)
        hard_left = self.budget - sum(n for _, n in entries)
        while not preempted and self.waiting and hard_left > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            hits = []
            if self.caching and s.plp_next < 0:
                hashes = self.prompt_hashes(s)[: (len(s.tokens) - 1) // self.bs]
                for h in hashes:
                    if h not in self.by_hash:
                        break
                    hits.append(self.by_hash[h])
            num_new = -(-len(s.tokens) // self.bs) - len(hits)
            rem = len(s.tokens) - len(hits) * self.bs
            if rem <= hard_left:  # done within this tick: admitted whole
                k = rem
            elif left > 0:
                k = min(rem, left, hard_left)
            else:
                break
            if num_new + sum(1 for b in hits if self.refs[b] == 0) > self.num_free():
                break
            self.waiting.pop(0)
            for b in hits:
                if self.refs[b] == 0:
                    del self.cached[b]
                self.refs[b] += 1
            s.blocks = hits + [self.alloc() for _ in range(num_new)]
            s.computed = len(hits) * self.bs
            s.num_published = len(hits)
            self.running.append(s)
            entries.append((s, k))
            hard_left -= k
            left = max(0, left - k)
        for i in range(len(decodes), num_planned):  # budget left: give it back to cut chunks
            s, k = entries[i]
            more = min(len(s.tokens) - s.computed - k, left)
            entries[i] = (s, k + more)
            left -= more
        return self._tick(entries, len(decodes), preempted)

    def _tick(self, entries, num_decodes, preempted):
        tick = dict(request_ids=[], input_ids=[], positions=[], slot_mapping=[], query_starts=[0],
                    context_lens=[], block_tables=[], logit_rows=[], sample_ids=[], sample_logit_index=[],
                    spans=[], preempted=preempted, num_decode_seqs=num_decodes)
        width = max([-(-(s.computed + n) // self.bs) for s, n in entries], default=1)
        for s, n in entries:
            start = len(tick["input_ids"])
            tick["request_ids"].append(s.request_id)
            for pos in range(s.computed, s.computed + n):
                tick["input_ids"].append(s.tokens[pos])
                tick["positions"].append(pos)
                tick["slot_mapping"].append(s.blocks[pos // self.bs] * self.bs + pos % self.bs)
            ctx = s.computed + n
            tick["query_starts"].append(start + n)
            tick["context_lens"].append(ctx)
            nb = -(-ctx // self.bs)
            tick["block_tables"].append(s.blocks[:nb] + [-1] * (width - nb))
            if s.plp_next >= 0:
                lo, hi = max(s.computed, s.plp_next), min(ctx, s.num_prompt - 1)
                if lo < hi:
                    tick["spans"].append((s.request_id, len(tick["logit_rows"]), hi - lo, lo))
                    tick["logit_rows"].extend(start + q - s.computed for q in range(lo, hi))
            if ctx == len(s.tokens):
                tick["sample_ids"].append(s.request_id)
                tick["sample_logit_index"].append(len(tick["logit_rows"]))
                tick["logit_rows"].append(start + n - 1)
        self.last = (entries, tick)
        return tick if entries else None

    def update(self, sampled):
        entries, tick = self.last
        by_id = {s.request_id: s for s, _ in entries}
        for s, n in entries:
            s.computed += n
        for rid, tok in zip(tick["sample_ids"], sampled):
            by_id[rid].tokens.append(tok)
        for rid, _first, count, pos in tick["spans"]:
            s = by_id[rid]
            s.plp_next = pos + count if pos + count < s.num_prompt - 1 else -1
        if self.caching:
            hashes_of = {}
            for s in self.running:
                done = min(s.computed, s.num_prompt) // self.bs
                if s.num_published < done:
                    hashes = hashes_of.setdefault(s.request_id, self.prompt_hashes(s))
                    for k in range(s.num_published, done):
                        h, b = hashes[k], s.blocks[k]
                        if h not in self.by_hash and self.hash_of[b] is None:
                            self.hash_of[b] = h
                            self.by_hash[h] = b
                    s.num_published = done
