"""BlockManager: free list, reference counts, prefix hashes, LRU eviction of cached blocks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, hash_block, prefix_block_hashes


def test_allocate_and_free_round_trip():
    bm = BlockManager(4, 16)
    ids = bm.allocate(3)
    assert ids == [0, 1, 2] and bm.num_free_blocks == 1 and bm.num_used_blocks == 3
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    bm.free(ids)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([0])
    bm.check_invariants()


def test_hashes_chain_over_the_prefix():
    a = np.arange(32, dtype=np.int32)
    b = a.copy()
    b[0] = 99  # first block differs: the second block's hash differs too
    ha, hb = prefix_block_hashes(a, 2, 16), prefix_block_hashes(b, 2, 16)
    assert ha[0] != hb[0] and ha[1] != hb[1]
    assert ha[1] == hash_block(ha[0], a[16:32])
    assert prefix_block_hashes(a, 2, 16) == ha


def test_prefix_match_take_and_lru_eviction():
    bm = BlockManager(4, 2)
    tokens = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    hashes = prefix_block_hashes(tokens, 3, 2)
    ids = bm.allocate(3)
    for b, h in zip(ids, hashes):
        bm.register(b, h)
    assert bm.match_prefix(hashes) == ids
    assert bm.match_prefix([hashes[0], 12345, hashes[2]]) == ids[:1]
    bm.free(ids)  # cached, unreferenced: they still count as free
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3
    assert bm.num_unreferenced(ids[:2]) == 2
    bm.take(ids[:2])  # a new request reuses the first two blocks
    assert bm.ref_counts[ids[0]] == 1 and bm.num_free_blocks == 2
    bm.check_invariants({ids[0]: 1, ids[1]: 1})
    # Two new blocks: the free one first, then the least recently freed cached one (the tail).
    new = bm.allocate(2)
    assert new == [3, ids[2]] and bm.num_evictions == 1
    assert bm.match_prefix(hashes) == ids[:2]
    bm.free(new)
    bm.free(ids[:2])
    bm.check_invariants()
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 4


def test_register_first_writer_wins_and_caching_off():
    bm = BlockManager(3, 2)
    a, b = bm.allocate(2)
    bm.register(a, 7)
    bm.register(b, 7)  # same content computed twice: b stays a plain block
    assert bm.match_prefix([7]) == [a] and bm.block_hashes[b] is None
    bm.free([a, b])
    assert list(bm.free_ids) == [2, b] and list(bm.cached_ids) == [a]
    off = BlockManager(2, 2, enable_prefix_caching=False)
    (c,) = off.allocate(1)
    off.register(c, 7)
    assert off.match_prefix([7]) == [] and off.num_cached_blocks == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5), st.integers(0, 3)),
                max_size=60))
def test_random_ops_keep_counts_consistent(ops):
    bm = BlockManager(8, 1)
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    for op, n, pick in ops:
        if op == "alloc" and bm.can_allocate(n):
            ids = bm.allocate(n)
            if pick:  # some owners publish their blocks to the prefix cache
                for b in ids:
                    bm.register(b, hash((len(owners), b)))
            owners.append(ids)
        elif op == "free" and owners:
            bm.free(owners.pop(pick % len(owners)))
        elif op == "share" and owners:
            ids = [b for b in owners[pick % len(owners)] if bm.block_hashes[b] is not None]
            if bm.num_unreferenced(ids) <= bm.num_free_blocks:
                bm.take(ids)
                owners.append(ids)
        refs: dict[int, int] = {}
        for ids in owners:
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        bm.check_invariants(refs)
        assert bm.num_used_blocks == len(refs)
    for ids in owners:
        bm.free(ids)
    assert bm.num_free_blocks == 8
    bm.check_invariants()
