"""Embeddings and scores in the engine: ``Engine.embed`` / ``aembed`` / ``rerank`` / ``score``.

inputs.py   inputs -> token ids (special tokens, token types, truncation), on the caller's thread
pooling.py  hidden rows -> one vector (mean | cls | last | max), Matryoshka cut, L2 norm
runner.py   jobs the engine thread runs between ticks (encoders, and decoders' causal forward)
api.py      the Engine methods (a mixin of engine.api.Engine)
"""
