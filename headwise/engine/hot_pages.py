"""Select heads' pages waiting in host memory (EngineConfig.select_host_pages).

A select head reads at most its budget plus sink and window per decode step, yet keeps
every token. With this option its K/V live in host memory (pinned on CUDA: the `home`
tensors of KVStorage), and the device holds, per select head, a hot set of
`num_pages` pages: copies of the pages decode chose recently. Each decode step the pages
chosen and not resident are copied in (least recently used out, never a page the same
call needs), and the chosen-page tables are rewritten to hot pages, so the select decode
kernels run unchanged over the hot tensors.

The books (which block each hot page holds, and when it was last used) are plain host
tensors kept here beside the tensors they describe: the runner owns both. A block's hot
copy is dropped whenever the block is written (a step's new tokens, a page read back from
the disk tier), so a hot page never differs from its home.
"""
from __future__ import annotations

import torch

from headwise.layers.kv_tensor import KVTensor


class HotPages:
    def __init__(self, home_k: KVTensor, home_v: KVTensor, num_pages: int, block_size: int,
                 device: torch.device) -> None:
        # home_k, home_v: [S, slots, D] (+ scales [S, slots]), every select head's K/V.
        S, slots, D = home_k.shape
        self.block_size, self.num_pages = block_size, num_pages
        self.home = (home_k, home_v)

        def hot(home: KVTensor) -> KVTensor:
            scale = None if home.scale is None else torch.zeros(S, num_pages * block_size, dtype=home.scale.dtype,
                                                                device=device)
            return KVTensor(torch.zeros(S, num_pages * block_size, D, dtype=home.data.dtype, device=device),
                            scale, home.dtype)

        self.k, self.v = hot(home_k), hot(home_v)  # [S, num_pages * block_size, D]
        num_blocks = slots // block_size
        self.resident = torch.full((S, num_blocks), -1, dtype=torch.int64)  # block -> its hot page, or -1
        self.owner = torch.full((S, num_pages), -1, dtype=torch.int64)      # hot page -> its block, or -1
        self.last_used = torch.full((S, num_pages), -1, dtype=torch.int64)  # -1: free
        self.clock = 0
        self.copied = 0  # pages copied from host, all heads
        self.hits = 0    # chosen pages found resident

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in (self.k, self.v) for t in (kv.data, kv.scale)
                   if t is not None)

    def view(self, first: int, n: int) -> "HotView":
        """The hot set of select heads [first, first + n) (one layer's select group)."""
        return HotView(self, first, n)

    def invalidate(self, first: int, n: int, blocks: torch.Tensor) -> None:
        """Drop the hot copies of `blocks` [m] of heads [first, first + n)."""
        blocks = blocks.to("cpu", torch.int64)
        pages = self.resident[first:first + n, blocks]  # [n, m]
        held = pages >= 0
        if held.any():
            heads = torch.arange(first, first + n)[:, None].expand_as(pages)[held]
            self.owner[heads, pages[held]] = -1
            self.last_used[heads, pages[held]] = -1
            self.resident[first:first + n, blocks] = -1

    def fetch(self, head: int, blocks: torch.Tensor) -> torch.Tensor:
        """Hot pages [m] holding `blocks` [m] (distinct, int64, host) of select head
        `head`, copying the missing ones in; at most num_pages blocks."""
        m = blocks.numel()
        if m > self.num_pages:
            raise RuntimeError(f"{m} pages asked of a hot set of {self.num_pages}")
        self.clock += 1
        pages = self.resident[head, blocks]
        hit = pages >= 0
        self.hits += int(hit.sum())
        self.last_used[head, pages[hit]] = self.clock
        miss = blocks[~hit]
        if miss.numel():
            # Least recently used first (free pages are -1); pages of this call are newest.
            victims = torch.argsort(self.last_used[head], stable=True)[:miss.numel()]
            old = self.owner[head, victims]
            self.resident[head, old[old >= 0]] = -1
            self.owner[head, victims] = miss
            self.resident[head, miss] = victims
            self.last_used[head, victims] = self.clock
            self._copy_in(head, miss, victims)
            self.copied += miss.numel()
        return self.resident[head, blocks]

    def _copy_in(self, head: int, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        # One gather on the host, one copy to the device (non-blocking from pinned memory).
        bs = self.block_size
        dev = self.k.data.device
        to = pages.to(dev)
        for hot, home in zip((self.k, self.v), self.home):
            D = home.shape[-1]
            src = home.data[head].view(-1, bs, D)[blocks]  # [m, bs, D]
            hot.data[head].view(-1, bs, D)[to] = src.to(dev, non_blocking=True)
            if home.scale is not None:
                hot.scale[head].view(-1, bs)[to] = home.scale[head].view(-1, bs)[blocks].to(dev, non_blocking=True)


class HotView:
    """One select group's share of the hot set: K/V [n, num_pages * block_size, D] views
    for the decode kernels, and the rewrite of its chosen-page tables."""

    def __init__(self, pages: HotPages, first: int, n: int) -> None:
        self.pages, self.first, self.n = pages, first, n
        self.k, self.v = pages.k[first:first + n], pages.v[first:first + n]

    def invalidate(self, blocks: torch.Tensor) -> None:
        self.pages.invalidate(self.first, self.n, blocks)

    def chosen(self, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """tables [n, R, K] int32 of chosen blocks per head and row, lens [n, R] tokens
        they hold -> the same tables over hot pages (entries past a row's pages: 0), with
        every page they name resident; None, nothing copied, when one head's pages do not
        fit its hot set at once (the caller splits the rows)."""
        bs = self.pages.block_size
        host_t, host_l = tables.to("cpu", torch.int64), lens.to("cpu", torch.int64)
        K = host_t.shape[-1]
        valid = torch.arange(K) < ((host_l + bs - 1) // bs)[..., None]  # [n, R, K]
        needed = [host_t[h][valid[h]].unique() for h in range(self.n)]  # sorted
        if max(b.numel() for b in needed) > self.pages.num_pages:
            return None
        out = torch.zeros_like(host_t)
        for h, blocks in enumerate(needed):
            hot = self.pages.fetch(self.first + h, blocks)
            out[h][valid[h]] = hot[torch.searchsorted(blocks, host_t[h][valid[h]])]
        return out.to(device=tables.device, dtype=torch.int32)
