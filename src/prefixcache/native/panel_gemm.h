/* Panel GEMM: out [rows, n] = x [rows, k] W^T (+ bias), W [n, k] packed once into column
 * panels, float32 or bfloat16 (float32 accumulation). Included by layers.c; used through
 * prefixcache.model.panel_gemm and by the compiled layer steps.
 *
 * The weight is laid out as panels of PANEL_COLS output columns, each panel the k values of
 * its columns one after another: float32 [n / 48][k][48]; bfloat16 [n / 48][k / 2][48][2] (pairs
 * of k, the operand layout of vdpbf16ps), zero padded to whole panels and, in bfloat16, to an
 * even k. A panel (k x 48 values) stays in the core's L2 cache while every PANEL_ROWS-row tile
 * of x goes through it; a tile is 8 x 3 zmm accumulators, one weight load feeding 8 FMAs. The
 * first tile of a panel streams its weights from memory and prefetches prefetch_bytes ahead of
 * that stream; the others read them from L2. Threads split the panels, so every output value is
 * the same sequence of operations whatever the row count or thread count: a row's result does
 * not depend on the batch it is in.
 *
 * AVX-512F (float32) and AVX512_BF16 (bfloat16) kernels where the compiler targets them, else
 * AVX2 + FMA ones (ymm tiles; bfloat16 widened to float32), else plain loops (correct, slow:
 * pc_panel_isa says which are fast, and the caller picks its GEMM by timing). */
#ifndef PREFIXCACHE_PANEL_GEMM_H
#define PREFIXCACHE_PANEL_GEMM_H

#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* the ymm kernels (AVX2 and FMA): float32 where there is no AVX-512F, bfloat16 (widened) where
 * there is no AVX512_BF16 */
#if defined(__AVX2__) && defined(__FMA__)
#define PANEL_AVX2 1
#ifndef __AVX512F__
#define PANEL_AVX2_F32 1
#endif
#ifndef __AVX512BF16__
#define PANEL_AVX2_BF16 1
#endif
#endif

#define PANEL_COLS 48
#define PANEL_ROWS 8
#define PANEL_VECS (PANEL_COLS / 16)
/* How far ahead of a weight stream the first tile prefetches: set from the machine's memory
 * latency x streaming rate (prefixcache.native.machine.prefetch_bytes) when the library loads */
static int64_t prefetch_bytes = 2048;

void pc_set_prefetch_bytes(int bytes) { prefetch_bytes = bytes; }

typedef uint16_t panel_bf16_t;

/* which kernels are vectorised: bit 0 float32, bit 1 bfloat16; bits 2 and 3: those are the
 * AVX2 ones */
int pc_panel_isa(void) {
    int isa = 0;
#if defined(__AVX512F__) || defined(PANEL_AVX2_F32)
    isa |= 1;
#endif
#if defined(__AVX512BF16__) || defined(PANEL_AVX2_BF16)
    isa |= 2;
#endif
#ifdef PANEL_AVX2_F32
    isa |= 4;
#endif
#ifdef PANEL_AVX2_BF16
    isa |= 8;
#endif
    return isa;
}

static inline int panel_count(int n) { return (n + PANEL_COLS - 1) / PANEL_COLS; }
static inline int even(int k) { return k + (k & 1); }

/* elements of the packed copy of a [n, k] weight */
int64_t pc_panel_size(int n, int k) { return (int64_t)panel_count(n) * even(k) * PANEL_COLS; }

/* [n, k] values of `size` bytes -> [n / 48][k][48] */
static void panel_pack_rows(const void *w, int n, int k, size_t size, void *out) {
    char *o = out;
    for (int p = 0; p < panel_count(n); p++)
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < PANEL_COLS; j++, o += size) {
                const int col = p * PANEL_COLS + j;
                if (col < n) memcpy(o, (const char *)w + ((int64_t)col * k + kk) * size, size);
                else memset(o, 0, size);
            }
}

void pc_panel_pack(const float *w, int n, int k, float *out) {
    panel_pack_rows(w, n, k, sizeof *w, out);
}

/* bfloat16 weights for the float32 GEMM (pc_panel_gemm_bf16w): the float32 layout, 2 bytes a
 * value */
void pc_panel_pack_bf16w(const panel_bf16_t *w, int n, int k, panel_bf16_t *out) {
    panel_pack_rows(w, n, k, sizeof *w, out);
}

void pc_panel_pack_bf16(const panel_bf16_t *w, int n, int k, panel_bf16_t *out) {
    const int pairs = even(k) / 2;
    for (int p = 0; p < panel_count(n); p++)
        for (int kk = 0; kk < 2 * pairs; kk++)
            for (int j = 0; j < PANEL_COLS; j++) {
                const int col = p * PANEL_COLS + j;
                out[(((int64_t)p * pairs + kk / 2) * PANEL_COLS + j) * 2 + (kk & 1)] =
                    col < n && kk < k ? w[(int64_t)col * k + kk] : 0;
            }
}

/* the panels thread t of nt takes */
static inline void panel_share(int n, int *p0, int *p1) {
    const int np = panel_count(n), t = omp_get_thread_num(), nt = omp_get_num_threads();
    *p0 = (int)((int64_t)np * t / nt);
    *p1 = (int)((int64_t)np * (t + 1) / nt);
}

#ifdef __AVX512F__
static inline __mmask16 cols_mask(int left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* a float32 tile's finish: its rows of accumulators (+ bias) (+ beta * out) stored to out's
 * real columns */
static inline __attribute__((always_inline)) void panel_store(
    const __m512 *acc, int vecs, const float *bias, float beta, float *out, int cols) {
    for (int j = 0; j < vecs && 16 * j < cols; j++) {
        const __mmask16 mask = cols_mask(cols - 16 * j);
        float *o = out + 16 * j;
        __m512 v = acc[j];
        if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * j));
        if (beta != 0.0f)
            v = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mask, o), v);
        _mm512_mask_storeu_ps(o, mask, v);
    }
}

/* 16 weights of a panel row as float32: float32 panels, or bfloat16 ones widened (a shift) */
static inline __attribute__((always_inline)) __m512 panel_weights(const void *wk, int j,
                                                                   const int bf16w) {
    if (!bf16w) return _mm512_loadu_ps((const float *)wk + 16 * j);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const panel_bf16_t *)wk + 16 * j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* mb (constant after inlining) rows of x through one panel wp (float32, or with bf16w bfloat16
 * weights widened to float32: float32 products and sums either way); cols: the panel's real
 * columns; out = acc (+ bias) (+ beta * out) */
static inline __attribute__((always_inline)) void panel_tile(
    const float *x, int64_t ldx, const void *wp, int k, const int bf16w, const int mb,
    int prefetch, const float *bias, float beta, float *out, int64_t ldo, int cols) {
    const int64_t row_bytes = (int64_t)PANEL_COLS * (bf16w ? 2 : 4);
    __m512 acc[PANEL_ROWS][PANEL_VECS];
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < PANEL_VECS; j++) acc[m][j] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        const char *wk = (const char *)wp + kk * row_bytes;
        if (prefetch)
            for (int line = 0; line < row_bytes / 64; line++)
                _mm_prefetch(wk + 64 * line + prefetch_bytes, _MM_HINT_T0);
        if (prefetch && bf16w && (kk & 1)) _mm_prefetch(wk + 64 + prefetch_bytes, _MM_HINT_T0);
        __m512 wv[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) wv[j] = panel_weights(wk, j, bf16w);
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + kk]);
            for (int j = 0; j < PANEL_VECS; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++) panel_store(acc[m], PANEL_VECS, bias, beta, out + m * ldo, cols);
}
#endif

#ifdef __AVX512BF16__
/* the bfloat16 tile: k2 pairs of k, odd_k when the last pair has one real value */
static inline __attribute__((always_inline)) void panel_tile_bf16(
    const panel_bf16_t *x, int64_t ldx, const panel_bf16_t *wp, int k, const int mb,
    int prefetch, const panel_bf16_t *bias, panel_bf16_t *out, int64_t ldo, int cols) {
    __m512 acc[PANEL_ROWS][PANEL_VECS];
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < PANEL_VECS; j++) acc[m][j] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk += 2) {
        const panel_bf16_t *wk = wp + (int64_t)kk * PANEL_COLS;
        if (prefetch)
            for (int line = 0; line < PANEL_VECS; line++)
                _mm_prefetch((const char *)(wk + 32 * line) + prefetch_bytes, _MM_HINT_T0);
        __m512bh wv[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) {
            uint32_t pair = x[m * ldx + kk]; /* k's value in the low half, k + 1's above */
            if (kk + 1 < k) memcpy(&pair, x + m * ldx + kk, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < PANEL_VECS; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < PANEL_VECS && 16 * j < cols; j++) {
            const __mmask16 mask = cols_mask(cols - 16 * j);
            __m512 v = acc[m][j];
            if (bias != NULL) {
                const __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + 16 * j));
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
            }
            _mm256_mask_storeu_epi16(out + m * ldo + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
}
#endif

#ifdef PANEL_AVX2
/* AVX2 tiles: 16 ymm registers hold 6 rows x 16 columns (a third of a panel) of float32 sums
 * beside the two weight vectors and a broadcast, or 4 rows x 16 columns of bfloat16 products'
 * sums; the panel's thirds are taken in turn. Each sum is one chain of FMAs over k, as in every
 * other tile shape, so a row's result does not depend on the tile it falls in. */
#define AVX2_ROWS 6
#define AVX2_BF16_ROWS 4

/* one row's 16 sums of an AVX2 tile (columns c0 ..) (+ bias) (+ beta * out) stored to out's
 * real columns */
static inline void avx2_store16(__m256 low, __m256 high, int c0, const float *bias, float beta,
                                float *out, int cols) {
    float sums[16];
    _mm256_storeu_ps(sums, low);
    _mm256_storeu_ps(sums + 8, high);
    for (int c = c0; c < c0 + 16 && c < cols; c++) {
        float v = sums[c - c0];
        if (bias != NULL) v += bias[c];
        out[c] = beta != 0.0f ? v + beta * out[c] : v;
    }
}

static inline __attribute__((always_inline)) __m256 avx2_weights(const void *wk, int j,
                                                                 const int bf16w) {
    if (!bf16w) return _mm256_loadu_ps((const float *)wk + 8 * j);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const panel_bf16_t *)wk + 8 * j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* rows m0 .. m0 + mb (mb <= 6, constant after inlining) of x through columns 16 * part .. of
 * the panel wp (float32, or bf16w: bfloat16 weights widened); out = acc (+ bias) (+ beta out) */
static inline __attribute__((always_inline)) void panel_tile_avx2(
    const float *x, int64_t ldx, const void *wp, int k, const int bf16w, const int mb,
    int prefetch, int part, const float *bias, float beta, float *out, int64_t ldo, int cols) {
    const int64_t row_bytes = (int64_t)PANEL_COLS * (bf16w ? 2 : 4);
    const int c0 = 16 * part;
    __m256 acc[AVX2_ROWS][2];
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        const char *wk = (const char *)wp + kk * row_bytes + c0 * (bf16w ? 2 : 4);
        if (prefetch) _mm_prefetch(wk + prefetch_bytes, _MM_HINT_T0);
        const __m256 w0 = avx2_weights(wk, 0, bf16w), w1 = avx2_weights(wk, 1, bf16w);
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) {
            const __m256 xv = _mm256_broadcast_ss(x + m * ldx + kk);
            acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++)
        avx2_store16(acc[m][0], acc[m][1], c0, bias, beta, out + m * ldo, cols);
}

static inline float avx2_widen(panel_bf16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline panel_bf16_t avx2_narrow(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (panel_bf16_t)((bits >> 16) | 0x40u);
    return (panel_bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* the bfloat16 GEMM's tile: rows m0 .. m0 + mb (mb <= 4: with its even and odd weights, 4 rows
 * fill the registers) through columns 16 * part .. of the
 * pair-interleaved panel wp, each pair of k split into its two widened halves: two FMAs per
 * pair, k's then k + 1's */
static inline __attribute__((always_inline)) void panel_tile_bf16_avx2(
    const panel_bf16_t *x, int64_t ldx, const panel_bf16_t *wp, int k, const int mb,
    int prefetch, int part, const panel_bf16_t *bias, panel_bf16_t *out, int64_t ldo,
    int cols) {
    const int c0 = 16 * part;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[AVX2_ROWS][2]; /* (mb <= AVX2_BF16_ROWS) */
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < 2; j++) acc[m][j] = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk += 2) {
        const panel_bf16_t *wk = wp + (int64_t)kk * PANEL_COLS + 2 * c0;
        if (prefetch) _mm_prefetch((const char *)wk + prefetch_bytes, _MM_HINT_T0);
        __m256 even[2], odd[2];
        for (int j = 0; j < 2; j++) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(wk + 16 * j));
            even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            odd[j] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
        }
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) {
            const __m256 x0 = _mm256_set1_ps(avx2_widen(x[m * ldx + kk]));
            const __m256 x1 = _mm256_set1_ps(kk + 1 < k ? avx2_widen(x[m * ldx + kk + 1]) : 0.0f);
            for (int j = 0; j < 2; j++) {
                acc[m][j] = _mm256_fmadd_ps(x0, even[j], acc[m][j]);
                acc[m][j] = _mm256_fmadd_ps(x1, odd[j], acc[m][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mb; m++) {
        float sums[16];
        for (int j = 0; j < 2; j++) _mm256_storeu_ps(sums + 8 * j, acc[m][j]);
        for (int c = c0; c < c0 + 16 && c < cols; c++)
            out[m * ldo + c] = avx2_narrow(bias != NULL ? sums[c - c0] + avx2_widen(bias[c])
                                                        : sums[c - c0]);
    }
}

/* all mb (<= PANEL_ROWS) rows of a tile, `rows` (6 or 4) at a time, through the panel's
 * thirds */
#define AVX2_TILES(tile, rows, ...)                                                             \
    for (int r0 = 0; r0 < mb; r0 += (rows)) {                                                   \
        const int nr = mb - r0 < (rows) ? mb - r0 : (rows);                                     \
        for (int part = 0; part < PANEL_COLS / 16; part++) {                                    \
            const int first = m0 == 0 && r0 == 0;                                               \
            switch (nr) {                                                                       \
            case 6: tile(__VA_ARGS__, 6, first, part, AVX2_TAIL); break;                         \
            case 5: tile(__VA_ARGS__, 5, first, part, AVX2_TAIL); break;                         \
            case 4: tile(__VA_ARGS__, 4, first, part, AVX2_TAIL); break;                         \
            case 3: tile(__VA_ARGS__, 3, first, part, AVX2_TAIL); break;                         \
            case 2: tile(__VA_ARGS__, 2, first, part, AVX2_TAIL); break;                         \
            default: tile(__VA_ARGS__, 1, first, part, AVX2_TAIL); break;                        \
            }                                                                                   \
        }                                                                                       \
    }
#endif

/* one panel, all rows, PANEL_ROWS at a time (the row count of the last tile a constant in
 * each case, so that the accumulators stay in registers) */
#define PANEL_TILES(tile, ...)                                                                  \
    switch (mb) {                                                                               \
    case 8: tile(__VA_ARGS__, 8, m0 == 0, TILE_TAIL); break;                                     \
    case 7: tile(__VA_ARGS__, 7, m0 == 0, TILE_TAIL); break;                                     \
    case 6: tile(__VA_ARGS__, 6, m0 == 0, TILE_TAIL); break;                                     \
    case 5: tile(__VA_ARGS__, 5, m0 == 0, TILE_TAIL); break;                                     \
    case 4: tile(__VA_ARGS__, 4, m0 == 0, TILE_TAIL); break;                                     \
    case 3: tile(__VA_ARGS__, 3, m0 == 0, TILE_TAIL); break;                                     \
    case 2: tile(__VA_ARGS__, 2, m0 == 0, TILE_TAIL); break;                                     \
    default: tile(__VA_ARGS__, 1, m0 == 0, TILE_TAIL); break;                                    \
    }

#if !defined(__AVX512F__) && !defined(PANEL_AVX2_F32)
static inline float panel_value(const void *wp, int64_t i, int bf16w) {
    if (!bf16w) return ((const float *)wp)[i];
    const uint32_t bits = (uint32_t)((const panel_bf16_t *)wp)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* out [rows, n] (row stride ldo) = x [rows, k] (row stride ldx) W^T + bias (or NULL)
 * + beta * out; w packed by pc_panel_pack (float32) or, with bf16w, pc_panel_pack_bf16w */
static void panel_gemm_f32(const float *x, int64_t ldx, int rows, int k, const void *w,
                           const int bf16w, int n, const float *bias, float beta, float *out,
                           int64_t ldo, int nthreads) {
    const int64_t panel_bytes = (int64_t)k * PANEL_COLS * (bf16w ? 2 : 4);
#pragma omp parallel num_threads(nthreads)
    {
        int p0, p1;
        panel_share(n, &p0, &p1);
        for (int p = p0; p < p1; p++) {
            const int c0 = p * PANEL_COLS, cols = n - c0 < PANEL_COLS ? n - c0 : PANEL_COLS;
            const void *wp = (const char *)w + p * panel_bytes;
            const float *b = bias == NULL ? NULL : bias + c0;
            for (int m0 = 0; m0 < rows; m0 += PANEL_ROWS) {
                const int mb = rows - m0 < PANEL_ROWS ? rows - m0 : PANEL_ROWS;
                const float *xm = x + m0 * ldx;
                float *om = out + m0 * ldo + c0;
#ifdef __AVX512F__
#define TILE_TAIL b, beta, om, ldo, cols
                if (bf16w) {
                    PANEL_TILES(panel_tile, xm, ldx, wp, k, 1)
                } else {
                    PANEL_TILES(panel_tile, xm, ldx, wp, k, 0)
                }
#undef TILE_TAIL
#elif defined(PANEL_AVX2_F32)
#define AVX2_TAIL b, beta, om + r0 * ldo, ldo, cols
                if (bf16w) {
                    AVX2_TILES(panel_tile_avx2, AVX2_ROWS, xm + r0 * ldx, ldx, wp, k, 1)
                } else {
                    AVX2_TILES(panel_tile_avx2, AVX2_ROWS, xm + r0 * ldx, ldx, wp, k, 0)
                }
#undef AVX2_TAIL
#else
                for (int m = 0; m < mb; m++)
                    for (int j = 0; j < cols; j++) {
                        float sum = 0.0f;
                        for (int kk = 0; kk < k; kk++)
                            sum += xm[m * ldx + kk] * panel_value(wp, (int64_t)kk * PANEL_COLS + j, bf16w);
                        if (b != NULL) sum += b[j];
                        om[m * ldo + j] = beta != 0.0f ? sum + beta * om[m * ldo + j] : sum;
                    }
#endif
            }
        }
    }
}

void pc_panel_gemm(const float *x, int64_t ldx, int rows, int k, const float *w, int n,
                   const float *bias, float beta, float *out, int64_t ldo, int nthreads) {
    panel_gemm_f32(x, ldx, rows, k, w, 0, n, bias, beta, out, ldo, nthreads);
}

/* the float32 GEMM over bfloat16 weights: each widened to float32 (exact), float32 products and
 * sums, so the result is the float32 GEMM's over the weights rounded to bfloat16 */
void pc_panel_gemm_bf16w(const float *x, int64_t ldx, int rows, int k, const panel_bf16_t *w,
                         int n, const float *bias, float beta, float *out, int64_t ldo,
                         int nthreads) {
    panel_gemm_f32(x, ldx, rows, k, w, 1, n, bias, beta, out, ldo, nthreads);
}

#if !defined(__AVX512BF16__) && !defined(PANEL_AVX2_BF16)
static inline float panel_widen(panel_bf16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline panel_bf16_t panel_narrow(float f) { /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (panel_bf16_t)((bits >> 16) | 0x40u); /* NaN */
    return (panel_bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#endif

/* the bfloat16 GEMM: float32 sums rounded to bfloat16 once (after the bias), as oneDNN does */
void pc_panel_gemm_bf16(const panel_bf16_t *x, int64_t ldx, int rows, int k,
                        const panel_bf16_t *w, int n, const panel_bf16_t *bias,
                        panel_bf16_t *out, int64_t ldo, int nthreads) {
    const int64_t panel_stride = (int64_t)even(k) * PANEL_COLS;
#pragma omp parallel num_threads(nthreads)
    {
        int p0, p1;
        panel_share(n, &p0, &p1);
        for (int p = p0; p < p1; p++) {
            const int c0 = p * PANEL_COLS, cols = n - c0 < PANEL_COLS ? n - c0 : PANEL_COLS;
            const panel_bf16_t *wp = w + p * panel_stride;
            const panel_bf16_t *b = bias == NULL ? NULL : bias + c0;
            for (int m0 = 0; m0 < rows; m0 += PANEL_ROWS) {
                const int mb = rows - m0 < PANEL_ROWS ? rows - m0 : PANEL_ROWS;
                const panel_bf16_t *xm = x + m0 * ldx;
                panel_bf16_t *om = out + m0 * ldo + c0;
#ifdef __AVX512BF16__
#define TILE_TAIL b, om, ldo, cols
                PANEL_TILES(panel_tile_bf16, xm, ldx, wp, k)
#undef TILE_TAIL
#elif defined(PANEL_AVX2_BF16)
#define AVX2_TAIL b, om + r0 * ldo, ldo, cols
                AVX2_TILES(panel_tile_bf16_avx2, AVX2_BF16_ROWS, xm + r0 * ldx, ldx, wp, k)
#undef AVX2_TAIL
#else
                for (int m = 0; m < mb; m++)
                    for (int j = 0; j < cols; j++) {
                        float sum = 0.0f;
                        for (int kk = 0; kk < k; kk++)
                            sum += panel_widen(xm[m * ldx + kk]) *
                                   panel_widen(wp[((int64_t)(kk / 2) * PANEL_COLS + j) * 2 + (kk & 1)]);
                        if (b != NULL) sum += panel_widen(b[j]);
                        om[m * ldo + j] = panel_narrow(sum);
                    }
#endif
            }
        }
    }
}

/* pc_panel_gemm behind MKL's cblas_sgemm_compute signature (row-major, A untransposed, B
 * packed by pc_panel_pack), for the compiled layers' projections; threads: OpenMP's default */
void pc_panel_compute(int layout, int transa, int transb, int m, int n, int k, const float *a,
                      int lda, const void *b, int ldb, float beta, float *c, int ldc) {
    (void)layout, (void)transa, (void)transb, (void)ldb;
    panel_gemm_f32(a, lda, m, k, b, 0, n, NULL, beta, c, ldc, omp_get_max_threads());
}

/* the same over bfloat16 weights (B packed by pc_panel_pack_bf16w) */
void pc_panel_compute_bf16w(int layout, int transa, int transb, int m, int n, int k,
                            const float *a, int lda, const void *b, int ldb, float beta, float *c,
                            int ldc) {
    (void)layout, (void)transa, (void)transb, (void)ldb;
    panel_gemm_f32(a, lda, m, k, b, 1, n, NULL, beta, c, ldc, omp_get_max_threads());
}

#endif
