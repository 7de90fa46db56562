"""Decode-sized matmuls over a weight kept as int8 codes and one float32 scale per group
of 32 or 16 inputs (kernels/cpu_matmul.c), where the weight is exactly that: GGUF's Q8_0,
Q5_0 and Q4_0 tensors (groups of 32), e.g. the tied token embedding both default models
project onto the vocabulary with, and its Q6_K and Q3_K ones (a scale per 16 inputs); or
codes times a scale plus a minimum per 32 inputs (Q5_1, Q5_K: exact_affine, which also
finds the 4-bit copies of layers.linear). Half the bytes of a bfloat16 weight or less;
calls of a few rows read every weight once, so they run at memory bandwidth
(benchmarks/bench_int8.py).
"""
from __future__ import annotations

import torch

from headwise.kernels.cpu_kernels import DTYPES, matmul_library

MAX_ROWS = 4  # calls with at most this many rows; from 8 rows the packed bf16 weight wins
ROWS_AT_ONCE = 8192  # weight rows exact_int8 and exact_affine examine at a time
AFFINE_GROUP = 32  # inputs per scale and minimum (GGUF Q4_1, Q5_1; the K formats' sub-blocks)
AFFINE_LEVELS = 32  # int8 copies with a minimum per group: codes 0..31 (GGUF Q5_1, Q5_K)
FIRST_ROWS = 64  # rows a search examines before the rest (row_batches)
# (inputs per scale, the codes of largest magnitude a group may have), tried in order.
# Groups of 32, per GGUF format: Q8_0 (d = amax / 127), Q5_0 (d = max / -16, codes
# q - 16), Q4_0 (d = max / -8, codes q - 8). Groups of 16: Q6_K's sub-blocks (codes
# q - 32, scale d * sc, so any top code up to 32) and Q3_K's (up to 4).
GROUPS = ((32, (127.0, 16.0, 8.0)), (16, tuple(float(t) for t in range(32, 0, -1))))


def exact_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [N, K] float32 as (codes [N, K] int8, scales [N, K/G] float32) with
    w = scale * code in every group of G inputs exactly (G = 32, else 16: see GROUPS), if
    w is exactly that, else None."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % 32:
        return None
    for group, tops in GROUPS:
        found = _exact_groups(w, group, tops)
        if found is not None:
            return found
    return None


def _exact_groups(w: torch.Tensor, group: int, tops: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    N, K = w.shape
    codes = torch.empty(N, K, dtype=torch.int8)
    scales = torch.empty(N, K // group)
    for r, end in row_batches(N):
        found = _exact_rows(w[r:end].reshape(-1, K // group, group), tops)
        if found is None:
            return None
        codes[r:end], scales[r:end] = found[0].flatten(1), found[1]
    return codes, scales


def row_batches(n: int) -> list[tuple[int, int]]:
    """The row ranges a search examines one at a time: a few rows first (most weights not
    of the format fail there, before a pass over thousands of rows: the searches run on
    every linear of a 16-bit checkpoint too), then ROWS_AT_ONCE at a time (bounded
    temporaries: a vocabulary is 10^5 rows)."""
    starts = [0] + list(range(min(n, FIRST_ROWS), n, ROWS_AT_ONCE))
    return list(zip(starts, starts[1:] + [n]))


def _exact_rows(g: torch.Tensor, tops: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    # g [n, K/G, G] -> (codes int8, scales [n, K/G]) or None
    a = g.abs()
    amax = a.amax(-1)
    # codes of at most max(tops) in magnitude: no group's largest value exceeds its
    # smallest nonzero one that many times (rejects a float weight in one pass)
    smallest = torch.where(a > 0, a, torch.inf).amin(-1)
    if (amax > smallest * (max(tops) * (1 + 1e-6))).any():
        return None
    scale = torch.zeros_like(amax)
    done = amax == 0  # an all-zero group: scale 0, codes 0
    tiny = torch.finfo(torch.float32).tiny
    for top in tops:
        d = amax / top
        fits = ((g / d.clamp(min=tiny)[..., None]).round() * d[..., None] == g).all(-1) & ~done
        scale = torch.where(fits, d, scale)
        done |= fits
        if bool(done.all()):
            return (g / scale.clamp(min=tiny)[..., None]).round().clamp(-127, 127).to(torch.int8), scale
    return None


def exact_affine(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w [N, K] float32 as codes [N, K] (int32, 0..levels - 1), scales and lows [N, K/32]
    with w = low + code * scale in every group of 32 inputs, to float32 rounding, if w is
    that, else None. Each group's minimum is coded 0 (low); its range is tried as
    levels - 1, levels - 2, ..., 1 code steps, since a quantizer that optimizes the scale
    (Q4_K, Q5_K; Q4_0's blocks seen this way) need not use the top code (a group of one
    value: scale 0)."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % AFFINE_GROUP:
        return None
    N, K = w.shape
    codes = torch.empty(N, K, dtype=torch.int32)
    scales, lows = torch.empty(N, K // AFFINE_GROUP), torch.empty(N, K // AFFINE_GROUP)
    for r, end in row_batches(N):
        found = _affine_rows(w[r:end].reshape(-1, K // AFFINE_GROUP, AFFINE_GROUP), levels)
        if found is None:
            return None
        codes[r:end], scales[r:end], lows[r:end] = found[0].flatten(1), found[1], found[2]
    return codes, scales, lows


def _affine_rows(g: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    # g [n, K/32, 32] -> (codes int32, scales, lows [n, K/32]) or None
    flat = g.reshape(-1, g.shape[-1])
    srt = flat.sort(-1).values
    low, high = srt[:, 0], srt[:, -1]
    tol = 1e-6 * (low.abs() + high.abs()) + 1e-30  # float32 rounding of low + code * scale
    gaps = srt.diff(dim=-1)
    gap = torch.where(gaps > 0, gaps, torch.inf).amin(-1)  # the code step or a multiple of it
    # at most levels - 1 steps between a group's ends, each at least the smallest gap
    # (rejects a float weight, or a finer format, in one pass)
    if ((high - low) > (gap + 2 * tol) * (levels - 1)).any():
        return None
    scale = torch.zeros_like(low)
    todo = (high > low).nonzero().squeeze(1)  # groups of one value keep scale 0
    # First guess: the smallest gap is one code step; then each step count from the top.
    guesses = [((high - low) / gap).round()] + [torch.full_like(low, float(n)) for n in range(levels - 1, 0, -1)]
    for steps in guesses:
        if not len(todo):
            break
        lo, d = low[todo], (high - low)[todo] / steps[todo]
        v = flat[todo]
        codes = ((v - lo[:, None]) / d[:, None]).round_()
        fits = ((codes >= 0) & (codes < levels) & ((codes * d[:, None] + lo[:, None] - v).abs()
                                                    <= tol[todo, None])).all(-1)
        scale[todo[fits]] = d[fits]
        todo = todo[~fits]
    if len(todo):
        return None
    codes = ((flat - low[:, None]) / scale.clamp(min=1e-30)[:, None]).round_().clamp_(0, levels - 1)
    n, G = g.shape[:2]
    return codes.to(torch.int32).view(n, G, -1), scale.view(n, G), low.view(n, G)


def int8_copy(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The int8 copy int8_matmul reads for w [N, K] float32: exact_int8's codes and scales
    (lows None), else exact_affine's codes 0..AFFINE_LEVELS - 1 with scales and lows; None
    where w is neither."""
    found = exact_int8(w)
    if found is not None:
        return found[0], found[1], None
    found = exact_affine(w, AFFINE_LEVELS)
    return None if found is None else (found[0].to(torch.int8), found[1], found[2])


def check_int8_weight(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None) -> None:
    """Raise ValueError unless (codes, scales, lows) is a weight int8_matmul reads: codes
    [N, K] int8, scales [N, K/G] float32 with G = 32 or 16, lows like scales or None, all
    contiguous. A layer checks its copy once; int8_matmul checks it per call otherwise."""
    N, K = codes.shape if codes.dim() == 2 else (0, 0)
    groups = scales.shape[-1] if scales.dim() == 2 else 0
    if (not N or codes.dtype != torch.int8 or scales.shape[0] != N or not groups or K % groups
            or K // groups not in (16, 32) or scales.dtype != torch.float32
            or not codes.is_contiguous() or not scales.is_contiguous()
            or (lows is not None and (lows.shape != scales.shape or lows.dtype != torch.float32
                                      or not lows.is_contiguous()))):
        raise ValueError(f"int8 weight must be codes [N, K] int8 and scales (and lows) [N, K/32] or "
                         f"[N, K/16] float32, contiguous; got codes {tuple(codes.shape)} {codes.dtype}, "
                         f"scales {tuple(scales.shape)} {scales.dtype}"
                         + ("" if lows is None else f", lows {tuple(lows.shape)} {lows.dtype}"))


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                lows: torch.Tensor | None = None, checked: bool = False) -> torch.Tensor | None:
    """x [M, K] (float32 or bfloat16, M <= MAX_ROWS, unit inner stride) times the weight
    (see check_int8_weight: w = code * scale (+ low)) transposed -> [M, N] in x's dtype;
    None where the kernel does not apply (no compiled library, another device or dtype,
    too many rows, inside a torch.compile trace). `checked`: the caller has checked the
    weight (check_int8_weight) and it has not changed since."""
    if (torch.compiler.is_dynamo_compiling() or x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2
            or not 0 < x.shape[0] <= MAX_ROWS or x.stride(-1) != 1):
        return None
    lib = matmul_library()
    if lib is None:
        return None
    if not checked:
        check_int8_weight(codes, scales, lows)
    M, K = x.shape
    N, groups = codes.shape[0], scales.shape[1]
    if codes.shape[1] != K:
        raise ValueError(f"input of {K} features for int8 codes of {codes.shape[1]}")
    out = torch.empty(M, N, dtype=x.dtype)
    rc = lib.int8_matmul(x.data_ptr(), x.stride(0), M, K, codes.data_ptr(), K, scales.data_ptr(),
                         None if lows is None else lows.data_ptr(), groups, K // groups, N, out.data_ptr(), N,
                         DTYPES[x.dtype], torch.get_num_threads())
    if rc:
        raise MemoryError("int8 matmul: out of memory") if rc == -2 else ValueError("int8 matmul: bad shape")
    return out
