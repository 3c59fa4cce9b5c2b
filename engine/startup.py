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
import os
import socket
import sys
import threading
import time
from pathlib import Path

from .errors import ModelFileError
from .gguf_file import GGUFFile, is_gguf_file

log = logging.getLogger("engine")



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
    """Read the GGUF header and tensor table (engine.gguf_file, the loader's own reader; the
    vocabulary is walked, not decoded) and check that every tensor's bytes lie inside the file.
    Raises ModelFileError: not a GGUF, truncated, or corrupt."""
    path = str(path)
    if not is_gguf_file(path):
        raise ModelFileError(f"{path}: not a GGUF file (the first bytes are not 'GGUF') "
                             "and not a Hugging Face model directory", path)
    try:
        with GGUFFile(path, with_vocabulary=False):
            pass
    except ValueError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        kind = "truncated" if "truncated" in detail else "corrupt"
        raise ModelFileError(f"{path}: {kind} GGUF file ({detail}): download it again", path) from None


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
