"""The async end of a request: ``async for event in eng.astream(...)``.

The engine thread still does one ``put`` per event on the request's own queue. The queue
here is a SimpleQueue that, after the put, wakes the event loop only when the consumer is
parked (``loop.call_soon_threadsafe`` on a future): a consumer that fell behind drains what
queued up without waking (yielding to the loop every READY_BURST events), and one that keeps up
first sleeps on the loop's timer until the next tick's events are due (engine/core/pacing.py),
so while ticks are short and steady it finds them queued and costs the engine thread no wake.
No thread of an executor is held per stream, so thousands of streams can wait on one loop.

Cancelling the task that awaits (``task.cancel()``, a client that went away in an ASGI app,
``asyncio.timeout``) closes the stream, which aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import queue

from .core.pacing import time_to
from .errors import EngineDead
from .outputs import Completion, StreamEvent
from .request_stream import BaseRequestStream

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

    async def next_item(self, is_alive, events_due) -> object:
        """The next item, parked on the loop (never blocking it) until the engine puts one;
        ``events_due``: EngineCore.events_due, when the next tick's events should be queued."""
        wait = time_to(events_due, self.empty)
        if wait:
            await asyncio.sleep(wait)
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


class AsyncRequestStream(BaseRequestStream):
    """Async iterator over one request's StreamEvents; ``aclose()`` or cancelling aborts the request.
    All but the waiting is BaseRequestStream's (engine/request_stream.py), shared with the sync stream."""

    def __init__(self, core, request, prompt_token_ids: list[int], outputs: LoopQueue, owner: object = None,
                 event_filter=None):
        super().__init__(core, request, prompt_token_ids, owner, event_filter)
        self._outputs = outputs  # the request's queue (group.outputs), which wakes this loop

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        self._take_pending()
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._outputs.next_item(self._core.is_alive, self._core.events_due)
        except BaseException as exc:  # cancelled (or the engine died): the request goes too
            self.close()
            if isinstance(exc, EngineDead):
                raise EngineDead(self._core.dead_message) from None
            raise
        event = self._event(item)
        if event is None:
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        self.close()

    async def collect(self) -> Completion:
        """Run the request to its end and fold its events into one Completion (then close)."""
        self._check_one_choice()
        return (await self.collect_choices())[0]

    async def collect_choices(self) -> list[Completion]:
        """One Completion per choice, in index order (one CompletionFold each, as the sync stream)."""
        folds = self._new_folds()
        try:
            async for event in self:
                folds[event.index].add(event)
        finally:
            self.close()
        return self._completions(folds)
