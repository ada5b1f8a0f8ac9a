// tools/bench - speed of the CPU backend's building blocks.
//
//   tools/bench [all | matmul | block | qmatmul | prompt | attn] [-t threads] [-r reps] [--profile]
//
// matmul: f32 GFLOP/s at 1024^3 and at LoRA-like shapes, then the same shapes with OpenBLAS
//         when the system has it (loaded with dlopen as a yardstick; qlora never links it).
//         The ratio column is qlora's speed over OpenBLAS's (> 1: qlora faster).
// block:  one llama transformer block, forward and forward+backward, at the 110M shape
//         (n_embd 768, 12 heads, ffn 2048), seq 256 and 512.
// qmatmul: a frozen weight in f32, NF4 and Q4_K: forward y = W x and the input gradient
//         dx = W^T dy (dequantised tile by tile), 4096x4096 and 11008x4096, 16/256/2048 tokens.
// prompt: a prompt's multiplies with 8-bit activations (generate, perplexity) against the exact
//         path, Q4_0 / Q8_0 / NF4 / Q4_K, 1B-shaped weights, 64 and 512 tokens, the fastest of -r runs.
// attn:   training attention on the CUDA backend (not part of all): causal, seq 2048, d 128 and 64, 32
//         query / 8 kv heads, batch 1, bf16 products; the fused FlashAttention-2 kernels against the
//         chunked cuBLAS products; forward and backward (fwd+bwd minus fwd) in TFLOP/s, counting
//         the causal half: forward 2 T^2 d H, backward 2.5 times that; then what a trainer's
//         --attn-backward auto chooses at each head dim (ql_cuda_fa_choose) and its two times.
// Times are medians over the repetitions after one warm-up run (attn: two, the second capturing a CUDA graph).
// limitation: random q6_K bytes need ql_block_q6_K (implementer part) to put a sane scale in d
#define QL_INTERNALS
#include "../models/llama.h"
#include "../qlora.h"
#include "cli.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F> static double median_time(int reps, F &&f) {
    f();  // warm-up: page faults, caches
    std::vector<double> t;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        f();
        t.push_back(now_s() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <typename F> static double best_time(int reps, F &&f) {
    f();  // warm-up
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        f();
        best = std::min(best, now_s() - t0);
    }
    return best;
}

// ---- OpenBLAS, if present ----
typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                               float *, int);
typedef void (*set_threads_fn)(int);
struct openblas {
    void *h = nullptr;
    cblas_sgemm_fn sgemm = nullptr;
    openblas(int n_threads) {
        for (const char *name : {"libopenblas.so.0", "libopenblas.so"})
            if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
        if (!h) return;
        sgemm = (cblas_sgemm_fn)dlsym(h, "cblas_sgemm");
        if (set_threads_fn st = (set_threads_fn)dlsym(h, "openblas_set_num_threads")) st(n_threads);
    }
    ~openblas() {
        if (h) dlclose(h);
    }
};

struct mm_shape {
    int M, N, K;
    const char *what;
};
static const mm_shape k_shapes[] = {
    {1024, 1024, 1024, "square"},
    {4096, 16, 4096, "LoRA-like: 16 tokens"},
    {4096, 256, 4096, "256 tokens"},
    {11008, 16, 4096, "ffn up, 16 tokens"},
    {768, 512, 768, "110M attn proj, seq 512"},
    {32000, 1024, 288, "vocab projection, 15M shape, 4x256 tokens"},
    {288, 1024, 32000, "its input gradient"},
};
static const int k_n_shapes = sizeof(k_shapes) / sizeof(k_shapes[0]);

struct mm_data {
    std::vector<float> a, b, c;
};
static mm_data make_data(const mm_shape &s) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> U(-1, 1);
    mm_data d{std::vector<float>((size_t)s.M * s.K), std::vector<float>((size_t)s.N * s.K), std::vector<float>((size_t)s.M * s.N)};
    for (float &x : d.a) x = U(rng);
    for (float &x : d.b) x = U(rng);
    return d;
}
static int reps_for(const mm_shape &s, int reps) { return (double)s.M * s.N * s.K > 2e9 ? std::max(3, reps / 3) : reps; }

static double g_ours_ms[k_n_shapes];
static std::vector<float> g_ours_c[k_n_shapes];

static void bench_matmul(ql_backend *cpu, int n_threads, int reps) {
    printf("## matmul f32, %d threads (%s)\n", n_threads, ql_cpu_features());
    printf("%-26s %10s %10s\n", "shape (M x N x K)", "ms", "GFLOP/s");
    for (int i = 0; i < k_n_shapes; i++) {
        const mm_shape &s = k_shapes[i];
        mm_data d = make_data(s);
        const double t = median_time(reps_for(s, reps), [&] {
            ql_cpu_sgemm(cpu, s.M, s.N, s.K, d.a.data(), s.K, d.b.data(), s.K, d.c.data(), s.M);
        });
        g_ours_ms[i] = t * 1e3;
        g_ours_c[i] = d.c;
        char label[64];
        snprintf(label, sizeof(label), "%dx%dx%d", s.M, s.N, s.K);
        printf("%-26s %10.3f %10.1f   %s\n", label, t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9, s.what);
    }
}

// The same shapes with b in bf16 (the weight a f32, rounded to bf16 as it is packed): what every
// matmul of a --precision bf16 step is. Native where ql_cpu_bf16_native() (AMX tiles or
// AVX512-BF16 pair dots), else widened to f32.
static void bench_matmul_bf16(ql_backend *cpu, int n_threads, int reps) {
    const char *kind = ql_cpu_bf16_kind();  // which kernel the numbers below measure (AMX or pair dots)
    printf("\n## matmul bf16 (b bf16), %d threads, native: %s\n", n_threads, kind ? kind : "no (widened to f32)");
    printf("%-26s %10s %10s %10s\n", "shape (M x N x K)", "ms", "GFLOP/s", "vs f32");
    for (int i = 0; i < k_n_shapes; i++) {
        const mm_shape &s = k_shapes[i];
        mm_data d = make_data(s);
        ql_init_params ip = {(size_t)s.K * (size_t)(s.M + s.N) * 4 + (size_t)s.M * s.N * 4 + (16u << 20), nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, s.K, s.M);
        memcpy(a->data, d.a.data(), d.a.size() * 4);
        ql_tensor *b = ql_new_tensor_2d(ctx, QL_TYPE_BF16, s.K, s.N);
        ql_type_traits_get(QL_TYPE_BF16)->from_float(d.b.data(), b->data, (int64_t)s.K * s.N);
        ql_graph *g = ql_graph_new(ctx);
        ql_graph_build_forward(g, ql_mul_mat(ctx, a, b));
        if (ql_graph_alloc(g, cpu) != QL_OK) {
            fprintf(stderr, "bench: %s\n", ql_ctx_error(ctx));
            exit(1);
        }
        const double t = median_time(reps_for(s, reps), [&] { ql_backend_graph_compute(cpu, g); });
        ql_graph_free(g);
        ql_free(ctx);
        char label[64];
        snprintf(label, sizeof(label), "%dx%dx%d", s.M, s.N, s.K);
        printf("%-26s %10.3f %10.1f %9.2fx   %s\n", label, t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9,
               g_ours_ms[i] > 0 ? g_ours_ms[i] / (t * 1e3) : 0.0, s.what);
    }
}

// OpenBLAS last: its worker threads busy-wait after each call and would steal cores from
// anything measured right after it.
static void bench_openblas(int n_threads, int reps) {
    openblas ob(n_threads);
    printf("\n## yardstick: OpenBLAS cblas_sgemm, same shapes and threads\n");
    if (!ob.sgemm) {
        printf("OpenBLAS not found (Debian: libopenblas0-pthread); skipped\n");
        return;
    }
    printf("%-26s %10s %10s %14s %12s\n", "shape (M x N x K)", "ms", "GFLOP/s", "qlora/OpenBLAS", "max |diff|");
    for (int i = 0; i < k_n_shapes; i++) {
        const mm_shape &s = k_shapes[i];
        mm_data d = make_data(s);
        // c[n][m] = sum_k a[m][k] b[n][k]: row-major C (N x M) = B (N x K) . A^T
        const double t = median_time(reps_for(s, reps), [&] {
            ob.sgemm(101 /*RowMajor*/, 111 /*NoTrans*/, 112 /*Trans*/, s.N, s.M, s.K, 1.0f, d.b.data(), s.K, d.a.data(), s.K,
                     0.0f, d.c.data(), s.M);
        });
        double md = 0;
        if (!g_ours_c[i].empty())
            for (size_t j = 0; j < d.c.size(); j++) md = std::max(md, (double)std::fabs(d.c[j] - g_ours_c[i][j]));
        char label[64];
        snprintf(label, sizeof(label), "%dx%dx%d", s.M, s.N, s.K);
        printf("%-26s %10.3f %10.1f", label, t * 1e3, 2.0 * s.M * s.N * s.K / t / 1e9);
        if (g_ours_ms[i] > 0)
            printf(" %13.2fx %12.1e\n", (t * 1e3) / g_ours_ms[i], md);
        else
            printf("\n");
    }
}

// ---- frozen quantized weights (the QLoRA base): forward y = W x and input gradient dx = W^T dy ----

// random weight bytes of `type` for an [out, in] weight: quantised from N(0, 0.02) where the type
// can be produced, random valid blocks otherwise (k-quants)
static std::vector<uint8_t> weight_bytes(ql_type type, int64_t out, int64_t in, const std::vector<float> &wf) {
    std::vector<uint8_t> b(ql_type_data_size(type, out, in));
    const ql_type_traits *tt = ql_type_traits_get(type);
    if (type == QL_TYPE_F32) {
        memcpy(b.data(), wf.data(), b.size());
    } else if (tt->from_float || tt->aux_bytes) {
        if (ql_quantize(type, wf.data(), out, in, b.data(), nullptr, 0) != QL_OK) exit(1);
    } else {
        std::mt19937 rng(7);
        for (uint8_t &x : b) x = (uint8_t)rng();
        const uint16_t d = ql_fp32_to_fp16(0.001f);
        for (size_t off = 0; off < b.size(); off += tt->type_size)
            memcpy(b.data() + off + (type == QL_TYPE_Q6_K ? offsetof(ql_block_q6_K, d) : 0), &d, 2);
    }
    return b;
}

// median ms of one matmul: forward (transposed = false) or dx = W^T dy (true)
static double time_qmatmul(ql_backend *cpu, ql_type type, const std::vector<uint8_t> &wb, int64_t out, int64_t in,
                           int64_t N, bool transposed, int reps, bool q8 = false) {
    const int64_t K = transposed ? out : in;
    ql_init_params ip = {wb.size() + (size_t)(in + out) * (size_t)N * 4 + (16u << 20), nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, type, in, out);
    memcpy(w->data, wb.data(), wb.size());
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, N);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> U(-1, 1);
    for (int64_t i = 0; i < K * N; i++) ((float *)x->data)[i] = U(rng);
    ql_tensor *y = ql_mul_mat(ctx, transposed ? ql_transpose(ctx, w) : w, x);
    if (q8) ql_mul_mat_set_prec(y, QL_TYPE_Q8_0);
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, y);
    if (ql_graph_alloc(g, cpu) != QL_OK) {
        fprintf(stderr, "bench: %s\n", ql_ctx_error(ctx));
        exit(1);
    }
    // q8 (a prompt's multiplies, timed on a shared machine): the fastest run, not the median
    const double t = q8 || reps < 0 ? best_time(std::abs(reps), [&] { ql_backend_graph_compute(cpu, g); })
                                    : median_time(reps, [&] { ql_backend_graph_compute(cpu, g); });
    ql_graph_free(g);
    ql_free(ctx);
    return t * 1e3;
}

static void bench_qmatmul(ql_backend *cpu, int n_threads, int reps) {
    printf("\n## frozen weight matmul: forward y = W x, input gradient dx = W^T dy; %d threads\n", n_threads);
    printf("%-12s %7s %-6s %10s %10s %10s %10s\n", "W [out,in]", "tokens", "type", "fwd ms", "bwd ms", "fwd/f32", "bwd/f32");
    const int64_t shapes[][2] = {{4096, 4096}, {11008, 4096}};
    const ql_type types[] = {QL_TYPE_F32, QL_TYPE_NF4, QL_TYPE_Q4_K};
    for (const auto &sh : shapes) {
        const int64_t out = sh[0], in = sh[1];
        std::vector<float> wf((size_t)(out * in));
        std::mt19937 rng(1);
        std::normal_distribution<float> N01(0.0f, 0.02f);
        for (float &v : wf) v = N01(rng);
        std::vector<std::vector<uint8_t>> wb;
        for (ql_type t : types) wb.push_back(weight_bytes(t, out, in, wf));
        for (int64_t N : {16, 256, 2048}) {
            const int r = N >= 2048 ? std::max(3, reps / 4) : reps;
            double f32_fwd = 0, f32_bwd = 0;
            for (size_t ti = 0; ti < 3; ti++) {
                const double tf = time_qmatmul(cpu, types[ti], wb[ti], out, in, N, false, r);
                const double tb = time_qmatmul(cpu, types[ti], wb[ti], out, in, N, true, r);
                if (ti == 0) f32_fwd = tf, f32_bwd = tb;
                char shape[32];
                snprintf(shape, sizeof(shape), "%lldx%lld", (long long)out, (long long)in);
                printf("%-12s %7lld %-6s %10.2f %10.2f %9.2fx %9.2fx\n", shape, (long long)N, ql_type_name(types[ti]), tf, tb,
                       tf / f32_fwd, tb / f32_bwd);
            }
        }
    }
}

// A prompt's multiplies (generate, perplexity: ql_mul_mat_set_prec Q8_0) against the exact path
// on the same weight: Llama-1B-shaped weights, prompts of N tokens; the fastest of reps runs
static void bench_prompt(ql_backend *cpu, int n_threads, int reps) {
    printf("\n## a prompt's multiplies: exact path vs 8-bit activations; %d threads, fastest of %d\n", n_threads, reps);
    printf("%-12s %7s %-6s %10s %10s %9s %12s %10s\n", "W [out,in]", "tokens", "type", "exact ms", "q8 ms", "speed-up", "q8 GOP/s", "q8 GB/s");
    const int64_t shapes[][2] = {{2048, 2048}, {8192, 2048}, {2048, 8192}};
    static const ql_type all[] = {QL_TYPE_Q4_0, QL_TYPE_Q8_0, QL_TYPE_NF4, QL_TYPE_Q4_K, QL_TYPE_Q4_1, QL_TYPE_Q5_0, QL_TYPE_Q5_1,
                                  QL_TYPE_Q2_K, QL_TYPE_Q3_K, QL_TYPE_Q5_K, QL_TYPE_Q6_K, QL_TYPE_IQ4_NL, QL_TYPE_IQ4_XS};
    // QLORA_BENCH_TYPES=q2_K,q3_K: those alone (names as ql_type_name)
    std::vector<ql_type> types;
    const char *only = getenv("QLORA_BENCH_TYPES");
    for (ql_type t : all)
        if (!only || strstr(only, ql_type_name(t))) types.push_back(t);
    // decode's one token (the weight read once: GB/s) and two prompts
    for (const auto &sh : shapes) {
        const int64_t out = sh[0], in = sh[1];
        std::vector<float> wf((size_t)(out * in));
        std::mt19937 rng(1);
        std::normal_distribution<float> N01(0.0f, 0.02f);
        for (float &v : wf) v = N01(rng);
        for (ql_type t : types) {
            const std::vector<uint8_t> wb = weight_bytes(t, out, in, wf);
            for (int64_t N : {1, 64, 512}) {
                const double te = time_qmatmul(cpu, t, wb, out, in, N, false, -reps), tq = time_qmatmul(cpu, t, wb, out, in, N, false, reps, true);
                char shape[32];
                snprintf(shape, sizeof(shape), "%lldx%lld", (long long)out, (long long)in);
                printf("%-12s %7lld %-6s %10.3f %10.3f %8.2fx %12.1f %10.1f\n", shape, (long long)N, ql_type_name(t), te, tq, te / tq,
                       2.0 * (double)(out * in * N) / (tq * 1e-3) / 1e9, (double)wb.size() / (tq * 1e-3) / 1e9);
            }
        }
    }
}

// ---- attention on the CUDA backend ----
// q, k, v in bf16 as the trainer makes them under a bf16 compute type (cast from f32 leafs: the
// casts' time is in the numbers, ~1% at d 128): the library's own timing (ql_cuda_fa_time, which
// --attn-backward auto's choice also runs)
static double time_attn(ql_backend *be, bool fused, bool backward, int reps, int64_t D) {
    const double t = ql_cuda_fa_time(be, fused ? QL_CUDA_FA_FUSED : QL_CUDA_FA_CHUNKED, D, 32, 8, 2048, backward, reps);
    if (t < 0) {
        fprintf(stderr, "bench: attention at d %lld did not run\n", (long long)D);
        exit(1);
    }
    return t;
}

static void bench_attn(int reps) {
    char err[256];
    ql_backend *be = ql_backend_init_by_name("cuda", 0, err, sizeof(err));
    if (!be) {
        fprintf(stderr, "bench attn: %s\n", err);
        exit(1);
    }
    const char *reg = getenv("QLORA_CUDA_FA2_REG"), *warps = getenv("QLORA_CUDA_FA2_WARPS");
    printf("\n## attention on CUDA: causal, seq 2048, 32/8 heads, batch 1, bf16 q/k/v and products"
           " (fused: the %s path; QLORA_CUDA_FA2_REG=%s, QLORA_CUDA_FA2_WARPS=%s)\n",
           ql_cuda_fa2_register_path(be) ? "register" : "shared-memory", reg ? reg : "-", warps ? warps : "-");
    printf("%-22s %4s %10s %10s %12s %12s\n", "path", "d", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s");
    for (int64_t D : {128, 64}) {
        const double flop = 2.0 * 2048.0 * 2048.0 * (double)D * 32.0;  // the causal half of 2 products of 2 T^2 d H
        // the fused path as it runs (the register path's backward streaming its tiles by asynchronous
        // copies into two buffers; dK/dV blocks a query head each, 4 slices here), the same with one
        // buffer loaded between barriers, the same with dK/dV blocks over all 4 heads of a group, the products
        static const char *const names[] = {"fused (WMMA)", "fused, one buffer", "fused, no head slices", "chunked cuBLAS"};
        for (int path : {0, 1, 2, 3}) {
            if (path == 1 && !ql_cuda_fa2_register_path(be)) continue;
            const bool fused = path < 3;
            const int was = ql_cuda_fa2_set_pipe(path != 1), was_split = ql_cuda_fa2_set_split(path != 2);
            const double tf = time_attn(be, fused, false, reps, D), tfb = time_attn(be, fused, true, reps, D), tb = tfb - tf;
            ql_cuda_fa2_set_pipe(was);
            ql_cuda_fa2_set_split(was_split);
            printf("%-22s %4lld %10.3f %10.3f %12.1f %12.1f\n", names[path], (long long)D, tf * 1e3, tb * 1e3, flop / tf * 1e-12,
                   2.5 * flop / tb * 1e-12);
        }
        // what a trainer's --attn-backward auto would choose at this shape (its own timing: one
        // layer forward and backward each way, in turn; the same graphs as above, f32 leafs cast)
        double mf = 0, mp = 0;
        char why[256] = "";
        const int m = ql_cuda_fa_choose(be, D, 32, 8, 2048, &mf, &mp, why, sizeof(why));
        if (m < 0)
            printf("auto (ql_cuda_fa_choose) %4lld: %s\n", (long long)D, why);
        else
            printf("auto (ql_cuda_fa_choose) %4lld: %s (fused %.3f ms, products %.3f ms forward and backward)\n", (long long)D,
                   m == QL_CUDA_FA_FUSED ? "fused" : "products", mf, mp);
    }
    ql_backend_free(be);
}

static bool g_profile = false;

// total time per op kind over the profiled runs, largest first
static void print_profile(const ql_graph *g) {
    double by_op[QL_OP_COUNT] = {0}, total = 0;
    for (int i = 0; i < ql_graph_n_nodes(g); i++) {
        by_op[ql_graph_node(g, i)->op] += ql_graph_node_seconds(g, i);
        total += ql_graph_node_seconds(g, i);
    }
    std::vector<int> order;
    for (int o = 0; o < QL_OP_COUNT; o++)
        if (by_op[o] > 0) order.push_back(o);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return by_op[a] > by_op[b]; });
    for (int o : order) printf("         %-20s %5.1f%%\n", ql_op_name((ql_op)o), 100 * by_op[o] / total);
}

static void bench_block(ql_backend *cpu, int n_threads, int reps) {
    printf("\n## one llama block, 110M shape (n_embd 768, 12 heads, ffn 2048), f32, %d threads\n", n_threads);
    printf("%-6s %-34s %10s %12s %12s\n", "seq", "pass", "ms", "tokens/s", "plan MiB");
    for (int T : {256, 512}) {
        for (int mode = 0; mode < 3; mode++) {
            // 0: forward; 1: forward+backward to the input only (frozen weights, as under LoRA);
            // 2: forward+backward with every weight trainable
            ql_llama_hparams hp;
            hp.n_vocab = 32; hp.n_embd = 768; hp.n_layer = 1; hp.n_head = 12; hp.n_head_kv = 12; hp.n_ff = 2048;
            ql_init_params ip = {ql_llama_weight_bytes(hp, QL_TYPE_F32, true) * 2 + ((size_t)T * 768 * 8) + (64u << 20),
                                 nullptr, false, false};
            ql_context *ctx = ql_init(ip);
            ql_llama m;
            if (ql_llama_create(ctx, &m, hp, QL_TYPE_F32, true) != QL_OK) {
                fprintf(stderr, "bench: %s\n", ql_ctx_error(ctx));
                exit(1);
            }
            ql_llama_randomize(&m, 1, 0.02f);
            if (mode == 2) ql_llama_set_params(&m);
            ql_tensor *x = ql_new_tensor_3d(ctx, QL_TYPE_F32, 768, T, 1);
            ql_tensor *pos = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1);
            for (int t = 0; t < T; t++) ((int32_t *)pos->data)[t] = t;
            std::mt19937 rng(2);
            std::normal_distribution<float> N(0, 1);
            for (int64_t i = 0; i < ql_nelements(x); i++) ((float *)x->data)[i] = N(rng);
            if (mode > 0) ql_set_param(x);
            ql_tensor *y = ql_llama_block(ctx, &m, 0, x, pos, nullptr);
            ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, y, y));
            ql_graph *gf = ql_graph_new(ctx);
            ql_graph_build_forward(gf, mode == 0 ? y : loss);
            ql_graph *g = mode == 0 ? gf : ql_graph_backward(ctx, gf, loss);
            ql_plan_stats st;
            if (!g || ql_graph_plan(g, cpu, &st) != QL_OK || ql_graph_alloc(g, cpu) != QL_OK) {
                fprintf(stderr, "bench: %s\n", ql_ctx_error(ctx));
                exit(1);
            }
            if (g_profile) ql_graph_set_profile(g, true);
            const double t = median_time(reps, [&] {
                ql_graph_zero_grads(g);
                ql_backend_graph_compute(cpu, g);
            });
            static const char *names[] = {"forward", "fwd+bwd, frozen weights (LoRA-like)", "fwd+bwd, all weights trainable"};
            printf("%-6d %-34s %10.2f %12.0f %12.1f\n", T, names[mode], t * 1e3, T / t, st.buffer_size / 1048576.0);
            if (g_profile) print_profile(g);
            if (g != gf) ql_graph_free(g);
            ql_graph_free(gf);
            ql_free(ctx);
        }
    }
}

int main(int argc, char **argv) {
    std::string what;
    int n_threads = 0, reps = 10;
    const char *usage = "[all|matmul|block|qmatmul|prompt|attn] [-t threads] [-r reps] [--profile]";
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        long long v = 0;
        if (a == "-t" || a == "--threads") {
            if (!arg_whole("bench", argc, argv, &i, 0, 1024, &v)) return 2;
            n_threads = (int)v;
        } else if (a == "-r" || a == "--reps") {
            if (!arg_whole("bench", argc, argv, &i, 1, 1000000, &v)) return 2;
            reps = (int)v;
        } else if (a == "--profile") {
            g_profile = true;
        } else if (a == "all" || a == "matmul" || a == "block" || a == "qmatmul" || a == "prompt" || a == "attn") {
            if (!what.empty()) {  // one benchmark a run: a second would silently replace the first
                fprintf(stderr, "bench: '%s' and '%s': one benchmark at a time (all runs every one)\n", what.c_str(), a.c_str());
                return 2;
            }
            what = a;
        } else if (a == "-h" || a == "--help") {
            printf("usage: %s %s\n", argv[0], usage);
            return 0;
        } else {
            fprintf(stderr, "bench: unknown argument '%s' (usage: %s %s)\n", argv[i], argv[0], usage);
            return 2;
        }
    }
    if (what.empty()) what = "all";
    if (what == "attn") {  // the CUDA backend only
        bench_attn(reps);
        return 0;
    }
    char err[256];
    ql_backend *cpu = ql_backend_init_by_name("cpu", n_threads, err, sizeof(err));
    if (!cpu) {
        fprintf(stderr, "bench: %s\n", err);
        return 1;
    }
    n_threads = ql_backend_cpu_n_threads(cpu);
    if (what == "all" || what == "matmul") bench_matmul(cpu, n_threads, reps);
    if (what == "all" || what == "matmul") bench_matmul_bf16(cpu, n_threads, reps);
    if (what == "all" || what == "block") bench_block(cpu, n_threads, std::max(3, reps / 2));
    if (what == "all" || what == "qmatmul") bench_qmatmul(cpu, n_threads, std::max(3, reps / 2));
    if (what == "all" || what == "prompt") bench_prompt(cpu, n_threads, std::max(5, reps));
    if (what == "all" || what == "matmul") bench_openblas(n_threads, reps);
    ql_backend_free(cpu);
    return 0;
}
