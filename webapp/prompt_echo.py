"""The prompt's part of a response: completions' ``echo`` (the prompt text, and with ``logprobs``
its tokens' logprobs) and vLLM's ``prompt_logprobs``, one-shot and streamed.

Streamed, both go in the first chunk of a choice, as vLLM sends them: echo text alone can go
out at once, but logprobs of the prompt exist only once the prompt is prefilled, so such a
choice's opening chunk is written when its first event arrives (``OpeningChunks``). The chunk
is the ChunkWriter's own event (so a chat chunk still carries the role once) with the prompt's
fields added; the writer's text offsets then continue after the echoed text. (The Ray Serve
ingress streams without it: there echo sends the text alone and prompt_logprobs are not streamed.)
"""
from __future__ import annotations

import json

from . import protocol


class OpeningChunks:
    """Per choice, the chunk to send before its first event: echo and/or prompt logprobs."""

    def __init__(self, req: protocol.ParsedRequest, stream, writer, tokenizer, echo_texts: list[str] | None):
        self.req = req
        self.stream = stream
        self.writer = writer
        self.tokenizer = tokenizer
        self.echo_texts = echo_texts
        self.opened: set[int] = set()

    @staticmethod
    def is_needed(req: protocol.ParsedRequest) -> bool:
        """Prompt logprobs to show, or echo with logprobs: the opening waits for the prefill."""
        return req.is_prompt_logprobs_shown or (req.is_echo and req.params.logprobs)

    def first(self, index: int) -> bytes:
        """The opening chunk of choice ``index`` the first time it is asked for, then b""."""
        if index in self.opened:
            return b""
        self.opened.add(index)
        req = self.req
        is_chat_shared = req.is_chat and index != 0  # chat: prompt_logprobs once, at the top of choice 0's chunk
        if self.echo_texts is None and is_chat_shared:
            return b""
        echo_text = "" if self.echo_texts is None else self.echo_texts[index]
        chunk = json.loads(self.writer.event(echo_text, None, None, index)[len(b"data: "):])
        prompt_logprobs = self.stream.choice_prompt_logprobs(index)
        choice = chunk["choices"][0]
        if self.echo_texts is not None and req.params.logprobs:
            choice["logprobs"] = protocol.echo_logprobs(first_token_text(self.tokenizer, self.stream, index),
                                                        prompt_logprobs)
            self.writer.advance_text_offset(index, len(echo_text))
        if req.is_prompt_logprobs_shown and not is_chat_shared:
            (chunk if req.is_chat else choice)["prompt_logprobs"] = protocol.prompt_logprobs_list(prompt_logprobs)
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def first_token_text(tokenizer, stream, index: int) -> str:
    """The text of a choice's first prompt token (it has no logprob: nothing comes before it)."""
    return tokenizer.decode(stream.choice_prompt_token_ids(index)[:1], skip_special_tokens=False)
