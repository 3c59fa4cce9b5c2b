"""Quantized weight products y [M, N] = x [M, K] @ W.T (+ bias) in C, on cext.cpu's
instruction set and thread pool; W in one of the layouts of cext/csrc/qgemm.h (built by
engine.models.quant), named by ``layout`` = Q4, Q5, Q8 or Q6 (Q6_K's own codes, PACKED only), plus HALF (fp16 scales), SUPER (Q4 scales as
Q4_K stores them: uint8 multiples of an fp16 factor per 256 inputs) and NO_MINS (Q5 rows without mins), and for matmul optionally the route: ROUTE_INT (int16 activation codes)
or ROUTE_FLOAT (float32 FMAs over decoded weights; AVX2 and up) or ROUTE_AMX (the integer route's sums on AMX-INT8 tiles) or ROUTE_STRIP (the integer route's sums with
AVX-512 VNNI, 16 outputs per vector; N a multiple of 16). PACKED: Q4, Q5 or Q8 rows stored in strips of 16 for
the strip route (``pack`` makes them; matmul with no route or ROUTE_STRIP, or ROUTE_AMX: the amx3 route, three bfloat16
products of the split weights and activations on AMX-BF16 tiles; and dequantize). INT8 (with PACKED,
matmul only): int8 activation codes where the default is int16 (twice the multiply-adds per instruction).

Arguments are raw addresses (``tensor.data_ptr()``) and sizes; the caller
(``engine.models.linear``) checks dtypes and shapes. The GIL is released while a kernel runs.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.stdint cimport int64_t, intptr_t, uint8_t, uint16_t
from posix.unistd cimport pread

from cext import cpu as _cpu


cdef extern from "csrc/cpu.h":
    int cpu_client_bind(const void* api)


if cpu_client_bind(PyCapsule_GetPointer(_cpu._api, b"cext.cpu._api")) != 0:
    raise ImportError("cext.qgemm: cext.cpu was built from another cpu.h")

Q4 = QG_Q4
Q5 = QG_Q5
Q8 = QG_Q8
Q6 = QG_Q6
HALF = QG_HALF
NO_MINS = QG_NO_MINS
SUPER = QG_SUPER
ROUTE_INT = QG_ROUTE_INT
ROUTE_FLOAT = QG_ROUTE_FLOAT
ROUTE_AMX = QG_ROUTE_AMX
ROUTE_STRIP = QG_ROUTE_STRIP
PACKED = QG_PACKED
INT8 = QG_INT8
FLOAT32 = DT_FLOAT32
BFLOAT16 = DT_BFLOAT16

# qg_matmul for cext.ops.decode_layers (a forward's layers in one call): the product itself,
# never a second copy of this module's kernels and their state (prefetch level, routes)
_matmul_capsule = PyCapsule_New(<void*>qg_matmul, b"cext.qgemm.qg_matmul", NULL)

_ERRORS = {
    QG_BAD_LENGTH: "K (num_cols) must be a multiple of 32 (Q8), of 64 (Q4, Q5) or of 256 (SUPER, Q6)",
    QG_BAD_LAYOUT: "unknown layout (or SUPER on a layout other than Q4 without HALF, or ROUTE_AMX / ROUTE_STRIP "
                   "with num_out not a multiple of 16, or ROUTE_AMX without AMX-INT8, or PACKED with a route other "
                   "than ROUTE_STRIP or ROUTE_AMX or a row count not a multiple of 16, or PACKED with ROUTE_AMX without "
                   "AMX-BF16 or with INT8, or INT8 without PACKED, or Q6 without PACKED or "
                   "with HALF, SUPER or NO_MINS)",
}


cdef inline int _check(int rc, int layout) except -1:
    if rc == QG_OK:
        return 0
    if rc == QG_NO_MEMORY:
        raise MemoryError("qgemm scratch")
    raise ValueError(f"layout {layout}: {_ERRORS.get(rc, f'qgemm error {rc}')}")



def check(int rc, int layout) -> None:
    """Raise for a product's return code rc as matmul does (MemoryError, ValueError naming the layout)."""
    _check(rc, layout)

def matmul(int layout, intptr_t x, int64_t x_stride, int64_t num_rows, int64_t num_cols, intptr_t w,
           intptr_t scales, int64_t num_out, intptr_t bias, intptr_t y, int64_t y_stride, int dtype):
    """y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) @ W.T + bias (float32 [N],
    0: none); x and y in dtype (FLOAT32 or BFLOAT16). w: the rows of W in ``layout``; scales:
    Q8's scales [N, K / 32] (0 for Q4 and Q5, whose rows hold them)."""
    cdef int rc
    with nogil:
        rc = qg_matmul(layout, <const void*>x, x_stride, num_rows, num_cols, <const void*>w,
                       <const void*>scales, num_out, <const float*>bias, <void*>y, y_stride, dtype)
    _check(rc, layout)


def dequantize(int layout, intptr_t w, intptr_t scales, int64_t first, int64_t count, int64_t num_cols,
               intptr_t out, int out_dtype=DT_FLOAT32):
    """Rows first .. first + count - 1 of W (as matmul's w, scales) -> out [count, K] in
    out_dtype (FLOAT32 or BFLOAT16)."""
    cdef int rc
    with nogil:
        rc = qg_dequantize(layout, <const void*>w, <const void*>scales, first, count, num_cols, <void*>out,
                           out_dtype)
    _check(rc, layout)


def q5_pack(intptr_t packed, intptr_t high, int64_t num_rows, int64_t num_cols, intptr_t out, int64_t out_stride):
    """Q5 codes in ggml's order (nibbles [N, K / 2], fifth bits [N, K / 8]) -> the Q5 layout's
    40-byte pair records, row n at out + n * out_stride."""
    cdef int rc
    with nogil:
        rc = qg_q5_pack(<const uint8_t*>packed, <const uint8_t*>high, num_rows, num_cols, <uint8_t*>out,
                        out_stride)
    _check(rc, Q5)


def q6k_pack(intptr_t raw, int64_t num_rows, int64_t num_cols, intptr_t out):
    """ggml Q6_K rows (num_cols / 256 blocks of 210 bytes a row) -> the Q6 | PACKED strips at out
    (num_rows / 16 x packed_strip_bytes(Q6, num_cols) bytes); num_rows a multiple of 16."""
    cdef int rc
    with nogil:
        rc = qg_q6k_pack(<const uint8_t*>raw, num_rows, num_cols, <uint8_t*>out)
    _check(rc, Q6 | QG_PACKED)


def pack_int8(int layout, intptr_t strips, int64_t num_rows, int64_t num_cols):
    """PACKED strips in ``layout`` (without INT8) made ready for INT8 products, in place (Q5: its sign
    masks in the int8 kernel's order; Q4 and Q8 as they are); read with ``layout | INT8`` from then on."""
    cdef int rc
    with nogil:
        rc = qg_pack_int8(layout, <uint8_t*>strips, num_rows, num_cols)
    _check(rc, layout)


def packed_strip_bytes(int layout, int64_t num_cols) -> int:
    """Bytes of one strip of 16 rows of the PACKED form of a Q4 ``layout`` with num_cols inputs (0: none)."""
    return qg_packed_strip_bytes(layout, num_cols)


def pack(int layout, intptr_t rows, intptr_t scales, int64_t num_rows, int64_t num_cols, intptr_t out):
    """Q4, Q5 or Q8 rows in ``layout`` (without PACKED; Q8: the codes and their scales) -> their PACKED
    strips at out (num_rows / 16 x packed_strip_bytes(layout, num_cols) bytes); num_rows a multiple of 16."""
    cdef int rc
    with nogil:
        rc = qg_pack(layout, <const void*>rows, <const void*>scales, num_rows, num_cols, <uint8_t*>out)
    _check(rc, layout)


_PREFETCH_LEVELS = {"l1": QG_PREFETCH_L1, "l2": QG_PREFETCH_L2}


def set_prefetch(str level):
    """Which cache the products' weight prefetch fills: "l1" (prefetcht0), "l2" (prefetcht1) or
    "auto" (the CPU's default: "l2" on AMD, "l1" elsewhere). Speed only: results are the same."""
    if level != "auto" and level not in _PREFETCH_LEVELS:
        raise ValueError(f"prefetch: unknown {level!r}, expected 'auto', 'l1' or 'l2'")
    qg_set_prefetch_level(_PREFETCH_LEVELS.get(level, 0))


def get_prefetch() -> str:
    """The level the products prefetch into now ("l1" or "l2")."""
    return "l2" if qg_prefetch_level() == QG_PREFETCH_L2 else "l1"


def set_prefetch_spread(bint on):
    """Whether decode steps' products (up to 5 rows, read in place) spread each pass's weight prefetch over
    its block loop (True, the default) or issue it in one burst at the pass's start. Speed only:
    results are the same."""
    qg_set_prefetch_spread(on)


def get_prefetch_spread() -> bool:
    return bool(qg_prefetch_spread())


def set_float_rows(int64_t rows):
    """From how many activation rows the products run in float32 (each pass's weight rows
    decoded once, FMAs against the float32 activations) instead of int16 codes (AVX2 and up)."""
    if rows < 1:
        raise ValueError(f"float_rows: must be >= 1, got {rows!r}")
    qg_set_float_rows(rows)


def get_float_rows() -> int:
    return qg_get_float_rows()


def read_rows(int fd, int64_t offset, int64_t num_rows, const int64_t[::1] ids, uint8_t[:, ::1] out):
    """out[k] = row ids[k] of a table of num_rows rows of out.shape[1] bytes at byte ``offset`` of the
    file ``fd``: one pread per row with the GIL released (the head's exact rows for the refined
    logits, engine.loader.repack.MappedRows). IndexError for an id outside the table; OSError if
    the file ends first."""
    cdef Py_ssize_t k, n = ids.shape[0], row_bytes = out.shape[1], done, failed = -1
    cdef ssize_t got
    if out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} rows for {n} ids")
    for k in range(n):
        if ids[k] < 0 or ids[k] >= num_rows:
            raise IndexError(f"row {ids[k]} is outside the tensor's {num_rows} rows")
    with nogil:
        for k in range(n):
            done = 0
            while done < row_bytes:
                got = pread(fd, &out[k, done], row_bytes - done, offset + ids[k] * row_bytes + done)
                if got <= 0:
                    failed = k
                    break
                done += got
            if failed >= 0:
                break
    if failed >= 0:
        raise OSError(f"short read of row {ids[failed]} ({row_bytes} bytes at offset "
                      f"{offset + ids[failed] * row_bytes})")


def dequantize_q6_k(const uint8_t[:, ::1] raw, float[:, ::1] out):
    """ggml Q6_K rows raw [R, blocks * 210] -> float32 out [R, blocks * 256]: per block of 256,
    value = (d * scale) * (q - 32), q the 6-bit code of a low nibble and a high bit pair, scale the
    int8 of its 16 values, d the block's fp16 factor (in that order: gguf.quants' float32 values)."""
    cdef Py_ssize_t r, b, half, l, num_blocks = raw.shape[1] // 210
    cdef const uint8_t *block
    cdef const uint8_t *ql
    cdef const uint8_t *qh
    cdef const signed char *sc
    cdef float *y
    cdef float d
    cdef uint8_t high
    if raw.shape[1] % 210 or out.shape[0] != raw.shape[0] or out.shape[1] != num_blocks * 256:
        raise ValueError(f"Q6_K rows of {raw.shape[1]} bytes (a multiple of 210) into {out.shape[1]} floats "
                         f"(256 a block) x {out.shape[0]} rows, for {raw.shape[0]} rows")
    with nogil:
        for r in range(raw.shape[0]):
            for b in range(num_blocks):
                block = &raw[r, b * 210]
                d = dt_f16_to_f32(block[208] | (block[209] << 8))
                for half in range(2):  # 128 values each: ql 64 bytes, qh 32, scales 8
                    ql = block + 64 * half
                    qh = block + 128 + 32 * half
                    sc = <const signed char *>(block + 192 + 8 * half)
                    y = &out[r, b * 256 + 128 * half]
                    for l in range(32):
                        high = qh[l]
                        y[l] = (d * sc[l // 16]) * <float>(((ql[l] & 0xF) | ((high & 3) << 4)) - 32)
                        y[l + 32] = (d * sc[l // 16 + 2]) * <float>(((ql[l + 32] & 0xF) | (((high >> 2) & 3) << 4)) - 32)
                        y[l + 64] = (d * sc[l // 16 + 4]) * <float>(((ql[l] >> 4) | (((high >> 4) & 3) << 4)) - 32)
                        y[l + 96] = (d * sc[l // 16 + 6]) * <float>(((ql[l + 32] >> 4) | (((high >> 6) & 3) << 4)) - 32)
