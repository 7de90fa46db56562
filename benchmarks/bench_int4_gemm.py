"""A model's 4-bit linears three ways, at decode and prefill row counts: the prepacked
bfloat16 weight the engine runs from 9 rows on (oneDNN), PyTorch's int4 CPU matmul the
engine runs up to 8 rows, and the matmul over the 4-bit codes of any row count
(kernels/int4_gemm.py, not yet called by the engine). One pass over every linear whose
weight is 4-bit (q/k/v and gate/up fused, as decode runs them; their parts' packed
weights for the first column), ms, median [min-max]; and the bytes each form holds.

    python benchmarks/bench_int4_gemm.py [--model qwen2.5-coder-1.5b] [--rows 1,4,8,16,32,64,256,1024] [--runs 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_linear import time_pass  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402

TORCH_INT4_MAX_ROWS = 64  # PyTorch's int4 kernel is 2-2.5x the packed weight's time from 32 rows: not timed past this


def four_bit(model_name: str):
    """(packed Linears whose weight is 4-bit, the 4-bit copies covering the same weights)
    of the model prepared for bfloat16 as the engine does."""
    from headwise.layers.linear import Int4Copy, Linear
    from headwise.weights.loader import load_weights

    model = load_weights(model_name, torch.bfloat16, lazy=True)
    model.prepare_weights(torch.bfloat16)
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None
              and (m.fused_int4 or m.int4 is not None)]
    copies = [m for m in model.modules() if isinstance(m, Int4Copy) and m.int4 is not None]
    return packed, copies


@torch.inference_mode()  # as the engine runs: in grad mode oneDNN took 50 ms for one row with a bias needing grad
def main(argv: list[str] | None = None) -> int:
    from headwise.kernels.int4_gemm import int4_gemm
    from headwise.layers.linear import int4_matmul

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,1024")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="bench/int4_gemm.json")
    args = ap.parse_args(argv)
    packed, copies = four_bit(args.model)
    probe = copies[0]
    if int4_gemm(torch.zeros(1, probe.in_features, dtype=torch.bfloat16), *probe.int4) is None:
        print("the 4-bit matmul does not run on this machine (no AVX512-BF16 build, or another layout)")
        return 1
    weights = sum(m.in_features * m.out_features for m in packed)
    mib_packed = weights * 2 / 2**20
    mib_codes = sum(t.numel() * t.element_size() for m in copies for t in m.int4) / 2**20
    lines = [f"Machine: {machine()}; {args.model}, bfloat16; {len(packed)} 4-bit linears "
             f"({weights / 1e6:.0f}M weights) as {len(copies)} matmuls; prepacked bf16 {mib_packed:.0f} MiB, "
             f"4-bit codes with scales {mib_codes:.0f} MiB; ms per pass, median [min-max] of {args.runs}", "",
             "| rows | prepacked bf16 | PyTorch int4 | int4_gemm | int4_gemm / prepacked |", "|---|---|---|---|---|"]
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in packed}}

        def run_packed():
            for m in packed:
                torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

        def run_torch_int4():
            for m in copies:
                int4_matmul(xs[m.in_features], m.int4)

        def run_gemm():
            for m in copies:
                int4_gemm(xs[m.in_features], *m.int4)

        a = time_pass(run_packed, args.runs)
        b = time_pass(run_torch_int4, args.runs) if rows <= TORCH_INT4_MAX_ROWS else None
        c = time_pass(run_gemm, args.runs)
        records.append({"rows": rows, "packed_ms": a.median, "torch_int4_ms": None if b is None else b.median,
                        "int4_gemm_ms": c.median})
        lines.append(f"| {rows} | {a.fmt()} | {'-' if b is None else b.fmt()} | {c.fmt()} | "
                     f"{c.median / a.median:.2f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    save(args.out, {"machine": machine(), "model": args.model, "mib_packed": mib_packed, "mib_codes": mib_codes,
                    "records": records}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
