"""The public Engine: submit prompts from any thread, stream events back.

Templating and tokenization run on the caller's thread (the tokenizer releases the GIL; chat
requests take engine/chat.py's one path); the engine thread (engine/core/runtime.py) sees only
token ids. Each async method is its sync twin's core with the async stream (engine/async_stream.py).
"""
from __future__ import annotations

import os
import queue
import sys
import weakref
from collections.abc import Sequence as SequenceABC

from .chat import prepare_chat
from .config import EngineConfig
from .core.runtime import EngineCore
from .embedding.api import EmbeddingMixin
from .errors import InvalidParameterError
from .outputs import Completion
from .params import SamplingParams
from .request_stream import RequestStream
from .startup import check_memory


def _display_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)).removesuffix(".gguf")


def _sizing_option(config: EngineConfig) -> str:
    """The option that sized the KV cache: the user's kv_cache_tokens, else max_model_len (its default)."""
    return "kv_cache_tokens" if config.kv_cache_tokens is not None else "max_model_len"


# Models loaded by from_pretrained, while some engine still uses them: a second engine over the
# same file and load options (a re-run notebook cell) shares the weights instead of loading a copy.
_shared_models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _model_key(path: str, config: EngineConfig):
    """The key of a loaded model in _shared_models: the file's identity and the load options."""
    stat = os.stat(path) if os.path.exists(path) else None
    return stat and (os.path.realpath(path), stat.st_mtime_ns, stat.st_size,
                     tuple(sorted(config.load_options.items())))


def _check_draft(path: str, tokenizer) -> None:
    """The draft model's files, and its tokenizer against the model's (before any weights load)."""
    from .core.draft import check_draft_tokenizer
    from .startup import check_model_path
    from .tokenizer import load_tokenizer

    check_model_path(path)
    check_draft_tokenizer(tokenizer, load_tokenizer(path))


def _load_draft(path: str, load_options: dict | None = None):
    """The draft model for speculative="draft", loaded with the model's load options."""
    from .loader import load_model

    options = load_options or {}
    return load_model(path, dtype=options.get("dtype"), quantization=options.get("quantization", "auto"),
                      activations=options.get("activations", "int16"))


class Engine(EmbeddingMixin):
    """An LLM engine with continuous batching. Use as a context manager or call close().
    Embeddings and scores: ``embed``, ``aembed``, ``rerank``, ``score`` (engine/embedding/api.py).

    A thin facade over the engine thread (engine/core/runtime.py): templating and tokenization
    run here, on the caller's thread; the thread sees only token ids.
    """

    def __init__(self, model, tokenizer, *, draft=None, **options):
        """``options``: the runtime fields of EngineConfig (max_model_len, max_num_seqs, ...).
        ``draft``: for speculative="draft", the loaded draft model (else it is loaded from
        draft_model); its tokenizer must be the model's (InvalidParameterError otherwise)."""
        from .heap import limit_arenas
        from .tokenizer import Tokenizer, load_tokenizer

        limit_arenas()  # before the engine's threads first allocate
        config = EngineConfig.from_options(options, allow_load=False)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if config.speculative_method == "draft" and draft is None:
            from .core.draft import check_draft_width

            _check_draft(config.draft_model, self.tokenizer)
            draft = _load_draft(config.draft_model)
            check_draft_width(model, draft)
        self.model = model
        self.config = config.resolve(getattr(model, "max_model_len", None))
        if hasattr(model, "kv_cache_bytes"):  # before the cache is allocated (the weights are resident)
            check_memory(self.config, model.kv_cache_bytes(self.config.kv_cache_tokens, self.config),
                         param=_sizing_option(config))
        self.model_path: str | None = None  # set by from_pretrained
        self._core = EngineCore(model, self.tokenizer, self.config, draft)
        # Collected without close() (a re-run notebook cell): stop the thread, which frees the
        # model and the KV cache. The finalizer holds the core, never the Engine.
        self._finalizer = weakref.finalize(self, EngineCore.close, self._core)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, progress: bool = False,
                        **options) -> Engine:
        """Load a .gguf file or a Hugging Face directory (None: the embedded SmolLM2-135M-Instruct).

        ``options``: any EngineConfig field, load options (dtype, quantization, num_threads) included.
        The files are checked (ModelFileError) and the tokenizer loaded before any weights.
        ``progress=True`` shows the load's stages (a tqdm bar on a terminal or in Jupyter, log
        lines otherwise). A model this process already holds for another engine (same file,
        same load options) is shared, not loaded again.
        """
        from .core.draft import check_draft_width
        from .heap import limit_arenas
        from .loader import default_model_path, load_model, release_free_heap
        from .models.threads import apply_thread_policy
        from .startup import LoadProgress, check_startup
        from .tokenizer import load_tokenizer

        limit_arenas()  # before the load's threads (the kernels' pool, torch's) first allocate
        if "prefix_cache_dir" not in options and "ipykernel" in sys.modules:  # a notebook: on by default
            from .core.prefix_disk import default_prefix_cache_dir

            options = {**options, "prefix_cache_dir": default_prefix_cache_dir()}
        config = EngineConfig.from_options(options)
        apply_thread_policy(config.num_threads)
        path = default_model_path() if model is None else os.fspath(model)
        runtime_options = {k: v for k, v in options.items() if k not in config.load_options}
        num_stages = 5 if config.speculative_method == "draft" else 4
        with LoadProgress(_display_name(path), num_stages=num_stages, enabled=progress) as load:
            load.stage("checking files")
            key = _model_key(path, config)
            loaded = _shared_models.get(key) if key else None
            # The files, then the KV cache and the weights still to load against the memory, before either.
            check_startup(path, config, weights_loaded=loaded is not None)
            load.stage("loading tokenizer")
            tokenizer = load_tokenizer(path)
            if config.speculative_method == "draft":  # a wrong draft stops the start before any weights load
                _check_draft(config.draft_model, tokenizer)
            load.stage("loading weights")
            if loaded is None:
                loaded = load_model(path, dtype=config.dtype, quantization=config.quantization,
                                    activations=config.activations)
                try:
                    _shared_models[key] = loaded
                except TypeError:  # a model type without weak references: not shared
                    pass
            draft = None
            if config.speculative_method == "draft":
                load.stage("loading the draft model")
                draft_key = _model_key(config.draft_model, config)
                draft = _shared_models.get(draft_key) if draft_key else None  # a model drafting for itself: shared
                if draft is None:
                    draft = _load_draft(config.draft_model, config.load_options)
                    try:
                        _shared_models[draft_key] = draft
                    except TypeError:
                        pass
                check_draft_width(loaded, draft)
            if config.prefix_cache_dir is not None and getattr(loaded, "file_identity", None) is None:
                from .core.prefix_disk import file_identity

                loaded.file_identity = {"files": file_identity(path), "load": config.load_options}
            load.stage("allocating KV cache")
            eng = cls(loaded, tokenizer, draft=draft, **runtime_options)
        release_free_heap()
        eng.model_path = path
        return eng

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_waiting(self) -> int:
        return self.config.max_waiting

    @property
    def kv_cache(self):
        return self._core.kv_cache

    # ----- lifecycle -----
    def close(self) -> None:
        self._finalizer()  # EngineCore.close, once

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_alive(self) -> bool:
        return self._core.is_alive()

    def stats(self) -> dict:
        """The engine thread's counters, and ``product_routes``: per quantized product shape
        ("layout NxK"), the route each row count takes (engine.models.routes; {} when fixed)."""
        from .models.routes import summary

        product_routes = summary(getattr(self.model, "product_routes", None) or {})
        return {**self._core.stats(), "product_routes": product_routes}

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "closed"
        name = _display_name(self.model_path) if self.model_path else type(self.model).__name__
        return f"<Engine {name} max_model_len={self.max_model_len} {state}>"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        from .display import describe_engine

        printer.text(repr(self) if cycle else describe_engine(self))

    def _repr_html_(self) -> str:
        from .display import engine_html

        return engine_html(self)

    def abort(self, request_id: str) -> None:
        self._core.abort(request_id)

    # ----- requests -----
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Submit one prompt (text, or token ids) and return its event iterator."""
        return self.submit(self._prompt_ids(prompt), params, request_id)

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None,
                    request_id: str | None = None, tools: list[dict] | None = None, tool_choice=None,
                    parallel_tool_calls: bool = True, chat_template_kwargs: dict | None = None) -> RequestStream:
        """Apply the chat template to OpenAI-style messages and stream the reply.

        ``tools`` / ``tool_choice``: OpenAI's (engine/tools): events then carry content as ``text``
        and call pieces as ``tool_calls``. A template that writes ``<think>`` blocks puts the
        reply's reasoning in ``reasoning_content`` (engine/reasoning.py). ``chat_template_kwargs``:
        more template variables, e.g. ``{"enable_thinking": False}``."""
        return self._submit_chat(self.submit, messages, params, request_id, tools, tool_choice,
                                 parallel_tool_calls, chat_template_kwargs)

    def _submit_chat(self, submit, messages, params, request_id, tools, tool_choice, parallel_tool_calls,
                     chat_template_kwargs):
        """The chat path of both twins (``submit``: self.submit or self._asubmit)."""
        chat = prepare_chat(self.tokenizer, messages, params, tools, tool_choice, parallel_tool_calls,
                            chat_template_kwargs)
        try:
            return submit(chat.prompt_ids, chat.params, request_id, prompt_param="messages",
                          event_filter=chat.event_filter)
        except InvalidParameterError as exc:
            raise chat.error(exc) from None

    def prepare_infill(self, prefix, suffix, params: SamplingParams | None = None,
                       extra_files: list[dict] | None = None) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params) of a fill-in-the-middle request (engine/infill.py): the model's FIM
        tokens around ``prefix`` and ``suffix`` (text or token ids), with ``extra_files``
        ([{filename, text}]) as llama.cpp's repo-level context. No FIM tokens: InvalidParameterError
        naming ``suffix``."""
        from .infill import prepare_infill

        return prepare_infill(self.tokenizer, prefix, suffix, params, extra_files)

    def stream_infill(self, prefix, suffix, params: SamplingParams | None = None,
                      extra_files: list[dict] | None = None, request_id: str | None = None) -> RequestStream:
        """Stream the middle between ``prefix`` and ``suffix``; generation ends at EOS or a FIM end token."""
        prompt_ids, params = self.prepare_infill(prefix, suffix, params, extra_files)
        return self.submit(prompt_ids, params, request_id)

    def infill(self, prefix, suffix, params: SamplingParams | None = None,
               extra_files: list[dict] | None = None) -> Completion:
        """The Completion of the code between ``prefix`` and ``suffix`` (fill-in-the-middle)."""
        return self.stream_infill(prefix, suffix, params, extra_files).collect()

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
               prompt_param: str = "prompt", outputs: queue.SimpleQueue | None = None,
               event_filter=None) -> RequestStream:
        """Submit prompt token ids. ``prompt_param`` names the prompt in errors ("prompt", "messages").
        ``outputs``: the queue the engine thread puts this request's events on (default: a new one).
        ``event_filter``: applied to every event the stream hands out (tool-call parsing)."""
        return RequestStream(self._core, self._submit_request(prompt_ids, params, request_id, prompt_param, outputs),
                             prompt_ids, owner=self, event_filter=event_filter)

    def _submit_request(self, prompt_ids, params, request_id, prompt_param, outputs):
        request = self._core.make_request(prompt_ids, params, request_id, prompt_param)
        if outputs is not None:
            request.group.outputs = outputs
        self._core.submit(request)
        return request

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidParameterError("prompt must be a string or a list of token ids", "prompt")

    def submit_batch(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                     request_id: str | None = None, prompt_param: str = "prompt",
                     add_special_tokens: bool = True) -> RequestStream:
        """Submit several prompts (text, encoded here, or token ids) as one request: one stream whose
        events carry ``index`` = prompt number * n + choice (the OpenAI order of a batched completion)."""
        first, prompts = self._submit_group(prompts, params, request_id, prompt_param, add_special_tokens, None)
        return RequestStream(self._core, first, prompts[0], owner=self)

    def _submit_group(self, prompts, params, request_id, prompt_param, add_special_tokens, outputs):
        if not prompts:
            raise InvalidParameterError(f"{prompt_param} must hold at least one prompt", prompt_param)
        prompts = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
                   for p in prompts]
        first = self._core.make_request(prompts[0], params, request_id,
                                        prompt_param if len(prompts) == 1 else f"{prompt_param}[0]")
        for i, prompt_ids in enumerate(prompts[1:], start=1):
            self._core.make_request(prompt_ids, params, prompt_param=f"{prompt_param}[{i}]", group=first.group)
        if outputs is not None:
            first.group.outputs = outputs
        self._core.submit(first.group)
        return first, prompts

    def cache_prompt(self, prompt: str | list[int]) -> int:
        """Compute a prompt's KV blocks into the prefix cache (mlx-lm's ``cache_prompt``) and, with
        ``prefix_cache_dir``, wait until they are on disk: a later request, or a later engine on the
        same directory, starting with this prompt prefills only what follows its last full block.
        Returns the prompt tokens now cached (its full blocks)."""
        prompt_ids = self._prompt_ids(prompt)
        self.submit(prompt_ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)).collect()
        self._core.flush_disk()
        block_size = self.config.block_size
        return len(prompt_ids) // block_size * block_size if self.config.enable_prefix_caching else 0

    # ----- one-shot wrappers -----
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Run many prompts batched together; returns completions in prompt order (with n > 1,
        the n choices of each prompt in a row). The prompts reach the engine at once (its first tick
        meets them all, so a run's numbers do not depend on thread timing): a list that would take
        the waiting requests past ``max_waiting`` raises EngineOverloaded before any runs.

        ``progress=True``: a tqdm.auto bar that advances as requests finish (in any order)."""
        pairs = self._generate_pairs(prompts, params)
        ended: queue.SimpleQueue = queue.SimpleQueue()  # each request's index as it ends
        streams: list[RequestStream] = []
        try:
            made = self._make_requests(pairs)
            for index, (request, _) in enumerate(made):
                request.group.ended, request.group.end_key = ended, index
            self._core.submit_many([request for request, _ in made])
            streams = [RequestStream(self._core, request, prompt_ids, owner=self) for request, prompt_ids in made]
            # Wait for the ends only (no wake-up per token), then fold what queued.
            if progress:
                from tqdm.auto import tqdm

                with tqdm(total=len(streams), desc="generate", unit="req") as bar:
                    for _ in streams:
                        if self._wait_finished(ended) < 0:
                            break
                        bar.update(1)
            else:
                for _ in streams:
                    if self._wait_finished(ended) < 0:
                        break
            return [c for stream in streams for c in stream.collect_choices()]  # in prompt order
        finally:
            for stream in streams:
                stream.close()

    def _make_requests(self, pairs) -> list[tuple]:
        """(request, prompt ids) per (prompt, params) pair, none submitted yet: generate and agenerate
        hand them to the engine together (submit_many), so its first tick meets every prompt in every
        run alike (one at a time, a tick could start between two: other row counts, other rounding)."""
        made = []
        for prompt, p in pairs:
            prompt_ids = self._prompt_ids(prompt)
            made.append((self._core.make_request(prompt_ids, p), prompt_ids))
        return made

    def _wait_finished(self, finished: queue.SimpleQueue) -> int:
        while True:
            try:
                return finished.get(timeout=1.0)
            except queue.Empty:
                if not self._core.is_alive():
                    return -1  # collect() raises EngineDead for the requests left

    @staticmethod
    def _generate_pairs(prompts, params) -> list[tuple[object, SamplingParams | None]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or not prompts:
            raise InvalidParameterError("prompts must be a non-empty list of strings or of token-id lists", "prompts")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidParameterError(f"params has {len(params)} entries for {len(prompts)} prompts", "params")
            return list(zip(prompts, params))
        return [(prompt, params) for prompt in prompts]

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool = True,
             chat_template_kwargs: dict | None = None) -> Completion | list[Completion]:
        """The reply's Completion; with params.n > 1, the list of the n choices' Completions.
        With tools, ``Completion.tool_calls`` holds the calls and ``text`` the content around them;
        ``reasoning_content`` the reasoning of a template with ``<think>`` blocks."""
        stream = self.stream_chat(messages, params, tools=tools, tool_choice=tool_choice,
                                  parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs)
        return stream.collect_reply()

    # ----- async twins (engine/async_stream.py): same arguments, never block the event loop -----
    def _asubmit(self, prompt_ids: list[int], params, request_id, prompt_param: str = "prompt", event_filter=None):
        import asyncio

        from .async_stream import AsyncRequestStream, LoopQueue

        outputs = LoopQueue(asyncio.get_running_loop())
        request = self._submit_request(prompt_ids, params, request_id, prompt_param, outputs)
        return AsyncRequestStream(self._core, request, prompt_ids, outputs, owner=self, event_filter=event_filter)

    def astream(self, prompt: str | list[int], params: SamplingParams | None = None,
                request_id: str | None = None):
        """``async for event in eng.astream(...)``; call it inside a coroutine (it binds to the running loop)."""
        return self._asubmit(self._prompt_ids(prompt), params, request_id)

    def astream_chat(self, messages: list[dict], params: SamplingParams | None = None,
                     request_id: str | None = None, tools: list[dict] | None = None, tool_choice=None,
                     parallel_tool_calls: bool = True, chat_template_kwargs: dict | None = None):
        return self._submit_chat(self._asubmit, messages, params, request_id, tools, tool_choice,
                                 parallel_tool_calls, chat_template_kwargs)

    def astream_infill(self, prefix, suffix, params: SamplingParams | None = None,
                       extra_files: list[dict] | None = None, request_id: str | None = None):
        """The async twin of ``stream_infill``; call it inside a coroutine."""
        prompt_ids, params = self.prepare_infill(prefix, suffix, params, extra_files)
        return self._asubmit(prompt_ids, params, request_id)

    async def ainfill(self, prefix, suffix, params: SamplingParams | None = None,
                      extra_files: list[dict] | None = None) -> Completion:
        return await self.astream_infill(prefix, suffix, params, extra_files).collect()

    def asubmit_batch(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                      request_id: str | None = None, prompt_param: str = "prompt",
                      add_special_tokens: bool = True):
        """The async twin of ``submit_batch``; call it inside a coroutine (it binds to the running loop)."""
        import asyncio

        from .async_stream import AsyncRequestStream, LoopQueue

        outputs = LoopQueue(asyncio.get_running_loop())
        first, prompts = self._submit_group(prompts, params, request_id, prompt_param, add_special_tokens, outputs)
        return AsyncRequestStream(self._core, first, prompts[0], outputs, owner=self)

    async def agenerate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                        progress: bool = False) -> list[Completion]:
        """Like generate (its prompts reach the engine at once too); cancelling the awaiting task
        aborts every request still running."""
        import asyncio

        from .async_stream import AsyncRequestStream, LoopQueue

        pairs = self._generate_pairs(prompts, params)
        streams = []
        bar = None

        async def run(stream) -> list[Completion]:
            completions = await stream.collect_choices()
            if bar is not None:
                bar.update(1)
            return completions

        try:
            loop, made = asyncio.get_running_loop(), self._make_requests(pairs)
            for request, _ in made:
                request.group.outputs = LoopQueue(loop)
            self._core.submit_many([request for request, _ in made])
            streams = [AsyncRequestStream(self._core, request, prompt_ids, request.group.outputs, owner=self)
                       for request, prompt_ids in made]
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(streams), desc="generate", unit="req")
            return [c for choices in await asyncio.gather(*(run(stream) for stream in streams)) for c in choices]
        finally:
            for stream in streams:
                stream.close()
            if bar is not None:
                bar.close()

    async def achat(self, messages: list[dict], params: SamplingParams | None = None,
                    tools: list[dict] | None = None, tool_choice=None,
                    parallel_tool_calls: bool = True,
                    chat_template_kwargs: dict | None = None) -> Completion | list[Completion]:
        stream = self.astream_chat(messages, params, tools=tools, tool_choice=tool_choice,
                                   parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs)
        return await stream.collect_reply()
