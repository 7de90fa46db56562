"""headwise's C kernels for the CPU, compiled on the machine that runs them.

cpu_decode.c (decode attention over paged blocks or rings, see there), cpu_prefill.c
(causal prefill attention in bfloat16 on AVX512-BF16 CPUs), cpu_pointwise.c
(RMSNorm and the rotary embedding, used by headwise.kernels.pointwise), cpu_matmul.c
(decode-sized matmuls over int8 weights, headwise.kernels.int8_matmul), cpu_gemm.c
(matmuls of any row count over 4-bit and int8 weights, headwise.kernels.codes_gemm), cpu_select.c
(select heads' page selection, headwise.kernels.page_select) and cpu_weights.c
(weights' codes at start-up, headwise.kernels.weight_codes) are each compiled
once per source, compiler and CPU with the system C compiler (`$CC`, else `cc`; -O3
-march=native -fopenmp, and without OpenMP where the compiler lacks it: one thread) into
the cache directory, and called through ctypes, which releases the GIL. A library links
the OpenMP runtime PyTorch has already loaded (same soname), so both share one thread
pool. Where no compiler works the callers keep their PyTorch code, after one log line.
HEADWISE_CPU_KERNELS=0 turns the kernels off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from headwise.paths import cache_dir

log = logging.getLogger("headwise.kernels")

HERE = Path(__file__).parent
BASE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]
# AVX-512 machines: GCC otherwise prefers 256-bit vectors
X86_FLAGS = ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
FLAG_SETS = [BASE_FLAGS + X86_FLAGS + ["-fopenmp"], BASE_FLAGS + X86_FLAGS]  # tried in order
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # a tensor's dtype -> the kernels' bf16 flag
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # cache values -> its type

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = [_ptr, _i64, _i64, _ptr, _i64, _i64,       # q, out
              _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr,  # new K/V rows, write rows
              _ptr, _ptr, _i64, _i64, _i64,             # cache K/V and strides
              _ptr, _ptr, _i64, _i64, _i64,             # int8: their scales and strides
              _ptr, _i64, _i64, _i64, _ptr, _i64,       # table, width, block, lens, cap
              _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]


def _cpu_id() -> str:
    """What -march=native depends on: the model name and flag lines of /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = {ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")}
    return "\n".join(sorted(keep))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (set CC)")
    return cc


def _build(cc: str, source: Path, flags: list[str], out: Path) -> None:
    """Compile `source` into `out`, atomically (another process building the same key
    writes the same file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([cc, *flags, str(source), "-o", str(tmp), "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        lines = e.stderr.strip().splitlines()
        first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else str(e))
        raise OSError(f"{cc} failed: {first.strip()}") from e
    finally:
        tmp.unlink(missing_ok=True)


_BUILDING = threading.Lock()  # one build at a time: a second caller waits, then finds it built


@functools.cache
def _load(name: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled HERE/`name`.c (flags FLAG_SETS + extra), or None (turned off, no
    working compiler)."""
    if os.environ.get("HEADWISE_CPU_KERNELS", "1") == "0":
        return None
    with _BUILDING:
        return _built(name, extra)


def _built(name: str, extra: tuple[str, ...]) -> ctypes.CDLL | None:
    source = HERE / f"{name}.c"
    try:
        cc = _compiler()
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels (%s) unavailable, using PyTorch's code: %s", name, e)
        return None
    error = None
    for flags in FLAG_SETS:
        flags = flags + list(extra)
        headers = [h.read_text() for h in sorted(HERE.glob("*.h"))]  # included by the sources
        key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), version,
                                        _cpu_id()]).encode()).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"{name}-{key}.so"
        try:
            if not path.is_file():
                _build(cc, source, flags, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            error = error or e
            continue
        if "-fopenmp" not in flags:
            log.warning("CPU kernels (%s) built without OpenMP (one thread): %s", name, error)
        return lib
    log.warning("CPU kernels (%s) unavailable, using PyTorch's code: %s", name, error)
    return None


def build_for_engine(pages_chosen: bool) -> None:
    """Build (or find built) the kernels a CPU engine runs, page selection's where its
    layout has heads that choose pages by key summaries (HeadClass.page_summary): an engine
    starts this beside loading its weights, so that a first build runs the compiler, in
    processes of its own, while the weights load."""
    weights_library(), library(), pointwise_library(), matmul_library(), prefill_library()
    if pages_chosen:
        select_library()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The decode attention kernel (cpu_decode.c), or None."""
    lib = _load("cpu_decode")
    if lib is not None:
        lib.paged_decode.argtypes = _SIGNATURE
        lib.paged_decode.restype = ctypes.c_int
    return lib


@functools.cache
def pointwise_library() -> ctypes.CDLL | None:
    """RMSNorm and rotary (cpu_pointwise.c), or None. Without FMA contraction: see there."""
    lib = _load("cpu_pointwise", ("-ffp-contract=off",))
    if lib is not None:
        lib.rms_norm.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int,
                                 _i64, _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        lib.rotary.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                               ctypes.c_int, ctypes.c_int]
        lib.rms_norm.restype = lib.rotary.restype = None
    return lib


@functools.cache
def weights_library() -> ctypes.CDLL | None:
    """GGUF block decoding, dequantization and 4-bit packing at start-up (cpu_weights.c),
    or None. Without FMA contraction: see there."""
    lib = _load("cpu_weights", ("-ffp-contract=off",))
    if lib is not None:
        lib.decode_gguf.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int]
        lib.decode_gguf.restype = ctypes.c_int
        lib.dequantize.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, ctypes.c_int, ctypes.c_int]
        lib.pack_int4.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int]
        lib.dequantize.restype = lib.pack_int4.restype = None
    return lib


@functools.cache
def matmul_library() -> ctypes.CDLL | None:
    """The int8-weight matmul of decode-sized calls (cpu_matmul.c), or None."""
    lib = _load("cpu_matmul")
    if lib is not None:
        lib.int8_matmul.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                                    _ptr, _i64, ctypes.c_int, ctypes.c_int]
        lib.int8_matmul.restype = ctypes.c_int
    return lib


@functools.cache
def gemm_library() -> ctypes.CDLL | None:
    """The matmuls over 4-bit and int8 codes for any row count (cpu_gemm.c), with AMX
    where the CPU has it and Linux grants its state, or None. Without contraction: an
    int8 tile's scale * code + low is rounded twice, as the dense weight's (layers.quant)."""
    lib = _load("cpu_gemm", ("-ffp-contract=off",))
    if lib is not None:
        lib.int4_gemm.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int]
        lib.int8_gemm.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int]
        lib.int4_gemm.restype = lib.int8_gemm.restype = ctypes.c_int
        lib.int4_gemm_glu.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, ctypes.c_int, _ptr, _i64, ctypes.c_int]
        lib.int8_gemm_glu.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                                      ctypes.c_int, _ptr, _i64, ctypes.c_int]
        lib.int4_gemm_glu.restype = lib.int8_gemm_glu.restype = ctypes.c_int
        lib.gemm_amx.argtypes = [ctypes.c_int]
        lib.gemm_amx.restype = ctypes.c_int
        lib.gemm_amx(-1)  # asks Linux for AMX's tile state once, before any call multiplies
    return lib


@functools.cache
def prefill_library(amx_too: bool = False) -> ctypes.CDLL | None:
    """Causal prefill attention (cpu_prefill.c), or None: also on a CPU without AVX512-BF16,
    and (unless amx_too: tests) on one with AMX, where PyTorch's own kernel multiplies with
    AMX tiles, which this one does not use (not measured against it: no machine with AMX
    was at hand)."""
    flags = _cpu_id().split()
    if "avx512_bf16" not in flags or ("amx_bf16" in flags and not amx_too):
        return None
    lib = _load("cpu_prefill")
    if lib is not None:
        lib.prefill_attention.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                          *[_i64] * 10, ctypes.c_float, ctypes.c_int]
        lib.prefill_attention.restype = ctypes.c_int
    return lib


def prefill_takes(q: torch.Tensor, amx_too: bool = False) -> bool:
    """Whether prefill_attention may take queries like q [c, H, D] (bfloat16 on the CPU, D
    a multiple of 64 up to 256, the library loaded): callers ask before gathering keys for it."""
    D = q.shape[-1]
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and D % 64 == 0 and D <= 256
            and prefill_library(amx_too) is not None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                      window: int | None = None, sink: int = 0, sinks_given: int = 0, band_pos: int = 0,
                      amx_too: bool = False) -> torch.Tensor | None:
    """cpu_prefill.c: attention of q [c, H, D], the positions [start, start + c), over k, v
    [S, nkv, D] (any strides but D's, each its own), query head h reading KV head
    h // (H // nkv) -> [c, H, D]. A query at position p sees the keys at positions
    (p - window, p] and those below `sink` up to p (window None: every key up to p).
    Keys [0, sinks_given) are positions [0, sinks_given), the rest positions band_pos on;
    they must hold every key a query sees. None where the kernel does not take these
    inputs: not bfloat16 on the CPU, D not a multiple of 64 up to 256, a CPU without
    AVX512-BF16 (or with AMX: see prefill_library), no library."""
    c, H, D = q.shape
    S, nkv = k.shape[0], k.shape[1]
    if (not prefill_takes(q, amx_too) or k.dtype != q.dtype or v.dtype != q.dtype or k.device.type != "cpu"
            or k.shape[-1] != D or v.shape != k.shape or q.stride(-1) != 1
            or k.stride(-1) != 1 or v.stride(-1) != 1 or H % nkv):
        return None
    if not (0 <= sinks_given <= min(band_pos, S) and 0 <= band_pos <= start
            and band_pos + S - sinks_given >= start + c and sink >= 0 and (window is None or window >= 1)):
        raise ValueError(f"keys of positions [0, {sinks_given}) and [{band_pos}, "
                         f"{band_pos + S - sinks_given}) do not hold what queries [{start}, {start + c}) see")
    lib = prefill_library(amx_too)
    out = torch.empty(c, H, D, dtype=q.dtype)
    rc = lib.prefill_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                               v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
                               c, S, sinks_given, band_pos, start, sink, start + c if window is None else window,
                               H, nkv, D, scale, torch.get_num_threads())
    if rc == -1:  # built without AVX512-BF16: this CPU lacks it
        return None
    if rc == -3:
        raise MemoryError("cpu_prefill: no memory for the packed keys and values")
    if rc:
        raise RuntimeError(f"cpu_prefill.prefill_attention failed ({rc})")
    return out


@functools.cache
def select_library() -> ctypes.CDLL | None:
    """Page selection of select heads (cpu_select.c), or None."""
    lib = _load("cpu_select")
    if lib is not None:
        lib.select_pages.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _ptr, _i64, _i64, ctypes.c_int,
                                     _ptr, _i64, _ptr] + [_i64] * 9 + [_ptr, _ptr]
        lib.select_pages.restype = ctypes.c_int
        lib.refresh_summaries.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _ptr] + [_i64] * 4 + [_ptr, _i64, _i64]
        lib.refresh_summaries.restype = ctypes.c_int
    return lib


def takes(compute: torch.dtype, values: torch.dtype, scales: torch.dtype | None, head_dim: int) -> bool:
    """Whether the kernel attends a cache stored so, for a model computing in `compute`:
    float32 or bfloat16 compute, values stored as computed or int8 with scales in the
    compute dtype, a head size that is a multiple of 16."""
    stored = (values == compute and scales is None) or (values == torch.int8 and scales == compute)
    return stored and compute in DTYPES and head_dim % 16 == 0


def usable(q: torch.Tensor, k) -> bool:
    """Whether the kernel takes q against this class's cache `k` (a KVTensor: values and,
    quantized, scales): on the CPU, stored as `takes` says, rows contiguous; and the
    library is there."""
    data, scale = k.data, k.scale
    return (takes(q.dtype, data.dtype, None if scale is None else scale.dtype, data.shape[-1])
            and q.device.type == "cpu" and data.device.type == "cpu"
            and q.stride(-1) == 1 and data.stride(-1) == 1 and library() is not None)


class DecodeCall:
    """Decode attention of one head class of one layer, through cpu_decode.c, without a
    copy of the cache. Built once per cache view; a call passes only the step's tensors.

    k, v: [nkv, ..., D] views of the cache values whose dim 0 is the KV head and whose
    last-but-one stride steps one key row. Key row p of sequence b is at
    k[h] + table[b, p // block] * block_stride + (p % block) * row stride; sequence b
    attends its first min(lens[b], cap) rows (cap: a ring's length, else None). int8
    values come with `scales` = (k scales, v scales [nkv, ...] laid out as the rows,
    their block stride). The class is KV heads [head, head + nkv) of the layer, with g
    query heads each."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block: int, block_stride: int, g: int,
                 head: int = 0, cap: int | None = None,
                 scales: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
        if k.stride() != v.stride() or k.dtype != v.dtype or k.dtype not in KV_TYPES:
            raise ValueError("K and V views must share their strides and be float32, bfloat16 or int8")
        if (k.dtype == torch.int8) != (scales is not None):
            raise ValueError("int8 values need their scales, and only they have scales")
        self.lib = library()
        self.nkv, self.D, self.g, self.head = k.shape[0], k.shape[-1], g, head
        self.type = KV_TYPES[k.dtype]
        self.cache = (k.data_ptr(), v.data_ptr(), k.stride(0), block_stride, k.stride(-2))
        if scales is None:
            self.dtype = k.dtype
            self.scales = (None, None, 0, 0, 0)
        else:
            ks, vs, scale_block_stride = scales
            if ks.stride() != vs.stride() or ks.dtype != vs.dtype or ks.dtype not in DTYPES:
                raise ValueError("K and V scales must share their strides and be float32 or bfloat16")
            self.dtype = ks.dtype
            self.scales = (ks.data_ptr(), vs.data_ptr(), ks.stride(0), scale_block_stride, ks.stride(-1))
        self.bf16 = DTYPES[self.dtype]
        self.block, self.cap = block, (1 << 62) if cap is None else cap
        self.views = (k, v, scales)  # kept alive with the pointers

    def __call__(self, q: torch.Tensor, out: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 scale: float, new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """q, out: the layer's [B, Hq, D] (any strides but D's), in the compute dtype (the
        cache's, or its scales'); table [B, W] and lens [B] int32, unit inner stride.
        new: (k, v [B, Hkv, D] in q's dtype, rows [B] int64): the step's own K/V, written
        first (quantized for an int8 cache) at key row rows[b] of each sequence, or None."""
        B, H, D = q.shape
        first, g = self.head * self.g, self.g  # the class's first query head
        if q.dtype != self.dtype or out.dtype != self.dtype or q.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError("q and out must be unit-stride rows in the cache's compute dtype")
        if D != self.D or H < first + self.nkv * g or out.shape != q.shape:
            raise ValueError(f"q and out must be [B, >= {first + self.nkv * g}, {self.D}]")
        if table.dtype != torch.int32 or lens.dtype != torch.int32 or table.stride(-1) != 1 or lens.stride(0) != 1:
            raise ValueError("table and lens must be int32 with unit inner stride")
        e = q.element_size()
        if new is None:
            written = (None, 0, 0, None, 0, 0, None)
        else:
            kn, vn, rows = new
            if (kn.dtype != self.dtype or vn.dtype != self.dtype or kn.stride(-1) != 1 or vn.stride(-1) != 1
                    or rows.dtype != torch.int64 or kn.shape[1] < self.head + self.nkv):
                raise ValueError("new K/V must be unit-stride rows of the compute dtype holding the "
                                 "class's heads; rows must be int64")
            written = (kn.data_ptr() + self.head * kn.stride(1) * e, kn.stride(0), kn.stride(1),
                       vn.data_ptr() + self.head * vn.stride(1) * e, vn.stride(0), vn.stride(1), rows.data_ptr())
        rc = self.lib.paged_decode(
            q.data_ptr() + first * q.stride(1) * e, q.stride(0), q.stride(1),
            out.data_ptr() + first * out.stride(1) * e, out.stride(0), out.stride(1),
            *written, *self.cache, *self.scales, table.data_ptr(), table.stride(0), table.shape[-1],
            self.block, lens.data_ptr(), self.cap, B, self.nkv, g, self.D, scale, self.type, self.bf16,
            torch.get_num_threads())
        if rc == -2:
            raise ValueError("a sequence's keys or write row lie past its table")
        if rc:
            raise ValueError(f"the CPU decode kernel does not take {g} query heads per KV head of size {self.D}")
