"""Command line for in-process use (also installed as ``llm-engine chat|complete``).

    python -m engine chat "Hello"            # stream a reply to one message
    python -m engine chat                     # interactive (engine/chat_repl.py): /reset /system /params,
                                              # Ctrl-C stops a reply; an empty line or Ctrl-D quits
    python -m engine complete "Once upon a"   # raw text continuation

Options, sampling values and the model files are checked before any weights load; a
mistake is one line on stderr and exit status 2. The load shows its stages on stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys

from .config import EngineConfig, add_engine_arguments, engine_options_from_args
from .params import SamplingParams


def build_parser(prog: str = "python -m engine", commands: tuple[str, ...] = ("chat", "complete")):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=list(commands))
    parser.add_argument("text", nargs="?", help="message (chat) or prompt (complete); chat without it is interactive")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--system", default=None, help="system message for chat")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_arguments(parser)
    return parser


def _print_stream(stream) -> str:
    pieces = []
    try:
        for event in stream:
            sys.stdout.write(event.text)
            sys.stdout.flush()
            pieces.append(event.text)
    finally:
        stream.close()
    sys.stdout.write("\n")
    return "".join(pieces)


def main(argv: list[str] | None = None, prog: str = "python -m engine") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from .errors import ModelFileError
    from .loader import default_model_path
    from .startup import check_model_path

    def fail(message: str) -> int:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        options = engine_options_from_args(args)
        EngineConfig.from_options(options)
        if args.command == "complete" and args.text is None:
            return fail("complete needs a prompt")
        check_model_path(default_model_path() if args.model is None else args.model)
    except (ValueError, ModelFileError, FileNotFoundError) as exc:
        return fail(str(exc))
    if not sys.stderr.isatty():  # the load's stages as log lines
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    from .api import Engine
    from .chat_repl import ChatSession, run_repl

    try:
        eng = Engine.from_pretrained(args.model, progress=True, **options)
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    with eng:
        try:
            if args.command == "complete":
                sys.stdout.write(args.text)
                _print_stream(eng.stream(args.text, params))
                return 0
            session = ChatSession(eng, params, system=args.system)
            if args.text is not None:
                session.turn(args.text)
                return 0
            return run_repl(session)
        except KeyboardInterrupt:  # outside a reply (a reply's Ctrl-C is handled by the session)
            sys.stdout.write("\n")
            return 130


if __name__ == "__main__":
    sys.exit(main())
