"""The project's GGUF tensor reader (engine.gguf_file.GGUFFile) against gguf.GGUFReader on both
real models, and its errors on truncated and corrupt files."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from model_fixtures import qwen_gguf, smollm2_gguf  # noqa: F401 (fixtures)

from engine.gguf_file import GGUFFile
from engine.loader import load_model


@pytest.mark.parametrize("model", ["smollm2_gguf", "qwen_gguf"])
def test_tensor_table_matches_gguf_reader(request, model):
    path = request.getfixturevalue(model)
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as ours:
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        assert ours.alignment == reader.alignment
        for t in reader.tensors:
            info = ours.tensors[t.name]
            assert info.dims == tuple(int(n) for n in t.shape), t.name
            assert info.shape == tuple(reversed(info.dims))
            assert info.ggml_type == int(t.tensor_type), t.name
            assert (info.offset, info.num_bytes) == (t.data_offset, t.n_bytes), t.name
            raw = ours.raw(t.name)
            assert raw.base is not None  # a view of the map, not a copy
            assert np.array_equal(raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
        norm = ours.array("output_norm.weight")
        assert norm.dtype == np.float32 and np.array_equal(norm, np.asarray(reader.get_tensor(
            [t.name for t in reader.tensors].index("output_norm.weight")).data))
        with pytest.raises(ValueError, match="quantized"):
            ours.array("blk.0.attn_q.weight")


def tiny_gguf(path, alignment: int | None = None) -> bytes:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_tensor("a.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    q = gguf.quants.quantize(np.ones((8, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("b.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_custom_alignment_and_views(tmp_path):
    tiny_gguf(tmp_path / "t.gguf", alignment=64)
    with GGUFFile(tmp_path / "t.gguf") as f:
        assert f.alignment == 64 and all(t.offset % 64 == 0 for t in f.tensors.values())
        assert np.array_equal(f.array("a.weight"), np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
        assert f.tensors["b.weight"].shape == (8, 64) and f.raw("b.weight").shape == (8, 36)


@pytest.mark.parametrize("cut", [100, 1, 5000])
def test_truncated_file_names_file_and_says_truncated(tmp_path, cut):
    whole = tiny_gguf(tmp_path / "whole.gguf")
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut] if cut == 100 else whole[:-cut])  # header cut, last byte, tensor data
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        GGUFFile(path)
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        load_model(path)


def test_real_model_truncated_tensor_data(tmp_path, smollm2_gguf):  # noqa: F811
    path = tmp_path / "smol.gguf"
    with open(smollm2_gguf, "rb") as src:
        path.write_bytes(src.read(50_000_000))
    with pytest.raises(ValueError, match=r"smol\.gguf: GGUF file is truncated: tensor"):
        load_model(path)


def header_offset_of_first_dims(data: bytes) -> int:
    """Byte offset of the first tensor's n_dims in a file with no key/values (GGUFWriter, no arch KV)."""
    offset = 4 + 4 + 16
    (num_kv,) = struct.unpack_from("<Q", data, 16)
    assert num_kv == 1  # general.architecture
    (key_len,) = struct.unpack_from("<Q", data, offset)
    offset += 8 + key_len + 4
    (value_len,) = struct.unpack_from("<Q", data, offset)
    offset += 8 + value_len
    (name_len,) = struct.unpack_from("<Q", data, offset)
    return offset + 8 + name_len


@pytest.mark.parametrize("damage", ["dims", "type", "count"])
def test_corrupt_file_names_file_and_says_corrupt(tmp_path, damage):
    data = bytearray(tiny_gguf(tmp_path / "whole.gguf"))
    at = header_offset_of_first_dims(bytes(data))
    if damage == "dims":
        struct.pack_into("<I", data, at, 9)
        expected = "corrupt"
    elif damage == "type":
        struct.pack_into("<I", data, at + 4 + 2 * 8, 999)  # after n_dims and two dims
        expected = "unknown ggml type 999"
    else:
        struct.pack_into("<Q", data, 8, 10 ** 12)  # tensor count
        expected = "corrupt"
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"bad\.gguf.*{expected}"):
        GGUFFile(path)
