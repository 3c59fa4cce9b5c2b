"""Start-up that fails fast and shows progress.

``check_model_path(path)`` looks at a model path before any weights load, in milliseconds:
a missing path, a directory without config.json / tokenizer.json / *.safetensors, a file that
is no GGUF, a GGUF whose header or tensor data is cut short (a truncated download) all raise
ModelFileError naming the path. ``bind_listen_socket`` takes the server's port before the
model loads. ``LoadProgress`` shows the load's stages: a tqdm bar on a terminal (a widget in
Jupyter), log lines otherwise.
"""
from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from .errors import ModelFileError

log = logging.getLogger("engine")

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_TYPE_STRING, _TYPE_ARRAY, _TYPE_UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
MAX_GGUF_ENTRIES = 1 << 24  # more tensors or header values than this: the counts are garbage


# ---------------------------------------------------------------- model files

def check_model_path(path: str | os.PathLike) -> None:
    """Raise ModelFileError unless ``path`` looks loadable: an HF directory with config.json,
    tokenizer.json and *.safetensors, or a complete GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory", str(path))
    if path.is_dir():
        missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise ModelFileError(f"{path}: not a complete Hugging Face model directory (missing "
                                 f"{', '.join(missing)})", str(path))
        return
    check_gguf_file(path)


def check_gguf_file(path: str | os.PathLike) -> None:
    """Walk the GGUF header and tensor table (no values decoded) and check that every tensor's
    bytes lie inside the file. Raises ModelFileError: not a GGUF, truncated, or corrupt."""
    path = str(path)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (the first bytes are not 'GGUF') "
                                 "and not a Hugging Face model directory", path)
        file_size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                data_end = _gguf_data_end(buffer, path)
            except (struct.error, IndexError):
                raise ModelFileError(f"{path}: truncated GGUF file (the header ends early; "
                                     f"the file has {file_size} bytes)", path) from None
    if data_end > file_size:
        raise ModelFileError(f"{path}: truncated GGUF file (its tensors need {data_end} bytes, "
                             f"the file has {file_size}): download it again", path)


def _gguf_data_end(buffer, path: str) -> int:
    """The end offset of the last tensor's data, from the header and the tensor table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buffer, 4)
    if version < 2 or version > 0xFFFF:
        raise ModelFileError(f"{path}: corrupt or unsupported GGUF file (version {version})", path)
    if num_tensors > MAX_GGUF_ENTRIES or num_kv > MAX_GGUF_ENTRIES:
        raise ModelFileError(f"{path}: corrupt GGUF file (it claims {num_tensors} tensors and "
                             f"{num_kv} header values)", path)
    offset = 24
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(num_kv):
        key, offset = _string(buffer, offset)
        (type_id,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if key == b"general.alignment" and type_id == _TYPE_UINT32:
            (alignment,) = struct.unpack_from("<I", buffer, offset)
        offset = _skip_value(buffer, offset, type_id, path)
    tensor_end = 0
    for _ in range(num_tensors):
        name, offset = _string(buffer, offset)
        (num_dims,) = struct.unpack_from("<I", buffer, offset)
        if num_dims > 8:
            raise ModelFileError(f"{path}: corrupt GGUF file (tensor {name!r} has {num_dims} dims)", path)
        dims = struct.unpack_from(f"<{num_dims}Q", buffer, offset + 4)
        type_id, data_offset = struct.unpack_from("<IQ", buffer, offset + 4 + 8 * num_dims)
        offset += 4 + 8 * num_dims + 12
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: corrupt or unsupported GGUF file (tensor {name.decode(errors='replace')!r} "
                                 f"has unknown type {type_id})", path) from None
        num_bytes = math.prod(dims) // block_size * type_size
        tensor_end = max(tensor_end, data_offset + num_bytes)
    if alignment < 1:
        raise ModelFileError(f"{path}: corrupt GGUF file (general.alignment = {alignment})", path)
    data_start = -(-offset // alignment) * alignment
    return data_start + tensor_end


def _string(buffer, offset: int) -> tuple[bytes, int]:
    (num_bytes,) = struct.unpack_from("<Q", buffer, offset)
    end = offset + 8 + num_bytes
    if end > len(buffer):
        raise IndexError(end)
    return bytes(buffer[offset + 8 : end]), end


def _skip_value(buffer, offset: int, type_id: int, path: str) -> int:
    if type_id in _SCALAR_SIZES:
        return offset + _SCALAR_SIZES[type_id]
    if type_id == _TYPE_STRING:
        return _string(buffer, offset)[1]
    if type_id == _TYPE_ARRAY:
        item_type, num_items = struct.unpack_from("<IQ", buffer, offset)
        offset += 12
        if item_type in _SCALAR_SIZES:
            return offset + num_items * _SCALAR_SIZES[item_type]
        if num_items > len(buffer):
            raise IndexError(num_items)
        if item_type == _TYPE_STRING:  # a vocabulary: the hot loop of the check
            unpack_length = _U64.unpack_from
            for _ in range(num_items):
                offset += 8 + unpack_length(buffer, offset)[0]
            if offset > len(buffer):
                raise IndexError(offset)
            return offset
        for _ in range(num_items):
            offset = _skip_value(buffer, offset, item_type, path)
        return offset
    raise ModelFileError(f"{path}: corrupt GGUF file (unknown value type {type_id} at byte {offset})", path)


# ---------------------------------------------------------------- the server's port

class PortInUseError(OSError):
    """The server's address cannot be bound (in use, or not this machine's)."""


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), before anything slow happens.

    Raises PortInUseError with a one-line message. The caller hands the socket to the
    server (webapp.serve(..., sock=...)), so no other process can take the port meanwhile."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress does itself
        sock.bind(address)
    except OSError as exc:
        sock.close()
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise PortInUseError(f"cannot bind {host}:{port}: {reason}") from None
    return sock


# ---------------------------------------------------------------- progress

def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython() if hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


class LoadProgress:
    """The stages of a load, shown as they start.

    ``enabled``: a tqdm bar (stages done / total, elapsed seconds ticking while a long stage
    runs) when stderr is a terminal or in Jupyter; log lines on logger "engine" otherwise.
    Not enabled: silent.
    """

    REFRESH_SECONDS = 0.5

    def __init__(self, what: str, num_stages: int, enabled: bool = True):
        self.what = what
        self.enabled = enabled
        self.num_stages = num_stages
        self._bar = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._start = time.perf_counter()
        self._stage_start = self._start
        self._stage: str | None = None

    def __enter__(self) -> LoadProgress:
        if not self.enabled:
            return self
        is_tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        if is_tty or _in_notebook():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.num_stages, desc=f"loading {self.what}", unit="step",
                             bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]", leave=True)
            self._ticker = threading.Thread(target=self._tick, name="load-progress", daemon=True)
            self._ticker.start()
        else:
            log.info("loading %s", self.what)
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.REFRESH_SECONDS):
            self._bar.refresh()

    def stage(self, name: str) -> None:
        """The next stage starts (the previous one is done)."""
        now = time.perf_counter()
        if self._stage is not None:
            self._done_stage(now)
        self._stage, self._stage_start = name, now
        if self._bar is not None:
            self._bar.set_description_str(f"{name}", refresh=True)

    def _done_stage(self, now: float) -> None:
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            log.info("  %s: %.1f s", self._stage, now - self._stage_start)

    def __exit__(self, exc_type, exc, tb) -> None:
        now = time.perf_counter()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if exc_type is None and self._stage is not None:
            self._done_stage(now)
        if self._bar is not None:
            if exc_type is None:
                self._bar.set_description_str(f"loaded {self.what}", refresh=False)
            self._bar.close()
        elif self.enabled and exc_type is None:
            log.info("loaded %s in %.1f s", self.what, now - self._start)
