// Recompute (gradient checkpointing) on the graph: segments found where a transformer's
// residual stream passes, any mix of keep levels gives the gradients of no recompute bit for
// bit, and saved activations shrink.
#include "tiny.h"

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

namespace {

// loss and every gradient of one run of tm's training graph (after `levels`, if given)
std::vector<float> grads_with(const std::vector<ql_keep> *levels, ql_recompute_stats *rs, ql_plan_stats *ps, bool poison) {
    tiny_model tm(16, 2, 29, 5);
    REQUIRE(tm.gb);
    const int n_seg = ql_graph_segments(tm.gb, nullptr, 0);
    if (levels) {
        REQUIRE((int)levels->size() == n_seg);
        REQUIRE_MESSAGE(ql_graph_recompute(tm.gb, levels->data(), n_seg, rs) == QL_OK, ql_ctx_error(tm.ctx));
    }
    ql_backend *be = ql_backend_cpu_init(2);
    ql_graph_set_poison(tm.gb, poison);
    REQUIRE_MESSAGE(ql_graph_plan(tm.gb, be, ps) == QL_OK, ql_ctx_error(tm.ctx));
    REQUIRE(ql_graph_alloc(tm.gb, be) == QL_OK);
    ql_graph_zero_grads(tm.gb);
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, tm.gb) == QL_OK, ql_ctx_error(tm.ctx));
    std::vector<float> out{*(const float *)tm.loss->data};
    for (int i = 0; i < ql_graph_n_params(tm.gb); i++) {
        const ql_tensor *g = ql_graph_param(tm.gb, i)->grad;
        out.insert(out.end(), (const float *)g->data, (const float *)g->data + ql_nelements(g));
    }
    ql_backend_free(be);
    return out;
}

}  // namespace

TEST_CASE("recompute: a 2-layer llama has 4 segments, their inputs the residual stream") {
    tiny_model tm(16, 2, 29, 5);
    std::vector<ql_tensor *> in(8, nullptr);
    const int n = ql_graph_segments(tm.gb, in.data(), 8);
    CHECK(n == 4);  // attention half and FFN half of each layer
    for (int i = 0; i < n; i++) {
        CAPTURE(i);
        REQUIRE(in[(size_t)i]);
        CHECK(in[(size_t)i]->ne[0] == 32);  // n_embd
        CHECK(in[(size_t)i]->ne[1] * in[(size_t)i]->ne[2] == 16 * 2);
    }
    CHECK(ql_graph_segments(tm.gf, nullptr, 0) == 0);  // a forward graph has no backward to feed
}

TEST_CASE("recompute: every keep level, and mixes, give the gradients of no recompute bit for bit") {
    const std::vector<float> ref = grads_with(nullptr, nullptr, nullptr, false);
    const ql_keep A = QL_KEEP_ALL, H = QL_KEEP_HEAVY, I = QL_KEEP_INPUT, N = QL_KEEP_NONE;
    const std::vector<std::vector<ql_keep>> cases = {
        {A, A, A, A}, {H, H, H, H}, {I, I, I, I}, {I, N, I, N}, {N, N, N, N}, {A, I, H, N}, {N, H, I, A},
    };
    ql_plan_stats none_ps;
    grads_with(&cases[0], nullptr, &none_ps, false);
    for (const auto &lv : cases) {
        for (bool poison : {false, true}) {
            CAPTURE(lv[0]);
            CAPTURE(lv[1]);
            CAPTURE(lv[2]);
            CAPTURE(lv[3]);
            CAPTURE(poison);
            ql_recompute_stats rs;
            ql_plan_stats ps;
            const std::vector<float> got = grads_with(&lv, &rs, &ps, poison);
            REQUIRE(got.size() == ref.size());
            CHECK(memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0);
            CHECK(rs.n_segments == 4);
            const bool all = lv == cases[0];
            CHECK((rs.n_recomputed == 0) == all);
            CHECK((rs.recompute_flops == 0) == all);
            CHECK(rs.recompute_flops <= rs.forward_flops);
            CHECK(ps.bytes[QL_MEM_SAVED] <= none_ps.bytes[QL_MEM_SAVED]);
            if (!all) CHECK(ps.recompute_peak > 0);
        }
    }
}
