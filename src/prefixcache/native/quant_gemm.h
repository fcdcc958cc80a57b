/* Quantized GEMM: out [rows, n] = x [rows, k] W^T (+ bias) in float32, W [n, k] stored as 8-bit
 * integers in blocks of 32 along k, each block with a scale d and optionally a minimum m per
 * column: w = d * q (+ m). That holds GGUF's Q8_0, Q4_0 and Q5_0 (m = 0) and Q4_1, Q5_1 and
 * Q4_K (per 32-value block) exactly. Included by layers.c; used through
 * prefixcache.model.quant_gemm and by the compiled layer steps.
 *
 * The activations are quantized per row in the same blocks, as llama.cpp does for these types:
 * dx = max |x| / 127, xq = round(x / dx); a block's product is then an exact integer sum
 * (vpdpbusd: unsigned bytes xq + 128 times signed weights, the 128 * sum(q) it adds taken off
 * with each block's column sums kept at packing) scaled once: acc += isum * (d * dx) + m * sx,
 * sx = dx * sum(xq). Every row goes through the same operations whatever the row or thread
 * count, so a row's result does not depend on the batch it is in.
 *
 * Layout: panels of QUANT_COLS columns; each panel a run of k / 32 block records of
 *   q     [8][48][4] int8   (4 consecutive k of a column side by side: vpdpbusd's operand)
 *         or, for 4-bit values (0..15), [4][48][4] bytes holding groups 2i and 2i + 1 in their
 *         low and high nibbles (unpacked with a shift and a mask: half the bytes streamed)
 *   d     [48] float16
 *   wsum  [48] int16        (the column's sum of q over the block)
 *   m     [48] float16      (with minimums only)
 * zero padded to whole panels. A weight's `form` says which: QUANT_BYTES (no minimum),
 * QUANT_BYTES_MIN, QUANT_NIBBLES (with minimum). A panel's records stay in L2 while every QUANT_ROWS-row tile of
 * x goes through them; the first tile streams them and prefetches ahead.
 *
 * AVX512_VNNI kernels where the compiler targets them, else AVX2 ones (llama.cpp's vpmaddubsw
 * dot products), else plain loops (correct, slow): pc_quant_isa says which. */
#ifndef PREFIXCACHE_QUANT_GEMM_H
#define PREFIXCACHE_QUANT_GEMM_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "panel_gemm.h" /* panel_store */

#define QUANT_BLOCK 32
#define QUANT_COLS 48
#define QUANT_ROWS 4
#define QUANT_VECS (QUANT_COLS / 16)
#define QUANT_GROUPS (QUANT_BLOCK / 4)
enum { QUANT_BYTES = 0, QUANT_BYTES_MIN = 1, QUANT_NIBBLES = 2 };

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#define QUANT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#include <immintrin.h>
#endif

/* which kernel this build has: 1 AVX512-VNNI, 2 AVX2, 0 the plain loops */
int pc_quant_isa(void) {
#if defined(QUANT_VNNI)
    return 1;
#elif defined(QUANT_AVX2)
    return 2;
#else
    return 0;
#endif
}

static inline int quant_panels(int n) { return (n + QUANT_COLS - 1) / QUANT_COLS; }

static inline int quant_q_bytes(int form) {
    return QUANT_BLOCK * QUANT_COLS / (form == QUANT_NIBBLES ? 2 : 1);
}

/* bytes of one block record */
static inline int64_t quant_record(int form) {
    return quant_q_bytes(form) + QUANT_COLS * 2 * (form == QUANT_BYTES ? 2 : 3);
}

/* bytes of the packed copy of a [n, k] weight (k a multiple of 32) */
int64_t pc_quant_size(int n, int k, int form) {
    return (int64_t)quant_panels(n) * (k / QUANT_BLOCK) * quant_record(form);
}

/* q [n, k] int8 (0..15 for QUANT_NIBBLES), d [n, k / 32] and m (NULL for QUANT_BYTES) float16
 * bits -> the packed layout */
void pc_quant_pack(const int8_t *q, const uint16_t *d, const uint16_t *m, int n, int k,
                   int form, uint8_t *out) {
    const int nb = k / QUANT_BLOCK, has_min = form != QUANT_BYTES, nib = form == QUANT_NIBBLES;
    const int64_t record = quant_record(form);
    memset(out, 0, (size_t)pc_quant_size(n, k, form));
    for (int p = 0; p < quant_panels(n); p++)
        for (int b = 0; b < nb; b++) {
            uint8_t *rec = out + ((int64_t)p * nb + b) * record;
            int8_t *rq = (int8_t *)rec;
            uint16_t *rd = (uint16_t *)(rec + quant_q_bytes(form));
            int16_t *rs = (int16_t *)(rd + QUANT_COLS);
            uint16_t *rm = (uint16_t *)(rs + QUANT_COLS);
            for (int j = 0; j < QUANT_COLS; j++) {
                const int col = p * QUANT_COLS + j;
                if (col >= n) continue;
                const int8_t *src = q + (int64_t)col * k + b * QUANT_BLOCK;
                int sum = 0;
                for (int i = 0; i < QUANT_BLOCK; i++) {
                    const int g = i / 4, at = (((nib ? g / 2 : g) * QUANT_COLS) + j) * 4 + i % 4;
                    if (!nib) rq[at] = src[i];
                    else rq[at] = (int8_t)((uint8_t)rq[at] | (uint8_t)((src[i] & 15) << (g & 1 ? 4 : 0)));
                    sum += src[i];
                }
                rd[j] = d[(int64_t)col * nb + b];
                rs[j] = (int16_t)sum;
                if (has_min) rm[j] = m[(int64_t)col * nb + b];
            }
        }
}

static inline float quant_half(uint16_t h) { /* IEEE half -> float */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const int exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ffu, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0) bits = sign | ((uint32_t)(exp + 112) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else { /* subnormal */
        int e = 113;
        while (!(mant & 0x400u)) mant <<= 1, e--;
        bits = sign | ((uint32_t)e << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* one row's blocks: xu = round(x / dx) + 128, dx, sx = dx * sum(round(x / dx)) */
static void quant_row(const float *x, int k, uint8_t *xu, float *dx, float *sx) {
    for (int b = 0; b < k / QUANT_BLOCK; b++) {
        const float *xb = x + b * QUANT_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QUANT_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QUANT_BLOCK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            xu[b * QUANT_BLOCK + i] = (uint8_t)(v + 128);
            sum += v;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

#ifdef QUANT_VNNI
/* mb (constant after inlining) rows of quantized x through one panel */
static inline __attribute__((always_inline)) void quant_tile(
    const uint8_t *xu, int64_t ldu, const float *dx, const float *sx, int64_t ldd,
    const uint8_t *wp, int nb, const int form, const int mb, int prefetch,
    const float *bias, float beta, float *out, int64_t ldo, int cols) {
    const int64_t record = quant_record(form);
    const int has_min = form != QUANT_BYTES;
    __m512 acc[QUANT_ROWS][QUANT_VECS];
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < QUANT_VECS; j++) acc[m][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = wp + b * record;
        __m512i isum[QUANT_ROWS][QUANT_VECS];
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < QUANT_VECS; j++) isum[m][j] = _mm512_setzero_si512();
        for (int g = 0; g < QUANT_GROUPS; g++) {
            const int nib = form == QUANT_NIBBLES;
            const uint8_t *wg = rec + (nib ? g / 2 : g) * QUANT_COLS * 4;
            if (prefetch && (!nib || !(g & 1)))
                for (int line = 0; line < 5; line++)
                    _mm_prefetch((const char *)rec + g * (record / QUANT_GROUPS) + 64 * line + prefetch_bytes,
                                 _MM_HINT_T0);
            __m512i wv[QUANT_VECS];
            for (int j = 0; j < QUANT_VECS; j++) {
                wv[j] = _mm512_loadu_si512(wg + 64 * j);
                if (nib) /* this group's nibble of each byte */
                    wv[j] = _mm512_and_si512(g & 1 ? _mm512_srli_epi16(wv[j], 4) : wv[j],
                                             _mm512_set1_epi8(15));
            }
            for (int m = 0; m < mb; m++) {
                int32_t four;
                memcpy(&four, xu + m * ldu + b * QUANT_BLOCK + 4 * g, sizeof four);
                const __m512i xv = _mm512_set1_epi32(four);
                for (int j = 0; j < QUANT_VECS; j++)
                    isum[m][j] = _mm512_dpbusd_epi32(isum[m][j], xv, wv[j]);
            }
        }
        const uint16_t *rd = (const uint16_t *)(rec + quant_q_bytes(form));
        const int16_t *rs = (const int16_t *)(rd + QUANT_COLS);
        const uint16_t *rm = (const uint16_t *)(rs + QUANT_COLS);
        for (int j = 0; j < QUANT_VECS; j++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rd + 16 * j)));
            const __m512i offset = _mm512_slli_epi32(
                _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(rs + 16 * j))), 7);
            const __m512 mw = has_min
                ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rm + 16 * j)))
                : _mm512_setzero_ps();
            for (int m = 0; m < mb; m++) {
                const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[m][j], offset));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * ldd + b]));
                acc[m][j] = _mm512_fmadd_ps(s, scale, acc[m][j]);
                if (has_min) acc[m][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * ldd + b]), acc[m][j]);
            }
        }
    }
    for (int m = 0; m < mb; m++) panel_store(acc[m], QUANT_VECS, bias, beta, out + m * ldo, cols);
}
#endif

#ifdef QUANT_AVX2
/* The AVX2 tile: mb (<= 4) rows through columns 16 * part .. of one panel, 8 columns a ymm.
 * Each group of 4 k is llama.cpp's AVX2 dot product: |w| (unsigned) times x with w's sign
 * (vpmaddubsw: pairs of products as 16 bits, at most 2 x 128 x 127, no saturation), pairs
 * summed into 32 bits (vpmaddwd); the block's integer sum is exact, the same as the VNNI
 * kernel's, and so are the float steps after it. */
static inline __attribute__((always_inline)) void quant_tile_avx2(
    const uint8_t *xu, int64_t ldu, const float *dx, const float *sx, int64_t ldd,
    const uint8_t *wp, int nb, const int form, const int mb, int prefetch, int part,
    const float *bias, float beta, float *out, int64_t ldo, int cols) {
    const int64_t record = quant_record(form);
    const int has_min = form != QUANT_BYTES, nib = form == QUANT_NIBBLES, c0 = 16 * part;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[QUANT_ROWS][2];
    for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = wp + b * record;
        if (prefetch && part == 0) /* the first tile streams the panel's records */
            for (int line = 0; line < (int)(record / 64); line++)
                _mm_prefetch((const char *)rec + 64 * line + prefetch_bytes, _MM_HINT_T0);
        __m256i isum[QUANT_ROWS][2];
        for (int m = 0; m < mb; m++) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
        for (int g = 0; g < QUANT_GROUPS; g++) {
            const uint8_t *wg = rec + ((nib ? g / 2 : g) * QUANT_COLS + c0) * 4;
            /* 4-bit values are unsigned (0 .. 15): they are vpmaddubsw's unsigned operand as
             * they are; bytes may be signed: |w|, and x takes w's sign */
            __m256i wabs[2], wv[2];
            for (int j = 0; j < 2; j++) {
                wv[j] = _mm256_loadu_si256((const __m256i *)(wg + 32 * j));
                if (nib) wv[j] = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(wv[j], 4) : wv[j], low);
                wabs[j] = nib ? wv[j] : _mm256_abs_epi8(wv[j]);
            }
            for (int m = 0; m < mb; m++) {
                int32_t four;
                memcpy(&four, xu + m * ldu + b * QUANT_BLOCK + 4 * g, sizeof four);
                const __m256i xv = _mm256_xor_si256(_mm256_set1_epi32(four), flip); /* x - 128 */
                for (int j = 0; j < 2; j++) {
                    const __m256i xs = nib ? xv : _mm256_sign_epi8(xv, wv[j]);
                    const __m256i pairs = _mm256_maddubs_epi16(wabs[j], xs);
                    isum[m][j] = _mm256_add_epi32(isum[m][j], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        const uint16_t *rd = (const uint16_t *)(rec + quant_q_bytes(form));
        const uint16_t *rm = rd + 2 * QUANT_COLS;
        for (int j = 0; j < 2; j++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rd + c0 + 8 * j)));
            const __m256 mw = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rm + c0 + 8 * j)))
                                      : _mm256_setzero_ps();
            for (int m = 0; m < mb; m++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[m * ldd + b]));
                acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][j]), scale, acc[m][j]);
                if (has_min) acc[m][j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[m * ldd + b]), acc[m][j]);
            }
        }
    }
    for (int m = 0; m < mb; m++)
        avx2_store16(acc[m][0], acc[m][1], c0, bias, beta, out + m * ldo, cols);
}
#endif

/* the same, plain loops (exact integer sums; the float steps in the same order) */
static __attribute__((unused)) void quant_tile_plain(const uint8_t *xu, int64_t ldu, const float *dx, const float *sx,
                             int64_t ldd, const uint8_t *wp, int nb, int form, int mb,
                             const float *bias, float beta, float *out, int64_t ldo, int cols) {
    const int64_t record = quant_record(form);
    const int has_min = form != QUANT_BYTES, nib = form == QUANT_NIBBLES;
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < cols; j++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *rec = wp + b * record;
                const int8_t *rq = (const int8_t *)rec;
                const uint16_t *rd = (const uint16_t *)(rec + quant_q_bytes(form));
                const uint16_t *rm = rd + 2 * QUANT_COLS;
                int isum = 0;
                for (int i = 0; i < QUANT_BLOCK; i++) {
                    const int g = i / 4, at = (((nib ? g / 2 : g) * QUANT_COLS) + j) * 4 + i % 4;
                    const int w = nib ? ((uint8_t)rq[at] >> (g & 1 ? 4 : 0)) & 15 : rq[at];
                    isum += ((int)xu[m * ldu + b * QUANT_BLOCK + i] - 128) * w;
                }
                acc += (float)isum * (quant_half(rd[j]) * dx[m * ldd + b]);
                if (has_min) acc += quant_half(rm[j]) * sx[m * ldd + b];
            }
            if (bias != NULL) acc += bias[j];
            out[m * ldo + j] = beta != 0.0f ? acc + beta * out[m * ldo + j] : acc;
        }
}

/* scratch for one call's quantized activations: grown per calling thread, kept */
static __thread uint8_t *quant_scratch;
static __thread size_t quant_scratch_size;

static uint8_t *quant_buffer(size_t size) {
    if (size > quant_scratch_size) {
        uint8_t *grown = realloc(quant_scratch, size);
        if (grown == NULL) return NULL;
        quant_scratch = grown, quant_scratch_size = size;
    }
    return quant_scratch;
}

static size_t quant_scratch_bytes(int rows, int k) {
    return (size_t)rows * (k + 8 * (k / QUANT_BLOCK)) + 64;
}

/* grow this thread's scratch for rows x k ahead of the calls (the compiled layers cannot report
 * a failed allocation): 0, or -1 where the memory is not there */
int pc_quant_reserve(int rows, int k) { return quant_buffer(quant_scratch_bytes(rows, k)) ? 0 : -1; }

/* out [rows, n] (row stride ldo) = x [rows, k] (row stride ldx) W^T + bias (or NULL)
 * + beta * out; w packed by pc_quant_pack. Returns 0, or -1 where scratch memory ran out. */
int pc_quant_gemm(const float *x, int64_t ldx, int rows, int k, const uint8_t *w, int n,
                  int form, const float *bias, float beta, float *out, int64_t ldo,
                  int nthreads) {
    const int nb = k / QUANT_BLOCK;
    const int64_t ldu = k, ldd = nb, record = quant_record(form);
    uint8_t *scratch = quant_buffer(quant_scratch_bytes(rows, k));
    if (scratch == NULL) return -1;
    uint8_t *xu = scratch;
    float *dx = (float *)(scratch + (((size_t)rows * k + 63) & ~(size_t)63));
    float *sx = dx + (int64_t)rows * nb;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            quant_row(x + r * ldx, k, xu + r * ldu, dx + r * ldd, sx + r * ldd);
        const int np = quant_panels(n), t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)np * t / nt), p1 = (int)((int64_t)np * (t + 1) / nt);
        for (int p = p0; p < p1; p++) {
            const int c0 = p * QUANT_COLS, cols = n - c0 < QUANT_COLS ? n - c0 : QUANT_COLS;
            const uint8_t *wp = w + (int64_t)p * nb * record;
            const float *b = bias == NULL ? NULL : bias + c0;
            for (int m0 = 0; m0 < rows; m0 += QUANT_ROWS) {
                const int mb = rows - m0 < QUANT_ROWS ? rows - m0 : QUANT_ROWS;
                const uint8_t *xm = xu + m0 * ldu;
                const float *dm = dx + m0 * ldd, *sm = sx + m0 * ldd;
                float *om = out + m0 * ldo + c0;
#if defined(QUANT_VNNI) || defined(QUANT_AVX2)
#ifdef QUANT_VNNI
#define QUANT_TILE(FORM, MB) \
    quant_tile(xm, ldu, dm, sm, ldd, wp, nb, FORM, MB, m0 == 0, b, beta, om, ldo, cols)
#else /* the AVX2 tile takes a panel's 48 columns 16 at a time */
#define QUANT_TILE(FORM, MB)                                                                    \
    for (int part = 0; part < QUANT_COLS / 16; part++)                                          \
        quant_tile_avx2(xm, ldu, dm, sm, ldd, wp, nb, FORM, MB, m0 == 0, part, b, beta, om, ldo, \
                        cols)
#endif
#define QUANT_TILES(FORM)                        \
    switch (mb) {                                \
    case 4: QUANT_TILE(FORM, 4); break;          \
    case 3: QUANT_TILE(FORM, 3); break;          \
    case 2: QUANT_TILE(FORM, 2); break;          \
    default: QUANT_TILE(FORM, 1); break;         \
    }
                if (form == QUANT_NIBBLES) {
                    QUANT_TILES(QUANT_NIBBLES)
                } else if (form == QUANT_BYTES_MIN) {
                    QUANT_TILES(QUANT_BYTES_MIN)
                } else {
                    QUANT_TILES(QUANT_BYTES)
                }
#undef QUANT_TILES
#undef QUANT_TILE
#else
                quant_tile_plain(xm, ldu, dm, sm, ldd, wp, nb, form, mb, b, beta, om, ldo, cols);
#endif
            }
        }
    }
    return 0;
}

/* what the compiled layers' `gemm` pointer hands pc_quant_compute as its packed B */
struct quant_weight {
    const uint8_t *data;
    int form;
};

/* pc_quant_gemm behind MKL's cblas_sgemm_compute signature, B a struct quant_weight */
void pc_quant_compute(int layout, int transa, int transb, int m, int n, int k, const float *a,
                      int lda, const void *b, int ldb, float beta, float *c, int ldc) {
    (void)layout, (void)transa, (void)transb, (void)ldb;
    const struct quant_weight *qw = b;
    if (pc_quant_gemm(a, lda, m, k, qw->data, n, qw->form, NULL, beta, c, ldc,
                      omp_get_max_threads()) != 0)
        abort(); /* not after pc_quant_reserve(m, k) succeeded in this thread */
}

#endif
