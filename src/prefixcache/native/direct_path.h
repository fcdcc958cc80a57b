/* The direct attention path for one head_dim (AVX-512 or portable vector code; included by attention.c once per head_dim
 * it supports, like a C++ template): HD is the head_dim, D_(name) the name of this head_dim's
 * copy of a function, PVR the rows per P V register tile (24 accumulators: PVR x HD / 16). What
 * does not depend on the head_dim is defined by the first inclusion only (DIRECT_COMMON is set
 * after it). The kernels themselves are described in attention.c. */

static inline int64_t D_(panel_floats)(int rows) {
    return (int64_t)(rows + PANEL - 1) / PANEL * PANEL * HD;
}

/* Floats of per-thread scratch `direct_tiles` and `direct_decode` need for tiles of tile_rows
 * rows. */
static int64_t D_(direct_floats)(int tile_rows) {
    const int64_t ld = (tile_rows + LANES - 1) / LANES * LANES;
    return KEY_BLOCK * ld + GROUP_TILES * (D_(panel_floats)(tile_rows) + ld * HD) +
           2 * KEY_BLOCK * HD /* a bfloat16 cache's key block, widened */
           + KEY_BLOCK / 2 * (ld + HD); /* or its probabilities and V, paired */
}

#ifndef DIRECT_COMMON
static inline vfloat load_vec(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void store_vec(float *p, vfloat v) { memcpy(p, &v, sizeof v); }
static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }

/* Per-lane selections: AVX-512's mask registers, or (portable code) lanes of all ones. A lane
 * mask's lanes are the rows of a row vector. */
#ifdef __AVX512F__
typedef __mmask16 lanes;
static inline vfloat splat(float x) { return (vfloat)_mm512_set1_ps(x); }
static inline lanes no_lanes(void) { return 0; }
static inline int any_lane(lanes m) { return m != 0; }
static inline int lane_in(lanes m, int l) { return (m >> l) & 1; }
static inline lanes lanes_greater(vfloat a, vfloat b) {
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ);
}
/* lanes whose last seen key (`last`) is at or after `key` */
static inline lanes lanes_seeing(int key, vfloat last) {
    return _mm512_cmp_ps_mask(_mm512_set1_ps((float)key), (__m512)last, _CMP_LE_OQ);
}
static inline vfloat zero_outside(lanes m, vfloat x) { return (vfloat)_mm512_maskz_mov_ps(m, (__m512)x); }
static inline vfloat max_vec(vfloat a, vfloat b) { return (vfloat)_mm512_max_ps((__m512)a, (__m512)b); }
/* max(a, b) in the lanes of m, a elsewhere */
static inline vfloat max_inside(vfloat a, lanes m, vfloat b) {
    return (vfloat)_mm512_mask_max_ps((__m512)a, m, (__m512)a, (__m512)b);
}
#else
typedef vint lanes;
static inline vfloat splat(float x) { return (vfloat){0} + x; }
static inline lanes no_lanes(void) { return (lanes){0}; }
static inline int any_lane(lanes m) {
    for (int l = 0; l < LANES; l++)
        if (m[l]) return 1;
    return 0;
}
static inline int lane_in(lanes m, int l) { return m[l] != 0; }
static inline lanes lanes_greater(vfloat a, vfloat b) { return a > b; }
static inline lanes lanes_seeing(int key, vfloat last) { return splat((float)key) <= last; }
static inline vfloat zero_outside(lanes m, vfloat x) { return (vfloat)((vint)x & m); }
static inline vfloat select_lanes(lanes m, vfloat a, vfloat b) { /* a in m, b elsewhere */
    return (vfloat)(((vint)a & m) | ((vint)b & ~m));
}
static inline vfloat max_vec(vfloat a, vfloat b) { return select_lanes(a > b, a, b); }
static inline vfloat max_inside(vfloat a, lanes m, vfloat b) {
    return select_lanes(m & (a > b), a, select_lanes(m, b, a));
}
#endif
#endif

static inline void D_(prefetch_row)(const float *row) {
    for (int c = 0; c < HD * (int)sizeof(float); c += 64) prefetch((const char *)row + c);
}

/* st[i][0 .. 16 nv) = sum_d k_rows[i][d] * qt[d][0 .. 16 nv), i < nk; nk and nv constants
 * after inlining, so the accumulators live in registers */
static inline __attribute__((always_inline)) void D_(qk_tile)(const float *const *k_rows,
                                                          const float *qt, int ldq, float *st,
                                                          int lds, int nk, int nv) {
    vfloat acc[QK_KEYS][QK_VECS];
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = (vfloat){0};
    for (int d = 0; d < HD; d++) {
        vfloat b[QK_VECS];
        for (int v = 0; v < nv; v++) b[v] = load_vec(qt + (int64_t)d * ldq + v * LANES);
        for (int i = 0; i < nk; i++) {
            const vfloat a = splat(k_rows[i][d]);
            for (int v = 0; v < nv; v++) acc[i][v] = fmadd(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) store_vec(st + (int64_t)i * lds + v * LANES, acc[i][v]);
}

/* scores of nk keys (QK_KEYS or 1) against all nvec row vectors; qt in panels */
static void D_(qk_keys)(const float *const *k_rows, const float *qt, int ld, float *st, int nk,
                    int nvec) {
    int v = 0;
    for (; v + QK_VECS <= nvec; v += QK_VECS) {
        const float *panel = qt + (int64_t)(v / QK_VECS) * HD * PANEL;
        if (nk == QK_KEYS) D_(qk_tile)(k_rows, panel, PANEL, st + v * LANES, ld, QK_KEYS, QK_VECS);
        else D_(qk_tile)(k_rows, panel, PANEL, st + v * LANES, ld, 1, QK_VECS);
    }
    for (; v < nvec; v++) {
        const float *col = qt + (int64_t)(v / QK_VECS) * HD * PANEL + v % QK_VECS * LANES;
        if (nk == QK_KEYS) D_(qk_tile)(k_rows, col, PANEL, st + v * LANES, ld, QK_KEYS, 1);
        else D_(qk_tile)(k_rows, col, PANEL, st + v * LANES, ld, 1, 1);
    }
}

/* o[r0 .. r0 + nr) (+)= sum over keys j0 .. j1 of P^T[j][r] * V row j; o: [rows, D]; `first`
 * starts the sums at zero */
static inline __attribute__((always_inline)) void D_(pv_tile)(const float *pt, int ldp, int r0,
                                                          int j0, int j1,
                                                          const float *const *v_rows, float *o,
                                                          int first, int nr) {
    enum { NV = HD / LANES };
    vfloat acc[PVR][NV];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            acc[i][k] = first ? (vfloat){0} : load_vec(o + (int64_t)(r0 + i) * HD + k * LANES);
    for (int j = j0; j < j1; j++) {
        const float *v = v_rows[j - j0], *p = pt + (int64_t)j * ldp + r0;
        vfloat row[NV];
        for (int k = 0; k < NV; k++) row[k] = load_vec(v + k * LANES);
        for (int i = 0; i < nr; i++) {
            const vfloat w = splat(p[i]);
            for (int k = 0; k < NV; k++) acc[i][k] = fmadd(w, row[k], acc[i][k]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            store_vec(o + (int64_t)(r0 + i) * HD + k * LANES, acc[i][k]);
}

#ifndef DIRECT_COMMON
/* The cache rows of one kv head: row j of K (or V) is at base + slots[j] * stride. */
struct head_rows {
    const float *k, *v;
    const int64_t *slots;
    int64_t stride;
};
#endif

#ifndef DIRECT_COMMON
static inline const float *k_row(const struct head_rows *hr, int j) { return hr->k + hr->slots[j] * hr->stride; }
static inline const float *v_row(const struct head_rows *hr, int j) { return hr->v + hr->slots[j] * hr->stride; }
#endif

/* st rows 0 .. nk = scores of keys b0 .. b0 + nk against the tile's rows; keys up to `keys`
 * exist, so the K rows one register tile ahead are prefetched while it can */
static __attribute__((noinline)) void D_(qk_block)(const struct head_rows *hr, int b0, int nk,
                                               int keys, const float *qt, int ld, float *st) {
    const float *k_rows[QK_KEYS];
    int j = 0;
    for (; j + QK_KEYS <= nk; j += QK_KEYS) {
        for (int i = 0; i < QK_KEYS; i++) k_rows[i] = k_row(hr, b0 + j + i);
        if (b0 + j + 2 * QK_KEYS <= keys)
            for (int i = 0; i < QK_KEYS; i++) D_(prefetch_row)(k_row(hr, b0 + j + QK_KEYS + i));
        D_(qk_keys)(k_rows, qt, ld, st + (int64_t)j * ld, QK_KEYS, ld / LANES);
    }
    for (; j < nk; j++) {
        k_rows[0] = k_row(hr, b0 + j);
        D_(qk_keys)(k_rows, qt, ld, st + (int64_t)j * ld, 1, ld / LANES);
    }
}

#ifndef DIRECT_COMMON
/* A tile's softmax state: per row vector the running max and sum, and the last key each row
 * sees (its own token: keys `open` .. are the tile's own tokens, seen causally). Keys are
 * counted from the tile's rows (`head_rows`), which begin at key `start` of the sequence: 0,
 * or a multiple of KEY_BLOCK where a decode row continues the state its shared keys left. */
struct tile_state {
    int rows, ld, m, t0, open, keys, start;
    float *qt, *o; /* Q^T panels; output sums [rows, D] */
    vfloat max[MAX_TILE_VECS], sum[MAX_TILE_VECS], last[MAX_TILE_VECS];
};
#endif

#ifndef DIRECT_COMMON
/* x where the rows of vector v see key `key`, else 0 */
static inline vfloat seen_only(vfloat x, int key, const struct tile_state *ts, int v) {
    if (key < ts->open) return x;
    return zero_outside(lanes_seeing(key, ts->last[v]), x);
}
#endif

/* The block's scores st [nk, ld] (keys b0 ..) become exp(scale * (s - max)), with max the
 * row's running max updated by this block (0 for keys the row does not see); the running sums
 * and, where a row's max grew, its output sums so far are rescaled to the new max. */
static __attribute__((noinline)) void D_(softmax_block)(float *st, int b0, int nk,
                                                    struct tile_state *ts, float scale) {
    const int ld = ts->ld, masked = b0 + nk > ts->open;
    for (int v = 0; v < ld / LANES; v++) {
        float *col = st + v * LANES;
        vfloat mx = ts->max[v];
        for (int j = 0; j < nk; j++) {
            const vfloat s = load_vec(col + (int64_t)j * ld);
            if (masked && b0 + j >= ts->open)
                mx = max_inside(mx, lanes_seeing(b0 + j, ts->last[v]), s);
            else mx = max_vec(mx, s);
        }
        const lanes grew = ts->start + b0 ? lanes_greater(mx, ts->max[v]) : no_lanes();
        if (any_lane(grew)) {
            const vfloat alpha = exp_nonpositive((ts->max[v] - mx) * scale);
            ts->sum[v] *= alpha;
            for (int l = 0; l < LANES; l++) {
                const int r = v * LANES + l;
                if (!lane_in(grew, l) || r >= ts->rows) continue;
                const vfloat a = splat(alpha[l]);
                for (int k = 0; k < HD; k += LANES) {
                    float *p = ts->o + (int64_t)r * HD + k;
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
                const vfloat x0 = exp_nonpositive(fmadd(load_vec(a), splat(scale), shift));
                const vfloat x1 = exp_nonpositive(fmadd(load_vec(b), splat(scale), shift));
                store_vec(a, x0);
                store_vec(b, x1);
                sum0 += x0;
                sum1 += x1;
            }
        else
            for (; j + 2 <= nk; j += 2) {
                float *a = col + (int64_t)j * ld, *b = a + ld;
                const vfloat x0 = seen_only(exp_nonpositive(fmadd(load_vec(a), splat(scale), shift)), b0 + j, ts, v);
                const vfloat x1 = seen_only(exp_nonpositive(fmadd(load_vec(b), splat(scale), shift)), b0 + j + 1, ts, v);
                store_vec(a, x0);
                store_vec(b, x1);
                sum0 += x0;
                sum1 += x1;
            }
        if (j < nk) {
            float *a = col + (int64_t)j * ld;
            const vfloat x = seen_only(exp_nonpositive(fmadd(load_vec(a), splat(scale), shift)), b0 + j, ts, v);
            store_vec(a, x);
            sum0 += x;
        }
        ts->sum[v] += sum0 + sum1;
    }
}

/* o (+)= P V over the block's nk keys (rows v_rows); the next block's next_n V rows (keys
 * from `next`) are prefetched a few per row tile */
static __attribute__((noinline)) void D_(pv_block)(const float *st, int ld, int rows, int nk,
                                               const float *const *v_rows, float *o, int first,
                                               const struct head_rows *hr, int next,
                                               int next_n) {
    const int per_tile = PVR * next_n / rows + 1;
    int r0 = 0, p = 0;
    for (; r0 + PVR <= rows; r0 += PVR) {
        for (const int stop = p + per_tile < next_n ? p + per_tile : next_n; p < stop; p++)
            D_(prefetch_row)(v_row(hr, next + p));
        D_(pv_tile)(st, ld, r0, 0, nk, v_rows, o, first, PVR);
    }
    for (; r0 < rows; r0++) D_(pv_tile)(st, ld, r0, 0, nk, v_rows, o, first, 1);
}

#ifdef __AVX512BF16__
#ifndef DIRECT_COMMON
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
#endif

#ifndef DIRECT_COMMON
typedef uint16_t bf16_t;
#endif

#ifndef DIRECT_COMMON
/* lane l of the result: a[l] in the low half, b[l] in the high half (a, b: 16 bfloat16 each) */
static inline __m512i interleave16(__m256i a, __m256i b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}
#endif

#ifndef DIRECT_COMMON
/* float32 -> bfloat16, round to nearest even (the values are finite) */
static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#endif

#ifndef DIRECT_COMMON
static inline bf16_t to_bf16_1(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#endif

#ifndef DIRECT_COMMON
static inline const bf16_t *k_row16(const struct head_rows *hr, int j) {
    return (const bf16_t *)hr->k + hr->slots[j] * hr->stride;
}
static inline const bf16_t *v_row16(const struct head_rows *hr, int j) {
    return (const bf16_t *)hr->v + hr->slots[j] * hr->stride;
}
#endif

/* st[i][0 .. 16 nv) = sum_p k_rows[i] pair p . qp[p][0 .. 16 nv) */
static inline __attribute__((always_inline)) void D_(qk_tile16)(const bf16_t *const *k_rows,
                                                            const uint32_t *qp, int ldq,
                                                            float *st, int lds, int nk, int nv) {
    __m512 acc[QK_KEYS][QK_VECS];
    for (int i = 0; i < nk; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = _mm512_setzero_ps();
    for (int p = 0; p < HD / 2; p++) {
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

static void D_(qk_keys16)(const bf16_t *const *k_rows, const uint32_t *qp, int ld, float *st, int nk,
                      int nvec) {
    enum { PANEL_LANES = HD / 2 * PANEL };
    int v = 0;
    for (; v + QK_VECS <= nvec; v += QK_VECS) {
        const uint32_t *panel = qp + (int64_t)(v / QK_VECS) * PANEL_LANES;
        if (nk == QK_KEYS) D_(qk_tile16)(k_rows, panel, PANEL, st + v * LANES, ld, QK_KEYS, QK_VECS);
        else D_(qk_tile16)(k_rows, panel, PANEL, st + v * LANES, ld, 1, QK_VECS);
    }
    for (; v < nvec; v++) {
        const uint32_t *col = qp + (int64_t)(v / QK_VECS) * PANEL_LANES + v % QK_VECS * LANES;
        if (nk == QK_KEYS) D_(qk_tile16)(k_rows, col, PANEL, st + v * LANES, ld, QK_KEYS, 1);
        else D_(qk_tile16)(k_rows, col, PANEL, st + v * LANES, ld, 1, 1);
    }
}

static __attribute__((noinline)) void D_(qk_block16)(const struct head_rows *hr, int b0, int nk,
                                                 int keys, const uint32_t *qp, int ld,
                                                 float *st) {
    const bf16_t *k_rows[QK_KEYS];
    int j = 0;
    for (; j + QK_KEYS <= nk; j += QK_KEYS) {
        for (int i = 0; i < QK_KEYS; i++) k_rows[i] = k_row16(hr, b0 + j + i);
        if (b0 + j + 2 * QK_KEYS <= keys)
            for (int i = 0; i < QK_KEYS; i++)
                for (int c = 0; c < HD * 2; c += 64)
                    _mm_prefetch((const char *)k_row16(hr, b0 + j + QK_KEYS + i) + c, _MM_HINT_T0);
        D_(qk_keys16)(k_rows, qp, ld, st + (int64_t)j * ld, QK_KEYS, ld / LANES);
    }
    for (; j < nk; j++) {
        k_rows[0] = k_row16(hr, b0 + j);
        D_(qk_keys16)(k_rows, qp, ld, st + (int64_t)j * ld, 1, ld / LANES);
    }
}

/* The block's V rows b0 .. b0 + nk, two keys per 32-bit lane: vp[jp][d] = (V[2jp][d],
 * V[2jp + 1][d]), a missing odd key as zeros. */
static void D_(pair_values)(const struct head_rows *hr, int b0, int nk, uint32_t *vp) {
    for (int jp = 0; 2 * jp < nk; jp++) {
        const bf16_t *r0 = v_row16(hr, b0 + 2 * jp);
        const bf16_t *r1 = 2 * jp + 1 < nk ? v_row16(hr, b0 + 2 * jp + 1) : NULL;
        for (int k = 0; k < HD; k += LANES) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(r0 + k));
            const __m256i b = r1 ? _mm256_loadu_si256((const __m256i *)(r1 + k)) : _mm256_setzero_si256();
            _mm512_storeu_si512(vp + (int64_t)jp * HD + k, interleave16(a, b));
        }
    }
}

#ifndef DIRECT_COMMON
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
#endif

static inline __attribute__((always_inline)) void D_(pv_tile16)(const uint32_t *pp, int ldp, int r0,
                                                            int pairs, const uint32_t *vp,
                                                            float *o, int first, int nr) {
    enum { NV = HD / LANES };
    __m512 acc[PVR][NV];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            acc[i][k] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + (int64_t)(r0 + i) * HD + k * LANES);
    for (int jp = 0; jp < pairs; jp++) {
        __m512bh row[NV];
        for (int k = 0; k < NV; k++)
            row[k] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)jp * HD + k * LANES);
        for (int i = 0; i < nr; i++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)pp[(int64_t)jp * ldp + r0 + i]);
            for (int k = 0; k < NV; k++) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], w, row[k]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < NV; k++)
            _mm512_storeu_ps(o + (int64_t)(r0 + i) * HD + k * LANES, acc[i][k]);
}

static __attribute__((noinline)) void D_(pv_block16)(const uint32_t *pp, int ld, int rows, int nk,
                                                 const uint32_t *vp, float *o, int first) {
    const int pairs = (nk + 1) / 2;
    int r0 = 0;
    for (; r0 + PVR <= rows; r0 += PVR) D_(pv_tile16)(pp, ld, r0, pairs, vp, o, first, PVR);
    for (; r0 < rows; r0++) D_(pv_tile16)(pp, ld, r0, pairs, vp, o, first, 1);
}
#else
#define DOT16 0
#endif

/* kv head h's rows in caches of either dtype (k_row / v_row for float32, k_row16 / v_row16
 * for bfloat16: the stride counts elements) */
static struct head_rows D_(head_of)(const void *k_cache, const void *v_cache, int bf16,
                                const int64_t *slots, int h, int KV) {
    const int64_t offset = (int64_t)h * HD * (bf16 ? 2 : 4); /* bytes */
    const struct head_rows hr = {(const float *)((const char *)k_cache + offset),
                                 (const float *)((const char *)v_cache + offset), slots,
                                 (int64_t)KV * HD};
    return hr;
}

#ifndef DIRECT_COMMON
static const int64_t BLOCK_ROWS[KEY_BLOCK] = {
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
};
#endif

#ifndef DIRECT_COMMON
/* Where a work item's tiles live in its buffer (direct_floats): the scores of one key block,
 * GROUP_TILES Q^T panels and output sums, and a bfloat16 cache's key block, widened. */
struct direct_buf {
    float *st, *qts, *os, *k_wide, *v_wide;
    uint32_t *p_pairs, *v_pairs; /* bfloat16 products: P and V two keys per lane */
    int tile_ld;
};
#endif

static struct direct_buf D_(direct_layout)(float *buf, int tile_rows) {
    struct direct_buf b;
    b.tile_ld = (tile_rows + LANES - 1) / LANES * LANES;
    b.st = buf, b.qts = b.st + (int64_t)KEY_BLOCK * b.tile_ld;
    b.os = b.qts + GROUP_TILES * D_(panel_floats)(tile_rows);
    b.k_wide = b.os + (int64_t)GROUP_TILES * b.tile_ld * HD;
    b.v_wide = b.k_wide + KEY_BLOCK * HD;
    b.p_pairs = (uint32_t *)(b.v_wide + KEY_BLOCK * HD);
    b.v_pairs = b.p_pairs + (int64_t)KEY_BLOCK / 2 * b.tile_ld;
    return b;
}

/* Tile `slot` of the buffer: rows r = g * m + t, query head h * G + g of token t0 + t (its
 * queries at q + (t0 + t) * q_row_stride), seeing keys 0 .. open + t - 1 of `keys` (causal
 * past `open`; open == keys: every row sees every key). `pad`: zero the panel's padding rows
 * (0 where the slot's last tile had the same rows, which left them zero). */
static void D_(tile_begin)(struct tile_state *ts, const struct direct_buf *b, int slot, int tile_rows,
                       const float *q, int64_t q_row_stride, int t0, int m, int open, int keys,
                       int h, int G, int dot16, int pad) {
    enum { D = HD };
    (void)dot16; /* bfloat16 panels need AVX512_BF16 */
    ts->m = m, ts->t0 = t0, ts->rows = G * m, ts->ld = (ts->rows + LANES - 1) / LANES * LANES;
    ts->open = open, ts->keys = keys, ts->start = 0;
    ts->qt = b->qts + slot * D_(panel_floats)(tile_rows), ts->o = b->os + (int64_t)slot * b->tile_ld * D;
    const int packed = pad ? ts->ld : ts->rows;
#if DOT16
    if (dot16) /* Q^T panels of bfloat16 pairs: [D/2][PANEL] lanes per panel */
        for (int r = 0; r < packed; r++) {
            uint32_t *dst = (uint32_t *)ts->qt + (int64_t)(r / PANEL) * (D / 2) * PANEL + r % PANEL;
            uint32_t pairs[D / 2] = {0}; /* padding rows: zero queries, scores unused */
            const float *src = q + (int64_t)(t0 + r % m) * q_row_stride + (int64_t)(h * G + r / m) * D;
            int d = 0;
            for (; r < ts->rows && d + 2 * LANES <= D; d += 2 * LANES) { /* bfloat16-exact */
                const __m512i w = (__m512i)_mm512_cvtne2ps_pbh((__m512)load_vec(src + d + LANES),
                                                               (__m512)load_vec(src + d));
                memcpy(pairs + d / 2, &w, sizeof w);
            }
            if (r < ts->rows && d < D) { /* a last 16 (head_dim 16, 80) */
                const __m256i w = (__m256i)_mm512_cvtneps_pbh((__m512)load_vec(src + d));
                memcpy(pairs + d / 2, &w, sizeof w);
            }
            for (int p = 0; p < D / 2; p++) dst[(int64_t)p * PANEL] = pairs[p];
        }
    else
#endif
    for (int r = 0; r < packed; r++) {
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

/* Start loading the K and V rows of the key block at b0 (if any: b0 < keys) of `size`-byte
 * elements while the current one computes. A block's rows lie in the cache's pages wherever
 * those are, one kv head's row every KV * HD elements: the hardware prefetchers miss most of
 * them, and the register tiles' own prefetches (a few keys ahead) come too late for memory. */
static inline __attribute__((always_inline)) void D_(prefetch_block)(const struct head_rows *hr,
                                                                     int b0, int keys, int size) {
    for (int j = b0; j < b0 + KEY_BLOCK && j < keys; j++) {
        const int64_t offset = hr->slots[j] * hr->stride * size;
        for (int c = 0; c < HD * size; c += 64) {
            prefetch((const char *)hr->k + offset + c);
            prefetch((const char *)hr->v + offset + c);
        }
    }
}

/* Every key block of kv head h (rows through hr) in turn through the nt tiles. */
static void D_(tiles_over_keys)(struct tile_state *tiles, int nt, const struct head_rows *hr,
                            const struct direct_buf *b, const void *k_cache,
                            const void *v_cache, int bf16, int KV, int h, float scale) {
    enum { D = HD };
    const struct head_rows wide = {b->k_wide, b->v_wide, BLOCK_ROWS, D};
    const float *v_rows[KEY_BLOCK];
    const int keys = tiles[nt - 1].keys; /* the last tile sees the most */
#if DOT16
    if (bf16 == KV_BF16_PRODUCTS) {
        for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
            const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
            D_(prefetch_block)(hr, b0 + PREFETCH_KEYS, keys, 2);
            D_(pair_values)(hr, b0, block, b->v_pairs);
            for (int t = 0; t < nt; t++) {
                struct tile_state *ts = &tiles[t];
                if (b0 >= ts->keys) continue;
                const int nk = ts->keys - b0 < KEY_BLOCK ? ts->keys - b0 : KEY_BLOCK;
                D_(qk_block16)(hr, b0, nk, ts->keys, (const uint32_t *)ts->qt, ts->ld, b->st);
                D_(softmax_block)(b->st, b0, nk, ts, scale);
                pair_probabilities(b->st, ts->ld, nk, b->p_pairs);
                D_(pv_block16)(b->p_pairs, ts->ld, ts->rows, nk, b->v_pairs, ts->o, ts->start + b0 == 0);
            }
        }
        return;
    }
#endif
    for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
        const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
        D_(prefetch_block)(hr, b0 + PREFETCH_KEYS, keys, bf16 ? 2 : 4);
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
                D_(qk_block)(&wide, 0, nk, nk, ts->qt, ts->ld, b->st);
            else
                D_(qk_block)(hr, b0, nk, ts->keys, ts->qt, ts->ld, b->st);
            D_(softmax_block)(b->st, b0, nk, ts, scale);
            if (bf16)
                D_(pv_block)(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, ts->start + b0 == 0, &wide, 0, 0);
            else
                D_(pv_block)(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, ts->start + b0 == 0, hr, next, next_n);
        }
    }
}

/* The tile's normalised rows into out [tokens, H, D] */
static void D_(tile_end)(const struct tile_state *ts, float *out, int h, int H, int G) {
    enum { D = HD };
    for (int r = 0; r < ts->rows; r++) {
        const float f = 1.0f / ts->sum[r / LANES][r % LANES];
        float *dst = out + ((int64_t)(ts->t0 + r % ts->m) * H + h * G + r / ts->m) * D;
        for (int d = 0; d < D; d++) dst[d] = ts->o[(int64_t)r * D + d] * f;
    }
}

/* New tokens g0 .. g1 - 1 of kv head h, `group` tiles (<= GROUP_TILES) at a time: each key
 * block in turn through every tile of the group. buf: D_(direct_floats)(G * tile_tokens). A
 * bfloat16 cache's key block is widened into buf first, once for the group's tiles (16 KB,
 * in L1), and read from there. */
static void D_(direct_tiles)(const float *q, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, int bf16, const int64_t *slots, float *out, int C,
                         int T, int g0_begin, int g1, int group, int tile_tokens, int h, int H,
                         int KV, int G, float scale, float *buf) {
    enum { D = HD };
    const struct head_rows hr = D_(head_of)(k_cache, v_cache, bf16, slots, h, KV);
    const int tile_rows = G * tile_tokens;
    const struct direct_buf b = D_(direct_layout)(buf, tile_rows);
    struct tile_state tiles[GROUP_TILES];
    for (int g0 = g0_begin; g0 < g1; g0 += group * tile_tokens) {
        int nt = 0;
        for (int t0 = g0; t0 < g1 && nt < group; t0 += tile_tokens, nt++) {
            const int m = T - t0 < tile_tokens ? T - t0 : tile_tokens;
            D_(tile_begin)(&tiles[nt], &b, nt, tile_rows, q, q_row_stride, t0, m, C + t0, C + t0 + m,
                       h, G, bf16 == KV_BF16_PRODUCTS, 1);
        }
        D_(tiles_over_keys)(tiles, nt, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
        for (int t = 0; t < nt; t++) D_(tile_end)(&tiles[t], out, h, H, G);
    }
}

#ifndef DIRECT_COMMON
/* A decode work item's partial result (attention.c's `decode`): for its rows r = g * nb + b
 * (query head h * G + g of sequence b0 + b), the output sums o [rows, D] over the keys it saw,
 * not normalised, their running max (raw scores) and sum; merged by `merge_parts`. */
struct decode_part {
    float *o, *max, *sum;
};

/* The tile's running max and sum of row r into part p, row pr */
static inline void keep_row_state(const struct tile_state *ts, int r, struct decode_part p, int pr) {
    p.max[pr] = ts->max[r / LANES][r % LANES], p.sum[pr] = ts->sum[r / LANES][r % LANES];
}
#endif

/* Sequences b0 .. b0 + nb - 1 of kv head h as one tile (rows g * nb + b) over the shared keys
 * k0 .. k1 - 1 (shared_slots), straight from the cache in key blocks as above, into part p.
 * buf: D_(direct_floats)(G * nb). */
static void D_(decode_shared)(const float *q, int64_t q_row_stride, const void *k_cache,
                              const void *v_cache, int bf16, const int64_t *shared_slots, int k0,
                              int k1, int b0, int nb, int h, int KV, int G, float scale,
                              float *buf, struct decode_part p) {
    const struct head_rows hr = D_(head_of)(k_cache, v_cache, bf16, shared_slots + k0, h, KV);
    const struct direct_buf b = D_(direct_layout)(buf, G * nb);
    const int keys = k1 - k0;
    struct tile_state ts;
    D_(tile_begin)(&ts, &b, 0, G * nb, q, q_row_stride, b0, nb, keys, keys, h, G,
                   bf16 == KV_BF16_PRODUCTS, 1);
    ts.o = p.o; /* the output sums go straight to the part */
    D_(tiles_over_keys)(&ts, 1, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
    for (int r = 0; r < ts.rows; r++) keep_row_state(&ts, r, p, r);
}

/* The same sequences over each one's own tail keys (tail_lens[b] of them at tail_slots[b *
 * max_tail ..]): a tile of its G rows per sequence, into part p's rows g * nb + b. */
static void D_(decode_tails)(const float *q, int64_t q_row_stride, const void *k_cache,
                             const void *v_cache, int bf16, const int64_t *tail_slots,
                             const int *tail_lens, int max_tail, int b0, int nb, int h, int KV,
                             int G, float scale, float *buf, struct decode_part p) {
    enum { D = HD };
    const struct direct_buf b = D_(direct_layout)(buf, G * nb);
    struct tile_state tail;
    for (int t = 0; t < nb; t++) {
        const int len = tail_lens[b0 + t];
        const struct head_rows tr = D_(head_of)(k_cache, v_cache, bf16,
                                                tail_slots + (int64_t)(b0 + t) * max_tail, h, KV);
        D_(tile_begin)(&tail, &b, 0, G * nb, q, q_row_stride, b0 + t, 1, len, len, h, G,
                       bf16 == KV_BF16_PRODUCTS, t == 0);
        D_(tiles_over_keys)(&tail, 1, &tr, &b, k_cache, v_cache, bf16, KV, h, scale);
        for (int g = 0; g < G; g++) {
            memcpy(p.o + (int64_t)(g * nb + t) * D, tail.o + (int64_t)g * D, D * sizeof(float));
            keep_row_state(&tail, g, p, g * nb + t);
        }
    }
}

/* Sequences b0 .. b0 + nb - 1 of kv head h, each row's keys taken exactly as a prefill row
 * takes them (`tiles_over_keys`: key blocks of KEY_BLOCK from key 0, one online-softmax state
 * carried through), so a decode row's result is the same bits as the prefill of that token
 * and does not depend on the other sequences of the step. The shared keys, down to a whole
 * number of key blocks (`aligned`), are read once for all the item's rows as one tile; each
 * sequence's tile then takes over its rows' state and continues over the rest of the shared
 * keys and its own tail, whose slots it lists in `rest` (KEY_BLOCK + max_tail of them). */
static void D_(decode_rows)(const float *q, int64_t q_row_stride, const void *k_cache,
                            const void *v_cache, int bf16, const int64_t *shared_slots,
                            int shared, const int64_t *tail_slots, const int *tail_lens,
                            int max_tail, float *out, int b0, int nb, int h, int H, int KV,
                            int G, float scale, float *buf, int64_t *rest) {
    enum { D = HD };
    const struct direct_buf b = D_(direct_layout)(buf, G * nb);
    const int aligned = shared / KEY_BLOCK * KEY_BLOCK, dot16 = bf16 == KV_BF16_PRODUCTS;
    struct tile_state all, seq;
    if (aligned > 0) {
        const struct head_rows hr = D_(head_of)(k_cache, v_cache, bf16, shared_slots, h, KV);
        D_(tile_begin)(&all, &b, 0, G * nb, q, q_row_stride, b0, nb, aligned, aligned, h, G,
                       dot16, 1);
        D_(tiles_over_keys)(&all, 1, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
    }
    for (int t = 0; t < nb; t++) {
        const int before = shared - aligned, own = tail_lens[b0 + t], len = before + own;
        memcpy(rest, shared_slots + aligned, (size_t)before * sizeof *rest);
        memcpy(rest + before, tail_slots + (int64_t)(b0 + t) * max_tail, (size_t)own * sizeof *rest);
        const struct head_rows tr = D_(head_of)(k_cache, v_cache, bf16, rest, h, KV);
        D_(tile_begin)(&seq, &b, 1, G * nb, q, q_row_stride, b0 + t, 1, len, len, h, G, dot16,
                       t == 0);
        if (aligned > 0) { /* row g of this tile is row g * nb + t of the shared one */
            seq.start = aligned;
            for (int g = 0; g < G; g++) {
                const int r = g * nb + t;
                seq.max[g / LANES][g % LANES] = all.max[r / LANES][r % LANES];
                seq.sum[g / LANES][g % LANES] = all.sum[r / LANES][r % LANES];
                memcpy(seq.o + (int64_t)g * D, all.o + (int64_t)r * D, D * sizeof(float));
            }
        }
        D_(tiles_over_keys)(&seq, 1, &tr, &b, k_cache, v_cache, bf16, KV, h, scale);
        D_(tile_end)(&seq, out, h, H, G);
    }
}
