/* Matmul of any row count over a weight kept only as 4-bit codes, in the layout PyTorch's
 * int4 CPU matmul reads on AVX-512 builds (layers.linear.int4_pack, kernels/cpu_weights.c
 * pack_int4): codes [N / 64][K][32 B], byte d (d < 16) holding rows d and d + 32 of the
 * block (low, high nibble) and byte 16 + d rows d + 16 and d + 48; scales and offsets
 * sz [K / 32][N][2] bfloat16, the weight being w = (code - 8) * scale + offset, in float32
 * as PyTorch's kernel computes it, then rounded to bfloat16.
 *
 * Why: PyTorch's int4 kernel dequantizes each weight again for every 4 rows of x, so it
 * loses to the packed bfloat16 weight from about 16 rows on (layers/linear.py); a model
 * therefore keeps a dense copy of every 4-bit weight beside its codes, four times the
 * codes' bytes (Qwen2.5-Coder-1.5B: 3.1 GB). Here each 64-row block of the weight is
 * dequantized once per call, a K-tile at a time, into a bfloat16 scratch in the pair
 * layout of AVX512-BF16's dot product (vdpbf16ps: lane i sums elements 2i and 2i + 1),
 * and every row of x is multiplied against it there, 6 rows x 64 outputs (24 float32
 * accumulators) at a time. So the dequantization is paid once per weight per call, and
 * from 8 rows on a call takes 1.02-1.15x the packed weight's time
 * (benchmarks/bench_int4_gemm.py).
 *
 * x [M, K] bfloat16 (row stride sx), y [M, N] bfloat16 (row stride sy), accumulated in
 * float32 and rounded once (round to nearest even). Built by kernels/cpu_kernels.py with
 * -march=native; without AVX512-BF16 int4_gemm returns -1 and the caller keeps its path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 64   /* weight rows per block of the packed layout */
#define KT 1024 /* inputs per K-tile: a tile's scratch is 64 x 1024 bfloat16 (128 KiB, in L2) */
#define MT 6    /* rows of x per micro-tile: 6 x 4 accumulators + 4 weight registers */
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN (1 << 20)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* The K-tile [k0, k0 + kt) of one 64-row block (blk: its codes, sz at its first row, row
 * stride of sz N) -> scratch [kt / 2][4][32] bfloat16: for input pair p and row group g,
 * lanes [n0 k, n0 k+1, n1 k, n1 k+1, ...] for the 16 rows of the group. */
static void dequant_tile(const uint8_t *blk, const uint16_t *sz, int64_t N, int64_t k0, int64_t kt,
                         uint16_t *scratch)
{
    /* [k rows 0-15 | k+1 rows 0-15] -> pairs (row, k), (row, k+1) */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m128i nibble = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    for (int64_t kg = 0; kg < kt; kg += 32) {  /* a group: k0 and kt are multiples of 32 */
        const uint16_t *s = sz + ((k0 + kg) / 32) * N * 2;  /* 16 (scale, offset) per row group */
        __m512 scale[4], offset[4];
        for (int g = 0; g < 4; g++) {
            const __m512i sg = _mm512_loadu_si512(s + g * 32);
            scale[g] = _mm512_castsi512_ps(_mm512_slli_epi32(sg, 16));
            offset[g] = _mm512_castsi512_ps(_mm512_and_si512(sg, _mm512_set1_epi32((int)0xffff0000u)));
        }
        for (int64_t k = kg; k < kg + 32; k += 2) {
            __m512 w[2][4];
            for (int j = 0; j < 2; j++) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + (k0 + k + j) * 32));
                const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
                const __m128i c[4] = {_mm_and_si128(lo, nibble), _mm_and_si128(hi, nibble),
                                      _mm_and_si128(_mm_srli_epi16(lo, 4), nibble),
                                      _mm_and_si128(_mm_srli_epi16(hi, 4), nibble)};
                for (int g = 0; g < 4; g++)
                    w[j][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(c[g], eight))),
                                              scale[g], offset[g]);
            }
            uint16_t *dst = scratch + (k / 2) * 128;
            for (int g = 0; g < 4; g++) {
                const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(w[1][g], w[0][g]);
                _mm512_storeu_si512(dst + g * 32, _mm512_permutexvar_epi16(pairs, h));
            }
        }
    }
}

/* rows (<= MT, a constant in each specialisation) of x times one dequantized K-tile,
 * added into acc [rows][64] float32. */
static inline __attribute__((always_inline)) void micro(const uint16_t *x, int64_t sx, const int rows,
                                                        const uint16_t *scratch, int64_t kt, float *acc)
{
    __m512 a[MT][4];
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < 4; g++)
            a[m][g] = _mm512_loadu_ps(acc + m * 64 + g * 16);
    for (int64_t p = 0; p < kt / 2; p++) {
        const uint16_t *b = scratch + p * 128;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32),
                       b2 = (__m512bh)_mm512_loadu_si512(b + 64), b3 = (__m512bh)_mm512_loadu_si512(b + 96);
        for (int m = 0; m < rows; m++) {
            int32_t pair;  /* x[m, k], x[m, k + 1] */
            memcpy(&pair, x + m * sx + 2 * p, 4);
            const __m512bh xa = (__m512bh)_mm512_set1_epi32(pair);
            a[m][0] = _mm512_dpbf16_ps(a[m][0], xa, b0);
            a[m][1] = _mm512_dpbf16_ps(a[m][1], xa, b1);
            a[m][2] = _mm512_dpbf16_ps(a[m][2], xa, b2);
            a[m][3] = _mm512_dpbf16_ps(a[m][3], xa, b3);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < 4; g++)
            _mm512_storeu_ps(acc + m * 64 + g * 16, a[m][g]);
}

static void micro_any(const uint16_t *x, int64_t sx, int rows, const uint16_t *scratch, int64_t kt, float *acc)
{
    switch (rows) {
    case 6: micro(x, sx, 6, scratch, kt, acc); break;
    case 5: micro(x, sx, 5, scratch, kt, acc); break;
    case 4: micro(x, sx, 4, scratch, kt, acc); break;
    case 3: micro(x, sx, 3, scratch, kt, acc); break;
    case 2: micro(x, sx, 2, scratch, kt, acc); break;
    case 1: micro(x, sx, 1, scratch, kt, acc); break;
    }
}

/* Returns 0, -1 for shapes it does not take (M < 1, K not a multiple of 32, N not a
 * multiple of 64), -2 when out of memory. */
int int4_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
              int64_t N, uint16_t *y, int64_t sy, int threads)
{
    if (M < 1 || K % 32 || N % NB || N < NB)
        return -1;
    if (M * N * K < PARALLEL_MIN)
        threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint16_t *scratch = aligned_alloc(64, KT * NB * sizeof(uint16_t));
        float *acc = aligned_alloc(64, sizeof(float) * M * NB);
        failed = !scratch || !acc;
        /* Every thread meets the loop (a worksharing loop some threads skip would hang);
         * one without its buffers leaves its blocks unwritten and the call fails. */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < N / NB; i++) {
            if (failed)
                continue;
            const uint8_t *blk = codes + i * NB * K / 2;
            memset(acc, 0, sizeof(float) * M * NB);
            for (int64_t k0 = 0; k0 < K; k0 += KT) {
                const int64_t kt = K - k0 < KT ? K - k0 : KT;
                dequant_tile(blk, sz + i * NB * 2, N, k0, kt, scratch);
                for (int64_t m0 = 0; m0 < M; m0 += MT)
                    micro_any(x + m0 * sx + k0, sx, M - m0 < MT ? (int)(M - m0) : MT, scratch, kt, acc + m0 * NB);
            }
            for (int64_t m = 0; m < M; m++)
                for (int g = 0; g < 4; g++)
                    _mm256_storeu_si256((__m256i *)(y + m * sy + i * NB + g * 16),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + m * NB + g * 16)));
        }
        free(scratch);
        free(acc);
    }
    return failed ? -2 : 0;
}
#else
int int4_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
              int64_t N, uint16_t *y, int64_t sy, int threads)
{
    (void)x, (void)sx, (void)M, (void)K, (void)codes, (void)sz, (void)N, (void)y, (void)sy, (void)threads;
    return -1;
}
#endif
