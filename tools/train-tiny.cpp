// tools/train-tiny - `make demo` until fine-tuning lands: trains a small character-level llama
// from scratch on a bundled text with the library (planned memory, fused attention, AdamW),
// then continues a prompt greedily to show what it learned. No files, no network.
//
//   ./train-tiny [-t threads] [--steps N] [--seed S]
#include "../models/llama.h"
#include "../qlora.h"
#include "cli.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static const char k_text[] =
    "The lamp keeper climbs the stair at dusk and lights the lamp for the ships at sea.\n"
    "The lamp keeper counts the waves at night and writes the count in a small grey book.\n"
    "The lamp keeper sleeps at dawn when the gulls come home and the ships are in the bay.\n"
    "In the small grey book the keeper writes: one light, one night, one ship safe home.\n";

// byte <-> token: newline is 0, printable ASCII 32..126 are 1..95
static int tok_of(char c) { return c == '\n' ? 0 : (c >= 32 && c <= 126 ? c - 31 : 1); }
static char char_of(int t) { return t == 0 ? '\n' : (char)(t + 31); }

int main(int argc, char **argv) {
    long long n_threads = 0, steps = 400, seed = 1;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        bool ok = true;
        if (a == "-t") ok = arg_whole("train-tiny", argc, argv, &i, 0, 1024, &n_threads);
        else if (a == "--steps") ok = arg_whole("train-tiny", argc, argv, &i, 1, 1000000, &steps);
        else if (a == "--seed") ok = arg_whole("train-tiny", argc, argv, &i, 0, 1LL << 62, &seed);
        else if (a == "-h" || a == "--help") {
            printf("usage: %s [-t threads] [--steps N] [--seed S]\n"
                   "  trains a tiny character-level llama from scratch on a bundled text, then continues a prompt;\n"
                   "  exit 0 when the loss fell to a quarter of where it started\n", argv[0]);
            return 0;
        } else {
            fprintf(stderr, "train-tiny: unknown argument '%s' (usage: %s [-t threads] [--steps N] [--seed S])\n", argv[i], argv[0]);
            return 2;
        }
        if (!ok) return 2;
    }
    char err[256];
    ql_backend *cpu = ql_backend_init_by_name("cpu", (int)n_threads, err, sizeof(err));  // (first: nothing else to free)
    if (!cpu) {
        fprintf(stderr, "train-tiny: %s\n", err);
        return 1;
    }
    const int V = 96, T = 64, B = 8;
    ql_llama_hparams hp;
    hp.n_vocab = V; hp.n_embd = 96; hp.n_layer = 2; hp.n_head = 4; hp.n_head_kv = 2; hp.n_ff = 256;

    ql_init_params ip = {64u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_llama m;
    if (ql_llama_create(ctx, &m, hp, QL_TYPE_F32, true) != QL_OK) {
        fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    ql_llama_randomize(&m, seed, 0.05f);
    ql_llama_set_params(&m);

    // training graph: B windows of T characters, predict each next character
    ql_tensor *tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    ql_tensor *pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    ql_tensor *targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
    ql_tensor *count = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
    ql_tensor *logits = ql_llama_forward(ctx, &m, tokens, pos, nullptr);
    ql_tensor *loss = ql_cross_entropy(ctx, ql_reshape_2d(ctx, logits, V, T * B), targets, count);
    ql_graph *gf = ql_graph_new(ctx);
    ql_graph_build_forward(gf, loss);
    ql_graph *gb = ql_graph_backward(ctx, gf, loss);

    // sampling graph: one window, same weights
    ql_tensor *s_tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1));
    ql_tensor *s_pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1));
    ql_tensor *s_logits = ql_llama_forward(ctx, &m, s_tokens, s_pos, nullptr);  // [V, T, 1]
    ql_graph *gs = ql_graph_new(ctx);
    ql_graph_build_forward(gs, s_logits);

    ql_plan_stats st;
    if (!gb || ql_graph_plan(gb, cpu, &st) != QL_OK || ql_graph_alloc(gb, cpu) != QL_OK ||
        ql_graph_plan(gs, cpu, nullptr) != QL_OK || ql_graph_alloc(gs, cpu) != QL_OK) {
        fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    std::vector<ql_tensor *> am, av;
    int64_t n_params = 0;
    for (int i = 0; i < ql_graph_n_params(gb); i++) {
        ql_tensor *p = ql_graph_param(gb, i);
        n_params += ql_nelements(p);
        am.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
        av.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
        if (!am.back() || !av.back()) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
            return 1;
        }
        ql_tensor_fill_f32(am.back(), 0);
        ql_tensor_fill_f32(av.back(), 0);
    }
    printf("train-tiny: character llama, %lld parameters, %d layers, %d threads (%s)\n", (long long)n_params,
           hp.n_layer, ql_backend_cpu_n_threads(cpu), ql_cpu_features());
    printf("memory plan: params %.2f MiB, grads %.2f MiB, saved activations %.2f MiB, scratch %.2f MiB, "
           "workspace %.2f MiB (no reuse would need %.2f MiB for activations)\n",
           st.bytes[QL_MEM_PARAMS] / 1048576.0, st.bytes[QL_MEM_GRADS] / 1048576.0, st.bytes[QL_MEM_SAVED] / 1048576.0,
           st.bytes[QL_MEM_SCRATCH] / 1048576.0, st.bytes[QL_MEM_WORK] / 1048576.0, st.sum_of_sizes / 1048576.0);

    const int n_text = (int)strlen(k_text);
    std::mt19937 rng((uint32_t)seed);
    ql_adamw_params opt = {0.0f, 0.9f, 0.99f, 1e-8f, 0.0f};
    const float lr_max = 3e-3f;  // linear decay to zero: a settled model at the end
    const auto t0 = std::chrono::steady_clock::now();
    float first = 0, last = 0;
    for (int step = 1; step <= steps; step++) {
        int32_t *tk = (int32_t *)tokens->data, *ps = (int32_t *)pos->data, *tg = (int32_t *)targets->data;
        for (int b = 0; b < B; b++) {
            const int start = (int)(rng() % (uint32_t)(n_text - T - 1));
            for (int t = 0; t < T; t++) {
                tk[b * T + t] = tok_of(k_text[start + t]);
                ps[b * T + t] = t;
                tg[b * T + t] = tok_of(k_text[start + t + 1]);
            }
        }
        *(float *)count->data = (float)(T * B);
        ql_graph_zero_grads(gb);
        if (ql_backend_graph_compute(cpu, gb) != QL_OK) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
            return 1;
        }
        opt.lr = lr_max * (1.0f - (float)(step - 1) / (float)steps);
        for (int i = 0; i < ql_graph_n_params(gb); i++) ql_adamw_update(ql_graph_param(gb, i), am[(size_t)i], av[(size_t)i], step, &opt, 1.0f);
        last = *(const float *)loss->data;
        if (step == 1) first = last;
        if (step == 1 || step % 50 == 0 || step == steps) {
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            printf("step %4d  loss %.4f  (%.0f tokens/s)\n", step, last, (double)step * T * B / s);
        }
    }

    // continue a prompt greedily; count how much of the text it reproduces
    const char *prompt = "The lamp keeper ";
    std::string ctxs = prompt;
    const int n_gen = 160;
    for (int g = 0; g < n_gen; g++) {
        const int n = std::min((int)ctxs.size(), T), off = (int)ctxs.size() - n;
        for (int t = 0; t < T; t++) {
            ((int32_t *)s_tokens->data)[t] = t < n ? tok_of(ctxs[(size_t)(off + t)]) : 0;
            ((int32_t *)s_pos->data)[t] = t;
        }
        if (ql_backend_graph_compute(cpu, gs) != QL_OK) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
            return 1;
        }
        const float *row = (const float *)s_logits->data + (size_t)(n - 1) * V;
        int best = 0;
        for (int v = 1; v < V; v++)
            if (row[v] > row[best]) best = v;
        ctxs += char_of(best);
    }
    // how far the output runs verbatim in the training text
    const std::string text = k_text;
    size_t verbatim = strlen(prompt);
    while (verbatim < ctxs.size() && text.find(ctxs.substr(0, verbatim + 1)) != std::string::npos) verbatim++;
    printf("\nprompt: \"%s\"\nmodel:  \"%s\"\n", prompt, ctxs.c_str());
    printf("\nloss %.3f -> %.3f; the first %zu of %d generated characters continue the training text verbatim\n",
           first, last, verbatim - strlen(prompt), n_gen);
    ql_graph_free(gs);
    ql_graph_free(gb);
    ql_graph_free(gf);
    ql_backend_free(cpu);
    ql_free(ctx);
    if (!(last < first / 4)) {  // the demo's promise: say why the exit is 1
        fprintf(stderr, "train-tiny: the loss fell from %.3f to %.3f, not to a quarter (%.3f): it did not learn the text "
                "(more --steps)\n", first, last, first / 4);
        return 1;
    }
    return 0;
}
