/* Page selection of the `select` head class (headwise/heads/select.py) on the CPU, and
 * the refresh of its key summaries (refresh_summaries, at the end). Selection: for
 * every decode sequence b and select KV head h, the pages it attends this step, in one
 * call (the PyTorch version is a dozen small ops per layer, ~0.6 ms at 8K tokens).
 *
 * Page p of sequence b is block table[b * t_sb + p]; its key summary (per-channel min
 * then max, D values each) for head h is at summ + block * s_block + h * s_head. Its
 * bound is the largest over the head's g query rows of sum_d max(q_d * min_d, q_d * max_d).
 * Pages touching [0, sink) or the last `window` tokens are always chosen; the others by
 * bound (ties: the lower page) up to K_b = max(budget_pages, forced pages) in all: a
 * sequence's own count, whatever else is in the batch, so its pages do not depend on
 * what it is batched with. Output per (h, b): the chosen blocks in page order at
 * out_table[(h * B + b) * K ...] (K: the width, at least every K_b) and their token count
 * at out_lens[h * B + b] (every page full but the sequence's last, which is always
 * chosen). A sequence of at most K_b pages gets all of them.
 *
 * Bounds are scored sixteen pages at a time (their lane sums folded into one vector);
 * in bfloat16 with AVX512-BF16, min and max rows are interleaved into pairs met by
 * (q's negative part, q's positive part) pairs in one dot-product instruction. The
 * budget's pages are then found by quickselect: linear in the pages whatever the bounds.
 *
 * Built and loaded by headwise/kernels/cpu_kernels.py like cpu_decode.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 512
#define LANES 16  /* D is a multiple of it */

/* n values from base + off as floats: one pass per dtype, so the bfloat16 widening
 * vectorises (a per-element dtype branch kept the page loop scalar) */
typedef union { float f[2 * MAX_D]; uint32_t u[2 * MAX_D]; } Row;

static inline void load_row(const void *base, int64_t off, int bf16, Row *dst, int64_t n)
{
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) dst->u[i] = (uint32_t)src[i] << 16;
    } else {
        memcpy(dst->f, (const float *)base + off, n * sizeof(float));
    }
}

typedef float vlanes __attribute__((vector_size(LANES * sizeof(float))));  /* GCC and Clang */
typedef float vhalf __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float vquarter __attribute__((vector_size(LANES / 4 * sizeof(float))));

/* q's g rows from q + off (row stride q_sh) as float32 positive and negative parts */
static void split_q(const void *q, int64_t off, int64_t q_sh, int q_bf16, int64_t g, int64_t D,
                    float qp[][MAX_D], float qn[][MAX_D])
{
    for (int64_t j = 0; j < g; j++) {
        Row x;
        load_row(q, off + j * q_sh, q_bf16, &x, D);
        for (int64_t d = 0; d < D; d++) {
            qp[j][d] = x.f[d] > 0 ? x.f[d] : 0;
            qn[j][d] = x.f[d] < 0 ? x.f[d] : 0;
        }
    }
}

/* Bound of one page for each of the g query rows, as LANES partial sums per row:
 * part[j] = sum over d-chunks of qp[j] * max + qn[j] * min, lane by lane */
static inline void page_partials(const Row *lohi, const float qp[][MAX_D], const float qn[][MAX_D],
                                 int64_t g, int64_t D, vlanes *part)
{
    const float *lo = lohi->f, *hi = lohi->f + D;
    for (int64_t j = 0; j < g; j++) {
        vlanes acc = {0};
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
            vlanes a, b, c, e;
            memcpy(&a, &qp[j][d0], sizeof a);
            memcpy(&b, &hi[d0], sizeof b);
            memcpy(&c, &qn[j][d0], sizeof c);
            memcpy(&e, &lo[d0], sizeof e);
            acc += a * b + c * e;
        }
        part[j] = acc;
    }
}

#if defined(__AVX512F__) && LANES == 16
#include <immintrin.h>

/* The 16 lane sums of v[0..16) as one vector, lane i = the sum of v[i]: 15 pairwise
 * folds (two shuffles and an add each) instead of 16 separate horizontal sums */
static inline __m512 sum16(const vlanes *v)
{
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) {  /* quarters 0+2, 1+3: pages 2i, 2i+1, 8 partials each */
        __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; i++)    /* quarter L: page 4i + L, 4 partials */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)    /* quarter L: pages 8i + L, 8i + 4 + L, 2 partials each */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* quarter L, element m: page 4m + L */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s);
}

/* The bounds of m <= 16 pages from their partial sums part[j][i] (query row j, page i):
 * per page the largest over the g rows of its summed lanes, into out[0..m) */
static inline void store_bounds(vlanes part[][16], int64_t g, int64_t m, float *out)
{
    for (int64_t j = 0; j < g; j++)
        for (int64_t i = m; i < 16; i++) part[j][i] = (vlanes){0};
    __m512 best = sum16(part[0]);
    for (int64_t j = 1; j < g; j++) best = _mm512_max_ps(best, sum16(part[j]));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << m) - 1), best);
}

/* Bounds of pages [p0, p1) (sixteen at a time) into score[0 .. p1 - p0) */
static void page_bounds(const void *summ, int64_t s_block, int64_t s_head, int s_bf16, const int32_t *row,
                        int64_t p0, int64_t p1, int64_t h, int64_t g, int64_t D,
                        const void *q, int64_t q_off, int64_t q_sh, int q_bf16, float *score)
{
    float qp[MAX_G][MAX_D], qn[MAX_G][MAX_D];
    split_q(q, q_off, q_sh, q_bf16, g, D, qp, qn);
    vlanes part[MAX_G][16];
    Row lohi;  /* the page's key minimum, then maximum: [2, D] */
    for (int64_t base = p0; base < p1; base += 16) {
        int64_t m = p1 - base < 16 ? p1 - base : 16;
        for (int64_t i = 0; i < m; i++) {
            load_row(summ, (int64_t)row[base + i] * s_block + h * s_head, s_bf16, &lohi, 2 * D);
            vlanes acc[MAX_G];
            page_partials(&lohi, qp, qn, g, D, acc);
            for (int64_t j = 0; j < g; j++) part[j][i] = acc[j];
        }
        store_bounds(part, g, m, score + (base - p0));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Bounds of pages [p0, p1) from bfloat16 queries and summaries, D a multiple of 32:
 * each page's minimum and maximum rows are interleaved into (min_d, max_d) pairs and
 * met by (q's negative part, q's positive part) pairs in one dot-product instruction,
 * qn_d * min_d + qp_d * max_d. The products of two bfloat16 values are exact in float32,
 * as in page_bounds, so only the order of the float32 additions differs. */
#define HAS_BF16_BOUNDS 1
static void page_bounds_bf16(const uint16_t *summ, int64_t s_block, int64_t s_head, const int32_t *row,
                             int64_t p0, int64_t p1, int64_t h, int64_t g, int64_t D,
                             const uint16_t *qv, int64_t q_sh, float *score)
{
    const int64_t C = D / 32;  /* zmm words of one row */
    __m512i qpair[MAX_G][MAX_D / 16];  /* per query row, 16 (qn_d, qp_d) pairs a word */
    const __m512i sign = _mm512_set1_epi16((short)0x8000), zero = _mm512_setzero_si512();
    for (int64_t j = 0; j < g; j++) {
        for (int64_t c = 0; c < C; c++) {
            __m512i x = _mm512_loadu_si512(qv + j * q_sh + 32 * c);
            __mmask32 neg = _mm512_test_epi16_mask(x, sign);
            __m512i qn = _mm512_mask_mov_epi16(zero, neg, x), qp = _mm512_mask_mov_epi16(x, neg, zero);
            qpair[j][2 * c] = _mm512_unpacklo_epi16(qn, qp);
            qpair[j][2 * c + 1] = _mm512_unpackhi_epi16(qn, qp);
        }
    }
    vlanes part[MAX_G][16];
    for (int64_t base = p0; base < p1; base += 16) {
        int64_t m = p1 - base < 16 ? p1 - base : 16;
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *lo = summ + (int64_t)row[base + i] * s_block + h * s_head, *hi = lo + D;
            __m512i pairs[MAX_D / 16];
            for (int64_t c = 0; c < C; c++) {
                __m512i l = _mm512_loadu_si512(lo + 32 * c), u = _mm512_loadu_si512(hi + 32 * c);
                pairs[2 * c] = _mm512_unpacklo_epi16(l, u);
                pairs[2 * c + 1] = _mm512_unpackhi_epi16(l, u);
            }
            for (int64_t j = 0; j < g; j++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < 2 * C; c++)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)pairs[c], (__m512bh)qpair[j][c]);
                part[j][i] = (vlanes)acc;
            }
        }
        store_bounds(part, g, m, score + (base - p0));
    }
}
#endif
#else
/* Sum of the LANES lanes: halves added pairwise, one fixed order
 * for a build (element reads, not memcpy: the accumulator stays in registers) */
static inline float hsum(vlanes v)
{
    vhalf s8;
    for (int l = 0; l < LANES / 2; l++) s8[l] = v[l] + v[l + LANES / 2];
    vquarter s4;
    for (int l = 0; l < LANES / 4; l++) s4[l] = s8[l] + s8[l + LANES / 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static void page_bounds(const void *summ, int64_t s_block, int64_t s_head, int s_bf16, const int32_t *row,
                        int64_t p0, int64_t p1, int64_t h, int64_t g, int64_t D,
                        const void *q, int64_t q_off, int64_t q_sh, int q_bf16, float *score)
{
    float qp[MAX_G][MAX_D], qn[MAX_G][MAX_D];
    split_q(q, q_off, q_sh, q_bf16, g, D, qp, qn);
    Row lohi;
    vlanes part[MAX_G];
    for (int64_t p = p0; p < p1; p++) {
        load_row(summ, (int64_t)row[p] * s_block + h * s_head, s_bf16, &lohi, 2 * D);
        page_partials(&lohi, qp, qn, g, D, part);
        float best = hsum(part[0]);
        for (int64_t j = 1; j < g; j++) {
            float sum = hsum(part[j]);
            best = sum > best ? sum : best;
        }
        score[p - p0] = best;
    }
}
#endif

/* The k-th largest of a[0..n) (1 <= k <= n), a reordered: quickselect, pivot the median
 * of three, so the time is linear in n whatever order the bounds come in (a heap of the
 * best k paid log k for nearly every page: bounds tend to rise toward recent pages) */
static float kth_largest(float *a, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1, want = k - 1;  /* want: its index in descending order */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float pivot = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {  /* [lo, i) >= pivot, (j, hi] <= pivot */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];  /* between the two parts: equal to the pivot */
    }
    return a[want];
}

int select_pages(const void *q, int64_t q_sb, int64_t q_sh, int q_bf16,        /* [B, n * g, D] */
                 const void *summ, int64_t s_block, int64_t s_head, int s_bf16,  /* [blocks, n, 2, D] */
                 const int32_t *table, int64_t t_sb, const int64_t *lens,        /* [B, >= pages], [B] */
                 int64_t B, int64_t n, int64_t g, int64_t D, int64_t block, int64_t sink, int64_t window,
                 int64_t budget_pages, int64_t K, int32_t *out_table, int32_t *out_lens)
{
    if (g > MAX_G || D > MAX_D || D % LANES || K < 1)
        return 1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (B * n > 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < n; h++) {
            int64_t len = lens[b], P = (len + block - 1) / block;
            const int32_t *row = table + b * t_sb;
            int32_t *dst = out_table + (h * B + b) * K;
            int64_t c = 0;
            int64_t sink_end = (sink + block - 1) / block;                  /* pages [0, sink_end) */
            int64_t win_start = len > window ? (len - window) / block : 0;  /* pages [win_start, P) */
            if (sink_end > P) sink_end = P;
            /* both ranges, less their overlap (heads/select.py forced_pages) */
            int64_t forced = sink_end + (P - win_start) - (sink_end > win_start ? sink_end - win_start : 0);
            int64_t Kb = forced > budget_pages ? forced : budget_pages;
            if ((P < Kb ? P : Kb) > K) { out_lens[h * B + b] = -2; continue; }  /* K too small a width */
            if (P <= Kb) {
                for (int64_t p = 0; p < P; p++) dst[c++] = row[p];
            } else {
                /* P > Kb >= forced: the pages chosen by bound lie between the two forced
                 * ranges, candidates [sink_end, win_start), and there are more than k */
                int64_t k = Kb - forced, C = win_start - sink_end;
                for (int64_t p = 0; p < sink_end; p++) dst[c++] = row[p];
                if (k > 0) {
                    float *score = malloc(2 * C * sizeof(float)), *scratch = score + C;
                    if (!score) { out_lens[h * B + b] = -1; continue; }
                    const int64_t q_off = b * q_sb + h * g * q_sh;  /* the head's first query row */
#ifdef HAS_BF16_BOUNDS
                    if (q_bf16 && s_bf16 && D % 32 == 0)
                        page_bounds_bf16((const uint16_t *)summ, s_block, s_head, row, sink_end, win_start, h, g,
                                         D, (const uint16_t *)q + q_off, q_sh, score);
                    else
#endif
                    page_bounds(summ, s_block, s_head, s_bf16, row, sink_end, win_start, h, g, D, q, q_off, q_sh,
                                q_bf16, score);
                    for (int64_t i = 0; i < C; i++)  /* a NaN bound ranks below every other */
                        if (score[i] != score[i]) score[i] = -__builtin_inff();
                    memcpy(scratch, score, C * sizeof(float));
                    float t = kth_largest(scratch, C, k);
                    int64_t ties = k;  /* pages at the threshold taken: the lower first */
                    for (int64_t i = 0; i < C; i++) ties -= score[i] > t;
                    for (int64_t i = 0; i < C; i++)
                        if (score[i] > t || (score[i] == t && ties-- > 0)) dst[c++] = row[sink_end + i];
                    free(score);
                }
                for (int64_t p = win_start; p < P; p++) dst[c++] = row[p];
            }
            for (int64_t i = c; i < K; i++) dst[i] = row[0];  /* unused: any valid block */
            out_lens[h * B + b] = (int32_t)((c - 1) * block + (len - (P - 1) * block));
        }
    }
    for (int64_t i = 0; i < B * n; i++)
        if (out_lens[i] < 0) return 2;
    return 0;
}

/* The key summaries of the blocks a step wrote: for each of blocks[0..m) and head
 * h < n, the per-channel minimum then maximum over the block's `block` key rows (row r
 * of block blk at k + h * k_sh + (blk * block + r) * k_sr), written to summ + blk *
 * s_block + h * s_head as [2, D]. Keys and summaries share one dtype, float32 or
 * bfloat16, so a minimum or maximum is stored exactly (heads/select.py refresh_summaries
 * is the PyTorch version, and the one for quantized keys). */
int refresh_summaries(const void *k, int64_t k_sh, int64_t k_sr, int bf16, const int64_t *blocks,
                      int64_t m, int64_t n, int64_t block, int64_t D,
                      void *summ, int64_t s_block, int64_t s_head)
{
    if (D > MAX_D)
        return 1;
#pragma omp parallel for collapse(2) if (m * n * block * D > (1 << 16))
    for (int64_t i = 0; i < m; i++) {
        for (int64_t h = 0; h < n; h++) {
            Row lohi, key;  /* [2, D]: minimum, maximum; one key row */
            float *lo = lohi.f, *hi = lohi.f + D;
            const int64_t first = h * k_sh + blocks[i] * block * k_sr;
            load_row(k, first, bf16, &lohi, D);
            memcpy(hi, lo, D * sizeof(float));
            for (int64_t r = 1; r < block; r++) {
                load_row(k, first + r * k_sr, bf16, &key, D);
                for (int64_t d = 0; d < D; d++) {
                    lo[d] = key.f[d] < lo[d] ? key.f[d] : lo[d];
                    hi[d] = key.f[d] > hi[d] ? key.f[d] : hi[d];
                }
            }
            const int64_t dst = blocks[i] * s_block + h * s_head;
            if (bf16) {  /* exact: each value is one of the bfloat16 keys */
                uint16_t *out = (uint16_t *)summ + dst;
                for (int64_t d = 0; d < 2 * D; d++) out[d] = (uint16_t)(lohi.u[d] >> 16);
            } else {
                memcpy((float *)summ + dst, lohi.f, 2 * D * sizeof(float));
            }
        }
    }
    return 0;
}
