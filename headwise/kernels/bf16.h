/* bfloat16 <-> float32 for headwise's C kernels (included by cpu_pointwise.c and
 * cpu_matmul.c; cpu_kernels.py hashes this file into every library's cache key). */
#ifndef HEADWISE_BF16_H
#define HEADWISE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f)  /* round to nearest even, NaN kept, as PyTorch casts */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#endif
