"""Per-request parse cost: the table-driven parser (webapp.protocol over webapp.request_fields)
against an equivalent pydantic v2 model (strict types, the same ranges), on the same bodies.

Both build the engine's SamplingParams at the end (the pydantic side from its validated
model), so the figures compare what a request pays before it reaches the engine. The
pydantic model here is written for this measurement only (pydantic ships with the openai
client in requirements-test.txt; the server does not depend on it).

Usage: ``python benchmarks/request_parse.py [--repeats 7] [--calls 2000]``; prints a table and
writes benchmarks/results/request_parse.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import environment, fmt_stats, measure, print_table, summarize, write_json  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from webapp import protocol  # noqa: E402

BODIES = {
    "minimal chat": {"model": "m", "messages": [{"role": "user", "content": "Hello there!"}]},
    "typical chat": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Say hello."}],
                     "temperature": 0.7, "top_p": 0.9, "max_tokens": 128, "stream": True,
                     "stream_options": {"include_usage": True}, "stop": ["\n\n"], "seed": 3},
    "all options": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7,
                    "max_tokens": 64, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                    "repetition_penalty": 1.1, "min_p": 0.05, "n": 2, "logprobs": True, "top_logprobs": 3,
                    "logit_bias": {str(i): 1.0 for i in range(20)}, "user": "u", "metadata": {"a": "b"}},
}


def pydantic_parser():
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    Number = StrictInt | StrictFloat

    class TextPart(BaseModel):
        type: Literal["text"]
        text: StrictStr

    class Message(BaseModel):
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: StrictStr | list[TextPart] | None = None

    class StreamOptions(BaseModel):
        include_usage: StrictBool | None = None

    class ChatRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: StrictStr | None = None
        messages: list[Message] = Field(min_length=1)
        max_tokens: StrictInt | None = Field(None, ge=1, le=(1 << 31) - 1)
        max_completion_tokens: StrictInt | None = Field(None, ge=1, le=(1 << 31) - 1)
        temperature: Number | None = Field(None, ge=0)
        top_p: Number | None = Field(None, gt=0, le=1)
        top_k: StrictInt | None = Field(None, ge=-1)
        min_p: Number | None = Field(None, ge=0, le=1)
        seed: StrictInt | None = None
        n: StrictInt | None = Field(None, ge=1, le=128)
        stop: StrictStr | list[StrictStr] | None = None
        stop_token_ids: list[StrictInt] | None = None
        presence_penalty: Number | None = Field(None, ge=-2, le=2)
        frequency_penalty: Number | None = Field(None, ge=-2, le=2)
        repetition_penalty: Number | None = Field(None, gt=0, le=100)
        logit_bias: dict[StrictStr, Number] | None = None
        logprobs: StrictBool | None = None
        top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
        stream: StrictBool | None = None
        stream_options: StreamOptions | None = None
        response_format: dict | None = None
        tools: list[dict] | None = None

    sampling_fields = ("temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "logit_bias", "top_logprobs")

    def parse(body: dict):
        req = ChatRequest.model_validate(body)
        kwargs = {name: getattr(req, name) for name in sampling_fields if getattr(req, name) is not None}
        kwargs["max_tokens"] = req.max_completion_tokens or req.max_tokens
        if req.stop is not None:
            kwargs["stop"] = req.stop
        kwargs["logprobs"] = bool(req.logprobs)
        return [m.model_dump() for m in req.messages], SamplingParams(**kwargs)

    return parse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    parsers = {"table (ours)": protocol.parse_chat, "pydantic v2": pydantic_parser()}
    results = {body: {name: [] for name in parsers} for body in BODIES}
    for _ in range(args.repeats):
        for body_name, body in BODIES.items():
            for name, parse in parsers.items():  # interleaved
                seconds = measure(lambda parse=parse, body=body: [parse(body) for _ in range(args.calls)], repeats=1)[0]
                results[body_name][name].append(seconds / args.calls * 1e6)
    rows, summary = [], {}
    for body_name in BODIES:
        ours = summarize(results[body_name]["table (ours)"])
        theirs = summarize(results[body_name]["pydantic v2"])
        summary[body_name] = {"table": ours, "pydantic": theirs}
        rows.append([body_name, fmt_stats(ours, ".1f"), fmt_stats(theirs, ".1f"),
                     f"{theirs['median'] / ours['median']:.2f}x"])
    print_table(["body", "table us/request", "pydantic us/request", "pydantic / table"], rows,
                title=f"parse_chat cost per request, median (min-max) over {args.repeats} repeats of {args.calls}")
    env = environment()
    print("load average:", env["load_average"])
    print("wrote", write_json("request_parse", {"args": vars(args), "environment": env, "results": summary}))


if __name__ == "__main__":
    main()
