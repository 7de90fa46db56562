"""EngineConfig: every engine option in one validated dataclass."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    model: str | None = None                  # GGUF file or HF directory; None: default model
    dtype: str = "float32"
    head_layout: Any = None                   # "full" | "window" | path | HeadLayout | None
    block_size: int = 16
    kv_cache_memory: int = 1 << 30            # bytes for both KV pools together
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048        # token budget of one engine step
    max_model_len: int | None = None
    max_queue: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "max_queue", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_options(cls, model: str | None, options: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **options)
