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

typedef struct { float v; int32_t p; } Entry;

/* a ranks below b: smaller bound, or equal bound and a later page */
static inline int below(Entry a, Entry b) { return a.v < b.v || (a.v == b.v && a.p > b.p); }

/* Min-heap of the best k entries seen (the root is the worst kept). */
static void sift_down(Entry *h, int64_t n, int64_t i)
{
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && below(h[l], h[m])) m = l;
        if (r < n && below(h[r], h[m])) m = r;
        if (m == i) return;
        Entry t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
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
                float qp[MAX_G][MAX_D], qn[MAX_G][MAX_D];  /* q's positive and negative parts */
                for (int64_t j = 0; j < g; j++) {
                    Row x;
                    load_row(q, b * q_sb + (h * g + j) * q_sh, q_bf16, &x, D);
                    for (int64_t d = 0; d < D; d++) {
                        qp[j][d] = x.f[d] > 0 ? x.f[d] : 0;
                        qn[j][d] = x.f[d] < 0 ? x.f[d] : 0;
                    }
                }
                int64_t k = Kb - forced;  /* pages chosen by bound */
                Entry *heap = k > 0 ? malloc(k * sizeof(Entry)) : NULL;
                char *take = calloc(P, 1);
                if ((k > 0 && !heap) || !take) { free(heap); free(take); out_lens[h * B + b] = -1; continue; }
                int64_t used = 0;
                Row lohi;  /* the page's key minimum, then maximum: [2, D] */
                const float *lo = lohi.f, *hi = lohi.f + D;
                for (int64_t p = 0; p < P; p++) {
                    if (p < sink_end || p >= win_start) { take[p] = 1; continue; }
                    if (k <= 0) continue;
                    load_row(summ, (int64_t)row[p] * s_block + h * s_head, s_bf16, &lohi, 2 * D);
                    float best = -__builtin_inff();
                    for (int64_t j = 0; j < g; j++) {
                        /* LANES partial sums in one vector, halved pairwise at the end: the
                         * sum is vectorised without reassociating it per build, and its last
                         * adds form a tree of depth log2(LANES) in registers */
                        vlanes acc = {0};
                        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
                            vlanes a, b, c, e;
                            memcpy(&a, &qp[j][d0], sizeof a);
                            memcpy(&b, &hi[d0], sizeof b);
                            memcpy(&c, &qn[j][d0], sizeof c);
                            memcpy(&e, &lo[d0], sizeof e);
                            acc += a * b + c * e;
                        }
                        float sum = hsum(acc);
                        best = sum > best ? sum : best;
                    }
                    Entry e = {best, (int32_t)p};
                    if (used < k) {  /* fill, then keep the heap property */
                        heap[used++] = e;
                        if (used == k)
                            for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
                    } else if (below(heap[0], e)) {
                        heap[0] = e;
                        sift_down(heap, k, 0);
                    }
                }
                for (int64_t i = 0; i < used; i++) take[heap[i].p] = 1;
                for (int64_t p = 0; p < P; p++)
                    if (take[p]) dst[c++] = row[p];
                free(heap);
                free(take);
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
