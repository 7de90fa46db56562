/* Decode attention on the CPU for one head class of one layer: each sequence's g query
 * heads per KV head attend over that KV head's cached keys, wherever the cache keeps them.
 *
 * Built and loaded at run time by headwise/kernels/cpu_kernels.py (the system C compiler,
 * -O3 -march=native -fopenmp); the PyTorch backend calls it instead of one SDPA call per
 * (sequence, class), whose per-call cost dominates decode at these sizes (~130 us each,
 * 48 per SmolLM2 step).
 *
 * Key row p of sequence b, KV head h (K and V alike, at k or v):
 *     base + h * s_head + table[b * s_table + p / block] * s_block + (p % block) * s_row
 * Full heads: table = the block table, block = block size, s_block = block * s_row.
 * Window heads: table = the ring slots (one entry per sequence), block = ring length.
 * Sequence b attends its first min(lens[b], cap) rows (a ring holds cap = its length).
 *
 * Work is cut into (sequence, KV head, piece of the keys) tasks so that one sequence with
 * one KV head still uses every thread; the pieces are merged by their log-sum-exp, as
 * flash-decoding does. Scores and sums are float32; K/V are float32 or bfloat16.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define TILE 16        /* keys scored before each softmax update (one v16f) */
#define MAX_G 16       /* query heads per KV head */
#define MAX_D 512      /* head size */
#define MIN_PIECE 256  /* keys per task at least, when a sequence is cut */

static inline __attribute__((always_inline)) void load_row(const void *base, int64_t off, int bf16, int D, float *dst)
{
    if (bf16) {
        const uint16_t *s = (const uint16_t *)base + off;
        #pragma omp simd
        for (int d = 0; d < D; d++) {
            uint32_t u = (uint32_t)s[d] << 16;
            float f;
            memcpy(&f, &u, 4);
            dst[d] = f;
        }
    } else {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    }
}

static inline void store_row(void *base, int64_t off, int bf16, int D, const float *src)
{
    if (bf16) {  /* round to nearest even, as PyTorch casts */
        uint16_t *o = (uint16_t *)base + off;
        for (int d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, &src[d], 4);
            u += 0x7fff + ((u >> 16) & 1);
            o[d] = (uint16_t)(u >> 16);
        }
    } else {
        memcpy((float *)base + off, src, (size_t)D * sizeof(float));
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, const int D)
{
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

typedef struct {
    float m[MAX_G];   /* running max of the scores */
    float l[MAX_G];   /* sum of exp(score - m) */
    float *acc;       /* [g, D]: sum of exp(score - m) * v */
} Partial;

/* Sixteen floats as one value (GCC/Clang vector extension: lowered to the target's
 * SIMD, AVX-512 here). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp(x) lane-wise for x <= 0 (scores minus their max): 2^n * p(r), |r| <= ln2 / 2, within
 * 2 ulp of expf; held at exp(-87) ~ 1.6e-38 below -87. */
static inline v16f exp_le0(v16f x)
{
    const v16f lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f,
                     -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    v16i below = x < lo;  /* lanes -1 where true */
    x = (v16f)(((v16i)lo & below) | ((v16i)x & ~below));
    const float round = 12582912.f;  /* 1.5 * 2^23: adding it rounds to an integer */
    v16f n = (x * 1.44269504f + round) - round;
    v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16f)e;
}

static inline float hmax(v16f x)
{
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#endif
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float hsum(v16f x)
{
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#endif
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

/* Keys [p0, p1) of (b, h): scores, softmax and the weighted sum of values into part.
 * Inlined with D a constant for the common head sizes, so the row loops unroll. */
static inline __attribute__((always_inline)) void
attend_piece_d(const float *q /* [g, D], scaled */, int g, const int D,
               const void *k, const void *v, int bf16, int64_t head_off,
               const int32_t *table, int64_t block, int64_t s_block, int64_t s_row,
               int64_t p0, int64_t p1, Partial *part)
{
    /* Partial sums stay on this thread's stack until the end: tasks' Partials are
     * neighbours in memory, and threads writing them every tile would share lines. */
    float kf[TILE * MAX_D], s[MAX_G][TILE], vf[MAX_D], acc[MAX_G * MAX_D], m[MAX_G], l[MAX_G];
    int64_t offs[TILE];
    for (int j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)g * D);
    int64_t blk = p0 / block, in = p0 % block;  /* key p's block and row in it */
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        int n = (int)(p1 - t0 < TILE ? p1 - t0 : TILE);
        for (int t = 0; t < n; t++) {
            offs[t] = head_off + (int64_t)table[blk] * s_block + in * s_row;
            if (++in == block) {
                in = 0;
                blk++;
            }
            load_row(k, offs[t], bf16, D, kf + t * D);
        }
        for (int j = 0; j < g; j++) {
            const float *qj = q + (int64_t)j * D;
            float sc[TILE];
            for (int t = 0; t < TILE; t++) sc[t] = t < n ? dot(qj, kf + t * D, D) : -INFINITY;
            v16f sv;
            memcpy(&sv, sc, sizeof sv);
            float mx = hmax(sv);
            mx = m[j] > mx ? m[j] : mx;
            v16f pv = exp_le0(sv - mx);
            for (int t = n; t < TILE; t++) pv[t] = 0.f;  /* past the piece's end */
            memcpy(s[j], &pv, sizeof pv);
            float corr = m[j] == -INFINITY ? 0.f : exp_le0((v16f){} + (m[j] - mx))[0];
            l[j] = l[j] * corr + hsum(pv);
            m[j] = mx;
            float *a = acc + (int64_t)j * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) a[d] *= corr;
        }
        for (int t = 0; t < n; t++) {
            load_row(v, offs[t], bf16, D, vf);
            for (int j = 0; j < g; j++) {
                const float w = s[j][t];
                float *a = acc + (int64_t)j * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) a[d] += w * vf[d];
            }
        }
    }
    memcpy(part->m, m, sizeof(float) * (size_t)g);
    memcpy(part->l, l, sizeof(float) * (size_t)g);
    memcpy(part->acc, acc, sizeof(float) * (size_t)g * D);
}

/* Sixteen values of row `off` from column c0 as floats (bf16: the 16 high bits). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16f load16(const void *base, int64_t off, int bf16)
{
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)base + off, sizeof h);
        return (v16f)(__builtin_convertvector(h, v16u) << 16);
    }
    v16f f;
    memcpy(&f, (const float *)base + off, sizeof f);
    return f;
}

/* attend_piece_d for D = 16 * DC, with each key and value row held in DC vectors once:
 * scores for all g queries from one load of the key, and per 16-float column of the
 * output, the g accumulators stay in registers over the tile's values. */
static inline __attribute__((always_inline)) void
attend_piece_v(const float *q, int g, const int DC, const void *k, const void *v, int bf16,
               int64_t head_off, const int32_t *table, int64_t block, int64_t s_block, int64_t s_row,
               int64_t p0, int64_t p1, Partial *part)
{
    const int D = 16 * DC;
    v16f acc[MAX_G * (MAX_D / 16)], qv[MAX_G * (MAX_D / 16)];
    float s[MAX_G][TILE], m[MAX_G], l[MAX_G];
    int64_t offs[TILE];
    for (int j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
        for (int c = 0; c < DC; c++) {
            acc[j * DC + c] = (v16f){};
            memcpy(&qv[j * DC + c], q + (int64_t)j * D + 16 * c, sizeof(v16f));
        }
    }
    int64_t blk = p0 / block, in = p0 % block;  /* key p's block and row in it */
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        int n = (int)(p1 - t0 < TILE ? p1 - t0 : TILE);
        float sc[MAX_G][TILE];
        for (int t = 0; t < TILE; t++) {
            if (t >= n) {
                for (int j = 0; j < g; j++) sc[j][t] = -INFINITY;
                continue;
            }
            offs[t] = head_off + (int64_t)table[blk] * s_block + in * s_row;
            if (++in == block) {
                in = 0;
                blk++;
            }
            v16f kr[MAX_D / 16];
            for (int c = 0; c < DC; c++) kr[c] = load16(k, offs[t] + 16 * c, bf16);
            for (int j = 0; j < g; j++) {
                v16f d = qv[j * DC] * kr[0];
                for (int c = 1; c < DC; c++) d += qv[j * DC + c] * kr[c];
                sc[j][t] = hsum(d);
            }
        }
        for (int j = 0; j < g; j++) {
            v16f sv;
            memcpy(&sv, sc[j], sizeof sv);
            float mx = hmax(sv);
            mx = m[j] > mx ? m[j] : mx;
            v16f pv = exp_le0(sv - mx);
            for (int t = n; t < TILE; t++) pv[t] = 0.f;  /* past the piece's end */
            memcpy(s[j], &pv, sizeof pv);
            float corr = m[j] == -INFINITY ? 0.f : exp_le0((v16f){} + (m[j] - mx))[0];
            l[j] = l[j] * corr + hsum(pv);
            m[j] = mx;
            for (int c = 0; c < DC; c++) acc[j * DC + c] *= corr;
        }
        for (int c = 0; c < DC; c++) {
            v16f a[MAX_G];
            for (int j = 0; j < g; j++) a[j] = acc[j * DC + c];
            for (int t = 0; t < n; t++) {
                v16f vr = load16(v, offs[t] + 16 * c, bf16);
                for (int j = 0; j < g; j++) a[j] += s[j][t] * vr;
            }
            for (int j = 0; j < g; j++) acc[j * DC + c] = a[j];
        }
    }
    memcpy(part->m, m, sizeof(float) * (size_t)g);
    memcpy(part->l, l, sizeof(float) * (size_t)g);
    for (int j = 0; j < g; j++)
        for (int c = 0; c < DC; c++) memcpy(part->acc + (int64_t)j * D + 16 * c, &acc[j * DC + c], sizeof(v16f));
}

static void attend_piece(const float *q, int g, int D, const void *k, const void *v, int bf16,
                         int64_t head_off, const int32_t *table, int64_t block, int64_t s_block,
                         int64_t s_row, int64_t p0, int64_t p1, Partial *part)
{
#define PIECE(DC) attend_piece_d(q, g, DC, k, v, bf16, head_off, table, block, s_block, s_row, p0, p1, part)
#define VPIECE(DC) attend_piece_v(q, g, DC, k, v, bf16, head_off, table, block, s_block, s_row, p0, p1, part)
    switch (D) {
    case 64: VPIECE(4); break;
    case 128: VPIECE(8); break;
    case 256: VPIECE(16); break;
    default: PIECE(D);
    }
#undef PIECE
#undef VPIECE
}

/* Returns 0; -1 for sizes it does not take (g > MAX_G, D > MAX_D) or no memory; -2 when
 * a sequence has more keys (or a write row) than its `width` table entries address.
 * With wpos (else NULL), first writes the step's own K/V rows knew/vnew [B, nkv, D] at key
 * row wpos[b] of each sequence (addressed as the keys are), then attends. */
int paged_decode(const void *q, int64_t q_sb, int64_t q_sh,  /* [B, nkv * g, D] */
                 void *out, int64_t o_sb, int64_t o_sh,      /* like q */
                 const void *knew, int64_t kn_sb, int64_t kn_sh,   /* [B, nkv, D] */
                 const void *vnew, int64_t vn_sb, int64_t vn_sh, const int64_t *wpos,
                 void *k, void *v, int64_t s_head, int64_t s_block, int64_t s_row,
                 const int32_t *table, int64_t s_table, int64_t width, int64_t block,
                 const int32_t *lens, int64_t cap, int64_t B, int64_t nkv, int64_t g, int64_t D, float scale, int bf16,
                 int nthreads)
{
    if (g > MAX_G || D > MAX_D || B <= 0 || nkv <= 0)
        return B <= 0 || nkv <= 0 ? 0 : -1;
    /* pieces per (b, h): enough tasks for every thread, none under MIN_PIECE keys */
    int64_t maxlen = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b] < cap ? lens[b] : cap;
        if (L > width * block || (wpos && (wpos[b] < 0 || wpos[b] >= width * block)))
            return -2;
        maxlen = lens[b] > maxlen ? lens[b] : maxlen;
    }
    maxlen = maxlen < cap ? maxlen : cap;
    int64_t want = (2 * nthreads + B * nkv - 1) / (B * nkv);
    int64_t most = maxlen / MIN_PIECE;
    int64_t pieces = want < most ? want : most;
    if (pieces < 1) pieces = 1;
    int64_t tasks = B * nkv * pieces;
    float *acc = malloc(sizeof(float) * (size_t)(tasks * g * D));
    Partial *parts = malloc(sizeof(Partial) * (size_t)tasks);
    if (!acc || !parts) {
        free(acc);
        free(parts);
        return -1;
    }
    const size_t esize = bf16 ? 2 : 4;
    #pragma omp parallel num_threads(nthreads)
    {
        if (wpos) {
            #pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * nkv; bh++) {
                int64_t b = bh / nkv, h = bh % nkv, p = wpos[b];
                int64_t off = h * s_head + (int64_t)table[b * s_table + p / block] * s_block + (p % block) * s_row;
                memcpy((char *)k + off * esize, (const char *)knew + (b * kn_sb + h * kn_sh) * esize,
                       (size_t)D * esize);
                memcpy((char *)v + off * esize, (const char *)vnew + (b * vn_sb + h * vn_sh) * esize,
                       (size_t)D * esize);
            }
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t bh = task / pieces, piece = task % pieces;
            int64_t b = bh / nkv, h = bh % nkv;
            int64_t L = lens[b] < cap ? lens[b] : cap;
            int64_t p0 = L * piece / pieces, p1 = L * (piece + 1) / pieces;
            Partial *part = &parts[task];
            part->acc = acc + task * g * D;
            float qs[MAX_G * MAX_D];
            for (int64_t j = 0; j < g; j++) {
                load_row(q, b * q_sb + (h * g + j) * q_sh, bf16, (int)D, qs + j * D);
                for (int64_t d = 0; d < D; d++) qs[j * D + d] *= scale;
            }
            attend_piece(qs, (int)g, (int)D, k, v, bf16, h * s_head, table + b * s_table,
                         block, s_block, s_row, p0, p1, part);
        }
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * nkv; bh++) {
            int64_t b = bh / nkv, h = bh % nkv;
            float o[MAX_D];
            for (int64_t j = 0; j < g; j++) {
                float mx = -INFINITY, l = 0.f;
                for (int64_t i = 0; i < pieces; i++) {
                    float m = parts[bh * pieces + i].m[j];
                    mx = m > mx ? m : mx;
                }
                memset(o, 0, sizeof(float) * (size_t)D);
                for (int64_t i = 0; i < pieces; i++) {
                    Partial *part = &parts[bh * pieces + i];
                    if (part->l[j] == 0.f) continue;  /* an empty piece */
                    float w = expf(part->m[j] - mx);
                    l += part->l[j] * w;
                    const float *a = part->acc + j * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
                }
                float inv = l > 0.f ? 1.f / l : 0.f;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
                store_row(out, b * o_sb + (h * g + j) * o_sh, bf16, (int)D, o);
            }
        }
    }
    free(acc);
    free(parts);
    return 0;
}
