"""Select heads' pages waiting in host memory (select_host_pages; engine.hot_pages).
Here host and device are both CPU memory, but separate tensors: the residency books, the
copies of missed pages, the table rewrite and the invalidation on writes run as they
would on a GPU, and outputs must equal the in-pool path token for token (float32)."""
import pytest
import torch

from headwise import LLM, SamplingParams
from headwise.cache.manager import CacheConfigError, KVCacheManager
from headwise.config import ConfigError
from headwise.engine.hot_pages import HotPages
from headwise.heads import select
from headwise.heads.layout import HeadSpec
from headwise.layers.kv_tensor import KVTensor

from tests.test_select_heads import layout_with, prompt


# ---- the books, on their own ----------------------------------------------------------
def books(num_pages=3, S=2, blocks=8, bs=2, D=4, quantized=False):
    data = torch.arange(2 * S * blocks * bs * D, dtype=torch.float32).view(2, S, blocks * bs, D)
    if quantized:
        q = data.to(torch.int8)
        scales = torch.rand(2, S, blocks * bs)
        home = [KVTensor(q[i], scales[i], torch.float32) for i in (0, 1)]
    else:
        home = [KVTensor(data[i], None, torch.float32) for i in (0, 1)]
    return HotPages(*home, num_pages, bs, torch.device("cpu")), home


def hot_rows(hot: HotPages, kv: int, head: int, page: int) -> torch.Tensor:
    t = (hot.k, hot.v)[kv]
    return t.data[head].view(-1, hot.block_size, t.shape[-1])[page]


def home_rows(home, kv: int, head: int, block: int, bs=2) -> torch.Tensor:
    return home[kv].data[head].view(-1, bs, home[kv].shape[-1])[block]


@pytest.mark.parametrize("quantized", [False, True])
def test_missed_pages_are_copied_in_and_hits_are_not(quantized):
    hot, home = books(quantized=quantized)
    pages = hot.fetch(1, torch.tensor([2, 5]))
    assert hot.copied == 2 and hot.hits == 0
    for p, b in zip(pages.tolist(), (2, 5)):
        for kv in (0, 1):
            assert torch.equal(hot_rows(hot, kv, 1, p), home_rows(home, kv, 1, b))
            if quantized:
                t, h = (hot.k, hot.v)[kv], home[kv]
                assert torch.equal(t.scale[1].view(-1, 2)[p], h.scale[1].view(-1, 2)[b])
    again = hot.fetch(1, torch.tensor([2, 5]))
    assert torch.equal(again, pages) and hot.copied == 2 and hot.hits == 2
    assert hot.resident[0].eq(-1).all()  # head 0 untouched


def test_least_recently_used_page_goes_first_never_one_of_the_same_call():
    hot, home = books(num_pages=3)
    hot.fetch(0, torch.tensor([0]))
    hot.fetch(0, torch.tensor([1]))
    hot.fetch(0, torch.tensor([2]))  # full: 0 oldest, then 1, then 2
    hot.fetch(0, torch.tensor([0]))  # a hit makes 0 newest: 1 is now the oldest
    got = hot.fetch(0, torch.tensor([0, 3]))
    assert hot.resident[0, 1] == -1 and hot.resident[0, 3] >= 0 and hot.resident[0, 0] >= 0
    # three blocks at once, two missing: the two pages outside this call go, 0's stays
    before = hot.resident[0, 0].item()
    hot.fetch(0, torch.tensor([0, 5, 6]))
    assert hot.resident[0, 0].item() == before
    assert set(hot.owner[0].tolist()) == {0, 5, 6}
    for b in (0, 5, 6):
        assert torch.equal(hot_rows(hot, 0, 0, hot.resident[0, b].item()), home_rows(home, 0, 0, b))
    assert got.numel() == 2
    with pytest.raises(RuntimeError, match="4 pages asked of a hot set of 3"):
        hot.fetch(0, torch.tensor([1, 2, 3, 4]))


def test_a_written_block_is_copied_again():
    hot, home = books()
    hot.fetch(0, torch.tensor([4]))
    hot.fetch(1, torch.tensor([4]))
    home[0].data[0].view(-1, 2, 4)[4] += 100  # the step writes block 4 of head 0 at home
    hot.invalidate(0, 1, torch.tensor([4]))
    assert hot.resident[0, 4] == -1 and hot.resident[1, 4] >= 0 and hot.owner[0].eq(-1).all()
    page = hot.fetch(0, torch.tensor([4])).item()
    assert torch.equal(hot_rows(hot, 0, 0, page), home_rows(home, 0, 0, 4)) and hot.copied == 3


def test_tables_are_rewritten_to_hot_pages_past_each_row_pages_zero():
    hot, home = books(num_pages=4)
    view = hot.view(0, 2)
    tables = torch.tensor([[[3, 7, 1], [7, 2, 2]], [[0, 1, 6], [5, 5, 5]]], dtype=torch.int32)  # [n, R, K]
    lens = torch.tensor([[5, 3], [6, 1]], dtype=torch.int32)  # bs 2: 3, 2 / 3, 1 pages
    got = view.chosen(tables, lens)
    assert got.dtype == torch.int32
    for h in range(2):
        for r in range(2):
            pages = -(-lens[h, r].item() // 2)
            for j in range(3):
                if j < pages:
                    assert hot.owner[h, got[h, r, j]].item() == tables[h, r, j].item()
                else:
                    assert got[h, r, j] == 0
    # more distinct pages than the hot set holds: nothing copied, the caller splits
    copied = hot.copied
    wide = torch.tensor([[[0, 1, 2], [3, 4, 5]]], dtype=torch.int32)
    assert hot.view(0, 1).chosen(wide, torch.tensor([[6, 6]], dtype=torch.int32)) is None
    assert hot.copied == copied


# ---- the engine (prefix hits: tests/test_select_heads.py, the disk tier: test_disk_tier.py) ---
@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


def shape_of(llama):
    return LLM(llama, head_layout="full", kv_cache_memory=1 << 24).layout.shape


@pytest.mark.parametrize("kv,other,hot_pages", [("auto", "full", 8), ("auto", "window", None), ("int8", "full", 8)])
def test_outputs_equal_the_in_pool_path(llama, kv, other, hot_pages, monkeypatch):
    """Two sequences decoding together past their budget, and a prefill in chunks (a
    later chunk attends a copy of its sequence's earlier K/V): with a hot set of 8 pages
    per head (two sequences x 4 chosen pages) pages are evicted and copied back all the
    time; the tokens and log-probabilities are those of the in-pool path."""
    second = HeadSpec("full") if other == "full" else HeadSpec("window", 4, 32)
    layout = layout_with(shape_of(llama), HeadSpec("select", 4, 20, 64), second)
    opts = dict(head_layout=layout, kv_cache_memory=1 << 24, dtype="float32", kv_cache_dtype=kv,
                max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    pool = LLM(llama, **opts)
    host = LLM(llama, select_host_pages=True, select_hot_pages=hot_pages, **opts)
    ids = prompt(pool, 150)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    want = pool.generate([ids, ids[:117]], params)
    got = host.generate([ids, ids[:117]], params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    hot = host.engine.runner.kv.hot
    assert hot.copied > 0 and hot.hits > 0
    if hot_pages == 8:  # 2 x 150-odd tokens of 16-token pages: far more pages than the set holds
        assert hot.copied > hot.num_pages * hot.k.shape[0]
    # the select heads' K/V are in the home pool only: the device pool holds the others
    kv_st = host.engine.runner.kv
    n_sel = host.engine.cache.geometry.summary_heads
    assert kv_st.home_kv.shape[1] == n_sel
    assert kv_st.paged_kv.shape[1] == host.engine.cache.geometry.total_paged_heads - n_sel


def test_a_budget_covering_the_context_attends_every_page_through_the_hot_set(llama):
    """Where every page of every sequence fits the budget, the pool path is the full
    class's decode; in host memory every page goes through the hot set instead."""
    layout = layout_with(shape_of(llama), HeadSpec("select", 4, 8, 1024), HeadSpec("full"))
    opts = dict(head_layout=layout, kv_cache_memory=1 << 24, dtype="float32", max_num_seqs=2)
    pool, host = LLM(llama, **opts), LLM(llama, select_host_pages=True, **opts)
    ids = prompt(pool, 150)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    want, got = pool.generate([ids, ids[:90]], params), host.generate([ids, ids[:90]], params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    hot = host.engine.runner.kv.hot
    steps = 11  # decode steps of each sequence (the first token comes from the prefill)
    # each step attends all of both sequences' pages (10 and 6 at first), one new page read per step
    assert hot.hits + hot.copied >= steps * hot.k.shape[0] * (10 + 6)
    assert hot.copied >= hot.k.shape[0] * (10 + 6 + steps)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_equals_the_in_pool_path(llama, caching):
    """A small pool preempts the later sequence, recomputed from its tokens: its generated
    rows attend their chosen pages through the hot set, split where they overflow it."""
    layout = layout_with(shape_of(llama), HeadSpec("select", 4, 8, 32), HeadSpec("window", 4, 8))
    geo = KVCacheManager(layout, 4, 1 << 30, 2, torch.float32).geometry
    opts = dict(head_layout=layout, block_size=4, dtype="float32", max_num_seqs=2, enable_prefix_caching=caching)
    roomy = LLM(llama, kv_cache_memory=1 << 24, **opts)
    # 24 blocks: the host bound (the device part of a block is its summaries only here)
    small = LLM(llama, kv_cache_memory=1 << 24, select_host_pages=True,
                select_host_memory=24 * geo.select_block_bytes, **opts)
    assert small.engine.cache.num_blocks == 24
    prompts = [prompt(small, 40), prompt(small, 33)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    got, want = small.generate(prompts, params), roomy.generate(prompts, params)
    assert sum(o.num_preemptions for o in got) > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


def test_the_device_budget_counts_the_hot_set_and_not_the_host_pages(llama):
    layout = layout_with(shape_of(llama), HeadSpec("select", 4, 20, 64), HeadSpec("full"))
    opts = dict(head_layout=layout, kv_cache_memory=1 << 22, dtype="float32", max_num_seqs=2)
    pool, host = LLM(llama, **opts), LLM(llama, select_host_pages=True, **opts)
    geo = host.engine.cache.geometry
    step = geo.select_step_pages  # max(64 // 16, 1 + 2 + 1) = 4
    assert step == 4 and host.engine.cache.hot_pages == 2 * step
    device_block = geo.block_bytes - geo.select_block_bytes
    assert host.engine.cache.kv_bytes(100) == 7 * device_block < pool.engine.cache.kv_bytes(100)
    hot_bytes = 2 * step * geo.select_block_bytes
    assert host.engine.cache.num_blocks == ((1 << 22) - hot_bytes) // device_block > pool.engine.cache.num_blocks
    kv = host.engine.runner.kv
    assert kv.host_nbytes == host.engine.cache.num_blocks * geo.select_block_bytes
    usage = host.engine.cache.usage()
    assert usage["host"]["total_bytes"] == kv.host_nbytes and "host" not in pool.engine.cache.usage()
    bounded = LLM(llama, select_host_pages=True, select_host_memory=10 * geo.select_block_bytes, **opts)
    assert bounded.engine.cache.num_blocks == 10


def test_bad_options_are_refused_at_start(llama):
    shape = shape_of(llama)
    layout = layout_with(shape, HeadSpec("select", 4, 20, 64), HeadSpec("full"))
    with pytest.raises(CacheConfigError, match=r"select_hot_pages=7 cannot hold one decode step's chosen pages: "
                                                 r"max_num_seqs=2 sequences x 4 pages per select head need 8"):
        LLM(llama, head_layout=layout, max_num_seqs=2, select_host_pages=True, select_hot_pages=7)
    with pytest.raises(CacheConfigError, match="has no select heads"):
        LLM(llama, head_layout="full", select_host_pages=True)
    with pytest.raises(ConfigError, match="need select_host_pages=True"):
        LLM(llama, head_layout=layout, select_hot_pages=8)
    with pytest.raises(ConfigError, match="torch attention backend only"):
        LLM(llama, head_layout=layout, select_host_pages=True, attention_backend="triton")


def test_a_step_that_overflows_the_hot_set_is_split_by_rows(llama, monkeypatch):
    """The recompute path attends many rows of one sequence at once; when their pages
    exceed the hot set, attend_chosen splits them, and the result is unchanged."""
    layout = layout_with(shape_of(llama), HeadSpec("select", 4, 20, 64), HeadSpec("full"))
    host = LLM(llama, head_layout=layout, dtype="float32", select_host_pages=True, max_num_seqs=1)
    grp = next(g for g in host.engine.model.attention_layers()[0].groups if g.hot is not None)
    n, R, K, bs = grp.num_heads, 6, 4, 16
    blocks = torch.arange(R * K, dtype=torch.int32).view(1, R, K).expand(n, -1, -1).contiguous()  # 24 pages
    lens = torch.full((n, R), K * bs, dtype=torch.int32)
    torch.manual_seed(0)
    grp.k.data.normal_(), grp.v.data.normal_()
    q = torch.randn(R, n * host.engine.model.config.group_size, grp.k.shape[-1])
    layer = host.engine.model.attention_layers()[0]
    got = select.attend_chosen(layer, grp, q, (blocks, lens), bs)
    plain = select._IMPLS["torch"](q, grp, (blocks, lens), bs, layer.scale)  # over the home pool itself
    assert torch.allclose(got, plain, atol=1e-6)
    assert grp.hot.pages.copied >= R * K
