"""Per-request state kept by the engine thread, and the caller's end of its output queue."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import torch

from .detokenizer import IncrementalDetokenizer
from .outputs import TokenLogprob
from .params import SamplingParams
from .sequence import Sequence
from .stops import StopMatcher


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    seq: Sequence
    detok: IncrementalDetokenizer
    stops: StopMatcher | None
    generator: torch.Generator | None
    stop_ids: frozenset[int]  # stop_token_ids, plus EOS ids unless ignore_eos
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    is_finished: bool = False
