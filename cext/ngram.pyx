"""Prompt lookup's index over one sequence, updated per appended id.

``NgramIndex.propose(tokens)``: the longest suffix of ``tokens`` (n from ngram_max down to
ngram_min) that also ends at an earlier position proposes the up to k ids that followed its
latest earlier occurrence. Every n-gram that ends before the last id is in one hash table
(key: a 64-bit hash of n and the n ids; value: the last position it ended at), so a proposal
costs O(ngram_max**2) hashing and probing whatever the context length; only the ids appended
since the last call are indexed. A hit is confirmed against the ids, so a hash collision can
never propose wrong ids. If ``tokens`` is not the previous history extended (a shorter or
rewritten sequence), the index is rebuilt from it.

tests/test_speculative.py checks it against a brute-force scan.
"""
cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

DEF MIN_SLOTS = 1024


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    h ^= h >> 33
    h *= 0xFF51AFD7ED558CCDULL
    h ^= h >> 33
    h *= 0xC4CEB9FE1A85EC53ULL
    h ^= h >> 33
    return h


cdef inline uint64_t _hash(const int32_t* ids, int64_t end, int n) noexcept nogil:
    """Hash of the n ids ending at ``end`` (inclusive), never 0 (0 marks an empty slot)."""
    cdef uint64_t h = <uint64_t>n * 0x9E3779B97F4A7C15ULL
    cdef int j
    for j in range(n):
        h = _mix(h ^ <uint64_t><uint32_t>ids[end - n + 1 + j]) + 0x9E3779B97F4A7C15ULL
    return h | 1


@cython.final
cdef class NgramIndex:
    def __cinit__(self, int k, int ngram_min=2, int ngram_max=4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.capacity = 256
        self.ids = <int32_t*>malloc(self.capacity * sizeof(int32_t))
        self.num_slots = MIN_SLOTS
        self.keys = <uint64_t*>malloc(self.num_slots * sizeof(uint64_t))
        self.ends = <int64_t*>malloc(self.num_slots * sizeof(int64_t))
        if self.ids == NULL or self.keys == NULL or self.ends == NULL:
            raise MemoryError("NgramIndex")
        self._reset()

    def __dealloc__(self):
        free(self.ids)
        free(self.keys)
        free(self.ends)

    cdef int _reset(self) except -1:
        self.num_ids = 0
        self.num_indexed = 0
        self.num_entries = 0
        memset(self.keys, 0, self.num_slots * sizeof(uint64_t))
        return 0

    cdef int _grow_table(self) except -1:
        """Double the table and re-insert every entry (amortised O(1) per n-gram)."""
        cdef uint64_t* old_keys = self.keys
        cdef int64_t* old_ends = self.ends
        cdef int64_t old_slots = self.num_slots, i, j
        cdef uint64_t* keys = <uint64_t*>malloc(2 * old_slots * sizeof(uint64_t))
        cdef int64_t* ends = <int64_t*>malloc(2 * old_slots * sizeof(int64_t))
        if keys == NULL or ends == NULL:
            free(keys)
            free(ends)
            raise MemoryError("NgramIndex table")
        memset(keys, 0, 2 * old_slots * sizeof(uint64_t))
        cdef uint64_t mask = <uint64_t>(2 * old_slots - 1)
        for i in range(old_slots):
            if old_keys[i]:
                j = <int64_t>(old_keys[i] & mask)
                while keys[j]:
                    j = (j + 1) & <int64_t>mask
                keys[j] = old_keys[i]
                ends[j] = old_ends[i]
        free(old_keys)
        free(old_ends)
        self.keys = keys
        self.ends = ends
        self.num_slots = 2 * old_slots
        return 0

    cdef bint _same(self, int64_t a, int64_t b, int n) noexcept nogil:
        """The n ids ending at a equal the n ids ending at b."""
        cdef int j
        for j in range(n):
            if self.ids[a - j] != self.ids[b - j]:
                return False
        return True

    cdef void _insert(self, uint64_t key, int64_t end, int n) noexcept nogil:
        cdef int64_t mask = self.num_slots - 1
        cdef int64_t i = <int64_t>(key & <uint64_t>mask)
        while self.keys[i]:
            if self.keys[i] == key and self._same(self.ends[i], end, n):
                self.ends[i] = end  # the latest occurrence
                return
            i = (i + 1) & mask
        self.keys[i] = key
        self.ends[i] = end
        self.num_entries += 1

    cdef int64_t _find(self, uint64_t key, int64_t end, int n) noexcept nogil:
        """The latest earlier end of the n-gram ending at ``end``, or -1."""
        cdef int64_t mask = self.num_slots - 1
        cdef int64_t i = <int64_t>(key & <uint64_t>mask)
        while self.keys[i]:
            if self.keys[i] == key and self._same(self.ends[i], end, n):
                return self.ends[i]
            i = (i + 1) & mask
        return -1

    cdef int _append(self, const int32_t* tokens, int64_t num) except -1:
        """Copy tokens[num_ids:num] and index the n-grams ending before num - 1."""
        cdef int64_t cap = self.capacity, end
        cdef int32_t* grown
        cdef int n, hi
        if num > cap:
            while cap < num:
                cap *= 2
            grown = <int32_t*>realloc(self.ids, cap * sizeof(int32_t))
            if grown == NULL:
                raise MemoryError("NgramIndex ids")
            self.ids = grown
            self.capacity = cap
        memcpy(self.ids + self.num_ids, tokens + self.num_ids, (num - self.num_ids) * sizeof(int32_t))
        self.num_ids = num
        for end in range(self.num_indexed, num - 1):
            while 2 * (self.num_entries + self.ngram_max) > self.num_slots:  # load <= 1/2
                self._grow_table()
            hi = self.ngram_max if self.ngram_max < end + 1 else <int>(end + 1)
            for n in range(self.ngram_min, hi + 1):
                self._insert(_hash(self.ids, end, n), end, n)
        if num - 1 > self.num_indexed:
            self.num_indexed = num - 1
        return 0

    def propose(self, const int32_t[::1] tokens) -> list:
        """At most k ids that followed the latest earlier occurrence of the longest suffix."""
        cdef int64_t num = tokens.shape[0], known = self.num_ids, found, stop, j
        cdef int n, hi
        if num == 0:
            return []
        if num < known or (known and self.ids[known - 1] != tokens[known - 1]):  # history changed
            self._reset()
        if num > self.num_ids:
            self._append(&tokens[0], num)
        hi = self.ngram_max if self.ngram_max < num - 1 else <int>(num - 1)
        for n in range(hi, self.ngram_min - 1, -1):
            found = self._find(_hash(self.ids, num - 1, n), num - 1, n)
            if found >= 0:
                stop = found + 1 + self.k
                if stop > num:
                    stop = num
                return [self.ids[j] for j in range(found + 1, stop)]
        return []
