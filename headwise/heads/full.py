"""The `full` class: heads that keep every token, in the paged block pool, and attend all
of them (exact causal attention). Its attention for each backend is here too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from headwise.heads.base import PAGED, HeadClass, register
from headwise.kernels import cpu_kernels
from headwise.layers.context import PrefillChunk, StepContext
from headwise.layers.kv_tensor import KVTensor, take
from headwise.layers.torch_attention import kernel_takes, pool_call, scaled_attention

# Decode over a run of at least SPLIT_MIN_LEN cached tokens is split into SPLIT_PARTS
# pieces per thread; a sequence over more than MAX_RUNS runs of slots is gathered first
# (split_attention).
SPLIT_MIN_LEN = 2048
SPLIT_PARTS = 2
MAX_RUNS = 32


class FullHeads(HeadClass):
    name = "full"
    storage = PAGED
    fused_decode = True

    def attend(self, layer, group, ctx, q, kst, vst, out) -> None:
        # kst, vst: stored forms of the step's K/V [T, n, D] (+ scales [T, n]); written
        # as they are, attended as reads will return them.
        self.write(group, ctx, kst, vst)
        B = ctx.num_decode
        if B:
            out[:B] = self.decode(layer, group, ctx, q[:B])
        if ctx.prefills:  # decode reads its own token back from the pool
            k, v = group.k.decode(*kst), group.v.decode(*vst)
        prefill = _IMPLS[layer.backend.NAME][1]
        for ch in ctx.prefills:
            s = ch.rows
            k_cache, v_cache, at = self.prefill_source(group, ch, q.device)
            out[s] = prefill(q[s], k[s], v[s], k_cache, v_cache, ctx, at, layer.scale)

    def prefill_source(self, group, ch: PrefillChunk, device) -> tuple[KVTensor, KVTensor, PrefillChunk]:
        """The caches a prefill chunk attends (those before it in its sequence), with the
        chunk that addresses them: the pool itself."""
        return group.k, group.v, ch

    def write(self, group, ctx, kst, vst) -> None:
        """The step's K/V into the group's slots of the pool (ctx.full_slots)."""
        write_slots(group, ctx.full_slots, kst, vst)

    def decode(self, layer, group, ctx, q) -> torch.Tensor:
        """The decode rows' attention: q [B, n*g, D] -> [B, n*g, D]."""
        return _IMPLS[layer.backend.NAME][0](q, group.k, group.v, ctx, layer.scale)


# ---- the torch backend --------------------------------------------------------------
def torch_decode(q, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, scale: float) -> torch.Tensor:
    # q: [B, nf*g, D]; k_cache, v_cache: [nf, slots, D]. A sequence attends over views of
    # the pool, one per run of consecutive slots (no copy), merged by log-sum-exp
    # (split_attention); only a sequence scattered over more than MAX_RUNS runs is
    # concatenated first. Its g query heads per KV head are the query rows of one fused
    # SDPA call (in bfloat16 ~3x faster on CPU than matmul + softmax + matmul). A
    # quantized pool is attended in its stored form (scaled_attention, float32).
    B, H, D = q.shape
    nf = k_cache.shape[0]
    out = torch.empty_like(q)
    if kernel_takes(q, k_cache, ctx):  # a step with prefill chunks too: K/V written already
        pool_call(k_cache, v_cache, ctx.block_size, H // nf)(q, out, ctx.decode.block_tables,
                                                             ctx.decode.lens_i32, scale)
        return out
    for i in range(B):
        r = ctx.decode.runs[i]
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


def torch_prefill(q, k, v, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, ch: PrefillChunk,
                 scale: float) -> torch.Tensor:
    # q: [c, nf*g, D]; k, v: [c, nf, D], the chunk's own keys (already in the pool too).
    if ch.start == 0:
        o = cpu_kernels.prefill_attention(q, k, v, 0, scale)
    else:  # the pool holds the chunk's own keys too: positions [0, start + c)
        at = (slice(None), ch.pages)
        k_all, v_all = k_cache.load(at), v_cache.load(at)  # [nf, start + c, D]
        o = cpu_kernels.prefill_attention(q, k_all.transpose(0, 1), v_all.transpose(0, 1), ch.start, scale)
    if o is not None:
        return o
    qq = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, c, D]
    if ch.start == 0:
        kk = k.transpose(0, 1).unsqueeze(0)  # [1, nf, c, D]
        vv = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    if q.device.type == "cpu":
        return _later_chunk(q, k, v, k_all[:, :ch.start], v_all[:, :ch.start], scale)
    kk, vv = k_all.unsqueeze(0), v_all.unsqueeze(0)  # [1, nf, start + c, D]
    qpos = torch.arange(ch.start, ch.start + ch.length, device=q.device)
    mask = torch.arange(ch.start + ch.length, device=q.device)[None, :] <= qpos[:, None]
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _later_chunk(q, k, v, k_past, v_past, scale: float) -> torch.Tensor:
    """A chunk after the first on the CPU: q [c, nf*g, D] over the earlier positions'
    k_past, v_past [nf, start, D] and its own k, v [c, nf, D] -> [c, nf*g, D].

    Two calls of PyTorch's fused CPU kernel merged by their log-sum-exp, with no mask: the
    earlier positions unmasked (each KV head's g query heads as the rows of one call, so
    its keys are read once and never repeated), the chunk's own causally (its top-left
    diagonal is the right one for a square). A [c, start + c] boolean mask, which SDPA
    turns into a float one added to every score, made the same attention 20-25% slower
    (Qwen2.5-Coder-0.5B's heads, chunks of 2048 at 8K and 32K)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    c, H, D = q.shape
    nf = k.shape[1]
    g = H // nf
    qg = q.view(c, nf, g, D).permute(1, 2, 0, 3).reshape(1, nf, g * c, D)
    o1, l1 = flash(qg, k_past[None], v_past[None], 0.0, False, scale=scale)[:2]  # [1, nf, g*c, D], [1, nf, g*c]
    k_own = k.transpose(0, 1).repeat_interleave(g, 0)[None]  # [1, H, c, D]
    v_own = v.transpose(0, 1).repeat_interleave(g, 0)[None]
    o2, l2 = flash(q.transpose(0, 1)[None], k_own, v_own, 0.0, True, scale=scale)[:2]  # [1, H, c, D], [1, H, c]
    o1 = o1.reshape(H, c, D)
    # softmax over the union = o1 + sigmoid(lse2 - lse1) * (o2 - o1)
    w = torch.sigmoid(l2[0] - l1.reshape(H, c)).to(o1.dtype)[..., None]
    return o1.lerp_(o2[0], w).transpose(0, 1)


# ---- the Triton backend: pages read in place through block tables ----------------------
# (headwise.kernels.triton_attention is imported on first use: Triton reads
# TRITON_INTERPRET when its kernels are defined.)
def triton_decode(q, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, scale: float) -> torch.Tensor:
    from headwise.kernels import triton_attention as K

    return K.paged_decode(q, k_cache.data, v_cache.data, ctx.decode.block_tables, ctx.decode_lens,
                          ctx.block_size, scale, k_scale=k_cache.scale, v_scale=v_cache.scale)


def triton_prefill(q, k, v, k_cache: KVTensor, v_cache: KVTensor, ctx: StepContext, ch: PrefillChunk,
                   scale: float) -> torch.Tensor:
    from headwise.kernels import triton_attention as K

    return K.paged_prefill(q, k_cache.data, v_cache.data, ch.pages, ch.start, ctx.block_size, scale,
                           k_scale=k_cache.scale, v_scale=v_cache.scale)


def write_slots(group, slots: torch.Tensor, kst, vst) -> None:
    """K/V [T, n, D] (+ scales [T, n]) into `slots` [T] of the group's pool, on the pool's
    device (select heads' home pool may be host memory: the values move there; the
    caller gives slots there)."""
    home = group.k.data.device
    if group.kv is not None:  # K and V in one write: [2, n, T, D]
        group.kv[:, :, slots] = torch.stack((kst[0], vst[0])).transpose(1, 2).to(home)
    else:
        at = (slice(None), slots)
        group.k.put(at, *take(kst, lambda t: t.transpose(0, 1).to(home)))
        group.v.put(at, *take(vst, lambda t: t.transpose(0, 1).to(home)))


_IMPLS = {"torch": (torch_decode, torch_prefill), "triton": (triton_decode, triton_prefill)}
FULL = register(FullHeads())
