"""Triton kernels against plain PyTorch references written out here.

On a machine without a GPU they run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); with a GPU the same tests run on CUDA tensors, unchanged.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from headwise.kernels import triton_attention as ta  # noqa: E402
from headwise.layers.kv_tensor import dequantize, quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 16
TOL = dict(atol=2e-5, rtol=1e-4)


def _softmax_attend(q, k, v, visible, scale):
    # q [Hq, M, D]; k, v [Hq, N, D]; visible [M, N] or [Hq, M, N]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _paged_pool(lens, block_size, nf, gen):
    """Pool [nf, slots, D] holding every sequence's tokens in scattered blocks, plus the
    dense keys per sequence and padded int32 block tables."""
    need = [-(-n // block_size) for n in lens]
    total = sum(need) + 3
    order = torch.randperm(total, generator=gen).tolist()  # blocks out of order
    kc = torch.randn(nf, total * block_size, D, generator=gen)
    vc = torch.randn(nf, total * block_size, D, generator=gen)
    tables, dense = [], []
    for n, nb in zip(lens, need):
        ids, order = order[:nb], order[nb:]
        tables.append(ids)
        pos = torch.arange(n)
        slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        dense.append((kc[:, slots], vc[:, slots]))  # [nf, n, D]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return kc, vc, bt, dense


@pytest.mark.parametrize("block_size", [1, 16, 48])
@pytest.mark.parametrize("nf,g", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode(block_size, nf, g, num_splits):
    gen = torch.Generator().manual_seed(block_size * 10 + g)
    lens = [1, 37, 130, 64]  # ragged, including a single token and a tile boundary
    kc, vc, bt, dense = _paged_pool(lens, block_size, nf, gen)
    q = torch.randn(len(lens), nf * g, D, generator=gen)
    scale = D ** -0.5
    got = ta.paged_decode(q.to(DEV), kc.to(DEV), vc.to(DEV), bt.to(DEV),
                          torch.tensor(lens, dtype=torch.int32, device=DEV), block_size, scale,
                          num_splits=num_splits).cpu()
    for b, (k, v) in enumerate(dense):
        kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [nf*g, n, D]
        ref = _softmax_attend(q[b][:, None], kk, vv, torch.ones(1, lens[b], dtype=torch.bool), scale)
        torch.testing.assert_close(got[b], ref[:, 0], **TOL)


@pytest.mark.parametrize("n,g", [(1, 1), (2, 3), (1, 4)])
def test_ring_decode(n, g):
    gen = torch.Generator().manual_seed(n + g)
    S, R = 5, 24
    kr = torch.randn(S, n, R, D, generator=gen)
    vr = torch.randn(S, n, R, D, generator=gen)
    slots = [3, 0, 4]
    lens = [1, 10, 500]  # partly filled, and wrapped many times over (every entry live)
    q = torch.randn(len(slots), n * g, D, generator=gen)
    scale = D ** -0.5
    got = ta.ring_decode(q.to(DEV), kr.to(DEV), vr.to(DEV), torch.tensor(slots, device=DEV),
                         torch.tensor(lens, device=DEV), scale).cpu()
    for b, (s, L) in enumerate(zip(slots, lens)):
        m = min(L, R)
        kk = kr[s, :, :m].repeat_interleave(g, 0)
        vv = vr[s, :, :m].repeat_interleave(g, 0)
        ref = _softmax_attend(q[b][:, None], kk, vv, torch.ones(1, m, dtype=torch.bool), scale)
        torch.testing.assert_close(got[b], ref[:, 0], **TOL)


@pytest.mark.parametrize("block_size", [1, 16, 24])
@pytest.mark.parametrize("nf,g", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("start,c", [(0, 70), (45, 30), (128, 1)])
def test_paged_prefill(block_size, nf, g, start, c):
    gen = torch.Generator().manual_seed(block_size + g + start)
    kc, vc, bt, dense = _paged_pool([start + c], block_size, nf, gen)
    q = torch.randn(c, nf * g, D, generator=gen)
    scale = D ** -0.5
    got = ta.paged_prefill(q.to(DEV), kc.to(DEV), vc.to(DEV), bt[0].to(DEV), start,
                           block_size, scale).cpu()
    k, v = dense[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    qpos = torch.arange(start, start + c)
    visible = torch.arange(start + c)[None, :] <= qpos[:, None]  # causal
    ref = _softmax_attend(q.transpose(0, 1), kk, vv, visible, scale).transpose(0, 1)
    torch.testing.assert_close(got, ref, **TOL)


def _ring_from_history(k_all, v_all, start, sink, window):
    """The ring after positions [0, start) were written in order, and each entry's position."""
    n, R = k_all.shape[0], sink + window
    kr, vr = torch.zeros(n, R, D), torch.zeros(n, R, D)
    pos = torch.full((R,), -1, dtype=torch.int64)
    for p in range(start):
        i = p if p < sink else sink + (p - sink) % window
        kr[:, i], vr[:, i], pos[i] = k_all[:, p], v_all[:, p], p
    return kr, vr, pos


@pytest.mark.parametrize("n,g", [(1, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("sink,window", [(4, 8), (0, 16), (8, 1), (70, 64)])
@pytest.mark.parametrize("start,c", [(0, 100), (3, 40), (57, 90), (300, 5)])
def test_window_prefill(n, g, sink, window, start, c):
    gen = torch.Generator().manual_seed(n * 100 + sink + window + start)
    T = start + c
    k_all = torch.randn(n, T, D, generator=gen)
    v_all = torch.randn(n, T, D, generator=gen)
    q = torch.randn(c, n * g, D, generator=gen)
    kr, vr, ring_pos = _ring_from_history(k_all, v_all, start, sink, window)
    scale = D ** -0.5
    got = ta.window_prefill(q.to(DEV), k_all[:, start:].transpose(0, 1).to(DEV),
                            v_all[:, start:].transpose(0, 1).to(DEV), kr.to(DEV), vr.to(DEV),
                            ring_pos.to(DEV), start, sink, window, scale).cpu()
    qp = torch.arange(start, T)[:, None]
    kp = torch.arange(T)[None, :]
    visible = (kp <= qp) & ((kp < sink) | (kp > qp - window))  # sink + recent window
    kk, vv = k_all.repeat_interleave(g, 0), v_all.repeat_interleave(g, 0)
    ref = _softmax_attend(q.transpose(0, 1), kk, vv, visible, scale).transpose(0, 1)
    torch.testing.assert_close(got, ref, **TOL)


def test_bfloat16_inputs():
    """bf16 cache and queries (the GPU dtype): accumulation stays float32."""
    gen = torch.Generator().manual_seed(7)
    kc, vc, bt, dense = _paged_pool([90], 16, 2, gen)
    q = torch.randn(1, 6, D, generator=gen)
    bf = torch.bfloat16
    got = ta.paged_decode(q.to(DEV, bf), kc.to(DEV, bf), vc.to(DEV, bf), bt.to(DEV),
                          torch.tensor([90], dtype=torch.int32, device=DEV), 16, D ** -0.5)
    k, v = dense[0]
    kk = k.to(bf).float().repeat_interleave(3, 0)
    vv = v.to(bf).float().repeat_interleave(3, 0)
    ref = _softmax_attend(q.to(bf).float()[0][:, None], kk, vv, torch.ones(1, 90, dtype=torch.bool), D ** -0.5)
    assert got.dtype == bf
    torch.testing.assert_close(got.float().cpu()[0], ref[:, 0], atol=2e-2, rtol=2e-2)


# ---- quantized caches: values and per-token scales, dequantized in the kernels' loads --
# fp8 runs on a GPU only: Triton's interpreter cannot load fp8.
QUANT = [torch.int8, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(
    DEV != "cuda", reason="Triton's interpreter has no fp8"))]


def _quant(x, dtype):
    """(values, scales) as the cache stores x, and the dequantized x every read sees."""
    q, s = quantize(x, dtype, torch.float32)
    return q, s, dequantize(q, s, torch.float32)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("block_size,nf,g", [(16, 2, 3), (1, 1, 1)])
def test_quantized_paged_decode_and_prefill(block_size, nf, g, dtype):
    gen = torch.Generator().manual_seed(11 + block_size)
    lens = [5, 130]
    kc, vc, bt, _ = _paged_pool(lens, block_size, nf, gen)
    (kq, ks, kd), (vq, vs, vd) = _quant(kc, dtype), _quant(vc, dtype)
    assert kq.dtype == dtype and not torch.equal(kd, kc)  # the reference is the quantized one
    scale = D ** -0.5
    q = torch.randn(len(lens), nf * g, D, generator=gen)
    dev = lambda *t: [x.to(DEV) for x in t]  # noqa: E731
    got = ta.paged_decode(*dev(q, kq, vq, bt, torch.tensor(lens, dtype=torch.int32)), block_size, scale,
                          k_scale=ks.to(DEV), v_scale=vs.to(DEV)).cpu()
    ref = ta.paged_decode(*dev(q, kd, vd, bt, torch.tensor(lens, dtype=torch.int32)), block_size, scale).cpu()
    torch.testing.assert_close(got, ref, **TOL)
    c, start = 40, lens[1] - 40
    qp = torch.randn(c, nf * g, D, generator=gen)
    got = ta.paged_prefill(*dev(qp, kq, vq, bt[1]), start, block_size, scale,
                           k_scale=ks.to(DEV), v_scale=vs.to(DEV)).cpu()
    ref = ta.paged_prefill(*dev(qp, kd, vd, bt[1]), start, block_size, scale).cpu()
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("dtype", QUANT)
def test_quantized_ring_decode_and_window_prefill(dtype):
    gen = torch.Generator().manual_seed(5)
    n, g, S, sink, window, start, c = 2, 3, 4, 4, 8, 30, 20
    R = sink + window
    (kq, ks, kd), (vq, vs, vd) = (_quant(torch.randn(S, n, R, D, generator=gen), dtype),
                                  _quant(torch.randn(S, n, R, D, generator=gen), dtype))
    slots, lens = [2, 0], [7, 300]
    q = torch.randn(2, n * g, D, generator=gen)
    scale = D ** -0.5
    sl, ln = torch.tensor(slots, device=DEV), torch.tensor(lens, device=DEV)
    got = ta.ring_decode(q.to(DEV), kq.to(DEV), vq.to(DEV), sl, ln, scale, k_scale=ks.to(DEV), v_scale=vs.to(DEV))
    ref = ta.ring_decode(q.to(DEV), kd.to(DEV), vd.to(DEV), sl, ln, scale)
    torch.testing.assert_close(got.cpu(), ref.cpu(), **TOL)
    # Window prefill: the ring (slot 1) quantized; the chunk's own K/V come round-tripped.
    k_all = _quant(torch.randn(n, start + c, D, generator=gen), dtype)[2]
    v_all = _quant(torch.randn(n, start + c, D, generator=gen), dtype)[2]
    kr, vr, ring_pos = _ring_from_history(k_all, v_all, start, sink, window)
    (krq, krs, krd), (vrq, vrs, vrd) = _quant(kr, dtype), _quant(vr, dtype)
    qc = torch.randn(c, n * g, D, generator=gen)
    kc, vc = k_all[:, start:].transpose(0, 1), v_all[:, start:].transpose(0, 1)
    got = ta.window_prefill(qc.to(DEV), kc.to(DEV), vc.to(DEV), krq.to(DEV), vrq.to(DEV), ring_pos.to(DEV),
                            start, sink, window, scale, k_scale=krs.to(DEV), v_scale=vrs.to(DEV)).cpu()
    k_ref, v_ref = k_all.clone(), v_all.clone()  # earlier positions as the ring returns them
    for i, p in enumerate(ring_pos.tolist()):
        if p >= 0:
            k_ref[:, p], v_ref[:, p] = krd[:, i], vrd[:, i]
    qp, kp = torch.arange(start, start + c)[:, None], torch.arange(start + c)[None, :]
    visible = (kp <= qp) & ((kp < sink) | (kp > qp - window))
    ref = _softmax_attend(qc.transpose(0, 1), k_ref.repeat_interleave(g, 0), v_ref.repeat_interleave(g, 0),
                          visible, scale).transpose(0, 1)
    torch.testing.assert_close(got, ref, **TOL)
