// tools/train-tiny - `make demo` until fine-tuning lands: trains a small character-level llama
// from scratch on a bundled text with the library (planned memory, fused attention, AdamW),
// then continues a prompt greedily to show what it learned. No files, no network.
//
//   ./train-tiny [-t threads] [--steps N] [--seed S]
#include "../models/llama.h"
#include "../qlora.h"
#include "cli.h"
#include "own.h"

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

// what the command line asks for
struct tiny_args {
    long long n_threads = 0, steps = 400, seed = 1;
};

// The flags into a: -1 to go on, else the exit code (0 for --help) after the usage or the message.
static int parse_args(int argc, char **argv, tiny_args *a) {
    for (int i = 1; i < argc; i++) {
        const std::string f = argv[i];
        bool ok = true;
        if (f == "-t") ok = arg_whole("train-tiny", argc, argv, &i, 0, 1024, &a->n_threads);
        else if (f == "--steps") ok = arg_whole("train-tiny", argc, argv, &i, 1, 1000000, &a->steps);
        else if (f == "--seed") ok = arg_whole("train-tiny", argc, argv, &i, 0, 1LL << 62, &a->seed);
        else if (f == "-h" || f == "--help") {
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
    return -1;
}

const int k_vocab = 96, k_window = 64, k_batch = 8;  // V characters, T per window, B windows a step

// What a run holds, freed in reverse order of declaration (the graphs, the backend, then the
// context whose tensors they use), and the tensors the steps fill and read.
struct tiny_state {
    owned<ql_context> ctx{nullptr, ql_free};
    owned<ql_backend> cpu{nullptr, ql_backend_free};
    owned<ql_graph> gf{nullptr, ql_graph_free}, gb{nullptr, ql_graph_free}, gs{nullptr, ql_graph_free};
    ql_llama_hparams hp;
    ql_llama m;
    ql_tensor *tokens = nullptr, *pos = nullptr;      // [T, B] training windows and their positions
    ql_tensor *targets = nullptr, *count = nullptr;   // [T * B] next characters; [1] how many
    ql_tensor *loss = nullptr;                        // [1]
    ql_tensor *s_tokens = nullptr, *s_pos = nullptr;  // [T, 1] the sampling window
    ql_tensor *s_logits = nullptr;                    // [V, T, 1]
    std::vector<ql_tensor *> am, av;                  // AdamW's moments, one pair per parameter
    ql_plan_stats st;
    int64_t n_params = 0;
};

// The model (random weights), the training graph (B windows of T characters, predict each next
// character, with its backward), the sampling graph (one window, same weights), both planned
// and allocated, and AdamW's zeroed moments; 0, or 1 after the message.
static int build_graphs(const tiny_args &a, tiny_state *s) {
    const int V = k_vocab, T = k_window, B = k_batch;
    ql_llama_hparams &hp = s->hp;
    hp.n_vocab = V; hp.n_embd = 96; hp.n_layer = 2; hp.n_head = 4; hp.n_head_kv = 2; hp.n_ff = 256;

    ql_init_params ip = {64u << 20, nullptr, false, false};
    s->ctx.reset(ql_init(ip));
    ql_context *ctx = s->ctx.get();
    if (ql_llama_create(ctx, &s->m, hp, QL_TYPE_F32, true) != QL_OK) {
        fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    ql_llama_randomize(&s->m, a.seed, 0.05f);
    ql_llama_set_params(&s->m);

    s->tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    s->pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    s->targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
    s->count = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
    ql_tensor *logits = ql_llama_forward(ctx, &s->m, s->tokens, s->pos, nullptr);
    s->loss = ql_cross_entropy(ctx, ql_reshape_2d(ctx, logits, V, T * B), s->targets, s->count);
    s->gf.reset(ql_graph_new(ctx));
    ql_graph_build_forward(s->gf.get(), s->loss);
    s->gb.reset(ql_graph_backward(ctx, s->gf.get(), s->loss));

    s->s_tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1));
    s->s_pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, 1));
    s->s_logits = ql_llama_forward(ctx, &s->m, s->s_tokens, s->s_pos, nullptr);
    s->gs.reset(ql_graph_new(ctx));
    ql_graph_build_forward(s->gs.get(), s->s_logits);

    ql_backend *cpu = s->cpu.get();
    ql_graph *gb = s->gb.get();
    if (!gb || ql_graph_plan(gb, cpu, &s->st) != QL_OK || ql_graph_alloc(gb, cpu) != QL_OK ||
        ql_graph_plan(s->gs.get(), cpu, nullptr) != QL_OK || ql_graph_alloc(s->gs.get(), cpu) != QL_OK) {
        fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
        return 1;
    }
    for (int i = 0; i < ql_graph_n_params(gb); i++) {
        ql_tensor *p = ql_graph_param(gb, i);
        s->n_params += ql_nelements(p);
        s->am.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
        s->av.push_back(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne));
        if (!s->am.back() || !s->av.back()) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(ctx));
            return 1;
        }
        ql_tensor_fill_f32(s->am.back(), 0);
        ql_tensor_fill_f32(s->av.back(), 0);
    }
    return 0;
}

// The model's size and the memory plan, one line each
static void print_plan(const tiny_state &s) {
    const ql_plan_stats &st = s.st;
    printf("train-tiny: character llama, %lld parameters, %d layers, %d threads (%s)\n", (long long)s.n_params,
           s.hp.n_layer, ql_backend_cpu_n_threads(s.cpu.get()), ql_cpu_features());
    printf("memory plan: params %.2f MiB, grads %.2f MiB, saved activations %.2f MiB, scratch %.2f MiB, "
           "workspace %.2f MiB (no reuse would need %.2f MiB for activations)\n",
           st.bytes[QL_MEM_PARAMS] / 1048576.0, st.bytes[QL_MEM_GRADS] / 1048576.0, st.bytes[QL_MEM_SAVED] / 1048576.0,
           st.bytes[QL_MEM_SCRATCH] / 1048576.0, st.bytes[QL_MEM_WORK] / 1048576.0, st.sum_of_sizes / 1048576.0);
}

// --steps steps of AdamW on random windows of the text, the learning rate decaying linearly to
// zero (a settled model at the end), a line every 50; the first and last losses. 0, or 1 after
// the message.
static int train(const tiny_args &a, tiny_state &s, float *first, float *last) {
    const int T = k_window, B = k_batch;
    ql_backend *cpu = s.cpu.get();
    ql_graph *gb = s.gb.get();
    const int n_text = (int)strlen(k_text);
    std::mt19937 rng((uint32_t)a.seed);
    ql_adamw_params opt = {0.0f, 0.9f, 0.99f, 1e-8f, 0.0f};
    const float lr_max = 3e-3f;
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 1; step <= a.steps; step++) {
        int32_t *tk = (int32_t *)s.tokens->data, *ps = (int32_t *)s.pos->data, *tg = (int32_t *)s.targets->data;
        for (int b = 0; b < B; b++) {
            const int start = (int)(rng() % (uint32_t)(n_text - T - 1));
            for (int t = 0; t < T; t++) {
                tk[b * T + t] = tok_of(k_text[start + t]);
                ps[b * T + t] = t;
                tg[b * T + t] = tok_of(k_text[start + t + 1]);
            }
        }
        *(float *)s.count->data = (float)(T * B);
        ql_graph_zero_grads(gb);
        if (ql_backend_graph_compute(cpu, gb) != QL_OK) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(s.ctx.get()));
            return 1;
        }
        opt.lr = lr_max * (1.0f - (float)(step - 1) / (float)a.steps);
        for (int i = 0; i < ql_graph_n_params(gb); i++) ql_adamw_update(ql_graph_param(gb, i), s.am[(size_t)i], s.av[(size_t)i], step, &opt, 1.0f);
        *last = *(const float *)s.loss->data;
        if (step == 1) *first = *last;
        if (step == 1 || step % 50 == 0 || step == a.steps) {
            const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            printf("step %4d  loss %.4f  (%.0f tokens/s)\n", step, *last, (double)step * T * B / sec);
        }
    }
    return 0;
}

// The prompt continued greedily by n_gen characters into *out (the prompt included); 0, or 1
// after the message.
static int continue_prompt(tiny_state &s, const char *prompt, int n_gen, std::string *out) {
    const int V = k_vocab, T = k_window;
    std::string &ctxs = *out = prompt;
    for (int g = 0; g < n_gen; g++) {
        const int n = std::min((int)ctxs.size(), T), off = (int)ctxs.size() - n;
        for (int t = 0; t < T; t++) {
            ((int32_t *)s.s_tokens->data)[t] = t < n ? tok_of(ctxs[(size_t)(off + t)]) : 0;
            ((int32_t *)s.s_pos->data)[t] = t;
        }
        if (ql_backend_graph_compute(s.cpu.get(), s.gs.get()) != QL_OK) {
            fprintf(stderr, "train-tiny: %s\n", ql_ctx_error(s.ctx.get()));
            return 1;
        }
        const float *row = (const float *)s.s_logits->data + (size_t)(n - 1) * V;
        int best = 0;
        for (int v = 1; v < V; v++)
            if (row[v] > row[best]) best = v;
        ctxs += char_of(best);
    }
    return 0;
}

int main(int argc, char **argv) {
    tiny_args a;
    if (const int rc = parse_args(argc, argv, &a); rc >= 0) return rc;
    tiny_state s;
    char err[256];
    s.cpu.reset(ql_backend_init_by_name("cpu", (int)a.n_threads, err, sizeof(err)));
    if (!s.cpu) {
        fprintf(stderr, "train-tiny: %s\n", err);
        return 1;
    }
    if (const int rc = build_graphs(a, &s)) return rc;
    print_plan(s);
    float first = 0, last = 0;
    if (const int rc = train(a, s, &first, &last)) return rc;

    // continue a prompt greedily; count how much of the text it reproduces
    const char *prompt = "The lamp keeper ";
    const int n_gen = 160;
    std::string ctxs;
    if (const int rc = continue_prompt(s, prompt, n_gen, &ctxs)) return rc;
    // how far the output runs verbatim in the training text
    const std::string text = k_text;
    size_t verbatim = strlen(prompt);
    while (verbatim < ctxs.size() && text.find(ctxs.substr(0, verbatim + 1)) != std::string::npos) verbatim++;
    printf("\nprompt: \"%s\"\nmodel:  \"%s\"\n", prompt, ctxs.c_str());
    printf("\nloss %.3f -> %.3f; the first %zu of %d generated characters continue the training text verbatim\n",
           first, last, verbatim - strlen(prompt), n_gen);
    if (!(last < first / 4)) {  // the demo's promise: say why the exit is 1
        fprintf(stderr, "train-tiny: the loss fell from %.3f to %.3f, not to a quarter (%.3f): it did not learn the text "
                "(more --steps)\n", first, last, first / 4);
        return 1;
    }
    return 0;
}
