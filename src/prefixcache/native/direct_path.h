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
    return KEY_BLOCK * ld + GROUP_TILES * (D_(panel_floats)(tile_rows) + 2 * ld * HD) +
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
/* The cache rows of one kv head: row j of K (or V) is at base + slots[j] * stride bytes. */
struct head_rows {
    const float *k, *v;
    const int64_t *slots;
    int64_t stride; /* bytes */
};
#endif

#ifndef DIRECT_COMMON
static inline const float *k_row(const struct head_rows *hr, int j) {
    return (const float *)((const char *)hr->k + hr->slots[j] * hr->stride);
}
static inline const float *v_row(const struct head_rows *hr, int j) {
    return (const float *)((const char *)hr->v + hr->slots[j] * hr->stride);
}
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
/* A tile's softmax state: per row vector the running max and sum of the current segment (its
 * keys since the last multiple of SEGMENT_KEYS), and the last key each row sees (its own token:
 * keys `open` .. are the tile's own tokens, seen causally); per row the segments before it,
 * merged (`merge_segment`: acc_max is -inf before the first). Keys are counted from the tile's
 * rows (`head_rows`), which begin at key `start` of the sequence: 0, or where a decode row
 * continues the state its shared keys left. */
struct tile_state {
    int rows, ld, m, t0, open, keys, start;
    float *qt, *o, *acc_o; /* Q^T panels; output sums [rows, D], and the earlier segments' */
    vfloat max[MAX_TILE_VECS], sum[MAX_TILE_VECS], last[MAX_TILE_VECS];
    float acc_max[MAX_TILE_VECS * LANES], acc_sum[MAX_TILE_VECS * LANES];
};

/* e^x of one x <= 0, by the vector exp (the same bits as a lane of it) */
static inline float exp_one(float x) { return exp_nonpositive(vsplat(x))[0]; }

/* One row's result so far (o_acc [D] unnormalised, *max_acc, *sum_acc) merged with the next
 * segment's (o, max, sum), both rescaled to the larger max: the one way every path combines a
 * row's segments, in key order, so that a decode step computing them apart and a prefill
 * computing them in turn give the same bits. The first segment is copied (*max_acc -inf). */
static void merge_segment(float *o_acc, float *max_acc, float *sum_acc, const float *o,
                          float max, float sum, int D, float scale) {
    if (*max_acc == -INFINITY) {
        memcpy(o_acc, o, (size_t)D * sizeof(float));
        *max_acc = max, *sum_acc = sum;
        return;
    }
    const float top = *max_acc > max ? *max_acc : max;
    const float before = exp_one((*max_acc - top) * scale), after = exp_one((max - top) * scale);
    *sum_acc = before * *sum_acc + after * sum;
    for (int d = 0; d < D; d++) o_acc[d] = before * o_acc[d] + after * o[d];
    *max_acc = top;
}
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
        const int first = (ts->start + b0) % SEGMENT_KEYS == 0; /* max -inf: nothing to rescale */
        const lanes grew = first ? no_lanes() : lanes_greater(mx, ts->max[v]);
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
    return (const bf16_t *)((const char *)hr->k + hr->slots[j] * hr->stride);
}
static inline const bf16_t *v_row16(const struct head_rows *hr, int j) {
    return (const bf16_t *)((const char *)hr->v + hr->slots[j] * hr->stride);
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

/* A quantized cache's row (`load_row`'s values) rounded to bfloat16 into dst [HD], a block's
 * two vectors at a time, in registers from the bytes to the rounded values */
static inline __attribute__((always_inline)) void D_(load_row16)(bf16_t *dst, const void *cache,
                                                                 int64_t row, int fmt) {
    const int layout = kv_layout(fmt), block_bytes = (int)kv_row_bytes(QBLOCK, layout);
    const char *src = (const char *)cache + row * kv_row_bytes(HD, layout);
    for (int b = 0; b < HD / QBLOCK; b++, src += block_bytes) {
        uint16_t h;
        memcpy(&h, src, 2);
        float wide[QBLOCK];
        dequant_block(wide, (const uint8_t *)src + 2, half_to_float(h), layout);
        const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(wide + LANES),
                                                  _mm512_loadu_ps(wide));
        _mm512_storeu_si512(dst + b * QBLOCK, (__m512i)pair);
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

/* kv head h's rows in caches of any layout (`kv_quant.h`: k_row / v_row read float32 rows,
 * k_row16 / v_row16 bfloat16 ones; the other layouts' rows are read by `load_row`) */
static struct head_rows D_(head_of)(const void *k_cache, const void *v_cache, int bf16,
                                const int64_t *slots, int h, int KV) {
    const int64_t row = kv_row_bytes(HD, bf16), offset = (int64_t)h * row; /* bytes */
    const struct head_rows hr = {(const float *)((const char *)k_cache + offset),
                                 (const float *)((const char *)v_cache + offset), slots,
                                 (int64_t)KV * row};
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
 * GROUP_TILES Q^T panels, output sums and earlier segments' sums, and a bfloat16 cache's key
 * block, widened. */
struct direct_buf {
    float *st, *qts, *os, *acc_os, *k_wide, *v_wide;
    uint32_t *p_pairs, *v_pairs; /* bfloat16 products: P and V two keys per lane */
    int tile_ld;
};
#endif

static struct direct_buf D_(direct_layout)(float *buf, int tile_rows) {
    struct direct_buf b;
    b.tile_ld = (tile_rows + LANES - 1) / LANES * LANES;
    b.st = buf, b.qts = b.st + (int64_t)KEY_BLOCK * b.tile_ld;
    b.os = b.qts + GROUP_TILES * D_(panel_floats)(tile_rows);
    b.acc_os = b.os + (int64_t)GROUP_TILES * b.tile_ld * HD;
    b.k_wide = b.acc_os + (int64_t)GROUP_TILES * b.tile_ld * HD;
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
    ts->acc_o = b->acc_os + (int64_t)slot * b->tile_ld * D;
    for (int r = 0; r < ts->rows; r++) ts->acc_max[r] = -INFINITY;
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

/* Start loading the K and V rows (`size` bytes each) of the key block at b0 (if any: b0 < keys)
 * while the current one computes. A block's rows lie in the cache's pages wherever
 * those are, one kv head's row every KV * HD elements: the hardware prefetchers miss most of
 * them, and the register tiles' own prefetches (a few keys ahead) come too late for memory. */
static inline __attribute__((always_inline)) void D_(prefetch_block)(const struct head_rows *hr,
                                                                     int b0, int keys, int size) {
    for (int j = b0; j < b0 + KEY_BLOCK && j < keys; j++) {
        const int64_t offset = hr->slots[j] * hr->stride;
        for (int c = 0; c < size; c += 64) {
            prefetch((const char *)hr->k + offset + c);
            prefetch((const char *)hr->v + offset + c);
        }
    }
}

/* At a segment's end: each row that saw keys in it merges them into its earlier segments, and
 * the running max and sum start again (the output sums do at the next block: `first`). */
static void D_(close_segment)(struct tile_state *ts, float scale) {
    for (int r = 0; r < ts->rows; r++) {
        const float max = ts->max[r / LANES][r % LANES];
        if (max == -INFINITY) continue; /* a causal row whose keys ended before this segment */
        merge_segment(ts->acc_o + (int64_t)r * HD, &ts->acc_max[r], &ts->acc_sum[r],
                      ts->o + (int64_t)r * HD, max, ts->sum[r / LANES][r % LANES], HD, scale);
    }
    for (int v = 0; v < ts->ld / LANES; v++) ts->max[v] = splat(-INFINITY), ts->sum[v] = (vfloat){0};
}

/* Every key block of kv head h (rows through hr) in turn through the nt tiles; a tile's rows
 * start a new segment at every multiple of SEGMENT_KEYS (`close_segment`). */
static void D_(tiles_over_keys)(struct tile_state *tiles, int nt, const struct head_rows *hr,
                            const struct direct_buf *b, const void *k_cache,
                            const void *v_cache, int bf16, int KV, int h, float scale) {
    enum { D = HD };
    const struct head_rows wide = {b->k_wide, b->v_wide, BLOCK_ROWS, D * (int64_t)sizeof(float)};
    const float *v_rows[KEY_BLOCK];
    const int keys = tiles[nt - 1].keys; /* the last tile sees the most */
#if DOT16
    if (kv_products(bf16)) {
        /* a quantized block dequantized, then rounded to bfloat16 into the wide buffers */
        const int quantized = kv_quantized(bf16);
        const struct head_rows wide16 = {b->k_wide, b->v_wide, BLOCK_ROWS, D * 2};
        const struct head_rows *rows = quantized ? &wide16 : hr;
        for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
            const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
            D_(prefetch_block)(hr, b0 + PREFETCH_KEYS, keys, (int)kv_row_bytes(HD, bf16));
            if (quantized)
                for (int j = 0; j < block; j++) {
                    const int64_t src = hr->slots[b0 + j] * KV + h;
                    D_(load_row16)((bf16_t *)b->k_wide + j * D, k_cache, src, bf16);
                    D_(load_row16)((bf16_t *)b->v_wide + j * D, v_cache, src, bf16);
                }
            const int r0 = quantized ? 0 : b0;
            D_(pair_values)(rows, r0, block, b->v_pairs);
            for (int t = 0; t < nt; t++) {
                struct tile_state *ts = &tiles[t];
                if (b0 >= ts->keys) continue;
                const int first = (ts->start + b0) % SEGMENT_KEYS == 0;
                if (first && b0 > 0) D_(close_segment)(ts, scale);
                const int nk = ts->keys - b0 < KEY_BLOCK ? ts->keys - b0 : KEY_BLOCK;
                D_(qk_block16)(rows, r0, nk, quantized ? nk : ts->keys,
                               (const uint32_t *)ts->qt, ts->ld, b->st);
                D_(softmax_block)(b->st, b0, nk, ts, scale);
                pair_probabilities(b->st, ts->ld, nk, b->p_pairs);
                D_(pv_block16)(b->p_pairs, ts->ld, ts->rows, nk, b->v_pairs, ts->o, first);
            }
        }
        return;
    }
#endif
    for (int b0 = 0; b0 < keys; b0 += KEY_BLOCK) {
        const int block = keys - b0 < KEY_BLOCK ? keys - b0 : KEY_BLOCK;
        D_(prefetch_block)(hr, b0 + PREFETCH_KEYS, keys, (int)kv_row_bytes(HD, bf16));
        if (bf16)
            for (int j = 0; j < block; j++) {
                const int64_t src = hr->slots[b0 + j] * KV + h;
                load_row(b->k_wide + j * D, k_cache, src, D, bf16);
                load_row(b->v_wide + j * D, v_cache, src, D, bf16);
                v_rows[j] = b->v_wide + j * D;
            }
        else
            for (int j = 0; j < block; j++) v_rows[j] = v_row(hr, b0 + j);
        for (int t = 0; t < nt; t++) {
            struct tile_state *ts = &tiles[t];
            if (b0 >= ts->keys) continue;
            const int first = (ts->start + b0) % SEGMENT_KEYS == 0;
            if (first && b0 > 0) D_(close_segment)(ts, scale);
            const int nk = ts->keys - b0 < KEY_BLOCK ? ts->keys - b0 : KEY_BLOCK;
            const int next = b0 + KEY_BLOCK, next_n = t == 0 && next < keys ? (keys - next < KEY_BLOCK ? keys - next : KEY_BLOCK) : 0;
            if (bf16)
                D_(qk_block)(&wide, 0, nk, nk, ts->qt, ts->ld, b->st);
            else
                D_(qk_block)(hr, b0, nk, ts->keys, ts->qt, ts->ld, b->st);
            D_(softmax_block)(b->st, b0, nk, ts, scale);
            if (bf16)
                D_(pv_block)(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, first, &wide, 0, 0);
            else
                D_(pv_block)(b->st, ts->ld, ts->rows, nk, v_rows, ts->o, first, hr, next, next_n);
        }
    }
}

#ifndef DIRECT_COMMON
/* Output sums o [D] over their weights' sum, into dst: every path's last step */
static inline void normalised(float *dst, const float *o, float sum, int D) {
    const float f = 1.0f / sum;
    for (int d = 0; d < D; d++) dst[d] = o[d] * f;
}
#endif

/* The tile's rows, their last segment merged, normalised into out [tokens, H, D] */
static void D_(tile_end)(struct tile_state *ts, float *out, int h, int H, int G, float scale) {
    enum { D = HD };
    D_(close_segment)(ts, scale);
    for (int r = 0; r < ts->rows; r++) {
        float *dst = out + ((int64_t)(ts->t0 + r % ts->m) * H + h * G + r / ts->m) * D;
        normalised(dst, ts->acc_o + (int64_t)r * D, ts->acc_sum[r], D);
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
                       h, G, kv_products(bf16), 1);
        }
        D_(tiles_over_keys)(tiles, nt, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
        for (int t = 0; t < nt; t++) D_(tile_end)(&tiles[t], out, h, H, G, scale);
    }
}

#ifndef DIRECT_COMMON
/* A decode work item's result over one segment of keys (attention.c's `decode`): for its rows
 * r = g * nb + b (query head h * G + g of sequence b0 + b), the output sums o [rows, D] over the
 * segment's keys, not normalised, their max (raw scores; -inf: the row has no keys there) and
 * sum; merged in key order by `merge_segment`. */
struct decode_part {
    float *o, *max, *sum;
};

/* The tile's running max and sum of row r into part p, row pr */
static inline void keep_row_state(const struct tile_state *ts, int r, struct decode_part p, int pr) {
    p.max[pr] = ts->max[r / LANES][r % LANES], p.sum[pr] = ts->sum[r / LANES][r % LANES];
}
#endif

/* Sequences b0 .. b0 + nb - 1 of kv head h over segment s of their keys (keys s * SEGMENT_KEYS
 * up to the next multiple), each row's keys in the order a prefill row takes them (key blocks
 * from the segment's start, one online-softmax state), into part p: a decode row's segments are
 * the prefill row's, so its result is the same bits and does not depend on the step. The
 * segment's shared keys, down to a whole number of key blocks (`aligned`), are read once for all
 * the item's rows as one tile; each sequence's tile then takes over its rows' state and
 * continues over the rest of the shared keys and its own, whose slots it lists in `rest`
 * (SEGMENT_KEYS of them at most). buf: D_(direct_floats)(G * nb). */
static void D_(decode_segment)(const float *q, int64_t q_row_stride, const void *k_cache,
                               const void *v_cache, int bf16, const int64_t *shared_slots,
                               int shared, const int64_t *tail_slots, const int *tail_lens,
                               int max_tail, int b0, int nb, int h, int KV, int G, float scale,
                               int s, float *buf, int64_t *rest, struct decode_part p) {
    enum { D = HD };
    const struct direct_buf b = D_(direct_layout)(buf, G * nb);
    const int aligned = shared / KEY_BLOCK * KEY_BLOCK, dot16 = kv_products(bf16);
    const int k0 = s * SEGMENT_KEYS, k1 = k0 + SEGMENT_KEYS;
    const int common = (k1 < aligned ? k1 : aligned) - k0; /* <= 0: none */
    struct tile_state all, seq;
    if (common > 0) {
        const struct head_rows hr = D_(head_of)(k_cache, v_cache, bf16, shared_slots + k0, h, KV);
        D_(tile_begin)(&all, &b, 0, G * nb, q, q_row_stride, b0, nb, common, common, h, G,
                       dot16, 1);
        all.start = k0;
        if (k0 + common == k1) all.o = p.o; /* the whole segment: the sums go to the part */
        D_(tiles_over_keys)(&all, 1, &hr, &b, k_cache, v_cache, bf16, KV, h, scale);
        if (k0 + common == k1) {
            for (int r = 0; r < all.rows; r++) keep_row_state(&all, r, p, r);
            return;
        }
    }
    const int from = common > 0 ? k0 + common : k0;
    for (int t = 0; t < nb; t++) {
        const int own = tail_lens[b0 + t], len = shared + own, to = k1 < len ? k1 : len;
        if (from >= to) { /* no keys of this sequence in the segment */
            for (int g = 0; g < G; g++) p.max[g * nb + t] = -INFINITY, p.sum[g * nb + t] = 0.0f;
            continue;
        }
        for (int j = from; j < to; j++)
            rest[j - from] = j < shared ? shared_slots[j] : tail_slots[(int64_t)(b0 + t) * max_tail + j - shared];
        const struct head_rows tr = D_(head_of)(k_cache, v_cache, bf16, rest, h, KV);
        D_(tile_begin)(&seq, &b, 1, G * nb, q, q_row_stride, b0 + t, 1, to - from, to - from,
                       h, G, dot16, t == 0);
        seq.start = from;
        if (common > 0) /* row g of this tile is row g * nb + t of the shared one */
            for (int g = 0; g < G; g++) {
                const int r = g * nb + t;
                seq.max[g / LANES][g % LANES] = all.max[r / LANES][r % LANES];
                seq.sum[g / LANES][g % LANES] = all.sum[r / LANES][r % LANES];
                memcpy(seq.o + (int64_t)g * D, all.o + (int64_t)r * D, D * sizeof(float));
            }
        D_(tiles_over_keys)(&seq, 1, &tr, &b, k_cache, v_cache, bf16, KV, h, scale);
        for (int g = 0; g < G; g++) {
            memcpy(p.o + (int64_t)(g * nb + t) * D, seq.o + (int64_t)g * D, D * sizeof(float));
            keep_row_state(&seq, g, p, g * nb + t);
        }
    }
}
