"""Stop strings: one Aho-Corasick automaton over all of a request's stop strings.

A state is the longest suffix of the text so far that is a prefix of some stop string, so
the text held back (it might still become a stop) is the last ``depth[state]`` characters,
and a stop has completed when ``match_len[state]`` (the longest stop that is a suffix of
the state) is not 0. Building takes time and memory linear in the total stop length (16
bytes per character, 20 while building; the stops are sorted first); a push costs time
linear in its text, amortized over the pushes, whatever the number of stops and the
length of the output. The held text is kept as the pushed pieces, so releasing it costs
what is released, not what is held.

Layout: the stops are sorted, and each contributes the part not shared with the previous
one (its "segment") as consecutive nodes, followed by one gap node (label SEPARATOR, never
reached). So node v + 1 is v's child by ``labels[v + 1]``; the first node of a segment is
a child of a node of an earlier segment (or of the root), kept in a small sorted edge table
(at most one edge per stop). Failure links are computed in order of depth, with the parent
of a segment's first node parked in its ``fail`` entry until then.
"""
cimport cython
from collections import deque

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_KIND, PyUnicode_READ
from libc.stdint cimport INT32_MAX, int32_t, uint32_t, uint64_t
from libc.string cimport memset


cdef Py_ssize_t common_prefix_len(str a, str b):
    cdef Py_ssize_t i, n = min(len(a), len(b))
    cdef unsigned int kind_a = PyUnicode_KIND(a), kind_b = PyUnicode_KIND(b)
    cdef void* data_a = PyUnicode_DATA(a)
    cdef void* data_b = PyUnicode_DATA(b)
    for i in range(n):
        if PyUnicode_READ(kind_a, data_a, i) != PyUnicode_READ(kind_b, data_b, i):
            return i
    return n


cdef void* alloc(Py_ssize_t num_items, size_t item_size) except NULL:
    cdef void* p = PyMem_Malloc(num_items * item_size if num_items else 1)
    if p == NULL:
        raise MemoryError()
    return p


cdef class StopAutomaton:
    """``StopAutomaton(stops, include_stop_str)``: stops are distinct non-empty strings."""

    def __cinit__(self):
        self.stops = ()
        self.held_parts = deque()
        self.stop_str = None

    def __init__(self, stops, bint include_stop_str=False):
        stops = tuple(stops)
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must be non-empty strings, got {stop!r:.40}")
        self._free()
        self.stops = stops
        self.include_stop_str = include_stop_str
        self.is_stopped = False
        self.stop_str = None
        self.held_parts.clear()
        self.held_offset = 0
        self.state = 0
        self._build(sorted(stops))

    def __dealloc__(self):
        self._free()

    cdef void _free(self) noexcept:
        PyMem_Free(self.labels)
        PyMem_Free(self.fail)
        PyMem_Free(self.depth)
        PyMem_Free(self.match_len)
        PyMem_Free(self.edge_parents)
        PyMem_Free(self.edge_chars)
        PyMem_Free(self.edge_children)
        PyMem_Free(self.alphabet)
        self.alphabet = NULL
        self.num_alphabet = 0
        self.labels = NULL
        self.fail = self.depth = self.match_len = self.edge_parents = self.edge_children = NULL
        self.edge_chars = NULL
        self.num_nodes = self.num_edges = self.max_stop_len = 0

    cdef int _build(self, list ordered) except -1:
        """The trie from the sorted stops (each shares its common prefix with the previous one),
        the alphabet and the edge table; then the failure links."""
        cdef Py_ssize_t num_stops = len(ordered), k, i, n, shared, num_nodes = 1, max_len = 0
        cdef str stop, previous = ""
        cdef int32_t node, first, parent
        cdef uint32_t char
        cdef unsigned int kind
        cdef void* data
        cdef int32_t* shared_lens = NULL
        cdef int32_t* path = NULL
        memset(self.alphabet_mask, 0, sizeof(self.alphabet_mask))
        try:
            shared_lens = <int32_t*>alloc(num_stops, sizeof(int32_t))
            for k in range(num_stops):
                stop = ordered[k]
                shared = common_prefix_len(previous, stop)
                if shared == len(stop):
                    raise ValueError(f"stop strings must be distinct, got {stop!r:.40} twice")
                shared_lens[k] = shared
                num_nodes += len(stop) - shared + 1
                max_len = max(max_len, len(stop))
                if num_nodes >= INT32_MAX:
                    raise ValueError(f"stop strings are too long in total ({num_nodes} nodes)")
                previous = stop
            self.labels = <uint32_t*>alloc(num_nodes, sizeof(uint32_t))
            self.fail = <int32_t*>alloc(num_nodes, sizeof(int32_t))
            self.depth = <int32_t*>alloc(num_nodes, sizeof(int32_t))
            self.match_len = <int32_t*>alloc(num_nodes, sizeof(int32_t))
            self.num_nodes, self.max_stop_len = num_nodes, max_len
            path = <int32_t*>alloc(max_len + 1, sizeof(int32_t))  # path[d]: node at depth d of the last stop
            path[0] = 0
            self.labels[0], self.fail[0], self.depth[0], self.match_len[0] = SEPARATOR, 0, 0, 0
            edges = []
            node = 1
            for k in range(num_stops):
                stop, shared = ordered[k], shared_lens[k]
                n, kind, data = len(stop), PyUnicode_KIND(stop), PyUnicode_DATA(stop)
                parent, first = path[shared], node
                if first != parent + 1:
                    edges.append((parent, <uint32_t>PyUnicode_READ(kind, data, shared), first))
                for i in range(shared, n):
                    char = PyUnicode_READ(kind, data, i)
                    self.alphabet_mask[(char >> 6) & (NUM_MASK_WORDS - 1)] |= (<uint64_t>1) << (char & 63)
                    self.labels[node], self.depth[node], self.match_len[node] = char, i + 1, 0
                    self.fail[node] = 0
                    path[i + 1] = node
                    node += 1
                self.fail[first] = parent  # parked until the failure links are computed
                self.match_len[node - 1] = n
                self.labels[node], self.fail[node], self.depth[node], self.match_len[node] = SEPARATOR, 0, 0, 0
                node += 1
            alphabet = sorted(set().union(*ordered))
            self.alphabet = <uint32_t*>alloc(len(alphabet), sizeof(uint32_t))
            for k, char_str in enumerate(alphabet):
                self.alphabet[k] = ord(char_str)
            self.num_alphabet = len(alphabet)
            edges.sort()
            self.num_edges = len(edges)
            self.edge_parents = <int32_t*>alloc(self.num_edges, sizeof(int32_t))
            self.edge_chars = <uint32_t*>alloc(self.num_edges, sizeof(uint32_t))
            self.edge_children = <int32_t*>alloc(self.num_edges, sizeof(int32_t))
            for k, (parent, char, first) in enumerate(edges):
                self.edge_parents[k], self.edge_chars[k], self.edge_children[k] = parent, char, first
                self.labels[parent] |= HAS_EDGES
            self._link()
        except BaseException:
            self._free()
            self.stops = ()
            raise
        finally:
            PyMem_Free(shared_lens)
            PyMem_Free(path)
        return 0

    cdef int _link(self) except -1:
        """Failure links and match lengths, over the nodes in order of depth (counting sort)."""
        cdef Py_ssize_t i, max_len = self.max_stop_len
        cdef int32_t v, u
        cdef int32_t* counts = NULL
        cdef int32_t* order = NULL
        try:
            counts = <int32_t*>alloc(max_len + 2, sizeof(int32_t))
            order = <int32_t*>alloc(self.num_nodes, sizeof(int32_t))
            memset(counts, 0, (max_len + 2) * sizeof(int32_t))
            for v in range(self.num_nodes):
                counts[self.depth[v] + 1] += 1
            for i in range(1, max_len + 2):
                counts[i] += counts[i - 1]
            for v in range(self.num_nodes):
                order[counts[self.depth[v]]] = v
                counts[self.depth[v]] += 1
            for i in range(self.num_nodes):
                v = order[i]
                if self.depth[v] == 0:
                    continue
                if self.depth[v] == 1:
                    self.fail[v] = 0
                else:
                    u = self.fail[v] if (self.labels[v - 1] & LABEL_MASK) == SEPARATOR else v - 1
                    self.fail[v] = self._goto(self.fail[u], self.labels[v] & LABEL_MASK)
                if not self.match_len[v]:
                    self.match_len[v] = self.match_len[self.fail[v]]
        finally:
            PyMem_Free(counts)
            PyMem_Free(order)
        return 0

    @cython.final
    cdef int32_t _child(self, int32_t node, uint32_t char) noexcept nogil:
        """The child of node by char in the edge table, -1 if none (binary search)."""
        cdef Py_ssize_t low = 0, high = self.num_edges, mid
        while low < high:
            mid = (low + high) >> 1
            if self.edge_parents[mid] < node or (self.edge_parents[mid] == node and self.edge_chars[mid] < char):
                low = mid + 1
            else:
                high = mid
        if low < self.num_edges and self.edge_parents[low] == node and self.edge_chars[low] == char:
            return self.edge_children[low]
        return -1

    @cython.final
    cdef bint _in_alphabet(self, uint32_t char) noexcept nogil:
        """Whether some stop has char: the 1,024-bit filter, then a binary search."""
        cdef Py_ssize_t low = 0, high = self.num_alphabet, mid
        if not (self.alphabet_mask[(char >> 6) & (NUM_MASK_WORDS - 1)] >> (char & 63)) & 1:
            return False
        while low < high:
            mid = (low + high) >> 1
            if self.alphabet[mid] < char:
                low = mid + 1
            else:
                high = mid
        return low < self.num_alphabet and self.alphabet[low] == char

    @cython.final
    cdef int32_t _step(self, int32_t state, uint32_t char) noexcept nogil:
        """The state after char. A character in no stop goes to the root at once, so that
        completes_with (not amortized by later pushes) does not walk a long failure chain
        for, e.g., a held U+FFFD."""
        if not (self.alphabet_mask[(char >> 6) & (NUM_MASK_WORDS - 1)] >> (char & 63)) & 1:
            return 0  # in no stop string (the filter alone says so)
        if state != 0 and not self._in_alphabet(char):
            return 0
        return self._goto(state, char)

    @cython.final
    cdef int32_t _goto(self, int32_t state, uint32_t char) noexcept nogil:
        """The state after char: the child by char of state or of the first node on its
        failure chain that has one, else the root."""
        cdef int32_t child
        while True:
            if (self.labels[state + 1] & LABEL_MASK) == char:
                return state + 1
            if self.labels[state] & HAS_EDGES:
                child = self._child(state, char)
                if child >= 0:
                    return child
            if state == 0:
                return 0
            state = self.fail[state]

    cpdef tuple push(self, str text):
        """-> (released, is_stopped): text that can no longer be part of a stop, cut at a stop."""
        cdef Py_ssize_t i, n, num_held, num_kept
        cdef int32_t state = self.state
        cdef unsigned int kind
        cdef void* data
        if text is None:
            raise TypeError("push() needs a str, got None")
        n = len(text)
        if self.is_stopped:
            return "", True
        if not self.stops:
            return text, False
        if n == 0:
            return "", False
        kind, data = PyUnicode_KIND(text), PyUnicode_DATA(text)
        for i in range(n):
            state = self._step(state, PyUnicode_READ(kind, data, i))
            if self.match_len[state]:
                num_held = self.depth[self.state]
                return self._stop(self._held() + text, num_held + i, state)
        num_held, num_kept = self.depth[self.state], self.depth[state]
        self.state = state
        if num_held == 0 and num_kept == 0:
            return text, False
        self.held_parts.append(text)
        return self._release(num_held + n - num_kept), False

    cdef str _held(self):
        cdef str held = "".join(self.held_parts)
        return held[self.held_offset:] if self.held_offset else held

    cdef str _release(self, Py_ssize_t num_chars):
        """Takes num_chars from the front of the held text."""
        cdef list released = []
        cdef str first
        cdef Py_ssize_t num_left
        while num_chars > 0:
            first = self.held_parts[0]
            num_left = len(first) - self.held_offset
            if num_left <= num_chars:
                released.append(first[self.held_offset:] if self.held_offset else first)
                self.held_parts.popleft()
                self.held_offset = 0
                num_chars -= num_left
            else:
                released.append(first[self.held_offset : self.held_offset + num_chars])
                self.held_offset += num_chars
                num_chars = 0
        if len(released) == 1:
            return released[0]
        return "".join(released)

    cdef tuple _stop(self, str buffer, Py_ssize_t end, int32_t state):
        """A stop ends at buffer[end]. One that starts earlier (the earliest wins) ends before
        start + max_stop_len - 1: look that far for it, then cut."""
        cdef Py_ssize_t length = self.match_len[state], start = end + 1 - length, i = end + 1
        cdef unsigned int kind = PyUnicode_KIND(buffer)
        cdef void* data = PyUnicode_DATA(buffer)
        while i < min(len(buffer), start + self.max_stop_len - 1):
            state = self._step(state, PyUnicode_READ(kind, data, i))
            if self.match_len[state] and i + 1 - self.match_len[state] < start:
                length = self.match_len[state]
                start = i + 1 - length
            i += 1
        self.is_stopped = True
        self.stop_str = buffer[start : start + length]
        self.held_parts.clear()
        self.held_offset = 0
        return buffer[: start + length if self.include_stop_str else start], True

    cpdef bint completes_with(self, str tentative):
        """Whether a stop string would complete if tentative were pushed (no state change).
        Costs len(tentative) steps; as they are not amortized by later pushes, a step may walk
        the failure chain (at most max_stop_len long, and only for a character of some stop)."""
        cdef Py_ssize_t i
        cdef int32_t state = self.state
        cdef unsigned int kind
        cdef void* data
        if tentative is None:
            raise TypeError("completes_with() needs a str, got None")
        if self.is_stopped or not self.stops:
            return False
        kind, data = PyUnicode_KIND(tentative), PyUnicode_DATA(tentative)
        for i in range(len(tentative)):
            state = self._step(state, PyUnicode_READ(kind, data, i))
            if self.match_len[state]:
                return True
        return False

    cpdef str flush(self):
        """The held-back tail, at the end of a request that did not stop."""
        cdef str held = self._held()
        self.held_parts.clear()
        self.held_offset = self.state = 0
        return "" if self.is_stopped else held

    @property
    def num_held(self) -> int:
        """Characters held back."""
        return self.depth[self.state] if self.num_nodes else 0
