"""Head layouts shipped with headwise, keyed by model identifier."""
from __future__ import annotations

from pathlib import Path

from headwise.heads.layout import HeadLayout, HeadSpec, LayoutError
from headwise.models.config import ModelConfig

_DIR = Path(__file__).parent
# Qwen2.5-Coder-1.5B: 80% of KV heads full, equal to full attention on the quality suite at
# 4K, 8K and 16K, three seeds per depth (docs/quality.md).
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct-gates-33-w1024.json",
           "Qwen2.5-Coder-1.5B-Instruct": "qwen2.5-coder-1.5b-instruct-gates-80-w1024.json"}
# Layouts with select heads (heads/select.py), calibrated from the shipped ones; opt-in
# (`--head-layout`, the benchmarks' `headwise-select`) until the quality suite says more.
SHIPPED_SELECT = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct-gates-33-w1024-select1024.json"}


def shipped_layout(model_name: str, shape: tuple[int, int, int], select: bool = False) -> HeadLayout | None:
    """The calibrated layout for a known model (with select heads: `select`), or None
    (then every head is full)."""
    fname = (SHIPPED_SELECT if select else SHIPPED).get(model_name)
    if fname is None or not (_DIR / fname).is_file():
        return None
    layout = HeadLayout.load(_DIR / fname)
    return layout if layout.shape == shape else None


def native_layout(cfg: ModelConfig) -> HeadLayout | None:
    """For a model with sliding-window layers (Gemma 3): their KV heads are window heads
    with sink 0 and the model's window, every other head full; what the model was trained
    to compute. None for a model without such layers."""
    sliding = set(cfg.sliding_layers)
    if not sliding:
        return None
    win, full = HeadSpec("window", 0, cfg.sliding_window), HeadSpec("full")
    heads = [[win if l in sliding else full] * cfg.num_kv_heads for l in range(cfg.num_layers)]
    return HeadLayout("native", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, heads, model=cfg.name)


def check_native_windows(layout: HeadLayout, cfg: ModelConfig) -> None:
    """A layout must keep a sliding-window layer's heads as the model was trained: window
    heads, sink 0, the model's window. Anything else (`full` included) computes a function
    the model never learned, so it is refused rather than run with a warning."""
    if not cfg.sliding_layers:
        return
    want = HeadSpec("window", 0, cfg.sliding_window)
    for l in cfg.sliding_layers:
        bad = [h for h, s in enumerate(layout.heads[l]) if s != want]
        if bad:
            raise LayoutError(
                f"head layout {layout.name!r} makes layer {l} KV head {bad[0]} of {cfg.name} "
                f"{layout.heads[l][bad[0]]}, but that layer attends through a "
                f"{cfg.sliding_window}-token sliding window as trained; a layout must keep its "
                f"heads window heads with sink 0 and window {cfg.sliding_window} (the native "
                f"layout, the default for this model, does; `full` is not this model's function)")
