"""Continuous batching over request and cache bookkeeping (no tensors, no model).

Each step spends a token budget: running requests first (one decode token, or the next
prefill chunk), then waiting requests in arrival order while every cache pool admits
them. A waiting request whose prompt starts with a cached prefix skips it: only the
tokens after it are computed and budgeted. The cache manager may end a prefill chunk
early, at a point where it plans to save window-head state and has no scratch ring slot
for it (plan_chunk). When the full-head pool cannot grow a
running request, the most recently admitted request is preempted: its KV is freed (its
full blocks stay cached) and it is recomputed later from its tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from headwise.engine.sequence import Sequence, SeqStatus


class RequestTooLargeError(ValueError):
    pass


class QueueFullError(RuntimeError):
    pass


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num new tokens)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, cache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_queue: int | None = None) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        cap = self.cache.max_tokens_per_seq()
        if seq.max_total_tokens > cap:
            raise RequestTooLargeError(
                f"request needs KV for {seq.num_prompt_tokens} prompt + {seq.params.max_tokens} "
                f"new tokens = {seq.max_total_tokens}, but the KV cache holds at most {cap} tokens "
                "per sequence; raise kv_cache_memory or shorten the request"
            )
        if self.max_queue is not None and len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"waiting queue is full ({self.max_queue} requests)")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop a request at any moment; its KV is freed at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            n = self.cache.plan_chunk(seq.seq_id, start, start + n) - start
            target = start + n
            while not self.cache.can_append(seq.seq_id, target):
                victim = self.running[-1]  # most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break  # seq itself was preempted; everything after it too
            self.cache.append(seq.seq_id, target)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        # Admit waiting requests in arrival order; none while we are preempting. One whose
        # cached prefix is still being read from disk is passed over until it is in. A
        # request is admitted only when its whole prompt fits beside what the running
        # ones still need to finish theirs: admitted on its first chunk alone, it would be
        # preempted part way through its prefill, and its next admission would redo it
        # (window heads resume only from a saved snapshot), over and over.
        reserved = sum(self.cache.pages_to_grow(s.seq_id, s.num_tokens) for s in self.running)
        i = 0
        while (i < len(self.waiting) and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[i]
            # A cached prefix is not computed again: the step starts after it (unless the
            # request wants the prompt's logprobs, which need its logits).
            hit = self.cache.match_prefix(seq.token_ids(0, seq.num_tokens),
                                          reuse=seq.params.prompt_logprobs is None)
            if hit.pending:
                i += 1
                continue
            start = hit.num_tokens
            n = min(seq.num_tokens - start, budget)
            n = self.cache.plan_chunk(seq.seq_id, start, start + n, hit) - start
            if not self.cache.can_allocate(start + n, hit, reserved, seq.num_tokens):
                break
            del self.waiting[i]
            self.cache.allocate(seq.seq_id, start + n, hit)
            reserved += self.cache.pages_to_grow(seq.seq_id, seq.num_tokens)
            seq.num_computed_tokens = start
            if seq.num_cached_tokens is None:  # what the client is told: its first admission
                seq.num_cached_tokens = start
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out
