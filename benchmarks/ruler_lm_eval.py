"""The third-party quality check: EleutherAI lm-evaluation-harness RULER through `headwise
serve`, full attention against head-split layouts, side by side (docs/quality.md).

    make ruler                       # sets up .venv-lmeval, then runs this with its defaults
    python benchmarks/ruler_lm_eval.py --head-layout full --head-layout L.json \\
        --lengths 4096,8192 --limit 10 --out bench/ruler

lm-eval runs in its own virtual environment (LM_EVAL, default .venv-lmeval/bin/lm-eval;
`make ruler` creates it: lm-eval has no torch dependency for API models, so headwise's
pinned torch stays out of it) and talks to a `headwise serve` of each layout on loopback
through its `local-completions` model: the prompts are lm-eval's own, greedy, with its gen
prefixes, so nothing of headwise's evaluation code is involved.

Offline: only RULER's synthetic tasks run (OFFLINE_TASKS: repeated-sentence and needle
haystacks, variable tracking, common- and frequent-word extraction). The essay haystacks
and the QA tasks download data sets, which these machines cannot. RULER's module asks
NLTK for its punkt_tab sentence model at import and downloads it when missing; the tasks
run here never split sentences (only essay haystacks do), so an empty punkt_tab folder in
a private NLTK_DATA keeps that import from reaching the network. Hub access is off
(HF_HUB_OFFLINE, HF_DATASETS_OFFLINE); the tokenizer lm-eval sizes prompts with is the
model's own, saved from the GGUF into the output folder.

Scores are lm-eval's: RULER's string match, the fraction of expected strings found (0-1),
averaged over the samples of a task and length. Every answer is kept under OUT/<layout>/
(--log_samples).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, start_server  # noqa: E402
from headwise.heads.layout import HeadLayout  # noqa: E402
from headwise.evaluation.cli import int_list  # noqa: E402
from headwise.weights.loader import load_tokenizer  # noqa: E402

OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
NEEDS_DOWNLOAD = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery",
                  "ruler_qa_squad", "ruler_qa_hotpot")


def layout_name(spec: str) -> str:
    return spec if spec in ("full", "default") else HeadLayout.load(spec).name


def offline_env(out: Path) -> dict[str, str]:
    nltk_data = out / "nltk_data"
    (nltk_data / "tokenizers" / "punkt_tab" / "english").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "NLTK_DATA": str(nltk_data), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def run_lm_eval(lm_eval: str, url: str, served: str, tokenizer: Path, tasks: list[str], length: int,
                limit: int, out: Path, env: dict[str, str], log) -> dict:
    """One lm-eval run at one length; returns {task: score}."""
    model_args = (f"base_url={url}/v1/completions,model={served},tokenizer={tokenizer},"
                  f"tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent=1,"
                  f"max_length={length + 256},max_retries=1,timeout=1200")
    cmd = [lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(tasks), "--limit", str(limit), "--log_samples", "--output_path", str(out),
           "--metadata", json.dumps({"max_seq_lengths": [length], "tokenizer": str(tokenizer)})]
    subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    newest = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(newest.read_text())["results"]
    return {t: float(results[t][f"{length},none"]) for t in tasks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model name or path (default: the default model)")
    ap.add_argument("--head-layout", action="append", default=None,
                    help="layouts to compare (repeatable): full | default | PATH; default: full and default")
    ap.add_argument("--tasks", default=",".join(OFFLINE_TASKS))
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--limit", type=int, default=10, help="samples per task and length")
    ap.add_argument("--out", default="bench/ruler")
    ap.add_argument("--server-args", default="--kv-cache-memory 1GiB --max-num-batched-tokens 8192",
                    help="further `headwise serve` arguments")
    ap.add_argument("--lm-eval", default=os.environ.get("LM_EVAL", ".venv-lmeval/bin/lm-eval"))
    a = ap.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    blocked = [t for t in tasks if t in NEEDS_DOWNLOAD]
    if blocked:
        raise SystemExit(f"{blocked[0]} needs a data set download, which this machine cannot make; "
                         f"offline RULER tasks: {', '.join(OFFLINE_TASKS)}")
    unknown = [t for t in tasks if t not in OFFLINE_TASKS]
    if unknown:
        raise SystemExit(f"unknown RULER task {unknown[0]!r}; choose from {', '.join(OFFLINE_TASKS)}")
    if a.limit < 1:
        raise SystemExit(f"--limit must be positive, got {a.limit}")
    if not Path(a.lm_eval).is_file():
        raise SystemExit(f"lm-eval not found at {a.lm_eval}; `make ruler` installs it in .venv-lmeval")
    lengths = int_list(a.lengths, "--lengths")
    layouts = a.head_layout or ["full", "default"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer"
    load_tokenizer(a.model).hf.save_pretrained(str(tokenizer))
    env = offline_env(out)
    model_args = [] if a.model is None else ["--model", a.model]
    scores: dict[str, dict[tuple[str, int], float]] = {}
    with open(out / "lm_eval.log", "a") as log:
        for spec in layouts:
            name = layout_name(spec)
            proc, url = start_server(None if spec == "default" else spec,
                                     model_args + ["--served-model-name", "headwise"] + a.server_args.split(),
                                     log=log)
            try:
                for length in lengths:
                    got = run_lm_eval(a.lm_eval, url, "headwise", tokenizer, tasks, length, a.limit,
                                      out / name.replace("/", "_"), env, log)
                    for t, v in got.items():
                        scores.setdefault(name, {})[(t, length)] = v
                    print(f"{name} @ {length}: " + ", ".join(f"{t} {100 * v:.1f}%" for t, v in got.items()), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    names = list(scores)
    lines = [f"Machine: {machine()}; lm-eval RULER through `headwise serve`, {a.limit} samples per task "
             f"and length, greedy; scores in %", "", "| task | length | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for length in lengths:
        for t in tasks:
            lines.append(f"| {t} | {length} | " + " | ".join(f"{100 * scores[n][(t, length)]:.1f}" for n in names) + " |")
        lines.append(f"| mean | {length} | " + " | ".join(
            f"{100 * sum(scores[n][(t, length)] for t in tasks) / len(tasks):.1f}" for n in names) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "ruler.json").write_text(json.dumps(
        {n: [{"task": t, "length": L, "score": v} for (t, L), v in s.items()] for n, s in scores.items()}, indent=1))
    (out / "ruler.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
