"""Runs the evaluation over several layouts (plus baselines) and writes the outputs."""
from __future__ import annotations

import torch
from tqdm import tqdm

from headwise.heads.layout import DEFAULT_SINK, HeadLayout, resolve_layout
from headwise.cache.spec import CacheGeometry, KVClassSpec
from headwise.evaluation import quality, runner
from headwise.evaluation.reference import REFERENCE_TASKS, TransformersReference
from headwise.layouts import native_layout, shipped_layout
from headwise.llm import LLM
from headwise.weights.loader import read_model_config

# Prompts run one at a time (two for agreement): few ring slots, so the wide-window
# baseline still fits the budget; one chunk per prompt.
EVAL_ENGINE_OPTIONS = dict(kv_cache_memory=1 << 30, max_num_batched_tokens=8192, max_num_seqs=2)


def _name(spec, layout: HeadLayout) -> str:
    if isinstance(spec, str) and spec in ("full", "window", "native"):
        return spec
    return layout.name


def equal_bytes_window(layout: HeadLayout, length: int, dtype: torch.dtype = torch.float32,
                       block_size: int = 16) -> HeadLayout:
    """All-window layout (StreamingLLM) whose KV bytes at `length` match `layout`'s
    (KV of both classes in `dtype`)."""
    L, H, D = layout.shape
    paged, rings = KVClassSpec("paged", dtype, D), KVClassSpec("ring", dtype, D)
    total = CacheGeometry.from_layout(layout, block_size, paged, rings).seq_bytes(length)
    ring = total // (L * H * rings.bytes_per_head_token)
    sink = min(DEFAULT_SINK, ring // 4)
    out = HeadLayout.window(layout.shape, sink=sink, window=max(1, ring - sink), model=layout.model)
    out.name = "window-same-KV"
    return out


def run_eval(model, layout_specs, task_names, lengths, seeds, baselines, json_path, plot_dir,
             rebased: bool = False, engine_options: dict | None = None, kv_dtypes: tuple[str, ...] = (),
             transformers: bool = False):
    """The reference is the model's own function: `full`, or `native` for a model with
    sliding-window layers (Gemma 3), where `full` is refused.
    rebased: also run every layout with window heads under StreamingLLM-style re-based
    rotary positions (named "<layout>+rebased"), to measure that choice.
    kv_dtypes: also run every layout with each of these KV cache dtypes (named
    "<layout>+<dtype>"); agreement stays measured against the reference in the options' dtype.
    engine_options: keyword arguments of every LLM built (default EVAL_ENGINE_OPTIONS).
    transformers: add a `transformers` row, HF transformers on the same weights, for the
    retrieval tasks (REFERENCE_TASKS)."""
    specs = list(layout_specs or [])
    opts = dict(EVAL_ENGINE_OPTIONS if engine_options is None else engine_options)
    native = native_layout(read_model_config(model))
    ref_name = "native" if native else "full"
    if baselines and native:
        raise ValueError("--baselines builds layouts over every head; this model's sliding-window "
                         "layers must stay native, so compare calibrated layouts instead")
    ref = LLM(model, head_layout=ref_name, **opts)
    shape, model_name = ref.layout.shape, ref.engine.model_name
    if not specs:
        shipped = shipped_layout(model_name, shape)
        specs = [ref_name] + ([shipped] if shipped is not None else [])
    if ref_name not in specs:
        specs = [ref_name] + specs
    plan: list[tuple[str, HeadLayout, list[int], dict]] = []
    split = None
    for spec in specs:
        lay = resolve_layout(spec, shape, model_name, native=native)
        plan.append((_name(spec, lay), lay, lengths, {}))
        for dt in kv_dtypes:
            plan.append((f"{_name(spec, lay)}+{dt}", lay, lengths, {"kv_cache_dtype": dt}))
        if rebased and lay.full_fraction < 1:
            plan.append((_name(spec, lay) + "+rebased", lay, lengths, {"window_positions": "rebased"}))
        if split is None and 0 < lay.full_fraction < 1:
            split = lay
    if baselines and split is not None:
        plan.append((f"random-{split.full_fraction:.0%}",
                     HeadLayout.random(shape, split.full_fraction, seed=0), lengths, {}))
        for L in lengths:
            plan.append(("window-same-KV", equal_bytes_window(split, L, ref.engine.dtype), [L], {}))
    if transformers:
        plan.append(("transformers", None, lengths, {}))
    ref_tasks = [t for t in task_names if t in REFERENCE_TASKS]

    def prompts(names) -> int:  # prompts per length for these tasks
        return (5 * sum(t in names for t in ("passkey", "niah")) * seeds
                + (3 * max(3, seeds) if "ruler" in names else 0)
                + ("ppl" in names) + ("agreement" in names))

    bar = tqdm(total=sum(prompts(ref_tasks if n == "transformers" else task_names) * len(ls)
                         for n, _, ls, _ in plan), desc="evaluating", unit="prompt")
    records, full_outputs = [], None
    for name, lay, ls, extra in plan:
        if name == "transformers":
            llm, names = TransformersReference(model, ref.engine.dtype), ref_tasks
        else:
            llm = ref if name == ref_name else LLM(model, **{**opts, "head_layout": lay, **extra})
            names = task_names
        recs, outs = runner.evaluate_layout(llm, name, names, ls, seeds,
                                            None if name == ref_name else full_outputs, bar)
        if name == ref_name:
            full_outputs = outs
            if "agreement" in task_names:
                recs += [runner.Record(ref_name, "agreement", L, 1.0, 2) for L in ls]
        records += recs
        if llm is not ref:
            del llm
    bar.close()
    names = list(dict.fromkeys(n for n, _, _, _ in plan))
    text = runner.table(records, names, lengths)
    if json_path:
        runner.write_json(records, json_path)
    if plot_dir:
        runner.heatmaps(records, plot_dir)
    return records, text


def run_quality(model, layout_specs, families, lengths, seeds: int = quality.SEEDS, json_path=None,
                engine_options: dict | None = None, previous: list[quality.SuiteRecord] | None = None,
                reference: bool = True):
    """The quality suite (evaluation.quality) for the reference and each layout; records
    of `previous` runs (--report) join the table, and a prompt (or a perplexity) they
    already hold is not run again, so runs over different lengths, families or numbers of
    seeds merge. Records are written to `json_path` after every prompt, so a run stopped
    part-way resumes when its own file is given back as `previous`. reference=False runs only the
    layouts given (their records merge with the reference's later, through --report).
    The layouts take turns family by family, each with its own engine, all kept alive for
    the run (memory: one engine per layout). Returns (records, markdown; None without the reference's records)."""
    opts = dict(EVAL_ENGINE_OPTIONS if engine_options is None else engine_options)
    cfg = read_model_config(model)
    native = native_layout(cfg)
    # A compute dtype asked for by name tags the records ("full@float32"): they are not
    # those of the engine's own dtype, so they neither stand in for them as done nor
    # merge with them; the report sets them side by side (rounding's own effect).
    tag = "" if opts.get("dtype", "auto") == "auto" else f"@{opts['dtype']}"
    ref_spec = "native" if native else "full"
    ref_name = ref_spec + tag
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    records = list(previous or [])
    # What the records hold: prompts by (layout, family, length, depth, seed), perplexity
    # by (layout, length).
    held = {(r.layout, r.family, r.length, r.depth, r.seed) for r in records if r.depth is not None}
    ppl_done = {(r.layout, r.length) for r in records if r.family.startswith("ppl:")}
    if layout_specs is None:
        shipped = shipped_layout(cfg.name, shape)
        layout_specs = [] if shipped is None else [shipped]
    todo = []
    # Without `reference`, a --head-layout naming the reference still runs: the user asked for it.
    run = ([ref_spec] if reference else []) + [s for s in layout_specs if not (reference and s == ref_spec)]
    for spec in run:
        lay = resolve_layout(spec, shape, cfg.name, native=native)
        name = _name(spec, lay) + tag
        wanted = quality.prompts(families, lengths, seeds)  # (family, length, depth, seed), by length then family
        skip = {p for p in wanted if (name, *p) in held}
        missing = [p for p in wanted if p not in skip]
        work = list(dict.fromkeys((L, f) for f, L, _, _ in missing))
        work += [(L, "ppl") for L in lengths if (name, L) not in ppl_done]
        if work:
            todo.append((name, lay, work, skip, len(missing)))
    bar = tqdm(total=sum(t[-1] for t in todo), desc="quality suite", unit="prompt")

    def keep(record: quality.SuiteRecord) -> None:  # saved after every prompt: a stopped run resumes (--report)
        records.append(record)
        if json_path:
            quality.save(records, json_path)

    # Family by family, every layout in turn (each engine made once and kept): a run
    # stopped part-way leaves every layout's answers to the same prompts (`make quality`
    # runs the reference and the shipped layout in one process).
    rank = {f: i for i, f in enumerate(quality.FAMILIES)}
    order = sorted({w for t in todo for w in t[2]}, key=lambda w: (w[0], rank.get(w[1], len(rank))))
    engines = {}
    for L, fam in order:
        for name, lay, work, skip, _ in todo:
            if (L, fam) not in work:
                continue
            if name not in engines:
                engines[name] = LLM(model, **{**opts, "head_layout": lay})
            quality.run_suite(engines[name], name, [] if fam == "ppl" else [fam], [L], seeds,
                              ppl=fam == "ppl", progress=bar, skip=skip, on_record=keep)
    engines.clear()
    bar.close()
    if ref_name not in quality.layouts_of(records):
        return records, None
    return records, quality.report(records, ref_name)
