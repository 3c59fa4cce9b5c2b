"""Paged KV cache bookkeeping: a free list with reference counts and a prefix cache.

Blocks hold ``block_size`` tokens of K/V. A block is in exactly one of three states:
free (ref 0, no hash), referenced (ref >= 1) or cached (ref 0 with a hash: its K/V are
kept for a future request with the same prefix, evicted least recently used first when a
new block is needed). Full prompt blocks are hashed by (parent hash, their token ids), so a
hash names a whole prefix. The hash is a 128-bit blake2b, the same in every process: the
disk tier (engine/core/prefix_disk.py) names its files by it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


def hash_block(parent_hash: int | None, token_ids: np.ndarray) -> int:
    """Hash of a full block ([block_size] int32 ids) given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(16, "little"))
    h.update(token_ids.astype("<i4", copy=False).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: np.ndarray, num_blocks: int, block_size: int) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` ([N] int32)."""
    hashes = []
    parent = None
    for k in range(num_blocks):
        parent = hash_block(parent, token_ids[k * block_size : (k + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free ones and unreferenced cached ones)."""
        return len(self.free_ids) + len(self.cached_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    # -- allocation --

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        ids = []
        for _ in range(num_blocks):
            if self.free_ids:
                block_id = self.free_ids.popleft()
            else:
                block_id, _ = self.cached_ids.popitem(last=False)
                del self.hash_to_block[self.block_hashes[block_id]]
                self.block_hashes[block_id] = None
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Freed in reverse so a prefix's tail is evicted first."""
        for block_id in reversed(block_ids):
            ref = self.ref_counts[block_id] - 1
            if ref < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = ref
            if ref == 0:
                if self.block_hashes[block_id] is not None:
                    self.cached_ids[block_id] = None
                else:
                    self.free_ids.append(block_id)

    # -- prefix cache --

    def match_prefix(self, block_hashes: list[int]) -> list[int]:
        """Ids of the cached blocks holding the longest cached prefix (no references taken)."""
        ids = []
        if not self.enable_prefix_caching:
            return ids
        for h in block_hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def num_unreferenced(self, block_ids: list[int]) -> int:
        """How many of these cached blocks count as free now (taking them uses up free capacity)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each of these cached blocks."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_ids[block_id]
            self.ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: int) -> bool:
        """Publish a fully computed block under its prefix hash (first writer wins); True if published."""
        if not self.enable_prefix_caching or block_hash in self.hash_to_block:
            return False
        if self.block_hashes[block_id] is not None:
            return False
        self.block_hashes[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        num = len(self.cached_ids)
        for block_id in self.cached_ids:
            del self.hash_to_block[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
            self.free_ids.append(block_id)
        self.cached_ids.clear()
        return num

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise if the free list, cache and reference counts disagree (for tests)."""
        free = set(self.free_ids)
        cached = set(self.cached_ids)
        if len(free) != len(self.free_ids) or free & cached:
            raise RuntimeError("a block is listed twice among free and cached blocks")
        for block_id in range(self.num_blocks):
            ref = self.ref_counts[block_id]
            in_lists = (block_id in free) + (block_id in cached)
            if (ref == 0) != (in_lists == 1) or ref < 0:
                raise RuntimeError(f"block {block_id}: ref {ref} but listed {in_lists} times")
            if block_id in cached and self.block_hashes[block_id] is None:
                raise RuntimeError(f"cached block {block_id} has no hash")
            if block_id in free and self.block_hashes[block_id] is not None:
                raise RuntimeError(f"free block {block_id} still has a hash")
        for h, block_id in self.hash_to_block.items():
            if self.block_hashes[block_id] != h:
                raise RuntimeError(f"hash table points at block {block_id} with another hash")
        if expected_refs is not None:
            for block_id in range(self.num_blocks):
                if self.ref_counts[block_id] != expected_refs.get(block_id, 0):
                    raise RuntimeError(
                        f"block {block_id}: ref {self.ref_counts[block_id]}, "
                        f"block tables hold it {expected_refs.get(block_id, 0)} times"
                    )
