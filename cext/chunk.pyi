"""Type stub for the compiled cext.chunk (see chunk.pyx for the escaping rules)."""

from engine.outputs import TokenLogprob

DONE: bytes

def clamp_logprob(value: float) -> float: ...
def dumps_str(text: str) -> bytes: ...

class ChunkWriter:
    def __init__(
        self, request_id: str, model: str, created: int, is_chat: bool, include_usage: bool = False
    ) -> None: ...
    def event(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None, index: int = 0
    ) -> bytes: ...
    def tool_event(
        self, text: str, tool_calls_json: bytes, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
        index: int = 0,
    ) -> bytes: ...
    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes: ...
