# cython: language_level=3
"""GGUF string arrays (a vocabulary: 50-150k entries, each a little-endian u64 length and its
bytes) read in one C loop: the Python loop took ~0.1 s per 50k strings at every model load."""
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.string cimport memcpy


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


def two_token_splits(list tokens, set vocab, const uint8_t[::1] skip):
    """Every split of a token text into two texts that are both in vocab (SentencePiece BPE's
    merges, engine/tokenizer/gguf_spm.py), tokens with skip[id] != 0 left out -> (lefts, rights,
    merged ids, split positions), in token order then split order. The Python loop took ~1-2 s
    over Gemma 3's 262,144 tokens (1.5 M split points) at every load."""
    cdef list lefts = [], rights = [], ids = [], splits = []
    cdef Py_ssize_t token_id, split, n
    cdef str text, left, right
    for token_id in range(len(tokens)):
        if skip[token_id]:
            continue
        text = <str>tokens[token_id]
        n = len(text)
        for split in range(1, n):
            left = text[:split]
            if left in vocab:
                right = text[split:]
                if right in vocab:
                    lefts.append(left)
                    rights.append(right)
                    ids.append(token_id)
                    splits.append(split)
    return lefts, rights, ids, splits


def pairs_in_order(list lefts, list rights, const int64_t[::1] order):
    """-> [(lefts[i], rights[i]) for i in order] (the merges list, ~0.2 s as a Python loop over
    Gemma 3's 515k splits)."""
    cdef Py_ssize_t i, j, n = order.shape[0], size = len(lefts)
    cdef list out = [None] * n
    for i in range(n):
        j = order[i]
        if j < 0 or j >= size:
            raise IndexError(f"order[{i}] = {j}: not an index of {size} splits")
        out[i] = (lefts[j], rights[j])
    return out
