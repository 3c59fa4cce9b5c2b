# A hash table over a vocabulary's token bytes (shared by cext/gguf_strings.pyx and cext/spm.pyx):
# the tokens' UTF-8 texts concatenated in `blob`, token i at blob[offsets[i]:offsets[i + 1]]; a table
# of 2^bits uint64 entries, each the text hash's upper 32 bits over id + 1 (0: empty), linear probing.
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp

cdef inline uint64_t _base() noexcept nogil:
    """The polynomial hash's base (odd)."""
    return 0x100000001B3ULL


cdef inline uint64_t _slot(uint64_t h, int bits) noexcept nogil:
    return (h * <uint64_t>0x9E3779B97F4A7C15ULL) >> (64 - bits)


cdef inline uint64_t _step(uint64_t h, unsigned char byte) noexcept nogil:
    """The polynomial hash of a text extended by one byte (the empty text hashes to 0)."""
    return h * _base() + byte + 1


cdef inline uint64_t _hash(const unsigned char *text, int64_t n) noexcept nogil:
    cdef uint64_t h = 0
    cdef int64_t k
    for k in range(n):
        h = _step(h, text[k])
    return h


cdef inline Py_ssize_t _find_slot(const uint64_t *table, int bits, uint64_t h, const char *text, int64_t n,
                                  const char *blob, const int64_t *offsets) noexcept nogil:
    """The slot of the entry whose bytes are text[:n] (hash h), or -1 - the empty slot where it
    would go. Most misses read only the table."""
    cdef uint64_t mask = (<uint64_t>1 << bits) - 1, i = _slot(h, bits), entry, tag = h >> 32
    cdef int64_t token_id
    while True:
        entry = table[i]
        if entry == 0:
            return -1 - <Py_ssize_t>i
        if entry >> 32 == tag:
            token_id = <int64_t>(entry & 0xFFFFFFFFULL) - 1
            if offsets[token_id + 1] - offsets[token_id] == n and memcmp(blob + offsets[token_id], text, n) == 0:
                return <Py_ssize_t>i
        i = (i + 1) & mask


cdef inline Py_ssize_t _find(const uint64_t *table, int bits, uint64_t h, const char *text, int64_t n,
                             const char *blob, const int64_t *offsets) noexcept nogil:
    """The id whose bytes are text[:n] (hash h), or -1."""
    cdef Py_ssize_t slot = _find_slot(table, bits, h, text, n, blob, offsets)
    if slot < 0:
        return -1
    return <Py_ssize_t>(table[slot] & 0xFFFFFFFFULL) - 1


cdef inline int _table_bits(Py_ssize_t num_entries) noexcept nogil:
    """Bits of a table at most half full."""
    cdef int bits = 4
    while (<Py_ssize_t>1 << bits) < 2 * num_entries:
        bits += 1
    return bits
