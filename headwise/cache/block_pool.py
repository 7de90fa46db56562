"""Physical pages with reference counts, cache keys and an eviction order.

A page is a full-head block, or a part of a window-state snapshot (see prefix_cache).
Free pages sit in three queues, taken in this order: pages holding nothing cached,
then cached pages of low priority (speculative snapshots), then cached pages in LRU
order (a page joins the tail when its last user releases it). A page taken while it
still carries a cache key is evicted: the owner of the key is told through `on_evict`,
so a cached prefix stays hit-able exactly until its pages are reused.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from enum import StrEnum
from typing import Callable, Hashable

from headwise.cache.pool import CacheFullError


class PageKind(StrEnum):
    """What a cached page holds. The values name the disk tier's files: never change them."""
    BLOCK = "b"      # a full-head block; the key's value is its chained hash
    SNAPSHOT = "s"   # a page of a window-state snapshot; the key's value is the snapshot's key


# A page key is (kind, value).
PageKey = tuple[PageKind, Hashable]


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[PageKey], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[PageKey | None] = [None] * num_blocks
        self._low_priority = [False] * num_blocks
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._low: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.on_evict = on_evict
        # Free pages that still carry a key, by kind: bytes held by cached, unused prefixes.
        self.cached_free: Counter[str] = Counter()

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: unused ones and cached ones nobody holds."""
        return len(self._empty) + len(self._low) + len(self._lru)

    @property
    def num_spare(self) -> int:
        """Free pages whose reuse evicts nothing of normal priority."""
        return len(self._empty) + len(self._low)

    def is_free(self, b: int) -> bool:
        return self.ref[b] == 0

    def take(self, n: int, high: bool = False) -> list[int]:
        """n pages, ascending. high: unused pages from the high end of the id range
        (window-state snapshots), so that they do not land between a sequence's blocks,
        which low ids fill in order: decode then reads a sequence in few runs."""
        if n > self.num_free:
            raise CacheFullError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            q = self._empty or self._low or self._lru
            b, _ = q.popitem(last=high and q is self._empty)
            if self.key[b] is not None:
                key = self.key[b]
                self.key[b] = None
                self.cached_free[key[0]] -= 1
                if self.on_evict is not None:
                    self.on_evict(key)
            self.ref[b] = 1
            out.append(b)
        # Ascending: a table's blocks then form long runs of adjacent ids, which decode
        # reads as one view each (freed blocks come back tail first, i.e. descending).
        return sorted(out)

    def touch(self, ids: list[int]) -> None:
        """One more user of each page (a cache hit); a free page leaves the free queues."""
        for b in ids:
            if self.ref[b] == 0:
                self._unqueue(b)
            self.ref[b] += 1

    def release(self, ids: list[int], low: bool = False) -> None:
        """One user fewer; a page nobody uses joins the tail of its free queue (cached
        pages of low priority: the low queue), keeping its key."""
        for b in ids:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._low_priority[b] = low
                self._enqueue(b)

    def set_key(self, b: int, key: PageKey | None) -> None:
        if self.ref[b] == 0:
            self._unqueue(b)
            self.key[b] = key
            self._enqueue(b)
        else:
            self.key[b] = key

    def refresh(self, ids: list[int]) -> None:
        """Cached free pages move to the tail of the LRU queue (as if just released)."""
        for b in ids:
            if b in self._lru:
                self._lru.move_to_end(b)

    def promote(self, ids: list[int]) -> None:
        """Cached pages stop being low priority (free ones move to the LRU tail)."""
        for b in ids:
            if self._low_priority[b]:
                self._set_low_priority(b, False)

    def demote(self, ids: list[int]) -> None:
        """Cached pages become low priority (evicted before the LRU queue)."""
        for b in ids:
            if not self._low_priority[b]:
                self._set_low_priority(b, True)

    def _set_low_priority(self, b: int, low: bool) -> None:
        if self.ref[b] == 0:
            self._unqueue(b)
            self._low_priority[b] = low
            self._enqueue(b)
        else:
            self._low_priority[b] = low

    def _enqueue(self, b: int) -> None:
        key = self.key[b]
        if key is None:
            self._empty[b] = None
            return
        (self._low if self._low_priority[b] else self._lru)[b] = None
        self.cached_free[key[0]] += 1

    def _unqueue(self, b: int) -> None:
        for q in (self._empty, self._low, self._lru):
            if b in q:
                del q[b]
                break
        if self.key[b] is not None:
            self.cached_free[self.key[b][0]] -= 1

    def check(self) -> None:
        """Assert the books are consistent (tests): every page is free xor referenced,
        and sits in the free queue its key says."""
        queues = (self._empty, self._low, self._lru)
        free = [b for q in queues for b in q]
        assert len(free) == len(set(free)), "a page is in two free queues"
        free = set(free)
        for b in range(self.num_blocks):
            assert (b in free) == (self.ref[b] == 0), f"block {b}: ref {self.ref[b]}, free {b in free}"
        assert all(self.key[b] is None for b in self._empty)
        assert all(self.key[b] is not None for q in queues[1:] for b in q)
        counts = Counter(self.key[b][0] for q in queues[1:] for b in q)
        assert +counts == +self.cached_free, (counts, self.cached_free)


def id_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, its index in `ids`, length) of each maximal run of consecutive ids. The
    pool hands blocks out in ascending runs (take), so a table or snapshot has few."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((b, i, 1))
    return out
