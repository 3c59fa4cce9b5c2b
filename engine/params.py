"""SamplingParams: what a request asks of generation, validated once at creation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidParameterError

MAX_TOP_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: the rest of the context (max_model_len - prompt)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = field(default=0)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidParameterError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not (_is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)):
            raise InvalidParameterError(f"seed must be None or a 64-bit integer, got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidParameterError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if any(s == "" for s in self.stop):
            raise InvalidParameterError("stop must not contain an empty string", "stop")
        self.stop = tuple(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidParameterError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}", "stop_token_ids")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for name in ("ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if not _is_int(self.top_logprobs) or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidParameterError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS)
        ):
            raise InvalidParameterError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
                "prompt_logprobs")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParameterError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
