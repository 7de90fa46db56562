"""The `window` class: heads that keep the first `sink` tokens and the last `window`
(StreamingLLM / DuoAttention's streaming heads), in a ring of sink + window entries per
sequence, and attend only those."""
from __future__ import annotations

import torch

from headwise.heads.base import RING, HeadClass, LayoutError, register
from headwise.layers import window_geometry as wgeo
from headwise.layers.kv_tensor import take
from headwise.layers.rotary import rotate


class WindowHeads(HeadClass):
    name = "window"
    storage = RING
    params = ("sink", "window")
    fused_decode = True

    def check(self, spec) -> None:
        if not isinstance(spec.window, int) or spec.window < 1:
            raise LayoutError(f"window must be an integer >= 1, got {spec.window!r}")
        if not isinstance(spec.sink, int) or spec.sink < 0:
            raise LayoutError(f"sink must be an integer >= 0, got {spec.sink!r}")

    def ring_size(self, spec) -> int:
        return spec.sink + spec.window

    def describe(self, spec) -> str:
        return f"window (sink {spec.sink}, window {spec.window})"

    # Ring entry of position p: p while p < sink, else sink + (p - sink) mod window.
    def ring_index(self, pos, sink: int, window: int):
        return wgeo.ring_index(pos, sink, window)

    def ring_writes(self, start: int, length: int, sink: int, window: int, device):
        return wgeo.ring_writes(start, length, sink, window, device)

    def prefill_geometry(self, start, length, sink, window, g, dtype, device, for_kernels):
        return wgeo.window_chunk(start, length, sink, window, g, dtype, device, for_kernels=for_kernels)

    def rebased_tables(self, rotary, positions, sink: int, window: int):
        # Each query turned back by max(0, p - (sink + window - 1)) for the sink keys.
        return rotary.back_tables((positions - (sink + window - 1)).clamp(min=0))

    def attend(self, layer, group, ctx, q, kst, vst, out) -> None:
        be, kind = layer.backend, group.ring_kind
        sink_rope = ctx.sink_rope[kind] if ctx.sink_rope and group.sink else None
        B = ctx.num_decode
        if B:
            ridx, slots = ctx.decode_ring_index[kind], ctx.decode_ring_slots
            # The new token overwrites position p - window, which it no longer sees.
            if group.kv is not None:  # K and V in one write: [B, 2, n, D]
                group.kv[:, slots, :, ridx] = torch.stack((kst[0][:B], vst[0][:B]), dim=1)
            else:
                at = (slots, slice(None), ridx)
                group.k.put(at, *take(kst, lambda t: t[:B]))
                group.v.put(at, *take(vst, lambda t: t[:B]))
            q_sink = None if sink_rope is None else rotate(q[:B], sink_rope[0][:B], sink_rope[1][:B])
            out[:B] = be.window_decode(q[:B], group, ctx, q_sink, layer.scale)
        if ctx.prefills:  # decode reads its own token back from the ring
            k, v = group.k.decode(*kst), group.v.decode(*vst)
        for ch in ctx.prefills:
            s = ch.rows
            q_sink = None if sink_rope is None else rotate(q[s], sink_rope[0][s], sink_rope[1][s])
            out[s] = be.window_prefill(q[s], k[s], v[s], group, ctx, ch, q_sink, layer.scale)
            # Written after attention: earlier queries of the chunk still need the
            # ring's older entries. Only tokens that survive the chunk are stored.
            geo = ch.window[kind]
            at = (ch.ring_slot, slice(None), geo.write_index)

            def kept(t):  # [c, n, ...] -> [n, kept, ...]
                return t[s][geo.write_rows].transpose(0, 1)

            group.k.put(at, *take(kst, kept))
            group.v.put(at, *take(vst, kept))
            # The state at a snapshot point inside the chunk: its scratch slot holds the
            # ring as of the chunk's start; add the chunk rows the ring holds at the point.
            for slot, writes in ch.snapshots:
                rows, index = writes[kind]
                at = (slot, slice(None), index)
                group.k.put(at, *take(kst, lambda t: t[s][rows].transpose(0, 1)))
                group.v.put(at, *take(vst, lambda t: t[s][rows].transpose(0, 1)))


WINDOW = register(WindowHeads())
