"""Scheduler unit tests: plain bookkeeping, no model."""
import pytest
import torch

from headwise.heads.layout import HeadLayout
from headwise.cache.manager import KVCacheManager
from headwise.engine.scheduler import QueueFullError, RequestTooLargeError, Scheduler
from headwise.engine.sequence import Sequence, SeqStatus
from headwise.sampling import SamplingParams


def _cache(num_blocks, block_size=4, layout=None, max_num_seqs=8):
    layout = layout or HeadLayout.full((1, 1, 2))
    block = 2 * layout.num_layers * layout.num_kv_heads * block_size * 2 * 4
    return KVCacheManager(layout, block_size, num_blocks * block, max_num_seqs, torch.float32)


def _seq(n, max_tokens=4):
    return Sequence(list(range(n)), SamplingParams(max_tokens=max_tokens))


def _advance(out, token=7):
    """What the engine does after running a step: count computed tokens, sample."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)


def test_chunked_prefill_under_token_budget_then_decode():
    s = Scheduler(_cache(16), max_num_seqs=4, max_num_batched_tokens=6)
    a, b = _seq(10), _seq(3)
    s.add(a), s.add(b)
    out = s.schedule()
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(a.seq_id, 6)]
    _advance(out)
    out = s.schedule()  # a finishes its prompt (4), b gets the remaining 2 of budget
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(a.seq_id, 4), (b.seq_id, 2)]
    _advance(out)
    out = s.schedule()  # a decodes one token, b finishes its prompt
    assert [(q.seq_id, n) for q, n in out.scheduled] == [(a.seq_id, 1), (b.seq_id, 1)]


def test_fcfs_and_max_num_seqs():
    s = Scheduler(_cache(64), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(2) for _ in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q for q, _ in out.scheduled] == seqs[:2]
    assert list(s.waiting) == [seqs[2]]


def test_preempts_most_recent_and_recomputes():
    cache = _cache(4)  # 16 token slots
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(8, max_tokens=8), _seq(8, max_tokens=8)
    s.add(a), s.add(b)
    _advance(s.schedule())  # both prefilled: 2 blocks each, pool full
    assert cache.paged.blocks.num_free == 0
    out = s.schedule()      # a needs a 3rd block -> b (admitted last) is preempted
    assert out.preempted == [b]
    assert [q for q, _ in out.scheduled] == [a]
    assert b.status == SeqStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.num_preemptions == 1
    assert cache.paged.tables[a.seq_id] == [0, 1, 3]  # b freed tail first: its block 3
    s.finish(a)
    out = s.schedule()      # b comes back with prompt + generated token recomputed
    assert out.scheduled == [(b, 9)]


def test_admits_a_prompt_only_when_all_of_it_fits():
    """A request whose first chunk would fit but not its whole prompt waits (FCFS: so do
    those behind it): admitted, it would be preempted part way through its prefill and
    compute it again, over and over, while the running one grows."""
    cache = _cache(8)  # 8 blocks of 4 tokens
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=8)
    a, b, c = _seq(12, max_tokens=6), _seq(24, max_tokens=1), _seq(4, max_tokens=1)
    s.add(a)
    _advance(s.schedule())  # a: 8 of its 12 prompt tokens
    s.add(b), s.add(c)
    out = s.schedule()  # a's last 4; b's first 4 would fit (1 block), all 24 (6) not beside a's 3
    assert out.scheduled == [(a, 4)] and list(s.waiting) == [b, c]
    while not a.is_finished:
        _advance(out)
        if len(a.output_token_ids) >= a.params.max_tokens:
            s.finish(a)
        out = s.schedule()
        assert not out.preempted
    assert [q for q, _ in out.scheduled] == [b] and s.num_preemptions == 0


def test_request_that_can_never_fit_fails_clearly():
    s = Scheduler(_cache(2), max_num_seqs=4, max_num_batched_tokens=100)
    with pytest.raises(RequestTooLargeError, match="holds at most 8 tokens"):
        s.add(_seq(6, max_tokens=4))


def test_abort_frees_at_once_and_queue_limit():
    cache = _cache(8)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=100, max_queue=1)
    a = _seq(5)
    s.add(a)
    s.schedule()
    assert cache.paged.blocks.num_free == 6
    s.abort(a)
    assert cache.paged.blocks.num_free == 8 and not s.has_unfinished()
    assert a.finish_reason == "abort"
    s.add(_seq(2))
    with pytest.raises(QueueFullError):
        s.add(_seq(2))


def test_admission_checks_ring_pool_too():
    cache = _cache(64, layout=HeadLayout.window((1, 1, 2), 2, 2), max_num_seqs=2)
    # ring pool has 2 slots even though max_num_seqs of the scheduler is larger
    s = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [_seq(3) for _ in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q for q, _ in out.scheduled] == seqs[:2]
