// scripts/sync_floor.cu: the floors of a decode step's synchronisation on this GPU, without the
// engine. A 0.5B decode layer is four dependent kernels (qkv_attention, o, gate/up, down), each a
// few microseconds; this measures what a dependency costs when the kernels do nothing:
//   1. a chain of kernels recorded in a CUDA graph, each block reading what the kernel before
//      wrote: plain graph edges, or programmatic dependent launch (griddepcontrol.wait, then
//      launch_dependents: the engine's qc_grid_start), at the engine's grid shapes;
//   2. the same chains with the dependency carried by a count in global memory instead of
//      griddepcontrol.wait (still launched as programmatic dependent launches, so that the next
//      grid is placed while this one runs): each block of a grid, once its writes are done, adds
//      one to the grid's count (a fence, then an atomic), and each block of the next grid spins
//      on it until it holds the grid's blocks (thread 0; FLAG_ACQUIRE an acquire load a poll,
//      FLAG_RELAXED relaxed polls and one fence after, FLAG_EARLY as FLAG_RELAXED with the next
//      grid let launch before the spin), or each block sets its own flag word, which the next
//      grid's warp 0 reads all of (FLAG_EACH: no two blocks' atomics on one word); a shape's
//      "/R" reads are not made there, so shapes with them run the plain and PDL chains only;
//   3. a grid barrier inside one resident kernel (an atomic count and a spin on it, as the
//      persistent decode kernel's qc_grid_sync), one to four blocks an SM.
// Prints microseconds per kernel and per barrier (the best of 5 graph launches).
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/sync_floor scripts/sync_floor.cu && /tmp/sync_floor
// Measured: bench/results/20261125-8c20074-*, addendum; the flag chains: bench/results/20261202-b2a36d6-*, addendum.
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// read: bytes each block reads after its wait (float4 loads by all its threads, from L2), from
// src: the same bytes for every block (READ_SAME, as every block of a GEMV reads its x), a copy
// of them for each block (READ_OWN), or one of 16 copies (READ_COPIES: block b the b % 16th).
enum { READ_SAME, READ_OWN, READ_COPIES };
__global__ void step_kernel(const float *in, float *out, int pdl, const float *src, int read, int mode) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    float v = __ldcg(in + (blockIdx.x * 7) % gridDim.x);     // what the kernel before wrote
    if (read) {
        const int copy = mode == READ_OWN ? blockIdx.x : mode == READ_COPIES ? blockIdx.x % 16 : 0;
        const float4 *p = (const float4 *)(src + (size_t)copy * (read / 4));
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int i = threadIdx.x; i < read / 16; i += blockDim.x) {
            const float4 x = __ldcg(p + i);
            acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
        v += acc.x + acc.y + acc.z + acc.w;
        __syncthreads();   // the block's loads all back, as a GEMV's x before its dot products
    }
    if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // (every reading thread's sum feeds a store it may make, so the compiler keeps its loads;
    // src is all zeros, so only thread 0 stores)
    if (threadIdx.x == 0 || (read && v == 12345.0f)) out[blockIdx.x] = v + 1.0f;
}

enum { SYNC_PLAIN, SYNC_PDL, FLAG_ACQUIRE, FLAG_RELAXED, FLAG_EARLY, FLAG_EACH, SYNC_KINDS };
static const char *const sync_name[SYNC_KINDS] = {"plain    ", "PDL      ", "flag acq ", "flag rlx ", "flag erly", "flag each"};
#define FLAG_WORDS 4096   // a grid's words in FLAG_EACH (one a block); counts: one 128-byte line a grid
__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned *p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ unsigned ld_relaxed_u32(const unsigned *p) {
    unsigned v; asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// Grid i of a chain: waits for grid i - 1 (whose blocks number `want`) by its flags, reads what it
// wrote, writes its own, then counts itself done.
__global__ void flag_kernel(const float *in, float *out, unsigned *flags, int i, unsigned want, int sync) {
    if (sync == FLAG_EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (i > 0) {
        if (sync == FLAG_EACH) {
            if (threadIdx.x < 32) {
                const unsigned *f = flags + (size_t)(i - 1) * FLAG_WORDS;
                for (;;) {
                    bool all = true;
                    for (unsigned b = threadIdx.x; b < want; b += 32) all &= ld_relaxed_u32(f + b) != 0;
                    if (__all_sync(0xffffffffu, all)) break;
                }
                __threadfence();
            }
        } else if (threadIdx.x == 0) {
            const unsigned *c = flags + (size_t)(i - 1) * 32;
            if (sync == FLAG_ACQUIRE) while (ld_acquire_u32(c) < want) {}
            else { while (ld_relaxed_u32(c) < want) {} __threadfence(); }
        }
        __syncthreads();
    }
    if (sync != FLAG_EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const float v = __ldcg(in + (blockIdx.x * 7) % gridDim.x);
    if (threadIdx.x == 0) out[blockIdx.x] = v + 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (sync == FLAG_EACH) asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flags + (size_t)i * FLAG_WORDS + blockIdx.x), "r"(1u) : "memory");
        else { __threadfence(); atomicAdd(flags + (size_t)i * 32, 1u); }
    }
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

struct shape { int sh[2][2]; int smem[2]; int read, mode; };   // smem: dynamic shared memory a block, bytes
static int chain(const shape &S, int sync, int n, float *a, float *b, const float *src, unsigned *flags, cudaStream_t s) {
    const int pdl = sync != SYNC_PLAIN, flag = sync >= FLAG_ACQUIRE;
    const int (&sh)[2][2] = S.sh;
    const int most_smem = S.smem[0] > S.smem[1] ? S.smem[0] : S.smem[1];
    const int smem_limit = most_smem > 48 * 1024 ? most_smem : 48 * 1024;
    CK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_limit));
    CK(cudaFuncSetAttribute(flag_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_limit));
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) {
        cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(sh[i & 1][0]); cfg.blockDim = dim3(sh[i & 1][1]); cfg.stream = s;
        cfg.dynamicSmemBytes = S.smem[i & 1];
        cfg.attrs = &attr; cfg.numAttrs = pdl ? 1 : 0;
        const unsigned blocks_before = i > 0 ? (unsigned)sh[(i - 1) & 1][0] : 0;   // what grid i waits for
        if (flag) CK(cudaLaunchKernelEx(&cfg, flag_kernel, (const float *)(i & 1 ? b : a), i & 1 ? a : b, flags, i,
                                        blocks_before, sync));
        else CK(cudaLaunchKernelEx(&cfg, step_kernel, (const float *)(i & 1 ? b : a), i & 1 ? a : b, pdl, src, S.read, S.mode));
    }
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const size_t flag_bytes = (size_t)n * FLAG_WORDS * sizeof(unsigned);
    if (flag) CK(cudaMemsetAsync(flags, 0, flag_bytes, s));
    CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    float best = 1e30f;
    for (int rep = 0; rep < 5; rep++) {
        if (flag) CK(cudaMemsetAsync(flags, 0, flag_bytes, s));
        cudaEventRecord(e0, s); CK(cudaGraphLaunch(ge, s)); cudaEventRecord(e1, s); CK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (ms < best) best = ms;
    }
    printf("chain of %d kernels, %4d x %3d then %4d x %3d, %s", n, sh[0][0], sh[0][1], sh[1][0], sh[1][1],
           sync_name[sync]);
    if (S.smem[0] || S.smem[1]) printf(", %d then %d KB of shared memory a block", S.smem[0] / 1024, S.smem[1] / 1024);
    if (S.read && !flag) printf(", reading %d bytes a block (%s)", S.read, S.mode == READ_OWN ? "its own" : S.mode == READ_COPIES ? "one of 16 copies" : "the same");
    printf(": %.3f us a kernel (best of 5)\n", best * 1000.0f / n);
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return 0;
}

// Shapes from the command line: "BxT" (a chain of grids of B blocks of T threads) or "B1xT1:B2xT2"
// (grids of the two shapes in turn: what a dependency from one kernel to the next costs when
// they differ, as the o projection's 28 blocks before the gate/up kernel's 152); none: the
// engine's shapes below. A shape may end in "/R" and a letter: each block then reads R bytes (a
// multiple of 16, at most READ_MAX) after its wait: s the same bytes as every other block, o its
// own, c one of 16 copies ("224x256/3584s": qkv_attention's grid reading x as its blocks do). A
// grid may end in "+K": K KB of dynamic shared memory a block, so that the two grids' blocks can or
// cannot share an SM ("448x256+48:224x256+100": the second grid's blocks placed only as the
// first's leave, as qkv_attention's after the down projection's).
#define READ_MAX 8192
static int parse_grid(const char *g, int (&sh)[2], int &smem) {
    int kb = 0;
    const int n = sscanf(g, "%dx%d+%d", &sh[0], &sh[1], &kb);
    smem = kb * 1024;
    return (n != 2 && n != 3) || sh[0] < 1 || sh[0] > 4096 || sh[1] < 32 || sh[1] > 1024 || kb < 0 || kb > 227;
}
static int parse(const char *arg, shape &S) {
    char mode = 0, tail = 0, first[64] = {0}, second[64] = {0};
    S.read = 0;
    const char *slash = strchr(arg, '/');
    if (slash && (sscanf(slash + 1, "%d%c%c", &S.read, &mode, &tail) != 2 || !strchr("soc", mode))) return 1;
    const size_t len = slash ? (size_t)(slash - arg) : strlen(arg);
    const char *colon = (const char *)memchr(arg, ':', len);
    const size_t l1 = colon ? (size_t)(colon - arg) : len;
    if (l1 >= sizeof first || (colon && len - l1 - 1 >= sizeof second)) return 1;
    memcpy(first, arg, l1);
    if (colon) memcpy(second, colon + 1, len - l1 - 1);
    if (parse_grid(first, S.sh[0], S.smem[0]) || parse_grid(colon ? second : first, S.sh[1], S.smem[1])) return 1;
    S.mode = mode == 'o' ? READ_OWN : mode == 'c' ? READ_COPIES : READ_SAME;
    return S.read < 0 || S.read % 16 || S.read > READ_MAX;
}

int main(int argc, char **argv) {
    int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *a, *b, *src; CK(cudaMalloc(&a, 4096 * sizeof(float))); CK(cudaMalloc(&b, 4096 * sizeof(float)));
    CK(cudaMalloc(&src, (size_t)4096 * READ_MAX)); CK(cudaMemset(src, 0, (size_t)4096 * READ_MAX));
    unsigned *flags; CK(cudaMalloc(&flags, (size_t)2000 * FLAG_WORDS * sizeof(unsigned)));
    CK(cudaMemset(a, 0, 4096 * sizeof(float))); CK(cudaMemset(b, 0, 4096 * sizeof(float)));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const char *engine[] = {"28x256", "112x512", "152x512", "896x256", "4096x256"};
    const int n_args = argc > 1 ? argc - 1 : 5;
    for (int i = 0; i < n_args; i++) {
        shape S;
        if (parse(argc > 1 ? argv[i + 1] : engine[i], S)) {
            printf("bad shape %s\n", argv[i + 1]);
            return 1;
        }
        for (int sync = 0; sync < SYNC_KINDS; sync++)
            if ((sync < FLAG_ACQUIRE || !S.read) && chain(S, sync, 2000, a, b, src, flags, s)) return 1;
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
