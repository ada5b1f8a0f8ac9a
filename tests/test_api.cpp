// Type traits, contexts, and bad input: every error names the op, the shapes and file:line.
#define QL_INTERNALS  // ql_backend_i (a backend that refuses ops), ql_cpu_threads_for, ql_graph_fail_nonfinite
#include "tiny.h"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <thread>

static bool has(const char *hay, const char *needle) { return strstr(hay, needle) != nullptr; }
static bool has_file_line(const char *msg) {  // "qlora.cpp:123: ..."
    const char *p = strstr(msg, ".cpp:");
    return p && p[5] >= '0' && p[5] <= '9';
}

TEST_CASE("type traits table") {
    CHECK(std::string(ql_type_name(QL_TYPE_F32)) == "f32");
    CHECK(std::string(ql_type_name(QL_TYPE_BF16)) == "bf16");
    CHECK(ql_type_traits_get(QL_TYPE_F16)->type_size == 2);
    CHECK(ql_type_traits_get(QL_TYPE_I32)->is_float == false);
    CHECK(ql_type_traits_get((ql_type)16) == nullptr);  // a gap in the ids (iq2_xxs: not read)
    CHECK(ql_type_traits_get((ql_type)-1) == nullptr);
    CHECK(ql_type_traits_get(QL_TYPE_COUNT) == nullptr);
    CHECK(ql_row_size(QL_TYPE_F16, 7) == 14);
}

TEST_CASE("fp16 / bf16 conversions round to nearest even; bulk == scalar") {
    CHECK(ql_fp32_to_fp16(1.0f) == 0x3c00);
    CHECK(ql_fp32_to_fp16(-2.0f) == 0xc000);
    CHECK(ql_fp32_to_fp16(65504.0f) == 0x7bff);
    CHECK(ql_fp32_to_fp16(65520.0f) == 0x7c00);                   // rounds up to inf
    CHECK(ql_fp32_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);      // smallest subnormal
    CHECK(ql_fp32_to_fp16(std::ldexp(1.0f, -26)) == 0x0000);      // below half of it
    CHECK(ql_fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie -> even
    CHECK(ql_fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie -> even (up)
    CHECK(std::isnan(ql_fp16_to_fp32(ql_fp32_to_fp16(NAN))));
    CHECK(ql_fp32_to_bf16(1.0f) == 0x3f80);
    CHECK(ql_fp32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
    CHECK(ql_fp32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
    CHECK(std::isnan(ql_bf16_to_fp32(ql_fp32_to_bf16(NAN))));

    // every half: bulk (F16C where compiled in) agrees with the portable scalar code, and
    // half -> float -> half is the identity for non-NaN values
    std::vector<uint16_t> h(65536);
    for (int i = 0; i < 65536; i++) h[(size_t)i] = (uint16_t)i;
    std::vector<float> f(65536);
    ql_type_traits_get(QL_TYPE_F16)->to_float(h.data(), f.data(), 65536);
    std::vector<uint16_t> back(65536);
    ql_type_traits_get(QL_TYPE_F16)->from_float(f.data(), back.data(), 65536);
    int bad = 0;
    for (int i = 0; i < 65536; i++) {
        const float s = ql_fp16_to_fp32((uint16_t)i);
        if (std::isnan(s)) continue;
        bad += memcmp(&s, &f[(size_t)i], 4) != 0 || back[(size_t)i] != (uint16_t)i;
    }
    CHECK(bad == 0);
    std::mt19937 rng(3);
    std::vector<float> r(4099);
    for (float &x : r) x = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng), (int)(rng() % 40) - 28);
    std::vector<uint16_t> bulk(r.size());
    ql_type_traits_get(QL_TYPE_F16)->from_float(r.data(), bulk.data(), (int64_t)r.size());
    bad = 0;
    for (size_t i = 0; i < r.size(); i++) bad += bulk[i] != ql_fp32_to_fp16(r[i]);
    CHECK(bad == 0);
    // bf16 likewise (AVX-512 where compiled in): random bits (nan, inf, subnormals) and ties
    std::vector<float> q(4099);
    for (size_t i = 0; i < q.size(); i++) {
        uint32_t u = (uint32_t)rng();
        if (i % 3 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exactly half way
        memcpy(&q[i], &u, 4);
    }
    ql_type_traits_get(QL_TYPE_BF16)->from_float(q.data(), bulk.data(), (int64_t)q.size());
    bad = 0;
    for (size_t i = 0; i < q.size(); i++) bad += bulk[i] != ql_fp32_to_bf16(q[i]);
    CHECK(bad == 0);
}

TEST_CASE("context arena: exhaustion is an error with a hint, never a crash") {
    ql_init_params ip = {4 * ql_tensor_overhead() + 256, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_new_tensor_1d(ctx, QL_TYPE_F32, 16);
    REQUIRE(a);
    ql_tensor *b = ql_new_tensor_2d(ctx, QL_TYPE_F32, 1000, 1000);
    CHECK(b == nullptr);
    CHECK(ql_ctx_status(ctx) == QL_ERR_NOMEM);
    CHECK(has(ql_ctx_error(ctx), "arena exhausted"));
    CHECK(has(ql_ctx_error(ctx), "hint"));
    CHECK(has(ql_ctx_error(ctx), "[1000, 1000] f32"));
    CHECK(has_file_line(ql_ctx_error(ctx)));
    CHECK(ql_add(ctx, a, b) == nullptr);  // the chain fails quietly, the first message stays
    CHECK(has(ql_ctx_error(ctx), "arena exhausted"));
    ql_free(ctx);

    ql_init_params mp = {0, nullptr, false, true};
    ql_context *m = ql_init(mp);
    CHECK(ql_new_tensor_2d(m, QL_TYPE_F32, 1000, 1000) != nullptr);  // measuring: never full
    CHECK(ql_used_mem(m) == ql_tensor_overhead() + 4000000);
    ql_free(m);
}

TEST_CASE("bad shapes and types are reported with op, shapes and file:line") {
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 4), "x");
    ql_tensor *i = ql_new_tensor_1d(ctx, QL_TYPE_I32, 4);
    struct bad_case {
        const char *what;
        std::function<ql_tensor *()> make;
        ql_status status;
    };
    const std::vector<bad_case> cases = {
        {"view", [&] { return ql_view_2d(ctx, x, 8, 5, x->nb[1], 0); }, QL_ERR_SHAPE},
        {"reshape", [&] { return ql_reshape_2d(ctx, x, 5, 7); }, QL_ERR_SHAPE},
        {"reshape", [&] { return ql_reshape_1d(ctx, ql_transpose(ctx, x), 32); }, QL_ERR_SHAPE},
        {"permute", [&] { return ql_permute(ctx, x, 0, 0, 1, 2); }, QL_ERR_INVALID},
        {"mul_mat", [&] { return ql_mul_mat(ctx, x, i); }, QL_ERR_SHAPE},
        {"get_rows", [&] { return ql_get_rows(ctx, x, x); }, QL_ERR_TYPE},
        {"rms_norm", [&] { return ql_rms_norm(ctx, i, 1e-5f); }, QL_ERR_TYPE},
        {"scale", [&] { return ql_scale_to(ctx, x, 2.0f, QL_TYPE_Q8_0); }, QL_ERR_TYPE},
        {"rope", [&] { return ql_rope(ctx, ql_reshape_4d(ctx, x, 4, 2, 4, 1), i, nullptr, 3, 0, 1e4f); }, QL_ERR_INVALID},
        {"rope", [&] { return ql_rope(ctx, ql_reshape_4d(ctx, x, 4, 2, 2, 2), i, nullptr, 4, 0, 1e4f); }, QL_ERR_SHAPE},
        {"flash_attn", [&] { return ql_flash_attn(ctx, ql_reshape_4d(ctx, x, 4, 4, 2, 1), ql_reshape_4d(ctx, x, 4, 2, 4, 1), ql_reshape_4d(ctx, x, 4, 2, 4, 1), nullptr, 1.0f); }, QL_ERR_SHAPE},
        {"cross_entropy", [&] { return ql_cross_entropy(ctx, x, ql_new_tensor_1d(ctx, QL_TYPE_I32, 3), ql_new_tensor_1d(ctx, QL_TYPE_F32, 1)); }, QL_ERR_SHAPE},
        {"dropout", [&] { return ql_dropout(ctx, x, 1.0f, i, 0); }, QL_ERR_INVALID},
        {"swiglu", [&] { return ql_swiglu(ctx, x, ql_transpose(ctx, x)); }, QL_ERR_SHAPE},
        {"cont", [&] { return ql_cast(ctx, i, QL_TYPE_F32); }, QL_ERR_TYPE},
        {"fill", [&] { const int64_t ne[1] = {3}; return ql_fill(ctx, QL_TYPE_I32, 1, ne, 0.0f); }, QL_ERR_TYPE},
    };
    for (const bad_case &c : cases) {
        const std::string what = c.what;
        CAPTURE(what);
        ql_ctx_clear_error(ctx);
        CHECK(c.make() == nullptr);
        CHECK(ql_ctx_status(ctx) == c.status);
        CHECK(has(ql_ctx_error(ctx), c.what));
        CHECK(has_file_line(ql_ctx_error(ctx)));
    }
    ql_free(ctx);
}

TEST_CASE("autodiff: frozen leafs get no gradient buffer; gradients accumulate across runs") {
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 5), "frozen");
    ql_tensor *a = ql_set_param(ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 3), "trainable"));
    ql_tensor *x = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 4));
    for (ql_tensor *t : {w, a, x})
        for (int64_t i = 0; i < ql_nelements(t); i++) ql_set_f32_1d(t, i, 0.1f * (float)((i * 7) % 11) - 0.5f);
    // loss = sum((W x)^2) + sum((A x)^2): only A is trainable
    ql_tensor *y1 = ql_mul_mat(ctx, w, x), *y2 = ql_mul_mat(ctx, a, x);
    ql_tensor *loss = ql_add(ctx, ql_sum(ctx, ql_mul(ctx, y1, y1)), ql_sum(ctx, ql_mul(ctx, y2, y2)));
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
    CHECK(w->grad == nullptr);
    REQUIRE(a->grad != nullptr);
    CHECK(ql_graph_n_params(gb) == 1);
    for (int i = 0; i < ql_graph_n_nodes(gb); i++)  // no matmul produces a [7, 5] gradient for W
        CHECK(!(ql_graph_node(gb, i)->op == QL_OP_MUL_MAT && ql_same_shape(ql_graph_node(gb, i), w)));
    ql_backend *be = ql_backend_cpu_init(2);
    ql_plan_stats st;
    REQUIRE(ql_graph_plan(gb, be, &st) == QL_OK);
    CHECK(st.bytes[QL_MEM_GRADS] == 128);  // 7 x 3 floats, aligned: the only gradient buffer
    CHECK(st.bytes[QL_MEM_WEIGHTS] == 192);
    REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
    ql_graph_zero_grads(gb);
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
    std::vector<float> once((const float *)a->grad->data, (const float *)a->grad->data + 21);
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);  // no zeroing: the second run adds
    for (int i = 0; i < 21; i++) CHECK(((const float *)a->grad->data)[i] == 2 * once[(size_t)i]);
    // dL/dA = 2 (A x) x^T, checked directly
    for (int r = 0; r < 3; r++)
        for (int k = 0; k < 7; k++) {
            double g = 0;
            for (int n = 0; n < 4; n++) {
                double ax = 0;
                for (int j = 0; j < 7; j++) ax += (double)ql_get_f32_1d(a, r * 7 + j) * ql_get_f32_1d(x, n * 7 + j);
                g += 2 * ax * ql_get_f32_1d(x, n * 7 + k);
            }
            CHECK(once[(size_t)(r * 7 + k)] == doctest::Approx(g).epsilon(1e-5));
        }
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("autodiff refuses what it cannot do") {
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 4));
    ql_tensor *h = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F16, 8, 4));
    ql_graph *g = ql_graph_new(ctx);
    ql_tensor *y = ql_silu(ctx, x);
    ql_graph_build_forward(g, y);
    CHECK(ql_graph_backward(ctx, g, y) == nullptr);  // not a scalar
    CHECK(has(ql_ctx_error(ctx), "single f32"));
    ql_ctx_clear_error(ctx);
    ql_tensor *other = ql_sum(ctx, x);
    CHECK(ql_graph_backward(ctx, g, other) == nullptr);  // not in the graph
    CHECK(has(ql_ctx_error(ctx), "not in the forward graph"));
    ql_ctx_clear_error(ctx);
    ql_graph *g2 = ql_graph_new(ctx);
    ql_tensor *l2 = ql_sum(ctx, ql_cast(ctx, h, QL_TYPE_F32));
    ql_graph_build_forward(g2, l2);
    CHECK(ql_graph_backward(ctx, g2, l2) == nullptr);  // f16 params: master weights are f32
    CHECK(ql_ctx_status(ctx) == QL_ERR_TYPE);
    ql_graph_free(g);
    ql_graph_free(g2);
    ql_free(ctx);
}

// A backend that claims no matrix multiply: the plan must name it, the op and the shapes.
static bool picky_supports(ql_backend *, const ql_tensor *n) { return n->op != QL_OP_MUL_MAT; }

TEST_CASE("plan: an op the backend lacks is named; compute needs a plan; bad ids are runtime errors") {
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *emb = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, 6, 10), "emb");
    ql_tensor *ids = ql_new_tensor_1d(ctx, QL_TYPE_I32, 3);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_F32, 6, 5);
    ql_tensor_fill_f32(emb, 0.5f);
    ql_tensor_fill_f32(w, 0.25f);
    ql_tensor *y = ql_mul_mat(ctx, w, ql_get_rows(ctx, emb, ids));
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, y);

    ql_backend *cpu = ql_backend_cpu_init(2);
    ql_backend picky = *cpu;
    picky.iface.name = "picky";
    picky.iface.supports_op = picky_supports;
    CHECK(ql_graph_plan(g, &picky, nullptr) == QL_ERR_UNSUPPORTED);
    CHECK(has(ql_ctx_error(ctx), "picky"));
    CHECK(has(ql_ctx_error(ctx), "mul_mat"));
    CHECK(has(ql_ctx_error(ctx), "[6, 5] f32"));
    ql_ctx_clear_error(ctx);

    CHECK(ql_backend_graph_compute(cpu, g) == QL_ERR_INVALID);  // not allocated
    CHECK(has(ql_ctx_error(ctx), "ql_graph_alloc"));
    ql_ctx_clear_error(ctx);

    REQUIRE(ql_graph_plan(g, cpu, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(g, cpu) == QL_OK);
    int32_t *id = (int32_t *)ids->data;
    id[0] = 1, id[1] = 9, id[2] = 3;
    REQUIRE(ql_backend_graph_compute(cpu, g) == QL_OK);
    CHECK(ql_get_f32_1d(y, 7) == doctest::Approx(6 * 0.5 * 0.25));
    id[1] = 10;  // out of the table
    CHECK(ql_backend_graph_compute(cpu, g) == QL_ERR_INVALID);
    CHECK(has(ql_ctx_error(ctx), "get_rows: id 10"));
    ql_ctx_clear_error(ctx);
    id[1] = 9;
    REQUIRE(ql_graph_plan(g, cpu, nullptr) == QL_OK);  // a new plan: pointers must be bound again
    CHECK(ql_backend_graph_compute(cpu, g) == QL_ERR_INVALID);
    ql_ctx_clear_error(ctx);
    REQUIRE(ql_graph_alloc(g, cpu) == QL_OK);
    CHECK(ql_backend_graph_compute(cpu, g) == QL_OK);
    ql_graph_free(g);
    ql_backend_free(cpu);
    ql_free(ctx);
}

TEST_CASE("compute_range: a graph in two parts equals one run; bad ranges and a graph without a buffer are refused") {
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 3));  // [7, 3]
    ql_tensor *x = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 4));  // [7, 4]
    for (ql_tensor *t : {a, x})
        for (int64_t i = 0; i < ql_nelements(t); i++) ql_set_f32_1d(t, i, 0.1f * (float)((i * 7) % 11) - 0.5f);
    ql_tensor *y = ql_mul_mat(ctx, a, x);  // [3, 4]
    ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, y, y));
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
    const int n = ql_graph_n_nodes(gb), nf = ql_graph_n_forward(gb);
    REQUIRE(0 < nf);
    REQUIRE(nf < n);
    ql_backend *be = ql_backend_cpu_init(2);
    CHECK(ql_backend_graph_compute_range(be, gb, 0, nf) == QL_ERR_INVALID);  // no buffer yet
    CHECK(has(ql_ctx_error(ctx), "ql_graph_alloc"));
    ql_ctx_clear_error(ctx);
    REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
    const int bad[3][2] = {{-1, nf}, {nf, nf - 1}, {0, n + 1}};
    for (const auto &r : bad) {
        CHECK(ql_backend_graph_compute_range(be, gb, r[0], r[1]) == QL_ERR_INVALID);
        CHECK(has(ql_ctx_error(ctx), "compute_range: nodes ["));
        ql_ctx_clear_error(ctx);
    }
    ql_graph_zero_grads(gb);
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
    const std::vector<float> whole((const float *)a->grad->data, (const float *)a->grad->data + 21);
    const float whole_loss = ql_get_f32_1d(loss, 0);
    ql_graph_zero_grads(gb);
    ql_set_f32_1d(loss, 0, 0.0f);
    REQUIRE(ql_backend_graph_compute_range(be, gb, 0, nf) == QL_OK);  // the forward part alone
    CHECK(ql_get_f32_1d(loss, 0) == whole_loss);
    for (int i = 0; i < 21; i++) CHECK(((const float *)a->grad->data)[i] == 0.0f);
    REQUIRE(ql_backend_graph_compute_range(be, gb, nf, -1) == QL_OK);  // then the rest
    for (int i = 0; i < 21; i++) CHECK(((const float *)a->grad->data)[i] == whole[(size_t)i]);
    ql_graph_zero_grads(gb);
    REQUIRE(ql_backend_graph_compute_range(be, gb, 0, -1) == QL_OK);  // the whole range: one run
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);              // and a whole run after it adds
    for (int i = 0; i < 21; i++) CHECK(((const float *)a->grad->data)[i] == 2 * whole[(size_t)i]);
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("cross entropy: a target outside the vocabulary and a zero count are runtime errors") {
    tiny_model tm(8, 1, 7, 1);
    ql_backend *be = ql_backend_cpu_init(1);
    REQUIRE(ql_graph_plan(tm.gb, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    ((int32_t *)tm.targets->data)[3] = 7;
    CHECK(ql_backend_graph_compute(be, tm.gb) == QL_ERR_INVALID);
    CHECK(has(ql_ctx_error(tm.ctx), "target 7 at row 3"));
    ql_ctx_clear_error(tm.ctx);
    tm.fill_inputs(1);
    *(float *)tm.count->data = 0;
    CHECK(ql_backend_graph_compute(be, tm.gb) == QL_ERR_INVALID);
    CHECK(has(ql_ctx_error(tm.ctx), "count"));
    ql_backend_free(be);
}

// ---- regressions from the first review (each of these failed before its fix) ----

TEST_CASE("a kernel error in a later node stops every thread (no hang), repeatedly") {
    tiny_model tm(8, 1, 7, 1);
    ql_backend *be = ql_backend_cpu_init(3);
    REQUIRE(ql_graph_plan(tm.gb, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    for (int rep = 0; rep < 50; rep++) {  // the error is raised in cross-entropy, far from node 0
        ((int32_t *)tm.targets->data)[5] = 99;
        CHECK(ql_backend_graph_compute(be, tm.gb) == QL_ERR_INVALID);
        ql_ctx_clear_error(tm.ctx);
        tm.fill_inputs(1);
        CHECK(ql_backend_graph_compute(be, tm.gb) == QL_OK);
    }
    ql_backend_free(be);
}

TEST_CASE("a new backend at a freed one's address does not inherit its plan") {
    tiny_model tm(24, 2, 13, 3);
    float ref = 0;
    size_t work1 = 0;
    for (int n : {1, 2, 4, 3, 1}) {
        ql_backend *be = ql_backend_cpu_init(n);  // typically the same address every time
        REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
        ql_plan_stats st;
        REQUIRE(ql_graph_get_stats(tm.gb, &st) == QL_OK);
        if (n == 1) work1 = st.bytes[QL_MEM_WORK];
        // the workspace follows the thread count: a fresh graph's on this backend (a matmul's
        // slices are its share of the columns, so not n times one thread's)
        tiny_model fresh(24, 2, 13, 3);
        REQUIRE(ql_graph_alloc(fresh.gb, be) == QL_OK);
        ql_plan_stats fs;
        REQUIRE(ql_graph_get_stats(fresh.gb, &fs) == QL_OK);
        CHECK(st.bytes[QL_MEM_WORK] == fs.bytes[QL_MEM_WORK]);
        CHECK((n == 1 || st.bytes[QL_MEM_WORK] > work1));
        ql_graph_zero_grads(tm.gb);
        REQUIRE(ql_backend_graph_compute(be, tm.gb) == QL_OK);
        const float l = *(const float *)tm.loss->data;
        if (n == 1 && ref == 0) ref = l;
        CHECK(l == ref);
        ql_backend_free(be);
    }
}

TEST_CASE("graphs sharing tensors: each run binds its own buffer") {
    tiny_model tm(24, 2, 13, 3);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    ql_graph_zero_grads(tm.gb);
    REQUIRE(ql_backend_graph_compute(be, tm.gb) == QL_OK);
    ql_tensor *p0 = ql_graph_param(tm.gb, 3);
    const std::vector<float> ref((const float *)p0->grad->data, (const float *)p0->grad->data + ql_nelements(p0));

    REQUIRE(ql_graph_alloc(tm.gf, be) == QL_OK);  // the forward graph shares gb's forward nodes
    REQUIRE(ql_backend_graph_compute(be, tm.gf) == QL_OK);
    ql_graph_free(tm.gf);  // its buffer is gone: gb must not read it
    tm.gf = nullptr;
    ql_graph_zero_grads(tm.gb);
    REQUIRE(ql_backend_graph_compute(be, tm.gb) == QL_OK);
    CHECK(memcmp(ref.data(), p0->grad->data, ref.size() * 4) == 0);
    ql_backend_free(be);
}

TEST_CASE("get_rows takes contiguous ids and a table with dense rows; cont copies i32 views") {
    ql_init_params ip = {4u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, 5, 11);
    ql_tensor *ids = ql_new_tensor_2d(ctx, QL_TYPE_I32, 8, 3);
    for (int i = 0; i < 24; i++) ((int32_t *)ids->data)[i] = (i * 7) % 11;
    ql_tensor *strided = ql_view_2d(ctx, ids, 4, 3, 8 * 4, 0);
    CHECK(ql_get_rows(ctx, a, strided) == nullptr);
    CHECK(has(ql_ctx_error(ctx), "ids"));
    CHECK(has(ql_ctx_error(ctx), "contiguous"));
    ql_ctx_clear_error(ctx);
    CHECK(ql_get_rows(ctx, ql_transpose(ctx, a), ids) == nullptr);
    CHECK(has(ql_ctx_error(ctx), "dense rows"));
    ql_ctx_clear_error(ctx);
    // the hinted fix works, for a strided and for a transposed i32 view
    ql_tensor *c1 = ql_set_output(ql_cont(ctx, strided));
    ql_tensor *c2 = ql_set_output(ql_cont(ctx, ql_transpose(ctx, ids)));
    ql_tensor *y = ql_set_output(ql_get_rows(ctx, a, c1));
    REQUIRE(y);
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, y);
    ql_graph_build_forward(g, c2);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 4; c++) CHECK(((int32_t *)c1->data)[r * 4 + c] == ((int32_t *)ids->data)[r * 8 + c]);
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 3; c++) CHECK(((int32_t *)c2->data)[r * 3 + c] == ((int32_t *)ids->data)[c * 8 + r]);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("gradient through a view whose rows overlap (4 threads)") {
    ql_init_params ip = {4u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    const int64_t ne0 = 1000, ne1 = 64, stride = 50, n = stride * (ne1 - 1) + ne0;  // row i starts at 50 i: rows overlap
    ql_tensor *x = ql_set_param(ql_new_tensor_1d(ctx, QL_TYPE_F32, n));
    ql_tensor *r = ql_new_tensor_2d(ctx, QL_TYPE_F32, ne0, ne1);
    for (int64_t i = 0; i < n; i++) ((float *)x->data)[i] = 1.0f;
    for (int64_t i = 0; i < ne0 * ne1; i++) ((float *)r->data)[i] = (float)(i % 7) - 3.0f;
    ql_tensor *v = ql_view_2d(ctx, x, ne0, ne1, stride * 4, 0);
    ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, ql_cont(ctx, v), r));
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    ql_backend *be = ql_backend_cpu_init(4);
    REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
    std::vector<double> want((size_t)n, 0.0);
    for (int64_t i1 = 0; i1 < ne1; i1++)
        for (int64_t i0 = 0; i0 < ne0; i0++) want[(size_t)(i1 * stride + i0)] += ((float *)r->data)[i1 * ne0 + i0];
    for (int rep = 0; rep < 20; rep++) {
        ql_graph_zero_grads(gb);
        REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) bad += ((float *)x->grad->data)[i] != (float)want[(size_t)i];
        CHECK(bad == 0);
    }
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("a second backward over the same params counts their gradient buffers") {
    tiny_model tm(8, 1, 7, 1);
    ql_graph *again = ql_graph_backward(tm.ctx, tm.gf, tm.loss);  // reuses every param->grad
    REQUIRE(again);
    ql_backend *be = ql_backend_cpu_init(1);
    ql_plan_stats a, b;
    REQUIRE(ql_graph_plan(tm.gb, be, &a) == QL_OK);
    REQUIRE(ql_graph_plan(again, be, &b) == QL_OK);
    CHECK(b.bytes[QL_MEM_GRADS] == a.bytes[QL_MEM_GRADS]);
    CHECK(b.bytes[QL_MEM_GRADS] > 0);
    ql_graph_free(again);
    ql_backend_free(be);
}

TEST_CASE("shapes whose byte size overflows are refused") {
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    CHECK(ql_new_tensor_2d(ctx, QL_TYPE_F32, (int64_t)1 << 32, (int64_t)1 << 32) == nullptr);
    CHECK(ql_ctx_status(ctx) == QL_ERR_SHAPE);
    CHECK(has(ql_ctx_error(ctx), "too large"));
    ql_free(ctx);
}

TEST_CASE("CPU threads: the default leaves the cores other work is using; -t above the cores warns") {
    // the rule: physical cores less the tasks already running, at least one
    CHECK(ql_cpu_threads_for(2, 0) == 2);
    CHECK(ql_cpu_threads_for(2, 1) == 1);  // one busy loop on a 2-core machine: 1 thread
    CHECK(ql_cpu_threads_for(2, 5) == 1);
    CHECK(ql_cpu_threads_for(16, 3) == 13);
    CHECK(ql_cpu_threads_for(4, -1) == 4);
    const int cores = ql_cpu_physical_cores();
    CHECK(cores >= 1);
    CHECK(cores <= (int)std::max(1u, std::thread::hardware_concurrency()));
    const int d = ql_cpu_default_threads();
    CHECK(d >= 1);
    CHECK(d <= cores);
    ql_backend *be = ql_backend_cpu_init(0);
    CHECK(ql_backend_cpu_n_threads(be) >= 1);
    CHECK(ql_backend_cpu_n_threads(be) <= cores);
    ql_backend_free(be);
}

TEST_CASE("backend as a value: --device parsed once, and what a backend answers (caps, memory)") {
    char err[256];
    ql_device d = {QL_DEVICE_CPU, 7};
    CHECK(ql_device_parse("cpu", &d, err, sizeof(err)) == QL_OK);
    CHECK((d.kind == QL_DEVICE_CPU && d.index == 0));
    CHECK(ql_device_parse("auto", &d, err, sizeof(err)) == QL_OK);
    CHECK(d.kind == QL_DEVICE_AUTO);
    CHECK(ql_device_parse("cuda", &d, err, sizeof(err)) == QL_OK);
    CHECK((d.kind == QL_DEVICE_GPU && d.index == 0));
    CHECK(ql_device_parse("cuda:3", &d, err, sizeof(err)) == QL_OK);
    CHECK((d.kind == QL_DEVICE_GPU && d.index == 3));
    for (const char *bad : {"tpu", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda:1x", "CPU", "", "cuda:99999"}) {
        CAPTURE(bad);
        d = {QL_DEVICE_AUTO, 5};
        CHECK(ql_device_parse(bad, &d, err, sizeof(err)) == QL_ERR_INVALID);
        CHECK(has(err, "is not a device (cpu, cuda, cuda:N, auto)"));
        CHECK((d.kind == QL_DEVICE_AUTO && d.index == 5));  // untouched
    }
    CHECK(ql_device_parse(nullptr, &d, nullptr, 0) == QL_ERR_INVALID);

    // the CPU: host memory, bf16 as its kernels have it, no device memory to track
    ql_backend *cpu = ql_backend_init_device({QL_DEVICE_CPU, 0}, 1, err, sizeof(err));
    REQUIRE_MESSAGE(cpu, err);
    ql_backend_caps c;
    REQUIRE(ql_backend_get_caps(cpu, &c) == QL_OK);
    CHECK(c.host);
    CHECK(!c.plan_only);
    CHECK(std::string(c.name) == "cpu");
    CHECK(c.bf16_gemm == ql_cpu_bf16_native());
    CHECK((c.cc == 0 && c.mem_total == 0 && c.context_bytes == 0 && c.alloc_granularity == 1 && c.graph_launch_bytes == 0));
    size_t in_use = 1, peak = 1;
    CHECK(!ql_backend_memory_used(cpu, &in_use, &peak));
    CHECK((in_use == 0 && peak == 0));
    CHECK(ql_backend_init_planned({QL_DEVICE_CPU, 0}, 80, err, sizeof(err)) == nullptr);  // the CPU is here
    CHECK(has(err, "needs no stand-in"));
    CHECK(ql_backend_get_caps(nullptr, &c) == QL_ERR_INVALID);
    CHECK(ql_backend_get_caps(cpu, nullptr) == QL_ERR_INVALID);
    ql_backend_free(cpu);

    // a stand-in for a card that is not here answers as that card would: its cc, bf16 from 8.0,
    // the context an estimate except where measured (9.0), 2 MiB pages; no memory of its own
    for (int cc : {75, 86, 90, 120}) {
        CAPTURE(cc);
        ql_backend *p = ql_backend_init_planned({QL_DEVICE_GPU, 0}, cc, err, sizeof(err));
        REQUIRE_MESSAGE(p, err);
        REQUIRE(ql_backend_get_caps(p, &c) == QL_OK);
        CHECK((!c.host && c.plan_only && c.cc == cc));
        CHECK(c.bf16_gemm == (cc >= 80));
        CHECK(c.context_estimated == (cc != 90));
        CHECK(c.context_bytes == ql_cuda_context_bytes(cc));
        CHECK(c.context_bytes > 0);
        CHECK(c.graph_launch_bytes == ql_cuda_graph_launch_bytes());
        CHECK(c.graph_launch_bytes > 0);
        CHECK(c.alloc_granularity == (size_t)2 << 20);
        CHECK(c.mem_total == 0);
        CHECK(has(c.name, ("compute capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10)).c_str()));
        CHECK(!ql_backend_memory_used(p, &in_use, &peak));
        ql_backend_free(p);
    }
    // a build or machine without the GPU: the device named is refused, by reason
    if (ql_cuda_device_count() == 0) {
        CHECK(ql_backend_init_device({QL_DEVICE_GPU, 0}, 1, err, sizeof(err)) == nullptr);
        CHECK(strlen(err) > 0);
        ql_backend *a = ql_backend_init_device({QL_DEVICE_AUTO, 0}, 1, err, sizeof(err));  // auto: the CPU
        REQUIRE(a);
        CHECK(ql_backend_is_host(a));
        ql_backend_free(a);
    }
}

TEST_CASE("API edge: sizes that would wrap, a plan-only backend, NULL graphs, bad quantize arguments - errors, not crashes") {
    // sizes within the alignment of SIZE_MAX rounded up to 0 bytes: a tiny block for a huge arena
    ql_init_params p = {SIZE_MAX, nullptr, false, false};
    CHECK(ql_init(p) == nullptr);
    ql_backend *cpu = ql_backend_cpu_init(1);
    REQUIRE(cpu);
    CHECK(ql_backend_buffer_alloc(cpu, QL_BUFFER_DEVICE, SIZE_MAX) == nullptr);
    CHECK(ql_backend_buffer_alloc(cpu, QL_BUFFER_HOST_PINNED, SIZE_MAX - 1) == nullptr);

    // a plan-only backend (the device plan of a card that is not here) holds no memory: its copies,
    // buffers and graph allocation are refused (they called through NULL function pointers)
    ql_backend *plan = ql_backend_init_planned({QL_DEVICE_GPU, 0}, 90, nullptr, 0);
    REQUIRE(plan);
    ql_init_params ip = {1 << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_set_param(ql_new_tensor_1d(ctx, QL_TYPE_F32, 16));
    float h[16] = {0};
    CHECK(ql_backend_tensor_set(plan, a, h, 0, sizeof(h)) == QL_ERR_UNSUPPORTED);
    CHECK(ql_backend_tensor_get(plan, a, h, 0, sizeof(h)) == QL_ERR_UNSUPPORTED);
    CHECK(ql_backend_tensor_memset(plan, a, 0, 0, sizeof(h)) == QL_ERR_UNSUPPORTED);
    CHECK(ql_backend_synchronize(plan) == QL_ERR_UNSUPPORTED);
    CHECK(ql_backend_buffer_alloc(plan, QL_BUFFER_DEVICE, 64) == nullptr);
    CHECK(ql_backend_place_ctx_tensors(plan, ctx) == nullptr);
    CHECK(has(ql_ctx_error(ctx), "only plans (it holds no memory)"));
    ql_ctx_clear_error(ctx);
    ql_graph *gf = ql_graph_new(ctx);
    ql_tensor *l = ql_sum(ctx, ql_mul(ctx, a, a));
    ql_graph_build_forward(gf, l);
    ql_graph *g = ql_graph_backward(ctx, gf, l);
    CHECK(ql_graph_plan(g, plan, nullptr) == QL_OK);  // planning is what it is for
    CHECK(ql_graph_alloc(g, plan) == QL_ERR_UNSUPPORTED);
    ql_ctx_clear_error(ctx);
    CHECK(ql_backend_graph_zero_grads(plan, g) == QL_ERR_UNSUPPORTED);
    ql_keep bad[1] = {(ql_keep)9999};
    ql_graph *gf2 = ql_graph_new(ctx);
    ql_tensor *l2 = ql_sum(ctx, ql_scale(ctx, a, 2.0f));
    ql_graph_build_forward(gf2, l2);
    ql_graph *g2 = ql_graph_backward(ctx, gf2, l2);
    CHECK(ql_graph_recompute(g2, bad, 1, nullptr) == QL_ERR_INVALID);
    CHECK(has(ql_ctx_error(ctx), "is not a ql_keep"));
    ql_ctx_clear_error(ctx);

    // optimizer helpers on tensors without memory
    ql_init_params na = {1 << 20, nullptr, true, false};  // no_alloc: data stays NULL
    ql_context *cn = ql_init(na);
    ql_tensor *w = ql_set_param(ql_new_tensor_1d(cn, QL_TYPE_F32, 8)), *m = ql_new_tensor_1d(cn, QL_TYPE_F32, 8),
              *v = ql_new_tensor_1d(cn, QL_TYPE_F32, 8);
    ql_graph *gn = ql_graph_new(cn);
    ql_tensor *ln = ql_sum(cn, ql_mul(cn, w, w));
    ql_graph_build_forward(gn, ln);
    ql_graph *gbn = ql_graph_backward(cn, gn, ln);
    const ql_adamw_params op = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    double sq = 0;
    bool fin = true;
    CHECK(ql_backend_grad_stats(cpu, w->grad, &sq, &fin) == QL_ERR_INVALID);
    CHECK(ql_backend_adamw_update(cpu, w, m, v, nullptr, nullptr, 1, &op, 1.0f) == QL_ERR_INVALID);
    CHECK(ql_backend_adamw_update(cpu, a, a, a, nullptr, nullptr, 0, &op, 1.0f) == QL_ERR_INVALID);  // step 0

    // NULL graphs read as empty ones
    CHECK(ql_graph_n_nodes(nullptr) == 0);
    CHECK(ql_graph_node(nullptr, 0) == nullptr);
    CHECK(ql_graph_n_params(nullptr) == 0);
    CHECK(ql_graph_plan_entries(nullptr, nullptr) == 0);
    ql_graph_zero_grads(nullptr);
    ql_graph_set_profile(nullptr, true);
    ql_graph_fail_nonfinite(g, -1, 0, true);  // (an index outside the graph: nothing to name)

    // quantize / dequantize: NULL buffers, row counts whose size overflows, NF4 side data whose
    // header does not locate this tensor's codes
    std::vector<float> src(64, 0.5f), out(64);
    std::vector<uint8_t> q(ql_row_size(QL_TYPE_NF4, 64) + 4096);
    char err[128];
    CHECK(ql_quantize(QL_TYPE_Q8_0, nullptr, 1, 32, q.data(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(ql_quantize(QL_TYPE_Q8_0, src.data(), 1, 32, nullptr, err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(ql_quantize(QL_TYPE_Q8_0, src.data(), INT64_MAX / 16, 32, q.data(), err, sizeof(err)) == QL_ERR_SHAPE);
    CHECK(ql_dequantize(QL_TYPE_Q8_0, nullptr, 1, 32, out.data()) == QL_ERR_INVALID);
    CHECK(ql_dequantize(QL_TYPE_Q8_0, q.data(), -1, 32, out.data()) == QL_ERR_INVALID);
    REQUIRE(ql_quantize(QL_TYPE_NF4, src.data(), 1, 64, q.data(), err, sizeof(err)) == QL_OK);
    REQUIRE(ql_dequantize(QL_TYPE_NF4, q.data(), 1, 64, out.data()) == QL_OK);
    CHECK(out[0] == doctest::Approx(0.5f).epsilon(0.05));
    const uint32_t lie = 0x10000000;  // a block count not this tensor's: the codes would be read far away
    memcpy(q.data() + ql_aux_offset(ql_row_size(QL_TYPE_NF4, 64)), &lie, 4);
    CHECK(ql_dequantize(QL_TYPE_NF4, q.data(), 1, 64, out.data()) == QL_ERR_INVALID);

    for (ql_graph *x : {g, gf, g2, gf2, gbn, gn}) ql_graph_free(x);
    ql_free(cn);
    ql_free(ctx);
    ql_backend_free(plan);
    ql_backend_free(cpu);
}
