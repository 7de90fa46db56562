"""KVCacheManager: the one door to the cache for the scheduler and the model runner.

It keeps the books of both pools (which blocks and which ring slot each sequence holds),
splits the byte budget between them, checks both on admission, and hands each step the
plain data it needs (slot ids, block tables, ring slots). It owns no tensor: the model
runner allocates the storage that `geometry` describes and binds it into the layers.
"""
from __future__ import annotations

import torch

from headwise.cache.full_pool import FullHeadPool
from headwise.cache.layout import HeadLayout
from headwise.cache.ring_pool import RingPool
from headwise.cache.spec import CacheGeometry, KVClassSpec


class CacheConfigError(ValueError):
    pass


class KVCacheManager:
    def __init__(self, layout: HeadLayout, block_size: int, kv_cache_memory: int,
                 max_num_seqs: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.block_size = block_size
        D = layout.head_dim
        self.geometry = CacheGeometry.from_layout(
            layout, block_size, KVClassSpec("full", dtype, D), KVClassSpec("window", dtype, D))
        geo = self.geometry
        self.ring = RingPool(max_num_seqs, geo.ring_bytes)
        if self.ring.total_bytes > kv_cache_memory:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes cannot hold the window-head rings of "
                f"max_num_seqs={max_num_seqs} sequences ({self.ring.total_bytes} bytes); "
                "raise kv_cache_memory or lower max_num_seqs"
            )
        block_bytes = geo.block_bytes
        num_blocks = (kv_cache_memory - self.ring.total_bytes) // block_bytes if block_bytes else 0
        if block_bytes and num_blocks < 1:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes leaves no room for one full-head block "
                f"({block_bytes} bytes) after the rings ({self.ring.total_bytes} bytes)"
            )
        self.full = FullHeadPool(num_blocks, block_size, block_bytes)
        self.pools = (self.full, self.ring)

    @property
    def num_blocks(self) -> int:
        return self.full.blocks.num_blocks

    @property
    def num_ring_slots(self) -> int:
        return self.ring.num_slots

    # ---- admission and growth (both pools) ----------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        return all(p.can_allocate(num_tokens) for p in self.pools)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        for p in self.pools:
            p.allocate(seq_id, num_tokens)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return all(p.can_append(seq_id, num_tokens) for p in self.pools)

    def append(self, seq_id: int, num_tokens: int) -> None:
        for p in self.pools:
            p.append(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        for p in self.pools:
            p.free(seq_id)

    def max_tokens_per_seq(self) -> int:
        return self.full.max_tokens()

    # ---- what a step needs, as plain data ------------------------------------------
    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Full-pool flat slots (block * block_size + offset) of positions [start, end)."""
        return self.full.slots(seq_id, start, end)

    def block_table(self, seq_id: int) -> list[int]:
        return self.full.block_table(seq_id)

    def slot_runs(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Positions [0, num_tokens) as (first flat slot, length) runs of adjacent slots."""
        return self.full.slot_runs(seq_id, num_tokens)

    def ring_slot(self, seq_id: int) -> int:
        return self.ring.slot(seq_id)

    @property
    def has_full_heads(self) -> bool:
        return self.full.active

    # ---- accounting ---------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens occupies under this layout."""
        return sum(p.bytes_for(num_tokens) for p in self.pools)

    def max_concurrency(self, num_tokens: int) -> int:
        """Sequences of `num_tokens` tokens that fit at once."""
        by_ring = self.ring.num_slots if self.ring.active else 1 << 62
        per = self.full.bytes_for(num_tokens)
        by_full = self.full.total_bytes // per if per else 1 << 62
        return min(by_ring, by_full)

    def usage(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, p in (("full", self.full), ("ring", self.ring)):
            total = p.total_bytes
            out[name] = {"used_bytes": p.used_bytes, "total_bytes": total,
                         "usage": p.used_bytes / total if total else 0.0}
        return out
