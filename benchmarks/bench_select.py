"""Decode speed of layouts with select heads against the layouts they came from, as the
context grows: batch-1 and batched decode tokens/s with every sequence's cache already
at the context length (benchmarks.common.headwise_aggregate: sequences placed in the
cache directly, no prefill; decode cost does not depend on the cached values). Layouts
are measured in turn within each round, so drift on the machine hits them alike.

    python benchmarks/bench_select.py --model gemma-3-270m --contexts 4096,32000 \
        --layouts native,headwise/layouts/gemma-3-270m-global-select2048.json
    python benchmarks/bench_select.py --contexts 8000 --layouts \
        headwise/layouts/smollm2-135m-instruct-gates-33-w1024.json,headwise/layouts/smollm2-135m-instruct-gates-33-w1024-select1024.json,full

Median of --rounds; writes a Markdown table and JSON to --out-dir.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import headwise_aggregate, machine  # noqa: E402
from headwise.config import parse_size  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layouts", required=True, help="comma-separated: full | native | PATH")
    ap.add_argument("--contexts", default="4096,8000")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="2GiB", type=parse_size,
                    help="KV cache memory of each layout's engine, as the engine's flag takes it "
                         "(a 1.5B model's 4 sequences of 32K need about 3.5GiB)")
    ap.add_argument("--out-dir", default="bench/select")
    a = ap.parse_args(argv)
    from headwise import LLM

    layouts = a.layouts.split(",")
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    llms = {lay: LLM(a.model, head_layout=lay, kv_cache_memory=a.kv_cache_memory, max_num_batched_tokens=8192)
            for lay in layouts}
    rows = []
    for L in contexts:
        got = {(lay, b): [] for lay in layouts for b in batches}
        for _ in range(a.rounds):
            for lay, llm in llms.items():
                for b in batches:
                    got[(lay, b)].append(headwise_aggregate(llm, L, b, a.steps))
        for lay, llm in llms.items():
            row = {"layout": llm.layout.name, "classes": llm.layout.summary, "context": L,
                   "kv_bytes_per_seq": llm.kv_bytes(L)}
            for b in batches:
                row[f"batch{b}_tok_s"] = statistics.median(got[(lay, b)])
                row[f"batch{b}_runs"] = got[(lay, b)]
            rows.append(row)
            print(f"{llm.layout.name:<48} {L:>6}: " + ", ".join(
                f"batch {b} {row[f'batch{b}_tok_s']:.1f} tok/s" for b in batches), flush=True)
    head = "| layout | classes | context | KV MiB/seq | " + " | ".join(f"batch {b} tok/s" for b in batches) + " |"
    lines = [f"Machine: {machine()}; median of {a.rounds} rounds, {a.steps} decode steps each; "
             f"{a.kv_cache_memory / 2**30:g} GiB of KV per layout", "", head,
             "|" + "---|" * (4 + len(batches))]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['classes']} | {r['context']} | {r['kv_bytes_per_seq'] / 2**20:.1f} | "
                     + " | ".join(f"{r[f'batch{b}_tok_s']:.1f}" for b in batches) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                                  "kv_cache_memory": a.kv_cache_memory, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
