"""The `window` class: heads that keep the first `sink` tokens and the last `window`
(StreamingLLM / DuoAttention's streaming heads), in a ring of sink + window entries per
sequence, and attend only those. Its attention for each backend is here too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from headwise.heads.base import RING, HeadClass, LayoutError, register
from headwise.kernels import cpu_kernels
from headwise.layers import window_geometry as wgeo
from headwise.layers.attention import HeadGroup
from headwise.layers.context import PrefillChunk, StepContext
from headwise.layers.kv_tensor import take
from headwise.layers.rotary import rotate
from headwise.layers.torch_attention import attend, kernel_takes, ring_call, scaled_attention


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
        decode, prefill = _IMPLS[layer.backend.NAME]
        kind = group.ring_kind
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
            out[:B] = decode(q[:B], group, ctx, q_sink, layer.scale)
        if ctx.prefills:  # decode reads its own token back from the ring
            k, v = group.k.decode(*kst), group.v.decode(*vst)
        for ch in ctx.prefills:
            s = ch.rows
            q_sink = None if sink_rope is None else rotate(q[s], sink_rope[0][s], sink_rope[1][s])
            out[s] = prefill(q[s], k[s], v[s], group, ctx, ch, q_sink, layer.scale)
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


# ---- the torch backend --------------------------------------------------------------
def torch_decode(q, wg: HeadGroup, ctx: StepContext, q_sink: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    # q: [B, n*g, D]. When most ring slots are busy, attend over every slot of the group
    # in one batched matmul on the ring itself (no copy); otherwise gather the B rings.
    # Quantized rings are attended in their stored form (scaled_attention); a ring in
    # another float dtype is gathered and converted.
    # q_sink: the query for the sink entries under re-based positions (else None).
    slots, lens = ctx.decode_ring_slots, ctx.decode_lens
    B, H, D = q.shape
    S, n, R, _ = wg.k.shape
    if q_sink is None and kernel_takes(q, wg.k, ctx):  # K/V written already
        out = torch.empty_like(q)
        ring_call(wg, H // n, 0)(q, out, ctx.decode.ring_table, ctx.decode.lens_i32, scale)
        return out
    if q_sink is None and B <= 2 and ctx.decode.min_len >= R:
        # One or two sequences whose rings are full (no mask): fused SDPA on each ring in
        # place, 2.6x faster at one sequence (bfloat16, R = 576); slower from ~8.
        out = torch.empty_like(q)
        for i, s in enumerate(ctx.decode.ring_slots):
            out[i] = F.scaled_dot_product_attention(
                q[i].view(1, n, H // n, D), wg.k.load(slice(s, s + 1)), wg.v.load(slice(s, s + 1)),
                scale=scale).view(H, D)
        return out
    qs = q_sink
    if 2 * B >= S and (wg.k.plain or wg.k.quantized):
        qa = q.new_zeros(S, H, D)
        qa[slots] = q
        if q_sink is not None:
            qs = q.new_zeros(S, H, D)
            qs[slots] = q_sink
        la = torch.ones(S, dtype=torch.int64, device=q.device)  # idle slots: one finite (ignored) key
        la[slots] = lens
        kk, vv, rows = wg.k, wg.v, slots
    else:
        qa, la = q, lens
        kk, vv, rows = wg.k[slots], wg.v[slots], None
    valid = torch.arange(R, device=q.device)[None, :] < torch.clamp(la, max=R)[:, None]  # [S or B, R]
    qv = qa.view(-1, n, H // n, D)
    qsv = None if qs is None else (qs.view(-1, n, H // n, D), wg.sink)  # ring entries [0, sink): sinks
    if kk.quantized:
        o = scaled_attention(qv, kk, vv, scale, valid, qsv).reshape(-1, H, D)
        return o if rows is None else o[rows]
    kk, vv = kk.load(), vv.load()
    s = torch.matmul(qv, kk.transpose(-1, -2)).float() * scale  # [*, n, g, R]
    if qsv is not None:
        sk = wg.sink
        s[..., :sk] = torch.matmul(qsv[0], kk[:, :, :sk].transpose(-1, -2)).float() * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1).to(vv.dtype), vv).reshape(-1, H, D)
    return o if rows is None else o[rows]


def torch_prefill(q, k, v, wg: HeadGroup, ctx: StepContext, ch: PrefillChunk,
                   q_sink: torch.Tensor | None, scale: float) -> torch.Tensor:
    # q: [c, n*g, D]; k, v: [c, n, D] -> [c, n*g, D]. The ring still holds what earlier
    # chunks left (this chunk is written after the call).
    # A prompt's first sink + W positions see every earlier token, so those rows (q0 of
    # them) are plain causal attention, computed as such (no band overlap, no masks).
    # Every later query p sees two disjoint key sets, attended separately and merged
    # by their log-sum-exp:
    #   band: positions (p - W, p], read as overlapping strided views (no gather);
    #   sinks: positions s < sink with s <= p - W (the sinks the band has left).
    c, start, W = ch.length, ch.start, wg.window
    geo = ch.window[wg.ring_kind]
    k_ring, v_ring = wg.k[ch.ring_slot], wg.v[ch.ring_slot]  # [n, R, D] KVTensors
    if q_sink is None:
        o = _through_kernel(q, k, v, k_ring, v_ring, geo, start, wg.sink, W, scale)
        if o is not None:
            return o
    n, D = k.shape[1], k.shape[2]
    g = q.shape[1] // n
    q0 = geo.causal_rows
    out = q.new_empty(q.shape)
    if q0:
        o = F.scaled_dot_product_attention(
            q[:q0].transpose(0, 1)[None], k[:q0].transpose(0, 1)[None], v[:q0].transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)  # [1, n*g, q0, D]
        out[:q0] = o[0].transpose(0, 1)
        if q0 == c:
            return out
    # Band rows: positions [s2, s2 + c2) of the chunk's rows [q0, c).
    s2, c2 = start + q0, c - q0
    masks = geo.masks
    Bq, nb = masks.block, masks.num_blocks
    S = W + Bq  # keys of block b: positions s2 + b*Bq - W + [0, S)
    # Keys of positions [base, s2 + nb*Bq), base = s2 - W; zero where no token exists.
    base = s2 - W
    kp = k.new_zeros(n, W + nb * Bq, D)
    vp = v.new_zeros(n, W + nb * Bq, D)
    lo = max(0, base)
    if lo < start:  # earlier context: the ring holds every position in [lo, start)
        kp[:, lo - base:start - base] = k_ring.load((slice(None), geo.ring_read))
        vp[:, lo - base:start - base] = v_ring.load((slice(None), geo.ring_read))
    a = max(lo, start)  # first position read from the chunk itself
    kp[:, a - base:start + c - base] = k[a - start:].transpose(0, 1)
    vp[:, a - base:start + c - base] = v[a - start:].transpose(0, 1)
    sn, st, sd = kp.stride()
    kb = kp.as_strided((n, nb, S, D), (sn, Bq * st, st, sd))  # [n, nb, S, D] overlapping
    vb = vp.as_strided((n, nb, S, D), (sn, Bq * st, st, sd))
    # GQA without copying keys: a block's g query heads of one KV head are its rows,
    # qb [n, nb, g, Bq, D], filled in one pass through a [nb, Bq, n, g, D] view (the
    # last block's rows past the chunk zero).
    nf, tail = divmod(c2, Bq)  # full blocks, rows of the last one
    qb = q.new_empty(n, nb, g, Bq, D)
    rows = qb.permute(1, 3, 0, 2, 4)  # [nb, Bq, n, g, D]: row i of block b is query b * Bq + i
    rows[:nf].copy_(q[q0:q0 + nf * Bq].view(nf, Bq, n, g, D))
    if tail:
        rows[nf, :tail].copy_(q[q0 + nf * Bq:].view(tail, n, g, D))
        rows[nf, tail:].zero_()
    qb = qb.view(n, nb, g * Bq, D)
    nh = masks.head.shape[1]  # blocks reaching before position 0 (their padding masked)
    if nh == 0:  # every block alike (no copy of the output)
        o, lse = attend(qb, kb, vb, masks.band, scale)
    else:
        o = q.new_empty(n, nb, g * Bq, D)
        lse = torch.empty(n, nb, g * Bq, dtype=torch.float32, device=q.device)
        o[:, :nh], lse[:, :nh] = attend(qb[:, :nh], kb[:, :nh], vb[:, :nh], masks.head, scale)
        if nh < nb:
            o[:, nh:], lse[:, nh:] = attend(qb[:, nh:], kb[:, nh:], vb[:, nh:], masks.band, scale)
    band = out[q0:]
    rows = o.view(n, nb, g, Bq, D).permute(1, 3, 0, 2, 4)  # as qb's
    band[:nf * Bq].view(nf, Bq, n, g, D).copy_(rows[:nf])
    if tail:
        band[nf * Bq:].view(tail, n, g, D).copy_(rows[nf, :tail])
    sink_bias = masks.sinks
    if sink_bias is None:  # no band row sees a sink outside its band
        return out
    ns, cq = sink_bias.shape[-1], sink_bias.shape[-2]
    r0 = c2 - cq  # first band row with p - W >= 0: it sees sink 0 outside its band
    n_ring = min(ns, start)  # sinks before the chunk are in the ring, the rest in k
    sinks = (slice(None), slice(0, n_ring))
    sk = torch.cat([k_ring.load(sinks), k[: ns - n_ring].transpose(0, 1)], 1)  # [n, ns, D]
    sv = torch.cat([v_ring.load(sinks), v[: ns - n_ring].transpose(0, 1)], 1)
    # Every query head against the few sink keys (repeated per head: ns rows each).
    qs = (q if q_sink is None else q_sink)[q0 + r0:].transpose(0, 1)[None]  # [1, n*g, cq, D] view
    o2, l2 = attend(qs, sk.repeat_interleave(g, 0)[None], sv.repeat_interleave(g, 0)[None], sink_bias, scale)
    o2 = o2[0].view(n, g, cq, D).permute(2, 0, 1, 3)  # [cq, n, g, D] (a view)
    l2 = l2[0].view(n, g, cq).permute(2, 0, 1)
    l1 = lse.view(n, nb, g, Bq).permute(1, 3, 0, 2).reshape(nb * Bq, n, g)[r0:c2]
    # softmax over the union = o1 + sigmoid(lse2 - lse1) * (o2 - o1), in one pass
    w = torch.sigmoid(l2 - l1).to(out.dtype)[..., None]
    band[r0:].view(cq, n, g, D).lerp_(o2, w)
    return out


def _through_kernel(q, k, v, k_ring, v_ring, geo, start: int, sink: int, W: int, scale: float):
    """The chunk in one call of the C prefill kernel (kernels/cpu_prefill.c), or None where
    it does not take it. Its keys: the sinks the band leaves out (ring entries [0, ns)),
    the band before the chunk (positions [start - W, start), geo.ring_read), the chunk's
    own; the kernel masks what each query does not see."""
    if not cpu_kernels.prefill_takes(q):
        return None  # what the kernel declines, before the ring's keys are copied for it
    band_pos = max(0, start - W)  # geo.ring_read's first position
    ns = min(sink, band_pos)
    if geo.ring_read is None and not ns:  # a first chunk: its own keys alone, no copy
        return cpu_kernels.prefill_attention(q, k, v, start, scale, window=W, sink=sink)
    ks, vs = [], []
    if ns:
        ks.append(k_ring.load((slice(None), slice(0, ns))))
        vs.append(v_ring.load((slice(None), slice(0, ns))))
    if geo.ring_read is not None:
        ks.append(k_ring.load((slice(None), geo.ring_read)))
        vs.append(v_ring.load((slice(None), geo.ring_read)))
    kk = torch.cat(ks + [k.transpose(0, 1)], 1).transpose(0, 1)  # [S, n, D]
    vv = torch.cat(vs + [v.transpose(0, 1)], 1).transpose(0, 1)
    return cpu_kernels.prefill_attention(q, kk, vv, start, scale, window=W, sink=sink, sinks_given=ns,
                                         band_pos=band_pos)


# ---- the Triton backend: rings read with the position each entry holds ---------------
# (headwise.kernels.triton_attention is imported on first use: Triton reads
# TRITON_INTERPRET when its kernels are defined.)
def triton_decode(q, wg: HeadGroup, ctx: StepContext, q_sink, scale: float) -> torch.Tensor:
    from headwise.kernels import triton_attention as K

    return K.ring_decode(q, wg.k.data, wg.v.data, ctx.decode_ring_slots, ctx.decode_lens, scale,
                         k_scale=wg.k.scale, v_scale=wg.v.scale)


def triton_prefill(q, k, v, wg: HeadGroup, ctx: StepContext, ch: PrefillChunk,
                   q_sink, scale: float) -> torch.Tensor:
    from headwise.kernels import triton_attention as K

    geo = ch.window[wg.ring_kind]
    kr, vr = wg.k[ch.ring_slot], wg.v[ch.ring_slot]
    return K.window_prefill(q, k, v, kr.data, vr.data, geo.ring_pos, ch.start, wg.sink, wg.window, scale,
                            k_scale=kr.scale, v_scale=vr.scale)


_IMPLS = {"torch": (torch_decode, torch_prefill), "triton": (triton_decode, triton_prefill)}
WINDOW = register(WindowHeads())
