"""Stored responses of ``POST /v1/responses`` (``store``, ``previous_response_id``, GET and DELETE).

An in-memory LRU, one per server (the Flask app, or the Ray Serve ingress), bounded twice:
at most ``max_responses`` responses and ``max_chars`` characters of conversation text, each
response counted with its whole conversation (what a continuation would send to the model),
so a long chain of turns keeps fewer responses rather than growing without bound. Past either
bound the least recently used response goes; continuing from it is then a 404, as for an id
never stored. Nothing survives a restart.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict  # the Response object, as GET /v1/responses/{id} returns it
    messages: tuple[dict, ...]  # the conversation without instructions, the reply's own turn included
    num_chars: int


def conversation_chars(messages) -> int:
    """The characters a conversation holds: contents and tool call arguments (linear in its size)."""
    total = 0
    for message in messages:
        total += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            total += len(call["function"]["arguments"]) + len(call["function"]["name"])
    return total


class ResponseStore:
    """Thread-safe LRU of StoredResponses by response id."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        if max_responses < 1 or max_chars < 1:
            raise ValueError(f"max_responses and max_chars must be >= 1, got {max_responses}, {max_chars}")
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_chars(self) -> int:
        return self._num_chars

    def put(self, response_id: str, body: dict, messages) -> None:
        entry = StoredResponse(body, tuple(messages), conversation_chars(messages))
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._num_chars -= old.num_chars
            self._entries[response_id] = entry
            self._num_chars += entry.num_chars
            while len(self._entries) > self.max_responses or (self._num_chars > self.max_chars
                                                              and len(self._entries) > 1):
                _, evicted = self._entries.popitem(last=False)
                self._num_chars -= evicted.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is None:
                return False
            self._num_chars -= entry.num_chars
            return True
