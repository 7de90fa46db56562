"""Serving benchmark, in one run: start `headwise serve` with the `full` layout and with
the head-split layout, and load each with `headwise bench serve` at several concurrencies.

    python benchmarks/bench_serving.py [--prompt-tokens 4096] [--concurrency 1,4,16] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, start_server  # noqa: E402
from headwise.bench_serve import run_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--out", default="bench/serving.json")
    a = ap.parse_args()
    conc = [int(x) for x in a.concurrency.split(",")]
    rows = []
    for layout in ("full", "default"):
        proc, url = start_server(None if layout == "default" else layout,
                                 ["--kv-cache-memory", str(int(a.kv_cache_gib * 2**30)), "--max-num-seqs",
                                  str(max(conc)), "--max-num-batched-tokens", "4096"])
        try:
            for c in conc:
                r = asyncio.run(run_bench(url, max(4, c), c, a.prompt_tokens, a.max_tokens))
                r["layout"] = "full" if layout == "full" else "head-split (shipped)"
                rows.append(r)
                print(f"{r['layout']:<22} c={c:<3} {r['completed']}/{r['num_requests']} ok  "
                      f"{r['request_throughput']:.3f} req/s  {r['output_tokens_per_s']:.1f} tok/s  "
                      f"TTFT med {r['ttft_s']['median']:.1f}s  TPOT med {1000 * r['tpot_s']['median']:.0f}ms",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    def ms(d, k):
        return "-" if d[k] is None else f"{1000 * d[k]:.0f}"

    lines = [f"Machine: {machine()}; {a.prompt_tokens}-token prompts, {a.max_tokens} output tokens, "
             f"KV budget {a.kv_cache_gib:g} GiB", "",
             "| layout | concurrency | requests | req/s | output tok/s | TTFT mean/median/p99 ms | TPOT mean/median/p99 ms | ITL mean/median/p99 ms | E2E mean/median/p99 ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [" / ".join(ms(r[k], q) for q in ("mean", "median", "p99")) for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")]
        lines.append(f"| {r['layout']} | {r['concurrency']} | {r['num_requests']} | {r['request_throughput']:.3f} | "
                     f"{r['output_tokens_per_s']:.1f} | " + " | ".join(cells) + f" | {r['failed']} |")
    table = "\n".join(lines)
    print("\n" + table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    Path(a.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
