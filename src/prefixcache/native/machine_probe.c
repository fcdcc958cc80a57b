/* Two measurements of one core against memory, for prefixcache.native.machine: the latency of
 * a load that misses every cache, and the rate a sequential read streams at. Built like the
 * other kernels (cc -O3 -march=native) and called once per machine through ctypes. */
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2 << 20)

/* `bytes` aligned to a huge page and, where the kernel allows, backed by huge pages: a random
 * walk over 4 KiB pages would add a page-table walk to most loads, which a weight stream pays
 * once per page, not per line */
static void *stream_memory(int64_t bytes) {
    const size_t size = ((size_t)bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void *p = aligned_alloc(HUGE_PAGE, size);
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static uint64_t next_random(uint64_t *state) { /* xorshift64* */
    uint64_t x = *state;
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* Nanoseconds per load when each load's address comes from the one before: one random cycle
 * through every 64-byte line of `bytes` (Sattolo's shuffle), `steps` loads after a warm-up
 * pass. -1 when the memory cannot be had. */
double pc_memory_latency_ns(int64_t bytes, int64_t steps) {
    const int64_t lines = bytes / 64;
    if (lines < 2 || steps < 1) return -1.0;
    int64_t *next = stream_memory(lines * 64);
    if (!next) return -1.0;
    int64_t *order = malloc((size_t)lines * sizeof(int64_t));
    if (!order) {
        free(next);
        return -1.0;
    }
    uint64_t state = 0x9E3779B97F4A7C15ULL;
    for (int64_t i = 0; i < lines; i++) order[i] = i;
    for (int64_t i = lines - 1; i > 0; i--) { /* Sattolo: a single cycle */
        const int64_t j = (int64_t)(next_random(&state) % (uint64_t)i);
        const int64_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
    for (int64_t i = 0; i < lines; i++) /* line order[i] points at line order[i + 1] */
        next[order[i] * 8] = order[(i + 1) % lines] * 8;
    free(order);
    volatile int64_t sink;
    int64_t at = 0;
    for (int64_t i = 0; i < lines; i++) at = next[at]; /* warm-up: pages touched, TLB */
    const double start = now_ns();
    for (int64_t i = 0; i < steps; i++) at = next[at];
    const double elapsed = now_ns() - start;
    sink = at;
    (void)sink;
    free(next);
    return elapsed / (double)steps;
}

/* Bytes per nanosecond one thread reads summing `bytes` of floats front to back, the best of
 * `repeats` passes after one that touches the pages. -1 when the memory cannot be had. */
double pc_stream_bytes_per_ns(int64_t bytes, int repeats) {
    const int64_t n = bytes / (int64_t)sizeof(float) / 64 * 64;
    if (n < 64 || repeats < 1) return -1.0;
    float *data = stream_memory(n * (int64_t)sizeof(float));
    if (!data) return -1.0;
    for (int64_t i = 0; i < n; i++) data[i] = (float)(i & 7);
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int r = 0; r < repeats; r++) {
        float sums[64] = {0}; /* independent sums: the adds keep up with the loads */
        const double start = now_ns();
        for (int64_t i = 0; i < n; i += 64)
            for (int l = 0; l < 64; l++) sums[l] += data[i + l];
        const double elapsed = now_ns() - start;
        for (int l = 0; l < 64; l++) sink += sums[l];
        const double rate = (double)n * sizeof(float) / elapsed;
        best = rate > best ? rate : best;
    }
    free(data);
    return best;
}
