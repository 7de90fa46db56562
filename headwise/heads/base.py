"""The head-class interface. Everything the engine must know about one class of
(layer, KV head) is a method of its HeadClass, in that class's module (heads/full.py,
heads/window.py): what a layout file says of its heads, where their K/V are stored, and
how a layer writes and attends them. Layout, geometry, storage and the attention layer
iterate over the classes a layout uses and ask these methods; none of them branches on a
class's name. A new class is a module with a HeadClass subclass, registered here.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

# Where a class keeps its heads' K/V (the cache manager's two pools):
PAGED = "paged"  # every token, in the block pool: one block holds block_size tokens of
                 # every paged head of every layer, so a sequence needs one block table
RING = "ring"    # a fixed number of tokens per sequence (ring_size), in its ring slot
STORAGES = (PAGED, RING)


class LayoutError(ValueError):
    pass


class RingKind(NamedTuple):
    """A ring class with its parameters: the model runner builds a step's ring metadata
    once per kind, not per layer, and the layers look it up by their group's kind."""
    name: str
    sink: int
    window: int


class HeadClass:
    """One head class. Subclasses set `name` and `storage` and implement what their
    storage needs (ring_size for RING classes) and `attend`."""
    name: ClassVar[str]
    storage: ClassVar[str]
    # Parameters a layout entry may give (JSON keys), each with the layout's default.
    params: ClassVar[tuple[str, ...]] = ()
    # Whether a decode-only step may attend this class through the backend's one-call
    # decode (the CPU's C kernel), which writes the new token where ring_index (paged:
    # its slot) says and attends every valid entry of the ring (paged: every token).
    # A group of a class that does not is attended by its own `attend` in that step.
    fused_decode: ClassVar[bool] = False
    # PAGED classes: whether each block keeps a key summary of the class's heads (per
    # channel min and max, [2, D] per head), counted in the block's bytes, recomputed from
    # the keys whenever a block is written (the runner's KVStorage; heads.select)
    page_summary: ClassVar[bool] = False

    # ---- layouts --------------------------------------------------------------------
    def check(self, spec) -> None:
        """Raise LayoutError when the spec's parameters are not valid for this class."""

    def ring_size(self, spec) -> int:
        """Tokens one head of this class keeps per sequence (RING classes)."""
        return 0

    def describe(self, spec) -> str:
        return self.name

    def group_key(self, spec) -> tuple:
        """Heads of one layer with equal keys are stored and attended together."""
        return tuple(getattr(spec, p) for p in self.params)

    # ---- per-step ring metadata (RING classes; built once per step and RingKind) --------
    def ring_index(self, pos, sink: int, window: int):
        """[n] ring entry that the token at each position of `pos` [n] is written to."""
        raise NotImplementedError

    def ring_writes(self, start: int, length: int, sink: int, window: int, device):
        """Rows of a prefill chunk of positions [start, start + length) that the ring
        still holds after it, and their ring entries: both [r]."""
        raise NotImplementedError

    def prefill_geometry(self, start: int, length: int, sink: int, window: int, g: int, dtype, device,
                         for_kernels: bool):
        """What the class's prefill attention reads of one chunk (ch.window[kind]);
        for_kernels: the backend reads pages in place (Triton), not band masks."""
        return None

    def rebased_tables(self, rotary, positions, sink: int, window: int):
        """Rotary tables turning queries back for re-based (StreamingLLM) positions, or
        None when the class keeps original positions."""
        return None

    # ---- the attention layer ----------------------------------------------------------
    def attend(self, layer: Any, group: Any, ctx: Any, q, kst, vst, out) -> None:
        """Write the step's K/V of `group` (a layers.attention.HeadGroup) into its cache
        and attend: q [T, n*g, D] -> out [T, n*g, D]; kst, vst: the step's K/V in their
        stored form (values [T, n, D], scales [T, n] or None)."""
        raise NotImplementedError


_REGISTRY: dict[str, HeadClass] = {}


def register(head_class: HeadClass) -> HeadClass:
    """Make a class known to layouts and the engine (by its name). Storage order within
    a layer follows registration order, then group_key."""
    if head_class.storage not in STORAGES:
        raise ValueError(f"head class {head_class.name!r}: storage must be one of {STORAGES}")
    _REGISTRY[head_class.name] = head_class
    return head_class


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def head_class(name: str) -> HeadClass | None:
    return _REGISTRY.get(name)


def class_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def order(name: str) -> int:
    """Position of a class in storage order (registration order)."""
    return list(_REGISTRY).index(name)
