"""Type stub for the compiled cext.ops (see ops.pyx and csrc/fused_kernels.h)."""

FLOAT32: int
BFLOAT16: int
ACT_SILU: int
ACT_GELU_TANH: int
FLOAT16: int
ACT_SILU: int
ACT_GELU_TANH: int

def add_rmsnorm(resid: int, delta: int, weight: int, out: int, num_rows: int, dim: int, eps: float,
                dtype: int) -> None: ...
def rope_kv_write(qkv: int, num_rows: int, row_stride: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  positions: int, cos: int, sin: int, num_positions: int, slots: int, k_cache: int,
                  v_cache: int, num_slots: int, dtype: int, cache_dtype: int) -> None: ...
def decode_attention(q: int, q_row_stride: int, k_cache: int, v_cache: int, num_blocks: int, block_size: int,
                     block_tables: int, table_stride: int, context_lens: int, num_seqs: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, sliding_window: int, scale: float, out: int,
                     dtype: int, cache_dtype: int) -> None: ...
def prefill_attention(q: int, q_row_stride: int, k_cache: int, v_cache: int, num_blocks: int, block_size: int,
                      block_tables: int, table_stride: int, query_starts: int, context_lens: int,
                      positions: int, num_seqs: int, num_rows: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, sliding_window: int, scale: float, out: int, out_row_stride: int,
                      dtype: int, cache_dtype: int, tiles: bool = False) -> None: ...
def set_prefill_amx(enabled: bool) -> bool: ...
def silu_mul(gate_up: int, out: int, num_rows: int, inter: int, dtype: int) -> None: ...
def glu_mul(gate_up: int, out: int, num_rows: int, inter: int, dtype: int, act: int) -> None: ...
def rmsnorm_rows(x: int, row_stride: int, out: int, out_row_stride: int, weight: int, num_rows: int, heads: int,
                 dim: int, eps: float, dtype: int) -> None: ...

L_ATTN_NORM: int
L_FFN_NORM: int
L_POST_ATTN_NORM: int
L_POST_FFN_NORM: int
L_Q_NORM: int
L_K_NORM: int
L_Q_HEADS: int
L_K_HEADS: int
L_QK_DIM: int
L_K_CACHE: int
L_V_CACHE: int
L_NUM_SLOTS: int
L_CACHE_DTYPE: int
L_ROPE: int
L_PLAN: int
L_ACT: int
PRODUCTS: int
P_LAYOUT: int
P_ROWS: int
P_SCALES: int
P_BIAS: int
P_OUT: int
P_IN: int
PRODUCT_FIELDS: int
LAYER_FIELDS: int
ROPE_FIELDS: int
PLAN_FIELDS: int
B_H: int
B_QKV: int
B_ATTN: int
B_O: int
B_GATE_UP: int
B_ACT: int
B_DOWN: int
BUFFERS: int


def bind_matmul(capsule: object) -> None: ...
def decode_layers(program: object, scales: object, resid: int, num_rows: int, hidden: int, eps: float, dtype: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, inter: int, positions: int, slots: int,
                  ropes: object, plans: object, buffers: object) -> None: ...
