"""The public Engine: submit prompts from any thread, stream events back.

Templating and tokenization run on the caller's thread (the tokenizer releases the GIL);
the engine thread (engine/runtime.py) sees only token ids.
"""
from __future__ import annotations

import itertools
import math
import os
import queue
import secrets
from collections.abc import Iterator, Sequence as SequenceABC

import torch

from .detokenizer import IncrementalDetokenizer
from .errors import EngineDead, EngineOverloaded
from .outputs import Completion, StreamEvent, TokenLogprob, Usage
from .params import SamplingParams
from .request import Request
from .runtime import FINISHED, EngineCore
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence
from .stops import StopMatcher
from .tick_cost import DEFAULT_TARGET_TICK_SECONDS

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_WAITING = 1024
_ENGINE_OPTIONS = (
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens",
    "block_size", "enable_prefix_caching", "max_waiting", "target_tick_seconds",
)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class RequestStream:
    """Iterator over one request's StreamEvents. Closing it (or dropping it) aborts the request."""

    def __init__(self, core: EngineCore, request: Request, prompt_token_ids: list[int]):
        self._core = core
        self._request = request
        self.request_id = request.request_id
        self.prompt_token_ids = prompt_token_ids
        self._done = False
        self._pending_error: BaseException | None = None  # met by ready_events(), raised by __next__

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Filled once the first event has arrived (the prompt is prefilled by then)."""
        return self._request.prompt_logprobs

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamEvent:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            self._done = True
            raise err
        if self._done:
            raise StopIteration
        outputs = self._request.outputs
        while True:
            try:
                item = outputs.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._core.is_alive() and outputs.empty():
                    self._done = True
                    raise EngineDead(self._core._dead_message()) from None
        if item is FINISHED:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def ready_events(self) -> list[StreamEvent]:
        """The events already queued, taken without waiting (the queue's lock is taken only to wait).

        A consumer that fell behind (a slow socket, a fast model) drains them after each
        ``next()`` and handles them at once: the SSE path writes them in one chunk.
        """
        events: list[StreamEvent] = []
        outputs = self._request.outputs
        while not self._done and self._pending_error is None and not outputs.empty():
            item = outputs.get_nowait()
            if item is FINISHED:
                self._done = True
            elif isinstance(item, BaseException):
                self._pending_error = item
            else:
                events.append(item)
        return events

    def close(self) -> None:
        if not self._done:
            self._done = True
            if not self._request.is_finished:
                self._core.abort(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Engine:
    """An LLM engine with continuous batching. Use as a context manager or call close()."""

    def __init__(self, model, tokenizer, **options):
        from .tokenizer import Tokenizer, load_tokenizer

        unknown = sorted(set(options) - set(_ENGINE_OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(_ENGINE_OPTIONS)}")
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.model = model
        model_len = getattr(model, "max_model_len", None) or 32768
        self.max_model_len = _positive_int("max_model_len", options.get("max_model_len") or model_len)
        block_size = _positive_int("block_size", options.get("block_size", DEFAULT_BLOCK_SIZE))
        kv_tokens = options.get("kv_cache_tokens") or max(2 * self.max_model_len, 16384)
        kv_tokens = _positive_int("kv_cache_tokens", kv_tokens)
        num_blocks = math.ceil(kv_tokens / block_size)
        max_batched = _positive_int(
            "max_num_batched_tokens", options.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        )
        self.max_waiting = _positive_int("max_waiting", options.get("max_waiting", DEFAULT_MAX_WAITING))
        config = SchedulerConfig(
            max_num_seqs=_positive_int("max_num_seqs", options.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
            max_num_batched_tokens=max_batched,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=self.max_model_len,
            enable_prefix_caching=bool(options.get("enable_prefix_caching", True)),
            # Prefill chunks adapt so a tick takes about this long while streams decode (None: off).
            target_tick_seconds=options.get("target_tick_seconds", DEFAULT_TARGET_TICK_SECONDS),
        )
        self.config = config
        kv_cache = model.make_kv_cache(num_blocks, block_size)
        self._core = EngineCore(model, self.tokenizer, Scheduler(config), kv_cache, self.max_model_len)
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, dtype: str = "float32", **options) -> Engine:
        """Load a .gguf file or a Hugging Face directory (None: the embedded SmolLM2-135M-Instruct)."""
        from .loader import default_model_path, load_model
        from .tokenizer import load_tokenizer

        path = default_model_path() if model is None else os.fspath(model)
        return cls(load_model(path, dtype=dtype), load_tokenizer(path), **options)

    # ----- lifecycle -----
    def close(self) -> None:
        self._core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_alive(self) -> bool:
        return self._core.is_alive()

    def stats(self) -> dict:
        sched = self._core.scheduler
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting + len(self._core._new),
            "kv_usage": sched.kv_usage(),
            "num_generated_tokens": self._core.num_generated_tokens,
            "num_ticks": self._core.num_ticks,
        }

    def abort(self, request_id: str) -> None:
        self._core.abort(request_id)

    # ----- requests -----
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Submit one prompt (text, or token ids) and return its event iterator."""
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        return self._submit(prompt_ids, params, request_id)

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Apply the chat template to OpenAI-style messages and stream the reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._submit(prompt_ids, params, request_id)

    def _submit(self, prompt_ids: list[int], params: SamplingParams | None, request_id: str | None) -> RequestStream:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        vocab_size = self.model.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        num_prompt = len(prompt_ids)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if not self._core.is_alive():
            raise EngineDead(self._core._dead_message())
        stats_waiting = self._core.scheduler.num_waiting + len(self._core._new)
        if stats_waiting >= self.max_waiting:
            raise EngineOverloaded(f"too many waiting requests ({stats_waiting}); retry later")
        if request_id is None:
            request_id = f"req-{self._id_prefix}-{next(self._ids)}"
        generator = None
        if not params.is_greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        request = Request(
            request_id=request_id,
            params=params,
            seq=Sequence(request_id, prompt_ids, params.max_tokens, params.prompt_logprobs),
            detok=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            stops=StopMatcher(tuple(params.stop), params.include_stop_str_in_output) if params.stop else None,
            generator=generator,
            stop_ids=frozenset(stop_ids),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self._core.submit(request)
        return RequestStream(self._core, request, prompt_ids)

    # ----- one-shot wrappers -----
    @staticmethod
    def _collect(stream: RequestStream) -> Completion:
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        finish_reason = None
        for event in stream:
            texts.append(event.text)
            token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                logprobs = (logprobs or []) + event.logprobs
            finish_reason = event.finish_reason or finish_reason
        return Completion(
            request_id=stream.request_id,
            text="".join(texts),
            token_ids=token_ids,
            finish_reason=finish_reason,
            logprobs=logprobs,
            prompt_token_ids=stream.prompt_token_ids,
            prompt_logprobs=stream.prompt_logprobs,
            usage=Usage(len(stream.prompt_token_ids), len(token_ids)),
        )

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, progress: bool = False) -> list[Completion]:
        """Run many prompts batched together; returns completions in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        streams = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                streams.append(self.stream(prompt, p))
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(streams), desc="generate", unit="req")
            results = []
            for stream in streams:
                results.append(self._collect(stream))
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            return results
        finally:
            for stream in streams:
                stream.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        stream = self.stream_chat(messages, params)
        try:
            return self._collect(stream)
        finally:
            stream.close()
