"""Embeddings and scores in the engine: ``Engine.embed`` / ``aembed`` / ``rerank`` / ``score``.

inputs.py   inputs -> token ids (special tokens, token types, truncation), on the caller's thread
pooling.py  hidden rows -> one vector (mean | cls | last | max), Matryoshka cut, L2 norm
runner.py   an encoder's jobs, packed chunks the engine thread runs one per loop turn
tick_rows.py  a decoder's embedding rows inside the generation ticks' forwards (prefill-only, pooled)
api.py      the Engine methods (a mixin of engine.api.Engine)
"""
