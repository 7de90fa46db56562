"""Per-step geometry of window-head attention: ring indices, which chunk rows survive
into the ring, band-block masks. All of it depends on positions and (sink, window) only,
never on the layer, so the model runner builds it once per step into the step context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

# Query block size for window-head prefill: each block of this many queries reads the
# window + block keys before and at it, so the work is O(n * (sink + window)).
WINDOW_QUERY_BLOCK = 64


def ring_index(pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Ring entry of position p: p while p < sink, else sink + (p - sink) mod window."""
    return torch.where(pos < sink, pos, sink + (pos - sink) % window)


def ring_positions(sink: int, window: int, start: int, device=None) -> torch.Tensor:
    """Position held by each ring entry after tokens [0, start) were written; -1 if empty."""
    i = torch.arange(sink + window, device=device)
    pos = torch.where(i < min(sink, start), i, -1)
    last = start - 1
    if last >= sink:
        off_last = (last - sink) % window
        recent = last - ((off_last - (i - sink)) % window)
        pos = torch.where((i >= sink) & (recent >= sink), recent, pos)
    return pos


def causal_rows(start: int, length: int, sink: int, window: int) -> int:
    """Leading rows of a chunk whose window covers every earlier token (positions below
    sink + window). Taken only for a sequence's first chunk, whose earlier context is empty."""
    return min(length, sink + window) if start == 0 else 0


def bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    """Bool mask -> additive bias (0 where allowed, -inf elsewhere)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class BandMasks(NamedTuple):
    block: int                  # Bq, query rows per band block
    num_blocks: int             # nb
    head: torch.Tensor          # [1, nh, g*Bq, S]: blocks reaching before position 0
    band: torch.Tensor          # [1, 1, g*Bq, S]: every other block
    sinks: torch.Tensor | None  # [1, 1, cq, ns], None if no row sees a sink outside its band


def band_masks(start: int, length: int, sink: int, W: int, g: int, dtype, device,
               block: int = WINDOW_QUERY_BLOCK) -> BandMasks | None:
    """The block geometry and additive masks of a chunk's band rows (see the torch
    backend's window prefill, heads/window.py); None when every row is in the causal prefix. Band mask rows are
    (query head, query) pairs of one KV head; sink mask rows are queries."""
    q0 = causal_rows(start, length, sink, W)
    c, start = length - q0, start + q0
    if c == 0:
        return None
    Bq = min(block, c)
    nb = -(-c // Bq)
    S = W + Bq
    rel = torch.arange(S, device=device)[None, :] - torch.arange(Bq, device=device)[:, None]
    band = ((rel > 0) & (rel <= W)).repeat(g, 1)  # [g*Bq, S]: key j sees row i iff i < j <= i + W
    nh = min(nb, max(0, -(-(W - start) // Bq)))
    kpos = start - W + torch.arange(nh, device=device)[:, None] * Bq + torch.arange(S, device=device)
    head = band[None] & (kpos >= 0)[:, None, :]  # [nh, g*Bq, S]
    r0 = max(0, W - start)  # first query row with p - W >= 0
    ns = min(sink, start + c - W)  # sinks some query of the chunk sees outside its band
    sinks = None
    if r0 < c and ns > 0:
        qpos = torch.arange(start + r0, start + c, device=device)
        sm = torch.arange(ns, device=device)[None, :] <= (qpos - W)[:, None]  # [cq, ns], every query head alike
        sinks = bias(sm[None, None], dtype)
    return BandMasks(Bq, nb, bias(head[None], dtype), bias(band[None, None], dtype), sinks)


@dataclass(frozen=True)
class BandSpec:
    """What band_masks takes for one chunk (kept to build its masks when first read)."""
    start: int
    length: int
    sink: int
    window: int
    g: int                      # query heads per KV head
    dtype: torch.dtype
    device: torch.device
    block: int = WINDOW_QUERY_BLOCK

    def masks(self) -> BandMasks | None:
        return band_masks(self.start, self.length, self.sink, self.window, self.g, self.dtype, self.device,
                          self.block)


@dataclass
class WindowChunk:
    """One prefill chunk seen by the window heads of one (sink, window)."""
    causal_rows: int               # leading rows computed as plain causal attention
    write_rows: torch.Tensor       # [r] chunk rows that survive into the ring
    write_index: torch.Tensor      # [r] their ring entries
    ring_read: torch.Tensor | None = None  # torch: ring entries of the earlier context the band reads
    ring_pos: torch.Tensor | None = None  # [R] position per ring entry before the chunk (Triton)
    # torch backend: the band's geometry. Its masks are built on first read only, as the
    # C prefill kernel (heads/window.py) masks by position and never reads them.
    band: BandSpec | None = field(default=None, repr=False)

    @cached_property
    def masks(self) -> BandMasks | None:
        """The band rows' masks (torch backend; None where every row is causal)."""
        return None if self.band is None else self.band.masks()


def ring_writes(start: int, length: int, sink: int, window: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a chunk of positions [start, start + length) that the ring still holds after
    it (sinks and the last `window`), and their ring entries: both [r]."""
    cpos = torch.arange(start, start + length, device=device)
    rows = ((cpos < sink) | (cpos >= start + length - window)).nonzero().squeeze(1)
    return rows, ring_index(cpos[rows], sink, window)


def window_chunk(start: int, length: int, sink: int, window: int, g: int, dtype, device,
                 for_kernels: bool, block: int = WINDOW_QUERY_BLOCK) -> WindowChunk:
    ch = WindowChunk(causal_rows(start, length, sink, window), *ring_writes(start, length, sink, window, device))
    if for_kernels:
        ch.ring_pos = ring_positions(sink, window, start, device)
    else:
        ch.band = BandSpec(start, length, sink, window, g, dtype, device, block)
        # Band rows start at start + causal rows and reach back `window` positions; what
        # lies before the chunk is read from the ring (positions [lo, start)).
        lo = max(0, start + ch.causal_rows - window)
        if lo < start:
            ch.ring_read = ring_index(torch.arange(lo, start, device=device), sink, window)
    return ch
