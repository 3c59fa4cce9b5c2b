"""Constrained decoding (structured output) over llguidance.

    vocab.py     our Tokenizer -> llguidance.LLTokenizer (token bytes from the detokenizer's table)
    compiler.py  SamplingParams' constraint -> GrammarSpec -> CompiledGrammar (bounded LRU cache)
    matcher.py   GrammarMatcher (one request's state) and apply_token_masks (the batch, per tick)

Why llguidance and not xgrammar: benchmarks/structured.py --compare-engines; README "Structured output".
"""
from .compiler import CompiledGrammar, GrammarSpec, cache_info, compile_grammar, spec_of
from .matcher import GrammarMatcher, apply_token_masks

__all__ = ["CompiledGrammar", "GrammarMatcher", "GrammarSpec", "apply_token_masks", "cache_info",
           "compile_grammar", "spec_of"]
