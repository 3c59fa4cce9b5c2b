"""Cython hot paths.

Host path: utf8 (the detokenizer's UTF-8 boundary tracker), chunk (the SSE chunk serializer),
tick (the scheduler's tick), stops (the stop-string automaton), sampler (the sampler kernel),
gguf_strings (a GGUF file's string arrays). Kernels of the forward step: cpu (the CPU probe,
the instruction-set switch and the thread pool every kernel module shares), ops (the small
ops between the products: add + RMSNorm, RoPE + KV write, decode attention, SiLU * up), qgemm
(the quantized weight products).
"""
