/* bench_common.h: what the C benches share: a monotonic clock, a seeded xorshift generator
 * (define BENCH_RNG_SEED before including), and the fp16 scale fields of one block, located
 * through the block structs of csrc/engine/quants.h, for weights of random codes and finite scales.
 * Needs _POSIX_C_SOURCE >= 199309L for clock_gettime. */
#ifndef QC_BENCH_COMMON_H
#define QC_BENCH_COMMON_H

#include <stddef.h>
#include <string.h>
#include <time.h>

#include "quants.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = BENCH_RNG_SEED;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* Byte offsets of the fp16 scales of a block of type t (d, then m / dmin where the format has
 * one) -> how many (0 for types without block scales). */
static int block_scale_offsets(uint32_t t, size_t offs[2]) {
    switch (t) {
    case QC_TYPE_Q4_0: offs[0] = offsetof(qc_block_q4_0, d); return 1;
    case QC_TYPE_Q5_0: offs[0] = offsetof(qc_block_q5_0, d); return 1;
    case QC_TYPE_Q8_0: offs[0] = offsetof(qc_block_q8_0, d); return 1;
    case QC_TYPE_Q4_1: offs[0] = offsetof(qc_block_q4_1, d); offs[1] = offsetof(qc_block_q4_1, m); return 2;
    case QC_TYPE_Q5_1: offs[0] = offsetof(qc_block_q5_1, d); offs[1] = offsetof(qc_block_q5_1, m); return 2;
    case QC_TYPE_Q2_K: offs[0] = offsetof(qc_block_q2_K, d); offs[1] = offsetof(qc_block_q2_K, dmin); return 2;
    case QC_TYPE_Q3_K: offs[0] = offsetof(qc_block_q3_K, d); return 1;
    case QC_TYPE_Q4_K: offs[0] = offsetof(qc_block_q4_K, d); offs[1] = offsetof(qc_block_q4_K, dmin); return 2;
    case QC_TYPE_Q5_K: offs[0] = offsetof(qc_block_q5_K, d); offs[1] = offsetof(qc_block_q5_K, dmin); return 2;
    case QC_TYPE_Q6_K: offs[0] = offsetof(qc_block_q6_K, d); return 1;
    default: return 0;
    }
}

/* Overwrite the fp16 scales of the block at blk with value(), in field order. */
static void set_block_scales(uint32_t t, uint8_t *blk, float (*value)(void)) {
    size_t offs[2];
    const int n = block_scale_offsets(t, offs);
    for (int i = 0; i < n; i++) {
        const qc_half h = qc_fp32_to_fp16(value());
        memcpy(blk + offs[i], &h, sizeof h);
    }
}

#endif /* QC_BENCH_COMMON_H */
