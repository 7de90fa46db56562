"""The `full` class: heads that keep every token, in the paged block pool, and attend all
of them (exact causal attention)."""
from __future__ import annotations

import torch

from headwise.heads.base import PAGED, HeadClass, register
from headwise.layers.kv_tensor import take


class FullHeads(HeadClass):
    name = "full"
    storage = PAGED
    fused_decode = True

    def attend(self, layer, group, ctx, q, kst, vst, out) -> None:
        # kst, vst: stored forms of the step's K/V [T, n, D] (+ scales [T, n]); written
        # as they are, attended as reads will return them.
        kc, vc, be = group.k, group.v, layer.backend
        if group.kv is not None:  # K and V in one write: [2, n, T, D]
            group.kv[:, :, ctx.full_slots] = torch.stack((kst[0], vst[0])).transpose(1, 2)
        else:
            at = (slice(None), ctx.full_slots)
            kc.put(at, *take(kst, lambda t: t.transpose(0, 1)))
            vc.put(at, *take(vst, lambda t: t.transpose(0, 1)))
        B = ctx.num_decode
        if B:
            out[:B] = be.full_decode(q[:B], kc, vc, ctx, layer.scale)
        if ctx.prefills:  # decode reads its own token back from the pool
            k, v = kc.decode(*kst), vc.decode(*vst)
        for ch in ctx.prefills:
            s = ch.rows
            out[s] = be.full_prefill(q[s], k[s], v[s], kc, vc, ctx, ch, layer.scale)


FULL = register(FullHeads())
