"""Model shape and hyper-parameters, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `model_type` -> architecture flags. Mistral and Llama share one code path; Gemma 3
# adds sandwich norms, scaled embeddings, GeGLU and per-layer-type rotary bases.
SUPPORTED_ARCHITECTURES = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "mistral": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
    "gemma3": dict(attention_bias=False, qk_norm=True),
}
# HF model_type spellings of a supported architecture
ARCHITECTURE_ALIASES = {"gemma3_text": "gemma3"}
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma 3's documented defaults where a checkpoint (GGUF) does not carry them: every
# sixth layer attends to everything, the sliding layers rotate with base 1e4.
GEMMA3_FULL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_ROPE_THETA = 1e6
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256  # transformers' default


def gemma3_layer_types(num_layers: int, full_every: int = GEMMA3_FULL_EVERY) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
            for i in range(num_layers)]


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
    # Per layer, "full_attention" or "sliding_attention" (a window of `sliding_window`
    # tokens, the newest included); None: every layer is alike, sliding if
    # sliding_window is set (Mistral), which headwise does not model.
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # rotary base of sliding layers, if their own
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    hidden_act: str = "silu"
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # Gemma: a norm after each sublayer too, and norm weights stored as 1 + w, applied in
    # float32 (the HF loader adds the 1; GGUF files store it added).
    sandwich_norms: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def __post_init__(self) -> None:
        self.architecture = ARCHITECTURE_ALIASES.get(self.architecture, self.architecture)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"headwise supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported activation {self.hidden_act!r}; expected one of {HIDDEN_ACTS}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise UnsupportedModelError(
                    f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}, got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise UnsupportedModelError("sliding_attention layers need a sliding_window")

    @property
    def sliding_layers(self) -> list[int]:
        """Layers that attend through a sliding window, as trained (modelled by a layout)."""
        return [i for i, t in enumerate(self.layer_types or []) if t == "sliding_attention"]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_theta_of(self, layer: int) -> float:
        if self.rope_local_theta is not None and layer in self.sliding_layers:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        if "text_config" in cfg:
            raise UnsupportedModelError(
                f"{cfg.get('model_type')!r} is a multimodal checkpoint; headwise runs text models "
                "(for Gemma 3: a Gemma3ForCausalLM checkpoint, model_type gemma3_text, or its GGUF)")
        arch = ARCHITECTURE_ALIASES.get(cfg.get("model_type", ""), cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            archs = cfg.get("architectures") or [arch]
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r} (model_type={arch!r}); "
                f"headwise supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_theta = cfg.get("rope_local_base_freq")
        if "full_attention" in rope:  # per layer type (transformers 5)
            local_theta = rope.get("sliding_attention", {}).get("rope_theta", local_theta)
            rope = rope["full_attention"]
        gemma = arch == "gemma3"
        theta = cfg.get("rope_theta", rope.get("rope_theta", GEMMA3_ROPE_THETA if gemma else 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        layer_types = cfg.get("layer_types")
        if gemma and layer_types is None:
            layer_types = gemma3_layer_types(cfg["num_hidden_layers"], cfg.get("sliding_window_pattern")
                                             or cfg.get("_sliding_window_pattern") or GEMMA3_FULL_EVERY)
        if layer_types is not None and (not sliding or "sliding_attention" not in layer_types):
            layer_types, sliding = None, None  # no layer slides
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_tanh" if gemma else "silu")
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
            layer_types=layer_types,
            rope_local_theta=float(local_theta) if gemma and local_theta else (
                GEMMA3_LOCAL_ROPE_THETA if gemma else None),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", GEMMA3_QUERY_PRE_ATTN_SCALAR if gemma else None),
            hidden_act="gelu_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act,
            scale_embeddings=gemma,
            sandwich_norms=gemma,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
