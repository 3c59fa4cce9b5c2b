"""Start-up that fails fast and shows progress.

``check_model_path(path)`` looks at a model path before any weights load, in milliseconds:
a model whose tensors do not match its metadata (engine.loader.validate),
a missing path, a directory without config.json / tokenizer.json / *.safetensors, a file that
is no GGUF, a GGUF whose header or tensor data is cut short (a truncated download) all raise
ModelFileError naming the path. ``check_memory`` refuses a KV cache (+ weights) larger than
what the process may use (cgroup limit, MemAvailable) unless over-commit is allowed.
``bind_listen_socket`` takes the server's port before the
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
        from .loader.encoder_loader import is_encoder_directory
        from .loader.validate import check_hf_directory, read_safetensors_header, safetensors_files

        if is_encoder_directory(path):  # BERT (engine.models.bert): its loader checks the config
            for file in safetensors_files(path):
                read_safetensors_header(file)  # offsets inside the file, byte counts matching shapes
            return
        check_hf_directory(path)  # config.json against the safetensors headers
        return
    from .loader.encoder_loader import is_encoder_path

    if is_encoder_path(path):  # a "bert" GGUF: the header, the tensors' bytes; its loader checks the shapes
        try:
            GGUFFile(str(path), with_vocabulary=False).close()
        except ValueError as exc:
            detail = str(exc).removeprefix(f"{path}: ")
            raise ModelFileError(f"{path}: corrupt GGUF file ({detail}): download it again", str(path)) from None
        return
    check_gguf_file(path)


def check_gguf_file(path: str | os.PathLike) -> None:
    """Read the GGUF header and tensor table (engine.gguf_file, the loader's own reader; the
    vocabulary is walked, not decoded), check that every tensor's bytes lie inside the file, and
    that the tensors the architecture needs have the shapes the metadata implies
    (engine.loader.validate). Raises ModelFileError: not a GGUF, truncated, or corrupt."""
    path = str(path)
    if not is_gguf_file(path):
        raise ModelFileError(f"{path}: not a GGUF file (the first bytes are not 'GGUF') "
                             "and not a Hugging Face model directory", path)
    try:
        gguf = GGUFFile(path, with_vocabulary=False)
    except ValueError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        kind = "truncated" if "truncated" in detail else "corrupt"
        raise ModelFileError(f"{path}: {kind} GGUF file ({detail}): download it again", path) from None
    from .loader.gguf_loader import read_config

    with gguf:
        read_config(gguf)  # the metadata's bounds, every tensor's shape and type


# ---------------------------------------------------------------- memory

CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes ~2^63 for "no limit"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 "max": no limit


def _cgroup_dirs(base: Path, relative: str) -> list[Path]:
    """The process's cgroup directory under base and its ancestors up to base (each limit applies);
    base alone where the path is not visible (a container's namespace)."""
    here = base / relative.lstrip("/")
    if not here.is_dir():
        return [base]
    return [here, *(p for p in here.parents if p == base or base in p.parents)]


def memory_available(cgroup_root: Path = CGROUP_ROOT, proc: Path = Path("/proc")) -> tuple[int, str]:
    """-> (bytes this process may still allocate, where the figure comes from): the least of the
    system's MemAvailable and, for the process's cgroup and each ancestor, its memory limit less
    its usage (cgroup v2 memory.max - memory.current, v1 memory.limit_in_bytes - usage_in_bytes)."""
    found: list[tuple[int, str]] = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        cgroups = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        cgroups = []
    for line in cgroups:
        hierarchy, controllers, relative = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2 (possibly under "unified" beside v1)
            for base in (cgroup_root, cgroup_root / "unified"):
                for d in _cgroup_dirs(base, relative):
                    limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                    if limit is not None and usage is not None:
                        found.append((limit - usage, f"cgroup memory.max of {d}"))
        elif "memory" in controllers.split(","):
            for d in _cgroup_dirs(cgroup_root / "memory", relative):
                limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
                if limit is not None and usage is not None and limit < _NO_LIMIT:
                    found.append((limit - usage, f"cgroup memory.limit_in_bytes of {d}"))
    if not found:
        return _NO_LIMIT, "no limit found"
    return min(found)


def format_bytes(num_bytes: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"


def check_memory(config, kv_cache_bytes: int, weights_bytes: int = 0, param: str = "kv_cache_tokens",
                 available: tuple[int, str] | None = None) -> None:
    """MemoryLimitError unless the KV cache, the weights still to load and the scheduler's token
    table ([max_num_seqs, max_model_len] int32) fit in what the process may still use.

    config: a resolved EngineConfig (config.allow_overcommit skips the check). param: the option
    that sized the cache ("kv_cache_tokens" when the user set it, else "max_model_len")."""
    from .errors import MemoryLimitError

    if config.allow_overcommit:
        return
    table_bytes = config.max_num_seqs * config.max_model_len * 4
    need = kv_cache_bytes + weights_bytes + table_bytes
    num_available, source = memory_available() if available is None else available
    if need <= num_available:
        return
    flag = "--" + param.replace("_", "-")
    value = config.kv_cache_tokens if param == "kv_cache_tokens" else config.max_model_len
    parts = [f"a KV cache of {format_bytes(kv_cache_bytes)} ({config.kv_cache_tokens} tokens)"]
    if weights_bytes:
        parts.append(f"{format_bytes(weights_bytes)} of weights")
    parts.append(f"{format_bytes(table_bytes)} of scheduler tables")
    raise MemoryLimitError(
        f"{param}={value} needs {format_bytes(need)} ({' + '.join(parts)}), more than the "
        f"{format_bytes(num_available)} this process may use ({source}): lower {param} ({flag}), "
        "or pass allow_overcommit=True (--allow-overcommit) to start anyway",
        param, num_bytes_needed=need, num_bytes_available=num_available)


def check_startup(path: str | os.PathLike, config, *, weights_loaded: bool = False) -> None:
    """Everything a start-up can refuse before loading: the model files (check_model_path, the
    tensors against the metadata) and the memory the KV cache, the weights (unless already
    loaded) and the scheduler's tables will take (check_memory). config: the user's EngineConfig
    (unresolved). ModelFileError or MemoryLimitError, both ValueErrors with one-line messages."""
    from .loader import model_footprint
    from .loader.encoder_loader import is_encoder_path
    from .models.llama import kv_cache_bytes

    check_model_path(path)
    if config.prefix_cache_dir is not None:
        check_prefix_cache_dir(config.prefix_cache_dir)
    if is_encoder_path(path):  # an encoder keeps no KV cache, and its
        return  # weights (tens of MB for the BERT family) are not estimated here
    model_config, kv_dtype, weights_bytes = model_footprint(path, config.dtype, config.quantization)
    resolved = config.resolve(model_config.max_position_embeddings)
    param = "kv_cache_tokens" if config.kv_cache_tokens is not None else "max_model_len"
    kv_bytes = kv_cache_bytes(model_config, resolved.kv_cache_tokens, kv_dtype, resolved)
    weights_bytes = 0 if weights_loaded else weights_bytes
    if config.speculative == "draft" and config.draft_model is not None:  # its files, weights and KV pool too
        check_model_path(config.draft_model)
        draft_config, draft_kv_dtype, draft_weights = model_footprint(config.draft_model, config.dtype,
                                                                      config.quantization)
        kv_bytes += kv_cache_bytes(draft_config, resolved.kv_cache_tokens, draft_kv_dtype, resolved)
        if os.path.realpath(config.draft_model) != os.path.realpath(path):  # a model drafting for itself shares
            weights_bytes += draft_weights
    check_memory(resolved, kv_bytes, weights_bytes, param=param)


def check_prefix_cache_dir(path: str) -> None:
    """The prefix cache's directory exists (made here) and is writable, else InvalidParameterError."""
    from .errors import InvalidParameterError

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise InvalidParameterError(f"prefix_cache_dir {path!r}: {exc.strerror or exc}", "prefix_cache_dir") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidParameterError(f"prefix_cache_dir {path!r} is not writable", "prefix_cache_dir")


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


def freeze_startup_heap() -> int:
    """Move every object alive now (imports, the model's and tokenizer's objects, the server) to
    the garbage collector's permanent generation, for a process that has finished starting and
    only serves: a full collection then scans what serving allocated, not the ~190k start-up
    objects it took 160 ms to traverse here with the GIL held (every stream stalled meanwhile).
    What is frozen is never collected, so a process of its own only (``python -m webapp``);
    never for an engine inside a user's process. Returns the number of objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
