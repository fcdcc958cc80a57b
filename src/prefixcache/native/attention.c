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
        x0 = exp_nonpositive(x0 * scale + shift);
        x1 = exp_nonpositive(x1 * scale + shift);
        memcpy(row + j, &x0, sizeof x0);
        memcpy(row + j + LANES, &x1, sizeof x1);
        sums0 += x0;
        sums1 += x1;
    }
    for (; j < visible; j += LANES) { /* the last 1 .. 31: whole vectors, then a partial one */
        const int lanes = visible - j < LANES ? visible - j : LANES;
        vfloat x = {0};
        memcpy(&x, row + j, (size_t)lanes * sizeof(float));
        x = exp_nonpositive(x * scale + shift);
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

/* What the caches hold and how the direct path multiplies them (the `bf16` arguments) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_BF16_PRODUCTS = 2 };

/* D values of a cache row as floats: copied, or widened from bfloat16 (a bfloat16's bits are
 * the high half of the float it stands for, so widening is exact; GCC vectorises the loop) */
static inline void load_row(float *dst, const void *cache, int64_t index, int D, int bf16) {
    if (!bf16) {
        memcpy(dst, (const float *)cache + index, (size_t)D * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)cache + index;
    uint32_t *bits = (uint32_t *)dst;
    for (int d = 0; d < D; d++) bits[d] = (uint32_t)src[d] << 16;
}

/* Inside a parallel region: K and V of positions 0 .. n - 1 (slots[]) gathered head-major,
 * k_heads[h] and v_heads[h] each [n, D] in position order; ends with the team's barrier. */
static void gather_heads(const void *k_cache, const void *v_cache, const int64_t *slots, int n,
                         int KV, int D, int bf16, float *k_heads, float *v_heads) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)KV * n; i++) {
        const int64_t h = i / n, j = i % n;
        const int64_t src = (slots[j] * KV + h) * D, dst = (h * n + j) * D;
        load_row(k_heads + dst, k_cache, src, D, bf16);
        load_row(v_heads + dst, v_cache, src, D, bf16);
    }
}

/* K and V of head h at positions 0 .. n - 1 (slots[]) into k_out, v_out, each [n, D]. */
static void gather_head(const void *k_cache, const void *v_cache, const int64_t *slots, int n,
                        int KV, int D, int bf16, int h, float *k_out, float *v_out) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t src = (slots[j] * KV + h) * D;
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

/* ---- Straight from the paged cache (AVX-512, head_dim 64) ------------------------------------
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
 * down the columns with no horizontal reductions, and P V broadcasts P^T[j][r] against the four
 * vectors of V row j. Q^T is stored as panels [D][48], one per register tile's rows, so each
 * tile streams through contiguous memory.
 *
 * Why blocks, and why all of a head's tiles (up to GROUP_TILES of them) inside each block: a
 * whole tile's scores (2,048 keys x 96 rows, 786 KB) did not fit in L2 next to the head's K
 * and V, and each tile fetched K and V from memory again. With one 32-key block at a time the
 * scores stay in L1 (12 KB), and the block's K and V rows, fetched once, serve every tile of
 * the head. K rows are prefetched one register tile ahead during QK, the next block's V rows
 * during PV. The block size, tile shape and exact max update were chosen by measurement on
 * head_dim 64 (docs/performance.md); at head_dim 128 the gather + MKL path is faster, so this
 * path is limited to 64. */
#ifdef __AVX512F__
#define DIRECT_HEAD_DIM 64
#define QK_KEYS 8       /* keys per QK register tile ... */
#define QK_VECS 3       /* ... times row vectors: 24 accumulators */
#define PANEL (QK_VECS * LANES) /* Q^T panel width: the rows of one QK register tile */
#define PV_ROWS 6       /* rows per PV register tile, times head_dim / 16 = 4 vectors: 24 */
#define KEY_BLOCK 32    /* keys per online-softmax block */
#define GROUP_TILES 4   /* tiles of one kv head that share each key block */
#define MAX_TILE_VECS 16 /* rows per tile on this path: at most 16 vectors (256 rows) */

static inline int direct_applies(int D, int tile_rows) {
    return D == DIRECT_HEAD_DIM && tile_rows <= MAX_TILE_VECS * LANES;
}

static inline int64_t panel_floats(int rows) {
    return (int64_t)(rows + PANEL - 1) / PANEL * PANEL * DIRECT_HEAD_DIM;
}

/* Floats of per-thread scratch `direct_head` needs for tiles of tile_rows rows. */
static int64_t direct_floats(int tile_rows) {
    const int64_t ld = (tile_rows + LANES - 1) / LANES * LANES;
    return KEY_BLOCK * ld + GROUP_TILES * (panel_floats(tile_rows) + ld * DIRECT_HEAD_DIM) +
           2 * KEY_BLOCK * DIRECT_HEAD_DIM /* a bfloat16 cache's key block, widened */
           + KEY_BLOCK / 2 * (ld + DIRECT_HEAD_DIM); /* or its probabilities and V, paired */
}

static inline vfloat load_vec(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void store_vec(float *p, vfloat v) { memcpy(p, &v, sizeof v); }
static inline vfloat splat(float x) { return (vfloat)_mm512_set1_ps(x); }
static inline void prefetch_row(const float *row) {
    for (int c = 0; c < DIRECT_HEAD_DIM * (int)sizeof(float); c += 64)
        _mm_prefetch((const char *)row + c, _MM_HINT_T0);
}

/* st[i][0 .. 16 nv) = sum_d k_rows[i][d] * qt[d][0 .. 16 nv), i < nk; nk and nv constants
 * after inlining, so the accumulators live in registers */
static inline __attribute__((always_inline)) void qk_tile(const float *const *k_rows,
                                                          const float *qt, int ldq, float *st,
                                                          int lds, int nk, int nv) {
    vfloat acc[QK_KEYS][QK_VECS];
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = (vfloat){0};
    for (int d = 0; d < DIRECT_HEAD_DIM; d++) {
        vfloat b[QK_VECS];
        for (int v = 0; v < nv; v++) b[v] = load_vec(qt + (int64_t)d * ldq + v * LANES);
        for (int i = 0; i < nk; i++) {
            const vfloat a = splat(k_rows[i][d]);
            for (int v = 0; v < nv; v++) acc[i][v] += a * b[v];
        }
    }
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) store_vec(st + (int64_t)i * lds + v * LANES, acc[i][v]);
}

/* scores of nk keys (QK_KEYS or 1) against all nvec row vectors; qt in panels */
static void qk_keys(const float *const *k_rows, const float *qt, int ld, float *st, int nk,
                    int nvec) {
    int v = 0;
    for (; v + QK_VECS <= nvec; v += QK_VECS) {
        const float *panel = qt + (int64_t)(v / QK_VECS) * DIRECT_HEAD_DIM * PANEL;
        if (nk == QK_KEYS) qk_tile(k_rows, panel, PANEL, st + v * LANES, ld, QK_KEYS, QK_VECS);
        else qk_tile(k_rows, panel, PANEL, st + v * LANES, ld, 1, QK_VECS);
    }
    for (; v < nvec; v++) {
        const float *col = qt + (int64_t)(v / QK_VECS) * DIRECT_HEAD_DIM * PANEL + v % QK_VECS * LANES;
        if (nk == QK_KEYS) qk_tile(k_rows, col, PANEL, st + v * LANES, ld, QK_KEYS, 1);
        else qk_tile(k_rows, col, PANEL, st + v * LANES, ld, 1, 1);
    }
}

/* o[r0 .. r0 + nr) (+)= sum over keys j0 .. j1 of P^T[j][r] * V row j; o: [rows, D]; `first`
 * starts the sums at zero */
static inline __attribute__((always_inline)) void pv_tile(const float *pt, int ldp, int r0,
                                                          int j0, int j1,
                                                          const float *const *v_rows, float *o,
                                                          int first, int nr) {
    enum { NV = DIRECT_HEAD_DIM / LANES };
    vfloat acc[PV_ROWS][NV];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            acc[i][k] = first ? (vfloat){0} : load_vec(o + (int64_t)(r0 + i) * DIRECT_HEAD_DIM + k * LANES);
    for (int j = j0; j < j1; j++) {
        const float *v = v_rows[j - j0], *p = pt + (int64_t)j * ldp + r0;
        vfloat row[NV];
        for (int k = 0; k < NV; k++) row[k] = load_vec(v + k * LANES);
        for (int i = 0; i < nr; i++) {
            const vfloat w = splat(p[i]);
            for (int k = 0; k < NV; k++) acc[i][k] += w * row[k];
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            store_vec(o + (int64_t)(r0 + i) * DIRECT_HEAD_DIM + k * LANES, acc[i][k]);
}

/* The cache rows of one kv head: row j of K (or V) is at base + slots[j] * stride. */
struct head_rows {
    const float *k, *v;
    const int64_t *slots;
    int64_t stride;
};

static inline const float *k_row(const struct head_rows *hr, int j) { return hr->k + hr->slots[j] * hr->stride; }
static inline const float *v_row(const struct head_rows *hr, int j) { return hr->v + hr->slots[j] * hr->stride; }

/* st rows 0 .. nk = scores of keys b0 .. b0 + nk against the tile's rows; keys up to `keys`
 * exist, so the K rows one register tile ahead are prefetched while it can */
static __attribute__((noinline)) void qk_block(const struct head_rows *hr, int b0, int nk,
                                               int keys, const float *qt, int ld, float *st) {
    const float *k_rows[QK_KEYS];
    int j = 0;
    for (; j + QK_KEYS <= nk; j += QK_KEYS) {
        for (int i = 0; i < QK_KEYS; i++) k_rows[i] = k_row(hr, b0 + j + i);
        if (b0 + j + 2 * QK_KEYS <= keys)
            for (int i = 0; i < QK_KEYS; i++) prefetch_row(k_row(hr, b0 + j + QK_KEYS + i));
        qk_keys(k_rows, qt, ld, st + (int64_t)j * ld, QK_KEYS, ld / LANES);
    }
    for (; j < nk; j++) {
        k_rows[0] = k_row(hr, b0 + j);
        qk_keys(k_rows, qt, ld, st + (int64_t)j * ld, 1, ld / LANES);
    }
}

/* A tile's softmax state: per row vector the running max and sum, and the last key each row
 * sees (its own token: keys `open` .. are the tile's own tokens, seen causally). */
struct tile_state {
    int rows, ld, m, t0, open, keys;
    float *qt, *o; /* Q^T panels; output sums [rows, D] */
    vfloat max[MAX_TILE_VECS], sum[MAX_TILE_VECS], last[MAX_TILE_VECS];
};

/* x where the rows of vector v see key `key`, else 0 */
static inline vfloat seen_only(vfloat x, int key, const struct tile_state *ts, int v) {
    if (key < ts->open) return x;
    const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps((float)key), (__m512)ts->last[v], _CMP_LE_OQ);
    return (vfloat)_mm512_maskz_mov_ps(seen, (__m512)x);
}

/* The block's scores st [nk, ld] (keys b0 ..) become exp(scale * (s - max)), with max the
 * row's running max updated by this block (0 for keys the row does not see); the running sums
 * and, where a row's max grew, its output sums so far are rescaled to the new max. */
static __attribute__((noinline)) void softmax_block(float *st, int b0, int nk,
                                                    struct tile_state *ts, float scale) {
    const int ld = ts->ld, masked = b0 + nk > ts->open;
    for (int v = 0; v < ld / LANES; v++) {
        float *col = st + v * LANES;
        vfloat mx = ts->max[v];
        for (int j = 0; j < nk; j++) {
            const __m512 s = (__m512)load_vec(col + (int64_t)j * ld);
            if (masked && b0 + j >= ts->open) {
                const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps((float)(b0 + j)), (__m512)ts->last[v], _CMP_LE_OQ);
                mx = (vfloat)_mm512_mask_max_ps((__m512)mx, seen, (__m512)mx, s);
            } else mx = (vfloat)_mm512_max_ps((__m512)mx, s);
        }
        const __mmask16 grew = b0 ? _mm512_cmp_ps_mask((__m512)mx, (__m512)ts->max[v], _CMP_GT_OQ) : 0;
        if (grew) {
            const vfloat alpha = exp_nonpositive((ts->max[v] - mx) * scale);
            ts->sum[v] *= alpha;
            for (int l = 0; l < LANES; l++) {
                const int r = v * LANES + l;
                if (!((grew >> l) & 1) || r >= ts->rows) continue;
                const vfloat a = splat(alpha[l]);
                for (int k = 0; k < DIRECT_HEAD_DIM; k += LANES) {
                    float *p = ts->o + (int64_t)r * DIRECT_HEAD_DIM + k;
                    store_vec(p, load_vec(p) * a);
                }
            }
        }
        ts->max[v] = mx;
        const vfloat shift = mx * -scale;
        /* two independent chains, keys alternating between them in every block, masked or
         * not: a row's sum is then the same whichever tile it falls in (where its tile starts
         * decides which blocks are masked), so a row's result does not depend on the batch */
        vfloat sum0 = {0}, sum1 = {0};
        int j = 0;
        if (!masked)
            for (; j + 2 <= nk; j += 2) {
                float *a = col + (int64_t)j * ld, *b = a + ld;
                const vfloat x0 = exp_nonpositive(load_vec(a) * scale + shift);
                const vfloat x1 = exp_nonpositive(load_vec(b) * scale + shift);
                store_vec(a, x0);
                store_vec(b, x1);
                sum0 += x0;
                sum1 += x1;
            }
        else
            for (; j + 2 <= nk; j += 2) {
                float *a = col + (int64_t)j * ld, *b = a + ld;
                const vfloat x0 = seen_only(exp_nonpositive(load_vec(a) * scale + shift), b0 + j, ts, v);
                const vfloat x1 = seen_only(exp_nonpositive(load_vec(b) * scale + shift), b0 + j + 1, ts, v);
                store_vec(a, x0);
                store_vec(b, x1);
                sum0 += x0;
                sum1 += x1;
            }
        if (j < nk) {
            float *a = col + (int64_t)j * ld;
            const vfloat x = seen_only(exp_nonpositive(load_vec(a) * scale + shift), b0 + j, ts, v);
            store_vec(a, x);
            sum0 += x;
        }
        ts->sum[v] += sum0 + sum1;
    }
}

/* o (+)= P V over the block's nk keys (rows v_rows); the next block's next_n V rows (keys
 * from `next`) are prefetched a few per row tile */
static __attribute__((noinline)) void pv_block(const float *st, int ld, int rows, int nk,
                                               const float *const *v_rows, float *o, int first,
                                               const struct head_rows *hr, int next,
                                               int next_n) {
    const int per_tile = PV_ROWS * next_n / rows + 1;
    int r0 = 0, p = 0;
    for (; r0 + PV_ROWS <= rows; r0 += PV_ROWS) {
        for (const int stop = p + per_tile < next_n ? p + per_tile : next_n; p < stop; p++)
            prefetch_row(v_row(hr, next + p));
        pv_tile(st, ld, r0, 0, nk, v_rows, o, first, PV_ROWS);
    }
    for (; r0 < rows; r0++) pv_tile(st, ld, r0, 0, nk, v_rows, o, first, 1);
}

#ifdef __AVX512BF16__
/* ---- bfloat16 products (AVX512_BF16): a bfloat16 model's attention ------------------------
 *
 * With bfloat16 queries and caches, vdpbf16ps multiplies pairs of bfloat16 values and adds both
 * products to a float32 lane: twice the multiply-adds per instruction of the float32 loops
 * above, and K rows read as they are stored. QK^T pairs adjacent dimensions: Q^T panels hold
 * (q[r][2p], q[r][2p + 1]) in lane r of row p ([D/2][PANEL] 32-bit lanes), a K row's pair p is
 * one broadcast 32-bit load. P V pairs adjacent keys: the probabilities (float32 after the
 * softmax, rounded to bfloat16 here, as bfloat16 FlashAttention kernels do) and the block's V
 * rows are interleaved two keys at a time. Scores, softmax and output sums stay float32. */
#define DOT16 1

typedef uint16_t bf16_t;

/* lane l of the result: a[l] in the low half, b[l] in the high half (a, b: 16 bfloat16 each) */
static inline __m512i interleave16(__m256i a, __m256i b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

/* float32 -> bfloat16, round to nearest even (the values are finite) */
static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static inline bf16_t to_bf16_1(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline const bf16_t *k_row16(const struct head_rows *hr, int j) {
    return (const bf16_t *)hr->k + hr->slots[j] * hr->stride;
}
static inline const bf16_t *v_row16(const struct head_rows *hr, int j) {
    return (const bf16_t *)hr->v + hr->slots[j] * hr->stride;
}

/* st[i][0 .. 16 nv) = sum_p k_rows[i] pair p . qp[p][0 .. 16 nv) */
static inline __attribute__((always_inline)) void qk_tile16(const bf16_t *const *k_rows,
                                                            const uint32_t *qp, int ldq,
                                                            float *st, int lds, int nk, int nv) {
    __m512 acc[QK_KEYS][QK_VECS];
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = _mm512_setzero_ps();
    for (int p = 0; p < DIRECT_HEAD_DIM / 2; p++) {
        __m512bh b[QK_VECS];
        for (int v = 0; v < nv; v++)
            b[v] = (__m512bh)_mm512_loadu_si512(qp + (int64_t)p * ldq + v * LANES);
        for (int i = 0; i < nk; i++) {
            int32_t pair;
            memcpy(&pair, k_rows[i] + 2 * p, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < nv; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
        }
    }
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(st + (int64_t)i * lds + v * LANES, acc[i][v]);
}

static void qk_keys16(const bf16_t *const *k_rows, const uint32_t *qp, int ld, float *st, int nk,
                      int nvec) {
    enum { PANEL_LANES = DIRECT_HEAD_DIM / 2 * PANEL };
    int v = 0;
    for (; v + QK_VECS <= nvec; v += QK_VECS) {
        const uint32_t *panel = qp + (int64_t)(v / QK_VECS) * PANEL_LANES;
        if (nk == QK_KEYS) qk_tile16(k_rows, panel, PANEL, st + v * LANES, ld, QK_KEYS, QK_VECS);
        else qk_tile16(k_rows, panel, PANEL, st + v * LANES, ld, 1, QK_VECS);
    }
    for (; v < nvec; v++) {
        const uint32_t *col = qp + (int64_t)(v / QK_VECS) * PANEL_LANES + v % QK_VECS * LANES;
        if (nk == QK_KEYS) qk_tile16(k_rows, col, PANEL, st + v * LANES, ld, QK_KEYS, 1);
        else qk_tile16(k_rows, col, PANEL, st + v * LANES, ld, 1, 1);
    }
}

static __attribute__((noinline)) void qk_block16(const struct head_rows *hr, int b0, int nk,
                                                 int keys, const uint32_t *qp, int ld,
                                                 float *st) {
    const bf16_t *k_rows[QK_KEYS];
    int j = 0;
    for (; j + QK_KEYS <= nk; j += QK_KEYS) {
        for (int i = 0; i < QK_KEYS; i++) k_rows[i] = k_row16(hr, b0 + j + i);
        if (b0 + j + 2 * QK_KEYS <= keys)
            for (int i = 0; i < QK_KEYS; i++)
                _mm_prefetch((const char *)k_row16(hr, b0 + j + QK_KEYS + i), _MM_HINT_T0),
                _mm_prefetch((const char *)k_row16(hr, b0 + j + QK_KEYS + i) + 64, _MM_HINT_T0);
        qk_keys16(k_rows, qp, ld, st + (int64_t)j * ld, QK_KEYS, ld / LANES);
    }
    for (; j < nk; j++) {
        k_rows[0] = k_row16(hr, b0 + j);
        qk_keys16(k_rows, qp, ld, st + (int64_t)j * ld, 1, ld / LANES);
    }
}

/* The block's V rows b0 .. b0 + nk, two keys per 32-bit lane: vp[jp][d] = (V[2jp][d],
 * V[2jp + 1][d]), a missing odd key as zeros. */
static void pair_values(const struct head_rows *hr, int b0, int nk, uint32_t *vp) {
    for (int jp = 0; 2 * jp < nk; jp++) {
        const bf16_t *r0 = v_row16(hr, b0 + 2 * jp);
        const bf16_t *r1 = 2 * jp + 1 < nk ? v_row16(hr, b0 + 2 * jp + 1) : NULL;
        for (int k = 0; k < DIRECT_HEAD_DIM; k += LANES) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(r0 + k));
            const __m256i b = r1 ? _mm256_loadu_si256((const __m256i *)(r1 + k)) : _mm256_setzero_si256();
            _mm512_storeu_si512(vp + (int64_t)jp * DIRECT_HEAD_DIM + k, interleave16(a, b));
        }
    }
}

/* The block's probabilities st [nk, ld] as bfloat16 pairs of keys: pp[jp][r] = (P[2jp][r],
 * P[2jp + 1][r]). */
static void pair_probabilities(const float *st, int ld, int nk, uint32_t *pp) {
    for (int jp = 0; 2 * jp < nk; jp++)
        for (int v = 0; v < ld; v += LANES) {
            const __m512 x0 = _mm512_loadu_ps(st + (int64_t)2 * jp * ld + v);
            const __m512 x1 = 2 * jp + 1 < nk ? _mm512_loadu_ps(st + (int64_t)(2 * jp + 1) * ld + v)
                                              : _mm512_setzero_ps();
            _mm512_storeu_si512(pp + (int64_t)jp * ld + v, interleave16(to_bf16(x0), to_bf16(x1)));
        }
}

static inline __attribute__((always_inline)) void pv_tile16(const uint32_t *pp, int ldp, int r0,
                                                            int pairs, const uint32_t *vp,
                                                            float *o, int first, int nr) {
    enum { NV = DIRECT_HEAD_DIM / LANES };
    __m512 acc[PV_ROWS][NV];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            acc[i][k] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + (int64_t)(r0 + i) * DIRECT_HEAD_DIM + k * LANES);
    for (int jp = 0; jp < pairs; jp++) {
        __m512bh row[NV];
        for (int k = 0; k < NV; k++)
            row[k] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)jp * DIRECT_HEAD_DIM + k * LANES);
        for (int i = 0; i < nr; i++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)pp[(int64_t)jp * ldp + r0 + i]);
            for (int k = 0; k < NV; k++) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], w, row[k]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            _mm512_storeu_ps(o + (int64_t)(r0 + i) * DIRECT_HEAD_DIM + k * LANES, acc[i][k]);
}

static __attribute__((noinline)) void pv_block16(const uint32_t *pp, int ld, int rows, int nk,
                                                 const uint32_t *vp, float *o, int first) {
    const int pairs = (nk + 1) / 2;
    int r0 = 0;
    for (; r0 + PV_ROWS <= rows; r0 += PV_ROWS) pv_tile16(pp, ld, r0, pairs, vp, o, first, PV_ROWS);
    for (; r0 < rows; r0++) pv_tile16(pp, ld, r0, pairs, vp, o, first, 1);
}
#else
#define DOT16 0
#endif

/* kv head h's rows in caches of either dtype (k_row / v_row for float32, k_row16 / v_row16
 * for bfloat16: the stride counts elements) */
static struct head_rows head_of(const void *k_cache, const void *v_cache, int bf16,
                                const int64_t *slots, int h, int KV) {
    const int64_t offset = (int64_t)h * DIRECT_HEAD_DIM * (bf16 ? 2 : 4); /* bytes */
    const struct head_rows hr = {(const float *)((const char *)k_cache + offset),
                                 (const float *)((const char *)v_cache + offset), slots,
                                 (int64_t)KV * DIRECT_HEAD_DIM};
    return hr;
}

static const int64_t BLOCK_ROWS[KEY_BLOCK] = {
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
};

/* Where a work item's tiles live in its buffer (direct_floats): the scores of one key block,
 * GROUP_TILES Q^T panels and output sums, and a bfloat16 cache's key block, widened. */
struct direct_buf {
    float *st, *qts, *os, *k_wide, *v_wide;
    uint32_t *p_pairs, *v_pairs; /* bfloat16 products: P and V two keys per lane */
    int tile_ld;
};

static struct direct_buf direct_layout(float *buf, int tile_rows) {
    struct direct_buf b;
    b.tile_ld = (tile_rows + LANES - 1) / LANES * LANES;
    b.st = buf, b.qts = b.st + (int64_t)KEY_BLOCK * b.tile_ld;
    b.os = b.qts + GROUP_TILES * panel_floats(tile_rows);
    b.k_wide = b.os + (int64_t)GROUP_TILES * b.tile_ld * DIRECT_HEAD_DIM;
    b.v_wide = b.k_wide + KEY_BLOCK * DIRECT_HEAD_DIM;
    b.p_pairs = (uint32_t *)(b.v_wide + KEY_BLOCK * DIRECT_HEAD_DIM);
    b.v_pairs = b.p_pairs + (int64_t)KEY_BLOCK / 2 * b.tile_ld;
    return b;
}

/* Tile `slot` of the buffer: rows r = g * m + t, query head h * G + g of token t0 + t (its
 * queries at q + (t0 + t) * q_row_stride), seeing keys 0 .. open + t - 1 of `keys` (causal
 * past `open`; open == keys: every row sees every key). */
static void tile_begin(struct tile_state *ts, const struct direct_buf *b, int slot, int tile_rows,
                       const float *q, int64_t q_row_stride, int t0, int m, int open, int keys,
                       int h, int G, int dot16) {
    enum { D = DIRECT_HEAD_DIM };
    ts->m = m, ts->t0 = t0, ts->rows = G * m, ts->ld = (ts->rows + LANES - 1) / LANES * LANES;
    ts->open = open, ts->keys = keys;
    ts->qt = b->qts + slot * panel_floats(tile_rows), ts->o = b->os + (int64_t)slot * b->tile_ld * D;
#if DOT16
    if (dot16) /* Q^T panels of bfloat16 pairs: [D/2][PANEL] lanes per panel */
        for (int r = 0; r < ts->ld; r++) {
            uint32_t *dst = (uint32_t *)ts->qt + (int64_t)(r / PANEL) * (D / 2) * PANEL + r % PANEL;
            const float *src = q + (int64_t)(t0 + r % m) * q_row_stride + (int64_t)(h * G + r / m) * D;
            for (int p = 0; p < D / 2; p++)
                dst[(int64_t)p * PANEL] = r >= ts->rows ? 0u : (uint32_t)to_bf16_1(src[2 * p]) |
                                                         (uint32_t)to_bf16_1(src[2 * p + 1]) << 16;
        }
    else
#endif
    for (int r = 0; r < ts->ld; r++) {
        float *dst = ts->qt + (int64_t)(r / PANEL) * D * PANEL + r % PANEL;
        if (r >= ts->rows) { /* padding rows: zero queries, scores unused */
            for (int d = 0; d < D; d++) dst[(int64_t)d * PANEL] = 0.0f;
            continue;
        }
        const float *src = q + (int64_t)(t0 + r % m) * q_row_stride + (int64_t)(h * G + r / m) * D;
        for (int d = 0; d < D; d++) dst[(int64_t)d * PANEL] = src[d];
    }
    for (int v = 0; v < ts->ld / LANES; v++) {
        ts->max[v] = splat(-INFINITY);
        ts->sum[v] = (vfloat){0};
        for (int l = 0; l < LANES; l++) {
            const int r = v * LANES + l;
            ts->last[v][l] = (float)(r < ts->rows ? open + r % m : keys - 1);
        }
    }
}

/* Every key block of kv head h (rows through hr) in turn through the nt tiles. */
static void tiles_over_keys(struct tile_state *tiles, int nt, const struct head_rows *hr,
                            const struct direct_buf *b, const void *k_cache,
                            const void *v_cache, int bf16, int KV, int h, float scale) {
    enum { D = DIRECT_HEAD_DIM };
    const struct head_rows wide = {b->k_wide, b->v_wide, BLOCK_ROWS, D};
    const float *v_rows[KEY_BLOCK];
    const int keys = tiles[nt - 1].keys; /* the last tile sees the most */
#if DOT16
    if (bf16 == KV_BF16_PRODUCTS) {
        for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
            const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
            pair_values(hr, b0, block, b->v_pairs);
            for (int t = 0; t < nt; t++) {
                struct tile_state *ts = &tiles[t];
                if (b0 >= ts->keys) continue;
                const int nk = ts->keys - b0 < KEY_BLOCK ? ts->keys - b0 : KEY_BLOCK;
                qk_block16(hr, b0, nk, ts->keys, (const uint32_t *)ts->qt, ts->ld, b->st);
                softmax_block(b->st, b0, nk, ts, scale);
                pair_probabilities(b->st, ts->ld, nk, b->p_pairs);
                pv_block16(b->p_pairs, ts->ld, ts->rows, nk, b->v_pairs, ts->o, b0 == 0);
            }
        }
        return;
    }
#endif
    for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
        const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
        if (bf16)
            for (int j = 0; j < block; j++) {
                const int64_t src = (hr->slots[b0 + j] * KV + h) * D;
                load_row(b->k_wide + j * D, k_cache, src, D, 1);
                load_row(b->v_wide + j * D, v_cache, src, D, 1);
                v_rows[j] = b->v_wide + j * D;
            }
        else
            for (int j = 0; j < block; j++) v_rows[j] = v_row(hr, b0 + j);
        for (int t = 0; t < nt; t++) {
            struct tile_state *ts = &tiles[t];
            if (b0 >= ts->keys) continue;
            const int nk = ts->keys - b0 < KEY_BLOCK ? ts->keys - b0 : KEY_BLOCK;
            const int next = b0 + KEY_BLOCK, next_n = t == 0 && next < keys ? (keys - next < KEY_BLOCK ? keys - next : KEY_BLOCK) : 0;
            if (bf16)
                qk_block(&wide, 0, nk, nk, ts->qt, ts->ld, b->st);
            else
                qk_block(hr, b0, nk, ts->keys, ts->qt, ts->ld, b->st);
            softmax_block(b->st, b0, nk, ts, scale);
            if (bf16)
                pv_block(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, b0 == 0, &wide, 0, 0);
            else
                pv_block(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, b0 == 0, hr, next, next_n);
        }
    }
}

/* The tile's normalised rows into out [tokens, H, D] */
static void tile_end(const struct tile_state *ts, float *out, int h, int H, int G) {
    enum { D = DIRECT_HEAD_DIM };
    for (int r = 0; r < ts->rows; r++) {
        const float f = 1.0f / ts->sum[r / LANES][r % LANES];
        float *dst = out + ((int64_t)(ts->t0 + r % ts->m) * H + h * G + r / ts->m) * D;
        for (int d = 0; d < D; d++) dst[d] = ts->o[(int64_t)r * D + d] * f;
    }
}

/* New tokens g0 .. g1 - 1 of kv head h, `group` tiles (<= GROUP_TILES) at a time: each key
 * block in turn through every tile of the group. buf: direct_floats(G * tile_tokens). A
 * bfloat16 cache's key block is widened into buf first, once for the group's tiles (16 KB,
 * in L1), and read from there. */
static void direct_tiles(const float *q, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, int bf16, const int64_t *slots, float *out, int C,
                         int T, int g0_begin, int g1, int group, int tile_tokens, int h, int H,
                         int KV, int G, float scale, float *buf) {
    enum { D = DIRECT_HEAD_DIM };
    const struct head_rows hr = head_of(k_cache, v_cache, bf16, slots, h, KV);
    const int tile_rows = G * tile_tokens;
    const struct direct_buf b = direct_layout(buf, tile_rows);
    struct tile_state tiles[GROUP_TILES];
    for (int g0 = g0_begin; g0 < g1; g0 += group * tile_tokens) {
        int nt = 0;
        for (int t0 = g0; t0 < g1 && nt < group; t0 += tile_tokens, nt++) {
            const int m = T - t0 < tile_tokens ? T - t0 : tile_tokens;
            tile_begin(&tiles[nt], &b, nt, tile_rows, q, q_row_stride, t0, m, C + t0, C + t0 + m,
                       h, G, bf16 == KV_BF16_PRODUCTS);
        }
        tiles_over_keys(tiles, nt, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
        for (int t = 0; t < nt; t++) tile_end(&tiles[t], out, h, H, G);
    }
}

/* Decode sequences b0 .. b0 + nb - 1 of kv head h as one tile (rows g * nb + b): the shared
 * keys (shared_slots) straight from the cache, in key blocks as above, then each sequence's own
 * tail keys (gathered into k_tail, v_tail; one small GEMM each for scores and values) folded
 * into its rows' running max, sum and output sums. buf: direct_floats(G * nb). */
static void direct_decode(const float *q, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, int bf16, const int64_t *shared_slots, int shared,
                          const int64_t *tail_slots, const int *tail_lens, int max_tail,
                          float *out, int b0, int nb, int h, int H, int KV, int G, float scale,
                          float *buf, float *k_tail, float *v_tail, float *tail_scores,
                          sgemm_fn sgemm) {
    enum { D = DIRECT_HEAD_DIM };
    const struct head_rows hr = head_of(k_cache, v_cache, bf16, shared_slots, h, KV);
    const struct direct_buf b = direct_layout(buf, G * nb);
    struct tile_state ts;
    tile_begin(&ts, &b, 0, G * nb, q, q_row_stride, b0, nb, shared, shared, h, G,
               bf16 == KV_BF16_PRODUCTS);
    tiles_over_keys(&ts, 1, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
    const float one = 1.0f, zero = 0.0f;
    int ld = D, g_rows = G, ldo = nb * D;
    for (int t = 0; t < nb; t++) {
        int len = tail_lens[b0 + t];
        const int64_t *slots = tail_slots + (int64_t)(b0 + t) * max_tail;
        for (int j = 0; j < len; j++) {
            const int64_t src = (slots[j] * KV + h) * D;
            load_row(k_tail + (int64_t)j * D, k_cache, src, D, bf16);
            load_row(v_tail + (int64_t)j * D, v_cache, src, D, bf16);
        }
        /* scores [G, len] (column-major [len, G]) = q rows of sequence b0 + t, K_tail^T */
        sgemm("T", "N", &len, &g_rows, &ld, &one, k_tail, &ld,
              q + (int64_t)(b0 + t) * q_row_stride + (int64_t)h * G * D, &ld, &zero,
              tail_scores, &len);
        for (int g = 0; g < G; g++) {
            const int r = g * nb + t;
            float *sc = tail_scores + (int64_t)g * len, *o = ts.o + (int64_t)r * D;
            const float old = ts.max[r / LANES][r % LANES];
            float mx = old;
            for (int j = 0; j < len; j++) mx = sc[j] > mx ? sc[j] : mx;
            vfloat x = {0};
            x[0] = (old - mx) * scale;
            const float alpha = exp_nonpositive(x)[0];
            float sum = ts.sum[r / LANES][r % LANES] * alpha;
            for (int d = 0; d < D; d++) o[d] *= alpha;
            for (int j = 0; j < len; j += LANES) { /* the tail's weights, LANES at a time */
                const int lanes = len - j < LANES ? len - j : LANES;
                vfloat w = {0};
                memcpy(&w, sc + j, (size_t)lanes * sizeof(float));
                w = exp_nonpositive((w - mx) * scale);
                for (int l = 0; l < lanes; l++) sum += w[l];
                memcpy(sc + j, &w, (size_t)lanes * sizeof(float));
            }
            ts.max[r / LANES][r % LANES] = mx, ts.sum[r / LANES][r % LANES] = sum;
        }
        /* output sums of its G rows (column-major [D, G], rows nb apart) += V_tail^T P^T */
        sgemm("N", "N", &ld, &g_rows, &len, &one, v_tail, &ld, tail_scores, &len, &one,
              ts.o + (int64_t)t * D, &ldo);
    }
    tile_end(&ts, out, h, H, G);
}
#else
#define GROUP_TILES 1
static inline int direct_applies(int D, int tile_rows) { (void)D; (void)tile_rows; return 0; }
static int64_t direct_floats(int tile_rows) { (void)tile_rows; return 0; }
static void direct_tiles(const float *q, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, int bf16, const int64_t *slots, float *out, int C,
                         int T, int g0_begin, int g1, int group, int tile_tokens, int h, int H,
                         int KV, int G, float scale, float *buf) {
    (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)bf16, (void)slots;
    (void)out, (void)C;
    (void)T, (void)g0_begin, (void)g1, (void)group, (void)tile_tokens, (void)h, (void)H;
    (void)KV, (void)G, (void)scale, (void)buf;
}
static void direct_decode(const float *q, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, int bf16, const int64_t *shared_slots, int shared,
                          const int64_t *tail_slots, const int *tail_lens, int max_tail,
                          float *out, int b0, int nb, int h, int H, int KV, int G, float scale,
                          float *buf, float *k_tail, float *v_tail, float *tail_scores,
                          sgemm_fn sgemm) {
    (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)bf16, (void)shared_slots;
    (void)shared, (void)tail_slots, (void)tail_lens, (void)max_tail, (void)out, (void)b0;
    (void)nb, (void)h, (void)H, (void)KV, (void)G, (void)scale, (void)buf, (void)k_tail;
    (void)v_tail, (void)tail_scores, (void)sgemm;
}
#endif

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
 * scores of one tile, or what `direct_head` needs, whichever is more. */
static int64_t per_thread_floats(int S, int G, int D, int tile_tokens) {
    const int64_t rows = (int64_t)G * tile_tokens, tiles = rows * (2 * (int64_t)D + S);
    const int64_t direct = direct_applies(D, (int)rows) ? direct_floats((int)rows) : 0;
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
 * Where `direct_applies` (AVX-512, head_dim 64, at most 256 stacked rows per tile), with or
 * without cached context: work item = a run of one kv head's tiles (`direct_group`), reading the
 * cache directly; it runs near the GEMMs' rate, about twice the gathering paths' on a fresh
 * 2,048-token prefill (figures: docs/performance.md). Otherwise two ways to split the work.
 * In general the team gathers every head's K and V once, then work
 * item = (kv head, tile): many items of varying size (the causal triangle) for dynamic
 * scheduling. After a cache hit (C >= T) with whole heads per thread (KV a multiple of the
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
                direct_tiles(q, q_row_stride, k_cache, v_cache, bf16, slots, out, C, T, g0,
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

/* Which split the prefill kernel uses for these sizes: 0 the shared gather, 1 a gather per kv
 * head, 2 per kv head straight from the cache (float32 caches only). */
int pc_attention_path(int T, int S, int H, int KV, int D, int tile_tokens, int nthreads,
                      int bf16) {
    (void)bf16; /* both cache dtypes take the same splits */
    if (direct_applies(D, (H / KV) * tile_tokens)) return 2;
    return S - T >= T && local_heads(KV, nthreads);
}

/* Floats of scratch `pc_decode` needs: shared K and V per kv head (or per thread, whichever is
 * more), then per thread the stacked queries and outputs of one chunk, its scores, and one
 * tail's K and V. */
static inline int decode_direct(int shared, int G, int D, int chunk) {
    return shared > 0 && direct_applies(D, G * chunk);
}

static int64_t decode_thread_floats(int shared, int max_tail, int G, int D, int chunk) {
    const int64_t rows = (int64_t)G * chunk;
    if (decode_direct(shared, G, D, chunk)) /* its tile, one tail's K and V, the tail scores */
        return direct_floats((int)rows) + (2 * (int64_t)D + G) * max_tail;
    return rows * (2 * (int64_t)D + shared + max_tail) + 2 * (int64_t)max_tail * D;
}

int64_t pc_decode_scratch_floats(int shared, int max_tail, int H, int KV, int D, int chunk,
                                 int nthreads) {
    const int G = H / KV;
    const int64_t gathered = decode_direct(shared, G, D, chunk) ? 0 : 2 * kv_copies(KV, nthreads) * (int64_t)shared * D;
    return gathered + (int64_t)nthreads * decode_thread_floats(shared, max_tail, G, D, chunk);
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
            const int64_t src = (slots[j] * KV + h) * D;
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
            const int64_t src = (slots[j] * KV + h) * D;
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
 * Where `direct_applies` (AVX-512, head_dim 64) the shared keys are read straight from the
 * cache by the direct path's key-block loops (`direct_decode`: no gather, and the register
 * tiles run near the GEMM's rate), each tail folded in after them. Otherwise, as in
 * pc_attention, where each thread gets whole kv heads, the thread gathers the shared keys of
 * the head it works on into its own buffer (read from L2 by that head's chunks), or the team
 * gathers every head's once. */
static void decode(const float *q, int64_t q_row_stride, const void *k_cache,
                   const void *v_cache, int bf16, const int64_t *shared_slots, int shared,
                   const int64_t *tail_slots, const int *tail_lens, int max_tail, float *out,
                   float *scratch, int B, int H, int KV, int D, float scale, int chunk,
                   int nthreads, sgemm_fn sgemm, set_threads_fn set_threads) {
    const int G = H / KV, num_chunks = (B + chunk - 1) / chunk;
    const int64_t head_floats = (int64_t)shared * D, chunk_rows = (int64_t)G * chunk;
    const int width = shared + max_tail;
    const int direct = decode_direct(shared, G, D, chunk);
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
            float *k_one = tile + direct_floats((int)chunk_rows), *v_one = k_one + (int64_t)max_tail * D;
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < KV * num_chunks; item++) {
                const int h = item / num_chunks, b0 = (item % num_chunks) * chunk;
                direct_decode(q, q_row_stride, k_cache, v_cache, bf16, shared_slots, shared,
                              tail_slots, tail_lens, max_tail, out, b0,
                              B - b0 < chunk ? B - b0 : chunk, h, H, KV, G, scale, tile, k_one,
                              v_one, v_one + (int64_t)max_tail * D, sgemm);
            }
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
