// models/llama.cpp - llama-family graph construction (see llama.h).
#include "llama.h"

#include <cmath>
#include <random>

static bool hparams_ok(ql_context *ctx, const ql_llama_hparams &hp) {
    const char *why = nullptr;
    if (hp.n_vocab <= 0 || hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.n_ff <= 0)
        why = "every size must be positive";
    else if (hp.n_embd % hp.n_head != 0)
        why = "n_embd must be a multiple of n_head";
    else if (hp.n_head % hp.n_head_kv != 0)
        why = "n_head must be a multiple of n_head_kv";
    else if (hp.head_dim() % 2 != 0)
        why = "the head dimension must be even (rope rotates pairs)";
    if (!why) return true;
    ql_ctx_set_error(ctx, QL_ERR_INVALID, "llama: bad hyper-parameters: %s (vocab %d, embd %d, layers %d, heads %d/%d, ff %d)",
                     why, hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff);
    return false;
}

size_t ql_llama_weight_bytes(const ql_llama_hparams &hp, ql_type wtype, bool tied) {
    const int64_t d = hp.head_dim(), E = hp.n_embd;
    const int64_t per_layer_w = E * hp.n_head * d + 2 * E * hp.n_head_kv * d + hp.n_head * d * E + 3 * E * hp.n_ff;
    size_t n = ql_row_size(wtype, per_layer_w) * (size_t)hp.n_layer;
    n += (size_t)(2 * hp.n_layer + 1) * (size_t)E * 4;           // norms
    n += (size_t)E * (size_t)hp.n_vocab * 4 * (tied ? 1 : 2);    // embeddings (+ output)
    return n;
}

ql_status ql_llama_create(ql_context *ctx, ql_llama *m, const ql_llama_hparams &hp, ql_type wtype, bool tied) {
    if (!hparams_ok(ctx, hp)) return QL_ERR_INVALID;
    const int64_t E = hp.n_embd, d = hp.head_dim();
    m->hp = hp;
    m->tok_embd = ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, hp.n_vocab), "token_embd.weight");
    m->out_norm = ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, E), "output_norm.weight");
    m->output   = tied ? m->tok_embd
                       : ql_set_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, hp.n_vocab), "output.weight");
    m->layers.resize((size_t)hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) {
        ql_llama_layer &L = m->layers[(size_t)il];
        L.attn_norm = ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, E), "blk.%d.attn_norm.weight", il);
        L.wq = ql_format_name(ql_new_tensor_2d(ctx, wtype, E, hp.n_head * d), "blk.%d.attn_q.weight", il);
        L.wk = ql_format_name(ql_new_tensor_2d(ctx, wtype, E, hp.n_head_kv * d), "blk.%d.attn_k.weight", il);
        L.wv = ql_format_name(ql_new_tensor_2d(ctx, wtype, E, hp.n_head_kv * d), "blk.%d.attn_v.weight", il);
        L.wo = ql_format_name(ql_new_tensor_2d(ctx, wtype, hp.n_head * d, E), "blk.%d.attn_output.weight", il);
        L.ffn_norm = ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, E), "blk.%d.ffn_norm.weight", il);
        L.w_gate = ql_format_name(ql_new_tensor_2d(ctx, wtype, E, hp.n_ff), "blk.%d.ffn_gate.weight", il);
        L.w_up   = ql_format_name(ql_new_tensor_2d(ctx, wtype, E, hp.n_ff), "blk.%d.ffn_up.weight", il);
        L.w_down = ql_format_name(ql_new_tensor_2d(ctx, wtype, hp.n_ff, E), "blk.%d.ffn_down.weight", il);
    }
    return ql_ctx_status(ctx);
}

static void for_each_weight(ql_llama *m, void (*fn)(ql_tensor *, void *), void *arg) {
    fn(m->tok_embd, arg);
    fn(m->out_norm, arg);
    if (m->output != m->tok_embd) fn(m->output, arg);
    for (ql_llama_layer &L : m->layers)
        for (ql_tensor *t : {L.attn_norm, L.wq, L.wk, L.wv, L.wo, L.ffn_norm, L.w_gate, L.w_up, L.w_down}) fn(t, arg);
}

struct randomize_arg {
    std::mt19937_64 rng;
    float std;
};

void ql_llama_randomize(ql_llama *m, uint64_t seed, float std) {
    randomize_arg a{std::mt19937_64(seed), std};
    for_each_weight(
        m,
        [](ql_tensor *t, void *p) {
            randomize_arg *r = (randomize_arg *)p;
            std::normal_distribution<float> N(0.0f, r->std);
            const bool norm = ql_n_dims(t) == 1;
            for (int64_t i = 0; i < ql_nelements(t); i++) ql_set_f32_1d(t, i, norm ? 1.0f : N(r->rng));
        },
        &a);
}

void ql_llama_set_params(ql_llama *m) {
    for_each_weight(m, [](ql_tensor *t, void *) { ql_set_param(t); }, nullptr);
}

ql_tensor *ql_llama_linear(ql_context *ctx, ql_tensor *w, ql_tensor *x) { return ql_mul_mat(ctx, w, x); }

ql_tensor *ql_llama_block(ql_context *ctx, const ql_llama *m, int il, ql_tensor *x, ql_tensor *pos, ql_tensor *seg) {
    if (!x) return nullptr;
    const ql_llama_hparams &hp = m->hp;
    const ql_llama_layer &L = m->layers[(size_t)il];
    const int64_t d = hp.head_dim(), T = x->ne[1], B = x->ne[2];

    // attention: pre-norm, q/k/v, rope, fused causal attention, output projection, residual
    ql_tensor *h = ql_mul(ctx, ql_rms_norm(ctx, x, hp.norm_eps), L.attn_norm);
    ql_tensor *q = ql_reshape_4d(ctx, ql_llama_linear(ctx, L.wq, h), d, hp.n_head, T, B);     // [d, H, T, B]
    ql_tensor *k = ql_reshape_4d(ctx, ql_llama_linear(ctx, L.wk, h), d, hp.n_head_kv, T, B);  // [d, Hkv, T, B]
    ql_tensor *v = ql_reshape_4d(ctx, ql_llama_linear(ctx, L.wv, h), d, hp.n_head_kv, T, B);
    q = ql_rope(ctx, q, pos, m->rope_freqs, (int)d, hp.rope_mode, hp.rope_base);
    k = ql_rope(ctx, k, pos, m->rope_freqs, (int)d, hp.rope_mode, hp.rope_base);
    ql_tensor *a = ql_flash_attn(ctx, ql_permute(ctx, q, 0, 2, 1, 3),  // [d, T, H, B] views, no copies
                                 ql_permute(ctx, k, 0, 2, 1, 3), ql_permute(ctx, v, 0, 2, 1, 3), seg,
                                 1.0f / std::sqrt((float)d));                               // [d, H, T, B]
    a = ql_reshape_3d(ctx, a, d * hp.n_head, T, B);
    x = ql_add(ctx, x, ql_llama_linear(ctx, L.wo, a));

    // feed-forward: pre-norm, SwiGLU, residual
    h = ql_mul(ctx, ql_rms_norm(ctx, x, hp.norm_eps), L.ffn_norm);
    ql_tensor *g = ql_swiglu(ctx, ql_llama_linear(ctx, L.w_gate, h), ql_llama_linear(ctx, L.w_up, h));  // [n_ff, T, B]
    return ql_add(ctx, x, ql_llama_linear(ctx, L.w_down, g));
}

ql_tensor *ql_llama_forward(ql_context *ctx, const ql_llama *m, ql_tensor *tokens, ql_tensor *pos, ql_tensor *seg) {
    ql_tensor *x = ql_get_rows(ctx, m->tok_embd, tokens);  // [n_embd, T, B]
    for (int il = 0; il < m->hp.n_layer; il++) x = ql_llama_block(ctx, m, il, x, pos, seg);
    x = ql_mul(ctx, ql_rms_norm(ctx, x, m->hp.norm_eps), m->out_norm);
    return ql_llama_linear(ctx, m->output, x);  // [n_vocab, T, B]
}
