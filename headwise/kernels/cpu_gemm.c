/* Matmul of any row count over a weight kept only as codes. int4_gemm: 4-bit codes, in the
 * layout PyTorch's int4 CPU matmul reads on AVX-512 builds (layers.int4.int4_pack,
 * kernels/cpu_weights.c pack_int4): codes [N / 64][K][32 B], byte d (d < 16) holding rows
 * d and d + 32 of the block (low, high nibble) and byte 16 + d rows d + 16 and d + 48;
 * scales and offsets sz [K / 32][N][2] bfloat16, the weight being w = (code - 8) * scale
 * + offset, in float32 as PyTorch's kernel computes it, then rounded to bfloat16.
 *
 * Why: PyTorch's int4 kernel dequantizes each weight again for every 4 rows of x, so it
 * loses to the packed bfloat16 weight from about 16 rows on (layers/linear.py); a model
 * therefore keeps a dense copy of every 4-bit weight beside its codes, four times the
 * codes' bytes (Qwen2.5-Coder-1.5B: 3.1 GB). Here each 64-row block of the weight is
 * dequantized once per call, a K-tile at a time, into a bfloat16 scratch in the pair
 * layout of AVX512-BF16's dot product (vdpbf16ps: lane i sums elements 2i and 2i + 1),
 * and every row of x is multiplied against it there, 6 rows x 64 outputs (24 float32
 * accumulators) at a time. So the dequantization is paid once per weight per call, and
 * from 8 rows on a call takes 1.02-1.15x the packed weight's time on a CPU without AMX
 * (benchmarks/bench_codes_gemm.py); with AMX, 0.6-0.9x up to 64 rows.
 *
 * int8_gemm does the same over a weight kept as int8 codes with a float32 scale (and a
 * float32 minimum, or none) per 16 or 32 inputs, row-major [N, K] (kernels.int8_matmul's
 * layout: GGUF Q8_0, Q6_K, Q5_0, Q5_K ...): w = code * scale (+ low), rounded once per
 * operation in float32 as layers.quant's dense weight is, then to bfloat16, so the tile
 * holds exactly the dense bfloat16 weight. Its rows are row-major, so each 16 rows x 16
 * input pairs of a tile are transposed in registers into the pair layout.
 *
 * x [M, K] bfloat16 (row stride sx), y [M, N] bfloat16 (row stride sy), accumulated in
 * float32 and rounded once (round to nearest even). Built by kernels/cpu_kernels.py with
 * -march=native; without AVX512-BF16 both return -1 and the caller keeps its path.
 *
 * On a CPU with AMX (Sapphire Rapids on), the rows of x are multiplied against the tile
 * with AMX's tile dot product instead: the tile's pair layout is already the one AMX
 * reads for its second operand (16 input pairs x 16 rows a tile, 64 bytes a pair row),
 * and x's rows are its first as they lie. oneDNN's packed weight multiplies with AMX on
 * such a CPU, so with the vector dot product alone a prefill chunk over the codes took
 * 5-7x its time (benchmarks/bench_codes_gemm.py, docs/benchmarks.md). Each row is still
 * summed in one order however the rows are split (a 16-row band or fewer: AMX sums each
 * row alone), but not in the vector path's order: gemm_amx(0) turns AMX off (tests,
 * benchmarks).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 64   /* weight rows per block of the packed layout */
#define KT 1024 /* inputs per K-tile: a tile's scratch is 64 x 1024 bfloat16 (128 KiB, in L2) */
#define MT 6    /* rows of x per micro-tile: 6 x 4 accumulators + 4 weight registers */
#define MCHUNK 480 /* rows of x per task at most (a multiple of MT and of AMX's 16): 120 KiB of accumulators */
/* With AMX: a 256-input K-tile (32 KiB of scratch, in L1: every 16-row band of x reads
 * the whole tile; 1024 took 1.2-1.5x the time from 512 rows of x on). Runs of 960 or 2048
 * rows instead of MCHUNK measured the same or slower. */
#define KT_AMX 256
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN (1 << 20)
#define PREFETCH 192 /* bytes ahead of an int8 row's codes that tile8 asks for */
/* Bytes ahead of a 4-bit block's codes that dequant_tile asks for (past the block's end:
 * the next block's, a thread's next task). Weights larger than the last-level cache's
 * share stream from memory, and dequantizing does too much work per byte for the
 * hardware's own prefetch to run far enough ahead: a synthetic 660 MB of codes at 16
 * rows read 5.0 GB/s (152 ms) without asking, 7.3 GB/s (100 ms) with it (1024-4096
 * bytes measured the same), near the 7.7 GB/s of codes that fit in cache. */
#define PREFETCH4 2048

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* -1 not asked yet, 0 off (turned off, or Linux refused the tile state), 1 on. */
static int amx_on = -1;

/* Whether AMX multiplies: want 1 asks Linux for the tile state (a process has none until
 * it asks; oneDNN asks too, the same way) and uses it if granted, 0 turns it off, -1 only
 * reports (asking the first time). Called from Python, one call at a time. */
int gemm_amx(int want)
{
    if (want == 0) {
        amx_on = 0;
    } else if (want == 1 || amx_on < 0) {
        amx_on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_on;
}

/* AMX's tile configuration (palette 1): per tile its rows and bytes per row. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* The tiles' shapes for a band of `rows` (<= 16) rows of x: tiles 0-3 accumulators
 * [rows][16] float32 for the four 16-output groups of the block, tile 4 the band's rows
 * of x [rows][32] bfloat16 (16 input pairs), tiles 5-7 the weight, [16 pairs][16 outputs
 * x 2] bfloat16. */
static void amx_configure(int rows)
{
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t < 5 ? rows : 16;
    }
    _tile_loadconfig(&c);
}

/* rows of x (any count) times one dequantized K-tile (scratch [kt / 2][64 outputs][2]),
 * added into acc [rows][64] float32, 16 rows at a time. (Two bands against half the
 * outputs each, reading each weight tile once for 32 rows, measured the same.)
 * *configured: the rows the thread's tiles are configured for (0: none yet). */
static void amx_micro(const uint16_t *x, int64_t sx, int64_t rows, const uint16_t *scratch, int64_t kt,
                      float *acc, int *configured)
{
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int r = rows - m0 < 16 ? (int)(rows - m0) : 16;
        if (r != *configured) {
            amx_configure(r);
            *configured = r;
        }
        float *a = acc + m0 * NB;
        const uint16_t *xr = x + m0 * sx;
        _tile_loadd(0, a, NB * 4);
        _tile_loadd(1, a + 16, NB * 4);
        _tile_loadd(2, a + 32, NB * 4);
        _tile_loadd(3, a + 48, NB * 4);
        for (int64_t p0 = 0; p0 < kt / 2; p0 += 16) {
            const uint16_t *b = scratch + p0 * 2 * NB;
            _tile_loadd(4, xr + 2 * p0, sx * 2);
            _tile_loadd(5, b, NB * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 32, NB * 4);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 64, NB * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 96, NB * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, a, NB * 4);
        _tile_stored(1, a + 16, NB * 4);
        _tile_stored(2, a + 32, NB * 4);
        _tile_stored(3, a + 48, NB * 4);
    }
}
#endif

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
        for (int line = 0; line < 4; line++)  /* the next group's 256 bytes, N * 4 bytes on */
            _mm_prefetch((const char *)(s + N * 2) + 64 * line, _MM_HINT_T0);
        __m512 scale[4], offset[4];
        for (int g = 0; g < 4; g++) {
            const __m512i sg = _mm512_loadu_si512(s + g * 32);
            scale[g] = _mm512_castsi512_ps(_mm512_slli_epi32(sg, 16));
            offset[g] = _mm512_castsi512_ps(_mm512_and_si512(sg, _mm512_set1_epi32((int)0xffff0000u)));
        }
        for (int64_t k = kg; k < kg + 32; k += 2) {
            __m512 w[2][4];
            _mm_prefetch((const char *)(blk + (k0 + k) * 32 + PREFETCH4), _MM_HINT_T0);
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

/* A weight in one of the two forms a tile is dequantized from. */
struct weight {
    int64_t N, K;
    const uint8_t *codes4; /* 4-bit: codes in the int4 kernel's layout, */
    const uint16_t *sz;    /* its scales and offsets */
    const int8_t *codes8;  /* int8: codes [N, K], */
    const float *scales;   /* scales [N, K / group], */
    const float *lows;     /* minimums like scales, or NULL */
    int64_t group;         /* inputs per scale: 16 or 32 */
};

typedef void (*tile_fn)(const struct weight *w, int64_t block, int64_t k0, int64_t kt, uint16_t *scratch);

static void tile4(const struct weight *w, int64_t block, int64_t k0, int64_t kt, uint16_t *scratch)
{
    dequant_tile(w->codes4 + block * NB * w->K / 2, w->sz + block * NB * 2, w->N, k0, kt, scratch);
}

/* r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit lanes (each lane an input pair). */
static inline void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  /* per 128-bit lane: pairs of rows interleaved */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + c], 128-bit lane L: column 4L + c of rows i..i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {      /* gather column 4L + c's four 128-bit pieces */
        const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i e = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(a, b, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(a, b, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(e, f, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(e, f, 0xdd);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* The K-tile [k0, k0 + kt) of 64-row block `block` of an int8 weight -> scratch, laid out
 * as dequant_tile's: each row's 32 inputs of a step as 16 bfloat16 pairs, then 16 rows'
 * pairs transposed so that a pair's 16 rows lie side by side. */
static void tile8(const struct weight *w, int64_t block, int64_t k0, int64_t kt, uint16_t *scratch)
{
    const int64_t K = w->K, G = w->group, groups = K / G, second = G == 16; /* the upper 16 inputs' scale */
    for (int g = 0; g < 4; g++) {
        const int64_t n0 = block * NB + g * 16;
        for (int64_t kc = 0; kc < kt; kc += 32) {
            const int64_t k = k0 + kc;
            __m512i v[16];
            for (int r = 0; r < 16; r++) {
                const int8_t *c = w->codes8 + (n0 + r) * K + k;
                _mm_prefetch((const char *)c + PREFETCH, _MM_HINT_T0);
                const float *s = w->scales + (n0 + r) * groups + k / G;
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
                lo = _mm512_mul_ps(lo, _mm512_set1_ps(s[0]));  /* not fused: rounded as the dense weight */
                hi = _mm512_mul_ps(hi, _mm512_set1_ps(s[second]));
                if (w->lows) {
                    const float *l = w->lows + (n0 + r) * groups + k / G;
                    lo = _mm512_add_ps(lo, _mm512_set1_ps(l[0]));
                    hi = _mm512_add_ps(hi, _mm512_set1_ps(l[second]));
                }
                v[r] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  /* lane j: inputs k + 2j, k + 2j + 1 */
            }
            transpose16(v);
            for (int j = 0; j < 16; j++)
                _mm512_storeu_si512(scratch + (kc / 2 + j) * 128 + g * 32, v[j]);
        }
    }
}

/* The gated product's activations, on float32 vectors: act(gate) * up. */
enum { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU_TANH = 2 };

/* e^x, float32: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor
 * polynomial of degree 6 (relative error below 2e-7, beside bfloat16's 2^-9); x clamped
 * where e^x leaves float32's range. */
static inline __m512 exp_ps(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) = g / (1 + e^-g); gelu_tanh(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g +
 * 0.044715 g^3), as g (1 - 1 / (e^2u + 1)). */
static inline __m512 activate_ps(__m512 g, int act)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == ACT_SILU)
        return _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f),
                                   _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g),
                                                   _mm512_mul_ps(g, g), g));
    const __m512 e = exp_ps(_mm512_add_ps(u, u));
    return _mm512_mul_ps(g, _mm512_sub_ps(one, _mm512_div_ps(one, _mm512_add_ps(e, one))));
}

/* acc [rows][64] = rows of x times block `block` of w, over all of K, a K-tile at a time. */
static void block_product(const uint16_t *x, int64_t sx, int64_t rows, const struct weight *w, tile_fn tile,
                          int64_t block, int64_t ktile, int amx, uint16_t *scratch, float *acc, int *configured)
{
    (void)amx, (void)configured;
    memset(acc, 0, sizeof(float) * rows * NB);
    for (int64_t k0 = 0; k0 < w->K; k0 += ktile) {
        const int64_t kt = w->K - k0 < ktile ? w->K - k0 : ktile;
        tile(w, block, k0, kt, scratch);
#ifdef ARCH_REQ_XCOMP_PERM
        if (amx) {  /* amx is 1 only where this is compiled */
            amx_micro(x + k0, sx, rows, scratch, kt, acc, configured);
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < rows; m0 += MT)
            micro_any(x + m0 * sx + k0, sx, rows - m0 < MT ? (int)(rows - m0) : MT, scratch, kt, acc + m0 * NB);
    }
}

/* y = x w^T over `blocks` 64-row blocks of the weight, each dequantized a K-tile at a time
 * by `tile`, for runs of at most MCHUNK rows of x (the accumulators of a run stay in L2).
 * A weight of few blocks (SmolLM2's 576 outputs: 9) is also split by rows of x so that
 * every thread gets as much: each (block, run) is a task, and a run's tiles are
 * dequantized again, which costs little beside multiplying hundreds of rows. A thread's
 * tasks take a run's blocks one after another, so that the run's rows of x stay in its
 * L2 while the codes stream past (block-major order: 1.2-1.5x the time at 2048 rows
 * with AMX, where each block re-read every run of x from L3). Each output is summed in
 * the same order however the work is split.
 *
 * Gated (up not NULL): output block i is act(x gate_i^T) * (x up_(i + up0)^T), gate_i
 * being block i of w, both products kept in float32 and rounded once: the MLP's
 * act(gate(x)) * up(x) with no pass over a [M, 2 I] product (the packed dense weight
 * fuses the same into oneDNN's matmul). Returns 0, or -2 when out of memory. */
static int gemm(const uint16_t *x, int64_t sx, int64_t M, const struct weight *w, tile_fn tile, int64_t blocks,
                const struct weight *up, int64_t up0, int act, uint16_t *y, int64_t sy, int threads)
{
    const int64_t K = w->K;
    if (M * blocks * NB * K * (up ? 2 : 1) < PARALLEL_MIN)
        threads = 1;
#ifdef ARCH_REQ_XCOMP_PERM
    const int amx = amx_on == 1;
#else
    const int amx = 0;
#endif
    const int64_t ktile = amx ? KT_AMX : KT;
    int64_t runs = (M + MCHUNK - 1) / MCHUNK;
    if (threads > 1 && (blocks * runs) % threads && M >= 2 * MT * threads)
        runs = (runs + threads - 1) / threads * threads;  /* tasks a multiple of the threads */
    const int64_t unit = amx ? 16 : MT;  /* rows a run is a multiple of: a micro-tile's */
    const int64_t step = ((M + runs - 1) / runs + unit - 1) / unit * unit;
    const size_t acc_bytes = sizeof(float) * (step < M ? step : M) * NB;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int configured = 0;  /* the rows this thread's AMX tiles are configured for, or none */
        uint16_t *scratch = aligned_alloc(64, ktile * NB * sizeof(uint16_t));
        float *acc = aligned_alloc(64, acc_bytes), *acc2 = up ? aligned_alloc(64, acc_bytes) : NULL;
        failed = !scratch || !acc || (up && !acc2);
        /* Every thread meets the loop (a worksharing loop some threads skip would hang);
         * one without its buffers leaves its tasks unwritten and the call fails. */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < blocks * runs; t++) {
            const int64_t i = t % blocks, r0 = t / blocks * step, rows = M - r0 < step ? M - r0 : step;
            if (failed || rows <= 0)
                continue;
            block_product(x + r0 * sx, sx, rows, w, tile, i, ktile, amx, scratch, acc, &configured);
            if (up)
                block_product(x + r0 * sx, sx, rows, up, tile, i + up0, ktile, amx, scratch, acc2, &configured);
            for (int64_t m = 0; m < rows; m++)
                for (int g = 0; g < 4; g++) {
                    __m512 v = _mm512_loadu_ps(acc + m * NB + g * 16);
                    if (up)
                        v = _mm512_mul_ps(activate_ps(v, act), _mm512_loadu_ps(acc2 + m * NB + g * 16));
                    _mm256_storeu_si256((__m256i *)(y + (r0 + m) * sy + i * NB + g * 16),
                                        (__m256i)_mm512_cvtneps_pbh(v));
                }
        }
#ifdef ARCH_REQ_XCOMP_PERM
        if (configured)
            _tile_release();
#endif
        free(scratch);
        free(acc);
        free(acc2);
    }
    return failed ? -2 : 0;
}

/* Returns 0, -1 for shapes it does not take (M < 1, K not a multiple of 32, N not a
 * multiple of 64), -2 when out of memory. */
int int4_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
              int64_t N, uint16_t *y, int64_t sy, int threads)
{
    if (M < 1 || K % 32 || N % NB || N < NB)
        return -1;
    const struct weight w = {.N = N, .K = K, .codes4 = codes, .sz = sz};
    return gemm(x, sx, M, &w, tile4, N / NB, NULL, 0, ACT_NONE, y, sy, threads);
}

/* The gated product over one 4-bit weight of N = 2 I rows, gate's then up's (a fused
 * gate/up projection): y [M, I] = act(x gate^T) * (x up^T), act ACT_SILU or
 * ACT_GELU_TANH. Returns as int4_gemm, and -1 also where I is not a multiple of 64 or
 * act is another. */
int int4_gemm_glu(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
                  int64_t N, int act, uint16_t *y, int64_t sy, int threads)
{
    if (M < 1 || K % 32 || N % (2 * NB) || N < 2 * NB || (act != ACT_SILU && act != ACT_GELU_TANH))
        return -1;
    const struct weight w = {.N = N, .K = K, .codes4 = codes, .sz = sz};
    return gemm(x, sx, M, &w, tile4, N / 2 / NB, &w, N / 2 / NB, act, y, sy, threads);
}

/* codes [N, K] int8 (row-major), scales [N, K / group] float32, lows like scales or NULL.
 * Returns as int4_gemm, and -1 also for a group other than 16 or 32. */
int int8_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
              const float *lows, int64_t group, int64_t N, uint16_t *y, int64_t sy, int threads)
{
    if (M < 1 || K % 32 || N % NB || N < NB || (group != 16 && group != 32))
        return -1;
    const struct weight w = {.N = N, .K = K, .codes8 = codes, .scales = scales, .lows = lows, .group = group};
    return gemm(x, sx, M, &w, tile8, N / NB, NULL, 0, ACT_NONE, y, sy, threads);
}

/* The gated product over two int8 weights of N rows each (gate's, up's; the same group):
 * y [M, N] = act(x gate^T) * (x up^T). Returns as int8_gemm, and -1 also for another act. */
int int8_gemm_glu(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const int8_t *gcodes, const float *gscales,
                  const float *glows, const int8_t *ucodes, const float *uscales, const float *ulows, int64_t group,
                  int64_t N, int act, uint16_t *y, int64_t sy, int threads)
{
    if (M < 1 || K % 32 || N % NB || N < NB || (group != 16 && group != 32)
        || (act != ACT_SILU && act != ACT_GELU_TANH))
        return -1;
    const struct weight g = {.N = N, .K = K, .codes8 = gcodes, .scales = gscales, .lows = glows, .group = group};
    const struct weight u = {.N = N, .K = K, .codes8 = ucodes, .scales = uscales, .lows = ulows, .group = group};
    return gemm(x, sx, M, &g, tile8, N / NB, &u, 0, act, y, sy, threads);
}
#else
int int4_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
              int64_t N, uint16_t *y, int64_t sy, int threads)
{
    (void)x, (void)sx, (void)M, (void)K, (void)codes, (void)sz, (void)N, (void)y, (void)sy, (void)threads;
    return -1;
}

int int8_gemm(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
              const float *lows, int64_t group, int64_t N, uint16_t *y, int64_t sy, int threads)
{
    (void)x, (void)sx, (void)M, (void)K, (void)codes, (void)scales, (void)lows, (void)group, (void)N, (void)y,
        (void)sy, (void)threads;
    return -1;
}

int int4_gemm_glu(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sz,
                  int64_t N, int act, uint16_t *y, int64_t sy, int threads)
{
    (void)x, (void)sx, (void)M, (void)K, (void)codes, (void)sz, (void)N, (void)act, (void)y, (void)sy, (void)threads;
    return -1;
}

int int8_gemm_glu(const uint16_t *x, int64_t sx, int64_t M, int64_t K, const int8_t *gcodes, const float *gscales,
                  const float *glows, const int8_t *ucodes, const float *uscales, const float *ulows, int64_t group,
                  int64_t N, int act, uint16_t *y, int64_t sy, int threads)
{
    (void)x, (void)sx, (void)M, (void)K, (void)gcodes, (void)gscales, (void)glows, (void)ucodes, (void)uscales,
        (void)ulows, (void)group, (void)N, (void)act, (void)y, (void)sy, (void)threads;
    return -1;
}
#endif

#ifndef ARCH_REQ_XCOMP_PERM
int gemm_amx(int want)  /* built without AMX (or without AVX512-BF16): never on */
{
    (void)want;
    return 0;
}
#endif
