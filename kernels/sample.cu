/* sample.cu: one draw on the device, following csrc/engine/sampler.c (qc_sample_row) step by step, so
 * that a decode step samples inside its CUDA graph and hands back 16 bytes instead of a row of
 * logits.
 *
 * One block of 1024 threads does the whole chain: a row is ~150k values that stay in L2, a pass
 * over them costs microseconds, and one block needs no grid-wide synchronisation. Where the host
 * sorts, the device selects a boundary, which gives the same set:
 *  - top-k: the k-th best value; ties at it are taken in id order, as the host's
 *    (value desc, id asc) order does;
 *  - top-p: the value at which the cumulative temperature-1 mass of the best tokens reaches
 *    top_p; ties at it in id order.
 * A boundary is found in two steps (qc_select_boundary): a histogram of the candidates over
 * 2048 linear value bins below the best (a token's bin follows its value, and the bins spread
 * the atomics: the top bits of float keys are nearly all alike), then an exact radix select
 * over the integer keys of the few tokens of the bin where the boundary lies.
 * The draw walks the survivors in id order, as the host does, so the same uniform number picks
 * the same token. Probability masses and the draw's running sums are double, as on the host.
 *
 * work (qc_sample_work_bytes(n) bytes): the penalised logits v[n] (floats), the temperature-1
 * masses of the candidates (doubles; their first n ints serve as the penalty's duplicate marks
 * before that), and the ids of the boundary bin (ints).
 */
#include "qc_cuda.cuh"
#include "sampler.h"

#include <limits.h>

#define QC_SAMPLE_THREADS 1024
#define QC_SAMPLE_WARPS (QC_SAMPLE_THREADS / 32)
#define QC_SAMPLE_ITEMS 8   /* consecutive ids per thread in the id-order scans */
#define QC_SAMPLE_BINS 2048 /* linear value bins of a boundary search's first step */

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
    float vmax, cut;          /* the best value; candidates are >= cut */
    int best;                 /* first index of vmax */
    int use_k, use_p;
    uint32_t k_key, p_key;    /* the k-th best key; the key where top-p's mass is reached */
    int k_last, p_last;       /* ties at those keys are kept up to this id */
    int use_min;
    double min_v;             /* min-p: logits >= this stay */
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

/* Where the cumulative weight of the candidates, taken best first (value desc, id asc), reaches
 * need: the boundary's key, and the last id kept among the tokens with that key (INT_MAX: all
 * of them). Every thread calls it; the answer is in *out for all after it returns.
 * T is int (top-k: weight 1 per token) or double (top-p: the token's mass). */
struct qc_boundary {
    uint32_t key;
    int last;
};

template <typename T, class Cand, class Weight>
__device__ void qc_select_boundary(int n, T need, Cand is_cand, Weight weight, const float *v,
                                   float vmax, float cut, int *list, qc_boundary *out) {
    __shared__ T hist[QC_SAMPLE_BINS];
    __shared__ int count[256];
    __shared__ int edge, n_list, chosen;
    __shared__ T above;
    const int tid = threadIdx.x, lane = tid & 31;
    const float inv_width = QC_SAMPLE_BINS / (vmax - cut);
    auto bin_of = [&](float x) {
        const int b = (int)((vmax - x) * inv_width);
        return b < QC_SAMPLE_BINS - 1 ? b : QC_SAMPLE_BINS - 1;
    };

    /* 1. the candidates' weight per linear value bin; the bin where need is reached */
    for (int b = tid; b < QC_SAMPLE_BINS; b += QC_SAMPLE_THREADS) hist[b] = 0;
    if (tid == 0) n_list = 0;
    __syncthreads();
    for (int i = tid; i < n; i += QC_SAMPLE_THREADS)
        if (is_cand(i)) atomicAdd(&hist[bin_of(v[i])], weight(i));
    __syncthreads();
    if (tid < 32) {
        /* bins in order (value descending), 256 per round, 8 per lane */
        T run = 0, last_above = 0;
        int found = -1, last_bin = 0;
        for (int c = 0; c < QC_SAMPLE_BINS && found < 0; c += 256) {
            T part[8], own = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { part[j] = hist[c + 8 * lane + j]; own += part[j]; }
            T incl = own;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const T y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            T r = run + (incl - own);
            int my_bin = -1, my_last = -1;
            T my_above = 0, my_last_above = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (part[j] > 0) {
                    if (my_bin < 0 && r + part[j] >= need) { my_bin = c + 8 * lane + j; my_above = r; }
                    my_last = c + 8 * lane + j;
                    my_last_above = r;
                }
                r += part[j];
            }
            const unsigned hit = __ballot_sync(0xffffffffu, my_bin >= 0);
            const unsigned filled = __ballot_sync(0xffffffffu, my_last >= 0);
            if (hit) {
                const int src = __ffs(hit) - 1;
                found = __shfl_sync(0xffffffffu, my_bin, src);
                last_above = __shfl_sync(0xffffffffu, my_above, src);
            } else if (filled) {
                const int src = 31 - __clz(filled);
                last_bin = __shfl_sync(0xffffffffu, my_last, src);
                last_above = __shfl_sync(0xffffffffu, my_last_above, src);
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
        /* rounding may leave the total short of need: then everything down to the last
         * non-empty bin is kept */
        if (lane == 0) {
            edge = found >= 0 ? found : last_bin;
            above = last_above;
        }
    }
    __syncthreads();

    /* 2. the ids of that bin (one atomic per warp) */
    const int e = edge;
    for (int base = 0; base < n; base += QC_SAMPLE_THREADS) {
        const int i = base + tid;
        const bool in = i < n && is_cand(i) && bin_of(v[i]) == e;
        const unsigned m = __ballot_sync(0xffffffffu, in);
        int at = 0;
        if (lane == 0 && m) at = atomicAdd(&n_list, __popc(m));
        at = __shfl_sync(0xffffffffu, at, 0);
        if (in) list[at + __popc(m & ((1u << lane) - 1))] = i;
    }
    __syncthreads();

    /* 3. radix select over their keys, 8 bits at a time */
    T left = need - above;   /* weight still to take within the bin */
    uint32_t prefix = 0, mask = 0;
    const int len = n_list;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += QC_SAMPLE_THREADS) { hist[b] = 0; count[b] = 0; }
        __syncthreads();
        for (int li = tid; li < len; li += QC_SAMPLE_THREADS) {
            const int i = list[li];
            const uint32_t k = qc_key(v[i]);
            if ((k & mask) == prefix) {
                atomicAdd(&hist[(k >> shift) & 255], weight(i));
                atomicAdd(&count[(k >> shift) & 255], 1);
            }
        }
        __syncthreads();
        if (tid < 32) qc_walk_bins<T>(hist, left, &chosen, &above);
        __syncthreads();
        prefix |= (uint32_t)chosen << shift;
        mask |= 255u << shift;
        left -= above;
        __syncthreads();   /* above and chosen are rewritten by the next round */
    }

    /* 4. ties at the boundary key: all of them when they fit, else in id order */
    const int ties = count[chosen];
    const bool all_fit = sizeof(T) == sizeof(int) ? (double)left >= (double)ties : ties <= 1;
    int last = INT_MAX;
    if (!all_fit) {
        const uint32_t key = prefix;
        last = qc_first_reaching(n, (double)left, false, [&](int i) {
            return is_cand(i) && qc_key(v[i]) == key ? (double)weight(i) : 0.0;
        }, count);
    }
    if (tid == 0) {
        out->key = prefix;
        out->last = last;
    }
    __syncthreads();
}

/* Is candidate (v, i) better than (bv, bi)? The larger value; of equal values the first id.
 * bi == INT_MAX: none yet. */
__device__ __forceinline__ bool qc_sample_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

/* This thread's best (value, first id) over x[lo .. hi) taken every QC_SAMPLE_THREADS ids,
 * NaN as -inf; bi = INT_MAX for none. */
__device__ __forceinline__ void qc_sample_thread_best(const float *x, int lo, int hi, float &bv, int &bi) {
    bv = -INFINITY;
    bi = INT_MAX;
    for (int i = lo + threadIdx.x; i < hi; i += QC_SAMPLE_THREADS) {
        const float v = x[i] != x[i] ? -INFINITY : x[i];
        if (v > bv || bi == INT_MAX) { bv = v; bi = i; }
    }
}

/* The block's best (value, first id) over its threads' (bv, bi), in thread 0. */
__device__ __forceinline__ void qc_sample_block_best(float &bv, int &bi, float *sh_v, int *sh_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (qc_sample_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sh_v[warp] = bv; sh_i[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < QC_SAMPLE_WARPS; w++)
            if (qc_sample_better(sh_v[w], sh_i[w], bv, bi)) { bv = sh_v[w]; bi = sh_i[w]; }
}

/* The greedy draw without a penalty (the common decode): the first largest logit, NaN never
 * chosen. One block's pass over 150k logits is slow: the argmax kernel's, the same pass, took
 * 12.6 us of a 0.5B decode step on the H100 (report 7a3514d). So the QC_SAMPLE_BLOCKS blocks
 * of the launch each take a slice and publish their best (part); the last to finish (done: a
 * counter, back to 0 after it) combines them in block order, so ties still go to the first id. */
__device__ void qc_sample_greedy(const float *__restrict__ logits, int n, const qc_sample_state *st,
                                 qc_sample_result *result, int2 *part, unsigned int *done, float *sh_v,
                                 int *sh_i) {
    __shared__ bool last_block;
    const int per = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per, hi = min(n, lo + per);
    float bv;
    int bi;
    qc_sample_thread_best(logits, lo, hi, bv, bi);
    qc_sample_block_best(bv, bi, sh_v, sh_i);
    if (threadIdx.x == 0) {
        part[blockIdx.x] = make_int2(__float_as_int(bv), bi);
        __threadfence();   /* the partial is visible before it is counted */
        last_block = atomicAdd(done, 1u) == gridDim.x - 1;
        if (last_block) {
            *done = 0;     /* ready for the next launch */
            __threadfence();
            bv = -INFINITY;
            bi = INT_MAX;
            for (int b = 0; b < (int)gridDim.x; b++) {
                const int2 pb = __ldcg(part + b);
                if (qc_sample_better(__int_as_float(pb.x), pb.y, bv, bi)) { bv = __int_as_float(pb.x); bi = pb.y; }
            }
            /* every logit NaN or -inf: nothing can be chosen */
            result->token = bv == -INFINITY ? -1 : bi;
            result->rng = st->rng;
            result->pad = 0;
        }
    }
}

__global__ void __launch_bounds__(QC_SAMPLE_THREADS)
qc_sample_kernel(const float *__restrict__ logits, int n, const qc_sample_state *__restrict__ st,
                 float *__restrict__ v, double *__restrict__ mass, int *__restrict__ list,
                 qc_sample_result *__restrict__ result, int2 *part, unsigned int *done) {
    __shared__ qc_sample_plan p;
    __shared__ double sh_d[QC_SAMPLE_WARPS];
    __shared__ int sh_i[QC_SAMPLE_WARPS];
    __shared__ float sh_v[QC_SAMPLE_WARPS];
    __shared__ qc_boundary sel;
    qc_grid_start();
    const int tid = threadIdx.x;
    const float temperature = st->temperature, penalty = st->repeat_penalty;
    const int n_history = st->n_history;
    const int32_t *history = (const int32_t *)(st + 1);   /* qc_sample_history, on the device */

    /* greedy without a penalty: every block (qc_sample_greedy); anything else: block 0 alone */
    if (qc_sample_plain_greedy(st)) {
        qc_sample_greedy(logits, n, st, result, part, done, sh_v, sh_i);
        return;
    }
    if (blockIdx.x != 0) return;

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

    /* the best value and its first index (v holds no NaN) */
    float bv;
    int bi;
    qc_sample_thread_best(v, 0, n, bv, bi);
    qc_sample_block_best(bv, bi, sh_v, sh_i);
    if (tid == 0) {
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

    /* top-k: the k best */
    if (st->top_k > 0) {
        int count = 0;
        for (int i = tid; i < n; i += QC_SAMPLE_THREADS) count += v[i] >= p.cut;
        const int n_cand = (int)qc_block_sum((double)count, sh_d);
        if (st->top_k < n_cand) {
            qc_select_boundary<int>(n, st->top_k, [&](int i) { return v[i] >= p.cut; },
                                    [&](int i) { return 1; }, v, p.vmax, p.cut, list, &sel);
            if (tid == 0) {
                p.use_k = 1;
                p.k_key = sel.key;
                p.k_last = sel.last;
            }
            __syncthreads();
        }
    }

    /* top-p: the smallest set of the best tokens whose softmax (temperature 1) reaches top_p */
    if (st->top_p < 1.0f) {
        double own = 0.0;
        for (int i = tid; i < n; i += QC_SAMPLE_THREADS) {
            const double m = qc_in_top_k(p, v[i], i) ? exp((double)v[i] - vmax) : 0.0;
            mass[i] = m;
            own += m;
        }
        const double target = (double)st->top_p * qc_block_sum(own, sh_d);
        qc_select_boundary<double>(n, target, [&](int i) { return mass[i] > 0.0; },
                                   [&](int i) { return mass[i]; }, v, p.vmax, p.cut, list, &sel);
        if (tid == 0) {
            p.use_p = 1;
            p.p_key = sel.key;
            p.p_last = sel.last;
        }
        __syncthreads();
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
    /* within qc_sample_work_bytes(n) = 32 KiB + 21 n bytes: 4 n + 8 n + 4 n (+ 8 of alignment) */
    float *v = (float *)work;
    double *mass = (double *)((char *)work + (((size_t)n_vocab * sizeof(float) + 7) & ~(size_t)7));
    int *list = (int *)(mass + n_vocab);
    qc_cuda *cu = qc_cuda_of(be);
    qc_launch(cu, qc_sample_kernel, dim3(QC_SAMPLE_BLOCKS), dim3(QC_SAMPLE_THREADS), 0, logits, (int)n_vocab,
              (const qc_sample_state *)state, v, mass, list, (qc_sample_result *)result, cu->sample_part,
              cu->sample_done);
    return QC_LAUNCHED(be, "qc_sample_kernel");
}

/* feed_draw (backend.h): the next decode step's inputs from this step's draw, in device memory,
 * so that the host can queue that step before it has seen the token. */
__global__ void qc_feed_draw_kernel(const qc_sample_result *result, qc_sample_state *state, int32_t *ids,
                                    int32_t *pos, int64_t n_vocab) {
    qc_grid_start();
    const int32_t token = result->token;
    ids[0] = token >= 0 && token < n_vocab ? token : 0;
    pos[0] += 1;
    if (result->rng != 0) state->rng = result->rng;   /* qc_sampler_set_rng's rule */
}

int qc_cuda_feed_draw(qc_backend *be, const void *result, void *state, int32_t *ids, int32_t *pos,
                      int64_t n_vocab) {
    qc_cuda_forget_rope(qc_cuda_of(be));   /* it moves the position */
    qc_launch(qc_cuda_of(be), qc_feed_draw_kernel, dim3(1), dim3(1), 0, (const qc_sample_result *)result,
              (qc_sample_state *)state, ids, pos, n_vocab);
    return QC_LAUNCHED(be, "qc_feed_draw_kernel");
}

/* download_start's copy (cuda_backend.cu says why a kernel): bytes of src into host memory mapped
 * for the device, by one warp's stores. The event recorded after it completes only once they are
 * visible to the host. */
__global__ void qc_to_host_kernel(const uint8_t *src, uint8_t *host, int bytes) {
    qc_grid_start();
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) host[i] = src[i];
}

int qc_cuda_to_host(qc_backend *be, const void *src, void *host, int bytes) {
    qc_launch(qc_cuda_of(be), qc_to_host_kernel, dim3(1), dim3(32), 0, (const uint8_t *)src, (uint8_t *)host, bytes);
    return QC_LAUNCHED(be, "qc_to_host_kernel");
}
