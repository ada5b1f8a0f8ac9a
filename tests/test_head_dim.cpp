// A head size that is not n_embd / n_head (Mistral-Nemo: 32 heads of 128 over 5120; Qwen3's
// shapes): q is [n_embd, n_head * head_dim], attn_output [n_head * head_dim, n_embd]. The forward
// against a float64 reference written out here, the KV cache, GGUF's attention.key_length and
// value_length, LoRA training and its files, make-model --head-dim, generate, convert hf.
#include "../models/adapter.h"
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../models/trainer.h"
#include "../qlora.h"
#include "tiny.h"
#include "util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

// dim 64, 4 query heads over 2 kv heads, heads of 32: q [64, 128], k/v [64, 64], o [128, 64]
ql_llama_hparams hd_hparams(int n_vocab = 61) {
    ql_llama_hparams hp = tiny_hparams(n_vocab, 64, 96, 2, 4, 2);
    hp.n_embd_head = 32;
    return hp;
}

// ---- a float64 reference: the llama forward as loops over the weights (GGUF layout: W [in, out],
// row o at o * in), Meta's rope order (pairs 2i, 2i+1), GQA, causal softmax, SwiGLU ----

const float *fp(const ql_tensor *t) { return (const float *)t->data; }

std::vector<double> matvec(const ql_tensor *w, const std::vector<double> &x) {
    const int64_t in = w->ne[0], out = w->ne[1];
    REQUIRE((int64_t)x.size() == in);
    std::vector<double> y((size_t)out, 0.0);
    for (int64_t o = 0; o < out; o++)
        for (int64_t i = 0; i < in; i++) y[(size_t)o] += (double)fp(w)[o * in + i] * x[(size_t)i];
    return y;
}

std::vector<double> rmsnorm(const std::vector<double> &x, const ql_tensor *g, double eps) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / (double)x.size() + eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); i++) y[i] = x[i] * r * (double)fp(g)[i];
    return y;
}

void rope(std::vector<double> &x, int heads, int D, int n_rot, double base, int pos) {
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < n_rot / 2; i++) {
            const double th = pos * std::pow(base, -2.0 * i / n_rot);
            double &a = x[(size_t)(h * D + 2 * i)], &b = x[(size_t)(h * D + 2 * i + 1)];
            const double a0 = a, b0 = b;
            a = a0 * std::cos(th) - b0 * std::sin(th);
            b = a0 * std::sin(th) + b0 * std::cos(th);
        }
}

// logits [T, V] row-major
std::vector<float> ref_logits(const ql_llama &m, const std::vector<int32_t> &toks) {
    const ql_llama_hparams &hp = m.hp;
    REQUIRE(hp.rope_mode == QL_ROPE_NORMAL);
    const int T = (int)toks.size(), E = hp.n_embd, H = hp.n_head, Hkv = hp.n_head_kv, D = hp.n_embd_head;
    const int n_rot = hp.n_rot > 0 ? hp.n_rot : D;
    std::vector<std::vector<double>> x((size_t)T, std::vector<double>((size_t)E));
    for (int t = 0; t < T; t++)
        for (int i = 0; i < E; i++) x[(size_t)t][(size_t)i] = fp(m.tok_embd)[(int64_t)toks[(size_t)t] * E + i];
    for (const ql_llama_layer &L : m.layers) {
        std::vector<std::vector<double>> q, k, v;
        for (int t = 0; t < T; t++) {
            const std::vector<double> h = rmsnorm(x[(size_t)t], L.attn_norm, hp.norm_eps);
            q.push_back(matvec(L.wq, h));
            k.push_back(matvec(L.wk, h));
            v.push_back(matvec(L.wv, h));
            REQUIRE(q.back().size() == (size_t)(H * D));  // n_head * head_dim, not n_embd
            rope(q.back(), H, D, n_rot, hp.rope_base, t);
            rope(k.back(), Hkv, D, n_rot, hp.rope_base, t);
        }
        for (int t = 0; t < T; t++) {
            std::vector<double> a((size_t)(H * D), 0.0);
            for (int hh = 0; hh < H; hh++) {
                const int kv = hh / (H / Hkv);
                std::vector<double> s((size_t)t + 1);
                double mx = -1e300, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double d = 0;
                    for (int c = 0; c < D; c++) d += q[(size_t)t][(size_t)(hh * D + c)] * k[(size_t)j][(size_t)(kv * D + c)];
                    s[(size_t)j] = d / std::sqrt((double)D);
                    mx = std::max(mx, s[(size_t)j]);
                }
                for (double &e : s) sum += (e = std::exp(e - mx));
                for (int j = 0; j <= t; j++)
                    for (int c = 0; c < D; c++) a[(size_t)(hh * D + c)] += s[(size_t)j] / sum * v[(size_t)j][(size_t)(kv * D + c)];
            }
            const std::vector<double> o = matvec(L.wo, a);
            for (int i = 0; i < E; i++) x[(size_t)t][(size_t)i] += o[(size_t)i];
            const std::vector<double> h = rmsnorm(x[(size_t)t], L.ffn_norm, hp.norm_eps);
            const std::vector<double> g = matvec(L.w_gate, h), u = matvec(L.w_up, h);
            std::vector<double> f(g.size());
            for (size_t i = 0; i < g.size(); i++) f[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
            const std::vector<double> dn = matvec(L.w_down, f);
            for (int i = 0; i < E; i++) x[(size_t)t][(size_t)i] += dn[(size_t)i];
        }
    }
    std::vector<float> out;
    for (int t = 0; t < T; t++)
        for (double l : matvec(m.output, rmsnorm(x[(size_t)t], m.out_norm, hp.norm_eps))) out.push_back((float)l);
    return out;
}

// the model as a GGUF with the head size keys (write_llama_gguf writes the shape keys only)
void write_hd_gguf(const ql_llama &m, const std::string &path, int key_length, int value_length) {
    const std::string plain = path + ".plain";
    write_llama_gguf(m, plain);
    rewrite_gguf(plain, path, [&](ql_gguf_writer *w) {
        if (key_length >= 0) ql_gguf_set_u32(w, "llama.attention.key_length", (uint32_t)key_length);
        if (value_length >= 0) ql_gguf_set_u32(w, "llama.attention.value_length", (uint32_t)value_length);
    });
    remove(plain.c_str());
}

// Hugging Face's q/k row order from GGUF's (the inverse of convert's permute): HF row
// h*hd + s*hd/2 + j holds GGUF row h*hd + 2j + s
std::vector<float> to_hf_rows(const ql_tensor *w, int heads) {
    const int64_t in = w->ne[0], rows = w->ne[1], hd = rows / heads;
    std::vector<float> out((size_t)(in * rows));
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < hd / 2; j++)
            for (int64_t s = 0; s < 2; s++)
                memcpy(&out[(size_t)((h * hd + s * hd / 2 + j) * in)], fp(w) + (h * hd + 2 * j + s) * in, (size_t)in * 4);
    return out;
}

std::vector<ql_sequence> sequences(int n, int T, int V) {
    std::vector<ql_sequence> out;
    for (int d = 0; d < n; d++) {
        ql_sequence s;
        int tok = (1 + 7 * d) % V;
        for (int i = 0; i < T; i++) {
            const int next = (3 * tok + 1) % V;  // a rule the adapter can learn
            s.tokens.push_back(tok);
            s.pos.push_back(i);
            s.seg.push_back(0);
            s.targets.push_back(i + 1 < T ? next : -1);
            s.n_targets += i + 1 < T;
            tok = next;
        }
        s.len = T;
        out.push_back(s);
    }
    return out;
}

}  // namespace

TEST_CASE("head_dim: heads of 32 over dim 64 (q 128 x 64) match the float64 reference; the KV cache agrees") {
    tiny_llama t(hd_hparams(), 5, 0.15f);
    const ql_llama_layer &L = t.m.layers[0];
    CHECK(L.wq->ne[0] == 64);
    CHECK(L.wq->ne[1] == 128);
    CHECK(L.wk->ne[1] == 64);  // 2 kv heads of 32
    CHECK(L.wo->ne[0] == 128);
    CHECK(L.wo->ne[1] == 64);
    const std::vector<int32_t> toks = {3, 17, 42, 8, 8, 59, 0, 23, 11};
    const std::vector<float> got = logits_of(t.m, toks), want = ref_logits(t.m, toks);
    const double e = rel_err(got, want);
    MESSAGE("head_dim 32 over dim 64: max |logit - ref| / max |ref| = ", e);
    CHECK(e < 1e-5);

    // the cache holds heads of 32: the prompt, then one token at a time, as the full forward
    const int V = t.m.hp.n_vocab, n_prompt = 4;
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_llama_cache cache;
    REQUIRE(ql_llama_cache_create(ctx, &t.m, 16, &cache) == QL_OK);
    CHECK(cache.k[0]->ne[0] == 32);
    ql_tensor *pt = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1), *pp = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1);
    ql_tensor *ot = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1), *op = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1);
    ql_tensor *lp = ql_set_output(ql_llama_forward_cached(ctx, &t.m, &cache, pt, pp));
    ql_tensor *lo = ql_set_output(ql_llama_forward_cached(ctx, &t.m, &cache, ot, op));
    REQUIRE_MESSAGE(lo, ql_ctx_error(ctx));
    ql_graph *gp = ql_graph_new(ctx), *go = ql_graph_new(ctx);
    ql_graph_build_forward(gp, lp);
    ql_graph_build_forward(go, lo);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(ql_graph_alloc(gp, be) == QL_OK);
    REQUIRE(ql_graph_alloc(go, be) == QL_OK);
    for (int i = 0; i < n_prompt; i++) {
        ((int32_t *)pt->data)[i] = toks[(size_t)i];
        ((int32_t *)pp->data)[i] = i;
    }
    *(int32_t *)cache.write_pos->data = 0;
    *(int32_t *)cache.n_kv->data = n_prompt;
    REQUIRE(ql_backend_graph_compute(be, gp) == QL_OK);
    std::vector<float> cached((const float *)lp->data, (const float *)lp->data + n_prompt * V);
    for (int i = n_prompt; i < (int)toks.size(); i++) {
        *(int32_t *)ot->data = toks[(size_t)i];
        *(int32_t *)op->data = i;
        *(int32_t *)cache.write_pos->data = i;
        *(int32_t *)cache.n_kv->data = i + 1;
        REQUIRE(ql_backend_graph_compute(be, go) == QL_OK);
        cached.insert(cached.end(), (const float *)lo->data, (const float *)lo->data + V);
    }
    CHECK(rel_err(cached, got) < 1e-5);
    ql_graph_free(gp);
    ql_graph_free(go);
    ql_backend_free(be);
    ql_free(ctx);

    // sizes a head cannot have are refused when the model is made
    ql_init_params sp = {1u << 20, nullptr, true, false};
    ql_context *sc = ql_init(sp);
    ql_llama bad;
    ql_llama_hparams hp = hd_hparams();
    hp.n_embd_head = 600;
    CHECK(ql_llama_create(sc, &bad, hp, QL_TYPE_F32, false) == QL_ERR_INVALID);
    CHECK_MESSAGE(has(ql_ctx_error(sc), "head dimension must be from 1 to 512"), ql_ctx_error(sc));
    ql_free(sc);
}

TEST_CASE("head_dim: GGUF keeps attention.key_length; value_length other than key_length is refused by name") {
    tiny_llama t(hd_hparams(), 7, 0.15f);
    tmpdir d;
    char err[400];
    const std::string path = d.file("hd.gguf");
    write_hd_gguf(t.m, path, 32, 32);
    ql_llama_file *f = ql_llama_load(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    CHECK(f->model.hp.n_embd_head == 32);
    CHECK(f->model.hp.head_dim() == 32);
    CHECK(f->model.hp.n_rot == 32);  // the whole head rotates unless rope.dimension_count says otherwise
    CHECK(f->model.layers[1].wq->ne[1] == 128);
    const std::vector<int32_t> toks = {1, 2, 3, 50, 4};
    CHECK(rel_err(logits_of(f->model, toks), logits_of(t.m, toks)) == 0.0);
    ql_llama_file_free(f);
    {  // key_length alone: value_length is taken to be the same
        const std::string p2 = d.file("hd2.gguf");
        write_hd_gguf(t.m, p2, 32, -1);
        ql_llama_file *f2 = ql_llama_load(p2.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(f2, err);
        CHECK(f2->model.hp.head_dim() == 32);
        ql_llama_file_free(f2);
    }
    // without the keys the head is 64 / 4 = 16 and q's 128 rows do not fit
    const std::string nokey = d.file("nokey.gguf");
    write_llama_gguf(t.m, nokey);
    CHECK(ql_llama_load(nokey.c_str(), err, sizeof(err)) == nullptr);
    CHECK_MESSAGE(has(err, "tensor blk.0.attn_q.weight has shape [64, 128, 1, 1], expected [64, 64]"), err);
    struct bad_case {
        int kl, vl;
        const char *says;
    };
    const bad_case cases[] = {
        {32, 16, "llama.attention.value_length 16 differs from llama.attention.key_length 32: keys and values of different head sizes are not supported"},
        {-1, 32, "llama.attention.value_length 32 differs from llama.attention.key_length 16"},
        {33, 33, "llama.attention.key_length 33: an even head size from 2 to 512 expected"},
        {0, 0, "llama.attention.key_length 0: an even head size"},
        {1024, 1024, "llama.attention.key_length 1024: an even head size from 2 to 512 expected"},
    };
    for (const bad_case &c : cases) {
        CAPTURE(c.says);
        const std::string p = d.file("bad.gguf");
        write_hd_gguf(t.m, p, c.kl, c.vl);
        CHECK(ql_llama_load(p.c_str(), err, sizeof(err)) == nullptr);
        CHECK_MESSAGE(has(err, c.says), err);
        CHECK(has(err, "bad.gguf"));
    }
}

TEST_CASE("head_dim: LoRA on q/k/v/o trains (gradients as finite differences, the loss falls); PEFT and GGUF adapters round-trip") {
    tiny_llama base(hd_hparams(), 11, 0.2f, /*tied_output=*/true);
    tmpdir d;
    const std::string path = d.file("hd.gguf");
    write_hd_gguf(base.m, path, 32, 32);
    char cerr[300];
    ql_llama_file *f = ql_llama_load(path.c_str(), cerr, sizeof(cerr));
    REQUIRE_MESSAGE(f, cerr);
    ql_train_options o;
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.0f;
    o.lora.targets = {"q", "k", "v", "o"};
    o.micro_batch = 2;
    o.grad_accum = 1;
    o.lr = 0;  // first: gradients only
    o.scheduler = ql_schedule::constant;
    o.max_grad_norm = 0;
    o.threads = 2;
    const std::vector<ql_sequence> seqs = sequences(2, 16, 61);
    std::string err;
    ql_trainer *t = ql_trainer_new(f, seqs, seqs, o, &err);
    REQUIRE_MESSAGE(t, err);
    std::vector<ql_tensor *> params = ql_llama_lora_params(ql_trainer_model(t));
    REQUIRE(params.size() == 16);  // 2 layers x (q, k, v, o) x (A, B)
    CHECK(params[1]->ne[1] == 128);  // q's B: [r, n_head * head_dim]
    CHECK(params[6]->ne[0] == 128);  // o's A: [n_head * head_dim, r]
    for (ql_tensor *p : params)  // a random adapter (B = 0 makes A's gradient vanish)
        for (int64_t i = 0; i < ql_nelements(p); i++) ((float *)p->data)[i] = 0.05f * (float)std::sin(1.3 * (double)i + 0.7 * (double)p->ne[1]);
    ql_step_metrics sm;
    REQUIRE_MESSAGE(ql_trainer_step(t, &sm, &err), err);
    double worst = 0;
    for (ql_tensor *p : {params[0], params[1], params[6], params[7]}) {  // q's and o's A and B
        const std::vector<float> g((const float *)p->grad->data, (const float *)p->grad->data + ql_nelements(p));
        double e_max = 0, fd_max = 0;
        for (int k = 0; k < 6; k++) {
            const int64_t i = (k * 89 + 5) % ql_nelements(p);
            float *x = (float *)p->data + i;
            const float keep = *x, h = 3e-3f;
            double lp = 0, lm = 0;
            *x = keep + h;
            REQUIRE(ql_trainer_eval(t, &lp, &err));
            *x = keep - h;
            REQUIRE(ql_trainer_eval(t, &lm, &err));
            *x = keep;
            const double fd = (lp - lm) / (2.0 * h);
            e_max = std::max(e_max, std::fabs(fd - g[(size_t)i]));
            fd_max = std::max(fd_max, std::fabs(fd));
        }
        worst = std::max(worst, e_max / fd_max);
    }
    MESSAGE("head_dim LoRA gradient vs central differences: worst normalised error ", worst);
    CHECK(worst < 1e-2);
    ql_trainer_free(t);

    // training from the usual start (B = 0): the loss falls
    o.lr = 1e-2f;
    t = ql_trainer_new(f, seqs, seqs, o, &err);
    REQUIRE_MESSAGE(t, err);
    double first = 0, last = 0;
    for (int s = 0; s < 30; s++) {
        REQUIRE_MESSAGE(ql_trainer_step(t, &sm, &err), err);
        (s == 0 ? first : last) = sm.loss;
    }
    MESSAGE("head_dim LoRA: loss ", first, " -> ", last, " in 30 steps");
    CHECK(last < 0.8 * first);

    // the trained adapter through PEFT's folder and llama.cpp's GGUF onto a fresh load: the same logits
    ql_lora_config c;
    c.r = 4;
    c.alpha = 8;
    c.dropout = 0;
    const std::vector<int32_t> toks = {4, 13, 40, 2, 9};
    const std::vector<float> trained = logits_of(ql_trainer_model(t), toks);
    REQUIRE_MESSAGE(ql_peft_save(d.file("peft").c_str(), ql_trainer_model(t), "llama", c, &err), err);
    REQUIRE_MESSAGE(ql_lora_save_gguf(d.file("lora.gguf").c_str(), ql_trainer_model(t), "llama", c, &err), err);
    for (const char *which : {"peft", "lora.gguf"}) {
        CAPTURE(which);
        ql_llama_file *g = ql_llama_load(path.c_str(), cerr, sizeof(cerr));
        REQUIRE_MESSAGE(g, cerr);
        ql_lora_adapter *ad = ql_lora_attach_any(&g->model, "llama", d.file(which).c_str(), 1.0f, &err);
        REQUIRE_MESSAGE(ad, err);
        CHECK(rel_err(logits_of(g->model, toks), trained) < 1e-6);
        ql_lora_adapter_free(ad);
        ql_llama_file_free(g);
    }
    // merged (f16 where merged): the base's keys carried over, so it loads with its heads of 32
    REQUIRE_MESSAGE(ql_llama_save_merged(d.file("merged.gguf").c_str(), *f, ql_trainer_model(t), &err), err);
    ql_llama_file *mg = ql_llama_load(d.file("merged.gguf").c_str(), cerr, sizeof(cerr));
    REQUIRE_MESSAGE(mg, cerr);
    CHECK(mg->model.hp.head_dim() == 32);
    CHECK(rel_err(logits_of(mg->model, toks), trained) < 1e-2);  // (f16 rounding of the merged weights)
    ql_llama_file_free(mg);
    ql_trainer_free(t);
    ql_llama_file_free(f);
}

TEST_CASE("head_dim: make-model --head-dim writes the keys; generate runs on it, greedy as the full forward" * needs_tools("make-model generate")) {
    tmpdir d;
    const std::string m = d.file("m.gguf");
    std::string log;
    REQUIRE_MESSAGE(run("./make-model -o " + m + " --dim 64 --heads 4 --kv-heads 2 --head-dim 32 --layers 2 --ff 96 --vocab 400 "
                        "--std 0.1",
                        &log) == 0,
                    log);
    CHECK_MESSAGE(has(log, "4/2 heads of 32"), log);
    char err[300];
    ql_llama_file *f = ql_llama_load(m.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(f, err);
    CHECK(f->model.hp.n_embd_head == 32);
    CHECK(f->model.layers[0].wq->ne[1] == 128);
    CHECK(f->model.layers[0].wo->ne[0] == 128);
    // greedy by hand over the full forward, then generate's text holds the same continuation
    ql_vocab *v = ql_vocab_load(f->gguf, err, sizeof(err));
    REQUIRE_MESSAGE(v, err);
    std::vector<int32_t> ids = ql_tokenize(v, "hello", true, false);
    const size_t n_prompt = ids.size();
    for (int s = 0; s < 6; s++) {
        const std::vector<float> lg = logits_of(f->model, ids);
        const float *last = lg.data() + (ids.size() - 1) * (size_t)f->model.hp.n_vocab;
        ids.push_back((int32_t)(std::max_element(last, last + f->model.hp.n_vocab) - last));
    }
    const std::string want = ql_detokenize(v, std::vector<int32_t>(ids.begin() + (long)n_prompt, ids.end()), false);
    ql_vocab_free(v);
    ql_llama_file_free(f);
    REQUIRE_MESSAGE(run("./generate -m " + m + " -p hello -n 6 --temp 0", &log) == 0, log);
    CHECK_MESSAGE(has(log, "hello" + want), "greedy continuation '", want, "' in: ", log);
    // a head size it cannot have is a bad argument
    CHECK(run("./make-model -o " + d.file("x.gguf") + " --head-dim 513", &log) == 2);
    CHECK_MESSAGE(has(log, "--head-dim: '513' is not an integer in [2, 512]"), log);
}

TEST_CASE("head_dim: convert hf reads config.json's head_dim (Mistral-Nemo's shape) and writes key_length" * needs_tools("convert")) {
    tiny_llama t(hd_hparams(270), 13, 0.15f);
    tmpdir d;
    const std::string hf = d.file("hf");
    REQUIRE(mkdir(hf.c_str(), 0755) == 0);
    for (const char *fn : {"tokenizer.json", "tokenizer_config.json"})
        write_file(hf + "/" + fn, read_file(tests_dir() + "golden/hf/mistral/" + fn));
    // the weights as save_pretrained writes them: PyTorch [out, in], q/k rows in rotate-half order
    std::vector<std::vector<float>> keep;
    std::vector<ql_st_tensor> st;
    auto add = [&](const std::string &name, const ql_tensor *w, int heads) {
        keep.push_back(heads ? to_hf_rows(w, heads) : std::vector<float>(fp(w), fp(w) + ql_nelements(w)));
        ql_st_tensor x;
        x.name = name;
        x.dtype = "F32";
        x.shape = ql_n_dims(w) == 1 ? std::vector<int64_t>{w->ne[0]} : std::vector<int64_t>{w->ne[1], w->ne[0]};
        st.push_back(x);
    };
    add("model.embed_tokens.weight", t.m.tok_embd, 0);
    add("model.norm.weight", t.m.out_norm, 0);
    add("lm_head.weight", t.m.output, 0);
    for (int il = 0; il < 2; il++) {
        const ql_llama_layer &L = t.m.layers[(size_t)il];
        const std::string p = "model.layers." + std::to_string(il) + ".";
        add(p + "input_layernorm.weight", L.attn_norm, 0);
        add(p + "post_attention_layernorm.weight", L.ffn_norm, 0);
        add(p + "self_attn.q_proj.weight", L.wq, 4);
        add(p + "self_attn.k_proj.weight", L.wk, 2);
        add(p + "self_attn.v_proj.weight", L.wv, 0);
        add(p + "self_attn.o_proj.weight", L.wo, 0);
        add(p + "mlp.gate_proj.weight", L.w_gate, 0);
        add(p + "mlp.up_proj.weight", L.w_up, 0);
        add(p + "mlp.down_proj.weight", L.w_down, 0);
    }
    for (size_t i = 0; i < st.size(); i++) st[i].data = keep[i].data();
    std::string err;
    REQUIRE_MESSAGE(ql_safetensors_write((hf + "/model.safetensors").c_str(), st, {}, &err), err);
    const std::string cfg = "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 96, "
                            "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 270, "
                            "\"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, \"bos_token_id\": 262, \"eos_token_id\": 263";
    write_file(hf + "/config.json", cfg + ", \"head_dim\": 32}");
    const std::string out = d.file("hd.gguf");
    std::string log;
    REQUIRE_MESSAGE(run("./convert hf " + hf + " -o " + out, &log) == 0, log);
    char cerr[300];
    ql_llama_file *f = ql_llama_load(out.c_str(), cerr, sizeof(cerr));
    REQUIRE_MESSAGE(f, cerr);
    CHECK(f->model.hp.n_embd_head == 32);
    uint64_t kl = 0, vl = 0;
    const int64_t ik = ql_gguf_find_kv(f->gguf, "llama.attention.key_length"), iv = ql_gguf_find_kv(f->gguf, "llama.attention.value_length");
    REQUIRE(ik >= 0);
    REQUIRE(iv >= 0);
    CHECK((ql_gguf_get_u64(f->gguf, ik, &kl) && kl == 32));
    CHECK((ql_gguf_get_u64(f->gguf, iv, &vl) && vl == 32));
    // the converted model is the one its weights came from (q/k rows permuted back by heads of 32)
    const std::vector<int32_t> toks = {262, 5, 77, 190, 33, 33, 8};
    CHECK(rel_err(logits_of(f->model, toks), logits_of(t.m, toks)) == 0.0);
    ql_llama_file_free(f);

    // without head_dim the head is 64 / 4 = 16: q_proj's shape says so; an odd head_dim is refused by name
    write_file(hf + "/config.json", cfg + "}");
    CHECK(run("./convert hf " + hf + " -o " + d.file("x.gguf"), &log) == 1);
    CHECK_MESSAGE(has(log, "model.layers.0.self_attn.q_proj.weight is [128, 64], config.json makes it [64, 64]"), log);
    write_file(hf + "/config.json", cfg + ", \"head_dim\": 33}");
    CHECK(run("./convert hf " + hf + " -o " + d.file("x.gguf"), &log) == 1);
    CHECK_MESSAGE(has(log, "config.json: head_dim is 33 (an even size up to 512)"), log);
    CHECK_FALSE(exists(d.file("x.gguf")));
}
