"""`make bench`: headwise (calibrated layout), the same with an int8 KV cache, headwise
(`full`), HF transformers and llama.cpp (llama-cpp-python on the same GGUF) side by side
on the default model.

Per system and context: time to first token, decode tokens/s at batch 1, KV bytes per
sequence, sequences that fit a fixed KV budget, aggregate decode tokens/s with that many
sequences, peak resident memory. Median [min-max] of --runs runs. Writes a Markdown
table, bench/results.json and bench/results.png.

    python benchmarks/bench_peers.py [--contexts 1024,2048,4096,8192] [--runs 3] [--budget-gib 2]

Aggregate decode is measured with every sequence's cache already at the context length:
headwise places sequences in its cache directly, transformers replicates one prefilled
cache across the batch; neither runs the batch's prefill (decode cost does not depend on
the cached values). llama.cpp: its unified KV cache is given n_ctx = budget / (bytes per
token) with n_seq_max sequences of `context` tokens each, decoded together in one batch.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peers  # noqa: E402
from benchmarks.common import Stat, machine  # noqa: E402
from headwise.config import DTYPE_CHOICES, EngineConfig, dtype_name  # noqa: E402
from headwise.weights.loader import checkpoint_dtype  # noqa: E402

FIELDS = ("system", "context", "ttft_s", "decode_tok_s", "agg_tok_s", "kv_bytes_per_seq",
          "max_concurrency", "peak_rss_bytes")

# llama.cpp's settings (flash attention on and off with its f16 KV; q8_0 KV, which needs
# flash attention), run as separate systems; the ratio table adds a row comparing each
# figure with the best of them and names which setting won it.
# (not "llama.cpp": the library's default, which picks one of them)
LLAMA_SETTINGS = tuple(n for n in peers.LLAMA_SYSTEMS if n != "llama.cpp")
RATIO_KEYS = ("ttft", "decode", "kv", "concurrency", "aggregate")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(system, L, runs, budget, new_tokens, agg_steps) -> dict:
    """One system at context L -> its record (medians; min/max alongside)."""
    single = [system.single(L, new_tokens) for _ in range(runs)]
    conc = system.max_concurrency(L + agg_steps + 2, budget)
    agg = [system.aggregate(L, conc, agg_steps) for _ in range(runs)] if conc > 0 else [0.0]
    ttft, dec, ag = Stat.of([s[0] for s in single]), Stat.of([s[1] for s in single]), Stat.of(agg)
    rec = {"system": system.name, "context": L, "ttft_s": ttft.median, "decode_tok_s": dec.median,
           "agg_tok_s": ag.median, "kv_bytes_per_seq": system.kv_bytes(L), "max_concurrency": conc,
           "peak_rss_bytes": peak_rss(),
           "range": {"ttft_s": [ttft.lo, ttft.hi], "decode_tok_s": [dec.lo, dec.hi], "agg_tok_s": [ag.lo, ag.hi]}}
    print(f"{system.name:<22} {L:>5}: TTFT {ttft.fmt()} s, decode {dec.fmt('.1f')} tok/s, "
          f"KV {rec['kv_bytes_per_seq'] / 2**20:.1f} MiB, fit {conc}, agg {ag.fmt('.1f')} tok/s", flush=True)
    return rec


def _run_system(name, model, layout, dtype, L, runs, budget, new_tokens, agg_steps):
    """(record, None), or (None, why) where the system cannot run here."""
    try:
        system = peers.make(name, model, L, layout, dtype)
    except peers.Skip as e:
        return None, str(e)
    rec = measure(system, L, runs, budget, new_tokens, agg_steps)
    system.close()
    return rec, None


def in_fresh_process(fn, *args):
    """fn(*args) in a newly spawned process (nothing inherited, so its peak RSS is fn's own)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def ratio_table(records: list[dict], skipped: dict[str, str], ref: str) -> str:
    systems = list(dict.fromkeys(r["system"] for r in records))
    contexts = sorted({r["context"] for r in records})
    by = {(r["system"], r["context"]): r for r in records}
    lines = ["| context | system | TTFT s | decode tok/s | KV MiB/seq | seqs in budget | aggregate tok/s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for L in contexts:
        for s in systems:
            r = by.get((s, L))
            if r is None:
                continue
            rg = r["range"]
            lines.append(f"| {L} | {s} | {r['ttft_s']:.2f} [{rg['ttft_s'][0]:.2f}-{rg['ttft_s'][1]:.2f}] | "
                         f"{r['decode_tok_s']:.1f} [{rg['decode_tok_s'][0]:.1f}-{rg['decode_tok_s'][1]:.1f}] | "
                         f"{r['kv_bytes_per_seq'] / 2**20:.1f} | {r['max_concurrency']} | "
                         f"{r['agg_tok_s']:.1f} [{rg['agg_tok_s'][0]:.1f}-{rg['agg_tok_s'][1]:.1f}] | "
                         f"{'n/a' if r['peak_rss_bytes'] is None else format(r['peak_rss_bytes'] / 2**20, '.0f')} |")
    lines += ["", f"Ratios of {ref} against each peer (TTFT: peer/ours, higher is better for us; others ours/peer):", "",
              "| context | peer | TTFT speed-up | decode | KV smaller | concurrency | aggregate |",
              "|---|---|---|---|---|---|---|"]
    for L in contexts:
        me = by.get((ref, L))
        for s in systems:
            peer = by.get((s, L))
            if s == ref or me is None or peer is None:
                continue
            rt = ratios(me, peer)
            lines.append(f"| {L} | {s} | {rt['ttft']:.2f}x | {rt['decode']:.2f}x | {rt['kv']:.2f}x | "
                         f"{rt['concurrency']:.2f}x | {rt['aggregate']:.2f}x |")
        settings = [by[(s, L)] for s in LLAMA_SETTINGS if (s, L) in by]
        if me is not None and len(settings) > 1:
            rt, won = best_ratios(me, settings)
            lines.append(f"| {L} | llama.cpp at its best | " + " | ".join(
                f"{rt[k]:.2f}x ({won[k].replace('llama.cpp-', '')})" for k in RATIO_KEYS) + " |")
    for s, why in skipped.items():
        lines.append(f"\n{s}: skipped ({why})")
    return "\n".join(lines)


def best_ratios(me: dict, settings: list[dict]) -> tuple[dict[str, float], dict[str, str]]:
    """Ratios of `me` against the best of one peer's settings, figure by figure: the peer's
    best is our smallest ratio (every ratio is "ours over theirs", higher is better for us).
    -> (ratios, the system that won each figure)."""
    per = [(ratios(me, r), r["system"]) for r in settings]
    best = {k: min(rt[k] for rt, _ in per) for k in RATIO_KEYS}
    # a tie (KV bytes do not depend on the setting) names every setting that reached it
    return best, {k: "/".join(s for rt, s in per if rt[k] == best[k]) for k in RATIO_KEYS}


def ratios(me: dict, peer: dict) -> dict[str, float]:
    def div(a, b):
        return a / b if b else float("inf")

    return {"ttft": div(peer["ttft_s"], me["ttft_s"]), "decode": div(me["decode_tok_s"], peer["decode_tok_s"]),
            "kv": div(peer["kv_bytes_per_seq"], me["kv_bytes_per_seq"]),
            "concurrency": div(me["max_concurrency"], peer["max_concurrency"]),
            "aggregate": div(me["agg_tok_s"], peer["agg_tok_s"])}


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in dict.fromkeys(r["system"] for r in records):
        rs = sorted((r for r in records if r["system"] == s), key=lambda r: r["context"])
        xs = [r["context"] for r in rs]
        axes[0].plot(xs, [r["ttft_s"] for r in rs], marker="o", label=s)
        axes[1].plot(xs, [r["agg_tok_s"] for r in rs], marker="o", label=s)
    axes[0].set(title="time to first token", xlabel="context (tokens)", ylabel="seconds")
    axes[1].set(title="aggregate decode within the KV budget", xlabel="context (tokens)", ylabel="tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--layout", default=None, help="head layout for `headwise` (default: the shipped one)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--agg-steps", type=int, default=8)
    ap.add_argument("--systems", default="headwise,headwise-select,headwise-int8,headwise-full,transformers,"
                                         "llama.cpp-fa,llama.cpp-nofa,llama.cpp-fa-q8",
                    help="comma-separated; headwise-select: the shipped layout with select heads; "
                         "llama.cpp-fa / -nofa: flash attention on / off, llama.cpp-fa-q8: flash "
                         "attention with a q8_0 KV cache, llama.cpp: the library default; also "
                         "headwise-codes / headwise-dense (quantized weights "
                         "kept as codes only / with prepacked dense copies, whichever the engine's "
                         "default is here), headwise-native (a model's native layout) and "
                         "headwise@LAYOUT.json")
    ap.add_argument("--out-dir", default="bench")
    ap.add_argument("--ref", default="headwise", help="system the ratio table compares against the others")
    ap.add_argument("--merge", action="append", default=[], metavar="RESULTS.json",
                    help="records of an earlier run (its results.json) shown in the same tables; a "
                         "system and context measured in this run replaces the earlier record")
    ap.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                    help="headwise and transformers compute dtype (auto: as the engine picks it)")
    a = ap.parse_args(argv)
    dtype = dtype_name(EngineConfig(dtype=a.dtype).resolve_dtype(checkpoint_dtype(a.model)))
    contexts = [int(x) for x in a.contexts.split(",")]
    budget = int(a.budget_gib * 2**30)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    earlier = [r for f in a.merge for r in load_records(Path(f))]
    records, skipped = [], {}
    for name in a.systems.split(","):
        # Each system and context runs in a fresh process, so its peak RSS is its own: with
        # one process per system, the 8K row's peak also held what 1K-4K had left resident
        # (freed memory does not all go back to the OS; 4432 against 2776 MiB for SmolLM2).
        for L in contexts:
            rec, why = in_fresh_process(_run_system, name, a.model, a.layout, dtype, L, a.runs, budget,
                                        a.new_tokens, a.agg_steps)
            if why is None:
                records.append(rec)
            else:
                print(f"{name}: skipped ({why})", flush=True)
                skipped[name] = why
            # Written after every context: a long run stopped part way keeps what it measured.
            table = write_results(out, merged(earlier, records), skipped, dtype, a.budget_gib, a.runs, a.ref)
            if why is not None:
                break
    print("\n" + table)
    if records or earlier:
        plot(merged(earlier, records), out / "results.png")
    return 0


def load_records(path: Path) -> list[dict]:
    """The records of an earlier run's results.json, each with the run's date."""
    try:
        res = json.loads(path.read_text())
        recs = res["records"]
        missing = {f for r in recs for f in FIELDS + ("range",) if f not in r}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--merge {path}: not a results.json of this benchmark ({e})")
    if missing:
        raise SystemExit(f"--merge {path}: records lack {sorted(missing)}")
    return [r | {"date": r.get("date", res.get("date"))} for r in recs]


def merged(earlier: list[dict], records: list[dict]) -> list[dict]:
    """Earlier records, less those this run measured again, then this run's."""
    now = {(r["system"], r["context"]) for r in records}
    return [r for r in earlier if (r["system"], r["context"]) not in now] + records


def write_results(out: Path, records: list[dict], skipped: dict, dtype: str, budget_gib: float, runs: int,
                  ref: str) -> str:
    today = time.strftime("%Y-%m-%d")
    dates = sorted({r.get("date") or today for r in records} | {today})
    merged_from = f"; records of {', '.join(dates)}" if len(dates) > 1 else ""
    table = (f"Machine: {machine()}; {dtype} (headwise, transformers); KV budget {budget_gib:g} GiB; "
             f"median [min-max] of {runs} runs{merged_from}\n\n"
             + ratio_table(records, skipped, ref))
    (out / "results.json").write_text(json.dumps(
        {"machine": machine(), "date": today, "dtype": dtype, "skipped": skipped,
         "records": [{k: r[k] for k in FIELDS} | {"range": r["range"], "date": r.get("date") or today}
                     for r in records]}, indent=1))
    (out / "results.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(main())
