"""The KV tier on disk, on the default model: a ~6,000-token document (English prose, in
a chat message) and a question; then a different question answered with the document's
prefix from memory, from the disk tier (the memory copy dropped first), and recomputed
(prefix caching off). Shipped layout and `full`; time to first token and the bytes one
cached document takes on disk.

    python benchmarks/bench_kv_tier.py [--doc-tokens 6000] [--runs 3] [--out bench/kv_tier.json]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_prefix import QUESTIONS, prose  # noqa: E402
from benchmarks.common import machine, save  # noqa: E402
from headwise import LLM, SamplingParams  # noqa: E402
from headwise.heads.layout import HeadLayout  # noqa: E402
from headwise.layouts import shipped_layout  # noqa: E402
from headwise.weights.loader import DEFAULT_MODEL_NAME  # noqa: E402

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    out = llm.generate(ids, PARAMS, use_tqdm=False)[0]
    return out.ttft_s, out.num_cached_tokens


def measure(layout, doc_tokens: int, runs: int) -> dict:
    probe = LLM(head_layout="full", kv_cache_memory=1 << 26)
    tok = probe.tokenizer
    del probe
    doc = prose(tok, doc_tokens, 0)
    ask = [tok.encode_chat([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]) for q in QUESTIONS]
    rec: dict = {"prompt_tokens": len(ask[0])}
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(head_layout=layout, kv_offload_dir=d, kv_cache_memory=2 << 30, max_num_seqs=8,
                  max_num_batched_tokens=2048)
        llm.generate(ask[0][:200], PARAMS, use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        rec["first"], _ = ttft(llm, ask[0])
        mem, disk = [], []
        for r in range(runs):
            mem.append(ttft(llm, ask[1 + 2 * r]))
            llm.offload_prefix_cache()   # everything cached is on disk now ...
            llm.reset_prefix_cache()     # ... and nothing in memory
            disk.append(ttft(llm, ask[2 + 2 * r]))
        rec["memory"] = statistics.median(t for t, _ in mem)
        rec["disk"] = statistics.median(t for t, _ in disk)
        rec["cached_tokens_disk"] = min(c for _, c in disk)
        llm.reset_prefix_cache()
        # Bytes of one cached document: a fresh directory, one request, then offloaded.
        with tempfile.TemporaryDirectory() as d2:
            one = LLM(head_layout=layout, kv_offload_dir=d2, kv_cache_memory=2 << 30, max_num_seqs=8,
                      max_num_batched_tokens=2048)
            one.generate(ask[0], PARAMS, use_tqdm=False)
            one.offload_prefix_cache()
            rec["disk_bytes"] = sum(f.stat().st_size for f in Path(d2).rglob("*.safetensors"))
            one.close()
            del one
        llm.close()
        del llm
        gc.collect()
    off = LLM(head_layout=layout, enable_prefix_caching=False, kv_cache_memory=2 << 30, max_num_seqs=8,
              max_num_batched_tokens=2048)
    off.generate(ask[0][:200], PARAMS, use_tqdm=False)
    rec["recompute"] = statistics.median(ttft(off, ask[1 + r])[0] for r in range(runs))
    del off
    gc.collect()
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench/kv_tier.json")
    a = ap.parse_args(argv)
    shape = (30, 3, 64)
    layouts = {"headwise (shipped)": shipped_layout(DEFAULT_MODEL_NAME, shape),
               "headwise-full": HeadLayout.full(shape, DEFAULT_MODEL_NAME)}
    results = {name: measure(lay, a.doc_tokens, a.runs) for name, lay in layouts.items()}
    lines = [f"Machine: {machine()}; KV budget 2 GiB; TTFT in seconds, median of {a.runs} follow-up questions",
             "", "| layout | prompt tokens | first request | follow-up, memory | follow-up, disk | "
             "follow-up, recomputed | disk vs recompute | MiB on disk per document |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['prompt_tokens']} | {r['first']:.2f} | {r['memory']:.3f} | {r['disk']:.3f} | "
                     f"{r['recompute']:.2f} | {r['recompute'] / r['disk']:.1f}x | {r['disk_bytes'] / 2**20:.1f} |")
    s, f = results["headwise (shipped)"], results["headwise-full"]
    lines += ["", f"Bytes on disk per cached document: full / shipped = {f['disk_bytes'] / s['disk_bytes']:.2f}x"]
    table = "\n".join(lines)
    print(table)
    save(a.out, {"machine": machine(), "results": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
