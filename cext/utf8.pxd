# Header of cext/utf8.pyx: the per-token byte table and the UTF-8 boundary tracker.
cimport cython
from libc.stdint cimport int64_t, uint8_t

# TokenTable.kinds flags (one uint8 per id). Python: cext.utf8.TokenKind.KIND_BYTE, ...
cpdef enum TokenKind:
    KIND_TEXT = 0      # piece bytes join the output as they are
    KIND_BYTE = 1      # a byte-fallback token <0xNN>: its one byte joins the current run
    KIND_SPECIAL = 2   # dropped when the tracker skips special tokens
    KIND_UNKNOWN = 4   # an id the tokenizer does not know: decode drops it

# Utf8Tracker.mode. Python: cext.utf8.DecodeMode.MODE_BYTES, DecodeMode.MODE_PIECES.
cpdef enum DecodeMode:
    MODE_BYTES = 0     # byte-level BPE: every piece is bytes, rendered like errors="replace"
    MODE_PIECES = 1    # SentencePiece: text pieces plus runs of byte-fallback tokens


@cython.final
cdef class TokenTable:
    cdef readonly bytes blob                 # every piece, concatenated
    cdef readonly object offsets             # int64 [num_ids + 1]: piece i is blob[offsets[i]:offsets[i + 1]]
    cdef readonly object kinds               # uint8 [num_ids]: KIND_* flags
    cdef readonly list texts                 # [num_ids]: str of a piece that is valid UTF-8 on its own, else None
                                             # (None when built without texts: see made)
    cdef readonly dict made                  # built without texts: the texts made so far, by id
    cdef readonly Py_ssize_t num_ids
    cdef const unsigned char* _blob
    cdef const int64_t[::1] _offsets
    cdef const uint8_t[::1] _kinds
    cdef object _text(self, Py_ssize_t token_id)


@cython.final
cdef class Utf8Tracker:
    cdef readonly TokenTable table
    cdef readonly int mode
    cdef readonly bint skip_special
    cdef readonly int num_strip              # leading spaces still to strip from the output
    # An incomplete UTF-8 sequence (MODE_BYTES) or the DFA state of the byte run (MODE_PIECES).
    cdef unsigned char pending[4]
    cdef int num_pending
    cdef int need                            # continuation bytes still expected
    cdef unsigned char lo, hi                # allowed range of the next continuation byte
    # MODE_PIECES: the current run of byte-fallback tokens.
    cdef unsigned char* run
    cdef Py_ssize_t num_run, run_capacity
    cdef bint is_run_invalid

    cdef str _emit(self, str text)
    cdef str _push(self, const unsigned char* data, Py_ssize_t num_bytes)
    cdef str _push_bytes(self, const unsigned char* data, Py_ssize_t num_bytes)
    cdef str _push_run_byte(self, unsigned char value)
    cdef str _end_run(self)
    cdef int _grow_run(self) except -1
    cpdef str add(self, Py_ssize_t token_id)
    cpdef str push(self, const unsigned char[::1] data)
    cpdef str push_byte(self, int value)
    cpdef str finish(self)
    cpdef str peek(self)
