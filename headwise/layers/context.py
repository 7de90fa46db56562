"""Per-step batch metadata that attention layers read (built by the model runner).

Token order in a step: the decode tokens of all decoding sequences first, then each
prefill chunk in turn. Everything here is plain data built once per step, never per
layer. StepContext holds what every backend reads (positions, slots, ring slots, the ring
classes' metadata); what one backend reads of the paged heads (block tables, slot runs,
int32 forms for the C kernel) it builds itself from the cache manager's plain data
(the backend's StepMetadata) into `decode` and each chunk's `pages`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


RingKind = tuple[str, int, int]  # (class, sink, window): heads.base.RingKind


@dataclass
class PrefillChunk:
    offset: int            # index of the chunk's first token in the flat batch
    start: int             # position of the chunk's first token in its sequence
    length: int            # number of tokens in the chunk
    ring_slot: int         # the sequence's slot in the ring pool
    # What the backend reads of the sequence's paged heads (its StepMetadata.chunk_pages:
    # torch: flat slots of positions [0, start + length) when start > 0; Triton: the
    # block table [num_blocks] int32)
    pages: torch.Tensor | None = None
    window: dict[RingKind, Any] = field(default_factory=dict)  # per ring kind: its class's
                                                              # prefill_geometry
    # Window state at snapshot points inside the chunk: per point, the scratch ring slot
    # that holds the ring as of the chunk's start, and per ring kind the chunk rows
    # [r] (relative to the chunk) that the ring holds at the point and their ring entries [r]
    snapshots: list[tuple[int, dict[RingKind, tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    # Position of the sequence's first generated token (its prompt's length): rows from
    # there on recompute tokens a decode step computed (a preempted sequence); None: unknown
    generated_from: int | None = None

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass
class PagedDecode:
    """A backend's metadata of a step's decode rows for the paged heads (StepContext.decode).
    Backends that read pages through block tables use it as is; others extend it."""
    block_tables: torch.Tensor | None = None         # [B, max_blocks] int32


def block_tables(rows: list[list[int]], device) -> torch.Tensor:
    """[B, max_blocks] int32 block tables, each row padded with block 0."""
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


@dataclass
class StepContext:
    positions: torch.Tensor                 # [T] int64
    full_slots: torch.Tensor                # [T] int64 paged-pool slot (block * block_size + offset)
    block_size: int = 16                    # tokens per block of the paged pool
    num_decode: int = 0
    decode_lens: torch.Tensor | None = None          # [B] tokens incl. the new one
    decode_ring_slots: torch.Tensor | None = None    # [B] int64
    decode_ring_index: dict[RingKind, torch.Tensor] = field(default_factory=dict)  # [B] ring entry
    decode: PagedDecode | None = None  # the backend's own metadata of the decode rows
    # Re-based (StreamingLLM) positions only: per ring kind, rotary tables (cos, sin)
    # [T, 1, D/2] turning each query back for the sink keys (HeadClass.rebased_tables).
    sink_rope: dict[RingKind, tuple[torch.Tensor, torch.Tensor]] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # A warm-up run of a captured step (engine.decode_capture): attention returns zeros
    # and writes nothing, as vLLM's dummy runs do.
    dry_run: bool = False


# Per thread: a decode step compiling in the background (engine.decode_capture) runs its
# dry steps while the engine thread runs real ones.
_LOCAL = threading.local()


@contextmanager
def step_context(ctx: StepContext):
    """Layers called inside the block, on this thread, read `ctx`; the context set before
    comes back after."""
    prev = getattr(_LOCAL, "ctx", None)
    _LOCAL.ctx = ctx
    try:
        yield ctx
    finally:
        _LOCAL.ctx = prev


def get_context() -> StepContext:
    ctx = getattr(_LOCAL, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside a model-runner step")
    return ctx
