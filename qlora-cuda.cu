// qlora-cuda.cu - the CUDA backend: device memory, one cuBLAS wrapper, a kernel for every op of
// the llama training and inference graphs, AdamW on the device.
//
// Reading order (sections below, each behind a banner):
//   1. CUDA or the shim; errors      2. device memory      3. tensors as kernels see them
//   4. dequantisation                5. matrix multiply (cuBLAS)
//   6. elementwise, rows, rope, loss, dropout, optimizer    7. attention
//   8. the backend: dispatch, supports_op, copies, init
//
// The same source compiles with nvcc (sm_75 .. sm_90) and, for tests on machines without a GPU,
// as host C++ through tests/cuda_shim.h (QL_CUDA_SHIM): a block's threads become fibers switched
// at barriers and warp collectives. So: kernels are launched only through QL_LAUNCH, dynamic
// shared memory is declared only through QL_DYN_SMEM, no inline PTX, and 16-bit values are only
// converted (to/from float), never used in half arithmetic.
//
// Every op has three parts: a kernel (k_*), a launcher taking a stream, and an entry point
// (cu_op_*) that asserts types and shapes. Results follow the CPU backend (the oracle): the same
// formulas, f32 accumulation; dequantisation uses the CPU's f32 expressions with explicit
// rounding (__fmul_rn, __fadd_rn: no fused multiply-add) so the weights are the CPU's bits.

#define QL_INTERNALS  // qlora.h's implementer part: block formats, the backend interface, the workspace rules
#include "qlora.h"

#ifndef QL_CUDA_SHIM
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <cuda_pipeline_primitives.h>
#define QL_LAUNCH(k, grid, block, smem, stream, ...) (k)<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define QL_DYN_SMEM(T, name) \
    extern __shared__ __align__(16) unsigned char ql_dyn_smem_[]; \
    T *name = reinterpret_cast<T *>(ql_dyn_smem_)
#define QL_UNROLL _Pragma("unroll")  // fixed-count loops over register arrays: unrolled, so no local memory
#endif

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <type_traits>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <new>
#include <unordered_map>
#include <vector>

// ============================================================================================
// 1. errors
// ============================================================================================

#define CU_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: qlora-cuda: internal error: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

struct cuda_backend;

// What an op's entry point gets: where to queue, the workspace, and where a failure goes.
struct cu_ctx {
    cuda_backend  *cb = nullptr;
    cudaStream_t   stream = nullptr;
    cublasHandle_t blas = nullptr;
    uint8_t       *work = nullptr;   // this node's workspace (planned into the graph's buffer)
    size_t         work_size = 0;
    bool           failed = false;
    char           err[512] = {0};
    // decode's 8-bit activations (section 5): the b whose codes the workspace holds, kept from one
    // product to the next of the same run while no node in between writes the workspace or over b
    const void    *q8_b = nullptr;
    int64_t        q8_key[4] = {0, 0, 0, 0};  // K, N, b's column stride, the block
    size_t         q8_at = 0;                   // ... the workspace's byte where they lie (ql_cuda_q8_codes_at)
    unsigned      *q8_cnt = nullptr;            // decode's counters (k_fa_decode, gv_tail_run: in the backend's scratch, zero)
};

static void cu_fail(cu_ctx &c, const char *file, int line, const char *what, const char *why) {
    if (c.failed) return;
    c.failed = true;
    const char *f = strrchr(file, '/');
    snprintf(c.err, sizeof(c.err), "%s:%d: %s: %s", f ? f + 1 : file, line, what, why);
}

// Every CUDA / cuBLAS call is checked; after a launch the last error is checked too.
#define CU_CHECK(c, call)                                                                \
    do {                                                                                 \
        const cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess) {                                                         \
            cu_fail((c), __FILE__, __LINE__, #call, cudaGetErrorString(e_));             \
            return;                                                                      \
        }                                                                                \
    } while (0)
#define CU_LAUNCHED(c) CU_CHECK(c, cudaGetLastError())
#define CUBLAS_CHECK(c, call)                                                            \
    do {                                                                                 \
        const cublasStatus_t s_ = (call);                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                               \
            cu_fail((c), __FILE__, __LINE__, #call, cublasGetStatusString(s_));          \
            return;                                                                      \
        }                                                                                \
    } while (0)

// ============================================================================================
// 2. device memory: every device allocation is registered, so a run can refuse a graph whose
//    leafs still point at host memory (a weight never placed) instead of faulting in a kernel
// ============================================================================================

struct cu_registry {
    std::mutex mu;
    std::map<uintptr_t, size_t> blocks;  // base -> size
    std::map<uintptr_t, int> device;     // base -> the device it is on (several backends in one process: a model split)
    size_t in_use = 0, peak = 0;
    std::map<int, std::pair<size_t, size_t>> per_device;  // device -> its in_use, peak
};
static cu_registry &cu_reg() {
    static cu_registry r;  // the device's allocation table: process-wide, as the device is
    return r;
}

static void *cu_device_alloc(size_t size) {
    void *p = nullptr;
    if (cudaMalloc(&p, std::max(size, (size_t)QL_ALIGN)) != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: the caller reports what did not fit
        return nullptr;
    }
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) (void)cudaGetLastError(), dev = -1;
    cu_registry &r = cu_reg();
    std::lock_guard<std::mutex> lk(r.mu);
    r.blocks[(uintptr_t)p] = size;
    r.device[(uintptr_t)p] = dev;
    std::pair<size_t, size_t> &pd = r.per_device[dev];
    pd.first += size;
    pd.second = std::max(pd.second, pd.first);
    r.in_use += size;
    r.peak = std::max(r.peak, r.in_use);
    return p;
}

static void cu_device_free(void *p) {
    if (!p) return;
    {
        cu_registry &r = cu_reg();
        std::lock_guard<std::mutex> lk(r.mu);
        auto it = r.blocks.find((uintptr_t)p);
        auto id = r.device.find((uintptr_t)p);
        if (it != r.blocks.end()) {
            r.in_use -= it->second;
            if (id != r.device.end()) r.per_device[id->second].first -= it->second;
            r.blocks.erase(it);
        }
        if (id != r.device.end()) {
            if (id->second >= 0 && cudaSetDevice(id->second) != cudaSuccess) (void)cudaGetLastError();  // (its own device's)
            r.device.erase(id);
        }
    }
    cudaFree(p);
}

// the device a registered allocation is on: -2 for none of ours (host memory), -1 for one whose
// device was not known when it was made
static int cu_device_of_ptr(const void *p) {
    cu_registry &r = cu_reg();
    std::lock_guard<std::mutex> lk(r.mu);
    auto it = r.blocks.upper_bound((uintptr_t)p);
    if (it == r.blocks.begin()) return -2;
    --it;
    if ((uintptr_t)p >= it->first + std::max(it->second, (size_t)1)) return -2;
    auto id = r.device.find(it->first);
    return id == r.device.end() ? -1 : id->second;
}

// ============================================================================================
// 3. tensors as kernels see them: a pointer, the shape and byte strides, passed by value
// ============================================================================================

struct cu_t {
    char   *data;
    int64_t ne[4];
    int64_t nb[4];
    int     type;
    int     contig;  // elements in order, no gaps: flat index i at i * element size (no 64-bit divisions)
};

static cu_t cu_of(const ql_tensor *t) {
    cu_t r;
    r.data = (char *)t->data;
    for (int i = 0; i < 4; i++) {
        r.ne[i] = t->ne[i];
        r.nb[i] = (int64_t)t->nb[i];
    }
    r.type = (int)t->type;
    r.contig = ql_is_contiguous(t);
    return r;
}

#define CU_BLOCK 256          // threads per block of the simple kernels
#define CU_MAX_GRID 65535     // grid-stride loops cap the grid here

static int cu_grid(int64_t n, int per_block = CU_BLOCK) {
    return (int)std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block, CU_MAX_GRID));
}

static bool is_float_type_cu(ql_type t) { return t == QL_TYPE_F32 || t == QL_TYPE_F16 || t == QL_TYPE_BF16; }

// one element of a plain type as float, and back (round to nearest even, as the CPU's converters)
__device__ __forceinline__ float cu_ld(const char *p, int type) {
    if (type == QL_TYPE_F32) return *(const float *)p;
    if (type == QL_TYPE_F16) return __half2float(*(const __half *)p);
    return __bfloat162float(*(const __nv_bfloat16 *)p);
}
__device__ __forceinline__ void cu_st(char *p, int type, float v) {
    if (type == QL_TYPE_F32) *(float *)p = v;
    else if (type == QL_TYPE_F16) *(__half *)p = __float2half_rn(v);
    else *(__nv_bfloat16 *)p = __float2bfloat16_rn(v);
}
// flat logical index -> byte offset of a (possibly strided) tensor
__device__ __forceinline__ int64_t cu_offs(const cu_t &t, int64_t i) {
    if (t.contig) return i * (t.type == QL_TYPE_F32 || t.type == QL_TYPE_I32 ? 4 : t.type == QL_TYPE_I8 ? 1 : 2);
    const int64_t i0 = i % t.ne[0], r = i / t.ne[0];
    const int64_t i1 = r % t.ne[1], r2 = r / t.ne[1];
    const int64_t i2 = r2 % t.ne[2], i3 = r2 / t.ne[2];
    return i0 * t.nb[0] + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// ============================================================================================
// 4. dequantisation: rows of a block-quantized (or 16-bit) weight into the workspace, in the
//    multiply's type. The f32 expressions are the CPU's, rounded step by step.
// ============================================================================================

__constant__ float cu_nf4_values[16] = QL_NF4_VALUES;
__constant__ int8_t cu_iq4_values[16] = QL_IQ4_VALUES;

__device__ __forceinline__ float cu_h2f(uint16_t h) {
    __half_raw r;
    r.x = h;
    return __half2float(__half(r));
}

// element j (0 <= j < block size) of one block of a ggml type
__device__ __forceinline__ float cu_dequant_q(int type, const uint8_t *blk, int j) {
    switch (type) {
    case QL_TYPE_Q4_0: {
        const ql_block_q4_0 *b = (const ql_block_q4_0 *)blk;
        const int q = j < 16 ? (b->qs[j] & 15) : (b->qs[j - 16] >> 4);
        return __fmul_rn((float)(q - 8), cu_h2f(b->d));
    }
    case QL_TYPE_Q8_0: {
        const ql_block_q8_0 *b = (const ql_block_q8_0 *)blk;
        return __fmul_rn((float)b->qs[j], cu_h2f(b->d));
    }
    case QL_TYPE_Q4_1: {
        const ql_block_q4_1 *b = (const ql_block_q4_1 *)blk;
        const int q = j < 16 ? (b->qs[j] & 15) : (b->qs[j - 16] >> 4);
        return __fadd_rn(__fmul_rn(cu_h2f(b->d), (float)q), cu_h2f(b->m));
    }
    case QL_TYPE_Q5_0: case QL_TYPE_Q5_1: {  // the same codes; q5_0 centred, q5_1 with its min
        const bool one = type == QL_TYPE_Q5_1;
        const uint8_t *qs = one ? ((const ql_block_q5_1 *)blk)->qs : ((const ql_block_q5_0 *)blk)->qs;
        const uint8_t *qh = one ? ((const ql_block_q5_1 *)blk)->qh : ((const ql_block_q5_0 *)blk)->qh;
        const float d = cu_h2f(one ? ((const ql_block_q5_1 *)blk)->d : ((const ql_block_q5_0 *)blk)->d);
        const int q = (j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4)) | ((qh[j / 8] >> (j % 8)) & 1) << 4;
        if (!one) return __fmul_rn(d, (float)(q - 16));
        return __fadd_rn(__fmul_rn(d, (float)q), cu_h2f(((const ql_block_q5_1 *)blk)->m));
    }
    case QL_TYPE_IQ4_NL: {
        const ql_block_iq4_nl *b = (const ql_block_iq4_nl *)blk;
        const int q = j < 16 ? (b->qs[j] & 15) : (b->qs[j - 16] >> 4);
        return __fmul_rn(cu_h2f(b->d), (float)cu_iq4_values[q]);
    }
    case QL_TYPE_IQ4_XS: {
        const ql_block_iq4_xs *b = (const ql_block_iq4_xs *)blk;
        const int s = j / 32, l = j % 32;
        const int ls = ((b->scales_l[s / 2] >> 4 * (s % 2)) & 15) | ((b->scales_h >> 2 * s) & 3) << 4;
        const int q = l < 16 ? (b->qs[16 * s + l] & 15) : (b->qs[16 * s + l - 16] >> 4);
        return __fmul_rn(__fmul_rn(cu_h2f(b->d), (float)(ls - 32)), (float)cu_iq4_values[q]);
    }
    case QL_TYPE_Q2_K: case QL_TYPE_Q3_K: {  // 2-bit fields: element j = 128 h + 32 k + i, sub-block j / 16
        const int h = j / 128, k = (j % 128) / 32, i = j % 32, sub = j / 16;
        if (type == QL_TYPE_Q2_K) {
            const ql_block_q2_K *b = (const ql_block_q2_K *)blk;
            const int q = (b->qs[32 * h + i] >> 2 * k) & 3, sc = b->scales[sub];
            const float dl = __fmul_rn(cu_h2f(b->d), (float)(sc & 15)), ml = __fmul_rn(cu_h2f(b->dmin), (float)(sc >> 4));
            return __fsub_rn(__fmul_rn(dl, (float)q), ml);
        }
        const ql_block_q3_K *b = (const ql_block_q3_K *)blk;
        const int lo4 = sub < 8 ? b->scales[sub] & 15 : b->scales[sub - 8] >> 4, hi2 = (b->scales[8 + sub % 4] >> 2 * (sub / 4)) & 3;
        const int q = ((b->qs[32 * h + i] >> 2 * k) & 3) - ((b->hmask[i] >> (4 * h + k)) & 1 ? 0 : 4);
        return __fmul_rn(__fmul_rn(cu_h2f(b->d), (float)((lo4 | hi2 << 4) - 32)), (float)q);
    }
    case QL_TYPE_Q4_K: case QL_TYPE_Q5_K: {
        const bool five = type == QL_TYPE_Q5_K;
        const uint8_t *sc6 = five ? ((const ql_block_q5_K *)blk)->scales : ((const ql_block_q4_K *)blk)->scales;
        const uint8_t *qs = five ? ((const ql_block_q5_K *)blk)->qs : ((const ql_block_q4_K *)blk)->qs;
        const uint16_t dh = five ? ((const ql_block_q5_K *)blk)->d : ((const ql_block_q4_K *)blk)->d;
        const uint16_t mh = five ? ((const ql_block_q5_K *)blk)->dmin : ((const ql_block_q4_K *)blk)->dmin;
        const int s = j / 32, l = j % 32;
        int sc, mn;
        if (s < 4) {
            sc = sc6[s] & 63;
            mn = sc6[s + 4] & 63;
        } else {
            sc = (sc6[s + 4] & 15) | ((sc6[s - 4] >> 6) << 4);
            mn = (sc6[s + 4] >> 4) | ((sc6[s] >> 6) << 4);
        }
        const uint8_t byte = qs[32 * (s / 2) + l];
        int q = (s & 1) ? (byte >> 4) : (byte & 15);
        if (five) q |= ((((const ql_block_q5_K *)blk)->qh[l] >> s) & 1) << 4;
        const float d = __fmul_rn(cu_h2f(dh), (float)sc), m = __fmul_rn(cu_h2f(mh), (float)mn);
        return __fsub_rn(__fmul_rn(d, (float)q), m);
    }
    case QL_TYPE_Q6_K: {
        const ql_block_q6_K *b = (const ql_block_q6_K *)blk;
        const int h = j / 128, r = j % 128, k = r / 32, l = r % 32;
        const uint8_t lo = b->ql[64 * h + 32 * (k & 1) + l];
        const int q = ((k < 2 ? (lo & 15) : (lo >> 4)) | (((b->qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
        const float s = __fmul_rn(cu_h2f(b->d), (float)b->scales[j / 16]);
        return __fmul_rn(s, (float)q);
    }
    default:
        return 0.0f;
    }
}

// NF4 side data (qlora.h): n_blocks, offset, map[256], group_scale[n_groups], code[n_blocks]
__device__ __forceinline__ float cu_nf4_absmax(const char *aux, int64_t blk) {
    const float *f = (const float *)aux;
    uint32_t n_blocks;
    memcpy(&n_blocks, f, 4);
    const float *map = f + 2, *scale = map + 256;
    const uint8_t *code = (const uint8_t *)(scale + (n_blocks + QL_NF4_GROUP - 1) / QL_NF4_GROUP);
    return __fadd_rn(__fmul_rn(map[code[blk]], scale[blk / QL_NF4_GROUP]), f[1]);
}

// one element of row r of a weight of any readable type (rows of ne0, `row_bytes` apart)
__device__ __forceinline__ float cu_weight_elem(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t r,
                                                int64_t e) {
    const char *row = w + r * row_bytes;
    if (type == QL_TYPE_F32 || type == QL_TYPE_F16 || type == QL_TYPE_BF16) return cu_ld(row + e * (type == QL_TYPE_F32 ? 4 : 2), type);
    if (type == QL_TYPE_NF4 || type == QL_TYPE_NF4_NODQ) {
        const uint8_t byte = ((const uint8_t *)row)[e / 2];
        const int64_t blk = (r * ne0 + e) / QL_NF4_BLOCK;
        const float am = type == QL_TYPE_NF4 ? cu_nf4_absmax(aux, blk) : ((const float *)aux)[blk];
        return __fmul_rn(cu_nf4_values[(e & 1) ? (byte & 15) : (byte >> 4)], am);
    }
    int bs = 32, bb = 0;  // elements and bytes per block
    switch (type) {
    case QL_TYPE_Q4_0: bb = (int)sizeof(ql_block_q4_0); break;
    case QL_TYPE_Q4_1: bb = (int)sizeof(ql_block_q4_1); break;
    case QL_TYPE_Q5_0: bb = (int)sizeof(ql_block_q5_0); break;
    case QL_TYPE_Q5_1: bb = (int)sizeof(ql_block_q5_1); break;
    case QL_TYPE_Q8_0: bb = (int)sizeof(ql_block_q8_0); break;
    case QL_TYPE_IQ4_NL: bb = (int)sizeof(ql_block_iq4_nl); break;
    case QL_TYPE_Q2_K: bs = QL_QK_K, bb = (int)sizeof(ql_block_q2_K); break;
    case QL_TYPE_Q3_K: bs = QL_QK_K, bb = (int)sizeof(ql_block_q3_K); break;
    case QL_TYPE_Q4_K: bs = QL_QK_K, bb = (int)sizeof(ql_block_q4_K); break;
    case QL_TYPE_Q5_K: bs = QL_QK_K, bb = (int)sizeof(ql_block_q5_K); break;
    case QL_TYPE_IQ4_XS: bs = QL_QK_K, bb = (int)sizeof(ql_block_iq4_xs); break;
    default: bs = QL_QK_K, bb = (int)sizeof(ql_block_q6_K); break;
    }
    return cu_dequant_q(type, (const uint8_t *)row + (e / bs) * bb, (int)(e % bs));
}

// the grid for rows of `len` elements: x covers a row (up to 8 blocks), y the rows
static dim3 cu_grid_rows(int64_t len, int64_t rows) {
    return dim3((unsigned)std::max<int64_t>(1, std::min<int64_t>((len + CU_BLOCK - 1) / CU_BLOCK, 8)),
                (unsigned)std::max<int64_t>(1, std::min<int64_t>(rows, CU_MAX_GRID)));
}

// A tile of a weight (rows of ne0 elements, `row_bytes` apart, any type the trait table reads):
// rows [r0, r0 + nr), columns [c0, c0 + nc) of each, written as dst [nc, nr] contiguous in
// dst_type. aux: NF4's side data. The multiply's two tiles are both this: W x takes whole rows
// (c0 = 0, nc = ne0), Wᵀ dy a band of columns of every row. The per-element kernel, for shapes
// the vectorised one below does not take (rows whose length is not a multiple of 8): a row per
// grid row (y, grid-stride), its elements across x.
__global__ void k_dequant_rows(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t r0, int64_t nr,
                               int64_t c0, int64_t nc, char *dst, int dst_type) {
    const size_t dsz = dst_type == QL_TYPE_F32 ? 4 : 2;
    for (int64_t r = blockIdx.y; r < nr; r += gridDim.y)
        for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < nc; e += (int64_t)gridDim.x * blockDim.x)
            cu_st(dst + (r * nc + e) * dsz, dst_type, cu_weight_elem(w, row_bytes, type, aux, ne0, r0 + r, c0 + e));
}

// ---- the vectorised path: 8 elements per thread (one NF4 absmax, one block header, one
// sub-block scale per 8), stored as one 16-byte vector (two in f32) ----

#define CU_DQ_VEC 8  // elements per thread of k_dequant_tile

// v rounded to f16 / bf16 (to nearest even, as cu_st), as bits
__device__ __forceinline__ uint32_t cu_bits16(float v, int type) {
    if (type == QL_TYPE_F16) return ((__half_raw)__float2half_rn(v)).x;
    return ((__nv_bfloat16_raw)__float2bfloat16_rn(v)).x;
}

// 8 values -> dst (16-byte aligned) in dst_type, rounded to nearest even as cu_st
__device__ __forceinline__ void cu_st8(char *dst, int dst_type, const float v[CU_DQ_VEC]) {
    if (dst_type == QL_TYPE_F32) {
        ((float4 *)dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    uint32_t h[CU_DQ_VEC / 2];  // element 2i in the low half (little-endian, as cu_st stores it)
    for (int i = 0; i < CU_DQ_VEC / 2; i++) h[i] = cu_bits16(v[2 * i], dst_type) | (uint32_t)cu_bits16(v[2 * i + 1], dst_type) << 16;
    *(uint4 *)dst = make_uint4(h[0], h[1], h[2], h[3]);
}

// the absmax of NF4 block blk, either kind
__device__ __forceinline__ float cu_nf4_block_absmax(int type, const char *aux, int64_t blk) {
    return type == QL_TYPE_NF4 ? cu_nf4_absmax(aux, blk) : ((const float *)aux)[blk];
}

// elements [e, e + 8) of row r (e a multiple of 8; ne0 too, so the 8 lie in one block of any
// type: 32, 64 and 256 are multiples of 8). The expressions are cu_dequant_q's and
// cu_weight_elem's, with what the 8 share read once: the same bits. am: NF4's absmax of the
// block (the caller's, shared by the 8 lanes of a block where it can be). generic = false: only
// the types with their own code here (cu_dequant8_fast), the others left as zeros - a kernel
// that unrolls several calls keeps the per-element switch out of its registers
template <bool generic>
__device__ __forceinline__ void cu_dequant8_t(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t r,
                                              int64_t e, float am, float v[CU_DQ_VEC]) {
    const uint8_t *row = (const uint8_t *)w + r * row_bytes;
    switch (type) {
    case QL_TYPE_F32: case QL_TYPE_F16: case QL_TYPE_BF16: {
        const int es = type == QL_TYPE_F32 ? 4 : 2;
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = cu_ld((const char *)row + (e + i) * es, type);
        return;
    }
    case QL_TYPE_Q6_K: {
        const ql_block_q6_K *b = (const ql_block_q6_K *)(row + (e / QL_QK_K) * sizeof(ql_block_q6_K));
        const int j = (int)(e % QL_QK_K), h = j / 128, k = (j % 128) / 32, l = j % 32;
        const uint8_t *lo = b->ql + 64 * h + 32 * (k & 1) + l, *hi = b->qh + 32 * h + l;
        const float s = __fmul_rn(cu_h2f(b->d), (float)b->scales[j / 16]);
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) {
            const int q = ((k < 2 ? (lo[i] & 15) : (lo[i] >> 4)) | (((hi[i] >> (2 * k)) & 3) << 4)) - 32;
            v[i] = __fmul_rn(s, (float)q);
        }
        return;
    }
    case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: {
        const uint32_t q = *(const uint32_t *)(row + e / 2);  // 4 bytes, 4-aligned (ne0 and e multiples of 8)
QL_UNROLL
        for (int i = 0; i < 4; i++) {
            const uint32_t byte = (q >> 8 * i) & 255;  // little-endian: byte i holds elements 2i (high) and 2i+1 (low)
            v[2 * i] = __fmul_rn(cu_nf4_values[byte >> 4], am);
            v[2 * i + 1] = __fmul_rn(cu_nf4_values[byte & 15], am);
        }
        return;
    }
    case QL_TYPE_Q4_0: {
        const ql_block_q4_0 *b = (const ql_block_q4_0 *)(row + (e / 32) * sizeof(ql_block_q4_0));
        const int j = (int)(e % 32), sh = j < 16 ? 0 : 4, j0 = j % 16;
        const float d = cu_h2f(b->d);
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = __fmul_rn((float)(((b->qs[j0 + i] >> sh) & 15) - 8), d);
        return;
    }
    case QL_TYPE_Q8_0: {
        const ql_block_q8_0 *b = (const ql_block_q8_0 *)(row + (e / 32) * sizeof(ql_block_q8_0));
        const int j = (int)(e % 32);
        const float d = cu_h2f(b->d);
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = __fmul_rn((float)b->qs[j + i], d);
        return;
    }
    case QL_TYPE_Q4_K: {
        const ql_block_q4_K *b = (const ql_block_q4_K *)(row + (e / QL_QK_K) * sizeof(ql_block_q4_K));
        const int j = (int)(e % QL_QK_K), s = j / 32, l = j % 32;
        int sc, mn;
        if (s < 4) {
            sc = b->scales[s] & 63;
            mn = b->scales[s + 4] & 63;
        } else {
            sc = (b->scales[s + 4] & 15) | ((b->scales[s - 4] >> 6) << 4);
            mn = (b->scales[s + 4] >> 4) | ((b->scales[s] >> 6) << 4);
        }
        const float d = __fmul_rn(cu_h2f(b->d), (float)sc), m = __fmul_rn(cu_h2f(b->dmin), (float)mn);
        const uint8_t *qs = b->qs + 32 * (s / 2) + l;
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = __fsub_rn(__fmul_rn(d, (float)((s & 1) ? (qs[i] >> 4) : (qs[i] & 15))), m);
        return;
    }
    default:  // the other block types: each element through cu_weight_elem
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = generic ? cu_weight_elem(w, row_bytes, type, aux, ne0, r, e + i) : 0.0f;
        return;
    }
}
__device__ __forceinline__ void cu_dequant8(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t r,
                                            int64_t e, float am, float v[CU_DQ_VEC]) {
    cu_dequant8_t<true>(w, row_bytes, type, aux, ne0, r, e, am, v);
}
// the types cu_dequant8_t<false> decodes
__host__ __device__ inline bool cu_dequant8_fast(int type) {
    switch (type) {
    case QL_TYPE_F32: case QL_TYPE_F16: case QL_TYPE_BF16: case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: case QL_TYPE_Q4_0:
    case QL_TYPE_Q8_0: case QL_TYPE_Q4_K: case QL_TYPE_Q6_K: return true;
    default: return false;
    }
}

// k_dequant_rows' tile, 8 elements per thread: groups g of a flat index over [nr rows, nc / 8]
// (nc, c0 and ne0 multiples of 8; nr * nc / 8 < 2^31: a tile is bounded by the planned budget).
// NF4 with nf4_shared (ne0, c0 and nc multiples of 64: the 8 lanes 8j .. 8j + 7 hold one whole
// block): one lane reads the block's absmax and passes it on (a shuffle), one per 64 elements;
// else each lane reads its own, one per 8. The loop is warp-uniform, for the shuffle.
__global__ void k_dequant_tile(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t r0, int64_t nr,
                               int64_t c0, int64_t nc, char *dst, int dst_type, int nf4_shared) {
    const uint32_t G = (uint32_t)(nc / CU_DQ_VEC), n = (uint32_t)nr * G, lane = threadIdx.x % 32;
    const bool nf4 = type == QL_TYPE_NF4 || type == QL_TYPE_NF4_NODQ;
    const size_t dsz = dst_type == QL_TYPE_F32 ? 4 : 2;
    for (uint32_t g0 = blockIdx.x * blockDim.x + threadIdx.x - lane; g0 < n; g0 += gridDim.x * blockDim.x) {
        const uint32_t g = g0 + lane, r = g < n ? g / G : 0, e = g < n ? (g - r * G) * CU_DQ_VEC : 0;
        float am = 0.0f;
        if (nf4) {
            if (g < n && (!nf4_shared || lane % 8 == 0)) am = cu_nf4_block_absmax(type, aux, ((int64_t)(r0 + r) * ne0 + c0 + e) / QL_NF4_BLOCK);
            if (nf4_shared) am = __shfl_sync(0xffffffff, am, lane & ~7u);
        }
        if (g >= n) continue;
        float v[CU_DQ_VEC];
        cu_dequant8(w, row_bytes, type, aux, ne0, r0 + r, c0 + e, am, v);
        cu_st8(dst + ((int64_t)r * nc + e) * dsz, dst_type, v);
    }
}

// can k_dequant_tile take this weight's tiles? (block-quantized, rows of a multiple of 8)
static bool cu_dequant_vec_ok(ql_type type, int64_t ne0) {
    const ql_type_traits *t = ql_type_traits_get(type);
    return t && t->blck_size > 1 && ne0 % CU_DQ_VEC == 0;
}

// launcher: rows [r0, r0 + nr), columns [c0, c0 + nc) of w -> dst [nc, nr] in dst_type
static void cu_dequant_tile(cu_ctx &c, cudaStream_t s, const char *w, int64_t row_bytes, ql_type type, const char *aux, int64_t ne0,
                            int64_t r0, int64_t nr, int64_t c0, int64_t nc, char *dst, ql_type dst_type) {
    if (cu_dequant_vec_ok(type, ne0) && c0 % CU_DQ_VEC == 0 && nc % CU_DQ_VEC == 0) {
        CU_ASSERT(nr * (nc / CU_DQ_VEC) < ((int64_t)1 << 31) && ((uintptr_t)dst & 15) == 0 && CU_BLOCK % 32 == 0);
        const int nf4_shared = ne0 % QL_NF4_BLOCK == 0 && c0 % QL_NF4_BLOCK == 0 && nc % QL_NF4_BLOCK == 0;
        QL_LAUNCH(k_dequant_tile, cu_grid(nr * (nc / CU_DQ_VEC)), CU_BLOCK, 0, s, w, row_bytes, (int)type, aux, ne0, r0, nr, c0, nc,
                  dst, (int)dst_type, nf4_shared);
    } else {
        QL_LAUNCH(k_dequant_rows, cu_grid_rows(nc, nr), CU_BLOCK, 0, s, w, row_bytes, (int)type, aux, ne0, r0, nr, c0, nc, dst,
                  (int)dst_type);
    }
    CU_LAUNCHED(c);
}

// A strided 2-D slice src (element (k, m) at k*nb0 + m*nb1, plain type) -> dst [K, M] contiguous
// in dst_type: a's conversion to the multiply's type, and b's copy when cuBLAS cannot read it.
// Laid out as k_dequant_rows: m per grid row, k across x.
__global__ void k_convert_2d(const char *src, int src_type, int64_t nb0, int64_t nb1, int64_t K, int64_t M, char *dst,
                             int dst_type) {
    const size_t dsz = dst_type == QL_TYPE_F32 ? 4 : 2;
    for (int64_t m = blockIdx.y; m < M; m += gridDim.y)
        for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < K; k += (int64_t)gridDim.x * blockDim.x)
            cu_st(dst + (m * K + k) * dsz, dst_type, cu_ld(src + k * nb0 + m * nb1, src_type));
}

// ============================================================================================
// 5. matrix multiply: ONE cuBLAS wrapper (cublasGemmStridedBatchedEx, f32 accumulation; bf16/f16
//    inputs on tensor cores). ql_mul_mat(a, b): c[m, n] = sum_k a[k, m] b[k, n] is, column-major,
//    C (M x N) = op(A) op(B) with A read from a's bytes and B from b's.
// ============================================================================================


static cudaDataType cu_dtype(ql_type t) { return t == QL_TYPE_F32 ? CUDA_R_32F : t == QL_TYPE_F16 ? CUDA_R_16F : CUDA_R_16BF; }

// An operand cuBLAS reads in place: elements (k, x) at k*nb0 + x*nb1 of a plain type.
struct cu_operand {
    const char *p;
    cublasOperation_t op;
    int64_t ld;
    bool ok;
};
// as op(M) with k the contracted index: "k contiguous" -> the stored matrix is K x X, so for A
// (which must come out M x K) that is op T, for B (K x N) op N
static cu_operand cu_as_operand(const char *p, size_t es, int64_t nb0, int64_t nb1, int64_t K, int64_t X, bool is_a) {
    cu_operand o{p, CUBLAS_OP_N, 0, false};
    if (nb0 == (int64_t)es && (X == 1 || nb1 % (int64_t)es == 0)) {
        o.op = is_a ? CUBLAS_OP_T : CUBLAS_OP_N;
        o.ld = X == 1 ? std::max<int64_t>(K, 1) : nb1 / (int64_t)es;
    } else if (nb1 == (int64_t)es && nb0 % (int64_t)es == 0) {
        o.op = is_a ? CUBLAS_OP_N : CUBLAS_OP_T;
        o.ld = K == 1 ? std::max<int64_t>(X, 1) : nb0 / (int64_t)es;
    }
    o.ok = ql_cuda_operand_ok(es, nb0, nb1, K, X);  // the planner's rule, exactly
    return o;
}

static cublasLtHandle_t cu_lt(cu_ctx &c);
static bool &cu_lt_ok(cu_ctx &c);
static void *cu_lt_work(cu_ctx &c, size_t *size);
// C (M x N, ldc) = alpha op(A) op(B) + beta C, batched with strides (a stride of 0 broadcasts);
// C f32, or of A and B's 16-bit type: summed in f32 (beta C too), rounded once as it is stored.
// Cin (beta != 0): C's addend where it is not C itself, laid out as C - cuBLASLt's C != D, so that a
// residual that lives on is added by the product that writes the sum, with no copy of it first
// (cuBLAS' GEMMs take C = D only). Returns false, with nothing queued, where cuBLASLt refuses it
static bool cu_gemm_to(cu_ctx &c, ql_type ab_type, const cu_operand &A, int64_t sA, const cu_operand &B, int64_t sB,
                       void *C, ql_type c_type, int64_t ldc, int64_t sC, int64_t M, int64_t N, int64_t K, int batch, float beta,
                       float alpha = 1.0f, const void *Cin = nullptr) {
    if (Cin && Cin != C && beta != 0.0f) {
        cublasLtMatmulDescOpaque_t op;
        cublasLtMatrixLayoutOpaque_t la, lb, lc;
        const int32_t ta = A.op, tb = B.op, nb = batch;
        const int64_t sa = sA, sb = sB, sc = sC;
        const cudaDataType abt = cu_dtype(ab_type), ct = cu_dtype(c_type);
        size_t ws_size = 0;
        void *ws = cu_lt_work(c, &ws_size);
        // a layout's rows and cols as stored (before op): A m x k under N, k x m under T
        const bool ok =
            cublasLtMatmulDescInit(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutInit(&la, abt, A.op == CUBLAS_OP_N ? M : K, A.op == CUBLAS_OP_N ? K : M, A.ld) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutInit(&lb, abt, B.op == CUBLAS_OP_N ? K : N, B.op == CUBLAS_OP_N ? N : K, B.ld) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutInit(&lc, ct, M, N, ldc) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof(nb)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof(nb)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof(nb)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sa, sizeof(sa)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sb, sizeof(sb)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutSetAttribute(&lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc, sizeof(sc)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmul(cu_lt(c), &op, &alpha, A.p, &la, B.p, &lb, &beta, Cin, &lc, C, &lc, nullptr, ws, ws_size, c.stream) ==
                CUBLAS_STATUS_SUCCESS;
        return ok;
    }
    const cublasStatus_t s = cublasGemmStridedBatchedEx(c.blas, A.op, B.op, (int)M, (int)N, (int)K, &alpha, A.p, cu_dtype(ab_type),
                                                        (int)A.ld, sA, B.p, cu_dtype(ab_type), (int)B.ld, sB, &beta, C, cu_dtype(c_type),
                                                        (int)ldc, sC, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) cu_fail(c, __FILE__, __LINE__, "cublasGemmStridedBatchedEx", cublasGetStatusString(s));
    return s == CUBLAS_STATUS_SUCCESS;
}
static void cu_gemm(cu_ctx &c, ql_type ab_type, const cu_operand &A, int64_t sA, const cu_operand &B, int64_t sB,
                    float *C, int64_t ldc, int64_t sC, int64_t M, int64_t N, int64_t K, int batch, float beta, float alpha = 1.0f) {
    cu_gemm_to(c, ab_type, A, sA, B, sB, C, QL_TYPE_F32, ldc, sC, M, N, K, batch, beta, alpha);
}

// part of a batched result: rows (bytes each) of a column-major matrix, cols of them ld bytes
// apart, batch matrices stride bytes apart - from src into dst at the same offsets
static void cu_copy_part(cu_ctx &c, char *dst, const char *src, int64_t row_bytes, int64_t ld, int64_t cols, int batch,
                         int64_t stride) {
    for (int i = 0; i < batch && !c.failed; i++)
        CU_CHECK(c, cudaMemcpy2DAsync(dst + i * stride, (size_t)ld, src + i * stride, (size_t)ld, (size_t)row_bytes, (size_t)cols,
                                      cudaMemcpyDeviceToDevice, c.stream));
}

// the workspace rules (which operands cuBLAS reads in place, tile sizes) are qlora.cpp's
// ql_cuda_* functions: a device plan computes them without CUDA

// d = c + p rounded once to d's 16-bit type (ql_mul_mat_acc onto a 16-bit c; p: the product in
// f32); d may be c (in place: each element read before it is written)
__global__ void k_acc_round(const char *c16, const float *p, char *d, int type, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        cu_st(d + i * 2, type, cu_ld(c16 + i * 2, type) + p[i]);
}

// ---- decode: a few tokens' product read straight from the packed weight (ql_cuda_mm_gemv) ----
// A block of GV_WARPS warps per row of W. Thread t takes elements [base + 8 t, base + 8 t + 8) of
// each GV_SPAN (so a warp reads 256 neighbouring elements of W and of every b column at a time:
// coalesced), decoded by the tile kernel's cu_dequant8 (NF4's absmax read once per 64 and shuffled
// where a row is whole blocks), rounded to the multiply's type as the tile would be, and dotted with
// every column of b (N <= 8 sums in registers). Decode is bound by the weight's bytes: reading them
// once, packed, is what the dequantise-then-GEMM path cannot do. What limits it is the bytes in
// flight (a warp per row with one 4-byte load a lane at a time reached ~0.6 TB/s on an H200): so
// the warps of a block split the row (4x the warps for the short rows of k/v), and each thread
// issues GV_UNROLL chunks' loads before it multiplies. The partial sums meet by shuffles within a
// warp, then in shared memory in a fixed order (the same bits every run).
#define CU_ROW_BLOCK 256  // threads per row of the row ops (rms_norm, softmax rows)

// The norm's and SwiGLU's element math, here for the decode products' tails (gv_tail_run) too.
// A row's scale (mean(x^2) + eps)^-1/2 as a block of CU_ROW_BLOCK threads sums it - thread v's
// strided sum, shuffles within each warp, then warp 0's over the warps' sums - made by this
// block's threads (a multiple of 32: thread t sums for threads t, t + blockDim.x, ...): every
// norm kernel's order, so the same bits whichever block makes it. Every thread calls it; sh [32]
template <typename P> __device__ __forceinline__ float cu_rms_scale_of(P x, int64_t ne0, float eps, float *sh) {
    const int lane = threadIdx.x % 32;
    for (int v0 = (int)threadIdx.x - lane; v0 < CU_ROW_BLOCK; v0 += (int)blockDim.x) {  // warp-uniform: thread v0 + lane's sum
        float s = 0;
        for (int64_t i = v0 + lane; i < ne0; i += CU_ROW_BLOCK) {
            const float xi = x[i];
            s += xi * xi;
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) sh[v0 / 32] = s;
    }
    __syncthreads();
    float t = threadIdx.x < CU_ROW_BLOCK / 32 ? sh[threadIdx.x] : 0.0f;
    if (threadIdx.x < 32)
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
    __syncthreads();
    if (threadIdx.x == 0) sh[0] = t;
    __syncthreads();
    const float r = sh[0];
    __syncthreads();  // (sh is written again by the next call)
    return 1.0f / sqrtf(r / (float)ne0 + eps);
}
// element i normed, then times w[i] (w NULL: not)
template <typename P> __device__ __forceinline__ float cu_rms_elem(P x, float rs, const float *w, int64_t i) {
    const float y = x[i] * rs;
    return w ? __fmul_rn(y, w[i]) : y;
}
__device__ __forceinline__ float cu_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float cu_swiglu_f(float x, float y) { return x * cu_sigmoid(x) * y; }

#define GV_WARPS 4                          // warps per row
#define GV_SPAN (GV_WARPS * 32 * CU_DQ_VEC)  // elements a block covers per chunk: 1024
#define GV_UNROLL 4                         // chunks in flight per thread (the types of cu_dequant8_fast; the others 1)

// the decode products' shared steps: 8 dequantised values rounded to the multiply's type ct (as
// the tile would be), and elements [e, e + 8) of a column of b (float4 loads where b4 says they
// are aligned f32)
__device__ __forceinline__ void cu_round8(float v[CU_DQ_VEC], int ct) {
    if (ct == QL_TYPE_F32) return;
QL_UNROLL
    for (int l = 0; l < CU_DQ_VEC; l++)
        v[l] = ct == QL_TYPE_F16 ? __half2float(__float2half_rn(v[l])) : __bfloat162float(__float2bfloat16_rn(v[l]));
}
__device__ __forceinline__ void cu_load8(const char *bp, bool b4, int bes, int b_type, float x[CU_DQ_VEC]) {
    if (b4) {
        const float4 p = ((const float4 *)bp)[0], q = ((const float4 *)bp)[1];
        x[0] = p.x, x[1] = p.y, x[2] = p.z, x[3] = p.w, x[4] = q.x, x[5] = q.y, x[6] = q.z, x[7] = q.w;
        return;
    }
QL_UNROLL
    for (int l = 0; l < CU_DQ_VEC; l++) x[l] = cu_ld(bp + l * bes, b_type);
}

// C [M, N] = W b (+ Ci: ql_mul_mat_acc's c, [M, N] f32, or NULL; added as ql_add would, c + the
// product, each element read and written by one thread: C may be Ci): W [K, M] (rows of K,
// row_bytes apart), b [K, N] (columns bnb1 bytes apart, of b_type); grid: M blocks
template <int U, bool generic>
__global__ void __launch_bounds__(GV_WARPS * 32) k_gemv(const char *w, int64_t row_bytes, int type, const char *aux, int64_t K,
                                                        int64_t M, const char *b, int b_type, int64_t bnb1, int N, int ct, float *C,
                                                        const float *Ci) {
    __shared__ float red[GV_WARPS][QL_CUDA_GEMV_MAX_N];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t r = blockIdx.x;
    const bool nf4 = type == QL_TYPE_NF4 || type == QL_TYPE_NF4_NODQ, share = nf4 && K % QL_NF4_BLOCK == 0;
    const int bes = b_type == QL_TYPE_F32 ? 4 : 2;
    const bool b4 = b_type == QL_TYPE_F32 && ((uintptr_t)b | (uintptr_t)bnb1) % 16 == 0;  // float4 loads of b
    float acc[QL_CUDA_GEMV_MAX_N];
QL_UNROLL
    for (int n = 0; n < QL_CUDA_GEMV_MAX_N; n++) acc[n] = 0.0f;
    for (int64_t base = 0; base < K; base += U * GV_SPAN) {  // block-uniform: the shuffles below
        float v[U][CU_DQ_VEC];
QL_UNROLL
        for (int u = 0; u < U; u++) {  // the loads of every chunk first
            // past the row's end: the row's first chunk is read again (no branch around the
            // loads), its products not taken below
            const int64_t e0 = base + u * GV_SPAN + threadIdx.x * CU_DQ_VEC, e = e0 < K ? e0 : threadIdx.x * CU_DQ_VEC % K;
            float am = 0.0f;
            if (nf4) {
                if (!share || lane % 8 == 0) am = cu_nf4_block_absmax(type, aux, (r * K + e) / QL_NF4_BLOCK);
                if (share) am = __shfl_sync(0xffffffff, am, lane & ~7);
            }
            cu_dequant8_t<generic>(w, row_bytes, type, aux, K, r, e, am, v[u]);
        }
QL_UNROLL
        for (int u = 0; u < U; u++) {
            const int64_t e = base + u * GV_SPAN + threadIdx.x * CU_DQ_VEC;
            if (e >= K) break;  // chunks past the row's end: only in the last trip, and for every later u
            cu_round8(v[u], ct);
QL_UNROLL
            for (int n = 0; n < QL_CUDA_GEMV_MAX_N; n++) {
                if (n >= N) break;
                float x[CU_DQ_VEC];
                cu_load8(b + n * bnb1 + e * bes, b4, bes, b_type, x);
                float s = 0.0f;
QL_UNROLL
                for (int l = 0; l < CU_DQ_VEC; l++) s = fmaf(v[u][l], x[l], s);
                acc[n] += s;
            }
        }
    }
QL_UNROLL
    for (int n = 0; n < QL_CUDA_GEMV_MAX_N; n++) {
        if (n >= N) break;
        float s = acc[n];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) red[warp][n] = s;
    }
    __syncthreads();
    if ((int)threadIdx.x < N) {
        float s = 0.0f;
        for (int i = 0; i < GV_WARPS; i++) s += red[i][threadIdx.x];
        C[threadIdx.x * M + r] = Ci ? Ci[threadIdx.x * M + r] + s : s;
    }
}

// The packed weight read in wide units (k_gemv_unit): a thread loads a whole unit of E elements
// with wide loads - NF4: 32 codes (one uint4) and its block's absmax; Q4_K: 64 elements, two
// sub-blocks (the 16-byte header and 32 bytes of codes); Q6_K: 32 elements (64 bytes of codes in
// 2-byte loads, its blocks of 210 bytes allow no wider) - U units before it decodes any, so a
// warp has 1-1.5 KiB in flight (k_gemv: 128 bytes; the H200 read 8B q4_K weights at ~0.37 TB/s
// with it). The decoded values are cu_dequant8's expressions: the same bits. A block of up to 4
// warps per row, sized to the row (a short row keeps one warp busy rather than four idle).
struct gv_nf4 {  // QL_TYPE_NF4 / NF4_NODQ, K a multiple of 64 (a unit is half a block, blocks within rows)
    static constexpr int E = 32, U = 2;
    struct raw {
        uint4 q;
        float am;
    };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int type, const char *aux, int64_t K, int64_t r, int64_t e) {
        x.q = *(const uint4 *)(row + e / 2);
        x.am = cu_nf4_block_absmax(type, aux, (r * K + e) / QL_NF4_BLOCK);
    }
    // elements [8 g, 8 g + 8) of the unit: bytes 4 g .. 4 g + 3, the high nibble first
    __device__ __forceinline__ static void decode8(const raw &x, int g, const float *tab, float v[CU_DQ_VEC]) {
        const uint32_t q = g == 0 ? x.q.x : g == 1 ? x.q.y : g == 2 ? x.q.z : x.q.w;
QL_UNROLL
        for (int i = 0; i < 4; i++) {
            const uint32_t byte = (q >> 8 * i) & 255;
            v[2 * i] = __fmul_rn(tab[byte >> 4], x.am);
            v[2 * i + 1] = __fmul_rn(tab[byte & 15], x.am);
        }
    }
};
struct gv_q4_K {  // QL_TYPE_Q4_K: sub-blocks 2p and 2p + 1 of a super-block (the low and high nibbles of 32 bytes)
    static constexpr int E = 64, U = 1;
    struct raw {
        uint4 h, q0, q1;
        int p;
    };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t e) {
        const uint8_t *b = row + (e / QL_QK_K) * sizeof(ql_block_q4_K);
        x.p = (int)(e % QL_QK_K) / 64;
        x.h = *(const uint4 *)b;  // d, dmin, scales[12]
        x.q0 = *(const uint4 *)(b + 16 + 32 * x.p);
        x.q1 = *(const uint4 *)(b + 32 + 32 * x.p);
    }
    __device__ __forceinline__ static void decode8(const raw &x, int g, const float *, float v[CU_DQ_VEC]) {
        const int s = 2 * x.p + g / 4, l = (g % 4) * 8;  // sub-block s, its elements l .. l + 7: bytes l .. l + 7
        auto sc6 = [&x](int k) {  // scales[k] from the header's words (s is not a constant: no array)
            const uint32_t wd = k < 4 ? x.h.y : k < 8 ? x.h.z : x.h.w;
            return (int)((wd >> 8 * (k & 3)) & 255);
        };
        int sc, mn;
        if (s < 4) {
            sc = sc6(s) & 63;
            mn = sc6(s + 4) & 63;
        } else {
            sc = (sc6(s + 4) & 15) | ((sc6(s - 4) >> 6) << 4);
            mn = (sc6(s + 4) >> 4) | ((sc6(s) >> 6) << 4);
        }
        const float d = __fmul_rn(cu_h2f((uint16_t)(x.h.x & 0xffff)), (float)sc), m = __fmul_rn(cu_h2f((uint16_t)(x.h.x >> 16)), (float)mn);
        const uint32_t w[8] = {x.q0.x, x.q0.y, x.q0.z, x.q0.w, x.q1.x, x.q1.y, x.q1.z, x.q1.w};
        const uint32_t lo = w[l / 4], hi = w[l / 4 + 1];
        const int sh = (s & 1) ? 4 : 0;
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) {
            const uint32_t byte = ((i < 4 ? lo : hi) >> 8 * (i % 4)) & 255;
            v[i] = __fsub_rn(__fmul_rn(d, (float)((byte >> sh) & 15)), m);
        }
    }
};

struct gv_q6_K {  // QL_TYPE_Q6_K: the 32 elements of one of a half's four groups (blocks of 210 bytes: 2-byte loads)
    static constexpr int E = 32, U = 1;
    struct raw {
        uint32_t q[8];  // the group's 32 6-bit codes, a byte each: 4 low bits of ql, 2 high bits of qh at 2 k
        uint32_t sc;    // its two 16-element scales (int8) and d (f16)
    };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t e) {
        const uint8_t *b = row + (e / QL_QK_K) * sizeof(ql_block_q6_K);
        const int j = (int)(e % QL_QK_K), h = j / 128, k = (j % 128) / 32, sh = k < 2 ? 0 : 4;
        const uint16_t *pl = (const uint16_t *)(b + 64 * h + 32 * (k & 1)), *ph = (const uint16_t *)(b + 128 + 32 * h);
QL_UNROLL
        for (int i = 0; i < 8; i++) {
            const uint32_t lo = pl[2 * i] | (uint32_t)pl[2 * i + 1] << 16, hi = ph[2 * i] | (uint32_t)ph[2 * i + 1] << 16;
            x.q[i] = ((lo >> sh) & 0x0f0f0f0fu) | (((hi >> 2 * k) & 0x03030303u) << 4);
        }
        x.sc = *(const uint16_t *)(b + 192 + j / 16) | (uint32_t) * (const uint16_t *)(b + 208) << 16;
    }
    __device__ __forceinline__ static void decode8(const raw &x, int g, const float *, float v[CU_DQ_VEC]) {
        const float s = __fmul_rn(cu_h2f((uint16_t)(x.sc >> 16)), (float)(int8_t)((x.sc >> 8 * (g / 2)) & 255));
        // words 2 g and 2 g + 1 by selects, not an index (an indexed array went to local memory)
        const uint32_t w0 = g == 0 ? x.q[0] : g == 1 ? x.q[2] : g == 2 ? x.q[4] : x.q[6];
        const uint32_t w1 = g == 0 ? x.q[1] : g == 1 ? x.q[3] : g == 2 ? x.q[5] : x.q[7];
QL_UNROLL
        for (int i = 0; i < CU_DQ_VEC; i++) v[i] = __fmul_rn(s, (float)((int)(((i < 4 ? w0 : w1) >> 8 * (i % 4)) & 63) - 32));
    }
};

// C [M, N] = W b (+ Ci) as k_gemv, R rows a block (grid: M / R blocks of 32-128 threads), NN >= N
// columns. The rows of a block share each load of b: the 8 elements of b a thread reads serve
// its units of all R rows (per row, b is K f32 against K / 2 bytes of 4-bit weight: with a row a
// block, b's re-reads from L1/L2 were 7x the weight's bytes and bounded the kernel)
template <typename T, int R, int NN>
__global__ void __launch_bounds__(GV_WARPS * 32) k_gemv_unit(const char *w, int64_t row_bytes, int type, const char *aux, int64_t K,
                                                             int64_t M, const char *b, int b_type, int64_t bnb1, int N, int ct, float *C,
                                                             const float *Ci) {
    __shared__ float red[GV_WARPS][R * NN];
    __shared__ float tab[16];  // NF4's table: the lanes' different codes from shared memory, not serialized constant reads
    if (threadIdx.x < 16) tab[threadIdx.x] = cu_nf4_values[threadIdx.x];
    __syncthreads();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nt = blockDim.x;
    const int64_t r0 = (int64_t)blockIdx.x * R, n_units = K / T::E;
    const int bes = b_type == QL_TYPE_F32 ? 4 : 2;
    const bool b4 = b_type == QL_TYPE_F32 && ((uintptr_t)b | (uintptr_t)bnb1) % 16 == 0;  // float4 loads of b
    float acc[R][NN];
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) acc[q][n] = 0.0f;
    for (int64_t i0 = threadIdx.x; i0 < n_units; i0 += (int64_t)T::U * nt) {
        typename T::raw x[T::U][R];
QL_UNROLL
        for (int u = 0; u < T::U; u++) {  // every unit's loads first (past the end: unit i0 again, rows past M: r0's; not used)
            const int64_t i = i0 + (int64_t)u * nt < n_units ? i0 + (int64_t)u * nt : i0;
QL_UNROLL
            for (int q = 0; q < R; q++) {
                const int64_t r = r0 + q < M ? r0 + q : r0;
                T::load(x[u][q], (const uint8_t *)w + r * row_bytes, type, aux, K, r, i * T::E);
            }
        }
QL_UNROLL
        for (int u = 0; u < T::U; u++) {
            const int64_t i = i0 + (int64_t)u * nt;
            const bool in = i < n_units;  // (a guard, not a break: the loop unrolls, x stays in registers)
QL_UNROLL
            for (int g = 0; g < T::E / CU_DQ_VEC; g++) {
                const int64_t e = i * T::E + g * CU_DQ_VEC;
                float v[R][CU_DQ_VEC];  // the R rows' 8 values, then each column of b read once for them
QL_UNROLL
                for (int q = 0; q < R; q++) {
                    T::decode8(x[u][q], g, tab, v[q]);
                    cu_round8(v[q], ct);
                }
QL_UNROLL
                for (int n = 0; n < NN; n++) {
                    if (n >= N || !in) break;
                    float xb[CU_DQ_VEC];
                    cu_load8(b + n * bnb1 + e * bes, b4, bes, b_type, xb);
QL_UNROLL
                    for (int q = 0; q < R; q++) {
                        float sum = 0.0f;
QL_UNROLL
                        for (int l = 0; l < CU_DQ_VEC; l++) sum = fmaf(v[q][l], xb[l], sum);
                        acc[q][n] += sum;
                    }
                }
            }
        }
    }
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) {
            if (n >= N) break;
            float sum = acc[q][n];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
            if (lane == 0) red[warp][q * NN + n] = sum;
        }
    __syncthreads();
    const int q = (int)threadIdx.x / NN, n = (int)threadIdx.x % NN;
    if (q < R && n < N && r0 + q < M) {
        float sum = 0.0f;
        for (int i = 0; i < nt / 32; i++) sum += red[i][q * NN + n];
        C[n * M + r0 + q] = Ci ? Ci[n * M + r0 + q] + sum : sum;
    }
}

// the unit kernel's threads for rows of K: enough for each to take U units a trip, 32 to 128
static unsigned cu_gemv_unit_threads(int64_t K, int E, int U) {
    const int64_t per = (K / E + U - 1) / U;
    return (unsigned)std::min<int64_t>(GV_WARPS * 32, std::max<int64_t>(32, (per + 31) / 32 * 32));
}

static const int g_gemv_rows = [] {
    const char *e = getenv("QLORA_CUDA_GEMV_ROWS");
    return e && (!strcmp(e, "1") || !strcmp(e, "2")) ? atoi(e) : 4;
}();
// ---- decode with 8-bit activations (ql_cuda_mm_q8: ql_mul_mat_set_prec Q8_0) ----
// The CPU's path (mm_q8) on the device: b's columns quantised once per node by k_q8_act into the
// workspace - int8 codes per element, per block of qb (32; 256 for the k-quants) an f32 scale
// d = amax / 127 (+ 0 * every element: NaN for a non-finite one) and the sums of each g codes (32;
// 8 for the k-quants: the offsets' part: Q4_0's -8, Q4_K's mins, Q6_K's -32) - then each weight
// unit dotted with them by __dp4a (four byte products a lane-instruction) on the packed codes,
// each unit's integer sums scaled in f32. The same codes and integer sums as the CPU: the results
// differ from its by f32 summation order only (the CPU's bound against the exact path then holds).
// A thread's unit is 32 elements; the k-quants' 8 units of a super-block are 8 neighbouring
// threads (16-byte loads of Q4_K's codes: a warp reads 4 super-blocks' 512 code bytes at once;
// Q5_K's the same, with its fifth bits' 16 bytes; IQ4_NL / IQ4_XS through their table as NF4; Q4_1
// and Q5_0/1 as Q4_0). Q2_K and Q3_K take the f32 decode kernels (k_gemv): packed, but no dp4a.
// NF4's codes become their int8 values (QL_NF4_I8_VALUES) by two byte permutes from the table in
// registers, a select on the code's top bit. Q4_0, Q8_0 (18- and 34-byte blocks) and Q6_K (210)
// are read by 2-byte loads, a thread a block (Q4_0, Q8_0) - limitation: not coalesced; the
// Q4_K / NF4 files this targets use Q6_K for the head (~9% of an 8B file's bytes).

__constant__ int8_t cu_nf4_i8[16] = QL_NF4_I8_VALUES;
__constant__ int8_t cu_iq4_i8[16] = QL_IQ4_VALUES;  // IQ4_NL / IQ4_XS's non-linear values

#define Q8_ACT_WARPS 8  // warps per block of k_q8_act, 256 elements each

// codes [N, K], scales [N, K/qb], sums [N, K/g] (ql_cuda_mm_q8_layout) of b [K, N] (f32, columns
// bnb1 bytes apart). A lane takes 8 neighbouring elements; the lanes of a block (4 for qb 32, the
// warp for 256) meet by shuffles. Here a lane's 8 elements e.. of column n (every lane of the warp
// calls it: the shuffles; in: e < K); k_q8_act's grid: (K / (256 Q8_ACT_WARPS) rounded up, N)
__device__ __forceinline__ void cu_q8_act8(const float v[8], bool in, int64_t n, int64_t K, int64_t e, int qb, int8_t *q, float *d, int *s) {
    const int lane = threadIdx.x % 32;
    float amax = 0.0f, bad = 0.0f;
QL_UNROLL
    for (int l = 0; l < 8; l++) {
        amax = fmaxf(amax, fabsf(v[l]));
        bad += v[l] * 0.0f;
    }
    const int span = qb == 32 ? 4 : 32;  // lanes of a block
    for (int o = 1; o < span; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        bad += __shfl_xor_sync(0xffffffff, bad, o);
    }
    const float id = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;  // the CPU's expressions: x id to nearest even, |.| <= 127
    uint32_t w[2] = {0, 0};
    int sum = 0;
QL_UNROLL
    for (int l = 0; l < 8; l++) {
        const int c = max(-127, min(127, __float2int_rn(__fmul_rn(v[l], id))));
        w[l / 4] |= (uint32_t)(c & 255) << 8 * (l % 4);
        sum += c;
    }
    // the sums of g codes: a lane's 8 (qb 256), or its block's 4 lanes' (qb 32)
    if (qb == 32) sum += __shfl_xor_sync(0xffffffff, sum, 1), sum += __shfl_xor_sync(0xffffffff, sum, 2);
    if (!in) return;
    *(uint2 *)(q + n * K + e) = make_uint2(w[0], w[1]);
    const int g = qb == 32 ? 32 : 8;
    if (lane % (g / 8) == 0) s[n * (K / g) + e / g] = sum;
    if (lane % span == 0) d[n * (K / qb) + e / qb] = __fadd_rn(__fdiv_rn(amax, 127.0f), bad);
}
__global__ void __launch_bounds__(Q8_ACT_WARPS * 32) k_q8_act(const char *b, int64_t bnb1, int64_t K, int qb, int8_t *q, float *d, int *s) {
    const int lane = threadIdx.x % 32, n = blockIdx.y;
    const int64_t e = ((int64_t)blockIdx.x * Q8_ACT_WARPS + threadIdx.x / 32) * 256 + lane * 8;
    const bool in = e < K;  // (K a multiple of qb: a block's lanes are all in or all out)
    const float *x = (const float *)(b + n * bnb1) + e;
    float v[8];
    if (in && (((uintptr_t)x) % 16) == 0) {
        const float4 p0 = ((const float4 *)x)[0], p1 = ((const float4 *)x)[1];
        v[0] = p0.x, v[1] = p0.y, v[2] = p0.z, v[3] = p0.w, v[4] = p1.x, v[5] = p1.y, v[6] = p1.z, v[7] = p1.w;
    } else {
QL_UNROLL
        for (int l = 0; l < 8; l++) v[l] = in ? x[l] : 0.0f;
    }
    cu_q8_act8(v, in, n, K, e, qb, q, d, s);
}

// The weight units: load (the raw bytes of unit i of a row), xload (column n's codes, scales and
// sums for unit i), dot (the unit's products, f32). A unit is 32 elements.
struct q8x_t {  // 32 codes, the block's scale, up to 4 sums
    int4 c0, c1;
    float d;
    int s[4];
};
__device__ __forceinline__ uint32_t cu_ld_u32_2(const uint8_t *p) {  // 4 bytes at a 2-byte boundary
    return (uint32_t)((const uint16_t *)p)[0] | (uint32_t)((const uint16_t *)p)[1] << 16;
}

struct gq_q4_0 {  // a block of 18 bytes: d, 16 bytes of codes (element j low nibble, j + 16 high)
    static constexpr int QB = 32;
    struct raw { uint32_t q[4]; uint16_t d; };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + i * sizeof(ql_block_q4_0);
        x.d = *(const uint16_t *)b;
QL_UNROLL
        for (int k = 0; k < 4; k++) x.q[k] = cu_ld_u32_2(b + 2 + 4 * k);
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *s, int64_t i) {
        x.c0 = ((const int4 *)(q + 32 * i))[0], x.c1 = ((const int4 *)(q + 32 * i))[1];
        x.d = d[i], x.s[0] = s[i];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *) {
        const int lo[4] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w}, hi[4] = {x.c1.x, x.c1.y, x.c1.z, x.c1.w};
        int sum = 0;
QL_UNROLL
        for (int k = 0; k < 4; k++) sum = __dp4a((int)((w.q[k] >> 4) & 0x0f0f0f0fu), hi[k], __dp4a((int)(w.q[k] & 0x0f0f0f0fu), lo[k], sum));
        return (float)(sum - 8 * x.s[0]) * __fmul_rn(cu_h2f(w.d), x.d);
    }
};

struct gq_q8_0 {  // a block of 34 bytes: d, 32 int8 codes
    static constexpr int QB = 32;
    struct raw { uint32_t q[8]; uint16_t d; };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + i * sizeof(ql_block_q8_0);
        x.d = *(const uint16_t *)b;
QL_UNROLL
        for (int k = 0; k < 8; k++) x.q[k] = cu_ld_u32_2(b + 2 + 4 * k);
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *, int64_t i) {
        x.c0 = ((const int4 *)(q + 32 * i))[0], x.c1 = ((const int4 *)(q + 32 * i))[1];
        x.d = d[i];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *) {
        const int c[8] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w, x.c1.x, x.c1.y, x.c1.z, x.c1.w};
        int sum = 0;
QL_UNROLL
        for (int k = 0; k < 8; k++) sum = __dp4a((int)w.q[k], c[k], sum);
        return (float)sum * __fmul_rn(cu_h2f(w.d), x.d);
    }
};

// NF4 codes -> int8 values, four at a time: n holds a code in the low nibble of each byte; the
// table's entries 0-7 are t[0..1], 8-15 t[2..3]
__device__ __forceinline__ uint32_t cu_nf4_i8x4(uint32_t n, const uint32_t *t) {
    const uint32_t sel = __byte_perm(n | (n >> 4), 0, 0x4420) & 0x7777;  // the codes' low 3 bits, a nibble each
    const uint32_t lo = __byte_perm(t[0], t[1], sel), hi = __byte_perm(t[2], t[3], sel);
    const uint32_t top = ((n >> 3) & 0x01010101u) * 255u;  // 0xff in the bytes whose code is 8 or more
    return (lo & ~top) | (hi & top);
}
struct gq_nf4 {  // half a block of 64: 16 bytes of codes (element 2j in byte j's high nibble), the block's absmax / 127
    static constexpr int QB = 32;
    struct raw { uint4 q; float wsc; };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int type, const char *aux, int64_t K, int64_t r, int64_t i) {
        x.q = *(const uint4 *)(row + 16 * i);
        x.wsc = __fdiv_rn(cu_nf4_block_absmax(type, aux, (r * K + 32 * i) / QL_NF4_BLOCK), 127.0f);
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *, int64_t i) {
        x.c0 = ((const int4 *)(q + 32 * i))[0], x.c1 = ((const int4 *)(q + 32 * i))[1];
        x.d = d[i];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *t) {
        const uint32_t c[4] = {w.q.x, w.q.y, w.q.z, w.q.w};
        const int xc[8] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w, x.c1.x, x.c1.y, x.c1.z, x.c1.w};
        int sum = 0;
QL_UNROLL
        for (int k = 0; k < 4; k++) {  // bytes 4k .. 4k + 3: elements 8k .. 8k + 7
            const uint32_t ve = cu_nf4_i8x4((c[k] >> 4) & 0x0f0f0f0fu, t), vo = cu_nf4_i8x4(c[k] & 0x0f0f0f0fu, t);
            sum = __dp4a((int)__byte_perm(ve, vo, 0x5140), xc[2 * k], sum);      // elements 8k .. 8k + 3
            sum = __dp4a((int)__byte_perm(ve, vo, 0x7362), xc[2 * k + 1], sum);  // 8k + 4 .. 8k + 7
        }
        return (float)sum * __fmul_rn(w.wsc, x.d);
    }
};

// Q4_K and Q5_K (Q5: a fifth bit per element from qh, codes 0..31; the same scales, mins and sums)
template <bool Q5>
struct gq_k45 {  // unit j of a super-block: 16 code bytes 32p + 16h (p = j / 2, h = j % 2): elements 16h .. 16h + 15 of sub-blocks 2p and 2p + 1
    static constexpr int QB = QL_QK_K;
    typedef std::conditional_t<Q5, ql_block_q5_K, ql_block_q4_K> block;
    struct raw { uint4 hd, q, qh; int j; };  // (qh: Q5_K's bytes 16h .. 16h + 15, bit 2p for sub-block 2p, 2p + 1 for 2p + 1)
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + (i / 8) * sizeof(block);
        x.j = (int)(i % 8);
        x.hd = *(const uint4 *)b;  // d, dmin, scales[12]
        x.q = *(const uint4 *)(b + offsetof(block, qs) + 16 * x.j);
        if constexpr (Q5) x.qh = *(const uint4 *)(b + offsetof(ql_block_q5_K, qh) + 16 * (x.j % 2));
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *s, int64_t i) {
        const int64_t b = i / 8;
        const int j = (int)(i % 8), p = j / 2, h = j % 2;
        const int8_t *c = q + b * QL_QK_K + 64 * p + 16 * h;
        x.c0 = *(const int4 *)c, x.c1 = *(const int4 *)(c + 32);
        x.d = d[b];
        const int *sp = s + b * (QL_QK_K / 8) + 8 * p + 2 * h;  // sums of 8: the unit's 16 of each sub-block
        x.s[0] = sp[0] + sp[1], x.s[1] = sp[4] + sp[5];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *) {
        const int p = w.j / 2;
        // the 6-bit scales and mins as mm_k4_scales: bytes 2p, 2p + 1 of sc[0..7], mn[0..7]
        const uint32_t sc = p < 2 ? w.hd.y & 0x3f3f3f3fu : (w.hd.w & 0x0f0f0f0fu) | (((w.hd.y >> 6) & 0x03030303u) << 4);
        const uint32_t mn = p < 2 ? w.hd.z & 0x3f3f3f3fu : ((w.hd.w >> 4) & 0x0f0f0f0fu) | (((w.hd.z >> 6) & 0x03030303u) << 4);
        const int sh = 16 * (p & 1);
        const int sc0 = (sc >> sh) & 255, sc1 = (sc >> (sh + 8)) & 255, mn0 = (mn >> sh) & 255, mn1 = (mn >> (sh + 8)) & 255;
        const uint32_t c[4] = {w.q.x, w.q.y, w.q.z, w.q.w};
        const uint32_t hb[4] = {w.qh.x, w.qh.y, w.qh.z, w.qh.w};
        const int xa[4] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w}, xb[4] = {x.c1.x, x.c1.y, x.c1.z, x.c1.w};
        int sa = 0, sb = 0;
QL_UNROLL
        for (int k = 0; k < 4; k++) {
            uint32_t lo = c[k] & 0x0f0f0f0fu, hi = (c[k] >> 4) & 0x0f0f0f0fu;
            if constexpr (Q5) {
                lo |= ((hb[k] >> (2 * p)) & 0x01010101u) << 4;
                hi |= ((hb[k] >> (2 * p + 1)) & 0x01010101u) << 4;
            }
            sa = __dp4a((int)lo, xa[k], sa);
            sb = __dp4a((int)hi, xb[k], sb);
        }
        const float dx = x.d;
        return (float)(sc0 * sa + sc1 * sb) * __fmul_rn(cu_h2f((uint16_t)(w.hd.x & 0xffff)), dx) -
               (float)(mn0 * x.s[0] + mn1 * x.s[1]) * __fmul_rn(cu_h2f((uint16_t)(w.hd.x >> 16)), dx);
    }
};
typedef gq_k45<false> gq_q4_K;
typedef gq_k45<true> gq_q5_K;

struct gq_q6_K {  // unit j of a super-block: half h = j / 4, l in [8t, 8t + 8) (t = j % 4) of its four groups m (elements 128h + 32m + l)
    static constexpr int QB = QL_QK_K;
    struct raw { uint32_t la[2], lb[2], qh[2]; int sc; uint16_t d; };  // sc: the four groups' scales (int8)
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + (i / 8) * sizeof(ql_block_q6_K);
        const int j = (int)(i % 8), h = j / 4, t = j % 4;
QL_UNROLL
        for (int k = 0; k < 2; k++) {
            x.la[k] = cu_ld_u32_2(b + 64 * h + 8 * t + 4 * k);       // groups 0 (low nibbles), 2 (high)
            x.lb[k] = cu_ld_u32_2(b + 64 * h + 32 + 8 * t + 4 * k);  // groups 1, 3
            x.qh[k] = cu_ld_u32_2(b + 128 + 32 * h + 8 * t + 4 * k);
        }
        int sc = 0;
QL_UNROLL
        for (int m = 0; m < 4; m++) {  // scales[8h + 2m + t / 2]: a byte of the 2-byte word at 8h + 2m
            const uint32_t v = *(const uint16_t *)(b + 192 + 8 * h + 2 * m);
            sc |= (int)((v >> 8 * (t / 2)) & 255) << 8 * m;
        }
        x.sc = sc;
        x.d = *(const uint16_t *)(b + 208);
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *s, int64_t i) {
        const int64_t b = i / 8;
        const int j = (int)(i % 8), h = j / 4, t = j % 4;
        const int8_t *c = q + b * QL_QK_K + 128 * h + 8 * t;  // groups m at + 32 m: 8 codes each
        const int2 g0 = *(const int2 *)c, g1 = *(const int2 *)(c + 32), g2 = *(const int2 *)(c + 64), g3 = *(const int2 *)(c + 96);
        x.c0 = make_int4(g0.x, g0.y, g1.x, g1.y), x.c1 = make_int4(g2.x, g2.y, g3.x, g3.y);
        x.d = d[b];
        const int *sp = s + b * (QL_QK_K / 8) + 16 * h + t;
QL_UNROLL
        for (int m = 0; m < 4; m++) x.s[m] = sp[4 * m];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *) {
        const int xc[8] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w, x.c1.x, x.c1.y, x.c1.z, x.c1.w};  // group m's words: 2m, 2m + 1
        int dm[4] = {0, 0, 0, 0};
QL_UNROLL
        for (int k = 0; k < 2; k++) {  // 6-bit codes 0..63, a byte each
            const uint32_t la = w.la[k], lb = w.lb[k], qh = w.qh[k];
            dm[0] = __dp4a((int)((la & 0x0f0f0f0fu) | ((qh & 0x03030303u) << 4)), xc[k], dm[0]);
            dm[1] = __dp4a((int)((lb & 0x0f0f0f0fu) | ((qh & 0x0c0c0c0cu) << 2)), xc[2 + k], dm[1]);
            dm[2] = __dp4a((int)(((la >> 4) & 0x0f0f0f0fu) | (qh & 0x30303030u)), xc[4 + k], dm[2]);
            dm[3] = __dp4a((int)(((lb >> 4) & 0x0f0f0f0fu) | ((qh >> 2) & 0x30303030u)), xc[6 + k], dm[3]);
        }
        int sum = 0;
QL_UNROLL
        for (int m = 0; m < 4; m++) sum += (int)(int8_t)(w.sc >> 8 * m) * (dm[m] - 32 * x.s[m]);
        return (float)sum * __fmul_rn(cu_h2f(w.d), x.d);
    }
};

// Q4_1, Q5_0 and Q5_1 (blocks of 32, 2-byte aligned: 2-byte loads, a thread a block as Q4_0): the
// nibbles as Q4_0's; Q5's fifth bit of element j is bit j of qh, spread here to bit 4 of each byte;
// x = d (q - 16) (Q5_0) or d q + m (Q4_1, Q5_1): the offset or the min times the activation's block sum
__device__ __forceinline__ uint32_t cu_qh_bit4(uint32_t qh, int j) {  // bits j .. j + 3 of qh at bit 4 of bytes 0 .. 3
    const uint32_t x = (qh >> j) & 15u;
    return ((x & 1u) | (x & 2u) << 7 | (x & 4u) << 14 | (x & 8u) << 21) << 4;
}
template <bool Q5, bool MIN>
struct gq_q01 : gq_q4_0 {  // (Q4_0's activation side: xload)
    typedef std::conditional_t<Q5, std::conditional_t<MIN, ql_block_q5_1, ql_block_q5_0>, ql_block_q4_1> block;
    struct raw { uint32_t q[4], qh; uint16_t d, m; };
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + i * sizeof(block);
        x.d = *(const uint16_t *)b;
        x.m = MIN ? *(const uint16_t *)(b + 2) : 0;
        x.qh = 0;
        if constexpr (Q5) x.qh = cu_ld_u32_2(b + offsetof(block, qh));
QL_UNROLL
        for (int k = 0; k < 4; k++) x.q[k] = cu_ld_u32_2(b + offsetof(block, qs) + 4 * k);
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *) {
        const int lo[4] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w}, hi[4] = {x.c1.x, x.c1.y, x.c1.z, x.c1.w};
        int sum = 0;
QL_UNROLL
        for (int k = 0; k < 4; k++) {  // elements 4k .. 4k + 3 (low nibbles), 16 + 4k .. (high)
            uint32_t a = w.q[k] & 0x0f0f0f0fu, b = (w.q[k] >> 4) & 0x0f0f0f0fu;
            if constexpr (Q5) a |= cu_qh_bit4(w.qh, 4 * k), b |= cu_qh_bit4(w.qh, 16 + 4 * k);
            sum = __dp4a((int)b, hi[k], __dp4a((int)a, lo[k], sum));
        }
        if constexpr (!MIN) return (float)(sum - 16 * x.s[0]) * __fmul_rn(cu_h2f(w.d), x.d);
        return (float)sum * __fmul_rn(cu_h2f(w.d), x.d) + (float)x.s[0] * __fmul_rn(cu_h2f(w.m), x.d);
    }
};

// IQ4_NL (a block of 32: d, 16 bytes, element j the low nibble of byte j, j + 16 the high) and
// IQ4_XS (unit s of a super-block of 136 bytes: sub-block s's 16 bytes, its 6-bit scale ls, x =
// d (ls - 32) kvalue[q]): the codes become the table's int8 values as NF4's do (cu_nf4_i8x4 with
// IQ4's table), then dp4a; one scale a unit, no mins or offsets
__device__ __forceinline__ int cu_iq4_dot16(const uint32_t q[4], const q8x_t &x, const uint32_t *t) {
    const int lo[4] = {x.c0.x, x.c0.y, x.c0.z, x.c0.w}, hi[4] = {x.c1.x, x.c1.y, x.c1.z, x.c1.w};
    int sum = 0;
QL_UNROLL
    for (int k = 0; k < 4; k++) {  // bytes 4k .. 4k + 3: elements 4k .. 4k + 3 (low nibbles) and 16 + 4k .. (high)
        sum = __dp4a((int)cu_nf4_i8x4(q[k] & 0x0f0f0f0fu, t), lo[k], sum);
        sum = __dp4a((int)cu_nf4_i8x4((q[k] >> 4) & 0x0f0f0f0fu, t), hi[k], sum);
    }
    return sum;
}
struct gq_iq4_nl : gq_q4_0 {  // Q4_0's block layout (load, xload); its own values
    static_assert(sizeof(ql_block_iq4_nl) == sizeof(ql_block_q4_0), "IQ4_NL reads as Q4_0's block");
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *t) {
        return (float)cu_iq4_dot16(w.q, x, t) * __fmul_rn(cu_h2f(w.d), x.d);
    }
};
struct gq_iq4_xs {
    static constexpr int QB = QL_QK_K;
    struct raw { uint32_t q[4], hs, sl; int s; };  // hs: d | scales_h << 16; sl: scales_l[0..3]
    __device__ __forceinline__ static void load(raw &x, const uint8_t *row, int, const char *, int64_t, int64_t, int64_t i) {
        const uint8_t *b = row + (i / 8) * sizeof(ql_block_iq4_xs);  // (136 bytes: 4-byte loads)
        x.s = (int)(i % 8);
        x.hs = *(const uint32_t *)b;
        x.sl = *(const uint32_t *)(b + offsetof(ql_block_iq4_xs, scales_l));
        const uint8_t *qs = b + offsetof(ql_block_iq4_xs, qs) + 16 * x.s;
QL_UNROLL
        for (int k = 0; k < 4; k++) x.q[k] = *(const uint32_t *)(qs + 4 * k);
    }
    __device__ __forceinline__ static void xload(q8x_t &x, const int8_t *q, const float *d, const int *, int64_t i) {
        x.c0 = ((const int4 *)(q + 32 * i))[0], x.c1 = ((const int4 *)(q + 32 * i))[1];  // (unit i: elements 32 i ..)
        x.d = d[i / 8];
    }
    __device__ __forceinline__ static float dot(const raw &w, const q8x_t &x, const uint32_t *t) {
        const int ls = (int)((w.sl >> (8 * (w.s / 2) + 4 * (w.s % 2))) & 15) | (int)(((w.hs >> 16) >> (2 * w.s)) & 3) << 4;
        return (float)(cu_iq4_dot16(w.q, x, t) * (ls - 32)) * __fmul_rn(cu_h2f((uint16_t)(w.hs & 0xffff)), x.d);
    }
};
// the int8 table a unit type reads (NF4's for the types without one: unused)
template <typename T> __device__ __forceinline__ const int8_t *cu_lut_of() {
    if constexpr (std::is_same_v<T, gq_iq4_nl> || std::is_same_v<T, gq_iq4_xs>) return cu_iq4_i8;
    return cu_nf4_i8;
}

// v into the cache's element i0 of row at + i1 (kv head i2, batch i3); f16: 2-byte elements
__device__ __forceinline__ void cu_cache_put(const cu_t &cache, bool f16, int32_t at, int64_t i0, int64_t i1, int64_t i2, int64_t i3, float v) {
    // limitation: a row outside the cache is not written (the CPU backend reports it; the tools never ask for one)
    if (at >= 0 && at + i1 < cache.ne[1]) {
        char *to = cache.data + i0 * (f16 ? 2 : 4) + (at + i1) * cache.nb[1] + i2 * cache.nb[2] + i3 * cache.nb[3];
        if (!f16) *(float *)to = v;
        else *(uint16_t *)to = (uint16_t)cu_bits16(v, QL_TYPE_F16);
    }
}
// rope's angle for pair i at position p (k_rope's and the decode products' tail's): in double as
// the CPU's, reduced to [-pi, pi] in double, then the f32 intrinsics (|error| < 2^-21 there;
// double sin/cos would put their large-argument path in local memory); back: its inverse
__device__ __forceinline__ void cu_rope_cs(int i, int n_dims, float base, const float *ff, int32_t p, int back, float *cs, float *sn) {
    const double inv = ql_rope_inv_freq(i, n_dims, (double)base, ff ? (double)ff[i] : 1.0);  // qlora.h: the CPU's expression
    const double th = (double)p * inv, two_pi = 6.283185307179586476925;
    const float r = (float)(th - two_pi * rint(th / two_pi));
    *cs = __cosf(r), *sn = back ? -__sinf(r) : __sinf(r);
}
__device__ __forceinline__ void cu_rope_rot(float x0, float x1, float cs, float sn, float *y0, float *y1) {
    *y0 = x0 * cs - x1 * sn, *y1 = x0 * sn + x1 * cs;
}

// The tail of a decode product's launch (ql_cuda_gemv_norm, ql_cuda_gemv_swiglu), run by every
// block after it stored its rows: it counts itself in cnt[g] (each thread's stores made visible
// first), and the last of the launch (norm: cnt[0], every block) or of its 256 rows (SwiGLU:
// cnt[row / 256], both products' blocks of them) makes the result from what the others stored,
// read past L1: the norm's rows [M, N] (k_rms_norm_q8's bits) or SwiGLU's 256 rows (k_swiglu_q8's),
// and the next product's codes (q NULL: none). It sets the counter back to 0 for the next launch.
struct gv_tail {
    int kind;                // 0: none; 1: the norm of a (w: its weight, or NULL); 2: SwiGLU of a and b
    unsigned *cnt;           // zero (the backend's scratch)
    const float *a, *b, *w;
    float eps;
    float *out;              // [M, N]
    int qb;                  // the next product's codes: blocks of qb, at q, sd, ss (ql_cuda_mm_q8_layout)
    int8_t *q;
    float *sd;
    int *ss;
    // kind 3 (ql_cuda_gemv_rope; a q, k, v group): q's and k's heads of D rows rotated into rq and rk
    // (NULL: not joined; H of q's) at positions pos with rope's frequencies (ff: NULL or factors,
    // base, mode); the keys' cache kc and the values' vc (data NULL: no store; f16: cf16) at row *at,
    // the values' heads of DV
    float *rq, *rk;
    int64_t D, H, DV;
    const int32_t *pos;
    const float *ff;
    float base;
    int mode, cf16;
    cu_t kc, vc;
    const int32_t *at;
};
// kind 3's tail, run by the blocks of q's (sg 0) and k's (sg 1) rows r0..: the last block of a
// head's rows (counted in cnt[(sg ? H : 0) + head]) rotates it, every token, as k_rope does
// (cu_rope_cs, cu_rope_rot: the same bits), and stores k's rotated pairs in the keys' cache
__device__ __forceinline__ void gv_rope_tail(unsigned *cnt, const float *a, float *out, int64_t M, int N, int64_t r0, int R, int sg, int64_t D,
                                             int64_t H, const int32_t *pos, const float *ff, float base, int mode, const cu_t &kc, int cf16,
                                             const int32_t *at) {
    __shared__ bool last;
    const int64_t g = (sg ? H : 0) + r0 / D;
    __threadfence();  // this thread's rows visible before the count says so
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + g, 1u) == (unsigned)(D / R) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const volatile float *va = a;  // (stored by other blocks)
    const int64_t h = r0 / D, hp = D / 2, other = mode == QL_ROPE_NEOX ? hp : 1;
    const bool store = sg == 1 && kc.data;
    const int32_t row = store ? *at : 0;
    for (int64_t j = threadIdx.x; j < N * hp; j += blockDim.x) {
        const int64_t t = j / hp, i = j % hp, i0 = mode == QL_ROPE_NEOX ? i : 2 * i, e = t * M + h * D + i0;
        float cs, sn, y0, y1;
        cu_rope_cs((int)i, (int)D, base, ff, pos[t], 0, &cs, &sn);
        cu_rope_rot(va[e], va[e + other], cs, sn, &y0, &y1);
        out[e] = y0, out[e + other] = y1;  // (the rotation [D, H, T]: C's own layout)
        if (store) {
            cu_cache_put(kc, cf16 != 0, row, i0, t, h, 0, y0);
            cu_cache_put(kc, cf16 != 0, row, i0 + other, t, h, 0, y1);
        }
    }
    if (threadIdx.x == 0) cnt[g] = 0;
}
__device__ __forceinline__ void gv_tail_run(int kind, unsigned *cnt, const float *a, const float *b, const float *w, float eps, float *out,
                                            int qb, int8_t *q, float *sd, int *ss, int64_t M, int N, int64_t g, unsigned arrivals) {
    __shared__ bool last;
    __shared__ float sh[32];
    __threadfence();  // this thread's rows visible before the count says so
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + g, 1u) == arrivals - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const volatile float *va = a, *vb = b;  // (stored by other blocks)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    // the norm: each column's scale first (k_rms_norm's sums); then a warp makes 256 elements at a
    // time - a column's all (norm) or rows g's (SwiGLU) - stores them, and reads them back for the
    // codes (one path for both kinds: few values live across the divisions' calls)
    __shared__ float rss[QL_CUDA_GEMV_MAX_N];
    for (int n = 0; kind == 1 && n < N; n++) {
        const float rs = cu_rms_scale_of(va + n * M, M, eps, sh);
        if (threadIdx.x == 0) rss[n] = rs;
    }
    __syncthreads();
    const int64_t per = kind == 1 ? M / 256 : 1, e0 = kind == 1 ? 0 : g * 256;  // chunks of 256 a column, the first's row
    for (int64_t it = warp; it < N * per; it += nw) {  // (warp-uniform: the shuffles)
        const int n = (int)(it / per);
        const int64_t e = e0 + (it % per) * 256 + lane * 8;
QL_UNROLL
        for (int l = 0; l < 8; l++)
            out[n * M + e + l] = kind == 1 ? cu_rms_elem(va + n * M, rss[n], w, e + l) : cu_swiglu_f(va[n * M + e + l], vb[n * M + e + l]);
        if (!q) continue;
        float v[8];
QL_UNROLL
        for (int l = 0; l < 8; l++) v[l] = out[n * M + e + l];  // (this thread's own stores)
        cu_q8_act8(v, true, n, M, e, qb, q, sd, ss);
    }
    if (threadIdx.x == 0) cnt[g] = 0;
}

// One product's part of a k_gemv_q8 launch (ql_cuda_gemv_group: q, k and v, or gate and up, of
// one b's codes): its weight (row_bytes apart, aux: NF4's double-quantised scales), M rows, the
// result C [M, N] and its addend Ci (or NULL)
struct gv_seg {
    const char *w;
    int64_t row_bytes;
    const char *aux;
    int64_t M;
    float *C;
    const float *Ci;
};

// C [M, N] = W b (+ Ci, as k_gemv's) from b's codes: R rows a block, NN >= N columns; a thread
// takes units i0, i0 + threads, ... of its rows, each column's codes read once for the R rows.
// Partial sums meet by shuffles, then across warps in a fixed order. Up to three products of the
// same codes: blocks [0, blk1) make s0's rows, [blk1, blk2) s1's, the rest s2's (grid: the sum of
// their M / R blocks of 32-128 threads); each row's sums are those of its product launched alone.
// tl: the launch's tail (gv_tail_run: s0's norm, or SwiGLU of s0's and s1's results), or kind 0
template <typename T, int R, int NN>
__global__ void __launch_bounds__(GV_WARPS * 32) k_gemv_q8(gv_seg s0, gv_seg s1, gv_seg s2, int64_t blk1, int64_t blk2, int type, int64_t K,
                                                           const int8_t *xq, const float *xd, const int *xs, int N, gv_tail tl) {
    __shared__ float red[GV_WARPS][R * NN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nt = blockDim.x;
    // this block's product, field by field (an indexed array of them would go through the stack)
    const int64_t bx = blockIdx.x;
    const int sg = bx >= blk2 ? 2 : bx >= blk1 ? 1 : 0;
    const char *w = sg == 2 ? s2.w : sg == 1 ? s1.w : s0.w, *aux = sg == 2 ? s2.aux : sg == 1 ? s1.aux : s0.aux;
    const int64_t row_bytes = sg == 2 ? s2.row_bytes : sg == 1 ? s1.row_bytes : s0.row_bytes, M = sg == 2 ? s2.M : sg == 1 ? s1.M : s0.M;
    float *C = sg == 2 ? s2.C : sg == 1 ? s1.C : s0.C;
    const float *Ci = sg == 2 ? s2.Ci : sg == 1 ? s1.Ci : s0.Ci;
    const int64_t r0 = (bx - (sg == 2 ? blk2 : sg == 1 ? blk1 : 0)) * R, n_units = K / 32;
    const int g = T::QB == 32 ? 32 : 8;
    uint32_t tab[4];  // a table type's int8 values (NF4's, or IQ4_NL/XS's), four a word
    const int8_t *lut = cu_lut_of<T>();
QL_UNROLL
    for (int k = 0; k < 4; k++)
        tab[k] = (uint32_t)(uint8_t)lut[4 * k] | (uint32_t)(uint8_t)lut[4 * k + 1] << 8 | (uint32_t)(uint8_t)lut[4 * k + 2] << 16 |
                 (uint32_t)(uint8_t)lut[4 * k + 3] << 24;
    float acc[R][NN];
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) acc[q][n] = 0.0f;
    for (int64_t i = threadIdx.x; i < n_units; i += nt) {
        typename T::raw x[R];
QL_UNROLL
        for (int q = 0; q < R; q++) {  // rows past M: r0's again (not stored)
            const int64_t r = r0 + q < M ? r0 + q : r0;
            T::load(x[q], (const uint8_t *)w + r * row_bytes, type, aux, K, r, i);
        }
QL_UNROLL
        for (int n = 0; n < NN; n++) {
            if (n >= N) break;
            q8x_t xv;
            T::xload(xv, xq + n * K, xd + n * (K / T::QB), xs + n * (K / g), i);
QL_UNROLL
            for (int q = 0; q < R; q++) acc[q][n] += T::dot(x[q], xv, tab);
        }
    }
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) {
            if (n >= N) break;
            float sum = acc[q][n];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
            if (lane == 0) red[warp][q * NN + n] = sum;
        }
    __syncthreads();
    const int q = (int)threadIdx.x / NN, n = (int)threadIdx.x % NN;
    if (q < R && n < N && r0 + q < M) {
        float sum = 0.0f;
        for (int i = 0; i < nt / 32; i++) sum += red[i][q * NN + n];
        const float y = Ci ? Ci[n * M + r0 + q] + sum : sum;
        C[n * M + r0 + q] = y;
        if (tl.kind == 3 && sg == 2 && tl.vc.data)  // (ql_cuda_gemv_rope: v's row into the values' cache, as k_cache_store)
            cu_cache_put(tl.vc, tl.cf16 != 0, *tl.at, (r0 + q) % tl.DV, n, (r0 + q) / tl.DV, 0, y);
    }
    if (tl.kind == 3) {
        if (sg < 2 && (sg == 0 ? tl.rq : tl.rk))
            gv_rope_tail(tl.cnt, C, sg == 0 ? tl.rq : tl.rk, M, N, r0, R, sg, tl.D, tl.H, tl.pos, tl.ff, tl.base, tl.mode, tl.kc, tl.cf16, tl.at);
    } else if (tl.kind)
        gv_tail_run(tl.kind, tl.cnt, tl.a, tl.b, tl.w, tl.eps, tl.out, tl.qb, tl.q, tl.sd, tl.ss, M, N, tl.kind == 1 ? 0 : r0 / 256,
                    tl.kind == 1 ? gridDim.x : 2 * (256 / R));
}

// Q6_K's 210-byte blocks through shared memory: a warp stages a chunk of 8 super-blocks of each
// of its R rows (1680 bytes, 16-byte aligned where rows are a multiple of 2048 elements) with
// 16-byte loads - 4 a lane, each instruction 512 neighbouring bytes - and its lanes then read
// their units' bytes there (gq_q6_K::load on the chunk: 2 units a lane). Read straight from global
// memory a unit's 17 two-byte loads touch ~8 cache lines a warp-instruction. Grid: M / R blocks of
// one warp per chunk of a row, up to GV_WARPS; the sums as k_gemv_q8's.
#define Q6S_CHUNK (8 * (int)sizeof(ql_block_q6_K))  // bytes of a chunk: 8 super-blocks, 2048 elements
template <int R, int NN>
__global__ void __launch_bounds__(GV_WARPS * 32) k_gemv_q8_q6s(const char *w, int64_t row_bytes, int64_t K, int64_t M, const int8_t *xq,
                                                               const float *xd, const int *xs, int N, float *C, const float *Ci, gv_tail tl) {
    QL_DYN_SMEM(uint4, stage);  // [warps][R][Q6S_CHUNK / 16]: each warp's chunk of each row
    __shared__ float red[GV_WARPS][R * NN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const int64_t r0 = (int64_t)blockIdx.x * R, n_chunks = K / 2048;
    float acc[R][NN];
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) acc[q][n] = 0.0f;
    for (int64_t ch = warp; ch < n_chunks; ch += nw) {
QL_UNROLL
        for (int q = 0; q < R; q++) {  // rows past M: r0's again (not stored)
            const uint4 *src = (const uint4 *)(w + (r0 + q < M ? r0 + q : r0) * row_bytes + ch * Q6S_CHUNK);
QL_UNROLL
            for (int k = 0; k < 4; k++)
                if (lane + 32 * k < Q6S_CHUNK / 16) stage[(warp * R + q) * (Q6S_CHUNK / 16) + lane + 32 * k] = src[lane + 32 * k];
        }
        __syncwarp();
QL_UNROLL
        for (int h = 0; h < 2; h++) {  // units lane and lane + 32 of the chunk's 64
            const int u = lane + 32 * h;
            gq_q6_K::raw x[R];
QL_UNROLL
            for (int q = 0; q < R; q++) gq_q6_K::load(x[q], (const uint8_t *)(stage + (warp * R + q) * (Q6S_CHUNK / 16)), 0, nullptr, K, 0, u);
QL_UNROLL
            for (int n = 0; n < NN; n++) {
                if (n >= N) break;
                q8x_t xv;
                gq_q6_K::xload(xv, xq + n * K, xd + n * (K / QL_QK_K), xs + n * (K / 8), ch * 64 + u);
QL_UNROLL
                for (int q = 0; q < R; q++) acc[q][n] += gq_q6_K::dot(x[q], xv, nullptr);
            }
        }
        __syncwarp();  // (the chunk read by every lane before the next is staged over it)
    }
QL_UNROLL
    for (int q = 0; q < R; q++)
QL_UNROLL
        for (int n = 0; n < NN; n++) {
            if (n >= N) break;
            float sum = acc[q][n];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
            if (lane == 0) red[warp][q * NN + n] = sum;
        }
    __syncthreads();
    const int q = (int)threadIdx.x / NN, n = (int)threadIdx.x % NN;
    if (q < R && n < N && r0 + q < M) {
        float sum = 0.0f;
        for (int i = 0; i < nw; i++) sum += red[i][q * NN + n];
        C[n * M + r0 + q] = Ci ? Ci[n * M + r0 + q] + sum : sum;
    }
    if (tl.kind == 1)  // (a norm only: never grouped)
        gv_tail_run(1, tl.cnt, tl.a, nullptr, tl.w, tl.eps, tl.out, tl.qb, tl.q, tl.sd, tl.ss, M, N, 0, gridDim.x);
}

// a decode product's addend (ql_mul_mat_acc's c: the residual stream, f32 [M, N] dense, maybe
// the result's own storage), or NULL
static const float *cu_gemv_addend(const ql_tensor *node) { return node->src[2] ? (const float *)node->src[2]->data : nullptr; }

// the codes of mm's b (blocks of qb), now at byte `at` of the workspace, for the next product of that b
static void cu_q8_made(cu_ctx &c, const ql_tensor *mm, int qb, size_t at) {
    const ql_tensor *b = mm->src[1];
    const int64_t key[4] = {b->ne[0], b->ne[1], (int64_t)b->nb[1], qb};  // (cu_op_gemv_q8's)
    c.q8_b = b->data;
    memcpy(c.q8_key, key, sizeof(key));
    c.q8_at = at;
}

// nodes[0..n): one product, or up to three of one b's codes (ql_cuda_gemv_group) by one launch.
// tails[0..nt): the nodes after them the launch makes as well: nodes[0]'s norm (ql_cuda_gemv_norm),
// SwiGLU of nodes[0]'s and nodes[1]'s results (ql_cuda_gemv_swiglu), or q's and k's rotations and the
// keys' and values' stores after q, k and v (ql_cuda_gemv_rope); mm: NULL, or the product after a
// norm or SwiGLU whose codes it writes (ql_cuda_q8_made_by(tail, mm)) - the caller then records
// them (cu_q8_made at ql_cuda_q8_codes_at(mm) for SwiGLU, 0 for a norm)
static void cu_op_gemv_q8(cu_ctx &c, ql_tensor *const *nodes, int n, int qb, ql_tensor *const *tails = nullptr, int nt = 0,
                          const ql_tensor *mm = nullptr) {
    const ql_tensor *tail = nt ? tails[0] : nullptr;
    const ql_tensor *node = nodes[0], *a = node->src[0], *b = node->src[1];
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    size_t off[2];
    CU_ASSERT(ql_cuda_mm_q8_layout(N, K, qb, off) <= c.work_size && N <= QL_CUDA_GEMV_MAX_N && n >= 1 && n <= QL_CUDA_GEMV_GROUP);
    for (int m = 1; m < n; m++) CU_ASSERT(ql_cuda_gemv_group(nodes[0], nodes[m]));
    // the codes of this b made by an earlier node (q, k and v of one input; gate and up; a norm or
    // SwiGLU before) are still there (cu_q8_after), at c.q8_at: not made again
    const int64_t key[4] = {K, N, (int64_t)b->nb[1], qb};
    if (c.q8_b != b->data || memcmp(c.q8_key, key, sizeof(key)) != 0) {
        QL_LAUNCH(k_q8_act, dim3((unsigned)((K + 256 * Q8_ACT_WARPS - 1) / (256 * Q8_ACT_WARPS)), (unsigned)N), Q8_ACT_WARPS * 32, 0,
                  c.stream, (const char *)b->data, (int64_t)b->nb[1], K, qb, (int8_t *)c.work, (float *)(c.work + off[0]),
                  (int *)(c.work + off[1]));
        CU_LAUNCHED(c);
        cu_q8_made(c, node, qb, 0);
    }
    CU_ASSERT(c.q8_at + ql_cuda_mm_q8_layout(N, K, qb, nullptr) <= c.work_size);
    const int8_t *xq = (const int8_t *)(c.work + c.q8_at);
    const float *xd = (const float *)(c.work + c.q8_at + off[0]);
    const int *xs = (const int *)(c.work + c.q8_at + off[1]);
    gv_tail tl{};
    if (tail && tail->op == QL_OP_ROPE) {  // q's rotation, then k's, k's store, v's: as far as they joined
        const ql_tensor *const grp[QL_CUDA_LAUNCH_MAX] = {nodes[0], nodes[1], nodes[2], tails[0], nt > 1 ? tails[1] : nullptr,
                                                          nt > 2 ? tails[2] : nullptr};
        CU_ASSERT(n == 3 && nt <= 4 && c.q8_cnt);
        for (int m = 0; m < nt; m++) CU_ASSERT(ql_cuda_gemv_rope(grp, 3 + m, tails[m]));
        tl.kind = 3;
        tl.cnt = c.q8_cnt;
        tl.rq = (float *)tails[0]->data;
        tl.rk = nt > 1 ? (float *)tails[1]->data : nullptr;
        tl.D = tail->src[0]->ne[0], tl.H = tail->src[0]->ne[1];
        tl.pos = (const int32_t *)tail->src[1]->data;
        tl.ff = tail->src[2] ? (const float *)tail->src[2]->data : nullptr;
        memcpy(&tl.base, &tail->op_params[2], sizeof(float));  // (rope's base: cu_param's slot 2)
        tl.mode = tail->op_params[1];
        if (nt > 2) {
            tl.kc = cu_of(tails[2]);
            tl.cf16 = tails[2]->type == QL_TYPE_F16;
            tl.at = (const int32_t *)tails[2]->src[2]->data;
        }
        if (nt > 3) tl.vc = cu_of(tails[3]), tl.DV = tails[3]->src[1]->ne[0];
    } else if (tail) {
        CU_ASSERT(nt == 1);
        tl.kind = tail->op == QL_OP_RMS_NORM ? 1 : 2;
        CU_ASSERT(tl.kind == 1 ? n == 1 && ql_cuda_gemv_norm(node, tail) : n == 2 && ql_cuda_gemv_swiglu(nodes[0], nodes[1], tail));
        CU_ASSERT(c.q8_cnt && (tl.kind == 1 || c.q8_at == 0));  // (SwiGLU's codes go past the group's: ql_cuda_q8_codes_at)
        tl.cnt = c.q8_cnt;
        tl.a = (const float *)(tl.kind == 1 ? node->data : tail->src[0]->data);
        tl.b = tl.kind == 1 ? nullptr : (const float *)tail->src[1]->data;
        tl.w = tl.kind == 1 && tail->src[1] ? (const float *)tail->src[1]->data : nullptr;
        if (tl.kind == 1) memcpy(&tl.eps, &tail->op_params[0], sizeof(float));  // (the norm's eps: cu_param's slot 0)
        tl.out = (float *)tail->data;
        if (mm) {
            tl.qb = ql_cuda_q8_made_by(tail, mm);
            const size_t at = tl.kind == 1 ? 0 : ql_cuda_q8_codes_at(mm);
            size_t o2[2];
            CU_ASSERT(tl.qb && at + ql_cuda_mm_q8_layout(mm->src[1]->ne[1], mm->src[1]->ne[0], tl.qb, o2) <= c.work_size);
            tl.q = (int8_t *)(c.work + at), tl.sd = (float *)(c.work + at + o2[0]), tl.ss = (int *)(c.work + at + o2[1]);
        }
    }
    const int rows = N == 1 ? g_gemv_rows : 1;
    // Q6_K in rows of whole chunks, 16-byte aligned: staged through shared memory (k_gemv_q8_q6s; alone)
    if (ql_cuda_gemv_q6s(a)) {
        CU_ASSERT(n == 1);
        typedef void (*fs)(const char *, int64_t, int64_t, int64_t, const int8_t *, const float *, const int *, int, float *, const float *,
                           gv_tail);
        const fs k6 = N > 1 ? k_gemv_q8_q6s<1, QL_CUDA_GEMV_MAX_N> : rows == 4 ? k_gemv_q8_q6s<4, 1> : rows == 2 ? k_gemv_q8_q6s<2, 1>
                                                                                                      : k_gemv_q8_q6s<1, 1>;
        const unsigned nw = (unsigned)std::min<int64_t>(GV_WARPS, K / 2048);
        QL_LAUNCH(k6, (unsigned)((M + rows - 1) / rows), 32 * nw, nw * (N > 1 ? 1 : rows) * Q6S_CHUNK, c.stream,
                  (const char *)a->data, (int64_t)a->nb[1], K, M, xq, xd, xs, (int)N, (float *)node->data, cu_gemv_addend(node), tl);
        CU_LAUNCHED(c);
        return;
    }
    typedef void (*fn)(gv_seg, gv_seg, gv_seg, int64_t, int64_t, int, int64_t, const int8_t *, const float *, const int *, int, gv_tail);
    fn k_gemv_q8_of = nullptr;  // (named so: the shim counts launches by this name)
    auto pick = [&](auto *tag) {
        typedef std::remove_pointer_t<decltype(tag)> T;
        k_gemv_q8_of = N > 1 ? k_gemv_q8<T, 1, QL_CUDA_GEMV_MAX_N> : rows == 4 ? k_gemv_q8<T, 4, 1> : rows == 2 ? k_gemv_q8<T, 2, 1>
                                                                                                  : k_gemv_q8<T, 1, 1>;
    };
    switch (a->type) {
    case QL_TYPE_Q4_0: pick((gq_q4_0 *)nullptr); break;
    case QL_TYPE_Q8_0: pick((gq_q8_0 *)nullptr); break;
    case QL_TYPE_Q4_K: pick((gq_q4_K *)nullptr); break;
    case QL_TYPE_Q5_K: pick((gq_q5_K *)nullptr); break;
    case QL_TYPE_IQ4_NL: pick((gq_iq4_nl *)nullptr); break;
    case QL_TYPE_Q4_1: pick((gq_q01<false, true> *)nullptr); break;
    case QL_TYPE_Q5_0: pick((gq_q01<true, false> *)nullptr); break;
    case QL_TYPE_Q5_1: pick((gq_q01<true, true> *)nullptr); break;
    case QL_TYPE_IQ4_XS: pick((gq_iq4_xs *)nullptr); break;
    case QL_TYPE_Q6_K: pick((gq_q6_K *)nullptr); break;
    default: CU_ASSERT(a->type == QL_TYPE_NF4 || a->type == QL_TYPE_NF4_NODQ); pick((gq_nf4 *)nullptr); break;
    }
    gv_seg sg[QL_CUDA_GEMV_GROUP] = {};
    int64_t first[QL_CUDA_GEMV_GROUP + 1] = {0};  // each product's first block; the grid's size last
    for (int m = 0; m < QL_CUDA_GEMV_GROUP; m++) {
        if (m < n) {
            const ql_tensor *wm = nodes[m]->src[0];
            const ql_type_traits *at = ql_type_traits_get(wm->type);
            sg[m] = gv_seg{(const char *)wm->data, (int64_t)wm->nb[1],
                           at->aux_bytes ? (const char *)wm->data + ql_aux_offset(ql_nbytes(wm)) : nullptr, wm->ne[1],
                           (float *)nodes[m]->data, cu_gemv_addend(nodes[m])};
        }
        first[m + 1] = first[m] + (m < n ? (sg[m].M + rows - 1) / rows : 0);
    }
    QL_LAUNCH(k_gemv_q8_of, (unsigned)first[QL_CUDA_GEMV_GROUP], cu_gemv_unit_threads(K, 32, 1), 0, c.stream, sg[0], sg[1], sg[2], first[1],
              first[2], (int)a->type, K, xq, xd, xs, (int)N, tl);
    CU_LAUNCHED(c);
}

// After each node of a run: the workspace's codes are forgotten once a node wrote over their b
// (its memory reused, a product in place of it) or used the workspace for anything else.
// (ql_graph_census counts the launches by the same rule)
static int cu_cc(const cu_ctx &c);  // section 8
static void cu_q8_after(cu_ctx &c, const ql_tensor *node) {
    if (!c.q8_b) return;
    const uintptr_t b0 = (uintptr_t)c.q8_b, b1 = b0 + (uintptr_t)(c.q8_key[2] * (c.q8_key[1] - 1) + c.q8_key[0] * 4);
    const uintptr_t n0 = (uintptr_t)node->data, n1 = n0 + ql_nbytes(node);
    const bool over = n0 < b1 && b0 < n1;
    if (over || (!ql_cuda_mm_q8(node) && ql_cuda_work_size(node, cu_cc(c)) > 0)) c.q8_b = nullptr;
}

static void cu_op_gemv(cu_ctx &c, ql_tensor *node) {
    if (const int qb = ql_cuda_mm_q8(node))
        if (ql_cuda_q8_aligned(node)) return cu_op_gemv_q8(c, &node, 1, qb);
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const ql_type_traits *at = ql_type_traits_get(a->type);
    const char *aux = at->aux_bytes ? (const char *)a->data + ql_aux_offset(ql_nbytes(a)) : nullptr;
    const int64_t M = a->ne[1];
    typedef void (*gemv_fn)(const char *, int64_t, int, const char *, int64_t, int64_t, const char *, int, int64_t, int, int, float *,
                            const float *);
    gemv_fn kern = cu_dequant8_fast(a->type) ? k_gemv<GV_UNROLL, false> : k_gemv<1, true>;  // (a name without commas, for the macros)
    unsigned threads = GV_WARPS * 32, rows = 1;  // the block's threads and rows
    const bool aligned = ((uintptr_t)a->data | (uintptr_t)a->nb[1]) % 16 == 0;  // the unit kernels' 16-byte loads
    // one token (decode): g_gemv_rows rows a block (4; 2 or 1 by QLORA_CUDA_GEMV_ROWS, to measure);
    // more: one row a block, up to 8 columns
    const bool one = b->ne[1] == 1;
    auto unit = [&](auto *tag) {
        typedef std::remove_pointer_t<decltype(tag)> T;
        rows = one ? g_gemv_rows : 1;
        kern = rows == 4 ? k_gemv_unit<T, 4, 1> : rows == 2 ? k_gemv_unit<T, 2, 1> : one ? k_gemv_unit<T, 1, 1> : k_gemv_unit<T, 1, QL_CUDA_GEMV_MAX_N>;
        threads = cu_gemv_unit_threads(a->ne[0], T::E, T::U);
    };
    if (aligned && (a->type == QL_TYPE_NF4 || a->type == QL_TYPE_NF4_NODQ) && a->ne[0] % QL_NF4_BLOCK == 0)
        unit((gv_nf4 *)nullptr);
    else if (aligned && a->type == QL_TYPE_Q4_K)
        unit((gv_q4_K *)nullptr);
    else if (a->type == QL_TYPE_Q6_K)
        unit((gv_q6_K *)nullptr);
    QL_LAUNCH(kern, (unsigned)((M + rows - 1) / rows), threads, 0, c.stream, (const char *)a->data, (int64_t)a->nb[1],
              (int)a->type, aux, a->ne[0], M, (const char *)b->data, (int)b->type, (int64_t)b->nb[1], (int)b->ne[1], (int)b->type,
              (float *)node->data, cu_gemv_addend(node));
    CU_LAUNCHED(c);
}

// ---- the dequantised tiles' pipeline: with more than one tile, tile t + 1 is dequantised on a
// side stream into the other of two buffers while the GEMMs of tile t run on the compute
// stream. Forked from the compute stream and joined back to it by events (capturable in a CUDA
// graph; no host synchronisation). The events' order is also kept on the host (cu_mm_order):
// a fill or a GEMM queued without the wait that orders it is an error - the shim runs every
// kernel at its launch, so only this bookkeeping shows a missing wait there ----

// The compute stream's wait for the last tile's fill is the join: nothing is queued on the side
// stream after it.
enum { CU_MM_EV_FORK, CU_MM_EV_READY0, CU_MM_EV_READY1, CU_MM_EV_FREE0, CU_MM_EV_FREE1, CU_MM_EV_COUNT };
struct cu_mm_side {  // per backend (cuda_backend::mm_side), made on the first multiply of more than one tile
    cudaStream_t stream = nullptr;
    cudaEvent_t ev[CU_MM_EV_COUNT] = {};
};
static cu_mm_side &cu_mm_side_of(cu_ctx &c);  // section 8: the backend's (storage only)
static void cu_mm_side_free(cu_mm_side &m) {
    if (m.stream) cudaStreamDestroy(m.stream);
    for (cudaEvent_t &e : m.ev)
        if (e) cudaEventDestroy(e);
    m = cu_mm_side();
}
static cu_mm_side *cu_mm_side_get(cu_ctx &c) {
    cu_mm_side &m = cu_mm_side_of(c);
    if (m.stream) return &m;
    bool ok = cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking) == cudaSuccess;
    for (cudaEvent_t &e : m.ev) ok = ok && cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
    if (!ok) {
        cu_mm_side_free(m);
        cu_fail(c, __FILE__, __LINE__, "cu_mm_side_get", "cannot make the multiply's side stream and its events");
        return nullptr;
    }
    return &m;
}

// what each stream has waited for of the other, positions counted in queued operations
// (stream 0: compute, 1: side); buffer i was filled at side position filled[i], last read by
// the GEMM at compute position read[i] (1: the work queued before this node)
struct cu_mm_order {
    int64_t pos[2] = {1, 0}, seen[2] = {0, 0};  // seen[x]: the other stream's position x waited for
    int64_t ev_pos[CU_MM_EV_COUNT] = {};
    int ev_stream[CU_MM_EV_COUNT] = {};
    int64_t filled[2] = {0, 0}, read[2] = {1, 1};
};

static void cu_mm_record(cu_ctx &c, cu_mm_side &m, cu_mm_order &o, int ev, int x) {
    CU_CHECK(c, cudaEventRecord(m.ev[ev], x ? m.stream : c.stream));
    o.ev_stream[ev] = x, o.ev_pos[ev] = o.pos[x];
}
static void cu_mm_wait(cu_ctx &c, cu_mm_side &m, cu_mm_order &o, int x, int ev) {
    CU_CHECK(c, cudaStreamWaitEvent(x ? m.stream : c.stream, m.ev[ev], 0));
    if (o.ev_stream[ev] != x) o.seen[x] = std::max(o.seen[x], o.ev_pos[ev]);
}

// ---- a product over a short K (ql_cuda_mm_thin: LoRA's rank side) ----
// C [M, N] = a b (+ c): a [K, M], b [K, N] (any strides), K <= QL_CUDA_THIN_K. A block makes a
// 128 x 32 tile of C: the K x 128 slice of a (rounded to the compute type, as a converted tile)
// and the K x 32 slice of b in shared memory; thread (x, y) makes rows m0 + x + 32 i (i < 4: a
// warp's loads and stores of c and C are 32 neighbouring elements) of columns n0 + 4 y .. + 3,
// summed over k in order in f32; then c added (read where it is: in place too) and the result
// rounded once to C's type - k_acc_round's value without the f32 product's round trip through
// the workspace. With seed (mul_mat_dropout's dx, C f32): each sum dropped out first - element
// (m, n) of the result's rows from row0 (qlora.h's hash), x / (1 - p) or 0 - then c added.
#define MT_M 128
#define MT_N 32
// C_F32: c is f32 whatever C's type (mul_mat_dropped's c under a 16-bit dO), else of C's type.
// (Two blocks an SM at least: with the bound on threads alone ptxas gave the C_F32 kernel an 8-byte
// stack frame on sm_90, at 40 registers)
template <bool C_F32>
__global__ void __launch_bounds__(256, 2) k_mm_thin(cu_t a, cu_t b, int ct, const char *c, char *C, int c_type, int64_t M, int64_t N,
                                                 int64_t K, const int32_t *seed, uint32_t stream, uint32_t threshold, float keep_scale,
                                                 int64_t row0) {
    QL_DYN_SMEM(float, sm);  // As [K][MT_M + 1], then Bs [K][MT_N + 1]: 41 KiB at K = 64
    float *As = sm, *Bs = sm + K * (MT_M + 1);
    const int64_t m0 = (int64_t)blockIdx.x * MT_M, n0 = (int64_t)blockIdx.y * MT_N;
    // k fastest: LoRA's factors have their K elements adjacent (a warp reads whole rows, not one
    // element of each); rows of MT_M + 1 and MT_N + 1 in shared memory, so those stores spread over banks
    for (int x = threadIdx.x; x < K * MT_M; x += blockDim.x) {
        const int k = x % K, j = x / K;
        float av = 0.0f;
        if (m0 + j < M) {
            av = cu_ld(a.data + k * a.nb[0] + (m0 + j) * a.nb[1], a.type);
            if (ct == QL_TYPE_BF16) av = __bfloat162float(__float2bfloat16_rn(av));
            else if (ct == QL_TYPE_F16) av = __half2float(__float2half_rn(av));
        }
        As[k * (MT_M + 1) + j] = av;
    }
    for (int x = threadIdx.x; x < K * MT_N; x += blockDim.x) {
        const int k = x % K, j = x / K;
        Bs[k * (MT_N + 1) + j] = n0 + j < N ? cu_ld(b.data + k * b.nb[0] + (n0 + j) * b.nb[1], b.type) : 0.0f;
    }
    __syncthreads();
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    float acc[4][4] = {};
    for (int k = 0; k < K; k++) {
        float av[4], bv[4];
QL_UNROLL
        for (int i = 0; i < 4; i++) av[i] = As[k * (MT_M + 1) + tx + 32 * i], bv[i] = Bs[k * (MT_N + 1) + ty * 4 + i];
QL_UNROLL
        for (int j = 0; j < 4; j++)
QL_UNROLL
            for (int i = 0; i < 4; i++) acc[j][i] = fmaf(av[i], bv[j], acc[j][i]);
    }
    if (seed) {
        const uint64_t key = ql_dropout_key(seed[0], stream);
QL_UNROLL
        for (int j = 0; j < 4; j++)
QL_UNROLL
            for (int i = 0; i < 4; i++) {
                const int64_t n = n0 + ty * 4 + j, m = m0 + tx + 32 * i;
                acc[j][i] = ql_dropout_hash(key, (uint64_t)((row0 + n) * M + m)) >= threshold ? acc[j][i] * keep_scale : 0.0f;
            }
    }
    // c's 16 elements read first, all at once, then the sums stored: C may be c itself (in place, of
    // C's type), and each thread reads only what it writes - so no read waits for the previous
    // element's store
    const size_t cs = c_type == QL_TYPE_F32 ? 4 : 2;
    if (c) {
QL_UNROLL
        for (int j = 0; j < 4; j++)
QL_UNROLL
            for (int i = 0; i < 4; i++) {
                const int64_t n = n0 + ty * 4 + j, m = m0 + tx + 32 * i;
                if (n < N && m < M) acc[j][i] += cu_ld(c + (n * M + m) * (C_F32 ? 4 : cs), C_F32 ? (int)QL_TYPE_F32 : c_type);
            }
    }
QL_UNROLL
    for (int j = 0; j < 4; j++)
QL_UNROLL
        for (int i = 0; i < 4; i++) {
            const int64_t n = n0 + ty * 4 + j, m = m0 + tx + 32 * i;
            if (n < N && m < M) cu_st(C + (n * M + m) * cs, c_type, acc[j][i]);
        }
}

static void cu_op_mm_thin(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0], *b = node->src[1], *acc = node->src[2];
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    CU_ASSERT(K <= QL_CUDA_THIN_K && ql_is_contiguous(node) && (!acc || (acc->type == node->type && ql_is_contiguous(acc))));
    const dim3 grid((unsigned)((M + MT_M - 1) / MT_M), (unsigned)((N + MT_N - 1) / MT_N));
    QL_LAUNCH(k_mm_thin<false>, grid, 256, (size_t)K * (MT_M + MT_N + 2) * sizeof(float), c.stream, cu_of(a), cu_of(b), (int)b->type,
              acc ? (const char *)acc->data : nullptr, (char *)node->data, (int)node->type, M, N, K, (const int32_t *)nullptr, 0u, 0u, 0.0f,
              (int64_t)0);
    CU_LAUNCHED(c);
}

// ---- a product with its b dropped out as it is read (QL_OP_MUL_MAT_DROPOUT: LoRA's A dropout(x)) ----
// C [M, N] f32 = a D, D = dropout(x) in the compute type ct: a [K, M] plain (M <= QL_CUDA_DROP_M,
// its columns dense), x [K, N] in rows (row n at n x_nb1). A block makes MD_N columns of C, all M
// rows: per step of MD_K, the MD_K x M slice of a (rounded to ct, as a converted tile) and the
// MD_K x MD_N slice of x - each thread 8 neighbouring k of one token (one 16-byte load for 16 bits,
// two for f32, where x's rows allow: vec), the mask's hash per element (qlora.h's: the CPU's mask),
// x / (1 - p) or 0 rounded to ct - in shared memory; thread (tn, tm) sums rows tm + 8 i of column
// tn over k in order in f32. x is read once; no copy of D is made. With few tokens, block (i, s)
// sums only k in [s kc, (s + 1) kc) into the workspace's split s (ql_cuda_mm_drop_splits), which
// k_mm_drop_sum adds in split order.
#define MD_N QL_CUDA_DROP_TOKENS  // columns (tokens) a block
#define MD_K QL_CUDA_DROP_KSTEP   // k a step
__device__ __forceinline__ float cu_round_to(float v, int ct) {
    if (ct == QL_TYPE_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    if (ct == QL_TYPE_F16) return __half2float(__float2half_rn(v));
    return v;
}
__global__ void __launch_bounds__(256) k_mm_drop(const char *a, int a_type, int64_t a_nb1, const char *x, int x_type, int64_t x_nb1,
                                                 int vec, const int32_t *seed, uint32_t stream, uint32_t threshold, float keep_scale,
                                                 int64_t row0, int ct, float *C, int M, int64_t N, int64_t K, int64_t kc) {
    __shared__ float As[MD_K][QL_CUDA_DROP_M + 1];  // [k][m]
    __shared__ float Xs[MD_K][MD_N + 1];            // [k][n]
    const uint64_t key = ql_dropout_key(seed[0], stream);
    const int64_t n0 = (int64_t)blockIdx.x * MD_N;
    const int tn = threadIdx.x % 32, tm = threadIdx.x / 32;
    const int as = a_type == QL_TYPE_F32 ? 4 : 2, xs = x_type == QL_TYPE_F32 ? 4 : 2;
    float acc[QL_CUDA_DROP_M / 8] = {};
    const int64_t kb = (int64_t)blockIdx.y * kc, ke = kb + kc < K ? kb + kc : K;
    C += (int64_t)blockIdx.y * M * N;  // this split's sums
    for (int64_t k0 = kb; k0 < ke; k0 += MD_K) {
        for (int i = threadIdx.x; i < MD_K * M; i += blockDim.x) {  // k fastest: a's columns are dense
            const int k = i % MD_K, m = i / MD_K;
            As[k][m] = k0 + k < K ? cu_round_to(cu_ld(a + (k0 + k) * as + m * a_nb1, a_type), ct) : 0.0f;
        }
        {  // thread (n, g): k0 + 8 g .. + 7 of column n0 + n (MD_N x MD_K / 8 = 256 pieces)
            const int n = threadIdx.x / 8, g = threadIdx.x % 8;
            const int64_t k = k0 + 8 * g, row = n0 + n;
            float v[8];
            if (row < N && vec && k + 8 <= K) {
                const char *p = x + row * x_nb1 + k * xs;
                if (x_type == QL_TYPE_F32) {
                    const float4 lo = ((const float4 *)p)[0], hi = ((const float4 *)p)[1];
                    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
                } else {
                    const uint4 q = *(const uint4 *)p;
                    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
QL_UNROLL
                    for (int j = 0; j < 4; j++) {
                        const uint16_t l = (uint16_t)(w[j] & 0xffff), h = (uint16_t)(w[j] >> 16);
                        v[2 * j] = x_type == QL_TYPE_F16 ? cu_h2f(l) : __uint_as_float((uint32_t)l << 16);
                        v[2 * j + 1] = x_type == QL_TYPE_F16 ? cu_h2f(h) : __uint_as_float((uint32_t)h << 16);
                    }
                }
            } else {
QL_UNROLL
                for (int j = 0; j < 8; j++) v[j] = row < N && k + j < K ? cu_ld(x + row * x_nb1 + (k + j) * xs, x_type) : 0.0f;
            }
            const uint64_t e = (uint64_t)((row0 + row) * K + k);  // the mask's element: x's flat index in the whole
QL_UNROLL
            for (int j = 0; j < 8; j++)
                Xs[8 * g + j][n] = cu_round_to(ql_dropout_hash(key, e + j) >= threshold ? v[j] * keep_scale : 0.0f, ct);
        }
        __syncthreads();
        for (int k = 0; k < MD_K; k++) {
            const float xv = Xs[k][tn];
QL_UNROLL
            for (int i = 0; i < QL_CUDA_DROP_M / 8; i++) acc[i] = fmaf(As[k][tm + 8 * i], xv, acc[i]);
        }
        __syncthreads();
    }
    const int64_t n = n0 + tn;
QL_UNROLL
    for (int i = 0; i < QL_CUDA_DROP_M / 8; i++)
        if (n < N && tm + 8 * i < M) C[n * M + tm + 8 * i] = acc[i];
}
// C [n] = the splits' sums P [s, n] added in split order
__global__ void k_mm_drop_sum(const float *P, float *C, int splits, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = P[i];
        for (int s = 1; s < splits; s++) v += P[s * n + i];
        C[i] = v;
    }
}

static void cu_op_mul_mat(cu_ctx &c, ql_tensor *node);
static void cu_op_dropout(cu_ctx &c, ql_tensor *node);
template <typename T> static T cu_param(const ql_tensor *t, int slot);
// y = c + dropout(prod) over the product prod (mul_mat_dropout's dx, where k_mm_thin does not take it),
// y of type yt (16 bits: the f32 sum rounded once); an f32 y may be c
__global__ void k_drop_acc(char *y, int yt, const float *prod, const float *cin, const int32_t *seed, uint32_t stream, uint32_t threshold,
                           float keep_scale, int64_t first, int64_t n) {
    const uint64_t key = ql_dropout_key(seed[0], stream);
    const int ys = yt == QL_TYPE_F32 ? 4 : 2;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = ql_dropout_hash(key, (uint64_t)(first + i)) >= threshold ? prod[i] * keep_scale : 0.0f;
        cu_st(y + i * ys, yt, cin ? cin[i] + v : v);
    }
}

static void cu_op_mul_mat_dropout(cu_ctx &c, ql_tensor *node) {
    const int slot = cu_param<int32_t>(node, 4);
    if (slot == 2) {  // the result dropped, c (src[3]) added: k_mm_thin's epilogue, or the product then k_drop_acc
        const ql_tensor *a = node->src[0], *b = node->src[1], *acc = node->src[3];
        const int32_t *seed = (const int32_t *)node->src[2]->data;
        const float pr = cu_param<float>(node, 0);
        const uint32_t stream = cu_param<uint32_t>(node, 1), thr = ql_dropout_threshold(pr);
        const int64_t row0 = cu_param<int64_t>(node, 2);
        CU_ASSERT(ql_is_contiguous(node) && is_float_type_cu(node->type) && (!acc || (acc->type == QL_TYPE_F32 && ql_is_contiguous(acc))));
        if (ql_cuda_mm_drop_fused(node)) {
            const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
            const dim3 grid((unsigned)((M + MT_M - 1) / MT_M), (unsigned)((N + MT_N - 1) / MT_N));
            // (c f32: the gradient so far; the result f32, or 16 bits where attention reads it as dO)
            QL_LAUNCH(k_mm_thin<true>, grid, 256, (size_t)K * (MT_M + MT_N + 2) * sizeof(float), c.stream, cu_of(a), cu_of(b), (int)b->type,
                      acc ? (const char *)acc->data : nullptr, (char *)node->data, (int)node->type, M, N, K, seed, stream, thr,
                      1.0f / (1.0f - pr), row0);
            CU_LAUNCHED(c);
            return;
        }
        // the product at the workspace's start (the rest its own): the result may be c's storage
        // (in place, the plan's), which k_drop_acc reads element by element as it writes
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(node, &mm, &d, nullptr);
        const int64_t n = ql_nelements(node);
        const size_t np = ((size_t)n * sizeof(float) + QL_ALIGN - 1) / QL_ALIGN * QL_ALIGN;  // (qlora.cpp's rule)
        CU_ASSERT(ql_cuda_work_size(node, 0) <= c.work_size);
        float *prod = (float *)c.work;
        mm.data = prod;
        c.work += np, c.work_size -= np;
        cu_op_mul_mat(c, &mm);
        c.work -= np, c.work_size += np;
        if (c.failed) return;
        QL_LAUNCH(k_drop_acc, cu_grid(n), CU_BLOCK, 0, c.stream, (char *)node->data, (int)node->type, (const float *)prod,
                  acc ? (const float *)acc->data : nullptr, seed, stream, thr, 1.0f / (1.0f - pr), row0 * node->ne[0], n);
        CU_LAUNCHED(c);
        return;
    }
    const ql_tensor *x = node->src[slot], *seed = node->src[2];
    if (ql_cuda_mm_drop_fused(node)) {
        const ql_tensor *a = node->src[0];
        const int64_t K = x->ne[0], N = ql_nrows(x);
        const float pr = cu_param<float>(node, 0);
        const int vec = (uintptr_t)x->data % 16 == 0 && x->nb[1] % 16 == 0 && x->nb[0] == ql_plain_size(x->type);
        int64_t kc = K;
        const int64_t splits = ql_cuda_mm_drop_splits(node, &kc);
        CU_ASSERT(ql_is_contiguous(node) && a->ne[0] == K && a->ne[1] <= QL_CUDA_DROP_M && ql_cuda_work_size(node, 0) <= c.work_size);
        float *P = splits > 1 ? (float *)c.work : (float *)node->data;
        const dim3 grid((unsigned)((N + MD_N - 1) / MD_N), (unsigned)splits);
        QL_LAUNCH(k_mm_drop, grid, 256, 0, c.stream, (const char *)a->data, (int)a->type, (int64_t)a->nb[1], (const char *)x->data,
                  (int)x->type, (int64_t)x->nb[1], vec, (const int32_t *)seed->data, cu_param<uint32_t>(node, 1),
                  ql_dropout_threshold(pr), 1.0f / (1.0f - pr), cu_param<int64_t>(node, 2), cu_param<int32_t>(node, 5), P,
                  (int)a->ne[1], N, K, kc);
        CU_LAUNCHED(c);
        if (splits > 1) {
            const int64_t n = ql_nelements(node);
            QL_LAUNCH(k_mm_drop_sum, cu_grid(n), CU_BLOCK, 0, c.stream, (const float *)P, (float *)node->data, (int)splits, n);
            CU_LAUNCHED(c);
        }
        return;
    }
    // D in the workspace by the dropout kernel (a QL_OP_DROPOUT node's params are this node's
    // first three: p, stream, first row), then the product over it with the rest of the workspace
    ql_tensor mm, d;
    ql_mul_mat_dropout_product(node, &mm, &d, c.work);
    const size_t nd = ((size_t)ql_nelements(x) * ql_plain_size(d.type) + QL_ALIGN - 1) / QL_ALIGN * QL_ALIGN;  // (qlora.cpp's rule)
    CU_ASSERT(ql_cuda_work_size(node, 0) <= c.work_size && nd <= c.work_size);
    ql_tensor dn = *node;
    dn.op = QL_OP_DROPOUT;
    dn.type = d.type;
    for (int i = 0; i < 4; i++) dn.ne[i] = x->ne[i];
    dn.nb[0] = ql_plain_size(d.type);
    for (int i = 1; i < 4; i++) dn.nb[i] = dn.nb[i - 1] * (size_t)dn.ne[i - 1];
    dn.data = c.work;
    for (ql_tensor *&s : dn.src) s = nullptr;
    dn.src[0] = (ql_tensor *)x;
    dn.src[1] = (ql_tensor *)seed;
    cu_op_dropout(c, &dn);
    if (c.failed) return;
    c.work += nd, c.work_size -= nd;
    cu_op_mul_mat(c, &mm);
    c.work -= nd, c.work_size += nd;
}

static void cu_op_mul_mat(cu_ctx &c, ql_tensor *node) {
    if (ql_cuda_mm_gemv(node)) return cu_op_gemv(c, node);
    if (ql_cuda_mm_thin(node)) return cu_op_mm_thin(c, node);
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const ql_type ct = b->type;
    const size_t es = ql_plain_size(ct);
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t A2 = a->ne[2], A3 = a->ne[3], B2 = b->ne[2], B3 = b->ne[3], r2 = B2 / A2, r3 = B3 / A3;
    // the result f32, or of b's 16-bit type (ql_mul_mat_to): one GEMM over all of K per element
    CU_ASSERT(b->ne[0] == K && (node->type == QL_TYPE_F32 || node->type == ct) && ql_is_contiguous(node) && is_float_type_cu(ct));
    const ql_tensor *acc = node->src[2];
    // ql_mul_mat_acc onto a 16-bit c: cuBLAS' epilogue rounds the product to C's type before it
    // adds beta C (an H200 put 28% of the elements an ulp off round(c + a b)), so the product is
    // made in f32 at the end of the workspace and k_acc_round adds c and rounds once
    const bool acc16 = acc && node->type != QL_TYPE_F32;
    const size_t stage = acc16 ? (size_t)ql_nelements(node) * sizeof(float) : 0;
    CU_ASSERT(ql_cuda_work_size(node, 0) <= c.work_size);
    const ql_type rt = acc16 ? QL_TYPE_F32 : node->type;  // what the GEMMs write
    char *C = acc16 ? (char *)c.work + ql_cuda_work_size(node, 0) - stage : (char *)node->data;
    const int64_t cs = (int64_t)ql_plain_size(rt);
    const int64_t sC = M * N;  // per batch of the result, in elements
    uint8_t *ws = c.work;
    // ql_mul_mat_acc (c of the GEMMs' type): every GEMM adds c's part - in place over c, or read from
    // c where c lives on (cuBLASLt's C != D: no copy of c first). Where cuBLASLt refuses that, c is
    // copied into C and the GEMMs add to it (said once: the census counts no copy)
    const char *cin = acc && !acc16 && acc->data != node->data ? (const char *)acc->data : nullptr;
    if (cin && !cu_lt_ok(c)) {
        CU_CHECK(c, cudaMemcpyAsync(C, cin, ql_nbytes(node), cudaMemcpyDeviceToDevice, c.stream));
        cin = nullptr;
    }
    const char *cin_parts = nullptr;  // c, copied a GEMM's part at a time (cuBLASLt refused one of this node's GEMMs)
    const float beta0 = acc && !acc16 ? 1.0f : 0.0f;  // the GEMMs' beta over C
    const float alpha = ql_mul_mat_alpha(node);      // ql_mul_mat_scaled_to: the epilogue's (f32, before rounding)

    // B: in place, or copied contiguous (K x N per batch) into the workspace
    const char *bp = (const char *)b->data;
    int64_t bnb0 = (int64_t)b->nb[0], bnb1 = (int64_t)b->nb[1], bnb2 = (int64_t)b->nb[2], bnb3 = (int64_t)b->nb[3];
    if (!ql_cuda_mm_b_direct(b)) {
        for (int64_t i3 = 0; i3 < B3; i3++)
            for (int64_t i2 = 0; i2 < B2; i2++) {
                char *dst = (char *)ws + ((i3 * B2 + i2) * K * N) * (int64_t)es;
                QL_LAUNCH(k_convert_2d, cu_grid_rows(K, N), CU_BLOCK, 0, c.stream, bp + i2 * bnb2 + i3 * bnb3, (int)b->type,
                          bnb0, bnb1, K, N, dst, (int)ct);
                CU_LAUNCHED(c);
            }
        bp = (const char *)ws;
        bnb0 = (int64_t)es, bnb1 = K * (int64_t)es, bnb2 = K * N * (int64_t)es, bnb3 = K * N * B2 * (int64_t)es;
        ws += ql_cuda_mm_b_bytes(b);
    }

    // a: read in place, or made in tiles of tm of its M rows (all of K each: no f32 sums over K
    // tiles) - a block-quantized W dequantised by rows (W x), a transposed one by bands of tm
    // columns of every row (Wᵀ dy), a plain type converted. Tile j of a's batch (ia2, ia3)
    // covers m in [m0, m0 + mt); the planner's rules give the tile and the buffers
    // (a cached weight W, or Wᵀ: read in place from its copy in the compute type, ql_backend_cache_weights)
    const ql_tensor *cw = ql_cuda_mm_cached(a, ct);
    const ql_weight_copy *copy = cw ? (const ql_weight_copy *)cw->extra : nullptr;
    if (cw && (!copy || copy->type != ct)) {
        char why[160];
        snprintf(why, sizeof(why), "weight '%s' is flagged cached but has no copy in %s (ql_backend_cache_weights)", cw->name,
                 ql_type_name(ct));
        cu_fail(c, __FILE__, __LINE__, "cu_op_mul_mat", why);
        return;
    }
    const bool trows = !cw && ql_cuda_mm_trows(a), direct = cw || (!trows && ql_cuda_mm_a_direct(a, ct));
    const int64_t tm = direct ? M : ql_cuda_mm_tile_rows(K, M), per_batch = (M + tm - 1) / tm, n_tiles = A2 * A3 * per_batch;
    const int n_bufs = direct ? 1 : ql_cuda_mm_tile_bufs(K, M, A2 * A3);
    const size_t buf_bytes = direct ? 0 : ql_cuda_mm_tile_bytes(K, M, ct);
    const ql_tensor *w = trows ? a->view_src : a;
    const ql_type_traits *wt = ql_type_traits_get(w->type);
    const bool quant = wt->blck_size > 1 || wt->aux_bytes;
    const char *aux = quant && wt->aux_bytes ? (const char *)w->data + ql_aux_offset(ql_nbytes(w)) : nullptr;
    cu_mm_side *side = n_bufs > 1 ? cu_mm_side_get(c) : nullptr;
    if (c.failed) return;
    cu_mm_order o;
    if (side) {
        cu_mm_record(c, *side, o, CU_MM_EV_FORK, 0);
        cu_mm_wait(c, *side, o, 1, CU_MM_EV_FORK);
    }
    for (int64_t t = 0; t < n_tiles && !c.failed; t++) {
        const int64_t ib = t / per_batch, ia2 = ib % A2, ia3 = ib / A2, m0 = (t % per_batch) * tm, mt = std::min(tm, M - m0);
        const int buf = (int)(t % n_bufs);
        cu_operand A;
        if (copy) {  // W [K, M] contiguous (a = W), or Wᵀ over it: element (k, m) at m * K_w + k of W's [K_w = M, K]
            const bool tr = cw != a;
            A = cu_as_operand((const char *)copy->data, es, tr ? M * (int64_t)es : (int64_t)es, tr ? (int64_t)es : K * (int64_t)es, K, M,
                              true);
        } else if (direct) {
            A = cu_as_operand((const char *)a->data + ia2 * a->nb[2] + ia3 * a->nb[3], es, (int64_t)a->nb[0], (int64_t)a->nb[1], K,
                              M, true);
        } else {
            char *dst = (char *)ws + (size_t)buf * buf_bytes;
            const int x = side ? 1 : 0;  // the stream that fills it
            cudaStream_t fs = side ? side->stream : c.stream;
            if (side) {
                if (t >= 2) cu_mm_wait(c, *side, o, 1, CU_MM_EV_FREE0 + buf);  // tile t - 2's GEMMs are done with it
                if (o.seen[1] < o.read[buf]) {
                    cu_fail(c, __FILE__, __LINE__, "cu_op_mul_mat", "a tile is filled before the GEMMs reading its buffer are done");
                    return;
                }
            }
            if (trows) {  // a = Wᵀ: rows k of W, columns [m0, m0 + mt) -> dst [mt, K] (column-major mt x K)
                CU_ASSERT(A2 == 1 && A3 == 1);
                cu_dequant_tile(c, fs, (const char *)w->data, (int64_t)w->nb[1], w->type, aux, M, 0, K, m0, mt, dst, ct);
                A = cu_operand{dst, CUBLAS_OP_N, mt, true};
            } else {  // rows [m0, m0 + mt) of a -> dst [K, mt]
                const char *ap = (const char *)a->data + ia2 * a->nb[2] + ia3 * a->nb[3];
                if (quant) {
                    CU_ASSERT(ql_rows_contiguous(a));
                    cu_dequant_tile(c, fs, ap, (int64_t)a->nb[1], a->type, aux, K, m0, mt, 0, K, dst, ct);
                } else {
                    QL_LAUNCH(k_convert_2d, cu_grid_rows(K, mt), CU_BLOCK, 0, fs, ap + m0 * (int64_t)a->nb[1], (int)a->type,
                              (int64_t)a->nb[0], (int64_t)a->nb[1], K, mt, dst, (int)ct);
                    CU_LAUNCHED(c);
                }
                A = cu_operand{dst, CUBLAS_OP_T, K, true};
            }
            o.filled[buf] = ++o.pos[x];
            if (side) {
                cu_mm_record(c, *side, o, CU_MM_EV_READY0 + buf, 1);
                cu_mm_wait(c, *side, o, 0, CU_MM_EV_READY0 + buf);
                if (o.seen[0] < o.filled[buf]) {
                    cu_fail(c, __FILE__, __LINE__, "cu_op_mul_mat", "a tile's GEMMs are queued before its fill is done");
                    return;
                }
            }
        }
        for (int64_t j3 = 0; j3 < r3; j3++) {
            const int64_t i3 = ia3 * r3 + j3;
            const cu_operand B = cu_as_operand(bp + ia2 * r2 * bnb2 + i3 * bnb3, es, bnb0, bnb1, K, N, false);
            const int64_t off = ((i3 * B2 + ia2 * r2) * sC + m0) * cs;
            // a refusal (at any GEMM: cuBLASLt's heuristics may take one tile's shape and not the next):
            // the earlier GEMMs' parts of C are made, so from there on each GEMM copies its own part of
            // c (mt of M rows, N columns, r2 batches) and adds to it by cuBLAS
            if (cin_parts) cu_copy_part(c, C + off, cin_parts + off, mt * cs, M * cs, N, (int)r2, sC * cs);
            if (!cu_gemm_to(c, ct, A, 0, B, bnb2 / (int64_t)es, C + off, rt, M, sC, mt, N, K, (int)r2, beta0, alpha, cin ? cin + off : nullptr) &&
                !c.failed) {
                fprintf(stderr, "qlora: cuda: cuBLASLt refused a product with C != D: each such product copies its addend first\n");
                cu_lt_ok(c) = false;
                cin_parts = cin;
                cu_copy_part(c, C + off, cin_parts + off, mt * cs, M * cs, N, (int)r2, sC * cs);
                cin = nullptr;
                if (!cu_gemm_to(c, ct, A, 0, B, bnb2 / (int64_t)es, C + off, rt, M, sC, mt, N, K, (int)r2, beta0, alpha)) return;
            }
            if (c.failed) return;
        }
        if (!direct) o.read[buf] = ++o.pos[0];
        if (side) cu_mm_record(c, *side, o, CU_MM_EV_FREE0 + buf, 0);
    }
    if (c.failed) return;
    if (side && o.seen[0] < o.pos[1]) {  // the join
        cu_fail(c, __FILE__, __LINE__, "cu_op_mul_mat", "the side stream is not joined back to the compute stream");
        return;
    }
    if (acc16) {
        const int64_t n = ql_nelements(node);
        QL_LAUNCH(k_acc_round, cu_grid(n), CU_BLOCK, 0, c.stream, (const char *)acc->data, (const float *)C, (char *)node->data,
                  (int)node->type, n);
        CU_LAUNCHED(c);
    }
}

// --cache-weights: W [K, M] whole in the multiply's type ct into dst, made by the tiles' own kernels
// (cu_dequant_tile, k_convert_2d) over the tiles' rows, so that the copy holds the tiles' values
static void cu_weight_copy(cu_ctx &c, const ql_tensor *w, char *dst, ql_type ct) {
    const ql_type_traits *wt = ql_type_traits_get(w->type);
    CU_ASSERT(wt && w->ne[2] == 1 && w->ne[3] == 1 && ql_rows_contiguous(w) && is_float_type_cu(ct));
    const bool quant = wt->blck_size > 1 || wt->aux_bytes;
    const char *aux = quant && wt->aux_bytes ? (const char *)w->data + ql_aux_offset(ql_nbytes(w)) : nullptr;
    const int64_t K = w->ne[0], M = w->ne[1], tm = ql_cuda_mm_tile_rows(K, M);
    const size_t es = ql_plain_size(ct);
    for (int64_t m0 = 0; m0 < M && !c.failed; m0 += tm) {  // rows [m0, m0 + mt) of W -> dst's [K, mt] at row m0
        const int64_t mt = std::min(tm, M - m0);
        char *d = dst + (size_t)(m0 * K) * es;
        if (quant) {
            cu_dequant_tile(c, c.stream, (const char *)w->data, (int64_t)w->nb[1], w->type, aux, K, m0, mt, 0, K, d, ct);
        } else {
            QL_LAUNCH(k_convert_2d, cu_grid_rows(K, mt), CU_BLOCK, 0, c.stream, (const char *)w->data + m0 * (int64_t)w->nb[1],
                      (int)w->type, (int64_t)w->nb[0], (int64_t)w->nb[1], K, mt, d, (int)ct);
            CU_LAUNCHED(c);
        }
    }
}

static bool cu_mm_supported(const ql_tensor *node, int cc) {
    const ql_tensor *a = node->src[0], *b = node->src[1];
    // the result f32, or of b's 16-bit type; ql_mul_mat_acc's c of the result's type
    if (!is_float_type_cu(b->type) || (node->type != QL_TYPE_F32 && node->type != b->type)) return false;
    if (node->src[2] && (node->src[2]->type != node->type || !ql_is_contiguous(node->src[2]))) return false;
    if (b->type == QL_TYPE_BF16 && !ql_cuda_bf16_gemm(cc)) return false;  // cuBLAS has no bf16 GEMM before Ampere
    if (ql_cuda_mm_b_direct(b) && (b->nb[2] % ql_plain_size(b->type) || b->nb[3] % ql_plain_size(b->type))) return false;
    const ql_type_traits *t = ql_type_traits_get(a->type);
    if (!t || !(t->to_float || t->to_float_aux)) return false;
    switch (a->type) {
    case QL_TYPE_F32: case QL_TYPE_F16: case QL_TYPE_BF16:
        return true;
    case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: case QL_TYPE_Q4_0: case QL_TYPE_Q8_0: case QL_TYPE_Q4_K: case QL_TYPE_Q5_K:
    case QL_TYPE_Q6_K: case QL_TYPE_Q4_1: case QL_TYPE_Q5_0: case QL_TYPE_Q5_1: case QL_TYPE_Q2_K: case QL_TYPE_Q3_K:
    case QL_TYPE_IQ4_NL: case QL_TYPE_IQ4_XS: {
        const ql_tensor *w = ql_cuda_mm_trows(a) ? a->view_src : a;
        // weights are 2-D and whole (side data is found after the rows)
        return w->ne[2] == 1 && w->ne[3] == 1 && ql_is_contiguous(w) && (ql_cuda_mm_trows(a) || ql_rows_contiguous(a)) &&
               !w->view_src;
    }
    default:
        return false;
    }
}

// ============================================================================================
// 6. elementwise, rows, rope, loss, dropout, optimizer
// ============================================================================================

// Rows: the r-th row (ne0 elements) of a tensor of up to 4 dimensions, by its byte strides.
__device__ __forceinline__ char *cu_row(const cu_t &t, int64_t r) {
    const int64_t i1 = r % t.ne[1], i2 = (r / t.ne[1]) % t.ne[2], i3 = r / (t.ne[1] * t.ne[2]);
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}
static int64_t cu_nrows(const ql_tensor *t) { return t->ne[1] * t->ne[2] * t->ne[3]; }
template <typename T> static T cu_param(const ql_tensor *t, int slot) {
    T v;
    memcpy(&v, &t->op_params[slot], sizeof(T));
    return v;
}

// A reduction over the whole block (every thread gets the result): within each warp by
// shuffles, then the warps' results through `sh` (32 slots). Every thread must call it.
struct cu_add {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct cu_max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
template <typename T, typename Op> __device__ __forceinline__ T cu_block_reduce(T v, T *sh, T identity, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();  // sh may still be read from a previous call
    if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
    __syncthreads();
    T t = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : identity;
    if (threadIdx.x < 32)
        for (int o = 16; o > 0; o >>= 1) t = op(t, __shfl_xor_sync(0xffffffff, t, o));
    if (threadIdx.x == 0) sh[0] = t;
    __syncthreads();
    return sh[0];
}
__device__ __forceinline__ float cu_block_sum(float v, float *sh) { return cu_block_reduce(v, sh, 0.0f, cu_add()); }
__device__ __forceinline__ double cu_block_sum_d(double v, double *sh) { return cu_block_reduce(v, sh, 0.0, cu_add()); }
__device__ __forceinline__ float cu_block_max(float v, float *sh) { return cu_block_reduce(v, sh, -INFINITY, cu_max()); }

#define CU_GRID_LOOP(i, n) for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

// ---- typed contiguous fast paths: CU_EW_VEC elements a step, read and written as 16-byte
// vectors (two for f32), the element types template parameters chosen on the host from the
// node's types. Each element gets the generic kernel's float math (the same helpers) and the
// same rounding on store (cu_bits16: __float2half_rn / __float2bfloat16_rn), so the results are
// the generic kernels' bits. The host takes them where every operand is contiguous and 16-byte
// aligned (cu_vec_ok); the elements after the last whole vector are a scalar tail. ----

#define CU_EW_VEC   8  // elements a vector step: 16 bytes of a 16-bit type, 32 of f32
#define CU_EW_STEPS 2  // vector steps a thread the grid is sized for (a grid-stride loop beyond it)

// element traits by ql_type: the stored type, one element to and from float, 8 from and to
// 16-byte aligned memory
template <int TYPE> struct cu_ew;
template <> struct cu_ew<QL_TYPE_F32> {
    typedef float T;
    static __device__ __forceinline__ float ld(const float *p, int64_t i) { return p[i]; }
    static __device__ __forceinline__ void st(float *p, int64_t i, float v) { p[i] = v; }
    static __device__ __forceinline__ float rounded(float v) { return v; }  // v as st stores it, read back
    static __device__ __forceinline__ void ld8(const float *p, float v[CU_EW_VEC]) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    static __device__ __forceinline__ void st8(float *p, const float v[CU_EW_VEC]) {
        ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
};
template <int TYPE> struct cu_ew16 {  // f16, bf16: the bits as uint16_t, element 2i in a word's low half
    typedef uint16_t T;
    static __device__ __forceinline__ float f(uint32_t h) {
        if (TYPE == QL_TYPE_F16) return cu_h2f((uint16_t)h);
        __nv_bfloat16_raw r;
        r.x = (uint16_t)h;
        return __bfloat162float(__nv_bfloat16(r));
    }
    static __device__ __forceinline__ float ld(const uint16_t *p, int64_t i) { return f(p[i]); }
    static __device__ __forceinline__ float rounded(float v) { return f(cu_bits16(v, TYPE)); }
    static __device__ __forceinline__ void st(uint16_t *p, int64_t i, float v) { p[i] = (uint16_t)cu_bits16(v, TYPE); }
    static __device__ __forceinline__ void ld8(const uint16_t *p, float v[CU_EW_VEC]) {
        const uint4 q = *(const uint4 *)p;
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
QL_UNROLL
        for (int k = 0; k < 4; k++) v[2 * k] = f(w[k] & 0xffff), v[2 * k + 1] = f(w[k] >> 16);
    }
    static __device__ __forceinline__ void st8(uint16_t *p, const float v[CU_EW_VEC]) {
        uint32_t w[4];
QL_UNROLL
        for (int k = 0; k < 4; k++) w[k] = cu_bits16(v[2 * k], TYPE) | (uint32_t)cu_bits16(v[2 * k + 1], TYPE) << 16;
        *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct cu_ew<QL_TYPE_F16> : cu_ew16<QL_TYPE_F16> {};
template <> struct cu_ew<QL_TYPE_BF16> : cu_ew16<QL_TYPE_BF16> {};

// the grid-stride loop over whole vectors [0, n / CU_EW_VEC), then the tail [n - n % CU_EW_VEC, n)
// on block 0's first threads
#define CU_VEC_LOOP(v, n) CU_GRID_LOOP(v, (n) / CU_EW_VEC)
#define CU_VEC_TAIL(i, n) \
    for (int64_t i = (n) / CU_EW_VEC * CU_EW_VEC + threadIdx.x; blockIdx.x == 0 && threadIdx.x < CU_EW_VEC && i < (n); i += CU_EW_VEC)

// the fast path's conditions: contiguous, 16-byte aligned (tensors start QL_ALIGN-aligned; a view may not)
static bool cu_vec_ok(const ql_tensor *t) { return ql_is_contiguous(t) && (uintptr_t)t->data % 16 == 0; }
static int cu_grid_vec(int64_t n) { return cu_grid(n / CU_EW_VEC, CU_BLOCK * CU_EW_STEPS); }

// the fast paths off (the strided kernels for every layout): QLORA_CUDA_EW_FAST=0 (an A/B on a
// GPU), or a test; and how many launches took one (tests)
static std::atomic<bool> cu_ew_fast_on{!(getenv("QLORA_CUDA_EW_FAST") && strcmp(getenv("QLORA_CUDA_EW_FAST"), "0") == 0)};
static std::atomic<int64_t> cu_ew_fast_launches{0};
void ql_cuda_ew_fast_for_tests(bool on) { cu_ew_fast_on = on; }
int64_t ql_cuda_ew_fast_launches_for_tests() { return cu_ew_fast_launches.load(); }
// layouts_ok: the operands allow the fast path (cu_vec_ok and the op's own conditions)
static bool cu_ew_fast(bool layouts_ok) {
    if (!layouts_ok || !cu_ew_fast_on) return false;
    cu_ew_fast_launches++;
    return true;
}

// ---- fill, copies, elementwise ----

__global__ void k_fill(float *d, int64_t n, float v) {
    CU_GRID_LOOP(i, n) d[i] = v;
}
static void cu_op_fill(cu_ctx &c, ql_tensor *node) {
    CU_ASSERT(node->type == QL_TYPE_F32 && ql_is_contiguous(node));
    const int64_t n = ql_nelements(node);
    QL_LAUNCH(k_fill, cu_grid(n), CU_BLOCK, 0, c.stream, (float *)node->data, n, cu_param<float>(node, 0));
    CU_LAUNCHED(c);
}

// dst (contiguous) = src element for element, converting between plain types; same-type copies of
// 4-byte types (i32) move the bits
__global__ void k_cont(cu_t src, char *dst, int dst_type, int64_t n) {
    const int ss = src.type == QL_TYPE_F32 || src.type == QL_TYPE_I32 ? 4 : 2, ds = dst_type == QL_TYPE_F32 || dst_type == QL_TYPE_I32 ? 4 : 2;
    CU_GRID_LOOP(i, n) {
        const char *s = src.data + cu_offs(src, i);
        if (src.type == dst_type) {
            if (ss == 4) *(uint32_t *)(dst + i * 4) = *(const uint32_t *)s;
            else *(uint16_t *)(dst + i * 2) = *(const uint16_t *)s;
        } else {
            cu_st(dst + i * ds, dst_type, cu_ld(s, src.type));
        }
    }
}
// the fast paths: a same-type copy moves the bits in 16-byte words (U: the element's bits), a
// conversion goes through float as k_cont's
template <typename U> __global__ void k_copy_vec(const U *s, U *d, int64_t n) {
    const int64_t nw = n * (int64_t)sizeof(U) / 16;  // whole 16-byte words
    CU_GRID_LOOP(w, nw) ((uint4 *)d)[w] = ((const uint4 *)s)[w];
    const int64_t t0 = nw * 16 / (int64_t)sizeof(U);  // the tail: fewer than 16 bytes
    if (blockIdx.x == 0 && threadIdx.x < n - t0) d[t0 + threadIdx.x] = s[t0 + threadIdx.x];
}
template <int S, int D> __global__ void k_cont_vec(const typename cu_ew<S>::T *s, typename cu_ew<D>::T *d, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float x[CU_EW_VEC];
        cu_ew<S>::ld8(s + v * CU_EW_VEC, x);
        cu_ew<D>::st8(d + v * CU_EW_VEC, x);
    }
    CU_VEC_TAIL(i, n) cu_ew<D>::st(d, i, cu_ew<S>::ld(s, i));
}
template <int S, int D> static void cu_launch_cont_vec(cu_ctx &c, const void *s, void *d, int64_t n) {
    QL_LAUNCH((k_cont_vec<S, D>), cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const typename cu_ew<S>::T *)s, (typename cu_ew<D>::T *)d, n);
}
static void cu_op_cont(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    const int64_t n = ql_nelements(node);
    const int st = (int)a->type, dt = (int)node->type;
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(node))) {
        if (st == dt && (st == QL_TYPE_F32 || st == QL_TYPE_I32))
            QL_LAUNCH(k_copy_vec<uint32_t>, cu_grid(n * 4 / 16, CU_BLOCK * CU_EW_STEPS), CU_BLOCK, 0, c.stream, (const uint32_t *)a->data,
                      (uint32_t *)node->data, n);
        else if (st == dt)
            QL_LAUNCH(k_copy_vec<uint16_t>, cu_grid(n * 2 / 16, CU_BLOCK * CU_EW_STEPS), CU_BLOCK, 0, c.stream, (const uint16_t *)a->data,
                      (uint16_t *)node->data, n);
        else if (st == QL_TYPE_F32 && dt == QL_TYPE_BF16) cu_launch_cont_vec<QL_TYPE_F32, QL_TYPE_BF16>(c, a->data, node->data, n);
        else if (st == QL_TYPE_F32 && dt == QL_TYPE_F16) cu_launch_cont_vec<QL_TYPE_F32, QL_TYPE_F16>(c, a->data, node->data, n);
        else if (st == QL_TYPE_BF16 && dt == QL_TYPE_F32) cu_launch_cont_vec<QL_TYPE_BF16, QL_TYPE_F32>(c, a->data, node->data, n);
        else if (st == QL_TYPE_F16 && dt == QL_TYPE_F32) cu_launch_cont_vec<QL_TYPE_F16, QL_TYPE_F32>(c, a->data, node->data, n);
        else if (st == QL_TYPE_BF16 && dt == QL_TYPE_F16) cu_launch_cont_vec<QL_TYPE_BF16, QL_TYPE_F16>(c, a->data, node->data, n);
        else cu_launch_cont_vec<QL_TYPE_F16, QL_TYPE_BF16>(c, a->data, node->data, n);
    } else {
        QL_LAUNCH(k_cont, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), (char *)node->data, dt, n);
    }
    CU_LAUNCHED(c);
}

// a + b or a * b, b repeated (by modulo, or by blocks when grouped) over a's shape
__global__ void k_binary(cu_t a, cu_t b, float *d, int mul, int grouped, int64_t n) {
    // the common layouts without 64-bit divisions: a and b contiguous, b the same size or one row
    if (a.contig && b.contig && (b.ne[0] * b.ne[1] * b.ne[2] * b.ne[3] == n || (!grouped && b.ne[1] * b.ne[2] * b.ne[3] == 1))) {
        const float *x = (const float *)a.data, *y = (const float *)b.data;
        const int64_t nb_ = b.ne[0] * b.ne[1] * b.ne[2] * b.ne[3];
        if (nb_ == n) {
            CU_GRID_LOOP(i, n) d[i] = mul ? x[i] * y[i] : x[i] + y[i];
        } else {
            const uint32_t r = (uint32_t)b.ne[0];  // a row: ne0 < 2^32
            CU_GRID_LOOP(i, n) d[i] = mul ? x[i] * y[(uint32_t)(i % r)] : x[i] + y[(uint32_t)(i % r)];
        }
        return;
    }
    CU_GRID_LOOP(i, n) {
        const int64_t i0 = i % a.ne[0], r = i / a.ne[0], i1 = r % a.ne[1], i2 = (r / a.ne[1]) % a.ne[2], i3 = r / (a.ne[1] * a.ne[2]);
        const int64_t idx[4] = {i0, i1, i2, i3};
        int64_t off = 0;
        for (int k = 0; k < 4; k++) off += (grouped ? idx[k] / (a.ne[k] / b.ne[k]) : idx[k] % b.ne[k]) * b.nb[k];
        const float x = *(const float *)(a.data + i0 * a.nb[0] + i1 * a.nb[1] + i2 * a.nb[2] + i3 * a.nb[3]);
        const float y = *(const float *)(b.data + off);
        d[i] = mul ? x * y : x + y;
    }
}
// the fast path: a and b contiguous, b the same size (nb == n) or one row of nb elements
// repeated (nb a multiple of CU_EW_VEC, so a vector of a meets one vector of b)
template <bool MUL> __global__ void k_binary_vec(const float *x, const float *y, float *d, int64_t nb, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC], q[CU_EW_VEC];
        cu_ew<QL_TYPE_F32>::ld8(x + v * CU_EW_VEC, p);
        cu_ew<QL_TYPE_F32>::ld8(y + (nb == n ? v * CU_EW_VEC : v * CU_EW_VEC % nb), q);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) p[k] = MUL ? p[k] * q[k] : p[k] + q[k];
        cu_ew<QL_TYPE_F32>::st8(d + v * CU_EW_VEC, p);
    }
    CU_VEC_TAIL(i, n) d[i] = MUL ? x[i] * y[i % nb] : x[i] + y[i % nb];
}
static void cu_op_binary(cu_ctx &c, ql_tensor *node, bool mul) {
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const int64_t n = ql_nelements(node), nb = ql_nelements(b);
    const bool grouped = node->op_params[0] != 0;
    const bool b_fits = nb == n || (!grouped && nb == b->ne[0] && nb % CU_EW_VEC == 0);  // b the same size, or a row of whole vectors
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(b) && cu_vec_ok(node) && b_fits)) {
        if (mul) QL_LAUNCH(k_binary_vec<true>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)a->data, (const float *)b->data,
                           (float *)node->data, nb, n);
        else QL_LAUNCH(k_binary_vec<false>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)a->data, (const float *)b->data,
                       (float *)node->data, nb, n);
    } else {
        QL_LAUNCH(k_binary, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), cu_of(b), (float *)node->data, (int)mul, (int)grouped, n);
    }
    CU_LAUNCHED(c);
}

// d = a * s in d's type (f32, or 16-bit: ql_scale_to, the f32 product rounded once on store)
__global__ void k_scale(cu_t a, char *d, int d_type, float s, int64_t n) {
    const int ds = d_type == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(i, n) cu_st(d + i * ds, d_type, *(const float *)(a.data + cu_offs(a, i)) * s);
}
template <int D> __global__ void k_scale_vec(const float *x, typename cu_ew<D>::T *d, float s, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC];
        cu_ew<QL_TYPE_F32>::ld8(x + v * CU_EW_VEC, p);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) p[k] = p[k] * s;
        cu_ew<D>::st8(d + v * CU_EW_VEC, p);
    }
    CU_VEC_TAIL(i, n) cu_ew<D>::st(d, i, x[i] * s);
}
template <int D> static void cu_launch_scale_vec(cu_ctx &c, const void *x, void *d, float s, int64_t n) {
    QL_LAUNCH(k_scale_vec<D>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)x, (typename cu_ew<D>::T *)d, s, n);
}
static void cu_op_scale(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    const int64_t n = ql_nelements(node);
    const float s = cu_param<float>(node, 0);
    CU_ASSERT(a->type == QL_TYPE_F32 && is_float_type_cu(node->type) && ql_is_contiguous(node));
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(node))) {
        if (node->type == QL_TYPE_F32) cu_launch_scale_vec<QL_TYPE_F32>(c, a->data, node->data, s, n);
        else if (node->type == QL_TYPE_BF16) cu_launch_scale_vec<QL_TYPE_BF16>(c, a->data, node->data, s, n);
        else cu_launch_scale_vec<QL_TYPE_F16>(c, a->data, node->data, s, n);
    } else {
        QL_LAUNCH(k_scale, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), (char *)node->data, (int)node->type, s, n);
    }
    CU_LAUNCHED(c);
}

// one block, a fixed assignment of elements to threads, summed in double: deterministic
__global__ void k_sum(cu_t a, float *d, int64_t n) {
    __shared__ double sh[32];
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += *(const float *)(a.data + cu_offs(a, i));
    s = cu_block_sum_d(s, sh);
    if (threadIdx.x == 0) *d = (float)s;
}
static void cu_op_sum(cu_ctx &c, ql_tensor *node) {
    QL_LAUNCH(k_sum, 1, 1024, 0, c.stream, cu_of(node->src[0]), (float *)node->data, ql_nelements(node->src[0]));
    CU_LAUNCHED(c);
}

// each result element sums its repetitions in a (the adjoint of broadcasting)
__global__ void k_reduce_to(cu_t a, float *d, int64_t d0, int64_t d1, int64_t d2, int64_t d3, int grouped) {
    const int64_t dn[4] = {d0, d1, d2, d3};
    CU_GRID_LOOP(j, d0 * d1 * d2 * d3) {
        const int64_t jj[4] = {j % d0, (j / d0) % d1, (j / (d0 * d1)) % d2, j / (d0 * d1 * d2)};
        int64_t rep[4];
        for (int k = 0; k < 4; k++) rep[k] = a.ne[k] / dn[k];
        float s = 0;
        for (int64_t t3 = 0; t3 < rep[3]; t3++)
            for (int64_t t2 = 0; t2 < rep[2]; t2++)
                for (int64_t t1 = 0; t1 < rep[1]; t1++)
                    for (int64_t t0 = 0; t0 < rep[0]; t0++) {
                        const int64_t i0 = grouped ? jj[0] * rep[0] + t0 : jj[0] + t0 * d0;
                        const int64_t i1 = grouped ? jj[1] * rep[1] + t1 : jj[1] + t1 * d1;
                        const int64_t i2 = grouped ? jj[2] * rep[2] + t2 : jj[2] + t2 * d2;
                        const int64_t i3 = grouped ? jj[3] * rep[3] + t3 : jj[3] + t3 * d3;
                        s += *(const float *)(a.data + i0 * a.nb[0] + i1 * a.nb[1] + i2 * a.nb[2] + i3 * a.nb[3]);
                    }
        d[j] = s;
    }
}
static void cu_op_reduce_to(cu_ctx &c, ql_tensor *node) {
    const int64_t n = ql_nelements(node);
    QL_LAUNCH(k_reduce_to, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(node->src[0]), (float *)node->data, node->ne[0], node->ne[1],
              node->ne[2], node->ne[3], (int)(node->op_params[0] != 0));
    CU_LAUNCHED(c);
}

// grad += contribution (the node aliases the gradient accumulator)
__global__ void k_acc_grad(float *g, cu_t src, int64_t n) {
    CU_GRID_LOOP(i, n) g[i] += *(const float *)(src.data + cu_offs(src, i));
}
__global__ void k_acc_grad_vec(float *g, const float *x, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC], q[CU_EW_VEC];
        cu_ew<QL_TYPE_F32>::ld8(g + v * CU_EW_VEC, p);
        cu_ew<QL_TYPE_F32>::ld8(x + v * CU_EW_VEC, q);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) p[k] += q[k];
        cu_ew<QL_TYPE_F32>::st8(g + v * CU_EW_VEC, p);
    }
    CU_VEC_TAIL(i, n) g[i] += x[i];
}
static void cu_op_acc_grad(cu_ctx &c, ql_tensor *node) {
    CU_ASSERT(ql_is_contiguous(node));
    const ql_tensor *src = node->src[1];
    const int64_t n = ql_nelements(src);
    if (cu_ew_fast(cu_vec_ok(src) && cu_vec_ok(node)))
        QL_LAUNCH(k_acc_grad_vec, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (float *)node->data, (const float *)src->data, n);
    else
        QL_LAUNCH(k_acc_grad, cu_grid(n), CU_BLOCK, 0, c.stream, (float *)node->data, cu_of(src), n);
    CU_LAUNCHED(c);
}

// rows of src (f32) into the cache (f32, or f16: rounded to nearest even as the CPU's) at the
// run-time row pos[0] (read on the device)
template <typename CT> __device__ __forceinline__ void cu_cache_store1(const cu_t &cache, const cu_t &src, int32_t at, int64_t i) {
    const int64_t i0 = i % src.ne[0], r = i / src.ne[0], i1 = r % src.ne[1], i2 = (r / src.ne[1]) % src.ne[2], i3 = r / (src.ne[1] * src.ne[2]);
    const float v = *(const float *)(src.data + i0 * src.nb[0] + i1 * src.nb[1] + i2 * src.nb[2] + i3 * src.nb[3]);
    cu_cache_put(cache, sizeof(CT) == 2, at, i0, i1, i2, i3, v);
}
template <typename CT> __global__ void k_cache_store(cu_t cache, cu_t src, const int32_t *pos, int64_t n) {
    const int32_t at = *pos;
    CU_GRID_LOOP(i, n) cu_cache_store1<CT>(cache, src, at, i);
}
// the keys' and the values' stores by one launch (ql_cuda_cache_store_pair): elements [0, n0) the
// first's, then the second's
template <typename CT>
__global__ void k_cache_store2(cu_t cache0, cu_t src0, cu_t cache1, cu_t src1, const int32_t *pos, int64_t n0, int64_t n1) {
    const int32_t at = *pos;
    CU_GRID_LOOP(i, n0 + n1) {
        if (i < n0) cu_cache_store1<CT>(cache0, src0, at, i);
        else cu_cache_store1<CT>(cache1, src1, at, i - n0);
    }
}
// second: NULL, or the next node, the values' store made by the same launch
static void cu_op_cache_store(cu_ctx &c, ql_tensor *node, ql_tensor *second = nullptr) {
    const int64_t n = ql_nelements(node->src[1]);
    const cu_t cache = cu_of(node), src = cu_of(node->src[1]);
    const int32_t *pos = (const int32_t *)node->src[2]->data;
    if (second) {
        CU_ASSERT(ql_cuda_cache_store_pair(node, second));
        const int64_t n1 = ql_nelements(second->src[1]);
        const cu_t cache1 = cu_of(second), src1 = cu_of(second->src[1]);
        if (node->type == QL_TYPE_F16)
            QL_LAUNCH(k_cache_store2<uint16_t>, cu_grid(n + n1), CU_BLOCK, 0, c.stream, cache, src, cache1, src1, pos, n, n1);
        else QL_LAUNCH(k_cache_store2<float>, cu_grid(n + n1), CU_BLOCK, 0, c.stream, cache, src, cache1, src1, pos, n, n1);
    } else if (node->type == QL_TYPE_F16) {
        QL_LAUNCH(k_cache_store<uint16_t>, cu_grid(n), CU_BLOCK, 0, c.stream, cache, src, pos, n);
    } else {
        QL_LAUNCH(k_cache_store<float>, cu_grid(n), CU_BLOCK, 0, c.stream, cache, src, pos, n);
    }
    CU_LAUNCHED(c);
}

// the view's gradient placed into zeros of the source's shape: d[off + i0 + i1 s1 + ...] += dy
__global__ void k_view_back(cu_t dy, float *d, int64_t off, int64_t s1, int64_t s2, int64_t s3, int64_t n) {
    CU_GRID_LOOP(i, n) {
        const int64_t i0 = i % dy.ne[0], r = i / dy.ne[0], i1 = r % dy.ne[1], i2 = (r / dy.ne[1]) % dy.ne[2], i3 = r / (dy.ne[1] * dy.ne[2]);
        d[off + i0 + i1 * s1 + i2 * s2 + i3 * s3] += *(const float *)(dy.data + i0 * dy.nb[0] + i1 * dy.nb[1] + i2 * dy.nb[2] + i3 * dy.nb[3]);
    }
}
static void cu_op_view_back(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *dy = node->src[0];
    const int64_t off = cu_param<int64_t>(node, 0), s1 = cu_param<int64_t>(node, 2), s2 = cu_param<int64_t>(node, 4),
                  s3 = cu_param<int64_t>(node, 6), n = ql_nelements(dy);
    CU_CHECK(c, cudaMemsetAsync(node->data, 0, ql_nbytes(node), c.stream));
    // a view overlapping itself (marked by its constructor) adds several elements into one place: one thread, in order
    const bool inj = node->op_params[8] == 0;
    QL_LAUNCH(k_view_back, inj ? cu_grid(n) : 1, inj ? CU_BLOCK : 1, 0, c.stream, cu_of(dy), (float *)node->data, off, s1, s2, s3, n);
    CU_LAUNCHED(c);
}

// ---- embedding rows ----

// a row outside the table gives NaN (check_finite names the node; the CPU backend reports the id)
__global__ void k_get_rows(const char *w, int64_t row_bytes, int type, const char *aux, int64_t ne0, int64_t nrows, const int32_t *ids,
                           float *d, int64_t n) {
    CU_GRID_LOOP(i, n) {
        const int64_t k = i / ne0, e = i % ne0;
        const int32_t id = ids[k];
        d[i] = id >= 0 && id < nrows ? cu_weight_elem(w, row_bytes, type, aux, ne0, id, e) : NAN;
    }
}
static void cu_op_get_rows(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0], *ids = node->src[1];
    const int64_t n = ql_nelements(node);
    const char *aux = a->aux_size ? (const char *)a->data + ql_aux_offset(ql_nbytes(a)) : nullptr;
    QL_LAUNCH(k_get_rows, cu_grid(n), CU_BLOCK, 0, c.stream, (const char *)a->data, (int64_t)a->nb[1], (int)a->type, aux, a->ne[0],
              a->ne[1], (const int32_t *)ids->data, (float *)node->data, n);
    CU_LAUNCHED(c);
}

// dst = 0, then each thread owns a column and adds the rows of dy in order: no races, one order
__global__ void k_get_rows_back(cu_t dy, const int32_t *ids, int64_t n_ids, float *d, int64_t ne0, int64_t nrows) {
    CU_GRID_LOOP(e, ne0) {
        for (int64_t i = 0; i < n_ids; i++) {
            const int32_t id = ids[i];
            if (id >= 0 && id < nrows) d[id * ne0 + e] += *(const float *)(cu_row(dy, i) + e * 4);
        }
    }
}
static void cu_op_get_rows_back(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *dy = node->src[0], *ids = node->src[1];
    CU_CHECK(c, cudaMemsetAsync(node->data, 0, ql_nbytes(node), c.stream));
    QL_LAUNCH(k_get_rows_back, cu_grid(node->ne[0]), CU_BLOCK, 0, c.stream, cu_of(dy), (const int32_t *)ids->data, ql_nelements(ids),
              (float *)node->data, node->ne[0], node->ne[1]);
    CU_LAUNCHED(c);
}

// ---- row ops: rms_norm, silu, swiglu, dropout ----

// w: NULL, or [ne0] (ql_rms_norm_mul): the normed element rounded to f32, then times w (ql_mul's
// product); d in d_type: f32, or 16-bit (ql_rms_norm_mul_to: that f32 value rounded once on store)
// d16: NULL, or an f32 d's cast to d16_type written too (ql_cuda_norm_cast_pair: the cast node's bits)
// the row's scale: cu_rms_scale_of (section 5, with cu_rms_elem: the decode products' tails use them too)
__device__ __forceinline__ float cu_rms_scale(const float *x, int64_t ne0, float eps, float *sh) {
    return cu_rms_scale_of(x, ne0, eps, sh);
}
// dr: the adapters' dropped-out copies of an f32 d (ql_cuda_norm_dropout), each element k_dropout's
// (the mask of its own index, the kept value times the scale, rounded once on store)
// a QL_OP_DROPOUT node's mask and scale, as k_dropout takes them (a copy made by another node's launch)
struct cu_drop_args {
    const int32_t *seed;
    uint32_t stream, thr;
    float ks;
    int64_t first;  // the mask's index of element 0 (ql_dropout_rows_to's first row times ne0)
};
static cu_drop_args cu_drop_of(const ql_tensor *t) {
    const float pr = cu_param<float>(t, 0);
    return cu_drop_args{(const int32_t *)t->src[1]->data, cu_param<uint32_t>(t, 1), ql_dropout_threshold(pr), 1.0f / (1.0f - pr),
                        cu_param<int64_t>(t, 2) * t->ne[0]};
}
struct cu_norm_drops {
    cu_drop_args m[QL_CUDA_NORM_DROPS];
    char *d[QL_CUDA_NORM_DROPS];
    int type[QL_CUDA_NORM_DROPS];
    int n;
};
__global__ void __launch_bounds__(CU_ROW_BLOCK) k_rms_norm(cu_t a, const float *w, char *d, int d_type, float eps, char *d16, int d16_type,
                                                           cu_norm_drops dr) {
    __shared__ float sh[32];
    const int64_t ne0 = a.ne[0], r = blockIdx.x;
    const float *x = (const float *)cu_row(a, r);
    const float rs = cu_rms_scale(x, ne0, eps, sh);
    uint64_t key[QL_CUDA_NORM_DROPS];  // (the loops unrolled: constant indices, registers not local memory)
QL_UNROLL
    for (int k = 0; k < QL_CUDA_NORM_DROPS; k++) key[k] = k < dr.n ? ql_dropout_key(dr.m[k].seed[0], dr.m[k].stream) : 0;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = cu_rms_elem(x, rs, w, i);
        const int64_t e = r * ne0 + i;
        cu_st(d + e * (d_type == QL_TYPE_F32 ? 4 : 2), d_type, v);
        if (d16) cu_st(d16 + e * 2, d16_type, v);
QL_UNROLL
        for (int k = 0; k < QL_CUDA_NORM_DROPS; k++)
            if (k < dr.n)
                cu_st(dr.d[k] + e * (dr.type[k] == QL_TYPE_F32 ? 4 : 2), dr.type[k],
                      ql_dropout_hash(key[k], (uint64_t)(dr.m[k].first + e)) >= dr.m[k].thr ? v * dr.m[k].ks : 0.0f);
    }
}
// decode (ql_cuda_q8_made_by): k_rms_norm's f32 result (cu_rms_scale, cu_rms_elem),
// and as each lane stores 8 neighbouring elements, their 8-bit codes for the next product (k_q8_act's,
// cu_q8_act8) - the product then finds them in the workspace. One block of CU_ROW_BLOCK a row
// (a column of the product's b), ne0 a multiple of 256
__global__ void __launch_bounds__(CU_ROW_BLOCK) k_rms_norm_q8(cu_t a, const float *w, float *d, float eps, int qb, int8_t *q, float *sd,
                                                              int *ss) {
    __shared__ float sh[32];
    const int64_t ne0 = a.ne[0], r = blockIdx.x;
    const float *x = (const float *)cu_row(a, r);
    const float rs = cu_rms_scale(x, ne0, eps, sh);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int64_t base = (int64_t)warp * 256; base < ne0; base += (int64_t)nw * 256) {  // (warp-uniform: the shuffles)
        const int64_t e = base + lane * 8;
        float v[8];
QL_UNROLL
        for (int l = 0; l < 8; l++) {
            v[l] = cu_rms_elem(x, rs, w, e + l);
            d[r * ne0 + e + l] = v[l];
        }
        cu_q8_act8(v, true, r, ne0, e, qb, q, sd, ss);
    }
}
// more[0..nm): the nodes after it made by the same launch - the result's cast to 16 bits
// (ql_cuda_norm_cast_pair), then adapters' dropped-out copies (ql_cuda_norm_dropout)
static void cu_op_rms_norm(cu_ctx &c, ql_tensor *node, ql_tensor *const *more = nullptr, int nm = 0) {
    // limitation: one block per row; rows beyond the grid's 2^31 - 1 do not occur in these graphs
    const ql_tensor *w = node->src[1];
    CU_ASSERT(is_float_type_cu(node->type) && ql_is_contiguous(node));
    const ql_tensor *cast = nm > 0 && more[0]->op == QL_OP_CONT ? more[0] : nullptr;
    CU_ASSERT(!cast || ql_cuda_norm_cast_pair(node, cast));
    cu_norm_drops dr{};
    for (int k = cast ? 1 : 0; k < nm; k++) {
        const ql_tensor *t = more[k];
        CU_ASSERT(dr.n < QL_CUDA_NORM_DROPS && ql_cuda_norm_dropout(node, t));
        dr.m[dr.n] = cu_drop_of(t), dr.d[dr.n] = (char *)t->data, dr.type[dr.n] = (int)t->type;
        dr.n++;
    }
    QL_LAUNCH(k_rms_norm, (unsigned)cu_nrows(node), CU_ROW_BLOCK, 0, c.stream, cu_of(node->src[0]), w ? (const float *)w->data : nullptr,
              (char *)node->data, (int)node->type, cu_param<float>(node, 0), cast ? (char *)cast->data : nullptr, cast ? (int)cast->type : 0, dr);
    CU_LAUNCHED(c);
}

// y = x r, r = (mean(x^2) + eps)^-1/2  =>  dx = r dy - r^3/n (dy . x) x
// w: NULL, or the forward's weight (ql_rms_norm_mul): the norm's dy is dy * w, rounded to f32 as
// ql_mul's product (__fmul_rn: never contracted into a sum), made where dy is read. acc: NULL, or the
// gradient so far (contiguous): d = acc + dx as ql_add sums (__fadd_rn: dx rounded first). d16:
// NULL, or d's cast to d16_type written too (ql_cuda_norm_cast_pair: the cast node's bits, no launch)
__global__ void __launch_bounds__(CU_ROW_BLOCK) k_rms_norm_back(cu_t a, cu_t dy, const float *w, const float *acc, float *d, float eps,
                                                              char *d16, int d16_type) {
    __shared__ float sh[32];
    const int64_t ne0 = a.ne[0], r = blockIdx.x;
    const float *x = (const float *)cu_row(a, r), *g = (const float *)cu_row(dy, r);
    float sxx = 0, sgx = 0;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float gi = w ? __fmul_rn(g[i], w[i]) : g[i];
        sxx += x[i] * x[i];
        sgx += gi * x[i];
    }
    sxx = cu_block_sum(sxx, sh);
    sgx = cu_block_sum(sgx, sh);
    const float rs = 1.0f / sqrtf(sxx / (float)ne0 + eps), k = -rs * rs * rs * sgx / (float)ne0;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float gi = w ? __fmul_rn(g[i], w[i]) : g[i];  // (g may be d: this thread's own element, read before it is written)
        const float dx = rs * gi + k * x[i];
        const float v = acc ? __fadd_rn(acc[r * ne0 + i], dx) : dx;
        d[r * ne0 + i] = v;
        if (d16) cu_st(d16 + (r * ne0 + i) * 2, d16_type, v);
    }
}
// cast: NULL, or the next node, the result's cast to 16 bits, made by the same launch (ql_cuda_norm_cast_pair)
static void cu_op_rms_norm_back(cu_ctx &c, ql_tensor *node, ql_tensor *cast = nullptr) {
    const ql_tensor *w = node->src[2], *acc = node->src[3];
    CU_ASSERT(!cast || (ql_cuda_norm_cast_pair(node, cast) && ql_is_contiguous(node)));
    QL_LAUNCH(k_rms_norm_back, (unsigned)cu_nrows(node), CU_ROW_BLOCK, 0, c.stream, cu_of(node->src[0]), cu_of(node->src[1]),
              w ? (const float *)w->data : nullptr, acc ? (const float *)acc->data : nullptr, (float *)node->data, cu_param<float>(node, 0),
              cast ? (char *)cast->data : nullptr, cast ? (int)cast->type : 0);
    CU_LAUNCHED(c);
}

__device__ __forceinline__ float cu_at(const cu_t &t, int64_t i) { return *(const float *)(t.data + cu_offs(t, i)); }

// the per-element math, one place for the generic kernels and the fast paths (the same bits)
__device__ __forceinline__ float cu_silu_f(float x) { return x * cu_sigmoid(x); }
// d/dx x s(x) = s (1 + x (1 - s))
__device__ __forceinline__ float cu_silu_back_f(float x, float g) {
    const float s = cu_sigmoid(x);
    return g * s * (1.0f + x * (1.0f - s));
}
// swiglu's backward at one element: *da = dy b silu'(a), *db = dy silu(a)
__device__ __forceinline__ void cu_swiglu_back_f(float x, float y, float g, float *da, float *db) {
    const float s = cu_sigmoid(x);
    *db = g * x * s;
    *da = g * y * s * (1.0f + x * (1.0f - s));
}

__global__ void k_silu(cu_t a, float *d, int64_t n) {
    CU_GRID_LOOP(i, n) d[i] = cu_silu_f(cu_at(a, i));
}
__global__ void k_silu_back(cu_t a, cu_t dy, float *d, int64_t n) {
    CU_GRID_LOOP(i, n) d[i] = cu_silu_back_f(cu_at(a, i), cu_at(dy, i));
}
// element i of a plain-typed tensor (f32, f16, bf16) as float
__device__ __forceinline__ float cu_get(const cu_t &t, int64_t i) { return cu_ld(t.data + cu_offs(t, i), t.type); }
// a and b of one type (f32, f16, bf16); d [n] of it too, a 16-bit value rounded once
__global__ void k_swiglu(cu_t a, cu_t b, char *d, int64_t n) {
    const int ds = a.type == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(i, n) cu_st(d + i * ds, a.type, cu_swiglu_f(cu_get(a, i), cu_get(b, i)));
}
// y = silu(a) b: da = dy b silu'(a) at [0, n), db = dy silu(a) at [n, 2n); a and b of any plain type, dy f32,
// d f32 or 16-bit (autodiff's cast of the two gradients folded in: each rounded once as it is stored)
__global__ void k_swiglu_back(cu_t a, cu_t b, cu_t dy, char *d, int d_type, int64_t n) {
    const int ds = d_type == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(i, n) {
        float da, db;
        cu_swiglu_back_f(cu_get(a, i), cu_get(b, i), cu_at(dy, i), &da, &db);
        cu_st(d + i * ds, d_type, da);
        cu_st(d + (n + i) * ds, d_type, db);
    }
}

// the fast paths: every operand contiguous and 16-byte aligned (swiglu_back's d + n too)
__global__ void k_silu_vec(const float *x, float *d, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC];
        cu_ew<QL_TYPE_F32>::ld8(x + v * CU_EW_VEC, p);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) p[k] = cu_silu_f(p[k]);
        cu_ew<QL_TYPE_F32>::st8(d + v * CU_EW_VEC, p);
    }
    CU_VEC_TAIL(i, n) d[i] = cu_silu_f(x[i]);
}
__global__ void k_silu_back_vec(const float *x, const float *dy, float *d, int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC], g[CU_EW_VEC];
        cu_ew<QL_TYPE_F32>::ld8(x + v * CU_EW_VEC, p);
        cu_ew<QL_TYPE_F32>::ld8(dy + v * CU_EW_VEC, g);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) p[k] = cu_silu_back_f(p[k], g[k]);
        cu_ew<QL_TYPE_F32>::st8(d + v * CU_EW_VEC, p);
    }
    CU_VEC_TAIL(i, n) d[i] = cu_silu_back_f(x[i], dy[i]);
}
// vector v of SwiGLU's fast path: its elements made, stored in d, and left in p (as computed)
template <int T>
__device__ __forceinline__ void cu_swiglu8(const typename cu_ew<T>::T *a, const typename cu_ew<T>::T *b, typename cu_ew<T>::T *d, int64_t v,
                                           float p[CU_EW_VEC]) {
    float q[CU_EW_VEC];
    cu_ew<T>::ld8(a + v * CU_EW_VEC, p);
    cu_ew<T>::ld8(b + v * CU_EW_VEC, q);
QL_UNROLL
    for (int k = 0; k < CU_EW_VEC; k++) p[k] = cu_swiglu_f(p[k], q[k]);
    cu_ew<T>::st8(d + v * CU_EW_VEC, p);
}
template <int T> __global__ void k_swiglu_vec(const typename cu_ew<T>::T *a, const typename cu_ew<T>::T *b, typename cu_ew<T>::T *d,
                                              int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC];
        cu_swiglu8<T>(a, b, d, v, p);
    }
    CU_VEC_TAIL(i, n) cu_ew<T>::st(d, i, cu_swiglu_f(cu_ew<T>::ld(a, i), cu_ew<T>::ld(b, i)));
}
template <int T, int D>
__global__ void k_swiglu_back_vec(const typename cu_ew<T>::T *a, const typename cu_ew<T>::T *b, const float *dy, typename cu_ew<D>::T *d,
                                  int64_t n) {
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC], q[CU_EW_VEC], g[CU_EW_VEC], da[CU_EW_VEC], db[CU_EW_VEC];
        cu_ew<T>::ld8(a + v * CU_EW_VEC, p);
        cu_ew<T>::ld8(b + v * CU_EW_VEC, q);
        cu_ew<QL_TYPE_F32>::ld8(dy + v * CU_EW_VEC, g);
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++) cu_swiglu_back_f(p[k], q[k], g[k], &da[k], &db[k]);
        cu_ew<D>::st8(d + v * CU_EW_VEC, da);
        cu_ew<D>::st8(d + n + v * CU_EW_VEC, db);
    }
    CU_VEC_TAIL(i, n) {
        float da, db;
        cu_swiglu_back_f(cu_ew<T>::ld(a, i), cu_ew<T>::ld(b, i), dy[i], &da, &db);
        cu_ew<D>::st(d, i, da);
        cu_ew<D>::st(d, n + i, db);
    }
}
static void cu_op_silu(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    const int64_t n = ql_nelements(node);
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(node)))
        QL_LAUNCH(k_silu_vec, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)a->data, (float *)node->data, n);
    else
        QL_LAUNCH(k_silu, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), (float *)node->data, n);
    CU_LAUNCHED(c);
}
static void cu_op_silu_back(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0], *dy = node->src[1];
    const int64_t n = ql_nelements(node);
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(dy) && cu_vec_ok(node)))
        QL_LAUNCH(k_silu_back_vec, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)a->data, (const float *)dy->data,
                  (float *)node->data, n);
    else
        QL_LAUNCH(k_silu_back, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), cu_of(dy), (float *)node->data, n);
    CU_LAUNCHED(c);
}
// decode (ql_cuda_q8_made_by): SwiGLU's f32 result [K, N] (cu_swiglu_f, as k_swiglu's) and, as
// each lane stores 8 neighbouring elements, their 8-bit codes for the next product (cu_q8_act8);
// k_q8_act's grid
__global__ void __launch_bounds__(Q8_ACT_WARPS * 32) k_swiglu_q8(const float *a, const float *b, float *d, int64_t K, int qb, int8_t *q,
                                                                float *sd, int *ss) {
    const int lane = threadIdx.x % 32, n = blockIdx.y;
    const int64_t e = ((int64_t)blockIdx.x * Q8_ACT_WARPS + threadIdx.x / 32) * 256 + lane * 8;
    const bool in = e < K;  // (K a multiple of qb: a block's lanes are all in or all out)
    float v[8];
QL_UNROLL
    for (int l = 0; l < 8; l++) {
        v[l] = in ? cu_swiglu_f(a[n * K + e + l], b[n * K + e + l]) : 0.0f;
        if (in) d[n * K + e + l] = v[l];
    }
    cu_q8_act8(v, in, n, K, e, qb, q, sd, ss);
}
// SwiGLU and the down projection adapter's dropped-out copy of its result (ql_cuda_swiglu_dropout):
// each element rounded to the result's type as stored, then k_dropout's mask and scale (its bits)
__global__ void k_swiglu_drop(cu_t a, cu_t b, char *d, char *dd, int dd_type, cu_drop_args dr, int64_t n) {
    const int ds = a.type == QL_TYPE_F32 ? 4 : 2, dds = dd_type == QL_TYPE_F32 ? 4 : 2;
    const uint64_t key = ql_dropout_key(dr.seed[0], dr.stream);
    CU_GRID_LOOP(i, n) {
        cu_st(d + i * ds, a.type, cu_swiglu_f(cu_get(a, i), cu_get(b, i)));
        cu_st(dd + i * dds, dd_type, ql_dropout_hash(key, (uint64_t)(dr.first + i)) >= dr.thr ? cu_ld(d + i * ds, a.type) * dr.ks : 0.0f);
    }
}
template <int T, int TD>
__global__ void k_swiglu_drop_vec(const typename cu_ew<T>::T *a, const typename cu_ew<T>::T *b, typename cu_ew<T>::T *d,
                                  typename cu_ew<TD>::T *dd, cu_drop_args dr, int64_t n) {
    const uint64_t key = ql_dropout_key(dr.seed[0], dr.stream);
    CU_VEC_LOOP(v, n) {
        float p[CU_EW_VEC], q[CU_EW_VEC];
        cu_swiglu8<T>(a, b, d, v, p);
        uint64_t ctr = key + QL_DROPOUT_STEP * (uint64_t)(dr.first + v * CU_EW_VEC + 1);  // (k_dropout8's counter)
QL_UNROLL
        for (int k = 0; k < CU_EW_VEC; k++, ctr += QL_DROPOUT_STEP)
            q[k] = (uint32_t)(ql_mix64(ctr) >> 32) >= dr.thr ? cu_ew<T>::rounded(p[k]) * dr.ks : 0.0f;
        cu_ew<TD>::st8(dd + v * CU_EW_VEC, q);
    }
    CU_VEC_TAIL(i, n) {
        const float y = cu_ew<T>::rounded(cu_swiglu_f(cu_ew<T>::ld(a, i), cu_ew<T>::ld(b, i)));
        cu_ew<T>::st(d, i, y);
        cu_ew<TD>::st(dd, i, ql_dropout_hash(key, (uint64_t)(dr.first + i)) >= dr.thr ? y * dr.ks : 0.0f);
    }
}
template <int T, int TD> static void cu_launch_swiglu_drop_vec(cu_ctx &c, const ql_tensor *node, ql_tensor *drop, int64_t n) {
    QL_LAUNCH((k_swiglu_drop_vec<T, TD>), cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const typename cu_ew<T>::T *)node->src[0]->data,
              (const typename cu_ew<T>::T *)node->src[1]->data, (typename cu_ew<T>::T *)node->data, (typename cu_ew<TD>::T *)drop->data,
              cu_drop_of(drop), n);
}
template <int T> static void cu_launch_swiglu_drop_vec_to(cu_ctx &c, const ql_tensor *node, ql_tensor *drop, int64_t n) {
    if (drop->type == QL_TYPE_F32) cu_launch_swiglu_drop_vec<T, QL_TYPE_F32>(c, node, drop, n);
    else if (drop->type == QL_TYPE_BF16) cu_launch_swiglu_drop_vec<T, QL_TYPE_BF16>(c, node, drop, n);
    else cu_launch_swiglu_drop_vec<T, QL_TYPE_F16>(c, node, drop, n);
}
// drop: NULL, or the next node, the adapter's dropped-out copy of the result, made by the same launch
static void cu_op_swiglu(cu_ctx &c, ql_tensor *node, ql_tensor *drop = nullptr) {
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const int64_t n = ql_nelements(node);
    CU_ASSERT(node->type == a->type && b->type == a->type && ql_is_contiguous(node));
    CU_ASSERT(!drop || ql_cuda_swiglu_dropout(node, drop));
    if (drop) {
        if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(b) && cu_vec_ok(node) && cu_vec_ok(drop))) {
            if (a->type == QL_TYPE_F32) cu_launch_swiglu_drop_vec_to<QL_TYPE_F32>(c, node, drop, n);
            else if (a->type == QL_TYPE_BF16) cu_launch_swiglu_drop_vec_to<QL_TYPE_BF16>(c, node, drop, n);
            else cu_launch_swiglu_drop_vec_to<QL_TYPE_F16>(c, node, drop, n);
        } else {
            QL_LAUNCH(k_swiglu_drop, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), cu_of(b), (char *)node->data, (char *)drop->data,
                      (int)drop->type, cu_drop_of(drop), n);
        }
    } else if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(b) && cu_vec_ok(node))) {
        if (a->type == QL_TYPE_F32)
            QL_LAUNCH(k_swiglu_vec<QL_TYPE_F32>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const float *)a->data, (const float *)b->data,
                      (float *)node->data, n);
        else if (a->type == QL_TYPE_BF16)
            QL_LAUNCH(k_swiglu_vec<QL_TYPE_BF16>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const uint16_t *)a->data,
                      (const uint16_t *)b->data, (uint16_t *)node->data, n);
        else
            QL_LAUNCH(k_swiglu_vec<QL_TYPE_F16>, cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const uint16_t *)a->data,
                      (const uint16_t *)b->data, (uint16_t *)node->data, n);
    } else {
        QL_LAUNCH(k_swiglu, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), cu_of(b), (char *)node->data, n);
    }
    CU_LAUNCHED(c);
}
// a norm or SwiGLU with the 8-bit codes of product mm's b (ql_cuda_q8_made_by(node, mm) == qb): left
// in the workspace as mm's own quantisation would leave them (cu_op_q8_made_by)
static void cu_op_q8_norm_swiglu(cu_ctx &c, ql_tensor *node, const ql_tensor *mm, int qb) {
    const int64_t K = node->ne[0], N = node->ne[1];
    size_t off[2];
    CU_ASSERT(ql_cuda_q8_made_by(node, mm) == qb && ql_cuda_mm_q8_layout(N, K, qb, off) <= c.work_size);
    int8_t *q = (int8_t *)c.work;
    float *sd = (float *)(c.work + off[0]);
    int *ss = (int *)(c.work + off[1]);
    if (node->op == QL_OP_RMS_NORM) {
        const ql_tensor *w = node->src[1];
        QL_LAUNCH(k_rms_norm_q8, (unsigned)N, CU_ROW_BLOCK, 0, c.stream, cu_of(node->src[0]), w ? (const float *)w->data : nullptr,
                  (float *)node->data, cu_param<float>(node, 0), qb, q, sd, ss);
    } else {
        QL_LAUNCH(k_swiglu_q8, dim3((unsigned)((K + 256 * Q8_ACT_WARPS - 1) / (256 * Q8_ACT_WARPS)), (unsigned)N), Q8_ACT_WARPS * 32, 0,
                  c.stream, (const float *)node->src[0]->data, (const float *)node->src[1]->data, (float *)node->data, K, qb, q, sd, ss);
    }
    CU_LAUNCHED(c);
}
template <int T, int D> static void cu_launch_swiglu_back_vec(cu_ctx &c, const ql_tensor *node, int64_t n) {
    QL_LAUNCH((k_swiglu_back_vec<T, D>), cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const typename cu_ew<T>::T *)node->src[0]->data,
              (const typename cu_ew<T>::T *)node->src[1]->data, (const float *)node->src[2]->data, (typename cu_ew<D>::T *)node->data, n);
}
template <int T> static void cu_launch_swiglu_back_vec_to(cu_ctx &c, const ql_tensor *node, int64_t n) {
    if (node->type == QL_TYPE_F32) cu_launch_swiglu_back_vec<T, QL_TYPE_F32>(c, node, n);
    else if (node->type == QL_TYPE_BF16) cu_launch_swiglu_back_vec<T, QL_TYPE_BF16>(c, node, n);
    else cu_launch_swiglu_back_vec<T, QL_TYPE_F16>(c, node, n);
}
static void cu_op_swiglu_back(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0], *b = node->src[1], *dy = node->src[2];
    const int64_t n = ql_nelements(a);
    const size_t ds = node->type == QL_TYPE_F32 ? 4 : 2;
    CU_ASSERT(is_float_type_cu(node->type) && ql_is_contiguous(node));
    if (cu_ew_fast(cu_vec_ok(a) && cu_vec_ok(b) && cu_vec_ok(dy) && cu_vec_ok(node) && ((uintptr_t)node->data + n * ds) % 16 == 0)) {
        if (a->type == QL_TYPE_F32) cu_launch_swiglu_back_vec_to<QL_TYPE_F32>(c, node, n);
        else if (a->type == QL_TYPE_BF16) cu_launch_swiglu_back_vec_to<QL_TYPE_BF16>(c, node, n);
        else cu_launch_swiglu_back_vec_to<QL_TYPE_F16>(c, node, n);
    } else {
        QL_LAUNCH(k_swiglu_back, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), cu_of(b), cu_of(dy), (char *)node->data, (int)node->type, n);
    }
    CU_LAUNCHED(c);
}

// the result in f32, or rounded to bf16 / f16 as it is stored (ql_dropout_to)
// first: the element index of a's first in the tensor it is a piece of (ql_dropout_rows_to)
__global__ void k_dropout(cu_t a, const int32_t *seed, char *d, int d_type, uint32_t stream, uint32_t threshold, float keep_scale,
                          int64_t first, int64_t n) {
    const uint64_t key = ql_dropout_key(seed[0], stream);  // qlora.h: the CPU's mask, bit for bit
    const int ds = d_type == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(i, n) {
        cu_st(d + i * ds, d_type, ql_dropout_hash(key, (uint64_t)(first + i)) >= threshold ? cu_get(a, i) * keep_scale : 0.0f);
    }
}
// k_dropout over contiguous, 16-byte aligned a and d (the element-wise fast paths' vectors, cu_ew),
// the counter stepped by an add (key + QL_DROPOUT_STEP (e + 1), as ql_dropout_hash, without its
// multiply per element): the same mask and values as k_dropout, bit for bit; then the scalar tail
template <int TA, int TD>
__global__ void k_dropout8(const typename cu_ew<TA>::T *a, const int32_t *seed, typename cu_ew<TD>::T *d, uint32_t stream,
                           uint32_t threshold, float keep_scale, int64_t first, int64_t n) {
    const uint64_t key = ql_dropout_key(seed[0], stream);
    CU_VEC_LOOP(v, n) {
        float x[CU_EW_VEC];
        cu_ew<TA>::ld8(a + v * CU_EW_VEC, x);
        uint64_t ctr = key + QL_DROPOUT_STEP * (uint64_t)(first + v * CU_EW_VEC + 1);
QL_UNROLL
        for (int j = 0; j < CU_EW_VEC; j++, ctr += QL_DROPOUT_STEP) x[j] = (uint32_t)(ql_mix64(ctr) >> 32) >= threshold ? x[j] * keep_scale : 0.0f;
        cu_ew<TD>::st8(d + v * CU_EW_VEC, x);
    }
    CU_VEC_TAIL(i, n) cu_ew<TD>::st(d, i, ql_dropout_hash(key, (uint64_t)(first + i)) >= threshold ? cu_ew<TA>::ld(a, i) * keep_scale : 0.0f);
}
template <int TA, int TD> static void cu_launch_dropout8(cu_ctx &c, const ql_tensor *a, ql_tensor *node, const int32_t *seed,
                                                         uint32_t stream, uint32_t thr, float ks, int64_t first, int64_t n) {
    QL_LAUNCH((k_dropout8<TA, TD>), cu_grid_vec(n), CU_BLOCK, 0, c.stream, (const typename cu_ew<TA>::T *)a->data, seed,
              (typename cu_ew<TD>::T *)node->data, stream, thr, ks, first, n);
}
template <int TA> static void cu_launch_dropout8_to(cu_ctx &c, const ql_tensor *a, ql_tensor *node, const int32_t *seed,
                                                    uint32_t stream, uint32_t thr, float ks, int64_t first, int64_t n) {
    if (node->type == QL_TYPE_F32) cu_launch_dropout8<TA, QL_TYPE_F32>(c, a, node, seed, stream, thr, ks, first, n);
    else if (node->type == QL_TYPE_BF16) cu_launch_dropout8<TA, QL_TYPE_BF16>(c, a, node, seed, stream, thr, ks, first, n);
    else cu_launch_dropout8<TA, QL_TYPE_F16>(c, a, node, seed, stream, thr, ks, first, n);
}
static void cu_op_dropout(cu_ctx &c, ql_tensor *node) {
    const int64_t n = ql_nelements(node);
    const ql_tensor *a = node->src[0];
    const cu_drop_args m = cu_drop_of(node);
    const int32_t *seed = m.seed;
    const uint32_t stream = m.stream, thr = m.thr;
    const float ks = m.ks;
    const int64_t first = m.first;
    if (cu_vec_ok(a) && cu_vec_ok(node) && is_float_type_cu(a->type)) {
        if (a->type == QL_TYPE_F32) cu_launch_dropout8_to<QL_TYPE_F32>(c, a, node, seed, stream, thr, ks, first, n);
        else if (a->type == QL_TYPE_BF16) cu_launch_dropout8_to<QL_TYPE_BF16>(c, a, node, seed, stream, thr, ks, first, n);
        else cu_launch_dropout8_to<QL_TYPE_F16>(c, a, node, seed, stream, thr, ks, first, n);
    } else {
        QL_LAUNCH(k_dropout, cu_grid(n), CU_BLOCK, 0, c.stream, cu_of(a), seed, (char *)node->data, (int)node->type, stream, thr, ks, first, n);
    }
    CU_LAUNCHED(c);
}

// a with b added to rows [row0, row0 + nb): over a's storage (in place) only those rows, else every row
__global__ void k_add_rows(const float *a, cu_t b, float *d, int64_t ne0, int64_t row0, int64_t nb, int inplace, int64_t n) {
    CU_GRID_LOOP(k, n) {
        const int64_t i = inplace ? row0 * ne0 + k : k, r = i / ne0;
        d[i] = r >= row0 && r < row0 + nb ? a[i] + cu_at(b, i - row0 * ne0) : a[i];
    }
}
static void cu_op_add_rows(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const int inplace = node->data == a->data;
    const int64_t n = inplace ? ql_nelements(b) : ql_nelements(node);
    QL_LAUNCH(k_add_rows, cu_grid(n), CU_BLOCK, 0, c.stream, (const float *)a->data, cu_of(b), (float *)node->data, node->ne[0],
              cu_param<int64_t>(node, 0), ql_nrows(b), inplace, n);
    CU_LAUNCHED(c);
}

// ---- rope ----
// One thread per (token, rotated pair): its angle once (in double, as the CPU), then every head.
// a: f32, or 16-bit (rope of q, k under a 16-bit compute type: widened as read); d of type dt: a's,
// or a 16-bit rope_back of f32 a (q's, k's gradients as their multiplies read them); a 16-bit d
// the f32 result rounded once on store, as the CPU; d contiguous [D, H, T, B].
// a2, d2 (d2 non-null): a second tensor rotated by the same launch, at the same positions (q's and
// k's rotations, ql_cuda_rope_pair): its heads after a's, each thread its (token, pair) in both.
// kc.data non-null (decode, ql_cuda_rope_store; d2 f32): the second's rotated pairs also into the
// keys' cache at row *at + t (f16: cf16), and nv more threads store the values vs into vc as
// k_cache_store's would (the values' store joined too; nv 0: not)
__device__ __forceinline__ void cu_rope_heads(const cu_t &a, char *d, int dt, int64_t tok, int64_t t, int64_t bb, int64_t i0, int64_t other,
                                              float cs, float sn, const cu_t &kc, bool store = false, bool cf16 = false, int32_t at = 0) {
    const int64_t D = a.ne[0], H = a.ne[1];
    const int es = a.type == QL_TYPE_F32 ? 4 : 2, ed = dt == QL_TYPE_F32 ? 4 : 2;
    for (int64_t h = 0; h < H; h++) {
        const char *x = a.data + h * a.nb[1] + t * a.nb[2] + bb * a.nb[3];
        char *y = d + (tok * H + h) * D * ed;
        const float x0 = cu_ld(x + i0 * es, a.type), x1 = cu_ld(x + (i0 + other) * es, a.type);
        float y0, y1;
        cu_rope_rot(x0, x1, cs, sn, &y0, &y1);
        cu_st(y + i0 * ed, dt, y0);
        cu_st(y + (i0 + other) * ed, dt, y1);
        if (store) {  // (dt f32: the values the store would read back)
            cu_cache_put(kc, cf16, at, i0, t, h, bb, y0);
            cu_cache_put(kc, cf16, at, i0 + other, t, h, bb, y1);
        }
    }
}
// cast_src, cast_d: nc elements of cast_src cast to cast_d's type cdt (ql_cuda_cast_rope: k_cont's bits), or nc 0
__global__ void k_rope(cu_t a, const int32_t *pos, const float *ff, char *d, int dt, int n_dims, int mode, float base, int back, int64_t n_tok,
                       cu_t a2, char *d2, int dt2, cu_t kc, cu_t vc, cu_t vs, const int32_t *at, int64_t nv, int cf16, cu_t cast_src,
                       char *cast_d, int cdt, int64_t nc) {
    const int hp = n_dims / 2;  // rotated pairs
    const int64_t T = a.ne[2];
    CU_GRID_LOOP(j, nc) cu_st(cast_d + j * (cdt == QL_TYPE_F32 ? 4 : 2), cdt, cu_get(cast_src, j));  // (each thread its share first)
    if (nv) {
        const int32_t row = *at;
        CU_GRID_LOOP(j, nv) {  // the values' store: each thread its share, then its share of the rotations
            const int64_t i0 = j % vs.ne[0], r = j / vs.ne[0], i1 = r % vs.ne[1], i2 = (r / vs.ne[1]) % vs.ne[2], i3 = r / (vs.ne[1] * vs.ne[2]);
            cu_cache_put(vc, cf16, row, i0, i1, i2, i3, *(const float *)(vs.data + i0 * vs.nb[0] + i1 * vs.nb[1] + i2 * vs.nb[2] + i3 * vs.nb[3]));
        }
    }
    const int32_t krow = kc.data ? *at : 0;
    CU_GRID_LOOP(j, n_tok * hp) {
        const int64_t tok = j / hp, t = tok % T, bb = tok / T;
        const int i = (int)(j % hp);
        float cs, sn;
        cu_rope_cs(i, n_dims, base, ff, pos[tok], back, &cs, &sn);
        const int64_t i0 = mode == QL_ROPE_NEOX ? i : 2 * i, other = mode == QL_ROPE_NEOX ? hp : 1;
        cu_rope_heads(a, d, dt, tok, t, bb, i0, other, cs, sn, kc);
        if (d2) cu_rope_heads(a2, d2, dt2, tok, t, bb, i0, other, cs, sn, kc, kc.data != nullptr, cf16 != 0, krow);
    }
}
// the dimensions past n_dims pass through (the bytes where d has a's type, else rounded as stored)
__global__ void k_rope_tail(cu_t a, char *d, int dt, int n_dims, int64_t n_rows) {
    const int64_t D = a.ne[0], tail = D - n_dims;
    const int es = a.type == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(j, n_rows * tail) {
        const int64_t row = j / tail, i = n_dims + j % tail;  // row = tok * H + h
        const int64_t h = row % a.ne[1], tok = row / a.ne[1], t = tok % a.ne[2], bb = tok / a.ne[2];
        const char *x = a.data + i * es + h * a.nb[1] + t * a.nb[2] + bb * a.nb[3];
        if (dt != a.type) cu_st(d + (row * D + i) * 2, dt, *(const float *)x);  // (f32 a, 16-bit d)
        else if (es == 4) *(float *)(d + (row * D + i) * 4) = *(const float *)x;
        else *(uint16_t *)(d + (row * D + i) * 2) = *(const uint16_t *)x;
    }
}
// node2: a second rotation made by the same launch (ql_cuda_rope_pair), else NULL; ks, vs: decode's
// keys' store of node2's result (ql_cuda_rope_store) and the values' (a store pair with ks), or NULL;
// cast: NULL, or the node before, a cast the launch writes too (ql_cuda_cast_rope)
static void cu_op_rope(cu_ctx &c, ql_tensor *node, bool back, ql_tensor *node2 = nullptr, const ql_tensor *ks = nullptr,
                       const ql_tensor *vs = nullptr, ql_tensor *cast = nullptr) {
    const ql_tensor *a = node->src[0], *ff = node->src[2];
    const int n_dims = node->op_params[0], mode = node->op_params[1];
    const int64_t n_tok = a->ne[2] * a->ne[3];
    CU_ASSERT(!node2 || (ql_cuda_rope_pair(node, node2) && n_dims == a->ne[0]));
    CU_ASSERT(!ks || (node2 && ql_cuda_rope_store(node2, ks) && (!vs || ql_cuda_cache_store_pair(ks, vs))));
    CU_ASSERT(!cast || (ql_cuda_cast_rope(cast, node) && !ks));
    const int64_t nv = vs ? ql_nelements(vs->src[1]) : 0, nc = cast ? ql_nelements(cast) : 0;
    const cu_t none = cu_of(a), kc = ks ? cu_of(ks) : cu_t{};
    QL_LAUNCH(k_rope, cu_grid(nc + nv + n_tok * (n_dims / 2)), CU_BLOCK, 0, c.stream, cu_of(a), (const int32_t *)node->src[1]->data,
              ff ? (const float *)ff->data : (const float *)nullptr, (char *)node->data, (int)node->type, n_dims, mode, cu_param<float>(node, 2),
              (int)back, n_tok, node2 ? cu_of(node2->src[0]) : cu_of(a), node2 ? (char *)node2->data : (char *)nullptr,
              node2 ? (int)node2->type : 0, kc, vs ? cu_of(vs) : none, vs ? cu_of(vs->src[1]) : none,
              ks ? (const int32_t *)ks->src[2]->data : (const int32_t *)nullptr, nv, ks && ks->type == QL_TYPE_F16 ? 1 : 0,
              cast ? cu_of(cast->src[0]) : none, cast ? (char *)cast->data : (char *)nullptr, cast ? (int)cast->type : 0, nc);
    CU_LAUNCHED(c);
    if (n_dims < a->ne[0]) {
        CU_ASSERT(!cast);  // (ql_cuda_cast_rope: one launch)
        const int64_t rows = n_tok * a->ne[1];
        QL_LAUNCH(k_rope_tail, cu_grid(rows * (a->ne[0] - n_dims)), CU_BLOCK, 0, c.stream, cu_of(a), (char *)node->data, (int)node->type, n_dims, rows);
        CU_LAUNCHED(c);
    }
}

// ---- cross entropy ----
// Per row (a block): logsumexp and the row's loss into the side data; then one block sums the
// losses in row order (in double, as the CPU) and divides by the run-time count.
#define CU_CE_BLOCK 1024  // the loss runs over chunks of few rows (64 tokens) of long rows (the vocabulary): wide blocks
__global__ void __launch_bounds__(CU_CE_BLOCK) k_ce_rows(cu_t lg, const int32_t *tg, float *lse, float *loss) {
    __shared__ float sh[32];
    const int64_t V = lg.ne[0], r = blockIdx.x;
    const int32_t t = tg[r];
    const float *x = (const float *)cu_row(lg, r);
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, x[i]);
    m = cu_block_max(m, sh);
    float s = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s += expf(x[i] - m);
    s = cu_block_sum(s, sh);
    if (threadIdx.x == 0) {
        const bool ignored = t < 0;
        lse[r] = ignored ? 0.0f : m + logf(s);
        // a target outside the vocabulary: NaN (the CPU backend names it)
        loss[r] = ignored ? 0.0f : t < V ? lse[r] - x[t] : NAN;
    }
}
__global__ void k_ce_total(const float *loss, int64_t n, const float *count, float *d) {
    __shared__ double sh[32];
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += loss[i];
    s = cu_block_sum_d(s, sh);
    if (threadIdx.x == 0) *d = *count > 0.0f ? (float)(s / *count) : NAN;
}
static void cu_op_cross_entropy(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *lg = node->src[0];
    const int64_t N = cu_nrows(lg);
    float *lse = (float *)((char *)node->data + ql_nbytes(node)), *loss = lse + N;
    QL_LAUNCH(k_ce_rows, (unsigned)N, CU_CE_BLOCK, 0, c.stream, cu_of(lg), (const int32_t *)node->src[1]->data, lse, loss);
    CU_LAUNCHED(c);
    QL_LAUNCH(k_ce_total, 1, 1024, 0, c.stream, (const float *)loss, N, (const float *)node->src[2]->data, (float *)node->data);
    CU_LAUNCHED(c);
}

// d = (softmax(x) - onehot(t)) dy / count, zero for ignored rows
// d in d_type: f32, or 16 bits (ql_cross_entropy_back_to: the f32 value rounded once on store)
__global__ void __launch_bounds__(CU_CE_BLOCK) k_ce_back(cu_t lg, const int32_t *tg, const float *lse, const float *dy, const float *count,
                                                          char *d, int d_type) {
    const int64_t V = lg.ne[0], r = blockIdx.x;
    const int32_t t = tg[r];
    const float *x = (const float *)cu_row(lg, r);
    const float scale = *dy / *count, l = lse[r];
    const int es = d_type == QL_TYPE_F32 ? 4 : 2;
    char *o = d + r * V * es;
    const bool ignored = t < 0 || t >= V;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
        cu_st(o + i * es, d_type, ignored ? 0.0f : expf(x[i] - l) * scale - (i == t ? scale : 0.0f));
}
static void cu_op_cross_entropy_back(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *lg = node->src[0], *fwd = node->src[3];
    const float *lse = (const float *)((const char *)fwd->data + ql_nbytes(fwd));
    QL_LAUNCH(k_ce_back, (unsigned)cu_nrows(lg), CU_CE_BLOCK, 0, c.stream, cu_of(lg), (const int32_t *)node->src[1]->data, lse,
              (const float *)node->src[4]->data, (const float *)node->src[2]->data, (char *)node->data, (int)node->type);
    CU_LAUNCHED(c);
}

// ---- what runs: exactly the layouts these kernels read ----

static bool cu_ops_supported(const ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    auto f32 = [](const ql_tensor *t) { return !t || t->type == QL_TYPE_F32; };
    auto dense_rows = [](const ql_tensor *t) { return t->type == QL_TYPE_F32 && ql_rows_contiguous(t); };
    switch (node->op) {
    case QL_OP_NONE: case QL_OP_VIEW: case QL_OP_RESHAPE: case QL_OP_PERMUTE: case QL_OP_TRANSPOSE: case QL_OP_WITH_GRAD:
        return true;
    case QL_OP_FILL:
        return node->type == QL_TYPE_F32;
    case QL_OP_CONT:
        return (is_float_type_cu(a->type) && is_float_type_cu(node->type)) || (a->type == QL_TYPE_I32 && node->type == QL_TYPE_I32);
    case QL_OP_ADD: case QL_OP_MUL:
        return f32(a) && f32(node->src[1]) && node->type == QL_TYPE_F32;
    case QL_OP_SCALE:  // f32, or a 16-bit result (ql_scale_to)
        return f32(a) && is_float_type_cu(node->type);
    case QL_OP_SUM: case QL_OP_REDUCE_TO: case QL_OP_SILU:
        return f32(a) && node->type == QL_TYPE_F32;
    case QL_OP_DROPOUT:
        return is_float_type_cu(a->type) && is_float_type_cu(node->type);
    case QL_OP_SILU_BACK:
        return f32(a) && f32(node->src[1]);
    case QL_OP_SWIGLU:  // f32, or 16-bit a, b and result
        return is_float_type_cu(a->type) && node->src[1]->type == a->type && node->type == a->type && ql_is_contiguous(node);
    case QL_OP_SWIGLU_BACK:  // the result f32, or 16-bit (autodiff's cast folded in)
        return is_float_type_cu(a->type) && node->src[1]->type == a->type && f32(node->src[2]) && is_float_type_cu(node->type);
    case QL_OP_ACC_GRAD:
        return f32(node) && f32(node->src[1]) && ql_is_contiguous(node);
    case QL_OP_CACHE_STORE:  // an f32 or f16 cache, f32 rows
        return (f32(node) || node->type == QL_TYPE_F16) && f32(node->src[1]) && ql_is_contiguous(node);
    case QL_OP_VIEW_BACK:
        return f32(a) && ql_is_contiguous(node);
    case QL_OP_ADD_ROWS:
        return f32(a) && f32(node->src[1]) && ql_is_contiguous(a);
    case QL_OP_GET_ROWS: {
        const ql_type_traits *t = ql_type_traits_get(a->type);
        switch (a->type) {
        case QL_TYPE_F32: case QL_TYPE_F16: case QL_TYPE_BF16:
            return ql_rows_contiguous(a) && a->ne[2] == 1 && a->ne[3] == 1;
        case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: case QL_TYPE_Q4_0: case QL_TYPE_Q8_0: case QL_TYPE_Q4_K: case QL_TYPE_Q5_K: case QL_TYPE_Q6_K:
        case QL_TYPE_Q4_1: case QL_TYPE_Q5_0: case QL_TYPE_Q5_1: case QL_TYPE_Q2_K: case QL_TYPE_Q3_K: case QL_TYPE_IQ4_NL: case QL_TYPE_IQ4_XS:
            return t && ql_is_contiguous(a) && !a->view_src && a->ne[2] == 1 && a->ne[3] == 1;  // side data after the rows
        default:
            return false;
        }
    }
    case QL_OP_GET_ROWS_BACK:
        return dense_rows(a) && ql_is_contiguous(node);
    case QL_OP_RMS_NORM:  // (a weight: contiguous f32 [ne0]; the result f32 or 16-bit)
        return dense_rows(a) && (!node->src[1] || (f32(node->src[1]) && ql_is_contiguous(node->src[1]))) && is_float_type_cu(node->type);
    case QL_OP_RMS_NORM_BACK:
        return dense_rows(a) && dense_rows(node->src[1]) && (!node->src[2] || (f32(node->src[2]) && ql_is_contiguous(node->src[2]))) &&
               (!node->src[3] || (f32(node->src[3]) && ql_is_contiguous(node->src[3])));
    case QL_OP_ROPE: case QL_OP_ROPE_BACK:  // rope: f32 or 16-bit a, the result in a's type; rope_back: f32 a, also a 16-bit result
        return is_float_type_cu(a->type) && ql_rows_contiguous(a) && is_float_type_cu(node->type) &&
               (node->type == a->type || (node->op == QL_OP_ROPE_BACK && a->type == QL_TYPE_F32)) && ql_is_contiguous(node) &&
               (!node->src[2] || ql_is_contiguous(node->src[2]));
    case QL_OP_CROSS_ENTROPY:
        return dense_rows(a);
    case QL_OP_CROSS_ENTROPY_BACK:
        return dense_rows(a) && ql_is_contiguous(node) && is_float_type_cu(node->type);
    case QL_OP_TO_HOST: case QL_OP_TO_DEVICE:  // one copy of the bytes (cuda_graph_compute, on the copy stream)
        return ql_is_contiguous(node) && ql_is_contiguous(a) && node->type == a->type;
    default:
        return false;
    }
}

// ---- the optimizer and gradient statistics (between graph runs) ----

__constant__ float cu_map_signed[256];
__constant__ float cu_map_unsigned[256];

// AdamW on f32 moments, element i: ql_adamw_update's expressions, each rounding explicit (no
// fused multiply-add), so the update is the CPU's bits
__device__ __forceinline__ void cu_adamw_elem(float *w, float *m, float *v, const float *g, int64_t i, float b1, float b2,
                                              float step_size, float eps, float decay, float gscale) {
    const float gi = __fmul_rn(g[i], gscale);
    m[i] = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(1.0f - b1, gi));
    v[i] = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(1.0f - b2, gi), gi));
    w[i] = __fsub_rn(__fmul_rn(w[i], decay), __fdiv_rn(__fmul_rn(step_size, m[i]), __fadd_rn(sqrtf(v[i]), eps)));
}
__global__ void k_adamw(float *w, float *m, float *v, const float *g, int64_t n, float b1, float b2, float step_size, float eps,
                        float decay, float gscale) {
    CU_GRID_LOOP(i, n) cu_adamw_elem(w, m, v, g, i, b1, b2, step_size, eps, decay, gscale);
}

// 8-bit AdamW of block b (QL_OPT8_BLOCK elements, one a thread; the last block of n partial):
// ql_adamw8bit_update's expressions. Every thread of the block calls it.
__device__ __forceinline__ void cu_adamw8_block(float *w, uint8_t *qm, float *am, uint8_t *qv, float *av, const float *g, int64_t n,
                                                int64_t b, float b1, float b2, float step_size, float eps, float decay, float gscale,
                                                float *sh, char *w16 = nullptr, int w16_type = 0) {
    const int64_t i = b * QL_OPT8_BLOCK + threadIdx.x;
    const bool in = i < n;
    float mi = 0, vi = 0;
    if (in) {
        const float gi = __fmul_rn(g[i], gscale);
        mi = __fmul_rn(cu_map_signed[qm[i]], am[b]);
        vi = __fmul_rn(cu_map_unsigned[qv[i]], av[b]);
        if (isfinite(gi)) {
            mi = __fadd_rn(__fmul_rn(b1, mi), __fmul_rn(1.0f - b1, gi));
            vi = __fadd_rn(__fmul_rn(b2, vi), __fmul_rn(__fmul_rn(1.0f - b2, gi), gi));
            const float wi = __fsub_rn(w[i], __fdiv_rn(__fmul_rn(step_size, mi), __fadd_rn(sqrtf(vi), eps)));
            w[i] = __fmul_rn(wi, decay);  // decoupled decay after the update, as bitsandbytes
        } else {
            mi = vi = 0.0f;
        }
        if (w16) cu_st(w16 + i * 2, w16_type, w[i]);  // the parameter's copy: k_convert_2d's rounding
    }
    const float mx_m = cu_block_max(fabsf(mi), sh), mx_v = cu_block_max(vi, sh);
    if (threadIdx.x == 0) {
        am[b] = mx_m;
        av[b] = mx_v;
    }
    if (in) {
        const float im = mx_m > 0 ? 1.0f / mx_m : 0.0f, iv = mx_v > 0 ? 1.0f / mx_v : 0.0f;
        qm[i] = ql_dynamic_quantize_inline(cu_map_signed, __fmul_rn(mi, im));
        qv[i] = ql_dynamic_quantize_inline(cu_map_unsigned, __fmul_rn(vi, iv));
    }
}
__global__ void __launch_bounds__(QL_OPT8_BLOCK) k_adamw8(float *w, uint8_t *qm, float *am, uint8_t *qv, float *av, const float *g, int64_t n,
                                                        float b1, float b2, float step_size, float eps, float decay, float gscale) {
    __shared__ float sh[32];
    cu_adamw8_block(w, qm, am, qv, av, g, n, blockIdx.x, b1, b2, step_size, eps, decay, gscale, sh);
}

// Adam's bias corrections folded into the step size (ql_adamw_update's)
struct cu_adam_consts {
    float step_size, eps, decay;
};
static cu_adam_consts cu_adam_consts_of(const ql_adamw_params *p, int64_t step) {
    const double bc1 = 1.0 - std::pow((double)p->beta1, (double)step), bc2 = 1.0 - std::pow((double)p->beta2, (double)step);
    return {(float)(p->lr * std::sqrt(bc2) / bc1), (float)(p->eps * std::sqrt(bc2)), 1.0f - p->lr * p->weight_decay};
}

// the 8-bit maps into constant memory, once per process
static void cu_opt8_maps(cu_ctx &c) {
    static std::once_flag maps;
    static cudaError_t maps_err = cudaSuccess;
    std::call_once(maps, [] {
        maps_err = cudaMemcpyToSymbol(cu_map_signed, ql_dynamic_map_signed(), 256 * sizeof(float));
        if (maps_err == cudaSuccess) maps_err = cudaMemcpyToSymbol(cu_map_unsigned, ql_dynamic_map_unsigned(), 256 * sizeof(float));
    });
    CU_CHECK(c, maps_err);
}

static void cu_adamw_update(cu_ctx &c, ql_tensor *param, ql_tensor *m, ql_tensor *v, ql_tensor *m_absmax, ql_tensor *v_absmax, int64_t step,
                            const ql_adamw_params *p, float grad_scale) {
    CU_ASSERT(param->type == QL_TYPE_F32 && param->grad && ql_is_contiguous(param) && step >= 1);
    const int64_t n = ql_nelements(param);
    const cu_adam_consts k = cu_adam_consts_of(p, step);
    if (!m_absmax) {
        QL_LAUNCH(k_adamw, cu_grid(n), CU_BLOCK, 0, c.stream, (float *)param->data, (float *)m->data, (float *)v->data,
                  (const float *)param->grad->data, n, p->beta1, p->beta2, k.step_size, k.eps, k.decay, grad_scale);
        CU_LAUNCHED(c);
        return;
    }
    cu_opt8_maps(c);
    if (c.failed) return;
    const int64_t nb = (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
    QL_LAUNCH(k_adamw8, (unsigned)nb, QL_OPT8_BLOCK, 0, c.stream, (float *)param->data, (uint8_t *)m->data, (float *)m_absmax->data,
              (uint8_t *)v->data, (float *)v_absmax->data, (const float *)param->grad->data, n, p->beta1, p->beta2, k.step_size, k.eps,
              k.decay, grad_scale);
    CU_LAUNCHED(c);
}

// sum of squares in double and the count of non-finite elements, one block: deterministic
__global__ void k_grad_stats(const float *x, int64_t n, double *out) {
    __shared__ double sh[32];
    double s = 0, bad = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        if (isfinite(v)) s += (double)v * v;
        else bad += 1;
    }
    s = cu_block_sum_d(s, sh);
    bad = cu_block_sum_d(bad, sh);
    if (threadIdx.x == 0) {
        out[0] = s;
        out[1] = bad;
    }
}

// ---- the same over a list of groups (ql_optim_list): one launch each ----

// The statistics of every group's gradient: up to QL_OPT_STATS_BLOCKS blocks of QL_OPT8_BLOCK threads,
// block b summing chunks b, b + gridDim.x, ... (one element a thread; double) into its partial,
// the last block to finish summing the partials in block order into result {sumsq, non-finite
// count} and setting the count of blocks done back to 0. Every order is fixed: the same bits at
// every run. desc: [n_groups]; part: [2 * gridDim.x]; result: [2].
__global__ void __launch_bounds__(QL_OPT8_BLOCK) k_grad_stats_multi(const ql_optim_desc *desc, int n_groups, int64_t n_chunks,
                                                                  double *part, double *result, unsigned *done) {
    __shared__ double sh[32];
    __shared__ bool last;
    double s = 0, bad = 0;
    int k = 0;  // the group of chunk c: chunks rise, so the group only moves forward
    for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        while (k + 1 < n_groups && desc[k + 1].chunk0 <= c) k++;
        const int64_t i = (c - desc[k].chunk0) * QL_OPT8_BLOCK + threadIdx.x;
        if (i < desc[k].n) {
            const float v = desc[k].g[i];
            if (isfinite(v)) s += (double)v * v;
            else bad += 1;
        }
    }
    s = cu_block_sum_d(s, sh);
    bad = cu_block_sum_d(bad, sh);
    if (threadIdx.x == 0) {
        part[2 * blockIdx.x] = s;
        part[2 * blockIdx.x + 1] = bad;
        __threadfence();  // the partial visible before the count says so
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const volatile double *vp = part;  // written by other blocks: past this block's L1
    s = 0, bad = 0;
    for (unsigned j = threadIdx.x; j < gridDim.x; j += blockDim.x) {
        s += vp[2 * j];
        bad += vp[2 * j + 1];
    }
    s = cu_block_sum_d(s, sh);
    bad = cu_block_sum_d(bad, sh);
    if (threadIdx.x == 0) {
        result[0] = s;
        result[1] = bad;
        *done = 0;  // ready for the next launch
    }
}

// One AdamW step of every group, block c updating chunk c (of QL_OPT8_BLOCK elements, one a
// thread) of its group, f32 or 8-bit, and the parameter's 16-bit copy where it has one (its
// products then read no f32 factor). The gradient factor (unscale, clip) comes from the
// statistics in result, on the device; a non-finite element anywhere skips the whole step.
__global__ void __launch_bounds__(QL_OPT8_BLOCK) k_adamw_multi(const ql_optim_desc *desc, int n_groups, const double *result,
                                                             float b1, float b2, float step_size, float eps, float decay,
                                                             double loss_scale, float max_norm) {
    __shared__ float sh[32];
    const double sq = result[0];
    if (result[1] != 0 || !isfinite(sq)) return;  // the same for every block: no update at all
    const float gscale = ql_optim_grad_factor(sq, loss_scale, max_norm);
    const int64_t c = blockIdx.x;
    int lo = 0, hi = n_groups - 1;  // the last group starting at or before chunk c
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (desc[mid].chunk0 <= c) lo = mid;
        else hi = mid - 1;
    }
    const ql_optim_desc d = desc[lo];
    if (!d.m_absmax) {
        const int64_t i = (c - d.chunk0) * QL_OPT8_BLOCK + threadIdx.x;
        if (i >= d.n) return;
        cu_adamw_elem(d.w, (float *)d.m, (float *)d.v, d.g, i, b1, b2, step_size, eps, decay, gscale);
        if (d.w16) cu_st((char *)d.w16 + i * 2, (int)d.w16_type, d.w[i]);  // the parameter's copy: k_convert_2d's rounding
        return;
    }
    cu_adamw8_block(d.w, (uint8_t *)d.m, d.m_absmax, (uint8_t *)d.v, d.v_absmax, d.g, d.n, c - d.chunk0, b1, b2, step_size, eps, decay,
                    gscale, sh, (char *)d.w16, (int)d.w16_type);
}

static void cu_grad_stats_multi_launch(cu_ctx &c, const ql_optim_list *l) {
    CU_ASSERT(l->store && l->n_chunks < ((int64_t)1 << 31));
    // at most QL_OPT_STATS_BLOCKS blocks, no more than there are chunks: the order is the list's own
    const unsigned blocks = (unsigned)std::max<int64_t>(1, std::min<int64_t>(QL_OPT_STATS_BLOCKS, l->n_chunks));
    QL_LAUNCH(k_grad_stats_multi, blocks, QL_OPT8_BLOCK, 0, c.stream, (const ql_optim_desc *)l->store, l->n, l->n_chunks,
              (double *)(l->store + ql_optim_store_partials(l->n)), (double *)(l->store + ql_optim_store_result(l->n)),
              (unsigned *)(l->store + ql_optim_store_counter(l->n)));
    CU_LAUNCHED(c);
}

// ============================================================================================
// 7. attention
// ============================================================================================

// Two ways. Over a KV cache (inference, Tk read at run time): one fused kernel, FlashAttention-2
// in plain CUDA - scores through shared memory a warp at a time (lane j holds key j of a 32-key
// tile), online softmax. Everything else (training, perplexity): cuBLAS products over chunks of
// queries, on tensor cores in bf16 when the attention asks for it (ql_flash_attn_set_prec) -
// per chunk of queries i0 .. i0 + nq and every (batch, kv head) at once:
//   S = scale K^T Q [keys, rep nq]  (only keys some query of the chunk may see: jend)
//   P = softmax(S) by columns, masked (causal, documents); O = V P
// backward, P recomputed from S and the forward's logsumexp:
//   dP = V^T dO, dS = P (dP - delta), dV += dO P^T, dK += scale Q dS^T, dQ = scale K dS
// q, k, v and dO are packed per (batch, kv head) in the compute type first, so each product is one
// strided-batched GEMM; the layout is qlora.cpp's ql_cuda_fa_layout (the device plan's too).

#define FA_WARPS 4                   // warps per block of the fused kernel
#define FA_BK 32                     // keys per tile: one per lane
#define FA_BQ 8                      // queries per block (FA_BQ / FA_WARPS per warp)

struct fa_args {
    cu_t q, k, v;       // q [d, Tq, H, B], k [d, Tk, Hkv, B], v [dv, Tk, Hkv, B]
    const int32_t *seg; // [Tk, B] or NULL
    const int32_t *nkv; // KV cache: the keys in use, read on the device; or NULL
    float scale;
};

__device__ __forceinline__ const float *fa_row(const cu_t &t, int64_t i, int64_t h, int64_t b) {
    return (const float *)(t.data + i * t.nb[1] + h * t.nb[2] + b * t.nb[3]);
}
// may query i (at key position i + off) see key j?
__device__ __forceinline__ bool fa_visible(const int32_t *seg, int64_t i, int64_t j, int64_t off, int64_t Tk, int64_t b) {
    return j <= i + off && (!seg || seg[b * Tk + j] == seg[b * Tk + i + off]);
}
__device__ __forceinline__ float fa_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ __forceinline__ float fa_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
// element c of a KV cache's row (i, h, b) as f32: KT float, or uint16_t for an f16 cache (widened
// as loaded; the sums stay f32)
template <typename KT> __device__ __forceinline__ float fa_kv(const cu_t &t, int64_t i, int64_t h, int64_t b, int64_t c) {
    const KT x = ((const KT *)(t.data + i * t.nb[1] + h * t.nb[2] + b * t.nb[3]))[c];
    if constexpr (sizeof(KT) == 4) return x;
    else return cu_h2f(x);
}
// rows [j0, j0 + n) of k (or v) of head hk into shared memory as f32, `ld` floats apart; zeros past n
template <typename KT>
__device__ __forceinline__ void fa_load(float *dst, int ld, const cu_t &t, int64_t j0, int n, int rows, int64_t hk, int64_t b) {
    const int64_t D = t.ne[0];
    for (int x = threadIdx.x; x < rows * D; x += blockDim.x) {
        const int r = x / (int)D, c = x % (int)D;
        dst[r * ld + c] = r < n ? fa_kv<KT>(t, j0 + r, hk, b, c) : 0.0f;
    }
}

// the fused forward over a KV cache (KT: its element, float or f16's uint16_t): block (head, query
// tile, batch), every head's last (longest) query tiles first, as k_fa2_fwd's
template <typename KT> __global__ void __launch_bounds__(FA_WARPS * 32) k_fa_fwd(fa_args a, float *out, float *lse) {
    const int64_t D = a.q.ne[0], Tq = a.q.ne[1], H = a.q.ne[2], DV = a.v.ne[0], Hkv = a.k.ne[2];
    const int64_t h = blockIdx.x, b = blockIdx.z, hk = h / (H / Hkv), i0 = (int64_t)(gridDim.y - 1 - blockIdx.y) * FA_BQ;
    const int nq = (int)min((int64_t)FA_BQ, Tq - i0), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t Tk = a.k.ne[1];
    bool bad = false;
    if (a.nkv) {
        const int64_t n = *a.nkv;
        bad = n < Tq || n > Tk;  // the CPU backend reports it; here the rows become NaN
        Tk = bad ? Tq : n;
    }
    const int64_t off = Tk - Tq;
    QL_DYN_SMEM(float, sm);
    float *Q = sm, *K = Q + FA_BQ * D, *V = K + FA_BK * (D + 1), *P = V + FA_BK * (DV + 1), *O = P + FA_BQ * FA_BK;
    float *M = O + FA_BQ * DV, *L = M + FA_BQ;
    for (int x = threadIdx.x; x < FA_BQ * D; x += blockDim.x) {
        const int r = x / (int)D;
        Q[x] = r < nq ? fa_row(a.q, i0 + r, h, b)[x % D] : 0.0f;
    }
    for (int x = threadIdx.x; x < FA_BQ * DV; x += blockDim.x) O[x] = 0.0f;
    if (threadIdx.x < FA_BQ) M[threadIdx.x] = -INFINITY, L[threadIdx.x] = 0.0f;
    const int64_t jend = min(Tk, i0 + nq + off);
    for (int64_t j0 = 0; j0 < jend; j0 += FA_BK) {
        const int bk = (int)min((int64_t)FA_BK, jend - j0);
        __syncthreads();  // the previous tile is no longer read
        fa_load<KT>(K, (int)D + 1, a.k, j0, bk, FA_BK, hk, b);
        fa_load<KT>(V, (int)DV + 1, a.v, j0, bk, FA_BK, hk, b);
        __syncthreads();
        for (int qi = warp; qi < nq; qi += FA_WARPS) {  // warp-uniform
            const int64_t i = i0 + qi, j = j0 + lane;
            const bool vis = lane < bk && fa_visible(a.seg, i, j, off, Tk, b);
            float s = -INFINITY;
            if (vis) {
                float acc = 0;
                for (int64_t c = 0; c < D; c++) acc += Q[qi * D + c] * K[lane * (D + 1) + c];
                s = acc * a.scale;
            }
            const float mx = fa_warp_max(s);
            if (mx == -INFINITY) continue;  // the whole warp: nothing visible in this tile
            const float mold = M[qi], mnew = fmaxf(mold, mx), alpha = expf(mold - mnew);
            const float p = vis ? expf(s - mnew) : 0.0f;
            const float psum = fa_warp_sum(p);
            P[qi * FA_BK + lane] = p;
            __syncwarp();
            for (int64_t c = lane; c < DV; c += 32) {
                float acc = O[qi * DV + c] * alpha;
                for (int jj = 0; jj < bk; jj++) acc += P[qi * FA_BK + jj] * V[jj * (DV + 1) + c];
                O[qi * DV + c] = acc;
            }
            __syncwarp();  // every lane read M[qi] and P before they change
            if (lane == 0) {
                M[qi] = mnew;
                L[qi] = L[qi] * alpha + psum;
            }
            __syncwarp();
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < nq * DV; x += blockDim.x) {
        const int qi = x / (int)DV;
        const int64_t i = i0 + qi;
        out[((b * Tq + i) * H + h) * DV + x % DV] = bad ? NAN : O[x] / L[qi];
    }
    if ((int)threadIdx.x < nq) lse[(b * H + h) * Tq + i0 + threadIdx.x] = bad ? NAN : M[threadIdx.x] + logf(L[threadIdx.x]);
}

// Decode (a few queries over a KV cache): a block per (query, head, batch), its warps taking
// every FD_WARPS-th key, each warp FD_KEYS keys' rows loaded before it uses them - a lane holds
// elements lane + 32 t of q, of the keys' and values' rows and of its running output; q.k summed
// by shuffles, online softmax per warp, the warps' (max, sum, output) met in shared memory at
// the end. k_fa_fwd's tiles through shared memory had one warp of four computing for a single
// query: 57 us a layer at the 8B shape on the H200 (13% of a token). An f16 cache (KT uint16_t):
// a lane holds pairs instead, elements 64 (t / 2) + 2 lane + t % 2, each pair one 4-byte load.
#define FD_WARPS 8
#define FD_KEYS 2
#define FD_MAXC 8  // D, DV <= 32 FD_MAXC
#define FD_MAX_TQ 8
// the row element slot t of a lane holds (a bijection of [0, 32 FD_MAXC) for each KT)
template <typename KT> __device__ __forceinline__ int fd_col(int lane, int t) {
    return sizeof(KT) == 4 ? lane + 32 * t : 64 * (t >> 1) + 2 * lane + (t & 1);
}
// a lane's slots of a cache row's first n elements into r (zeros past n), widened to f32
template <typename KT> __device__ __forceinline__ void fd_load(float r[FD_MAXC], const cu_t &t, int64_t j, int64_t hk, int64_t b, int64_t n, int lane) {
    const KT *p = (const KT *)(t.data + j * t.nb[1] + hk * t.nb[2] + b * t.nb[3]);
    if constexpr (sizeof(KT) == 4) {
QL_UNROLL
        for (int s = 0; s < FD_MAXC; s++) r[s] = lane + 32 * s < n ? p[lane + 32 * s] : 0.0f;
    } else {
QL_UNROLL
        for (int s = 0; s < FD_MAXC; s += 2) {
            const int c = fd_col<KT>(lane, s);
            if (c + 1 < n && (uintptr_t)(p + c) % 4 == 0) {  // (rows of an odd length: not 4-byte aligned)
                const uint32_t w = *(const uint32_t *)(p + c);
                r[s] = cu_h2f((uint16_t)(w & 0xffff)), r[s + 1] = cu_h2f((uint16_t)(w >> 16));
            } else {
                r[s] = c < n ? cu_h2f(p[c]) : 0.0f, r[s + 1] = c + 1 < n ? cu_h2f(p[c + 1]) : 0.0f;
            }
        }
    }
}
#define QL_CUDA_Q8_COUNTER0 256   // the backend's scratch ints from here: decode's counters (QL_CUDA_Q8_COUNTERS)
// q8 non-null (ql_cuda_q8_made_by: one query, the o projection's codes in blocks of qb): after its
// head's output, the block that finishes a group of qb / DV heads (or each of its head's DV / qb
// blocks) quantises the group's elements as k_q8_act would (cu_q8_act8, the values read back from
// out). The group's heads count themselves in cnt[group] (zero before; set back to 0 by the last)
template <typename KT>
__global__ void __launch_bounds__(FD_WARPS * 32) k_fa_decode(fa_args a, float *out, float *lse, int8_t *q8, float *q8d, int *q8s, int qb,
                                                             unsigned *cnt) {
    __shared__ float sm_m[FD_WARPS], sm_l[FD_WARPS], sm_o[FD_WARPS][32 * FD_MAXC];
    const int64_t D = a.q.ne[0], Tq = a.q.ne[1], H = a.q.ne[2], DV = a.v.ne[0], Hkv = a.k.ne[2];
    const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hkv);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t Tk = a.k.ne[1];
    bool bad = false;
    if (a.nkv) {  // as k_fa_fwd
        const int64_t n = *a.nkv;
        bad = n < Tq || n > Tk;
        Tk = bad ? Tq : n;
    }
    const int64_t off = Tk - Tq, jend = min(Tk, i + 1 + off);
    float q[FD_MAXC], o[FD_MAXC];
    const float *qr = fa_row(a.q, i, h, b);
QL_UNROLL
    for (int t = 0; t < FD_MAXC; t++) q[t] = fd_col<KT>(lane, t) < D ? qr[fd_col<KT>(lane, t)] : 0.0f, o[t] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int64_t j0 = warp; j0 < jend; j0 += FD_WARPS * FD_KEYS) {  // warp-uniform
        float kr[FD_KEYS][FD_MAXC], vr[FD_KEYS][FD_MAXC];
QL_UNROLL
        for (int u = 0; u < FD_KEYS; u++) {  // the rows' loads first (past jend: row j0 again, not used)
            const int64_t j = j0 + u * FD_WARPS < jend ? j0 + u * FD_WARPS : j0;
            fd_load<KT>(kr[u], a.k, j, hk, b, D, lane);
            fd_load<KT>(vr[u], a.v, j, hk, b, DV, lane);
        }
QL_UNROLL
        for (int u = 0; u < FD_KEYS; u++) {
            const int64_t j = j0 + u * FD_WARPS;
            float s = 0.0f;
QL_UNROLL
            for (int t = 0; t < FD_MAXC; t++) s += q[t] * kr[u][t];
            s = fa_warp_sum(s) * a.scale;
            if (j >= jend || !fa_visible(a.seg, i, j, off, Tk, b)) continue;  // warp-uniform
            const float mnew = fmaxf(m, s), alpha = expf(m - mnew), p = expf(s - mnew);
            l = l * alpha + p;
QL_UNROLL
            for (int t = 0; t < FD_MAXC; t++) o[t] = o[t] * alpha + p * vr[u][t];
            m = mnew;
        }
    }
    if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
QL_UNROLL
    for (int t = 0; t < FD_MAXC; t++) sm_o[warp][fd_col<KT>(lane, t)] = o[t];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f;  // (no key visible: M = -inf, L = 0, the row 0 / 0 = NaN, as k_fa_fwd's)
    for (int w = 0; w < FD_WARPS; w++) L += sm_m[w] == -INFINITY ? 0.0f : sm_l[w] * expf(sm_m[w] - M);
    for (int64_t c = threadIdx.x; c < DV; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < FD_WARPS; w++) acc += sm_m[w] == -INFINITY ? 0.0f : sm_o[w][c] * expf(sm_m[w] - M);
        out[((b * Tq + i) * H + h) * DV + c] = bad ? NAN : acc / L;
    }
    if (threadIdx.x == 0) lse[(b * H + h) * Tq + i] = bad ? NAN : M + logf(L);
    if (!q8) return;
    __shared__ bool last;
    const int64_t K = H * DV, hpb = qb > DV ? qb / DV : 1, grp = h / hpb;  // heads a block spans; this head's group
    __syncthreads();  // (the head's output written by every thread)
    if (threadIdx.x == 0) {
        __threadfence();  // this head's output visible before the count says so
        last = hpb == 1 || atomicAdd(cnt + grp, 1u) == (unsigned)hpb - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const volatile float *vo = out;  // written by other blocks: past this block's L1
    const int64_t e0 = grp * hpb * DV, e1 = e0 + hpb * DV;
    for (int64_t c0 = e0 + warp * 256; c0 < e1; c0 += FD_WARPS * 256) {  // warp-uniform: a warp 256 elements, a lane 8
        const int64_t e = c0 + lane * 8;
        const bool in = e < e1;
        float v8[8];
QL_UNROLL
        for (int u = 0; u < 8; u++) v8[u] = in ? vo[e + u] : 0.0f;
        cu_q8_act8(v8, in, 0, K, e, qb, q8, q8d, q8s);
    }
    if (threadIdx.x == 0 && hpb > 1) cnt[grp] = 0;  // ready for the next launch
}

static size_t fa_fwd_smem(int64_t D, int64_t DV) {
    return (size_t)(FA_BQ * D + FA_BK * (D + 1) + FA_BK * (DV + 1) + FA_BQ * FA_BK + FA_BQ * DV + 2 * FA_BQ) * sizeof(float);
}

// ---- attention as products ----

// rows [i0, i0 + n) of t [E, T, Hx, B] (f32 or 16-bit, dense rows, any strides) -> dst [E, n, Hx, B] in type ct:
// per (batch, kv head) the rep = H / Hkv query heads of the group are adjacent, so a group's
// columns (head r, query i) are one matrix [E, rep n]. Two tensors a launch (K and V; a chunk's
// Q and dO), the second's elements after the first's; dst1 NULL: one. Backward also unpacks the
// chunk before's dq (k_fa_unpack's [E, Tq, H, B] f32, E = t0's): usrc [E, un, H, B] -> udst rows
// [ui0, ui0 + un) - its product's result, read before this chunk's product writes it again
__global__ void k_fa_pack(cu_t t0, char *dst0, cu_t t1, char *dst1, int64_t i0, int64_t n, int ct, const float *usrc, int64_t un,
                          int64_t ui0, float *udst) {
    const int64_t total0 = t0.ne[0] * n * t0.ne[2] * t0.ne[3], total1 = dst1 ? t1.ne[0] * n * t1.ne[2] * t1.ne[3] : 0;
    const int64_t packed = total0 + total1, E0 = t0.ne[0], Tq = t0.ne[1];
    const int es = ct == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(y, packed + E0 * un * t0.ne[2] * t0.ne[3]) {
        if (y >= packed) {  // the unpack
            const int64_t x = y - packed, c = x % E0, i = (x / E0) % un, bh = x / (E0 * un);
            udst[(bh * Tq + ui0 + i) * E0 + c] = usrc[x];
            continue;
        }
        const bool second = y >= total0;  // (field by field: a reference to either parameter would copy both to the stack)
        const int64_t x = second ? y - total0 : y, E = second ? t1.ne[0] : t0.ne[0], Hx = second ? t1.ne[2] : t0.ne[2];
        const int64_t c = x % E, i = (x / E) % n, hb = x / (E * n), h = hb % Hx, b = hb / Hx;
        const int64_t off = c * (second ? t1.nb[0] : t0.nb[0]) + (i0 + i) * (second ? t1.nb[1] : t0.nb[1]) +
                            h * (second ? t1.nb[2] : t0.nb[2]) + b * (second ? t1.nb[3] : t0.nb[3]);
        cu_st((second ? dst1 : dst0) + x * es, ct, cu_ld((second ? t1.data : t0.data) + off, second ? t1.type : t0.type));
    }
}

// the chunk's columns back into an output laid out [E, H, Tq, B] (attention, in its type dt: f32,
// or 16-bit rounded once) or [E, Tq, H, B] (dq, f32)
__global__ void k_fa_unpack(const float *src, int64_t E, int64_t n, int64_t H, int64_t B, int64_t i0, int64_t Tq, int heads_inner,
                            char *dst, int dt) {
    const int es = dt == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(x, E * n * H * B) {
        const int64_t c = x % E, i = (x / E) % n, bh = x / (E * n), h = bh % H, b = bh / H;
        cu_st(dst + ((heads_inner ? (b * Tq + i0 + i) * H + h : bh * Tq + i0 + i) * E + c) * es, dt, src[x]);
    }
}

// forward: one block per column of S (a query of a head; column x = (b H + h) n + i - i0):
// the visible keys' softmax -> P (in the compute type; over S in f32), and the logsumexp
__global__ void __launch_bounds__(CU_ROW_BLOCK) k_fa_softmax(float *S, char *P, int pt, int64_t jend, int64_t n, int64_t i0, int64_t Tq,
                                                             int64_t Tk, const int32_t *seg, int64_t H, float *lse) {
    __shared__ float sh[32];
    const int64_t x = blockIdx.x, i = i0 + x % n, bh = x / n, b = bh / H, off = Tk - Tq;
    const float *s = S + x * jend;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < jend; j += blockDim.x)
        if (fa_visible(seg, i, j, off, Tk, b)) m = fmaxf(m, s[j]);
    m = cu_block_max(m, sh);
    float l = 0;
    for (int64_t j = threadIdx.x; j < jend; j += blockDim.x)
        if (fa_visible(seg, i, j, off, Tk, b)) l += expf(s[j] - m);
    l = cu_block_sum(l, sh);
    const float inv = 1.0f / l;
    const int es = pt == QL_TYPE_F32 ? 4 : 2;
    for (int64_t j = threadIdx.x; j < jend; j += blockDim.x) {
        const float p = fa_visible(seg, i, j, off, Tk, b) ? expf(s[j] - m) * inv : 0.0f;
        cu_st(P + (x * jend + j) * es, pt, p);  // f32: P is S, each element read before it is written
    }
    if (threadIdx.x == 0) lse[bh * Tq + i] = m + logf(l);
}

// backward: p = exp(s - lse) where visible, ds = p (dp - delta) -> P, dS (over S and dP in f32);
// element y = x jend + j: key j of column x = (b H + h) n + i - i0
__global__ void k_fa_ds(const float *S, const float *dP, char *P, char *dS, int pt, int64_t jend, int64_t n, int64_t ncols, int64_t i0,
                        int64_t Tq, int64_t Tk, const int32_t *seg, int64_t H, const float *lse, const float *delta) {
    const int es = pt == QL_TYPE_F32 ? 4 : 2;
    const int64_t off = Tk - Tq;
    CU_GRID_LOOP(y, jend * ncols) {
        const int64_t x = y / jend, j = y % jend, i = i0 + x % n, bh = x / n, b = bh / H;
        float p = 0.0f, ds = 0.0f;
        if (fa_visible(seg, i, j, off, Tk, b)) {
            p = expf(S[y] - lse[bh * Tq + i]);
            ds = p * (dP[y] - delta[bh * Tq + i]);
        }
        cu_st(P + y * es, pt, p);  // f32: over S and dP, each element read before it is written
        cu_st(dS + y * es, pt, ds);
    }
}

// delta_i = dO_i . O_i, per (query, head, batch); dO (dt) and O (ot) f32 or 16-bit
// d16 (the fused backward's): dO rounded to the compute type ct as well, for its kernels' 16-byte tile copies
// zero [nz] (the products' backward): dK and dV, which its chunks add up, set to 0 in the same launch
__global__ void k_fa_delta(const char *dO, int dt, const char *O, int ot, int64_t DV, int64_t H, int64_t Tq, int64_t n, float *delta,
                           char *d16, int ct, float *zero, int64_t nz) {
    CU_GRID_LOOP(z, nz) zero[z] = 0.0f;
    const int es = ot == QL_TYPE_F32 ? 4 : 2, ds = dt == QL_TYPE_F32 ? 4 : 2;
    CU_GRID_LOOP(x, n) {  // x = (b H + h) Tq + i
        const int64_t i = x % Tq, h = (x / Tq) % H, b = x / (Tq * H), row = ((b * Tq + i) * H + h) * DV;
        float s = 0;
        for (int64_t c = 0; c < DV; c++) {
            const float d = cu_ld(dO + (row + c) * ds, dt);
            s += d * cu_ld(O + (row + c) * es, ot);
            if (d16) cu_st(d16 + (row + c) * 2, ct, d);
        }
        delta[x] = s;
    }
}

static fa_args fa_args_of(const ql_tensor *node) {
    fa_args a;
    a.q = cu_of(node->src[0]);
    a.k = cu_of(node->src[1]);
    a.v = cu_of(node->src[2]);
    a.seg = node->src[3] ? (const int32_t *)node->src[3]->data : nullptr;
    a.nkv = node->op == QL_OP_FLASH_ATTN && node->src[4] ? (const int32_t *)node->src[4]->data : nullptr;
    a.scale = cu_param<float>(node, 0);
    return a;
}

static int cu_cc(const cu_ctx &c);

// both directions: the products above, chunk by chunk
static void cu_fa_gemm(cu_ctx &c, ql_tensor *node) {
    const bool back = node->op == QL_OP_FLASH_ATTN_BACK;
    const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
    const int64_t D = q->ne[0], Tq = q->ne[1], H = q->ne[2], B = q->ne[3], Tk = k->ne[1], Hkv = k->ne[2], DV = v->ne[0];
    const int64_t rep = H / Hkv, G = Hkv * B, off = Tk - Tq;
    const fa_args a = fa_args_of(node);
    size_t o[QL_CUDA_FA_NBUF];
    int64_t chunk;
    ql_type ct;
    const size_t need = ql_cuda_fa_layout(node, cu_cc(c), o, &chunk, &ct);
    CU_ASSERT(c.work_size >= need);
    const size_t es = ql_plain_size(ct);
    char *W = (char *)c.work;
    char *Kw = W + o[QL_CUDA_FA_K], *Vw = W + o[QL_CUDA_FA_V], *Qw = W + o[QL_CUDA_FA_Q], *dOw = W + o[QL_CUDA_FA_DO];
    float *S = (float *)(W + o[QL_CUDA_FA_S]), *dP = (float *)(W + o[QL_CUDA_FA_DP]), *Ow = (float *)(W + o[QL_CUDA_FA_OUT]);
    char *P = es == 4 ? (char *)S : W + o[QL_CUDA_FA_P], *dS = es == 4 ? (char *)dP : W + o[QL_CUDA_FA_DS];
    float *delta = (float *)(W + o[QL_CUDA_FA_DELTA]);
    const ql_tensor *fwd = back ? node->src[4] : node, *dOt = back ? node->src[5] : nullptr;
    const float *lse_in = (const float *)((const char *)fwd->data + ql_nbytes(fwd));
    float *out = (float *)node->data, *lse = back ? nullptr : (float *)((char *)node->data + ql_nbytes(node));  // (out: dq's f32 in backward)
    float *dq = out, *dk = dq + ql_nelements(q), *dv = dk + ql_nelements(k);
    cu_t dOv{};  // dO [DV, H, Tq, B] seen as [DV, Tq, H, B]
    if (back) {
        dOv = cu_of(dOt);
        dOv.ne[1] = Tq, dOv.ne[2] = H, dOv.contig = 0;
        const int64_t ds = (int64_t)ql_plain_size(dOt->type);  // f32 or 16-bit
        dOv.nb[1] = H * DV * ds, dOv.nb[2] = DV * ds;
        const int64_t nz = ql_nelements(k) + ql_nelements(v);  // dK, dV add up over the chunks: zeroed here
        QL_LAUNCH(k_fa_delta, cu_grid(std::max(Tq * H * B, nz / 8)), CU_BLOCK, 0, c.stream, (const char *)dOt->data, (int)dOt->type,
                  (const char *)fwd->data, (int)fwd->type, DV, H, Tq, Tq * H * B, delta, nullptr, (int)QL_TYPE_BF16, dk, nz);
        CU_LAUNCHED(c);
    }
    // K and V packed [D, Tk] per group, or read in place (a kv head's rows Hkv D apart, the heads D apart)
    const bool direct = ql_cuda_fa_kv_direct(node, ct);
    if (direct) {
        Kw = (char *)k->data;
        Vw = (char *)v->data;
    } else {
        QL_LAUNCH(k_fa_pack, cu_grid((D + DV) * Tk * G), CU_BLOCK, 0, c.stream, a.k, Kw, a.v, Vw, (int64_t)0, Tk, (int)ct,
                  (const float *)nullptr, (int64_t)0, (int64_t)0, (float *)nullptr);
        CU_LAUNCHED(c);
    }
    const int64_t ldk = direct ? Hkv * D : D, ldv = direct ? Hkv * DV : DV, sK = direct ? D : D * Tk, sV = direct ? DV : DV * Tk;
    int64_t un = 0, ui0 = 0;  // backward: the chunk whose dq is still in Ow, unpacked by the next pack
    const cu_operand Kn{Kw, CUBLAS_OP_N, ldk, true}, Kt{Kw, CUBLAS_OP_T, ldk, true};
    const cu_operand Vn{Vw, CUBLAS_OP_N, ldv, true}, Vt{Vw, CUBLAS_OP_T, ldv, true};
    for (int64_t i0 = 0; i0 < Tq; i0 += chunk) {
        const int64_t n = std::min(chunk, Tq - i0), cols = rep * n, jend = std::min(Tk, i0 + n + off);
        const int64_t sS = jend * cols;  // per (batch, kv head)
        // Q's chunk (and backward's dO's, [DV, H, Tq, B] seen as [DV, Tq, H, B]) packed; the chunk before's dq unpacked
        QL_LAUNCH(k_fa_pack, cu_grid((D + (back ? DV : 0)) * n * H * B + D * un * H * B), CU_BLOCK, 0, c.stream, a.q, Qw, dOv,
                  back ? dOw : nullptr, i0, n, (int)ct, (const float *)Ow, un, ui0, dq);
        CU_LAUNCHED(c);
        // S = scale K^T Q: [jend, cols] per group
        cu_gemm(c, ct, Kt, sK, cu_operand{Qw, CUBLAS_OP_N, D, true}, D * cols, S, jend, sS, jend, cols, D, (int)G, 0.0f, a.scale);
        if (c.failed) return;
        if (!back) {
            QL_LAUNCH(k_fa_softmax, (unsigned)(n * H * B), CU_ROW_BLOCK, 0, c.stream, S, P, (int)ct, jend, n, i0, Tq, Tk, a.seg, H, lse);
            CU_LAUNCHED(c);
            // O = V P: [DV, cols] per group
            cu_gemm(c, ct, Vn, sV, cu_operand{P, CUBLAS_OP_N, jend, true}, sS, Ow, DV, DV * cols, DV, cols, jend, (int)G, 0.0f);
            if (c.failed) return;
            QL_LAUNCH(k_fa_unpack, cu_grid(DV * n * H * B), CU_BLOCK, 0, c.stream, Ow, DV, n, H, B, i0, Tq, 1, (char *)node->data,
                      (int)node->type);
            CU_LAUNCHED(c);
            continue;
        }
        const cu_operand dOn{dOw, CUBLAS_OP_N, DV, true}, Qn{Qw, CUBLAS_OP_N, D, true};
        // dP = V^T dO: [jend, cols]
        cu_gemm(c, ct, Vt, sV, dOn, DV * cols, dP, jend, sS, jend, cols, DV, (int)G, 0.0f);
        if (c.failed) return;
        QL_LAUNCH(k_fa_ds, cu_grid(jend * n * H * B), CU_BLOCK, 0, c.stream, S, dP, P, dS, (int)ct, jend, n, n * H * B, i0, Tq, Tk,
                  a.seg, H, lse_in, delta);
        CU_LAUNCHED(c);
        // dV += dO P^T: [DV, jend]; dK += scale Q dS^T: [D, jend]; dQ = scale K dS: [D, cols]
        cu_gemm(c, ct, dOn, DV * cols, cu_operand{P, CUBLAS_OP_T, jend, true}, sS, dv, DV, DV * Tk, DV, jend, cols, (int)G, 1.0f);
        if (c.failed) return;
        cu_gemm(c, ct, Qn, D * cols, cu_operand{dS, CUBLAS_OP_T, jend, true}, sS, dk, D, D * Tk, D, jend, cols, (int)G, 1.0f, a.scale);
        if (c.failed) return;
        cu_gemm(c, ct, Kn, sK, cu_operand{dS, CUBLAS_OP_N, jend, true}, sS, Ow, D, D * cols, D, cols, jend, (int)G, 0.0f, a.scale);
        if (c.failed) return;
        un = n, ui0 = i0;
    }
    if (un) {  // the last chunk's dq
        QL_LAUNCH(k_fa_unpack, cu_grid(D * un * H * B), CU_BLOCK, 0, c.stream, Ow, D, un, H, B, ui0, Tq, 0, (char *)dq, (int)QL_TYPE_F32);
        CU_LAUNCHED(c);
    }
}

// ---- attention on tensor cores: FlashAttention-2 through WMMA (training, 16-bit compute) ----
// The default wherever ql_cuda_fa_fused(node) (qlora.cpp): prec bf16, d == dv in {64, 80, 96, 128}.
// Tiles of q, k, v (and dO) are converted from f32 to the compute type T (bf16 from cc 8.0, fp16
// on 7.5) on their way into shared memory, or copied where they are T already. The register
// path (forward and backward) streams bf16 tiles by asynchronous copies (cp.async through
// cuda_pipeline_primitives.h) into two buffers, so the next tile loads while this one's products
// run; elsewhere no copy/compute overlap beyond what other resident blocks give. Products
// are 16x16x16 WMMA tiles with f32 accumulators. A fragment's element-to-lane mapping is never
// assumed: row-wise softmax goes through shared memory (S stored, processed by lanes, P loaded
// as a matrix_a fragment), and the one per-row operation on register fragments (O's rescale)
// looks each element's row up in `rid`, an accumulator fragment loaded from a table of row numbers
// (fragments of one type share one mapping). Scores are kept in log2 units: s2 = scale log2(e) q.k.
//   forward: block = 64 queries of one head (16 per warp); key tiles of 64; online softmax.
//   backward, deterministic, no atomics: delta = rowsum(dO O) first (k_fa_delta), then
//     k_fa2_dkv: block = 16 NW keys of one kv head, over the query heads of its group (or of a
//              slice of them: ql_cuda_fa2_kv_split) and every query tile that can see them:
//              dV += P^T dO, dK += dS^T Q (scale at the end); a slice's into its partial;
//     k_fa2_dq:  block = 16 NW queries of one head, over their key tiles: dQ += dS K; with
//              slices, the blocks past the heads sum the partials in slice order.
// Causal tiles no query of the block may see are not visited; with documents (seg), neither are
// tiles whose segment ranges do not meet; tiles every query sees entirely skip the mask.
#ifdef QL_CUDA_SHIM
#define FA2_UNROLL
#define FA2_NO_UNROLL
#else
#define FA2_NO_UNROLL _Pragma("unroll 1")
#define FA2_UNROLL _Pragma("unroll")  // fragment arrays stay in registers: every index a constant
#endif
#define FA2_WARPS 4  // forward: warps per block
#define FA2_BQ 64    // forward: queries per block (16 per warp)
#define FA2_BK 64    // forward: keys per tile
#define FA2_PAD 8    // 16-bit elements after each row of a tile in shared memory (bank spread; 16-byte rows)
#define FA2_LOG2E 1.4426950408889634f
#define FA2_LN2 0.6931471805599453f

// the backward's tiles by compute type: NW warps (16 NW keys per dK/dV block, 16 NW queries per
// dQ block), BT queries (dK/dV) or keys (dQ) per inner tile. fp16 is sm_75's, whose blocks get 64 KiB.
template <typename T> struct fa2_back_cfg { static constexpr int NW = 4, BT = 32; };
template <> struct fa2_back_cfg<__half> { static constexpr int NW = 2, BT = 32; };

// each compute type's kernels are built for its architectures only: bf16 from sm_80 (no bf16 WMMA
// before), fp16 below (ql_cuda_fa_layout picks bf16 wherever it exists); elsewhere empty, never launched
#ifdef __CUDA_ARCH__
#define FA2_ARCH_OK(T) (std::is_same<T, __nv_bfloat16>::value ? __CUDA_ARCH__ >= 800 : __CUDA_ARCH__ < 800)
#else
#define FA2_ARCH_OK(T) true
#endif
template <typename T> __device__ __forceinline__ T fa2_cvt(float v);
template <> __device__ __forceinline__ __nv_bfloat16 fa2_cvt<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half fa2_cvt<__half>(float v) { return __float2half_rn(v); }
__device__ __forceinline__ float fa2_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float fa2_f(__half v) { return __half2float(v); }

// shared memory of each kernel, bytes (host and device agree; the gate below checks the limits)
template <typename T, int D> constexpr size_t fa2_fwd_smem() {
    return (size_t)2 * FA2_BK * (D + FA2_PAD) * sizeof(T) + (size_t)FA2_WARPS * 16 * (FA2_BK + 4) * sizeof(float) +
           (size_t)FA2_WARPS * 16 * (FA2_BK + FA2_PAD) * sizeof(T) + (256 + 3 * FA2_BQ) * sizeof(float);
}
template <typename T, int D, int NB = 1> constexpr size_t fa2_back_smem() {  // both backward kernels: 16 NW rows held, NB x BT streamed
    constexpr int NW = fa2_back_cfg<T>::NW, BT = fa2_back_cfg<T>::BT;
    return (size_t)2 * (16 * NW + NB * BT) * (D + FA2_PAD) * sizeof(T) + (size_t)NW * 16 * (BT + 4) * sizeof(float) +
           (size_t)NW * 16 * (BT + FA2_PAD) * sizeof(T) + 2 * 16 * NW * sizeof(float) + 2 * NB * BT * sizeof(float);
}
// the gate: a block's shared memory within sm_86/89's 99 KiB (bf16, cc >= 8.0) and sm_75's 64 KiB (fp16)
#define FA2_SMEM_OK(D)                                                                                                  \
    static_assert(fa2_fwd_smem<__nv_bfloat16, D>() <= (99u << 10) && fa2_back_smem<__nv_bfloat16, D, 2>() <= (99u << 10) && \
                      fa2_fwd_smem<__half, D>() <= (64u << 10) && fa2_back_smem<__half, D>() <= (64u << 10),        \
                  "fused attention's shared memory above the device limit at head dim " #D)
FA2_SMEM_OK(64);
FA2_SMEM_OK(80);
FA2_SMEM_OK(96);
FA2_SMEM_OK(128);

// rows [0, n) of a matrix with E dense columns of type st (f32, or 16-bit: q, k, v under a 16-bit
// compute type, widened exactly), `rs` bytes apart, into dst [rows][E + FA2_PAD] as T; zeros from n
// to rows. vec: base and rs 16-byte aligned (f32: float4 loads).
template <typename T, int E>
__device__ __forceinline__ void fa2_load(T *dst, const char *base, int64_t rs, int n, int rows, bool vec, int st = QL_TYPE_F32) {
    constexpr int LD = E + FA2_PAD;
    for (int x = threadIdx.x; x < rows * (E / 4); x += blockDim.x) {
        const int r = x / (E / 4), c = x % (E / 4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < n && st != QL_TYPE_F32) {
            const char *p = base + r * rs + c * 2;
            v = make_float4(cu_ld(p, st), cu_ld(p + 2, st), cu_ld(p + 4, st), cu_ld(p + 6, st));
        } else if (r < n) {
            const float *p = (const float *)(base + r * rs) + c;
            if (vec) v = *(const float4 *)p;
            else v = make_float4(p[0], p[1], p[2], p[3]);
        }
        T *d = dst + r * LD + c;
        d[0] = fa2_cvt<T>(v.x), d[1] = fa2_cvt<T>(v.y), d[2] = fa2_cvt<T>(v.z), d[3] = fa2_cvt<T>(v.w);
    }
}
__device__ __forceinline__ bool fa2_aligned(const void *p, int64_t rs) { return ((uintptr_t)p | (uintptr_t)rs) % 16 == 0; }

// rows [0, n) of a 16-bit matrix of T, E dense columns `rs` bytes apart, into dst [rows][E +
// FA2_PAD]: 16-byte copies (base and rs 16-byte aligned); zeros from n to rows
template <typename T, int E> __device__ __forceinline__ void fa2_copy16(T *dst, const char *base, int64_t rs, int n, int rows) {
    constexpr int LD = E + FA2_PAD, V = E / 8;  // 8 elements a copy
    for (int x = threadIdx.x; x < rows * V; x += blockDim.x) {
        const int r = x / V, c = x % V * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < n) v = *(const uint4 *)(base + r * rs + c * 2);
        *(uint4 *)(dst + r * LD + c) = v;
    }
}
// fa2_load, or fa2_copy16 where the source is T already and aligned
template <typename T, int E>
__device__ __forceinline__ void fa2_tile(T *dst, const char *base, int64_t rs, int n, int rows, int st) {
    if (st == QL_TYPE_BF16 && std::is_same<T, __nv_bfloat16>::value && fa2_aligned(base, rs)) fa2_copy16<T, E>(dst, base, rs, n, rows);
    else fa2_load<T, E>(dst, base, rs, n, rows, fa2_aligned(base, rs), st);
}

// The register path's streamed tiles (key tiles for the forward and dQ, query tiles for dK/dV).
// With PIPE (the sources bf16 and 16-byte aligned: the trainer's under bf16) two buffers take
// turns: the next tile's rows travel by asynchronous copies (cp.async) while this tile's products
// run, so a tile's load waits on memory only when the products are shorter than its latency.
// Without PIPE one buffer, loaded between two barriers. The same products in the same order
// either way: the same bits. (Where two buffers halve the tile - dQ at d 128, the 8-warp backward
// at d 96 - a 16-row piece of another document inside a 64-row tile is skipped instead of
// multiplied by a zero P: still the same bits while those rows are finite.)
// rows [0, n) of a bf16 matrix (base and rs 16-byte aligned) into dst [rows][E + FA2_PAD] by
// asynchronous 16-byte copies; rows n.. zeroed by plain stores. They land at the caller's
// __pipeline_wait_prior; other threads see them after the __syncthreads that follows it.
template <typename T, int E> __device__ __forceinline__ void fa2_copy16_async(T *dst, const char *base, int64_t rs, int n, int rows) {
    constexpr int LD = E + FA2_PAD, V = E / 8;
    for (int x = threadIdx.x; x < rows * V; x += blockDim.x) {
        const int r = x / V, c = x % V * 8;
        if (r < n) __pipeline_memcpy_async(dst + r * LD + c, base + r * rs + c * 2, 16);
        else *(uint4 *)(dst + r * LD + c) = make_uint4(0, 0, 0, 0);
    }
}

// the segment ids of positions [p0, p0 + n) of batch b: min and max, the same in every lane
__device__ __forceinline__ void fa2_seg_range(const int32_t *seg, int64_t p0, int n, int *lo, int *hi) {
    int a = INT_MAX, z = INT_MIN;
    for (int r = threadIdx.x % 32; r < n; r += 32) a = min(a, (int)seg[p0 + r]), z = max(z, (int)seg[p0 + r]);
    for (int o = 16; o > 0; o >>= 1) a = min(a, __shfl_xor_sync(0xffffffff, a, o)), z = max(z, __shfl_xor_sync(0xffffffff, z, o));
    *lo = a, *hi = z;
}

// forward: block (head, query tile, batch), the last query tiles (the longest causal rows) of every
// head first (blocks start in order of their index, x fastest: longest first leaves the short ones
// to fill the end, where a head's long tile dispatched last would run alone)
template <typename T, int D>
__global__ void __launch_bounds__(FA2_WARPS * 32, 1) k_fa2_fwd(fa_args a, char *out, float *lse) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    using namespace nvcuda;
    constexpr int LD = D + FA2_PAD, SLD = FA2_BK + 4, PLD = FA2_BK + FA2_PAD, NF = D / 16, NK = FA2_BK / 16;
    const int64_t Tq = a.q.ne[1], H = a.q.ne[2], Tk = a.k.ne[1], Hkv = a.k.ne[2], off = Tk - Tq;
    const int64_t h = blockIdx.x, b = blockIdx.z, hk = (int)h / ((int)H / (int)Hkv), i0 = (int64_t)(gridDim.y - 1 - blockIdx.y) * FA2_BQ;  // (32-bit divisions)
    const int nq = (int)min((int64_t)FA2_BQ, Tq - i0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Ks = (T *)sm, *Vs = Ks + FA2_BK * LD;                      // [FA2_BK][LD] each
    float *S = (float *)(Vs + FA2_BK * LD);                         // [warps][16][SLD]
    T *P = (T *)(S + FA2_WARPS * 16 * SLD);                         // [warps][16][PLD]
    float *rid = (float *)(P + FA2_WARPS * 16 * PLD), *M = rid + 256, *L = M + FA2_BQ, *A = L + FA2_BQ;
    float *Sw = S + warp * 16 * SLD;
    T *Pw = P + warp * 16 * PLD;
    // q's rows through Ks into registers
    const char *qb = a.q.data + i0 * a.q.nb[1] + h * a.q.nb[2] + b * a.q.nb[3];
    fa2_load<T, D>(Ks, qb, a.q.nb[1], nq, FA2_BQ, fa2_aligned(qb, a.q.nb[1]), a.q.type);
    for (int x = threadIdx.x; x < 256; x += blockDim.x) rid[x] = (float)(x / 16);
    if (threadIdx.x < FA2_BQ) M[threadIdx.x] = -INFINITY, L[threadIdx.x] = 0.0f;
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[NF];
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[NF], rowf;
FA2_UNROLL
    for (int f = 0; f < NF; f++) {
        wmma::load_matrix_sync(qf[f], Ks + r0 * LD + f * 16, LD);
        wmma::fill_fragment(o[f], 0.0f);
    }
    wmma::load_matrix_sync(rowf, rid, 16, wmma::mem_row_major);
    int qlo = 0, qhi = 0;
    if (a.seg) fa2_seg_range(a.seg + b * Tk, i0 + off, nq, &qlo, &qhi);
    const char *kb = a.k.data + hk * a.k.nb[2] + b * a.k.nb[3], *vb = a.v.data + hk * a.v.nb[2] + b * a.v.nb[3];
    const bool kvec = fa2_aligned(kb, a.k.nb[1]), vvec = fa2_aligned(vb, a.v.nb[1]);
    const int64_t jend = min(Tk, i0 + nq + off);  // causal: no query of the block sees a key past jend
    for (int64_t j0 = 0; j0 < jend; j0 += FA2_BK) {
        const int nk = (int)min((int64_t)FA2_BK, jend - j0);
        if (a.seg) {  // documents: skip a tile whose segments do not meet the block's (the same answer in every warp)
            int klo, khi;
            fa2_seg_range(a.seg + b * Tk, j0, nk, &klo, &khi);
            if (khi < qlo || klo > qhi) continue;
        }
        __syncthreads();  // the previous tile is no longer read
        fa2_load<T, D>(Ks, kb + j0 * a.k.nb[1], a.k.nb[1], nk, FA2_BK, kvec, a.k.type);
        fa2_load<T, D>(Vs, vb + j0 * a.v.nb[1], a.v.nb[1], nk, FA2_BK, vvec, a.v.type);
        __syncthreads();
        if (j0 > i0 + r0 + 15 + off || r0 >= nq) continue;  // this warp's queries see none of the tile
        const bool full = !a.seg && j0 + FA2_BK - 1 <= i0 + r0 + off;  // every query of the warp sees every key
        // S = Q K^T: [16, FA2_BK] of this warp
FA2_UNROLL
        for (int n = 0; n < NK; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
            wmma::fill_fragment(s, 0.0f);
FA2_UNROLL
            for (int f = 0; f < NF; f++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, Ks + n * 16 * LD + f * 16, LD);
                wmma::mma_sync(s, qf[f], kf, s);
            }
            wmma::store_matrix_sync(Sw + n * 16, s, SLD, wmma::mem_row_major);
        }
        __syncwarp();
        {  // online softmax: two lanes per row, half the tile's keys each
            const int r = lane / 2, c0 = lane % 2 * (FA2_BK / 2);
            const int64_t i = i0 + r0 + r;
            const bool row_ok = r0 + r < nq;
            float *srow = Sw + r * SLD + c0, mx = -INFINITY;  // masked scores over the raw ones, in log2 units
            for (int c = 0; c < FA2_BK / 2; c++) {
                const int64_t j = j0 + c0 + c;
                const bool vis = full || (row_ok && c0 + c < nk && fa_visible(a.seg, i, j, off, Tk, b));
                srow[c] = vis ? srow[c] * sl2 : -INFINITY;
                mx = fmaxf(mx, srow[c]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            const float mo = M[r0 + r], mn = fmaxf(mo, mx), ms = mn == -INFINITY ? 0.0f : mn;
            float sum = 0.0f;
            for (int c = 0; c < FA2_BK / 2; c++) {
                const float p = exp2f(srow[c] - ms);
                Pw[r * PLD + c0 + c] = fa2_cvt<T>(p);
                sum += p;
            }
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            const float alpha = exp2f(mo - ms);
            __syncwarp();  // both lanes of a row have read M
            if (lane % 2 == 0) M[r0 + r] = mn, L[r0 + r] = L[r0 + r] * alpha + sum, A[r0 + r] = alpha;
        }
        __syncwarp();
        // O = alpha O + P V
FA2_UNROLL
        for (int f = 0; f < NF; f++)
FA2_UNROLL
            for (int e = 0; e < o[f].num_elements; e++) o[f].x[e] *= A[r0 + (int)rowf.x[e]];
FA2_UNROLL
        for (int kk = 0; kk < NK; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
            wmma::load_matrix_sync(pf, Pw + kk * 16, PLD);
FA2_UNROLL
            for (int f = 0; f < NF; f++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, Vs + kk * 16 * LD + f * 16, LD);
                wmma::mma_sync(o[f], pf, vf, o[f]);
            }
        }
    }
    __syncwarp();  // every lane has read A
    if (lane < 16) A[r0 + lane] = L[r0 + lane] > 0.0f ? 1.0f / L[r0 + lane] : 0.0f;
    __syncwarp();
    // O / l -> out [D, H, Tq, B] through this warp's S, 4 fragments (64 columns) at a time; lse
FA2_UNROLL
    for (int f = 0; f < NF; f++) {
FA2_UNROLL
        for (int e = 0; e < o[f].num_elements; e++) o[f].x[e] *= A[r0 + (int)rowf.x[e]];
        wmma::store_matrix_sync(Sw + f % 4 * 16, o[f], SLD, wmma::mem_row_major);
        if (f % 4 == 3 || f == NF - 1) {
            const int cols = (f % 4 + 1) * 16;
            __syncwarp();
            for (int x = lane; x < 16 * cols; x += 32) {
                const int r = x / cols, c = x % cols;
                if (r0 + r < nq)  // the output in q's type (16-bit: rounded once)
                    cu_st(out + (((b * Tq + i0 + r0 + r) * H + h) * D + f / 4 * 64 + c) * (a.q.type == QL_TYPE_F32 ? 4 : 2), a.q.type,
                          Sw[r * SLD + c]);
            }
            __syncwarp();
        }
    }
    if (lane < 16 && r0 + lane < nq) lse[(b * H + h) * Tq + i0 + r0 + lane] = M[r0 + lane] * FA2_LN2 + logf(L[r0 + lane]);
    }
}

// a fragment of 16 rows from shared memory times the transpose of BT rows: [16, BT] of f32 into
// Sw (ld BT + 4): Sw = X Y^T, X [16][LD] and Y [BT][LD] both rows of D elements
template <typename T, int D, int BT>
__device__ __forceinline__ void fa2_rows_by_rows(float *Sw, const T *X, const T *Y) {
    using namespace nvcuda;
    constexpr int LD = D + FA2_PAD;
FA2_NO_UNROLL  // (fewer live registers beside the dK, dV accumulators)
    for (int n = 0; n < BT / 16; n++) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
        wmma::fill_fragment(s, 0.0f);
FA2_UNROLL
        for (int f = 0; f < D / 16; f++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> xf;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> yf;
            wmma::load_matrix_sync(xf, X + f * 16, LD);
            wmma::load_matrix_sync(yf, Y + n * 16 * LD + f * 16, LD);
            wmma::mma_sync(s, xf, yf, s);
        }
        wmma::store_matrix_sync(Sw + n * 16, s, BT + 4, wmma::mem_row_major);
    }
}
// acc[D / 16] += Pw [16][BT] (ld BT + FA2_PAD) times Y [BT][LD]
template <typename T, int D, int BT, typename F>
__device__ __forceinline__ void fa2_acc_product(F *acc, const T *Pw, const T *Y) {
    using namespace nvcuda;
    constexpr int LD = D + FA2_PAD;
FA2_NO_UNROLL
    for (int kk = 0; kk < BT / 16; kk++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
        wmma::load_matrix_sync(pf, Pw + kk * 16, BT + FA2_PAD);
FA2_UNROLL
        for (int f = 0; f < D / 16; f++) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> yf;
            wmma::load_matrix_sync(yf, Y + kk * 16 * LD + f * 16, LD);
            wmma::mma_sync(acc[f], pf, yf, acc[f]);
        }
    }
}
// acc[D / 16] (16 rows) * scale -> rows dst + r * D for r < n, through Sw (ld BT + 4), BT columns at a time
template <int D, int BT, typename F>
__device__ __forceinline__ void fa2_store_rows(F *acc, float scale, float *Sw, float *dst, int n) {
    using namespace nvcuda;
    const int lane = threadIdx.x % 32;
    constexpr int G = BT / 16;  // fragments per pass
FA2_UNROLL
    for (int f = 0; f < D / 16; f++) {
FA2_UNROLL
        for (int e = 0; e < acc[f].num_elements; e++) acc[f].x[e] *= scale;
        wmma::store_matrix_sync(Sw + f % G * 16, acc[f], BT + 4, wmma::mem_row_major);
        if (f % G == G - 1 || f == D / 16 - 1) {
            const int cols = (f % G + 1) * 16;
            __syncwarp();
            for (int x = lane; x < 16 * cols; x += 32) {
                const int r = x / cols, c = x % cols;
                if (r < n) dst[(int64_t)r * D + f / G * G * 16 + c] = Sw[r * (BT + 4) + c];
            }
            __syncwarp();
        }
    }
}

// The streamed-tile loop of the register path (and of the d 128 dK/dV kernel), both ways. Tile
// positions t come from advance(t) (false past the last); issue(t, buf) loads tile t into buffer
// buf (with PIPE: starts its copies) and keeps its per-row values in registers; put(buf) stores
// those into shared memory; body(t, buf) computes on a loaded tile. With PIPE tile t + 1 is issued
// before tile t's body runs, and its rows are put after it.
template <bool PIPE, typename P, typename Adv, typename Issue, typename Put, typename Body>
__device__ __forceinline__ void fa2_stream(P t, Adv advance, Issue issue, Put put, Body body) {
    bool have = advance(t);
    if constexpr (PIPE) {
        if (have) issue(t, 0), put(0);
        __pipeline_commit();
    }
    for (int buf = 0; have; buf = PIPE ? buf ^ 1 : 0) {
        P tn = t;
        const bool more = advance(tn);
        if constexpr (PIPE) {
            if (more) issue(tn, buf ^ 1);
            __pipeline_commit();
            __pipeline_wait_prior(1);  // this tile's copies have landed (the next tile's may not have)
            __syncthreads();           // ... every thread's
        } else {
            __syncthreads();  // the previous tile is no longer read
            issue(t, 0), put(0);
            __syncthreads();
        }
        body(t, buf);
        if constexpr (PIPE) {
            if (more) put(buf ^ 1);
            __syncthreads();  // this buffer is read no more: the tile after next is issued into it
        }
        t = tn, have = more;
    }
}
// the key tile after j0 (tiles of BK up to jend) whose documents meet the queries' [qlo, qhi]
// (every thread agrees); false past the last
__device__ __forceinline__ bool fa2_next_ktile(const fa_args &a, int64_t b, int64_t Tk, int64_t jend, int BK, int qlo, int qhi, int64_t &j0) {
    for (;;) {
        if ((j0 += BK) >= jend) return false;
        if (!a.seg) return true;
        int klo, khi;
        fa2_seg_range(a.seg + b * Tk, j0, (int)min((int64_t)BK, jend - j0), &klo, &khi);
        if (!(khi < qlo || klo > qhi)) return true;
    }
}
// dK/dV's tile after t = (query head r of the group, query tile i0): tiles of BT from qstart, the
// first that may see the block's keys, whose documents meet the keys' [klo, khi], heads r up to
// rhi (the end of the block's slice); false past the last
__device__ __forceinline__ bool fa2_next_qtile(const fa_args &a, int b, int Tk, int Tq, int off, int BT, int qstart, int rhi, int klo,
                                               int khi, int2 &t) {
    for (;;) {
        if ((t.y += BT) >= Tq) {
            t.y = qstart;
            if (++t.x >= rhi) return false;
        }
        if (!a.seg) return true;
        int qlo, qhi;
        fa2_seg_range(a.seg + (int64_t)b * Tk, t.y + off, min(BT, Tq - t.y), &qlo, &qhi);
        if (!(khi < qlo || klo > qhi)) return true;
    }
}
// dK/dV by slices of the group's query heads (ql_cuda_fa2_kv_split): with split > 1 the dK/dV kernel's
// block (blockIdx.x = kv head x split + slice) writes its slice's partial dK, dV (the layout of dk
// then dv, n floats) at part + slice n, and the dQ kernel's rows of blocks past its query tiles
// sum the slices in order into out (dk, dv contiguous: the backward's own result)
struct fa2_split {
    float *part;
    float *out;
    int64_t n;
    int split;
};
// the dK/dV block's slice: its kv head, the first and past-the-last query head of the group, and dk,
// dv pointed at its partial when split
__device__ __forceinline__ int fa2_slice(const fa2_split &sp, int rep, int &hk, int &rlo, float *&dk, float *&dv) {
    const int sl = (int)blockIdx.x % sp.split;
    hk = (int)blockIdx.x / sp.split;
    rlo = sl * rep / sp.split;
    if (sp.split > 1) {
        const int64_t vo = dv - dk;
        dk = sp.part + sl * sp.n, dv = dk + vo;
    }
    return (sl + 1) * rep / sp.split;
}
// the dQ kernel's rows of blocks past its query tiles (y >= y0): out = the slices' sum, in slice order
__device__ __forceinline__ void fa2_sum_slices(const fa2_split &sp, int y0) {
    const int64_t nb = (int64_t)(gridDim.y - y0) * gridDim.x * gridDim.z;
    const int64_t id = ((int64_t)(blockIdx.y - y0) * gridDim.z + blockIdx.z) * gridDim.x + blockIdx.x;
    for (int64_t i = id * blockDim.x + threadIdx.x; i < sp.n; i += nb * blockDim.x) {
        float s = sp.part[i];
        for (int j = 1; j < sp.split; j++) s += sp.part[j * sp.n + i];
        sp.out[i] = s;
    }
}
// a dK/dV tile's query row of this thread (threads < BT): lse in log2 units and delta, on their way
// from issue to shared memory
struct fa2_qrow {
    float l = 0.0f, d = 0.0f;
    __device__ __forceinline__ void get(const float *lse, const float *delta, int64_t row0, int nq, int BT) {
        const int x = threadIdx.x;
        if (x < BT) l = x < nq ? lse[row0 + x] * FA2_LOG2E : 0.0f, d = x < nq ? delta[row0 + x] : 0.0f;
    }
    __device__ __forceinline__ void put(float *L, float *Dl, int BT) const {
        if ((int)threadIdx.x < BT) L[threadIdx.x] = l, Dl[threadIdx.x] = d;
    }
};

// dK, dV: block (kv head and slice, 16 NW keys, batch); the slice's query heads, every query tile
// that may see the keys. dk, dv [D, Tk, Hkv, B]; dO [D, H, Tq, B] of type dt (f32 or 16-bit); lse, delta [Tq, H, B].
// PIPE (the register path's choice at d 128: q and dO bf16, aligned): query tiles in two buffers by
// asynchronous copies, as k_fa2_dkv_reg's
template <typename T, int D, bool PIPE = false>
__global__ void __launch_bounds__(fa2_back_cfg<T>::NW * 32, 1)
    k_fa2_dkv(fa_args a, const char *dO, int dt, const float *lse, const float *delta, float *dk, float *dv, fa2_split sp) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    using namespace nvcuda;
    constexpr int NW = fa2_back_cfg<T>::NW, BT = fa2_back_cfg<T>::BT, RK = 16 * NW, LD = D + FA2_PAD, NF = D / 16, NB = PIPE ? 2 : 1;
    constexpr int SLD = BT + 4, PLD = BT + FA2_PAD;
    static_assert(BT <= 32 * NW, "a thread per query row of a tile (its lse and delta)");
    // sizes and positions in 32 bits (row offsets below in 64): fewer registers beside the accumulators
    const int Tq = (int)a.q.ne[1], H = (int)a.q.ne[2], Tk = (int)a.k.ne[1], Hkv = (int)a.k.ne[2], off = Tk - Tq, rep = H / Hkv;
    int hk, rlo;  // (blockIdx.x: kv head and slice; y: keys, the first, busiest, dispatched first across heads)
    const int rhi = fa2_slice(sp, rep, hk, rlo, dk, dv), b = blockIdx.z, j0 = blockIdx.y * RK;
    const int nk = min(RK, Tk - j0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Ks = (T *)sm, *Vs = Ks + RK * LD, *Qb = Vs + RK * LD, *dOb = Qb + NB * BT * LD;  // K, V [RK][LD]; q, dO [NB][BT][LD]
    float *Sw = (float *)(dOb + NB * BT * LD) + warp * 16 * SLD;
    T *Pw = (T *)((float *)(dOb + NB * BT * LD) + NW * 16 * SLD) + warp * 16 * PLD;
    float *Lb = (float *)((T *)((float *)(dOb + NB * BT * LD) + NW * 16 * SLD) + NW * 16 * PLD), *Db = Lb + NB * BT;  // [NB][BT]
    const char *kb = a.k.data + (int64_t)j0 * a.k.nb[1] + hk * a.k.nb[2] + b * a.k.nb[3];
    const char *vb = a.v.data + (int64_t)j0 * a.v.nb[1] + hk * a.v.nb[2] + b * a.v.nb[3];
    fa2_load<T, D>(Ks, kb, a.k.nb[1], nk, RK, fa2_aligned(kb, a.k.nb[1]), a.k.type);
    fa2_load<T, D>(Vs, vb, a.v.nb[1], nk, RK, fa2_aligned(vb, a.v.nb[1]), a.v.type);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dkf[NF], dvf[NF];
FA2_UNROLL
    for (int f = 0; f < NF; f++) wmma::fill_fragment(dkf[f], 0.0f), wmma::fill_fragment(dvf[f], 0.0f);
    int klo = 0, khi = 0;
    if (a.seg) fa2_seg_range(a.seg + (int64_t)b * Tk, j0, nk, &klo, &khi);
    const int qstart = max(0, j0 - off) / BT * BT;  // the first query that may see key j0
    const int64_t es = dt == QL_TYPE_F32 ? 4 : 2, ors = (int64_t)H * D * es;  // dO's element size, row stride
    auto advance = [&](int2 &t) { return fa2_next_qtile(a, b, Tk, Tq, off, BT, qstart, rhi, klo, khi, t); };
    fa2_qrow qrow;  // this thread's query row of the tile on its way
    auto issue = [&](int2 t, int buf) {  // tile t = (r, i0) into buffer buf: q and dO rows; lse, delta into qrow
        const int h = hk * rep + t.x, i0 = t.y, nq = min(BT, Tq - i0);
        const char *qb = a.q.data + h * a.q.nb[2] + b * a.q.nb[3] + (int64_t)i0 * a.q.nb[1];
        const char *ob = dO + ((int64_t)(b * Tq + i0) * H + h) * D * es;
        if constexpr (PIPE) {
            fa2_copy16_async<T, D>(Qb + buf * BT * LD, qb, a.q.nb[1], nq, BT);
            fa2_copy16_async<T, D>(dOb + buf * BT * LD, ob, ors, nq, BT);
        } else {
            fa2_load<T, D>(Qb, qb, a.q.nb[1], nq, BT, fa2_aligned(qb, a.q.nb[1]), a.q.type);
            fa2_load<T, D>(dOb, ob, ors, nq, BT, fa2_aligned(ob, ors), dt);
        }
        qrow.get(lse, delta, (int64_t)(b * H + h) * Tq + i0, nq, BT);
    };
    auto put = [&](int buf) { qrow.put(Lb + buf * BT, Db + buf * BT, BT); };
    fa2_stream<PIPE>(int2{rlo, qstart - BT}, advance, issue, put, [&](int2 t, int buf) {
        const int i0 = t.y;
        const T *Qs = Qb + buf * BT * LD, *dOs = dOb + buf * BT * LD;
        const float *Lr = Lb + buf * BT, *Dr = Db + buf * BT;
        const int nq = min(BT, Tq - i0);
        if (!(r0 >= nk || j0 + r0 > i0 + nq - 1 + off)) {  // some query of the tile sees this warp's keys
            const bool full = !a.seg && nq == BT && r0 + 16 <= nk && j0 + r0 + 15 <= i0 + off;
            // S^T = K Q^T -> P^T (kept in registers for dS, and in Pw for dV)
            fa2_rows_by_rows<T, D, BT>(Sw, Ks + r0 * LD, Qs);
            __syncwarp();
            for (int x = lane; x < 16 * BT; x += 32) {
                const int kr = x / BT, c = x % BT;
                const int j = j0 + r0 + kr, i = i0 + c;
                const bool vis = full || (c < nq && r0 + kr < nk && fa_visible(a.seg, i, j, off, Tk, b));
                Pw[kr * PLD + c] = fa2_cvt<T>(vis ? exp2f(Sw[kr * SLD + c] * sl2 - Lr[c]) : 0.0f);
            }
            __syncwarp();
            fa2_acc_product<T, D, BT>(dvf, Pw, dOs);  // dV += P^T dO
            // dP^T = V dO^T -> dS^T = P^T (dP^T - delta) into Pw
            fa2_rows_by_rows<T, D, BT>(Sw, Vs + r0 * LD, dOs);
            __syncwarp();
            for (int x = lane; x < 16 * BT; x += 32) {  // each lane rewrites the elements it reads
                const int kr = x / BT, c = x % BT;
                Pw[kr * PLD + c] = fa2_cvt<T>(fa2_f(Pw[kr * PLD + c]) * (Sw[kr * SLD + c] - Dr[c]));
            }
            __syncwarp();
            fa2_acc_product<T, D, BT>(dkf, Pw, Qs);  // dK += dS^T Q
        }
    });
    const int64_t row = (int64_t)(b * Hkv + hk) * Tk + j0 + r0;
    const int n = max(0, min(16, nk - r0));
    fa2_store_rows<D, BT>(dkf, a.scale, Sw, dk + row * D, n);
    fa2_store_rows<D, BT>(dvf, 1.0f, Sw, dv + row * D, n);
    }
}

// dQ: block (16 NW queries, head, batch) over the key tiles its queries may see. dq [D, Tq, H, B]
template <typename T, int D>
__global__ void __launch_bounds__(fa2_back_cfg<T>::NW * 32, 1)
    k_fa2_dq(fa_args a, const char *dO, int dt, const float *lse, const float *delta, float *dq, fa2_split sp) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    constexpr int NW = fa2_back_cfg<T>::NW, BT = fa2_back_cfg<T>::BT, RQ = 16 * NW, LD = D + FA2_PAD, NF = D / 16;
    constexpr int SLD = BT + 4, PLD = BT + FA2_PAD;
    const int64_t Tq = a.q.ne[1], H = a.q.ne[2], Tk = a.k.ne[1], Hkv = a.k.ne[2], off = Tk - Tq;
    const int nqb = (int)((Tq + RQ - 1) / RQ);
    if ((int)blockIdx.y >= nqb) return fa2_sum_slices(sp, nqb);  // (the rows past the query tiles: dK, dV's slices summed)
    const int64_t h = blockIdx.x, b = blockIdx.z, hk = (int)h / ((int)H / (int)Hkv), i0 = (int64_t)(nqb - 1 - (int)blockIdx.y) * RQ;
    const int nq = (int)min((int64_t)RQ, Tq - i0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Qs = (T *)sm, *dOs = Qs + RQ * LD, *Ks = dOs + RQ * LD, *Vs = Ks + BT * LD;
    float *Sw = (float *)(Vs + BT * LD) + warp * 16 * SLD;
    T *Pw = (T *)((float *)(Vs + BT * LD) + NW * 16 * SLD) + warp * 16 * PLD;
    float *Lr = (float *)((T *)((float *)(Vs + BT * LD) + NW * 16 * SLD) + NW * 16 * PLD), *Dr = Lr + RQ;
    const char *qb = a.q.data + i0 * a.q.nb[1] + h * a.q.nb[2] + b * a.q.nb[3];
    const int64_t es = dt == QL_TYPE_F32 ? 4 : 2;  // dO [D, H, Tq, B] of type dt
    const char *ob = dO + ((b * Tq + i0) * H + h) * D * es;
    fa2_load<T, D>(Qs, qb, a.q.nb[1], nq, RQ, fa2_aligned(qb, a.q.nb[1]), a.q.type);
    fa2_load<T, D>(dOs, ob, H * D * es, nq, RQ, fa2_aligned(ob, H * D * es), dt);
    for (int x = threadIdx.x; x < RQ; x += blockDim.x) {
        const int64_t row = (b * H + h) * Tq + i0 + x;
        Lr[x] = x < nq ? lse[row] * FA2_LOG2E : 0.0f;
        Dr[x] = x < nq ? delta[row] : 0.0f;
    }
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> dqf[NF];
FA2_UNROLL
    for (int f = 0; f < NF; f++) nvcuda::wmma::fill_fragment(dqf[f], 0.0f);
    int qlo = 0, qhi = 0;
    if (a.seg) fa2_seg_range(a.seg + b * Tk, i0 + off, nq, &qlo, &qhi);
    const char *kb = a.k.data + hk * a.k.nb[2] + b * a.k.nb[3], *vb = a.v.data + hk * a.v.nb[2] + b * a.v.nb[3];
    const bool kvec = fa2_aligned(kb, a.k.nb[1]), vvec = fa2_aligned(vb, a.v.nb[1]);
    const int64_t jend = min(Tk, i0 + nq + off);
    for (int64_t j0 = 0; j0 < jend; j0 += BT) {
        const int nk = (int)min((int64_t)BT, jend - j0);
        if (a.seg) {
            int klo, khi;
            fa2_seg_range(a.seg + b * Tk, j0, nk, &klo, &khi);
            if (khi < qlo || klo > qhi) continue;
        }
        __syncthreads();  // the previous key tile is no longer read
        fa2_load<T, D>(Ks, kb + j0 * a.k.nb[1], a.k.nb[1], nk, BT, kvec, a.k.type);
        fa2_load<T, D>(Vs, vb + j0 * a.v.nb[1], a.v.nb[1], nk, BT, vvec, a.v.type);
        __syncthreads();
        if (j0 > i0 + r0 + 15 + off || r0 >= nq) continue;  // this warp's queries see none of the tile
        const bool full = !a.seg && j0 + BT - 1 <= i0 + r0 + off;
        fa2_rows_by_rows<T, D, BT>(Sw, Qs + r0 * LD, Ks);  // S = Q K^T
        __syncwarp();
        for (int x = lane; x < 16 * BT; x += 32) {  // P, rounded as the dK/dV kernel's
            const int qr = x / BT, c = x % BT;
            const int64_t i = i0 + r0 + qr, j = j0 + c;
            const bool vis = full || (r0 + qr < nq && c < nk && fa_visible(a.seg, i, j, off, Tk, b));
            Pw[qr * PLD + c] = fa2_cvt<T>(vis ? exp2f(Sw[qr * SLD + c] * sl2 - Lr[r0 + qr]) : 0.0f);
        }
        __syncwarp();
        fa2_rows_by_rows<T, D, BT>(Sw, dOs + r0 * LD, Vs);  // dP = dO V^T
        __syncwarp();
        for (int x = lane; x < 16 * BT; x += 32) {
            const int qr = x / BT, c = x % BT;
            Pw[qr * PLD + c] = fa2_cvt<T>(fa2_f(Pw[qr * PLD + c]) * (Sw[qr * SLD + c] - Dr[r0 + qr]));
        }
        __syncwarp();
        fa2_acc_product<T, D, BT>(dqf, Pw, Ks);  // dQ += dS K
    }
    fa2_store_rows<D, BT>(dqf, a.scale, Sw, dq + ((b * H + h) * Tq + i0 + r0) * D, max(0, min(16, nq - r0)));
    }
}

// ---- the register path (bf16, where k_fa2_probe found sm_80's fragment layout) ----
// Scores, probabilities and dS never leave the registers: element i of a 16x16 accumulator or
// matrix_a fragment of lane l sits at row fa2_rr(l, i), column fa2_rc(l, i) - mma.m16n8k16's
// layout, which k_fa2_probe checks on the device once (cuda_backend::fa2_reg) instead of assuming
// it. A row is then held by the 4 lanes of a quad (shuffles over lane bits 0-1), and an
// accumulator's elements are the matrix_a fragment of the same tile: P and dS go from one to the
// other without shared memory. Rounding as the shared-memory path (P and dS rounded to bf16 for
// the products; sums and the softmax state in f32).
__device__ __forceinline__ int fa2_rr(int lane, int i) { return lane / 4 + 8 * (i / 2 % 2); }
__device__ __forceinline__ int fa2_rc(int lane, int i) { return 2 * (lane % 4) + i % 2 + 8 * (i / 4); }
__device__ __forceinline__ float fa2_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}
__device__ __forceinline__ float fa2_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// one warp: *ok = 1 when bf16 16x16 accumulator and matrix_a fragments follow fa2_rr / fa2_rc
template <typename T> __global__ void k_fa2_probe(int *ok) {  // (T: bf16; a template, so the branch below compiles away below sm_80)
    if constexpr (!FA2_ARCH_OK(T)) {
        if (threadIdx.x == 0) *ok = 0;
    } else {
    using namespace nvcuda;
    __shared__ float tf[256];
    __shared__ T tb[256];
    const int lane = threadIdx.x % 32;
    for (int x = lane; x < 256; x += 32) tf[x] = (float)x, tb[x] = __float2bfloat16_rn((float)x);  // 0..255: exact in bf16
    __syncwarp();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> m;
    wmma::load_matrix_sync(c, tf, 16, wmma::mem_row_major);
    wmma::load_matrix_sync(m, tb, 16);
    bool good = c.num_elements == 8 && m.num_elements == 8;
    if (good)
        for (int i = 0; i < 8; i++) {
            const float want = (float)(fa2_rr(lane, i) * 16 + fa2_rc(lane, i));
            good = good && c.x[i % c.num_elements] == want && __bfloat162float(m.x[i % m.num_elements]) == want;
        }
    good = __all_sync(0xffffffff, good);
    if (lane == 0) *ok = good ? 1 : 0;
    }
}

// forward, register path: block (16 NW queries, head, batch), key tiles of FA2_BK; with PIPE (k and
// v bf16, rows 16-byte aligned, and the device's shared memory allowing two buffers) the next key
// tile travels by asynchronous copies while this one's products run - the same bits as one buffer
template <typename T, int D, int NW, bool PIPE>  // (T: bf16)
__global__ void __launch_bounds__(NW * 32, 1) k_fa2_fwd_reg(fa_args a, char *out, float *lse) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    using namespace nvcuda;
    constexpr int LD = D + FA2_PAD, NF = D / 16, NK = FA2_BK / 16, BQ = 16 * NW, NB = PIPE ? 2 : 1;
    constexpr bool QREG = D <= 96;  // q's fragments held in registers; at 128 read from shared memory (no spills)
    static_assert(BQ <= 2 * FA2_BK, "q's tile is loaded through the K and V tiles");
    const int64_t Tq = a.q.ne[1], H = a.q.ne[2], Tk = a.k.ne[1], Hkv = a.k.ne[2], off = Tk - Tq;
    const int64_t h = blockIdx.x, b = blockIdx.z, hk = (int)h / ((int)H / (int)Hkv), i0 = (int64_t)(gridDim.y - 1 - blockIdx.y) * BQ;
    const int nq = (int)min((int64_t)BQ, Tq - i0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Kb = (T *)sm, *Vb = Kb + NB * FA2_BK * LD, *Qs = QREG ? Kb : Vb + NB * FA2_BK * LD;  // K, V [NB][FA2_BK][LD]; q [BQ][LD]
    const char *qb = a.q.data + i0 * a.q.nb[1] + h * a.q.nb[2] + b * a.q.nb[3];
    fa2_tile<T, D>(Qs, qb, a.q.nb[1], nq, BQ, a.q.type);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[QREG ? NF : 1];
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[NF];
FA2_UNROLL
    for (int f = 0; f < NF; f++) {
        if constexpr (QREG) wmma::load_matrix_sync(qf[f], Qs + r0 * LD + f * 16, LD);
        wmma::fill_fragment(o[f], 0.0f);
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows fa2_rr(lane, 0) and + 8: max (log2 units), this lane's part of the sum
    int qlo = 0, qhi = 0;
    if (a.seg) fa2_seg_range(a.seg + b * Tk, i0 + off, nq, &qlo, &qhi);
    const char *kb = a.k.data + hk * a.k.nb[2] + b * a.k.nb[3], *vb = a.v.data + hk * a.v.nb[2] + b * a.v.nb[3];
    const int64_t jend = min(Tk, i0 + nq + off);
    // the key tiles visited, in order, less those whose documents do not meet the queries' (every thread agrees)
    auto advance = [&](int64_t &j0) { return fa2_next_ktile(a, b, Tk, jend, FA2_BK, qlo, qhi, j0); };
    auto issue = [&](int64_t j0, int buf) {  // key tile j0 into buffer buf
        const int nk = (int)min((int64_t)FA2_BK, jend - j0);
        if constexpr (PIPE) {
            fa2_copy16_async<T, D>(Kb + buf * FA2_BK * LD, kb + j0 * a.k.nb[1], a.k.nb[1], nk, FA2_BK);
            fa2_copy16_async<T, D>(Vb + buf * FA2_BK * LD, vb + j0 * a.v.nb[1], a.v.nb[1], nk, FA2_BK);
        } else {
            fa2_tile<T, D>(Kb, kb + j0 * a.k.nb[1], a.k.nb[1], nk, FA2_BK, a.k.type);
            fa2_tile<T, D>(Vb, vb + j0 * a.v.nb[1], a.v.nb[1], nk, FA2_BK, a.v.type);
        }
    };
    if constexpr (PIPE) __syncthreads();  // q (read through the first buffer where QREG) is in every warp's registers
    fa2_stream<PIPE>((int64_t)-FA2_BK, advance, issue, [](int) {}, [&](int64_t j0, int buf) {
        const T *Ks = Kb + buf * FA2_BK * LD, *Vs = Vb + buf * FA2_BK * LD;
        const int nk = (int)min((int64_t)FA2_BK, jend - j0);
        if (!(j0 > i0 + r0 + 15 + off || r0 >= nq)) {  // this warp's queries see some of the tile
            const bool full = !a.seg && j0 + FA2_BK - 1 <= i0 + r0 + off;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s[NK];
FA2_UNROLL
            for (int n = 0; n < NK; n++) {
                wmma::fill_fragment(s[n], 0.0f);
FA2_UNROLL
                for (int f = 0; f < NF; f++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                    wmma::load_matrix_sync(kf, Ks + n * 16 * LD + f * 16, LD);
                    if constexpr (QREG) {
                        wmma::mma_sync(s[n], qf[f], kf, s[n]);
                    } else {
                        wmma::load_matrix_sync(qf[0], Qs + r0 * LD + f * 16, LD);
                        wmma::mma_sync(s[n], qf[0], kf, s[n]);
                    }
                }
            }
            float mx[2] = {-INFINITY, -INFINITY};
FA2_UNROLL
            for (int n = 0; n < NK; n++)
FA2_UNROLL
                for (int i = 0; i < 8; i++) {
                    float v = s[n].x[i] * sl2;
                    if (!full) {
                        const int r = r0 + fa2_rr(lane, i), c = n * 16 + fa2_rc(lane, i);
                        if (!(r < nq && c < nk && fa_visible(a.seg, i0 + r, j0 + c, off, Tk, b))) v = -INFINITY;
                    }
                    s[n].x[i] = v;
                    mx[i / 2 % 2] = fmaxf(mx[i / 2 % 2], v);
                }
            float ms[2], alpha[2];
FA2_UNROLL
            for (int e = 0; e < 2; e++) {
                const float mn = fmaxf(m[e], fa2_quad_max(mx[e]));
                ms[e] = mn == -INFINITY ? 0.0f : mn;
                alpha[e] = exp2f(m[e] - ms[e]);
                m[e] = mn;
                l[e] *= alpha[e];
            }
FA2_UNROLL
            for (int f = 0; f < NF; f++)
FA2_UNROLL
                for (int i = 0; i < 8; i++) o[f].x[i] *= alpha[i / 2 % 2];
FA2_UNROLL
            for (int kk = 0; kk < NK; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
FA2_UNROLL
                for (int i = 0; i < 8; i++) {
                    const float p = exp2f(s[kk].x[i] - ms[i / 2 % 2]);
                    l[i / 2 % 2] += p;
                    pf.x[i] = fa2_cvt<T>(p);
                }
FA2_UNROLL
                for (int f = 0; f < NF; f++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                    wmma::load_matrix_sync(vf, Vs + kk * 16 * LD + f * 16, LD);
                    wmma::mma_sync(o[f], pf, vf, o[f]);
                }
            }
        }
    });
    float inv[2];
FA2_UNROLL
    for (int e = 0; e < 2; e++) {
        l[e] = fa2_quad_sum(l[e]);
        inv[e] = l[e] > 0.0f ? 1.0f / l[e] : 0.0f;
    }
    const int es = a.q.type == QL_TYPE_F32 ? 4 : 2;  // the output in q's type (16-bit: rounded once)
FA2_UNROLL
    for (int f = 0; f < NF; f++)
FA2_UNROLL
        for (int i = 0; i < 8; i++) {
            const int r = r0 + fa2_rr(lane, i);
            if (r < nq) cu_st(out + (((b * Tq + i0 + r) * H + h) * D + f * 16 + fa2_rc(lane, i)) * es, a.q.type, o[f].x[i] * inv[i / 2 % 2]);
        }
    if (lane % 4 == 0)
        for (int e = 0; e < 2; e++) {
            const int r = r0 + lane / 4 + 8 * e;
            if (r < nq) lse[(b * H + h) * Tq + i0 + r] = m[e] * FA2_LN2 + logf(l[e]);
        }
    }
}

// dK, dV, register path: block (kv head and slice, 16 NW keys, batch); the slice's query heads, query
// tiles of BT, 16 queries at a time. dk, dv [D, Tk, Hkv, B]; dO [D, H, Tq, B]; lse, delta [Tq, H, B]
template <typename T, int D, int NW, int BT, bool PIPE>  // (T: bf16)
__global__ void __launch_bounds__(NW * 32, 1)
    k_fa2_dkv_reg(fa_args a, const char *dO, const float *lse, const float *delta, float *dk, float *dv, fa2_split sp) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    using namespace nvcuda;
    constexpr int RK = 16 * NW, LD = D + FA2_PAD, NF = D / 16, NB = PIPE ? 2 : 1;
    static_assert(BT <= 32 * NW, "a thread per query row of a tile (its lse and delta)");
    const int Tq = (int)a.q.ne[1], H = (int)a.q.ne[2], Tk = (int)a.k.ne[1], Hkv = (int)a.k.ne[2], off = Tk - Tq, rep = H / Hkv;
    int hk, rlo;  // (blockIdx.x: kv head and slice; y: keys, the first, busiest, dispatched first across heads)
    const int rhi = fa2_slice(sp, rep, hk, rlo, dk, dv), b = blockIdx.z, j0 = blockIdx.y * RK;
    const int nk = min(RK, Tk - j0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Ks = (T *)sm, *Vs = Ks + RK * LD, *Qb = Vs + RK * LD, *dOb = Qb + NB * BT * LD;  // K, V [RK][LD]; q, dO [NB][BT][LD]
    float *Lb = (float *)(dOb + NB * BT * LD), *Db = Lb + NB * BT;                     // [NB][BT]: lse (log2 units), delta
    const char *kb = a.k.data + (int64_t)j0 * a.k.nb[1] + hk * a.k.nb[2] + b * a.k.nb[3];
    const char *vb = a.v.data + (int64_t)j0 * a.v.nb[1] + hk * a.v.nb[2] + b * a.v.nb[3];
    fa2_tile<T, D>(Ks, kb, a.k.nb[1], nk, RK, a.k.type);
    fa2_tile<T, D>(Vs, vb, a.v.nb[1], nk, RK, a.v.type);
    constexpr bool KVREG = D <= 64;  // this warp's K and V rows as fragments in registers (fewer shared-memory reads); above, read each time
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> kfa[KVREG ? NF : 1], vfa[KVREG ? NF : 1];
    if constexpr (KVREG) {
        __syncthreads();
FA2_UNROLL
        for (int f = 0; f < NF; f++) {
            wmma::load_matrix_sync(kfa[f], Ks + r0 * LD + f * 16, LD);
            wmma::load_matrix_sync(vfa[f], Vs + r0 * LD + f * 16, LD);
        }
    }
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dkf[NF], dvf[NF];
FA2_UNROLL
    for (int f = 0; f < NF; f++) wmma::fill_fragment(dkf[f], 0.0f), wmma::fill_fragment(dvf[f], 0.0f);
    int klo = 0, khi = 0;
    if (a.seg) fa2_seg_range(a.seg + (int64_t)b * Tk, j0, nk, &klo, &khi);
    // the tiles visited, in order: (query head r of the group, query tile i0) from the first query
    // that may see key j0, less the tiles whose documents do not meet the keys' (every thread agrees)
    const int qstart = max(0, j0 - off) / BT * BT;
    auto advance = [&](int2 &t) { return fa2_next_qtile(a, b, Tk, Tq, off, BT, qstart, rhi, klo, khi, t); };
    fa2_qrow qrow;  // this thread's query row of the tile on its way
    auto issue = [&](int2 t, int buf) {  // tile t = (r, i0) into buffer buf: q and dO rows; lse, delta into qrow
        const int h = hk * rep + t.x, i0 = t.y, nq = min(BT, Tq - i0);
        const char *qb = a.q.data + h * a.q.nb[2] + b * a.q.nb[3] + (int64_t)i0 * a.q.nb[1];
        const char *ob = dO + (((int64_t)(b * Tq + i0) * H + h) * D) * 2;  // (bf16, aligned: the workspace's)
        if constexpr (PIPE) {
            fa2_copy16_async<T, D>(Qb + buf * BT * LD, qb, a.q.nb[1], nq, BT);
            fa2_copy16_async<T, D>(dOb + buf * BT * LD, ob, H * D * 2, nq, BT);
        } else {
            fa2_tile<T, D>(Qb, qb, a.q.nb[1], nq, BT, a.q.type);
            fa2_copy16<T, D>(dOb, ob, H * D * 2, nq, BT);
        }
        qrow.get(lse, delta, (int64_t)(b * H + h) * Tq + i0, nq, BT);
    };
    auto put = [&](int buf) { qrow.put(Lb + buf * BT, Db + buf * BT, BT); };
    fa2_stream<PIPE>(int2{rlo, qstart - BT}, advance, issue, put, [&](int2 t, int buf) {
        const int i0 = t.y;
        const T *Qs = Qb + buf * BT * LD, *dOs = dOb + buf * BT * LD;
        const float *Lr = Lb + buf * BT, *Dr = Db + buf * BT;
        const int nq = min(BT, Tq - i0);
        if (r0 < nk) {
FA2_NO_UNROLL
            for (int n = 0; n < BT / 16; n++) {  // queries i0 + 16 n ..
                const int q0 = n * 16;
                if (q0 >= nq || j0 + r0 > i0 + q0 + 15 + off) continue;  // none of them sees this warp's keys
                const bool full = !a.seg && q0 + 16 <= nq && r0 + 16 <= nk && j0 + r0 + 15 <= i0 + q0 + off;
                // S^T = K Q^T -> P^T; dV += P^T dO; dP^T = V dO^T -> dS^T; dK += dS^T Q ([16 keys, 16 queries];
                // in this order, so that S^T and dP^T are not live at once)
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
                wmma::fill_fragment(s, 0.0f);
FA2_UNROLL
                for (int f = 0; f < NF; f++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> yf;
                    wmma::load_matrix_sync(yf, Qs + q0 * LD + f * 16, LD);
                    if constexpr (KVREG) {
                        wmma::mma_sync(s, kfa[f], yf, s);
                    } else {
                        wmma::load_matrix_sync(kfa[0], Ks + r0 * LD + f * 16, LD);
                        wmma::mma_sync(s, kfa[0], yf, s);
                    }
                }
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf, df;
FA2_UNROLL
                for (int i = 0; i < 8; i++) {
                    const int kr = r0 + fa2_rr(lane, i), c = q0 + fa2_rc(lane, i);
                    const bool vis = full || (c < nq && kr < nk && fa_visible(a.seg, i0 + c, j0 + kr, off, Tk, b));
                    pf.x[i] = fa2_cvt<T>(vis ? exp2f(s.x[i] * sl2 - Lr[c]) : 0.0f);
                }
FA2_UNROLL
                for (int f = 0; f < NF; f++) {  // dV += P^T dO
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> yf;
                    wmma::load_matrix_sync(yf, dOs + q0 * LD + f * 16, LD);
                    wmma::mma_sync(dvf[f], pf, yf, dvf[f]);
                }
                wmma::fill_fragment(s, 0.0f);  // now dP^T
FA2_UNROLL
                for (int f = 0; f < NF; f++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> yf;
                    wmma::load_matrix_sync(yf, dOs + q0 * LD + f * 16, LD);
                    if constexpr (KVREG) {
                        wmma::mma_sync(s, vfa[f], yf, s);
                    } else {
                        wmma::load_matrix_sync(vfa[0], Vs + r0 * LD + f * 16, LD);
                        wmma::mma_sync(s, vfa[0], yf, s);
                    }
                }
FA2_UNROLL
                for (int i = 0; i < 8; i++) df.x[i] = fa2_cvt<T>(fa2_f(pf.x[i]) * (s.x[i] - Dr[q0 + fa2_rc(lane, i)]));
FA2_UNROLL
                for (int f = 0; f < NF; f++) {  // dK += dS^T Q
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> yf;
                    wmma::load_matrix_sync(yf, Qs + q0 * LD + f * 16, LD);
                    wmma::mma_sync(dkf[f], df, yf, dkf[f]);
                }
            }
        }
    });
    const int64_t row = (int64_t)(b * Hkv + hk) * Tk + j0 + r0;
FA2_UNROLL
    for (int f = 0; f < NF; f++)
FA2_UNROLL
        for (int i = 0; i < 8; i++) {
            const int kr = fa2_rr(lane, i), c = f * 16 + fa2_rc(lane, i);
            if (r0 + kr < nk) dk[(row + kr) * D + c] = dkf[f].x[i] * a.scale, dv[(row + kr) * D + c] = dvf[f].x[i];
        }
    }
}

// dQ, register path: block (16 NW queries, head, batch) over key tiles of BT, 16 keys at a time.
// dq [D, Tq, H, B]
template <typename T, int D, int NW, int BT, bool PIPE>  // (T: bf16)
__global__ void __launch_bounds__(NW * 32, 1)
    k_fa2_dq_reg(fa_args a, const char *dO, const float *lse, const float *delta, float *dq, fa2_split sp) {
    if constexpr (!FA2_ARCH_OK(T)) return;
    else
    {
    using namespace nvcuda;
    constexpr int RQ = 16 * NW, LD = D + FA2_PAD, NF = D / 16, NB = PIPE ? 2 : 1;
    const int64_t Tq = a.q.ne[1], H = a.q.ne[2], Tk = a.k.ne[1], Hkv = a.k.ne[2], off = Tk - Tq;
    const int nqb = (int)((Tq + RQ - 1) / RQ);
    if ((int)blockIdx.y >= nqb) return fa2_sum_slices(sp, nqb);  // (the rows past the query tiles: dK, dV's slices summed)
    const int64_t h = blockIdx.x, b = blockIdx.z, hk = (int)h / ((int)H / (int)Hkv), i0 = (int64_t)(nqb - 1 - (int)blockIdx.y) * RQ;
    const int nq = (int)min((int64_t)RQ, Tq - i0), warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    const float sl2 = a.scale * FA2_LOG2E;
    QL_DYN_SMEM(unsigned char, sm);
    T *Qs = (T *)sm, *dOs = Qs + RQ * LD, *Kb = dOs + RQ * LD, *Vb = Kb + NB * BT * LD;  // q, dO [RQ][LD]; K, V [NB][BT][LD]
    const char *qb = a.q.data + i0 * a.q.nb[1] + h * a.q.nb[2] + b * a.q.nb[3];
    fa2_tile<T, D>(Qs, qb, a.q.nb[1], nq, RQ, a.q.type);
    fa2_copy16<T, D>(dOs, dO + ((b * Tq + i0) * H + h) * D * 2, H * D * 2, nq, RQ);  // (bf16, aligned: the workspace's)
    float Lq[2], Dq[2];  // rows fa2_rr(lane, 0) and + 8
    for (int e = 0; e < 2; e++) {
        const int r = r0 + lane / 4 + 8 * e;
        const int64_t row = (b * H + h) * Tq + i0 + r;
        Lq[e] = r < nq ? lse[row] * FA2_LOG2E : 0.0f;
        Dq[e] = r < nq ? delta[row] : 0.0f;
    }
    constexpr bool QREG = D <= 64;  // this warp's q and dO rows as fragments in registers; above, read each time
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qfa[QREG ? NF : 1], ofa[QREG ? NF : 1];
    if constexpr (QREG) {
        __syncthreads();
FA2_UNROLL
        for (int f = 0; f < NF; f++) {
            wmma::load_matrix_sync(qfa[f], Qs + r0 * LD + f * 16, LD);
            wmma::load_matrix_sync(ofa[f], dOs + r0 * LD + f * 16, LD);
        }
    }
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dqf[NF];
FA2_UNROLL
    for (int f = 0; f < NF; f++) wmma::fill_fragment(dqf[f], 0.0f);
    int qlo = 0, qhi = 0;
    if (a.seg) fa2_seg_range(a.seg + b * Tk, i0 + off, nq, &qlo, &qhi);
    const char *kb = a.k.data + hk * a.k.nb[2] + b * a.k.nb[3], *vb = a.v.data + hk * a.v.nb[2] + b * a.v.nb[3];
    const int64_t jend = min(Tk, i0 + nq + off);
    // the key tiles visited, in order, less those whose documents do not meet the queries' (every thread agrees)
    auto advance = [&](int64_t &j0) { return fa2_next_ktile(a, b, Tk, jend, BT, qlo, qhi, j0); };
    auto issue = [&](int64_t j0, int buf) {  // key tile j0 into buffer buf
        const int nk = (int)min((int64_t)BT, jend - j0);
        if constexpr (PIPE) {
            fa2_copy16_async<T, D>(Kb + buf * BT * LD, kb + j0 * a.k.nb[1], a.k.nb[1], nk, BT);
            fa2_copy16_async<T, D>(Vb + buf * BT * LD, vb + j0 * a.v.nb[1], a.v.nb[1], nk, BT);
        } else {
            fa2_tile<T, D>(Kb, kb + j0 * a.k.nb[1], a.k.nb[1], nk, BT, a.k.type);
            fa2_tile<T, D>(Vb, vb + j0 * a.v.nb[1], a.v.nb[1], nk, BT, a.v.type);
        }
    };
    fa2_stream<PIPE>((int64_t)-BT, advance, issue, [](int) {}, [&](int64_t j0, int buf) {
        const T *Ks = Kb + buf * BT * LD, *Vs = Vb + buf * BT * LD;
        const int nk = (int)min((int64_t)BT, jend - j0);
        if (r0 < nq) {
FA2_NO_UNROLL
            for (int n = 0; n < BT / 16; n++) {  // keys j0 + 16 n ..
                const int k0 = n * 16;
                if (k0 >= nk || j0 + k0 > i0 + r0 + 15 + off) continue;  // none of them seen by this warp's queries
                const bool full = !a.seg && k0 + 16 <= nk && r0 + 16 <= nq && j0 + k0 + 15 <= i0 + r0 + off;
                // S = Q K^T and dP = dO V^T: [16 queries, 16 keys]
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> s, dp;
                wmma::fill_fragment(s, 0.0f);
                wmma::fill_fragment(dp, 0.0f);
FA2_UNROLL
                for (int f = 0; f < NF; f++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> yf;
                    wmma::load_matrix_sync(yf, Ks + k0 * LD + f * 16, LD);
                    if constexpr (QREG) {
                        wmma::mma_sync(s, qfa[f], yf, s);
                    } else {
                        wmma::load_matrix_sync(qfa[0], Qs + r0 * LD + f * 16, LD);
                        wmma::mma_sync(s, qfa[0], yf, s);
                    }
                    wmma::load_matrix_sync(yf, Vs + k0 * LD + f * 16, LD);
                    if constexpr (QREG) {
                        wmma::mma_sync(dp, ofa[f], yf, dp);
                    } else {
                        wmma::load_matrix_sync(ofa[0], dOs + r0 * LD + f * 16, LD);
                        wmma::mma_sync(dp, ofa[0], yf, dp);
                    }
                }
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> df;
FA2_UNROLL
                for (int i = 0; i < 8; i++) {
                    const int qr = r0 + fa2_rr(lane, i), c = k0 + fa2_rc(lane, i), e = i / 2 % 2;
                    const bool vis = full || (qr < nq && c < nk && fa_visible(a.seg, i0 + qr, j0 + c, off, Tk, b));
                    const float p = fa2_f(fa2_cvt<T>(vis ? exp2f(s.x[i] * sl2 - Lq[e]) : 0.0f));  // P rounded as the dK/dV kernel's
                    df.x[i] = fa2_cvt<T>(p * (dp.x[i] - Dq[e]));
                }
FA2_UNROLL
                for (int f = 0; f < NF; f++) {  // dQ += dS K
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> yf;
                    wmma::load_matrix_sync(yf, Ks + k0 * LD + f * 16, LD);
                    wmma::mma_sync(dqf[f], df, yf, dqf[f]);
                }
            }
        }
    });
    float *dst = dq + ((b * H + h) * Tq + i0) * D;
FA2_UNROLL
    for (int f = 0; f < NF; f++)
FA2_UNROLL
        for (int i = 0; i < 8; i++) {
            const int qr = r0 + fa2_rr(lane, i);
            if (qr < nq) dst[(int64_t)qr * D + f * 16 + fa2_rc(lane, i)] = dqf[f].x[i] * a.scale;
        }
    }
}
template <int D, int NW, int NB = 1> constexpr size_t fa2_fwd_reg_smem() {  // NB buffers of K and V tiles (q's first), q's own above head dim 96
    return (size_t)(2 * NB * FA2_BK + (D > 96 ? 16 * NW : 0)) * (D + FA2_PAD) * 2;
}
template <int D, int NW, int BT, int NB = 1> constexpr size_t fa2_back_reg_smem() {  // 16 NW rows held, NB buffers of BT streamed
    return (size_t)2 * (16 * NW + NB * BT) * (D + FA2_PAD) * 2 + 2 * NB * BT * sizeof(float);  // (+ dK/dV's lse, delta)
}
#define FA2_REG_NW 4   // backward: warps per block (16 NW keys or queries held)
#define FA2_REG_BT 64  // backward: queries (dK/dV) or keys (dQ) per streamed tile
// the streamed tile with two buffers (PIPE): FA2_REG_BT rows where the block's shared memory stays within 99 KiB, else half
template <int D, int NW> constexpr int fa2_pipe_bt() {
    return fa2_back_reg_smem<D, NW, FA2_REG_BT, 2>() <= (99u << 10) ? FA2_REG_BT : FA2_REG_BT / 2;
}
#define FA2_REG_SMEM_OK(D)                                                                                                 \
    static_assert(fa2_fwd_reg_smem<D, 8>() <= (99u << 10) && fa2_back_reg_smem<D, (D <= 96 ? 8 : 4), FA2_REG_BT>() <= (99u << 10) && \
                      fa2_back_reg_smem<D, FA2_REG_NW, fa2_pipe_bt<D, FA2_REG_NW>(), 2>() <= (99u << 10) &&                   \
                      (D > 96 || fa2_back_reg_smem<D, 8, fa2_pipe_bt<D, 8>(), 2>() <= (99u << 10)),                                       \
                  "fused attention's register path: shared memory above the device limit at head dim " #D)
FA2_REG_SMEM_OK(64);
FA2_REG_SMEM_OK(80);
FA2_REG_SMEM_OK(96);
FA2_REG_SMEM_OK(128);

// launchers: the kernel for (T, D), its shared memory allowed, then the launch
static bool cu_fa2_reg(const cu_ctx &c);
static size_t cu_smem_optin(const cu_ctx &c);  // a block's shared memory on this device, opted in
// the register path's streamed tiles in two buffers by asynchronous copies (PIPE) where the streamed
// tensor is bf16 and every row 16-byte aligned (and, forward, the device's shared memory allows),
// unless QLORA_CUDA_FA2_PIPE=0 (or ql_cuda_fa2_set_pipe)
static int g_fa2_pipe = !(getenv("QLORA_CUDA_FA2_PIPE") && strcmp(getenv("QLORA_CUDA_FA2_PIPE"), "0") == 0);
int ql_cuda_fa2_set_pipe(int on) {
    const int was = g_fa2_pipe;
    g_fa2_pipe = on != 0;
    return was;
}
static bool fa2_async_ok(const ql_tensor *t) {
    return g_fa2_pipe && t->type == QL_TYPE_BF16 && ((uintptr_t)t->data | (uintptr_t)t->nb[1] | (uintptr_t)t->nb[2] | (uintptr_t)t->nb[3]) % 16 == 0;
}
// the register path's forward: 8 warps (128 queries) a block, or 4 (QLORA_CUDA_FA2_WARPS=4); on an H200
// 8 ran 56 / 45 TFLOP/s at d 128 / 64, 4 ran 50 / 42
static const int g_fa2_fwd_warps = getenv("QLORA_CUDA_FA2_WARPS") && atoi(getenv("QLORA_CUDA_FA2_WARPS")) == 4 ? 4 : 8;
template <int D, int NW, bool PIPE> static void fa2_fwd_reg_launch(cu_ctx &c, ql_tensor *node) {
    const ql_tensor *q = node->src[0];
    const size_t smem = fa2_fwd_reg_smem<D, NW, PIPE ? 2 : 1>();
    void (*kern)(fa_args, char *, float *) = k_fa2_fwd_reg<__nv_bfloat16, D, NW, PIPE>;
    CU_CHECK(c, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const dim3 grid((unsigned)q->ne[2], (unsigned)((q->ne[1] + 16 * NW - 1) / (16 * NW)), (unsigned)q->ne[3]);  // (heads, query tiles, batch)
    float *lse = (float *)((char *)node->data + ql_nbytes(node));
    QL_LAUNCH(kern, grid, NW * 32, smem, c.stream, fa_args_of(node), (char *)node->data, lse);
    CU_LAUNCHED(c);
}
template <int D, int NW> static void fa2_fwd_reg_pick(cu_ctx &c, ql_tensor *node) {  // two buffers where they fit this device
    if (fa2_async_ok(node->src[1]) && fa2_async_ok(node->src[2]) && fa2_fwd_reg_smem<D, NW, 2>() <= cu_smem_optin(c))
        return fa2_fwd_reg_launch<D, NW, true>(c, node);
    fa2_fwd_reg_launch<D, NW, false>(c, node);
}
// the register path's backward: 4 warps a block (64 keys or queries held), or 8 (QLORA_CUDA_FA2_BWD_WARPS=8; on an
// H200 the same speed: d 64 18.2 against 18.4 TFLOP/s)
static const int g_fa2_bwd_warps = getenv("QLORA_CUDA_FA2_BWD_WARPS") && atoi(getenv("QLORA_CUDA_FA2_BWD_WARPS")) == 8 ? 8 : 4;
// the dK/dV grid: (kv heads x slices, blocks of rk keys, batch) - a key block's heads and slices side by
// side, so the first (busiest) key blocks of every head go first; the dQ grid: (heads, blocks of rq
// queries, the last (busiest) first, + rows of blocks that sum dK/dV's slices, batch)
static dim3 fa2_dkv_grid(const ql_tensor *k, int rk, const fa2_split &sp) {
    return dim3((unsigned)(k->ne[2] * sp.split), (unsigned)((k->ne[1] + rk - 1) / rk), (unsigned)k->ne[3]);
}
static dim3 fa2_dq_grid(const ql_tensor *q, int rq, int threads, const fa2_split &sp) {
    const int64_t nqb = (q->ne[1] + rq - 1) / rq, B = q->ne[3], H = q->ne[2];
    const int64_t sums = sp.split > 1 ? (sp.n + 32 * threads - 1) / (32 * threads) : 0;  // blocks of 32 sums a thread
    const int64_t rows = std::min((sums + H * B - 1) / (H * B), 65535 - nqb);
    return dim3((unsigned)H, (unsigned)(nqb + rows), (unsigned)B);
}
template <int D, int NW, bool PIPE>
static void fa2_dkv_reg_launch(cu_ctx &c, const ql_tensor *k, const fa_args &a, const char *dO, const float *lse, const float *delta,
                               float *dk, float *dv, const fa2_split &sp) {
    constexpr int BT = PIPE ? fa2_pipe_bt<D, NW>() : FA2_REG_BT;
    const size_t smem = fa2_back_reg_smem<D, NW, BT, PIPE ? 2 : 1>();
    void (*kern)(fa_args, const char *, const float *, const float *, float *, float *, fa2_split) = k_fa2_dkv_reg<__nv_bfloat16, D, NW, BT, PIPE>;
    CU_CHECK(c, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    QL_LAUNCH(kern, fa2_dkv_grid(k, 16 * NW, sp), NW * 32, smem, c.stream, a, dO, lse, delta, dk, dv, sp);
    CU_LAUNCHED(c);
}
template <int D, int NW, bool PIPE>
static void fa2_dq_reg_launch(cu_ctx &c, const ql_tensor *q, const fa_args &a, const char *dO, const float *lse, const float *delta,
                              float *dq, const fa2_split &sp) {
    constexpr int BT = PIPE ? fa2_pipe_bt<D, NW>() : FA2_REG_BT;
    const size_t smem = fa2_back_reg_smem<D, NW, BT, PIPE ? 2 : 1>();
    void (*kern)(fa_args, const char *, const float *, const float *, float *, fa2_split) = k_fa2_dq_reg<__nv_bfloat16, D, NW, BT, PIPE>;
    CU_CHECK(c, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    QL_LAUNCH(kern, fa2_dq_grid(q, 16 * NW, NW * 32, sp), NW * 32, smem, c.stream, a, dO, lse, delta, dq, sp);
    CU_LAUNCHED(c);
}
template <int D, int NW>
static void fa2_back_reg_launch(cu_ctx &c, ql_tensor *node, const float *delta, const char *dO16, const fa2_split &sp) {
    const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2], *fwd = node->src[4];
    const fa_args a = fa_args_of(node);
    const char *dO = dO16;
    const float *lse = (const float *)((const char *)fwd->data + ql_nbytes(fwd));
    float *dq = (float *)node->data, *dk = dq + ql_nelements(q), *dv = dk + ql_nelements(k);
    if constexpr (D > 96) {  // dK, dV at head dim 128: the shared-memory kernel (the register one needs more than 255 registers)
        using T = __nv_bfloat16;
        constexpr int SNW = fa2_back_cfg<T>::NW;
        const bool pipe = fa2_async_ok(q);  // (then dO from the 16-byte aligned bf16 copy, or dO itself in bf16)
        const size_t ssmem = pipe ? fa2_back_smem<T, D, 2>() : fa2_back_smem<T, D>();
        void (*kold)(fa_args, const char *, int, const float *, const float *, float *, float *, fa2_split) =
            pipe ? k_fa2_dkv<T, D, true> : k_fa2_dkv<T, D, false>;
        CU_CHECK(c, cudaFuncSetAttribute(kold, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ssmem));
        const char *dOk = pipe ? dO16 : (const char *)node->src[5]->data;
        const int dtk = pipe ? (int)QL_TYPE_BF16 : (int)node->src[5]->type;
        QL_LAUNCH(kold, fa2_dkv_grid(k, 16 * SNW, sp), SNW * 32, ssmem, c.stream, a, dOk, dtk, lse, delta, dk, dv, sp);
        CU_LAUNCHED(c);
    } else if (fa2_async_ok(q)) {  // (dO: the bf16 workspace copy or dO itself, 16-byte aligned either way)
        fa2_dkv_reg_launch<D, NW, true>(c, k, a, dO, lse, delta, dk, dv, sp);
    } else {
        fa2_dkv_reg_launch<D, NW, false>(c, k, a, dO, lse, delta, dk, dv, sp);
    }
    if (fa2_async_ok(k) && fa2_async_ok(v)) fa2_dq_reg_launch<D, NW, true>(c, q, a, dO, lse, delta, dq, sp);
    else fa2_dq_reg_launch<D, NW, false>(c, q, a, dO, lse, delta, dq, sp);
}
template <typename T, int D> static void fa2_fwd_launch(cu_ctx &c, ql_tensor *node) {
    if (std::is_same<T, __nv_bfloat16>::value && cu_fa2_reg(c))
        return g_fa2_fwd_warps == 8 ? fa2_fwd_reg_pick<D, 8>(c, node) : fa2_fwd_reg_pick<D, 4>(c, node);
    const ql_tensor *q = node->src[0];
    const size_t smem = fa2_fwd_smem<T, D>();
    void (*kern)(fa_args, char *, float *) = k_fa2_fwd<T, D>;  // (a name without commas, for the macros)
    CU_CHECK(c, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const dim3 grid((unsigned)q->ne[2], (unsigned)((q->ne[1] + FA2_BQ - 1) / FA2_BQ), (unsigned)q->ne[3]);  // (heads, query tiles, batch)
    float *lse = (float *)((char *)node->data + ql_nbytes(node));
    QL_LAUNCH(kern, grid, FA2_WARPS * 32, smem, c.stream, fa_args_of(node), (char *)node->data, lse);
    CU_LAUNCHED(c);
}
template <typename T, int D>
static void fa2_back_launch(cu_ctx &c, ql_tensor *node, const float *delta, const char *dO16, const fa2_split &sp) {
    if (std::is_same<T, __nv_bfloat16>::value && cu_fa2_reg(c)) {
        if constexpr (D <= 96)  // (8 warps' tiles above 99 KiB of shared memory at d 128)
            if (g_fa2_bwd_warps == 8) return fa2_back_reg_launch<D, 8>(c, node, delta, dO16, sp);
        return fa2_back_reg_launch<D, FA2_REG_NW>(c, node, delta, dO16, sp);
    }
    const ql_tensor *q = node->src[0], *k = node->src[1], *fwd = node->src[4];
    constexpr int NW = fa2_back_cfg<T>::NW;
    const size_t smem = fa2_back_smem<T, D>();
    const fa_args a = fa_args_of(node);
    const char *dO = (const char *)node->src[5]->data;
    const int dt = (int)node->src[5]->type;
    const float *lse = (const float *)((const char *)fwd->data + ql_nbytes(fwd));
    float *dq = (float *)node->data, *dk = dq + ql_nelements(q), *dv = dk + ql_nelements(k);
    void (*kdkv)(fa_args, const char *, int, const float *, const float *, float *, float *, fa2_split) = k_fa2_dkv<T, D>;
    void (*kdq)(fa_args, const char *, int, const float *, const float *, float *, fa2_split) = k_fa2_dq<T, D>;
    CU_CHECK(c, cudaFuncSetAttribute(kdkv, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CU_CHECK(c, cudaFuncSetAttribute(kdq, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    QL_LAUNCH(kdkv, fa2_dkv_grid(k, 16 * NW, sp), NW * 32, smem, c.stream, a, dO, dt, lse, delta, dk, dv, sp);
    CU_LAUNCHED(c);
    QL_LAUNCH(kdq, fa2_dq_grid(q, 16 * NW, NW * 32, sp), NW * 32, smem, c.stream, a, dO, dt, lse, delta, dq, sp);
    CU_LAUNCHED(c);
}
template <typename T> static void fa2_run(cu_ctx &c, ql_tensor *node, const float *delta, const char *dO16, const fa2_split &sp) {
    const bool back = node->op == QL_OP_FLASH_ATTN_BACK;
    switch (node->src[0]->ne[0]) {
    case 64:  return back ? fa2_back_launch<T, 64>(c, node, delta, dO16, sp) : fa2_fwd_launch<T, 64>(c, node);
    case 80:  return back ? fa2_back_launch<T, 80>(c, node, delta, dO16, sp) : fa2_fwd_launch<T, 80>(c, node);
    case 96:  return back ? fa2_back_launch<T, 96>(c, node, delta, dO16, sp) : fa2_fwd_launch<T, 96>(c, node);
    case 128: return back ? fa2_back_launch<T, 128>(c, node, delta, dO16, sp) : fa2_fwd_launch<T, 128>(c, node);
    default:  CU_ASSERT(!"fused attention: head dim not in ql_cuda_fa_fused");
    }
}
// both directions, fused: the compute type and the backward's delta [Tq, H, B] from ql_cuda_fa_layout
static void cu_fa_fused(cu_ctx &c, ql_tensor *node) {
    size_t o[QL_CUDA_FA_NBUF];
    ql_type ct;
    const size_t need = ql_cuda_fa_layout(node, cu_cc(c), o, nullptr, &ct);
    CU_ASSERT(c.work_size >= need);
    float *delta = nullptr;
    char *dO16 = nullptr;
    fa2_split sp{nullptr, nullptr, 0, 1};
    if (node->op == QL_OP_FLASH_ATTN_BACK) {
        const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
        sp.split = ql_cuda_fa2_kv_split(node);
        sp.n = ql_nelements(k) + ql_nelements(v);
        sp.out = (float *)node->data + ql_nelements(q);  // dk, then dv
        if (sp.split > 1) sp.part = (float *)((char *)c.work + o[QL_CUDA_FA_S]);
        const int64_t DV = v->ne[0], H = q->ne[2], Tq = q->ne[1], B = q->ne[3];
        const ql_tensor *dO = node->src[5];
        const bool copy = dO->type != ct;  // dO already in the compute type: read in place (the layout has no copy)
        delta = (float *)((char *)c.work + o[QL_CUDA_FA_DELTA]);
        dO16 = copy ? (char *)c.work + o[QL_CUDA_FA_DO] : (char *)dO->data;
        CU_ASSERT((uintptr_t)dO16 % 16 == 0);  // the register path's 16-byte tile copies
        QL_LAUNCH(k_fa_delta, cu_grid(Tq * H * B), CU_BLOCK, 0, c.stream, (const char *)dO->data, (int)dO->type,
                  (const char *)node->src[4]->data, (int)node->src[4]->type, DV, H, Tq, Tq * H * B, delta, copy ? dO16 : nullptr,
                  (int)ct, nullptr, (int64_t)0);
        CU_LAUNCHED(c);
    }
    if (ct == QL_TYPE_BF16) fa2_run<__nv_bfloat16>(c, node, delta, dO16, sp);
    else fa2_run<__half>(c, node, delta, dO16, sp);
}

// mm: NULL, or the o projection whose 8-bit codes (blocks of qb) the decode kernel writes too
// (ql_cuda_q8_made_by), into the workspace as k_q8_act would
static void cu_op_flash_attn(cu_ctx &c, ql_tensor *node, const ql_tensor *mm = nullptr, int qb = 0) {
    CU_ASSERT(!mm || (ql_cuda_q8_made_by(node, mm) == qb && !ql_cuda_fa_fused(node) && !ql_cuda_fa_gemm(node)));
    if (ql_cuda_fa_fused(node)) return cu_fa_fused(c, node);
    if (ql_cuda_fa_gemm(node)) return cu_fa_gemm(c, node);
    const ql_tensor *q = node->src[0], *v = node->src[2];
    const size_t smem = fa_fwd_smem(q->ne[0], v->ne[0]);
    const dim3 grid((unsigned)q->ne[2], (unsigned)((q->ne[1] + FA_BQ - 1) / FA_BQ), (unsigned)q->ne[3]);  // (heads, query tiles, batch)
    float *lse = (float *)((char *)node->data + ql_nbytes(node));
    const bool kv16 = node->src[1]->type == QL_TYPE_F16;  // an f16 KV cache (q f32: cu_attn_supported)
    const fa_args a = fa_args_of(node);
    if (q->ne[1] <= FD_MAX_TQ && q->ne[0] <= 32 * FD_MAXC && v->ne[0] <= 32 * FD_MAXC) {  // decode: a block per query
        const dim3 gd((unsigned)q->ne[1], (unsigned)q->ne[2], (unsigned)q->ne[3]);
        int8_t *q8 = nullptr;
        float *q8d = nullptr;
        int *q8s = nullptr;
        if (mm) {
            const int64_t K = ql_nelements(node);
            size_t off[2];
            CU_ASSERT(ql_cuda_mm_q8_layout(1, K, qb, off) <= c.work_size && K / qb <= QL_CUDA_Q8_COUNTERS);
            q8 = (int8_t *)c.work, q8d = (float *)(c.work + off[0]), q8s = (int *)(c.work + off[1]);
        }
        unsigned *cnt = c.q8_cnt;
        CU_ASSERT(!mm || cnt);
        if (kv16) QL_LAUNCH(k_fa_decode<uint16_t>, gd, FD_WARPS * 32, 0, c.stream, a, (float *)node->data, lse, q8, q8d, q8s, qb, cnt);
        else QL_LAUNCH(k_fa_decode<float>, gd, FD_WARPS * 32, 0, c.stream, a, (float *)node->data, lse, q8, q8d, q8s, qb, cnt);
        CU_LAUNCHED(c);
        return;
    }
    CU_ASSERT(!mm);  // (ql_cuda_q8_made_by asks for the decode kernel's shapes)
    if (kv16) QL_LAUNCH(k_fa_fwd<uint16_t>, grid, FA_WARPS * 32, smem, c.stream, a, (float *)node->data, lse);
    else QL_LAUNCH(k_fa_fwd<float>, grid, FA_WARPS * 32, smem, c.stream, a, (float *)node->data, lse);
    CU_LAUNCHED(c);
}

// a node with the 8-bit codes of product mm's b (ql_cuda_q8_made_by(node, mm) == qb: a norm,
// SwiGLU, decode's attention), left in the workspace as mm's own quantisation would leave them
// (cu_op_gemv_q8 finds them: c.q8_b, c.q8_key)
static void cu_op_q8_made_by(cu_ctx &c, ql_tensor *node, const ql_tensor *mm, int qb) {
    if (node->op == QL_OP_FLASH_ATTN) cu_op_flash_attn(c, node, mm, qb);
    else cu_op_q8_norm_swiglu(c, node, mm, qb);
    cu_q8_made(c, mm, qb, 0);
}

static void cu_op_flash_attn_back(cu_ctx &c, ql_tensor *node) { ql_cuda_fa_fused(node) ? cu_fa_fused(c, node) : cu_fa_gemm(c, node); }

static bool cu_attn_supported(const ql_tensor *node, int cc) {
    const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
    // f32, or one 16-bit type; over a KV cache (src[4]: n_kv) f32 q, and f32 or f16 k and v (an f16 cache)
    const bool kv16 = node->op == QL_OP_FLASH_ATTN && node->src[4] && q->type == QL_TYPE_F32 && k->type == QL_TYPE_F16 &&
                      v->type == QL_TYPE_F16;
    if (!kv16 && (!is_float_type_cu(q->type) || k->type != q->type || v->type != q->type)) return false;
    if (!ql_is_contiguous(node)) return false;
    if (node->op == QL_OP_FLASH_ATTN && (node->src[4] ? q->type != QL_TYPE_F32 : node->type != q->type)) return false;
    if (node->op == QL_OP_FLASH_ATTN_BACK) {
        const ql_tensor *dO = node->src[5];  // f32, or 16-bit (a 16-bit output's, autodiff rounds it)
        if (!is_float_type_cu(dO->type) || !ql_is_contiguous(dO) || !ql_is_contiguous(node->src[4])) return false;
    }
    if (ql_cuda_fa_fused(node))  // the fused kernels: the grid's y and z; fp16 on sm_75, bf16 from sm_80
        return cc >= 75 && q->ne[2] <= 65535 && q->ne[3] <= 65535;
    if (ql_cuda_fa_gemm(node)) {  // cuBLAS' int sizes: rows, columns and leading dimensions
        int64_t chunk;
        ql_cuda_fa_layout(node, cc, nullptr, &chunk, nullptr);
        const int64_t cols = q->ne[2] / k->ne[2] * chunk;
        return k->ne[1] <= INT32_MAX && cols <= INT32_MAX && q->ne[0] <= INT32_MAX && v->ne[0] <= INT32_MAX &&
               chunk * q->ne[2] * q->ne[3] <= INT32_MAX;
    }
    // the fused kernel: its tiles in 48 KiB of shared memory, the grid's y and z
    return fa_fwd_smem(q->ne[0], v->ne[0]) <= (48 << 10) && q->ne[2] <= 65535 && q->ne[3] <= 65535;
}


// ============================================================================================
// 8. the backend
// ============================================================================================

struct cu_schedule {  // a graph's offload copies: their event slots, and where the compute stream waits
    uint64_t plan_id = 0;                      // the plan it was made for (ql_graph_plan_id)
    int n_copies = 0;
    std::vector<int> slot;                     // per node: its copy's slot, or -1
    std::vector<std::vector<int>> wait_before; // per node: the slots whose copy must be done first
    // CUDA graphs: the run captured once its nodes and buffers (key: cu_graph_key) were seen twice
    uint64_t key = 0;
    int runs = 0;                              // eager runs with this key
    cudaGraphExec_t exec = nullptr;
    bool refused = false;                      // its capture failed: node by node until the plan changes
};

struct cuda_backend {
    int device = 0;
    cudaDeviceProp prop{};
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    cublasLtHandle_t lt = nullptr;  // cuBLASLt: products whose addend is not their result (C != D); on cuBLAS' workspace
    bool lt_ok = true;              // false once it refused one (then c is copied first)
    size_t blas_work_size = 0;
    int   *d_scratch = nullptr;  // device: reduction results (check_finite, gradient statistics); from int
                                 // QL_CUDA_Q8_COUNTER0 decode's counters (k_fa_decode, the products' tails), zeroed at start
    int   *h_scratch = nullptr;  // pinned host copy
    // activation offload (QL_OP_TO_HOST / TO_DEVICE): the copies' own stream, and per copy two
    // events (the compute stream reached it; the copy is done), made on the first graph that has
    // copies and kept
    cudaStream_t copy_stream = nullptr;
    std::vector<cudaEvent_t> events;
    cudaEvent_t joined = nullptr;  // the copy stream's last copy: the compute stream waits for it at a run's end
    // per graph and first node (a graph run in parts: each part its own capture): where to wait (cu_copy_schedule)
    std::map<std::pair<const ql_graph *, int>, cu_schedule> schedules;
    void  *blas_work = nullptr;    // cuBLAS's workspace (cublasSetWorkspace): nothing to allocate in a capture
    bool   graphs = true;          // CUDA graphs (QLORA_CUDA_GRAPHS=0, ql_cuda_set_graphs: off)
    ql_cuda_graph_counts counts{};
    cu_mm_side mm_side;  // the multiply's tile pipeline (section 5)
    // --profile: an event before and after each node on the compute stream, read once the run is
    // done (no wait per node; made on the first profiled run and kept, grown with the graph)
    std::vector<cudaEvent_t> prof_events;
    bool fa2_reg = false;  // k_fa2_probe found sm_80's fragment layout: the fused attention's register path
};
static cu_mm_side &cu_mm_side_of(cu_ctx &c) { return c.cb->mm_side; }
static cublasLtHandle_t cu_lt(cu_ctx &c) { return c.cb->lt; }
static bool &cu_lt_ok(cu_ctx &c) { return c.cb->lt_ok; }
// cuBLAS' workspace: the GEMMs and cuBLASLt's products run one after another on the compute stream
static void *cu_lt_work(cu_ctx &c, size_t *size) {
    *size = c.cb->blas_work_size;
    return c.cb->blas_work;
}
// Every entry point makes its backend's device the current one first: several backends (a model
// split over devices) share the process and its host threads.
static bool cu_use(const cuda_backend *cb) {
    if (cudaSetDevice(cb->device) == cudaSuccess) return true;
    fprintf(stderr, "qlora: cuda: cudaSetDevice(%d): %s\n", cb->device, cudaGetErrorString(cudaGetLastError()));
    return false;
}
static int cu_cc(const cu_ctx &c) { return c.cb->prop.major * 10 + c.cb->prop.minor; }
static bool cu_fa2_reg(const cu_ctx &c) { return c.cb->fa2_reg; }
static size_t cu_smem_optin(const cu_ctx &c) { return c.cb->prop.sharedMemPerBlockOptin; }


__global__ void k_first_nonfinite(cu_t t, int64_t n, unsigned long long *first) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = cu_ld(t.data + cu_offs(t, i), t.type);
        if (!isfinite(v)) atomicMin(first, (unsigned long long)i * 2 + (isnan(v) ? 1 : 0));
    }
}

static void cu_run_node(cu_ctx &c, ql_tensor *node) {
    switch (node->op) {
    case QL_OP_FILL:               cu_op_fill(c, node); break;
    case QL_OP_CONT:               cu_op_cont(c, node); break;
    case QL_OP_ADD:                cu_op_binary(c, node, false); break;
    case QL_OP_MUL:                cu_op_binary(c, node, true); break;
    case QL_OP_SCALE:              cu_op_scale(c, node); break;
    case QL_OP_SUM:                cu_op_sum(c, node); break;
    case QL_OP_REDUCE_TO:          cu_op_reduce_to(c, node); break;
    case QL_OP_MUL_MAT:            cu_op_mul_mat(c, node); break;
    case QL_OP_MUL_MAT_ROWS: {     // the product, written at its rows of the result (c's storage)
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        cu_op_mul_mat(c, &mm);
        break;
    }
    case QL_OP_GET_ROWS:           cu_op_get_rows(c, node); break;
    case QL_OP_GET_ROWS_BACK:      cu_op_get_rows_back(c, node); break;
    case QL_OP_RMS_NORM:           cu_op_rms_norm(c, node); break;
    case QL_OP_RMS_NORM_BACK:      cu_op_rms_norm_back(c, node); break;
    case QL_OP_ROPE:               cu_op_rope(c, node, false); break;
    case QL_OP_ROPE_BACK:          cu_op_rope(c, node, true); break;
    case QL_OP_SILU:               cu_op_silu(c, node); break;
    case QL_OP_SILU_BACK:          cu_op_silu_back(c, node); break;
    case QL_OP_SWIGLU:             cu_op_swiglu(c, node); break;
    case QL_OP_SWIGLU_BACK:        cu_op_swiglu_back(c, node); break;
    case QL_OP_FLASH_ATTN:         cu_op_flash_attn(c, node); break;
    case QL_OP_FLASH_ATTN_BACK:    cu_op_flash_attn_back(c, node); break;
    case QL_OP_CROSS_ENTROPY:      cu_op_cross_entropy(c, node); break;
    case QL_OP_CROSS_ENTROPY_BACK: cu_op_cross_entropy_back(c, node); break;
    case QL_OP_DROPOUT:            cu_op_dropout(c, node); break;
    case QL_OP_MUL_MAT_DROPOUT:    cu_op_mul_mat_dropout(c, node); break;
    case QL_OP_VIEW_BACK:          cu_op_view_back(c, node); break;
    case QL_OP_ADD_ROWS:           cu_op_add_rows(c, node); break;
    case QL_OP_ACC_GRAD:           cu_op_acc_grad(c, node); break;
    case QL_OP_CACHE_STORE:        cu_op_cache_store(c, node); break;
    case QL_OP_TO_HOST: case QL_OP_TO_DEVICE:
        CU_ASSERT(!"cuda: copies run in cuda_graph_compute, on the copy stream");
        break;
    case QL_OP_NONE: case QL_OP_VIEW: case QL_OP_RESHAPE: case QL_OP_PERMUTE: case QL_OP_TRANSPOSE: case QL_OP_WITH_GRAD:
        break;
    case QL_OP_COUNT:
        CU_ASSERT(!"cuda: op out of range");
    }
    cu_q8_after(c, node);  // (section 5: decode's 8-bit activations kept or forgotten)
}

static bool cuda_supports_op(ql_backend *be, const ql_tensor *node) {
    const int cc = ((cuda_backend *)be->impl)->prop.major * 10 + ((cuda_backend *)be->impl)->prop.minor;
    switch (node->op) {
    case QL_OP_MUL_MAT:         return cu_mm_supported(node, cc);
    case QL_OP_MUL_MAT_ROWS: {
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        return cu_mm_supported(&mm, cc);
    }
    case QL_OP_MUL_MAT_DROPOUT: {  // (the fused kernels convert as they read; the other path is the product's)
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(node, &mm, &d, nullptr);
        return ql_cuda_mm_drop_fused(node) || cu_mm_supported(&mm, cc);
    }
    case QL_OP_FLASH_ATTN:
    case QL_OP_FLASH_ATTN_BACK: return cu_attn_supported(node, cc);
    case QL_OP_COUNT:           return false;
    default:                    return cu_ops_supported(node);
    }
}

static size_t cuda_work_size(ql_backend *be, const ql_tensor *node) {
    const cudaDeviceProp &p = ((cuda_backend *)be->impl)->prop;
    return ql_cuda_work_size(node, p.major * 10 + p.minor);
}

static void *cuda_buffer_alloc(ql_backend *be, size_t size) { return cu_use((cuda_backend *)be->impl) ? cu_device_alloc(size) : nullptr; }
static void  cuda_buffer_free(void *p) { cu_device_free(p); }
static void *cuda_host_alloc(ql_backend *be, size_t size) {
    void *p = nullptr;
    if (!cu_use((cuda_backend *)be->impl)) return nullptr;
    if (cudaMallocHost(&p, size) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
    }
    return p;
}
static void cuda_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

static bool cu_ok(cudaError_t e, const char *what, char *err, size_t n) {
    if (e == cudaSuccess) return true;
    snprintf(err, n, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

static bool cuda_copy(ql_backend *be, void *dst, const void *src, size_t size, int dir, bool async, char *err, size_t n) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    if (!cu_use(cb)) return cu_ok(cudaErrorInvalidDevice, "cudaSetDevice", err, n);
    const cudaMemcpyKind kind = dir == QL_COPY_TO_DEVICE ? cudaMemcpyHostToDevice
                              : dir == QL_COPY_TO_HOST ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    if (async) return cu_ok(cudaMemcpyAsync(dst, src, size, kind, cb->stream), "cudaMemcpyAsync", err, n);
    return cu_ok(cudaMemcpyAsync(dst, src, size, kind, cb->stream), "cudaMemcpyAsync", err, n) &&
           cu_ok(cudaStreamSynchronize(cb->stream), "cudaStreamSynchronize", err, n);
}

static bool cuda_memset(ql_backend *be, void *dst, int value, size_t size, char *err, size_t n) {
    if (!cu_use((cuda_backend *)be->impl)) return cu_ok(cudaErrorInvalidDevice, "cudaSetDevice", err, n);
    return cu_ok(cudaMemsetAsync(dst, value, size, ((cuda_backend *)be->impl)->stream), "cudaMemsetAsync", err, n);
}

static bool cuda_synchronize(ql_backend *be, char *err, size_t n) {
    if (!cu_use((cuda_backend *)be->impl)) return cu_ok(cudaErrorInvalidDevice, "cudaSetDevice", err, n);
    return cu_ok(cudaStreamSynchronize(((cuda_backend *)be->impl)->stream), "cudaStreamSynchronize", err, n);
}

// the gradient's sum of squares and finiteness, brought to the host (the trainer needs the norm)
static void cu_grad_stats(cu_ctx &c, const ql_tensor *t, double *sumsq, bool *finite) {
    CU_ASSERT(t->type == QL_TYPE_F32 && ql_is_contiguous(t));
    double *d = (double *)c.cb->d_scratch, *h = (double *)c.cb->h_scratch;
    QL_LAUNCH(k_grad_stats, 1, 1024, 0, c.stream, (const float *)t->data, ql_nelements(t), d);
    CU_LAUNCHED(c);
    CU_CHECK(c, cudaMemcpyAsync(h, d, 2 * sizeof(double), cudaMemcpyDeviceToHost, c.stream));
    CU_CHECK(c, cudaStreamSynchronize(c.stream));
    *sumsq = h[0];
    *finite = h[1] == 0;
}

// a cu_ctx for work outside graphs (the optimizer's update, gradient statistics)
static cu_ctx cu_ctx_of(cuda_backend *cb) {
    cu_ctx c;
    c.cb = cb;
    c.stream = cb->stream;
    c.blas = cb->blas;
    c.q8_cnt = cb->d_scratch ? (unsigned *)(cb->d_scratch + QL_CUDA_Q8_COUNTER0) : nullptr;
    return c;
}

static ql_status cuda_adamw_update(ql_backend *be, ql_tensor *param, ql_tensor *m, ql_tensor *v, ql_tensor *m_absmax,
                                   ql_tensor *v_absmax, int64_t step, const ql_adamw_params *p, float grad_scale) {
    if (!cu_use((cuda_backend *)be->impl)) return QL_ERR_IO;
    cu_ctx c = cu_ctx_of((cuda_backend *)be->impl);
    cu_adamw_update(c, param, m, v, m_absmax, v_absmax, step, p, grad_scale);
    if (c.failed) fprintf(stderr, "qlora: cuda: adamw_update: %s\n", c.err);
    return c.failed ? QL_ERR_IO : QL_OK;
}

static ql_status cuda_grad_stats(ql_backend *be, const ql_tensor *t, double *sumsq, bool *finite) {
    if (!cu_use((cuda_backend *)be->impl)) return QL_ERR_IO;
    cu_ctx c = cu_ctx_of((cuda_backend *)be->impl);
    cu_grad_stats(c, t, sumsq, finite);
    if (c.failed) fprintf(stderr, "qlora: cuda: grad_stats: %s\n", c.err);
    return c.failed ? QL_ERR_IO : QL_OK;
}

static bool cuda_weight_copy(ql_backend *be, const ql_tensor *w, void *dst, ql_type type, char *err, size_t n) {
    if (!cu_use((cuda_backend *)be->impl)) return cu_ok(cudaErrorInvalidDevice, "cudaSetDevice", err, n);
    cu_ctx c = cu_ctx_of((cuda_backend *)be->impl);
    cu_weight_copy(c, w, (char *)dst, type);
    const cudaError_t e = c.failed ? cudaSuccess : cudaStreamSynchronize(c.stream);
    if (e != cudaSuccess) cu_fail(c, __FILE__, __LINE__, "cudaStreamSynchronize", cudaGetErrorString(e));
    if (c.failed) snprintf(err, n, "%s", c.err);
    return !c.failed;
}

// the statistics' result to the host: the one synchronisation of a step
static void cu_optim_read(cu_ctx &c, const ql_optim_list *l, double *sumsq, bool *finite) {
    double *h = (double *)c.cb->h_scratch;
    CU_CHECK(c, cudaMemcpyAsync(h, l->store + ql_optim_store_result(l->n), 2 * sizeof(double), cudaMemcpyDeviceToHost, c.stream));
    CU_CHECK(c, cudaStreamSynchronize(c.stream));
    *sumsq = h[0];
    *finite = h[1] == 0 && std::isfinite(h[0]);
}

static void cu_adamw_update_multi(cu_ctx &c, const ql_optim_list *l, int64_t step, const ql_adamw_params *p, double loss_scale,
                                  float max_norm, double *sumsq, bool *finite) {
    CU_ASSERT(step >= 1 && loss_scale > 0);
    cu_grad_stats_multi_launch(c, l);
    cu_opt8_maps(c);
    if (c.failed) return;
    const cu_adam_consts k = cu_adam_consts_of(p, step);
    if (l->n_chunks > 0) {
        QL_LAUNCH(k_adamw_multi, (unsigned)l->n_chunks, QL_OPT8_BLOCK, 0, c.stream, (const ql_optim_desc *)l->store, l->n,
                  (const double *)(l->store + ql_optim_store_result(l->n)), p->beta1, p->beta2, k.step_size, k.eps, k.decay, loss_scale,
                  max_norm);
        CU_LAUNCHED(c);
    }
    cu_optim_read(c, l, sumsq, finite);
}

static ql_status cuda_grad_stats_multi(ql_backend *be, ql_optim_list *l, double *sumsq, bool *finite) {
    if (!cu_use((cuda_backend *)be->impl)) return QL_ERR_IO;
    cu_ctx c = cu_ctx_of((cuda_backend *)be->impl);
    cu_grad_stats_multi_launch(c, l);
    if (!c.failed) cu_optim_read(c, l, sumsq, finite);
    if (c.failed) fprintf(stderr, "qlora: cuda: grad_stats_multi: %s\n", c.err);
    return c.failed ? QL_ERR_IO : QL_OK;
}

static ql_status cuda_adamw_update_multi(ql_backend *be, ql_optim_list *l, int64_t step, const ql_adamw_params *p, double loss_scale,
                                         float max_norm, double *sumsq, bool *finite) {
    if (!cu_use((cuda_backend *)be->impl)) return QL_ERR_IO;
    cu_ctx c = cu_ctx_of((cuda_backend *)be->impl);
    cu_adamw_update_multi(c, l, step, p, loss_scale, max_norm, sumsq, finite);
    if (c.failed) fprintf(stderr, "qlora: cuda: adamw_update_multi: %s\n", c.err);
    return c.failed ? QL_ERR_IO : QL_OK;
}

// Where the compute stream waits for offload's copies: a copy to the host before its source's
// last reader (which may write over it in place, or after which its block is reused), a copy
// back before its first reader.
static void cu_copy_schedule(const ql_graph *g, cu_schedule *sch) {
    const int n = ql_graph_n_nodes(g);
    const ql_plan_entry *pe = nullptr;
    const int n_entries = ql_graph_plan_entries(g, &pe);
    sch->plan_id = ql_graph_plan_id(g);
    sch->n_copies = 0;
    sch->slot.assign((size_t)n, -1);
    sch->wait_before.assign((size_t)n, {});
    std::unordered_map<const ql_tensor *, int> made_at, last_read;
    for (int k = 0; k < n_entries; k++) last_read[pe[k].tensor] = pe[k].last;
    for (int i = 0; i < n; i++) {
        const ql_tensor *node = ql_graph_node(g, i);
        if (node->op == QL_OP_TO_HOST) {
            sch->slot[(size_t)i] = sch->n_copies++;
            const ql_tensor *src = node->src[0];
            while (src->view_src) src = src->view_src;
            auto it = last_read.find(src);
            const int L = it == last_read.end() ? i + 1 : std::max(i + 1, it->second);
            if (L < n) sch->wait_before[(size_t)L].push_back(sch->slot[(size_t)i]);
        } else if (node->op == QL_OP_TO_DEVICE) {
            sch->slot[(size_t)i] = sch->n_copies++;
            made_at[node] = sch->slot[(size_t)i];
        }
        for (const ql_tensor *s : node->src) {
            while (s && s->view_src) s = s->view_src;
            auto it = s ? made_at.find(s) : made_at.end();
            if (it != made_at.end()) {
                sch->wait_before[(size_t)i].push_back(it->second);
                made_at.erase(it);
            }
        }
    }
}

static std::atomic<int64_t> cu_pairs_made{0};  // nodes made by the launch of the one before (tests)
int64_t ql_cuda_pairs_made_for_tests() { return cu_pairs_made.load(); }

static bool cu_noop(const ql_tensor *n) {
    return n->op == QL_OP_NONE || n->op == QL_OP_VIEW || n->op == QL_OP_RESHAPE || n->op == QL_OP_PERMUTE || n->op == QL_OP_TRANSPOSE ||
           n->op == QL_OP_WITH_GRAD;
}
// whether y's bytes lie over x's (its view root's): the census' test on the plan (ql_graph_census)
static bool cu_over(const ql_tensor *x, const ql_tensor *y) {
    while (x->view_src) x = x->view_src;
    const char *xb = (const char *)x->data, *yb = (const char *)y->data;
    return xb < yb + ql_nbytes(y) && yb < xb + ql_nbytes(x);
}
// ... over a's result or any of a's sources (ql_cuda_launch_pair's second node b: its launch reads
// them while it writes b)
static bool cu_over_any(const ql_tensor *a, const ql_tensor *b) {
    if (cu_over(a, b)) return true;
    for (const ql_tensor *sr : a->src)
        if (sr && cu_over(sr, b)) return true;
    return false;
}

// The nodes of g queued on the streams, in order; offload's copies on the copy stream, joined
// back at the end (so a copy no node waits for is done when the compute stream is). Eager runs
// may also time nodes (profile) or look for the first non-finite result (check_finite).
static ql_status cu_graph_enqueue(ql_backend *be, ql_graph *g, const ql_graph_exec &ex, const cu_schedule &sch, cu_ctx &c) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    ql_context *ctx = ql_graph_ctx(g);
    const int n = ql_graph_n_nodes(g);
    char err[256];
    if (ex.poison && !cuda_memset(be, ex.buffer, 0xff, ex.buffer_size, err, sizeof(err))) {
        ql_ctx_set_error(ctx, QL_ERR_IO, "compute: %s", err);
        return QL_ERR_IO;
    }
    // --profile: each node's time on the device between its two events, the nodes queued without
    // waits between them (a node the host queues slower than the device runs also counts its
    // launch's time; waiting for each node, as before, added ~10 us to every one on an H200)
    std::vector<int> timed;
    if (ex.profile) {
        while (cb->prof_events.size() < (size_t)(2 * n)) {
            cudaEvent_t e = nullptr;
            if (cudaEventCreate(&e) != cudaSuccess) {
                ql_ctx_set_error(ctx, QL_ERR_IO, "compute: --profile's events: %s", cudaGetErrorString(cudaGetLastError()));
                return QL_ERR_IO;
            }
            cb->prof_events.push_back(e);
        }
        timed.reserve((size_t)n);
    }
    int made = -1;  // the last node made by the launch of an earlier one (ql_cuda_launch_joins)
    for (int i = ex.first; i < ex.last && !c.failed; i++) {
        ql_tensor *node = ql_graph_node(g, i);
        for (int k : sch.wait_before[(size_t)i])
            if (cudaStreamWaitEvent(c.stream, cb->events[(size_t)(2 * k + 1)], 0) != cudaSuccess) {
                snprintf(c.err, sizeof(c.err), "cudaStreamWaitEvent: %s", cudaGetErrorString(cudaGetLastError()));
                c.failed = true;
            }
        if (sch.slot[(size_t)i] >= 0 && !c.failed) {  // a copy: on the copy stream, after what the compute stream did so far
            cudaEvent_t reached = cb->events[(size_t)(2 * sch.slot[(size_t)i])], done = cb->events[(size_t)(2 * sch.slot[(size_t)i] + 1)];
            const bool ok = cudaEventRecord(reached, c.stream) == cudaSuccess &&
                            cudaStreamWaitEvent(cb->copy_stream, reached, 0) == cudaSuccess &&
                            cudaMemcpyAsync(node->data, node->src[0]->data, ql_nbytes(node), cudaMemcpyDefault, cb->copy_stream) ==
                                cudaSuccess &&
                            cudaEventRecord(done, cb->copy_stream) == cudaSuccess;
            if (!ok) {
                snprintf(c.err, sizeof(c.err), "%s: %s", ql_op_name(node->op), cudaGetErrorString(cudaGetLastError()));
                c.failed = true;
            }
            c.q8_b = nullptr;  // (a copy may write where decode's 8-bit activations came from)
            continue;
        }
        if (c.failed || cu_noop(node) || i <= made) continue;  // (a launch's nodes: only views between them)
        if (ex.profile && !c.failed && cudaEventRecord(cb->prof_events[(size_t)(2 * i)], c.stream) != cudaSuccess) c.failed = true;
        // a node and the next by one launch (ql_cuda_launch_pair: q's and k's rotations; a norm or its
        // backward and its 16-bit copy), unless the next is timed or checked apart, or its result lies
        // over this one's or a source of it. The copies' waits before the next (and the views between:
        // the first reader of a copy) are made before the launch: earlier, so no later (the census
        // counts the pair whatever the waits)
        int j = i + 1;
        for (; j < ex.last && cu_noop(ql_graph_node(g, j)); j++) {}
        ql_tensor *next = j < ex.last ? ql_graph_node(g, j) : nullptr;
        if (next && !ex.profile && !ex.check_finite && sch.slot[(size_t)j] < 0 && ql_cuda_launch_pair(node, next) &&
            (ql_cuda_tail_over_ok(node, next) || !cu_over_any(node, next))) {
            // more join the launch (ql_cuda_launch_joins): decode's third product of one b's codes;
            // after the rotations, the keys' and values' cache stores
            ql_tensor *grp[QL_CUDA_LAUNCH_MAX] = {node, next};
            int ng = 2;
            for (int k = j + 1; ng < QL_CUDA_LAUNCH_MAX; k++) {
                for (; k < ex.last && cu_noop(ql_graph_node(g, k)); k++) {}
                if (k >= ex.last || sch.slot[(size_t)k] >= 0) break;
                ql_tensor *t = ql_graph_node(g, k);
                bool joins = ql_cuda_launch_joins(grp, ng, t);
                for (int m = 0; joins && m < ng && !ql_cuda_tail_over_ok(grp[0], t); m++) joins = !cu_over_any(grp[m], t);
                if (!joins) break;
                grp[ng++] = t;
                j = k;
            }
            for (int k = i + 1; k <= j && !c.failed; k++)
                for (int w : sch.wait_before[(size_t)k])
                    if (cudaStreamWaitEvent(c.stream, cb->events[(size_t)(2 * w + 1)], 0) != cudaSuccess) {
                        snprintf(c.err, sizeof(c.err), "cudaStreamWaitEvent: %s", cudaGetErrorString(cudaGetLastError()));
                        c.failed = true;
                    }
            cu_pairs_made += ng - 1;
            // decode products and their launch's tails (ql_cuda_gemv_norm / _swiglu / _rope): a norm or
            // SwiGLU ending it writes the codes of the product after it, as its own launch would
            // (ql_cuda_q8_made_by)
            int np = 0;
            while (np < ng && grp[np]->op == QL_OP_MUL_MAT) np++;
            const ql_tensor *tail = node->op == QL_OP_MUL_MAT && np < ng ? grp[ng - 1] : nullptr, *mm = nullptr;
            int qt = 0;
            if (tail) {
                int k = j + 1;
                for (; k < ex.last && cu_noop(ql_graph_node(g, k)); k++) {}
                if (k < ex.last && (qt = ql_cuda_q8_made_by(tail, ql_graph_node(g, k)))) mm = ql_graph_node(g, k);
            }
            if (!c.failed) {
                if (node->op == QL_OP_RMS_NORM_BACK) cu_op_rms_norm_back(c, node, next);
                else if (node->op == QL_OP_RMS_NORM) cu_op_rms_norm(c, node, grp + 1, ng - 1);
                else if (node->op == QL_OP_SWIGLU) cu_op_swiglu(c, node, next);
                else if (node->op == QL_OP_CONT)
                    cu_op_rope(c, next, next->op == QL_OP_ROPE_BACK, ng > 2 ? grp[2] : nullptr, nullptr, nullptr, node);
                else if (node->op == QL_OP_CACHE_STORE) cu_op_cache_store(c, node, next);
                else if (node->op == QL_OP_MUL_MAT) cu_op_gemv_q8(c, grp, np, ql_cuda_mm_q8(node), grp + np, ng - np, mm);
                else cu_op_rope(c, node, node->op == QL_OP_ROPE_BACK, next, ng > 2 ? grp[2] : nullptr, ng > 3 ? grp[3] : nullptr);
            }
            for (int m = 0; m < ng; m++) cu_q8_after(c, grp[m]);  // (as cu_run_node: decode's 8-bit activations dropped where written over)
            if (mm) cu_q8_made(c, mm, qt, tail->op == QL_OP_SWIGLU ? ql_cuda_q8_codes_at(mm) : 0);
            made = j;
        } else if (int qb = next && !ex.profile && !ex.check_finite ? ql_cuda_q8_made_by(node, next) : 0) {
            // decode: a norm or SwiGLU and the codes of the product after it, which reads them (one launch fewer)
            cu_q8_after(c, node);
            cu_op_q8_made_by(c, node, next, qb);
        } else {
            cu_run_node(c, node);
        }
        if (ex.profile && !c.failed) {
            if (cudaEventRecord(cb->prof_events[(size_t)(2 * i + 1)], c.stream) != cudaSuccess) c.failed = true;
            timed.push_back(i);
        }
        if (ex.check_finite && !c.failed && is_float_type_cu(node->type)) {
            unsigned long long *d = (unsigned long long *)cb->d_scratch, h = ~0ull;
            if (!cuda_memset(be, d, 0xff, sizeof(h), err, sizeof(err))) break;
            QL_LAUNCH(k_first_nonfinite, cu_grid(ql_nelements(node)), CU_BLOCK, 0, c.stream, cu_of(node), ql_nelements(node), d);
            if (cudaGetLastError() != cudaSuccess || !cuda_copy(be, &h, d, sizeof(h), QL_COPY_TO_HOST, false, err, sizeof(err))) {
                snprintf(c.err, sizeof(c.err), "check_finite: %s", err);
                c.failed = true;
                break;
            }
            if (h != ~0ull) {
                ql_graph_fail_nonfinite(g, i, (int64_t)(h / 2), (h & 1) != 0);
                return ql_ctx_status(ctx);
            }
        }
        if (c.failed) {
            ql_ctx_set_error(ctx, QL_ERR_IO, "compute: node %d (%s): %s", i, ql_op_name(node->op), c.err);
            return QL_ERR_IO;
        }
    }
    // the copy stream joined: what follows the run on the compute stream (a read of the results,
    // the next run over the same buffer) comes after every copy, waited for inside or not
    if (sch.n_copies && !c.failed &&
        (cudaEventRecord(cb->joined, cb->copy_stream) != cudaSuccess || cudaStreamWaitEvent(c.stream, cb->joined, 0) != cudaSuccess)) {
        snprintf(c.err, sizeof(c.err), "joining the copy stream: %s", cudaGetErrorString(cudaGetLastError()));
        c.failed = true;
    }
    if (ex.profile && !c.failed) {
        if (cudaStreamSynchronize(c.stream) != cudaSuccess) {
            snprintf(c.err, sizeof(c.err), "--profile: %s", cudaGetErrorString(cudaGetLastError()));
            c.failed = true;
        }
        for (size_t j = 0; j < timed.size() && !c.failed; j++) {
            float ms = 0.0f;
            if (cudaEventElapsedTime(&ms, cb->prof_events[(size_t)(2 * timed[j])], cb->prof_events[(size_t)(2 * timed[j] + 1)]) == cudaSuccess)
                ql_graph_add_node_seconds(g, timed[j], ms * 1e-3);
        }
    }
    if (c.failed) {
        ql_ctx_set_error(ctx, QL_ERR_IO, "compute: %s", c.err);
        return QL_ERR_IO;
    }
    return QL_OK;
}

// What a captured run depends on besides the device data it reads when it runs: the buffers,
// every node's op, parameters, shape, strides and addresses (a kernel argument is baked into
// the graph). Any change makes a new capture.
static uint64_t cu_graph_key(const ql_graph *g, const ql_graph_exec &ex) {
    uint64_t h = 0x243F6A8885A308D3ull;
    auto mix = [&h](uint64_t v) {
        h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    };
    mix((uintptr_t)ex.buffer), mix(ex.buffer_size), mix((uintptr_t)ex.work), mix(ex.work_size);
    const int n = ql_graph_n_nodes(g);
    mix((uint64_t)n), mix((uint64_t)ex.first), mix((uint64_t)ex.last);
    for (int i = 0; i < n; i++) {
        const ql_tensor *t = ql_graph_node(g, i);
        mix((uint64_t)t->op), mix((uint64_t)t->type), mix((uintptr_t)t->data);
        for (int d = 0; d < 4; d++) mix((uint64_t)t->ne[d]), mix((uint64_t)t->nb[d]);
        for (int p = 0; p < QL_MAX_OP_PARAMS; p++) mix((uint32_t)t->op_params[p]);
        for (const ql_tensor *sr : t->src) mix(sr ? (uintptr_t)sr->data : 0);
    }
    return h;
}

static void cu_graph_drop(cu_schedule &sch) {  // (a new key or plan: the next capture is tried afresh)
    if (sch.exec) cudaGraphExecDestroy(sch.exec);
    sch.exec = nullptr;
    sch.runs = 0;
    sch.refused = false;
}

static ql_status cuda_graph_compute(ql_backend *be, ql_graph *g) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    ql_context *ctx = ql_graph_ctx(g);
    ql_graph_exec ex;
    ql_graph_get_exec(g, &ex);
    if (!cu_use(cb)) {
        ql_ctx_set_error(ctx, QL_ERR_IO, "compute: cannot make CUDA device %d current", cb->device);
        return QL_ERR_IO;
    }
    // every leaf a kernel will read must be this device's memory: a weight never placed (or placed
    // on another device of a split) is an error, not a fault
    for (int i = ex.first; i < ex.last; i++) {
        const ql_tensor *node = ql_graph_node(g, i);
        if (node->op == QL_OP_TO_DEVICE) continue;  // (a host leaf's copy, ql_to_device: reads host memory by design)
        for (const ql_tensor *s : node->src) {
            if (!s || s->op != QL_OP_NONE) continue;
            const int dev = s->data && ql_nbytes(s) > 0 ? cu_device_of_ptr(s->data) : -1;
            if (dev == -2) {
                ql_ctx_set_error(ctx, QL_ERR_INVALID, "compute: %s '%s' holds host memory, not %s's --> hint: "
                                 "ql_backend_place_ctx_tensors (weights, adapters) or ql_backend_alloc_ctx_tensors",
                                 ql_op_name(s->op), s->name, be->iface.name);
                return QL_ERR_INVALID;
            }
            if (dev >= 0 && dev != cb->device) {
                ql_ctx_set_error(ctx, QL_ERR_INVALID, "compute: '%s' is on CUDA device %d, the graph runs on device %d", s->name, dev,
                                 cb->device);
                return QL_ERR_INVALID;
            }
        }
    }
    cu_ctx c = cu_ctx_of(cb);
    c.work = ex.work;
    c.work_size = ex.work_size;
    // offload: each copy runs on the copy stream once the compute stream reaches it; the compute
    // stream waits only where it must (cu_copy_schedule). Made once per graph and plan.
    cu_schedule &sch = cb->schedules[{g, ex.first}];
    if (sch.plan_id != ql_graph_plan_id(g)) {
        cu_graph_drop(sch);
        cu_copy_schedule(g, &sch);
        const int n_copies = sch.n_copies;
        if (n_copies && !cb->copy_stream && cudaStreamCreateWithFlags(&cb->copy_stream, cudaStreamNonBlocking) != cudaSuccess) {
            ql_ctx_set_error(ctx, QL_ERR_IO, "compute: creating the copy stream: %s", cudaGetErrorString(cudaGetLastError()));
            return QL_ERR_IO;
        }
        while ((int)cb->events.size() < 2 * n_copies || (n_copies && !cb->joined)) {
            cudaEvent_t e = nullptr;
            if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
                ql_ctx_set_error(ctx, QL_ERR_IO, "compute: creating an event: %s", cudaGetErrorString(cudaGetLastError()));
                return QL_ERR_IO;
            }
            if (!cb->joined) cb->joined = e;
            else cb->events.push_back(e);
        }
    }
    // CUDA graphs: a run seen twice with the same key is captured (nothing in it syncs with the
    // host, allocates or reads device data on the host) and from then on replayed in one launch.
    // Eager: timing nodes, looking for non-finite results, poisoning the buffer, or graphs off.
    if (!cb->graphs || ex.profile || ex.check_finite || ex.poison) {
        cb->counts.eager++;
        return cu_graph_enqueue(be, g, ex, sch, c);
    }
    const uint64_t key = cu_graph_key(g, ex);
    if (sch.key != key) {
        cu_graph_drop(sch);
        sch.key = key;
    }
    if (sch.refused) {
        cb->counts.eager++;
        return cu_graph_enqueue(be, g, ex, sch, c);
    }
    if (!sch.exec && ++sch.runs < 2) {  // (the first run eager: kernels and cuBLAS loaded outside any capture)
        cb->counts.eager++;
        return cu_graph_enqueue(be, g, ex, sch, c);
    }
    if (!sch.exec) {
        // A capture records, it runs nothing: where the device will not make the graph (a long
        // sequence's ~10^6 launches, its executable's memory on a full card) the same run goes
        // node by node, now and for this plan's later runs, and one line says so
        const cudaError_t eb = cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal);
        const ql_status st = eb == cudaSuccess ? cu_graph_enqueue(be, g, ex, sch, c) : QL_OK;
        cudaGraph_t graph = nullptr;
        const cudaError_t e = eb != cudaSuccess ? eb : cudaStreamEndCapture(c.stream, &graph);
        const cudaError_t ei = e == cudaSuccess && st == QL_OK ? cudaGraphInstantiate(&sch.exec, graph, 0) : cudaSuccess;
        if (graph) cudaGraphDestroy(graph);
        if (st != QL_OK || e != cudaSuccess || ei != cudaSuccess) {
            (void)cudaGetLastError();  // (a failed capture's error is not the next launch's)
            sch.exec = nullptr;
            if (st != QL_OK) return st;  // (the run's own error, not the graph's)
            fprintf(stderr, "qlora: cuda: a run of %d nodes could not be made a CUDA graph (%s): it runs node by node\n",
                    ql_graph_n_nodes(g), cudaGetErrorString(e != cudaSuccess ? e : ei));
            sch.refused = true;
            cb->counts.refused++;
            cb->counts.eager++;
            c = cu_ctx_of(cb);  // (what the capture's enqueue noted, e.g. the decode codes made, was never run)
            c.work = ex.work;
            c.work_size = ex.work_size;
            return cu_graph_enqueue(be, g, ex, sch, c);
        }
        cb->counts.captured++;
    }
    if (cudaGraphLaunch(sch.exec, c.stream) != cudaSuccess) {
        ql_ctx_set_error(ctx, QL_ERR_IO, "compute: launching the CUDA graph: %s", cudaGetErrorString(cudaGetLastError()));
        return QL_ERR_IO;
    }
    cb->counts.launched++;
    return QL_OK;
}

void ql_cuda_set_graphs(ql_backend *be, bool on) {
    if (!ql_backend_is_cuda(be)) return;
    cuda_backend *cb = (cuda_backend *)be->impl;
    cb->graphs = on;
    if (!on)
        for (auto &kv : cb->schedules) cu_graph_drop(kv.second);
}

bool ql_cuda_get_graph_counts(const ql_backend *be, ql_cuda_graph_counts *counts) {
    if (!counts) return false;
    *counts = ql_cuda_graph_counts{};
    if (!ql_backend_is_cuda(be)) return false;
    *counts = ((const cuda_backend *)be->impl)->counts;
    return true;
}

static void cuda_free(ql_backend *be) {
    cuda_backend *cb = (cuda_backend *)be->impl;
    if (!cu_use(cb)) (void)cudaGetLastError();  // (freed anyway)
    for (auto &kv : cb->schedules) cu_graph_drop(kv.second);
    if (cb->blas) cublasDestroy(cb->blas);
    if (cb->lt) cublasLtDestroy(cb->lt);
    if (cb->blas_work) cudaFree(cb->blas_work);
    if (cb->joined) cudaEventDestroy(cb->joined);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    if (cb->copy_stream) cudaStreamDestroy(cb->copy_stream);
    for (cudaEvent_t e : cb->events) cudaEventDestroy(e);
    for (cudaEvent_t e : cb->prof_events) cudaEventDestroy(e);
    cu_mm_side_free(cb->mm_side);
    cu_device_free(cb->d_scratch);
    cuda_host_free(cb->h_scratch);
    delete cb;
    delete be;
}

int ql_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

ql_status ql_cuda_device_get_info(int device, ql_cuda_device_info *info, char *err, size_t err_size) {
    if (!info) return QL_ERR_INVALID;
    memset(info, 0, sizeof(*info));
    const int n = ql_cuda_device_count();
    if (device < 0 || device >= n) {
        if (err && err_size) snprintf(err, err_size, n ? "no CUDA device %d (there are %d)" : "no CUDA device", device, n);
        return QL_ERR_INVALID;
    }
    cudaDeviceProp p;
    size_t free_b = 0, total_b = 0;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess || cudaSetDevice(device) != cudaSuccess ||
        cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        if (err && err_size) snprintf(err, err_size, "CUDA device %d: %s", device, cudaGetErrorString(e));
        return QL_ERR_IO;
    }
    snprintf(info->name, sizeof(info->name), "%s", p.name);
    info->major = p.major;
    info->minor = p.minor;
    info->total_mem = total_b;
    info->free_mem = free_b;
    info->n_sm = p.multiProcessorCount;
    return QL_OK;
}

ql_backend *ql_backend_cuda_init(int device, char *err, size_t err_size) {
    char tmp[256];
    if (!err || !err_size) err = tmp, err_size = sizeof(tmp);
    ql_cuda_device_info info;
    if (ql_cuda_device_get_info(device, &info, err, err_size) != QL_OK) return nullptr;
    if (info.major * 10 + info.minor < 75) {
        snprintf(err, err_size, "CUDA device %d (%s) has compute capability %d.%d; qlora needs 7.5 or newer", device,
                 info.name, info.major, info.minor);
        return nullptr;
    }
    cuda_backend *cb = new (std::nothrow) cuda_backend();
    ql_backend *be = new (std::nothrow) ql_backend();
    if (!cb || !be) {
        delete cb;
        delete be;
        snprintf(err, err_size, "out of host memory");
        return nullptr;
    }
    cb->device = device;
    be->iface = {"cuda", cuda_supports_op, cuda_work_size, cuda_buffer_alloc, cuda_buffer_free, cuda_graph_compute,
                 cuda_free, cuda_host_alloc, cuda_host_free, cuda_copy, cuda_memset, cuda_synchronize,
                 cuda_adamw_update, cuda_grad_stats, cuda_grad_stats_multi, cuda_adamw_update_multi, cuda_weight_copy};
    be->impl = cb;
    be->id = ql_backend_new_id();
    bool ok = cudaGetDeviceProperties(&cb->prop, device) == cudaSuccess &&
              cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking) == cudaSuccess;
    if (ok && cublasCreate(&cb->blas) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, err_size, "cublasCreate failed on device %d", device);
        cuda_free(be);
        return nullptr;
    }
    ok = ok && cublasSetStream(cb->blas, cb->stream) == CUBLAS_STATUS_SUCCESS &&
         cublasSetMathMode(cb->blas, CUBLAS_DEFAULT_MATH) == CUBLAS_STATUS_SUCCESS;  // f32 stays f32: no TF32
    // cuBLAS's workspace: ours, of the size the plan counts in the context (not in qlora's own
    // allocations), so that a captured graph allocates nothing and every capture shares it.
    // After cublasSetStream, which resets it to cuBLAS's own pool (the shim does the same)
    const size_t blas_ws = ql_cuda_cublas_workspace_bytes(info.major * 10 + info.minor);
    ok = ok && cudaMalloc(&cb->blas_work, blas_ws) == cudaSuccess &&
         cublasSetWorkspace(cb->blas, cb->blas_work, blas_ws) == CUBLAS_STATUS_SUCCESS && cublasLtCreate(&cb->lt) == CUBLAS_STATUS_SUCCESS;
    cb->blas_work_size = blas_ws;
    const char *graphs = getenv("QLORA_CUDA_GRAPHS");
    cb->graphs = !graphs || strcmp(graphs, "0") != 0;  // on by default
    cb->d_scratch = ok ? (int *)cu_device_alloc(4096) : nullptr;
    cb->h_scratch = ok ? (int *)cuda_host_alloc(be, 4096) : nullptr;
    ok = ok && cb->d_scratch && cudaMemsetAsync(cb->d_scratch, 0, 4096, cb->stream) == cudaSuccess;
    if (ok && cb->d_scratch && cb->h_scratch && info.major >= 8) {  // the fragment layout the register path needs, checked once
        QL_LAUNCH(k_fa2_probe<__nv_bfloat16>, 1, 32, 0, cb->stream, cb->d_scratch);
        ok = cudaGetLastError() == cudaSuccess &&
             cudaMemcpyAsync(cb->h_scratch, cb->d_scratch, sizeof(int), cudaMemcpyDeviceToHost, cb->stream) == cudaSuccess &&
             cudaStreamSynchronize(cb->stream) == cudaSuccess;
        cb->fa2_reg = ok && cb->h_scratch[0] == 1 && !(getenv("QLORA_CUDA_FA2_REG") && strcmp(getenv("QLORA_CUDA_FA2_REG"), "0") == 0);
    }
    if (!ok || !cb->d_scratch || !cb->h_scratch) {
        snprintf(err, err_size, "CUDA device %d (%s) failed to start: %s", device, info.name,
                 cudaGetErrorString(cudaGetLastError()));
        cuda_free(be);
        return nullptr;
    }
    return be;
}

bool ql_backend_is_cuda(const ql_backend *be) { return be && be->iface.graph_compute == cuda_graph_compute; }
bool ql_cuda_fa2_register_path(const ql_backend *be) { return ql_backend_is_cuda(be) && ((const cuda_backend *)be->impl)->fa2_reg; }

ql_status ql_backend_cuda_info(const ql_backend *be, ql_cuda_device_info *info) {
    if (!info) return QL_ERR_INVALID;
    if (!ql_backend_is_cuda(be)) {
        memset(info, 0, sizeof(*info));
        return QL_ERR_INVALID;
    }
    char err[128];
    return ql_cuda_device_get_info(((const cuda_backend *)be->impl)->device, info, err, sizeof(err));
}

ql_status ql_cuda_copy_peer(ql_backend *to, void *dst, ql_backend *from, const void *src, size_t size) {
    if (!ql_backend_is_cuda(to) || !ql_backend_is_cuda(from) || (!dst && size) || (!src && size)) return QL_ERR_UNSUPPORTED;
    cuda_backend *ct = (cuda_backend *)to->impl, *cf = (cuda_backend *)from->impl;
    if (size == 0) return QL_OK;
    // from's work done (the source complete); the copy queued on to's stream (before its next run)
    if (!cu_use(cf) || cudaStreamSynchronize(cf->stream) != cudaSuccess || !cu_use(ct)) return QL_ERR_IO;
    if (ct->device != cf->device) {
        static std::mutex mu;
        static std::set<std::pair<int, int>> enabled;  // (to, from) pairs tried
        std::lock_guard<std::mutex> lk(mu);
        if (enabled.insert({ct->device, cf->device}).second) {
            int can = 0;
            if (cudaDeviceCanAccessPeer(&can, ct->device, cf->device) == cudaSuccess && can &&
                cudaDeviceEnablePeerAccess(cf->device, 0) != cudaSuccess)
                (void)cudaGetLastError();  // (already enabled, or refused: the copy still goes, staged)
        }
    }
    if (cudaMemcpyPeerAsync(dst, ct->device, src, cf->device, size, ct->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return QL_ERR_IO;
    }
    return QL_OK;
}

bool ql_cuda_device_memory_used(const ql_backend *be, size_t *in_use, size_t *peak) {
    if (!ql_backend_is_cuda(be)) return false;
    cu_registry &r = cu_reg();
    std::lock_guard<std::mutex> lk(r.mu);
    auto it = r.per_device.find(((const cuda_backend *)be->impl)->device);
    if (in_use) *in_use = it == r.per_device.end() ? 0 : it->second.first;
    if (peak) *peak = it == r.per_device.end() ? 0 : it->second.second;
    return true;
}

bool ql_cuda_memory_used(size_t *in_use, size_t *peak) {
    cu_registry &r = cu_reg();
    std::lock_guard<std::mutex> lk(r.mu);
    if (in_use) *in_use = r.in_use;
    if (peak) *peak = r.peak;
    return true;
}
void ql_cuda_memory_set_peaks(const ql_backend *be, size_t peak, size_t device_peak) {
    cu_registry &r = cu_reg();
    std::lock_guard<std::mutex> lk(r.mu);
    r.peak = std::max(peak, r.in_use);
    if (!ql_backend_is_cuda(be)) return;
    auto it = r.per_device.find(((const cuda_backend *)be->impl)->device);
    if (it != r.per_device.end()) it->second.second = std::max(device_peak, it->second.first);
}
