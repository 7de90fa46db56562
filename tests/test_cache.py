"""Block pool, full-head pool, ring pool and cache manager on tiny configurations."""
import pytest
import torch

from headwise.cache.block_pool import BlockPool
from headwise.heads.layout import HeadLayout, HeadSpec
from headwise.cache.manager import CacheConfigError, KVCacheManager
from headwise.cache.pool import CacheFullError
from headwise.engine.kv_storage import KVStorage

F32 = torch.float32


def test_block_pool_exact_ids_and_reuse():
    pool = BlockPool(6)
    a = pool.take(2)
    b = pool.take(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    pool.release(a)
    assert pool.take(3) == [0, 1, 5]  # never-used block 5 and freed 0, 1; ascending
    with pytest.raises(CacheFullError):
        pool.take(1)


def _manager(layout, blocks_bytes=None, max_num_seqs=2, block_size=4):
    return KVCacheManager(layout, block_size, blocks_bytes, max_num_seqs, F32)


def test_full_layout_block_tables_exact():
    layout = HeadLayout.full((2, 2, 8))
    block_bytes = 2 * 4 * 4 * 8 * 4  # K+V, 4 full heads, 4 tokens, D=8, fp32
    m = _manager(layout, 5 * block_bytes)
    assert m.paged.blocks.num_blocks == 5 and m.ring.total_bytes == 0
    m.allocate(10, 5)           # 5 tokens -> 2 blocks
    m.allocate(11, 4)           # 1 block
    assert m.paged.tables == {10: [0, 1], 11: [2]}
    assert m.can_append(10, 12) and not m.can_append(10, 21)
    m.append(10, 12)            # grows to 3 blocks
    assert m.paged.tables[10] == [0, 1, 3]
    assert m.slot_mapping(10, 6, 9) == [1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    m.free(10)
    m.allocate(12, 16)
    # never-used block 4, then 10's blocks (freed tail first); a table is ascending
    assert m.paged.tables[12] == [0, 1, 3, 4]
    m.free(11), m.free(12)
    assert m.paged.blocks.num_free == 5 and m.usage()["paged"]["used_bytes"] == 0


def test_no_leaked_blocks_after_many_sequences():
    layout = HeadLayout.full((1, 1, 4))
    m = _manager(layout, 2 * 1 * 4 * 4 * 4 * 16, max_num_seqs=4)
    g = torch.Generator().manual_seed(0)
    live = {}
    for sid in range(500):
        n = int(torch.randint(1, 20, (1,), generator=g))
        while not m.can_allocate(n):
            m.free(live.pop(min(live)))
        m.allocate(sid, n)
        live[sid] = sid
    for sid in list(live):
        m.free(sid)
    assert m.paged.blocks.num_free == 16 and not m.paged.tables


def test_mixed_layout_storage_and_kv_bytes():
    # layer 0: 1 full + 1 window; layer 1: 0 full + 2 window (different windows)
    heads = [[HeadSpec("full"), HeadSpec("window", 2, 4)],
             [HeadSpec("window", 2, 4), HeadSpec("window", 1, 3)]]
    layout = HeadLayout("m", 2, 2, 8, heads)
    ring_seq = 2 * ((2 + 4) + (2 + 4) + (1 + 3)) * 8 * 4
    block = 2 * 1 * 4 * 8 * 4
    m = _manager(layout, 3 * ring_seq + 10 * block, max_num_seqs=3)
    assert m.ring.total_bytes == 3 * ring_seq
    assert m.paged.blocks.num_blocks == 10
    kv = KVStorage(m.geometry, m.num_blocks, m.num_ring_slots)
    assert kv.paged_k.shape == (1, 40, 8)  # only the one full head is stored
    assert m.kv_bytes(9) == 3 * block + ring_seq
    m.allocate(1, 9)
    m.allocate(2, 1)
    assert m.ring.slot_of == {1: 0, 2: 1}
    assert m.usage()["ring"]["used_bytes"] == 2 * ring_seq
    assert m.usage()["paged"]["used_bytes"] == 4 * block
    # the storage the runner allocates is exactly what the books count
    assert kv.nbytes == m.ring.total_bytes + m.paged.total_bytes
    m.allocate(3, 1)
    assert not m.can_allocate(1)  # ring pool is the limit now
    m.free(2)
    assert m.can_allocate(1)


def test_kv_bytes_25_percent_full_at_8k():
    shape = (30, 3, 64)  # SmolLM2
    pairs = [(l, h) for l in range(30) for h in range(3)]
    quarter = HeadLayout.from_full_set("q", shape, set(pairs[: int(0.25 * 90)]))
    full = KVCacheManager(HeadLayout.full(shape), 16, 1 << 30, 8, F32)
    split = KVCacheManager(quarter, 16, 1 << 30, 8, F32)
    assert split.kv_bytes(8192) * 3.5 <= full.kv_bytes(8192)
    assert full.kv_bytes(8192) == 2 * 90 * 8192 * 64 * 4


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(CacheConfigError, match="max_num_seqs"):
        _manager(HeadLayout.window((2, 2, 8), 4, 8), 100, max_num_seqs=4)
    with pytest.raises(CacheConfigError, match="no room for one full-head block"):
        _manager(HeadLayout.full((2, 2, 8)), 10)


def test_reallocated_blocks_form_one_run():
    """Blocks come back tail first (so a cached prefix outlives its tail), yet a sequence
    taking them again gets them ascending: one run of adjacent ids, read as one view."""
    layout = HeadLayout.full((1, 1, 4))
    m = KVCacheManager(layout, 4, 8 * 2 * 4 * 4 * 4, 1, F32, enable_prefix_caching=True)
    m.allocate(1, 32)
    m.free(1)
    m.allocate(2, 32)
    assert m.paged.tables[2] == list(range(8)) and m.slot_runs(2, 32) == [(0, 32)]


@pytest.mark.parametrize("kind,kv_dtype", [("mixed", "auto"), ("mixed", "int8"), ("window", "auto")])
def test_pages_and_ring_snapshots_round_trip_over_scattered_pages(kind, kv_dtype):
    """Pool pages written and read back byte for byte, in runs of consecutive ids or not
    (values and int8 scales; plain pages of a window-only layout); a ring slot saved into
    pages and loaded into another slot is the same ring; pages not named stay as they were."""
    heads = ([[HeadSpec("full"), HeadSpec("window", 2, 4)], [HeadSpec("window", 2, 4), HeadSpec("full")]]
             if kind == "mixed" else [[HeadSpec("window", 2, 4)] * 2] * 2)
    layout = HeadLayout(kind, 2, 2, 8, heads)
    m = KVCacheManager(layout, 4, 1 << 16, 3, F32, enable_prefix_caching=True, kv_cache_dtype=kv_dtype)
    kv = KVStorage(m.geometry, m.num_blocks, m.num_ring_slots, page_bytes=m.page_bytes, compute_dtype=F32)
    g = torch.Generator().manual_seed(0)
    for t in (kv.paged_kv, kv.paged_k_scale, kv.paged_v_scale, kv.rings, kv.ring_scales, kv.pages):
        if t is not None and t.numel():
            t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                             generator=g, dtype=torch.uint8))
    before = [v.clone() for v in kv._page_views()]
    per = sum(v.shape[0] * v.shape[2] for v in before)  # bytes of one page
    pages = [1, 2, 3, 7, 5] if m.num_blocks > 7 else [0, 2]
    data = torch.randint(0, 256, (len(pages) * per - 3,), generator=g, dtype=torch.uint8)
    kv.write_pages(pages, data)
    back = kv.read_pages(pages)
    assert torch.equal(back[:data.numel()], data) and not back[data.numel():].any()
    for v, old in zip(kv._page_views(), before):  # only the named pages changed
        rest = [b for b in range(v.shape[1]) if b not in pages]
        assert torch.equal(v[:, rest], old[:, rest])
    ring = kv.read_ring(0)
    snap = pages[: m.snapshot_pages] if len(pages) >= m.snapshot_pages else list(range(m.snapshot_pages))
    kv.write_pages(snap, ring)
    kv.write_ring(2, kv.read_pages(snap))
    assert torch.equal(kv.read_ring(2), ring) and not torch.equal(kv.read_ring(1), ring)
