"""Helpers the benchmarks compute their figures with (benchmarks.common), where a wrong helper
would put a wrong number in a report."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from benchmarks.common import decode_read_bytes
from benchmarks.llama_server import our_server_argv


def _write(path, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("untied", [False, True])
def test_decode_read_bytes_counts_the_embeddings_only_as_a_tied_head(tmp_path, untied):
    """A decode step reads every weight once, and the token embeddings whole only when they are
    the head too (a file without output.weight); with a head of its own it reads one row of them."""
    tensors = {"token_embd.weight": np.ones((64, 32), np.float32), "blk.0.attn_q.weight": np.ones((32, 32), np.float16),
               "output_norm.weight": np.ones(32, np.float32)}
    if untied:
        tensors["output.weight"] = np.ones((64, 32), np.float32)
    path = tmp_path / "m.gguf"
    _write(path, tensors)
    want = 32 * 32 * 2 + 32 * 4 + 64 * 32 * 4  # the head's bytes once: output.weight, or the tied embeddings
    assert decode_read_bytes(path) == want


def test_our_server_gets_the_engine_options_as_flags_the_cli_takes():
    """vs_llamacpp's HTTP rows start ``python -m webapp`` with the engine options it measures
    with: each a flag its parser accepts (speculative=None, plain decoding, is ``off``)."""
    import argparse

    from engine.config import add_engine_arguments, engine_options_from_args

    options = {"max_model_len": 2128, "kv_cache_tokens": 4096, "speculative": None}
    argv = our_server_argv("/m.gguf", options, 8000)
    assert argv[1:3] == ["-m", "webapp"]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    parsed = engine_options_from_args(parser.parse_args(argv[argv.index("--max-model-len"):]))
    assert {k: parsed[k] for k in options} == options
