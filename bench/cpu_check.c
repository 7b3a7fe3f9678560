/* cpu_check.c: C-level correctness checks of the CPU backend's ops against naive float64
 * references, then the decode/prefill matmul timings.
 *
 *   gcc -std=c11 -O3 -pthread -Icsrc/engine -Icsrc/cpu bench/cpu_check.c csrc/engine/quants.c csrc/engine/common.c \
 *       csrc/engine/backend.c csrc/engine/sampler.c csrc/cpu/\*.c -lm -o /tmp/cpu_check && /tmp/cpu_check [threads]
 *
 * Prints one line per check and exits 1 if any failed. Tolerances are stated per check as
 * |got - ref| <= atol + rtol * scale, with the scale named. The checks run the float32
 * reference ops (device "cpu:float"), whose tolerances these are; the fast kernels' 8-bit
 * activations are checked by tests/test_kernels.py. The timings run the fast kernels ("cpu").
 */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "quants.h"
#define BENCH_RNG_SEED 0x243F6A8885A308D3ull
#include "bench_common.h"

static int failures = 0;

static void check(int ok, const char *what) {
    printf("%s  %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

static float frand(void) { return (float)(rnd() % 20001) / 10000.0f - 1.0f; }   /* [-1, 1] */

static float scale_value(void) { return 0.002f * frand(); }

/* A random weight of the given type, with finite values. */
static void *make_weight(uint32_t t, int64_t rows, int64_t cols, qc_weight *w) {
    const qc_type_traits *tr = qc_type_get(t);
    int64_t rb = qc_row_bytes(t, cols);
    size_t bytes = (size_t)(rows * rb);
    uint8_t *p = malloc(bytes + 64);
    if (t == QC_TYPE_F32) for (int64_t i = 0; i < rows * cols; i++) ((float *)p)[i] = frand();
    else if (t == QC_TYPE_F16) for (int64_t i = 0; i < rows * cols; i++) ((uint16_t *)p)[i] = qc_fp32_to_fp16(frand());
    else if (t == QC_TYPE_BF16) for (int64_t i = 0; i < rows * cols; i++) { float f = frand(); uint32_t u; memcpy(&u, &f, 4); ((uint16_t *)p)[i] = (uint16_t)(u >> 16); }
    else {
        for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)rnd();
        for (size_t i = 0; i < bytes; i += (size_t)tr->type_size) set_block_scales(t, p + i, scale_value);
    }
    w->type = t; w->rows = rows; w->cols = cols; w->nbytes = bytes; w->host = p; w->data = NULL;
    return p;
}

static void check_matmul(qc_backend *be, uint32_t t, int64_t rows, int64_t cols, int n) {
    qc_weight w;
    void *mem = make_weight(t, rows, cols, &w);
    be->ops->weight_load(be, &w);
    float *wf = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * n * cols);
    float *bias = malloc(sizeof(float) * rows), *out = malloc(sizeof(float) * n * rows);
    float *one = malloc(sizeof(float) * rows);
    qc_dequantize(t, w.host, wf, rows, cols, NULL);
    for (int64_t i = 0; i < n * cols; i++) x[i] = frand();
    for (int64_t i = 0; i < rows; i++) bias[i] = 10.0f * frand();
    int rc = be->ops->matmul(be, &w, bias, x, n, out);
    double worst = 0;
    int identical = 1;
    for (int tk = 0; tk < n && rc == 0; tk++) {
        for (int64_t r = 0; r < rows; r++) {
            double ref = bias[r], mag = fabs(bias[r]);
            for (int64_t c = 0; c < cols; c++) {
                ref += (double)wf[r * cols + c] * x[tk * cols + c];
                mag += fabs((double)wf[r * cols + c] * x[tk * cols + c]);
            }
            double err = fabs(out[tk * rows + r] - ref) / (mag + 1e-30);
            if (err > worst) worst = err;
        }
        /* the same token alone must give the same bits */
        be->ops->matmul(be, &w, bias, x + tk * cols, 1, one);
        if (memcmp(one, out + tk * rows, sizeof(float) * rows) != 0) identical = 0;
    }
    char msg[200];
    snprintf(msg, sizeof msg, "matmul %-4s %5lld x %5lld n=%-3d |err| <= 2e-6 * (sum|w x| + |b|): "
             "worst %.2e; n=1 bit-identical: %s", qc_type_get(t)->name, (long long)rows,
             (long long)cols, n, worst, identical ? "yes" : "NO");
    check(rc == 0 && worst <= 2e-6 && identical, msg);
    be->ops->weight_free(be, &w);
    free(mem); free(wf); free(x); free(bias); free(out); free(one);
}

static void check_embed(qc_backend *be) {
    qc_weight w;
    void *mem = make_weight(QC_TYPE_Q6_K, 50, 512, &w);
    be->ops->weight_load(be, &w);
    int32_t ids[4] = {3, 49, 0, 3};
    float out[4 * 512], ref[512];
    int ok = be->ops->embed(be, &w, ids, 4, out) == 0;
    for (int i = 0; i < 4 && ok; i++) {
        qc_dequantize(QC_TYPE_Q6_K, (const uint8_t *)w.host + (size_t)ids[i] * 210 * 2, ref, 1, 512, NULL);
        ok = memcmp(ref, out + i * 512, sizeof ref) == 0;
    }
    check(ok, "embed Q6_K rows are the dequantized rows, bit for bit");
    int32_t bad[2] = {1, 50};
    check(be->ops->embed(be, &w, bad, 2, out) < 0 && be->err.kind == QC_ERR_RANGE,
          "embed: id 50 of a 50-row table fails with QC_ERR_RANGE");
    free(mem);
}

static void check_rmsnorm(qc_backend *be) {
    enum { N = 5, D = 896 };
    static float x[N * D], w[D], out[N * D];
    for (int i = 0; i < N * D; i++) x[i] = 30.0f * frand();
    for (int i = 0; i < D; i++) w[i] = frand();
    double worst = 0;
    int rc = be->ops->rmsnorm(be, x, w, N, D, 1e-6f, out);
    for (int t = 0; t < N; t++) {
        double ss = 0;
        for (int i = 0; i < D; i++) ss += (double)x[t * D + i] * x[t * D + i];
        double sc = 1.0 / sqrt(ss / D + 1e-6);
        for (int i = 0; i < D; i++) {
            double ref = x[t * D + i] * sc * w[i];
            double err = fabs(out[t * D + i] - ref) / (fabs(ref) + 1e-30);
            if (err > worst) worst = err;
        }
    }
    char msg[160];
    snprintf(msg, sizeof msg, "rmsnorm |err| <= 3e-7 * |ref|: worst %.2e", worst);
    check(rc == 0 && worst <= 3e-7, msg);
    /* in place */
    memcpy(out, x, sizeof x);
    static float out2[N * D];
    be->ops->rmsnorm(be, x, w, N, D, 1e-6f, out2);
    be->ops->rmsnorm(be, out, w, N, D, 1e-6f, out);
    check(memcmp(out, out2, sizeof out) == 0, "rmsnorm in place (out == x) gives the same bits");
}

static void check_rope(qc_backend *be) {
    enum { N = 4, H = 3, HD = 64 };
    static float x[N * H * HD], x0[N * H * HD];
    int32_t pos[N] = {0, 1, 1000, 32767};
    for (int i = 0; i < N * H * HD; i++) x0[i] = x[i] = frand();
    int rc = be->ops->rope(be, x, pos, N, H, HD, 1e6f);
    double worst = 0;
    for (int t = 0; t < N; t++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < HD / 2; i++) {
                const float *v = x0 + (t * H + h) * HD;
                double a = pos[t] * pow(1e6, -2.0 * i / HD);
                double r0 = v[i] * cos(a) - v[i + HD / 2] * sin(a);
                double r1 = v[i] * sin(a) + v[i + HD / 2] * cos(a);
                const float *g = x + (t * H + h) * HD;
                worst = fmax(worst, fmax(fabs(g[i] - r0), fabs(g[i + HD / 2] - r1)));
            }
    char msg[160];
    snprintf(msg, sizeof msg, "rope NEOX theta=1e6 positions up to 32767: |err| <= 4e-7 (|x| <= 1): worst %.2e", worst);
    check(rc == 0 && worst <= 4e-7, msg);
}

static void naive_attention(const float *q, const float *kc, const float *vc, const int32_t *pos, int n,
                            int n_kv, int nh, int nkv, int hd, double *out, double *probs) {
    int group = nh / nkv, kvd = nkv * hd;
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < n; t++) {
            double s[512], m = -INFINITY, sum = 0;
            for (int k = 0; k <= pos[t]; k++) {
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)q[(t * nh + h) * hd + i] * kc[k * kvd + (h / group) * hd + i];
                s[k] = d / sqrt((double)hd);
                if (s[k] > m) m = s[k];
            }
            for (int k = 0; k <= pos[t]; k++) { s[k] = exp(s[k] - m); sum += s[k]; }
            for (int k = 0; k < n_kv; k++) probs[(h * n + t) * n_kv + k] = k <= pos[t] ? s[k] / sum : 0;
            for (int i = 0; i < hd; i++) {
                double o = 0;
                for (int k = 0; k <= pos[t]; k++) o += s[k] / sum * vc[k * kvd + (h / group) * hd + i];
                out[(t * nh + h) * hd + i] = o;
            }
        }
}

static void check_attention(qc_backend *be) {
    enum { NH = 14, NKV = 2, HD = 64, NCTX = 40, N = 7 };
    static float q[N * NH * HD], kc[NCTX * NKV * HD], vc[NCTX * NKV * HD], out[N * NH * HD];
    static float scores[NH * N * NCTX], probs[NH * N * NCTX];
    static double rout[N * NH * HD], rprobs[NH * N * NCTX];
    int32_t pos[N] = {30, 31, 32, 33, 34, 35, 36};     /* a prefill after 30 cached tokens */
    int n_kv = pos[N - 1] + 1;
    for (int i = 0; i < N * NH * HD; i++) q[i] = 3.0f * frand();
    for (int i = 0; i < NCTX * NKV * HD; i++) { kc[i] = 3.0f * frand(); vc[i] = frand(); }
    const qc_kv_cache cache = {kc, vc, QC_KV_F32};
    int rc = be->ops->attention(be, q, cache, pos, N, n_kv, NH, NKV, HD, out, scores, probs);
    naive_attention(q, kc, vc, pos, N, n_kv, NH, NKV, HD, rout, rprobs);
    double wo = 0, wp = 0;
    int masks = 1;
    for (int i = 0; i < N * NH * HD; i++) wo = fmax(wo, fabs(out[i] - rout[i]));
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < N; t++)
            for (int k = 0; k < n_kv; k++) {
                int at = (h * N + t) * n_kv + k;
                wp = fmax(wp, fabs(probs[at] - rprobs[at]));
                if (k > pos[t] && !(isinf(scores[at]) && scores[at] < 0 && probs[at] == 0.0f)) masks = 0;
                if (k <= pos[t] && !isfinite(scores[at])) masks = 0;
            }
    char msg[200];
    snprintf(msg, sizeof msg, "attention GQA 14/2 heads, 7 queries at 30..36: |out err| <= 1e-5 (|v| <= 1): %.2e, "
             "|p err| <= 1e-6: %.2e, masks -inf/0: %s", wo, wp, masks ? "yes" : "NO");
    check(rc == 0 && wo <= 1e-5 && wp <= 1e-6 && masks, msg);
    /* the same queries one at a time (decode) give the same bits, scores/probs off */
    static float one[NH * HD];
    int same = 1;
    for (int t = 0; t < N; t++) {
        be->ops->attention(be, q + t * NH * HD, cache, pos + t, 1, pos[t] + 1, NH, NKV, HD, one, NULL, NULL);
        if (memcmp(one, out + t * NH * HD, sizeof one) != 0) same = 0;
    }
    check(same, "attention: each query alone (decode) gives the prefill's bits");
    int32_t badpos[1] = {n_kv};
    check(be->ops->attention(be, q, cache, badpos, 1, n_kv, NH, NKV, HD, out, NULL, NULL) < 0,
          "attention: a position >= n_kv fails");
}

static void check_elementwise(qc_backend *be) {
    enum { C = 100003 };
    static float g[C], u[C], out[C];
    for (int i = 0; i < C; i++) { g[i] = 20.0f * frand(); u[i] = frand(); }
    g[0] = -200.0f; g[1] = 200.0f;
    int rc = be->ops->swiglu(be, g, u, C, out);
    double worst = 0;
    for (int i = 0; i < C; i++) {
        double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        worst = fmax(worst, fabs(out[i] - ref) / (fabs(ref) + 1e-30));
    }
    char msg[160];
    snprintf(msg, sizeof msg, "swiglu |err| <= 4e-7 * |ref| for |g| <= 200: worst %.2e", worst);
    check(rc == 0 && worst <= 4e-7 && isfinite(out[0]) && isfinite(out[1]), msg);
    memcpy(out, g, sizeof g);
    rc = be->ops->add(be, out, u, C, out);
    int ok = rc == 0;
    for (int i = 0; i < C && ok; i++) ok = out[i] == g[i] + u[i];
    check(ok, "add, out aliasing a: exact");
    float row[12] = {1, 5, NAN, 5, -INFINITY, 2, NAN, NAN, NAN, -1, -1, -2};
    int32_t am[3] = {-1, -1, -1};
    rc = be->ops->argmax(be, row, 3, 4, am);
    /* rows: {1,5,nan,5} -> 1 (first of the ties); {-inf,2,nan,nan} -> 1; {nan,-1,-1,-2} -> 1 */
    check(rc == 0 && am[0] == 1 && am[1] == 1 && am[2] == 1, "argmax: first max on ties, NaN never wins");
}

static void bench_matmul(qc_backend *be, uint32_t t, int64_t rows, int64_t cols, int n, int reps) {
    fflush(stdout);
    qc_weight w;
    void *mem = make_weight(t, rows, cols, &w);
    be->ops->weight_load(be, &w);
    float *x = malloc(sizeof(float) * n * cols), *out = malloc(sizeof(float) * n * rows);
    for (int64_t i = 0; i < n * cols; i++) x[i] = frand();
    be->ops->matmul(be, &w, NULL, x, n, out);   /* warm caches */
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        be->ops->matmul(be, &w, NULL, x, n, out);
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("matmul %-4s %5lld x %4lld  n=%-3d  %d threads: %8.3f ms  %6.2f GB/s of weights  %6.2f GFLOP/s\n",
           qc_type_get(t)->name, (long long)rows, (long long)cols, n, be->threads, best * 1e3,
           (double)w.nbytes / best * 1e-9, 2.0 * rows * cols * n / best * 1e-9);
    free(mem); free(x); free(out);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    qc_backend *be = NULL;
    qc_error err = {0};
    if (qc_backend_create("cpu:float", threads, &be, &err) < 0) {
        printf("create failed: %s\n", err.msg);
        return 1;
    }
    uint32_t types[] = {QC_TYPE_F32, QC_TYPE_F16, QC_TYPE_BF16, QC_TYPE_Q4_0, QC_TYPE_Q4_1,
                        QC_TYPE_Q5_0, QC_TYPE_Q5_1, QC_TYPE_Q8_0, QC_TYPE_Q2_K, QC_TYPE_Q3_K,
                        QC_TYPE_Q4_K, QC_TYPE_Q5_K, QC_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        check_matmul(be, types[i], 37, 512, 1);
        check_matmul(be, types[i], 101, 768, 5);
    }
    check_matmul(be, QC_TYPE_Q8_0, 896, 896, 64);
    check_matmul(be, QC_TYPE_Q4_K, 300, 4864, 3);
    check_embed(be);
    check_rmsnorm(be);
    check_rope(be);
    check_attention(be);
    check_elementwise(be);
    /* thread count does not change results */
    {
        qc_backend *b1 = NULL, *b3 = NULL;
        qc_backend_create("cpu:float", 1, &b1, &err);
        qc_backend_create("cpu:float", 3, &b3, &err);
        qc_weight w;
        void *mem = make_weight(QC_TYPE_Q5_0, 333, 896, &w);
        w.data = (void *)w.host;
        float *x = malloc(sizeof(float) * 9 * 896), *o1 = malloc(sizeof(float) * 9 * 333), *o3 = malloc(sizeof(float) * 9 * 333);
        for (int i = 0; i < 9 * 896; i++) x[i] = frand();
        b1->ops->matmul(b1, &w, NULL, x, 9, o1);
        b3->ops->matmul(b3, &w, NULL, x, 9, o3);
        check(memcmp(o1, o3, sizeof(float) * 9 * 333) == 0, "matmul: 1 and 3 threads give the same bits");
        qc_backend_destroy(b1);
        qc_backend_destroy(b3);
        free(mem); free(x); free(o1); free(o3);
    }
    printf("%s: %d failure(s)\n\n", failures ? "FAILED" : "all passed", failures);
    qc_backend_destroy(be);
    be = NULL;
    if (qc_backend_create("cpu", threads, &be, &err) < 0) {
        printf("create failed: %s\n", err.msg);
        return 1;
    }

    /* Qwen2.5-0.5B shapes as (rows, cols) = (out, in) = GGUF ne reversed: attn_q/o 896 x 896,
     * ffn_down 896 x 4864 (GGUF ne [4864, 896], the only FFN weight a K format can hold, as 896
     * is not a multiple of 256), ffn_gate/up 4864 x 896, lm_head 151936 x 896. */
    bench_matmul(be, QC_TYPE_Q8_0, 896, 896, 1, 200);
    bench_matmul(be, QC_TYPE_Q8_0, 896, 896, 64, 10);
    bench_matmul(be, QC_TYPE_Q4_K, 896, 4864, 1, 50);
    bench_matmul(be, QC_TYPE_Q4_K, 896, 4864, 64, 5);
    bench_matmul(be, QC_TYPE_Q6_K, 896, 4864, 1, 50);
    bench_matmul(be, QC_TYPE_Q6_K, 896, 4864, 64, 5);
    bench_matmul(be, QC_TYPE_Q5_0, 4864, 896, 1, 50);
    bench_matmul(be, QC_TYPE_Q5_0, 4864, 896, 64, 5);
    bench_matmul(be, QC_TYPE_F16, 4864, 896, 1, 50);
    bench_matmul(be, QC_TYPE_Q8_0, 151936, 896, 1, 3);
    qc_backend_destroy(be);
    return failures ? 1 : 0;
}
