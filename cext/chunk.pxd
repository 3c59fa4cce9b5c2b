# Header for cext/chunk.pyx: the SSE chunk serializer.
cimport cython


@cython.final
cdef class ChunkWriter:
    cdef char* buf              # reused output buffer: prefix, then one chunk's variable part
    cdef Py_ssize_t cap         # bytes allocated in buf
    cdef Py_ssize_t pos         # bytes written so far
    cdef Py_ssize_t prefix_len  # the constant head of every choice-0 chunk, kept in buf[:prefix_len]
    cdef Py_ssize_t choices_len # buf[:choices_len] is the head up to '"choices":[' (other choices start there)
    cdef bytes head             # 'data: {"id":...,"model":...,"choices":[' (for the usage chunk)
    cdef bint is_chat
    cdef bint include_usage
    cdef bint is_first          # the first chat chunk carries delta.role
    cdef long long text_offset  # completions logprobs: character offset of choice 0's next token
    cdef set roles_sent         # choices other than 0 whose first chat chunk went out
    cdef dict text_offsets      # choices other than 0: their text_offset

    cdef int _reserve(self, Py_ssize_t num_bytes) except -1
    cdef int _raw(self, const char* data, Py_ssize_t num_bytes) except -1
    cdef int _str(self, str text) except -1
    cdef int _int(self, long long value) except -1
    cdef int _float(self, double value) except -1
    cdef int _byte_list(self, object values) except -1
    cdef int _chat_logprobs(self, list logprobs) except -1
    cdef int _text_logprobs(self, list logprobs) except -1
    cdef bytes _take(self)
    cdef int _choice0_head(self) except -1
    cpdef bytes event(self, str text, object logprobs, object finish_reason, long long index=*)
    cpdef bytes delta_event(self, str text, object reasoning, object tool_calls_json, object logprobs,
                            object finish_reason, long long index=*)
    cpdef bytes usage(self, long long prompt_tokens, long long completion_tokens)
    cpdef advance_text_offset(self, long long index, long long num_chars)
