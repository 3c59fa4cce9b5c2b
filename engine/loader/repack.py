"""ggml weight blocks -> the engine's weight formats (engine.models.quant), without a float32
copy of the model: one tensor at a time, read from the file's memory map.

Int4 (engine.models.linear.Int4Weight): group g of a row is ``q * scale + min`` with groups of
32 along the input dimension and ggml's nibble order. ggml's 4-bit blocks map onto it exactly
(every product below is exact in float32):
- Q4_0 (32 per block): ``d * (q - 8)``         -> scale = d, min = -8 d
- Q4_1 (32 per block): ``d * q + m``           -> scale = d, min = m (the codes bytes as they are)
- Q4_K (256 per super-block, 8 sub-blocks of 32 with 6-bit scales and mins):
  ``d * sc_j * q - dmin * m_j``                -> scale = d sc_j, min = -dmin m_j
Int5 (Int5Weight, the same with q in 0..31): Q5_0 (``d * (q - 16)``: scale = d, min = -16 d) and
Q5_1 (``d * q + m``) map onto it exactly, the file's bytes as they are (nibbles and fifth bits).
Int8 (Int8Weight, a scale per block of 32): Q8_0 (``d * q``) and Q5_0 (``d * (q - 16)``, codes
q - 16 in -16..15) map onto it exactly. Other types are dequantized (gguf.quants) and
re-quantized: int8 per block of 32 (absmax / 127) or int4 group-32 (min/max, round to nearest).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from engine.models.quant import Int4Weight, Int5Weight

try:
    from cext import qgemm
except ImportError:  # cext not built: the rows through Python and gguf.quants
    qgemm = None

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 2, 3, 6, 7, 8, 12, 14
INT4_TYPES = (Q4_0, Q4_1, Q4_K)
INT5_TYPES = (Q5_0, Q5_1)
PLAIN_TYPES = (0, 1, 30)  # F32, F16, BF16


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """[rows, blocks, bytes] uint8 -> [rows, blocks] float32 of the fp16 at byte `start`."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] codes: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, blocks, 12] 6-bit packed scales/mins -> two [rows, blocks, 8] uint8 (ggml get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    low_sc, low_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_sc = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    high_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return np.concatenate((low_sc, high_sc), -1), np.concatenate((low_m, high_m), -1)


def _pack(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes -> [..., 16] bytes: element j low nibble, element j + 16 high nibble."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def q4_to_int4(raw: np.ndarray, ggml_type: int, num_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw uint8 [N, bytes per row] of a Q4_0/Q4_1/Q4_K tensor -> (packed uint8 [N, K / 2] as
    Int4Weight.packed, scales float32 [N, K / 32], mins float32 [N, K / 32]) with
    w = q * scale + min."""
    num_rows = raw.shape[0]
    if ggml_type == Q4_0:
        blocks = raw.reshape(num_rows, num_cols // 32, 18)
        d = _f16(blocks, 0)  # [N, K/32]
        return blocks[..., 2:].reshape(num_rows, num_cols // 2), d, -8 * d
    if ggml_type == Q4_1:
        blocks = raw.reshape(num_rows, num_cols // 32, 20)
        d, m = _f16(blocks, 0), _f16(blocks, 2)  # [N, K/32]
        return blocks[..., 4:].reshape(num_rows, num_cols // 2), d, m
    if ggml_type == Q4_K:
        blocks = raw.reshape(num_rows, num_cols // 256, 144)
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]  # [N, K/256, 1]
        sc, mins = _q4_k_scales_mins(blocks[..., 4:16])  # [N, K/256, 8]
        qs = blocks[..., 16:].reshape(num_rows, num_cols // 256, 4, 32)  # 4 chunks of 64 elements
        codes = np.stack((qs & 0x0F, qs >> 4), axis=3)  # [N, K/256, 4, 2, 32]: sub-block 2c, 2c + 1
        scale = d * sc  # [N, K/256, 8]
        return (_pack(codes).reshape(num_rows, num_cols // 2), scale.reshape(num_rows, -1).astype(np.float32),
                (-(dmin * mins)).reshape(num_rows, -1).astype(np.float32))
    raise ValueError(f"ggml type {ggml_type} is not a 4-bit type with groups of 32")


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Any ggml tensor -> float32 [shape] (a new array)."""
    if ggml_type == 0:
        return np.array(raw.view(np.float32).reshape(shape))
    if ggml_type == 1:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    if ggml_type == 30:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if ggml_type == Q8_0:  # fp16 d, 32 int8: d * q
        blocks = raw.reshape(raw.shape[0], -1, 34)
        return (_f16(blocks, 0)[..., None] * blocks[..., 2:].view(np.int8)).reshape(shape)
    if ggml_type == Q5_0:  # fp16 d, 32 high bits, 16 bytes of nibbles: d * (q - 16)
        blocks = raw.reshape(raw.shape[0], -1, 22)
        high_bits = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [R, blocks, 1]
        high = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [R, blocks, 32]
        codes = (_nibbles(blocks[..., 6:]) | high).astype(np.float32) - 16
        return (_f16(blocks, 0)[..., None] * codes).reshape(shape)
    if ggml_type == Q6_K and qgemm is not None:  # in C, the values gguf.quants gives (Q4_K_M heads, down layers)
        out = np.empty(shape, dtype=np.float32)
        qgemm.dequantize_q6_k(np.ascontiguousarray(raw), out.reshape(raw.shape[0], -1))
        return out
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ValueError(f"unknown ggml type {ggml_type}") from None
    try:
        values = gguf_dequantize(raw, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(f"ggml type {qtype.name} cannot be dequantized by gguf.quants: {exc}") from exc
    return np.asarray(values, dtype=np.float32).reshape(shape)


def q5_0_codes(raw: np.ndarray, num_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """raw uint8 [N, bytes per row] of a Q5_0 tensor -> (int8 codes [N, K] in the kernels' order
    (Int8Weight.q: per block byte 2i = element i, 2i + 1 = element 16 + i), float32 scales
    [N, K / 32]) with w = code * scale exactly: a block is d * (q - 16) with q in 0..31, so the
    codes are q - 16 and the scale is d (an Int8Weight, like Q8_0)."""
    num_rows = raw.shape[0]
    blocks = raw.reshape(num_rows, num_cols // 32, 22)
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little") << 4  # [N, blocks, 32]: bit j of qh
    qs = blocks[..., 6:]  # [N, blocks, 16]: element i low nibble, 16 + i high
    codes = np.empty((num_rows, num_cols // 32, 16, 2), dtype=np.uint8)
    np.bitwise_or(qs & 0x0F, high[..., :16], out=codes[..., 0])
    np.bitwise_or(qs >> 4, high[..., 16:], out=codes[..., 1])
    codes -= 16  # q - 16 as two's complement bytes
    return codes.view(np.int8).reshape(num_rows, num_cols), _f16(blocks, 0)


def int5_from_q5(raw: np.ndarray, ggml_type: int, num_cols: int) -> Int5Weight:
    """raw uint8 [N, bytes per row] of a Q5_0 / Q5_1 tensor -> Int5Weight (exact): the blocks'
    nibbles and fifth bits copied as they are, scale d, min -16 d (Q5_0) or m (Q5_1)."""
    num_rows = raw.shape[0]
    if ggml_type not in INT5_TYPES:
        raise ValueError(f"ggml type {ggml_type} is not Q5_0 or Q5_1")
    width = 22 if ggml_type == Q5_0 else 24  # fp16 d (, fp16 m), 4 bytes of fifth bits, 16 of nibbles
    blocks = raw.reshape(num_rows, num_cols // 32, width)
    d = _f16(blocks, 0)
    mins = -16 * d if ggml_type == Q5_0 else _f16(blocks, 2)
    packed = np.ascontiguousarray(blocks[..., width - 16:]).reshape(num_rows, num_cols // 2)
    high = np.ascontiguousarray(blocks[..., width - 20:width - 16]).reshape(num_rows, num_cols // 8)
    return Int5Weight(torch.from_numpy(packed), torch.from_numpy(high), torch.from_numpy(d), torch.from_numpy(mins))


def int4_from_q4(raw: np.ndarray, ggml_type: int, num_cols: int) -> Int4Weight:
    packed, scales, mins = q4_to_int4(raw, ggml_type, num_cols)
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(scales), torch.from_numpy(mins))


class MappedRows:
    """A quantized [N, K] ggml tensor left in the file, read a few rows at a time (embedding
    lookups, the head's refined logits): exact, and never resident. With ``source`` (the file's
    path and the tensor's byte offset) each row is read with pread from a descriptor opened at
    load (the loaded file, even if its path is replaced later); the pages stay in the page cache
    only. Read through the map instead, a fault maps the whole page-cache folio around the page
    (64 KB of fault-around, 2 MB where the page cache holds large folios, as for a file just
    written), so the 64 refined head rows of each step made Qwen2.5-Coder-1.5B's Q6_K head and
    Q4_K embedding (322 MB) resident within a few hundred steps; dropping the pages every few
    hundred rows did not hold with large folios. Without ``source`` rows come from ``raw``."""

    def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int],
                 source: tuple[str, int] | None = None):
        self.raw = raw  # uint8 [N, bytes per row], a view of the map
        self.ggml_type = ggml_type
        self.shape = tuple(shape)
        self.row_bytes = raw.shape[1]
        self._fd = os.open(source[0], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if source is not None else None
        self._offset = source[1] if source is not None else 0

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def _gather(self, flat: np.ndarray) -> np.ndarray:
        """uint8 [len(flat), row bytes]: the rows' bytes."""
        if self._fd is None:
            return self.raw[flat]
        out = np.empty((len(flat), self.row_bytes), dtype=np.uint8)
        if qgemm is not None:  # one C loop, the GIL released (16 rows' refined logits: 1,024 reads a step)
            qgemm.read_rows(self._fd, self._offset, self.shape[0], np.ascontiguousarray(flat, dtype=np.int64), out)
            return out
        first: dict[int, int] = {}
        for k, i in enumerate(flat.tolist()):
            if i < 0 or i >= self.shape[0]:
                raise IndexError(f"row {i} is outside the tensor's {self.shape[0]} rows")
            if i in first:
                out[k] = out[first[i]]
                continue
            first[i] = k
            data = os.pread(self._fd, self.row_bytes, self._offset + i * self.row_bytes)
            if len(data) != self.row_bytes:
                raise OSError(f"short read of row {i} ({len(data)} of {self.row_bytes} bytes)")
            out[k] = np.frombuffer(data, dtype=np.uint8)
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] -> rows [..., K] in dtype."""
        flat = ids.reshape(-1)
        if flat.numel() == 0:  # a forward with no logit rows (a prompt's inner chunk)
            return torch.empty(*ids.shape, self.shape[1], dtype=dtype)
        w = torch.from_numpy(dequantize(self._gather(flat.numpy()), self.ggml_type, (len(flat), self.shape[1])))
        return w.reshape(*ids.shape, self.shape[1]).to(dtype)
