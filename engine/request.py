"""Per-request state kept by the engine thread, and the caller's end of its output queue.

``Request.create`` is the one place a request is made from prompt ids and SamplingParams:
it checks the ids and the context length (typed errors), fills ``max_tokens=None`` in as
"the rest of the context", seeds the sampler and builds the text pipeline.
"""
from __future__ import annotations

import dataclasses
import queue
import secrets
from dataclasses import dataclass, field

import torch

from .errors import ContextLengthError, InvalidParameterError
from .outputs import TokenLogprob
from .params import SamplingParams
from .sequence import Sequence
from .text_stream import TextStream


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams  # max_tokens concrete (never None)
    seq: Sequence
    text: TextStream
    generator: torch.Generator | None
    stop_ids: frozenset[int]  # stop_token_ids, plus EOS ids unless ignore_eos
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    is_finished: bool = False

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, *, tokenizer,
               vocab_size: int, max_model_len: int, prompt_param: str = "prompt") -> Request:
        """A request ready to submit. Raises InvalidParameterError / ContextLengthError naming the field
        (``prompt_param``: what the caller calls the prompt, "prompt" or "messages")."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if not prompt_ids:
            raise InvalidParameterError(f"{prompt_param} is empty: it must hold at least one token", prompt_param)
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
            raise InvalidParameterError(f"{prompt_param} token ids must be in [0, {vocab_size})", prompt_param)
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        num_prompt = len(prompt_ids)
        if num_prompt >= max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length (max_model_len) is {max_model_len} tokens; the {prompt_param} has "
                f"{num_prompt} tokens, which leaves no room for a completion", prompt_param,
                max_model_len=max_model_len)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max_model_len - num_prompt)
        elif num_prompt + params.max_tokens > max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens: the {prompt_param} "
                f"({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({max_model_len})", "max_tokens", max_model_len=max_model_len)
        generator = None
        if not params.is_greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed % (1 << 64) if params.seed is not None else secrets.randbits(63))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        return cls(
            request_id=request_id,
            params=params,
            seq=Sequence(request_id, prompt_ids, params.max_tokens, params.prompt_logprobs),
            text=TextStream(tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output),
            generator=generator,
            stop_ids=frozenset(stop_ids),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
