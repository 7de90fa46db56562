"""Per-step batch metadata that attention layers read (set by the model runner).

Token order in a step: the decode tokens of all decoding sequences first, then each
prefill chunk in turn. Every tensor here is built once per step, never per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    offset: int            # index of the chunk's first token in the flat batch
    start: int             # position of the chunk's first token in its sequence
    length: int            # number of tokens in the chunk
    slots: torch.Tensor    # full-pool slots of positions [0, start + length) if start > 0,
                           # else of the chunk only
    ring_slot: int         # the sequence's slot in the window-head ring pool
    block_table: torch.Tensor | None = None  # [num_blocks] int32 (Triton backend only)
    # Window-head attention biases of this chunk, built by the first layer that needs them
    # and reused by the rest (keyed by sink, window, group size, dtype).
    window_biases: dict = field(default_factory=dict)
    # Window-head ring writes of this chunk (positions, surviving rows, ring slots), keyed
    # by (sink, window); built once, like the biases.
    ring_writes: dict = field(default_factory=dict)


@dataclass
class StepContext:
    positions: torch.Tensor                 # [T] int64
    full_slots: torch.Tensor                # [T] int64 flat slot (block * block_size + offset)
    num_decode: int = 0
    decode_runs: list[list[tuple[int, int]]] | None = None  # per sequence: (first slot, length)
    decode_lens: torch.Tensor | None = None          # [B] tokens incl. the new one
    decode_ring_slots: torch.Tensor | None = None    # [B] int64
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (Triton backend)
    prefills: list[PrefillChunk] = field(default_factory=list)


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _CONTEXT
