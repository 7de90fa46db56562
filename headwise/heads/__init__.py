"""Head classes and layouts: which class each (layer, KV head) belongs to (layout.py, the
vocabulary every package shares), and one module per class with all that class does
(base.py: the interface and registry; full.py; window.py; select.py)."""
from headwise.heads import full, select, window  # noqa: F401  (registers the built-in classes)
from headwise.heads.base import HeadClass, LayoutError, register
from headwise.heads.layout import HeadLayout, HeadSpec, resolve_layout

__all__ = ["HeadClass", "HeadLayout", "HeadSpec", "LayoutError", "register", "resolve_layout"]
