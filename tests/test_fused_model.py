"""Whole-model logits, fused path (C kernels between the matmuls) against the torch
reference path: tiny random models of every architecture, and the default model."""
from __future__ import annotations

import random

import pytest
import torch

from engine.batch import single_sequence_batch
from engine.loader import load_model
from engine.models import LlamaModel, fused
from tests.test_model import BLOCK_SIZE, make_batch, random_state_dict, tiny_config

CONFIGS = {
    "llama_tied": dict(tie_word_embeddings=True),
    "qwen2_bias": dict(architecture="qwen2", attention_bias=True),
    "mistral_window": dict(architecture="mistral", sliding_window=5),
    "mha_head64": dict(num_heads=2, num_kv_heads=2, head_dim=64, hidden_size=96),
}


def _both(model, fn):
    """fn(model) on the fused path and on the reference path, each on a fresh KV cache."""
    model.use_fused = True
    fused_out = fn(model)
    model.use_fused = False
    reference_out = fn(model)
    model.use_fused = True
    return fused_out, reference_out


def _chunked_then_decode(model, ids, chunk_sizes, seed, block_size=BLOCK_SIZE):
    """Logits of every row: prefill in chunks, then one decode step per token, through a
    shuffled block table with unused blocks between the used ones."""
    num_blocks = -(-len(ids) // block_size)
    table = random.Random(seed).sample(range(3 * num_blocks), num_blocks)
    cache = model.make_kv_cache(3 * num_blocks, block_size)
    pos, pieces = 0, []
    for size in chunk_sizes + [1] * len(ids):
        if pos >= len(ids):
            break
        chunk = ids[pos: pos + size]
        pieces.append(model.forward(single_sequence_batch(chunk, pos, table, block_size, "all"), cache))
        pos += len(chunk)
    return torch.cat(pieces)  # [N, V]


def _mixed_batch(model, seed):
    """Three decode rows and two prefill chunks in one forward (prefixes cached first)."""
    rng = random.Random(seed)
    prompts = [rng.choices(range(model.vocab_size), k=n) for n in (9, 14, 3, 11, 6)]
    starts = [8, 13, 2, 4, 0]
    free = rng.sample(range(40), 40)
    tables = [[free.pop() for _ in range(-(-len(p) // BLOCK_SIZE))] for p in prompts]
    cache = model.make_kv_cache(40, BLOCK_SIZE)
    for prompt, start, table in zip(prompts, starts, tables):
        if start:
            model.forward(single_sequence_batch(prompt[:start], 0, table, BLOCK_SIZE), cache)
    chunks = [(p[s:], s, t) for p, s, t in zip(prompts, starts, tables)]
    return model.forward(make_batch(chunks, BLOCK_SIZE, all_rows=True), cache)


def test_fused_is_the_default_path():
    assert fused.is_available()
    model = LlamaModel(tiny_config(), random_state_dict(tiny_config()))
    assert model.use_fused


def test_prompt_attention_takes_tiles_only_beside_the_quantized_kernels():
    """AMX prompt attention (16 bits of each operand) where the model's own products round (the
    quantized kernels', bfloat16 weights); float32 attention beside float32 products (dense float32
    weights, exact_products)."""
    from engine.loader import default_model_path
    from engine.loader.gguf_loader import load_gguf

    batch = make_batch([(list(range(1, 9)), 0, list(range(-(-8 // BLOCK_SIZE))))], BLOCK_SIZE)
    for model, tiles in ((LlamaModel(tiny_config(), random_state_dict(tiny_config())), False),
                         (LlamaModel(tiny_config(), random_state_dict(tiny_config()), dtype="bfloat16"), True),
                         (load_gguf(default_model_path(), dtype="float32"), True),
                         (load_gguf(default_model_path(), dtype="float32", exact_products=True), False)):
        assert model.tile_attention == tiles
        assert all(plan.tiles == tiles for plan in model._plans(batch, is_fused=True))  # what the kernel gets


@pytest.fixture(scope="module")
def tiny_models():
    return {name: LlamaModel(tiny_config(**overrides), random_state_dict(tiny_config(**overrides), seed=i))
            for i, (name, overrides) in enumerate(CONFIGS.items())}


def test_quantized_float32_models_keep_float16_kv_caches():
    assert load_model(None).make_kv_cache(2, BLOCK_SIZE).k.dtype == torch.float16  # the default: int4 weights
    assert load_model(None, quantization="float32").kv_cache_dtype == torch.float32  # exact mode


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_float16_cache_fused_tracks_reference(tiny_models, name):
    """A float16 KV cache: both paths round K and V once on write; what is left is float16
    rounding met at different points, far below the logits' scale."""
    model = tiny_models[name]
    model.kv_cache_dtype = torch.float16
    ids = random.Random(1).choices(range(97), k=23)
    got, expected = _both(model, lambda m: _chunked_then_decode(m, ids, [5, 1, 7], seed=2))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    got, expected = _both(model, lambda m: _mixed_batch(m, seed=3))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    model.kv_cache_dtype = torch.float32


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_float32_fused_equals_reference(tiny_models, name):
    model = tiny_models[name]
    ids = random.Random(1).choices(range(97), k=23)
    got, expected = _both(model, lambda m: _chunked_then_decode(m, ids, [5, 1, 7], seed=2))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    got, expected = _both(model, lambda m: _mixed_batch(m, seed=3))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama_tied", "mistral_window"])
def test_tiny_bfloat16_fused_is_as_close_to_float32_as_the_reference(name):
    config = tiny_config(**CONFIGS[name])
    state = random_state_dict(config, seed=4)
    exact = LlamaModel(config, state, dtype="float32")
    exact.use_fused = False
    ids = random.Random(5).choices(range(97), k=20)
    truth = _chunked_then_decode(exact, ids, [6], seed=6)
    model = LlamaModel(config, state, dtype="bfloat16")
    got, reference = _both(model, lambda m: _chunked_then_decode(m, ids, [6], seed=6))
    err_fused = (got - truth).abs().max().item()
    err_reference = (reference - truth).abs().max().item()
    # The fused path keeps the residual in float32 and rounds each op once: no worse.
    assert err_fused <= 1.25 * err_reference + 1e-3, (err_fused, err_reference)
    assert err_fused < 0.03 * truth.abs().max().item()  # bf16 rounding, not a wrong kernel


@pytest.mark.slow
def test_default_model_fused_equals_reference():
    model = load_model(None, dtype="float32", quantization="float32")  # exact weights: ulps only
    rng = random.Random(7)
    ids = rng.choices(range(model.vocab_size), k=21)
    got, expected = _both(model, lambda m: _chunked_then_decode(m, ids, [9, 4], seed=8, block_size=16))
    # Logits reach |15|; only summation order differs (float32 ulps).
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    got, expected = _both(model, lambda m: _mixed_batch(m, seed=9))
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_default_model_bfloat16_fused_tracks_float32():
    exact = load_model(None, dtype="float32", quantization="float32")
    exact.use_fused = False
    ids = random.Random(10).choices(range(exact.vocab_size), k=14)
    truth = _chunked_then_decode(exact, ids, [8], seed=11, block_size=16).log_softmax(-1)
    del exact
    model = load_model(None, dtype="bfloat16", quantization="bfloat16")
    got, reference = _both(model, lambda m: _chunked_then_decode(m, ids, [8], seed=11, block_size=16))
    got, reference = got.log_softmax(-1), reference.log_softmax(-1)
    assert (got.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.9
    top = truth.topk(5, dim=-1).indices
    err_fused = (got.gather(1, top) - truth.gather(1, top)).abs().max().item()
    err_reference = (reference.gather(1, top) - truth.gather(1, top)).abs().max().item()
    assert err_fused <= 1.25 * err_reference + 0.05, (err_fused, err_reference)
