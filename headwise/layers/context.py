"""Per-step batch metadata that attention layers read (built by the model runner).

Token order in a step: the decode tokens of all decoding sequences first, then each
prefill chunk in turn. Everything here is plain data built once per step, never per
layer: slot ids, block tables, ring slots, and the window heads' geometry.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from headwise.layers.window_geometry import WindowChunk

RingKind = tuple[str, int, int]  # (class, sink, window): heads.base.RingKind


@dataclass
class PrefillChunk:
    offset: int            # index of the chunk's first token in the flat batch
    start: int             # position of the chunk's first token in its sequence
    length: int            # number of tokens in the chunk
    slots: torch.Tensor    # full-pool slots of positions [0, start + length) if start > 0
                           # (torch backend), else of the chunk only
    ring_slot: int         # the sequence's slot in the window-head ring pool
    block_table: torch.Tensor | None = None  # [num_blocks] int32 (Triton backend only)
    window: dict[RingKind, WindowChunk] = field(default_factory=dict)  # per ring kind
    # Window state at snapshot points inside the chunk: per point, the scratch ring slot
    # that holds the ring as of the chunk's start, and per (sink, window) the chunk rows
    # [r] (relative to the chunk) that the ring holds at the point and their ring entries [r]
    snapshots: list[tuple[int, dict[RingKind, tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass
class StepContext:
    positions: torch.Tensor                 # [T] int64
    full_slots: torch.Tensor                # [T] int64 flat slot (block * block_size + offset)
    block_size: int = 16                    # tokens per full-pool block
    num_decode: int = 0
    decode_runs: list[list[tuple[int, int]]] | None = None  # per sequence: (first slot, length)
    decode_lens: torch.Tensor | None = None          # [B] tokens incl. the new one
    decode_ring_slots: torch.Tensor | None = None    # [B] int64
    # The same on the host, so per-layer choices need no device read back
    decode_min_len: int = 0                          # min(decode_lens)
    decode_ring_slot_list: list[int] = field(default_factory=list)  # decode_ring_slots
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (Triton backend,
                                                     # and the torch backend's C kernel)
    decode_lens_i32: torch.Tensor | None = None      # [B] int32 decode_lens (C kernel)
    decode_ring_table: torch.Tensor | None = None    # [B, 1] int32 ring slots (C kernel)
    decode_ring_index: dict[RingKind, torch.Tensor] = field(default_factory=dict)  # [B] ring entry
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
