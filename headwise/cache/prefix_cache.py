"""Books of the prefix cache: which token prefixes have their KV in the pool.

Full heads: block i of a token sequence is identified by a chained hash covering every
token up to the end of block i (and a root that names the layout, dtype and block size,
so different KV never shares a key). A full block registered here can be shared by any
sequence whose prompt starts with the same tokens; it stays cached after its sequence
ends, until the block pool hands its page out again (LRU).

Window heads: their state at L tokens (sink tokens and the last `window` tokens before
L, for every window head) cannot be shared in place, since each running sequence owns a
ring that keeps rotating. It is saved instead as a snapshot: a copy of a ring slot taken
when a sequence has computed exactly L tokens (L a multiple of the block size), stored
in pages of the same pool and keyed by the hash of block L / block_size - 1. A prefix of
L tokens is a hit when the full blocks covering [0, L) and the snapshot at L are cached.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Callable, Hashable

from headwise.cache.block_pool import BlockPool, PageKey, PageKind


def root_hash(root: Hashable) -> int:
    """The chain's first link, from a description of what the KV is (layout, dtype, ...)."""
    return int.from_bytes(hashlib.blake2b(repr(root).encode(), digest_size=8).digest(), "little")


def block_hashes(root: int, token_ids: list[int], block_size: int, prev: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, which start at a block boundary
    right after the block hashed `prev` (None: at the start of the sequence, after
    `root`). blake2b, not hash(): keys must be the same in every process (disk tier)."""
    out = []
    h = root if prev is None else prev
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(array("q", token_ids[i:i + block_size]).tobytes())
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


@dataclass
class Snapshot:
    pages: list[int]
    anchor: bool          # False: speculative (evicted before everything else)
    parent: int = 0       # (for the disk tier) hash of the block before its last one,
    tokens: list[int] = field(default_factory=list)  # and its last block's tokens


@dataclass
class PrefixStats:
    queries: int = 0      # prompt tokens looked up
    hits: int = 0         # of those, tokens found cached


@dataclass
class PrefixIndex:
    """hash -> cached full block, hash -> window-state snapshot; kept in step with the
    block pool's evictions (see BlockPool.on_evict)."""
    pool: BlockPool
    blocks: dict[int, int] = field(default_factory=dict)
    # hash -> (previous block's hash, the block's tokens): what a disk copy stores
    block_meta: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    stats: PrefixStats = field(default_factory=PrefixStats)
    # Told (kind, hash, pages, parent, tokens) when an entry is evicted, before its pages
    # are overwritten (the disk tier copies them out); None: evictions are dropped.
    on_evicted: Callable[[str, int, list[int], int, list[int]], None] | None = None

    def __post_init__(self) -> None:
        self.pool.on_evict = self._on_evict

    def _on_evict(self, key: PageKey) -> None:
        kind, h = key
        if kind == PageKind.BLOCK:
            b = self.blocks.pop(h, None)
            parent, tokens = self.block_meta.pop(h, (0, []))
            if b is not None and self.on_evicted is not None:
                self.on_evicted(PageKind.BLOCK, h, [b], parent, tokens)
        else:  # one page of a snapshot was reused: the snapshot is gone
            snap = self.snapshots.pop(h, None)
            if snap is not None:
                for b in snap.pages:
                    if self.pool.key[b] == key:
                        self.pool.set_key(b, None)
                if self.on_evicted is not None and snap.anchor:  # speculative ones are not kept
                    self.on_evicted(PageKind.SNAPSHOT, h, snap.pages, snap.parent, snap.tokens)

    def add_block(self, h: int, b: int, parent: int = 0, tokens: list[int] | None = None) -> None:
        """Register block b as holding the tokens hashed by h (first writer wins)."""
        if h not in self.blocks and self.pool.key[b] is None:
            self.blocks[h] = b
            self.block_meta[h] = (parent, tokens or [])
            self.pool.set_key(b, (PageKind.BLOCK, h))

    def cached_blocks(self, hashes: list[int]) -> list[int]:
        """The longest run of leading blocks that are cached."""
        out = []
        for h in hashes:
            b = self.blocks.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def add_snapshot(self, h: int, pages: list[int], anchor: bool, parent: int = 0,
                     tokens: list[int] | None = None) -> None:
        for b in pages:
            self.pool.set_key(b, (PageKind.SNAPSHOT, h))
        self.snapshots[h] = Snapshot(pages, anchor, parent, tokens or [])

    def drop_snapshot(self, h: int) -> None:
        """Forget a snapshot (superseded); its free pages hold nothing any more."""
        snap = self.snapshots.pop(h, None)
        if snap is not None:
            for b in snap.pages:
                self.pool.set_key(b, None)

    def clear(self) -> int:
        """Forget every cached prefix; returns how many pages were freed of their keys."""
        n = 0
        for b in list(self.blocks.values()) + [b for s in self.snapshots.values() for b in s.pages]:
            if self.pool.key[b] is not None:
                self.pool.set_key(b, None)
                n += 1
        self.blocks.clear()
        self.block_meta.clear()
        self.snapshots.clear()
        return n
