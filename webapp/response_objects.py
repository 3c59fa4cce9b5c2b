"""The Responses API's wire shapes: the Response object, its output items, its typed stream events.

Both routes end in ``response_body`` (a finished request's Completion -> the Response object):
the non-streamed one with the Completion of the engine's fold (RequestStream.collect), the
streamed one with the Completion of ``ResponseEvents.fold``, the same CompletionFold fed the
events as they are written. A streamed response's events, each ``event: <type>`` + ``data:``:

    response.created, response.in_progress
    per output item, in the order it first appears in the reply:
      reasoning:     output_item.added, content_part.added, reasoning_text.delta..., (at the end)
                     reasoning_text.done, content_part.done, output_item.done
      message:       output_item.added, content_part.added, output_text.delta..., (at the end)
                     output_text.done, content_part.done, output_item.done
      function_call: output_item.added, function_call_arguments.delta..., (at the end)
                     function_call_arguments.done, output_item.done
    response.completed (or response.incomplete: max_output_tokens reached), with usage

``sequence_number`` counts the events from 0. A reply that is only tool calls (its text only
whitespace) has no message item; any other reply has one. A reply with a reasoning block (a
template that writes ``<think>``: engine/reasoning.py) has a reasoning item first, its text as
one ``reasoning_text`` part; the message's text never holds it. A failure mid-stream is an ``error``
event, then ``response.failed``.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator

from engine.outputs import CompletionFold

from .errors import from_exception
from .metrics import RequestRecord, ServerMetrics
from .response_store import ResponseStore
from .responses import ResponsesRequest

log = logging.getLogger("webapp")


def new_item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt_tokens + num_output_tokens}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


_ID_PREFIXES = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def has_message(text: str, num_calls: int) -> bool:
    """A reply gets a message item unless it is tool calls with nothing but whitespace around them."""
    return num_calls == 0 or bool(text.strip())


def output_items(completion, item_ids: list[str] | None = None) -> list[dict]:
    """The output items of a finished reply: its message (if any), then its calls. ``item_ids``:
    the ids a stream already announced, in this order (None: new ones)."""
    calls = completion.tool_calls or []
    status = _status(completion.finish_reason)
    reasoning = completion.reasoning_content
    kinds = (["reasoning"] if reasoning is not None else []) + \
        (["message"] if has_message(completion.text, len(calls)) else []) + ["function_call"] * len(calls)
    ids = item_ids or [new_item_id(_ID_PREFIXES[kind]) for kind in kinds]
    items = []
    if reasoning is not None:
        items.append(reasoning_item(ids[0], reasoning, status))
    if "message" in kinds:
        items.append(message_item(ids[len(items)], completion.text, status))
    for item_id, call in zip(ids[len(items):], calls, strict=True):
        items.append(call_item(item_id, call.id, call.name, call.arguments, "completed"))
    return items


def response_object(req: ResponsesRequest, response_id: str, model_name: str, created_at: int, status: str,
                    output: list[dict], usage_body: dict | None) -> dict:
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model_name, "output": output, "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled", "usage": usage_body, "user": None, "background": False, **req.settings,
    }


def reply_messages(completion) -> list[dict]:
    """The reply as the chat messages a continuation (previous_response_id) sends the model."""
    message = {"role": "assistant", "content": completion.text or None}
    if completion.reasoning_content is not None:  # templates render it in a tool-call loop (Qwen3)
        message["reasoning_content"] = completion.reasoning_content
    if completion.tool_calls:
        message["tool_calls"] = [call.to_dict() for call in completion.tool_calls]
    return [message]


def response_body(req: ResponsesRequest, store: ResponseStore, response_id: str, model_name: str,
                  created_at: int, completion, num_prompt_tokens: int,
                  item_ids: list[str] | None = None) -> dict:
    """The Response object of a finished request (kept in ``store`` when the request says store)."""
    body = response_object(req, response_id, model_name, created_at, _status(completion.finish_reason),
                           output_items(completion, item_ids),
                           usage(num_prompt_tokens, len(completion.token_ids)))
    if req.is_store:
        store.put(response_id, body, [*req.conversation, *reply_messages(completion)])
    return body


def sse_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, allow_nan=False)}\n\n".encode()


class ResponseEvents:
    """The typed stream events of one response, from its StreamEvents (tool calls parsed already).

    ``opening()``, then ``add(event)`` per StreamEvent, then ``closing(num_prompt_tokens)``
    (or ``failure(exc)``); each returns the bytes to write. ``fold`` folds the events as they go.
    """

    def __init__(self, req: ResponsesRequest, store: ResponseStore, response_id: str, model_name: str,
                 created_at: int):
        self.req, self.store = req, store
        self.response_id, self.model_name, self.created_at = response_id, model_name, created_at
        self.fold = CompletionFold(response_id)
        self.num_events = 0
        self.item_ids: list[str] = []  # by output_index
        self.message_index: int | None = None
        self.reasoning_index: int | None = None
        self.call_indices: dict[int, int] = {}  # the call's delta index -> its output_index
        self.pending = ""  # whitespace before the first text: shown once the reply proves to have a message

    def _event(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return sse_event(event)

    def _response(self, status: str, output=(), usage_body=None) -> dict:
        return response_object(self.req, self.response_id, self.model_name, self.created_at, status,
                               list(output), usage_body)

    def opening(self) -> bytes:
        return (self._event("response.created", response=self._response("in_progress"))
                + self._event("response.in_progress", response=self._response("in_progress")))

    def _open_message(self) -> bytes:
        self.message_index = len(self.item_ids)
        item_id = new_item_id("msg_")
        self.item_ids.append(item_id)
        item = message_item(item_id, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._event("response.output_item.added", output_index=self.message_index, item=item)
                + self._event("response.content_part.added", item_id=item_id, output_index=self.message_index,
                              content_index=0, part=part))

    def _open_reasoning(self) -> bytes:
        self.reasoning_index = len(self.item_ids)
        item_id = new_item_id("rs_")
        self.item_ids.append(item_id)
        item = reasoning_item(item_id, "", "in_progress")
        item["content"] = []
        return (self._event("response.output_item.added", output_index=self.reasoning_index, item=item)
                + self._event("response.content_part.added", item_id=item_id, output_index=self.reasoning_index,
                              content_index=0, part={"type": "reasoning_text", "text": ""}))

    def _reasoning_delta(self, text: str) -> bytes:
        return self._event("response.reasoning_text.delta", item_id=self.item_ids[self.reasoning_index],
                           output_index=self.reasoning_index, content_index=0, delta=text)

    def _text_delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", item_id=self.item_ids[self.message_index],
                           output_index=self.message_index, content_index=0, delta=text, logprobs=[])

    def add(self, event) -> bytes:
        self.fold.add(event)
        out = []
        if event.reasoning_content is not None:
            if self.reasoning_index is None:
                out.append(self._open_reasoning())
            if event.reasoning_content:
                out.append(self._reasoning_delta(event.reasoning_content))
        if event.text:
            if self.message_index is not None:
                out.append(self._text_delta(event.text))
            else:
                self.pending += event.text
                if self.pending.strip():
                    out += [self._open_message(), self._text_delta(self.pending)]
                    self.pending = ""
        for delta in event.tool_calls or ():
            index = self.call_indices.get(delta.index)
            if index is None:
                index = self.call_indices[delta.index] = len(self.item_ids)
                item_id = new_item_id("fc_")
                self.item_ids.append(item_id)
                item = call_item(item_id, delta.id or "", delta.name or "", "", "in_progress")
                out.append(self._event("response.output_item.added", output_index=index, item=item))
            if delta.arguments:
                out.append(self._event("response.function_call_arguments.delta", item_id=self.item_ids[index],
                                       output_index=index, delta=delta.arguments))
        return b"".join(out)

    def closing(self, num_prompt_tokens: int) -> tuple[bytes, dict]:
        """The done events of every item, then response.completed (or .incomplete); and the body."""
        completion = self.fold.result([], None)
        out = []
        if self.message_index is None and has_message(completion.text, len(self.call_indices)):
            out.append(self._open_message())
            if self.pending:
                out.append(self._text_delta(self.pending))
        # the body's items in output_index order: the message where it first appeared, the calls by index
        call_keys = sorted(self.call_indices)  # fold_tool_calls orders the calls by index too
        by_output = {self.call_indices[k]: call
                     for k, call in zip(call_keys, completion.tool_calls or [], strict=True)}
        body_ids = [self.item_ids[i] for i in (self.reasoning_index, self.message_index) if i is not None]
        body_ids += [self.item_ids[self.call_indices[k]] for k in call_keys]
        body = response_body(self.req, self.store, self.response_id, self.model_name, self.created_at,
                             completion, num_prompt_tokens, body_ids)
        items = {item["id"]: item for item in body["output"]}
        for index, item_id in enumerate(self.item_ids):
            item = items[item_id]
            if index == self.reasoning_index:
                part = item["content"][0]
                out += [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                    content_index=0, text=part["text"]),
                        self._event("response.content_part.done", item_id=item_id, output_index=index,
                                    content_index=0, part=part)]
            elif index == self.message_index:
                part = item["content"][0]
                out += [self._event("response.output_text.done", item_id=item_id, output_index=index,
                                    content_index=0, text=part["text"], logprobs=[]),
                        self._event("response.content_part.done", item_id=item_id, output_index=index,
                                    content_index=0, part=part)]
            else:
                out.append(self._event("response.function_call_arguments.done", item_id=item_id,
                                       output_index=index, arguments=by_output[index].arguments))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        body["output"] = [items[item_id] for item_id in self.item_ids]
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=body))
        return b"".join(out), body

    def failure(self, exc: BaseException) -> bytes:
        """A failure after the 200 went out: OpenAI's error event, then response.failed."""
        err = from_exception(exc)
        failed = self._response("failed", usage_body=None)
        failed["error"] = {"code": err.code or err.type, "message": err.message}
        return (self._event("error", code=err.code or err.type, message=err.message, param=err.param)
                + self._event("response.failed", response=failed))


def _never() -> bool:
    return False


def stream_events(stream, events: ResponseEvents, record: RequestRecord, metrics: ServerMetrics,
                  is_disconnected: Callable[[], bool] = _never) -> Iterator[bytes]:
    """A streamed response's bytes, written as the events arrive (the WSGI front-end; the Ray
    ingress writes the same ResponseEvents from its async loop). Events that queued meanwhile go
    in the same write; leaving (or closing this generator) aborts the request."""
    status = "abort"
    try:
        yield events.opening()
        for event in stream:
            batch = [event, *stream.ready_events()]
            for e in batch:
                record.event(e)
            yield b"".join(events.add(e) for e in batch)
            if batch[-1].finish_reason is None and is_disconnected():
                return
        yield events.closing(record.num_prompt_tokens)[0]
        status = "ok"
    except Exception as exc:  # the engine failed mid-stream: say so in-band
        status = "error"
        log.exception("response stream failed")
        yield events.failure(exc)
    finally:
        stream.close()
        record.queue_s = stream.queue_time
        metrics.finish(record, status)
