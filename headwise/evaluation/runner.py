"""`headwise eval`: every task for every layout in one run -> table, JSON records, heatmaps."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from headwise.evaluation import tasks

ALL_TASKS = ("passkey", "niah", "ruler", "ppl", "agreement")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_NEW = {"passkey": 8, "niah": 8, "multikey": 8, "vartrack": 24, "cwe": 16}


@dataclass
class Record:
    layout: str
    task: str
    length: int
    score: float
    n: int
    depth: float | None = None


def prose_text() -> str:
    return "".join(tasks.prose_sentences())


def evaluate_layout(llm, layout_name: str, task_names, lengths, seeds: int = 1, full_outputs=None,
                    progress=None) -> tuple[list[Record], dict]:
    """Run tasks on one engine. Returns records and this layout's greedy outputs (for agreement)."""
    from headwise import SamplingParams

    tok = llm.tokenizer
    records: list[Record] = []
    outputs: dict = {}

    def run(kind, length, depth, seed):
        s = tasks.TASKS[kind](tok, length, depth, seed=seed)
        o = llm.generate(s.text, SamplingParams(max_tokens=MAX_NEW[kind], stop=["\n\n"]), use_tqdm=False)[0]
        if progress is not None:
            progress.update(1)
        return tasks.score(s, o.text)

    for length in lengths:
        for kind in [t for t in ("passkey", "niah") if t in task_names]:
            for depth in DEPTHS:
                sc = [run(kind, length, depth, 1000 * length + 17 * i + int(depth * 100)) for i in range(seeds)]
                records.append(Record(layout_name, kind, length, sum(sc) / len(sc), len(sc), depth))
        if "ruler" in task_names:
            for kind in tasks.RULER_TASKS:
                sc = [run(kind, length, 0.2 + 0.6 * ((i * 0.618) % 1), 7 * length + i) for i in range(max(3, seeds))]
                records.append(Record(layout_name, kind, length, sum(sc) / len(sc), len(sc)))
        if "ppl" in task_names:
            ids = tok.encode(prose_text())[:length]
            nll = -llm.engine.prompt_logprobs(ids).mean()
            records.append(Record(layout_name, "ppl", length, math.exp(float(nll)), len(ids) - 1))
            if progress is not None:
                progress.update(1)
        if "agreement" in task_names:
            prompts = [tasks.niah(tok, length, d, seed=99 + i).text for i, d in enumerate((0.3, 0.7))]
            outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
            outputs[length] = [o.token_ids for o in outs]
            if full_outputs is not None:
                ref = full_outputs[length]
                agree = [sum(a == b for a, b in zip(o, r)) / 32 for o, r in zip(outputs[length], ref)]
                records.append(Record(layout_name, "agreement", length, sum(agree) / len(agree), len(agree)))
            if progress is not None:
                progress.update(1)
    return records, outputs


def summarize(records: list[Record]) -> dict[tuple[str, str, int], float]:
    """Mean score per (layout, task, length); passkey/niah averaged over depths and the
    three RULER tasks also averaged as 'ruler'."""
    acc: dict[tuple[str, str, int], list[float]] = {}
    for r in records:
        acc.setdefault((r.layout, r.task, r.length), []).append(r.score)
        if r.task in tasks.RULER_TASKS:
            acc.setdefault((r.layout, "ruler", r.length), []).append(r.score)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def table(records: list[Record], layouts: list[str], lengths: list[int]) -> str:
    s = summarize(records)
    task_order = [t for t in ("passkey", "niah", "multikey", "vartrack", "cwe", "ruler", "ppl", "agreement")
                  if any(k[1] == t for k in s)]
    lines = ["| task | length | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
    for t in task_order:
        for L in lengths:
            cells = []
            for name in layouts:
                v = s.get((name, t, L))
                cells.append("-" if v is None else (f"{v:.2f}" if t == "ppl" else f"{100 * v:.0f}%"))
            lines.append(f"| {t} | {L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmaps(records: list[Record], out_dir: str | Path) -> list[Path]:
    """One PNG per layout: needle depth x length, mean passkey/niah accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted({r.layout for r in records}):
        rs = [r for r in records if r.layout == name and r.depth is not None]
        if not rs:
            continue
        lengths = sorted({r.length for r in rs})
        grid = torch.full((len(DEPTHS), len(lengths)), float("nan"))
        for di, d in enumerate(DEPTHS):
            for li, L in enumerate(lengths):
                v = [r.score for r in rs if r.depth == d and r.length == L]
                if v:
                    grid[di, li] = sum(v) / len(v)
        fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 1.1 * len(lengths)), 3.6))
        im = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_yticks(range(len(DEPTHS)), [f"{int(d * 100)}%" for d in DEPTHS])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{name}: passkey + needle accuracy", fontsize=9)
        for di in range(len(DEPTHS)):
            for li in range(len(lengths)):
                if not math.isnan(grid[di, li]):
                    ax.text(li, di, f"{grid[di, li]:.0%}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        p = out_dir / f"needle_{name.replace('/', '_')}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def write_json(records: list[Record], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([vars(r) for r in records], indent=1))
