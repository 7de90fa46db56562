"""The KV tensors, allocated by the model runner from the cache manager's geometry and
bound into the attention layers as per-layer views (the model owns no cache memory)."""
from __future__ import annotations

import torch

from headwise.cache.spec import CacheGeometry, WindowGroupSpec
from headwise.layers.attention import WindowGroup


class KVStorage:
    def __init__(self, geo: CacheGeometry, num_blocks: int, num_ring_slots: int,
                 device: torch.device | str = "cpu") -> None:
        self.geometry = geo
        self.num_ring_slots = num_ring_slots
        F, D = geo.total_full_heads, geo.full.head_dim
        slots = num_blocks * geo.block_size if F else 0
        # Head-major so that layer l's full heads are one contiguous slice.
        self.full_k = torch.zeros(F, slots, D, dtype=geo.full.dtype, device=device)  # [F, slots, D]
        self.full_v = torch.zeros(F, slots, D, dtype=geo.full.dtype, device=device)
        # Per (layer, window group) a contiguous [2, num_ring_slots, n, sink + window, D]
        # block, so decode runs one batched matmul over all slots of a group.
        self.rings = torch.zeros(2 * num_ring_slots * geo.ring_elems, dtype=geo.window.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.rings))

    def _ring_view(self, kv: int, g: WindowGroupSpec) -> torch.Tensor:
        """[num_ring_slots, n, sink + window, D] K (kv=0) or V (kv=1) of one group."""
        S, D = self.num_ring_slots, self.geometry.window.head_dim
        size = S * g.num_heads * g.ring_size * D
        start = 2 * S * g.offset + kv * size
        return self.rings[start: start + size].view(S, g.num_heads, g.ring_size, D)

    def layer_views(self, layer: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None, list[WindowGroup]]:
        """(number of full heads, their K and V [nf, slots, D], window groups) of a layer."""
        geo = self.geometry
        nf, off = geo.num_full[layer], geo.full_offset[layer]
        kf = self.full_k[off: off + nf] if nf else None
        vf = self.full_v[off: off + nf] if nf else None
        groups = [WindowGroup(g.kv_start, g.kv_end, g.sink, g.window, self._ring_view(0, g), self._ring_view(1, g))
                  for g in geo.groups[layer]]
        return nf, kf, vf, groups
