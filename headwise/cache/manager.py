"""KVCacheManager: the one door to the cache for the scheduler and the model runner.

It keeps the books of both pools (which blocks and which ring slot each sequence holds)
and of the prefix cache, splits the byte budget between them, checks both on admission,
and hands each step the plain data it needs (slot ids, block tables, ring slots, ring
copies to run). It owns no tensor: the model runner allocates the storage that
`geometry` describes and binds it into the layers.

Prefix caching (see prefix_cache): on admission `match_prefix` finds the longest prefix
of a prompt whose full-head blocks and window-head state are cached; `allocate` shares
those blocks and asks the runner to load the window state into the new ring slot. After
each step `commit` registers the sequence's newly full blocks; where window state is
saved is the snapshot policy's (cache/snapshots.py), and the disk tier is reached
through its link (cache/tier_link.py). The copies all three plan wait in one queue
(ops.CopyQueue) until the runner takes them (pop_ops).
"""
from __future__ import annotations

import torch

from headwise.cache.block_pool import BlockPool, PageKind
from headwise.cache.disk_tier import DiskTier
from headwise.cache.paged_pool import PagedPool
from headwise.cache.ops import CopyQueue, PageIn, PageOut, PrefixHit, RingClone, RingCopy
from headwise.cache.prefix_cache import PrefixIndex, block_hashes, root_hash
from headwise.cache.ring_pool import RingPool
from headwise.cache.snapshots import SeqBooks, SnapshotPolicy
from headwise.cache.spec import CacheGeometry, class_specs
from headwise.cache.tier_link import Fetch, TierLink
from headwise.heads.base import PAGED, RING
from headwise.heads.layout import HeadLayout


class CacheConfigError(ValueError):
    pass


class KVCacheManager:
    def __init__(self, layout: HeadLayout, block_size: int, kv_cache_memory: int,
                 max_num_seqs: int, dtype: torch.dtype, enable_prefix_caching: bool = False,
                 kv_cache_dtype: str = "auto", select_host_pages: bool = False,
                 select_hot_pages: int | None = None, select_host_memory: int = 0) -> None:
        """dtype: the model's compute dtype; kv_cache_dtype: how both classes store KV
        (see KV_CACHE_DTYPES), unless the layout sets a class's own.

        select_host_pages: select heads' K/V wait in host memory (engine.hot_pages);
        kv_cache_memory then budgets the device (the other heads' blocks, the rings, the
        key summaries and a hot set of select_hot_pages pages per select head, by default
        one decode step's worth for max_num_seqs sequences), and select_host_memory (0:
        no bound) the host."""
        self.layout = layout
        self.block_size = block_size
        self.geometry = CacheGeometry.from_layout(layout, block_size, *class_specs(layout, kv_cache_dtype, dtype))
        geo = self.geometry
        self.ring = RingPool(max_num_seqs, geo.ring_bytes)
        if self.ring.total_bytes > kv_cache_memory:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes cannot hold the window-head rings of "
                f"max_num_seqs={max_num_seqs} sequences ({self.ring.total_bytes} bytes); "
                "raise kv_cache_memory or lower max_num_seqs"
            )
        self.caching = enable_prefix_caching
        self.hot_pages = self._hot_pages(select_host_pages, select_hot_pages, max_num_seqs)
        # Bytes of a block on the device and in host memory (select_host_pages), and the
        # device's hot set of select pages (fixed, like the rings).
        host_block = geo.select_block_bytes if self.hot_pages else 0
        block_bytes = geo.block_bytes - host_block
        self.host_block_bytes = host_block
        fixed = self.ring.total_bytes + self.hot_pages * host_block
        # Pages of the block pool: paged-head blocks, which also hold window snapshots; a
        # layout without paged heads gets pages of one snapshot each when caching. A tier
        # page carries the whole block, wherever its parts live.
        self.page_bytes = geo.block_bytes or (geo.ring_bytes if self.caching else 0)
        num_pages = (kv_cache_memory - fixed) // (block_bytes or self.page_bytes) if self.page_bytes else 0
        if host_block and select_host_memory:
            num_pages = min(num_pages, select_host_memory // host_block)
        if block_bytes and num_pages < 1:
            raise CacheConfigError(
                f"kv_cache_memory={kv_cache_memory} bytes leaves no room for one full-head block "
                f"({block_bytes} bytes) after the rings ({self.ring.total_bytes} bytes)"
                + (f" and the select heads' hot set ({self.hot_pages * host_block} bytes)" if host_block else "")
                + (f", or select_host_memory={select_host_memory} for one block's select pages "
                   f"({host_block} bytes)" if host_block and select_host_memory else "")
            )
        pool = BlockPool(num_pages)
        self.paged = PagedPool(pool, block_size, block_bytes)
        self.pools = (self.paged, self.ring)
        self.index = PrefixIndex(pool)
        self.snapshot_pages = (-(-geo.ring_bytes // self.page_bytes)
                               if self.caching and self.ring.active and self.page_bytes else 0)
        # Different KV never shares a key: the root names the layout, dtypes, block size.
        self._root = root_hash(("headwise", layout.shape, str(dtype), geo.paged.label, geo.ring.label, block_size,
                                tuple((s.kind, s.sink, s.window) for row in layout.heads for s in row)))
        self._seqs: dict[int, SeqBooks] = {}
        self._queue = CopyQueue()
        self.snapshots = SnapshotPolicy(self.index, pool, self.ring, self._queue, block_size,
                                        self.snapshot_pages, self._root)
        self.tier: DiskTier | None = None
        self._tier_link: TierLink | None = None

    def _hot_pages(self, host: bool, hot_pages: int | None, max_num_seqs: int) -> int:
        """Pages per select head in the device's hot set (0: select pages stay in the pool;
        EngineConfig refuses the other host options without select_host_pages)."""
        if not host:
            return 0
        geo = self.geometry
        if not geo.summary_heads:
            raise CacheConfigError(f"select_host_pages: layout {self.layout.name!r} has no select heads")
        need = max_num_seqs * geo.select_step_pages
        if hot_pages is None:
            return need
        if hot_pages < need:
            raise CacheConfigError(
                f"select_hot_pages={hot_pages} cannot hold one decode step's chosen pages: max_num_seqs="
                f"{max_num_seqs} sequences x {geo.select_step_pages} pages per select head need {need}")
        return hot_pages

    def attach_tier(self, tier: DiskTier) -> None:
        """Evicted prefixes go to `tier` and hits may come back from it (prefix caching
        must be on). Its fingerprint must name this cache's root (see root)."""
        if not self.caching:
            raise CacheConfigError("a KV offload directory needs prefix caching (enable_prefix_caching=True)")
        self.tier = tier
        self._tier_link = TierLink(tier, self.index, self.paged.blocks, self._queue, self.block_size,
                                   self.snapshot_pages, self._root, self.paged.active)

    @property
    def root(self) -> int:
        """First link of the block-hash chain (names the layout, dtype and block size)."""
        return self._root

    @property
    def num_blocks(self) -> int:
        return self.paged.blocks.num_blocks

    @property
    def num_ring_slots(self) -> int:
        return self.ring.num_slots

    @property
    def has_paged_heads(self) -> bool:
        return self.paged.active

    # ---- prefix cache ---------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], use_tier: bool = True, reuse: bool = True) -> PrefixHit:
        """The longest cached prefix of a new sequence's tokens (block-aligned, leaving at
        least one token to compute) and the snapshot points planned for it. With a disk
        tier, the prefix may go on there: a hit that needs entries not yet read comes back
        `pending` (they are being read); one that fails to read or verify is dropped, and
        the prefix found in memory is used instead. reuse=False: an empty hit with its
        snapshot points planned, for a request that computes its whole prompt (its
        prompt's logprobs); its blocks and window states are offered to later ones."""
        P, bs = len(token_ids), self.block_size
        if not self.caching:
            return PrefixHit(num_prompt=P)
        max_blocks = (P - 1) // bs
        hashes = block_hashes(self._root, token_ids[: max_blocks * bs], bs)
        blocks = self.index.cached_blocks(hashes) if self.paged.active and reuse else []
        n = len(blocks) if self.paged.active or not reuse else max_blocks
        link = self._tier_link if use_tier and reuse else None
        if link is not None and self.paged.active:  # the chain may go on in the disk tier
            n = link.extend_chain(hashes, n, max_blocks)
        reach = n * bs  # how far the cached full blocks go
        snapshot, snap_on_disk = None, False
        if self.snapshot_pages:  # window heads: the latest saved state within the reach
            while n and hashes[n - 1] not in self.index.snapshots:
                if link is not None and link.has_snapshot(hashes[n - 1]):
                    snap_on_disk = True
                    break
                n -= 1
            snapshot = hashes[n - 1] if n else None
        hit = PrefixHit(n * bs, hashes, blocks[:n], snapshot, num_prompt=P)
        if link is not None:
            fetched = link.fetch(hit, token_ids, snap_on_disk)
            if fetched is Fetch.PENDING:
                hit.pending = True
                return hit
            if fetched is Fetch.FAILED:
                return self.match_prefix(token_ids, use_tier=False)
        if self.snapshot_pages:
            self.snapshots.plan(hit, max_blocks, reach)
        return hit

    def plan_chunk(self, seq_id: int, start: int, end: int, hit: PrefixHit | None = None) -> int:
        """End of a sequence's next prefill chunk [start, end) (`hit`: a sequence about to
        be admitted with it). Window state at a planned snapshot point inside the chunk is
        written by the layers into a free ring slot lent for the step (lent by append or
        allocate, see chunk_snapshots) and saved from there at commit; where no free slot
        is left for a point, the chunk ends at that point instead, so that the sequence's
        own ring holds the state after the step."""
        books = self._seqs.get(seq_id)
        hit = hit or (books.hit if books else None)
        return end if hit is None else self.snapshots.chunk_end(books, hit, start, end)

    def chunk_snapshots(self, seq_id: int) -> list[tuple[int, int]]:
        """(point, scratch ring slot) of the snapshot points inside the sequence's chunk of
        this step: its layers write the window state at each point into the slot."""
        books = self._seqs.get(seq_id)
        return list(books.scratch) if books else []

    def commit(self, seq_id: int, token_ids, num_computed: int) -> None:
        """After a step: `num_computed` tokens of the sequence are in the cache.
        token_ids(start, end) gives its tokens. Registers its newly full blocks and saves
        its window state where planned."""
        books = self._seqs.get(seq_id)
        if books is None:
            return
        bs = self.block_size
        # Blocks past the prompt hold K/V that select heads' decode computed with page
        # selection, which a later prompt computing them afresh would not: they are not
        # offered to other requests (the prefix cache equals computing from scratch).
        upto = min(num_computed, books.hit.num_prompt) if self.geometry.summary_heads else num_computed
        nfull = upto // bs
        h, done = books.hashes, books.num_registered
        if nfull > done:
            toks = token_ids(done * bs, nfull * bs)
            h += block_hashes(self._root, toks, bs, h[-1] if h else None)
            if self.paged.active:
                table = self.paged.tables[seq_id]
                for i in range(done, nfull):
                    self.index.add_block(h[i], table[i], h[i - 1] if i else self._root,
                                         toks[(i - done) * bs:(i - done + 1) * bs])
            books.num_registered = nfull
        books.computed = num_computed
        self.snapshots.after_step(seq_id, books, num_computed, token_ids)

    def pop_ops(self) -> list[RingCopy | RingClone | PageOut | PageIn]:
        """Copies for the runner to make now, in order; pass them to ops_done afterwards."""
        return self._queue.pop()

    def ops_done(self, ops: list) -> None:
        for op in ops:
            if isinstance(op, RingCopy):
                self.paged.blocks.release(op.pages, low=op.save and not op.anchor)

    def offload_all(self) -> None:
        """Queue copies of every cached block and anchor snapshot to the disk tier (at
        shutdown: the next process finds them)."""
        if self._tier_link is not None:
            self._tier_link.offload_all()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running sequences keep their KV); returns the
        number of pages that held one."""
        for books in self._seqs.values():
            books.rolling = None
        return self.index.clear()

    # ---- admission and growth (both pools) ----------------------------------------
    def pages_to_grow(self, seq_id: int, num_tokens: int) -> int:
        """Pages a running sequence still has to take to hold `num_tokens` tokens."""
        return self.paged.to_grow(seq_id, num_tokens)

    def can_allocate(self, num_tokens: int, hit: PrefixHit | None = None, reserved: int = 0,
                     num_prompt: int = 0) -> bool:
        """Room for a new sequence holding `num_tokens` tokens after its first step (its
        cached prefix included), and for it to grow to `num_prompt` tokens beside
        `reserved` pages that running sequences are still to take. The pages of a window
        state it loads count for the first step only: they are free again once loaded."""
        if not self.ring.can_allocate(num_tokens):
            return False
        hit = hit or PrefixHit()
        snap = self.index.snapshots.get(hit.snapshot) if hit.snapshot is not None else None
        if snap is not None:  # held while its state is loaded: idle pages leave the free queues
            extra = sum(self.paged.blocks.is_free(b) for b in snap.pages)
        else:  # read from disk into new pages, or no window state to load
            extra = self.snapshot_pages if hit.snapshot is not None else 0
        return (self.paged.can_allocate(num_tokens, hit.blocks, extra)
                and self.paged.can_allocate(max(num_tokens, num_prompt), hit.blocks, reserved))

    def allocate(self, seq_id: int, num_tokens: int, hit: PrefixHit | None = None) -> None:
        hit = hit or PrefixHit()
        pool = self.paged.blocks
        snap = self.index.snapshots.get(hit.snapshot) if hit.snapshot is not None else None
        # What the hit shares is held before any page is taken, which could evict it.
        pool.touch(hit.blocks)
        if snap is not None:
            snap.anchor = True  # it serves a hit: no longer speculative
            pool.touch(snap.pages)
        if hit.from_disk:  # into new pages, registered as cached again
            loaded, from_disk = self._tier_link.load(hit)
            snap = snap or from_disk
        else:
            loaded = []
        self.paged.allocate(seq_id, num_tokens, hit.blocks + loaded)
        self.ring.allocate(seq_id, num_tokens)
        if snap is not None:
            self._queue.add(RingCopy(False, self.ring.slot(seq_id), snap.pages))
        if self.caching and hit.num_prompt:
            self.index.stats.queries += hit.num_prompt
            self.index.stats.hits += hit.num_tokens
            n = hit.num_tokens // self.block_size
            books = self._seqs[seq_id] = SeqBooks(hit, hit.hashes[:n], num_registered=n,
                                                  computed=hit.num_tokens)
            self.snapshots.lend_scratch(seq_id, books, num_tokens)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return all(p.can_append(seq_id, num_tokens) for p in self.pools)

    def append(self, seq_id: int, num_tokens: int) -> None:
        for p in self.pools:
            p.append(seq_id, num_tokens)
        books = self._seqs.get(seq_id)
        if books is not None:
            self.snapshots.lend_scratch(seq_id, books, num_tokens)

    def free(self, seq_id: int) -> None:
        books = self._seqs.pop(seq_id, None)
        self.ring.free(seq_id)
        if books is None:
            self.paged.free(seq_id)
        else:
            self.snapshots.release(books, self.paged.pop(seq_id))

    def max_tokens_per_seq(self) -> int:
        return self.paged.max_tokens()

    # ---- what a step needs, as plain data ------------------------------------------
    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Paged-pool flat slots (block * block_size + offset) of positions [start, end)."""
        return self.paged.slots(seq_id, start, end)

    def block_table(self, seq_id: int) -> list[int]:
        return self.paged.block_table(seq_id)

    def slot_runs(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Positions [0, num_tokens) as (first flat slot, length) runs of adjacent slots."""
        return self.paged.slot_runs(seq_id, num_tokens)

    def ring_slot(self, seq_id: int) -> int:
        return self.ring.slot(seq_id)

    # ---- accounting ---------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens occupies under this layout."""
        return sum(p.bytes_for(num_tokens) for p in self.pools)

    def max_concurrency(self, num_tokens: int) -> int:
        """Sequences of `num_tokens` tokens that fit at once."""
        by_ring = self.ring.num_slots if self.ring.active else 1 << 62
        per = self.paged.bytes_for(num_tokens)
        by_paged = self.paged.total_bytes // per if per else 1 << 62
        return min(by_ring, by_paged)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per storage kind ("paged": the block pool of full and select heads; "ring": the
        window heads' rings; "host": select heads' pages in host memory, when they wait
        there): bytes held by running sequences, in total, and (prefix caching) held by
        cached prefixes nobody uses, which count as free (ring snapshots are cached in
        the block pool's pages)."""
        cached = self.paged.blocks.cached_free
        out = {}
        for name, p, kind in ((PAGED, self.paged, PageKind.BLOCK), (RING, self.ring, PageKind.SNAPSHOT)):
            total = p.total_bytes
            out[name] = {"used_bytes": p.used_bytes, "total_bytes": total,
                         "usage": p.used_bytes / total if total else 0.0,
                         "cached_bytes": cached[kind] * (p.block_bytes if p is self.paged else self.page_bytes)}
        if self.host_block_bytes:
            blocks, per = self.paged.blocks, self.host_block_bytes
            used, total = (blocks.num_blocks - blocks.num_free) * per, blocks.num_blocks * per
            out["host"] = {"used_bytes": used, "total_bytes": total, "usage": used / total,
                           "cached_bytes": cached[PageKind.BLOCK] * self.host_block_bytes}
        return out
