"""The KV tensors, allocated by the model runner from the cache manager's geometry and
bound into the attention layers as per-layer views (the model owns no cache memory)."""
from __future__ import annotations

import torch

from headwise.cache.spec import CacheGeometry, WindowGroupSpec
from headwise.layers.attention import WindowGroup


class KVStorage:
    def __init__(self, geo: CacheGeometry, num_blocks: int, num_ring_slots: int,
                 device: torch.device | str = "cpu", page_bytes: int = 0) -> None:
        self.geometry = geo
        self.num_ring_slots = num_ring_slots
        self.num_blocks = num_blocks
        F, D = geo.total_full_heads, geo.full.head_dim
        slots = num_blocks * geo.block_size if F else 0
        # Head-major so that layer l's full heads are one contiguous slice.
        self.full_k = torch.zeros(F, slots, D, dtype=geo.full.dtype, device=device)  # [F, slots, D]
        self.full_v = torch.zeros(F, slots, D, dtype=geo.full.dtype, device=device)
        # Per (layer, window group) a contiguous [2, num_ring_slots, n, sink + window, D]
        # block, so decode runs one batched matmul over all slots of a group.
        self.rings = torch.zeros(2 * num_ring_slots * geo.ring_elems, dtype=geo.window.dtype, device=device)
        # Pages of the block pool are full-head blocks; a layout without full heads that
        # caches window state gets plain pages of `page_bytes` instead.
        self.pages = torch.zeros(0 if F else num_blocks, page_bytes, dtype=torch.uint8, device=device)
        self._groups = [(self._ring_view(0, g), self._ring_view(1, g)) for gs in geo.groups for g in gs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.rings, self.pages))

    # ---- window-state snapshots: a ring slot's bytes <-> pages of the block pool ------
    def read_ring(self, slot: int) -> torch.Tensor:
        """The bytes of one ring slot, every window group's K then V, flat uint8."""
        return torch.cat([t[slot].reshape(-1).view(torch.uint8) for kv in self._groups for t in kv])

    def write_ring(self, slot: int, data: torch.Tensor) -> None:
        at = 0
        for kv in self._groups:
            for t in kv:
                dst = t[slot].view(-1).view(torch.uint8)
                dst.copy_(data[at: at + dst.numel()])
                at += dst.numel()

    def _page_views(self) -> list[torch.Tensor]:
        """The pool as [F, num_blocks, bytes per block per head] byte views of K and V
        (a page's bytes: its slice of each), or the plain pages [1, num_pages, bytes]."""
        if self.pages.shape[0]:
            return [self.pages[None]]
        F = self.full_k.shape[0]
        return [t.view(torch.uint8).view(F, self.num_blocks, -1) for t in (self.full_k, self.full_v)]

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        views = self._page_views()
        idx = torch.tensor(pages, device=data.device)
        per = sum(v.shape[0] * v.shape[2] for v in views)  # bytes of one page
        buf = torch.zeros(len(pages) * per, dtype=torch.uint8, device=data.device)
        buf[: data.numel()] = data
        buf = buf.view(len(pages), len(views), -1)  # [N, K/V, F * bytes]
        for i, v in enumerate(views):
            v.index_copy_(1, idx, buf[:, i].reshape(len(pages), v.shape[0], -1).transpose(0, 1))

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        views = self._page_views()
        idx = torch.tensor(pages, device=views[0].device)
        parts = [v.index_select(1, idx).transpose(0, 1).reshape(len(pages), -1) for v in views]
        return torch.stack(parts, 1).reshape(-1)  # [N, K/V, F * bytes] flat

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
