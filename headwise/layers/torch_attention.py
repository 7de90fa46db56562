"""The PyTorch attention backend (CPU, and any device without Triton).

Four functions, one per (head class, operation), with the same signatures as the Triton
backend's (headwise.layers.triton_backend):
    full_decode(q, k_cache, v_cache, ctx, scale)                -> [B, nf*g, D]
    full_prefill(q, k, v, k_cache, v_cache, ctx, chunk, scale)  -> [c, nf*g, D]
    window_decode(q, wg, ctx, q_sink, scale)                    -> [B, n*g, D]
    window_prefill(q, k, v, wg, ctx, chunk, q_sink, scale)      -> [c, n*g, D]
The layer has already written the step's full-head K/V into the pool and the decode
tokens' window-head K/V into the rings; prefill ring writes follow the call. Caches are
KVTensors: decode attends a quantized class in its stored form (scaled_attention), other
reads dequantize only the sequence or ring at hand.

Two hooks every backend has as well:
    decode_kernel(device, spec, compute) -> bool: whether decode of a head class stored as
        `spec` (a KVClassSpec) goes through the C kernel, so the runner builds its metadata
    fused_decode(layer, ctx, q, k, v) -> [B, Hq, D] or None: a whole decode-only step of
        a layer (writes and attention), or None for the four functions above.
On the CPU, decode rows go through headwise's C kernel (kernels/cpu_decode.c): a
decode-only step in fused_decode, the decode rows of a step with prefill chunks in
full_decode / window_decode; the PyTorch code below serves where the kernel does not
(no compiler, caches it does not take, re-based positions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from headwise.cache.spec import KVClassSpec
from headwise.kernels import cpu_kernels
from headwise.layers.attention import HeadGroup, HeadSplitAttention
from headwise.layers.context import PrefillChunk, StepContext
from headwise.layers.kv_tensor import KVTensor

NAME = "torch"
# Full heads read slot runs and gathered slots; window heads read band masks.
PAGED = False
# Decode over a run of at least SPLIT_MIN_LEN cached tokens is split into SPLIT_PARTS
# pieces per thread; a sequence over more than MAX_RUNS runs of slots is gathered first
# (split_attention).
SPLIT_MIN_LEN = 2048
SPLIT_PARTS = 2
MAX_RUNS = 32


def decode_kernel(device: torch.device, spec: KVClassSpec, compute: torch.dtype) -> bool:
    """Whether decode of a head class stored as `spec` attends through the C kernel
    (kernels/cpu_decode.c): on the CPU where it compiled, a storage it takes. It then
    needs block tables and int32 lengths, not slot runs."""
    return (device.type == "cpu" and cpu_kernels.takes(compute, spec.dtype, spec.scale_dtype, spec.head_dim)
            and cpu_kernels.library() is not None)


def pool_call(k: KVTensor, v: KVTensor, block_size: int, g: int, head: int = 0) -> cpu_kernels.DecodeCall:
    """The C kernel's call for a paged group: K/V [n, slots, D] (+ scales [n, slots]), the
    group being KV heads [head, head + n) of the queries it is given."""
    scales = None if k.scale is None else (k.scale, v.scale, block_size * k.scale.stride(1))
    return cpu_kernels.DecodeCall(k.data, v.data, block_size, block_size * k.data.stride(1), g, head,
                                  scales=scales)


def ring_call(wg: HeadGroup, g: int, head: int) -> cpu_kernels.DecodeCall:
    """The C kernel's call for a ring group's rings [S, n, R, D] (+ scales [S, n, R]),
    the group being KV heads [head, head + n) of the queries it is given."""
    k, v = wg.k.data.transpose(0, 1), wg.v.data.transpose(0, 1)  # [n, S, R, D]
    scales = None
    if wg.k.scale is not None:
        ks, vs = wg.k.scale.transpose(0, 1), wg.v.scale.transpose(0, 1)  # [n, S, R]
        scales = (ks, vs, ks.stride(1))
    R = k.shape[2]
    return cpu_kernels.DecodeCall(k, v, R, k.stride(1), g, head, cap=R, scales=scales)


class KernelCalls:
    """A layer's C-kernel calls (cpu_kernels.DecodeCall), one per head group: a paged
    group's reads the block pool through block tables, a ring group's its rings (with its
    (sink, window), whose ring entry the new token takes). Built on the layer's first
    decode step; a layer whose caches the kernel does not take (fp8, another dtype), or
    with a class that does not allow it (HeadClass.fused_decode), gets none and keeps the
    code below."""

    def __init__(self, layer: HeadSplitAttention, q: torch.Tensor, block_size: int) -> None:
        self.ok = all(grp.head_class.fused_decode and cpu_kernels.usable(q, grp.k) for grp in layer.groups)
        if not self.ok:
            return
        g = layer.group
        # Ring groups with their kind (whose ring entry the new token takes).
        self.paged = [pool_call(grp.k, grp.v, block_size, g, grp.kv_start) for grp in layer.groups if grp.paged]
        self.rings = [(ring_call(grp, g, grp.kv_start), grp.ring_kind) for grp in layer.groups if not grp.paged]


def _kernel_takes(q: torch.Tensor, cache: KVTensor, ctx: StepContext) -> bool:
    """Whether the C kernel attends these decode rows (the runner built its metadata)."""
    return ctx.decode_lens_i32 is not None and cpu_kernels.usable(q, cache)


def fused_decode(layer: HeadSplitAttention, ctx: StepContext, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor | None:
    """A decode-only step of one layer (q [B, Hq, D]; k, v [B, Hkv, D]): each class's cache
    write and attention in one C call, into one output [B, Hq, D]; or None where it does
    not apply (prefill chunks in the step, re-based positions, no kernel, caches it does
    not take), and the layer goes the general way."""
    if ctx.prefills or ctx.decode_lens_i32 is None or ctx.sink_rope:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or not q.dtype == k.dtype == v.dtype:
        return None
    calls = layer.backend_state
    if calls is None:
        calls = layer.backend_state = KernelCalls(layer, q, ctx.block_size)
    if not calls.ok:
        return None
    out = torch.empty_like(q)
    lens = ctx.decode_lens_i32
    for call in calls.paged:  # the new token's key row is its position
        call(q, out, ctx.decode_block_tables, lens, layer.scale, (k, v, ctx.positions))
    for call, kind in calls.rings:
        call(q, out, ctx.decode_ring_table, lens, layer.scale, (k, v, ctx.decode_ring_index[kind]))
    return out


# ---- full heads: paged blocks -----------------------------------------------------
def full_decode(q, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, scale: float) -> torch.Tensor:
    # q: [B, nf*g, D]; k_cache, v_cache: [nf, slots, D]. A sequence attends over views of
    # the pool, one per run of consecutive slots (no copy), merged by log-sum-exp
    # (split_attention); only a sequence scattered over more than MAX_RUNS runs is
    # concatenated first. Its g query heads per KV head are the query rows of one fused
    # SDPA call (in bfloat16 ~3x faster on CPU than matmul + softmax + matmul). A
    # quantized pool is attended in its stored form (scaled_attention, float32).
    B, H, D = q.shape
    nf = k_cache.shape[0]
    out = torch.empty_like(q)
    if _kernel_takes(q, k_cache, ctx):  # a step with prefill chunks too: K/V written already
        pool_call(k_cache, v_cache, ctx.block_size, H // nf)(q, out, ctx.decode_block_tables,
                                                             ctx.decode_lens_i32, scale)
        return out
    for i in range(B):
        r = ctx.decode_runs[i]
        qi = q[i].view(nf, H // nf, D)
        if k_cache.quantized:
            o = scaled_attention(qi, _gather(k_cache, r), _gather(v_cache, r), scale)
        elif len(r) > MAX_RUNS:
            o = split_attention(qi, [(_gather(k_cache, r).load(), _gather(v_cache, r).load())], scale)
        else:
            o = split_attention(qi, [(k_cache[:, a:a + n].load(), v_cache[:, a:a + n].load()) for a, n in r],
                                scale)  # views [nf, n, D] of the pool
        out[i] = o.view(H, D)
    return out


def _gather(cache: KVTensor, runs: list[tuple[int, int]]) -> KVTensor:
    """[nf, L, D] of a sequence's runs of slots: a view for one run, else a copy."""
    if len(runs) == 1:
        (a, n), = runs
        return cache[:, a:a + n]
    return KVTensor.cat([cache[:, a:a + n] for a, n in runs], 1)


def split_attention(q: torch.Tensor, runs: list[tuple[torch.Tensor, torch.Tensor]],
                    scale: float) -> torch.Tensor:
    """One sequence's decode attention, q [n, g, D] over the concatenation of the runs'
    k, v [n, L_i, D] -> [n, g, D], without concatenating them.

    Each run is attended on its own and the results merged by their log-sum-exp, as
    flash-decoding does on GPUs. PyTorch's CPU flash kernel parallelises over (batch,
    head, query block), so a decode call with one KV head (Gemma 3 has one per layer) is
    one task on one core; a long run is therefore also cut into SPLIT_PARTS * threads
    pieces attended as a batch (strided views)."""
    if len(runs) == 1 and runs[0][0].shape[1] < SPLIT_MIN_LEN:
        k, v = runs[0]
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs, lses = [], []
    parts = SPLIT_PARTS * torch.get_num_threads()
    for k, v in runs:
        n, L, D = k.shape
        c = L // parts if L >= SPLIT_MIN_LEN and parts > 1 and k.stride(-2) == D else 0
        if c:  # [n, L, D] -> [parts, n, c, D] views of the first parts * c rows
            kp, vp = (x[:, :parts * c].unflatten(1, (parts, c)).transpose(0, 1) for x in (k, v))
            o, lse = flash(q[None].expand(parts, *q.shape), kp, vp, 0.0, False, scale=scale)[:2]
            outs.append(o), lses.append(lse)
            k, v = k[:, parts * c:], v[:, parts * c:]
        if k.shape[1]:
            o, lse = flash(q[None], k[None], v[None], 0.0, False, scale=scale)[:2]  # [1, n, g, D], [1, n, g]
            outs.append(o), lses.append(lse)
    w = torch.softmax(torch.cat(lses), dim=0).unsqueeze(-1)  # [pieces, n, g, 1]: each piece's share
    return (torch.cat(outs).float() * w).sum(0).to(q.dtype)


def full_prefill(q, k, v, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, ch: PrefillChunk,
                 scale: float) -> torch.Tensor:
    # q: [c, nf*g, D]; k, v: [c, nf, D], the chunk's own keys (already in the pool too).
    qq = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, c, D]
    if ch.start == 0:
        kk = k.transpose(0, 1).unsqueeze(0)  # [1, nf, c, D]
        vv = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
    else:
        at = (slice(None), ch.slots)
        kk = k_cache.load(at).unsqueeze(0)  # [1, nf, start + c, D]
        vv = v_cache.load(at).unsqueeze(0)
        qpos = torch.arange(ch.start, ch.start + ch.length, device=q.device)
        mask = torch.arange(ch.start + ch.length, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


# ---- window heads: sink + recent ring ------------------------------------------------
def window_decode(q, wg: HeadGroup, ctx: StepContext, q_sink: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    # q: [B, n*g, D]. When most ring slots are busy, attend over every slot of the group
    # in one batched matmul on the ring itself (no copy); otherwise gather the B rings.
    # Quantized rings are attended in their stored form (scaled_attention); a ring in
    # another float dtype is gathered and converted.
    # q_sink: the query for the sink entries under re-based positions (else None).
    slots, lens = ctx.decode_ring_slots, ctx.decode_lens
    B, H, D = q.shape
    S, n, R, _ = wg.k.shape
    if q_sink is None and _kernel_takes(q, wg.k, ctx):  # K/V written already
        out = torch.empty_like(q)
        ring_call(wg, H // n, 0)(q, out, ctx.decode_ring_table, ctx.decode_lens_i32, scale)
        return out
    if q_sink is None and B <= 2 and ctx.decode_min_len >= R:
        # One or two sequences whose rings are full (no mask): fused SDPA on each ring in
        # place, 2.6x faster at one sequence (bfloat16, R = 576); slower from ~8.
        out = torch.empty_like(q)
        for i, s in enumerate(ctx.decode_ring_slot_list):
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


def scaled_attention(q, k: KVTensor, v: KVTensor, scale: float, valid: torch.Tensor | None = None,
                     q_sink=None) -> torch.Tensor:
    """Decode attention over quantized K/V in their stored form: per-token scales multiply
    the scores and the probabilities instead of the values, so no scaled copy of K or V
    is written (int8 and fp8 convert to float32 exactly). All in float32: the scores are
    as exact as SDPA's, and float32 matmuls of a length that changes every step run
    without the ~0.5 ms oneDNN spends on each new bfloat16 matmul shape on this CPU.
    q [*, n, g, D]; k, v [*, n, L, D] (+ scales [*, n, L]); valid [*, L] or None;
    q_sink (query for the entries [0, sink), sink) or None -> [*, n, g, D] in q's dtype."""
    kq, vq = k.data.float(), v.data.float()
    kscale = (k.scale.float() * scale).unsqueeze(-2)  # [*, n, 1, L]
    s = torch.matmul(q.float(), kq.transpose(-1, -2)).mul_(kscale)  # [*, n, g, L]
    if q_sink is not None:
        qs, sk = q_sink
        s[..., :sk] = torch.matmul(qs.float(), kq[..., :sk, :].transpose(-1, -2)) * kscale[..., :sk]
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).mul_(v.scale.float().unsqueeze(-2))
    return torch.matmul(p, vq).to(q.dtype)


def window_prefill(q, k, v, wg: HeadGroup, ctx: StepContext, ch: PrefillChunk,
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


def attend(q, k, v, bias: torch.Tensor, scale: float,
           fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q: [B, H, L, D]; k, v: [B, H, S, D]; bias: additive
    (see window_geometry.bias), broadcastable to [B, H, L, S], every row with a finite
    entry. Returns out [B, H, L, D] and lse [B, H, L] (float32). fused (default: on CPU)
    uses PyTorch's fused CPU kernel, which returns the lse it computes."""
    if q.device.type == "cpu" if fused is None else fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias.expand(*q.shape[:-1], k.shape[-2]), scale=scale)
        return o, lse.float()
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v), lse
