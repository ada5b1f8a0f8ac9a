// tests/tiny.h - a tiny llama (2 layers, GQA) with its training graph, shared by tests.
#pragma once

#include "../models/llama.h"
#include "../qlora.h"

#include <cmath>
#include <cstring>
#include <vector>

struct tiny_model {
    ql_context *ctx = nullptr;
    ql_llama    m;
    ql_tensor  *tokens, *pos, *targets, *count, *logits, *loss;
    ql_graph   *gf = nullptr, *gb = nullptr;
    std::vector<ql_tensor *> adam_m, adam_v;
    int T, B, V;

    static ql_llama_hparams hparams(int V) {
        ql_llama_hparams hp;
        hp.n_vocab = V;
        hp.n_embd = 32;
        hp.n_layer = 2;
        hp.n_head = 4;
        hp.n_head_kv = 2;
        hp.n_ff = 48;
        return hp;
    }

    // next token = (5 * token + 3) % V: learnable by any working model
    static int next_token(int t, int V) { return (5 * t + 3) % V; }

    // measure: build everything in a measuring context (no data, nothing runs)
    tiny_model(int T_, int B_, int V_, uint64_t seed, bool measure = false, bool train = true) : T(T_), B(B_), V(V_) {
        ql_init_params ip = {32u << 20, nullptr, false, measure};
        ctx = ql_init(ip);
        ql_llama_create(ctx, &m, hparams(V), QL_TYPE_F32, false);
        if (!measure) ql_llama_randomize(&m, seed, 0.1f);
        if (train) ql_llama_set_params(&m);
        tokens  = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
        pos     = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
        targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
        count   = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
        logits  = ql_llama_forward(ctx, &m, tokens, pos, nullptr);               // [V, T, B]
        loss    = ql_cross_entropy(ctx, ql_reshape_2d(ctx, logits, V, T * B), targets, count);
        gf = ql_graph_new(ctx);
        ql_graph_build_forward(gf, loss);
        if (train) gb = ql_graph_backward(ctx, gf, loss);
        if (!measure) fill_inputs(seed);
    }
    ~tiny_model() {
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_free(ctx);
    }
    void fill_inputs(uint64_t seed) {
        int32_t *tk = (int32_t *)tokens->data, *ps = (int32_t *)pos->data, *tg = (int32_t *)targets->data;
        for (int b = 0; b < B; b++) {
            int t0 = (int)((seed + 7 * (uint64_t)b) % (uint64_t)V);
            for (int t = 0; t < T; t++) {
                tk[b * T + t] = t0;
                ps[b * T + t] = t;
                t0 = next_token(t0, V);
                tg[b * T + t] = t0;
            }
        }
        tg[0] = -1;  // one ignored target
        *(float *)count->data = (float)(T * B - 1);
    }
    ql_graph *train_graph() { return gb; }

    // one step of AdamW on every parameter; returns the loss of the step
    float step(ql_backend *be, int it, float lr) {
        if (adam_m.empty())
            for (int i = 0; i < ql_graph_n_params(gb); i++) {
                ql_tensor *p = ql_graph_param(gb, i);
                adam_m.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
                adam_v.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
                ql_tensor_fill_f32(adam_m.back(), 0);
                ql_tensor_fill_f32(adam_v.back(), 0);
            }
        ql_graph_zero_grads(gb);
        if (ql_backend_graph_compute(be, gb) != QL_OK) return NAN;
        const ql_adamw_params opt = {lr, 0.9f, 0.999f, 1e-8f, 0.0f};
        for (int i = 0; i < ql_graph_n_params(gb); i++)
            ql_adamw_update(ql_graph_param(gb, i), adam_m[(size_t)i], adam_v[(size_t)i], it, &opt, 1.0f);
        return *(const float *)loss->data;
    }
};
