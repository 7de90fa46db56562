"""The KV tier on disk: prefixes evicted from memory come back from disk with the same
outputs (float32), across processes too; damaged or foreign entries are skipped and
recomputed; the directory stays within its bound; busy use leaks nothing."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.heads.layout import HeadSpec
from headwise.cache.manager import KVCacheManager
from tests.test_prefix_cache import _check_books, _same, mixed

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0)


def _layout(kind, shape):
    if kind in ("select", "select-host"):  # select heads (budget 6 of the documents' 28 blocks) beside window heads
        L, H, D = shape
        sel, win = HeadSpec("select", 4, 8, 24), HeadSpec("window", 4, 8)
        return HeadLayout("select", L, H, D, [[sel if (l + h) % 2 else win for h in range(H)] for l in range(L)])
    return {"full": HeadLayout.full(shape), "window": HeadLayout.window(shape, 4, 8),
            "mixed": mixed(shape)}[kind]


def _opts(path, kind, docs_in_memory=1.5):
    """An engine whose pool holds about `docs_in_memory` 110-token documents."""
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = _layout(kind, shape)
    geo = KVCacheManager(lay, 4, 1 << 30, 1, torch.float32).geometry
    per_doc = geo.seq_bytes(130) + 2 * geo.ring_bytes
    opts = dict(head_layout=lay, block_size=4, dtype="float32", max_num_seqs=1,
                kv_cache_memory=geo.ring_bytes + int(docs_in_memory * per_doc))
    if kind == "select-host":  # select pages in host memory: bounded there, not on the device
        opts.update(select_host_pages=True, select_host_memory=int(docs_in_memory * 33 * geo.select_block_bytes))
    return opts


def _docs(tok):
    texts = ["Document A about rivers and the sea. ", "Document B about towns and old bridges. ",
             "Document C about mountains and snow. "]
    out = [tok.encode(t * 20)[:110] for t in texts]
    assert all(len(d) == 110 for d in out)
    return out


def _pair_with_a_cached(path, tmp_path, opts):
    """(LLM with a disk tier that has cached document a, the same without caching, a, a
    question, the hashes of a + question)."""
    tiered = LLM(path, kv_offload_dir=str(tmp_path), **opts)
    plain = LLM(path, enable_prefix_caching=False, **opts)
    tok = tiered.tokenizer
    a = _docs(tok)[0]
    q = tok.encode(" Question: what is it about?", add_special_tokens=False)
    tiered.generate([a], GREEDY, use_tqdm=False)
    return tiered, plain, a, q, tiered.engine.cache.match_prefix(a + q).hashes


@pytest.mark.parametrize("kind", ["full", "window", "mixed", "select", "select-host"])
def test_prefix_from_disk_equals_recompute(tiny_models, tmp_path, kind):
    path = str(tiny_models["llama"])
    tiered, plain, a, q, keys = _pair_with_a_cached(path, tmp_path, _opts(path, kind))
    tok, cache = tiered.tokenizer, tiered.engine.cache
    for i in range(8):  # other documents push a's prefix out of memory, to disk
        tiered.generate([tok.encode(f"Another document {i} about towns. " * 20)[:110]], GREEDY, use_tqdm=False)
        if not any(h in cache.index.blocks or h in cache.index.snapshots for h in keys):
            break
    assert not any(h in cache.index.blocks or h in cache.index.snapshots for h in keys)
    tier = cache.tier
    tier.flush()
    got = tiered.generate([a + q], GREEDY, use_tqdm=False)[0]
    _same(got, plain.generate([a + q], GREEDY, use_tqdm=False)[0])
    assert got.num_cached_tokens >= 100 and tier.stats.hit_tokens > 0
    tiered.engine.cache.paged.blocks.check()
    tiered.close()


RESTART = """
import sys
from headwise import LLM, SamplingParams
from tests.test_disk_tier import _opts, _docs
llm = LLM(sys.argv[1], kv_offload_dir=sys.argv[2], **_opts(sys.argv[1], "mixed", docs_in_memory=4))
a = _docs(llm.tokenizer)[0]
llm.generate([a], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
llm.close()
"""


def test_restart_reads_what_an_earlier_process_cached(tiny_models, tmp_path):
    path = str(tiny_models["llama"])
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", RESTART, path, str(tmp_path)], check=True, cwd=root,
                   env=dict(os.environ, PYTHONPATH=str(root)), timeout=300)
    opts = _opts(path, "mixed", docs_in_memory=4)
    b = LLM(path, kv_offload_dir=str(tmp_path), **opts)
    a = _docs(b.tokenizer)[0]
    q = b.tokenizer.encode(" Question: what is it about?", add_special_tokens=False)
    got = b.generate([a + q], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 100 and b.engine.cache.tier.stats.hit_tokens > 0
    _same(got, LLM(path, enable_prefix_caching=False, **opts).generate([a + q], GREEDY, use_tqdm=False)[0])


def test_damaged_and_foreign_entries_are_recomputed(tiny_models, tmp_path, caplog):
    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=4)
    first = LLM(path, kv_offload_dir=str(tmp_path), **opts)
    a, b, _ = _docs(first.tokenizer)
    first.generate([a], GREEDY, use_tqdm=False)
    first.generate([b], GREEDY, use_tqdm=False)
    first.close()
    (fp_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(fp_dir.iterdir())
    for f in files[::3]:  # flip bytes at the end of the payload
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    for f in files[1::3]:  # truncate
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    (tmp_path / "0123456789abcdef0123").mkdir()  # another model's or layout's entries
    q = first.tokenizer.encode(" Question: what is it about?", add_special_tokens=False)
    plain = LLM(path, enable_prefix_caching=False, **opts)
    with caplog.at_level(logging.WARNING, logger="headwise.kv_tier"):
        again = LLM(path, kv_offload_dir=str(tmp_path), **opts)
        for doc in (a, b):
            _same(again.generate([doc + q], GREEDY, use_tqdm=False)[0],
                  plain.generate([doc + q], GREEDY, use_tqdm=False)[0])
    text = caplog.text
    assert "another model" in text and "checksum" in text or "unreadable" in text
    assert again.engine.cache.tier.stats.errors > 0


def test_directory_stays_within_its_bound(tiny_models, tmp_path):
    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=1.2)
    bound = 60_000
    llm = LLM(path, kv_offload_dir=str(tmp_path), kv_offload_bytes=bound, **opts)
    tok = llm.tokenizer
    for i in range(8):
        llm.generate([tok.encode(f"Document {i} about rivers and the sea. " * 20)[:110]], GREEDY, use_tqdm=False)
        llm.engine.cache.tier.flush()
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
        assert on_disk <= bound, (i, on_disk)
    assert llm.engine.cache.tier.stats.entries > 0


def test_busy_use_leaks_no_block_and_no_partial_file(tiny_models, tmp_path):
    """Many requests over a few documents, in batches, with memory for about one: blocks
    are evicted to disk and read back again and again; the books stay exact."""
    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=1.5)
    opts["max_num_seqs"] = 3
    opts["kv_cache_memory"] += 2 * KVCacheManager(opts["head_layout"], 4, 1 << 30, 1, torch.float32).geometry.ring_bytes
    llm = LLM(path, kv_offload_dir=str(tmp_path), **opts)
    plain = LLM(path, enable_prefix_caching=False, **opts)
    docs = _docs(llm.tokenizer)
    prompts = [docs[i % 3] + [100 + i] for i in range(12)]
    for batch in (prompts[:6], prompts[6:]):
        for g, w in zip(llm.generate(batch, GREEDY, use_tqdm=False), plain.generate(batch, GREEDY, use_tqdm=False)):
            _same(g, w)
    cache = llm.engine.cache
    _check_books(cache, [])
    assert cache.paged.blocks.num_free == cache.paged.blocks.num_blocks
    assert cache.tier.stats.hit_tokens > 0
    llm.close()
    assert not [f for f in tmp_path.rglob(".tmp-*")]


def test_full_disk_stops_offloading_and_serving_goes_on(tiny_models, tmp_path, monkeypatch, caplog):
    import errno

    from headwise.cache import disk_tier

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "replace", no_space)
    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=1.2)
    llm = LLM(path, kv_offload_dir=str(tmp_path), **opts)
    plain = LLM(path, enable_prefix_caching=False, **opts)
    tok = llm.tokenizer
    with caplog.at_level(logging.WARNING, logger="headwise.kv_tier"):
        for i in range(4):
            prompt = tok.encode(f"Document {i} about rivers and the sea. " * 20)[:110]
            _same(llm.generate([prompt], GREEDY, use_tqdm=False)[0], plain.generate([prompt], GREEDY, use_tqdm=False)[0])
        llm.engine.cache.tier.flush()
    assert caplog.text.count("offloading stops") == 1
    assert llm.engine.cache.tier.stats.entries == 0 and not list(tmp_path.rglob("*.safetensors"))
    assert not list(tmp_path.rglob(".tmp-*"))


def test_server_reports_tier_metrics(tiny_models, tmp_path):
    import httpx

    from tests.test_server import _metric, running_server

    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=1.2)
    opts.pop("max_num_seqs")
    with running_server(path, max_model_len=1024, kv_offload_dir=str(tmp_path), max_num_seqs=1, **opts) as (url, _):
        for i in range(4):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": f"Document {i} about the sea. " * 20,
                                                          "max_tokens": 4}, timeout=60)
            assert r.status_code == 200
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "Document 0 about the sea. " * 20,
                                                          "max_tokens": 4}, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _metric(url, "headwise:kv_offload_entries") > 0 and _metric(url, "headwise:kv_offload_bytes") > 0
        assert _metric(url, "headwise:prefix_cache_disk_hits_total") > 0
        assert _metric(url, "headwise:kv_offload_write_seconds_count") > 0
        assert _metric(url, "headwise:kv_offload_read_seconds_count") > 0


@pytest.mark.parametrize("with_dir", [False, True])
def test_host_memory_tier_serves_before_the_disk(tiny_models, tmp_path, with_dir):
    """--kv-offload-host-bytes: evicted prefixes are kept in host memory (pinned on CUDA)
    and come back from there, without a disk read; bounded by its size."""
    path = str(tiny_models["llama"])
    opts = _opts(path, "mixed", docs_in_memory=1.2)
    tiered = LLM(path, kv_offload_dir=str(tmp_path) if with_dir else None, kv_offload_host_bytes=200_000, **opts)
    plain = LLM(path, enable_prefix_caching=False, **opts)
    tok, cache = tiered.tokenizer, tiered.engine.cache
    a = _docs(tok)[0]
    q = tok.encode(" Question: what is it about?", add_special_tokens=False)
    tiered.generate([a], GREEDY, use_tqdm=False)
    for i in range(3):
        tiered.generate([tok.encode(f"Another document {i} about towns. " * 20)[:110]], GREEDY, use_tqdm=False)
    got = tiered.generate([a + q], GREEDY, use_tqdm=False)[0]
    _same(got, plain.generate([a + q], GREEDY, use_tqdm=False)[0])
    st = cache.tier.stats
    assert got.num_cached_tokens >= 100 and st.served["host"] > 0 and st.served["disk"] == 0
    assert 0 < st.host_bytes <= 200_000
    assert (st.entries > 0) == with_dir


def test_scoring_a_prompt_offloads_what_it_evicts_before_overwriting_it(tiny_models, tmp_path):
    """prompt_logits (perplexity, evaluation) takes pages outside the engine step: the
    prefixes it evicts must reach the disk tier intact."""
    path = str(tiny_models["llama"])
    tiered, plain, a, q, keys = _pair_with_a_cached(path, tmp_path, _opts(path, "mixed", docs_in_memory=1.2))
    tok, cache = tiered.tokenizer, tiered.engine.cache
    tiered.engine.prompt_logits(tok.encode("Scored text about mountains. " * 20)[:115])
    assert not all(h in cache.index.blocks for h in keys)  # some of a's blocks were evicted ...
    cache.tier.flush()
    got = tiered.generate([a + q], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 100 and cache.tier.stats.hit_tokens > 0  # ... to disk, and back:
    _same(got, plain.generate([a + q], GREEDY, use_tqdm=False)[0])


def test_an_evicted_entry_not_yet_copied_out_is_waited_for(tmp_path):
    """Between an eviction (in the scheduler) and the copy of its pages to the tier
    (before the next step), a lookup of that prefix waits for it instead of finding its
    chain broken and recomputing all of it."""
    from headwise.cache.disk_tier import DiskTier
    from headwise.cache.ops import PageOut

    cache = KVCacheManager(HeadLayout.full((1, 1, 4)), 4, 4 * 2 * 4 * 4 * 4, 2, torch.float32,
                           enable_prefix_caching=True)
    assert cache.num_blocks == 4
    tier = DiskTier(tmp_path, 1 << 20, "fp")
    cache.attach_tier(tier)
    a, b = list(range(10, 19)), list(range(50, 66))
    cache.allocate(1, 9, cache.match_prefix(a))
    cache.commit(1, lambda s, e: a[s:e], 9)
    cache.free(1)  # a's two full blocks stay cached
    cache.allocate(2, 16, cache.match_prefix(b))  # takes all four pages: a's are evicted
    ops = cache.pop_ops()
    assert [type(op) for op in ops] == [PageOut, PageOut]
    hit = cache.match_prefix(a)  # before the engine has copied them out
    assert hit.pending
    for op in ops:  # the runner's copy (any bytes: the tier checks what it wrote)
        tier.put(op.entry, torch.full((64,), op.pages[0], dtype=torch.uint8))
    cache.ops_done(ops)
    tier.flush()
    for _ in range(200):
        hit = cache.match_prefix(a)
        if not hit.pending:
            break
        tier.wait_for_reads(0.05)
    assert hit.num_tokens == 8 and len(hit.from_disk) == 2
    tier.close()
