/* The decoder's element-wise steps on the CPU, float32 and bfloat16: residual add + RMSNorm,
 * rotary embedding in place, and the SwiGLU activation (silu(gate) * up); and whole layers
 * built from them and a packed GEMM (at the end): float32 over MKL's or the panel GEMM
 * (panel_gemm.h), bfloat16 over the panel GEMM.
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

#include "lora.h"
#include "panel_gemm.h"
#include "quant_gemm.h"
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

/* ---- The same steps for a bfloat16 model -------------------------------------------------
 *
 * Each reads bfloat16, computes in float32 and rounds to bfloat16 exactly where torch's
 * bfloat16 code (and transformers') rounds, so the results are torch's up to the float32
 * rounding inside one step: the residual add, the normalised value before the weight, and
 * each product and sum of the rotary. */

typedef uint16_t bf16_t;

static inline float widen(bf16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* round to nearest even (finite values) */
static inline bf16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return widen(narrow(f)); }

/* pc_add_rms_norm in bfloat16: h = bf16(h + delta); out = bf16(w * bf16(h / rms(h))) */
void pc_add_rms_norm_bf16(bf16_t *h, const bf16_t *delta, const bf16_t *w, bf16_t *out, int rows,
                          int n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        bf16_t *x = h + (int64_t)r * n;
        float sum_sq = 0.0f;
        if (delta != NULL) {
            const bf16_t *d = delta + (int64_t)r * n;
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < n; i++) {
                const bf16_t sum = narrow(widen(x[i]) + widen(d[i]));
                x[i] = sum;
                sum_sq += widen(sum) * widen(sum);
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int i = 0; i < n; i++) sum_sq += widen(x[i]) * widen(x[i]);
        }
        const float inv = 1.0f / sqrtf(sum_sq / (float)n + eps);
        bf16_t *o = out + (int64_t)r * n;
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = narrow(widen(w[i]) * round_bf16(widen(x[i]) * inv));
    }
}

/* LANES bfloat16 values, widened to a vector of floats and narrowed back (round to nearest
 * even) */
typedef uint16_t vbf16 __attribute__((vector_size(2 * LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * LANES)));

static inline vfloat widen_vec(vbf16 x) { return (vfloat)(__builtin_convertvector(x, vuint) << 16); }

static inline vbf16 narrow_vec(vfloat f) {
    const vuint bits = (vuint)f;
    return __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, vbf16);
}

/* bf16(bf16(silu(g)) * u) for LANES lanes */
static inline vbf16 silu_mul_bf16(vbf16 g, vbf16 u) {
    const vfloat a = widen_vec(g);
    return narrow_vec(widen_vec(narrow_vec(a / (1.0f + exp_clamped(-a)))) * widen_vec(u));
}

/* pc_silu_mul in bfloat16: out = bf16(bf16(silu(gate)) * up) */
void pc_silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int rows, int I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const bf16_t *g = gate_up + (int64_t)r * 2 * I, *u = g + I;
        bf16_t *o = out + (int64_t)r * I;
        int i = 0;
        for (; i + LANES <= I; i += LANES) {
            vbf16 a16, b16;
            memcpy(&a16, g + i, sizeof a16);
            memcpy(&b16, u + i, sizeof b16);
            const vbf16 y = silu_mul_bf16(a16, b16);
            memcpy(o + i, &y, sizeof y);
        }
        if (i < I) { /* the last 1 .. 15 as one partial vector */
            const size_t bytes = (size_t)(I - i) * sizeof(bf16_t);
            vbf16 a16 = {0}, b16 = {0};
            memcpy(&a16, g + i, bytes);
            memcpy(&b16, u + i, bytes);
            const vbf16 y = silu_mul_bf16(a16, b16);
            memcpy(o + i, &y, bytes);
        }
    }
}

/* pc_rotary in bfloat16 (x, cos, signed_sin bfloat16): each product and the sum rounded */
void pc_rotary_bf16(bf16_t *x, int64_t row_stride, int T, int heads, int D, const bf16_t *cos,
                    const bf16_t *signed_sin, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < T; t++) {
        const bf16_t *c = cos + (int64_t)t * D, *s = signed_sin + (int64_t)t * D;
        for (int h = 0; h < heads; h++) {
            bf16_t *v = x + t * row_stride + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = widen(v[d]), b = widen(v[d + half]);
                v[d] = narrow(round_bf16(a * widen(c[d])) + round_bf16(b * widen(s[d])));
                v[d + half] = narrow(round_bf16(b * widen(c[d + half])) +
                                     round_bf16(a * widen(s[d + half])));
            }
        }
    }
}

/* ---- A whole layer in one or two calls (prefixcache.model.fused_layers) -----------------
 *
 * The steps before the attention (add + norm, qkv projection, rotary, the K/V write) and after
 * it (o projection, add + norm, the MLP) are one call each, and for a step that is one
 * sequence's prefill the attention kernel goes in between (`pc_layer`): no Python between the
 * GEMMs, whose streams of weights flush the interpreter's data (the reason: fused_layers.py).
 * The same operations in the same order, through the same packed GEMM: the same bits as the
 * separate calls. */

/* MKL's cblas_sgemm_compute (from libtorch): row-major C = A B + beta C, B packed */
typedef void (*packed_gemm_fn)(int layout, int transa, int transb, int m, int n, int k,
                               const float *a, int lda, const void *b, int ldb, float beta,
                               float *c, int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_PACKED = 151 };

/* out [rows, n] = x [rows, k] W^T (+ bias [n]); W packed by prefixcache.model.packed_gemm */
static void project(packed_gemm_fn gemm, const float *x, int rows, int k, const void *w, int n,
                    const float *bias, float *out) {
    float beta = 0.0f;
    if (bias != NULL) {
        for (int r = 0; r < rows; r++) memcpy(out + (int64_t)r * n, bias, (size_t)n * sizeof(float));
        beta = 1.0f;
    }
    gemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, rows, n, k, x, k, w, k, beta, out, n);
}

/* h [rows, hidden] += delta (unless NULL); x = RMSNorm(h) * norm_w; qkv [rows, (H + 2 KV) D]
 * = x W_qkv^T (+ bias); q and k rotated in place (cos, signed_sin: [rows, D]); this step's k
 * and v copied to their slots of the caches [num_slots, KV, D]. */
static void pc_attention_inputs(packed_gemm_fn gemm, float *h, const float *delta, const float *norm_w,
                         float eps, float *x, int rows, int hidden, const void *w_qkv,
                         const float *bias, float *qkv, int H, int KV, int D, const float *cos,
                         const float *signed_sin, float *k_cache, float *v_cache,
                         const int64_t *slots, const struct lora_runs *runs,
                         const struct lora_table *lora, int nthreads) {
    const int width = (H + 2 * KV) * D;
    const size_t kv_bytes = (size_t)KV * D * sizeof(float);
    pc_add_rms_norm(h, delta, norm_w, x, rows, hidden, eps, nthreads);
    project(gemm, x, rows, hidden, w_qkv, width, bias, qkv);
    if (lora != NULL)
        pc_lora_apply(runs, &lora[0], x, hidden, hidden, qkv, width, 0, rows, 0, nthreads);
    pc_rotary(qkv, width, rows, H + KV, D, cos, signed_sin, nthreads);
    if (k_cache == NULL) return; /* a quantized cache: the caller's kv_write writes it */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *k = qkv + (int64_t)r * width + (int64_t)H * D;
        memcpy(k_cache + slots[r] * KV * D, k, kv_bytes);
        memcpy(v_cache + slots[r] * KV * D, k + (int64_t)KV * D, kv_bytes);
    }
}

/* o = attn [rows, q_size] W_o^T; h += o; x = RMSNorm(h) * norm_w; out [rows, hidden] =
 * (silu(x W_gate^T) * x W_up^T) W_down^T, `chunk` rows at a time (gate_up: [chunk, 2 I], act:
 * [chunk, I] scratch); each projection followed by its adapters' updates (lora: the layer's
 * 4 tables, qkv, o, gate_up, down; NULL: none). */
static void pc_mlp_block(packed_gemm_fn gemm, const float *attn, int rows, int q_size, const void *w_o,
                  float *h, int hidden, const float *norm_w, float eps, const void *w_gate_up,
                  int I, const void *w_down, float *o, float *x, float *gate_up, float *act,
                  float *out, int chunk, const struct lora_runs *runs,
                  const struct lora_table *lora, int nthreads) {
    project(gemm, attn, rows, q_size, w_o, hidden, NULL, o);
    if (lora != NULL)
        pc_lora_apply(runs, &lora[1], attn, q_size, q_size, o, hidden, 0, rows, 0, nthreads);
    pc_add_rms_norm(h, o, norm_w, x, rows, hidden, eps, nthreads);
    for (int r0 = 0; r0 < rows; r0 += chunk) {
        const int m = rows - r0 < chunk ? rows - r0 : chunk;
        const float *xr = x + (int64_t)r0 * hidden;
        float *out_r = out + (int64_t)r0 * hidden;
        project(gemm, xr, m, hidden, w_gate_up, 2 * I, NULL, gate_up);
        if (lora != NULL)
            pc_lora_apply(runs, &lora[2], xr, hidden, hidden, gate_up, 2 * I, r0, m, 0, nthreads);
        pc_silu_mul(gate_up, act, m, I, nthreads);
        project(gemm, act, m, I, w_down, hidden, NULL, out_r);
        if (lora != NULL)
            pc_lora_apply(runs, &lora[3], act, I, I, out_r, hidden, r0, m, 0, nthreads);
    }
}

/* pc_attention (prefixcache/native/attention.c, another library: its address is passed in) */
typedef void (*attention_fn)(const float *q, int64_t q_row_stride, const float *k_cache,
                             const float *v_cache, const int64_t *slots, float *out,
                             float *scratch, int T, int S, int H, int KV, int D, float scale,
                             int tile_tokens, int nthreads, void *sgemm, void *set_threads);

/* pc_decode (attention.c): one query per sequence, over shared keys then each one's own */
typedef void (*decode_fn)(const float *q, int64_t q_row_stride, const float *k_cache,
                          const float *v_cache, const int64_t *shared_slots, int shared,
                          const int64_t *tail_slots, const int *tail_lens, int max_tail,
                          float *out, float *scratch, int B, int H, int KV, int D, float scale,
                          int chunk, int nthreads, void *sgemm, void *set_threads);

/* pc_decode_kv16: the same over bfloat16 caches; products: bfloat16 products */
typedef void (*decode_kv16_fn)(const float *q, int64_t q_row_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int64_t *shared_slots, int shared,
                               const int64_t *tail_slots, const int *tail_lens, int max_tail,
                               float *out, float *scratch, int B, int H, int KV, int D,
                               float scale, int chunk, int nthreads, void *sgemm,
                               void *set_threads, int products);

/* pc_kv_write (attention.c's kv_quant.h): the step's K and V rows quantized into the caches */
typedef void (*kv_write_fn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                            int T, int KV, int D, int bf16_in, const int64_t *slots,
                            void *k_cache, void *v_cache, int fmt);

/* One layer of one step: prefixcache.model.fused_layers.LayerArgs mirrors this layout. */
struct layer_args {
    packed_gemm_fn gemm;
    float *h;            /* [rows, hidden], the residual stream, updated in place */
    const float *delta;  /* [rows, hidden], the previous layer's MLP output, or NULL */
    const float *norm_w, *post_norm_w;
    float eps;
    int rows, hidden, H, KV, D, I, chunk, nthreads;
    const void *w_qkv, *w_o, *w_gate_up, *w_down; /* packed */
    const float *qkv_bias;                        /* or NULL */
    const float *cos, *signed_sin;                /* [rows, D] */
    float *k_cache, *v_cache;                     /* [num_slots, KV, D] */
    const int64_t *slot_mapping;                  /* [rows] */
    float *x, *qkv, *o, *gate_up, *act, *out;     /* buffers; out: the MLP output */
    /* the attention, for pc_layer: pc_attention's address and its arguments */
    attention_fn attention;
    const int64_t *seq_slots;
    int S, tile_tokens;
    float scale;
    float *attn, *scratch;
    void *sgemm, *set_threads;
    /* or, for a step of decodes only, pc_decode's address (attention then NULL) and its own
     * arguments; in bfloat16 pc_decode_kv16's, with the queries widened into q32 and its
     * float32 output out32 rounded into attn */
    void *decode;
    const int64_t *shared_slots, *tail_slots;
    const int *tail_lens;
    int shared, max_tail, decode_chunk, products;
    float *q32, *out32;
    /* the step's rows under adapters and this layer's 4 tables of their updates (qkv, o,
     * gate_up, down: lora.h), or NULL */
    const struct lora_runs *lora_runs;
    const struct lora_table *lora;
    /* a quantized KV cache's writer (its layout kv_format) instead of the row copies, or NULL */
    kv_write_fn kv_write;
    int kv_format;
};

/* The K and V of qkv's rows (a bfloat16 model's where bf16) through the layer's kv_write */
static void write_kv_quantized(const struct layer_args *a, const void *qkv, int bf16) {
    const int64_t width = (int64_t)(a->H + 2 * a->KV) * a->D, size = bf16 ? 2 : 4;
    const char *k = (const char *)qkv + (int64_t)a->H * a->D * size;
    a->kv_write(k, width, k + (int64_t)a->KV * a->D * size, width, a->rows, a->KV, a->D, bf16,
                a->slot_mapping, a->k_cache, a->v_cache, a->kv_format);
}

/* The steps before the attention (pc_attention_inputs) */
void pc_layer_inputs(const struct layer_args *a) {
    pc_attention_inputs(a->gemm, a->h, a->delta, a->norm_w, a->eps, a->x, a->rows, a->hidden,
                        a->w_qkv, a->qkv_bias, a->qkv, a->H, a->KV, a->D, a->cos, a->signed_sin,
                        a->kv_write ? NULL : a->k_cache, a->v_cache, a->slot_mapping,
                        a->lora_runs, a->lora, a->nthreads);
    if (a->kv_write) write_kv_quantized(a, a->qkv, 0);
}

/* The steps after it (pc_mlp_block) on the attention output attended [rows, H * D] */
void pc_layer_outputs(const struct layer_args *a, const float *attended) {
    pc_mlp_block(a->gemm, attended, a->rows, a->H * a->D, a->w_o, a->h, a->hidden, a->post_norm_w,
                 a->eps, a->w_gate_up, a->I, a->w_down, a->o, a->x, a->gate_up, a->act, a->out,
                 a->chunk, a->lora_runs, a->lora, a->nthreads);
}

/* A whole layer, for a step that is one sequence's prefill through pc_attention or decodes
 * only through pc_decode (the queries: qkv's rows, read in place) */
void pc_layer(const struct layer_args *a) {
    const int64_t q_stride = (int64_t)(a->H + 2 * a->KV) * a->D;
    pc_layer_inputs(a);
    if (a->decode != NULL)
        ((decode_fn)a->decode)(a->qkv, q_stride, a->k_cache, a->v_cache, a->shared_slots, a->shared,
                  a->tail_slots, a->tail_lens, a->max_tail, a->attn, a->scratch, a->rows, a->H,
                  a->KV, a->D, a->scale, a->decode_chunk, a->nthreads, a->sgemm,
                  a->set_threads);
    else
        a->attention(a->qkv, q_stride, a->k_cache, a->v_cache, a->seq_slots, a->attn,
                     a->scratch, a->rows, a->S, a->H, a->KV, a->D, a->scale, a->tile_tokens,
                     a->nthreads, a->sgemm, a->set_threads);
    pc_layer_outputs(a, a->attn);
}

/* ---- The two calls in bfloat16 -----------------------------------------------------------
 *
 * The same steps on a bfloat16 model whose projections are packed for the panel GEMM: the
 * layer_args pointers then hold bfloat16 arrays (the weights pc_panel_pack_bf16's), `gemm` is
 * unused. Each step is the one the separate calls run (pc_add_rms_norm_bf16, pc_panel_gemm_bf16,
 * pc_rotary_bf16, pc_silu_mul_bf16), in the same order: the same bits. */

static void project_bf16(const bf16_t *x, int rows, int k, const void *w, int n,
                         const bf16_t *bias, bf16_t *out, int nthreads) {
    pc_panel_gemm_bf16(x, k, rows, k, (const bf16_t *)w, n, bias, out, n, nthreads);
}

void pc_layer_inputs_bf16(const struct layer_args *a) {
    const int rows = a->rows, H = a->H, KV = a->KV, D = a->D, width = (H + 2 * KV) * D;
    const size_t kv_bytes = (size_t)KV * D * sizeof(bf16_t);
    bf16_t *h = (bf16_t *)a->h, *x = (bf16_t *)a->x, *qkv = (bf16_t *)a->qkv;
    bf16_t *k_cache = (bf16_t *)a->k_cache, *v_cache = (bf16_t *)a->v_cache;
    pc_add_rms_norm_bf16(h, (const bf16_t *)a->delta, (const bf16_t *)a->norm_w, x, rows,
                         a->hidden, a->eps, a->nthreads);
    project_bf16(x, rows, a->hidden, a->w_qkv, width, (const bf16_t *)a->qkv_bias, qkv,
                 a->nthreads);
    if (a->lora != NULL)
        pc_lora_apply(a->lora_runs, &a->lora[0], x, a->hidden, a->hidden, qkv, width, 0, rows, 1,
                      a->nthreads);
    pc_rotary_bf16(qkv, width, rows, H + KV, D, (const bf16_t *)a->cos,
                   (const bf16_t *)a->signed_sin, a->nthreads);
    if (a->kv_write) {
        write_kv_quantized(a, qkv, 1);
        return;
    }
#pragma omp parallel for num_threads(a->nthreads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const bf16_t *k = qkv + (int64_t)r * width + (int64_t)H * D;
        memcpy(k_cache + a->slot_mapping[r] * KV * D, k, kv_bytes);
        memcpy(v_cache + a->slot_mapping[r] * KV * D, k + (int64_t)KV * D, kv_bytes);
    }
}

void pc_layer_outputs_bf16(const struct layer_args *a, const bf16_t *attended) {
    const int rows = a->rows, hidden = a->hidden, I = a->I, chunk = a->chunk;
    bf16_t *h = (bf16_t *)a->h, *x = (bf16_t *)a->x, *o = (bf16_t *)a->o;
    bf16_t *gate_up = (bf16_t *)a->gate_up, *act = (bf16_t *)a->act, *out = (bf16_t *)a->out;
    const struct lora_runs *runs = a->lora_runs;
    const struct lora_table *lora = a->lora;
    const int q_size = a->H * a->D;
    project_bf16(attended, rows, q_size, a->w_o, hidden, NULL, o, a->nthreads);
    if (lora != NULL)
        pc_lora_apply(runs, &lora[1], attended, q_size, q_size, o, hidden, 0, rows, 1, a->nthreads);
    pc_add_rms_norm_bf16(h, o, (const bf16_t *)a->post_norm_w, x, rows, hidden, a->eps,
                         a->nthreads);
    for (int r0 = 0; r0 < rows; r0 += chunk) {
        const int m = rows - r0 < chunk ? rows - r0 : chunk;
        const bf16_t *xr = x + (int64_t)r0 * hidden;
        bf16_t *out_r = out + (int64_t)r0 * hidden;
        project_bf16(xr, m, hidden, a->w_gate_up, 2 * I, NULL, gate_up, a->nthreads);
        if (lora != NULL)
            pc_lora_apply(runs, &lora[2], xr, hidden, hidden, gate_up, 2 * I, r0, m, 1,
                          a->nthreads);
        pc_silu_mul_bf16(gate_up, act, m, I, a->nthreads);
        project_bf16(act, m, I, a->w_down, hidden, NULL, out_r, a->nthreads);
        if (lora != NULL)
            pc_lora_apply(runs, &lora[3], act, I, I, out_r, hidden, r0, m, 1, a->nthreads);
    }
}

/* A whole bfloat16 layer for a step of decodes only through pc_decode_kv16: the queries widened
 * to float32 (exact) and the output rounded to bfloat16, as native_attention.PreparedDecode
 * does around the same kernel: the same bits as the two calls around paged_attention. */
void pc_layer_bf16(const struct layer_args *a) {
    const int rows = a->rows, n = a->H * a->D, width = (a->H + 2 * a->KV) * a->D;
    const bf16_t *qkv = (const bf16_t *)a->qkv;
    bf16_t *attn = (bf16_t *)a->attn;
    pc_layer_inputs_bf16(a);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++) a->q32[(int64_t)r * n + i] = widen(qkv[(int64_t)r * width + i]);
    ((decode_kv16_fn)a->decode)(a->q32, n, (const uint16_t *)a->k_cache,
                                (const uint16_t *)a->v_cache, a->shared_slots, a->shared,
                                a->tail_slots, a->tail_lens, a->max_tail, a->out32, a->scratch,
                                rows, a->H, a->KV, a->D, a->scale, a->decode_chunk,
                                a->nthreads, a->sgemm, a->set_threads, a->products);
    for (int64_t i = 0; i < (int64_t)rows * n; i++) attn[i] = narrow(a->out32[i]);
    pc_layer_outputs_bf16(a, attn);
}
