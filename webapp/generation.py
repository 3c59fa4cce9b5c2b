"""One generation request, with no web framework: the pieces both front-ends call.

The single-process server (webapp/app.py: Flask on waitress, webapp/wsgi.py) and the Ray Serve
ingress (webapp/ray_ingress.py: Starlette behind Ray's proxy) differ only in how bytes reach the
socket. Authentication, admission (429), submission, response ids, echo and the
non-streamed bodies are these functions; the request parsing is webapp.protocol, the
streamed chunks webapp.sse, the errors webapp.errors, the metrics webapp.metrics.
"""
from __future__ import annotations

import hmac
import threading

from engine.errors import InvalidParameterError
from engine.params import CONSTRAINT_FIELDS

from . import errors, protocol


class Admission:
    """At most ``max_concurrent`` generation requests in flight; one more is refused with 429 at once."""

    def __init__(self, max_concurrent: int):
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent_requests must be a positive integer, got {max_concurrent!r}")
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def enter(self) -> None:
        """Take a slot or raise the 429 APIError (with Retry-After)."""
        if not self._slots.acquire(blocking=False):
            raise errors.overloaded("too many concurrent requests")

    def leave(self) -> None:
        self._slots.release()


def expected_authorization(api_key: str | None) -> bytes | None:
    return f"Bearer {api_key}".encode() if api_key else None


KEYED_PATHS = frozenset({"/infill"})  # generation routes outside /v1/ that need the key as well


def check_api_key(expected: bytes | None, path: str, method: str, authorization: str | None) -> None:
    """/v1/* and /infill need ``Authorization: Bearer <key>`` when a key is set (preflights excepted):
    else 401."""
    if expected is None or not (path.startswith("/v1/") or path in KEYED_PATHS) or method == "OPTIONS":
        return
    if not hmac.compare_digest((authorization or "").encode(), expected):
        raise errors.unauthorized()


def models_body(model_name: str, max_model_len: int | None) -> dict:
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "llm-engine"}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def _api_error(req: protocol.ParsedRequest, exc: Exception) -> errors.APIError:
    """An engine error as the client's error: a schema or grammar that did not compile names the
    client's own field (response_format, guided_json, ...), not SamplingParams'."""
    if isinstance(exc, InvalidParameterError) and req.constraint_param and exc.param in CONSTRAINT_FIELDS:
        return errors.bad_request(f"{req.constraint_param}: {exc}", req.constraint_param)
    return errors.from_exception(exc)


def submit(engine, req: protocol.ParsedRequest):
    """Template and tokenize on the calling thread (the engine's own prompt path), then submit.
    Engine errors (context length, a bad parameter, overload) come out as APIErrors."""
    return _submit(engine, req, engine.stream_chat, engine.submit_batch)


def asubmit(engine, req: protocol.ParsedRequest):
    """``submit`` for an event loop: an AsyncRequestStream (the events wake the loop, no thread held)."""
    return _submit(engine, req, engine.astream_chat, engine.asubmit_batch)


def _prompts(engine, req: protocol.ParsedRequest) -> tuple[list, object]:
    """(prompts, params) to submit: with a suffix, each prompt is a prefix framed by the model's FIM
    tokens (the engine's one infill path, Engine.prepare_infill)."""
    if req.suffix is None:
        return req.prompts, req.params
    prompts, params = [], req.params
    for prompt in req.prompts:
        if req.cursor_text:  # tokenized apart from the prefix, as llama.cpp's /infill does
            pieces = engine.tokenizer.encode_batch([prompt, req.cursor_text], add_special_tokens=False)
            prompt = pieces[0] + pieces[1]
        ids, params = engine.prepare_infill(prompt, req.suffix, req.params, req.extra_files)
        prompts.append(ids)
    return prompts, params


def _submit(engine, req: protocol.ParsedRequest, stream_chat, submit_batch):
    """The core of both twins: ``stream_chat`` / ``submit_batch`` are the engine's sync or async ones."""
    try:
        if req.is_chat:
            return stream_chat(req.messages, req.params, tools=req.tools, tool_choice=req.tool_choice,
                               parallel_tool_calls=req.parallel_tool_calls,
                               chat_template_kwargs=req.chat_template_kwargs)
        prompts, params = _prompts(engine, req)
        return submit_batch(prompts, params, add_special_tokens=req.add_special_tokens)
    except Exception as exc:
        raise _api_error(req, exc) from None


def num_prompt_tokens(stream, n: int) -> int:
    """Prompt tokens of a submitted request, counted once per prompt (choice i*n is prompt i's first)."""
    return sum(len(stream.choice_prompt_token_ids(i)) for i in range(0, stream.num_choices, n))


def response_id(req: protocol.ParsedRequest, engine_request_id: str) -> str:
    return ("chatcmpl-" if req.is_chat else "cmpl-") + engine_request_id


def echo_texts(tokenizer, req: protocol.ParsedRequest) -> list[str] | None:
    """Per choice, its prompt as text (completions' echo)."""
    if not req.is_echo:
        return None
    texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in req.prompts]
    return [text for text in texts for _ in range(req.params.n)]


def response_body(req: protocol.ParsedRequest, request_id: str, model_name: str, created: int, completions,
                  echo: list[str] | None, tokenizer=None) -> dict:
    """The non-streamed response of a finished request (its Completions, from the engine's one fold).
    ``tokenizer`` renders each echoed prompt's first token (echo with logprobs); without one it is
    the echoed text before the other prompt tokens' texts."""
    if req.is_chat:
        return protocol.chat_response(request_id, model_name, created, completions, req.params.n,
                                      req.is_prompt_logprobs_shown)
    first_texts = None
    if echo is not None and req.params.logprobs:
        first_texts = [tokenizer.decode(c.prompt_token_ids[:1], skip_special_tokens=False) if tokenizer is not None
                       else text[: len(text) - len("".join(lp.token for lp in c.prompt_logprobs[1:]))]
                       for c, text in zip(completions, echo)]
    return protocol.text_response(request_id, model_name, created, completions, req.params.n, echo, first_texts,
                                  req.is_prompt_logprobs_shown)


def tokenize_body(tokenizer, body: dict, max_model_len: int | None) -> dict:
    """POST /tokenize (vLLM's shape): a prompt or chat messages -> their token ids."""
    req = protocol.parse_tokenize(body)
    try:
        if req.messages is not None:
            ids = tokenizer.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                        chat_template_kwargs=req.chat_template_kwargs)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    except Exception as exc:
        raise errors.from_exception(exc) from None
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(tokenizer, body: dict) -> dict:
    ids = protocol.parse_detokenize(body, tokenizer.vocab_size)
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
