"""Type stub for the compiled cext.qgemm (see qgemm.pyx and csrc/qgemm.h)."""

Q4: int
Q5: int
Q8: int
HALF: int
NO_MINS: int
SUPER: int
ROUTE_INT: int
ROUTE_FLOAT: int
FLOAT32: int
BFLOAT16: int

def matmul(layout: int, x: int, x_stride: int, num_rows: int, num_cols: int, w: int, scales: int, num_out: int,
           bias: int, y: int, y_stride: int, dtype: int) -> None: ...
def dequantize(layout: int, w: int, scales: int, first: int, count: int, num_cols: int, out: int,
               out_dtype: int = ...) -> None: ...
def q5_pack(packed: int, high: int, num_rows: int, num_cols: int, out: int, out_stride: int) -> None: ...
def set_float_rows(rows: int) -> None: ...
def get_float_rows() -> int: ...
