"""Prefill attention of one chunk of one layer, bfloat16, three ways: PyTorch's SDPA with
the boolean mask a chunk after the first needs (headwise's code before
kernels/cpu_prefill.c), the same as two unmasked SDPA calls merged by log-sum-exp (the
PyTorch path that stays where the kernel does not apply), and the C kernel. Shapes are
the heads of the known models; a chunk of 2048 queries (the default step budget) after
`start` earlier tokens, and one window head group (sink 64, window 1024).

    python benchmarks/bench_prefill_attention.py [--starts 0,6144,14336,30720] [--runs 3]

Prints a table and saves bench/prefill_attention.{json,md}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import Stat, machine, save  # noqa: E402
from headwise.heads.full import _later_chunk  # noqa: E402
from headwise.kernels import cpu_kernels  # noqa: E402

# model: (query heads, KV heads, head size)
MODELS = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-Coder-0.5B": (14, 2, 64), "Qwen2.5-Coder-1.5B": (12, 2, 128),
          "Gemma 3 270M": (4, 1, 256)}
CHUNK = 2048


def timed(fn, runs: int) -> Stat:
    fn()  # first call: allocations, oneDNN primitives
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return Stat.of(times)


def full_case(H, nkv, D, start, runs):
    S, c = start + CHUNK, CHUNK
    gen = torch.Generator().manual_seed(start + H)
    q = torch.randn(c, H, D, generator=gen).bfloat16()
    k, v = (torch.randn(S, nkv, D, generator=gen).bfloat16() for _ in range(2))
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, k, v))
    mask = torch.arange(S)[None] <= torch.arange(start, S)[:, None]
    kp, vp = k[:start].transpose(0, 1).contiguous(), v[:start].transpose(0, 1).contiguous()

    def masked():
        if start == 0:
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=D ** -0.5, enable_gqa=True)
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)

    def two_calls():
        return masked() if start == 0 else _later_chunk(q, k[start:], v[start:], kp, vp, D ** -0.5)

    out = {"masked SDPA": timed(masked, runs), "two SDPA calls": timed(two_calls, runs)}
    if cpu_kernels.prefill_attention(q[:1], k[:1], v[:1], 0, 1.0) is not None:
        out["kernel"] = timed(lambda: cpu_kernels.prefill_attention(q, k, v, start, D ** -0.5), runs)
    return 4 * H * D * c * (start + c / 2), out


def window_case(H, nkv, D, start, runs, sink=64, window=1024):
    """A window head group's chunk: PyTorch's band path (heads/window.py's torch_prefill,
    masks per block) is not separable from the ring, so the kernel is set against one
    masked SDPA over the keys it reads."""
    band_pos = max(0, start - window)
    ns = min(sink, band_pos)
    S, c = ns + start + CHUNK - band_pos, CHUNK
    gen = torch.Generator().manual_seed(start + H + 1)
    q = torch.randn(c, H, D, generator=gen).bfloat16()
    k, v = (torch.randn(S, nkv, D, generator=gen).bfloat16() for _ in range(2))
    j = torch.arange(S)
    kpos = torch.where(j < ns, j, band_pos + j - ns)
    p = torch.arange(start, start + c)[:, None]
    mask = (kpos[None] <= p) & ((kpos[None] > p - window) | (kpos[None] < sink))
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = {"masked SDPA": timed(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=D ** -0.5,
                                                                        enable_gqa=True), runs)}
    if cpu_kernels.prefill_attention(q[:1], k[:1], v[:1], 0, 1.0) is not None:
        out["kernel"] = timed(lambda: cpu_kernels.prefill_attention(
            q, k, v, start, D ** -0.5, window=window, sink=sink, sinks_given=ns, band_pos=band_pos), runs)
    seen = int(mask.sum())  # (query, key) pairs attended, per query head
    return 4 * H * D * seen, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", default="0,6144,14336,30720")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench/prefill_attention.json")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    try:
        starts = [int(x) for x in args.starts.split(",")]
    except ValueError:
        ap.error(f"--starts takes comma-separated token counts, not {args.starts!r}")
    rows, records = [], []
    ways = ["masked SDPA", "two SDPA calls", "kernel"]
    for name in args.models.split(","):
        H, nkv, D = MODELS[name]
        for kind in ("full", "window"):
            for start in starts:
                flops, res = (full_case if kind == "full" else window_case)(H, nkv, D, start, args.runs)
                cells = [f"{res[w].median * 1e3:.0f} ms ({flops / res[w].median / 1e9:.0f})" if w in res else "-"
                         for w in ways]
                speedup = (f"{res['masked SDPA'].median / res['kernel'].median:.2f}x" if "kernel" in res else "-")
                rows.append(f"| {name} | {kind} | {start} | " + " | ".join(cells) + f" | {speedup} |")
                records.append({"model": name, "heads": kind, "start": start, "flops": flops,
                                "seconds": {w: [s.median, s.lo, s.hi] for w, s in res.items()}})
                print(rows[-1], flush=True)
    table = "\n".join([f"Machine: {machine()}; chunk {CHUNK} queries, bfloat16, median of {args.runs}; "
                       "ms per chunk and layer (GFLOP/s of the attention each query sees).", "",
                       "| model | heads | start | masked SDPA | two SDPA calls | kernel | kernel vs masked |",
                       "|---|---|---|---|---|---|---|", *rows])
    print(table)
    save(args.out, {"machine": machine(), "records": records}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
