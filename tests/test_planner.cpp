// The static memory planner: no two live tensors share bytes, reuse is real, a planned graph
// computes the same bits as one without reuse, and running it allocates nothing.
#include "tiny.h"

#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>

// Count heap allocations while `g_counting` is set (covers everything that goes through new).
// (g++ 12 takes the replaced delete's free() for a mismatch with new, inlined: it is not one)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
static std::atomic<bool> g_counting{false};
static std::atomic<long> g_allocs{0};
void *operator new(size_t n) {
    if (g_counting.load(std::memory_order_relaxed)) g_allocs++;
    if (void *p = malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}
void *operator new[](size_t n) { return operator new(n); }
void *operator new(size_t n, const std::nothrow_t &) noexcept {
    if (g_counting.load(std::memory_order_relaxed)) g_allocs++;
    return malloc(n ? n : 1);
}
void *operator new[](size_t n, const std::nothrow_t &t) noexcept { return operator new(n, t); }
void operator delete(void *p, const std::nothrow_t &) noexcept { free(p); }
void operator delete[](void *p, const std::nothrow_t &) noexcept { free(p); }
void operator delete(void *p) noexcept { free(p); }
void operator delete[](void *p) noexcept { free(p); }
void operator delete(void *p, size_t) noexcept { free(p); }
void operator delete[](void *p, size_t) noexcept { free(p); }

static void check_no_overlap(const ql_graph *g) {
    const ql_plan_entry *e;
    const int n = ql_graph_plan_entries(g, &e);
    REQUIRE(n > 0);
    long pairs = 0;
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            const bool live_together = e[i].first <= e[j].last && e[j].first <= e[i].last;
            if (!live_together) continue;
            // the one sanctioned sharing: a result written in place over a source dying at that node
            const bool handoff = (e[j].inplace && e[j].first == e[i].last && e[j].offset == e[i].offset) ||
                                 (e[i].inplace && e[i].first == e[j].last && e[i].offset == e[j].offset);
            if (handoff) continue;
            pairs++;
            const bool disjoint = e[i].offset + e[i].size <= e[j].offset || e[j].offset + e[j].size <= e[i].offset;
            if (!disjoint)
                FAIL("tensors ", e[i].tensor->name, " [", e[i].first, ",", e[i].last, "] @", e[i].offset, "+", e[i].size,
                     " and ", e[j].tensor->name, " [", e[j].first, ",", e[j].last, "] @", e[j].offset, "+", e[j].size,
                     " are live together and overlap");
        }
    CHECK(pairs > 0);
}

// loss and every gradient of one run, as raw floats
static std::vector<float> run_once(tiny_model &tm, ql_backend *be) {
    ql_graph_zero_grads(tm.gb);
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, tm.gb) == QL_OK, ql_ctx_error(tm.ctx));
    std::vector<float> out{*(const float *)tm.loss->data};
    for (int i = 0; i < ql_graph_n_params(tm.gb); i++) {
        const ql_tensor *g = ql_graph_param(tm.gb, i)->grad;
        out.insert(out.end(), (const float *)g->data, (const float *)g->data + ql_nelements(g));
    }
    return out;
}

TEST_CASE("planner: live tensors never overlap; reuse beats the sum of sizes") {
    tiny_model tm(40, 3, 19, 5);
    REQUIRE_MESSAGE(tm.gb, ql_ctx_error(tm.ctx));
    ql_backend *be = ql_backend_cpu_init(2);
    ql_plan_stats st;
    REQUIRE_MESSAGE(ql_graph_plan(tm.gb, be, &st) == QL_OK, ql_ctx_error(tm.ctx));
    check_no_overlap(tm.gb);
    const size_t arena = st.bytes[QL_MEM_SAVED] + st.bytes[QL_MEM_SCRATCH];
    MESSAGE("planned ", arena, " bytes for ", st.n_planned, " tensors; without reuse ", st.sum_of_sizes, "; in place ",
            st.n_inplace);
    CHECK(arena < st.sum_of_sizes / 2);
    CHECK(st.n_inplace > 0);

    // categories: params and grads are the model's weights, inputs the four input leafs
    size_t params = 0;
    for (int i = 0; i < ql_graph_n_params(tm.gb); i++) params += (ql_nbytes(ql_graph_param(tm.gb, i)) + 63) / 64 * 64;
    CHECK(st.bytes[QL_MEM_PARAMS] == params);
    CHECK(st.bytes[QL_MEM_GRADS] == params);
    CHECK(st.bytes[QL_MEM_WEIGHTS] == 0);
    CHECK(st.bytes[QL_MEM_INPUTS] == 3 * 512 + 64);  // tokens, pos, targets: 480 bytes each, aligned; count
    CHECK(st.bytes[QL_MEM_SAVED] > 0);
    CHECK(st.total == st.bytes[QL_MEM_PARAMS] * 2 + st.bytes[QL_MEM_INPUTS] + st.buffer_size);
    ql_backend_free(be);
}

TEST_CASE("planner: poisoned planned run == run without reuse, bit for bit; no allocation while computing") {
    tiny_model tm(33, 2, 23, 9);
    REQUIRE_MESSAGE(tm.gb, ql_ctx_error(tm.ctx));
    ql_backend *be = ql_backend_cpu_init(3);

    ql_graph_set_no_reuse(tm.gb, true);
    ql_plan_stats flat;
    REQUIRE(ql_graph_plan(tm.gb, be, &flat) == QL_OK);
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    CHECK(flat.bytes[QL_MEM_SAVED] + flat.bytes[QL_MEM_SCRATCH] == flat.sum_of_sizes);
    const std::vector<float> ref = run_once(tm, be);

    ql_graph_set_no_reuse(tm.gb, false);
    REQUIRE(ql_graph_plan(tm.gb, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    ql_graph_set_poison(tm.gb, true);
    const std::vector<float> got = run_once(tm, be);
    REQUIRE(got.size() == ref.size());
    CHECK(std::isfinite(got[0]));
    CHECK(memcmp(got.data(), ref.data(), got.size() * sizeof(float)) == 0);

    ql_graph_set_poison(tm.gb, false);
    g_allocs = 0;
    g_counting = true;
    ql_graph_zero_grads(tm.gb);
    const ql_status s = ql_backend_graph_compute(be, tm.gb);
    g_counting = false;
    CHECK(s == QL_OK);
    CHECK(g_allocs.load() == 0);
    ql_backend_free(be);
}

TEST_CASE("planner: a forward-only graph saves nothing for backward; frozen weights count as weights") {
    tiny_model tm(16, 1, 11, 3, false, /*train=*/false);
    ql_backend *be = ql_backend_cpu_init(1);
    ql_plan_stats st;
    REQUIRE(ql_graph_plan(tm.gf, be, &st) == QL_OK);
    check_no_overlap(tm.gf);
    CHECK(st.bytes[QL_MEM_SAVED] == 0);
    CHECK(st.bytes[QL_MEM_PARAMS] == 0);
    CHECK(st.bytes[QL_MEM_GRADS] == 0);
    CHECK(st.bytes[QL_MEM_WEIGHTS] > 0);
    REQUIRE(ql_graph_alloc(tm.gf, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, tm.gf) == QL_OK);
    CHECK(std::fabs(*(const float *)tm.loss->data - std::log(11.0f)) < 1.0f);
    ql_backend_free(be);
}

TEST_CASE("measure mode: sizes known before anything is allocated") {
    tiny_model real(24, 2, 13, 1);
    tiny_model meas(24, 2, 13, 1, /*measure=*/true);
    REQUIRE(real.gb);
    REQUIRE(meas.gb);
    CHECK(ql_ctx_is_measure(meas.ctx));
    CHECK(ql_used_mem(meas.ctx) == ql_used_mem(real.ctx));
    CHECK(ql_ctx_data_size(meas.ctx) == ql_ctx_data_size(real.ctx));
    ql_backend *be = ql_backend_cpu_init(2);
    ql_plan_stats a, b;
    REQUIRE(ql_graph_plan(real.gb, be, &a) == QL_OK);
    REQUIRE(ql_graph_plan(meas.gb, be, &b) == QL_OK);
    CHECK(memcmp(&a, &b, sizeof(a)) == 0);
    CHECK(ql_graph_alloc(meas.gb, be) == QL_ERR_INVALID);  // nothing to bind a measured graph to
    CHECK(strstr(ql_ctx_error(meas.ctx), "measuring") != nullptr);
    ql_backend_free(be);
}

TEST_CASE("planner: a graph in another graph's buffer (alloc_shared) computes the same; too big is refused") {
    // host: a chain over [64, 32]; guest: a smaller chain over [16, 8], both from one context
    ql_init_params ip = {4u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 32), *y = ql_new_tensor_2d(ctx, QL_TYPE_F32, 16, 8);
    for (int64_t i = 0; i < ql_nelements(x); i++) ((float *)x->data)[i] = 0.01f * (float)(i % 97) - 0.4f;
    for (int64_t i = 0; i < ql_nelements(y); i++) ((float *)y->data)[i] = 0.03f * (float)(i % 13) - 0.2f;
    ql_tensor *hx = ql_sum(ctx, ql_silu(ctx, ql_scale(ctx, ql_mul(ctx, x, x), 0.5f)));
    ql_tensor *gy = ql_sum(ctx, ql_silu(ctx, ql_add(ctx, y, y)));
    ql_graph *host = ql_graph_new(ctx), *guest = ql_graph_new(ctx);
    ql_graph_build_forward(host, hx);
    ql_graph_build_forward(guest, gy);
    ql_backend *be = ql_backend_cpu_init(2);
    // refused before the host has a buffer, and when the guest is the bigger one
    CHECK(ql_graph_alloc_shared(guest, be, host) == QL_ERR_INVALID);
    CHECK(std::string(ql_ctx_error(ctx)).find("host graph has no buffer") != std::string::npos);
    ql_ctx_clear_error(ctx);
    REQUIRE(ql_graph_alloc(guest, be) == QL_OK);
    CHECK(ql_graph_alloc_shared(host, be, guest) == QL_ERR_INVALID);
    CHECK(std::string(ql_ctx_error(ctx)).find("needs") != std::string::npos);
    ql_ctx_clear_error(ctx);
    // the real thing: guest in the host's buffer, alternating runs give the values computed alone
    REQUIRE(ql_backend_graph_compute(be, guest) == QL_OK);
    const float alone_g = *(const float *)gy->data;
    REQUIRE(ql_graph_alloc(host, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, host) == QL_OK);
    const float alone_h = *(const float *)hx->data;
    REQUIRE(ql_graph_alloc_shared(guest, be, host) == QL_OK);
    for (int k = 0; k < 3; k++) {
        REQUIRE(ql_backend_graph_compute(be, guest) == QL_OK);
        CHECK(*(const float *)gy->data == alone_g);
        REQUIRE(ql_backend_graph_compute(be, host) == QL_OK);
        CHECK(*(const float *)hx->data == alone_h);
    }
    double want = 0;  // and the guest's value is right
    for (int64_t i = 0; i < ql_nelements(y); i++) {
        const double v = 2.0 * ((const float *)y->data)[i];
        want += v / (1 + std::exp(-v));
    }
    CHECK(alone_g == doctest::Approx(want).epsilon(1e-5));
    ql_graph_free(guest);  // borrowed: freeing the guest leaves the host's buffer alone
    REQUIRE(ql_backend_graph_compute(be, host) == QL_OK);
    CHECK(*(const float *)hx->data == alone_h);
    ql_graph_free(host);
    ql_backend_free(be);
    ql_free(ctx);
}

// Blocks placed in execution order leave a hole where a short-lived big tensor sat under a
// long-lived small one; the planner places them again knowing every lifetime, largest first.
// a [4N] dies at node 2, s [N] (made from a, after it) lives on, b [5N] comes after a is gone:
// in execution order b cannot use a's hole (4N < 5N) and goes on top (about 10N); placed by size
// b and a share the bottom, s sits above them: 6N, what is alive at once at b's node.
TEST_CASE("planner: blocks placed by size fill the holes execution order leaves") {
    const int64_t N = 1024;
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x4 = ql_new_tensor_1d(ctx, QL_TYPE_F32, 4 * N), *x5 = ql_new_tensor_1d(ctx, QL_TYPE_F32, 5 * N);
    for (int64_t i = 0; i < 4 * N; i++) ((float *)x4->data)[i] = 0.001f * (float)(i % 101);
    for (int64_t i = 0; i < 5 * N; i++) ((float *)x5->data)[i] = 0.002f * (float)(i % 89);
    ql_tensor *a = ql_scale(ctx, x4, 2.0f);                           // node 0: [4N]
    ql_tensor *s = ql_scale(ctx, ql_view_1d(ctx, a, N, 0), 3.0f);     // node 1: [N], an output
    ql_tensor *ra = ql_sum(ctx, a);                                   // node 2: a's last reader
    ql_tensor *rb = ql_sum(ctx, ql_scale(ctx, x5, 4.0f));             // nodes 3, 4: b [5N] and its sum
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, s);
    ql_graph_build_forward(g, ra);
    ql_graph_build_forward(g, rb);
    REQUIRE_MESSAGE(ql_ctx_error(ctx)[0] == 0, ql_ctx_error(ctx));
    ql_backend *be = ql_backend_cpu_init(1);

    ql_graph_set_no_reuse(g, true);
    REQUIRE(ql_graph_plan(g, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    const std::vector<float> ref = {*(const float *)ra->data, *(const float *)rb->data, ((const float *)s->data)[7]};

    ql_graph_set_no_reuse(g, false);
    ql_plan_stats st;
    REQUIRE(ql_graph_plan(g, be, &st) == QL_OK);
    check_no_overlap(g);
    const size_t f = sizeof(float), scalar = 64;  // a sum's [1], aligned
    CHECK(st.bytes[QL_MEM_SCRATCH] == (5 * N + N) * f + 2 * scalar);  // b, s, the two sums alive after a
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    ql_graph_set_poison(g, true);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    const std::vector<float> got = {*(const float *)ra->data, *(const float *)rb->data, ((const float *)s->data)[7]};
    CHECK(memcmp(got.data(), ref.data(), sizeof(float) * ref.size()) == 0);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("planner: an add (or product) writes over its second source when the first lives on; the values stay") {
    // y = x + f(x): x is read again later (a residual stream's checkpoint), f(x) dies at the add -
    // the add takes f(x)'s block instead of a third [E, T]
    for (ql_op op : {QL_OP_ADD, QL_OP_MUL}) {
        CAPTURE(ql_op_name(op));
        ql_init_params ip{8u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        const int64_t E = 32, T = 24;
        ql_tensor *in = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, T));
        for (int64_t i = 0; i < E * T; i++) ((float *)in->data)[i] = 0.01f * (float)(i % 37) - 0.1f;
        ql_tensor *x = ql_scale(ctx, in, 2.0f);                 // a result that stays alive
        ql_tensor *f = ql_scale(ctx, ql_rms_norm(ctx, x, 1e-5f), 3.0f);
        ql_tensor *y = op == QL_OP_ADD ? ql_add(ctx, x, f) : ql_mul(ctx, x, f);
        ql_tensor *out = ql_add(ctx, ql_scale(ctx, y, 0.5f), x);  // x read after y
        ql_set_output(out);
        ql_graph *g = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(g, out) == QL_OK);
        ql_backend *be = ql_backend_cpu_init(2);
        REQUIRE(ql_graph_plan(g, be, nullptr) == QL_OK);
        const ql_plan_entry *pe = nullptr;
        const int n = ql_graph_plan_entries(g, &pe);
        size_t y_off = 1, f_off = 0;
        for (int i = 0; i < n; i++) {
            if (pe[i].tensor == y) {
                y_off = pe[i].offset;
                CHECK(pe[i].inplace);
            }
            if (pe[i].tensor == f) f_off = pe[i].offset;
        }
        CHECK(y_off == f_off);
        REQUIRE(ql_graph_alloc(g, be) == QL_OK);
        ql_graph_set_poison(g, true);
        REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
        std::vector<float> got((const float *)out->data, (const float *)out->data + E * T);
        ql_graph_set_no_reuse(g, true);  // the same graph, every result its own bytes
        REQUIRE(ql_graph_plan(g, be, nullptr) == QL_OK);
        REQUIRE(ql_graph_alloc(g, be) == QL_OK);
        REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
        CHECK(memcmp(got.data(), out->data, got.size() * sizeof(float)) == 0);
        ql_graph_free(g);
        ql_backend_free(be);
        ql_free(ctx);
    }
}

TEST_CASE("planner: mul_mat_dropout's dx adds onto the gradient so far over its bytes; the bits stay") {
    // x read by two LoRA A multiplies with their dropout inside (ql_mul_mat_dropout): backward's
    // second dx = c + dropout(Aᵀ dc) lands on the first's, which dies there - the result takes c's
    // block, so the kernel must read each element of c before it stores that element
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16}) {
        CAPTURE(ql_type_name(t));
        ql_init_params ip{8u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        const int64_t K = 96, N = 40, R = 8;
        ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
        *(int32_t *)seed->data = 8;
        auto param = [&](int64_t a, int64_t b, int salt) {
            ql_tensor *p = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, a, b));
            for (int64_t i = 0; i < a * b; i++) ((float *)p->data)[i] = 0.02f * (float)((i * 7 + salt) % 41) - 0.4f;
            return p;
        };
        ql_tensor *x = param(K, N, 1), *a1 = param(K, R, 2), *a2 = param(K, R, 3);
        ql_tensor *y = ql_add(ctx, ql_mul_mat_dropout(ctx, a1, x, 0.3f, seed, 1, t, 0), ql_mul_mat_dropout(ctx, a2, x, 0.3f, seed, 2, t, 0));
        ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, y, y));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        ql_backend *be = ql_backend_cpu_init(2);
        REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
        const ql_plan_entry *pe = nullptr;
        const int n = ql_graph_plan_entries(gb, &pe);
        int onto = 0, inplace = 0;
        for (int i = 0; i < n; i++) {
            const ql_tensor *e = pe[i].tensor;
            if (e->op != QL_OP_MUL_MAT_DROPOUT || !e->src[3]) continue;
            onto++;
            inplace += pe[i].inplace;
            if (pe[i].inplace) CHECK(pe[i].offset == [&] { for (int j = 0; j < n; j++) if (pe[j].tensor == e->src[3]) return pe[j].offset; return (size_t)1; }());
        }
        CHECK(onto == 1);
        CHECK(inplace == 1);
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        const std::vector<float> got((const float *)x->grad->data, (const float *)x->grad->data + K * N);
        ql_graph_set_no_reuse(gb, true);  // every result its own bytes
        REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        CHECK(memcmp(got.data(), x->grad->data, got.size() * sizeof(float)) == 0);
        double norm = 0;
        for (float v : got) norm += (double)v * v;
        CHECK(norm > 1e-3);  // a gradient that is there
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_backend_free(be);
        ql_free(ctx);
    }
}
