"""The GGUF container: magic, version and the key/value header, read with a small reader of
our own over a memory map (``gguf.GGUFReader`` maps and indexes every tensor first, which
costs seconds). Shared by the tokenizer (vocabulary) and the model loader."""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

GGUF_MAGIC = b"GGUF"


# GGUF value types -> struct format of one scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_TYPE_STRING = 8
_TYPE_ARRAY = 9


class HeaderReader:
    """Sequential little-endian reads over the mapped file; errors name the file."""

    def __init__(self, buffer, path: str):
        self.buffer = buffer
        self.path = path
        self.offset = 0

    def take(self, num_bytes: int) -> memoryview:
        end = self.offset + num_bytes
        if end > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF header is truncated at byte {self.offset}")
        view = memoryview(self.buffer)[self.offset:end]
        self.offset = end
        return view

    def scalar(self, type_id: int):
        fmt = "<" + _SCALAR_FORMATS[type_id]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        (num_bytes,) = struct.unpack("<Q", self.take(8))
        return bytes(self.take(num_bytes)).decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id == _TYPE_STRING:
            return self.string()
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id)
        if type_id == _TYPE_ARRAY:
            item_type, num_items = struct.unpack("<IQ", self.take(12))
            if item_type == _TYPE_STRING:
                return [self.string() for _ in range(num_items)]
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
                data = self.take(num_items * dtype.itemsize)
                return np.frombuffer(data, dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(num_items)]
        raise ValueError(f"{self.path}: unknown GGUF value type {type_id} at byte {self.offset}")


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, object]:
    """All key/value pairs of a GGUF file's header (arrays as lists), without the tensors."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise ValueError(f"{path}: not a GGUF file (empty)") from None
    try:
        if len(buffer) < 4 or bytes(buffer[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        reader = HeaderReader(buffer, path)
        reader.offset = 4
        version = reader.scalar(4)
        if version > 0xFFFF:
            raise ValueError(f"{path}: big-endian GGUF files are not supported")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
        _num_tensors, num_kv = struct.unpack("<QQ", reader.take(16))
        metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = reader.string()
            (type_id,) = struct.unpack("<I", reader.take(4))
            metadata[key] = reader.value(type_id)
        return metadata
    finally:
        try:
            buffer.close()
        except BufferError:  # a view is still referenced (an error's traceback); GC closes it
            pass




def is_gguf_file(path: str | os.PathLike) -> bool:
    """True when the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC
