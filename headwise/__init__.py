"""headwise: long-context LLM inference with a KV cache split along the head dimension."""
from headwise.cache.layout import HeadLayout
from headwise.llm import LLM, RequestOutput
from headwise.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "HeadLayout"]
__version__ = "0.1.0"
