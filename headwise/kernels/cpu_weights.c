/* A model's weights at start-up, kept as integer codes (layers.quant.QuantCodes):
 *   decode_gguf   GGUF blocks -> codes, scales and lows (weights.gguf_codes)
 *   dequantize    codes -> the dense weight in float32 or bfloat16 (QuantCodes.dense)
 *   pack_int4     4-bit codes -> the packed form of PyTorch's int4 CPU matmul
 * Each is one pass over the weight with no temporaries. The NumPy and PyTorch code these
 * replace made several passes, each into new memory the kernel had to zero first: on
 * this project's VM, most of the time Qwen2.5-Coder-1.5B took to load and prepare.
 *
 * Built and loaded at run time by headwise/kernels/cpu_kernels.py, like cpu_decode.c,
 * with -ffp-contract=off: scale * code + low is rounded twice, as GGUF's dequantizers
 * round it, never fused. Results equal the NumPy / PyTorch code bit for bit
 * (tests/test_weight_codes.py).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Below this many elements a call runs on one thread. */
#define PARALLEL_MIN 32768

/* ---- GGUF blocks ---------------------------------------------------------------- */

/* Tensor types, numbered as weight_codes.py names them (not GGML's numbers). */
enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, N_TYPES };
/* per type: bytes per block, inputs per block, inputs per scale, whether it has lows
 * (decode_gguf checks its caller's arrays against these) */
static const int64_t BLOCK_BYTES[N_TYPES] = {34, 18, 20, 22, 24, 144, 176, 210};
static const int64_t BLOCK_INPUTS[N_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int64_t GROUP[N_TYPES] = {32, 32, 32, 32, 32, 32, 32, 16};
static const int HAS_LOWS[N_TYPES] = {0, 0, 1, 0, 1, 1, 1, 0};

/* IEEE half (little-endian bytes) -> float32, exactly (as NumPy converts it) */
static inline float f16(const uint8_t *p)
{
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f);  /* zero or subnormal: man * 2^-24, exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);  /* inf, NaN with its payload */
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The 6-bit scale and minimum of sub-block j (0..7) of a K-format block's 12 bytes s:
 * bytes 0-3 scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 the low nibbles of scales
 * 4-7 and the high ones of mins 4-7, whose top two bits sit in bytes 0-3 and 4-7. */
static inline void k_scale(const uint8_t *s, int j, float *sc, float *mn)
{
    if (j < 4) {
        *sc = (float)(s[j] & 0x3f);
        *mn = (float)(s[j + 4] & 0x3f);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
    }
}

/* One block b of type t: its codes c [inputs], scales sc and lows lo [inputs / group]. */
static inline void decode_block(const uint8_t *b, int t, int8_t *c, float *sc, float *lo)
{
    switch (t) {
    case Q8_0:
        sc[0] = f16(b);
        memcpy(c, b + 2, 32);
        break;
    case Q4_0:
        sc[0] = f16(b);
        for (int i = 0; i < 16; i++) {
            c[i] = (int8_t)((b[2 + i] & 0x0f) - 8);
            c[i + 16] = (int8_t)((b[2 + i] >> 4) - 8);
        }
        break;
    case Q4_1:
        sc[0] = f16(b);
        lo[0] = f16(b + 2);
        for (int i = 0; i < 16; i++) {
            c[i] = (int8_t)(b[4 + i] & 0x0f);
            c[i + 16] = (int8_t)(b[4 + i] >> 4);
        }
        break;
    case Q5_0:
    case Q5_1: {
        /* high bits: a little-endian uint32, input i's bit i */
        const int off = t == Q5_0 ? 2 : 4;
        const uint8_t *qh = b + off, *qs = b + off + 4;
        sc[0] = f16(b);
        if (t == Q5_1)
            lo[0] = f16(b + 2);
        for (int i = 0; i < 16; i++) {
            int lo4 = qs[i] & 0x0f, hi4 = qs[i] >> 4;
            int h0 = (qh[i >> 3] >> (i & 7)) & 1, h1 = (qh[(i + 16) >> 3] >> ((i + 16) & 7)) & 1;
            c[i] = (int8_t)((lo4 | (h0 << 4)) - (t == Q5_0 ? 16 : 0));
            c[i + 16] = (int8_t)((hi4 | (h1 << 4)) - (t == Q5_0 ? 16 : 0));
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        /* d, dmin fp16; 12 B of 6-bit scales; (Q5_K: 32 B of high bits, bit j of byte i is
         * input i of sub-block j); 128 B of nibbles in 4 runs of 32: low nibbles are
         * sub-block 2r, high ones 2r + 1. w = (d * sc) * q - (dmin * m) per 32 */
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (t == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            float s6, m6;
            k_scale(b + 4, j, &s6, &m6);
            sc[j] = d * s6;
            lo[j] = -(dmin * m6);
        }
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 32; i++) {
                int q0 = qs[r * 32 + i] & 0x0f, q1 = qs[r * 32 + i] >> 4;
                if (t == Q5_K) {
                    q0 |= ((qh[i] >> (2 * r)) & 1) << 4;
                    q1 |= ((qh[i] >> (2 * r + 1)) & 1) << 4;
                }
                c[(2 * r) * 32 + i] = (int8_t)q0;
                c[(2 * r + 1) * 32 + i] = (int8_t)q1;
            }
        break;
    }
    case Q6_K: {
        /* 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, d fp16. Input p = 128 h + r:
         * low nibble of byte 64 h + r % 64 (shifted by 4 where r >= 64), high bits of byte
         * 32 h + r % 32 shifted by 2 (r / 32). w = (d * sc) * (q - 32) per 16 */
        const uint8_t *ql = b, *qh = b + 128;
        const float d = f16(b + 208);
        for (int g = 0; g < 16; g++)
            sc[g] = d * (float)(int8_t)b[192 + g];
        for (int p = 0; p < 256; p++) {
            const int h = p >> 7, r = p & 127;
            const int low = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0f;
            const int high = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 0x03;
            c[p] = (int8_t)((low | (high << 4)) - 32);
        }
        break;
    }
    }
}

/* `blocks` consecutive blocks of `block_bytes` each, of type t (a tensor's rows, one
 * after another) -> codes [n_codes = blocks * inputs], scales and lows [n_scales = blocks
 * * inputs / group] (lows NULL for types without). Returns 0, or -1 (nothing written) for
 * a type this file does not read or sizes that are not the type's. */
int decode_gguf(const uint8_t *raw, int64_t blocks, int64_t block_bytes, int t, int8_t *codes, int64_t n_codes,
                float *scales, int64_t n_scales, float *lows, int nthreads)
{
    if (t < 0 || t >= N_TYPES || HAS_LOWS[t] != (lows != NULL) || block_bytes != BLOCK_BYTES[t]
            || n_codes != blocks * BLOCK_INPUTS[t] || n_scales != blocks * (BLOCK_INPUTS[t] / GROUP[t]))
        return -1;
    const int64_t bb = BLOCK_BYTES[t], bi = BLOCK_INPUTS[t], groups = bi / GROUP[t];
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks * bi >= PARALLEL_MIN)
    for (int64_t i = 0; i < blocks; i++)
        decode_block(raw + i * bb, t, codes + i * bi, scales + i * groups, lows ? lows + i * groups : NULL);
    return 0;
}

/* ---- dequantization --------------------------------------------------------------- */

static inline void put(void *base, int64_t i, int bf16, float f)
{
    if (bf16)
        ((uint16_t *)base)[i] = to_bf16(f);
    else
        ((float *)base)[i] = f;
}

/* One row of dequantize, inlined with constant types. */
static inline __attribute__((always_inline)) void
dequant_row(const int8_t *c, const float *s, const float *lo, int64_t K, int64_t G, char *orow,
            const int has_low, const int bf16)
{
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        const float sc = s[g0 / G], low = has_low ? lo[g0 / G] : 0.f;
        #pragma omp simd
        for (int64_t i = g0; i < g0 + G; i++) {
            float w = (float)c[i] * sc;
            if (has_low)
                w += low;
            put(orow, i, bf16, w);
        }
    }
}

/* out [N, K] = scale[n, k / G] * code[n, k] (+ low[n, k / G] where lows is given), each
 * product and sum rounded to float32, then to bfloat16 (bf16 = 1) or kept float32.
 * codes [N, K] int8, scales and lows [N, K / G] float32, all packed. */
void dequantize(const int8_t *codes, const float *scales, const float *lows, int64_t N, int64_t K,
                int64_t G, void *out, int bf16, int nthreads)
{
    const size_t e = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * (K / G), *lo = lows ? lows + n * (K / G) : NULL;
        char *orow = (char *)out + n * K * e;
        if (lo && bf16)
            dequant_row(c, s, lo, K, G, orow, 1, 1);
        else if (lo)
            dequant_row(c, s, lo, K, G, orow, 1, 0);
        else if (bf16)
            dequant_row(c, s, lo, K, G, orow, 0, 1);
        else
            dequant_row(c, s, lo, K, G, orow, 0, 0);
    }
}

/* ---- 4-bit packing ----------------------------------------------------------------- */

/* 4-bit codes [N, K] (int8, 0..15) -> [N, K / 2] bytes in the layout PyTorch's
 * _convert_weight_to_int4pack_for_cpu writes on AVX-512 builds (it takes int32 codes:
 * four times the bytes, made by a cast of their own): rows in blocks of 64, each
 * block's K columns one after another, 32 bytes per column, byte d (d < 16) holding rows
 * d and d + 32 of the block (low, high nibble) and byte 16 + d rows d + 16 and d + 48. A
 * last block of fewer rows holds them in pairs (n, n + 1) per byte. Other builds lay the
 * codes out otherwise: the caller compares this with PyTorch's on probes first. */
void pack_int4(const int8_t *codes, int64_t N, int64_t K, uint8_t *out, int nthreads)
{
    const int64_t B = 64, blocks = (N + B - 1) / B;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= PARALLEL_MIN)
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t nb = N - i * B < B ? N - i * B : B;
        const int8_t *src = codes + i * B * K;
        uint8_t *dst = out + i * B * K / 2;
        for (int64_t k = 0; k < K; k++) {
            if (nb == B) {
                for (int64_t d = 0; d < 16; d++) {
                    dst[k * 32 + d] = (uint8_t)(src[d * K + k] | (src[(d + 32) * K + k] << 4));
                    dst[k * 32 + 16 + d] = (uint8_t)(src[(d + 16) * K + k] | (src[(d + 48) * K + k] << 4));
                }
            } else {
                for (int64_t n = 0; n < nb; n += 2)
                    dst[k * nb / 2 + n / 2] = (uint8_t)(src[n * K + k] | (src[(n + 1) * K + k] << 4));
            }
        }
    }
}
