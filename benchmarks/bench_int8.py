"""The low-bit copies of a model's GGUF linears against their prepacked bfloat16 weights,
at decode-sized row counts: per model and kind of copy, one pass over every linear that
keeps one. Kinds: int8 codes with a scale per 32 inputs (kernels/int8_matmul.py: Q8_0,
Q5_0, e.g. both default models' tied vocabulary projection), int8 with a scale per 16
(Q6_K, Q3_K), int8 with a scale and a minimum per 32 (Q5_1, Q5_K), and 4-bit codes (PyTorch's int4 CPU kernel: Q4_1, Q4_0, Q4_K) of the
layers not fused with others (FusedInt4's q/k/v and gate/up are in bench_linear.py).

    python benchmarks/bench_int8.py [--models SmolLM2-135M-Instruct,gemma-3-270m] [--rows 1,2,4,8] [--runs 7]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_linear import time_pass  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402


def copy_kind(m) -> str | None:
    """Which copy a prepared Linear keeps for a few rows, or None."""
    if m.int4 is not None:
        return "4-bit"
    if m.int8_codes is not None:
        minimum = "" if m.int8_lows is None else " and minimum"
        return f"int8, scale{minimum} per {m.in_features // m.int8_scales.shape[1]}"
    return None


def linears_by_copy(model_name: str) -> dict[str, list]:
    """The model's linears that keep a copy, by kind, prepared for bfloat16 as the engine does."""
    from headwise.layers.linear import Linear
    from headwise.weights.loader import load_model

    model, _ = load_model(model_name, torch.float32)
    model.prepare_weights(torch.bfloat16)
    kinds: dict[str, list] = {}
    for m in model.modules():
        if isinstance(m, Linear) and copy_kind(m):
            kinds.setdefault(copy_kind(m), []).append(m)
    return kinds


def copy_mib(m) -> float:
    if m.int4 is not None:
        return sum(t.numel() * t.element_size() for t in m.int4) / 2**20
    lows = 0 if m.int8_lows is None else m.int8_lows.numel() * 4
    return (m.int8_codes.numel() + m.int8_scales.numel() * 4 + lows) / 2**20


def main(argv: list[str] | None = None) -> int:
    from headwise.kernels.int8_matmul import MAX_ROWS, int8_matmul
    from headwise.layers.int4 import INT4_MAX_ROWS

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma-3-270m")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="bench/int8_linear.json")
    args = ap.parse_args(argv)
    lines = [f"Machine: {machine()}; bfloat16 activations; ms per pass over the model's linears with "
             f"that copy, median [min-max] of {args.runs}; the engine uses int8 copies up to {MAX_ROWS} "
             f"rows, 4-bit ones up to {INT4_MAX_ROWS}", "",
             "| model | copy | linears | weight MiB bf16 / copy | rows | prepacked bf16 | copy | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    records = []
    for name in args.models.split(","):
        for kind, lins in linears_by_copy(name).items():
            mib16 = sum(m.in_features * m.out_features * 2 for m in lins) / 2**20
            mibc = sum(copy_mib(m) for m in lins)
            limit = INT4_MAX_ROWS if kind == "4-bit" else MAX_ROWS
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in lins}}

                def packed():
                    for m in lins:
                        torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, m.bias, "none", [], "")

                def copy():
                    for m in lins:
                        x = xs[m.in_features]
                        m.int4_mm(x) if m.int4 is not None else int8_matmul(x, m.int8_codes, m.int8_scales,
                                                                            m.int8_lows)

                a = time_pass(packed, args.runs)
                b = time_pass(copy, args.runs) if rows <= limit else None
                records.append({"model": name, "copy": kind, "linears": len(lins), "rows": rows,
                                "packed_ms": a.median, "copy_ms": None if b is None else b.median})
                lines.append(f"| {name} | {kind} | {len(lins)} | {mib16:.0f} / {mibc:.0f} | {rows} | {a.fmt()} | "
                             f"{'-' if b is None else b.fmt()} | "
                             f"{'-' if b is None else f'{a.median / b.median:.2f}x'} |")
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    save(args.out, {"machine": machine(), "records": records}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
