# Quantized weight products (cext/csrc/qgemm.h: the routes and the byte layouts).
from libc.stdint cimport int64_t, uint8_t, uint16_t


cdef extern from "csrc/qgemm.h" nogil:
    enum:
        QG_Q4
        QG_Q5
        QG_Q8
        QG_Q6
        QG_HALF
        QG_NO_MINS
        QG_SUPER
        QG_ROUTE_INT
        QG_ROUTE_FLOAT
        QG_ROUTE_AMX
        QG_ROUTE_STRIP
        QG_PACKED
        QG_INT8
        QG_OK
        QG_BAD_LENGTH
        QG_NO_MEMORY
        QG_BAD_LAYOUT

    int qg_matmul(int layout, const void* x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
                  const void* w, const void* scales, int64_t num_out, const float* bias,
                  void* y, int64_t y_stride, int dtype)
    int qg_dequantize(int layout, const void* w, const void* scales, int64_t first, int64_t count,
                      int64_t num_cols, void* out, int out_dtype)
    int64_t qg_packed_strip_bytes(int layout, int64_t num_cols)
    int qg_pack(int layout, const void* rows, const void* scales, int64_t num_rows, int64_t num_cols, uint8_t* out)
    int qg_pack_int8(int layout, uint8_t* strips, int64_t num_rows, int64_t num_cols)
    int qg_q6k_pack(const uint8_t* raw, int64_t num_rows, int64_t num_cols, uint8_t* out)
    int qg_q5_pack(const uint8_t* packed, const uint8_t* high, int64_t num_rows, int64_t num_cols,
                   uint8_t* out, int64_t out_stride)
    void qg_set_float_rows(int64_t rows)
    enum:
        QG_PREFETCH_L1
        QG_PREFETCH_L2
    int qg_prefetch_level()
    void qg_set_prefetch_level(int level)
    int qg_prefetch_spread()
    void qg_set_prefetch_spread(int on)
    int64_t qg_get_float_rows()


cdef extern from "csrc/dtype.h" nogil:
    enum:
        DT_FLOAT32
        DT_BFLOAT16
    float dt_f16_to_f32(uint16_t h)
