"""The production WSGI server: ``make_server(engine)`` and ``serve(engine)`` (waitress, threads).

One process, one engine, one continuous batch: waitress's handler threads run webapp.app's
Flask app; its connection limits and JSON errors for what never reaches Flask live here.
"""
from __future__ import annotations

import logging

from . import errors
from .app import JSON_MIMETYPE, create_app
from .shared import DEFAULT_MAX_BODY_BYTES, DEFAULT_THREADS, RESERVED_THREADS
from .sse_pump import SSE_TASK_KEY

log = logging.getLogger("webapp")

# Connection limits of the WSGI server (documented in the README, "Limits"). A connection that
# sends nothing for CHANNEL_TIMEOUT_S while no request of it is running (headers never finished,
# an idle keep-alive) is closed; the check runs every CLEANUP_INTERVAL_S. CONNECTION_LIMIT open
# sockets (each one file descriptor) are accepted before new ones wait in the listen backlog.
CHANNEL_TIMEOUT_S = 10
CLEANUP_INTERVAL_S = 2
CONNECTION_LIMIT = 2000
# Bodies past max_body_bytes get Flask's JSON 413 without being read; past this many bytes the
# WSGI server itself refuses (still JSON, via _JSONErrorChannel) before buffering them.
MAX_REQUEST_BODY_BYTES = 64 << 20


def _json_error_channel():
    """A waitress channel whose own errors (413 past MAX_REQUEST_BODY_BYTES, malformed HTTP) are
    OpenAI-style JSON like every other error of this server, with a lean write path for streams
    (``_StreamingTask.write``, ``write_soon``)."""
    import time

    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask, WSGITask

    class _JSONErrorTask(ErrorTask):
        def execute(self):
            error = self.request.error
            body = errors.from_http_status(error.code, f"{error.reason}: {error.body}").body()
            self.status = f"{error.code} {error.reason}"
            self.response_headers.append(("Content-Type", JSON_MIMETYPE))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    class _StreamingTask(WSGITask):
        """After the headers, a chunk of a chunked response (an SSE stream) is framed and handed to
        the channel in one step: waitress's own write re-checks the headers, the status and the
        length of every chunk."""

        def write(self, data):
            if self.wrote_header and self.chunked_response and data and self.has_body:
                self.channel.write_soon(b"%X\r\n%b\r\n" % (len(data), data))
            else:
                super().write(data)

        def get_environment(self):
            """With the task itself in it, for webapp.sse_pump (``SSE_TASK_KEY``)."""
            environ = super().get_environment()
            environ[SSE_TASK_KEY] = self
            return environ

        def backlog(self) -> int:
            """Bytes of this connection not yet taken by its socket."""
            return self.channel.total_outbufs_len

    class _JSONErrorChannel(HTTPChannel):
        error_task_class = _JSONErrorTask
        task_class = _StreamingTask

        def write_soon(self, data):
            """With nothing queued ahead, send at once from the handler thread (waitress sends every
            write at once too: send_bytes=1) without its buffer objects; whatever the socket does not
            take, and every other case, goes through waitress's own path."""
            if type(data) is bytes and data and self.connected and not self.total_outbufs_len:
                with self.outbuf_lock:
                    if self.connected and not self.total_outbufs_len:
                        try:
                            num_sent = self.socket.send(data)
                        except OSError:  # would block, or a disconnect: waitress's path handles it
                            num_sent = 0
                        if num_sent:
                            self.last_activity = time.time()
                            if num_sent == len(data):
                                return num_sent
                            data = data[num_sent:]
            return super().write_soon(data)

    return _JSONErrorChannel


def make_server(engine, host: str = "127.0.0.1", port: int = 0, threads: int = DEFAULT_THREADS,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent_requests: int | None = None,
                channel_timeout: int = CHANNEL_TIMEOUT_S, sock=None, **app_options):
    """A waitress server bound now (port 0: a free one); ``.run()`` serves, ``.close()`` stops.

    ``sock``: a socket already bound (engine.startup.bind_listen_socket, taken before the model
    loaded); host and port are then ignored.

    ``server.effective_port`` is the bound port. ``threads`` handler threads serve requests;
    at most ``max_concurrent_requests`` (default: threads - RESERVED_THREADS) of them run
    generation requests, one more gets 429 at once, so health probes and metrics scrapes always
    find a free thread under overload.

    Why waitress (measured in benchmarks/serving.py, section "wsgi"): it costs ~10-20 us per
    SSE chunk, on par with cheroot (which was slower at 8 streams in our runs), is already
    pinned, serves from threads in this process (one engine, one continuous batch; gunicorn's
    pre-fork workers would each need their own engine and split the batch), sends every write at
    once (waitress 3 defaults to send_bytes=1), and with channel_request_lookahead it keeps
    reading the socket, so a client that leaves is noticed at the next chunk.
    """
    import waitress.server

    if not isinstance(threads, int) or threads <= RESERVED_THREADS:
        raise ValueError(f"threads must be an integer > {RESERVED_THREADS} (the threads kept for probes), "
                         f"got {threads!r}")
    if max_concurrent_requests is None:
        max_concurrent_requests = threads - RESERVED_THREADS
    app = create_app(engine, max_body_bytes=max_body_bytes, max_concurrent_requests=max_concurrent_requests,
                     **app_options)
    _raise_open_file_limit(CONNECTION_LIMIT + 256)
    where = {"sockets": [sock]} if sock is not None else {"host": host, "port": port}
    server = waitress.server.create_server(
        app,
        **where,
        threads=threads,
        channel_request_lookahead=1,  # keep reading the socket: notice disconnects mid-stream
        # waitress 3 defaults to send_bytes=1: each SSE chunk is sent from the handler thread at once
        max_request_body_size=max(MAX_REQUEST_BODY_BYTES, max_body_bytes),
        connection_limit=CONNECTION_LIMIT,
        channel_timeout=channel_timeout,
        cleanup_interval=min(CLEANUP_INTERVAL_S, channel_timeout),
        ident="llm-engine",
    )
    server.channel_class = _json_error_channel()
    return server


def _raise_open_file_limit(wanted: int) -> None:
    """Each connection is a file descriptor: lift the soft limit toward ``wanted`` (never above the hard
    one)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: keep the limit
        pass


def serve(engine, host: str = "127.0.0.1", port: int = 8000, sock=None, **options) -> None:
    """Serve ``engine`` on host:port with the production WSGI server (waitress); blocks.

    ``sock``: serve on this bound socket instead of binding host:port (python -m webapp binds
    it before the model loads). options: api_key, model_name, threads, max_body_bytes,
    max_concurrent_requests, allowed_origins.
    """
    server = make_server(engine, host, port, sock=sock, **options)
    if sock is not None:
        host = sock.getsockname()[0]
    log.warning("serving on http://%s:%s", host, server.effective_port)
    try:
        server.run()
    finally:
        server.close()
