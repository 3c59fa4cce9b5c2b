# Header of cext/ngram.pyx: one sequence's incremental n-gram index (prompt lookup).
cimport cython
from libc.stdint cimport int32_t, int64_t, uint64_t


@cython.final
cdef class NgramIndex:
    cdef readonly int k                      # most ids proposed
    cdef readonly int ngram_min
    cdef readonly int ngram_max
    cdef readonly int64_t num_ids            # ids copied from the sequence so far
    cdef readonly int64_t num_indexed        # n-grams ending before this position are in the table
    cdef readonly int64_t num_entries        # occupied slots
    cdef int32_t* ids                        # [capacity] the sequence's ids
    cdef int64_t capacity
    # Open addressing, linear probing: slot i holds the hash of an n-gram (0: empty) and the
    # position it last ended at; a hit is confirmed against the ids (no false match).
    cdef uint64_t* keys                      # [num_slots]
    cdef int64_t* ends                       # [num_slots]
    cdef int64_t num_slots                   # a power of two

    cdef int _reset(self) except -1
    cdef int _append(self, const int32_t* tokens, int64_t num) except -1
    cdef int _grow_table(self) except -1
    cdef bint _same(self, int64_t a, int64_t b, int n) noexcept nogil
    cdef void _insert(self, uint64_t key, int64_t end, int n) noexcept nogil
    cdef int64_t _find(self, uint64_t key, int64_t end, int n) noexcept nogil
