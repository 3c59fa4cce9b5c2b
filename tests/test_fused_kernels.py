"""Each fused C kernel (cext.ops through engine.models.fused) against its torch reference
over random shapes: float32 and bfloat16, every instruction-set variant this CPU runs,
block tables with holes, contexts that are not multiples of the block size, GQA ratios,
sliding windows, strided query rows, one thread and the pool."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cext import cpu
from engine.models import fused

DTYPES = [torch.float32, torch.bfloat16]
BF16_RTOL = 2 ** -7  # one bfloat16 ulp: kernel and reference round float32 sums taken in another order


ALL_ISAS = ("baseline", "avx2", "avx512")


def _runnable_isas() -> list[str]:
    isas = []
    for name in ALL_ISAS:
        try:
            cpu.set_isa(name)
            isas.append(name)
        except ValueError:
            pass
    cpu.set_isa("auto")
    return isas


ISAS = _runnable_isas()


def use_isa(name: str) -> None:
    """Every variant is a test case; the ones this CPU lacks skip, saying so (their logic stays
    covered by the baseline variant, the scalar definition)."""
    if name not in ISAS:
        pytest.skip(f"CPU lacks {name}")
    cpu.set_isa(name)


# The isa/pooled fixtures set process state that holds for every generated example.
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    use_isa(request.param)
    yield request.param
    cpu.set_isa("auto")


@pytest.fixture
def pooled():
    """Two pool threads and no size threshold: every call with > 1 item is split."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_num_threads(2)
    cpu.set_parallel_threshold(0)
    yield
    cpu.set_num_threads(old_threads)
    cpu.set_parallel_threshold(old_threshold)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, atol: float = 1e-5) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=BF16_RTOL)


def _rand(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@SETTINGS
@given(num_rows=st.integers(1, 6), dim=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       has_delta=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_add_rmsnorm(isa, num_rows, dim, dtype, has_delta, seed):
    g = torch.Generator().manual_seed(seed)
    resid = _rand(g, num_rows, dim, scale=3.0)
    delta = _rand(g, num_rows, dim, dtype=dtype) if has_delta else None
    weight = _rand(g, dim, dtype=dtype)
    expected_resid = resid.clone()
    expected = fused.add_rmsnorm_reference(expected_resid, delta, weight, 1e-5)
    out = fused.add_rmsnorm(resid, delta, weight, 1e-5)
    assert out.dtype == dtype and out.shape == (num_rows, dim)
    torch.testing.assert_close(resid, expected_resid, atol=0, rtol=0)  # the same float32 additions
    _close(out, expected, dtype)


@SETTINGS
@given(num_rows=st.integers(1, 5), num_kv_heads=st.integers(1, 3), groups=st.integers(1, 4),
       half_dim=st.integers(1, 40), extra_cols=st.integers(0, 5), dtype=st.sampled_from(DTYPES),
       is_half_cache=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rope_kv_write(isa, num_rows, num_kv_heads, groups, half_dim, extra_cols, dtype, is_half_cache, seed):
    g = torch.Generator().manual_seed(seed)
    num_heads, head_dim = num_kv_heads * groups, 2 * half_dim
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _rand(g, num_rows, width + extra_cols, dtype=dtype)[:, :width]  # rows strided when extra_cols > 0
    num_positions, num_slots = 64, 3 * num_rows + 2
    cos, sin = _rand(g, num_positions, half_dim), _rand(g, num_positions, half_dim)
    positions = torch.randint(0, num_positions, (num_rows,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:num_rows]  # distinct, scattered over the cache
    cache_dtype = torch.float16 if is_half_cache else dtype  # float16 caches beside either activation dtype
    k_cache = _rand(g, num_slots, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = _rand(g, num_slots, num_kv_heads, head_dim, dtype=cache_dtype)
    ref = [qkv.clone(), k_cache.clone(), v_cache.clone()]
    fused.rope_kv_write_reference(ref[0], num_heads, num_kv_heads, head_dim, positions, cos, sin, slots,
                                  ref[1], ref[2])
    fused.rope_kv_write(qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin, slots, k_cache, v_cache)
    _close(qkv, ref[0], dtype)
    for actual, expected in zip((k_cache, v_cache), ref[1:]):  # untouched slots included
        if is_half_cache:  # the same float32 value rounded once to float16 on both sides
            torch.testing.assert_close(actual.float(), expected.float(), atol=1e-3, rtol=2 ** -10)
        else:
            _close(actual, expected, dtype)


@st.composite
def attention_cases(draw):
    num_seqs = draw(st.integers(1, 4))
    block_size = draw(st.integers(1, 8))
    lens = draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    max_blocks = max(-(-n // block_size) for n in lens) + draw(st.integers(0, 2))
    return dict(
        num_seqs=num_seqs, block_size=block_size, context_lens=lens, max_blocks=max_blocks,
        num_kv_heads=draw(st.integers(1, 3)), groups=draw(st.sampled_from([1, 2, 3, 4, 7])),
        head_dim=draw(st.sampled_from([1, 4, 8, 16, 24, 64])),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 40))),
        num_blocks=sum(-(-n // block_size) for n in lens) + draw(st.integers(0, 6)),
        q_extra_cols=draw(st.integers(0, 3)), is_half_cache=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2 ** 16)),
    )


def _attention_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype, bs = case["dtype"], case["block_size"]
    num_heads = case["num_kv_heads"] * case["groups"]
    D = case["head_dim"]
    # Each sequence owns distinct blocks scattered over the cache (unused blocks are holes);
    # the table is -1 padded past its context.
    free = torch.randperm(case["num_blocks"], generator=g).tolist()
    tables = torch.full((case["num_seqs"], case["max_blocks"]), -1, dtype=torch.int64)
    for b, n in enumerate(case["context_lens"]):
        need = -(-n // bs)
        tables[b, :need] = torch.tensor([free.pop() for _ in range(need)])
    cache_dtype = torch.float16 if case["is_half_cache"] else dtype
    k_cache = _rand(g, case["num_blocks"] * bs, case["num_kv_heads"], D, dtype=cache_dtype, scale=2.0)
    v_cache = _rand(g, case["num_blocks"] * bs, case["num_kv_heads"], D, dtype=cache_dtype)
    rows = _rand(g, case["num_seqs"], num_heads * D + case["q_extra_cols"], dtype=dtype)
    q = rows[:, : num_heads * D].view(case["num_seqs"], num_heads, D)  # [B, H, D], rows strided
    lens = torch.tensor(case["context_lens"], dtype=torch.int64)
    return q, k_cache, v_cache, tables, lens


def _check_attention(case):
    q, k_cache, v_cache, tables, lens = _attention_inputs(case)
    args = (q, k_cache, v_cache, tables, lens, case["block_size"], case["sliding_window"])
    out = fused.decode_attention(*args)
    _close(out, fused.decode_attention_reference(*args), case["dtype"], atol=1e-4)


@SETTINGS
@given(case=attention_cases())
def test_decode_attention(isa, case):
    _check_attention(case)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=attention_cases())
def test_decode_attention_split_across_pool_threads(pooled, case):
    _check_attention(case)


@SETTINGS
@given(num_rows=st.integers(1, 5), inter=st.integers(1, 1100), scale=st.sampled_from([1.0, 10.0, 60.0]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_silu_mul(isa, num_rows, inter, scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = _rand(g, num_rows, 2 * inter, dtype=dtype, scale=scale)  # large |gate|: exp over/underflow
    _close(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up), dtype, atol=1e-5 * scale)


@SETTINGS
@given(num_rows=st.integers(1, 5), inter=st.integers(1, 1100), scale=st.sampled_from([1.0, 10.0, 60.0]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_gelu_tanh_mul(isa, num_rows, inter, scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = _rand(g, num_rows, 2 * inter, dtype=dtype, scale=scale)
    _close(fused.glu_mul(gate_up, "gelu_tanh"), fused.glu_mul_reference(gate_up, "gelu_tanh"), dtype,
           atol=1e-5 * scale)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_mul_value_bits_do_not_depend_on_the_column(isa, act):
    """The vector loop (8 lanes) and the scalar tail compute the same operations: a gate/up pair gives
    the same bits in a lane as in the tail (a row of 8 m + 7 values, rotated through every offset)."""
    g = torch.Generator().manual_seed(3)
    inter = 8 * 64 + 7
    gate = torch.randn(inter, generator=g) * torch.logspace(-3, 2, inter)
    gate[:4] = torch.tensor([88.5, -87.5, 30.0, -30.0])
    up = torch.randn(inter, generator=g)
    base = fused.glu_mul(torch.cat([gate, up])[None], act)[0].clone()
    for shift in range(1, 8):
        rotated = fused.glu_mul(torch.cat([gate.roll(shift), up.roll(shift)])[None], act)[0]
        assert torch.equal(rotated.roll(-shift).view(torch.int32), base.view(torch.int32)), shift


@SETTINGS
@given(num_rows=st.integers(1, 5), heads=st.integers(1, 5), dim=st.integers(1, 300), extra=st.integers(0, 9),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_rmsnorm_rows_in_place_and_out(isa, num_rows, heads, dim, extra, scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = _rand(g, num_rows, heads * dim + extra, dtype=dtype, scale=scale)  # columns past the pieces: untouched
    weight = _rand(g, dim, dtype=dtype)
    expected = fused.rmsnorm_rows_reference(x, weight, 1e-6, heads)
    _close(fused.rmsnorm_rows(x, weight, 1e-6, heads), expected, dtype)
    inplace = x.clone()
    fused.rmsnorm_rows(inplace, weight, 1e-6, heads, out=inplace)
    _close(inplace[:, : heads * dim], expected, dtype)
    assert torch.equal(inplace[:, heads * dim:], x[:, heads * dim:])


def test_row_kernels_split_across_pool_threads(pooled):
    g = torch.Generator().manual_seed(0)
    resid = _rand(g, 9, 70)
    delta, weight = _rand(g, 9, 70), _rand(g, 70)
    expected_resid = resid.clone()
    expected = fused.add_rmsnorm_reference(expected_resid, delta, weight, 1e-6)
    _close(fused.add_rmsnorm(resid, delta, weight, 1e-6), expected, torch.float32)
    gate_up = _rand(g, 7, 2 * 600, dtype=torch.bfloat16)
    _close(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up), torch.bfloat16)
    _close(fused.glu_mul(gate_up, "gelu_tanh"), fused.glu_mul_reference(gate_up, "gelu_tanh"), torch.bfloat16)
    qkv, weight = _rand(g, 9, 5 * 64 + 3), _rand(g, 64)
    _close(fused.rmsnorm_rows(qkv, weight, 1e-6, 5), fused.rmsnorm_rows_reference(qkv, weight, 1e-6, 5),
           torch.float32)


def test_bad_indices_raise_instead_of_reading_outside_the_cache():
    case = dict(num_seqs=2, block_size=4, context_lens=[5, 9], max_blocks=3, num_kv_heads=1, groups=2,
                head_dim=8, sliding_window=None, num_blocks=6, q_extra_cols=0, is_half_cache=False,
                dtype=torch.float32, seed=0)
    q, k_cache, v_cache, tables, lens = _attention_inputs(case)
    holed = tables.clone()
    holed[1, 1] = -1  # a hole inside the context
    with pytest.raises(IndexError, match="block table"):
        fused.decode_attention(q, k_cache, v_cache, holed, lens, 4)
    holed[1, 1] = 6  # past the cache
    with pytest.raises(IndexError, match="block table"):
        fused.decode_attention(q, k_cache, v_cache, holed, lens, 4)
    with pytest.raises(IndexError, match="context length"):
        fused.decode_attention(q, k_cache, v_cache, tables, torch.tensor([5, 13]), 4)
    # A sliding window skips the blocks it does not reach: a hole there is fine.
    windowed = tables.clone()
    windowed[1, 0] = -1
    fused.decode_attention(q, k_cache, v_cache, windowed, lens, 4, sliding_window=4)
    qkv = torch.zeros(1, 4 * 8)
    cos = sin = torch.zeros(10, 4)
    kc = vc = torch.zeros(24, 1, 8)
    with pytest.raises(IndexError, match="slot"):
        fused.rope_kv_write(qkv, 2, 1, 8, torch.tensor([0]), cos, sin, torch.tensor([24]), kc, vc)
    with pytest.raises(IndexError, match="position"):
        fused.rope_kv_write(qkv, 2, 1, 8, torch.tensor([10]), cos, sin, torch.tensor([0]), kc, vc)


def test_wrong_dtypes_and_layouts_are_value_errors():
    with pytest.raises(ValueError, match="dtype"):
        fused.silu_mul(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="gate_up"):
        fused.silu_mul(torch.zeros(4, 2).t())
    with pytest.raises(ValueError, match="resid"):
        fused.add_rmsnorm(torch.zeros(2, 4, dtype=torch.bfloat16), None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="act"):
        fused.glu_mul(torch.zeros(2, 4), "relu")
    with pytest.raises(ValueError, match="weight"):
        fused.rmsnorm_rows(torch.zeros(2, 8), torch.ones(4, dtype=torch.bfloat16), 1e-5, 2)
    with pytest.raises(ValueError, match="x: rows"):
        fused.rmsnorm_rows(torch.zeros(2, 7), torch.ones(4), 1e-5, 2)


def test_isa_selection_names_what_runs():
    assert cpu.get_isa() in ISAS
    assert "baseline" in ISAS
    with pytest.raises(ValueError, match="isa"):
        cpu.set_isa("sse9")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_attention_over_many_spans(isa, data):
    """Contexts of several hundred keys on one thread: the vector path scores FK_SPAN (256)
    keys per online-softmax step across blocks, so spans end mid-block and groups (7) are not
    multiples of its 3-group tiles."""
    block_size = data.draw(st.sampled_from([1, 5, 16]))
    lens = data.draw(st.lists(st.integers(200, 700), min_size=1, max_size=2))
    case = dict(num_seqs=len(lens), block_size=block_size, context_lens=lens,
                max_blocks=max(-(-n // block_size) for n in lens), num_kv_heads=data.draw(st.integers(1, 2)),
                groups=data.draw(st.sampled_from([1, 3, 4, 7])), head_dim=data.draw(st.sampled_from([8, 64, 128])),
                sliding_window=data.draw(st.one_of(st.none(), st.integers(1, 600))),
                num_blocks=sum(-(-n // block_size) for n in lens) + 2, q_extra_cols=data.draw(st.integers(0, 3)),
                is_half_cache=data.draw(st.booleans()), dtype=data.draw(st.sampled_from(DTYPES)),
                seed=data.draw(st.integers(0, 2 ** 16)))
    _check_attention(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,sliding_window", [([300], None), ([257, 90], None), ([500], 200), ([1000], None)])
def test_long_context_splits_keys_across_threads(pooled, dtype, lens, sliding_window):
    """Few (sequence, kv head) pairs and long contexts: each pair's keys are split over the
    threads and the partial softmaxes merged."""
    max_blocks = max(-(-n // 16) for n in lens)
    case = dict(num_seqs=len(lens), block_size=16, context_lens=lens, max_blocks=max_blocks, num_kv_heads=1,
                groups=3, head_dim=64, sliding_window=sliding_window, num_blocks=sum(-(-n // 16) for n in lens) + 3,
                q_extra_cols=0, is_half_cache=dtype == torch.float32, dtype=dtype, seed=len(lens))
    _check_attention(case)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_attention_row_same_bits_alone_in_any_batch_on_any_threads(pooled, data):
    """A row's keys are cut into ranges by its own context alone (FK_SPLIT_KEYS): its output is the
    same bits alone or beside rows of other lengths, on one pool thread or two. (The cut once
    depended on the batch's size and the thread count: a stream's numbers changed with its neighbours.)"""
    lens = data.draw(st.lists(st.integers(1, 900), min_size=2, max_size=5))
    block_size = data.draw(st.sampled_from([1, 16]))
    case = dict(num_seqs=len(lens), block_size=block_size, context_lens=lens,
                max_blocks=max(-(-n // block_size) for n in lens), num_kv_heads=data.draw(st.sampled_from([1, 3])),
                groups=data.draw(st.sampled_from([1, 3])), head_dim=64,
                sliding_window=data.draw(st.one_of(st.none(), st.integers(100, 600))),
                num_blocks=sum(-(-n // block_size) for n in lens) + 2, q_extra_cols=0,
                is_half_cache=data.draw(st.booleans()), dtype=data.draw(st.sampled_from(DTYPES)),
                seed=data.draw(st.integers(0, 2 ** 16)))
    q, k_cache, v_cache, tables, lens_t = _attention_inputs(case)
    window = case["sliding_window"]
    batched = fused.decode_attention(q, k_cache, v_cache, tables, lens_t, block_size, window)
    for threads in (1, 2):
        cpu.set_num_threads(threads)
        for b in range(len(lens)):
            alone = fused.decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], lens_t[b:b + 1],
                                           block_size, window)
            assert torch.equal(alone[0], batched[b]), (threads, b, lens)
