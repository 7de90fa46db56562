"""Snapshot policy: where a sequence's window-head state (its ring) is saved into pool
pages, so that a later prompt sharing the prefix resumes from it instead of recomputing.

Full heads need nothing of this: their cached blocks are the prefix. A window head's
state at a point is its whole ring (sink + window tokens), so it is saved only at points
chosen to be hit:
  - anchors: a block boundary TRAILING_TOKENS before the end of the prompt (so that the
    first follow-up question about a document, which leaves the first prompt where the
    question starts, finds a state near the document's end; for a shorter prompt, its
    end instead), and the point where the prompt left the cached prefix (a document's
    end, once its next question comes; the snapshot loaded to get there is demoted);
  - speculative (evicted first): the last block boundary before the end of the prompt
    (an exact repeat), and the latest block boundary while decoding (the next chat turn
    starts from it).
A speculative snapshot that serves a hit becomes an anchor. A point inside a prefill
chunk does not cut the chunk: a free ring slot is lent for the step as scratch, the
layers write the state at that point into it, and the commit after the step saves it.

The policy keeps no state of its own beyond each sequence's SeqBooks; it edits the
prefix index and the block pool, and queues the ring copies the runner makes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from headwise.cache.block_pool import BlockPool
from headwise.cache.ops import CopyQueue, PrefixHit, RingClone, RingCopy
from headwise.cache.prefix_cache import PrefixIndex
from headwise.cache.ring_pool import RingPool

# A snapshot this many tokens (rounded to blocks) before the end of each prompt.
TRAILING_TOKENS = 128


@dataclass
class SeqBooks:
    """The prefix-cache books of one running sequence."""
    hit: PrefixHit
    hashes: list[int]
    num_registered: int = 0
    computed: int = 0              # tokens in the cache as of the last commit
    rolling: int | None = None     # its latest decode snapshot
    saved: list[tuple[int, int]] = field(default_factory=list)  # (point, key) of its anchors
    # Points inside the chunk being computed, each with the scratch ring slot lent for it
    scratch: list[tuple[int, int]] = field(default_factory=list)


class SnapshotPolicy:
    def __init__(self, index: PrefixIndex, pool: BlockPool, ring: RingPool, queue: CopyQueue,
                 block_size: int, snapshot_pages: int, root: int) -> None:
        self.index, self.pool, self.ring, self.queue = index, pool, ring, queue
        self.block_size = block_size
        self.pages = snapshot_pages   # pool pages one snapshot takes
        self.root = root

    def plan(self, hit: PrefixHit, max_blocks: int, reach: int) -> None:
        """The points at which a new sequence with `hit` saves its state (see the module
        docstring); `reach`: how far its cached full blocks go."""
        bs = self.block_size
        end = max_blocks * bs
        trailing = end - TRAILING_TOKENS // bs * bs
        anchors = {trailing if trailing > hit.num_tokens else end, reach}
        hit.points = sorted(p for p in anchors | {end} if p > hit.num_tokens)
        hit.anchors = frozenset(anchors)
        hit.reach = reach

    def chunk_end(self, books: SeqBooks | None, hit: PrefixHit, start: int, end: int) -> int:
        """End of a prefill chunk [start, end): a point inside it with no free ring slot
        to lend ends the chunk there, so the sequence's own ring holds the state after the
        step. books: None for a sequence about to be admitted (it takes a slot first)."""
        inside = hit.points_inside(start, end)
        spare = max(0, self.ring.num_free - (books is None))
        return inside[spare] if len(inside) > spare else end

    def lend_scratch(self, seq_id: int, books: SeqBooks, end: int) -> None:
        """Lend scratch ring slots to the points inside the chunk [books.computed, end),
        holding the ring's state at the chunk's start."""
        start = books.computed
        for p in books.hit.points_inside(start, end):
            if self.ring.num_free:
                slot = self.ring.lend()
                if start:  # (before the first token the ring holds nothing to keep)
                    self.queue.add(RingClone(self.ring.slot(seq_id), slot))
                books.scratch.append((p, slot))

    def after_step(self, seq_id: int, books: SeqBooks, num_computed: int, token_ids) -> None:
        """Save the states a step reached: points inside its chunk (from their scratch
        slots, then given back), a planned point at its end, or, while decoding, the
        latest block boundary (replacing the sequence's previous rolling snapshot)."""
        for point, slot in books.scratch:
            self._save_point(books, point, slot, token_ids)
            self.ring.take_back(slot)  # the save is queued first, so the slot may be reused
        books.scratch.clear()
        bs = self.block_size
        if not self.pages or num_computed % bs or not num_computed:
            return
        if num_computed in books.hit.points:
            self._save_point(books, num_computed, self.ring.slot(seq_id), token_ids)
        elif num_computed >= books.hit.num_prompt and num_computed // bs <= len(books.hashes):
            # decoding: keep only the latest (not where the manager registers no block past
            # the prompt: layouts with select heads)
            old = self.index.snapshots.get(books.rolling)
            if old is not None and not old.anchor:  # (one that served a hit stays)
                self.index.drop_snapshot(books.rolling)
            key = books.hashes[num_computed // bs - 1]
            saved = self._save(key, False, self._meta(books, num_computed, token_ids), self.ring.slot(seq_id))
            books.rolling = key if saved else None

    def release(self, books: SeqBooks, table: list[int]) -> None:
        """Give a finished sequence's blocks back in eviction order, tail first: the
        blocks after its last snapshot, that snapshot, the blocks before it down to the
        previous snapshot, ... A snapshot saved early would otherwise be evicted long
        before the blocks it makes useful. (Its latest decode snapshot stays speculative:
        where a next chat turn starts, if memory allows, else from the end of its prompt.)"""
        for _, slot in books.scratch:  # (a clone queued into it is harmless)
            self.ring.take_back(slot)
        hi = None
        for point, key in sorted(books.saved, reverse=True):
            self.pool.release(table[point // self.block_size:hi][::-1])
            hi = point // self.block_size
            snap = self.index.snapshots.get(key)
            if snap is not None:
                self.pool.refresh(snap.pages)
        self.pool.release(table[:hi][::-1])

    def _meta(self, books: SeqBooks, point: int, token_ids) -> tuple[int, list[int]]:
        """(previous block's hash, tokens of the block ending at `point`) of a snapshot."""
        i = point // self.block_size
        return (books.hashes[i - 2] if i > 1 else self.root, token_ids(point - self.block_size, point))

    def _save_point(self, books: SeqBooks, point: int, ring_slot: int, token_ids) -> None:
        """Save the window state after `point` tokens (a planned point), held in `ring_slot`."""
        key = books.hashes[point // self.block_size - 1]
        if self._save(key, point in books.hit.anchors, self._meta(books, point, token_ids), ring_slot):
            books.saved.append((point, key))
        loaded = self.index.snapshots.get(books.hit.snapshot)
        if point == books.hit.reach and key in self.index.snapshots and loaded:
            loaded.anchor = False  # the prefix's new, longer state supersedes it
            self.pool.demote(loaded.pages)

    def _save(self, key: int, anchor: bool, meta: tuple[int, list[int]], ring_slot: int) -> bool:
        snap = self.index.snapshots.get(key)
        if snap is not None:  # another sequence saved this state already
            if anchor and not snap.anchor:
                snap.anchor = True
                self.pool.promote(snap.pages)
            return False
        # Opportunistic: never at the expense of running sequences, and a speculative
        # snapshot never evicts cached prefixes of normal priority.
        if self.pages > (self.pool.num_free if anchor else self.pool.num_spare):
            return False
        pages = self.pool.take(self.pages, high=True)
        self.index.add_snapshot(key, pages, anchor, *meta)
        self.queue.add(RingCopy(True, ring_slot, pages, anchor))
        return True
