"""Books of the paged pool, where the heads of the paged classes (full, select) keep
every token: which blocks each sequence holds.

One block holds `block_size` tokens for every paged KV head of every layer, so a sequence
needs a single block table. A table may start with blocks shared with other sequences
(a prefix-cache hit); every block is released exactly once per holder. No tensors here:
the runner owns the storage.
"""
from __future__ import annotations

from headwise.cache.block_pool import BlockPool, id_runs


class PagedPool:
    def __init__(self, blocks: BlockPool, block_size: int, block_bytes: int) -> None:
        self.block_size = block_size
        self.block_bytes = block_bytes  # 0 when the layout has no paged head
        self.blocks = blocks            # shared with window-state snapshots
        self.tables: dict[int, list[int]] = {}
        # Per sequence, its blocks as maximal runs of consecutive ids: [first_block, count].
        # Decode attends over each run as a slice of the pool, with no gather.
        self._runs: dict[int, list[list[int]]] = {}

    @property
    def active(self) -> bool:
        return self.block_bytes > 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.active else 0

    def can_allocate(self, num_tokens: int, shared: list[int] = (), extra: int = 0) -> bool:
        """Room for a sequence of `num_tokens` whose first blocks are `shared` (cached),
        plus `extra` pages taken from the free queues for it (window-state snapshots):
        shared blocks nobody holds now leave the free queues too."""
        idle = sum(self.blocks.is_free(b) for b in shared)
        return self.blocks_for(num_tokens) - len(shared) + idle + extra <= self.blocks.num_free

    def to_grow(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a sequence still has to take to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def allocate(self, seq_id: int, num_tokens: int, head: list[int] = ()) -> None:
        """head: the blocks its table starts with, already held for it by the caller
        (cached blocks it shares, blocks filled from the disk tier)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        self.tables[seq_id] = []
        self._runs[seq_id] = []
        self._extend(seq_id, list(head))
        self._extend(seq_id, self.blocks.take(max(0, self.blocks_for(num_tokens) - len(head))))

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(self.tables[seq_id])
        return need <= self.blocks.num_free

    def append(self, seq_id: int, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(self.tables[seq_id])
        if need > 0:
            self._extend(seq_id, self.blocks.take(need))

    def _extend(self, seq_id: int, ids: list[int]) -> None:
        self.tables[seq_id].extend(ids)
        runs = self._runs[seq_id]
        for first, _, n in id_runs(ids):
            if runs and runs[-1][0] + runs[-1][1] == first:  # continues the last run
                runs[-1][1] += n
            else:
                runs.append([first, n])

    def free(self, seq_id: int) -> None:
        # Last block first: a sequence's tail is evicted before its prefix (LRU order).
        self.blocks.release(self.pop(seq_id)[::-1])

    def pop(self, seq_id: int) -> list[int]:
        """Forget a sequence's table without releasing its blocks (the caller does)."""
        self._runs.pop(seq_id, None)
        return self.tables.pop(seq_id, [])

    def slot_runs(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Positions [0, num_tokens) as (first flat slot, length) runs of contiguous slots."""
        out, left, bs = [], num_tokens, self.block_size
        for first, count in self._runs[seq_id]:
            n = min(left, count * bs)
            out.append((first * bs, n))
            left -= n
            if left <= 0:
                break
        return out

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot ids (block * block_size + offset) of positions [start, end)."""
        if not self.active:
            return [0] * (end - start)
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def bytes_for(self, num_tokens: int) -> int:
        return self.blocks_for(num_tokens) * self.block_bytes

    def max_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size if self.active else 1 << 62

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks some sequence holds (cached, unheld blocks count as free)."""
        return (self.blocks.num_blocks - self.blocks.num_free) * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.blocks.num_blocks * self.block_bytes
