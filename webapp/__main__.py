"""python -m webapp [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]"""
from __future__ import annotations

import argparse
import logging
import os

from engine.config import add_engine_arguments, engine_options_from_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m webapp", description="OpenAI-compatible LLM server")
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
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
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import engine

    from . import serve
    from .cors import parse_origins

    eng = engine.Engine.from_pretrained(args.model, **engine_options_from_args(args))
    if args.served_model_name:
        name = args.served_model_name
    elif args.model:
        name = os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]
    else:
        name = "SmolLM2-135M-Instruct"
    try:
        serve(eng, host=args.host, port=args.port, api_key=args.api_key, model_name=name, threads=args.threads,
              max_concurrent_requests=args.max_concurrent_requests, allowed_origins=parse_origins(args.allowed_origins))
    except KeyboardInterrupt:
        pass
    finally:
        eng.close()


if __name__ == "__main__":
    main()
