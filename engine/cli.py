"""The ``llm-engine`` console script (installed by ``pip install .``).

    llm-engine chat [PROMPT] [options]      # as python -m engine chat (interactive without PROMPT)
    llm-engine complete PROMPT [options]    # as python -m engine complete
    llm-engine serve [webapp options]       # as python -m webapp (needs the "serve" extra)
"""
from __future__ import annotations

import sys

USAGE = "usage: llm-engine {chat,complete,serve} ...\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE + __doc__.split("\n\n", 1)[1])
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        try:
            from webapp.__main__ import main as serve_main
        except ImportError as exc:  # flask / waitress missing
            sys.stderr.write(f"llm-engine serve: error: {exc.name or exc} is not installed "
                             "(pip install 'llm-engine[serve]')\n")
            return 2
        serve_main(rest, prog="llm-engine serve")
        return 0
    if command in ("chat", "complete"):
        from engine.__main__ import main as engine_main

        return engine_main(argv, prog="llm-engine")
    sys.stderr.write(USAGE + f"llm-engine: error: unknown command {command!r} (chat, complete, serve)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
