"""Command line for in-process use.

    python -m engine chat "Hello"            # stream a reply to one message
    python -m engine chat                     # interactive: one line per turn, empty line or EOF quits
    python -m engine complete "Once upon a"   # raw text continuation
"""
from __future__ import annotations

import argparse
import sys

from .api import Engine
from .config import add_engine_arguments, engine_options_from_args
from .params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["chat", "complete"])
    parser.add_argument("text", nargs="?", help="message (chat) or prompt (complete); chat without it is interactive")
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--system", default=None, help="system message for chat")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_arguments(parser)
    return parser


def _print_stream(stream) -> str:
    pieces = []
    for event in stream:
        sys.stdout.write(event.text)
        sys.stdout.flush()
        pieces.append(event.text)
    sys.stdout.write("\n")
    return "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "complete" and args.text is None:
        print("error: complete needs a prompt", file=sys.stderr)
        return 2
    try:
        eng = Engine.from_pretrained(args.model, **engine_options_from_args(args))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with eng:
        if args.command == "complete":
            sys.stdout.write(args.text)
            _print_stream(eng.stream(args.text, params))
            return 0
        messages = [{"role": "system", "content": args.system}] if args.system else []
        turns = [args.text] if args.text is not None else None
        while True:
            if turns is not None:
                if not turns:
                    return 0
                text = turns.pop()
            else:
                try:
                    text = input("> ")
                except EOFError:
                    return 0
                if not text.strip():
                    return 0
            messages.append({"role": "user", "content": text})
            reply = _print_stream(eng.stream_chat(messages, params))
            messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
