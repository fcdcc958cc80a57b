/* The decoder's element-wise steps on the CPU, float32: residual add + RMSNorm, rotary
 * embedding in place, and the SwiGLU activation (silu(gate) * up).
 *
 * Built by prefixcache.native for prefixcache.model.native_layers (cc -O3 -march=native
 * -fopenmp) at first use and called through ctypes. Each is one pass over its rows where torch
 * runs 2-6 kernels with a temporary each (F.rms_norm: 4; the rotary: 3 and a roll), rows split
 * over the OpenMP team torch uses. Rows are contiguous; x / w / out never alias unless stated.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "vector_math.h"

/* e^x, x clamped to [-87, 88] */
static inline vfloat exp_clamped(vfloat x) {
    return exp_in_range(min_lanes(max_lanes(x, -87.0f), 88.0f));
}

/* h, delta, out: [rows, n]; w: [n]. h += delta (skipped when delta is NULL), then
 * out = w * (h / sqrt(mean(h^2) + eps)), the product order of transformers' LlamaRMSNorm. */
void pc_add_rms_norm(float *h, const float *delta, const float *w, float *out, int rows, int n,
                     float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        float *x = h + (int64_t)r * n;
        float sum_sq = 0.0f;
        if (delta != NULL) {
            const float *d = delta + (int64_t)r * n;
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < n; i++) {
                x[i] += d[i];
                sum_sq += x[i] * x[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < n; i++) sum_sq += x[i] * x[i];
        }
        const float inv = 1.0f / sqrtf(sum_sq / (float)n + eps);
        float *o = out + (int64_t)r * n;
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = w[i] * (x[i] * inv);
    }
}

/* gate_up: [rows, 2 * I] (gate then up), out: [rows, I] = silu(gate) * up, silu(g) =
 * g / (1 + e^-g). */
void pc_silu_mul(const float *gate_up, float *out, int rows, int I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * I, *u = g + I;
        float *o = out + (int64_t)r * I;
        int i = 0;
        for (; i + LANES <= I; i += LANES) {
            vfloat a, b;
            memcpy(&a, g + i, sizeof a);
            memcpy(&b, u + i, sizeof b);
            const vfloat y = a / (1.0f + exp_clamped(-a)) * b;
            memcpy(o + i, &y, sizeof y);
        }
        if (i < I) { /* the last 1 .. 15 as one partial vector */
            const size_t bytes = (size_t)(I - i) * sizeof(float);
            vfloat a = {0}, b = {0};
            memcpy(&a, g + i, bytes);
            memcpy(&b, u + i, bytes);
            const vfloat y = a / (1.0f + exp_clamped(-a)) * b;
            memcpy(o + i, &y, bytes);
        }
    }
}

/* x: [T, heads, D] with rows row_stride floats apart (heads and D contiguous), rotated in place
 * by position; cos, signed_sin: [T, D] as RotaryEmbedding.cos_sin builds them (cos repeated
 * over both halves, sin as [-sin, sin]), so with x = [x1, x2]:
 * out = [x1 cos + x2 (-sin), x2 cos + x1 sin], transformers' x cos + rotate_half(x) sin. */
void pc_rotary(float *x, int64_t row_stride, int T, int heads, int D, const float *cos,
               const float *signed_sin, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = signed_sin + (int64_t)t * D;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * row_stride + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] + b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
