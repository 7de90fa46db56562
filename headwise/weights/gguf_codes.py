"""GGUF block formats read as codes and scales (layers.quant.QuantCodes), not dequantized.

Each format stores groups of inputs as small integers with a float16 scale, and for some
a minimum; the K formats pack 6-bit sub-block scales into a 256-input super-block. The
tensor type names the format, so the codes are read, never searched for. The scales are
the float32 products gguf's dequantizers form (d * sc, dmin * m), so QuantCodes.dense()
equals gguf's float32 weight bit for bit (tests/test_gguf_codes.py).

Per block (bytes; fp16 = float16; the codes' bit layout as in ggml-quants.c):
    Q8_0   32 inputs:  d fp16, 32 x int8                     w = d * q
    Q4_0   32 inputs:  d fp16, 16 B nibbles                  w = d * (q - 8)
    Q4_1   32 inputs:  d, m fp16, 16 B nibbles               w = d * q + m
    Q5_0   32 inputs:  d fp16, 4 B high bits, 16 B nibbles   w = d * (q - 16)
    Q5_1   32 inputs:  d, m fp16, 4 B high bits, nibbles     w = d * q + m
    Q4_K  256 inputs:  d, dmin fp16, 12 B 6-bit scales/mins, 128 B nibbles
                       w = (d * sc) * q - (dmin * m) per 32
    Q5_K  256 inputs:  as Q4_K plus 32 B high bits
    Q6_K  256 inputs:  128 B low nibbles, 64 B 2-bit highs, 16 x int8 scales, d fp16
                       w = (d * sc) * (q - 32) per 16
Other types (F32, F16, Q2_K, Q3_K, IQ*) are not read here: the loader dequantizes them.

The C kernel (kernels.weight_codes.decode_gguf) decodes a tensor in one pass; the NumPy
decoders below are the reference it is tested against and the fallback where it is not
built (their temporaries, fresh memory per chunk, made Qwen2.5-Coder-1.5B's load several
times slower).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from headwise.kernels.weight_codes import decode_gguf
from headwise.layers.quant import QuantCodes

CHUNK_BYTES = 1 << 20  # raw bytes per decoding task (threads: numpy releases the GIL)
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [n, B] int8, scales, lows [n, B / G]


def _f16(b: np.ndarray) -> np.ndarray:
    # b [n, 2] uint8 -> [n, 1] float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # qs [n, 16 * k] uint8 -> [n, 32 * k]: per run of 16 bytes, low nibbles then high ones
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, 16) >> _NIBBLE_SHIFTS) & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # qh [n, 4] uint8 (a little-endian uint32) -> [n, 32] bits, input i's bit i
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(b: np.ndarray) -> Decoded:
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> Decoded:
    return (_nibbles(b[:, 2:]).astype(np.int8) - 8), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # s [n, 12] uint8 -> 6-bit scales and mins [n, 8]: bytes 0-3 scales 0-3 (low 6 bits),
    # 4-7 mins 0-3; bytes 8-11 the low nibbles of scales 4-7 and the high ones of mins 4-7,
    # whose top two bits sit in bytes 0-3 (scales) and 4-7 (mins)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray, q: np.ndarray) -> Decoded:
    # Q4_K / Q5_K: codes q [n, 256]; d, dmin fp16 then 12 B of scales
    sc, mn = _k_scales(b[:, 4:16])
    return q.astype(np.int8), _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mn)


def _q4_k(b: np.ndarray) -> Decoded:
    n = b.shape[0]
    # 4 runs of 32 bytes: low nibbles are sub-block 2j, high nibbles 2j + 1
    q = ((b[:, 16:].reshape(n, 4, 1, 32) >> _NIBBLE_SHIFTS) & 0x0F).reshape(n, 256)
    return _k_affine(b, q)


def _q5_k(b: np.ndarray) -> Decoded:
    n = b.shape[0]
    low = ((b[:, 48:].reshape(n, 4, 1, 32) >> _NIBBLE_SHIFTS) & 0x0F).reshape(n, 8, 32)
    # 32 bytes of high bits: bit j of byte i is input i of sub-block j
    high = ((b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1)
    return _k_affine(b, (low | (high << 4)).reshape(n, 256))


def _q6_k(b: np.ndarray) -> Decoded:
    n = b.shape[0]
    low = ((b[:, :128].reshape(n, 2, 1, 64) >> _NIBBLE_SHIFTS) & 0x0F).reshape(n, 8, 32)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
            & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).astype(np.int8) - 32
    scales = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(n, 256), scales, None


# formats with a minimum per group (their QuantCodes have lows)
WITH_LOWS = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K}
# type -> (decoder of raw blocks [n, block bytes], inputs per scale, levels)
FORMATS: dict[Q, tuple[Callable[[np.ndarray], Decoded], int, int]] = {
    Q.Q8_0: (_q8_0, 32, 256),
    Q.Q4_0: (_q4_0, 32, 16),
    Q.Q4_1: (_q4_1, 32, 16),
    Q.Q5_0: (_q5_0, 32, 32),
    Q.Q5_1: (_q5_1, 32, 32),
    Q.Q4_K: (_q4_k, 32, 16),
    Q.Q5_K: (_q5_k, 32, 32),
    Q.Q6_K: (_q6_k, 16, 64),
}


def read_codes(rows: np.ndarray, qtype: Q, threads: int = 2) -> QuantCodes | None:
    """rows [N, row bytes] uint8 (a GGUF tensor's raw data, one output row per row) of
    type `qtype` -> its QuantCodes [N, K], or None for a type FORMATS does not read."""
    if qtype not in FORMATS:
        return None
    decode, group, levels = FORMATS[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    N = rows.shape[0]
    blocks_per_row = rows.shape[1] // size
    K = blocks_per_row * block
    codes = np.empty((N, K), dtype=np.int8)
    scales = np.empty((N, K // group), dtype=np.float32)
    lows = np.empty_like(scales) if qtype in WITH_LOWS else None
    if not (rows.flags.c_contiguous and decode_gguf(rows.reshape(N * blocks_per_row, size), qtype.name,
                                                    codes.reshape(-1), scales.reshape(-1),
                                                    None if lows is None else lows.reshape(-1))):
        # NumPy's decoders (where the C kernel is not built), a chunk of rows per task
        step = max(1, CHUNK_BYTES // max(rows.shape[1], 1))

        def chunk(r: int) -> None:
            part = rows[r:r + step]
            n = part.shape[0]
            q, s, m = decode(np.ascontiguousarray(part).reshape(n * blocks_per_row, size))
            codes[r:r + n] = q.reshape(n, K)
            scales[r:r + n] = s.reshape(n, K // group)
            if m is not None:
                lows[r:r + n] = m.reshape(n, K // group)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(chunk, range(0, N, step)))
    return QuantCodes(torch.from_numpy(codes), torch.from_numpy(scales),
                      None if lows is None else torch.from_numpy(lows), group, levels)
