"""The public Engine: submit prompts from any thread, stream events back.

Templating and tokenization run on the caller's thread (the tokenizer releases the GIL);
the engine thread (engine/runtime.py) sees only token ids.
"""
from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator, Sequence as SequenceABC

from .config import EngineConfig
from .errors import EngineDead, InvalidParameterError
from .outputs import Completion, StreamEvent, TokenLogprob, Usage
from .params import SamplingParams
from .runtime import FINISHED, EngineCore


class RequestStream:
    """Iterator over one request's StreamEvents. Closing it (or dropping it) aborts the request.

    A request with n > 1 choices (or several prompts, ``Engine.submit_batch``) streams the
    events of all its choices, interleaved; ``StreamEvent.index`` says whose each one is.
    """

    def __init__(self, core: EngineCore, request, prompt_token_ids: list[int]):
        self._core = core
        self._request = request
        self._group = request.group
        self.request_id = self._group.request_id
        self.prompt_token_ids = prompt_token_ids
        self._done = False
        self._pending_error: BaseException | None = None  # met by ready_events(), raised by __next__

    @property
    def num_choices(self) -> int:
        return len(self._group.requests)

    def choice_prompt_token_ids(self, index: int) -> list[int]:
        return self._group.requests[index].seq.prompt_token_ids

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Filled once the first event has arrived (the prompt is prefilled by then)."""
        return self._request.prompt_logprobs

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission until the engine first scheduled the request (None: not yet)."""
        seq = self._request.seq
        return None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time

    def choice_prompt_logprobs(self, index: int) -> list[TokenLogprob | None] | None:
        return self._group.requests[index].prompt_logprobs

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamEvent:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            self._done = True
            raise err
        if self._done:
            raise StopIteration
        outputs = self._group.outputs
        while True:
            try:
                item = outputs.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._core.is_alive() and outputs.empty():
                    self._done = True
                    raise EngineDead(self._core.dead_message) from None
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
        outputs = self._group.outputs
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
            if not self._group.is_finished:
                self._core.abort(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def collect(self, on_event: Callable[[StreamEvent], bool | None] | None = None) -> Completion:
        """Run the request to its end and fold its events into one Completion (then close).

        ``on_event(event)`` sees every event as it arrives; returning True stops early: the
        request is aborted and the Completion so far comes back with finish_reason "abort".
        For a request of several choices use ``collect_choices``.
        """
        if self.num_choices != 1:
            raise InvalidParameterError(
                f"this request has {self.num_choices} choices: use collect_choices()", "n")
        return self.collect_choices(on_event)[0]

    def collect_choices(self, on_event: Callable[[StreamEvent], bool | None] | None = None) -> list[Completion]:
        """Like ``collect``, one Completion per choice, in index order."""
        num_choices = self.num_choices
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        logprobs: list[list[TokenLogprob] | None] = [None] * num_choices
        finish_reasons: list[str | None] = [None] * num_choices
        try:
            for event in self:
                i = event.index
                texts[i].append(event.text)
                token_ids[i].extend(event.token_ids)
                if event.logprobs is not None:
                    if logprobs[i] is None:
                        logprobs[i] = []
                    logprobs[i].extend(event.logprobs)
                finish_reasons[i] = event.finish_reason or finish_reasons[i]
                if on_event is not None and on_event(event) and event.finish_reason is None:
                    finish_reasons = [r or "abort" for r in finish_reasons]
                    break
        finally:
            self.close()
        completions = []
        for i in range(num_choices):
            prompt_ids = self.prompt_token_ids if num_choices == 1 else self.choice_prompt_token_ids(i)
            completions.append(Completion(
                request_id=self.request_id,
                text="".join(texts[i]),
                token_ids=token_ids[i],
                finish_reason=finish_reasons[i],
                logprobs=logprobs[i],
                prompt_token_ids=prompt_ids,
                prompt_logprobs=self.choice_prompt_logprobs(i),
                usage=Usage(len(prompt_ids), len(token_ids[i])),
                index=i,
            ))
        return completions


class Engine:
    """An LLM engine with continuous batching. Use as a context manager or call close().

    A thin facade over the engine thread (engine/runtime.py): templating and tokenization
    run here, on the caller's thread; the thread sees only token ids.
    """

    def __init__(self, model, tokenizer, **options):
        """``options``: the runtime fields of EngineConfig (max_model_len, max_num_seqs, ...)."""
        from .tokenizer import Tokenizer, load_tokenizer

        config = EngineConfig.from_options(options, allow_load=False)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.model = model
        self.config = config.resolve(getattr(model, "max_model_len", None))
        self._core = EngineCore(model, self.tokenizer, self.config)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, **options) -> Engine:
        """Load a .gguf file or a Hugging Face directory (None: the embedded SmolLM2-135M-Instruct).

        ``options``: any EngineConfig field, load options (dtype, quantization, num_threads) included.
        """
        from .loader import default_model_path, load_model
        from .models.threads import apply_thread_policy
        from .tokenizer import load_tokenizer

        config = EngineConfig.from_options(options)
        apply_thread_policy(config.num_threads)
        path = default_model_path() if model is None else os.fspath(model)
        loaded = load_model(path, dtype=config.dtype or "float32")
        runtime_options = {k: v for k, v in options.items() if k not in config.load_options}
        return cls(loaded, load_tokenizer(path), **runtime_options)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_waiting(self) -> int:
        return self.config.max_waiting

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
        return self._core.stats()

    def abort(self, request_id: str) -> None:
        self._core.abort(request_id)

    # ----- requests -----
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Submit one prompt (text, or token ids) and return its event iterator."""
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise InvalidParameterError("prompt must be a string or a list of token ids", "prompt")
        return self.submit(prompt_ids, params, request_id)

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None,
                    request_id: str | None = None, tools: list[dict] | None = None) -> RequestStream:
        """Apply the chat template to OpenAI-style messages and stream the reply."""
        prompt_ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
        return self.submit(prompt_ids, params, request_id, prompt_param="messages")

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
               prompt_param: str = "prompt") -> RequestStream:
        """Submit prompt token ids. ``prompt_param`` names the prompt in errors ("prompt", "messages")."""
        request = self._core.make_request(prompt_ids, params, request_id, prompt_param)
        self._core.submit(request)
        return RequestStream(self._core, request, prompt_ids)

    def submit_batch(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                     request_id: str | None = None, prompt_param: str = "prompt",
                     add_special_tokens: bool = True) -> RequestStream:
        """Submit several prompts (text, encoded here, or token ids) as one request: one stream whose
        events carry ``index`` = prompt number * n + choice (the OpenAI order of a batched completion)."""
        if not prompts:
            raise InvalidParameterError(f"{prompt_param} must hold at least one prompt", prompt_param)
        prompts = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
                   for p in prompts]
        first = self._core.make_request(prompts[0], params, request_id,
                                        prompt_param if len(prompts) == 1 else f"{prompt_param}[0]")
        for i, prompt_ids in enumerate(prompts[1:], start=1):
            self._core.make_request(prompt_ids, params, prompt_param=f"{prompt_param}[{i}]", group=first.group)
        self._core.submit(first.group)
        return RequestStream(self._core, first, prompts[0])

    # ----- one-shot wrappers -----
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Run many prompts batched together; returns completions in prompt order (with n > 1,
        the n choices of each prompt in a row)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or not prompts:
            raise InvalidParameterError("prompts must be a non-empty list of strings or of token-id lists", "prompts")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidParameterError(f"params has {len(params)} entries for {len(prompts)} prompts", "params")
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
                results.extend(stream.collect_choices())
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            return results
        finally:
            for stream in streams:
                stream.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             tools: list[dict] | None = None) -> Completion | list[Completion]:
        """The reply's Completion; with params.n > 1, the list of the n choices' Completions."""
        stream = self.stream_chat(messages, params, tools=tools)
        return stream.collect() if stream.num_choices == 1 else stream.collect_choices()
