"""The default model's 210 projection matmuls (7 per layer x 30 layers, real weights),
one pass over all of them per measurement, at several row counts, three ways:
plain F.linear on the plain weight, the weight prepacked for oneDNN, and the 4-bit copy
(PyTorch's int4 CPU matmul on the GGUF's Q4_1 codes), as decode runs it: q/k/v fused into
one matmul and gate/up into another (120 calls). Decode at batch B is B rows;
a prefill chunk is its token count. A second table times the 30 MLPs,
down(silu(gate(x)) * up(x)), spelled out with F.linear against headwise's MLP (prepacked,
SiLU and the product inside the matmuls; the 4-bit copy where rows <= 8).

    python benchmarks/bench_linear.py [--rows 1,4,16,64,1024] [--dtype auto] [--runs 5]
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


def load_linears(dtype: torch.dtype):
    """(plain weights, prepared Linears, their 4-bit matmuls as decode runs them (fused
    groups and single layers), prepared MLPs, plain MLP weights (gate, up, down))."""
    from headwise.layers.int4 import Int4Copy
    from headwise.layers.linear import Linear
    from headwise.weights.loader import load_model

    model, _ = load_model(None, torch.float32)
    lins = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, Linear)]
    plain = [m.weight.detach().to(dtype) for m in lins]
    mlps = [layer.mlp for layer in model.model.layers]
    plain_mlps = [tuple(p.weight.detach().to(dtype) for p in (m.gate_proj, m.up_proj, m.down_proj)) for m in mlps]
    model.prepare_weights(dtype)
    units4 = [m for layer in model.model.layers for m in layer.modules()
              if isinstance(m, Int4Copy) and m.int4 is not None]
    return plain, lins, units4, mlps, plain_mlps


def time_pass(fn, runs: int) -> Stat:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Stat.of(times)


def main(argv: list[str] | None = None) -> int:
    from headwise.config import DTYPE_CHOICES, EngineConfig
    from headwise.layers.int4 import int4_matmul
    from headwise.layers.linear import FusedInt4

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64,1024")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="bench/linear.json")
    args = ap.parse_args(argv)
    dtype = EngineConfig(dtype=args.dtype).resolve_dtype(None)
    plain, lins, units4, mlps, plain_mlps = load_linears(dtype)
    n4 = sum(len(m.sizes) if isinstance(m, FusedInt4) else 1 for m in units4)  # linears covered
    head = (f"Machine: {machine()}; {dtype}; {len(lins)} linears ({n4} 4-bit, as {len(units4)} matmuls); "
            f"ms per pass over all of them, median [min-max] of {args.runs}")
    lines = [head, "", "| rows | plain F.linear | prepacked | 4-bit | plain / prepacked | plain / 4-bit |",
             "|---|---|---|---|---|---|"]
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in {w.shape[1] for w in plain}}

        def run_plain():
            for w in plain:
                F.linear(xs[w.shape[1]], w)

        def run_packed():
            for m in lins:
                torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

        def run_int4():
            for m in units4:
                int4_matmul(xs[m.in_features], m.int4)

        a, b = time_pass(run_plain, args.runs), time_pass(run_packed, args.runs)
        c = time_pass(run_int4, args.runs) if n4 == len(lins) else None
        records.append({"rows": rows, "plain_ms": a.median, "packed_ms": b.median,
                        "int4_ms": None if c is None else c.median})
        lines.append(f"| {rows} | {a.fmt()} | {b.fmt()} | {'-' if c is None else c.fmt()} | "
                     f"{a.median / b.median:.2f}x | {'-' if c is None else f'{a.median / c.median:.2f}x'} |")
        print(lines[-1], flush=True)
    lines += ["", "| rows | MLPs, plain | MLPs, headwise | speed-up |", "|---|---|---|---|"]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, mlps[0].gate_proj.in_features, dtype=dtype)

        def run_plain_mlp():
            for g, u, d in plain_mlps:
                F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

        def run_mlp():
            for m in mlps:
                m(x)

        a, b = time_pass(run_plain_mlp, args.runs), time_pass(run_mlp, args.runs)
        records.append({"rows": rows, "mlp_plain_ms": a.median, "mlp_headwise_ms": b.median})
        lines.append(f"| {rows} | {a.fmt()} | {b.fmt()} | {a.median / b.median:.2f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    save(args.out, {"machine": machine(), "dtype": str(dtype), "records": records}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
