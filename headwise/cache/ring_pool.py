"""Fixed-size rings for window heads: one slot per running sequence.

A slot holds, for every window head of every layer, sink + window token positions, so
its size does not depend on the prompt length. Storage is one flat buffer laid out group
by group: each (layer, window group) owns a contiguous [2, num_slots, n_heads,
sink + window, D] block, so decode can run one batched matmul over all slots of a group
without gathering them.
"""
from __future__ import annotations

from collections import deque

import torch

from headwise.cache.pool import CacheFullError


class RingPool:
    def __init__(self, num_slots: int, elems_per_seq: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.elems_per_seq = elems_per_seq
        self.num_slots = num_slots if elems_per_seq else 0
        self._free: deque[int] = deque(range(self.num_slots))
        self.slot_of: dict[int, int] = {}
        esize = torch.empty((), dtype=dtype).element_size()
        self.seq_bytes = 2 * elems_per_seq * esize
        self.storage = torch.zeros(2 * self.num_slots * elems_per_seq, dtype=dtype, device=device)

    def can_allocate(self, num_tokens: int) -> bool:
        return not self.elems_per_seq or bool(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if not self.elems_per_seq:
            return
        if not self._free:
            raise CacheFullError("window-head ring pool has no free slot")
        self.slot_of[seq_id] = self._free.popleft()

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return True  # constant size

    def append(self, seq_id: int, num_tokens: int) -> None:
        pass

    def free(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq_id: int) -> int:
        return self.slot_of.get(seq_id, 0)

    def view(self, kv: int, offset: int, n_heads: int, ring: int, head_dim: int) -> torch.Tensor:
        """Contiguous [num_slots, n_heads, ring, D] K (kv=0) or V (kv=1) of the group whose
        per-sequence element offset is `offset`."""
        size = self.num_slots * n_heads * ring * head_dim
        start = 2 * self.num_slots * offset + kv * size
        return self.storage[start: start + size].view(self.num_slots, n_heads, ring, head_dim)

    def bytes_for(self, num_tokens: int) -> int:
        return self.seq_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.slot_of) * self.seq_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.seq_bytes
