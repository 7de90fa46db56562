"""Argument handling for `headwise eval`."""
from __future__ import annotations

import argparse
from pathlib import Path

from headwise.heads.layout import KV_CACHE_DTYPES
from headwise.config import add_engine_args, engine_options
from headwise.evaluation import quality
from headwise.evaluation.families import FAMILIES
from headwise.evaluation.runner import ALL_TASKS
from headwise.evaluation.suite import EVAL_ENGINE_OPTIONS, run_eval, run_quality


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """The non-empty names of a comma-separated list, stripped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="long-context quality of one or more layouts")
    p.add_argument("--head-layout", action="append", default=None,
                   help="layout to evaluate (repeatable): full | window | native | PATH; default: the reference "
                        "(full, or native for a model with sliding-window layers) + shipped")
    p.add_argument("--tasks", default=",".join(ALL_TASKS))
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--seeds", type=int, default=None, help="prompts per (task, length, depth); default 1, "
                   "3 with --suite")
    p.add_argument("--baselines", action="store_true",
                   help="add `window` with the same KV bytes and a random layout with the same full fraction")
    p.add_argument("--rebased", action="store_true",
                   help="also run each layout with window heads under StreamingLLM-style re-based positions")
    p.add_argument("--kv-dtypes", default="",
                   help="also run each layout with these KV cache dtypes, comma-separated "
                        f"(e.g. int8; choices {', '.join(KV_CACHE_DTYPES[1:])}); rows named LAYOUT+DTYPE")
    p.add_argument("--transformers", action="store_true",
                   help="add a `transformers` row: HF transformers on the same weights (passkey, niah, ruler)")
    p.add_argument("--suite", action="store_true",
                   help="run the quality suite (every family x length x 5 depths x --seeds prompts, "
                        "perplexity per source; 95%% intervals and the equal-to-reference verdict) "
                        "instead of --tasks; --seeds defaults to 3")
    p.add_argument("--families", default=",".join(FAMILIES), help="suite families, comma-separated")
    p.add_argument("--report", action="append", default=[], metavar="JSON",
                   help="suite records of earlier runs (--suite --json) to add to the table; a prompt "
                        "(layout, family, length, depth, seed) they hold is not run again, so giving a "
                        "stopped run's own --json back resumes it, and a run with more --seeds adds only "
                        "the new seeds' prompts (repeatable)")
    p.add_argument("--no-reference", action="store_true",
                   help="suite: run only the --head-layout layouts, not the reference (merge with its "
                        "records later through --report)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot-dir", default=None)
    add_engine_args(p, exclude=("head_layout",))
    p.set_defaults(func=cmd_eval, **EVAL_ENGINE_OPTIONS)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.suite or args.report:
        return cmd_suite(args)
    args.seeds = args.seeds or 1
    task_names = name_list(args.tasks)
    bad = [t for t in task_names if t not in ALL_TASKS]
    if bad:
        raise ValueError(f"unknown task {bad[0]!r}; choose from {', '.join(ALL_TASKS)}")
    lengths = int_list(args.lengths, "--lengths")
    kv_dtypes = tuple(name_list(args.kv_dtypes))
    bad = [d for d in kv_dtypes if d not in KV_CACHE_DTYPES]
    if bad:
        raise ValueError(f"unknown KV cache dtype {bad[0]!r} in --kv-dtypes; choose from {', '.join(KV_CACHE_DTYPES)}")
    records, text = run_eval(args.model, args.head_layout, task_names, lengths, args.seeds,
                             args.baselines, args.json, args.plot_dir, args.rebased,
                             engine_options(args, exclude=("model", "head_layout")), kv_dtypes,
                             args.transformers)
    print(text)
    return 0



def cmd_suite(args: argparse.Namespace) -> int:
    families = name_list(args.families)
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown suite family {bad[0]!r}; choose from {', '.join(FAMILIES)}")
    seeds = args.seeds or quality.SEEDS
    if seeds < 1:
        raise ValueError(f"--seeds must be positive, got {seeds}")
    lengths = int_list(args.lengths, "--lengths")
    previous = quality.load(*args.report) if args.report else None
    specs = args.head_layout
    if not args.suite:  # --report alone: the table of the records given, at --lengths
        specs, previous = [], [r for r in previous if r.length in lengths]
    records, text = run_quality(args.model, specs, families, lengths, seeds,
                                args.json, engine_options(args, exclude=("model", "head_layout")), previous,
                                reference=args.suite and not args.no_reference)
    if not records:
        raise ValueError("nothing to run: give --head-layout with --no-reference, or drop --no-reference"
                         if args.suite else f"the reports hold no records at --lengths {args.lengths}")
    if text is None:
        print(f"no reference records: {', '.join(quality.layouts_of(records))} written to {args.json}; "
              f"add the reference's with --report for the table")
        return 0
    print(text)
    if args.plot_dir:
        ref = "full" if "full" in quality.layouts_of(records) else "native"
        print(f"wrote {quality.plot_fractions(records, ref, Path(args.plot_dir) / 'quality_fractions.png')}")
    return 0
