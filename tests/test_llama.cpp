// The llama family: logits against an independent float64 torch reference (tests/golden/
// llama_logits.bin from tests/reference/llama_golden.py), GGUF loading and its errors, and the
// KV cache agreeing with the full forward.
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "tiny.h"
#include "util.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

struct golden_case {
    std::string name;
    std::vector<int32_t> tokens;
    int V = 0;
    std::vector<float> logits;  // [T, V]
};

std::vector<golden_case> load_golden() {
    std::vector<golden_case> out;
    FILE *f = fopen((tests_dir() + "golden/llama_logits.bin").c_str(), "rb");
    if (!f) return out;
    char magic[8];
    int32_t n = 0;
    if (fread(magic, 1, 8, f) == 8 && !memcmp(magic, "QLLOGITS", 8) && fread(&n, 4, 1, f) == 1)
        for (int i = 0; i < n; i++) {
            golden_case c;
            int32_t len = 0, T = 0;
            if (fread(&len, 4, 1, f) != 1 || len <= 0 || len > 200) break;
            c.name.resize((size_t)len);
            if (fread(&c.name[0], 1, (size_t)len, f) != (size_t)len || fread(&T, 4, 1, f) != 1 || fread(&c.V, 4, 1, f) != 1) break;
            c.tokens.resize((size_t)T);
            c.logits.resize((size_t)T * (size_t)c.V);
            if (fread(c.tokens.data(), 4, (size_t)T, f) != (size_t)T ||
                fread(c.logits.data(), 4, c.logits.size(), f) != c.logits.size())
                break;
            out.push_back(c);
        }
    fclose(f);
    return out;
}

const golden_case *find_case(const std::vector<golden_case> &cs, const char *name) {
    for (const golden_case &c : cs)
        if (c.name == name) return &c;
    return nullptr;
}

// the reference script's generator: splitmix64, 24-bit uniforms in [-1, 1), exact in f32
struct gen {
    uint64_t s;
    float next() {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return (float)(z >> 40) * 0x1p-23f - 1.0f;
    }
    void fill(ql_tensor *t, double scale, float offset = 0.0f) {  // python: f32(f32(u * scale) + offset)
        float *d = (float *)t->data;
        for (int64_t i = 0; i < ql_nelements(t); i++) {
            const float v = (float)((double)next() * scale);
            d[i] = v + offset;
        }
    }
};

// the golden file's random model: GQA (6 heads over 2), Qwen2-style biases, neox rope, base 1e6
struct random_model {
    ql_context *ctx;
    ql_llama m;
    random_model() {
        ql_init_params ip = {16u << 20, nullptr, false, false};
        ctx = ql_init(ip);
        ql_llama_hparams hp = tiny_hparams(101, 96, 160, 2, 6, 2);
        hp.rope_base = 1000000.0f;
        hp.rope_mode = QL_ROPE_NEOX;
        REQUIRE(ql_llama_create(ctx, &m, hp, QL_TYPE_F32, false) == QL_OK);
        gen g{4242};
        g.fill(m.tok_embd, 0.5);
        for (int il = 0; il < 2; il++) {
            ql_llama_layer &L = m.layers[(size_t)il];
            L.bq = ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, 96), "blk.%d.attn_q.bias", il);
            L.bk = ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, 32), "blk.%d.attn_k.bias", il);
            L.bv = ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, 32), "blk.%d.attn_v.bias", il);
            g.fill(L.attn_norm, 0.2, 1.0f);
            g.fill(L.wq, 0.15);
            g.fill(L.wk, 0.15);
            g.fill(L.wv, 0.15);
            g.fill(L.bq, 0.3);
            g.fill(L.bk, 0.3);
            g.fill(L.bv, 0.3);
            g.fill(L.wo, 0.1);
            g.fill(L.ffn_norm, 0.2, 1.0f);
            g.fill(L.w_gate, 0.1);
            g.fill(L.w_up, 0.1);
            g.fill(L.w_down, 0.1);
        }
        g.fill(m.out_norm, 0.2, 1.0f);
        g.fill(m.output, 0.3);
    }
    ~random_model() { ql_free(ctx); }
};

// writes the model as a GGUF of the given architecture (biases included when present)
void write_gguf(const ql_llama &m, const char *arch, const std::string &path, const char *skip_tensor = nullptr,
                const char *skip_key = nullptr) {
    llama_gguf_opts o;
    o.arch = arch;
    o.rope_base = true;
    o.skip_tensor = skip_tensor;
    o.skip_key = skip_key;
    write_llama_gguf(m, path, o);
}

}  // namespace

TEST_CASE("llama: random GQA model with biases and neox rope matches the float64 reference") {
    const std::vector<golden_case> cs = load_golden();
    const golden_case *c = find_case(cs, "random-gqa-bias-neox");
    REQUIRE_MESSAGE(c, "cannot read tests/golden/llama_logits.bin");
    random_model rm;
    const std::vector<float> got = logits_of(rm.m, c->tokens);
    const double e = rel_err(got, c->logits);
    MESSAGE("random GQA/bias/neox model: max |logit - ref| / max |ref| = ", e);
    CHECK(e < 1e-4);

    // the same model through a qwen2 GGUF file: the loader finds biases, neox rope, GQA
    tmpdir d;
    const std::string path = d.path + "/qwen2.gguf";
    write_gguf(rm.m, "qwen2", path);
    char err[256];
    ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    CHECK(f->arch == "qwen2");
    CHECK(f->model.hp.rope_mode == QL_ROPE_NEOX);
    CHECK(f->model.hp.n_head_kv == 2);
    CHECK(f->model.layers[1].bk != nullptr);
    const std::vector<float> again = logits_of(f->model, c->tokens, 3);
    CHECK(memcmp(again.data(), got.data(), got.size() * 4) == 0);
    ql_llama_file_free(f);
}

TEST_CASE("llama: the KV cache gives the full forward's logits, prompt then one token at a time") {
    random_model rm;
    const std::vector<int32_t> toks = {5, 17, 3, 99, 42, 42, 7, 0, 64, 12, 31, 8};
    const std::vector<float> full = logits_of(rm.m, toks);
    const int V = rm.m.hp.n_vocab, n_prompt = 5, n_ctx = 16;
    ql_type ctype = QL_TYPE_F32;
    double tol = 1e-5;
    SUBCASE("an f32 cache") {}
    SUBCASE("an f16 cache (keys and values rounded as stored)") {
        ctype = QL_TYPE_F16;
        tol = 1e-3;  // (measured 1.7e-4)
    }
    const std::string ctype_name = ql_type_name(ctype);
    CAPTURE(ctype_name);
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_llama_cache cache;
    REQUIRE(ql_llama_cache_create(ctx, &rm.m, n_ctx, &cache, ctype) == QL_OK);
    CHECK(cache.k[0]->type == ctype);
    // two static graphs: the prompt (5 tokens) and one token
    ql_tensor *pt = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1), *pp = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1);
    ql_tensor *ot = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1), *op = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1);
    ql_tensor *lp = ql_set_output(ql_llama_forward_cached(ctx, &rm.m, &cache, pt, pp));
    ql_tensor *lo = ql_set_output(ql_llama_forward_cached(ctx, &rm.m, &cache, ot, op));
    REQUIRE_MESSAGE(lo, ql_ctx_error(ctx));
    ql_graph *gp = ql_graph_new(ctx), *go = ql_graph_new(ctx);
    ql_graph_build_forward(gp, lp);
    ql_graph_build_forward(go, lo);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(ql_graph_alloc(gp, be) == QL_OK);
    REQUIRE(ql_graph_alloc(go, be) == QL_OK);
    for (int t = 0; t < n_prompt; t++) {
        ((int32_t *)pt->data)[t] = toks[(size_t)t];
        ((int32_t *)pp->data)[t] = t;
    }
    *(int32_t *)cache.write_pos->data = 0;
    *(int32_t *)cache.n_kv->data = n_prompt;
    REQUIRE(ql_backend_graph_compute(be, gp) == QL_OK);
    std::vector<float> got((const float *)lp->data, (const float *)lp->data + n_prompt * V);
    {  // the prompt with the last token's logits alone (generate): that row of the full prompt's
        ql_tensor *pl = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1), *ql = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1);
        ql_tensor *ll = ql_set_output(ql_llama_forward_cached(ctx, &rm.m, &cache, pl, ql, true));
        REQUIRE_MESSAGE(ll, ql_ctx_error(ctx));
        CHECK(ll->ne[0] == V);
        CHECK(ql_nelements(ll) == V);
        ql_graph *gl = ql_graph_new(ctx);
        ql_graph_build_forward(gl, ll);
        REQUIRE(ql_graph_alloc(gl, be) == QL_OK);
        memcpy(pl->data, pt->data, ql_nbytes(pt));
        memcpy(ql->data, pp->data, ql_nbytes(pp));
        REQUIRE(ql_backend_graph_compute(be, gl) == QL_OK);
        const std::vector<float> last(got.end() - V, got.end()), one((const float *)ll->data, (const float *)ll->data + V);
        CHECK(rel_err(one, last) < 1e-5);
        ql_graph_free(gl);
    }
    for (int t = n_prompt; t < (int)toks.size(); t++) {
        *(int32_t *)ot->data = toks[(size_t)t];
        *(int32_t *)op->data = t;
        *(int32_t *)cache.write_pos->data = t;
        *(int32_t *)cache.n_kv->data = t + 1;
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, go) == QL_OK, ql_ctx_error(ctx));
        got.insert(got.end(), (const float *)lo->data, (const float *)lo->data + V);
    }
    const double e = rel_err(got, full);
    MESSAGE(std::string(ql_type_name(ctype)) << " cache: logits within " << e << " of the full forward's");
    CHECK(e < tol);
    CHECK((ctype == QL_TYPE_F32 || e > 1e-6));  // (the f16 rounding is there)
    // past the cache: a clear run-time error
    *(int32_t *)cache.write_pos->data = n_ctx;
    *(int32_t *)cache.n_kv->data = n_ctx + 1;
    CHECK(ql_backend_graph_compute(be, go) == QL_ERR_INVALID);
    CHECK(std::string(ql_ctx_error(ctx)).find("cache") != std::string::npos);
    ql_graph_free(gp);
    ql_graph_free(go);
    ql_backend_free(be);
    ql_free(ctx);
}

TEST_CASE("llama: loading refuses what it cannot run, naming what is wrong") {
    random_model rm;
    tmpdir d;
    char err[300];
    struct bad_case {
        const char *arch, *skip_tensor, *skip_key, *says;
    };
    const bad_case cases[] = {
        {"gpt-neox", nullptr, nullptr, "unknown architecture 'gpt-neox'"},
        {"llama", "blk.1.ffn_up.weight", nullptr, "missing tensor blk.1.ffn_up.weight"},
        {"llama", nullptr, "block_count", "missing key llama.block_count"},
        {"llama", "token_embd.weight", nullptr, "missing tensor token_embd.weight"},
    };
    for (const bad_case &c : cases) {
        const std::string path = d.path + "/bad.gguf";
        write_gguf(rm.m, c.arch, path, c.skip_tensor, c.skip_key);
        CAPTURE(c.says);
        CHECK(ql_llama_load(path.c_str(), err, sizeof(err)) == nullptr);
        CHECK(std::string(err).find(c.says) != std::string::npos);
        CHECK(std::string(err).find("bad.gguf") != std::string::npos);
    }
    // a wrong shape: heads that do not divide the kv projection
    {
        const std::string path = d.path + "/shape.gguf";
        ql_llama_hparams hp = rm.m.hp;
        rm.m.hp.n_head_kv = 3;
        write_gguf(rm.m, "llama", path);
        rm.m.hp = hp;
        CHECK(ql_llama_load(path.c_str(), err, sizeof(err)) == nullptr);
        CHECK(std::string(err).find("has shape") != std::string::npos);
    }
    // an rms epsilon that makes every output nan (NaN, negative, zero) is refused at load, not printed later
    for (const float eps : {NAN, -1e-5f, 0.0f}) {
        CAPTURE(eps);
        const std::string path = d.path + "/eps.gguf";
        const ql_llama_hparams hp = rm.m.hp;
        rm.m.hp.norm_eps = eps;
        write_gguf(rm.m, "llama", path);
        rm.m.hp = hp;
        CHECK(ql_llama_load(path.c_str(), err, sizeof(err)) == nullptr);
        CHECK_MESSAGE(std::string(err).find("llama.attention.layer_norm_rms_epsilon is ") != std::string::npos, err);
    }
    CHECK(ql_llama_load((d.path + "/none.gguf").c_str(), err, sizeof(err)) == nullptr);
    CHECK(std::string(err).find("none.gguf") != std::string::npos);
}

TEST_CASE("llama: stories260K converted from llama2.c matches the float64 reference" * needs_fixture("stories260K/stories260K.bin") *
          needs_tools("convert")) {
    const std::string fx = fixtures_dir();
    fixture("stories260K/stories260K.bin");
    const golden_case *c = nullptr;
    const std::vector<golden_case> cs = load_golden();
    c = find_case(cs, "stories260K");
    REQUIRE(c);
    tmpdir d;
    const std::string out = d.path + "/stories260K.gguf";
    const std::string cmd = "./convert llama2c " + fx + "/stories260K/stories260K.bin " + fx + "/stories260K/tok512.bin -o " +
                            out + " > /dev/null 2>&1";
    REQUIRE(system(cmd.c_str()) == 0);
    char err[300];
    ql_llama_file *f = ql_llama_load(out.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    CHECK(f->model.hp.n_embd == 64);
    CHECK(f->model.hp.n_head_kv == 4);
    CHECK(f->model.output == f->model.tok_embd);  // the classifier is shared
    const std::vector<float> got = logits_of(f->model, c->tokens);
    const double e = rel_err(got, c->logits);
    MESSAGE("stories260K: max |logit - ref| / max |ref| = ", e);
    CHECK(e < 1e-4);
    ql_llama_file_free(f);
}

TEST_CASE("llama: a llama.cpp LoRA adapter gives the logits of the merged weights W + (alpha/r) B A") {
    random_model rm;
    tmpdir d;
    const std::string base = d.path + "/base.gguf", adapter = d.path + "/lora.gguf";
    write_gguf(rm.m, "llama", base);
    char err[300];
    ql_llama_file *f = ql_llama_load(base.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    // an adapter on q and down of both layers: A [in, r], B [r, out], alpha 16, r 4
    const int r = 4;
    const float alpha = 16.0f;
    gen g{77};
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_str(w, "general.type", "adapter");
    ql_gguf_set_str(w, "adapter.type", "lora");
    ql_gguf_set_f32(w, "adapter.lora.alpha", alpha);
    std::vector<std::vector<float>> keep;
    std::vector<std::pair<ql_tensor *, std::pair<size_t, size_t>>> pairs;  // weight, (A index, B index)
    for (const ql_llama_layer &L : f->model.layers)
        for (ql_tensor *wt : {L.wq, L.w_down}) {
            keep.emplace_back((size_t)(wt->ne[0] * r));
            for (float &x : keep.back()) x = 0.1f * g.next();
            keep.emplace_back((size_t)(r * wt->ne[1]));
            for (float &x : keep.back()) x = 0.1f * g.next();
            const int64_t na[4] = {wt->ne[0], r, 1, 1}, nb[4] = {r, wt->ne[1], 1, 1};
            const std::string n = wt->name;
            REQUIRE(ql_gguf_add_tensor(w, (n + ".lora_a").c_str(), QL_TYPE_F32, 2, na, keep[keep.size() - 2].data(),
                                       keep[keep.size() - 2].size() * 4) == QL_OK);
            REQUIRE(ql_gguf_add_tensor(w, (n + ".lora_b").c_str(), QL_TYPE_F32, 2, nb, keep.back().data(),
                                       keep.back().size() * 4) == QL_OK);
            pairs.push_back({wt, {keep.size() - 2, keep.size() - 1}});
        }
    REQUIRE_MESSAGE(ql_gguf_write(w, adapter.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf_writer_free(w);

    ql_lora_adapter *ad = ql_llama_attach_lora(&f->model, "llama", adapter.c_str(), 1.0f, err, sizeof(err));
    REQUIRE_MESSAGE(ad, err);
    CHECK(ad->n_pairs == 4);
    const std::vector<int32_t> toks = {3, 1, 4, 1, 5, 9, 2, 6};
    const std::vector<float> with_adapter = logits_of(f->model, toks);
    // merge into the in-memory model: W[out][in] += (alpha / r) sum_k B[out][k] A[k][in]
    for (const auto &p : pairs) {
        ql_tensor *mw = nullptr;
        for (ql_llama_layer &L : rm.m.layers)
            for (ql_tensor *t : {L.wq, L.w_down})
                if (!strcmp(t->name, p.first->name)) mw = t;
        REQUIRE(mw);
        const std::vector<float> &A = keep[p.second.first], &B = keep[p.second.second];
        const int64_t in = mw->ne[0], out = mw->ne[1];
        for (int64_t o = 0; o < out; o++)
            for (int64_t i = 0; i < in; i++) {
                double s = 0;
                for (int k = 0; k < r; k++) s += (double)B[(size_t)(o * r + k)] * A[(size_t)(k * in + i)];
                ((float *)mw->data)[o * in + i] += (float)(alpha / r * s);
            }
    }
    rm.m.hp.rope_mode = QL_ROPE_NORMAL;  // the file says "llama": normal rope
    const std::vector<float> merged = logits_of(rm.m, toks);
    CHECK(rel_err(with_adapter, merged) < 1e-5);
    CHECK(rel_err(with_adapter, logits_of(f->model, toks)) == 0.0);  // deterministic
    // wrong architecture
    CHECK(ql_llama_attach_lora(&f->model, "qwen2", adapter.c_str(), 1.0f, err, sizeof(err)) == nullptr);
    CHECK(std::string(err).find("architecture 'llama'") != std::string::npos);
    // llama.cpp's rule: alpha 0 means the user scale alone; rank 0 is refused
    {
        const std::string a0 = d.path + "/alpha0.gguf", r0 = d.path + "/rank0.gguf";
        for (int which = 0; which < 2; which++) {
            ql_gguf_writer *w2 = ql_gguf_writer_new();
            ql_gguf_set_str(w2, "general.architecture", "llama");
            ql_gguf_set_str(w2, "general.type", "adapter");
            ql_gguf_set_str(w2, "adapter.type", "lora");
            ql_gguf_set_f32(w2, "adapter.lora.alpha", 0.0f);
            ql_tensor *wq = f->model.layers[0].wq;
            const int rk = which == 0 ? 2 : 0;
            std::vector<float> A((size_t)(wq->ne[0] * rk + 1), 0.01f), Bm((size_t)(rk * wq->ne[1] + 1), 0.02f);
            const int64_t na[4] = {wq->ne[0], rk, 1, 1}, nb[4] = {rk, wq->ne[1], 1, 1};
            REQUIRE(ql_gguf_add_tensor(w2, "blk.0.attn_q.weight.lora_a", QL_TYPE_F32, 2, na, A.data(), A.size() * 4 - 4) == QL_OK);
            REQUIRE(ql_gguf_add_tensor(w2, "blk.0.attn_q.weight.lora_b", QL_TYPE_F32, 2, nb, Bm.data(), Bm.size() * 4 - 4) == QL_OK);
            REQUIRE(ql_gguf_write(w2, (which == 0 ? a0 : r0).c_str(), err, sizeof(err)) == QL_OK);
            ql_gguf_writer_free(w2);
        }
        ql_llama_file *g2 = ql_llama_load(base.c_str(), err, sizeof(err));
        REQUIRE(g2);
        ql_lora_adapter *a = ql_llama_attach_lora(&g2->model, "llama", a0.c_str(), 0.5f, err, sizeof(err));
        REQUIRE_MESSAGE(a, err);
        CHECK(g2->model.lora.at(g2->model.layers[0].wq).scale == 0.5f);
        CHECK(ql_llama_attach_lora(&g2->model, "llama", r0.c_str(), 1.0f, err, sizeof(err)) == nullptr);
        CHECK(std::string(err).find("rank 0") != std::string::npos);
        ql_lora_adapter_free(a);
        ql_llama_file_free(g2);
    }
    ql_lora_adapter_free(ad);
    ql_llama_file_free(f);
}

TEST_CASE("llama: a rope_freqs tensor (Llama 3.1 scaling) and linear scaling keys divide the frequencies; other scalings refused") {
    random_model rm;
    tmpdir d;
    const std::string plain = d.path + "/plain.gguf", scaled = d.path + "/scaled.gguf";
    rm.m.hp.rope_mode = QL_ROPE_NORMAL;
    write_gguf(rm.m, "llama", plain);
    // the same model plus rope_freqs: factors of 1 change nothing; factors of 4 change the logits
    ql_tensor *ff = ql_set_name(ql_new_tensor_1d(rm.ctx, QL_TYPE_F32, 8), "rope_freqs.weight");  // head_dim 16 / 2
    // (scaling_type: instead of the tensor, the keys rope.scaling.type / .factor, as llama.cpp's converter writes linear scaling)
    auto write_with = [&](float factor, const std::string &path, const char *scaling_type = nullptr) {
        for (int i = 0; i < 8; i++) ((float *)ff->data)[i] = factor;
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf *src;
        char err[256];
        src = ql_gguf_open(plain.c_str(), err, sizeof(err));
        REQUIRE(src);
        for (int64_t i = 0; i < ql_gguf_n_kv(src); i++) ql_gguf_copy_kv(w, src, i);
        for (int64_t i = 0; i < ql_gguf_n_tensors(src); i++) {
            int64_t ne[4];
            const int nd = ql_gguf_tensor_ne(src, i, ne);
            REQUIRE(ql_gguf_add_tensor(w, ql_gguf_tensor_name(src, i), ql_gguf_tensor_type(src, i), nd, ne,
                                       ql_gguf_tensor_data(src, i), ql_gguf_tensor_size(src, i)) == QL_OK);
        }
        const int64_t ne[4] = {8, 1, 1, 1};
        if (scaling_type) {
            ql_gguf_set_str(w, "llama.rope.scaling.type", scaling_type);
            ql_gguf_set_f32(w, "llama.rope.scaling.factor", factor);
        } else
            REQUIRE(ql_gguf_add_tensor(w, "rope_freqs.weight", QL_TYPE_F32, 1, ne, ff->data, 32) == QL_OK);
        REQUIRE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK);
        ql_gguf_writer_free(w);
        ql_gguf_close(src);
    };
    char err[256];
    const std::vector<int32_t> toks = {7, 7, 3, 50, 2, 9, 11, 4, 4, 80};
    ql_llama_file *a = ql_llama_load(plain.c_str(), err, sizeof(err));
    REQUIRE(a);
    CHECK(a->model.rope_freqs == nullptr);
    const std::vector<float> base = logits_of(a->model, toks);
    write_with(1.0f, scaled);
    ql_llama_file *b = ql_llama_load(scaled.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(b, err);
    REQUIRE(b->model.rope_freqs != nullptr);
    CHECK(rel_err(logits_of(b->model, toks), base) < 1e-6);
    ql_llama_file_free(b);
    write_with(4.0f, scaled);
    b = ql_llama_load(scaled.c_str(), err, sizeof(err));
    REQUIRE(b);
    const std::vector<float> by4 = logits_of(b->model, toks);
    CHECK(rel_err(by4, base) > 1e-3);
    ql_llama_file_free(b);
    // linear scaling by 4 as keys: every frequency divided by 4, the same logits as the tensor of 4s
    write_with(4.0f, scaled, "linear");
    b = ql_llama_load(scaled.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(b, err);
    CHECK(logits_of(b->model, toks) == by4);
    ql_llama_file_free(b);
    // refused by name: another scaling type, a factor that is not positive
    write_with(4.0f, scaled, "yarn");
    CHECK(ql_llama_load(scaled.c_str(), err, sizeof(err)) == nullptr);
    CHECK_MESSAGE(std::string(err).find("rope scaling 'yarn' (llama.rope.scaling.type) is not supported") != std::string::npos, err);
    write_with(-2.0f, scaled, "linear");
    CHECK(ql_llama_load(scaled.c_str(), err, sizeof(err)) == nullptr);
    CHECK_MESSAGE(std::string(err).find("llama.rope.scaling.factor is -2") != std::string::npos, err);
    ql_llama_file_free(a);
}

TEST_CASE("llama: q8_activations puts the base weights' multiplies on the 8-bit path: close to exact, not equal") {
    const ql_llama_hparams hp = tiny_hparams(96, 128, 192);
    ql_init_params ip = {16u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_llama m;
    REQUIRE(ql_llama_create(ctx, &m, hp, QL_TYPE_Q4_0, false) == QL_OK);
    ql_llama_randomize(&m, 9, 0.05f);  // the f32 tensors; the Q4_0 linears from Gaussians here
    std::mt19937 rng(9);
    std::normal_distribution<float> G(0.0f, 0.05f);
    for (const ql_llama_layer &L : m.layers)
        for (ql_tensor *w : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) {
            REQUIRE(w->type == QL_TYPE_Q4_0);
            std::vector<float> v((size_t)ql_nelements(w));
            for (float &e : v) e = G(rng);
            REQUIRE(ql_quantize(QL_TYPE_Q4_0, v.data(), w->ne[1], w->ne[0], w->data, nullptr, 0) == QL_OK);
        }
    const std::vector<int32_t> toks = {5, 17, 3};  // 3 tokens: within the path's 8 rows
    const std::vector<float> exact = logits_of(m, toks);
    m.q8_activations = true;
    const std::vector<float> q8 = logits_of(m, toks);
    CHECK(q8 != exact);
    CHECK(rel_err(q8, exact) < 0.02);
    MESSAGE("q4_0 tiny llama, 8-bit activations: max |logit diff| / max |logit| = " << rel_err(q8, exact));
    ql_free(ctx);
}

// Issue 30 item 2, attention's side: under a 16-bit compute type q, k and v are made in it (with
// their LoRA), rope and attention read and write it, and the o projection multiplies attention's
// output as it is (no cast): what backward keeps of attention is 16-bit. With biases (an f32
// add) they stay f32, and so does the KV cache's path.
TEST_CASE("llama: under bf16 / fp16 q, k, v, rope and attention are 16-bit; the o projection reads attention's output uncast") {
    for (ql_type ct : {QL_TYPE_BF16, QL_TYPE_F16})
        for (bool biases : {false, true}) {
            INFO("compute " << std::string(ql_type_name(ct)) << std::string(biases ? ", biases" : ""));
            tiny_llama t(tiny_hparams(40, 64, 96, 2, 4, 2), 7, 0.1f);
            ql_llama &m = t.m;
            ql_init_params ip = {8u << 20, nullptr, true, false};
            ql_context *ctx = ql_init(ip);
            if (biases)
                for (ql_llama_layer &L : m.layers) {
                    L.bq = ql_new_tensor_1d(ctx, QL_TYPE_F32, 64);
                    L.bk = ql_new_tensor_1d(ctx, QL_TYPE_F32, 32);
                    L.bv = ql_new_tensor_1d(ctx, QL_TYPE_F32, 32);
                }
            ql_lora_config lc;
            lc.r = 4, lc.alpha = 8, lc.targets = {"q", "k", "v", "o"};
            REQUIRE(ql_llama_add_lora(ctx, &m, lc, nullptr) == QL_OK);
            m.compute = ct;
            ql_tensor *tok = ql_new_tensor_2d(ctx, QL_TYPE_I32, 9, 1), *pos = ql_new_tensor_2d(ctx, QL_TYPE_I32, 9, 1);
            ql_tensor *out = ql_llama_forward(ctx, &m, tok, pos, nullptr);
            REQUIRE_MESSAGE(out, ql_ctx_error(ctx));
            ql_graph *g = ql_graph_new(ctx);
            REQUIRE(ql_graph_build_forward(g, out) == QL_OK);
            const ql_type want = biases ? QL_TYPE_F32 : ct;
            auto root = [](const ql_tensor *x) {  // through reshapes and permutes to what made the data
                while (x->view_src) x = x->view_src;
                return x;
            };
            int n_rope = 0, n_attn = 0, n_qkv = 0, n_o = 0;
            for (int i = 0; i < ql_graph_n_nodes(g); i++) {
                const ql_tensor *n = ql_graph_node(g, i);
                if (n->op == QL_OP_ROPE) {
                    n_rope++;
                    CHECK(n->type == want);
                    CHECK(root(n->src[0])->type == want);  // q or k as its linear (+ LoRA) made it
                }
                if (n->op == QL_OP_FLASH_ATTN) {
                    n_attn++;
                    CHECK(n->type == want);
                    for (int s = 0; s < 3; s++) CHECK(n->src[s]->type == want);
                    CHECK(root(n->src[0])->op == QL_OP_ROPE);
                    if (!biases) CHECK(root(n->src[2])->op == QL_OP_MUL_MAT);  // v: W x + B(A x), straight into attention
                }
                if (n->op != QL_OP_MUL_MAT) continue;
                for (const ql_llama_layer &L : m.layers) {
                    const ql_tensor *made[6] = {L.wq, L.wk, L.wv, m.lora.at(L.wq).b, m.lora.at(L.wk).b, m.lora.at(L.wv).b};
                    for (const ql_tensor *w : made)
                        if (n->src[0] == w) {
                            n_qkv++;
                            CHECK(n->type == want);
                        }
                    if (n->src[0] == L.wo || n->src[0] == m.lora.at(L.wo).a) {  // the o projection and its LoRA's A
                        n_o++;
                        CHECK(n->src[1]->type == ct);
                        if (!biases) CHECK(root(n->src[1])->op == QL_OP_FLASH_ATTN);  // no cast between
                    }
                }
            }
            CHECK(n_rope == 2 * 2);
            CHECK(n_attn == 2);
            CHECK(n_qkv == 2 * 6);
            CHECK(n_o == 2 * 2);
            ql_graph_free(g);
            ql_free(ctx);
        }
}

// The head and the loss fused (ql_llama_loss's grad): h's gradient made in forward is backward's
// (bit for bit: the same operations), one chunk's logits are alive at a time with its dlogits over
// them, and no chunk is recomputed.
TEST_CASE("llama: the fused loss gives the unfused gradient of h, one chunk's logits at a time, dlogits over them") {
    const int V = 1000, E = 32, N = 64;
    tiny_llama t(tiny_hparams(V, E, 64, 1), 3, 0.3f, /*tied_output=*/false);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(be);
    struct run_result {
        float loss = 0;
        std::vector<float> dh;
        size_t buffer = 0;
        int head_products = 0;
    };
    // scale: the loss scaled after the head (its gradient seed then reaches ql_with_grad as dy =
    // scale, not 1); block: the model's block between the input and the head (h's gradient is then
    // the input's), recompute: with every segment's results recomputed (QL_KEEP_NONE)
    auto run = [&](int64_t chunk, bool fused, ql_type compute, float scale = 1.0f, bool block = false, bool recompute = false) {
        run_result r;
        ql_init_params ip = {32u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_llama m = t.m;
        m.compute = compute;
        ql_tensor *h = ql_set_param(ql_new_tensor_2d(ctx, QL_TYPE_F32, E, N));
        ql_tensor *tg = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, N));
        ql_tensor *cnt = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
        std::mt19937 rng(5);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int i = 0; i < E * N; i++) ((float *)h->data)[i] = nd(rng);
        for (int i = 0; i < N; i++) ((int32_t *)tg->data)[i] = i % 7 == 3 ? -1 : (int32_t)((i * 37 + 11) % V);
        *(float *)cnt->data = 50.0f;
        ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, N, 1));
        for (int i = 0; i < N; i++) ((int32_t *)pos->data)[i] = i;
        ql_tensor *x = block ? ql_llama_hidden(ctx, &m, ql_reshape_3d(ctx, h, E, N, 1), pos, nullptr) : h;
        ql_tensor *loss = ql_llama_loss(ctx, &m, x, tg, cnt, chunk, fused);
        if (scale != 1.0f) loss = ql_scale(ctx, loss, scale);
        REQUIRE_MESSAGE(loss, ql_ctx_error(ctx));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        if (recompute) {
            const int n_seg = ql_graph_segments(gb, nullptr, 0);
            REQUIRE(n_seg > 0);
            std::vector<ql_keep> none((size_t)n_seg, QL_KEEP_NONE);
            REQUIRE(ql_graph_recompute(gb, none.data(), n_seg, nullptr) == QL_OK);
        } else if (!fused && chunk > 0) {
            REQUIRE(ql_graph_recompute(gb, nullptr, 0, nullptr) == QL_OK);
        }
        ql_plan_stats st{};
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, &st) == QL_OK, ql_ctx_error(ctx));
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);  // a reader of a dead (or overwritten) tensor reads NaN
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        r.loss = ql_get_f32_1d(loss, 0);
        r.dh.assign((const float *)h->grad->data, (const float *)h->grad->data + E * N);
        r.buffer = st.buffer_size - st.bytes[QL_MEM_WORK];  // (the matmul's packing buffers aside)
        for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
            const ql_tensor *n = ql_graph_node(gb, i);
            r.head_products += (n->op == QL_OP_MUL_MAT && (n->src[0] == m.output || n->src[0]->view_src == m.output)) ||
                               (n->op == QL_OP_MUL_MAT_ROWS && n->src[1]->view_src == m.output);
        }
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_free(ctx);
        return r;
    };
    for (ql_type ct : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16}) {
        CAPTURE(std::string(ql_type_name(ct)));
        for (int64_t chunk : {(int64_t)0, (int64_t)8, (int64_t)24}) {
            CAPTURE(chunk);
            const run_result old = run(chunk, false, ct), fused = run(chunk, true, ct);
            CHECK(fused.loss == old.loss);
            CHECK(fused.dh == old.dh);
            const int chunks = chunk > 0 ? (int)((N + chunk - 1) / chunk) : 1;
            CHECK(old.head_products == (chunk > 0 ? 3 : 2) * chunks);
            CHECK(fused.head_products == 2 * chunks);
            if (chunk == 8 && ct == QL_TYPE_F32) {
                // the buffer: one chunk's logits [V, 8] (32,000 bytes; its dlogits over them) and dh
                // [E, N] (8 KiB), a few small ones - never the whole logits (256,000 bytes)
                MESSAGE("fused, chunks of 8: buffer ", fused.buffer, " bytes (unfused ", old.buffer, ")");
                CHECK(fused.buffer <= (size_t)V * 8 * 4 + (size_t)E * N * 4 + 2048);  // (no [E, 8] product: straight into dh)
                CHECK(fused.buffer < old.buffer);
            }
            if (chunk == 0) continue;
            // a loss scaled after the head (dy 0.5 at ql_with_grad): exact powers of two, the same
            // bits - but in fp16, where the old path rounds dlogits dy / count and the fused one
            // dlogits / count, then scales dh: a scale against fp16's underflow belongs in count
            // (the trainer's loss scaling), as ql_with_grad says
            const run_result old_s = run(chunk, false, ct, 0.5f), fused_s = run(chunk, true, ct, 0.5f);
            CHECK(fused_s.loss == old_s.loss);
            if (ct != QL_TYPE_F16) CHECK(fused_s.dh == old_s.dh);
            else {
                double num = 0, den = 0;
                for (size_t i = 0; i < old_s.dh.size(); i++)
                    num += std::pow(fused_s.dh[i] - old_s.dh[i], 2), den += std::pow(old_s.dh[i], 2);
                CHECK(std::sqrt(num / den) < 1e-2);
            }
            CHECK(fused_s.dh != fused.dh);
            // recompute at its most (every segment keeps nothing): the gradient made in forward stays
            const run_result old_b = run(chunk, false, ct, 1.0f, true), fused_r = run(chunk, true, ct, 1.0f, true, true);
            CHECK(fused_r.loss == old_b.loss);
            CHECK(fused_r.dh == old_b.dh);
            CHECK(fused_r.head_products == 2 * chunks);
        }
    }
    ql_backend_free(be);
}

// Adapter dropout inside A's multiply (ql_llama.lora_dropout_fused: ql_mul_mat_dropout) against the
// dropped-out copies (ql_dropout_rows_to, then the multiply): the same loss and LoRA gradients bit
// for bit - every compute type, the FFN whole and in chunks (a chunk's mask offset), and with every
// segment recomputed (the masks drawn again) - and no copies: no dropout node in forward, and fewer
// bytes alive when backward starts. The copies made first (lora_copies_first, a device's order): the
// same loss, the gradients to rounding
TEST_CASE("llama: adapter dropout inside A's multiply gives the copies' loss and LoRA gradients bit for bit, and saves less") {
    const int V = 50, E = 64, N = 24;
    tiny_llama t(tiny_hparams(V, E, 96, 2, 4, 2), 11, 0.2f);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(be);
    struct result {
        float loss = 0;
        std::vector<std::vector<float>> grads;
        int n_dropout = 0, n_fused = 0, n_grouped = 0;
        size_t saved = 0;
    };
    auto run = [&](bool fused, ql_type ct, int64_t chunk, bool recompute, bool x16 = false, bool first = false) {
        result r;
        ql_init_params ip = {32u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_llama m = t.m;
        m.compute = ct;
        m.ffn_chunk = chunk;
        m.lora_dropout_fused = fused;
        m.lora_dropout_x16 = x16;
        m.lora_copies_first = first;
        ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
        ((int32_t *)seed->data)[0] = 2024;
        ql_lora_config lc;
        lc.r = 4, lc.alpha = 8, lc.dropout = 0.2f, lc.targets = {"q", "k", "v", "o", "gate", "up", "down"};
        REQUIRE(ql_llama_add_lora(ctx, &m, lc, seed) == QL_OK);
        const std::vector<ql_tensor *> params = ql_llama_lora_params(m);
        std::mt19937 rng(3);
        std::normal_distribution<float> nd(0.0f, 0.3f);
        for (ql_tensor *p : params)  // B too (0 as made): A's gradient then flows
            if (p->ne[1] != 4 || p->ne[0] == 4)
                for (int64_t i = 0; i < ql_nelements(p); i++) ((float *)p->data)[i] = nd(rng);
        ql_tensor *h = ql_set_input(ql_new_tensor_3d(ctx, QL_TYPE_F32, E, N, 1));
        for (int i = 0; i < E * N; i++) ((float *)h->data)[i] = nd(rng) * 3.0f;
        ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, N, 1));
        for (int i = 0; i < N; i++) ((int32_t *)pos->data)[i] = i;
        ql_tensor *tg = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, N));
        for (int i = 0; i < N; i++) ((int32_t *)tg->data)[i] = (i * 7 + 3) % V;
        ql_tensor *cnt = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
        *(float *)cnt->data = (float)N;
        ql_tensor *loss = ql_llama_loss(ctx, &m, ql_llama_hidden(ctx, &m, h, pos, nullptr), tg, cnt, 0, true);
        REQUIRE_MESSAGE(loss, ql_ctx_error(ctx));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        int prev = QL_OP_NONE;  // the last op before, no-op views skipped
        for (int i = 0; i < ql_graph_n_nodes(gf); i++) {
            const ql_tensor *node = ql_graph_node(gf, i);
            r.n_dropout += node->op == QL_OP_DROPOUT;
            r.n_fused += node->op == QL_OP_MUL_MAT_DROPOUT;
            // a copy right after the norm (its cast) or another copy: what a device makes in the norm's launch
            if (node->op == QL_OP_DROPOUT) r.n_grouped += prev == QL_OP_RMS_NORM || prev == QL_OP_CONT || prev == QL_OP_DROPOUT;
            if (node->op != QL_OP_RESHAPE && node->op != QL_OP_VIEW && node->op != QL_OP_PERMUTE && node->op != QL_OP_TRANSPOSE)
                prev = node->op;
        }
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        if (recompute) {
            const int n_seg = ql_graph_segments(gb, nullptr, 0);
            REQUIRE(n_seg > 0);
            std::vector<ql_keep> none((size_t)n_seg, QL_KEEP_NONE);
            REQUIRE(ql_graph_recompute(gb, none.data(), n_seg, nullptr) == QL_OK);
        }
        ql_plan_stats st{};
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, &st) == QL_OK, ql_ctx_error(ctx));
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        r.loss = ql_get_f32_1d(loss, 0);
        for (ql_tensor *p : params) r.grads.emplace_back((const float *)p->grad->data, (const float *)p->grad->data + ql_nelements(p));
        r.saved = st.bytes[QL_MEM_SAVED];
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_free(ctx);
        return r;
    };
    std::map<std::pair<int64_t, bool>, result> f32_copies;  // the f32 run, each 16-bit one's yardstick
    for (ql_type ct : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16})
        for (int64_t chunk : {(int64_t)0, (int64_t)10})
            for (bool recompute : {false, true}) {
                INFO(std::string(ql_type_name(ct)) << ", FFN chunk " << chunk << std::string(recompute ? ", every segment recomputed" : ""));
                const result copies = run(false, ct, chunk, recompute), fused = run(true, ct, chunk, recompute);
                CHECK(fused.loss == copies.loss);
                REQUIRE(fused.grads.size() == copies.grads.size());
                for (size_t i = 0; i < fused.grads.size(); i++) CHECK_MESSAGE(fused.grads[i] == copies.grads[i], "LoRA tensor " << i);
                const int per_layer = chunk ? 4 + 3 * 3 : 7;  // q k v o, then gate up down per chunk (24 rows: 3 chunks)
                CHECK(copies.n_dropout == 2 * per_layer);
                CHECK(fused.n_dropout == 0);
                CHECK(fused.n_fused == 2 * per_layer);
                if (!recompute) CHECK(fused.saved < copies.saved);
                // the copies of one normed input first (lora_copies_first, a device's: its norm kernel
                // writes them): the same masks and loss; the input's gradient summed in another order
                // (every base product's part first), so the gradients agree to rounding, not bit for bit
                const result first = run(false, ct, chunk, recompute, false, true);
                CHECK(first.loss == copies.loss);
                CHECK(first.n_dropout == copies.n_dropout);
                CHECK(first.n_grouped == 2 * (chunk ? 3 + 2 * 3 : 5));  // q k v, gate up (per chunk): all after their norm
                CHECK(copies.n_grouped == 2 * (chunk ? 1 + 3 : 2));     // only the first of each norm's
                for (size_t i = 0; i < first.grads.size(); i++) {
                    double num = 0, den = 0;
                    for (size_t j = 0; j < first.grads[i].size(); j++)
                        num = std::max(num, std::fabs((double)first.grads[i][j] - copies.grads[i][j])),
                        den = std::max(den, std::fabs((double)copies.grads[i][j]));
                    CHECK_MESSAGE(num <= 1e-5 * den, "LoRA tensor ", i, ": ", num, " of ", den);
                }
                if (ct == QL_TYPE_BF16 && !chunk && !recompute)
                    MESSAGE("saved activations: ", fused.saved, " bytes fused, ", copies.saved, " with the copies");
                // reading x's 16-bit cast (lora_dropout_x16): f32 x is that cast under f32 - the same
                // bits; under bf16 / fp16 a kept element is rounded twice: no farther from the f32 run
                // than the copies' run is (within 25%), and less is kept
                const result x16 = run(true, ct, chunk, recompute, true);
                auto dist = [](const result &u, const result &v) {  // relative L2 over every LoRA gradient
                    double num = 0, den = 0;
                    for (size_t i = 0; i < u.grads.size(); i++)
                        for (size_t j = 0; j < u.grads[i].size(); j++)
                            num += std::pow((double)u.grads[i][j] - v.grads[i][j], 2), den += std::pow((double)v.grads[i][j], 2);
                    return std::sqrt(num / den);
                };
                if (ct == QL_TYPE_F32) {
                    CHECK(x16.loss == copies.loss);
                    CHECK(dist(x16, copies) == 0);
                    f32_copies[{chunk, recompute}] = copies;
                } else {
                    const result &ref = f32_copies.at({chunk, recompute});
                    const double e16 = dist(x16, copies), ect = dist(copies, ref), e16ref = dist(x16, ref);
                    CHECK(std::fabs(x16.loss - ref.loss) <= 1.25 * std::fabs(copies.loss - ref.loss) + 1e-3f);
                    CHECK(e16ref < 1.25 * ect);
                    if (!recompute) CHECK(x16.saved < fused.saved);
                    if (!chunk && !recompute)
                        MESSAGE(std::string(ql_type_name(ct)), " x16: loss ", x16.loss, " (copies ", copies.loss, ", f32 ", ref.loss,
                                "), gradients ", e16, " from the copies', ", e16ref, " from f32's (the copies' ", ect, "); saved ",
                                x16.saved, " bytes");
                }
            }
    ql_backend_free(be);
}

// Issue 28 item 2: fewer element-wise nodes. LoRA's s A x is written in the compute type by A's
// product or its scale (ql_scale_to), and so is backward's s dy that A's multiply reads (by B's
// dx product, its alpha s): no cast reads a scale. Each norm multiplies its weight in (ql_rms_norm_mul),
// and its backward multiplies dy by it: no mul by a norm weight either way. Every compute type,
// the FFN whole and in chunks (a norm per chunk), adapter dropout in A's multiply or as copies
TEST_CASE("llama: LoRA's scale is written in the compute type (by A's product where dropout is not in it), norms multiply their weight in; forward and backward") {
    const int V = 50, E = 64, N = 24;
    tiny_llama t(tiny_hparams(V, E, 96, 2, 4, 2), 11, 0.2f);
    for (ql_type ct : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16})
        for (int64_t chunk : {(int64_t)0, (int64_t)10})
            for (int fused = 0; fused < 3; fused++) {  // 2: no adapter dropout - the norms written in the compute type
                INFO(std::string(ql_type_name(ct)) << ", FFN chunk " << chunk
                                                   << std::string(fused == 1 ? "" : fused == 0 ? ", dropout copies" : ", no dropout"));
                ql_init_params ip = {32u << 20, nullptr, true, false};
                ql_context *ctx = ql_init(ip);
                ql_llama m = t.m;
                m.compute = ct;
                m.ffn_chunk = chunk;
                m.lora_dropout_fused = fused == 1;
                ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
                ql_lora_config lc;
                lc.r = 4, lc.alpha = 8, lc.dropout = fused == 2 ? 0.0f : 0.2f, lc.targets = {"q", "k", "v", "o", "gate", "up", "down"};
                REQUIRE(ql_llama_add_lora(ctx, &m, lc, seed) == QL_OK);
                ql_tensor *h = ql_set_input(ql_new_tensor_3d(ctx, QL_TYPE_F32, E, N, 1));
                ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, N, 1));
                ql_tensor *tg = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, N));
                ql_tensor *cnt = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
                ql_tensor *loss = ql_llama_loss(ctx, &m, ql_llama_hidden(ctx, &m, h, pos, nullptr), tg, cnt, 0, true);
                REQUIRE_MESSAGE(loss, ql_ctx_error(ctx));
                ql_graph *gf = ql_graph_new(ctx);
                REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
                ql_graph *gb = ql_graph_backward(ctx, gf, loss);
                REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
                int n_scale[2] = {0, 0}, n_cast_of_scale = 0;  // scales in the compute type: forward, backward
                int n_scaled[2] = {0, 0};                      // products scaled as they write (alpha / r = 2)
                int n_norm[2] = {0, 0}, n_mul_by_norm_weight = 0;     // norms with their weight: forward, backward
                int n_norm16 = 0, n_cast_of_norm = 0;                 // norms written in the compute type; casts reading a norm
                auto norm_weight = [&m](const ql_tensor *w) {
                    if (w == m.out_norm) return true;
                    for (const ql_llama_layer &L : m.layers)
                        if (w == L.attn_norm || w == L.ffn_norm) return true;
                    return false;
                };
                for (int i = 0; i < ql_graph_n_nodes(gb); i++) {
                    const ql_tensor *n = ql_graph_node(gb, i);
                    const bool back = i >= ql_graph_n_nodes(gf);
                    if (n->op == QL_OP_MUL && (norm_weight(n->src[0]) || norm_weight(n->src[1]))) n_mul_by_norm_weight++;
                    if (n->op == QL_OP_RMS_NORM && !back && norm_weight(n->src[1])) n_norm[0]++;
                    if (n->op == QL_OP_RMS_NORM && !back && n->type == ct && ct != QL_TYPE_F32) n_norm16++;
                    if (n->op == QL_OP_CONT && n->src[0]->op == QL_OP_RMS_NORM) n_cast_of_norm++;
                    if (n->op == QL_OP_RMS_NORM_BACK && norm_weight(n->src[2])) n_norm[1]++;
                    const bool of_product = n->src[0] && (n->src[0]->op == QL_OP_MUL_MAT || n->src[0]->op == QL_OP_MUL_MAT_DROPOUT);
                    if (n->op == QL_OP_SCALE && n->type == ct && of_product) n_scale[i >= ql_graph_n_nodes(gf)]++;
                    if (n->op == QL_OP_MUL_MAT && n->type == ct && ql_mul_mat_alpha(n) == 2.0f) n_scaled[back]++;
                    if (n->op == QL_OP_CONT && n->src[0]->op == QL_OP_SCALE) n_cast_of_scale++;
                }
                const int per_layer = chunk ? 4 + 3 * 3 : 7;  // q k v o, then gate up down per chunk (24 rows: 3 chunks)
                CHECK(n_cast_of_scale == 0);
                // forward: the scale is A's product's own (ql_mul_mat_scaled_to), or with dropout in the
                // product one pass after it; backward: s dc for A's two products, made by B's dx product
                // (s Bᵀ dy, its alpha) in a 16-bit compute type; in f32 one scale after that product
                CHECK(n_scale[0] == (fused == 1 ? 2 * per_layer : 0));
                CHECK(n_scaled[0] == (fused == 1 ? 0 : 2 * per_layer));
                CHECK(n_scale[1] == (ct == QL_TYPE_F32 ? 2 * per_layer : 0));
                CHECK(n_scaled[1] == (ct == QL_TYPE_F32 ? 0 : 2 * per_layer));
                const int norms = chunk ? 1 + 3 : 2;  // per layer: attention's, the FFN's (per chunk)
                CHECK(n_mul_by_norm_weight == 0);
                CHECK(n_norm[0] == 2 * norms + 1);  // (+ the head's)
                CHECK(n_norm[1] == 2 * norms);      // (+ the head's, - block 0's first: no parameter's gradient needs its input's)
                // the blocks' norms: in the compute type where no dropout reads them in f32 (the head's stays f32:
                // the loss reads it), else f32 and one cast each
                const bool norm16 = fused == 2 && ct != QL_TYPE_F32;
                CHECK(n_norm16 == (norm16 ? 2 * norms : 0));
                CHECK(n_cast_of_norm == (ct == QL_TYPE_F32 || norm16 ? 0 : 2 * norms));
                ql_graph_free(gb);
                ql_graph_free(gf);
                ql_free(ctx);
            }
}

void ql_autodiff_fold_for_tests(bool on);  // qlora.cpp's autodiff: a gradient's 16-bit cast or sum folded into the node making it
void ql_autodiff_cast_grad_for_tests(bool on);  // ... a 16-bit copy's gradient summed into its f32 source's

// ... and autodiff's folded casts (s dy by ql_scale_to, SwiGLU's and rope's gradients and
// attention's dO written in the compute type, a cast reading what an f32 copy would have copied) and adds (a norm's dx summed onto its
// input's gradient by rms_norm_back) give the separate nodes' loss and LoRA gradients bit for bit,
// with fewer nodes: every
// compute type, the FFN whole and in chunks, fp16's guard (f32 gate and up), every segment recomputed
TEST_CASE("llama: autodiff's casts and adds folded into the nodes making the gradients give the separate nodes' bits") {
    const int V = 50, E = 64, N = 24;
    tiny_llama t(tiny_hparams(V, E, 96, 2, 4, 2), 11, 0.2f);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(be);
    struct result {
        float loss = 0;
        std::vector<std::vector<float>> grads;
        int nodes = 0;
    };
    auto run = [&](bool fold, ql_type ct, int64_t chunk, bool guard, bool recompute, bool cast_grad = true) {
        result r;
        ql_autodiff_fold_for_tests(fold);
        ql_autodiff_cast_grad_for_tests(cast_grad);
        ql_init_params ip = {32u << 20, nullptr, false, false};
        ql_context *ctx = ql_init(ip);
        ql_llama m = t.m;
        m.compute = ct;
        m.ffn_chunk = chunk;
        m.ffn_down_f32 = guard;
        m.lora_dropout_fused = false;  // (the device's default: dropped-out copies)
        ql_tensor *seed = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1));
        ((int32_t *)seed->data)[0] = 7;
        ql_lora_config lc;
        lc.r = 4, lc.alpha = 8, lc.dropout = 0.2f, lc.targets = {"q", "k", "v", "o", "gate", "up", "down"};
        REQUIRE(ql_llama_add_lora(ctx, &m, lc, seed) == QL_OK);
        const std::vector<ql_tensor *> params = ql_llama_lora_params(m);
        std::mt19937 rng(3);
        std::normal_distribution<float> nd(0.0f, 0.3f);
        for (ql_tensor *p : params)  // B too (0 as made): A's gradient then flows
            for (int64_t i = 0; i < ql_nelements(p); i++) ((float *)p->data)[i] = nd(rng);
        ql_tensor *h = ql_set_input(ql_new_tensor_3d(ctx, QL_TYPE_F32, E, N, 1));
        for (int i = 0; i < E * N; i++) ((float *)h->data)[i] = nd(rng) * 3.0f;
        ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, N, 1));
        for (int i = 0; i < N; i++) ((int32_t *)pos->data)[i] = i;
        ql_tensor *tg = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, N));
        for (int i = 0; i < N; i++) ((int32_t *)tg->data)[i] = (i * 7 + 3) % V;
        ql_tensor *cnt = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
        *(float *)cnt->data = (float)N;
        ql_tensor *loss = ql_llama_loss(ctx, &m, ql_llama_hidden(ctx, &m, h, pos, nullptr), tg, cnt, 0, true);
        REQUIRE_MESSAGE(loss, ql_ctx_error(ctx));
        ql_graph *gf = ql_graph_new(ctx);
        REQUIRE(ql_graph_build_forward(gf, loss) == QL_OK);
        ql_graph *gb = ql_graph_backward(ctx, gf, loss);
        ql_autodiff_fold_for_tests(true);
        ql_autodiff_cast_grad_for_tests(true);
        REQUIRE_MESSAGE(gb, ql_ctx_error(ctx));
        if (recompute) {
            const int n_seg = ql_graph_segments(gb, nullptr, 0);
            REQUIRE(n_seg > 0);
            std::vector<ql_keep> none((size_t)n_seg, QL_KEEP_NONE);
            REQUIRE(ql_graph_recompute(gb, none.data(), n_seg, nullptr) == QL_OK);
        }
        r.nodes = ql_graph_n_nodes(gb);
        REQUIRE_MESSAGE(ql_graph_plan(gb, be, nullptr) == QL_OK, ql_ctx_error(ctx));
        if (fold && ct != QL_TYPE_F32) {  // attention backward's f32 dq, dk, dv taken out (16-bit) before any product runs
            const ql_plan_entry *e = nullptr;
            int n_attn = 0;
            for (int i = 0, ne = ql_graph_plan_entries(gb, &e); i < ne; i++) {
                if (e[i].tensor->op != QL_OP_FLASH_ATTN_BACK) continue;
                n_attn++;
                for (int j = e[i].first + 1; j <= e[i].last; j++)
                    CHECK_MESSAGE(ql_graph_node(gb, j)->op != QL_OP_MUL_MAT, "attention backward's result alive at a product, node ", j);
            }
            CHECK(n_attn == 2);
        }
        REQUIRE(ql_graph_alloc(gb, be) == QL_OK);
        ql_graph_set_poison(gb, true);
        ql_graph_zero_grads(gb);
        REQUIRE_MESSAGE(ql_backend_graph_compute(be, gb) == QL_OK, ql_ctx_error(ctx));
        r.loss = ql_get_f32_1d(loss, 0);
        for (ql_tensor *p : params) r.grads.emplace_back((const float *)p->grad->data, (const float *)p->grad->data + ql_nelements(p));
        ql_graph_free(gb);
        ql_graph_free(gf);
        ql_free(ctx);
        return r;
    };
    for (ql_type ct : {QL_TYPE_F32, QL_TYPE_BF16, QL_TYPE_F16})
        for (int64_t chunk : {(int64_t)0, (int64_t)10})
            for (bool guard : {false, true})
                for (bool recompute : {false, true}) {
                    if (guard && ct == QL_TYPE_F32) continue;
                    INFO(std::string(ql_type_name(ct)) << ", FFN chunk " << chunk << std::string(guard ? ", f32 FFN past gate and up" : "")
                                                       << std::string(recompute ? ", every segment recomputed" : ""));
                    const result apart = run(false, ct, chunk, guard, recompute), folded = run(true, ct, chunk, guard, recompute);
                    CHECK(folded.loss == apart.loss);
                    REQUIRE(folded.grads.size() == apart.grads.size());
                    for (size_t i = 0; i < folded.grads.size(); i++) CHECK_MESSAGE(folded.grads[i] == apart.grads[i], "LoRA tensor " << i);
                    // the casts folded, per layer: each adapted linear's scaled dy, two nodes (the f32 product
                    // Bᵀ dy and its scale: one product with the scale as alpha, writing 16 bits; the guard's
                    // down projection and its LoRA are f32: none), SwiGLU's 2 gradients (per FFN chunk: 24
                    // rows, 3 chunks), v's f32 copy (its gradient out of attention's, permuted back and made
                    // contiguous), q's and k's rope_back, and attention's dO (the o projection's input's
                    // dx, its LoRA's dropped-out product onto Wᵀ dy, written in 16 bits)
                    const int swiglu = chunk ? 3 : 1, per_layer = 2 * (4 + 2 * swiglu + (guard ? 0 : swiglu)) + 2 * swiglu + 1 + 2 + 1;
                    // and the adds of a norm's dx onto its input's gradient: both norms of both layers but block
                    // 0's first (no gradient of its input is needed); the FFN in chunks: its norms read views of
                    // rows (whose gradients add_rows sums), so only block 1's attention norm
                    const int adds = chunk ? 1 : 2 * 2 - 1;
                    CHECK(apart.nodes - folded.nodes == (ct == QL_TYPE_F32 ? 0 : 2 * per_layer) + adds);
                }
    // the normed input's 16-bit copy (q, k and v multiply it; their adapters' dropout reads the f32
    // input) sums its gradient into the f32 input's: the same gradients to f32's rounding (summed
    // in another order), one add fewer per norm whose result has a gradient - every one but block
    // 0's attention norm (nothing trainable before it), the FFN's once per chunk (24 rows, 3 chunks)
    for (ql_type ct : {QL_TYPE_BF16, QL_TYPE_F16})
        for (int64_t chunk : {(int64_t)0, (int64_t)10}) {
            INFO(std::string(ql_type_name(ct)) << ", FFN chunk " << chunk);
            const result into = run(true, ct, chunk, false, false), apart = run(true, ct, chunk, false, false, false);
            CHECK(into.loss == apart.loss);
            REQUIRE(into.grads.size() == apart.grads.size());
            for (size_t i = 0; i < into.grads.size(); i++) {
                double mx = 0, err = 0;
                for (size_t j = 0; j < into.grads[i].size(); j++)
                    mx = std::max(mx, (double)std::fabs(apart.grads[i][j])), err = std::max(err, (double)std::fabs(into.grads[i][j] - apart.grads[i][j]));
                CHECK_MESSAGE(err <= 1e-5 * mx, "LoRA tensor " << i << ": " << err << " of " << mx);
            }
            CHECK(apart.nodes - into.nodes == (2 - 1) + 2 * (chunk ? 3 : 1));
        }
    ql_backend_free(be);
}
