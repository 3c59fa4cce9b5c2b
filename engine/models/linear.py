"""Linear layers over three weight formats: dense (packed once for oneDNN), int4 groups of 32
(aten's CPU int4 matmul) and int8 per output row (aten's int8 weight matmul).

Dense: ``F.linear`` hands a plain row-major weight to the BLAS on every call; oneDNN's blocked
layout, made once at load (``mkldnn._reorder_linear_weight``), was faster at every row count
we measured. These are the ops torch's CPU compiler uses for frozen linear layers; where they
are missing or fail (bfloat16 on a CPU without AVX512-BF16, like our AVX2 host) the layer
keeps the plain weight and ``F.linear``.

Int4 (``Int4Weight``): codes q in 0..15, w = (q - 8) * scale + zero per group of 32 inputs;
``_weight_int4pack_mm_for_cpu`` takes scales_and_zeros [K / 32, N, 2] in the activation dtype.
Int8 (``Int8Weight``): w = q * scale[row], ``_weight_int8pack_mm`` with scales [N].
On AVX2 both run fast with bfloat16 inputs only (float32 inputs take a scalar path, ~12x
slower), so quantized products run in bfloat16 whatever the model's activation dtype, with a
cast in and out; float32 there gives the exact reference product for tests.

Per-row-count policy: a quantized layer may keep a dense copy for products of more than
``dense_above_rows`` rows (whole prompts), where oneDNN's dense float32 product wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

GROUP_SIZE = 32


@dataclass
class Int4Weight:
    """codes uint8 [N, K] in 0..15, scales/zeros float32 [N, K / 32]: w = (q - 8) * scale + zero."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """The same row operation (a permutation, a slice) on codes, scales and zeros."""
        return Int4Weight(fn(self.codes), fn(self.scales), fn(self.zeros))

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(*(torch.cat([getattr(p, n) for p in parts]) for n in ("codes", "scales", "zeros")))

    @staticmethod
    def from_dense(w: torch.Tensor) -> Int4Weight:
        """w [N, K] float -> asymmetric int4 groups of 32 (min/max, round to nearest)."""
        num_rows, num_cols = w.shape
        groups = w.float().reshape(num_rows, num_cols // GROUP_SIZE, GROUP_SIZE)  # [N, K/32, 32]
        low, high = groups.amin(-1), groups.amax(-1)  # [N, K/32]
        scale = ((high - low) / 15).clamp_min(1e-12)
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return Int4Weight(codes.reshape(num_rows, num_cols), scale, low + 8 * scale)

    def dequantize(self) -> torch.Tensor:
        """-> float32 [N, K]."""
        num_rows, num_cols = self.shape
        groups = self.codes.reshape(num_rows, -1, GROUP_SIZE).float() - 8  # [N, K/32, 32]
        return (groups * self.scales[..., None] + self.zeros[..., None]).reshape(num_rows, num_cols)


@dataclass
class Int8Weight:
    """q int8 [N, K], scales float32 [N]: w = q * scale[row]. exact_rows: optionally where the
    weight came from (rows read exactly from a GGUF map, engine.loader.repack.MappedRows) for
    lookups: the embedding and the head's refined logits."""
    q: torch.Tensor
    scales: torch.Tensor
    exact_rows: object | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int8Weight:
        return Int8Weight(fn(self.q), fn(self.scales))

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))

    @staticmethod
    def from_dense(w: torch.Tensor) -> Int8Weight:
        """w [N, K] float -> symmetric per-row int8 (scale = absmax / 127)."""
        w = w.float()
        scales = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
        q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return Int8Weight(q, scales)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] -> rows [..., K] in dtype (an embedding lookup): the exact source rows when
        known, else the dequantized int8 rows."""
        if self.exact_rows is not None:
            return self.exact_rows.rows(ids, dtype)
        return self.q[ids].to(dtype) * self.scales[ids].to(dtype)[..., None]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]


Weight = torch.Tensor | Int4Weight | Int8Weight


def cat_rows(parts: list[Weight]) -> Weight:
    """Concatenate weights along the output rows (fused QKV, gate/up). Parts of one format stay
    in it; a mix (a Q8_0 V beside Q5_0 Q/K) becomes per-row int8."""
    kinds = {type(p) for p in parts}
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

    quantized_dtype: the dtype a quantized product runs in (the int4/int8 ops take scales in
    it); activations of another dtype are cast in and out. bfloat16 by default (the fast
    kernels on AVX2); float32 gives the exact product. dense_above_rows: for a quantized W,
    also keep a dense float32 oneDNN copy and use it for more rows than this.
    """

    __slots__ = ("format", "out_features", "bias", "dense", "dense_above_rows", "quantized_dtype", "_int4", "_int8")

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, pack: bool = True,
                 keep_dense: bool = False, quantized_dtype: torch.dtype | None = None,
                 dense_above_rows: int | None = None):
        self.out_features = weight.shape[0]
        self.dense = None
        self.dense_above_rows = dense_above_rows
        self._int4 = self._int8 = None
        if isinstance(weight, torch.Tensor):
            self.format = "dense"
            self.quantized_dtype = None
            self.bias = None if bias is None else bias.to(weight.dtype)
            self.dense = DenseLinear(weight, self.bias, pack, keep_dense)
            return
        dtype = self.quantized_dtype = quantized_dtype or torch.bfloat16
        self.bias = None if bias is None else bias.to(dtype)
        if isinstance(weight, Int4Weight):
            self.format = "int4"
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
            scales_and_zeros = torch.stack((weight.scales.t(), weight.zeros.t()), dim=-1)  # [K/32, N, 2]
            self._int4 = (packed, scales_and_zeros.to(dtype).contiguous())
        elif isinstance(weight, Int8Weight):
            self.format = "int8"
            self._int8 = (weight.q.contiguous(), weight.scales.to(dtype).contiguous())
        else:
            raise TypeError(f"unsupported weight type {type(weight).__name__}")
        if dense_above_rows is not None:
            self.dense = DenseLinear(weight.dequantize(), None if bias is None else bias.float(), pack)

    @property
    def weight(self) -> torch.Tensor | None:
        """The dense weight when one is kept unpacked (dense format only)."""
        return self.dense.weight if self.format == "dense" else None

    @property
    def is_packed(self) -> bool:
        return self.format != "dense" or self.dense.is_packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.format == "dense":
            return self.dense(x)
        if self.dense is not None and x.shape[0] > self.dense_above_rows:
            return self.dense(x.float()).to(x.dtype)
        xq = x.to(self.quantized_dtype).contiguous()
        if self._int4 is not None:
            packed, scales_and_zeros = self._int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xq, packed, GROUP_SIZE, scales_and_zeros)
        else:
            q, scales = self._int8
            y = torch._weight_int8pack_mm(xq, q, scales)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(x.dtype)
