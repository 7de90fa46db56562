"""Physical pages with reference counts, cache keys and an eviction order.

A page is a full-head block, or a part of a window-state snapshot (see prefix_cache).
Free pages sit in two queues: `low` (speculative snapshots, evicted first) and the main
LRU queue (a page joins its tail when its last user releases it). `take` pops from the
heads, so never-used pages go first, then the least recently released; a page taken
while it still carries a cache key is evicted: the owner of the key is told through
`on_evict`, so a cached prefix stays hit-able exactly until its pages are reused.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Hashable

from headwise.cache.pool import CacheFullError

# A page key is (kind, value): kind "b" for a full-head block (value: its chained hash),
# "s" for a page of a window-state snapshot (value: the snapshot's key).
PageKey = tuple[str, Hashable]


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[PageKey], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[PageKey | None] = [None] * num_blocks
        self._low: OrderedDict[int, None] = OrderedDict()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict = on_evict
        # Free pages that still carry a key, by kind: bytes held by cached, unused prefixes.
        self.cached_free: Counter[str] = Counter()

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: unused ones and cached ones nobody holds."""
        return len(self._low) + len(self._free)

    def is_free(self, b: int) -> bool:
        return self.ref[b] == 0

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise CacheFullError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            q = self._low if self._low else self._free
            b, _ = q.popitem(last=False)
            if self.key[b] is not None:
                self._evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, ids: list[int]) -> None:
        """One more user of each page (a cache hit); a free page leaves the free queues."""
        for b in ids:
            if self.ref[b] == 0:
                self._unfree(b)
            self.ref[b] += 1

    def release(self, ids: list[int], low: bool = False) -> None:
        """One user fewer; a page nobody uses joins the tail of the LRU queue (or of the
        low-priority queue), keeping its key."""
        for b in ids:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self._low if low else self._free)[b] = None
                if self.key[b] is not None:
                    self.cached_free[self.key[b][0]] += 1

    def give_back(self, ids: list[int]) -> None:
        self.release(ids)

    def set_key(self, b: int, key: PageKey | None) -> None:
        old = self.key[b]
        if self.ref[b] == 0:
            if old is not None:
                self.cached_free[old[0]] -= 1
            if key is not None:
                self.cached_free[key[0]] += 1
        self.key[b] = key

    def demote(self, ids: list[int]) -> None:
        """Free pages to the head of the queues: reused before anything else."""
        for b in ids:
            if self.ref[b] == 0:
                self._unfree(b)
                self._low[b] = None
                self._low.move_to_end(b, last=False)
                if self.key[b] is not None:
                    self.cached_free[self.key[b][0]] += 1

    def promote(self, ids: list[int]) -> None:
        """Free pages in the low-priority queue move to the tail of the LRU queue."""
        for b in ids:
            if b in self._low:
                del self._low[b]
                self._free[b] = None

    def _unfree(self, b: int) -> None:
        if b in self._low:
            del self._low[b]
        else:
            del self._free[b]
        if self.key[b] is not None:
            self.cached_free[self.key[b][0]] -= 1

    def _evict(self, b: int) -> None:
        key = self.key[b]
        self.key[b] = None
        self.cached_free[key[0]] -= 1
        if self.on_evict is not None:
            self.on_evict(key)

    def check(self) -> None:
        """Assert the books are consistent (tests): every page is free xor referenced."""
        free = set(self._low) | set(self._free)
        assert len(free) == len(self._low) + len(self._free), "a page is in both free queues"
        for b in range(self.num_blocks):
            assert (b in free) == (self.ref[b] == 0), f"block {b}: ref {self.ref[b]}, free {b in free}"
        counts = Counter(self.key[b][0] for b in free if self.key[b] is not None)
        assert +counts == +self.cached_free, (counts, self.cached_free)
