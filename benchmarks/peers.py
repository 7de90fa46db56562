"""One adapter per benchmarked system, each exposing the same measurements."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from benchmarks.common import headwise_aggregate, headwise_single, hf_single, prompt_ids
from benchmarks.llamacpp_batch import UBATCH
from headwise.config import DTYPES


class Skip(Exception):
    pass


class HeadwiseSystem:
    def __init__(self, name: str, model: str | None, layout, max_context: int, dtype: str,
                 kv_cache_dtype: str = "auto", dense_weights: bool | None = None) -> None:
        from headwise import LLM

        self.name, self.model, self.layout = name, model, layout
        self.opts = dict(head_layout=layout, max_num_batched_tokens=8192, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         dense_weights=dense_weights)
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

        from headwise.weights.loader import load_tokenizer, resolve_model_path

        p = resolve_model_path(model)
        dt = DTYPES[dtype]
        if p.is_file():
            self.hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dt)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(str(p), dtype=dt)
        self.tok = load_tokenizer(str(p))
        self.hf.eval()
        c = self.hf.config
        self.per_layer_token = 2 * c.num_key_value_heads * (
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * dt.itemsize
        types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
        self.layers, self.sliding = c.num_hidden_layers, types.count("sliding_attention")
        self.window = getattr(c, "sliding_window", None)
        self.max_len = c.max_position_embeddings

    def _ids(self, L: int, new: int, salt: int = 0) -> list[int]:
        return prompt_ids(self.tok, min(L, self.max_len - new - 2), salt)

    def single(self, L: int, new: int) -> tuple[float, float]:
        return hf_single(self.hf, self._ids(L, new, L), new)

    def kv_bytes(self, L: int) -> int:
        # DynamicCache: K and V (model dtype) of every token, of the window in sliding layers
        swa = self.sliding * min(L, self.window) if self.sliding else 0
        return ((self.layers - self.sliding) * L + swa) * self.per_layer_token

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


# llama.cpp's systems: name -> (flash attention: on / off / the library's default, q8_0 KV)
LLAMA_SYSTEMS = {"llama.cpp": (None, False), "llama.cpp-fa": (True, False), "llama.cpp-nofa": (False, False),
                 "llama.cpp-fa-q8": (True, True)}


class LlamaCppSystem:
    """llama-cpp-python on the very same GGUF. `flash`: flash attention on (llama.cpp-fa),
    off (llama.cpp-nofa) or the library's default (llama.cpp). KV cache f16 (its default),
    or q8_0 for K and V with `q8_kv` (llama.cpp-fa-q8: a quantized V cache needs flash
    attention), the peer of headwise's int8 KV."""

    def __init__(self, model: str | None, max_context: int, flash: bool | None = None, q8_kv: bool = False) -> None:
        if q8_kv and flash is not True:
            raise ValueError("llama.cpp's q8_0 V cache needs flash attention on")
        self.flash, self.q8_kv = flash, q8_kv
        self.name = next(n for n, setting in LLAMA_SYSTEMS.items() if setting == (flash, q8_kv))
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
        from headwise.weights.gguf_loader import read_config
        from headwise.weights.gguf_file import GGUFFile

        cfg = read_config(GGUFFile(self.path), p.stem)
        values = 2 * cfg.num_kv_heads * cfg.head_dim  # K and V, per layer and token
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0] if q8_kv else (1, 2)  # q8_0 or f16
        if cfg.head_dim % block:
            raise Skip(f"q8_0 KV needs a head dim divisible by {block}")
        self.per_layer_token = values // block * block_bytes
        self.layers, self.sliding = cfg.num_layers, len(cfg.sliding_layers)
        # A model with sliding-window layers gets llama.cpp's SWA cache (swa_full off):
        # those layers keep about window + one micro-batch of cells per sequence.
        self.swa_cells = (cfg.sliding_window + UBATCH) if self.sliding else None
        self.max_len = cfg.max_position_embeddings
        self.llm = None

    def _load(self, n_ctx: int, n_seq: int = 1):
        import llama_cpp

        kw = dict(model_path=self.path, n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                  n_batch=min(n_ctx, 2048), n_ubatch=UBATCH, verbose=False, swa_full=self.swa_cells is None)
        if n_seq > 1:
            kw["n_seq_max"] = n_seq
        if self.flash is not None:
            kw["flash_attn"] = self.flash
        if self.q8_kv:
            kw["type_k"] = kw["type_v"] = llama_cpp.GGML_TYPE_Q8_0
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
        swa = 0 if self.swa_cells is None else self.sliding * min(L, self.swa_cells)
        return ((self.layers - self.sliding) * L + swa) * self.per_layer_token

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
        from headwise.layouts import native_layout, shipped_layout
        from headwise.weights.loader import model_name, read_model_config, resolve_model_path

        cfg = read_model_config(model)
        known = shipped_layout(model_name(resolve_model_path(model)), (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
        if layout is None and known is None and native_layout(cfg) is None:
            raise Skip("no calibrated layout for this model; run headwise calibrate and pass it")
        # None: the engine's default, the shipped layout, else the native one (Gemma 3)
        return HeadwiseSystem(name, model, layout, max_context, dtype, "int8" if name.endswith("int8") else "auto")
    if name == "headwise-select":  # the shipped layout with select heads
        from headwise.layouts import shipped_layout
        from headwise.weights.loader import model_name, read_model_config, resolve_model_path

        cfg = read_model_config(model)
        lay = shipped_layout(model_name(resolve_model_path(model)), (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                             select=True)
        if lay is None:
            raise Skip("no layout with select heads ships for this model (headwise calibrate --select-from)")
        return HeadwiseSystem(name, model, lay, max_context, dtype)
    if name == "headwise-codes":  # the engine's default layout, quantized weights kept as codes only
        return HeadwiseSystem(name, model, layout, max_context, dtype, dense_weights=False)
    if name == "headwise-dense":  # the same with prepacked dense copies for prefill
        return HeadwiseSystem(name, model, layout, max_context, dtype, dense_weights=True)
    if name == "headwise-native":
        return HeadwiseSystem(name, model, "native", max_context, dtype)
    if name.startswith("headwise@"):  # headwise@LAYOUT.json: a layout of one's own, named by its file
        path = name.split("@", 1)[1]
        return HeadwiseSystem(f"headwise-{Path(path).stem}", model, path, max_context, dtype)
    if name == "headwise-full":
        from headwise.weights.loader import read_model_config

        if read_model_config(model).sliding_layers:
            raise Skip("`full` is not this model's function (it has sliding-window layers); "
                       "headwise runs its native layout")
        return HeadwiseSystem("headwise-full", model, "full", max_context, dtype)
    if name == "transformers":
        return TransformersSystem(model, dtype)
    if name in LLAMA_SYSTEMS:
        return LlamaCppSystem(model, max_context, *LLAMA_SYSTEMS[name])
    raise ValueError(f"unknown system {name!r}")
