// tests/test_ops.cpp - every op constructor of qlora.h, forward against a naive reference
// written here in double precision, backward against central finite differences of that
// reference. Each check runs on the CPU backend with 1 and with 3 threads, with the planner's
// poison mode on (a tensor read after its block was reused shows up as NaN).
//
// Error measures:
//   forward:  max|got - ref| / max(1, max|ref|)                <= 1e-5 (f32)
//   backward: max|grad - fd| / max(1e-3, max|fd|) over checked elements <= 1e-4
// with fd the central difference (h = 1e-4) of L(x) = sum(ref(x) * r) in double, r a fixed
// random tensor of the output's shape. Set QL_TEST_VERBOSE=1 to print every measured error.
#include <doctest/doctest.h>

#define QL_INTERNALS  // ql_cuda_fa_layout, ql_cuda_work_size, ql_cuda_node_launches: a score budget's chunks
#include "qlora.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Vec    = std::vector<double>;
using Inputs = std::vector<Vec>;
using RefFn  = std::function<Vec(const Inputs &)>;
using Shape  = std::array<int64_t, 4>;

bool verbose() {
    static const bool v = std::getenv("QL_TEST_VERBOSE") != nullptr;
    return v;
}

int64_t numel(const Shape &s) { return s[0] * s[1] * s[2] * s[3]; }

// flat index of (i0, i1, i2, i3) in a contiguous tensor of shape ne
int64_t at(const Shape &ne, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return i0 + ne[0] * (i1 + ne[1] * (i2 + ne[2] * i3));
}

template <class F> void for4(const Shape &ne, F &&f) {
    for (int64_t i3 = 0; i3 < ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < ne[1]; ++i1)
                for (int64_t i0 = 0; i0 < ne[0]; ++i0) f(i0, i1, i2, i3);
}

// ---- fp16 / bf16, written independently of the library ------------------------------------

// round x to a binary format with `mant` stored mantissa bits and minimum normal exponent
// `emin` (round to nearest even, subnormals included, no overflow handling)
double round_to_format(double x, int mant, int emin) {
    if (x == 0) return x;
    int e;
    std::frexp(x, &e);            // |x| = m * 2^e, 0.5 <= m < 1  ->  floor(log2|x|) = e - 1
    int ex = std::max(e - 1, emin);
    double quantum = std::ldexp(1.0, ex - mant);
    return std::nearbyint(x / quantum) * quantum;  // default rounding mode: ties to even
}
double round_f16(double x) { return round_to_format(x, 10, -14); }
double round_bf16(double x) { return round_to_format(x, 7, -126); }

double decode_f16(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) v = std::ldexp((double)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((double)(1024 + m), e - 25);
    return s ? -v : v;
}
double decode_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ---- test harness ---------------------------------------------------------------------------

// One context with random leafs, an op result y, loss = sum(y * r), forward + backward graphs,
// computed on a CPU backend. Construction with the same seed gives the same data every time.
struct Harness {
    ql_context *ctx = nullptr;
    std::mt19937 rng;
    std::vector<ql_tensor *> in_t;   // registered float inputs (leafs), in creation order
    Inputs in_v;                     // their values (as stored: after rounding to their type)
    std::vector<bool> in_param;
    ql_tensor *y = nullptr, *out = nullptr, *r = nullptr, *loss = nullptr;
    Vec r_v;
    ql_graph *gf = nullptr, *gb = nullptr;
    ql_backend *be = nullptr;

    explicit Harness(uint32_t seed = 20240531u) : rng(seed) {
        ql_init_params ip{256u << 20, nullptr, false, false};
        ctx = ql_init(ip);
        REQUIRE(ctx != nullptr);
    }
    ~Harness() {
        if (gb) ql_graph_free(gb);
        if (gf) ql_graph_free(gf);
        if (be) ql_backend_free(be);
        if (ctx) ql_free(ctx);
    }
    Harness(const Harness &) = delete;
    Harness &operator=(const Harness &) = delete;

    double uni(double lo = -1, double hi = 1) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
    int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

    // a contiguous leaf of `type` filled with uniform values in [lo, hi); input number in_t.size()
    ql_tensor *input(ql_type type, Shape ne, bool param, double lo = -1, double hi = 1) {
        ql_tensor *t = ql_new_tensor_4d(ctx, type, ne[0], ne[1], ne[2], ne[3]);
        REQUIRE_MESSAGE(t != nullptr, ql_ctx_error(ctx));
        REQUIRE(t->data != nullptr);
        in_t.push_back(t);
        in_v.emplace_back(numel(ne));
        in_param.push_back(param);
        for (int64_t i = 0; i < numel(ne); ++i) set(in_t.size() - 1, i, uni(lo, hi));
        if (param) ql_set_param(t);
        return t;
    }
    // element i (flat) of input k
    void set(size_t k, int64_t i, double v) {
        ql_tensor *t = in_t[k];
        const float f = (float)v;
        switch (t->type) {
        case QL_TYPE_F32: ((float *)t->data)[i] = f; in_v[k][i] = f; break;
        case QL_TYPE_F16: {
            uint16_t h = ql_fp32_to_fp16(f);
            ((uint16_t *)t->data)[i] = h;
            in_v[k][i] = decode_f16(h);
            break;
        }
        case QL_TYPE_BF16: {
            uint16_t h = ql_fp32_to_bf16(f);
            ((uint16_t *)t->data)[i] = h;
            in_v[k][i] = decode_bf16(h);
            break;
        }
        default: FAIL("unexpected input type");
        }
    }
    ql_tensor *ints(Shape ne, const std::vector<int32_t> &v) {
        REQUIRE((int64_t)v.size() == numel(ne));
        ql_tensor *t = ql_new_tensor_4d(ctx, QL_TYPE_I32, ne[0], ne[1], ne[2], ne[3]);
        REQUIRE_MESSAGE(t != nullptr, ql_ctx_error(ctx));
        std::memcpy(t->data, v.data(), v.size() * sizeof(int32_t));
        return t;
    }

    bool any_param() const { return std::find(in_param.begin(), in_param.end(), true) != in_param.end(); }
    ql_graph *graph() const { return gb ? gb : gf; }

    // loss = sum(y * r); build, plan, allocate, compute once
    void run(ql_tensor *y_, int n_threads) {
        REQUIRE_MESSAGE(y_ != nullptr, "op returned NULL: " << ql_ctx_error(ctx));
        y = y_;
        const bool is_view = y->op == QL_OP_VIEW || y->op == QL_OP_RESHAPE || y->op == QL_OP_PERMUTE ||
                             y->op == QL_OP_TRANSPOSE;
        out = is_view ? ql_cont(ctx, y) : y;  // ql_mul needs dense rows; outputs are read flat
        REQUIRE_MESSAGE(out != nullptr, ql_ctx_error(ctx));
        REQUIRE(out->type == QL_TYPE_F32);
        ql_set_output(out);
        const Shape ne = {out->ne[0], out->ne[1], out->ne[2], out->ne[3]};
        r = ql_new_tensor_4d(ctx, QL_TYPE_F32, ne[0], ne[1], ne[2], ne[3]);
        REQUIRE(r != nullptr);
        r_v.resize(numel(ne));
        for (int64_t i = 0; i < numel(ne); ++i) {
            ((float *)r->data)[i] = (float)uni();
            r_v[i] = ((float *)r->data)[i];
        }
        loss = ql_sum(ctx, ql_mul(ctx, out, r));
        REQUIRE_MESSAGE(loss != nullptr, ql_ctx_error(ctx));
        gf = ql_graph_new(ctx);
        REQUIRE(gf != nullptr);
        REQUIRE_MESSAGE(ql_graph_build_forward(gf, loss) == QL_OK, ql_ctx_error(ctx));
        if (any_param()) {
            gb = ql_graph_backward(ctx, gf, loss);
            REQUIRE_MESSAGE(gb != nullptr, "ql_graph_backward: " << ql_ctx_error(ctx));
        }
        be = ql_backend_cpu_init(n_threads);
        REQUIRE(be != nullptr);
        ql_plan_stats st;
        REQUIRE_MESSAGE(ql_graph_plan(graph(), be, &st) == QL_OK, "plan: " << ql_ctx_error(ctx));
        REQUIRE_MESSAGE(ql_graph_alloc(graph(), be) == QL_OK, "alloc: " << ql_ctx_error(ctx));
        ql_graph_set_poison(graph(), true);
        compute();
    }
    void compute() {
        ql_graph_zero_grads(graph());
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, graph()) == QL_OK, "compute: " << ql_ctx_error(ctx));
    }
    Vec output() const {
        const float *p = (const float *)out->data;
        return Vec(p, p + ql_nelements(out));
    }
    Vec grad(size_t k) const {
        const ql_tensor *x = in_t[k], *g = x->grad;
        REQUIRE_MESSAGE(g != nullptr, "input " << k << " has no grad");
        REQUIRE(g->type == QL_TYPE_F32);
        REQUIRE(ql_same_shape(g, x));
        REQUIRE(ql_is_contiguous(g));
        const float *p = (const float *)g->data;
        return Vec(p, p + ql_nelements(g));
    }
};

double fwd_err(const Vec &got, const Vec &ref) {
    double d = 0, m = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        d = std::max(d, std::fabs(got[i] - ref[i]));
        m = std::max(m, std::fabs(ref[i]));
    }
    return d / std::max(1.0, m);
}

// all elements of a small tensor, ~60 random ones (plus the first and last) of a big one
std::vector<int64_t> pick_indices(int64_t n, uint32_t seed) {
    std::vector<int64_t> idx;
    if (n <= 100) {
        for (int64_t i = 0; i < n; ++i) idx.push_back(i);
        return idx;
    }
    std::mt19937 g(seed);
    std::uniform_int_distribution<int64_t> d(0, n - 1);
    idx.push_back(0);
    idx.push_back(n - 1);
    for (int i = 0; i < 60; ++i) idx.push_back(d(g));
    std::sort(idx.begin(), idx.end());
    idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
    return idx;
}

struct Tol {
    double fwd  = 1e-5;
    double grad = 1e-4;
    double h    = 1e-4;  // finite-difference step
};

using BuildFn = std::function<ql_tensor *(Harness &)>;
using ExtraFn = std::function<void(Harness &)>;

// Builds the op with `build` (deterministic: same data every call), runs it with 1 and 3
// threads, checks the output against ref(inputs) and every param's gradient against central
// differences of sum(fd_ref(inputs) * r) (fd_ref defaults to ref).
void check_op(const std::string &name, const BuildFn &build, const RefFn &ref, Tol tol = Tol(),
              const ExtraFn &extra = nullptr, const RefFn &fd_ref = nullptr) {
    Vec ref_y;
    Inputs first_inputs;
    std::vector<std::vector<int64_t>> idx;
    std::vector<Vec> fd;
    bool have_ref = false;
    for (int nt : {1, 3}) {
        INFO(name << ", " << nt << " thread(s)");
        Harness h;
        ql_tensor *y = build(h);
        h.run(y, nt);
        if (!have_ref) {
            have_ref = true;
            first_inputs = h.in_v;
            ref_y = ref(h.in_v);
            REQUIRE(ref_y.size() == (size_t)ql_nelements(h.out));
            const RefFn &lf = fd_ref ? fd_ref : ref;
            const Vec rv = h.r_v;
            auto L = [&](const Inputs &in) {
                Vec o = lf(in);
                double s = 0;
                for (size_t i = 0; i < o.size(); ++i) s += o[i] * rv[i];
                return s;
            };
            Inputs in = h.in_v;
            idx.assign(in.size(), {});
            fd.assign(in.size(), {});
            for (size_t k = 0; k < in.size(); ++k) {
                if (!h.in_param[k]) continue;
                idx[k] = pick_indices((int64_t)in[k].size(), 1000u + (uint32_t)k);
                for (int64_t i : idx[k]) {
                    const double x0 = in[k][i];
                    in[k][i] = x0 + tol.h;
                    const double lp = L(in);
                    in[k][i] = x0 - tol.h;
                    const double lm = L(in);
                    in[k][i] = x0;
                    fd[k].push_back((lp - lm) / (2 * tol.h));
                }
            }
        } else {
            REQUIRE(h.in_v == first_inputs);  // the same data for every thread count
        }
        const double ef = fwd_err(h.output(), ref_y);
        if (verbose()) MESSAGE(name << " nt=" << nt << " forward err " << ef);
        CHECK_MESSAGE(ef <= tol.fwd, "forward error " << ef << " > " << tol.fwd);
        for (size_t k = 0; k < h.in_v.size(); ++k) {
            if (!h.in_param[k]) continue;
            const Vec g = h.grad(k);
            double d = 0, m = 0;
            int64_t worst = -1;
            for (size_t j = 0; j < idx[k].size(); ++j) {
                const double gi = g[idx[k][j]], e = std::fabs(gi - fd[k][j]);
                if (!std::isfinite(gi)) { d = INFINITY; worst = idx[k][j]; break; }
                if (e > d) { d = e; worst = idx[k][j]; }
                m = std::max(m, std::fabs(fd[k][j]));
            }
            const double eg = d / std::max(1e-3, m);
            if (verbose()) MESSAGE(name << " nt=" << nt << " grad of input " << k << " err " << eg);
            CHECK_MESSAGE(eg <= tol.grad, "gradient of input " << k << ": error " << eg << " > " << tol.grad
                                              << " (max|fd| " << m << ", worst element " << worst << ")");
        }
        if (extra) extra(h);
    }
}

// ---- naive references -----------------------------------------------------------------------

// gather through byte strides nb (f32 source, element size 4) and a byte offset
Vec ref_strided(const Vec &src, const Shape &ne, const std::array<size_t, 4> &nb, size_t offs) {
    Vec o(numel(ne));
    for4(ne, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        size_t byte = offs + i0 * 4 + i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
        o[at(ne, i0, i1, i2, i3)] = src[byte / 4];
    });
    return o;
}

// source dimension k becomes result dimension ax[k]
Vec ref_permute(const Vec &x, const Shape &ne, const std::array<int, 4> &ax) {
    Shape rne;
    for (int k = 0; k < 4; ++k) rne[ax[k]] = ne[k];
    Vec o(x.size());
    for4(ne, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const int64_t s[4] = {i0, i1, i2, i3};
        int64_t d[4];
        for (int k = 0; k < 4; ++k) d[ax[k]] = s[k];
        o[at(rne, d[0], d[1], d[2], d[3])] = x[at(ne, i0, i1, i2, i3)];
    });
    return o;
}

// b broadcast to a's shape by repetition (index modulo b's extent)
Vec ref_binary(const Vec &a, const Shape &an, const Vec &b, const Shape &bn, bool mul) {
    Vec o(a.size());
    for4(an, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const double bv = b[at(bn, i0 % bn[0], i1 % bn[1], i2 % bn[2], i3 % bn[3])];
        const int64_t i = at(an, i0, i1, i2, i3);
        o[i] = mul ? a[i] * bv : a[i] + bv;
    });
    return o;
}

Vec ref_reduce_to(const Vec &a, const Shape &an, const Shape &ln, bool grouped) {
    Vec o(numel(ln), 0.0);
    for4(an, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const int64_t s[4] = {i0, i1, i2, i3};
        int64_t d[4];
        for (int k = 0; k < 4; ++k) d[k] = grouped ? s[k] / (an[k] / ln[k]) : s[k] % ln[k];
        o[at(ln, d[0], d[1], d[2], d[3])] += a[at(an, i0, i1, i2, i3)];
    });
    return o;
}

struct MM {
    int64_t K, M, N, A2, A3, B2, B3;
    bool at;  // a given as a transposed view of a leaf [M, K, A2, A3]
    bool bt;  // b given as a transposed view of a leaf [N, K, B2, B3]
};
Vec ref_mul_mat(const Vec &a, const Vec &b, const MM &s) {
    Vec c(s.M * s.N * s.B2 * s.B3);
    const int64_t r2 = s.B2 / s.A2, r3 = s.B3 / s.A3;
    for (int64_t j3 = 0; j3 < s.B3; ++j3)
        for (int64_t j2 = 0; j2 < s.B2; ++j2) {
            const int64_t ia = s.M * s.K * (j2 / r2 + s.A2 * (j3 / r3));
            const int64_t ib = s.N * s.K * (j2 + s.B2 * j3);
            for (int64_t n = 0; n < s.N; ++n)
                for (int64_t m = 0; m < s.M; ++m) {
                    double acc = 0;
                    for (int64_t k = 0; k < s.K; ++k) {
                        const double av = s.at ? a[ia + m + s.M * k] : a[ia + k + s.K * m];
                        const double bv = s.bt ? b[ib + n + s.N * k] : b[ib + k + s.K * n];
                        acc += av * bv;
                    }
                    c[m + s.M * (n + s.N * (j2 + s.B2 * j3))] = acc;
                }
        }
    return c;
}

double silu(double x) { return x / (1 + std::exp(-x)); }

struct RopeCfg {
    int hd, nd, nh, T, B, mode;
    bool ff;
    double base;
};
Vec ref_rope(const Vec &x, const std::vector<int32_t> &pos, const Vec *ff, const RopeCfg &c) {
    Vec o = x;
    for (int b = 0; b < c.B; ++b)
        for (int t = 0; t < c.T; ++t)
            for (int h = 0; h < c.nh; ++h) {
                const int64_t base = (int64_t)c.hd * (h + c.nh * (t + (int64_t)c.T * b));
                const double p = pos[t + c.T * b];
                for (int i = 0; i < c.nd / 2; ++i) {
                    double theta = p * std::pow(c.base, -2.0 * i / c.nd);
                    if (ff) theta /= (*ff)[i];
                    const int i0 = c.mode == QL_ROPE_NEOX ? i : 2 * i;
                    const int i1 = c.mode == QL_ROPE_NEOX ? i + c.nd / 2 : 2 * i + 1;
                    const double x0 = x[base + i0], x1 = x[base + i1];
                    o[base + i0] = x0 * std::cos(theta) - x1 * std::sin(theta);
                    o[base + i1] = x0 * std::sin(theta) + x1 * std::cos(theta);
                }
            }
    return o;
}

struct AttnCfg {
    int d, dv, H, Hkv, Tq, Tk, B;
    bool seg;
    double scale;
    bool q_from_op;  // q is a permuted view of an op result rather than of a leaf
};
// q leaf [d, H, Tq, B], k leaf [d, Hkv, Tk, B], v leaf [dv, Hkv, Tk, B] -> [dv, H, Tq, B]
Vec ref_attn(const Vec &q, const Vec &k, const Vec &v, const std::vector<int32_t> &seg, const AttnCfg &c) {
    Vec o((size_t)c.dv * c.H * c.Tq * c.B);
    Vec s(c.Tk);
    const int g = c.H / c.Hkv;
    for (int b = 0; b < c.B; ++b)
        for (int i = 0; i < c.Tq; ++i)
            for (int h = 0; h < c.H; ++h) {
                const int hk = h / g;
                const double *qi = &q[(size_t)c.d * (h + c.H * (i + (size_t)c.Tq * b))];
                double mx = -INFINITY;
                for (int j = 0; j < c.Tk; ++j) {
                    bool ok = j <= i + (c.Tk - c.Tq);
                    if (c.seg) ok = ok && seg[i + c.Tk * b] == seg[j + c.Tk * b];
                    if (!ok) { s[j] = -INFINITY; continue; }
                    const double *kj = &k[(size_t)c.d * (hk + c.Hkv * (j + (size_t)c.Tk * b))];
                    double dot = 0;
                    for (int e = 0; e < c.d; ++e) dot += qi[e] * kj[e];
                    s[j] = c.scale * dot;
                    mx = std::max(mx, s[j]);
                }
                double z = 0;
                for (int j = 0; j < c.Tk; ++j) {
                    s[j] = std::isinf(s[j]) ? 0.0 : std::exp(s[j] - mx);
                    z += s[j];
                }
                double *oi = &o[(size_t)c.dv * (h + c.H * (i + (size_t)c.Tq * b))];
                for (int e = 0; e < c.dv; ++e) {
                    double acc = 0;
                    for (int j = 0; j < c.Tk; ++j)
                        if (s[j] != 0) acc += s[j] * v[(size_t)c.dv * (hk + c.Hkv * (j + (size_t)c.Tk * b)) + e];
                    oi[e] = acc / z;
                }
            }
    return o;
}

}  // namespace

// =============================================================================================
// fill, views, reshape, permute, transpose, cont, cast
// =============================================================================================

TEST_CASE("fill") {
    const int64_t ne[4] = {7, 5, 3, 1};
    check_op("fill alone", [&](Harness &h) { return ql_fill(h.ctx, QL_TYPE_F32, 3, ne, 2.5f); },
             [](const Inputs &) { return Vec(105, 2.5); });
    check_op("x + fill",
             [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, {7, 5, 3, 1}, true);
                 return ql_add(h.ctx, x, ql_fill(h.ctx, QL_TYPE_F32, 3, ne, -1.25f));
             },
             [](const Inputs &in) {
                 Vec o = in[0];
                 for (double &v : o) v += -1.25;
                 return o;
             });
}

TEST_CASE("view_1d..4d, gradient into the source") {
    const Shape xn = {13, 7, 5, 3};  // nb = 4, 52, 364, 1820
    struct V {
        const char *name;
        int nd;
        Shape ne;
        std::array<size_t, 4> nb;
        size_t offs;
        bool of_op;  // view of scale(x, 2) instead of x
    };
    const V views[] = {
        {"view_1d", 1, {29, 1, 1, 1}, {4, 0, 0, 0}, 4 * 11, false},
        {"view_2d", 2, {5, 4, 1, 1}, {4, 52, 0, 0}, 4 * (2 + 13 * 1), false},
        {"view_2d every other row", 2, {9, 11, 1, 1}, {4, 104, 0, 0}, 4 * 3, false},
        {"view_3d", 3, {4, 3, 2, 1}, {4, 52, 728, 0}, 4 * (1 + 13 * 2 + 91 * 1), false},
        {"view_4d", 4, {6, 2, 2, 2}, {4, 156, 728, 1820}, 4 * 3, false},
        {"view_2d of an op result", 2, {7, 3, 1, 1}, {4, 52, 0, 0}, 4 * 13 * 2, true},
    };
    for (const V &w : views) {
        check_op(w.name,
                 [&](Harness &h) {
                     ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                     ql_tensor *s = w.of_op ? ql_scale(h.ctx, x, 2.0f) : x;
                     switch (w.nd) {
                     case 1: return ql_view_1d(h.ctx, s, w.ne[0], w.offs);
                     case 2: return ql_view_2d(h.ctx, s, w.ne[0], w.ne[1], w.nb[1], w.offs);
                     case 3: return ql_view_3d(h.ctx, s, w.ne[0], w.ne[1], w.ne[2], w.nb[1], w.nb[2], w.offs);
                     default:
                         return ql_view_4d(h.ctx, s, w.ne[0], w.ne[1], w.ne[2], w.ne[3], w.nb[1], w.nb[2],
                                           w.nb[3], w.offs);
                     }
                 },
                 [&](const Inputs &in) {
                     Vec o = ref_strided(in[0], w.ne, w.nb, w.offs);
                     if (w.of_op) for (double &v : o) v *= 2;
                     return o;
                 });
    }
}

TEST_CASE("reshape") {
    const Shape xn = {13, 7, 5, 1};  // 455 elements
    for (int nd = 1; nd <= 4; ++nd) {
        check_op("reshape_" + std::to_string(nd) + "d",
                 [&](Harness &h) -> ql_tensor * {
                     ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                     switch (nd) {
                     case 1: return ql_reshape_1d(h.ctx, x, 455);
                     case 2: return ql_reshape_2d(h.ctx, x, 35, 13);
                     case 3: return ql_reshape_3d(h.ctx, x, 5, 7, 13);
                     default: return ql_reshape_4d(h.ctx, x, 7, 5, 1, 13);
                     }
                 },
                 [](const Inputs &in) { return in[0]; });
    }
    check_op("reshape_2d of an op result",
             [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                 return ql_reshape_2d(h.ctx, ql_scale(h.ctx, x, -1.0f), 65, 7);
             },
             [](const Inputs &in) {
                 Vec o = in[0];
                 for (double &v : o) v = -v;
                 return o;
             });
}

TEST_CASE("permute, transpose, cont") {
    const Shape xn = {5, 7, 3, 2};
    const std::array<int, 4> perms[] = {{2, 0, 1, 3}, {1, 3, 0, 2}, {0, 2, 1, 3}, {3, 2, 1, 0}};
    for (const auto &p : perms) {
        check_op("permute " + std::to_string(p[0]) + std::to_string(p[1]) + std::to_string(p[2]) +
                     std::to_string(p[3]),
                 [&](Harness &h) {
                     ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                     return ql_permute(h.ctx, x, p[0], p[1], p[2], p[3]);
                 },
                 [&](const Inputs &in) { return ref_permute(in[0], xn, p); });
    }
    check_op("transpose",
             [&](Harness &h) { return ql_transpose(h.ctx, h.input(QL_TYPE_F32, xn, true)); },
             [&](const Inputs &in) { return ref_permute(in[0], xn, {1, 0, 2, 3}); });
    check_op("cont of a permuted view",
             [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                 ql_tensor *y = ql_cont(h.ctx, ql_permute(h.ctx, x, 1, 2, 0, 3));
                 REQUIRE(y != nullptr);
                 CHECK(y->op == QL_OP_CONT);
                 CHECK(ql_is_contiguous(y));
                 return y;
             },
             [&](const Inputs &in) { return ref_permute(in[0], xn, {1, 2, 0, 3}); });
    check_op("cont of a contiguous tensor",
             [&](Harness &h) { return ql_cont(h.ctx, h.input(QL_TYPE_F32, xn, true)); },
             [](const Inputs &in) { return in[0]; });
}

TEST_CASE("cast to F16 / BF16 and back") {
    // Forward: the reference rounds in double (ties to even, subnormals included), so the result
    // must match exactly. Backward: the cast is differentiated as the identity (straight
    // through), so the reference for the finite differences is the identity; the gradient may
    // itself pass through an f16/bf16 tensor, hence tolerances of 2^-10 (f16) and 2^-7 (bf16).
    const Shape xn = {13, 7, 3, 1};
    struct C {
        const char *name;
        ql_type type;
        bool transposed;
        double gtol;
    };
    const C cases[] = {{"cast F16", QL_TYPE_F16, false, 1e-3},
                       {"cast BF16", QL_TYPE_BF16, false, 8e-3},
                       {"cast F16 of a transposed view", QL_TYPE_F16, true, 1e-3}};
    for (const C &c : cases) {
        auto rnd = [&](double v) { return c.type == QL_TYPE_F16 ? round_f16(v) : round_bf16(v); };
        ql_tensor *mid = nullptr;
        Tol tol;
        tol.fwd = 0;
        tol.grad = c.gtol;
        auto src = [&](const Inputs &in) { return c.transposed ? ref_permute(in[0], xn, {1, 0, 2, 3}) : in[0]; };
        check_op(c.name,
                 [&](Harness &h) {
                     ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                     for (int64_t i = 0; i < numel(xn); ++i)  // magnitudes from 2^-26 to 2^10
                         h.set(0, i, h.uni() * std::ldexp(1.0, h.irand(-26, 10)));
                     const double u = c.type == QL_TYPE_F16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
                     h.set(0, 0, 1 + u);      // tie: rounds down to the even 1.0
                     h.set(0, 1, 1 + 3 * u);  // tie: rounds up to the even 1 + 4u
                     h.set(0, 2, -(1 + 5 * u));
                     h.set(0, 3, 0.0);
                     ql_tensor *s = c.transposed ? ql_transpose(h.ctx, x) : x;
                     mid = ql_cast(h.ctx, s, c.type);
                     REQUIRE_MESSAGE(mid != nullptr, ql_ctx_error(h.ctx));
                     ql_set_output(mid);
                     return ql_cast(h.ctx, mid, QL_TYPE_F32);
                 },
                 [&](const Inputs &in) {
                     Vec o = src(in);
                     for (double &v : o) v = rnd(v);
                     return o;
                 },
                 tol,
                 [&](Harness &h) {
                     REQUIRE(mid->type == c.type);
                     REQUIRE(ql_is_contiguous(mid));
                     const Vec want = src(h.in_v);
                     const uint16_t *p = (const uint16_t *)mid->data;
                     int64_t bad = 0;
                     for (int64_t i = 0; i < (int64_t)want.size(); ++i) {
                         const double got = c.type == QL_TYPE_F16 ? decode_f16(p[i]) : decode_bf16(p[i]);
                         if (got != rnd(want[i])) ++bad;
                     }
                     CHECK_MESSAGE(bad == 0, bad << " elements of the " << ql_type_name(c.type)
                                                 << " tensor differ from round-to-nearest-even");
                 },
                 src);
    }
}

// =============================================================================================
// elementwise: add, mul, scale, sum, reduce_to
// =============================================================================================

TEST_CASE("add and mul with broadcasting") {
    const Shape an = {21, 7, 6, 3};
    const Shape bns[] = {{21, 7, 6, 3}, {1, 1, 1, 1}, {21, 1, 1, 1}, {7, 1, 3, 3}, {21, 7, 1, 3}, {1, 7, 2, 1}};
    for (bool mul : {false, true})
        for (const Shape &bn : bns) {
            std::string name = std::string(mul ? "mul" : "add") + " b=[" + std::to_string(bn[0]) + "," +
                               std::to_string(bn[1]) + "," + std::to_string(bn[2]) + "," +
                               std::to_string(bn[3]) + "]";
            check_op(name,
                     [&](Harness &h) {
                         ql_tensor *a = h.input(QL_TYPE_F32, an, true);
                         ql_tensor *b = h.input(QL_TYPE_F32, bn, true);
                         return mul ? ql_mul(h.ctx, a, b) : ql_add(h.ctx, a, b);
                     },
                     [&](const Inputs &in) { return ref_binary(in[0], an, in[1], bn, mul); });
        }
}

TEST_CASE("scale and sum") {
    const Shape xn = {37, 13, 3, 1};
    check_op("scale",
             [&](Harness &h) { return ql_scale(h.ctx, h.input(QL_TYPE_F32, xn, true), -1.7f); },
             [](const Inputs &in) {
                 Vec o = in[0];
                 for (double &v : o) v *= (double)-1.7f;
                 return o;
             });
    check_op("sum",
             [&](Harness &h) { return ql_sum(h.ctx, h.input(QL_TYPE_F32, xn, true)); },
             [](const Inputs &in) {
                 double s = 0;
                 for (double v : in[0]) s += v;
                 return Vec{s};
             });
}

TEST_CASE("reduce_to") {
    const Shape an = {21, 10, 6, 3};
    const Shape lns[] = {{7, 5, 3, 1}, {1, 1, 1, 1}, {21, 1, 6, 1}, {21, 10, 6, 3}, {3, 2, 1, 3}};
    for (bool grouped : {false, true})
        for (const Shape &ln : lns) {
            std::string name = std::string("reduce_to grouped=") + (grouped ? "1" : "0") + " like=[" +
                               std::to_string(ln[0]) + "," + std::to_string(ln[1]) + "," +
                               std::to_string(ln[2]) + "," + std::to_string(ln[3]) + "]";
            check_op(name,
                     [&](Harness &h) {
                         ql_tensor *a = h.input(QL_TYPE_F32, an, true);
                         ql_tensor *like = ql_new_tensor_4d(h.ctx, QL_TYPE_F32, ln[0], ln[1], ln[2], ln[3]);
                         return ql_reduce_to(h.ctx, a, like, grouped);
                     },
                     [&](const Inputs &in) { return ref_reduce_to(in[0], an, ln, grouped); });
        }
}

// =============================================================================================
// mul_mat
// =============================================================================================

namespace {
void check_mul_mat(const std::string &name, const MM &s, ql_type atype = QL_TYPE_F32, Tol tol = Tol()) {
    check_op(name,
             [&](Harness &h) {
                 const bool pa = atype == QL_TYPE_F32;  // only f32 leafs can be params
                 ql_tensor *a = s.at ? h.input(atype, {s.M, s.K, s.A2, s.A3}, pa)
                                     : h.input(atype, {s.K, s.M, s.A2, s.A3}, pa);
                 ql_tensor *b = s.bt ? h.input(QL_TYPE_F32, {s.N, s.K, s.B2, s.B3}, true)
                                     : h.input(QL_TYPE_F32, {s.K, s.N, s.B2, s.B3}, true);
                 if (s.at) a = ql_transpose(h.ctx, a);
                 if (s.bt) b = ql_transpose(h.ctx, b);
                 ql_tensor *c = ql_mul_mat(h.ctx, a, b);
                 REQUIRE_MESSAGE(c != nullptr, ql_ctx_error(h.ctx));
                 CHECK(c->ne[0] == s.M);
                 CHECK(c->ne[1] == s.N);
                 CHECK(c->ne[2] == s.B2);
                 CHECK(c->ne[3] == s.B3);
                 return c;
             },
             [&](const Inputs &in) { return ref_mul_mat(in[0], in[1], s); }, tol);
}
}  // namespace

TEST_CASE("mul_mat f32") {
    check_mul_mat("mul_mat plain 13x7 K=37", {37, 13, 7, 1, 1, 1, 1, false, false});
    check_mul_mat("mul_mat across blocking M=131 N=67 K=300", {300, 131, 67, 1, 1, 1, 1, false, false});
    check_mul_mat("mul_mat tiny N M=259 N=3 K=517", {517, 259, 3, 1, 1, 1, 1, false, false});
    check_mul_mat("mul_mat N=1 M=67 K=131", {131, 67, 1, 1, 1, 1, 1, false, false});
    check_mul_mat("mul_mat a transposed view", {37, 19, 11, 1, 1, 1, 1, true, false});
    check_mul_mat("mul_mat a transposed view, big", {131, 67, 21, 1, 1, 1, 1, true, false});
    check_mul_mat("mul_mat b transposed view", {37, 19, 11, 1, 1, 1, 1, false, true});
    check_mul_mat("mul_mat both transposed", {29, 13, 9, 1, 1, 1, 1, true, true});
    check_mul_mat("mul_mat batched, a broadcast (A2=2 B2=6, A3=B3=3)", {11, 13, 5, 2, 3, 6, 3, false, false});
    check_mul_mat("mul_mat batched, a broadcast (A2=2 B2=4, A3=1 B3=3)", {11, 13, 5, 2, 1, 4, 3, false, false});
    check_mul_mat("mul_mat batched, a transposed", {11, 7, 5, 1, 3, 3, 3, true, false});
    // one a for every batch: da is one multiply over all N B2 B3 columns (b contiguous), or
    // per batch then summed (b a transposed view)
    check_mul_mat("mul_mat batched, a one matrix (A2=A3=1 B2=4 B3=3)", {11, 13, 5, 1, 1, 4, 3, false, false});
    check_mul_mat("mul_mat batched, a one matrix, b transposed", {11, 13, 5, 1, 1, 4, 3, false, true});
}

TEST_CASE("mul_mat with an F16 / BF16 a") {
    // a is stored in f16/bf16 (the reference uses exactly the stored values). The contract is
    // that a is widened exactly to f32 and b stays f32, so the f32 tolerances apply.
    Tol f16;
    Tol bf16;
    check_mul_mat("mul_mat F16 a 37x13 K=67", {67, 37, 13, 1, 1, 1, 1, false, false}, QL_TYPE_F16, f16);
    check_mul_mat("mul_mat F16 a M=131 N=5 K=300", {300, 131, 5, 1, 1, 1, 1, false, false}, QL_TYPE_F16, f16);
    check_mul_mat("mul_mat F16 a batched", {19, 11, 7, 1, 1, 3, 1, false, false}, QL_TYPE_F16, f16);
    check_mul_mat("mul_mat BF16 a 37x13 K=67", {67, 37, 13, 1, 1, 1, 1, false, false}, QL_TYPE_BF16, bf16);
    check_mul_mat("mul_mat BF16 a M=131 N=5 K=300", {300, 131, 5, 1, 1, 1, 1, false, false}, QL_TYPE_BF16, bf16);
}

TEST_CASE("mul_mat with an F16 / BF16 b: a 16-bit multiply, forward and backward") {
    // y = a . cast(x, T): a (f32, or NF4-dequantised) is rounded to T as it is packed, products
    // sum in f32. Backward does the same: dy rounded to T, then da = x_T dy_T, dx = a_T dy_T.
    // References in double from independently rounded values.
    struct C { ql_type t; int64_t K, M, N, B = 1; };  // B: batches of x (a shared: da sums over them)
    // (bf16 with K a multiple of 32 and N >= 16 runs on AMX tiles where the processor has them:
    // K 256 forward, and K = N = 96 for da; 77 tokens leave partial tiles; with K even, on
    // AVX512-BF16's pair dots where it has those: K 258 is one of them everywhere)
    for (const C c : {C{QL_TYPE_BF16, 67, 37, 100}, C{QL_TYPE_F16, 67, 37, 100}, C{QL_TYPE_BF16, 300, 45, 3},
                      C{QL_TYPE_F16, 33, 131, 70}, C{QL_TYPE_BF16, 256, 45, 96}, C{QL_TYPE_BF16, 128, 37, 77},
                      C{QL_TYPE_BF16, 544, 1100, 40}, C{QL_TYPE_BF16, 258, 70, 100}, C{QL_TYPE_BF16, 70, 21, 36, 3},
                      C{QL_TYPE_F16, 30, 40, 28, 4}, C{QL_TYPE_BF16, 512, 40, 100}}) {
        Vec first[3];  // y, da, dx at 1 thread: 3 threads must give the same bits
        for (int nt : {1, 3}) {
            INFO(ql_type_name(c.t) << " K " << c.K << " M " << c.M << " N " << c.N << " B " << c.B << ", " << nt << " threads");
            const auto rnd = [&](double v) { return c.t == QL_TYPE_BF16 ? round_bf16((float)v) : round_f16((float)v); };
            Harness h;
            ql_tensor *a = h.input(QL_TYPE_F32, {c.K, c.M, 1, 1}, true);
            ql_tensor *x = h.input(QL_TYPE_F32, {c.K, c.N / c.B, c.B, 1}, true);  // N tokens in B batches
            ql_tensor *xc = ql_cast(h.ctx, x, c.t);
            h.run(ql_mul_mat(h.ctx, a, xc), nt);
            const Vec &av = h.in_v[0], &xv = h.in_v[1];
            Vec y(c.M * c.N, 0.0), da(c.K * c.M, 0.0), dx(c.K * c.N, 0.0);
            for (int64_t n = 0; n < c.N; n++)
                for (int64_t m = 0; m < c.M; m++) {
                    const double r = rnd(h.r_v[n * c.M + m]);
                    for (int64_t k = 0; k < c.K; k++) {
                        y[n * c.M + m] += rnd(av[m * c.K + k]) * rnd(xv[n * c.K + k]);
                        da[m * c.K + k] += rnd(xv[n * c.K + k]) * r;
                        dx[n * c.K + k] += rnd(av[m * c.K + k]) * r;
                    }
                }
            CHECK(fwd_err(h.output(), y) <= 1e-5);
            CHECK(fwd_err(h.grad(0), da) <= 1e-5);
            CHECK(fwd_err(h.grad(1), dx) <= 1e-5);
            const Vec got[3] = {h.output(), h.grad(0), h.grad(1)};
            for (int q = 0; q < 3; q++) {
                if (nt == 1) first[q] = got[q];
                else CHECK(got[q] == first[q]);
            }
            // and not the f32 product: the rounding is really there
            Vec y32(c.M * c.N, 0.0);
            for (int64_t n = 0; n < c.N; n++)
                for (int64_t m = 0; m < c.M; m++)
                    for (int64_t k = 0; k < c.K; k++) y32[n * c.M + m] += av[m * c.K + k] * xv[n * c.K + k];
            CHECK(fwd_err(h.output(), y32) > 1e-4);
        }
    }
}

TEST_CASE("mul_mat_acc: c + a b with the bits of ql_add(c, ql_mul_mat(a, b)), forward and backward, in place or not") {
    // y = c + a . x, c made by an op (so the planner may write the product over it) and shared
    // with another consumer in some cases (so it may not); LoRA's shape: K small, x 16-bit
    struct C { ql_type t; int64_t K, M, N, B; bool shared; };
    for (const C c : {C{QL_TYPE_F32, 16, 70, 100, 1, false}, C{QL_TYPE_F32, 16, 37, 3, 1, false},
                      C{QL_TYPE_BF16, 16, 70, 96, 4, false}, C{QL_TYPE_BF16, 40, 33, 50, 2, true},
                      C{QL_TYPE_BF16, 64, 70, 96, 2, false}, C{QL_TYPE_BF16, 96, 45, 40, 1, true},  // (K % 32 == 0: AMX where there)
                      C{QL_TYPE_F16, 24, 45, 20, 1, false}, C{QL_TYPE_F32, 0, 9, 5, 1, false}}) {
        for (int nt : {1, 3}) {
            INFO(ql_type_name(c.t) << " K " << c.K << " M " << c.M << " N " << c.N << " B " << c.B
                                   << (c.shared ? " c shared" : "") << ", " << nt << " threads");
            Vec got[2][4];
            for (int fused = 0; fused < 2; fused++) {
                Harness h;
                ql_tensor *a = h.input(QL_TYPE_F32, {c.K, c.M, 1, 1}, true);
                ql_tensor *x = h.input(QL_TYPE_F32, {c.K, c.N / c.B, c.B, 1}, true);
                ql_tensor *c0 = h.input(QL_TYPE_F32, {c.M, c.N / c.B, c.B, 1}, true);
                ql_tensor *cm = ql_scale(h.ctx, c0, 0.5f);  // an op's result
                ql_tensor *xc = c.t == QL_TYPE_F32 ? x : ql_cast(h.ctx, x, c.t);
                ql_tensor *y = fused ? ql_mul_mat_acc(h.ctx, a, xc, cm) : ql_add(h.ctx, cm, ql_mul_mat(h.ctx, a, xc));
                if (c.shared) y = ql_mul(h.ctx, y, cm);  // cm lives on after the multiply
                h.run(y, nt);
                got[fused][0] = h.output();
                for (int q = 0; q < 3; q++) got[fused][q + 1] = h.grad((size_t)q);
                if (!fused || c.shared) continue;
                // and the values: against double
                Vec ref(c.M * c.N);
                const auto rnd = [&](double v) {
                    return c.t == QL_TYPE_BF16 ? round_bf16((float)v) : c.t == QL_TYPE_F16 ? round_f16((float)v) : v;
                };
                for (int64_t n = 0; n < c.N; n++)
                    for (int64_t m = 0; m < c.M; m++) {
                        double v = 0.5 * h.in_v[2][n * c.M + m];
                        for (int64_t k = 0; k < c.K; k++) v += rnd(h.in_v[0][m * c.K + k]) * rnd(h.in_v[1][n * c.K + k]);
                        ref[n * c.M + m] = v;
                    }
                CHECK(fwd_err(h.output(), ref) <= 1e-5);
                Vec dc(c.M * c.N);
                for (size_t i = 0; i < dc.size(); i++) dc[i] = 0.5 * h.r_v[i];
                CHECK(fwd_err(h.grad(2), dc) <= 1e-6);
            }
            for (int q = 0; q < 4; q++) CHECK(got[1][q] == got[0][q]);
        }
    }
    // beyond 256 of K, c joins after the first K block: close, not the same bits
    Harness h;
    ql_tensor *a = h.input(QL_TYPE_F32, {300, 20, 1, 1}, true), *x = h.input(QL_TYPE_F32, {300, 70, 1, 1}, true);
    ql_tensor *c0 = h.input(QL_TYPE_F32, {20, 70, 1, 1}, true);
    h.run(ql_mul_mat_acc(h.ctx, a, x, c0), 2);
    Vec ref(20 * 70);
    for (int64_t n = 0; n < 70; n++)
        for (int64_t m = 0; m < 20; m++) {
            double v = h.in_v[2][n * 20 + m];
            for (int64_t k = 0; k < 300; k++) v += h.in_v[0][m * 300 + k] * h.in_v[1][n * 300 + k];
            ref[n * 20 + m] = v;
        }
    CHECK(fwd_err(h.output(), ref) <= 1e-5);
    {  // the same with x in bf16 (AMX where there: c through the tiles after the first K block), at 1 and 3 threads
        Vec first;
        for (int nt : {1, 3}) {
            Harness hb;
            ql_tensor *ab = hb.input(QL_TYPE_F32, {512, 40, 1, 1}, true), *xb = hb.input(QL_TYPE_F32, {512, 100, 1, 1}, true);
            ql_tensor *cb = hb.input(QL_TYPE_F32, {40, 100, 1, 1}, true);
            hb.run(ql_mul_mat_acc(hb.ctx, ab, ql_cast(hb.ctx, xb, QL_TYPE_BF16), cb), nt);
            Vec rb(40 * 100);
            for (int64_t n = 0; n < 100; n++)
                for (int64_t m = 0; m < 40; m++) {
                    double v = hb.in_v[2][n * 40 + m];
                    for (int64_t k = 0; k < 512; k++) v += round_bf16((float)hb.in_v[0][m * 512 + k]) * round_bf16((float)hb.in_v[1][n * 512 + k]);
                    rb[n * 40 + m] = v;
                }
            CHECK(fwd_err(hb.output(), rb) <= 1e-5);
            if (nt == 1) first = hb.output();
            else CHECK(hb.output() == first);
        }
    }
    // bad input: c of another shape or type is refused with the op's name
    ql_tensor *bad = ql_mul_mat_acc(h.ctx, a, x, ql_new_tensor_2d(h.ctx, QL_TYPE_F32, 70, 20));
    CHECK(bad == nullptr);
    CHECK(std::string(ql_ctx_error(h.ctx)).find("mul_mat_acc") != std::string::npos);
}

TEST_CASE("mul_mat_to and mul_mat_acc with a 16-bit result: the bits of ql_cast of the f32 result, forward and backward") {
    // y = mul_mat_to(a, x16, t) against ql_cast(ql_mul_mat(a, x16), t); with c: mul_mat_acc onto a
    // 16-bit c against ql_cast(ql_add(ql_cast(c, f32), ql_mul_mat(a, x16)), t), c made by an op
    // (written over in place) or living on after the multiply. Shapes beyond one staging sub-tile
    // (M > 1024 columns, N > 384 rows), batched, K beyond one K block.
    struct C { int64_t K, M, N, B; bool acc, shared; };
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (const C c : {C{40, 1100, 400, 1, false, false}, C{40, 1100, 400, 1, true, false}, C{64, 70, 96, 4, true, false},
                          C{300, 33, 50, 1, true, false}, C{512, 40, 100, 1, true, true}, C{16, 37, 3, 1, false, false}})
            for (int nt : {1, 3}) {
                INFO(std::string(ql_type_name(t)) << " K " << c.K << " M " << c.M << " N " << c.N << " B " << c.B << (c.acc ? " acc" : "")
                                     << (c.shared ? " c shared" : "") << ", " << nt << " threads");
                Vec got[2][4];
                for (int fused = 0; fused < 2; fused++) {
                    Harness h;
                    ql_tensor *a = h.input(QL_TYPE_F32, {c.K, c.M, 1, 1}, true);
                    ql_tensor *x = h.input(QL_TYPE_F32, {c.K, c.N / c.B, c.B, 1}, true);
                    ql_tensor *c0 = h.input(QL_TYPE_F32, {c.M, c.N / c.B, c.B, 1}, true);
                    ql_tensor *xc = ql_cast(h.ctx, x, t), *c16 = ql_cast(h.ctx, ql_scale(h.ctx, c0, 0.5f), t);
                    ql_tensor *y;
                    if (fused)
                        y = c.acc ? ql_mul_mat_acc(h.ctx, a, xc, c16) : ql_mul_mat_to(h.ctx, a, xc, t);
                    else
                        y = ql_cast(h.ctx, c.acc ? ql_add(h.ctx, ql_cast(h.ctx, c16, QL_TYPE_F32), ql_mul_mat(h.ctx, a, xc)) : ql_mul_mat(h.ctx, a, xc), t);
                    REQUIRE_MESSAGE(y, ql_ctx_error(h.ctx));
                    CHECK(y->type == t);
                    y = ql_cast(h.ctx, y, QL_TYPE_F32);
                    if (c.shared) y = ql_mul(h.ctx, y, ql_cast(h.ctx, c16, QL_TYPE_F32));  // c16 lives on after the multiply
                    h.run(y, nt);
                    got[fused][0] = h.output();
                    for (int q = 0; q < (c.acc || c.shared ? 3 : 2); q++) got[fused][q + 1] = h.grad((size_t)q);
                    if (!fused || c.shared) continue;
                    // and the values: against double, within one rounding of the 16-bit result
                    const auto rnd = [&](double v) { return t == QL_TYPE_BF16 ? round_bf16((float)v) : round_f16((float)v); };
                    Vec ref(c.M * c.N);
                    for (int64_t n = 0; n < c.N; n++)
                        for (int64_t m = 0; m < c.M; m++) {
                            double v = c.acc ? rnd(0.5 * h.in_v[2][n * c.M + m]) : 0.0;
                            for (int64_t k = 0; k < c.K; k++) v += rnd(h.in_v[0][m * c.K + k]) * rnd(h.in_v[1][n * c.K + k]);
                            ref[n * c.M + m] = v;
                        }
                    CHECK(fwd_err(h.output(), ref) <= (t == QL_TYPE_BF16 ? 8e-3 : 1e-3));
                }
                for (int q = 0; q < 4; q++) CHECK(got[1][q] == got[0][q]);
            }
    // bad input: a 16-bit result needs b of that type; c of another 16-bit type than b is refused
    Harness h;
    ql_tensor *a = h.input(QL_TYPE_F32, {16, 8, 1, 1}, false), *x = h.input(QL_TYPE_F32, {16, 4, 1, 1}, false);
    CHECK(ql_mul_mat_to(h.ctx, a, x, QL_TYPE_BF16) == nullptr);
    CHECK(std::string(ql_ctx_error(h.ctx)).find("mul_mat") != std::string::npos);
    Harness h2;
    ql_tensor *a2 = h2.input(QL_TYPE_F32, {16, 8, 1, 1}, false), *x2 = h2.input(QL_TYPE_BF16, {16, 4, 1, 1}, false);
    CHECK(ql_mul_mat_acc(h2.ctx, a2, x2, h2.input(QL_TYPE_F16, {8, 4, 1, 1}, false)) == nullptr);
    CHECK(std::string(ql_ctx_error(h2.ctx)).find("mul_mat_acc") != std::string::npos);
}

TEST_CASE("16-bit results against the math with finite-difference gradients: mul_mat_to, swiglu") {
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        const bool bf = t == QL_TYPE_BF16;
        auto rnd = [bf](double v) { return bf ? round_bf16((float)v) : round_f16((float)v); };
        // one rounding of the result (a flip at the last bit where f32 and double differ), and the
        // gradient of the unrounded math at the rounded inputs (dy rounded to b's type in the multiply)
        Tol tol;
        tol.fwd = bf ? 1e-2 : 2e-3;
        tol.grad = bf ? 3e-2 : 4e-3;
        const int64_t K = 48, M = 33, N = 20;
        check_op(std::string("mul_mat_to ") + ql_type_name(t),
                 [&](Harness &h) {
                     ql_tensor *a = h.input(QL_TYPE_F32, {K, M, 1, 1}, true), *x = h.input(QL_TYPE_F32, {K, N, 1, 1}, true);
                     return ql_cast(h.ctx, ql_mul_mat_to(h.ctx, a, ql_cast(h.ctx, x, t), t), QL_TYPE_F32);
                 },
                 [&](const Inputs &in) {
                     Vec o(M * N);
                     for (int64_t n = 0; n < N; n++)
                         for (int64_t m = 0; m < M; m++) {
                             double v = 0;
                             for (int64_t k = 0; k < K; k++) v += rnd(in[0][m * K + k]) * rnd(in[1][n * K + k]);
                             o[n * M + m] = rnd(v);
                         }
                     return o;
                 },
                 tol, nullptr,
                 [&](const Inputs &in) {
                     Vec o(M * N);
                     for (int64_t n = 0; n < N; n++)
                         for (int64_t m = 0; m < M; m++)
                             for (int64_t k = 0; k < K; k++) o[n * M + m] += in[0][m * K + k] * in[1][n * K + k];
                     return o;
                 });
        const Shape xn = {37, 13, 3, 1};
        check_op(std::string("swiglu ") + ql_type_name(t),
                 [&](Harness &h) {
                     ql_tensor *a = h.input(QL_TYPE_F32, xn, true, -6, 6), *b = h.input(QL_TYPE_F32, xn, true);
                     return ql_cast(h.ctx, ql_swiglu(h.ctx, ql_cast(h.ctx, a, t), ql_cast(h.ctx, b, t)), QL_TYPE_F32);
                 },
                 [&](const Inputs &in) {
                     Vec o = in[0];
                     for (size_t i = 0; i < o.size(); ++i) o[i] = rnd(silu(rnd(in[0][i])) * rnd(in[1][i]));
                     return o;
                 },
                 tol, nullptr,
                 [](const Inputs &in) {
                     Vec o = in[0];
                     for (size_t i = 0; i < o.size(); ++i) o[i] = silu(in[0][i]) * in[1][i];
                     return o;
                 });
    }
}

TEST_CASE("swiglu and dropout on 16-bit inputs: the bits of the f32 op on the widened inputs, rounded; f32 gradients") {
    // swiglu(a16, b16) against ql_cast(swiglu(f32(a16), f32(b16)), t); dropout_to(a16, t) against
    // dropout_to(f32(a16), t): forward and every gradient, 1 and 3 threads
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (int op = 0; op < 2; op++)
            for (int nt : {1, 3}) {
                INFO(std::string(ql_type_name(t)) << (op ? " dropout" : " swiglu") << ", " << nt << " threads");
                Vec got[2][3];
                for (int direct = 0; direct < 2; direct++) {
                    Harness h;
                    ql_tensor *a = h.input(QL_TYPE_F32, {70, 9, 2, 1}, true, -6, 6), *b = h.input(QL_TYPE_F32, {70, 9, 2, 1}, true);
                    ql_tensor *a16 = ql_cast(h.ctx, a, t), *b16 = ql_cast(h.ctx, b, t);
                    ql_tensor *y;
                    if (op == 0) {
                        y = direct ? ql_swiglu(h.ctx, a16, b16)
                                   : ql_cast(h.ctx, ql_swiglu(h.ctx, ql_cast(h.ctx, a16, QL_TYPE_F32), ql_cast(h.ctx, b16, QL_TYPE_F32)), t);
                    } else {
                        ql_tensor *seed = h.ints({1, 1, 1, 1}, {4321});
                        y = ql_mul(h.ctx, ql_cast(h.ctx, ql_dropout_to(h.ctx, direct ? a16 : ql_cast(h.ctx, a16, QL_TYPE_F32), 0.3f, seed, 7, t),
                                                  QL_TYPE_F32), b);
                    }
                    REQUIRE_MESSAGE(y, ql_ctx_error(h.ctx));
                    if (op == 0) CHECK(y->type == t);
                    h.run(y->type == QL_TYPE_F32 ? y : ql_cast(h.ctx, y, QL_TYPE_F32), nt);
                    got[direct][0] = h.output();
                    for (int q = 0; q < 2; q++) got[direct][q + 1] = h.grad((size_t)q);
                }
                for (int q = 0; q < 3; q++) CHECK(got[1][q] == got[0][q]);
            }
}

TEST_CASE("backward: an input feeding several multiplies sums their input gradients in the multiplies (mul_mat_acc)") {
    // y = W1 x + W2 x + W3 x, x trainable, the W frozen: dx = (W1 + W2 + W3) dy with the second and
    // third product added onto the sum so far as they are written - no separate add
    const int64_t K = 40, M = 300, N = 33;  // M > 256: products over two K blocks in backward
    for (int nt : {1, 3}) {
        INFO(nt << " threads");
        Harness h;
        ql_tensor *w[3];
        for (int i = 0; i < 3; i++) w[i] = h.input(QL_TYPE_F32, {K, M, 1, 1}, false);
        ql_tensor *x = h.input(QL_TYPE_F32, {K, N, 1, 1}, true);
        ql_tensor *y = ql_add(h.ctx, ql_add(h.ctx, ql_mul_mat(h.ctx, w[0], x), ql_mul_mat(h.ctx, w[1], x)), ql_mul_mat(h.ctx, w[2], x));
        h.run(y, nt);
        int fused = 0;
        for (int i = 0; i < ql_graph_n_nodes(h.gb); i++) {
            const ql_tensor *n = ql_graph_node(h.gb, i);
            fused += n->op == QL_OP_MUL_MAT && n->src[2] != nullptr;
        }
        CHECK(fused == 2);
        Vec ref((size_t)(K * N));
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++) {
                double v = 0;
                for (int i = 0; i < 3; i++)
                    for (int64_t m = 0; m < M; m++) v += (double)h.in_v[(size_t)i][m * K + k] * h.r_v[n * M + m];
                ref[n * K + k] = v;
            }
        CHECK(fwd_err(h.grad(3), ref) <= 1e-5);
    }
}

TEST_CASE("mul_mat with an F16 b: a gradient beyond f16's range overflows, in bf16 it does not") {
    for (ql_type t : {QL_TYPE_F16, QL_TYPE_BF16}) {
        Harness h;
        ql_tensor *a = h.input(QL_TYPE_F32, {16, 8, 1, 1}, true);
        ql_tensor *x = h.input(QL_TYPE_F32, {16, 4, 1, 1}, false);
        // dy = 1e6 r: past f16's 65504 (what a too-large loss scale does)
        h.run(ql_scale(h.ctx, ql_mul_mat(h.ctx, a, ql_cast(h.ctx, x, t)), 1e6f), 1);
        const Vec g = h.grad(0);
        const bool finite = std::all_of(g.begin(), g.end(), [](double v) { return std::isfinite(v); });
        CHECK(finite == (t == QL_TYPE_BF16));
    }
}

TEST_CASE("check_finite names the first node that makes a nan, and its sources") {
    Harness h;
    ql_tensor *a = ql_set_name(h.input(QL_TYPE_F32, {8, 4, 1, 1}, true), "wa");
    ql_tensor *x = h.input(QL_TYPE_F32, {8, 3, 1, 1}, false);
    h.run(ql_mul_mat(h.ctx, a, ql_rms_norm(h.ctx, x, 1e-5f)), 1);
    ql_graph_set_check_finite(h.graph(), true);
    h.compute();  // finite: runs through
    ((float *)a->data)[5] = NAN;
    CHECK(ql_backend_graph_compute(h.be, h.graph()) != QL_OK);
    const std::string e = ql_ctx_error(h.ctx);
    INFO(e);
    CHECK(e.find("mul_mat") != std::string::npos);
    CHECK(e.find("of wa, node 0 (rms_norm)") != std::string::npos);
    CHECK(e.find("holds nan") != std::string::npos);
}

// =============================================================================================
// get_rows, rms_norm, rope, silu, swiglu
// =============================================================================================

TEST_CASE("get_rows") {
    const int64_t E = 13, R = 11;
    struct G {
        const char *name;
        Shape idn;
        ql_type atype;
    };
    const G cases[] = {{"get_rows 1-D ids", {9, 1, 1, 1}, QL_TYPE_F32},
                       {"get_rows 2-D ids", {7, 3, 1, 1}, QL_TYPE_F32},
                       {"get_rows 3-D ids", {5, 2, 3, 1}, QL_TYPE_F32},
                       {"get_rows F16 a", {7, 3, 1, 1}, QL_TYPE_F16}};
    for (const G &g : cases) {
        std::vector<int32_t> ids(numel(g.idn));
        std::mt19937 r(77);
        for (auto &v : ids) v = (int32_t)(r() % 5) * 2;  // few distinct rows: many repeats
        ids[0] = R - 1;
        ids[1] = R - 1;
        check_op(g.name,
                 [&](Harness &h) {
                     ql_tensor *a = h.input(g.atype, {E, R, 1, 1}, g.atype == QL_TYPE_F32);
                     ql_tensor *y = ql_get_rows(h.ctx, a, h.ints(g.idn, ids));
                     REQUIRE_MESSAGE(y != nullptr, std::string(ql_ctx_error(h.ctx)));
                     CHECK(y->ne[0] == E);
                     CHECK(y->ne[1] == g.idn[0]);
                     CHECK(y->ne[2] == g.idn[1]);
                     CHECK(y->ne[3] == g.idn[2]);
                     return y;
                 },
                 [&](const Inputs &in) {
                     Vec o;
                     for (int32_t id : ids)
                         for (int64_t c = 0; c < E; ++c) o.push_back(in[0][c + E * id]);
                     return o;
                 });
    }
}

TEST_CASE("rms_norm") {
    struct N {
        const char *name;
        Shape xn;
        float eps;
        double scale;
    };
    const N cases[] = {{"rms_norm 37x7x3", {37, 7, 3, 1}, 1e-5f, 1.0},
                       {"rms_norm 131x5, eps 1e-6", {131, 5, 1, 1}, 1e-6f, 1.0},
                       {"rms_norm small values (eps matters)", {13, 9, 1, 1}, 1e-2f, 0.05}};
    for (const N &c : cases) {
        check_op(c.name,
                 [&](Harness &h) {
                     ql_tensor *x = h.input(QL_TYPE_F32, c.xn, true, -c.scale, c.scale);
                     return ql_rms_norm(h.ctx, x, c.eps);
                 },
                 [&](const Inputs &in) {
                     Vec o = in[0];
                     const int64_t n = c.xn[0];
                     for (int64_t r = 0; r < (int64_t)o.size() / n; ++r) {
                         double ss = 0;
                         for (int64_t i = 0; i < n; ++i) ss += in[0][r * n + i] * in[0][r * n + i];
                         const double f = 1 / std::sqrt(ss / n + (double)c.eps);
                         for (int64_t i = 0; i < n; ++i) o[r * n + i] = in[0][r * n + i] * f;
                     }
                     return o;
                 });
    }
}

TEST_CASE("rope") {
    const RopeCfg cases[] = {
        {14, 10, 3, 7, 2, QL_ROPE_NORMAL, false, 10000.0},
        {14, 10, 3, 7, 2, QL_ROPE_NORMAL, true, 10000.0},
        {14, 10, 3, 7, 2, QL_ROPE_NEOX, false, 10000.0},
        {14, 10, 3, 7, 2, QL_ROPE_NEOX, true, 500000.0},
        {13, 6, 5, 5, 1, QL_ROPE_NEOX, false, 10000.0},
        {22, 22, 2, 5, 3, QL_ROPE_NORMAL, true, 10000.0},  // n_dims == head_dim
    };
    for (const RopeCfg &c : cases) {
        std::vector<int32_t> pos(c.T * c.B);
        std::mt19937 r(5);
        for (auto &p : pos) p = (int32_t)(r() % 26);  // repeats, out of order, not 0..T-1
        std::string name = std::string("rope ") + (c.mode == QL_ROPE_NEOX ? "NEOX" : "NORMAL") + " hd=" +
                           std::to_string(c.hd) + " n_dims=" + std::to_string(c.nd) +
                           (c.ff ? " freq_factors" : "");
        check_op(name,
                 [&](Harness &h) {
                     ql_tensor *x = h.input(QL_TYPE_F32, {c.hd, c.nh, c.T, c.B}, true);
                     ql_tensor *ff = c.ff ? h.input(QL_TYPE_F32, {c.nd / 2, 1, 1, 1}, false, 1.0, 4.0) : nullptr;
                     ql_tensor *p = h.ints({c.T, c.B, 1, 1}, pos);
                     return ql_rope(h.ctx, x, p, ff, c.nd, c.mode, (float)c.base);
                 },
                 [&](const Inputs &in) {
                     const double fb = (double)(float)c.base;
                     RopeCfg cc = c;
                     cc.base = fb;
                     return ref_rope(in[0], pos, c.ff ? &in[1] : nullptr, cc);
                 });
    }
}

TEST_CASE("silu and swiglu") {
    const Shape xn = {37, 13, 3, 1};
    check_op("silu",
             [&](Harness &h) { return ql_silu(h.ctx, h.input(QL_TYPE_F32, xn, true, -6, 6)); },
             [](const Inputs &in) {
                 Vec o = in[0];
                 for (double &v : o) v = silu(v);
                 return o;
             });
    check_op("swiglu",
             [&](Harness &h) {
                 ql_tensor *a = h.input(QL_TYPE_F32, xn, true, -6, 6);
                 ql_tensor *b = h.input(QL_TYPE_F32, xn, true);
                 return ql_swiglu(h.ctx, a, b);
             },
             [](const Inputs &in) {
                 Vec o = in[0];
                 for (size_t i = 0; i < o.size(); ++i) o[i] = silu(in[0][i]) * in[1][i];
                 return o;
             });
}

// =============================================================================================
// flash_attn
// =============================================================================================

namespace {
void check_attn(const std::string &name, const AttnCfg &c) {
    std::vector<int32_t> seg;
    if (c.seg) {
        REQUIRE(c.Tq == c.Tk);
        std::mt19937 r(11);
        for (int b = 0; b < c.B; ++b) {
            int id = 3 + 10 * b, left = 1 + (int)(r() % 9);
            for (int j = 0; j < c.Tk; ++j) {
                if (left-- == 0) { ++id; left = (int)(r() % 17); }
                seg.push_back(id);
            }
        }
    }
    check_op(name,
             [&](Harness &h) {
                 // as a llama model has them: [d, H, T, B] then permute(0, 2, 1, 3) -> [d, T, H, B]
                 ql_tensor *ql = h.input(QL_TYPE_F32, {c.d, c.H, c.Tq, c.B}, true);
                 ql_tensor *kl = h.input(QL_TYPE_F32, {c.d, c.Hkv, c.Tk, c.B}, true);
                 ql_tensor *vl = h.input(QL_TYPE_F32, {c.dv, c.Hkv, c.Tk, c.B}, true);
                 ql_tensor *qs = c.q_from_op ? ql_scale(h.ctx, ql, 1.0f) : ql;
                 ql_tensor *q = ql_permute(h.ctx, qs, 0, 2, 1, 3);
                 ql_tensor *k = ql_permute(h.ctx, kl, 0, 2, 1, 3);
                 ql_tensor *v = ql_permute(h.ctx, vl, 0, 2, 1, 3);
                 REQUIRE(q != nullptr);
                 CHECK(q->ne[1] == c.Tq);
                 CHECK(q->ne[2] == c.H);
                 ql_tensor *s = c.seg ? h.ints({c.Tk, c.B, 1, 1}, seg) : nullptr;
                 ql_tensor *o = ql_flash_attn(h.ctx, q, k, v, s, (float)c.scale);
                 REQUIRE_MESSAGE(o != nullptr, ql_ctx_error(h.ctx));
                 CHECK(o->ne[0] == c.dv);
                 CHECK(o->ne[1] == c.H);
                 CHECK(o->ne[2] == c.Tq);
                 CHECK(o->ne[3] == c.B);
                 return o;
             },
             [&](const Inputs &in) {
                 AttnCfg cc = c;
                 cc.scale = (double)(float)c.scale;
                 return ref_attn(in[0], in[1], in[2], seg, cc);
             });
}
}  // namespace

TEST_CASE("flash_attn") {
    //                 d  dv   H Hkv  Tq  Tk  B   seg    scale                 q_from_op
    check_attn("attn H==Hkv Tq==Tk", {19, 19, 3, 3, 13, 13, 2, false, 1 / std::sqrt(19.0), false});
    check_attn("attn GQA H=4*Hkv", {17, 17, 12, 3, 11, 11, 1, false, 0.5, false});
    check_attn("attn Tq<Tk (kv cache), GQA", {13, 13, 4, 1, 5, 37, 2, false, 0.6, false});
    check_attn("attn Tq=1 decode", {13, 13, 2, 2, 1, 23, 2, false, 0.6, false});
    check_attn("attn seg (packed documents), long T", {19, 19, 2, 2, 67, 67, 2, true, 0.5, false});
    check_attn("attn seg, GQA, q from an op", {11, 11, 4, 1, 29, 29, 2, true, 0.7, true});
    check_attn("attn dv != d", {13, 7, 3, 3, 9, 21, 1, false, 0.4, false});
}

TEST_CASE("flash_attn backward: the fused pass and the two passes give the same bits") {
    // B * Hkv = 2 items: fused (FlashAttention-2, 5 products a tile) at 1 and 2 threads, the two
    // passes (dq by query blocks, dk/dv by key blocks) at 3 and 4 - the same sums in the same order
    struct C { int64_t d, dv, H, Hkv, Tq, Tk, B; bool seg; };
    for (const C c : {C{16, 16, 4, 1, 150, 150, 2, true}, C{24, 20, 4, 2, 70, 135, 1, false},
                      C{64, 64, 2, 2, 200, 200, 1, false}, C{13, 13, 3, 1, 67, 67, 2, true}}) {
        std::vector<int32_t> seg;
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t j = 0; j < c.Tk; ++j) seg.push_back((int32_t)(b * 100 + j / 37));  // documents of 37
        Vec first[4];
        for (int nt : {1, 2, 3, 4}) {
            INFO("d " << c.d << " H " << c.H << " Hkv " << c.Hkv << " Tq " << c.Tq << " Tk " << c.Tk << ", " << nt << " threads");
            Harness h;
            ql_tensor *q = h.input(QL_TYPE_F32, {c.d, c.Tq, c.H, c.B}, true, -2, 2);
            ql_tensor *k = h.input(QL_TYPE_F32, {c.d, c.Tk, c.Hkv, c.B}, true, -2, 2);
            ql_tensor *v = h.input(QL_TYPE_F32, {c.dv, c.Tk, c.Hkv, c.B}, true);
            h.run(ql_flash_attn(h.ctx, q, k, v, c.seg ? h.ints({c.Tk, c.B, 1, 1}, seg) : nullptr, 0.3f), nt);
            const Vec got[4] = {h.output(), h.grad(0), h.grad(1), h.grad(2)};
            for (int i = 0; i < 4; i++) {
                double mx = 0;
                for (double x : got[i]) mx = std::max(mx, std::fabs(x));
                CHECK(mx > 1e-3);  // gradients that are there to compare
                if (nt == 1) first[i] = got[i];
                else CHECK_MESSAGE(got[i] == first[i], "output/grad " << i << " differs from 1 thread's");
            }
        }
    }
}

TEST_CASE("flash_attn in bf16 (ql_flash_attn_set_prec): near the f32 result, rounded where native, the same bits for any thread count") {
    {
        ql_init_params ip = {1u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *x = ql_new_tensor_4d(ctx, QL_TYPE_F32, 8, 5, 2, 1);
        ql_tensor *a = ql_flash_attn(ctx, x, x, x, nullptr, 0.5f);
        CHECK(ql_flash_attn_set_prec(a, QL_TYPE_F16) == QL_ERR_TYPE);
        CHECK(ql_flash_attn_set_prec(x, QL_TYPE_BF16) == QL_ERR_INVALID);
        CHECK(ql_flash_attn_set_prec(nullptr, QL_TYPE_BF16) == QL_ERR_INVALID);
        CHECK(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
        ql_free(ctx);
    }
    // where AVX512-BF16 is there the products are bf16: within bf16's rounding of the f32 result
    // but not equal to it; elsewhere the request is declined and the result is f32's
    const bool native = ql_cpu_bf16_native();
    struct C { int64_t d, dv, H, Hkv, Tq, Tk, B; bool seg; };
    for (const C c : {C{64, 64, 4, 2, 150, 150, 2, false}, C{13, 21, 3, 1, 67, 67, 2, true}, C{40, 40, 2, 2, 30, 100, 1, false}}) {
        std::vector<int32_t> seg;
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t j = 0; j < c.Tk; ++j) seg.push_back((int32_t)(b * 100 + j / 29));
        Vec f32[4], first[4];
        for (int run = 0; run < 4; run++) {  // f32 at 1 thread, then bf16 at 1, 2 and 3
            const int nt = run == 0 ? 1 : run;
            INFO("d " << c.d << " dv " << c.dv << " Tq " << c.Tq << " Tk " << c.Tk << std::string(run ? " bf16, " : " f32, ") << nt << " threads");
            Harness h;
            ql_tensor *q = h.input(QL_TYPE_F32, {c.d, c.Tq, c.H, c.B}, true, -2, 2);
            ql_tensor *k = h.input(QL_TYPE_F32, {c.d, c.Tk, c.Hkv, c.B}, true, -2, 2);
            ql_tensor *v = h.input(QL_TYPE_F32, {c.dv, c.Tk, c.Hkv, c.B}, true);
            ql_tensor *a = ql_flash_attn(h.ctx, q, k, v, c.seg ? h.ints({c.Tk, c.B, 1, 1}, seg) : nullptr, 0.3f);
            if (run) REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
            h.run(a, nt);
            const Vec got[4] = {h.output(), h.grad(0), h.grad(1), h.grad(2)};
            for (int i = 0; i < 4; i++) {
                if (run == 0) { f32[i] = got[i]; continue; }
                const double e = fwd_err(got[i], f32[i]);
                if (verbose()) MESSAGE("bf16 attention, output/grad " << i << ": " << e << " from f32");
                CHECK_MESSAGE(e <= 2e-2, "output/grad " << i << ": " << e << " from f32's");
                if (native) CHECK_MESSAGE(e > 1e-5, "output/grad " << i << " not rounded: " << e);
                else CHECK(got[i] == f32[i]);
                if (run == 1) first[i] = got[i];
                else CHECK_MESSAGE(got[i] == first[i], "output/grad " << i << " differs from 1 thread's");
            }
        }
    }
}

TEST_CASE("mul_mat_scaled_to: the bits of ql_scale_to(ql_mul_mat(a, b), s, type), forward and backward, in one node") {
    // the dot path (a few f32 columns), the packed one, a 16-bit b (its result in 16 bits), 1 and 2 threads
    struct C { int64_t K, M, N; ql_type bt; };
    for (const C c : {C{64, 16, 3, QL_TYPE_F32}, C{96, 40, 300, QL_TYPE_F32}, C{64, 16, 200, QL_TYPE_BF16}, C{72, 24, 5, QL_TYPE_F16}})
        for (int nt : {1, 2}) {
            INFO("K " << c.K << " M " << c.M << " N " << c.N << " b " << std::string(ql_type_name(c.bt)) << ", " << nt << " threads");
            Vec out[2], ga[2], gb[2];
            for (int one = 0; one < 2; one++) {
                Harness h;
                ql_tensor *a = h.input(QL_TYPE_F32, {c.K, c.M, 1, 1}, true), *b = h.input(c.bt, {c.K, c.N, 1, 1}, c.bt == QL_TYPE_F32);
                ql_tensor *y = one ? ql_mul_mat_scaled_to(h.ctx, a, b, 0.37f, c.bt) : ql_scale_to(h.ctx, ql_mul_mat(h.ctx, a, b), 0.37f, c.bt);
                REQUIRE_MESSAGE(y != nullptr, std::string(ql_ctx_error(h.ctx)));
                CHECK(y->op == (one ? QL_OP_MUL_MAT : QL_OP_SCALE));
                CHECK(ql_mul_mat_alpha(y) == (one ? 0.37f : 1.0f));
                h.run(c.bt == QL_TYPE_F32 ? y : ql_cast(h.ctx, y, QL_TYPE_F32), nt);
                int n_scale = 0;
                for (int i = 0; i < ql_graph_n_nodes(h.gf); i++) n_scale += ql_graph_node(h.gf, i)->op == QL_OP_SCALE;
                CHECK(n_scale == (one ? 0 : 1));  // forward: the scale is the product's own
                out[one] = h.output();
                ga[one] = h.grad(0);
                if (c.bt == QL_TYPE_F32) gb[one] = h.grad(1);
            }
            CHECK(out[0] == out[1]);
            CHECK(ga[0] == ga[1]);
            CHECK(gb[0] == gb[1]);
            double mx = 0;
            for (float v : out[1]) mx = std::max(mx, (double)std::fabs(v));
            CHECK(mx > 0.1);  // (not all zeros)
        }
    // s == 1 is the plain product; a scale is a MUL_MAT's only
    Harness h;
    ql_tensor *a = h.input(QL_TYPE_F32, {8, 4, 1, 1}, true), *b = h.input(QL_TYPE_F32, {8, 3, 1, 1}, false);
    CHECK(ql_mul_mat_alpha(ql_mul_mat_scaled_to(h.ctx, a, b, 1.0f, QL_TYPE_F32)) == 1.0f);
    CHECK(ql_mul_mat_alpha(ql_mul_mat(h.ctx, a, b)) == 1.0f);
    CHECK(ql_mul_mat_alpha(ql_scale(h.ctx, a, 3.0f)) == 1.0f);
    CHECK(ql_mul_mat_alpha(nullptr) == 1.0f);
    CHECK(ql_mul_mat_scaled_to(h.ctx, a, b, 2.0f, QL_TYPE_BF16) == nullptr);  // a 16-bit result needs a 16-bit b
}

TEST_CASE("flash_attn's score budget: a device's chunk of queries, its backward's too; bad budgets refused") {
    // q [16, 600, 4, 1]: a chunk's scores are c x 600 x 4 f32 - the default budget (32 MiB) takes
    // the largest chunk (256), 1 MiB 64 (its scores 600 KiB; 128 would be 1.2 MiB)
    Harness h;
    ql_tensor *q = h.input(QL_TYPE_F32, {16, 600, 4, 1}, true), *k = h.input(QL_TYPE_F32, {16, 600, 2, 1}, true),
              *v = h.input(QL_TYPE_F32, {16, 600, 2, 1}, true);
    ql_tensor *a = ql_flash_attn(h.ctx, q, k, v, nullptr, 0.25f);
    REQUIRE(a != nullptr);
    auto chunk = [](const ql_tensor *n) {
        int64_t c = -1;
        ql_cuda_fa_layout(n, 90, nullptr, &c, nullptr);
        return c;
    };
    CHECK(ql_flash_attn_chunk_rows(600, 600, 4, 1, 0) == 256);
    CHECK(ql_flash_attn_chunk_rows(600, 600, 4, 1, (size_t)1 << 20) == 64);
    CHECK(ql_flash_attn_chunk_rows(100, 600, 4, 1, 0) == 100);  // all of Tq
    CHECK(ql_flash_attn_chunk_rows(4096, 4096, 32, 8, 0) == 16);  // never below 16
    CHECK(chunk(a) == 256);
    const size_t ws_default = ql_cuda_work_size(a, 90);
    CHECK(ql_flash_attn_set_score_bytes(nullptr, (size_t)1 << 20) == QL_ERR_INVALID);
    CHECK(ql_flash_attn_set_score_bytes(q, (size_t)1 << 20) == QL_ERR_INVALID);           // not an attention
    CHECK(ql_flash_attn_set_score_bytes(a, ((size_t)3 << 20) / 2) == QL_ERR_INVALID);      // not whole MiB
    CHECK(ql_flash_attn_set_score_bytes(a, (size_t)INT32_MAX * 2 << 20) == QL_ERR_INVALID);  // past 2^31 MiB
    CHECK(chunk(a) == 256);  // (refused: unchanged)
    REQUIRE(ql_flash_attn_set_score_bytes(a, (size_t)1 << 20) == QL_OK);
    CHECK(chunk(a) == 64);
    CHECK(ql_cuda_work_size(a, 90) < ws_default);
    h.run(a, 1);
    int n_back = 0;
    for (int i = 0; i < ql_graph_n_nodes(h.gb); i++) {
        const ql_tensor *n = ql_graph_node(h.gb, i);
        if (n->op != QL_OP_FLASH_ATTN_BACK) continue;
        n_back++;
        CHECK(chunk(n) == 64);  // the forward's budget
        CHECK(ql_cuda_node_launches(n, 90, false) == 3 + 7 * 10);  // 600 / 64: 10 chunks, the last of 24
    }
    CHECK(n_back == 1);
    REQUIRE(ql_flash_attn_set_score_bytes(a, 0) == QL_OK);  // the default again
    CHECK(chunk(a) == 256);
}

TEST_CASE("the fused attention backward's dK/dV slices: the rule, the workspace, the census") {
    // headers only: the plan's functions read shapes. bf16 attention, both directions fused
    const int mode = ql_cuda_fa_get_mode();
    ql_cuda_fa_set_mode(QL_CUDA_FA_FUSED);
    struct C { int64_t d, T, H, Hkv, B; int split; };
    const C cases[] = {
        {64, 2048, 32, 8, 1, 4},   // the 1B shape: 32 key blocks x 8 kv heads = 256 blocks -> all 4 heads apart
        {128, 2048, 32, 8, 1, 4},  // the 8B shape
        {64, 4096, 32, 8, 1, 2},   // 512 blocks: two slices of 2 heads
        {64, 8192, 32, 8, 1, 1},   // 1024 blocks: enough
        {64, 2048, 32, 32, 1, 1},  // MHA: nothing to split
        {64, 100, 12, 2, 1, 6},    // rep 6: a divisor each time (2, 3, 6), up to 6
        {64, 3000, 12, 2, 1, 6},   // 47 x 2 blocks: 3 would make 282 - not enough, 6 is all
        {64, 9000, 12, 2, 1, 6},   // 141 x 2 blocks: 2 slices make 564, 3 846, then 6 (4 and 5 do not divide 6)
        {64, 12000, 12, 2, 1, 3},  // 188 x 2: 2 make 752, 3 make 1128 - enough
        {64, 2048, 32, 8, 4, 1},   // batch 4: 1024 blocks
    };
    for (const C &c : cases) {
        INFO("d " << c.d << ", T " << c.T << ", heads " << c.H << "/" << c.Hkv << ", batch " << c.B);
        ql_init_params ip{64u << 20, nullptr, true, false};
        ql_context *ctx = ql_init(ip);
        REQUIRE(ctx != nullptr);
        auto leaf = [&](int64_t h) { return ql_cast(ctx, ql_set_param(ql_new_tensor_4d(ctx, QL_TYPE_F32, c.d, c.T, h, c.B)), QL_TYPE_BF16); };
        ql_tensor *q = leaf(c.H), *k = leaf(c.Hkv), *v = leaf(c.Hkv);
        ql_tensor *a = ql_flash_attn(ctx, q, k, v, nullptr, 0.125f);
        REQUIRE(a != nullptr);
        REQUIRE(ql_flash_attn_set_prec(a, QL_TYPE_BF16) == QL_OK);
        ql_tensor *loss = ql_sum(ctx, ql_cast(ctx, a, QL_TYPE_F32));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb != nullptr, ql_ctx_error(ctx));
        int n_back = 0;
        for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
            const ql_tensor *n = ql_graph_node(gb, i);
            if (n->op != QL_OP_FLASH_ATTN_BACK) continue;
            n_back++;
            REQUIRE(ql_cuda_fa_fused(n));
            CHECK(ql_cuda_fa2_kv_split(n) == c.split);
            CHECK(ql_cuda_fa2_kv_split(a) == 1);  // (the forward has no slices)
            size_t off[QL_CUDA_FA_NBUF];
            const size_t with = ql_cuda_fa_layout(n, 90, off, nullptr, nullptr);
            const int was = ql_cuda_fa2_set_split(0);
            CHECK(ql_cuda_fa2_kv_split(n) == 1);
            const size_t without = ql_cuda_fa_layout(n, 90, nullptr, nullptr, nullptr);
            ql_cuda_fa2_set_split(was);
            const size_t parts = c.split > 1 ? (size_t)c.split * (size_t)(2 * c.d * c.T * c.Hkv * c.B) * sizeof(float) : 0;
            CHECK(with == without + parts);  // the slices' partials, f32
            CHECK(off[QL_CUDA_FA_S] == without);  // after delta and dO's copy
            CHECK(ql_cuda_node_launches(n, 90, false) == 3);  // delta, dK/dV, dQ (+ the sums)
        }
        CHECK(n_back == 1);
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_free(ctx);
    }
    ql_cuda_fa_set_mode(mode);
}

TEST_CASE("flash_attn backward with a 16-bit output: dO read in its type, both passes the same bits, near f32's") {
    // 16-bit q, k, v (a 16-bit compute type's): autodiff hands backward dO rounded to the output's
    // type. Both CPU paths (B * Hkv = 2 items: the fused pass at 1 and 2 threads, the two passes at
    // 3 and 4) widen it alike: the same bits; within the type's rounding of the f32 attention's
    // gradients on the same (rounded) inputs. Several query blocks and key tiles, GQA, documents.
    struct C { int64_t d, dv, H, Hkv, Tq, Tk, B; bool seg; };
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16})
        for (const C c : {C{16, 16, 4, 1, 150, 150, 2, true}, C{24, 20, 4, 2, 70, 135, 1, false}, C{64, 64, 6, 2, 200, 200, 1, false}}) {
            std::vector<int32_t> seg;
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t j = 0; j < c.Tk; ++j) seg.push_back((int32_t)(b * 100 + j / 37));
            Vec f32[3], first[3];
            for (int run = 0; run < 5; run++) {  // f32 at 1 thread, then 16-bit at 1 .. 4
                const int nt = run == 0 ? 1 : run;
                INFO(std::string(ql_type_name(t)) << " d " << c.d << " H " << c.H << " Hkv " << c.Hkv << " Tq " << c.Tq << " Tk " << c.Tk
                                     << (run ? ", 16-bit, " : ", f32, ") << nt << " threads");
                Harness h;
                ql_tensor *q = h.input(QL_TYPE_F32, {c.d, c.Tq, c.H, c.B}, true, -2, 2);
                ql_tensor *k = h.input(QL_TYPE_F32, {c.d, c.Tk, c.Hkv, c.B}, true, -2, 2);
                ql_tensor *v = h.input(QL_TYPE_F32, {c.dv, c.Tk, c.Hkv, c.B}, true);
                auto in = [&](ql_tensor *x) {  // the same rounded values either way; f32 reads them widened
                    ql_tensor *r = ql_cast(h.ctx, x, t);
                    return run ? r : ql_cast(h.ctx, r, QL_TYPE_F32);
                };
                ql_tensor *a = ql_flash_attn(h.ctx, in(q), in(k), in(v), c.seg ? h.ints({c.Tk, c.B, 1, 1}, seg) : nullptr, 0.3f);
                REQUIRE(a != nullptr);
                h.run(run ? ql_cast(h.ctx, a, QL_TYPE_F32) : a, nt);
                int n_back = 0;
                for (int i = 0; i < ql_graph_n_nodes(h.gb); i++) {
                    const ql_tensor *n = ql_graph_node(h.gb, i);
                    if (n->op != QL_OP_FLASH_ATTN_BACK) continue;
                    n_back++;
                    CHECK(n->src[5]->type == (run ? t : QL_TYPE_F32));  // f32 attention: dO as it was
                }
                CHECK(n_back == 1);
                const Vec got[3] = {h.grad(0), h.grad(1), h.grad(2)};
                for (int i = 0; i < 3; i++) {
                    if (run == 0) {
                        f32[i] = got[i];
                        continue;
                    }
                    const double e = fwd_err(got[i], f32[i]);
                    if (verbose()) MESSAGE(std::string(ql_type_name(t)) << " attention, grad " << i << ": " << e << " from f32");
                    CHECK_MESSAGE(e <= (t == QL_TYPE_BF16 ? 1e-2 : 2e-3), "grad " << i << ": " << e << " from f32's");
                    CHECK_MESSAGE(e > 1e-6, "grad " << i << ": dO not rounded? " << e);
                    if (run == 1) first[i] = got[i];
                    else CHECK_MESSAGE(got[i] == first[i], "grad " << i << " differs from 1 thread's");
                }
            }
        }
}

// =============================================================================================
// cross_entropy
// =============================================================================================

TEST_CASE("cross_entropy") {
    struct X {
        const char *name;
        Shape ln;
        double range;
    };
    const X cases[] = {{"cross_entropy 37x13", {37, 13, 1, 1}, 3.0},
                       {"cross_entropy 3-D logits, large values", {67, 5, 3, 1}, 12.0}};
    for (const X &c : cases) {
        const int64_t V = c.ln[0], N = c.ln[1] * c.ln[2];
        std::vector<int32_t> tg(N);
        std::mt19937 r(3);
        for (auto &t : tg) t = (int32_t)(r() % V);
        tg[1] = -1;
        tg[4] = -100;
        tg[N - 1] = -1;
        tg[N - 3] = (int32_t)V - 1;
        tg[0] = 0;
        int kept = 0;
        for (int32_t t : tg) kept += t >= 0;
        const double count = kept + 7.5;  // normalisation not tied to the kept rows
        check_op(c.name,
                 [&](Harness &h) {
                     ql_tensor *lg = h.input(QL_TYPE_F32, c.ln, true, -c.range, c.range);
                     ql_tensor *cnt = h.input(QL_TYPE_F32, {1, 1, 1, 1}, false);
                     h.set(1, 0, count);
                     ql_tensor *t = h.ints({c.ln[1], c.ln[2], c.ln[3], 1}, tg);
                     return ql_cross_entropy(h.ctx, lg, t, cnt);
                 },
                 [&](const Inputs &in) {
                     double L = 0;
                     for (int64_t n = 0; n < N; ++n) {
                         if (tg[n] < 0) continue;
                         const double *x = &in[0][n * V];
                         double mx = -INFINITY, z = 0;
                         for (int64_t v = 0; v < V; ++v) mx = std::max(mx, x[v]);
                         for (int64_t v = 0; v < V; ++v) z += std::exp(x[v] - mx);
                         L += (mx + std::log(z) - x[tg[n]]) / in[1][0];
                     }
                     return Vec{L};
                 },
                 Tol(),
                 [&](Harness &h) {  // rows with an ignored target get exactly zero gradient
                     const Vec g = h.grad(0);
                     for (int64_t n = 0; n < N; ++n) {
                         if (tg[n] >= 0) continue;
                         int64_t nz = 0;
                         for (int64_t v = 0; v < V; ++v) nz += g[n * V + v] != 0.0;
                         CHECK_MESSAGE(nz == 0, "row " << n << " (target " << tg[n] << ") has " << nz
                                                       << " non-zero gradient elements");
                     }
                 });
    }
}

// =============================================================================================
// dropout
// =============================================================================================

TEST_CASE("dropout") {
    const float p = 0.3f;
    const Shape xn = {101, 99, 1, 1};  // 9999 elements
    const int64_t n = numel(xn);
    const double keep_scale = 1.0 / (1.0 - (double)p);
    std::vector<bool> mask_first;
    for (int nt : {1, 3}) {
        INFO("dropout, " << nt << " thread(s)");
        Harness h;
        ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
        ql_tensor *seed = ql_set_input(h.ints({1, 1, 1, 1}, {42}));
        ql_tensor *y = ql_dropout(h.ctx, x, p, seed, 7u);
        h.run(y, nt);

        // every element is 0 or x/(1-p); the gradient is r * keep / (1-p)
        auto check_run = [&](std::vector<bool> &mask) {
            const Vec yv = h.output(), g = h.grad(0);
            int64_t kept = 0, bad_val = 0, bad_grad = 0;
            mask.assign(n, false);
            for (int64_t i = 0; i < n; ++i) {
                const double xv = h.in_v[0][i], want = xv * keep_scale;
                if (yv[i] != 0) {
                    mask[i] = true;
                    ++kept;
                    if (!(std::fabs(yv[i] - want) <= 1e-6 * std::fabs(want))) ++bad_val;
                }
                const double gw = mask[i] ? h.r_v[i] * keep_scale : 0.0;
                if (!(std::fabs(g[i] - gw) <= 1e-6 * std::fabs(gw) + 1e-30)) ++bad_grad;
            }
            CHECK_MESSAGE(bad_val == 0, bad_val << " kept elements differ from x/(1-p)");
            CHECK_MESSAGE(bad_grad == 0, bad_grad << " gradient elements differ from r*keep/(1-p)");
            const double frac = (double)kept / (double)n;  // sd ~ 0.0046 for 1 - p = 0.7
            CHECK_MESSAGE(std::fabs(frac - 0.7) < 0.03, "kept fraction " << frac);
        };
        std::vector<bool> m1, m2, m3;
        check_run(m1);
        {  // the mask is the documented hash, whatever the SIMD path: element e survives when the high
           // half of mix64(mix64(seed << 32 | stream) + G (e + 1)) >= p 2^32 (splitmix64's finaliser)
            auto mix = [](uint64_t z) {
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
                z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
                return z ^ (z >> 31);
            };
            const uint64_t key = mix((uint64_t)42 << 32 | 7u);
            const uint32_t thr = (uint32_t)((double)p * 4294967296.0);
            int64_t wrong = 0;
            for (int64_t e = 0; e < n; ++e)
                wrong += m1[e] != ((uint32_t)(mix(key + 0x9E3779B97F4A7C15ull * (uint64_t)(e + 1)) >> 32) >= thr);
            CHECK_MESSAGE(wrong == 0, wrong << " elements of the mask are not the hash's");
        }
        if (nt == 1) mask_first = m1;
        else CHECK_MESSAGE(m1 == mask_first, "the mask depends on the thread count");

        h.compute();  // same seed: same mask
        check_run(m2);
        CHECK(m2 == m1);

        ((int32_t *)seed->data)[0] = 43;  // another step: another mask
        h.compute();
        check_run(m3);
        int64_t diff = 0;
        for (int64_t i = 0; i < n; ++i) diff += m3[i] != m1[i];
        CHECK_MESSAGE(diff > n / 10, "seed 42 and 43 masks differ in only " << diff << " elements");
    }

    // a 16-bit result: the cast of the f32 result, bit for bit, and the same gradient
    for (ql_type t : {QL_TYPE_BF16, QL_TYPE_F16}) {
        INFO("dropout to " << ql_type_name(t));
        Vec out[2], grad[2];
        for (int fused = 0; fused < 2; fused++) {
            Harness h;
            ql_tensor *x = h.input(QL_TYPE_F32, {131, 9, 1, 1}, true, -3, 3);
            ql_tensor *seed = ql_set_input(h.ints({1, 1, 1, 1}, {5}));
            ql_tensor *d = fused ? ql_dropout_to(h.ctx, x, 0.2f, seed, 3u, t) : ql_cast(h.ctx, ql_dropout(h.ctx, x, 0.2f, seed, 3u), t);
            REQUIRE(d != nullptr);
            CHECK(d->type == t);
            h.run(ql_cast(h.ctx, d, QL_TYPE_F32), 2);
            out[fused] = h.output();
            grad[fused] = h.grad(0);
        }
        CHECK(out[1] == out[0]);
        CHECK(grad[1] == grad[0]);
        int64_t zeros = 0;
        for (double v : out[1]) zeros += v == 0;
        CHECK(zeros > 100);  // ~20% of 1179 dropped
        CHECK(zeros < 400);
    }
    {
        Harness h;
        ql_tensor *x = h.input(QL_TYPE_F32, {8, 2, 1, 1}, true);
        ql_tensor *seed = ql_set_input(h.ints({1, 1, 1, 1}, {5}));
        CHECK(ql_dropout_to(h.ctx, x, 0.2f, seed, 3u, QL_TYPE_Q8_0) == nullptr);
        CHECK(std::string(ql_ctx_error(h.ctx)).find("result type q8_0") != std::string::npos);
    }

    // a forward-only graph, another context: the mask depends only on (seed, stream, index);
    // another stream gives another mask
    ql_init_params ip{64u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    REQUIRE(ctx != nullptr);
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, xn[0], xn[1]);
    ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
    ((int32_t *)seed->data)[0] = 42;
    for (int64_t i = 0; i < n; ++i) ((float *)x->data)[i] = 0.5f + (float)(i % 7);
    ql_tensor *d7 = ql_set_output(ql_dropout(ctx, x, p, seed, 7u));
    ql_tensor *d8 = ql_set_output(ql_dropout(ctx, x, p, seed, 8u));
    REQUIRE(d7 != nullptr);
    REQUIRE(d8 != nullptr);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, d7) == QL_OK);
    REQUIRE(ql_graph_build_forward(g, d8) == QL_OK);
    ql_backend *be = ql_backend_cpu_init(3);
    ql_plan_stats st;
    REQUIRE(ql_graph_plan(g, be, &st) == QL_OK);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    ql_graph_set_poison(g, true);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    int64_t same7 = 0, diff78 = 0;
    for (int64_t i = 0; i < n; ++i) {
        const bool k7 = ((float *)d7->data)[i] != 0, k8 = ((float *)d8->data)[i] != 0;
        same7 += k7 == (bool)mask_first[i];
        diff78 += k7 != k8;
    }
    CHECK_MESSAGE(same7 == n, "same seed and stream, another graph: mask differs in " << n - same7);
    CHECK_MESSAGE(diff78 > n / 10, "streams 7 and 8 differ in only " << diff78 << " elements");
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

// =============================================================================================
// a result in pieces of rows: add_rows, dropout over rows of a whole
// =============================================================================================

TEST_CASE("add_rows: x with pieces added at their rows - forward and gradients (a view of dy) against the math") {
    const int64_t E = 17, N = 12;
    const int64_t at[3] = {0, 3, 8}, len[3] = {3, 5, 4};  // rows 0-2, 3-7, 8-11: the whole, in pieces
    check_op("add_rows chain",
             [&](Harness &h) {
                 ql_tensor *r = h.input(QL_TYPE_F32, {E, N, 1, 1}, true);
                 for (int i = 0; i < 3; i++) r = ql_add_rows(h.ctx, r, h.input(QL_TYPE_F32, {E, len[i], 1, 1}, true), at[i]);
                 return r;
             },
             [&](const Inputs &in) {
                 Vec o = in[0];
                 for (int i = 0; i < 3; i++)
                     for (int64_t j = 0; j < E * len[i]; j++) o[(size_t)(at[i] * E + j)] += in[(size_t)i + 1][(size_t)j];
                 return o;
             });
    // the FFN in chunks: each piece a function of rows of a itself. Backward hands a all of dy at
    // the chain's last link and adds each piece's gradient onto its rows of that one sum (no
    // src-sized view_back), each piece reading its rows of dy off the sum (still dy's there); where
    // pieces share rows, a piece reads dy itself
    auto pieces_of_a = [&](const int64_t *p0, const int64_t *pn, int np, bool apart) {
        const std::string what = apart ? "apart" : "sharing rows";
        check_op("add_rows chain of pieces made from rows of a, " + what,
                 [&](Harness &h) {
                     ql_tensor *a = h.input(QL_TYPE_F32, {E, N, 1, 1}, true), *r = a;
                     for (int i = 0; i < np; i++) {
                         ql_tensor *v = ql_view_2d(h.ctx, a, E, pn[i], a->nb[1], (size_t)p0[i] * a->nb[1]);
                         r = ql_add_rows(h.ctx, r, ql_mul(h.ctx, v, v), p0[i]);
                     }
                     return r;
                 },
                 [&](const Inputs &in) {
                     Vec o = in[0];
                     for (int i = 0; i < np; i++)
                         for (int64_t j = p0[i] * E; j < (p0[i] + pn[i]) * E; j++) o[(size_t)j] += in[0][(size_t)j] * in[0][(size_t)j];
                     return o;
                 },
                 Tol(), [&](Harness &h) {
                     int whole = 0;  // a-sized gradients made: a view_back, dy added at the end
                     for (int i = 0; i < ql_graph_n_nodes(h.gb); i++) {
                         const ql_tensor *t = ql_graph_node(h.gb, i);
                         whole += (t->op == QL_OP_VIEW_BACK || t->op == QL_OP_ADD) && ql_nelements(t) == E * N;
                     }
                     CHECK(whole == 0);
                 });
    };
    pieces_of_a(at, len, 3, true);
    const int64_t at2[2] = {0, 3}, len2[2] = {6, 6};  // rows 0-5 and 3-8
    pieces_of_a(at2, len2, 2, false);
    check_op("add_rows, a part of the rows, b a strided view, a 3-d a",
             [&](Harness &h) {
                 ql_tensor *a = h.input(QL_TYPE_F32, {E, 4, 3, 1}, true), *b = h.input(QL_TYPE_F32, {E + 5, 2, 1, 1}, true);
                 return ql_add_rows(h.ctx, a, ql_view_2d(h.ctx, b, E, 2, b->nb[1], 2 * sizeof(float)), 7);
             },
             [&](const Inputs &in) {
                 Vec o = in[0];
                 for (int64_t r = 0; r < 2; r++)
                     for (int64_t j = 0; j < E; j++) o[(size_t)((7 + r) * E + j)] += in[1][(size_t)(r * (E + 5) + 2 + j)];
                 return o;
             });
}

TEST_CASE("add_rows: the bits of ql_add; a chain goes in place; bad shapes are refused") {
    ql_init_params ip{16u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    const int64_t E = 64, N = 40;
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, E, N), *y = ql_new_tensor_2d(ctx, QL_TYPE_F32, E, N);
    for (int64_t i = 0; i < E * N; i++) ((float *)x->data)[i] = 0.1f * (float)((i * 37) % 101) - 5.0f;
    for (int64_t i = 0; i < E * N; i++) ((float *)y->data)[i] = 0.01f * (float)((i * 53) % 97) - 0.3f;
    ql_tensor *whole = ql_add(ctx, x, y);
    ql_tensor *r = ql_scale(ctx, x, 1.0f);  // a result that dies in the chain: the chain may go in place from the start
    for (int64_t r0 = 0; r0 < N; r0 += 10) r = ql_add_rows(ctx, r, ql_view_2d(ctx, y, E, 10, y->nb[1], (size_t)(r0 * E) * 4), r0);
    ql_set_output(whole);
    ql_set_output(r);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, whole) == QL_OK);
    REQUIRE(ql_graph_build_forward(g, r) == QL_OK);
    ql_backend *be = ql_backend_cpu_init(2);
    ql_plan_stats st;
    REQUIRE(ql_graph_plan(g, be, &st) == QL_OK);
    CHECK(st.n_inplace >= 4);  // each add_rows over the tensor before it
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    CHECK(memcmp(whole->data, r->data, ql_nbytes(r)) == 0);
    // refused, with the op in the message
    CHECK(ql_add_rows(ctx, x, ql_new_tensor_2d(ctx, QL_TYPE_F32, E, 3), N - 2) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)).find("add_rows: b [64, 3") != std::string::npos);
    ql_ctx_clear_error(ctx);
    CHECK(ql_add_rows(ctx, x, ql_new_tensor_2d(ctx, QL_TYPE_F32, E - 1, 3), 0) == nullptr);
    ql_ctx_clear_error(ctx);
    CHECK(ql_add_rows(ctx, ql_transpose(ctx, x), ql_new_tensor_2d(ctx, QL_TYPE_F32, N, 3), 0) == nullptr);  // a not contiguous
    ql_ctx_clear_error(ctx);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("to_device: a host leaf's copy in the graph; anything else refused with the op in the message") {
    ql_init_params ip{1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *dev = ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 4);  // not flagged QL_FLAG_HOST
    CHECK(ql_to_device(ctx, dev) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)).find("to_device: [8, 4") != std::string::npos);
    ql_ctx_clear_error(ctx);
    ql_tensor *host = ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 4);
    host->flags |= QL_FLAG_HOST;
    CHECK(ql_to_device(ctx, ql_transpose(ctx, host)) == nullptr);  // a view, not a leaf
    ql_ctx_clear_error(ctx);
    for (int i = 0; i < 32; i++) ((float *)host->data)[i] = 0.5f * (float)i;
    ql_tensor *y = ql_to_device(ctx, host);
    REQUIRE_MESSAGE(y, ql_ctx_error(ctx));
    CHECK(y->op == QL_OP_TO_DEVICE);
    ql_set_output(y);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, y) == QL_OK);
    ql_backend *be = ql_backend_cpu_init(1);
    REQUIRE(ql_graph_plan(g, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    CHECK(memcmp(y->data, host->data, 32 * sizeof(float)) == 0);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("backward: each parameter's accumulation runs as soon as its gradient is complete, not at the end") {
    ql_init_params ip{8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    const int L = 6;
    ql_tensor *h = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 16));
    for (int i = 0; i < 8 * 16; i++) ((float *)h->data)[i] = 0.01f * (float)(i % 13);
    std::vector<ql_tensor *> w;
    for (int l = 0; l < L; l++) {
        w.push_back(ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 8)));
        for (int i = 0; i < 64; i++) ((float *)w.back()->data)[i] = 0.1f * (float)((i * 7 + l) % 5) - 0.2f;
        h = ql_mul_mat(ctx, w.back(), h);
    }
    ql_tensor *loss = ql_sum(ctx, h);
    ql_graph *gf = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
    std::unordered_map<const ql_tensor *, int> pos;
    for (int i = 0; i < ql_graph_n_nodes(gb); i++) pos[ql_graph_node(gb, i)] = i;
    // a gradient that is one product is added onto the grad as it is multiplied (mul_mat_rows
    // adding over the grad's rows, right after its operands); else acc_grad right after it
    int accs = 0, products = 0;
    for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
        const ql_tensor *t = ql_graph_node(gb, i);
        if (t->op == QL_OP_MUL_MAT_ROWS && (t->src[0]->flags & QL_FLAG_GRAD)) {
            products++;
            int last = -1;
            for (int s = 1; s <= 2; s++)
                if (pos.count(t->src[s])) last = std::max(last, pos[t->src[s]]);
            CHECK(i == last + 1);
            continue;
        }
        if (t->op != QL_OP_ACC_GRAD) continue;
        accs++;
        REQUIRE(pos.count(t->src[1]));
        CHECK(i == pos[t->src[1]] + 1);  // right after its gradient: that gradient dies there
    }
    CHECK(accs + products == L);
    CHECK(products == L);  // each w's gradient is one product
    ql_backend *be = ql_backend_cpu_init(1);  // (the gradients' values: every other autodiff test)
    REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
    REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
    ql_graph_zero_grads(gb);
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
    // a second run adds onto the first (accumulation over micro-batches): twice the gradient
    std::vector<std::vector<float>> once;
    for (ql_tensor *p : w) once.emplace_back((const float *)p->grad->data, (const float *)p->grad->data + 64);
    REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
    for (int l = 0; l < L; l++) {
        double worst = 0, amax = 0;
        for (int i = 0; i < 64; i++) {
            worst = std::max(worst, std::fabs((double)((const float *)w[l]->grad->data)[i] - 2.0 * once[l][i]));
            amax = std::max(amax, std::fabs((double)once[l][i]));
        }
        CAPTURE(l);
        CHECK(amax > 0);
        CHECK(worst <= 1e-6 * amax);
    }
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("dropout over rows of a whole (ql_dropout_rows_to): the whole's mask, forward and backward") {
    const float p = 0.25f;
    const int64_t E = 33, N = 20, r0 = 7, k = 9;
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16}) {
        CAPTURE(ql_type_name(t));
        ql_init_params ip{16u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_tensor *x = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, N));
        for (int64_t i = 0; i < E * N; i++) ((float *)x->data)[i] = 0.5f + 0.01f * (float)(i % 89);
        ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
        ((int32_t *)seed->data)[0] = 1234;
        ql_tensor *whole = ql_dropout_to(ctx, x, p, seed, 3, t);
        ql_tensor *piece = ql_dropout_rows_to(ctx, ql_view_2d(ctx, x, E, k, x->nb[1], (size_t)(r0 * E) * 4), p, seed, 3, t, r0);
        REQUIRE(piece);
        ql_set_output(whole);
        ql_set_output(piece);
        // the loss reads the piece only: x's gradient is the piece's mask in the piece's rows, 0 elsewhere
        ql_tensor *loss = ql_sum(ctx, ql_cast(ctx, piece, QL_TYPE_F32));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, whole) == QL_OK);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        ql_backend *be = ql_backend_cpu_init(2);
        REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        REQUIRE(ql_backend_graph_zero_grads(be, gb) == QL_OK);
        REQUIRE(ql_backend_graph_compute(be, gb) == QL_OK);
        const size_t es = t == QL_TYPE_F32 ? 4 : 2;
        CHECK(memcmp(piece->data, (const uint8_t *)whole->data + (size_t)(r0 * E) * es, (size_t)(k * E) * es) == 0);
        int64_t wrong = 0, kept = 0;
        for (int64_t i = 0; i < E * N; i++) {
            const int64_t row = i / E;
            const bool in = row >= r0 && row < r0 + k;
            const float w = t == QL_TYPE_F32 ? ((float *)whole->data)[i] : ql_bf16_to_fp32(((uint16_t *)whole->data)[i]);
            const float g = ((float *)x->grad->data)[i], want = in && w != 0 ? 1.0f / (1.0f - p) : 0.0f;
            wrong += g != want;
            kept += in && w != 0;
        }
        CHECK(wrong == 0);
        CHECK(kept > k * E / 2);
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_backend_free(be);
        ql_free(ctx);
    }
}

// =============================================================================================
// a product with its b dropped out as it is read (ql_mul_mat_dropout: LoRA's A dropout(x))
// =============================================================================================

// element e of the whole survives dropout p under (seed, stream): qlora.h's documented hash, written out
static bool ref_keep(int32_t seed, uint32_t stream, int64_t e, float p) {
    auto mix = [](uint64_t z) {
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    };
    const uint64_t key = mix((uint64_t)(uint32_t)seed << 32 | stream);
    return (uint32_t)(mix(key + 0x9E3779B97F4A7C15ull * (uint64_t)(e + 1)) >> 32) >= (uint32_t)((double)p * 4294967296.0);
}

TEST_CASE("mul_mat_dropout: a dropout(x) against the math, gradients by central differences (rows of a whole, batches)") {
    const float p = 0.3f;
    const double ks = 1.0 / (1.0 - (double)p);
    // x [K, N, B2] rows r0.. of a whole: element (k, row) draws the whole's mask at (r0 + row) K + k
    struct Cfg { int64_t K, M, N, B2, r0; };
    for (const Cfg c : {Cfg{37, 5, 11, 1, 0}, Cfg{70, 16, 9, 3, 0}, Cfg{33, 7, 13, 1, 6}}) {
        INFO("K " << c.K << " M " << c.M << " N " << c.N << " B2 " << c.B2 << " row0 " << c.r0);
        check_op("mul_mat_dropout",
                 [&](Harness &h) {
                     ql_tensor *a = h.input(QL_TYPE_F32, {c.K, c.M, 1, 1}, true), *x = h.input(QL_TYPE_F32, {c.K, c.N, c.B2, 1}, true);
                     ql_tensor *seed = ql_set_input(h.ints({1, 1, 1, 1}, {77}));
                     return ql_mul_mat_dropout(h.ctx, a, x, p, seed, 9u, QL_TYPE_F32, c.r0);
                 },
                 [&](const Inputs &in) {
                     Vec o((size_t)(c.M * c.N * c.B2));
                     for (int64_t row = 0; row < c.N * c.B2; row++)
                         for (int64_t m = 0; m < c.M; m++) {
                             double acc = 0;
                             for (int64_t k = 0; k < c.K; k++)
                                 if (ref_keep(77, 9u, (c.r0 + row) * c.K + k, p)) acc += in[0][(size_t)(m * c.K + k)] * in[1][(size_t)(row * c.K + k)] * ks;
                             o[(size_t)(row * c.M + m)] = acc;
                         }
                     return o;
                 });
    }
}

// The unfused pair's bits: ql_mul_mat(a, ql_dropout_rows_to(x, ...)) - forward, a's and x's
// gradients - for every multiply type, x of each type, a piece of rows of a whole, 1 and 3 threads
TEST_CASE("mul_mat_dropout: the bits of mul_mat over ql_dropout_rows_to, forward and backward") {
    const float p = 0.2f;
    const int64_t K = 96, M = 8, N = 40, r0 = 9, n = 19;  // x: rows r0 .. r0 + n of a whole [K, N]
    for (ql_type t : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16})
        for (ql_type xt : {QL_TYPE_F32, QL_TYPE_BF16})
            for (int nt : {1, 3}) {
                INFO(std::string(ql_type_name(t)) << " multiply, x " << std::string(ql_type_name(xt)) << ", " << nt << " threads");
                std::vector<float> y[2], ga[2], gx[2];
                for (int fused = 0; fused < 2; fused++) {
                    ql_init_params ip{16u << 20, nullptr, false, false};
                    ql_context *ctx = ql_init(ip);
                    ql_tensor *a = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, K, M));
                    ql_tensor *w = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, K, N));
                    for (int64_t i = 0; i < K * M; i++) ((float *)a->data)[i] = 0.05f * (float)((i * 29) % 41) - 1.0f;
                    for (int64_t i = 0; i < K * N; i++) ((float *)w->data)[i] = 0.37f * (float)((i * 53) % 97) / 7.0f - 2.3f;
                    ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
                    ((int32_t *)seed->data)[0] = 31;
                    ql_tensor *xw = xt == QL_TYPE_F32 ? w : ql_cast(ctx, w, xt);  // the whole, then a piece of its rows
                    ql_tensor *x = ql_view_2d(ctx, xw, K, n, xw->nb[1], (size_t)r0 * xw->nb[1]);
                    ql_tensor *u = fused ? ql_mul_mat_dropout(ctx, a, x, p, seed, 4u, t, r0)
                                         : ql_mul_mat(ctx, a, ql_dropout_rows_to(ctx, x, p, seed, 4u, t, r0));
                    REQUIRE_MESSAGE(u, ql_ctx_error(ctx));
                    CHECK(u->op == (fused ? QL_OP_MUL_MAT_DROPOUT : QL_OP_MUL_MAT));
                    ql_tensor *r = ql_new_tensor_2d(ctx, QL_TYPE_F32, M, n);
                    for (int64_t i = 0; i < M * n; i++) ((float *)r->data)[i] = 0.01f * (float)((i * 7) % 23) - 0.1f;
                    ql_set_output(u);
                    ql_tensor *loss = ql_sum(ctx, ql_mul(ctx, u, r));
                    ql_graph *gf = ql_graph_new(ctx);
                    REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
                    ql_graph *gb = ql_graph_backward(ctx, gf, loss);
                    REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
                    int n_fused = 0;
                    for (int i = 0; i < ql_graph_n_nodes(gb); i++) n_fused += ql_graph_node(gb, i)->op == QL_OP_MUL_MAT_DROPOUT;
                    // forward, da's and dx's: no dropped-out copy anywhere; unfused, dx's too (the
                    // dropout's backward over the product that read its copy)
                    CHECK(n_fused == (fused ? 3 : 1));
                    ql_backend *be = ql_backend_cpu_init(nt);
                    REQUIRE(ql_graph_plan(gb, be, nullptr) == QL_OK);
                    REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
                    ql_graph_set_poison(gb, true);
                    ql_graph_zero_grads(gb);
                    REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
                    y[fused].assign((const float *)u->data, (const float *)u->data + M * n);
                    ga[fused].assign((const float *)a->grad->data, (const float *)a->grad->data + K * M);
                    gx[fused].assign((const float *)w->grad->data, (const float *)w->grad->data + K * N);
                    ql_graph_free(gb);
                    ql_graph_free(gf);
                    ql_backend_free(be);
                    ql_free(ctx);
                }
                CHECK(y[1] == y[0]);
                CHECK(ga[1] == ga[0]);
                CHECK(gx[1] == gx[0]);
                {  // dx in one node has the bits of its three: dropout(aᵀ dc) as forward ops (dc = r in
                   // the multiply's type), x's gradient in the piece's rows
                    ql_init_params ip{16u << 20, nullptr, false, false};
                    ql_context *ctx = ql_init(ip);
                    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, K, M);
                    for (int64_t i = 0; i < K * M; i++) ((float *)a->data)[i] = 0.05f * (float)((i * 29) % 41) - 1.0f;
                    ql_tensor *r = ql_new_tensor_2d(ctx, QL_TYPE_F32, M, n);
                    for (int64_t i = 0; i < M * n; i++) ((float *)r->data)[i] = 0.01f * (float)((i * 7) % 23) - 0.1f;
                    ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
                    ((int32_t *)seed->data)[0] = 31;
                    ql_tensor *dc = t == QL_TYPE_F32 ? r : ql_cast(ctx, r, t);
                    ql_tensor *dx = ql_dropout_rows_to(ctx, ql_mul_mat(ctx, ql_transpose(ctx, a), dc), p, seed, 4u, QL_TYPE_F32, r0);
                    REQUIRE_MESSAGE(dx, ql_ctx_error(ctx));
                    ql_set_output(dx);
                    ql_graph *g = ql_graph_new(ctx);
                    REQUIRE(ql_graph_build_forward(g, dx) == QL_OK);
                    ql_backend *be = ql_backend_cpu_init(nt);
                    REQUIRE(ql_graph_plan(g, be, nullptr) == QL_OK);
                    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
                    REQUIRE_MESSAGE(ql_backend_graph_compute(be, g) == QL_OK, ql_ctx_error(ctx));
                    CHECK(std::vector<float>((const float *)dx->data, (const float *)dx->data + K * n) ==
                          std::vector<float>(gx[1].begin() + r0 * K, gx[1].begin() + (r0 + n) * K));
                    ql_graph_free(g);
                    ql_backend_free(be);
                    ql_free(ctx);
                }
                int64_t zeros = 0, outside = 0;  // x's gradient: the piece's mask in its rows, nothing elsewhere
                for (int64_t i = 0; i < K * N; i++) {
                    const bool in = i / K >= r0 && i / K < r0 + n;
                    zeros += in && gx[1][(size_t)i] == 0.0f;
                    outside += !in && gx[1][(size_t)i] != 0.0f;
                }
                CHECK(outside == 0);
                CHECK(zeros > K * n / 10);
                CHECK(zeros < K * n / 3);
            }
}

TEST_CASE("mul_mat_dropout: bad input is refused with the op's name") {
    ql_init_params ip{4u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, 16, 4), *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 16, 5);
    ql_tensor *seed = ql_new_tensor_1d(ctx, QL_TYPE_I32, 1);
    CHECK(ql_mul_mat_dropout(ctx, a, x, 1.0f, seed, 0, QL_TYPE_BF16, 0) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)).find("mul_mat_dropout: p = 1") != std::string::npos);
    ql_ctx_clear_error(ctx);
    CHECK(ql_mul_mat_dropout(ctx, a, ql_new_tensor_2d(ctx, QL_TYPE_F32, 15, 5), 0.1f, seed, 0, QL_TYPE_BF16, 0) == nullptr);
    ql_ctx_clear_error(ctx);
    CHECK(ql_mul_mat_dropout(ctx, a, x, 0.1f, x, 0, QL_TYPE_BF16, 0) == nullptr);  // the seed
    ql_ctx_clear_error(ctx);
    CHECK(ql_mul_mat_dropout(ctx, a, x, 0.1f, seed, 0, QL_TYPE_Q8_0, 0) == nullptr);
    ql_ctx_clear_error(ctx);
    CHECK(ql_mul_mat_dropout(ctx, a, ql_transpose(ctx, ql_new_tensor_2d(ctx, QL_TYPE_F32, 5, 16)), 0.1f, seed, 0, QL_TYPE_BF16, 0) ==
          nullptr);  // x without dense rows
    ql_ctx_clear_error(ctx);
    ql_tensor *ok = ql_mul_mat_dropout(ctx, a, x, 0.1f, seed, 0, QL_TYPE_BF16, 3);
    REQUIRE(ok);
    CHECK(ok->type == QL_TYPE_F32);
    CHECK((ok->ne[0] == 4 && ok->ne[1] == 5));
    ql_free(ctx);
}

// =============================================================================================
// bad input
// =============================================================================================

TEST_CASE("bad input: NULL result, message with op and file:line, first error kept") {
    ql_init_params ip{16u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    REQUIRE(ctx != nullptr);
    CHECK(ql_ctx_status(ctx) == QL_OK);
    CHECK(std::string(ql_ctx_error(ctx)).empty());

    ql_tensor *a = ql_new_tensor_2d(ctx, QL_TYPE_F32, 7, 5);
    ql_tensor *b = ql_new_tensor_2d(ctx, QL_TYPE_F32, 8, 3);
    ql_tensor *c3 = ql_new_tensor_2d(ctx, QL_TYPE_F32, 3, 5);
    REQUIRE(a != nullptr);
    REQUIRE(b != nullptr);
    REQUIRE(c3 != nullptr);

    // mul_mat: K mismatch
    CHECK(ql_mul_mat(ctx, a, b) == nullptr);
    const std::string e1 = ql_ctx_error(ctx);
    CHECK_MESSAGE(e1.find("mul_mat") != std::string::npos, e1);
    CHECK_MESSAGE(e1.find(".cpp:") != std::string::npos, e1);
    CHECK(ql_ctx_status(ctx) == QL_ERR_SHAPE);

    // a NULL source: NULL, no new message
    CHECK(ql_add(ctx, nullptr, a) == nullptr);
    CHECK(ql_silu(ctx, nullptr) == nullptr);
    CHECK(ql_mul_mat(ctx, a, nullptr) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)) == e1);
    CHECK(ql_ctx_status(ctx) == QL_ERR_SHAPE);

    // a second bad op: still NULL, the first error is kept
    CHECK(ql_add(ctx, a, c3) == nullptr);
    CHECK(std::string(ql_ctx_error(ctx)) == e1);

    // add: 7 % 3 != 0
    ql_ctx_clear_error(ctx);
    CHECK(ql_ctx_status(ctx) == QL_OK);
    CHECK(std::string(ql_ctx_error(ctx)).empty());
    CHECK(ql_add(ctx, a, c3) == nullptr);
    const std::string e2 = ql_ctx_error(ctx);
    CHECK_MESSAGE(e2.find("add") != std::string::npos, e2);
    CHECK_MESSAGE(e2.find(".cpp:") != std::string::npos, e2);
    CHECK(ql_ctx_status(ctx) == QL_ERR_SHAPE);

    // mul_mat: b's batch not a multiple of a's
    ql_ctx_clear_error(ctx);
    ql_tensor *a3 = ql_new_tensor_3d(ctx, QL_TYPE_F32, 7, 4, 2);
    ql_tensor *b3 = ql_new_tensor_3d(ctx, QL_TYPE_F32, 7, 3, 3);
    CHECK(ql_mul_mat(ctx, a3, b3) == nullptr);
    CHECK(ql_ctx_status(ctx) == QL_ERR_SHAPE);
    CHECK(std::string(ql_ctx_error(ctx)).find("mul_mat") != std::string::npos);

    // get_rows with F32 ids: a type error
    ql_ctx_clear_error(ctx);
    ql_tensor *fids = ql_new_tensor_1d(ctx, QL_TYPE_F32, 3);
    CHECK(ql_get_rows(ctx, a, fids) == nullptr);
    const std::string e3 = ql_ctx_error(ctx);
    CHECK(ql_ctx_status(ctx) == QL_ERR_TYPE);
    CHECK_MESSAGE(e3.find("get_rows") != std::string::npos, e3);
    CHECK_MESSAGE(e3.find(".cpp:") != std::string::npos, e3);

    // the context still works after clearing
    ql_ctx_clear_error(ctx);
    CHECK(ql_add(ctx, a, a) != nullptr);
    CHECK(ql_ctx_status(ctx) == QL_OK);
    ql_free(ctx);
}

// =============================================================================================
// more shapes and paths (from the first code review)
// =============================================================================================

TEST_CASE("flash_attn: longer, wider heads, Tq < Tk with GQA, segments across tiles") {
    check_attn("attn Tq<Tk big, GQA, d>64", {80, 72, 4, 2, 45, 130, 2, false, 0.1, false});
    check_attn("attn seg long, d>64", {70, 70, 2, 1, 150, 150, 1, true, 0.1, true});
    check_attn("attn Tq=33 Tk=33 GQA", {16, 16, 6, 2, 33, 33, 2, false, 0.3, false});
}
TEST_CASE("mul_mat: packed path with batches, broadcast, transposes, F16, K = 1") {
    check_mul_mat("mm packed batched bcast", {40, 37, 70, 2, 1, 6, 2, false, false});
    check_mul_mat("mm packed batched bcast a^T", {40, 37, 70, 2, 2, 6, 4, true, false});
    check_mul_mat("mm packed b^T big", {300, 45, 100, 1, 1, 1, 1, false, true});
    check_mul_mat("mm F16 packed", {300, 45, 100, 1, 1, 2, 1, false, false}, QL_TYPE_F16);
    check_mul_mat("mm F16 transposed", {33, 45, 100, 1, 1, 1, 1, true, false}, QL_TYPE_F16);
    check_mul_mat("mm F16 transposed dot", {33, 45, 5, 1, 1, 1, 1, true, false}, QL_TYPE_F16);
    check_mul_mat("mm K=1", {1, 45, 100, 1, 1, 1, 1, false, false});
    check_mul_mat("mm K=1 dot", {1, 45, 3, 1, 1, 1, 1, false, false});
}
TEST_CASE("rope on a permuted (non-contiguous) view") {
    RopeCfg c{14, 10, 3, 7, 2, QL_ROPE_NEOX, false, 10000.0};
    std::vector<int32_t> pos(c.T * c.B);
    for (size_t i = 0; i < pos.size(); i++) pos[i] = (int)(i * 3 % 17);
    check_op("rope permuted",
             [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, {c.hd, c.T, c.nh, c.B}, true);
                 ql_tensor *xp = ql_permute(h.ctx, ql_scale(h.ctx, x, 1.0f), 0, 2, 1, 3);  // [hd, nh, T, B]
                 return ql_rope(h.ctx, xp, h.ints({c.T, c.B, 1, 1}, pos), nullptr, c.nd, c.mode, (float)c.base);
             },
             [&](const Inputs &in) {
                 Vec xs = ref_permute(in[0], {c.hd, c.T, c.nh, c.B}, {0, 2, 1, 3});
                 return ref_rope(xs, pos, nullptr, c);
             });
}
TEST_CASE("view of a view, gradient into the source") {
    const Shape xn = {13, 7, 5, 3};
    check_op("view of view",
             [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, xn, true);
                 ql_tensor *v1 = ql_view_2d(h.ctx, x, 13, 20, 52, 52 * 3);
                 return ql_view_2d(h.ctx, v1, 5, 6, 104, 8);
             },
             [&](const Inputs &in) { return ref_strided(in[0], {5, 6, 1, 1}, {4, 104, 0, 0}, 52 * 3 + 8); });
}
TEST_CASE("one tensor reaching an op through several paths") {
    const Shape xn = {9, 5, 1, 1};
    check_op("x*x", [&](Harness &h) { ql_tensor *x = h.input(QL_TYPE_F32, xn, true); return ql_mul(h.ctx, x, x); },
             [](const Inputs &in) { Vec o = in[0]; for (double &v : o) v = v * v; return o; });
    check_op("swiglu(x,x)", [&](Harness &h) { ql_tensor *x = h.input(QL_TYPE_F32, xn, true); return ql_swiglu(h.ctx, x, x); },
             [](const Inputs &in) { Vec o = in[0]; for (double &v : o) v = silu(v) * v; return o; });
    check_op("mul_mat(x,x)", [&](Harness &h) { ql_tensor *x = h.input(QL_TYPE_F32, xn, true); return ql_mul_mat(h.ctx, x, x); },
             [](const Inputs &in) { MM s{9, 5, 5, 1, 1, 1, 1, false, false}; return ref_mul_mat(in[0], in[0], s); });
    check_op("cast f16 then mm", [&](Harness &h) {
                 ql_tensor *x = h.input(QL_TYPE_F32, xn, true, -1, 1);
                 ql_tensor *b = h.input(QL_TYPE_F32, {9, 4, 1, 1}, true);
                 return ql_mul_mat(h.ctx, ql_cast(h.ctx, ql_cast(h.ctx, x, QL_TYPE_F16), QL_TYPE_F32), b); },
             [](const Inputs &in) { MM s{9, 5, 4, 1, 1, 1, 1, false, false}; Vec a = in[0]; for (double &v : a) v = round_f16(v); return ref_mul_mat(a, in[1], s); },
             Tol{1e-5, 2e-3, 1e-4},
             nullptr,
             [](const Inputs &in) { MM s{9, 5, 4, 1, 1, 1, 1, false, false}; return ref_mul_mat(in[0], in[1], s); });
    check_attn("attn small, Hkv == H", {8, 8, 2, 2, 7, 7, 1, false, 0.5, false});
}

TEST_CASE("silu and softmax-style exp on NaN / inf inputs: NaN stays NaN, no undefined conversion") {
    // the vector exp's exponent is converted to int; a NaN there was undefined behaviour on the
    // portable path (caught by clang's -fsanitize=float-cast-overflow in make test-portable)
    ql_init_params ip = {1u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *x = ql_new_tensor_1d(ctx, QL_TYPE_F32, 8);
    const float in[8] = {NAN, INFINITY, -INFINITY, 0.0f, 1.0f, -1.0f, 100.0f, -100.0f};
    memcpy(x->data, in, sizeof(in));
    ql_tensor *y = ql_silu(ctx, x);
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, y) == QL_OK);
    ql_backend *be = ql_backend_cpu_init(1);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    const float *o = (const float *)y->data;
    CHECK(std::isnan(o[0]));
    CHECK(o[1] == INFINITY);
    CHECK(!(o[2] > 0.0f));  // -inf * sigmoid(-inf): the clamped exp leaves -inf (or NaN), never a positive value
    CHECK(o[3] == 0.0f);
    CHECK(o[4] == doctest::Approx(0.7310586));
    CHECK(o[6] == doctest::Approx(100.0));
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
}
