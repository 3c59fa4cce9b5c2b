"""Constrained decoding (structured output) over llguidance.

    vocab.py     our Tokenizer -> llguidance.LLTokenizer (token bytes from the detokenizer's table)
    compiler.py  SamplingParams' constraint -> GrammarSpec -> CompiledGrammar (bounded LRU cache)
    matcher.py   GrammarMatcher (one request's state) and mask_rows (the batch, per tick, before sampling)

Why llguidance and not xgrammar: benchmarks/structured.py --compare-engines; README "Structured output".
"""
from .compiler import CompiledGrammar, GrammarSpec, cache_info, compile_grammar, spec_of
from .matcher import GrammarMatcher, apply_token_masks, mask_rows

__all__ = ["CompiledGrammar", "GrammarMatcher", "GrammarSpec", "apply_token_masks", "cache_info",
           "compile_grammar", "mask_rows", "spec_of"]
