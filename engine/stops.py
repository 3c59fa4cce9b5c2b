"""Stop strings over streamed text: release what can never be part of a stop, cut at the first stop.

The engine feeds the detokenizer's released text to ``push``. The matcher holds back only
the longest suffix of the unreleased text that is a prefix of some stop string (no fixed
window), so text is released as early as possible and never retracted. When a stop string
completes, the text is cut before the earliest occurrence of any stop (kept if
``include_stop_str``); when two stops start at the same place, the shorter one (the one
that completed first) wins.

All stop strings share one Aho-Corasick automaton: a state is the longest suffix of the
text so far that is a prefix of some stop, so the held-back text is the state's depth.
Building it takes time and memory linear in the total stop length (about 13 bytes per
character); a push costs time linear in its text (amortized over the pushes), whatever
the number of stops and the length of the output. Limits, enforced by ``check_stop_caps``
in linear time: at most ``MAX_NUM_STOPS`` strings, each at most ``MAX_STOP_LEN``
characters, ``MAX_TOTAL_STOP_LEN`` characters in all.

`push_token_text` is the per-token step for an engine: besides ``push``, it stops at the
token that completes a stop string even while the detokenizer still holds that text (a
SentencePiece byte-fallback run is held until it ends, yet ``decode`` of the ids so far
already shows the character).
"""
from __future__ import annotations

from array import array

MAX_NUM_STOPS = 256  # stop strings per request (OpenAI allows 4)
MAX_STOP_LEN = 131_072  # characters in one stop string
MAX_TOTAL_STOP_LEN = 1_048_576  # characters over all stop strings of a request (~13 MiB of automaton)


def check_stop_caps(stops) -> None:
    """ValueError naming ``stop`` if a sequence of strings is over the caps; linear in its size."""
    if len(stops) > MAX_NUM_STOPS:
        raise ValueError(f"stop must have at most {MAX_NUM_STOPS} strings, got {len(stops)}")
    num_chars = 0
    for s in stops:
        if len(s) > MAX_STOP_LEN:
            raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters each, got one of {len(s)}")
        num_chars += len(s)
    if num_chars > MAX_TOTAL_STOP_LEN:
        raise ValueError(f"stop strings must total at most {MAX_TOTAL_STOP_LEN} characters, got {num_chars}")


class StopMatcher:
    """One request's stop-string state.

    ``push(text) -> (released, is_stopped)``; after a stop, ``released`` ends at the cut
    (or just after the stop string with ``include_stop_str``) and later pushes release
    nothing. ``flush()`` returns the held-back tail at the end of a request that did not stop.

    The automaton: node ids index ``_chars``, which is a separator (a character in no stop)
    then, per stop string in sorted order, the part not shared with the previous one (its
    "segment"), each followed by the separator. Node 0 is the root; node ``v + 1`` is the
    child of ``v`` by ``_chars[v + 1]`` unless that is the separator; other children (at most
    one per stop) are in ``_children``. ``_fail[v]`` is the failure link, ``_depth[v]`` the
    length of the prefix v stands for, ``_match_len[v]`` the length of the longest stop that
    is a suffix of it (0: none).
    """

    __slots__ = ("stops", "include_stop_str", "is_stopped", "stop_str", "_held", "_state", "_alphabet",
                 "_chars", "_children", "_fail", "_depth", "_match_len", "_max_stop_len")

    def __init__(self, stops: tuple[str, ...], include_stop_str: bool = False):
        if isinstance(stops, str) or not isinstance(stops, (tuple, list)) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a tuple of strings, got {type(stops).__name__}")
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain an empty string")
        check_stop_caps(stops)
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.is_stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text
        self._held = ""
        self._state = 0
        self._max_stop_len = max(map(len, self.stops), default=0)
        self._build()

    def _build(self) -> None:
        """The trie from the sorted stops (neighbours share their common prefix), then failure
        links and match lengths in order of depth."""
        self._alphabet = alphabet = frozenset("".join(self.stops))
        sep = next(chr(code) for code in range(len(alphabet) + 1) if chr(code) not in alphabet)
        parts, segments = [sep], []  # segment: (first node, its depth, number of nodes, parent node)
        children: dict[int, dict[str, int]] = {}
        depth, match_len = array("i", [0]), array("i", [0])
        path = array("i", bytes(4 * (self._max_stop_len + 1)))  # path[d]: node at depth d of the last stop
        previous, num_nodes = "", 1
        for stop in sorted(self.stops):
            shared = _common_prefix_len(previous, stop)  # < len(stop): stops are distinct, prefixes sort first
            parent, first, tail = path[shared], num_nodes, stop[shared:]
            if first != parent + 1:
                children.setdefault(parent, {})[tail[0]] = first
            segments.append((first, shared + 1, len(tail), parent))
            parts += (tail, sep)
            depth.extend(range(shared + 1, len(stop) + 1))
            depth.append(0)
            match_len.frombytes(bytes(4 * (len(tail) - 1)))
            match_len.extend((len(stop), 0))
            path[shared + 1 : len(stop) + 1] = array("i", range(first, first + len(tail)))
            num_nodes += len(tail) + 1
            previous = stop
        self._chars = chars = "".join(parts)
        self._children, self._depth, self._match_len = children, depth, match_len
        self._fail = fail = array("i", bytes(4 * num_nodes))
        segments.sort(key=lambda segment: segment[1])
        active, num_started = [], 0
        for d in range(1, self._max_stop_len + 1):
            active = [segment for segment in active if segment[1] + segment[2] > d]
            while num_started < len(segments) and segments[num_started][1] == d:
                active.append(segments[num_started])
                num_started += 1
            if d == 1:
                continue  # depth 1 fails to the root
            for first, first_depth, _, parent in active:
                node = first + d - first_depth
                target = self._next(fail[node - 1 if node != first else parent], chars[node])
                fail[node] = target
                if not match_len[node]:
                    match_len[node] = match_len[target]

    def _next(self, state: int, char: str) -> int:
        """The state after ``char`` (goto, following failure links)."""
        if char not in self._alphabet:
            return 0
        chars, children, fail = self._chars, self._children, self._fail
        while True:
            if chars[state + 1] == char:
                return state + 1
            out = children.get(state)
            if out is not None and char in out:
                return out[char]
            if not state:
                return 0
            state = fail[state]

    def push(self, text: str) -> tuple[str, bool]:
        if self.is_stopped:
            return "", True
        if not self.stops:
            return text, False
        if not text:
            return "", False
        held = self._held
        if self._alphabet.isdisjoint(text):  # no character of text is in any stop: release all
            self._state, self._held = 0, ""
            return held + text, False
        alphabet, chars, children, fail, match_len = self._alphabet, self._chars, self._children, self._fail, self._match_len
        state, num_held, end = self._state, len(held), -1
        for i, char in enumerate(text):  # the goto of _next, inlined
            if char not in alphabet:
                state = 0
                continue
            while True:
                if chars[state + 1] == char:
                    state += 1
                    break
                out = children.get(state)
                if out is not None and char in out:
                    state = out[char]
                    break
                if not state:
                    break
                state = fail[state]
            if match_len[state]:
                end = i
                break
        if end >= 0:
            return self._stop(held + text, num_held + end, state)
        self._state = state
        num_kept = self._depth[state]
        if num_kept <= len(text):
            self._held = text[len(text) - num_kept :]
            return held + text[: len(text) - num_kept], False
        num_released = num_held + len(text) - num_kept
        self._held = held[num_released:] + text
        return held[:num_released], False

    def _stop(self, buffer: str, end: int, state: int) -> tuple[str, bool]:
        """The first stop ends at buffer[end]; one that starts earlier ends before
        ``start + max_stop_len - 1``: look that far for it, then cut."""
        match_len = self._match_len
        start = end + 1 - match_len[state]
        length = match_len[state]
        for i in range(end + 1, min(len(buffer), start + self._max_stop_len - 1)):
            state = self._next(state, buffer[i])
            if match_len[state] and i + 1 - match_len[state] < start:
                start, length = i + 1 - match_len[state], match_len[state]
        self.is_stopped = True
        self.stop_str = buffer[start : start + length]
        self._held = ""
        return buffer[: start + length if self.include_stop_str else start], True

    def completes_with(self, tentative: str) -> bool:
        """Whether a stop string would complete if ``tentative`` were pushed (no state change)."""
        if self.is_stopped or not self.stops or not tentative or self._alphabet.isdisjoint(tentative):
            return False
        state, match_len = self._state, self._match_len
        for char in tentative:
            state = self._next(state, char)
            if match_len[state]:
                return True
        return False

    def flush(self) -> str:
        """The held-back tail, at the end of a request that did not stop."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice compares."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def push_token_text(stops: StopMatcher, detokenizer, text: str) -> tuple[str, bool]:
    """``stops.push(text)`` for the text ``detokenizer.add`` just returned, stopping at this token
    if the output so far, including what the detokenizer still holds (rendered as if the output
    ended here, as decode of the ids so far shows it), contains a stop. The cut is before the
    earliest occurrence over that whole text."""
    held = detokenizer.peek()
    if held and stops.completes_with(text + held):
        return stops.push(text + detokenizer.finish())
    return stops.push(text)
