"""What the engine gives back: StreamEvent per step, Completion per request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one token.

    ``token`` is the token's text; a piece that is not valid UTF-8 on its own (part of
    a multi-byte character) renders with U+FFFD for the invalid bytes, exactly as
    ``bytes.decode("utf-8", errors="replace")`` would. ``bytes`` always holds the raw bytes.
    ``top`` is a list of (token_id, token, bytes, logprob), best first.
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[int, str, list[int], float]] = field(default_factory=list)


@dataclass(slots=True)
class StreamEvent:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    index: int = 0  # which choice (n > 1, batched prompts) the event belongs to


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    usage: Usage
    index: int = 0  # the choice's index (n > 1: prompt i's choices are i*n .. i*n+n-1)
