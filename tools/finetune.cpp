// tools/finetune - LoRA fine-tuning of a GGUF llama on a JSONL file.
//
//   ./finetune -m model.gguf -d data.jsonl [-o DIR] [options]     (./finetune --help lists them)
//
// Writes into DIR: adapter.gguf (llama.cpp's LoRA format), peft/ (adapter_config.json +
// adapter_model.safetensors), metrics.jsonl, loss.png, checkpoint.gguf (every --save-every steps
// and at the end, atomically), and merged.gguf with --merge. --resume DIR continues a run
// exactly (the checkpoint stores the command: DIR alone is enough); --export DIR writes the
// adapter of an interrupted run; Ctrl-C, SIGTERM and SIGHUP save a checkpoint and exit 128+signal.
//
// Data parallel (built with make MPI=1): `mpirun -np N ./finetune ...` runs N processes, each with
// the model and the data, each computing --grad-accum micro-batches of every step: the run of one
// process with N x --grad-accum (models/trainer.h). Rank 0 alone prints and writes (metrics,
// adapter, checkpoints); a rank that fails stops the job (ql_dist_abort) naming itself and the
// cause; the checkpoint stores the effective accumulation, which --resume divides among however
// many processes it runs with. QLORA_DIST_FAIL=RANK:STEP[:kill|:term] makes a rank fail (an error,
// or SIGKILL) or get a SIGTERM as step STEP begins: how the tests stop one rank mid-run.
// QLORA_DIST_ALWAYS=1 makes each step's all-reduce in one process too (NCCL's check on one GPU).
#include "../models/adapter.h"
#include "../models/data.h"
#include "../models/trainer.h"
#include "own.h"
#include "plot.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <malloc.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

static std::atomic<int> g_stop{0};  // the signal that asked the run to stop, or 0
// data parallel (ql_dist_*): this process's rank and the job's processes; rank 0 is the writer
static int g_rank = 0, g_world = 1;
static bool writer() { return g_rank == 0; }
static std::string g_cause;  // a failed run's message, for the line that stops the other ranks
// SIGINT (Ctrl-C), SIGTERM (kill, timeout, job schedulers, containers) and SIGHUP (a closed
// terminal): the first ends the run after the current step with a checkpoint saved, and the
// process exits 128 + the signal so that `finetune && next` does not go on; a second one kills -
// but for a repeat of the first SIGTERM or SIGHUP: GNU timeout sends its TERM to the child and
// again to its process group, and a closed terminal's HUP can come twice; those must not kill
// the run it asked to save (SIGKILL is what kills a run that will not stop)
static const int k_stop_signals[] = {SIGINT, SIGTERM, SIGHUP};
static void on_stop_signal(int sig) {
    int none = 0;
    if (g_stop.compare_exchange_strong(none, sig)) {  // the first: say so now, the step may take seconds
        // (write(2): async-signal-safe, unlike stdio)
        static const char k_msg[] = "\nfinetune: stopping after this step; a checkpoint will be saved (Ctrl-C again kills)\n";
        static const char k_msg_term[] = "\nfinetune: stopping after this step; a checkpoint will be saved\n";
        if (sig == SIGINT) {
            if (write(STDERR_FILENO, k_msg, sizeof(k_msg) - 1) < 0) {}
        } else if (write(STDERR_FILENO, k_msg_term, sizeof(k_msg_term) - 1) < 0) {}
    }
    const int first = g_stop.load();
    for (int s : k_stop_signals) signal(s, s == first && first != SIGINT ? on_stop_signal : SIG_DFL);
}

static const char *k_help =
    "usage: %s -m model.gguf -d data.jsonl [-o DIR] [options]\n"
    "LoRA:      --lora-targets q,k,v,o|all|LIST  --lora-r 16  --lora-alpha 32  --lora-dropout 0.05  --rslora\n"
    "data:      --seq-len 512  --pack  --chat-template NAME  --skip-bad-lines  --no-eos\n"
    "           --group-by-length (micro-batches of similar lengths)  --no-dynamic-padding (pad every micro-batch\n"
    "           to --seq-len, not to its longest sequence)\n"
    "           --val-split F | --val-data FILE  --eval-every N\n"
    "trainer:   -b 4  --grad-accum 1  --lr 2e-4  --beta1 0.9  --beta2 0.999  --eps 1e-8  --weight-decay 0\n"
    "           --lr-scheduler constant|constant_with_warmup|linear|cosine  --warmup-ratio 0  --warmup-steps N\n"
    "           --max-grad-norm 1.0  --optim adamw|adamw8bit|paged_adamw|paged_adamw8bit\n"
    "           --epochs 1  --max-steps N  --seed 42  -t THREADS  --profile (time per op, printed at the end)\n"
    "device:    --device cpu|cuda|cuda:N|auto (auto: cuda when built with it and a GPU is present, else cpu)\n"
    "precision: --precision auto|fp32|bf16|fp16 (auto, the default: on a GPU bf16 from compute capability 8.0, else fp16;\n"
    "           on the CPU bf16 where it multiplies it natively (AMX, AVX512-BF16), else fp32)\n"
    "           fp16's loss scaling: --loss-scale-init 65536  --loss-scale-growth 2  --loss-scale-backoff 0.5\n"
    "           --loss-scale-interval 2000\n"
    "           --ffn-down-f32 (with a 16-bit type: the FFN past gate and up, the down projection and its LoRA in f32 -\n"
    "           fp16's guard where a SwiGLU result passes 65504; the hint names it when that happens)\n"
    "memory:    --checkpointing none|block|sqrt|auto  --mem-limit SIZE (e.g. 6G; auto and -b auto need it, or a GPU)\n"
    "           (auto is the default when the limit is known - --mem-limit, --vram, a GPU's free memory: no recompute,\n"
    "           recompute, then on a GPU offload, --embd-on-host, paged optimizer state (these first with the feed-forward\n"
    "           whole, then again with it in chunks where needed), --offload-late, --offload-grads;\n"
    "           then with 16-bit compute and dropout --lora-dropout-fused 16: the first that fits)\n"
    "           -b auto  --effective-batch N  --offload-activations  --dry-run (print the plan, train nothing)  --json\n"
    "           --offload-late (offload, and each block's checkpoint brought back twice, just before its readers: none on\n"
    "           the device through a block's backward; the GPU may wait for those copies)\n"
    "           --offload-grads (--offload-late, and backward's large results that wait across a block's attention\n"
    "           backward - the residual gradient, the norm's 16-bit output - parked in pinned host memory meanwhile)\n"
    "           --lora-dropout-fused auto|off|on|16 (adapter dropout inside A's multiply: auto on the CPU, off on a GPU;\n"
    "           16 reads x's 16-bit copy: the least memory, x rounded twice; auto's last step when a limit needs it)\n"
    "           --loss-chunk N (tokens per output-projection + loss chunk; 0 auto, -1 never)  --loss-unfused (backward\n"
    "           recomputes each chunk's logits: the path before the fused head + loss, for comparisons)\n"
    "           --ffn-chunk N (tokens per feed-forward chunk: its intermediates a chunk at a time; 0 auto: when the plan\n"
    "           needs it, -1 never)\n"
    "           --attn-score-mib auto|N (a GPU: attention's backward as products over chunks of queries whose f32 scores\n"
    "           fit N MiB; auto: 64 where the plan fits with it and the chunks grow, else 32)\n"
    "           --attn-backward auto|fused|products (a GPU: attention's backward by the fused kernels or by those products;\n"
    "           auto: the faster on the card, one layer timed both ways at the start; a plan without the card: products)\n"
    "GPU:       --vram SIZE  --cc X.Y (with --dry-run on a machine without that card: its plan, e.g. --vram 12G --cc 8.6;\n"
    "           cc 7.5 to 12.0; sizes take a unit: K/M/G/T, powers of 1024, or B)\n"
    "           --embd-on-host | --embd-on-device (default: on the host only when the plan needs it)\n"
    "           --cache-weights on|off|auto (a copy of the frozen weights and the adapter in the compute type, so the products\n"
    "           need no dequantising or conversion; auto, the default: when the plan with it fits, the first thing given up)\n"
    "           --host-mem SIZE (with --dry-run: plan for a host with this much available memory, e.g. 128G)\n"
    "output:    -o DIR (default finetune-out)  --save-every N  --merge  --overwrite (replace a run in -o DIR)\n"
    "resume:    --resume DIR (continues the run in DIR with its own model, data and flags; more --max-steps or --epochs\n"
    "           extend a finished run)  --export DIR (writes DIR's adapter.gguf and peft/ from its checkpoint, no training)\n";

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

// what a run writes in -o DIR, its checkpoint first: guarded without --overwrite, removed with it
static const char *const k_run_outputs[] = {"checkpoint.gguf", "adapter.gguf", "peft/adapter_model.safetensors",
                                            "peft/adapter_config.json", "merged.gguf", "metrics.jsonl", "loss.png"};

static bool make_dir(const std::string &d, std::string *err) {
    if (mkdir(d.c_str(), 0755) == 0 || errno == EEXIST) {
        struct stat st;
        if (stat(d.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return true;
    }
    *err = d + ": cannot create the output directory: " + strerror(errno);
    return false;
}

// One run per output directory: an exclusive flock on DIR/.lock (released by the kernel when
// the process ends, however it ends), holding the owner's pid for the message.
static bool lock_dir(const std::string &d, std::string *err) {
    const std::string path = d + "/.lock";
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        *err = path + ": cannot create: " + strerror(errno);
        return false;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = {0};
        const ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
        close(fd);
        *err = d + ": another finetune" + (n > 0 ? std::string(" (pid ") + std::string(pid, strcspn(pid, "\n")) + ")" : "") +
               " is writing there now --> wait for it, or choose another -o";
        return false;
    }
    const std::string me = std::to_string((long long)getpid()) + "\n";
    if (ftruncate(fd, 0) != 0 || pwrite(fd, me.data(), me.size(), 0) != (ssize_t)me.size()) {}  // the pid is for the message only
    return true;  // fd stays open (and locked) for the life of the process
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

// where the training graph's time went: per op kind, the multiplies by shape, then the ten costliest nodes
// (c: the plan's census, made while the run's weights' copies existed - by the time the profile is
// printed the trainer has moved to the host and dropped them, and a census now would count tiles)
static void print_profile(const ql_graph *g, const ql_census &c, double runs) {  // runs: the graph's evaluations profiled
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
    if (c.nodes)  // per run, from the plan: what the time above paid for
        printf("  census per run: %lld launches (%lld ops), %.3f TFLOP executed (%.3f recomputed): %.1f TFLOP/s over the "
               "profiled time\n", (long long)c.launches, (long long)c.nodes, c.flops / 1e12, c.recompute_flops / 1e12,
               c.flops * runs / total / 1e12);
    std::vector<int> ops;
    for (int o = 0; o < QL_OP_COUNT; o++)
        if (by_op[(size_t)o] > 0) ops.push_back(o);
    std::sort(ops.begin(), ops.end(), [&](int x, int y) { return by_op[(size_t)x] > by_op[(size_t)y]; });
    for (int o : ops) printf("  %-22s %6.1f%%\n", ql_op_name((ql_op)o), 100 * by_op[(size_t)o] / total);
    // the multiplies by shape: where their time goes and at what rate (y = a^T b: M outputs, N
    // tokens, K inner; 'T' where a is a transposed view, e.g. a frozen weight's input gradient)
    std::map<std::string, std::pair<double, double>> mm;  // shape -> seconds, flops
    for (int i = 0; i < ql_graph_n_nodes(g); i++) {
        const ql_tensor *n = ql_graph_node(g, i);
        if (n->op != QL_OP_MUL_MAT) continue;
        const ql_tensor *a = n->src[0], *b = n->src[1];
        char key[160];
        snprintf(key, sizeof(key), "%lldx%lldx%lld%s %s.%s", (long long)n->ne[0], (long long)n->ne[1], (long long)a->ne[0],
                 n->ne[2] * n->ne[3] > 1 ? (" x" + std::to_string(n->ne[2] * n->ne[3])).c_str() : "",
                 ql_type_name(a->type), ql_type_name(b->type));
        std::string k = key;
        if (a->op == QL_OP_TRANSPOSE) k += " (a^T)";
        mm[k].first += ql_graph_node_seconds(g, i);
        mm[k].second += 2.0 * (double)ql_nelements(n) * (double)a->ne[0];
    }
    std::vector<std::pair<double, std::string>> mms;
    for (const auto &e : mm) mms.push_back({e.second.first, e.first});
    std::sort(mms.rbegin(), mms.rend());
    printf("  mul_mat by shape (M x N x K a.b: share of the graph, GFLOP/s):\n");
    for (size_t k = 0; k < mms.size() && k < 12; k++) {
        // (below 1 GFLOP/s - a tiny product, a loaded machine - 3 digits, not "0.0")
        const double rate = mms[k].first > 0 ? runs * mm[mms[k].second].second / mms[k].first / 1e9 : 0.0;
        printf(rate < 1 ? "  %6.1f%%  %-40s %7.3g\n" : "  %6.1f%%  %-40s %7.1f\n", 100 * mms[k].first / total, mms[k].second.c_str(), rate);
    }
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

// "6G", "512M", "1.5GiB", "6442450944B": K, M, G, T are powers of 1024, B is bytes. A unit is
// required ("--vram 8" would be 8 bytes); false with why on anything else.
static bool parse_size(const char *s, size_t *out, std::string *why) {
    char *end = nullptr;
    const double v = strtod(s, &end);
    *why = "is not a size";
    if (!end || end == s || !std::isfinite(v) || v <= 0) return false;
    std::string u = end;
    for (char &c : u) c = (char)toupper((unsigned char)c);
    if (u.empty()) {
        *why = "has no unit: K, M, G or T (powers of 1024), or B for bytes";
        return false;
    }
    if (u.size() >= 2 && u.substr(u.size() - 2) == "IB") u = u.substr(0, u.size() - 2);
    else if (u.size() >= 2 && u.back() == 'B') u.pop_back();
    else if (u == "B") u.clear();
    double m = 1;
    if (u == "K") m = 1024.0;
    else if (u == "M") m = 1048576.0;
    else if (u == "G") m = 1073741824.0;
    else if (u == "T") m = 1099511627776.0;
    else if (!u.empty()) return false;
    if (v * m < 1 || v * m > 1e18) return false;
    *out = (size_t)(v * m);
    return true;
}

// --cc: MAJOR.MINOR with one digit after the point ("8.6"), or the two or three digits nvcc's
// sm_86 uses ("86", "120"); 0 when it is neither
static int parse_cc(const char *s) {
    const size_t n = strlen(s), dot = strcspn(s, ".");
    if (n == 0 || strspn(s, "0123456789.") != n) return 0;
    if (dot == n) return n >= 2 && n <= 3 ? atoi(s) : 0;
    if (dot == 0 || dot > 2 || n != dot + 2) return 0;  // one digit after the point
    return atoi(s) * 10 + (s[dot + 1] - '0');
}

static size_t rss_bytes() { return (size_t)(rss_mib() * 1048576.0); }
static size_t hwm_bytes() { return (size_t)(peak_rss_mib() * 1048576.0); }
// Linux: the peak (VmHWM) starts again from the current size, so that the training peak is
// measured apart from loading's
static void reset_hwm() {
    if (FILE *f = fopen("/proc/self/clear_refs", "w")) {
        fputs("5", f);
        fclose(f);
    }
}

// The memory plan as a table (process: the bytes outside the trainer's plan, and how they
// were obtained) or as one JSON object.
// "bf16 1002.0, nf4 3433.8": bytes by weight type, in MiB
static std::string by_type_text(const std::vector<std::pair<std::string, size_t>> &v) {
    std::string types;
    for (const auto &x : v) {
        char b[64];
        snprintf(b, sizeof(b), "%s%s %.1f", types.empty() ? "" : ", ", x.first.c_str(), (double)x.second / 1048576.0);
        types += b;
    }
    return types;
}

static void print_device_memory(const ql_memory_plan &m, const std::string &optim, size_t process, size_t limit, bool json) {
    const double MiB = 1048576.0;
    process = ql_plan_process(m, process);
    const bool fits = limit == 0 || m.total <= limit;
    if (json) {
        printf("{\"device\": \"%s\", \"cc\": %d, \"weights\": {\"device\": %zu, \"by_type\": {", m.device_desc.c_str(), m.cc, m.dev_weights);
        for (size_t i = 0; i < m.dev_weights_by_type.size(); i++)
            printf("%s\"%s\": %zu", i ? ", " : "", m.dev_weights_by_type[i].first.c_str(), m.dev_weights_by_type[i].second);
        printf("}, \"embedding_in_host_memory\": %zu}, \"lora\": %zu, \"grads\": %zu, \"optimizer\": %zu, \"optimizer_name\": \"%s\", "
               "\"optimizer_in_host_memory\": %s, \"inputs_and_state\": %zu, \"saved_activations\": %zu, \"checkpoints\": %zu, \"temporaries\": %zu, "
               "\"recompute_peak\": %zu, \"workspace\": %zu, \"graph_buffer\": %zu, \"context\": %zu, \"rounding\": %zu, "
               "\"total\": %zu, \"limit\": %zu, \"fits\": %s, \"host\": {\"process\": %zu, \"planned\": %zu, \"embedding\": %zu, \"pinned\": %zu, \"rows\": %zu, \"parked\": %zu}, "
               "\"checkpointing\": \"%s\", \"recompute_fraction\": %.4f, \"micro_batch\": %d, \"loss_chunk\": %lld, \"ffn_chunk\": %lld, \"attn_chunk\": %lld, \"attn_scores\": \"%s\", \"attn_backward\": \"%s\", \"lora_dropout\": \"%s\", "
               "\"cache_weights\": {\"bytes\": %zu, \"copies_would_take\": %zu, \"choice\": \"%s\"}, \"census\": {\"nodes\": %lld, \"launches\": %lld, \"flops\": %.6g, \"recompute_flops\": %.6g, \"bytes\": {\"matmul\": %.6g, "
               "\"attention\": %.6g, \"loss\": %.6g, \"other\": %.6g}}}\n",
               m.host_embd, m.lora, m.grads, m.optimizer, optim.c_str(), m.optimizer_host ? "true" : "false", m.dev_state, m.saved, m.checkpoints, m.scratch, m.recompute,
               m.work, m.dev_buffer, m.dev_context, m.dev_rounding, m.total, limit, fits ? "true" : "false", process, m.host, m.host_embd, m.host_pinned, m.host_rows, m.host_parked,
               m.checkpointing.c_str(), m.recompute_fraction, m.micro_batch, (long long)m.loss_chunk, (long long)m.ffn_chunk, (long long)m.attn_chunk,
               m.attn_scores.c_str(), m.attn_backward.c_str(), m.lora_dropout.c_str(), m.dev_cache, m.cache_candidate, m.cache_weights.c_str(), (long long)m.census.nodes, (long long)m.census.launches, m.census.flops, m.census.recompute_flops,
               m.census.bytes[QL_CENSUS_MATMUL], m.census.bytes[QL_CENSUS_ATTENTION], m.census.bytes[QL_CENSUS_LOSS], m.census.bytes[QL_CENSUS_OTHER]);
        return;
    }
    const std::string types = by_type_text(m.dev_weights_by_type);
    printf("finetune: device memory plan (MiB), %s\n", m.device_desc.c_str());
    printf("  base weights, whole, as stored         %10.1f   %s\n", m.dev_weights / MiB, types.c_str());
    if (m.embd_on_host)
        printf("    (the token embedding stays in host memory: %.1f; the step's rows are gathered into pinned memory, %.1f, and copied in where\n"
               "    block 0 reads them)\n", m.host_embd / MiB, m.host_rows / MiB);
    printf("  LoRA parameters (fp32)                 %10.1f\n", m.lora / MiB);
    printf("  gradients (fp32)                       %10.1f\n", m.grads / MiB);
    printf("  optimizer state (%-20s %10.1f   %.2f bytes per parameter%s\n", (optim + ")").c_str(), m.optimizer / MiB,
           m.lora ? (double)m.optimizer / (double)(m.lora / 4) : 0.0,
           m.optimizer_host ? "; paged: pinned host memory, updated there by the GPU" : "");
    printf("  graph inputs                           %10.2f\n", (m.dev_state - std::min(m.dev_state, m.lora + m.grads + m.optimizer)) / MiB);
    printf("  saved activations (forward->backward)  %10.1f", m.saved / MiB);
    const size_t offloaded = m.host_pinned - std::min(m.host_pinned, m.host_rows + m.host_parked);
    if (m.checkpoints) printf("   of them block checkpoints %.1f", (m.checkpoints - std::min(m.checkpoints, offloaded)) / MiB);
    if (offloaded) printf("\n    offloaded: %.1f of checkpoints in pinned host memory, copied on a second stream", offloaded / MiB);
    if (m.host_parked) printf("\n    and %.1f of backward's gradients parked there across each attention's backward", m.host_parked / MiB);
    printf("\n  temporaries and recompute              %10.1f", m.scratch / MiB);
    if (m.recompute) printf("   recomputed results: at most %.1f at once", m.recompute / MiB);
    printf("\n  kernel workspace (dequant tiles, attn) %10.1f\n", m.work / MiB);
    printf("  weights' copies in the compute type    %10.1f   --cache-weights %s", m.dev_cache / MiB, m.cache_weights.c_str());
    if (!m.dev_cache && m.cache_candidate) printf("; they would take %.1f", m.cache_candidate / MiB);
    printf("\n");
    printf("  CUDA context + cuBLAS workspace        %10.1f   %s for cc %d.%d (the card's use is printed after step 1); of it the CUDA "
           "graph's executable %.1f (%lld B a launch, measured once)\n",
           m.dev_context / MiB, m.dev_context_estimated ? "an ESTIMATE (an H200's, as a bound)" : "measured", m.cc / 10, m.cc % 10,
           m.dev_graph / MiB, m.census.launches > 0 ? (long long)(m.dev_graph / (size_t)m.census.launches) : 0LL);
    char pages[48];
    snprintf(pages, sizeof(pages), "allocator rounding (%g MiB pages)", m.dev_granularity / MiB);
    printf("  %-38s %10.1f\n", pages, m.dev_rounding / MiB);
    printf("  total device memory                    %10.1f", m.total / MiB);
    if (limit) printf("   of %.1f: %s", limit / MiB, fits ? "fits" : "does NOT fit");
    printf("\n  host memory: process %.1f (RSS before training) + %.1f planned = %.1f", process / MiB, m.host / MiB,
           (process + m.host) / MiB);
    printf("\n    of it: the adapter's and moments' copies (checkpoints are written from them) %.1f", (m.lora + m.optimizer) / MiB);
    if (m.dist) printf(", the gradients packed for the all-reduce (data parallel) %.1f", m.dist / MiB);
    if (m.embd_on_host) printf(", the embedding's rows read from the model's mapping %.1f", m.weights / MiB);
    if (m.host_pinned) printf(", pinned %.1f (offloaded checkpoints, the embedding's rows)", m.host_pinned / MiB);
    printf("\n    (the model's pages go back to the kernel once copied to the device; the CUDA runtime's own host memory, its\n"
           "    kernels loaded on first use, is not planned)");
    printf("\n  checkpointing: %s", m.checkpointing.c_str());
    if (m.recompute_fraction > 0) printf("; recomputes %.0f%% of the forward FLOPs", 100 * m.recompute_fraction);
    if (m.loss_chunk) printf("\n  loss: output projection + cross-entropy in chunks of %lld tokens (logits never whole)%s", (long long)m.loss_chunk,
                             m.loss_fused ? "; fused: dlogits and dh made in forward" : "; backward recomputes the logits");
    if (m.ffn_chunk) printf("\n  feed-forward: in chunks of %lld tokens (its intermediates a chunk at a time)", (long long)m.ffn_chunk);
    if (!m.attn_backward.empty()) printf("\n  attention's backward: %s", m.attn_backward.c_str());
    if (m.attn_chunk && !m.attn_fused)
        printf("\n  attention's backward products: chunks of %lld queries (--attn-score-mib %s)", (long long)m.attn_chunk, m.attn_scores.c_str());
    if (!m.lora_dropout.empty()) printf("\n  adapter dropout: %s", m.lora_dropout.c_str());
    if (m.census.nodes) {  // what one micro-batch's graph costs there, from the plan (ql_graph_census)
        const ql_census &c = m.census;
        const double GB = 1e9;
        printf("\n  census, one micro-batch: %lld launches without CUDA graphs (%lld ops; with graphs one launch), %.2f TFLOP "
               "executed of which %.2f recomputed;\n    bytes read and written: multiplies %.1f GB, attention %.1f, loss %.1f, "
               "the rest %.1f", (long long)c.launches, (long long)c.nodes, c.flops / 1e12, c.recompute_flops / 1e12,
               c.bytes[QL_CENSUS_MATMUL] / GB, c.bytes[QL_CENSUS_ATTENTION] / GB, c.bytes[QL_CENSUS_LOSS] / GB, c.bytes[QL_CENSUS_OTHER] / GB);
    }
    printf("\n");
    fflush(stdout);
}

// the memory a plan must fit: the process's (--mem-limit), or the device's (--vram or its free
// memory, and --mem-limit), the smaller; what the plan's total is compared with
static size_t plan_limit(const ql_memory_plan &m, size_t mem_limit) {
    if (!m.device) return mem_limit;
    return m.vram && mem_limit ? std::min(m.vram, mem_limit) : m.vram ? m.vram : mem_limit;
}
static size_t plan_total(const ql_memory_plan &m, size_t rss) { return (m.device ? 0 : ql_plan_process(m, rss)) + m.total; }

static void print_memory(const ql_memory_plan &m, const std::string &optim, size_t process, const char *process_how, size_t limit,
                         bool json) {
    if (m.device) return print_device_memory(m, optim, process, limit, json);
    const double MiB = 1048576.0;
    process = ql_plan_process(m, process);
    const size_t total = process + m.total;
    if (json) {
        printf("{\"weights\": {\"read\": %zu, \"read_already\": %zu, \"file\": %zu, \"by_type\": {", m.weights, m.weights_resident, m.weights_file);
        for (size_t i = 0; i < m.weights_by_type.size(); i++)
            printf("%s\"%s\": %zu", i ? ", " : "", m.weights_by_type[i].first.c_str(), m.weights_by_type[i].second);
        printf("}}, \"lora\": %zu, \"grads\": %zu, \"optimizer\": %zu, \"saved_activations\": %zu, \"checkpoints\": %zu, "
               "\"checkpoints_in_host_memory\": %s, \"optimizer_name\": \"%s\", \"optimizer_in_host_memory\": %s, \"temporaries\": %zu, \"recompute_peak\": %zu, \"workspace\": %zu, "
               "\"inputs\": %zu, \"graph\": %zu, \"graph_heap\": %zu, \"reserve\": %zu, \"process\": %zu, \"total\": %zu, \"limit\": %zu, \"fits\": %s, "
               "\"checkpointing\": \"%s\", \"recompute_fraction\": %.4f, \"micro_batch\": %d}\n",
               m.lora, m.grads, m.optimizer, m.saved, m.checkpoints, m.offload ? "true" : "false", optim.c_str(), m.optimizer_host ? "true" : "false", m.scratch, m.recompute, m.work,
               m.inputs, m.headers, m.graph_heap, m.reserve, process, total, limit, limit == 0 || total <= limit ? "true" : "false",
               m.checkpointing.c_str(), m.recompute_fraction, m.micro_batch);
        return;
    }
    const std::string types = by_type_text(m.weights_by_type);
    printf("finetune: memory plan (MiB)\n");
    printf("  base weights, pages read               %10.1f   %s; %.1f in the file", m.weights / MiB, types.c_str(), m.weights_file / MiB);
    if (m.weights_resident) printf("; %.1f read already (not in the process's line)", m.weights_resident / MiB);
    printf("\n");
    printf("  LoRA parameters (fp32)                 %10.1f\n", m.lora / MiB);
    printf("  gradients (fp32)                       %10.1f\n", m.grads / MiB);
    printf("  optimizer state (%-20s %10.1f   %.2f bytes per parameter%s\n", (optim + ")").c_str(), m.optimizer / MiB,
           m.lora ? (double)m.optimizer / (double)(m.lora / 4) : 0.0, m.optimizer_host ? "; paged: host memory" : "");
    printf("  saved activations (forward->backward)  %10.1f", m.saved / MiB);
    if (m.checkpoints) printf("   of them block checkpoints %.1f%s", m.checkpoints / MiB, m.offload ? " (host memory)" : "");
    printf("\n  temporaries and recompute              %10.1f", m.scratch / MiB);
    if (m.recompute) printf("   recomputed results: at most %.1f at once, in room the saved free", m.recompute / MiB);
    printf("\n  kernel workspace (matmul, attention)   %10.1f\n", m.work / MiB);
    printf("  data buffers (graph inputs)            %10.2f\n", m.inputs / MiB);
    if (m.dist) printf("  gradients packed for the all-reduce    %10.2f   (data parallel: host memory)\n", m.dist / MiB);
    printf("  graph structures                       %10.1f   tensor headers %.1f, the graphs' lists and plans %.1f\n",
           (m.headers + m.graph_heap) / MiB, m.headers / MiB, m.graph_heap / MiB);
    printf("  reserve (other heap, code pages)       %10.1f\n", m.reserve / MiB);
    printf("  process (%s)%*s%10.1f\n", process_how, std::max(0, 29 - (int)strlen(process_how)), "", process / MiB);
    printf("  total                                  %10.1f", total / MiB);
    if (limit) printf("   limit %.1f: %s", limit / MiB, total <= limit ? "fits" : "does NOT fit");
    if (m.offload)
        printf("\n    with --offload-activations: %.1f host + %.1f device (the CPU backend: one memory, nothing moves)",
               m.checkpoints / MiB, (total - m.checkpoints) / MiB);
    printf("\n  checkpointing: %s", m.checkpointing.c_str());
    if (m.recompute_fraction > 0) printf("; recomputes %.0f%% of the forward FLOPs", 100 * m.recompute_fraction);
    if (m.loss_chunk) printf("\n  loss: output projection + cross-entropy in chunks of %lld tokens (logits never whole)%s", (long long)m.loss_chunk,
                             m.loss_fused ? "; fused: dlogits and dh made in forward" : "; backward recomputes the logits");
    if (m.ffn_chunk) printf("\n  feed-forward: in chunks of %lld tokens (its intermediates a chunk at a time)", (long long)m.ffn_chunk);
    if (!m.lora_dropout.empty()) printf("\n  adapter dropout: %s", m.lora_dropout.c_str());
    printf("\n");
    fflush(stdout);  // before any message on stderr
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
    bool b_auto = false, dry_run = false, json = false;
    // the memory limit is known (--mem-limit, --vram, or a GPU's free memory): the tool fits the
    // run to it (choose_memory), --checkpointing auto the default
    bool limit_known = false, cp_default = false;
    int effective_batch = 0;  // 0: not asked for
    bool precision_auto = false;
    size_t host_mem = 0;      // --host-mem: the available host memory a plan assumes (0: this machine's)
    ql_device dev = {QL_DEVICE_AUTO, 0};  // --device, parsed once
    std::string device_text = "auto";     // as given, for messages
    int cc = 0;               // --cc: the card a stand-in plans for (0: 8.0 assumed)
    ql_backend *be = nullptr; // the backend --device made (resolve_device; main frees it)
    // --device cuda:0,cuda:1: a model split over cards (the first is dev, be); --vram A,B: one per card
    std::vector<ql_device> split_dev;
    std::vector<std::string> split_text;
    std::vector<ql_backend *> split_be;  // [1..] freed by run() (be is [0])
    std::vector<size_t> vram_list;
    bool plan_only = false;   // --vram/--cc --dry-run without the GPU: a stand-in plans for it
    std::string plan_line;    // which card it plans for
    std::string scaler_flag;  // a loss-scaling flag given (only fp16 has a scaler)
    const char *export_dir = nullptr;  // --export DIR: the adapter from DIR's checkpoint, no training
    // every flag as given, with its values (what a checkpoint stores for --resume DIR alone)
    std::vector<std::vector<std::string>> given;
    // the tool trains on a GPU when it has one, in the precision the hardware multiplies fastest
    args() { o.precision = ql_precision::automatic; }
};

// a flag's comma-separated values ("cuda:0,cuda:1", "24G,24G"); one value: itself
static std::vector<std::string> split_list(const char *s) {
    std::vector<std::string> v;
    const std::string str = s;
    for (size_t p = 0; p <= str.size();) {
        const size_t c = std::min(str.find(',', p), str.size());
        v.push_back(str.substr(p, c - p));
        p = c + 1;
    }
    return v;
}

// --device cuda:0,cuda:1: a backend per card (a stand-in for each card not here, with --dry-run),
// the trainer's split over them; --vram one size per card, or one for all
static bool resolve_split(args *a) {
    const size_t S = a->split_dev.size();
    if (g_world > 1) {
        fprintf(stderr, "finetune: --device %s: a model split over cards with several processes (data parallel): not supported "
                        "(v1) --> hint: one of the two\n", a->device_text.c_str());
        return false;
    }
    if (a->vram_list.size() > 1 && a->vram_list.size() != S) {
        fprintf(stderr, "finetune: --vram: %zu sizes for %zu cards (--device %s): one, or one per card\n", a->vram_list.size(), S,
                a->device_text.c_str());
        return false;
    }
    std::string missing;
    for (size_t i = 0; i < S; i++) {
        char err[256] = "";
        ql_backend *be = ql_backend_init_device(a->split_dev[i], a->o.threads, err, sizeof(err));
        if (!be && a->dry_run) {  // a card that is not here: its plan, by a stand-in
            missing += (missing.empty() ? "" : ", ") + a->split_text[i];
            if (!a->cc) a->cc = 80;
            char e2[256];
            be = ql_backend_init_planned(a->split_dev[i], a->cc, e2, sizeof(e2));
            if (!be) snprintf(err, sizeof(err), "%s", e2);
            else a->plan_only = true;
        }
        if (!be) {
            fprintf(stderr, "finetune: --device %s: %s: %s%s\n", a->device_text.c_str(), a->split_text[i].c_str(), err,
                    a->dry_run ? "" : " (--dry-run plans for cards that are not here)");
            return false;
        }
        a->split_be.push_back(be);
        if (i == 0) a->be = be;  // (run() frees it; the others by split_be)
        if (!ql_backend_is_host(be) && !missing.empty() && missing.find(a->split_text[i]) != std::string::npos) continue;
        char desc[320];
        ql_backend_describe(be, desc, sizeof(desc));
        printf("finetune: card %zu: %s\n", i, desc);
    }
    if (a->o.precision == ql_precision::automatic) {
        a->o.precision = ql_auto_precision(a->be);
        a->precision_auto = true;
    }
    a->o.backend = a->be;
    a->o.split = a->split_be;
    a->o.split_vram = a->vram_list;
    std::string mem;
    for (size_t i = 0; i < S; i++) {
        char b[64];
        const size_t v = a->vram_list.empty() ? 0 : a->vram_list[a->vram_list.size() == 1 ? 0 : i];
        snprintf(b, sizeof(b), "%s%s %s", i ? ", " : "", a->split_text[i].c_str(), v ? (std::to_string(v >> 20) + " MiB").c_str() : "(its free memory)");
        mem += b;
    }
    char line[768];
    const std::string planned = missing.empty() ? "" : "; not here, planned for compute capability " + std::to_string(a->cc / 10) + "." +
                                                           std::to_string(a->cc % 10) + ": " + missing;
    snprintf(line, sizeof(line), "finetune: a model split over %zu cards (%s)%s, precision %s\n", S, mem.c_str(), planned.c_str(),
             ql_name(a->o.precision));
    a->plan_line = line;
    return true;
}

// one flag with its value; false (after a one-line message) on anything malformed
// The device: refused here with its reason (no GPU, no CUDA in this build), described when a
// GPU. --vram/--cc with --dry-run on a machine without the GPU: a plan for that card.
static bool resolve_device(args *a) {
    if (!a->split_dev.empty()) return resolve_split(a);
    if (a->vram_list.size() > 1) {
        fprintf(stderr, "finetune: --vram: %zu sizes for one card: one size per card is for a split (--device cuda:0,cuda:1)\n",
                a->vram_list.size());
        return false;
    }
    char err[256];
    // a card this machine may not have: --vram/--cc, or a dry run of --device cuda
    const bool card = a->o.vram || a->cc || (a->dry_run && a->dev.kind == QL_DEVICE_GPU);
    if (card && a->dev.kind == QL_DEVICE_CPU) {
        fprintf(stderr, "finetune: --vram/--cc describe a GPU: with --device cuda (this run: --device cpu)\n");
        return false;
    }
    // data parallel: each process the GPU of its local rank (cuda and auto name none)
    if (g_world > 1 && (a->device_text == "cuda" || a->device_text == "auto") && ql_cuda_device_count() > 0)
        a->dev = {QL_DEVICE_GPU, ql_dist_local_rank() % ql_cuda_device_count()};
    ql_backend *be = ql_backend_init_device(a->dev, a->o.threads, err, sizeof(err));
    if (be && card && ql_backend_is_host(be) && a->dry_run) {  // --device auto found no GPU: --vram asks about one
        ql_backend_free(be);
        be = nullptr;
        snprintf(err, sizeof(err), "no CUDA device");
        a->dev = {QL_DEVICE_GPU, 0};
    }
    if (!be && card && a->dev.kind == QL_DEVICE_GPU) {
        if (!a->dry_run) {
            fprintf(stderr, "finetune: --device %s: %s (--vram/--cc with --dry-run plan for a card that is not here)\n",
                    a->device_text.c_str(), err);
            return false;
        }
        a->plan_only = true;
        const bool cc_given = a->cc != 0;
        if (!a->cc) a->cc = 80;
        char e2[256];
        if (!(be = ql_backend_init_planned(a->dev, a->cc, e2, sizeof(e2)))) {
            fprintf(stderr, "finetune: --device %s: %s\n", a->device_text.c_str(), e2);
            return false;
        }
        if (a->o.precision == ql_precision::automatic) {  // as on the card: bf16 where it has bf16 GEMM, else fp16 + loss scaling
            a->o.precision = ql_auto_precision(be);
            a->precision_auto = true;
        }
        const bool bf16 = a->o.precision == ql_precision::bf16;
        char mem[64] = "memory unknown (no --vram)";
        if (a->o.vram) snprintf(mem, sizeof(mem), "%.1f GiB", a->o.vram / 1073741824.0);
        char line[640];  // printed once the flags are all accepted
        snprintf(line, sizeof(line), "finetune: no CUDA device here (%s): planning for one with %s, compute capability %d.%d%s, precision %s%s\n",
               err, mem, a->cc / 10, a->cc % 10, cc_given ? "" : " (no --cc: assumed)", ql_name(a->o.precision),
               a->precision_auto ? (bf16 ? " (auto: bf16 from 8.0)" : " (auto: fp16 below 8.0, no bf16 GEMM there)") : "");
        a->plan_line = line;
        a->be = a->o.backend = be;
        return true;
    }
    if (!be) {
        fprintf(stderr, "finetune: --device %s: %s\n", a->device_text.c_str(), err);
        return false;
    }
    if (!ql_backend_is_host(be)) {
        char desc[320];
        ql_backend_describe(be, desc, sizeof(desc));
        printf("finetune: %s\n", desc);
    } else if (card) {
        fprintf(stderr, "finetune: --vram/--cc describe a GPU: with --device cuda (this run: --device cpu)\n");
        ql_backend_free(be);
        return false;
    }
    if (a->o.precision == ql_precision::automatic) {  // bf16 where the backend multiplies it natively
        a->o.precision = ql_auto_precision(be);
        a->precision_auto = true;
    }
    a->be = a->o.backend = be;
    return true;
}

// a bound as a user writes it: whole numbers in full (1048576, not 1.04858e+06), others as %g
static std::string plain(double v) {
    char b[48];
    if (v == std::floor(v) && std::fabs(v) < 1e16) snprintf(b, sizeof(b), "%.0f", v);
    else snprintf(b, sizeof(b), "%g", v);
    return b;
}

// --optim, --precision, --lr-scheduler, --checkpointing: the value by the trainer's one parser
template <class E> static bool choice_flag(const char *flag, const char *s, E *x) {
    std::string err;
    if (ql_parse(s, x, &err)) return true;
    fprintf(stderr, "finetune: %s: '%s' %s\n", flag, s, err.substr(err.find(" (") + 1).c_str());
    return false;
}

// a flag's value (s; nullptr when it had none, its message already given) as a number in
// [lo, hi]; false after a one-line message
static bool num(const char *flag, const char *s, double lo, double hi, double *v) {
    char *end = nullptr;
    *v = s ? strtod(s, &end) : NAN;
    if (!s || !end || end == s || *end || !std::isfinite(*v) || *v < lo || *v > hi) {  // ('' is no number, not 0)
        if (s) fprintf(stderr, "finetune: %s: '%s' is not a number in [%s, %s]\n", flag, s, plain(lo).c_str(), plain(hi).c_str());
        return false;
    }
    return true;
}
// the same for the integer flags: 1.5 is refused, not truncated
static bool whole(const char *flag, const char *s, double lo, double hi, double *v) {
    if (!num(flag, s, lo, hi, v)) return false;
    if (*v != std::floor(*v)) {
        fprintf(stderr, "finetune: %s: '%s' is not a whole number\n", flag, s);
        return false;
    }
    return true;
}

// --lora-targets q,k,...|all: the list, each once, in the order given; false after the message
static bool lora_targets_flag(const char *s, args *a) {
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
    return true;
}

// --mem-limit / --vram SIZE (parse_size; --vram not 0); false after the message, with examples
static bool size_flag(const char *flag, const char *s, const char *examples, bool nonzero, size_t *out) {
    std::string why;
    if (!parse_size(s, out, &why) || (nonzero && *out == 0)) {
        fprintf(stderr, "finetune: %s: '%s' %s (e.g. %s%s)\n", flag, s, why.c_str(), examples,
                why.find("unit") == std::string::npos ? "; K/M/G/T are powers of 1024" : "");
        return false;
    }
    return true;
}

// --cc "8.6" or "86", 7.5 to 12.0 (from 9.0 on the newest rules known, Hopper's, apply); false after the message
static bool cc_flag(const char *s, args *a) {
    const int cc = parse_cc(s);
    if (cc == 0) {
        fprintf(stderr, "finetune: --cc: '%s' is not a compute capability: MAJOR.MINOR with one digit after the point "
                        "(7.5 to 12.0, e.g. 8.6)\n", s);
        return false;
    }
    if (cc < 75 || cc > 120) {
        fprintf(stderr, "finetune: --cc: '%s' is not a compute capability qlora runs on (7.5 to 12.0, e.g. 8.6)\n", s);
        return false;
    }
    a->cc = cc;
    return true;
}

// The flags alone (what they say, not whether they make a run): false after a one-line message
static bool parse_flags(int argc, char **argv, args *a) {
    auto need = [&](int &i) -> const char * {
        if (i + 1 >= argc) {
            fprintf(stderr, "finetune: %s needs a value\n", argv[i]);
            return nullptr;
        }
        return argv[++i];
    };
    char e[256];
    for (int i = 1; i < argc; i++) {
        const std::string f = argv[i];
        double v = 0;
        const char *s = nullptr;
        const int first = i;
        struct record {  // the flag and the values it took, once parsed
            args *a; char **argv; const int &first, &i;
            ~record() {
                if (i >= first) a->given.emplace_back(argv + first, argv + i + 1);
            }
        } rec{a, argv, first, i};
        if (f == "-h" || f == "--help") {
            printf(k_help, argv[0]);
            ql_dist_free();
            exit(0);
        } else if (f == "-m") { if (!(a->model = need(i))) return false; }
        else if (f == "-d") { if (!(a->data = need(i))) return false; }
        else if (f == "-o") { if (!(s = need(i))) return false; a->out = s; a->out_given = true; }
        else if (f == "--val-data") { if (!(a->val_data = need(i))) return false; }
        else if (f == "--resume") { if (!(a->resume = need(i))) return false; }
        else if (f == "--export") { if (!(a->export_dir = need(i))) return false; }
        else if (f == "--chat-template") { if (!(a->chat = need(i))) return false; }
        else if (f == "--lora-targets") { if (!(s = need(i)) || !lora_targets_flag(s, a)) return false; }
        else if (f == "--lora-r") { if (!whole(f.c_str(), need(i), 1, 4096, &v)) return false; a->o.lora.r = (int)v; }
        else if (f == "--lora-alpha") { if (!num(f.c_str(), need(i), 1e-6, 1e6, &v)) return false; a->o.lora.alpha = (float)v; }
        else if (f == "--lora-dropout") { if (!num(f.c_str(), need(i), 0, 0.999, &v)) return false; a->o.lora.dropout = (float)v; }
        else if (f == "--rslora") a->o.lora.rslora = true;
        else if (f == "--seq-len") { if (!whole(f.c_str(), need(i), 2, 1 << 20, &v)) return false; a->d.seq_len = (int)v; }
        else if (f == "--pack") a->d.pack = true;
        else if (f == "--no-dynamic-padding") a->o.dynamic_padding = false;
        else if (f == "--group-by-length") a->o.group_by_length = true;
        else if (f == "--skip-bad-lines") a->d.skip_bad_lines = true;
        else if (f == "--no-eos") a->d.add_eos = false;
        else if (f == "--val-split") { if (!num(f.c_str(), need(i), 0, 0.9, &v)) return false; a->val_split = v; }
        else if (f == "--eval-every") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->eval_every = (int64_t)v; }
        else if (f == "-b" && i + 1 < argc && !strcmp(argv[i + 1], "auto")) { a->b_auto = true; i++; }
        else if (f == "-b") { if (!whole(f.c_str(), need(i), 1, 4096, &v)) return false; a->o.micro_batch = (int)v; a->b_auto = false; }
        else if (f == "--effective-batch") { if (!whole(f.c_str(), need(i), 1, 1 << 20, &v)) return false; a->effective_batch = (int)v; }
        else if (f == "--checkpointing") {
            if (!(s = need(i))) return false;
            if (!choice_flag("--checkpointing", s, &a->o.checkpointing)) return false;
        }
        else if (f == "--mem-limit") { if (!(s = need(i)) || !size_flag("--mem-limit", s, "6G, 512M, 1.5G", false, &a->o.mem_limit)) return false; }
        else if (f == "--vram") {
            if (!(s = need(i))) return false;
            a->vram_list.clear();
            for (const std::string &x : split_list(s)) {  // one size, or one per card of a split (24G,24G)
                size_t sz = 0;
                if (!size_flag("--vram", x.c_str(), "8G, 24G, 11.5G; one per card: 24G,24G", true, &sz)) return false;
                a->vram_list.push_back(sz);
            }
            a->o.vram = a->vram_list[0];
        }
        else if (f == "--host-mem") { if (!(s = need(i)) || !size_flag("--host-mem", s, "32G, 128G", true, &a->host_mem)) return false; }
        else if (f == "--cc") { if (!(s = need(i)) || !cc_flag(s, a)) return false; }
        else if (f == "--embd-on-host") a->o.embd_on_host = 1;
        else if (f == "--embd-on-device") a->o.embd_on_host = 0;
        else if (f == "--cache-weights") {
            if (!(s = need(i))) return false;
            if (!strcmp(s, "on") || !strcmp(s, "off") || !strcmp(s, "auto")) {
                a->o.cache_weights = !strcmp(s, "on") ? 1 : !strcmp(s, "off") ? 0 : -1;
            } else {
                fprintf(stderr, "finetune: --cache-weights: '%s' is not one of on, off, auto\n", s);
                return false;
            }
        }
        else if (f == "--loss-chunk") { if (!whole(f.c_str(), need(i), -1, 1 << 30, &v)) return false; a->o.loss_chunk = (int64_t)v; }
        else if (f == "--ffn-chunk") { if (!whole(f.c_str(), need(i), -1, 1 << 30, &v)) return false; a->o.ffn_chunk = (int64_t)v; }
        else if (f == "--attn-score-mib") {
            if (!(s = need(i))) return false;
            char *end = nullptr;
            const long n = strcmp(s, "auto") == 0 ? 0 : strtol(s, &end, 10);
            if (strcmp(s, "auto") != 0 && (!end || end == s || *end || n < 1 || n > (1 << 20))) {
                fprintf(stderr, "finetune: --attn-score-mib: '%s' is not auto or a whole number of MiB in [1, 1048576]\n", s);
                return false;
            }
            a->o.attn_score_mib = (int)n;
        }
        else if (f == "--attn-backward") {
            if (!(s = need(i))) return false;
            if (strcmp(s, "auto") && strcmp(s, "fused") && strcmp(s, "products")) {
                fprintf(stderr, "finetune: --attn-backward: '%s' is not one of auto, fused, products\n", s);
                return false;
            }
            a->o.attn_backward = !strcmp(s, "auto") ? -1 : !strcmp(s, "fused") ? 1 : 0;
        }
        else if (f == "--offload-activations") a->o.offload_activations = true;
        else if (f == "--offload-late") a->o.offload_activations = a->o.offload_late = true;
        else if (f == "--offload-grads") a->o.offload_activations = a->o.offload_late = a->o.offload_grads = true;
        else if (f == "--lora-dropout-fused") {
            if (!(s = need(i))) return false;
            if (!strcmp(s, "auto") || !strcmp(s, "off") || !strcmp(s, "on") || !strcmp(s, "16")) {
                a->o.lora_dropout_fused = !strcmp(s, "auto") ? -1 : !strcmp(s, "off") ? 0 : !strcmp(s, "on") ? 1 : 16;
            } else {
                fprintf(stderr, "finetune: --lora-dropout-fused: '%s' is not one of auto, off, on, 16\n", s);
                return false;
            }
        }
        else if (f == "--loss-unfused") a->o.loss_fused = false;
        else if (f == "--optim") {
            if (!(s = need(i))) return false;
            if (!choice_flag("--optim", s, &a->o.optim)) return false;
        }
        else if (f == "--precision") {
            if (!(s = need(i))) return false;
            if (!choice_flag("--precision", s, &a->o.precision)) return false;
        }
        else if (f == "--loss-scale-init") { if (!num(f.c_str(), need(i), 1e-30, 1e19, &v)) return false; a->o.scale_init = (float)v; a->scaler_flag = f; }
        else if (f == "--loss-scale-growth") { if (!num(f.c_str(), need(i), 1, 1e6, &v)) return false; a->o.scale_growth = (float)v; a->scaler_flag = f; }
        else if (f == "--loss-scale-backoff") { if (!num(f.c_str(), need(i), 1e-6, 0.999999, &v)) return false; a->o.scale_backoff = (float)v; a->scaler_flag = f; }
        else if (f == "--loss-scale-interval") { if (!whole(f.c_str(), need(i), 1, 1e9, &v)) return false; a->o.scale_interval = (int)v; a->scaler_flag = f; }
        else if (f == "--ffn-down-f32") a->o.ffn_down_f32 = true;
        else if (f == "--dry-run") a->dry_run = true;
        else if (f == "--json") a->json = true;
        else if (f == "--grad-accum") { if (!whole(f.c_str(), need(i), 1, 1 << 20, &v)) return false; a->o.grad_accum = (int)v; }
        else if (f == "--lr") { if (!num(f.c_str(), need(i), 0, 10, &v)) return false; a->o.lr = (float)v; }
        else if (f == "--beta1") { if (!num(f.c_str(), need(i), 0, 0.999999, &v)) return false; a->o.beta1 = (float)v; }
        else if (f == "--beta2") { if (!num(f.c_str(), need(i), 0, 0.999999, &v)) return false; a->o.beta2 = (float)v; }
        else if (f == "--eps") {  // > 0: with eps 0, an entry whose gradient is still 0 divides 0 by 0
            if (!num(f.c_str(), need(i), 0, 1, &v)) return false;
            if (!(v > 0)) {
                fprintf(stderr, "finetune: --eps: '%s' must be above 0 (the update divides by sqrt(v) + eps; default 1e-8)\n", argv[i]);
                return false;
            }
            a->o.eps = (float)v;
        }
        else if (f == "--weight-decay") { if (!num(f.c_str(), need(i), 0, 10, &v)) return false; a->o.weight_decay = (float)v; }
        else if (f == "--lr-scheduler") {
            if (!(s = need(i))) return false;
            if (!choice_flag("--lr-scheduler", s, &a->o.scheduler)) return false;
        }
        else if (f == "--warmup-ratio") { if (!num(f.c_str(), need(i), 0, 1, &v)) return false; a->o.warmup_ratio = v; }
        else if (f == "--warmup-steps") { if (!whole(f.c_str(), need(i), 0, 1e12, &v)) return false; a->o.warmup_steps = (int64_t)v; }
        else if (f == "--max-grad-norm") { if (!num(f.c_str(), need(i), 0, 1e6, &v)) return false; a->o.max_grad_norm = (float)v; }
        else if (f == "--epochs") { if (!whole(f.c_str(), need(i), 1, 1e6, &v)) return false; a->o.epochs = (int)v; }
        else if (f == "--max-steps") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->o.max_steps = (int64_t)v; }
        else if (f == "--seed") { if (!whole(f.c_str(), need(i), 0, 9e15, &v)) return false; a->o.seed = (uint64_t)v; a->o.lora.init_seed = a->o.seed; }
        else if (f == "-t") { if (!whole(f.c_str(), need(i), 0, 1024, &v)) return false; a->o.threads = (int)v; }
        else if (f == "--device") {
            if (!(s = need(i))) return false;
            a->split_dev.clear(), a->split_text.clear();
            const std::vector<std::string> list = split_list(s);
            for (const std::string &x : list) {  // several: a model split over those cards, in that order
                ql_device d;
                if (ql_device_parse(x.c_str(), &d, e, sizeof(e)) != QL_OK) {
                    fprintf(stderr, "finetune: --device %s: %s\n", s, e);
                    return false;
                }
                if (list.size() > 1 && d.kind != QL_DEVICE_GPU) {
                    fprintf(stderr, "finetune: --device %s: a model split over cards takes CUDA cards (cuda:0,cuda:1), not %s\n", s, x.c_str());
                    return false;
                }
                for (const ql_device &o : a->split_dev)
                    if (o.index == d.index) {
                        fprintf(stderr, "finetune: --device %s: cuda:%d given twice (each card once)\n", s, d.index);
                        return false;
                    }
                if (list.size() > 1) a->split_dev.push_back(d), a->split_text.push_back("cuda:" + std::to_string(d.index));
                if (a->split_dev.size() <= 1) a->dev = d;
            }
            a->device_text = s;
        }
        else if (f == "--save-every") { if (!whole(f.c_str(), need(i), 1, 1e12, &v)) return false; a->save_every = (int64_t)v; }
        else if (f == "--merge") a->merge = true;
        else if (f == "--overwrite") a->overwrite = true;
        else if (f == "--profile") a->profile = true;
        else {
            fprintf(stderr, "finetune: unknown flag '%s' (see --help)\n", argv[i]);
            return false;
        }
    }
    return true;
}

// whether the command (a resumed run's: its stored command too) gave flag f
static bool flag_given(const args &a, const char *f) {
    for (const auto &g : a.given)
        if (g[0] == f) return true;
    return false;
}

// Flags that change how a run is carried out, not what it computes: a resumed run may give them
// anew. (--max-steps and --epochs may grow: they extend a run.) Every other flag given again
// must agree with the run's.
static bool operational_flag(const std::string &f) {
    for (const char *x : {"-o", "-t", "--device", "--checkpointing", "--mem-limit", "--vram", "--cc", "--host-mem", "--embd-on-host",
                          "--embd-on-device", "--cache-weights", "--loss-chunk", "--loss-unfused", "--ffn-chunk", "--attn-score-mib", "--attn-backward", "--offload-activations", "--offload-late", "--offload-grads", "--lora-dropout-fused", "--eval-every", "--save-every", "--merge",
                          "--overwrite", "--profile", "--dry-run", "--json", "--resume", "--export", "--max-steps", "--epochs"})
        if (f == x) return true;
    return false;
}
static bool path_flag(const std::string &f) { return f == "-m" || f == "-d" || f == "--val-data"; }
static std::string absolute(const std::string &p) {
    char buf[PATH_MAX];
    return realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// What a checkpoint stores of this run's command: every flag once (the last given wins), paths
// absolute (a resume may start elsewhere), -b auto as the batch it chose, and none of the flags
// that only say what this invocation does (-o, --resume, --export, --overwrite, --dry-run, --json).
static std::vector<std::string> stored_command(const args &a) {
    std::vector<std::string> out;
    for (size_t k = 0; k < a.given.size(); k++) {
        const std::vector<std::string> &g = a.given[k];
        bool later = false;
        for (size_t j = k + 1; j < a.given.size(); j++) later = later || a.given[j][0] == g[0];
        if (later || g[0] == "-o" || g[0] == "--resume" || g[0] == "--export" || g[0] == "--overwrite" || g[0] == "--dry-run" ||
            g[0] == "--json")
            continue;
        if (g[0] == "-b" || g[0] == "--effective-batch" || g[0] == "--precision") continue;  // as resolved, below
        out.push_back(g[0]);
        for (size_t j = 1; j < g.size(); j++) out.push_back(path_flag(g[0]) ? absolute(g[j]) : g[j]);
    }
    // the optimizer when choose_memory made it paged (it is part of the run: a resume keeps it)
    if (!flag_given(a, "--optim") && a.o.optim != ql_optim::adamw) out.insert(out.end(), {"--optim", ql_name(a.o.optim)});
    // the batch and the precision as chosen (auto: by this machine; a resume elsewhere keeps them)
    // (the accumulation as one process would make it: a resume divides it among its processes)
    out.insert(out.end(), {"-b", std::to_string(a.o.micro_batch), "--grad-accum", std::to_string(a.o.grad_accum * g_world), "--precision",
                           ql_name(a.o.precision)});
    return out;
}

// --resume/--export DIR where DIR has no checkpoint.gguf: what DIR is instead (false, with why) -
// not there, not a run's, a run still before its first save (DIR/.lock held: running), or one
// that stopped before it. True when the checkpoint is there.
static bool no_checkpoint_why(const std::string &dir, std::string *why) {
    struct stat st;
    if (stat((dir + "/checkpoint.gguf").c_str(), &st) == 0) return true;
    if (stat(dir.c_str(), &st) != 0) {
        *why = "no such directory";
        return false;
    }
    if (!S_ISDIR(st.st_mode)) {
        *why = "not a directory (give the run's -o directory)";
        return false;
    }
    const int fd = open((dir + "/.lock").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        *why = "no checkpoint.gguf there: no finetune run has written to it";
        return false;
    }
    char pid[32] = {0};
    const bool running = flock(fd, LOCK_SH | LOCK_NB) != 0;  // the run holds its lock until it ends
    const ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
    close(fd);
    const std::string who = n > 0 ? " (pid " + std::string(pid, strcspn(pid, "\n")) + ")" : "";
    if (running)
        *why = "no checkpoint yet: the run there" + who + " is still running and has not reached its first save (one at the "
               "end, or every --save-every steps) --> wait for it, or stop it with Ctrl-C/kill: it saves one then";
    else
        *why = "no checkpoint: the run there" + who + " ended before its first save (it failed, or was killed before a step "
               "ended) --> start it again";
    return false;
}

// --resume DIR / --export DIR: the run's own command from DIR's checkpoint, then
// this one's flags (which win); a setting given again must say what the run said.
static bool parse_with_run(int argc, char **argv, args *a) {
    const std::string dir = a->export_dir ? a->export_dir : a->resume;
    const char *flag = a->export_dir ? "--export" : "--resume";
    static std::vector<std::string> cmd;  // the flags' values point into it for the rest of the run
    int64_t step = 0, total = 0;
    std::string err;
    if (!no_checkpoint_why(dir, &err)) {
        fprintf(stderr, "finetune: %s %s: %s\n", flag, dir.c_str(), err.c_str());
        return false;
    }
    if (!ql_checkpoint_info((dir + "/checkpoint.gguf").c_str(), &cmd, &step, &total, &err)) {
        if (a->model) return true;  // an older checkpoint, the run's flags given again (the trainer checks them)
        fprintf(stderr, "finetune: %s %s: %s\n", flag, dir.c_str(), err.c_str());
        return false;
    }
    // a run from before --precision auto was the default stored no --precision: it was fp32
    if (std::find(cmd.begin(), cmd.end(), "--precision") == cmd.end()) cmd.insert(cmd.end(), {"--precision", "fp32"});
    std::vector<char *> sv = {argv[0]};
    for (std::string &x : cmd) sv.push_back(&x[0]);
    args run;
    if (!parse_flags((int)sv.size(), sv.data(), &run)) {
        fprintf(stderr, "finetune: %s %s: the command stored in its checkpoint does not parse (above)\n", flag, dir.c_str());
        return false;
    }
    for (const auto &g : a->given) {
        if (operational_flag(g[0])) continue;
        for (const auto &r : run.given) {
            if (r[0] != g[0]) continue;
            bool same = r.size() == g.size();
            for (size_t j = 1; same && j < g.size(); j++) same = (path_flag(g[0]) ? absolute(g[j]) : g[j]) == r[j];
            if (same) continue;
            std::string was, now;
            for (size_t j = 1; j < r.size(); j++) was += " " + r[j];
            for (size_t j = 1; j < g.size(); j++) now += " " + g[j];
            fprintf(stderr, "finetune: %s%s: the run in %s has %s%s; a resumed run keeps its settings --> hint: leave it out, "
                            "or start a new run (-o)\n", g[0].c_str(), now.c_str(), dir.c_str(), r[0].c_str(), was.c_str());
            return false;
        }
    }
    // the run's flags, then this invocation's (later ones win)
    std::vector<char *> all = sv;
    for (int i = 1; i < argc; i++) all.push_back(argv[i]);
    args merged;
    if (!parse_flags((int)all.size(), all.data(), &merged)) return false;
    *a = merged;
    return true;
}

static bool parse(int argc, char **argv, args *a) {
    if (!parse_flags(argc, argv, a)) return false;
    if (a->export_dir && a->resume) {
        fprintf(stderr, "finetune: --export and --resume are alternatives (--export writes the adapter of a run, --resume goes on "
                        "training it)\n");
        return false;
    }
    if ((a->export_dir || a->resume) && !parse_with_run(argc, argv, a)) return false;
    if (a->export_dir && !a->resume) a->resume = a->export_dir;  // export: the checkpoint's state, no step
    if (!a->model || !a->data) {
        fprintf(stderr, "finetune: -m model.gguf and -d data.jsonl are required (see --help)\n");
        return false;
    }
    if (a->val_data && a->val_split > 0) {
        fprintf(stderr, "finetune: --val-split and --val-data are alternatives\n");
        return false;
    }
    if (a->host_mem && !a->dry_run) {
        fprintf(stderr, "finetune: --host-mem plans for another machine's memory: with --dry-run (a run uses this one's)\n");
        return false;
    }
    if (!resolve_device(a)) return false;
    if (a->profile && !a->split_dev.empty()) {
        fprintf(stderr, "finetune: --profile: not for a model split over cards (--device %s) in this version\n", a->device_text.c_str());
        return false;
    }
    if (a->o.threads > 0) ql_cpu_warn_threads("finetune", a->o.threads);
    const bool cp_auto = a->o.checkpointing == ql_checkpointing::automatic, host = ql_backend_is_host(a->be);
    if ((a->b_auto || cp_auto) && a->o.mem_limit == 0 && !a->o.vram && host) {
        fprintf(stderr, "finetune: %s needs --mem-limit (or on a GPU --vram)\n", a->b_auto ? "-b auto" : "--checkpointing auto");
        return false;
    }
    if ((a->b_auto || cp_auto) && a->o.mem_limit == 0 && !a->o.vram && a->plan_only) {
        fprintf(stderr, "finetune: %s needs --vram SIZE: without the GPU there is no memory to fit (e.g. --vram 24G)\n",
                a->b_auto ? "-b auto" : "--checkpointing auto");
        return false;
    }
    // the default policy: auto where there is a limit to fit (the tool then also decides offload,
    // the embedding's place and paged moments: choose_memory), else none, as it always was
    a->limit_known = a->o.mem_limit || a->o.vram || (!host && !a->plan_only);
    if (a->limit_known && !flag_given(*a, "--checkpointing")) {
        a->o.checkpointing = ql_checkpointing::automatic;
        a->cp_default = true;
    }
    if (!a->scaler_flag.empty() && a->o.precision != ql_precision::fp16) {
        fprintf(stderr, "finetune: %s: loss scaling is for --precision fp16 (this run: %s%s)\n", a->scaler_flag.c_str(),
                ql_name(a->o.precision), a->precision_auto ? ", chosen by --precision auto, the default" : "");
        return false;
    }
    if (a->effective_batch > 0 && !a->b_auto) {
        if (a->effective_batch % (a->o.micro_batch * g_world) != 0) {
            fprintf(stderr, "finetune: --effective-batch %d is not a multiple of -b %d%s\n", a->effective_batch, a->o.micro_batch,
                    g_world > 1 ? (" x " + std::to_string(g_world) + " processes").c_str() : "");
            return false;
        }
        a->o.grad_accum = a->effective_batch / a->o.micro_batch / g_world;
    }
    // data parallel: a resumed run's accumulation is the checkpoint's effective one (its stored
    // command's), divided among this job's processes
    if (a->resume && g_world > 1) {
        if (a->o.grad_accum % g_world != 0) {
            fprintf(stderr, "finetune: %s: the run's effective accumulation %d (micro-batches per step) does not divide among %d "
                            "processes --> hint: mpirun -np with a divisor of %d\n", a->resume, a->o.grad_accum, g_world, a->o.grad_accum);
            return false;
        }
        a->o.grad_accum /= g_world;
    }
    a->o.world = g_world, a->o.rank = g_rank;
    a->o.dist_always = getenv("QLORA_DIST_ALWAYS") != nullptr;  // the all-reduce in one process too (the NCCL check on one GPU)
    return true;
}

static std::string mib_str(size_t b) {
    char t[32];
    snprintf(t, sizeof(t), "%.1f", (double)b / 1048576.0);
    return t;
}

// A split's plan: a line per card (its blocks, weights, state, saved activations, temporaries,
// workspace, context, its total against its limit, its recompute), and how the blocks were chosen
static void print_split(const args &a, const ql_memory_plan &m, int n_layer, bool json) {
    const double MiB = 1048576.0;
    const size_t S = m.stages.size();
    if (!json)
        printf("finetune: a model split over %zu cards, blocks %s; each card's plan (MiB) - the residual stream and its gradient "
               "cross between cards through host memory (v1)\n", S, m.split_choice.c_str());
    for (size_t i = 0; i < S; i++) {
        const ql_memory_plan &p = m.stages[i];
        const int l0 = m.stage_layers[i], l1 = i + 1 < S ? m.stage_layers[i + 1] : n_layer;
        const std::string extra = std::string(i == 0 ? " + embedding" : "") + (i + 1 == S ? " + head" : "");
        const char *verdict = p.vram == 0 ? "no limit known" : p.total <= p.vram ? "fits" : "does not fit";
        const std::string card = i < a.split_text.size() ? a.split_text[i] : std::to_string(i);
        if (json) {
            printf("{\"card\": \"%s\", \"device\": \"%s\", \"blocks\": [%d, %d], \"weights\": %zu, \"state\": %zu, \"saved\": %zu, "
                   "\"temporaries\": %zu, \"workspace\": %zu, \"cache\": %zu, \"context\": %zu, \"total\": %zu, \"limit\": %zu, "
                   "\"fits\": %s, \"checkpointing\": \"%s\", \"micro_batch\": %d}\n",
                   card.c_str(), p.device_desc.c_str(), l0, l1, p.dev_weights, p.dev_state, p.saved, p.scratch, p.work, p.dev_cache,
                   p.dev_context + p.dev_rounding, p.total, p.vram, p.vram == 0 || p.total <= p.vram ? "true" : "false",
                   p.checkpointing.c_str(), p.micro_batch);
            continue;
        }
        printf("  card %zu %s (%s): blocks %d-%d%s: weights %.1f, adapter+grads+optimizer+inputs %.1f, saved %.1f, temporaries %.1f, "
               "workspace %.1f%s, context %.1f = %.1f of %.1f (%s); checkpointing %s\n",
               i, card.c_str(), p.device_desc.c_str(), l0, l1 - 1, extra.c_str(), p.dev_weights / MiB, p.dev_state / MiB, p.saved / MiB,
               p.scratch / MiB, p.work / MiB, p.dev_cache ? (", weight copies " + mib_str(p.dev_cache)).c_str() : "",
               (p.dev_context + p.dev_rounding) / MiB, p.total / MiB, p.vram / MiB, verdict, p.checkpointing.c_str());
    }
    if (json) {  // the whole: fits when every card does; total the fullest card's (bench/seq_fit.sh reads this line)
        bool all = true;
        size_t most = 0, pinned = 0;
        std::string cps;
        for (const ql_memory_plan &p : m.stages) {
            all = all && (p.vram == 0 || p.total <= p.vram);
            most = std::max(most, p.total);
            pinned += p.host_pinned;
            cps += (cps.empty() ? "" : " | ") + p.checkpointing;
        }
        printf("{\"split\": \"%s\", \"cards\": %zu, \"fits\": %s, \"total\": %zu, \"checkpointing\": \"%s\", \"optimizer_name\": \"%s\", "
               "\"host\": {\"process\": %zu, \"planned\": %zu, \"pinned\": %zu}}\n",
               m.split_choice.c_str(), S, all ? "true" : "false", most, cps.c_str(), ql_name(a.o.optim), ql_plan_process(m, a.o.mem_other), m.host, pinned);
    }
}

// ---- memory: -b auto, advice when nothing fits, the snapshot ----

using seqs = std::vector<ql_sequence>;

// -b auto: the largest micro-batch whose plan fits --mem-limit (plans only, no trial runs);
// with --effective-batch N the divisors of N, accumulation making up the rest. Memory grows
// with the micro-batch, so a binary search over the candidates.
static bool choose_batch(ql_llama_file *f, const seqs &tr, const seqs &ev, args *a) {
    std::vector<int> cand;
    const int N = a->effective_batch;
    const int cap = N > 0 ? N : (int)std::min<size_t>(4096, tr.size());  // more than the data is padding
    for (int b = 1; b <= cap; b++)
        if (N == 0 || N % (b * g_world) == 0) cand.push_back(b);
    // with --checkpointing auto: the batch that fits with at most block's recompute (sqrt's
    // extra recompute costs more time than a bigger micro-batch saves); auto then picks the
    // cheapest recompute for it. auto by default (not asked for): the batch that fits without
    // recompute, and only when none does the one that fits with block's
    bool block = a->o.checkpointing == ql_checkpointing::automatic && !a->cp_default;
    auto fits = [&](int b) {
        ql_train_options o = a->o;
        o.micro_batch = b;
        if (o.checkpointing == ql_checkpointing::automatic) o.checkpointing = block ? ql_checkpointing::block : ql_checkpointing::none;
        ql_memory_plan mp;
        std::string err;
        return ql_train_plan(f, tr, ev, o, &mp, &err);
    };
    size_t lo = 0, hi = cand.size();  // cand[lo - 1] fits (lo = 0: none known), cand[hi] does not
    for (int pass = 0; pass < 2 && lo == 0; pass++) {
        if (pass == 1) {
            if (block || !a->cp_default) break;
            block = true, hi = cand.size();
        }
        while (lo < hi) {
            const size_t mid = (lo + hi) / 2;
            if (fits(cand[mid])) lo = mid + 1;
            else hi = mid;
        }
    }
    a->o.micro_batch = lo > 0 ? cand[lo - 1] : 1;  // nothing fits: 1, and the plan below says why
    if (N > 0) a->o.grad_accum = std::max(1, N / a->o.micro_batch / g_world);
    if (lo > 0) {
        ql_memory_plan mp;
        std::string err;
        ql_train_plan(f, tr, ev, a->o, &mp, &err);
        printf("finetune: -b auto: micro-batch %d is the largest that fits %.0f MiB%s%s\n", a->o.micro_batch,
               (double)plan_limit(mp, a->o.mem_limit) / 1048576.0, mp.device ? " of device memory" : "",
               N > 0 ? " among the divisors of --effective-batch" : "");
    }
    return true;
}

// ---- memory: the tool's choice when the limit is known ----

static std::string size_text(size_t b) {
    char s[32];
    if (b >= ((size_t)1 << 30)) snprintf(s, sizeof(s), "%.1f GiB", (double)b / 1073741824.0);
    else snprintf(s, sizeof(s), "%.1f MiB", (double)b / 1048576.0);
    return s;
}

// What the host can give to pinned memory: MemAvailable (/proc/meminfo) less a margin for the
// rest of the machine, the larger of 2 GiB and 10% of MemTotal; 0 when unreadable. host_mem > 0
// (--host-mem, a plan for another machine): that machine's available memory, the same margin.
static size_t host_for_pinned(size_t host_mem, size_t *available, size_t *margin) {
    if (host_mem) {
        *available = host_mem;
        *margin = std::max<size_t>((size_t)2 << 30, host_mem / 10);
        return host_mem > *margin ? host_mem - *margin : 0;
    }
    size_t avail_kb = 0, total_kb = 0;
    if (FILE *f = fopen("/proc/meminfo", "r")) {
        char line[256];
        while (fgets(line, sizeof(line), f)) {
            unsigned long long kb = 0;
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail_kb = (size_t)kb;
            if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) total_kb = (size_t)kb;
        }
        fclose(f);
    }
    *available = avail_kb * 1024;
    *margin = std::max<size_t>((size_t)2 << 30, total_kb * 1024 / 10);
    return *available > *margin ? *available - *margin : 0;
}

// the trainer's auto choice in a few words: "block", "sqrt", "per segment: 6 of 8 input only, 2
// keep matmul/attention", "none needed"
static std::string auto_policy_text(const std::string &c) {
    int S = 0, in = 0, heavy = 0, all = 0;
    if (sscanf(c.c_str(), "auto: of %d segments %d keep only their input, %d keep matmul/attention results, %d", &S, &in, &heavy,
               &all) == 4)
        return "per segment: " + std::to_string(in) + " of " + std::to_string(S) + " input only, " + std::to_string(heavy) +
               " keep matmul/attention";
    if (c.rfind("auto: none", 0) == 0) return "none needed";
    return c.rfind("auto: ", 0) == 0 ? c.substr(6) : c;
}

// One step of the ladder: its options and plan, whether it fits (the device's or process's
// limit, and on a device the host's memory for what it pins)
struct mem_step {
    std::string what;         // "no recompute", "recompute (block)", "+ checkpoint offload", ...
    ql_train_options o;
    ql_memory_plan mp;
    bool planned = false, fits = false;
    size_t pinned = 0;        // pinned host memory: offloaded checkpoints, paged moments
    bool host_short = false;  // the device would hold it, the host has not the pinned memory
    bool chunks = false;      // the second pass: the feed-forward in chunks where the trainer needs them
    bool twin = false;        // ... of a step the first pass tried with the feed-forward whole
};

// The step time relative to no recompute, from the planner's FLOPs: a LoRA step costs about
// two forward passes (the forward, then the input gradients; frozen weights get no weight
// gradient), recompute adds its own. Copies (offload, the embedding's rows, paged moments)
// overlap or are small: not counted.
// (The chunked loss's head is recomputed whatever the policy: times are relative to the first step's.)
static double relative_step_time(const ql_memory_plan &mp, const ql_memory_plan &first) {
    return (1.0 + mp.recompute_fraction / 2.0) / (1.0 + first.recompute_fraction / 2.0);
}

// --checkpointing auto (the default when the memory limit is known): the fastest plan that fits,
// in this order - no recompute; recompute (the trainer's auto: per segment, block, sqrt); then on
// a device the checkpoints offloaded to pinned host memory (when the host has it; where it has
// not under auto's recompute, the step is planned again with block's); the token embedding in
// host memory; the optimizer's moments paged to pinned host memory; checkpoints back late;
// gradients parked on the host; adapter dropout inside A's multiply. Each step keeps
// the ones before it; a flag given for any of them pins it (the ladder leaves it as given). On
// the CPU only the first two (offload there is accounting only; the rest are device memory's).
// One line says what was chosen and why; --dry-run adds the table of the steps. When none fits,
// a.o is the first step's and the caller's plan says what does not fit.
static void choose_memory(ql_llama_file *f, const seqs &tr, const seqs &ev, args *a) {
    const bool device = !ql_backend_is_host(a->be);
    const bool cp_pinned = a->o.checkpointing != ql_checkpointing::automatic, offload_pinned = a->o.offload_activations;
    const bool embd_pinned = a->o.embd_on_host != -1, optim_pinned = flag_given(*a, "--optim"), late_pinned = a->o.offload_late;
    const bool grads_pinned = a->o.offload_grads;
    const bool drop_pinned = a->o.lora_dropout_fused != -1;
    const bool tied = f->model.output == f->model.tok_embd;
    std::vector<mem_step> steps;
    mem_step s0;
    s0.o = a->o;
    if (!cp_pinned) s0.o.checkpointing = ql_checkpointing::none;
    if (device && !embd_pinned) s0.o.embd_on_host = 0;
    s0.what = cp_pinned ? "--checkpointing " + std::string(ql_name(a->o.checkpointing)) : "no recompute";
    steps.push_back(s0);
    auto add = [&](const std::string &what, auto change) {
        mem_step s = steps.back();
        s.what = what;
        change(s.o);
        steps.push_back(s);
    };
    if (!cp_pinned) add("recompute", [](ql_train_options &o) { o.checkpointing = ql_checkpointing::automatic; });
    if (device && !offload_pinned && steps.back().o.checkpointing != ql_checkpointing::none)
        add("+ checkpoint offload", [](ql_train_options &o) { o.offload_activations = true; });
    if (device && !embd_pinned && !tied) add("+ embedding in host memory", [](ql_train_options &o) { o.embd_on_host = 1; });
    if (device && !optim_pinned && !ql_optim_paged(a->o.optim))
        add("+ paged optimizer state", [](ql_train_options &o) {
            o.optim = ql_optim_8bit(o.optim) ? ql_optim::paged_adamw8bit : ql_optim::paged_adamw;
        });
    if (device && !late_pinned && steps.back().o.offload_activations)  // (copies the compute waits for)
        add("+ checkpoints back late", [](ql_train_options &o) { o.offload_late = true; });
    // the residual gradient (and the norm's copy) parked on the host across attention's backward:
    // one copy a block more that the compute waits for - cheaper than the dropout's kernels
    if (device && !grads_pinned && steps.back().o.offload_late)
        add("+ gradients parked on the host", [](ql_train_options &o) { o.offload_grads = true; });
    // adapter dropout inside A's multiply over x's 16-bit copy: backward keeps that copy instead of
    // a dropped-out copy per adapted linear (on a device: kernels measured 14% slower: last)
    if (!drop_pinned && a->o.lora.dropout > 0 && a->o.precision != ql_precision::fp32)
        add("+ dropout inside A's multiply (16-bit x)", [](ql_train_options &o) { o.lora_dropout_fused = 16; });
    // On a device, the feed-forward in chunks of tokens (the trainer's auto, when recompute's peak
    // needs it) costs more than the copies that overlap: each chunk dequantises the weights again
    // in smaller products (an H200 at the 8B shape, seq 2048, NF4 tiles: 4 chunks made a
    // block-recompute step 1.54x slower, while offloading its checkpoints cost 1%; bench/RESULTS.md,
    // session 35). So the steps up to the paged state are tried first with the feed-forward whole,
    // then the whole ladder again with its chunks allowed.
    if (device && a->o.ffn_chunk == 0) {
        std::vector<mem_step> ladder;
        size_t whole = 0;  // the steps the first pass takes: those before the copies the compute waits for
        for (const mem_step &s : steps) {
            const bool waits = s.o.offload_late || s.o.offload_grads || s.o.lora_dropout_fused != a->o.lora_dropout_fused;
            if (waits) break;  // (copies the compute waits for, kernels measured slower: after the chunks)
            ladder.push_back(s);
            // (no recompute: the trainer chunks only recompute's feed-forward)
            if (s.o.checkpointing != ql_checkpointing::none) ladder.back().o.ffn_chunk = -1;
            whole++;
        }
        for (size_t i = 0; i < steps.size(); i++) {
            if (steps[i].o.checkpointing == ql_checkpointing::none) continue;
            ladder.push_back(steps[i]);
            ladder.back().chunks = true;
            ladder.back().twin = i < whole;
        }
        steps.swap(ladder);
    }
    if (steps.size() < 2) return;  // everything pinned: the flags' plan, as given

    size_t available = 0, margin = 0;
    const size_t host_room = host_for_pinned(a->host_mem, &available, &margin);
    int chosen = -1;
    for (size_t i = 0; i < steps.size(); i++) {
        mem_step &s = steps[i];
        std::string err;
        s.fits = ql_train_plan(f, tr, ev, s.o, &s.mp, &err);
        s.planned = s.mp.total > 0;
        if (s.chunks && s.mp.ffn_chunk == 0 && s.twin) {  // (the first pass's plan again: not shown twice)
            s.planned = s.fits = false;
            continue;
        }
        if (s.what == "recompute") s.what += " (" + auto_policy_text(s.mp.checkpointing) + ")";
        if (s.chunks && s.mp.ffn_chunk > 0) s.what += ", feed-forward in chunks";
        s.pinned = s.mp.host_pinned + (device && s.mp.optimizer_host ? s.mp.optimizer : 0);
        if (s.fits && s.pinned > 0 && s.pinned > host_room) s.fits = false, s.host_short = true;
        // auto's recompute may keep two checkpoints a block (each half's input): less device memory,
        // twice the pinned host memory once offloaded. Short of host memory: one a block instead
        if (s.host_short && !cp_pinned && s.o.checkpointing == ql_checkpointing::automatic && s.o.offload_activations) {
            mem_step b = s;
            b.o.checkpointing = ql_checkpointing::block;
            b.fits = ql_train_plan(f, tr, ev, b.o, &b.mp, &err);
            b.pinned = b.mp.host_pinned + (device && b.mp.optimizer_host ? b.mp.optimizer : 0);
            b.host_short = b.fits && b.pinned > host_room;
            if (b.fits && !b.host_short) {
                b.what += " (one checkpoint a block: less host memory)";
                s = b;
            }
        }
        if (s.fits && chosen < 0) chosen = (int)i;
        if (chosen >= 0 && !a->dry_run) break;  // a dry run plans them all for its table
    }
    const ql_memory_plan &m0 = steps[0].mp;
    const size_t limit = plan_limit(m0, a->o.mem_limit);
    auto total = [&](const mem_step &s) { return plan_total(s.mp, a->o.mem_other); };
    FILE *out = a->json ? stderr : stdout;  // (--json: stdout holds the one object)
    const char *kind = m0.device ? " of device memory" : "";
    if (chosen < 0 && !m0.total) {  // not a question of memory (the caller's plan says what)
        a->o = steps[0].o;
        return;
    }
    if (chosen < 0) {
        std::string tried;
        for (const mem_step &s : steps)
            if (s.planned)
                tried += (tried.empty() ? "" : ", ") + s.what + " " + size_text(total(s)) + (s.host_short ? " (the host lacks the pinned memory)" : "");
        fprintf(stderr, "finetune: memory: checkpointing auto: nothing fits the limit of %s%s (%s)\n", size_text(limit).c_str(), kind,
                tried.c_str());
    } else {
        const mem_step &c = steps[(size_t)chosen];
        a->o = c.o;
        fprintf(out, "finetune: memory: checkpointing auto -> %s: %s of the %s%s limit", c.what.c_str(), size_text(total(c)).c_str(),
                size_text(limit).c_str(), kind);
        int prev = chosen - 1;
        while (prev > 0 && !steps[(size_t)prev].planned) prev--;
        if (chosen > 0) {
            const mem_step &p = steps[(size_t)prev];
            fprintf(out, " (%s needs %s%s)", p.what.c_str(), size_text(total(p)).c_str(),
                    p.host_short ? ", more pinned host memory than there is" : "");
        }
        if (c.pinned > 0)
            fprintf(out, "; pinned host %s of %s available less a %s margin", size_text(c.pinned).c_str(), size_text(available).c_str(),
                    size_text(margin).c_str());
        if (chosen > 0) fprintf(out, "; step time about x%.2f", relative_step_time(c.mp, m0));
        if (chosen > 0 && device && c.mp.ffn_chunk > 0)
            fprintf(out, " by FLOPs, more with the feed-forward's chunks (each dequantises the weights again)");
        fprintf(out, "\n");
    }
    if (a->dry_run) {
        fprintf(out, "finetune: memory: the alternatives, in the order auto tries them (step time against the first's: 1 + "
                     "recomputed / (2 x forward) FLOPs, the planner's counts; copies not counted)\n");
        int w = 0;
        for (const mem_step &s : steps) w = std::max(w, (int)s.what.size());
        for (size_t i = 0; i < steps.size(); i++) {
            const mem_step &s = steps[i];
            if (!s.planned) continue;
            fprintf(out, "  %-*s %12s  %-14s x%.2f%s\n", w, s.what.c_str(), size_text(total(s)).c_str(),
                    s.fits ? "fits" : s.host_short ? "host short" : "does NOT fit", relative_step_time(s.mp, m0),
                    (int)i == chosen ? "   <- chosen" : "");
        }
    }
    if (chosen < 0) a->o = steps[0].o;
    fflush(out);
}

// One change the advice may suggest, and what it does to the run's options
struct advice_change {
    std::string what, flags;  // the line's words; the flags they come to in a combination
    int group, cost;          // at most one change per group in a combination
    int cp = 0;               // 1 block, 2 sqrt
    bool b1 = false, half = false, nf4 = false, embd = false, optim8 = false;
    bool cache_auto = false;  // --cache-weights auto: the copies only when they fit
};

// What the advice works with: the run, the changes that apply to it, and the predicted total of
// any set of them
struct advisor {
    ql_llama_file *f;
    const seqs &tr, &ev;
    const args &a;
    std::vector<advice_change> ch;
    int eff = 0;                           // the effective batch, kept by -b 1 --grad-accum
    ql_optim optim8 = ql_optim::adamw8bit;  // the 8-bit form of the run's optimizer
    size_t T = 0;                          // the sequence length
    size_t saving = 0;                     // ./quantize: the blocks' matrices in NF4
    std::string nf4_how;
    size_t limit = 0;                      // plan_limit: what a total must fit
    seqs tr_half, ev_half;                 // the data at half the length: made once, when a set first needs it
    bool halved = false;

    advisor(ql_llama_file *model, const seqs &train, const seqs &eval, const args &run) : f(model), tr(train), ev(eval), a(run) {}

    // the run's options with the changes of `set` (indices into ch), micro-batch b for -b 1's
    ql_train_options options(const std::vector<size_t> &set, int b) const {
        ql_train_options o = a.o;
        for (size_t k : set) {
            const advice_change &c = ch[k];
            if (c.cp) o.checkpointing = c.cp == 1 ? ql_checkpointing::block : ql_checkpointing::sqrt;
            if (c.b1) o.micro_batch = b, o.grad_accum = eff / b;
            if (c.embd) o.embd_on_host = 1;
            if (c.optim8) o.optim = optim8;
            if (c.cache_auto) o.cache_weights = -1;
        }
        return o;
    }
    seqs half(const seqs &s) const {
        seqs h = s;
        for (ql_sequence &q : h)
            for (std::vector<int32_t> *x : {&q.tokens, &q.pos, &q.seg, &q.targets})
                if (!x->empty()) x->resize(T / 2);
        return h;
    }
    // the predicted total of the run with the changes of `set`; 0: no plan
    size_t predict(const std::vector<size_t> &set, int b) {
        bool h = false, q = false;
        for (size_t k : set) h = h || ch[k].half, q = q || ch[k].nf4;
        ql_memory_plan mp;
        std::string err;
        if (h && !halved) tr_half = half(tr), ev_half = half(ev), halved = true;
        if (h) ql_train_plan(f, tr_half, ev_half, options(set, b), &mp, &err);
        else ql_train_plan(f, tr, ev, options(set, b), &mp, &err);
        if (mp.total == 0) return 0;
        return plan_total(mp, a.o.mem_other) - std::min(q ? saving : 0, mp.total);
    }
    bool fits(size_t total) const { return total > 0 && (limit == 0 || total <= limit); }
    // a combination's flags, -b 1's with micro-batch b
    std::string words(const std::vector<size_t> &set, int b) const {
        std::string w;
        for (size_t k : set)
            w += (w.empty() ? "" : " + ") + (ch[k].b1 ? "-b " + std::to_string(b) + " --grad-accum " + std::to_string(eff / b) : ch[k].flags);
        return w;
    }
};

// The changes that apply to this run (now: its plan), each with its group and cost: more
// recompute, micro-batch 1, half the sequence length, the base in NF4 (on a device also the
// embedding in host memory and 8-bit moments)
static void advice_changes(advisor &v, const ql_memory_plan &now) {
    const args &a = v.a;
    using C = ql_checkpointing;
    const C cp = a.o.checkpointing;
    v.eff = a.o.micro_batch * a.o.grad_accum;
    v.optim8 = ql_optim_paged(a.o.optim) ? ql_optim::paged_adamw8bit : ql_optim::adamw8bit;
    v.T = v.tr.empty() ? 0 : v.tr[0].tokens.size();
    for (const ql_llama_layer &L : v.f->model.layers)
        for (const ql_tensor *w : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) {
            const size_t nf4 = ql_type_data_size(QL_TYPE_NF4, w->ne[1], w->ne[0]), cur = ql_nbytes(w) + w->aux_size;
            if (w->ne[0] % 2 == 0 && cur > nf4) v.saving += cur - nf4;
        }
    v.nf4_how = "./quantize " + std::string(a.model) + " out.gguf nf4";
    std::vector<advice_change> &ch = v.ch;
    if (now.device && now.dev_cache > 0 && a.o.cache_weights == 1) {  // the first thing to give up
        advice_change c{"--cache-weights auto (the weights' copies only when they fit)", "--cache-weights auto", 6, 0};
        c.cache_auto = true;
        ch.push_back(c);
    }
    if (now.device && !now.embd_on_host && v.f->model.output != v.f->model.tok_embd) {
        advice_change c{"--embd-on-host", "--embd-on-host", 0, 1};
        c.embd = true;
        ch.push_back(c);
    }
    if (cp == C::none) {
        advice_change c{"--checkpointing block", "--checkpointing block", 1, 2};
        c.cp = 1;
        ch.push_back(c);
    }
    if (cp == C::none || cp == C::block) {
        advice_change c{"--checkpointing sqrt", "--checkpointing sqrt", 1, 4};
        c.cp = 2;
        if (cp == C::block) c.cost = 2;  // the next step from where the run is
        ch.push_back(c);
    }
    if (now.device && !ql_optim_8bit(a.o.optim)) {
        advice_change c{"--optim " + std::string(ql_name(v.optim8)), "--optim " + std::string(ql_name(v.optim8)), 2, 2};
        c.optim8 = true;
        ch.push_back(c);
    }
    if (a.o.micro_batch > 1) {
        advice_change c{"-b 1 --grad-accum " + std::to_string(v.eff) + " (the same effective batch)", "-b 1 --grad-accum " + std::to_string(v.eff), 3, 3};
        c.b1 = true;
        ch.push_back(c);
    }
    if (v.saving > 0) {
        advice_change c{"the base in NF4 (" + v.nf4_how + ")", "the base in NF4", 4, 5};
        c.nf4 = true;
        ch.push_back(c);
    }
    if (v.T >= 4) {  // the plan depends on the length and the tokens present, not on how many sequences
        advice_change c{"--seq-len " + std::to_string(v.T / 2), "--seq-len " + std::to_string(v.T / 2), 5, 6};
        c.half = true;
        ch.push_back(c);
    }
}

// When no single change fits: the cheapest combination of two or more (one change per group)
// that does, its micro-batch the largest that fits with the rest - or, when even all of them
// together do not fit, that line
static void advise_combination(advisor &v) {
    const std::vector<advice_change> &ch = v.ch;
    std::vector<std::vector<size_t>> combos = {{}};
    for (size_t k = 0; k < ch.size(); k++) {
        const size_t n = combos.size();
        for (size_t c = 0; c < n; c++) {
            bool clash = false;
            for (size_t j : combos[c]) clash = clash || ch[j].group == ch[k].group;
            if (clash) continue;
            std::vector<size_t> x = combos[c];
            x.push_back(k);
            combos.push_back(x);
        }
    }
    auto cost = [&](const std::vector<size_t> &set) {
        int c = 0;
        for (size_t k : set) c += ch[k].cost;
        return c;
    };
    std::stable_sort(combos.begin(), combos.end(), [&](const std::vector<size_t> &x, const std::vector<size_t> &y) {
        return cost(x) != cost(y) ? cost(x) < cost(y) : x.size() < y.size();
    });
    // the strongest combination first: when even it does not fit, no other will be tried
    std::vector<size_t> all;
    for (size_t g = 0; g < 6; g++) {
        size_t best = ch.size();
        for (size_t k = 0; k < ch.size(); k++)
            if (ch[k].group == (int)g && (best == ch.size() || ch[k].cp > ch[best].cp)) best = k;
        if (best < ch.size()) all.push_back(best);
    }
    const size_t t_all = v.predict(all, 1);
    if (all.size() < 2 || !v.fits(t_all)) {
        if (all.size() >= 2 && t_all > 0)
            fprintf(stderr, "  %-60s %9.1f MiB  (all of them together: still over the limit)\n", v.words(all, 1).c_str(),
                    (double)t_all / 1048576.0);
        return;
    }
    for (const std::vector<size_t> &set : combos) {
        if (set.size() < 2) continue;
        const size_t t = set == all ? t_all : v.predict(set, 1);
        if (!v.fits(t)) continue;
        // its micro-batch: the largest divisor of the effective batch that fits with the rest
        int b = 1;
        size_t tb = t;
        bool has_b1 = false;
        for (size_t k : set) has_b1 = has_b1 || ch[k].b1;
        for (int d = v.eff / 2; has_b1 && d > 1; d--)
            if (v.eff % d == 0) {
                const size_t x = v.predict(set, d);
                if (v.fits(x)) {
                    b = d, tb = x;
                    break;
                }
            }
        fprintf(stderr, "  %-60s %9.1f MiB  fits (together; no single change does)\n", v.words(set, b).c_str(), (double)tb / 1048576.0);
        for (size_t k : set)
            if (ch[k].nf4) fprintf(stderr, "  (the base in NF4: %s)\n", v.nf4_how.c_str());
        return;
    }
}

// The changes that would help most when the plan does not fit, each with its predicted total
// (advice_changes). When no single one fits: the combination that fits at the least cost (each
// change's cost: what it takes from speed or from the run itself), its micro-batch then the
// largest that fits with the rest (advise_combination).
static void advise(ql_llama_file *f, const seqs &tr, const seqs &ev, const args &a, const ql_memory_plan &now) {
    advisor v(f, tr, ev, a);
    advice_changes(v, now);
    v.limit = plan_limit(now, a.o.mem_limit);
    std::vector<std::pair<size_t, size_t>> single;  // total, change
    for (size_t k = 0; k < v.ch.size(); k++)
        if (const size_t t = v.predict({k}, 1)) single.push_back({t, k});
    std::sort(single.begin(), single.end());
    if (single.empty()) return;
    char lim[64] = "";
    if (v.limit) snprintf(lim, sizeof(lim), ", limit %.1f MiB", (double)v.limit / 1048576.0);
    fprintf(stderr, "finetune: what would help most (predicted %stotals; now %.1f MiB%s):\n", now.device ? "device " : "",
            (double)plan_total(now, a.o.mem_other) / 1048576.0, lim);
    for (size_t i = 0; i < single.size() && i < 3; i++)
        fprintf(stderr, "  %-60s %9.1f MiB%s\n", v.ch[single[i].second].what.c_str(), (double)single[i].first / 1048576.0,
                v.fits(single[i].first) ? "  fits" : "");
    if (v.limit == 0 || v.fits(single[0].first)) return;
    advise_combination(v);
}

// Every planned tensor with its size, category and lifetime, for the post-mortem.
// Not in a directory that holds another run's outputs (--overwrite removes them only once a run
// starts): the snapshot would sit beside a run it does not describe.
static void write_snapshot(ql_llama_file *f, const seqs &tr, const seqs &ev, const args &a, const std::string &out) {
    std::string err;
    const std::string path = out + "/memory-snapshot.json";
    struct stat st;
    if (!same_dir(out, a.resume))
        for (const char *name : k_run_outputs)
            if (lstat((out + "/" + name).c_str(), &st) == 0) {
                fprintf(stderr, "finetune: no memory snapshot: %s holds an earlier run's %s (--overwrite replaces it only when a "
                                "run starts) --> hint: another -o gets the snapshot\n", out.c_str(), name);
                return;
            }
    if (make_dir(out, &err) && ql_train_write_snapshot(f, tr, ev, a.o, path.c_str(), &err))
        fprintf(stderr, "finetune: wrote %s (every planned tensor: bytes, category, lifetime)\n", path.c_str());
    else
        fprintf(stderr, "finetune: no memory snapshot: %s\n", err.c_str());
}

// what --precision auto (the default) saw, for the line that says what it chose
static std::string precision_why(const args &a, bool device) {
    if (!a.precision_auto) return "";
    if (device)
        return a.o.precision == ql_precision::bf16 ? " (auto: this GPU multiplies bf16 on its tensor cores)"
                                       : " (auto: this GPU has no bf16 tensor cores: fp16 with loss scaling)";
    const char *kind = ql_cpu_bf16_kind();
    return a.o.precision == ql_precision::bf16 && kind ? std::string(" (auto: this CPU multiplies bf16 natively, on ") + kind + ")"
                                           : " (auto: this CPU has no native bf16 multiply; 16-bit would only add conversions)";
}

// adapter.gguf (llama.cpp's format) and peft/ (PEFT's) in DIR, from the trainer's adapter
static bool write_adapter(ql_llama_file *f, ql_trainer *t, const args &a, const std::string &out) {
    ql_lora_config c = a.o.lora;  // the run's: r, alpha, dropout, rslora as trained
    {  // PEFT loads base_model_name_or_path from the Hub: only a repository the GGUF names will do
        size_t len;
        const int64_t ik = ql_gguf_find_kv(f->gguf, "general.source.huggingface.repository");
        const char *repo = ik >= 0 ? ql_gguf_get_str(f->gguf, ik, &len) : nullptr;
        c.base_model = repo ? repo : "";
    }
    ql_llama &m = ql_trainer_model(t);
    std::string err;
    if (!ql_trainer_to_host(t, &err) || !ql_lora_save_gguf((out + "/adapter.gguf").c_str(), m, f->arch.c_str(), c, &err) ||
        !ql_peft_save((out + "/peft").c_str(), m, f->arch.c_str(), c, &err)) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return false;
    }
    return true;
}

// --export DIR: the adapter as the checkpoint holds it (checked like a resume: checksum, base,
// settings), no step taken, the checkpoint and metrics left as they are
static bool export_adapter(ql_llama_file *f, ql_trainer *t, const args &a, const std::string &out, int64_t step, int64_t total) {
    std::string err;
    if (!write_adapter(f, t, a, out)) return false;
    if (a.merge && !ql_llama_save_merged((out + "/merged.gguf").c_str(), *f, ql_trainer_model(t), &err)) {
        fprintf(stderr, "finetune: %s\n", err.c_str());
        return false;
    }
    printf("finetune: exported the adapter after step %lld of %lld from %s/checkpoint.gguf: wrote %s/adapter.gguf, %s/peft/%s\n",
           (long long)step, (long long)total, a.export_dir, out.c_str(), out.c_str(), a.merge ? (", " + out + "/merged.gguf").c_str() : "");
    return true;
}

// ---- the run: main's steps, in the order they happen ----

static double mib(size_t b) { return (double)b / 1048576.0; }

// What a run holds: the model, its data, the trainer, the loop's counters. Freed in reverse order
// of declaration - the trainer before the vocabulary and the model it was built from; the
// backend (main's, made by resolve_device) after them all.
struct ft_run {
    owned<ql_llama_file> f{nullptr, ql_llama_file_free};
    owned<ql_vocab> vocab{nullptr, ql_vocab_free};
    ql_dataset train, eval;
    int32_t pad = 0;                      // the sequences' padding token
    std::vector<ql_sequence> tseq, eseq;  // the training and evaluation sequences (moved into the trainer)
    size_t n_train = 0, n_eval = 0;
    int64_t n_targets = 0;                // the supervised tokens of the training sequences
    std::string out;                      // the output directory
    ql_memory_plan plan;                  // the plan made before anything was allocated
    std::chrono::steady_clock::time_point t_build;
    owned<ql_trainer> t{nullptr, ql_trainer_free};
    int64_t total = 0, per_epoch = 0;     // optimizer steps: the run's, an epoch's
    int64_t run_step = 0, run_total = 0;  // what the checkpoint had done, and of how many steps
    size_t predicted = 0;                 // the process's RSS: on a device run its host part only
    size_t card_max = 0;                  // the card's use, highest reading: read at the end, the run's buffers may be gone
    bool tty = false;                     // stdout is a terminal: one step line rewritten in place
    std::string err;
    // the loop's
    std::vector<std::pair<double, double>> curve, eval_curve;
    std::string kept;   // on resume: the metrics of the steps the checkpoint holds (later ones are redone)
    std::string mpath;  // DIR/metrics.jsonl, open for appending in `metrics`
    FILE *metrics = nullptr;
    int64_t eval_every = 0, first = 0;
    int64_t profiled_from = 0;  // --profile: the steps after this one
    std::chrono::steady_clock::time_point t0;
    double last_loss = NAN, last_eval = NAN, tok_s = 0, real_s = 0, sup_s = 0;  // tokens/s: computed, real, supervised
    int64_t tokens = 0, real = 0, supervised = 0;
    bool warned = false, interrupted = false;
    size_t train_peak = 0;
};

// The model, its vocabulary, and from them the data's chat template and BOS (as tokenize --data
// shows them); 0, else the exit code after the message.
static int load_model(args &a, ft_run &r) {
    char e[512];
    r.f.reset(ql_llama_load(a.model, e, sizeof(e)));
    if (!r.f) {
        fprintf(stderr, "finetune: %s\n", e);
        return 1;
    }
    r.vocab.reset(ql_vocab_load(r.f->gguf, e, sizeof(e)));
    if (!r.vocab) {
        fprintf(stderr, "finetune: %s: %s\n", a.model, e);  // (the vocabulary's errors do not name the file)
        return 1;
    }
    if (!ql_data_options_for(r.f->gguf, r.vocab.get(), a.chat, &a.d, &r.err)) {
        fprintf(stderr, "finetune: --chat-template: %s\n", r.err.c_str());
        return 2;
    }
    const ql_llama_hparams &hp = r.f->model.hp;
    if (hp.n_ctx_train > 0 && a.d.seq_len > hp.n_ctx_train)
        fprintf(stderr, "finetune: warning: --seq-len %d is longer than the model's context length %d (its positions beyond were "
                        "never trained)\n", a.d.seq_len, hp.n_ctx_train);
    return 0;
}

// The training and evaluation sets (-d, --val-data or --val-split), refused when empty, as
// sequences; 0, or 1 after the message.
static int load_data(args &a, ft_run &r) {
    ql_vocab *vocab = r.vocab.get();
    ql_dataset &train = r.train, &eval = r.eval;
    if (!ql_dataset_load(a.data, vocab, a.d, &train, &r.err) ||
        (a.val_data && !ql_dataset_load(a.val_data, vocab, a.d, &eval, &r.err))) {
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    if (train.n_bad > 0)
        fprintf(stderr, "finetune: warning: skipped %lld bad line%s of %s; the first: %s\n", (long long)train.n_bad,
                train.n_bad == 1 ? "" : "s", a.data, r.err.c_str());
    if (a.val_split > 0) ql_dataset_split(&train, a.val_split, a.o.seed, &eval);
    if (train.examples.empty()) {
        fprintf(stderr, "finetune: %s: no usable training examples (%lld non-blank lines, %lld bad, %lld with nothing to learn)\n", a.data,
                (long long)train.n_lines, (long long)train.n_bad, (long long)train.n_empty);
        return 1;
    }
    if (a.val_split > 0 && eval.examples.empty()) {  // one example: it cannot be both trained on and held out
        fprintf(stderr, "finetune: --val-split %g: %s has %zu usable example%s, too few to hold one out for evaluation\n",
                a.val_split, a.data, train.examples.size(), train.examples.size() == 1 ? "" : "s");
        return 1;
    }
    if (a.val_data && eval.examples.empty()) {  // an evaluation asked for and nothing to evaluate: not a silent no-op
        fprintf(stderr, "finetune: --val-data %s: no usable evaluation examples (%lld non-blank lines, %lld bad, %lld with nothing to learn)\n",
                a.val_data, (long long)eval.n_lines, (long long)eval.n_bad, (long long)eval.n_empty);
        return 1;
    }
    r.pad = ql_vocab_pad(vocab) >= 0 ? ql_vocab_pad(vocab) : std::max(0, ql_vocab_eos(vocab));
    ql_dataset_sequences(train, a.d, r.pad, &r.tseq);
    ql_dataset_sequences(eval, a.d, r.pad, &r.eseq);
    a.o.packed = a.d.pack;
    return 0;
}

// Another run's directory is never overwritten unasked: 0, or 1 after the message when -o holds
// a run's outputs (with or without its checkpoint) and this is neither --resume of it nor --overwrite.
static int check_out_dir(const args &a, const std::string &out) {
    if (a.dry_run || a.overwrite || same_dir(out, a.resume) || !writer()) return 0;  // (rank 0 checks for all)
    struct stat st;
    // a run's outputs without its checkpoint (deleted to save space, or copied there) are as
    // much a user's as the run itself
    for (const char *name : k_run_outputs)
        if (lstat((out + "/" + name).c_str(), &st) == 0) {
            if (name == k_run_outputs[0])
                fprintf(stderr, "finetune: %s already holds a run (checkpoint.gguf): --resume %s continues it, "
                        "--overwrite replaces it, or choose another -o\n", out.c_str(), out.c_str());
            else
                fprintf(stderr, "finetune: %s already holds %s (a run's output, without its checkpoint): --overwrite "
                        "replaces it, or choose another -o\n", out.c_str(), name);
            return 1;
        }
    return 0;
}

// The memory plan, before anything is allocated: -b auto's batch, --checkpointing auto's ladder,
// then the plan itself. --dry-run prints it (0); a plan that does not fit says why, with advice
// and (not on a dry run) the snapshot (1). -1 to go on to the run.
static int plan_memory(args &a, ft_run &r) {
    ql_llama_file *f = r.f.get();
    for (const ql_sequence &s : r.tseq) r.n_targets += s.n_targets;
    r.n_train = r.tseq.size(), r.n_eval = r.eseq.size();
    // what the process already holds (code, model metadata, vocabulary, data): the plan adds to it
    a.o.mem_other = rss_bytes();
    if (!a.split_dev.empty() && (int)a.split_dev.size() > f->model.hp.n_layer) {
        fprintf(stderr, "finetune: --device %s: %zu cards for a model of %d blocks (at most one card per block)\n", a.device_text.c_str(),
                a.split_dev.size(), f->model.hp.n_layer);
        return 1;
    }
    if (a.b_auto && !choose_batch(f, r.tseq, r.eseq, &a)) return 1;
    // (a split: each card's plan chooses its own recompute; the ladder's offload, embedding and
    // paged choices are left to the flags - limitation: v1)
    if (a.limit_known && a.split_dev.empty()) choose_memory(f, r.tseq, r.eseq, &a);
    a.o.command = stored_command(a);
    ql_memory_plan &plan = r.plan;
    const bool planned = ql_train_plan(f, r.tseq, r.eseq, a.o, &plan, &r.err);
    if (!planned && plan.total == 0) {  // not a question of memory: the model or data cannot be built
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    if (!a.dry_run && planned) return -1;
    if (!a.json && !a.plan_only) printf("finetune: precision %s%s\n", ql_name(a.o.precision), precision_why(a, plan.device).c_str());
    if (!a.json && g_world > 1) printf("finetune: data parallel: %d processes (%s); the plan is each process's\n", g_world, ql_dist_name());
    if (!plan.stages.empty()) print_split(a, plan, f->model.hp.n_layer, a.json);
    else print_memory(plan, ql_name(a.o.optim), a.o.mem_other, "RSS before training", plan_limit(plan, a.o.mem_limit), a.json);
    if (a.plan_only && plan_limit(plan, a.o.mem_limit) == 0)
        fprintf(a.json ? stderr : stdout, "finetune: no verdict: without the GPU the plan needs --vram SIZE (the card's memory, "
                                          "e.g. --vram 24G) to say whether it fits\n");
    if (!planned) {
        fprintf(stderr, "finetune: does not fit: %s\n", r.err.c_str());
        advise(f, r.tseq, r.eseq, a, plan);
        if (!a.dry_run && writer()) write_snapshot(f, r.tseq, r.eseq, a, r.out);
        return 1;
    }
    return 0;
}

// The trainer, everything sized, planned and allocated before step one; a resumed run's state
// from its checkpoint; DIR (and DIR/peft) made and locked. 0, or 1 after the message - when an
// allocation failed although the plan fit, with what was planned and advice.
static int build_trainer(const args &a, ft_run &r) {
    ql_llama_file *f = r.f.get();
    r.t_build = std::chrono::steady_clock::now();
    r.t.reset(ql_trainer_new(f, std::move(r.tseq), std::move(r.eseq), a.o, &r.err));
    ql_trainer *t = r.t.get();
    if (!t) {
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        g_cause = r.err;
        if (!writer() || !make_dir(r.out, &r.err)) return 1;
        std::vector<ql_sequence> t2, e2;  // (the sequences went to the trainer: rebuild them for the snapshot)
        ql_dataset_sequences(r.train, a.d, r.pad, &t2);
        ql_dataset_sequences(r.eval, a.d, r.pad, &e2);
        advise(f, t2, e2, a, r.plan);
        write_snapshot(f, t2, e2, a, r.out);
        return 1;
    }
    if ((a.resume && !ql_trainer_load(t, (std::string(a.resume) + "/checkpoint.gguf").c_str(), &r.err)) ||
        (writer() && (!make_dir(r.out, &r.err) || !lock_dir(r.out, &r.err) || !make_dir(r.out + "/peft", &r.err)))) {
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        g_cause = r.err;
        return 1;
    }
    r.total = ql_trainer_total_steps(t), r.per_epoch = ql_trainer_steps_per_epoch(t);
    if (a.resume) {
        std::vector<std::string> unused;
        ql_checkpoint_info((std::string(a.resume) + "/checkpoint.gguf").c_str(), &unused, &r.run_step, &r.run_total, &r.err);
    }
    return 0;
}

// What the run is: the model, the data, the sequences and their padding, the batch and steps,
// LoRA and the optimizer, the precision, warnings for settings that cannot do what they seem to
// ask, and the memory plan.
static void print_run(const args &a, const ft_run &r) {
    const ql_llama_file *f = r.f.get();
    ql_trainer *t = r.t.get();
    const ql_llama_hparams &hp = f->model.hp;
    const ql_dataset &train = r.train;
    const ql_memory_plan &mp = ql_trainer_memory(t);
    printf("finetune: model %s: %s, %d layers, dim %d, %d/%d heads, ffn %d, vocab %d, %s weights %.1f MiB\n", a.model,
           f->arch.c_str(), hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab,
           ql_type_name(f->model.layers[0].wq->type), mib(mp.weights_file));
    printf("finetune: data %s: %lld lines (text %lld, prompt/completion %lld, messages %lld, alpaca %lld), %lld bad, "
           "%lld truncated to %d tokens, %lld with nothing to learn\n",
           a.data, (long long)train.n_lines, (long long)train.n_per_format[0], (long long)train.n_per_format[1],
           (long long)train.n_per_format[2], (long long)train.n_per_format[3], (long long)train.n_bad,
           (long long)train.n_truncated, a.d.seq_len, (long long)train.n_empty);
    printf("finetune: %zu training sequences (%s), %lld supervised tokens; %zu evaluation sequences\n", r.n_train,
           a.d.pack ? "packed" : "one example each", (long long)r.n_targets, r.n_eval);
    {  // what padding costs: one epoch's positions computed against the data's tokens
        int64_t real = 0, padded = 0;
        ql_trainer_epoch_tokens(t, &real, &padded);
        const std::vector<int64_t> &L = ql_trainer_lengths(t);
        std::string ls;
        for (int64_t x : L) ls += (ls.empty() ? "" : ", ") + std::to_string(x);
        const std::string how = !a.o.dynamic_padding ? "every micro-batch to --seq-len " + ls + " (--no-dynamic-padding)"
                                : L.size() > 1     ? "each micro-batch to the shortest of " + ls + " tokens that holds it"
                                                   : "every micro-batch to " + ls + " tokens (the longest sequence's)";
        printf("finetune: padding: %s%s; an epoch computes %lld positions for %lld tokens (%.1f%% padding)\n", how.c_str(),
               a.o.group_by_length ? ", grouped by length" : "", (long long)padded, (long long)real,
               padded ? 100.0 * (double)(padded - real) / (double)padded : 0.0);
    }
    if (g_world > 1)
        printf("finetune: data parallel: %d processes (%s), each computing %d of every step's %d micro-batches; the memory "
               "plan below is each process's\n", g_world, ql_dist_name(), a.o.grad_accum, a.o.grad_accum * g_world);
    const std::string procs = g_world > 1 ? " x " + std::to_string(g_world) + " processes" : "";
    printf("finetune: micro-batch %d%s x accumulation %d%s = effective batch %d sequences; %lld steps (%lld per epoch)%s\n",
           a.o.micro_batch, a.b_auto ? " (-b auto)" : "", a.o.grad_accum, procs.c_str(), a.o.micro_batch * a.o.grad_accum * g_world, (long long)r.total,
           (long long)r.per_epoch,
           ql_trainer_steps_done(t) ? (", resuming after step " + std::to_string(ql_trainer_steps_done(t))).c_str() : "");
    printf("finetune: LoRA r %d, alpha %g%s, dropout %g on", a.o.lora.r, (double)a.o.lora.alpha, a.o.lora.rslora ? " (rsLoRA)" : "",
           (double)a.o.lora.dropout);
    for (const std::string &x : a.o.lora.targets) printf(" %s", x.c_str());
    printf("; %s lr %g (%s, warmup %lld steps), weight decay %g, max grad norm %g\n", ql_name(a.o.optim), (double)a.o.lr,
           ql_name(a.o.scheduler), (long long)ql_trainer_warmup_steps(t),
           (double)a.o.weight_decay, (double)a.o.max_grad_norm);
    printf("finetune: precision %s%s", ql_name(a.o.precision), precision_why(a, mp.device).c_str());
    if (a.o.precision == ql_precision::fp16)
        printf("; loss scale %g, x%g after %d clean steps, x%g and the step skipped on inf/nan gradients",
               ql_trainer_loss_scale(t), (double)a.o.scale_growth, a.o.scale_interval, (double)a.o.scale_backoff);
    printf("\n%s\n", ql_trainable_line(ql_trainer_n_trainable(t), ql_trainer_n_base(t)).c_str());
    // settings that run but cannot do what they seem to ask
    if (ql_trainer_warmup_steps(t) > r.total)
        fprintf(stderr, "finetune: warning: a warmup of %lld steps in a run of %lld: the learning rate never reaches --lr %g\n",
                (long long)ql_trainer_warmup_steps(t), (long long)r.total, (double)a.o.lr);
    if (a.o.lora.r > hp.n_embd)  // (every target matrix has a side of n_embd)
        fprintf(stderr, "finetune: warning: --lora-r %d is above the model's dimension %d: a rank above a matrix's smaller side "
                "adds parameters, not capacity\n", a.o.lora.r, hp.n_embd);
    if (!mp.stages.empty()) print_split(a, mp, hp.n_layer, false);
    else print_memory(mp, ql_name(a.o.optim), a.o.mem_other, "RSS before training", plan_limit(mp, a.o.mem_limit), false);
}

// The peak memory measured against the plan: the process's (VmHWM), and on a device our
// allocations' high-water mark and the whole card's use (context, libraries, ours: its total
// less its free memory)
static void report_peak(const args &a, ft_run &r, const char *when, size_t hwm) {
    const ql_memory_plan &mp = ql_trainer_memory(r.t.get());
    printf("finetune: peak memory %s: %.1f MiB measured (VmHWM), %.1f MiB planned (%+.1f%%)\n", when, mib(hwm),
           mib(r.predicted), 100.0 * ((double)hwm - (double)r.predicted) / (double)r.predicted);
    if (!mp.device) return;
    size_t in_use = 0, ours = 0;
    ql_backend_memory_used(a.be, &in_use, &ours);
    if (!mp.stages.empty()) {  // a split: ours over every card (one process's count), against every card's plan
        size_t planned = 0;
        for (const ql_memory_plan &p : mp.stages) planned += p.total - p.dev_context - p.dev_rounding;
        printf("finetune: device memory %s: ours %.1f MiB peak over %zu cards (planned %.1f, %+.1f%%)\n", when, mib(ours), mp.stages.size(),
               mib(planned), 100.0 * ((double)ours - (double)planned) / (double)std::max<size_t>(1, planned));
        return;
    }
    ql_backend_caps caps{};
    const size_t card = r.card_max =
        std::max(r.card_max, ql_backend_get_caps(a.be, &caps) == QL_OK ? caps.mem_total - caps.mem_free : 0);
    const size_t planned_ours = mp.total - mp.dev_context - mp.dev_rounding;
    printf("finetune: device memory %s: ours %.1f MiB peak (planned %.1f, %+.1f%%); the card in use %.1f MiB (planned %.1f "
           "with context and rounding, %+.1f%%)\n", when, mib(ours), mib(planned_ours),
           100.0 * ((double)ours - (double)planned_ours) / (double)std::max<size_t>(1, planned_ours), mib(card), mib(mp.total),
           100.0 * ((double)card - (double)mp.total) / (double)std::max<size_t>(1, mp.total));
}

// DIR/metrics.jsonl: the kept history of a resumed run goes in whole (temp file, rename), then
// it is open for appending; --overwrite then removes the earlier run's other files. 0, or 1
// after the message (nothing of this run left behind).
static int open_metrics(const args &a, ft_run &r) {
    if (!writer()) {  // data parallel: rank 0 writes the metrics (the others' lines go nowhere)
        r.metrics = fopen("/dev/null", "w");
        return r.metrics ? 0 : 1;
    }
    const std::string &out = r.out;
    if (a.resume)
        keep_metrics(std::string(a.resume) + "/metrics.jsonl", ql_trainer_steps_done(r.t.get()), &r.kept, &r.curve, &r.eval_curve);
    r.mpath = out + "/metrics.jsonl";
    const std::string mtmp = r.mpath + ".tmp";
    FILE *metrics = fopen(mtmp.c_str(), "w");
    const bool mok = metrics && fputs(r.kept.c_str(), metrics) >= 0 && fflush(metrics) == 0 && fsync(fileno(metrics)) == 0;
    int e_write = errno;  // (before fclose can change it)
    if (metrics) fclose(metrics);
    metrics = nullptr;
    if (mok) {
        if (rename(mtmp.c_str(), r.mpath.c_str()) == 0) metrics = fopen(r.mpath.c_str(), "a");
        e_write = errno;
    }
    if (!metrics) {
        unlink(mtmp.c_str());              // nothing of this run is left behind:
        rmdir((out + "/peft").c_str());    // the temporary, and peft/ if this run made it (empty)
        fprintf(stderr, "finetune: %s: cannot write: %s\n", r.mpath.c_str(), strerror(e_write));
        return 1;
    }
    r.metrics = metrics;
    // --overwrite: the earlier run's files go now that this one starts (its metrics were just
    // replaced), so that the directory never holds its adapter beside this run's metrics
    if (a.overwrite && !same_dir(out, a.resume)) {
        std::string gone;
        for (const char *name : k_run_outputs)
            if (strcmp(name, "metrics.jsonl") != 0 && unlink((out + "/" + name).c_str()) == 0)
                gone += std::string(gone.empty() ? "" : ", ") + name;
        if (!gone.empty()) printf("finetune: --overwrite: removed the earlier run's %s from %s\n", gone.c_str(), out.c_str());
    }
    return 0;
}

// DIR/checkpoint.gguf; false after the message
static bool save_checkpoint(ft_run &r) {
    if (!writer()) return true;  // data parallel: rank 0's (every rank holds the same state)
    if (!ql_trainer_save(r.t.get(), (r.out + "/checkpoint.gguf").c_str(), &r.err)) {
        fprintf(stderr, "%sfinetune: %s\n", r.tty ? "\n" : "", r.err.c_str());
        g_cause = r.err;
        return false;
    }
    return true;
}

// the adapter (small: what the user wants) first, then the checkpoint (large); each written
// atomically, so a full disk replaces nothing good
static bool write_outputs(const args &a, ft_run &r) {
    if (!write_adapter(r.f.get(), r.t.get(), a, r.out)) return false;
    if (!save_checkpoint(r)) {
        fprintf(stderr, "finetune: the adapter is written (%s/adapter.gguf, %s/peft/); the checkpoint is not\n", r.out.c_str(),
                r.out.c_str());
        return false;
    }
    return true;
}

// A step that fails ends the run: the exit code 1 after the message. After a non-finite loss or
// gradient (keep: the trainer stopped before the update, and its message says the adapter is the
// last good step's) that adapter and its checkpoint are written; not after a backend error or a
// failed evaluation. A run that did no step leaves no empty metrics.jsonl or peft/ (a rerun
// would be refused for them).
static int failed(const args &a, ft_run &r, bool keep) {
    fprintf(stderr, "%sfinetune: %s\n", r.tty ? "\n" : "", r.err.c_str());
    g_cause = r.err;
    if (!writer()) return 1;  // (rank 0 writes; the job is stopped when this returns)
    ql_trainer *t = r.t.get();
    const int64_t done = ql_trainer_steps_done(t);
    if (done == r.first && r.kept.empty()) unlink(r.mpath.c_str());
    if (done > r.first && keep && ql_trainer_intact(t) && write_outputs(a, r))
        fprintf(stderr, "finetune: the adapter and the checkpoint of step %lld are in %s\n", (long long)done, r.out.c_str());
    rmdir((r.out + "/peft").c_str());  // (only when empty)
    return 1;
}

// One step's line in metrics.jsonl, and on stdout (rewritten in place on a terminal; else the
// first, every twentieth of the run, the last and each evaluated one)
static void log_step(const args &a, const ft_run &r, const ql_step_metrics &m, bool evaluated, double el, double rss, double hwm) {
    FILE *metrics = r.metrics;
    fprintf(metrics, "{\"step\": %lld, \"loss\": %.6f", (long long)m.step, m.loss);
    if (evaluated) fprintf(metrics, ", \"eval_loss\": %.6f", r.last_eval);
    if (a.o.precision == ql_precision::fp16)
        fprintf(metrics, ", \"loss_scale\": %g, \"skipped\": %s, \"skipped_steps\": %lld", m.loss_scale,
                m.skipped ? "true" : "false", (long long)m.skipped_total);
    char gnorm[32] = "null";  // a skipped fp16 step's norm is inf: JSON has no such number
    if (std::isfinite(m.grad_norm)) snprintf(gnorm, sizeof(gnorm), "%.6f", m.grad_norm);
    fprintf(metrics,
            ", \"lr\": %.6g, \"grad_norm\": %s, \"step_seconds\": %.4f, \"tokens_per_s\": %.1f, \"padded_tokens_per_s\": %.1f, "
            "\"supervised_tokens_per_s\": %.1f, \"mem_mib\": %.1f, \"peak_mib\": %.1f, \"planned_mib\": %.1f}\n",
            m.lr, gnorm, m.seconds, r.real_s, r.tok_s, r.sup_s, rss, hwm, mib(r.predicted));
    fflush(metrics);
    const int64_t total = r.total;
    const double eta = (double)(total - m.step) * el / (double)std::max<int64_t>(1, m.step - r.first);
    char line[256], scaler[96] = "";
    if (a.o.precision == ql_precision::fp16)
        snprintf(scaler, sizeof(scaler), "  scale %g%s (%lld skipped)", m.loss_scale, m.skipped ? " SKIPPED" : "",
                 (long long)m.skipped_total);
    snprintf(line, sizeof(line), "step %lld/%lld  loss %.4f%s  lr %.2e%s  %.0f tok/s (%.0f padded)  mem %.0f MiB  ETA %s",
             (long long)m.step, (long long)total, m.loss,
             std::isnan(r.last_eval) ? "" : ("  eval " + std::to_string(r.last_eval).substr(0, 6)).c_str(), m.lr, scaler, r.real_s,
             r.tok_s, rss, hms(eta).c_str());
    if (r.tty)
        printf("\r%-110s", line);
    else if (m.step == r.first + 1 || m.step % std::max<int64_t>(1, total / 20) == 0 || m.step == total || evaluated)
        printf("%s\n", line);
    fflush(stdout);
}

// The loop: the evaluation before training, then the steps (each logged, evaluated every
// eval_every, checkpointed every --save-every) until the last or a stop signal (r.interrupted).
// 0, else the exit code after the message.
static int train_steps(const args &a, ft_run &r) {
    ql_trainer *t = r.t.get();
    const ql_memory_plan &mp = ql_trainer_memory(t);
    if (r.n_eval > 0 && r.first == 0) {  // where the run starts from
        if (!ql_trainer_eval(t, &r.last_eval, &r.err)) return failed(a, r, false);
        r.eval_curve.push_back({0.0, r.last_eval});
        fprintf(r.metrics, "{\"step\": 0, \"eval_loss\": %.6f}\n", r.last_eval);
        printf("finetune: eval loss before training %.4f\n", r.last_eval);
        fflush(stdout);
    }
    // QLORA_DIST_FAIL=RANK:STEP[:kill|:term]: this rank fails, or is sent SIGTERM, as step STEP begins (the tests')
    int fail_rank = -1;
    long long fail_step = -1;
    char fail_how[8] = "";
    if (const char *e = getenv("QLORA_DIST_FAIL")) sscanf(e, "%d:%lld:%7s", &fail_rank, &fail_step, fail_how);
    while (ql_trainer_steps_done(t) < r.total) {
        ql_step_metrics m;
        if (fail_rank == g_rank && fail_step == ql_trainer_steps_done(t) + 1) {
            if (!strcmp(fail_how, "kill")) raise(SIGKILL);
            if (!strcmp(fail_how, "term")) {
                raise(SIGTERM);  // (not a failure: this rank asks every one to stop after the step)
            } else {
                r.err = "step " + std::to_string(fail_step) + ": a failure made on purpose (QLORA_DIST_FAIL)";
                return failed(a, r, false);
            }
        }
        if (!ql_trainer_step(t, &m, &r.err)) return failed(a, r, true);
        r.tokens += m.tokens;
        r.real += m.real_tokens;
        r.supervised += m.targets;
        const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.t0).count();
        r.tok_s = (double)r.tokens / std::max(el, 1e-9);
        r.real_s = (double)r.real / std::max(el, 1e-9);
        r.sup_s = (double)r.supervised / std::max(el, 1e-9);
        r.last_loss = m.loss;
        r.curve.push_back({(double)m.step, m.loss});
        bool evaluated = false;
        if (r.n_eval > 0 && (m.step % r.eval_every == 0 || m.step == r.total)) {
            if (!ql_trainer_eval(t, &r.last_eval, &r.err)) return failed(a, r, false);
            r.eval_curve.push_back({(double)m.step, r.last_eval});
            evaluated = true;
        }
        const double rss = rss_mib(), hwm = peak_rss_mib();  // read once per step (/proc)
        log_step(a, r, m, evaluated, el, rss, hwm);
        if (m.step == r.first + 1) {
            if (r.tty) printf("\n");
            report_peak(a, r, "after step 1", (size_t)(hwm * 1048576.0));
            if (a.profile && r.total > m.step) {  // the profile from step 2: step 1 pays first calls (GPU modules, first touch)
                ql_graph_set_profile(ql_trainer_graph(t), true);
                r.profiled_from = m.step;
            }
        }
        if (a.o.mem_limit && !mp.device && !r.warned && hwm * 1048576.0 > (double)(a.o.mem_limit / 10 * 9)) {  // (on a device it limits device memory)
            fprintf(stderr, "%sfinetune: warning: memory %.0f MiB is above 90%% of --mem-limit %.0f MiB\n", r.tty ? "\n" : "",
                    hwm, mib(a.o.mem_limit));
            r.warned = true;
        }
        if (a.save_every > 0 && m.step % a.save_every == 0 && !save_checkpoint(r)) return 1;
        // data parallel: a signal reaches one rank or all, at different steps: they stop together
        int64_t stop = g_stop.load() != 0;
        if (g_world > 1 && ql_dist_allreduce_i64(&stop, 1) != QL_OK) {
            r.err = std::string("the stop flag's all-reduce (") + ql_dist_name() + ") failed";
            return failed(a, r, false);
        }
        if (stop) {
            int none = 0;
            g_stop.compare_exchange_strong(none, SIGTERM);  // (another rank's signal: the exit code of a SIGTERM)
            r.interrupted = true;
            break;
        }
    }
    return 0;
}

// Data parallel: every rank's adapter and optimizer state the same as rank 0's (they took the
// same summed gradients and made the same updates), checked by a checksum; 0, or 1 after the message
static int check_ranks_agree(ft_run &r) {
    if (g_world == 1) return 0;
    uint64_t h = 0, h0 = 0;
    int64_t differ = 0;
    if (!ql_trainer_state_hash(r.t.get(), &h)) {
        r.err = "the adapter could not be read back for the ranks' comparison";
        g_cause = r.err;
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    h0 = h;
    if (ql_dist_broadcast(&h0, sizeof(h0), 0) != QL_OK || (differ = h0 != h, ql_dist_allreduce_i64(&differ, 1) != QL_OK)) {
        r.err = std::string("the ranks' comparison of their adapters (") + ql_dist_name() + ") failed";
        g_cause = r.err;
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    if (differ) {  // a bug, not the user's: the run's outputs would be one rank's arbitrary choice
        char sums[64];
        snprintf(sums, sizeof(sums), "%016llx here, %016llx on rank 0", (unsigned long long)h, (unsigned long long)h0);
        r.err = "after step " + std::to_string(ql_trainer_steps_done(r.t.get())) + " the adapters of " + std::to_string(differ) + " of " +
                std::to_string(g_world) + " processes differ from rank 0's (checksum " + sums + "): the run's outputs are not written";
        g_cause = r.err;
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    printf("finetune: data parallel: the adapter and its optimizer state are the same on all %d processes (checksum %016llx)\n",
           g_world, (unsigned long long)h);
    return 0;
}

// An interrupted run: its checkpoint, and 128 + the signal (the shell's convention for a run a
// signal ended: 130 for SIGINT, 143 for SIGTERM); 1 when the checkpoint cannot be saved
static int save_interrupted(ft_run &r) {
    if (!save_checkpoint(r)) return 1;
    const int sig = g_stop.load();
    printf("finetune: interrupted (%s) after step %lld: checkpoint saved in %s --> resume with --resume %s\n",
           sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "SIGINT", (long long)ql_trainer_steps_done(r.t.get()), r.out.c_str(),
           r.out.c_str());
    fflush(stdout);
    return 128 + sig;
}

// A finished run's outputs - write_outputs (adapter, checkpoint), the merged model, loss.png -
// and its summary: steps, speed, losses, peak memory, the files, the profile. The exit code.
static int write_results(const args &a, ft_run &r) {
    ql_trainer *t = r.t.get();
    const std::string &out = r.out;
    if (!writer()) {  // data parallel: rank 0 writes the outputs
        fclose(r.metrics);
        return 0;
    }
    if (!write_outputs(a, r)) return 1;
    ql_llama &m = ql_trainer_model(t);
    if (a.merge && !ql_llama_save_merged((out + "/merged.gguf").c_str(), *r.f, m, &r.err)) {
        fprintf(stderr, "finetune: %s\n", r.err.c_str());
        return 1;
    }
    if (!ql_plot_losses((out + "/loss.png").c_str(), r.curve, r.eval_curve, &r.err)) fprintf(stderr, "finetune: note: %s\n", r.err.c_str());
    fclose(r.metrics);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.t0).count();
    const int64_t first = r.first;
    if (ql_trainer_steps_done(t) == first)
        printf("finetune: the checkpoint had finished all %lld steps; outputs written again (--max-steps or --epochs with more "
               "extend the run)", (long long)first);
    else {  // the steps this invocation ran; a resumed run also where that ends the run
        const int64_t done = ql_trainer_steps_done(t);
        printf("finetune: done: %lld steps", (long long)(done - first));
        if (first > 0) printf(" this run (resumed after step %lld; now step %lld of %lld)", (long long)first, (long long)done, (long long)r.total);
        printf(" in %s, %.0f tokens/s (%.0f supervised, %.0f computed with padding); final loss %.4f", hms(secs).c_str(), r.real_s,
               r.sup_s, r.tok_s, r.last_loss);
    }
    if (!std::isnan(r.last_eval)) printf(", eval loss %.4f", r.last_eval);
    printf("\n");
    report_peak(a, r, "of training", r.train_peak);
    size_t dev_now = 0, dev_peak = 0;
    if (ql_backend_memory_used(a.be, &dev_now, &dev_peak))  // (the device's context itself not counted)
        printf("finetune: device memory: peak %.1f MiB allocated by qlora\n", mib(dev_peak));
    printf("finetune: wrote %s/adapter.gguf, %s/peft/, %s/metrics.jsonl, %s/loss.png, %s/checkpoint.gguf%s\n", out.c_str(),
           out.c_str(), out.c_str(), out.c_str(), out.c_str(), a.merge ? (", " + out + "/merged.gguf").c_str() : "");
    if (a.profile) {
        if (r.profiled_from > first) printf("finetune: profile: steps %lld-%lld (step %lld left out: first calls)\n",
                                            (long long)r.profiled_from + 1, (long long)ql_trainer_steps_done(t), (long long)r.profiled_from);
        print_profile(ql_trainer_graph(t), ql_trainer_memory(t).census, (double)(ql_trainer_steps_done(t) - r.profiled_from) * a.o.grad_accum);
    }
    return 0;
}

static int run(int argc, char **argv) {
    args a;
    const bool parsed = parse(argc, argv, &a);
    owned<ql_backend> be_(a.be, ql_backend_free);  // made once by resolve_device; freed after everything that uses it (r)
    struct free_rest {  // a split's other cards
        std::vector<ql_backend *> v;
        ~free_rest() {
            for (ql_backend *b : v) ql_backend_free(b);
        }
    } rest_{a.split_be.size() > 1 ? std::vector<ql_backend *>(a.split_be.begin() + 1, a.split_be.end()) : std::vector<ql_backend *>()};
    if (!parsed) return 2;
    if (!a.plan_line.empty()) fputs(a.plan_line.c_str(), stdout);
    // glibc raises its mmap threshold as large blocks are freed, after which planning's
    // temporaries stay in the heap: fixed thresholds give them back, so RSS is what the plan says
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 20);
    ft_run r;
    r.tty = isatty(fileno(stdout)) && g_world == 1;  // (under mpirun stdout is its pty, whatever the end is)

    if (const int rc = load_model(a, r)) return rc;
    if (const int rc = load_data(a, r)) return rc;
    r.out = a.resume && !a.out_given ? std::string(a.resume) : a.out;
    if (const int rc = check_out_dir(a, r.out)) return rc;
    if (const int rc = plan_memory(a, r); rc >= 0) return rc;
    if (const int rc = build_trainer(a, r)) return rc;
    print_run(a, r);
    printf("finetune: planned and allocated in %.2f s\n",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - r.t_build).count());
    fflush(stdout);
    ql_trainer *t = r.t.get();
    r.predicted = ql_plan_process(ql_trainer_memory(t), a.o.mem_other) + ql_trainer_memory(t).host;
    // the weight pages now rather than during step one, and the peak counted from here: loading's
    // temporaries are not the training run's
    ql_trainer_page_in_weights(t);
    reset_hwm();
    if (a.profile) ql_graph_set_profile(ql_trainer_graph(t), true);
    if (a.export_dir)
        return !writer() || export_adapter(r.f.get(), t, a, r.out, r.run_step, r.run_total > 0 ? r.run_total : r.total) ? 0 : 1;
    if (a.resume && r.run_total > 0 && r.total != r.run_total)
        printf("finetune: the run had %lld steps, now %lld (--max-steps/--epochs): the learning-rate schedule spans the new total\n",
               (long long)r.run_total, (long long)r.total);

    for (int s : k_stop_signals) signal(s, on_stop_signal);
    if (const int rc = open_metrics(a, r)) return rc;
    r.eval_every = a.eval_every > 0 ? a.eval_every : std::max<int64_t>(1, r.total / 10);
    r.t0 = std::chrono::steady_clock::now();
    r.first = r.profiled_from = ql_trainer_steps_done(t);
    if (const int rc = train_steps(a, r)) return rc;
    if (const int rc = check_ranks_agree(r)) return rc;
    r.train_peak = hwm_bytes();
    if (r.tty) printf("\n");
    // from here on every file is written atomically: a signal loses nothing (but for an interrupted
    // run, whose checkpoint a repeat of its SIGTERM/SIGHUP must not stop: on_stop_signal's choice stays)
    if (!r.interrupted)
        for (int s : k_stop_signals) signal(s, SIG_DFL);
    if (r.interrupted) {
        g_cause.clear();  // (every rank agreed to stop: not a failure to spread)
        return save_interrupted(r);
    }
    return write_results(a, r);
}

int main(int argc, char **argv) {
    char err[256];
    if (ql_dist_init(&argc, &argv, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "finetune: %s\n", err);
        return 1;
    }
    g_rank = ql_dist_rank(), g_world = ql_dist_size();
    // data parallel: rank 0 alone prints (the others' errors and warnings still reach stderr)
    if (g_world > 1 && !writer() && !freopen("/dev/null", "w", stdout)) return 1;
    const int rc = run(argc, argv);
    if (g_world > 1 && rc != 0 && (rc < 128 || !g_cause.empty())) {
        // the others may be waiting for this one in a collective: the job ends here
        fflush(stdout);
        const std::string msg = "finetune stopped (exit code " + std::to_string(rc) + "): " +
                                (g_cause.empty() ? std::string("the reason is in its message above") : ql_user_message(g_cause)) +
                                "; stopping every process";
        ql_dist_abort(rc, msg.c_str());
    }
    ql_dist_free();
    return rc;
}
