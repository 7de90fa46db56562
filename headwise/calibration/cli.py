"""Argument handling for `headwise calibrate`."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from headwise.heads.layout import DEFAULT_BUDGET, DEFAULT_SINK, DEFAULT_WINDOW, HeadLayout
from headwise.calibration.calibrate import METHODS, calibrate, select_from_scores
from headwise.calibration.samples import ALL_KINDS, KINDS, check_kinds
from headwise.calibration.select_profile import DEFAULT_LENGTHS, DEFAULT_RECALL, check_select, select_layout
from headwise.config import add_engine_args, engine_options
from headwise.layouts import native_layout
from headwise.weights.loader import read_model_config
from headwise.evaluation.cli import int_list, name_list

CLASS_SETS = ("full,window", "full,select,window")


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="find which KV heads stay full; write a layout JSON")
    p.add_argument("--out", required=True, help="layout JSON to write")
    p.add_argument("--full-fraction", type=float, default=0.25,
                   help="fraction of the candidate KV heads kept full (on a model with sliding-window "
                        "layers, such as Gemma 3, the heads of its full-attention layers)")
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=24, help="calibration prompts")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"calibration prompt kinds, comma-separated, taken in turn (of {','.join(ALL_KINDS)}; "
                        "tally: a count over the whole prompt)")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths in tokens, comma-separated (default 1024,1536 for gates, else 1024,2048,3072)")
    p.add_argument("--method", choices=METHODS, default="gates",
                   help="how heads are ranked: gates (trained by distillation), mass (attention mass "
                        "outside sink + window), ablation (output change when windowed); docs/quality.md")
    p.add_argument("--rounds", type=int, default=2, help="ablation: re-scoring rounds with the split in place")
    p.add_argument("--steps", type=int, default=64, help="gates: training steps (one prompt each)")
    p.add_argument("--lr", type=float, default=0.05, help="gates: Adam learning rate")
    p.add_argument("--l1", type=float, default=0.05, help="gates: weight of the L1 pull toward window")
    p.add_argument("--plot", default=None, help="PNG heatmap of per-head scores (layers x heads)")
    p.add_argument("--from-scores", default=None, metavar="LAYOUT",
                   help="re-select from the scores stored in a calibrated layout (no model run)")
    p.add_argument("--select-from", default=None, metavar="LAYOUT",
                   help="a layout file, or `native` (Gemma 3's own): make its full heads whose chosen pages hold --recall of their "
                        "attention mass `select` heads (budget --budget, sink --sink, window --window); "
                        f"profile prompts of --lengths tokens (default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--classes", default="full,window", choices=CLASS_SETS,
                   help="the head classes calibration decides: with `select`, the ranking's full heads "
                        "are then profiled as with --select-from, and those reaching --recall become "
                        "select heads (budget --budget, sink --sink, window --select-window, profile "
                        "prompts of --select-lengths tokens)")
    p.add_argument("--select-window", type=int, default=DEFAULT_WINDOW,
                   help="--classes full,select,window: the recent window select heads always attend")
    p.add_argument("--select-lengths", default=None,
                   help="--classes full,select,window: profile prompt lengths "
                        f"(default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="select heads: tokens attended per decode step")
    p.add_argument("--recall", type=float, default=DEFAULT_RECALL,
                   help="select heads: the share of a full head's attention mass its chosen pages must hold")
    p.add_argument("--name", default=None, help="name written into the layout")
    add_engine_args(p, exclude=("head_layout",))
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"output directory {str(out.parent)!r} does not exist")
    three = "select" in args.classes
    kinds = check_kinds(tuple(name_list(args.kinds)))
    if three and (args.from_scores or args.select_from):
        raise ValueError("--classes full,select,window applies to a calibration run; with --from-scores "
                         "or --select-from leave it out (--select-from makes select heads itself)")
    if three:  # checked before the ranking runs, so a bad value loses no work
        select_lengths = int_list(args.select_lengths, "--select-lengths") if args.select_lengths else DEFAULT_LENGTHS
        check_select(args.budget, args.sink, args.select_window, args.recall, select_lengths)
    if args.from_scores:
        layout = select_from_scores(HeadLayout.load(args.from_scores), args.full_fraction,
                                    args.sink, args.window, args.name)
        how = f"selected from the scores in {args.from_scores}"
    elif args.select_from:
        lengths = int_list(args.lengths, "--lengths") if args.lengths else DEFAULT_LENGTHS
        source = (native_layout(read_model_config(args.model)) if args.select_from == "native"
                  else HeadLayout.load(args.select_from))
        if source is None:
            raise ValueError("--select-from native: this model has no native layout (no sliding-window "
                             "layers); give a layout file")
        layout, how = _select(args, source, args.window, lengths, kinds)
    else:
        t0 = time.perf_counter()
        layout = calibrate(args.model, args.full_fraction, args.sink, args.window, args.seed,
                           num_samples=args.samples, lengths=int_list(args.lengths, "--lengths") if args.lengths else None,
                           rounds=args.rounds,
                           engine_options=engine_options(args, exclude=("model", "head_layout")),
                           method=args.method, steps=args.steps, lr=args.lr, l1=args.l1, kinds=kinds)
        how = f"calibrated in {time.perf_counter() - t0:.0f}s"
        if three:
            layout, profiled = _select(args, layout, args.select_window, select_lengths, kinds)
            how += f"; {profiled}"
    if args.name:
        layout.name = args.name
    layout.save(out)
    print(f"wrote {out}: {layout.summary} ({layout.full_fraction:.1%} keep every token), {how}")
    if args.plot:
        plot_scores(layout, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _select(args: argparse.Namespace, source: HeadLayout, window: int,
            lengths: tuple[int, ...], kinds: tuple[str, ...]) -> tuple[HeadLayout, str]:
    """`source` with the full heads whose chosen pages hold --recall of their attention
    mass made select heads -> (layout, what was done, with each head's recall)."""
    t0 = time.perf_counter()
    layout, recall = select_layout(args.model, source, args.budget, args.sink, window, args.recall,
                                   args.samples, lengths, args.seed,
                                   engine_options=engine_options(args, exclude=("model", "head_layout")),
                                   kinds=kinds)
    classes = [s.kind for row in layout.heads for s in row]
    return layout, (f"{classes.count('select')} select heads (recall >= {args.recall}), {classes.count('full')} full, "
                    f"profiled in {time.perf_counter() - t0:.0f}s; recall per head (layers x heads):\n"
                    + "\n".join(" ".join(f"{x:.2f}" for x in row) for row in recall.tolist()))


def plot_scores(layout: HeadLayout, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    s = torch.tensor([[float("nan") if x is None else x for x in row] for row in layout.scores])
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
