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
#include <string.h>
#include <omp.h>

#include "vector_math.h"

#define LORA_TILE 4     /* rows sharing each load of A and of B */
#define LORA_COLS 64    /* output columns per pass over B (b_t's rows are padded to them) */
#define LORA_MAX_RANK 512

/* One adapter's update of output columns [col0, col0 + n) of one projection. */
struct lora_piece {
    const float *a_t; /* [k][rank_pad]: A transposed, ranks zero-padded to whole vectors */
    const float *b_t; /* [rank][n_pad]: B transposed, columns zero-padded to LORA_COLS */
    int rank, rank_pad, col0, n, n_pad;
    float scale;
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

static inline vfloat lora_load(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
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

/* u[t] = x[t] A^T for the tile's T rows (u: [T][rank_pad / LANES] vectors), x of type TYPE
 * read through WIDEN */
#define LORA_SHRINK(name, TYPE, WIDEN)                                                         \
    static void name(const struct lora_piece *p, const TYPE *x, int64_t ldx, int k, int T,   \
                     vfloat *u) {                                                             \
        const int nv = p->rank_pad / LANES;                                                   \
        for (int i = 0; i < T * nv; i++) u[i] = (vfloat){0};                                  \
        for (int kk = 0; kk < k; kk++) {                                                      \
            const float *a = p->a_t + (int64_t)kk * p->rank_pad;                              \
            for (int v = 0; v < nv; v++) {                                                    \
                const vfloat av = lora_load(a + v * LANES);                                   \
                for (int t = 0; t < T; t++)                                                   \
                    u[t * nv + v] = fmadd(vsplat(WIDEN(x[t * ldx + kk])), av, u[t * nv + v]); \
            }                                                                                 \
        }                                                                                     \
    }

#define LORA_IDENTITY(v) (v)
LORA_SHRINK(lora_shrink_f32, float, LORA_IDENTITY)
LORA_SHRINK(lora_shrink_bf16, uint16_t, lora_widen)

/* out[t, col0 + j] += (u[t] B^T)[j] * scale for the tile's T rows */
static void lora_expand(const struct lora_piece *p, const vfloat *u, int T, void *out,
                        int64_t ldo, int bf16) {
    const float *uf = (const float *)u;
    const int rank = p->rank, rank_pad = p->rank_pad;
    for (int c0 = 0; c0 < p->n; c0 += LORA_COLS) {
        vfloat acc[LORA_TILE][LORA_COLS / LANES];
        memset(acc, 0, sizeof acc);
        for (int i = 0; i < rank; i++) {
            const float *b = p->b_t + (int64_t)i * p->n_pad + c0;
            vfloat bv[LORA_COLS / LANES];
            for (int v = 0; v < LORA_COLS / LANES; v++) bv[v] = lora_load(b + v * LANES);
            for (int t = 0; t < T; t++) {
                const vfloat ui = vsplat(uf[t * rank_pad + i]);
                for (int v = 0; v < LORA_COLS / LANES; v++)
                    acc[t][v] = fmadd(ui, bv[v], acc[t][v]);
            }
        }
        const int cols = p->n - c0 < LORA_COLS ? p->n - c0 : LORA_COLS;
        for (int t = 0; t < T; t++) {
            const float *d = (const float *)acc[t];
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
        vfloat u[LORA_TILE * LORA_MAX_RANK / LANES];
        const int slot = runs->slot[s];
        for (int q = table->first[slot]; q < table->first[slot + 1]; q++) {
            const struct lora_piece *p = table->pieces + q;
            if (bf16)
                lora_shrink_bf16(p, (const uint16_t *)x + local * ldx, ldx, k, T, u);
            else
                lora_shrink_f32(p, (const float *)x + local * ldx, ldx, k, T, u);
            lora_expand(p, u, T, (char *)out + local * ldo * (bf16 ? 2 : 4), ldo, bf16);
        }
    }
}

#endif
