"""Plain data the cache manager hands out: what a prefix lookup found (PrefixHit), and
the copies it asks the model runner to make between ring slots, pool pages and the disk
tier, in order (RingCopy, RingClone, PageOut, PageIn)."""
from __future__ import annotations

from dataclasses import dataclass, field

from headwise.cache.disk_tier import TierEntry


@dataclass
class RingCopy:
    """A copy the runner makes between a ring slot and snapshot pages."""
    save: bool            # True: ring slot -> pages; False: pages -> ring slot
    ring_slot: int
    pages: list[int]
    anchor: bool = True   # for saves: where the pages go once copied


@dataclass
class RingClone:
    """Copy one ring slot into another (a running sequence's state into a scratch slot)."""
    src: int
    dst: int


@dataclass
class PageOut:
    """Copy pages out to the disk tier (before they are reused)."""
    entry: TierEntry
    pages: list[int]


@dataclass
class PageIn:
    """Fill pages with bytes read from the disk tier."""
    pages: list[int]
    data: object           # uint8 tensor on the CPU, as the tier read it


@dataclass
class PrefixHit:
    """What match_prefix found for one prompt (plain data, used by the next allocate)."""
    num_tokens: int = 0                                  # cached prefix length
    hashes: list[int] = field(default_factory=list)      # the prompt's full-block hashes
    blocks: list[int] = field(default_factory=list)      # shared full-head blocks
    snapshot: int | None = None                          # window state at num_tokens
    points: list[int] = field(default_factory=list)      # planned snapshot points
    anchors: frozenset[int] = frozenset()                # points saved as anchors
    reach: int = 0                                       # how far the cached full blocks go
    num_prompt: int = 0
    # From the disk tier, read and verified: blocks after `blocks`, then maybe the snapshot.
    from_disk: list[tuple[TierEntry, object]] = field(default_factory=list)
    pending: bool = False   # its prefix is being read from disk: admit it on a later step

    def points_inside(self, start: int, end: int) -> list[int]:
        """Planned snapshot points strictly inside the prefill chunk [start, end)."""
        return [p for p in self.points if start < p < end]


class CopyQueue:
    """The copies planned since the runner last took them, in the order planned (a
    snapshot's save must run before its scratch slot is lent again)."""

    def __init__(self) -> None:
        self._ops: list[RingCopy | RingClone | PageOut | PageIn] = []

    def add(self, op: RingCopy | RingClone | PageOut | PageIn) -> None:
        self._ops.append(op)

    def pop(self) -> list[RingCopy | RingClone | PageOut | PageIn]:
        ops, self._ops = self._ops, []
        return ops
