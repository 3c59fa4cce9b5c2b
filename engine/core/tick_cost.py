"""How long a tick takes: running estimates that size the prefill chunks of the next tick.

A tick's time (forward + sampling) is modelled as a fixed part for its decode rows plus a
cost per prefill token. Both are exponential moving averages of measured ticks: decode-only
ticks teach the fixed part, ticks with prefill teach the per-token cost (what is left after
the fixed part, per token). The per-token cost drifts with the context a chunk attends to;
the averages follow it tick by tick.
"""
from __future__ import annotations

import time

DEFAULT_TARGET_TICK_SECONDS = 0.35
MIN_PREFILL_SHARE = 0.25  # share of a tick's time prefill keeps when decodes alone exceed the target
MIN_PREFILL_TOKENS = 16  # and never fewer tokens: an unmodelled fixed cost cannot starve prefill
INITIAL_PREFILL_TOKENS = 64  # prefill tokens of a tick before any tick has been timed
TIMING_SMOOTHING = 0.5  # weight of the newest tick in the running cost estimates


class TickCostModel:
    """Prefill tokens per tick for a time target; ``target_tick_seconds`` None: always the hard budget."""

    def __init__(self, target_tick_seconds: float | None, max_num_batched_tokens: int, clock=time.perf_counter):
        self.target_tick_seconds = target_tick_seconds
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.sec_per_prefill_token: float | None = None
        self.sec_per_decode_tick = 0.0  # estimated time of a tick without prefill tokens
        self._started_at = 0.0

    def prefill_budget(self) -> int:
        """Prefill tokens for the next tick: the whole budget, or what fits the time target."""
        hard = self.max_num_batched_tokens
        if self.target_tick_seconds is None:
            return hard
        if self.sec_per_prefill_token is None:
            return min(hard, INITIAL_PREFILL_TOKENS)
        decode_s, token_s = self.sec_per_decode_tick, self.sec_per_prefill_token
        num = int((self.target_tick_seconds - decode_s) / token_s)
        # Prefill keeps MIN_PREFILL_SHARE of the tick even when the target is out of reach.
        floor = int(decode_s * MIN_PREFILL_SHARE / (1 - MIN_PREFILL_SHARE) / token_s)
        return max(MIN_PREFILL_TOKENS, min(hard, max(num, floor)))

    def start(self) -> None:
        """The tick is planned; its forward starts now."""
        self._started_at = self.clock()

    def observe(self, num_prefill_tokens: int) -> None:
        """The tick started by start() has its tokens: update the estimates with its time."""
        if self.target_tick_seconds is None:
            return
        elapsed = self.clock() - self._started_at
        a = TIMING_SMOOTHING
        if num_prefill_tokens == 0:
            self.sec_per_decode_tick += a * (elapsed - self.sec_per_decode_tick)
        elif num_prefill_tokens >= MIN_PREFILL_TOKENS // 4:  # tiny chunks time mostly noise
            per_token = max(elapsed - self.sec_per_decode_tick, 0.05 * elapsed, 1e-9) / num_prefill_tokens
            if self.sec_per_prefill_token is None:
                self.sec_per_prefill_token = per_token
            else:
                self.sec_per_prefill_token += a * (per_token - self.sec_per_prefill_token)
