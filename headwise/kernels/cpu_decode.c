/* Decode attention on the CPU for one head class of one layer: each sequence's g query
 * heads per KV head attend over that KV head's cached keys, wherever the cache keeps them.
 *
 * Built and loaded at run time by headwise/kernels/cpu_kernels.py (the system C compiler,
 * -O3 -march=native -fopenmp); the PyTorch backend calls it instead of one SDPA call per
 * (sequence, class), whose per-call cost dominates decode at these sizes (~125 us each,
 * 48 per SmolLM2 step).
 *
 * Key row p of sequence b, KV head h (K and V alike, at k or v):
 *     base + h * s_head + table[b * s_table + p / block] * s_block + (p % block) * s_row
 * Full heads: table = the block table, block = block size, s_block = block * s_row.
 * Window heads: table = the ring slots (one entry per sequence), block = ring length.
 * Sequence b attends its first min(lens[b], cap) rows (a ring holds cap = its length).
 * int8 caches keep one scale per row (in q's dtype), addressed alike with their own
 * strides (c_head, c_block, c_row); a row's value is its int8 codes times its scale.
 *
 * Work is cut into (sequence, KV head, piece of the keys) tasks so that one sequence with
 * one KV head still uses every thread; the pieces are merged by their log-sum-exp, as
 * flash-decoding does. Scores and sums are float32; q is float32 or bfloat16, K/V are
 * stored as q is, or int8.
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
#define MAX_D 512      /* head size, a multiple of 16 */
#define MIN_PIECE 256  /* keys per task at least, when a sequence is cut */

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };

/* Sixteen lanes as one value (GCC/Clang vector extension: lowered to the target's SIMD,
 * AVX-512 here). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int8_t v16c __attribute__((vector_size(16)));

/* Sixteen consecutive values at element `off` of base as floats. */
static inline __attribute__((always_inline)) v16f load16(const void *base, int64_t off, int type)
{
    /* GCC widens vector-extension conversions lane by lane here: intrinsics where there
     * are (3-4x faster for int8) */
    if (type == KV_BF16) {  /* a bfloat16 is the high half of a float */
#if defined(__AVX512F__)
        __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
        return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
#else
        v16h h;
        memcpy(&h, (const uint16_t *)base + off, sizeof h);
        return (v16f)(__builtin_convertvector(h, v16u) << 16);
#endif
    }
    if (type == KV_INT8) {
#if defined(__AVX512F__)
        __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)base + off));
        return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#else
        v16c c;
        memcpy(&c, (const int8_t *)base + off, sizeof c);
        return __builtin_convertvector(__builtin_convertvector(c, v16i), v16f);
#endif
    }
    v16f f;
    memcpy(&f, (const float *)base + off, sizeof f);
    return f;
}

static inline float load1(const void *base, int64_t off, int bf16)
{
    if (!bf16)
        return ((const float *)base)[off];
    uint32_t u = (uint32_t)((const uint16_t *)base)[off] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f)  /* round to nearest even, as PyTorch casts */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline void store_row(void *base, int64_t off, int bf16, int D, const float *src)
{
    if (bf16) {
        uint16_t *o = (uint16_t *)base + off;
        for (int d = 0; d < D; d++) o[d] = to_bf16(src[d]);
    } else {
        memcpy((float *)base + off, src, (size_t)D * sizeof(float));
    }
}

static inline float hmax(v16f x)
{
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#else
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
#endif
}

static inline float hsum(v16f x)
{
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#else
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
#endif
}

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

/* Where one class's cache is and how it is stored. */
typedef struct {
    void *k, *v;                      /* values */
    void *ks, *vs;                    /* int8: per-row scales, else NULL */
    int64_t s_head, s_block, s_row;   /* value strides, in elements */
    int64_t c_head, c_block, c_row;   /* scale strides, in elements */
    int type;                         /* KV_F32, KV_BF16 or KV_INT8 */
    int bf16;                         /* q, out, new rows and scales: bfloat16, else float32 */
} Cache;

typedef struct {
    float m[MAX_G];   /* running max of the scores */
    float l[MAX_G];   /* sum of exp(score - m) */
    float *acc;       /* [g, D]: sum of exp(score - m) * v */
} Partial;

/* Keys [p0, p1) of (b, h), D = 16 * DC: scores, softmax and the weighted sum of values
 * into part. Each key and value row is loaded once, into DC vectors: the scores of all g
 * queries come from one load of the key, and per 16-float column of the output the g
 * accumulators stay in registers over the tile's values. Inlined with DC a constant for
 * the common head sizes, so the row loops unroll. */
static inline __attribute__((always_inline)) void
attend_piece_v(const float *q /* [g, D], scaled */, int g, const int DC, const int type, const Cache *c,
               int64_t h, const int32_t *table, int64_t block, int64_t p0, int64_t p1, Partial *part)
{
    const int D = 16 * DC;
    /* Partial sums stay on this thread's stack until the end: tasks' Partials are
     * neighbours in memory, and threads writing them every tile would share lines. */
    v16f acc[MAX_G * (MAX_D / 16)], qv[MAX_G * (MAX_D / 16)];
    float s[MAX_G][TILE], m[MAX_G], l[MAX_G], vsc[TILE] = {0};
    int64_t offs[TILE];
    const int quant = type == KV_INT8;
    for (int j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
        for (int i = 0; i < DC; i++) {
            acc[j * DC + i] = (v16f){};
            memcpy(&qv[j * DC + i], q + (int64_t)j * D + 16 * i, sizeof(v16f));
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
            offs[t] = h * c->s_head + (int64_t)table[blk] * c->s_block + in * c->s_row;
            float ksc = 1.f;
            if (quant) {
                int64_t so = h * c->c_head + (int64_t)table[blk] * c->c_block + in * c->c_row;
                ksc = load1(c->ks, so, c->bf16);
                vsc[t] = load1(c->vs, so, c->bf16);
            }
            if (++in == block) {
                in = 0;
                blk++;
            }
            v16f kr[MAX_D / 16];
            for (int i = 0; i < DC; i++) kr[i] = load16(c->k, offs[t] + 16 * i, type);
            for (int j = 0; j < g; j++) {
                v16f d = qv[j * DC] * kr[0];
                for (int i = 1; i < DC; i++) d += qv[j * DC + i] * kr[i];
                sc[j][t] = hsum(d) * ksc;
            }
        }
        for (int j = 0; j < g; j++) {
            v16f sv;
            memcpy(&sv, sc[j], sizeof sv);
            float mx = hmax(sv);
            mx = m[j] > mx ? m[j] : mx;
            v16f pv = exp_le0(sv - mx);
            for (int t = n; t < TILE; t++) pv[t] = 0.f;  /* past the piece's end */
            float corr = m[j] == -INFINITY ? 0.f : exp_le0((v16f){} + (m[j] - mx))[0];
            l[j] = l[j] * corr + hsum(pv);
            m[j] = mx;
            if (quant) {  /* the value rows' scales weigh their probabilities */
                v16f w;
                memcpy(&w, vsc, sizeof w);
                pv *= w;
            }
            memcpy(s[j], &pv, sizeof pv);
            for (int i = 0; i < DC; i++) acc[j * DC + i] *= corr;
        }
        for (int i = 0; i < DC; i++) {
            v16f a[MAX_G];
            for (int j = 0; j < g; j++) a[j] = acc[j * DC + i];
            for (int t = 0; t < n; t++) {
                v16f vr = load16(c->v, offs[t] + 16 * i, type);
                for (int j = 0; j < g; j++) a[j] += s[j][t] * vr;
            }
            for (int j = 0; j < g; j++) acc[j * DC + i] = a[j];
        }
    }
    memcpy(part->m, m, sizeof(float) * (size_t)g);
    memcpy(part->l, l, sizeof(float) * (size_t)g);
    for (int j = 0; j < g; j++)
        for (int i = 0; i < DC; i++) memcpy(part->acc + (int64_t)j * D + 16 * i, &acc[j * DC + i], sizeof(v16f));
}

/* attend_piece_v with the storage type and the common head sizes as constants. */
#define FOR_TYPE(T)                                                                          \
    static void attend_piece_##T(const float *q, int g, int D, const Cache *c, int64_t h,    \
                                 const int32_t *table, int64_t block, int64_t p0, int64_t p1, \
                                 Partial *part)                                              \
    {                                                                                        \
        switch (D) {                                                                         \
        case 64: attend_piece_v(q, g, 4, T, c, h, table, block, p0, p1, part); break;        \
        case 128: attend_piece_v(q, g, 8, T, c, h, table, block, p0, p1, part); break;       \
        case 256: attend_piece_v(q, g, 16, T, c, h, table, block, p0, p1, part); break;      \
        default: attend_piece_v(q, g, D / 16, T, c, h, table, block, p0, p1, part);          \
        }                                                                                    \
    }
FOR_TYPE(KV_F32)
FOR_TYPE(KV_BF16)
FOR_TYPE(KV_INT8)
#undef FOR_TYPE

static void attend_piece(const float *q, int g, int D, const Cache *c, int64_t h, const int32_t *table,
                         int64_t block, int64_t p0, int64_t p1, Partial *part)
{
    if (c->type == KV_INT8)
        attend_piece_KV_INT8(q, g, D, c, h, table, block, p0, p1, part);
    else if (c->type == KV_BF16)
        attend_piece_KV_BF16(q, g, D, c, h, table, block, p0, p1, part);
    else
        attend_piece_KV_F32(q, g, D, c, h, table, block, p0, p1, part);
}

/* Row x [D] (q's dtype) into the cache at value offset off (and scale offset so). int8:
 * one symmetric scale per row, amax / 127, rounded to the scale dtype before dividing,
 * codes rounded half to even: as headwise.layers.kv_tensor.quantize computes them. */
static void write_row(const Cache *c, void *dst, void *sdst, int64_t off, int64_t so, const void *x, int D)
{
    if (c->type != KV_INT8) {
        size_t e = c->bf16 ? 2 : 4;
        memcpy((char *)dst + off * e, x, (size_t)D * e);
        return;
    }
    float xf[MAX_D], amax = 0.f;
    for (int d = 0; d < D; d++) {
        xf[d] = load1(x, d, c->bf16);
        float a = fabsf(xf[d]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.f;
    s = s < 1.17549435e-38f ? 1.17549435e-38f : s;  /* the scale dtype's smallest normal */
    if (c->bf16) {
        uint16_t b = to_bf16(s);
        ((uint16_t *)sdst)[so] = b;
        s = load1(&b, 0, 1);
    } else {
        ((float *)sdst)[so] = s;
    }
    int8_t *o = (int8_t *)dst + off;
    for (int d = 0; d < D; d++) {
        float y = xf[d] / s;
        y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
        o[d] = (int8_t)rintf(y);
    }
}

/* Returns 0; -1 for sizes it does not take (g > MAX_G, D > MAX_D or not a multiple of 16)
 * or no memory; -2 when a sequence has more keys (or a write row) than its `width` table
 * entries address. With wpos (else NULL), first writes the step's own K/V rows knew/vnew
 * [B, nkv, D] at key row wpos[b] of each sequence (addressed as the keys are), then
 * attends. */
int paged_decode(const void *q, int64_t q_sb, int64_t q_sh,  /* [B, nkv * g, D] */
                 void *out, int64_t o_sb, int64_t o_sh,      /* like q */
                 const void *knew, int64_t kn_sb, int64_t kn_sh,   /* [B, nkv, D] */
                 const void *vnew, int64_t vn_sb, int64_t vn_sh, const int64_t *wpos,
                 void *k, void *v, int64_t s_head, int64_t s_block, int64_t s_row,
                 void *ks, void *vs, int64_t c_head, int64_t c_block, int64_t c_row,
                 const int32_t *table, int64_t s_table, int64_t width, int64_t block,
                 const int32_t *lens, int64_t cap, int64_t B, int64_t nkv, int64_t g, int64_t D,
                 float scale, int type, int bf16, int nthreads)
{
    if (B <= 0 || nkv <= 0)
        return 0;
    if (g > MAX_G || D > MAX_D || D % 16 || (type == KV_INT8 && (!ks || !vs)))
        return -1;
    const Cache cache = {k, v, ks, vs, s_head, s_block, s_row, c_head, c_block, c_row, type, bf16};
    const Cache *c = &cache;
    /* pieces per (b, h): enough tasks for every thread, none under MIN_PIECE keys */
    int64_t maxlen = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b] < cap ? lens[b] : cap;
        if (L > width * block || (wpos && (wpos[b] < 0 || wpos[b] >= width * block)))
            return -2;
        maxlen = L > maxlen ? L : maxlen;
    }
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
    const size_t qsize = bf16 ? 2 : 4;
    #pragma omp parallel num_threads(nthreads)
    {
        if (wpos) {
            #pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * nkv; bh++) {
                int64_t b = bh / nkv, h = bh % nkv, p = wpos[b];
                int64_t blk = table[b * s_table + p / block], in = p % block;
                int64_t off = h * s_head + blk * s_block + in * s_row;
                int64_t so = h * c_head + blk * c_block + in * c_row;
                write_row(c, k, ks, off, so, (const char *)knew + (b * kn_sb + h * kn_sh) * qsize, (int)D);
                write_row(c, v, vs, off, so, (const char *)vnew + (b * vn_sb + h * vn_sh) * qsize, (int)D);
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
            for (int64_t j = 0; j < g; j++)
                for (int64_t d = 0; d < D; d++)
                    qs[j * D + d] = load1(q, b * q_sb + (h * g + j) * q_sh + d, bf16) * scale;
            attend_piece(qs, (int)g, (int)D, c, h, table + b * s_table, block, p0, p1, part);
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
