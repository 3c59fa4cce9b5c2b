"""Prefix-affine routing for Ray Serve: a request goes to the replica that served its prefix last.

Ray Serve's request-router extension point (``RequestRouter`` in ``request_router_config``)
asks ``choose_replicas`` for ranks of replicas; within a rank Ray takes the replica with the
shortest queue, and moves to the next rank when every replica of a rank is full. This router:

- cuts the request's prompt into blocks (``prefix_keys``: characters of the rendered
  messages or prompt text, or token ids) and chains a hash over them, so key i stands for
  the whole prefix up to block i, as the engine's prefix cache keys its KV blocks;
- remembers, for each key, the replica it routed that prefix to last (``PrefixTable``: a
  bounded LRU map, linear in the prompt per request);
- ranks the replica of the longest remembered prefix first and all the others second, unless
  that replica's queue is longer than the shortest one by more than ``imbalance_threshold``:
  then, as with no match, one rank of all replicas (Ray picks the least loaded).

The table lives in the router, which lives in the caller's process (the ingress replica):
with several ingress replicas, each learns its own table (docs/scale-out.md).
It also keeps the replicas it was given, so the ingress can read their ``routing_stats``
(each engine replica's ``record_routing_stats``: its engine stats) for /metrics.
"""
from __future__ import annotations

import collections

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_CHARS = 64  # ~16 tokens of English text: one engine KV block (block_size 16)
BLOCK_IDS = 16
MAX_KEYS = 1 << 17  # remembered prefix blocks (one dict entry each, ~150 bytes)
DEFAULT_IMBALANCE_THRESHOLD = 8  # queued+running requests a preferred replica may have beyond the least loaded

def prompt_text(req) -> str | list[int]:
    """What the prefix cache sees first: the rendered messages (role, content), or the first prompt."""
    if req.messages is not None:
        return "".join(f"\x1e{m.get('role', '')}\x1f{m.get('content') or ''}" for m in req.messages)
    return req.prompts[0] if req.prompts else ""


def prefix_keys(prompt: str | list[int]) -> list[int]:
    """Chained hashes of the prompt's whole blocks: key i identifies the prefix of blocks 0..i."""
    step = BLOCK_IDS if isinstance(prompt, list) else BLOCK_CHARS
    keys, key = [], 0
    for start in range(0, len(prompt) - step + 1, step):
        block = prompt[start:start + step]
        key = hash((key, block if isinstance(block, str) else tuple(block)))
        keys.append(key)
    return keys


class PrefixTable:
    """Prefix key -> the replica id it was routed to last; least recently used keys are forgotten."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._owner: collections.OrderedDict[int, ReplicaID] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, keys: list[int], live_ids: set) -> tuple[ReplicaID | None, int]:
        """The live replica holding the longest prefix of ``keys``, and how many blocks it matched."""
        best, num_matched = None, 0
        for depth, key in enumerate(keys, start=1):
            owner = self._owner.get(key)
            if owner is None:
                break
            if owner in live_ids:
                best, num_matched = owner, depth
        return best, num_matched

    def record(self, keys: list[int], replica_id: ReplicaID) -> None:
        """Deepest key first, so a prefix's first blocks are its most recently used: eviction
        shortens a remembered prefix from its end, never leaves a tail without its head."""
        owner = self._owner
        for key in reversed(keys):
            owner[key] = replica_id
            owner.move_to_end(key)
        while len(owner) > self.max_keys:
            owner.popitem(last=False)

    def forget(self, replica_id: ReplicaID) -> None:
        for key in [k for k, r in self._owner.items() if r == replica_id]:
            del self._owner[key]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """``request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter)``."""

    def initialize_state(self, is_affine: bool = True, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_keys: int = MAX_KEYS):
        """``is_affine=False``: least-loaded only (the baseline the hit rate is measured against)."""
        self.is_affine = is_affine
        self.imbalance_threshold = imbalance_threshold
        self.table = PrefixTable(max_keys)
        self.num_routed = 0
        self.num_affine = 0  # routed to the replica of a remembered prefix
        self.replicas: list[RunningReplica] = []
        # Ray ships this module to the ingress by value (a copy of its globals): the registry the
        # ingress reads lives in a module imported by reference.
        from webapp.ray_ingress import register_router

        register_router(self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.replicas = list(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.replicas = [r for r in self.replicas if r.replica_id != replica_id]
        self.table.forget(replica_id)

    def _keys(self, pending_request: PendingRequest | None) -> list[int]:
        if not self.is_affine or pending_request is None or not pending_request.args:
            return []
        req = pending_request.args[0]
        if not hasattr(req, "messages"):  # not a generation request (tokenize, health): no affinity
            return []
        return prefix_keys(prompt_text(req))

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        keys = self._keys(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner_id, _ = self.table.longest_match(keys, set(by_id)) if keys else (None, 0)
        if owner_id is not None:
            owner = by_id[owner_id]
            least = min(self._queue_len(r) for r in candidate_replicas)
            if self._queue_len(owner) - least <= self.imbalance_threshold:
                return [[owner], [r for r in candidate_replicas if r.replica_id != owner_id]]
        return [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = self._keys(pending_request)
        if not keys:
            return
        self.num_routed += 1
        owner_id, _ = self.table.longest_match(keys, {replica_id})
        if owner_id is not None:
            self.num_affine += 1
        self.table.record(keys, replica_id)

    def replica_stats(self) -> list[dict]:
        """Each known replica's last ``routing_stats`` (its engine's stats, refreshed by Ray)."""
        return [dict(r.routing_stats or {}) for r in self.replicas]
