"""Model code: the decoder-only transformer and its config (loading: headwise.weights)."""
from headwise.models.config import ModelConfig, UnsupportedModelError
from headwise.models.causal_lm import CausalLM

__all__ = ["CausalLM", "ModelConfig", "UnsupportedModelError"]
