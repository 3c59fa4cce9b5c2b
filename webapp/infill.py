"""``POST /infill`` in llama.cpp's shape (llama.vim, llama.vscode): fill-in-the-middle with repo context.

    {"input_prefix", "input_suffix", "input_extra": [{"filename", "text"}], "prompt", "n_predict",
     "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream", "cache_prompt"}

``prompt`` is the text before the cursor on the current line (it goes after ``input_prefix``);
``input_extra`` becomes llama.cpp's repo-level context (engine/infill.py). The request runs as a
/v1/completions request with a suffix (webapp.generation: the engine's one infill path); only the
answer's shape is llama.cpp's: ``{"content", "tokens", "stop", "stop_type", "tokens_predicted",
"tokens_evaluated", ...}``, streamed as one such object per event (``stop: false``) and a last
one with ``stop: true``. Any other field is a 400 naming it (llama.cpp's time limits, indentation
stop and sampler chains are not implemented).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from engine.errors import InvalidParameterError
from engine.params import SamplingParams

from .errors import bad_request, from_exception
from .metrics import RequestRecord, ServerMetrics
from .protocol import ParsedRequest, check_text
from .request_fields import MAX_TOKENS_LIMIT

_TYPES = {"input_prefix": str, "input_suffix": str, "prompt": str, "input_extra": list, "stop": list,
          "stream": bool, "cache_prompt": bool, "n_predict": int, "seed": int, "top_k": int,
          "temperature": (int, float), "top_p": (int, float), "min_p": (int, float)}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")  # SamplingParams' names too
STOP_TYPES = {"stop": "eos", "length": "limit"}

log = logging.getLogger("webapp")


def _field(body: dict, name: str):
    value = body.get(name)
    if value is None:
        return None
    kind = _TYPES[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        kind_name = getattr(kind, "__name__", "number")
        raise bad_request(f"{name} must be of type {kind_name}, got {value!r:.60}", name)
    return value


def parse_infill(body: dict) -> ParsedRequest:
    for name in body:
        if name not in _TYPES and name != "model":
            raise bad_request(f"{name} is not a field of /infill this server supports", name)
    prefix = check_text(_field(body, "input_prefix") or "", "input_prefix")
    suffix = check_text(_field(body, "input_suffix") or "", "input_suffix")
    prompt = check_text(_field(body, "prompt") or "", "prompt")
    extra = _field(body, "input_extra") or []
    for i, item in enumerate(extra):
        if not isinstance(item, dict) or set(item) - {"filename", "text"}:
            raise bad_request(f"input_extra[{i}] must be an object with filename and text",
                              f"input_extra[{i}]")
    kwargs = {name: _field(body, name) for name in _SAMPLING if body.get(name) is not None}
    if kwargs.get("seed") == -1:
        del kwargs["seed"]  # llama.cpp's "random"
    if kwargs.get("top_k") is not None and kwargs["top_k"] < 0:
        kwargs["top_k"] = 0
    n_predict = _field(body, "n_predict")
    if n_predict is not None and not -1 <= n_predict <= MAX_TOKENS_LIMIT or n_predict == 0:
        raise bad_request(f"n_predict must be -1 (no limit) or a positive integer, got {n_predict}",
                          "n_predict")
    kwargs["max_tokens"] = None if n_predict in (None, -1) else n_predict
    stop = _field(body, "stop")
    if stop is not None:
        if not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be an array of strings", "stop")
        kwargs["stop"] = tuple(check_text(s, "stop") for s in stop)
    try:
        params = SamplingParams(**kwargs)
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None
    return ParsedRequest(False, params, prompts=[prefix], is_stream=bool(_field(body, "stream")),
                         suffix=suffix, extra_files=extra, cursor_text=prompt)


def infill_body(completion, num_prompt_tokens: int, model_name: str) -> dict:
    """llama.cpp's answer of a finished /infill request."""
    return {"index": 0, "content": completion.text, "tokens": list(completion.token_ids), "id_slot": 0,
            "stop": True, "model": model_name, "tokens_predicted": len(completion.token_ids),
            "tokens_evaluated": num_prompt_tokens,
            "stop_type": STOP_TYPES.get(completion.finish_reason, "none"),
            "stopping_word": "", "truncated": False, "has_new_line": "\n" in completion.text}


def event_chunk(event, num_predicted: int, num_prompt_tokens: int) -> bytes:
    """One streamed event as llama.cpp's SSE object (``stop`` true on the last)."""
    chunk = {"index": 0, "content": event.text, "tokens": list(event.token_ids), "id_slot": 0,
             "stop": event.finish_reason is not None, "tokens_predicted": num_predicted,
             "tokens_evaluated": num_prompt_tokens}
    if event.finish_reason is not None:
        chunk["stop_type"] = STOP_TYPES.get(event.finish_reason, "none")
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def stream_chunks(stream, record: RequestRecord, metrics: ServerMetrics, is_disconnected: Callable[[], bool],
                  num_prompt_tokens: int) -> Iterator[bytes]:
    """A streamed /infill request's bytes, one llama.cpp object per event (the WSGI front-end)."""
    status = "abort"
    try:
        for event in stream:
            parts = []
            for e in (event, *stream.ready_events()):
                record.event(e)
                parts.append(event_chunk(e, record.num_generated, num_prompt_tokens))
            yield b"".join(parts)
            if not record.finish_reasons and is_disconnected():
                return
        status = "ok"
    except Exception as exc:  # the engine failed mid-stream: an error object, as llama.cpp sends
        status = "error"
        log.exception("infill stream failed")
        yield b"data: " + from_exception(exc).body() + b"\n\n"
    finally:
        stream.close()
        record.queue_s = stream.queue_time
        metrics.finish(record, status)
