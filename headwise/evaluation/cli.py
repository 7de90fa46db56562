"""Argument handling for `headwise calibrate` and `headwise eval`."""
from __future__ import annotations

import argparse
from pathlib import Path

from headwise.cache.layout import HeadLayout
from headwise.evaluation.runner import ALL_TASKS


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="find which KV heads stay full; write a layout JSON")
    p.add_argument("--model", default=None)
    p.add_argument("--out", required=True, help="layout JSON to write")
    p.add_argument("--full-fraction", type=float, default=0.25)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=24, help="calibration prompts")
    p.add_argument("--lengths", default="1024,2048,3072", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="re-scoring rounds with the split in place")
    p.add_argument("--plot", default=None, help="PNG heatmap of per-head scores (layers x heads)")
    p.add_argument("--from-scores", default=None, metavar="LAYOUT",
                   help="re-select from the scores stored in a calibrated layout (no model run)")
    p.add_argument("--name", default=None, help="name written into the layout")
    p.set_defaults(func=cmd_calibrate)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return values


def cmd_calibrate(args: argparse.Namespace) -> int:
    from headwise.calibration import calibrate, select_from_scores

    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"output directory {str(out.parent)!r} does not exist")
    if args.from_scores:
        layout = select_from_scores(HeadLayout.load(args.from_scores), args.full_fraction,
                                    args.sink, args.window, args.name)
        how = f"selected from the scores in {args.from_scores}"
    else:
        layout = calibrate(args.model, args.full_fraction, args.sink, args.window, args.seed,
                           num_samples=args.samples, lengths=_int_list(args.lengths, "--lengths"),
                           rounds=args.rounds)
        if args.name:
            layout.name = args.name
        how = f"calibrated in {layout.calibration_seconds:.0f}s"
    layout.save(out)
    print(f"wrote {out}: {layout.full_fraction:.1%} of KV heads full "
          f"({sum(layout.num_full(l) for l in range(layout.num_layers))} of "
          f"{layout.num_layers * layout.num_kv_heads}), {how}")
    if args.plot:
        plot_scores(layout, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot_scores(layout: HeadLayout, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    s = torch.tensor(layout.scores)
    fig, ax = plt.subplots(figsize=(2 + 0.6 * layout.num_kv_heads, 1 + 0.22 * layout.num_layers))
    im = ax.imshow(s.numpy(), cmap="viridis", aspect="auto")
    for l in range(layout.num_layers):
        for h in range(layout.num_kv_heads):
            if layout.heads[l][h].kind == "full":
                ax.text(h, l, "F", ha="center", va="center", color="white", fontsize=7)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title("head scores (F = full)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="long-context quality of one or more layouts")
    p.add_argument("--model", default=None)
    p.add_argument("--head-layout", action="append", default=None,
                   help="layout to evaluate (repeatable): full | window | PATH; default: full + shipped")
    p.add_argument("--tasks", default=",".join(ALL_TASKS))
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--seeds", type=int, default=1, help="prompts per (task, length, depth)")
    p.add_argument("--baselines", action="store_true",
                   help="add `window` with the same KV bytes and a random layout with the same full fraction")
    p.add_argument("--rebased", action="store_true",
                   help="also run each layout with window heads under StreamingLLM-style re-based positions")
    p.add_argument("--json", default=None)
    p.add_argument("--plot-dir", default=None)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from headwise.evaluation.suite import run_eval

    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in task_names if t not in ALL_TASKS]
    if bad:
        raise ValueError(f"unknown task {bad[0]!r}; choose from {', '.join(ALL_TASKS)}")
    lengths = _int_list(args.lengths, "--lengths")
    records, text = run_eval(args.model, args.head_layout, task_names, lengths, args.seeds,
                             args.baselines, args.json, args.plot_dir, args.rebased)
    print(text)
    return 0

