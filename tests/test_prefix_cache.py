"""Prefix caching: greedy outputs with caching equal those without it (float32), exact
books after any mix of finish, abort, preemption and eviction, and eviction that never
touches a block in use."""
import random

import pytest
import torch

from headwise import LLM, HeadLayout, SamplingParams
from headwise.cache.block_pool import PageKind
from headwise.heads.layout import HeadSpec
from headwise.cache.manager import KVCacheManager
from headwise.engine.scheduler import Scheduler
from headwise.engine.sequence import Sequence, SeqStatus

SINK, WINDOW = 4, 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)


def mixed(shape):
    L, H, D = shape
    return HeadLayout("mixed", L, H, D, [[HeadSpec("window", SINK, WINDOW) if (l + h) % 2 else HeadSpec("full")
                                          for h in range(H)] for l in range(L)])


def _layout(kind, shape):
    return {"full": lambda: "full", "window": lambda: HeadLayout.window(shape, SINK, WINDOW),
            "mixed": lambda: mixed(shape)}[kind]()


def _pair(path, kind, **opts):
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    base = dict(head_layout=_layout(kind, shape), kv_cache_memory=1 << 24, block_size=4, dtype="float32")
    base.update(opts)
    return LLM(path, enable_prefix_caching=True, **base), LLM(path, enable_prefix_caching=False, **base)


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def _backend(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        return dict(attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    return {}


# Triton (its interpreter here, ~10 s a case) on the layout with both classes only.
@pytest.mark.parametrize("kind,backend", [("full", "torch"), ("window", "torch"), ("mixed", "torch"),
                                          ("mixed", "triton")])
def test_document_questions_equal_uncached(tiny_models, kind, backend):
    cached, plain = _pair(str(tiny_models["llama"]), kind, max_num_batched_tokens=16, **_backend(backend))
    tok = cached.tokenizer
    doc = tok.encode("A report on rivers, bridges and the towns between them. " * 6)
    assert len(doc) > 4 * (SINK + WINDOW)  # hits far longer than the window
    questions = [tok.encode(q, add_special_tokens=False) for q in
                 (" Which town?", " Name every bridge in it, please.", " Why?", " Which town?")]
    hits = []
    for q in questions:
        got = cached.generate([doc + q], GREEDY, use_tqdm=False)[0]
        _same(got, plain.generate([doc + q], GREEDY, use_tqdm=False)[0])
        hits.append(got.num_cached_tokens)
    assert hits[0] == 0 and all(h > len(doc) - 4 * 4 for h in hits[1:]), hits
    # the very same prompt again: everything but its last (partial) block is cached
    again = cached.generate([doc + questions[0]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(doc + questions[0]) - 1) // 4 * 4


@pytest.mark.parametrize("kind", ["window", "mixed"])
def test_hit_points_mid_block_and_block_aligned(tiny_models, kind):
    """Prompts sharing 160 (block-aligned) or 162 tokens with a first one. The second hits
    the latest window state saved at or before the shared part (the first prompt's last
    block boundary, or the one TRAILING_TOKENS before it) and saves the state where it
    left the cached prefix; the third hits exactly there, the last block boundary <= shared."""
    cached, plain = _pair(str(tiny_models["llama"]), kind)
    base = cached.tokenizer.encode("Bridges and rivers, towns and roads. " * 25)
    for shared in (160, 162):
        cached.reset_prefix_cache()
        prompts = [base[:shared] + suffix for suffix in ([100, 101, 102], [200, 201], [300])]
        hits = []
        for prompt in prompts:
            got = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
            _same(got, plain.generate([prompt], GREEDY, use_tqdm=False)[0])
            hits.append(got.num_cached_tokens)
        edge = shared // 4 * 4
        assert hits[0] == 0 and 0 < hits[1] <= edge and hits[2] == edge, hits
        assert (hits[1] == edge) == (shared == 160)  # 160: the first prompt's last boundary


@pytest.mark.parametrize("kind", ["window", "mixed", "full"])
def test_multi_turn_chat_extends_previous_turn(tiny_models, kind):
    cached, plain = _pair(str(tiny_models["qwen3"]), kind)
    tok = cached.tokenizer
    history = tok.encode("User: tell me about rivers.\nAssistant:")
    p = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0)
    prev_len = 0
    for turn in range(4):
        got = cached.generate([history], p, use_tqdm=False)[0]
        _same(got, plain.generate([history], p, use_tqdm=False)[0])
        if turn:  # the previous turn's prompt and answer are cached (up to a block)
            assert got.num_cached_tokens >= prev_len - 4, (got.num_cached_tokens, prev_len)
        prev_len = len(history) + len(got.token_ids)
        history = history + got.token_ids + tok.encode(f"\nUser: and bridge {turn}?\nAssistant:",
                                                       add_special_tokens=False)


def test_short_prompts_and_shared_system_prompt_in_one_batch(tiny_models):
    """Prompts shorter than sink + window, and a batch sharing a prefix: the later ones
    hit blocks the first one registered in earlier steps."""
    cached, plain = _pair(str(tiny_models["llama"]), "mixed", max_num_batched_tokens=8)
    tok = cached.tokenizer
    system = tok.encode("You are a careful assistant for river maps. ")
    prompts = [tok.encode("Hi"), tok.encode("Rivers"), system + [300], system + [301, 302], system + [303]]
    got = cached.generate(prompts, GREEDY, use_tqdm=False)
    for g, w in zip(got, plain.generate(prompts, GREEDY, use_tqdm=False)):
        _same(g, w)
    whole = len(system) // 4 * 4  # the system prompt's whole blocks (block_size 4)
    assert whole >= 8 and [g.num_cached_tokens for g in got[3:]] == [whole, whole]


def test_evicted_prefix_is_recomputed(tiny_models):
    """A budget for about one document: caching a second evicts (the tail of) the first,
    whose next request recomputes what was evicted and still answers the same."""
    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = mixed(shape)
    probe = KVCacheManager(lay, 4, 1 << 30, 1, torch.float32)
    per_doc = probe.kv_bytes(120) + probe.geometry.ring_bytes  # blocks + one snapshot
    opts = dict(head_layout=lay, block_size=4, dtype="float32", max_num_seqs=1,
                kv_cache_memory=probe.geometry.ring_bytes + int(1.5 * per_doc))
    cached, plain = LLM(path, **opts), LLM(path, enable_prefix_caching=False, **opts)
    tok = cached.tokenizer
    a = tok.encode("Document A about rivers and the sea. " * 20)[:110]
    b = tok.encode("Document B about towns and old bridges. " * 20)[:110]
    assert len(a) == len(b) == 110
    hits = []
    for prompt in (a, a, b, a):
        got = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
        _same(got, plain.generate([prompt], GREEDY, use_tqdm=False)[0])
        hits.append(got.num_cached_tokens)
    assert hits[0] == 0 and hits[1] == 108 and hits[2] == 0
    assert hits[3] < hits[1]  # b's blocks took a's tail (a tail is evicted before its prefix)


@pytest.mark.parametrize("kind", ["full", "mixed"])
def test_preemption_resumes_from_its_own_cached_blocks(tiny_models, kind):
    """Two sequences outgrow the pool: the later one is preempted, its blocks stay cached
    (tail evicted first), and it resumes from them; outputs equal uncached ones. (Under
    a split layout the window state it would resume from is the oldest cached page and
    goes first, so only equality is checked there.)"""
    path = str(tiny_models["llama"])
    shape = LLM(path, head_layout="full", kv_cache_memory=1 << 22).layout.shape
    lay = HeadLayout.full(shape) if kind == "full" else mixed(shape)
    geo = KVCacheManager(lay, 4, 1 << 30, 2, torch.float32).geometry
    opts = dict(head_layout=lay, block_size=4, dtype="float32", max_num_seqs=2,
                kv_cache_memory=2 * geo.ring_bytes + 24 * geo.block_bytes)
    cached, plain = LLM(path, **opts), LLM(path, enable_prefix_caching=False, **opts)
    tok = cached.tokenizer
    prompts = [tok.encode(f"Story {i} about a river and a bridge, told slowly.") for i in range(2)]
    p = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    got = cached.generate(prompts, p, use_tqdm=False)
    assert sum(o.num_preemptions for o in got) > 0
    if kind == "full":
        assert cached.engine.cache.index.stats.hits > 0  # the resumed sequence re-hit its blocks
    for g, w in zip(got, plain.generate(prompts, p, use_tqdm=False)):
        _same(g, w)


# ---- books, without a model ------------------------------------------------------------
def _step_to_prompt_end(sched, cache) -> None:
    """One engine step without a model: schedule, run the cache's copies, commit what was
    computed; a sequence whose tokens are all computed finishes there."""
    out = sched.schedule()
    cache.ops_done(cache.pop_ops())
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        cache.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            sched.finish(seq)
    cache.ops_done(cache.pop_ops())


def _check_books(cache, running):
    """Every block is free (possibly cached) or held exactly by the sequences using it."""
    pool = cache.paged.blocks
    pool.check()
    holders = [0] * pool.num_blocks
    for seq in running:
        for b in cache.paged.tables[seq.seq_id]:
            holders[b] += 1
    assert holders == pool.ref, "a block's references differ from the tables holding it"
    for h, b in cache.index.blocks.items():
        assert pool.key[b] == (PageKind.BLOCK, h)
    for h, snap in cache.index.snapshots.items():
        assert all(pool.key[b] == (PageKind.SNAPSHOT, h) for b in snap.pages)
    ring = cache.ring  # each ring slot free or held by one running sequence; none lent
    if ring.active:
        assert not ring.lent and ring.num_free + len(running) == ring.num_slots
        assert len({ring.slot_of[s.seq_id] for s in running}) == len(running)


def test_prompt_logprobs_compute_the_whole_prompt_and_share_it_after(tiny_models):
    """A request for its prompt's logprobs takes no cached prefix (a hit has no logits), is
    scored in chunks beside other requests exactly as the scoring path scores it alone, and
    leaves its blocks and window states for the requests after it."""
    cached, plain = _pair(str(tiny_models["llama"]), "mixed", max_num_batched_tokens=16)
    tok = cached.tokenizer
    doc = tok.encode("A report on rivers, bridges and the towns between them. " * 4)
    ids = doc + tok.encode(" Which town?", add_special_tokens=False)
    cached.generate([doc + [5, 6, 7]], GREEDY, use_tqdm=False)  # the document is cached now
    other = tok.encode("Something else entirely, to share the steps with.")
    scored, _ = cached.generate([ids, other], [SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3),
                                               GREEDY], use_tqdm=False)
    assert scored.num_cached_tokens == 0 and scored.prompt_logprobs[0] is None
    want = plain.engine.prompt_logprobs(ids, chunk_size=len(ids))  # [T - 1], one chunk, alone
    got = torch.tensor([scored.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for p in range(1, len(ids)):
        top = list(scored.prompt_logprobs[p].items())
        assert len(top) in (3, 4) and [v for _, v in top[:3]] == sorted((v for _, v in top[:3]), reverse=True)
        assert top[0][1] >= scored.prompt_logprobs[p][ids[p]]
    after = cached.generate([ids], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens >= len(doc) - 4  # its blocks, whole ones, serve the next request
    _same(after, plain.generate([ids], GREEDY, use_tqdm=False)[0])


@pytest.mark.parametrize("kind", ["full", "mixed", "window"])
def test_random_requests_keep_exact_books(kind):
    """Hundreds of requests sharing prefixes, finishing, aborting and preempted under a
    small budget: after every step the books are exact; at the end nothing is held."""
    shape = (2, 2, 4)
    layout = {"full": HeadLayout.full(shape), "window": HeadLayout.window(shape, 2, 4),
              "mixed": mixed(shape)}[kind]
    probe = KVCacheManager(layout, 4, 1 << 20, 4, torch.float32)
    budget = 4 * probe.geometry.ring_bytes + 30 * (probe.geometry.block_bytes or probe.geometry.ring_bytes // 2)
    cache = KVCacheManager(layout, 4, budget, 4, torch.float32, enable_prefix_caching=True)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=24)
    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    live, evictions_seen = [], False
    for step in range(1500):
        if len(live) < 6 and rng.random() < 0.4 and step < 1300:
            prompt = rng.choice(docs) + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
            seq = Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True))
            sched.add(seq)
            live.append(seq)
        before = len(cache.index.blocks)
        out = sched.schedule()
        cache.ops_done(cache.pop_ops())
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            cache.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        cache.ops_done(cache.pop_ops())
        for seq, n in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens and seq.status == SeqStatus.RUNNING:
                seq.output_token_ids.append(rng.randrange(1000))
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
        if live and rng.random() < 0.05:
            sched.abort(rng.choice(live))
        live = [s for s in live if not s.is_finished]
        evictions_seen |= len(cache.index.blocks) < before
        _check_books(cache, sched.running)
    while sched.has_unfinished():
        _step_to_prompt_end(sched, cache)
    _check_books(cache, [])
    assert cache.paged.blocks.num_free == cache.paged.blocks.num_blocks  # nothing held by anyone
    assert cache.index.stats.hits > 0
    if kind != "window":  # (window-only sequences never grow, so never preempt)
        assert evictions_seen and sched.num_preemptions > 0


def test_exact_block_ids_of_a_hit():
    """A second sequence with the same 9-token prompt shares the first one's two full
    blocks (ids 0, 1), loads its window state, and computes only the ninth token."""
    layout = mixed((2, 2, 4))
    cache = KVCacheManager(layout, 4, 1 << 16, 2, torch.float32, enable_prefix_caching=True)
    ids = list(range(100, 109))
    hit = cache.match_prefix(ids)
    assert hit.num_tokens == 0 and hit.points == [8]  # the last block boundary before the end
    cache.allocate(1, 8, hit)
    assert cache.paged.tables[1] == [0, 1]
    cache.commit(1, lambda a, b: ids[a:b], 8)
    (save,) = cache.pop_ops()
    # Snapshot pages come from the high end, away from the sequences' blocks.
    top = cache.paged.blocks.num_blocks
    assert save.save and save.ring_slot == 0 and save.pages == list(range(top - cache.snapshot_pages, top))
    cache.ops_done([save])
    cache.append(1, 9)
    cache.commit(1, lambda a, b: ids[a:b], 9)
    cache.free(1)
    hit = cache.match_prefix(ids)
    assert hit.num_tokens == 8 and hit.blocks == [0, 1]
    cache.allocate(2, 9, hit)
    (load,) = cache.pop_ops()
    assert not load.save and load.ring_slot == 1 and load.pages == save.pages
    assert cache.paged.tables[2][:2] == [0, 1] and cache.paged.blocks.ref[0] == 1
    cache.ops_done([load])
    cache.free(2)
    cache.paged.blocks.check()
    assert cache.paged.blocks.num_free == cache.paged.blocks.num_blocks


def test_snapshots_do_not_split_a_sequence_into_runs(tiny_models):
    """A chunked prefill saves window-state snapshots as it goes; their pages come from the
    top of the pool, so the sequence's own blocks stay one run that decode reads in one
    view."""
    cached, _ = _pair(str(tiny_models["llama"]), "mixed", max_num_batched_tokens=16)
    eng = cached.engine
    seq = eng.add_request(list(range(5, 205)), SamplingParams(max_tokens=4, ignore_eos=True))
    while seq.num_computed_tokens < 200:
        eng.step()
    assert len(eng.cache.index.snapshots) >= 2  # the prefill saved snapshots on the way
    assert len(eng.cache.slot_runs(seq.seq_id, seq.num_computed_tokens)) == 1
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("kind,kv_dtype", [("window", "auto"), ("mixed", "auto"), ("mixed", "int8")])
@pytest.mark.parametrize("budget", [2048, 128])
def test_snapshot_points_inside_a_chunk_do_not_cut_it(tiny_models, kind, kv_dtype, budget):
    """A 200-token document plans snapshots at 68 (TRAILING_TOKENS before its last block
    boundary) and 196. Neither cuts the prefill: in one chunk, or in chunks [0, 128) and
    [128, 200), whose second starts from a copy of the ring; the state at each point is
    saved from a scratch ring slot, and questions hitting either point answer as without
    caching (float32)."""
    cached, plain = _pair(str(tiny_models["llama"]), kind, max_num_batched_tokens=budget,
                          kv_cache_dtype=kv_dtype)
    eng = cached.engine
    doc = [5 + i % 300 for i in range(200)]
    seq = eng.add_request(doc, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        eng.step()
        steps.append(seq.num_computed_tokens)
    assert steps == ([200] if budget >= 200 else [128, 200])  # one step per budget's worth
    hashes = eng.cache.match_prefix(doc + [7]).hashes
    assert {hashes[68 // 4 - 1], hashes[196 // 4 - 1]} <= set(eng.cache.index.snapshots)
    assert eng.cache.ring.num_free == eng.cache.ring.num_slots and not eng.cache.ring.lent
    for prompt, hit in ((doc[:70] + [9, 10, 11], 68), (doc[:198] + [12, 13], 196)):
        got = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
        _same(got, plain.generate([prompt], GREEDY, use_tqdm=False)[0])
        assert got.num_cached_tokens == hit


def test_plan_chunk_lends_scratch_slots_or_cuts():
    """Points inside a chunk get a free ring slot each (a copy of the ring first when the
    chunk does not start at 0), given back at commit; without a free slot the chunk ends
    at the point instead."""
    layout = mixed((2, 2, 4))
    cache = KVCacheManager(layout, 4, 1 << 20, 2, torch.float32, enable_prefix_caching=True)
    ids = list(range(100, 300))
    toks = lambda a, b: ids[a:b]  # noqa: E731
    hit = cache.match_prefix(ids)
    assert hit.points == [68, 196]
    # Admitted, it takes one of the two slots: one is spare, for the first point inside.
    assert cache.plan_chunk(1, 0, 128, hit) == 128
    assert cache.plan_chunk(1, 0, 200, hit) == 196  # two points inside: cut at the second
    cache.allocate(1, 128, hit)
    assert cache.chunk_snapshots(1) == [(68, 1)] and cache.ring.num_free == 0
    assert cache.pop_ops() == []  # the chunk starts at 0: nothing to copy into the scratch slot
    cache.commit(1, toks, 128)
    (save,) = cache.pop_ops()
    assert save.save and save.anchor and save.ring_slot == 1  # 68: an anchor
    assert cache.ring.num_free == 1 and cache.chunk_snapshots(1) == []
    cache.ops_done([save])
    assert cache.plan_chunk(1, 128, 200) == 200
    cache.append(1, 200)
    (clone,) = cache.pop_ops()
    assert (clone.src, clone.dst) == (0, 1) and cache.chunk_snapshots(1) == [(196, 1)]
    cache.commit(1, toks, 200)
    save, rolling = cache.pop_ops()  # (the prompt is all in: the latest state, speculative)
    assert save.ring_slot == 1 and not save.anchor and cache.ring.num_free == 1  # 196: speculative
    assert rolling.ring_slot == 0 and not rolling.anchor
    cache.ops_done([save, rolling])
    assert len(cache.index.snapshots) == 3 and hit.hashes[68 // 4 - 1] in cache.index.snapshots
    # Another sequence takes the free slot: no spare left, so the first's next point cuts.
    cache.allocate(2, 8, cache.match_prefix([1] * 9))
    cache.free(1)
    hit = cache.match_prefix(list(range(500, 700)))
    assert cache.plan_chunk(3, 0, 200, hit) == 68
    cache.free(2)
    cache.paged.blocks.check()


def test_a_prompt_that_fits_only_without_its_hit_snapshot_is_still_admitted():
    """A prompt whose blocks fill the pool but for the pages of the window state it would
    load: it is admitted (those pages count for its first step only), loads the state,
    and grows into them; it is not left waiting forever."""
    layout = mixed((2, 2, 4))
    probe = KVCacheManager(layout, 4, 1 << 20, 1, torch.float32, enable_prefix_caching=True)
    budget = probe.geometry.ring_bytes + 40 * probe.geometry.block_bytes
    cache = KVCacheManager(layout, 4, budget, 1, torch.float32, enable_prefix_caching=True)
    assert cache.num_blocks == 40 and 1 < cache.snapshot_pages < 40
    sched = Scheduler(cache, max_num_seqs=1, max_num_batched_tokens=16)
    doc = list(range(100, 100 + 4 * (40 - cache.snapshot_pages)))
    first = Sequence(doc, SamplingParams(max_tokens=1, ignore_eos=True))
    second = Sequence(doc + list(range(7, 7 + 4 * cache.snapshot_pages - 8)), SamplingParams(max_tokens=1))
    assert -(-second.max_total_tokens // 4) <= 40  # it fits the pool, without a snapshot beside it
    for seq in (first, second):
        sched.add(seq)
        for _ in range(200):
            _step_to_prompt_end(sched, cache)
            if seq.is_finished:
                break
        assert seq.is_finished
    assert second.num_cached_tokens > 0  # it did start from the first one's saved state
    _check_books(cache, [])
