"""Which full heads can become `select` heads (heads/select.py): a training-free profile,
after RedKnot's rule that a retrieval head is one whose attention mass sits in few tokens.

Calibration prompts (calibration.samples, held out from the quality suite) run through
the engine with a two-class layout in place. At every answer position, for every full
head, the pages a select head would attend are chosen exactly as heads.select chooses
them (sink and window pages, then the highest Quest bounds within the budget), and the
head's full-attention probability mass on those pages is its recall. Heads whose mean
recall reaches a threshold (0.9 by default: the pages hold 90% of the mass) become select
heads; the others stay full. Window heads stay as they are.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from headwise.calibration.samples import KINDS, make_samples
from headwise.heads.layout import HeadLayout, HeadSpec
from headwise.heads.select import page_count, select_pages
from headwise.llm import LLM

DEFAULT_RECALL = 0.9
# Profile prompts must be several times the budget, or every page fits and recall is 1.
DEFAULT_LENGTHS = (4096, 6144)


class _RecallProbe:
    """Per-layer observer: the attention mass each KV head's chosen pages hold at the
    sample's answer positions, summed over samples."""

    def __init__(self, order: list[int], group: int, scale: float, block_size: int,
                 sink: int, window: int, budget: int) -> None:
        self.order, self.group, self.scale = order, group, scale
        self.bs, self.sink, self.window, self.budget = block_size, sink, window, budget
        self.rows: list[int] = []
        self.recall = torch.zeros(len(order))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # q: [T, Hq, D]; k: [T, Hkv, D] in storage order
        T, Hq, D = q.shape
        n, g, bs = k.shape[1], self.group, self.bs
        rows = torch.tensor(self.rows)
        R = len(rows)
        qq = q[rows].float().view(R, n, g, D)
        kk = k.float()
        s = torch.einsum("rngd,tnd->rngt", qq, kk) * self.scale
        j = torch.arange(T)
        s = s.masked_fill(j[None, None, None] > rows[:, None, None, None], float("-inf"))
        p = torch.softmax(s, -1)                                          # [R, n, g, T]
        P = -(-T // bs)
        pad = torch.cat((kk, kk[-1:].expand(P * bs - T, n, D)))          # last page padded with its last key
        pages = pad.view(P, bs, n, D)
        summary = torch.stack((pages.amin(1), pages.amax(1)), 2)          # [P, n, 2, D]
        # The pages decode would choose, each answer row a sequence of rows + 1 tokens
        # whose block table is pages 0..P-1 (heads.select, its PyTorch path).
        lens = rows + 1
        tables = torch.arange(P, dtype=torch.int32)[None].expand(R, P).contiguous()
        K = page_count(lens.tolist(), P, bs, self.sink, self.window, self.budget)
        if K is None:  # every page fits the budget
            chosen = torch.ones(R, n, P, dtype=torch.bool)
        else:
            picked, counts = select_pages(q[rows].float(), summary, tables, lens, bs, self.sink, self.window,
                                          self.budget, K, use_kernel=False)  # [n, R, K] pages, [n, R] tokens
            used = torch.arange(K)[None, None] < (-(-counts.long() // bs))[..., None]  # [n, R, K]
            # max, not overwrite: an unused entry may repeat a chosen page
            chosen = torch.zeros(R, n, P, dtype=torch.int8).scatter_reduce_(
                2, picked.long().transpose(0, 1), used.transpose(0, 1).to(torch.int8), "amax").bool()
        tokens = chosen.repeat_interleave(bs, dim=2)[..., :T]             # [R, n, T]
        recall = (p * tokens[:, :, None]).sum(-1).mean((0, 2))           # [n]
        for pos, head in enumerate(self.order):
            self.recall[head] += recall[pos]


def recall_profile(llm: LLM, samples, sink: int, window: int, budget: int, progress: bool = True) -> torch.Tensor:
    """[L, H] mean recall of every KV head (original head order) over the samples."""
    eng = llm.engine
    cfg = eng.model_config
    layers = eng.model.attention_layers()
    probes = [_RecallProbe(eng.layout.head_order(l), cfg.group_size, attn.scale, eng.cache.block_size,
                           sink, window, budget) for l, attn in enumerate(layers)]
    for attn, p in zip(layers, probes):
        attn.observer = p
    try:
        for s in tqdm(samples, desc="select profile", unit="prompt", disable=not progress):
            for p in probes:
                p.rows = s.query_rows
            eng.prompt_logits(s.ids, chunk_size=len(s.ids), positions=[])
    finally:
        for attn in layers:
            attn.observer = None
    return torch.stack([p.recall for p in probes]) / len(samples)


def check_select(budget: int, sink: int, window: int, recall: float, lengths: tuple[int, ...]) -> HeadSpec:
    """The select heads' spec, or ValueError (LayoutError) for parameters the profile
    cannot use; checked before any model runs."""
    spec = HeadSpec("select", sink, window, budget)  # checks the parameters
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall must be in (0, 1], got {recall}")
    if max(lengths) <= budget:
        raise ValueError(f"profile prompts of {max(lengths)} tokens fit the budget of {budget}; "
                         "give longer prompt lengths")
    return spec


def select_layout(model: str | None, source: HeadLayout, budget: int, sink: int, window: int,
                  recall: float = DEFAULT_RECALL, num_samples: int = 12,
                  lengths: tuple[int, ...] = DEFAULT_LENGTHS, seed: int = 0, progress: bool = True,
                  engine_options: dict | None = None,
                  kinds: tuple[str, ...] = KINDS) -> tuple[HeadLayout, torch.Tensor]:
    """`source` with each full head whose recall reaches `recall` made a select head
    (sink, window, budget), profiled on prompts of `kinds` (calibration.samples);
    returns the layout and the [L, H] recall of every head."""
    spec = check_select(budget, sink, window, recall, lengths)
    opts = dict(engine_options or {})
    opts["max_num_batched_tokens"] = max(opts.get("max_num_batched_tokens", 0), max(lengths) + 64)
    llm = LLM(model, head_layout=source, **opts)
    samples = make_samples(llm.tokenizer, num_samples, lengths, seed, kinds)
    scores = recall_profile(llm, samples, sink, window, budget, progress)
    heads = [[spec if s.kind == "full" and scores[l, h] >= recall else s for h, s in enumerate(row)]
             for l, row in enumerate(source.heads)]
    name = f"{source.name}-select{budget}"
    return HeadLayout(name, *source.shape, heads, model=source.model, scores=source.scores,
                      kv_dtype=source.kv_dtype), scores
