"""RequestStream: the caller's end of one submitted request (all its choices).

Iterating yields StreamEvents as the engine thread puts them on the request's queue;
``ready_events`` drains what already queued without waiting; ``collect`` /
``collect_choices`` fold the events into Completions (the one fold, also used by the server).
Closing the stream (or dropping it) aborts the request. ``BaseRequestStream`` is all of it but
the waiting, shared with the async twin (engine/async_stream.py).
"""
from __future__ import annotations

import queue
from collections.abc import Callable

from .core.pacing import pace
from .core.runtime import FINISHED, EngineCore
from .errors import EngineDead, InvalidParameterError
from .outputs import Completion, CompletionFold, StreamEvent, TokenLogprob


class BaseRequestStream:
    """What the sync and the async end of a request share: the request's queue and choices, the
    event filter, the drain of what already queued, closing, and the fold into Completions.
    The subclasses only wait: a blocking ``get`` (RequestStream), a parked future (AsyncRequestStream)."""

    def __init__(self, core: EngineCore, request, prompt_token_ids: list[int], owner: object = None,
                 event_filter: Callable[[StreamEvent], StreamEvent] | None = None):
        self._core = core
        self._filter = event_filter  # applied to every event handed out (tool-call parsing, engine/tools)
        self._owner = owner  # the Engine: kept alive (its thread running) while a stream is held
        self._request = request
        self._group = request.group
        self._outputs = request.group.outputs
        self.request_id = self._group.request_id
        self.prompt_token_ids = prompt_token_ids
        self._done = False
        self._pending_error: BaseException | None = None  # met by ready_events(), raised by the next wait

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

    def _event(self, item) -> StreamEvent | None:
        """A queued item as the caller sees it: the filtered event, None at the end; raises an error."""
        if item is FINISHED:
            self._done = True
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item if self._filter is None else self._filter(item)

    def _take_pending(self) -> None:
        """Raise the error ready_events() met, once."""
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            self._done = True
            raise err

    def ready_events(self) -> list[StreamEvent]:
        """The events already queued, taken without waiting (the queue's lock is taken only to wait).

        A consumer that fell behind (a slow socket, a fast model) drains them after each
        ``next()`` and handles them at once: the SSE path writes them in one chunk. An error met
        here is raised by the next wait.
        """
        events: list[StreamEvent] = []
        outputs = self._outputs
        while not self._done and self._pending_error is None and not outputs.empty():
            item = outputs.get_nowait()
            if item is FINISHED:
                self._done = True
            elif isinstance(item, BaseException):
                self._pending_error = item
            else:
                events.append(item if self._filter is None else self._filter(item))
        return events

    @property
    def is_drained(self) -> bool:
        """Every item is taken: the end (FINISHED) or an error was met (take_error() hands the error out)."""
        return self._done or self._pending_error is not None

    def take_error(self) -> BaseException | None:
        """The error ready_events() met, once (the stream is then done), else None."""
        err, self._pending_error = self._pending_error, None
        if err is not None:
            self._done = True
        return err

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

    def _check_one_choice(self) -> None:
        if self.num_choices != 1:
            raise InvalidParameterError(
                f"this request has {self.num_choices} choices: use collect_choices()", "n")

    def _new_folds(self) -> list[CompletionFold]:
        return [CompletionFold(self.request_id) for _ in range(self.num_choices)]

    def _completions(self, folds: list[CompletionFold]) -> list[Completion]:
        """One Completion per choice, in index order."""
        return [fold.result(self.prompt_token_ids if len(folds) == 1 else self.choice_prompt_token_ids(i),
                            self.choice_prompt_logprobs(i), index=i) for i, fold in enumerate(folds)]

    def collect_reply(self):
        """``collect()`` for one choice, else ``collect_choices()`` (Engine.chat / achat)."""
        return self.collect() if self.num_choices == 1 else self.collect_choices()


class RequestStream(BaseRequestStream):
    """Iterator over one request's StreamEvents. Closing it (or dropping it) aborts the request.

    A request with n > 1 choices (or several prompts, ``Engine.submit_batch``) streams the
    events of all its choices, interleaved; ``StreamEvent.index`` says whose each one is.
    """

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamEvent:
        self._take_pending()
        if self._done:
            raise StopIteration
        outputs = self._outputs
        pace(self._core.events_due, outputs.empty)
        while True:
            try:
                item = outputs.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._core.is_alive() and outputs.empty():
                    self._done = True
                    raise EngineDead(self._core.dead_message) from None
        event = self._event(item)
        if event is None:
            raise StopIteration
        return event

    def collect(self, on_event: Callable[[StreamEvent], bool | None] | None = None) -> Completion:
        """Run the request to its end and fold its events into one Completion (then close).

        ``on_event(event)`` sees every event as it arrives; returning True stops early: the
        request is aborted and the Completion so far comes back with finish_reason "abort".
        For a request of several choices use ``collect_choices``.
        """
        self._check_one_choice()
        return self.collect_choices(on_event)[0]

    def collect_choices(self, on_event: Callable[[StreamEvent], bool | None] | None = None) -> list[Completion]:
        """Like ``collect``, one Completion per choice, in index order (one CompletionFold each)."""
        folds = self._new_folds()
        try:
            for event in self:
                folds[event.index].add(event)
                if on_event is not None and on_event(event) and event.finish_reason is None:
                    for fold in folds:
                        fold.finish_reason = fold.finish_reason or "abort"
                    break
        finally:
            self.close()
        return self._completions(folds)

