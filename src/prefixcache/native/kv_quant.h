/* The paged KV cache's layouts as the attention kernels read them, and the quantized ones'
 * writes (prefixcache/attention/kv_format.py is the Python side; its torch code is the
 * reference these must match bit for bit).
 *
 * A cache row is one token's K (or V) for one kv head, D values. float32 and bfloat16 rows are
 * D elements. A quantized row is D / 32 blocks in llama.cpp's block layout, each a float16
 * scale d, then:
 *   int8      32 signed bytes q, value d * q (Q8_0: d = amax / 127, q = round-half-even(x / d))
 *   int4      16 bytes, value j in the low nibble of byte j, value 16 + j in the high one,
 *             value d * (n - 8) (Q4_0: d near the largest-magnitude value / -8, the best of a
 *             few, `q4_scale`); K and V rotated
 *             by the normalised Hadamard transform of the head first (`hadamard`), which the
 *             kernels apply to the queries, and to the outputs to rotate them back
 *   fp8_e4m3, fp8_e5m2  32 bytes of 8-bit floats f, value d * f (d = amax / the format's
 *             largest finite value)
 * The scale is computed once per block (amax / q_max, rounded to float16), and each value
 * quantized against that float16 scale: x * (1 / d) rounded, clamped to the format's range. */
#ifndef PREFIXCACHE_KV_QUANT_H
#define PREFIXCACHE_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* What the caches hold (and for bfloat16, how the direct path multiplies it: `bf16` in the
 * kernels' arguments is one of these) */
enum {
    KV_F32 = 0,
    KV_BF16 = 1,
    KV_BF16_PRODUCTS = 2,
    KV_Q8 = 3,
    KV_Q4 = 4,
    KV_FP8_E4M3 = 5,
    KV_FP8_E5M2 = 6,
};
#define QBLOCK 32 /* values per quantized block */
/* or'ed into a quantized layout's code: a bfloat16 model's direct path reads its blocks as
 * bfloat16 (each value rounded once more) and multiplies bfloat16 pairs, as over a bfloat16
 * cache (KV_BF16_PRODUCTS) */
#define KV_PRODUCTS 16

static inline int kv_layout(int fmt) { return fmt & (KV_PRODUCTS - 1); }
static inline int kv_quantized(int fmt) { return kv_layout(fmt) >= KV_Q8; }
static inline int kv_rotated(int fmt) { return kv_layout(fmt) == KV_Q4; }
static inline int kv_products(int fmt) { return fmt == KV_BF16_PRODUCTS || (fmt & KV_PRODUCTS); }

/* Bytes of one row of D values (D a multiple of 32 for the quantized layouts) */
static inline int64_t kv_row_bytes(int D, int fmt) {
    switch (kv_layout(fmt)) {
    case KV_F32: return 4 * (int64_t)D;
    case KV_BF16: case KV_BF16_PRODUCTS: return 2 * (int64_t)D;
    case KV_Q4: return (int64_t)D / QBLOCK * (2 + QBLOCK / 2);
    default: return (int64_t)D / QBLOCK * (2 + QBLOCK);
    }
}

/* IEEE float16 <-> float32, round to nearest even: F16C's instructions where the CPU has them
 * (every AVX2 CPU the kernels target), else the same conversions in integer code */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000;
    const int32_t exp = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    uint32_t man = x & 0x7FFFFF;
    if (((x >> 23) & 0xFF) == 0xFF) return (uint16_t)(sign | 0x7C00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7C00);
    if (exp <= 0) { /* subnormal or zero: shift the implicit bit in, round to nearest even */
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        const int shift = 14 - exp;
        uint32_t half = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* may carry into exp */
    return (uint16_t)(sign | half);
#endif
}

/* The 8-bit floats' values, by byte (e4m3fn: no infinities, 0x7F/0xFF NaN; e5m2: IEEE-like) */
static float fp8_values[2][256];

static float fp8_value(unsigned byte, int e5m2) {
    const int sign = byte >> 7, bits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const int exp = (byte & 0x7F) >> bits, man = byte & ((1 << bits) - 1);
    float v;
    if (!e5m2 && exp == 15 && man == 7) v = NAN;
    else if (e5m2 && exp == 31) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexpf((float)man, 1 - bias - bits);
    else v = ldexpf((float)((1 << bits) | man), exp - bias - bits);
    return sign ? -v : v;
}

__attribute__((constructor)) static void fp8_tables(void) {
    for (int e = 0; e < 2; e++)
        for (unsigned b = 0; b < 256; b++) fp8_values[e][b] = fp8_value(b, e);
}

/* x [D] <- H x / sqrt(D), the normalised Walsh-Hadamard transform (D a power of two): its own
 * inverse. The butterflies run in one fixed order (pairs h apart, h = 1, 2, 4, ...), as
 * kv_format.hadamard does them in torch. */
#ifdef __AVX512F__
/* one butterfly stage h < 16 inside 16-lane vectors: lane j with bit h clear takes x_j +
 * x_{j+h}, with it set x_{j-h} - x_j (the same two operations as the scalar stage's) */
static inline __m512 butterfly_lanes(__m512 x, int h) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), x);
    const __mmask16 high = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), high, partner, x);
}
#endif

static void hadamard(float *x, int D) {
#ifdef __AVX512F__
    if (D >= 16 && D <= 512) {
        __m512 v[32];
        const int n = D / 16;
        for (int i = 0; i < n; i++) v[i] = _mm512_loadu_ps(x + 16 * i);
        for (int h = 1; h < 16; h *= 2)
            for (int i = 0; i < n; i++) v[i] = butterfly_lanes(v[i], h);
        for (int h = 1; h < n; h *= 2) /* pairs of whole vectors, 16 h apart */
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const __m512 a = v[j], b = v[j + h];
                    v[j] = _mm512_add_ps(a, b);
                    v[j + h] = _mm512_sub_ps(a, b);
                }
        const __m512 norm = _mm512_set1_ps(1.0f / sqrtf((float)D));
        for (int i = 0; i < n; i++) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(v[i], norm));
        return;
    }
#endif
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)D);
    for (int d = 0; d < D; d++) x[d] *= norm;
}

/* One quantized block's 32 values (after its 2-byte scale) times the scale d into dst: each
 * value one product (exact value times d, rounded once), in vectors where the CPU has AVX-512 */
static inline void dequant_block(float *dst, const uint8_t *q, float d, int fmt) {
#ifdef __AVX512F__
    const __m512 scale = _mm512_set1_ps(d);
    __m512 lo, hi;
    if (fmt == KV_Q8) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    } else if (fmt == KV_Q4) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512i eight = _mm512_set1_epi32(8), nibble = _mm512_set1_epi32(15);
        lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(bytes, nibble), eight));
        hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), eight));
    } else { /* 8-bit floats as float16 bits (e5m2: the high byte; e4m3: rebiased by 2^8) */
        const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        if (fmt == KV_FP8_E5M2) {
            lo = _mm512_cvtph_ps(_mm256_slli_epi16(a, 8));
            hi = _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
        } else {
            const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7F);
            const __m512 rebias = _mm512_set1_ps(256.0f);
            lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(
                     _mm256_slli_epi16(_mm256_and_si256(a, sign), 8),
                     _mm256_slli_epi16(_mm256_and_si256(a, rest), 7))), rebias);
            hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(
                     _mm256_slli_epi16(_mm256_and_si256(b, sign), 8),
                     _mm256_slli_epi16(_mm256_and_si256(b, rest), 7))), rebias);
        }
    }
    _mm512_storeu_ps(dst, _mm512_mul_ps(lo, scale));
    _mm512_storeu_ps(dst + 16, _mm512_mul_ps(hi, scale));
#else
    if (fmt == KV_Q8) {
        for (int i = 0; i < QBLOCK; i++) dst[i] = (float)(int8_t)q[i] * d;
    } else if (fmt == KV_Q4) {
        for (int i = 0; i < QBLOCK / 2; i++) {
            dst[i] = (float)((int)(q[i] & 15) - 8) * d;
            dst[QBLOCK / 2 + i] = (float)((int)(q[i] >> 4) - 8) * d;
        }
    } else {
        const float *values = fp8_values[fmt == KV_FP8_E5M2];
        for (int i = 0; i < QBLOCK; i++) dst[i] = values[q[i]] * d;
    }
#endif
}

/* D values of one cache row at src as floats: copied, widened from bfloat16 (exact: a
 * bfloat16's bits are the high half of the float it stands for), or dequantized */
static inline void dequant_row(float *dst, const char *src, int D, int fmt) {
    fmt = kv_layout(fmt);
    switch (fmt) {
    case KV_F32:
        memcpy(dst, src, (size_t)D * sizeof(float));
        return;
    case KV_BF16: case KV_BF16_PRODUCTS: {
        const uint16_t *bf = (const uint16_t *)src;
        uint32_t *bits = (uint32_t *)dst;
        for (int d = 0; d < D; d++) bits[d] = (uint32_t)bf[d] << 16;
        return;
    }
    default: {
        const int block_bytes = fmt == KV_Q4 ? 2 + QBLOCK / 2 : 2 + QBLOCK;
        for (int b = 0; b < D / QBLOCK; b++, src += block_bytes) {
            uint16_t h;
            memcpy(&h, src, 2);
            dequant_block(dst + b * QBLOCK, (const uint8_t *)src + 2, half_to_float(h), fmt);
        }
    }
    }
}

/* D values of cache row `row` (token slot * KV + kv head) as floats (`dequant_row`) */
static inline void load_row(float *dst, const void *cache, int64_t row, int D, int fmt) {
    dequant_row(dst, (const char *)cache + row * kv_row_bytes(D, fmt), D, fmt);
}

/* int4's scales tried per block: the largest magnitude / -8 times each of these (exact binary
 * fractions, 1 first); the one whose values come back with the least squared error is kept
 * (Q4_0's own scale, 1, maps the extreme exactly but wastes +8; a smaller one clips it, a larger
 * one coarsens the rest). Over a 512-token text on SmolLM2 the search takes int4's mean KL
 * divergence from 0.049 to 0.036 (docs/performance.md). */
#define Q4_SCALES 17
static const float q4_factors[Q4_SCALES] = {
    1.0f, 0.75f, 0.78125f, 0.8125f, 0.84375f, 0.875f, 0.90625f, 0.9375f, 0.96875f,
    1.03125f, 1.0625f, 1.09375f, 1.125f, 1.15625f, 1.1875f, 1.21875f, 1.25f,
};

/* x's int4 value (a nibble, the value + 8) for the inverse scale inv */
static inline float q4_nibble(float x, float inv) {
    const float n = floorf(x * inv + 8.5f);
    return n > 15.0f ? 15.0f : n < 0.0f ? 0.0f : n;
}

/* The float16 scale of an int4 block: `q4_factors`' best for x (the first of equal errors).
 * A candidate's squared error is summed in one order on every CPU, vector-friendly: value i's
 * and value 16 + i's into lane i, then the 16 lanes in halves (8, 4, 2, 1), as
 * kv_format._q4_scale sums them in torch. */
static uint16_t q4_scale(const float *x, float extreme) {
    uint16_t best = 0;
    float best_err = 0.0f;
    for (int c = 0; c < Q4_SCALES; c++) {
        const uint16_t h = float_to_half(extreme / -8.0f * q4_factors[c]);
        const float d = half_to_float(h), inv = d != 0.0f ? 1.0f / d : 0.0f;
        float sq[QBLOCK / 2];
        for (int i = 0; i < QBLOCK / 2; i++) {
            const float e0 = x[i] - (q4_nibble(x[i], inv) - 8.0f) * d;
            const float e1 = x[i + QBLOCK / 2] - (q4_nibble(x[i + QBLOCK / 2], inv) - 8.0f) * d;
            sq[i] = e0 * e0 + e1 * e1;
        }
        for (int w = QBLOCK / 4; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) sq[i] += sq[i + w];
        if (c == 0 || sq[0] < best_err) best = h, best_err = sq[0];
    }
    return best;
}

#ifdef __AVX512F__
/* lanes 0..15 of a, summed in halves (lane i + lane i + 8, then + 4, + 2, + 1): q4_scale's
 * order */
static inline float sum_halves(__m512 a) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* q4_nibble of 16 values */
static inline __m512 q4_nibbles16(__m512 x, __m512 inv) {
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, inv), _mm512_set1_ps(8.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(n, _mm512_setzero_ps()), _mm512_set1_ps(15.0f));
}

/* quantize_block in vectors: the same operations, so the same bytes */
static void quantize_block16(const float *x, char *dst, int fmt) {
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    uint16_t h;
    if (fmt == KV_Q8) {
        h = float_to_half(amax / 127.0f);
    } else { /* the first value of that magnitude, as the scalar scan finds it */
        const uint32_t at = (uint32_t)_mm512_cmp_ps_mask(a0, _mm512_set1_ps(amax), _CMP_EQ_OQ) |
                            (uint32_t)_mm512_cmp_ps_mask(a1, _mm512_set1_ps(amax), _CMP_EQ_OQ) << 16;
        const float extreme = amax == 0.0f ? 0.0f : x[__builtin_ctz(at)];
        float best_err = 0.0f;
        h = 0;
        for (int c = 0; c < Q4_SCALES; c++) {
            const uint16_t hc = float_to_half(extreme / -8.0f * q4_factors[c]);
            const float dc = half_to_float(hc);
            const __m512 d = _mm512_set1_ps(dc), inv = _mm512_set1_ps(dc != 0.0f ? 1.0f / dc : 0.0f);
            const __m512 eight = _mm512_set1_ps(8.0f);
            const __m512 e0 = _mm512_sub_ps(x0, _mm512_mul_ps(_mm512_sub_ps(q4_nibbles16(x0, inv), eight), d));
            const __m512 e1 = _mm512_sub_ps(x1, _mm512_mul_ps(_mm512_sub_ps(q4_nibbles16(x1, inv), eight), d));
            const float err = sum_halves(_mm512_add_ps(_mm512_mul_ps(e0, e0), _mm512_mul_ps(e1, e1)));
            if (c == 0 || err < best_err) h = hc, best_err = err;
        }
    }
    const float d = half_to_float(h);
    const __m512 inv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    memcpy(dst, &h, 2);
    if (fmt == KV_Q8) {
        const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 q0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x0, inv), r), lo), hi);
        const __m512 q1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x1, inv), r), lo), hi);
        _mm_storeu_si128((__m128i *)(dst + 2), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q0)));
        _mm_storeu_si128((__m128i *)(dst + 18), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q1)));
        return;
    }
    const __m512i n0 = _mm512_cvtps_epi32(q4_nibbles16(x0, inv));
    const __m512i n1 = _mm512_cvtps_epi32(q4_nibbles16(x1, inv));
    _mm_storeu_si128((__m128i *)(dst + 2),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(n0, _mm512_slli_epi32(n1, 4))));
}
#endif

/* One block of 32 values quantized into dst (2 + 32 or 2 + 16 bytes); int8 and int4 only */
static void quantize_block(const float *x, char *dst, int fmt) {
#ifdef __AVX512F__
    quantize_block16(x, dst, fmt);
    return;
#endif
    float amax = 0.0f, extreme = 0.0f;
    for (int i = 0; i < QBLOCK; i++) {
        const float a = fabsf(x[i]);
        if (a > amax) amax = a, extreme = x[i];
    }
    const uint16_t h = fmt == KV_Q8 ? float_to_half(amax / 127.0f) : q4_scale(x, extreme);
    const float d = half_to_float(h), inv = d != 0.0f ? 1.0f / d : 0.0f;
    memcpy(dst, &h, 2);
    if (fmt == KV_Q8) {
        int8_t *q = (int8_t *)(dst + 2);
        for (int i = 0; i < QBLOCK; i++) {
            float r = nearbyintf(x[i] * inv);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[i] = (int8_t)r;
        }
        return;
    }
    uint8_t *q = (uint8_t *)(dst + 2);
    for (int i = 0; i < QBLOCK / 2; i++)
        q[i] = (uint8_t)((int)q4_nibble(x[i], inv) | ((int)q4_nibble(x[QBLOCK / 2 + i], inv) << 4));
}

/* The step's new K and V into quantized caches (int8 or int4): row t of k and v (D values per
 * kv head, KV heads, rows k_stride and v_stride elements apart; bfloat16 where `bf16_in`) into
 * slot slots[t]; int4 rows are rotated first. Each row is quantized on its own: its bytes do
 * not depend on the rest of the step. On the calling thread: the writes are small beside the
 * step, and an OpenMP team's start-up and a busy core's wait would cost more than they save
 * (docs/performance.md). */
void pc_kv_write(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int T, int KV,
                 int D, int bf16_in, const int64_t *slots, void *k_cache, void *v_cache,
                 int fmt) {
    const int64_t bytes = kv_row_bytes(D, fmt), block_bytes = bytes / (D / QBLOCK);
    for (int64_t i = 0; i < (int64_t)T * KV * 2; i++) {
        const int64_t t = i / (2 * KV), h = i / 2 % KV, is_v = i % 2;
        const void *src = is_v ? v : k;
        float row[512];
        const int64_t offset = t * (is_v ? v_stride : k_stride) + h * D;
        if (bf16_in) {
            const uint16_t *bf = (const uint16_t *)src + offset;
            uint32_t *bits = (uint32_t *)row;
            for (int d = 0; d < D; d++) bits[d] = (uint32_t)bf[d] << 16;
        } else {
            memcpy(row, (const float *)src + offset, (size_t)D * sizeof(float));
        }
        if (kv_rotated(fmt)) hadamard(row, D);
        char *dst = (char *)(is_v ? v_cache : k_cache) + (slots[t] * KV + h) * bytes;
        for (int b = 0; b < D / QBLOCK; b++) quantize_block(row + b * QBLOCK, dst + b * block_bytes, fmt);
    }
}

/* Rows [n, D] rotated by `hadamard`, in place (rows `stride` floats apart) */
static void hadamard_rows(float *x, int64_t n, int64_t stride, int D) {
    for (int64_t r = 0; r < n; r++) hadamard(x + r * stride, D);
}

#endif
