"""Triton attention kernels for full heads (paged) and window heads (ring).

All four kernels handle grouped-query attention inside the kernel: one program owns one
KV head and computes every query head of its group against keys loaded once, so K/V are
never repeated. Scores use an online softmax (running max m, sum l, accumulator acc).

Shapes (per layer, per head class; D = head dim, g = query heads per KV head):
  full pool   k_cache, v_cache  [nf, num_slots, D]; slot = block * block_size + offset
  ring        k_ring, v_ring    [num_ring_slots, n, sink + window, D]
  decode      q [B, heads * g, D] -> [B, heads * g, D]
  prefill     q [c, heads * g, D] -> [c, heads * g, D] (one chunk of one sequence)

Quantized caches (int8, fp8) come with scales [same leading shape] (x ~ q * scale, one
per token and head); the kernels dequantize each tile as they load it (QUANT), into the
query's dtype, never a dequantized copy of the cache. A plain cache in another float
dtype than the query is converted in the load too.

CPU tests run these kernels through Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from headwise.kernels import fix_interpreter_for_numpy

fix_interpreter_for_numpy()

# Keys per tile. Decode splits long contexts over programs (flash-decoding) so that a
# single sequence still fills the GPU; TARGET_PROGRAMS is about two waves on an H200.
BLOCK_N = 64
BLOCK_M = 64
TARGET_PROGRAMS = 264
# Read once, as Triton itself does when the kernels below are defined.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _online_update(q, k, v, valid, m, l, acc, scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # q [M, BD], k/v [N, BD], valid [M, N]; m, l [M]; acc [M, BD] float32.
    if UPCAST:  # bf16 under the interpreter, whose dot cannot multiply bf16 (exact upcast)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid, s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # Rows with no valid key yet keep m = -inf; subtract 0 instead so exp gives 0, not nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the P @ V product runs in the cache dtype, as flash attention does
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


@triton.jit
def _load_kv(X, XS, Q, off, soff, lmask, kmask, QUANT: tl.constexpr):
    # A [N, BD] tile of K or V at element offsets off (scales at soff [N]), in Q's dtype.
    x = tl.load(X + off, mask=lmask, other=0)
    if QUANT:
        s = tl.load(XS + soff, mask=kmask, other=0)
        return (x.to(tl.float32) * s.to(tl.float32)[:, None]).to(Q.dtype.element_ty)
    return x.to(Q.dtype.element_ty)


@triton.jit
def _group_query(Q, sq_b, sq_h, b, h, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                 BD: tl.constexpr):
    # Decode: the g query heads of KV head h for sequence b, padded to G_PAD >= 16 rows
    # (the minimum tl.dot tile). Returns query heads, row mask, D lanes and q [G_PAD, BD].
    r = tl.arange(0, G_PAD)
    d = tl.arange(0, BD)
    rmask = r < G
    dmask = d < D
    qh = h * G + r
    q = tl.load(Q + b * sq_b + qh[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    return qh, rmask, d, dmask, q


@triton.jit
def _paged_decode_kernel(Q, K, V, KS, VS, TABLES, LENS, ACC, LSE,
                         sq_b, sq_h, sk_h, sk_s, ss_h, ss_s, st_b, sa_b, sa_h, sa_s, sl_b, sl_h,
                         scale, split_len,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         QUANT: tl.constexpr):
    # Program (sequence b, KV head h, split sp): keys [sp * split_len, ...) of sequence b.
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(LENS + b)
    lo = sp * split_len
    hi = tl.minimum(L, lo + split_len)
    qh, rmask, d, dmask, q = _group_query(Q, sq_b, sq_h, b, h, G, G_PAD, D, BD)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BD], tl.float32)
    for n0 in range(lo, hi, BN):
        kpos = n0 + tl.arange(0, BN)
        kmask = kpos < hi
        blk = tl.load(TABLES + b * st_b + kpos // BS, mask=kmask, other=0)
        slot = blk.to(tl.int64) * BS + kpos % BS
        off = h * sk_h + slot[:, None] * sk_s + d[None, :]
        soff = h * ss_h + slot * ss_s
        lmask = kmask[:, None] & dmask[None, :]
        k = _load_kv(K, KS, Q, off, soff, lmask, kmask, QUANT)
        v = _load_kv(V, VS, Q, off, soff, lmask, kmask, QUANT)
        m, l, acc = _online_update(q, k, v, kmask[None, :], m, l, acc, scale, IEEE, UPCAST)
    # Empty split (lo >= L): l = 0, lse = -inf, so the combine step gives it weight 0.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(ACC + b * sa_b + qh[:, None] * sa_h + sp * sa_s + d[None, :], out,
             mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + b * sl_b + qh * sl_h + sp, m + tl.log(tl.where(l == 0.0, 1.0, l)), mask=rmask)


@triton.jit
def _ring_decode_kernel(Q, K, V, KS, VS, RSLOT, LENS, OUT,
                        sq_b, sq_h, sk_slot, sk_h, sk_r, ss_slot, ss_h, ss_r, so_b, so_h, R, scale,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        BN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    # Program (sequence b, window head h). A ring slot is filled in order until all
    # sink + window entries hold a token, so the valid entries are [0, min(len, R)).
    b = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.minimum(tl.load(LENS + b), R)
    rs = tl.load(RSLOT + b).to(tl.int64)
    base = rs * sk_slot + h * sk_h
    sbase = rs * ss_slot + h * ss_h
    qh, rmask, d, dmask, q = _group_query(Q, sq_b, sq_h, b, h, G, G_PAD, D, BD)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BD], tl.float32)
    for n0 in range(0, L, BN):
        idx = n0 + tl.arange(0, BN)
        kmask = idx < L
        off = base + idx[:, None] * sk_r + d[None, :]
        lmask = kmask[:, None] & dmask[None, :]
        k = _load_kv(K, KS, Q, off, sbase + idx * ss_r, lmask, kmask, QUANT)
        v = _load_kv(V, VS, Q, off, sbase + idx * ss_r, lmask, kmask, QUANT)
        m, l, acc = _online_update(q, k, v, kmask[None, :], m, l, acc, scale, IEEE, UPCAST)
    out = acc / l[:, None]
    tl.store(OUT + b * so_b + qh[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _query_rows(Q, sq_t, sq_h, pid, h, c, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                BM: tl.constexpr):
    # Prefill rows are (query, query head) pairs of KV head h's group, so its g query
    # heads share every key tile. Returns query index, query head, row mask, D lanes, q.
    p = pid * BM + tl.arange(0, BM)
    pmask = p < c * G
    qi = p // G
    qh = h * G + p % G
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(Q + qi[:, None] * sq_t + qh[:, None] * sq_h + d[None, :],
                mask=pmask[:, None] & dmask[None, :], other=0.0)
    return qi, qh, pmask, d, dmask, q


@triton.jit
def _store_rows(OUT, so_t, so_h, qi, qh, pmask, d, dmask, acc, l):
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(OUT + qi[:, None] * so_t + qh[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
             mask=pmask[:, None] & dmask[None, :])


@triton.jit
def _paged_prefill_kernel(Q, K, V, KS, VS, TABLE, OUT,
                          sq_t, sq_h, sk_h, sk_s, ss_h, ss_s, so_t, so_h, start, c, scale,
                          G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    # Program (row block, full KV head h). Causal: keys stop at the block's last
    # query, and the chunk's own keys are already in the pool.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    qi, qh, pmask, d, dmask, q = _query_rows(Q, sq_t, sq_h, pid, h, c, G, D, BD, BM)
    qpos = start + qi
    last = start + tl.minimum((pid * BM + BM - 1) // G, c - 1)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for n0 in range(0, last + 1, BN):
        kpos = n0 + tl.arange(0, BN)
        kmask = kpos <= last
        blk = tl.load(TABLE + kpos // BS, mask=kmask, other=0)
        slot = blk.to(tl.int64) * BS + kpos % BS
        off = h * sk_h + slot[:, None] * sk_s + d[None, :]
        soff = h * ss_h + slot * ss_s
        lmask = kmask[:, None] & dmask[None, :]
        k = _load_kv(K, KS, Q, off, soff, lmask, kmask, QUANT)
        v = _load_kv(V, VS, Q, off, soff, lmask, kmask, QUANT)
        valid = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        m, l, acc = _online_update(q, k, v, valid, m, l, acc, scale, IEEE, UPCAST)
    _store_rows(OUT, so_t, so_h, qi, qh, pmask, d, dmask, acc, l)


@triton.jit
def _window_prefill_kernel(Q, K, V, KR, VR, KRS, VRS, RPOS, OUT,
                           sq_t, sq_h, sk_t, sk_h, sr_h, sr_r, ss_h, ss_r, so_t, so_h,
                           start, c, n_sc, R, sink, W, scale,
                           G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, HAS_RING: tl.constexpr,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    # Program (row block, window KV head h). Key p is visible to query q when
    # p <= q and (p < sink or p > q - W). Three sources, disjoint, each loaded only
    # where it can be visible: the ring (context before the chunk), the chunk's sink
    # tokens, and the chunk tokens in [first query - W + 1, last query].
    pid = tl.program_id(0)
    h = tl.program_id(1)
    qi, qh, pmask, d, dmask, q = _query_rows(Q, sq_t, sq_h, pid, h, c, G, D, BD, BM)
    qpos = start + qi
    q_first = (pid * BM) // G
    q_last = tl.minimum((pid * BM + BM - 1) // G, c - 1)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if HAS_RING:
        for n0 in range(0, R, BN):
            idx = n0 + tl.arange(0, BN)
            imask = idx < R
            kp = tl.load(RPOS + idx, mask=imask, other=-1)
            off = h * sr_h + idx[:, None] * sr_r + d[None, :]
            lmask = imask[:, None] & dmask[None, :]
            k = _load_kv(KR, KRS, Q, off, h * ss_h + idx * ss_r, lmask, imask, QUANT)
            v = _load_kv(VR, VRS, Q, off, h * ss_h + idx * ss_r, lmask, imask, QUANT)
            valid = (kp[None, :] >= 0) & ((kp[None, :] < sink) | (kp[None, :] > qpos[:, None] - W))
            m, l, acc = _online_update(q, k, v, valid, m, l, acc, scale, IEEE, UPCAST)
    for n0 in range(0, n_sc, BN):
        j = n0 + tl.arange(0, BN)
        jmask = j < n_sc
        off = j[:, None] * sk_t + h * sk_h + d[None, :]
        lmask = jmask[:, None] & dmask[None, :]
        k = tl.load(K + off, mask=lmask, other=0.0)
        v = tl.load(V + off, mask=lmask, other=0.0)
        valid = jmask[None, :] & (start + j[None, :] <= qpos[:, None])
        m, l, acc = _online_update(q, k, v, valid, m, l, acc, scale, IEEE, UPCAST)
    lo = tl.maximum(q_first - W + 1, 0)
    for n0 in range(lo, q_last + 1, BN):
        j = n0 + tl.arange(0, BN)
        jmask = j <= q_last
        kp = start + j
        off = j[:, None] * sk_t + h * sk_h + d[None, :]
        lmask = jmask[:, None] & dmask[None, :]
        k = tl.load(K + off, mask=lmask, other=0.0)
        v = tl.load(V + off, mask=lmask, other=0.0)
        valid = (jmask & (kp >= sink))[None, :] & (kp[None, :] <= qpos[:, None]) & (kp[None, :] > qpos[:, None] - W)
        m, l, acc = _online_update(q, k, v, valid, m, l, acc, scale, IEEE, UPCAST)
    _store_rows(OUT, so_t, so_h, qi, qh, pmask, d, dmask, acc, l)


# ---- launchers ---------------------------------------------------------------------
def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _dot_mode(t: torch.Tensor) -> dict[str, bool]:
    # float32 inputs: exact products (tf32 would cost ~1e-3 against the reference).
    # bf16 on a GPU: tensor-core dots. bf16 in the interpreter: upcast, then exact.
    upcast = t.dtype != torch.float32 and _INTERPRETED
    return {"IEEE": t.dtype == torch.float32 or upcast, "UPCAST": upcast}


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, like: torch.Tensor):
    """Scale pointers and strides for the kernels; unquantized caches pass a dummy."""
    if k_scale is None:
        return like, like, (0,) * (like.dim() - 1), False
    return k_scale, v_scale, k_scale.stride(), True


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                 scale: float, num_splits: int | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of full heads over their pages, read through block tables.

    q [B, nf*g, D]; k_cache, v_cache [nf, slots, D] (unit stride over D), quantized with
    k_scale, v_scale [nf, slots]; block_tables [B, max_blocks] int32; lens [B] tokens
    including the new one."""
    B, H, D = q.shape
    nf = k_cache.shape[0]
    G = H // nf
    max_len = int(block_tables.shape[1]) * block_size
    if num_splits is None:
        num_splits = max(1, min(-(-TARGET_PROGRAMS // (B * nf)), -(-max_len // BLOCK_N)))
    split_len = -(-(-(-max_len // num_splits)) // BLOCK_N) * BLOCK_N
    num_splits = -(-max_len // split_len)
    acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    ks, vs, ss, quant = _scales(k_scale, v_scale, k_cache)
    _paged_decode_kernel[(B, nf, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, lens, acc, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), *ss, block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        scale, split_len,
        G=G, G_PAD=_pad(G), D=D, BD=_pad(D), BS=block_size, BN=BLOCK_N, QUANT=quant, **_dot_mode(q))
    if num_splits == 1:
        return acc[:, :, 0].to(q.dtype)
    # Combine splits: weight each by its share of the softmax mass, exp(lse_i) / sum.
    w = torch.softmax(lse, dim=-1)
    return (acc * w[..., None]).sum(2).to(q.dtype)


def ring_decode(q: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                ring_slots: torch.Tensor, lens: torch.Tensor, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one window group over its rings.

    q [B, n*g, D]; k_ring, v_ring [S, n, R, D] (quantized: scales [S, n, R]);
    ring_slots [B]; lens [B] (incl. new token)."""
    B, H, D = q.shape
    n, R = k_ring.shape[1], k_ring.shape[2]
    G = H // n
    out = torch.empty_like(q)
    ks, vs, ss, quant = _scales(k_scale, v_scale, k_ring)
    _ring_decode_kernel[(B, n)](
        q, k_ring, v_ring, ks, vs, ring_slots, lens, out,
        q.stride(0), q.stride(1), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), *ss,
        out.stride(0), out.stride(1), R, scale,
        G=G, G_PAD=_pad(G), D=D, BD=_pad(D), BN=BLOCK_N, QUANT=quant, **_dot_mode(q))
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, start: int, block_size: int,
                  scale: float, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill attention of full heads for one chunk at positions
    [start, start + c), keys read from the pool (the chunk's keys already written).

    q [c, nf*g, D]; k_cache, v_cache [nf, slots, D] (quantized: scales [nf, slots]);
    block_table [num_blocks] int32."""
    c, H, D = q.shape
    nf = k_cache.shape[0]
    G = H // nf
    out = torch.empty_like(q)
    grid = (triton.cdiv(c * G, BLOCK_M), nf)
    ks, vs, ss, quant = _scales(k_scale, v_scale, k_cache)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, block_table, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), *ss,
        out.stride(0), out.stride(1), start, c, scale,
        G=G, D=D, BD=_pad(D), BS=block_size, BM=BLOCK_M, BN=BLOCK_N, QUANT=quant, **_dot_mode(q))
    return out


def window_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_ring: torch.Tensor, v_ring: torch.Tensor, ring_pos: torch.Tensor,
                   start: int, sink: int, window: int, scale: float,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Sink + window prefill attention of one window group for one chunk.

    q [c, n*g, D]; k, v [c, n, D] (the chunk, in q's dtype); k_ring, v_ring [n, R, D],
    this sequence's ring before the chunk (quantized: scales [n, R]); ring_pos [R]
    position held by each entry (-1: empty)."""
    c, H, D = q.shape
    n, R = k.shape[1], k_ring.shape[1]
    G = H // n
    out = torch.empty_like(q)
    n_sc = max(0, min(sink - start, c))
    grid = (triton.cdiv(c * G, BLOCK_M), n)
    ks, vs, ss, quant = _scales(k_scale, v_scale, k_ring)
    _window_prefill_kernel[grid](
        q, k, v, k_ring, v_ring, ks, vs, ring_pos, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k_ring.stride(0), k_ring.stride(1), *ss,
        out.stride(0), out.stride(1), start, c, n_sc, R, sink, window, scale,
        G=G, D=D, BD=_pad(D), BM=BLOCK_M, BN=BLOCK_N, HAS_RING=start > 0, QUANT=quant, **_dot_mode(q))
    return out
