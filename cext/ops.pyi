"""Type stub for the compiled cext.ops (see ops.pyx and csrc/fused_kernels.h)."""

FLOAT32: int
BFLOAT16: int
FLOAT16: int

def add_rmsnorm(resid: int, delta: int, weight: int, out: int, num_rows: int, dim: int, eps: float,
                dtype: int) -> None: ...
def rope_kv_write(qkv: int, num_rows: int, row_stride: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  positions: int, cos: int, sin: int, num_positions: int, slots: int, k_cache: int,
                  v_cache: int, num_slots: int, dtype: int, cache_dtype: int) -> None: ...
def decode_attention(q: int, q_row_stride: int, k_cache: int, v_cache: int, num_blocks: int, block_size: int,
                     block_tables: int, table_stride: int, context_lens: int, num_seqs: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, sliding_window: int, scale: float, out: int,
                     dtype: int, cache_dtype: int) -> None: ...
def silu_mul(gate_up: int, out: int, num_rows: int, inter: int, dtype: int) -> None: ...
