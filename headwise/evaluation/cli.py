"""Argument handling for `headwise eval`."""
from __future__ import annotations

import argparse

from headwise.cache.layout import KV_CACHE_DTYPES
from headwise.config import add_engine_args, engine_options
from headwise.evaluation.runner import ALL_TASKS
from headwise.evaluation.suite import EVAL_ENGINE_OPTIONS, run_eval


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return values


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="long-context quality of one or more layouts")
    p.add_argument("--head-layout", action="append", default=None,
                   help="layout to evaluate (repeatable): full | window | native | PATH; default: the reference "
                        "(full, or native for a model with sliding-window layers) + shipped")
    p.add_argument("--tasks", default=",".join(ALL_TASKS))
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--seeds", type=int, default=1, help="prompts per (task, length, depth)")
    p.add_argument("--baselines", action="store_true",
                   help="add `window` with the same KV bytes and a random layout with the same full fraction")
    p.add_argument("--rebased", action="store_true",
                   help="also run each layout with window heads under StreamingLLM-style re-based positions")
    p.add_argument("--kv-dtypes", default="",
                   help="also run each layout with these KV cache dtypes, comma-separated "
                        f"(e.g. int8; choices {', '.join(KV_CACHE_DTYPES[1:])}); rows named LAYOUT+DTYPE")
    p.add_argument("--transformers", action="store_true",
                   help="add a `transformers` row: HF transformers on the same weights (passkey, niah, ruler)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot-dir", default=None)
    add_engine_args(p, exclude=("head_layout",))
    p.set_defaults(func=cmd_eval, **EVAL_ENGINE_OPTIONS)


def cmd_eval(args: argparse.Namespace) -> int:
    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in task_names if t not in ALL_TASKS]
    if bad:
        raise ValueError(f"unknown task {bad[0]!r}; choose from {', '.join(ALL_TASKS)}")
    lengths = int_list(args.lengths, "--lengths")
    kv_dtypes = tuple(d.strip() for d in args.kv_dtypes.split(",") if d.strip())
    bad = [d for d in kv_dtypes if d not in KV_CACHE_DTYPES]
    if bad:
        raise ValueError(f"unknown KV cache dtype {bad[0]!r} in --kv-dtypes; choose from {', '.join(KV_CACHE_DTYPES)}")
    records, text = run_eval(args.model, args.head_layout, task_names, lengths, args.seeds,
                             args.baselines, args.json, args.plot_dir, args.rebased,
                             engine_options(args, exclude=("model", "head_layout")), kv_dtypes,
                             args.transformers)
    print(text)
    return 0

