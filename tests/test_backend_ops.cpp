// tests/test_backend_ops.cpp - every op of the llama graphs, forward and backward, on every
// backend, compared with the CPU backend (the oracle). Written once against the backend
// interface (tensor set/get, buffers), so the same cases run
//   - on the CPU backend (test-qlora): the interface's memcpy path, and the harness itself;
//   - on the CUDA backend through tests/cuda_shim.h (build/test-cuda-shim, in make test);
//   - on a real GPU (test-qlora built with make CUDA=1); without one they are skipped and counted.
//
// A case builds its graph with the leaf helpers below; the harness builds it twice: once in an
// allocating context on the CPU (the reference) and once in a no_alloc context whose leafs live
// in a buffer of the backend under test, filled through ql_backend_tensor_set. Leaf data is a
// function of the leaf's order, so both see the same numbers. Cases with trainable leafs also
// run backward (loss = sum(out * R), R random) and compare every gradient. Planned buffers are
// poisoned with NaN before each run, so an element a kernel forgets to write shows up.
#define QL_INTERNALS  // ql_cuda_fa_fused / ql_cuda_fa_gemm: which attention path runs
#include "util.h"

#include "../models/llama.h"
#include "../models/trainer.h"
#include "../qlora.h"
#include "tiny.h"

#include <cstring>
#include <functional>
#include <memory>

namespace {

// ---- the backend under test --------------------------------------------------------------

bool cuda_probe() {
    const int n = ql_cuda_device_count();
    if (n == 0) {
        char err[256] = "";
        ql_cuda_device_info info;
        ql_cuda_device_get_info(0, &info, err, sizeof(err));
        printf("test_backend_ops: skipped: no CUDA device (%s)\n", err);
    }
    return n > 0;
}
const bool k_have_cuda = cuda_probe();  // evaluated before main: doctest's skip needs it

ql_backend *make_backend(const char *which) {
    if (!strcmp(which, "cpu")) return ql_backend_cpu_init(2);
    char err[256];
    ql_backend *be = ql_backend_cuda_init(0, err, sizeof(err));
    if (!be) FAIL("ql_backend_cuda_init: ", err);
    return be;
}

// ---- deterministic data ------------------------------------------------------------------

struct rng {
    uint64_t s;
    explicit rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        return s;
    }
    float uniform(float lo, float hi) { return lo + (hi - lo) * (float)((next() >> 40) * (1.0 / 16777216.0)); }
};

// How a case makes its leafs. Each leaf's bytes are made here, from the leaf's index.
struct leafs {
    ql_context *ctx;
    bool on_cpu;  // the reference run: data goes straight into the arena
    struct leaf {
        ql_tensor *t;
        std::vector<uint8_t> bytes;  // rows + side data
    };
    std::vector<leaf> all;
    std::vector<ql_tensor *> params;

    ql_tensor *add(ql_tensor *t, std::vector<uint8_t> bytes) {
        REQUIRE(t);
        REQUIRE(bytes.size() == ql_nbytes(t) + t->aux_size);
        if (on_cpu) memcpy(t->data, bytes.data(), bytes.size());
        all.push_back({t, std::move(bytes)});
        return t;
    }
    static std::vector<float> randn(size_t n, uint64_t seed, float lo, float hi) {
        rng r(seed);
        std::vector<float> v(n);
        for (float &x : v) x = r.uniform(lo, hi);
        return v;
    }
    // any float type: values uniform in [lo, hi), converted (quantized types through ql_quantize)
    ql_tensor *rand(ql_type type, std::vector<int64_t> ne, float lo = -1.0f, float hi = 1.0f) {
        ql_tensor *t = ql_new_tensor(ctx, type, (int)ne.size(), ne.data());
        REQUIRE(t);
        std::vector<uint8_t> b(ql_nbytes(t) + t->aux_size);
        const ql_type_traits *tt = ql_type_traits_get(type);
        if (!tt->from_float && !tt->aux_bytes)  // no quantiser for it here: random codes, small fp16 super-scales
            return add(t, random_blocks(type, b.size(), (uint32_t)all.size() + 1));
        const std::vector<float> v = randn((size_t)ql_nelements(t), all.size() + 1, lo, hi);
        char err[128];
        REQUIRE_MESSAGE(ql_quantize(type, v.data(), ql_nrows(t), t->ne[0], b.data(), err, sizeof(err)) == QL_OK, err);
        return add(t, std::move(b));
    }
    ql_tensor *param(std::vector<int64_t> ne, float lo = -1.0f, float hi = 1.0f) {
        ql_tensor *t = rand(QL_TYPE_F32, ne, lo, hi);
        ql_set_param(t);
        params.push_back(t);
        return t;
    }
    ql_tensor *i32(std::vector<int64_t> ne, const std::function<int32_t(int64_t)> &f) {
        ql_tensor *t = ql_new_tensor(ctx, QL_TYPE_I32, (int)ne.size(), ne.data());
        REQUIRE(t);
        std::vector<uint8_t> b(ql_nbytes(t));
        for (int64_t i = 0; i < ql_nelements(t); i++) {
            const int32_t v = f(i);
            memcpy(b.data() + 4 * i, &v, 4);
        }
        return add(t, std::move(b));
    }
    ql_tensor *scalar(float v) {
        ql_tensor *t = ql_new_tensor_1d(ctx, QL_TYPE_F32, 1);
        std::vector<uint8_t> b(4);
        memcpy(b.data(), &v, 4);
        return add(t, std::move(b));
    }
};

using builder = std::function<ql_tensor *(leafs &)>;

// One run: build, place on `be`, compute; outputs and gradients come back as floats.
struct run_result {
    std::vector<float> out;
    std::vector<std::vector<float>> grads;
    std::string error;
};

std::vector<float> fetch(ql_backend *be, const ql_tensor *t) {
    REQUIRE(ql_is_contiguous(t));
    std::vector<uint8_t> b(ql_nbytes(t));
    REQUIRE(ql_backend_tensor_get(be, t, b.data(), 0, b.size()) == QL_OK);
    std::vector<float> v((size_t)ql_nelements(t));
    if (t->type == QL_TYPE_I32) {
        for (size_t i = 0; i < v.size(); i++) v[i] = (float)((const int32_t *)b.data())[i];
    } else {
        REQUIRE(ql_dequantize(t->type, b.data(), ql_nrows(t), t->ne[0], v.data()) == QL_OK);
    }
    return v;
}

run_result run_case(ql_backend *be, bool reference, const builder &build, bool backward) {
    run_result res;
    ql_init_params ip = {64u << 20, nullptr, !reference, false};
    std::unique_ptr<ql_context, void (*)(ql_context *)> ctx(ql_init(ip), ql_free);
    leafs L{ctx.get(), reference, {}, {}};
    ql_tensor *out = build(L);
    INFO("error: " << std::string(ql_ctx_error(ctx.get())));
    REQUIRE(out);
    ql_set_output(out);
    ql_graph *gf = ql_graph_new(ctx.get());
    REQUIRE(ql_graph_build_forward(gf, out) == QL_OK);
    ql_graph *g = gf;
    if (backward && !L.params.empty()) {
        // loss = sum(out * R): dL/dout = R, random, so every gradient element matters
        ql_tensor *r = L.rand(QL_TYPE_F32, {out->ne[0], out->ne[1], out->ne[2], out->ne[3]});
        ql_tensor *loss = ql_sum(ctx.get(), ql_mul(ctx.get(), out, r));
        REQUIRE(loss);
        ql_graph_build_forward(gf, loss);
        g = ql_graph_backward(ctx.get(), gf, loss);
        REQUIRE_MESSAGE(g, ql_ctx_error(ctx.get()));
    }
    std::unique_ptr<ql_backend_buffer, void (*)(ql_backend_buffer *)> buf(nullptr, ql_backend_buffer_free);
    if (!reference) {
        buf.reset(ql_backend_alloc_ctx_tensors(be, ctx.get(), QL_BUFFER_DEVICE));
        REQUIRE_MESSAGE(buf, ql_ctx_error(ctx.get()));
        for (const auto &l : L.all) REQUIRE(ql_backend_tensor_set(be, l.t, l.bytes.data(), 0, l.bytes.size()) == QL_OK);
    }
    ql_plan_stats st;
    if (ql_graph_plan(g, be, &st) != QL_OK || ql_graph_alloc(g, be) != QL_OK) {
        res.error = ql_ctx_error(ctx.get());
    } else {
        ql_graph_set_poison(g, true);
        REQUIRE(ql_backend_graph_zero_grads(be, g) == QL_OK);
        if (ql_backend_graph_compute(be, g) != QL_OK) {
            res.error = ql_ctx_error(ctx.get());
        } else {
            REQUIRE(ql_backend_synchronize(be) == QL_OK);
            res.out = fetch(be, out);
            if (g != gf)
                for (ql_tensor *p : L.params) res.grads.push_back(fetch(be, p->grad));
        }
    }
    if (g != gf) ql_graph_free(g);
    ql_graph_free(gf);
    return res;
}

// max |x - r| / max |r|: one number per tensor, printed on failure
double norm_err(const std::vector<float> &x, const std::vector<float> &r) {
    if (x.size() != r.size()) return INFINITY;
    double num = 0, den = 1e-12;
    for (size_t i = 0; i < r.size(); i++) {
        if (std::isnan(x[i]) != std::isnan(r[i])) return INFINITY;  // poisoned = never written
        if (std::isnan(r[i])) continue;
        num = std::max(num, (double)std::fabs(x[i] - r[i]));
        den = std::max(den, (double)std::fabs(r[i]));
    }
    return num / den;
}

// The case on `be` against the CPU: outputs and gradients within tol (normalised).
void check_case(ql_backend *be, const char *what, const builder &build, double tol, bool backward = true) {
    INFO("case: " << std::string(what));
    ql_backend *cpu = ql_backend_cpu_init(1);
    const run_result ref = run_case(cpu, true, build, backward);
    ql_backend_free(cpu);
    REQUIRE_MESSAGE(ref.error.empty(), ref.error);
    const run_result got = run_case(be, false, build, backward);
    REQUIRE_MESSAGE(got.error.empty(), got.error);
    const double e = norm_err(got.out, ref.out);
    CHECK_MESSAGE(e <= tol, what, ": output error ", e, " > ", tol);
    REQUIRE(got.grads.size() == ref.grads.size());
    for (size_t i = 0; i < ref.grads.size(); i++) {
        const double eg = norm_err(got.grads[i], ref.grads[i]);
        CHECK_MESSAGE(eg <= tol, what, ": gradient ", i, " error ", eg, " > ", tol);
    }
}

constexpr double TOL_F32 = 1e-5;   // the same f32 formulas, another summation order
constexpr double TOL_MM  = 1e-4;   // long dot products (cuBLAS' order vs the CPU's panels)
constexpr double TOL_16  = 1e-2;   // bf16/f16 roundings of intermediate values may differ

// Every case registered for both backends: "backend ops cpu: NAME" and "backend ops cuda: NAME".
#define OP_CASE(name)                                                                                   \
    static void op_case_##name(ql_backend *be);                                                         \
    TEST_CASE("backend ops cpu: " #name) {                                                              \
        ql_backend *be = make_backend("cpu");                                                           \
        op_case_##name(be);                                                                             \
        ql_backend_free(be);                                                                            \
    }                                                                                                   \
    TEST_CASE("backend ops cuda: " #name * skip_unless(k_have_cuda, "without a CUDA device")) {            \
        ql_backend *be = make_backend("cuda");                                                          \
        op_case_##name(be);                                                                             \
        ql_backend_free(be);                                                                            \
    }                                                                                                   \
    static void op_case_##name(ql_backend *be)

}  // namespace

// ---- the cases ------------------------------------------------------------------------------

OP_CASE(fill_cont_cast) {
    check_case(be, "fill", [](leafs &L) {
        const int64_t ne[2] = {37, 3};
        return ql_add(L.ctx, ql_fill(L.ctx, QL_TYPE_F32, 2, ne, 0.25f), L.param({37, 3}));
    }, TOL_F32);
    check_case(be, "cont of a permuted view", [](leafs &L) {
        return ql_cont(L.ctx, ql_permute(L.ctx, L.param({5, 7, 3, 2}), 2, 0, 3, 1));
    }, TOL_F32);
    check_case(be, "cont of a transposed view", [](leafs &L) { return ql_cont(L.ctx, ql_transpose(L.ctx, L.param({33, 17}))); },
               TOL_F32);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16}) {
        INFO("type: " << std::string(ql_type_name(t)));
        check_case(be, "cast to 16-bit", [t](leafs &L) { return ql_cast(L.ctx, L.param({45, 6}, -70000.0f, 70000.0f), t); },
                   0.0, false);  // conversions are exact roundings: the same bits
        check_case(be, "cast from 16-bit", [t](leafs &L) { return ql_cast(L.ctx, L.rand(t, {45, 6}), QL_TYPE_F32); }, 0.0);
    }
}

OP_CASE(add_mul_scale_sum_reduce) {
    check_case(be, "add, broadcast", [](leafs &L) { return ql_add(L.ctx, L.param({19, 6, 4}), L.param({19, 1, 2})); }, TOL_F32);
    check_case(be, "mul, broadcast", [](leafs &L) { return ql_mul(L.ctx, L.param({19, 6, 4}), L.param({1, 6, 1})); }, TOL_F32);
    check_case(be, "mul, strided a", [](leafs &L) {
        ql_tensor *a = L.param({25, 6});
        return ql_mul(L.ctx, ql_view_2d(L.ctx, a, 19, 6, a->nb[1], 2 * sizeof(float)), L.param({19, 6}));
    }, TOL_F32);
    check_case(be, "scale", [](leafs &L) { return ql_scale(L.ctx, L.param({300, 3}), -0.37f); }, TOL_F32);
    check_case(be, "sum", [](leafs &L) { return ql_sum(L.ctx, L.param({1000, 7})); }, TOL_F32);
    check_case(be, "reduce_to", [](leafs &L) {
        ql_tensor *a = L.param({10, 6, 4});
        return ql_reduce_to(L.ctx, a, ql_new_tensor_3d(L.ctx, QL_TYPE_F32, 10, 3, 1), false);
    }, TOL_F32);
    check_case(be, "reduce_to grouped", [](leafs &L) {
        ql_tensor *a = L.param({10, 6, 4});
        return ql_reduce_to(L.ctx, a, ql_new_tensor_3d(L.ctx, QL_TYPE_F32, 10, 6, 2), true);
    }, TOL_F32);
}

OP_CASE(mul_mat_float) {
    check_case(be, "f32", [](leafs &L) { return ql_mul_mat(L.ctx, L.param({67, 33}), L.param({67, 9})); }, TOL_MM);
    check_case(be, "f32, one token", [](leafs &L) { return ql_mul_mat(L.ctx, L.param({64, 40}), L.param({64, 1})); }, TOL_MM);
    check_case(be, "f32, K = 1", [](leafs &L) { return ql_mul_mat(L.ctx, L.param({1, 5}), L.param({1, 7})); }, TOL_MM);
    check_case(be, "transposed operands", [](leafs &L) {
        return ql_mul_mat(L.ctx, ql_transpose(L.ctx, L.param({21, 48})), ql_transpose(L.ctx, L.param({13, 48})));
    }, TOL_MM);
    check_case(be, "batched, broadcast (GQA)", [](leafs &L) {
        return ql_mul_mat(L.ctx, L.param({24, 10, 2, 1}), L.param({24, 7, 6, 2}));
    }, TOL_MM);
    check_case(be, "permuted b", [](leafs &L) {
        return ql_mul_mat(L.ctx, L.param({16, 9, 3}), ql_permute(L.ctx, L.param({16, 3, 5}), 0, 2, 1, 3));
    }, TOL_MM);
    // ql_mul_mat_acc: onto c made by an op (written over in place), onto a leaf, batched and bf16 (LoRA's B)
    check_case(be, "mul_mat_acc onto an op's result", [](leafs &L) {
        return ql_mul_mat_acc(L.ctx, L.param({16, 40}), L.param({16, 9}), ql_scale(L.ctx, L.param({40, 9}), 0.5f));
    }, TOL_MM);
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})  // K over several of the CPU's K blocks, in place over c
        check_case(be, "mul_mat_acc onto an op's result, long K", [t](leafs &L) {
            ql_tensor *x = L.param({1000, 9});
            return ql_mul_mat_acc(L.ctx, L.param({1000, 40}), t == QL_TYPE_F32 ? x : ql_cast(L.ctx, x, t), ql_scale(L.ctx, L.param({40, 9}), 0.5f));
        }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})  // ... and onto a c that lives on (a leaf)
        check_case(be, "mul_mat_acc onto a leaf, long K", [t](leafs &L) {
            ql_tensor *x = L.param({1000, 9});
            return ql_mul_mat_acc(L.ctx, L.param({1000, 40}), t == QL_TYPE_F32 ? x : ql_cast(L.ctx, x, t), L.param({40, 9}));
        }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
    check_case(be, "mul_mat_acc onto a leaf, batched", [](leafs &L) {
        return ql_mul_mat_acc(L.ctx, L.param({24, 10}), L.param({24, 7, 3}), L.param({10, 7, 3}));
    }, TOL_MM);
    check_case(be, "mul_mat_acc, 16-bit b", [](leafs &L) {
        return ql_mul_mat_acc(L.ctx, L.param({16, 33}), ql_cast(L.ctx, L.param({16, 12}), QL_TYPE_BF16), L.param({33, 12}));
    }, TOL_16);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16}) {
        INFO("type: " << std::string(ql_type_name(t)));
        check_case(be, "16-bit a (frozen), f32 b", [t](leafs &L) { return ql_mul_mat(L.ctx, L.rand(t, {96, 40}), L.param({96, 5})); },
                   TOL_MM);
        check_case(be, "16-bit multiply: f32 a rounded to b's type", [t](leafs &L) {
            return ql_mul_mat(L.ctx, L.param({96, 40}), ql_cast(L.ctx, L.param({96, 5}), t));
        }, TOL_16);
        // a 16-bit result (the FFN's gate and up under bf16/fp16): rounded once on store; the LoRA
        // product added onto it (ql_mul_mat_acc, a 16-bit c: in place where it dies there)
        check_case(be, "16-bit result, batched", [t](leafs &L) {
            return ql_cast(L.ctx, ql_mul_mat_to(L.ctx, L.param({96, 40}), ql_cast(L.ctx, L.param({96, 5, 3}), t), t), QL_TYPE_F32);
        }, TOL_16);
        check_case(be, "16-bit result, NF4 a, then mul_mat_acc onto it", [t](leafs &L) {
            ql_tensor *y = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_NF4, {256, 40}), ql_cast(L.ctx, L.param({256, 9}), t), t);
            return ql_cast(L.ctx, ql_mul_mat_acc(L.ctx, L.param({16, 40}), ql_cast(L.ctx, L.param({16, 9}), t), y), QL_TYPE_F32);
        }, TOL_16);
        check_case(be, "mul_mat_acc onto a 16-bit leaf", [t](leafs &L) {
            return ql_cast(L.ctx, ql_mul_mat_acc(L.ctx, L.param({24, 10}), ql_cast(L.ctx, L.param({24, 7, 2}), t), L.rand(t, {10, 7, 2})),
                           QL_TYPE_F32);
        }, TOL_16);
    }
}

// a product over a short K (LoRA's rank side; ql_cuda_mm_thin on a device where c is 16-bit):
// tiles of 128 x 32 with partial ones both ways, K 16 and 64, a transposed a (Aᵀ du), c added
// (16-bit: rounded once)
OP_CASE(mul_mat_thin_k) {
    for (int64_t k : {16, 64}) {
        INFO("K " << k);
        check_case(be, "short K, f32", [k](leafs &L) {
            ql_tensor *y = ql_mul_mat(L.ctx, L.param({k, 130}), L.param({k, 70}));
            CHECK_FALSE(ql_cuda_mm_thin(y));  // an f32 result: cuBLAS (the device's rule; the CPU runs it too)
            return y;
        }, TOL_MM);
        check_case(be, "short K, transposed a", [k](leafs &L) {
            return ql_mul_mat(L.ctx, ql_transpose(L.ctx, L.param({130, k})), L.param({k, 70}));
        }, TOL_MM);
        for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
            INFO("type: " << std::string(ql_type_name(t)));
            check_case(be, "short K, 16-bit b, mul_mat_acc onto f32", [k, t](leafs &L) {
                return ql_mul_mat_acc(L.ctx, L.param({k, 130}), ql_cast(L.ctx, L.param({k, 70}), t), L.param({130, 70}));
            }, TOL_16);
            check_case(be, "short K, mul_mat_acc onto a 16-bit result", [k, t](leafs &L) {
                ql_tensor *y = ql_mul_mat_to(L.ctx, L.param({96, 130}), ql_cast(L.ctx, L.param({96, 70}), t), t);
                ql_tensor *r = ql_mul_mat_acc(L.ctx, L.param({k, 130}), ql_cast(L.ctx, L.param({k, 70}), t), y);
                CHECK(ql_cuda_mm_thin(r));
                return ql_cast(L.ctx, r, QL_TYPE_F32);
            }, TOL_16);
        }
    }
}

OP_CASE(mul_mat_quantized) {
    for (ql_type t : {QL_TYPE_NF4, QL_TYPE_NF4_NODQ, QL_TYPE_Q4_0, QL_TYPE_Q4_1, QL_TYPE_Q5_0, QL_TYPE_Q5_1, QL_TYPE_Q8_0,
                      QL_TYPE_Q2_K, QL_TYPE_Q3_K, QL_TYPE_Q4_K, QL_TYPE_Q5_K, QL_TYPE_Q6_K, QL_TYPE_IQ4_NL, QL_TYPE_IQ4_XS}) {
        INFO("type: " << std::string(ql_type_name(t)));
        // forward, and backward through the transposed quantized weight (dx = W^T dy); 12 and 11
        // columns: dequantised tiles and cuBLAS on a device, 6 and 3: the decode product that reads
        // the packed weight (ql_cuda_mm_gemv)
        for (int64_t n : {6, 12}) {
            INFO("columns: " << n);
            check_case(be, "frozen quantized a, f32 b", [t, n](leafs &L) {
                return ql_mul_mat(L.ctx, L.rand(t, {512, 24}), L.param({512, n}));
            }, TOL_MM);
        }
        for (int64_t n : {1, 3, 11}) {  // 1: the decode product's 4 rows a block reading a 16-bit b
            INFO("columns: " << n);
            check_case(be, "frozen quantized a, bf16 b", [t, n](leafs &L) {
                return ql_mul_mat(L.ctx, L.rand(t, {256, 20}), ql_cast(L.ctx, L.param({256, n}), QL_TYPE_BF16));
            }, TOL_16);
        }
        // decode: 1 and 8 columns; rows of 2048 (k_gemv: two of a trip's four chunks), 5120 (a whole
        // trip of four chunks, then one chunk and three past the end; the unit kernels: threads with
        // a unit past the end, threads with none) and 9216 (the unit kernels' second trip)
        for (int64_t n : {1, 8})
            for (int64_t k : {2048, 5120, 9216}) {
                INFO("columns: " << n << ", row length " << k);
                check_case(be, "decode product", [t, n, k](leafs &L) {
                    return ql_mul_mat(L.ctx, L.rand(t, {k, 37}), L.rand(QL_TYPE_F32, {k, n}));
                }, TOL_MM, false);
            }
    // onto c (decode's residual: the o and down projections add onto it as they write), c an
    // intermediate that dies there (the product may take over its bytes) or a leaf that lives on
    for (int64_t n : {1, 8})
        for (bool dies : {true, false}) {
            INFO("columns: " << n << (dies ? ", c dies at the product" : ", c a leaf"));
            check_case(be, "decode product onto c", [t, n, dies](leafs &L) {
                ql_tensor *c = dies ? ql_scale(L.ctx, L.rand(QL_TYPE_F32, {37, n}), 3.0f) : L.rand(QL_TYPE_F32, {37, n});
                ql_tensor *y = ql_mul_mat_acc(L.ctx, L.rand(t, {2048, 37}), L.rand(QL_TYPE_F32, {2048, n}), c);
                CHECK(ql_cuda_mm_gemv(y));
                return y;
            }, TOL_MM, false);
        }
    }
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16, QL_TYPE_F32})
        check_case(be, "decode product, a float weight", [t](leafs &L) {
            return ql_mul_mat(L.ctx, L.rand(t, {1024, 37}), L.rand(QL_TYPE_F32, {1024, 2}));
        }, TOL_MM, false);
    for (ql_type t : {QL_TYPE_NF4, QL_TYPE_NF4_NODQ})  // rows of 172: NF4 blocks of 64 cross rows (bitsandbytes' layout)
        check_case(be, "NF4 rows that are not whole blocks", [t](leafs &L) {
            return ql_mul_mat(L.ctx, L.rand(t, {172, 5}), L.param({172, 3}));  // 430 bytes of codes: padded side data
        }, TOL_MM);
}

extern "C" long long qlshim_launches(const char *kernel) __attribute__((weak));  // the shim's count per kernel (NULL elsewhere)

// Decode with 8-bit activations (ql_mul_mat_set_prec Q8_0; ql_cuda_mm_q8 on a device): the
// reference is the CPU's own 8-bit path (the same codes and integer sums; the CPU's test holds it
// to README's bound of the exact product), so only f32 summation order may differ. Every type with
// an integer kernel; 1, 3 and 8 columns; 37 rows (4 a block: a last block of one) and 2; rows of
// one unit's worth up to several trips of 128 threads, and lengths that are not a multiple of 256
// where the type's blocks allow (Q4_0, Q8_0: 32; NF4: 64); Q6_K also in rows of whole chunks of
// 2048 (k_gemv_q8_q6s: one chunk a warp; 5 chunks over 4 warps). Each case checks that the path ran.
OP_CASE(mul_mat_decode_q8) {
    struct shape {
        ql_type t;
        std::vector<int64_t> ks;
    };
    const shape shapes[] = {{QL_TYPE_Q4_0, {96, 544, 4160}},   {QL_TYPE_Q8_0, {32, 544, 4160}},
                            {QL_TYPE_NF4, {64, 576, 4160}},    {QL_TYPE_NF4_NODQ, {192, 4160}},
                            {QL_TYPE_Q4_K, {256, 2304, 5120}}, {QL_TYPE_Q5_K, {256, 2304, 5120}},
                            {QL_TYPE_Q6_K, {256, 2304, 2048, 10240}}, {QL_TYPE_IQ4_NL, {32, 544, 4160}},
                            {QL_TYPE_Q4_1, {32, 544, 4160}},   {QL_TYPE_Q5_0, {32, 544, 4160}},
                            {QL_TYPE_Q5_1, {32, 544, 4160}},
                            {QL_TYPE_IQ4_XS, {256, 2304, 5120}}};
    const bool cuda = strcmp(ql_backend_name(be), "cpu") != 0;
    for (const shape &sh : shapes)
        for (int64_t k : sh.ks)
            for (int64_t n : {1, 3, 8})
                for (int64_t m : {37, 2}) {
                    if (m == 2 && n != 1) continue;
                    INFO("type " << std::string(ql_type_name(sh.t)) << ", K " << k << ", columns " << n << ", rows " << m);
                    const ql_type t = sh.t;
                    check_case(be, "decode product, 8-bit activations", [t, k, n, m, cuda](leafs &L) {
                        // activations with an outlier per column (blocks of very different scales)
                        ql_tensor *y = ql_mul_mat(L.ctx, L.rand(t, {k, m}, -0.5f, 0.5f), L.rand(QL_TYPE_F32, {k, n}, -2.0f, 2.0f));
                        REQUIRE(ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) == QL_OK);
                        if (cuda) CHECK(ql_cuda_mm_q8(y) == (ql_type_traits_get(t)->blck_size == QL_QK_K ? 256 : 32));
                        return y;
                    }, TOL_MM, false);
                }
    // onto c (decode's residual, added as the product is written; c dying there: the product may
    // take its bytes), 1 and 3 columns, for each type at its longest row (Q6_K: whole chunks,
    // k_gemv_q8_q6s, and 2304, k_gemv_q8)
    for (const shape &sh : shapes)
        for (int64_t k : sh.t == QL_TYPE_Q6_K ? std::vector<int64_t>{2304, 10240} : std::vector<int64_t>{sh.ks.back()})
            for (int64_t n : {1, 3}) {
                INFO("onto c: type " << std::string(ql_type_name(sh.t)) << ", K " << k << ", columns " << n);
                const ql_type t = sh.t;
                check_case(be, "decode product onto c, 8-bit activations", [t, k, n, cuda](leafs &L) {
                    ql_tensor *c = ql_scale(L.ctx, L.rand(QL_TYPE_F32, {37, n}, -4.0f, 4.0f), 0.5f);
                    ql_tensor *y = ql_mul_mat_acc(L.ctx, L.rand(t, {k, 37}, -0.5f, 0.5f), L.rand(QL_TYPE_F32, {k, n}, -2.0f, 2.0f), c);
                    REQUIRE(ql_mul_mat_set_prec(y, QL_TYPE_Q8_0) == QL_OK);
                    if (cuda) CHECK(ql_cuda_mm_q8(y) > 0);
                    return y;
                }, TOL_MM, false);
            }
    // products of one b (q, k and v; gate and up) share its codes: made once, unless a node in
    // between used the workspace (here a product in dequantised tiles: made again). The shim counts
    // the quantisations
    for (bool between : {false, true}) {
        INFO(std::string(between ? "a tiled product in between" : "two products of one b"));
        const long long before = qlshim_launches ? qlshim_launches("k_q8_act") : 0;
        check_case(be, "decode products sharing b's 8-bit activations", [between](leafs &L) {
            ql_tensor *b = L.rand(QL_TYPE_F32, {512, 1}, -2.0f, 2.0f);
            ql_tensor *y1 = ql_mul_mat(L.ctx, L.rand(QL_TYPE_Q4_K, {512, 40}), b);
            ql_tensor *y2 = ql_mul_mat(L.ctx, L.rand(QL_TYPE_Q6_K, {512, 40}), b);
            REQUIRE(ql_mul_mat_set_prec(y1, QL_TYPE_Q8_0) == QL_OK);
            REQUIRE(ql_mul_mat_set_prec(y2, QL_TYPE_Q8_0) == QL_OK);
            if (between) {  // y1, then z (12 columns: tiles in the workspace), then y2
                ql_tensor *z = ql_mul_mat(L.ctx, L.rand(QL_TYPE_Q4_K, {512, 40}), L.rand(QL_TYPE_F32, {512, 12}));
                y1 = ql_add(L.ctx, y1, ql_view_2d(L.ctx, z, 40, 1, z->nb[1], 0));
            }
            return ql_add(L.ctx, y1, y2);
        }, TOL_MM, false);
        if (cuda && qlshim_launches) CHECK(qlshim_launches("k_q8_act") - before == (between ? 2 : 1));
    }
}

// ---- the multiply's dequantised tiles (issue 31 item 3): weights in several tiles of 128 rows
// (the tile budget made small here), rows that are not a multiple of the tile, the transposed
// product Wᵀ dy in bands of W's columns, the vectorised dequantisation and its per-element
// fallback, the next tile filled on a side stream (a missing event wait fails the node) ----

void ql_cuda_mm_tile_elems_for_tests(int64_t n);  // qlora.cpp's CUDA planning rules: the tile budget (<= 0: the default)

namespace {
struct tile_budget {  // tiles of `rows` rows of K elements while in scope
    explicit tile_budget(int64_t elems) { ql_cuda_mm_tile_elems_for_tests(elems); }
    ~tile_budget() { ql_cuda_mm_tile_elems_for_tests(0); }
};

// the weight types with their own vectorised code, one through the generic one (Q6_K), and the
// row length each takes (whole blocks; 192 leaves a band of 64 columns after one of 128)
struct tile_type {
    ql_type t;
    int64_t ne0;
};
const tile_type k_tile_types[] = {{QL_TYPE_NF4, 192}, {QL_TYPE_NF4_NODQ, 192}, {QL_TYPE_Q4_0, 192}, {QL_TYPE_Q8_0, 192},
                                  {QL_TYPE_Q4_K, 256}, {QL_TYPE_Q6_K, 256},
                                  {QL_TYPE_NF4, 200},   // rows of 200: an absmax per 8 elements (blocks cross rows)
                                  {QL_TYPE_NF4, 172}};  // 172: the per-element path
const int64_t k_tile_rows[] = {260, 129};  // 128 + 128 + 4 rows (3 tiles: a buffer's reuse), 128 + 1

// the budget for tiles of `rows` rows both ways (W x: rows of W; Wᵀ dy: bands of W's columns)
int64_t budget_for(int64_t rows, const tile_type &tt, int64_t w_rows) { return rows * std::max(tt.ne0, w_rows); }

// an identity [n, n] in f32
ql_tensor *identity(leafs &L, int64_t n) {
    ql_tensor *t = ql_new_tensor_2d(L.ctx, QL_TYPE_F32, n, n);
    std::vector<uint8_t> b((size_t)(n * n) * 4, 0);
    const float one = 1.0f;
    for (int64_t i = 0; i < n; i++) memcpy(b.data() + 4 * (i * n + i), &one, 4);
    return L.add(t, std::move(b));
}
float round_to(float v, ql_type t) {
    return t == QL_TYPE_BF16 ? ql_bf16_to_fp32(ql_fp32_to_bf16(v)) : t == QL_TYPE_F16 ? ql_fp16_to_fp32(ql_fp32_to_fp16(v)) : v;
}
}  // namespace

// W I and Wᵀ I on the backend are the dequantised weight itself: ql_dequantize's bits, rounded to
// the compute type (b's), whatever the tiles - an exact product (sums of one term and zeros).
// Budgets: one tile; tiles of 128 in two buffers; 128 over a budget of 64: one buffer, tiles
// made and used in turn. The compute type turns with them (each weight sees f32, bf16, fp16 in
// each direction)
OP_CASE(mul_mat_tiles_dequantised_bits) {
    const ql_type cts[3] = {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16};
    for (const tile_type &tt : k_tile_types)
        for (int ri = 0; ri < 2; ri++)
            for (int transposed = 0; transposed < 2; transposed++)
                for (int bi = 0; bi < 3; bi++) {
                    const int64_t rows = k_tile_rows[ri], budget = bi == 0 ? 0 : budget_for(bi == 1 ? 128 : 64, tt, rows);
                    const ql_type ct = cts[(ri + transposed + bi) % 3];
                    INFO(std::string(ql_type_name(tt.t)) << " [" << tt.ne0 << ", " << rows << "], compute "
                                                         << std::string(ql_type_name(ct)) << (transposed ? ", W^T I" : ", W I")
                                                         << ", budget " << budget);
                    tile_budget tb(budget);
                    std::vector<uint8_t> wbytes;
                    const run_result r = run_case(be, false, [&](leafs &L) {
                        ql_tensor *w = L.rand(tt.t, {tt.ne0, rows});
                        wbytes = L.all.back().bytes;
                        ql_tensor *a = transposed ? ql_transpose(L.ctx, w) : w;
                        ql_tensor *x = identity(L, a->ne[0]);
                        return ql_mul_mat(L.ctx, a, ct == QL_TYPE_F32 ? x : ql_cast(L.ctx, x, ct));
                    }, false);
                    REQUIRE_MESSAGE(r.error.empty(), r.error);
                    std::vector<float> wd((size_t)(tt.ne0 * rows));
                    REQUIRE(ql_dequantize(tt.t, wbytes.data(), rows, tt.ne0, wd.data()) == QL_OK);
                    REQUIRE(r.out.size() == wd.size());
                    int64_t off = 0, first = -1;
                    for (int64_t m = 0; m < rows; m++)
                        for (int64_t k = 0; k < tt.ne0; k++) {
                            // W I: out [rows, ne0], out(m, k) = W(m, k); Wᵀ I: out [ne0, rows], the weight's own layout
                            const float got = r.out[(size_t)(transposed ? m * tt.ne0 + k : k * rows + m)];
                            if (got != round_to(wd[(size_t)(m * tt.ne0 + k)], ct) && off++ == 0) first = m * tt.ne0 + k;
                        }
                    CHECK_MESSAGE(off == 0, off, " elements differ from ql_dequantize's, the first at flat ", first);
                }
}

// the products against the CPU in tiles of 128: W x and its backward Wᵀ dy (x's gradient), f32,
// bf16 and fp16 b; Wᵀ y and a 16-bit result of it (one GEMM over all of K now)
OP_CASE(mul_mat_tiles) {
    for (const tile_type &tt : k_tile_types) {
        if (tt.t == QL_TYPE_Q6_K || tt.ne0 == 172) continue;  // the generic paths: the bits above, and mul_mat_quantized
        for (int64_t rows : k_tile_rows) {
            INFO(std::string(ql_type_name(tt.t)) << " [" << tt.ne0 << ", " << rows << "]");
            tile_budget tb(budget_for(128, tt, rows));
            check_case(be, "W x, f32", [&](leafs &L) { return ql_mul_mat(L.ctx, L.rand(tt.t, {tt.ne0, rows}), L.param({tt.ne0, 7})); },
                       TOL_MM);
            check_case(be, "W^T y, f32", [&](leafs &L) {
                return ql_mul_mat(L.ctx, ql_transpose(L.ctx, L.rand(tt.t, {tt.ne0, rows})), L.param({rows, 5}));
            }, TOL_MM, false);  // forward only: W x's backward above is this product already
            if (rows != k_tile_rows[0]) continue;
            // onto a c that lives on (the residual under the o and down projections): each tile's
            // GEMM reads its rows of c and writes the sum apart (cuBLASLt's C != D), f32 and bf16 b;
            // 12 columns (8 or fewer: the decode kernel, which adds c itself)
            for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})
                check_case(be, "W x onto a kept c", [&](leafs &L) {
                    ql_tensor *x = L.param({tt.ne0, 12});
                    ql_tensor *y = ql_mul_mat_acc(L.ctx, L.rand(tt.t, {tt.ne0, rows}), t == QL_TYPE_F32 ? x : ql_cast(L.ctx, x, t),
                                                  L.param({rows, 12}));
                    CHECK_FALSE(ql_cuda_mm_gemv(y));
                    return y;
                }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
            for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
                INFO("compute " << std::string(ql_type_name(t)));
                check_case(be, "W x, 16-bit b", [&](leafs &L) {
                    return ql_mul_mat(L.ctx, L.rand(tt.t, {tt.ne0, rows}), ql_cast(L.ctx, L.param({tt.ne0, 6}), t));
                }, TOL_16);
                check_case(be, "W^T y, 16-bit result", [&](leafs &L) {
                    ql_tensor *y = ql_mul_mat_to(L.ctx, ql_transpose(L.ctx, L.rand(tt.t, {tt.ne0, rows})),
                                                 ql_cast(L.ctx, L.param({rows, 5}), t), t);
                    return ql_cast(L.ctx, y, QL_TYPE_F32);
                }, TOL_16, false);
            }
        }
    }
}

// cuBLASLt refusing a C != D product after it took the node's first tile (its heuristics may
// take one shape and not the next): the tiles made stay, each later one copies its own rows of c
// and adds to them by cuBLAS - the bits of the run it never refused (the shim's GEMMs are one
// reference either way), and the CPU's within the products' bound
extern "C" int qlshim_refuse_lt_after(int skip, int n) __attribute__((weak));
TEST_CASE("backend ops cuda: W x onto a kept c, cuBLASLt refusing after the first tile: the same bits" *
          skip_unless(k_have_cuda && qlshim_refuse_lt_after != nullptr, "without the CUDA shim's hooks")) {
    const tile_type tt = k_tile_types[0];
    const int64_t rows = k_tile_rows[0];  // 3 tiles of 128 rows
    tile_budget tb(budget_for(128, tt, rows));
    const builder build = [&](leafs &L) {
        ql_tensor *x = L.param({tt.ne0, 12});  // (more than 8 columns: tiles, not the decode kernel)
        return ql_mul_mat_acc(L.ctx, L.rand(tt.t, {tt.ne0, rows}), ql_cast(L.ctx, x, QL_TYPE_BF16), L.param({rows, 12}));
    };
    auto run = [&](int skip) {  // a fresh backend each: a refusal is remembered by the backend
        ql_backend *be = make_backend("cuda");
        if (skip >= 0) qlshim_refuse_lt_after(skip, 1);
        const run_result r = run_case(be, false, build, false);
        CHECK(qlshim_refuse_lt_after(0, 0) == 0);  // the refusal was met (or none was asked)
        ql_backend_free(be);
        REQUIRE_MESSAGE(r.error.empty(), r.error);
        return r;
    };
    const run_result taken = run(-1);
    ql_backend *cpu = ql_backend_cpu_init(1);
    const run_result ref = run_case(cpu, true, build, false);
    ql_backend_free(cpu);
    CHECK(norm_err(taken.out, ref.out) <= TOL_16);
    for (int skip : {1, 2}) {  // refused at the second tile's GEMM, at the third's
        INFO("cuBLASLt takes " << skip << " GEMMs, then refuses");
        const run_result refused = run(skip);
        REQUIRE(refused.out.size() == taken.out.size());
        CHECK(memcmp(refused.out.data(), taken.out.data(), taken.out.size() * sizeof(float)) == 0);
    }
}

OP_CASE(get_rows) {
    auto ids = [](leafs &L) { return L.i32({11}, [](int64_t i) { return (int32_t)((i * 7 + 3) % 13); }); };
    check_case(be, "f32, backward", [ids](leafs &L) { return ql_get_rows(L.ctx, L.param({40, 13}), ids(L)); }, TOL_F32);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16, QL_TYPE_Q8_0, QL_TYPE_NF4}) {
        INFO("type: " << std::string(ql_type_name(t)));
        check_case(be, "frozen", [ids, t](leafs &L) { return ql_get_rows(L.ctx, L.rand(t, {64, 13}), ids(L)); }, TOL_F32);
    }
}

OP_CASE(rms_norm_silu_swiglu) {
    check_case(be, "rms_norm", [](leafs &L) { return ql_rms_norm(L.ctx, L.param({300, 5}), 1e-5f); }, TOL_F32);
    check_case(be, "rms_norm wide", [](leafs &L) { return ql_rms_norm(L.ctx, L.param({2050, 3}), 1e-6f); }, TOL_F32);
    check_case(be, "silu", [](leafs &L) { return ql_silu(L.ctx, L.param({77, 5}, -6.0f, 6.0f)); }, TOL_F32);
    check_case(be, "swiglu", [](leafs &L) { return ql_swiglu(L.ctx, L.param({77, 5}, -6.0f, 6.0f), L.param({77, 5})); }, TOL_F32);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16}) {  // 16-bit a, b and result; f32 gradients
        INFO("type: " << std::string(ql_type_name(t)));
        check_case(be, "swiglu, 16-bit", [t](leafs &L) {
            ql_tensor *a = ql_cast(L.ctx, L.param({77, 5}, -6.0f, 6.0f), t), *b = ql_cast(L.ctx, L.param({77, 5}), t);
            return ql_cast(L.ctx, ql_swiglu(L.ctx, a, b), QL_TYPE_F32);
        }, TOL_16);
    }
}

// A norm's backward whose result (the residual's gradient, f32) a product reads in 16 bits: the
// device's norm kernel writes the cast too, and the cast node is no launch (ql_cuda_norm_cast_pair).
// x = W p (W NF4, p read in bf16 / f16) normed: backward's dx = norm_back(dy), cast for Wᵀ dx; with
// the residual (x also added to the output) the norm's dx is summed onto x's gradient so far in the
// same kernel; and forward, the norm in f32 and its copy for a product. On the device: the bits of
// the two launches (pairs off), and the CPU's within the 16-bit bound; on the CPU the case is the
// oracle's own
void ql_cuda_launch_pair_for_tests(bool on);
int64_t ql_cuda_pairs_made_for_tests() __attribute__((weak));
namespace {
// the case on a device with its launch pairs on, then off (each node its own launch): the same
// output and gradients bit for bit; the nodes that joined a launch with the pairs on
int64_t paired_as_apart(ql_backend *be, const builder &build) {
    const int64_t made0 = ql_cuda_pairs_made_for_tests ? ql_cuda_pairs_made_for_tests() : 0;
    const run_result paired = run_case(be, false, build, true);
    const int64_t made = ql_cuda_pairs_made_for_tests ? ql_cuda_pairs_made_for_tests() - made0 : -1;
    ql_cuda_launch_pair_for_tests(false);
    const run_result apart = run_case(be, false, build, true);
    ql_cuda_launch_pair_for_tests(true);
    REQUIRE(paired.error.empty());
    REQUIRE(apart.error.empty());
    CHECK(paired.out == apart.out);
    REQUIRE(paired.grads.size() == apart.grads.size());
    for (size_t i = 0; i < paired.grads.size(); i++) CHECK_MESSAGE(paired.grads[i] == apart.grads[i], "gradient ", i);
    return made;
}
// forward: the norm (f32: adapter dropout reads it) and its copy the product reads
ql_tensor *norm_cast_forward_case(leafs &L, ql_type t) {
    ql_tensor *h = ql_rms_norm_mul(L.ctx, L.param({64, 7, 2}), L.rand(QL_TYPE_F32, {64}, 0.5f, 1.5f), 1e-5f);
    return ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_NF4, {64, 40}), ql_cast(L.ctx, h, t), QL_TYPE_F32);
}
ql_tensor *norm_cast_case(leafs &L, ql_type t, bool residual) {
    ql_tensor *p = L.param({64, 7, 2});
    ql_tensor *x = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_NF4, {64, 40}), ql_cast(L.ctx, p, t), QL_TYPE_F32);  // [40, 7, 2]
    ql_tensor *y = ql_rms_norm_mul(L.ctx, x, L.rand(QL_TYPE_F32, {40}, 0.5f, 1.5f), 1e-5f);  // (frozen, as a model's)
    return residual ? ql_add(L.ctx, y, x) : y;
}
}  // namespace
OP_CASE(rms_norm_back_cast) {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (int v = 0; v < 3; v++) {  // backward, backward with the residual, forward
            INFO(std::string(ql_type_name(t)) << std::string(v == 1 ? ", with the residual" : v == 2 ? ", forward" : ""));
            const builder build = [t, v](leafs &L) { return v == 2 ? norm_cast_forward_case(L, t) : norm_cast_case(L, t, v == 1); };
            check_case(be, "rms_norm_back then its 16-bit cast", build, TOL_16);
            if (ql_backend_is_host(be)) continue;
            const int64_t made = paired_as_apart(be, build);
            CHECK(made >= 1);  // the pair was made by one launch
        }
}

// The adapters' dropped-out copies of a normed input (q's, k's and v's, as llama's dropped_copies
// makes them: one after another, each reader placed after the last) follow the norm and its 16-bit
// copy, and the device's norm kernel writes them all (ql_cuda_norm_dropout): one launch for five
// nodes, not four reading the norm's result again. Copies in bf16, f16 and f32, one with its mask
// from row 3 on (a chunk's rows of the whole); without the 16-bit copy too (f32 compute). On the
// device: the bits of the launches apart (pairs off: k_dropout, tested against the CPU), the number
// of nodes the launch made, and the CPU's result within the 16-bit bound
namespace {
ql_tensor *norm_drops_case(leafs &L, ql_type t, bool cast) {
    ql_tensor *h = ql_rms_norm_mul(L.ctx, L.param({64, 7, 2}), L.rand(QL_TYPE_F32, {64}, 0.5f, 1.5f), 1e-5f);
    ql_tensor *hc = cast ? ql_cast(L.ctx, h, t) : nullptr;
    if (hc) h = ql_reshape_4d_after(L.ctx, h, 64, 7, 2, 1, hc);
    ql_tensor *seed = L.i32({1}, [](int64_t) { return 4242; });
    const ql_type types[3] = {t, QL_TYPE_F32, t == QL_TYPE_BF16 ? QL_TYPE_F16 : QL_TYPE_BF16};
    ql_tensor *d[3], *last = nullptr;
    for (int i = 0; i < 3; i++) {
        ql_tensor *src = last ? ql_reshape_4d_after(L.ctx, h, 64, 7, 2, 1, last) : h;
        d[i] = last = ql_dropout_rows_to(L.ctx, src, 0.3f, seed, 7 + (uint32_t)i, types[i], i == 1 ? 3 : 0);
    }
    ql_tensor *y = nullptr;  // (the copies' readers first, as in a linear: the walk meets them before the base product)
    for (int i = 0; i < 3; i++) {
        ql_tensor *di = d[i] == last ? d[i] : ql_reshape_4d_after(L.ctx, d[i], 64, 7, 2, 1, last);
        ql_tensor *p = ql_mul_mat(L.ctx, L.param({64, 40}, -0.5f, 0.5f), di);  // (an adapter's A, trained)
        y = y ? ql_add(L.ctx, y, p) : p;
    }
    return hc ? ql_add(L.ctx, y, ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_NF4, {64, 40}), hc, QL_TYPE_F32)) : y;
}
}  // namespace
OP_CASE(rms_norm_dropout_copies) {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (bool cast : {true, false}) {
            INFO(std::string(ql_type_name(t)) << std::string(cast ? ", with the 16-bit copy" : ", no 16-bit copy"));
            const builder build = [t, cast](leafs &L) { return norm_drops_case(L, t, cast); };
            check_case(be, "rms_norm then its cast and three dropped-out copies", build, TOL_16);
            if (ql_backend_is_host(be)) continue;
            const int64_t made = paired_as_apart(be, build);
            CHECK(made == (cast ? 4 : 3));  // the cast and the three copies made by the norm's launch
        }
}

// SwiGLU's result and the down projection adapter's dropped-out copy of it by one launch
// (ql_cuda_swiglu_dropout): the copy from each element as stored, with k_dropout's mask and scale.
// 16-bit and f32 operands, copies in another type, a mask from row 2 on; rows of 77 (the vector
// path's tail) and 96 (whole vectors); the strided kernel too (fast paths off). On the device: the
// bits of the two launches (pairs off) and the CPU's within the bound
void ql_cuda_ew_fast_for_tests(bool on) __attribute__((weak));  // qlora-cuda.cu (absent without the CUDA backend)
OP_CASE(swiglu_dropout_copy) {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16, QL_TYPE_F32})
        for (int64_t ne0 : {77, 96})
            for (bool fast : {true, false}) {
                const ql_type td = t == QL_TYPE_F32 ? QL_TYPE_BF16 : t;
                INFO(std::string(ql_type_name(t)) << ", rows of " << ne0 << std::string(fast ? "" : ", fast paths off"));
                const builder build = [t, td, ne0](leafs &L) {
                    ql_tensor *a = L.param({ne0, 5}, -4.0f, 4.0f), *b = L.param({ne0, 5});
                    if (t != QL_TYPE_F32) a = ql_cast(L.ctx, a, t), b = ql_cast(L.ctx, b, t);
                    ql_tensor *g = ql_swiglu(L.ctx, a, b);
                    ql_tensor *seed = L.i32({1}, [](int64_t) { return 515; });
                    ql_tensor *d = ql_dropout_rows_to(L.ctx, g, 0.25f, seed, 3, td, 2);
                    return ql_add(L.ctx, ql_mul_mat(L.ctx, L.param({ne0, 24}, -0.5f, 0.5f), d),  // (A's product, then the base's)
                                  ql_mul_mat(L.ctx, L.rand(QL_TYPE_F32, {ne0, 24}, -0.5f, 0.5f), g));
                };
                if (ql_cuda_ew_fast_for_tests && !ql_backend_is_host(be)) ql_cuda_ew_fast_for_tests(fast);
                check_case(be, "swiglu and its dropped-out copy", build, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
                if (!ql_backend_is_host(be)) {
                    const int64_t made = paired_as_apart(be, build);
                    CHECK(made == 1);  // the copy made by SwiGLU's launch
                }
                if (ql_cuda_ew_fast_for_tests && !ql_backend_is_host(be)) ql_cuda_ew_fast_for_tests(true);
            }
}

// Attention's backward gives the gradients of q, k and v as views of one result; v's, read by its
// 16-bit product, is cast, then q's and k's rotations back (a rope pair) follow. The rotations'
// launch writes the cast too (ql_cuda_cast_rope): the block's q, k, v projections (NF4, 16-bit
// results, q's rotation placed after k's projection as llama places it), GQA 4:2, head dim 16. On
// the device: the bits of the launches apart, three nodes joined (forward's rope pair, backward's
// and the cast), and the CPU's within the 16-bit bound
OP_CASE(rope_back_cast) {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        INFO(std::string(ql_type_name(t)));
        const builder build = [t](leafs &L) {
            const int64_t E = 64, D = 16, H = 4, Hkv = 2, T = 12;
            ql_tensor *x = ql_cast(L.ctx, L.param({E, T}), t);
            auto lin = [&](int64_t out) { return ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_NF4, {E, out}), x, t); };
            ql_tensor *kl = lin(D * Hkv), *vl = lin(D * Hkv);
            ql_tensor *q = ql_reshape_4d_after(L.ctx, lin(D * H), D, H, T, 1, kl);
            ql_tensor *k = ql_reshape_4d(L.ctx, kl, D, Hkv, T, 1), *v = ql_reshape_4d(L.ctx, vl, D, Hkv, T, 1);
            ql_tensor *pos = L.i32({T, 1}, [](int64_t i) { return (int32_t)(i * 3 % 17); });
            q = ql_rope(L.ctx, q, pos, nullptr, (int)D, QL_ROPE_NORMAL, 10000.0f);
            k = ql_rope(L.ctx, k, pos, nullptr, (int)D, QL_ROPE_NORMAL, 10000.0f);
            ql_tensor *a = ql_flash_attn(L.ctx, ql_permute(L.ctx, q, 0, 2, 1, 3), ql_permute(L.ctx, k, 0, 2, 1, 3),
                                         ql_permute(L.ctx, v, 0, 2, 1, 3), nullptr, 0.25f);
            return ql_cast(L.ctx, ql_reshape_2d(L.ctx, a, D * H, T), QL_TYPE_F32);
        };
        check_case(be, "rope_back with the values' gradient cast", build, TOL_16);
        if (ql_backend_is_host(be)) continue;
        const int64_t made = paired_as_apart(be, build);
        CHECK(made == 3);  // forward's rotations, backward's, and the cast joining backward's launch
    }
}

// ---- the element-wise ops' typed fast paths (issue 28 item 2): contiguous, 16-byte aligned
// operands take vectors of 8 elements and a scalar tail; other layouts the strided kernels. Each
// case runs on the backend twice, fast paths on and off: the same bits (the same float math per
// element, the same rounding), and against the CPU (exactly where the op is a copy or a cast).
// Element counts: under one vector, whole vectors, whole vectors and a tail; views at 4 bytes
// (misaligned: the strided kernels) and 16 bytes (aligned: the fast path) into a leaf. ----

int64_t ql_cuda_ew_fast_launches_for_tests() __attribute__((weak));

namespace {

struct ew_fast_off {  // the strided kernels for every layout while in scope
    ew_fast_off() { ql_cuda_ew_fast_for_tests(false); }
    ~ew_fast_off() { ql_cuda_ew_fast_for_tests(true); }
};

// `build` on be: against the CPU within tol; on CUDA also the fast paths' bits against the strided
// kernels', and `fast` of its launches taken by a fast path (-1: any number, at least one); returns that number
int64_t ew_case(ql_backend *be, const char *what, const builder &build, double tol, int fast, bool backward = true) {
    INFO("case: " << std::string(what));
    const bool cuda = ql_backend_is_cuda(be);
    const int64_t n0 = cuda ? ql_cuda_ew_fast_launches_for_tests() : 0;
    check_case(be, what, build, tol, backward);
    if (!cuda) return 0;
    const int64_t n_fast = ql_cuda_ew_fast_launches_for_tests() - n0;
    if (fast < 0) CHECK_MESSAGE(n_fast > 0, std::string(what), ": no fast path taken");
    else CHECK_MESSAGE(n_fast == fast, std::string(what), ": ", n_fast, " fast-path launches, expected ", fast);
    const run_result on = run_case(be, false, build, backward);
    run_result off;
    {
        ew_fast_off guard;
        off = run_case(be, false, build, backward);
    }
    REQUIRE(on.error.empty());
    REQUIRE(off.error.empty());
    auto same = [](const std::vector<float> &x, const std::vector<float> &y) {
        return x.size() == y.size() && (x.empty() || !memcmp(x.data(), y.data(), x.size() * sizeof(float)));
    };
    CHECK_MESSAGE(same(on.out, off.out), std::string(what), ": the fast path's output is not the strided kernel's bits");
    REQUIRE(on.grads.size() == off.grads.size());
    for (size_t i = 0; i < on.grads.size(); i++) CHECK_MESSAGE(same(on.grads[i], off.grads[i]), std::string(what), ": gradient ", i, " differs");
    return n_fast;
}

}  // namespace

OP_CASE(elementwise_fast_paths) {
    const ql_type types[3] = {QL_TYPE_F32, QL_TYPE_F16, QL_TYPE_BF16};
    for (int64_t n0 : {5, 64, 37}) {  // one row of n0 x 5: a tail only, whole vectors, vectors and a tail of 1
        INFO("elements " << n0 << " x 5");
        // cont: every pair of the float types (the same type: the bits moved), forward only: one launch each
        for (ql_type s : types)
            for (ql_type d : types) {
                INFO("cont " << std::string(ql_type_name(s)) << " -> " << std::string(ql_type_name(d)));
                ew_case(be, "cont", [n0, s, d](leafs &L) {
                    ql_tensor *x = L.rand(s, {n0, 5}, -70000.0f, 70000.0f);  // (f16 overflows to inf: the same on both)
                    return ql_cast(L.ctx, x, d);
                }, 0.0, 1, false);
            }
        ew_case(be, "cont i32", [n0](leafs &L) {
            return ql_cont(L.ctx, L.i32({n0, 5}, [](int64_t i) { return (int32_t)(i * 2654435761u); }));
        }, 0.0, 1, false);
        // add, mul (the backward: reduce_to and mul, fast paths too), scale, silu and its backward
        ew_case(be, "add", [n0](leafs &L) { return ql_add(L.ctx, L.param({n0, 5}), L.param({n0, 5})); }, TOL_F32, -1);
        ew_case(be, "mul", [n0](leafs &L) { return ql_mul(L.ctx, L.param({n0, 5}), L.param({n0, 5})); }, TOL_F32, -1);
        ew_case(be, "scale", [n0](leafs &L) { return ql_scale(L.ctx, L.param({n0, 5}), -0.37f); }, TOL_F32, -1);
        ew_case(be, "silu", [n0](leafs &L) { return ql_silu(L.ctx, L.param({n0, 5}, -6.0f, 6.0f)); }, TOL_F32, -1);
        // acc_grad: a parameter used twice, its two contributions added into its gradient
        ew_case(be, "acc_grad", [n0](leafs &L) {
            ql_tensor *p = L.param({n0, 5});
            return ql_add(L.ctx, ql_scale(L.ctx, p, 0.5f), ql_silu(L.ctx, p));
        }, TOL_F32, -1);
        // swiglu and its backward in each type (16-bit: rounded once on store)
        for (ql_type t : types) {
            INFO("swiglu " << std::string(ql_type_name(t)));
            ew_case(be, "swiglu", [n0, t](leafs &L) {
                ql_tensor *a = L.param({n0, 5}, -6.0f, 6.0f), *b = L.param({n0, 5});
                if (t != QL_TYPE_F32) a = ql_cast(L.ctx, a, t), b = ql_cast(L.ctx, b, t);
                return ql_cast(L.ctx, ql_swiglu(L.ctx, a, b), QL_TYPE_F32);
            }, t == QL_TYPE_F32 ? TOL_F32 : TOL_16, -1);
        }
    }
    // swiglu's backward: the db half at d + n, aligned where n is a multiple of 4 (36 x 5 = 180:
    // vectors and a tail of 4) takes the fast path, 37 x 5 does not; nor does the consumer of
    // the db half (a view at n floats), the other ops alike
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16}) {
        int64_t n_fast[2] = {0, 0};
        for (int64_t n0 : {36, 37}) {
            INFO("elements " << n0 << " x 5, " << std::string(ql_type_name(t)));
            n_fast[n0 - 36] = ew_case(be, "swiglu back", [n0, t](leafs &L) {
                ql_tensor *a = ql_cast(L.ctx, L.param({n0, 5}, -6.0f, 6.0f), t), *b = ql_cast(L.ctx, L.param({n0, 5}), t);
                return ql_cast(L.ctx, ql_swiglu(L.ctx, a, b), QL_TYPE_F32);
            }, t == QL_TYPE_F32 ? TOL_F32 : TOL_16, -1);
        }
        if (ql_backend_is_cuda(be)) CHECK_MESSAGE(n_fast[0] == n_fast[1] + 2, "swiglu_back's fast path: ", n_fast[0], " vs ", n_fast[1]);
    }
    // broadcasts: b one row of a multiple of 8 (fast), of 36 or a column (strided), grouped (strided)
    ew_case(be, "add, a row of 64", [](leafs &L) { return ql_add(L.ctx, L.rand(QL_TYPE_F32, {64, 7}), L.rand(QL_TYPE_F32, {64})); },
            TOL_F32, 1, false);
    ew_case(be, "mul, a row of 64", [](leafs &L) { return ql_mul(L.ctx, L.rand(QL_TYPE_F32, {64, 7}), L.rand(QL_TYPE_F32, {64})); },
            TOL_F32, 1, false);
    ew_case(be, "add, a row of 8 repeated along rows of 16", [](leafs &L) {
        return ql_add(L.ctx, L.rand(QL_TYPE_F32, {16, 7}), L.rand(QL_TYPE_F32, {8}));
    }, TOL_F32, 1, false);
    ew_case(be, "add, a row of 36", [](leafs &L) { return ql_add(L.ctx, L.rand(QL_TYPE_F32, {36, 7}), L.rand(QL_TYPE_F32, {36})); },
            TOL_F32, 0, false);
    ew_case(be, "mul, a column", [](leafs &L) { return ql_mul(L.ctx, L.rand(QL_TYPE_F32, {64, 7}), L.rand(QL_TYPE_F32, {1, 7})); },
            TOL_F32, 0, false);
    // views into a leaf of 400: at 4 bytes (misaligned: strided kernels), at 16 (aligned: fast)
    for (int64_t off : {1, 4}) {
        INFO("view at element " << off);
        const int fast = off % 4 == 0 ? 1 : 0;
        ew_case(be, "cont of a view", [off](leafs &L) {
            ql_tensor *x = L.rand(QL_TYPE_F32, {400});
            return ql_cast(L.ctx, ql_view_1d(L.ctx, x, 333, off * 4), QL_TYPE_BF16);
        }, 0.0, fast, false);
        ew_case(be, "copy of a view", [off](leafs &L) {
            ql_tensor *x = L.rand(QL_TYPE_F32, {400});
            return ql_cont(L.ctx, ql_view_1d(L.ctx, x, 333, off * 4));
        }, 0.0, fast, false);
        ew_case(be, "add of a view", [off](leafs &L) {
            ql_tensor *x = L.rand(QL_TYPE_F32, {400});
            return ql_add(L.ctx, ql_view_1d(L.ctx, x, 333, off * 4), L.rand(QL_TYPE_F32, {333}));
        }, TOL_F32, fast, false);
        ew_case(be, "scale of a view", [off](leafs &L) {
            ql_tensor *x = L.rand(QL_TYPE_F32, {400});
            return ql_scale(L.ctx, ql_view_1d(L.ctx, x, 333, off * 4), 3.0f);
        }, TOL_F32, fast, false);
        ew_case(be, "swiglu of views", [off](leafs &L) {
            ql_tensor *x = ql_cast(L.ctx, L.rand(QL_TYPE_F32, {400}, -6.0f, 6.0f), QL_TYPE_BF16);
            return ql_swiglu(L.ctx, ql_view_1d(L.ctx, x, 333, off * 2 * 2), ql_view_1d(L.ctx, x, 333, 0));
        }, TOL_16, fast + 1, false);  // (+ the cast)
    }
}

// ql_scale_to (issue 28 item 2: LoRA's s A x and its 16-bit cast as one node): s a in f32, rounded
// once on store - on every backend the bits of the CPU's ql_cast(ql_scale(a, s), type), fast paths
// and strided kernels alike (a view at element 1: the strided kernel), f16 past its range (inf);
// the gradient ql_scale's
OP_CASE(scale_to) {
    auto bits = [](const std::vector<float> &x, const std::vector<float> &y) {
        return x.size() == y.size() && !x.empty() && !memcmp(x.data(), y.data(), x.size() * sizeof(float));
    };
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_F16, QL_TYPE_BF16})
        for (int64_t n0 : {5, 64, 37, 333}) {
            INFO(std::string(ql_type_name(t)) << ", elements " << n0 << " x 5" << std::string(n0 == 333 ? ", a view at element 1" : ""));
            const float lo = t == QL_TYPE_F16 ? -300000.0f : -3.0f, hi = -lo;  // (f16: some products past 65504)
            auto a = [n0, lo, hi](leafs &L) {
                if (n0 != 333) return L.param({n0, 5}, lo, hi);
                ql_tensor *x = L.param({400, 5}, lo, hi);
                return ql_view_2d(L.ctx, x, 333, 5, x->nb[1], 4);
            };
            const builder fused = [t, a](leafs &L) { return ql_cast(L.ctx, ql_scale_to(L.ctx, a(L), 0.37f, t), QL_TYPE_F32); };
            const builder pair = [t, a](leafs &L) {
                return ql_cast(L.ctx, ql_cast(L.ctx, ql_scale(L.ctx, a(L), 0.37f), t), QL_TYPE_F32);
            };
            ew_case(be, "scale_to", fused, 0.0, -1);
            ql_backend *cpu = ql_backend_cpu_init(1);
            const run_result ref = run_case(cpu, true, pair, true);
            ql_backend_free(cpu);
            const run_result got = run_case(be, false, fused, true);
            REQUIRE(ref.error.empty());
            REQUIRE(got.error.empty());
            CHECK_MESSAGE(bits(got.out, ref.out), "scale_to: not the bits of the CPU's cast(scale(a, s))");
            REQUIRE(got.grads.size() == 1);
            REQUIRE(ref.grads.size() == 1);
            CHECK_MESSAGE(bits(got.grads[0], ref.grads[0]), "scale_to's gradient: not the pair's");
        }
}

// ql_rms_norm_mul (issue 28 item 2: a norm times its weight as one node): on every backend the
// bits of that backend's ql_mul(ql_rms_norm(a), w), forward and backward (rms_norm_back with dy * w
// made in it; a trainable weight's reduce), within TOL_F32 of the CPU; rows of a view of rows (the
// FFN's chunks), a row wider than a block, the result cast to 16 bits as the model's compute input -
// and written in 16 bits (ql_rms_norm_mul_to): that cast's bits
OP_CASE(rms_norm_mul) {
    auto bits = [](const std::vector<float> &x, const std::vector<float> &y) {
        return x.size() == y.size() && !x.empty() && !memcmp(x.data(), y.data(), x.size() * sizeof(float));
    };
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_F16, QL_TYPE_BF16})
        for (int64_t n0 : {300, 2050, 64})
            for (bool w_trained : {false, true}) {
                INFO(std::string(ql_type_name(t)) << ", rows of " << n0 << std::string(n0 == 64 ? " (a view of rows 2..6 of 9)" : "")
                                                  << std::string(w_trained ? ", w trained" : ""));
                auto make = [t, n0, w_trained](leafs &L, bool fused) {
                    ql_tensor *x = L.param({n0, n0 == 64 ? 9 : 5}, -2.0f, 2.0f);
                    if (n0 == 64) x = ql_view_2d(L.ctx, x, 64, 4, x->nb[1], 2 * x->nb[1]);
                    ql_tensor *w = w_trained ? L.param({n0}, 0.5f, 1.5f) : L.rand(QL_TYPE_F32, {n0}, 0.5f, 1.5f);
                    ql_tensor *y = fused ? ql_rms_norm_mul(L.ctx, x, w, 1e-5f) : ql_mul(L.ctx, ql_rms_norm(L.ctx, x, 1e-5f), w);
                    return t == QL_TYPE_F32 ? y : ql_cast(L.ctx, ql_cast(L.ctx, y, t), QL_TYPE_F32);
                };
                const builder fused = [make](leafs &L) { return make(L, true); }, pair = [make](leafs &L) { return make(L, false); };
                check_case(be, "rms_norm_mul", fused, t == QL_TYPE_F32 ? TOL_F32 : TOL_16);
                const run_result want = run_case(be, false, pair, true), got = run_case(be, false, fused, true);
                REQUIRE(want.error.empty());
                REQUIRE(got.error.empty());
                CHECK_MESSAGE(bits(got.out, want.out), "rms_norm_mul: not the bits of mul(rms_norm(a), w) on this backend");
                REQUIRE(got.grads.size() == want.grads.size());
                for (size_t i = 0; i < got.grads.size(); i++) CHECK_MESSAGE(bits(got.grads[i], want.grads[i]), "gradient ", i, " differs");
                // ql_rms_norm_mul_to: the result written in t, the bits of the cast of the f32 node
                const builder to = [t, n0, w_trained](leafs &L) {
                    ql_tensor *x = L.param({n0, n0 == 64 ? 9 : 5}, -2.0f, 2.0f);
                    if (n0 == 64) x = ql_view_2d(L.ctx, x, 64, 4, x->nb[1], 2 * x->nb[1]);
                    ql_tensor *w = w_trained ? L.param({n0}, 0.5f, 1.5f) : L.rand(QL_TYPE_F32, {n0}, 0.5f, 1.5f);
                    return ql_cast(L.ctx, ql_rms_norm_mul_to(L.ctx, x, w, 1e-5f, t), QL_TYPE_F32);
                };
                const run_result got_to = run_case(be, false, to, true);
                REQUIRE(got_to.error.empty());
                CHECK_MESSAGE(bits(got_to.out, got.out), "rms_norm_mul_to: not the bits of the cast of rms_norm_mul on this backend");
                REQUIRE(got_to.grads.size() == got.grads.size());
                for (size_t i = 0; i < got.grads.size(); i++) CHECK_MESSAGE(bits(got_to.grads[i], got.grads[i]), "rms_norm_mul_to's gradient ", i);
            }
}

void ql_autodiff_fold_for_tests(bool on);  // qlora.cpp's autodiff: a gradient's 16-bit cast or sum folded into the node making it

namespace {
struct fold_off {  // autodiff's separate casts and adds while in scope
    fold_off() { ql_autodiff_fold_for_tests(false); }
    ~fold_off() { ql_autodiff_fold_for_tests(true); }
};
// build's one parameter's gradient with autodiff's folds and without: the same bits (and, with
// same_out, the same output)
void check_fold_bits(ql_backend *be, const builder &build, const char *what, bool same_out = false) {
    const run_result folded = run_case(be, false, build, true);
    run_result apart;
    {
        fold_off off;
        apart = run_case(be, false, build, true);
    }
    REQUIRE(folded.error.empty());
    REQUIRE(apart.error.empty());
    REQUIRE(folded.grads.size() == 1);
    REQUIRE(apart.grads.size() == 1);
    if (same_out) CHECK(folded.out == apart.out);
    CHECK_MESSAGE(!memcmp(folded.grads[0].data(), apart.grads[0].data(), folded.grads[0].size() * sizeof(float)), what);
}
}  // namespace

// SwiGLU's backward writing gate's and up's gradients in the type their multiplies read (autodiff
// folds the two casts into it): on every backend the bits of the f32 node and its casts (the
// folding off), fast path and strided kernel alike, within TOL_16 of the CPU; 16-bit gate and up,
// and f32 ones read by 16-bit multiplies (fp16's guard); rows of 40 (vectors, the db half aligned)
// and 37 (tails; in 16 bits the db half is not 16-byte aligned: the strided kernel)
OP_CASE(swiglu_back_to) {
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16})
        for (bool guard : {false, true})
            for (int64_t n_ff : {40, 37}) {
                INFO(std::string(ql_type_name(t)) << std::string(guard ? ", f32 gate and up" : "") << ", n_ff " << n_ff);
                const builder build = [t, guard, n_ff](leafs &L) {
                    ql_tensor *x = ql_cast(L.ctx, L.param({32, 6}), t);
                    const ql_type out = guard ? QL_TYPE_F32 : t;
                    ql_tensor *g = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {32, n_ff}, -0.5f, 0.5f), x, out);
                    ql_tensor *u = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {32, n_ff}, -0.5f, 0.5f), x, out);
                    ql_tensor *y = ql_swiglu(L.ctx, g, u);
                    return out == QL_TYPE_F32 ? y : ql_cast(L.ctx, y, QL_TYPE_F32);
                };
                ew_case(be, "swiglu_back_to", build, TOL_16, -1);
                check_fold_bits(be, build, "x's gradient through the folded casts: not the bits of the separate ones", true);
            }
}

// rope's backward writing q's gradient in the type its multiply reads (autodiff folds the cast
// into it): on every backend the bits of the f32 rope_back and its cast (the folding off), within
// TOL_16 of the CPU; whole and partial rotations (a pass-through tail rounded as stored), both modes
OP_CASE(rope_back_to) {
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16})
        for (int mode : {QL_ROPE_NORMAL, QL_ROPE_NEOX})
            for (int n_dims : {12, 8}) {
                INFO(std::string(ql_type_name(t)) << ", mode " << mode << ", n_dims " << n_dims);
                const builder build = [t, mode, n_dims](leafs &L) {
                    ql_tensor *pos = L.i32({5, 2}, [](int64_t i) { return (int32_t)(7 * i + 3); });
                    ql_tensor *ff = n_dims < 12 ? L.rand(QL_TYPE_F32, {n_dims / 2}, 1.0f, 8.0f) : nullptr;
                    ql_tensor *x = ql_cast(L.ctx, L.param({32, 10}), t);
                    ql_tensor *q = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {32, 36}, -0.5f, 0.5f), x, t);  // [36, 10]
                    ql_tensor *r = ql_rope(L.ctx, ql_reshape_4d(L.ctx, q, 12, 3, 5, 2), pos, ff, n_dims, mode, 10000.0f);
                    return ql_cast(L.ctx, r, QL_TYPE_F32);
                };
                check_case(be, "rope_back_to", build, TOL_16);
                check_fold_bits(be, build, "x's gradient through the folded cast: not the bits of rope_back and the cast", true);
                // (the fold is there: one rope_back, in t, and no f32 one)
                ql_init_params ip = {16u << 20, nullptr, false, false};
                std::unique_ptr<ql_context, void (*)(ql_context *)> ctx(ql_init(ip), ql_free);
                leafs L{ctx.get(), true, {}, {}};
                ql_tensor *loss = ql_sum(ctx.get(), build(L));
                ql_graph *gf = ql_graph_new(ctx.get());
                REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
                ql_graph *gb = ql_graph_backward(ctx.get(), gf, loss);
                REQUIRE(gb);
                int rb16 = 0, rb32 = 0;
                for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
                    const ql_tensor *n = ql_graph_node(gb, i);
                    if (n->op == QL_OP_ROPE_BACK) (n->type == t ? rb16 : rb32)++;
                }
                CHECK(rb16 == 1);
                CHECK(rb32 == 0);
                ql_graph_free(gb);
                ql_graph_free(gf);
            }
}

// a norm's dx summed onto its input's gradient so far by rms_norm_back (autodiff folds the add in;
// y = x + rms_norm_mul(x, w), the residual stream's shape: the sum so far is also the norm's dy):
// on every backend the bits of rms_norm_back and ql_add (the folding off), within TOL_F32 of the CPU
OP_CASE(rms_norm_back_acc) {
    for (int64_t n0 : {300, 2050})
        for (bool weighted : {false, true}) {
            INFO("rows of " << n0 << std::string(weighted ? ", weighted" : ""));
            const builder build = [n0, weighted](leafs &L) {
                ql_tensor *x = L.param({n0, 5}, -2.0f, 2.0f);
                ql_tensor *n = weighted ? ql_rms_norm_mul(L.ctx, x, L.rand(QL_TYPE_F32, {n0}, 0.5f, 1.5f), 1e-5f) : ql_rms_norm(L.ctx, x, 1e-5f);
                return ql_add(L.ctx, x, n);
            };
            check_case(be, "rms_norm_back onto the gradient so far", build, TOL_F32);
            check_fold_bits(be, build, "x's gradient with the add folded: not the bits of rms_norm_back and the add");
        }
}

// a gradient copied to be contiguous (a reshape's backward over a permuted view, as attention's dv)
// that a 16-bit multiply reads: autodiff's cast reads the permuted view itself (the strided k_cont
// on CUDA) - x's gradient the bits of the copy and the cast, within TOL_16 of the CPU
OP_CASE(cast_of_copy_folded) {
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16}) {
        INFO(std::string(ql_type_name(t)));
        const builder build = [t](leafs &L) {
            ql_tensor *x = ql_cast(L.ctx, L.param({16, 12}), t);
            ql_tensor *v = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {16, 24}, -0.5f, 0.5f), x, t);  // [24, 12]
            ql_tensor *p = ql_permute(L.ctx, ql_reshape_4d(L.ctx, v, 8, 3, 12, 1), 0, 2, 1, 3);    // [8, 12, 3, 1]
            return ql_cast(L.ctx, p, QL_TYPE_F32);
        };
        check_case(be, "cast of a copy, folded", build, TOL_16);
        check_fold_bits(be, build, "x's gradient through the folded cast: not the bits of the copy and the cast");
    }
}

OP_CASE(rope) {
    for (int mode : {QL_ROPE_NORMAL, QL_ROPE_NEOX}) {
        INFO("mode: " << mode);
        check_case(be, "rope", [mode](leafs &L) {
            ql_tensor *pos = L.i32({7, 2}, [](int64_t i) { return (int32_t)(i * 3 + 1); });
            return ql_rope(L.ctx, L.param({16, 3, 7, 2}), pos, nullptr, 16, mode, 10000.0f);
        }, TOL_F32);
        check_case(be, "rope, partial dims and freq factors", [mode](leafs &L) {
            ql_tensor *pos = L.i32({5, 1}, [](int64_t i) { return (int32_t)(100 + i); });
            ql_tensor *ff = L.rand(QL_TYPE_F32, {4}, 1.0f, 8.0f);
            return ql_rope(L.ctx, L.param({12, 2, 5, 1}), pos, ff, 8, mode, 500000.0f);
        }, TOL_F32);
        // 16-bit in and out (q and k under a 16-bit compute type), the pass-through tail too: the
        // same f32 rotation rounded once (the backends' sin/cos differ in the last bits of f32)
        for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
            INFO("type: " << std::string(ql_type_name(t)));
            check_case(be, "rope, 16-bit, partial dims and freq factors", [mode, t](leafs &L) {
                ql_tensor *pos = L.i32({5, 2}, [](int64_t i) { return (int32_t)(7 * i + 3); });
                ql_tensor *ff = L.rand(QL_TYPE_F32, {4}, 1.0f, 8.0f);
                // a view of the input, as q's and k's (no rope in place over it: the tail is copied)
                ql_tensor *x = ql_reshape_4d(L.ctx, ql_cast(L.ctx, L.param({36, 5, 2}), t), 12, 3, 5, 2);
                ql_tensor *r = ql_rope(L.ctx, x, pos, ff, 8, mode, 10000.0f);
                REQUIRE(r->type == t);
                return ql_cast(L.ctx, r, QL_TYPE_F32);
            }, TOL_16);
        }
    }
    // q's and k's rotations as neighbours in the graph (q's placed after k's projection), which a
    // device makes by one launch forward and, their gradients' rotations, backward: 4 and 2 heads,
    // 16-bit and f32, both modes
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})
        for (int mode : {QL_ROPE_NORMAL, QL_ROPE_NEOX}) {
            INFO("q and k, " << std::string(ql_type_name(t)) << ", mode " << mode);
            check_case(be, "rope, q's and k's as neighbours", [t, mode](leafs &L) {
                ql_tensor *pos = L.i32({7, 2}, [](int64_t i) { return (int32_t)(5 * i + 2); });
                ql_tensor *x = L.param({24, 7, 2});
                ql_tensor *xc = t == QL_TYPE_F32 ? x : ql_cast(L.ctx, x, t);
                ql_tensor *kl = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {24, 32}, -0.5f, 0.5f), xc, t);  // [32, 7, 2]
                ql_tensor *ql = ql_mul_mat_to(L.ctx, L.rand(QL_TYPE_F32, {24, 64}, -0.5f, 0.5f), xc, t);
                ql_tensor *q = ql_rope(L.ctx, ql_reshape_4d_after(L.ctx, ql, 16, 4, 7, 2, kl), pos, nullptr, 16, mode, 10000.0f);
                ql_tensor *k = ql_rope(L.ctx, ql_reshape_4d(L.ctx, kl, 16, 2, 7, 2), pos, nullptr, 16, mode, 10000.0f);
                // one node reads both rotations (as attention does): q's first, so they are neighbours
                return ql_mul_mat(L.ctx, ql_reshape_2d(L.ctx, q, 16, 56), ql_reshape_2d(L.ctx, k, 16, 28));  // [56, 28]
            }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
        }
    if (!ql_backend_is_host(be)) return;
    // the CPU (the oracle): a 16-bit rope is the f32 rope of the widened input, rounded once - bit for bit
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        auto build = [t](bool widen) {
            return [t, widen](leafs &L) {
                ql_tensor *pos = L.i32({6, 1}, [](int64_t i) { return (int32_t)(11 * i); });
                ql_tensor *x = ql_cast(L.ctx, L.param({10, 2, 6, 1}, -3.0f, 3.0f), t);
                ql_tensor *r = widen ? ql_cast(L.ctx, ql_rope(L.ctx, ql_cast(L.ctx, x, QL_TYPE_F32), pos, nullptr, 8, QL_ROPE_NEOX, 100.0f), t)
                                     : ql_rope(L.ctx, x, pos, nullptr, 8, QL_ROPE_NEOX, 100.0f);
                return ql_cast(L.ctx, r, QL_TYPE_F32);
            };
        };
        const run_result a = run_case(be, true, build(false), true), b = run_case(be, true, build(true), true);
        REQUIRE(a.error.empty());
        REQUIRE(b.error.empty());
        CHECK(a.out == b.out);
        CHECK(a.grads == b.grads);
    }
}

OP_CASE(cross_entropy) {
    check_case(be, "with ignored targets", [](leafs &L) {
        ql_tensor *tg = L.i32({9, 2}, [](int64_t i) { return i % 4 == 3 ? -1 : (int32_t)((i * 37) % 1000); });
        return ql_cross_entropy(L.ctx, L.param({1000, 9, 2}, -4.0f, 4.0f), tg, L.scalar(11.0f));
    }, TOL_F32);
    // dlogits written in 16 bits (ql_cross_entropy_back_to: the fused head's Wᵀ dlogits reads
    // them so): the bits of the f32 result's cast, on this backend, and the CPU's within the bound
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        INFO("dlogits in " << std::string(ql_type_name(t)));
        auto build = [t](bool direct) {
            return [t, direct](leafs &L) {
                ql_tensor *tg = L.i32({9, 2}, [](int64_t i) { return i % 4 == 3 ? -1 : (int32_t)((i * 37) % 1000); });
                ql_tensor *ce = ql_cross_entropy(L.ctx, L.rand(QL_TYPE_F32, {1000, 9, 2}, -4.0f, 4.0f), tg, L.scalar(11.0f));
                ql_tensor *dy = L.scalar(0.75f);
                ql_tensor *d = direct ? ql_cross_entropy_back_to(L.ctx, ce, dy, t) : ql_cast(L.ctx, ql_cross_entropy_back(L.ctx, ce, dy), t);
                return ql_cast(L.ctx, d, QL_TYPE_F32);
            };
        };
        check_case(be, "dlogits in 16 bits", build(true), TOL_16, false);
        const bool host = ql_backend_is_host(be);
        const run_result direct = run_case(be, host, build(true), false), cast = run_case(be, host, build(false), false);
        REQUIRE(direct.error.empty());
        REQUIRE(cast.error.empty());
        CHECK(direct.out == cast.out);
    }
}

OP_CASE(dropout) {
    // the masks come from the same hash: the same elements survive on every backend
    check_case(be, "p = 0.3", [](leafs &L) {
        ql_tensor *seed = L.i32({1}, [](int64_t) { return 1234; });
        return ql_dropout(L.ctx, L.param({129, 7}), 0.3f, seed, 5);
    }, TOL_F32);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16})  // the result rounded as it is stored: the same bits
        check_case(be, "p = 0.3, a 16-bit result", [t](leafs &L) {
            ql_tensor *seed = L.i32({1}, [](int64_t) { return 99; });
            return ql_cast(L.ctx, ql_dropout_to(L.ctx, L.param({129, 7}), 0.3f, seed, 5, t), QL_TYPE_F32);
        }, 0.0);
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16})  // a 16-bit a (SwiGLU's result into the down projection's LoRA)
        check_case(be, "p = 0.3, a 16-bit a and result", [t](leafs &L) {
            ql_tensor *seed = L.i32({1}, [](int64_t) { return 98; });
            return ql_cast(L.ctx, ql_dropout_to(L.ctx, ql_cast(L.ctx, L.param({129, 7}), t), 0.3f, seed, 5, t), QL_TYPE_F32);
        }, 0.0);
}

OP_CASE(add_rows_dropout_rows) {
    // a result in pieces of rows (the FFN in token chunks): the chain goes in place on the device
    // too; a piece's dropout draws the whole's mask
    check_case(be, "add_rows chain", [](leafs &L) {
        ql_tensor *r = ql_scale(L.ctx, L.param({37, 300}), 1.0f);
        for (int64_t r0 = 0; r0 < 300; r0 += 100) r = ql_add_rows(L.ctx, r, L.param({37, 100}), r0);
        return r;
    }, TOL_F32);
    check_case(be, "add_rows, a kept a", [](leafs &L) { return ql_add_rows(L.ctx, L.param({37, 10, 3}), L.param({37, 4}), 21); },
               TOL_F32);
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})
        check_case(be, "dropout_rows_to", [t](leafs &L) {
            ql_tensor *seed = L.i32({1}, [](int64_t) { return 77; });
            ql_tensor *x = L.param({129, 30});
            return ql_cast(L.ctx, ql_dropout_rows_to(L.ctx, ql_view_2d(L.ctx, x, 129, 11, x->nb[1], 129 * 4 * 13), 0.3f, seed, 5, t, 13),
                           QL_TYPE_F32);
        }, 0.0);
}

// LoRA's A dropout(x) with the mask applied as x is read (ql_mul_mat_dropout; on a device k_mm_drop
// in forward, the dropped operand made in the workspace for backward's da): x a piece of rows of a
// whole (the mask's row offset), K over several k steps and a partial one, with and without 16-byte
// rows, tokens over several blocks and a partial one, batches; then the workspace's path in forward too
OP_CASE(mul_mat_dropout) {
    struct shape { int64_t K, M, N, B; };
    for (int fused = 1; fused >= 0; fused--) {
        ql_cuda_mm_drop_fused_for_tests(fused != 0);
        for (const shape s : {shape{200, 16, 45, 1}, shape{77, 5, 33, 2}, shape{64, 64, 70, 1}})
            for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16})
                for (ql_type xt : {QL_TYPE_F32, QL_TYPE_BF16}) {
                    INFO("K " << s.K << " M " << s.M << " N " << s.N << " B " << s.B << ", multiply " << std::string(ql_type_name(t)) << ", x "
                              << std::string(ql_type_name(xt)) << (fused ? ", k_mm_drop" : ", the workspace's path"));
                    check_case(be, "mul_mat_dropout", [&](leafs &L) {
                        ql_tensor *seed = L.i32({1}, [](int64_t) { return 4321; });
                        const int64_t r0 = 7, rows = s.N * s.B;  // the whole has r0 + rows + 3 rows
                        ql_tensor *w = L.param({s.K, r0 + rows + 3}, -2.0f, 2.0f);
                        ql_tensor *wx = xt == QL_TYPE_F32 ? w : ql_cast(L.ctx, w, xt);
                        ql_tensor *x = ql_view_3d(L.ctx, wx, s.K, s.N, s.B, wx->nb[1], wx->nb[1] * (size_t)s.N, (size_t)r0 * wx->nb[1]);
                        return ql_mul_mat_dropout(L.ctx, L.param({s.K, s.M}), x, 0.25f, seed, 11, t, r0);
                    }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
                }
    }
    ql_cuda_mm_drop_fused_for_tests(true);
    // x read by two such products: the second dx added onto the first as it is made (k_mm_thin's
    // dropout epilogue with c; k_drop_acc after the product where the fused kernels are off)
    for (int fused = 1; fused >= 0; fused--) {
        ql_cuda_mm_drop_fused_for_tests(fused != 0);
        for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})
            check_case(be, fused ? "mul_mat_dropout, x read twice" : "mul_mat_dropout, x read twice, the product's path", [t](leafs &L) {
                ql_tensor *seed = L.i32({1}, [](int64_t) { return 8; });
                ql_tensor *x = L.param({96, 150}, -2.0f, 2.0f);
                return ql_add(L.ctx, ql_mul_mat_dropout(L.ctx, L.param({96, 8}), x, 0.3f, seed, 1, t, 0),
                              ql_mul_mat_dropout(L.ctx, L.param({96, 8}), x, 0.3f, seed, 2, t, 0));
            }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
    }
    ql_cuda_mm_drop_fused_for_tests(true);
    // y read by two products, whose dx (the second's onto the first's, c) y's own product reads in
    // 16 bits (as attention reads its dO): autodiff writes that sum in 16 bits (c + v in f32, rounded
    // once as stored), the bits of the f32 node and its cast. k_mm_thin's epilogue with an f32 c
    // under a 16-bit result, and the product's path
    for (int fused = 1; fused >= 0; fused--) {
        ql_cuda_mm_drop_fused_for_tests(fused != 0);
        for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
            INFO(std::string(ql_type_name(t)) << (fused ? ", k_mm_thin" : ", the product's path"));
            const builder build = [t](leafs &L) {
                ql_tensor *seed = L.i32({1}, [](int64_t) { return 31; });
                ql_tensor *x = L.param({40, 70}, -2.0f, 2.0f);
                ql_tensor *y = ql_mul_mat_dropout(L.ctx, L.rand(QL_TYPE_F32, {40, 160}, -0.5f, 0.5f), x, 0.2f, seed, 1, t, 0);  // [160, 70]
                return ql_add(L.ctx, ql_mul_mat_dropout(L.ctx, L.rand(QL_TYPE_F32, {160, 12}, -0.5f, 0.5f), y, 0.3f, seed, 2, t, 0),
                              ql_mul_mat_dropout(L.ctx, L.rand(QL_TYPE_F32, {160, 12}, -0.5f, 0.5f), y, 0.3f, seed, 3, t, 0));
            };
            check_case(be, fused ? "mul_mat_dropout, a 16-bit dx" : "mul_mat_dropout, a 16-bit dx, the product's path", build, TOL_16);
            check_fold_bits(be, build, "x's gradient through the 16-bit dx: not the bits of the f32 dx and its cast", true);
        }
    }
    ql_cuda_mm_drop_fused_for_tests(true);
    // enough tokens that a split takes more than one k step (2 splits of 2 steps and 1, 172 token
    // blocks): forward only
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16})
        check_case(be, "mul_mat_dropout, 5500 tokens", [t](leafs &L) {
            ql_tensor *seed = L.i32({1}, [](int64_t) { return 5; });
            return ql_mul_mat_dropout(L.ctx, L.param({136, 4}), L.param({136, 5500}), 0.1f, seed, 2, t, 3);
        }, t == QL_TYPE_F32 ? TOL_MM : TOL_16, false);
}

// ql_mul_mat_scaled_to: the scale in the GEMM's alpha (not the decode gemv's or the thin kernel's:
// those take none), a 16-bit result rounded after it; a few tokens (the gemv's shapes) and many, an
// NF4 a (tiles)
OP_CASE(mul_mat_scaled) {
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16}) {
        check_case(be, "scaled product, many tokens", [t](leafs &L) {
            ql_tensor *b = t == QL_TYPE_F32 ? L.param({96, 150}) : ql_cast(L.ctx, L.param({96, 150}), t);
            ql_tensor *y = ql_mul_mat_scaled_to(L.ctx, L.param({96, 24}), b, 0.375f, t);
            REQUIRE(ql_mul_mat_alpha(y) == 0.375f);
            return t == QL_TYPE_F32 ? y : ql_cast(L.ctx, y, QL_TYPE_F32);
        }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
        check_case(be, "scaled product, 4 tokens (not the gemv)", [t](leafs &L) {
            ql_tensor *b = t == QL_TYPE_F32 ? L.param({64, 4}) : ql_cast(L.ctx, L.param({64, 4}), t);
            ql_tensor *y = ql_mul_mat_scaled_to(L.ctx, L.param({64, 16}), b, -2.5f, t);
            REQUIRE(!ql_cuda_mm_gemv(y));
            return t == QL_TYPE_F32 ? y : ql_cast(L.ctx, y, QL_TYPE_F32);
        }, t == QL_TYPE_F32 ? TOL_MM : TOL_16);
    }
    check_case(be, "scaled product, an NF4 a in tiles, bf16", [](leafs &L) {
        ql_tensor *w = L.rand(QL_TYPE_NF4, {128, 40});
        return ql_cast(L.ctx, ql_mul_mat_scaled_to(L.ctx, w, ql_cast(L.ctx, L.param({128, 70}), QL_TYPE_BF16), 0.5f, QL_TYPE_BF16),
                       QL_TYPE_F32);
    }, TOL_16);
}

// fa_mode_guard: a CUDA attention mode (ql_cuda_fa_set_mode) for one case, the previous one after
struct fa_mode_guard {
    int was = ql_cuda_fa_get_mode();
    explicit fa_mode_guard(int mode) { ql_cuda_fa_set_mode(mode); }
    ~fa_mode_guard() { ql_cuda_fa_set_mode(was); }
};

OP_CASE(flash_attn) {
    fa_mode_guard chunked(QL_CUDA_FA_CHUNKED);  // the products on a device (flash_attn_fused: the fused kernels)
    check_case(be, "causal, GQA", [](leafs &L) {
        return ql_flash_attn(L.ctx, L.param({16, 19, 4, 2}), L.param({16, 19, 2, 2}), L.param({16, 19, 2, 2}), nullptr, 0.25f);
    }, TOL_F32);
    check_case(be, "Tq < Tk, dv != d", [](leafs &L) {
        return ql_flash_attn(L.ctx, L.param({8, 5, 2, 1}), L.param({8, 23, 1, 1}), L.param({12, 23, 1, 1}), nullptr, 0.35f);
    }, TOL_F32);
    check_case(be, "document segments", [](leafs &L) {
        ql_tensor *seg = L.i32({70, 1}, [](int64_t i) { return (int32_t)(i < 20 ? 0 : i < 53 ? 1 : 2); });
        return ql_flash_attn(L.ctx, L.param({24, 70, 2, 1}), L.param({24, 70, 2, 1}), L.param({24, 70, 2, 1}), seg, 0.2f);
    }, TOL_F32);
    check_case(be, "several query chunks (300 > 256), GQA 4:1, head dim 128, batch 2", [](leafs &L) {
        return ql_flash_attn(L.ctx, L.param({128, 300, 4, 2}), L.param({128, 300, 1, 2}), L.param({128, 300, 1, 2}), nullptr, 0.09f);
    }, TOL_F32);
    check_case(be, "several query chunks, Tq < Tk, dv != d", [](leafs &L) {
        return ql_flash_attn(L.ctx, L.param({16, 270, 2, 1}), L.param({16, 290, 2, 1}), L.param({8, 290, 2, 1}), nullptr, 0.25f);
    }, TOL_F32);
    // a score budget (ql_flash_attn_set_score_bytes): chunks of 64 queries, ten of them, the last of 24
    check_case(be, "a score budget of 1 MiB: ten query chunks, the last partial, GQA", [](leafs &L) {
        ql_tensor *a = ql_flash_attn(L.ctx, L.param({16, 600, 4, 1}), L.param({16, 600, 2, 1}), L.param({16, 600, 2, 1}), nullptr, 0.25f);
        REQUIRE(ql_flash_attn_set_score_bytes(a, (size_t)1 << 20) == QL_OK);
        int64_t c = 0;
        ql_cuda_fa_layout(a, 90, nullptr, &c, nullptr);
        REQUIRE(c == 64);
        return a;
    }, TOL_F32);
    check_case(be, "documents across chunks", [](leafs &L) {
        ql_tensor *seg = L.i32({280, 2}, [](int64_t i) { return (int32_t)((i % 280) < 100 ? 0 : (i % 280) < 261 ? 1 : 2); });
        return ql_flash_attn(L.ctx, L.param({32, 280, 2, 2}), L.param({32, 280, 2, 2}), L.param({32, 280, 2, 2}), seg, 0.2f);
    }, TOL_F32);
    // products in bf16 where asked (the CPU rounds the same operands where it has AVX512-BF16,
    // else computes in f32: either way within bf16's error)
    check_case(be, "bf16 products (set_prec), GQA, two chunks", [](leafs &L) {
        ql_tensor *a = ql_flash_attn(L.ctx, L.param({64, 260, 4, 1}), L.param({64, 260, 2, 1}), L.param({64, 260, 2, 1}), nullptr, 0.125f);
        REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
        return a;
    }, TOL_16);
    // a head dim the fused kernels do not take (48): bf16 products over query chunks (cuBLAS)
    check_case(be, "bf16 products (set_prec), head dim 48, two chunks", [](leafs &L) {
        ql_tensor *a = ql_flash_attn(L.ctx, L.param({48, 260, 4, 1}), L.param({48, 260, 2, 1}), L.param({48, 260, 2, 1}), nullptr, 0.14f);
        REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
        REQUIRE(ql_cuda_fa_gemm(a));
        return a;
    }, TOL_16);
    // bf16 k and v as the llama block makes them - permuted views of [D, Hkv, T], one sequence: the
    // products read them in place (a kv head's rows Hkv D apart, the heads D apart), no packed
    // copies; two chunks, GQA 2:1 and 1:1, Tq < Tk
    for (int64_t hkv : {1, 2})
        check_case(be, "bf16 k, v read in place by the products (permuted views, one sequence)", [hkv](leafs &L) {
            auto heads = [&](int64_t d, int64_t h, int64_t t) {  // [d, t, h, 1] over a bf16 [d, h, t, 1]
                return ql_permute(L.ctx, ql_cast(L.ctx, L.param({d, h, t, 1}), QL_TYPE_BF16), 0, 2, 1, 3);
            };
            ql_tensor *a = ql_flash_attn(L.ctx, heads(64, 2, 300), heads(64, hkv, 320), heads(64, hkv, 320), nullptr, 0.125f);
            REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
            REQUIRE(ql_cuda_fa_gemm(a));
            REQUIRE(ql_cuda_fa_kv_direct(a, QL_TYPE_BF16));
            size_t off[QL_CUDA_FA_NBUF];
            int64_t c = 0;
            ql_cuda_fa_layout(a, 90, off, &c, nullptr);
            CHECK(off[QL_CUDA_FA_V] == off[QL_CUDA_FA_K]);  // no K buffer
            CHECK(off[QL_CUDA_FA_Q] == off[QL_CUDA_FA_K]);  // nor V
            CHECK(c < 300);
            return ql_cast(L.ctx, a, QL_TYPE_F32);
        }, TOL_16);
    // 16-bit q, k, v (a 16-bit compute type's): read widened, the output in their type, rounded
    // once; f32 gradients. f32 products (fp16 and bf16), bf16 products (set_prec) over two chunks
    // with GQA, documents across chunks
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        INFO("type: " << std::string(ql_type_name(t)));
        auto c16 = [t](leafs &L, std::vector<int64_t> ne) { return ql_cast(L.ctx, L.param(ne), t); };
        check_case(be, "16-bit q, k, v and output: causal, GQA, Tq < Tk, dv != d", [t, c16](leafs &L) {
            ql_tensor *a = ql_flash_attn(L.ctx, c16(L, {16, 19, 4, 2}), c16(L, {16, 23, 2, 2}), c16(L, {24, 23, 2, 2}), nullptr, 0.25f);
            REQUIRE(a->type == t);
            return ql_cast(L.ctx, a, QL_TYPE_F32);
        }, TOL_16);
        check_case(be, "16-bit q, k, v and output: documents across chunks", [c16](leafs &L) {
            ql_tensor *seg = L.i32({280, 2}, [](int64_t i) { return (int32_t)((i % 280) < 100 ? 0 : (i % 280) < 261 ? 1 : 2); });
            return ql_cast(L.ctx, ql_flash_attn(L.ctx, c16(L, {32, 280, 2, 2}), c16(L, {32, 280, 2, 2}), c16(L, {32, 280, 2, 2}), seg, 0.2f),
                           QL_TYPE_F32);
        }, TOL_16);
        if (t == QL_TYPE_BF16)
            check_case(be, "bf16 q, k, v and output, bf16 products (set_prec), GQA, two chunks", [c16](leafs &L) {
                ql_tensor *a = ql_flash_attn(L.ctx, c16(L, {64, 260, 4, 1}), c16(L, {64, 260, 2, 1}), c16(L, {64, 260, 2, 1}), nullptr, 0.125f);
                REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
                REQUIRE(ql_cuda_fa_gemm(a));
                return ql_cast(L.ctx, a, QL_TYPE_F32);
            }, TOL_16);
    }
    // the CPU (the oracle): 16-bit inputs read exactly - the output is the f32 kernel's on the
    // widened inputs, rounded once, bit for bit; the gradients differ by backward reading the
    // rounded output (rowsum(dO o O)) - within 16-bit's error. Both backward paths: one kv head
    // takes the two passes with 2 threads, two the fused pass.
    if (ql_backend_is_host(be))
        for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
            for (int64_t hkv : {1, 2}) {
                auto build = [t, hkv](bool widen) {
                    return [t, hkv, widen](leafs &L) {
                        ql_tensor *seg = L.i32({90, 1}, [](int64_t i) { return (int32_t)(i < 40 ? 0 : 1); });
                        ql_tensor *q = ql_cast(L.ctx, L.param({16, 90, 4, 1}), t), *k = ql_cast(L.ctx, L.param({16, 90, hkv, 1}), t);
                        ql_tensor *v = ql_cast(L.ctx, L.param({24, 90, hkv, 1}), t);
                        auto w = [&](ql_tensor *x) { return ql_cast(L.ctx, x, QL_TYPE_F32); };
                        return w(widen ? ql_cast(L.ctx, ql_flash_attn(L.ctx, w(q), w(k), w(v), seg, 0.3f), t)
                                       : ql_flash_attn(L.ctx, q, k, v, seg, 0.3f));
                    };
                };
                const run_result x = run_case(be, true, build(false), true), y = run_case(be, true, build(true), true);
                REQUIRE(x.error.empty());
                REQUIRE(y.error.empty());
                CHECK(x.out == y.out);
                REQUIRE(x.grads.size() == 3);
                for (size_t i = 0; i < 3; i++) CHECK(norm_err(x.grads[i], y.grads[i]) <= TOL_16);
            }
    check_case(be, "over a KV cache, n_kv at run time", [](leafs &L) {
        ql_tensor *nkv = L.i32({1}, [](int64_t) { return 13; });
        return ql_flash_attn_kv(L.ctx, L.rand(QL_TYPE_F32, {16, 3, 4, 1}), L.rand(QL_TYPE_F32, {16, 32, 2, 1}),
                                L.rand(QL_TYPE_F32, {16, 32, 2, 1}), nkv, 0.25f);
    }, TOL_F32, false);
    // decode (k_fa_decode on a device): 1 and 3 queries, head dims 128 and 80 (lanes past the row's
    // end), 77 keys in use of 96 (several key groups a warp, the last partial), GQA 4:1, batch 2;
    // and 9 queries (the tile kernel)
    struct kv_shape {
        int64_t d, tq, nkv, h, hkv, b;
    };
    for (const kv_shape &k : {kv_shape{128, 1, 77, 8, 2, 1}, kv_shape{80, 3, 77, 4, 1, 2}, kv_shape{64, 9, 40, 2, 2, 1}}) {
        INFO("d " << k.d << ", " << k.tq << " queries, " << k.nkv << " keys, heads " << k.h << "/" << k.hkv << ", batch " << k.b);
        check_case(be, "over a KV cache, decode", [k](leafs &L) {
            ql_tensor *nkv = L.i32({1}, [k](int64_t) { return (int32_t)k.nkv; });
            return ql_flash_attn_kv(L.ctx, L.rand(QL_TYPE_F32, {k.d, k.tq, k.h, k.b}), L.rand(QL_TYPE_F32, {k.d, 96, k.hkv, k.b}),
                                    L.rand(QL_TYPE_F32, {k.d, 96, k.hkv, k.b}), nkv, 1.0f / std::sqrt((float)k.d));
        }, TOL_F32, false);
    }
}

// Training attention in bf16 (set_prec), switched to the fused FlashAttention-2 kernels on tensor
// cores (qlora-cuda.cu, k_fa2_*) at head dims 64, 80, 96, 128: forward and backward against the
// CPU, causal with Tq < Tk and partial tiles, GQA 1:1 .. 4:1, documents (with tiles skipped),
// batch 2; bf16 (cc >= 8.0) and fp16 (the cc 7.5 path, through the shim's device setting); the
// backward bit for bit the same in two runs (no atomics).
extern "C" __attribute__((weak)) void qlshim_set_cc(int major, int minor);  // tests/cuda_shim.h; absent on a real GPU
extern "C" __attribute__((weak)) int qlshim_set_wmma_sm80(int on);         // the same

struct fa_shape {
    const char *what;
    int64_t d, tq, tk, h, hkv, b;
    int docs;  // 0: causal only; else document boundaries
};
static const fa_shape fa_shapes[] = {
    {"d 64, GQA 4:1, batch 2, Tq 70 (partial tiles)", 64, 70, 70, 4, 1, 2, 0},
    {"d 80, Tq 37 < Tk 100", 80, 37, 100, 2, 2, 1, 0},
    {"d 96, documents, GQA 2:1, batch 2", 96, 90, 90, 4, 2, 2, 1},
    {"d 128, GQA 2:1, three query tiles (whole tiles unmasked)", 128, 150, 150, 2, 1, 1, 0},
    {"d 64, long documents: key tiles skipped", 64, 200, 200, 2, 2, 1, 2},
    // tile edges: the last query of a warp sees just the first key of a tile (offset 33), the
    // last query of a tile just one key of a warp (Tq 49), a tile one key short of whole (offset 14)
    {"d 64, Tq 37 < Tk 70", 64, 37, 70, 1, 1, 1, 0},
    {"d 64, Tq 49", 64, 49, 49, 1, 1, 1, 0},
    {"d 64, Tq 50 < Tk 64", 64, 50, 64, 1, 1, 1, 0},
};
static const int fa_n_shapes = (int)(sizeof(fa_shapes) / sizeof(fa_shapes[0]));
// bf16 q, k, v and output (a bf16 compute type's attention, as the trainer's): read and written in
// 16 bits - on a device, the register path's backward streams them by asynchronous copies
static const int fa_shapes16[] = {0, 2, 3, 4};
static builder fused_attn_builder(const fa_shape sh, bool in16) {
    return [sh, in16](leafs &L) {
        ql_tensor *seg = nullptr;
        if (sh.docs == 1)  // batch 0: three documents, batch 1: two
            seg = L.i32({sh.tk, sh.b}, [&](int64_t i) {
                const int64_t j = i % sh.tk;
                return (int32_t)(i < sh.tk ? (j < 20 ? 0 : j < 61 ? 1 : 2) : (j < 45 ? 5 : 6));
            });
        if (sh.docs == 2) seg = L.i32({sh.tk, sh.b}, [&](int64_t i) { return (int32_t)(i % sh.tk < 70 ? 0 : 1); });
        auto in = [&](std::vector<int64_t> ne) { return in16 ? ql_cast(L.ctx, L.param(ne), QL_TYPE_BF16) : L.param(ne); };
        ql_tensor *a = ql_flash_attn(L.ctx, in({sh.d, sh.tq, sh.h, sh.b}), in({sh.d, sh.tk, sh.hkv, sh.b}),
                                     in({sh.d, sh.tk, sh.hkv, sh.b}), seg, 1.0f / std::sqrt((float)sh.d));
        REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
        CHECK(ql_cuda_fa_fused(a));  // the fused kernels, not the chunked products
        CHECK(!ql_cuda_fa_gemm(a));
        return in16 ? ql_cast(L.ctx, a, QL_TYPE_F32) : a;
    };
}

// few: the first shape, the documents and one bf16-input case only (a second mode over the same kernels)
static void fused_attn_cases(ql_backend *be, bool few = false) {
    const int n16 = (int)(sizeof(fa_shapes16) / sizeof(fa_shapes16[0]));
    for (int si = 0; si < fa_n_shapes + n16; si++) {
        const bool in16 = si >= fa_n_shapes;
        if (few && si != 0 && si != 2 && si != fa_n_shapes) continue;
        const fa_shape sh = fa_shapes[in16 ? fa_shapes16[si - fa_n_shapes] : si];
        INFO("q, k, v " << std::string(in16 ? "bf16" : "f32"));
        const builder build = fused_attn_builder(sh, in16);
        check_case(be, sh.what, build, TOL_16);
        if (ql_backend_is_host(be)) continue;
        // the backward is deterministic: dK, dV by key tiles, dQ by query tiles, no atomics
        const run_result r1 = run_case(be, false, build, true), r2 = run_case(be, false, build, true);
        REQUIRE(r1.error.empty());
        REQUIRE(r2.error.empty());
        CHECK(r1.out == r2.out);
        REQUIRE(r1.grads.size() == 3);
        for (size_t i = 0; i < r1.grads.size(); i++) CHECK_MESSAGE(r1.grads[i] == r2.grads[i], sh.what, ": gradient ", i, " differs between runs");
    }
}

extern "C" __attribute__((weak)) int qlshim_set_async_early(int on);  // tests/cuda_shim.h; absent on a real GPU
extern "C" __attribute__((weak)) long long qlshim_async_copies(void);  // the same
// The register path's streamed tiles by asynchronous copies in two buffers, against one buffer
// loaded between barriers: the same products in the same order, so the same bits. Through the shim
// the copies land at the wait (a read before it sees the buffer's old rows) and, again, as they are
// issued (a copy into a buffer still being read changes what is read).
static void fa2_pipe_cases(ql_backend *be) {
    for (int si : fa_shapes16) {
        const fa_shape sh = fa_shapes[si];
        INFO(sh.what << ", bf16 q, k, v");
        const builder build = fused_attn_builder(sh, true);
        const int was = ql_cuda_fa2_set_pipe(0);
        const long long c0 = qlshim_async_copies ? qlshim_async_copies() : 0;
        const run_result one = run_case(be, false, build, true);
        const long long c1 = qlshim_async_copies ? qlshim_async_copies() : 0;
        ql_cuda_fa2_set_pipe(1);
        const run_result two = run_case(be, false, build, true);
        if (qlshim_async_copies) {  // the two runs took the two paths (else the comparison below proves nothing)
            CHECK(c1 == c0);
            CHECK(qlshim_async_copies() > c1);
        }
        run_result early;
        if (qlshim_set_async_early) {
            const int e = qlshim_set_async_early(1);
            early = run_case(be, false, build, true);
            qlshim_set_async_early(e);
        }
        ql_cuda_fa2_set_pipe(was);
        REQUIRE(one.error.empty());
        REQUIRE(two.error.empty());
        REQUIRE(one.grads.size() == 3);
        REQUIRE(two.grads.size() == 3);
        CHECK(one.out == two.out);
        for (size_t i = 0; i < 3; i++) CHECK_MESSAGE(one.grads[i] == two.grads[i], "gradient ", i, ": two buffers differ from one");
        if (!qlshim_set_async_early) continue;
        REQUIRE(early.error.empty());
        REQUIRE(early.grads.size() == 3);
        CHECK(early.out == one.out);
        for (size_t i = 0; i < 3; i++) CHECK_MESSAGE(early.grads[i] == one.grads[i], "gradient ", i, ": copies landing at issue differ");
    }
}

OP_CASE(flash_attn_fused) {
    fa_mode_guard on(QL_CUDA_FA_FUSED);  // the default fuses the forward only: both for this case
    if (!ql_backend_is_host(be)) MESSAGE("fused attention: the " << std::string(ql_cuda_fa2_register_path(be) ? "register" : "shared-memory") << " path");
    fused_attn_cases(be);
    if (ql_backend_is_host(be)) return;
    {  // dK, dV by blocks over all the group's query heads (above: a block per head, the slices summed by
       // the dQ kernel, as these short sequences always get - ql_cuda_fa2_kv_split)
        const int was = ql_cuda_fa2_set_split(0);
        INFO("dK/dV blocks over every head of the group (no slices)");
        fused_attn_cases(be, true);
        ql_cuda_fa2_set_split(was);
    }
    if (!qlshim_set_wmma_sm80 && ql_cuda_fa2_register_path(be)) fa2_pipe_cases(be);  // a real GPU's (the shim's: below)
    {  // the default: the fused forward's lse read by the chunked backward
        ql_cuda_fa_set_mode(QL_CUDA_FA_FORWARD);
        INFO("the fused forward, the chunked backward");
        fused_attn_cases(be, true);
        ql_cuda_fa_set_mode(QL_CUDA_FA_FUSED);
    }
    if (qlshim_set_wmma_sm80) {
        // the other layout: sm_80's fragments (the register path, k_fa2_*_reg, where the backend's
        // probe finds them) if the shim scrambled them above, else the scramble (the shared-memory path)
        const int was = qlshim_set_wmma_sm80(1);
        qlshim_set_wmma_sm80(!was);
        INFO("WMMA fragments " << std::string(was ? "scrambled: the shared-memory path" : "in sm_80's layout: the register path"));
        ql_backend *other = make_backend("cuda");
        CHECK(ql_cuda_fa2_register_path(other) == !was);  // the probe found what the shim does
        fused_attn_cases(other);
        if (ql_cuda_fa2_register_path(other)) fa2_pipe_cases(other);
        ql_backend_free(other);
        qlshim_set_wmma_sm80(was);
    }
    if (!qlshim_set_cc) {
        MESSAGE("the fp16 (cc 7.5) kernels: not tested on this device (the shim's device setting is absent)");
        return;
    }
    qlshim_set_cc(7, 5);  // a T4: fp16 tensor cores, 64 KiB of shared memory per block
    ql_backend *t4 = make_backend("cuda");
    fused_attn_cases(t4);
    ql_backend_free(t4);
    qlshim_set_cc(9, 0);
}

OP_CASE(cache_store) {
    check_case(be, "rows at a run-time position", [](leafs &L) {
        ql_tensor *cache = L.rand(QL_TYPE_F32, {8, 10, 2, 1});
        ql_tensor *pos = L.i32({1}, [](int64_t) { return 6; });
        return ql_cont(L.ctx, ql_cache_store(L.ctx, cache, L.rand(QL_TYPE_F32, {8, 3, 2, 1}), pos));
    }, 0.0, false);
}

// An f16 KV cache (generate --cache-type f16; issue 32 item 3): keys and values rounded to f16 as
// stored (the same bits as the CPU's), read widened by the attention over the cache - the decode
// kernel for 1..8 queries (key groups of 16, the last partial: n_kv 1, 15, 17, 21, 33, 40, 77; a lane's
// element pairs, one 4-byte load each), the tiled kernel for a prompt's (tiles of 32 keys and 8
// queries: n_kv 9, 33, 70, 96 - the last tile partial or whole), head dims 64, 80 (lanes past the
// row's end), 128 and 33 (odd: pairs unaligned), GQA 4:1 and 2:1, batch 2. The new
// rows are stored at n_kv - Tq, as generate does, over a cache of random f16 rows.
extern "C" long long qlshim_launches(const char *kernel) __attribute__((weak));  // the shim's count per kernel (absent elsewhere)
OP_CASE(flash_attn_kv16) {
    check_case(be, "f16 cache: rows stored at a run-time position", [](leafs &L) {
        ql_tensor *cache = L.rand(QL_TYPE_F16, {8, 10, 2, 2});
        ql_tensor *pos = L.i32({1}, [](int64_t) { return 6; });
        ql_tensor *c = ql_cache_store(L.ctx, cache, L.rand(QL_TYPE_F32, {8, 3, 2, 2}, -60000.0f, 60000.0f), pos);
        REQUIRE(c->type == QL_TYPE_F16);
        return ql_cont(L.ctx, c);
    }, 0.0, false);  // one rounding each: the same bits
    struct kv_shape {
        int64_t d, tq, nkv, h, hkv, b;
    };
    const kv_shape shapes[] = {
        {128, 1, 1, 8, 2, 1}, {128, 1, 77, 8, 2, 1}, {64, 1, 17, 4, 2, 2}, {80, 3, 15, 4, 1, 2}, {64, 4, 33, 4, 2, 1},
        {80, 8, 40, 2, 2, 1},  // the most queries the decode kernel takes
        {33, 2, 21, 2, 1, 1},  // rows of an odd length: the decode kernel's pairs not 4-byte aligned
        {64, 9, 9, 4, 2, 1}, {64, 20, 33, 4, 1, 2}, {128, 40, 70, 4, 2, 1}, {80, 17, 96, 2, 1, 1},
    };
    for (const kv_shape &k : shapes) {
        INFO("d " << k.d << ", " << k.tq << " queries, " << k.nkv << " keys of 96, heads " << k.h << "/" << k.hkv << ", batch " << k.b);
        const bool decode = k.tq <= 8;
        const char *kern = decode ? "k_fa_decode<uint16_t>" : "k_fa_fwd<uint16_t>";
        const long long before = qlshim_launches ? qlshim_launches(kern) : 0;
        check_case(be, "f16 cache: store, then attention over it", [k](leafs &L) {
            ql_tensor *nkv = L.i32({1}, [k](int64_t) { return (int32_t)k.nkv; });
            ql_tensor *pos = L.i32({1}, [k](int64_t) { return (int32_t)(k.nkv - k.tq); });
            ql_tensor *ck = L.rand(QL_TYPE_F16, {k.d, 96, k.hkv, k.b}), *cv = L.rand(QL_TYPE_F16, {k.d, 96, k.hkv, k.b});
            ql_tensor *kk = ql_cache_store(L.ctx, ck, L.rand(QL_TYPE_F32, {k.d, k.tq, k.hkv, k.b}), pos);
            ql_tensor *vv = ql_cache_store(L.ctx, cv, L.rand(QL_TYPE_F32, {k.d, k.tq, k.hkv, k.b}), pos);
            return ql_flash_attn_kv(L.ctx, L.rand(QL_TYPE_F32, {k.d, k.tq, k.h, k.b}), kk, vv, nkv, 1.0f / std::sqrt((float)k.d));
        }, TOL_F32, false);
        if (!ql_backend_is_host(be) && qlshim_launches) CHECK_MESSAGE(qlshim_launches(kern) == before + 1, kern, " ran");
    }
}

OP_CASE(views_backward) {
    check_case(be, "view gradients into the source", [](leafs &L) {
        ql_tensor *a = L.param({12, 10});
        ql_tensor *v = ql_view_2d(L.ctx, a, 5, 4, a->nb[1], 3 * sizeof(float) + a->nb[1]);
        return ql_mul(L.ctx, ql_cont(L.ctx, v), ql_reshape_2d(L.ctx, ql_cont(L.ctx, ql_view_1d(L.ctx, a, 20, 0)), 5, 4));
    }, TOL_F32);
}

// ---- the optimizer where the tensors live -----------------------------------------------------

static void adamw_case(ql_backend *be, bool eight_bit) {
    const int64_t n = 5000;  // over QL_OPT8_MIN_SIZE, a partial last block
    std::vector<float> p0 = leafs::randn(n, 1, -1, 1), g0 = leafs::randn(n, 2, -0.01f, 0.01f);
    g0[17] = NAN;  // 8-bit: a non-finite element resets its state and leaves the weight
    std::vector<std::vector<float>> out;
    for (int side = 0; side < 2; side++) {
        ql_backend *b = side == 0 ? ql_backend_cpu_init(1) : be;
        ql_init_params ip = {1u << 20, nullptr, side == 1, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *p = ql_set_param(ql_new_tensor_1d(ctx, QL_TYPE_F32, n));
        p->grad = ql_new_tensor_1d(ctx, QL_TYPE_F32, n);
        const int64_t nb = (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
        ql_tensor *m = ql_new_tensor_1d(ctx, eight_bit ? QL_TYPE_I8 : QL_TYPE_F32, n);
        ql_tensor *v = ql_new_tensor_1d(ctx, eight_bit ? QL_TYPE_I8 : QL_TYPE_F32, n);
        ql_tensor *ma = eight_bit ? ql_new_tensor_1d(ctx, QL_TYPE_F32, nb) : nullptr;
        ql_tensor *va = eight_bit ? ql_new_tensor_1d(ctx, QL_TYPE_F32, nb) : nullptr;
        ql_backend_buffer *buf = side == 1 ? ql_backend_alloc_ctx_tensors(b, ctx, QL_BUFFER_DEVICE) : nullptr;
        REQUIRE((side == 0 || buf));
        REQUIRE(ql_backend_tensor_set(b, p, p0.data(), 0, n * 4) == QL_OK);
        for (ql_tensor *t : {m, v, ma, va})
            if (t) REQUIRE(ql_backend_tensor_memset(b, t, 0, 0, ql_nbytes(t)) == QL_OK);
        const ql_adamw_params ap = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
        for (int step = 1; step <= 3; step++) {
            std::vector<float> g = g0;
            for (auto &x : g) x *= (float)step;
            if (!eight_bit) g[17] = 0.5f;
            REQUIRE(ql_backend_tensor_set(b, p->grad, g.data(), 0, n * 4) == QL_OK);
            REQUIRE(ql_backend_adamw_update(b, p, m, v, ma, va, step, &ap, 0.5f) == QL_OK);
        }
        double ss = 0;
        bool fin = true;
        REQUIRE(ql_backend_grad_stats(b, p->grad, &ss, &fin) == QL_OK);
        CHECK(fin == !eight_bit);
        std::vector<float> r(n);
        REQUIRE(ql_backend_synchronize(b) == QL_OK);
        REQUIRE(ql_backend_tensor_get(b, p, r.data(), 0, n * 4) == QL_OK);
        r.push_back((float)ss);
        out.push_back(r);
        ql_backend_buffer_free(buf);
        ql_free(ctx);
        if (side == 0) ql_backend_free(b);
    }
    CHECK(out[1][17] == doctest::Approx(out[0][17]).epsilon(1e-6));
    CHECK(norm_err(out[1], out[0]) <= 1e-5);
}

OP_CASE(adamw) { adamw_case(be, false); }
OP_CASE(adamw8bit) { adamw_case(be, true); }

// ---- the interface itself ---------------------------------------------------------------------

OP_CASE(buffers_set_get) {
    ql_init_params ip = {1u << 20, nullptr, true, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, 10, 3);
    ql_tensor *q = ql_new_tensor_2d(ctx, QL_TYPE_NF4, 128, 2);  // side data travels with the rows
    ql_backend_buffer *buf = ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE);
    REQUIRE(buf);
    CHECK(ql_backend_buffer_size(buf) >= ql_nbytes(a) + ql_nbytes(q) + q->aux_size);
    std::vector<float> x(30);
    for (int i = 0; i < 30; i++) x[(size_t)i] = (float)i;
    REQUIRE(ql_backend_tensor_set(be, a, x.data(), 0, 120) == QL_OK);
    float y[4] = {0};
    REQUIRE(ql_backend_tensor_get(be, a, y, 40, 16) == QL_OK);
    CHECK(y[0] == 10.0f);
    CHECK(y[3] == 13.0f);
    REQUIRE(ql_backend_tensor_set_async(be, a, x.data() + 20, 0, 8) == QL_OK);
    REQUIRE(ql_backend_synchronize(be) == QL_OK);
    REQUIRE(ql_backend_tensor_get_async(be, a, y, 0, 8) == QL_OK);
    REQUIRE(ql_backend_synchronize(be) == QL_OK);
    CHECK(y[0] == 20.0f);
    CHECK(y[1] == 21.0f);
    std::vector<uint8_t> qb(ql_nbytes(q) + q->aux_size, 7), back(qb.size());
    REQUIRE(ql_backend_tensor_set(be, q, qb.data(), 0, qb.size()) == QL_OK);
    REQUIRE(ql_backend_tensor_get(be, q, back.data(), 0, back.size()) == QL_OK);
    CHECK(back == qb);
    // outside the tensor: refused, nothing copied
    CHECK(ql_backend_tensor_set(be, a, x.data(), 100, 24) == QL_ERR_INVALID);
    CHECK(ql_backend_tensor_get(be, a, y, 0, 121) == QL_ERR_INVALID);
    ql_backend_buffer_free(buf);
    ql_free(ctx);
}

OP_CASE(place_ctx_tensors) {
    // weights made on the host (an arena, as a GGUF mapping) are placed once; a graph reads them
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_F32, 4, 2), *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 4, 1);
    for (int i = 0; i < 8; i++) ql_set_f32_1d(w, i, (float)i);
    for (int i = 0; i < 4; i++) ql_set_f32_1d(x, i, 1.0f);
    ql_tensor *y = ql_mul_mat(ctx, w, ql_view_2d(ctx, x, 4, 1, x->nb[1], 0));
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, y) == QL_OK);
    ql_backend_buffer *buf = ql_backend_place_ctx_tensors(be, ctx);
    REQUIRE(buf);
    CHECK(ql_backend_buffer_size(buf) == (ql_backend_is_host(be) ? 0u : 2u * QL_ALIGN));
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    float r[2];
    REQUIRE(ql_backend_tensor_get(be, y, r, 0, 8) == QL_OK);
    CHECK(r[0] == 6.0f);   // 0+1+2+3
    CHECK(r[1] == 22.0f);  // 4+5+6+7
    ql_graph_free(g);
    ql_backend_buffer_free(buf);
    ql_free(ctx);
}

// ---- a whole training step: a tiny GQA llama, NF4 base, LoRA on every linear -------------------
// The flow a trainer follows on any backend: the base placed once from its GGUF mapping, the
// adapter and the graph's leafs (inputs, gradient accumulators) placed, inputs in through set,
// loss and gradients out through get, AdamW where the tensors live.

struct step_run {
    std::vector<float> losses;
    std::vector<std::vector<float>> grads;  // after step 1
};

static step_run llama_steps(ql_backend *be, const std::string &gguf, ql_type compute, int n_steps) {
    step_run res;
    char err[256];
    ql_llama_file *f = ql_llama_load(gguf.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    f->model.compute = compute;
    ql_backend_buffer *wbuf = ql_backend_place_ctx_tensors(be, f->ctx);
    REQUIRE_MESSAGE(wbuf, ql_ctx_error(f->ctx));

    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    const int T = 12, B = 2, V = f->model.hp.n_vocab;
    ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
    ql_lora_config spec;
    spec.r = 4;
    spec.dropout = 0.1f;
    spec.targets = {"q", "k", "v", "o", "gate", "up", "down"};
    REQUIRE(ql_llama_add_lora(ctx, &f->model, spec, seed) == QL_OK);
    const std::vector<ql_tensor *> params = ql_llama_lora_params(f->model);
    // B starts at 0 (the base model): give it values so every gradient is non-trivial at step 1
    for (size_t i = 1; i < params.size(); i += 2)
        for (int64_t j = 0; j < ql_nelements(params[i]); j++) ql_set_f32_1d(params[i], j, 0.01f * (float)((j * 7 + (int64_t)i) % 11 - 5));
    ql_tensor *tokens  = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    ql_tensor *pos     = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    ql_tensor *targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
    ql_tensor *count   = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
    ql_tensor *logits  = ql_llama_forward(ctx, &f->model, tokens, pos, nullptr);
    ql_tensor *loss    = ql_set_output(ql_cross_entropy(ctx, ql_reshape_2d(ctx, logits, V, T * B), targets, count));
    REQUIRE_MESSAGE(loss, ql_ctx_error(ctx));
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
    // rope and attention read and write the compute type, and attention's backward reads q, k, v
    // and the output as forward kept them, 16-bit (issue 30 item 2): the step below runs that path
    int n16 = 0;
    for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
        const ql_tensor *n = ql_graph_node(gb, i);
        n16 += (n->op == QL_OP_ROPE || n->op == QL_OP_FLASH_ATTN) && n->type == compute;
        n16 += n->op == QL_OP_FLASH_ATTN_BACK && n->src[0]->type == compute && n->src[4]->type == compute;
    }
    CHECK(n16 == 4 * f->model.hp.n_layer);  // per layer: rope of q and of k, attention, its backward
    std::vector<ql_tensor *> mom;  // AdamW's m and v, zero
    for (ql_tensor *p : params)
        for (int k = 0; k < 2; k++) {
            mom.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
            ql_tensor_fill_f32(mom.back(), 0.0f);
        }
    // inputs: next token = (5 t + 3) % V, one ignored target
    std::vector<int32_t> tk(T * B), ps(T * B), tg(T * B);
    for (int b = 0; b < B; b++)
        for (int t = 0, x = 3 + 11 * b; t < T; t++) {
            tk[b * T + t] = x;
            ps[b * T + t] = t;
            x = (5 * x + 3) % V;
            tg[b * T + t] = x;
        }
    tg[0] = -1;
    const float cnt = (float)(T * B - 1);
    ql_backend_buffer *abuf = ql_backend_place_ctx_tensors(be, ctx);  // adapter, inputs, grads, moments
    REQUIRE_MESSAGE(abuf, ql_ctx_error(ctx));
    REQUIRE(ql_backend_tensor_set(be, tokens, tk.data(), 0, tk.size() * 4) == QL_OK);
    REQUIRE(ql_backend_tensor_set(be, pos, ps.data(), 0, ps.size() * 4) == QL_OK);
    REQUIRE(ql_backend_tensor_set(be, targets, tg.data(), 0, tg.size() * 4) == QL_OK);
    REQUIRE(ql_backend_tensor_set(be, count, &cnt, 0, 4) == QL_OK);
    REQUIRE_MESSAGE(ql_graph_alloc(gb, be) == QL_OK, ql_ctx_error(ctx));
    const ql_adamw_params opt = {2e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    for (int step = 1; step <= n_steps; step++) {
        const int32_t sd = 1000 + step;
        REQUIRE(ql_backend_tensor_set(be, seed, &sd, 0, 4) == QL_OK);
        REQUIRE(ql_backend_graph_zero_grads(be, gb) == QL_OK);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        float l = 0;
        REQUIRE(ql_backend_tensor_get(be, loss, &l, 0, 4) == QL_OK);
        res.losses.push_back(l);
        if (step == 1)
            for (ql_tensor *p : params) res.grads.push_back(fetch(be, p->grad));
        for (size_t i = 0; i < params.size(); i++)
            REQUIRE(ql_backend_adamw_update(be, params[i], mom[2 * i], mom[2 * i + 1], nullptr, nullptr, step, &opt, 1.0f) == QL_OK);
    }
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_buffer_free(abuf);
    ql_free(ctx);
    ql_backend_buffer_free(wbuf);
    ql_llama_file_free(f);
    return res;
}

OP_CASE(llama_qlora_step) {
    tmpdir d;
    const std::string path = d.file("tiny-nf4.gguf");
    {
        tiny_llama t(tiny_hparams(64, 64, 128), 3, 0.1f);  // GQA: 4 query heads over 2 kv heads
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_NF4;
        write_llama_gguf(t.m, path, o);
    }
    for (ql_type compute : {QL_TYPE_BF16, QL_TYPE_F16}) {
        INFO("compute: " << std::string(ql_type_name(compute)));
        ql_backend *cpu = ql_backend_cpu_init(1);
        const step_run ref = llama_steps(cpu, path, compute, 20);
        ql_backend_free(cpu);
        const step_run got = llama_steps(be, path, compute, 20);
        // step 1: the loss and every adapter gradient
        CHECK(got.losses[0] == doctest::Approx(ref.losses[0]).epsilon(1e-3));
        REQUIRE(got.grads.size() == ref.grads.size());
        double worst = 0;
        for (size_t i = 0; i < ref.grads.size(); i++) worst = std::max(worst, norm_err(got.grads[i], ref.grads[i]));
        // 3e-2: in bf16 the attention's products are bf16 on the GPU, bf16 or f32 on the CPU (f32
        // where it lacks AVX512-BF16): 0.021 measured on an H100 against an AVX2 build
        CHECK_MESSAGE(worst <= 3e-2, "worst adapter gradient error ", worst);
        double gap = 0;
        for (size_t s = 0; s < ref.losses.size(); s++) gap = std::max(gap, (double)std::fabs(got.losses[s] - ref.losses[s]) / std::fabs(ref.losses[s]));
        MESSAGE("step 1's adapter gradients within ", worst, ", 20 steps' losses within ", gap, " (relative) of the CPU's");
        // 20 steps: the losses track the CPU's, and training works on both
        for (size_t s = 0; s < ref.losses.size(); s++)
            CHECK_MESSAGE(std::fabs(got.losses[s] - ref.losses[s]) <= 2e-2 * std::fabs(ref.losses[s]), "step ", s + 1, ": ",
                          got.losses[s], " vs ", ref.losses[s]);
        CHECK(ref.losses.back() < 0.8f * ref.losses.front());
    }
}

// ---- the trainer itself on the backend (--device): the same run as on the CPU ------------------

OP_CASE(trainer_device) {
    tmpdir d;
    const std::string path = d.file("tiny-nf4.gguf");
    {
        tiny_llama t(tiny_hparams(61, 64, 128), 5, 0.2f, /*tied_output=*/true);
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_NF4;
        write_llama_gguf(t.m, path, o);
    }
    std::vector<ql_sequence> seqs;  // next = (3 t + 1) % 61, a masked prompt, padding
    for (int s = 0; s < 8; s++) {
        ql_sequence q;
        int tok = (7 * s + 2) % 61;
        for (int i = 0; i < 20; i++) {
            const bool real = i < 20 - s;
            q.tokens.push_back(real ? tok : 0);
            q.pos.push_back(i);
            q.seg.push_back(real ? 0 : 1);
            const int next = (3 * tok + 1) % 61;
            q.targets.push_back(real && i + 1 < 20 - s && i >= 2 ? next : -1);
            q.n_targets += q.targets.back() >= 0;
            tok = next;
        }
        seqs.push_back(q);
    }
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.1f;
    o.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
    o.micro_batch = 2;
    o.grad_accum = 2;
    o.lr = 5e-3f;
    o.max_steps = 8;
    o.threads = 1;
    o.precision = ql_precision::bf16;
    o.attn_f32 = true;  // the CUDA backend's attention is f32: the CPU's the same, so runs agree to the rounding
    // backend NULL: the trainer's own CPU backend, the reference
    auto run = [&](ql_backend *backend, std::vector<double> *losses, double *eval, std::vector<float> *adapter) {
        const std::string device = backend && !ql_backend_is_host(backend) ? "cuda" : "cpu";
        char err[256];
        ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        ql_train_options oo = o;
        oo.backend = backend;
        std::string e;
        ql_trainer *t = ql_trainer_new(f, seqs, seqs, oo, &e);
        REQUIRE_MESSAGE(t, e);
        ql_step_metrics m;
        while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
            REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
            losses->push_back(m.loss);
        }
        REQUIRE_MESSAGE(ql_trainer_eval(t, eval, &e), e);
        REQUIRE_MESSAGE(ql_trainer_save(t, d.file(device + ".ckpt").c_str(), &e), e);
        REQUIRE_MESSAGE(ql_trainer_to_host(t, &e), e);  // the adapter, back on the host for export
        for (ql_tensor *p : ql_llama_lora_params(ql_trainer_model(t)))
            adapter->insert(adapter->end(), (const float *)p->data, (const float *)p->data + ql_nelements(p));
        ql_trainer_free(t);
        ql_llama_file_free(f);
    };
    std::vector<double> ref_l, got_l;
    double ref_e = 0, got_e = 0;
    std::vector<float> ref_a, got_a;
    run(nullptr, &ref_l, &ref_e, &ref_a);
    run(be, &got_l, &got_e, &got_a);
    REQUIRE(got_l.size() == ref_l.size());
    for (size_t s = 0; s < ref_l.size(); s++)
        CHECK_MESSAGE(std::fabs(got_l[s] - ref_l[s]) <= 1e-2 * ref_l[s], "step ", s + 1, ": ", got_l[s], " vs ", ref_l[s]);
    CHECK(got_e == doctest::Approx(ref_e).epsilon(1e-2));
    // The adapters after 8 Adam steps: since gate and up are stored in bf16 (issue 30 item 2), an
    // element whose f32 sums differ in the last bit between cuBLAS's order and the CPU's can
    // round to neighbouring bf16 values (2^-8 apart), and Adam's normalised steps carry that on:
    // measured on an H200 0.044 (0.0052 with f32 gate/up), 0.0035 through the shim. With q, k, v,
    // RoPE and attention in bf16 too (7d7cd48): 0.074 on the H200, 0.046 through the shim, so the
    // bound is 0.1 - a drift bound of bf16 storage over 8 normalised steps (a wrong kernel is off
    // by O(1)); the losses above still agree to 1e-2 (measured 8.4e-4) and step 1's to ~1e-5.
    double gap = 0;
    for (size_t s = 0; s < ref_l.size(); s++) gap = std::max(gap, std::fabs(got_l[s] - ref_l[s]) / ref_l[s]);
    MESSAGE("8 bf16 steps: losses within ", gap, " (relative), the adapter within ", norm_err(got_a, ref_a), " of the CPU's");
    CHECK(norm_err(got_a, ref_a) <= 0.1);
    CHECK(ref_l.back() < ref_l.front());
    // the checkpoint written from the device holds the adapter that came back
    CHECK(read_file(d.file((ql_backend_is_host(be) ? std::string("cpu") : std::string("cuda")) + ".ckpt")).size() > 1000);
}

// fp16 with the FFN's guard (--ffn-down-f32: gate and up written in f32, SwiGLU's result and the
// down projection with its LoRA and dropout in f32 over NF4 weights, the rest fp16 with loss
// scaling): the device's steps are the CPU's to fp16's rounding
OP_CASE(trainer_fp16_ffn_guard) {
    tmpdir d;
    const std::string path = d.file("tiny-nf4-guard.gguf");
    {
        tiny_llama t(tiny_hparams(61, 64, 128), 9, 0.2f, /*tied_output=*/true);
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_NF4;
        write_llama_gguf(t.m, path, o);
    }
    std::vector<ql_sequence> seqs;
    for (int s = 0; s < 4; s++) {
        ql_sequence q;
        int tok = (5 * s + 1) % 61;
        for (int i = 0; i < 16; i++) {
            q.tokens.push_back(tok);
            q.pos.push_back(i);
            q.seg.push_back(0);
            tok = (3 * tok + 1) % 61;
            q.targets.push_back(i >= 1 ? tok : -1);
            q.n_targets += q.targets.back() >= 0;
        }
        seqs.push_back(q);
    }
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.1f;
    o.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
    o.micro_batch = 2;
    o.lr = 5e-3f;
    o.max_steps = 4;
    o.threads = 1;
    o.precision = ql_precision::fp16;
    o.ffn_down_f32 = true;
    auto run = [&](ql_backend *backend, std::vector<double> *losses) {
        char err[256];
        ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        ql_train_options oo = o;
        oo.backend = backend;
        std::string e;
        ql_trainer *t = ql_trainer_new(f, seqs, seqs, oo, &e);
        REQUIRE_MESSAGE(t, e);
        ql_step_metrics m;
        while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
            REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
            losses->push_back(m.loss);
        }
        ql_trainer_free(t);
        ql_llama_file_free(f);
    };
    std::vector<double> ref, got;
    run(nullptr, &ref);
    run(be, &got);
    REQUIRE(got.size() == ref.size());
    for (size_t s = 0; s < ref.size(); s++)
        CHECK_MESSAGE(std::fabs(got[s] - ref[s]) <= 1e-2 * ref[s], "step ", s + 1, ": ", got[s], " vs ", ref[s]);
    CHECK(ref.back() < ref.front());
}

// ---- GPU memory: the loss in chunks, the embedding on the host, the device plan is exact ----

OP_CASE(trainer_chunked_loss_embd_on_host_plan) {
    tmpdir d;
    const std::string path = d.file("tiny-untied.gguf");
    {
        tiny_llama t(tiny_hparams(97, 64, 128), 7, 0.2f, /*tied_output=*/false);
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_NF4;
        write_llama_gguf(t.m, path, o);
    }
    std::vector<ql_sequence> seqs;
    for (int s = 0; s < 4; s++) {
        ql_sequence q;
        int tok = (11 * s + 5) % 97;
        for (int i = 0; i < 24; i++) {
            q.tokens.push_back(tok);
            q.pos.push_back(i);
            q.seg.push_back(0);
            tok = (5 * tok + 3) % 97;
            q.targets.push_back(i >= 3 ? tok : -1);
            q.n_targets += q.targets.back() >= 0;
        }
        seqs.push_back(q);
    }
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.targets = {"q", "v", "down"};
    o.micro_batch = 2;
    o.lr = 1e-2f;
    o.max_steps = 3;
    o.threads = 1;
    o.backend = be;
    struct result {
        std::vector<double> losses;
        std::vector<float> adapter;
        ql_memory_plan plan;
        size_t allocated = 0;  // device memory the trainer allocated (ql_backend_memory_used)
        size_t n_lengths = 0;  // training graphs (dynamic padding)
    };
    using C = ql_checkpointing;
    auto run = [&](int64_t chunk, int embd_host, C checkpointing = C::none, bool offload = false, ql_optim optim = ql_optim::adamw,
                   int64_t ffn_chunk = -1, const std::vector<ql_sequence> *data = nullptr, bool late = false, bool grads = false) {
        const std::vector<ql_sequence> &seqs_run = data ? *data : seqs;
        result r;
        char err[256];
        ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        ql_train_options oo = o;
        oo.loss_chunk = chunk;
        oo.embd_on_host = embd_host;
        oo.checkpointing = checkpointing;
        oo.offload_activations = offload;
        oo.optim = optim;
        oo.ffn_chunk = ffn_chunk;
        oo.offload_late = late;
        oo.offload_grads = grads;
        std::string e;
        REQUIRE_MESSAGE(ql_train_plan(f, seqs_run, seqs_run, oo, &r.plan, &e), e);
        size_t before = 0, after = 0;
        ql_backend_memory_used(be, &before, nullptr);
        ql_trainer *t = ql_trainer_new(f, seqs_run, seqs_run, oo, &e);
        REQUIRE_MESSAGE(t, e);
        ql_backend_memory_used(be, &after, nullptr);
        r.allocated = after - before;
        r.n_lengths = ql_trainer_lengths(t).size();
        ql_step_metrics m;
        while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
            REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
            r.losses.push_back(m.loss);
        }
        REQUIRE_MESSAGE(ql_trainer_to_host(t, &e), e);
        for (ql_tensor *p : ql_llama_lora_params(ql_trainer_model(t)))
            r.adapter.insert(r.adapter.end(), (const float *)p->data, (const float *)p->data + ql_nelements(p));
        ql_trainer_free(t);
        ql_llama_file_free(f);
        return r;
    };
    const result whole = run(-1, 0), chunked = run(10, ql_backend_is_host(be) ? 0 : 1);
    const result block = run(-1, 0, C::block), offloaded = run(-1, 0, C::block, true);
    const result ffn = run(-1, 0, C::block, false, ql_optim::adamw, 10);  // 48 token rows in chunks of 10
    // the rows input in pinned host memory, copied in by the graph (ql_to_device) for block 0's
    // forward and again for its recompute, with the checkpoints offloaded; and the FFN in chunks
    const result rows_offloaded = run(-1, ql_backend_is_host(be) ? 0 : 1, C::block, true),
                 rows_ffn = run(-1, ql_backend_is_host(be) ? 0 : 1, C::block, false, ql_optim::adamw, 10);
    const result paged = run(-1, 0, C::none, false, ql_optim::paged_adamw), paged8 = run(-1, 0, C::none, false, ql_optim::paged_adamw8bit),
                 eight = run(-1, 0, C::none, false, ql_optim::adamw8bit);
    // 48 rows in chunks of 10: every chunk covers the whole vocabulary, so the loss is the same sum
    // in another order and the gradients are the same numbers
    CHECK(whole.plan.loss_chunk == 0);
    CHECK(chunked.plan.loss_chunk == 10);
    REQUIRE(chunked.losses.size() == whole.losses.size());
    for (size_t s = 0; s < whole.losses.size(); s++) CHECK(chunked.losses[s] == doctest::Approx(whole.losses[s]).epsilon(1e-6));
    CHECK(norm_err(chunked.adapter, whole.adapter) <= 1e-5);
    CHECK(whole.losses.back() < whole.losses.front());
    // the checkpoints copied to host memory and back (on a GPU on a second stream; through the shim
    // those copies happen only when an event orders them, so a missing wait reads stale bytes):
    // the same bits
    CHECK(offloaded.losses == block.losses);
    CHECK(offloaded.adapter == block.adapter);
    // the FFN in token chunks: the same run but for the sums over tokens
    CHECK(ffn.plan.ffn_chunk == 10);
    REQUIRE(ffn.losses.size() == block.losses.size());
    for (size_t s = 0; s < block.losses.size(); s++) CHECK(ffn.losses[s] == doctest::Approx(block.losses[s]).epsilon(1e-5));
    CHECK(norm_err(ffn.adapter, block.adapter) <= 1e-4);
    // each checkpoint brought back twice, just before its readers (none on the device through a
    // block's backward; the last block's offloaded too): the same bits, less device memory
    const result late = run(-1, 0, C::block, true, ql_optim::adamw, -1, nullptr, true);
    CHECK(late.losses == block.losses);
    CHECK(late.adapter == block.adapter);
    CHECK(late.plan.host_pinned == 2 * offloaded.plan.host_pinned);  // both blocks' checkpoints
    if (!ql_backend_is_host(be)) CHECK(late.plan.dev_buffer < offloaded.plan.dev_buffer);
    // and backward's large results that wait across a block's attention backward (the residual
    // gradient) parked in host memory meanwhile, the next checkpoint back after the block is done
    // (QL_OFFLOAD_GRADS; the copy to the host is waited for only where its bytes are written
    // again - through the shim a wait too late reads bytes written over): the same bits again
    const result parked = run(-1, 0, C::block, true, ql_optim::adamw, -1, nullptr, true, true);
    CHECK(parked.losses == block.losses);
    CHECK(parked.adapter == block.adapter);
    if (!ql_backend_is_host(be)) {
        CHECK(parked.plan.host_parked > 0);
        CHECK(parked.plan.host_pinned == late.plan.host_pinned + parked.plan.host_parked);
        CHECK(parked.plan.dev_buffer <= late.plan.dev_buffer);  // (the peak here is not attention's: less shows in test_finetune_defaults)
    }
    CHECK(rows_offloaded.losses == offloaded.losses);  // the same rows, gathered on the host: the same bits
    CHECK(rows_offloaded.adapter == offloaded.adapter);
    CHECK(rows_ffn.losses == ffn.losses);
    CHECK(rows_ffn.adapter == ffn.adapter);
    {  // 48 positions; lengths 48, 48, 12, 20 in micro-batches of 2: a shorter graph (dynamic
       // padding) whose rows input shares the longest one's pinned bytes
        std::vector<ql_sequence> mixed;
        for (int s = 0; s < 4; s++) {
            ql_sequence q;
            int tok = (7 * s + 2) % 97;
            const int n = s < 2 ? 48 : s == 2 ? 12 : 20;
            for (int i = 0; i < 48; i++) {  // (padded to 48, as the data's sequences are)
                q.tokens.push_back(i < n ? tok : 0);
                q.pos.push_back(i);
                q.seg.push_back(0);
                tok = (5 * tok + 3) % 97;
                q.targets.push_back(i >= 3 && i < n ? tok : -1);
                q.n_targets += q.targets.back() >= 0;
            }
            q.len = n;
            mixed.push_back(q);
        }
        const result dev = run(-1, 0, C::block, false, ql_optim::adamw, -1, &mixed),  // (offload keeps one length)
                     host = run(-1, ql_backend_is_host(be) ? 0 : 1, C::block, false, ql_optim::adamw, -1, &mixed);
        CHECK(dev.losses == host.losses);
        CHECK(dev.adapter == host.adapter);
        CHECK(dev.losses != block.losses);
        CHECK(host.n_lengths >= 2);  // (a shorter graph did run)
    }
    // paged state (on a GPU: pinned host memory its kernel updates in place): the same updates
    CHECK(paged.losses == whole.losses);
    CHECK(paged.adapter == whole.adapter);
    CHECK(paged8.adapter == eight.adapter);
    if (ql_backend_is_host(be)) {
        CHECK(!whole.plan.device);
        return;
    }
    // on the device: the embedding stayed on the host, and the plan is what was allocated, to the
    // byte (the weights, the run's tensors, the graph buffer; the backend's 4 KiB scratch is the
    // caller's, made with the backend before the trainer, and planned in the rounding's extra page)
    REQUIRE(whole.plan.device);
    CHECK(chunked.plan.embd_on_host);
    CHECK(chunked.plan.host_embd == (size_t)(97 * 64 * 4));
    CHECK(chunked.plan.dev_weights < whole.plan.dev_weights);
    // the step's embedding rows: one [64, 24, 2] f32 input that training and evaluation both read,
    // in pinned host memory (on the device only from its copy to its last reader: in the graph's
    // buffer); the token ids they replace were 192 bytes a graph
    const size_t rows_in = 64 * 24 * 2 * 4;
    MESSAGE("device state: token ids ", whole.plan.dev_state, ", embedding rows ", chunked.plan.dev_state);
    CHECK(chunked.plan.dev_state < whole.plan.dev_state);
    CHECK(chunked.plan.dev_state + 2 * 256 >= whole.plan.dev_state);
    CHECK(chunked.plan.host_pinned == rows_in);
    // block 0's checkpoint is the rows' copy, made again in backward: not kept, not offloaded (2
    // layers: nothing is left to offload; the pinned bytes are the rows')
    CHECK(rows_offloaded.plan.checkpoints + rows_in == offloaded.plan.checkpoints);
    CHECK(rows_offloaded.plan.saved <= offloaded.plan.saved);
    CHECK(offloaded.plan.host_pinned == rows_in);  // (block 0's checkpoint, the same size)
    CHECK(rows_offloaded.plan.host_pinned == rows_in);
    CHECK(offloaded.plan.host_pinned > 0);  // 2 layers: the first block's checkpoint (the last stays)
    CHECK(offloaded.plan.saved < block.plan.saved);
    CHECK(paged.plan.optimizer_host);
    CHECK(paged.plan.dev_state + paged.plan.optimizer == whole.plan.dev_state);  // the moments left the device
    for (const result *r : {&whole, &chunked, &block, &offloaded, &paged, &paged8, &ffn, &rows_offloaded, &rows_ffn, &late}) {
        // (and the weights' copies, which --cache-weights auto takes on the shim's 16 GiB)
        CHECK(r->allocated == r->plan.dev_weights + r->plan.dev_state + r->plan.dev_buffer + r->plan.dev_cache);
        CHECK(r->plan.total ==
              r->plan.dev_weights + r->plan.dev_state + r->plan.dev_buffer + r->plan.dev_cache + r->plan.dev_context + r->plan.dev_rounding);
        // the host's part holds none of the device's buffers: under the adapter, moments, pages
        // read and pinned memory, plus the reserve and a little staging
        const size_t own = r->plan.weights + r->plan.headers + r->plan.graph_heap + r->plan.lora + r->plan.optimizer + r->plan.host_pinned;
        CHECK(r->plan.host >= own);
        CHECK(r->plan.host <= own + (1u << 20) + own / 100 + 64 * 1024);
    }
    // the host reads no weight page on a device, except the embedding rows it keeps
    CHECK(whole.plan.weights == 0);
    CHECK(chunked.plan.weights > 0);
    CHECK(chunked.plan.weights <= chunked.plan.host_embd + 65536);
    CHECK(offloaded.plan.host >= block.plan.host + offloaded.plan.host_pinned);
}

// ---- a product straight into rows of a whole (the fused loss's dh) ----------------------------

OP_CASE(mul_mat_rows) {
    const int E = 64, V = 288, N = 40;
    for (ql_type wtype : {QL_TYPE_NF4, QL_TYPE_F16}) {
        for (ql_type btype : {QL_TYPE_F32, QL_TYPE_F16}) {
            CAPTURE(std::string(ql_type_name(wtype)));
            CAPTURE(std::string(ql_type_name(btype)));
            ql_init_params ip = {16u << 20, nullptr, true, false};
            ql_context *ctx = ql_init(ip);
            ql_tensor *w = ql_new_tensor_2d(ctx, wtype, E, V);  // a head: [E, V]
            ql_tensor *d0 = ql_new_tensor_2d(ctx, btype, V, 16), *d1 = ql_new_tensor_2d(ctx, btype, V, 20);
            ql_tensor *c = ql_new_tensor_2d(ctx, QL_TYPE_F32, E, N);
            ql_tensor *wt = ql_transpose(ctx, w);
            // rows [0, 16) and [16, 36) written, [36, 40) left as c had them
            ql_tensor *y = ql_mul_mat_rows(ctx, wt, d1, ql_mul_mat_rows(ctx, wt, d0, c, 0), 16);
            ql_tensor *r0 = ql_mul_mat(ctx, wt, d0), *r1 = ql_mul_mat(ctx, wt, d1);  // the products as ql_mul_mat makes them
            REQUIRE_MESSAGE(y, ql_ctx_error(ctx));
            for (ql_tensor *t : {y, r0, r1}) ql_set_output(t);
            ql_graph *g = ql_graph_new(ctx);
            for (ql_tensor *t : {r0, r1, y}) REQUIRE(ql_graph_build_forward(g, t) == QL_OK);
            ql_backend_buffer *leafs = ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE);
            REQUIRE_MESSAGE(leafs, ql_ctx_error(ctx));
            rng r(3);
            auto fill = [&](ql_tensor *t) {
                std::vector<float> x((size_t)ql_nelements(t));
                for (float &v : x) v = r.uniform(-1.0f, 1.0f);
                std::vector<uint8_t> bytes(ql_nbytes(t) + t->aux_size);
                char err[200] = "";
                REQUIRE_MESSAGE(ql_quantize(t->type, x.data(), ql_nrows(t), t->ne[0], bytes.data(), err, sizeof(err)) == QL_OK, err);
                REQUIRE(ql_backend_tensor_set(be, t, bytes.data(), 0, bytes.size()) == QL_OK);
            };
            for (ql_tensor *t : {w, d0, d1}) fill(t);
            std::vector<float> c0((size_t)E * N, 7.0f);
            REQUIRE(ql_backend_tensor_set(be, c, c0.data(), 0, c0.size() * 4) == QL_OK);
            const bool planned = ql_graph_plan(g, be, nullptr) == QL_OK && ql_graph_alloc(g, be) == QL_OK;
            REQUIRE_MESSAGE(planned, ql_ctx_error(ctx));
            REQUIRE_MESSAGE(ql_backend_graph_compute(be, g) == QL_OK, ql_ctx_error(ctx));
            std::vector<float> got((size_t)E * N), p0((size_t)E * 16), p1((size_t)E * 20);
            REQUIRE(ql_backend_tensor_get(be, y, got.data(), 0, got.size() * 4) == QL_OK);
            REQUIRE(ql_backend_tensor_get(be, r0, p0.data(), 0, p0.size() * 4) == QL_OK);
            REQUIRE(ql_backend_tensor_get(be, r1, p1.data(), 0, p1.size() * 4) == QL_OK);
            std::vector<float> want(p0);
            want.insert(want.end(), p1.begin(), p1.end());
            want.insert(want.end(), (size_t)E * 4, 7.0f);
            CHECK((got == want));  // the same kernel over the same product: the same bits, at their rows
            ql_census cs;
            REQUIRE(ql_graph_census(g, be, &cs) == QL_OK);
            CHECK(cs.flops == 2.0 * 2 * V * E * 36);  // each product counted once, as the rows it writes
            ql_graph_free(g);
            ql_backend_buffer_free(leafs);
            ql_free(ctx);
        }
    }
}

// ---- the head and the loss fused: dlogits and dh made in forward, no logits recompute ----------

OP_CASE(trainer_fused_loss) {
    tmpdir d;
    const std::string path = d.file("tiny-nf4-head.gguf");
    const int V = 97, E = 64;
    {
        tiny_llama t(tiny_hparams(V, E, 128), 3, 0.2f, /*tied_output=*/false);
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_Q4_0;
        o.nf4 = {"output.weight"};  // a quantised frozen head, as a QLoRA run's
        write_llama_gguf(t.m, path, o);
    }
    std::vector<ql_sequence> seqs;
    for (int s = 0; s < 4; s++) {
        ql_sequence q;
        int tok = (13 * s + 4) % V;
        for (int i = 0; i < 24; i++) {
            q.tokens.push_back(tok);
            q.pos.push_back(i);
            q.seg.push_back(0);
            tok = (7 * tok + 2) % V;
            q.targets.push_back(i >= 2 && i != 9 ? tok : -1);  // a masked prompt and an ignored row inside a chunk
            q.n_targets += q.targets.back() >= 0;
        }
        seqs.push_back(q);
    }
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.1f;
    o.lora.targets = {"q", "v", "up", "down"};
    o.micro_batch = 2;
    o.lr = 1e-2f;
    o.max_steps = 3;
    o.threads = 1;
    o.backend = be;
    o.attn_f32 = true;
    struct result {
        std::vector<double> losses;
        std::vector<float> adapter;
        ql_memory_plan plan;
        int head_products = 0;  // multiplies by the head's weight in a micro-batch's graph
        size_t allocated = 0;
    };
    auto run = [&](ql_precision pr, int64_t chunk, bool fused) {
        result r;
        char err[256];
        ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        ql_train_options oo = o;
        oo.precision = pr;
        oo.loss_chunk = chunk;
        oo.loss_fused = fused;
        std::string e;
        REQUIRE_MESSAGE(ql_train_plan(f, seqs, seqs, oo, &r.plan, &e), e);
        size_t before = 0, after = 0;
        ql_backend_memory_used(be, &before, nullptr);
        ql_trainer *t = ql_trainer_new(f, seqs, seqs, oo, &e);
        REQUIRE_MESSAGE(t, e);
        ql_backend_memory_used(be, &after, nullptr);
        r.allocated = after - before;
        const ql_tensor *w = ql_trainer_model(t).output;
        ql_graph *g = ql_trainer_graph(t);
        for (int i = 0; i < ql_graph_n_nodes(g); i++) {
            const ql_tensor *n = ql_graph_node(g, i);
            r.head_products += (n->op == QL_OP_MUL_MAT && (n->src[0] == w || n->src[0]->view_src == w)) ||
                               (n->op == QL_OP_MUL_MAT_ROWS && n->src[1]->view_src == w);
        }
        ql_step_metrics m;
        while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
            REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
            r.losses.push_back(m.loss);
        }
        double ev = 0;
        REQUIRE_MESSAGE(ql_trainer_eval(t, &ev, &e), e);
        r.losses.push_back(ev);  // the evaluation graph's (no dh in it)
        REQUIRE_MESSAGE(ql_trainer_to_host(t, &e), e);
        for (ql_tensor *p : ql_llama_lora_params(ql_trainer_model(t)))
            r.adapter.insert(r.adapter.end(), (const float *)p->data, (const float *)p->data + ql_nelements(p));
        ql_trainer_free(t);
        ql_llama_file_free(f);
        return r;
    };
    const int rows = 2 * 24;
    for (ql_precision pr : {ql_precision::fp32, ql_precision::bf16, ql_precision::fp16}) {
        if (pr == ql_precision::bf16 && !ql_backend_is_host(be)) {
            ql_backend_caps c{};
            ql_backend_get_caps(be, &c);
            if (!c.bf16_gemm) continue;
        }
        for (int64_t chunk : {(int64_t)-1, (int64_t)10}) {
            CAPTURE((int)pr);
            CAPTURE(chunk);
            const result old = run(pr, chunk, false), fused = run(pr, chunk, true);
            // the same operations in the same order (dy = 1 made in forward instead of backward's
            // seed of 1, dh's rows added onto zeros instead of view_back's): the same bits
            REQUIRE(fused.losses.size() == old.losses.size());
            for (size_t s = 0; s < old.losses.size(); s++) CHECK(fused.losses[s] == old.losses[s]);
            CHECK(norm_err(fused.adapter, old.adapter) == 0.0);
            CHECK(old.losses[old.losses.size() - 2] < old.losses.front());
            CHECK(fused.plan.loss_fused);
            // the census: 3 head products per chunk before (forward, recompute, Wᵀ dlogits), 2 now
            const int chunks = chunk > 0 ? (rows + (int)chunk - 1) / (int)chunk : 1;
            CHECK(old.head_products == (chunk > 0 ? 3 : 2) * chunks);
            CHECK(fused.head_products == 2 * chunks);
            CHECK(fused.plan.census.recompute_flops == 0.0);
            if (chunk > 0) CHECK(old.plan.census.recompute_flops == 2.0 * V * E * rows);
            if (!ql_backend_is_host(be)) {  // the device plan is what was allocated, to the byte
                CHECK(fused.allocated == fused.plan.dev_weights + fused.plan.dev_state + fused.plan.dev_buffer + fused.plan.dev_cache);
                CHECK(old.allocated == old.plan.dev_weights + old.plan.dev_state + old.plan.dev_buffer + old.plan.dev_cache);
            }
        }
    }
}

// ---- a device run gives the model's pages back once placed (QL_FLAG_MAPPED) ---------------------

namespace {
// the resident bytes of this process's mappings of `path` (Linux /proc/self/smaps; -1 without it)
long long mapped_rss(const std::string &path) {
    FILE *fp = fopen("/proc/self/smaps", "r");
    if (!fp) return -1;
    char line[4096];
    bool in = false;
    long long kb = 0;
    while (fgets(line, sizeof(line), fp)) {
        const size_t n = strlen(line);
        if (n && line[n - 1] == '\n') line[n - 1] = 0;
        unsigned long a, b;
        if (sscanf(line, "%lx-%lx", &a, &b) == 2 && strchr(line, ' ')) {  // a mapping's header line
            const size_t L = strlen(line);
            in = L >= path.size() && path == line + L - path.size();
        } else if (in && !strncmp(line, "Rss:", 4)) {
            kb += atoll(line + 4);
        }
    }
    fclose(fp);
    return kb * 1024;
}
}  // namespace

OP_CASE(device_gives_back_model_pages) {
    tmpdir d;
    const std::string path = d.file("tiny-f32.gguf");
    {
        tiny_llama t(tiny_hparams(97, 128, 256), 3, 0.2f, /*tied_output=*/false);
        write_llama_gguf(t.m, path, llama_gguf_opts{});  // f32: ~0.5 MiB of weights
    }
    char err[256];
    ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    size_t tensor_bytes = 0;
    volatile uint8_t sink = 0;
    for (ql_tensor *w : {f->model.tok_embd, f->model.output, f->model.layers[0].wq, f->model.layers[1].w_down}) {
        CHECK((w->flags & QL_FLAG_MAPPED));  // opened by path: the file's mapping
        for (size_t i = 0; i < ql_nbytes(w); i += 512) sink = sink + ((const uint8_t *)w->data)[i];
        tensor_bytes += ql_nbytes(w);
    }
    (void)sink;
    const long long before = mapped_rss(path);
    if (before < 0) {
        ql_llama_file_free(f);
        MESSAGE("no /proc/self/smaps: not checked");
        return;
    }
    CHECK(before >= (long long)tensor_bytes);
    ql_backend_buffer *wb = ql_backend_place_ctx_tensors(be, f->ctx);
    REQUIRE(wb);
    const long long placed = mapped_rss(path);
    if (ql_backend_is_host(be)) {
        CHECK(placed == before);  // the CPU reads the weights where they are
    } else {
        CHECK(f->model.tok_embd->data != ql_backend_buffer_host_data(wb, f->model.tok_embd));
        const long long P = sysconf(_SC_PAGESIZE);
        CHECK(placed <= ((long long)ql_gguf_data_offset(f->gguf) + P - 1) / P * P + P);  // the header's pages at most
    }
    ql_backend_buffer_free(wb);  // back on the mapping: the host reads the same bytes again, from the file
    REQUIRE(f->model.tok_embd->type == QL_TYPE_F32);
    tiny_llama t(tiny_hparams(97, 128, 256), 3, 0.2f, false);
    CHECK(memcmp((const float *)f->model.tok_embd->data + 5 * 128, (const float *)t.m.tok_embd->data + 5 * 128, 128 * 4) == 0);
    CHECK(memcmp(f->model.output->data, t.m.output->data, ql_nbytes(t.m.output)) == 0);
    ql_llama_file_free(f);
}

OP_CASE(check_finite_and_host_leafs) {
    // check_finite names the same node on every backend
    std::string msg[2];
    for (int side = 0; side < 2; side++) {
        ql_backend *b = side == 0 ? ql_backend_cpu_init(1) : be;
        ql_init_params ip = {1u << 20, nullptr, true, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *x = ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, 40), "x");
        ql_tensor *y = ql_scale(ctx, ql_add(ctx, x, x), 1e38f);  // overflows to inf in the scale
        ql_graph *g = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(g, y) == QL_OK);
        ql_backend_buffer *buf = ql_backend_alloc_ctx_tensors(b, ctx, QL_BUFFER_DEVICE);
        REQUIRE(buf);
        std::vector<float> v(40, 1.0f);
        v[7] = 9.0f;  // 2 x 9 x 1e38 overflows; 2 x 1e38 does not
        REQUIRE(ql_backend_tensor_set(b, x, v.data(), 0, 160) == QL_OK);
        REQUIRE(ql_graph_alloc(g, b) == QL_OK);
        ql_graph_set_check_finite(g, true);
        CHECK(ql_backend_graph_compute(b, g) != QL_OK);
        msg[side] = ql_ctx_error(ctx);
        ql_graph_free(g);
        ql_backend_buffer_free(buf);
        ql_free(ctx);
        if (side == 0) ql_backend_free(b);
    }
    CHECK_MESSAGE(msg[0].find("(scale [40] f32 of node 0 (add)) holds inf at element 7") != std::string::npos, msg[0]);
    CHECK(msg[1].substr(msg[1].find("compute:")) == msg[0].substr(msg[0].find("compute:")));
    if (ql_backend_is_host(be)) return;
    // a device refuses a graph whose leaf still holds host memory, naming it
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 8), "forgotten.weight");
    ql_tensor_fill_f32(w, 1.0f);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, ql_scale(ctx, w, 2.0f)) == QL_OK);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    CHECK(ql_backend_graph_compute(be, g) == QL_ERR_INVALID);
    CHECK_MESSAGE(std::string(ql_ctx_error(ctx)).find("'forgotten.weight' holds host memory") != std::string::npos, ql_ctx_error(ctx));
    ql_graph_free(g);
    ql_free(ctx);
}

// A 16-bit result on the backend itself against the f32 result rounded: ql_mul_mat_to is
// round(a b), ql_mul_mat_acc onto a 16-bit c is round(c + a b) - one rounding, not cuBLAS'
// epilogue's two (which an H200 showed: 28% of the elements an ulp off before the product went
// through f32). The same multiply either way, so the same bits.
OP_CASE(mul_mat_16bit_result_rounds_once) {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (int acc = 0; acc < 2; acc++)
            for (int64_t K : {64, 1024}) {
                INFO("type " << std::string(ql_type_name(t)) << (acc ? ", onto c" : "") << ", K " << K);
                const run_result r = run_case(be, false, [t, acc, K](leafs &L) {
                    ql_tensor *a = L.rand(QL_TYPE_NF4, {K, 256});
                    ql_tensor *x = ql_cast(L.ctx, L.rand(QL_TYPE_F32, {K, 90}), t);
                    ql_tensor *c = ql_cast(L.ctx, L.rand(QL_TYPE_F32, {256, 90}), t);
                    ql_tensor *y = acc ? ql_mul_mat_acc(L.ctx, a, x, ql_cont(L.ctx, c)) : ql_mul_mat_to(L.ctx, a, x, t);
                    ql_tensor *p = ql_mul_mat(L.ctx, a, x);
                    ql_tensor *ref = ql_cast(L.ctx, acc ? ql_add(L.ctx, ql_cast(L.ctx, c, QL_TYPE_F32), p) : p, t);
                    return ql_add(L.ctx, ql_cast(L.ctx, y, QL_TYPE_F32), ql_scale(L.ctx, ql_cast(L.ctx, ref, QL_TYPE_F32), -1.0f));
                }, false);
                REQUIRE_MESSAGE(r.error.empty(), r.error);
                int64_t off = 0;
                for (float v : r.out) off += v != 0.0f;
                CHECK_MESSAGE(off == 0, off, " of ", r.out.size(), " elements differ from the f32 result rounded once");
            }
}

// ---- --cache-weights (issue 31 item 3): the frozen weights' copies in the compute type ----------
// A tiny llama whose linears are NF4, Q8_0 or f16 and whose head is f32, trained with and without
// the copies. The products then read the copy (one GEMM over all of W, or Wᵀ over it) instead of
// dequantising tiles (here several of 128 rows: the tile budget made small): the GEMMs' inputs
// are the same values, so through the shim (a GEMM that sums each element alone, in k order) the
// losses and adapters are the same bits. The plan counts the copies, to the byte. The CPU keeps
// no copies: `on` is refused there, auto is off.
OP_CASE(trainer_cache_weights) {
    tmpdir d;
    tile_budget tiles(64 * 128);  // (a budget of 128 rows of 64: the 384-row weights and the 300-row head in 3 tiles)
    {  // the workspace rule: a flagged weight's products (W x and Wᵀ dy) plan no tile for it
        ql_init_params ip = {1u << 20, nullptr, true, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_NF4, 64, 384);
        ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_BF16, 64, 10), *dy = ql_new_tensor_2d(ctx, QL_TYPE_BF16, 384, 10);
        ql_tensor *fwd = ql_mul_mat(ctx, w, x), *back = ql_mul_mat(ctx, ql_transpose(ctx, w), dy);
        const size_t f0 = ql_cuda_work_size(fwd, 90), b0 = ql_cuda_work_size(back, 90);
        CHECK(f0 >= (size_t)2 * 128 * 64 * 2);  // two tiles' buffers
        CHECK(b0 >= (size_t)2 * 64 * 64 * 2);
        CHECK(ql_cuda_node_launches(fwd, 90, false) == 3 + 3);  // 3 tiles: a fill and a GEMM each
        ql_weight_cache_mark(&w, 1, true);
        CHECK(ql_cuda_mm_cached(fwd->src[0], QL_TYPE_BF16) == w);
        CHECK(ql_cuda_mm_cached(back->src[0], QL_TYPE_BF16) == w);
        CHECK(ql_cuda_work_size(fwd, 90) == 0);
        CHECK(ql_cuda_work_size(back, 90) == 0);
        CHECK(ql_cuda_node_launches(fwd, 90, false) == 1);  // one GEMM over the copy
        ql_weight_cache_mark(&w, 1, false);
        CHECK(ql_cuda_work_size(fwd, 90) == f0);
        ql_free(ctx);
    }
    struct variant {
        ql_type linear;
        ql_precision prec;
        int r = 4;
        ql_optim optim = ql_optim::adamw;
    };
    // (r 16: the factors of 6,144 elements take 8-bit state, the smaller ones f32 - both update kernels)
    for (const variant &vr : {variant{QL_TYPE_NF4, ql_precision::bf16}, variant{QL_TYPE_NF4, ql_precision::fp16},
                              variant{QL_TYPE_Q8_0, ql_precision::bf16}, variant{QL_TYPE_F16, ql_precision::bf16},
                              variant{QL_TYPE_F16, ql_precision::fp16}, variant{QL_TYPE_NF4, ql_precision::bf16, 16, ql_optim::paged_adamw8bit}}) {
        INFO("linears " << std::string(ql_type_name(vr.linear)) << ", precision " << std::string(ql_name(vr.prec)) << ", r " << vr.r
                        << ", " << std::string(ql_name(vr.optim)));
        const std::string path = d.file(std::string("tiny-") + ql_type_name(vr.linear) + ".gguf");
        {
            tiny_llama t(tiny_hparams(300, 64, 384), 9, 0.2f, /*tied_output=*/false);
            llama_gguf_opts o;
            o.linear_type = vr.linear;
            write_llama_gguf(t.m, path, o);
        }
        std::vector<ql_sequence> seqs;
        for (int s = 0; s < 4; s++) {
            ql_sequence q;
            int tok = (13 * s + 7) % 300;
            for (int i = 0; i < 24; i++) {
                q.tokens.push_back(tok);
                q.pos.push_back(i);
                q.seg.push_back(0);
                tok = (7 * tok + 11) % 300;
                q.targets.push_back(i >= 2 ? tok : -1);
                q.n_targets += q.targets.back() >= 0;
            }
            seqs.push_back(q);
        }
        ql_train_options o;
        o.lora.r = vr.r;
        o.lora.alpha = 2.0f * vr.r;
        o.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
        o.lora.dropout = 0.1f;
        o.optim = vr.optim;
        o.micro_batch = 2;
        o.lr = 1e-2f;
        o.max_steps = 3;
        o.threads = 1;
        o.precision = vr.prec;
        o.checkpointing = ql_checkpointing::block;  // (recompute reads the weights too)
        o.loss_chunk = -1;
        o.backend = be;
        struct result {
            std::vector<double> losses;
            std::vector<float> adapter;
            ql_memory_plan plan;
            size_t allocated = 0;
            std::string error;
        };
        // resume: a checkpoint saved after the first step and a new trainer loading it (the load
        // writes the adapter after the copies were made from its initial values)
        auto run = [&](int cache, bool resume = false) {
            result r;
            char err[256];
            ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
            REQUIRE_MESSAGE(f, err);
            ql_train_options oo = o;
            oo.cache_weights = cache;
            size_t before = 0, after = 0;
            ql_backend_memory_used(be, &before, nullptr);
            ql_trainer *t = nullptr;
            if (ql_train_plan(f, seqs, seqs, oo, &r.plan, &r.error)) t = ql_trainer_new(f, seqs, seqs, oo, &r.error);
            if (!t) {
                ql_llama_file_free(f);
                return r;
            }
            ql_backend_memory_used(be, &after, nullptr);
            r.allocated = after - before;
            ql_step_metrics m;
            std::string e;
            while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
                REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
                r.losses.push_back(m.loss);
                if (resume && ql_trainer_steps_done(t) == 1) {
                    const std::string ck = d.file("resume.gguf");
                    REQUIRE_MESSAGE(ql_trainer_save(t, ck.c_str(), &e), e);
                    ql_trainer_free(t);
                    REQUIRE((t = ql_trainer_new(f, seqs, seqs, oo, &e)));
                    REQUIRE_MESSAGE(ql_trainer_load(t, ck.c_str(), &e), e);
                }
            }
            REQUIRE_MESSAGE(ql_trainer_to_host(t, &e), e);
            for (ql_tensor *p : ql_llama_lora_params(ql_trainer_model(t)))
                r.adapter.insert(r.adapter.end(), (const float *)p->data, (const float *)p->data + ql_nelements(p));
            ql_trainer_free(t);
            for (const ql_tensor *w : {f->model.layers[0].wq, f->model.layers[1].w_down, f->model.output})
                CHECK((!(w->flags & QL_FLAG_CACHED) && !w->extra));  // the trainer leaves the model as it found it
            ql_llama_file_free(f);
            return r;
        };
        const result off = run(0), autod = run(-1);
        REQUIRE_MESSAGE(off.error.empty(), off.error);
        REQUIRE_MESSAGE(autod.error.empty(), autod.error);
        CHECK(off.losses.back() < off.losses.front());
        CHECK(autod.losses == off.losses);
        CHECK(autod.adapter == off.adapter);
        CHECK(off.plan.dev_cache == 0);
        if (ql_backend_is_host(be)) {  // the CPU converts while packing: no copies, `on` refused with the reason
            CHECK_MESSAGE(autod.plan.cache_weights.rfind("off (the CPU", 0) == 0, autod.plan.cache_weights);
            const result on = run(1);
            CHECK_MESSAGE(on.error.rfind("--cache-weights on: the CPU backend converts the weights while packing", 0) == 0, on.error);
            continue;
        }
        const result on = run(1);
        REQUIRE_MESSAGE(on.error.empty(), on.error);
        CHECK(on.plan.cache_weights == "on");
        // f16 linears under fp16 need no copy (they are the compute type): only the f32 head has one;
        // and each LoRA factor, f32 [in, r] and [r, out], one in the compute type
        const int64_t E = 64, F = 384, V = 300, kv = 64 / 4 * 2, L = 2, R = vr.r;
        const size_t es = vr.prec == ql_precision::fp32 ? 4 : 2;
        const int64_t linear_elems = L * (E * E * 2 + E * kv * 2 + E * F * 3);
        const bool linears = !(vr.linear == QL_TYPE_F16 && vr.prec == ql_precision::fp16);
        size_t factors = 0;
        for (const int64_t n : {E * R, R * E, E * R, R * kv, E * R, R * kv, E * R, R * E, E * R, R * F, E * R, R * F, F * R, R * E})
            factors += L * (((size_t)n * es + QL_ALIGN - 1) / QL_ALIGN * QL_ALIGN);
        CHECK(on.plan.dev_cache == (linears ? (size_t)linear_elems * es : 0) + (size_t)(E * V) * es + factors);
        // every product of a factor reads its copy: no conversion before it
        CHECK(on.plan.census.launches < off.plan.census.launches);
        // the shim's 16 GiB: auto took them, and the same plan as `on`
        CHECK(autod.plan.cache_weights == "auto: on");
        CHECK(autod.plan.dev_cache == on.plan.dev_cache);
        // the same bits: the copies hold the tiles' values, and the factors' follow every update
        CHECK(on.losses == off.losses);
        CHECK(on.adapter == off.adapter);
        const result resumed = run(1, true);  // and every write: a checkpoint loaded into a new run
        CHECK(resumed.losses == on.losses);
        CHECK(resumed.adapter == on.adapter);
        for (const result *r : {&off, &on, &autod}) {  // the plan is what was allocated, to the byte
            CHECK(r->allocated == r->plan.dev_weights + r->plan.dev_state + r->plan.dev_buffer + r->plan.dev_cache);
            CHECK(r->plan.total ==
                  r->plan.dev_weights + r->plan.dev_state + r->plan.dev_buffer + r->plan.dev_cache + r->plan.dev_context + r->plan.dev_rounding);
        }
    }
}

// ---- a model split over devices: the same run as one device --------------------------------

extern "C" __attribute__((weak)) int qlshim_set_devices(int n);  // tests/cuda_shim.h; absent on a real GPU

extern "C" long long qlshim_peer_copies(void) __attribute__((weak));  // tests/cuda_shim.h: peer copies between devices

OP_CASE(trainer_split_layers) {
    // a second and third device: through the shim three of them (each a number for cudaSetDevice:
    // a launch on another device's stream, or a weight placed on another device, fails); on a real
    // GPU the card itself again when it is alone (two backends on one device: what a split needs
    // of the code, not of the hardware); on the CPU more CPU backends
    const bool host = ql_backend_is_host(be);
    const int was = !host && qlshim_set_devices ? qlshim_set_devices(3) : 0;
    const int n_dev = host ? 3 : ql_cuda_device_count();
    std::vector<ql_backend *> more;
    for (int i = 1; i < 3; i++) {
        char err[256] = "";
        ql_backend *b = host ? ql_backend_cpu_init(1) : ql_backend_cuda_init(i < n_dev ? i : 0, err, sizeof(err));
        REQUIRE_MESSAGE(b, err);
        more.push_back(b);
    }
    tmpdir d;
    const std::string path = d.file("tiny4.gguf"), tied_path = d.file("tied.gguf");
    {
        tiny_llama t(tiny_hparams(97, 64, 128, /*n_layer=*/4), 11, 0.2f, /*tied_output=*/false);
        llama_gguf_opts o;
        o.linear_type = QL_TYPE_NF4;
        write_llama_gguf(t.m, path, o);
        tiny_llama u(tiny_hparams(97, 64, 128, 4), 11, 0.2f, /*tied_output=*/true);
        write_llama_gguf(u.m, tied_path, o);
    }
    std::vector<ql_sequence> seqs;
    for (int s = 0; s < 6; s++) {  // targets end at 24, 16 or 12: the shorter graphs of dynamic padding run too
        ql_sequence q;
        int tok = (13 * s + 3) % 97;
        const int last = s % 3 == 0 ? 24 : s % 3 == 1 ? 16 : 12;
        for (int i = 0; i < 24; i++) {
            q.tokens.push_back(tok);
            q.pos.push_back(i);
            q.seg.push_back(0);
            tok = (7 * tok + 5) % 97;
            q.targets.push_back(i >= 2 && i < last ? tok : -1);
            q.n_targets += q.targets.back() >= 0;
        }
        seqs.push_back(q);
    }
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.1f;  // masks drawn per block: a stage's must be the whole's
    o.lora.targets = {"q", "v", "gate", "down"};
    o.micro_batch = 2;
    o.grad_accum = 2;  // h_in's gradient must start from zero in each micro-batch
    o.lr = 1e-2f;
    o.max_grad_norm = 0.05f;  // below the norms met: the clip factor is the whole's, from every stage's gradients
    o.max_steps = 3;
    o.threads = 1;
    o.backend = be;
    struct result {
        std::vector<double> losses, norms;
        double eval = 0;
        std::vector<float> adapter;
        uint64_t hash = 0;
        ql_memory_plan plan;
        size_t allocated = 0;
        std::vector<size_t> per_device;  // what each stage's device got (through the shim: devices 0, 1, 2)
    };
    auto run = [&](const std::vector<ql_backend *> &split, const std::vector<int> &layers) {
        result r;
        char err[256];
        ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f, err);
        ql_train_options oo = o;
        oo.split = split;
        oo.split_layers = layers;
        std::string e;
        REQUIRE_MESSAGE(ql_train_plan(f, seqs, seqs, oo, &r.plan, &e), e);
        size_t before = 0, after = 0;
        ql_backend_memory_used(be, &before, nullptr);
        std::vector<size_t> dev_before(split.size(), 0), dev_after(split.size(), 0);  // each stage's device
        for (size_t i = 0; i < split.size(); i++) ql_cuda_device_memory_used(split[i], &dev_before[i], nullptr);
        ql_trainer *t = ql_trainer_new(f, seqs, seqs, oo, &e);
        REQUIRE_MESSAGE(t, e);
        ql_backend_memory_used(be, &after, nullptr);
        r.allocated = after - before;
        for (size_t i = 0; i < split.size(); i++) {
            ql_cuda_device_memory_used(split[i], &dev_after[i], nullptr);
            r.per_device.push_back(dev_after[i] - dev_before[i]);
        }
        ql_step_metrics m;
        while (ql_trainer_steps_done(t) < ql_trainer_total_steps(t)) {
            REQUIRE_MESSAGE(ql_trainer_step(t, &m, &e), e);
            r.losses.push_back(m.loss);
            r.norms.push_back(m.grad_norm);
        }
        REQUIRE_MESSAGE(ql_trainer_eval(t, &r.eval, &e), e);
        REQUIRE(ql_trainer_state_hash(t, &r.hash));
        REQUIRE_MESSAGE(ql_trainer_save(t, d.file("split" + std::to_string(split.size()) + ".ckpt").c_str(), &e), e);
        REQUIRE_MESSAGE(ql_trainer_to_host(t, &e), e);
        for (ql_tensor *p : ql_llama_lora_params(ql_trainer_model(t)))
            r.adapter.insert(r.adapter.end(), (const float *)p->data, (const float *)p->data + ql_nelements(p));
        ql_trainer_free(t);
        ql_llama_file_free(f);
        return r;
    };
    const result one = run({}, {});
    const long long peer0 = qlshim_peer_copies ? qlshim_peer_copies() : 0;
    const result two = run({be, more[0]}, {});               // balanced by memory
    const result three = run({be, more[0], more[1]}, {0, 1, 3});
    if (!host && qlshim_peer_copies)  // the activations and their gradients crossed card to card (shim devices 0-2)
        CHECK(qlshim_peer_copies() - peer0 > 0);
    REQUIRE(two.plan.stages.size() == 2);
    REQUIRE(three.plan.stages.size() == 3);
    MESSAGE("split over 2: ", two.plan.split_choice, "; over 3: ", three.plan.split_choice);
    CHECK(three.plan.stage_layers == std::vector<int>{0, 1, 3});
    CHECK(one.norms[0] > o.max_grad_norm);  // (the clip is in force)
    for (const result *r : {&two, &three}) {
        REQUIRE(r->losses.size() == one.losses.size());
        // the same ops in the same order on every stage: the same bits (the norm's double sum
        // over the stages in another order: within a double's rounding)
        for (size_t s = 0; s < one.losses.size(); s++) {
            CHECK(r->losses[s] == one.losses[s]);
            CHECK(r->norms[s] == doctest::Approx(one.norms[s]).epsilon(1e-12));
        }
        CHECK(r->eval == one.eval);
        CHECK(r->adapter == one.adapter);
        CHECK(r->hash == one.hash);  // the checkpoint's payload: the adapter and the moments, named, in order
        if (host) continue;
        // each stage's device plan is what it allocated (all of them together, to the byte)
        size_t planned = 0;
        for (size_t i = 0; i < r->plan.stages.size(); i++) {
            const ql_memory_plan &sp = r->plan.stages[i];
            CHECK(sp.device);
            CHECK(sp.total == sp.dev_weights + sp.dev_state + sp.dev_buffer + sp.dev_cache + sp.dev_context + sp.dev_rounding);
            planned += sp.dev_weights + sp.dev_state + sp.dev_buffer + sp.dev_cache;
            // each device its own stage's (where two stages share a real card, the card's count holds both)
            if (n_dev >= 3) CHECK(r->per_device[i] == sp.dev_weights + sp.dev_state + sp.dev_buffer + sp.dev_cache);
        }
        CHECK(r->allocated == planned);
        // the blocks' weights are on their stages: the weights over the stages are the whole's
        size_t w = 0;
        for (const ql_memory_plan &sp : r->plan.stages) w += sp.dev_weights;
        CHECK(w == one.plan.dev_weights);
    }
    if (!host) {  // the halves of a stage's graph were captured as CUDA graphs of their own and replayed (the same bits above)
        ql_cuda_graph_counts c;
        REQUIRE(ql_cuda_get_graph_counts(more[0], &c));
        MESSAGE("the second device: ", c.captured, " captures, ", c.launched, " launches, ", c.eager, " eager runs");
        CHECK(c.captured > 0);
        CHECK(c.launched > c.captured);
    }
    // a split's checkpoint is one device's: the same file
    CHECK(read_file(d.file("split0.ckpt")) == read_file(d.file("split2.ckpt")));
    CHECK(read_file(d.file("split0.ckpt")) == read_file(d.file("split3.ckpt")));

    // what a split refuses, in one line
    char err[256];
    ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
    ql_llama_file *tied = ql_llama_load(tied_path.c_str(), err, sizeof(err));
    REQUIRE(f);
    REQUIRE(tied);
    auto refused = [&](ql_llama_file *m, ql_train_options oo, const char *what) {
        ql_memory_plan mp;
        std::string e;
        CHECK_FALSE(ql_train_plan(m, seqs, seqs, oo, &mp, &e));
        CHECK_MESSAGE(e.find(what) != std::string::npos, e);
        ql_trainer *t = ql_trainer_new(m, seqs, seqs, oo, &e);
        CHECK(!t);
        ql_trainer_free(t);
    };
    ql_train_options bad = o;
    bad.split = {be, more[0]};
    refused(tied, bad, "tied");
    ql_train_options dup = bad;
    dup.split = {be, be};
    refused(f, dup, "each once");
    ql_train_options five = bad;
    five.split = {be, more[0], more[1], more[0], more[1]};
    refused(f, five, "at most one device per block");
    ql_train_options layers = bad;
    layers.split_layers = {0, 4};
    refused(f, layers, "first blocks");
    ql_train_options dp = bad;
    dp.world = 2;
    refused(f, dp, "data parallel");
    ql_train_options vr = bad;
    vr.split_vram = {1u << 30, 1u << 30, 1u << 30};
    refused(f, vr, "device memory limits");
    ql_llama_file_free(tied);
    ql_llama_file_free(f);
    for (ql_backend *b : more) ql_backend_free(b);
    if (!host && qlshim_set_devices) qlshim_set_devices(was);
}
