"""headwise: long-context LLM inference with a KV cache split along the head dimension."""
import os

# PyTorch's CPU allocator backs allocations of 2 MiB or more with transparent huge pages
# when this is set before torch is first imported (read once, at its first allocation).
# Fresh memory is faulted in 2 MiB at a time instead of 4 KiB: writing a new 27 MB
# tensor went from ~2 GB/s to ~6-9 GB/s on this project's VM, which is most of a model's
# start (its weights made dense and packed into new memory). Set it to 0 to turn it off;
# a process that imported torch first keeps its allocator as it was.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# Everything headwise loads is local (GGUF files, model directories), so the Hugging Face
# libraries it reads tokenizers and configs with never need the network: keep them off it
# and their telemetry off. Read when huggingface_hub is first imported; a user's own
# setting wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from headwise.heads.layout import HeadLayout
from headwise.llm import LLM, CompletionOutput, RequestOutput
from headwise.sampling import SamplingParams
from headwise.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "HeadLayout"]
__version__ = "0.1.0"
