/* dot_bench.c: throughput of qc_dot_row (the CPU matmul's inner loop), one thread.
 *
 *   gcc -std=c11 -O3 -Icsrc bench/dot_bench.c csrc/quants.c csrc/common.c -lm -o /tmp/dot_bench
 *   /tmp/dot_bench [MiB of weights, default 256] [repeats, default 5]
 *
 * For each type: a weight of the given size (rows of 4096 elements, random codes, finite
 * scales), every row dotted with one float vector; prints the best time over the repeats as
 * GB/s of stored weight bytes and Gelem/s, for qc_dot_row and for qc_dequantize row by row
 * (the matmul's prefill path). A second size of 1 MiB shows the cache-resident rate.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quants.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* Byte offsets of the fp16 scale fields of one block (as in quants.h). */
static void fix_halves(uint32_t t, uint8_t *blk) {
    int offs[2] = {-1, -1};
    switch (t) {
    case QC_TYPE_Q8_0: case QC_TYPE_Q5_0: case QC_TYPE_Q4_0: offs[0] = 0; break;
    case QC_TYPE_Q4_K: case QC_TYPE_Q5_K: case QC_TYPE_Q4_1: case QC_TYPE_Q5_1: offs[0] = 0; offs[1] = 2; break;
    case QC_TYPE_Q2_K: offs[0] = 80; offs[1] = 82; break;
    case QC_TYPE_Q3_K: offs[0] = 108; break;
    case QC_TYPE_Q6_K: offs[0] = 208; break;
    default: return;
    }
    for (int i = 0; i < 2; i++)
        if (offs[i] >= 0) {
            uint16_t h = qc_fp32_to_fp16(0.001f * (float)(rnd() % 1000));
            memcpy(blk + offs[i], &h, 2);
        }
}

static void bench(uint32_t t, size_t target_bytes, int repeats) {
    const qc_type_traits *tr = qc_type_get(t);
    const int64_t ncols = 4096;
    int64_t row_bytes = qc_row_bytes(t, ncols);
    int64_t rows = (int64_t)(target_bytes / (size_t)row_bytes);
    if (rows < 1) rows = 1;
    size_t bytes = (size_t)(rows * row_bytes);
    uint8_t *w = aligned_alloc(64, (bytes + 63) / 64 * 64);
    float *x = aligned_alloc(64, (size_t)ncols * sizeof(float));
    if (w == NULL || x == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rnd();
    if (t == QC_TYPE_F32)
        for (size_t i = 0; i < bytes / 4; i++) ((float *)w)[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
    else if (t == QC_TYPE_BF16)
        for (size_t i = 0; i < bytes / 2; i++) ((uint16_t *)w)[i] = (uint16_t)(0x3c00 + rnd() % 0x400);
    else if (t == QC_TYPE_F16)
        for (size_t i = 0; i < bytes / 2; i++) ((uint16_t *)w)[i] = qc_fp32_to_fp16((float)(rnd() % 2000) / 1000.0f - 1.0f);
    else
        for (size_t i = 0; i < bytes; i += (size_t)tr->type_size) fix_halves(t, w + i);
    for (int64_t i = 0; i < ncols; i++) x[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
    double best = 1e30, best_dq = 1e30, sink = 0;
    float *buf = aligned_alloc(64, (size_t)ncols * sizeof(float));
    if (buf == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        for (int64_t i = 0; i < rows; i++) sink += qc_dot_row(t, w + (size_t)(i * row_bytes), x, ncols);
        double dt = now() - t0;
        if (dt < best) best = dt;
        t0 = now();
        for (int64_t i = 0; i < rows; i++) {
            qc_dequantize(t, w + (size_t)(i * row_bytes), buf, 1, ncols, NULL);
            sink += buf[i % ncols];
        }
        dt = now() - t0;
        if (dt < best_dq) best_dq = dt;
    }
    printf("%-5s %7.1f MiB  dot %6.2f GB/s %6.2f Gelem/s   dequantize %6.2f GB/s %6.2f Gelem/s  (sink %g)\n",
           tr->name, (double)bytes / (1 << 20), (double)bytes / best * 1e-9,
           (double)(rows * ncols) / best * 1e-9, (double)bytes / best_dq * 1e-9,
           (double)(rows * ncols) / best_dq * 1e-9, sink);
    free(buf);
    free(w);
    free(x);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? (size_t)atoi(argv[1]) : 256;
    int repeats = argc > 2 ? atoi(argv[2]) : 5;
    uint32_t types[] = {QC_TYPE_Q8_0, QC_TYPE_Q4_K, QC_TYPE_Q6_K, QC_TYPE_Q5_0, QC_TYPE_F16,
                        QC_TYPE_F32, QC_TYPE_BF16, QC_TYPE_Q4_0, QC_TYPE_Q4_1, QC_TYPE_Q5_1,
                        QC_TYPE_Q2_K, QC_TYPE_Q3_K, QC_TYPE_Q5_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) bench(types[i], mib << 20, repeats);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) bench(types[i], 1u << 20, repeats * 40);
    return 0;
}
