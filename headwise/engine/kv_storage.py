"""The KV tensors, allocated by the model runner from the cache manager's geometry and
bound into the attention layers as per-layer views (the model owns no cache memory).
A quantized class has a scale tensor beside each value tensor, with the same leading
shape; byte copies (snapshots, tier pages) carry both.

With select heads' pages in host memory (hot_pages > 0; engine.hot_pages), the paged
pool on the device holds the other paged heads only, the select heads' K/V have a `home`
pool of their own in host memory (pinned on CUDA), and the device keeps their key
summaries and hot set. A tier page then carries the device heads' bytes, then the home
heads', then the summaries."""
from __future__ import annotations

import torch

from headwise.cache.block_pool import id_runs
from headwise.cache.spec import CacheGeometry, GroupSpec
from headwise.engine.hot_pages import HotPages
from headwise.heads.base import head_class
from headwise.layers.attention import HeadGroup
from headwise.layers.kv_tensor import KVTensor


class KVStorage:
    def __init__(self, geo: CacheGeometry, num_blocks: int, num_ring_slots: int,
                 device: torch.device | str = "cpu", page_bytes: int = 0,
                 compute_dtype: torch.dtype | None = None, hot_pages: int = 0) -> None:
        self.geometry = geo
        self.device = torch.device(device)
        # What reads return (the model's dtype); a plain class defaults to its own dtype.
        self.compute = {c.name: compute_dtype or c.scale_dtype or c.dtype for c in (geo.paged, geo.ring)}
        self.num_ring_slots = num_ring_slots
        self.num_blocks = num_blocks
        F, D = geo.total_paged_heads, geo.paged.head_dim
        slots = num_blocks * geo.block_size if F else 0
        S = geo.summary_heads if hot_pages else 0  # heads whose K/V wait in host memory
        # Head-major so that layer l's paged heads are one contiguous slice.
        # K and V side by side, so a step writes both in one op (HeadGroup.kv).
        self.paged_kv = torch.zeros(2, F - S, slots, D, dtype=geo.paged.dtype, device=device)  # [K|V, F, slots, D]
        self.paged_k, self.paged_v = self.paged_kv[0], self.paged_kv[1]
        fs = geo.paged.scale_dtype
        self.paged_k_scale = None if fs is None else torch.zeros(F - S, slots, dtype=fs, device=device)  # [F, slots]
        self.paged_v_scale = None if fs is None else torch.zeros(F - S, slots, dtype=fs, device=device)
        # Host mode: the select heads' [K|V, S, slots, D] (+ scales [S, slots]), pinned on
        # CUDA for asynchronous copies; a paged group's first head in the device pool
        # counts the other paged heads before it.
        pin = self.device.type == "cuda"
        self.home_kv = _zeros((2, S, slots, D), geo.paged.dtype, pin)
        self.home_scales = None if fs is None else _zeros((2, S, slots), fs, pin)
        self._device_offset = {}
        before = 0
        for g in (g for gs in geo.groups for g in gs if g.paged):
            self._device_offset[g] = g.offset - before
            before += g.num_heads if S and g.summarised else 0
        self.hot = None
        if S:
            self.hot = HotPages(*(KVTensor(self.home_kv[i], None if fs is None else self.home_scales[i],
                                           compute_dtype or geo.paged.dtype) for i in (0, 1)),
                                hot_pages, geo.block_size, self.device)
        # Per (layer, window group) a contiguous [2, num_ring_slots, n, sink + window, D]
        # block, so decode runs one batched matmul over all slots of a group; scales
        # likewise [2, num_ring_slots, n, sink + window].
        self.rings = torch.zeros(2 * num_ring_slots * geo.ring_elems, dtype=geo.ring.dtype, device=device)
        ws = geo.ring.scale_dtype
        self.ring_scales = (None if ws is None else
                            torch.zeros(2 * num_ring_slots * geo.ring_tokens, dtype=ws, device=device))
        # Pages of the block pool are paged-head blocks; a layout without paged heads that
        # caches window state gets plain pages of `page_bytes` instead.
        self.pages = torch.zeros(0 if F else num_blocks, page_bytes, dtype=torch.uint8, device=device)
        # Key summaries of the summarised paged heads (select), per block: [num_blocks,
        # S, 2 (min, max), D]; part of a block's bytes, so they travel with it (tier pages).
        self.summaries = torch.zeros(num_blocks if geo.summary_heads else 0, geo.summary_heads, 2, D,
                                     dtype=geo.summary_dtype, device=device)
        self._groups = [(self._ring_view(0, g), self._ring_view(1, g)) for g in geo.ring_groups]

    @property
    def nbytes(self) -> int:
        """Bytes on the device (the hot set included, host memory not)."""
        return sum(t.numel() * t.element_size() for t in (self.paged_kv, self.paged_k_scale,
                                                           self.paged_v_scale, self.rings, self.ring_scales,
                                                           self.pages, self.summaries) if t is not None) + (
            self.hot.nbytes if self.hot is not None else 0)

    @property
    def host_nbytes(self) -> int:
        """Bytes of the select heads' pages in host memory (0 unless they wait there)."""
        return sum(t.numel() * t.element_size() for t in (self.home_kv, self.home_scales) if t is not None)

    # ---- window-state snapshots: a ring slot's bytes <-> pages of the block pool ------
    def _ring_parts(self, slot: int) -> list[torch.Tensor]:
        """One ring slot's tensors, every window group's K then V, values then scales."""
        parts = []
        for kv in self._groups:
            for t in kv:
                parts.append(t.data[slot])
                if t.quantized:
                    parts.append(t.scale[slot])
        return parts

    def read_ring(self, slot: int) -> torch.Tensor:
        """The bytes of one ring slot (see _ring_parts), flat uint8."""
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in self._ring_parts(slot)])

    def write_ring(self, slot: int, data: torch.Tensor) -> None:
        at = 0
        for t in self._ring_parts(slot):
            dst = t.view(-1).view(torch.uint8)
            dst.copy_(data[at: at + dst.numel()])
            at += dst.numel()

    def copy_ring(self, src: int, dst: int) -> None:
        for a, b in zip(self._ring_parts(src), self._ring_parts(dst)):
            b.copy_(a)

    def _page_views(self) -> list[torch.Tensor]:
        """The pool as [F, num_blocks, bytes per block per head] byte views of K and V
        values, then their scales when quantized (a page's bytes: its slice of each), or
        the plain pages [1, num_pages, bytes]."""
        if self.pages.shape[0]:
            return [self.pages[None]]
        parts = (self.paged_k, self.paged_v, self.paged_k_scale, self.paged_v_scale)
        if self.hot is not None:
            parts += tuple(self.home_kv) + (() if self.home_scales is None else tuple(self.home_scales))
        views = [t.view(torch.uint8).view(t.shape[0], self.num_blocks, -1) for t in parts
                 if t is not None and t.shape[0]]  # (host mode: no device heads where all are select)
        if self.summaries.numel():
            views.append(self.summaries.view(torch.uint8).view(1, self.num_blocks, -1))
        return views

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        views = self._page_views()
        per = sum(v.shape[0] * v.shape[2] for v in views)  # bytes of one page
        N = len(pages)
        buf = data if data.numel() == N * per else torch.cat((data, data.new_zeros(N * per - data.numel())))
        buf = buf.view(N, per)  # [N, views' bytes one after another]
        at = 0
        for v in views:
            n = v.shape[0] * v.shape[2]
            src = buf[:, at: at + n].reshape(N, v.shape[0], -1).transpose(0, 1)  # [heads, N, bytes]
            for first, i, m in id_runs(pages):  # slice copies: ~4x faster than index_copy_ here
                v[:, first: first + m].copy_(src[:, i: i + m])
            at += n
        if self.hot is not None:  # the hot copies of these blocks are stale now
            self.hot.invalidate(0, self.geometry.summary_heads, torch.tensor(pages, dtype=torch.int64))

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        parts = []
        for v in self._page_views():
            runs = [v[:, first: first + m] for first, _, m in id_runs(pages)]
            got = runs[0] if len(runs) == 1 else torch.cat(runs, 1)  # [heads, N, bytes]
            parts.append(got.transpose(0, 1).reshape(len(pages), -1).to(self.device))
        return torch.cat(parts, 1).reshape(-1)  # [N, views' bytes] flat

    def _ring_view(self, kv: int, g: GroupSpec) -> KVTensor:
        """[num_ring_slots, n, sink + window, D] K (kv=0) or V (kv=1) of one group."""
        S, D = self.num_ring_slots, self.geometry.ring.head_dim
        tokens = S * g.num_heads * g.ring_size
        start = 2 * S * g.offset // D + kv * tokens  # in head-tokens
        data = self.rings[start * D: (start + tokens) * D].view(S, g.num_heads, g.ring_size, D)
        scale = (None if self.ring_scales is None else
                 self.ring_scales[start: start + tokens].view(S, g.num_heads, g.ring_size))
        return KVTensor(data, scale, self.compute["ring"])

    def _ring_pair(self, g: GroupSpec) -> torch.Tensor | None:
        """[2, num_ring_slots, n, sink + window, D]: one group's K and V values together
        (for one write of both); None when the class is quantized (scales to write too)."""
        if self.ring_scales is not None:
            return None
        S, D = self.num_ring_slots, self.geometry.ring.head_dim
        start = 2 * S * g.offset // D
        return self.rings[start * D: (start + 2 * S * g.num_heads * g.ring_size) * D].view(
            2, S, g.num_heads, g.ring_size, D)

    def _paged_views(self, g: GroupSpec) -> tuple[KVTensor, KVTensor, torch.Tensor | None]:
        """K and V [n, slots, D] KVTensors of a paged group, and both values together
        [2, n, slots, D] (None when quantized: scales to write too); a select group's
        are in its home pool when its pages wait in host memory."""
        dt = self.compute["paged"]
        if self.hot is not None and g.summarised:
            kv, scales, at = self.home_kv, self.home_scales, g.summary_offset
        else:
            kv, at = self.paged_kv, self._device_offset[g]
            scales = None if self.paged_k_scale is None else (self.paged_k_scale, self.paged_v_scale)
        heads = slice(at, at + g.num_heads)
        k, v = (KVTensor(kv[i][heads], None if scales is None else scales[i][heads], dt) for i in (0, 1))
        return k, v, None if scales is not None else kv[:, heads]

    def layer_views(self, layer: int) -> list[HeadGroup]:
        """Every head group of a layer with its cache views, in storage order."""
        out = []
        for g in self.geometry.groups[layer]:
            k, v, kv = (self._paged_views(g) if g.paged else
                        (self._ring_view(0, g), self._ring_view(1, g), self._ring_pair(g)))
            summary = (self.summaries[:, g.summary_offset: g.summary_offset + g.num_heads]
                       if g.summarised else None)  # [num_blocks, n, 2, D]
            hot = self.hot.view(g.summary_offset, g.num_heads) if self.hot is not None and g.summarised else None
            out.append(HeadGroup(head_class(g.kind), g.kv_start, g.kv_end, g.sink, g.window, k, v, kv,
                                 budget=g.budget, summary=summary, hot=hot))
        return out


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory, pinned when the device is CUDA."""
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if pin else t
