"""The OpenAI wire format: parse and validate requests, build (non-streamed) responses.

``parse_chat`` / ``parse_completion`` turn a request body into a ``ParsedRequest``
(messages or prompts, ``engine.SamplingParams``, stream flags) or raise ``APIError``
(400, naming the offending field in ``param``). Every field the server knows is declared
once in ``webapp.request_fields`` (its JSON Schema and its fate: a sampling parameter, read
here, ignored because it cannot change the answer, or accepted only with the values that
change nothing); unknown fields are ignored, as vLLM does.

The dict builders below are the plain-Python construction of every response object;
the streamed chunks from ``cext.chunk.ChunkWriter`` must ``json.loads`` to exactly
``chat_chunk()`` / ``text_chunk()`` of the same values (tests/test_chunk.py).
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from engine.errors import InvalidParameterError
from engine.params import CONSTRAINT_FIELDS as PARAMS_CONSTRAINT_FIELDS
from engine.params import SamplingParams
from engine.tokenizer import validate_messages
from engine.tools import validate_tool_choice, validate_tools

from .constraints import constraint
from .errors import APIError, bad_request
from .request_fields import (
    CHAT,
    COMPLETIONS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CONSTRAINT_FIELDS,
    FIELDS_BY_ENDPOINT,
    MAX_TOKENS_LIMIT,
    Fate,
    check,
)

MAX_PROMPTS = 256  # prompts in one batched /v1/completions request
MAX_CHOICES = 256  # prompts * n
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(slots=True)
class ParsedRequest:
    is_chat: bool
    params: SamplingParams
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one or more
    is_stream: bool = False
    include_usage: bool = False
    is_echo: bool = False
    add_special_tokens: bool = True
    is_prompt_logprobs_shown: bool = False  # the request asked for prompt_logprobs (echo may want them alone)
    tools: list[dict] | None = None  # chat: OpenAI tools, checked by the engine (engine/tools)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # chat: more template variables (the engine checks each key)
    constraint_param: str | None = None  # the client's structured-output field, named by a later compile error
    suffix: str | None = None  # fill-in-the-middle: each prompt is the prefix (engine.Engine.prepare_infill)
    extra_files: list[dict] | None = None  # with suffix: llama.cpp /infill's repo-level context
    cursor_text: str = ""  # /infill's prompt: the line before the cursor, tokenized after the prefix

    @property
    def prompt(self) -> str | list[int] | None:
        return self.prompts[0] if len(self.prompts) == 1 else None


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


def check_text(value: str, param: str) -> str:
    if _SURROGATES.search(value):
        raise bad_request(f"{param} contains a lone surrogate (not valid Unicode).", param)
    return value


def _messages(messages) -> list[dict]:
    """The engine's own message check (engine.tokenizer.validate_messages), as a 400."""
    try:
        return validate_messages(messages)
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompts(prompt) -> list[str | list[int]]:
    """A string, token ids, or a batch of either -> the list of prompts."""
    if isinstance(prompt, str):
        return [check_text(prompt, "prompt")]
    if _is_ids(prompt):
        if min(prompt) < 0:
            raise bad_request("prompt token ids must be >= 0", "prompt")
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
        for k, p in enumerate(prompt):
            if isinstance(p, str):
                check_text(p, f"prompt[{k}]")
            elif min(p) < 0:
                raise bad_request(f"prompt[{k}] token ids must be >= 0", f"prompt[{k}]")
        return list(prompt)
    raise bad_request("prompt is required: a non-empty string, an array of token ids, or an array of those",
                      "prompt")


_OWN_PARSERS = frozenset({"messages", "prompt"})  # checked by _messages / _prompts, naming the element


def _fields(body: dict, endpoint: str) -> dict:
    """The known, non-null fields of ``body``, each checked against its declaration."""
    fields = FIELDS_BY_ENDPOINT[endpoint]
    values = {}
    for name, value in body.items():
        f = fields.get(name)
        if f is None or f.fate is Fate.IGNORED or value is None or name in _OWN_PARSERS:
            continue
        values[name] = value if name in CONSTRAINT_FIELDS else check(value, f)  # webapp.constraints checks those
    return values


def sampling_params(values: dict, endpoint: str, found: tuple | None = None,
                    default_max_tokens: int | None = None) -> SamplingParams:
    """``found``: the request's structured-output constraint (webapp.constraints.constraint).
    ``default_max_tokens``: when the body has no max_tokens (None: the rest of the context)."""
    fields = FIELDS_BY_ENDPOINT[endpoint]
    kwargs = {}
    if found is not None:
        kwargs[found[1]] = found[2]
    for name, value in values.items():
        f = fields[name]
        if f.fate is Fate.SAMPLING:
            kwargs[f.target or name] = value
    if "max_completion_tokens" in values:
        kwargs["max_tokens"] = values["max_completion_tokens"]
    kwargs.setdefault("max_tokens", default_max_tokens)  # None: the rest of the context
    stop = values.get("stop")
    if stop is not None:
        kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in kwargs["stop"]:
            check_text(s, "stop")
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM spells "disabled" as -1
    if endpoint == COMPLETIONS and "logprobs" in values:  # legacy: an int, the number of alternatives
        kwargs["logprobs"] = True
    best_of = values.get("best_of")
    if best_of is not None and best_of != values.get("n", 1):
        raise bad_request(f"best_of must equal n (no reranking), got best_of={best_of}", "best_of")
    try:
        return SamplingParams(**kwargs)
    except InvalidParameterError as e:
        if found is not None and e.param in PARAMS_CONSTRAINT_FIELDS:
            raise bad_request(f"{found[0]}: {e}", found[0]) from None
        raise bad_request(str(e), e.param) from None


def _stream_flags(values: dict) -> tuple[bool, bool]:
    is_stream = values.get("stream", False)
    include_usage = (values.get("stream_options") or {}).get("include_usage") or False
    return is_stream, bool(is_stream and include_usage)


def _tools(values: dict) -> None:
    """The engine's own tools check (engine.tools.spec), as a 400 naming the field."""
    try:
        validate_tool_choice(values.get("tool_choice"), validate_tools(values.get("tools")))
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None


def parse_chat(body: dict) -> ParsedRequest:
    values = _fields(body, CHAT)
    messages = _messages(body.get("messages"))
    _tools(values)
    found = constraint(values)  # (client field, SamplingParams field, value) or None
    params = sampling_params(values, CHAT, found)
    is_stream, include_usage = _stream_flags(values)
    return ParsedRequest(True, params, messages=messages, is_stream=is_stream, include_usage=include_usage,
                         is_prompt_logprobs_shown=params.prompt_logprobs is not None,
                         constraint_param=found[0] if found else None, tools=values.get("tools"),
                         tool_choice=values.get("tool_choice"),
                         parallel_tool_calls=values.get("parallel_tool_calls", True),
                         chat_template_kwargs=values.get("chat_template_kwargs"))


def parse_completion(body: dict) -> ParsedRequest:
    values = _fields(body, COMPLETIONS)
    prompts = _prompts(body.get("prompt"))
    found = constraint(values)
    # OpenAI's legacy default: 16 tokens when max_tokens is absent; an explicit null: the rest of the context
    default_max_tokens = None if "max_tokens" in body else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = sampling_params(values, COMPLETIONS, found, default_max_tokens)
    if len(prompts) * params.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={params.n} choices exceeds {MAX_CHOICES}", "n")
    is_echo = values.get("echo", False)
    suffix = check_text(values["suffix"], "suffix") if values.get("suffix") else None  # "": no insertion
    if suffix is not None and is_echo:
        raise bad_request("echo cannot be combined with suffix (fill-in-the-middle)", "suffix")
    is_prompt_logprobs_shown = params.prompt_logprobs is not None
    if is_echo and params.logprobs and (params.prompt_logprobs is None or params.prompt_logprobs < params.top_logprobs):
        # echo with logprobs: the echoed prompt's tokens get theirs too (OpenAI legacy, vLLM)
        params = dataclasses.replace(params, prompt_logprobs=params.top_logprobs)
    is_stream, include_usage = _stream_flags(values)
    return ParsedRequest(False, params, prompts=prompts, is_stream=is_stream, include_usage=include_usage,
                         is_echo=is_echo, add_special_tokens=values.get("add_special_tokens", True),
                         is_prompt_logprobs_shown=is_prompt_logprobs_shown,
                         constraint_param=found[0] if found else None, suffix=suffix)


# ---- /tokenize and /detokenize (vLLM's shapes) ----

@dataclass(slots=True)
class TokenizeRequest:
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def parse_tokenize(body: dict) -> TokenizeRequest:
    """{"prompt", "add_special_tokens"=true} or {"messages", "add_generation_prompt"=true, "tools",
    "chat_template_kwargs"}."""
    return_token_strs = _flag(body, "return_token_strs", False)
    if body.get("messages") is not None:
        try:
            tools = validate_tools(body.get("tools"))
        except InvalidParameterError as e:
            raise bad_request(str(e), e.param) from None
        if _flag(body, "add_special_tokens", False):
            raise bad_request("add_special_tokens is not supported with messages: the template adds what it needs",
                              "add_special_tokens")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        return TokenizeRequest(messages=_messages(body["messages"]),
                               add_generation_prompt=_flag(body, "add_generation_prompt", True),
                               tools=tools or None, return_token_strs=return_token_strs,
                               chat_template_kwargs=kwargs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt (a string) or messages is required", "prompt")
    return TokenizeRequest(prompt=check_text(prompt, "prompt"),
                           add_special_tokens=_flag(body, "add_special_tokens", True),
                           return_token_strs=return_token_strs)


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise bad_request("tokens must be an array of token ids", "tokens")
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise bad_request(f"tokens must be token ids in [0, {vocab_size})", "tokens")
    return tokens


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


def _legacy_top(lp) -> dict:
    """{token: logprob} of the alternatives, and of the token itself (OpenAI: up to k + 1 entries)."""
    top = {clean_text(t): clamp_logprob(v) for _, t, _, v in lp.top}
    if all(tid != lp.token_id for tid, _, _, _ in lp.top):
        top[clean_text(lp.token)] = clamp_logprob(lp.logprob)
    return top


def text_logprobs(logprobs, text_offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [clean_text(lp.token) for lp in logprobs],
            "token_logprobs": [clamp_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [_legacy_top(lp) for lp in logprobs],
            "text_offset": offsets}


def echo_logprobs(first_token_text: str, prompt_logprobs, text_offset: int = 0) -> dict:
    """The legacy logprobs of an echoed prompt: its first token has none (null), the others the
    engine's prompt_logprobs (entry i: token i given the tokens before it)."""
    texts = [first_token_text] + [lp.token for lp in prompt_logprobs[1:]]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": [clean_text(t) for t in texts],
            "token_logprobs": [None] + [clamp_logprob(lp.logprob) for lp in prompt_logprobs[1:]],
            "top_logprobs": [None] + [_legacy_top(lp) for lp in prompt_logprobs[1:]],
            "text_offset": offsets}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_chunk(request_id, model, created, text, logprobs, finish_reason, is_first=False,
               include_usage=False, index=0, tool_calls=None, reasoning_content=None) -> dict:
    """``tool_calls``: the ToolCallDeltas of the event; ``reasoning_content``: its reasoning text
    (with either, an empty ``text`` is content null)."""
    delta = {"role": "assistant", "content": clean_text(text)} if is_first else {"content": clean_text(text)}
    if tool_calls is not None or reasoning_content is not None:
        delta["content"] = clean_text(text) if text else None
    if reasoning_content is not None:
        delta["reasoning_content"] = clean_text(reasoning_content)
    if tool_calls is not None:
        delta["tool_calls"] = tool_call_deltas(tool_calls)
    chunk = {"id": clean_text(request_id), "object": "chat.completion.chunk", "created": created,
             "model": clean_text(model),
             "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def tool_call_deltas(deltas) -> list[dict]:
    """OpenAI's ``delta.tool_calls``: [{index, id?, type?, function: {name?, arguments}}]."""
    return [d.to_dict() for d in deltas]


def chat_message(c) -> dict:
    """The ``message`` of a chat choice: content null when the reply is only tool calls;
    ``reasoning_content`` (vLLM's and llama.cpp's field) when the reply had a reasoning block."""
    tool_calls = getattr(c, "tool_calls", None)
    message = {"role": "assistant", "content": c.text or None if tool_calls else c.text}
    reasoning = getattr(c, "reasoning_content", None)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [call.to_dict() for call in tool_calls]
    return message


def text_chunk(request_id, model, created, text, logprobs, finish_reason, text_offset=0,
               include_usage=False, index=0) -> dict:
    chunk = {"id": clean_text(request_id), "object": "text_completion", "created": created,
             "model": clean_text(model),
             "choices": [{"index": index, "text": clean_text(text), "logprobs": text_logprobs(logprobs, text_offset),
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def prompt_logprobs_list(prompt_logprobs) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and its top alternatives (rank: 1-based among the alternatives; the
    prompt token's own rank in the vocabulary, lp.rank, when it is not among them)."""
    if prompt_logprobs is None:
        return None
    out = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": clamp_logprob(v), "rank": r, "decoded_token": clean_text(t)}
                 for r, (tid, t, _, v) in enumerate(lp.top, start=1)}
        if str(lp.token_id) not in entry:
            entry = {str(lp.token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                        "decoded_token": clean_text(lp.token)}, **entry}
        out.append(entry)
    return out


def num_prompt_tokens(completions, n: int) -> int:
    """Prompt tokens of a request counted once per prompt (choice i*n is prompt i's first)."""
    return sum(c.usage.prompt_tokens for c in completions[::n])


def chat_response(request_id, model, created, completions, n: int = 1, is_prompt_logprobs_shown=True) -> dict:
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": chat_message(c),
                         "logprobs": chat_logprobs(c.logprobs), "finish_reason": c.finish_reason}
                        for c in completions],
            "usage": usage_dict(num_prompt_tokens(completions, n),
                                sum(c.usage.completion_tokens for c in completions))}
    if completions[0].prompt_logprobs is not None and is_prompt_logprobs_shown:
        body["prompt_logprobs"] = prompt_logprobs_list(completions[0].prompt_logprobs)
    return body


def text_response(request_id, model, created, completions, n: int = 1, echo_texts=None, first_token_texts=None,
                  is_prompt_logprobs_shown=True) -> dict:
    """``echo_texts``: per choice, the prompt text to prepend (echo); with logprobs, the echoed
    tokens' logprobs come first (``first_token_texts``: per choice, its prompt's first token)."""
    choices = []
    for k, c in enumerate(completions):
        echo_text = "" if echo_texts is None else echo_texts[k]
        logprobs = text_logprobs(c.logprobs, len(echo_text))
        if logprobs is not None and echo_texts is not None:
            echoed = echo_logprobs(first_token_texts[k], c.prompt_logprobs)
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        choice = {"index": c.index, "text": echo_text + c.text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason}
        if c.prompt_logprobs is not None and is_prompt_logprobs_shown:
            choice["prompt_logprobs"] = prompt_logprobs_list(c.prompt_logprobs)
        choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage_dict(num_prompt_tokens(completions, n),
                                sum(c.usage.completion_tokens for c in completions))}


__all__ = ["APIError", "MAX_TOKENS_LIMIT", "ParsedRequest", "decode_body", "parse_chat", "parse_completion"]
