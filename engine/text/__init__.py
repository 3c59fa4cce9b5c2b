"""Generated ids to text: byte-exact incremental detokenization and stop strings.

- ``detokenizer``: ``IncrementalDetokenizer`` (O(1) per token; public at ``engine.detokenizer``).
- ``stops``: ``StopMatcher``, one Aho-Corasick automaton over a request's stop strings.
- ``text_stream``: ``TextStream``, the two together: one request's text pipeline.
"""
