"""The quantized products of cext/csrc/qgemm.c (through engine.models.linear.Linear) against a
torch emulation of their definition: x quantized to int16 codes per block of 32 (scale max|x| / 32767,
round half to even), integer dot products with the 4- or 8-bit codes (int8 with a scale per block of 32), the Q4 min term taken
with the exact block sums of x. Every instruction-set variant this CPU runs, one thread and
the pool, float32 and bfloat16 activations, fp16 and float32 Q4 scales; and the layout's
round trip and the exact (dequantized) product."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cext import fused as cfused
from engine.models.linear import GROUP_SIZE, KERNEL_MAX_ROWS, Int4Weight, Int8Weight, Linear, blocks_to_int4
from test_fused_kernels import ISAS

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=[(isa, threads) for isa in ISAS for threads in (1, 2)], ids=lambda p: f"{p[0]}-{p[1]}t")
def variant(request):
    isa, threads = request.param
    old_threads, old_threshold = cfused.get_num_threads(), cfused.get_parallel_threshold()
    cfused.set_isa(isa)
    cfused.set_num_threads(threads)
    cfused.set_parallel_threshold(0)  # with 2 threads every call is split
    yield request.param
    cfused.set_isa("auto")
    cfused.set_num_threads(old_threads)
    cfused.set_parallel_threshold(old_threshold)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (codes [M, K/32, 32] float64, scales [M, K/32] float64, exact block sums)."""
    blocks = x.float().reshape(x.shape[0], -1, GROUP_SIZE)  # [M, K/32, 32]
    amax = blocks.abs().amax(-1)  # [M, K/32]
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv[..., None])  # half to even, as nearbyintf
    return codes.double(), (amax / 32767).double(), blocks.sum(-1).double()


def emulate_int4(x: torch.Tensor, weight: Int4Weight, half: bool) -> torch.Tensor:
    codes, dx, sx = quantize_activations(x)
    num_rows, num_cols = weight.shape
    q = weight.codes.reshape(num_rows, -1, GROUP_SIZE).double()  # [N, K/32, 32]
    scales, mins = (weight.scales.half().double(), weight.mins.half().double()) if half else (
        weight.scales.double(), weight.mins.double())
    dots = torch.einsum("mbj,nbj->mnb", codes, q)  # [M, N, K/32] integers
    return (dots * dx[:, None] * scales[None] + sx[:, None] * mins[None]).sum(-1)  # [M, N]


def emulate_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    codes, dx, _ = quantize_activations(x)
    q = weight.codes.reshape(weight.codes.shape[0], -1, GROUP_SIZE).double()
    dots = torch.einsum("mbj,nbj->mnb", codes, q)  # [M, N, K/32]
    return (dots * dx[:, None] * weight.scales.double()[None]).sum(-1)


def _inputs(seed, num_rows, num_out, num_cols, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_out, num_cols, generator=gen) * 0.05
    x = torch.randn(num_rows, num_cols, generator=gen).to(dtype)
    x[0, :GROUP_SIZE] = 0  # an all-zero block: scale 0, codes 0
    bias = torch.randn(num_out, generator=gen)
    return w, x, bias


def _check(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=rtol)


@SETTINGS
@given(num_rows=st.integers(1, KERNEL_MAX_ROWS), num_out=st.integers(1, 37), groups=st.sampled_from([2, 4, 18]),
       half=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_int4_product_matches_its_definition(variant, num_rows, num_out, groups, half, dtype, seed):
    w, x, bias = _inputs(seed, num_rows, num_out, GROUP_SIZE * groups, dtype)
    weight = Int4Weight.from_dense(w)
    if half:  # scales and mins that fp16 holds exactly, as Q4_0/Q4_1 files give
        weight = Int4Weight(weight.packed, weight.scales.half().float(), weight.mins.half().float())
    linear = Linear(weight, bias)
    assert linear._half == half
    y = linear(x)
    assert y.dtype == dtype and y.shape == (num_rows, num_out)
    _check(y, emulate_int4(x, weight, half) + bias.double(), dtype)


@SETTINGS
@given(num_rows=st.integers(1, KERNEL_MAX_ROWS), num_out=st.integers(1, 37), groups=st.sampled_from([1, 3, 18]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_int8_product_matches_its_definition(variant, num_rows, num_out, groups, dtype, seed):
    w, x, bias = _inputs(seed, num_rows, num_out, GROUP_SIZE * groups, dtype)
    weight = Int8Weight.from_dense(w)
    y = Linear(weight, bias)(x)
    _check(y, emulate_int8(x, weight) + bias.double(), dtype)


def test_strided_activation_rows():
    w, x, _ = _inputs(3, 6, 10, 128, torch.float32)
    wide = torch.cat((x, torch.randn(6, 32)), dim=1)[:, :128]  # row stride 160
    linear = Linear(Int4Weight.from_dense(w))
    torch.testing.assert_close(linear(wide), linear(x.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("half", [False, True])
def test_layout_round_trip_and_dequantize(half):
    weight = Int4Weight.from_dense(torch.randn(12, 192))
    if half:
        weight = Int4Weight(weight.packed, weight.scales.half().float(), weight.mins.half().float())
    back = blocks_to_int4(weight.blocks(half), 192, half)
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.scales, weight.scales)
    assert torch.equal(back.mins, weight.mins)
    torch.testing.assert_close(Linear(weight).dequantize(), weight.dequantize(), atol=0, rtol=0)


def test_exact_mode_and_rows_beyond_the_kernels_use_the_dequantized_weight():
    w, x, bias = _inputs(5, 40, 24, 96, torch.float32)  # 40 rows: above KERNEL_MAX_ROWS; K = 96: no pair layout
    for weight in (Int4Weight.from_dense(w), Int8Weight.from_dense(w)):
        exact = x.double() @ weight.dequantize().double().T + bias.double()
        torch.testing.assert_close(Linear(weight, bias)(x).double(), exact, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(Linear(weight, bias, quantized_dtype=torch.float32)(x[:2]).double(), exact[:2],
                                   atol=1e-4, rtol=1e-5)


def test_bad_width_is_an_error_not_a_read_past_the_row():
    with pytest.raises(IndexError, match="multiple of 32"):
        cfused.q8_matmul(0, 0, 1, 48, 0, 0, 1, 0, 0, 1, cfused.FLOAT32)
    with pytest.raises(ValueError, match="multiple of 64"):
        Int4Weight.from_dense(torch.randn(2, 96)).blocks()
