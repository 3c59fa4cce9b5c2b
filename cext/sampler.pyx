"""The sampler kernel: per row of logits, in one call with the GIL released, the logits
processing of a request (allowed ids, -inf masks, logit_bias and the repetition / frequency /
presence penalties over the few ids they touch), the choice (greedy argmax, or softmax(l / T)
under min-p, top-k and top-p, drawn from the request's ``RandomStream``) and the logprob, rank
and top logprobs of the raw row. See cext/csrc/sampler_kernels.h for the definitions.

The Python side (``engine.sampling``) passes the batch's ``SamplingParams``, streams and
``engine.sampling.logits_process.LogitsAdjuster`` objects; this module reads their fields once per row
and hands the C kernel raw pointers to the adjusters' arrays (``TouchedIds``, kept here so
that counting a generated id is a few C operations).
"""
cimport cython
from cpython.pycapsule cimport PyCapsule_GetPointer
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

import numpy as np

from cext import cpu as _cpu

cnp.import_array()


cdef extern from "csrc/cpu.h":
    int cpu_client_bind(const void* api)


if cpu_client_bind(PyCapsule_GetPointer(_cpu._api, b"cext.cpu._api")) != 0:
    raise ImportError("cext.sampler: cext.cpu was built from another cpu.h")

_ERRORS = {SK_BAD_ID: "a token id of logit_bias, allowed_token_ids or a mask is outside the vocabulary"}


cdef inline int _check(int rc) except -1:
    if rc == SK_OK:
        return 0
    if rc == SK_NO_MEMORY:
        raise MemoryError("sampler scratch")
    raise IndexError(_ERRORS.get(rc, f"sampler kernel error {rc}"))


@cython.final
cdef class RandomStream:
    """MT19937 seeded like ``torch.Generator().manual_seed(seed)``; ``random()`` equals
    ``torch.rand((), dtype=torch.float64, generator=g)`` draw for draw."""

    def __init__(self, seed):
        sk_mt_seed(&self.mt, <uint64_t>(int(seed) % (1 << 64)))

    def random(self) -> float:
        return sk_mt_uniform(&self.mt)

    def snapshot(self) -> RandomStream:
        """A copy of the stream at this point (speculative verification draws ahead, then rewinds)."""
        cdef RandomStream copy = RandomStream.__new__(RandomStream)
        copy.mt = self.mt
        return copy

    def restore(self, RandomStream snapshot, int num_draws=0):
        """Go back to ``snapshot``'s state, then draw ``num_draws`` uniforms (discarded)."""
        cdef int i
        self.mt = snapshot.mt
        for i in range(num_draws):
            sk_mt_uniform(&self.mt)


@cython.final
cdef class TouchedIds:
    """The ids a request's logit_bias and penalties change, and per id its bias, scale (the
    repetition penalty once seen) and sub (frequency * count + presence), for the kernel to
    apply as l = rep(l + bias) - sub. ``add(token_id)`` counts one generated id in O(1)."""

    def __init__(self, list touched_ids, list bias_values, set seen_ids, int64_t capacity,
                 double repetition_penalty, double frequency_penalty, double presence_penalty):
        cdef int64_t j, num = len(touched_ids)
        if capacity < num:
            raise ValueError("capacity must hold the touched ids")
        self.capacity = capacity
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.bias = np.zeros(capacity, dtype=np.float32)
        self.scale = np.ones(capacity, dtype=np.float32)
        self.sub = np.zeros(capacity, dtype=np.float32)
        self.counts = np.zeros(capacity, dtype=np.int32)
        self._ids = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self.ids)
        self._bias = <float*>cnp.PyArray_DATA(<cnp.ndarray>self.bias)
        self._scale = <float*>cnp.PyArray_DATA(<cnp.ndarray>self.scale)
        self._sub = <float*>cnp.PyArray_DATA(<cnp.ndarray>self.sub)
        self._counts = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>self.counts)
        self.repetition_penalty = repetition_penalty
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.is_counted = frequency_penalty != 0.0 or presence_penalty != 0.0
        self.slot_of = {}
        for j in range(num):
            token_id = touched_ids[j]
            self._ids[j] = token_id
            self.slot_of[token_id] = j
            if j < len(bias_values):
                self._bias[j] = bias_values[j]
            if token_id in seen_ids:
                self._scale[j] = repetition_penalty
        self.num_ids = num

    cpdef add(self, int64_t token_id):
        """Count one generated id: O(1)."""
        cdef int64_t j
        cdef bint is_repeated = self.repetition_penalty != 1.0
        if not self.is_counted and not is_repeated:
            return
        slot = self.slot_of.get(token_id)
        if slot is None:
            j = self.num_ids
            if j >= self.capacity:
                raise IndexError("TouchedIds is full: more generated ids than max_tokens")
            self._ids[j] = token_id
            self.slot_of[token_id] = j
            self.num_ids = j + 1
        else:
            j = slot
        if is_repeated:
            self._scale[j] = self.repetition_penalty
        if self.is_counted:
            self._sub[j] += self.frequency_penalty + (self.presence_penalty if self._counts[j] == 0 else 0.0)
        self._counts[j] += 1


cdef inline const void* _data(object array, int typenum, str field) except NULL:
    cdef cnp.ndarray arr = <cnp.ndarray?>array
    if cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise TypeError(f"LogitsAdjuster.{field} must be a C-contiguous array of the right dtype")
    return cnp.PyArray_DATA(arr)


cdef int _fill_row(sk_row* row, object params, object stream, object adjuster, list keep) except -1:
    memset(row, 0, sizeof(sk_row))
    row.top_p = 1.0
    row.num_top = params.top_logprobs if params.logprobs else -1
    if not params.is_greedy and stream is not None:
        row.temperature = params.temperature
        row.top_k = params.top_k
        row.top_p = params.top_p
        row.min_p = params.min_p
        row.rng = &(<RandomStream?>stream).mt
    if adjuster is None:
        return 0
    allowed = adjuster.allowed_ids
    if allowed is not None:
        row.allowed_ids = <const int64_t*>_data(allowed, cnp.NPY_INT64, "allowed_ids")
        row.num_allowed = cnp.PyArray_SIZE(<cnp.ndarray>allowed)
    masked = adjuster.masked_ids_now()
    if masked is not None:
        keep.append(masked)
        row.masked_ids = <const int64_t*>_data(masked, cnp.NPY_INT64, "masked_ids_now()")
        row.num_masked = cnp.PyArray_SIZE(<cnp.ndarray>masked)
    cdef TouchedIds touched = <TouchedIds?>adjuster.touched
    if touched.num_ids:
        row.ids = touched._ids
        row.bias = touched._bias
        row.scale = touched._scale
        row.sub = touched._sub
        row.num_touched = touched.num_ids
    keep.append(touched)
    return 0


def sample_rows(float[:, ::1] logits, list params, list streams, list adjusters=None, bint process_only=False):
    """Process and sample each row of ``logits`` [S, V] float32 (changed in place).

    params: S SamplingParams; streams: S RandomStream (None for greedy rows); adjusters: S
    LogitsAdjuster or None (or None for all). Returns (token_ids, logprob_rows): logprob_rows[i]
    is None, or (logprob, rank, top_ids, top_logprobs) when params[i].logprobs.
    With process_only only the processing is applied; returns None.
    """
    cdef int64_t num_rows = logits.shape[0], vocab = logits.shape[1], i, j, max_top = 0
    if len(params) != num_rows or len(streams) != num_rows or (adjusters is not None and len(adjusters) != num_rows):
        raise ValueError("params, streams and adjusters need one entry per row of logits")
    if vocab >= (1 << 31):
        raise ValueError("the sampler keeps token ids in 32 bits: the vocabulary must be < 2**31")
    if num_rows == 0:
        return None if process_only else ([], [])
    cdef sk_row* rows = <sk_row*>malloc(num_rows * sizeof(sk_row))
    cdef sk_result* results = <sk_result*>malloc(num_rows * sizeof(sk_result))
    cdef int64_t* top_ids = NULL
    cdef float* top_logprobs = NULL
    cdef list keep = []
    cdef int rc
    try:
        if rows == NULL or results == NULL:
            raise MemoryError("sampler rows")
        for i in range(num_rows):
            _fill_row(&rows[i], params[i], streams[i], None if adjusters is None else adjusters[i], keep)
            if rows[i].num_top > max_top:
                max_top = rows[i].num_top
        if max_top:
            top_ids = <int64_t*>malloc(num_rows * max_top * sizeof(int64_t))
            top_logprobs = <float*>malloc(num_rows * max_top * sizeof(float))
            if top_ids == NULL or top_logprobs == NULL:
                raise MemoryError("sampler top logprobs")
        for i in range(num_rows):
            results[i].top_ids = top_ids + i * max_top if max_top else NULL
            results[i].top_logprobs = top_logprobs + i * max_top if max_top else NULL
        with nogil:
            rc = sk_sample_rows(&logits[0, 0], num_rows, vocab, rows, results, process_only)
        _check(rc)
        if process_only:
            return None
        token_ids = [results[i].token_id for i in range(num_rows)]
        logprob_rows = [None] * num_rows
        for i in range(num_rows):
            if rows[i].num_top >= 0:
                logprob_rows[i] = (results[i].logprob, results[i].rank,
                                   [results[i].top_ids[j] for j in range(rows[i].num_top)],
                                   [results[i].top_logprobs[j] for j in range(rows[i].num_top)])
        return token_ids, logprob_rows
    finally:
        free(rows)
        free(results)
        free(top_ids)
        free(top_logprobs)


def logprob_rows(const float[:, ::1] logits, const int64_t[::1] target_ids, int num_top):
    """Raw log-softmax of each row [N, V]: (logprobs [N] float32, ranks [N] int64, top_ids [N, k],
    top_logprobs [N, k]) of target_ids[i] under row i; ranks as vLLM's (1 = the best)."""
    cdef int64_t num_rows = logits.shape[0], vocab = logits.shape[1]
    if target_ids.shape[0] != num_rows:
        raise ValueError("target_ids needs one id per row of logits")
    if num_top < 0:
        raise ValueError("num_top must be >= 0")
    logprobs = np.empty(num_rows, dtype=np.float32)
    ranks = np.empty(num_rows, dtype=np.int64)
    top_ids = np.empty((num_rows, num_top), dtype=np.int64)
    top_logprobs = np.empty((num_rows, num_top), dtype=np.float32)
    if num_rows == 0:
        return logprobs, ranks, top_ids, top_logprobs
    cdef float[::1] lp = logprobs
    cdef int64_t[::1] rk = ranks
    cdef int64_t[:, ::1] ti = top_ids
    cdef float[:, ::1] tl = top_logprobs
    cdef int rc
    with nogil:
        rc = sk_logprob_rows(&logits[0, 0], num_rows, vocab, &target_ids[0], num_top, &lp[0], &rk[0],
                             &ti[0, 0] if num_top else NULL, &tl[0, 0] if num_top else NULL)
    _check(rc)
    return logprobs, ranks, top_ids, top_logprobs
