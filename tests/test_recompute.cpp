// Recompute (gradient checkpointing) on the graph: segments found where a transformer's
// residual stream passes, any mix of keep levels gives the gradients of no recompute bit for
// bit, and saved activations shrink.
#include "tiny.h"

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

namespace {

// the loss and every parameter's gradient after a run of gb, as raw floats
std::vector<float> loss_and_grads(const ql_graph *gb, const ql_tensor *loss) {
    std::vector<float> out{*(const float *)loss->data};
    for (int i = 0; i < ql_graph_n_params(gb); i++) {
        const ql_tensor *g = ql_graph_param(gb, i)->grad;
        out.insert(out.end(), (const float *)g->data, (const float *)g->data + ql_nelements(g));
    }
    return out;
}

// a 2-layer stack over a graph input x [E, T] (as the trainer's embedding rows uploaded from the
// host), every weight trainable, loss = sum(h * h); x[i] = a * ((i * b) % c) - 0.5
struct stack_over_input {
    ql_context *ctx = nullptr;
    ql_llama m;
    ql_tensor *loss = nullptr;
    ql_graph *gf = nullptr;
    stack_over_input(uint64_t seed, int64_t ffn_chunk, float a, int b, int c, int T = 16) {
        ql_init_params ip = {32u << 20, nullptr, false, false};
        ctx = ql_init(ip);
        ql_llama_create(ctx, &m, tiny_hparams(29, 32, 48), QL_TYPE_F32, false);
        ql_llama_randomize(&m, seed, 0.1f);
        ql_llama_set_params(&m);
        m.ffn_chunk = ffn_chunk;
        const int64_t E = m.hp.n_embd;
        ql_tensor *x = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, T));
        ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1));
        for (int i = 0; i < E * T; i++) ((float *)x->data)[i] = a * (float)((i * b) % c) - 0.5f;
        for (int t = 0; t < T; t++) ((int32_t *)pos->data)[t] = t;
        ql_tensor *h = ql_llama_hidden(ctx, &m, ql_reshape_3d(ctx, x, E, T, 1), pos, nullptr);
        loss = ql_sum(ctx, ql_mul(ctx, h, h));
        gf = ql_graph_new(ctx);
        ql_graph_build_forward(gf, loss);
    }
    ~stack_over_input() {
        ql_graph_free(gf);
        ql_free(ctx);
    }
};

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
    const std::vector<float> out = loss_and_grads(tm.gb, tm.loss);
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

// A stack whose input is a graph input (the trainer's embedding rows uploaded from the host, a
// later stage of a split): block 0's first norm has no op before it, so it is a run of one node
// between two cuts, as is the o projection read only by the residual add. They join the segment
// next to them - recomputed like the rest of the block, not alive through the whole step.
TEST_CASE("recompute: a stack over a graph input keeps none of block 0 under KEEP_NONE") {
    const int T = 16, L = 2;
    stack_over_input st(7, 0, 0.05f, 7, 23, T);
    ql_context *ctx = st.ctx;
    ql_graph *gf = st.gf;
    ql_tensor *loss = st.loss;
    const int64_t E = st.m.hp.n_embd;
    REQUIRE(st.m.hp.n_layer == L);
    auto run = [&](bool recompute, ql_plan_stats *ps) {
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        std::vector<ql_tensor *> in(16, nullptr);
        const int n = ql_graph_segments(gb, in.data(), 16);
        CHECK(n == 2 * L);
        REQUIRE(in[0]);
        CHECK(in[0]->op == QL_OP_RMS_NORM);  // block 0's first norm starts the first segment
        if (recompute) {
            const std::vector<ql_keep> none((size_t)n, QL_KEEP_NONE);
            REQUIRE_MESSAGE(ql_graph_recompute(gb, none.data(), n, nullptr) == QL_OK, ql_ctx_error(ctx));
        }
        ql_backend *be = ql_backend_cpu_init(1);
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, ps) == QL_OK, ql_ctx_error(ctx));
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        const std::vector<float> out = loss_and_grads(gb, loss);
        ql_backend_free(be);
        ql_graph_free(gb);
        return out;
    };
    ql_plan_stats kept, none;
    const std::vector<float> ref = run(false, &kept), got = run(true, &none);
    REQUIRE(got.size() == ref.size());
    CHECK(memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    // saved under KEEP_NONE: what follows the last segment (the head's input, the final norm and
    // its product, read by their backward: three [E, T]) - none of block 0 (its norm and its o
    // projection were two more, kept before)
    const size_t row = (size_t)E * T * sizeof(float);
    MESSAGE("saved: no recompute ", kept.bytes[QL_MEM_SAVED], ", every segment KEEP_NONE ", none.bytes[QL_MEM_SAVED], " ([E, T] = ", row, ")");
    CHECK(none.bytes[QL_MEM_SAVED] <= 3 * row + 64);
}

// Offload with the FFN in chunks: the FFN's input (a segment input under KEEP_INPUT) is read in
// backward through views of its rows. Those views are made again over the copy brought back, so
// the checkpoint itself dies at its copy to the host - before, the forward views kept it on the
// device through backward (31 x [E, T] f32 at the 8B shape). Gradients equal no offload's.
TEST_CASE("recompute: offloaded checkpoints read through row views die at their copy to the host") {
    stack_over_input st(9, 5, 0.04f, 5, 29);  // 16 rows: FFN chunks of 5, 5, 5, 1
    ql_context *ctx = st.ctx;
    ql_graph *gf = st.gf;
    ql_tensor *loss = st.loss;
    auto run = [&](bool offload) {
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        const int n = ql_graph_segments(gb, nullptr, 0);
        std::vector<ql_tensor *> in((size_t)n, nullptr);
        ql_graph_segments(gb, in.data(), n);
        const std::vector<ql_keep> input((size_t)n, QL_KEEP_INPUT);
        REQUIRE_MESSAGE(ql_graph_recompute(gb, input.data(), n, nullptr) == QL_OK, ql_ctx_error(ctx));
        std::vector<ql_tensor *> off;
        for (ql_tensor *t : in)
            if (t->op == QL_OP_MUL_MAT && t->src[2]) off.push_back(t);  // the FFN halves' inputs (x + attention: the o projection onto x)
        CHECK(off.size() == 2);
        if (offload) REQUIRE_MESSAGE(ql_graph_offload(gb, off.data(), (int)off.size()) == QL_OK, ql_ctx_error(ctx));
        ql_backend *be = ql_backend_cpu_init(1);
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, nullptr) == QL_OK, ql_ctx_error(ctx));
        if (offload) {
            const ql_plan_entry *e;
            const int ne = ql_graph_plan_entries(gb, &e);
            int found = 0;
            for (int k = 0; k < ne; k++)
                for (ql_tensor *t : off)
                    if (e[k].tensor == t) {
                        found++;
                        CHECK(e[k].last < ql_graph_n_forward(gb));  // its last reader: the copy to the host
                    }
            CHECK(found == 2);
        }
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        const std::vector<float> out = loss_and_grads(gb, loss);
        ql_backend_free(be);
        ql_graph_free(gb);
        return out;
    };
    const std::vector<float> ref = run(false), got = run(true);
    REQUIRE(got.size() == ref.size());
    CHECK(memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0);
}

TEST_CASE("recompute: offloaded late, a block's checkpoint comes back twice and is on the device only around its readers; gradients parked") {
    stack_over_input st(4, 0, 0.03f, 7, 31);
    auto run = [&](int flags) {
        ql_graph *gb = ql_graph_backward(st.ctx, st.gf, st.loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(st.ctx));
        const int n = ql_graph_segments(gb, nullptr, 0);
        std::vector<ql_tensor *> in((size_t)n, nullptr);
        ql_graph_segments(gb, in.data(), n);
        std::vector<ql_keep> block((size_t)n, QL_KEEP_NONE);  // as the trainer's block: one checkpoint a block
        std::vector<ql_tensor *> off;
        for (int i = 0; i < n; i++)
            if (std::string(in[(size_t)i]->name) == "blk.1.in") block[(size_t)i] = QL_KEEP_INPUT, off.push_back(in[(size_t)i]);
        REQUIRE(off.size() == 1);
        REQUIRE_MESSAGE(ql_graph_recompute(gb, block.data(), n, nullptr) == QL_OK, ql_ctx_error(st.ctx));
        if (flags >= 0) REQUIRE_MESSAGE(ql_graph_offload_ex(gb, off.data(), 1, flags) == QL_OK, ql_ctx_error(st.ctx));
        ql_backend *be = ql_backend_cpu_init(1);
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, nullptr) == QL_OK, ql_ctx_error(st.ctx));
        if (flags == QL_OFFLOAD_LATE) {  // two copies back: the first dies before the second is made
            const ql_plan_entry *e;
            const int ne = ql_graph_plan_entries(gb, &e);
            std::vector<const ql_plan_entry *> backs;
            for (int k = 0; k < ne; k++)
                if (e[k].tensor->op == QL_OP_TO_DEVICE) backs.push_back(&e[k]);
            REQUIRE(backs.size() == 2);
            CHECK(backs[0]->last < backs[1]->first);
            CHECK(backs[1]->first > backs[0]->first + 50);  // (the block's backward in between)
        }
        if (flags > 0 && (flags & QL_OFFLOAD_GRADS)) {  // backward's results parked across attention's backward
            const ql_plan_entry *e;
            const int ne = ql_graph_plan_entries(gb, &e), nf = ql_graph_n_forward(gb);
            int parked = 0;
            for (int k = 0; k < ne; k++) {
                if (!e[k].host || e[k].first < nf) continue;
                parked++;
                const ql_tensor *src = e[k].tensor->src[0];
                bool attn_between = false;  // the copy back comes after an attention backward
                int back = -1;
                for (int i = e[k].first + 1; i < ql_graph_n_nodes(gb); i++) {
                    const ql_tensor *node = ql_graph_node(gb, i);
                    if (node->op == QL_OP_FLASH_ATTN_BACK) attn_between = true;
                    if (node->op == QL_OP_TO_DEVICE && node->src[0] == e[k].tensor) back = i;
                }
                CHECK(attn_between);
                CHECK(back > e[k].first);
                for (int j = 0; j < ne; j++)  // the original dies at its copy to the host
                    if (e[j].tensor == src) CHECK(e[j].last == e[k].first);
            }
            CHECK(parked >= 1);  // block 1's residual gradient (block 0's input takes no gradient: nothing reads it after)
        }
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(st.ctx));
        const std::vector<float> out = loss_and_grads(gb, st.loss);
        ql_backend_free(be);
        ql_graph_free(gb);
        return out;
    };
    const std::vector<float> ref = run(-1), once = run(0), late = run(QL_OFFLOAD_LATE), parked = run(QL_OFFLOAD_LATE | QL_OFFLOAD_GRADS);
    CHECK(memcmp(once.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    CHECK(memcmp(late.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    // (poisoned: a reader left on a parked original reads freed bytes, 0xff)
    CHECK(memcmp(parked.data(), ref.data(), ref.size() * sizeof(float)) == 0);
}
