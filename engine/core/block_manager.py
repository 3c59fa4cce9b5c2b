"""Paged KV cache bookkeeping: a free list with reference counts and a prefix cache.

Blocks hold ``block_size`` tokens of K/V. A block is in exactly one of three states:
free (ref 0, no hash), referenced (ref >= 1) or cached (ref 0 with a hash: its K/V are
kept for a future request with the same prefix, evicted least recently used first when a
new block is needed). Full prompt blocks are hashed by (parent hash, their token ids), so a
hash names a whole prefix. The hash is a 128-bit blake2b, the same in every process: the
disk tier (engine/core/prefix_disk.py) names its files by it.

Sliding-window layers (Gemma 2/3, Mistral): a block's K/V in those layers is needed only while
some sequence holding it can still attend to it. ``window_refs`` counts the sequences that may
(a reference taken with the block, given up by ``release_window`` once the sequence's next
query is past the block's window); at zero the block's sliding K/V is dropped (its pages go
back to the OS, engine.models.attention) and the block is marked ``is_window_dropped`` until it
is allocated again. Its other layers stay, so a prefix-cache match must end where the window
before it is intact (``match_prefix``). A finished sequence's last window keeps its sliding K/V
for such a match, but only while it is among the ``max_kept_windows`` most recent such blocks
(least recently kept dropped first); a freed block no match can find (no hash) drops it at
once. So the sliding layers hold at most the running sequences' windows plus that many blocks,
whatever the traffic: engine.models.llama.kv_cache_bytes counts them so.
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, max_kept_windows: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.max_kept_windows = max_kept_windows  # None: every finished window is kept
        # unreferenced windows (window_refs 0, sliding K/V still there), least recently kept first
        self.kept_windows: OrderedDict[int, None] = OrderedDict()
        self.ref_counts = [0] * num_blocks
        self.window_refs = [0] * num_blocks  # references that may still read the sliding layers' K/V
        self.is_window_dropped = [False] * num_blocks
        self.dropped_ids: list[int] = []  # dropped since the owner last took them (drain_dropped)
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
            self.window_refs[block_id] = 1
            self.is_window_dropped[block_id] = False
            self.kept_windows.pop(block_id, None)
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int], num_window_released: int = 0) -> None:
        """Drop one reference from each block (and its window reference, unless it is among the
        first ``num_window_released``, given up before). Freed in reverse so a prefix's tail is
        evicted first. A window reference given up here keeps the block's sliding K/V for a
        prefix-cache match when the block has a hash (up to max_kept_windows such blocks), and
        drops it otherwise."""
        for k in range(len(block_ids) - 1, -1, -1):
            block_id = block_ids[k]
            ref = self.ref_counts[block_id] - 1
            if ref < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = ref
            if k >= num_window_released:
                self.window_refs[block_id] -= 1
                if self.window_refs[block_id] == 0 and self.sliding_window is not None:
                    self._keep_window(block_id)
            if ref == 0:
                if self.block_hashes[block_id] is not None:
                    self.cached_ids[block_id] = None
                else:
                    self.free_ids.append(block_id)

    def _keep_window(self, block_id: int) -> None:
        """A block's last window reference went with a finished sequence: keep its sliding K/V
        for a match (a hash), dropping the least recently kept beyond max_kept_windows."""
        if self.block_hashes[block_id] is None:
            self._drop_window(block_id)
            return
        self.kept_windows[block_id] = None
        if self.max_kept_windows is not None:
            while len(self.kept_windows) > self.max_kept_windows:
                oldest, _ = self.kept_windows.popitem(last=False)
                self._drop_window(oldest)

    def _drop_window(self, block_id: int) -> None:
        self.kept_windows.pop(block_id, None)
        if not self.is_window_dropped[block_id]:
            self.is_window_dropped[block_id] = True
            self.dropped_ids.append(block_id)

    def release_window(self, block_id: int) -> None:
        """A sequence's next query is past this block's window: give up its window reference;
        the last one marks the block's sliding K/V dropped (``drain_dropped`` hands them out)."""
        refs = self.window_refs[block_id] - 1
        if refs < 0:
            raise RuntimeError(f"block {block_id}: window released more often than taken")
        self.window_refs[block_id] = refs
        if refs == 0:
            self._drop_window(block_id)

    def drain_dropped(self) -> list[int]:
        """Blocks whose sliding K/V became unneeded since the last call (for the cache to drop)."""
        ids, self.dropped_ids = self.dropped_ids, []
        return ids

    # -- prefix cache --

    def match_prefix(self, block_hashes: list[int]) -> list[int]:
        """Ids of the cached blocks holding the longest usable cached prefix (no references
        taken): with a sliding window, the longest whose last window of blocks kept its
        sliding K/V (the next query attends to it)."""
        ids = []
        if not self.enable_prefix_caching:
            return ids
        for h in block_hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        if self.sliding_window is None:
            return ids
        num_dropped = 0  # dropped blocks among ids[:n] (a running count: linear in the match)
        dropped_before = [0]
        for block_id in ids:
            num_dropped += self.is_window_dropped[block_id]
            dropped_before.append(num_dropped)
        for n in range(len(ids), 0, -1):
            # The query at position n * bs reads keys from n * bs - window + 1 on.
            first = max(0, (n * self.block_size - self.sliding_window + 1) // self.block_size)
            if dropped_before[n] == dropped_before[first]:
                return ids[:n]
        return []

    def num_unreferenced(self, block_ids: list[int]) -> int:
        """How many of these cached blocks count as free now (taking them uses up free capacity)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each of these cached blocks."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_ids[block_id]
            self.ref_counts[block_id] += 1
            self.window_refs[block_id] += 1
            self.kept_windows.pop(block_id, None)

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
            if block_id in self.kept_windows:  # no match can find it now
                self._drop_window(block_id)
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
            if not 0 <= self.window_refs[block_id] <= ref:
                raise RuntimeError(f"block {block_id}: {self.window_refs[block_id]} window refs, ref {ref}")
        for block_id in self.kept_windows:
            if self.window_refs[block_id] or self.is_window_dropped[block_id] or self.block_hashes[block_id] is None:
                raise RuntimeError(f"kept window {block_id}: window refs {self.window_refs[block_id]}, dropped "
                                   f"{self.is_window_dropped[block_id]}, hash {self.block_hashes[block_id]}")
        if self.max_kept_windows is not None and len(self.kept_windows) > self.max_kept_windows:
            raise RuntimeError(f"{len(self.kept_windows)} kept windows, more than {self.max_kept_windows}")
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
