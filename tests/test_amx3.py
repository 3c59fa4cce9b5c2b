"""The amx3 route (cext/csrc/qgemm_amx3.h): packed strips' products as three bfloat16 products of
the split weights and activations on AMX-BF16 tiles, float32 sums. Against the float64 product of
the dequantized weights (the float route's definition), every packed format, 1-70 rows, one and
two threads, float32 and bfloat16 activations; rows independent of the batch; where it is offered."""
from __future__ import annotations

import pytest
import torch
from test_q6k_strips import strips_of
from test_qgemm import PACKED_KINDS, _inputs, packed_pair, row_layouts  # noqa: F401 (autouse: rows unpacked)
from test_quant import _q6_k_rows

from cext import cpu, qgemm
from engine.models import routes
from engine.models.linear import Linear

HAS_AMX = "amx_bf16" in cpu.features()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="CPU lacks AMX bf16 (the amx3 route's tiles)")


def _layer(kind: str, num_out: int, num_cols: int, bias: torch.Tensor, monkeypatch) -> Linear:
    if kind == "q6":
        raw = _q6_k_rows(num_out, num_cols // 256, seed=num_cols)
        return Linear(strips_of(raw), bias)
    w = torch.randn(num_out, num_cols, generator=torch.Generator().manual_seed(num_cols)) * 0.05
    return packed_pair(kind, w, bias, monkeypatch)[1]


def _assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, layer: Linear, bias: torch.Tensor) -> None:
    """|y - x W.T - b| within 2^-15 of |x| |W|.T plus float32's sums over K (2^-24 each): the split
    keeps 16 bits of each weight and activation and drops xl . wl (below 2^-16 of each term); a
    bfloat16 y adds its own rounding. One bfloat16 product (2^-9) would fail it."""
    dense = layer.dequantize().double()
    exact = x.double() @ dense.T + bias.double()
    magnitude = x.double().abs() @ dense.abs().T
    bound = magnitude * (2.0 ** -15 + x.shape[1] * 2.0 ** -24) + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0 ** -8
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", [*PACKED_KINDS, "q6"])
def test_every_packed_format_is_the_exact_product(kind, threads, monkeypatch):
    """Q4 (float32 and fp16 scales, Q4_K's super-blocks), Q5 (with and without mins), Q8 and Q6_K
    strips: 1-70 rows (one row tile, two, an odd one after pairs), three strips (a pair and a lone
    one), a bias, float32 and bfloat16 activations and outputs."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_num_threads(threads)
    cpu.set_parallel_threshold(0)
    try:
        num_cols = 512 if kind in ("q4_k", "q6") else 192
        bias = torch.randn(48, generator=torch.Generator().manual_seed(3))
        layer = _layer(kind, 48, num_cols, bias, monkeypatch)
        assert layer.can_run("amx3", 1)
        for seed, num_rows in enumerate((1, 2, 15, 16, 17, 33, 70)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(seed)).to(dtype)
                y = layer.run(x, "amx3")
                assert y.dtype == dtype and y.shape == (num_rows, 48)
                _assert_close_to_exact(y, x, layer, bias)
    finally:
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


@needs_amx
def test_wide_rows_take_k_in_chunks(monkeypatch):
    """K = 8,448 (264 blocks) at 67 rows: the activations' tiles (2.7 MB) pass the 2 MB of one
    chunk, so K runs in chunks with each C tile's sums stored between them; 80 outputs (five
    strips: pairs and a last lone strip)."""
    bias = torch.zeros(80)
    layer = _layer("int4_half", 80, 8448, bias, monkeypatch)
    x = torch.randn(67, 8448, generator=torch.Generator().manual_seed(1))
    _assert_close_to_exact(layer.run(x, "amx3"), x, layer, bias)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_k_in_chunks_over_items_of_several_pairs(threads, monkeypatch):
    """Where K runs in chunks the pool's items are a few runs of several pairs of strips (a thread's
    share in Q3_ITEMS_PER_THREAD items) and each chunk's panels are built for its blocks only: 336
    outputs (21 strips: ten pairs and a lone one, items of 3 + 3 + 3 + 2 pairs on two threads),
    K = 8,448 at 67 rows. The exact product, and each row's bits the same as in 16 rows (K in one
    chunk) or in a 40-row part (in chunks again)."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_num_threads(threads)
    cpu.set_parallel_threshold(0)
    try:
        bias = torch.randn(336, generator=torch.Generator().manual_seed(5))
        layer = _layer("int4_half", 336, 8448, bias, monkeypatch)
        x = torch.randn(67, 8448, generator=torch.Generator().manual_seed(6))
        whole = layer.run(x, "amx3")
        _assert_close_to_exact(whole, x, layer, bias)
        for first, count in ((0, 16), (27, 40)):
            assert torch.equal(layer.run(x[first:first + count], "amx3"), whole[first:first + count]), (first, count)
    finally:
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


@needs_amx
@pytest.mark.parametrize(("kind", "num_cols"), [("int5_0", 512), ("q6", 512), ("int4_half", 8448)])
def test_rows_do_not_depend_on_the_batch(kind, num_cols, monkeypatch):
    """A row's outputs have the same bits alone, in a pair of row tiles, in a lone tile after
    pairs, or beside padding; at K = 8,448 also whether K ran in one chunk (16 rows: their
    activations' tiles fit the 2 MB of one) or in chunks with the sums kept between them (70)."""
    layer = _layer(kind, 32, num_cols, torch.zeros(32), monkeypatch)
    x = torch.randn(70, num_cols, generator=torch.Generator().manual_seed(2))
    whole = layer.run(x, "amx3")
    _assert_close_to_exact(whole, x, layer, torch.zeros(32))
    for first, count in ((0, 1), (5, 1), (3, 16), (0, 17), (20, 33), (69, 1), (1, 69)):
        assert torch.equal(layer.run(x[first:first + count], "amx3"), whole[first:first + count]), (first, count)


def test_offered_for_packed_strips_where_amx_bf16_is(monkeypatch):
    """The route table has amx3 exactly where the CPU has AMX-BF16 (ENGINE_AMX3=0 leaves it out);
    only packed strips without int8 codes can run it, and the C entry refuses the rest by name."""
    assert ("amx3" in routes.available_routes(False)) == HAS_AMX
    assert "amx3" in routes.EXACT_ROUTES
    monkeypatch.setenv("ENGINE_AMX3", "0")
    assert "amx3" not in routes.available_routes(False)
    w, x, bias = _inputs(1, 3, 48, 192, torch.float32)
    rows, packed = packed_pair("int4", w, bias, monkeypatch)
    assert not rows.can_run("amx3", 64)
    assert packed.can_run("amx3", 64) == HAS_AMX
    int8 = packed_pair("int5", w, bias, monkeypatch)[1]
    assert int8.use_int8_activations()
    assert not int8.can_run("amx3", 64)
    y = torch.empty(3, 48)
    with pytest.raises(ValueError, match="PACKED"):
        qgemm.matmul(int8.layout | qgemm.ROUTE_AMX, x.data_ptr(), 192, 3, 192, int8._rows.data_ptr(), 0, 48, 0,
                     y.data_ptr(), 48, 0)
