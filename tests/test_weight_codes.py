"""The C kernels for a model's weights at start-up (kernels/cpu_weights.c through
kernels/weight_codes.py): GGUF blocks decode to NumPy's codes, scales and lows, codes
dequantize to PyTorch's dense weight, and 4-bit codes pack as PyTorch packs them, all
bit for bit; where a kernel does not apply, the callers keep their own code."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from headwise.kernels import cpu_kernels, weight_codes
from headwise.layers import linear
from headwise.layers.quant import QuantCodes
from headwise.weights import gguf_codes
from headwise.weights.gguf_codes import FORMATS, WITH_LOWS, read_codes
from tests.test_gguf_codes import random_blocks


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the loader keeps NumPy's and PyTorch's code")
    assert cpu_kernels.weights_library() is not None, "a C compiler is here but the kernel did not build"


def _numpy_codes(raw: np.ndarray, qtype) -> QuantCodes:
    """read_codes through NumPy's decoders alone (the kernel turned away)."""
    real = gguf_codes.decode_gguf
    gguf_codes.decode_gguf = lambda *a: False
    try:
        return read_codes(raw, qtype)
    finally:
        gguf_codes.decode_gguf = real


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(a.dtype, a.dtype)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("any_bytes", [False, True])
def test_gguf_blocks_decode_as_numpy_decodes_them(qtype, any_bytes):
    """Realistic blocks, and blocks of random bytes (float16 fields that are subnormal,
    infinite or NaN included)."""
    raw = random_blocks(40, 512, qtype, seed=3)
    if any_bytes:
        raw = np.random.default_rng(4).integers(0, 256, raw.shape, dtype=np.uint8)
    size = GGML_QUANT_SIZES[qtype][1]
    codes = np.empty(40 * 512, np.int8)
    scales = np.empty(40 * 512 // FORMATS[qtype][1], np.float32)
    lows = np.empty_like(scales) if qtype in WITH_LOWS else None
    assert weight_codes.decode_gguf(raw.reshape(-1, size), qtype.name, codes, scales, lows)
    ref = _numpy_codes(raw, qtype)
    assert torch.equal(torch.from_numpy(codes).view(40, 512), ref.codes)
    assert _same_bits(torch.from_numpy(scales).view(ref.scales.shape), ref.scales)
    assert _same_bits(None if lows is None else torch.from_numpy(lows).view(ref.scales.shape), ref.lows)
    got = read_codes(raw, qtype)  # the loader's way: the kernel
    assert torch.equal(got.codes, ref.codes) and _same_bits(got.scales, ref.scales) and _same_bits(got.lows, ref.lows)


def test_decode_declines_what_it_does_not_read():
    raw = random_blocks(4, 64, Q.Q8_0).reshape(-1, 34)
    codes, scales = np.empty(256, np.int8), np.empty(8, np.float32)
    assert not weight_codes.decode_gguf(raw, "Q2_K", codes, scales, None)  # a type it does not read
    assert not weight_codes.decode_gguf(raw[::2], "Q8_0", codes, scales, None)  # not contiguous
    assert not weight_codes.decode_gguf(raw, "Q8_0", codes.astype(np.int16), scales, None)
    assert not weight_codes.decode_gguf(random_blocks(4, 64, Q.Q4_1).reshape(-1, 20), "Q4_1", codes, scales,
                                        None)  # Q4_1 has lows
    assert not weight_codes.decode_gguf(raw, "Q8_0", codes[:-1], scales, None)  # too few codes
    assert not weight_codes.decode_gguf(raw, "Q8_0", codes, scales, np.empty(8, np.float32))  # Q8_0 has none
    assert not weight_codes.decode_gguf(raw.reshape(-1, 17), "Q8_0", codes, scales, None)  # not Q8_0's blocks
    assert weight_codes.decode_gguf(raw, "Q8_0", codes, scales, None)  # as it reads them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("with_lows", [False, True])
def test_dequantize_is_pytorch_bit_for_bit(dtype, group, with_lows):
    g = torch.Generator().manual_seed(group + with_lows)
    N, K = 37, 8 * group  # rows not a multiple of anything the loop splits by
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    codes[0] = 0  # zero codes: +0 or, times a negative scale, -0, as PyTorch gives it
    scales = torch.randn(N, K // group, generator=g) * 1e-3
    lows = torch.randn(N, K // group, generator=g) * 1e-2 if with_lows else None
    q = QuantCodes(codes, scales, lows, group, 256)
    ref = q.dense_torch(dtype)
    assert _same_bits(weight_codes.dequantize(codes, scales, lows, group, dtype), ref)
    assert _same_bits(q.dense(dtype), ref)  # dense() takes the kernel
    out = torch.empty(N * K + 5, dtype=dtype)[:N * K].view(N, K)
    assert q.dense(dtype, out) is out and _same_bits(out, ref)  # into a given buffer
    with pytest.raises(ValueError, match="out must be"):
        q.dense(dtype, torch.empty(N, K + 1, dtype=dtype))


def test_dequantize_declines_what_it_does_not_read():
    codes, scales = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2)
    assert weight_codes.dequantize(codes, scales, None, 32, torch.float16) is None  # dtype
    assert weight_codes.dequantize(codes.t().contiguous().t(), scales, None, 32, torch.float32) is None  # strided
    assert weight_codes.dequantize(codes, scales.double(), None, 32, torch.float32) is None
    assert weight_codes.dequantize(codes, scales, torch.ones(4, 3), 32, torch.float32) is None  # lows' shape
    assert weight_codes.dequantize(codes, scales, None, 48, torch.float32) is None  # groups
    assert weight_codes.dequantize(codes, scales, None, 32, torch.float32, torch.empty(4, 64)[:, :32]) is None
    # QuantCodes.dense then keeps PyTorch's code
    assert torch.equal(QuantCodes(codes, scales, None, 32, 256).dense(torch.float16), torch.zeros(4, 64).half())


@pytest.mark.parametrize("N,K", [(64, 32), (16, 64), (208, 96), (176, 1536)])  # last blocks of 16 and 48 rows
def test_int4_packing_is_pytorchs(N, K):
    g = torch.Generator().manual_seed(N + K)
    codes = torch.randint(0, 16, (N, K), dtype=torch.int8, generator=g)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    ours = weight_codes.pack_int4(codes)
    if weight_codes.int4_layout_matches():
        assert ours is not None and torch.equal(ours, theirs)
    else:  # a build that lays the codes out otherwise: PyTorch's own packing is used
        assert ours is None
    scales, lows = torch.rand(N, K // 32, generator=g), torch.rand(N, K // 32, generator=g)
    a, b = linear.int4_pack(codes, scales, lows), linear.int4_pack(codes.to(torch.int32), scales, lows)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert weight_codes.pack_int4(codes.to(torch.int32)) is None
    assert weight_codes.pack_int4(codes[:N - 8]) is None  # rows the int4 kernel does not pack


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@pytest.mark.parametrize("preset", [None, "0"])
def test_import_turns_on_huge_pages_before_torch_unless_told(preset):
    """`import headwise` sets THP_MEM_ALLOC_ENABLE before torch is imported (its allocator
    reads it once), and leaves a value the user set alone. Where the kernel gives huge
    pages only to memory that asks for them (madvise), a 64 MiB tensor then gets them,
    and with the value 0 it does not."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if preset is not None:
        env["THP_MEM_ALLOC_ENABLE"] = preset
    code = ("import os, sys; import headwise, torch\n"
            "def huge():\n"
            "    rollup = open('/proc/self/smaps_rollup').read().splitlines()\n"
            "    return int(next(l for l in rollup if l.startswith('AnonHugePages')).split()[1])\n"
            "before = huge(); t = torch.ones(64 << 20, dtype=torch.uint8)\n"
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), huge() - before)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    value, grown_kib = out.stdout.split()
    assert value == (preset or "1")
    if _thp_mode() == "madvise":
        assert (int(grown_kib) >= 32 << 10) == (preset is None)
