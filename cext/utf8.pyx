"""UTF-8 boundary tracking for incremental detokenization.

`Utf8Tracker` receives the raw bytes of generated tokens one piece at a time and
returns the text that can no longer change; it holds back only what a later byte
could still change. Two renderings, matching `tokenizers`' decoders byte for byte:

- MODE_BYTES (byte-level BPE, `decoders.ByteLevel`): the pieces are concatenated and
  decoded like ``bytes.decode("utf-8", errors="replace")`` (one U+FFFD per maximal
  invalid subpart). Everything but an incomplete last character is released at once.
- MODE_PIECES (SentencePiece, `Replace`/`ByteFallback`/`Fuse`/`Strip`): text pieces are
  valid UTF-8 and released at once; a run of consecutive byte-fallback tokens is decoded
  as a whole when it ends, and if it is not valid UTF-8 every byte token of it becomes
  U+FFFD. So a run is held until it ends or turns invalid (from then on each byte token
  is released as U+FFFD at once).

``num_strip`` leading spaces of the whole output are removed (the `Strip` decoder).
`TokenTable` holds every token's piece so that ``add(token_id)`` is one call.
"""
cimport cython
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.ref cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8String, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t


cdef str REPLACEMENT = "\ufffd"


cdef inline int lead_need(unsigned char b, unsigned char* lo, unsigned char* hi) noexcept nogil:
    """Continuation bytes a lead byte needs (and the range of the first one), -1 if b cannot lead."""
    if b < 0x80:
        return 0
    if b < 0xC2:
        return -1
    lo[0] = 0x80
    hi[0] = 0xBF
    if b < 0xE0:
        return 1
    if b < 0xF0:
        if b == 0xE0:
            lo[0] = 0xA0
        elif b == 0xED:
            hi[0] = 0x9F
        return 2
    if b < 0xF5:
        if b == 0xF0:
            lo[0] = 0x90
        elif b == 0xF4:
            hi[0] = 0x8F
        return 3
    return -1


cdef inline Py_ssize_t incomplete_tail(const unsigned char* data, Py_ssize_t n) noexcept nogil:
    """Start of the trailing incomplete-but-valid-so-far sequence of data[:n], or n if none."""
    cdef Py_ssize_t j = n - 1
    cdef unsigned char lo = 0x80, hi = 0xBF
    cdef int need
    while j >= 0 and j >= n - 3:
        if (data[j] & 0xC0) != 0x80:
            need = lead_need(data[j], &lo, &hi)
            if need <= n - 1 - j:
                return n  # ASCII, complete, or not a lead byte: nothing to hold
            if j + 1 < n and not (lo <= data[j + 1] <= hi):
                return n
            if j + 2 < n and not (0x80 <= data[j + 2] <= 0xBF):
                return n
            return j
        j -= 1
    return n


cdef inline str decode_replace(const unsigned char* data, Py_ssize_t n):
    return PyUnicode_DecodeUTF8(<const char*>data, n, "replace")


@cython.final
cdef class TokenTable:
    """Every token's piece: ``blob[offsets[i]:offsets[i + 1]]`` with ``kinds[i]`` flags."""

    def __init__(self, bytes blob, offsets, kinds, list texts=None):
        """texts: each id's strict text (None for a byte token or a piece that is not valid UTF-8
        alone); None: each one is made from its piece on first use and kept in ``made`` (a list of
        262k str is ~18 MB, a list of 262k slots alone 2.1 MB; a stream uses a few thousand ids)."""
        cdef Py_ssize_t num_ids = len(kinds)
        if len(offsets) != num_ids + 1 or (texts is not None and len(texts) != num_ids):
            raise ValueError("offsets must have len(kinds) + 1 entries and texts len(kinds)")
        if num_ids and (offsets[0] != 0 or offsets[num_ids] != len(blob)):
            raise ValueError("offsets must start at 0 and end at len(blob)")
        self.blob = blob
        self.offsets = offsets
        self.kinds = kinds
        self.texts = texts
        self.made = {} if texts is None else None
        self.num_ids = num_ids
        self._blob = <const unsigned char*>blob
        self._offsets = offsets
        self._kinds = kinds

    cdef object _text(self, Py_ssize_t token_id):
        """texts[token_id], or made from the piece the first time."""
        cdef int64_t start
        cdef object text
        cdef PyObject *found
        if self.made is None:
            return <object>PyList_GET_ITEM(self.texts, token_id)
        found = PyDict_GetItem(self.made, token_id)
        if found != NULL:
            return <object>found
        text = None
        start = self._offsets[token_id]
        if self._kinds[token_id] & KIND_UNKNOWN:
            text = ""  # as token_pieces gives it (add() drops the id before asking)
        elif not self._kinds[token_id] & KIND_BYTE:
            try:
                text = PyUnicode_DecodeUTF8(<const char*>(self._blob + start),
                                            self._offsets[token_id + 1] - start, NULL)
            except UnicodeDecodeError:
                text = None
        self.made[token_id] = text
        return text

    def text(self, Py_ssize_t token_id):
        """The strict text of a piece: str when valid UTF-8 alone, None for a byte token or not."""
        if token_id < 0 or token_id >= self.num_ids:
            return None
        return self._text(token_id)

    def piece(self, Py_ssize_t token_id) -> bytes:
        if token_id < 0 or token_id >= self.num_ids:
            return b""
        return self.blob[self._offsets[token_id]:self._offsets[token_id + 1]]


@cython.final
cdef class Utf8Tracker:
    def __cinit__(self, TokenTable table=None, int mode=MODE_BYTES, bint skip_special=True, int num_strip=0):
        if mode != MODE_BYTES and mode != MODE_PIECES:
            raise ValueError(f"mode must be DecodeMode.MODE_BYTES or MODE_PIECES, got {mode}")
        if num_strip < 0:
            raise ValueError(f"num_strip must be >= 0, got {num_strip}")
        self.table = table
        self.mode = mode
        self.skip_special = skip_special
        self.num_strip = num_strip
        self.run = NULL

    def __dealloc__(self):
        PyMem_Free(self.run)

    cdef str _emit(self, str text):
        cdef Py_ssize_t i = 0, n
        if self.num_strip == 0:
            return text
        n = len(text)
        if n == 0:
            return text
        while i < n and i < self.num_strip and text[i] == " ":
            i += 1
        self.num_strip = 0 if i < n else self.num_strip - i
        return text[i:]

    cpdef str add(self, Py_ssize_t token_id):
        """Feed one token id through the table; return the text that became final."""
        cdef TokenTable table = self.table
        cdef uint8_t kind
        cdef int64_t start
        cdef object text
        if table is None:
            raise ValueError("add() needs a tracker built with a TokenTable")
        if token_id < 0 or token_id >= table.num_ids:
            return ""  # decode drops ids it does not know
        kind = table._kinds[token_id]
        if kind & KIND_UNKNOWN or (kind & KIND_SPECIAL and self.skip_special):
            return ""
        start = table._offsets[token_id]
        if kind & KIND_BYTE:
            return self._push_run_byte(table._blob[start])
        if self.num_pending == 0 and self.num_run == 0 and not self.is_run_invalid and self.num_strip == 0:
            text = table._text(token_id)
            if text is not None:
                return <str>text
        return self._push(table._blob + start, table._offsets[token_id + 1] - start)

    cpdef str push(self, const unsigned char[::1] data):
        """Feed raw piece bytes (a text piece in MODE_PIECES); return the text that became final."""
        if data.shape[0] == 0:
            return self._push(NULL, 0)
        return self._push(&data[0], data.shape[0])

    cpdef str push_byte(self, int value):
        """Feed one byte-fallback token's byte (MODE_PIECES) or one byte (MODE_BYTES)."""
        cdef unsigned char b
        if value < 0 or value > 255:
            raise ValueError(f"value must be a byte (0-255), got {value}")
        b = <unsigned char>value
        if self.mode == MODE_PIECES:
            return self._push_run_byte(b)
        return self._push_bytes(&b, 1)

    cpdef str finish(self):
        """Release what is held, rendered as the decoder renders the end of the output."""
        if self.mode == MODE_PIECES:
            return self._emit(self._end_run())
        if self.num_pending == 0:
            return ""
        self.num_pending = 0
        self.need = 0
        return self._emit(REPLACEMENT)  # an incomplete sequence is one maximal invalid subpart

    cpdef str peek(self):
        """What finish() would return now, without changing any state."""
        cdef str text
        cdef Py_ssize_t i = 0, n
        if self.mode == MODE_BYTES:
            return REPLACEMENT if self.num_pending else ""  # U+FFFD is not a space: no strip
        if self.is_run_invalid or self.num_run == 0:
            return ""
        text = REPLACEMENT * self.num_run if self.need else decode_replace(self.run, self.num_run)
        n = len(text)
        while i < n and i < self.num_strip and text[i] == " ":
            i += 1
        return text[i:]

    cdef str _push(self, const unsigned char* data, Py_ssize_t num_bytes):
        cdef str head
        if self.mode == MODE_BYTES:
            return self._push_bytes(data, num_bytes)
        head = self._end_run()
        if num_bytes == 0:
            return self._emit(head)
        return self._emit(head + decode_replace(data, num_bytes))

    cdef str _push_bytes(self, const unsigned char* data, Py_ssize_t num_bytes):
        cdef Py_ssize_t i = 0, split, k
        cdef unsigned char b
        cdef str head = "", body
        # Complete (or invalidate) the held sequence first.
        while self.num_pending and i < num_bytes:
            b = data[i]
            if self.lo <= b <= self.hi:
                self.pending[self.num_pending] = b
                self.num_pending += 1
                self.need -= 1
                self.lo = 0x80
                self.hi = 0xBF
                i += 1
                if self.need == 0:
                    head = decode_replace(self.pending, self.num_pending)
                    self.num_pending = 0
            else:
                head = REPLACEMENT  # b is not consumed: it starts afresh
                self.num_pending = 0
                self.need = 0
        if self.num_pending:
            return ""
        split = i + incomplete_tail(data + i, num_bytes - i)
        if split > i:
            body = decode_replace(data + i, split - i)
            head = body if not head else head + body
        if split < num_bytes:
            self.need = lead_need(data[split], &self.lo, &self.hi)
            for k in range(split, num_bytes):
                self.pending[k - split] = data[k]
            self.num_pending = <int>(num_bytes - split)
            if self.num_pending > 1:
                self.need -= self.num_pending - 1
                self.lo = 0x80
                self.hi = 0xBF
        return self._emit(head)

    cdef int _grow_run(self) except -1:
        cdef Py_ssize_t capacity = self.run_capacity * 2 if self.run_capacity else 64
        cdef unsigned char* run = <unsigned char*>PyMem_Realloc(self.run, capacity)
        if run == NULL:
            raise MemoryError()
        self.run = run
        self.run_capacity = capacity
        return 0

    cdef str _push_run_byte(self, unsigned char value):
        cdef bint is_valid
        cdef Py_ssize_t num_bad
        if self.is_run_invalid:
            return self._emit(REPLACEMENT)
        if self.num_run == self.run_capacity:
            self._grow_run()
        self.run[self.num_run] = value
        self.num_run += 1
        if self.need == 0:
            self.need = lead_need(value, &self.lo, &self.hi)
            is_valid = self.need >= 0
        else:
            is_valid = self.lo <= value <= self.hi
            if is_valid:
                self.need -= 1
                self.lo = 0x80
                self.hi = 0xBF
        if is_valid:
            return ""
        # The run can never be valid again: every byte token of it renders as U+FFFD.
        num_bad = self.num_run
        self.is_run_invalid = True
        self.num_run = 0
        self.need = 0
        return self._emit(REPLACEMENT * num_bad)

    cdef str _end_run(self):
        cdef str text
        if self.is_run_invalid:
            self.is_run_invalid = False
            return ""
        if self.num_run == 0:
            return ""
        if self.need:
            text = REPLACEMENT * self.num_run
        else:
            text = decode_replace(self.run, self.num_run)
        self.num_run = 0
        self.need = 0
        return text

    @property
    def num_held_bytes(self) -> int:
        """Bytes held back: an incomplete character or an unfinished byte-fallback run."""
        return self.num_pending + self.num_run


cdef inline int hex_value(Py_UCS4 c) noexcept:
    cdef int code = <int>c
    if 48 <= code <= 57:     # 0-9
        return code - 48
    if 97 <= code <= 102:    # a-f
        return code - 87
    if 65 <= code <= 70:     # A-F
        return code - 55
    return -1


cdef inline int byte_token_value(str token) noexcept:
    """The byte of a ByteFallback token "<0xNN>" (or "<0x+N>", as `tokenizers` parses it with
    u8::from_str_radix), -1 for any other text."""
    cdef int high, low
    if len(token) != 6 or token[0] != u'<' or token[1] != u'0' or token[2] != u'x' or token[5] != u'>':
        return -1
    low = hex_value(token[4])
    if low < 0:
        return -1
    if token[3] == u'+':
        return low
    high = hex_value(token[3])
    return -1 if high < 0 else high * 16 + low


def token_pieces(list tokens, tuple replaces, bint byte_fallback, byte_level, uint8_t[::1] kinds,
                 bint with_texts=True):
    """Every token's piece as its decoder renders it alone -> (pieces, strict texts, texts).

    tokens[i] is the vocabulary's text of id i or None (an unknown id: empty piece, kinds[i] =
    KIND_UNKNOWN). byte_level: None for SentencePiece-style pieces (the (pattern, content)
    replaces in order, then with byte_fallback a "<0xNN>" token is its one byte, kinds[i] |=
    KIND_BYTE), else a function token -> bytes (ByteLevel). kinds comes in with KIND_SPECIAL
    set for special ids. Strict texts: the piece as str, None for a byte token or a piece that
    is not valid UTF-8; texts: the same with errors="replace". with_texts=False: both are None
    (TokenTable makes strict texts on use). The Python loop took ~0.5 s over Gemma 3's 262,144
    ids at every load."""
    cdef Py_ssize_t num_ids = len(tokens), i
    cdef int value
    cdef str text
    cdef bytes piece
    if kinds.shape[0] != num_ids:
        raise ValueError(f"kinds has {kinds.shape[0]} entries for {num_ids} tokens")
    cdef list pieces = [None] * num_ids
    cdef list strict = [None] * num_ids if with_texts else None
    cdef list texts = [None] * num_ids if with_texts else None
    for i in range(num_ids):
        token = tokens[i]
        if token is None:
            pieces[i] = b""
            if with_texts:
                strict[i] = texts[i] = ""
            kinds[i] = KIND_UNKNOWN
            continue
        if byte_level is not None:
            piece = byte_level(token)
            pieces[i] = piece
            if with_texts:
                try:
                    strict[i] = texts[i] = PyUnicode_DecodeUTF8(<const char*>piece, len(piece), NULL)
                except UnicodeDecodeError:
                    texts[i] = decode_replace(<const unsigned char*>piece, len(piece))
            continue
        text = <str>token
        for pattern, content in replaces:
            text = text.replace(pattern, content)
        value = byte_token_value(text) if byte_fallback else -1
        if value >= 0:
            piece = bytes((value,))
            pieces[i] = piece
            if with_texts:
                texts[i] = decode_replace(<const unsigned char*>piece, 1)
            kinds[i] |= KIND_BYTE
        else:
            pieces[i] = PyUnicode_AsUTF8String(text)  # a str's UTF-8 is valid: its strict text is itself
            if with_texts:
                strict[i] = texts[i] = text
    return pieces, strict, texts
