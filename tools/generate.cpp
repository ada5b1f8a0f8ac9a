// tools/generate - continue a prompt with a GGUF model, streaming the text.
//
//   ./generate -m model.gguf [-p "prompt"] [-n 128] [--temp 0.8] [--top-k 40] [--top-p 0.95]
//              [--seed 1] [--lora adapter.gguf [--lora-scale 1]] [-c context] [-t threads]
//              [--device cpu|cuda|cuda:N|auto]
//
// Generation stops at an end-of-generation token (ql_vocab_is_eog: eos, eot, eom and the texts
// llama.cpp treats as such, e.g. <|eot_id|> and <|end_of_text|>), after -n tokens, or at the
// context's end; one line on stderr says which. The text on stdout ends with a newline.
// --temp 0 is greedy. An empty prompt starts from BOS alone. Two graphs are planned before the
// first token - the prompt and one new token - over one KV cache; every step then only sets
// inputs (token, position, cache row) and runs, allocating nothing. On a GPU the weights are
// placed on it once; inputs go in and logits come back through the backend's set/get.
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
#include <cstring>
#include <random>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s -m model.gguf [-p PROMPT] [-n N] [--temp T] [--top-k K] [--top-p P] [--seed S]\n"
            "       [--lora adapter.gguf|peft-dir] [--lora-scale S] [-c CONTEXT] [-t THREADS]\n"
            "       [--device cpu|cuda|cuda:N|auto]   (auto: cuda when built with it and a GPU is present)\n",
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

int main(int argc, char **argv) {
    const char *model = nullptr, *lora = nullptr, *device = "auto";
    std::string prompt;
    double n_gen = 128, temp = 0.8, top_k = 40, top_p = 0.95, seed = 1, n_ctx = 0, threads = 0, lora_scale = 1;
    bool scale_given = false;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        const bool has = i + 1 < argc;
        bool ok = true;
        if (a == "-m" && has) {  // one model: a second would silently replace the first
            if (model) {
                fprintf(stderr, "generate: -m given twice ('%s', '%s')\n", model, argv[i + 1]);
                return 2;
            }
            model = argv[++i];
        } else if (a == "-p" && has) prompt = argv[++i];
        else if (a == "-n" && has) ok = parse_whole("-n", argv[++i], 0, 1 << 20, &n_gen);
        else if (a == "--temp" && has) ok = parse_num("--temp", argv[++i], 0, 100, &temp);
        else if (a == "--top-k" && has) ok = parse_whole("--top-k", argv[++i], 0, 1 << 30, &top_k);
        else if (a == "--top-p" && has) ok = parse_num("--top-p", argv[++i], 0, 1, &top_p);
        else if (a == "--seed" && has) ok = parse_whole("--seed", argv[++i], 0, 9007199254740992.0, &seed);  // (2^53: every whole number exact)
        else if (a == "-c" && has) ok = parse_whole("-c", argv[++i], 1, 1 << 20, &n_ctx);
        else if (a == "-t" && has) ok = parse_whole("-t", argv[++i], 0, 1024, &threads);
        else if (a == "--lora" && has) {
            if (lora) {  // one adapter: a second would silently replace the first
                fprintf(stderr, "generate: --lora given twice ('%s', '%s'): one adapter at a time (merge one with finetune --merge)\n",
                        lora, argv[i + 1]);
                return 2;
            }
            lora = argv[++i];
        } else if (a == "--device" && has) device = argv[++i];
        else if (a == "--lora-scale" && has) ok = parse_num("--lora-scale", argv[++i], -100, 100, &lora_scale), scale_given = true;
        else if (a == "-h" || a == "--help") {
            usage(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "generate: unknown or incomplete argument '%s' (--help lists the flags)\n", argv[i]);  // one line
            return 2;
        }
        if (!ok) return 2;
    }
    if (!model) {
        fprintf(stderr, "generate: -m model.gguf is required\n");
        return usage(argv[0]);
    }
    if (scale_given && !lora) {
        fprintf(stderr, "generate: --lora-scale without --lora: there is no adapter to scale\n");
        return 2;
    }
    char err[512];
    ql_llama_file *f = ql_llama_load(model, err, sizeof(err));
    if (!f) {
        fprintf(stderr, "generate: %s\n", err);
        return 1;
    }
    owned<ql_llama_file> f_(f, ql_llama_file_free);
    ql_vocab *vocab = ql_vocab_load(f->gguf, err, sizeof(err));
    owned<ql_vocab> vocab_(vocab, ql_vocab_free);
    if (!vocab) {
        fprintf(stderr, "generate: %s: %s\n", model, err);  // (the vocabulary's errors do not name the file)
        return 1;
    }
    ql_llama &m = f->model;
    ql_lora_adapter *ad = nullptr;
    if (lora) {
        std::string e;
        if (!(ad = ql_lora_attach_any(&m, f->arch.c_str(), lora, (float)lora_scale, &e))) {
            fprintf(stderr, "generate: %s\n", e.c_str());
            return 1;
        }
    }
    owned<ql_lora_adapter> ad_(ad, ql_lora_adapter_free);
    std::vector<int32_t> toks = ql_tokenize(vocab, prompt, true, true);
    if (toks.empty()) {
        if (ql_vocab_bos(vocab) < 0) {
            fprintf(stderr, "generate: the prompt is empty and the vocabulary has no BOS token to start from\n");
            return 1;
        }
        toks.push_back(ql_vocab_bos(vocab));
    }
    const int n_prompt = (int)toks.size();
    int ctx_len = n_ctx > 0 ? (int)n_ctx : n_prompt + std::max(1, (int)n_gen);
    if (m.hp.n_ctx_train > 0 && n_ctx <= 0) ctx_len = std::min(ctx_len, m.hp.n_ctx_train);
    if (n_prompt >= ctx_len) {
        fprintf(stderr, "generate: the prompt has %d tokens, the context %d --> hint: a larger -c\n", n_prompt, ctx_len);
        return 1;
    }
    if (n_ctx > 0 && m.hp.n_ctx_train > 0 && (int)n_ctx > m.hp.n_ctx_train)  // as perplexity says it
        fprintf(stderr, "generate: note: -c %d is longer than the model's training context %d\n", (int)n_ctx, m.hp.n_ctx_train);

    // the cache, the two graphs, all planned and allocated before the first token
    const ql_llama_hparams &hp = m.hp;
    const size_t cache_bytes = (size_t)hp.n_layer * 2 * (size_t)hp.head_dim() * (size_t)ctx_len * (size_t)hp.n_head_kv * 4;
    if (threads > 0) ql_cpu_warn_threads("generate", (int)threads);
    ql_backend *be = ql_backend_init_by_name(device, (int)threads, err, sizeof(err));
    owned<ql_backend> be_(be, ql_backend_free);
    if (!be) {
        fprintf(stderr, "generate: --device %s: %s\n", device, err);
        return 1;
    }
    if (!ql_backend_is_host(be)) {  // a GPU says which, and how much memory it has free
        char desc[320];
        ql_backend_describe(be, desc, sizeof(desc));
        fprintf(stderr, "generate: %s\n", desc);
    }
    // the weights (and an adapter) placed once: nothing moves on the CPU
    ql_backend_buffer *wbuf = ql_backend_place_ctx_tensors(be, f->ctx);
    ql_backend_buffer *abuf = ad ? ql_backend_place_ctx_tensors(be, ad->ctx) : nullptr;
    owned<ql_backend_buffer> wbuf_(wbuf, ql_backend_buffer_free), abuf_(abuf, ql_backend_buffer_free);
    if (!wbuf || (ad && !abuf)) {
        fprintf(stderr, "generate: %s\n", ql_ctx_error(wbuf ? ad->ctx : f->ctx));
        return 1;
    }
    // headers only: the cache and the inputs get their data from the backend (alloc_ctx_tensors)
    ql_init_params ip = {(size_t)(hp.n_layer * 200 + 400) * ql_tensor_overhead() + (1u << 20), nullptr, true, false};
    ql_context *ctx = ql_init(ip);
    owned<ql_context> ctx_(ctx, ql_free);
    if (!ctx) {
        fprintf(stderr, "generate: out of memory\n");
        return 1;
    }
    ql_llama_cache cache;
    ql_llama_cache_create(ctx, &m, ctx_len, &cache);
    ql_tensor *pt = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1), *pp = ql_new_tensor_2d(ctx, QL_TYPE_I32, n_prompt, 1);
    ql_tensor *ot = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1), *op = ql_new_tensor_2d(ctx, QL_TYPE_I32, 1, 1);
    ql_tensor *lp = ql_set_output(ql_llama_forward_cached(ctx, &m, &cache, pt, pp));
    ql_tensor *lo = ql_set_output(ql_llama_forward_cached(ctx, &m, &cache, ot, op));
    ql_graph *gp = ql_graph_new(ctx), *go = ql_graph_new(ctx);
    owned<ql_graph> gp_(gp, ql_graph_free), go_(go, ql_graph_free);
    ql_graph_build_forward(gp, lp);
    ql_graph_build_forward(go, lo);
    ql_backend_buffer *cbuf = ql_ctx_status(ctx) == QL_OK ? ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE) : nullptr;
    owned<ql_backend_buffer> cbuf_(cbuf, ql_backend_buffer_free);
    if (!cbuf || ql_graph_alloc(gp, be) != QL_OK || ql_graph_alloc(go, be) != QL_OK) {
        fprintf(stderr, "generate: %s (a KV cache of %.1f MiB for %d tokens) --> hint: a smaller -c\n", ql_ctx_error(ctx),
                cache_bytes / 1048576.0, ctx_len);
        return 1;
    }
    auto set_i32 = [&](ql_tensor *t, const int32_t *v, size_t n) { return ql_backend_tensor_set(be, t, v, 0, n * 4) == QL_OK; };
    std::vector<float> logits((size_t)hp.n_vocab);

    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int32_t> positions((size_t)n_prompt);
    for (int t = 0; t < n_prompt; t++) positions[(size_t)t] = t;
    const int32_t zero = 0;
    if (!set_i32(pt, toks.data(), toks.size()) || !set_i32(pp, positions.data(), positions.size()) ||
        !set_i32(cache.write_pos, &zero, 1) || !set_i32(cache.n_kv, &n_prompt, 1) || ql_backend_graph_compute(be, gp) != QL_OK ||
        ql_backend_tensor_get(be, lp, logits.data(), (size_t)(n_prompt - 1) * hp.n_vocab * 4, logits.size() * 4) != QL_OK) {
        fprintf(stderr, "generate: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    printf("%s", prompt.c_str());
    fflush(stdout);
    bool line_open = !prompt.empty() && prompt.back() != '\n';  // the output ends with a newline
    const auto t1 = std::chrono::steady_clock::now();
    std::mt19937_64 rng((uint64_t)seed);
    std::vector<std::pair<float, int32_t>> cand;
    int n_done = 0;
    int32_t eog = -1;  // why it stopped: an end-of-generation token (this one), -n, or the context's end
    for (int pos = n_prompt; n_done < (int)n_gen && pos < ctx_len; pos++) {
        for (float x : logits)
            if (!std::isfinite(x)) {  // NaN weights, an inf adapter scale: refuse to sample from them
                fprintf(stderr, "\ngenerate: the logits at position %d are not finite: the model or the adapter holds "
                                "NaN or inf values\n", pos);
                return 1;
            }
        const int32_t next = sample(logits.data(), hp.n_vocab, temp, (int)top_k, top_p, rng, cand);
        if (ql_vocab_is_eog(vocab, next)) {  // eos, eot, eom and llama.cpp's end-of-generation texts
            eog = next;
            break;
        }
        const std::string piece = ql_token_to_piece(vocab, next, false);
        fwrite(piece.data(), 1, piece.size(), stdout);
        fflush(stdout);
        if (!piece.empty()) line_open = piece.back() != '\n';
        n_done++;
        if (n_done == (int)n_gen || pos + 1 >= ctx_len) break;
        const int32_t n_kv = pos + 1;
        if (!set_i32(ot, &next, 1) || !set_i32(op, &pos, 1) || !set_i32(cache.write_pos, &pos, 1) ||
            !set_i32(cache.n_kv, &n_kv, 1) || ql_backend_graph_compute(be, go) != QL_OK ||
            ql_backend_tensor_get(be, lo, logits.data(), 0, logits.size() * 4) != QL_OK) {
            fprintf(stderr, "\ngenerate: %s\n", ql_ctx_error(ctx));
            return 1;
        }
    }
    const auto t2 = std::chrono::steady_clock::now();
    if (line_open) printf("\n");
    fflush(stdout);
    const double tp = std::chrono::duration<double>(t1 - t0).count(), tg = std::chrono::duration<double>(t2 - t1).count();
    fprintf(stderr, "%sgenerate: prompt %d tokens in %.3f s (%.1f tokens/s); generated %d tokens in %.3f s (%.1f tokens/s)\n",
            n_done > 0 || !prompt.empty() ? "\n" : "", n_prompt, tp, n_prompt / std::max(tp, 1e-9), n_done, tg,
            n_done / std::max(tg, 1e-9));
    // why it stopped, in one line
    if (eog >= 0)
        fprintf(stderr, "generate: stopped at the end-of-generation token %s (id %d) after %d token%s\n",
                ql_vocab_token_text(vocab, eog), (int)eog, n_done, n_done == 1 ? "" : "s");
    else if (n_done == (int)n_gen)
        fprintf(stderr, "generate: stopped after -n %d tokens\n", (int)n_gen);
    else  // fewer than asked, and not the model's choice: say whose limit it was
        fprintf(stderr, "generate: stopped at the end of the context (%d tokens: %s) before -n %d --> hint: a larger -c\n", ctx_len,
                n_ctx > 0 ? "-c" : "the model's training context", (int)n_gen);
    return 0;
}
