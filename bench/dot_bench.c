/* dot_bench.c: throughput of qc_dot_row (the CPU matmul's inner loop), one thread.
 *
 *   gcc -std=c11 -O3 -Icsrc/engine bench/dot_bench.c csrc/engine/quants.c csrc/engine/common.c -lm -o /tmp/dot_bench
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
#define BENCH_RNG_SEED 0x9E3779B97F4A7C15ull
#include "bench_common.h"

static float scale_value(void) { return 0.001f * (float)(rnd() % 1000); }

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
        for (size_t i = 0; i < bytes; i += (size_t)tr->type_size) set_block_scales(t, w + i, scale_value);
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
