"""The prefix cache's disk tier: full KV blocks kept in files across restarts.

One file per full prompt block, named by its place in the prompt and its chained hash
(engine/core/block_manager.py: a hash names the whole prefix up to that block), under a
directory named by the model's fingerprint (file identity, load options, KV dtype and shape,
block size, and whether a product route rounds to bfloat16). Blocks go to disk off the engine thread: the engine thread
copies a newly computed block out of the cache (``save``) and a writer thread writes it
(temporary file + ``os.replace``, so a reader, or another engine sharing the directory,
never sees half a file) and evicts the least recently used files beyond ``max_bytes``.
Blocks come back on the caller's thread (``read``, before the request is submitted: the
files are read and checked there) and the engine thread only copies them into the cache at
admission (``restore``). A file whose header, fingerprint, hash, shape or checksum disagrees
is logged, removed and read as a miss: the prompt is prefilled instead.

File layout (little-endian): HEADER (magic, version, dtype code, layers, block size, KV
heads, head dim, block index, fingerprint, block hash, payload bytes, payload crc32,
header crc32), then the payload: K then V of the block, each [L, block_size, KH, D].
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib

import torch

from ..errors import InvalidParameterError

log = logging.getLogger("engine")

MAGIC = b"LLMEKVB\x00"
VERSION = 1
HEADER = struct.Struct("<8sHBxIIIII16s16sQI")  # ... payload crc32; the header's own crc32 follows
HEADER_BYTES = HEADER.size + 4
DTYPE_CODES = {torch.float16: 1, torch.float32: 2, torch.bfloat16: 3}
SUFFIX = ".kv"
# Blocks copied out for the writer and not yet written: beyond it a block is not saved (counted).
MAX_PENDING_BYTES = 512 << 20
# Blocks read ahead for requests not yet admitted: beyond it a request prefills instead.
MAX_PREFETCH_BYTES = 1 << 30
LRU_SECONDS = 60.0  # eviction's grain of recency
EVICT_TO = 0.9  # an eviction pass leaves the directory at this share of max_bytes
STALE_TMP_SECONDS = 3600.0  # a writer's temporary file older than this was left by a crash


def default_prefix_cache_dir() -> str | None:
    """The command lines' and notebooks' default: $LLM_ENGINE_PREFIX_CACHE_DIR ("" or "off": none),
    else none under pytest (PYTEST_CURRENT_TEST, which the servers and kernels a test starts inherit),
    else the user cache directory's llm-engine/prefix."""
    env = os.environ.get("LLM_ENGINE_PREFIX_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "none") else env
    if "PYTEST_CURRENT_TEST" in os.environ:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llm-engine", "prefix")


def file_identity(path: str) -> list:
    """(name, size, mtime_ns, blake2b of the first MiB) of a model file or of each file of a directory."""
    paths = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if os.path.isfile(os.path.join(path, name)))
    out = []
    for p in paths:
        st = os.stat(p)
        with open(p, "rb") as f:
            head = hashlib.blake2b(f.read(1 << 20), digest_size=16).hexdigest()
        out.append([os.path.realpath(p), st.st_size, st.st_mtime_ns, head])
    return out


def model_fingerprint(identity, kv_cache, block_size: int, routes: dict | None) -> bytes:
    """16 bytes naming everything a block's K/V depend on besides its tokens. Of the product
    routes only whether one is approximate (bfloat16, engine.models.routes.APPROXIMATE): the exact
    ones differ by float32 rounding, as a block computed in another chunk would, and the table is
    timed per process (a table timed on a busy machine is timed again by a quiet one), so two
    engines sharing a directory would otherwise not meet each other's blocks."""
    from engine.models.routes import APPROXIMATE

    k = kv_cache.k  # [L, S, KH, D]
    approximate = any(route in APPROXIMATE for table in (routes or {}).values() for route in table)
    doc = {"version": VERSION, "model": identity, "kv_dtype": str(k.dtype), "block_size": block_size,
           "layers": k.shape[0], "kv_heads": k.shape[2], "head_dim": k.shape[3], "approximate": approximate}
    return hashlib.blake2b(json.dumps(doc, sort_keys=True, default=str).encode(), digest_size=16).digest()


def make_prefix_disk_cache(config, model, kv_cache) -> PrefixDiskCache | None:
    """The disk tier of a resolved EngineConfig, or None without ``prefix_cache_dir``."""
    if config.prefix_cache_dir is None or not config.enable_prefix_caching:
        return None
    identity = getattr(model, "file_identity", None)
    if identity is None or not hasattr(kv_cache, "k"):
        raise InvalidParameterError(
            f"prefix_cache_dir needs a model loaded from its files by Engine.from_pretrained (they name the "
            f"cache); {type(model).__name__} has no file identity or no paged KV cache", "prefix_cache_dir")
    fingerprint = model_fingerprint(identity, kv_cache, config.block_size, getattr(model, "product_routes", None))
    try:
        return PrefixDiskCache(config.prefix_cache_dir, config.prefix_cache_disk_bytes, fingerprint, kv_cache,
                               config.block_size)
    except OSError as exc:
        raise InvalidParameterError(f"prefix_cache_dir {config.prefix_cache_dir!r}: {exc}", "prefix_cache_dir") from exc


class DiskBlocks:
    """Blocks read ahead for one sequence: ``payloads[j]`` is prompt block ``first + j`` ([2, L, bs, KH, D])."""

    __slots__ = ("first", "payloads", "_cache", "_num_bytes")

    def __init__(self, cache: PrefixDiskCache, first: int, payloads: list[torch.Tensor], num_bytes: int):
        self.first = first
        self.payloads = payloads
        self._cache = cache
        self._num_bytes = num_bytes

    def release(self) -> None:
        """Give back the read-ahead budget (idempotent)."""
        if self._num_bytes:
            self._cache._unreserve(self._num_bytes)
            self._num_bytes = 0
        self.payloads = []

    def __del__(self) -> None:
        self.release()


class PrefixDiskCache:
    def __init__(self, root: str, max_bytes: int, fingerprint: bytes, kv_cache, block_size: int):
        k = kv_cache.k
        if k.dtype not in DTYPE_CODES:
            raise ValueError(f"prefix_cache_dir: KV dtype {k.dtype} has no disk format")
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.dir = os.path.join(self.root, fingerprint.hex())
        os.makedirs(self.dir, exist_ok=True)  # OSError: the caller names prefix_cache_dir
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.block_shape = (k.shape[0], block_size, k.shape[2], k.shape[3])  # [L, bs, KH, D]
        self.dtype = k.dtype
        self.payload_bytes = 2 * k[:, :block_size].numel() * k.element_size()
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.RLock()  # DiskBlocks.__del__ may release a reservation on any thread
        self._num_pending_bytes = 0
        self._num_prefetch_bytes = 0
        self._num_dir_bytes: int | None = None  # the writer's estimate of the directory's size
        self.num_written_blocks = 0
        self.num_dropped_blocks = 0  # not saved: the writer was MAX_PENDING_BYTES behind
        self.num_read_blocks = 0
        self.num_bad_files = 0  # corrupt, truncated or foreign files found and removed
        self.num_evicted_files = 0
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-writer", daemon=True)
        self._writer.start()

    # ----- engine thread -----
    def save(self, block_hash: int, index: int, block_id: int) -> None:
        """Copy block ``block_id`` (prompt block ``index``) out of the cache for the writer; never blocks."""
        with self._lock:
            if self._num_pending_bytes + self.payload_bytes > MAX_PENDING_BYTES:
                self.num_dropped_blocks += 1
                return
            self._num_pending_bytes += self.payload_bytes
        s = block_id * self.block_size
        kv = self.kv_cache
        payload = torch.stack((kv.k[:, s : s + self.block_size], kv.v[:, s : s + self.block_size]))  # [2, L, bs, KH, D]
        self._queue.put((block_hash, index, payload))

    def restore(self, block_id: int, payload: torch.Tensor) -> None:
        """Copy a block read from disk into cache block ``block_id``."""
        s = block_id * self.block_size
        self.kv_cache.k[:, s : s + self.block_size].copy_(payload[0])
        self.kv_cache.v[:, s : s + self.block_size].copy_(payload[1])

    # ----- any thread -----
    def path_of(self, block_hash: int, index: int) -> str:
        return os.path.join(self.dir, f"{index:06d}-{block_hash:032x}{SUFFIX}")

    def read(self, block_hashes: list[int], first: int) -> DiskBlocks | None:
        """The longest run of prompt blocks ``first``, ``first + 1``, ... found on disk and sound."""
        payloads: list[torch.Tensor] = []
        for index in range(first, len(block_hashes)):
            with self._lock:
                if self._num_prefetch_bytes + self.payload_bytes > MAX_PREFETCH_BYTES:
                    break
                self._num_prefetch_bytes += self.payload_bytes
            payload = self._read_file(block_hashes[index], index)
            if payload is None:
                self._unreserve(self.payload_bytes)
                break
            payloads.append(payload)
        if not payloads:
            return None
        self.num_read_blocks += len(payloads)
        return DiskBlocks(self, first, payloads, len(payloads) * self.payload_bytes)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every block handed to the writer is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._writer.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)

    def stats(self) -> dict:
        return {"num_prefix_cache_disk_written_blocks": self.num_written_blocks,
                "num_prefix_cache_disk_dropped_blocks": self.num_dropped_blocks,
                "num_prefix_cache_disk_read_blocks": self.num_read_blocks,
                "num_prefix_cache_disk_bad_files": self.num_bad_files,
                "num_prefix_cache_disk_evicted_files": self.num_evicted_files}

    def _unreserve(self, num_bytes: int) -> None:
        with self._lock:
            self._num_prefetch_bytes -= num_bytes

    def _read_file(self, block_hash: int, index: int) -> torch.Tensor | None:
        path = self.path_of(block_hash, index)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("prefix cache file %s unreadable (%s): prefilling instead", path, exc)
            return None
        problem = self._check(data, block_hash, index)
        if problem is not None:
            log.warning("prefix cache file %s %s: removed, prefilling instead", path, problem)
            self.num_bad_files += 1
            _remove(path)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        flat = torch.frombuffer(bytearray(memoryview(data)[HEADER_BYTES:]), dtype=self.dtype)
        return flat.view(2, *self.block_shape)

    def _check(self, data: bytes, block_hash: int, index: int) -> str | None:
        """What is wrong with a file's bytes, or None."""
        if len(data) < HEADER_BYTES:
            return f"is truncated ({len(data)} bytes, the header alone is {HEADER_BYTES})"
        fields = HEADER.unpack_from(data)
        (header_crc,) = struct.unpack_from("<I", data, HEADER.size)
        if fields[0] != MAGIC:
            return "is not a prefix cache file (bad magic)"
        if zlib.crc32(memoryview(data)[: HEADER.size]) != header_crc:
            return "has a corrupt header (checksum)"
        magic, version, dtype_code, layers, bs, kv_heads, head_dim, file_index, fingerprint, hash_bytes, \
            payload_bytes, payload_crc = fields
        if version != VERSION:
            return f"has format version {version}, not {VERSION}"
        if fingerprint != self.fingerprint:
            return "belongs to another model or engine configuration (fingerprint)"
        if (layers, bs, kv_heads, head_dim) != self.block_shape or dtype_code != DTYPE_CODES[self.dtype]:
            return "has another KV shape or dtype"
        if hash_bytes != block_hash.to_bytes(16, "little") or file_index != index:
            return "holds another block (hash)"
        if payload_bytes != self.payload_bytes or len(data) != self.file_bytes:
            return f"is truncated or padded ({len(data)} bytes, expected {self.file_bytes})"
        if zlib.crc32(memoryview(data)[HEADER_BYTES:]) != payload_crc:
            return "has a corrupt payload (checksum)"
        return None

    # ----- writer thread -----
    def _write_loop(self) -> None:
        self._num_dir_bytes = self._scan_and_evict()
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            block_hash, index, payload = item
            try:
                self._write(block_hash, index, payload)
            except Exception as exc:  # a full or read-only disk: this block stays in memory only
                log.warning("prefix cache: block not written to %s: %s", self.dir, exc)
            finally:
                with self._lock:
                    self._num_pending_bytes -= self.payload_bytes
                self._queue.task_done()

    def _write(self, block_hash: int, index: int, payload: torch.Tensor) -> None:
        path = self.path_of(block_hash, index)
        if os.path.exists(path):  # another request or engine wrote it: keep it recent
            os.utime(path)
            return
        body = memoryview(payload.contiguous().view(torch.uint8).numpy()).cast("B")
        d = self.block_shape
        header = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], d[0], d[1], d[2], d[3], index,
                             self.fingerprint, block_hash.to_bytes(16, "little"), len(body), zlib.crc32(body))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(struct.pack("<I", zlib.crc32(header)))
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        self.num_written_blocks += 1
        self._num_dir_bytes += self.file_bytes
        if self._num_dir_bytes > self.max_bytes:
            self._num_dir_bytes = self._scan_and_evict()

    def _scan_and_evict(self) -> int:
        """The directory's bytes after removing the least recently used files beyond max_bytes (every
        model's subdirectory counts; use is counted per minute, and within a minute a prefix's later
        blocks go first, so what stays is the head of a prefix, which is what a lookup can use)."""
        files, total, now = [], 0, time.time()
        try:
            subdirs = [e.path for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return 0
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        _remove(e.path)
                    continue
                if e.name.endswith(SUFFIX):
                    index = int(e.name[:6]) if e.name[:6].isdigit() else 0
                    files.append((int(st.st_mtime // LRU_SECONDS), -index, e.path, st.st_size))
                    total += st.st_size
        if total <= self.max_bytes:
            return total
        files.sort()
        target = self.max_bytes * EVICT_TO
        for _mtime, _index, path, size in files:
            if total <= target:
                break
            if _remove(path):
                self.num_evicted_files += 1
            total -= size
        return total


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False
