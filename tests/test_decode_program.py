"""A decode forward's layers in one C call (engine.models.decode_program) against the per-layer
calls it replaces: the same logits bit for bit, on the real quantized models (SmolLM2's plain
blocks, Qwen2.5's q/k/v bias, Gemma 3's q/k norms, post-norms, GELU and sliding windows)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from model_fixtures import gemma3_gguf, qwen15_gguf, qwen_gguf  # noqa: F401 (fixtures)

from cext import ops
from engine.batch import single_sequence_batch
from engine.loader import load_model
from tests.test_model import make_batch

BLOCK = 16


def _decode_logits(model, prompts: list[list[int]], steps: int, seed: int) -> torch.Tensor:
    """Each prompt prefilled alone, then ``steps`` decode forwards of every sequence together (the
    greedy ids of the first path fed to both: the rows' inputs do not depend on the path)."""
    rng = random.Random(seed)
    lengths = [len(p) + steps for p in prompts]
    free = rng.sample(range(sum(-(-n // BLOCK) for n in lengths) * 2), sum(-(-n // BLOCK) for n in lengths))
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    cache = model.make_kv_cache(2 * sum(len(t) for t in tables), BLOCK)
    for prompt, table in zip(prompts, tables):
        model.forward(single_sequence_batch(prompt, 0, table, BLOCK), cache)
    ids = [rng.randrange(1000, 20000) for _ in prompts]
    rows = []
    for step in range(steps):
        batch = make_batch([([t], len(p) + step, table) for t, p, table in zip(ids, prompts, tables)], BLOCK)
        logits = model.forward(batch, cache)
        rows.append(logits.clone())
        ids = [rng.randrange(1000, 20000) for _ in prompts]
    return torch.cat(rows)


def _both(model, prompts, steps, seed):
    model.use_decode_program = True
    model.decode_programs.clear()
    with_program = _decode_logits(model, prompts, steps, seed)
    assert model.decode_programs, "the decode forwards did not take the program"
    model.use_decode_program = False
    per_layer = _decode_logits(model, prompts, steps, seed)
    model.use_decode_program = True
    return with_program, per_layer


def _prompts(model, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1000, min(20000, model.vocab_size)) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


@pytest.mark.parametrize("lengths", [[7], [5, 23, 12], [3] * 9, [2] * 40])  # 40 rows: amx3 where AMX is
def test_the_default_model_decodes_the_same_bits_in_one_call(default_model, lengths):
    got, expected = _both(default_model, _prompts(default_model, lengths, seed=len(lengths)), steps=5, seed=3)
    assert torch.equal(got, expected)


def test_bfloat16_activations_decode_the_same_bits_in_one_call():
    model = load_model(None, dtype="bfloat16")
    got, expected = _both(model, _prompts(model, [9, 4], seed=1), steps=4, seed=2)
    assert torch.equal(got, expected)


def test_qwen_with_qkv_bias_decodes_the_same_bits_in_one_call(qwen_gguf):  # noqa: F811
    model = load_model(qwen_gguf)
    assert model.layers[0].qkv_proj.bias is not None
    got, expected = _both(model, _prompts(model, [6, 19], seed=4), steps=3, seed=5)
    assert torch.equal(got, expected)


def test_gemma3_norms_gelu_and_windows_decode_the_same_bits_in_one_call(gemma3_gguf):  # noqa: F811
    """q/k norms, post-norms, GELU-tanh, two rotary tables, sliding layers beside global ones,
    and a context past the 512-token window."""
    model = load_model(gemma3_gguf)
    layer = model.layers[0]
    assert layer.qk_norm is not None and layer.post_attn_norm is not None and layer.hidden_act != "silu"
    assert {layer.window is None for layer in model.layers} == {True, False}
    got, expected = _both(model, _prompts(model, [520, 8], seed=6), steps=3, seed=7)
    assert torch.equal(got, expected)


def test_qkv_in_two_formats_decodes_the_same_bits_in_one_call(qwen15_gguf):  # noqa: F811
    """Qwen2.5-Coder-1.5B Q4_K_M: where the kernels take strips, half its layers' q/k (Q4_K) and v (Q6_K)
    stay in their own codes as two parts of one qkv product (RowParts), the second writing after the
    first in the same rows; the program runs them as the per-layer path does."""
    from cext import cpu

    model = load_model(qwen15_gguf)
    formats = [layer.qkv_proj.format for layer in model.layers]
    if "avx2" in cpu.features():
        assert formats.count("parts") == 14
        parts = next(layer.qkv_proj.parts for layer in model.layers if layer.qkv_proj.parts)
        assert [p.format for p in parts] == ["int4", "q6"] and [p.out_features for p in parts] == [1792, 256]
    got, expected = _both(model, _prompts(model, [6, 11], seed=8), steps=3, seed=9)
    assert torch.equal(got, expected)


def test_programs_are_made_per_batch_size_and_prompts_take_the_per_layer_path(default_model):
    model = default_model
    model.decode_programs.clear()
    capacity = model.decode_buffers.capacity  # the largest batch of the tests before
    cache = model.make_kv_cache(8, BLOCK)
    model.forward(single_sequence_batch(list(range(1000, 1020)), 0, [0, 1], BLOCK), cache)
    assert not model.decode_programs  # a prompt chunk: no program
    for pos in (20, 21):
        model.forward(single_sequence_batch([1234], pos, [0, 1], BLOCK), cache)
    assert len(model.decode_programs) == 1  # made once, then reused
    (program,) = model.decode_programs.values()
    assert program.num_rows == 1 and program.kv_cache is cache
    model.forward(make_batch([([1234], 22, [0, 1]), ([1235], 5, [2]), ([1236], 5, [3])], BLOCK), cache)
    assert sorted(p.num_rows for p in model.decode_programs.values()) == [1, 3]
    assert model.decode_buffers.capacity == max(capacity, 3)  # one set of activations: the largest batch's rows
    other = model.make_kv_cache(8, BLOCK)  # another cache: the programs of the first are dropped
    model.forward(single_sequence_batch([1234], 0, [0], BLOCK), other)
    assert [p.kv_cache for p in model.decode_programs.values()] == [other]


def test_a_bad_block_fails_by_name_and_leaves_the_program_usable(default_model):
    model = default_model
    cache = model.make_kv_cache(4, BLOCK)
    model.forward(single_sequence_batch(list(range(1000, 1005)), 0, [0], BLOCK), cache)
    bad = make_batch([([1234], 5, [0]), ([1235], 3, [9])], BLOCK)  # block 9 of a 4-block cache
    with pytest.raises(IndexError):
        model.forward(bad, cache)
    good = model.forward(make_batch([([1234], 5, [0]), ([1235], 5, [0])], BLOCK), cache)
    assert good.shape == (2, model.vocab_size) and torch.isfinite(good).all()
    assert any(p.num_rows == 2 for p in model.decode_programs.values())  # the failure was the program's


def test_a_program_naming_a_missing_plan_is_refused(default_model):
    """decode_layers checks the plan and rotary table each layer names before it runs any."""
    model = default_model
    cache = model.make_kv_cache(4, BLOCK)
    model.forward(single_sequence_batch(list(range(1000, 1005)), 0, [0], BLOCK), cache)
    model.forward(single_sequence_batch([1234], 5, [0], BLOCK), cache)
    program = next(p for p in model.decode_programs.values() if p is not None)
    table = program.table.copy()
    table[3, ops.L_PLAN] = 1  # a sliding-window plan this model never has
    ropes, plans = np.zeros(6, dtype=np.int64), np.zeros(12, dtype=np.int64)
    ropes[0], plans[0], plans[4] = 1, 1, BLOCK  # table 0 and plan 0 given (never read: refused first)
    resid = torch.zeros(1, model.config.hidden_size)
    with pytest.raises(ValueError, match="layer 3"):
        ops.decode_layers(table, program.scales, resid.data_ptr(), 1, model.config.hidden_size, 1e-5, 0,
                          model.config.num_heads, model.config.num_kv_heads, model.config.head_dim,
                          model.config.intermediate_size, 0, 0, ropes, plans, model.decode_buffers.pointers)
