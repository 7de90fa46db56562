"""The Triton attention backend: the kernels of headwise.kernels.triton_attention behind
the torch backend's signatures (see headwise.layers.torch_attention). Pages are read in
place through block tables; window heads read their ring with the position each entry
holds. Import only when this backend is chosen: Triton reads TRITON_INTERPRET when the
kernels are defined.
"""
from __future__ import annotations

import torch

from headwise.kernels import triton_attention as K
from headwise.layers.attention import WindowGroup
from headwise.layers.context import PrefillChunk, StepContext

NAME = "triton"
# Full heads read pages through block tables; window heads read ring positions.
PAGED = True


def full_decode(q, k_cache, v_cache, ctx: StepContext, scale: float) -> torch.Tensor:
    return K.paged_decode(q, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_lens,
                          ctx.block_size, scale)


def full_prefill(q, k, v, k_cache, v_cache, ctx: StepContext, ch: PrefillChunk,
                 scale: float) -> torch.Tensor:
    return K.paged_prefill(q, k_cache, v_cache, ch.block_table, ch.start, ctx.block_size, scale)


def window_decode(q, wg: WindowGroup, ctx: StepContext, q_sink, scale: float) -> torch.Tensor:
    return K.ring_decode(q, wg.k_ring, wg.v_ring, ctx.decode_ring_slots, ctx.decode_lens, scale)


def window_prefill(q, k, v, wg: WindowGroup, ctx: StepContext, ch: PrefillChunk,
                   q_sink, scale: float) -> torch.Tensor:
    geo = ch.window[(wg.sink, wg.window)]
    return K.window_prefill(q, k, v, wg.k_ring[ch.ring_slot], wg.v_ring[ch.ring_slot], geo.ring_pos,
                            ch.start, wg.sink, wg.window, scale)
