"""Physical block ids with a FIFO free queue (freed blocks are reused last)."""
from __future__ import annotations

from collections import deque

from headwise.cache.pool import CacheFullError


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(ids)
