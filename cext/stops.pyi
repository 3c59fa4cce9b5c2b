"""Type stubs for cext/stops.pyx (one Aho-Corasick automaton over a request's stop strings)."""

class StopAutomaton:
    stops: tuple[str, ...]
    include_stop_str: bool
    is_stopped: bool
    stop_str: str | None
    state: int
    num_nodes: int
    max_stop_len: int
    num_held: int
    def __init__(self, stops: tuple[str, ...] | list[str], include_stop_str: bool = False) -> None: ...
    def push(self, text: str) -> tuple[str, bool]: ...
    def completes_with(self, tentative: str) -> bool: ...
    def flush(self) -> str: ...
