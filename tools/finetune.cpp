// tools/finetune - LoRA fine-tuning of a GGUF llama on a JSONL file.
//
//   ./finetune -m model.gguf -d data.jsonl [-o DIR] [options]     (./finetune --help lists them)
//
// Writes into DIR: adapter.gguf (llama.cpp's LoRA format), peft/ (adapter_config.json +
// adapter_model.safetensors), metrics.jsonl, loss.png, checkpoint.gguf (every --save-every steps
// and at the end, atomically), and merged.gguf with --merge. --resume DIR continues a run
// exactly; Ctrl-C saves a checkpoint and exits cleanly.
#include "../models/adapter.h"
#include "../models/data.h"
#include "../models/trainer.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::atomic<bool> g_stop{false};
// the first Ctrl-C ends the run after the current step (a checkpoint is saved); a second one kills
static void on_sigint(int) {
    g_stop.store(true);
    signal(SIGINT, SIG_DFL);
}

static const char *k_help =
    "usage: %s -m model.gguf -d data.jsonl [-o DIR] [options]\n"
    "LoRA:      --lora-targets q,k,v,o|all|LIST  --lora-r 16  --lora-alpha 32  --lora-dropout 0.05  --rslora\n"
    "data:      --seq-len 512  --pack  --chat-template NAME  --skip-bad-lines  --no-eos\n"
    "           --val-split F | --val-data FILE  --eval-every N\n"
    "trainer:   -b 4  --grad-accum 1  --lr 2e-4  --beta1 0.9  --beta2 0.999  --eps 1e-8  --weight-decay 0\n"
    "           --lr-scheduler constant|constant_with_warmup|linear|cosine  --warmup-ratio 0  --warmup-steps N\n"
    "           --max-grad-norm 1.0\n"
    "           --epochs 1  --max-steps N  --seed 42  -t THREADS  --profile (time per op, printed at the end)\n"
    "output:    -o DIR (default finetune-out)  --save-every N  --resume DIR  --merge  --overwrite (replace a run in -o DIR)\n";

static double peak_rss_mib() {  // VmHWM: the high-water mark of resident memory
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    double kb = 0;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    fclose(f);
    return kb / 1024.0;
}
static double rss_mib() {
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, res = 0;
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &res) != 2) res = 0;
        fclose(f);
    }
    return (double)res * (double)sysconf(_SC_PAGESIZE) / 1048576.0;
}

static std::string hms(double s) {
    char b[32];
    const long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(b, sizeof(b), "%ldh%02ldm", t / 3600, t % 3600 / 60);
    else if (t >= 60) snprintf(b, sizeof(b), "%ldm%02lds", t / 60, t % 60);
    else snprintf(b, sizeof(b), "%lds", t);
    return b;
}

static bool make_dir(const std::string &d, std::string *err) {
    if (mkdir(d.c_str(), 0755) == 0 || errno == EEXIST) {
        struct stat st;
        if (stat(d.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return true;
    }
    *err = d + ": cannot create the output directory: " + strerror(errno);
    return false;
}

// The lines of an earlier run's metrics.jsonl up to step `upto`, and its loss curves, so that
// after --resume the file and loss.png cover the whole run once.
static void keep_metrics(const std::string &path, int64_t upto, std::string *kept, std::vector<std::pair<double, double>> *curve,
                         std::vector<std::pair<double, double>> *eval_curve) {
    FILE *f = fopen(path.c_str(), "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof(line), f)) {
        long long step = 0;
        double v = 0;
        if (sscanf(line, "{\"step\": %lld", &step) != 1 || step > upto) continue;
        *kept += line;
        const char *l = strstr(line, "\"loss\": "), *e = strstr(line, "\"eval_loss\": ");
        if (l && sscanf(l + 8, "%lf", &v) == 1) curve->push_back({(double)step, v});
        if (e && sscanf(e + 13, "%lf", &v) == 1) eval_curve->push_back({(double)step, v});
    }
    fclose(f);
}

// where the training graph's time went: per op kind, then the ten costliest nodes
static void print_profile(const ql_graph *g) {
    std::vector<double> by_op(QL_OP_COUNT, 0.0);
    std::vector<std::pair<double, int>> nodes;
    double total = 0;
    for (int i = 0; i < ql_graph_n_nodes(g); i++) {
        const double s = ql_graph_node_seconds(g, i);
        by_op[ql_graph_node(g, i)->op] += s;
        nodes.push_back({s, i});
        total += s;
    }
    if (total <= 0) return;
    printf("finetune: profile of the training graph (%d nodes, %.3f s in all):\n", ql_graph_n_nodes(g), total);
    std::vector<int> ops;
    for (int o = 0; o < QL_OP_COUNT; o++)
        if (by_op[(size_t)o] > 0) ops.push_back(o);
    std::sort(ops.begin(), ops.end(), [&](int x, int y) { return by_op[(size_t)x] > by_op[(size_t)y]; });
    for (int o : ops) printf("  %-22s %6.1f%%\n", ql_op_name((ql_op)o), 100 * by_op[(size_t)o] / total);
    std::sort(nodes.rbegin(), nodes.rend());
    printf("  costliest nodes:\n");
    for (size_t k = 0; k < nodes.size() && k < 10; k++) {
        const ql_tensor *n = ql_graph_node(g, nodes[k].second);
        printf("  %6.1f%%  %-14s %s [%lld, %lld, %lld]\n", 100 * nodes[k].first / total, ql_op_name(n->op), n->name,
               (long long)n->ne[0], (long long)n->ne[1], (long long)n->ne[2]);
    }
}

static bool same_dir(const std::string &a, const char *b) {
    if (!b) return false;
    char ra[PATH_MAX], rb[PATH_MAX];
    return realpath(a.c_str(), ra) && realpath(b, rb) && !strcmp(ra, rb);
}

struct args {
    const char *model = nullptr, *data = nullptr, *val_data = nullptr, *resume = nullptr, *chat = nullptr;
    std::string out = "finetune-out";
    bool out_given = false;
    ql_train_options o;
    ql_data_options d;
    double val_split = 0;
    int64_t eval_every = 0, save_every = 0;
    bool merge = false, overwrite = false, profile = false;
};

// one flag with its value; false (after a one-line message) on anything malformed
static bool parse(int argc, char **argv, args *a) {
    auto need = [&](int &i) -> const char * {
        if (i + 1 >= argc) {
            fprintf(stderr, "finetune: %s needs a value\n", argv[i]);
            return nullptr;
        }
        return argv[++i];
    };
    auto num = [&](const char *flag, const char *s, double lo, double hi, double *v) {
        char *end = nullptr;
        *v = s ? strtod(s, &end) : NAN;
        if (!s || !end || *end || !std::isfinite(*v) || *v < lo || *v > hi) {
            if (s) fprintf(stderr, "finetune: %s: '%s' is not a number in [%g, %g]\n", flag, s, lo, hi);
            return false;
        }
        return true;
    };
    auto whole = [&](const char *flag, const char *s, double lo, double hi, double *v) {  // integer flags
        if (!num(flag, s, lo, hi, v)) return false;
        if (*v != std::floor(*v)) {
            fprintf(stderr, "finetune: %s: '%s' is not a whole number\n", flag, s);
            return false;
        }
        return true;
    };
    for (int i = 1; i < argc; i++) {
        const std::string f = argv[i];
        double v = 0;
        const char *s = nullptr;
        if (f == "-h" || f == "--help") {
            printf(k_help, argv[0]);
            exit(0);
        } else if (f == "-m") { if (!(a->model = need(i))) return false; }
        else if (f == "-d") { if (!(a->data = need(i))) return false; }
        else if (f == "-o") { if (!(s = need(i))) return false; a->out = s; a->out_given = true; }
        else if (f == "--val-data") { if (!(a->val_data = need(i))) return false; }
        else if (f == "--resume") { if (!(a->resume = need(i))) return false; }
        else if (f == "--chat-template") { if (!(a->chat = need(i))) return false; }
        else if (f == "--lora-targets") {
            if (!(s = need(i))) return false;
            a->o.lora.targets.clear();
            std::string list = s;
            if (list == "all") list = "q,k,v,o,gate,up,down";
            for (size_t p = 0; p <= list.size();) {
                const size_t c = std::min(list.find(',', p), list.size());
                const std::string t = list.substr(p, c - p);
                if (!ql_lora_target_valid(t)) {
                    fprintf(stderr, "finetune: --lora-targets: unknown target '%s' (q, k, v, o, gate, up, down, or all)\n", t.c_str());
                    return false;
                }
                if (std::find(a->o.lora.targets.begin(), a->o.lora.targets.end(), t) == a->o.lora.targets.end())
                    a->o.lora.targets.push_back(t);
                p = c + 1;
            }
        }
        else if (f == "--lora-r") { if (!whole(f.c_str(), need(i), 1, 4096, &v)) return false; a->o.lora.r = (int)v; }
        else if (f == "--lora-alpha") { if (!num(f.c_str(), need(i), 1e-6, 1e6, &v)) return false; a->o.lora.alpha = (float)v; }
        else if (f == "--lora-dropout") { if (!num(f.c_str(), need(i), 0, 0.999, &v)) return false; a->o.lora.dropout = (float)v; }
        else if (f == "--rslora") a->o.lora.rslora = true;
        else if (f == "--seq-len") { if (!whole(f.c_str(), need(i), 2, 1 << 20, &v)) return false; a->d.seq_len = (int)v; }
        else if (f == "--pack") a->d.pack = true;
        else if (f == "--skip-bad-lines") a->d.skip_bad_lines = true;
        else if (f == "--no-eos") a->d.add_eos = false;
        else if (f == "--val-split") { if (!num(f.c_str(), need(i), 0, 0.9, &v)) return false; a->val_split = v; }
        else if (f == "--eval-every") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->eval_every = (int64_t)v; }
        else if (f == "-b") { if (!whole(f.c_str(), need(i), 1, 4096, &v)) return false; a->o.micro_batch = (int)v; }
        else if (f == "--grad-accum") { if (!whole(f.c_str(), need(i), 1, 1 << 20, &v)) return false; a->o.grad_accum = (int)v; }
        else if (f == "--lr") { if (!num(f.c_str(), need(i), 0, 10, &v)) return false; a->o.lr = (float)v; }
        else if (f == "--beta1") { if (!num(f.c_str(), need(i), 0, 0.999999, &v)) return false; a->o.beta1 = (float)v; }
        else if (f == "--beta2") { if (!num(f.c_str(), need(i), 0, 0.999999, &v)) return false; a->o.beta2 = (float)v; }
        else if (f == "--eps") { if (!num(f.c_str(), need(i), 0, 1, &v)) return false; a->o.eps = (float)v; }
        else if (f == "--weight-decay") { if (!num(f.c_str(), need(i), 0, 10, &v)) return false; a->o.weight_decay = (float)v; }
        else if (f == "--lr-scheduler") {
            if (!(s = need(i))) return false;
            a->o.scheduler = s;
            if (a->o.scheduler != "constant" && a->o.scheduler != "constant_with_warmup" && a->o.scheduler != "linear" &&
                a->o.scheduler != "cosine") {
                fprintf(stderr, "finetune: --lr-scheduler: '%s' (constant, constant_with_warmup, linear, cosine)\n", s);
                return false;
            }
        }
        else if (f == "--warmup-ratio") { if (!num(f.c_str(), need(i), 0, 1, &v)) return false; a->o.warmup_ratio = v; }
        else if (f == "--warmup-steps") { if (!whole(f.c_str(), need(i), 0, 1e12, &v)) return false; a->o.warmup_steps = (int64_t)v; }
        else if (f == "--max-grad-norm") { if (!num(f.c_str(), need(i), 0, 1e6, &v)) return false; a->o.max_grad_norm = (float)v; }
        else if (f == "--epochs") { if (!whole(f.c_str(), need(i), 1, 1e6, &v)) return false; a->o.epochs = (int)v; }
        else if (f == "--max-steps") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->o.max_steps = (int64_t)v; }
        else if (f == "--seed") { if (!whole(f.c_str(), need(i), 0, 9e15, &v)) return false; a->o.seed = (uint64_t)v; a->o.lora.init_seed = a->o.seed; }
        else if (f == "-t") { if (!whole(f.c_str(), need(i), 0, 1024, &v)) return false; a->o.threads = (int)v; }
        else if (f == "--save-every") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->save_every = (int64_t)v; }
        else if (f == "--merge") a->merge = true;
        else if (f == "--overwrite") a->overwrite = true;
        else if (f == "--profile") a->profile = true;
        else {
            fprintf(stderr, "finetune: unknown flag '%s' (see --help)\n", argv[i]);
            return false;
        }
    }
    if (!a->model || !a->data) {
        fprintf(stderr, "finetune: -m model.gguf and -d data.jsonl are required (see --help)\n");
        return false;
    }
    if (a->val_data && a->val_split > 0) {
        fprintf(stderr, "finetune: --val-split and --val-data are alternatives\n");
        return false;
    }
    return true;
}

int main(int argc, char **argv) {
    args a;
    if (!parse(argc, argv, &a)) return 2;
    const bool tty = isatty(fileno(stdout));
    std::string err;
    char e[512];

    // ---- the model, its vocabulary, the data ----
    ql_llama_file *f = ql_llama_load(a.model, e, sizeof(e));
    if (!f) {
        fprintf(stderr, "finetune: %s\n", e);
        return 1;
    }
    ql_vocab *vocab = ql_vocab_load(f->gguf, e, sizeof(e));
    if (!vocab) {
        fprintf(stderr, "finetune: %s\n", e);
        return 1;
    }
    if (a.chat) {
        a.d.chat = ql_chat_template_from_name(a.chat);
        if (a.d.chat == QL_CHAT_COUNT) {
            fprintf(stderr, "finetune: --chat-template: unknown template '%s' (llama3, chatml, llama2, phi3, gemma, zephyr)\n", a.chat);
            return 2;
        }
    } else {
        size_t len;
        const int64_t ic = ql_gguf_find_kv(f->gguf, "tokenizer.chat_template");
        const char *jinja = ic >= 0 ? ql_gguf_get_str(f->gguf, ic, &len) : nullptr;
        a.d.chat = jinja ? ql_chat_template_detect(jinja) : QL_CHAT_NONE;
    }
    a.d.add_bos = ql_vocab_bos(vocab) >= 0 && ql_vocab_add_bos(vocab);  // as generate tokenizes prompts
    ql_dataset train, eval;
    if (!ql_dataset_load(a.data, vocab, a.d, &train, &err) ||
        (a.val_data && !ql_dataset_load(a.val_data, vocab, a.d, &eval, &err))) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return 1;
    }
    if (train.n_bad > 0)
        fprintf(stderr, "finetune: warning: skipped %lld bad line%s of %s; the first: %s\n", (long long)train.n_bad,
                train.n_bad == 1 ? "" : "s", a.data, err.c_str());
    if (a.val_split > 0) ql_dataset_split(&train, a.val_split, a.o.seed, &eval);
    if (train.examples.empty()) {
        fprintf(stderr, "finetune: %s: no usable training examples (%lld lines, %lld bad, %lld with nothing to learn)\n", a.data,
                (long long)train.n_lines, (long long)train.n_bad, (long long)train.n_empty);
        return 1;
    }
    const int32_t pad = ql_vocab_pad(vocab) >= 0 ? ql_vocab_pad(vocab) : std::max(0, ql_vocab_eos(vocab));
    std::vector<ql_sequence> tseq, eseq;
    ql_dataset_sequences(train, a.d, pad, &tseq);
    ql_dataset_sequences(eval, a.d, pad, &eseq);
    a.o.packed = a.d.pack;

    const std::string out = a.resume && !a.out_given ? std::string(a.resume) : a.out;
    struct stat st;
    if (!a.overwrite && !same_dir(out, a.resume) && stat((out + "/checkpoint.gguf").c_str(), &st) == 0) {
        fprintf(stderr, "finetune: %s already holds a run (checkpoint.gguf): --resume %s continues it, --overwrite replaces it, "
                "or choose another -o\n", out.c_str(), out.c_str());
        return 1;
    }

    // ---- the trainer: everything sized, planned and allocated before step one ----
    const auto t_build = std::chrono::steady_clock::now();
    ql_trainer *t = ql_trainer_new(f, tseq, eseq, a.o, &err);
    if (!t) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return 1;
    }
    if ((a.resume && !ql_trainer_load(t, (std::string(a.resume) + "/checkpoint.gguf").c_str(), &err)) ||
        !make_dir(out, &err) || !make_dir(out + "/peft", &err)) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return 1;
    }

    const ql_llama_hparams &hp = f->model.hp;
    const int64_t total = ql_trainer_total_steps(t), per_epoch = ql_trainer_steps_per_epoch(t);
    int64_t n_targets = 0;
    for (const ql_sequence &s : tseq) n_targets += s.n_targets;
    const ql_plan_stats &ps = ql_trainer_plan(t);
    auto mib = [](size_t b) { return (double)b / 1048576.0; };
    printf("finetune: model %s: %s, %d layers, dim %d, %d/%d heads, ffn %d, vocab %d, %s weights %.1f MiB\n", a.model,
           f->arch.c_str(), hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab,
           ql_type_name(f->model.layers[0].wq->type), mib(ps.bytes[QL_MEM_WEIGHTS]));
    printf("finetune: data %s: %lld lines (text %lld, prompt/completion %lld, messages %lld, alpaca %lld), %lld bad, "
           "%lld truncated to %d tokens, %lld with nothing to learn\n",
           a.data, (long long)train.n_lines, (long long)train.n_per_format[0], (long long)train.n_per_format[1],
           (long long)train.n_per_format[2], (long long)train.n_per_format[3], (long long)train.n_bad,
           (long long)train.n_truncated, a.d.seq_len, (long long)train.n_empty);
    printf("finetune: %zu training sequences (%s), %lld supervised tokens; %zu evaluation sequences\n", tseq.size(),
           a.d.pack ? "packed" : "one example each", (long long)n_targets, eseq.size());
    printf("finetune: micro-batch %d x accumulation %d = effective batch %d sequences; %lld steps (%lld per epoch)%s\n",
           a.o.micro_batch, a.o.grad_accum, a.o.micro_batch * a.o.grad_accum, (long long)total, (long long)per_epoch,
           ql_trainer_steps_done(t) ? (", resuming after step " + std::to_string(ql_trainer_steps_done(t))).c_str() : "");
    printf("finetune: LoRA r %d, alpha %g%s, dropout %g on", a.o.lora.r, (double)a.o.lora.alpha, a.o.lora.rslora ? " (rsLoRA)" : "",
           (double)a.o.lora.dropout);
    for (const std::string &x : a.o.lora.targets) printf(" %s", x.c_str());
    printf("; AdamW lr %g (%s, warmup %lld steps), weight decay %g, max grad norm %g\n", (double)a.o.lr,
           a.o.scheduler.c_str(), (long long)ql_trainer_warmup_steps(t),
           (double)a.o.weight_decay, (double)a.o.max_grad_norm);
    printf("%s\n", ql_trainable_line(ql_trainer_n_trainable(t), ql_trainer_n_base(t)).c_str());
    printf("finetune: memory plan: base weights %.1f MiB, adapter + gradients + AdamW %.1f MiB, inputs %.2f MiB, "
           "saved activations %.1f MiB, scratch %.1f MiB, kernel workspace %.1f MiB; total %.1f MiB (planned in %.2f s)\n",
           mib(ps.bytes[QL_MEM_WEIGHTS]), mib(ql_trainer_state_bytes(t)), mib(ps.bytes[QL_MEM_INPUTS]),
           mib(ps.bytes[QL_MEM_SAVED]), mib(ps.bytes[QL_MEM_SCRATCH]), mib(ps.bytes[QL_MEM_WORK]),
           mib(ps.total + ql_trainer_state_bytes(t) / 2),  // plan counts params + grads; add the moments
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t_build).count());
    fflush(stdout);

    if (a.profile) ql_graph_set_profile(ql_trainer_graph(t), true);

    // ---- the loop ----
    signal(SIGINT, on_sigint);
    std::vector<std::pair<double, double>> curve, eval_curve;
    std::string kept;  // on resume: the metrics of the steps the checkpoint holds (later ones are redone)
    if (a.resume) keep_metrics(std::string(a.resume) + "/metrics.jsonl", ql_trainer_steps_done(t), &kept, &curve, &eval_curve);
    // the kept history goes in whole (temp file, rename) before new lines are appended
    const std::string mpath = out + "/metrics.jsonl", mtmp = mpath + ".tmp";
    FILE *metrics = fopen(mtmp.c_str(), "w");
    const bool mok = metrics && fputs(kept.c_str(), metrics) >= 0 && fflush(metrics) == 0 && fsync(fileno(metrics)) == 0;
    if (metrics) fclose(metrics);
    metrics = mok && rename(mtmp.c_str(), mpath.c_str()) == 0 ? fopen(mpath.c_str(), "a") : nullptr;
    if (!metrics) {
        fprintf(stderr, "finetune: %s: cannot write: %s\n", mpath.c_str(), strerror(errno));
        return 1;
    }
    const int64_t eval_every = a.eval_every > 0 ? a.eval_every : std::max<int64_t>(1, total / 10);
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t first = ql_trainer_steps_done(t);
    double last_loss = NAN, last_eval = NAN, tok_s = 0;
    int64_t tokens = 0;
    auto save_checkpoint = [&]() {
        if (!ql_trainer_save(t, (out + "/checkpoint.gguf").c_str(), &err)) {
            fprintf(stderr, "\nfinetune: %s\n", err.c_str());
            return false;
        }
        return true;
    };
    if (!eseq.empty() && first == 0) {  // where the run starts from
        if (!ql_trainer_eval(t, &last_eval, &err)) {
            fprintf(stderr, "finetune: %s\n", err.c_str());
            return 1;
        }
        eval_curve.push_back({0.0, last_eval});
        fprintf(metrics, "{\"step\": 0, \"eval_loss\": %.6f}\n", last_eval);
        printf("finetune: eval loss before training %.4f\n", last_eval);
        fflush(stdout);
    }
    bool interrupted = false;
    while (ql_trainer_steps_done(t) < total) {
        ql_step_metrics m;
        if (!ql_trainer_step(t, &m, &err)) {
            fprintf(stderr, "\nfinetune: %s\n", err.c_str());
            return 1;
        }
        tokens += m.tokens;
        const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        tok_s = (double)tokens / std::max(el, 1e-9);
        last_loss = m.loss;
        curve.push_back({(double)m.step, m.loss});
        bool evaluated = false;
        if (!eseq.empty() && (m.step % eval_every == 0 || m.step == total)) {
            if (!ql_trainer_eval(t, &last_eval, &err)) {
                fprintf(stderr, "\nfinetune: %s\n", err.c_str());
                return 1;
            }
            eval_curve.push_back({(double)m.step, last_eval});
            evaluated = true;
        }
        fprintf(metrics, "{\"step\": %lld, \"loss\": %.6f", (long long)m.step, m.loss);
        if (evaluated) fprintf(metrics, ", \"eval_loss\": %.6f", last_eval);
        fprintf(metrics,
                ", \"lr\": %.6g, \"grad_norm\": %.6f, \"step_seconds\": %.4f, \"tokens_per_s\": %.1f, \"mem_mib\": %.1f, "
                "\"peak_mib\": %.1f}\n",
                m.lr, m.grad_norm, m.seconds, tok_s, rss_mib(), peak_rss_mib());
        fflush(metrics);
        const double eta = (double)(total - m.step) * el / (double)std::max<int64_t>(1, m.step - first);
        char line[256];
        snprintf(line, sizeof(line), "step %lld/%lld  loss %.4f%s  lr %.2e  %.0f tok/s  mem %.0f MiB  ETA %s",
                 (long long)m.step, (long long)total, m.loss,
                 std::isnan(last_eval) ? "" : ("  eval " + std::to_string(last_eval).substr(0, 6)).c_str(), m.lr, tok_s,
                 rss_mib(), hms(eta).c_str());
        if (tty)
            printf("\r%-110s", line);
        else if (m.step == first + 1 || m.step % std::max<int64_t>(1, total / 20) == 0 || m.step == total || evaluated)
            printf("%s\n", line);
        fflush(stdout);
        if (a.save_every > 0 && m.step % a.save_every == 0 && !save_checkpoint()) return 1;
        if (g_stop.load()) {
            interrupted = true;
            break;
        }
    }
    if (tty) printf("\n");
    signal(SIGINT, SIG_DFL);  // from here on every file is written atomically: Ctrl-C loses nothing

    // ---- outputs ----
    if (!save_checkpoint()) return 1;
    if (interrupted) {
        printf("finetune: interrupted after step %lld: checkpoint saved in %s --> resume with --resume %s\n",
               (long long)ql_trainer_steps_done(t), out.c_str(), out.c_str());
        return 0;
    }
    ql_lora_config c;
    c.r = a.o.lora.r;
    c.alpha = a.o.lora.alpha;
    c.dropout = a.o.lora.dropout;
    c.rslora = a.o.lora.rslora;
    for (const std::string &x : a.o.lora.targets) c.targets.push_back(x == "o" ? "o_proj" : x + "_proj");
    {  // PEFT loads base_model_name_or_path from the Hub: only a repository the GGUF names will do
        size_t len;
        const int64_t ik = ql_gguf_find_kv(f->gguf, "general.source.huggingface.repository");
        const char *repo = ik >= 0 ? ql_gguf_get_str(f->gguf, ik, &len) : nullptr;
        c.base_model = repo ? repo : "";
    }
    ql_llama &m = ql_trainer_model(t);
    if (!ql_lora_save_gguf((out + "/adapter.gguf").c_str(), m, f->arch.c_str(), c, &err) ||
        !ql_peft_save((out + "/peft").c_str(), m, f->arch.c_str(), c, &err) ||
        (a.merge && !ql_llama_save_merged((out + "/merged.gguf").c_str(), *f, m, &err))) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return 1;
    }
    if (!ql_plot_losses((out + "/loss.png").c_str(), curve, eval_curve, &err)) fprintf(stderr, "finetune: note: %s\n", err.c_str());
    fclose(metrics);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (ql_trainer_steps_done(t) == first)
        printf("finetune: the checkpoint had finished all %lld steps; outputs written again", (long long)first);
    else
        printf("finetune: done: %lld steps in %s, %.0f tokens/s; final loss %.4f", (long long)ql_trainer_steps_done(t),
               hms(secs).c_str(), tok_s, last_loss);
    if (!std::isnan(last_eval)) printf(", eval loss %.4f", last_eval);
    printf("; peak memory %.0f MiB\n", peak_rss_mib());
    printf("finetune: wrote %s/adapter.gguf, %s/peft/, %s/metrics.jsonl, %s/loss.png, %s/checkpoint.gguf%s\n", out.c_str(),
           out.c_str(), out.c_str(), out.c_str(), out.c_str(), a.merge ? (", " + out + "/merged.gguf").c_str() : "");
    if (a.profile) print_profile(ql_trainer_graph(t));
    ql_trainer_free(t);
    ql_vocab_free(vocab);
    ql_llama_file_free(f);
    return 0;
}
