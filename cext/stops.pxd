# Header of cext/stops.pyx: one Aho-Corasick automaton over a request's stop strings.
cimport cython
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef enum:
    LABEL_MASK = 0x3FFFFFFF  # labels[v] & LABEL_MASK: the character into node v
    SEPARATOR = 0x200000     # label of the root and of the gaps between stops: above every code point
    HAS_EDGES = 0x40000000   # labels[v] flag: v has children in the edge table
    NUM_MASK_WORDS = 16      # alphabet filter: 1,024 bits over the low bits of a code point


cdef class StopAutomaton:
    cdef public tuple stops
    cdef public bint include_stop_str
    cdef public bint is_stopped
    cdef public object stop_str              # the stop string that ended the text, else None
    cdef readonly int32_t state              # node: the longest suffix of the text that is a stop prefix
    cdef readonly int32_t num_nodes
    cdef readonly int32_t max_stop_len
    # The unreleased text (the last depth[state] characters): "".join(held_parts)[held_offset:],
    # kept as the pushed pieces so that releasing costs what is released, not what is held.
    cdef object held_parts                   # collections.deque of str
    cdef Py_ssize_t held_offset
    # Node v in [0, num_nodes]; 0 is the root, v + 1 is v's child by labels[v + 1] (unless SEPARATOR).
    cdef uint32_t* labels                    # [num_nodes + 1]
    cdef int32_t* fail                       # [num_nodes] failure link
    cdef int32_t* depth                      # [num_nodes] length of the prefix a node stands for
    cdef int32_t* match_len                  # [num_nodes] longest stop that is a suffix of it, 0: none
    # Children not at v + 1 (at most one per stop), sorted by (parent, char).
    cdef int32_t* edge_parents
    cdef uint32_t* edge_chars
    cdef int32_t* edge_children
    cdef int32_t num_edges
    cdef uint64_t alphabet_mask[NUM_MASK_WORDS]  # bit (c & 1023) set if some stop has a char c
    cdef uint32_t* alphabet                  # [num_alphabet] the distinct characters of the stops, sorted
    cdef int32_t num_alphabet

    cdef void _free(self) noexcept
    cdef int _build(self, list ordered) except -1
    cdef int _link(self) except -1
    cdef int32_t _child(self, int32_t node, uint32_t char) noexcept nogil
    cdef bint _in_alphabet(self, uint32_t char) noexcept nogil
    cdef int32_t _step(self, int32_t state, uint32_t char) noexcept nogil
    cdef int32_t _goto(self, int32_t state, uint32_t char) noexcept nogil
    cdef str _held(self)
    cdef str _release(self, Py_ssize_t num_chars)
    cdef tuple _stop(self, str buffer, Py_ssize_t end, int32_t state)
    cpdef tuple push(self, str text)
    cpdef bint completes_with(self, str tentative)
    cpdef str flush(self)
