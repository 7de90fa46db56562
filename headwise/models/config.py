"""Model shape and hyper-parameters, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `model_type` -> architecture flags. Mistral and Llama share one code path.
SUPPORTED_ARCHITECTURES = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "mistral": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"headwise supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            archs = cfg.get("architectures") or [arch]
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r} (model_type={arch!r}); "
                f"headwise supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=dict(rope, rope_type=rope_type) if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", flags["attention_bias"]),
            qk_norm=flags["qk_norm"],
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
