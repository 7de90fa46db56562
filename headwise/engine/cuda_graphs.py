"""Decode steps replayed from CUDA graphs, as vLLM and SGLang run decode on GPUs.

A decode step is a few hundred small kernels (30 layers of norms, projections, rotary,
cache writes, two attention calls per class); launched one by one from Python, the launches
cost more than the kernels at small batches. At start, the model body (embedding through
the last layer, attention included) is captured once per batch-size bucket (capture_sizes)
into a CUDA graph; a decode-only step of B sequences then copies its inputs into the
graphs' persistent buffers, pads the rows up to the bucket, and replays one graph. The
vocabulary projection runs after the replay on the B real rows only (its output would
otherwise take a bucket x vocabulary buffer per graph).

What a graph reads is fixed at capture: tensors by address, Python values (shapes, the
batch size, kernel launch arguments) by value. So every per-step input lives in a buffer
of the largest bucket: token ids, positions, full-pool slots, lengths, ring slots, each
window kind's ring entry, and block tables as wide as the longest sequence
(max_model_len); steps read views of their first rows. Only backends whose decode reads
nothing but those tensors are captured (the Triton backend, PAGED); the PyTorch backend
decides per step in Python (ring occupancy, slot runs) and stays eager.

Padding rows are a one-token sequence at position 0 writing into a spare block and a
spare ring slot that the runner allocates past the cache manager's books, so no sequence
ever sees them. Steps with prefill chunks, more sequences than the largest bucket, or
custom logit rows (evaluation) run eagerly.

Policy, EngineConfig.enforce_eager: captured on CUDA with the Triton backend unless True;
with False the captured body is also the torch.compile'd one (engine.decode_capture).
A capture that fails leaves decode eager, with one log line.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from headwise.engine.decode_capture import warn_eager
from headwise.layers.context import PagedDecode, RingKind, StepContext, step_context

log = logging.getLogger("headwise.cuda_graphs")

MAX_CAPTURE_SIZE = 256  # larger decode batches run eagerly (launch costs matter less there)
WARMUP_RUNS = 2  # eager runs before each capture (Triton compiles, allocator settles)

# (step function) -> (replay, output): runs the function once while recording it; replay()
# runs the recording again, writing the same output tensor.
Capturer = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets captured for up to `max_batch` sequences (vLLM's: 1, 2, 4, then
    every multiple of 8), capped at MAX_CAPTURE_SIZE."""
    top = min(max_batch, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] < top:  # the last bucket holds the largest batch
        sizes.append(top)
    return sizes


class CudaCapturer:
    """Captures step functions into CUDA graphs that share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm-up on a side stream, as PyTorch's capture recipe asks: kernels compile and
        # the caching allocator serves the capture from settled pools.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


def capturer_for(device: torch.device) -> Capturer | None:
    """The graph capturer of a device: CUDA graphs on CUDA, none elsewhere."""
    return CudaCapturer(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class GraphShape:
    """What the captured graphs are sized for."""
    max_batch: int                 # largest decode batch (its bucket is the largest graph)
    max_blocks: int                # block table width: the longest sequence's blocks
    block_size: int
    ring_kinds: list[RingKind]     # one ring-entry buffer per kind
    has_paged_heads: bool          # whether steps carry block tables
    pad_block: int                 # the spare block and ring slot padding rows write into
    pad_ring: int


class CudaGraphDecode:
    """Decode-only steps replayed from graphs captured per batch-size bucket.

    hidden_fn(ids [T], positions [T]) -> [T, hidden] is the step's model body."""

    def __init__(self, hidden_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], capturer: Capturer,
                 device: torch.device, shape: GraphShape) -> None:
        self.hidden_fn = hidden_fn
        self.capturer = capturer
        self.sizes = capture_sizes(shape.max_batch)
        self.block_size = block_size = shape.block_size
        self.pad_slot, self.pad_block, self.pad_ring = shape.pad_block * block_size, shape.pad_block, shape.pad_ring
        ring_kinds, has_paged_heads, max_blocks = shape.ring_kinds, shape.has_paged_heads, shape.max_blocks
        n, i64 = self.sizes[-1], dict(dtype=torch.int64, device=device)
        # The persistent inputs; a step of B rows fills [:B] and pads up to its bucket.
        self.ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.zeros(n, **i64)                 # full-pool slot of each row
        self.lens = torch.ones(n, **i64)                   # tokens incl. the new one
        self.ring_slots = torch.zeros(n, **i64)
        self.ring_index = {kind: torch.zeros(n, **i64) for kind in ring_kinds}  # ring entry per row
        self.tables = (torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
                       if has_paged_heads else None)        # [n, max_blocks] block tables
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # bucket -> (replay, hidden)
        self.capture_s = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.graphs)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def applies(self, ctx: StepContext) -> bool:
        """Whether a step replays a graph: decode rows only, within the largest bucket,
        block tables within the captured width."""
        return (self.enabled and not ctx.prefills and 0 < ctx.num_decode <= self.sizes[-1]
                and (self.tables is None or ctx.decode.block_tables.shape[1] <= self.tables.shape[1]))

    def _context(self, n: int) -> StepContext:
        """The context the graph of bucket n is captured under: views of the buffers."""
        return StepContext(positions=self.positions[:n], full_slots=self.slots[:n], block_size=self.block_size,
                           num_decode=n, decode_lens=self.lens[:n], decode_ring_slots=self.ring_slots[:n],
                           decode=PagedDecode(None if self.tables is None else self.tables[:n]),
                           decode_ring_index={kind: t[:n] for kind, t in self.ring_index.items()})

    def _pad(self, a: int, b: int) -> None:
        """Rows [a, b): one-token sequences at position 0 in the spare block and ring slot."""
        if a == b:
            return
        for t in (self.ids, self.positions, *self.ring_index.values()):  # ring entry of position 0 is 0
            t[a:b].zero_()
        self.slots[a:b].fill_(self.pad_slot)
        self.lens[a:b].fill_(1)
        self.ring_slots[a:b].fill_(self.pad_ring)
        if self.tables is not None:
            self.tables[a:b, 0].fill_(self.pad_block)

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool memory); on
        any failure, none is kept and decode stays eager."""
        t0 = time.perf_counter()
        try:
            for n in reversed(self.sizes):
                self._pad(0, n)
                with step_context(self._context(n)), torch.inference_mode():
                    self.graphs[n] = self.capturer(
                        lambda ids=self.ids[:n], pos=self.positions[:n]: self.hidden_fn(ids, pos))
        except Exception as e:  # noqa: BLE001 - any capture failure means eager decode
            self.graphs.clear()
            warn_eager(log, "CUDA graph capture failed, decode runs eagerly", e)
            return
        self.capture_s = time.perf_counter() - t0
        log.info("decode captured in CUDA graphs for batches of %s (%.1f s)",
                 ", ".join(map(str, self.sizes)), self.capture_s)

    def replay(self, ctx: StepContext, ids: torch.Tensor) -> torch.Tensor:
        """Run a decode-only step (see applies): ids [B] -> the last layer's output [B, hidden]."""
        B = ctx.num_decode
        n = self.bucket(B)
        self.ids[:B].copy_(ids)
        self.positions[:B].copy_(ctx.positions)
        self.slots[:B].copy_(ctx.full_slots)
        self.lens[:B].copy_(ctx.decode_lens)
        self.ring_slots[:B].copy_(ctx.decode_ring_slots)
        for kind, t in self.ring_index.items():
            t[:B].copy_(ctx.decode_ring_index[kind])
        if self.tables is not None:  # columns past a row's length are never read
            w = ctx.decode.block_tables.shape[1]
            self.tables[:B, :w].copy_(ctx.decode.block_tables)
        self._pad(B, n)
        replay, hidden = self.graphs[n]
        replay()
        return hidden[:B]
