"""The prefill attention kernel (cext.ops.prefill_attention through engine.models.fused)
against the exact float64 reference: random block tables with holes, several sequences per
call, GQA groups, head_dim 64 / 128 (and odd sizes the kernel pads), float32 / bfloat16 /
float16 caches, float32 and bfloat16 activations, sliding windows, strided query rows,
arbitrary row positions, every instruction-set variant this CPU runs (with AMX-BF16 also the
tiles' variant, within its own bound), one thread and the pool; and the model's attention plan
(decode and prefill rows in one batch) fused vs torch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cext import cpu as cfused
from cext import ops
from engine.batch import ForwardBatch
from engine.models import fused
from engine.models.attention import paged_attention, plan_attention


def _runnable_isas() -> list[str]:
    isas = []
    for name in ("baseline", "avx2", "avx512"):
        try:
            cfused.set_isa(name)
            isas.append(name)
        except ValueError:
            pass
    cfused.set_isa("auto")
    if "avx512" in isas and "amx_bf16" in cfused.features():
        isas.append("amx")  # AVX-512 with the products on AMX-BF16 tiles (prefill_attention_amx.h)
    return isas


ISAS = _runnable_isas()
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# float32 kernel vs the float64 reference: float32 sums of a few thousand terms of |x| <= ~10.
FLOAT32_TOL = dict(atol=2e-5, rtol=1e-5)
BF16_TOL = dict(atol=1e-5, rtol=2 ** -8)  # outputs rounded once to bfloat16 (half an ulp), and float32 sums


def test_isas_this_machine_runs():
    print(f"prefill attention routes tested: {ISAS} (the others are absent on this CPU)")
    assert "baseline" in ISAS


@pytest.fixture(params=ISAS)
def isa(request):
    cfused.set_isa("avx512" if request.param == "amx" else request.param)
    old = ops.set_prefill_amx(request.param == "amx")
    yield request.param
    ops.set_prefill_amx(old)
    cfused.set_isa("auto")


def _amx_active() -> bool:
    """Whether prefill_attention runs its AMX variant now (the CPU has it, the switch is on)."""
    enabled = ops.set_prefill_amx(True)
    ops.set_prefill_amx(enabled)
    return enabled and "amx_bf16" in cfused.features() and cfused.get_isa() == "avx512"


def _amx_bound(q, k_cache, v_cache, block_tables, query_starts, context_lens, positions, block_size,
               sliding_window=None) -> torch.Tensor:
    """The AMX variant's error bound per output [T, H * D]: each score within 2^-15 of
    scale * sum_d |q_d| |k_d| (every operand split into two bfloat16 keeps 16 bits, and the dropped
    ql . kl is below 2^-16 of each term) and each probability within 2^-16, so an output is within
    (2 max|dS| + 2^-15) max|v| over the row's keys; twice that, plus float32's tolerance."""
    num_rows, num_heads, head_dim = q.shape
    groups = num_heads // k_cache.shape[1]
    bound = torch.zeros(num_rows, num_heads, head_dim, dtype=torch.float64)
    for b in range(query_starts.shape[0] - 1):
        start, stop, length = int(query_starts[b]), int(query_starts[b + 1]), int(context_lens[b])
        if stop == start:
            continue
        pos = torch.arange(length)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].double().abs().repeat_interleave(groups, dim=1)  # [C, H, D]
        v = v_cache[slots].double().abs().amax(-1).repeat_interleave(groups, dim=1)  # [C, H]
        rows = positions[start:stop, None]
        allowed = pos[None, :] <= rows  # [R, C]
        if sliding_window:
            allowed &= pos[None, :] > rows - sliding_window
        magnitude = torch.einsum("rhd,chd->rhc", q[start:stop].double().abs(), k) / head_dim ** 0.5
        magnitude = magnitude.masked_fill(~allowed[:, None, :], 0).amax(-1)  # [R, H]
        v_max = v.T[None].expand(stop - start, -1, -1).masked_fill(~allowed[:, None, :], 0).amax(-1)
        bound[start:stop] = ((2 * 2.0 ** -15 * magnitude + 2.0 ** -15) * v_max)[..., None]
    return 2 * bound.reshape(num_rows, num_heads * head_dim)


@pytest.fixture
def pooled():
    """Two pool threads and no size threshold: every call with > 1 item is split."""
    old_threads, old_threshold = cfused.get_num_threads(), cfused.get_parallel_threshold()
    cfused.set_num_threads(2)
    cfused.set_parallel_threshold(0)
    yield
    cfused.set_num_threads(old_threads)
    cfused.set_parallel_threshold(old_threshold)


@st.composite
def prefill_cases(draw, max_len: int = 300, head_dims=(64, 128, 8, 36, 6)):
    num_seqs = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([1, 5, 16]))
    lens = draw(st.lists(st.integers(1, max_len), min_size=num_seqs, max_size=num_seqs))
    # rows of each sequence: a chunk ending at its context (the scheduler's case) or, sometimes,
    # arbitrary positions inside it
    rows = [draw(st.integers(0, min(n, 150))) for n in lens]
    return dict(
        block_size=block_size, context_lens=lens, num_rows=rows,
        is_scattered=draw(st.integers(0, 4)) == 0, num_kv_heads=draw(st.integers(1, 3)),
        groups=draw(st.sampled_from([1, 2, 3, 7])), head_dim=draw(st.sampled_from(head_dims)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, max_len))),
        extra_blocks=draw(st.integers(0, 5)), q_extra_cols=draw(st.integers(0, 3)),
        cache_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2 ** 16)),
    )


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    bs, lens, D = case["block_size"], case["context_lens"], case["head_dim"]
    num_kv, num_heads = case["num_kv_heads"], case["num_kv_heads"] * case["groups"]
    num_blocks = sum(-(-n // bs) for n in lens) + case["extra_blocks"]
    max_blocks = max(-(-n // bs) for n in lens) + 1
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, unused ones are holes
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int64)
    starts, positions = [0], []
    for b, n in enumerate(lens):
        need = -(-n // bs)
        tables[b, :need] = torch.tensor([free.pop() for _ in range(need)])
        r = case["num_rows"][b]
        if case["is_scattered"]:
            positions += torch.randint(0, n, (r,), generator=g).tolist()
        else:
            positions += list(range(n - r, n))
        starts.append(starts[-1] + r)
    k_cache = (torch.randn(num_blocks * bs, num_kv, D, generator=g) * 2).to(case["cache_dtype"])
    v_cache = torch.randn(num_blocks * bs, num_kv, D, generator=g).to(case["cache_dtype"])
    num_rows = starts[-1]
    rows = torch.randn(num_rows, num_heads * D + case["q_extra_cols"], generator=g).to(case["dtype"])
    q = rows[:, : num_heads * D].view(num_rows, num_heads, D)  # [T, H, D], rows strided
    return (q, k_cache, v_cache, tables, torch.tensor(starts), torch.tensor(lens), torch.tensor(positions,
            dtype=torch.int64), bs, case["sliding_window"])


def _assert_plan_close(out, expected, args, tiles):
    """The fused plan's output against the reference plan's (float32 SDPA): float32's tolerance,
    plus the AMX variant's bound where the plan let it run (tiles) and it did."""
    if tiles and _amx_active():
        bound = _amx_bound(*args).view(out.shape) + 2e-5 + 1e-5 * expected.abs().double()
        assert ((out.double() - expected.double()).abs() <= bound).all()
        return
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def _check(case):
    args = _inputs(case)
    out = fused.prefill_attention(*args)
    expected = fused.prefill_attention_reference(*args)  # float64
    tol = FLOAT32_TOL if case["dtype"] == torch.float32 else BF16_TOL
    assert out.dtype == case["dtype"]
    if _amx_active():
        err = (out.double() - expected).abs()
        bound = _amx_bound(*args) + tol["atol"] + tol["rtol"] * expected.abs()
        assert (err <= bound).all(), (err / bound).max()
        return
    torch.testing.assert_close(out.double(), expected, **tol)


@SETTINGS
@given(case=prefill_cases())
def test_prefill_attention_matches_float64(isa, case):
    _check(case)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=prefill_cases())
def test_prefill_attention_split_across_pool_threads(pooled, case):
    _check(case)


def test_calls_without_tiles_keep_the_float32_products(isa):
    """tiles=False (the models whose own products are float32) runs the AVX-512 kernel whatever the
    CPU has: the same bits as with the AMX variant switched off."""
    case = dict(block_size=16, context_lens=[300], num_rows=[100], is_scattered=False, num_kv_heads=2, groups=3,
                head_dim=64, sliding_window=None, extra_blocks=2, q_extra_cols=1, cache_dtype=torch.float16,
                dtype=torch.float32, seed=9)
    args = _inputs(case)
    untiled = fused.prefill_attention(*args, tiles=False)
    old = ops.set_prefill_amx(False)
    try:
        assert torch.equal(untiled, fused.prefill_attention(*args))
    finally:
        ops.set_prefill_amx(old)


def test_every_split_term_counts(isa):
    """Values whose bfloat16 roundings all lean one way (1 + 3 2^-10 rounds to 1, leaving 2^-8.4
    in the low part), so errors add up instead of cancelling: one query over two keys, 1.5 and
    1 times a row of those values (scores ~1.5 and ~1, so the second key's probability e^-0.5 is
    not a bfloat16), with values zero and a row of those values. An AMX variant that dropped any of
    qh.kl, ql.kh, ph.vl, pl.vh would land 1.4-4.5x past its bound (each checked by removing it);
    the float32 kernels are exact here to 1e-6."""
    lean = 1 + 3 * 2.0 ** -10
    D = 64
    k_cache = torch.full((2, 1, D), lean)
    k_cache[0] *= 1.5
    v_cache = torch.zeros(2, 1, D)
    v_cache[1] = lean
    q = torch.full((1, 1, D), lean / 8)  # scale 1/8: scores 1.5 lean^2 and lean^2
    args = (q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([0, 1]), torch.tensor([2]),
            torch.tensor([1]), 1, None)
    out = fused.prefill_attention(*args).double()
    expected = fused.prefill_attention_reference(*args)
    bound = _amx_bound(*args) if _amx_active() else torch.zeros_like(expected)
    assert ((out - expected).abs() <= bound + 1e-6).all(), (out - expected).abs().max()


@pytest.mark.parametrize("head_dim,groups,cache_dtype,window", [
    (64, 3, torch.float16, None), (128, 7, torch.float32, None), (64, 7, torch.float16, 700),
    (128, 1, torch.bfloat16, 100),
])
def test_last_chunk_of_a_long_prompt(isa, head_dim, groups, cache_dtype, window):
    """A 256-row chunk at the end of a 2,000-token context (many spans, masked diagonal tiles)."""
    case = dict(block_size=16, context_lens=[2000], num_rows=[256], is_scattered=False, num_kv_heads=2,
                groups=groups, head_dim=head_dim, sliding_window=window, extra_blocks=3, q_extra_cols=0,
                cache_dtype=cache_dtype, dtype=torch.float32, seed=head_dim + groups)
    _check(case)


@pytest.mark.parametrize("tiles", [False, True])
def test_mixed_decode_and_prefill_batch_fused_vs_torch_plan(pooled, tiles):
    """One tick's batch: 2 decode rows, a prompt chunk over earlier context and a whole short
    prompt; the fused plan (decode kernel + prefill kernel) against the reference plan (SDPA)."""
    g = torch.Generator().manual_seed(3)
    bs, H, KH, D = 16, 6, 2, 64
    lens = [40, 75, 300, 37]  # decode, decode, chunk of 120 rows at 180..299, whole prompt of 37
    rows = [1, 1, 120, 37]
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((4, 20), -1, dtype=torch.int64)
    positions, slots = [], []
    for b, n in enumerate(lens):
        need = -(-n // bs)
        tables[b, :need] = torch.tensor([free.pop() for _ in range(need)])
        for p in range(n - rows[b], n):
            positions.append(p)
            slots.append(int(tables[b, p // bs]) * bs + p % bs)
    starts = [0, 1, 2, 122, 159]
    T = starts[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_starts=torch.tensor(starts), context_lens=torch.tensor(lens), block_tables=tables,
        logit_rows=torch.tensor([0, 1, 121, 158]), prompt_lens=torch.tensor(lens), query_starts_list=starts,
        context_lens_list=lens, num_decode_seqs=2, block_size=bs)
    k_cache = torch.randn(num_blocks * bs, KH, D, generator=g)
    v_cache = torch.randn(num_blocks * bs, KH, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    k, v = k_cache[batch.slot_mapping], v_cache[batch.slot_mapping]  # the new rows, already in the cache
    for window in (None, 50):
        fused_plan = plan_attention(batch, window, torch.float32, is_fused=True, tiles=tiles)
        assert fused_plan.num_prefill_seqs == 2 and not fused_plan.prefills
        out = paged_attention(q, k, v, k_cache, v_cache, fused_plan)
        expected = paged_attention(q, k, v, k_cache, v_cache, plan_attention(batch, window, torch.float32))
        _assert_plan_close(out, expected, (q, k_cache, v_cache, tables, batch.query_starts, batch.context_lens,
                                           batch.positions, bs, window), tiles)


SMALL_CASE = dict(block_size=4, context_lens=[5, 9], num_rows=[2, 3], is_scattered=False, num_kv_heads=1,
                  groups=2, head_dim=8, sliding_window=None, extra_blocks=0, q_extra_cols=0,
                  cache_dtype=torch.float32, dtype=torch.float32, seed=0)


def _small_call(**overrides):
    args = list(_inputs(SMALL_CASE))
    names = ["q", "k_cache", "v_cache", "block_tables", "query_starts", "context_lens", "positions"]
    for key, value in overrides.items():
        args[names.index(key)] = value
    return fused.prefill_attention(*args)


def test_bad_indices_raise_instead_of_reading_outside_the_cache():
    tables = _inputs(SMALL_CASE)[3]
    _small_call()
    holed = tables.clone()
    holed[1, 1] = -1  # a hole inside the context
    with pytest.raises(IndexError, match="block table"):
        _small_call(block_tables=holed)
    holed[1, 1] = 5  # past the cache (5 blocks)
    with pytest.raises(IndexError, match="block table"):
        _small_call(block_tables=holed)
    with pytest.raises(IndexError, match="position"):  # a row past its context
        _small_call(positions=torch.tensor([3, 5, 6, 7, 8]))
    with pytest.raises(IndexError, match="position"):  # a row before position 0
        _small_call(positions=torch.tensor([3, 4, -1, 7, 8]))
    with pytest.raises(IndexError, match="out of order"):  # sequences' rows overlapping
        _small_call(query_starts=torch.tensor([0, 3, 2]))
    with pytest.raises(IndexError, match="position"):  # rows past the batch
        _small_call(query_starts=torch.tensor([0, 2, 6]))
    with pytest.raises(IndexError, match="context length"):  # longer than the block table
        _small_call(context_lens=torch.tensor([5, 17]))
    with pytest.raises(ValueError, match="positions"):
        _small_call(positions=torch.tensor([3, 4, 6, 7, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        _small_call(q=torch.zeros(5, 2, 8, dtype=torch.float16))


@pytest.mark.parametrize("tiles", [False, True])
def test_whole_prompts_take_the_kernel_and_match_float64(pooled, tiles):
    """A batch of whole prompts only (no earlier context, no decode rows): the fused plan gives
    them to the kernel (not SDPA), and its output is the float64 causal attention."""
    g = torch.Generator().manual_seed(4)
    bs, H, KH, D = 16, 6, 2, 64
    lens = [333, 70]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((2, 22), -1, dtype=torch.int64)
    positions, slots = [], []
    for b, n in enumerate(lens):
        tables[b, :-(-n // bs)] = torch.tensor([free.pop() for _ in range(-(-n // bs))])
        positions += list(range(n))
        slots += [int(tables[b, p // bs]) * bs + p % bs for p in range(n)]
    starts = [0, lens[0], sum(lens)]
    T = starts[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), query_starts=torch.tensor(starts), context_lens=torch.tensor(lens),
        block_tables=tables, logit_rows=torch.tensor([starts[1] - 1, T - 1]), prompt_lens=torch.tensor(lens),
        query_starts_list=starts, context_lens_list=lens, num_decode_seqs=0, block_size=bs)
    k_cache = torch.randn(num_blocks * bs, KH, D, generator=g)
    v_cache = torch.randn(num_blocks * bs, KH, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    k, v = k_cache[batch.slot_mapping], v_cache[batch.slot_mapping]
    for window in (None, 50):
        plan = plan_attention(batch, window, torch.float32, is_fused=True, tiles=tiles)
        assert plan.num_prefill_seqs == 2 and not plan.prefills
        out = paged_attention(q, k, v, k_cache, v_cache, plan)
        args = (q, k_cache, v_cache, tables, torch.tensor(starts), torch.tensor(lens), torch.tensor(positions), bs,
                window)
        _assert_plan_close(out.double(), fused.prefill_attention_reference(*args), args, tiles)
        assert torch.equal(out, fused.prefill_attention(*args, tiles=tiles))  # the plan passes tiles on
