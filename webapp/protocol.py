"""The OpenAI wire format: parse and validate requests, build (non-streamed) responses.

``parse_chat`` / ``parse_completion`` turn a request body into a ``ParsedRequest``
(messages or prompt, ``engine.SamplingParams``, stream flags) or raise ``APIError``
(400, naming the offending field in ``param``). Unknown optional fields are ignored, as
OpenAI does; fields that would change the answer and that we do not implement (n > 1,
best_of > 1, echo, batched prompts) are rejected with a clear message instead.

The dict builders below are the plain-Python construction of every response object;
the streamed chunks from ``cext.chunk.ChunkWriter`` must ``json.loads`` to exactly
``chat_chunk()`` / ``text_chunk()`` of the same values (tests/test_chunk.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.errors import InvalidParameterError
from engine.params import SamplingParams

from .errors import APIError, bad_request

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_TOKENS_LIMIT = 1 << 31  # beyond this a request is malformed, not merely too long
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(slots=True)
class ParsedRequest:
    is_chat: bool
    params: SamplingParams
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completions
    is_stream: bool = False
    include_usage: bool = False


def decode_body(raw: bytes) -> dict:
    """Bytes of a request body -> the JSON object, or APIError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(value: str, param: str) -> str:
    if _SURROGATES.search(value):
        raise bad_request(f"{param} contains a lone surrogate (not valid Unicode).", param)
    return value


def _get(body: dict, name: str, types: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        names = " or ".join("integer" if t is int else "number" if t is float else
                            {str: "string", bool: "boolean", list: "array", dict: "object"}[t] for t in types)
        raise bad_request(f"{name} must be {'an' if names[0] in 'aeiou' else 'a'} {names}, got {value!r}", name)
    return value


def _content_text(content, param: str) -> str:
    if isinstance(content, str):
        return _check_text(content, param)
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}[{k}] must be a text part {{'type': 'text', 'text': ...}}; "
                                  "only text content is supported", f"{param}[{k}]")
            parts.append(_check_text(part["text"], f"{param}[{k}].text"))
        return "".join(parts)
    raise bad_request(f"{param} must be a string or a list of text parts, got {type(content).__name__}", param)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("messages is required and must be an array of {role, content} objects", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                              f"messages[{i}].role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": _content_text(content, f"messages[{i}].content")})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _check_text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad_request("prompt token ids must be >= 0", "prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt must be one string or one token list; batched prompts are not supported",
                          "prompt")
    raise bad_request("prompt is required: a non-empty string or array of token ids", "prompt")


def _sampling(body: dict, num_top_logprobs: int, is_logprobs: bool) -> SamplingParams:
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {n}", "n")
    best_of = _get(body, "best_of", (int,), 1)
    if best_of != 1:
        raise bad_request(f"best_of must be 1, got {best_of}", "best_of")
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    if max_tokens is not None and not (1 <= max_tokens < MAX_TOKENS_LIMIT):
        raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens}", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (_check_text(stop, "stop"),)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(_check_text(s, "stop") for s in stop)
    else:
        raise bad_request(f"stop must be a string or an array of strings, got {stop!r}", "stop")
    top_k = _get(body, "top_k", (int,), 0)
    kwargs = dict(
        max_tokens=max_tokens,  # None: the rest of the context
        temperature=_get(body, "temperature", (int, float), 1.0),
        top_p=_get(body, "top_p", (int, float), 1.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
        seed=_get(body, "seed", (int,)),
        stop=stop,
        stop_token_ids=_get(body, "stop_token_ids", (list,), []),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        logprobs=is_logprobs,
        top_logprobs=num_top_logprobs,
        skip_special_tokens=_get(body, "skip_special_tokens", (bool,), True),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
        min_tokens=_get(body, "min_tokens", (int,), 0),
    )
    try:
        return SamplingParams(**kwargs)
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    is_stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False)
    return is_stream, bool(is_stream and include_usage)


def parse_chat(body: dict) -> ParsedRequest:
    _get(body, "model", (str,))
    messages = _messages(body)
    is_logprobs = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), 0)
    params = _sampling(body, top, is_logprobs)
    is_stream, include_usage = _stream_flags(body)
    return ParsedRequest(True, params, messages=messages, is_stream=is_stream, include_usage=include_usage)


def parse_completion(body: dict) -> ParsedRequest:
    _get(body, "model", (str,))
    prompt = _prompt(body)
    if _get(body, "echo", (bool,), False):
        raise bad_request("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    num_logprobs = _get(body, "logprobs", (int,))  # legacy: an int, the number of top alternatives
    params = _sampling(body, num_logprobs or 0, num_logprobs is not None)
    is_stream, include_usage = _stream_flags(body)
    return ParsedRequest(False, params, prompt=prompt, is_stream=is_stream, include_usage=include_usage)


# ---- response builders (plain Python; the reference for cext.chunk) ----

def clean_text(text: str) -> str:
    """What the serializer writes for a str: lone surrogates become U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def clamp_logprob(value: float) -> float:
    if not value >= -9999.0:  # NaN, -inf
        return -9999.0
    return 0.0 if value == float("inf") else value


def chat_logprobs(logprobs) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [
        {"token": clean_text(lp.token), "logprob": clamp_logprob(lp.logprob), "bytes": list(lp.bytes),
         "top_logprobs": [{"token": clean_text(t), "logprob": clamp_logprob(v), "bytes": list(b)}
                          for _, t, b, v in lp.top]}
        for lp in logprobs]}


def text_logprobs(logprobs, text_offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [clean_text(lp.token) for lp in logprobs],
            "token_logprobs": [clamp_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{clean_text(t): clamp_logprob(v) for _, t, _, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_chunk(request_id, model, created, text, logprobs, finish_reason, is_first=False,
               include_usage=False, index=0) -> dict:
    delta = {"role": "assistant", "content": clean_text(text)} if is_first else {"content": clean_text(text)}
    chunk = {"id": clean_text(request_id), "object": "chat.completion.chunk", "created": created,
             "model": clean_text(model),
             "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def text_chunk(request_id, model, created, text, logprobs, finish_reason, text_offset=0,
               include_usage=False, index=0) -> dict:
    chunk = {"id": clean_text(request_id), "object": "text_completion", "created": created,
             "model": clean_text(model),
             "choices": [{"index": index, "text": clean_text(text), "logprobs": text_logprobs(logprobs, text_offset),
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_response(request_id, model, created, completion) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "logprobs": chat_logprobs(completion.logprobs),
                         "finish_reason": completion.finish_reason}],
            "usage": usage_dict(completion.usage.prompt_tokens, completion.usage.completion_tokens)}


def text_response(request_id, model, created, completion) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": completion.text, "logprobs": text_logprobs(completion.logprobs),
                         "finish_reason": completion.finish_reason}],
            "usage": usage_dict(completion.usage.prompt_tokens, completion.usage.completion_tokens)}


__all__ = ["APIError", "ParsedRequest", "decode_body", "parse_chat", "parse_completion"]
