/* 16-lane float vectors (GCC vector extensions: zmm registers with AVX-512, pairs of ymm with
 * AVX2) and the exp the kernels share. Included by attention.c and layers.c. */
#ifndef PREFIXCACHE_VECTOR_MATH_H
#define PREFIXCACHE_VECTOR_MATH_H

#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
#define LANES 16

/* max(x, lo) per lane: one vmaxps where the CPU has AVX-512, else compare and select */
static inline vfloat max_lanes(vfloat x, float lo) {
#ifdef __AVX512F__
    return (vfloat)_mm512_max_ps((__m512)x, _mm512_set1_ps(lo));
#else
    const vfloat low = x * 0.0f + lo;
    const vint below = x < low;
    return (vfloat)((below & (vint)low) | (~below & (vint)x));
#endif
}

/* min(x, hi) per lane */
static inline vfloat min_lanes(vfloat x, float hi) {
#ifdef __AVX512F__
    return (vfloat)_mm512_min_ps((__m512)x, _mm512_set1_ps(hi));
#else
    const vfloat high = x * 0.0f + hi;
    const vint above = x > high;
    return (vfloat)((above & (vint)high) | (~above & (vint)x));
#endif
}

/* e^x for x in [-87, 88] (callers clamp): 2^n e^r, n = round(x / ln 2), |r| <= ln(2) / 2, a
 * degree-6 polynomial (minimax for relative error) for e^r and 2^n built from n's bits: adding
 * 1.5 * 2^23 + 127 to x / ln 2 leaves n + 127 in the low mantissa bits of the float sum t, so
 * t's bits shifted left by 23 are 2^n (a normal float for every n in range). Relative error
 * <= 3.1e-7 (float32 SDPA's exp: ~1e-7); 10 vector operations per 16 lanes. */
static inline vfloat exp_in_range(vfloat x) {
    const vfloat t = x * 1.44269504088896341f + 12583039.0f;
    const vfloat n = t - 12583039.0f;
    const vfloat r = x - n * 0.693147180559945f;
    vfloat p = r * 1.383683062158525e-3f + 8.374815806746483e-3f;
    p = p * r + 4.166822507977486e-2f;
    p = p * r + 1.6666419804096222e-1f;
    p = p * r + 4.9999991059303284e-1f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vfloat)((vint)t << 23);
}

#endif
