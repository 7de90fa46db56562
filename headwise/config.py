"""EngineConfig: every engine option in one validated dataclass."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from headwise.heads.layout import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
BACKENDS = ("auto", "torch", "triton")
WINDOW_POSITIONS = ("original", "rebased")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the option's spelling)."""
    return str(dtype).removeprefix("torch.")


class ConfigError(ValueError):
    pass


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1073741824' -> bytes (binary and decimal units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r}; use bytes or a unit such as 512MiB, 2GiB, 1.5GB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return n


def _opt(default: Any, help: str, type: Any = None, choices: tuple | None = None) -> Any:
    """A field whose CLI flag (--name-with-dashes) is generated from it: name, default,
    type, choices and help are written once, here."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass
class EngineConfig:
    model: str | None = _opt(None, "GGUF file, HF directory or a known name: SmolLM2-135M-Instruct "
                             "(the default), gemma-3-270m", str)
    # "auto": bfloat16 where the device multiplies it natively (CUDA; CPUs with AVX512-BF16
    # or AMX) and the checkpoint is 16-bit or quantized, else float32. See resolve_dtype.
    dtype: str = _opt("auto", "compute and KV dtype; auto: bfloat16 where the device computes it "
                      "natively and the checkpoint is 16-bit or quantized, else float32",
                      str, DTYPE_CHOICES)
    kv_cache_dtype: str = _opt("auto", "KV cache dtype of both head classes (a layout file may set "
                               "each class's own): auto (the compute dtype), bfloat16, float16, float32, "
                               "int8 (a scale per token and head), fp8_e4m3 (CUDA only)", str, KV_CACHE_DTYPES)
    head_layout: Any = _opt(None, "full | window | native | PATH to a layout JSON (default: the "
                            "model's shipped layout, else native). native: the model's sliding-window "
                            "layers (Gemma 3) as window heads, every other head full", str)
    block_size: int = _opt(16, "tokens per full-head KV block", int)
    kv_cache_memory: int = _opt(1 << 30, "bytes for the KV cache (both pools); units allowed: 2GiB, "
                                "512MiB", parse_size)
    max_num_seqs: int = _opt(32, "sequences running at once (one window-head ring each)", int)
    max_num_batched_tokens: int = _opt(2048, "token budget of one engine step; longer prompts "
                                       "are prefilled in chunks of it", int)
    max_model_len: int | None = _opt(None, "longest prompt + completion in tokens "
                                     "(default: the model's context)", int)
    max_queue: int | None = _opt(None, "waiting requests beyond this are refused "
                                 "(the server answers 503)", int)
    num_threads: int | None = _opt(None, "CPU threads for PyTorch (default: PyTorch's choice)", int)
    device: str = _opt("cpu", "cpu | cuda | cuda:N", str)
    attention_backend: str = _opt("auto", "auto: Triton kernels on CUDA, PyTorch elsewhere",
                                  str, BACKENDS)
    # Rotary positions seen by window heads: "original" (DuoAttention; the default) or
    # "rebased" (StreamingLLM: distances as if evicted tokens were never there).
    window_positions: str = _opt("original", "rotary positions of window heads: original "
                                 "(DuoAttention) or rebased (StreamingLLM)", str, WINDOW_POSITIONS)
    enforce_eager: bool | None = _opt(None, "never compile or graph-capture the decode step (default: "
                                      "CUDA graphs on CUDA with the Triton backend, torch.compile where "
                                      "that pays: CPU decode over 4-bit weights; --no-enforce-eager: "
                                      "compiled wherever it compiles, graphs on CUDA too)", bool)
    compile_in_background: bool = _opt(False, "on the CPU, do not wait for the decode step to compile: "
                                       "start at once, decode eagerly until the compiled step is ready "
                                       "(about 10 s later)", bool)
    enable_prefix_caching: bool = _opt(True, "reuse the KV of prompt prefixes seen before (full-head "
                                       "blocks and window-head state)", bool)
    prepared_weights_cache: bool = _opt(True, "keep a GGUF model's prepared weights (packed, with their "
                                        "decode copies) under the cache directory, so the next start with "
                                        "the same dtype and layout skips loading and preparing (safe to "
                                        "delete: $HEADWISE_CACHE_DIR/prepared)", bool)
    dense_weights: bool | None = _opt(None, "keep a prepacked bfloat16 copy of each quantized weight beside "
                                      "its codes for prefill (about 3x the 4-bit codes' bytes, and a slower "
                                      "first start); default: only where the codes cannot serve every "
                                      "matmul (not the CPU, not bfloat16, no AVX512-BF16); "
                                      "--no-dense-weights: every matmul reads the codes (bfloat16 on the "
                                      "CPU only)", bool)
    select_host_pages: bool = _opt(False, "select heads' K/V wait in host memory (pinned on CUDA); the "
                                   "device keeps their key summaries and a hot set of the pages decode "
                                   "chose, and kv_cache_memory budgets the device (torch attention "
                                   "backend)", bool)
    select_hot_pages: int | None = _opt(None, "with select_host_pages: pages per select head in the "
                                        "device's hot set (default: one decode step of max_num_seqs "
                                        "sequences)", int)
    select_host_memory: int = _opt(0, "with select_host_pages: bound on the host memory of select heads' "
                                   "pages (0: as many blocks as the device budget holds); units allowed",
                                   parse_size)
    kv_offload_dir: str | None = _opt(None, "directory of a second KV tier: cached prefixes evicted from "
                                      "memory are written there and read back instead of recomputed, "
                                      "also by a later process", str)
    kv_offload_bytes: int = _opt(16 << 30, "bound on the KV offload directory (LRU beyond it); units "
                                 "allowed", parse_size)
    kv_offload_host_bytes: int = _opt(0, "host memory for evicted prefixes in front of the offload "
                                      "directory (pinned on CUDA; 0: none); units allowed", parse_size)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "kv_offload_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.kv_offload_host_bytes, int) or self.kv_offload_host_bytes < 0:
            raise ConfigError(f"kv_offload_host_bytes must be >= 0, got {self.kv_offload_host_bytes!r}")
        if (self.kv_offload_dir is not None or self.kv_offload_host_bytes) and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_dir / kv_offload_host_bytes need enable_prefix_caching=True")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.compile_in_background, bool):
            raise ConfigError(f"compile_in_background must be True or False, got {self.compile_in_background!r}")
        if not isinstance(self.select_host_pages, bool):
            raise ConfigError(f"select_host_pages must be True or False, got {self.select_host_pages!r}")
        if self.select_hot_pages is not None and (not isinstance(self.select_hot_pages, int)
                                                  or isinstance(self.select_hot_pages, bool)
                                                  or self.select_hot_pages < 1):
            raise ConfigError(f"select_hot_pages must be a positive integer or None, got {self.select_hot_pages!r}")
        if not isinstance(self.select_host_memory, int) or self.select_host_memory < 0:
            raise ConfigError(f"select_host_memory must be >= 0, got {self.select_host_memory!r}")
        if (self.select_hot_pages is not None or self.select_host_memory) and not self.select_host_pages:
            raise ConfigError("select_hot_pages / select_host_memory need select_host_pages=True")
        if self.dense_weights is not None and not isinstance(self.dense_weights, bool):
            raise ConfigError(f"dense_weights must be True, False or None, got {self.dense_weights!r}")
        if not isinstance(self.prepared_weights_cache, bool):
            raise ConfigError(f"prepared_weights_cache must be True or False, got {self.prepared_weights_cache!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be True, False or None, got {self.enforce_eager!r}")
        for name in ("max_model_len", "max_queue", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")

        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but PyTorch sees no CUDA device")
        if self.dense_weights is False and dev.type != "cpu":
            raise ConfigError(f"dense_weights=False keeps 4-bit weights as codes for the CPU's int4 kernels; "
                              f"device {self.device!r} keeps the dense weights (leave dense_weights on)")
        if self.kv_cache_dtype == "fp8_e4m3" and dev.type != "cuda":
            raise ConfigError("kv_cache_dtype='fp8_e4m3' needs a CUDA device; on the CPU use int8 "
                              f"(choices: {list(KV_CACHE_DTYPES)})")
        if self.attention_backend not in BACKENDS:
            raise ConfigError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.window_positions not in WINDOW_POSITIONS:
            raise ConfigError(f"window_positions must be one of {WINDOW_POSITIONS}, got {self.window_positions!r}")
        if self.select_host_pages and self.attention_backend == "triton":
            raise ConfigError("select_host_pages is implemented in the torch attention backend only "
                              "(attention_backend='torch')")
        if self.window_positions == "rebased" and self.attention_backend == "triton":
            raise ConfigError("window_positions='rebased' is implemented in the torch backend only")
        if self.attention_backend == "triton":
            from headwise.kernels import triton_usable

            if not triton_usable(dev):
                raise ConfigError(
                    "attention_backend='triton' needs the triton package and a CUDA device "
                    "(or TRITON_INTERPRET=1 to run the kernels in Triton's interpreter on CPU)")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def backend(self) -> str:
        """The attention backend in use: Triton kernels on CUDA when "auto"."""
        if self.attention_backend != "auto":
            return self.attention_backend
        from headwise.kernels import triton_installed

        if self.window_positions == "rebased" or self.select_host_pages:
            return "torch"
        return "triton" if self.torch_device.type == "cuda" and triton_installed() else "torch"

    def resolve_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """The compute and KV dtype. checkpoint_dtype: what the weights were saved in
        ("float32", "bfloat16", ...), None for quantized (GGUF) weights. ConfigError where
        dense_weights=False meets a dtype other than bfloat16 (the int4 kernels' only one)."""
        if self.dtype != "auto":
            dtype = DTYPES[self.dtype]
        elif checkpoint_dtype in (None, "bfloat16", "float16") and native_bf16(self.torch_device):
            dtype = torch.bfloat16
        else:
            dtype = torch.float32
        if self.dense_weights is False and dtype != torch.bfloat16:
            raise ConfigError(f"dense_weights=False needs bfloat16 compute; dtype {self.dtype!r} resolves to "
                              f"{dtype} here (explicitly, or this CPU lacks AVX512-BF16, or the checkpoint is "
                              "float32)")
        return dtype

    def keeps_dense_weights(self, dtype: torch.dtype, codes_kernels: Callable[[], bool]) -> bool:
        """Whether quantized weights keep prepacked dense copies: dense_weights where given;
        by default only where their codes cannot serve every matmul: another device than
        the CPU, compute in another dtype than bfloat16, or no matmul kernels over codes
        (codes_kernels(), asked last: kernels.codes_gemm.available). Kept as codes, a model
        starts several times sooner in a fraction of the memory (docs/benchmarks.md)."""
        if self.dense_weights is not None:
            return self.dense_weights
        return not (self.torch_device.type == "cpu" and dtype == torch.bfloat16 and codes_kernels())

    @classmethod
    def from_options(cls, model: str | None, options: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **options)


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run natively (faster than float32) on `device`."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:  # x86 Linux: AVX512-BF16 or AMX dot products (elsewhere PyTorch emulates bf16)
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (--max-num-seqs for max_num_seqs, ...)."""
    for f in fields(EngineConfig):
        if f.name in exclude:
            continue
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        if meta["type"] is bool:  # --x / --no-x
            parser.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction,
                                help=meta["help"])
            continue
        parser.add_argument(flag, dest=f.name, default=f.default, type=meta["type"], choices=meta["choices"],
                            help=f"{meta['help']} (default: %(default)s)")


def engine_options(args: argparse.Namespace, exclude: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """The engine options parsed by add_engine_args, as keyword arguments of LLM()."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)
            if f.name not in exclude and hasattr(args, f.name)}

