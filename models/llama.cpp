// models/llama.cpp - llama-family graph construction (see llama.h).
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

static bool hparams_ok(ql_context *ctx, const ql_llama_hparams &hp) {
    const char *why = nullptr;
    if (hp.n_vocab <= 0 || hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.n_ff <= 0)
        why = "every size must be positive";
    else if (hp.n_embd_head < 0 || hp.n_embd_head > 512)
        why = "the head dimension must be from 1 to 512 (0: n_embd / n_head)";
    else if (hp.n_embd_head == 0 && hp.n_embd % hp.n_head != 0)
        why = "n_embd must be a multiple of n_head (or the head dimension given)";
    else if (hp.n_head % hp.n_head_kv != 0)
        why = "n_head must be a multiple of n_head_kv";
    else if (hp.head_dim() % 2 != 0)
        why = "the head dimension must be even (rope rotates pairs)";
    if (!why) return true;
    ql_ctx_set_error(ctx, QL_ERR_INVALID, "llama: bad hyper-parameters: %s (vocab %d, embd %d, layers %d, heads %d/%d, head dim %d, ff %d)",
                     why, hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_embd_head, hp.n_ff);
    return false;
}

size_t ql_llama_weight_bytes(const ql_llama_hparams &hp, ql_type wtype, bool tied) {
    const int64_t d = hp.head_dim(), E = hp.n_embd;
    auto bytes = [&](int64_t in, int64_t out) { return (ql_type_data_size(wtype, out, in) + 63) / 64 * 64; };  // rows + side data
    const size_t per_layer = bytes(E, hp.n_head * d) + 2 * bytes(E, hp.n_head_kv * d) + bytes(hp.n_head * d, E) +
                             2 * bytes(E, hp.n_ff) + bytes(hp.n_ff, E);
    size_t n = per_layer * (size_t)hp.n_layer;
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
    // limitation: values are drawn as f32 one by one: make f32 models, quantize afterwards (ql_quantize)
    randomize_arg a{std::mt19937_64(seed), std};
    for_each_weight(
        m,
        [](ql_tensor *t, void *p) {
            randomize_arg *r = (randomize_arg *)p;
            std::normal_distribution<float> N(0.0f, r->std);
            const bool norm = ql_n_dims(t) == 1;
            if (t->type != QL_TYPE_F32) return;  // see the limitation above
            for (int64_t i = 0; i < ql_nelements(t); i++) ((float *)t->data)[i] = norm ? 1.0f : N(r->rng);
        },
        &a);
}

void ql_llama_set_params(ql_llama *m) {
    for_each_weight(m, [](ql_tensor *t, void *) { ql_set_param(t); }, nullptr);
}

// x in the compute type: x itself (f32), or one cast that several linears of the same input
// share (q, k, v; gate, up), named after the first (a diagnosis names it: an f16 overflow)
static ql_tensor *compute_input(ql_context *ctx, const ql_llama *m, ql_tensor *w, ql_tensor *x) {
    if (m->compute == QL_TYPE_F32 || !x || x->type == m->compute) return x;  // (SwiGLU's result is made in it)
    ql_tensor *xc = ql_cast(ctx, x, m->compute);
    return xc ? ql_format_name(xc, "%s.input", w->name) : nullptr;
}

// QLORA_DROPOUT_FUSED: 0 the dropped-out copies, 16 the fused dropout reading x's 16-bit copy (tests, A/B)
static const char *dropout_env() {
    static const char *env = getenv("QLORA_DROPOUT_FUSED");
    return env ? env : "";
}

// QLORA_MM_SCALE=0: LoRA's scale as a pass after A's product, not in it (A/B runs: the same bits)
static bool scale_env_off() {
    static const bool off = getenv("QLORA_MM_SCALE") && strcmp(getenv("QLORA_MM_SCALE"), "0") == 0;
    return off;
}

// whether linear_c reads x itself, not only xc: adapter dropout drawn over f32 x
static bool reads_x(const ql_llama *m, const ql_tensor *w) {
    auto it = m->lora.find(w);
    if (it == m->lora.end() || !(m->lora_dropout && it->second.seed && it->second.dropout > 0)) return false;
    const bool fused = m->lora_dropout_fused && strcmp(dropout_env(), "0") != 0;
    return !(fused && (m->lora_dropout_x16 || strcmp(dropout_env(), "16") == 0));
}

// a pre-norm, x normed and times `norm`, for the linears ws that read it: *h f32 and *hc, its copy
// in the compute type (compute_input) - or, where no linear reads h itself (no adapter dropout
// drawn over it), *hc alone, the norm writing the compute type (the cast's bits), and *h = *hc
static void pre_norm(ql_context *ctx, const ql_llama *m, ql_tensor *x, ql_tensor *norm, std::initializer_list<const ql_tensor *> ws,
                     ql_tensor **h, ql_tensor **hc) {
    bool f32 = m->compute == QL_TYPE_F32;
    for (const ql_tensor *w : ws) f32 = f32 || reads_x(m, w);
    if (f32) {
        *h = ql_rms_norm_mul(ctx, x, norm, m->hp.norm_eps);
        *hc = compute_input(ctx, m, (ql_tensor *)*ws.begin(), *h);
        // the readers of h (dropout) placed after the copy (graph order only): the norm and its copy
        // are then neighbours, which a device makes by one launch (ql_cuda_norm_cast_pair)
        if (*h && *hc && *hc != *h) *h = ql_reshape_4d_after(ctx, *h, (*h)->ne[0], (*h)->ne[1], (*h)->ne[2], (*h)->ne[3], *hc);
    } else {
        *hc = ql_rms_norm_mul_to(ctx, x, norm, m->hp.norm_eps, m->compute);
        if (*hc) ql_format_name(*hc, "%s.input", (*ws.begin())->name);
        *h = *hc;
    }
}

// y = W x (+ LoRA), xc: x in the compute type (compute_input); x may be rows [row0, ...) of a
// whole (the FFN in chunks): its dropout draws the whole's mask. out: y's type - F32, or the
// compute type where only 16-bit ops read y (W x, then W x + B(.), each rounded once on store).
// onto (f32, y's shape, contiguous): y = onto + W x (+ LoRA), the product adding onto it as it
// writes (ql_mul_mat_acc; over onto's storage where onto dies there) - the residual's add
// xd: NULL, or the adapter's dropped-out copy of x made already (dropped_copies)
static ql_tensor *linear_c(ql_context *ctx, const ql_llama *m, ql_tensor *w, ql_tensor *x, ql_tensor *xc, int64_t row0 = 0,
                           ql_type out = QL_TYPE_F32, ql_type ct = QL_TYPE_COUNT, ql_tensor *onto = nullptr, ql_tensor *xd = nullptr) {
    // a 16-bit compute type: the multiplies' inputs in it (what backward keeps is then 16-bit too);
    // ct: this linear's own (f32 for the guarded down projection), else the model's
    if (ct == QL_TYPE_COUNT) ct = m->compute;
    ql_tensor *y = onto ? ql_mul_mat_acc(ctx, w, xc, onto) : ql_mul_mat_to(ctx, w, xc, out);
    if (y && m->q8_activations) ql_mul_mat_set_prec(y, QL_TYPE_Q8_0);
    auto it = m->lora.find(w);
    if (it == m->lora.end()) return y;
    const ql_lora_pair &p = it->second;  // [in, r] then [r, out]
    const bool drop = m->lora_dropout && p.seed && p.dropout > 0;
    const bool env_unfused = strcmp(dropout_env(), "0") == 0, env_x16 = strcmp(dropout_env(), "16") == 0;
    // the scale on the rank-r side: over [r, T] instead of [out, T], forward and back, its result
    // rounded to the compute type as it is written: A's multiply's own (its GEMM's alpha), or with
    // dropout inside the multiply one pass after it. B's multiply adds onto W x as it writes (in
    // place where W x dies there): no pass for the add
    ql_tensor *sax;  // s A dropout(x) [r, T]: the mask applied as A's multiply reads x (or xc), or a dropped-out copy of x first
    if (drop && m->lora_dropout_fused && !env_unfused) {
        ql_tensor *ax = ql_mul_mat_dropout(ctx, p.a, m->lora_dropout_x16 || env_x16 ? xc : x, p.dropout, p.seed, p.stream, ct, row0);
        sax = ql_scale_to(ctx, ax, p.scale, ct);
    } else {  // (the copy in the compute type as made)
        ql_tensor *in = !drop ? xc : xd ? xd : ql_dropout_rows_to(ctx, x, p.dropout, p.seed, p.stream, ct, row0);
        sax = scale_env_off() ? ql_scale_to(ctx, ql_mul_mat(ctx, p.a, in), p.scale, ct) : ql_mul_mat_scaled_to(ctx, p.a, in, p.scale, ct);
    }
    return ql_mul_mat_acc(ctx, p.b, sax, y);
}

// The adapters' dropped-out copies of one normed x (rows row0.. of a whole) for the linears ws
// that read x itself (reads_x: copies, not dropout inside A's multiply), under lora_copies_first:
// made one after another (graph order only) right after the norm and its 16-bit copy, so a device's
// norm kernel writes them all as it stores each element (ql_cuda_norm_dropout). Each reader gets a
// view placed after the last, so whichever linear the walk meets first, all the copies come first.
// xd[i]: ws[i]'s copy, or NULL (linear_c makes it where it is read)
static void dropped_copies(ql_context *ctx, const ql_llama *m, std::initializer_list<const ql_tensor *> ws, ql_tensor *x, int64_t row0,
                           ql_tensor **xd) {
    ql_tensor *last = nullptr;
    auto after_last = [&](ql_tensor *t) { return ql_reshape_4d_after(ctx, t, t->ne[0], t->ne[1], t->ne[2], t->ne[3], last); };
    int n = 0;
    for (const ql_tensor *w : ws) {
        xd[n] = nullptr;
        if (m->lora_copies_first && x && reads_x(m, w)) {
            const ql_lora_pair &p = m->lora.find(w)->second;
            xd[n] = last = ql_dropout_rows_to(ctx, last ? after_last(x) : x, p.dropout, p.seed, p.stream, m->compute, row0);
        }
        n++;
    }
    for (int k = 0; k < n; k++)
        if (xd[k] && xd[k] != last) xd[k] = after_last(xd[k]);
}

ql_tensor *ql_llama_linear(ql_context *ctx, const ql_llama *m, ql_tensor *w, ql_tensor *x) {
    return linear_c(ctx, m, w, x, compute_input(ctx, m, w, x));
}

// y = W x (+ b): the linear layers of attention may carry biases (Qwen2); out: y's type (linear_c)
static ql_tensor *linear_b(ql_context *ctx, const ql_llama *m, ql_tensor *w, ql_tensor *b, ql_tensor *x, ql_tensor *xc,
                           ql_type out, ql_tensor *xd) {
    ql_tensor *y = linear_c(ctx, m, w, x, xc, 0, out, QL_TYPE_COUNT, nullptr, xd);
    return b ? ql_add(ctx, y, b) : y;
}

// One block; with a cache, the new keys and values go into it and attention reads it.
static ql_tensor *block(ql_context *ctx, const ql_llama *m, int il, ql_tensor *x, ql_tensor *pos, ql_tensor *seg,
                        const ql_llama_cache *cache) {
    if (!x) return nullptr;
    const ql_llama_hparams &hp = m->hp;
    const ql_llama_layer &L = m->layers[(size_t)il];
    const int64_t d = hp.head_dim(), T = x->ne[1], B = x->ne[2];
    const int n_rot = hp.n_rot > 0 ? hp.n_rot : (int)d;

    // attention: pre-norm, q/k/v, rope, fused causal attention, output projection, residual
    ql_tensor *h, *hc;  // one 16-bit copy for q, k and v (or the norm written in 16 bits)
    pre_norm(ctx, m, x, L.attn_norm, {L.wq, L.wk, L.wv}, &h, &hc);
    ql_tensor *xd[3];  // q's, k's and v's adapter dropout copies of h, or NULL
    dropped_copies(ctx, m, {L.wq, L.wk, L.wv}, h, 0, xd);
    // q, k, v in the compute type: only 16-bit ops read them (rope, attention), so what backward
    // keeps of attention (q and k after rope, v, the output: the o projection's input) is 16-bit
    // too. f32 where something f32-only reads them: the biases' add (Qwen2), a KV cache (generate)
    const ql_type qkv = m->compute != QL_TYPE_F32 && !cache && !L.bq && !L.bk && !L.bv ? m->compute : QL_TYPE_F32;
    // q's rotation placed after k's projection (graph order only): the two rotations are then
    // neighbours, which a device makes in one launch. With a cache (decode) after v's projection
    // too: q's, k's and v's products then neighbours, one launch on a device (ql_cuda_gemv_group)
    ql_tensor *kl = linear_b(ctx, m, L.wk, L.bk, h, hc, qkv, xd[1]), *vl = linear_b(ctx, m, L.wv, L.bv, h, hc, qkv, xd[2]);
    ql_tensor *kv = cache && kl && vl ? ql_reshape_4d_after(ctx, kl, kl->ne[0], kl->ne[1], kl->ne[2], kl->ne[3], vl) : kl;
    ql_tensor *q = ql_reshape_4d_after(ctx, linear_b(ctx, m, L.wq, L.bq, h, hc, qkv, xd[0]), d, hp.n_head, T, B, kv);  // [d, H, T, B]
    ql_tensor *k = ql_reshape_4d(ctx, kl, d, hp.n_head_kv, T, B);                                             // [d, Hkv, T, B]
    ql_tensor *v = ql_reshape_4d(ctx, vl, d, hp.n_head_kv, T, B);
    q = ql_rope(ctx, q, pos, m->rope_freqs, n_rot, hp.rope_mode, hp.rope_base);
    k = ql_rope(ctx, k, pos, m->rope_freqs, n_rot, hp.rope_mode, hp.rope_base);
    const float scale = 1.0f / std::sqrt((float)d);
    ql_tensor *a;  // [d, H, T, B]
    if (cache) {
        // k's store placed after v's projection (graph order only): the two stores are then
        // neighbours, which a device makes in one launch
        k = ql_reshape_4d_after(ctx, k, k->ne[0], k->ne[1], k->ne[2], k->ne[3], v);
        ql_tensor *kc = ql_cache_store(ctx, cache->k[(size_t)il], ql_permute(ctx, k, 0, 2, 1, 3), cache->write_pos);
        ql_tensor *vc = ql_cache_store(ctx, cache->v[(size_t)il], ql_permute(ctx, v, 0, 2, 1, 3), cache->write_pos);
        a = ql_flash_attn_kv(ctx, ql_permute(ctx, q, 0, 2, 1, 3), kc, vc, cache->n_kv, scale);
    } else {
        a = ql_flash_attn(ctx, ql_permute(ctx, q, 0, 2, 1, 3),  // [d, T, H, B] views, no copies
                          ql_permute(ctx, k, 0, 2, 1, 3), ql_permute(ctx, v, 0, 2, 1, 3), seg, scale);
    }
    if (a && m->compute == QL_TYPE_BF16 && m->attn_bf16) ql_flash_attn_set_prec(a, QL_TYPE_BF16);
    if (a && !cache && m->attn_score_bytes) ql_flash_attn_set_score_bytes(a, m->attn_score_bytes);
    a = ql_reshape_3d(ctx, a, d * hp.n_head, T, B);  // in q's type: a 16-bit a is the o projection's input as it is
    // the residual: the o projection adds onto x as it writes - no [E, T] product and add pass
    // (decode's too: a launch fewer a projection - the add's bits where the product is summed
    // first, as the device's decode kernels and the CPU's 8-bit path do; the CPU's packed GEMMs
    // start from c, within their bound); in backward's recompute x (a checkpoint brought back,
    // read again later from its own copy) dies here, so x + o(a) takes over its bytes
    if (x->type == QL_TYPE_F32 && ql_is_contiguous(x))
        x = linear_c(ctx, m, L.wo, a, compute_input(ctx, m, L.wo, a), 0, QL_TYPE_F32, QL_TYPE_COUNT, x);
    else
        x = ql_add(ctx, x, ql_llama_linear(ctx, m, L.wo, a));

    // feed-forward: pre-norm, SwiGLU, residual
    // gate, up and SwiGLU's result in the compute type: 16-bit ops read them (SwiGLU; the down
    // projection's multiply), so what backward keeps of the FFN is 16-bit; the residual stays f32
    // (the fp16 guard, ffn_down_f32: gate and up written in f32, SwiGLU's result f32, the down
    // projection and its LoRA multiplied in f32 - nothing of the FFN past gate and up is 16-bit)
    const bool guard = m->ffn_down_f32 && m->compute != QL_TYPE_F32;
    const ql_type ff = guard ? QL_TYPE_F32 : m->compute;
    // onto: the residual the product adds onto as it writes (as the o projection's), or NULL
    auto down = [&](ql_tensor *g, int64_t r0, ql_tensor *onto = nullptr) {
        return guard ? linear_c(ctx, m, L.w_down, g, g, r0, QL_TYPE_F32, QL_TYPE_F32, onto)
                     : linear_c(ctx, m, L.w_down, g, compute_input(ctx, m, L.w_down, g), r0, QL_TYPE_F32, QL_TYPE_COUNT, onto);
    };
    const int64_t rows = T * B, c = m->ffn_chunk;
    if (c <= 0 || c >= rows || !x) {
        pre_norm(ctx, m, x, L.ffn_norm, {L.w_gate, L.w_up}, &h, &hc);  // one for gate and up
        dropped_copies(ctx, m, {L.w_gate, L.w_up}, h, 0, xd);
        ql_tensor *g = ql_swiglu(ctx, linear_c(ctx, m, L.w_gate, h, hc, 0, ff, QL_TYPE_COUNT, nullptr, xd[0]),
                                 linear_c(ctx, m, L.w_up, h, hc, 0, ff, QL_TYPE_COUNT, nullptr, xd[1]));  // [n_ff, T, B]
        // the residual added by the down projection as it writes
        return x && x->type == QL_TYPE_F32 && ql_is_contiguous(x) ? down(g, 0, x) : ql_add(ctx, x, down(g, 0));
    }
    // in chunks of c tokens: each chunk's norm, gate, up, SwiGLU and down (and their LoRA) on rows
    // of x, its result added into those rows of the residual (in place along the chain). The norm
    // and the 16-bit copy too are made a chunk at a time (a norm is row by row: the same bits): no
    // [E, T] of them exists, and every gradient reaches x through views of its rows, summed into
    // x's one gradient (add_rows) - not one whole-size tensor per chunk
    const int64_t E = hp.n_embd;
    auto rows_of = [&](ql_tensor *t, int64_t r0, int64_t n) {  // [E, n]: rows r0.. of t, T and B counted together
        return ql_view_2d(ctx, t, E, n, t->nb[1], (size_t)r0 * t->nb[1]);
    };
    // the result stays [E, T, B], not a view of it: a recompute policy cuts the graph at this
    // block's output (the next one's "blk.N.in"), which must be a result of its own
    ql_tensor *r = x;
    for (int64_t r0 = 0; r0 < rows && r; r0 += c) {
        const int64_t n = std::min(c, rows - r0);
        ql_tensor *hr, *hcr;  // [E, n]
        pre_norm(ctx, m, rows_of(x, r0, n), L.ffn_norm, {L.w_gate, L.w_up}, &hr, &hcr);
        dropped_copies(ctx, m, {L.w_gate, L.w_up}, hr, r0, xd);
        ql_tensor *g = ql_swiglu(ctx, linear_c(ctx, m, L.w_gate, hr, hcr, r0, ff, QL_TYPE_COUNT, nullptr, xd[0]),
                                 linear_c(ctx, m, L.w_up, hr, hcr, r0, ff, QL_TYPE_COUNT, nullptr, xd[1]));  // [n_ff, n]
        r = ql_add_rows(ctx, r, down(g, r0), r0);
    }
    return r;
}

ql_tensor *ql_llama_block(ql_context *ctx, const ql_llama *m, int il, ql_tensor *x, ql_tensor *pos, ql_tensor *seg) {
    return block(ctx, m, il, x, pos, seg, nullptr);
}

static ql_tensor *head(ql_context *ctx, const ql_llama *m, ql_tensor *x) {  // final norm, output projection
    ql_tensor *h, *hc;
    pre_norm(ctx, m, x, m->out_norm, {m->output}, &h, &hc);
    return linear_c(ctx, m, m->output, h, hc);
}

ql_tensor *ql_llama_forward(ql_context *ctx, const ql_llama *m, ql_tensor *tokens, ql_tensor *pos, ql_tensor *seg) {
    ql_tensor *x = ql_get_rows(ctx, m->tok_embd, tokens);  // [n_embd, T, B]
    for (int il = 0; il < m->hp.n_layer; il++) x = block(ctx, m, il, x, pos, seg, nullptr);
    return head(ctx, m, x);  // [n_vocab, T, B]
}

ql_tensor *ql_llama_hidden(ql_context *ctx, const ql_llama *m, ql_tensor *x, ql_tensor *pos, ql_tensor *seg) {
    return ql_llama_hidden_range(ctx, m, x, pos, seg, 0, m->hp.n_layer);
}

ql_tensor *ql_llama_hidden_range(ql_context *ctx, const ql_llama *m, ql_tensor *x, ql_tensor *pos, ql_tensor *seg, int l0, int l1) {
    if (l0 < 0 || l1 > m->hp.n_layer || l0 > l1) {
        ql_ctx_set_error(ctx, QL_ERR_INVALID, "llama: blocks [%d, %d) of %d", l0, l1, m->hp.n_layer);
        return nullptr;
    }
    // the residual stream between blocks is named "blk.<il>.in" (il = n_layer: the head's input):
    // a recompute policy finds block boundaries among the graph's segments by these names
    const int last = l1 == m->hp.n_layer ? l1 : l1 - 1;  // (a range's output, another range's input, is left unnamed)
    for (int il = l0; il <= last && x; il++) {
        if (x->op != QL_OP_NONE && !x->name[0]) ql_format_name(x, "blk.%d.in", il);
        if (il < l1) x = block(ctx, m, il, x, pos, seg, nullptr);
    }
    if (l1 < m->hp.n_layer) return x;
    return ql_rms_norm_mul(ctx, x, m->out_norm, m->hp.norm_eps);  // [n_embd, T, B]
}

int64_t ql_llama_ffn_chunk(int64_t n_ff, int64_t n_rows) {
    const int64_t per = std::max<int64_t>(1, QL_LLAMA_FFN_CHUNK_ELEMS / std::max<int64_t>(1, n_ff));
    const int64_t n_chunks = (n_rows + per - 1) / per;
    return (n_rows + n_chunks - 1) / std::max<int64_t>(1, n_chunks);  // equal chunks, each within the budget
}

int64_t ql_llama_loss_chunk(int64_t n_vocab, int64_t n_rows, int64_t elems) {
    const int64_t per = std::max<int64_t>(1, elems / std::max<int64_t>(1, n_vocab));
    const int64_t n_chunks = (n_rows + per - 1) / per;
    return (n_rows + n_chunks - 1) / n_chunks;  // equal chunks, each within the budget
}

ql_tensor *ql_llama_loss(ql_context *ctx, const ql_llama *m, ql_tensor *h, ql_tensor *targets, ql_tensor *count, int64_t chunk,
                         bool grad) {
    if (!h) return nullptr;
    const int64_t E = h->ne[0], N = ql_nelements(h) / E;
    h = ql_reshape_2d(ctx, h, E, N);
    if (grad && !(m->output->flags & QL_FLAG_PARAM) && !m->lora.count(m->output)) {
        // fused: per chunk logits -> loss -> dlogits (over the logits) -> dh rows; the product
        // of backward's shape (W^T dlogits, dlogits in the multiply's type: what backward's
        // would read), written straight into its rows of dh, so the numbers are the unfused path's
        if (chunk <= 0 || chunk > N) chunk = N;
        const int64_t one_ne[1] = {1};
        ql_tensor *one = ql_fill(ctx, QL_TYPE_F32, 1, one_ne, 1.0f);  // dy = 1: the loss's seed (scaled in backward)
        // dh's storage [E, N], zeros made from h (every row is then written), not a fill: the
        // graph's order (a post-order walk) then makes it after h, where a fill (no sources)
        // would come first and live through the whole forward, joining every recompute segment into one
        ql_tensor *dh = ql_scale(ctx, h, 0.0f);
        ql_tensor *wt = ql_transpose(ctx, m->output);                  // [n_vocab, E]
        ql_tensor *loss = nullptr;
        for (int64_t r0 = 0; r0 < N; r0 += chunk) {
            const int64_t n = std::min(chunk, N - r0);
            ql_tensor *hc = ql_view_2d(ctx, h, E, n, h ? h->nb[1] : 0, (size_t)r0 * (h ? h->nb[1] : 0));
            ql_tensor *l = ql_cross_entropy(ctx, ql_llama_linear(ctx, m, m->output, hc),
                                            ql_view_1d(ctx, targets, n, (size_t)r0 * sizeof(int32_t)), count);
            // [n_vocab, n], written in the multiply's type (the f32 values rounded once: a cast's bits)
            ql_tensor *d = ql_cross_entropy_back_to(ctx, l, one, m->compute);
            dh = ql_mul_mat_rows(ctx, wt, d, dh, r0);  // straight into its rows of dh
            loss = loss ? ql_add(ctx, loss, l) : l;
        }
        return ql_with_grad(ctx, loss, h, dh);
    }
    if (chunk <= 0 || chunk >= N)  // one chunk: the plain head, its logits kept for backward
        return ql_cross_entropy(ctx, ql_llama_linear(ctx, m, m->output, h), targets, count);
    // rows [r0, r0 + n): logits [n_vocab, n] made, read by their cross-entropy, dropped; backward
    // makes them again (QL_FLAG_RECOMPUTE) just before it needs them, one chunk at a time
    ql_tensor *loss = nullptr;
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
        const int64_t n = std::min(chunk, N - r0);
        ql_tensor *hc = ql_view_2d(ctx, h, E, n, h ? h->nb[1] : 0, (size_t)r0 * (h ? h->nb[1] : 0));
        ql_tensor *logits = ql_llama_linear(ctx, m, m->output, hc);
        if (logits) logits->flags |= QL_FLAG_RECOMPUTE;
        ql_tensor *l = ql_cross_entropy(ctx, logits, ql_view_1d(ctx, targets, n, (size_t)r0 * sizeof(int32_t)), count);
        loss = loss ? ql_add(ctx, loss, l) : l;
    }
    return loss;
}

// ---- trainable LoRA ----

static const char *const k_lora_targets[] = {"q", "k", "v", "o", "gate", "up", "down"};

bool ql_lora_target_valid(const std::string &t) {
    for (const char *n : k_lora_targets)
        if (t == n) return true;
    return false;
}

static ql_tensor *target_weight(ql_llama_layer &L, const std::string &t) {
    if (t == "q") return L.wq;
    if (t == "k") return L.wk;
    if (t == "v") return L.wv;
    if (t == "o") return L.wo;
    if (t == "gate") return L.w_gate;
    if (t == "up") return L.w_up;
    return L.w_down;
}

ql_status ql_llama_add_lora(ql_context *ctx, ql_llama *m, const ql_lora_config &spec, ql_tensor *seed) {
    return ql_llama_add_lora_range(ctx, m, spec, seed, 0, m->hp.n_layer);
}

ql_status ql_llama_add_lora_range(ql_context *ctx, ql_llama *m, const ql_lora_config &spec, ql_tensor *seed, int l0, int l1) {
    if (l0 < 0 || l1 > m->hp.n_layer || l0 > l1) {
        ql_ctx_set_error(ctx, QL_ERR_INVALID, "lora: blocks [%d, %d) of %d", l0, l1, m->hp.n_layer);
        return QL_ERR_INVALID;
    }
    if (spec.r <= 0 || !(spec.alpha > 0) || spec.dropout < 0 || spec.dropout >= 1) {
        ql_ctx_set_error(ctx, QL_ERR_INVALID, "lora: r %d must be positive, alpha %g positive, dropout %g in [0, 1)", spec.r,
                         (double)spec.alpha, (double)spec.dropout);
        return QL_ERR_INVALID;
    }
    for (const std::string &t : spec.targets)
        if (!ql_lora_target_valid(t)) {
            ql_ctx_set_error(ctx, QL_ERR_INVALID, "lora: unknown target '%s' (q, k, v, o, gate, up, down, or all)", t.c_str());
            return QL_ERR_INVALID;
        }
    const float scale = spec.rslora ? spec.alpha / std::sqrt((float)spec.r) : spec.alpha / (float)spec.r;
    uint64_t s = spec.init_seed;  // splitmix64: the same initial adapter on every platform
    auto uniform = [&s]() {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return (double)(z >> 11) * 0x1p-53;  // [0, 1)
    };
    // the draws and dropout streams of the whole model, whatever the range: a block's adapter and
    // masks are the same in every split
    uint32_t stream = 1;
    for (int il = 0; il < l1; il++)
        for (const char *t : k_lora_targets) {  // a fixed order, whatever the order given
            if (std::find(spec.targets.begin(), spec.targets.end(), t) == spec.targets.end()) continue;
            ql_tensor *w = target_weight(m->layers[(size_t)il], t);
            if (il < l0) {  // another range's: its stream and A's draws passed over
                stream++;
                s += 0x9E3779B97F4A7C15ull * (uint64_t)(w->ne[0] * spec.r);
                continue;
            }
            ql_lora_pair p;
            p.a = ql_set_param(ql_format_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, w->ne[0], spec.r), "%s.lora_a", w->name));
            p.b = ql_set_param(ql_format_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, spec.r, w->ne[1]), "%s.lora_b", w->name));
            if (!p.a || !p.b) return ql_ctx_status(ctx);
            if (p.a->data) {  // (a measuring context has no data to fill)
                const double bound = 1.0 / std::sqrt((double)w->ne[0]);
                for (int64_t i = 0; i < ql_nelements(p.a); i++) ((float *)p.a->data)[i] = (float)((2 * uniform() - 1) * bound);
                memset(p.b->data, 0, ql_nbytes(p.b));
            }
            p.scale = scale;
            p.dropout = spec.dropout;
            p.seed = spec.dropout > 0 ? seed : nullptr;
            p.stream = stream++;
            m->lora[w] = p;
        }
    return ql_ctx_status(ctx);
}

std::vector<ql_tensor *> ql_llama_lora_params(const ql_llama &m) {
    return ql_llama_lora_params_range(m, 0, (int)m.layers.size());
}

std::vector<ql_tensor *> ql_llama_lora_params_range(const ql_llama &m, int l0, int l1) {
    std::vector<ql_tensor *> out;
    for (int il = l0; il < l1; il++) {
        const ql_llama_layer &L = m.layers[(size_t)il];
        for (ql_tensor *w : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) {
            auto it = m.lora.find(w);
            if (it == m.lora.end()) continue;
            out.push_back(it->second.a);
            out.push_back(it->second.b);
        }
    }
    return out;
}

// ---- generation with a KV cache ----

std::vector<ql_backend_buffer *> ql_llama_repack_weights(ql_backend *be, const ql_llama *m, const char *tool) {
    std::vector<ql_backend_buffer *> bufs;
    if (!be || !m || !ql_backend_is_host(be) || !m->q8_activations) return bufs;
    for (ql_type type : {QL_TYPE_Q4_0, QL_TYPE_Q4_K, QL_TYPE_Q6_K, QL_TYPE_NF4, QL_TYPE_NF4_NODQ}) {
        if (!ql_cpu_repacks(type)) continue;
        std::vector<ql_tensor *> ws;
        auto add = [&ws, type](ql_tensor *t) {
            const bool nf4 = type == QL_TYPE_NF4 || type == QL_TYPE_NF4_NODQ;  // (rows of whole blocks of 64)
            if (t && t->type == type && t->ne[1] % 8 == 0 && (!nf4 || t->ne[0] % 64 == 0) && std::find(ws.begin(), ws.end(), t) == ws.end())
                ws.push_back(t);
        };
        for (const ql_llama_layer &l : m->layers)
            for (ql_tensor *t : {l.wq, l.wk, l.wv, l.wo, l.w_gate, l.w_up, l.w_down}) add(t);
        add(m->output);
        if (ws.empty()) continue;
        char err[256] = {0};
        if (ql_backend_buffer *b = ql_backend_cache_weights(be, ws.data(), (int)ws.size(), type, err, sizeof(err))) bufs.push_back(b);
        else fprintf(stderr, "%s: note: %s weights read as rows, not repacked (%s)\n", tool, ql_type_name(type), err);
    }
    return bufs;
}

ql_status ql_llama_cache_create(ql_context *ctx, const ql_llama *m, int n_ctx, ql_llama_cache *cache, ql_type type) {
    if (n_ctx <= 0) {
        ql_ctx_set_error(ctx, QL_ERR_INVALID, "llama: cache length %d must be positive", n_ctx);
        return QL_ERR_INVALID;
    }
    if (type != QL_TYPE_F32 && type != QL_TYPE_F16) {
        ql_ctx_set_error(ctx, QL_ERR_TYPE, "llama: a KV cache in %s (f32 or f16)", ql_type_name(type));
        return QL_ERR_TYPE;
    }
    const ql_llama_hparams &hp = m->hp;
    cache->n_ctx = n_ctx;
    cache->k.clear();
    cache->v.clear();
    for (int il = 0; il < hp.n_layer; il++) {
        cache->k.push_back(ql_format_name(ql_new_tensor_3d(ctx, type, hp.head_dim(), n_ctx, hp.n_head_kv), "cache_k.%d", il));
        cache->v.push_back(ql_format_name(ql_new_tensor_3d(ctx, type, hp.head_dim(), n_ctx, hp.n_head_kv), "cache_v.%d", il));
    }
    cache->write_pos = ql_set_input(ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1), "cache_write_pos"));
    cache->n_kv = ql_set_input(ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1), "cache_n_kv"));
    return ql_ctx_status(ctx);
}

ql_tensor *ql_llama_forward_cached(ql_context *ctx, const ql_llama *m, const ql_llama_cache *cache, ql_tensor *tokens,
                                   ql_tensor *pos, bool last_only) {
    ql_tensor *x = ql_get_rows(ctx, m->tok_embd, tokens);  // [n_embd, T, 1]
    for (int il = 0; il < m->hp.n_layer; il++) x = block(ctx, m, il, x, pos, nullptr, cache);
    if (x && last_only && x->ne[1] > 1) x = ql_view_2d(ctx, x, x->ne[0], 1, x->nb[1], (size_t)(x->ne[1] - 1) * x->nb[1]);  // [n_embd, 1]
    ql_tensor *logits = head(ctx, m, x);  // [n_vocab, T or 1, 1]
    return logits ? ql_reshape_2d(ctx, logits, logits->ne[0], logits->ne[1]) : nullptr;
}

// ---- a model in a GGUF file ----

namespace {

struct loader {
    const char *path;
    ql_gguf *g;
    std::string arch;
    char *err;
    size_t err_size;
    bool failed = false;

    void fail(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
        if (failed) return;
        failed = true;
        char msg[400];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        snprintf(err, err_size, "%s: %s", path, msg);
    }
    // "{arch}.suffix" as an integer; required unless a default is given
    int64_t key_int(const char *suffix, int64_t def, bool required) {
        const std::string key = arch + "." + suffix;
        const int64_t i = ql_gguf_find_kv(g, key.c_str());
        if (i < 0) {
            if (required) fail("missing key %s", key.c_str());
            return def;
        }
        int64_t v = 0;
        if (ql_gguf_get_i64(g, i, &v) && (v < 0 || v > (1 << 24))) {
            fail("key %s = %lld is out of range", key.c_str(), (long long)v);
            return def;
        }
        if (!ql_gguf_get_i64(g, i, &v)) {
            fail("key %s is a %s, not an integer%s", key.c_str(),
                 ql_gguf_kv_type(g, i) == QL_GGUF_ARRAY ? "array" : "non-integer",
                 ql_gguf_kv_type(g, i) == QL_GGUF_ARRAY ? " (per-layer values are not supported)" : "");
            return def;
        }
        return v;
    }
    double key_float(const char *suffix, double def) {
        const std::string key = arch + "." + suffix;
        const int64_t i = ql_gguf_find_kv(g, key.c_str());
        double v = def;
        if (i >= 0 && !ql_gguf_get_f64(g, i, &v)) fail("key %s is not a number", key.c_str());
        return v;
    }
    // binds a tensor of the expected shape; optional ones may be absent (NULL)
    ql_tensor *tensor(ql_context *ctx, const std::string &name, int64_t ne0, int64_t ne1, bool optional) {
        if (failed) return nullptr;
        const int64_t i = ql_gguf_find_tensor(g, name.c_str());
        if (i < 0) {
            if (!optional) fail("missing tensor %s", name.c_str());
            return nullptr;
        }
        int64_t ne[4];
        ql_gguf_tensor_ne(g, i, ne);
        const int want_nd = ne1 > 1 ? 2 : 1;
        if (ne[0] != ne0 || ne[1] != ne1 || ne[2] != 1 || ne[3] != 1) {
            fail("tensor %s has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld] for these hyper-parameters",
                 name.c_str(), (long long)ne[0], (long long)ne[1], (long long)ne[2], (long long)ne[3], (long long)ne0,
                 (long long)ne1);
            return nullptr;
        }
        const ql_type type = ql_gguf_tensor_type(g, i);
        if (!ql_type_traits_get(type)->is_float || (want_nd == 1 && type != QL_TYPE_F32)) {
            fail("tensor %s has type %s; %s", name.c_str(), ql_type_name(type),
                 want_nd == 1 ? "norms and biases must be f32" : "not a number type");
            return nullptr;
        }
        ql_tensor *t = ql_new_tensor_2d(ctx, type, ne0, ne1);
        if (!t) {
            fail("%s", ql_ctx_error(ctx));
            return nullptr;
        }
        if (ql_nbytes(t) + t->aux_size != ql_gguf_tensor_size(g, i)) {
            fail("tensor %s holds %zu bytes, %zu expected", name.c_str(), ql_gguf_tensor_size(g, i), ql_nbytes(t) + t->aux_size);
            return nullptr;
        }
        t->data = const_cast<void *>(ql_gguf_tensor_data(g, i));  // zero copy: read-only mapping
        if (ql_gguf_is_mapped(g)) t->flags |= QL_FLAG_MAPPED;  // a device run gives its pages back once placed
        ql_set_name(t, name.c_str());
        return t;
    }
};

}  // namespace

ql_llama_file *ql_llama_load(const char *path, char *err, size_t err_size) {
    ql_gguf *g = ql_gguf_open(path, err, err_size);
    if (!g) return nullptr;
    loader L{path, g, "", err, err_size};
    size_t len = 0;
    const int64_t ia = ql_gguf_find_kv(g, "general.architecture");
    const char *arch = ia >= 0 ? ql_gguf_get_str(g, ia, &len) : nullptr;
    const int64_t itype = ql_gguf_find_kv(g, "general.type");
    const char *type = itype >= 0 ? ql_gguf_get_str(g, itype, &len) : nullptr;
    if (type && !strcmp(type, "adapter")) {  // an adapter given where a model belongs
        L.fail("a LoRA adapter, not a model (give it with --lora, and the base model with -m)");
    } else if (type && !strcmp(type, "qlora-checkpoint")) {  // finetune's checkpoint.gguf
        L.fail("a finetune checkpoint, not a model (finetune --resume DIR continues it, --export DIR writes its adapter)");
    } else if (!arch) {
        L.fail("no general.architecture string: not a model file");
    } else if (strcmp(arch, "llama") && strcmp(arch, "mistral") && strcmp(arch, "qwen2")) {
        L.fail("unknown architecture '%s' (supported: llama, mistral, qwen2)", arch);
    }
    if (L.failed) {
        ql_gguf_close(g);
        return nullptr;
    }
    L.arch = arch;
    ql_llama_hparams hp;
    hp.n_embd    = (int)L.key_int("embedding_length", 0, true);
    hp.n_layer   = (int)L.key_int("block_count", 0, true);
    hp.n_ff      = (int)L.key_int("feed_forward_length", 0, true);
    hp.n_head    = (int)L.key_int("attention.head_count", 0, true);
    hp.n_head_kv = (int)L.key_int("attention.head_count_kv", hp.n_head, false);
    hp.n_ctx_train = (int)L.key_int("context_length", 0, false);
    hp.norm_eps  = (float)L.key_float("attention.layer_norm_rms_epsilon", 1e-5);
    hp.rope_base = (float)L.key_float("rope.freq_base", 10000.0);
    hp.rope_mode = L.arch == "qwen2" ? QL_ROPE_NEOX : QL_ROPE_NORMAL;
    const int64_t it = ql_gguf_find_tensor(g, "token_embd.weight");
    if (it >= 0) {
        int64_t ne[4];
        ql_gguf_tensor_ne(g, it, ne);
        hp.n_vocab = (int)ne[1];
    }
    // the head size: llama.cpp's key_length and value_length (Mistral-Nemo, Qwen3: n_head * head
    // size need not be n_embd); absent, n_embd / n_head. One size serves q, k and v here.
    const bool has_kl = ql_gguf_find_kv(g, (L.arch + ".attention.key_length").c_str()) >= 0,
               has_vl = ql_gguf_find_kv(g, (L.arch + ".attention.value_length").c_str()) >= 0;
    if (!L.failed && (has_kl || has_vl)) {
        const int64_t hd0 = hp.n_head > 0 ? hp.n_embd / hp.n_head : 0;
        const int64_t kl = L.key_int("attention.key_length", hd0, false), vl = L.key_int("attention.value_length", kl, false);
        if (!L.failed && kl != vl)
            L.fail("%s.attention.value_length %lld differs from %s.attention.key_length %lld: keys and values of different "
                   "head sizes are not supported", L.arch.c_str(), (long long)vl, L.arch.c_str(), (long long)kl);
        else if (!L.failed && (kl <= 0 || kl > 512 || kl % 2))
            L.fail("%s.attention.key_length %lld: an even head size from 2 to 512 expected", L.arch.c_str(), (long long)kl);
        hp.n_embd_head = (int)kl;
    }
    if (!L.failed && (hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.n_ff <= 0 ||
                      (hp.n_embd_head == 0 && hp.n_embd % hp.n_head != 0) || hp.n_head % hp.n_head_kv != 0 ||
                      hp.n_layer > 4096))
        L.fail("inconsistent hyper-parameters (embd %d, layers %d, heads %d/%d, ff %d)", hp.n_embd, hp.n_layer, hp.n_head,
               hp.n_head_kv, hp.n_ff);
    // a NaN or negative epsilon, a zero rope base: every output would be nan - refused here, not printed as "nan" later
    if (!L.failed && !(std::isfinite(hp.norm_eps) && hp.norm_eps > 0))
        L.fail("%s.attention.layer_norm_rms_epsilon is %g: a positive finite number expected", L.arch.c_str(), (double)hp.norm_eps);
    if (!L.failed && !(std::isfinite(hp.rope_base) && hp.rope_base > 0))
        L.fail("%s.rope.freq_base is %g: a positive finite number expected", L.arch.c_str(), (double)hp.rope_base);
    if (!L.failed) {
        hp.n_rot = (int)L.key_int("rope.dimension_count", hp.head_dim(), false);
        if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim() || hp.n_rot % 2) L.fail("rope.dimension_count %d does not fit head size %d", hp.n_rot, hp.head_dim());
    }
    if (!L.failed && it < 0) L.fail("missing tensor token_embd.weight");
    // rope scaling given as keys: "none", or "linear" (positions divided by the factor: every
    // frequency divided by it, so it joins the per-frequency divisors below); Llama 3.1's comes
    // as the rope_freqs tensor instead
    const int64_t irs = ql_gguf_find_kv(g, (L.arch + ".rope.scaling.type").c_str());
    const char *rs = irs >= 0 ? ql_gguf_get_str(g, irs, &len) : nullptr;
    float linear = 1.0f;
    if (!L.failed && irs >= 0 && rs && !strcmp(rs, "linear")) {
        linear = (float)L.key_float("rope.scaling.factor", 1.0);
        if (!(std::isfinite(linear) && linear > 0)) L.fail("%s.rope.scaling.factor is %g: a positive finite number expected", L.arch.c_str(), (double)linear);
    } else if (!L.failed && irs >= 0 && (!rs || strcmp(rs, "none")))
        L.fail("rope scaling '%s' (%s.rope.scaling.type) is not supported (none and linear are; Llama 3.1's is the rope_freqs tensor)",
               rs ? rs : "?", L.arch.c_str());
    if (L.failed) {
        ql_gguf_close(g);
        return nullptr;
    }

    ql_llama_file *f = new ql_llama_file();
    f->gguf = g;
    f->arch = L.arch;
    ql_init_params ip = {(size_t)(hp.n_layer * 12 + 9) * ql_tensor_overhead(), nullptr, true, false};
    f->ctx = ql_init(ip);
    ql_llama &m = f->model;
    m.hp = hp;
    const int64_t E = hp.n_embd, d = hp.head_dim(), nq = hp.n_head * d, nkv = hp.n_head_kv * d;
    m.tok_embd = L.tensor(f->ctx, "token_embd.weight", E, hp.n_vocab, false);
    m.out_norm = L.tensor(f->ctx, "output_norm.weight", E, 1, false);
    m.output = L.tensor(f->ctx, "output.weight", E, hp.n_vocab, true);
    if (!m.output) m.output = m.tok_embd;  // tied
    m.rope_freqs = L.tensor(f->ctx, "rope_freqs.weight", hp.n_rot / 2, 1, true);
    if (linear != 1.0f && !L.failed) {  // the divisors times the factor, held by the file object
        f->rope_linear.assign((size_t)hp.n_rot / 2, linear);
        if (m.rope_freqs)
            for (int i = 0; i < hp.n_rot / 2; i++) f->rope_linear[(size_t)i] *= ((const float *)m.rope_freqs->data)[i];
        m.rope_freqs = ql_new_tensor_1d(f->ctx, QL_TYPE_F32, hp.n_rot / 2);
        m.rope_freqs->data = f->rope_linear.data();
        ql_set_name(m.rope_freqs, "rope_freqs.weight");
    }
    m.layers.resize((size_t)hp.n_layer);
    for (int il = 0; il < hp.n_layer && !L.failed; il++) {
        ql_llama_layer &Y = m.layers[(size_t)il];
        const std::string p = "blk." + std::to_string(il) + ".";
        Y.attn_norm = L.tensor(f->ctx, p + "attn_norm.weight", E, 1, false);
        Y.wq = L.tensor(f->ctx, p + "attn_q.weight", E, nq, false);
        Y.wk = L.tensor(f->ctx, p + "attn_k.weight", E, nkv, false);
        Y.wv = L.tensor(f->ctx, p + "attn_v.weight", E, nkv, false);
        Y.wo = L.tensor(f->ctx, p + "attn_output.weight", nq, E, false);
        Y.bq = L.tensor(f->ctx, p + "attn_q.bias", nq, 1, true);
        Y.bk = L.tensor(f->ctx, p + "attn_k.bias", nkv, 1, true);
        Y.bv = L.tensor(f->ctx, p + "attn_v.bias", nkv, 1, true);
        Y.ffn_norm = L.tensor(f->ctx, p + "ffn_norm.weight", E, 1, false);
        Y.w_gate = L.tensor(f->ctx, p + "ffn_gate.weight", E, hp.n_ff, false);
        Y.w_up = L.tensor(f->ctx, p + "ffn_up.weight", E, hp.n_ff, false);
        Y.w_down = L.tensor(f->ctx, p + "ffn_down.weight", hp.n_ff, E, false);
    }
    if (L.failed) {
        ql_llama_file_free(f);
        return nullptr;
    }
    return f;
}

void ql_llama_file_free(ql_llama_file *f) {
    if (!f) return;
    ql_free(f->ctx);
    ql_gguf_close(f->gguf);
    delete f;
}

// ---- llama.cpp LoRA adapters ----

ql_lora_adapter *ql_llama_attach_lora(ql_llama *m, const char *arch, const char *path, float user_scale, char *err,
                                      size_t err_size) {
    ql_gguf *g = ql_gguf_open(path, err, err_size);
    if (!g) return nullptr;
    ql_lora_adapter *ad = new ql_lora_adapter();
    ad->gguf = g;
    auto fail = [&](const std::string &msg) -> ql_lora_adapter * {
        snprintf(err, err_size, "%s: %s", path, msg.c_str());
        ql_lora_adapter_free(ad);
        return nullptr;
    };
    size_t len;
    auto str = [&](const char *key) {
        const int64_t i = ql_gguf_find_kv(g, key);
        return i >= 0 ? ql_gguf_get_str(g, i, &len) : nullptr;
    };
    const char *type = str("general.type"), *atype = str("adapter.type"), *a_arch = str("general.architecture");
    if (!type || strcmp(type, "adapter") || !atype || strcmp(atype, "lora"))
        return fail("not a LoRA adapter (general.type \"adapter\" and adapter.type \"lora\" expected)");
    if (!a_arch || strcmp(a_arch, arch))
        return fail(std::string("an adapter for architecture '") + (a_arch ? a_arch : "?") + "', the model is '" + arch + "'");
    double alpha = 0;
    const int64_t ial = ql_gguf_find_kv(g, "adapter.lora.alpha");
    if (ial < 0 || !ql_gguf_get_f64(g, ial, &alpha)) return fail("missing adapter.lora.alpha");
    ad->alpha = (float)alpha;
    if (!std::isfinite(ad->alpha) || ad->alpha < 0)  // (a double beyond float's range is inf here)
        return fail("adapter.lora.alpha is " + std::to_string(alpha) + ": a finite number >= 0 expected");

    std::unordered_map<std::string, ql_tensor *> by_name;  // the model's linear weights
    for (ql_llama_layer &L : m->layers)
        for (ql_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) by_name[t->name] = t;
    by_name[m->output->name] = m->output;
    struct idx {
        int64_t a = -1, b = -1;
    };
    std::unordered_map<ql_tensor *, idx> found;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const std::string name = ql_gguf_tensor_name(g, i);
        const bool is_a = name.size() > 7 && name.compare(name.size() - 7, 7, ".lora_a") == 0;
        const bool is_b = name.size() > 7 && name.compare(name.size() - 7, 7, ".lora_b") == 0;
        if (!is_a && !is_b) return fail("unexpected tensor " + name + " (an adapter holds only .lora_a / .lora_b)");
        const std::string base = name.substr(0, name.size() - 7);
        auto w = by_name.find(base);
        if (w == by_name.end()) return fail("tensor " + name + " adapts " + base + ", which the model does not have");
        (is_a ? found[w->second].a : found[w->second].b) = i;
    }
    if (found.empty()) return fail("no adapter tensors");
    ql_init_params ip = {found.size() * 2 * ql_tensor_overhead() + 1024, nullptr, true, false};
    ad->ctx = ql_init(ip);
    std::unordered_map<const ql_tensor *, ql_lora_pair> pairs;
    for (const auto &kv : found) {
        const ql_tensor *w = kv.first;
        if (kv.second.a < 0 || kv.second.b < 0) return fail(std::string("weight ") + w->name + " has only one of lora_a, lora_b");
        int64_t na[4], nb[4];
        ql_gguf_tensor_ne(g, kv.second.a, na);
        ql_gguf_tensor_ne(g, kv.second.b, nb);
        const int64_t r = na[1];
        if (r <= 0) return fail(std::string("the adapter of ") + w->name + " has rank 0");
        if (na[0] != w->ne[0] || nb[0] != r || nb[1] != w->ne[1] || na[2] * na[3] * nb[2] * nb[3] != 1)
            return fail(std::string("the adapter of ") + w->name + " has lora_a [" + std::to_string(na[0]) + ", " +
                        std::to_string(na[1]) + "] and lora_b [" + std::to_string(nb[0]) + ", " + std::to_string(nb[1]) +
                        "]; the weight is [" + std::to_string(w->ne[0]) + ", " + std::to_string(w->ne[1]) + "]");
        ql_lora_pair p;
        p.a = ql_new_tensor_2d(ad->ctx, ql_gguf_tensor_type(g, kv.second.a), na[0], na[1]);
        p.b = ql_new_tensor_2d(ad->ctx, ql_gguf_tensor_type(g, kv.second.b), nb[0], nb[1]);
        if (!p.a || !p.b) return fail(ql_ctx_error(ad->ctx));
        p.a->data = const_cast<void *>(ql_gguf_tensor_data(g, kv.second.a));
        p.b->data = const_cast<void *>(ql_gguf_tensor_data(g, kv.second.b));
        p.scale = (float)(alpha != 0 ? user_scale * alpha / (double)r : user_scale);  // llama.cpp: alpha 0 = the user scale
        pairs[w] = p;
    }
    for (const auto &kv : pairs) m->lora[kv.first] = kv.second;  // only once everything checked out
    ad->n_pairs = (int)pairs.size();
    return ad;
}

void ql_lora_adapter_free(ql_lora_adapter *a) {
    if (!a) return;
    ql_free(a->ctx);
    ql_gguf_close(a->gguf);
    delete a;
}
