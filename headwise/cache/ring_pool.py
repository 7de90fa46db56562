"""Books of the window-head rings: one fixed-size slot per running sequence.

A slot holds, for every window head of every layer, sink + window token positions, so
its size does not depend on the prompt length. No tensors here: the runner owns the
storage (see CacheGeometry for its layout). A free slot may be lent for one step as
scratch space (the window state at a snapshot point inside a prefill chunk, see
KVCacheManager.plan_chunk) and comes back when the step is committed.
"""
from __future__ import annotations

from collections import deque

from headwise.cache.pool import CacheFullError


class RingPool:
    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes  # 0 when the layout has no window head
        self.num_slots = num_slots if slot_bytes else 0
        self._free: deque[int] = deque(range(self.num_slots))
        self.slot_of: dict[int, int] = {}
        self.lent: set[int] = set()  # scratch slots out for the current step

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lend(self) -> int:
        slot = self._free.popleft()
        self.lent.add(slot)
        return slot

    def take_back(self, slot: int) -> None:
        self.lent.remove(slot)
        self._free.append(slot)

    @property
    def active(self) -> bool:
        return self.slot_bytes > 0

    def can_allocate(self, num_tokens: int) -> bool:
        return not self.active or bool(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if not self.active:
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

    def bytes_for(self, num_tokens: int) -> int:
        return self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.slot_of) * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes
