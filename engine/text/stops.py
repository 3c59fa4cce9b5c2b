"""Stop strings over streamed text: release what can never be part of a stop, cut at the first stop.

The engine feeds the detokenizer's released text to ``push``. The matcher holds back only
the longest suffix of the unreleased text that is a prefix of some stop string (no fixed
window), so text is released as early as possible and never retracted. When a stop string
completes, the text is cut before the earliest occurrence of any stop (kept if
``include_stop_str``); when two stops start at the same place, the shorter one (the one
that completed first) wins.

All stop strings share one Aho-Corasick automaton (cext/stops.pyx): a state is the longest
suffix of the text so far that is a prefix of some stop, so the held-back text is the
state's depth. Building it takes time and memory linear in the total stop length (16
bytes per character); a push costs time linear in its text (amortized over the pushes),
whatever the number of stops and the length of the output. Limits, enforced by ``check_stop_caps``
in linear time: at most ``MAX_NUM_STOPS`` strings, each at most ``MAX_STOP_LEN``
characters, ``MAX_TOTAL_STOP_LEN`` characters in all.

The per-token step of a request (detokenizer + stops) is ``engine.text.text_stream.TextStream``.
"""
from __future__ import annotations

from cext.stops import StopAutomaton

from ..errors import InvalidParameterError

MAX_NUM_STOPS = 256  # stop strings per request (OpenAI allows 4)
MAX_STOP_LEN = 131_072  # characters in one stop string
MAX_TOTAL_STOP_LEN = 1_048_576  # characters over all stop strings of a request (16 MiB of automaton)


def check_stop_caps(stops) -> None:
    """ValueError naming ``stop`` if a sequence of strings is over the caps; linear in its size."""
    if len(stops) > MAX_NUM_STOPS:
        raise InvalidParameterError(f"stop must have at most {MAX_NUM_STOPS} strings, got {len(stops)}", "stop")
    num_chars = 0
    for s in stops:
        if len(s) > MAX_STOP_LEN:
            raise InvalidParameterError(
                f"stop strings must be at most {MAX_STOP_LEN} characters each, got one of {len(s)}", "stop")
        num_chars += len(s)
    if num_chars > MAX_TOTAL_STOP_LEN:
        raise InvalidParameterError(
            f"stop strings must total at most {MAX_TOTAL_STOP_LEN} characters, got {num_chars}", "stop")


class StopMatcher(StopAutomaton):
    """One request's stop-string state.

    ``push(text) -> (released, is_stopped)``; after a stop, ``released`` ends at the cut
    (or just after the stop string with ``include_stop_str``) and later pushes release
    nothing. ``flush()`` returns the held-back tail at the end of a request that did not stop.
    ``completes_with(tentative)``: whether pushing ``tentative`` would complete a stop (no
    state change). ``stop_str`` is the stop string that ended the text, else None. The
    automaton and its loops are cext.stops.StopAutomaton. ``stops`` is SamplingParams.stop,
    validated there (non-empty strings within the caps), so it is trusted here.
    """

    __slots__ = ()

    def __init__(self, stops: tuple[str, ...], include_stop_str: bool = False):
        super().__init__(tuple(dict.fromkeys(stops)), include_stop_str)

