/* Prefill attention in bfloat16 for CPUs with AVX512-BF16 (cpu_kernels.prefill_attention):
 * full heads' causal attention and window heads' sink + window attention.
 *
 * Why: attention grows with the square of a prompt's length and the rest of a prefill
 * linearly, so long prompts' prefills are mostly attention, and PyTorch's fused CPU kernel computes it as small
 * bfloat16 GEMMs (a head size of 64 as the inner dimension) whose float32 outputs go
 * through memory, with a mask added to every score where the keys do not start at
 * position 0; on an AVX512-BF16 CPU without AMX that ran at 83-128 GFLOP/s here. This
 * kernel keeps a block of scores in registers: Q.K^T and P.V are VDPBF16PS dot products
 * (pairs of bfloat16 products summed into float32), the softmax is online (flash
 * attention), the keys and values are repacked once per call into the pair-interleaved
 * layout those instructions read, and blocks no query of a work item sees are skipped.
 *
 * Numerics follow PyTorch's kernel: scores in float32, times `scale`, a running max and
 * sum in float32, probabilities rounded to bfloat16 for P.V (PyTorch does the same), the
 * output rounded once. The running max is lazy (LAZY_MAX): probabilities are taken
 * against a max that may trail the true one by up to 8, which scales them all alike. exp
 * is a degree-7 polynomial (relative error ~1e-8 before rounding).
 *
 * q [Lq rows][H heads][D], k and v [S rows][nkv heads][D], out like q, each with its own
 * row and head strides (elements) and unit stride along D. Query row i is position
 * start + i; it sees the keys at positions (p - W, p] and those below `sink` up to p.
 * Keys [0, ns) are positions [0, ns) (sinks given apart from the band), keys [ns, S) are
 * positions band_pos on. Query head h reads KV head h / (H / nkv).
 *
 * Returns 0; -1 where the kernel was not built for AVX512-BF16 or D is not a multiple of 64
 * up to 256 (the caller keeps PyTorch's code); -2 on sizes that do not fit; -3 when out of
 * memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define R 4        /* query rows computed together (register blocking) */
#define QB 128     /* query rows of one work item: R-row groups sharing each key block in cache */
#define BK 64      /* keys of one online-softmax step: 4 tiles of 16 */
#define DMAX 256
/* How far a score may pass the row's running max before the max moves (natural-log
 * units): probabilities up to e^8 (~3000) lose nothing in float32 sums or in bfloat16,
 * whose rounding is relative. */
#define LAZY_MAX 8.0f

/* e^x for x <= LAZY_MAX (clamped at -87: below, the caller's mask zeroes what matters) */
static inline __m512 exp_neg(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f)); /* |f| <= ln2/2 */
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh bcast_pair(const uint16_t *p)  /* two bfloat16 at p, in every 32-bit lane */
{
    int32_t w;
    memcpy(&w, p, 4);
    return (__m512bh)_mm512_set1_epi32(w);
}

/* Keys of one KV head into tiles of 16: kp[t][d/2][16 keys][2]; values into key pairs:
 * vp[j/2][D][2]; zero past S. */
static void pack_head(const uint16_t *k, const uint16_t *v, int64_t k_row, int64_t v_row, int64_t S,
                      int64_t D, int64_t tiles, uint16_t *kp, uint16_t *vp)
{
    for (int64_t t = 0; t < tiles; t++) {
        uint32_t *kt = (uint32_t *)(kp + t * 16 * D);
        uint32_t *vt = (uint32_t *)(vp + t * 16 * D);
        for (int l = 0; l < 16; l++) {
            int64_t j = t * 16 + l;
            if (j < S) {
                const uint16_t *kr = k + j * k_row, *vr = v + j * v_row;
                for (int64_t p = 0; p < D / 2; p++) {
                    uint32_t w;
                    memcpy(&w, kr + 2 * p, 4);
                    kt[p * 16 + l] = w;
                }
                uint16_t *vo = (uint16_t *)vt + (l / 2) * 2 * D + (l & 1);
                for (int64_t d = 0; d < D; d++)
                    vo[2 * d] = vr[d];
            } else {
                for (int64_t p = 0; p < D / 2; p++)
                    kt[p * 16 + l] = 0;
                uint16_t *vo = (uint16_t *)vt + (l / 2) * 2 * D + (l & 1);
                for (int64_t d = 0; d < D; d++)
                    vo[2 * d] = 0;
            }
        }
    }
}

/* R query rows (qb [R][D]) against keys [j0, j0 + BK): scores into s [R][BK] (scaled). */
static inline void scores(const uint16_t *qb, const uint16_t *kp, int64_t D, float scale, float *s)
{
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh kt[4];
        for (int t = 0; t < 4; t++)
            kt[t] = (__m512bh)_mm512_loadu_si512(kp + (t * D / 2 + p) * 32);
        for (int r = 0; r < R; r++) {
            __m512bh qp = bcast_pair(qb + r * D + 2 * p);
            for (int t = 0; t < 4; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], kt[t], qp);
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++)
            _mm512_storeu_ps(s + r * BK + t * 16, _mm512_mul_ps(acc[r][t], sc));
}

/* o [R][D] += pb [R][BK] (bfloat16 probabilities) . values of keys [j0, j0 + BK) */
static inline void weighted_values(const uint16_t *pb, const uint16_t *vp, int64_t D, float *o)
{
    for (int64_t c0 = 0; c0 < D; c0 += 64) {  /* 4 chunks of 16 outputs per row at a time */
        __m512 acc[R][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_loadu_ps(o + r * D + c0 + c * 16);
        for (int jp = 0; jp < BK / 2; jp++) {
            __m512bh vt[4];
            for (int c = 0; c < 4; c++)
                vt[c] = (__m512bh)_mm512_loadu_si512(vp + (jp * D + c0 + c * 16) * 2);
            for (int r = 0; r < R; r++) {
                __m512bh pp = bcast_pair(pb + r * BK + 2 * jp);
                for (int c = 0; c < 4; c++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vt[c], pp);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(o + r * D + c0 + c * 16, acc[r][c]);
    }
}

/* Keys [lo, hi] (positions) among the 16 of a tile starting at position t0, as bits. */
static inline uint32_t range_bits(int64_t t0, int64_t lo, int64_t hi)
{
    if (hi < t0 || lo > t0 + 15 || hi < lo)
        return 0;
    int64_t a = lo > t0 ? lo - t0 : 0, b = hi < t0 + 15 ? hi - t0 : 15;
    return ((2u << b) - 1) & ~((1u << a) - 1);
}

/* Whether a row at a position in [p0, p1] sees a key at a position in [b0, b1) */
static inline int block_seen(int64_t b0, int64_t b1, int64_t p0, int64_t p1, int64_t sink, int64_t W)
{
    return b0 <= p1 && (b1 - 1 > p0 - W || b0 < sink);
}

typedef struct {
    const uint16_t *kp, *vp;  /* packed keys and values (pack_head) */
    int64_t n, pos;           /* keys, position of the first */
} segment;

/* One work item: query head h, rows [i0, i0 + n), n <= QB, at positions start + i0 + r. */
static void rows_item(const uint16_t *q, int64_t q_row, uint16_t *out, int64_t o_row,
                      const segment *segs, int nseg, int64_t i0, int64_t n, int64_t start,
                      int64_t sink, int64_t W, int64_t D, float scale, uint16_t *qb, float *o)
{
    /* qb [QB][D]: the rows' queries (zero past n); o [QB][D]: their unnormalised outputs */
    _Alignas(64) float s[R * BK];
    _Alignas(64) uint16_t pb[R * BK];
    float m[QB];
    __m512 l[QB];  /* running sums, 16 lanes each: summed across lanes once, at the end */
    int64_t groups = (n + R - 1) / R;
    for (int64_t r = 0; r < groups * R; r++) {
        if (r < n)
            memcpy(qb + r * D, q + (i0 + r) * q_row, D * 2);
        else
            memset(qb + r * D, 0, D * 2);
        memset(o + r * D, 0, D * 4);
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
    }
    int64_t p_first = start + i0, p_last = start + i0 + n - 1;
    for (int sg = 0; sg < nseg; sg++) {
        const segment *seg = segs + sg;
        for (int64_t j0 = 0; j0 < seg->n; j0 += BK) {
            int64_t b0 = seg->pos + j0, b1 = b0 + (seg->n - j0 < BK ? seg->n - j0 : BK);  /* positions [b0, b1) */
            if (!block_seen(b0, b1, p_first, p_last, sink, W))
                continue;
            const uint16_t *kb = seg->kp + j0 * D, *vb = seg->vp + j0 * D;
            for (int64_t g = 0; g < groups; g++) {
                int64_t gp0 = p_first + g * R, gp1 = gp0 + R - 1;
                if (!block_seen(b0, b1, gp0, gp1, sink, W))
                    continue;
                /* every row sees every key of the block (inside all four causal windows) */
                int full = b1 - b0 == BK && b0 + BK - 1 <= gp0 && b0 > gp1 - W;
                scores(qb + g * R * D, kb, D, scale, s);
                for (int r = 0; r < R; r++) {
                    int64_t row = g * R + r, p = gp0 + r;
                    float *sr = s + r * BK;
                    __m512 v4[4];
                    __mmask16 ok[4];
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    if (full) {  /* most blocks of a long prompt: no per-key visibility to work out */
                        for (int t = 0; t < 4; t++) {
                            ok[t] = (__mmask16)0xffff;
                            v4[t] = _mm512_loadu_ps(sr + t * 16);
                            mx = _mm512_max_ps(mx, v4[t]);
                        }
                    } else {
                        for (int t = 0; t < 4; t++) {
                            int64_t t0 = b0 + t * 16;
                            /* the window (p - W, p] and the sinks [0, sink) up to p, among existing keys */
                            ok[t] = (__mmask16)((range_bits(t0, p - W + 1, p)
                                                 | range_bits(t0, 0, (sink < p + 1 ? sink : p + 1) - 1))
                                                & range_bits(t0, b0, b1 - 1));
                            v4[t] = _mm512_mask_blend_ps(ok[t], _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sr + t * 16));
                            mx = _mm512_max_ps(mx, v4[t]);
                        }
                    }
                    if (!full && !(ok[0] | ok[1] | ok[2] | ok[3])) {  /* the row sees none of the block */
                        memset(pb + r * BK, 0, BK * 2);
                        continue;
                    }
                    /* Lazy maximum: the running max moves only when a score passes it by more
                     * than LAZY_MAX, so most blocks skip the horizontal max and the rescale of
                     * the row's output. */
                    float alpha = 1.0f;
                    if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m[row] + LAZY_MAX), _CMP_GT_OQ)) {
                        float bm = _mm512_reduce_max_ps(mx);
                        alpha = m[row] == -INFINITY ? 0.0f : expf(m[row] - bm);
                        m[row] = bm;
                    }
                    __m512 mn = _mm512_set1_ps(m[row]), sum = _mm512_setzero_ps();
                    for (int t = 0; t < 4; t += 2) {
                        __m512 e0 = _mm512_maskz_mov_ps(ok[t], exp_neg(_mm512_sub_ps(v4[t], mn)));
                        __m512 e1 = _mm512_maskz_mov_ps(ok[t + 1], exp_neg(_mm512_sub_ps(v4[t + 1], mn)));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                        _mm512_storeu_si512(pb + r * BK + t * 16, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                    }
                    l[row] = _mm512_fmadd_ps(l[row], _mm512_set1_ps(alpha), sum);
                    if (alpha != 1.0f) {
                        __m512 a = _mm512_set1_ps(alpha);
                        float *orow = o + row * D;
                        for (int64_t d = 0; d < D; d += 16)
                            _mm512_storeu_ps(orow + d, _mm512_mul_ps(a, _mm512_loadu_ps(orow + d)));
                    }
                }
                weighted_values(pb, vb, D, o + g * R * D);
            }
        }
    }
    for (int64_t r = 0; r < n; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        uint16_t *dst = out + (i0 + r) * o_row;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o + r * D + d))));
    }
}
#endif

int prefill_attention(const uint16_t *q, int64_t q_row, int64_t q_head,
                      const uint16_t *k, int64_t k_row, int64_t k_head,
                      const uint16_t *v, int64_t v_row, int64_t v_head,
                      uint16_t *out, int64_t o_row, int64_t o_head,
                      int64_t Lq, int64_t S, int64_t ns, int64_t band_pos, int64_t start,
                      int64_t sink, int64_t W, int64_t H, int64_t nkv, int64_t D,
                      float scale, int nthreads)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (D % 64 || D > DMAX || D <= 0)
        return -1;
    /* the sinks precede the band, and the band reaches the last query's own key */
    if (Lq <= 0 || S <= 0 || ns < 0 || ns > S || ns > band_pos || start < 0 || sink < 0 || W < 1
        || nkv <= 0 || H % nkv || band_pos > start || band_pos + (S - ns) < start + Lq)
        return -2;
    int64_t g = H / nkv;
    int64_t cap[2] = {(ns + BK - 1) / BK * BK, (S - ns + BK - 1) / BK * BK};  /* whole blocks, zero past the keys */
    size_t per_head = (size_t)(cap[0] + cap[1]) * D;  /* elements of one head's packed keys (or values) */
    uint16_t *kp = aligned_alloc(64, per_head * nkv * 2), *vp = aligned_alloc(64, per_head * nkv * 2);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -3;
    }
    if (nthreads < 1)
        nthreads = 1;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t h = 0; h < 2 * nkv; h++) {  /* (head, segment) */
        int64_t hh = h / 2, first = h % 2 ? ns : 0, n = h % 2 ? S - ns : ns;
        size_t at = hh * per_head + (h % 2 ? cap[0] * D : 0);
        pack_head(k + hh * k_head + first * k_row, v + hh * v_head + first * v_row, k_row, v_row, n, D,
                  cap[h % 2] / 16, kp + at, vp + at);
    }
    int64_t blocks = (Lq + QB - 1) / QB;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        /* per thread: QB rows of queries and outputs (too large for a worker's stack) */
        uint16_t *qb = aligned_alloc(64, QB * DMAX * 2);
        float *o = aligned_alloc(64, QB * DMAX * 4);
        if (!qb || !o) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Later row blocks see more keys: dynamic scheduling, largest first. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < H * blocks; it++) {
            int64_t b = blocks - 1 - it / H, h = it % H;
            int64_t i0 = b * QB, n = Lq - i0 < QB ? Lq - i0 : QB;
            size_t at = (h / g) * per_head;
            segment segs[2] = {{kp + at, vp + at, ns, 0},
                               {kp + at + cap[0] * D, vp + at + cap[0] * D, S - ns, band_pos}};
            if (qb && o)
                rows_item(q + h * q_head, q_row, out + h * o_head, o_row, segs, 2, i0, n, start, sink, W, D,
                          scale, qb, o);
        }
        free(qb);
        free(o);
    }
    free(kp);
    free(vp);
    return failed ? -3 : 0;
#else
    (void)q; (void)q_row; (void)q_head; (void)k; (void)k_row; (void)k_head; (void)v; (void)v_row; (void)v_head;
    (void)out; (void)o_row; (void)o_head; (void)Lq; (void)S; (void)ns; (void)band_pos; (void)start;
    (void)sink; (void)W; (void)H; (void)nkv; (void)D; (void)scale; (void)nthreads;
    return -1;
#endif
}
