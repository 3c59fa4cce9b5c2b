"""Linear layers over four weight formats: dense (packed once for oneDNN), int4 and int5 groups
of 32, and int8 per block of 32, the quantized ones through our C kernels (cext/csrc/qgemm.c).

Dense: ``F.linear`` hands a plain row-major weight to the BLAS on every call; oneDNN's blocked
layout, made once at load (``mkldnn._reorder_linear_weight``), was faster at every row count
we measured. These are the ops torch's CPU compiler uses for frozen linear layers; where they
are missing or fail (bfloat16 on a CPU without AVX512-BF16, like our AVX2 host) the layer
keeps the plain weight and ``F.linear``.

Int4 (``Int4Weight``): w = q * scale + min per group of 32 inputs, q in 0..15 (ggml's form, so
Q4_0/Q4_1/Q4_K load exactly). Int5 (``Int5Weight``): the same with q in 0..31 (Q5_0/Q5_1).
Int8 (``Int8Weight``): w = q * scale per block of 32. Products of up to KERNEL_MAX_ROWS rows
run in C (cext/csrc/qgemm.c), the weights read once per call in their codes: below
``fused.get_float_rows()`` rows (decode batches, bound by the bytes of weights they stream) x is
quantized to int16 per block of 32 and the codes are widened in registers for integer dot
products (AVX2 madd); from there (bound by arithmetic) each pass decodes its weight rows once to
float32 and runs FMAs against float32 x. Larger products (long prompt chunks) dequantize the
weight to float32 a slice of rows at a time and use the BLAS. aten's int4 op was replaced: on
AVX2 it ran at ~5 GMAC/s at batch 1 against ~18-20 for these kernels
(benchmarks/quant_bench.py).

Per-row-count policy: a quantized layer may keep a dense copy for products of more than
``dense_above_rows`` rows (whole prompts), where oneDNN's dense float32 product wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

try:
    from cext import fused as _qgemm
except ImportError:  # not built: quantized products dequantize the weight per call
    _qgemm = None

GROUP_SIZE = 32
# Rows up to which the C kernels beat dequantize + BLAS: their float path ran 1.3-2x the BLAS
# route at 128 rows and prefilled 256-token chunks 1.4-1.6x faster in the model (the scheduler's
# default tick budget is 256); 512-1,000-row products measured even (benchmarks/qgemm_rows.py).
KERNEL_MAX_ROWS = 256
INT_KERNEL_MAX_ROWS = 16  # without AVX2 there is no float path: the scalar kernels up to here
DEQUANT_ROWS = 1024  # output rows dequantized at once for a prompt's product (4 MB of float32 at K = 896)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _is_half_exact(t: torch.Tensor) -> bool:
    """Whether every value of t is an fp16 value (float16 already, or float32 that converts back)."""
    if t.dtype == torch.float16:
        return True
    values = t.float().numpy()
    return bool((values.astype(np.float16).astype(np.float32) == values).all())


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
        return _is_half_exact(self.scales) and _is_half_exact(self.mins)

    def blocks(self, half: bool = False) -> torch.Tensor:
        """-> uint8 [N, K / 32 * (20 if half else 24)], the C kernels' layout (cext/csrc/qgemm.h):
        per row the scales, the mins (fp16 if half, else float32), then per pair of blocks 32
        bytes whose 16-bit word i holds elements i, 16 + i, 32 + i, 48 + i. K: a multiple of 64.
        (NumPy: ~20x faster than the same uint8 ops in torch here, which matters at load.)"""
        num_rows, num_cols = self.shape
        if num_cols % (2 * GROUP_SIZE):
            raise ValueError(f"Q4 blocks need K a multiple of {2 * GROUP_SIZE}, got {num_cols}")
        num_groups = num_cols // GROUP_SIZE
        dtype, width = (np.float16, 2) if half else (np.float32, 4)
        # ggml's byte i of a block holds its elements i (low nibble) and 16 + i (high), so word i
        # of a pair is byte i of the first block beside byte i of the second: an interleave.
        packed = self.packed.numpy().reshape(num_rows, num_groups // 2, 2, GROUP_SIZE // 2)  # [N, K/64, 2, 16]
        out = np.empty((num_rows, num_groups * (16 + 2 * width)), dtype=np.uint8)
        out[:, : num_groups * width] = self.scales.numpy().astype(dtype).view(np.uint8)
        out[:, num_groups * width: num_groups * 2 * width] = self.mins.numpy().astype(dtype).view(np.uint8)
        out[:, num_groups * 2 * width:].reshape(num_rows, num_groups // 2, GROUP_SIZE // 2, 2)[:] = \
            packed.transpose(0, 1, 3, 2)  # word i: (first block's byte i, second's)
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
        return Int5Weight(weight.packed, torch.zeros(num_rows, num_cols // 8, dtype=torch.uint8), weight.scales,
                          weight.mins)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int5Weight:
        return Int5Weight(fn(self.packed), fn(self.high), fn(self.scales), fn(self.mins))

    @staticmethod
    def cat(parts: list[Int5Weight]) -> Int5Weight:
        return Int5Weight(*(torch.cat([getattr(p, n) for p in parts]) for n in ("packed", "high", "scales", "mins")))

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
        """-> uint8 [N, K / 32 * (24 if half else 28)], the C kernels' Q5 rows (cext/csrc/qgemm.h):
        per row the scales and kernel_mins (fp16 if half, else float32), then per pair of blocks
        40 bytes: 16-bit word i = the 5-bit two's complement codes (q - 16) of elements 48 + i,
        32 + i, 16 + i at bits 11, 6, 1 and the top bit of element i's at bit 0; then element
        i's low 4 bits as nibble i. K: a multiple of 64. with_mins=False (every kernel min 0,
        Q5_0): no mins, K / 32 * (22 if half else 24) bytes, for the kernels' FK_NO_MINS layout."""
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
        if _qgemm is not None:  # a C loop: the NumPy below costs ~1.5 s at Qwen2.5-0.5B's load
            packed, high = self.packed.contiguous(), self.high.contiguous()
            _qgemm.q5_pack(packed.data_ptr(), high.data_ptr(), num_rows, num_cols, out[:, head:].ctypes.data,
                           out.shape[1])
            return torch.from_numpy(out)
        fields = (self.codes.numpy() ^ 16).reshape(num_rows, num_pairs, 4, 16).astype(np.uint16)  # (q - 16) & 31
        words = (fields[:, :, 3] << 11) | (fields[:, :, 2] << 6) | (fields[:, :, 1] << 1) | (fields[:, :, 0] >> 4)
        low = (fields[:, :, 0] & 0x0F).astype(np.uint8)  # [N, pairs, 16]
        pairs = out[:, head:].reshape(num_rows, num_pairs, 40)
        pairs[..., :32] = words.astype("<u2").view(np.uint8).reshape(num_rows, num_pairs, 32)
        pairs[..., 32:] = low[..., 0::2] | (low[..., 1::2] << 4)
        return torch.from_numpy(out)


@dataclass
class Int8Weight:
    """q int8 [N, K], scales float32 [N, K / 32]: w = q * scale per block of 32 inputs (ggml's
    Q8_0, so a Q8_0 tensor loads exactly). q is kept in the C kernels' order (interleave_q8:
    within each block, byte 2i = element i, 2i + 1 = element 16 + i), so the product needs no
    second copy; row operations are unaffected, element access goes through ``codes``. is_exact: q and scales are the source's own values
    (a Q8_0 file), not a re-quantization. exact_rows: optionally where a re-quantized weight
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


Weight = torch.Tensor | Int4Weight | Int5Weight | Int8Weight


def cat_rows(parts: list[Weight]) -> Weight:
    """Concatenate weights along the output rows (fused QKV, gate/up). Parts of one format stay
    in it; int4 beside int5 becomes int5 (exact), int5 (Q5_0) beside int8 (a Q8_0 V beside Q5_0
    Q/K) becomes int8 (exact), any other mix int8 re-quantized."""
    kinds = {type(p) for p in parts}
    if kinds == {Int4Weight, Int5Weight}:
        parts, kinds = [Int5Weight.from_int4(p) if isinstance(p, Int4Weight) else p for p in parts], {Int5Weight}
    if kinds == {Int5Weight, Int8Weight}:
        parts, kinds = [p.to_int8() if isinstance(p, Int5Weight) else p for p in parts], {Int8Weight}
    if len(kinds) == 1:
        kind = kinds.pop()
        return torch.cat(parts) if kind is torch.Tensor else kind.cat(parts)
    return Int8Weight.from_dense(torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]))


def _packing_ops():
    if not torch.backends.mkldnn.is_available():
        return None
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops._reorder_linear_weight, ops._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


class DenseLinear:
    """y = x @ weight.T + bias for x [T, in]; weight [out, in] (dense, or packed at init)."""

    __slots__ = ("weight", "bias", "out_features", "_packed", "_op")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 keep_dense: bool = False):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.weight = weight  # [out, in]; dropped once packed unless keep_dense
        self._packed = None
        self._op = None
        ops = _packing_ops() if pack else None
        if ops is None:
            return
        reorder, pointwise = ops
        try:
            packed = reorder(weight, 64)  # the row count the layout is tuned for; any count works
            probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
            pointwise(probe, packed, bias, "none", [None], "")
        except RuntimeError:
            return
        self._packed, self._op = packed, pointwise
        if not keep_dense:
            self.weight = None

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return self._op(x, self._packed, self.bias, "none", [None], "")


class Linear:
    """y = x @ W.T + b for x [T, in] -> [T, out] (in x's dtype), W dense, Int4Weight or Int8Weight.

    quantized_dtype: how a quantized product runs. None (the default): the C kernels of
    cext/csrc/qgemm.h for up to KERNEL_MAX_ROWS rows (int16 activation codes and integer dot
    products for decode batches, float32 FMAs over weights decoded per pass from
    fused.get_float_rows() rows), and for more rows the weight dequantized to float32 a slice at
    a time and a float32 product. A dtype (float32 in tests): always the dequantized weight in
    that dtype, the exact product.
    dense_above_rows: for a quantized W, also keep a dense float32 oneDNN copy and use it for
    more rows than this (memory for speed on long prompts; off by default).
    """

    __slots__ = ("format", "out_features", "in_features", "bias", "dense", "dense_above_rows", "quantized_dtype",
                 "weight_dtype", "_blocks", "_half", "_no_mins", "_q8", "_scales")

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, pack: bool = True,
                 keep_dense: bool = False, quantized_dtype: torch.dtype | None = None,
                 dense_above_rows: int | None = None):
        self.out_features, self.in_features = weight.shape
        self.dense = None
        self.dense_above_rows = dense_above_rows
        self._blocks = self._q8 = self._scales = None
        self._half = self._no_mins = False
        if isinstance(weight, torch.Tensor):
            self.format = "dense"
            self.quantized_dtype = None
            self.weight_dtype = weight.dtype
            self.bias = None if bias is None else bias.to(weight.dtype)
            self.dense = DenseLinear(weight, self.bias, pack, keep_dense)
            return
        self.quantized_dtype = quantized_dtype
        self.weight_dtype = None
        self.bias = None if bias is None else bias.float().contiguous()
        if isinstance(weight, Int5Weight) and (self.in_features % (2 * GROUP_SIZE) or _qgemm is None):
            weight = weight.to_int8()  # no kernel layout: the int8 form (exact for Q5_0)
        if isinstance(weight, Int5Weight):
            self.format = "int5"
            self._half = weight.is_half_exact()
            self._no_mins = bool((weight.kernel_mins == 0).all())  # Q5_0: rows without mins, no m term
            self._blocks = weight.blocks(self._half, with_mins=not self._no_mins)  # [N, K/32 * (22-28)]
        elif isinstance(weight, Int4Weight):
            self.format = "int4"
            if self.in_features % (2 * GROUP_SIZE) == 0:
                self._half = weight.is_half_exact()  # fp16 scales where that loses nothing
                self._blocks = weight.blocks(self._half)  # [N, K/32 * (20 or 24)]
            else:  # no kernel layout: the product dequantizes per call
                self._q8 = weight
        elif isinstance(weight, Int8Weight):
            self.format = "int8"
            self._q8 = weight.q.contiguous()  # [N, K], already in the kernels' order
            scales = weight.scales
            self._half = scales.dtype == torch.float16 or _is_half_exact(scales)  # a file's fp16 d: half the bytes
            self._scales = (scales.half() if self._half else scales.float()).contiguous()  # [N, K/32]
        else:
            raise TypeError(f"unsupported weight type {type(weight).__name__}")
        if dense_above_rows is not None:
            self.dense = DenseLinear(weight.dequantize(), self.bias, pack)

    @property
    def weight(self) -> torch.Tensor | None:
        """The dense weight when one is kept unpacked (dense format only)."""
        return self.dense.weight if self.format == "dense" else None

    @property
    def is_packed(self) -> bool:
        return self.format != "dense" or self.dense.is_packed

    @property
    def is_exact(self) -> bool:
        """Whether products are float32 products of the stored weight (no rounding of x or W
        beyond float32)."""
        if self.format == "dense":
            return self.weight_dtype == torch.float32
        return self.quantized_dtype == torch.float32

    def dequantize(self, first_row: int = 0, end_row: int | None = None) -> torch.Tensor:
        """A quantized weight (or its output rows first_row .. end_row - 1) -> float32 [n, K], a new tensor."""
        end_row = self.out_features if end_row is None else end_row
        if self.format == "int8":
            return Int8Weight(self._q8[first_row:end_row], self._scales[first_row:end_row]).dequantize()
        if self._blocks is None:  # an Int4Weight the kernels cannot take
            return self._q8.map_rows(lambda t: t[first_row:end_row]).dequantize()
        blocks = self._blocks[first_row:end_row]
        out = torch.empty(end_row - first_row, self.in_features, dtype=torch.float32)
        if _qgemm is not None:
            _qgemm.q4_dequantize(blocks.data_ptr(), self._half, len(blocks), self.in_features, out.data_ptr(),
                                 self.format == "int5", self._no_mins)
            return out
        return blocks_to_int4(blocks, self.in_features, self._half).dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.format == "dense":
            return self.dense(x)
        num_rows = x.shape[0]
        if self.dense is not None and num_rows > self.dense_above_rows:
            return self.dense(x.float()).to(x.dtype)
        code = _DTYPE_CODES.get(x.dtype)
        if (self.quantized_dtype is None and _qgemm is not None and code is not None
                and (self._blocks is not None or self.format == "int8")
                and (num_rows <= INT_KERNEL_MAX_ROWS or (num_rows <= KERNEL_MAX_ROWS and _qgemm.get_isa() != "baseline"))):
            if x.stride(-1) != 1:
                x = x.contiguous()
            y = torch.empty(num_rows, self.out_features, dtype=x.dtype)  # [T, N]
            bias = 0 if self.bias is None else self.bias.data_ptr()
            if self._blocks is not None:
                _qgemm.q4_matmul(x.data_ptr(), x.stride(0), num_rows, self.in_features, self._blocks.data_ptr(),
                                 self._half, self.out_features, bias, y.data_ptr(), self.out_features, code,
                                 self.format == "int5", self._no_mins)
            else:
                _qgemm.q8_matmul(x.data_ptr(), x.stride(0), num_rows, self.in_features, self._q8.data_ptr(),
                                 self._scales.data_ptr(), self.out_features, bias, y.data_ptr(), self.out_features,
                                 code, self._half)
            return y
        if self.quantized_dtype is not None:  # the exact product with the whole dequantized weight
            w = self.dequantize().to(self.quantized_dtype)  # [N, K]
            bias = None if self.bias is None else self.bias.to(self.quantized_dtype)
            return F.linear(x.to(self.quantized_dtype), w, bias).to(x.dtype)
        # Prompts: float32 products over DEQUANT_ROWS output rows at a time, so the dequantized
        # weight held at once is a few MB, not the layer (35 MB for Qwen2.5-0.5B's gate/up).
        x32 = x.float()
        y = torch.empty(num_rows, self.out_features, dtype=torch.float32)  # [T, N]
        for first in range(0, self.out_features, DEQUANT_ROWS):
            end = min(first + DEQUANT_ROWS, self.out_features)
            bias = None if self.bias is None else self.bias[first:end]
            y[:, first:end] = F.linear(x32, self.dequantize(first, end), bias)
        return y.to(x.dtype)


def blocks_to_int4(blocks: torch.Tensor, num_cols: int, half: bool = False) -> Int4Weight:
    """The kernels' Q4 rows -> Int4Weight (the inverse of Int4Weight.blocks)."""
    num_rows, num_groups = blocks.shape[0], num_cols // GROUP_SIZE
    dtype, width = (torch.float16, 2) if half else (torch.float32, 4)
    scales = blocks[:, : num_groups * width].contiguous().view(dtype).float()  # [N, K/32]
    mins = blocks[:, num_groups * width: num_groups * 2 * width].contiguous().view(dtype).float()
    words = blocks[:, num_groups * 2 * width:].reshape(num_rows, num_groups // 2, 16, 2)  # [N, K/64, word, byte]
    runs = torch.stack((words[..., 0] & 0x0F, words[..., 0] >> 4, words[..., 1] & 0x0F, words[..., 1] >> 4), dim=2)
    return Int4Weight.from_codes(runs.reshape(num_rows, num_cols), scales, mins)  # runs: [N, K/64, 4, 16]


def interleave_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernels' order: per block of 32, byte 2i = element i, 2i + 1 = 16 + i."""
    num_rows, num_cols = q.shape
    return q.reshape(num_rows, -1, 2, 16).transpose(2, 3).reshape(num_rows, num_cols).contiguous()


def deinterleave_q8(q: torch.Tensor) -> torch.Tensor:
    num_rows, num_cols = q.shape
    return q.reshape(num_rows, -1, 16, 2).transpose(2, 3).reshape(num_rows, num_cols).contiguous()
