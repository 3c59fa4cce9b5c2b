"""Quantized weights: ggml 4-bit blocks repacked into aten's int4 format exactly (against
gguf.quants' dequantization, with float32 activations), on synthetic tensors and on real ones
of both models (Q/K rows permuted for llama); int8 per block of 32 (Q8_0 exact) and the
quantization option."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import qwen_gguf, smollm2_gguf  # noqa: F401 (fixtures)

from engine.gguf_file import GGUFFile
from engine.loader import load_model, resolve_options
from engine.loader.gguf_loader import GGUFStateDict, read_config
from engine.loader.repack import Q4_0, Q4_1, Q4_K, MappedRows, dequantize, int4_from_q4, int5_from_q5
from engine.models.linear import Linear
from engine.models.quant import Int4Weight, Int5Weight, Int8Weight, PackedInt8Weight, PackedQ6Weight, cat_rows

ATOL = 1e-4


def random_blocks(rng: np.random.Generator, ggml_type: int, num_rows: int, num_cols: int) -> np.ndarray:
    """Random valid ggml blocks (random codes and 6-bit scales, finite fp16 d / m)."""
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    num_blocks = num_cols // block_elements
    raw = rng.integers(0, 256, size=(num_rows, num_blocks, block_bytes), dtype=np.uint8)
    num_halves = 1 if ggml_type == Q4_0 else 2  # d, or d and m / dmin
    halves = rng.uniform(-0.05, 0.05, size=(num_rows, num_blocks, num_halves)).astype(np.float16)
    if ggml_type == Q4_K:
        halves = np.abs(halves)
    raw[..., : 2 * num_halves] = halves.view(np.uint8).reshape(num_rows, num_blocks, 2 * num_halves)
    return raw.reshape(num_rows, num_blocks * block_bytes)


def gguf_dequantize(raw: np.ndarray, ggml_type: int, num_cols: int) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(raw.shape[0], num_cols))


def assert_int4_product_exact(weight: Int4Weight, exact: torch.Tensor, seed: int = 0) -> None:
    """Linear with float32 activations equals x @ exact.T (the aten int4 op, not our dequantize)."""
    x = torch.randn(3, exact.shape[1], generator=torch.Generator().manual_seed(seed))  # [T, K]
    y = Linear(weight, exact=True)(x)  # [T, N]
    torch.testing.assert_close(y, x @ exact.T, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q4_K])
def test_int4_repack_is_exact_on_random_blocks(ggml_type):
    rng = np.random.default_rng(ggml_type)
    raw = random_blocks(rng, ggml_type, 48, 512)
    weight = int4_from_q4(raw, ggml_type, 512)
    exact = gguf_dequantize(raw, ggml_type, 512)
    assert weight.shape == (48, 512) and int(weight.codes.max()) <= 15
    torch.testing.assert_close(weight.dequantize(), exact, atol=1e-6, rtol=1e-6)
    assert_int4_product_exact(weight, exact)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_own_dequantize_matches_gguf(qtype):
    ggml_type = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, ggml_type).view(np.uint8).reshape(16, -1)
    np.testing.assert_array_equal(dequantize(raw, int(ggml_type), (16, 128)),
                                  gguf_dequantize(raw, int(ggml_type), 128).numpy())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_repack_of_gguf_quantized_weights(qtype):
    ggml_type = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32) * 0.02
    raw = gguf.quants.quantize(w, ggml_type)  # [64, bytes per row]
    exact = gguf_dequantize(raw, int(ggml_type), 256)
    assert (exact - torch.from_numpy(w)).abs().max() < 0.02  # really a 4-bit approximation of w
    assert_int4_product_exact(int4_from_q4(raw, int(ggml_type), 256), exact)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_int5_repack_of_gguf_quantized_weights(qtype):
    ggml_type = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(2).standard_normal((24, 256)).astype(np.float32) * 0.02
    raw = gguf.quants.quantize(w, ggml_type)  # [24, bytes per row]
    exact = gguf_dequantize(raw, int(ggml_type), 256)
    assert (exact - torch.from_numpy(w)).abs().max() < 0.01  # a 5-bit approximation of w
    int5 = int5_from_q5(raw, int(ggml_type), 256)
    torch.testing.assert_close(int5.dequantize(), exact, atol=0, rtol=0)
    linear = Linear(int5)
    assert linear.format == "int5"
    torch.testing.assert_close(linear.dequantize(), exact, atol=1e-7, rtol=0)  # (m + 16 d) - 16 d: float32 rounding
    x = torch.randn(3, 256)
    torch.testing.assert_close(Linear(int5, exact=True)(x), x @ exact.T, atol=ATOL, rtol=1e-5)
    permuted = int5.map_rows(lambda t: t.flip(0))
    torch.testing.assert_close(permuted.dequantize(), exact.flip(0), atol=0, rtol=0)


def test_fused_rows_and_permutation_keep_codes_scales_zeros_together():
    rng = np.random.default_rng(7)
    parts = [int4_from_q4(random_blocks(rng, Q4_1, n, 64), Q4_1, 64) for n in (8, 4, 4)]
    fused = cat_rows(parts)
    expected = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(fused.dequantize(), expected)
    perm = torch.randperm(16)
    torch.testing.assert_close(fused.map_rows(lambda t: t[perm]).dequantize(), expected[perm])
    mixed = cat_rows([parts[0], Int8Weight.from_dense(parts[1].dequantize())])  # a Q8_0 V beside Q4 Q/K
    assert isinstance(mixed, Int8Weight) and mixed.shape == (12, 64)


def block_step(w: torch.Tensor) -> torch.Tensor:
    """The int8 step of each weight's block of 32 (absmax / 127), [N, K]."""
    blocks = w.reshape(w.shape[0], -1, 32)
    return (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(w.shape)


def test_int8_block_bounds_and_product():
    w = torch.randn(40, 96) * torch.linspace(0.01, 1.0, 40)[:, None]
    int8 = Int8Weight.from_dense(w)
    assert int8.scales.shape == (40, 3) and not int8.is_exact
    assert ((int8.dequantize() - w).abs() <= block_step(w) / 2 + 1e-7).all()
    x = torch.randn(5, 96)
    torch.testing.assert_close(Linear(int8, exact=True)(x), x @ int8.dequantize().T, atol=ATOL, rtol=1e-5)
    ids = torch.tensor([3, 0, 39])
    torch.testing.assert_close(int8.rows(ids, torch.float32), int8.dequantize()[ids])


def test_q8_0_loads_as_its_own_codes_and_scales(smollm2_gguf):  # noqa: F811
    name = "model.embed_tokens.weight"  # SmolLM2: Q8_0, tied to the head
    head = converted(smollm2_gguf, [name], "auto")[name]
    exact = converted(smollm2_gguf, [name], "float32")[name]
    # Int8Weight, or its strips where the kernels take them (packed by the loader a chunk at a time)
    assert isinstance(head, (Int8Weight, PackedInt8Weight)) and head.is_exact and head.exact_rows is None
    torch.testing.assert_close(head.dequantize(), exact, atol=0, rtol=0)


def test_int4_from_dense_error_is_half_a_step():
    w = torch.randn(16, 128)
    int4 = Int4Weight.from_dense(w)
    groups = w.reshape(16, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [16, 4]
    error = (int4.dequantize() - w).abs().reshape(16, 4, 32)
    assert (error <= step[..., None] / 2 + 1e-6).all()


def converted(path, names: list[str], quantization: str):
    with GGUFFile(path) as f:
        config = read_config(f)
        lazy = GGUFStateDict(f, config, quantization, torch.float32)
        return {name: lazy[name] for name in names}


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",  # permuted rows
                                  "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.7.mlp.down_proj.weight"])
def test_smollm2_q4_1_tensors_repack_exactly(smollm2_gguf, name):  # noqa: F811
    int4 = converted(smollm2_gguf, [name], "auto")[name]
    exact = converted(smollm2_gguf, [name], "float32")[name]  # gguf.quants + unpermute, float32
    assert isinstance(int4, Int4Weight)
    torch.testing.assert_close(int4.dequantize(), exact, atol=1e-6, rtol=1e-6)
    assert_int4_product_exact(int4, exact)


def test_qwen_tensors_q4_k_and_q5_0_exact_and_others_int8(qwen_gguf):  # noqa: F811
    with GGUFFile(qwen_gguf) as f:
        q4_k = [n for n, t in f.tensors.items() if t.ggml_type == Q4_K]
        types = {t.ggml_type for t in f.tensors.values()}
        q6_k = [n for n, t in f.tensors.items() if t.ggml_type == 14 and n.startswith("blk.")]
    assert q4_k and {6, 8, 14} <= types  # Q4_K beside Q5_0, Q8_0 and Q6_K layers
    layer = q4_k[0].split(".")[1]
    q6_layer = q6_k[0].split(".")[1]
    names = [f"model.layers.{layer}.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
             f"model.layers.{q6_layer}.mlp.down_proj.weight"]
    assert q6_k[0] == f"blk.{q6_layer}.ffn_down.weight"
    auto, exact = converted(qwen_gguf, names, "auto"), converted(qwen_gguf, names, "float32")
    down = auto[names[0]]
    assert isinstance(down, Int4Weight)
    assert_int4_product_exact(down, exact[names[0]])
    q = auto[names[1]]  # Q5_0 -> Int5Weight (the file's nibbles and fifth bits, scale d, min -16 d): exact
    assert isinstance(q, Int5Weight)
    torch.testing.assert_close(q.dequantize(), exact[names[1]], atol=0, rtol=0)
    linear = Linear(q)
    assert (linear.format, linear.half) == ("int5", True)
    torch.testing.assert_close(linear.dequantize(), exact[names[1]], atol=0, rtol=0)  # the kernels' layout
    as_int8 = q.to_int8()  # what a fused layer beside a Q8_0 tensor gets: codes q - 16, scales d
    assert as_int8.is_exact and int(as_int8.codes.min()) >= -16 and int(as_int8.codes.max()) <= 15
    torch.testing.assert_close(as_int8.dequantize(), exact[names[1]], atol=0, rtol=0)
    q6 = auto[names[2]]  # Q6_K: its own codes in strips where the kernels take them (tests/test_q6k_strips.py),
    if isinstance(q6, PackedQ6Weight):  # else int8 per block, within half an int8 step of the exact weight
        assert q6.is_exact and torch.equal(q6.dequantize(), exact[names[2]])
    else:
        assert isinstance(q6, Int8Weight) and not q6.is_exact
        assert ((q6.dequantize() - exact[names[2]]).abs() <= block_step(exact[names[2]]) / 2 + 1e-6).all()


@pytest.mark.parametrize("ggml_type", [8, 14])  # Q8_0 (its own codes) and Q6_K (re-quantized)
def test_int8_head_packed_a_chunk_at_a_time_is_the_int8_head(qwen_gguf, ggml_type, monkeypatch):  # noqa: F811
    """Where the kernels take strips (AVX2 and up) the loader packs an int8 head chunk by chunk
    (PackedInt8Weight: the int8 rows never whole beside their strips): the same weights, lookups and
    products as the Int8Weight it makes otherwise, packed by Linear."""
    from cext import cpu

    with GGUFFile(qwen_gguf, with_vocabulary=False) as f:
        name = next(n for n, t in f.tensors.items() if t.ggml_type == ggml_type and n.startswith("blk."))
        info = f.tensors[name]
        state = GGUFStateDict(f, read_config(f), "auto", torch.float32)
        monkeypatch.setattr("engine.loader.gguf_loader.CHUNK_ROWS", 32)  # several chunks
        monkeypatch.setenv("ENGINE_PACKED", "0")
        rows = state._int8(f.raw(name), info, may_pack=True)
        monkeypatch.setenv("ENGINE_PACKED", "1")
        packed = state._int8(f.raw(name), info, may_pack=True)
        assert isinstance(state._int8(f.raw(name), info), Int8Weight)  # a projection: row operations follow
        state.exact_products = True  # an exact model's head stays in rows
        assert isinstance(state._int8(f.raw(name), info, may_pack=True), Int8Weight)
    assert isinstance(rows, Int8Weight) and rows.is_exact == (ggml_type == 8)
    if "avx2" not in cpu.features():
        assert isinstance(packed, Int8Weight)
        return
    assert isinstance(packed, PackedInt8Weight) and packed.is_exact == rows.is_exact
    assert torch.equal(packed.dequantize(), rows.dequantize())
    ids = torch.tensor([[0, 17], [info.shape[0] - 1, 3]])
    assert torch.equal(packed.rows(ids, torch.float32), rows.dequantize()[ids])
    from_loader, from_rows = Linear(packed), Linear(rows)
    assert from_loader.is_packed_strips and from_rows.is_packed_strips
    x = torch.randn(3, info.shape[1])
    assert torch.equal(from_loader(x), from_rows(x))


def test_quantization_option_is_validated(tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        load_model(tmp_path / "missing.gguf", quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        resolve_options("float32", "bfloat16")
    assert resolve_options(None, "auto") == "float32" and resolve_options(None, "bfloat16") == "bfloat16"
    assert resolve_options("bfloat16", "int4") == "bfloat16"


@pytest.mark.slow
def test_default_model_formats_and_exact_mode(smollm2_gguf):  # noqa: F811
    model = load_model(smollm2_gguf)
    assert model.dtype == torch.float32 and not model.layers[0].qkv_proj.is_exact  # the C kernels' product
    layer = model.layers[0]
    assert {layer.qkv_proj.format, layer.o_proj.format, layer.gate_up_proj.format, layer.down_proj.format} == {"int4"}
    assert model.head_proj.format == "int8" and model.embed_rows is model.head_int8  # tied Q8_0 embedding
    exact = load_model(smollm2_gguf, quantization="float32")
    ids = torch.tensor([[0, 5], [49151, 1234]])
    torch.testing.assert_close(model.head_rows(ids), exact.lm_head[ids])  # exact rows from the map
    torch.testing.assert_close(model.embed_tokens(ids[0]), exact.embed[ids[0]])
    dense = load_model(smollm2_gguf, quantization="bfloat16")
    assert dense.layers[0].qkv_proj.format == "dense" and dense.head_proj.format == "dense"


@pytest.mark.parametrize("ggml_type, block_bytes, block", [(14, 210, 256), (8, 34, 32), (6, 22, 32)])
def test_mapped_rows_of_no_ids(ggml_type, block_bytes, block):
    """A forward with no logit rows (a prompt's inner chunk) asks the refined head for no rows:
    Q6_K (gguf.quants) failed on the empty gather, so any chunked prompt on Qwen2.5-Coder-1.5B,
    whose head is Q6_K, failed its request."""
    raw = np.zeros((3, 2 * block_bytes), dtype=np.uint8)
    rows = MappedRows(raw, ggml_type, (3, 2 * block))
    out = rows.rows(torch.empty(0, 5, dtype=torch.int64), torch.float32)
    assert out.shape == (0, 5, 2 * block) and out.dtype == torch.float32
    assert rows.rows(torch.tensor([[2, 0]]), torch.float32).shape == (1, 2, 2 * block)


def _q6_k_rows(num_rows: int, num_blocks: int, seed: int) -> np.ndarray:
    """Random Q6_K rows with finite fp16 factors (the last two bytes of each 210-byte block)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (num_rows, num_blocks, 210), dtype=np.uint8)
    d = rng.uniform(-0.02, 0.02, (num_rows, num_blocks)).astype(np.float16)
    d[0, 0] = np.float16(6e-8)  # a subnormal factor
    raw[..., 208:] = d[..., None].view(np.uint8)
    return raw.reshape(num_rows, num_blocks * 210)


def test_q6_k_rows_dequantize_in_c_as_gguf_quants_does():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from cext import qgemm

    raw = _q6_k_rows(7, 6, seed=1)
    out = np.full((7, 6 * 256), np.nan, dtype=np.float32)
    qgemm.dequantize_q6_k(raw, out)
    expected = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(7, -1)
    assert np.array_equal(out, expected)
    with pytest.raises(ValueError, match="multiple of 210"):
        qgemm.dequantize_q6_k(np.ascontiguousarray(raw[:, :209]), out)
    with pytest.raises(ValueError, match="Q6_K rows"):
        qgemm.dequantize_q6_k(raw, np.ascontiguousarray(out[:, :256]))


def test_mapped_rows_read_in_c_as_in_python(tmp_path, monkeypatch):
    """A Q6_K tensor (Qwen2.5-Coder-1.5B's head) read by pread: rows in C (cext.qgemm.read_rows,
    dequantize_q6_k) equal the Python loop and gguf.quants, repeated ids too; an id past the end
    and a file cut short fail by name."""
    from engine.loader import repack

    raw = _q6_k_rows(40, 2, seed=2)
    path = tmp_path / "q6k.bin"
    path.write_bytes(b"x" * 100 + raw.tobytes())
    rows = MappedRows(raw, 14, (40, 512), source=(str(path), 100))
    ids = torch.tensor([[3, 39, 3], [0, 17, 3]])
    fast = rows.rows(ids, torch.float32)
    monkeypatch.setattr(repack, "qgemm", None)
    slow = rows.rows(ids, torch.float32)
    assert torch.equal(fast, slow) and torch.equal(fast, torch.from_numpy(dequantize(raw, 14, (40, 512)))[ids])
    monkeypatch.undo()
    with pytest.raises(IndexError, match="row 40 is outside"):
        rows.rows(torch.tensor([40]), torch.float32)
    with open(path, "r+b") as f:
        f.truncate(100 + 30 * raw.shape[1] + 5)  # row 30 cut after 5 bytes
    with pytest.raises(OSError, match="short read of row 30"):
        rows.rows(torch.tensor([2, 30]), torch.float32)


def _resident_kb(array: np.ndarray) -> int:
    """Resident kB of the memory mapping holding ``array``'s first byte (/proc/self/smaps)."""
    address, inside = array.ctypes.data, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


def test_mapped_rows_read_with_pread_and_stay_out_of_the_resident_set(qwen_gguf):  # noqa: F811
    """Read through the map, a fault maps the whole page-cache folio around a row (64 KB, 2 MB
    with large folios), so rows read a step at a time (the head's refined logits, embedding
    lookups) made most of a mapped tensor resident; MappedRows reads them with pread instead."""
    name = "model.embed_tokens.weight"  # Q5_0, 151,936 x 896: 94 MB in the file
    rows = converted(qwen_gguf, [name], "auto")[name]
    exact = converted(qwen_gguf, [name], "float32")[name]
    generator = torch.Generator().manual_seed(0)
    for _ in range(48):  # 48 steps of 64 rows, some repeated
        ids = torch.randint(0, rows.shape[0], (64,), generator=generator)
        ids[-1] = ids[0]
        torch.testing.assert_close(rows.rows(ids, torch.float32), exact[ids], atol=0, rtol=0)
    read = _resident_kb(rows.raw)
    touched = rows.raw[torch.randint(0, rows.shape[0], (48 * 64,), generator=generator).numpy()].sum()  # the control
    assert touched >= 0 and _resident_kb(rows.raw) > 4 * max(read, 256), read
    with pytest.raises(IndexError, match="outside"):
        rows.rows(torch.tensor([rows.shape[0]]), torch.float32)


def test_qwen_untied_embedding_stays_in_the_map_and_is_exact(qwen_gguf):  # noqa: F811
    name = "model.embed_tokens.weight"  # Q5_0
    rows = converted(qwen_gguf, [name], "auto")[name]
    exact = converted(qwen_gguf, [name], "float32")[name]
    assert isinstance(rows, MappedRows) and rows.shape == tuple(exact.shape)
    ids = torch.tensor([[0, 151935], [17, 9000]])
    torch.testing.assert_close(rows.rows(ids, torch.float32), exact[ids], atol=0, rtol=0)
    head = converted(qwen_gguf, ["lm_head.weight"], "auto")["lm_head.weight"]  # Q8_0 -> int8 + exact rows
    exact_head = converted(qwen_gguf, ["lm_head.weight"], "float32")["lm_head.weight"]
    assert isinstance(head, (Int8Weight, PackedInt8Weight))
    torch.testing.assert_close(head.rows(ids, torch.float32), exact_head[ids], atol=0, rtol=0)
