"""One adapter per benchmarked system, each exposing the same measurements."""
from __future__ import annotations

import time

import torch

from benchmarks.common import headwise_aggregate, headwise_single, hf_single, prompt_ids
from headwise.config import DTYPES


class Skip(Exception):
    pass


class HeadwiseSystem:
    def __init__(self, name: str, model: str | None, layout, max_context: int, dtype: str,
                 kv_cache_dtype: str = "auto") -> None:
        from headwise import LLM

        self.name, self.model, self.layout = name, model, layout
        self.opts = dict(head_layout=layout, max_num_batched_tokens=8192, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        self.llm = LLM(model, kv_cache_memory=1 << 30, **self.opts)
        self.max_len = self.llm.engine.max_model_len

    def _ids(self, L: int, new: int, salt: int = 0) -> list[int]:
        return prompt_ids(self.llm.tokenizer, min(L, self.max_len - new - 2), salt)

    def single(self, L: int, new: int) -> tuple[float, float]:
        return headwise_single(self.llm, self._ids(L, new, L), new)

    def kv_bytes(self, L: int) -> int:
        return self.llm.kv_bytes(L)

    def max_concurrency(self, tokens: int, budget: int) -> int:
        return budget // self.llm.kv_bytes(min(tokens, self.max_len))

    def aggregate(self, L: int, num_seqs: int, steps: int) -> float:
        import gc

        from headwise import LLM

        budget = num_seqs * self.llm.kv_bytes(min(L + steps + 2, self.max_len))
        # One engine at a time, so peak RSS is one model plus this budget (pools are
        # allocated up front), comparable with a peer holding that many caches.
        self.llm = None
        gc.collect()
        big = LLM(self.model, kv_cache_memory=budget, max_num_seqs=num_seqs, **self.opts)
        try:
            return headwise_aggregate(big, min(L, self.max_len - steps - 2), num_seqs, steps)
        finally:
            del big
            gc.collect()
            self.llm = LLM(self.model, kv_cache_memory=1 << 30, **self.opts)

    def close(self) -> None:
        del self.llm


class TransformersSystem:
    name = "transformers"

    def __init__(self, model: str | None, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        from headwise.weights.loader import resolve_model_path
        from headwise.tokenizer import Tokenizer

        p = resolve_model_path(model)
        dt = DTYPES[dtype]
        if p.is_file():
            self.hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dt)
            self.tok = Tokenizer.from_path(p.parent, p.name)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(str(p), dtype=dt)
            self.tok = Tokenizer.from_path(p)
        self.hf.eval()
        c = self.hf.config
        self.per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * dt.itemsize
        self.max_len = c.max_position_embeddings

    def _ids(self, L: int, new: int, salt: int = 0) -> list[int]:
        return prompt_ids(self.tok, min(L, self.max_len - new - 2), salt)

    def single(self, L: int, new: int) -> tuple[float, float]:
        return hf_single(self.hf, self._ids(L, new, L), new)

    def kv_bytes(self, L: int) -> int:
        return L * self.per_token  # DynamicCache: K and V (model dtype) for every layer and KV head

    def max_concurrency(self, tokens: int, budget: int) -> int:
        return budget // self.kv_bytes(min(tokens, self.max_len))

    @torch.no_grad()
    def aggregate(self, L: int, num_seqs: int, steps: int) -> float:
        ids = torch.tensor([self._ids(L, steps, L)])
        out = self.hf(ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(num_seqs)  # the same prefilled context for every sequence
        nxt = out.logits[:, -1].argmax(-1, keepdim=True).repeat(num_seqs, 1)
        out = self.hf(nxt, past_key_values=cache, use_cache=True)  # warm-up step
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return num_seqs * steps / (time.perf_counter() - t0)

    def close(self) -> None:
        del self.hf


class LlamaCppSystem:
    """llama-cpp-python on the very same GGUF; f16 KV cache (its default)."""

    name = "llama.cpp"

    def __init__(self, model: str | None, max_context: int) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise Skip("llama-cpp-python is not installed (make bench builds it; the build failed or was skipped)")
        from headwise.weights.loader import resolve_model_path

        p = resolve_model_path(model)
        if p.suffix != ".gguf":
            raise Skip("llama.cpp needs a GGUF file")
        self.path = str(p)
        self.threads = torch.get_num_threads()
        from gguf import GGUFReader

        r = GGUFReader(self.path)
        arch = r.fields["general.architecture"].contents()
        layers = r.fields[f"{arch}.block_count"].contents()
        kv = r.fields[f"{arch}.attention.head_count_kv"].contents()
        heads = r.fields[f"{arch}.attention.head_count"].contents()
        dim = r.fields[f"{arch}.embedding_length"].contents() // heads
        self.per_token = 2 * layers * kv * dim * 2  # f16 K and V
        self.max_len = r.fields[f"{arch}.context_length"].contents()
        self.llm = None

    def _load(self, n_ctx: int, n_seq: int = 1):
        import llama_cpp

        kw = dict(model_path=self.path, n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                  n_batch=min(n_ctx, 2048), n_ubatch=512, verbose=False)
        if n_seq > 1:
            kw["n_seq_max"] = n_seq
        return llama_cpp.Llama(**kw)

    def single(self, L: int, new: int) -> tuple[float, float]:
        L = min(L, self.max_len - new - 2)
        if self.llm is None or self.llm.n_ctx() < L + new + 2:
            self.llm = self._load(min(self.max_len, max(L + new + 2, 2048)))
        ids = prompt_ids(_LlamaTok(self.llm), L, L)
        self.llm.reset()
        t0 = time.perf_counter()
        times = []
        for _ in self.llm.create_completion(ids, max_tokens=new + 1, temperature=0.0, stream=True):
            times.append(time.perf_counter())
        return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])

    def kv_bytes(self, L: int) -> int:
        return L * self.per_token

    def max_concurrency(self, tokens: int, budget: int) -> int:
        return budget // self.kv_bytes(min(tokens, self.max_len))

    def aggregate(self, L: int, num_seqs: int, steps: int) -> float:
        from benchmarks.llamacpp_batch import batched_decode

        return batched_decode(self, min(L, self.max_len - steps - 2), num_seqs, steps)

    def close(self) -> None:
        self.llm = None


class _LlamaTok:
    def __init__(self, llm) -> None:
        self.llm = llm

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)


def make(name: str, model: str | None, max_context: int, layout=None, dtype: str = "float32"):
    """dtype: the resolved compute dtype ("float32" | "bfloat16") shared by headwise and
    transformers; llama.cpp runs the GGUF as it is (quantized weights, f16 KV)."""
    if name in ("headwise", "headwise-int8"):
        from headwise.layouts import shipped_layout
        from headwise.weights.loader import DEFAULT_MODEL_NAME

        lay = layout or (shipped_layout(DEFAULT_MODEL_NAME, (30, 3, 64)) if model is None else None)
        if lay is None:
            raise Skip("no calibrated layout for this model; run headwise calibrate and pass it")
        return HeadwiseSystem(name, model, lay, max_context, dtype, "int8" if name.endswith("int8") else "auto")
    if name == "headwise-full":
        return HeadwiseSystem("headwise-full", model, "full", max_context, dtype)
    if name == "transformers":
        return TransformersSystem(model, dtype)
    if name == "llama.cpp":
        return LlamaCppSystem(model, max_context)
    raise ValueError(f"unknown system {name!r}")
