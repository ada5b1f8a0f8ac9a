// A frozen quantized weight in a matmul: forward y = W x and the input gradient dx = W^T dy,
// dequantised tile by tile inside the kernel, must equal dequantise-then-f32-matmul.
#define QL_INTERNALS  // the CUDA planning rules (ql_cuda_mm_*)
#include "../qlora.h"
#include "util.h"
#include "tiny.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

// weight bytes of `type` for rows x cols: quantised from Gaussians where the type can be
// produced, random valid blocks otherwise (k-quants: random codes and scales, small d/dmin)
std::vector<uint8_t> make_weight(ql_type type, int64_t rows, int64_t cols, std::mt19937 &rng) {
    std::vector<uint8_t> bytes(ql_type_data_size(type, rows, cols));
    const ql_type_traits *tt = ql_type_traits_get(type);
    if (tt->from_float || tt->aux_bytes) {
        std::normal_distribution<float> N(0.0f, 0.05f);
        std::vector<float> w((size_t)(rows * cols));
        for (float &v : w) v = N(rng);
        REQUIRE(ql_quantize(type, w.data(), rows, cols, bytes.data(), nullptr, 0) == QL_OK);
        return bytes;
    }
    return random_blocks(type, bytes.size(), (uint32_t)rng());  // no quantiser here: random codes, small scales
}

struct run_out {
    std::vector<float> y, dx;
};

// y = mul_mat(W, x) and dL/dx for L = sum(y * r), W [cols=K, rows=M] of `type`
run_out run_mul_mat(ql_type type, const std::vector<uint8_t> &wbytes, int64_t M, int64_t K, const std::vector<float> &x,
                    const std::vector<float> &r, int64_t N, int threads) {
    ql_init_params ip = {wbytes.size() + (size_t)(K * N + 2 * M * N) * 4 + (4u << 20), nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, type, K, M);
    REQUIRE(w);
    REQUIRE(ql_nbytes(w) + w->aux_size == wbytes.size());
    memcpy(w->data, wbytes.data(), wbytes.size());
    ql_tensor *xt = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, K, N));
    ql_tensor *rt = ql_new_tensor_2d(ctx, QL_TYPE_F32, M, N);
    memcpy(xt->data, x.data(), x.size() * 4);
    memcpy(rt->data, r.data(), r.size() * 4);
    ql_tensor *y = ql_set_output(ql_mul_mat(ctx, w, xt));
    ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, y, rt));
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
    ql_backend *be = ql_backend_cpu_init(threads);
    REQUIRE_MESSAGE(ql_graph_alloc(gb, be) == QL_OK, ql_ctx_error(ctx));
    ql_graph_set_poison(gb, true);
    ql_graph_zero_grads(gb);
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
    run_out o;
    o.y.assign((const float *)y->data, (const float *)y->data + M * N);
    o.dx.assign((const float *)xt->grad->data, (const float *)xt->grad->data + K * N);
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(be);
    ql_free(ctx);
    return o;
}

}  // namespace

TEST_CASE("quantized matmul == dequantise-then-f32, forward and input gradient, every type") {
    const ql_type types[] = {QL_TYPE_F16,  QL_TYPE_BF16, QL_TYPE_Q4_0, QL_TYPE_Q4_1, QL_TYPE_Q5_0,   QL_TYPE_Q5_1,
                             QL_TYPE_Q8_0, QL_TYPE_Q2_K, QL_TYPE_Q3_K, QL_TYPE_Q4_K, QL_TYPE_Q5_K,   QL_TYPE_Q6_K,
                             QL_TYPE_IQ4_NL, QL_TYPE_IQ4_XS, QL_TYPE_NF4, QL_TYPE_NF4_NODQ};
    const int64_t M = 200, K = 512;  // M: not a multiple of the 32-wide panels
    std::mt19937 rng(11);
    for (ql_type type : types) {
        const std::vector<uint8_t> wq = make_weight(type, M, K, rng);
        std::vector<float> wf((size_t)(M * K));
        REQUIRE(ql_dequantize(type, wq.data(), M, K, wf.data()) == QL_OK);
        std::vector<uint8_t> wfb(wf.size() * 4);
        memcpy(wfb.data(), wf.data(), wfb.size());
        for (int64_t N : {5, 100}) {  // the dot path (few tokens) and the packed path
            std::uniform_real_distribution<float> U(-1, 1);
            std::vector<float> x((size_t)(K * N)), r((size_t)(M * N));
            for (float &v : x) v = U(rng);
            for (float &v : r) v = U(rng);
            for (int threads : {1, 3}) {
                const run_out q = run_mul_mat(type, wq, M, K, x, r, N, threads);
                const run_out f = run_mul_mat(QL_TYPE_F32, wfb, M, K, x, r, N, threads);
                const double ey = rel_err(q.y, f.y), edx = rel_err(q.dx, f.dx);
                CAPTURE(std::string(ql_type_name(type)));
                CAPTURE(N);
                CAPTURE(threads);
                CHECK(ey <= 1e-5);
                CHECK(edx <= 1e-5);
            }
        }
    }
}

TEST_CASE("finite differences through an NF4 matmul (double reference)") {
    const int64_t M = 70, K = 256, N = 9;
    std::mt19937 rng(3);
    const std::vector<uint8_t> wq = make_weight(QL_TYPE_NF4, M, K, rng);
    std::vector<float> wf((size_t)(M * K));
    REQUIRE(ql_dequantize(QL_TYPE_NF4, wq.data(), M, K, wf.data()) == QL_OK);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> x((size_t)(K * N)), r((size_t)(M * N));
    for (float &v : x) v = U(rng);
    for (float &v : r) v = U(rng);
    const run_out q = run_mul_mat(QL_TYPE_NF4, wq, M, K, x, r, N, 2);
    // L(x) = sum_{m,n} r[m,n] sum_k W[m,k] x[k,n], differentiated numerically in double
    auto L = [&](const std::vector<double> &xd) {
        double s = 0;
        for (int64_t n = 0; n < N; n++)
            for (int64_t m = 0; m < M; m++) {
                double y = 0;
                for (int64_t k = 0; k < K; k++) y += (double)wf[(size_t)(m * K + k)] * xd[(size_t)(n * K + k)];
                s += y * r[(size_t)(n * M + m)];
            }
        return s;
    };
    std::vector<double> xd(x.begin(), x.end());
    double worst = 0, scale = 0;
    for (int t = 0; t < 40; t++) {
        const size_t i = (size_t)(rng() % (uint32_t)(K * N));
        const double h = 1e-3, keep = xd[i];
        xd[i] = keep + h;
        const double lp = L(xd);
        xd[i] = keep - h;
        const double lm = L(xd);
        xd[i] = keep;
        const double fd = (lp - lm) / (2 * h);
        worst = std::max(worst, std::fabs(fd - q.dx[i]));
        scale = std::max(scale, std::fabs(fd));
    }
    CHECK(worst / scale < 1e-5);
}

TEST_CASE("NF4 read through views: strided rows, half rows, permuted, transposed, get_rows") {
    // each view of an NF4 weight must read exactly what the same view of its f32 dequantisation reads
    const int64_t E = 128, R = 8, Z = 2;  // [E, R, Z]
    std::mt19937 rng(21);
    std::normal_distribution<float> N(0.0f, 0.1f);
    std::vector<float> w((size_t)(E * R * Z));
    for (float &v : w) v = N(rng);
    ql_init_params ip = {16u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *q = ql_new_tensor_3d(ctx, QL_TYPE_NF4, E, R, Z);
    ql_tensor *f = ql_new_tensor_3d(ctx, QL_TYPE_F32, E, R, Z);
    REQUIRE(ql_quantize(QL_TYPE_NF4, w.data(), R * Z, E, q->data, nullptr, 0) == QL_OK);
    REQUIRE(ql_dequantize(QL_TYPE_NF4, q->data, R * Z, E, (float *)f->data) == QL_OK);
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, E / 2, 3), *xe = ql_new_tensor_2d(ctx, QL_TYPE_F32, E, 3);
    ql_tensor *y = ql_new_tensor_2d(ctx, QL_TYPE_F32, R / 2, 3);
    ql_tensor *xb = ql_new_tensor_3d(ctx, QL_TYPE_F32, E, 3, R);  // for the permuted [E, Z, R] weight
    for (ql_tensor *t : {x, xe, y, xb})
        for (int64_t i = 0; i < ql_nelements(t); i++) ((float *)t->data)[i] = N(rng);
    ql_tensor *ids = ql_new_tensor_1d(ctx, QL_TYPE_I32, 3);
    ((int32_t *)ids->data)[0] = 3, ((int32_t *)ids->data)[1] = 0, ((int32_t *)ids->data)[2] = 7;
    // the same view built over either tensor
    auto every_other = [&](ql_tensor *a) { return ql_view_2d(ctx, a, E, R / 2, 2 * a->nb[1], 0); };
    auto second_half = [&](ql_tensor *a) { return ql_view_2d(ctx, a, E / 2, R, a->nb[1], ql_row_size(a->type, E / 2)); };
    auto permuted = [&](ql_tensor *a) { return ql_permute(ctx, a, 0, 2, 1, 3); };  // [E, Z, R]: rows strided
    // elements 32..111 of each row: starts and ends inside a block of 64 (absmax by flat index)
    auto inside = [&](ql_tensor *a) { return ql_view_2d(ctx, a, 80, R, a->nb[1], ql_row_size(a->type, 32)); };
    ql_tensor *x80 = ql_new_tensor_2d(ctx, QL_TYPE_F32, 80, 3);
    for (int64_t i = 0; i < 240; i++) ((float *)x80->data)[i] = N(rng);
    std::vector<std::pair<ql_tensor *, ql_tensor *>> outs;  // (from NF4, from f32)
    outs.push_back({ql_mul_mat(ctx, every_other(q), xe), ql_mul_mat(ctx, every_other(f), xe)});
    outs.push_back({ql_mul_mat(ctx, second_half(q), x), ql_mul_mat(ctx, second_half(f), x)});
    outs.push_back({ql_mul_mat(ctx, permuted(q), xb), ql_mul_mat(ctx, permuted(f), xb)});
    outs.push_back({ql_mul_mat(ctx, ql_transpose(ctx, every_other(q)), y), ql_mul_mat(ctx, ql_transpose(ctx, every_other(f)), y)});
    outs.push_back({ql_get_rows(ctx, second_half(q), ids), ql_get_rows(ctx, second_half(f), ids)});
    outs.push_back({ql_mul_mat(ctx, inside(q), x80), ql_mul_mat(ctx, inside(f), x80)});
    ql_graph *g = ql_graph_new(ctx);
    for (auto &o : outs) {
        REQUIRE_MESSAGE(o.first, std::string(ql_ctx_error(ctx)));
        ql_graph_build_forward(g, ql_set_output(o.first));
        ql_graph_build_forward(g, ql_set_output(o.second));
    }
    ql_backend *be = ql_backend_cpu_init(3);
    REQUIRE_MESSAGE(ql_graph_alloc(g, be) == QL_OK, ql_ctx_error(ctx));
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, g) == QL_OK, ql_ctx_error(ctx));
    const char *names[] = {"every other row", "second half of each row", "permuted", "transposed every-other", "get_rows of half rows",
                           "inside blocks"};
    for (size_t i = 0; i < outs.size(); i++) {
        CAPTURE(std::string(names[i]));
        const std::vector<float> a((const float *)outs[i].first->data, (const float *)outs[i].first->data + ql_nelements(outs[i].first));
        const std::vector<float> b((const float *)outs[i].second->data, (const float *)outs[i].second->data + ql_nelements(outs[i].second));
        CHECK(rel_err(a, b) <= 1e-5);
    }
    // a view starting inside a block of a blocked type (q4_0: 18-byte blocks) is refused
    ql_tensor *q40 = ql_new_tensor_2d(ctx, QL_TYPE_Q4_0, 64, 4);
    CHECK(ql_view_2d(ctx, q40, 32, 4, q40->nb[1], 16) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)).find("whole") != std::string::npos);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

namespace {

// y = mul_mat(W, x) forward only, W [K, M] of `type`; q8: with ql_mul_mat_set_prec(QL_TYPE_Q8_0)
std::vector<float> run_forward(ql_type type, const std::vector<uint8_t> &wbytes, int64_t M, int64_t K, const std::vector<float> &x,
                               int64_t N, int threads, bool q8) {
    ql_init_params ip = {wbytes.size() + (size_t)(K * N + M * N) * 4 + (4u << 20), nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, type, K, M);
    REQUIRE(w);
    memcpy(w->data, wbytes.data(), wbytes.size());
    ql_tensor *xt = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, N);
    memcpy(xt->data, x.data(), x.size() * 4);
    ql_tensor *y = ql_set_output(ql_mul_mat(ctx, w, xt));
    REQUIRE(y);
    if (q8) REQUIRE(ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) == QL_OK);
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, y);
    ql_backend *be = ql_backend_cpu_init(threads);
    REQUIRE_MESSAGE(ql_graph_alloc(g, be) == QL_OK, ql_ctx_error(ctx));
    ql_graph_set_poison(g, true);
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, g) == QL_OK, ql_ctx_error(ctx));
    std::vector<float> out((const float *)y->data, (const float *)y->data + M * N);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
    return out;
}

// Gaussian activations with outliers (one element in 64 fifty times larger), as a residual stream has
std::vector<float> outlier_activations(int64_t n, std::mt19937 &rng) {
    std::normal_distribution<float> G(0.0f, 1.0f);
    std::vector<float> x((size_t)n);
    for (float &v : x) v = G(rng) * (rng() % 64 == 0 ? 50.0f : 1.0f);
    return x;
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr bool k_have_vnni = true;  // (qlora.cpp's prompt GEMM is compiled with the same flags)
#else
static constexpr bool k_have_vnni = false;
#endif

// The bound README's generate section states: per output, the activations' rounding (|x - d q| <=
// d/2, d = the block's max |x| / 127) times |W|, plus for NF4 the table's int8 rounding (at most
// 0.00367 of the block's absmax per weight) times |x| and times d/2; f32 sums add 1e-5 sum |W| |x|.
TEST_CASE("8-bit activations (ql_mul_mat_set_prec): within the stated bound of the exact path, every type with an integer kernel") {
    const ql_type types[] = {QL_TYPE_Q4_0, QL_TYPE_Q8_0, QL_TYPE_Q4_K, QL_TYPE_Q6_K, QL_TYPE_NF4, QL_TYPE_NF4_NODQ, QL_TYPE_Q4_1,
                             QL_TYPE_Q5_0, QL_TYPE_Q5_1, QL_TYPE_Q5_K, QL_TYPE_IQ4_NL, QL_TYPE_IQ4_XS, QL_TYPE_Q3_K, QL_TYPE_Q2_K};
    const int64_t M = 72, K = 1024;  // M: chunks of 16 columns split unevenly over 3 threads
    std::mt19937 rng(32);
    for (ql_type type : types) {
        const std::vector<uint8_t> wq = make_weight(type, M, K, rng);
        std::vector<float> wf((size_t)(M * K));
        REQUIRE(ql_dequantize(type, wq.data(), M, K, wf.data()) == QL_OK);
        const bool nf4 = type == QL_TYPE_NF4 || type == QL_TYPE_NF4_NODQ;
        const int64_t qb_decode = ql_type_traits_get(type)->blck_size == 256 ? 256 : 32;
        std::vector<float> wtab((size_t)(M * K), 0.0f);  // NF4: the table's rounding, 0.00367 absmax (= the block's max |W|)
        if (nf4)
            for (int64_t b = 0; b < M * K / 64; b++) {
                float am = 0;
                for (int64_t k = 0; k < 64; k++) am = std::max(am, std::fabs(wf[(size_t)(b * 64 + k)]));
                for (int64_t k = 0; k < 64; k++) wtab[(size_t)(b * 64 + k)] = 0.00367f * am;
            }
        // above 8 rows of b (a prompt) the int8 GEMM where the build has AVX-512 VNNI (elsewhere the
        // exact path): the activations then in blocks of 32 for every type
        for (int64_t N : {1, 3, 8, 9, 37}) {
            if (N > 8 && (!k_have_vnni || type == QL_TYPE_Q2_K)) continue;  // (Q2_K's prompts: the exact path, below)
            const int64_t qb = N > 8 ? 32 : qb_decode;
            const std::vector<float> x = outlier_activations(K * N, rng);
            const std::vector<float> exact = run_forward(type, wq, M, K, x, N, 2, false);
            const std::vector<float> fast = run_forward(type, wq, M, K, x, N, 2, true);
            CAPTURE(std::string(ql_type_name(type)));
            CAPTURE(N);
            CHECK(run_forward(type, wq, M, K, x, N, 1, true) == fast);  // no dependence on the threads
            CHECK(run_forward(type, wq, M, K, x, N, 3, true) == fast);
            // the documented arithmetic emulated in double: x's codes (q = x 127/amax to nearest, in f32
            // as the kernel), NF4's weights through the int8 table; only f32 sums may differ from it
            std::vector<float> xr((size_t)(K * N));
            for (int64_t b = 0; b < K * N / qb; b++) {
                float amax = 0;
                for (int64_t k = b * qb; k < (b + 1) * qb; k++) amax = std::max(amax, std::fabs(x[(size_t)k]));
                const float id = amax > 0 ? 127.0f / amax : 0.0f;
                for (int64_t k = b * qb; k < (b + 1) * qb; k++) xr[(size_t)k] = std::nearbyint(x[(size_t)k] * id) * (amax / 127.0f);
            }
            std::vector<float> wr = wf;
            if (nf4) {
                const float vals[16] = QL_NF4_VALUES;
                for (size_t k = 0; k < wr.size(); k++) {
                    const float am = wtab[k] / 0.00367f;
                    if (am == 0) continue;
                    int best = 0;
                    for (int c = 1; c < 16; c++)
                        if (std::fabs(vals[c] * am - wf[k]) < std::fabs(vals[best] * am - wf[k])) best = c;
                    wr[k] = (float)std::lround(127.0 * vals[best]) * (am / 127.0f);
                }
            }
            double emul = 0;
            for (int64_t i = 0; i < N; i++)
                for (int64_t j = 0; j < M; j++) {
                    double ref = 0, mag = 0;
                    for (int64_t k = 0; k < K; k++) {
                        ref += (double)wr[(size_t)(j * K + k)] * xr[(size_t)(i * K + k)];
                        mag += std::fabs((double)wr[(size_t)(j * K + k)] * xr[(size_t)(i * K + k)]);
                    }
                    emul = std::max(emul, std::fabs(fast[(size_t)(i * M + j)] - ref) / mag);
                }
            CHECK(emul <= 2e-6);
            double worst = 0, moved = 0;  // worst |diff| / bound; the largest |diff| (the path ran)
            for (int64_t i = 0; i < N; i++)
                for (int64_t j = 0; j < M; j++) {
                    double bound = 0, mag = 0;
                    for (int64_t b = 0; b < K / qb; b++) {
                        double amax = 0;
                        for (int64_t k = b * qb; k < (b + 1) * qb; k++) amax = std::max(amax, (double)std::fabs(x[(size_t)(i * K + k)]));
                        const double half = amax / 127 / 2;
                        for (int64_t k = b * qb; k < (b + 1) * qb; k++) {
                            const double w = std::fabs(wf[(size_t)(j * K + k)]), e = wtab[(size_t)(j * K + k)];
                            const double xv = std::fabs(x[(size_t)(i * K + k)]);
                            bound += (w + e) * half + e * xv;
                            mag += w * xv;
                        }
                    }
                    bound += 1e-5 * mag;
                    const double d = std::fabs((double)fast[(size_t)(i * M + j)] - exact[(size_t)(i * M + j)]);
                    worst = std::max(worst, d / bound);
                    moved = std::max(moved, d);
                }
            CHECK(worst <= 1.0);
            CHECK(moved > 0);  // the 8-bit path was taken (exact would be 0)
            MESSAGE(std::string(ql_type_name(type)) << " N=" << N << ": worst |fast - exact| / bound = " << worst
                                                    << ", |fast - emulated| / sum |w x| = " << emul);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
static constexpr bool k_have_r8 = true;  // (qlora.cpp makes the copies under the same flags)
#else
static constexpr bool k_have_r8 = false;
#endif

// The CPU's weight copies: Q4_0, Q4_K, Q6_K and NF4 repacked in groups of 8 rows
// (ql_backend_cache_weights with the weight's type), read by decode's kernel and packed from by the
// prompt GEMM. (NF4's copy holds its scales undone from the double quantisation: zeroing the rows
// and their side data below leaves only the copy to give the results.)
TEST_CASE("8-bit activations on Q4_0, Q4_K, Q6_K and NF4 repacked in groups of 8 rows: the rows' results (prompts bit for bit), any "
          "threads, kept in step, freed" *
          skip_unless(k_have_r8, "without AVX-512 VNNI (no repacked copies in this build)")) {
  for (ql_type T : {QL_TYPE_Q4_0, QL_TYPE_Q4_K, QL_TYPE_Q6_K, QL_TYPE_NF4, QL_TYPE_NF4_NODQ}) {
    CAPTURE(std::string(ql_type_name(T)));
    const int64_t M = 72, K = 1024;
    std::mt19937 rng(33);
    const std::vector<uint8_t> wq = make_weight(T, M, K, rng), wq2 = make_weight(T, M, K, rng);
    std::vector<float> wf((size_t)(M * K)), wf2((size_t)(M * K));
    REQUIRE(ql_dequantize(T, wq.data(), M, K, wf.data()) == QL_OK);
    REQUIRE(ql_dequantize(T, wq2.data(), M, K, wf2.data()) == QL_OK);
    // the largest |a - b| over the outputs, relative to each output's sum |w x|
    auto rel = [&](const std::vector<float> &a, const std::vector<float> &b, const std::vector<float> &w, const std::vector<float> &x, int64_t N) {
        double worst = 0;
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < M; j++) {
                double mag = 0;
                for (int64_t k = 0; k < K; k++) mag += std::fabs((double)w[(size_t)(j * K + k)] * x[(size_t)(i * K + k)]);
                worst = std::max(worst, std::fabs((double)a[(size_t)(i * M + j)] - b[(size_t)(i * M + j)]) / mag);
            }
        return worst;
    };
    for (int64_t N : {1, 3, 8, 9, 37}) {
        CAPTURE(N);
        const std::vector<float> x = outlier_activations(K * N, rng);
        const std::vector<float> rows = run_forward(T, wq, M, K, x, N, 2, true);
        std::vector<float> r8[3];
        for (int th : {1, 2, 3}) {
            ql_init_params ip = {wq.size() + (size_t)(K * N + M * N) * 4 + (4u << 20), nullptr, false, false};
            ql_context *ctx = ql_init(ip);
            ql_tensor *w = ql_new_tensor_2d(ctx, T, K, M);
            ql_set_name(w, "w");
            memcpy(w->data, wq.data(), wq.size());
            ql_tensor *xt = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, N);
            memcpy(xt->data, x.data(), x.size() * 4);
            ql_tensor *y = ql_set_output(ql_mul_mat(ctx, w, xt));
            REQUIRE(ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) == QL_OK);
            ql_graph *g = ql_graph_new(ctx);
            ql_graph_build_forward(g, y);
            ql_backend *be = ql_backend_cpu_init(th);
            REQUIRE(ql_graph_alloc(g, be) == QL_OK);
            char err[256] = {0};
            ql_backend_buffer *rb = ql_backend_cache_weights(be, &w, 1, T, err, sizeof(err));
            REQUIRE_MESSAGE(rb, err);
            memset(w->data, 0, wq.size());  // the rows zeroed behind the API's back: only the copy can give the results
            REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
            r8[th - 1].assign((const float *)y->data, (const float *)y->data + M * N);
            if (th == 2) {
                // a write through the API makes the copy again: the rows' results on the new bytes
                REQUIRE(ql_backend_tensor_set(be, w, wq2.data(), 0, wq2.size()) == QL_OK);
                REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
                const std::vector<float> now((const float *)y->data, (const float *)y->data + M * N);
                const std::vector<float> rows2 = run_forward(T, wq2, M, K, x, N, 2, true);
                if (N > 8) CHECK(now == rows2);
                CHECK(rel(now, rows2, wf2, x, N) <= 2e-6);
                // freed: the weight is rows again (its own bytes: wq2 now)
                ql_backend_buffer_free(rb);
                CHECK(!(w->flags & QL_FLAG_CACHED));
                REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
                CHECK(std::vector<float>((const float *)y->data, (const float *)y->data + M * N) == rows2);
            } else {
                ql_backend_buffer_free(rb);
            }
            ql_graph_free(g);
            ql_backend_free(be);
            ql_free(ctx);
        }
        CHECK(r8[0] == r8[1]);  // no dependence on the threads
        CHECK(r8[2] == r8[1]);
        // the same integer block sums: a prompt's GEMM packs the same panels (the rows' bits); decode
        // sums a row's blocks in another f32 order than the rows' kernel
        if (N > 8) CHECK(r8[1] == rows);
        CHECK(rel(r8[1], rows, wf, x, N) <= 2e-6);
    }
  }
}

TEST_CASE("the CPU's weight copies: Q4_0, Q4_K, Q6_K and NF4 alone, in their own type, rows a multiple of 8 (NF4: of whole blocks of "
          "64); other requests refused with the reason") {
    ql_init_params ip = {4u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *odd = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_Q4_0, 64, 12), "odd");  // 12 rows
    ql_tensor *nf4 = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_NF4, 64, 16), "nf4w");
    ql_tensor *q6 = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_Q6_K, 256, 16), "q6w");
    ql_tensor *q8 = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_Q8_0, 64, 16), "q8w");
    ql_tensor *ok = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_Q4_0, 64, 16), "okw");
    ql_tensor *k4 = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_Q4_K, 512, 16), "k4w");
    ql_tensor *nf4part = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_NF4, 96, 16), "nf4part");  // rows of 1.5 blocks of 64
    ql_tensor *nodq = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_NF4_NODQ, 128, 8), "nodqw");
    std::mt19937 rng(34);
    for (ql_tensor *t : {nf4, nodq}) {  // real blocks and side data (a copy reads the absmax)
        const std::vector<uint8_t> b = make_weight(t->type, t->ne[1], t->ne[0], rng);
        REQUIRE(b.size() == ql_nbytes(t) + t->aux_size);
        memcpy(t->data, b.data(), b.size());
    }
    ql_backend *be = ql_backend_cpu_init(1);
    char err[256] = {0};
    CHECK(ql_cpu_repacks(QL_TYPE_Q4_0) == k_have_r8);
    CHECK(ql_cpu_repacks(QL_TYPE_Q4_K) == k_have_r8);
    CHECK(ql_cpu_repacks(QL_TYPE_Q6_K) == k_have_r8);
    CHECK(ql_cpu_repacks(QL_TYPE_NF4) == k_have_r8);
    CHECK(ql_cpu_repacks(QL_TYPE_NF4_NODQ) == k_have_r8);
    CHECK(!ql_cpu_repacks(QL_TYPE_Q8_0));
    auto refused = [&](ql_tensor *w, ql_type type, const char *why) {
        CHECK(ql_backend_cache_weights(be, &w, 1, type, err, sizeof(err)) == nullptr);
        CHECK_MESSAGE(std::string(err).find(why) != std::string::npos, err);
        CHECK(!(w->flags & QL_FLAG_CACHED));
    };
    refused(odd, QL_TYPE_Q4_0, k_have_r8 ? "odd is not a 2-D q4_0 weight whose rows are a multiple of 8" : "this build keeps no repacked q4_0");
    refused(nf4, QL_TYPE_Q4_0, k_have_r8 ? "nf4w is not a 2-D q4_0 weight" : "this build keeps no repacked q4_0");
    refused(k4, QL_TYPE_Q4_0, k_have_r8 ? "k4w is not a 2-D q4_0 weight" : "this build keeps no repacked q4_0");  // another type than its own
    refused(ok, QL_TYPE_Q4_K, k_have_r8 ? "okw is not a 2-D q4_K weight" : "this build keeps no repacked q4_K");
    refused(nf4part, QL_TYPE_NF4, k_have_r8 ? "nf4part is not a 2-D nf4 weight whose rows are a multiple of 8, of whole blocks of 64"
                                           : "this build keeps no repacked nf4");
    refused(q8, QL_TYPE_Q8_0, "keeps no weight copies in this type");
    refused(ok, QL_TYPE_BF16, "keeps no weight copies in this type");  // a compute-type copy: a device's
    for (ql_tensor *w : {ok, k4, q6, nf4, nodq}) {
        ql_backend_buffer *b = ql_backend_cache_weights(be, &w, 1, w->type, err, sizeof(err));
        CHECK_MESSAGE((b != nullptr) == k_have_r8, err);
        CHECK(((w->flags & QL_FLAG_CACHED) != 0) == k_have_r8);
        ql_backend_buffer_free(b);
        CHECK(!(w->flags & QL_FLAG_CACHED));
    }
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("8-bit activations: the request's checks, and the multiplies it leaves exact") {
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_Q4_0, 64, 4), *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 1);
    ql_tensor *y = ql_mul_mat(ctx, w, x);
    CHECK(ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) == QL_OK);
    CHECK(ql_mul_mat_set_prec(y, QL_TYPE_F32) == QL_OK);
    CHECK(ql_mul_mat_set_prec(y, QL_TYPE_BF16) == QL_ERR_TYPE);
    CHECK(ql_mul_mat_set_prec(ql_add(ctx, x, x), QL_TYPE_Q8_0) == QL_ERR_INVALID);
    CHECK(ql_mul_mat_set_prec(nullptr, QL_TYPE_Q8_0) == QL_ERR_INVALID);
    ql_free(ctx);
    // bit for bit the exact path: a prompt's rows of b on a type without a panel kind (Q2_K); without
    // VNNI, more than 8 rows of b of any type
    std::mt19937 rng(5);
    const int64_t M = 40, K = 512;
    for (auto tn : {std::make_pair(QL_TYPE_Q2_K, (int64_t)12), std::make_pair(k_have_vnni ? QL_TYPE_Q2_K : QL_TYPE_Q4_0, (int64_t)9)}) {
        const std::vector<uint8_t> wq = make_weight(tn.first, M, K, rng);
        const std::vector<float> xs = outlier_activations(K * tn.second, rng);
        CAPTURE(std::string(ql_type_name(tn.first)));
        CHECK(run_forward(tn.first, wq, M, K, xs, tn.second, 2, true) == run_forward(tn.first, wq, M, K, xs, tn.second, 2, false));
    }
}

// the planner's tile rules at the 8B shape (no device needed): tiles of whole multiples of 128
// rows (the old rule made 585 + 1 for ffn_down), the transposed weight in bands of its columns,
// two buffers where there are several tiles within the budget, one where 128 rows are over it
TEST_CASE("cuda planning rules: the multiply's tiles") {
    const ql_type bf16 = QL_TYPE_BF16;
    CHECK(ql_cuda_mm_tile_rows(14336, 4096) == 512);    // ffn_down W x: 8 tiles of 512 rows, K = 14336
    CHECK(ql_cuda_mm_tile_rows(4096, 14336) == 2048);   // gate / up W x, and ffn_down's Wᵀ dy (bands of 2048 columns)
    CHECK(ql_cuda_mm_tile_rows(4096, 1000) == 1000);    // within the budget: all rows, one tile
    CHECK(ql_cuda_mm_tile_rows(128256, 4096) == 128);   // the head's Wᵀ dy: the 128-column minimum
    CHECK(ql_cuda_mm_tile_rows(14336, 300) == 300);
    CHECK(ql_cuda_mm_tile_bufs(14336, 4096, 1) == 2);
    CHECK(ql_cuda_mm_tile_bufs(4096, 1000, 1) == 1);
    CHECK(ql_cuda_mm_tile_bufs(4096, 1000, 2) == 2);    // two batches: two tiles
    CHECK(ql_cuda_mm_tile_bufs(128256, 4096, 1) == 1);  // 31 MiB a band: one buffer
    CHECK(ql_cuda_mm_tile_bytes(14336, 4096, bf16) == (size_t)512 * 14336 * 2);
    for (int64_t len : {320, 4096, 14336, 128256})
        for (int64_t rows : {129, 300, 4096, 14336}) {
            const int64_t t = ql_cuda_mm_tile_rows(len, rows);
            INFO("rows of " << len << ", " << rows << " rows: tiles of " << t);
            CHECK((t == rows || t % QL_CUDA_MM_TILE_ALIGN == 0));
            CHECK((t == QL_CUDA_MM_TILE_ALIGN || t * len <= QL_CUDA_MM_TILE_ELEMS));
        }
    // the workspace of an NF4 ffn_down forward, 2048 tokens of bf16: two 512-row tiles (b read in place)
    ql_init_params ip = {1u << 20, nullptr, true, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_NF4, 14336, 4096), *x = ql_new_tensor_2d(ctx, bf16, 14336, 2048);
    ql_tensor *y = ql_mul_mat(ctx, w, x), *dx = ql_mul_mat(ctx, ql_transpose(ctx, w), ql_new_tensor_2d(ctx, bf16, 4096, 2048));
    REQUIRE((y && dx));
    CHECK(ql_cuda_work_size(y, 90) == 2 * (size_t)512 * 14336 * 2);
    CHECK(ql_cuda_work_size(dx, 90) == 2 * (size_t)2048 * 4096 * 2);
    ql_free(ctx);
}
