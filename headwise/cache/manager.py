"""KVCacheManager: the one cache API the scheduler and runner use.

It fronts the full-head pool (paged) and the window-head pool (rings), splits the byte
budget between them, checks both on admission, and binds per-layer views to the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from headwise.cache.full_pool import FullHeadPool
from headwise.cache.layout import HeadLayout
from headwise.cache.ring_pool import RingPool


class CacheConfigError(ValueError):
    pass


@dataclass
class _Group:
    kv_start: int
    kv_end: int
    sink: int
    window: int
    offset: int  # element offset in a ring slot


class KVCacheManager:
    def __init__(self, layout: HeadLayout, block_size: int, kv_cache_memory: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.block_size = block_size
        D = layout.head_dim
        self.full_offsets: list[int] = []
        self.groups: list[list[_Group]] = []
        F = E = 0
        for l in range(layout.num_layers):
            self.full_offsets.append(F)
            nf = layout.num_full(l)
            F += nf
            order = layout.head_order(l)
            groups: list[_Group] = []
            for pos in range(nf, len(order)):
                s = layout.heads[l][order[pos]]
                if groups and (groups[-1].sink, groups[-1].window) == (s.sink, s.window):
                    groups[-1].kv_end = pos + 1
                else:
                    groups.append(_Group(pos, pos + 1, s.sink, s.window, 0))
            for grp in groups:
                grp.offset = E
                E += (grp.kv_end - grp.kv_start) * (grp.sink + grp.window) * D
            self.groups.append(groups)
        self.ring = RingPool(max_num_seqs, E, dtype, device)
        if self.ring.total_bytes > kv_cache_memory:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes cannot hold the window-head rings of "
                f"max_num_seqs={max_num_seqs} sequences ({self.ring.total_bytes} bytes); "
                "raise kv_cache_memory or lower max_num_seqs"
            )
        esize = torch.empty((), dtype=dtype).element_size()
        block_bytes = 2 * F * block_size * D * esize
        num_blocks = (kv_cache_memory - self.ring.total_bytes) // block_bytes if F else 0
        if F and num_blocks < 1:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes leaves no room for one full-head block "
                f"({block_bytes} bytes) after the rings ({self.ring.total_bytes} bytes)"
            )
        self.full = FullHeadPool(num_blocks, block_size, F, D, dtype, device)
        self.pools = (self.full, self.ring)

    # ---- binding ------------------------------------------------------------------
    def bind(self, attention_layers, backend: str = "torch") -> None:
        D = self.layout.head_dim
        from headwise.layers.attention import WindowGroup

        for l, attn in enumerate(attention_layers):
            nf = self.layout.num_full(l)
            off = self.full_offsets[l]
            kf = self.full.k[off: off + nf] if nf else None
            vf = self.full.v[off: off + nf] if nf else None
            wgs = []
            for g in self.groups[l]:
                n, R = g.kv_end - g.kv_start, g.sink + g.window
                wgs.append(WindowGroup(g.kv_start, g.kv_end, g.sink, g.window,
                                       self.ring.view(0, g.offset, n, R, D),
                                       self.ring.view(1, g.offset, n, R, D)))
            attn.bind(nf, kf, vf, wgs, self.block_size, backend)

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

    # ---- accounting ---------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens occupies under this layout."""
        return sum(p.bytes_for(num_tokens) for p in self.pools)

    def max_concurrency(self, num_tokens: int) -> int:
        """Sequences of `num_tokens` tokens that fit at once."""
        by_ring = self.ring.num_slots if self.ring.elems_per_seq else 1 << 62
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
