"""Stop strings over streamed text: release what can never be part of a stop, cut at the first stop.

The engine feeds the detokenizer's released text to ``push``. The matcher holds back only
the longest suffix of the unreleased text that is a prefix of some stop string (no fixed
window), so text is released as early as possible and never retracted. When a stop string
completes, the text is cut before the earliest occurrence of any stop (kept if
``include_stop_str``); when two stops start at the same place, the shorter one (the one
that completed first) wins. Each push scans only the held tail plus the new text, so its
cost does not grow with the length of the output.

The per-token step of a request (detokenizer + stops) is ``engine.text_stream.TextStream``.
"""
from __future__ import annotations


class StopMatcher:
    """One request's stop-string state.

    ``push(text) -> (released, is_stopped)``; after a stop, ``released`` ends at the cut
    (or just after the stop string with ``include_stop_str``) and later pushes release
    nothing. ``flush()`` returns the held-back tail at the end of a request that did not stop.
    """

    __slots__ = ("stops", "include_stop_str", "is_stopped", "stop_str", "_held", "_prefixes", "_max_prefix_len")

    def __init__(self, stops: tuple[str, ...], include_stop_str: bool = False):
        if isinstance(stops, str) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a tuple of strings, got {stops!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain an empty string")
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.is_stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text
        self._held = ""
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._max_prefix_len = max((len(s) - 1 for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        if self.is_stopped:
            return "", True
        if not self.stops:
            return text, False
        if not text:
            return "", False
        held = self._held
        buffer = held + text
        # A match must end in the new text: it may begin at most len(stop) - 1 chars into `held`.
        cut, stop_str = -1, None
        for stop in self.stops:
            index = buffer.find(stop, max(0, len(held) - len(stop) + 1))
            if index >= 0 and (cut < 0 or index < cut or (index == cut and len(stop) < len(stop_str))):
                cut, stop_str = index, stop
        if stop_str is not None:
            self.is_stopped = True
            self.stop_str = stop_str
            self._held = ""
            return buffer[: cut + len(stop_str) if self.include_stop_str else cut], True
        num_held = self._held_suffix_len(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], False

    def completes_with(self, tentative: str) -> bool:
        """Whether a stop string would complete if ``tentative`` were pushed (no state change)."""
        if self.is_stopped or not self.stops or not tentative:
            return False
        held = self._held
        buffer = held + tentative
        return any(buffer.find(stop, max(0, len(held) - len(stop) + 1)) >= 0 for stop in self.stops)

    def _held_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        for k in range(min(len(buffer), self._max_prefix_len), 0, -1):
            if buffer[-k:] in self._prefixes:
                return k
        return 0

    def flush(self) -> str:
        """The held-back tail, at the end of a request that did not stop."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

