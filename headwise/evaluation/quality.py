"""The quality suite (`headwise eval --suite`, `make quality`): every family of
evaluation.families at every length, DEPTHS x seeds prompts each, per layout; perplexity
on each evaluation source; 95% intervals; the verdict "equal to the reference".

Equal to the reference (full attention, or a model's native layout) means both:
- per family and length, the layout's mean score is not below the lower end of the
  reference's 95% interval (Wilson's score interval on the mean over the prompts; a mean
  above the interval is better, not different, and counts as equal);
- over the whole suite, the layout fails at most MAX_LOST of the prompts the reference
  passes (a prompt passes when it scores 1).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from headwise.evaluation import tasks
from headwise.evaluation.families import FAMILIES
from headwise.evaluation.sources import EVAL_SOURCES

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SEEDS = 3
MAX_LOST = 0.02
Z95 = 1.959964


@dataclass
class SuiteRecord:
    layout: str
    family: str        # a FAMILIES name, or "ppl:<source>"
    length: int
    depth: float | None
    seed: int
    score: float       # fraction of expected strings found; perplexity for ppl rows
    output: str = ""
    full_fraction: float | None = None  # of the layout's KV heads


def seed_of(depth_index: int, i: int) -> int:
    """The seed of the i-th prompt at a depth: 15 distinct seeds per length cover every
    pairing of phrasing and source (families._source)."""
    return 3 * depth_index + i


def run_suite(llm, layout: str, families=tuple(FAMILIES), lengths=(1024, 2048, 4096, 8000),
              seeds: int = SEEDS, ppl: bool = True, progress=None, skip=frozenset(),
              on_record=None) -> list[SuiteRecord]:
    """Greedy answers of one engine to every prompt of the suite, scored; the prompts
    `skip` names, as (family, length, depth, seed), are left out (records held already).
    `on_record(record)` is called as each record is made (a caller saves there: at 16K a
    family of a 1.5B model is 10-50 minutes of prompts)."""
    frac = llm.engine.layout.full_fraction
    from headwise.sampling import SamplingParams

    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown suite family {bad[0]!r}; choose from {', '.join(FAMILIES)}")
    tok, out = llm.tokenizer, []
    for length in lengths:
        for name in families:
            fam = FAMILIES[name]
            for d, depth in enumerate(DEPTHS):
                for i in range(seeds):
                    seed = seed_of(d, i)
                    if (name, length, depth, seed) in skip:
                        continue
                    s = fam.build(tok, length, depth, seed)
                    o = llm.generate(s.text, SamplingParams(max_tokens=fam.max_new, stop=["\n\n"]),
                                     use_tqdm=False)[0]
                    out.append(SuiteRecord(layout, name, length, depth, seed, tasks.score(s, o.text), o.text, frac))
                    if on_record is not None:
                        on_record(out[-1])
                    if progress is not None:
                        progress.update(1)
        if ppl:
            for src in EVAL_SOURCES:
                ids = tok.encode("".join(tasks.prose_sentences(src)))[:length]
                nll = -llm.engine.prompt_logprobs(ids).mean()
                out.append(SuiteRecord(layout, f"ppl:{src}", length, None, 0, math.exp(float(nll)), "", frac))
                if on_record is not None:
                    on_record(out[-1])
    return out


def prompts(families, lengths, seeds: int) -> list[tuple[str, int, float, int]]:
    """(family, length, depth, seed) of every prompt run_suite answers."""
    return [(f, L, depth, seed_of(d, i)) for L in lengths for f in families
            for d, depth in enumerate(DEPTHS) for i in range(seeds)]


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95% score interval of a mean of n scores in [0, 1] (Wilson's, exact at 0 and 1)."""
    if n == 0:
        return 0.0, 1.0
    d = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / d
    half = z / d * math.sqrt(max(0.0, mean * (1 - mean) / n + z * z / (4 * n * n)))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Cell:
    family: str
    length: int
    n: int
    ref_mean: float
    ref_interval: tuple[float, float]
    mean: float

    @property
    def equal(self) -> bool:
        return self.mean >= self.ref_interval[0] - 1e-12


@dataclass
class Verdict:
    layout: str
    cells: list[Cell]
    ref_passed: int      # prompts the reference passes
    lost_prompts: list[tuple[str, int, float, int]]  # of those, the ones this layout fails: (family, length, depth, seed)
    ppl: dict[tuple[str, int], tuple[float, float]]  # (source, length) -> (reference, layout)

    @property
    def lost(self) -> int:
        return len(self.lost_prompts)

    @property
    def lost_fraction(self) -> float:
        return self.lost / self.ref_passed if self.ref_passed else 0.0

    @property
    def equal(self) -> bool:
        return all(c.equal for c in self.cells) and self.lost_fraction <= MAX_LOST

    @property
    def mean(self) -> float:
        return sum(c.mean for c in self.cells) / max(1, len(self.cells))


def _by_prompt(records: list[SuiteRecord], layout: str) -> dict[tuple, float]:
    return {(r.family, r.length, r.depth, r.seed): r.score for r in records
            if r.layout == layout and not r.family.startswith("ppl:")}


def compare(records: list[SuiteRecord], ref: str, layout: str) -> Verdict:
    """The layout's verdict against the reference, over the prompts both answered."""
    a, b = _by_prompt(records, ref), _by_prompt(records, layout)
    keys = [k for k in a if k in b]
    if not keys:
        raise ValueError(f"no prompt answered by both {ref!r} and {layout!r}")
    cells = []
    for fam, length in dict.fromkeys((k[0], k[1]) for k in keys):
        ks = [k for k in keys if k[:2] == (fam, length)]
        rm = sum(a[k] for k in ks) / len(ks)
        cells.append(Cell(fam, length, len(ks), rm, wilson(rm, len(ks)), sum(b[k] for k in ks) / len(ks)))
    passed = [k for k in keys if a[k] >= 1.0]
    lost = [k for k in passed if b[k] < 1.0]
    def ppl_of(name: str) -> dict[tuple[str, int], float]:
        return {(r.family[4:], r.length): r.score for r in records if r.layout == name and r.family.startswith("ppl:")}

    ppl_ref, ppl_lay = ppl_of(ref), ppl_of(layout)
    ppl = {k: (ppl_ref[k], v) for k, v in ppl_lay.items() if k in ppl_ref}
    return Verdict(layout, cells, len(passed), lost, ppl)


def layouts_of(records: list[SuiteRecord]) -> list[str]:
    return list(dict.fromkeys(r.layout for r in records))


def report(records: list[SuiteRecord], ref: str) -> str:
    """Markdown: per family and length, every layout's mean (reference with its interval,
    a cell below it marked), then each layout's verdict line and perplexities."""
    others = [l for l in layouts_of(records) if l != ref]
    verdicts = [compare(records, ref, l) for l in others]
    head = [f"{ref} (95% interval)"] + others
    lines = ["| family | length | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    base = compare(records, ref, ref).cells
    for i, c in enumerate(base):
        row = [f"{c.ref_mean:.0%} ({c.ref_interval[0]:.1%}-{c.ref_interval[1]:.1%})"]
        for v in verdicts:
            cell = next((x for x in v.cells if (x.family, x.length) == (c.family, c.length)), None)
            row.append("-" if cell is None else f"{cell.mean:.0%}" + ("" if cell.equal else " **below**"))
        lines.append(f"| {c.family} | {c.length} | " + " | ".join(row) + " |")
    lines.append("")
    for v in verdicts:
        if v.ppl:
            ppl = f"perplexity at most {max(l / r - 1 for r, l in v.ppl.values()):+.1%} over {ref}'s"
        else:  # never a figure where one of the two was not measured
            ppl = f"perplexity not compared (none of {ref} and {v.layout} at the same source and length)"
        lines.append(f"- {v.layout}: {'EQUAL to' if v.equal else 'NOT equal to'} {ref}; "
                     f"{sum(not c.equal for c in v.cells)} of {len(v.cells)} cells below the interval; "
                     f"fails {v.lost} of the {v.ref_passed} prompts {ref} passes ({v.lost_fraction:.1%}, "
                     f"limit {MAX_LOST:.0%}); mean score {v.mean:.1%} ({ref} "
                     f"{sum(c.ref_mean for c in v.cells) / max(1, len(v.cells)):.1%}); {ppl}"
                     + (f"; lost: {', '.join(_named(k) for k in v.lost_prompts)}" if v.lost_prompts else ""))
    return "\n".join(lines)


def _named(key: tuple[str, int, float, int]) -> str:
    """A prompt's name in a report: family@length depth% seed."""
    fam, length, depth, seed = key
    return f"{fam}@{length} depth {depth:.0%} seed {seed}"


def save(records: list[SuiteRecord], path: str | Path) -> None:
    """Written beside and renamed over `path`, so a run stopped mid-write keeps the last
    complete file (runs resume from it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([asdict(r) for r in records], indent=0))
    os.replace(tmp, path)


def load(*paths: str | Path) -> list[SuiteRecord]:
    """The records of --json files, each prompt (layout, family, length, depth, seed) and
    perplexity once. Files may overlap: two runs resumed from the same record and run side
    by side both hold it, and a run given both would otherwise write it twice. A prompt
    held with two different results is refused rather than one silently winning: which
    stands is the user's call."""
    kept: dict[tuple, tuple[SuiteRecord, Path]] = {}
    for p in map(Path, paths):
        for raw in json.loads(p.read_text()):
            r = SuiteRecord(**raw)
            key = (r.layout, r.family, r.length, r.depth, r.seed)
            first, where = kept.setdefault(key, (r, p))
            if first != r:
                raise ValueError(f"{where} and {p} hold different results for layout {r.layout!r}, "
                                 f"{r.family} at {r.length} tokens, depth {r.depth}, seed {r.seed} "
                                 f"(scores {first.score} and {r.score}); leave one of them out")
    return [r for r, _ in kept.values()]


def method_of(layout: str) -> str:
    """A layout name less its trailing fraction and window ("smollm2-gates-33-w512" ->
    "smollm2-gates"): the series a layout belongs to in the fraction plot."""
    return re.sub(r"(-\d+(\.\d+)?)?(-w\d+)?$", "", layout) or layout


def plot_fractions(records: list[SuiteRecord], ref: str, path: str | Path, title: str = "") -> Path:
    """PNG, two panels against the full fraction, one line per method (method_of): each
    layout's mean suite score (the reference's mean and interval as a band), and the share
    of the prompts the reference passes that the layout fails (MAX_LOST as a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = compare(records, ref, ref)
    n = sum(c.n for c in base.cells)
    lo, hi = wilson(base.mean, n)
    fig, (ax, ax_lost) = plt.subplots(1, 2, figsize=(10, 4))
    ax.axhspan(lo, hi, color="0.85", label=f"{ref} (95% interval)")
    ax.axhline(base.mean, color="0.4", lw=1)
    ax_lost.axhline(MAX_LOST, color="0.4", lw=1, ls="--", label=f"limit ({MAX_LOST:.0%})")
    series: dict[str, list[tuple[float, Verdict]]] = {}
    for name in layouts_of(records):
        frac = next((r.full_fraction for r in records if r.layout == name), None)
        if name == ref or frac is None:
            continue
        series.setdefault(method_of(name), []).append((frac, compare(records, ref, name)))
    for label, pts in series.items():
        pts.sort(key=lambda p: p[0])
        fracs = [f for f, _ in pts]
        ax.plot(fracs, [v.mean for _, v in pts], "-o", label=label)
        ax_lost.plot(fracs, [v.lost_fraction for _, v in pts], "-o", label=label)
        for f, v in pts:
            if v.equal:
                ax.plot(f, v.mean, "k*", ms=12)
                ax_lost.plot(f, v.lost_fraction, "k*", ms=12)
    for a in (ax, ax_lost):
        a.set_xlabel("fraction of KV heads full")
        a.legend(fontsize=7)
    ax.set_ylabel("mean suite score")
    ax_lost.set_ylabel(f"share of {ref}'s passed prompts failed")
    fig.suptitle(title or f"quality suite against {ref} (* equal to {ref})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
