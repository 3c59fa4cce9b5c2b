"""Chat templates: OpenAI-style messages -> prompt text, rendered in a jinja2 sandbox.

`validate_messages` is the one message check of the engine and the HTTP server: roles system,
developer, user, assistant, tool; content a string or a list of text parts (joined with "\n",
as vLLM does); an assistant message may have no content and OpenAI's `tool_calls` (their
`arguments` JSON text parsed into the object templates expect, as transformers' server does)
and a `reasoning_content` string (Qwen3's template renders it in a tool-call loop); a tool
message needs its `tool_call_id`; keys set to None are dropped (as transformers does);
other keys pass through to the template; lone surrogates are rejected. Role `developer`
(OpenAI's newer name for the system role) is rendered as `system`
by a template that does not mention it, as vLLM's and llama.cpp's servers do; a template that
handles "developer" itself (gpt-oss) gets it unchanged.

A template embedded in a model file is untrusted input, so it runs in jinja2's
`ImmutableSandboxedEnvironment` (no attribute access to internals, no mutation of the
arguments). The environment matches what Hugging Face templates expect (transformers'
`chat_template_utils`): trim_blocks + lstrip_blocks, loop controls, a `tojson` filter that
keeps non-ASCII text, `raise_exception(message)`, `strftime_now(format)` and a no-op
`{% generation %}` block.

Every failure is a ChatTemplateError, an engine.errors.InvalidParameterError whose `param`
names the field ("messages[1].content", "tools", or "messages" when the template fails).
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidParameterError

__all__ = ["ChatTemplateError", "KNOWN_ROLES", "check_chat_template", "check_template_kwargs",
           "render_chat_template", "validate_messages"]

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
_SURROGATE = re.compile("[\ud800-\udfff]")
_MENTIONS_DEVELOPER = re.compile(r"""["']developer["']""")


class ChatTemplateError(InvalidParameterError):
    """The messages are invalid, or the chat template is missing, broken, or raised.

    ``param`` names the field: "messages[1].role", "messages[0].content[2].text", "tools", or
    "messages" for the conversation as a whole (a template that rejects it or fails)."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param)


class _TemplateRaised(Exception):
    """raise_exception() called from inside a template."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we just render it."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template is not valid jinja2 (line {e.lineno}: {e.message})") from None


def check_chat_template(template: str) -> None:
    """ChatTemplateError unless `template` compiles (its syntax; what it renders is per request)."""
    try:
        _compile(template)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template cannot be compiled ({type(e).__name__}: {e})") from None


def _check_text(text: str, where: str) -> str:
    if _SURROGATE.search(text):
        raise ChatTemplateError(f"{where} contains a lone surrogate (not valid Unicode)", where)
    return text


def _content_text(content, where: str) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text": str} parts
    joined with "\n"."""
    if isinstance(content, str):
        return _check_text(content, where)
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}", where
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{at} must be an object, got {type(part).__name__}", at)
        if part.get("type") != "text":
            raise ChatTemplateError(
                f"{at}.type must be 'text', got {part.get('type')!r}; only text content is supported", at
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{at}.text must be a string, got {type(text).__name__}", f"{at}.text")
        texts.append(_check_text(text, f"{at}.text"))
    return "\n".join(texts)


def validate_messages(messages) -> list[dict]:
    """Check OpenAI-style chat messages; return copies whose content is a plain string.

    Raises ChatTemplateError (an InvalidParameterError) whose ``param`` names the offending
    field, e.g. "messages[1].role". Validating the result again returns equal messages.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object, got {type(message).__name__}", where)
        role = message.get("role")
        if role not in KNOWN_ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(KNOWN_ROLES)}; got {role!r}",
                                    f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":  # a reply that only calls tools
            content = ""
        elif content is None:
            raise ChatTemplateError(f"{where}.content is missing", f"{where}.content")
        # Keys set to None are dropped, as transformers does (templates test `is defined`).
        out = {k: v for k, v in message.items() if v is not None}
        out["content"] = _content_text(content, f"{where}.content")
        if "tool_calls" in out:
            if role != "assistant":
                raise ChatTemplateError(f"{where}.tool_calls is only allowed in assistant messages",
                                        f"{where}.tool_calls")
            out["tool_calls"] = _tool_calls(out["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and not isinstance(out.get("tool_call_id"), str):
            raise ChatTemplateError(f"{where}.tool_call_id (the id of the call this answers) must be a string",
                                    f"{where}.tool_call_id")
        reasoning = out.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            raise ChatTemplateError(f"{where}.reasoning_content must be a string, in an assistant message",
                                    f"{where}.reasoning_content")
        if reasoning is not None:
            _check_text(reasoning, f"{where}.reasoning_content")
        name = out.get("name")
        if name is not None and not isinstance(name, str):
            raise ChatTemplateError(f"{where}.name must be a string", f"{where}.name")
        checked.append(out)
    return checked


def _tool_calls(tool_calls, where: str) -> list[dict]:
    """An assistant's calls, OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}].

    ``arguments`` may be JSON text (OpenAI) or an object; text is parsed into the object the
    templates iterate and serialize (what transformers' server does before rendering)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise ChatTemplateError(f"{where} must be a list of tool calls, got {type(tool_calls).__name__}", where)
    out = []
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ChatTemplateError(f"{at} must be an object, got {type(call).__name__}", at)
        if call.get("type", "function") != "function":
            raise ChatTemplateError(f"{at}.type must be 'function', got {call.get('type')!r:.80}", f"{at}.type")
        if "id" in call and not isinstance(call["id"], str):
            raise ChatTemplateError(f"{at}.id must be a string", f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatTemplateError(f"{at}.function must be an object with name and arguments", f"{at}.function")
        if not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{at}.function.name must be a string", f"{at}.function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ChatTemplateError(f"{at}.function.arguments is not valid JSON: {arguments!r:.80}",
                                        f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise ChatTemplateError(f"{at}.function.arguments must be a JSON object (or its JSON text)",
                                    f"{at}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


# Variables the renderer sets itself: a request names them with their own fields (messages, tools, ...).
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                 "eos_token", "raise_exception", "strftime_now"})


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads that it does not set itself."""
    env = _compile(template).environment
    return frozenset(meta.find_undeclared_variables(env.parse(template)))


def check_template_kwargs(template: str | None, kwargs) -> dict:
    """``chat_template_kwargs`` checked: an object of variables the template reads, none of them one
    the renderer sets (messages, tools, ...). Nothing is passed that the template would ignore, so a
    key it does not read is an error naming it. Returns the dict ({} for None)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}",
                                "chat_template_kwargs")
    if not kwargs:
        return kwargs
    if not template:
        raise ChatTemplateError("this model has no chat template to pass chat_template_kwargs to",
                                "chat_template_kwargs")
    known = _template_variables(template)
    for key in kwargs:
        where = f"chat_template_kwargs.{key}"
        if not isinstance(key, str):
            raise ChatTemplateError(f"chat_template_kwargs keys must be strings, got {key!r:.80}",
                                    "chat_template_kwargs")
        if key in _RESERVED_VARIABLES:
            raise ChatTemplateError(f"{where} is set by the request itself (its own field), not by "
                                    "chat_template_kwargs", where)
        if key not in known:
            names = ", ".join(sorted(known - _RESERVED_VARIABLES)) or "none"
            raise ChatTemplateError(f"{where}: this model's chat template has no variable {key!r:.80} "
                                    f"(it reads: {names})", where)
    return kwargs


@lru_cache(maxsize=16)
def _knows_developer_role(template: str) -> bool:
    return _MENTIONS_DEVELOPER.search(template) is not None


def render_chat_template(
    template: str | None,
    messages,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs,
) -> str:
    """Render `messages` with `template` in the sandbox. All errors are ChatTemplateError.

    Extra keyword arguments reach the template as variables; `tools` and `documents` default
    to None, as transformers passes them."""
    if not template:
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
    checked = validate_messages(messages)
    compiled = _compile(template)
    if not _knows_developer_role(template):
        checked = [{**m, "role": "system"} if m["role"] == "developer" else m for m in checked]
    tools = kwargs.get("tools")
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise ChatTemplateError(f"tools must be a list of tool objects, got {tools!r:.100}", "tools")
    kwargs.setdefault("tools", None)  # templates test `tools is not none`
    kwargs.setdefault("documents", None)
    try:
        text = compiled.render(
            messages=checked, add_generation_prompt=bool(add_generation_prompt),
            bos_token=bos_token, eos_token=eos_token, **kwargs,
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template rejected the messages: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ZeroDivisionError, OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    # Other fields (tool calls, names) reach the prompt too; the tokenizer cannot take surrogates.
    return _check_text(text, "messages")
