// tools/perplexity - how well a model predicts a text.
//
//   ./perplexity -m model.gguf -f text.txt [-c 512] [--lora adapter.gguf [--lora-scale 1]]
//                [--json] [-t threads] [--device cpu|cuda|cuda:N|auto] [--exact]
//
// The text is tokenized once, without BOS, and cut into consecutive chunks of c-1 tokens; each
// window is BOS followed by one chunk, and every chunk token is predicted by the position
// before it - so "tokens" equals the text's token count. Prints the mean negative
// log-likelihood and its exponential; --json prints {"nll": ..., "ppl": ..., "tokens": ...}, the
// numbers with 9 significant digits (enough to tell two runs apart). The quantised weights'
// multiplies take 8-bit activations, as generate's do (the bound is in README's generate section;
// llama.cpp's perplexity works alike); --exact keeps them f32, the exact dequantised path.
#include "../models/adapter.h"
#include "../models/llama.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "own.h"

#include <chrono>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr, "usage: %s -m model.gguf -f text.txt [-c 512] [--lora adapter.gguf|peft-dir] [--lora-scale S] [--json] [-t THREADS]\n"
                    "       [--device cpu|cuda|cuda:N|auto]   (auto: cuda when built with it and a GPU is present)\n"
                    "       [--exact]   (f32 activations in the quantised weights' multiplies, not 8-bit)\n",
            argv0);
    return 2;
}

// One window length's graph: tokens [T], targets [T] (-1: not predicted), summed NLL out.
struct window_graph {
    ql_context *ctx = nullptr;
    ql_graph *g = nullptr;
    ql_tensor *tokens, *pos, *targets, *count, *nll;
    ql_backend_buffer *inputs = nullptr;  // the leafs above, in the backend's memory
    bool build(const ql_llama &m, int T, ql_backend *be, std::string *why) {
        ql_init_params ip = {(size_t)(m.hp.n_layer * 200 + 400) * ql_tensor_overhead() + (1u << 16), nullptr, true, false};
        ctx = ql_init(ip);
        tokens = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1);
        pos = ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1);
        targets = ql_new_tensor_1d(ctx, QL_TYPE_I32, T);
        count = ql_new_tensor_1d(ctx, QL_TYPE_F32, 1);
        ql_tensor *logits = ql_llama_forward(ctx, &m, tokens, pos, nullptr);
        nll = ql_cross_entropy(ctx, logits ? ql_reshape_2d(ctx, logits, logits->ne[0], T) : nullptr, targets, count);
        g = ql_graph_new(ctx);
        ql_graph_build_forward(g, nll);
        if (ql_ctx_status(ctx) != QL_OK || !(inputs = ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE)) ||
            ql_graph_alloc(g, be) != QL_OK) {
            *why = ql_ctx_error(ctx);
            return false;
        }
        std::vector<int32_t> p((size_t)T);
        for (int t = 0; t < T; t++) p[(size_t)t] = t;
        const float one = 1.0f;  // the op's sum over predicted tokens, unnormalised
        if (ql_backend_tensor_set(be, pos, p.data(), 0, p.size() * 4) != QL_OK || ql_backend_tensor_set(be, count, &one, 0, 4) != QL_OK) {
            *why = "cannot write the inputs to the device";
            return false;
        }
        return true;
    }
    ~window_graph() {
        ql_graph_free(g);
        ql_backend_buffer_free(inputs);
        ql_free(ctx);
    }
};

// what the command line asks for
struct ppl_args {
    const char *model = nullptr, *file = nullptr, *lora = nullptr, *device = "auto";
    int c = 512, threads = 0;
    double lora_scale = 1;
    bool json = false;
    bool exact = false;  // --exact: no 8-bit activations (ql_llama::q8_activations)
};

// The flags into a: -1 to go on, else the exit code (0 for --help) after the usage or the message.
static int parse_args(int argc, char **argv, ppl_args *o) {
    bool scale_given = false;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        const bool has = i + 1 < argc;
        if ((a == "-m" || a == "-f") && has) {  // one model, one text: a second would silently replace the first
            const char *&slot = a == "-m" ? o->model : o->file;
            if (slot) {
                fprintf(stderr, "perplexity: %s given twice ('%s', '%s')\n", a.c_str(), slot, argv[i + 1]);
                return 2;
            }
            slot = argv[++i];
        } else if (a == "--lora" && has) {
            if (o->lora) {  // one adapter: a second would silently replace the first
                fprintf(stderr, "perplexity: --lora given twice ('%s', '%s'): one adapter at a time\n", o->lora, argv[i + 1]);
                return 2;
            }
            o->lora = argv[++i];
        } else if (a == "--device" && has) o->device = argv[++i];
        else if (a == "--json") o->json = true;
        else if (a == "--exact") o->exact = true;
        else if ((a == "-c" || a == "-t" || a == "--lora-scale") && has) {
            char *end = nullptr;
            const double v = strtod(argv[++i], &end);
            const bool bad = !end || end == argv[i] || *end || !std::isfinite(v) || (a == "-c" && (v < 2 || v > (1 << 20) || v != (int)v)) ||
                             (a == "-t" && (v < 0 || v > 1024 || v != (int)v));
            if (bad) {
                fprintf(stderr, "perplexity: %s: '%s' is not a valid value%s\n", a.c_str(), argv[i],
                        a == "-c" ? " (an integer >= 2)" : "");
                return 2;
            }
            if (a == "-c") o->c = (int)v;
            else if (a == "-t") o->threads = (int)v;
            else o->lora_scale = v, scale_given = true;
        } else if (a == "-h" || a == "--help") {
            usage(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "perplexity: unknown or incomplete argument '%s' (--help lists the flags)\n", argv[i]);  // one line
            return 2;
        }
    }
    if (!o->model || !o->file) {
        fprintf(stderr, "perplexity: -m model.gguf and -f text.txt are required\n");
        return usage(argv[0]);
    }
    if (scale_given && !o->lora) {
        fprintf(stderr, "perplexity: --lora-scale without --lora: there is no adapter to scale\n");
        return 2;
    }
    return -1;
}

// The whole text file into *text, refused when it cannot be read or holds a NUL byte;
// 0, or 1 after the message.
static int read_text(const char *file, std::string *text) {
    FILE *tf = fopen(file, "rb");
    if (!tf) {
        fprintf(stderr, "perplexity: %s: cannot open: %s\n", file, strerror(errno));
        return 1;
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), tf)) > 0) text->append(buf, n);
    const bool read_failed = ferror(tf) != 0;
    const int read_errno = errno;
    fclose(tf);
    if (read_failed) {  // a directory opens, then fails to read
        fprintf(stderr, "perplexity: %s: cannot read: %s\n", file, strerror(read_errno));
        return 1;
    }
    const size_t nul = text->find('\0');
    if (nul != std::string::npos) {  // a binary file would tokenize to byte tokens for minutes
        fprintf(stderr, "perplexity: %s: not a text file (a NUL byte at offset %zu)\n", file, nul);
        return 1;
    }
    return 0;
}

// what a run holds, freed in reverse order of declaration (what depends on a thing after it)
struct ppl_state {
    owned<ql_llama_file> f{nullptr, ql_llama_file_free};
    owned<ql_vocab> vocab{nullptr, ql_vocab_free};
    owned<ql_lora_adapter> ad{nullptr, ql_lora_adapter_free};
    owned<ql_backend> be{nullptr, ql_backend_free};
    owned<ql_backend_buffer> wbuf{nullptr, ql_backend_buffer_free}, abuf{nullptr, ql_backend_buffer_free};
    std::vector<owned<ql_backend_buffer>> rbuf;  // the CPU's repacked Q4_0, Q4_K, Q6_K, NF4 weights
};

// The model, its vocabulary and the adapter (--lora); 0, or 1 after the message.
static int load_model(const ppl_args &o, ppl_state *s) {
    char err[512];
    s->f.reset(ql_llama_load(o.model, err, sizeof(err)));
    s->vocab.reset(s->f ? ql_vocab_load(s->f->gguf, err, sizeof(err)) : nullptr);
    if (!s->f || !s->vocab) {
        fprintf(stderr, "perplexity: %s: %s\n", o.model, err);  // (the vocabulary's errors do not name the file)
        return 1;
    }
    if (o.lora) {
        std::string e;
        s->ad.reset(ql_lora_attach_any(&s->f->model, s->f->arch.c_str(), o.lora, (float)o.lora_scale, &e));
        if (!s->ad) {
            fprintf(stderr, "perplexity: %s\n", e.c_str());
            return 1;
        }
    }
    return 0;
}

// The backend (--device), and the weights and the adapter placed on it once; 0, or 1 after the message.
static int place_model(const ppl_args &o, ppl_state *s) {
    char err[512];
    if (o.threads > 0) ql_cpu_warn_threads("perplexity", o.threads);
    s->be.reset(ql_backend_init_by_name(o.device, o.threads, err, sizeof(err)));
    ql_backend *be = s->be.get();
    if (!be) {
        fprintf(stderr, "perplexity: --device %s: %s\n", o.device, err);
        return 1;
    }
    if (!ql_backend_is_host(be)) {
        char desc[320];
        ql_backend_describe(be, desc, sizeof(desc));
        fprintf(stderr, "perplexity: %s\n", desc);
    }
    ql_lora_adapter *ad = s->ad.get();
    s->wbuf.reset(ql_backend_place_ctx_tensors(be, s->f->ctx));  // the weights, placed once
    s->abuf.reset(ad ? ql_backend_place_ctx_tensors(be, ad->ctx) : nullptr);
    if (!s->wbuf || (ad && !s->abuf)) {
        fprintf(stderr, "perplexity: %s\n", ql_ctx_error(s->wbuf ? ad->ctx : s->f->ctx));
        return 1;
    }
    return 0;
}

// Every window of c - 1 tokens after a BOS through its graph (full, or last for the shorter
// tail), the summed nll into *sum; a live counter on a terminal. 0, or 1 after the message.
static int score_windows(const ppl_args &o, ql_backend *be, int32_t bos, const std::vector<int32_t> &toks, window_graph &full,
                         window_graph &last, double *sum) {
    const int chunk = o.c - 1;
    const int64_t n_tok = (int64_t)toks.size();
    const bool progress = isatty(fileno(stderr));
    std::vector<int32_t> tk((size_t)o.c), tg((size_t)o.c);
    for (int64_t start = 0; start < n_tok; start += chunk) {
        const int64_t len = std::min<int64_t>(chunk, n_tok - start);
        window_graph &w = len == chunk ? full : last;
        tk[0] = bos;
        for (int64_t i = 0; i < len; i++) {
            tk[i + 1] = toks[(size_t)(start + i)];
            tg[i] = toks[(size_t)(start + i)];  // predicted from the position before it
        }
        tg[(size_t)len] = -1;  // the last position predicts nothing in this window
        float nll_w = 0;
        if (ql_backend_tensor_set(be, w.tokens, tk.data(), 0, (size_t)(len + 1) * 4) != QL_OK ||
            ql_backend_tensor_set(be, w.targets, tg.data(), 0, (size_t)(len + 1) * 4) != QL_OK ||
            ql_backend_graph_compute(be, w.g) != QL_OK || ql_backend_tensor_get(be, w.nll, &nll_w, 0, 4) != QL_OK) {
            fprintf(stderr, "perplexity: %s\n", ql_ctx_error(w.ctx));
            return 1;
        }
        *sum += nll_w;
        if (!o.json && progress) fprintf(stderr, "\rperplexity: %lld/%lld tokens", (long long)(start + len), (long long)n_tok);
    }
    return 0;
}

int main(int argc, char **argv) {
    ppl_args o;
    if (const int rc = parse_args(argc, argv, &o); rc >= 0) return rc;
    std::string text;
    if (const int rc = read_text(o.file, &text)) return rc;
    ppl_state s;
    if (const int rc = load_model(o, &s)) return rc;
    const ql_llama &m = s.f->model;
    const int32_t bos = ql_vocab_bos(s.vocab.get());
    if (bos < 0) {
        fprintf(stderr, "perplexity: %s: the vocabulary has no BOS token to start each window with\n", o.model);
        return 1;
    }
    const std::vector<int32_t> toks = ql_tokenize(s.vocab.get(), text, false, false);
    if (toks.empty()) {
        fprintf(stderr, "perplexity: %s: the text has no tokens\n", o.file);
        return 1;
    }
    if (m.hp.n_ctx_train > 0 && o.c > m.hp.n_ctx_train)
        fprintf(stderr, "perplexity: note: -c %d is longer than the model's training context %d\n", o.c, m.hp.n_ctx_train);
    const int chunk = o.c - 1;
    const int64_t n_tok = (int64_t)toks.size(), n_full = n_tok / chunk, tail = n_tok % chunk;
    if (const int rc = place_model(o, &s)) return rc;
    ql_backend *be = s.be.get();
    s.f->model.q8_activations = !o.exact;  // (before the graphs are built: their multiplies carry it)
    for (ql_backend_buffer *b : ql_llama_repack_weights(be, &s.f->model, "perplexity"))  // prompts' panels packed from the copies: the same bits
        s.rbuf.emplace_back(b, ql_backend_buffer_free);
    window_graph full, last;  // both planned and allocated before the first window runs
    std::string why;
    if ((n_full > 0 && !full.build(m, o.c, be, &why)) || (tail > 0 && !last.build(m, (int)tail + 1, be, &why))) {
        fprintf(stderr, "perplexity: %s\n", why.c_str());
        return 1;
    }
    const bool progress = isatty(fileno(stderr));  // a live counter on a terminal only
    const auto t0 = std::chrono::steady_clock::now();
    double sum = 0;
    if (const int rc = score_windows(o, be, bos, toks, full, last, &sum)) return rc;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double nll = sum / (double)n_tok;
    if (!std::isfinite(nll)) {  // NaN weights, an inf adapter scale: a number that is not one is an error
        if (progress && !o.json) fprintf(stderr, "\n");
        fprintf(stderr, "perplexity: the mean nll is %s: the model%s holds non-finite values (NaN or inf weights?)\n",
                std::isnan(nll) ? "nan" : "inf", o.lora ? " or the adapter" : "");
        return 1;
    }
    if (o.json) {
        printf("{\"nll\": %.9g, \"ppl\": %.9g, \"tokens\": %lld}\n", nll, std::exp(nll), (long long)n_tok);
    } else {
        if (progress) fprintf(stderr, "\n");
        printf("perplexity: %lld tokens in windows of %d: mean nll %.6f, perplexity %.4f (%.1f tokens/s)\n",
               (long long)n_tok, o.c, nll, std::exp(nll), (double)n_tok / std::max(secs, 1e-9));
    }
    return 0;
}
