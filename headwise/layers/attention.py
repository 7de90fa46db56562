"""Head-split attention over the cache views the model runner binds into each layer.

Within a layer the KV heads are ordered full heads first, then window heads grouped by
(sink, window); the model's projection weights are permuted to match at load time
(see headwise.models.head_order), so every class is a contiguous slice.
Full heads read and write paged blocks; window heads read and write a fixed-size ring.
The layer writes the cache; the attention itself is the bound backend's (one function
per head class and operation, see layers.torch_attention). Cache views are KVTensors
(layers.kv_tensor): a quantized class's K/V are written once, quantized, and the step's
own K/V are attended in their round-tripped form, as later reads will see them.

Under torch.compile (engine.decode_capture) the layer is one opaque custom op,
headwise::attention: the cache writes and the backend's data-dependent Python run as they
do eagerly, and the code around them is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from headwise.layers import opaque
from headwise.layers.context import get_context
from headwise.layers.kv_tensor import KVTensor, take
from headwise.layers.rotary import rotate


@torch.library.custom_op("headwise::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """HeadSplitAttention.attend of the layer whose op_key is `layer` (see layers.opaque).
    Its cache writes are the layer's own state, which nothing else in a graph touches."""
    return opaque.lookup(layer).attend(q, k, v)


@attention_op.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


@dataclass
class WindowGroup:
    """One layer's view of a window group's rings: every ring slot, n heads."""
    kv_start: int          # first KV head of the group within the layer
    kv_end: int
    sink: int
    window: int
    k_ring: KVTensor       # [num_ring_slots, n_heads, sink + window, D] view
    v_ring: KVTensor
    kv_ring: torch.Tensor | None = None  # [2, num_ring_slots, n_heads, sink + window, D]
                                         # K and V values together (None: quantized)


class HeadSplitAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale  # of q.k
        # Bound by the model runner; the layer never allocates cache memory.
        self.num_full = num_kv_heads
        self.k_full: KVTensor | None = None  # [num_full, num_slots, D]
        self.v_full: KVTensor | None = None
        self.kv_full: torch.Tensor | None = None
        self.window_groups: list[WindowGroup] = []
        self.backend: ModuleType | None = None
        self.backend_state = None
        # Optional callback (q, k, v) used by calibration to read a layer's heads.
        self.observer = None

    def bind(self, num_full: int, k_full, v_full, window_groups: list[WindowGroup],
             kv_full: torch.Tensor | None, backend: ModuleType) -> None:
        # kv_full: the full heads' K and V values together [2, nf, slots, D] (one write
        # for both), None when quantized
        self.num_full = num_full
        self.k_full, self.v_full, self.kv_full = k_full, v_full, kv_full
        self.window_groups = window_groups
        self.backend = backend
        self.backend_state = None  # whatever the backend keeps per layer (built on first use)
        caches = ([k_full] if num_full else []) + [wg.k_ring for wg in window_groups]
        # When every class of the layer stores K/V alike, the step's K/V are encoded
        # once for all heads (a quantized step is a dozen small ops per call).
        self._shared = caches[0] if all(c.format == caches[0].format for c in caches) else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied) -> [T, Hq, D]
        if torch.compiler.is_dynamo_compiling():
            return attention_op(q, k, v, self.op_key)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.observer is not None:
            self.observer(q, k, v)
        ctx = get_context()
        if ctx.dry_run:  # a compile warm-up: shapes only, the cache untouched
            return torch.zeros_like(q)
        fused = self.backend.fused_decode(self, ctx, q, k, v)
        if fused is not None:
            return fused
        out = torch.empty_like(q)
        g = self.group
        nf = self.num_full
        # Stored forms (values, scales) of the step's K and V, per class.
        shared = None if self._shared is None else self._shared.encode_kv(k, v)

        def forms(cache: KVTensor, heads: slice):
            if shared is None:
                return cache.encode_kv(k[:, heads], v[:, heads])
            return tuple(take(f, lambda t: t[:, heads]) for f in shared)

        if nf:
            self._full(ctx, q[:, : nf * g], *forms(self.k_full, slice(0, nf)), out[:, : nf * g])
        for wg in self.window_groups:
            qs = slice(wg.kv_start * g, wg.kv_end * g)
            ks = slice(wg.kv_start, wg.kv_end)
            self._window(ctx, wg, q[:, qs], *forms(wg.k_ring, ks), out[:, qs])
        return out

    def _full(self, ctx, q, kst, vst, out) -> None:
        # kst, vst: stored forms of the step's K/V [T, nf, D] (+ scales [T, nf]); written
        # as they are, attended as reads will return them.
        kc, vc, be = self.k_full, self.v_full, self.backend
        if self.kv_full is not None:  # K and V in one write: [2, nf, T, D]
            self.kv_full[:, :, ctx.full_slots] = torch.stack((kst[0], vst[0])).transpose(1, 2)
        else:
            at = (slice(None), ctx.full_slots)
            kc.put(at, *take(kst, lambda t: t.transpose(0, 1)))
            vc.put(at, *take(vst, lambda t: t.transpose(0, 1)))
        B = ctx.num_decode
        if B:
            out[:B] = be.full_decode(q[:B], kc, vc, ctx, self.scale)
        if ctx.prefills:  # decode reads its own token back from the pool
            k, v = kc.decode(*kst), vc.decode(*vst)
        for ch in ctx.prefills:
            s = ch.rows
            out[s] = be.full_prefill(q[s], k[s], v[s], kc, vc, ctx, ch, self.scale)

    def _window(self, ctx, wg: WindowGroup, q, kst, vst, out) -> None:
        be, kind = self.backend, (wg.sink, wg.window)
        sink_rope = ctx.sink_rope[kind] if ctx.sink_rope and wg.sink else None
        B = ctx.num_decode
        if B:
            ridx, slots = ctx.decode_ring_index[kind], ctx.decode_ring_slots
            # The new token overwrites position p - window, which it no longer sees.
            if wg.kv_ring is not None:  # K and V in one write: [B, 2, n, D]
                wg.kv_ring[:, slots, :, ridx] = torch.stack((kst[0][:B], vst[0][:B]), dim=1)
            else:
                at = (slots, slice(None), ridx)
                wg.k_ring.put(at, *take(kst, lambda t: t[:B]))
                wg.v_ring.put(at, *take(vst, lambda t: t[:B]))
            q_sink = None if sink_rope is None else rotate(q[:B], sink_rope[0][:B], sink_rope[1][:B])
            out[:B] = be.window_decode(q[:B], wg, ctx, q_sink, self.scale)
        if ctx.prefills:  # decode reads its own token back from the ring
            k, v = wg.k_ring.decode(*kst), wg.v_ring.decode(*vst)
        for ch in ctx.prefills:
            s = ch.rows
            q_sink = None if sink_rope is None else rotate(q[s], sink_rope[0][s], sink_rope[1][s])
            out[s] = be.window_prefill(q[s], k[s], v[s], wg, ctx, ch, q_sink, self.scale)
            # Written after attention: earlier queries of the chunk still need the
            # ring's older entries. Only tokens that survive the chunk are stored.
            geo = ch.window[kind]
            at = (ch.ring_slot, slice(None), geo.write_index)

            def kept(t: torch.Tensor) -> torch.Tensor:  # [c, n, ...] -> [n, kept, ...]
                return t[s][geo.write_rows].transpose(0, 1)

            wg.k_ring.put(at, *take(kst, kept))
            wg.v_ring.put(at, *take(vst, kept))
            # The state at a snapshot point inside the chunk: its scratch slot holds the
            # ring as of the chunk's start; add the chunk rows the ring holds at the point.
            for slot, writes in ch.snapshots:
                rows, index = writes[kind]
                at = (slot, slice(None), index)
                wg.k_ring.put(at, *take(kst, lambda t: t[s][rows].transpose(0, 1)))
                wg.v_ring.put(at, *take(vst, lambda t: t[s][rows].transpose(0, 1)))
