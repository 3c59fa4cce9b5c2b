"""Linear layers over the weight formats of engine/models/quant.py: dense (packed once for
oneDNN), and int4, int5 and int8 blocks of 32 through the C kernels (cext.qgemm; routes and
byte layouts in cext/csrc/qgemm.h).

Dense: ``F.linear`` hands a plain row-major weight to the BLAS on every call; oneDNN's blocked
layout, made once at load (``mkldnn._reorder_linear_weight``), was faster at every row count
we measured. These are the ops torch's CPU compiler uses for frozen linear layers; where they
are missing or fail the layer keeps the plain weight and ``F.linear``.

Quantized: where the CPU has AVX2 (or AVX-512 VNNI) the weights are packed at load into strips of 16
rows (``should_pack``; cext/csrc/qgemm.h's QG_PACKED) and every product runs the strip route over
them in place (or amx3, or blas through their dequantization). Otherwise products of up to
KERNEL_MAX_ROWS rows run in C, the weights read once per call in their codes (below
``qgemm.get_float_rows()`` rows with int16 activation codes and integer dot products, from there
float32 FMAs over weights decoded per pass). Larger products (long prompt chunks) dequantize the
weight to float32 a slice of rows at a time and use the BLAS.
``exact=True`` makes every product the float32 product of the dequantized weight (tests,
benchmarks/quant_accuracy.py). Optionally a quantized layer keeps a dense copy for products of
more than ``dense_above_rows`` rows (whole prompts), where oneDNN's dense float32 product wins.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from engine.models.quant import (
    GROUP_SIZE,
    Int4Weight,
    Int5Weight,
    Int8Weight,
    PackedInt8Weight,
    PackedQ6Weight,
    RowParts,
    Weight,
    blocks_to_int4,
    dequantize_rows,
    is_half_exact_tensor,
)

try:
    from cext import cpu, qgemm
except ImportError:  # not built: quantized products dequantize the weight per call
    cpu = qgemm = None

class _RowRoutes(threading.local):
    """The running forward's row spans, per thread (``row_routes``)."""

    spans: tuple[tuple[int, int], ...] = ()


_ROW_ROUTES = _RowRoutes()
# Routes whose rows are computed independently of each other (the C kernels: int16 codes and
# float32 sums per row): spans that take one of them may share a call. A BLAS may block a product
# by its row count, so spans on the others run as products of their own.
ROW_INDEPENDENT = ("int16", "float", "amx_int", "strip", "amx3")


class row_routes:
    """``with row_routes(((rows, route_rows), ...)):`` the products inside split their rows into
    consecutive spans, each computed by the route a product of its ``route_rows`` rows takes;
    rows after the last span take the route of their own count. The model passes its tick's
    classes of rows (ForwardBatch.route_spans): decode and verification rows by the number of
    decoding sequences (the route plain decoding of them takes), or, with a prompt chunk among
    them, the generation requests' rows by their count; embedding texts' rows by theirs. The
    routes round differently (int16 activation codes or float32) but a row's numbers depend only
    on its route, so a speculative step's verification rows equal plain decoding and embedding
    rows move no stream's or prompt's numbers. Spans on different routes run as separate
    products (one more pass over the weights).
    Nested uses restore the outer spans on exit (MoE experts and the head set their own)."""

    __slots__ = ("spans", "_outer")

    def __init__(self, spans: tuple[tuple[int, int], ...]):
        self.spans = spans

    def __enter__(self) -> row_routes:
        self._outer = _ROW_ROUTES.spans
        _ROW_ROUTES.spans = self.spans
        return self

    def __exit__(self, *exc) -> None:
        _ROW_ROUTES.spans = self._outer


def current_row_routes() -> tuple[tuple[int, int], ...]:
    """The spans of the innermost ``row_routes`` of this thread, () outside."""
    return _ROW_ROUTES.spans


# Rows up to which the C kernels beat dequantize + BLAS without a measured route table (the
# scheduler's default tick budget is 256; docs/performance.md, "Quantized product routes").
KERNEL_MAX_ROWS = 256
# Rows per C kernel call: a product of more rows runs as calls of this many. The kernels read
# all of x once per pass of decoded weight rows; past a few hundred rows x leaves L2 and their
# rate fell 1.3-3x per row at 4,096 rows (docs/performance.md).
KERNEL_BLOCK_ROWS = 256
INT_KERNEL_MAX_ROWS = 16  # without AVX2 there is no float path: the scalar kernels up to here
# The kernels' layout codes (cext/csrc/qgemm.h's QG_*; tests/test_qgemm.py checks they agree).
Q4, Q5, Q8, HALF, NO_MINS, ROUTE_INT, ROUTE_FLOAT, SUPER, ROUTE_AMX, ROUTE_STRIP = 0, 1, 2, 4, 8, 16, 32, 64, 128, 256
Q6 = 3  # Q6_K's own codes, in strips only (qgemm.h's QG_Q6)
PACKED = 512  # quantized rows stored in strips of 16 for the strip route (qgemm.h's QG_PACKED)
INT8 = 1024  # packed products with int8 activation codes (qgemm.h's QG_INT8)
# The C kernels' routes (cext/csrc/qgemm.h): amx_int is int16's integer sums on AMX-INT8 tiles,
# strip the same sums with AVX-512 VNNI, 16 outputs per vector; amx3 (packed strips only, the same
# route bit as amx_int) three bfloat16 products of the split weights and activations on AMX-BF16
# tiles (cext/csrc/qgemm_amx3.h).
KERNEL_ROUTES = {"int16": ROUTE_INT, "float": ROUTE_FLOAT, "amx_int": ROUTE_AMX, "strip": ROUTE_STRIP,
                  "amx3": ROUTE_AMX}
AMX_ROWS = 1024  # output rows dequantized to bfloat16 at once on the amx route (1.8 MB at K = 896)
# float32 elements of a weight dequantized at once on the blas route (16 MB: all of a SmolLM2
# layer's weight in one product, Qwen2.5-0.5B's gate/up in 3), into a per-thread scratch reused
# by every call: a fresh tensor per call cost more than the dequantization (page faults; 256 rows
# at 2 threads, load ~15: qkv 47 ms per call against 23 ms, docs/performance.md)
DEQUANT_FLOATS = 1 << 22
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_ROUTE_EPOCH = 0  # bumped whenever a layer's route table changes (decode programs cache routes)


def route_epoch() -> int:
    return _ROUTE_EPOCH


def is_kernel_route(route: str) -> bool:
    """Whether a route runs in the C kernels (Linear.kernel_layout gives its layout code)."""
    return route in KERNEL_ROUTES


def one_class_route_rows(num_rows: int) -> int | None:
    """The row count a product of num_rows rows routes by when the current ``row_routes`` make its
    rows one class (a decode step; no spans: num_rows itself), else None (Linear.__call__ then
    splits the product by class)."""
    spans = _ROW_ROUTES.spans
    if not spans:
        return num_rows
    return spans[0][1] if spans[0][0] >= num_rows else None


def _packing_ops():
    if not torch.backends.mkldnn.is_available():
        return None
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops._reorder_linear_weight, ops._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_scratch = threading.local()


def _scratch_floats(num_floats: int) -> torch.Tensor:
    """This thread's reused float32 scratch, at least num_floats long -> its first num_floats."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < num_floats:
        buf = _scratch.buf = torch.empty(num_floats, dtype=torch.float32)
    return buf[:num_floats]


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
    """y = x @ W.T + b for x [T, in] -> [T, out] (in x's dtype), W dense or a quant.py weight.

    exact: every product of a quantized W is the float32 product of the dequantized weight
    (else the kernels of cext.qgemm up to KERNEL_MAX_ROWS rows, and beyond them the weight
    dequantized a slice at a time and a float32 product).
    dense_above_rows: for a quantized W, also keep a dense float32 oneDNN copy and use it for
    more rows than this (memory for speed on long prompts; off by default).
    """

    __slots__ = ("format", "out_features", "in_features", "bias", "dense", "dense_above_rows", "exact",
                 "weight_dtype", "layout", "_rows", "_scales", "_int4", "_route_grid", "_route_best", "parts")

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, pack: bool = True,
                 keep_dense: bool = False, exact: bool = False, dense_above_rows: int | None = None):
        self.out_features, self.in_features = weight.shape
        self.dense = None
        self.dense_above_rows = dense_above_rows
        self.exact = exact
        self.layout = None  # the qgemm layout of _rows (and _scales), None: no kernel layout
        self._rows = self._scales = self._int4 = None
        self._route_grid = self._route_best = None  # engine.models.routes' table; None: the fixed thresholds
        self.parts = None  # RowParts: the parts' layers, each product into its columns of one output
        if isinstance(weight, RowParts):
            self.format, self.weight_dtype = "parts", None
            self.bias = None if bias is None else bias.float().contiguous()
            self.parts, first = [], 0
            for part in weight.parts:
                rows = part.shape[0]
                self.parts.append(Linear(part, None if bias is None else bias[first:first + rows], pack, exact=exact))
                first += rows
            if dense_above_rows is not None:
                self.dense = DenseLinear(weight.dequantize(), self.bias, pack)
            return
        if isinstance(weight, torch.Tensor):
            self.format = "dense"
            self.weight_dtype = weight.dtype
            self.bias = None if bias is None else bias.to(weight.dtype)
            self.dense = DenseLinear(weight, self.bias, pack, keep_dense)
            return
        self.weight_dtype = None
        self.bias = None if bias is None else bias.float().contiguous()
        if isinstance(weight, Int5Weight) and (self.in_features % (2 * GROUP_SIZE) or qgemm is None):
            weight = weight.to_int8()  # no kernel layout: the int8 form (exact for Q5_0)
        if isinstance(weight, Int5Weight):
            self.format = "int5"
            half = weight.is_half_exact()
            no_mins = bool((weight.kernel_mins == 0).all())  # Q5_0: rows without mins, no m term
            self._rows = weight.blocks(half, with_mins=not no_mins)  # [N, K/32 * (22-28)]
            self.layout = _layout(Q5, half, no_mins)
            if should_pack(self):
                self._pack()
        elif isinstance(weight, Int4Weight):
            self.format = "int4"
            if self.in_features % (2 * GROUP_SIZE) == 0:
                half = weight.is_half_exact()  # fp16 scales where that loses nothing
                # Q4_K's scales are not fp16 values but factor as it stores them: 18.5 bytes a
                # block instead of 24 (the C kernels read QG_SUPER; the NumPy fallback does not)
                rows = None if half or qgemm is None else weight.super_blocks()
                if rows is not None:
                    self._rows, self.layout = rows, Q4 | SUPER  # [N, K/32 * 18.5]
                else:
                    self._rows = weight.blocks(half)  # [N, K/32 * (20 or 24)]
                    self.layout = _layout(Q4, half)
                if should_pack(self):
                    self._pack()
            else:  # no kernel layout: the product dequantizes per call
                self._int4 = weight
        elif isinstance(weight, PackedInt8Weight):  # packed by the loader, a chunk of rows at a time
            self.format = "q6" if isinstance(weight, PackedQ6Weight) else "int8"
            self._rows, self.layout = weight.strips, weight.layout | PACKED
        elif isinstance(weight, Int8Weight):
            self.format = "int8"
            self._rows = weight.q.contiguous()  # [N, K], already in the kernels' order
            scales = weight.scales
            # a file's fp16 d: half the bytes
            half = scales.dtype == torch.float16 or is_half_exact_tensor(scales)
            self._scales = (scales.half() if half else scales.float()).contiguous()  # [N, K/32]
            self.layout = _layout(Q8, half)
            if should_pack(self):
                self._pack()
        else:
            raise TypeError(f"unsupported weight type {type(weight).__name__}")
        if dense_above_rows is not None:
            self.dense = DenseLinear(weight.dequantize(), self.bias, pack)

    def _pack(self) -> None:
        """The Q4, Q5 or Q8 rows -> strips of 16 rows (qgemm.h's QG_PACKED): every product of this layer
        then runs the strip route (or dequantizes), whatever its row count."""
        strip_bytes = qgemm.packed_strip_bytes(self.layout, self.in_features)
        packed = torch.empty(self.out_features // 16, strip_bytes, dtype=torch.uint8)
        scales = 0 if self._scales is None else self._scales.data_ptr()
        qgemm.pack(self.layout, self._rows.data_ptr(), scales, self.out_features, self.in_features,
                   packed.data_ptr())
        self._rows, self._scales, self.layout = packed, None, self.layout | PACKED

    def use_int8_activations(self) -> bool:
        """From now on quantize this layer's activations to int8 codes (qgemm.h's QG_INT8: twice the
        multiply-adds per instruction, llama.cpp's precision) where its rows are packed strips and its
        products are not exact -> whether it does (other layers keep their int16 codes)."""
        if self.parts is not None:  # a list, not a generator: every part is switched, not just up to a refusal
            return all([part.use_int8_activations() for part in self.parts])
        if self.int8_activations:
            return True
        if self.exact or not self.is_packed_strips:
            return False
        qgemm.pack_int8(self.layout, self._rows.data_ptr(), self.out_features, self.in_features)  # Q5's masks
        self.layout |= INT8
        return True

    @property
    def int8_activations(self) -> bool:
        if self.parts is not None:
            return all(part.int8_activations for part in self.parts)
        return self.layout is not None and bool(self.layout & INT8)

    @property
    def is_packed_strips(self) -> bool:
        """Whether the rows are stored in strips of 16 (only strip, amx3, blas and amx can run them)."""
        return self.layout is not None and bool(self.layout & PACKED)

    @property
    def weight(self) -> torch.Tensor | None:
        """The dense weight when one is kept unpacked (dense format only)."""
        return self.dense.weight if self.format == "dense" else None

    @property
    def is_packed(self) -> bool:
        return self.format != "dense" or self.dense.is_packed

    @property
    def half(self) -> bool:
        """Whether the kernels' rows hold fp16 scales (and mins)."""
        return self.layout is not None and bool(self.layout & HALF)

    @property
    def no_mins(self) -> bool:
        """Whether the kernels' Q5 rows hold no mins (Q5_0)."""
        return self.layout is not None and bool(self.layout & NO_MINS)

    @property
    def is_exact(self) -> bool:
        """Whether products are float32 products of the stored weight (no rounding of x or W
        beyond float32)."""
        if self.format == "dense":
            return self.weight_dtype == torch.float32
        return self.exact

    def dequantize(self, first_row: int = 0, end_row: int | None = None) -> torch.Tensor:
        """A quantized weight (or its output rows first_row .. end_row - 1) -> float32 [n, K] (new)."""
        end_row = self.out_features if end_row is None else end_row
        if self.parts is not None:
            return torch.cat([part.dequantize() for part in self.parts])[first_row:end_row]
        if self._int4 is not None:  # an Int4Weight the kernels cannot take
            return self._int4.map_rows(lambda t: t[first_row:end_row]).dequantize()
        if qgemm is None:
            if self.format == "int8":
                return Int8Weight(self._rows[first_row:end_row], self._scales[first_row:end_row]).dequantize()
            return blocks_to_int4(self._rows[first_row:end_row], self.in_features, self.half).dequantize()
        out = torch.empty(end_row - first_row, self.in_features, dtype=torch.float32)
        return self._dequantize_into(first_row, end_row, out)

    def _dequantize_into(self, first_row: int, end_row: int, out: torch.Tensor) -> torch.Tensor:
        """Rows first_row .. end_row - 1 of a kernel-layout weight -> out [n, K] float32 (contiguous)."""
        scales = 0 if self._scales is None else self._scales.data_ptr()
        qgemm.dequantize(self.layout, self._rows.data_ptr(), scales, first_row, end_row - first_row,
                         self.in_features, out.data_ptr())
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] -> the dequantized weight rows [..., K] in dtype (a lookup: an embedding that
        shares this layer's codes)."""
        return dequantize_rows(self.layout, self._rows, self._scales, (self.out_features, self.in_features), ids,
                               dtype)

    def _dequantized_slice(self, first_row: int, end_row: int) -> torch.Tensor:
        """The rows dequantized, in this thread's scratch when the kernels' layout allows (valid
        until the next call on this thread), else a new tensor."""
        if self._int4 is not None or qgemm is None:
            return self.dequantize(first_row, end_row)
        out = _scratch_floats((end_row - first_row) * self.in_features).view(end_row - first_row, -1)
        return self._dequantize_into(first_row, end_row, out)

    # ----- routes (engine.models.routes) -----
    def row_slice(self, num_out: int) -> Linear:
        """The same layer's first num_out output rows (sharing storage), for timing its routes."""
        part = object.__new__(Linear)
        for name in self.__slots__:
            setattr(part, name, getattr(self, name))
        part.out_features = num_out
        part.dense = None
        part._route_grid = part._route_best = None
        if self.is_packed_strips:  # strips of 16 rows
            if num_out % 16:
                raise ValueError(f"num_out: a packed layer is sliced in strips of 16 rows, got {num_out}")
            part._rows = self._rows[:num_out // 16]
        elif self._rows is not None:
            part._rows = self._rows[:num_out]
        if self._scales is not None:
            part._scales = self._scales[:num_out]
        if self.bias is not None:
            part.bias = self.bias[:num_out]
        if self._int4 is not None:
            part._int4 = self._int4.map_rows(lambda t: t[:num_out])
        return part

    def set_routes(self, grid: tuple[int, ...], best: list[str]) -> None:
        """The route for up to grid[i] rows is best[i] (beyond the last entry: the last route);
        an entry this layer cannot run (a table of another shape's) takes its fixed route."""
        global _ROUTE_EPOCH
        best = [route if self.can_run(route, limit) else self.fixed_route(limit) for limit, route in zip(grid, best)]
        self._route_grid, self._route_best = tuple(grid), best
        _ROUTE_EPOCH += 1

    def fixed_route(self, num_rows: int) -> str:
        """The route without a measured table: the kernels up to KERNEL_MAX_ROWS rows (the
        scalar ones up to INT_KERNEL_MAX_ROWS), float from qgemm.get_float_rows(), else blas."""
        if self.exact or self.layout is None or qgemm is None:
            return "blas"
        if self.is_packed_strips:
            return "strip"
        if cpu.get_isa() == "baseline":
            return "int16" if num_rows <= INT_KERNEL_MAX_ROWS else "blas"
        if num_rows > KERNEL_MAX_ROWS:
            return "blas"
        return "float" if num_rows >= qgemm.get_float_rows() else "int16"

    def route(self, num_rows: int) -> str:
        if self._route_best is None or self.exact:
            return self.fixed_route(num_rows)
        for limit, route in zip(self._route_grid, self._route_best):
            if num_rows <= limit:
                return route
        return self._route_best[-1]

    def can_run(self, route: str, num_rows: int) -> bool:
        if self.parts is not None:
            return all(part.can_run(route, num_rows) for part in self.parts)
        if route == "blas":
            return True
        if self.layout is None or qgemm is None:
            return False
        if self.is_packed_strips:  # strip at any ISA (AVX-512 VNNI's, AVX2's or the portable kernel: same bits)
            if route == "amx3":  # not over int8 strips (their Q5 sign masks are the int8 kernel's)
                return cpu.allows("amx_bf16") and not self.int8_activations
            return route == "strip" or (route == "amx" and cpu.allows("amx_bf16"))
        if route == "float":
            return cpu.get_isa() != "baseline"
        if route == "amx3":
            return False
        if route == "amx":
            return cpu.allows("amx_bf16")
        if route == "amx_int":
            return cpu.allows("amx_int8") and self.out_features % 16 == 0
        if route == "strip":
            return cpu.allows("avx512_vnni") and self.out_features % 16 == 0
        return route == "int16"

    def kernel_layout(self, route: str) -> int:
        """The qgemm layout code of a product on one of the C kernel routes (KERNEL_ROUTES)."""
        return self.layout | KERNEL_ROUTES[route]

    def run(self, x: torch.Tensor, route: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] through one route ("int16", "float", "amx_int", "strip", "amx3", "amx" or
        "blas");
        ``out``: a float32 [T, out] tensor to write the result into (returned)."""
        if self.parts is not None:
            return _into(out, torch.cat([part.run(x, route) for part in self.parts], dim=1))
        num_rows = x.shape[0]
        if route in KERNEL_ROUTES:
            code = _DTYPE_CODES.get(x.dtype)
            if code is None:
                x, code = x.float(), 0
            if x.stride(-1) != 1:
                x = x.contiguous()
            if out is None or out.dtype != x.dtype:
                y = torch.empty(num_rows, self.out_features, dtype=x.dtype)  # [T, N]
            else:
                y = out
            bias = 0 if self.bias is None else self.bias.data_ptr()
            scales = 0 if self._scales is None else self._scales.data_ptr()
            layout = self.kernel_layout(route)
            # KERNEL_BLOCK_ROWS rows per call: each pass of decoded weight rows then meets a block
            # of x that stays in L2 (docs/performance.md, "Row blocks of the C kernels"). The blocks'
            # addresses by arithmetic: a row view costs ~1 us, beside a one-row product's ~20.
            x_ptr, y_ptr, rows_ptr = x.data_ptr(), y.data_ptr(), self._rows.data_ptr()
            x_step, y_step = x.stride(0) * x.element_size(), self.out_features * y.element_size()
            for first in range(0, num_rows, KERNEL_BLOCK_ROWS):
                count = min(KERNEL_BLOCK_ROWS, num_rows - first)
                qgemm.matmul(layout, x_ptr + first * x_step, x.stride(0), count, self.in_features, rows_ptr,
                             scales, self.out_features, bias, y_ptr + first * y_step, self.out_features, code)
            return _into(out, y)
        if route == "amx":
            return _into(out, self._bf16_product(x))
        # blas: float32 products over slices of at most DEQUANT_FLOATS dequantized weights, so
        # what is held at once is a few MB, not the layer (35 MB for Qwen2.5-0.5B's gate/up);
        # one product when the whole weight fits (slices into a strided y measured 3x slower).
        x32 = x.float()
        slice_rows = max(1, DEQUANT_FLOATS // self.in_features)
        if slice_rows >= self.out_features:
            return _into(out, F.linear(x32, self._dequantized_slice(0, self.out_features), self.bias).to(x.dtype))
        y = torch.empty(num_rows, self.out_features, dtype=torch.float32) if out is None else out  # [T, N]
        for first in range(0, self.out_features, slice_rows):
            end = min(first + slice_rows, self.out_features)
            bias = None if self.bias is None else self.bias[first:end]
            y[:, first:end] = F.linear(x32, self._dequantized_slice(first, end), bias)
        return y if out is not None else y.to(x.dtype)

    def _bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """The weights dequantized to bfloat16 AMX_ROWS output rows at a time and oneDNN's
        bfloat16 matmul (AMX tiles): x, W and y rounded to bfloat16, float32 sums."""
        num_rows = x.shape[0]
        xb = x.to(torch.bfloat16)
        y = torch.empty(num_rows, self.out_features, dtype=torch.float32)  # [T, N]
        chunk = min(AMX_ROWS, self.out_features)
        w = torch.empty(chunk, self.in_features, dtype=torch.bfloat16)  # [chunk, K]
        scales = 0 if self._scales is None else self._scales.data_ptr()
        for first in range(0, self.out_features, chunk):
            count = min(chunk, self.out_features - first)
            qgemm.dequantize(self.layout, self._rows.data_ptr(), scales, first, count, self.in_features,
                             w.data_ptr(), qgemm.BFLOAT16)
            # bfloat16 out: torch's CPU mm has no float32 output for bfloat16 inputs
            y[:, first:first + count] = torch.mm(xb, w[:count].t())
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out], its rows split by the current ``row_routes``. ``out``: a float32
        [T, out] tensor to write the result into (returned), e.g. the engine's logits buffer."""
        if self.format == "dense":
            return _into(out, self.dense(x))
        if self.parts is not None:  # each part's product (its own routes) into its columns
            if self.dense is not None and x.shape[0] > self.dense_above_rows:
                return self._product(x, "dense", out)
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype) if out is None else out
            first = 0
            for part in self.parts:
                y[:, first:first + part.out_features] = part(x)
                first += part.out_features
            return y
        num_rows = x.shape[0]
        route_rows = one_class_route_rows(num_rows)
        if route_rows is not None:  # one class of rows (a decode step): one product
            return self._product(x, self._way(route_rows), out)
        spans = _ROW_ROUTES.spans
        pieces = []  # [first row, end row, way]
        first = 0
        rest = num_rows - sum(rows for rows, _ in spans)
        for rows, route_rows in (*spans, (rest, rest)):  # the rows after the spans: their own count
            if rows <= 0 or first >= num_rows:
                continue
            end = min(first + rows, num_rows)
            way = self._way(route_rows)
            if pieces and pieces[-1][2] == way and way in ROW_INDEPENDENT:
                pieces[-1][1] = end
            else:
                pieces.append([first, end, way])
            first = end
        if len(pieces) == 1:
            return self._product(x, pieces[0][2], out)
        if out is not None:
            for first, end, way in pieces:
                self._product(x[first:end], way, out[first:end])
            return out
        return torch.cat([self._product(x[first:end], way) for first, end, way in pieces])

    def _way(self, num_rows: int) -> str:
        """How a product of num_rows rows runs: "dense" (the dense copy), "exact" or a route."""
        if self.dense is not None and num_rows > self.dense_above_rows:
            return "dense"
        return "exact" if self.exact else self.route(num_rows)

    def _product(self, x: torch.Tensor, way: str, out: torch.Tensor | None = None) -> torch.Tensor:
        if way == "dense":
            return _into(out, self.dense(x.float()).to(x.dtype))
        if way == "exact":  # the exact product with the whole dequantized weight
            return _into(out, F.linear(x.float(), self.dequantize(), self.bias).to(x.dtype))
        return self.run(x, way, out)


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y, or y copied into out (a product that made its own tensor, with an out to fill)."""
    if out is None or out is y:
        return y
    out.copy_(y)
    return out


def packs(num_out: int, exact: bool = False) -> bool:
    """Whether a quantized layer of num_out outputs is packed into strips of 16 (``Linear._pack``): its
    outputs are a multiple of 16, its products are not ``exact``, the CPU has AVX2 (AVX-512 VNNI's
    kernel or AVX2's, the same bits) and neither ``ENGINE_STRIP=0`` nor ``ENGINE_PACKED=0`` is set. The
    strip route then serves every row count: one activation row at the rate the caches give (1.5-2.5x
    int16's on Zen 4 with AVX-512, 1.1-1.6x on Zen 3 with AVX2; benchmarks/qgemm_rows.py), and a decode
    step's products round alike at any batch size and on every ISA."""
    return (qgemm is not None and not exact and num_out % 16 == 0
            and cpu.allows("avx2") and os.environ.get("ENGINE_STRIP", "1") != "0"
            and os.environ.get("ENGINE_PACKED", "1") != "0")


def should_pack(layer: Linear) -> bool:
    """``packs`` for a layer."""
    return packs(layer.out_features, layer.exact)


def _layout(fmt: int, half: bool, no_mins: bool = False) -> int:
    """A qgemm layout code: the format plus HALF (fp16 scales) and NO_MINS (Q5 rows without mins)."""
    return fmt | (HALF if half else 0) | (NO_MINS if no_mins else 0)
