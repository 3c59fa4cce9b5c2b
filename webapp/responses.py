"""``POST /v1/responses`` (OpenAI's Responses API) as a chat request of the one chat pipeline.

``parse_responses(body, store)`` turns a Responses body into a ``ResponsesRequest`` whose
``chat`` is the ParsedRequest the chat route would build: the same ``engine.stream_chat`` prompt
path (template, tools, structured output) and the same fold (``CompletionFold``) run it; only
the wire shapes differ (webapp.response_objects builds the Response object and its events).

    input (a string or items)  -> chat messages: message items (text parts) as messages,
                                  function_call items as the assistant's tool_calls,
                                  function_call_output items as tool messages, reasoning items
                                  as the next assistant turn's reasoning_content
    instructions               -> a system message first (not carried by previous_response_id)
    previous_response_id       -> the stored conversation (webapp.response_store) before input
    tools / tool_choice        -> chat's function tools and tool_choice
    text.format                -> response_format (json_object, json_schema): structured output
    max_output_tokens, temperature, top_p -> SamplingParams

Every field is declared in webapp.request_fields (``RESPONSES_FIELDS``); a field the table does
not know, an input item of another type, a non-function tool or a non-text content part is a
400 naming it (``input[2].call_id``, ``tools[0].type``, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import InvalidParameterError
from engine.tokenizer import validate_messages
from engine.tools import validate_tool_choice, validate_tools

from . import generation
from .constraints import constraint
from .errors import APIError, bad_request
from .protocol import ParsedRequest, check_text, sampling_params
from .request_fields import FIELDS_BY_ENDPOINT, RESPONSES, Fate, check
from .response_store import ResponseStore

RESPONSE_ID_PREFIX = "resp_"
MAX_INPUT_ITEMS = 4096
TEXT_PARTS = frozenset({"input_text", "output_text"})
ITEM_KEYS = {  # the keys each input item may carry (ids and statuses of output items sent back are fine)
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "status"}),
}
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
ROLES = ("user", "system", "developer", "assistant")
TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# Param names of the chat pipeline's errors -> the Responses request's own names.
_RENAMES = ((re.compile(r"^messages(\[\d+\])?"), "input"), (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^(tools\[\d+\])\.function"), r"\1"), (re.compile(r"^tool_choice\.function"),
                                                                  "tool_choice"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"))


@dataclass(slots=True)
class ResponsesRequest:
    chat: ParsedRequest  # what the engine runs (webapp.generation.submit: engine.stream_chat)
    conversation: list[dict]  # the chat messages without instructions: stored with the reply
    previous_response_id: str | None
    is_store: bool
    settings: dict  # the request's settings as the Response object repeats them


def rename_param(param: str | None) -> str | None:
    """A chat pipeline's error param in the Responses request's terms (``messages`` -> ``input``)."""
    for pattern, replacement in _RENAMES if param else ():
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


def renamed(err: APIError) -> APIError:
    param = rename_param(err.param)
    if param == err.param:
        return err
    return APIError(err.status, err.message, err.type, param, err.code, err.headers)


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's 404 for an id that is not (or no longer) stored."""
    if param is not None:
        return APIError(404, f"Previous response with id '{response_id}' not found.", param=param,
                        code="previous_response_not_found")
    return APIError(404, f"No response found with id '{response_id}'.", code="not_found")


def check_no_query(args) -> None:
    """GET /v1/responses/{id} takes no options (stream, include, starting_after): a 400 naming one."""
    for name in args:
        raise bad_request(f"{name} is not supported when retrieving a response", name)


def deleted_body(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "deleted": True}


def submit(engine, req: ResponsesRequest):
    """The chat route's submission (engine.stream_chat), errors named as the Responses request names them."""
    try:
        return generation.submit(engine, req.chat)
    except APIError as err:
        raise renamed(err) from None


def _values(body: dict) -> dict:
    """The non-null fields of ``body``, each checked against its declaration; an unknown one is a 400."""
    fields = FIELDS_BY_ENDPOINT[RESPONSES]
    values = {}
    for name, value in body.items():
        f = fields.get(name)
        if f is None:
            raise bad_request(f"{name} is not a field of /v1/responses this server supports", name)
        if value is None or f.fate is Fate.IGNORED:
            continue
        values[name] = check(value, f)
    return values


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string, got {type(value).__name__}", where)
    return check_text(value, where)


def _parts(content, where: str) -> str | list[dict]:
    """A message's content: a string, or text parts (input_text, output_text) as chat's text parts."""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{at} must be an object like {{\"type\": \"input_text\", \"text\": ...}}", at)
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise bad_request(f"{at}.type: {kind!r:.40} content is not supported (text only: input_text, "
                              "output_text)", f"{at}.type")
        for key, value in part.items():
            if key not in PART_KEYS and value is not None:
                raise bad_request(f"{at}.{key} is not supported in a text part", f"{at}.{key}")
        parts.append({"type": "text", "text": _text(part.get("text"), f"{at}.text")})
    return parts


def _check_keys(item: dict, kind: str, where: str) -> None:
    """A key set to null counts as absent (as for the request's own fields)."""
    for key, value in item.items():
        if key not in ITEM_KEYS[kind] and value is not None:
            raise bad_request(f"{where}.{key} is not supported in a {kind} item", f"{where}.{key}")


def input_messages(value, known_call_ids: set[str]) -> list[dict]:
    """``input`` -> chat messages. ``known_call_ids``: the calls of the conversation so far (grows
    with the function_call items read here); a function_call_output must answer one of them."""
    if isinstance(value, str):
        return [{"role": "user", "content": check_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise bad_request("input is required: a string or a non-empty array of items", "input")
    if len(value) > MAX_INPUT_ITEMS:
        raise bad_request(f"input holds {len(value)} items; at most {MAX_INPUT_ITEMS} are allowed", "input")
    messages: list[dict] = []
    pending: tuple[int, str] | None = None  # a reasoning item's index and text, for the next assistant turn
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item), got {type(item).__name__}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_KEYS:
            raise bad_request(f"{where}.type: {kind!r:.40} is not a supported input item (message, "
                              "function_call, function_call_output, reasoning)", f"{where}.type")
        _check_keys(item, kind, where)
        if pending is not None and not _is_assistant_turn(item, kind):
            raise bad_request(f"input[{pending[0]}]: a reasoning item must come right before the assistant "
                              "message or function_call it belongs to", f"input[{pending[0]}]")
        if kind == "reasoning":
            pending = (i, _reasoning_text(item, where))
            continue
        if pending is not None:  # this item opens the assistant turn the reasoning belongs to
            messages.append({"role": "assistant", "content": None, "reasoning_content": pending[1]})
            pending = None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r:.40}",
                                  f"{where}.role")
            content = _parts(item.get("content"), f"{where}.content")
            if role == "assistant" and messages and messages[-1].get("reasoning_content") is not None \
                    and messages[-1]["content"] is None and "tool_calls" not in messages[-1]:
                messages[-1]["content"] = content  # the turn its reasoning item opened
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id = _text(item.get("call_id"), f"{where}.call_id")
            call = {"id": call_id, "type": "function", "function": {
                "name": _text(item.get("name"), f"{where}.name"),
                "arguments": _text(item.get("arguments"), f"{where}.arguments")}}
            known_call_ids.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            call_id = _text(item.get("call_id"), f"{where}.call_id")
            if call_id not in known_call_ids:
                raise bad_request(f"{where}.call_id: no function_call with call_id {call_id!r:.60} comes "
                                  "before this output", f"{where}.call_id")
            output = item.get("output")
            content = _parts(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    if pending is not None:
        raise bad_request(f"input[{pending[0]}]: a reasoning item must come right before the assistant "
                          "message or function_call it belongs to", f"input[{pending[0]}]")
    return messages


def _is_assistant_turn(item: dict, kind: str) -> bool:
    return kind == "function_call" or (kind == "message" and item.get("role") == "assistant")


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text parts joined (summary parts are not model text)."""
    if item.get("summary"):
        raise bad_request(f"{where}.summary: reasoning summaries are not supported (send the reasoning_text "
                          "content this server wrote)", f"{where}.summary")
    content = item.get("content") or []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be an array of reasoning_text parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise bad_request(f"{at} must be a reasoning_text part", at)
        texts.append(_text(part.get("text"), f"{at}.text"))
    return "".join(texts)


def call_ids(messages) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or ()}


def chat_tools(tools) -> list[dict] | None:
    """Responses' function tools ({type, name, description, parameters, strict}) -> chat's."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"{where}.type: {kind!r:.40} tools are not supported (function tools only)",
                              f"{where}.type")
        for key, value in tool.items():
            if key not in TOOL_KEYS and value is not None:
                raise bad_request(f"{where}.{key} is not supported in a function tool", f"{where}.{key}")
        function = {k: v for k, v in tool.items() if k in TOOL_KEYS and k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    """"none" | "auto" | "required" | {type: function, name} -> chat's tool_choice."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise bad_request(f"tool_choice.type: {choice.get('type')!r:.40} is not supported (function only)",
                          "tool_choice.type")
    for key in choice:
        if key not in ("type", "name"):
            raise bad_request(f"tool_choice.{key} is not supported", f"tool_choice.{key}")
    return {"type": "function", "function": {"name": choice.get("name")}}


def text_constraint(text: dict | None) -> tuple[str, str, object] | None:
    """``text.format`` -> (client field, SamplingParams field, value) through webapp.constraints."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        response_format = {"type": "json_object"}
    else:
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        response_format = {"type": "json_schema", "json_schema": spec}
    try:
        found = constraint({"response_format": response_format})
    except APIError as err:
        raise renamed(err) from None
    return None if found is None else ("text.format", found[1], found[2])


def parse_responses(body: dict, store: ResponseStore) -> ResponsesRequest:
    values = _values(body)
    previous_id = values.get("previous_response_id")
    history: list[dict] = []
    if previous_id is not None:
        entry = store.get(previous_id)
        if entry is None:
            raise response_not_found(previous_id, "previous_response_id")
        history = list(entry.messages)
    if "input" not in values:
        raise bad_request("input is required: a string or a non-empty array of items", "input")
    conversation = history + input_messages(values["input"], call_ids(history))
    instructions = values.get("instructions")
    messages = [{"role": "system", "content": instructions}, *conversation] if instructions else conversation
    try:
        messages = validate_messages(messages)
    except InvalidParameterError as e:
        raise bad_request(str(e), rename_param(e.param)) from None
    tools = chat_tools(values.get("tools"))
    tool_choice = chat_tool_choice(values.get("tool_choice"))
    try:
        validate_tool_choice(tool_choice, validate_tools(tools))
    except InvalidParameterError as e:
        raise bad_request(str(e), rename_param(e.param)) from None
    found = text_constraint(values.get("text"))
    try:
        params = sampling_params(values, RESPONSES, found)
    except APIError as err:
        raise renamed(err) from None
    chat = ParsedRequest(True, params, messages=messages, is_stream=values.get("stream", False), tools=tools,
                         tool_choice=tool_choice, parallel_tool_calls=values.get("parallel_tool_calls", True),
                         constraint_param=found[0] if found else None)
    fmt = (values.get("text") or {}).get("format") or {"type": "text"}
    settings = {
        "instructions": instructions, "max_output_tokens": values.get("max_output_tokens"),
        "metadata": values.get("metadata") or {}, "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": previous_id, "store": values.get("store", True),
        "temperature": params.temperature, "top_p": params.top_p, "text": {"format": fmt},
        "tool_choice": values.get("tool_choice", "auto"), "tools": values.get("tools") or [],
    }
    return ResponsesRequest(chat, conversation, previous_id, settings["store"], settings)
