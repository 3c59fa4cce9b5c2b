"""Per-request state kept by the engine thread, and the caller's end of its output queue.

``Request.create`` is the one place a request is made from prompt ids and SamplingParams:
it checks the ids and the context length (typed errors), fills ``max_tokens=None`` in as
"the rest of the context", seeds the sampler, builds the text pipeline and compiles the
structured-output grammar (on the caller's thread, cached: engine.structured).

A submission is a ``RequestGroup``: its choices (``n`` per prompt; several prompts for a
batched /v1/completions) share one output queue, and events carry the choice's ``index``.
For n > 1 the first choice of a prompt is the leader: the others (its ``followers``) enter
the scheduler only once the leader has prefilled, so they find the prompt's KV blocks in
the prefix cache instead of computing them again.
"""
from __future__ import annotations

import copy
import queue
from dataclasses import dataclass, field

from ..errors import ContextLengthError, InvalidParameterError
from ..outputs import TokenLogprob
from ..params import SamplingParams
from ..sampling.logits_process import LogitsAdjuster
from ..sampling.sampler import RandomStream, random_stream
from ..structured import GrammarMatcher, compile_grammar, spec_of
from ..text.text_stream import TextStream
from .sequence import Sequence


class RequestGroup:
    """The choices of one submission: one output queue, one public id, finished when all are."""

    __slots__ = ("request_id", "outputs", "requests", "num_unfinished", "ended", "end_key")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: list[Request] = []  # every choice, in index order
        self.num_unfinished = 0
        # Set by a caller that waits for the end only (Engine.generate): the engine thread puts
        # end_key on it once the last item is on ``outputs``, so nobody wakes per token.
        self.ended: queue.SimpleQueue | None = None
        self.end_key: object = None

    def end(self, item) -> None:
        """The group's last item on its queue (FINISHED or an error), then the end notice."""
        self.outputs.put(item)
        if self.ended is not None:
            self.ended.put(self.end_key)

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def leaders(self) -> list[Request]:
        """The choices submitted at once (the first of each prompt)."""
        return [r for r in self.requests if r.leader is None]


@dataclass(eq=False)
class Request:
    request_id: str  # unique in the engine (the scheduler's key); events carry group.request_id
    params: SamplingParams  # max_tokens concrete (never None)
    seq: Sequence
    text: TextStream
    generator: RandomStream | None
    stop_ids: frozenset[int]  # stop_token_ids, plus EOS ids unless ignore_eos
    group: RequestGroup
    index: int = 0  # the choice's index in the group's events
    adjuster: LogitsAdjuster | None = None  # logits processing, None on the fast path
    grammar: GrammarMatcher | None = None  # structured output: the token mask and its state
    leader: Request | None = None  # for a follower: the choice whose prefill it waits for
    followers: list[Request] = field(default_factory=list)  # choices waiting for this one's prefill
    prompt_logprobs: list[TokenLogprob | None] | None = None
    is_finished: bool = False

    @property
    def outputs(self) -> queue.SimpleQueue:
        return self.group.outputs

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, *, tokenizer,
               vocab_size: int, max_model_len: int, prompt_param: str = "prompt",
               group: RequestGroup | None = None) -> Request:
        """The ``params.n`` choices of one prompt, added to ``group`` (a new one by default) with the
        next indices; returns the leader (index order: leader, then its followers). Raises
        InvalidParameterError / ContextLengthError naming the field (``prompt_param``: what the
        caller calls the prompt, "prompt" or "messages")."""
        if not prompt_ids:
            raise InvalidParameterError(f"{prompt_param} is empty: it must hold at least one token", prompt_param)
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
            raise InvalidParameterError(f"{prompt_param} token ids must be in [0, {vocab_size})", prompt_param)
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            raise InvalidParameterError(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                                        f"{max(params.logit_bias)}", "logit_bias")
        if params.allowed_token_ids is not None and params.allowed_token_ids[-1] >= vocab_size:
            raise InvalidParameterError(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
        num_prompt = len(prompt_ids)
        if num_prompt >= max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length (max_model_len) is {max_model_len} tokens; "
                f"the {prompt_param} has {num_prompt} tokens, which leaves no room for a completion", prompt_param,
                max_model_len=max_model_len)
        if params.max_tokens is None:  # a copy: dataclasses.replace would validate params again
            params = copy.copy(params)
            params.max_tokens = max_model_len - num_prompt
        elif num_prompt + params.max_tokens > max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens: the {prompt_param} "
                f"({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({max_model_len})", "max_tokens", max_model_len=max_model_len)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        stop_ids = frozenset(stop_ids)
        bad_words_ids = _bad_words_ids(tokenizer, params.bad_words, vocab_size) if params.bad_words else []
        spec = spec_of(params)
        compiled = compile_grammar(spec, tokenizer, vocab_size) if spec is not None else None  # this thread
        if group is None:
            group = RequestGroup(request_id)
        leader = None
        for choice in range(params.n):
            index = len(group.requests)
            choice_id = request_id if params.n == 1 and index == 0 else f"{request_id}-{index}"
            seed = None if params.seed is None else params.seed + choice  # vLLM: choice i draws with seed + i
            req = cls._choice(choice_id, prompt_ids, params, seed, stop_ids, bad_words_ids, tokenizer, group, index,
                              leader)
            if compiled is not None:
                req.grammar = GrammarMatcher(compiled)
            if leader is None:
                leader = req
            else:
                leader.followers.append(req)
            group.requests.append(req)
            group.num_unfinished += 1
        return leader

    @classmethod
    def _choice(cls, request_id, prompt_ids, params, seed, stop_ids, bad_words_ids, tokenizer, group, index,
                leader) -> Request:
        generator = None if params.is_greedy else random_stream(seed)
        num_prompt_logprobs = params.prompt_logprobs if leader is None else None  # the leader's are shared
        return cls(
            request_id=request_id,
            params=params,
            seq=Sequence(request_id, prompt_ids, params.max_tokens, num_prompt_logprobs, stop_ids, params.min_tokens),
            text=TextStream(tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output),
            generator=generator,
            stop_ids=stop_ids,
            group=group,
            index=index,
            adjuster=LogitsAdjuster.for_request(params, prompt_ids, stop_ids, params.max_tokens, bad_words_ids),
            leader=leader,
            prompt_logprobs=(leader.prompt_logprobs if leader is not None
                             else [None] if params.prompt_logprobs is not None else None),
        )


def _bad_words_ids(tokenizer, bad_words: tuple[str, ...], vocab_size: int) -> list[list[int]]:
    """vLLM's encoding of bad_words: each word as is, and with a leading space when that gives
    other ids of the same length (the word in the middle of a text)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return [ids for ids in out if max(ids) < vocab_size]
