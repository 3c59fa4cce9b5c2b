# The sampler kernel (cext/csrc/sampler_kernels.h): plain C over raw pointers.
cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "csrc/sampler_kernels.h" nogil:
    enum:
        SK_OK
        SK_BAD_ID
        SK_NO_MEMORY

    ctypedef struct sk_mt19937:
        uint32_t state[624]
        int index

    void sk_mt_seed(sk_mt19937* mt, uint64_t seed)
    double sk_mt_uniform(sk_mt19937* mt)

    ctypedef struct sk_row:
        float temperature
        int32_t top_k
        float top_p
        float min_p
        sk_mt19937* rng
        const int64_t* allowed_ids
        int64_t num_allowed
        const int64_t* masked_ids
        int64_t num_masked
        const int64_t* ids
        const float* bias
        const float* scale
        const float* sub
        int64_t num_touched
        int32_t num_top

    ctypedef struct sk_result:
        int64_t token_id
        float logprob
        int64_t rank
        int64_t* top_ids
        float* top_logprobs

    int sk_sample_rows(float* logits, int64_t num_rows, int64_t vocab, const sk_row* rows, sk_result* results,
                       int process_only)
    int sk_logprob_rows(const float* logits, int64_t num_rows, int64_t vocab, const int64_t* target_ids,
                        int32_t num_top, float* logprobs, int64_t* ranks, int64_t* top_ids, float* top_logprobs)


# One request's random stream: torch.Generator's MT19937 and float64 uniforms, in C.
@cython.final
cdef class RandomStream:
    cdef sk_mt19937 mt


# One request's touched ids (biased, seen in the prompt or output) with what happens to each
# logit: l = rep(l + bias) - sub, rep(x) = x / scale if x > 0 else x * scale. add() is O(1).
@cython.final
cdef class TouchedIds:
    cdef readonly object ids                 # [capacity] int64
    cdef readonly object bias                # [capacity] float32
    cdef readonly object scale               # [capacity] float32, 1: not seen
    cdef readonly object sub                 # [capacity] float32, frequency * count + presence
    cdef readonly object counts              # [capacity] int32, generated count per touched id
    cdef readonly int64_t num_ids
    cdef readonly int64_t capacity
    cdef dict slot_of                        # token id -> its index
    cdef double repetition_penalty
    cdef double frequency_penalty
    cdef double presence_penalty
    cdef bint is_counted                     # frequency or presence penalty
    cdef int64_t* _ids
    cdef float* _bias
    cdef float* _scale
    cdef float* _sub
    cdef int32_t* _counts

    cpdef add(self, int64_t token_id)
