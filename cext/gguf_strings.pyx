# cython: language_level=3
"""GGUF string arrays (a vocabulary: 50-150k entries, each a little-endian u64 length and its
bytes) read in one C loop: the Python loop took ~0.1 s per 50k strings at every model load."""
from cpython.unicode cimport PyUnicode_AsUTF8String, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.string cimport memcpy

from cext.vocab_hash cimport _base, _find, _hash, _slot, _step, _table_bits

import numpy as np


def read_strings(const uint8_t[::1] buffer, Py_ssize_t offset, Py_ssize_t num_items, bint decode):
    """-> (list of str or None, the offset after the array, or -1 - the offset of a truncated
    entry). Invalid UTF-8 is replaced (U+FFFD), as the header reader does."""
    cdef Py_ssize_t size = buffer.shape[0], end, i
    cdef uint64_t num_bytes
    cdef list out = [] if decode else None
    cdef const uint8_t *data = &buffer[0] if size > 0 else NULL
    for i in range(num_items):
        if offset > size - 8:
            return out, -1 - offset
        memcpy(&num_bytes, data + offset, 8)  # little-endian hosts (x86-64, aarch64)
        end = offset + 8
        if num_bytes > <uint64_t>(size - end):
            return out, -1 - end
        offset = end + <Py_ssize_t>num_bytes
        if decode:
            out.append(PyUnicode_DecodeUTF8(<const char *>(data + end), <Py_ssize_t>num_bytes, "replace"))
    return out, offset


def two_token_splits(list tokens, const uint8_t[::1] skip):
    """Every split of a token text into two texts that are both tokens (SentencePiece BPE's merges,
    engine/tokenizer/gguf_spm.py), tokens with skip[id] != 0 left out -> int64 arrays (left ids,
    right ids, merged ids, split positions in characters), in token order then split order.

    One pass in C over the tokens' UTF-8 bytes: a hash table of every token's bytes, each token's
    prefix and suffix hashes from one polynomial prefix-hash pass (mod 2^64), each hit confirmed by
    memcmp. Gemma 3's 262,144 tokens have 1.5 M split points: str slices and set lookups took
    ~0.7 s a load. A text that occurs twice finds its first id."""
    cdef Py_ssize_t num_tokens = len(tokens), i
    if skip.shape[0] != num_tokens:
        raise ValueError(f"skip has {skip.shape[0]} entries for {num_tokens} tokens")
    encoded = [PyUnicode_AsUTF8String(t) for t in tokens]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=num_tokens)
    cdef int64_t[::1] offsets = np.zeros(num_tokens + 1, dtype=np.int64)
    np.cumsum(lengths, out=np.asarray(offsets)[1:])
    cdef bytes blob = b"".join(encoded)
    del encoded
    cdef const char *data = blob
    cdef const unsigned char *text
    cdef int64_t max_len = int(lengths.max()) if num_tokens else 0
    if num_tokens >= 0xFFFFFFFF:
        raise ValueError(f"{num_tokens} tokens: more than a 32-bit id")
    cdef int bits = _table_bits(num_tokens)
    cdef uint64_t[::1] table = np.zeros(<Py_ssize_t>1 << bits, dtype=np.uint64)
    cdef uint64_t[::1] prefix = np.zeros(max_len + 1, dtype=np.uint64)   # prefix[k]: hash of text[:k]
    cdef uint64_t[::1] powers = np.ones(max_len + 1, dtype=np.uint64)    # powers[k]: BASE^k
    cdef uint64_t h, mask = (<uint64_t>1 << bits) - 1, slot
    cdef int64_t n, k, chars, left_id, right_id, count = 0
    out = np.empty((4, 1024), dtype=np.int64)
    cdef int64_t[:, ::1] found = out
    with nogil:
        for k in range(1, max_len + 1):
            powers[k] = powers[k - 1] * _base()
        for i in range(num_tokens):
            n = offsets[i + 1] - offsets[i]
            text = <const unsigned char *>(data + offsets[i])
            h = _hash(text, n)
            if _find(&table[0], bits, h, <const char *>text, n, data, &offsets[0]) >= 0:
                continue
            slot = _slot(h, bits)
            while table[slot] != 0:
                slot = (slot + 1) & mask
            table[slot] = ((h >> 32) << 32) | <uint64_t>(i + 1)
    with nogil:
        for i in range(num_tokens):
            if skip[i]:
                continue
            n = offsets[i + 1] - offsets[i]
            text = <const unsigned char *>(data + offsets[i])
            for k in range(n):
                prefix[k + 1] = _step(prefix[k], text[k])
            chars = 0
            for k in range(1, n):
                if (text[k] & 0xC0) == 0x80:  # inside a character
                    continue
                chars += 1
                left_id = _find(&table[0], bits, prefix[k], <const char *>text, k, data, &offsets[0])
                if left_id < 0:
                    continue
                right_id = _find(&table[0], bits, prefix[n] - prefix[k] * powers[n - k],
                                 <const char *>(text + k), n - k, data, &offsets[0])
                if right_id < 0:
                    continue
                if count == found.shape[1]:
                    with gil:
                        out = np.concatenate([out, np.empty_like(out)], axis=1)
                        found = out
                found[0, count] = left_id
                found[1, count] = right_id
                found[2, count] = i
                found[3, count] = chars
                count += 1
    return tuple(out[:, :count].copy())


def pairs_in_order(list tokens, const int64_t[::1] lefts, const int64_t[::1] rights, const int64_t[::1] order):
    """-> [(tokens[lefts[i]], tokens[rights[i]]) for i in order]: the merges list (~0.2 s as a
    Python loop over Gemma 3's 515k splits)."""
    cdef Py_ssize_t i, j, n = order.shape[0], size = lefts.shape[0], num_tokens = len(tokens)
    cdef int64_t left, right
    if rights.shape[0] != size:
        raise ValueError(f"{size} left ids but {rights.shape[0]} right ids")
    cdef list out = [None] * n
    for i in range(n):
        j = order[i]
        if j < 0 or j >= size:
            raise IndexError(f"order[{i}] = {j}: not an index of {size} splits")
        left, right = lefts[j], rights[j]
        if not (0 <= left < num_tokens and 0 <= right < num_tokens):
            raise IndexError(f"split {j}: ids {left}, {right} are not ids of {num_tokens} tokens")
        out[i] = (tokens[left], tokens[right])
    return out
