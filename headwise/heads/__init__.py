"""The vocabulary every package shares: which class each (layer, KV head) belongs to."""
from headwise.heads.layout import HeadLayout, HeadSpec, LayoutError, resolve_layout

__all__ = ["HeadLayout", "HeadSpec", "LayoutError", "resolve_layout"]
