"""python -m webapp [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]

Start-up fails fast: the options, the model files and the port are checked (the port is
bound and held) before any weights load; a user's mistake is one line on stderr and exit
status 2, never a traceback. The load shows its stages (a bar on a terminal, log lines
otherwise).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.config import add_engine_arguments, engine_options_from_args

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser(prog: str = "python -m webapp") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible LLM server")
    parser.add_argument("--model", default=None,
                        help=".gguf file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (or set LLM_API_KEY)")
    parser.add_argument("--threads", type=int, default=64,
                        help="HTTP handler threads; 8 of them are kept for /health, /metrics and 429 answers")
    parser.add_argument("--max-concurrent-requests", type=int, default=None,
                        help="generation requests in flight before 429 (default: threads - 8)")
    parser.add_argument("--allowed-origins", default=None,
                        help="CORS: comma-separated browser origins allowed to call the API, or '*' (default: none)")
    parser.add_argument("--ray-replicas", type=int, default=None,
                        help="serve N engine replicas on Ray Serve (a local Ray, started and stopped here)")
    parser.add_argument("--ray-address", default=None,
                        help="serve on an existing Ray cluster (e.g. ray://head:10001 or auto); see docs/scale-out.md")
    add_engine_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m webapp") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from engine.config import EngineConfig
    from engine.errors import ModelFileError
    from engine.loader import default_model_path
    from engine.startup import PortInUseError, bind_listen_socket, check_model_path, check_startup, freeze_startup_heap

    from .cors import parse_origins
    from .shared import RESERVED_THREADS

    options = engine_options_from_args(args)
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if args.threads <= RESERVED_THREADS:
            raise ValueError(f"--threads must be more than {RESERVED_THREADS} (the threads kept for probes), "
                             f"got {args.threads}")
        if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be a positive integer, "
                             f"got {args.max_concurrent_requests}")
        config = EngineConfig.from_options(options)
        allowed_origins = parse_origins(args.allowed_origins)
        model_path = default_model_path() if args.model is None else args.model
        if args.ray_address is None:  # the model files, and the memory a local engine will take
            check_startup(model_path, config)
        else:  # the replicas run on the cluster's machines
            check_model_path(model_path)
        if args.ray_replicas is not None and args.ray_replicas < 1:
            raise ValueError(f"--ray-replicas must be a positive integer, got {args.ray_replicas}")
        if (args.ray_replicas or args.ray_address) and allowed_origins:
            raise ValueError("--allowed-origins is not supported with Ray Serve yet (docs/scale-out.md)")
        sock = bind_listen_socket(args.host, args.port)
    except (ValueError, ModelFileError, PortInUseError, FileNotFoundError) as exc:
        parser.exit(2, f"{parser.prog}: error: {_one_line(exc)}\n")

    if args.served_model_name:
        name = args.served_model_name
    elif args.model:
        name = os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]
    else:
        name = DEFAULT_MODEL_NAME
    if args.ray_replicas is not None or args.ray_address is not None:
        sock.close()  # the port is free (checked); Ray's HTTP proxy binds it
        _serve_on_ray(parser, args, options, name)
        return

    import engine

    from . import serve  # the package's public name (loads webapp.wsgi)

    try:
        eng = engine.Engine.from_pretrained(args.model, progress=True, **options)
    except (ValueError, OSError, MemoryError) as exc:  # passed the checks and still would not load
        sock.close()
        parser.exit(2, f"{parser.prog}: error: {_one_line(exc)}\n")
    logging.getLogger("webapp").info("froze %d start-up objects out of the collector's scans", freeze_startup_heap())
    try:
        serve(eng, sock=sock, api_key=args.api_key, model_name=name, threads=args.threads,
              max_concurrent_requests=args.max_concurrent_requests, allowed_origins=allowed_origins)
    except KeyboardInterrupt:
        pass
    finally:
        eng.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).splitlines())


def _serve_on_ray(parser: argparse.ArgumentParser, args, options: dict, name: str) -> None:
    from .ray_serve import DeployError, EngineSpec, serve_on_ray

    spec = EngineSpec(kwargs={"model": args.model, **options}, model_name=name)
    try:  # --max-concurrent-requests unset: the replicas' own limits (max_num_seqs, queue) bind first
        serve_on_ray(spec, args.host, args.port, args.ray_replicas or 1, address=args.ray_address,
                     api_key=args.api_key, max_concurrent_requests=args.max_concurrent_requests)
    except DeployError as exc:
        parser.exit(2, f"{parser.prog}: error: {_one_line(exc)}\n")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
