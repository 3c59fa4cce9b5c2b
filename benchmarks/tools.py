"""Tool calling: what parsing the reply for calls costs per generated token (host side only).

ScriptedModel (no model compute) with the default model's tokenizer replays two replies of
about the same length (~1,400 tokens): plain prose, and prose with 16 Hermes ``<tool_call>`` calls. Each is
streamed through ``Engine.stream_chat`` without tools and with ``tools`` (tool_choice auto:
every event goes through the parser), and each event is serialized as its SSE chunk (the
per-token ``ChunkWriter.event`` path, or ``delta_chunk`` for events with call deltas), as the
server does. All configurations interleave within each repeat; medians with min-max; the load
average is printed. A second table times the parser alone, fed the replies' token texts.
Never asserts on time.

    .venv/bin/python benchmarks/tools.py [--repeats 9]

Prints a table; writes benchmarks/results/tools.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import engine  # noqa: E402
from benchmarks.common import environment, fmt_stats, measure, print_table, summarize, write_json  # noqa: E402
from cext.chunk import ChunkWriter  # noqa: E402
from engine.loader import default_model_path  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.testing import ScriptedModel  # noqa: E402
from engine.tools import HermesParser  # noqa: E402
from webapp.sse import delta_chunk  # noqa: E402

PROSE = ("The engine streams every token as soon as it is sampled, and the server writes it to the socket "
         "at once. Tool calls arrive as JSON inside tags; the parser holds back what may start a call. ")
CALL = ('<tool_call>\n{"name": "search", "arguments": {"query": "%s", "limit": 10, "filters": {"lang": "en"}}}\n'
        '</tool_call>\n')
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "filters": {"type": "object"}}}}}]
ASK = [{"role": "user", "content": "Look it up."}]


def replies() -> dict[str, str]:
    with_calls = (PROSE * 2 + "".join(CALL % (PROSE[:60 + 20 * i]) for i in range(4))) * 4
    plain = PROSE * (len(with_calls) // len(PROSE) + 1)
    return {"prose": plain[:len(with_calls)], "prose + 16 calls": with_calls}


def run_once(eng, tools, num_tokens: int) -> tuple[float, int]:
    """Seconds to stream and serialize one reply; the number of tool call deltas seen."""
    writer = ChunkWriter("chatcmpl-b", "m", 0, True)
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    num_deltas = 0
    start = time.perf_counter()
    for event in eng.stream_chat(ASK, params, tools=tools):
        if event.tool_calls is None:
            writer.event(event.text, event.logprobs, event.finish_reason, event.index)
        else:
            num_deltas += len(event.tool_calls)
            delta_chunk(writer, event)
    return time.perf_counter() - start, num_deltas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    tok = engine.load_tokenizer(default_model_path())
    engines, lengths = {}, {}
    for name, text in replies().items():
        ids = tok.encode(text, add_special_tokens=False)
        lengths[name] = len(ids)
        engines[name] = engine.Engine(ScriptedModel(ids, tok.vocab_size), tok, max_model_len=4096, speculative=None)
    configs = [(reply, label, tools) for reply in engines for label, tools in (("no tools", None), ("tools", TOOLS))]
    seconds = {c[:2]: [] for c in configs}
    deltas = {}
    try:
        for config in configs:  # warm-up
            run_once(engines[config[0]], config[2], lengths[config[0]])
        for _ in range(args.repeats):
            for reply, label, tools in configs:
                elapsed, deltas[reply, label] = run_once(engines[reply], tools, lengths[reply])
                seconds[reply, label].append(elapsed)
    finally:
        for eng in engines.values():
            eng.close()
    rows, results = [], []
    for reply, label, _ in configs:
        rates = [lengths[reply] / s for s in seconds[reply, label]]
        base = [lengths[reply] / s for s in seconds[reply, "no tools"]]
        ratio = summarize([r / b for r, b in zip(rates, base)])
        us_per_token = summarize([s / lengths[reply] * 1e6 for s in seconds[reply, label]])
        rows.append([reply, label, lengths[reply], deltas[reply, label], fmt_stats(summarize(rates), ".0f"),
                     fmt_stats(us_per_token, ".1f"), fmt_stats(ratio, ".2f")])
        results.append({"reply": reply, "config": label, "tokens": lengths[reply],
                        "tool_call_deltas": deltas[reply, label],
                        "tok_per_s": summarize(rates), "us_per_token": us_per_token, "ratio_vs_no_tools": ratio})
    parser_rows, parser_results = [], []
    for reply, text in replies().items():  # the parser alone, fed the reply's token texts
        pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]

        def parse(pieces=pieces):
            p = HermesParser()
            for piece in pieces:
                p.add(piece)
            p.finish()
        times = [s / len(pieces) * 1e6 for s in measure(parse, args.repeats)]
        parser_rows.append([reply, len(pieces), fmt_stats(summarize(times), ".2f")])
        parser_results.append({"reply": reply, "tokens": len(pieces), "us_per_token": summarize(times)})
    env = environment()
    print_table(["reply", "config", "tokens", "call deltas", "tok/s", "us/token", "vs no tools"], rows,
                title=f"Stream + SSE chunks, ScriptedModel (load average {env['load_average'][0]:.1f})")
    print_table(["reply", "tokens", "us/token"], parser_rows, title="HermesParser alone, per token")
    path = write_json("tools", {"environment": env, "repeats": args.repeats, "results": results,
                                "parser": parser_results})
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
