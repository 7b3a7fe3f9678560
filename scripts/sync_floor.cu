// scripts/sync_floor.cu: the floors of a decode step's synchronisation on this GPU, without the
// engine. A 0.5B decode layer is four dependent kernels (qkv_attention, o, gate/up, down), each a
// few microseconds; this measures what a dependency costs when the kernels do nothing:
//   1. a chain of kernels recorded in a CUDA graph, each block reading what the kernel before
//      wrote: plain graph edges, or programmatic dependent launch (griddepcontrol.wait, then
//      launch_dependents: the engine's qc_grid_start), at the engine's grid shapes;
//   2. a grid barrier inside one resident kernel (an atomic count and a spin on it, as the
//      persistent decode kernel's qc_grid_sync), one to four blocks an SM.
// Prints microseconds per kernel and per barrier (the best of 5 graph launches).
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/sync_floor scripts/sync_floor.cu && /tmp/sync_floor
// Measured: bench/results/20261125-8c20074-*, addendum.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__global__ void step_kernel(const float *in, float *out, int pdl) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    float v = __ldcg(in + (blockIdx.x * 7) % gridDim.x);     // what the kernel before wrote
    if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) out[blockIdx.x] = v + 1.0f;
}

__device__ unsigned long long bar_count;
__global__ void barrier_kernel(int rounds, float *buf) {
    unsigned long long base = 0;
    if (threadIdx.x == 0) { unsigned long long v; asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(&bar_count)); base = v - v % gridDim.x; }
    for (int r = 1; r <= rounds; r++) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&bar_count, 1ull);
            unsigned long long v;
            do { asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(&bar_count)); } while (v < base + (unsigned long long)r * gridDim.x);
        }
        __syncthreads();
        if (threadIdx.x == 0) buf[blockIdx.x] += buf[(blockIdx.x + 1) % gridDim.x];
    }
}

static int chain(const int (&sh)[2][2], int pdl, int n, float *a, float *b, cudaStream_t s) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) {
        cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(sh[i & 1][0]); cfg.blockDim = dim3(sh[i & 1][1]); cfg.stream = s;
        cfg.attrs = &attr; cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, step_kernel, (const float *)(i & 1 ? b : a), i & 1 ? a : b, pdl));
    }
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    float best = 1e30f;
    for (int rep = 0; rep < 5; rep++) {
        cudaEventRecord(e0, s); CK(cudaGraphLaunch(ge, s)); cudaEventRecord(e1, s); CK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (ms < best) best = ms;
    }
    printf("chain of %d kernels, %4d x %3d then %4d x %3d, %s: %.3f us a kernel (best of 5)\n", n, sh[0][0], sh[0][1],
           sh[1][0], sh[1][1], pdl ? "PDL      " : "plain    ", best * 1000.0f / n);
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return 0;
}

// Shapes from the command line: "BxT" (a chain of grids of B blocks of T threads) or "B1xT1:B2xT2"
// (grids of the two shapes in turn: what a dependency from one kernel to the next costs when
// they differ, as the o projection's 28 blocks before the gate/up kernel's 152); none: the
// engine's shapes below.
static int parse(const char *arg, int (&sh)[2][2]) {
    int n = sscanf(arg, "%dx%d:%dx%d", &sh[0][0], &sh[0][1], &sh[1][0], &sh[1][1]);
    if (n == 2) sh[1][0] = sh[0][0], sh[1][1] = sh[0][1];
    return n == 2 || n == 4 ? 0 : 1;
}

int main(int argc, char **argv) {
    int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *a, *b; CK(cudaMalloc(&a, 4096 * sizeof(float))); CK(cudaMalloc(&b, 4096 * sizeof(float)));
    CK(cudaMemset(a, 0, 4096 * sizeof(float))); CK(cudaMemset(b, 0, 4096 * sizeof(float)));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const char *engine[] = {"28x256", "112x512", "152x512", "896x256", "4096x256"};
    const int n_args = argc > 1 ? argc - 1 : 5;
    for (int i = 0; i < n_args; i++) {
        int sh[2][2];
        if (parse(argc > 1 ? argv[i + 1] : engine[i], sh)) { printf("bad shape %s\n", argv[i + 1]); return 1; }
        for (int pdl = 0; pdl < 2; pdl++)
            if (chain(sh, pdl, 2000, a, b, s)) return 1;
    }
    if (argc > 1) return 0;
    for (int per_sm = 1; per_sm <= 4; per_sm *= 2) {
        const int blocks = sms * per_sm, rounds = 20000;
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        barrier_kernel<<<blocks, 256, 0, s>>>(100, a); CK(cudaStreamSynchronize(s));
        cudaEventRecord(e0, s); barrier_kernel<<<blocks, 256, 0, s>>>(rounds, a); cudaEventRecord(e1, s);
        CK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        printf("grid barrier, %d blocks (%d an SM): %.3f us a barrier\n", blocks, per_sm, ms * 1000.0f / rounds);
    }
    return 0;
}
