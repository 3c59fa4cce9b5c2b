"""The async end of a request: ``async for event in eng.astream(...)``.

The engine thread still does one ``put`` per event on the request's own queue. The queue
here is a SimpleQueue that, after the put, wakes the event loop only when the consumer is
parked (``loop.call_soon_threadsafe`` on a future): a consumer that keeps up costs one wake
per event, one that fell behind drains what queued up without waking (yielding to the loop
every READY_BURST events). No thread of
an executor is held per stream, so thousands of streams can wait on one loop.

Cancelling the task that awaits (``task.cancel()``, a client that went away in an ASGI app,
``asyncio.timeout``) closes the stream, which aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import queue

from .core.runtime import FINISHED
from .errors import EngineDead, InvalidParameterError
from .outputs import Completion, CompletionFold, StreamEvent

# Without a wake-up for this long, check that the engine thread is still alive.
ALIVE_CHECK_SECONDS = 1.0
# A consumer that keeps finding events queued yields to the loop after this many in a row, so
# a fast engine never starves the loop's other tasks (or a cancel waiting to be delivered).
READY_BURST = 16


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class LoopQueue(queue.SimpleQueue):
    """A request's output queue whose producer (the engine thread) wakes a parked asyncio consumer.

    Race-free under the GIL: the consumer publishes its future *before* it looks at the queue,
    the producer puts *before* it looks at the future, so one of them always sees the other.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.waiter: asyncio.Future | None = None
        self.num_taken_ready = 0  # items taken in a row without parking

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    async def next_item(self, is_alive) -> object:
        """The next item, parked on the loop (never blocking it) until the engine puts one."""
        while True:
            future = self.loop.create_future()
            self.waiter = future
            if not self.empty():
                self.waiter = None
                self.num_taken_ready += 1
                if self.num_taken_ready >= READY_BURST:  # let the loop run (and deliver a cancel)
                    self.num_taken_ready = 0
                    await asyncio.sleep(0)
                return self.get_nowait()
            self.num_taken_ready = 0
            # Not asyncio.wait_for: on 3.11 it can swallow a cancel that meets a wake-up.
            timer = self.loop.call_later(ALIVE_CHECK_SECONDS, _wake, future)
            try:
                await future
            finally:
                timer.cancel()
                self.waiter = None
            if self.empty() and not is_alive():
                raise EngineDead("engine thread is not running")


class AsyncRequestStream:
    """Async iterator over one request's StreamEvents; ``aclose()`` or cancelling aborts the request."""

    def __init__(self, core, request, prompt_token_ids: list[int], outputs: LoopQueue, owner: object = None,
                 event_filter=None):
        self._core = core
        self._filter = event_filter  # applied to every event handed out (tool-call parsing)
        self._owner = owner  # the Engine: kept alive while a stream is held
        self._request = request
        self._group = request.group
        self._outputs = outputs
        self.request_id = self._group.request_id
        self.prompt_token_ids = prompt_token_ids
        self._done = False
        self._pending: object = None  # the end or an error met by ready_events(), for __anext__

    @property
    def prompt_logprobs(self):
        return self._request.prompt_logprobs

    @property
    def num_choices(self) -> int:
        return len(self._group.requests)

    def choice_prompt_token_ids(self, index: int) -> list[int]:
        return self._group.requests[index].seq.prompt_token_ids

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission until the engine first scheduled the request (None: not yet)."""
        seq = self._request.seq
        return None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time

    def ready_events(self) -> list[StreamEvent]:
        """The events already queued, taken without waiting (as ``RequestStream.ready_events``); an
        error or the end met here is left for the next ``__anext__``."""
        events: list[StreamEvent] = []
        outputs = self._outputs
        while not self._done and not outputs.empty():
            item = outputs.get_nowait()
            if item is FINISHED or isinstance(item, BaseException):
                self._pending = item
                break
            events.append(item)
        return events

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        item, self._pending = self._pending, None
        try:
            if item is None:
                item = await self._outputs.next_item(self._core.is_alive)
        except BaseException as exc:  # cancelled (or the engine died): the request goes too
            self.close()
            if isinstance(exc, EngineDead):
                raise EngineDead(self._core.dead_message) from None
            raise
        if item is FINISHED:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item if self._filter is None else self._filter(item)

    def close(self) -> None:
        if not self._done:
            self._done = True
            if not self._group.is_finished:
                self._core.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    async def collect(self) -> Completion:
        """Run the request to its end and fold its events into one Completion (then close)."""
        if self.num_choices != 1:
            raise InvalidParameterError(f"this request has {self.num_choices} choices: use collect_choices()", "n")
        return (await self.collect_choices())[0]

    async def collect_choices(self) -> list[Completion]:
        """One Completion per choice, in index order (one CompletionFold each, as the sync stream)."""
        folds = [CompletionFold(self.request_id) for _ in range(self.num_choices)]
        try:
            async for event in self:
                folds[event.index].add(event)
        finally:
            self.close()
        requests = self._group.requests
        return [fold.result(self.prompt_token_ids if len(folds) == 1 else requests[i].seq.prompt_token_ids,
                            requests[i].prompt_logprobs, index=i) for i, fold in enumerate(folds)]
