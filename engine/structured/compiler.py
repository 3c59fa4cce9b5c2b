"""A request's constraint -> a compiled llguidance grammar, cached.

``spec_of(params)`` reads the one constraint of a SamplingParams (``json_schema``, ``regex``,
``choice`` or ``grammar``) into a ``GrammarSpec`` (kind + canonical text: the cache key).
``compile_grammar(spec, tokenizer, vocab_size)`` turns it into a ``CompiledGrammar``: an
llguidance ``LLMatcher`` in its start state, built once and copied per request
(``deep_copy`` costs microseconds). The cache is a bounded LRU keyed by (vocabulary, spec), so a
repeated schema costs one dict lookup. Compilation runs on the caller's thread (``Request.create``),
never on the engine thread; llguidance releases the GIL while it builds.

Dialects
  json_schema  JSON Schema (draft 2020-12 subset of llguidance: types, properties, required,
               additionalProperties, items/prefixItems, enum/const, anyOf/oneOf/allOf, $ref/$defs,
               minLength/maxLength/pattern/format, minimum/maximum/exclusive*, minItems/maxItems).
               An unsupported keyword or format is an InvalidParameterError naming the field.
               Output is compact JSON with Python's separators (", " and ": "), no free whitespace:
               a small model cannot wander off into blank lines.
  regex        the whole output matches (Rust ``regex`` syntax; ``\\d``, ``\\w``, ``\\s`` are ASCII).
  choice       the output is exactly one of the strings.
  grammar      a Lark grammar (llguidance's dialect: ``start: ...``, ``/regex/`` terminals, ``%json``)
               or a GBNF grammar (llama.cpp: ``root ::= ...``); GBNF is recognised and converted.
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidParameterError
from .vocab import ll_tokenizer, llguidance_module

if TYPE_CHECKING:
    import llguidance

MAX_CACHED_GRAMMARS = 256
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Per-token work bounds (llguidance's own, lowered): one mask step of any grammar stays bounded.
LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000, max_lexer_states=250_000)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # the SamplingParams field: "json_schema" | "regex" | "choice" | "grammar"
    text: str  # the cache key: JSON text (key order kept: it is the output order) or the text itself


def spec_of(params) -> GrammarSpec | None:
    """The constraint of a SamplingParams, or None (params allow at most one)."""
    if params.json_schema is not None:
        return GrammarSpec("json_schema", json.dumps(params.json_schema, ensure_ascii=False))
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("choice", json.dumps(list(params.choice), ensure_ascii=False))
    if params.grammar is not None:
        return GrammarSpec("grammar", params.grammar)
    return None


class CompiledGrammar:
    """A grammar ready for matching: ``matcher()`` gives a fresh per-request copy."""

    __slots__ = ("spec", "_start")

    def __init__(self, spec: GrammarSpec, start: llguidance.LLMatcher):
        self.spec = spec
        self._start = start

    def matcher(self) -> llguidance.LLMatcher:
        return self._start.deep_copy()


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec; raises InvalidParameterError naming the field."""
    llguidance = llguidance_module()
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        from llguidance.gbnf_to_lark import any_to_lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.text))
    except Exception as exc:  # ValueError (not a JSON object), GbnfToLarkError (a GBNF it cannot read), ...
        raise InvalidParameterError(f"{spec.kind} is invalid: {exc}", spec.kind) from None


def _compile(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    llguidance = llguidance_module()
    start = llguidance.LLMatcher(tokenizer, _grammar_text(spec), log_level=0,
                                 limits=llguidance.LLParserLimits(**LIMITS))
    if start.is_error():
        message = start.get_error().strip()
        raise InvalidParameterError(f"{spec.kind} is not supported or invalid: {message}", spec.kind)
    return CompiledGrammar(spec, start)


class _LRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key):
        with self.lock:
            value = self.entries.get(key)
            if value is not None:
                self.entries.move_to_end(key)
                self.num_hits += 1
            else:
                self.num_misses += 1
            return value

    def put(self, key, value) -> None:
        with self.lock:
            self.entries[key] = value
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


_cache = _LRU(MAX_CACHED_GRAMMARS)


def compile_grammar(spec: GrammarSpec, tokenizer, vocab_size: int) -> CompiledGrammar:
    """The compiled grammar of ``spec`` over ``tokenizer``'s ids (``vocab_size``: the logits width).
    Cached (LRU of MAX_CACHED_GRAMMARS); errors are InvalidParameterError naming spec.kind."""
    vocab = ll_tokenizer(tokenizer, vocab_size)
    key = (vocab, spec)
    compiled = _cache.get(key)
    if compiled is None:
        compiled = _compile(spec, vocab)
        _cache.put(key, compiled)
    return compiled


def cache_info() -> dict:
    return {"size": len(_cache.entries), "hits": _cache.num_hits, "misses": _cache.num_misses}


__all__ = ["CompiledGrammar", "GrammarSpec", "cache_info", "compile_grammar", "spec_of"]
