"""The cache manager's link to the disk tier: a prefix chain that goes on on disk, entries
read back into pool pages on admission, and evicted entries copied out.

An entry is never trusted on its hash alone: before a hit uses it, its tokens and its
parent hash are compared with the prompt's (the tier has already checked its bytes
against their checksum).
"""
from __future__ import annotations

from enum import Enum

from headwise.cache.block_pool import BlockPool, PageKind
from headwise.cache.disk_tier import DiskTier, TierEntry
from headwise.cache.ops import CopyQueue, PageIn, PageOut, PrefixHit
from headwise.cache.prefix_cache import PrefixIndex, Snapshot


class Fetch(Enum):
    READY = "ready"       # every entry the hit needs is read and verified (or none was needed)
    PENDING = "pending"   # some are still being read: admit the sequence on a later step
    FAILED = "failed"     # one failed to read or verify: use what memory holds instead


class TierLink:
    def __init__(self, tier: DiskTier, index: PrefixIndex, pool: BlockPool, queue: CopyQueue,
                 block_size: int, snapshot_pages: int, root: int, has_paged_heads: bool) -> None:
        self.tier, self.index, self.pool, self.queue = tier, index, pool, queue
        self.block_size = block_size
        self.snapshot_pages = snapshot_pages
        self.root = root
        self.has_paged_heads = has_paged_heads
        index.on_evicted = self.offload

    # ---- lookups ----------------------------------------------------------------------
    def extend_chain(self, hashes: list[int], n: int, max_blocks: int) -> int:
        """How far a chain of full blocks cached up to block `n` goes on on disk."""
        while n < max_blocks and self.tier.has(PageKind.BLOCK, hashes[n]):
            n += 1
        return n

    def has_snapshot(self, key: int) -> bool:
        return self.tier.has(PageKind.SNAPSHOT, key)

    def fetch(self, hit: PrefixHit, token_ids: list[int], snapshot_on_disk: bool) -> Fetch:
        """Read what `hit` needs from disk (its blocks beyond those in memory, and its
        snapshot when that is on disk) into hit.from_disk, verified against the prompt."""
        n, bs = hit.num_tokens // self.block_size, self.block_size
        need = [(PageKind.BLOCK, h) for h in hit.hashes[len(hit.blocks):n]] if self.has_paged_heads else []
        need += [(PageKind.SNAPSHOT, hit.snapshot)] if snapshot_on_disk else []
        if not need:
            return Fetch.READY
        tier = self.tier
        got = [tier.ready(*i) for i in need]
        if any(g is None for g in got):
            tier.prefetch([i for i, g in zip(need, got) if g is None])
            got = [tier.ready(*i) for i in need]  # the host tier's are ready at once
        if any(g is None for g in got):
            return Fetch.PENDING if any(tier.is_pending(*i) for i in need) else Fetch.FAILED
        for entry, _ in got:
            i = hit.hashes.index(entry.key)
            parent = hit.hashes[i - 1] if i else self.root
            if entry.tokens != token_ids[i * bs:(i + 1) * bs] or entry.parent != parent:
                tier.drop(entry.kind, entry.key, "tokens differ from the prompt's")
                return Fetch.FAILED
        hit.from_disk = got
        return Fetch.READY

    # ---- admission --------------------------------------------------------------------
    def load(self, hit: PrefixHit) -> tuple[list[int], Snapshot | None]:
        """Take pages for the entries hit.from_disk holds, queue the copies into them and
        register them as cached again; returns the full blocks loaded and the snapshot
        read (the index's entry, its pages held), or None."""
        loaded, snap = [], None
        for entry, data in hit.from_disk:
            block = entry.kind == PageKind.BLOCK
            pages = self.pool.take(1) if block else self.pool.take(self.snapshot_pages, high=True)
            self.queue.add(PageIn(pages, data))
            if block:
                loaded += pages
                self.index.add_block(entry.key, pages[0], entry.parent, entry.tokens)
            else:
                self.index.add_snapshot(entry.key, pages, True, entry.parent, entry.tokens)
                snap = self.index.snapshots[entry.key]
            self.tier.release(entry.kind, entry.key)
        if hit.from_disk:  # tokens it would have recomputed, served from disk
            in_memory = len(hit.blocks) * self.block_size if self.has_paged_heads else 0
            self.tier.count_hit(hit.num_tokens - in_memory)
        return loaded, snap

    # ---- eviction ---------------------------------------------------------------------
    def offload(self, kind: PageKind, key: int, pages: list[int], parent: int, tokens: list[int]) -> None:
        """An evicted entry: copy its pages out to the disk tier before they are reused."""
        if not self.tier.has(kind, key):
            self.queue.add(PageOut(TierEntry(kind, key, parent, tokens), pages))
            self.tier.expect(kind, key)

    def offload_all(self) -> None:
        """Queue copies of every cached block and anchor snapshot (at shutdown: the next
        process finds them)."""
        for h, b in self.index.blocks.items():
            self.offload(PageKind.BLOCK, h, [b], *self.index.block_meta[h])
        for h, snap in self.index.snapshots.items():
            if snap.anchor:
                self.offload(PageKind.SNAPSHOT, h, snap.pages, snap.parent, snap.tokens)
