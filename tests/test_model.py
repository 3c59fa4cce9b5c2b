"""The decoder through the paged cache: chunked prefill, step-by-step decode and mixed
batches all give the logits of one-shot prefill; config validation; the KV cache."""
from __future__ import annotations

import random

import pytest
import torch

from engine.batch import ForwardBatch, single_sequence_batch
from engine.loader import load_model
from engine.models import LlamaModel, PagedKVCache
from engine.models.config import ModelConfig

BLOCK_SIZE = 4


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rnd(V, E, scale=1.0), "model.norm.weight": 1 + rnd(E, scale=0.1)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(V, E)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": 1 + rnd(E, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(E, scale=0.1),
            p + "self_attn.q_proj.weight": rnd(q, E), p + "self_attn.k_proj.weight": rnd(kv, E),
            p + "self_attn.v_proj.weight": rnd(kv, E), p + "self_attn.o_proj.weight": rnd(E, q),
            p + "mlp.gate_proj.weight": rnd(I, E), p + "mlp.up_proj.weight": rnd(I, E),
            p + "mlp.down_proj.weight": rnd(E, I),
        })
        if config.attention_bias:
            sd.update({p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                       p + "self_attn.v_proj.bias": rnd(kv)})
    return sd


def make_batch(chunks: list[tuple[list[int], int, list[int]]], block_size: int, all_rows: bool = False) -> ForwardBatch:
    """chunks: (new token ids, start position, block table) per sequence; decode rows first.

    logit rows: every row if all_rows, else the last row of each sequence.
    """
    input_ids, positions, slots, starts, lens, rows = [], [], [], [0], [], []
    max_blocks = max(len(table) for _, _, table in chunks)
    tables = torch.full((len(chunks), max_blocks), -1, dtype=torch.int64)
    for b, (ids, start, table) in enumerate(chunks):
        tables[b, : len(table)] = torch.tensor(table)
        for j, token in enumerate(ids):
            pos = start + j
            input_ids.append(token)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        rows.extend(range(starts[-1], starts[-1] + len(ids)) if all_rows else [starts[-1] + len(ids) - 1])
        starts.append(starts[-1] + len(ids))
        lens.append(start + len(ids))
    num_decode = 0
    while num_decode < len(chunks) and len(chunks[num_decode][0]) == 1:
        num_decode += 1
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(input_ids=t(input_ids), positions=t(positions), slot_mapping=t(slots),
                        query_starts=t(starts), context_lens=t(lens), block_tables=tables, logit_rows=t(rows),
                        prompt_lens=t(lens), query_starts_list=starts, context_lens_list=lens,
                        num_decode_seqs=num_decode, block_size=block_size)


def one_shot_logits(model, ids: list[int]) -> torch.Tensor:
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    return model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK_SIZE, "all"), cache)


# float32 products of different row counts (1-row decode, chunk-sized prompts) take different GEMM
# blockings, so they round differently at the ulp of the logits' scale: on an AVX-512 oneDNN build
# the default model's logits (|15|) differed by 2e-4 between a 7-row chunk and the one-shot forward.
# A bound relative to that scale holds on any CPU; a real error (a wrong position or KV slot)
# moves logits by a large fraction of it (test_chunked_bound_catches_a_wrong_position).
SCALE_RTOL = 3e-5


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = SCALE_RTOL) -> None:
    """|actual - expected| <= rel * max|expected| elementwise (a bound stated against the logits' scale)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, atol=rel * scale, rtol=0)


def chunked_and_decode_logits(model, ids: list[int], chunk_sizes: list[int], seed: int,
                              gap: int = 0) -> torch.Tensor:
    """Prefill in chunks then decode one token at a time, through a shuffled block table.

    gap > 0 skips that many positions after the first chunk (a wrong-position error, for negative controls).
    """
    num_blocks = -(-(len(ids) + gap) // BLOCK_SIZE)
    table = random.Random(seed).sample(range(3 * num_blocks), num_blocks)
    cache = model.make_kv_cache(3 * num_blocks, BLOCK_SIZE)
    pos, pieces = 0, []
    for size in chunk_sizes + [1] * len(ids):
        if pos >= len(ids):
            break
        chunk = ids[pos: pos + size]
        batch = single_sequence_batch(chunk, pos + (gap if pos else 0), table, BLOCK_SIZE, "all")
        pieces.append(model.forward(batch, cache))
        pos += len(chunk)
    return torch.cat(pieces)


def check_chunked_and_decode(model, ids: list[int], chunk_sizes: list[int], seed: int, atol: float | None = None,
                             rtol: float = 0.0) -> None:
    """Chunked prefill + decode equals the one-shot forward: within atol (tiny models, whose products of
    any row count agree to ~1e-6) or, with atol=None, within SCALE_RTOL of the logits' scale."""
    reference = one_shot_logits(model, ids)  # [N, V]
    got = chunked_and_decode_logits(model, ids, chunk_sizes, seed)
    if atol is None:
        assert_logits_close(got, reference)
    else:
        torch.testing.assert_close(got, reference, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def tiny_models():
    cases = {
        "llama_tied": tiny_config(tie_word_embeddings=True),
        "qwen2_bias": tiny_config(architecture="qwen2", attention_bias=True),
        "mistral_window": tiny_config(architecture="mistral", sliding_window=5),
        "llama3_rope": tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    }
    return {name: LlamaModel(cfg, random_state_dict(cfg, seed=i)) for i, (name, cfg) in enumerate(cases.items())}


@pytest.mark.parametrize("name", ["llama_tied", "qwen2_bias", "mistral_window", "llama3_rope"])
def test_chunked_prefill_and_decode_match_one_shot(tiny_models, name):
    ids = random.Random(1).choices(range(97), k=23)
    check_chunked_and_decode(tiny_models[name], ids, [5, 1, 7], seed=2, atol=1e-4)


@pytest.mark.parametrize("name", ["llama_tied", "qwen2_bias", "mistral_window"])
def test_mixed_batch_equals_each_sequence_alone(tiny_models, name):
    model = tiny_models[name]
    rng = random.Random(3)
    prompts = [rng.choices(range(97), k=n) for n in (9, 14, 3, 11, 6)]
    # Sequences 0-2 decode their last token (prefix cached), 3 prefills a second chunk, 4 a first chunk.
    starts = [8, 13, 2, 4, 0]
    num_blocks = 64
    free = rng.sample(range(num_blocks), num_blocks)
    tables = [[free.pop() for _ in range(-(-len(p) // BLOCK_SIZE))] for p in prompts]
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    for prompt, start, table in zip(prompts, starts, tables):  # fill the cached prefixes
        if start:
            model.forward(single_sequence_batch(prompt[:start], 0, table, BLOCK_SIZE), cache)
    batch = make_batch([(p[s:], s, t) for p, s, t in zip(prompts, starts, tables)], BLOCK_SIZE, all_rows=True)
    assert batch.num_decode_seqs == 3
    logits = model.forward(batch, cache)  # [T, V]
    expected = torch.cat([one_shot_logits(model, p)[s:] for p, s in zip(prompts, starts)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_logit_rows_select_and_order(tiny_models):
    model = tiny_models["llama_tied"]
    ids = list(range(10, 20))
    full = one_shot_logits(model, ids)
    batch = single_sequence_batch(ids, 0, [0, 1, 2], BLOCK_SIZE, "all")
    batch.logit_rows = torch.tensor([7, 2], dtype=torch.int64)
    out = model.forward(batch, model.make_kv_cache(3, BLOCK_SIZE))
    assert out.shape == (2, 97) and out.dtype == torch.float32
    torch.testing.assert_close(out, full[[7, 2]], atol=1e-5, rtol=0)


def test_bfloat16_close_to_float32():
    cfg = tiny_config()
    sd = random_state_dict(cfg)
    ids = random.Random(4).choices(range(97), k=12)
    f32 = one_shot_logits(LlamaModel(cfg, sd, dtype="float32"), ids)
    model = LlamaModel(cfg, sd, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.make_kv_cache(2, 4).k.dtype == torch.bfloat16
    bf16 = one_shot_logits(model, ids)
    assert bf16.dtype == torch.float32
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9
    assert (bf16 - f32).abs().max() < 0.25 * f32.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_give_the_dense_logits(dtype):
    cfg = tiny_config(attention_bias=True)  # the qkv bias goes through the packed product too
    sd = random_state_dict(cfg)
    ids = random.Random(5).choices(range(97), k=9)
    packed = LlamaModel(cfg, sd, dtype=dtype)
    dense = LlamaModel(cfg, sd, dtype=dtype, pack_weights=False)
    layer = packed.layers[0]
    # oneDNN packs bfloat16 only on CPUs with native bf16 support (AVX512-BF16/AMX); elsewhere
    # the layer must fall back to the dense weight and still give the same logits.
    can_pack = dtype == "float32" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, packed.head_proj)
    assert all(p.is_packed == can_pack for p in projections)
    assert not dense.layers[0].qkv_proj.is_packed and dense.layers[0].qkv_proj.weight is not None
    if can_pack:
        assert layer.qkv_proj.weight is None and packed.head_proj.weight is packed.lm_head  # no second dense copy
    a, b = one_shot_logits(packed, ids), one_shot_logits(dense, ids)
    tol = 1e-4 if dtype == "float32" else 0.05
    torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)


def test_kv_cache_shape_and_zeroed():
    cache = LlamaModel(tiny_config(), random_state_dict(tiny_config())).make_kv_cache(5, 4)
    assert isinstance(cache, PagedKVCache)
    assert cache.k.shape == (2, 20, 2, 8) and cache.num_slots == 20
    assert not cache.k.any() and not cache.v.any()
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(2, 0, 4, 2, 8, torch.float32)


def test_missing_and_misshapen_weights_are_named():
    cfg = tiny_config()
    sd = random_state_dict(cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel(cfg, sd)
    sd = random_state_dict(cfg)
    sd["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        LlamaModel(cfg, sd)
    with pytest.raises(ValueError, match="dtype"):
        LlamaModel(cfg, random_state_dict(cfg), dtype="float16")


@pytest.mark.parametrize("overrides, field", [
    ({"architecture": "gpt2"}, "architecture"),
    ({"num_kv_heads": 4}, "num_kv_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"head_dim": 7}, "head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_config_from_hf_dict():
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "sliding_window": 4096, "use_sliding_window": False,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    })
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == ("qwen2", 8, 2, True)
    assert cfg.sliding_window is None and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


@pytest.mark.slow
def test_default_model_chunked_decode_and_batch_match_one_shot():
    model = load_model(None, quantization="float32")  # float32 products: equal up to the float32 ulp
    assert model.config.architecture == "llama" and model.config.tie_word_embeddings
    assert model.vocab_size == 49152 and model.config.num_kv_heads == 3
    rng = random.Random(5)
    ids = rng.choices(range(49152), k=22)
    # Logits reach |15|: GEMMs of 1, 7 and 9 rows round differently at the float32 ulp level.
    check_chunked_and_decode(model, ids, [7, 9], seed=6)
    prompts = [rng.choices(range(49152), k=n) for n in (12, 20, 9)]
    starts = [11, 13, 0]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10]]
    cache = model.make_kv_cache(11, BLOCK_SIZE)
    for prompt, start, table in zip(prompts, starts, tables):
        if start:
            model.forward(single_sequence_batch(prompt[:start], 0, table, BLOCK_SIZE), cache)
    logits = model.forward(make_batch([(p[s:], s, t) for p, s, t in zip(prompts, starts, tables)], BLOCK_SIZE), cache)
    expected = torch.stack([one_shot_logits(model, p)[-1] for p in prompts])
    assert_logits_close(logits, expected)


def test_chunked_bound_catches_a_wrong_position():
    """The scale-relative bound is tight: later chunks one position off (a real error) exceed it many times."""
    model = load_model(None, quantization="float32")
    ids = random.Random(5).choices(range(49152), k=22)
    reference = one_shot_logits(model, ids)
    shifted = chunked_and_decode_logits(model, ids, [7, 9], seed=6, gap=1)
    error = (shifted - reference).abs().max().item()
    assert error > 100 * SCALE_RTOL * reference.abs().max().item()


def test_bfloat16_top_logits_are_not_rounded_to_bfloat16():
    cfg = tiny_config(vocab_size=300, hidden_size=64, head_dim=8, num_heads=8)
    model = LlamaModel(cfg, random_state_dict(cfg), dtype="bfloat16")
    x = torch.randn(3, 64).bfloat16() * 4
    logits = model.compute_logits(x)  # [3, V]
    exact = x.float() @ model.lm_head.float().T  # same bf16 inputs, float32 products
    top = exact.topk(10, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-5)
    # The tail keeps bf16 rounding: within bf16's relative precision of the exact product.
    assert ((logits - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).all()


def test_a_refined_head_runs_int8_codes_and_keeps_its_best_logits_exact():
    """A head re-quantized to int8 (a Q6_K file head) has its REFINE_TOP_K best logits a row
    recomputed from the exact rows, so its product takes int8 activation codes (packed strips:
    AVX-512 VNNI) at any ``activations``: the best logits are the exact product's, the tail moves
    by the codes' rounding only."""
    from engine.models.linear import packs
    from engine.models.quant import Int8Weight

    class ExactRows:
        def __init__(self, w):
            self.w = w

        def rows(self, ids, dtype):
            return self.w[ids].to(dtype)

    cfg = tiny_config(vocab_size=320, hidden_size=64, head_dim=8, num_heads=8)
    state = random_state_dict(cfg)
    w = state["lm_head.weight"]
    state["lm_head.weight"] = Int8Weight.from_dense(w)
    state["lm_head.weight"].exact_rows = ExactRows(w)
    model = LlamaModel(cfg, state)
    assert model.head_is_refined and model.activations == "int16"
    assert model.head_proj.int8_activations == packs(320)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3
    logits = model.compute_logits(x)  # [5, V]
    exact = x @ w.T
    top = exact.topk(10, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-6)
    assert ((logits - exact).abs() <= 0.05 * exact.abs().max()).all()  # the tail: int8 weights and codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_full_rows_are_made_on_first_lookup_and_after_growth(dtype):
    """The [P, D] cos/sin of the torch path are made when first looked up (the fused path reads
    only the half tables), from float64 rounded once to the model dtype, and made again at the
    new length after ensure() grows the table."""
    from engine.models.rope import RotaryTable

    table = RotaryTable(tiny_config(max_position_embeddings=64), dtype)
    assert table.cos is None and table.cos_half.shape == (64, 4)

    def want(num_positions):
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float64), table.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    positions = torch.tensor([0, 5, 63])
    cos, sin = table.lookup(positions)
    assert cos.shape == (3, 1, 8) and cos.dtype == dtype
    assert torch.equal(cos[:, 0], want(64)[0][positions]) and torch.equal(sin[:, 0], want(64)[1][positions])
    table.ensure(100)
    assert table.cos is None and table.num_positions == 128
    cos, sin = table.lookup(torch.tensor([99]))
    assert torch.equal(cos[:, 0], want(128)[0][[99]]) and torch.equal(sin[:, 0], want(128)[1][[99]])
