"""The Triton attention backend: the kernels of headwise.kernels.triton_attention behind
the torch backend's signatures (see headwise.layers.torch_attention). Pages are read in
place through block tables; window heads read their ring with the position each entry
holds. Import only when this backend is chosen: Triton reads TRITON_INTERPRET when the
kernels are defined.
"""
from __future__ import annotations

import torch

from headwise.kernels import triton_attention as K
from headwise.layers.attention import HeadGroup
from headwise.layers.context import PrefillChunk, StepContext
from headwise.layers.kv_tensor import KVTensor

NAME = "triton"
# Full heads read pages through block tables; window heads read ring positions.
PAGED = True


def decode_kernel(device: torch.device, spec, compute: torch.dtype) -> bool:
    """Whether decode of a class goes through the torch backend's C kernel (never here)."""
    return False


def fused_decode(layer, ctx: StepContext, q, k, v) -> None:
    """The torch backend's one-call decode of a layer; here decode goes the general way."""
    return None


def full_decode(q, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, scale: float) -> torch.Tensor:
    return K.paged_decode(q, k_cache.data, v_cache.data, ctx.decode_block_tables, ctx.decode_lens,
                          ctx.block_size, scale, k_scale=k_cache.scale, v_scale=v_cache.scale)


def full_prefill(q, k, v, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, ch: PrefillChunk,
                 scale: float) -> torch.Tensor:
    return K.paged_prefill(q, k_cache.data, v_cache.data, ch.block_table, ch.start, ctx.block_size, scale,
                           k_scale=k_cache.scale, v_scale=v_cache.scale)


def window_decode(q, wg: HeadGroup, ctx: StepContext, q_sink, scale: float) -> torch.Tensor:
    return K.ring_decode(q, wg.k.data, wg.v.data, ctx.decode_ring_slots, ctx.decode_lens, scale,
                         k_scale=wg.k.scale, v_scale=wg.v.scale)


def window_prefill(q, k, v, wg: HeadGroup, ctx: StepContext, ch: PrefillChunk,
                   q_sink, scale: float) -> torch.Tensor:
    geo = ch.window[wg.ring_kind]
    kr, vr = wg.k[ch.ring_slot], wg.v[ch.ring_slot]
    return K.window_prefill(q, k, v, kr.data, vr.data, geo.ring_pos, ch.start, wg.sink, wg.window, scale,
                            k_scale=kr.scale, v_scale=vr.scale)
