"""Sequence: one request's tokens and its place in the scheduler.

A waiting sequence owns its token buffer and counters. While it runs it is bound to a
slot of the scheduler's ``cext.tick.TickState``: its tokens, counters and block table live
in that slot's rows (the Cython tick reads them without touching Python objects) and the
properties below read through to them. Unbinding (finish, abort, preemption) copies the
tokens back out.
"""
from __future__ import annotations

import enum
import time

import numpy as np


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "max_tokens",
        "num_prompt_logprobs",
        "status",
        "next_prompt_logprob_pos",
        "block_hashes",
        "num_registered_blocks",
        "num_cached_tokens",
        "disk_blocks",
        "arrival_time",
        "first_scheduled_time",
        "spec",
        "stop_ids",
        "min_tokens",
        "_buf",
        "_num_tokens",
        "_num_computed",
        "_state",
        "_slot",
    )

    def __init__(
        self, request_id: str, prompt_token_ids, max_tokens: int, num_prompt_logprobs: int | None = None,
        stop_ids: frozenset[int] | tuple[int, ...] = (), min_tokens: int = 0,
    ) -> None:
        # Typed values, checked where they entered: a non-empty list of ids in [0, vocab_size)
        # (Request.create) and max_tokens >= 1 (SamplingParams).
        n = len(prompt_token_ids)
        self.request_id = request_id
        self.num_prompt_tokens = n
        self.max_tokens = max_tokens
        self.num_prompt_logprobs = num_prompt_logprobs
        self.status = SequenceStatus.WAITING
        # Next prompt position whose logits predict a prompt token (-1: none wanted or all done).
        self.next_prompt_logprob_pos = 0 if num_prompt_logprobs is not None and n > 1 else -1
        self.block_hashes: list[int] | None = None  # chained hashes of full prompt blocks
        self.num_registered_blocks = 0  # prompt blocks already published to the prefix cache
        self.num_cached_tokens = 0  # tokens taken from the prefix cache at the last admission
        self.disk_blocks = None  # engine.core.prefix_disk.DiskBlocks read ahead for admission, or None
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None  # perf_counter at the first admission (queue time)
        self.spec = None  # engine.core.speculative.SpecState when this request may speculate
        # The finish rule the decode tick checks (cext.tick.TickState.set_finish_rule): ids that end
        # the sequence once more than min_tokens are generated; max_tokens ends it too.
        self.stop_ids = stop_ids
        self.min_tokens = min_tokens
        self._buf = np.empty(n + max_tokens, dtype=np.int32)  # [capacity]
        self._buf[:n] = prompt_token_ids
        self._num_tokens = n
        self._num_computed = 0
        self._state = None  # cext.tick.TickState while running
        self._slot = -1

    # -- counters (read through to the tick state while bound) --

    @property
    def num_tokens(self) -> int:
        if self._state is None:
            return self._num_tokens
        return int(self._state.num_tokens[self._slot])

    @property
    def num_computed_tokens(self) -> int:
        if self._state is None:
            return self._num_computed
        return int(self._state.num_computed[self._slot])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._state is None:
            self._num_computed = value
        else:
            self._state.num_computed[self._slot] = value

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated ids."""
        return self._buf[: self.num_tokens].tolist()

    @property
    def token_array(self) -> np.ndarray:
        """[num_tokens] int32 view of the ids (no copy; valid until the sequence changes)."""
        return self._buf[: self.num_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Generated ids (a new list on each call)."""
        return self._buf[self.num_prompt_tokens : self.num_tokens].tolist()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._buf[: self.num_prompt_tokens].tolist()

    @property
    def block_ids(self) -> list[int]:
        if self._state is None:
            return []
        return self._state.block_tables[self._slot, : self._state.num_blocks[self._slot]].tolist()

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        n = self.num_tokens
        if n >= self.num_prompt_tokens + self.max_tokens:
            raise ValueError(f"sequence {self.request_id!r} already holds max_tokens={self.max_tokens} generated ids")
        self._buf[n] = token_id
        if self._state is None:
            self._num_tokens = n + 1
        else:
            self._state.num_tokens[self._slot] = n + 1

    # -- binding to a scheduler slot (the scheduler's business) --

    def bind(self, state, slot: int, num_computed: int) -> None:
        n = self._num_tokens
        row = state.tokens[slot]
        row[:n] = self._buf[:n]
        state.num_tokens[slot] = n
        state.num_computed[slot] = num_computed
        state.num_prompt_tokens[slot] = self.num_prompt_tokens
        state.next_logprob_pos[slot] = self.next_prompt_logprob_pos
        state.num_blocks[slot] = 0
        state.set_finish_rule(slot, self.max_tokens, self.min_tokens, self.stop_ids)
        self._buf = row
        self._state = state
        self._slot = slot

    def unbind(self) -> None:
        """Copy tokens out of the slot; the caller frees the slot's blocks first."""
        state = self._state
        if state is None:
            return
        n = int(state.num_tokens[self._slot])
        buf = np.empty(max(n, self.num_prompt_tokens + self.max_tokens), dtype=np.int32)
        buf[:n] = self._buf[:n]
        self._buf = buf
        self._num_tokens = n
        self._num_computed = int(state.num_computed[self._slot])
        self._state = None
        self._slot = -1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
