"""llama.cpp's own server and quantizer for benchmarks/vs_llamacpp.py: the 16-stream anchor over HTTP.

`make llamacpp` builds ``llama-server`` and ``llama-quantize`` from the pinned llama-cpp-python
sdist's vendored llama.cpp (its CMake, the ISA flags /proc/cpuinfo reports, named) into
.cache/llamacpp/server-<version>/, beside the CMake arguments used (cmake-args.txt).

- ``q4_0_copy(path, name)``: a Q4_0 copy of a GGUF file made by llama.cpp's own quantizer
  (the built llama-quantize, else ``llama_cpp.llama_model_quantize`` through the bindings),
  cached under .cache/llamacpp/q4_0/.
- ``Server``: a server subprocess on a free loopback port, ready once /health answers 200:
  llama-server (``--parallel N``, continuous batching) or ours (``python -m webapp``).
- ``concurrent_completions``: N greedy /v1/completions requests at once (token-id prompts,
  EOS ignored), aggregate completion tokens per second of wall time (prefill included).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMACPP_VERSION = "0.3.36"
SERVER_DIR = REPO / ".cache" / "llamacpp" / f"server-{LLAMACPP_VERSION}"
Q4_0_DIR = REPO / ".cache" / "llamacpp" / "q4_0"
LLAMA_FTYPE_MOSTLY_Q4_0 = 2  # llama.h's llama_ftype


class BenchmarkSetupError(RuntimeError):
    """A binary or file the benchmark needs is missing or failed (names what and how to get it)."""


def server_binary() -> Path | None:
    path = SERVER_DIR / "llama-server"
    return path if path.is_file() else None


def build_flags() -> str:
    """The CMake arguments llama-server was built with (empty when it was not built here)."""
    path = SERVER_DIR / "cmake-args.txt"
    return path.read_text().strip() if path.is_file() else ""


def q4_0_copy(source: str, name: str) -> str:
    """-> the path of a Q4_0 copy of `source` (made once, then cached)."""
    Q4_0_DIR.mkdir(parents=True, exist_ok=True)
    target = Q4_0_DIR / f"{name}-q4_0.gguf"
    if target.is_file():
        return str(target)
    partial = target.with_suffix(".partial")
    quantize = SERVER_DIR / "llama-quantize"
    if quantize.is_file():
        # --allow-requantize: the sources are already quantized (Q4_1, Q4_K_M); they are
        # dequantized to float32 and quantized again, as llama.cpp does.
        done = subprocess.run([str(quantize), "--allow-requantize", source, str(partial), "Q4_0", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise BenchmarkSetupError(f"llama-quantize failed on {source}: {done.stdout[-2000:]}")
    else:
        try:
            import llama_cpp
        except ImportError:
            raise BenchmarkSetupError("no quantizer: run `make llamacpp` (builds llama-quantize and "
                                      "llama-cpp-python)") from None
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPE_MOSTLY_Q4_0
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(source.encode(), str(partial).encode(), params)
        if rc != 0:
            raise BenchmarkSetupError(f"llama_model_quantize({source}) returned {rc}")
    partial.rename(target)
    return str(target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess bound to 127.0.0.1 on a free port; its log goes to a file."""

    def __init__(self, label: str, argv: list[str], port: int, log_path: Path, env: dict | None = None,
                 timeout_s: float = 600.0):
        self.label, self.port, self.log_path = label, port, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchmarkSetupError(f"{label} exited with status {self.proc.returncode} while starting "
                                          f"(a negative status is a signal: -4 is SIGILL); log: {log_path}")
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise BenchmarkSetupError(f"{label} not ready after {timeout_s:.0f} s; log: {log_path}")
            time.sleep(0.5)

    def system_info(self) -> str:
        """llama-server's own line naming the CPU features its build uses (empty for ours)."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "system_info" in line:
                return line.split("system_info:", 1)[-1].strip()
        return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def llama_server(path: str, num_parallel: int, ctx_per_stream: int, num_threads: int,
                 log_path: Path) -> Server:
    binary = server_binary()
    if binary is None:
        raise BenchmarkSetupError(f"{SERVER_DIR / 'llama-server'} is missing: run `make llamacpp`")
    port = free_port()
    argv = [str(binary), "-m", path, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(num_parallel), "--cont-batching", "-c", str(num_parallel * ctx_per_stream),
            "-t", str(num_threads), "-tb", str(num_threads), "--no-webui", "--no-warmup"]
    return Server(f"llama-server --parallel {num_parallel}", argv, port, log_path)


def our_server_argv(path: str, options: dict, port: int) -> list[str]:
    """``python -m webapp`` with the engine options as its flags (speculative=None: ``off``)."""
    argv = [sys.executable, "-m", "webapp", "--model", path, "--host", "127.0.0.1", "--port", str(port)]
    for key, value in options.items():
        if value is None and key == "speculative":
            value = "off"  # Python's None is the command line's off
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def our_server(path: str, options: dict, log_path: Path) -> Server:
    port = free_port()
    argv = our_server_argv(path, options, port)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return Server("ours (python -m webapp)", argv, port, log_path, env=env)


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body: dict, timeout: float = 1800) -> dict:
    """POST a JSON body to the local server on port -> its JSON reply (any status but 200 raises)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise BenchmarkSetupError(f"port {port}: {path} answered {response.status}: {data[:500]!r}")
    return json.loads(data)


def complete(port: int, prompt_ids: list[int], num_tokens: int) -> int:
    """One greedy completion of exactly num_tokens (EOS ignored) -> completion tokens reported."""
    body = {"prompt": prompt_ids, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True}
    return int(post_json(port, "/v1/completions", body)["usage"]["completion_tokens"])


def concurrent_completions(port: int, prompts: list[list[int]], num_tokens: int) -> float:
    """All prompts sent at once, one connection each -> completion tokens / wall seconds."""
    counts = [0] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            counts[i] = complete(port, prompts[i], num_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(counts) / elapsed
