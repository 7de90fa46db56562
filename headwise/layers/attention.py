"""Head-split attention over the cache views the cache manager hands each layer.

Within a layer the KV heads are ordered full heads first, then window heads grouped by
(sink, window); the model's projection weights are permuted to match at load time
(see headwise.models.head_order), so every class is a contiguous slice.
Full heads read and write paged blocks; window heads read and write a fixed-size ring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from headwise.layers.context import PrefillChunk, StepContext, get_context

# Query block size for window-head prefill: each block of this many queries reads the
# window + block keys before and at it, so the work is O(n * (sink + window)).
WINDOW_QUERY_BLOCK = 64


@dataclass
class WindowGroup:
    kv_start: int          # first KV head of the group within the layer
    kv_end: int
    sink: int
    window: int
    k_ring: torch.Tensor   # [num_ring_slots, n_heads, sink + window, D] view
    v_ring: torch.Tensor

    def ring_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Slot of position p: p while p < sink, else sink + (p - sink) mod window."""
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.window)


class HeadSplitAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # Bound by the cache manager; the layer never allocates cache memory.
        self.num_full = num_kv_heads
        self.k_full: torch.Tensor | None = None  # [num_full, num_slots, D]
        self.v_full: torch.Tensor | None = None
        self.window_groups: list[WindowGroup] = []
        # Optional callback (q, k, v) used by calibration to read a layer's heads.
        self.observer = None
        self.block_size = 16
        self._kernels = None  # headwise.kernels.triton_attention when that backend is bound
        # Set for StreamingLLM-style re-based positions: window heads then score sink keys
        # with the query rotated back by delta = max(0, p - (sink + window - 1)), the
        # distance the evicted tokens would have added. None: original positions.
        self.sink_rotary = None

    def bind(self, num_full: int, k_full, v_full, window_groups: list[WindowGroup],
             block_size: int = 16, backend: str = "torch") -> None:
        self.num_full = num_full
        self.k_full, self.v_full = k_full, v_full
        self.window_groups = window_groups
        self.block_size = block_size
        if backend == "triton":
            from headwise.kernels import triton_attention

            self._kernels = triton_attention
        else:
            self._kernels = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied) -> [T, Hq, D]
        if self.observer is not None:
            self.observer(q, k, v)
        ctx = get_context()
        out = torch.empty_like(q)
        g = self.group
        nf = self.num_full
        if nf:
            self._full(ctx, q[:, : nf * g], k[:, :nf], v[:, :nf], out[:, : nf * g])
        for wg in self.window_groups:
            qs = slice(wg.kv_start * g, wg.kv_end * g)
            ks = slice(wg.kv_start, wg.kv_end)
            self._window(ctx, wg, q[:, qs], k[:, ks], v[:, ks], out[:, qs])
        return out

    # ---- full heads: paged blocks -------------------------------------------------
    def _full(self, ctx: StepContext, q, k, v, out) -> None:
        kc, vc = self.k_full, self.v_full
        kc[:, ctx.full_slots] = k.transpose(0, 1)
        vc[:, ctx.full_slots] = v.transpose(0, 1)
        B = ctx.num_decode
        kern = self._kernels
        if kern is not None:  # Triton: pages read in place through block tables
            if B:
                out[:B] = kern.paged_decode(q[:B], kc, vc, ctx.decode_block_tables, ctx.decode_lens,
                                            self.block_size, self.scale)
            for ch in ctx.prefills:
                s = slice(ch.offset, ch.offset + ch.length)
                out[s] = kern.paged_prefill(q[s], kc, vc, ch.block_table, ch.start,
                                            self.block_size, self.scale)
            return
        if B:
            out[:B] = _paged_decode(q[:B], kc, vc, ctx.decode_runs, self.scale)
        for ch in ctx.prefills:
            s = slice(ch.offset, ch.offset + ch.length)
            qq = q[s].transpose(0, 1).unsqueeze(0)  # [1, Hq, c, D]
            if ch.start == 0:
                kk = k[s].transpose(0, 1).unsqueeze(0)  # [1, nf, c, D]
                vv = v[s].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                   scale=self.scale, enable_gqa=True)
            else:
                kk = kc.index_select(1, ch.slots).unsqueeze(0)  # [1, nf, start + c, D]
                vv = vc.index_select(1, ch.slots).unsqueeze(0)
                qpos = torch.arange(ch.start, ch.start + ch.length, device=q.device)
                mask = torch.arange(ch.start + ch.length, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
            out[s] = o[0].transpose(0, 1)

    # ---- window heads: sink + recent ring ----------------------------------------
    def _window(self, ctx: StepContext, wg: WindowGroup, q, k, v, out) -> None:
        B = ctx.num_decode
        if B:
            pos = ctx.positions[:B]
            ridx = wg.ring_index(pos)
            slots = ctx.decode_ring_slots
            # The new token overwrites position p - window, which it no longer sees.
            wg.k_ring[slots, :, ridx] = k[:B]
            wg.v_ring[slots, :, ridx] = v[:B]
            if self._kernels is not None:
                out[:B] = self._kernels.ring_decode(q[:B], wg.k_ring, wg.v_ring, slots,
                                                    ctx.decode_lens, self.scale)
            else:
                out[:B] = _ring_decode(q[:B], wg, slots, ctx.decode_lens, self.scale,
                                       self._sink_query(wg, q[:B], pos))
        for ch in ctx.prefills:
            s = slice(ch.offset, ch.offset + ch.length)
            cpos, rows, ridx = _ring_writes(ch, wg, q.device)
            if self._kernels is not None:
                ring_pos = _ring_positions(wg.sink, wg.window, ch.start, q.device)
                out[s] = self._kernels.window_prefill(
                    q[s], k[s], v[s], wg.k_ring[ch.ring_slot], wg.v_ring[ch.ring_slot], ring_pos,
                    ch.start, wg.sink, wg.window, self.scale)
            else:
                out[s] = self._window_prefill(wg, ch, q[s], k[s], v[s], self._sink_query(wg, q[s], cpos))
            # Written after attention: earlier queries of the chunk still need the
            # ring's older entries. Only tokens that survive the chunk are stored.
            wg.k_ring[ch.ring_slot, :, ridx] = k[s][rows].transpose(0, 1)
            wg.v_ring[ch.ring_slot, :, ridx] = v[s][rows].transpose(0, 1)

    def _sink_query(self, wg: WindowGroup, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        if self.sink_rotary is None or wg.sink == 0:
            return None
        delta = (pos - (wg.sink + wg.window - 1)).clamp(min=0)
        return self.sink_rotary.shift_back(q, delta)

    def _window_prefill(self, wg: WindowGroup, ch: PrefillChunk, q, k, v,
                        q_sink: torch.Tensor | None = None) -> torch.Tensor:
        # q: [c, n*g, D]; k, v: [c, n, D] -> [c, n*g, D].
        # A prompt's first sink + W positions see every earlier token, so those rows (q0 of
        # them) are plain causal attention, computed as such (no band overlap, no masks).
        # Every later query p sees two disjoint key sets, attended separately and merged
        # by their log-sum-exp:
        #   band: positions (p - W, p], read as overlapping strided views (no gather);
        #   sinks: positions s < sink with s <= p - W (the sinks the band has left).
        c, start, sink, W = ch.length, ch.start, wg.sink, wg.window
        n, D = k.shape[1], k.shape[2]
        g = q.shape[1] // n
        q0 = _causal_rows(ch, sink, W)
        out = q.new_empty(q.shape)
        if q0:
            o = F.scaled_dot_product_attention(
                q[:q0].transpose(0, 1)[None], k[:q0].transpose(0, 1)[None], v[:q0].transpose(0, 1)[None],
                is_causal=True, scale=self.scale, enable_gqa=True)  # [1, n*g, q0, D]
            out[:q0] = o[0].transpose(0, 1)
            if q0 == c:
                return out
        # Band rows: positions [s2, s2 + c2) of the chunk's rows [q0, c).
        s2, c2 = start + q0, c - q0
        masks = _window_biases(ch, sink, W, g, q.dtype, q.device)
        Bq, nb = masks.block, masks.num_blocks
        S = W + Bq  # keys of block b: positions s2 + b*Bq - W + [0, S)
        # Keys of positions [base, s2 + nb*Bq), base = s2 - W; zero where no token exists.
        base = s2 - W
        kp = k.new_zeros(n, W + nb * Bq, D)
        vp = v.new_zeros(n, W + nb * Bq, D)
        lo = max(0, base)
        if lo < start:  # earlier context: the ring holds every position in [lo, start)
            ridx = wg.ring_index(torch.arange(lo, start, device=q.device))
            kp[:, lo - base:start - base] = wg.k_ring[ch.ring_slot][:, ridx]
            vp[:, lo - base:start - base] = wg.v_ring[ch.ring_slot][:, ridx]
        a = max(lo, start)  # first position read from the chunk itself
        kp[:, a - base:start + c - base] = k[a - start:].transpose(0, 1)
        vp[:, a - base:start + c - base] = v[a - start:].transpose(0, 1)
        sn, st, sd = kp.stride()
        kb = kp.as_strided((n, nb, S, D), (sn, Bq * st, st, sd))  # [n, nb, S, D] overlapping
        vb = vp.as_strided((n, nb, S, D), (sn, Bq * st, st, sd))
        # GQA without copying keys: a block's g query heads of one KV head are its rows.
        qb = F.pad(q[q0:], (0, 0, 0, 0, 0, nb * Bq - c2)).view(nb, Bq, n, g, D)
        qb = qb.permute(2, 0, 3, 1, 4).reshape(n, nb, g * Bq, D)
        head_bias, band_bias, sink_bias = masks.head, masks.band, masks.sinks
        nh = head_bias.shape[1]  # blocks reaching before position 0 (their padding masked)
        o = q.new_empty(n, nb, g * Bq, D)
        lse = torch.empty(n, nb, g * Bq, dtype=torch.float32, device=q.device)
        if nh:
            o[:, :nh], lse[:, :nh] = _attend(qb[:, :nh], kb[:, :nh], vb[:, :nh], head_bias, self.scale)
        if nh < nb:
            o[:, nh:], lse[:, nh:] = _attend(qb[:, nh:], kb[:, nh:], vb[:, nh:], band_bias, self.scale)
        band = out[q0:]
        band.copy_(o.view(n, nb, g, Bq, D).permute(1, 3, 0, 2, 4).reshape(nb * Bq, n * g, D)[:c2])
        if sink_bias is None:  # no band row sees a sink outside its band
            return out
        ns = sink_bias.shape[-1]
        cq = sink_bias.shape[-2] // g
        r0 = c2 - cq  # first band row with p - W >= 0: it sees sink 0 outside its band
        n_ring = min(ns, start)  # sinks before the chunk are in the ring, the rest in k
        sk = torch.cat([wg.k_ring[ch.ring_slot][:, :n_ring], k[: ns - n_ring].transpose(0, 1)], 1)  # [n, ns, D]
        sv = torch.cat([wg.v_ring[ch.ring_slot][:, :n_ring], v[: ns - n_ring].transpose(0, 1)], 1)
        qs = (q if q_sink is None else q_sink)[q0 + r0:].view(cq, n, g, D).permute(1, 2, 0, 3).reshape(n, 1, g * cq, D)
        o2, l2 = _attend(qs, sk[:, None], sv[:, None], sink_bias, self.scale)
        o2 = o2.view(n, g, cq, D).permute(2, 0, 1, 3).reshape(cq, n * g, D)
        l2 = l2.view(n, g, cq).permute(2, 0, 1).reshape(cq, n * g)
        l1 = lse.view(n, nb, g, Bq).permute(1, 3, 0, 2).reshape(nb * Bq, n * g)[r0:c2]
        # softmax over the union = o1 + sigmoid(lse2 - lse1) * (o2 - o1)
        w = torch.sigmoid(l2 - l1).to(out.dtype)[..., None]
        band[r0:] += w * (o2 - band[r0:])
        return out


def _causal_rows(ch: PrefillChunk, sink: int, W: int) -> int:
    """Leading rows of a chunk whose window covers every earlier token (positions below
    sink + W). Taken only for a sequence's first chunk, whose earlier context is empty."""
    return min(ch.length, sink + W) if ch.start == 0 else 0


def _ring_writes(ch: PrefillChunk, wg: WindowGroup, device):
    """(positions of the chunk [c], chunk rows that survive into the ring, their ring
    slots): the same in every layer, so built once per chunk and (sink, window)."""
    key = (wg.sink, wg.window)
    if key not in ch.ring_writes:
        cpos = torch.arange(ch.start, ch.start + ch.length, device=device)
        rows = ((cpos < wg.sink) | (cpos >= ch.start + ch.length - wg.window)).nonzero().squeeze(1)
        ch.ring_writes[key] = (cpos, rows, wg.ring_index(cpos[rows]))
    return ch.ring_writes[key]


class BandMasks(NamedTuple):
    block: int                  # Bq, query rows per band block
    num_blocks: int             # nb
    head: torch.Tensor          # [1, nh, g*Bq, S]: blocks reaching before position 0
    band: torch.Tensor          # [1, 1, g*Bq, S]: every other block
    sinks: torch.Tensor | None  # [1, 1, g*cq, ns], None if no row sees a sink outside its band


def _window_biases(ch: PrefillChunk, sink: int, W: int, g: int, dtype, device) -> BandMasks:
    """The block geometry and additive masks of a chunk's band rows (see
    _window_prefill), the same in every layer, so built once per chunk. Mask rows are
    (query head, query) pairs of one KV head."""
    key = (sink, W, g, dtype)
    if key not in ch.window_biases:
        q0 = _causal_rows(ch, sink, W)
        c, start = ch.length - q0, ch.start + q0
        Bq = min(WINDOW_QUERY_BLOCK, c)
        nb = -(-c // Bq)
        S = W + Bq
        rel = torch.arange(S, device=device)[None, :] - torch.arange(Bq, device=device)[:, None]
        band = ((rel > 0) & (rel <= W)).repeat(g, 1)  # [g*Bq, S]: key j sees row i iff i < j <= i + W
        nh = min(nb, max(0, -(-(W - start) // Bq)))
        kpos = start - W + torch.arange(nh, device=device)[:, None] * Bq + torch.arange(S, device=device)
        head = band[None] & (kpos >= 0)[:, None, :]  # [nh, g*Bq, S]
        r0 = max(0, W - start)  # first query row with p - W >= 0
        ns = min(sink, start + c - W)  # sinks some query of the chunk sees outside its band
        sinks = None
        if r0 < c and ns > 0:
            qpos = torch.arange(start + r0, start + c, device=device)
            sm = (torch.arange(ns, device=device)[None, :] <= (qpos - W)[:, None]).repeat(g, 1)
            sinks = _bias(sm[None, None], dtype)
        ch.window_biases[key] = BandMasks(Bq, nb, _bias(head[None], dtype), _bias(band[None, None], dtype), sinks)
    return ch.window_biases[key]


def _bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    """Bool mask -> additive bias (0 where allowed, -inf elsewhere)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _attend(q, k, v, bias: torch.Tensor, scale: float,
            fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q: [B, H, L, D]; k, v: [B, H, S, D]; bias: additive
    (see _bias), broadcastable to [B, H, L, S], every row with a finite entry.
    Returns out [B, H, L, D] and lse [B, H, L] (float32). fused (default: on CPU) uses
    PyTorch's fused CPU kernel, which returns the lse it computes."""
    if q.device.type == "cpu" if fused is None else fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias.expand(*q.shape[:-1], k.shape[-2]), scale=scale)
        return o, lse.float()
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v), lse


def _ring_positions(sink: int, window: int, start: int, device=None) -> torch.Tensor:
    """Position held by each ring slot after tokens [0, start) were written; -1 if empty."""
    i = torch.arange(sink + window, device=device)
    pos = torch.where(i < min(sink, start), i, -1)
    last = start - 1
    if last >= sink:
        off_last = (last - sink) % window
        recent = last - ((off_last - (i - sink)) % window)
        pos = torch.where((i >= sink) & (recent >= sink), recent, pos)
    return pos


def _paged_decode(q, kc, vc, runs, scale) -> torch.Tensor:
    # q: [B, nf*g, D]; kc, vc: [nf, slots, D]. A sequence whose slots form one run attends
    # over a view of the pool (no copy); scattered runs are concatenated first. Its g query
    # heads per KV head are the query rows of one fused SDPA call (in bfloat16 ~3x faster
    # on CPU than matmul + softmax + matmul).
    B, H, D = q.shape
    nf = kc.shape[0]
    out = torch.empty_like(q)
    for i in range(B):
        r = runs[i]
        if len(r) == 1:
            a, n = r[0]
            k, v = kc[:, a:a + n], vc[:, a:a + n]  # [nf, L, D]
        else:
            k = torch.cat([kc[:, a:a + n] for a, n in r], 1)
            v = torch.cat([vc[:, a:a + n] for a, n in r], 1)
        o = F.scaled_dot_product_attention(q[i].view(1, nf, H // nf, D), k[None], v[None], scale=scale)
        out[i] = o.view(H, D)
    return out


def _ring_decode(q, wg: WindowGroup, slots, lens, scale, q_sink=None) -> torch.Tensor:
    # q: [B, n*g, D]. When most ring slots are busy, attend over every slot of the group
    # in one batched matmul on the ring itself (no copy); otherwise gather the B rings.
    # q_sink: the query for the sink entries under re-based positions (else None).
    B, H, D = q.shape
    S, n, R, _ = wg.k_ring.shape
    if q_sink is None and B <= 2 and bool((lens >= R).all()):
        # One or two sequences whose rings are full (no mask): fused SDPA on each ring in
        # place, 2.6x faster at one sequence (bfloat16, R = 576); slower from ~8.
        out = torch.empty_like(q)
        for i, s in enumerate(slots.tolist()):
            out[i] = F.scaled_dot_product_attention(
                q[i].view(1, n, H // n, D), wg.k_ring[s:s + 1], wg.v_ring[s:s + 1], scale=scale).view(H, D)
        return out
    qs = q_sink
    if 2 * B >= S:
        qa = q.new_zeros(S, H, D)
        qa[slots] = q
        if q_sink is not None:
            qs = q.new_zeros(S, H, D)
            qs[slots] = q_sink
        la = torch.ones(S, dtype=torch.int64, device=q.device)  # idle slots: one finite (ignored) key
        la[slots] = lens
        kk, vv, rows = wg.k_ring, wg.v_ring, slots
    else:
        qa, la = q, lens
        kk, vv, rows = wg.k_ring.index_select(0, slots), wg.v_ring.index_select(0, slots), None
    valid = torch.arange(R, device=q.device)[None, :] < torch.clamp(la, max=R)[:, None]  # [S or B, R]
    s = torch.matmul(qa.view(-1, n, H // n, D), kk.transpose(-1, -2)).float() * scale  # [*, n, g, R]
    if qs is not None:  # ring entries [0, sink) hold the sink tokens
        sk = wg.sink
        s[..., :sk] = torch.matmul(qs.view(-1, n, H // n, D), kk[:, :, :sk].transpose(-1, -2)).float() * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1).to(vv.dtype), vv).reshape(-1, H, D)
    return o if rows is None else o[rows]
