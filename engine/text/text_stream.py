"""One request's text pipeline: generated ids in, final text out, cut at the first stop string.

``TextStream`` owns the incremental detokenizer and the stop matcher, so a token's text
makes one trip: ``add(id) -> (text, is_stopped)`` releases what became final, and
``finish() -> (text, is_stopped)`` releases what is still held when the request ends for
another reason (a stop token, max_tokens, the context limit).

Stops are matched on the released text together with what the detokenizer still holds
(rendered as ``decode`` of the ids so far would end), so the request stops at the very token
that completes a stop string even while its characters are held (a SentencePiece
byte-fallback run is released only when it ends); the cut is before the earliest occurrence.
"""
from __future__ import annotations

from .detokenizer import IncrementalDetokenizer
from .stops import StopMatcher


class TextStream:
    """``add(token_id) -> (text, is_stopped)``; ``finish() -> (text, is_stopped)``.

    After a stop, later calls release nothing. Without stop strings ``add`` is the
    detokenizer's own ``add`` plus a tuple.
    """

    __slots__ = ("_detok", "_stops")

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopMatcher(tuple(stop), include_stop_str_in_output) if stop else None

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return None if self._stops is None else self._stops.stop_str

    def add(self, token_id: int) -> tuple[str, bool]:
        text = self._detok.add(token_id)
        stops = self._stops
        if stops is None:
            return text, False
        if stops.is_stopped:
            return "", True
        held = self._detok.peek()
        if held and stops.completes_with(text + held):
            return stops.push(text + self._detok.finish())
        return stops.push(text)

    def finish(self) -> tuple[str, bool]:
        """The held tail, rendered as ``decode`` renders the end of the output."""
        tail = self._detok.finish()
        stops = self._stops
        if stops is None:
            return tail, False
        if stops.is_stopped:
            return "", True
        text, is_stopped = stops.push(tail)
        if not is_stopped:
            text += stops.flush()
        return text, is_stopped
