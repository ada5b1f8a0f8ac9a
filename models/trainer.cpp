// models/trainer.cpp - LoRA fine-tuning (see trainer.h).
#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace {

// splitmix64: data order and dropout seeds, the same on every platform
uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// the inputs and the loss of one graph: a batch of B sequences of T tokens
struct batch_io {
    ql_tensor *tokens = nullptr, *pos = nullptr, *seg = nullptr, *targets = nullptr, *count = nullptr, *loss = nullptr;
    ql_graph *gf = nullptr, *g = nullptr;  // g: what runs (gf itself, or its backward graph)
};

}  // namespace

struct ql_trainer {
    ql_llama_file *f = nullptr;
    ql_train_options o;
    std::vector<ql_sequence> train, eval;
    int64_t T = 0, B = 0;
    bool packed = false;  // sequences hold several documents: attention needs the segment ids
    ql_context *ctx = nullptr;
    ql_backend *cpu = nullptr;
    ql_tensor *seed = nullptr;
    batch_io tr, ev;
    std::vector<ql_tensor *> params, adam_m, adam_v;
    ql_plan_stats plan{};
    int64_t step = 0, total = 0, per_epoch = 0, warmup = 0;
    std::vector<int64_t> order;  // the current epoch's visiting order
    int64_t order_epoch = -1;
    std::vector<const ql_sequence *> slot;  // [micro_batch * grad_accum] a step's sequences (NULL: none)
};

static batch_io make_io(ql_context *ctx, const ql_llama &m, int64_t T, int64_t B, bool packed, bool backward) {
    batch_io io;
    io.tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    io.pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    io.seg = packed ? ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B)) : nullptr;
    io.targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
    io.count = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
    ql_tensor *logits = ql_llama_forward(ctx, &m, io.tokens, io.pos, io.seg);
    io.loss = ql_cross_entropy(ctx, logits ? ql_reshape_2d(ctx, logits, logits->ne[0], T * B) : nullptr, io.targets, io.count);
    io.gf = ql_graph_new(ctx);
    ql_graph_build_forward(io.gf, io.loss);
    io.g = backward ? ql_graph_backward(ctx, io.gf, io.loss) : io.gf;
    return io;
}

static void free_io(batch_io &io) {
    if (io.g != io.gf) ql_graph_free(io.g);
    ql_graph_free(io.gf);
    io = batch_io();
}

// adapters, both graphs and the optimizer state in ctx (a measuring context, or the real one)
static bool build(ql_trainer *t, ql_context *ctx) {
    ql_llama &m = t->f->model;
    t->seed = ql_set_input(ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1), "dropout_seed"));
    if (ql_llama_add_lora(ctx, &m, t->o.lora, t->seed) != QL_OK) return false;
    t->params = ql_llama_lora_params(m);
    m.lora_dropout = true;
    t->tr = make_io(ctx, m, t->T, t->B, t->packed, true);
    m.lora_dropout = false;  // evaluation: no dropout
    t->ev = make_io(ctx, m, t->T, t->B, t->packed, false);
    m.lora_dropout = true;
    t->adam_m.clear();
    t->adam_v.clear();
    for (ql_tensor *p : t->params) {
        t->adam_m.push_back(ql_format_name(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne), "%s.adam_m", p->name));
        t->adam_v.push_back(ql_format_name(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne), "%s.adam_v", p->name));
    }
    return ql_ctx_status(ctx) == QL_OK && t->tr.g;
}

double ql_trainer_lr_at(const ql_trainer *t, int64_t s) {  // transformers' schedules, step from 0
    const ql_train_options &o = t->o;
    if (o.scheduler == "constant") return o.lr;  // transformers' "constant" has no warmup
    if (s < t->warmup) return o.lr * (double)s / (double)std::max<int64_t>(1, t->warmup);
    if (o.scheduler == "constant_with_warmup") return o.lr;
    const double progress = (double)(s - t->warmup) / (double)std::max<int64_t>(1, t->total - t->warmup);
    if (o.scheduler == "linear") return o.lr * std::max(0.0, 1.0 - progress);
    return o.lr * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));  // cosine, half a cycle
}

ql_trainer *ql_trainer_new(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                           const ql_train_options &o, std::string *err) {
    if (train.empty()) {
        *err = "no training sequences";
        return nullptr;
    }
    if (o.micro_batch < 1 || o.grad_accum < 1 || !(o.lr >= 0) || o.epochs < 1 ||
        (o.scheduler != "constant" && o.scheduler != "constant_with_warmup" && o.scheduler != "linear" && o.scheduler != "cosine")) {
        *err = "bad training options (micro-batch and accumulation >= 1, lr >= 0, epochs >= 1, "
               "scheduler constant|constant_with_warmup|linear|cosine)";
        return nullptr;
    }
    ql_trainer *t = new ql_trainer();
    t->f = f;
    t->o = o;
    t->train = train;
    t->eval = eval;
    t->T = (int64_t)train[0].tokens.size();
    t->B = o.micro_batch;
    t->packed = o.packed;
    const int64_t per_step = (int64_t)o.micro_batch * o.grad_accum;
    t->per_epoch = ((int64_t)train.size() + per_step - 1) / per_step;
    t->total = o.max_steps > 0 ? o.max_steps : t->per_epoch * o.epochs;
    t->warmup = o.scheduler == "constant"  ? 0  // as transformers: warmup_steps if > 0, else ceil(ratio * total)
                : o.warmup_steps > 0       ? o.warmup_steps
                                           : (int64_t)std::ceil(o.warmup_ratio * (double)t->total);
    t->slot.assign((size_t)per_step, nullptr);
    t->order.reserve(train.size());

    // sizes first (a measuring pass), then one arena
    ql_init_params mp = {0, nullptr, false, true};
    ql_context *meas = ql_init(mp);
    const bool ok = build(t, meas);
    const size_t need = ql_used_mem(meas);
    if (!ok) *err = ql_ctx_error(meas);
    free_io(t->tr);
    free_io(t->ev);
    ql_free(meas);
    if (!ok) {
        ql_trainer_free(t);
        return nullptr;
    }
    ql_init_params ip = {need + (1u << 16), nullptr, false, false};
    t->ctx = ql_init(ip);
    t->cpu = ql_backend_cpu_init(o.threads);
    // evaluation runs between steps: its graph lives in the training graph's buffer (whose
    // gradients are zeroed at the start of every step anyway), so the plan printed is the peak
    bool ok_alloc = t->ctx && build(t, t->ctx) && ql_graph_plan(t->tr.g, t->cpu, &t->plan) == QL_OK &&
                    ql_graph_alloc(t->tr.g, t->cpu) == QL_OK;
    if (ok_alloc && ql_graph_plan(t->ev.g, t->cpu, nullptr) == QL_OK) {
        ql_plan_stats es;
        ql_graph_get_stats(t->ev.g, &es);
        ok_alloc = es.buffer_size <= t->plan.buffer_size ? ql_graph_alloc_shared(t->ev.g, t->cpu, t->tr.g) == QL_OK
                                                         : ql_graph_alloc(t->ev.g, t->cpu) == QL_OK;
    } else {
        ok_alloc = false;
    }
    if (!ok_alloc) {
        *err = t->ctx ? ql_ctx_error(t->ctx) : "out of memory";
        ql_trainer_free(t);
        return nullptr;
    }
    for (size_t i = 0; i < t->params.size(); i++) {
        ql_tensor_fill_f32(t->adam_m[i], 0.0f);
        ql_tensor_fill_f32(t->adam_v[i], 0.0f);
    }
    return t;
}

void ql_trainer_free(ql_trainer *t) {
    if (!t) return;
    free_io(t->tr);
    free_io(t->ev);
    ql_backend_free(t->cpu);
    ql_free(t->ctx);
    if (t->f) {  // the model's adapters pointed into ctx
        t->f->model.lora.clear();
    }
    delete t;
}

int64_t ql_trainer_total_steps(const ql_trainer *t) { return t->total; }
int64_t ql_trainer_steps_done(const ql_trainer *t) { return t->step; }
int64_t ql_trainer_steps_per_epoch(const ql_trainer *t) { return t->per_epoch; }
int64_t ql_trainer_warmup_steps(const ql_trainer *t) { return t->warmup; }
const ql_plan_stats &ql_trainer_plan(const ql_trainer *t) { return t->plan; }
ql_llama &ql_trainer_model(ql_trainer *t) { return t->f->model; }
ql_graph *ql_trainer_graph(ql_trainer *t) { return t->tr.g; }

int64_t ql_trainer_n_trainable(const ql_trainer *t) {
    int64_t n = 0;
    for (const ql_tensor *p : t->params) n += ql_nelements(p);
    return n;
}

int64_t ql_trainer_n_base(const ql_trainer *t) {
    const ql_llama &m = t->f->model;
    int64_t n = ql_nelements(m.tok_embd) + ql_nelements(m.out_norm) + (m.output != m.tok_embd ? ql_nelements(m.output) : 0);
    for (const ql_llama_layer &L : m.layers)
        for (const ql_tensor *w : {L.attn_norm, L.wq, L.wk, L.wv, L.bq, L.bk, L.bv, L.wo, L.ffn_norm, L.w_gate, L.w_up, L.w_down})
            if (w) n += ql_nelements(w);
    return n;
}

size_t ql_trainer_state_bytes(const ql_trainer *t) {
    return (size_t)ql_trainer_n_trainable(t) * 4 * sizeof(float);  // weights, gradients, two moments
}

// sequence index of slot `i` (0 .. micro*accum-1) of step s, or -1 past the epoch's end
static int64_t slot_sequence(ql_trainer *t, int64_t s, int64_t i) {
    const int64_t epoch = s / t->per_epoch, at = (s % t->per_epoch) * t->o.micro_batch * t->o.grad_accum + i;
    const int64_t n = (int64_t)t->train.size();
    if (at >= n) return -1;
    if (t->order_epoch != epoch) {  // Fisher-Yates from (seed, epoch)
        t->order.resize((size_t)n);
        for (int64_t k = 0; k < n; k++) t->order[(size_t)k] = k;
        uint64_t state = t->o.seed ^ (0xA0761D6478BD642Full * (uint64_t)(epoch + 1));
        for (int64_t k = n - 1; k > 0; k--) {
            state = mix(state);
            std::swap(t->order[(size_t)k], t->order[(size_t)(state % (uint64_t)(k + 1))]);
        }
        t->order_epoch = epoch;
    }
    return t->order[(size_t)at];
}

// writes B sequences (NULL: empty, all targets -1) into a graph's inputs
static void fill(const batch_io &io, int64_t T, int64_t B, const ql_sequence *const *seqs) {
    int32_t *tk = (int32_t *)io.tokens->data, *ps = (int32_t *)io.pos->data, *tg = (int32_t *)io.targets->data;
    int32_t *sg = io.seg ? (int32_t *)io.seg->data : nullptr;
    for (size_t b = 0; b < (size_t)B; b++) {
        const ql_sequence *s = seqs[b];
        for (int64_t i = 0; i < T; i++) {
            const size_t k = b * (size_t)T + (size_t)i;
            tk[k] = s ? s->tokens[(size_t)i] : 0;
            ps[k] = s ? s->pos[(size_t)i] : (int32_t)i;
            tg[k] = s ? s->targets[(size_t)i] : -1;
            if (sg) sg[k] = s ? s->seg[(size_t)i] : 0;
        }
    }
}

bool ql_trainer_step(ql_trainer *t, ql_step_metrics *m, std::string *err) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t s = t->step, B = t->B, A = t->o.grad_accum;
    // the step's sequences, and its supervised-token count (the loss's denominator)
    int64_t targets = 0;
    for (int64_t i = 0; i < B * A; i++) {
        const int64_t q = slot_sequence(t, s, i);
        t->slot[(size_t)i] = q >= 0 ? &t->train[(size_t)q] : nullptr;
        if (q >= 0) targets += t->train[(size_t)q].n_targets;
    }
    if (targets == 0) {
        *err = "step " + std::to_string(s + 1) + " has no supervised tokens";
        return false;
    }
    ql_graph_zero_grads(t->tr.g);
    *(float *)t->tr.count->data = (float)targets;
    double loss = 0;
    for (int64_t a = 0; a < A; a++) {
        fill(t->tr, t->T, B, t->slot.data() + a * B);
        *(int32_t *)t->seed->data = (int32_t)(uint32_t)mix(t->o.seed * 0x9E3779B97F4A7C15ull + (uint64_t)(s * A + a));
        if (ql_backend_graph_compute(t->cpu, t->tr.g) != QL_OK) {
            *err = ql_ctx_error(t->ctx);
            return false;
        }
        const float l = *(const float *)t->tr.loss->data;
        if (!std::isfinite(l)) {
            *err = "step " + std::to_string(s + 1) + ", micro-batch " + std::to_string(a + 1) + ": the loss is " +
                   (std::isnan(l) ? "nan" : "infinite") + " --> hint: a lower --lr, or check the data";
            return false;
        }
        loss += l;
    }
    double sq = 0;  // the global gradient norm, then clipping folded into the update's scale
    for (const ql_tensor *p : t->params) {
        const float *g = (const float *)p->grad->data;
        for (int64_t i = 0; i < ql_nelements(p); i++) sq += (double)g[i] * g[i];
    }
    const double norm = std::sqrt(sq);
    if (!std::isfinite(norm)) {
        *err = "step " + std::to_string(s + 1) + ": the gradient norm is not finite";
        return false;
    }
    const float clip = (t->o.max_grad_norm > 0 && norm > t->o.max_grad_norm) ? (float)(t->o.max_grad_norm / (norm + 1e-6)) : 1.0f;
    const double lr = ql_trainer_lr_at(t, s);
    const ql_adamw_params hp = {(float)lr, t->o.beta1, t->o.beta2, t->o.eps, t->o.weight_decay};
    for (size_t i = 0; i < t->params.size(); i++) ql_adamw_update(t->params[i], t->adam_m[i], t->adam_v[i], s + 1, &hp, clip);
    t->step++;
    m->step = t->step;
    m->loss = loss;
    m->lr = lr;
    m->grad_norm = norm;
    m->tokens = B * A * t->T;
    m->targets = targets;
    m->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return true;
}

bool ql_trainer_eval(ql_trainer *t, double *loss, std::string *err) {
    int64_t targets = 0;
    for (const ql_sequence &s : t->eval) targets += s.n_targets;
    if (targets == 0) {
        *err = "no evaluation tokens";
        return false;
    }
    *(float *)t->ev.count->data = (float)targets;
    double sum = 0;
    for (size_t i = 0; i < t->eval.size(); i += (size_t)t->B) {
        for (size_t b = 0; b < (size_t)t->B; b++) t->slot[b] = i + b < t->eval.size() ? &t->eval[i + b] : nullptr;
        fill(t->ev, t->T, t->B, t->slot.data());
        if (ql_backend_graph_compute(t->cpu, t->ev.g) != QL_OK) {
            *err = ql_ctx_error(t->ctx);
            return false;
        }
        sum += *(const float *)t->ev.loss->data;
    }
    *loss = sum;
    return true;
}

// ---- checkpoints ----

// The settings a resumed run must share with the one that saved the checkpoint (anything that
// changes the data order, the masks, the schedule or the update), as (key, value) text, so that
// a mismatch can be named. The data enter by a fingerprint of every training token and target.
static std::vector<std::pair<std::string, std::string>> run_settings(const ql_trainer *t) {
    std::string targets;
    for (const std::string &x : t->o.lora.targets) targets += (targets.empty() ? "" : ",") + x;
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the sequences
    auto mix = [&h](int32_t v) {
        for (int k = 0; k < 4; k++) h = (h ^ ((uint32_t)v >> (8 * k) & 0xffu)) * 1099511628211ull;
    };
    for (const ql_sequence &q : t->train) {
        for (int32_t v : q.tokens) mix(v);
        for (int32_t v : q.targets) mix(v);
        for (int32_t v : q.seg) mix(v);
    }
    char hex[20];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)h);
    auto num = [](double v) {
        char b[32];
        snprintf(b, sizeof(b), "%.9g", v);
        return std::string(b);
    };
    const ql_train_options &o = t->o;
    return {{"architecture", t->f->arch},
            {"training data", std::to_string(t->train.size()) + " sequences of " + std::to_string(t->T) + " tokens, fingerprint " + hex},
            {"seed", std::to_string(o.seed)},
            {"micro-batch", std::to_string(o.micro_batch)},
            {"gradient accumulation", std::to_string(o.grad_accum)},
            {"total steps", std::to_string(t->total)},
            {"lora r", std::to_string(o.lora.r)},
            {"lora alpha", num(o.lora.alpha)},
            {"rslora", o.lora.rslora ? "yes" : "no"},
            {"lora dropout", num(o.lora.dropout)},
            {"lora targets", targets},
            {"lora init seed", std::to_string(o.lora.init_seed)},
            {"learning rate", num(o.lr)},
            {"scheduler", o.scheduler + ", warmup " + std::to_string(t->warmup) + " steps"},
            {"adamw", "betas " + num(o.beta1) + " " + num(o.beta2) + ", eps " + num(o.eps) + ", weight decay " + num(o.weight_decay)},
            {"max grad norm", num(o.max_grad_norm)}};
}

bool ql_trainer_save(const ql_trainer *t, const char *path, std::string *err) {
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", t->f->arch.c_str());
    ql_gguf_set_str(w, "general.type", "qlora-checkpoint");
    ql_gguf_set_u32(w, "qlora.checkpoint.version", 1);
    ql_gguf_set_u64(w, "qlora.checkpoint.step", (uint64_t)t->step);
    for (const auto &kv : run_settings(t)) ql_gguf_set_str(w, ("qlora.run." + kv.first).c_str(), kv.second.c_str());
    for (size_t i = 0; i < t->params.size(); i++)
        for (const ql_tensor *x : {t->params[i], t->adam_m[i], t->adam_v[i]}) {
            const int64_t ne[4] = {x->ne[0], x->ne[1], 1, 1};
            if (ql_gguf_add_tensor(w, x->name, QL_TYPE_F32, 2, ne, x->data, ql_nbytes(x)) != QL_OK) {
                *err = std::string(path) + ": tensor " + x->name + " could not be added";
                ql_gguf_writer_free(w);
                return false;
            }
        }
    char e[512];
    const bool ok = ql_gguf_write(w, path, e, sizeof(e)) == QL_OK;
    if (!ok) *err = e;
    ql_gguf_writer_free(w);
    return ok;
}

bool ql_trainer_load(ql_trainer *t, const char *path, std::string *err) {
    char e[512];
    ql_gguf *g = ql_gguf_open(path, e, sizeof(e));
    if (!g) {
        *err = e;
        return false;
    }
    auto str = [&](const std::string &key, bool *found) {
        size_t len;
        const int64_t i = ql_gguf_find_kv(g, key.c_str());
        const char *s = i >= 0 ? ql_gguf_get_str(g, i, &len) : nullptr;
        if (found) *found = s != nullptr;
        return std::string(s ? s : "");
    };
    std::string why;
    uint64_t ver = 0, step = 0;
    int64_t iv = ql_gguf_find_kv(g, "qlora.checkpoint.version"), is = ql_gguf_find_kv(g, "qlora.checkpoint.step");
    if (str("general.type", nullptr) != "qlora-checkpoint" || iv < 0 || !ql_gguf_get_u64(g, iv, &ver) || ver != 1 || is < 0 ||
        !ql_gguf_get_u64(g, is, &step))
        why = "not a qlora checkpoint (version 1)";
    for (const auto &kv : run_settings(t)) {  // every difference, named
        if (!why.empty() && why.rfind("another run", 0) != 0) break;
        bool found = false;
        const std::string was = str("qlora.run." + kv.first, &found);
        if (found && was == kv.second) continue;
        why += (why.empty() ? "another run: " : "; ") + kv.first + " was " + (found ? was : "(not recorded)") + ", now " + kv.second;
    }
    if (!why.empty() && why.rfind("another run", 0) == 0) why += " --> hint: resume with the same data and flags";
    if (why.empty() && step > (uint64_t)t->total)
        why = "it is at step " + std::to_string(step) + ", past this run's " + std::to_string(t->total) + " steps";
    for (int pass = 0; pass < 2 && why.empty(); pass++)  // check every tensor, then copy: all or nothing
        for (size_t i = 0; i < t->params.size() && why.empty(); i++)
            for (ql_tensor *x : {t->params[i], t->adam_m[i], t->adam_v[i]}) {
                const int64_t k = ql_gguf_find_tensor(g, x->name);
                if (k < 0 || ql_gguf_tensor_type(g, k) != QL_TYPE_F32 || ql_gguf_tensor_size(g, k) != ql_nbytes(x)) {
                    why = std::string("tensor ") + x->name + " is missing or of another shape";
                    break;
                }
                if (pass == 1) memcpy(x->data, ql_gguf_tensor_data(g, k), ql_nbytes(x));
            }
    ql_gguf_close(g);
    if (!why.empty()) {
        *err = std::string(path) + ": " + why;
        return false;
    }
    t->step = (int64_t)step;
    return true;
}

std::string ql_trainable_line(int64_t trainable, int64_t base) {
    auto commas = [](int64_t v) {
        std::string s = std::to_string(v);
        for (int i = (int)s.size() - 3; i > 0; i -= 3) s.insert((size_t)i, ",");
        return s;
    };
    const int64_t all = trainable + base;  // PEFT counts the adapter among all params
    char pct[32];
    snprintf(pct, sizeof(pct), "%.4f", all > 0 ? 100.0 * (double)trainable / (double)all : 0.0);
    return "trainable params: " + commas(trainable) + " || all params: " + commas(all) + " || trainable%: " + pct;
}
