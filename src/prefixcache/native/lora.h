/* LoRA on the CPU: each adapter's low-rank update of a projection's output, over the rows of
 * a step that run under it (the segmented product of S-LoRA and Punica: the base projection
 * runs once over every row, then each adapter over its own rows). Included by layers.c; used
 * through prefixcache.model.lora_batch and by the compiled layer steps right after each GEMM.
 *
 * A piece is one adapter's update of one block of a projection's output columns (q, k or v of
 * the fused qkv projection, gate or up of gate_up, o, down):
 *     out[r, col0 + j] += (sum_i (sum_kk x[r, kk] A[i, kk]) B[col0 + j, i]) * scale
 * peft's `result + lora_B(lora_A(x)) * scaling`, in float32 (x and out may be bfloat16: x
 * widened, the sum rounded once into out). Every value is one chain of fused multiply-adds in a
 * fixed order (over kk, then over i), whatever the rows beside it, the tile it falls in or the
 * thread that runs it: a row's bits do not depend on its batch. */
#ifndef PREFIXCACHE_LORA_H
#define PREFIXCACHE_LORA_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "vector_math.h"

/* rows sharing each load of A and of B (their accumulators fill the vector registers) */
#ifdef __AVX512F__
#define LORA_TILE 8
#else
#define LORA_TILE 4
#endif
#define LORA_VECS 2                    /* rank vectors (A) or column vectors (B) per pass */
#define LORA_COLS (LORA_VECS * LANES)  /* b_t's rows are padded to 64 columns: whole passes */
#define LORA_MAX_RANK 512
#define LORA_STACK_X 16384             /* floats of a widened bfloat16 tile kept on the stack */

/* One adapter's update of output columns [col0, col0 + n) of one projection; A and B in float32,
 * or bfloat16 where bf16w (widened to float32 as they are read: a bfloat16 model's adapters) */
struct lora_piece {
    const void *a_t; /* [k][rank_pad]: A transposed, ranks zero-padded to whole vectors */
    const void *b_t; /* [rank][n_pad]: B transposed, columns zero-padded to 64 */
    int rank, rank_pad, col0, n, n_pad;
    float scale;
    int bf16w;
};

/* A projection's pieces by adapter slot: slot s's are pieces[first[s] .. first[s + 1]) */
struct lora_table {
    const struct lora_piece *pieces;
    const int *first;
};

/* A step's rows under an adapter: `count` runs of rows [row0, row0 + rows) under `slot` */
struct lora_runs {
    int count;
    const int *row0, *rows, *slot;
};

typedef uint16_t lora_vbf16 __attribute__((vector_size(2 * LANES)));
typedef uint32_t lora_vuint __attribute__((vector_size(4 * LANES)));

/* LANES weights from w[at], float32, or bfloat16 widened (exact) where bf16w */
static inline __attribute__((always_inline)) vfloat lora_load(const void *w, int64_t at,
                                                              const int bf16w) {
    if (bf16w) {
        lora_vbf16 h;
        memcpy(&h, (const uint16_t *)w + at, sizeof h);
        return (vfloat)(__builtin_convertvector(h, lora_vuint) << 16);
    }
    vfloat v;
    memcpy(&v, (const float *)w + at, sizeof v);
    return v;
}

static inline float lora_widen(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t lora_narrow(float f) { /* round to nearest even (finite values) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Ranks [v0 * LANES, (v0 + NV) * LANES) of u[t] = x[t] A^T for the tile's T rows (u: [T][rank_pad]
 * floats). Inlined with constant T, NV and bf16 (`lora_shrink`), so that the T x NV
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void lora_shrink_tile(
    const struct lora_piece *p, const float *x, int64_t ldx, int k, const int bf16w, const int T,
    const int NV, int v0, float *u) {
    vfloat acc[LORA_TILE][LORA_VECS];
    for (int t = 0; t < T; t++)
        for (int v = 0; v < NV; v++) acc[t][v] = (vfloat){0};
    int64_t a = (int64_t)v0 * LANES;
    for (int kk = 0; kk < k; kk++, a += p->rank_pad) {
        vfloat av[LORA_VECS];
        for (int v = 0; v < NV; v++) av[v] = lora_load(p->a_t, a + v * LANES, bf16w);
        for (int t = 0; t < T; t++) {
            const vfloat xs = vsplat(x[t * ldx + kk]);
            for (int v = 0; v < NV; v++) acc[t][v] = fmadd(xs, av[v], acc[t][v]);
        }
    }
    for (int t = 0; t < T; t++)
        for (int v = 0; v < NV; v++)
            memcpy(u + (int64_t)t * p->rank_pad + (v0 + v) * LANES, &acc[t][v], sizeof(vfloat));
}

#define LORA_SHRINK_NV(T, BF16W)                                                  \
    (NV == 1 ? lora_shrink_tile(p, x, ldx, k, BF16W, T, 1, v0, u)                 \
             : lora_shrink_tile(p, x, ldx, k, BF16W, T, LORA_VECS, v0, u))
#define LORA_SHRINK_CASE(T)                                                       \
    case T:                                                                       \
        if (p->bf16w) LORA_SHRINK_NV(T, 1); else LORA_SHRINK_NV(T, 0);            \
        break;

/* u[t] = x[t] A^T for the tile's T rows (x: float32 rows ldx apart; u: [T][rank_pad] floats) */
static void lora_shrink(const struct lora_piece *p, const float *x, int64_t ldx, int k, int T,
                        float *u) {
    const int nv = p->rank_pad / LANES;
    for (int v0 = 0; v0 < nv; v0 += LORA_VECS) {
        const int NV = nv - v0 < LORA_VECS ? nv - v0 : LORA_VECS;
        switch (T) {
            LORA_SHRINK_CASE(1) LORA_SHRINK_CASE(2) LORA_SHRINK_CASE(3) LORA_SHRINK_CASE(4)
#if LORA_TILE > 4
            LORA_SHRINK_CASE(5) LORA_SHRINK_CASE(6) LORA_SHRINK_CASE(7) LORA_SHRINK_CASE(8)
#endif
        }
    }
}

/* out[t, col0 + j] += (u[t] B^T)[j] * scale for the tile's T rows (inlined with constant T and
 * bf16: `lora_expand`) */
static inline __attribute__((always_inline)) void lora_expand_tile(
    const struct lora_piece *p, const float *u, const int T, void *out, int64_t ldo,
    const int bf16, const int bf16w) {
    for (int c0 = 0; c0 < p->n; c0 += LORA_COLS) {
        vfloat acc[LORA_TILE][LORA_VECS];
        for (int t = 0; t < T; t++)
            for (int v = 0; v < LORA_VECS; v++) acc[t][v] = (vfloat){0};
        int64_t b = c0;
        for (int i = 0; i < p->rank; i++, b += p->n_pad) {
            vfloat bv[LORA_VECS];
            for (int v = 0; v < LORA_VECS; v++) bv[v] = lora_load(p->b_t, b + v * LANES, bf16w);
            for (int t = 0; t < T; t++) {
                const vfloat ui = vsplat(u[(int64_t)t * p->rank_pad + i]);
                for (int v = 0; v < LORA_VECS; v++) acc[t][v] = fmadd(ui, bv[v], acc[t][v]);
            }
        }
        const int cols = p->n - c0 < LORA_COLS ? p->n - c0 : LORA_COLS;
        for (int t = 0; t < T; t++) {
            float d[LORA_COLS];
            memcpy(d, acc[t], sizeof d);
            const int64_t at = t * ldo + p->col0 + c0;
            if (bf16) {
                uint16_t *o = (uint16_t *)out + at;
                for (int j = 0; j < cols; j++)
                    o[j] = lora_narrow(lora_widen(o[j]) + d[j] * p->scale);
            } else {
                float *o = (float *)out + at;
                for (int j = 0; j < cols; j++) o[j] = o[j] + d[j] * p->scale;
            }
        }
    }
}

#define LORA_EXPAND_CASE(T)                                                       \
    case T:                                                                       \
        if (bf16 && p->bf16w) lora_expand_tile(p, u, T, out, ldo, 1, 1);          \
        else if (bf16) lora_expand_tile(p, u, T, out, ldo, 1, 0);                 \
        else if (p->bf16w) lora_expand_tile(p, u, T, out, ldo, 0, 1);             \
        else lora_expand_tile(p, u, T, out, ldo, 0, 0);                           \
        break;

static void lora_expand(const struct lora_piece *p, const float *u, int T, void *out,
                        int64_t ldo, int bf16) {
    switch (T) {
        LORA_EXPAND_CASE(1) LORA_EXPAND_CASE(2) LORA_EXPAND_CASE(3) LORA_EXPAND_CASE(4)
#if LORA_TILE > 4
        LORA_EXPAND_CASE(5) LORA_EXPAND_CASE(6) LORA_EXPAND_CASE(7) LORA_EXPAND_CASE(8)
#endif
    }
}

/* The rows of runs[s] inside [first_row, first_row + num_rows), as [lo, hi) */
static inline void lora_clip(const struct lora_runs *runs, int s, int first_row, int num_rows,
                             int *lo, int *hi) {
    const int a = runs->row0[s], b = a + runs->rows[s], end = first_row + num_rows;
    *lo = a > first_row ? a : first_row;
    *hi = b < end ? b : end;
}

/* The update of every run's rows inside [first_row, first_row + num_rows) of a step: x points
 * at that window's first row ([num_rows, k], rows ldx elements apart), out likewise ([num_rows,
 * the projection's width], ldo apart); bfloat16 x and out where bf16. Tiles of LORA_TILE rows
 * of one run are the units the threads share. */
void pc_lora_apply(const struct lora_runs *runs, const struct lora_table *table,
                   const void *x, int64_t ldx, int k, void *out, int64_t ldo, int first_row,
                   int num_rows, int bf16, int nthreads) {
    if (runs == NULL || table == NULL || table->pieces == NULL) return;
    int ntiles = 0;
    for (int s = 0; s < runs->count; s++) {
        int lo, hi;
        lora_clip(runs, s, first_row, num_rows, &lo, &hi);
        const int slot = runs->slot[s];
        if (hi > lo && table->first[slot + 1] > table->first[slot])
            ntiles += (hi - lo + LORA_TILE - 1) / LORA_TILE;
    }
    if (ntiles == 0) return;
    const int team = ntiles < nthreads ? ntiles : nthreads;
#pragma omp parallel for num_threads(team) schedule(dynamic)
    for (int it = 0; it < ntiles; it++) {
        int s = 0, lo = 0, hi = 0, seen = 0, tile = 0;
        for (; s < runs->count; s++) { /* the run and the tile of work item `it` */
            lora_clip(runs, s, first_row, num_rows, &lo, &hi);
            const int slot = runs->slot[s];
            if (hi <= lo || table->first[slot + 1] <= table->first[slot]) continue;
            const int n = (hi - lo + LORA_TILE - 1) / LORA_TILE;
            if (it < seen + n) {
                tile = it - seen;
                break;
            }
            seen += n;
        }
        const int r0 = lo + tile * LORA_TILE;
        const int T = hi - r0 < LORA_TILE ? hi - r0 : LORA_TILE;
        const int64_t local = r0 - first_row;
        float u[LORA_TILE * LORA_MAX_RANK];
        const int slot = runs->slot[s];
        /* the tile's x in float32: bfloat16 rows widened once for all its pieces (exact), on
         * the stack up to LORA_STACK_X floats */
        float stack_x[LORA_STACK_X];
        const float *xt = (const float *)x + local * ldx;
        int64_t ldt = ldx;
        float *widened = NULL;
        if (bf16) {
            const int64_t n = (int64_t)T * k;
            widened = n <= LORA_STACK_X ? stack_x : malloc((size_t)n * sizeof(float));
            if (widened == NULL) abort(); /* never an update left out */
            const uint16_t *xb = (const uint16_t *)x + local * ldx;
            for (int t = 0; t < T; t++)
                for (int kk = 0; kk < k; kk++)
                    widened[(int64_t)t * k + kk] = lora_widen(xb[t * ldx + kk]);
            xt = widened, ldt = k;
        }
        for (int q = table->first[slot]; q < table->first[slot + 1]; q++) {
            const struct lora_piece *p = table->pieces + q;
            lora_shrink(p, xt, ldt, k, T, u);
            lora_expand(p, u, T, (char *)out + local * ldo * (bf16 ? 2 : 4), ldo, bf16);
        }
        if (widened != stack_x) free(widened);
    }
}

#endif
