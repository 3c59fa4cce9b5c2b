# cython: language_level=3
"""SentencePiece BPE encoding as llama.cpp runs it (`llm_tokenizer_spm` in src/llama-vocab.cpp), in C
with the GIL released. The GGUF "llama" vocabularies (Gemma 2/3, LLaMA 2, Mistral, Phi-3) encode
here: built as a `tokenizers` BPE model their merges (every two-token split of every token, 515k
for Gemma's 262,144 tokens) took ~115 MB and ~0.6 s a load; this keeps the tokens' bytes, one
hash table and the scores (~9 MB for Gemma).

    encoder = SpmEncoder(tokens, scores, special_ids, byte_ids, add_space_prefix)
    encoder.encode_batch(["Hello world"])  # -> [[ids]]

Per text:
1. Special tokens: the text is cut at each occurrence of a special token's text (the ids given:
   control, unknown and user-defined tokens), the leftmost occurrence first and the longest one
   at a position (the `tokenizers` library's rule for added tokens); each occurrence is its id.
2. Each piece between them: U+2581 prepended when ``add_space_prefix``, every space replaced by
   U+2581, split into UTF-8 characters; then, while some adjacent pair of symbols concatenates to
   a token, the pair whose token scores highest merges (ties: the leftmost pair).
3. Each symbol left is its token, or (a character that is not a token) its bytes' byte tokens
   (``byte_ids``; -1: the byte is dropped).
A text occurring twice in the vocabulary is its last id (llama.cpp's map).
"""
cimport cython
from cpython.unicode cimport PyUnicode_AsUTF8String, PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint64_t, uint8_t
from libc.stdlib cimport free, malloc, realloc

from cext.vocab_hash cimport _find, _find_slot, _hash, _slot, _step, _table_bits

import numpy as np


cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object text, Py_ssize_t *size) except NULL


cdef struct Symbol:
    int32_t prev
    int32_t next
    int32_t start  # byte offset in the piece's buffer
    int32_t n      # bytes; 0 once merged into the symbol on its left


cdef struct Bigram:
    float score
    int32_t left
    int32_t right
    int32_t size   # bytes of the pair when it was queued (a stale entry no longer matches)


cdef struct Ids:
    int32_t *data
    Py_ssize_t size
    Py_ssize_t cap


cdef struct Scratch:
    unsigned char *text  # the piece with U+2581 for spaces
    Symbol *symbols
    Bigram *heap
    Py_ssize_t heap_size
    Py_ssize_t heap_cap


cdef struct Vocab:
    const char *blob
    const int64_t *offsets
    const uint64_t *table
    int bits
    const uint64_t *special_table
    int special_bits
    const float *scores
    const int32_t *byte_ids     # [256]
    const uint8_t *starts       # [256]: a special token's text starts with this byte
    const uint8_t *lengths      # [max_special + 1]: some special token's text has this many bytes
    const uint64_t *prefixes    # hashes (| 1) of every prefix of a special token's text: the scan stops early
    int prefix_bits
    Py_ssize_t max_special
    bint add_space_prefix


MAX_TEXT_BYTES = (1 << 29) - 1  # a piece's bytes, 3 per space, fit the symbols' int32 offsets

# llama.cpp's unicode_len_utf8: a character's bytes from its first byte's high nibble.
cdef uint8_t[16] _UTF8_LEN = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4]


cdef inline void *_grown(void *data, Py_ssize_t *cap, size_t item_bytes) noexcept nogil:
    """data reallocated to 2 * cap + 16 items (cap updated), or NULL (data untouched) when out of memory."""
    cdef void *grown = realloc(data, (2 * cap[0] + 16) * item_bytes)
    if grown != NULL:
        cap[0] = 2 * cap[0] + 16
    return grown


cdef inline int _push(Ids *out, int32_t token_id) noexcept nogil:
    cdef int32_t *grown
    if out.size == out.cap:
        grown = <int32_t *>_grown(out.data, &out.cap, sizeof(int32_t))
        if grown == NULL:
            return -1
        out.data = grown
    out.data[out.size] = token_id
    out.size += 1
    return 0


cdef inline bint _before(const Bigram *a, const Bigram *b) noexcept nogil:
    """a leaves the queue before b: the higher score, then the leftmost pair."""
    return a.score > b.score or (a.score == b.score and a.left < b.left)


cdef inline int _heap_push(Scratch *s, Bigram item) noexcept nogil:
    cdef Bigram *grown
    cdef Py_ssize_t i, parent
    if s.heap_size == s.heap_cap:
        grown = <Bigram *>_grown(s.heap, &s.heap_cap, sizeof(Bigram))
        if grown == NULL:
            return -1
        s.heap = grown
    i = s.heap_size
    s.heap_size += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(&item, &s.heap[parent]):
            break
        s.heap[i] = s.heap[parent]
        i = parent
    s.heap[i] = item
    return 0


cdef inline Bigram _heap_pop(Scratch *s) noexcept nogil:
    cdef Bigram top = s.heap[0], last
    cdef Py_ssize_t i = 0, child, n
    s.heap_size -= 1
    n = s.heap_size
    if n > 0:
        last = s.heap[n]
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and _before(&s.heap[child + 1], &s.heap[child]):
                child += 1
            if not _before(&s.heap[child], &last):
                break
            s.heap[i] = s.heap[child]
            i = child
        s.heap[i] = last
    return top


cdef inline bint _has_prefix(const Vocab *v, uint64_t h) noexcept nogil:
    """Whether some special token's text may start with the text of hash h (a hash match: the
    special lookup itself compares the bytes)."""
    cdef uint64_t mask = (<uint64_t>1 << v.prefix_bits) - 1, i = _slot(h, v.prefix_bits), entry
    h |= 1
    while True:
        entry = v.prefixes[i]
        if entry == 0:
            return False
        if entry == h:
            return True
        i = (i + 1) & mask


cdef inline Py_ssize_t _token(const Vocab *v, const unsigned char *text, Py_ssize_t n) noexcept nogil:
    return _find(v.table, v.bits, _hash(text, n), <const char *>text, n, v.blob, v.offsets)


cdef inline int _try_bigram(const Vocab *v, Scratch *s, int32_t left, int32_t right) noexcept nogil:
    """Queue the pair (left, right) when their bytes together are a token."""
    cdef Bigram item
    cdef Py_ssize_t token_id
    if left < 0 or right < 0:
        return 0
    item.size = s.symbols[left].n + s.symbols[right].n
    token_id = _token(v, s.text + s.symbols[left].start, item.size)
    if token_id < 0:
        return 0
    item.score = v.scores[token_id]
    item.left = left
    item.right = right
    return _heap_push(s, item)


cdef int _encode_piece(const Vocab *v, Scratch *s, const unsigned char *piece, Py_ssize_t n,
                       Ids *out) noexcept nogil:
    """Steps 2 and 3 of the module docstring for one piece (n > 0) between special tokens."""
    cdef Py_ssize_t m = 0, k, off, num_symbols = 0
    cdef int32_t i, length
    cdef Py_ssize_t token_id
    cdef Bigram top
    cdef Symbol *left
    cdef Symbol *right
    if v.add_space_prefix:
        s.text[0] = 0xE2; s.text[1] = 0x96; s.text[2] = 0x81
        m = 3
    for k in range(n):
        if piece[k] == 0x20:
            s.text[m] = 0xE2; s.text[m + 1] = 0x96; s.text[m + 2] = 0x81
            m += 3
        else:
            s.text[m] = piece[k]
            m += 1
    off = 0
    while off < m:
        length = _UTF8_LEN[s.text[off] >> 4]
        if length > m - off:
            length = <int32_t>(m - off)
        s.symbols[num_symbols].prev = <int32_t>num_symbols - 1
        s.symbols[num_symbols].next = <int32_t>num_symbols + 1
        s.symbols[num_symbols].start = <int32_t>off
        s.symbols[num_symbols].n = length
        off += length
        num_symbols += 1
    s.symbols[num_symbols - 1].next = -1
    s.heap_size = 0
    for i in range(1, <int32_t>num_symbols):
        if _try_bigram(v, s, i - 1, i) < 0:
            return -1
    while s.heap_size > 0:
        top = _heap_pop(s)
        left = &s.symbols[top.left]
        right = &s.symbols[top.right]
        if left.n == 0 or right.n == 0 or left.n + right.n != top.size:
            continue  # one of the two merged since this pair was queued
        left.n += right.n
        right.n = 0
        left.next = right.next
        if right.next >= 0:
            s.symbols[right.next].prev = top.left
        if _try_bigram(v, s, left.prev, top.left) < 0 or _try_bigram(v, s, top.left, left.next) < 0:
            return -1
    i = 0
    while i != -1:
        token_id = _token(v, s.text + s.symbols[i].start, s.symbols[i].n)
        if token_id >= 0:
            if _push(out, <int32_t>token_id) < 0:
                return -1
        else:
            for k in range(s.symbols[i].start, s.symbols[i].start + s.symbols[i].n):
                if v.byte_ids[s.text[k]] >= 0 and _push(out, v.byte_ids[s.text[k]]) < 0:
                    return -1
        i = s.symbols[i].next
    return 0


cdef int _encode(const Vocab *v, const unsigned char *text, Py_ssize_t n, Ids *out) noexcept nogil:
    """One text: cut at special tokens (step 1), each piece through _encode_piece."""
    cdef Scratch s
    cdef Py_ssize_t i = 0, piece_start = 0, length, limit, best_length
    cdef Py_ssize_t token_id, best_id = -1
    cdef uint64_t h
    cdef int status = 0
    s.text = <unsigned char *>malloc(3 * n + 3)
    s.symbols = <Symbol *>malloc((n + 1) * sizeof(Symbol))
    s.heap = NULL
    s.heap_size = s.heap_cap = 0
    if s.text == NULL or s.symbols == NULL:
        status = -1
    while status == 0 and i < n:
        best_length = 0
        if v.starts[text[i]]:
            limit = v.max_special if v.max_special < n - i else n - i
            h = 0
            for length in range(1, limit + 1):
                h = _step(h, text[i + length - 1])
                if not _has_prefix(v, h):
                    break
                if v.lengths[length]:
                    token_id = _find(v.special_table, v.special_bits, h, <const char *>(text + i), length,
                                     v.blob, v.offsets)
                    if token_id >= 0:
                        best_length, best_id = length, token_id
        if best_length == 0:
            i += 1
            continue
        if i > piece_start:
            status = _encode_piece(v, &s, text + piece_start, i - piece_start, out)
        if status == 0:
            status = _push(out, <int32_t>best_id)
        i += best_length
        piece_start = i
    if status == 0 and piece_start < n:
        status = _encode_piece(v, &s, text + piece_start, n - piece_start, out)
    free(s.text)
    free(s.symbols)
    free(s.heap)
    return status


cdef void _insert(uint64_t *table, int bits, const unsigned char *text, Py_ssize_t n, Py_ssize_t token_id,
                  const char *blob, const int64_t *offsets) noexcept nogil:
    """Map text[:n] to token_id, replacing an earlier id of the same text."""
    cdef uint64_t h = _hash(text, n)
    cdef Py_ssize_t slot = _find_slot(table, bits, h, <const char *>text, n, blob, offsets)
    if slot < 0:
        slot = -1 - slot
    table[slot] = ((h >> 32) << 32) | <uint64_t>(token_id + 1)


cdef void _insert_prefixes(uint64_t *table, int bits, const unsigned char *text, Py_ssize_t n) noexcept nogil:
    """Add the hash (| 1) of each of text's prefixes (text[:1] ... text[:n]) to a set."""
    cdef uint64_t h = 0, mask = (<uint64_t>1 << bits) - 1, i
    cdef Py_ssize_t k
    for k in range(n):
        h = _step(h, text[k])
        i = _slot(h, bits)
        while table[i] != 0 and table[i] != (h | 1):
            i = (i + 1) & mask
        table[i] = h | 1


@cython.final
cdef class SpmEncoder:
    """A "llama" (SentencePiece BPE) vocabulary's encoder; see the module docstring.

    tokens: every id's text; scores: float32 [len(tokens)]; special_ids: the ids matched in text
    before the merges; byte_ids: int32 [256], the id each byte falls back to (-1: dropped)."""
    cdef bytes _blob
    cdef int64_t[::1] _offsets
    cdef uint64_t[::1] _table
    cdef uint64_t[::1] _special_table
    cdef float[::1] _scores
    cdef int32_t[::1] _byte_ids
    cdef uint8_t[::1] _starts
    cdef uint8_t[::1] _lengths
    cdef uint64_t[::1] _prefixes
    cdef Vocab _vocab
    cdef readonly Py_ssize_t num_tokens
    cdef object _special_ids  # int64, sorted: for __reduce__

    def __init__(self, list tokens, scores, special_ids, byte_ids, bint add_space_prefix):
        cdef Py_ssize_t num_tokens = len(tokens), i, n, max_special = 0
        if num_tokens == 0 or num_tokens >= 0x7FFFFFFF:
            raise ValueError(f"{num_tokens} tokens: an SpmEncoder takes 1 to 2^31 - 2")
        self._scores = np.ascontiguousarray(scores, dtype=np.float32)
        if self._scores.shape[0] != num_tokens:
            raise ValueError(f"{self._scores.shape[0]} scores for {num_tokens} tokens")
        self._byte_ids = np.ascontiguousarray(byte_ids, dtype=np.int32)
        if self._byte_ids.shape[0] != 256 or not (-1 <= np.asarray(self._byte_ids).min()
                                                   and np.asarray(self._byte_ids).max() < num_tokens):
            raise ValueError("byte_ids must be 256 ids of this vocabulary or -1")
        specials = np.sort(np.asarray(special_ids, dtype=np.int64))  # (np.unique imports numpy.ma: ~0.1 s)
        self._special_ids = specials
        if len(specials) and (specials.min() < 0 or specials.max() >= num_tokens):
            raise ValueError(f"special_ids must be ids of this vocabulary (0 to {num_tokens - 1})")
        encoded = [PyUnicode_AsUTF8String(t) for t in tokens]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=num_tokens)
        self._offsets = np.zeros(num_tokens + 1, dtype=np.int64)
        np.cumsum(lengths, out=np.asarray(self._offsets)[1:])
        self._blob = b"".join(encoded)
        del encoded
        self.num_tokens = num_tokens
        cdef const char *blob = self._blob
        cdef int bits = _table_bits(num_tokens), special_bits = _table_bits(len(specials))
        self._table = np.zeros(<Py_ssize_t>1 << bits, dtype=np.uint64)
        self._special_table = np.zeros(<Py_ssize_t>1 << special_bits, dtype=np.uint64)
        if len(specials):
            max_special = int(lengths[specials].max())
        self._starts = np.zeros(256, dtype=np.uint8)
        self._lengths = np.zeros(max_special + 1, dtype=np.uint8)
        cdef int prefix_bits = _table_bits(int(lengths[specials].sum()) if len(specials) else 0)
        self._prefixes = np.zeros(<Py_ssize_t>1 << prefix_bits, dtype=np.uint64)
        cdef const int64_t[::1] special_view = specials
        cdef Py_ssize_t token_id
        with nogil:
            for i in range(num_tokens):
                n = self._offsets[i + 1] - self._offsets[i]
                _insert(&self._table[0], bits, <const unsigned char *>(blob + self._offsets[i]), n, i, blob,
                        &self._offsets[0])
            for i in range(special_view.shape[0]):
                token_id = special_view[i]
                n = self._offsets[token_id + 1] - self._offsets[token_id]
                if n == 0:
                    continue
                _insert(&self._special_table[0], special_bits, <const unsigned char *>(blob + self._offsets[token_id]),
                        n, token_id, blob, &self._offsets[0])
                self._starts[<unsigned char>blob[self._offsets[token_id]]] = 1
                self._lengths[n] = 1
                _insert_prefixes(&self._prefixes[0], prefix_bits,
                                 <const unsigned char *>(blob + self._offsets[token_id]), n)
        self._vocab.blob = blob
        self._vocab.offsets = &self._offsets[0]
        self._vocab.table = &self._table[0]
        self._vocab.bits = bits
        self._vocab.special_table = &self._special_table[0]
        self._vocab.special_bits = special_bits
        self._vocab.scores = &self._scores[0]
        self._vocab.byte_ids = &self._byte_ids[0]
        self._vocab.starts = &self._starts[0]
        self._vocab.lengths = &self._lengths[0]
        self._vocab.prefixes = &self._prefixes[0]
        self._vocab.prefix_bits = prefix_bits
        self._vocab.max_special = max_special
        self._vocab.add_space_prefix = add_space_prefix

    def __reduce__(self):
        """Pickling and copy.deepcopy rebuild the encoder from its tokens' texts."""
        return (SpmEncoder, (self.token_texts(), np.asarray(self._scores), self._special_ids,
                             np.asarray(self._byte_ids), bool(self._vocab.add_space_prefix)))

    def encode_batch(self, list texts):
        """-> [[ids] per text]. The GIL is released while the texts are encoded."""
        texts = list(texts)  # holds each str (and so its UTF-8 buffer) while the GIL is released
        cdef Py_ssize_t num_texts = len(texts), i, j
        cdef const char **pointers = <const char **>malloc((num_texts + 1) * sizeof(char *))
        cdef Py_ssize_t *sizes = <Py_ssize_t *>malloc((num_texts + 1) * sizeof(Py_ssize_t))
        cdef Ids *outs = <Ids *>malloc((num_texts + 1) * sizeof(Ids))
        cdef int failed = 0
        cdef list result
        if pointers == NULL or sizes == NULL or outs == NULL:
            free(pointers); free(sizes); free(outs)
            raise MemoryError()
        for i in range(num_texts):
            outs[i].data = NULL
            outs[i].size = outs[i].cap = 0
        try:
            for i in range(num_texts):
                if not isinstance(texts[i], str):
                    raise ValueError(f"texts[{i}] must be a string, got {type(texts[i]).__name__}")
                pointers[i] = PyUnicode_AsUTF8AndSize(texts[i], &sizes[i])  # kept alive by `texts`
                if sizes[i] > MAX_TEXT_BYTES:
                    raise ValueError(f"texts[{i}] has {sizes[i]} UTF-8 bytes; an SpmEncoder takes at most "
                                     f"{MAX_TEXT_BYTES}")
            with nogil:
                for i in range(num_texts):
                    if _encode(&self._vocab, <const unsigned char *>pointers[i], sizes[i], &outs[i]) < 0:
                        failed = 1
                        break
            if failed:
                raise MemoryError()
            result = [None] * num_texts
            for i in range(num_texts):
                result[i] = [outs[i].data[j] for j in range(outs[i].size)]
            return result
        finally:
            for i in range(num_texts):
                free(outs[i].data)
            free(pointers)
            free(sizes)
            free(outs)

    def encode(self, str text):
        """-> [ids] of one text."""
        return self.encode_batch([text])[0]

    def token_text(self, Py_ssize_t token_id):
        """The text of an id; None for an id outside the vocabulary."""
        if token_id < 0 or token_id >= self.num_tokens:
            return None
        return PyUnicode_DecodeUTF8(<const char *>self._vocab.blob + self._offsets[token_id],
                                    self._offsets[token_id + 1] - self._offsets[token_id], NULL)

    def token_id(self, str text):
        """The id of a token's text (the last one, for a text that occurs twice); None if no token."""
        cdef bytes data = PyUnicode_AsUTF8String(text)
        cdef Py_ssize_t n = len(data)
        cdef Py_ssize_t found = _token(&self._vocab, <const unsigned char *><const char *>data, n)
        return None if found < 0 else found

    def token_blob(self):
        """(every token's UTF-8 bytes concatenated, int64 offsets [num_tokens + 1]): token i is
        blob[offsets[i]:offsets[i + 1]]. The offsets are a copy."""
        return self._blob, np.asarray(self._offsets).copy()

    def token_texts(self):
        """Every id's text, a new list."""
        return [self.token_text(i) for i in range(self.num_tokens)]
