/* Float vectors of the CPU's width (GCC vector extensions: 16 lanes in a zmm register with
 * AVX-512, else 8 lanes, a ymm register with AVX2: wider vectors than the registers compile to
 * values spilled to memory) and the exp the kernels share. Included by attention.c and
 * layers.c. */
#ifndef PREFIXCACHE_VECTOR_MATH_H
#define PREFIXCACHE_VECTOR_MATH_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));

static inline vfloat vsplat(float x) { return (vfloat){0} + x; }

/* a * b + c with one rounding, as one instruction where the CPU has FMA. The kernels are
 * built with -ffp-contract=off, so that no other multiply and add is fused: whether the compiler
 * fuses one depends on the code around it, which would give a row other bits in another tile. */
static inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && LANES == 8
    return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* max(x, lo) per lane (lo where x is NaN): one vmaxps where the CPU has AVX-512, else compare
 * and select */
static inline vfloat max_lanes(vfloat x, float lo) {
#ifdef __AVX512F__
    return (vfloat)_mm512_max_ps((__m512)x, _mm512_set1_ps(lo));
#else
    const vfloat low = vsplat(lo);
    const vint keep = x >= low;
    return (vfloat)((keep & (vint)x) | (~keep & (vint)low));
#endif
}

/* min(x, hi) per lane (hi where x is NaN) */
static inline vfloat min_lanes(vfloat x, float hi) {
#ifdef __AVX512F__
    return (vfloat)_mm512_min_ps((__m512)x, _mm512_set1_ps(hi));
#else
    const vfloat high = vsplat(hi);
    const vint keep = x <= high;
    return (vfloat)((keep & (vint)x) | (~keep & (vint)high));
#endif
}

/* e^x for x in [-87, 88] (callers clamp): 2^n e^r, n = round(x / ln 2), |r| <= ln(2) / 2, a
 * degree-6 polynomial (minimax for relative error) for e^r and 2^n built from n's bits: adding
 * 1.5 * 2^23 + 127 to x / ln 2 leaves n + 127 in the low mantissa bits of the float sum t, so
 * t's bits shifted left by 23 are 2^n (a normal float for every n in range). Relative error
 * <= 3.1e-7 (float32 SDPA's exp: ~1e-7); 10 vector operations per 16 lanes. */
static inline vfloat exp_in_range(vfloat x) {
    const vfloat zero = {0};
    const vfloat t = fmadd(x, zero + 1.44269504088896341f, zero + 12583039.0f);
    const vfloat n = t - 12583039.0f;
    const vfloat r = fmadd(-n, zero + 0.693147180559945f, x);
    vfloat p = fmadd(r, zero + 1.383683062158525e-3f, zero + 8.374815806746483e-3f);
    p = fmadd(p, r, zero + 4.166822507977486e-2f);
    p = fmadd(p, r, zero + 1.6666419804096222e-1f);
    p = fmadd(p, r, zero + 4.9999991059303284e-1f);
    p = fmadd(p, r, zero + 1.0f);
    p = fmadd(p, r, zero + 1.0f);
    return p * (vfloat)((vint)t << 23);
}

#endif
