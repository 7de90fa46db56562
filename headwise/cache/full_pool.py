"""Paged storage for full heads only.

One block holds `block_size` tokens for every full KV head of every layer, so a sequence
needs a single block table. Storage is head-major, [F, num_blocks * block_size, D] for K
and for V, where F is the total number of full heads over all layers; layer l's view is
the contiguous slice of its own full heads. Window heads take no space here.
"""
from __future__ import annotations

import torch

from headwise.cache.block_pool import BlockPool


class FullHeadPool:
    def __init__(self, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.num_heads = num_heads
        self.blocks = BlockPool(num_blocks if num_heads else 0)
        self.tables: dict[int, list[int]] = {}
        # Per sequence, its blocks as maximal runs of consecutive ids: [first_block, count].
        # Decode attends over each run as a slice of the pool, with no gather.
        self._runs: dict[int, list[list[int]]] = {}
        esize = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = 2 * num_heads * block_size * head_dim * esize
        slots = self.blocks.num_blocks * block_size
        self.k = torch.zeros(num_heads, slots, head_dim, dtype=dtype, device=device)  # [F, slots, D]
        self.v = torch.zeros(num_heads, slots, head_dim, dtype=dtype, device=device)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.num_heads else 0

    def can_allocate(self, num_tokens: int) -> bool:
        return self._blocks_for(num_tokens) <= self.blocks.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        self.tables[seq_id] = []
        self._runs[seq_id] = []
        self._extend(seq_id, self.blocks.take(self._blocks_for(num_tokens)))

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        need = self._blocks_for(num_tokens) - len(self.tables[seq_id])
        return need <= self.blocks.num_free

    def append(self, seq_id: int, num_tokens: int) -> None:
        table = self.tables[seq_id]
        need = self._blocks_for(num_tokens) - len(table)
        if need > 0:
            self._extend(seq_id, self.blocks.take(need))

    def _extend(self, seq_id: int, ids: list[int]) -> None:
        self.tables[seq_id].extend(ids)
        runs = self._runs[seq_id]
        for b in ids:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])

    def free(self, seq_id: int) -> None:
        self._runs.pop(seq_id, None)
        self.blocks.give_back(self.tables.pop(seq_id, []))

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

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) of a sequence."""
        table = torch.tensor(self.tables[seq_id], dtype=torch.int64)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def bytes_for(self, num_tokens: int) -> int:
        return self._blocks_for(num_tokens) * self.block_bytes

    def max_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size if self.num_heads else 1 << 62

    @property
    def used_bytes(self) -> int:
        return (self.blocks.num_blocks - self.blocks.num_free) * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.blocks.num_blocks * self.block_bytes

