"""Q6_K weights in their own codes (cext/csrc/qgemm.h's QG_Q6 | QG_PACKED, engine.models.quant's
PackedQ6Weight): the strips made from a file's rows dequantize to gguf.quants' values, and products
are their integer definition (int16 activation codes per block of 32, sums of (q - 32) x per group
of 16, each group's scale d * s) on every instruction set, thread count and batch; the loader
makes them for Q6_K tensors where the kernels take strips, and only there."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from model_fixtures import gemma3_gguf, qwen_gguf  # noqa: F401 (fixtures)
from test_fused_kernels import ALL_ISAS, use_isa
from test_qgemm import quantize_activations
from test_quant import _q6_k_rows

from cext import cpu, qgemm
from engine.models import linear as linear_module
from engine.models.linear import Linear, packs
from engine.models.quant import Int4Weight, Int8Weight, PackedQ6Weight, RowParts, cat_rows

LAYOUT = qgemm.Q6 | qgemm.PACKED


def strips_of(raw: np.ndarray) -> PackedQ6Weight:
    num_rows, num_cols = raw.shape[0], raw.shape[1] // 210 * 256
    strips = torch.empty(num_rows // 16, qgemm.packed_strip_bytes(LAYOUT, num_cols), dtype=torch.uint8)
    qgemm.q6k_pack(np.ascontiguousarray(raw).ctypes.data, num_rows, num_cols, strips.data_ptr())
    return PackedQ6Weight(strips, (num_rows, num_cols))


def codes_and_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K rows -> (codes q - 32 [N, K], group scales d * s [N, K / 16] float32), decoded from the
    bytes as ggml's dequantize_row_q6_K reads them."""
    num_rows = raw.shape[0]
    blocks = raw.reshape(num_rows, -1, 210)
    ql, qh, sc = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208].view(np.int8)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)
    codes = np.empty((num_rows, blocks.shape[1], 256), dtype=np.int32)
    for half in range(2):
        low = ql[..., 64 * half:64 * half + 64].astype(np.int32)
        high = qh[..., 32 * half:32 * half + 32].astype(np.int32)
        base = 128 * half
        codes[..., base:base + 32] = (low[..., :32] & 15) | ((high & 3) << 4)
        codes[..., base + 32:base + 64] = (low[..., 32:] & 15) | (((high >> 2) & 3) << 4)
        codes[..., base + 64:base + 96] = (low[..., :32] >> 4) | (((high >> 4) & 3) << 4)
        codes[..., base + 96:base + 128] = (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)
    scales = d[..., None] * sc.astype(np.float32)  # [N, blocks, 16]: exact in float32
    return (codes - 32).reshape(num_rows, -1), scales.reshape(num_rows, -1)


def emulate(x: torch.Tensor, raw: np.ndarray, xmax: float = 32767.0) -> torch.Tensor:
    """The product's definition in float64: sum over groups of (d s) * dx * sum (q - 32) x_codes, the
    activations' codes int16 (xmax 32767) or int8 (127: QG_INT8)."""
    codes, dx, _ = quantize_activations(x, xmax)  # [M, K/32, 32], [M, K/32]
    c, scales = codes_and_scales(raw)
    c = torch.from_numpy(c).double().reshape(c.shape[0], -1, 16)  # [N, K/16, 16]
    xg = codes.reshape(codes.shape[0], -1, 16)  # [M, K/16, 16]
    dots = torch.einsum("mgj,ngj->mng", xg, c)  # [M, N, K/16] integers
    dxg = dx.repeat_interleave(2, dim=1)  # each block's scale for its two groups
    return (dots * dxg[:, None] * torch.from_numpy(scales).double()[None]).sum(-1)


def assert_within_rounding(y: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y within float32's rounding of sums of K terms (K 2^-24 times the sum of the terms' magnitudes)
    of the float64 expected, plus bfloat16's rounding of the output when y is bfloat16. Random Q6_K
    bytes make weights up to ~80, so a fixed tolerance would be too loose for some rows and too tight
    for others."""
    magnitude = x.abs().double() @ w.abs().double().T  # [M, N]
    bound = magnitude * x.shape[1] * 2.0 ** -24
    if y.dtype == torch.bfloat16:
        bound = bound + expected.abs() * 2.0 ** -8
    assert ((y.double() - expected).abs() <= bound + 1e-30).all(), (y.double() - expected).abs().max()


def test_strips_dequantize_to_the_files_values():
    """Every row (any first row, float32 and bfloat16) dequantizes to gguf.quants' value, bit for
    bit, subnormal factors and scales of -128 included; lookups read the same."""
    raw = _q6_k_rows(48, 3, seed=3)
    raw.reshape(48, 3, 210)[0, 0, 192] = 0x80  # an int8 scale of -128
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(48, -1))
    weight = strips_of(raw)
    assert weight.is_exact and weight.shape == (48, 768)
    assert weight.strips.numel() == 48 * 3 * 210  # Q6_K's own 6.5625 bits a weight
    assert torch.equal(weight.dequantize(), expected)
    layer = Linear(weight)
    assert layer.format == "q6" and layer.is_packed_strips and layer.is_exact is False
    assert torch.equal(layer.dequantize(13, 37), expected[13:37])
    out = torch.empty(20, 768, dtype=torch.bfloat16)
    qgemm.dequantize(layer.layout, layer._rows.data_ptr(), 0, 11, 20, 768, out.data_ptr(), qgemm.BFLOAT16)
    assert torch.equal(out, expected[11:31].bfloat16())
    ids = torch.tensor([[3, 47], [0, 3]])
    assert torch.equal(weight.rows(ids, torch.float32), expected[ids])
    assert torch.equal(layer.rows(ids, torch.float32), expected[ids])


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_products_are_their_definition_on_every_isa(isa):
    """The AVX-512 kernel (or the portable one below AVX-512 VNNI) against the float64 definition, and
    bit for bit against each other: one thread and two, 1-8-row passes and their tails, float32 and
    bfloat16 activations, with a bias; blas (the dequantized weight) agrees to float32 rounding."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_parallel_threshold(0)
    try:
        for seed, num_rows in enumerate((1, 2, 3, 4, 5, 8, 11, 17)):
            raw = _q6_k_rows(32, 2, seed=10 + seed)
            layer = Linear(strips_of(raw), bias := torch.randn(32, generator=torch.Generator().manual_seed(seed)))
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(seed)).to(dtype)
                x[0, :32] = 0  # an all-zero block
                cpu.set_isa("auto")
                cpu.set_num_threads(2)
                reference = layer.run(x, "strip")
                assert reference.dtype == dtype and reference.shape == (num_rows, 32)
                weights = layer.dequantize()
                assert_within_rounding(reference, emulate(x.float(), raw) + bias.double(), x.float(), weights)
                use_isa(isa)
                for threads in (1, 2):
                    cpu.set_num_threads(threads)
                    assert torch.equal(layer.run(x, "strip"), reference), (isa, num_rows, dtype, threads)
                if dtype == torch.float32:
                    exact = x.double() @ weights.double().T + bias.double()
                    assert_within_rounding(layer.run(x, "blas"), exact, x, weights)
    finally:
        cpu.set_isa("auto")
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_int8_activations_are_their_definition_on_every_isa(isa):
    """QG_INT8 on the same strips (no repacking: pack_int8 leaves them): int8 activation codes times
    the unsigned codes (vpdpbusd), 32 times the groups' code sums taken off; the AVX-512 kernel and the
    portable one give the same bits at every row count, alone or in a batch."""
    old_threads, old_threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    cpu.set_parallel_threshold(0)
    try:
        raw = _q6_k_rows(48, 2, seed=21)
        layer = Linear(strips_of(raw))
        before = layer.dequantize()
        assert layer.use_int8_activations() and layer.int8_activations
        assert torch.equal(layer.dequantize(), before)
        for seed, num_rows in enumerate((1, 2, 3, 5, 8, 11, 17)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(seed)).to(dtype)
                cpu.set_isa("auto")
                cpu.set_num_threads(2)
                reference = layer.run(x, "strip")
                assert_within_rounding(reference, emulate(x.float(), raw, 127.0), x.float(), before)
                use_isa(isa)
                for threads in (1, 2):
                    cpu.set_num_threads(threads)
                    assert torch.equal(layer.run(x, "strip"), reference), (isa, num_rows, dtype, threads)
                    for first, count in ((0, 1), (num_rows - 1, 1), (0, min(num_rows, 4))):
                        assert torch.equal(layer.run(x[first:first + count], "strip"), reference[first:first + count])
    finally:
        cpu.set_isa("auto")
        cpu.set_num_threads(old_threads)
        cpu.set_parallel_threshold(old_threshold)


def test_rows_do_not_depend_on_the_batch():
    """A row's outputs are the same alone or beside others, in any pass (the passes of 1-2 rows take
    the groups' code sums off per row, 3-8 per code: the same integers)."""
    raw = _q6_k_rows(32, 1, seed=5)
    layer = Linear(strips_of(raw))
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(1))
    whole = layer.run(x, "strip")
    for count in range(1, 18):
        for first in (0, 3, 21 - count):
            assert torch.equal(layer.run(x[first:first + count], "strip"), whole[first:first + count]), count


def test_bad_layouts_and_shapes_are_errors():
    """Q6 exists only in strips: the C entries refuse the rest, naming the layout; K must be a multiple
    of 256 and the rows of 16."""
    y, x = torch.empty(1, 16), torch.zeros(1, 256)
    for layout in (qgemm.Q6, qgemm.Q6 | qgemm.INT8, LAYOUT | qgemm.HALF, LAYOUT | qgemm.ROUTE_INT):
        with pytest.raises(ValueError, match=f"layout {layout}: unknown layout"):
            qgemm.matmul(layout, x.data_ptr(), 256, 1, 256, 0, 0, 16, 0, y.data_ptr(), 16, qgemm.FLOAT32)
    with pytest.raises(ValueError, match=r"256 \(SUPER, Q6\)"):
        qgemm.matmul(LAYOUT, x.data_ptr(), 256, 1, 128, 0, 0, 16, 0, y.data_ptr(), 16, qgemm.FLOAT32)
    with pytest.raises(ValueError, match="unknown layout"):
        qgemm.dequantize(qgemm.Q6, 0, 0, 0, 1, 256, 0)
    with pytest.raises(ValueError, match="unknown layout"):
        qgemm.pack(qgemm.Q6, 0, 0, 16, 256, 0)
    with pytest.raises(ValueError, match="256"):
        qgemm.q6k_pack(0, 16, 320, 0)
    with pytest.raises(ValueError, match="unknown layout"):  # rows not in strips of 16
        qgemm.q6k_pack(0, 24, 256, 0)
    assert qgemm.packed_strip_bytes(LAYOUT, 512) == 2 * 16 * 210 and qgemm.packed_strip_bytes(LAYOUT, 320) == 0
    assert linear_module.Q6 == qgemm.Q6


def test_strips_concatenate_and_mix_by_requantizing():
    """Fused layers: Q6 strips beside Q6 strips stay Q6 (their strips in order); beside a dense tensor
    the whole becomes int8 re-quantized, as any other mix does (beside quantized rows: parts, below)."""
    a, b = _q6_k_rows(32, 1, seed=1), _q6_k_rows(16, 1, seed=2)
    joined = cat_rows([strips_of(a), strips_of(b)])
    assert isinstance(joined, PackedQ6Weight) and joined.shape == (48, 256)
    assert torch.equal(joined.dequantize(), torch.cat([strips_of(a).dequantize(), strips_of(b).dequantize()]))
    mixed = cat_rows([torch.randn(16, 256), strips_of(b)])
    assert isinstance(mixed, Int8Weight) and mixed.shape == (32, 256)
    assert isinstance(cat_rows([Int8Weight.from_dense(torch.randn(16, 256)), strips_of(b)]), RowParts)


def test_q6_strips_beside_another_format_stay_in_parts():
    """A fused layer of Q4 rows and Q6_K strips (a Q4_K_M file's q/k beside its v) keeps both in their
    codes: RowParts (the Q4 runs fused), one Linear whose output is each part's product in its columns,
    bias and all, on every route the parts take; int8 activations reach every part."""
    gen = torch.Generator().manual_seed(3)
    q = Int4Weight.from_dense(torch.randn(32, 256, generator=gen))
    k = Int4Weight.from_dense(torch.randn(16, 256, generator=gen))
    v = strips_of(_q6_k_rows(16, 1, seed=4))
    fused = cat_rows([q, k, v])
    assert isinstance(fused, RowParts) and [type(p) for p in fused.parts] == [Int4Weight, PackedQ6Weight]
    assert fused.shape == (64, 256)
    bias = torch.randn(64, generator=gen)
    layer = Linear(fused, bias)
    assert layer.format == "parts" and [p.out_features for p in layer.parts] == [48, 16]
    weights = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(layer.dequantize(), weights)
    for num_rows in (1, 3, 9):
        x = torch.randn(num_rows, 256, generator=gen)
        y = layer(x)
        assert torch.equal(y, torch.cat([layer.parts[0](x), layer.parts[1](x)], dim=1))
        # within the int16 activation codes' rounding (2^-16 of a block's largest |x|) of the exact product
        exact = x.double() @ weights.double().T + bias.double()
        assert ((y.double() - exact).abs() <= 2e-4 * (x.abs().double() @ weights.abs().double().T) + 1e-6).all()
        out = torch.empty(num_rows, 64)
        assert layer(x, out) is out and torch.equal(out, y)
        assert torch.equal(layer.run(x, "blas"), torch.cat([p.run(x, "blas") for p in layer.parts], dim=1))
    if layer.parts[0].is_packed_strips:
        assert layer.use_int8_activations() and layer.int8_activations


def test_loader_keeps_q6_k_tensors_in_their_codes(qwen_gguf):  # noqa: F811
    """Qwen2.5-Coder-0.5B's Q6_K down projections load as PackedQ6Weight where the kernels take strips
    (the file's values exactly, and the product its int16 definition to float32's rounding), else as int8
    re-quantized; never a permuted family's q/k, an MoE expert's rows or an untied embedding."""
    from engine.gguf_file import GGUFFile
    from engine.loader.gguf_loader import GGUFStateDict, _ExpertRows, read_config

    with GGUFFile(qwen_gguf, with_vocabulary=False) as f:
        gguf_name = next(n for n, t in f.tensors.items() if t.ggml_type == 14 and n.startswith("blk."))
        layer = gguf_name.split(".")[1]
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        config = read_config(f)
        state = GGUFStateDict(f, config, "auto", torch.float32)
        exact = GGUFStateDict(f, config, "float32", torch.float32)
        weight, dense = state[name], exact[name]
        info = f.tensors[gguf_name]
        raw = f.raw(gguf_name).copy()
        assert state._takes_q6_strips(name, info) == packs(info.shape[0])
        state.is_permuted = True
        assert not state._takes_q6_strips(name.replace("mlp.down_proj", "self_attn.q_proj"), info)
        assert state._takes_q6_strips(name.replace("mlp.down_proj", "self_attn.v_proj"), info) == packs(info.shape[0])
        assert not state._takes_q6_strips(name, _ExpertRows(gguf_name, info.dims, 14, 0))
        assert not state._takes_q6_strips("model.embed_tokens.weight", info) or config.tie_word_embeddings
        state.exact_products = True
        assert not state._takes_q6_strips(name, info)
    if not packs(info.shape[0]):
        assert isinstance(weight, Int8Weight) and not weight.is_exact
        return
    assert isinstance(weight, PackedQ6Weight) and torch.equal(weight.dequantize(), dense)
    # the product is its definition (int16 activation codes, the file's Q6_K codes) to float32's rounding
    # (a fixed atol against the exact product failed one output in 2,688 for an unseeded x)
    x = torch.randn(3, dense.shape[1], generator=torch.Generator().manual_seed(0))
    assert_within_rounding(Linear(weight)(x), emulate(x, raw), x, dense)


def test_rows_reordered_after_load_fall_back_to_int8():
    """A partial-rotary family reorders its fused qkv rows after load (engine.models.llama._map_rows:
    Phi-4-mini's attn_qkv may be Q6_K): strips cannot be reordered, so the weight becomes int8
    re-quantized, its rows in the new order."""
    from engine.models.llama import _map_rows

    v = strips_of(_q6_k_rows(32, 1, seed=6))
    gen = torch.Generator().manual_seed(0)
    for weight in (v, RowParts([Int4Weight.from_dense(torch.randn(16, 256, generator=gen)), v])):
        dense = weight.dequantize()
        order = torch.randperm(dense.shape[0], generator=gen)
        moved = _map_rows(weight, order)
        assert isinstance(moved, Int8Weight) and moved.shape == dense.shape
        expected = dense[order].reshape(dense.shape[0], -1, 32)
        step = expected.abs().amax(-1, keepdim=True) / 127
        assert ((moved.dequantize().reshape(expected.shape) - expected).abs() <= step / 2 + 1e-5).all()


def test_parts_keep_a_dense_copy_for_long_prompts():
    """dense_above_rows on a layer in parts: beyond it the dense float32 copy runs (as for any layer)."""
    q = Int4Weight.from_dense(torch.randn(16, 256, generator=torch.Generator().manual_seed(1)))
    layer = Linear(RowParts([q, strips_of(_q6_k_rows(16, 1, seed=7))]), dense_above_rows=4)
    assert layer.dense is not None
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ layer.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), exact, atol=1e-3, rtol=1e-4)
    assert torch.equal(layer(x[:4]), torch.cat([layer.parts[0](x[:4]), layer.parts[1](x[:4])], dim=1))


def test_q5_0_beside_q8_0_stays_in_parts_with_the_same_bits(gemma3_gguf):  # noqa: F811
    """Gemma 3's Q5_0 q/k beside a Q8_0 v: two parts (int5 strips and int8 strips, 5.5 and 8.5 bits a
    weight) where the whole was int8 (q - 16); the products are the same bits as the int8 form's."""
    from engine.gguf_file import GGUFFile
    from engine.loader.gguf_loader import GGUFStateDict, read_config
    from engine.models.quant import Int5Weight

    with GGUFFile(gemma3_gguf, with_vocabulary=False) as f:
        state = GGUFStateDict(f, read_config(f), "auto", torch.float32)
        q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert isinstance(q, Int5Weight) and isinstance(v, Int8Weight) and v.is_exact
    fused = cat_rows([q, k, v])
    assert isinstance(fused, RowParts) and [type(p) for p in fused.parts] == [Int5Weight, Int8Weight]
    assert isinstance(cat_rows([q, v, k]), Int8Weight)  # three runs: the int8 form, as before
    parts, whole = Linear(fused), Linear(Int8Weight.cat([q.to_int8(), k.to_int8(), v]))
    for num_rows in (1, 3, 8, 17):
        x = torch.randn(num_rows, q.shape[1], generator=torch.Generator().manual_seed(num_rows))
        assert torch.equal(parts(x), whole(x))
