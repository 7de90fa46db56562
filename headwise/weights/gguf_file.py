"""A GGUF file's metadata and tensors, read without decoding the tokenizer's arrays.

gguf's GGUFReader builds a Python object per array element: Gemma 3's 262K-token
vocabulary (tokens, scores, types) took 14 s of a 20 s engine start. Here numeric arrays
are one numpy view and string arrays are skipped unless asked for; the model loader only
needs scalars, the tensor table and the vocabulary's length.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count;
metadata entries (key, value type, value); tensor infos (name, dims, type, offset);
padding to `general.alignment`; tensor data.
"""
from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value type -> numpy dtype (8 = string, 9 = array)
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
DEQUANT_CHUNK_BYTES = 1 << 20  # quantized bytes per dequantization task
DEQUANT_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class GGUFFormatError(ValueError):
    pass


@dataclass
class StringArray:
    """A string array left undecoded: its length only."""
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]       # GGUF order: innermost dimension first
    qtype: GGMLQuantizationType
    data: np.ndarray             # raw bytes [rows, bytes per row] (uint8), a view of the file

    def dequantize(self) -> np.ndarray:
        """float32, in row-major order (outermost dimension first), a writable array of its
        own (F32 tensors are copied out of the file's map). gguf's own per-format
        code, over chunks of about a MiB of rows on threads (numpy releases the GIL)
        instead of gguf.quants.dequantize's 16-row groups on one: the same function on the
        same blocks, so the same values, 3x sooner (Gemma 3 270M: 2.9 -> 0.9 s on 2 cores).
        Types gguf has no per-type table entry for (another gguf version) go through
        gguf.quants.dequantize."""
        from gguf import quants

        shape = tuple(reversed(self.shape))
        kind = _format_code(self.qtype)
        rows = self.data
        if kind is None or rows.ndim != 2:
            return np.array(quants.dequantize(rows, self.qtype), dtype=np.float32).reshape(shape)  # own copy
        if hasattr(kind, "init_grid"):
            kind.init_grid()
        out = np.empty((rows.shape[0], int(np.prod(shape)) // max(rows.shape[0], 1)), dtype=np.float32)
        step = max(1, DEQUANT_CHUNK_BYTES // max(rows.shape[1], 1))

        def chunk(r: int) -> None:
            out[r:r + step] = kind.dequantize_rows(rows[r:r + step])

        with ThreadPoolExecutor(DEQUANT_THREADS) as pool:
            list(pool.map(chunk, range(0, rows.shape[0], step)))
        return out.reshape(shape)


def _format_code(qtype: GGMLQuantizationType):
    """gguf's class for a block format (with dequantize_rows), or None: its table is not
    public API, so another gguf version may lack it."""
    from gguf import quants

    kind = getattr(quants, "_type_traits", {}).get(qtype)
    return kind if hasattr(kind, "dequantize_rows") else None


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFFormatError(f"{self.path} is empty, not a GGUF file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)  # views of the map, no copy
        self._pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: unsupported GGUF version {version}")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(qtype), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise GGUFFormatError(f"{self.path}: tensor {name} rows are not whole blocks")
            row_bytes = dims[0] // block * size
            rows = int(np.prod(dims[1:], dtype=np.int64))
            lo = start + offset
            if lo + rows * row_bytes > len(self._buf):
                raise GGUFFormatError(f"{self.path} is truncated (tensor {name})")
            data = self._buf[lo: lo + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors.append(GGUFTensor(name, dims, qtype, data))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def release(self, tensor: GGUFTensor) -> bool:
        """Drop a tensor's pages of the file from this process's resident memory once its
        contents are copied out (they stay in the page cache; a later read faults them in
        again). A loader that reads every tensor otherwise ends holding the whole file
        mapped beside what it made of it: Qwen2.5-Coder-1.5B's 1.1 GB on top of its codes at
        the peak of a cold start. False where the OS has no madvise."""
        if not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or tensor.data.size == 0:
            return False
        lo = tensor.data.ctypes.data - self._buf.ctypes.data
        if not 0 <= lo < len(self._buf):
            raise ValueError(f"tensor {tensor.name!r} is not one of {self.path}'s")
        start = lo // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, lo + tensor.data.size - start)
        return True

    # ---- parsing ------------------------------------------------------------------
    def _take(self, n: int) -> np.ndarray:
        if self._pos + n > len(self._buf):
            raise GGUFFormatError(f"{self.path} is truncated")
        out = self._buf[self._pos: self._pos + n]
        self._pos += n
        return out

    def _skip_strings(self, n: int) -> int:
        """The offset after n strings from here. Read from bytes copied in spans, not
        through the memmap per string (Qwen2.5's 151,646 tokens: 1.8 s that way)."""
        pos, span, chunk = self._pos, b"", 1 << 20
        start = pos  # file offset of span[0]
        for _ in range(n):
            if pos + 8 - start > len(span):
                if pos + 8 > len(self._buf):
                    raise GGUFFormatError(f"{self.path} is truncated")
                start, span = pos, bytes(self._buf[pos: pos + chunk])
            (length,) = struct.unpack_from("<Q", span, pos - start)
            pos += 8 + length
        if pos > len(self._buf):
            raise GGUFFormatError(f"{self.path} is truncated")
        return pos

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, bytes(self._take(struct.calcsize(fmt))))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            dt = np.dtype(_SCALARS[vtype])
            return self._take(dt.itemsize).view(dt)[0].item()
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")
        etype, n = self._unpack("<IQ")
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype])
            values = self._take(n * dt.itemsize).view(dt)
            return values.tolist() if n <= 4096 else values  # long ones stay a view of the file
        if etype == _STRING:  # skipped: each is a length and that many bytes
            self._pos = self._skip_strings(n)
            return StringArray(n)
        return [self._value(etype) for _ in range(n)]
