// tools/generate - continue a prompt with a GGUF model, streaming the text.
//
//   ./generate -m model.gguf [-p "prompt"] [-n 128] [--temp 0.8] [--top-k 40] [--top-p 0.95]
//              [--seed 1] [--lora adapter.gguf [--lora-scale 1]] [-c context] [-t threads]
//              [--device cpu|cuda|cuda:N|auto] [--exact] [--profile] [--cache-type f32|f16]
//
// Generation stops at an end-of-generation token (ql_vocab_is_eog: eos, eot, eom and the texts
// llama.cpp treats as such, e.g. <|eot_id|> and <|end_of_text|>), after -n tokens, or at the
// context's end; one line on stderr says which. The text on stdout ends with a newline.
// --temp 0 is greedy. An empty prompt starts from BOS alone. Two graphs are planned before the
// first token - the prompt and one new token - over one KV cache; every step then only sets
// inputs (token, position, cache row) and runs, allocating nothing. On a GPU the weights are
// placed on it once; inputs go in and logits come back through the backend's set/get. The
// quantised weights' multiplies take 8-bit activations (integer dot products, as llama.cpp; the
// bound is in README's generate section); --exact keeps them f32, the exact dequantised path.
// --cache-type f16 keeps the KV cache in f16 (half its memory and of the bytes a long context's
// token reads; keys and values rounded as stored); f32 by default. On a GPU one line says what the
// cache and the whole run hold there.
#include "../models/adapter.h"
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "own.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s -m model.gguf [-p PROMPT] [-n N] [--temp T] [--top-k K] [--top-p P] [--seed S]\n"
            "       [--lora adapter.gguf|peft-dir] [--lora-scale S] [-c CONTEXT] [-t THREADS]\n"
            "       [--device cpu|cuda|cuda:N|auto]   (auto: cuda when built with it and a GPU is present)\n"
            "       [--exact]   (f32 activations in the quantised weights' multiplies, not 8-bit)\n"
            "       [--profile] (the prompt's and a decoded token's time by op, at the end; each node waited for)\n"
            "       [--cache-type f32|f16]   (the KV cache's type; default f32)\n",
            argv0);
    return 2;
}

// (an empty value is no number: strtod reads nothing and would give 0)
static bool parse_num(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end = nullptr;
    const double v = strtod(s, &end);
    if (!end || end == s || *end || !std::isfinite(v) || v < lo || v > hi) {
        fprintf(stderr, "generate: %s: '%s' is not a number in [%g, %g]\n", flag, s, lo, hi);
        return false;
    }
    *out = v;
    return true;
}
// a count, a seed, a thread number: 1.5 is refused, not truncated
static bool parse_whole(const char *flag, const char *s, double lo, double hi, double *out) {
    if (!parse_num(flag, s, lo, hi, out)) return false;
    if (*out != std::floor(*out)) {
        fprintf(stderr, "generate: %s: '%s' is not a whole number\n", flag, s);
        return false;
    }
    return true;
}

// temperature, top-k, top-p over the logits; greedy at temperature 0
static int32_t sample(const float *logits, int V, double temp, int top_k, double top_p, std::mt19937_64 &rng,
                      std::vector<std::pair<float, int32_t>> &cand) {
    if (temp <= 0) return (int32_t)(std::max_element(logits, logits + V) - logits);
    cand.clear();
    for (int i = 0; i < V; i++) cand.push_back({logits[i], (int32_t)i});
    const int k = top_k > 0 ? std::min(top_k, V) : V;
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [](auto &a, auto &b) { return a.first > b.first; });
    cand.resize((size_t)k);
    double sum = 0;
    for (auto &c : cand) sum += (c.first = (float)std::exp((c.first - cand[0].first) / temp));
    double acc = 0;
    size_t keep = cand.size();
    for (size_t i = 0; i < cand.size(); i++) {  // the smallest prefix holding top_p of the mass
        acc += cand[i].first / sum;
        if (acc >= top_p) {
            keep = i + 1;
            break;
        }
    }
    cand.resize(keep);
    double total = 0;
    for (auto &c : cand) total += c.first;
    double r = std::uniform_real_distribution<double>(0, total)(rng);
    for (auto &c : cand)
        if ((r -= c.first) <= 0) return c.second;
    return cand.back().second;
}

// what the command line asks for
struct gen_args {
    const char *model = nullptr, *lora = nullptr, *device = "auto";
    std::string prompt;
    double n_gen = 128, temp = 0.8, top_k = 40, top_p = 0.95, seed = 1, n_ctx = 0, threads = 0, lora_scale = 1;
    bool exact = false;  // --exact: no 8-bit activations (ql_llama::q8_activations)
    bool profile = false;  // --profile: the token graph's time by op, node by node (each node waited for)
    ql_type cache_type = QL_TYPE_F32;  // --cache-type
};

// The flags into a: -1 to go on, else the exit code (0 for --help) after the usage or the message.
static int parse_args(int argc, char **argv, gen_args *a) {
    bool scale_given = false;
    for (int i = 1; i < argc; i++) {
        const std::string f = argv[i];
        const bool has = i + 1 < argc;
        bool ok = true;
        if (f == "-m" && has) {  // one model: a second would silently replace the first
            if (a->model) {
                fprintf(stderr, "generate: -m given twice ('%s', '%s')\n", a->model, argv[i + 1]);
                return 2;
            }
            a->model = argv[++i];
        } else if (f == "-p" && has) a->prompt = argv[++i];
        else if (f == "-n" && has) ok = parse_whole("-n", argv[++i], 0, 1 << 20, &a->n_gen);
        else if (f == "--temp" && has) ok = parse_num("--temp", argv[++i], 0, 100, &a->temp);
        else if (f == "--top-k" && has) ok = parse_whole("--top-k", argv[++i], 0, 1 << 30, &a->top_k);
        else if (f == "--top-p" && has) ok = parse_num("--top-p", argv[++i], 0, 1, &a->top_p);
        else if (f == "--seed" && has) ok = parse_whole("--seed", argv[++i], 0, 9007199254740992.0, &a->seed);  // (2^53: every whole number exact)
        else if (f == "-c" && has) ok = parse_whole("-c", argv[++i], 1, 1 << 20, &a->n_ctx);
        else if (f == "-t" && has) ok = parse_whole("-t", argv[++i], 0, 1024, &a->threads);
        else if (f == "--lora" && has) {
            if (a->lora) {  // one adapter: a second would silently replace the first
                fprintf(stderr, "generate: --lora given twice ('%s', '%s'): one adapter at a time (merge one with finetune --merge)\n",
                        a->lora, argv[i + 1]);
                return 2;
            }
            a->lora = argv[++i];
        } else if (f == "--device" && has) a->device = argv[++i];
        else if (f == "--exact") a->exact = true;
        else if (f == "--profile") a->profile = true;
        else if (f == "--cache-type" && has) {
            const std::string t = argv[++i];
            if (t != "f32" && t != "f16") {
                fprintf(stderr, "generate: --cache-type: '%s' is not f32 or f16\n", t.c_str());
                return 2;
            }
            a->cache_type = t == "f16" ? QL_TYPE_F16 : QL_TYPE_F32;
        }
        else if (f == "--lora-scale" && has) ok = parse_num("--lora-scale", argv[++i], -100, 100, &a->lora_scale), scale_given = true;
        else if (f == "-h" || f == "--help") {
            usage(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "generate: unknown or incomplete argument '%s' (--help lists the flags)\n", argv[i]);  // one line
            return 2;
        }
        if (!ok) return 2;
    }
    if (!a->model) {
        fprintf(stderr, "generate: -m model.gguf is required\n");
        return usage(argv[0]);
    }
    if (scale_given && !a->lora) {
        fprintf(stderr, "generate: --lora-scale without --lora: there is no adapter to scale\n");
        return 2;
    }
    return -1;
}

// What a run holds, freed in reverse order of declaration (what depends on a thing after it),
// and the two planned graphs: the prompt's (pt, pp -> lp) and one new token's (ot, op -> lo).
struct gen_state {
    owned<ql_llama_file> f{nullptr, ql_llama_file_free};
    owned<ql_vocab> vocab{nullptr, ql_vocab_free};
    owned<ql_lora_adapter> ad{nullptr, ql_lora_adapter_free};
    owned<ql_backend> be{nullptr, ql_backend_free};
    owned<ql_backend_buffer> wbuf{nullptr, ql_backend_buffer_free}, abuf{nullptr, ql_backend_buffer_free};
    std::vector<owned<ql_backend_buffer>> rbuf;  // the CPU's repacked Q4_0, Q4_K, Q6_K, NF4 weights
    owned<ql_context> ctx{nullptr, ql_free};
    owned<ql_graph> gp{nullptr, ql_graph_free}, go{nullptr, ql_graph_free};
    owned<ql_backend_buffer> cbuf{nullptr, ql_backend_buffer_free};
    std::vector<int32_t> toks;  // the prompt's tokens (BOS alone for an empty prompt)
    int n_prompt = 0, ctx_len = 0;
    ql_llama_cache cache;
    ql_tensor *pt = nullptr, *pp = nullptr, *ot = nullptr, *op = nullptr;  // [n_prompt] / [1] tokens and positions
    ql_tensor *lp = nullptr, *lo = nullptr;                                 // [n_vocab, n_prompt] / [n_vocab, 1] logits
};

// The model, its vocabulary and the adapter (--lora); 0, or 1 after the message.
static int load_model(const gen_args &a, gen_state *s) {
    char err[512];
    s->f.reset(ql_llama_load(a.model, err, sizeof(err)));
    if (!s->f) {
        fprintf(stderr, "generate: %s\n", err);
        return 1;
    }
    s->f->model.q8_activations = !a.exact;
    s->vocab.reset(ql_vocab_load(s->f->gguf, err, sizeof(err)));
    if (!s->vocab) {
        fprintf(stderr, "generate: %s: %s\n", a.model, err);  // (the vocabulary's errors do not name the file)
        return 1;
    }
    if (a.lora) {
        std::string e;
        s->ad.reset(ql_lora_attach_any(&s->f->model, s->f->arch.c_str(), a.lora, (float)a.lora_scale, &e));
        if (!s->ad) {
            fprintf(stderr, "generate: %s\n", e.c_str());
            return 1;
        }
    }
    return 0;
}

// The prompt's tokens and the context length (-c, else the prompt and -n within the model's
// training context); 0, or 1 after the message when the prompt does not fit.
static int prompt_tokens(const gen_args &a, gen_state *s) {
    const ql_llama &m = s->f->model;
    s->toks = ql_tokenize(s->vocab.get(), a.prompt, true, true);
    if (s->toks.empty()) {
        if (ql_vocab_bos(s->vocab.get()) < 0) {
            fprintf(stderr, "generate: the prompt is empty and the vocabulary has no BOS token to start from\n");
            return 1;
        }
        s->toks.push_back(ql_vocab_bos(s->vocab.get()));
    }
    const int n_prompt = s->n_prompt = (int)s->toks.size();
    int ctx_len = a.n_ctx > 0 ? (int)a.n_ctx : n_prompt + std::max(1, (int)a.n_gen);
    if (m.hp.n_ctx_train > 0 && a.n_ctx <= 0) ctx_len = std::min(ctx_len, m.hp.n_ctx_train);
    s->ctx_len = ctx_len;
    if (n_prompt >= ctx_len) {
        fprintf(stderr, "generate: the prompt has %d tokens, the context %d --> hint: a larger -c\n", n_prompt, ctx_len);
        return 1;
    }
    if (a.n_ctx > 0 && m.hp.n_ctx_train > 0 && (int)a.n_ctx > m.hp.n_ctx_train)  // as perplexity says it
        fprintf(stderr, "generate: note: -c %d is longer than the model's training context %d\n", (int)a.n_ctx, m.hp.n_ctx_train);
    return 0;
}

// The backend, the weights (and adapter) placed on it once, the KV cache and the two graphs,
// all planned and allocated before the first token; 0, or 1 after the message.
static int plan_graphs(const gen_args &a, gen_state *s) {
    const ql_llama &m = s->f->model;
    const ql_llama_hparams &hp = m.hp;
    const size_t cache_bytes = (size_t)hp.n_layer * 2 * (size_t)hp.head_dim() * (size_t)s->ctx_len * (size_t)hp.n_head_kv *
                               (a.cache_type == QL_TYPE_F16 ? 2 : 4);
    char err[512];
    if (a.threads > 0) ql_cpu_warn_threads("generate", (int)a.threads);
    s->be.reset(ql_backend_init_by_name(a.device, (int)a.threads, err, sizeof(err)));
    ql_backend *be = s->be.get();
    if (!be) {
        fprintf(stderr, "generate: --device %s: %s\n", a.device, err);
        return 1;
    }
    if (!ql_backend_is_host(be)) {  // a GPU says which, and how much memory it has free
        char desc[320];
        ql_backend_describe(be, desc, sizeof(desc));
        fprintf(stderr, "generate: %s\n", desc);
    }
    // the weights (and an adapter) placed once: nothing moves on the CPU
    ql_lora_adapter *ad = s->ad.get();
    s->wbuf.reset(ql_backend_place_ctx_tensors(be, s->f->ctx));
    s->abuf.reset(ad ? ql_backend_place_ctx_tensors(be, ad->ctx) : nullptr);
    if (!s->wbuf || (ad && !s->abuf)) {
        fprintf(stderr, "generate: %s\n", ql_ctx_error(s->wbuf ? ad->ctx : s->f->ctx));
        return 1;
    }
    // on the CPU with 8-bit activations, Q4_0, Q4_K, Q6_K and NF4 weights repacked in groups of 8 rows
    // (the file's pages of them given back): decode reads them faster (bench/RESULTS.md, sessions 21-22)
    for (ql_backend_buffer *b : ql_llama_repack_weights(be, &m, "generate")) s->rbuf.emplace_back(b, ql_backend_buffer_free);
    // headers only: the cache and the inputs get their data from the backend (alloc_ctx_tensors)
    ql_init_params ip = {(size_t)(hp.n_layer * 200 + 400) * ql_tensor_overhead() + (1u << 20), nullptr, true, false};
    s->ctx.reset(ql_init(ip));
    ql_context *ctx = s->ctx.get();
    if (!ctx) {
        fprintf(stderr, "generate: out of memory\n");
        return 1;
    }
    ql_llama_cache_create(ctx, &m, s->ctx_len, &s->cache, a.cache_type);
    s->pt = ql_new_tensor_2d(ctx, QL_TYPE_I32, s->n_prompt, 1), s->pp = ql_new_tensor_2d(ctx, QL_TYPE_I32, s->n_prompt, 1);
    s->ot = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1), s->op = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1);
    s->lp = ql_set_output(ql_llama_forward_cached(ctx, &m, &s->cache, s->pt, s->pp, true));  // [n_vocab, 1]: the last's
    s->lo = ql_set_output(ql_llama_forward_cached(ctx, &m, &s->cache, s->ot, s->op));
    s->gp.reset(ql_graph_new(ctx));
    s->go.reset(ql_graph_new(ctx));
    ql_graph_build_forward(s->gp.get(), s->lp);
    ql_graph_build_forward(s->go.get(), s->lo);
    s->cbuf.reset(ql_ctx_status(ctx) == QL_OK ? ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE) : nullptr);
    if (!s->cbuf || ql_graph_alloc(s->gp.get(), be) != QL_OK || ql_graph_alloc(s->go.get(), be) != QL_OK) {
        fprintf(stderr, "generate: %s (a KV cache of %.1f MiB for %d tokens) --> hint: a smaller -c\n", ql_ctx_error(ctx),
                cache_bytes / 1048576.0, s->ctx_len);
        return 1;
    }
    size_t in_use = 0;
    if (!ql_backend_is_host(be) && ql_backend_memory_used(be, &in_use, nullptr))
        fprintf(stderr, "generate: the KV cache %.1f MiB (%s, %d tokens); %.1f MiB of device memory in use\n", cache_bytes / 1048576.0,
                ql_type_name(a.cache_type), s->ctx_len, in_use / 1048576.0);
    return 0;
}

static bool set_i32(ql_backend *be, ql_tensor *t, const int32_t *v, size_t n) { return ql_backend_tensor_set(be, t, v, 0, n * 4) == QL_OK; }

// The prompt through the model: the last position's logits into *logits; 0, or 1 after the message.
static int run_prompt(gen_state &s, std::vector<float> *logits) {
    ql_backend *be = s.be.get();
    std::vector<int32_t> positions((size_t)s.n_prompt);
    for (int t = 0; t < s.n_prompt; t++) positions[(size_t)t] = t;
    const int32_t zero = 0;
    if (!set_i32(be, s.pt, s.toks.data(), s.toks.size()) || !set_i32(be, s.pp, positions.data(), positions.size()) ||
        !set_i32(be, s.cache.write_pos, &zero, 1) || !set_i32(be, s.cache.n_kv, &s.n_prompt, 1) ||
        ql_backend_graph_compute(be, s.gp.get()) != QL_OK ||
        ql_backend_tensor_get(be, s.lp, logits->data(), 0, logits->size() * 4) != QL_OK) {
        fprintf(stderr, "generate: %s\n", ql_ctx_error(s.ctx.get()));
        return 1;
    }
    return 0;
}

// how the generation went: tokens written, the end-of-generation token that stopped it (or -1:
// -n or the context's end), whether stdout's last line is unfinished
struct gen_result {
    int n_done = 0;
    int32_t eog = -1;
    bool line_open = false;
};

// Sample, print, feed back one token at a time until an end-of-generation token, -n tokens or
// the context's end; 0, or 1 after the message (non-finite logits, a failed step).
static int generate_tokens(const gen_args &a, gen_state &s, std::vector<float> &logits, gen_result *r) {
    ql_backend *be = s.be.get();
    const int n_vocab = s.f->model.hp.n_vocab;
    std::mt19937_64 rng((uint64_t)a.seed);
    std::vector<std::pair<float, int32_t>> cand;
    for (int pos = s.n_prompt; r->n_done < (int)a.n_gen && pos < s.ctx_len; pos++) {
        for (float x : logits)
            if (!std::isfinite(x)) {  // NaN weights, an inf adapter scale: refuse to sample from them
                fprintf(stderr, "\ngenerate: the logits at position %d are not finite: the model or the adapter holds "
                                "NaN or inf values\n", pos);
                return 1;
            }
        const int32_t next = sample(logits.data(), n_vocab, a.temp, (int)a.top_k, a.top_p, rng, cand);
        if (ql_vocab_is_eog(s.vocab.get(), next)) {  // eos, eot, eom and llama.cpp's end-of-generation texts
            r->eog = next;
            break;
        }
        const std::string piece = ql_token_to_piece(s.vocab.get(), next, false);
        fwrite(piece.data(), 1, piece.size(), stdout);
        fflush(stdout);
        if (!piece.empty()) r->line_open = piece.back() != '\n';
        r->n_done++;
        if (r->n_done == (int)a.n_gen || pos + 1 >= s.ctx_len) break;
        const int32_t n_kv = pos + 1;
        if (!set_i32(be, s.ot, &next, 1) || !set_i32(be, s.op, &pos, 1) || !set_i32(be, s.cache.write_pos, &pos, 1) ||
            !set_i32(be, s.cache.n_kv, &n_kv, 1) || ql_backend_graph_compute(be, s.go.get()) != QL_OK ||
            ql_backend_tensor_get(be, s.lo, logits.data(), 0, logits.size() * 4) != QL_OK) {
            fprintf(stderr, "\ngenerate: %s\n", ql_ctx_error(s.ctx.get()));
            return 1;
        }
    }
    return 0;
}

// --profile: where a decoded token's time went, by op (the token graph run node by node, so the
// sum is above the graph's time without the waits); runs: the token graph's evaluations
static void print_profile(const ql_graph *g, int runs, double wall, const char *what = "a decoded token") {
    std::map<std::string, double> by_op;
    double total = 0;
    for (int i = 0; i < ql_graph_n_nodes(g); i++) {
        const ql_tensor *n = ql_graph_node(g, i);
        std::string key = ql_op_name(n->op);
        if (n->op == QL_OP_MUL_MAT) key += std::string(" ") + ql_type_name(n->src[0]->type);
        by_op[key] += ql_graph_node_seconds(g, i);
        total += ql_graph_node_seconds(g, i);
    }
    if (runs <= 0 || total <= 0) return;
    std::vector<std::pair<double, std::string>> v;
    for (const auto &kv : by_op) v.push_back({kv.second, kv.first});
    std::sort(v.rbegin(), v.rend());
    fprintf(stderr, "generate: profile of %s (%d nodes): %.3f ms in the nodes, %.3f ms in all\n", what, ql_graph_n_nodes(g),
            total / runs * 1e3, wall / runs * 1e3);
    for (const auto &x : v) fprintf(stderr, "  %-22s %6.1f%%  %8.3f ms\n", x.second.c_str(), 100 * x.first / total, x.first / runs * 1e3);
}

// why it stopped, in one line
static void report_stop(const gen_args &a, const gen_state &s, const gen_result &r) {
    if (r.eog >= 0)
        fprintf(stderr, "generate: stopped at the end-of-generation token %s (id %d) after %d token%s\n",
                ql_vocab_token_text(s.vocab.get(), r.eog), (int)r.eog, r.n_done, r.n_done == 1 ? "" : "s");
    else if (r.n_done == (int)a.n_gen)
        fprintf(stderr, "generate: stopped after -n %d tokens\n", (int)a.n_gen);
    else  // fewer than asked, and not the model's choice: say whose limit it was
        fprintf(stderr, "generate: stopped at the end of the context (%d tokens: %s) before -n %d --> hint: a larger -c\n", s.ctx_len,
                a.n_ctx > 0 ? "-c" : "the model's training context", (int)a.n_gen);
}

int main(int argc, char **argv) {
    gen_args a;
    if (const int rc = parse_args(argc, argv, &a); rc >= 0) return rc;
    gen_state s;
    if (const int rc = load_model(a, &s)) return rc;
    if (const int rc = prompt_tokens(a, &s)) return rc;
    if (const int rc = plan_graphs(a, &s)) return rc;
    std::vector<float> logits((size_t)s.f->model.hp.n_vocab);

    if (a.profile) ql_graph_set_profile(s.gp.get(), true);
    const auto t0 = std::chrono::steady_clock::now();
    if (const int rc = run_prompt(s, &logits)) return rc;
    printf("%s", a.prompt.c_str());
    fflush(stdout);
    gen_result r;
    r.line_open = !a.prompt.empty() && a.prompt.back() != '\n';  // the output ends with a newline
    if (a.profile) ql_graph_set_profile(s.go.get(), true);
    const auto t1 = std::chrono::steady_clock::now();
    if (const int rc = generate_tokens(a, s, logits, &r)) return rc;
    const auto t2 = std::chrono::steady_clock::now();
    if (r.line_open) printf("\n");
    fflush(stdout);
    const double tp = std::chrono::duration<double>(t1 - t0).count(), tg = std::chrono::duration<double>(t2 - t1).count();
    fprintf(stderr, "%sgenerate: prompt %d tokens in %.3f s (%.1f tokens/s); generated %d tokens in %.3f s (%.1f tokens/s)\n",
            r.n_done > 0 || !a.prompt.empty() ? "\n" : "", s.n_prompt, tp, s.n_prompt / std::max(tp, 1e-9), r.n_done, tg,
            r.n_done / std::max(tg, 1e-9));
    report_stop(a, s, r);
    if (a.profile) print_profile(s.gp.get(), 1, tp, "the prompt");
    if (a.profile) print_profile(s.go.get(), r.n_done - 1, tg);  // (the last token is sampled, not run)
    return 0;
}
