"""Head layouts shipped with headwise, keyed by model identifier."""
from __future__ import annotations

from pathlib import Path

from headwise.cache.layout import HeadLayout

_DIR = Path(__file__).parent
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.json"}


def shipped_layout(model_name: str, shape: tuple[int, int, int]) -> HeadLayout | None:
    """The calibrated layout for a known model, or None (then every head is full)."""
    fname = SHIPPED.get(model_name)
    if fname is None or not (_DIR / fname).is_file():
        return None
    layout = HeadLayout.load(_DIR / fname)
    return layout if layout.shape == shape else None
