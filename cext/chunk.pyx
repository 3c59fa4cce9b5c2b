"""SSE chunk serializer: OpenAI streaming chunks written into one reused buffer.

A ``ChunkWriter`` belongs to one request. Its constructor renders the constant head of
every chunk (``data: {"id":..,"object":..,"created":..,"model":..,"choices":[{"index":0,``)
once into its buffer; each ``event()`` then rewinds to the end of that head and writes
only the escaped delta text, the optional logprobs and the finish_reason, and returns
the whole SSE event (``data: {...}\\n\\n``) as one ``bytes``. Events of other choices
(``index`` > 0: n > 1, batched prompts) rewind to ``"choices":[`` and write their index;
each choice gets its own first-chunk role and its own text offsets. A chat event with more
than content (``delta.reasoning_content``, ``delta.tool_calls``) goes through ``delta_event``.

String escaping (the output is UTF-8 JSON that ``json.loads`` reads back exactly):
``"`` and ``\\`` are backslash-escaped; control characters below U+0020 become
``\\n \\r \\t \\b \\f`` or ``\\u00XX``; every other code point is written as raw UTF-8
(non-ASCII and emoji included). Lone surrogates (a Python ``str`` may hold U+D800..U+DFFF,
even a "pair" stored as two code points) cannot be encoded as UTF-8: each becomes
U+FFFD, so every chunk is valid UTF-8 that any JSON parser reads the same way. The
engine never produces them (its text comes from a UTF-8 decode with replacement).

Logprobs: values below -9999.0, -inf and NaN are written as -9999.0 (as vLLM does), so
the output stays strict JSON (no ``-Infinity``); +inf is written as 0.0.
"""
from cpython.conversion cimport Py_DTSF_ADD_DOT_0, PyOS_double_to_string
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND
from libc.stdint cimport uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy, strlen

DONE = b"data: [DONE]\n\n"

cdef char ESCAPE[128]   # 0: copy as is; otherwise the letter after the backslash
cdef const char* HEX = b"0123456789abcdef"


cdef void _init_escape_table() noexcept:
    cdef int i
    for i in range(128):
        ESCAPE[i] = 0
    for i in range(32):
        ESCAPE[i] = 117  # 'u'
    ESCAPE[8] = 98    # \b
    ESCAPE[9] = 116   # \t
    ESCAPE[10] = 110  # \n
    ESCAPE[12] = 102  # \f
    ESCAPE[13] = 114  # \r
    ESCAPE[34] = 34   # \"
    ESCAPE[92] = 92   # \\


_init_escape_table()


cdef inline char* _put_code_point(char* out, uint32_t c) noexcept nogil:
    cdef char e
    if c < 0x80:
        e = ESCAPE[c]
        if e == 0:
            out[0] = <char>c
            return out + 1
        out[0] = 92  # backslash
        if e != 117:
            out[1] = e
            return out + 2
        out[1] = 117
        out[2] = 48
        out[3] = 48
        out[4] = HEX[c >> 4]
        out[5] = HEX[c & 15]
        return out + 6
    if c < 0x800:
        out[0] = <char>(0xC0 | (c >> 6))
        out[1] = <char>(0x80 | (c & 0x3F))
        return out + 2
    if 0xD800 <= c < 0xE000:
        c = 0xFFFD  # lone surrogate: not encodable as UTF-8
    if c < 0x10000:
        out[0] = <char>(0xE0 | (c >> 12))
        out[1] = <char>(0x80 | ((c >> 6) & 0x3F))
        out[2] = <char>(0x80 | (c & 0x3F))
        return out + 3
    out[0] = <char>(0xF0 | (c >> 18))
    out[1] = <char>(0x80 | ((c >> 12) & 0x3F))
    out[2] = <char>(0x80 | ((c >> 6) & 0x3F))
    out[3] = <char>(0x80 | (c & 0x3F))
    return out + 4


cdef inline double _clamp_logprob(double value) noexcept nogil:
    if not (value >= -9999.0):  # NaN, -inf, very negative
        return -9999.0
    if value > 1.7976931348623157e308:  # +inf
        return 0.0
    return value


def clamp_logprob(double value) -> float:
    """The value ``ChunkWriter`` writes for a logprob (for reference builders and tests)."""
    return _clamp_logprob(value)


cdef class ChunkWriter:
    """Serializes one request's stream. Not thread-safe: one writer per request."""

    def __cinit__(self, str request_id, str model, long long created, bint is_chat,
                  bint include_usage=False):
        self.cap = 1024
        self.buf = <char*>PyMem_Malloc(self.cap)
        if self.buf == NULL:
            raise MemoryError()
        self.pos = 0
        self.is_chat = is_chat
        self.include_usage = include_usage
        self.is_first = True
        self.text_offset = 0
        self._raw(b'data: {"id":', 12)
        self._str(request_id)
        if is_chat:
            self._raw(b',"object":"chat.completion.chunk","created":', 44)
        else:
            self._raw(b',"object":"text_completion","created":', 38)
        self._int(created)
        self._raw(b',"model":', 9)
        self._str(model)
        self._raw(b',"choices":[', 12)
        self.head = PyBytes_FromStringAndSize(self.buf, self.pos)
        self.choices_len = self.pos
        self.roles_sent = set()
        self.text_offsets = {}
        self._choice0_head()
        self.prefix_len = self.pos

    def __dealloc__(self):
        PyMem_Free(self.buf)

    cdef int _reserve(self, Py_ssize_t num_bytes) except -1:
        cdef Py_ssize_t need = self.pos + num_bytes
        cdef Py_ssize_t new_cap
        cdef char* grown
        if need <= self.cap:
            return 0
        new_cap = max(need, 2 * self.cap)
        grown = <char*>PyMem_Realloc(self.buf, new_cap)
        if grown == NULL:
            raise MemoryError()
        self.buf = grown
        self.cap = new_cap
        return 0

    cdef int _raw(self, const char* data, Py_ssize_t num_bytes) except -1:
        self._reserve(num_bytes)
        memcpy(self.buf + self.pos, data, num_bytes)
        self.pos += num_bytes
        return 0

    cdef int _str(self, str text) except -1:
        """Writes text as a quoted JSON string."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        cdef Py_ssize_t i
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef char* out
        self._reserve(6 * n + 2)  # worst case: every character a \u00XX escape
        out = self.buf + self.pos
        out[0] = 34
        out += 1
        if kind == 1:
            for i in range(n):
                out = _put_code_point(out, (<uint8_t*>data)[i])
        elif kind == 2:
            for i in range(n):
                out = _put_code_point(out, (<uint16_t*>data)[i])
        else:
            for i in range(n):
                out = _put_code_point(out, (<uint32_t*>data)[i])
        out[0] = 34
        self.pos = (out + 1) - self.buf
        return 0

    cdef int _int(self, long long value) except -1:
        cdef char tmp[24]
        cdef int n = 0
        cdef bint negative = value < 0
        cdef unsigned long long v = <unsigned long long>(-value) if negative else <unsigned long long>value
        while True:
            tmp[23 - n] = <char>(48 + v % 10)
            n += 1
            v //= 10
            if v == 0:
                break
        if negative:
            tmp[23 - n] = 45
            n += 1
        return self._raw(tmp + 24 - n, n)

    cdef int _float(self, double value) except -1:
        cdef char* text = PyOS_double_to_string(_clamp_logprob(value), b'r', 0, Py_DTSF_ADD_DOT_0, NULL)
        try:
            self._raw(text, strlen(text))
        finally:
            PyMem_Free(text)
        return 0

    cdef int _byte_list(self, object values) except -1:
        cdef bint is_first = True
        self._raw(b"[", 1)
        for v in values:
            if not is_first:
                self._raw(b",", 1)
            is_first = False
            self._int(v)
        self._raw(b"]", 1)
        return 0

    cdef int _chat_logprobs(self, list logprobs) except -1:
        """{"content":[{"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}]}]}"""
        cdef Py_ssize_t i, j
        self._raw(b'{"content":[', 12)
        for i in range(len(logprobs)):
            lp = logprobs[i]
            if i:
                self._raw(b",", 1)
            self._raw(b'{"token":', 9)
            self._str(lp.token)
            self._raw(b',"logprob":', 11)
            self._float(lp.logprob)
            self._raw(b',"bytes":', 9)
            self._byte_list(lp.bytes)
            self._raw(b',"top_logprobs":[', 17)
            top = lp.top
            for j in range(len(top)):
                entry = top[j]
                if j:
                    self._raw(b",", 1)
                self._raw(b'{"token":', 9)
                self._str(entry[1])
                self._raw(b',"logprob":', 11)
                self._float(entry[3])
                self._raw(b',"bytes":', 9)
                self._byte_list(entry[2])
                self._raw(b"}", 1)
            self._raw(b"]}", 2)
        self._raw(b"]}", 2)
        return 0

    cdef int _text_logprobs(self, list logprobs) except -1:
        """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        cdef Py_ssize_t i, j, n = len(logprobs)
        self._raw(b'{"tokens":[', 11)
        for i in range(n):
            if i:
                self._raw(b",", 1)
            self._str(logprobs[i].token)
        self._raw(b'],"token_logprobs":[', 20)
        for i in range(n):
            if i:
                self._raw(b",", 1)
            self._float(logprobs[i].logprob)
        self._raw(b'],"top_logprobs":[', 18)
        for i in range(n):
            if i:
                self._raw(b",", 1)
            self._raw(b"{", 1)
            lp = logprobs[i]
            top = lp.top
            is_in_top = False
            for j in range(len(top)):
                entry = top[j]
                if j:
                    self._raw(b",", 1)
                self._str(entry[1])
                self._raw(b":", 1)
                self._float(entry[3])
                is_in_top = is_in_top or entry[0] == lp.token_id
            if not is_in_top:  # OpenAI: the sampled token is always there (up to k + 1 entries)
                if top:
                    self._raw(b",", 1)
                self._str(lp.token)
                self._raw(b":", 1)
                self._float(lp.logprob)
            self._raw(b"}", 1)
        self._raw(b'],"text_offset":[', 17)
        for i in range(n):
            if i:
                self._raw(b",", 1)
            self._int(self.text_offset)
            self.text_offset += PyUnicode_GET_LENGTH(logprobs[i].token)
        self._raw(b"]}", 2)
        return 0

    cdef bytes _take(self):
        return PyBytes_FromStringAndSize(self.buf, self.pos)

    cpdef bytes event(self, str text, object logprobs, object finish_reason, long long index=0):
        """One SSE event for one StreamEvent: its text, logprobs (list or None), finish_reason, choice index."""
        cdef bint is_first
        cdef long long saved_offset = self.text_offset
        if index == 0:
            self.pos = self.prefix_len
            is_first = self.is_first
            self.is_first = False
        else:
            self.pos = self.choices_len
            self._raw(b'{"index":', 9)
            self._int(index)
            if self.is_chat:
                self._raw(b',"delta":{', 10)
            else:
                self._raw(b',', 1)
            is_first = index not in self.roles_sent
            if is_first:
                self.roles_sent.add(index)
            self.text_offset = self.text_offsets.get(index, 0)
        if self.is_chat:
            if is_first:
                self._raw(b'"role":"assistant",', 19)
            self._raw(b'"content":', 10)
            self._str(text)
            self._raw(b'},"logprobs":', 13)
        else:
            self._raw(b'"text":', 7)
            self._str(text)
            self._raw(b',"logprobs":', 12)
        if logprobs is None:
            self._raw(b"null", 4)
        elif self.is_chat:
            self._chat_logprobs(logprobs)
        else:
            self._text_logprobs(logprobs)
        self._raw(b',"finish_reason":', 17)
        if finish_reason is None:
            self._raw(b"null", 4)
        else:
            self._str(finish_reason)
        if self.include_usage:
            self._raw(b'}],"usage":null}\n\n', 18)
        else:
            self._raw(b"}]}\n\n", 5)
        if index == 0:
            return self._take()
        self.text_offsets[index] = self.text_offset
        self.text_offset = saved_offset
        chunk = self._take()
        self.pos = self.choices_len  # put choice 0's head back in buf[:prefix_len]
        self._choice0_head()
        return chunk

    cpdef advance_text_offset(self, long long index, long long num_chars):
        """Move choice ``index``'s completions text_offset past text sent outside ``event`` (echo)."""
        if index == 0:
            self.text_offset += num_chars
        else:
            self.text_offsets[index] = self.text_offsets.get(index, 0) + num_chars

    cpdef bytes delta_event(self, str text, object reasoning, object tool_calls_json, object logprobs,
                            object finish_reason, long long index=0):
        """A chat event whose delta has more than content: ``reasoning`` (str or None) is written as
        ``delta.reasoning_content``, ``tool_calls_json`` (bytes or None: the JSON array of
        ``delta.tool_calls``) as is; ``content`` is null when ``text`` is empty. Requests of a
        reasoning template or with tools only: the per-token ``event`` path stays as it is."""
        cdef bint is_first
        if not self.is_chat:
            raise ValueError("reasoning and tool calls exist only in chat chunks")
        if reasoning is not None and not isinstance(reasoning, str):
            raise TypeError("reasoning must be a str or None")
        if tool_calls_json is not None and not isinstance(tool_calls_json, bytes):
            raise TypeError("tool_calls_json must be bytes or None")
        if index == 0:
            self.pos = self.prefix_len
            is_first = self.is_first
            self.is_first = False
        else:
            self.pos = self.choices_len
            self._raw(b'{"index":', 9)
            self._int(index)
            self._raw(b',"delta":{', 10)
            is_first = index not in self.roles_sent
            if is_first:
                self.roles_sent.add(index)
        if is_first:
            self._raw(b'"role":"assistant",', 19)
        self._raw(b'"content":', 10)
        if text:
            self._str(text)
        else:
            self._raw(b"null", 4)
        if reasoning is not None:
            self._raw(b',"reasoning_content":', 21)
            self._str(reasoning)
        if tool_calls_json is not None:
            self._raw(b',"tool_calls":', 14)
            self._raw(tool_calls_json, len(<bytes>tool_calls_json))
        self._raw(b'},"logprobs":', 13)
        if logprobs is None:
            self._raw(b"null", 4)
        else:
            self._chat_logprobs(logprobs)
        self._raw(b',"finish_reason":', 17)
        if finish_reason is None:
            self._raw(b"null", 4)
        else:
            self._str(finish_reason)
        if self.include_usage:
            self._raw(b'}],"usage":null}\n\n', 18)
        else:
            self._raw(b"}]}\n\n", 5)
        chunk = self._take()
        if index != 0:
            self.pos = self.choices_len  # put choice 0's head back in buf[:prefix_len]
            self._choice0_head()
        return chunk

    cdef int _choice0_head(self) except -1:
        if self.is_chat:
            return self._raw(b'{"index":0,"delta":{', 20)
        return self._raw(b'{"index":0,', 11)

    cpdef bytes usage(self, long long prompt_tokens, long long completion_tokens):
        """The final usage chunk of stream_options.include_usage (choices is empty)."""
        self.pos = self.prefix_len
        self._raw(b'],"usage":{"prompt_tokens":', 27)
        self._int(prompt_tokens)
        self._raw(b',"completion_tokens":', 21)
        self._int(completion_tokens)
        self._raw(b',"total_tokens":', 16)
        self._int(prompt_tokens + completion_tokens)
        self._raw(b"}}\n\n", 4)
        return self.head + PyBytes_FromStringAndSize(self.buf + self.prefix_len, self.pos - self.prefix_len)


def dumps_str(str text) -> bytes:
    """``text`` as a quoted JSON string, escaped exactly as ChunkWriter escapes delta text."""
    cdef ChunkWriter writer = ChunkWriter("", "", 0, True)
    writer.pos = 0
    writer._str(text)
    return writer._take()
