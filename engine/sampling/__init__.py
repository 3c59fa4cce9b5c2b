"""Choosing the next token: logits processing, then sampling, for a whole batch at once.

- ``logits_process``: ``LogitsAdjuster`` (allowed ids, bias, penalties, min_tokens, bad words).
- ``sampler``: temperature / top-k / top-p / min-p sampling and logprobs through ``cext.sampler``.

The plain-NumPy definitions the kernels are tested against are in tests/sampling_reference.py.
"""
