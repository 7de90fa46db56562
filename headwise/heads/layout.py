"""Head layouts: the head class of every (layer, KV head): `full` (every token),
`window` (sink + recent window) or `select` (every token kept, a budget of pages attended).

File format (JSON, version 2):
    {"format": "headwise-head-layout", "version": 2, "model": "<id>",
     "num_layers": L, "num_kv_heads": H, "head_dim": D,
     "sink": 64, "window": 256, "budget": 2048,   # budget: only with select heads
     "heads": [["full", "window", {"class": "window", "sink": 32, "window": 512}, "select"], ...],
     "kv_dtype": {"paged": "int8", "ring": "bfloat16"},  # optional, per storage kind
     "scores": [[...], ...]}          # optional, per-head calibration scores
A head given as a bare string uses the file's default parameters. `kv_dtype` sets the KV
cache dtype of a storage kind (the block pool of the paged classes, full and select; the
rings of the window class), overriding the engine's kv_cache_dtype option for it; files
written before select heads existed name them "full" and "window", which still load.
Version 1 files (no kv_dtype) still load. The classes are those registered in
headwise.heads.base (heads/full.py, heads/window.py, heads/select.py); each checks its own parameters.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwise.heads import base
from headwise.heads.base import LayoutError

FORMAT = "headwise-head-layout"
VERSION = 2
READABLE_VERSIONS = (1, 2)
DEFAULT_SINK = 64
DEFAULT_WINDOW = 256
# Tokens a `select` head attends per decode step (sink and recent window included).
DEFAULT_BUDGET = 2048
DEFAULTS = {"sink": DEFAULT_SINK, "window": DEFAULT_WINDOW, "budget": DEFAULT_BUDGET}
# A layout's kv_dtype sets the dtype of each storage kind's pool: "paged" (the block pool)
# and "ring". Older files named them by their first class, "full" and "window".
KV_DTYPE_KEYS = base.STORAGES
_OLD_KV_DTYPE_KEYS = {"full": base.PAGED, "window": base.RING}
# KV cache dtypes, by the names options and layout files use. "auto": the compute dtype;
# int8 and fp8_e4m3 store one scale per token and head beside the values.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3")


def kv_dtypes(kv_dtype: dict[str, str] | None, name: str = "") -> dict[str, str] | None:
    """A layout's kv_dtype checked and keyed by storage kind (old class-name keys renamed)."""
    if kv_dtype is None:
        return None
    out: dict[str, str] = {}
    for key, dt in kv_dtype.items():
        kind = _OLD_KV_DTYPE_KEYS.get(key, key)
        if kind not in KV_DTYPE_KEYS or dt not in KV_CACHE_DTYPES:
            raise LayoutError(f"layout {name!r}: kv_dtype maps {KV_DTYPE_KEYS} to one of "
                              f"{KV_CACHE_DTYPES}, got {key!r}: {dt!r}")
        if kind in out:
            raise LayoutError(f"layout {name!r}: kv_dtype sets {kind!r} twice (as {key!r} too)")
        out[kind] = dt
    return out


@dataclass(frozen=True)
class HeadSpec:
    kind: str              # a registered head class: "full", "window", ...
    sink: int = DEFAULT_SINK     # parameters; a class reads those it names (HeadClass.params)
    window: int = DEFAULT_WINDOW
    budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if self.head_class is None:
            raise LayoutError(f"unknown head class {self.kind!r}; expected one of {base.class_names()}")
        # Parameters the class does not have take their defaults, so that equal heads
        # compare (and hash into prefix-cache keys) equal.
        for p, default in DEFAULTS.items():
            if p not in self.head_class.params:
                object.__setattr__(self, p, default)
        self.head_class.check(self)

    @property
    def head_class(self) -> base.HeadClass | None:
        return base.head_class(self.kind)

    def __str__(self) -> str:
        return self.head_class.describe(self)

    @property
    def ring_size(self) -> int:
        """Tokens a head of a ring class keeps per sequence (0 for paged classes)."""
        return self.head_class.ring_size(self)

    @property
    def paged(self) -> bool:
        return self.head_class.storage == base.PAGED

    @property
    def group_key(self) -> tuple:
        """Heads of one layer with equal keys are stored and attended together, in this
        order: paged classes first, then by registration, then by parameters."""
        return (not self.paged, base.order(self.kind), self.head_class.group_key(self))


@dataclass
class HeadLayout:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    heads: list[list[HeadSpec]]     # [layer][kv_head]
    model: str = ""
    scores: list[list[float]] | None = None
    kv_dtype: dict[str, str] | None = None  # storage kind -> KV cache dtype (overrides the option)

    def __post_init__(self) -> None:
        self.kv_dtype = kv_dtypes(self.kv_dtype, self.name)
        if len(self.heads) != self.num_layers or any(len(r) != self.num_kv_heads for r in self.heads):
            raise LayoutError(
                f"layout {self.name!r} lists {len(self.heads)} layers x "
                f"{[len(r) for r in self.heads][:3]}... heads, expected {self.num_layers} x {self.num_kv_heads}"
            )

    # ---- construction -------------------------------------------------------------
    @classmethod
    def uniform(cls, name: str, shape: tuple[int, int, int], spec: HeadSpec, model: str = "") -> "HeadLayout":
        L, H, D = shape
        return cls(name, L, H, D, [[spec] * H for _ in range(L)], model=model)

    @classmethod
    def full(cls, shape: tuple[int, int, int], model: str = "") -> "HeadLayout":
        return cls.uniform("full", shape, HeadSpec("full"), model)

    @classmethod
    def window(cls, shape: tuple[int, int, int], sink: int = DEFAULT_SINK,
               window: int = DEFAULT_WINDOW, model: str = "") -> "HeadLayout":
        return cls.uniform("window", shape, HeadSpec("window", sink, window), model)

    @classmethod
    def from_full_set(cls, name: str, shape: tuple[int, int, int], full: set[tuple[int, int]],
                      sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW, model: str = "",
                      scores: list[list[float]] | None = None) -> "HeadLayout":
        L, H, D = shape
        heads = [[HeadSpec("full") if (l, h) in full else HeadSpec("window", sink, window)
                  for h in range(H)] for l in range(L)]
        return cls(name, L, H, D, heads, model=model, scores=scores)

    @classmethod
    def random(cls, shape: tuple[int, int, int], full_fraction: float, seed: int = 0,
               sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW, model: str = "") -> "HeadLayout":
        L, H, _ = shape
        pairs = [(l, h) for l in range(L) for h in range(H)]
        k = int(full_fraction * len(pairs))
        chosen = set(random.Random(seed).sample(pairs, k))
        return cls.from_full_set(f"random-{full_fraction:g}", shape, chosen, sink, window, model)

    # ---- queries ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    def num_paged(self, layer: int) -> int:
        """KV heads of a layer that keep every token (paged classes)."""
        return sum(s.paged for s in self.heads[layer])

    def class_counts(self) -> dict[str, int]:
        """KV heads of each class, in registration order."""
        kinds = [s.kind for r in self.heads for s in r]
        return {c: kinds.count(c) for c in base.class_names() if c in kinds}

    @property
    def summary(self) -> str:
        """e.g. "13 full, 17 select, 60 window of 90 KV heads"."""
        counts = self.class_counts()
        return f"{', '.join(f'{n} {c}' for c, n in counts.items())} of {sum(counts.values())} KV heads"

    @property
    def full_fraction(self) -> float:
        """Share of KV heads that keep every token (paged classes: full and select)."""
        return sum(self.num_paged(l) for l in range(self.num_layers)) / (self.num_layers * self.num_kv_heads)

    def head_order(self, layer: int) -> list[int]:
        """KV heads of a layer in storage order (HeadSpec.group_key, then head index):
        paged heads first, so every group of a class and parameters is contiguous."""
        row = self.heads[layer]
        return sorted(range(len(row)), key=lambda h: (row[h].group_key, h))

    def check_shape(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        if self.shape != (num_layers, num_kv_heads, head_dim):
            raise LayoutError(
                f"head layout {self.name!r} was made for a model with (layers, kv_heads, head_dim)="
                f"{self.shape} (model {self.model or 'unknown'!r}), but this model has "
                f"{(num_layers, num_kv_heads, head_dim)}"
            )

    # ---- files --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        used = {p for r in self.heads for s in r for p in s.head_class.params}
        defaults = {p: self._default(p, DEFAULTS[p]) for p in DEFAULTS}

        def enc(s: HeadSpec):
            params = {p: getattr(s, p) for p in s.head_class.params}
            if all(v == defaults[p] for p, v in params.items()):
                return s.kind
            return {"class": s.kind, **params}

        d: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "model": self.model, "name": self.name,
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "sink": self.default_sink, "window": self.default_window,
            **({"budget": defaults["budget"]} if "budget" in used else {}),
            "heads": [[enc(s) for s in row] for row in self.heads],
        }
        if self.kv_dtype:
            d["kv_dtype"] = kv_dtypes(self.kv_dtype, self.name)
        if self.scores is not None:
            d["scores"] = self.scores
        return d

    @property
    def default_sink(self) -> int:
        return self._default("sink", DEFAULT_SINK)

    @property
    def default_window(self) -> int:
        return self._default("window", DEFAULT_WINDOW)

    def _default(self, param: str, fallback: int) -> int:
        """The file's default of a parameter: that of the first head whose class has it."""
        return next((getattr(s, param) for r in self.heads for s in r if param in s.head_class.params), fallback)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: Any, name: str = "layout") -> "HeadLayout":
        if not isinstance(d, dict):
            raise LayoutError(f"{name}: a head layout must be a JSON object")
        if d.get("format") != FORMAT:
            raise LayoutError(f"{name}: not a headwise head layout (format={d.get('format')!r})")
        if d.get("version") not in READABLE_VERSIONS:
            raise LayoutError(f"{name}: unsupported layout version {d.get('version')!r}; "
                              f"expected one of {READABLE_VERSIONS}")
        kv_dtype = d.get("kv_dtype")
        if kv_dtype is not None and not isinstance(kv_dtype, dict):
            raise LayoutError(f"{name}: 'kv_dtype' must be an object such as {{\"paged\": \"int8\"}}")
        try:
            L, H, D = int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"])
            top = {p: d.get(p, DEFAULTS[p]) for p in DEFAULTS}  # the file's defaults
            rows = d["heads"]
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"{name}: missing or invalid field {e}") from None
        if not isinstance(rows, list):
            raise LayoutError(f"{name}: 'heads' must be a list of layers")
        heads = []
        for l, row in enumerate(rows):
            if not isinstance(row, list):
                raise LayoutError(f"{name}: layer {l} must be a list of head classes")
            specs = []
            for h, e in enumerate(row):
                try:
                    if isinstance(e, str):
                        specs.append(HeadSpec(e, **top))
                    elif isinstance(e, dict):
                        specs.append(HeadSpec(e.get("class"), **{p: e.get(p, v) for p, v in top.items()}))
                    else:
                        raise LayoutError(f"head entry must be a string or object, got {e!r}")
                except LayoutError as err:
                    raise LayoutError(f"{name}: layer {l} head {h}: {err}") from None
            heads.append(specs)
        return cls(d.get("name", name), L, H, D, heads, model=d.get("model", ""), scores=d.get("scores"),
                   kv_dtype=kv_dtype)

    @classmethod
    def load(cls, path: str | Path) -> "HeadLayout":
        p = Path(path)
        if not p.is_file():
            raise LayoutError(f"head layout file {str(p)!r} does not exist")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise LayoutError(f"head layout {str(p)!r} is not valid JSON: {e}") from None
        return cls.from_dict(d, name=p.stem)


def resolve_layout(spec: "str | HeadLayout | None", shape: tuple[int, int, int], model: str,
                   default: "HeadLayout | None" = None, native: "HeadLayout | None" = None) -> HeadLayout:
    """`full`, `window`, `native`, a file path or a HeadLayout -> a HeadLayout checked
    against the model. `native`: the model's own layout (layouts.native_layout), `full`
    for a model without sliding-window layers."""
    if spec is None:
        layout = default or HeadLayout.full(shape, model)
    elif isinstance(spec, HeadLayout):
        layout = spec
    elif spec == "native":
        layout = native or HeadLayout.full(shape, model)
    elif spec == "full":
        layout = HeadLayout.full(shape, model)
    elif spec == "window":
        layout = HeadLayout.window(shape, model=model)
    else:
        layout = HeadLayout.load(spec)
    layout.check_shape(*shape)
    return layout
