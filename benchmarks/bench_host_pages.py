"""Select heads' pages in host memory (select_host_pages): how much of the hot set each
decode step must copy in, and what the device keeps, against the same layout with every
page in the pool. Real prompts (documents of the quality suite's prose sources), greedy
decode of both engines side by side: tokens compared, device and host KV bytes per
sequence, pages each select head attends per step, pages copied in per step (what a GPU
would move over PCIe), the hot set's hit rate, and decode tokens/s of both on this
machine (host and device are the same memory here, so this is the books' and copies'
overhead, not a GPU's transfer time).

    python benchmarks/bench_host_pages.py --model qwen2.5-coder-0.5b \
        --layout headwise/layouts/qwen2.5-coder-0.5b-instruct-gates-60-w1024-select2048.json \
        --context 8192 --batch 2 --steps 64

Writes a Markdown table and JSON to --out-dir.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, save  # noqa: E402


def prompts(tokenizer, context: int, batch: int) -> list[list[int]]:
    """`batch` prompts of `context` tokens, each from another eval-source document run."""
    from headwise.evaluation.sources import SOURCES

    docs = [d for name in ("licenses", "pydoc", "man") for d in SOURCES[name].read()]
    text = "\n\n".join(docs)
    ids = tokenizer.encode(text)
    if len(ids) < batch * context:
        raise SystemExit(f"the prose sources give {len(ids)} tokens; {batch} x {context} asked")
    return [ids[i * context:(i + 1) * context] for i in range(batch)]


def run(llm, ps, steps: int, repeats: int) -> tuple[list, list[float], tuple[int, int]]:
    """Greedy outputs of `steps` tokens, the times of steps - 2 decode steps in steady
    state (`repeats` of them), and the hot set's (pages copied, hits) over the first. The
    prompts are prefilled once into the prefix cache first; then they are run to two
    tokens and to `steps` tokens (each computing only its prompt's last block), and the
    first run is taken off the second. One such window lasts a second or two, and on a
    shared two-core machine one window's speed varied 1.6x between runs: hence repeats."""
    from headwise import SamplingParams

    hot = llm.engine.runner.kv.hot

    def timed(n):
        t = time.perf_counter()
        before = (hot.copied, hot.hits) if hot is not None else (0, 0)
        outs = llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
        after = (hot.copied, hot.hits) if hot is not None else (0, 0)
        return outs, time.perf_counter() - t, (after[0] - before[0], after[1] - before[1])

    timed(1)  # the prefill, into the prefix cache
    secs, counts = [], None
    for _ in range(repeats):
        _, t2, (c2, h2) = timed(2)
        outs, tn, (cn, hn) = timed(steps)
        secs.append(tn - t2)
        counts = counts or (cn - c2, hn - h2)
    return outs, secs, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layout", required=True, help="a layout with select heads (PATH)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="tokens generated (at least 3)")
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--repeats", type=int, default=5, help="timed steady-state windows per mode (median)")
    ap.add_argument("--out-dir", default="bench/host_pages")
    a = ap.parse_args(argv)
    if a.steps < 3:
        ap.error("--steps must be at least 3")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    from headwise import LLM
    from headwise.config import parse_size

    # eager decode in both: a compiled step's first use would be timed otherwise
    opts = dict(model=a.model, head_layout=a.layout, max_num_seqs=a.batch, enable_prefix_caching=True,
                enforce_eager=True,
                kv_cache_memory=parse_size(a.kv_cache_memory))
    rows = []
    got = {}
    for mode, extra in (("pool", {}), ("host", {"select_host_pages": True})):
        llm = LLM(**opts, **extra)
        ps = prompts(llm.tokenizer, a.context, a.batch)
        eng = llm.engine
        hot = eng.runner.kv.hot
        outs, secs, (copied, hits) = run(llm, ps, a.steps, a.repeats)
        got[mode] = [o.token_ids for o in outs]
        decodes = a.steps - 2
        speeds = sorted(a.batch * decodes / t for t in secs)
        row = {"mode": mode, "decode_tok_s": statistics.median(speeds), "decode_tok_s_all": speeds,
               "device_kv_mib_per_seq": eng.cache.kv_bytes(a.context + a.steps) / 2**20,
               "host_kv_mib_per_seq": (-(-(a.context + a.steps) // eng.cache.block_size)
                                       * eng.cache.host_block_bytes / 2**20)}
        if hot is not None:
            S = hot.k.shape[0]
            per = decodes * S  # per decode step and select head
            row.update(select_heads=S, hot_pages_per_head=hot.num_pages, hot_set_mib=hot.nbytes / 2**20,
                       pages_attended_per_step=(copied + hits) / per, pages_copied_per_step=copied / per,
                       hit_rate=hits / max(1, copied + hits),
                       copied_kib_per_step_all_heads=copied / decodes * eng.cache.host_block_bytes / S / 1024)
        rows.append(row)
        del llm
    same = got["pool"] == got["host"]
    h = rows[1]

    def speed(row: dict) -> str:
        return f"{row['decode_tok_s']:.1f} [{row['decode_tok_s_all'][0]:.1f}-{row['decode_tok_s_all'][-1]:.1f}]"

    table = "\n".join([
        f"Select pages in host memory: {a.layout}, {a.context} tokens x {a.batch} sequences, {a.steps} decode "
        f"steps; {machine()}",
        "",
        "| | in the pool | in host memory |",
        "|---|---|---|",
        f"| device KV per sequence | {rows[0]['device_kv_mib_per_seq']:.1f} MiB | "
        f"{h['device_kv_mib_per_seq']:.1f} MiB (+ hot set {h['hot_set_mib']:.1f} MiB for all) |",
        f"| host KV per sequence | - | {h['host_kv_mib_per_seq']:.1f} MiB |",
        f"| pages a select head attends per step (all sequences) | | {h['pages_attended_per_step']:.1f} |",
        f"| of them copied in per step (steady state) | | {h['pages_copied_per_step']:.2f} (hit rate {h['hit_rate']:.1%}) |",
        f"| bytes copied in per step, all select heads | | {h['copied_kib_per_step_all_heads']:.0f} KiB |",
        f"| decode tok/s here (CPU), median [min-max] of {a.repeats} | {speed(rows[0])} | {speed(h)} |",
        f"| greedy tokens equal | | {'yes' if same else 'NO'} |",
    ])
    print(table)
    save(str(Path(a.out_dir) / f"host_pages_{a.context}.json"),
         {"machine": machine(), "args": vars(a), "rows": rows, "tokens_equal": same}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
