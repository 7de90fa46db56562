"""Which engine replica serves a prompt: the one holding the longest prefix of it, unless
that one is much busier than the least loaded.

Plain bookkeeping over replica ids, used by the Ray Serve request router
(headwise/server/ray_serve.py) and unit tested without Ray. The router sees every request it
sends (one ingress), so it knows which prefixes went where and how many requests each
replica is serving, without asking the replicas.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Sequence

# Tokens per hashed block. The engine's prefix cache keeps whole blocks too; routing only
# needs a prefix's identity, not the engine's block size.
ROUTE_BLOCK = 16
# A reservation (a replica chosen, the send not yet confirmed) counts as load this long.
RESERVE_S = 10.0


def block_hashes(ids: Sequence[int], block: int = ROUTE_BLOCK) -> list[int]:
    """One hash per whole block; each names the entire prefix up to its block's end."""
    out, h = [], 0
    for i in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[i:i + block])))  # tuples of ints hash the same in every process
        out.append(h)
    return out


class PrefixAffinity:
    """imbalance: how many more requests in flight than the least loaded replica the
    prefix's holder may have and still be chosen. min_match: the share of a prompt's blocks
    a holder must have for the prefix to count (a shared system prompt alone does not).
    max_blocks: remembered prefix blocks (least recently routed forgotten first)."""

    def __init__(self, imbalance: int = 4, min_match: float = 0.5, max_blocks: int = 1 << 20) -> None:
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.imbalance, self.min_match, self.max_blocks = imbalance, min_match, max_blocks
        self._owners: OrderedDict[int, set[str]] = OrderedDict()  # block hash -> replicas sent it
        self._blocks: Counter[str] = Counter()   # remembered blocks per replica
        self._load: Counter[str] = Counter()     # requests in flight per replica
        self._inflight: dict[str, str] = {}      # request id -> replica
        # Chosen but not yet confirmed sent: request id -> (replica, when). Requests routed at
        # the same moment must see each other, or all of them pick the same idle replica.
        self._reserved: dict[str, tuple[str, float]] = {}

    def load(self, replica: str) -> int:
        return self._loads([replica])[replica]

    def _loads(self, replicas: Sequence[str]) -> dict[str, int]:
        loads = {r: self._load[r] for r in replicas}
        now = time.monotonic()
        for rid, (r, t) in list(self._reserved.items()):
            if now - t > RESERVE_S:  # never confirmed (cancelled while routing)
                del self._reserved[rid]
            elif r in loads:
                loads[r] += 1
        return loads

    def holders(self, hashes: Sequence[int], replicas: Sequence[str]) -> tuple[set[str], int]:
        """The replicas (among `replicas`) sent the longest prefix of `hashes`, and its length
        in blocks."""
        live = set(replicas)
        best: set[str] = set()
        depth = 0
        for h in hashes:
            got = self._owners.get(h)
            got = got & live if got else None
            if not got:
                break
            best, depth = got, depth + 1
        return best, depth

    def rank(self, hashes: Sequence[int], replicas: Sequence[str]) -> list[list[str]]:
        """Replicas in order of preference, as ranks: the prefix's holder alone first when it
        qualifies, then the rest, least loaded first (ties: fewest remembered blocks, so new
        documents spread over the replicas)."""
        loads = self._loads(replicas)
        order = sorted(replicas, key=lambda r: (loads[r], self._blocks[r], r))
        if not order:
            return []
        holders, depth = self.holders(hashes, order)
        least = loads[order[0]]
        if hashes and depth >= self.min_match * len(hashes):
            fit = [r for r in order if r in holders and loads[r] - least <= self.imbalance]
            if fit:
                return [[fit[0]]] + ([[r for r in order if r != fit[0]]] if len(order) > 1 else [])
        return [[order[0]]] + ([order[1:]] if len(order) > 1 else [])

    def reserve(self, request_id: str, replica: str) -> None:
        """`replica` is about to get the request (it counts as load until routed/completed)."""
        self._reserved[request_id] = (replica, time.monotonic())

    def routed(self, request_id: str, replica: str, hashes: Sequence[int]) -> None:
        """The request went to `replica`, which now holds its prefix."""
        self._reserved.pop(request_id, None)
        if request_id in self._inflight:  # re-sent (a retry)
            self._load[self._inflight[request_id]] -= 1
        self._inflight[request_id] = replica
        self._load[replica] += 1
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            if replica not in owners:
                owners.add(replica)
                self._blocks[replica] += 1
        while len(self._owners) > self.max_blocks:
            _, gone = self._owners.popitem(last=False)
            for r in gone:
                self._blocks[r] -= 1

    def completed(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        replica = self._inflight.pop(request_id, None)
        if replica is not None:
            self._load[replica] -= 1

    def forget(self, replica: str) -> None:
        """A replica is gone (died, scaled down): its cache went with it."""
        for h in [h for h, owners in self._owners.items() if replica in owners]:
            owners = self._owners[h]
            owners.discard(replica)
            if not owners:
                del self._owners[h]
        self._blocks.pop(replica, None)
        self._load.pop(replica, None)
        for rid in [rid for rid, r in self._inflight.items() if r == replica]:
            del self._inflight[rid]
        for rid in [rid for rid, (r, _) in self._reserved.items() if r == replica]:
            del self._reserved[rid]
