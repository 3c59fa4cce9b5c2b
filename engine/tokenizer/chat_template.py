"""Chat templates: OpenAI-style messages -> prompt text, rendered in a jinja2 sandbox.

A template embedded in a model file is untrusted input, so it runs in jinja2's
`ImmutableSandboxedEnvironment` (no attribute access to internals, no mutation of the
arguments). The environment matches what Hugging Face templates expect (transformers'
`chat_template_utils`): trim_blocks + lstrip_blocks, loop controls, a `tojson` filter that
keeps non-ASCII text, `raise_exception(message)`, `strftime_now(format)` and a no-op
`{% generation %}` block.

Every failure is a ChatTemplateError (a ValueError), which the HTTP layer reports as a 400.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "KNOWN_ROLES", "validate_messages", "render_chat_template"]

KNOWN_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The messages are invalid, or the chat template is missing, broken, or raised."""


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


def _content_text(content, where: str) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text": str} parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{where}[{j}] must be an object, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ChatTemplateError(f"{where}[{j}].type must be 'text', got {part.get('type')!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}[{j}].text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


def validate_messages(messages) -> list[dict]:
    """Check OpenAI-style chat messages; return copies whose content is a plain string.

    Raises ChatTemplateError (a ValueError) naming the offending field, e.g. "messages[1].role".
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in KNOWN_ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(KNOWN_ROLES)}; got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        elif content is None:
            raise ChatTemplateError(f"{where}.content is missing")
        checked.append({**message, "content": _content_text(content, f"{where}.content")})
    return checked


def render_chat_template(
    template: str | None,
    messages,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs,
) -> str:
    """Render `messages` with `template` in the sandbox. All errors are ChatTemplateError."""
    if not template:
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
    checked = validate_messages(messages)
    compiled = _compile(template)
    kwargs.setdefault("tools", None)  # as transformers passes them: templates test `tools is not none`
    kwargs.setdefault("documents", None)
    try:
        return compiled.render(
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
