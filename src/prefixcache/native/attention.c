/* Paged attention on the CPU, float32: the prefill of one sequence over its paged K/V
 * (`pc_attention`), and decode steps of sequences sharing a prefix (`pc_decode`, at the end).
 *
 * Built by prefixcache.native for prefixcache.attention.native_attention (cc -O3 -march=native
 * -fopenmp) at first use and called through ctypes. Query token t of the T new ones sits at
 * position C + t, C = S - T, and sees keys 0 .. C + t, read through `slots` (the slot of each
 * position 0 .. S - 1 in the flattened cache [num_slots, KV, D]). This covers a prefill after a
 * cache hit (C > 0), a prefill chunk, and a fresh prefill (C = 0, causal).
 *
 * Work item = (kv head, tile of `tile_tokens` new tokens). Its G query heads are stacked into
 * one [G * m, D] block; the scores against the keys any row of the tile may see go into a
 * per-thread buffer sized to stay in L2, the softmax runs over each row's visible keys only (no
 * mask), and one GEMM with V gives the output rows, normalised there. The GEMMs are the Fortran
 * BLAS sgemm that the caller passes (MKL's, from libtorch), single-threaded inside the OpenMP
 * team.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "vector_math.h"
#include "kv_quant.h"

/* column-major C = alpha * op(A) * op(B) + beta * C (Fortran BLAS calling convention) */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
/* MKL_Set_Num_Threads_Local: threads MKL uses on the calling thread; returns the old value */
typedef int (*set_threads_fn)(int);

#define MAX_TILE_ROWS 4096 /* G * tile_tokens; checked by the caller */

/* e^x for x <= 0; below -87 it returns ~e^-87 (1.6e-38) instead of a subnormal */
static inline vfloat exp_nonpositive(vfloat x) { return exp_in_range(max_lanes(x, -87.0f)); }

/* row[0 .. visible) <- exp(scale * (row - max)), row[visible .. width) <- 0; returns 1 / sum,
 * the normalisation, which the caller applies to the D outputs instead of the `width` weights.
 * Two vectors per iteration, each with its own running sum: independent chains to overlap. */
static float softmax_row(float *row, int visible, int width, float scale) {
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int j = 0; j < visible; j++) max = row[j] > max ? row[j] : max;
    const float shift = -max * scale; /* scale * (x - max) as one multiply-add */
    vfloat sums0 = {0}, sums1 = {0};
    int j = 0;
    for (; j + 2 * LANES <= visible; j += 2 * LANES) {
        vfloat x0, x1;
        memcpy(&x0, row + j, sizeof x0);
        memcpy(&x1, row + j + LANES, sizeof x1);
        x0 = exp_nonpositive(fmadd(x0, vsplat(scale), vsplat(shift)));
        x1 = exp_nonpositive(fmadd(x1, vsplat(scale), vsplat(shift)));
        memcpy(row + j, &x0, sizeof x0);
        memcpy(row + j + LANES, &x1, sizeof x1);
        sums0 += x0;
        sums1 += x1;
    }
    for (; j < visible; j += LANES) { /* the last 1 .. 31: whole vectors, then a partial one */
        const int lanes = visible - j < LANES ? visible - j : LANES;
        vfloat x = {0};
        memcpy(&x, row + j, (size_t)lanes * sizeof(float));
        x = exp_nonpositive(fmadd(x, vsplat(scale), vsplat(shift)));
        for (int l = lanes; l < LANES; l++) x[l] = 0.0f;
        memcpy(row + j, &x, (size_t)lanes * sizeof(float));
        sums0 += x;
    }
    sums0 += sums1;
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += sums0[l];
    if (width > visible) memset(row + visible, 0, (size_t)(width - visible) * sizeof(float));
    return 1.0f / sum;
}

/* Inside a parallel region: K and V of positions 0 .. n - 1 (slots[]) gathered head-major,
 * k_heads[h] and v_heads[h] each [n, D] in position order; ends with the team's barrier. */
static void gather_heads(const void *k_cache, const void *v_cache, const int64_t *slots, int n,
                         int KV, int D, int bf16, float *k_heads, float *v_heads) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)KV * n; i++) {
        const int64_t h = i / n, j = i % n;
        const int64_t src = slots[j] * KV + h, dst = (h * n + j) * D;
        load_row(k_heads + dst, k_cache, src, D, bf16);
        load_row(v_heads + dst, v_cache, src, D, bf16);
    }
}

/* K and V of head h at positions 0 .. n - 1 (slots[]) into k_out, v_out, each [n, D]. */
static void gather_head(const void *k_cache, const void *v_cache, const int64_t *slots, int n,
                        int KV, int D, int bf16, int h, float *k_out, float *v_out) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t src = slots[j] * KV + h;
        load_row(k_out + j * D, k_cache, src, D, bf16);
        load_row(v_out + j * D, v_cache, src, D, bf16);
    }
}

/* Both kernels gather K/V either once for the team (a buffer per kv head) or, where every
 * thread gets whole kv heads, per thread (a buffer per thread): `local_heads` says which, and
 * the scratch holds `kv_copies` head-sized K and V buffers, enough for either. */
static inline int local_heads(int KV, int nthreads) { return KV % nthreads == 0; }
static inline int64_t kv_copies(int KV, int nthreads) { return KV > nthreads ? KV : nthreads; }

/* One work item's tile: new tokens t0 .. t0 + m - 1 of kv head h, whose G query heads are
 * h * G .. h * G + G - 1, against k_h, v_h ([C + t0 + m, D] at least, gathered). */
static void attend_tile(const float *q, int64_t q_row_stride, const float *k_h, const float *v_h,
                        float *out, int C, int t0, int m, int h, int H, int G, int D,
                        float scale, float *stacked_q, float *stacked_out, float *scores,
                        sgemm_fn sgemm) {
    int rows = G * m, keys = C + t0 + m; /* keys: all any row of the tile may see */
    for (int g = 0; g < G; g++)
        for (int t = 0; t < m; t++)
            memcpy(stacked_q + ((int64_t)g * m + t) * D,
                   q + (int64_t)(t0 + t) * q_row_stride + (int64_t)(h * G + g) * D,
                   D * sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    int ld = D;
    /* scores (row-major [rows, keys]) = stacked_q K_h^T; column-major that is
     * scores^T [keys, rows] = (K_h^T)^T stacked_q^T */
    sgemm("T", "N", &keys, &rows, &ld, &one, k_h, &ld, stacked_q, &ld, &zero, scores, &keys);
    float inv[MAX_TILE_ROWS];
    for (int r = 0; r < rows; r++)
        inv[r] = softmax_row(scores + (int64_t)r * keys, C + t0 + r % m + 1, keys, scale);
    /* stacked_out [rows, D] = P V_h; column-major out^T [D, rows] = V_h^T P^T */
    sgemm("N", "N", &ld, &rows, &keys, &one, v_h, &ld, scores, &keys, &zero, stacked_out, &ld);
    for (int g = 0; g < G; g++)
        for (int t = 0; t < m; t++) {
            float *dst = out + ((int64_t)(t0 + t) * H + h * G + g) * D;
            const float *src = stacked_out + ((int64_t)g * m + t) * D;
            const float f = inv[g * m + t];
            for (int d = 0; d < D; d++) dst[d] = src[d] * f;
        }
}

/* ---- Straight from the paged cache (head_dims 16, 32, 64, 80, 96, 128) -----------------------
 *
 * The paths above gather a head's K and V into a buffer that MKL then copies again into its
 * packed panels (after a cache hit the gather is paid for few queries). Here register-tiled
 * loops read the cache directly, one key row at a time through `slots`, in blocks of 32 keys
 * with an online softmax (a running max and sum per row; the output sums rescaled when a row's
 * max grows), the way FlashAttention does on GPUs.
 *
 * Scores are kept transposed, st [keys, ld] (row r = g * m + t: query head h * G + g, token
 * t0 + t; ld = rows rounded up to 16), so one vector holds 16 rows' scores for one key: QK^T is
 * a broadcast of K[j][d] times a vector of Q^T[d] (no transposed copy of K), the softmax runs
 * down the columns with no horizontal reductions, and P V broadcasts P^T[j][r] against the
 * D / 16 vectors of V row j. Q^T is stored as panels [D][48], one per register tile's rows, so
 * each tile streams through contiguous memory. The loops are written once, in direct_path.h,
 * and compiled for each head_dim (64: P V tiles of 6 rows x 4 vectors; 128: 3 x 8).
 *
 * Why blocks, and why all of a head's tiles (up to GROUP_TILES of them) inside each block: a
 * whole tile's scores (2,048 keys x 96 rows, 786 KB) did not fit in L2 next to the head's K
 * and V, and each tile fetched K and V from memory again. With one 32-key block at a time the
 * scores stay in L1 (12 KB), and the block's K and V rows, fetched once, serve every tile of
 * the head. K rows are prefetched one register tile ahead during QK, the next block's V rows
 * during PV. The block size, tile shape and exact max update were chosen by measurement on
 * head_dim 64 (docs/performance.md) and kept at 128. */
#ifdef __AVX512F__
#define QK_KEYS 8       /* keys per QK register tile ... */
#define QK_VECS 3       /* ... times row vectors: 24 accumulators of 32 zmm registers */
/* rows per PV register tile (PVR in direct_path.h): up to 24 accumulators, e.g. 6 rows x 4
 * vectors at head_dim 64, 3 x 8 at 128 */
#define PVR_FOR(hd) ((hd) == 16 ? 24 : (hd) == 32 ? 12 : (hd) == 64 ? 6 : (hd) <= 96 ? 4 : 3)
#else /* 8-lane vectors in 16 ymm registers: QK tiles of 8 accumulators, P V of one to 4 rows */
#define QK_KEYS 4
#define QK_VECS 2
#define PVR_FOR(hd) ((hd) == 16 ? 4 : (hd) == 32 ? 2 : 1)
#endif
#define PANEL (QK_VECS * LANES) /* Q^T panel width: the rows of one QK register tile */
#define KEY_BLOCK 32    /* keys per online-softmax block */
/* keys per segment: a row's keys are reduced segment by segment, from key 0, and the segments
 * merged in order (`merge_segment`), in a prefill and in a decode step alike; a decode step
 * spreads a long context's segments over the threads. A multiple of KEY_BLOCK, fixed: where a
 * row's sums restart must not depend on the step. */
#ifndef SEGMENT_KEYS
#define SEGMENT_KEYS 256
#endif
#define GROUP_TILES 4   /* tiles of one kv head that share each key block */
#define PREFETCH_KEYS 64 /* how far ahead a key block's rows are prefetched */
#define MAX_TILE_VECS (256 / LANES) /* rows per tile on this path: at most 256 */

/* The head_dims the direct path is compiled for (each a copy of direct_path.h's loops) */
static inline int direct_head_dim(int D) {
    return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128;
}

static inline int direct_applies(int D, int tile_rows) {
    return direct_head_dim(D) && tile_rows <= MAX_TILE_VECS * LANES;
}

#define HD 16
#define D_(name) name##_16
#define PVR PVR_FOR(16)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR
#define DIRECT_COMMON
#define HD 32
#define D_(name) name##_32
#define PVR PVR_FOR(32)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR
#define HD 64
#define D_(name) name##_64
#define PVR PVR_FOR(64)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR
#define HD 80
#define D_(name) name##_80
#define PVR PVR_FOR(80)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR
#define HD 96
#define D_(name) name##_96
#define PVR PVR_FOR(96)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR
#define HD 128
#define D_(name) name##_128
#define PVR PVR_FOR(128)
#include "direct_path.h"
#undef HD
#undef D_
#undef PVR

/* `call` of the copy of `name` for head_dim D (one of `direct_head_dim`'s) */
#define BY_HEAD_DIM(D, call, name, ...)                                                         \
    switch (D) {                                                                                \
    case 16: call(name##_16(__VA_ARGS__)); break;                                               \
    case 32: call(name##_32(__VA_ARGS__)); break;                                               \
    case 64: call(name##_64(__VA_ARGS__)); break;                                               \
    case 80: call(name##_80(__VA_ARGS__)); break;                                               \
    case 96: call(name##_96(__VA_ARGS__)); break;                                               \
    default: call(name##_128(__VA_ARGS__)); break;                                              \
    }
#define RETURN(x) return x
#define DO(x) x

/* Floats of per-thread scratch the direct path needs for tiles of tile_rows rows. */
static int64_t direct_floats(int D, int tile_rows) {
    BY_HEAD_DIM(D, RETURN, direct_floats, tile_rows)
}

/* New tokens g0 .. g1 - 1 of kv head h (`direct_tiles_64`, ...) */
static void direct_tiles(int D, const float *q, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, int bf16, const int64_t *slots, float *out, int C,
                         int T, int g0_begin, int g1, int group, int tile_tokens, int h, int H,
                         int KV, int G, float scale, float *buf) {
    BY_HEAD_DIM(D, DO, direct_tiles, q, q_row_stride, k_cache, v_cache, bf16, slots, out, C, T,
                g0_begin, g1, group, tile_tokens, h, H, KV, G, scale, buf)
}

/* Segment s of a decode work item's keys into part p (`decode_segment_64`, ...) */
static void direct_decode_segment(int D, const float *q, int64_t q_row_stride,
                                  const void *k_cache, const void *v_cache, int bf16,
                                  const int64_t *shared_slots, int shared,
                                  const int64_t *tail_slots, const int *tail_lens, int max_tail,
                                  int b0, int nb, int h, int KV, int G, float scale, int s,
                                  float *buf, int64_t *rest, struct decode_part p) {
    BY_HEAD_DIM(D, DO, decode_segment, q, q_row_stride, k_cache, v_cache, bf16, shared_slots,
                shared, tail_slots, tail_lens, max_tail, b0, nb, h, KV, G, scale, s, buf, rest, p)
}

/* Tiles per work item of the direct path: the most (up to GROUP_TILES, which share each key
 * block's K/V rows) for which kv heads x items per head spread evenly over the threads. E.g.
 * 3 kv heads of 4 tiles on 2 threads: items of 2 tiles (6 items, 3 per thread) rather than
 * whole heads (2 heads on one thread, 1 on the other). */
static int direct_group(int KV, int num_tiles, int nthreads) {
    int best = 1;
    int64_t best_cost = -1;
    for (int group = 1; group <= GROUP_TILES && group <= num_tiles; group++) {
        const int64_t items = (int64_t)KV * ((num_tiles + group - 1) / group);
        const int64_t cost = (items + nthreads - 1) / nthreads * group; /* tiles on the busiest */
        if (best_cost < 0 || cost <= best_cost) best = group, best_cost = cost;
    }
    return best;
}

/* Floats of scratch one thread of `pc_attention` works in: the stacked queries, outputs and
 * scores of one tile, or what the direct path needs, whichever is more. */
static int64_t per_thread_floats(int S, int G, int D, int tile_tokens) {
    const int64_t rows = (int64_t)G * tile_tokens, tiles = rows * (2 * (int64_t)D + S);
    const int64_t direct = direct_applies(D, (int)rows) ? direct_floats(D, (int)rows) : 0;
    return tiles > direct ? tiles : direct;
}

/* Floats of scratch `pc_attention` needs: K and V per kv head (or per thread, whichever is
 * more), then per_thread_floats for each thread. */
int64_t pc_scratch_floats(int S, int H, int KV, int D, int tile_tokens, int nthreads) {
    return 2 * kv_copies(KV, nthreads) * S * D +
           (int64_t)nthreads * per_thread_floats(S, H / KV, D, tile_tokens);
}

/* The prefill kernel; `bf16`: the caches hold bfloat16 (else float32).
 *
 * Where `direct_applies` (a head_dim of `direct_head_dim`, at most 256 stacked rows per tile),
 * with or without cached context: work item = a run of one kv head's tiles (`direct_group`),
 * reading the cache directly: no gather and no second copy into MKL's panels (figures:
 * docs/performance.md). Otherwise two ways to split the work. In general the team gathers
 * every head's K and V once, then work item = (kv head, tile): many items of varying size (the
 * causal triangle) for dynamic scheduling. After a cache hit (C >= T) with whole heads per thread (KV a multiple of the
 * thread count), work item = kv head instead, and the thread gathers that head's keys into its
 * own buffer, which its few tiles then read from L2 rather than from wherever a shared gather
 * left them (8% less time at 128 new tokens over 2,048 keys). With fewer heads than that (MQA),
 * splitting a head's tiles between threads balanced worse than the shared gather (10-15% slower
 * at 2,048 over 4,096 keys), so those keep the shared one. */
static void attention(const float *q, int64_t q_row_stride, const void *k_cache,
                      const void *v_cache, int bf16, const int64_t *slots, float *out,
                      float *scratch, int T, int S, int H, int KV, int D, float scale,
                      int tile_tokens, int nthreads, sgemm_fn sgemm, set_threads_fn set_threads) {
    const int G = H / KV, C = S - T;
    const int num_tiles = (T + tile_tokens - 1) / tile_tokens;
    const int64_t head_floats = (int64_t)S * D, tile_rows = (int64_t)G * tile_tokens;
    float *kv_buffers = scratch;
    float *per_thread = scratch + 2 * kv_copies(KV, nthreads) * head_floats;
    const int local = C >= T && local_heads(KV, nthreads);
    const int direct = direct_applies(D, (int)tile_rows);
    const int group = direct ? direct_group(KV, num_tiles, nthreads) : 1;
    const int groups_per_head = (num_tiles + group - 1) / group;

#pragma omp parallel num_threads(nthreads)
    {
        const int previous = set_threads(1); /* MKL stays single-threaded inside the team */
        const int thread = omp_get_thread_num();
        float *stacked_q = per_thread + thread * per_thread_floats(S, G, D, tile_tokens);
        float *stacked_out = stacked_q + tile_rows * D;
        float *scores = stacked_out + tile_rows * D;
        if (direct) {
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < KV * groups_per_head; item++) {
                const int h = item / groups_per_head, span = group * tile_tokens;
                const int g0 = item % groups_per_head * span;
                direct_tiles(D, q, q_row_stride, k_cache, v_cache, bf16, slots, out, C, T, g0,
                             T - g0 < span ? T : g0 + span, group, tile_tokens, h, H, KV, G,
                             scale, stacked_q);
            }
        } else if (local) {
            float *k_h = kv_buffers + 2 * thread * head_floats, *v_h = k_h + head_floats;
#pragma omp for schedule(dynamic, 1)
            for (int h = 0; h < KV; h++) {
                gather_head(k_cache, v_cache, slots, S, KV, D, bf16, h, k_h, v_h);
                for (int tile = 0; tile < num_tiles; tile++) {
                    const int t0 = tile * tile_tokens;
                    const int m = T - t0 < tile_tokens ? T - t0 : tile_tokens;
                    attend_tile(q, q_row_stride, k_h, v_h, out, C, t0, m, h, H, G, D, scale,
                                stacked_q, stacked_out, scores, sgemm);
                }
            }
        } else {
            float *k_heads = kv_buffers, *v_heads = kv_buffers + KV * head_floats;
            gather_heads(k_cache, v_cache, slots, S, KV, D, bf16, k_heads, v_heads);
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < KV * num_tiles; item++) {
                const int h = item / num_tiles, t0 = (item % num_tiles) * tile_tokens;
                const int m = T - t0 < tile_tokens ? T - t0 : tile_tokens;
                attend_tile(q, q_row_stride, k_heads + h * head_floats, v_heads + h * head_floats,
                            out, C, t0, m, h, H, G, D, scale, stacked_q, stacked_out, scores,
                            sgemm);
            }
        }
        set_threads(previous);
    }
}

/* q: [T, H, D] with rows q_row_stride floats apart (heads and D contiguous); k_cache, v_cache:
 * [num_slots, KV, D] float32; slots: [S]; out: [T, H, D] contiguous; scratch:
 * pc_scratch_floats. The queries, scores and outputs are float32 in both entry points. */
void pc_attention(const float *q, int64_t q_row_stride, const float *k_cache,
                  const float *v_cache, const int64_t *slots, float *out, float *scratch, int T,
                  int S, int H, int KV, int D, float scale, int tile_tokens, int nthreads,
                  sgemm_fn sgemm, set_threads_fn set_threads) {
    attention(q, q_row_stride, k_cache, v_cache, 0, slots, out, scratch, T, S, H, KV, D, scale,
              tile_tokens, nthreads, sgemm, set_threads);
}

/* pc_attention over bfloat16 caches: K and V widened to float32 as they are gathered, or with
 * `products` (a bfloat16 model's queries, passed widened) the direct path multiplies bfloat16
 * pairs where the CPU has AVX512_BF16 */
void pc_attention_kv16(const float *q, int64_t q_row_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *slots, float *out,
                       float *scratch, int T, int S, int H, int KV, int D, float scale,
                       int tile_tokens, int nthreads, sgemm_fn sgemm,
                       set_threads_fn set_threads, int products) {
    attention(q, q_row_stride, k_cache, v_cache, products ? KV_BF16_PRODUCTS : KV_BF16, slots,
              out, scratch, T, S, H, KV, D, scale, tile_tokens, nthreads, sgemm, set_threads);
}

/* Queries [rows, H, D] (rows `stride` floats apart) as a rotated layout's kernels take them:
 * each head's row rotated (`hadamard`) into qrot [rows, H, D]; else q itself */
static const float *layout_queries(const float *q, int64_t *stride, int rows, int H, int D,
                                   int fmt, float *qrot) {
    if (!kv_rotated(fmt)) return q;
    for (int64_t t = 0; t < rows; t++)
        memcpy(qrot + t * H * D, q + t * *stride, (size_t)H * D * sizeof(float));
    hadamard_rows(qrot, (int64_t)rows * H, D, D);
    *stride = (int64_t)H * D;
    return qrot;
}

/* pc_attention over quantized caches (`kv_quant.h`: fmt KV_Q8, KV_Q4, KV_FP8_*): each key
 * block's K and V rows dequantized as they are read, in the direct path into the block's
 * L1-sized buffer (as bfloat16 rows are widened), in the gather path into the gathered heads.
 * A rotated layout's queries are rotated into qrot ([T, H, D] floats) first and the outputs
 * rotated back after. */
void pc_attention_quant(const float *q, int64_t q_row_stride, const void *k_cache,
                        const void *v_cache, const int64_t *slots, float *out, float *scratch,
                        int T, int S, int H, int KV, int D, float scale, int tile_tokens,
                        int nthreads, sgemm_fn sgemm, set_threads_fn set_threads, int fmt,
                        float *qrot) {
    q = layout_queries(q, &q_row_stride, T, H, D, fmt, qrot);
    attention(q, q_row_stride, k_cache, v_cache, fmt, slots, out, scratch, T, S, H, KV, D, scale,
              tile_tokens, nthreads, sgemm, set_threads);
    if (kv_rotated(fmt)) hadamard_rows(out, (int64_t)T * H, D, D);
}

/* Bytes of one cache row of D values in layout fmt */
int64_t pc_kv_row_bytes(int D, int fmt) { return kv_row_bytes(D, fmt); }

/* Rows [n, D] (contiguous) rotated by the normalised Hadamard transform, in place: what the
 * kernels do to a rotated layout's queries and outputs, for tests and the torch paths */
void pc_hadamard_rows(float *x, int64_t n, int D) { hadamard_rows(x, n, D, D); }

/* D values of cache row `row` in layout fmt as floats (`load_row`), for tests */
void pc_kv_read(float *dst, const void *cache, int64_t row, int D, int fmt) {
    load_row(dst, cache, row, D, fmt);
}

/* The vector code of this build: bit 0 AVX-512F (else vectors of 8 lanes), bit 1 the bfloat16
 * products of AVX512_BF16 */
int pc_attention_isa(void) {
    int isa = 0;
#ifdef __AVX512F__
    isa |= 1;
#endif
#if DOT16
    isa |= 2;
#endif
    return isa;
}

/* Which split the prefill kernel uses for these sizes: 0 the shared gather, 1 a gather per kv
 * head, 2 per kv head straight from the cache (float32 caches only). */
int pc_attention_path(int T, int S, int H, int KV, int D, int tile_tokens, int nthreads,
                      int bf16) {
    (void)bf16; /* both cache dtypes take the same splits */
    if (direct_applies(D, (H / KV) * tile_tokens)) return 2;
    return S - T >= T && local_heads(KV, nthreads);
}

/* Floats of scratch `pc_decode` needs: on the direct path each thread's tiles and slot list,
 * then the work items' results per segment (`decode_part`s); otherwise shared K and V per kv
 * head (or per thread, whichever is more), then per thread the stacked queries and outputs of
 * one chunk, its scores, and one tail's K and V. */
static inline int decode_direct(int G, int D, int chunk) { return direct_applies(D, G * chunk); }

static int64_t decode_thread_floats(int shared, int max_tail, int G, int D, int chunk) {
    const int64_t rows = (int64_t)G * chunk;
    if (decode_direct(G, D, chunk)) /* its tiles, and one sequence's slots in a segment */
        return direct_floats(D, (int)rows) + 2 * (int64_t)SEGMENT_KEYS;
    return rows * (2 * (int64_t)D + shared + max_tail) + 2 * (int64_t)max_tail * D;
}

static int64_t decode_part_floats(int G, int D, int chunk) {
    return (int64_t)G * chunk * (D + 2);
}

/* Segments of the longest sequence: shared keys, then up to max_tail of its own */
static int decode_segments(int shared, int max_tail) {
    return (shared + max_tail + SEGMENT_KEYS - 1) / SEGMENT_KEYS;
}

/* Whether `pc_decode` takes the direct path for these sizes */
int pc_decode_direct(int H, int KV, int D, int chunk) { return decode_direct(H / KV, D, chunk); }

int64_t pc_decode_scratch_floats(int shared, int max_tail, int B, int H, int KV, int D,
                                 int chunk, int nthreads) {
    const int G = H / KV;
    const int64_t threads = (int64_t)nthreads * decode_thread_floats(shared, max_tail, G, D, chunk);
    if (decode_direct(G, D, chunk)) {
        const int64_t items = (int64_t)KV * ((B + chunk - 1) / chunk);
        return threads + items * decode_segments(shared, max_tail) *
                             decode_part_floats(G, D, chunk);
    }
    return 2 * kv_copies(KV, nthreads) * (int64_t)shared * D + threads;
}

/* Part `index` of the parts area: o [rows, D], then max and sum [rows] */
static struct decode_part part_at(float *parts, int64_t index, int G, int D, int chunk) {
    const int64_t rows = (int64_t)G * chunk;
    float *o = parts + index * decode_part_floats(G, D, chunk);
    const struct decode_part p = {o, o + rows * D, o + rows * D + rows};
    return p;
}

/* One work item's rows from its segments' parts, merged in key order as a prefill tile merges
 * them (`merge_segment`, then `normalised`), into out [B, H, D]; row r = g * nb + b. */
static void merge_segments(float *parts, int64_t first, int segments, int nb, int h, int H,
                           int G, int D, int chunk, int b0, float scale, float *out) {
    for (int r = 0; r < G * nb; r++) {
        float *dst = out + ((int64_t)(b0 + r % nb) * H + h * G + r / nb) * D;
        float max = -INFINITY, sum = 0.0f;
        for (int s = 0; s < segments; s++) {
            const struct decode_part p = part_at(parts, first + s, G, D, chunk);
            if (p.max[r] == -INFINITY) break; /* the row's keys ended in the segment before */
            merge_segment(dst, &max, &sum, p.o + (int64_t)r * D, p.max[r], p.sum[r], D, scale);
        }
        normalised(dst, dst, sum, D);
    }
}

/* The direct path's decode, inside the team: every (kv head h, chunk c) item's keys in
 * segments (`decode_segment`), one unit each, spread over the threads; after the team's barrier
 * each item's segments are merged. The segments are a prefill's, so are the sums. */
static void direct_decode(const float *q, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, int bf16, const int64_t *shared_slots, int shared,
                          const int64_t *tail_slots, const int *tail_lens, int max_tail,
                          float *out, int B, int H, int KV, int D, float scale, int chunk,
                          float *tile, int64_t *rest, float *parts) {
    const int G = H / KV, num_chunks = (B + chunk - 1) / chunk, items = KV * num_chunks;
    const int segments = decode_segments(shared, max_tail);
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < items * segments; unit++) {
        const int item = unit / segments, s = unit % segments;
        const int h = item / num_chunks, b0 = (item % num_chunks) * chunk;
        const struct decode_part p = part_at(parts, (int64_t)unit, G, D, chunk);
        direct_decode_segment(D, q, q_row_stride, k_cache, v_cache, bf16, shared_slots, shared,
                              tail_slots, tail_lens, max_tail, b0,
                              B - b0 < chunk ? B - b0 : chunk, h, KV, G, scale, s, tile, rest, p);
    }
#pragma omp for schedule(static)
    for (int item = 0; item < items; item++) {
        const int b0 = (item % num_chunks) * chunk;
        merge_segments(parts, (int64_t)item * segments, segments,
                       B - b0 < chunk ? B - b0 : chunk, item / num_chunks, H, G, D, chunk, b0,
                       scale, out);
    }
}

/* One work item of `pc_decode`: sequences b0 .. b0 + nb - 1, kv head h, whose shared keys are
 * k_h, v_h ([shared, D], gathered); per-thread buffers as pc_decode_scratch_floats lays out. */
static void decode_item(const float *q, int64_t q_row_stride, const void *k_cache,
                        const void *v_cache, int bf16, const float *k_h, const float *v_h,
                        int shared,
                        const int64_t *tail_slots, const int *tail_lens, int max_tail,
                        float *out, int b0, int nb, int h, int H, int KV, int G, int D,
                        float scale, float *stacked_q, float *stacked_out, float *scores,
                        float *k_tail, float *v_tail, sgemm_fn sgemm) {
    const int width = shared + max_tail; /* scores row stride */
    int rows = G * nb, ld = D, ldw = width, g_rows = G, n_shared = shared;
    const float one = 1.0f, zero = 0.0f;
    for (int b = 0; b < nb; b++) /* row b * G + g: sequence b0 + b, head h * G + g */
        memcpy(stacked_q + (int64_t)b * G * D, q + (int64_t)(b0 + b) * q_row_stride +
               (int64_t)h * G * D, (size_t)G * D * sizeof(float));
    if (shared > 0)
        sgemm("T", "N", &n_shared, &rows, &ld, &one, k_h, &ld, stacked_q, &ld, &zero, scores,
              &ldw);
    float inv[MAX_TILE_ROWS];
    for (int b = 0; b < nb; b++) {
        int len = tail_lens[b0 + b];
        const int64_t *slots = tail_slots + (int64_t)(b0 + b) * max_tail;
        for (int j = 0; j < len; j++) {
            const int64_t src = slots[j] * KV + h;
            load_row(k_tail + (int64_t)j * D, k_cache, src, D, bf16);
        }
        float *row0 = scores + (int64_t)b * G * width;
        sgemm("T", "N", &len, &g_rows, &ld, &one, k_tail, &ld, stacked_q + (int64_t)b * G * D,
              &ld, &zero, row0 + shared, &ldw);
        for (int g = 0; g < G; g++)
            inv[b * G + g] = softmax_row(row0 + (int64_t)g * width, shared + len, width, scale);
    }
    if (shared > 0)
        sgemm("N", "N", &ld, &rows, &n_shared, &one, v_h, &ld, scores, &ldw, &zero, stacked_out,
              &ld);
    else
        memset(stacked_out, 0, (size_t)rows * D * sizeof(float));
    for (int b = 0; b < nb; b++) {
        int len = tail_lens[b0 + b];
        const int64_t *slots = tail_slots + (int64_t)(b0 + b) * max_tail;
        for (int j = 0; j < len; j++) {
            const int64_t src = slots[j] * KV + h;
            load_row(v_tail + (int64_t)j * D, v_cache, src, D, bf16);
        }
        sgemm("N", "N", &ld, &g_rows, &len, &one, v_tail, &ld,
              scores + (int64_t)b * G * width + shared, &ldw, &one,
              stacked_out + (int64_t)b * G * D, &ld);
        for (int g = 0; g < G; g++) {
            float *dst = out + ((int64_t)(b0 + b) * H + h * G + g) * D;
            const float *src = stacked_out + ((int64_t)b * G + g) * D;
            const float f = inv[b * G + g];
            for (int d = 0; d < D; d++) dst[d] = src[d] * f;
        }
    }
}

/* Decode attention: B sequences with one query token each, all starting with the same `shared`
 * keys (shared_slots; 0 for none), then each its own tail_lens[b] >= 1 keys (tail_slots[b *
 * max_tail ..]). q: [B, H, D] with rows q_row_stride floats apart; out: [B, H, D] contiguous.
 * Work item = (kv head, chunk of `chunk` sequences): their G query heads stacked, one GEMM over
 * the shared keys for all of them, small GEMMs per tail, one softmax per row over both parts.
 * Where `direct_applies` (`direct_head_dim`) the shared keys and the tails are read
 * straight from the cache by the direct path's key-block loops (`direct_decode`: no gather, and
 * the register tiles run near the GEMM's rate), one unit per segment of each item's keys,
 * merged after in key order, as a prefill merges them: a row's result is the same bits in any
 * step. Otherwise, as in pc_attention, where each thread gets whole kv heads, the thread
 * gathers the shared keys of the head it works on into its own buffer (read from L2 by that
 * head's chunks), or the team gathers every head's once. */
static void decode(const float *q, int64_t q_row_stride, const void *k_cache,
                   const void *v_cache, int bf16, const int64_t *shared_slots, int shared,
                   const int64_t *tail_slots, const int *tail_lens, int max_tail, float *out,
                   float *scratch, int B, int H, int KV, int D, float scale, int chunk,
                   int nthreads, sgemm_fn sgemm, set_threads_fn set_threads) {
    const int G = H / KV, num_chunks = (B + chunk - 1) / chunk;
    const int64_t head_floats = (int64_t)shared * D, chunk_rows = (int64_t)G * chunk;
    const int width = shared + max_tail;
    const int direct = decode_direct(G, D, chunk);
    float *kv_buffers = scratch;
    float *per_thread = scratch + (direct ? 0 : 2 * kv_copies(KV, nthreads) * head_floats);
    const int64_t thread_floats = decode_thread_floats(shared, max_tail, G, D, chunk);
    const int local = shared > 0 && local_heads(KV, nthreads);

#pragma omp parallel num_threads(nthreads)
    {
        const int previous = set_threads(1);
        const int thread = omp_get_thread_num();
        float *stacked_q = per_thread + thread * thread_floats;
        float *stacked_out = stacked_q + chunk_rows * D;
        float *scores = stacked_out + chunk_rows * D;
        float *k_tail = scores + chunk_rows * width, *v_tail = k_tail + (int64_t)max_tail * D;
        if (direct) {
            float *tile = per_thread + thread * thread_floats;
            direct_decode(q, q_row_stride, k_cache, v_cache, bf16, shared_slots, shared,
                          tail_slots, tail_lens, max_tail, out, B, H, KV, D, scale, chunk, tile,
                          (int64_t *)(tile + direct_floats(D, (int)chunk_rows)),
                          per_thread + nthreads * thread_floats);
        } else if (local) {
            float *k_h = kv_buffers + 2 * thread * head_floats, *v_h = k_h + head_floats;
#pragma omp for schedule(dynamic, 1)
            for (int h = 0; h < KV; h++) {
                gather_head(k_cache, v_cache, shared_slots, shared, KV, D, bf16, h, k_h, v_h);
                for (int b0 = 0; b0 < B; b0 += chunk)
                    decode_item(q, q_row_stride, k_cache, v_cache, bf16, k_h, v_h, shared, tail_slots,
                                tail_lens, max_tail, out, b0, B - b0 < chunk ? B - b0 : chunk,
                                h, H, KV, G, D, scale, stacked_q, stacked_out, scores, k_tail,
                                v_tail, sgemm);
            }
        } else {
            float *k_shared = kv_buffers, *v_shared = kv_buffers + KV * head_floats;
            gather_heads(k_cache, v_cache, shared_slots, shared, KV, D, bf16, k_shared, v_shared);
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < KV * num_chunks; item++) {
                const int h = item / num_chunks, b0 = (item % num_chunks) * chunk;
                decode_item(q, q_row_stride, k_cache, v_cache, bf16, k_shared + h * head_floats,
                            v_shared + h * head_floats, shared, tail_slots, tail_lens, max_tail,
                            out, b0, B - b0 < chunk ? B - b0 : chunk, h, H, KV, G, D, scale,
                            stacked_q, stacked_out, scores, k_tail, v_tail, sgemm);
            }
        }
        set_threads(previous);
    }
}

void pc_decode(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
               const int64_t *shared_slots, int shared, const int64_t *tail_slots,
               const int *tail_lens, int max_tail, float *out, float *scratch, int B, int H,
               int KV, int D, float scale, int chunk, int nthreads, sgemm_fn sgemm,
               set_threads_fn set_threads) {
    decode(q, q_row_stride, k_cache, v_cache, 0, shared_slots, shared, tail_slots, tail_lens,
           max_tail, out, scratch, B, H, KV, D, scale, chunk, nthreads, sgemm, set_threads);
}

/* pc_decode over bfloat16 caches (queries and outputs float32; `products` as for
 * pc_attention_kv16) */
void pc_decode_kv16(const float *q, int64_t q_row_stride, const uint16_t *k_cache,
                    const uint16_t *v_cache, const int64_t *shared_slots, int shared,
                    const int64_t *tail_slots, const int *tail_lens, int max_tail, float *out,
                    float *scratch, int B, int H, int KV, int D, float scale, int chunk,
                    int nthreads, sgemm_fn sgemm, set_threads_fn set_threads, int products) {
    decode(q, q_row_stride, k_cache, v_cache, products ? KV_BF16_PRODUCTS : KV_BF16,
           shared_slots, shared, tail_slots, tail_lens, max_tail, out, scratch, B, H, KV, D,
           scale, chunk, nthreads, sgemm, set_threads);
}

/* pc_decode over quantized caches (fmt and qrot as for pc_attention_quant) */
void pc_decode_quant(const float *q, int64_t q_row_stride, const void *k_cache,
                     const void *v_cache, const int64_t *shared_slots, int shared,
                     const int64_t *tail_slots, const int *tail_lens, int max_tail, float *out,
                     float *scratch, int B, int H, int KV, int D, float scale, int chunk,
                     int nthreads, sgemm_fn sgemm, set_threads_fn set_threads, int fmt,
                     float *qrot) {
    q = layout_queries(q, &q_row_stride, B, H, D, fmt, qrot);
    decode(q, q_row_stride, k_cache, v_cache, fmt, shared_slots, shared, tail_slots, tail_lens,
           max_tail, out, scratch, B, H, KV, D, scale, chunk, nthreads, sgemm, set_threads);
    if (kv_rotated(fmt)) hadamard_rows(out, (int64_t)B * H, D, D);
}
