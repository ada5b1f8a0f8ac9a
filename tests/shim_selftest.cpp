// tests/shim_selftest.cpp - the CUDA shim itself: that kernels compute what they would on a
// GPU, and that what a GPU would hide (a missing or divergent barrier, a deadlock, a shuffle in a
// partial warp, a bad launch) is reported. Part of build/test-cuda-shim.
#include "cuda_shim.h"

#include "../qlora.h"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

namespace {

// RMS norm of each row: shared memory, two barriers, a warp shuffle
__global__ void k_rms(const float *x, float *y, int n) {
    __shared__ float partial[32];
    const float *row = x + (size_t)blockIdx.x * n;
    float s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += row[i] * row[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
        if (threadIdx.x == 0) partial[0] = t;
    }
    __syncthreads();
    const float r = 1.0f / std::sqrt(partial[0] / n + 1e-6f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[(size_t)blockIdx.x * n + i] = row[i] * r;
}

// thread t writes shared[t], then reads its neighbour's: right only with the barrier
__global__ void k_neighbour(float *out, int with_barrier, float salt) {
    __shared__ float sh[64];
    sh[threadIdx.x] = (float)threadIdx.x + salt;
    if (with_barrier) __syncthreads();
    out[threadIdx.x] = sh[(threadIdx.x + 1) % 64];
}

__global__ void k_divergent(float *out) {
    if (threadIdx.x < 16) __syncthreads();
    else __syncthreads();
    out[threadIdx.x] = 1;
}

__global__ void k_early_exit(float *out) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

__global__ void k_shuffle(float *out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffff, (float)threadIdx.x, 1); }

__global__ void k_mask_without_me(float *out) {
    out[threadIdx.x] = threadIdx.x == 0 ? __shfl_sync(0x2u, 1.0f, 1) : 0.0f;
}

__global__ void k_lanes(int *out) {
    const int l = threadIdx.x;
    out[l * 5 + 0] = __shfl_down_sync(0xffffffff, l, 3, 16);
    out[l * 5 + 1] = __shfl_up_sync(0xffffffff, l, 2);
    out[l * 5 + 2] = __shfl_sync(0xffffffff, l * 10, 7);
    out[l * 5 + 3] = (int)__ballot_sync(0xffffffff, l % 3 == 0);
    out[l * 5 + 4] = __shfl_xor_sync(0xffffffff, l, 8, 16);
}

__global__ void k_shared_per_block(int *out) {
    __shared__ int v;
    if (threadIdx.x == 0) v = (int)blockIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

__global__ void k_dyn(float *out) {
    QL_DYN_SMEM(float, sm);
    out[threadIdx.x] = sm[threadIdx.x];  // never written: the poison
}

__global__ void k_atomics(float *sum, int *mx) {
    atomicAdd(sum, 1.0f);
    atomicMax(mx, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}

// C [M, N] row major = A [M, K] row major x B [K, N] col major, one warp per 16 x 16 tile
__global__ void k_wmma_gemm(const __half *A, const __half *B, float *C, int M, int N, int K) {
    using namespace nvcuda;
    const int tm = blockIdx.y * 16, tn = blockIdx.x * 16;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(a, A + (size_t)tm * K + k, K);
        wmma::load_matrix_sync(b, B + (size_t)tn * K + k, K);
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + (size_t)tm * N + tn, acc, N, wmma::mem_row_major);
    (void)M;
}

// the same, but scaling the accumulator by guessing which element a lane holds: layout-dependent
__global__ void k_wmma_guess(const __half *A, const __half *B, float *C, int K) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(a, A, K);
    wmma::load_matrix_sync(b, B, K);
    wmma::mma_sync(acc, a, b, acc);
    for (int i = 0; i < acc.num_elements; i++)  // "element lane * 8 + i is row (lane * 8 + i) / 16"
        if ((threadIdx.x * 8 + i) / 16 == 0) acc.x[i] *= 2.0f;  // meant: double row 0
    wmma::store_matrix_sync(C, acc, 16, wmma::mem_row_major);
}

// out[i] = in[i] * k + add: `add` by value, as a graph's kernel node keeps it
__global__ void k_axpb(const float *in, float *out, float k, float add, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * k + add;
}

struct shim_settings {  // every test leaves the shim as it found it
    ~shim_settings() {
        qlshim::set_order(qlshim::ORDER_FORWARD, 1);
        qlshim::set_device(9, 0, (size_t)16 << 30);
        qlshim::set_device_count(1);
        (void)cudaGetLastError();
    }
};

template <typename T> T *dev(size_t n) {
    void *p = nullptr;
    REQUIRE(cudaMalloc(&p, n * sizeof(T)) == cudaSuccess);
    return (T *)p;
}

}  // namespace

TEST_CASE("shim: a reduction with shared memory, barriers and shuffles equals a plain loop, in every order") {
    shim_settings keep;
    const int rows = 37, n = 300;
    std::vector<float> x((size_t)rows * n);
    for (size_t i = 0; i < x.size(); i++) x[i] = std::sin((float)i * 0.37f);
    float *dx = dev<float>(x.size()), *dy = dev<float>(x.size());
    cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    for (qlshim::order_t o : {qlshim::ORDER_FORWARD, qlshim::ORDER_REVERSE, qlshim::ORDER_RANDOM}) {
        qlshim::set_order(o, 7);
        QL_LAUNCH(k_rms, rows, 128, 0, nullptr, dx, dy, n);
        REQUIRE(cudaGetLastError() == cudaSuccess);
        for (int r = 0; r < rows; r++) {
            double s = 0;
            for (int i = 0; i < n; i++) s += (double)x[(size_t)(r * n + i)] * x[(size_t)(r * n + i)];
            const double inv = 1.0 / std::sqrt(s / n + 1e-6);
            for (int i = 0; i < n; i += 37) CHECK(dy[r * n + i] == doctest::Approx(x[(size_t)(r * n + i)] * inv).epsilon(1e-5));
        }
    }
    cudaFree(dx);
    cudaFree(dy);
}

TEST_CASE("shim: a missing barrier gives a wrong answer in some order; with it, right in all") {
    shim_settings keep;
    float *out = dev<float>(64);
    float salt = 0;
    auto run = [&](qlshim::order_t o, int barrier) {
        qlshim::set_order(o, 3);
        salt += 1000;  // what an earlier launch left in shared memory is never this launch's value
        QL_LAUNCH(k_neighbour, 1, 64, 0, nullptr, out, barrier, salt);
        REQUIRE(cudaGetLastError() == cudaSuccess);
        int right = 0;
        for (int t = 0; t < 64; t++) right += out[t] == (float)((t + 1) % 64) + salt;
        return right;
    };
    // forward: thread t reads t+1's slot before t+1 ran (only thread 63 reads a written one);
    // reverse: only thread 63 reads too early
    CHECK(run(qlshim::ORDER_FORWARD, 0) == 1);
    CHECK(run(qlshim::ORDER_REVERSE, 0) == 63);
    for (qlshim::order_t o : {qlshim::ORDER_FORWARD, qlshim::ORDER_REVERSE, qlshim::ORDER_RANDOM}) CHECK(run(o, 1) == 64);
    cudaFree(out);
}

TEST_CASE("shim: divergent barriers, deadlocks, partial warps, foreign masks and bad launches are reported") {
    shim_settings keep;
    float *out = dev<float>(1024);
    auto fails_with = [&](const std::string &what) {
        CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
        CHECK_MESSAGE(qlshim::last_error_message().find(what) != std::string::npos, qlshim::last_error_message());
    };
    QL_LAUNCH(k_divergent, 1, 32, 0, nullptr, out);
    fails_with("divergent __syncthreads");
    CHECK(qlshim::last_error_message().find("shim_selftest.cpp:44") != std::string::npos);  // both call sites
    CHECK(qlshim::last_error_message().find("shim_selftest.cpp:45") != std::string::npos);
    QL_LAUNCH(k_early_exit, 1, 32, 0, nullptr, out);
    fails_with("deadlock: 1 thread(s) exited while thread");
    QL_LAUNCH(k_shuffle, 1, 48, 0, nullptr, out);
    fails_with("partial warp");
    QL_LAUNCH(k_shuffle, 1, 64, 0, nullptr, out);  // whole warps: fine
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(out[0] == 1.0f);
    CHECK(out[33] == 32.0f);
    QL_LAUNCH(k_mask_without_me, 1, 32, 0, nullptr, out);
    fails_with("does not name the calling lane");
    QL_LAUNCH(k_shuffle, 1, 1025, 0, nullptr, out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    QL_LAUNCH(k_dyn, 1, 32, 64 << 10, nullptr, out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    REQUIRE(cudaFuncSetAttribute(k_dyn, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10) == cudaSuccess);
    QL_LAUNCH(k_dyn, 1, 32, 64 << 10, nullptr, out);
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(std::isnan(out[5]));  // dynamic shared memory starts poisoned
    cudaFree(out);
}

TEST_CASE("shim: shuffle, ballot and width semantics; shared memory per block; atomics across blocks") {
    shim_settings keep;
    int *o = dev<int>(32 * 5);
    QL_LAUNCH(k_lanes, 1, 32, 0, nullptr, o);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    for (int l = 0; l < 32; l++) {
        CHECK(o[l * 5 + 0] == (l % 16 + 3 < 16 ? l + 3 : l));  // down within 16-lane segments
        CHECK(o[l * 5 + 1] == (l >= 2 ? l - 2 : l));
        CHECK(o[l * 5 + 2] == 70);
        CHECK((unsigned)o[l * 5 + 3] == 0x49249249u);
        CHECK(o[l * 5 + 4] == (l ^ 8));
    }
    int *pb = dev<int>(64 * 40);
    QL_LAUNCH(k_shared_per_block, 40, 64, 0, nullptr, pb);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    for (int b = 0; b < 40; b++) CHECK(pb[b * 64 + 63] == b);
    float *sum = dev<float>(1);
    int *mx = dev<int>(1);
    *sum = 0;
    *mx = -1;
    QL_LAUNCH(k_atomics, 50, 96, 0, nullptr, sum, mx);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    CHECK(*sum == 4800.0f);
    CHECK(*mx == 4799);
    cudaFree(o);
    cudaFree(pb);
    cudaFree(sum);
    cudaFree(mx);
}

TEST_CASE("shim: cuBLAS' GEMM: transposes, batches with a broadcast A, 16-bit inputs, argument checks, beta 0") {
    shim_settings keep;
    cublasHandle_t h = nullptr;
    REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    const int m = 5, n = 4, k = 7, batch = 3;
    std::vector<float> A((size_t)m * k), B((size_t)k * n * batch), C((size_t)m * n * batch, NAN);
    for (size_t i = 0; i < A.size(); i++) A[i] = (float)((int)(i * 7 % 11) - 5);
    for (size_t i = 0; i < B.size(); i++) B[i] = (float)((int)(i * 5 % 9) - 4) * 0.5f;
    const float one = 1, zero = 0;
    // A stored k x m (op T), B k x n per batch (op N), A shared by every batch (stride 0)
    REQUIRE(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A.data(), CUDA_R_32F, k, 0, B.data(), CUDA_R_32F, k,
                                       (long long)k * n, &zero, C.data(), CUDA_R_32F, m, (long long)m * n, batch, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double want = 0;
                for (int p = 0; p < k; p++) want += (double)A[(size_t)(p + i * k)] * B[(size_t)(b * k * n + p + j * k)];
                CHECK(C[(size_t)(b * m * n + i + j * m)] == doctest::Approx(want));
            }
    std::vector<__nv_bfloat16> Ab(A.size()), Bb(B.size());
    for (size_t i = 0; i < A.size(); i++) Ab[i] = __float2bfloat16_rn(A[i]);
    for (size_t i = 0; i < B.size(); i++) Bb[i] = __float2bfloat16_rn(B[i]);
    std::vector<float> C2(C.size(), NAN);
    REQUIRE(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, Ab.data(), CUDA_R_16BF, k, 0, Bb.data(), CUDA_R_16BF,
                                       k, (long long)k * n, &zero, C2.data(), CUDA_R_32F, m, (long long)m * n, batch,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    CHECK(C2 == C);  // small integers and halves: exact in bf16
    // lda below the rows of op(A): refused as cuBLAS does; mixed input types: not supported
    CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A.data(), CUDA_R_32F, m - 1, 0, B.data(), CUDA_R_32F, k,
                                     0, &zero, C.data(), CUDA_R_32F, m, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) ==
          CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A.data(), CUDA_R_32F, k, 0, Bb.data(), CUDA_R_16BF, k,
                                     0, &zero, C.data(), CUDA_R_32F, m, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) ==
          CUBLAS_STATUS_NOT_SUPPORTED);
    qlshim::set_device(7, 5, (size_t)16 << 30);  // a T4 has no bf16 GEMM
    CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, Ab.data(), CUDA_R_16BF, k, 0, Bb.data(), CUDA_R_16BF,
                                     k, 0, &zero, C2.data(), CUDA_R_32F, m, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) ==
          CUBLAS_STATUS_ARCH_MISMATCH);
    cublasDestroy(h);
}

TEST_CASE("shim: device memory is counted and limited; no device is an answer, not a crash") {
    shim_settings keep;
    qlshim::set_device(8, 6, (size_t)1 << 20);  // a 1 MiB device
    void *a = nullptr, *b = nullptr;
    REQUIRE(cudaMalloc(&a, 700 << 10) == cudaSuccess);
    CHECK(qlshim::device_bytes_in_use() == (size_t)(700 << 10));
    CHECK(cudaMalloc(&b, 400 << 10) == cudaErrorMemoryAllocation);
    CHECK(b == nullptr);
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    CHECK(fr == (size_t)(324 << 10));
    CHECK(((unsigned char *)a)[12345] == 0xff);  // fresh memory is garbage
    cudaFree(a);
    CHECK(qlshim::device_bytes_in_use() == 0);
    qlshim::set_device_count(0);
    int n = -1;
    CHECK(cudaGetDeviceCount(&n) == cudaErrorNoDevice);
    CHECK(n == 0);
    char err[256] = "";
    CHECK(ql_backend_cuda_init(0, err, sizeof(err)) == nullptr);
    CHECK(std::string(err) == "no CUDA device");
}

TEST_CASE("shim: the CUDA backend out of device memory: weights and the planned buffer refused with what did not fit") {
    shim_settings keep;
    qlshim::set_device(8, 0, (size_t)8 << 20);  // an 8 MiB GPU: 4 of it cuBLAS's workspace
    char err[256] = "";
    ql_backend *be = ql_backend_cuda_init(0, err, sizeof(err));
    REQUIRE_MESSAGE(be, err);
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_F32, 1024, 1024);  // 4 MiB of weights
    CHECK(ql_backend_place_ctx_tensors(be, ctx) == nullptr);
    CHECK_MESSAGE(std::string(ql_ctx_error(ctx)).find("could not allocate 4.0 MiB for the weights") != std::string::npos,
                  ql_ctx_error(ctx));
    CHECK(w->data != nullptr);  // still the host's: nothing moved
    ql_free(ctx);
    // weights that fit, a planned buffer that does not
    ctx = ql_init(ip);
    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 512), *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 1024);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, ql_mul_mat(ctx, a, x)) == QL_OK);
    ql_backend_buffer *buf = ql_backend_place_ctx_tensors(be, ctx);
    REQUIRE_MESSAGE(buf, ql_ctx_error(ctx));
    CHECK(ql_graph_alloc(g, be) == QL_ERR_NOMEM);
    CHECK_MESSAGE(std::string(ql_ctx_error(ctx)).find("backend cuda could not allocate 2097152 bytes for the planned buffer") !=
                      std::string::npos,
                  ql_ctx_error(ctx));
    ql_graph_free(g);
    ql_backend_buffer_free(buf);
    ql_free(ctx);
    ql_backend_free(be);
}

TEST_CASE("shim: WMMA - a tiled GEMM equals a plain loop; code that guesses the fragment layout is caught") {
    shim_settings keep;
    const int M = 32, N = 32, K = 48;
    std::vector<__half> A((size_t)M * K), B((size_t)N * K);  // B col major: column n at B + n K
    std::vector<float> a((size_t)M * K), b((size_t)N * K);
    for (size_t i = 0; i < A.size(); i++) A[i] = __float2half_rn(a[i] = (float)((int)(i * 7 % 13) - 6) * 0.25f);
    for (size_t i = 0; i < B.size(); i++) B[i] = __float2half_rn(b[i] = (float)((int)(i * 5 % 11) - 5) * 0.5f);
    __half *dA = dev<__half>(A.size()), *dB = dev<__half>(B.size());
    float *dC = dev<float>((size_t)M * N);
    cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    QL_LAUNCH(k_wmma_gemm, dim3(N / 16, M / 16), 32, 0, nullptr, dA, dB, dC, M, N, K);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float want = 0;
            for (int k = 0; k < K; k++) want += a[(size_t)(m * K + k)] * b[(size_t)(n * K + k)];
            CHECK(dC[m * N + n] == want);  // quarters and halves: exact
        }
    QL_LAUNCH(k_wmma_guess, 1, 32, 0, nullptr, dA, dB, dC, K);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    int row0_doubled = 0, others_doubled = 0;
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float want = 0;
            for (int k = 0; k < 16; k++) want += a[(size_t)(m * K + k)] * b[(size_t)(n * K + k)];
            if (want == 0) continue;
            const bool doubled = dC[m * 16 + n] == 2 * want;
            (m == 0 ? row0_doubled : others_doubled) += doubled;
        }
    CHECK(others_doubled > 0);  // the guess scaled elements outside row 0: wrong, as it would be on some GPU
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
}

TEST_CASE("shim: stream capture records, a graph launch replays in order; what a capture forbids fails and invalidates it") {
    shim_settings keep;
    const int n = 64;
    float *a = dev<float>(n), *b = dev<float>(n), *c = dev<float>(n);
    std::vector<float> h(n), got(n);
    for (int i = 0; i < n; i++) h[i] = (float)i;
    cudaStream_t s = nullptr, side = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess);
    cudaEvent_t fork, join;
    cudaEventCreate(&fork);
    cudaEventCreate(&join);
    cublasHandle_t blas;
    cublasCreate(&blas);
    cublasSetStream(blas, s);
    REQUIRE(cudaMemcpy(a, h.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);

    // a kernel, a copy forked onto a second stream and joined back, a memset: nothing runs while capturing
    float add = 1.0f;
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    cudaStreamCaptureStatus cs;
    CHECK((cudaStreamIsCapturing(s, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive));
    QL_LAUNCH(k_axpb, 1, n, 0, s, a, b, 2.0f, add, n);
    add = 100.0f;  // the graph keeps the argument it was captured with
    cudaEventRecord(fork, s);
    cudaStreamWaitEvent(side, fork, 0);  // side joins the capture
    cudaMemcpyAsync(c, b, n * sizeof(float), cudaMemcpyDeviceToDevice, side);
    cudaEventRecord(join, side);
    cudaStreamWaitEvent(s, join, 0);
    cudaMemsetAsync(b, 0, n * sizeof(float), s);
    CHECK(((unsigned char *)b)[0] == 0xff);  // not run yet
    cudaGraph_t g = nullptr;
    REQUIRE(cudaStreamEndCapture(s, &g) == cudaSuccess);
    cudaGraphExec_t x = nullptr;
    REQUIRE(cudaGraphInstantiate(&x, g, 0) == cudaSuccess);
    cudaGraphDestroy(g);
    for (int rep = 0; rep < 2; rep++) {
        REQUIRE(cudaMemcpy(c, h.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);  // (overwritten by the replay)
        REQUIRE(cudaGraphLaunch(x, s) == cudaSuccess);
        REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
        REQUIRE(cudaMemcpy(got.data(), c, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
        for (int i = 0; i < n; i++) CHECK(got[i] == 2.0f * i + 1.0f);
        CHECK(((float *)b)[5] == 0.0f);
    }
    cudaGraphExecDestroy(x);

    // forbidden while capturing: each invalidates the capture, which then ends in an error
    auto forbidden = [&](const char *what, const std::function<cudaError_t()> &call, cudaError_t want) {
        REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
        CHECK_MESSAGE(call() == want, what);
        cudaGraph_t bad = nullptr;
        CHECK_MESSAGE(cudaStreamEndCapture(s, &bad) == cudaErrorStreamCaptureInvalidated, what);
        CHECK(bad == nullptr);
    };
    void *p = nullptr;
    forbidden("sync", [&] { return cudaStreamSynchronize(s); }, cudaErrorStreamCaptureUnsupported);
    forbidden("malloc", [&] { return cudaMalloc(&p, 16); }, cudaErrorStreamCaptureUnsupported);
    forbidden("sync copy", [&] { return cudaMemcpy(got.data(), c, 4, cudaMemcpyDeviceToHost); }, cudaErrorStreamCaptureUnsupported);
    cudaEventRecord(fork, side);  // recorded outside the capture
    forbidden("outside event", [&] { return cudaStreamWaitEvent(s, fork, 0); }, cudaErrorStreamCaptureIsolation);
    const float one = 1.0f, zero = 0.0f;  // cuBLAS without a workspace of ours
    forbidden("gemm without workspace", [&] {
        return cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, a, CUDA_R_32F, 8, a, CUDA_R_32F, 8, &zero, c, CUDA_R_32F, 8,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED ? cudaSuccess : cudaErrorUnknown;
    }, cudaSuccess);
    // relaxed mode allows an allocation
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    CHECK(cudaMalloc(&p, 16) == cudaSuccess);
    CHECK(cudaFree(p) == cudaSuccess);
    cudaGraph_t ok = nullptr;
    CHECK(cudaStreamEndCapture(s, &ok) == cudaSuccess);
    cudaGraphDestroy(ok);
    // a stream forked and never joined back
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    cudaEventRecord(fork, s);
    cudaStreamWaitEvent(side, fork, 0);
    cudaMemsetAsync(c, 0, 4, side);
    cudaGraph_t unjoined = nullptr;
    CHECK(cudaStreamEndCapture(s, &unjoined) == cudaErrorStreamCaptureUnjoined);
    CHECK(unjoined == nullptr);
    // and nothing is left capturing: eager work runs again
    QL_LAUNCH(k_axpb, 1, n, 0, s, a, b, 1.0f, 0.0f, n);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(((float *)b)[7] == 7.0f);
    cublasDestroy(blas);
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    cudaStreamDestroy(side);
    cudaStreamDestroy(s);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
}
