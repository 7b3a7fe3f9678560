/* sample.cu: one draw on the device, following csrc/sampler.c (qc_sample_row) step by step, so
 * that a decode step samples inside its CUDA graph and hands back 16 bytes instead of a row of
 * logits.
 *
 * One block of 1024 threads does the whole chain: a row is ~150k values that stay in L2, a pass
 * over them costs microseconds, and one block needs no grid-wide synchronisation. Where the host
 * sorts, the device selects by threshold, which gives the same set:
 *  - top-k: a radix select (4 passes of 8 bits over an order-preserving integer key of each
 *    logit) finds the k-th best value; ties at it are taken in id order, as the host's
 *    (value desc, id asc) order does;
 *  - top-p: the same radix walk with each bucket weighted by its probability mass finds the value
 *    at which the cumulative mass of the best tokens reaches top_p; ties at it in id order.
 * The draw walks the survivors in id order, as the host does, so the same uniform number picks
 * the same token. Probability masses and the draw's running sums are double, as on the host.
 *
 * work (qc_sample_work_bytes(n) bytes): the penalised logits v[n] (floats), then the
 * temperature-1 masses of the candidates (doubles), whose first n ints also serve as the
 * penalty's duplicate marks before that.
 */
#include "qc_cuda.cuh"
#include "sampler.h"

#include <limits.h>

#define QC_SAMPLE_THREADS 1024
#define QC_SAMPLE_WARPS (QC_SAMPLE_THREADS / 32)
#define QC_SAMPLE_ITEMS 8   /* consecutive ids per thread in the id-order scans */

/* ---------------------------------------------------------------------------------------- */
/* the RNG of sampler.c */

__device__ __forceinline__ double qc_rng_uniform(uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}

/* An unsigned key with the order of the floats (no NaN here; -0 was made +0). */
__device__ __forceinline__ uint32_t qc_key(float v) {
    const uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* ---------------------------------------------------------------------------------------- */
/* block-wide helpers (every thread of the block calls them) */

__device__ double qc_block_sum(double x, double *sh) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    __syncthreads();   /* sh may still be read by a previous call */
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = x;
    __syncthreads();
    if (threadIdx.x < 32) {
        x = sh[threadIdx.x];
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        if (threadIdx.x == 0) sh[0] = x;
    }
    __syncthreads();
    return sh[0];
}

__device__ int qc_block_min(int x, int *sh) {
    for (int off = 16; off > 0; off >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, off));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = x;
    __syncthreads();
    if (threadIdx.x < 32) {
        x = sh[threadIdx.x];
        for (int off = 16; off > 0; off >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, off));
        if (threadIdx.x == 0) sh[0] = x;
    }
    __syncthreads();
    return sh[0];
}

/* Warp 0 walks 256 histogram bins from the top (largest keys) down: the bin where the running
 * total reaches `need`, and the total of the bins above it. Should rounding leave the total
 * short of need, the lowest non-empty bin is taken (everything above it is kept). */
template <typename T>
__device__ void qc_walk_bins(const T *hist, T need, int *chosen, T *above) {
    const int lane = threadIdx.x;
    T part[8], own = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        part[j] = hist[255 - 8 * lane - j];
        own += part[j];
    }
    T incl = own;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0;
    const unsigned reach = __ballot_sync(0xffffffffu, incl >= need);
    const unsigned filled = __ballot_sync(0xffffffffu, own > 0);
    const int owner = reach ? __ffs(reach) - 1 : 31 - __clz(filled);
    if (lane == owner) {
        T run = excl;
        int bin = -1;
        T bin_above = 0;
        for (int j = 0; j < 8; j++) {
            if (part[j] > 0) { bin = 255 - 8 * lane - j; bin_above = run; }
            if (part[j] > 0 && (reach != 0) && run + part[j] >= need) break;
            run += part[j];
        }
        *chosen = bin < 0 ? 0 : bin;
        *above = bin_above;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the draw */

/* What every thread needs to know of the chain so far (shared memory). */
struct qc_sample_plan {
    float vmax, cut;
    int best;                 /* first index of vmax */
    int n_cand;               /* tokens with v >= cut */
    int use_k, use_p;
    uint32_t k_key, p_key;    /* the k-th best key; the key where top-p's mass is reached */
    int k_last, p_last;       /* ties at those keys are kept up to this id */
    double p_target;          /* top_p x (mass of the top-k survivors) */
    double p_above;           /* mass of the keys above p_key */
    int use_min;
    double min_v;             /* min-p: logits >= this stay */
    float inv_t;
    int last;                 /* the largest surviving id */
};

__device__ __forceinline__ bool qc_in_top_k(const qc_sample_plan &p, float v, int i) {
    if (!(v >= p.cut)) return false;
    if (!p.use_k) return true;
    const uint32_t k = qc_key(v);
    return k > p.k_key || (k == p.k_key && i <= p.k_last);
}

__device__ __forceinline__ bool qc_survives(const qc_sample_plan &p, float v, int i) {
    if (!qc_in_top_k(p, v, i)) return false;
    if (p.use_p) {
        const uint32_t k = qc_key(v);
        if (!(k > p.p_key || (k == p.p_key && i <= p.p_last))) return false;
    }
    return !p.use_min || (double)v >= p.min_v;
}

/* The first id (in id order) with value > 0 at which the running sum of value over ids 0..i
 * reaches target (exceeds it when strict); INT_MAX when the total falls short. Each thread
 * takes QC_SAMPLE_ITEMS consecutive ids, so a chunk of ids is one block-wide scan. */
template <class F>
__device__ int qc_first_reaching(int n, double target, bool strict, F value, int *sh_i) {
    __shared__ double warp_off[QC_SAMPLE_WARPS];
    __shared__ double chunk_total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunk = QC_SAMPLE_THREADS * QC_SAMPLE_ITEMS;
    double carry = 0.0;
    for (int base = 0; base < n; base += chunk) {
        const int i0 = base + threadIdx.x * QC_SAMPLE_ITEMS;
        double x[QC_SAMPLE_ITEMS], own = 0.0;
#pragma unroll
        for (int j = 0; j < QC_SAMPLE_ITEMS; j++) {
            x[j] = i0 + j < n ? value(i0 + j) : 0.0;
            own += x[j];
        }
        double incl = own;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += y;
        }
        __syncthreads();   /* the previous chunk is done with warp_off */
        if (lane == 31) warp_off[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            double t = warp_off[lane];
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const double y = __shfl_up_sync(0xffffffffu, t, off);
                if (lane >= off) t += y;
            }
            const double before = __shfl_up_sync(0xffffffffu, t, 1);
            warp_off[lane] = lane == 0 ? 0.0 : before;
            if (lane == 31) chunk_total = t;
        }
        __syncthreads();
        double run = carry + warp_off[warp] + (incl - own);
        int hit = INT_MAX;
#pragma unroll
        for (int j = 0; j < QC_SAMPLE_ITEMS; j++) {
            run += x[j];
            if (hit == INT_MAX && x[j] > 0.0 && (strict ? run > target : run >= target)) hit = i0 + j;
        }
        carry += chunk_total;
        hit = qc_block_min(hit, sh_i);
        if (hit != INT_MAX) return hit;
    }
    return INT_MAX;
}

__global__ void __launch_bounds__(QC_SAMPLE_THREADS)
qc_sample_kernel(const float *__restrict__ logits, int n, const qc_sample_state *__restrict__ st,
                 float *__restrict__ v, double *__restrict__ mass, qc_sample_result *__restrict__ result) {
    __shared__ qc_sample_plan p;
    __shared__ double sh_d[QC_SAMPLE_WARPS];
    __shared__ int sh_i[QC_SAMPLE_WARPS];
    __shared__ float sh_v[QC_SAMPLE_WARPS];
    __shared__ int hist_n[256];          /* radix histograms: counts, and masses for top-p */
    __shared__ double hist_m[256];
    __shared__ int chosen, above_n;      /* qc_walk_bins' answer */
    __shared__ double above_m;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float temperature = st->temperature, penalty = st->repeat_penalty;
    const int n_history = st->n_history;
    const int32_t *history = (const int32_t *)(st + 1);   /* qc_sample_history, on the device */

    /* non-finite handling: NaN is never chosen; -0 becomes +0 so that keys order like floats */
    for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
        const float x = logits[i];
        v[i] = x != x ? -INFINITY : (x == 0.0f ? 0.0f : x);
    }
    __syncthreads();

    /* repetition penalty, once per distinct token: the lowest history slot naming a token
     * applies it (marks in the mass area, which is not in use yet) */
    if (penalty != 1.0f && n_history > 0) {
        int *mark = (int *)mass;
        for (int h = tid; h < n_history; h += QC_SAMPLE_THREADS)
            if (history[h] >= 0 && history[h] < n) mark[history[h]] = INT_MAX;
        __syncthreads();
        for (int h = tid; h < n_history; h += QC_SAMPLE_THREADS)
            if (history[h] >= 0 && history[h] < n) atomicMin(&mark[history[h]], h);
        __syncthreads();
        for (int h = tid; h < n_history; h += QC_SAMPLE_THREADS) {
            const int t = history[h];
            if (t >= 0 && t < n && mark[t] == h) v[t] = v[t] > 0.0f ? v[t] / penalty : v[t] * penalty;
        }
        __syncthreads();
    }

    /* the best value and its first index */
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = tid; i < n; i += QC_SAMPLE_THREADS)
        if (v[i] > bv || bi == INT_MAX) { bv = v[i]; bi = i; }
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sh_v[warp] = bv; sh_i[warp] = bi; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < QC_SAMPLE_WARPS; w++)
            if (sh_v[w] > bv || (sh_v[w] == bv && sh_i[w] < bi)) { bv = sh_v[w]; bi = sh_i[w]; }
        memset(&p, 0, sizeof p);
        p.vmax = bv;
        p.best = bi;
        p.cut = bv - QC_CANDIDATE_NATS * (temperature > 1.0f ? temperature : 1.0f);
    }
    __syncthreads();
    if (p.vmax == -INFINITY || p.vmax == INFINITY || temperature <= 0.0f) {
        /* nothing can be chosen / greedy / certain: no draw */
        if (tid == 0) {
            result->token = p.vmax == -INFINITY ? -1 : p.best;
            result->rng = st->rng;
            result->pad = 0;
        }
        return;
    }
    const float vmax = p.vmax;

    /* top-k: the k best, by a radix select over the keys of the candidates */
    if (st->top_k > 0) {
        int count = 0;
        for (int i = tid; i < n; i += QC_SAMPLE_THREADS) count += v[i] >= p.cut;
        const int n_cand = (int)qc_block_sum((double)count, sh_d);
        if (st->top_k < n_cand) {
            uint32_t prefix = 0, mask = 0;
            int need = st->top_k;   /* tokens still to take at or below the current prefix */
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int b = tid; b < 256; b += QC_SAMPLE_THREADS) hist_n[b] = 0;
                __syncthreads();
                for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
                    const uint32_t k = qc_key(v[i]);
                    if (v[i] >= p.cut && (k & mask) == prefix) atomicAdd(&hist_n[(k >> shift) & 255], 1);
                }
                __syncthreads();
                if (warp == 0) qc_walk_bins<int>(hist_n, need, &chosen, &above_n);
                __syncthreads();
                prefix |= (uint32_t)chosen << shift;
                mask |= 255u << shift;
                need -= above_n;
                if (shift == 0 && tid == 0) {
                    p.use_k = 1;
                    p.k_key = prefix;
                    /* every tie fits, or the need-th of them in id order is the last kept */
                    p.k_last = need >= hist_n[chosen] ? INT_MAX : -1;
                }
                __syncthreads();
            }
            if (p.k_last == -1) {
                const uint32_t kk = p.k_key;
                const int last = qc_first_reaching(n, (double)need, false, [&](int i) {
                    return v[i] >= p.cut && qc_key(v[i]) == kk ? 1.0 : 0.0;
                }, sh_i);
                if (tid == 0) p.k_last = last;
                __syncthreads();
            }
        }
    }

    /* top-p: the smallest set of the best tokens whose softmax (temperature 1) reaches top_p,
     * by the same radix walk with each bucket weighted by its mass */
    if (st->top_p < 1.0f) {
        double own = 0.0;
        for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
            const double m = qc_in_top_k(p, v[i], i) ? exp((double)v[i] - vmax) : 0.0;
            mass[i] = m;
            own += m;
        }
        const double target = (double)st->top_p * qc_block_sum(own, sh_d);
        uint32_t prefix = 0, mask = 0;
        double got = 0.0;   /* mass of the keys above the current prefix */
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += QC_SAMPLE_THREADS) { hist_m[b] = 0.0; hist_n[b] = 0; }
            __syncthreads();
            for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
                const uint32_t k = qc_key(v[i]);
                if (mass[i] > 0.0 && (k & mask) == prefix) {
                    atomicAdd(&hist_m[(k >> shift) & 255], mass[i]);
                    atomicAdd(&hist_n[(k >> shift) & 255], 1);
                }
            }
            __syncthreads();
            if (warp == 0) qc_walk_bins<double>(hist_m, target - got, &chosen, &above_m);
            __syncthreads();
            prefix |= (uint32_t)chosen << shift;
            mask |= 255u << shift;
            got += above_m;
            if (shift == 0 && tid == 0) {
                p.use_p = 1;
                p.p_key = prefix;
                /* a lone token at the boundary is kept (the mass before it is short of target) */
                p.p_last = hist_n[chosen] <= 1 ? INT_MAX : -1;
            }
            __syncthreads();
        }
        if (p.p_last == -1) {
            /* ties at the boundary value, in id order, until the mass reaches target */
            const uint32_t pk = p.p_key;
            const int last = qc_first_reaching(n, target - got, false, [&](int i) {
                return qc_key(v[i]) == pk ? mass[i] : 0.0;
            }, sh_i);
            if (tid == 0) p.p_last = last;
            __syncthreads();
        }
    }

    /* min-p: keep p >= min_p * p_max, i.e. logit >= max + log(min_p) */
    if (tid == 0 && st->min_p > 0.0f) {
        p.use_min = 1;
        p.min_v = (double)vmax + log((double)st->min_p);
    }
    __syncthreads();

    /* temperature, then one draw from the survivors, walked in id order */
    const float inv_t = 1.0f / temperature;
    double own = 0.0;
    int last = -1;
    for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
        if (qc_survives(p, v[i], i)) {
            own += (double)expf((v[i] - vmax) * inv_t);
            last = i;
        }
    }
    const double total = qc_block_sum(own, sh_d);
    last = -qc_block_min(-last, sh_i);
    uint64_t rng = st->rng;
    const double r = qc_rng_uniform(&rng) * total;
    /* the host picks the first survivor whose cumulative weight exceeds r */
    const int token = qc_first_reaching(n, r, true, [&](int i) {
        return qc_survives(p, v[i], i) ? (double)expf((v[i] - vmax) * inv_t) : 0.0;
    }, sh_i);
    if (tid == 0) {
        result->token = token == INT_MAX ? last : token;
        result->rng = rng;
        result->pad = 0;
    }
}

int qc_cuda_sample(qc_backend *be, const float *logits, int64_t n_vocab, const void *state,
                   void *work, void *result) {
    if (n_vocab <= 0 || n_vocab > INT32_MAX)
        return qc_cuda_value_error(be, "sample: %lld logits", (long long)n_vocab);
    float *v = (float *)work;
    double *mass = (double *)((char *)work + (((size_t)n_vocab * sizeof(float) + 7) & ~(size_t)7));
    qc_sample_kernel<<<1, QC_SAMPLE_THREADS, 0, qc_cuda_of(be)->stream>>>(
        logits, (int)n_vocab, (const qc_sample_state *)state, v, mass, (qc_sample_result *)result);
    return QC_LAUNCHED(be, "qc_sample_kernel");
}
