/* Row-wise kernels of a decoder layer on the CPU: RMSNorm (after an optional residual add)
 * and the rotary embedding, one pass over each row, float32 math, rounded once.
 *
 * Built and loaded at run time by headwise/kernels/cpu_kernels.py, like cpu_decode.c, but
 * with -ffp-contract=off: a * b - c * d is rounded as PyTorch's separate ops round it, so
 * the rotary embedding of float32 values is PyTorch's bit for bit. PyTorch's own CPU code
 * for these runs as many ops (bfloat16 -> float32, squares, sums, products, back), each a
 * pass over memory: at 8K tokens of SmolLM2 they took ~1 s of a 3.4 s prefill.
 *
 * Values are float32 (bf16 = 0) or bfloat16 (bf16 = 1); a row's last dimension has unit
 * stride, the others are given as strides in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Below this many elements a call runs on one thread (a decode step's rows). */
#define PARALLEL_MIN 32768

static inline float get(const void *base, int64_t i, int bf16)
{
    return bf16 ? from_bf16(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void put(void *base, int64_t i, int bf16, float f)
{
    if (bf16)
        ((uint16_t *)base)[i] = to_bf16(f);
    else
        ((float *)base)[i] = f;
}

/* Sum of a row's squares over dim: float32 over runs of 64 values (vectorised), the
 * runs' sums added in double; as exact as PyTorch's cascaded float32 sum, or more. */
static inline __attribute__((always_inline)) float mean_square(const void *row, int64_t dim, const int bf16)
{
    double total = 0.0;
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        int64_t d1 = d0 + 64 < dim ? d0 + 64 : dim;
        float part = 0.f;
        #pragma omp simd reduction(+:part)
        for (int64_t d = d0; d < d1; d++) {
            float s = get(row, d, bf16);
            part += s * s;
        }
        total += part;
    }
    return (float)(total / (double)dim);
}

/* One row of rms_norm; inlined with constant types, so each loop is compiled for them. */
static inline __attribute__((always_inline)) void
norm_row(const char *src, const char *rr, char *sr, char *orow, const void *w, int64_t dim, float eps,
         const int bf16, const int w_bf16)
{
    if (rr) {
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            put(sr, d, bf16, get(src, d, bf16) + get(rr, d, bf16));
        src = sr;
    }
    float rstd = 1.f / sqrtf(mean_square(src, dim, bf16) + eps);  /* float32, as PyTorch */
    #pragma omp simd
    for (int64_t d = 0; d < dim; d++)
        put(orow, d, bf16, get(src, d, bf16) * rstd * get(w, d, w_bf16));
}

/* out[r] = s[r] / sqrt(mean(s[r]^2) + eps) * w, where s = x, or, with res, s = x + res
 * rounded to the values' type and also stored at sum (which may be x itself).
 * w: [dim], float32 (w_bf16 = 0) or bfloat16. */
void rms_norm(const void *x, int64_t x_s, const void *res, int64_t r_s, void *sum, int64_t s_s,
              void *out, int64_t o_s, const void *w, int w_bf16, int64_t rows, int64_t dim,
              float eps, int bf16, int nthreads)
{
    const size_t e = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *src = (const char *)x + r * x_s * e;
        const char *rr = res ? (const char *)res + r * r_s * e : NULL;
        char *sr = res ? (char *)sum + r * s_s * e : NULL;
        char *orow = (char *)out + r * o_s * e;
        if (bf16 && w_bf16)
            norm_row(src, rr, sr, orow, w, dim, eps, 1, 1);
        else if (bf16)
            norm_row(src, rr, sr, orow, w, dim, eps, 1, 0);
        else if (w_bf16)
            norm_row(src, rr, sr, orow, w, dim, eps, 0, 1);
        else
            norm_row(src, rr, sr, orow, w, dim, eps, 0, 0);
    }
}

/* One (token, head) of rotary, inlined with a constant type. */
static inline __attribute__((always_inline)) void
rotate_row(const char *xr, char *orow, const float *c, const float *s, int64_t half, const int bf16)
{
    #pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float x1 = get(xr, i, bf16), x2 = get(xr, i + half, bf16);
        put(orow, i, bf16, x1 * c[i] - x2 * s[i]);
        put(orow, i + half, bf16, x2 * c[i] + x1 * s[i]);
    }
}

/* Half-split rotary embedding of x [T, H, D] into out (which may be x): with c, s the
 * cos and sin [T, D/2] (float32, row stride c_t) of each token's position,
 *     out[.., i] = x[.., i] c[i] - x[.., i + D/2] s[i]
 *     out[.., i + D/2] = x[.., i + D/2] c[i] + x[.., i] s[i]. */
void rotary(const void *x, int64_t x_t, int64_t x_h, void *out, int64_t o_t, int64_t o_h,
            const float *cos_, const float *sin_, int64_t c_t, int64_t T, int64_t H, int64_t D,
            int bf16, int nthreads)
{
    const size_t e = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * c_t, *s = sin_ + t * c_t;
        for (int64_t h = 0; h < H; h++) {
            const char *xr = (const char *)x + (t * x_t + h * x_h) * e;
            char *orow = (char *)out + (t * o_t + h * o_h) * e;
            if (bf16)
                rotate_row(xr, orow, c, s, D / 2, 1);
            else
                rotate_row(xr, orow, c, s, D / 2, 0);
        }
    }
}
