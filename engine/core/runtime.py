"""The engine thread: one loop that owns the model and runs ticks.

schedule -> forward -> sample -> update -> one loop over the sampled sequences that runs
each request's text pipeline (detokenizer + stops) and puts one StreamEvent per request on
its queue. Callers reach the thread only through the public methods below (``make_request``,
``submit``, ``abort``, ``close`` and the read-only ``num_waiting``/``dead_message``/``stats``),
which talk to it through two deques (new requests, aborts) and a wake-up event; results
leave through each request's own SimpleQueue, so a token costs one queue put (one lock) on
the way out.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import secrets
import threading
import time
import traceback

import numpy as np
import torch

from cext.emit import emit_rows

from ..batch import LogitsBuffer
from ..config import EngineConfig
from ..errors import EngineDead, EngineError, EngineOverloaded, InvalidParameterError, SchedulerRefused
from ..heap import release_free_heap
from ..outputs import StreamEvent, TokenLogprob
from ..params import SamplingParams
from ..sampling import sampler
from ..structured import mask_rows
from ..tokenizer.token_bytes import TokenPieces
from .block_manager import prefix_block_hashes
from .draft import DraftModel
from .output_worker import DEFER_MIN_FORWARD_S, DEFER_MIN_ROWS, Deferred, OutputWorker
from .pacing import TickClock
from .prefix_disk import make_prefix_disk_cache
from .request import Request, RequestGroup
from .scheduler import Scheduler, SchedulerConfig
from .speculative import make_spec_decoder

# A forward is followed by malloc_trim at most once every TRIM_HEAP_INTERVAL_S (EngineCore._trim_after).
TRIM_HEAP_INTERVAL_S = 1.0

log = logging.getLogger("engine")

FINISHED = object()  # queue sentinel after the last event


class _TickRequests:
    """The requests of a tick's sampled rows and what the sampler takes from them, made once per
    SchedulerOutput: a decode-only output is reused while the running set stays, and so is this."""

    __slots__ = ("out", "reqs", "params", "generators", "grammars", "adjusters", "is_plain")

    def __init__(self, out, requests: dict):
        self.out = out
        self.reqs = reqs = [requests[s.request_id] for s in out.sample_seqs]
        self.params = [r.params for r in reqs]
        self.generators = [r.generator for r in reqs]
        grammars = [r.grammar for r in reqs]
        adjusters = [r.adjuster for r in reqs]
        self.grammars = grammars if grammars.count(None) != len(reqs) else None
        self.adjusters = adjusters if adjusters.count(None) != len(reqs) else None
        # Every row's output is text, an event and the tick's finish verdict (no grammar, no logits
        # processing to feed, no logprobs, no followers waiting for a prefill).
        self.is_plain = (self.grammars is None and self.adjusters is None
                         and not any(p.logprobs for p in self.params) and not any(r.followers for r in reqs))


class EngineCore:
    def __init__(self, model, tokenizer, config: EngineConfig, draft_model=None):
        """``config`` is resolved (EngineConfig.resolve): max_model_len and kv_cache_tokens are set.
        ``draft_model``: the loaded model for speculative="draft" (tokenizer checked by the caller)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv_cache = model.make_kv_cache(config.num_blocks, config.block_size)
        # Sliding layers (Gemma 2/3) keep only their window's blocks (engine.core.block_manager).
        has_sliding = bool(getattr(self.kv_cache, "sliding_layers", ()))
        draft = None
        if draft_model is not None:  # its own pool of the target's size, plus room for the proposals
            extra = config.max_num_seqs * (-(-config.num_speculative_tokens // config.block_size) + 1)
            draft = DraftModel(draft_model, config.num_blocks + extra, config.block_size, config.max_num_seqs,
                               config.max_model_len)
        self.spec = make_spec_decoder(config.speculative_method, config.num_speculative_tokens, draft)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            target_tick_seconds=config.target_tick_seconds,
            sliding_window=model.window if has_sliding else None,
            window_slack=config.num_speculative_tokens if self.spec is not None else 0,
        ))
        self.scheduler.spec = self.spec
        if has_sliding:
            self.scheduler.on_window_dropped = self.kv_cache.drop_window_blocks
        self.disk = make_prefix_disk_cache(config, model, self.kv_cache)  # None unless prefix_cache_dir
        self.scheduler.disk = self.disk
        self.pieces = TokenPieces(tokenizer)
        self.requests: dict[str, Request] = {}  # running or waiting choices, by their own id
        self.groups: dict[str, RequestGroup] = {}  # unfinished submissions, by their public id
        self._new: collections.deque[RequestGroup] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._jobs: collections.deque = collections.deque()  # encoders' embedding/scoring jobs (engine/embedding)
        self._tick_rows = None  # a decoder's embedding rows in the ticks (engine/embedding/tick_rows.py)
        self._submit_lock = threading.Lock()  # submit's check-then-append, never taken per token
        self._live_ids: set[str] = set()  # submitted and not finished (added under _submit_lock)
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self.error: BaseException | None = None
        self.num_generated_tokens = 0
        self.num_ticks = 0
        self._last_trim = -math.inf  # time.monotonic() of the last heap trim (_trim_after): the first forward trims
        self._logits_buffer = LogitsBuffer()  # the ticks' logits, one map reused (engine.batch)
        self._tick_requests: _TickRequests | None = None
        self._tick_listeners: list = []  # called after each tick (add_tick_listener), shared with the worker
        # A steady tick's output loop runs beside the next forward (engine/core/output_worker.py)
        # once forwards last this long, for this many rows; tests set 0 and 1 to defer every steady
        # tick, an infinite time to defer none.
        self.defer_min_forward_s = DEFER_MIN_FORWARD_S
        self.defer_min_rows = DEFER_MIN_ROWS
        self._last_forward_s = 0.0
        self.clock = TickClock()  # when forwards start: threads paced by them (engine/core/pacing.py)
        self._output = OutputWorker(self._tick_listeners, self.clock)  # not the core: a dropped engine is collected
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    # ----- caller side (any thread) -----
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def dead_message(self) -> str:
        if self.error is not None:
            return f"engine thread died: {type(self.error).__name__}: {self.error}"
        return "engine is closed"

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running: in the hand-over deque or the scheduler's queue."""
        return sum(len(g.requests) for g in list(self._new)) + self.scheduler.num_waiting

    def stats(self) -> dict:
        sched = self.scheduler
        spec = self.spec
        rows = self._tick_rows
        is_alive = self.is_alive()
        return {
            "num_running": sched.num_running if is_alive else 0,
            "num_waiting": self.num_waiting if is_alive else 0,
            "kv_usage": sched.kv_usage() if is_alive else 0.0,
            "num_generated_tokens": self.num_generated_tokens,
            "num_ticks": self.num_ticks,
            "num_preemptions": sched.num_preemptions,
            "num_prefix_cache_hit_tokens": sched.num_prefix_cache_hit_tokens,
            "num_prefix_cache_query_tokens": sched.num_prefix_cache_query_tokens,
            "num_prefix_cache_disk_hit_tokens": sched.num_prefix_cache_disk_hit_tokens,
            **(self.disk.stats() if self.disk is not None else {}),
            "spec_decode_num_draft_tokens": spec.num_draft_tokens if spec is not None else 0,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens if spec is not None else 0,
            "spec_decode_acceptance_rate": spec.acceptance_rate if spec is not None else 0.0,
            "num_embedding_tokens": rows.num_tokens if rows is not None else 0,
            "num_mixed_ticks": rows.num_mixed_ticks if rows is not None else 0,
        }

    def make_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, prompt_param: str = "prompt",
                     group: RequestGroup | None = None) -> Request:
        """A Request for this engine's model and limits (typed errors name the bad field): the
        leader of ``params.n`` choices, added to ``group`` (batched prompts) or to a new group."""
        if not getattr(self.model, "can_generate", True):
            raise InvalidParameterError(
                f"{type(self.model).__name__} is an embedding model: it serves embed, rerank and score, not "
                "generation", "model")
        if group is not None:
            request_id = group.request_id
        elif request_id is None:
            request_id = f"req-{self._id_prefix}-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidParameterError(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"params must be a SamplingParams, got {type(params).__name__}",
                                        "params")
        request = Request.create(
            request_id, prompt_ids, params, tokenizer=self.tokenizer,
            vocab_size=self.model.vocab_size, max_model_len=self.max_model_len, prompt_param=prompt_param,
            group=group)
        if self.disk is not None:  # here, on the caller's thread: the engine thread only copies them in
            self._read_ahead(request.seq)
        return request

    def _read_ahead(self, seq) -> None:
        """Read the prompt's full blocks the memory cache lacks from the disk tier (PrefixDiskCache.read)."""
        if seq.next_prompt_logprob_pos >= 0:  # prompt logprobs compute every prompt row
            return
        bs = self.config.block_size
        seq.block_hashes = prefix_block_hashes(seq.token_array, seq.num_prompt_tokens // bs, bs)
        max_hits = min(len(seq.block_hashes), (seq.num_prompt_tokens - 1) // bs)
        in_memory = self.scheduler.block_manager.hash_to_block  # read only: a miss here is a hint
        first = 0
        while first < max_hits and seq.block_hashes[first] in in_memory:
            first += 1
        if first < max_hits:
            seq.disk_blocks = self.disk.read(seq.block_hashes[:max_hits], first)

    def submit(self, request: Request | RequestGroup) -> None:
        """Hand a request (all choices of its group) to the engine thread. Raises EngineDead, or
        EngineOverloaded when ``max_waiting`` requests already wait (the ones not yet picked up count too)."""
        self.submit_many([request])

    def submit_many(self, requests) -> None:
        """Hand several requests to the engine thread at once: its next tick meets all of them or
        none (one at a time, a tick could start between two and prefill the first alone: other row
        counts, other rounding, so ``Engine.generate``'s output would depend on thread timing).
        All or nothing: raises as ``submit`` does, before any is handed over, for the first request
        that would be refused (a request id in use, twice in the list, or past ``max_waiting``)."""
        groups = [r if isinstance(r, RequestGroup) else r.group for r in requests]
        with self._submit_lock:
            if not self.is_alive():
                raise EngineDead(self.dead_message)
            num_waiting = self.num_waiting
            ids = set()
            for group in groups:
                if group.request_id in self._live_ids:
                    raise InvalidParameterError(
                        f"request_id {group.request_id!r} is already in use by a running request", "request_id")
                if group.request_id in ids:
                    raise InvalidParameterError(f"request_id {group.request_id!r} is given twice", "request_id")
                if num_waiting >= self.config.max_waiting:
                    raise EngineOverloaded(f"too many waiting requests ({num_waiting}); retry later")
                ids.add(group.request_id)
                num_waiting += len(group.requests)
            self._live_ids.update(ids)
            self._new.extend(groups)  # one C call under the GIL: the engine thread's drain sees all or none
        self._wake.set()

    def submit_job(self, job) -> None:
        """Run ``job.step(is_busy)`` on the engine thread, once between two ticks, until it returns
        True (engine/embedding/runner.py); ``is_busy``: generation is running or waiting. A step
        that raises fails the job (``job.fail(exc)``), never the engine. Raises EngineDead."""
        with self._submit_lock:
            if not self.is_alive():
                raise EngineDead(self.dead_message)
            self._jobs.append(job)
        self._wake.set()

    def set_tick_rows(self, rows) -> None:
        """Let ``rows`` add rows to every tick's forward (engine/embedding/tick_rows.py): before a tick,
        ``rows.budget(scheduler)`` tokens of its budget are kept for them and ``rows.take(n,
        block_manager)`` returns a part (or None) that ``rows.merge(batch, part)`` appends to the
        batch; the forward's hidden states of ``part.hidden_rows`` go to ``rows.put(part, hidden,
        block_manager)``, a failed forward to ``rows.fail_part``. ``rows.has_work()`` keeps the loop
        running; ``rows.fail(exc)`` when the engine stops."""
        self._tick_rows = rows

    def add_tick_listener(self, fn) -> None:
        """Call ``fn()`` (no arguments, quick, never raising, thread-safe) after every tick and when
        the engine stops: the tick's events are on their queues by then (on the engine thread, or on
        its output worker for a tick whose output loop ran beside the next forward). One consumer that
        serves many streams (webapp.sse_pump) wakes once a tick this way, not once per stream."""
        with self._submit_lock:
            self._tick_listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._tick_listeners:
            fn()

    def events_due(self) -> float:
        """When (``time.perf_counter()``) the next tick's events should be on their queues and the
        engine thread in its forward, for a consumer whose queue is empty (engine/core/pacing.py);
        0.0 when forwards are not short and steady, or the last tick's output runs on the worker
        (its puts wake the consumer off the engine thread). Read without a lock."""
        return 0.0 if self._output.is_pending else self.clock.next_forward()

    def wake(self) -> None:
        """New work for the engine thread (a caller that queued it elsewhere, e.g. TickRows)."""
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a submission by its public id (every choice of it)."""
        self._aborts.append(request_id)
        self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self.disk is not None:  # the blocks handed to the writer reach the disk
                self.disk.close()

    def flush_disk(self, timeout: float = 60.0) -> bool:
        """Wait until the blocks computed so far are written to the disk tier (True when there is none)."""
        return self.disk is None or self.disk.flush(timeout)

    # ----- engine thread -----
    def _run(self) -> None:
        try:
            torch.set_grad_enabled(False)
            while not self._stopping:
                if self._aborts and self._output.is_pending:  # an abort's last event follows the tick's
                    self._settle_output()
                self._drain_inputs()
                if self._jobs:
                    self._step_job()
                rows = self._tick_rows
                if not self.scheduler.has_work() and (rows is None or not rows.has_work()):
                    if self._output.is_pending:
                        self._settle_output()
                        continue
                    if not self._jobs:
                        self._wake.wait()
                        self._wake.clear()
                    continue
                self._tick()
                if self._tick_listeners and not self._output.is_pending:  # else the worker wakes them
                    self._notify()
        except BaseException as exc:  # the thread itself failed: nobody may hang
            self.error = exc
            log.error("engine thread died:\n%s", traceback.format_exc())
        finally:
            self._stopping = True
            try:
                self._settle_output()
            except BaseException:  # the engine is going down: every request fails below
                log.exception("output worker failed")
            self._output.close()
            self._fail_all(EngineDead(self.dead_message))
            self._notify()

    def _drain_inputs(self) -> None:
        while self._new:
            group = self._new.popleft()
            self.groups[group.request_id] = group
            for req in group.leaders:
                if group.is_finished:  # a leader was refused: the group failed
                    break
                self._add(req)
        while self._aborts:
            group = self.groups.get(self._aborts.popleft())
            if group is None:
                continue
            for req in group.requests:
                if not req.is_finished:
                    if self.requests.pop(req.request_id, None) is not None:
                        self.scheduler.abort(req.request_id)
                    self._finish(req, "abort", text="")

    def _step_job(self) -> None:
        job = self._jobs.popleft()
        try:
            is_done = job.step(self.scheduler.has_work())
        except Exception as exc:  # a failed job fails its caller, not the engine
            log.exception("embedding job failed")
            job.fail(exc)
            return
        if not is_done:
            self._jobs.append(job)  # round robin with the other jobs

    def _add(self, req: Request) -> None:
        try:
            self.scheduler.add(req.seq)
        except SchedulerRefused as exc:
            self._fail(req.request_id, exc, req)
            return
        if self.spec is not None:  # every request may speculate (verification samples as plain decoding)
            req.seq.spec = self.spec.make_state()
        self.requests[req.request_id] = req

    def _tick(self) -> None:
        sched = self.scheduler
        tick_start = time.perf_counter()  # the verify budget's step times count the schedule too
        draft = self.spec.draft if self.spec is not None else None
        draft_seconds = draft.seconds if draft is not None else 0.0
        rows = self._tick_rows
        num_reserved = rows.budget(sched) if rows is not None and rows.has_work() else 0
        out = sched.schedule(num_reserved) if sched.has_work() else None
        part = rows.take(num_reserved, sched.block_manager) if num_reserved else None
        if out is None and part is None:
            self._wake.wait(0.001)
            return
        if part is not None:
            self._tick_with_rows(out, part)
            if out is None:
                return
        else:
            self.num_ticks += 1
            start = time.perf_counter()
            self.clock.forward_started(start)
            out.batch.logits_out = self._logits_buffer  # sampled before the next forward
            try:
                logits = self.model.forward(out.batch, self.kv_cache)  # [S, V]
            except Exception as exc:  # a failed forward fails the requests in it, not the engine
                log.exception("forward failed")
                self._fail_tick(out, exc)
                return
            self._last_forward_s = time.perf_counter() - start
            self._after_forward(out, logits)
            self._trim_after()
            if self.spec is not None:  # the step times of decode rows and proposals: the verify budget
                num_rows = out.batch.num_tokens
                if num_rows == len(out.seqs) + sum(len(e.draft) for e, _k, _first in out.spec_entries):
                    # the whole tick: a tick with proposals takes the general plan and its verified
                    # runs' output goes through Python per request, where a plain tick takes the
                    # steady Cython plan and one call for all rows' output (a share of a step that
                    # grows as products get faster: int8 activations, small models)
                    # but not the draft model's forwards, which the budget counts apart (per draft id
                    # and per id caught up): a tick that caught a prompt up would price its row count
                    # for good, the budget then never running that many rows again to see it cheaper
                    seconds = time.perf_counter() - tick_start
                    if draft is not None:
                        seconds -= draft.seconds - draft_seconds
                    self.spec.observe_step(num_rows, seconds, len(out.seqs))

    def _tick_with_rows(self, out, part) -> None:
        """A forward with embedding rows after the generation rows (if any): pooled, never sampled."""
        rows, bm = self._tick_rows, self.scheduler.block_manager
        batch = rows.merge(out.batch if out is not None else None, part)
        batch.logits_out = self._logits_buffer
        start = time.perf_counter()
        try:
            logits, hidden = self.model.forward_with_hidden(batch, self.kv_cache, part.hidden_rows)
            self._last_forward_s = time.perf_counter() - start
            rows.put(part, hidden, bm)
        except Exception as exc:
            log.exception("forward with embedding rows failed")
            rows.fail_part(part, exc, bm)
            if out is not None:
                self._fail_tick(out, exc)
            return
        if out is not None:
            self.num_ticks += 1
            rows.num_mixed_ticks += 1
            out.batch = batch  # the tick's cost counts the embedding rows too (the scheduler's estimates)
            self._after_forward(out, logits)
        self._trim_after()

    def _trim_after(self) -> None:
        """After a forward, at most once every TRIM_HEAP_INTERVAL_S, hand the heap pages freed
        since the last trim back to the OS (malloc_trim, 0.1-1.3 ms): glibc keeps them. A long
        prompt's chunks left the heap fragmented, so the resident size crept up chunk by chunk
        (Qwen2.5-Coder-1.5B: +130 MB over a 2,048-token prompt; the peak over `import torch`
        1,641 -> 1,510 MB with a trim after every chunk). Steady decode ticks free ~10 MB more
        than they keep (Gemma 3 270M through vs_llamacpp's workloads, one stream: the resident
        size besides the KV pages 330-333 -> 318-324 MB with a trim a second; see
        docs/performance.md). A trim and the page faults after it cost ~6 ms at most, 2% of a
        256-row chunk of SmolLM2, hence once a second."""
        now = time.monotonic()
        if now - self._last_trim >= TRIM_HEAP_INTERVAL_S:
            self._last_trim = now
            release_free_heap()

    def _fail_tick(self, out, exc: BaseException) -> None:
        self._settle_output()
        for seq in out.seqs:
            self._fail(seq.request_id, exc)

    def _after_forward(self, out, logits: torch.Tensor) -> None:
        deferred = self._output.join() if self._output.is_pending else None  # the last tick's output loop
        sample_seqs = out.sample_seqs
        tick_reqs = self._tick_requests
        if tick_reqs is None or tick_reqs.out is not out:
            tick_reqs = self._tick_requests = _TickRequests(out, self.requests)
        reqs = tick_reqs.reqs
        if out.prompt_logprob_spans:
            self._prompt_logprobs(out.prompt_logprob_spans, logits)
        if sample_seqs:
            index = out.sample_logit_index
            if len(index) != logits.shape[0]:  # prompt_logprobs rows too: keep the sampled ones
                rows = logits.index_select(0, torch.from_numpy(np.asarray(index, dtype=np.int64)))
            else:
                rows = logits
            if tick_reqs.grammars is not None:  # structured output: before sampling and logprobs (vLLM)
                rows = mask_rows(rows, tick_reqs.grammars)
            token_ids, row_logprobs = sampler.sample(rows, tick_reqs.params, tick_reqs.generators,
                                                     tick_reqs.adjusters)
        else:
            token_ids, row_logprobs = [], []
        runs = (self.spec.verify(out.spec_entries, logits, reqs, token_ids, row_logprobs)
                if out.spec_entries else None)
        self.scheduler.update(out, token_ids)
        if deferred is not None:  # its late stops end before this tick's output (their new ids dropped)
            self._apply_deferred(deferred, out)
        if not token_ids:
            return
        self.num_generated_tokens += len(token_ids)
        if out.is_decode_only and tick_reqs.is_plain:
            if (self._last_forward_s >= self.defer_min_forward_s and len(token_ids) >= self.defer_min_rows
                    and self.scheduler.num_ending == 0):
                self._output.hand_off(Deferred(reqs, token_ids, self.scheduler.state.finish_codes[:len(token_ids)]))
            else:
                self._emit_decodes(reqs, token_ids)
            return
        # Every sampled sequence's length, with its new token, in one read of the tick state.
        slots = out.slots if len(token_ids) == len(out.slots) else out.slots[out.sample_entries]
        lengths = self.scheduler.state.num_tokens[slots].tolist()
        for k, (req, token_id, lp, num_tokens) in enumerate(zip(reqs, token_ids, row_logprobs, lengths)):
            if req.is_finished:  # a stop string the last tick's deferred output found, or a failed group
                continue
            try:
                if runs and k in runs:
                    self._process_run(req, runs[k])
                else:
                    self._process_token(req, token_id, lp, num_tokens)
            except Exception as exc:
                log.exception("output processing failed for %s", req.request_id)
                self._fail(req.request_id, exc)

    def _emit_decodes(self, reqs: list[Request], token_ids: list[int]) -> None:
        """The output of a steady-state tick whose rows are all plain, in one call (cext.emit): per row
        its text and its event, with the tick's finish verdicts (cext.tick decode_commit: stop ids past
        min_tokens, max_tokens, max_model_len) in place of per-token checks; rows that end come back
        here in row order. The same events as _process_token."""

        def end_row(k: int, text: str | None, finish_reason: str | None) -> None:
            req = reqs[k]
            if finish_reason is None:  # more stop ids than the tick's table holds
                self._process_token(req, token_ids[k], None, req.seq.num_tokens)
                return
            self._end(req, text, token_ids[k], finish_reason)

        def fail_row(k: int, exc: BaseException) -> None:
            log.error("output processing failed for %s", reqs[k].request_id, exc_info=exc)
            self._fail(reqs[k].request_id, exc)

        emit_rows(reqs, token_ids, self.scheduler.state.finish_codes, StreamEvent, end_row, fail_row)

    def _end(self, req: Request, text: str, token_id: int, finish_reason: str) -> None:
        """A running choice's last event: it leaves the scheduler, then its queue gets the event."""
        group = req.group
        self.scheduler.finish(req.seq)
        self.requests.pop(req.request_id, None)
        group.outputs.put(StreamEvent(group.request_id, text, [token_id], None, finish_reason, req.index))
        self._mark_finished(req)

    def _settle_output(self) -> None:
        """Wait for a deferred output loop and apply what it found (no tick in flight)."""
        deferred = self._output.join()
        if deferred is not None:
            self._apply_deferred(deferred, None)

    def _apply_deferred(self, deferred: Deferred, out) -> None:
        """The rows a deferred output loop ended by a stop string finish now, with the event they
        would have had a tick earlier; ``out``: the tick since scheduled (its id for them is dropped
        and not counted). Rows whose processing raised fail their requests."""
        for req, exc in deferred.failures:
            log.error("output processing failed for %s", req.request_id, exc_info=exc)
            self._fail(req.request_id, exc)
        for req, token_id, text in deferred.late_stops:
            if req.is_finished:
                continue
            if out is not None and any(seq is req.seq for seq in out.sample_seqs):
                self.num_generated_tokens -= 1
            self._end(req, text, token_id, "stop")

    def _process_run(self, req: Request, run) -> None:
        """The ids a verified proposal emits, one event each, as if decoded one by one (the
        sequence's length steps with them, so stops, max_tokens and EOS cut the run there); a
        run verified in order samples its next row once the id before it is counted. Then
        the rejected rows are rolled back."""
        entry = run.entry
        num_tokens = self.scheduler.state.num_tokens
        num_emitted = 0
        while True:
            length = entry.num_tokens + num_emitted + 1
            num_tokens[entry.slot] = length  # what the sequence holds if it finishes here
            self._process_token(req, run.ids[num_emitted], run.logprobs[num_emitted], length)
            num_emitted += 1
            if req.is_finished or (num_emitted == len(run.ids) and not self.spec.sample_next(run, req)):
                break
        self.spec.finish_run(run)
        self.num_generated_tokens += num_emitted - 1  # the first is counted with the tick's
        if not req.is_finished:
            sched = self.scheduler
            self.spec.rollback(sched.state, sched.block_manager, entry, run.ids)

    def _process_token(self, req: Request, token_id: int, lp, num_tokens: int) -> None:
        """``num_tokens``: the sequence's length with ``token_id``."""
        params = req.params
        seq = req.seq
        if req.adjuster is not None:
            req.adjuster.add(token_id)
        is_grammar_done = False
        if req.grammar is not None:
            if token_id not in req.stop_ids:
                req.grammar.accept(token_id)
                is_grammar_done = req.grammar.is_finished  # complete: only EOS could follow
            if req.grammar.error is not None:  # never silently "stop" on a failed grammar
                raise EngineError(f"structured output failed: {req.grammar.error}")
        if req.followers:  # the leader has prefilled: its choices now find the prompt in the prefix cache
            followers, req.followers = req.followers, []
            for follower in followers:
                if not follower.is_finished:
                    self._add(follower)
            if req.is_finished:  # a follower was refused: the group failed
                return
        logprobs = [self._token_logprob(token_id, lp)] if lp is not None else None
        finish_reason = None
        num_generated = num_tokens - seq.num_prompt_tokens
        if token_id in req.stop_ids and num_generated > params.min_tokens:
            text, is_stopped = req.text.finish()  # the stop token's own text is not output
            finish_reason = "stop"
        else:
            text, is_stopped = req.text.add(token_id)
            if is_stopped:
                finish_reason = "stop"
            elif is_grammar_done:
                tail, _ = req.text.finish()
                text += tail
                finish_reason = "stop"
            elif num_generated >= params.max_tokens or num_tokens >= self.max_model_len:
                tail, is_stopped = req.text.finish()
                text += tail
                finish_reason = "stop" if is_stopped else "length"
        group = req.group
        event = StreamEvent(group.request_id, text, [token_id], logprobs, finish_reason, req.index)
        if finish_reason is not None:
            self.scheduler.finish(seq)
            self.requests.pop(req.request_id, None)
            group.outputs.put(event)
            self._mark_finished(req)
        else:
            group.outputs.put(event)

    def _token_logprob(self, token_id: int, lp) -> TokenLogprob:
        pieces = self.pieces
        top = [
            (tid, pieces.text_of(tid), list(pieces.bytes_of(tid)), val)
            for tid, val in zip(lp.top_ids, lp.top_logprobs)
        ]
        return TokenLogprob(token_id, pieces.text_of(token_id), list(pieces.bytes_of(token_id)), lp.logprob, top,
                            lp.rank)

    def _prompt_logprobs(self, spans, logits: torch.Tensor) -> None:
        for seq, first, count, first_pos in spans:
            req = self.requests.get(seq.request_id)
            if req is None or count == 0:
                continue
            prompt = req.seq.token_ids
            targets = [int(prompt[first_pos + 1 + j]) for j in range(count)]
            rows = sampler.prompt_logprobs(logits[first : first + count], targets, req.params.prompt_logprobs)
            for target, row in zip(targets, rows):
                req.prompt_logprobs.append(self._token_logprob(target, row))

    def _finish(self, req: Request, reason: str, text: str) -> None:
        req.outputs.put(StreamEvent(req.group.request_id, text, [], None, reason, req.index))
        self._mark_finished(req)

    def _mark_finished(self, req: Request) -> None:
        """One choice is done; the group's queue ends when its last choice is."""
        req.is_finished = True
        group = req.group
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            self.groups.pop(group.request_id, None)
            self._live_ids.discard(group.request_id)  # the id may be used again
            group.end(FINISHED)

    def _fail(self, request_id: str, exc: BaseException, req: Request | None = None) -> None:
        """A choice failed: its whole group fails (the caller's stream raises) and its other choices stop."""
        req = self.requests.get(request_id) if req is None else req
        if req is None:
            return
        group = req.group
        for choice in group.requests:
            if self.requests.pop(choice.request_id, None) is not None:
                self.scheduler.abort(choice.request_id)
            choice.is_finished = True
        group.num_unfinished = 0
        self.groups.pop(group.request_id, None)
        self._live_ids.discard(group.request_id)
        if isinstance(exc, ValueError):  # the scheduler refused the request (too long for the KV cache, ...)
            group.end(exc)
        else:
            group.end(EngineError(f"request {request_id} failed: {type(exc).__name__}: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        while self._jobs:
            self._jobs.popleft().fail(exc)
        if self._tick_rows is not None:
            self._tick_rows.fail(exc)
        pending = list(self.groups.values()) + list(self._new)
        self.requests.clear()
        self.groups.clear()
        self._new.clear()
        for group in pending:
            for req in group.requests:
                req.is_finished = True
            group.num_unfinished = 0
            self._live_ids.discard(group.request_id)
            group.end(exc)

