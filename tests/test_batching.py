"""Continuous batching with the default model: batched, preempted and prefix-cached runs give the solo ids.

Greedy ids may legitimately differ where two candidates are nearly tied: batching changes
the floating-point summation order. A difference is accepted only at a position where the
solo run's top-2 logprobs were within 0.01 of each other (everything after it follows).
"""
from __future__ import annotations

import os

import pytest

from engine import Engine
from engine.loader import default_model_path, load_model
from engine.params import SamplingParams
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Write a haiku about autumn leaves.",
    "The three primary colors are",
    "Translate to French: Good morning, how are you today?",
    "In physics, the law of conservation of energy states that energy can neither be created nor destroyed; "
    "it can only be transformed from one form to another. For example, when a ball falls,",
]
MAX_TOKENS = 10
TIE = 0.01


@pytest.fixture(scope="module")
def model_and_tokenizer():
    path = default_model_path()
    # float32 products: batched and solo rows then differ at the float32 ulp only (the int4
    # default rounds inputs to bfloat16, which turns ulp differences into ~0.1-nat ones).
    return load_model(path, quantization="float32"), load_tokenizer(path)


def make_engine(model_and_tokenizer, **options) -> Engine:
    model, tok = model_and_tokenizer
    return Engine(model, tok, **options)


def greedy(top_logprobs: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True,
                          top_logprobs=top_logprobs)


@pytest.fixture(scope="module")
def solo(model_and_tokenizer):
    """Each prompt alone on a cold engine (no prefix cache): ids and per-position top-2 logprobs."""
    with make_engine(model_and_tokenizer, enable_prefix_caching=False, max_model_len=1024) as eng:
        return [eng.generate([p], greedy())[0] for p in PROMPTS]


def assert_same_greedy(solo_completion, ids: list[int], what: str) -> None:
    ref = solo_completion.token_ids
    assert len(ids) == len(ref), what
    for i, (a, b) in enumerate(zip(ref, ids)):
        if a != b:
            top = solo_completion.logprobs[i].top
            gap = top[0][3] - top[1][3]
            assert gap <= TIE, f"{what}: ids differ at {i} ({a} vs {b}) though the solo top-2 gap is {gap:.4f}"
            return


def test_batched_equals_solo(model_and_tokenizer, solo):
    # A small token budget: prefills are chunked and mixed with decodes in one forward.
    with make_engine(
        model_and_tokenizer, enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=1024
    ) as eng:
        batched = eng.generate(PROMPTS, greedy())
        assert eng.stats()["num_ticks"] > MAX_TOKENS + 1
    for i, (s, b) in enumerate(zip(solo, batched)):
        assert b.prompt_token_ids == s.prompt_token_ids
        assert_same_greedy(s, b.token_ids, f"prompt {i} batched")


def test_preemption_gives_the_solo_ids(model_and_tokenizer):
    # 5 blocks of 16 tokens; each request needs 3-4 blocks by its end (prompts of 5-19 tokens plus
    # 30 generated), so any two requests running together run out and the newest is preempted.
    # generate() submits all four before the first tick ends, so at least two always overlap.
    idx = [0, 2, 4, 6]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    with make_engine(model_and_tokenizer, enable_prefix_caching=False, max_model_len=1024) as eng:
        solo30 = [eng.generate([PROMPTS[i]], params)[0] for i in idx]
    with make_engine(
        model_and_tokenizer, enable_prefix_caching=False, kv_cache_tokens=80, max_num_seqs=4, max_model_len=1024
    ) as eng:
        out = eng.generate([PROMPTS[i] for i in idx], params)
        assert eng.stats()["num_preemptions"] > 0
        assert eng.stats()["kv_usage"] == 0.0
    for i, s, c in zip(idx, solo30, out):
        assert_same_greedy(s, c.token_ids, f"prompt {i} preempted")


def test_prefix_cache_hit_gives_the_cold_ids(model_and_tokenizer, solo):
    _, tok = model_and_tokenizer
    system = tok.encode(PROMPTS[7], add_special_tokens=True)  # 40+ tokens: a few full blocks
    tails = [tok.encode(" Also,", add_special_tokens=False), tok.encode(" However, the", add_special_tokens=False)]
    prompts = [system + t for t in tails]
    with make_engine(model_and_tokenizer, enable_prefix_caching=False, max_model_len=1024) as cold_eng:
        cold = [cold_eng.generate([p], greedy())[0] for p in prompts]
    with make_engine(model_and_tokenizer, enable_prefix_caching=True, max_model_len=1024) as eng:
        first = eng.generate([system], greedy())[0]
        warm = [eng.generate([p], greedy())[0] for p in prompts]
        assert eng.stats()["num_prefix_cache_hit_tokens"] >= 2 * 16 * (len(system) // 16)
    assert_same_greedy(solo[7], first.token_ids, "system prompt")
    for i, (c, w) in enumerate(zip(cold, warm)):
        assert_same_greedy(c, w.token_ids, f"prefix hit {i}")


def _batch(seqs, gen_rows: int | None = None, gen_seqs: int | None = None, generation_end: int | None = None):
    """A ForwardBatch of sequences (token ids, first position, block table), every row up to
    generation_end a logit row; the leading one-row sequences are its decodes."""
    import torch

    from engine.batch import ForwardBatch

    bs = 16
    ids, positions, slots, starts, ctx, tables = [], [], [], [0], [], []
    for tokens, start, table in seqs:
        for i, token in enumerate(tokens):
            pos = start + i
            ids.append(token)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + len(tokens))
        ctx.append(start + len(tokens))
        tables.append(table)
    width = max(len(table) for table in tables)
    tables = [table + [-1] * (width - len(table)) for table in tables]
    num_decodes = next((i for i, (tokens, _, _) in enumerate(seqs) if len(tokens) != 1), len(seqs))
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    logit_rows = list(range(len(ids) if generation_end is None else generation_end))
    return ForwardBatch(t(ids), t(positions), t(slots), t(starts), t(ctx), t(tables), t(logit_rows),
                        t(ctx), starts, ctx, num_decode_seqs=num_decodes, block_size=bs, gen_rows=gen_rows,
                        gen_seqs=gen_seqs, generation_end=generation_end)


@pytest.fixture(scope="module")
def quantized_model():
    """The default model with its products in row layouts (ENGINE_PACKED=0), whose routes differ by
    row count: its file's Q4/Q8_0 products through the C kernels' routes."""
    old = os.environ.get("ENGINE_PACKED")
    os.environ["ENGINE_PACKED"] = "0"
    try:
        return load_model(default_model_path())
    finally:
        if old is None:
            del os.environ["ENGINE_PACKED"]
        else:
            os.environ["ENGINE_PACKED"] = old


def test_packed_strips_give_rows_the_same_numbers_in_any_batch():
    """With the default model's products packed in strips (AVX2 and up), a decode row's logits are
    bit-equal alone, beside another decode and a prompt chunk, and, where the table keeps the strip
    route at 72 rows, inside 72 rows of one class, which on row layouts take another route. Where the
    table puts 72 rows on amx3 (AMX bf16) or blas (the dequantized weight: measured faster on AVX2),
    their rounding, not strip's: there the row equals itself in any other 72-row tick (its numbers
    follow its route, not its neighbours) and its solo run within the two routes' roundings (measured
    0.004 on logits up to ~20)."""
    import torch

    from cext import cpu

    if "avx2" not in cpu.features():
        pytest.skip("CPU lacks AVX2: Q4/Q8 layers keep their row layouts")
    model = load_model(default_model_path())
    assert model.head_proj.is_packed_strips and model.layers[0].gate_up_proj.is_packed_strips
    tables = [[0, 1, 2], [3, 4, 5]]

    def run(extra):
        cache = model.make_kv_cache(16, 16)
        model.forward(_batch([(list(range(1000, 1030)), 0, tables[0]), (list(range(2000, 2030)), 0, tables[1])]), cache)
        return model.forward(_batch([([1030], 30, tables[0])] + extra), cache)

    alone = run([])
    neighbours = [([2030], 30, tables[1]), (list(range(3000, 3010)), 0, [6])]
    beside = run(neighbours)
    merged = run(neighbours + [(list(range(4000, 4060)), 0, [9, 10, 11, 12])])
    assert torch.equal(beside[:1], alone)
    layers = [proj for layer in model.layers for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                          layer.down_proj)]
    if all(proj.route(72) == "strip" for proj in layers):
        assert torch.equal(merged[:1], alone)
    else:
        assert {proj.route(72) for proj in layers} <= {"strip", "amx3", "blas"}
        other = run([(list(range(5000, 5071)), 0, [9, 10, 11, 12, 13])])  # 72 rows again, other neighbours
        assert torch.equal(merged[:1], other[:1])
        # routes apart: int16 codes against split bfloat16 (amx3) or float32 (blas)
        torch.testing.assert_close(merged[:1], alone, atol=1e-2, rtol=0)


def test_decode_rows_bit_equal_as_verification_and_beside_embedding_rows(quantized_model):
    """The default model's logits of two decode rows are bit-equal as rows of speculative
    verification chunks (each row then attends as a decode row and takes the route of the
    two-sequence decode step), and a tick's generation rows (decodes and a prompt chunk) are
    unmoved by embedding rows after them."""
    import torch

    model = quantized_model
    prompts = [list(range(1000, 1030)), list(range(2000, 2030))]
    tables = [[0, 1, 2], [3, 4, 5]]
    follow = [list(range(1030, 1034)), list(range(2030, 2034))]

    def prefilled():
        cache = model.make_kv_cache(16, 16)
        model.forward(_batch([(p, 0, t) for p, t in zip(prompts, tables)]), cache)
        return cache

    cache = prefilled()
    steps = [model.forward(_batch([([f[i]], 30 + i, t) for f, t in zip(follow, tables)]), cache) for i in range(4)]
    # A 10-row prompt chunk beside the decodes, then with 60 rows of an embedding text after them
    # (generation_end: rows after it are embedding rows): the decode and prompt rows are unmoved.
    chunk = [(list(range(3000, 3010)), 0, [6])]  # 12 generation rows: the one-row route
    decodes = [([f[0]], 30, t) for f, t in zip(follow, tables)]
    cache = prefilled()
    without = model.forward(_batch(decodes + chunk), cache)
    cache = prefilled()
    embedding = [(list(range(4000, 4060)), 0, [9, 10, 11, 12])]
    with_text = model.forward(_batch(decodes + chunk + embedding, generation_end=12), cache)
    assert torch.equal(with_text, without)
    cache = prefilled()
    merged = model.forward(_batch(decodes + chunk + embedding), cache)  # all one class of prompt rows
    assert not torch.equal(merged[:12], without)  # the control: 72 rows of one class take another route
    cache = prefilled()
    verified = model.forward(_batch([(f, 30, t) for f, t in zip(follow, tables)], gen_rows=8, gen_seqs=2), cache)
    for i in range(4):
        assert torch.equal(verified[[i, 4 + i]], steps[i])
    cache = prefilled()
    plain = model.forward(_batch([(f, 30, t) for f, t in zip(follow, tables)]), cache)  # as prompt chunks
    assert not torch.equal(plain, verified)  # the prefill kernel and routes round otherwise (the control)


def test_ticks_write_their_logits_into_one_reused_map(quantized_model):
    """The engine's ticks write their logits into one map (engine.batch.LogitsBuffer): the same
    memory tick after tick while the batch keeps its rows, given back when a tick's logits are
    small (one prompt's row); the ids equal those of ticks that allocate their logits afresh."""
    from engine.batch import LogitsBuffer

    class Recording(LogitsBuffer):
        def __init__(self, min_bytes):
            super().__init__()
            self.MIN_BYTES = min_bytes
            self.taken = []  # (rows, data pointer or None) per tick

        def take(self, num_rows, num_cols):
            out = super().take(num_rows, num_cols)
            self.taken.append((num_rows, None if out is None else out.data_ptr()))
            return out

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokenizer = load_tokenizer(default_model_path())
    runs = {}
    for min_bytes in (1 << 20, 1 << 40):  # the engine's threshold; never a map
        with Engine(quantized_model, tokenizer) as eng:
            buffer = eng._core._logits_buffer = Recording(min_bytes)
            runs[min_bytes] = [c.token_ids for c in eng.generate(PROMPTS, params)]
            eight = [ptr for rows, ptr in buffer.taken if rows == len(PROMPTS)]
            if min_bytes == 1 << 20:  # 8 rows of 49,152 logits: 1.6 MB, mapped
                assert len(eight) >= MAX_TOKENS - 1 and len(set(eight)) == 1 and eight[0] is not None
                assert buffer.num_maps <= 2  # the batch's map (and one for a partial first tick)
                eng.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0))
                assert buffer.taken[-1] == (1, None) and buffer.capacity == 0  # one row: 197 KB, not mapped
            else:
                assert set(eight) == {None} and buffer.num_maps == 0
    assert runs[1 << 20] == runs[1 << 40]


def test_logits_buffer_keeps_its_map_within_a_quarter_of_its_rows():
    from engine.batch import LogitsBuffer

    buffer, cols = LogitsBuffer(), 1 << 16  # 256 KB a row
    first = buffer.take(16, cols)
    assert first.shape == (16, cols) and buffer.capacity == 16 and buffer.num_maps == 1
    assert buffer.take(5, cols).data_ptr() == first.data_ptr()  # 5 of 16 rows: the same map
    assert buffer.take(4, cols).shape == (4, cols) and buffer.capacity == 4  # a quarter: remapped smaller
    assert buffer.take(17, cols).shape == (17, cols) and buffer.num_maps == 3  # more rows: a larger map
    assert buffer.take(8, cols + 16).shape == (8, cols + 16) and buffer.num_maps == 4  # another width
    assert buffer.take(3, cols) is None and buffer.capacity == 0  # 768 KB: under MIN_BYTES, no map


def test_logits_buffer_trims_the_heap_before_each_new_map(monkeypatch):
    """The forward's freed activations go back to the OS before a new map's pages come in
    (engine.heap.release_free_heap); a reused map trims nothing."""
    import engine.batch as batch_module

    trims = []
    monkeypatch.setattr(batch_module, "release_free_heap", lambda: trims.append(1))
    buffer, cols = batch_module.LogitsBuffer(), 1 << 16
    buffer.take(16, cols)
    assert len(trims) == 1
    buffer.take(5, cols)  # the same map
    assert len(trims) == 1
    buffer.take(17, cols)  # a larger one
    assert len(trims) == 2 and buffer.num_maps == 2
    buffer.take(3, cols)  # no map at all
    assert len(trims) == 2
