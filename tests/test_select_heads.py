"""The `select` head class (heads/select.py): every token kept, decode attends the pages
whose Quest bound is highest within a budget. Checked against full attention (a budget
that covers the context) and against a dense reference that masks exactly the pages the
bound chooses, recomputed here from the keys, not from the engine's summaries."""
from types import SimpleNamespace

import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.cache.manager import KVCacheManager
from headwise.heads import select
from headwise.heads.layout import HeadSpec, LayoutError
from headwise.kernels import cpu_kernels, page_select
from headwise.layers.kv_tensor import KVTensor

BS = 16  # block size (the engine's default)


def layout_with(shape, spec: HeadSpec, other: HeadSpec) -> HeadLayout:
    L, H, D = shape
    return HeadLayout("sel", L, H, D, [[spec if (l + h) % 2 == 0 else other for h in range(H)] for l in range(L)])


def test_bound_is_never_below_a_page_true_max():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        B, W, n, G, D = 2, 5, 2, 3, 8
        keys = torch.randn(B, W, n, BS, D, generator=g, dtype=torch.float64) * (1 + trial % 4)
        q = torch.randn(B, n, G, D, generator=g, dtype=torch.float64) * 3
        summary = torch.stack((keys.amin(3), keys.amax(3)), 3)  # [B, W, n, 2, D]
        bound = select.page_bounds(q, summary)  # [B, n, W]
        true = (q[:, None, :, :, None, :] * keys[:, :, :, None]).sum(-1)  # [B, W, n, G, BS]
        true = true.amax(-1).amax(-1).permute(0, 2, 1)  # [B, n, W]
        assert (bound >= true - 1e-9).all()
        # and it is attained when a page holds one key (min = max)
        one = torch.stack((keys[:, :, :, 0], keys[:, :, :, 0]), 3)
        exact = (q[:, None] * keys[:, :, :, None, 0]).sum(-1).amax(-1).permute(0, 2, 1)
        assert torch.allclose(select.page_bounds(q, one), exact)


def test_layout_parameters_are_checked_and_saved(tmp_path):
    spec = HeadSpec("select", 16, 64, 256)
    assert str(spec) == "select (budget 256, sink 16, window 64)"
    lay = layout_with((2, 2, 16), spec, HeadSpec("full"))
    lay.save(tmp_path / "l.json")
    assert HeadLayout.load(tmp_path / "l.json").heads == lay.heads
    with pytest.raises(LayoutError, match="budget .* must cover sink \\+ window"):
        HeadSpec("select", 64, 256, 128)
    with pytest.raises(LayoutError, match="budget must be an integer"):
        HeadSpec("select", 4, 8, "many")


def reference_logits(llm: LLM, ids: list[int], decode_from: int) -> torch.Tensor:
    """Dense forward, logits [T, V]. Rows before decode_from are prefill (every head
    causal); from there on, a select head's query attends only the pages its bound picks:
    pages touching [0, sink) or the last `window` tokens, then the highest bounds, with
    budget // BS pages in all. Bounds from the keys themselves (min, max per channel of
    each page's keys), the largest over the KV head's query heads."""
    model, layout = llm.engine.model, llm.engine.layout
    cfg = model.config
    T = len(ids)
    pos = torch.arange(T)
    x = model.model.embed_tokens(torch.tensor(ids))
    for l, layer in enumerate(model.model.layers):
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_proj(h).view(T, cfg.num_heads, cfg.head_dim)
        k = att.k_proj(h).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = att.v_proj(h).view(T, cfg.num_kv_heads, cfg.head_dim)
        q, k = model.model.rotary(pos, q, k)
        order = layout.head_order(l)
        G = cfg.group_size
        outs = torch.empty(T, cfg.num_heads, cfg.head_dim)
        for kh in range(cfg.num_kv_heads):
            spec = layout.heads[l][order[kh]]
            mask = pos[None] <= pos[:, None]  # [T, T]
            if spec.kind == "window":
                mask &= (pos[None] < spec.sink) | (pos[None] > pos[:, None] - spec.window)
            if spec.kind == "select":
                for i in range(decode_from, T):
                    n = i + 1
                    P = -(-n // BS)
                    bounds = []
                    for p in range(P):
                        kp = k[p * BS: min(n, (p + 1) * BS), kh]  # the page's keys
                        lo, hi = kp.amin(0), kp.amax(0)
                        qq = q[i, kh * G:(kh + 1) * G]  # [G, D]
                        bounds.append(torch.maximum(qq * lo, qq * hi).sum(-1).max().item())
                    forced = {p for p in range(P) if p * BS < spec.sink or (p + 1) * BS > n - spec.window}
                    K = max(spec.budget // BS, len(forced))
                    rest = sorted(set(range(P)) - forced, key=lambda p: -bounds[p])
                    keep = forced | set(rest[:max(0, K - len(forced))])
                    row = torch.zeros(T, dtype=torch.bool)
                    for p in keep:
                        row[p * BS: min(n, (p + 1) * BS)] = True
                    mask[i] = row
            for qh in range(kh * G, (kh + 1) * G):
                s = (q[:, qh] @ k[:, kh].T) / cfg.head_dim ** 0.5
                outs[:, qh] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, kh]
        x = x + att.o_proj(outs.reshape(T, -1))  # heads in storage order, as the weights are
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x)).float()


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


def prompt(llm, n=150):
    ids = llm.tokenizer.encode("Rivers, towns and bridges; a ledger of ferries and tolls. " * 20)
    return ids[:n]


def test_a_budget_covering_the_context_equals_full(llama):
    full = LLM(llama, head_layout="full", kv_cache_memory=1 << 24, dtype="float32")
    ids = prompt(full)
    spec = HeadSpec("select", 4, 8, 1024)  # 1024 tokens: every page of these sequences
    sel = LLM(llama, head_layout=layout_with(full.layout.shape, spec, HeadSpec("full")),
              kv_cache_memory=1 << 24, dtype="float32")
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0)
    a, b = full.generate([ids, ids[:77]], params), sel.generate([ids, ids[:77]], params)
    for x, y in zip(a, b):  # token for token; logprobs to float32 rounding (heads are grouped
        # differently: two groups of one head each against one of two)
        assert x.token_ids == y.token_ids
        assert max(abs(u - w) for u, w in zip(x.logprobs, y.logprobs)) < 1e-5


def test_choosing_every_page_equals_the_full_decode(llama):
    """The attention over chosen pages (per-head tables) against the full class's, with
    every page chosen explicitly (no shortcut)."""
    sel = LLM(llama, head_layout=layout_with((2, 2, 16), HeadSpec("select", 4, 8, 1024), HeadSpec("full")),
              kv_cache_memory=1 << 24, dtype="float32")
    grp = next(g for g in sel.engine.runner.kv.layer_views(0) if g.head_class is select.SELECT)
    B, n, G, D = 3, grp.num_heads, 2, 16
    lens = torch.tensor([40, 17, 64])
    tables = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]], dtype=torch.int32)
    grp.k.data.normal_(), grp.v.data.normal_()
    q = torch.randn(B, n * G, D)
    from headwise.layers.context import StepContext
    from headwise.layers.torch_attention import TorchDecode
    from headwise.heads.full import torch_decode as full_decode
    ctx = StepContext(positions=lens - 1, full_slots=lens - 1, num_decode=B, decode_lens=lens,
                      decode=TorchDecode(block_tables=tables, runs=[
                          [(int(row[p]) * BS, min(BS, int(m) - p * BS)) for p in range(-(-int(m) // BS))]
                          for row, m in zip(tables, lens)]))
    pages = -(-lens // BS)
    picked = (tables[None].expand(n, B, 4).contiguous(),
              lens[None].expand(n, B).to(torch.int32).contiguous())
    for impl in ("kernel", "torch"):
        if impl == "torch":  # the PyTorch path: a float64 q is one the C kernel does not take
            q64 = q.double()
            got = select.torch_decode(q64, grp, picked, BS, 0.25).float()
        else:
            got = select.torch_decode(q, grp, picked, BS, 0.25)
        want = full_decode(q, grp.k, grp.v, ctx, 0.25)
        assert torch.allclose(got, want, atol=1e-5), impl
    assert pages.tolist() == [3, 2, 4]


@pytest.mark.parametrize("other,path,budget", [("full", "kernel", 64), ("window", "kernel", 64),
                                               ("full", "torch", 64), ("full", "triton", 64),
                                               ("full", "kernel", 24), ("full", "torch", 24)])
def test_small_budget_equals_a_dense_reference_masking_the_chosen_pages(llama, other, path, budget, monkeypatch):
    """Budget 64: 4 pages of 16, the sink page, 2-3 window pages, the rest chosen. Budget
    24 (= sink + window, 1 page): the sink and window pages alone are 3 or 4, so each
    sequence attends exactly those, whatever the other sequence of its batch needs."""
    opts = {}
    if path == "torch":  # the PyTorch gather path, where the C kernel is not taken
        monkeypatch.setattr(select, "usable", lambda q, k: False)
    if path == "triton":  # the Triton backend (its interpreter on a machine without a GPU)
        pytest.importorskip("triton")
        opts = dict(attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    probe = LLM(llama, head_layout="full", kv_cache_memory=1 << 24)
    spec = HeadSpec("select", 4, 20, budget)
    second = HeadSpec("full") if other == "full" else HeadSpec("window", 4, 32)
    layout = layout_with(probe.layout.shape, spec, second)
    llm = LLM(llama, head_layout=layout, kv_cache_memory=1 << 24, dtype="float32", **opts)
    ids = prompt(llm, 150)  # 10 pages: the budget leaves most out
    # two sequences decoding together, of different lengths
    outs = llm.generate([ids, ids[:117]], SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0))
    for p, out in zip((ids, ids[:117]), outs):
        full_ids = p + out.token_ids
        with torch.no_grad():  # row len(p) - 1 is the prompt's (prefill): exact
            ref = torch.log_softmax(reference_logits(llm, full_ids, len(p)), -1)
        for t, tok in enumerate(out.token_ids):
            row = len(p) - 1 + t
            assert tok == int(ref[row].argmax()) and abs(out.logprobs[t] - float(ref[row, tok])) < 1e-4
    # and the selection mattered: full attention gives other logits
    with torch.no_grad():
        dense = torch.log_softmax(reference_logits(llm, full_ids, len(full_ids)), -1)
    assert (dense[len(p):] - ref[len(p):]).abs().max() > 1e-3


@pytest.mark.parametrize("caching,backend", [(True, "torch"), (False, "torch"), (True, "triton")])
def test_a_preempted_sequence_recomputes_what_its_decode_attended(llama, caching, backend):
    """Two sequences outgrow a small pool: the later one is preempted and recomputed from
    its tokens, generated ones included. Its select heads attend those rows as its decode
    steps did (each row over the pages its own length chose), so the output equals that of
    an engine with room for both."""
    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    layout = layout_with(shape, HeadSpec("select", 4, 8, 32), HeadSpec("window", 4, 8))
    geo = KVCacheManager(layout, 4, 1 << 30, 2, torch.float32).geometry
    opts = dict(head_layout=layout, block_size=4, dtype="float32", max_num_seqs=2)
    if backend == "triton":  # block tables read in place (Triton's interpreter without a GPU)
        pytest.importorskip("triton")
        opts.update(attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    small = LLM(llama, enable_prefix_caching=caching, kv_cache_memory=2 * geo.ring_bytes + 24 * geo.block_bytes,
                **opts)
    roomy = LLM(llama, kv_cache_memory=1 << 24, **opts)
    prompts = [prompt(small, 40), prompt(small, 33)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    got, want = small.generate(prompts, params), roomy.generate(prompts, params)
    assert sum(o.num_preemptions for o in got) > 0 and sum(o.num_preemptions for o in want) == 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


@pytest.mark.parametrize("kv,host", [("auto", False), ("int8", False), ("auto", True), ("int8", True)])
def test_prefix_hits_equal_computing_from_scratch(llama, kv, host):
    """A prompt whose prefix comes from the prefix cache (blocks and their key summaries)
    decodes as one computed from scratch, plain and int8; also with the cached engine's
    select pages in host memory (select_host_pages), against the in-pool engine."""
    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    layout = layout_with(shape, HeadSpec("select", 4, 8, 32), HeadSpec("window", 4, 8))
    opts = dict(head_layout=layout, kv_cache_memory=1 << 24, dtype="float32", kv_cache_dtype=kv)
    cached = LLM(llama, enable_prefix_caching=True, select_host_pages=host, **opts)
    plain = LLM(llama, enable_prefix_caching=False, **opts)
    doc = prompt(cached, 140)
    q2 = cached.tokenizer.encode(" Who pays the toll?", add_special_tokens=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0)
    cached.generate([doc], params)  # the document's end: a window-state snapshot point
    got = cached.generate([doc + q2], params)[0]
    assert got.num_cached_tokens >= 128
    want = plain.generate([doc + q2], params)[0]
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


def test_summaries_count_in_the_kv_bytes(llama):
    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    full = LLM(llama, head_layout="full", kv_cache_memory=1 << 24, dtype="float32").engine.cache.geometry
    lay = layout_with(shape, HeadSpec("select", 4, 8, 32), HeadSpec("full"))
    geo = LLM(llama, head_layout=lay, kv_cache_memory=1 << 24, dtype="float32").engine.cache.geometry
    L, H, D = shape
    n_sel = sum(s.kind == "select" for row in lay.heads for s in row)
    # per block: full K/V bytes of every paged head, and min + max [2, D] float32 per select head
    assert geo.block_bytes == full.block_bytes + n_sel * 2 * D * 4
    assert geo.seq_bytes(100) == 7 * geo.block_bytes


def test_select_profile_turns_full_heads_whose_pages_hold_the_mass_into_select(llama):
    from headwise.calibration.select_profile import recall_profile, select_layout
    from headwise.calibration.samples import make_samples

    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    L, H, D = shape
    source = HeadLayout("two", L, H, D, [[HeadSpec("full") if h == 0 else HeadSpec("window", 4, 16)
                                          for h in range(H)] for l in range(L)])
    opts = dict(kv_cache_memory=1 << 24, dtype="float32")
    lay, recall = select_layout(llama, source, budget=48, sink=4, window=16, recall=0.5, num_samples=2,
                                lengths=(300,), progress=False, engine_options=opts)
    assert recall.shape == (L, H) and ((recall > 0) & (recall <= 1 + 1e-5)).all()
    assert (recall < 1 - 1e-3).any()  # a budget of 3 of 19 pages leaves mass out
    for l in range(L):
        for h in range(H):
            want = "window" if h else ("select" if recall[l, h] >= 0.5 else "full")
            assert lay.heads[l][h].kind == want
    # a budget that holds every page recalls everything
    llm = LLM(llama, head_layout=source, max_num_batched_tokens=400, **opts)
    samples = make_samples(llm.tokenizer, 2, (300,), 0)
    assert torch.allclose(recall_profile(llm, samples, 4, 16, 1024, progress=False), torch.ones(L, H), atol=1e-5)
    with pytest.raises(ValueError, match="fit the budget"):
        select_layout(llama, source, budget=512, sink=4, window=16, lengths=(300,), progress=False,
                      engine_options=opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summary_refresh_kernel_equals_pytorch(dtype):
    """refresh_summaries through cpu_select.c and through PyTorch: per-channel min and max
    of each written block's keys, for every head, other blocks untouched; the keys a view
    of a pool holding more heads (as a head group's are)."""
    if cpu_kernels.select_library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    n, D, blocks = 2, 32, 10
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(n + 1, blocks * BS, D, generator=g).to(dtype)  # [heads, slots, D]
    k = KVTensor(pool[1:], None, dtype)  # the group's heads: not the pool's first
    written = torch.tensor([7, 2, 4])
    summaries = []
    for kernel in (True, False):
        summary = torch.full((blocks, n, 2, D), 99.0, dtype=dtype)
        group = SimpleNamespace(k=k, summary=summary)
        select.refresh_summaries(group, written, BS, use_kernel=kernel)
        summaries.append(summary)
    assert torch.equal(summaries[0], summaries[1])
    keys = pool[1:].view(n, blocks, BS, D)[:, 4]  # [n, BS, D]
    assert torch.equal(summaries[0][4], torch.stack((keys.amin(1), keys.amax(1)), 1))
    assert (summaries[0][[0, 1, 3, 5, 6, 8, 9]] == 99).all()
    assert page_select.refresh_summaries(k.data, written, BS, summaries[0])  # the kernel took it


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("B", [1, 3])
def test_chosen_pages_are_in_position_order_within_budget(B, kernel):
    """select_pages alone, through the C kernel (kernels/cpu_select.c) and PyTorch: forced
    pages, budget, position order with the partial page last, lengths, and tables the C
    attention kernel takes (unit strides, even for one sequence)."""
    if kernel and cpu_kernels.select_library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    n, G, D, W = 3, 2, 16, 12  # D: the kernel takes multiples of 16
    g = torch.Generator().manual_seed(B)
    summary = torch.randn(40, n, 2, D, generator=g).sort(dim=2).values  # min <= max
    tables = torch.randperm(40, generator=g)[:B * W].view(B, W).to(torch.int32)
    lens = torch.tensor([150, 70, 33][:B])
    q = torch.randn(B, n * G, D, generator=g)
    K = select.page_count(lens.tolist(), W, BS, sink=4, window=20, budget=64)
    assert K == 4 and select.page_count([60, 33], W, BS, 4, 20, 64) is None  # 4 pages or fewer: all
    sel, sel_lens = select.select_pages(q, summary, tables, lens, BS, 4, 20, 64, K, use_kernel=kernel)
    if kernel:  # the C kernel took these inputs (select_pages would fall back to PyTorch)
        assert page_select.select_pages(q, summary, tables, lens, BS, 4, 20, 64 // BS, K) is not None
    assert sel.shape == (n, B, 4) and sel_lens.shape == (n, B)
    for h in range(n):
        assert sel[h].stride(-1) == 1 and sel_lens[h].stride(0) == 1
    bounds = select.page_bounds(q.view(B, n, G, D), summary[tables.long()])
    if kernel:  # both ways choose the same pages (entries past a sequence's pages are unused)
        t_sel, t_lens = select.select_pages(q, summary, tables, lens, BS, 4, 20, 64, K, use_kernel=False)
        assert torch.equal(t_lens, sel_lens)
        for b in range(B):
            used = min(K, -(-int(lens[b]) // BS))
            assert torch.equal(t_sel[:, b, :used], sel[:, b, :used])
    for b in range(B):
        P = -(-int(lens[b]) // BS)
        for h in range(n):
            row = tables[b].tolist()
            pages = [row.index(x) for x in sel[h, b].tolist()[:min(P, 4)]]
            assert pages == sorted(pages) and pages[-1] == P - 1  # position order, last page last
            forced = {p for p in range(P) if p * BS < 4 or (p + 1) * BS > int(lens[b]) - 20}
            assert forced <= set(pages)
            rest = sorted(set(range(P)) - forced, key=lambda p: -float(bounds[b, h, p]))
            assert set(pages) == forced | set(rest[:len(pages) - len(forced)])
            assert int(sel_lens[h, b]) == (len(pages) - 1) * BS + int(lens[b]) - (P - 1) * BS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_chooses_as_pytorch_over_many_pages(dtype):
    """The C kernel over real head sizes and hundreds of pages (sixteen pages scored at a
    time, a last partial group; in bfloat16 the pair dot-product path where the CPU has
    it): the pages PyTorch's float32 bounds rank highest, in position order."""
    if cpu_kernels.select_library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    n, G, D, W, B = 2, 7, 64, 301, 3
    g = torch.Generator().manual_seed(7)
    summary = torch.randn(B * W + 5, n, 2, D, generator=g).sort(dim=2).values.to(dtype)
    tables = torch.randperm(B * W + 5, generator=g)[:B * W].view(B, W).to(torch.int32)
    lens = torch.tensor([W * BS - 3, 200 * BS, 37 * BS + 1])
    q = torch.randn(B, n * G, D, generator=g).to(dtype)
    K = select.page_count(lens.tolist(), W, BS, sink=64, window=256, budget=1024)
    got = page_select.select_pages(q, summary, tables, lens, BS, 64, 256, 1024 // BS, K)
    assert got is not None
    bounds = select.page_bounds(q.view(B, n, G, D), summary[tables.long()])  # [B, n, W] float32
    for b in range(B):
        P = -(-int(lens[b]) // BS)
        forced = [p for p in range(P) if p * BS < 64 or (p + 1) * BS > int(lens[b]) - 256]
        for h in range(n):
            rest = sorted(set(range(P)) - set(forced), key=lambda p: -float(bounds[b, h, p]))
            want = sorted(forced + rest[:max(0, 1024 // BS - len(forced))])
            assert got[0][h, b, :len(want)].tolist() == [int(tables[b, p]) for p in want]
            assert int(got[1][h, b]) == (len(want) - 1) * BS + int(lens[b]) - (P - 1) * BS


def test_kernel_breaks_ties_toward_the_lower_page():
    """Equal bounds (here every summary zero, as in a cache nothing was written to): the
    pages chosen by bound are the lowest candidates, whatever the order of the table."""
    if cpu_kernels.select_library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    n, G, D, W = 1, 2, 32, 100
    summary = torch.zeros(W, n, 2, D, dtype=torch.bfloat16)
    tables = torch.randperm(W, generator=torch.Generator().manual_seed(1))[None].to(torch.int32)
    q = torch.randn(1, n * G, D).to(torch.bfloat16)
    lens = torch.tensor([W * BS])
    got, _ = page_select.select_pages(q, summary, tables, lens, BS, 16, 32, 10, 10)
    want = [0] + list(range(1, 8)) + [98, 99]  # the sink page, 7 by bound, the 2 window pages
    assert got[0, 0].tolist() == [int(tables[0, p]) for p in want]


def test_a_next_turn_over_generated_tokens_equals_computing_from_scratch(llama):
    """A prompt that repeats an earlier answer: the answer's K/V were decoded with page
    selection, so its blocks are not offered as a prefix (the prompt's are); the next
    turn computes them as a prompt, as an engine without a prefix cache does."""
    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    layout = layout_with(shape, HeadSpec("select", 4, 8, 32), HeadSpec("window", 4, 8))
    opts = dict(head_layout=layout, kv_cache_memory=1 << 24, dtype="float32")
    cached, plain = LLM(llama, enable_prefix_caching=True, **opts), LLM(llama, enable_prefix_caching=False, **opts)
    doc = prompt(cached, 140)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    first = cached.generate([doc], params)[0]
    turn = doc + first.token_ids + cached.tokenizer.encode(" And then?", add_special_tokens=False)
    got, want = cached.generate([turn], params)[0], plain.generate([turn], params)[0]
    assert 128 <= got.num_cached_tokens <= len(doc)  # the prompt's blocks, none of the answer's
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


def test_calibrate_cli_makes_select_heads(llama, tmp_path, capsys):
    from headwise.cli import main

    shape = LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape
    HeadLayout.full(shape, "tiny").save(tmp_path / "full.json")
    out = tmp_path / "sel.json"
    rc = main(["calibrate", "--model", llama, "--select-from", str(tmp_path / "full.json"), "--budget", "48",
               "--window", "16", "--sink", "4", "--recall", "0.01", "--samples", "2", "--lengths", "300",
               "--kv-cache-memory", str(1 << 24), "--out", str(out)])
    assert rc == 0 and "4 select of 4 KV heads" in capsys.readouterr().out
    assert {str(s) for row in HeadLayout.load(out).heads for s in row} == {"select (budget 48, sink 4, window 16)"}
    rc = main(["calibrate", "--model", llama, "--select-from", "native", "--out", str(tmp_path / "n.json")])
    assert rc != 0 and "no native layout" in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()


def test_calibrate_cli_decides_three_classes_in_one_run(llama, tmp_path, capsys):
    """`--classes full,select,window`: the ranking picks full heads, then the recall profile
    makes select heads of them; the full heads the ranking chose are exactly those now full
    or select, and bad select parameters fail before any model runs."""
    from headwise.cli import main

    common = ["calibrate", "--model", llama, "--method", "mass", "--full-fraction", "0.5", "--sink", "4",
              "--window", "8", "--samples", "2", "--lengths", "96", "--kv-cache-memory", str(1 << 24)]
    two, three = tmp_path / "two.json", tmp_path / "three.json"
    assert main(common + ["--out", str(two)]) == 0
    capsys.readouterr()
    rc = main(common + ["--classes", "full,select,window", "--budget", "48", "--select-window", "16",
                        "--recall", "0.01", "--select-lengths", "300", "--out", str(three)])
    assert rc == 0 and "select heads (recall >= 0.01)" in capsys.readouterr().out
    a, b = HeadLayout.load(two), HeadLayout.load(three)
    kept = {(l, h) for l, row in enumerate(a.heads) for h, s in enumerate(row) if s.kind == "full"}
    assert kept and kept == {(l, h) for l, row in enumerate(b.heads) for h, s in enumerate(row)
                             if s.kind in ("full", "select")}
    assert {str(s) for row in b.heads for s in row if s.kind == "select"} == {"select (budget 48, sink 4, window 16)"}
    assert all(s == a.heads[l][h] for l, row in enumerate(b.heads) for h, s in enumerate(row) if s.kind == "window")
    # profile prompts that fit the budget: refused up front, nothing written
    bad = tmp_path / "bad.json"
    rc = main(common + ["--classes", "full,select,window", "--budget", "512", "--select-lengths", "300",
                        "--out", str(bad)])
    assert rc != 0 and "fit the budget of 512" in capsys.readouterr().err and not bad.exists()
    rc = main(["calibrate", "--from-scores", str(two), "--classes", "full,select,window", "--out", str(bad)])
    assert rc != 0 and "applies to a calibration run" in capsys.readouterr().err and not bad.exists()
