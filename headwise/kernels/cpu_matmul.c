/* Decode-sized matmul over a weight kept as int8 codes with one float32 scale per group
 * of G = 32 or 16 inputs (GGUF's Q8_0, Q5_0 and Q4_0 tensors are exactly that with 32,
 * Q6_K and Q3_K with 16), and optionally a float32 minimum per group (Q5_1, Q5_K):
 *     y[m, n] = sum_i x[m, i] * (scale[n, i / G] * code[n, i] + low[n, i / G])
 * for a few rows m (decode steps). Such a call reads every weight once, so it is bound
 * by memory bandwidth: int8 codes are half the bytes of a bfloat16 weight. Each weight is
 * dequantized in float32 (scale * code is exact there, as in GGUF's own dequantization:
 * a float16 scale, times a 6-bit sub-block scale for the K formats, times a code) and multiplied into float32 accumulators, one per input lane, summed at
 * the end of the row; x is float32 or bfloat16 (bf16 = 1), y the same, rounded once.
 *
 * Built and loaded at run time by headwise/kernels/cpu_kernels.py, like cpu_decode.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define GROUP 32  /* inputs per step of the loops below; a scale covers G = 32 or 16 */
#define MAX_ROWS 8
/* Below this many weights a call runs on one thread. */
#define PARALLEL_MIN (1 << 16)

static inline void store(void *out, int64_t i, const int bf16, float y)
{
    if (bf16)
        ((uint16_t *)out)[i] = to_bf16(y);
    else
        ((float *)out)[i] = y;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif

/* Output rows [n0, n1) for M input rows xf [M, K] (float32, packed); M is a constant in
 * each specialisation, so the 2 * M accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows(const float *xf, const int64_t M, int64_t K,
                                                       const int8_t *codes, int64_t sc, const float *scales,
                                                       const float *lows, int64_t ss, const int64_t G,
                                                       int64_t n0, int64_t n1, void *out, int64_t so,
                                                       const int bf16)
{
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *c = codes + n * sc;
        const float *s = scales + n * ss;
        const float *lo = lows ? lows + n * ss : NULL;
        __m512 acc[MAX_ROWS][2];
        for (int64_t m = 0; m < M; m++)
            acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += GROUP) {
            _mm_prefetch((const char *)(c + PREFETCH_ROWS * sc + k0), _MM_HINT_T0);
            __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(s[k0 / G]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(c + k0)))));
            __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(s[(k0 + 16) / G]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(c + k0 + 16)))));
            if (lo) {
                w0 = _mm512_add_ps(w0, _mm512_set1_ps(lo[k0 / G]));
                w1 = _mm512_add_ps(w1, _mm512_set1_ps(lo[(k0 + 16) / G]));
            }
            for (int64_t m = 0; m < M; m++) {
                acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + k0), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * K + k0 + 16), acc[m][1]);
            }
        }
        for (int64_t m = 0; m < M; m++)
            store(out, m * so + n, bf16, _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])));
    }
}
#else
/* Portable version of the above: one float32 accumulator per input lane of a group. */
static inline __attribute__((always_inline)) void rows(const float *xf, const int64_t M, int64_t K,
                                                       const int8_t *codes, int64_t sc, const float *scales,
                                                       const float *lows, int64_t ss, const int64_t G,
                                                       int64_t n0, int64_t n1, void *out, int64_t so,
                                                       const int bf16)
{
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *c = codes + n * sc;
        const float *s = scales + n * ss;
        const float *lo = lows ? lows + n * ss : NULL;
        float acc[MAX_ROWS][GROUP];
        memset(acc, 0, sizeof(acc));
        for (int64_t k0 = 0; k0 < K; k0 += GROUP) {
            float w[GROUP];
            #pragma omp simd
            for (int i = 0; i < GROUP; i++)
                w[i] = s[(k0 + i) / G] * (float)c[k0 + i] + (lo ? lo[(k0 + i) / G] : 0.f);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = xf + m * K + k0;
                #pragma omp simd
                for (int i = 0; i < GROUP; i++)
                    acc[m][i] += w[i] * xm[i];
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float y = 0.f;
            for (int i = 0; i < GROUP; i++)
                y += acc[m][i];
            store(out, m * so + n, bf16, y);
        }
    }
}
#endif

/* One specialisation per (M, G, bf16). */
#define ROWS_G(m, g) \
    if (bf16) \
        rows(xf, m, K, codes, sc, scales, lows, ss, g, n0, n1, out, so, 1); \
    else \
        rows(xf, m, K, codes, sc, scales, lows, ss, g, n0, n1, out, so, 0);
#define ROWS_CASE(m) \
    case m: \
        if (G == 32) { \
            ROWS_G(m, 32) \
        } else { \
            ROWS_G(m, 16) \
        } \
        break;

static void rows_any(const float *xf, int64_t M, int64_t K, const int8_t *codes, int64_t sc, const float *scales,
                     const float *lows, int64_t ss, int64_t G, int64_t n0, int64_t n1, void *out, int64_t so,
                     int bf16)
{
    switch (M) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
}

/* x [M, K] (row stride sx, elements), codes [N, K] (row stride sc), scales and lows
 * [N, K / G] (row stride ss; lows may be NULL), out [M, N] (row stride so). Returns 0, or
 * -1 when M, K or G is out of range (M > MAX_ROWS, K not a multiple of 32, G neither 32
 * nor 16) and -2 when out of memory. */
int int8_matmul(const void *x, int64_t sx, int64_t M, int64_t K, const int8_t *codes, int64_t sc,
                const float *scales, const float *lows, int64_t ss, int64_t G, int64_t N, void *out,
                int64_t so, int bf16, int threads)
{
    if (M < 1 || M > MAX_ROWS || K % GROUP || (G != 32 && G != 16))
        return -1;
    float *xf = malloc(sizeof(float) * M * K);
    if (!xf)
        return -2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            xf[m * K + k] = bf16 ? from_bf16(((const uint16_t *)x)[m * sx + k]) : ((const float *)x)[m * sx + k];
    if (N * K < PARALLEL_MIN)
        threads = 1;
    const int64_t chunk = 64;  /* output rows per task */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        int64_t n1 = n0 + chunk < N ? n0 + chunk : N;
        rows_any(xf, M, K, codes, sc, scales, lows, ss, G, n0, n1, out, so, bf16);
    }
    free(xf);
    return 0;
}
