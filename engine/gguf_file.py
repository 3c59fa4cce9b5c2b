"""The GGUF container: magic, version, the key/value header and the tensor-info table, read
with a small reader of our own over a memory map (``gguf.GGUFReader`` builds numpy records for
every tensor and field, which costs seconds). Tensors come out as numpy views of the map, never
copies. Shared by the tokenizer (vocabulary) and the model loader (GGUFFile)."""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelFileError

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
            raise ModelFileError(f"{self.path}: GGUF header is truncated at byte {self.offset}", self.path)
        view = memoryview(self.buffer)[self.offset:end]
        self.offset = end
        return view

    def scalar(self, type_id: int):
        fmt = "<" + _SCALAR_FORMATS[type_id]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        (num_bytes,) = struct.unpack("<Q", self.take(8))
        return bytes(self.take(num_bytes)).decode("utf-8", errors="replace")

    def strings(self, num_items: int, decode: bool = True) -> list[str] | None:
        """An array's strings in one C loop (cext.gguf_strings; vocabularies hold 50-150k);
        decode=False only walks past them."""
        from cext.gguf_strings import read_strings

        if num_items > (len(self.buffer) - self.offset) // 8:  # each string takes >= 8 bytes (its length)
            raise ModelFileError(f"{self.path}: GGUF header is truncated at byte {self.offset}: an array of "
                                 f"{num_items} strings does not fit in the file", self.path)
        out, offset = read_strings(self.buffer, self.offset, num_items, decode)
        if offset < 0:
            raise ModelFileError(f"{self.path}: GGUF header is truncated at byte {-1 - offset}", self.path)
        self.offset = offset
        return out

    def skip_value(self, type_id: int) -> None:
        """Walk past a value without building it."""
        if type_id == _TYPE_ARRAY:
            item_type, num_items = struct.unpack("<IQ", self.take(12))
            if item_type == _TYPE_STRING:
                self.strings(num_items, decode=False)
            elif item_type in _SCALAR_FORMATS:
                self.take(num_items * struct.calcsize(_SCALAR_FORMATS[item_type]))
            else:
                for _ in range(num_items):
                    self.skip_value(item_type)
        else:
            self.value(type_id)

    def value(self, type_id: int):
        if type_id == _TYPE_STRING:
            return self.string()
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id)
        if type_id == _TYPE_ARRAY:
            item_type, num_items = struct.unpack("<IQ", self.take(12))
            if item_type == _TYPE_STRING:
                return self.strings(num_items)
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
                data = self.take(num_items * dtype.itemsize)
                return np.frombuffer(data, dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(num_items)]
        raise ModelFileError(f"{self.path}: unknown GGUF value type {type_id} at byte {self.offset}",
                             self.path)


# ggml tensor types -> (elements per block, bytes per block). Types missing here are looked up
# in gguf.constants (the tensor can be viewed; the loader decides whether it can use it).
GGML_BLOCK_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2),
}
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4


def ggml_block_size(ggml_type: int) -> tuple[int, int] | None:
    """-> (elements per block, bytes per block), None for a type unknown to us and to gguf."""
    if ggml_type in GGML_BLOCK_SIZES:
        return GGML_BLOCK_SIZES[ggml_type]
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ImportError, ValueError, KeyError):
        return None


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor-info table. dims are ggml's (fastest-varying first); shape is
    numpy's (rows first); offset is absolute in the file."""
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        try:
            # Copy-on-write: the pages are the page cache's until written (we never write), and
            # numpy/torch views over them are writable, which torch.from_numpy wants.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:  # empty file
            raise ModelFileError(f"{path}: not a GGUF file (empty)", path) from None


MAX_PLAUSIBLE_ENTRIES = 1 << 24  # tensors + header keys of any real model are far fewer


def _read_header(buffer, path: str, skip_prefix: str | None = None) -> tuple[HeaderReader, int, dict[str, object]]:
    """-> (reader positioned after the key/values, number of tensors, metadata). Array values
    of keys starting with skip_prefix are walked past, not read (the model loader skips the
    vocabulary)."""
    if len(buffer) < 4 or bytes(buffer[:4]) != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic)", path)
    reader = HeaderReader(buffer, path)
    reader.offset = 4
    version = reader.scalar(4)
    if version > 0xFFFF:
        raise ModelFileError(f"{path}: big-endian GGUF files are not supported", path)
    if version < 2:
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (need 2 or later)", path)
    num_tensors, num_kv = struct.unpack("<QQ", reader.take(16))
    # Every key/value and tensor entry takes at least 12 bytes: a count beyond that is corruption,
    # and checking it here keeps the loops below linear in the file size.
    if (num_tensors + num_kv) * 12 > len(buffer):
        # Plausible counts in too short a file: a cut download; absurd counts: garbage.
        what = "truncated" if num_tensors + num_kv < MAX_PLAUSIBLE_ENTRIES else "corrupt"
        raise ModelFileError(f"{path}: GGUF file is {what}: its header lists {num_tensors} tensors and "
                         f"{num_kv} keys, which cannot fit in {len(buffer)} bytes", path)
    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key = reader.string()
        (type_id,) = struct.unpack("<I", reader.take(4))
        if skip_prefix is not None and type_id == _TYPE_ARRAY and key.startswith(skip_prefix):
            reader.skip_value(type_id)
        else:
            metadata[key] = reader.value(type_id)
    return reader, num_tensors, metadata


def _close(buffer) -> None:
    try:
        buffer.close()
    except BufferError:  # a view is still referenced (an error's traceback); GC closes it
        pass


def read_gguf_metadata(path: str | os.PathLike, with_vocabulary: bool = True) -> dict[str, object]:
    """All key/value pairs of a GGUF file's header (arrays as lists), without the tensors.
    with_vocabulary=False leaves the tokenizer's arrays (tokenizer.ggml.*) out: ~0.1 s less on a
    262k vocabulary, for callers that only look at the architecture."""
    path = os.fspath(path)
    buffer = _map(path)
    try:
        return _read_header(buffer, path, None if with_vocabulary else "tokenizer.ggml.")[2]
    finally:
        _close(buffer)


class GGUFFile:
    """A GGUF file over a memory map: metadata, the tensor-info table, and numpy views of each
    tensor's bytes (no copies: the pages are read from the page cache when first touched).

        with GGUFFile(path) as f:
            f.metadata["general.architecture"]; f.tensors["token_embd.weight"].shape
            f.raw("blk.0.attn_q.weight")   # uint8 [rows, bytes per row]
            f.array("output_norm.weight")  # F32/F16/BF16/I*: typed [rows, cols]

    A truncated or corrupt file raises ValueError naming the file. Views keep the map alive;
    close() unmaps it once no view is left (otherwise the garbage collector does).
    with_vocabulary=False leaves the tokenizer's arrays (tokenizer.ggml.*) out of metadata.
    """

    def __init__(self, path: str | os.PathLike, with_vocabulary: bool = True):
        self.path = os.fspath(path)
        self._buffer = _map(self.path)
        try:
            skip_prefix = None if with_vocabulary else "tokenizer.ggml."
            reader, num_tensors, self.metadata = _read_header(self._buffer, self.path, skip_prefix)
            self.alignment = self._alignment()
            self.tensors = self._read_tensor_infos(reader, num_tensors)
        except BaseException:
            _close(self._buffer)
            raise

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: GGUF file is corrupt: general.alignment {alignment!r} "
                             "is not a power of two", self.path)
        return alignment

    def _read_tensor_infos(self, reader: HeaderReader, num_tensors: int) -> dict[str, TensorInfo]:
        entries = []
        for _ in range(num_tensors):
            name = reader.string()
            (num_dims,) = struct.unpack("<I", reader.take(4))
            if not 1 <= num_dims <= MAX_DIMS:
                raise ModelFileError(f"{self.path}: GGUF file is corrupt: tensor {name!r} has {num_dims} dims",
                                     self.path)
            dims = struct.unpack(f"<{num_dims}Q", reader.take(8 * num_dims))
            if 0 in dims:  # no model has an empty tensor; rows of 0 would divide by zero below
                raise ModelFileError(f"{self.path}: GGUF file is corrupt: tensor {name!r} has a zero dim "
                                     f"{list(dims)}", self.path)
            ggml_type, offset = struct.unpack("<IQ", reader.take(12))
            entries.append((name, dims, ggml_type, offset))
        data_start = -(-reader.offset // self.alignment) * self.alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in entries:
            block = ggml_block_size(ggml_type)
            if block is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}",
                                     self.path)
            block_elements, block_bytes = block
            if dims[0] % block_elements:
                raise ModelFileError(f"{self.path}: GGUF file is corrupt: tensor {name!r} rows of {dims[0]} "
                                 f"elements are not whole blocks of {block_elements}", self.path)
            if offset % self.alignment:
                raise ModelFileError(f"{self.path}: GGUF file is corrupt: tensor {name!r} at offset {offset} "
                                 f"is not aligned to {self.alignment}", self.path)
            num_bytes = math.prod(dims) // block_elements * block_bytes
            start = data_start + offset
            if start + num_bytes > len(self._buffer):
                raise ModelFileError(f"{self.path}: GGUF file is truncated: tensor {name!r} needs bytes "
                                 f"{start}..{start + num_bytes}, the file has {len(self._buffer)}", self.path)
            if name in tensors:
                raise ModelFileError(f"{self.path}: GGUF file is corrupt: tensor {name!r} appears twice",
                                     self.path)
            tensors[name] = TensorInfo(name, tuple(dims), ggml_type, start, num_bytes)
        return tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, bytes per row] (rows: all dims but ggml's first)."""
        info = self.tensors[name]
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        num_rows = math.prod(info.dims[1:])
        return data.reshape(num_rows, info.num_bytes // num_rows)

    def array(self, name: str) -> np.ndarray:
        """An unquantized tensor as a typed view in numpy order (F32, F16, BF16 as uint16, I*)."""
        info = self.tensors[name]
        if info.ggml_type not in _PLAIN_DTYPES:
            raise ModelFileError(f"{self.path}: tensor {name!r} is quantized (ggml type {info.ggml_type})",
                                 self.path)
        data = np.frombuffer(self._buffer, dtype=_PLAIN_DTYPES[info.ggml_type],
                             count=info.num_elements, offset=info.offset)
        return data.reshape(info.shape)

    def release(self, name: str, first_row: int = 0, end_row: int | None = None) -> None:
        """Drop the tensor's pages (or those of its rows first_row .. end_row - 1) from this
        process's resident set once converted: they stay in the page cache, and a later read
        (of a neighbouring row sharing a page, or a lookup) maps them again."""
        info = self.tensors[name]
        row_bytes = info.num_bytes // math.prod(info.dims[1:])
        first = info.offset + first_row * row_bytes
        last = info.offset + (info.num_bytes if end_row is None else end_row * row_bytes)
        page = mmap.PAGESIZE
        start = first // page * page
        end = min(-(-last // page) * page, len(self._buffer))
        if hasattr(mmap, "MADV_DONTNEED") and not self._buffer.closed:
            self._buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        _close(self._buffer)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Unquantized ggml types -> numpy dtype of one element (BF16 as its raw 16 bits).
_PLAIN_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 24: np.dtype("i1"), 25: np.dtype("<i2"),
                 26: np.dtype("<i4"), 27: np.dtype("<i8"), 28: np.dtype("<f8"), 30: np.dtype("<u2")}


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True when the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC
