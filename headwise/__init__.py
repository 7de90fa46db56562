"""headwise: long-context LLM inference with a KV cache split along the head dimension."""
from headwise.heads.layout import HeadLayout
from headwise.llm import LLM, CompletionOutput, RequestOutput
from headwise.sampling import SamplingParams
from headwise.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "HeadLayout"]
__version__ = "0.1.0"
