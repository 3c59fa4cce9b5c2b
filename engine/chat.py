"""The engine's one chat path: OpenAI-style messages in, what to submit out.

    chat = prepare_chat(tokenizer, messages, params, tools, tool_choice, parallel_tool_calls)
    stream = submit(chat.prompt_ids, chat.params, event_filter=chat.event_filter)

Every chat request (Engine.stream_chat / astream_chat, and so chat, achat and the server's
/v1/chat/completions) is templated and tokenized here, on the caller's thread. Tools are a
hook into this path (``ToolHook``, engine/tools/stream.py), loaded only when a request has
tools or a tool_choice: it validates them before templating, hands the template the tools to
render, rewrites the params (a json_schema for tool_choice "required" or a named tool) and
filters the request's events (generated text -> content + tool-call deltas). Reasoning is a
filter before it (engine/reasoning.py), on when the template writes ``<think>`` blocks: the
reply's reasoning goes to ``reasoning_content`` and the tools' parser sees the content only.
``chat_template_kwargs`` reach the template as its variables (``enable_thinking``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .errors import InvalidParameterError
from .outputs import StreamEvent
from .params import SamplingParams
from .reasoning import reasoning_filter


@dataclass(slots=True)
class ChatPrompt:
    """A chat request ready to submit: its prompt ids, its params and its event filter (or None)."""

    prompt_ids: list[int]
    params: SamplingParams | None
    event_filter: Callable[[StreamEvent], StreamEvent] | None = None
    tool_hook: object | None = None  # engine.tools.stream.ToolHook when the request has tools

    def error(self, exc: InvalidParameterError) -> InvalidParameterError:
        """The error to raise for ``exc`` from submitting (the hook may name ``tools`` instead)."""
        return exc if self.tool_hook is None else self.tool_hook.error(exc)


def _chain(first, second):
    """One event filter that applies ``first``, then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda event: second(first(event))


def prepare_chat(tokenizer, messages, params: SamplingParams | None = None, tools=None, tool_choice=None,
                 parallel_tool_calls: bool = True, chat_template_kwargs: dict | None = None) -> ChatPrompt:
    """Template and tokenize ``messages`` (with the tools of the hook, if any). Raises
    InvalidParameterError naming the field (tools and tool_choice are checked before templating)."""
    hook = None
    if tools is not None or tool_choice is not None:
        from .tools.stream import tool_hook

        hook = tool_hook(tokenizer, tools, tool_choice, parallel_tool_calls)
    prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True,
                                       tools=None if hook is None else hook.tools,
                                       chat_template_kwargs=chat_template_kwargs)
    if hook is not None:
        params = hook.sampling_params(params)
    reasoning = reasoning_filter(tokenizer, prompt_ids, params)
    if reasoning is not None and tokenizer.is_special_text(reasoning.markers):  # kept in the text for the parser
        params = dataclasses.replace(params or SamplingParams(), skip_special_tokens=False)
    tool_filter = None if hook is None else hook.event_filter()
    return ChatPrompt(prompt_ids, params, _chain(reasoning, tool_filter), hook)
