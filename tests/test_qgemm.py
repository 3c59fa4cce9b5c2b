"""The quantized products of cext/csrc/qgemm.c (through engine.models.linear.Linear) against
their definitions. The integer path (fewer rows than qgemm.get_float_rows()): x quantized to
int16 codes per block of 32 (scale max|x| / 32767, round half to even), integer dot products
with the 4-, 5- or 8-bit codes (int8 with a scale per block of 32), the Q4 min term taken with
the exact block sums of x, emulated in torch. The float path (AVX2, from get_float_rows() rows):
the float32 product of the dequantized weights, against float64. Every instruction-set variant
this CPU runs, one thread and the pool, both paths, float32 and bfloat16 activations, fp16 and
float32 Q4 scales; and the layout's round trip and the exact (dequantized) product."""
from __future__ import annotations

import itertools
import platform
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_fused_kernels import ALL_ISAS, use_isa

from cext import cpu, qgemm
from engine.models import linear as linear_module
from engine.models.linear import INT_KERNEL_MAX_ROWS, KERNEL_MAX_ROWS, Linear
from engine.models.quant import GROUP_SIZE, Int4Weight, Int5Weight, Int8Weight, blocks_to_int4, cat_rows

MAX_TEST_ROWS = min(KERNEL_MAX_ROWS, 40)  # both paths' tiles and their ragged tails
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def row_layouts(monkeypatch):
    """Q4 layers keep their row layout (every route runs them) unless a test packs them itself
    (``packed`` below: QG_PACKED strips, which only the strip route reads)."""
    monkeypatch.setenv("ENGINE_PACKED", "0")


@pytest.fixture(params=[(isa, threads) for isa in ALL_ISAS for threads in (1, 2)],
                ids=lambda p: f"{p[0]}-{p[1]}t")
def variant(request):
    """avx512: the VNNI variant (vpdpwssd, 16-lane FMAs) where the CPU has AVX-512 VNNI, else avx2's."""
    isa, threads = request.param
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    use_isa(isa)
    cpu.set_num_threads(threads)
    cpu.set_parallel_threshold(0)  # with 2 threads every call is split
    yield request.param
    cpu.set_isa("auto")
    cpu.set_num_threads(old_threads)
    cpu.set_parallel_threshold(old_threshold)


@pytest.fixture(params=["int16", "float"])
def path(request, variant):
    """Which product the C kernels run for every row count: the integer tiles or the float
    path. -> fn(num_rows): "int16" or "float" (the float32 product of the dequantized weights:
    the float path, or on the baseline ISA, which has none, products beyond INT_KERNEL_MAX_ROWS)."""
    old = qgemm.get_float_rows()
    qgemm.set_float_rows(1 if request.param == "float" else 2 ** 30)
    if variant[0] == "baseline":
        yield lambda num_rows: "int16" if num_rows <= INT_KERNEL_MAX_ROWS else "float"
    else:
        yield lambda num_rows: request.param
    qgemm.set_float_rows(old)


def exact_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float path's definition: x @ w.T in float64 over the dequantized weights w [N, K]."""
    return x.double() @ w.double().T


def quantize_activations(x: torch.Tensor, xmax: float = 32767.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (codes [M, K/32, 32] float64, scales [M, K/32] float64, block sums);
    codes |q| <= xmax (32767: int16, with the exact sums; 127: QG_INT8's int8, with the sums of
    the dequantized codes, in float32)."""
    blocks = x.float().reshape(x.shape[0], -1, GROUP_SIZE)  # [M, K/32, 32]
    amax = blocks.abs().amax(-1)  # [M, K/32]
    inv = torch.where(amax > 0, torch.tensor(xmax) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv[..., None])  # half to even, as nearbyintf
    dx = amax / xmax
    sums = blocks.sum(-1) if xmax == 32767.0 else dx * codes.sum(-1)
    return codes.double(), dx.double(), sums.double()


def emulate_int4(x: torch.Tensor, weight: Int4Weight | Int5Weight, half: bool, xmax: float = 32767.0) -> torch.Tensor:
    """Int5: the kernels take signed codes q - 16 and the min m + 16 d (with x's exact block sums)."""
    codes, dx, sx = quantize_activations(x, xmax)
    num_rows, num_cols = weight.shape
    is_int5 = isinstance(weight, Int5Weight)
    q = weight.codes.reshape(num_rows, -1, GROUP_SIZE).double() - (16 if is_int5 else 0)  # [N, K/32, 32]
    weight_mins = weight.kernel_mins if is_int5 else weight.mins
    scales, mins = (weight.scales.half().double(), weight_mins.half().double()) if half else (
        weight.scales.double(), weight_mins.double())
    dots = torch.einsum("mbj,nbj->mnb", codes, q)  # [M, N, K/32] integers
    return (dots * dx[:, None] * scales[None] + sx[:, None] * mins[None]).sum(-1)  # [M, N]


def emulate_int8(x: torch.Tensor, weight: Int8Weight, xmax: float = 32767.0) -> torch.Tensor:
    codes, dx, _ = quantize_activations(x, xmax)
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
@given(num_rows=st.integers(1, MAX_TEST_ROWS), num_out=st.integers(1, 37), groups=st.sampled_from([2, 4, 18]),
       half=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_int4_product_matches_its_definition(path, num_rows, num_out, groups, half, dtype, seed):
    w, x, bias = _inputs(seed, num_rows, num_out, GROUP_SIZE * groups, dtype)
    weight = Int4Weight.from_dense(w)
    if half:  # scales and mins that fp16 holds exactly, as Q4_0/Q4_1 files give
        weight = Int4Weight(weight.packed, weight.scales.half().float(), weight.mins.half().float())
    linear = Linear(weight, bias)
    assert linear.half == half
    y = linear(x)
    assert y.dtype == dtype and y.shape == (num_rows, num_out)
    expected = exact_product(x, weight.dequantize()) if path(num_rows) == "float" else emulate_int4(x, weight, half)
    _check(y, expected + bias.double(), dtype)


def q4_k_weight(gen: torch.Generator, num_out: int, num_cols: int) -> Int4Weight:
    """Scales and mins as Q4_K makes them: per 256 inputs fp16 d and dmin, per 32 6-bit sc and m
    (scale d sc, min -dmin m), the largest 63 in most super-blocks but not all."""
    supers = num_cols // 256
    d = (torch.rand(num_out, supers, 1, generator=gen) * 0.01).half().float()
    dmin = (torch.rand(num_out, supers, 1, generator=gen) * 0.01).half().float()
    sc = torch.randint(0, 64, (num_out, supers, 8), generator=gen).float()
    m = torch.randint(0, 64, (num_out, supers, 8), generator=gen).float()
    sc[:, :, 3], m[:, :, 5] = 63, 63
    sc[0, 0] = torch.arange(0, 16, 2)  # a super-block whose largest multiplier is 14
    m[-1, -1] = 0  # and one without mins
    codes = torch.randint(0, 16, (num_out, num_cols), generator=gen, dtype=torch.uint8)
    return Int4Weight.from_codes(codes, (d * sc).reshape(num_out, -1), (-(dmin * m)).reshape(num_out, -1))


@SETTINGS
@given(num_rows=st.integers(1, MAX_TEST_ROWS), num_out=st.integers(1, 37), supers=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_q4_k_scales_in_super_blocks_match_their_definition(path, num_rows, num_out, supers, dtype, seed):
    """QG_SUPER rows (18.5 bytes a block, not 24): the same products as the float32 scales give,
    bit for bit, and the definition's values."""
    gen = torch.Generator().manual_seed(seed)
    num_cols = 256 * supers
    weight = q4_k_weight(gen, num_out, num_cols)
    assume(not weight.is_half_exact())  # (a few rows can be: those take fp16 scales, 20 bytes a block)
    x = torch.randn(num_rows, num_cols, generator=gen).to(dtype)
    bias = torch.randn(num_out, generator=gen)
    linear = Linear(weight, bias)
    assert linear.layout == qgemm.Q4 | qgemm.SUPER and not linear.half
    assert linear._rows.shape == (num_out, num_cols // 32 * 37 // 2)
    y = linear(x)
    if path(num_rows) == "float":  # float32 sums of K terms: within K 2^-24 of the terms' magnitudes
        dense = weight.dequantize()
        expected = exact_product(x, dense) + bias.double()
        bound = (x.double().abs() @ dense.double().abs().T) * num_cols * 2.0 ** -24 + 1e-6
        if dtype == torch.bfloat16:
            bound = bound + expected.abs() * 2.0 ** -8
        assert ((y.double() - expected).abs() <= bound).all(), ((y.double() - expected).abs() / bound).max()
    else:
        _check(y, emulate_int4(x, weight, False) + bias.double(), dtype)
    plain_rows = weight.blocks(False)  # float32 scales and mins
    for name, flag in (("int16", qgemm.ROUTE_INT), ("float", qgemm.ROUTE_FLOAT)):
        if not linear.can_run(name, num_rows):
            continue
        plain = torch.empty_like(y)
        qgemm.matmul(qgemm.Q4 | flag, x.data_ptr(), x.stride(0), num_rows, num_cols, plain_rows.data_ptr(), 0,
                     num_out, bias.data_ptr(), plain.data_ptr(), num_out, 0 if dtype == torch.float32 else 1)
        assert torch.equal(linear.run(x, name), plain), name
    assert torch.equal(linear.dequantize(), weight.dequantize())


def test_scales_that_do_not_factor_keep_float32_scales():
    from engine.models.quant import super_factors

    weight = q4_k_weight(torch.Generator().manual_seed(1), 8, 512)
    f, q = super_factors(weight.scales.numpy())
    assert torch.equal(torch.from_numpy(f.astype("float32")).repeat_interleave(8, 1) * torch.from_numpy(q).float(),
                       weight.scales)
    scales = weight.scales.clone()
    scales[2, 9] = 0.0123456  # no fp16 factor times a byte gives this
    assert super_factors(scales.numpy()) is None
    odd = Int4Weight(weight.packed, scales, weight.mins)
    linear = Linear(odd)
    assert linear.layout == qgemm.Q4 and torch.equal(linear.dequantize(), odd.dequantize())
    narrow = Int4Weight.from_dense(torch.randn(4, 192))  # K not a multiple of 256
    assert narrow.super_blocks() is None


def random_int5(gen: torch.Generator, num_out: int, num_cols: int, half: bool, is_q5_0: bool) -> Int5Weight:
    """Codes over all of 0..31 (every fifth bit pattern); Q5_0's min -16 d or Q5_1's own min."""
    codes = torch.randint(0, 32, (num_out, num_cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(num_out, num_cols // GROUP_SIZE, generator=gen) * 0.01
    mins = -16 * scales if is_q5_0 else torch.randn(num_out, num_cols // GROUP_SIZE, generator=gen) * 0.1
    if half:
        scales, mins = scales.half().float(), mins.half().float()
    return Int5Weight.from_codes(codes, scales, mins)


@SETTINGS
@given(num_rows=st.integers(1, MAX_TEST_ROWS), num_out=st.integers(1, 37), groups=st.sampled_from([2, 4, 18]),
       half=st.booleans(), is_q5_0=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 16))
def test_int5_product_matches_its_definition(path, num_rows, num_out, groups, half, is_q5_0, dtype, seed):
    _, x, bias = _inputs(seed, num_rows, num_out, GROUP_SIZE * groups, dtype)
    weight = random_int5(torch.Generator().manual_seed(seed), num_out, GROUP_SIZE * groups, half, is_q5_0)
    linear = Linear(weight, bias)
    assert linear.format == "int5" and (linear.half == half or not is_q5_0)  # Q5_1: m + 16 d may need float32
    y = linear(x)
    assert y.dtype == dtype and y.shape == (num_rows, num_out)
    if path(num_rows) == "float":
        expected = exact_product(x, weight.dequantize())
    else:
        expected = emulate_int4(x, weight, linear.half)
    _check(y, expected + bias.double(), dtype)


@pytest.mark.parametrize("half", [False, True])
def test_int5_codes_layout_and_dequantize_are_exact(half, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    weight = random_int5(gen, 9, 256, half, is_q5_0=True)
    in_c = weight.blocks(half)  # cext's packing loop against the NumPy definition of the layout
    monkeypatch.setattr("engine.models.quant.qgemm", None)
    assert torch.equal(weight.blocks(half), in_c)
    monkeypatch.undo()
    assert torch.equal(Int5Weight.from_codes(weight.codes, weight.scales, weight.mins).high, weight.high)
    # The kernels' form d * (q - 16) + (m + 16 d): for Q5_0 with fp16 d, exactly the file's d * (q - 16)
    exact = (weight.codes.reshape(9, -1, GROUP_SIZE).double() - 16) * weight.scales[..., None].double()
    torch.testing.assert_close(Linear(weight).dequantize().double(), exact.reshape(9, 256), atol=0,
                               rtol=0 if half else 1e-6)
    # Q5_0 rows in the kernels hold no mins: 22 bytes per block of 32 with fp16 scales, as the file
    linear = Linear(weight)
    assert linear.no_mins and linear._rows.shape == (9, 256 // GROUP_SIZE * (22 if half else 24))
    scale_bytes = 256 // GROUP_SIZE * (2 if half else 4)  # then in_c's mins, which linear's rows leave out
    assert torch.equal(linear._rows[:, :scale_bytes], in_c[:, :scale_bytes])
    assert torch.equal(linear._rows[:, scale_bytes:], in_c[:, 2 * scale_bytes:])
    with pytest.raises(ValueError, match="kernel min"):
        random_int5(gen, 2, 64, half, is_q5_0=False).blocks(half, with_mins=False)
    as_int8 = weight.to_int8()  # Q5_0: codes q - 16, scale d
    assert as_int8.is_exact
    if half:  # fp16 scales, as in a file: d * q and d * q - 16 d are exact in float32 either way
        assert torch.equal(as_int8.dequantize(), weight.dequantize())
    torch.testing.assert_close(as_int8.dequantize(), weight.dequantize(), atol=0, rtol=1e-6)
    assert Linear(random_int5(gen, 3, 96, half, True)).format == "int8"  # K = 96: no pair layout


def test_fused_layers_keep_int5_exact():
    gen = torch.Generator().manual_seed(3)
    q5 = random_int5(gen, 6, 128, True, is_q5_0=True)  # fp16 scales, as a file has
    q4 = Int4Weight.from_dense(torch.randn(4, 128, generator=gen))
    q8 = Int8Weight.from_dense(torch.randn(5, 128, generator=gen))
    mixed = cat_rows([q5, q4])  # int4 rows join as int5 with fifth bits 0
    assert isinstance(mixed, Int5Weight)
    assert torch.equal(mixed.dequantize(), torch.cat((q5.dequantize(), q4.dequantize())))
    with_int8 = cat_rows([q5, q8])  # a Q8_0 V beside Q5_0 Q/K: int8, exact
    assert isinstance(with_int8, Int8Weight)
    assert torch.equal(with_int8.dequantize(), torch.cat((q5.dequantize(), q8.dequantize())))


@SETTINGS
@given(num_rows=st.integers(1, MAX_TEST_ROWS), num_out=st.integers(1, 37), groups=st.sampled_from([1, 3, 18]),
       half=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_int8_product_matches_its_definition(path, num_rows, num_out, groups, half, dtype, seed):
    w, x, bias = _inputs(seed, num_rows, num_out, GROUP_SIZE * groups, dtype)
    weight = Int8Weight.from_dense(w)
    if half:  # scales that fp16 holds exactly, as a Q8_0 file's d: the kernels read them as fp16
        weight = Int8Weight(weight.q, weight.scales.half().float())
    linear = Linear(weight, bias)
    assert linear.half == half and linear._scales.dtype == (torch.float16 if half else torch.float32)
    y = linear(x)
    expected = exact_product(x, weight.dequantize()) if path(num_rows) == "float" else emulate_int8(x, weight)
    _check(y, expected + bias.double(), dtype)


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
    w, x, bias = _inputs(5, KERNEL_MAX_ROWS + 3, 24, 96, torch.float32)  # above KERNEL_MAX_ROWS; K = 96: no pair layout
    for weight in (Int4Weight.from_dense(w), Int8Weight.from_dense(w)):
        exact = x.double() @ weight.dequantize().double().T + bias.double()
        torch.testing.assert_close(Linear(weight, bias)(x).double(), exact, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(Linear(weight, bias, exact=True)(x[:2]).double(), exact[:2],
                                   atol=1e-4, rtol=1e-5)


def test_layout_codes_agree_with_the_kernels():
    names = ("Q4", "Q5", "Q8", "HALF", "NO_MINS", "ROUTE_INT", "ROUTE_FLOAT", "SUPER", "ROUTE_AMX", "ROUTE_STRIP")
    assert [getattr(linear_module, n) for n in names] == [getattr(qgemm, n) for n in names]
    with pytest.raises(ValueError, match="unknown layout"):
        qgemm.matmul(3, 0, 0, 1, 64, 0, 0, 1, 0, 0, 1, qgemm.FLOAT32)
    for layout in (qgemm.Q8 | qgemm.SUPER, qgemm.Q5 | qgemm.SUPER, qgemm.Q4 | qgemm.SUPER | qgemm.HALF):
        with pytest.raises(ValueError, match="unknown layout"):
            qgemm.matmul(layout, 0, 0, 1, 256, 0, 0, 1, 0, 0, 1, qgemm.FLOAT32)
        with pytest.raises(ValueError, match="unknown layout"):
            qgemm.dequantize(layout, 0, 0, 0, 1, 256, 0, qgemm.FLOAT32)
    with pytest.raises(ValueError, match="ROUTE_STRIP with num_out not a multiple of 16"):
        qgemm.matmul(qgemm.Q4 | qgemm.ROUTE_STRIP, 0, 0, 1, 64, 0, 0, 24, 0, 0, 24, qgemm.FLOAT32)
    with pytest.raises(ValueError, match=r"256 \(SUPER, Q6\)"):
        qgemm.matmul(qgemm.Q4 | qgemm.SUPER, 0, 0, 1, 192, 0, 0, 1, 0, 0, 1, qgemm.FLOAT32)


def test_bad_width_is_an_error_not_a_read_past_the_row():
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm.matmul(qgemm.Q8, 0, 0, 1, 48, 0, 0, 1, 0, 0, 1, qgemm.FLOAT32)
    with pytest.raises(ValueError, match="multiple of 64"):
        Int4Weight.from_dense(torch.randn(2, 96)).blocks()


# ----- routes (engine.models.routes): every route this CPU has, against float64 -----

ROUTE_NEEDS = {"float": ("avx2", "AVX2"), "amx": ("amx_bf16", "AMX bf16"), "amx_int": ("amx_int8", "AMX int8"),
               "strip": ("avx512_vnni", "AVX-512 VNNI")}
STRIP_ROUTES = ("amx_int", "strip")  # outputs in strips of 16


def _weights(kind: str, w: torch.Tensor):
    if kind == "int5_0":  # Q5_0: rows without mins
        return random_int5(torch.Generator().manual_seed(5), w.shape[0], w.shape[1], half=True, is_q5_0=True)
    if kind == "int8_half":  # fp16 scales, as a Q8_0 file gives
        weight = Int8Weight.from_dense(w)
        return Int8Weight(weight.q, weight.scales.half().float())
    if kind == "int4":
        return Int4Weight.from_dense(w)
    if kind == "int4_half":  # fp16 scales and mins, as Q4_0/Q4_1 files give
        weight = Int4Weight.from_dense(w)
        return Int4Weight(weight.packed, weight.scales.half().float(), weight.mins.half().float())
    if kind == "q4_k":  # K a multiple of 256: the super-block layout
        return q4_k_weight(torch.Generator().manual_seed(6), w.shape[0], w.shape[1])
    if kind == "int8":
        return Int8Weight.from_dense(w)
    return random_int5(torch.Generator().manual_seed(5), w.shape[0], w.shape[1], half=True, is_q5_0=False)


@pytest.mark.parametrize("route", ["int16", "float", "amx_int", "strip", "amx", "blas"])
@pytest.mark.parametrize("kind", ["int4", "int5", "int8", "q4_k"])
@pytest.mark.parametrize("num_rows", [1, 7, 33])
def test_every_route_matches_the_float64_product(route, kind, num_rows):
    """int16, amx_int and strip: the emulated integer definition; float and blas: the exact float32
    product; amx: bfloat16 x, W and y with float32 sums, so |err| <= 2^-8 (|x| @ |W|.T) + 2^-8 |y|."""
    if route in ROUTE_NEEDS and ROUTE_NEEDS[route][0] not in cpu.features():
        pytest.skip(f"CPU lacks {ROUTE_NEEDS[route][1]}")
    num_out = 48 if route in STRIP_ROUTES else 45
    w, x, bias = _inputs(num_rows, num_rows, num_out, 256 if kind == "q4_k" else 192, torch.float32)
    weight = _weights(kind, w)
    linear = Linear(weight, bias)
    assert linear.can_run(route, num_rows)
    y = linear.run(x, route)
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T + bias.double()
    if route in ("int16", *STRIP_ROUTES):
        emulated = emulate_int8(x, weight) if kind == "int8" else emulate_int4(x, weight, linear.half)
        torch.testing.assert_close(y.double(), emulated + bias.double(), atol=1e-4, rtol=1e-5)
    elif route == "amx":
        bound = 2 ** -8 * (x.double().abs() @ dense.abs().T + exact.abs()) + 1e-6
        assert ((y.double() - exact).abs() <= bound).all()
        assert (y.double() - exact).abs().max() > 0  # bfloat16 really ran (not a float32 route)
    else:
        torch.testing.assert_close(y.double(), exact, atol=1e-4, rtol=1e-5)


@pytest.fixture(params=[("amx_int", 1), ("amx_int", 2), ("strip", 1), ("strip", 2)],
                ids=lambda p: f"{p[0]}-{p[1]}t")
def strip_route(request):
    """amx_int or strip on one thread or split across two (every call split) -> the route's name."""
    route, threads = request.param
    if ROUTE_NEEDS[route][0] not in cpu.features():
        pytest.skip(f"CPU lacks {ROUTE_NEEDS[route][1]} "
                    "(the route's definition is the int16 route's: emulate_int4/int8)")
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_num_threads(threads)
    cpu.set_parallel_threshold(0)
    yield route
    cpu.set_num_threads(old_threads)
    cpu.set_parallel_threshold(old_threshold)


@SETTINGS
@given(num_rows=st.integers(1, 70), strips=st.integers(1, 5),
       kind=st.sampled_from(["int4", "int4_half", "int5", "int8", "q4_k"]),
       blocks=st.sampled_from([2, 8, 28]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 16))
def test_strip_routes_are_the_integer_routes_definition(strip_route, num_rows, strips, kind, blocks, dtype, seed):
    """amx_int (cext/csrc/qgemm_amx.h) and strip (qgemm_strip.h) sum the int16 route's integers:
    the emulated definition for every layout, row counts that leave partial tiles of activation
    rows, odd and even numbers of 16-output strips (amx_int's pairs and a lone strip), bfloat16 in
    and out; and each equals the int16 route to float32 rounding (they add the blocks' scaled sums
    in other orders)."""
    num_cols = 256 if kind == "q4_k" else GROUP_SIZE * blocks
    w, x, bias = _inputs(seed, num_rows, 16 * strips, num_cols, dtype)
    weight = _weights(kind, w)
    linear = Linear(weight, bias)
    y = linear.run(x, strip_route)
    assert y.dtype == dtype and y.shape == (num_rows, 16 * strips)
    emulated = emulate_int8(x, weight) if kind == "int8" else emulate_int4(x, weight, linear.half)
    _check(y, emulated + bias.double(), dtype)
    _check(y, linear.run(x, "int16").double(), dtype)
    assert not linear.row_slice(16 * strips - 8).can_run(strip_route, num_rows)  # outputs not in strips of 16


def test_strip_route_below_avx512_is_the_int16_route():
    """With the switch below AVX-512 a layer whose table holds strip (measured at full ISA) runs
    the int16 route's kernels instead, bit for bit, and can_run says strip is not available."""
    if "avx512_vnni" not in cpu.features():
        pytest.skip("CPU lacks AVX-512 VNNI")
    w, x, bias = _inputs(3, 40, 32, 256, torch.float32)
    linear = Linear(_weights("q4_k", w), bias)
    try:
        cpu.set_isa("avx2")
        assert not linear.can_run("strip", 40)
        torch.testing.assert_close(linear.run(x, "strip"), linear.run(x, "int16"), atol=0, rtol=0)
    finally:
        cpu.set_isa("auto")
    assert linear.can_run("strip", 40)


@pytest.mark.parametrize("route", ["int16", "float", "amx_int", "strip"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_products_beyond_one_kernel_block_are_run_in_row_blocks(route, kind, monkeypatch):
    """More rows than KERNEL_BLOCK_ROWS (made 16 here): the C routes run block after block of
    strided rows, and every block's rows are the product's (float64 definition, bias included)."""
    if route in ROUTE_NEEDS and ROUTE_NEEDS[route][0] not in cpu.features():
        pytest.skip(f"CPU lacks {ROUTE_NEEDS[route][1]}")
    monkeypatch.setattr(linear_module, "KERNEL_BLOCK_ROWS", 16)
    w, x, bias = _inputs(53, 53, 48, 192, torch.float32)
    x = torch.cat([x, torch.randn(53, 5)], dim=1)[:, :192]  # strided rows
    weight = _weights(kind, w)
    layer = Linear(weight, bias)
    y = layer.run(x, route)
    if route in ("int16", *STRIP_ROUTES):
        expected = emulate_int8(x, weight) if kind == "int8" else emulate_int4(x, weight, layer.half)
    else:
        expected = x.double() @ weight.dequantize().double().T
    torch.testing.assert_close(y.double(), expected + bias.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("slice_floats", [1 << 22, 10 * 192])
def test_blas_route_in_weight_slices_through_one_scratch(slice_floats, monkeypatch):
    """The blas route's dequantized weight (whole, or slices of 10 rows) lives in one reused
    per-thread scratch: two layers taking turns each still get their own float64 product."""
    monkeypatch.setattr(linear_module, "DEQUANT_FLOATS", slice_floats)
    layers = []
    for seed, kind in ((11, "int4"), (12, "int8")):
        w, x, bias = _inputs(seed, 37, 45, 192, torch.float32)
        weight = _weights(kind, w)
        layers.append((Linear(weight, bias), x, x.double() @ weight.dequantize().double().T + bias.double()))
    for _ in range(2):
        for layer, x, expected in layers:
            torch.testing.assert_close(layer.run(x, "blas").double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "int4_half", "int5", "int8", "q4_k"])
def test_dequantize_to_bfloat16_rounds_like_torch(variant, kind):
    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    linear = Linear(_weights(kind, w))
    out = torch.empty(20, 256, dtype=torch.bfloat16)
    scales = 0 if linear._scales is None else linear._scales.data_ptr()
    qgemm.dequantize(linear.layout, linear._rows.data_ptr(), scales, 11, 20, 256, out.data_ptr(),
                     qgemm.BFLOAT16)
    f32 = linear.dequantize(11, 31)
    assert torch.equal(f32, _weights(kind, w).dequantize()[11:31])
    assert torch.equal(out, f32.bfloat16())


def test_route_table_picks_by_row_count_and_is_cached(tmp_path, monkeypatch):
    from engine.models import routes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ENGINE_ROUTES", raising=False)
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})  # a process that has read no table yet
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    layers = [Linear(Int4Weight.from_dense(w)), Linear(Int4Weight.from_dense(w)), Linear(Int8Weight.from_dense(w))]
    calls = []
    assert routes.ROW_GRID[4:6] == (16, 32) and routes.SAME_ROUTE_ROWS == 16
    best = ["int16"] + ["float"] * 5 + ["blas"] * (len(routes.ROW_GRID) - 6)
    monkeypatch.setattr(routes, "measure", lambda layer, available: calls.append(layer) or list(best))
    monkeypatch.setattr(routes, "neighbours_were_busy", lambda *args: False)  # the machine's other work: not here
    table = routes.calibrate(layers, allow_approximate=False, num_threads=1)
    assert len(calls) == 2 and len(table) == 2  # one measurement per distinct (layout, N, K)
    # up to 16 rows the one-row route (routes.same_route_up_to), then the measured ones
    assert [layers[0].route(m) for m in (1, 2, 16, 17, 32, 33, 600)] == ["int16"] * 3 + ["float"] * 2 + ["blas"] * 2
    assert set(routes.summary(table).values()) == {"1-16 int16, 17-32 float, 33+ blas"}
    calls.clear()
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})  # another process
    fresh = [Linear(Int4Weight.from_dense(w))]
    assert routes.calibrate(fresh, allow_approximate=False, num_threads=1) == {list(table)[0]: table[list(table)[0]]}
    assert not calls and fresh[0].route(600) == "blas"  # read from the per-machine cache
    assert fresh[0].route(20) == "float"
    monkeypatch.setenv("ENGINE_ROUTES", "fastest")  # the measured table at every row count
    fastest = [Linear(Int4Weight.from_dense(w))]
    routes.calibrate(fastest, allow_approximate=False, num_threads=1)
    assert [fastest[0].route(m) for m in (1, 2, 16, 33)] == ["int16", "float", "float", "blas"]
    monkeypatch.delenv("ENGINE_ROUTES")
    exact = Linear(Int4Weight.from_dense(w), exact=True)
    routes.calibrate([exact], allow_approximate=False, num_threads=1)
    assert exact.route(1) == "blas"  # exact products never take a table's route
    monkeypatch.setenv("ENGINE_ROUTES", "fixed")
    assert routes.calibrate([Linear(Int4Weight.from_dense(w))], allow_approximate=False, num_threads=1) == {}


def test_a_table_measured_on_a_busy_machine_is_measured_again_when_quiet(tmp_path, monkeypatch):
    from engine.models import routes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ENGINE_ROUTES", raising=False)
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})  # a process that has read no table yet
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    calls = []
    table = ["int16"] * len(routes.ROW_GRID)
    monkeypatch.setattr(routes, "measure", lambda layer, available: calls.append(layer) or list(table))
    monkeypatch.setattr(routes, "neighbours_were_busy", lambda *args: False)  # only is_busy decides here
    busy = [True]
    monkeypatch.setattr(routes, "is_busy", lambda: busy[0])

    def load_in_a_new_process():
        monkeypatch.setattr(routes, "_PROCESS_TABLES", {})
        routes.calibrate([Linear(Int4Weight.from_dense(w))], allow_approximate=False, num_threads=1)

    load_in_a_new_process()
    load_in_a_new_process()
    assert len(calls) == 1  # still busy: the busy table serves
    busy[0] = False
    routes.calibrate([Linear(Int4Weight.from_dense(w))], allow_approximate=False, num_threads=1)
    assert len(calls) == 1  # quiet now, but this process used the busy table: it keeps it
    load_in_a_new_process()
    load_in_a_new_process()
    assert len(calls) == 2  # measured again once, quiet, then cached


def test_a_table_measured_beside_a_busy_neighbour_counts_as_busy(tmp_path, monkeypatch):
    """The load average lags: other processes' CPU time during the measurement (from
    /proc/stat, minus ours) marks the table busy too, so a quiet load measures it again."""
    from engine.models import routes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ENGINE_ROUTES", raising=False)
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})
    monkeypatch.setattr(routes, "is_busy", lambda: False)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    calls = []
    table = ["int16"] * len(routes.ROW_GRID)
    monkeypatch.setattr(routes, "measure", lambda layer, available: calls.append(layer) or list(table))
    neighbours = [True]
    monkeypatch.setattr(routes, "neighbours_were_busy", lambda before, after, seconds: neighbours[0])

    def load():
        monkeypatch.setattr(routes, "_PROCESS_TABLES", {})
        routes.calibrate([Linear(Int4Weight.from_dense(w))], allow_approximate=False, num_threads=1)

    load()  # a neighbour ran during the measurement: stored as busy
    neighbours[0] = False
    load()  # a quiet load measures it again
    load()  # and that table serves
    assert len(calls) == 2


def test_a_short_measurement_is_judged_over_the_whole_neighbour_window(tmp_path, monkeypatch):
    """One shape's measurement takes less than /proc/stat can judge: calibrate waits out the
    window before the second sample, so a neighbour busy beside a short measurement still marks
    the table busy (before, such a table was stored as quiet); a cached table waits for nothing."""
    from engine.models import routes

    if routes.cpu_seconds() is None:
        pytest.skip("no /proc/stat")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ENGINE_ROUTES", raising=False)
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})
    monkeypatch.setattr(routes, "is_busy", lambda: False)
    monkeypatch.setattr(routes, "measure", lambda layer, available: ["int16"] * len(routes.ROW_GRID))
    windows = []
    monkeypatch.setattr(routes, "neighbours_were_busy",
                        lambda before, after, seconds: windows.append(seconds) or True)
    layer = Linear(Int4Weight.from_dense(torch.randn(64, 128, generator=torch.Generator().manual_seed(2))))
    routes.calibrate([layer], allow_approximate=False, num_threads=1)
    assert len(windows) == 1 and windows[0] >= routes.NEIGHBOUR_WINDOW
    monkeypatch.setattr(routes, "is_busy", lambda: True)  # the stored table was marked busy: served while busy
    monkeypatch.setattr(routes, "_PROCESS_TABLES", {})
    start = time.perf_counter()
    routes.calibrate([layer], allow_approximate=False, num_threads=1)
    assert len(windows) == 1 and time.perf_counter() - start < routes.NEIGHBOUR_WINDOW


def test_a_route_timing_starts_after_an_untimed_call():
    """The other route's timing left this route's threads asleep: a timed call that wakes them runs
    mostly on the caller, so _time_call runs the product once before it reads the clock."""
    from engine.models import routes

    events = []

    class Proxy:
        def run(self, x, route):
            events.append(("run", route))

    ticks = iter(range(100))

    def clock():
        events.append(("clock", None))
        return next(ticks) * routes.MIN_TIMED_SECONDS

    assert routes._time_call(Proxy(), None, "strip", clock) == routes.MIN_TIMED_SECONDS
    assert events == [("run", "strip"), ("clock", None), ("run", "strip"), ("clock", None)]


def test_measure_wakes_the_pool_for_a_kernel_route_timed_after_a_torch_route(monkeypatch):
    from engine.models import routes

    timed = []
    monkeypatch.setattr(routes, "_time_call",
                        lambda proxy, x, route, clock, wake=True: timed.append((route, wake)) or 1.0)
    layer = Linear(Int4Weight.from_dense(torch.randn(64, 128, generator=torch.Generator().manual_seed(4))))
    available = routes.available_routes(False)
    routes.measure(layer, available, grid=(1, 4), rounds=2)
    assert timed and {route for route, _ in timed} >= {"int16", "blas"}
    previous = [r for r in available if layer.can_run(r, 1)][-1]  # the warm-up calls' last
    for route, wake in timed:
        assert wake == (route not in routes.TORCH_ROUTES and previous in routes.TORCH_ROUTES), (route, previous)
        previous = route
    assert any(wake for _, wake in timed) and not all(wake for _, wake in timed)


def test_neighbours_cpu_time_is_the_machines_minus_ours():
    from engine.models import routes

    # (machine busy, this process) CPU seconds at two samples 1 s apart
    assert routes.neighbours_were_busy((100.0, 10.0), (101.5, 10.9), 1.0)  # others 0.6 cores
    assert not routes.neighbours_were_busy((100.0, 10.0), (101.9, 11.8), 1.0)  # others 0.1: ours was the rest
    assert not routes.neighbours_were_busy(None, (1.0, 1.0), 1.0)  # no /proc/stat: not known busy
    assert not routes.neighbours_were_busy((100.0, 10.0), (100.01, 10.0), 0.01)  # one tick: too short to judge
    sample = routes.cpu_seconds()
    assert sample is None or (sample[0] > 0 and sample[1] >= 0)


def test_decode_sized_products_are_timed_on_whole_layers():
    from engine.models import routes

    w = torch.randn(3072, 576, generator=torch.Generator().manual_seed(3)) * 0.05
    layer = Linear(Int4Weight.from_dense(w))
    assert routes.proxy_rows(layer, 1) == 3072  # one row: the whole layer (its fixed costs are not the product)
    assert routes.proxy_rows(layer, 512) == routes.PROXY_ROWS
    assert all(routes.proxy_rows(layer, m) * m * 576 >= min(routes.PROXY_MACS, 3072 * m * 576) for m in routes.ROW_GRID)


def test_a_layer_never_takes_a_route_its_shape_cannot_run():
    """amx_int needs outputs in strips of 16: a head of 1,000 outputs is timed at 512 rows on
    its first 256, which could run it, but the layer's table never holds it, and a table given
    to it from elsewhere falls back to the fixed route there (a fresh clone's families tests hit
    qgemm's layout error on such heads)."""
    from engine.models import routes

    layer = Linear(Int8Weight.from_dense(torch.randn(1000, 128, generator=torch.Generator().manual_seed(8)) * 0.05))
    assert routes.proxy_rows(layer, 512) == 256
    best = routes.measure(layer, routes.available_routes(allow_approximate=False), grid=(1, 512), rounds=1)
    assert "amx_int" not in best and "strip" not in best
    layer.set_routes((16, 512), ["amx_int", "amx_int"])
    assert layer.route(8) == layer.fixed_route(16) and layer.route(300) == layer.fixed_route(512)
    layer.set_routes((16, 512), ["strip", "strip"])
    assert layer.route(8) == layer.fixed_route(16) and layer.route(300) == layer.fixed_route(512)
    x = torch.randn(300, 128)
    torch.testing.assert_close(layer(x), layer.run(x, "blas"), atol=1e-4, rtol=1e-4)


def test_measured_routes_are_ones_this_cpu_runs():
    from engine.models import routes

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    layer = Linear(Int4Weight.from_dense(w))
    available = routes.available_routes(allow_approximate=True)
    best = routes.measure(layer, available, grid=(1, 64), rounds=1)
    assert len(best) == 2 and set(best) <= set(available)
    assert ("amx" in available) == ("amx_bf16" in cpu.features())
    assert ("amx_int" in available) == ("amx_int8" in cpu.features())
    assert ("strip" in available) == ("avx2" in cpu.features())  # over packed strips from AVX2 up
    part = layer.row_slice(40)
    x = torch.randn(3, 128)
    torch.testing.assert_close(part(x), layer(x)[:, :40], atol=0, rtol=0)


def test_row_spans_take_the_route_of_their_own_class():
    """Inside row_routes(spans) a product's rows split into spans, each computed by the route of
    its route_rows rows, the rest by their own count: the decode rows of a tick come out bit-equal
    to a plain decode step of the same sequences, and prompt rows to the prompt alone, whatever
    rows follow them."""
    from engine.models import routes
    from engine.models.linear import row_routes

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    layer = Linear(Int8Weight.from_dense(w))
    layer.set_routes(routes.ROW_GRID, ["int16"] * 2 + ["float"] * 4 + ["blas"] * (len(routes.ROW_GRID) - 6))
    x = torch.randn(80, 128, generator=torch.Generator().manual_seed(4))
    decode_step = layer(x[:3])  # three sequences decoding alone: the route of 3 rows (float)
    assert layer.route(3) == "float" and layer.route(40) == "blas"
    with row_routes(((3, 3),)):  # the same three rows, 37 prompt rows after them
        mixed = layer(x[:40])
    assert torch.equal(mixed[:3], decode_step)
    assert torch.equal(mixed[3:], layer.run(x[3:40], layer.route(37)))
    assert not torch.equal(layer(x[:40])[:3], decode_step)  # outside: all 40 rows take the blas route
    with row_routes(((7, 2),)):  # two sequences verifying 1 + 2 and 1 + 3 rows: the 2-row route
        verify = layer(x[:7])
    assert torch.equal(verify, layer.run(x[:7], "int16"))
    with row_routes(((40, 40),)):  # all rows decode: one product
        assert torch.equal(layer(x[:40]), layer.run(x[:40], "blas"))
    prompt = layer(x[3:40])  # a 37-row prompt chunk alone (blas)
    with row_routes(((3, 3), (37, 37))):  # decodes, the prompt chunk, then 40 embedding rows
        three = layer(x)
    assert torch.equal(three[:3], decode_step) and torch.equal(three[3:40], prompt)
    assert torch.equal(three[40:], layer.run(x[40:], "blas"))
    with row_routes(((3, 3), (3, 3))):  # two classes on one row-independent route: one call
        assert torch.equal(layer(x[:6]), layer.run(x[:6], "float"))


def test_a_product_writes_into_the_output_it_is_given():
    """``layer(x, out)`` (the engine's logits buffer) fills out with what ``layer(x)`` returns, on
    every route this CPU runs, on rows split into spans of different routes, and bfloat16 inputs."""
    from engine.models import routes
    from engine.models.linear import row_routes

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(6))
    for weight, pack in itertools.product((Int8Weight.from_dense(w), Int4Weight.from_dense(w)), (True, False)):
        layer = Linear(weight, pack=pack)
        for route in [*routes.available_routes(allow_approximate=True), "blas"]:
            if not layer.can_run(route, 9):
                continue
            for inputs in (x, x.bfloat16()):
                out = torch.full((9, 96), float("nan"))
                assert layer.run(inputs, route, out) is out
                torch.testing.assert_close(out, layer.run(inputs, route).float(), atol=0, rtol=0)
        if pack:
            continue
        layer.set_routes(routes.ROW_GRID, ["int16"] * 2 + ["blas"] * (len(routes.ROW_GRID) - 2))
        with row_routes(((2, 2),)):  # two decode rows, then seven prompt rows on another route
            out = torch.full((9, 96), float("nan"))
            assert layer(x, out) is out
            torch.testing.assert_close(out, layer(x), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["q4", "q4_half", "q4_k", "q5_0", "q5_1", "int8"])
@pytest.mark.parametrize("num_cols", [256, 896])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_takes_the_same_bits_in_a_product_of_any_row_count(variant, kind, num_cols, dtype):
    """The integer route sums each (weight row, activation row) in the same steps whatever the
    product's row count (tiles of 1 or 2 rows, weights decoded per pass or kept in registers,
    AVX-512's two rows per 512-bit vector in groups of 4 and 2 rows): a decoding stream's numbers
    do not change with the streams beside it (engine.models.routes). 896 inputs: 28 blocks, a
    tail past the scales' 8-block vectors; a bias; bfloat16 in and out."""
    if kind == "q4_k" and num_cols % 256:
        num_cols = 768
    gen = torch.Generator().manual_seed(11)
    num_out = 13
    w = torch.randn(num_out, num_cols, generator=gen) * 0.05
    if kind == "int8":
        weight = Int8Weight.from_dense(w)
    elif kind.startswith("q5"):
        weight = random_int5(gen, num_out, num_cols, half=True, is_q5_0=kind == "q5_0")
    else:
        weight = _weights({"q4": "int4", "q4_half": "int4_half", "q4_k": "q4_k"}[kind], w)
    linear = Linear(weight, torch.randn(num_out, generator=gen))
    x = torch.randn(17, num_cols, generator=gen).to(dtype)
    if not linear.can_run("int16", 17):
        pytest.skip("no integer route on this ISA")
    alone = torch.cat([linear.run(x[i:i + 1], "int16") for i in range(17)])
    for num_rows in (2, 3, 4, 5, 6, 7, 8, 16, 17):
        assert torch.equal(linear.run(x[:num_rows], "int16"), alone[:num_rows]), num_rows


@pytest.mark.parametrize("kind", ["q4_k", "q5_0", "int8"])
def test_the_weight_prefetch_level_changes_no_result(variant, kind):
    """qgemm.set_prefetch picks the cache the kernels' weight prefetch fills and
    set_prefetch_spread whether decode steps spread it over each pass (speed only): every
    combination gives the same bits on every route this CPU runs, for one, two and many rows."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 512, generator=gen) * 0.05  # 75 passes of 4 rows: the prefetch runs ahead
    if kind == "int8":
        weight = Int8Weight.from_dense(w)
    elif kind == "q5_0":
        weight = random_int5(gen, 300, 512, half=True, is_q5_0=True)
    else:
        weight = _weights("q4_k", w)
    linear = Linear(weight)
    x = torch.randn(9, 512, generator=gen)
    routes = [r for r in ("int16", "float") if linear.can_run(r, 9)]
    assert qgemm.get_prefetch_spread()  # the default
    try:
        results = {}
        for level in ("l1", "l2"):
            for spread in (True, False):
                qgemm.set_prefetch(level)
                qgemm.set_prefetch_spread(spread)
                assert qgemm.get_prefetch() == level and qgemm.get_prefetch_spread() == spread
                results[level, spread] = [linear.run(x[:rows], route) for route in routes for rows in (1, 2, 9)]
        first = results["l1", True]
        for other in results.values():
            assert all(torch.equal(a, b) for a, b in zip(first, other))
    finally:
        qgemm.set_prefetch("auto")
        qgemm.set_prefetch_spread(True)


def test_the_default_prefetch_level_follows_the_cpu_vendor():
    """L2 on AMD (measured faster there), L1 elsewhere; a bad level is a ValueError naming it."""
    cpuinfo = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    is_amd = "AuthenticAMD" in cpuinfo
    qgemm.set_prefetch("auto")
    if platform.machine() in ("x86_64", "AMD64"):
        assert qgemm.get_prefetch() == ("l2" if is_amd else "l1")
    with pytest.raises(ValueError, match="prefetch"):
        qgemm.set_prefetch("l3")
    assert qgemm.get_prefetch() in ("l1", "l2")


# ---- QG_PACKED: Q4 rows in strips of 16 (cext/csrc/qgemm.h), read by the strip route alone ----
PACKED_KINDS = ["int4", "int4_half", "q4_k", "int5", "int5_0", "int8", "int8_half"]


def packed_pair(kind: str, w: torch.Tensor, bias: torch.Tensor, monkeypatch) -> tuple[Linear, Linear]:
    """The same Q4 weight as a row-layout layer and as QG_PACKED strips (packed through qgemm.pack
    whatever the CPU: Linear packs only where AVX-512 VNNI is)."""
    rows = Linear(_weights(kind, w), bias)
    packed = Linear(_weights(kind, w), bias)
    packed._pack()
    assert packed.is_packed_strips and not rows.is_packed_strips
    return rows, packed


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_strips_are_the_strip_routes_numbers(isa, threads, kind, monkeypatch):
    """A packed layer's product (AVX-512 VNNI in place, AVX2's halves of strips, or the portable kernel)
    is the strip route's over the row layout bit for bit at every row count (1-8-row passes and their
    tails), float32 and bfloat16 in and out (without AVX-512 VNNI: the portable kernel's bits), and the
    integer definition to float32 rounding."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_num_threads(threads)
    cpu.set_parallel_threshold(0)
    try:
        for seed, num_rows in enumerate((1, 2, 3, 5, 8, 11, 17)):
            for dtype in (torch.float32, torch.bfloat16):
                w, x, bias = _inputs(seed, num_rows, 48, 256 if kind == "q4_k" else 192, dtype)
                rows, packed = packed_pair(kind, w, bias, monkeypatch)
                if "avx512_vnni" in cpu.features():
                    reference = rows.run(x, "strip")
                else:
                    cpu.set_isa("baseline")
                    reference = packed.run(x, "strip")
                    cpu.set_isa("auto")
                use_isa(isa)
                y = packed.run(x, "strip")
                cpu.set_isa("auto")
                assert y.dtype == dtype and y.shape == (num_rows, 48)
                weight = _weights(kind, w)
                emulated = emulate_int8(x, weight) if kind.startswith("int8") else emulate_int4(x, weight, rows.half)
                _check(y, emulated + bias.double(), dtype)
                assert torch.equal(y, reference), (num_rows, dtype)
    finally:
        cpu.set_isa("auto")
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_rows_do_not_depend_on_the_batch(kind, monkeypatch):
    """Each activation row's outputs are the same alone, in a pass of any count up to 8 rows (the
    rows after the passes of 8 take one pass of their count) or in a product of passes: a decode
    step's numbers do not move with the number of sequences beside it, nor a verification's."""
    w, x, bias = _inputs(4, 21, 32, 256 if kind == "q4_k" else 192, torch.float32)
    _, packed = packed_pair(kind, w, bias, monkeypatch)
    whole = packed.run(x, "strip")  # two passes of 8, then one of 5
    for count in range(1, 18):
        for first in (0, 3, 21 - count):
            assert torch.equal(packed.run(x[first:first + count], "strip"), whole[first:first + count]), count


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_strips_dequantize_and_run_blas_like_rows(isa, kind, monkeypatch):
    """qg_dequantize reads the strips (float32 and bfloat16, any first row; AVX2's 16 values at a time
    across the pool, or the portable loop) as the row layout's values, so the blas route, the exact
    product and a lookup (``Linear.rows``) see the same weight."""
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    rows, packed = packed_pair(kind, w, torch.zeros(48), monkeypatch)
    expected = rows.dequantize()
    use_isa(isa)
    try:
        _dequantize_like_rows(rows, packed, expected)
    finally:
        cpu.set_isa("auto")


def _dequantize_like_rows(rows: Linear, packed: Linear, expected: torch.Tensor) -> None:
    assert torch.equal(packed.dequantize(), expected)
    assert torch.equal(packed.dequantize(13, 37), rows.dequantize(13, 37))
    out = torch.empty(20, 256, dtype=torch.bfloat16)
    qgemm.dequantize(packed.layout, packed._rows.data_ptr(), 0, 11, 20, 256, out.data_ptr(), qgemm.BFLOAT16)
    assert torch.equal(out, rows.dequantize(11, 31).bfloat16())
    x = torch.randn(5, 256)
    torch.testing.assert_close(packed.run(x, "blas"), rows.run(x, "blas"), atol=0, rtol=0)
    ids = torch.tensor([[3, 47], [0, 3]])
    assert torch.equal(packed.rows(ids, torch.float32), rows.dequantize()[ids])
    with pytest.raises(IndexError, match="row 48"):
        packed.rows(torch.tensor([48]), torch.float32)


def test_packed_layers_run_the_strip_route_alone(monkeypatch):
    """A packed layer offers strip (any ISA), blas and, with AMX, amx; never the row layout's routes.
    Its slices for route timing are whole strips; the C entry refuses packed layouts it cannot run
    with the layout named."""
    w, x, bias = _inputs(1, 3, 64, 128, torch.float32)
    _, packed = packed_pair("int4", w, bias, monkeypatch)
    for route in ("int16", "float", "amx_int"):
        assert not packed.can_run(route, 3)
    assert packed.can_run("strip", 3) and packed.can_run("blas", 3)
    assert packed.fixed_route(1) == packed.fixed_route(300) == "strip"
    part = packed.row_slice(32)
    assert torch.equal(part.run(x, "strip"), packed.run(x, "strip")[:, :32])
    with pytest.raises(ValueError, match="strips of 16"):
        packed.row_slice(40)
    for layout in (packed.layout | qgemm.ROUTE_INT, packed.layout | qgemm.ROUTE_FLOAT):
        y = torch.empty(3, 64)
        with pytest.raises(ValueError, match="PACKED"):
            qgemm.matmul(layout, x.data_ptr(), 128, 3, 128, packed._rows.data_ptr(), 0, 64, 0, y.data_ptr(), 64, 0)
    with pytest.raises(ValueError, match="PACKED"):  # 48 outputs are 3 strips; 40 are not
        qgemm.matmul(packed.layout, x.data_ptr(), 128, 3, 128, packed._rows.data_ptr(), 0, 40, 0, y.data_ptr(), 64, 0)
    assert qgemm.packed_strip_bytes(linear_module.Q4 | linear_module.SUPER, 128) == 0  # K not in 256s
    with pytest.raises(ValueError):  # rows not in strips of 16
        qgemm.pack(Linear(_weights("int4", w)).layout, 0, 0, 40, 128, 0)


INT8_KINDS = PACKED_KINDS  # QG_INT8: every packed layout


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("kind", INT8_KINDS)
def test_int8_activations_are_their_definition_on_every_isa(isa, kind, monkeypatch):
    """QG_INT8: the activations' int8 codes (|q| <= 127, max|x| / 127, half to even) times the weights'
    codes, summed exactly per block (Q8's by an offset of 128 taken off again), to float32 rounding of
    the emulated sums; the AVX-512 kernel (bytes in its own order, vpdpbusd) and the portable one
    give the same bits, one thread or two, at every row count and in any batch. Q5 strips are rewritten
    for it (qgemm.pack_int8: the sign masks in the kernel's byte order), and still dequantize to the
    same weight."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_parallel_threshold(0)
    try:
        for seed, num_rows in enumerate((1, 2, 3, 5, 8, 11, 17)):
            for dtype in (torch.float32, torch.bfloat16):
                w, x, bias = _inputs(seed, num_rows, 48, 256, dtype)
                _, packed = packed_pair(kind, w, bias, monkeypatch)
                int16, weight_before = packed.run(x, "strip"), packed.dequantize()
                assert packed.use_int8_activations() and packed.int8_activations
                assert packed.use_int8_activations()  # a second call changes nothing
                assert torch.equal(packed.dequantize(), weight_before)
                assert torch.equal(packed.dequantize(5, 29), weight_before[5:29])
                reference = packed.run(x, "strip")  # the CPU's own kernel, two threads
                weight = _weights(kind, w)
                emulated = (emulate_int8(x, weight, 127.0) if kind.startswith("int8")
                            else emulate_int4(x, weight, packed.half, 127.0)) + bias.double()
                _check(reference, emulated, dtype)
                if dtype == torch.float32:  # int16 codes really were replaced (the sums moved)
                    assert (reference - int16).abs().max() > 1e-4
                use_isa(isa)
                for threads in (1, 2):
                    cpu.set_num_threads(threads)
                    assert torch.equal(packed.run(x, "strip"), reference), (num_rows, dtype, threads)
                    for first, count in ((0, 1), (num_rows - 1, 1), (0, min(num_rows, 4))):
                        assert torch.equal(packed.run(x[first:first + count], "strip"),
                                           reference[first:first + count])
                cpu.set_isa("auto")
    finally:
        cpu.set_isa("auto")
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("kind", ["int4", "int5"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_activations_sum_extreme_codes_exactly(isa, kind, sign):
    """The largest sums the int8 kernels meet: every weight code at its top (Q4 15, Q5 31: the strips'
    unsigned bytes) against activations constant per row (every code +-127). AVX2 adds a block's
    byte products in int16 before widening them (Q4's eight pairs of vectors reach 30480, Q5's four
    31496): a sum that wrapped would move every output. Each ISA's kernel gives the emulated sums
    and the portable kernel's bits."""
    num_out, num_cols = 32, 256
    gen = torch.Generator().manual_seed(3)
    codes = torch.full((num_out, num_cols), 15 if kind == "int4" else 31, dtype=torch.uint8)
    scales = (torch.rand(num_out, num_cols // GROUP_SIZE, generator=gen) * 0.01 + 0.001).half().float()
    mins = (-8 * scales if kind == "int4" else -16 * scales).half().float()
    weight = (Int4Weight if kind == "int4" else Int5Weight).from_codes(codes, scales, mins)
    layer = Linear(weight)
    layer._pack()
    assert layer.use_int8_activations()
    x = torch.full((3, num_cols), sign * 0.5)
    x[1] *= 3.0
    x[2, :GROUP_SIZE] = 0  # one block of zeros: codes 0, sum 0
    expected = emulate_int4(x, weight, layer.half, 127.0)
    cpu.set_isa("baseline")
    try:
        portable = layer.run(x, "strip")
        _check(portable, expected, torch.float32)
        use_isa(isa)
        assert torch.equal(layer.run(x, "strip"), portable)
    finally:
        cpu.set_isa("auto")


def test_int8_activations_take_only_packed_layers(monkeypatch):
    """Row layouts, exact and dense layers keep their products (use_int8_activations says no); the C
    entry refuses QG_INT8 on rows, naming the layout."""
    w, x, bias = _inputs(0, 3, 48, 128, torch.float32)
    rows = Linear(_weights("int4", w), bias)
    assert not rows.is_packed_strips and not rows.use_int8_activations()
    exact = Linear(_weights("int4", w), bias, exact=True)
    exact._pack()
    assert not exact.use_int8_activations()
    assert not Linear(w, bias).use_int8_activations()  # dense
    y = torch.empty(3, 48)
    layout = rows.layout | qgemm.INT8
    with pytest.raises(ValueError, match=f"layout {layout}"):
        qgemm.matmul(layout, x.data_ptr(), 128, 3, 128, rows._rows.data_ptr(), 0, 48, 0, y.data_ptr(), 48, 0)
    assert linear_module.INT8 == qgemm.INT8


def test_which_layers_are_packed(monkeypatch):
    """Linear packs a quantized layer (Q4, Q5, Q8) where the CPU has AVX2 (AVX-512 VNNI's kernel or AVX2's),
    unless its outputs are not a multiple of 16, its products are exact, the ISA switch is below AVX2, or
    ENGINE_PACKED=0 / ENGINE_STRIP=0 says not to."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    monkeypatch.setenv("ENGINE_PACKED", "1")
    avx2 = cpu.allows("avx2")
    cpu.set_isa("baseline")
    try:
        assert not Linear(_weights("int4", w)).is_packed_strips
    finally:
        cpu.set_isa("auto")
    assert Linear(_weights("int4", w)).is_packed_strips == avx2
    assert Linear(_weights("q4_k", torch.randn(32, 256))).is_packed_strips == avx2
    assert not Linear(_weights("int4", w[:40])).is_packed_strips
    assert not Linear(_weights("int4", w), exact=True).is_packed_strips
    assert Linear(_weights("int8", w)).is_packed_strips == avx2
    assert Linear(_weights("int5_0", w)).is_packed_strips == avx2
    for switch in ("ENGINE_PACKED", "ENGINE_STRIP"):
        monkeypatch.setenv(switch, "0")
        assert not Linear(_weights("int4", w)).is_packed_strips
        monkeypatch.setenv(switch, "1")
