"""Type stubs for cext/utf8.pyx (UTF-8 boundary tracking for incremental detokenization)."""
from enum import IntEnum

import numpy as np

class TokenKind(IntEnum):  # TokenTable.kinds flags
    KIND_TEXT = 0
    KIND_BYTE = 1      # a byte-fallback token <0xNN>
    KIND_SPECIAL = 2   # dropped when skipping special tokens
    KIND_UNKNOWN = 4   # an id decode drops

class DecodeMode(IntEnum):  # Utf8Tracker.mode
    MODE_BYTES = 0     # byte-level BPE, concatenated bytes rendered like errors="replace"
    MODE_PIECES = 1    # SentencePiece text pieces plus byte-fallback runs

class TokenTable:
    blob: bytes
    offsets: np.ndarray  # int64 [num_ids + 1]
    kinds: np.ndarray    # uint8 [num_ids]
    texts: list[str | None] | None  # None when built without texts
    made: dict[int, str | None] | None  # built without texts: the texts made so far
    num_ids: int
    def __init__(self, blob: bytes, offsets: np.ndarray, kinds: np.ndarray,
                 texts: list[str | None] | None = None) -> None: ...
    def piece(self, token_id: int) -> bytes: ...
    def text(self, token_id: int) -> str | None: ...

class Utf8Tracker:
    table: TokenTable | None
    mode: int
    skip_special: bool
    num_strip: int
    num_held_bytes: int
    def __init__(
        self, table: TokenTable | None = None, mode: int = ..., skip_special: bool = True, num_strip: int = 0
    ) -> None: ...
    def add(self, token_id: int) -> str: ...
    def push(self, data: bytes | bytearray | memoryview) -> str: ...
    def push_byte(self, value: int) -> str: ...
    def finish(self) -> str: ...
    def peek(self) -> str: ...
