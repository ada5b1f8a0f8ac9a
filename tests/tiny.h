// tests/tiny.h - tiny llamas for the tests: random weights in memory (tiny_llama), written to a
// GGUF (write_llama_gguf), their logits (logits_of), and one with its training graph (tiny_model);
// a GGUF copied with edits (rewrite_gguf: a key set, a tensor's bytes or rows changed).
//
//   tiny_llama t(tiny_hparams(96, 64, 128), /*seed=*/1, /*std=*/0.1f);
//   llama_gguf_opts o;
//   o.linear_type = QL_TYPE_NF4;               // the seven weights of each block as NF4
//   write_llama_gguf(t.m, path, o);
#pragma once

#include "../models/llama.h"
#include "../qlora.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

// 2 layers, GQA (4 query heads over 2 kv heads) unless told otherwise
inline ql_llama_hparams tiny_hparams(int n_vocab, int n_embd, int n_ff, int n_layer = 2, int n_head = 4, int n_head_kv = 2) {
    ql_llama_hparams hp;
    hp.n_vocab = n_vocab;
    hp.n_embd = n_embd;
    hp.n_layer = n_layer;
    hp.n_head = n_head;
    hp.n_head_kv = n_head_kv;
    hp.n_ff = n_ff;
    return hp;
}

// An f32 llama in its own context: weights N(0, std), norms 1 (ql_llama_randomize).
struct tiny_llama {
    ql_context *ctx = nullptr;
    ql_llama    m;
    tiny_llama(const ql_llama_hparams &hp, uint64_t seed, float std, bool tied_output = false) {
        ql_init_params ip = {16u << 20, nullptr, false, false};
        ctx = ql_init(ip);
        REQUIRE(ql_llama_create(ctx, &m, hp, QL_TYPE_F32, tied_output) == QL_OK);
        ql_llama_randomize(&m, seed, std);
    }
    ~tiny_llama() { ql_free(ctx); }
    tiny_llama(const tiny_llama &) = delete;
    tiny_llama &operator=(const tiny_llama &) = delete;
};

// What write_llama_gguf writes. The defaults: the architecture, the hyper-parameters and the norm
// epsilon; every tensor in its own type, in llama.cpp's order (the output unless it is tied).
struct llama_gguf_opts {
    const char *arch = "llama";
    const char *name = nullptr;           // general.name, when set
    bool file_type = false;               // general.file_type = 0
    bool shape_keys = true;               // <arch>.embedding_length, feed_forward_length, head_count(_kv) (block_count always)
    bool norm_eps = true;                 // <arch>.attention.layer_norm_rms_epsilon
    bool rope_base = false;               // <arch>.rope.freq_base
    bool tokens = false;                  // tokenizer.ggml.tokens = ["a", "b"]
    const char *skip_key = nullptr;       // a hyper-parameter left out, without "<arch>." ("block_count")
    const char *skip_tensor = nullptr;    // a tensor left out
    ql_type linear_type = QL_TYPE_COUNT;  // q/k/v/o/gate/up/down quantised to this; COUNT: as they are
    std::vector<std::string> nf4;         // these tensors NF4 (double-quantised), whatever else is asked
    bool norms_first = false;             // per block: both norms, then the linear weights
};

// writes m as a model GGUF (biases included when present); f32 tensors quantised as `o` asks
// src copied to dst (KVs and tensors in order) with edits: edit_kv(w) after the KVs are copied
// (ql_gguf_set_* replaces a key in place); edit_tensor(name, ne, &data, &size) may point a
// tensor at other bytes or change its shape. For damaged-input tests.
inline void rewrite_gguf(const std::string &src, const std::string &dst, const std::function<void(ql_gguf_writer *)> &edit_kv,
                         const std::function<void(const std::string &, int64_t *, const void **, size_t *)> &edit_tensor = nullptr) {
    char err[256];
    ql_gguf *g = ql_gguf_open(src.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    ql_gguf_writer *w = ql_gguf_writer_new();
    for (int64_t k = 0; k < ql_gguf_n_kv(g); k++) ql_gguf_copy_kv(w, g, k);
    if (edit_kv) edit_kv(w);
    for (int64_t k = 0; k < ql_gguf_n_tensors(g); k++) {
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, k, ne);
        const void *data = ql_gguf_tensor_data(g, k);
        size_t size = ql_gguf_tensor_size(g, k);
        if (edit_tensor) edit_tensor(ql_gguf_tensor_name(g, k), ne, &data, &size);
        REQUIRE(ql_gguf_add_tensor(w, ql_gguf_tensor_name(g, k), ql_gguf_tensor_type(g, k), nd, ne, data, size) == QL_OK);
    }
    REQUIRE_MESSAGE(ql_gguf_write(w, dst.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf_writer_free(w);
    ql_gguf_close(g);
}

inline void write_llama_gguf(const ql_llama &m, const std::string &path, const llama_gguf_opts &o = llama_gguf_opts()) {
    ql_gguf_writer *w = ql_gguf_writer_new();
    const std::string a = o.arch;
    ql_gguf_set_str(w, "general.architecture", o.arch);
    if (o.name) ql_gguf_set_str(w, "general.name", o.name);
    if (o.file_type) ql_gguf_set_u32(w, "general.file_type", 0);
    auto key = [&](const char *k, int v) {
        if (!o.skip_key || strcmp(k, o.skip_key)) ql_gguf_set_u32(w, (a + "." + k).c_str(), (uint32_t)v);
    };
    if (o.shape_keys) key("embedding_length", m.hp.n_embd);
    key("block_count", m.hp.n_layer);
    if (o.shape_keys) {
        key("feed_forward_length", m.hp.n_ff);
        key("attention.head_count", m.hp.n_head);
        key("attention.head_count_kv", m.hp.n_head_kv);
    }
    if (o.norm_eps) ql_gguf_set_f32(w, (a + ".attention.layer_norm_rms_epsilon").c_str(), m.hp.norm_eps);
    if (o.rope_base) ql_gguf_set_f32(w, (a + ".rope.freq_base").c_str(), m.hp.rope_base);
    if (o.tokens) {
        const char *toks[] = {"a", "b"};
        ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 2);
    }
    std::vector<std::vector<uint8_t>> keep;  // quantised bytes, alive until the write
    auto add = [&](const ql_tensor *t, bool linear) {
        if (!t || (o.skip_tensor && !strcmp(t->name, o.skip_tensor))) return;
        ql_type type = linear && o.linear_type != QL_TYPE_COUNT ? o.linear_type : t->type;
        for (const std::string &n : o.nf4)
            if (n == t->name) type = QL_TYPE_NF4;
        const int64_t ne[4] = {t->ne[0], t->ne[1], 1, 1};
        if (type == t->type) {
            REQUIRE(ql_gguf_add_tensor(w, t->name, type, ql_n_dims(t), ne, t->data, ql_nbytes(t)) == QL_OK);
            return;
        }
        keep.emplace_back(ql_type_data_size(type, t->ne[1], t->ne[0]));
        char err[200] = "";
        REQUIRE_MESSAGE(ql_quantize(type, (const float *)t->data, t->ne[1], t->ne[0], keep.back().data(), err, sizeof(err)) == QL_OK, err);
        REQUIRE(ql_gguf_add_tensor(w, t->name, type, ql_n_dims(t), ne, keep.back().data(), keep.back().size()) == QL_OK);
    };
    add(m.tok_embd, false);
    add(m.out_norm, false);
    if (m.output != m.tok_embd) add(m.output, false);
    for (const ql_llama_layer &L : m.layers) {
        add(L.attn_norm, false);
        if (o.norms_first) add(L.ffn_norm, false);
        for (const ql_tensor *t : {L.wq, L.wk, L.wv}) add(t, true);
        for (const ql_tensor *t : {L.bq, L.bk, L.bv}) add(t, false);
        add(L.wo, true);
        if (!o.norms_first) add(L.ffn_norm, false);
        for (const ql_tensor *t : {L.w_gate, L.w_up, L.w_down}) add(t, true);
    }
    char err[256];
    REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf_writer_free(w);
}

// full forward of `tokens` at positions 0..T-1: logits [T, V] row-major
inline std::vector<float> logits_of(const ql_llama &m, const std::vector<int32_t> &tokens, int threads = 2) {
    const int64_t T = (int64_t)tokens.size();
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *tk = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1), *ps = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1);
    for (int64_t t = 0; t < T; t++) {
        ((int32_t *)tk->data)[t] = tokens[(size_t)t];
        ((int32_t *)ps->data)[t] = (int32_t)t;
    }
    ql_tensor *lg = ql_llama_forward(ctx, &m, tk, ps, nullptr);
    REQUIRE_MESSAGE(lg, ql_ctx_error(ctx));
    ql_graph *g = ql_graph_new(ctx);
    ql_graph_build_forward(g, lg);
    ql_backend *be = ql_backend_cpu_init(threads);
    REQUIRE_MESSAGE(ql_graph_alloc(g, be) == QL_OK, ql_ctx_error(ctx));
    REQUIRE_MESSAGE(ql_backend_graph_compute(be, g) == QL_OK, ql_ctx_error(ctx));
    std::vector<float> out((const float *)lg->data, (const float *)lg->data + T * m.hp.n_vocab);
    ql_graph_free(g);
    ql_backend_free(be);
    ql_free(ctx);
    return out;
}

// A tiny llama with its forward, loss and backward graphs on a learnable rule, and AdamW.
struct tiny_model {
    ql_context *ctx = nullptr;
    ql_llama    m;
    ql_tensor  *tokens, *pos, *targets, *count, *logits, *loss;
    ql_graph   *gf = nullptr, *gb = nullptr;
    std::vector<ql_tensor *> adam_m, adam_v;
    int T, B, V;

    static ql_llama_hparams hparams(int V) { return tiny_hparams(V, 32, 48); }

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

// Random blocks of a ggml type that has no quantiser here (k-quants, iq4): random codes and
// scales, with the block's fp16 super-scales (d, dmin) made finite and of a weight's magnitude.
inline std::vector<uint8_t> random_blocks(ql_type type, size_t bytes, uint32_t seed) {
    std::vector<uint8_t> b(bytes);
    uint32_t s = seed * 2654435761u + 1;
    auto next = [&s]() { return s = s * 1664525u + 1013904223u; };
    for (uint8_t &x : b) x = (uint8_t)(next() >> 24);
    const size_t bs = ql_type_traits_get(type)->type_size;
    std::vector<size_t> at;  // byte offsets of the fp16 fields in a block
    switch (type) {
    case QL_TYPE_Q4_K: case QL_TYPE_Q5_K: at = {0, 2}; break;
    case QL_TYPE_Q6_K: at = {bs - 2}; break;
    case QL_TYPE_Q2_K: at = {80, 82}; break;
    case QL_TYPE_Q3_K: at = {108}; break;
    default: at = {0}; break;  // iq4_nl, iq4_xs, and the 32-element types: d leads the block
    }
    for (size_t o = 0; o + bs <= b.size(); o += bs)
        for (size_t f : at) {
            const uint16_t h = ql_fp32_to_fp16(0.001f + 0.009f * (float)(next() >> 8) / 16777216.0f);
            memcpy(&b[o + f], &h, 2);
        }
    return b;
}
