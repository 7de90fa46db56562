"""The `select` class: heads that keep every token in the paged pool, as full heads do,
but whose decode attends only the pages its query needs (Quest's query-aware page
selection), within a budget of `budget` tokens that always includes the first `sink`
tokens and the last `window`. Prefill is exact (the full class's).

Each block keeps, per select head, the per-channel minimum and maximum of its keys
(HeadGroup.summary [num_blocks, n, 2, D]), recomputed whenever the block is written.
At each decode step a page's score is the Quest bound, an upper bound on q.k over the
page's keys: sum_d max(q_d * min_d, q_d * max_d), the largest over the group's query
heads; the top pages are attended exactly. Re-selected at every step: the bound reads
2 * D values per page against the 2 * block_size * D of its K and V. A sequence's pages
depend on its own length and query only, never on what it is batched with.

Generated tokens' K/V are what decode computed with page selection. When a sequence is
recomputed from its tokens (after preemption), the rows of its generated tokens are
attended as its decode steps attended them, each a one-token sequence of its own length
over the same pages and summaries, so that recomputing changes nothing.

With the pages in host memory (EngineConfig.select_host_pages; engine.hot_pages) the
group's k and v are its home pool there: writes and summaries read it, decode attends the
chosen pages through the group's hot set on the device, and a later prefill chunk attends
a device copy of the sequence's earlier K/V.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from headwise.heads.base import LayoutError, register
from headwise.heads.full import FullHeads, write_slots
from headwise.kernels import page_select
from headwise.kernels.cpu_kernels import usable
from headwise.layers.kv_tensor import KVTensor, dequantize
from headwise.layers.torch_attention import pool_call


class SelectHeads(FullHeads):
    name = "select"
    params = ("sink", "window", "budget")
    fused_decode = False  # per-head page tables: attended by `attend` within the layer's fused step
    page_summary = True

    def __init__(self) -> None:
        self._step = None  # (the step's context, what every select group of it shares)

    def check(self, spec) -> None:
        for p, low in (("sink", 0), ("window", 1), ("budget", 1)):
            v = getattr(spec, p)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise LayoutError(f"{p} must be an integer >= {low}, got {v!r}")
        if spec.budget < spec.sink + spec.window:
            raise LayoutError(f"budget ({spec.budget}) must cover sink + window ({spec.sink + spec.window})")

    def describe(self, spec) -> str:
        return f"select (budget {spec.budget}, sink {spec.sink}, window {spec.window})"

    def _shared(self, ctx) -> dict:
        """Per step, computed once for all layers: the blocks the step writes, the decode
        lengths on the host, per (sink, window, budget) the page count K (None: every
        sequence fits), and with pages in host memory the step's slots and blocks there."""
        step = self._step
        if step is None or step[0] is not ctx:
            if ctx.num_decode and not ctx.prefills:  # one new token per sequence: distinct blocks
                blocks = ctx.full_slots // ctx.block_size
            else:
                blocks = torch.unique(ctx.full_slots // ctx.block_size)
            step = self._step = (ctx, {"blocks": blocks, "lens": ctx.decode_lens.tolist() if ctx.num_decode else []})
        return step[1]

    def attend(self, layer, group, ctx, q, kst, vst, out) -> None:
        super().attend(layer, group, ctx, q, kst, vst, out)
        for ch in ctx.prefills:  # rows of generated tokens, recomputed: as decode attended them
            if ch.generated_from is None or ch.generated_from >= ch.start + ch.length:
                continue
            first = max(ch.start, ch.generated_from)
            rows = slice(ch.offset + first - ch.start, ch.offset + ch.length)
            lens = torch.arange(first + 1, ch.start + ch.length + 1)  # [R] tokens each row's step saw
            table = _chunk_blocks(ctx, ch, layer.backend.PAGED)  # [P] int32
            K = page_count(lens.tolist(), table.shape[0], ctx.block_size, group.sink, group.window, group.budget)
            if K is None:  # every row attended all its pages: exact attention, as computed
                continue
            tables = table[None].expand(len(lens), -1).contiguous()  # [R, P]: one sequence per row
            picked = select_pages(q[rows], group.summary, tables, lens, ctx.block_size, group.sink,
                                  group.window, group.budget, K)
            out[rows] = attend_chosen(layer, group, q[rows], picked, ctx.block_size)

    def write(self, group, ctx, kst, vst) -> None:
        shared = self._shared(ctx)
        if group.hot is None:
            super().write(group, ctx, kst, vst)
            refresh_summaries(group, shared["blocks"], ctx.block_size)
            return
        # In host memory: the step's slots and blocks moved there once per step, for every
        # layer (each move from the device waits for it)
        if "host" not in shared:
            shared["host"] = (ctx.full_slots.to("cpu"), shared["blocks"].to("cpu", torch.int64))
        slots, blocks = shared["host"]
        write_slots(group, slots, kst, vst)
        refresh_summaries(group, shared["blocks"], ctx.block_size, home_blocks=blocks)
        group.hot.invalidate(blocks)

    def prefill_source(self, group, ch, device):
        """In host memory, the chunk attends a device copy of its sequence's K/V
        [n, start + length, D] (a first chunk reads only its own rows: nothing to copy)."""
        if group.hot is None or ch.pages is None:
            return super().prefill_source(group, ch, device)
        at = (slice(None), ch.pages.to(group.k.data.device))
        k, v = (KVTensor(c.data[at].to(device), None if c.scale is None else c.scale[at].to(device), c.dtype)
                for c in (group.k, group.v))
        return k, v, dataclasses.replace(ch, pages=torch.arange(ch.pages.numel(), device=device))

    def decode(self, layer, group, ctx, q) -> torch.Tensor:
        shared = self._shared(ctx)
        key = (group.sink, group.window, group.budget)
        if key not in shared:
            shared[key] = page_count(shared["lens"], ctx.decode.block_tables.shape[1], ctx.block_size, *key)
        K = shared[key]
        # block tables [B, W] int32: StepMetadata builds them when a layout has select heads
        tables = ctx.decode.block_tables
        if K is None:  # every page fits the budget: exactly the full class's decode
            if group.hot is None:
                return super().decode(layer, group, ctx, q)
            n = group.num_heads  # in host memory: every page chosen, through the hot set
            lens = ctx.decode_lens.to(torch.int32)[None].expand(n, -1).contiguous()  # [n, B]
            picked = (tables[None].expand(n, -1, -1), lens)
        else:
            picked = select_pages(q, group.summary, tables, ctx.decode_lens, ctx.block_size,
                                  group.sink, group.window, group.budget, K)
        return attend_chosen(layer, group, q, picked, ctx.block_size)


def attend_chosen(layer, group, q: torch.Tensor, picked, block_size: int) -> torch.Tensor:
    """Attention of q [R, n*g, D] over the pages `picked` names ((tables [n, R, K], lens
    [n, R]), select_pages), from the pool, or through the hot set when the group's pages
    wait in host memory; rows are split where one call's pages would overflow it."""
    impl = _IMPLS[layer.backend.NAME]
    if group.hot is None:
        return impl(q, group, picked, block_size, layer.scale)
    tables, lens = picked
    hot_tables = group.hot.chosen(tables, lens)
    if hot_tables is None:
        R = q.shape[0]
        if R == 1:
            raise RuntimeError("a select head's chosen pages do not fit its hot set (select_hot_pages)")
        h = R // 2
        return torch.cat([attend_chosen(layer, group, q[a:b], (tables[:, a:b], lens[:, a:b]), block_size)
                          for a, b in ((0, h), (h, R))])
    hot_group = group.state.get("hot_group")
    if hot_group is None:  # the same heads over the hot set's pages
        hot_group = group.state["hot_group"] = dataclasses.replace(group, k=group.hot.k, v=group.hot.v, kv=None,
                                                                   hot=None, state={})
    return impl(q, hot_group, (hot_tables, lens.to(torch.int32)), block_size, layer.scale)


def _chunk_blocks(ctx, ch, paged_backend: bool) -> torch.Tensor:
    """[P] int32 blocks of a prefill chunk's sequence, positions [0, start + length): the
    chunk's block table (backends that read pages in place), else from its slots."""
    bs = ctx.block_size
    if paged_backend:
        return ch.pages[:-(-(ch.start + ch.length) // bs)].to(torch.int32)
    slots = ctx.full_slots[ch.rows] if ch.start == 0 else ch.pages  # [start + length]
    return (slots[::bs] // bs).to(torch.int32)


def refresh_summaries(group, blocks: torch.Tensor, block_size: int, use_kernel: bool = True,
                      home_blocks: torch.Tensor | None = None) -> None:
    """Recompute the key summaries of `blocks` [m] from all block_size keys each holds
    (`home_blocks`: the same blocks on the keys' device, where that is host memory).
    Rows past a partial block's fill hold stale keys: the bound they give is looser,
    never lower (and a sequence's last page is always attended anyway). On the CPU the C
    kernel (kernels/cpu_select.c) does it in one call for plainly stored keys."""
    if group.k.scale is None and use_kernel and page_select.refresh_summaries(group.k.data, blocks, block_size,
                                                                             group.summary):
        return
    n, D = group.k.shape[0], group.k.shape[-1]
    at = blocks if home_blocks is None else home_blocks
    k = group.k.data.view(n, -1, block_size, D)[:, at]  # [n, m, bs, D]
    if group.k.scale is not None:
        k = dequantize(k, group.k.scale.view(n, -1, block_size)[:, at], torch.float32)
    s = torch.stack((k.amin(2), k.amax(2)), 2).transpose(0, 1)
    group.summary[blocks] = s.to(group.summary.device, group.summary.dtype)


def page_bounds(q: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """Quest bound of each page: q [B, n, g, D]; summary [B, W, n, 2, D] (min, max of
    each page's keys) -> [B, n, W], max over the g query heads of sum_d max(q_d * min_d,
    q_d * max_d), in float32 (float64 in, float64 out)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(dt)
    lo, hi = summary[..., 0, :].to(dt), summary[..., 1, :].to(dt)  # [B, W, n, D]
    # max(q * lo, q * hi) = relu(q) * hi + min(q, 0) * lo, summed over d
    s = (torch.einsum("bngd,bwnd->bngw", qf.clamp(min=0), hi)
         + torch.einsum("bngd,bwnd->bngw", qf.clamp(max=0), lo))
    return s.amax(2)


def forced_pages(n: int, block_size: int, sink: int, window: int) -> int:
    """Pages of a sequence of n tokens touching [0, sink) or its last `window` tokens."""
    P = -(-n // block_size)
    sink_end = min(P, -(-sink // block_size))
    win_start = max(0, n - window) // block_size
    return sink_end + (P - win_start) - max(0, sink_end - win_start)


def page_count(lens: list[int], width: int, block_size: int, sink: int, window: int, budget: int) -> int | None:
    """K, the width of a step's chosen-page tables: the most pages a sequence attends,
    max(budget // block_size, its sink and window pages), at most the table's width; None
    when every sequence has at most its own count of pages (then each attends all)."""
    own = [max(budget // block_size, forced_pages(n, block_size, sink, window)) for n in lens]
    if all(-(-n // block_size) <= k for n, k in zip(lens, own)):
        return None
    return min(width, max(own))


def select_pages(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 block_size: int, sink: int, window: int, budget: int, K: int, use_kernel: bool = True):
    """The pages each head of a select group attends at this decode step: per sequence
    max(budget // block_size, its forced pages), in tables of width K (page_count).

    q [B, n*g, D]; summary [num_blocks, n, 2, D]; tables [B, W] int32 block tables; lens
    [B] tokens including the new one. Returns (tables [n, B, K] int32, lens [n, B]
    int32): per head and sequence its chosen blocks in position order (the last, partial
    page last) and the number of tokens they hold. Pages touching [0, sink) or the last
    `window` tokens are always chosen; the rest by their Quest bound. On the CPU the C
    kernel (kernels/cpu_select.c) does it in one call."""
    B, W = tables.shape
    if use_kernel:
        picked = page_select.select_pages(q, summary, tables, lens, block_size, sink, window,
                                          budget // block_size, K)
        if picked is not None:
            return picked
    n = summary.shape[1]
    lens = lens.to(torch.int64)
    pages = (lens + block_size - 1) // block_size                       # [B]
    p = torch.arange(W, device=q.device)
    forced = (p[None] * block_size < sink) | ((p[None] + 1) * block_size > (lens - window)[:, None])
    valid = p[None] < pages[:, None]                                    # [B, W]
    forced &= valid
    own = forced.sum(1).clamp(min=budget // block_size)                 # [B] pages each attends
    s = page_bounds(q.view(B, n, -1, q.shape[-1]), summary[tables.long()])  # [B, n, W]
    s = s.masked_fill(forced[:, None], float("inf")).masked_fill(~valid[:, None], float("-inf"))
    top, idx = s.topk(K, dim=-1)                                        # [B, n, K]
    chosen = (top > float("-inf")) & (torch.arange(K, device=q.device) < own[:, None, None])
    idx, _ = idx.masked_fill(~chosen, W).sort(-1)                       # position order, unused last
    blocks = tables.long().gather(1, idx.clamp(max=W - 1).flatten(1)).view(B, n, K)
    count = chosen.sum(-1)                                              # [B, n]
    tail = lens - (pages - 1) * block_size                              # tokens in the last page
    sel_lens = (count - 1) * block_size + tail[:, None]
    return _packed(blocks.transpose(0, 1)), _packed(sel_lens.transpose(0, 1))


def _packed(x: torch.Tensor) -> torch.Tensor:
    """x as a new int32 tensor with row-major strides (`contiguous()` keeps the odd
    stride of a size-1 dim, and the C kernel needs unit inner strides)."""
    return torch.empty(x.shape, dtype=torch.int32, device=x.device).copy_(x)


# ---- attention over the chosen pages, per backend --------------------------------------
def torch_decode(q, group, picked, block_size: int, scale: float) -> torch.Tensor:
    # q [B, n*g, D]; each head h attends the pages tables[h] [B, K] holds, lens[h] [B] tokens.
    tables, lens = picked
    n = group.num_heads
    B, H, D = q.shape
    out = torch.empty_like(q)
    if usable(q, group.k):  # the C kernel, one call per head with its own page table
        calls = group.state.get("calls")
        if calls is None:
            calls = group.state["calls"] = [pool_call(group.k[h:h + 1], group.v[h:h + 1], block_size, H // n, head=h)
                                            for h in range(n)]
        for h, call in enumerate(calls):
            call(q, out, tables[h], lens[h], scale)
        return out
    K = tables.shape[-1]
    slots = (tables.long()[..., None] * block_size + torch.arange(block_size)).view(n, B, K * block_size)
    heads = torch.arange(n)[:, None, None]
    k = _load(group.k, heads, slots).transpose(0, 1)  # [B, n, K*bs, D]
    v = _load(group.v, heads, slots).transpose(0, 1)
    mask = (torch.arange(K * block_size)[None, None] < lens.T[..., None].long())[:, :, None]  # [B, n, 1, K*bs]
    o = F.scaled_dot_product_attention(q.view(B, n, H // n, D).to(k.dtype), k, v, attn_mask=mask, scale=scale)
    return o.reshape(B, H, D).to(q.dtype)


def _load(cache: KVTensor, heads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, B, L, D] values of each head's own slots [n, B, L], in the compute dtype (float32
    for a quantized pool)."""
    if cache.scale is None:
        return cache.data[heads, slots].to(cache.dtype)
    return dequantize(cache.data[heads, slots], cache.scale[heads, slots], torch.float32)


def triton_decode(q, group, picked, block_size: int, scale: float) -> torch.Tensor:
    from headwise.kernels import triton_attention as K

    tables, lens = picked
    n, g = group.num_heads, q.shape[1] // group.num_heads
    out = torch.empty_like(q)
    ks, vs = group.k.scale, group.v.scale
    for h in range(n):
        out[:, h * g:(h + 1) * g] = K.paged_decode(
            q[:, h * g:(h + 1) * g].contiguous(), group.k.data[h:h + 1], group.v.data[h:h + 1], tables[h],
            lens[h], block_size, scale, k_scale=None if ks is None else ks[h:h + 1],
            v_scale=None if vs is None else vs[h:h + 1])
    return out


_IMPLS = {"torch": torch_decode, "triton": triton_decode}
SELECT = register(SelectHeads())
