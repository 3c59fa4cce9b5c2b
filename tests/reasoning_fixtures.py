"""Reasoning test helpers: the default vocabulary with a reasoning model's chat template, and
scripted engines over it whose reply is a given text (ScriptedModel, greedy).

The default vocabulary (SmolLM2) has ChatML's <|im_start|> / <|im_end|>, so Qwen3's and QwQ's
templates tokenize with it as they would with their own; <think> is three tokens there
("<", "think", ">"), so every scripted reply splits its tags across tokens.
"""
from __future__ import annotations

from pathlib import Path

import engine
from engine.testing import ScriptedModel
from engine.tokenizer import Tokenizer
from tests.server_fixtures import default_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
DEEPSEEK_R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
SURE_PEAK = 40.0  # the scripted token's logit: p ~ 1 - 2e-9, so sampled replies follow the script too


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def tokenizer_with(name: str) -> Tokenizer:
    base = default_tokenizer()
    return Tokenizer(base.backend, bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids,
                     add_bos=base.add_bos, chat_template=template(name))


def reply_ids(tok: Tokenizer, text: str, per_char: bool = False) -> list[int]:
    """The ids of ``text`` then EOS; ``per_char``: one token per character (ASCII texts)."""
    if per_char:
        ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
        assert tok.decode(ids) == text
    else:
        ids = tok.encode(text, add_special_tokens=False)
    return ids + [min(tok.eos_token_ids)]


def reasoning_engine(text: str, name: str = QWEN3, per_char: bool = False, **options) -> engine.Engine:
    tok = tokenizer_with(name)
    options.setdefault("max_model_len", 2048)
    return engine.Engine(ScriptedModel(reply_ids(tok, text, per_char), tok.vocab_size, SURE_PEAK), tok, **options)
