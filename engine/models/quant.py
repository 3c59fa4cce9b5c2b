"""The quantized weight formats, as loaded (engine/loader/repack.py maps ggml's blocks onto
them exactly) and as the kernels read them (``blocks()``: the byte layouts of
cext/csrc/qgemm.h, described there once).

- ``Int4Weight``: w = q * scale + min per group of 32 inputs, q in 0..15 (Q4_0, Q4_1, Q4_K).
- ``Int5Weight``: the same with q in 0..31 (Q5_0, Q5_1).
- ``Int8Weight``: w = q * scale per block of 32 (Q8_0; Q5_0 as codes q - 16).
- ``PackedInt8Weight``: int8 codes already in the kernels' strips of 16 rows; ``PackedQ6Weight``: Q6_K's
  own codes in strips (both made by the GGUF loader).
``Weight`` is any of them or a dense tensor; ``cat_rows`` joins weights along the output rows
(fused QKV, gate/up) in the narrowest format that holds them exactly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

try:
    from cext import qgemm
except ImportError:  # not built: the NumPy packing below
    qgemm = None

GROUP_SIZE = 32


def is_half_exact_tensor(t: torch.Tensor) -> bool:
    """Whether every value of t is an fp16 value (float16 already, or float32 that converts back)."""
    if t.dtype == torch.float16:
        return True
    values = t.float().numpy()
    return bool((values.astype(np.float16).astype(np.float32) == values).all())


SUPER_GROUPS = 8  # blocks of 32 per Q4_K super-block (the kernels' QG_SUPER groups)


def super_factors(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """float32 [N, G] (G a multiple of 8) -> (fp16 f [N, G / 8], uint8 q [N, G]) with
    values[n, 8 s + j] == f[n, s] * q[n, 8 s + j] exactly in float32, or None when some group of
    8 has no such factoring (Q4_K's scales d * sc_j and mins -dmin * m_j always do: sc, m are
    6-bit and the largest is 63, so f = the largest magnitude / 63 first, other divisors after)."""
    num_rows, num_groups = values.shape
    g = values.reshape(num_rows, num_groups // SUPER_GROUPS, SUPER_GROUPS).astype(np.float32, copy=False)
    ref = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)  # [N, S, 1]: the largest magnitude, signed
    factor, codes, ok = _try_factor(g, ref, 63)
    if not ok.all():  # groups whose largest multiplier is not 63: other divisors, those groups only
        todo = ~ok
        sub, sub_ref = g[todo], ref[todo]
        sub_factor, sub_codes = factor[todo], codes[todo]
        left = np.ones(len(sub), dtype=bool)
        for top in range(62, 0, -1):
            f, q, good = _try_factor(sub, sub_ref, top)
            take = left & good
            sub_factor[take], sub_codes[take] = f[take], q[take]
            left &= ~good
            if not left.any():
                break
        if left.any():
            return None
        factor[todo], codes[todo] = sub_factor, sub_codes
    return factor[..., 0], codes.reshape(num_rows, num_groups)


def _try_factor(g: np.ndarray, ref: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[..., 8] values, [..., 1] signed largest -> (fp16 f [..., 1], uint8 q [..., 8], ok [...])
    for f = ref / top: ok where every value is f * q exactly with q in 0..255 (all zeros: f = 0)."""
    f = (ref / np.float32(top)).astype(np.float16)
    f32 = f.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(g / f32)
    q = np.where(f32 == 0, 0, q)  # an all-zero group (ref 0): q 0
    ok = ((q >= 0) & (q <= 255) & (f32 * q == g)).all(-1)
    return f, q.astype(np.uint8), ok


@dataclass
class Int4Weight:
    """w = q * scale + min per group of 32 inputs, q in 0..15 (ggml's form: Q4_0, Q4_1 and Q4_K
    sub-blocks map onto it exactly). packed uint8 [N, K / 2]: for group g of a row, bytes
    16 g .. 16 g + 15 hold element j in the low nibble and element j + 16 in the high nibble
    (ggml's order); scales, mins float32 [N, K / 32]."""
    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def codes(self) -> torch.Tensor:
        """-> uint8 [N, K] in 0..15, in element order."""
        num_rows, num_cols = self.shape
        groups = self.packed.reshape(num_rows, -1, GROUP_SIZE // 2)  # [N, K/32, 16]
        return torch.cat((groups & 0x0F, groups >> 4), dim=-1).reshape(num_rows, num_cols)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Weight:
        """codes uint8 [N, K] in 0..15 (element order) -> the packed form."""
        num_rows, num_cols = codes.shape
        groups = codes.reshape(num_rows, -1, GROUP_SIZE)  # [N, K/32, 32]
        packed = groups[..., :GROUP_SIZE // 2] | (groups[..., GROUP_SIZE // 2:] << 4)  # [N, K/32, 16]
        return Int4Weight(packed.reshape(num_rows, num_cols // 2).contiguous(), scales, mins)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """The same row operation (a permutation, a slice) on codes, scales and mins."""
        return Int4Weight(fn(self.packed), fn(self.scales), fn(self.mins))

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(*(torch.cat([getattr(p, n) for p in parts]) for n in ("packed", "scales", "mins")))

    @staticmethod
    def from_dense(w: torch.Tensor) -> Int4Weight:
        """w [N, K] float -> asymmetric int4 groups of 32 (min/max, round to nearest)."""
        num_rows, num_cols = w.shape
        groups = w.float().reshape(num_rows, num_cols // GROUP_SIZE, GROUP_SIZE)  # [N, K/32, 32]
        low, high = groups.amin(-1), groups.amax(-1)  # [N, K/32]
        scale = ((high - low) / 15).clamp_min(1e-12)
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return Int4Weight.from_codes(codes.reshape(num_rows, num_cols), scale, low)

    def dequantize(self) -> torch.Tensor:
        """-> float32 [N, K]."""
        num_rows, num_cols = self.shape
        groups = self.codes.reshape(num_rows, -1, GROUP_SIZE).float()  # [N, K/32, 32]
        return (groups * self.scales[..., None] + self.mins[..., None]).reshape(num_rows, num_cols)

    def is_half_exact(self) -> bool:
        """Whether every scale and min is an fp16 value (Q4_0 and Q4_1 files: yes; Q4_K's
        products of two scales: in general no)."""
        return is_half_exact_tensor(self.scales) and is_half_exact_tensor(self.mins)

    def blocks(self, half: bool = False) -> torch.Tensor:
        """-> uint8 [N, K / 32 * (20 if half else 24)]: the kernels' Q4 rows (cext/csrc/qgemm.h's
        QG_Q4, with QG_HALF when half: fp16 scales and mins). K: a multiple of 64. (NumPy: ~20x
        faster than the same uint8 ops in torch here, which matters at load.)"""
        num_rows, num_cols = self.shape
        if num_cols % (2 * GROUP_SIZE):
            raise ValueError(f"Q4 blocks need K a multiple of {2 * GROUP_SIZE}, got {num_cols}")
        num_groups = num_cols // GROUP_SIZE
        dtype, width = (np.float16, 2) if half else (np.float32, 4)
        out = np.empty((num_rows, num_groups * (16 + 2 * width)), dtype=np.uint8)
        out[:, : num_groups * width] = self.scales.numpy().astype(dtype).view(np.uint8)
        out[:, num_groups * width: num_groups * 2 * width] = self.mins.numpy().astype(dtype).view(np.uint8)
        self._code_pairs(out[:, num_groups * 2 * width:])
        return torch.from_numpy(out)

    def _code_pairs(self, out: np.ndarray) -> None:
        """The codes in the kernels' pairs of blocks into out uint8 [N, K / 2] (a view)."""
        num_rows, num_cols = self.shape
        num_groups = num_cols // GROUP_SIZE
        # ggml's byte i of a block holds its elements i (low nibble) and 16 + i (high), so word i
        # of a pair is byte i of the first block beside byte i of the second: an interleave.
        # [N, K/64, 2, 16]
        packed = self.packed.numpy().reshape(num_rows, num_groups // 2, 2, GROUP_SIZE // 2)
        out.reshape(num_rows, num_groups // 2, GROUP_SIZE // 2, 2)[:] = \
            packed.transpose(0, 1, 3, 2)  # word i: (first block's byte i, second's)

    def super_blocks(self) -> torch.Tensor | None:
        """-> uint8 [N, K / 32 * 18.5]: the kernels' Q4 rows with QG_SUPER (scales and mins as
        Q4_K stores them: per 8 blocks an fp16 factor and 8 uint8 multipliers), or None when
        K is not a multiple of 256 or the scales or mins do not factor so (super_factors)."""
        num_rows, num_cols = self.shape
        if num_cols % (SUPER_GROUPS * GROUP_SIZE):
            return None
        factored = [super_factors(values.float().numpy()) for values in (self.scales, self.mins)]
        if any(f is None for f in factored):
            return None
        num_supers = num_cols // (SUPER_GROUPS * GROUP_SIZE)
        group_bytes = num_supers * (2 + SUPER_GROUPS)
        out = np.empty((num_rows, 2 * group_bytes + num_cols // 2), dtype=np.uint8)
        for i, (f, q) in enumerate(factored):
            groups = out[:, i * group_bytes: (i + 1) * group_bytes].reshape(num_rows, num_supers, 2 + SUPER_GROUPS)
            groups[..., :2] = f.view(np.uint8).reshape(num_rows, num_supers, 2)
            groups[..., 2:] = q.reshape(num_rows, num_supers, SUPER_GROUPS)
        self._code_pairs(out[:, 2 * group_bytes:])
        return torch.from_numpy(out)


@dataclass
class Int5Weight:
    """w = q * scale + min per group of 32 inputs, q in 0..31 (ggml's Q5_0 is ``d * q - 16 d``,
    Q5_1 ``d * q + m``: both load exactly). packed uint8 [N, K / 2]: the low nibbles in
    Int4Weight's order; high uint8 [N, K / 8]: per group 4 bytes, bit j (little-endian) the
    fifth bit of element j (ggml's qh); scales, mins float32 [N, K / 32]. The kernels read
    0.75 bytes per weight (fp16 scales) against int8's 1.125."""
    packed: torch.Tensor
    high: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def codes(self) -> torch.Tensor:
        """-> uint8 [N, K] in 0..31, in element order."""
        num_rows, num_cols = self.shape
        low = Int4Weight(self.packed, self.scales, self.mins).codes
        bits = np.unpackbits(self.high.numpy().reshape(num_rows, num_cols // 8), axis=-1, bitorder="little")
        return low | (torch.from_numpy(bits) << 4)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int5Weight:
        """codes uint8 [N, K] in 0..31 (element order) -> the packed form."""
        num_rows, num_cols = codes.shape
        low = Int4Weight.from_codes(codes & 0x0F, scales, mins).packed
        high = np.packbits((codes >> 4).numpy().astype(np.uint8), axis=-1, bitorder="little")  # [N, K/8]
        return Int5Weight(low, torch.from_numpy(high), scales, mins)

    @staticmethod
    def from_int4(weight: Int4Weight) -> Int5Weight:
        """The same weight with every fifth bit 0 (to join Q5 rows in one fused layer)."""
        num_rows, num_cols = weight.shape
        no_high = torch.zeros(num_rows, num_cols // 8, dtype=torch.uint8)
        return Int5Weight(weight.packed, no_high, weight.scales,
                          weight.mins)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int5Weight:
        return Int5Weight(fn(self.packed), fn(self.high), fn(self.scales), fn(self.mins))

    @staticmethod
    def cat(parts: list[Int5Weight]) -> Int5Weight:
        names = ("packed", "high", "scales", "mins")
        return Int5Weight(*(torch.cat([getattr(p, n) for p in parts]) for n in names))

    def dequantize(self) -> torch.Tensor:
        num_rows, num_cols = self.shape
        groups = self.codes.reshape(num_rows, -1, GROUP_SIZE).float()
        return (groups * self.scales[..., None] + self.mins[..., None]).reshape(num_rows, num_cols)

    @property
    def kernel_mins(self) -> torch.Tensor:
        """The kernels' min: they take signed codes q - 16, so w = scale * (q - 16) + (min + 16 scale)
        (0 for Q5_0)."""
        return self.mins + 16 * self.scales

    def is_half_exact(self) -> bool:
        """Whether the kernels' scales and mins are all fp16 values (Q5_0 files: yes)."""
        return Int4Weight(self.packed, self.scales, self.kernel_mins).is_half_exact()

    def to_int8(self) -> Int8Weight:
        """-> Int8Weight: exact when every min is -16 scale (Q5_0: codes q - 16, scale d),
        else a re-quantization."""
        if bool((self.mins == -16 * self.scales).all()):
            codes = (self.codes.to(torch.int16) - 16).to(torch.int8)
            return Int8Weight.from_codes(codes, self.scales.float(), is_exact=True)
        return Int8Weight.from_dense(self.dequantize())

    def blocks(self, half: bool = False, with_mins: bool = True) -> torch.Tensor:
        """-> uint8 [N, K / 32 * (24 if half else 28)]: the kernels' Q5 rows (cext/csrc/qgemm.h's
        QG_Q5) of the signed codes q - 16 with kernel_mins. with_mins=False (every kernel min 0:
        Q5_0): no mins, K / 32 * (22 if half else 24) bytes (QG_NO_MINS). K: a multiple of 64."""
        num_rows, num_cols = self.shape
        if num_cols % (2 * GROUP_SIZE):
            raise ValueError(f"Q5 blocks need K a multiple of {2 * GROUP_SIZE}, got {num_cols}")
        if not with_mins and bool((self.kernel_mins != 0).any()):
            raise ValueError("Q5 blocks without mins need every kernel min to be 0 (Q5_0)")
        num_groups, num_pairs = num_cols // GROUP_SIZE, num_cols // (2 * GROUP_SIZE)
        dtype, width = (np.float16, 2) if half else (np.float32, 4)
        head = num_groups * (2 if with_mins else 1) * width
        out = np.empty((num_rows, head + num_pairs * 40), dtype=np.uint8)
        out[:, : num_groups * width] = self.scales.numpy().astype(dtype).view(np.uint8)
        if with_mins:
            out[:, num_groups * width: head] = self.kernel_mins.numpy().astype(dtype).view(np.uint8)
        if qgemm is not None:  # a C loop: the NumPy below costs ~1.5 s at Qwen2.5-0.5B's load
            packed, high = self.packed.contiguous(), self.high.contiguous()
            qgemm.q5_pack(packed.data_ptr(), high.data_ptr(), num_rows, num_cols, out[:, head:].ctypes.data,
                           out.shape[1])
            return torch.from_numpy(out)
        # (q - 16) & 31
        fields = (self.codes.numpy() ^ 16).reshape(num_rows, num_pairs, 4, 16).astype(np.uint16)
        words = ((fields[:, :, 3] << 11) | (fields[:, :, 2] << 6) | (fields[:, :, 1] << 1)
                 | (fields[:, :, 0] >> 4))
        low = (fields[:, :, 0] & 0x0F).astype(np.uint8)  # [N, pairs, 16]
        pairs = out[:, head:].reshape(num_rows, num_pairs, 40)
        pairs[..., :32] = words.astype("<u2").view(np.uint8).reshape(num_rows, num_pairs, 32)
        pairs[..., 32:] = low[..., 0::2] | (low[..., 1::2] << 4)
        return torch.from_numpy(out)


@dataclass
class Int8Weight:
    """q int8 [N, K], scales float32 [N, K / 32]: w = q * scale per block of 32 inputs (ggml's
    Q8_0, so a Q8_0 tensor loads exactly). q is kept in the kernels' order (interleave_q8;
    cext/csrc/qgemm.h's QG_Q8), so the product needs no second copy; row operations are
    unaffected, element access goes through ``codes``. is_exact: q and scales are the source's
    own values (a Q8_0 file), not a re-quantization. exact_rows: optionally where a re-quantized weight
    came from (rows read exactly from a GGUF map, engine.loader.repack.MappedRows) for lookups:
    the embedding and the head's refined logits."""
    q: torch.Tensor
    scales: torch.Tensor
    exact_rows: object | None = None
    is_exact: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int8Weight:
        return Int8Weight(fn(self.q), fn(self.scales), is_exact=self.is_exact)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                          is_exact=all(p.is_exact for p in parts))

    @property
    def codes(self) -> torch.Tensor:
        """-> int8 [N, K] in element order."""
        return deinterleave_q8(self.q)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, is_exact: bool = False) -> Int8Weight:
        """codes int8 [N, K] in element order, scales [N, K / 32]."""
        return Int8Weight(interleave_q8(codes), scales, is_exact=is_exact)

    @staticmethod
    def from_dense(w: torch.Tensor) -> Int8Weight:
        """w [N, K] float -> symmetric int8 per block of 32 (scale = absmax / 127)."""
        num_rows, num_cols = w.shape
        blocks = w.float().reshape(num_rows, -1, GROUP_SIZE)  # [N, K/32, 32]
        scales = (blocks.abs().amax(-1) / 127).clamp_min(1e-12)  # [N, K/32]
        q = (blocks / scales[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        return Int8Weight.from_codes(q.reshape(num_rows, num_cols), scales)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] -> rows [..., K] in dtype (an embedding lookup): the exact source rows when
        known, else the dequantized int8 rows."""
        if self.exact_rows is not None and not self.is_exact:
            return self.exact_rows.rows(ids, dtype)
        flat = ids.reshape(-1)
        q = deinterleave_q8(self.q[flat]).float().reshape(len(flat), -1, GROUP_SIZE)  # [n, K/32, 32]
        w = (q * self.scales[flat][..., None]).reshape(*ids.shape, self.shape[1])
        return w.to(dtype)

    def dequantize(self) -> torch.Tensor:
        num_rows, num_cols = self.shape
        q = self.codes.float().reshape(num_rows, -1, GROUP_SIZE)
        return (q * self.scales[..., None]).reshape(num_rows, num_cols)


def dequantize_rows(layout: int, rows: torch.Tensor, scales: torch.Tensor | None, shape: tuple[int, int],
                    ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ids [...] -> rows [..., K] in dtype of a weight in a kernel layout (cext.qgemm: ``rows``, and Q8's
    ``scales`` in a row layout), one row dequantized at a time (a lookup of a few rows)."""
    from cext import qgemm

    flat = ids.reshape(-1).tolist()
    num_rows, num_cols = shape
    out = torch.empty(len(flat), num_cols, dtype=torch.float32)
    scales_ptr = 0 if scales is None else scales.data_ptr()
    for k, row in enumerate(flat):
        if not 0 <= row < num_rows:
            raise IndexError(f"row {row} of a weight with {num_rows} rows")
        qgemm.dequantize(layout, rows.data_ptr(), scales_ptr, row, 1, num_cols, out[k].data_ptr())
    return out.reshape(*ids.shape, num_cols).to(dtype)


class PackedInt8Weight:
    """An int8 weight already in the kernels' strips of 16 rows (cext/csrc/qgemm.h's QG_PACKED with
    ``layout``, Q8 with or without HALF): what the GGUF loader makes of a head a chunk of rows at a time,
    so the int8 rows and their strips never exist whole side by side. is_exact and exact_rows as
    Int8Weight's; lookups (``rows``) read the exact source rows when known, else the strips."""

    __slots__ = ("strips", "layout", "shape", "is_exact", "exact_rows")

    def __init__(self, strips: torch.Tensor, layout: int, shape: tuple[int, int], is_exact: bool = False,
                 exact_rows: object | None = None):
        self.strips, self.layout, self.shape = strips, layout, tuple(shape)
        self.is_exact, self.exact_rows = is_exact, exact_rows

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.exact_rows is not None:  # a re-quantized weight's source, or a Q6_K head's (faster than strips)
            return self.exact_rows.rows(ids, dtype)
        from cext import qgemm

        return dequantize_rows(self.layout | qgemm.PACKED, self.strips, None, self.shape, ids, dtype)

    def dequantize(self) -> torch.Tensor:
        from cext import qgemm

        out = torch.empty(self.shape, dtype=torch.float32)
        qgemm.dequantize(self.layout | qgemm.PACKED, self.strips.data_ptr(), 0, 0, self.shape[0], self.shape[1],
                         out.data_ptr())
        return out


class PackedQ6Weight(PackedInt8Weight):
    """A ggml Q6_K weight in the kernels' strips of 16 rows, its own codes and scales (cext/csrc/qgemm.h's
    QG_Q6 | QG_PACKED: 6.56 bits a weight where int8 codes take 8.5), made by the GGUF loader a chunk of
    rows at a time (cext.qgemm.q6k_pack). Exact: the products and lookups read the file's values. Rows are
    not reordered or sliced (the loader keeps tensors that need that in another format); whole weights
    concatenate (``cat``)."""

    __slots__ = ()

    def __init__(self, strips: torch.Tensor, shape: tuple[int, int]):
        from cext import qgemm

        super().__init__(strips, qgemm.Q6, shape, is_exact=True)

    @staticmethod
    def cat(parts: list[PackedQ6Weight]) -> PackedQ6Weight:
        return PackedQ6Weight(torch.cat([p.strips for p in parts]),
                              (sum(p.shape[0] for p in parts), parts[0].shape[1]))


class RowParts:
    """Consecutive output rows in formats of their own (a fused layer whose parts would otherwise be
    re-quantized to one format: Q4_K q/k beside a Q6_K v in a Q4_K_M file's layers). Linear runs each
    part's product into its columns of one output."""

    __slots__ = ("parts", "shape")

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])  # quantized parts only (cat_rows)


Weight = torch.Tensor | Int4Weight | Int5Weight | Int8Weight | PackedInt8Weight | RowParts


class StripRows:
    """An Int8Weight's lookups (``rows``) served by the Linear that packed its codes into strips
    (engine.models.linear), so the model keeps one copy of a tied head and embedding: the exact
    source rows when the weight has them (a re-quantized file tensor), else the strips' values."""

    __slots__ = ("layer", "exact_rows", "is_exact", "shape")

    def __init__(self, layer, weight: Int8Weight):
        self.layer = layer
        self.exact_rows, self.is_exact, self.shape = weight.exact_rows, weight.is_exact, weight.shape

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.exact_rows is not None:  # the source's rows (a Q6_K head's: its own values, read faster)
            return self.exact_rows.rows(ids, dtype)
        return self.layer.rows(ids, dtype)


def cat_rows(parts: list[Weight]) -> Weight:
    """Concatenate weights along the output rows (fused QKV, gate/up). Parts of one format stay
    in it (Q6_K strips: theirs concatenated); Q6_K strips beside other quantized formats, and int5 beside
    an exact int8 (a Q8_0 V beside Q5_0 Q/K), stay apart in at most two parts (RowParts: each run of one
    kind fused); int4 beside int5 becomes int5 (exact), int5 beside int8 in more runs becomes int8 (exact
    where the int8 is), any other mix int8 re-quantized."""
    kinds = {type(p) for p in parts}
    q6_mix = PackedQ6Weight in kinds and len(kinds) > 1 and not kinds & {PackedInt8Weight, torch.Tensor}
    exact_mix = kinds == {Int5Weight, Int8Weight} and all(p.is_exact for p in parts if isinstance(p, Int8Weight))
    if q6_mix or exact_mix:
        # Q6_K strips beside other quantized rows, or Q5_0 beside Q8_0 (Gemma 3's and Qwen2.5's q/k beside
        # v): each run of one kind fused, at most two parts (what the decode program takes); more runs
        # take the rules below
        runs: list[list] = []
        for p in parts:
            if runs and _part_kind(runs[-1][0], q6_mix) == _part_kind(p, q6_mix):
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) <= 2:
            return RowParts([cat_rows(run) if len(run) > 1 else run[0] for run in runs])
    if kinds == {Int4Weight, Int5Weight}:
        parts = [Int5Weight.from_int4(p) if isinstance(p, Int4Weight) else p for p in parts]
        kinds = {Int5Weight}
    if kinds == {Int5Weight, Int8Weight}:
        parts, kinds = [p.to_int8() if isinstance(p, Int5Weight) else p for p in parts], {Int8Weight}
    if len(kinds) == 1:
        kind = kinds.pop()
        return torch.cat(parts) if kind is torch.Tensor else kind.cat(parts)
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
    return Int8Weight.from_dense(torch.cat(dense))


def _part_kind(weight, q6_mix: bool) -> type:
    """What cat_rows fuses into one part: beside Q6_K strips every other format together (cat_rows joins
    them by its rules), else each type apart."""
    if isinstance(weight, PackedQ6Weight):
        return PackedQ6Weight
    return object if q6_mix else type(weight)


def blocks_to_int4(blocks: torch.Tensor, num_cols: int, half: bool = False) -> Int4Weight:
    """The kernels' Q4 rows -> Int4Weight (the inverse of Int4Weight.blocks)."""
    num_rows, num_groups = blocks.shape[0], num_cols // GROUP_SIZE
    dtype, width = (torch.float16, 2) if half else (torch.float32, 4)
    scales = blocks[:, : num_groups * width].contiguous().view(dtype).float()  # [N, K/32]
    mins = blocks[:, num_groups * width: num_groups * 2 * width].contiguous().view(dtype).float()
    words = blocks[:, num_groups * 2 * width:].reshape(num_rows, num_groups // 2, 16, 2)  # [N, K/64, word, b]
    low, high = words[..., 0], words[..., 1]
    runs = torch.stack((low & 0x0F, low >> 4, high & 0x0F, high >> 4), dim=2)
    return Int4Weight.from_codes(runs.reshape(num_rows, num_cols), scales, mins)  # runs: [N, K/64, 4, 16]


def interleave_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernels' order (QG_Q8): per block of 32, byte 2i = element i, 2i + 1 = 16 + i."""
    num_rows, num_cols = q.shape
    return q.reshape(num_rows, -1, 2, 16).transpose(2, 3).reshape(num_rows, num_cols).contiguous()


def deinterleave_q8(q: torch.Tensor) -> torch.Tensor:
    num_rows, num_cols = q.shape
    return q.reshape(num_rows, -1, 16, 2).transpose(2, 3).reshape(num_rows, num_cols).contiguous()
