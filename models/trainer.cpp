// models/trainer.cpp - LoRA fine-tuning (see trainer.h).
#include "trainer.h"

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

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
    ql_tensor *embd = nullptr;  // [n_embd, T, B] f32: rows gathered on the host (embd_host), instead of tokens
    ql_graph *gf = nullptr, *g = nullptr;  // g: what runs (gf itself, or its backward graph)
    // a stage of a split (blocks [l0, l1) of the model on one device): the residual stream coming
    // in (stages after the first; training: a leaf with a gradient, the one going back), the one
    // going out (stages before the last) and the gradient that comes back for it, all [n_embd, T, B] f32
    ql_tensor *h_in = nullptr, *h_out = nullptr, *g_out = nullptr;
};

}  // namespace

struct ql_trainer {
    ql_llama_file *f = nullptr;
    ql_train_options o;
    const std::vector<ql_sequence> *train = nullptr, *eval = nullptr;  // the run's own, or (planning) the caller's
    std::vector<ql_sequence> own_train, own_eval;
    int64_t T = 0, B = 0;   // the training graph's length (the longest sequence's bucket) and micro-batch
    int64_t seq_len = 0;    // the sequences' length (--seq-len)
    // dynamic padding: the lengths of the training graphs (ascending; the last is T, t->tr) and
    // the graphs of the shorter ones; a micro-batch runs in the shortest that holds it
    std::vector<int64_t> bucket_len;
    std::vector<batch_io> bucket_io;  // [bucket_len.size() - 1]
    bool packed = false;  // sequences hold several documents: attention needs the segment ids
    ql_context *ctx = nullptr;
    ql_backend *be = nullptr;      // the backend that trains: the caller's (o.backend), or own_be
    ql_backend *own_be = nullptr;  // the CPU backend made here when the caller gave none
    ql_backend_caps caps{};        // what it is and has (host, stand-in, cc, memory, context)
    // a device backend: the placements of the weights and of the run's tensors (adapter, grads,
    // moments, inputs); each keeps its tensors' host bytes, which checkpoints are written from
    ql_backend_buffer *weights_buf = nullptr, *state_buf = nullptr;
    ql_backend_buffer *paged_buf = nullptr;  // paged_* on a device: the moments in pinned host memory
    bool on_host = true;
    std::vector<int32_t> in_tokens, in_pos, in_targets, in_seg;  // [T * B] staging for set
    ql_backend_buffer *embd_buf = nullptr;  // embd_host: the rows input in pinned host memory (the shorter lengths' share it)
    std::vector<std::pair<ql_tensor *, void *>> embd_alias;  // those shorter lengths' inputs, and their own bytes
    bool embd_host = false;      // the token embedding stays in host memory (QL_FLAG_HOST)
    // --cache-weights: the frozen weights that get a copy in the compute type (flagged while the
    // plan has them: QL_FLAG_CACHED), and on a device the buffer of the copies
    bool cache = false;
    std::vector<ql_tensor *> cache_w;
    ql_backend_buffer *cache_buf = nullptr;
    int64_t loss_chunk = 0;      // rows per cross-entropy chunk (0: one)
    int64_t auto_chunk = 0;      // what auto would choose (0: one chunk suffices)
    int64_t ffn_chunk = 0;       // tokens per feed-forward chunk (0: whole)
    int64_t auto_ffn_chunk = 0;  // what auto would choose (0: one chunk suffices)
    size_t attn_score = 0;       // attention's score budget (0: the default)
    ql_tensor *seed = nullptr;
    batch_io tr, ev;
    std::vector<ql_tensor *> params;
    // per parameter its optimizer state: {m, v} f32, or (8-bit) {m, m_absmax, v, v_absmax}
    std::vector<std::vector<ql_tensor *>> state;
    // the optimizer's groups (parameter, moments) described once for the multi-tensor step, and
    // on a device its store (descriptors, the norm's partial sums), planned and placed with the state
    ql_optim_list *olist = nullptr;
    ql_tensor *optim_store = nullptr;
    ql_plan_stats plan{};
    int64_t step = 0, total = 0, per_epoch = 0, warmup = 0;
    std::vector<int64_t> order;  // the current epoch's visiting order
    int64_t order_epoch = -1;
    std::vector<const ql_sequence *> slot;  // [micro_batch * accum(t)] a step's sequences, every rank's (NULL: none)
    std::vector<float> dist_grads;          // [grads / 4] data parallel: every gradient packed for the all-reduce
    std::vector<float *> dist_dev;          // ... on a device: the gradients where they are (NCCL), and their sizes
    std::vector<size_t> dist_n;
    // memory
    std::vector<ql_keep> levels;  // per forward segment (empty: no recompute)
    ql_recompute_stats rs{};
    int n_seg = 0;  // forward segments of the training graph
    std::vector<int> seg_block;  // per segment: the block whose input starts it, or -1 (inside a block, or none)
    ql_memory_plan mem;
    std::vector<std::pair<uintptr_t, uintptr_t>> pages;  // base-weight pages a run reads, [begin, end) page numbers
    // mixed precision
    ql_type compute = QL_TYPE_F32;
    int64_t applied = 0;        // optimizer updates made (steps not skipped): the schedule's position
    float   scale = 1;          // the loss scale (fp16), else 1; f32 as the checkpoint stores it
    int64_t growth_tracker = 0; // clean steps since the scale last changed
    int64_t skipped = 0, skipped_in_row = 0;
    bool broken = false;  // a failed step left a state not worth saving (ql_trainer_intact)
    // a model split over devices (ql_train_options.split): the outer trainer holds the run (data
    // order, schedule, scaler, step) and one stage trainer per device, each a trainer of blocks
    // [l0, l1) on its backend with its own plan, graphs, adapter part and optimizer state
    std::vector<ql_trainer *> stages;
    bool is_stage = false;
    int l0 = 0, l1 = 0;            // the blocks this trainer trains ([0, n_layer) unless a stage)
    ql_tensor *rope = nullptr;     // a stage: its own copy of the model's rope factors (each device needs them)
    std::vector<float> xfer;       // the outer trainer: [n_embd * T * B] a stage's h_out or h_in's gradient on its way
};

// the micro-batches of one optimizer step, every rank's: one process's accumulation
static int64_t accum(const ql_trainer *t) { return (int64_t)t->o.grad_accum * t->o.world; }

// the trainers that hold the adapter: the stages of a split, else the trainer itself
static std::vector<ql_trainer *> parts(const ql_trainer *t) {
    return t->stages.empty() ? std::vector<ql_trainer *>{const_cast<ql_trainer *>(t)} : t->stages;
}


// ---- the run's choices: names in enum order, and what a wrong one is called ----
template <class E> struct choice;
template <> struct choice<ql_optim> {
    static constexpr const char *what = "optimizer";
    static constexpr const char *names[] = {"adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"};
};
template <> struct choice<ql_precision> {
    static constexpr const char *what = "precision";
    static constexpr const char *names[] = {"fp32", "bf16", "fp16", "auto"};
};
template <> struct choice<ql_schedule> {
    static constexpr const char *what = "scheduler";
    static constexpr const char *names[] = {"constant", "constant_with_warmup", "linear", "cosine"};
};
template <> struct choice<ql_checkpointing> {
    static constexpr const char *what = "checkpointing";
    static constexpr const char *names[] = {"none", "block", "sqrt", "auto"};
};
template <class E> static const char *choice_name(E x) {
    const size_t i = (size_t)x, n = sizeof(choice<E>::names) / sizeof(choice<E>::names[0]);
    return i < n ? choice<E>::names[i] : "?";
}
template <class E> static bool choice_parse(const std::string &s, E *x, std::string *err) {
    const size_t n = sizeof(choice<E>::names) / sizeof(choice<E>::names[0]);
    std::string all;
    for (size_t i = 0; i < n; i++) {
        if (s == choice<E>::names[i]) {
            *x = (E)i;
            return true;
        }
        all += (i ? ", " : "") + std::string(choice<E>::names[i]);
    }
    if (err) *err = std::string("unknown ") + choice<E>::what + " '" + s + "' (" + all + ")";
    return false;
}
const char *ql_name(ql_optim x) { return choice_name(x); }
const char *ql_name(ql_precision x) { return choice_name(x); }
const char *ql_name(ql_schedule x) { return choice_name(x); }
const char *ql_name(ql_checkpointing x) { return choice_name(x); }
bool ql_parse(const std::string &s, ql_optim *x, std::string *err) { return choice_parse(s, x, err); }
bool ql_parse(const std::string &s, ql_precision *x, std::string *err) { return choice_parse(s, x, err); }
bool ql_parse(const std::string &s, ql_schedule *x, std::string *err) { return choice_parse(s, x, err); }
bool ql_parse(const std::string &s, ql_checkpointing *x, std::string *err) { return choice_parse(s, x, err); }

static ql_type precision_type(ql_precision p) {
    return p == ql_precision::bf16 ? QL_TYPE_BF16 : p == ql_precision::fp16 ? QL_TYPE_F16 : QL_TYPE_F32;
}

// A library message as a user reads it: the "qlora.cpp:3284: " an error carries at the API edge
// (where in the library it was raised) removed, kept with QLORA_DEBUG set in the environment
std::string ql_user_message(const std::string &msg) {
    const char *dbg = getenv("QLORA_DEBUG");
    if (dbg && *dbg && strcmp(dbg, "0") != 0) return msg;
    std::string out;
    for (size_t i = 0; i < msg.size();) {
        // "<name>.cpp:<digits>: " (or .cu/.h) at the start or after a space: dropped
        size_t j = i;
        while (j < msg.size() && (isalnum((unsigned char)msg[j]) || msg[j] == '_' || msg[j] == '-')) j++;
        size_t k = j;
        for (const char *ext : {".cpp:", ".cu:", ".h:"})
            if (k == j && j > i && msg.compare(j, strlen(ext), ext) == 0) k = j + strlen(ext);
        size_t d = k;
        while (k > j && d < msg.size() && isdigit((unsigned char)msg[d])) d++;
        if (k > j && d > k && msg.compare(d, 2, ": ") == 0 && (i == 0 || msg[i - 1] == ' ')) {
            i = d + 2;
            continue;
        }
        out += msg[i++];
    }
    return out;
}
static std::string ctx_message(const ql_context *ctx) { return ql_user_message(ql_ctx_error(ctx)); }

ql_precision ql_auto_precision(const ql_backend *be) {  // see trainer.h
    ql_backend_caps c{};
    ql_backend_get_caps(be, &c);
    return c.bf16_gemm ? ql_precision::bf16 : c.host ? ql_precision::fp32 : ql_precision::fp16;
}

// the graph of blocks [l0, l1) (the whole model: [0, n_layer)); a stage before the last ends in
// its h_out, returned (training) through ql_with_grad with g_out as its gradient, so that
// backward starts from what the next stage sends back
// embd_shared: another graph's embedding rows input of the same shape, read by this graph too
// (training and evaluation never run at once: one [n_embd, T, B] on the device, not two)
static batch_io make_io(ql_context *ctx, const ql_llama &m, int64_t T, int64_t B, bool packed, bool backward, bool embd_host,
                        int64_t loss_chunk, bool loss_fused, int l0, int l1, ql_tensor *embd_shared = nullptr) {
    const bool first = l0 == 0, last = l1 == m.hp.n_layer;
    batch_io io;
    if (!first) {  // (training: a leaf with a gradient - an accumulator, not one of the optimizer's parameters)
        io.h_in = ql_format_name(ql_new_tensor_3d(ctx, QL_TYPE_F32, m.hp.n_embd, T, B), "blk.%d.in", l0);
        io.h_in = backward ? ql_set_param(io.h_in) : ql_set_input(io.h_in);
    } else if (embd_host) {
        // in host memory, gathered there each run and copied to the device where block 0 reads
        // it (and again for its recompute): not a device input alive through the whole step
        io.embd = embd_shared && embd_shared->ne[0] == m.hp.n_embd && embd_shared->ne[1] == T && embd_shared->ne[2] == B
                      ? embd_shared
                      : ql_set_input(ql_set_name(ql_new_tensor_3d(ctx, QL_TYPE_F32, m.hp.n_embd, T, B), "token_embd.rows"));
        if (io.embd) io.embd->flags |= QL_FLAG_HOST;
    } else {
        io.tokens = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    }
    io.pos = ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B));
    io.seg = packed ? ql_set_input(ql_new_tensor_2d(ctx, QL_TYPE_I32, T, B)) : nullptr;
    if (last) {
        io.targets = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_I32, T * B));
        io.count = ql_set_input(ql_new_tensor_1d(ctx, QL_TYPE_F32, 1));
    }
    ql_tensor *x = !first ? io.h_in : embd_host ? ql_to_device(ctx, io.embd) : ql_get_rows(ctx, m.tok_embd, io.tokens);  // [n_embd, T, B]
    ql_tensor *h = ql_llama_hidden_range(ctx, &m, x, io.pos, io.seg, l0, l1);
    if (last) {
        io.loss = ql_llama_loss(ctx, &m, h, io.targets, io.count, loss_chunk, backward && loss_fused);
    } else if (backward) {  // y: h_out's first element (a view: nothing runs), its gradient g_out
        io.h_out = h;
        io.g_out = ql_set_input(ql_format_name(ql_new_tensor_3d(ctx, QL_TYPE_F32, m.hp.n_embd, T, B), "blk.%d.in.grad", l1));
        io.loss = ql_with_grad(ctx, h ? ql_view_1d(ctx, h, 1, 0) : nullptr, h, io.g_out);
    } else {
        io.loss = io.h_out = h;
    }
    io.gf = ql_graph_new(ctx);
    ql_graph_build_forward(io.gf, io.loss);
    io.g = backward ? ql_graph_backward(ctx, io.gf, io.loss) : io.gf;
    return io;
}

static size_t input_bytes(const batch_io &io) {
    size_t n = 0;
    for (const ql_tensor *x : {io.tokens, io.embd, io.pos, io.seg, io.targets, io.count, io.h_in, io.g_out})
        if (x) n += ql_nbytes(x);
    if (io.h_in && io.h_in->grad) n += ql_nbytes(io.h_in->grad);  // (a split: what goes back to the stage before)
    return n;
}

static void free_io(batch_io &io) {
    if (io.g != io.gf) ql_graph_free(io.g);
    ql_graph_free(io.gf);
    io = batch_io();
}

// With the weights' copies, the adapter's f32 factors get one too, in the compute type: every
// product of a factor would otherwise convert it first (two launches a product, 384 of the 1B
// step's), and the optimizer's update kernel rewrites the copy as it updates the factor
static bool factor_copy(const ql_trainer *t, const ql_tensor *p) {
    return !t->on_host && t->compute != QL_TYPE_F32 && p->type == QL_TYPE_F32 && p->ne[2] == 1 && p->ne[3] == 1;
}
static std::vector<ql_tensor *> param_copies(const ql_trainer *t) {
    std::vector<ql_tensor *> v;
    for (ql_tensor *p : t->params)
        if (t->cache && factor_copy(t, p)) v.push_back(p);
    return v;
}

// adapters, both graphs and the optimizer state in ctx (a measuring context, or the real one)
static bool build(ql_trainer *t, ql_context *ctx) {
    ql_llama &m = t->f->model;
    t->seed = ql_set_input(ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_I32, 1), "dropout_seed"));
    if (ql_llama_add_lora_range(ctx, &m, t->o.lora, t->seed, t->l0, t->l1) != QL_OK) return false;
    t->params = ql_llama_lora_params_range(m, t->l0, t->l1);
    for (ql_tensor *p : param_copies(t)) p->flags |= QL_FLAG_CACHED;  // (the plan's; the copies come with the weights')
    // a stage: the rope factors (read by every block) copied into its own tensors, placed with
    // them on its device; the model's stay where they are while its graphs are built
    ql_tensor *const rope_model = m.rope_freqs;
    t->rope = nullptr;
    if (t->is_stage && rope_model) {
        t->rope = ql_format_name(ql_new_tensor(ctx, rope_model->type, 4, rope_model->ne), "%s.stage", rope_model->name);
        if (t->rope && t->rope->data) memcpy(t->rope->data, rope_model->data, ql_nbytes(rope_model));
        m.rope_freqs = t->rope;
    }
    struct restore_rope {
        ql_llama &m;
        ql_tensor *r;
        ~restore_rope() { m.rope_freqs = r; }
    } restore{m, rope_model};
    m.lora_dropout = true;
    // adapter dropout inside A's multiply (ql_train_options.lora_dropout_fused; auto: on the CPU
    // only - on a device its kernels made an H200's 1B and 8B steps 14% slower than the dropped-out
    // copies and cuBLAS, bench/RESULTS.md, session 11). QLORA_DROPOUT_FUSED=1 or 16 in the
    // environment turns it on under auto (A/B runs)
    const char *fused_env = getenv("QLORA_DROPOUT_FUSED");
    const int fused = t->o.lora_dropout_fused;
    m.lora_dropout_fused = fused > 0 || (fused < 0 && (t->on_host || (fused_env && (strcmp(fused_env, "1") == 0 || strcmp(fused_env, "16") == 0))));
    m.lora_dropout_x16 = fused == 16 && t->compute != QL_TYPE_F32;
    m.lora_copies_first = !t->on_host;
    m.compute = t->compute;
    m.attn_bf16 = !t->o.attn_f32;
    m.ffn_down_f32 = t->o.ffn_down_f32;
    m.ffn_chunk = t->ffn_chunk;
    m.attn_score_bytes = t->attn_score;
    t->tr = make_io(ctx, m, t->T, t->B, t->packed, true, t->embd_host, t->loss_chunk, t->o.loss_fused, t->l0, t->l1);
    // the policy's levels, and the unfused chunked loss's logits (recomputed whatever the levels)
    if (t->tr.g && (!t->levels.empty() || t->loss_chunk > 0) &&
        ql_graph_recompute(t->tr.g, t->levels.empty() ? nullptr : t->levels.data(), (int)t->levels.size(), &t->rs) != QL_OK)
        return false;
    if (t->tr.g && t->o.offload_activations && !t->on_host && !t->levels.empty()) {
        // the checkpoints to host memory, all but the last (backward needs it at once: nothing to overlap)
        std::vector<ql_tensor *> in(t->levels.size(), nullptr), off;
        ql_graph_segments(t->tr.g, in.data(), (int)in.size());
        // limitation: a checkpoint that is a view of another tensor (a segment inside a block can
        // start at attention's permuted [head_dim, heads, T, B]) stays on the device: ql_graph_offload
        // copies whole forward results only
        // (an upload of host memory, ql_to_device, is copied again instead)
        auto copyable = [](const ql_tensor *x) {
            return ql_is_contiguous(x) && !x->aux_size && x->op != QL_OP_VIEW && x->op != QL_OP_RESHAPE &&
                   x->op != QL_OP_PERMUTE && x->op != QL_OP_TRANSPOSE && x->op != QL_OP_TO_DEVICE;
        };
        for (size_t i = 0; i < in.size(); i++)
            if (t->levels[i] == QL_KEEP_INPUT && in[i] && copyable(in[i])) off.push_back(in[i]);
        if (!off.empty() && !t->o.offload_late && !t->o.offload_grads) off.pop_back();  // (late: the last too - it waits for its copies anyway)
        if (ql_graph_offload_ex(t->tr.g, off.data(), (int)off.size(), (t->o.offload_late ? QL_OFFLOAD_LATE : 0) | (t->o.offload_grads ? QL_OFFLOAD_GRADS : 0)) != QL_OK) return false;
    }
    t->bucket_io.clear();
    for (size_t k = 0; t->tr.g && k + 1 < t->bucket_len.size(); k++) {  // the shorter lengths: the same recompute
        t->bucket_io.push_back(make_io(ctx, m, t->bucket_len[k], t->B, t->packed, true, t->embd_host,
                                       t->loss_chunk > 0 ? std::min(t->loss_chunk, t->bucket_len[k] * t->B) : 0, t->o.loss_fused,
                                       t->l0, t->l1));
        if (!t->bucket_io.back().g || ((!t->levels.empty() || t->loss_chunk > 0) &&
                                       ql_graph_recompute(t->bucket_io.back().g, t->levels.empty() ? nullptr : t->levels.data(),
                                                          (int)t->levels.size(), nullptr) != QL_OK))
            return false;
    }
    m.lora_dropout = false;  // evaluation: no dropout
    t->ev = make_io(ctx, m, t->T, t->B, t->packed, false, t->embd_host, t->loss_chunk, false, t->l0, t->l1, t->tr.embd);
    m.lora_dropout = true;
    t->state.clear();
    const bool eight = ql_optim_8bit(t->o.optim);
    for (ql_tensor *p : t->params) {
        const int64_t n = ql_nelements(p), nb = (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
        if (eight && n >= QL_OPT8_MIN_SIZE)  // bitsandbytes: smaller tensors keep f32 state
            t->state.push_back({ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_I8, n), "%s.adam_m8", p->name),
                                ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, nb), "%s.adam_m8_absmax", p->name),
                                ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_I8, n), "%s.adam_v8", p->name),
                                ql_format_name(ql_new_tensor_1d(ctx, QL_TYPE_F32, nb), "%s.adam_v8_absmax", p->name)});
        else
            t->state.push_back({ql_format_name(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne), "%s.adam_m", p->name),
                                ql_format_name(ql_new_tensor(ctx, QL_TYPE_F32, 4, p->ne), "%s.adam_v", p->name)});
    }
    // paged_* on a device: the moments live in pinned host memory, updated there by the device's
    // kernel over the bus (no device copy of the state); the placement of the rest leaves them
    if (!t->on_host && ql_optim_paged(t->o.optim))
        for (const auto &st : t->state)
            for (ql_tensor *x : st) x->flags |= QL_FLAG_HOST;
    t->optim_store = t->on_host ? nullptr  // (the CPU's list needs none)
                                : ql_set_name(ql_new_tensor_1d(ctx, QL_TYPE_I8, (int64_t)ql_optim_list_bytes((int)t->params.size())),
                                              "optim_list");
    return ql_ctx_status(ctx) == QL_OK && t->tr.g;
}

double ql_trainer_lr_at(const ql_trainer *t, int64_t s) {  // transformers' schedules, step from 0
    const ql_train_options &o = t->o;
    if (o.scheduler == ql_schedule::constant) return o.lr;  // transformers' "constant" has no warmup
    if (s < t->warmup) return o.lr * (double)s / (double)std::max<int64_t>(1, t->warmup);
    if (o.scheduler == ql_schedule::constant_with_warmup) return o.lr;
    const double progress = (double)(s - t->warmup) / (double)std::max<int64_t>(1, t->total - t->warmup);
    if (o.scheduler == ql_schedule::linear) return o.lr * std::max(0.0, 1.0 - progress);
    return o.lr * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));  // cosine, half a cycle
}

// ---- memory: the weight pages a run reads, a measured plan, the recompute policy ----

// Every frozen tensor of the base model (NULL for the ones it lacks): the embedding, the output
// projection unless tied to it, the final norm, rope factors, each block's tensors.
// A stage of a split: its blocks', the embedding on the first, the head on the last (the rope
// factors: its own copy, ql_trainer.rope).
static std::vector<const ql_tensor *> base_weights(const ql_trainer *t) {
    const ql_llama &m = t->f->model;
    const bool first = t->l0 == 0, last = t->l1 == m.hp.n_layer;
    std::vector<const ql_tensor *> v;
    if (first) v.push_back(m.tok_embd);
    if (last && m.output != m.tok_embd) v.push_back(m.output);
    if (last) v.push_back(m.out_norm);
    if (!t->is_stage) v.push_back(m.rope_freqs);
    for (int il = t->l0; il < t->l1; il++) {
        const ql_llama_layer &L = m.layers[(size_t)il];
        for (const ql_tensor *w : {L.attn_norm, L.wq, L.wk, L.wv, L.bq, L.bk, L.bv, L.wo, L.ffn_norm, L.w_gate, L.w_up, L.w_down})
            v.push_back(w);
    }
    return v;
}
// the same, without the absent ones, for a placement
static std::vector<ql_tensor *> stage_weights(const ql_trainer *t) {
    std::vector<ql_tensor *> v;
    for (const ql_tensor *w : base_weights(t))
        if (w) v.push_back(const_cast<ql_tensor *>(w));
    return v;
}

// How many of the pages in these intervals are in this process's memory now (Linux: the
// present bit of /proc/self/pagemap, readable without privileges); 0 where it cannot be read.
static size_t resident_pages(const std::vector<std::pair<uintptr_t, uintptr_t>> &pages) {
    FILE *f = fopen("/proc/self/pagemap", "rb");
    if (!f) return 0;
    size_t n = 0;
    std::vector<uint64_t> e(4096);  // one entry a page
    for (const auto &x : pages)
        for (uintptr_t p = x.first; p < x.second;) {
            const size_t k = (size_t)std::min<uintptr_t>(e.size(), x.second - p);
            if (fseeko(f, (off_t)(p * sizeof(uint64_t)), SEEK_SET) != 0 || fread(e.data(), sizeof(uint64_t), k, f) != k) {
                fclose(f);
                return 0;
            }
            for (size_t i = 0; i < k; i++) n += e[i] >> 63;
            p += k;
        }
    fclose(f);
    return n;
}

// Page intervals of the base weights a run reads: every frozen tensor whole, except the token
// embedding, of which get_rows reads only the rows of tokens the data holds.
static void weight_pages(ql_trainer *t) {
    const ql_llama &m = t->f->model;
    const uintptr_t P = (uintptr_t)sysconf(_SC_PAGESIZE);
    // a fault on a mapped file maps the cached pages around it too (Linux: fault_around_bytes,
    // 64 KiB): the embedding rows the data uses cost their 64 KiB windows, not their pages
    const uintptr_t W = std::max<uintptr_t>(1, 65536 / P);
    std::vector<std::pair<uintptr_t, uintptr_t>> iv;
    std::map<std::string, size_t> by_type;
    // on a device the host reads only what stays there (QL_FLAG_HOST: the embedding with
    // --embd-on-host); the rest is read once, by the placement, which gives the pages back
    auto host_reads = [&](const ql_tensor *w) { return t->on_host || (w->flags & QL_FLAG_HOST); };
    t->mem.weights_file = 0;
    auto whole = [&](const ql_tensor *w) {
        if (!w || !w->data) return;
        const size_t n = ql_nbytes(w) + w->aux_size;
        const uintptr_t b = (uintptr_t)w->data;
        t->mem.weights_file += n;
        if (!host_reads(w)) return;
        iv.push_back({b / P, (b + n + P - 1) / P});
        by_type[ql_type_name(w->type)] += n;
    };
    std::vector<bool> used((size_t)m.hp.n_vocab, false);
    for (const std::vector<ql_sequence> *v : {t->train, t->eval})
        for (const ql_sequence &q : *v)
            for (int32_t tok : q.tokens)
                if (tok >= 0 && tok < m.hp.n_vocab) used[(size_t)tok] = true;
    for (const ql_tensor *w : base_weights(t)) {
        if (w != m.tok_embd || m.output == m.tok_embd || !host_reads(w)) {  // whole; a tied embedding too (the output projection reads it all)
            whole(w);
            continue;
        }
        const size_t row = ql_row_size(m.tok_embd->type, m.tok_embd->ne[0]);
        const uintptr_t e0 = (uintptr_t)m.tok_embd->data, p0 = e0 / P, p1 = (e0 + ql_nbytes(m.tok_embd) + P - 1) / P;
        for (size_t r = 0; r < used.size(); r++)
            if (used[r]) {  // the window, within the tensor (its neighbours are counted whole, or are metadata)
                const uintptr_t b = e0 + r * row;
                iv.push_back({std::max(p0, b / P / W * W), std::min(p1, ((b + row + P - 1) / P + W - 1) / W * W)});
                by_type[ql_type_name(m.tok_embd->type)] += row;
            }
        t->mem.weights_file += ql_nbytes(m.tok_embd) + m.tok_embd->aux_size;
    }
    std::sort(iv.begin(), iv.end());
    t->pages.clear();
    for (const auto &x : iv) {
        if (!t->pages.empty() && x.first <= t->pages.back().second)
            t->pages.back().second = std::max(t->pages.back().second, x.second);
        else
            t->pages.push_back(x);
    }
    t->mem.weights = 0;
    for (const auto &x : t->pages) t->mem.weights += (size_t)(x.second - x.first) * P;
    // pages that loading touched already (NF4 statistics checked, fault-around) are in the RSS
    // the plan adds to (ql_plan_process)
    t->mem.weights_resident = std::min(t->mem.weights, resident_pages(t->pages) * P);
    t->mem.weights_by_type.assign(by_type.begin(), by_type.end());
}

// Planning builds and frees every graph several times (each policy measured, then the real
// ones): the freed blocks stay resident in the middle of the heap, where the allocator's trim
// at the top does not reach. Given back once the run is built, so that RSS is what the plan
// counts (measured on stories260K with dynamic padding: +2 MiB of a 17.8 MiB plan otherwise).
static void give_back_heap() {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
}

// what no plan sees - heap blocks besides the graphs' (ql_graph_heap_bytes counts those),
// library code paged in on first use, pages mapped around the embedding rows read - measured at
// 1-4 MiB on 6-400 MiB runs: a reserve, so that a budget the plan accepts holds in RSS
// measured on stories260K and the demo (AVX2 build): heap beyond the graphs' lists 0.2 MiB, code
// and libm pages first touched in the step 0.45 MiB
static size_t plan_reserve(size_t planned) { return (768u << 10) + planned / 200; }

// --cache-weights: the frozen linears of the blocks and the output head that are not of the
// compute type and stay on the device; flagged (on) or not, so that the plans count them
static void set_cache(ql_trainer *t, bool on) {
    ql_weight_cache_mark(t->cache_w.data(), (int)t->cache_w.size(), false);
    t->cache_w.clear();
    ql_llama &m = t->f->model;
    auto add = [&](ql_tensor *w) {
        if (w && w->type != t->compute && !(w->flags & QL_FLAG_HOST) && w->ne[2] == 1 && w->ne[3] == 1 &&
            std::find(t->cache_w.begin(), t->cache_w.end(), w) == t->cache_w.end())
            t->cache_w.push_back(w);
    };
    for (int il = t->l0; il < t->l1; il++) {
        ql_llama_layer &L = m.layers[(size_t)il];
        for (ql_tensor *w : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up}) add(w);
        if (!t->o.ffn_down_f32 || t->compute == QL_TYPE_F32) add(L.w_down);  // (the guard multiplies it in f32: no copy)
    }
    if (t->l1 == m.hp.n_layer) add(m.output);
    t->cache = on;
    ql_weight_cache_mark(t->cache_w.data(), (int)t->cache_w.size(), on);
}

// What a device run allocates, as ql_trainer_new allocates it: the weights placed whole (the
// embedding too, unless it stays on the host), one placement of the run's own tensors, one
// graph buffer (the bigger graph's: training and evaluation never run at once), the context,
// and (offload) the training graph's pinned host memory.
static void device_plan(ql_trainer *t, ql_context *meas, size_t train_buf, size_t eval_buf) {
    ql_memory_plan &m = t->mem;
    const size_t G = std::max<size_t>(1, t->caps.alloc_granularity);  // the device rounds each buffer up to it
    m.dev_granularity = G;
    auto round = [&](size_t b) { return b ? (b + G - 1) / G * G - b : 0; };
    m.device = true;
    m.cc = t->caps.cc;
    const std::vector<ql_tensor *> sw = stage_weights(t);
    m.dev_weights = t->is_stage ? ql_tensors_placed_bytes(sw.data(), (int)sw.size()) : ql_ctx_placed_bytes(t->f->ctx);
    std::map<std::string, size_t> by_type;
    for (const ql_tensor *w : base_weights(t))
        if (w && w->data && !(w->flags & QL_FLAG_HOST)) by_type[ql_type_name(w->type)] += ql_nbytes(w) + w->aux_size;
    m.dev_weights_by_type.assign(by_type.begin(), by_type.end());
    m.dev_state = ql_ctx_placed_bytes(meas);
    m.dev_buffer = std::max(train_buf, eval_buf);  // one buffer, the other graph runs in it
    // (the context, and the training graph's executable once captured: the census is made by now)
    m.dev_graph = (size_t)std::max<int64_t>(0, m.census.launches) * t->caps.graph_launch_bytes;
    m.dev_context = t->caps.context_bytes + m.dev_graph;
    m.dev_context_estimated = t->caps.context_estimated;
    std::vector<ql_tensor *> pc;  // the factors' copies, counted whether or not they are on
    for (ql_tensor *p : t->params)
        if (factor_copy(t, p)) pc.push_back(p);
    m.cache_candidate = ql_weight_cache_bytes(t->cache_w.data(), (int)t->cache_w.size(), t->compute) +
                        ql_weight_cache_bytes(pc.data(), (int)pc.size(), t->compute);
    m.dev_cache = t->cache ? m.cache_candidate : 0;  // one buffer of copies, made after the weights are placed
    m.dev_rounding = round(m.dev_weights) + round(m.dev_state) + round(m.dev_buffer) + round(m.dev_cache) + G;  // + the backend's scratch
    m.total = m.dev_weights + m.dev_state + m.dev_buffer + m.dev_cache + m.dev_context + m.dev_rounding;
    // the host's part: what the host writes of the arena (tensor headers, the adapter made there
    // before its upload, the moments' copies each checkpoint fills; gradients and inputs are
    // never written there), the batch staged for upload, the pages it reads of the weights (the
    // embedding's rows on the host, else none: the placement gives the model's pages back) and
    // pinned memory. Not planned: the device runtime's own (kernels loaded on first use).
    const size_t n_in = (size_t)(t->T * t->B);
    const size_t staged = n_in * 4 * sizeof(int32_t);  // (the embedding's rows are gathered into their pinned input)
    m.host = m.weights + m.headers + m.graph_heap + m.lora + m.optimizer + staged + m.host_pinned + m.dist;
    m.host += plan_reserve(m.host);
}

// Builds everything in a measuring context with the current levels and fills t->mem from the
// plans; nothing is allocated.
static bool measure(ql_trainer *t, std::string *err) {
    ql_init_params mp = {0, nullptr, false, true};
    ql_context *meas = ql_init(mp);
    t->rs = ql_recompute_stats();
    ql_plan_stats ps{}, es{};
    bool ok = build(t, meas) && ql_graph_plan(t->tr.g, t->be, &ps) == QL_OK && ql_graph_plan(t->ev.g, t->be, &es) == QL_OK;
    size_t bucket_buf = 0, bucket_inputs = 0;  // the shorter graphs run in the same buffer
    for (const batch_io &b : t->bucket_io) {
        ql_plan_stats bs{};
        ok = ok && ql_graph_plan(b.g, t->be, &bs) == QL_OK;
        bucket_buf = std::max(bucket_buf, bs.buffer_size);
        bucket_inputs += input_bytes(b);
    }
    es.buffer_size = std::max(es.buffer_size, bucket_buf);  // (what shares the training graph's buffer)
    if (!ok) *err = ctx_message(meas);
    ql_memory_plan &m = t->mem;
    if (ok) {
        const size_t arena = ql_used_mem(meas);
        m.lora = 0;
        for (const ql_tensor *p : t->params) m.lora += ql_nbytes(p);
        m.grads = m.lora;
        m.optimizer = 0;
        for (const auto &st : t->state)
            for (const ql_tensor *x : st) m.optimizer += ql_nbytes(x);
        m.optimizer_host = ql_optim_paged(t->o.optim);
        m.inputs = input_bytes(t->tr) + input_bytes(t->ev) + bucket_inputs + ql_nbytes(t->seed) -
                   (t->ev.embd && t->ev.embd == t->tr.embd ? ql_nbytes(t->ev.embd) : 0);  // (shared: counted once)
        m.headers = arena - std::min(arena, m.lora + m.grads + m.optimizer + m.inputs);
        m.graph_heap = 0;  // every graph the run keeps: training, evaluation, the shorter lengths'
        auto heap = [](const batch_io &io) { return ql_graph_heap_bytes(io.gf) + (io.g != io.gf ? ql_graph_heap_bytes(io.g) : 0); };
        m.graph_heap = heap(t->tr) + heap(t->ev);
        for (const batch_io &b : t->bucket_io) m.graph_heap += heap(b);
        if (ql_graph_census(t->tr.g, t->be, &m.census) != QL_OK) m.census = ql_census{};
        m.saved = ps.bytes[QL_MEM_SAVED];
        m.recompute = ps.recompute_peak;
        m.work = ps.bytes[QL_MEM_WORK];
        m.scratch = std::max(ps.buffer_size, es.buffer_size) - m.saved - m.work;  // eval shares the buffer
        m.checkpoints = 0;
        std::vector<ql_tensor *> in((size_t)t->levels.size(), nullptr);
        if (!in.empty()) ql_graph_segments(t->tr.g, in.data(), (int)in.size());
        for (size_t i = 0; i < in.size(); i++)
            if (t->levels[i] == QL_KEEP_INPUT && in[i] && in[i]->op != QL_OP_TO_DEVICE) m.checkpoints += ql_nbytes(in[i]) + in[i]->aux_size;
        m.offload = t->o.offload_activations && m.checkpoints > 0;
        m.host_rows = t->tr.embd && !t->on_host ? ql_nbytes(t->tr.embd) : 0;  // (one buffer: evaluation and the shorter lengths share it)
        m.host_pinned = ps.host_size + m.host_rows;
        m.host_parked = ps.host_back;
        m.dist = t->o.world > 1 || t->o.dist_always ? m.grads : 0;
        const size_t planned = m.weights + arena + m.graph_heap + std::max(ps.buffer_size, es.buffer_size) + m.dist;
        m.reserve = plan_reserve(planned);
        m.total = planned + m.reserve;
        m.host = m.total;  // (a device run: device_plan sets both)
        m.loss_chunk = t->loss_chunk;
        m.loss_fused = t->o.loss_fused;
        m.ffn_chunk = t->ffn_chunk;
        {
            const ql_llama &lm = t->f->model;
            m.lora_dropout = t->o.lora.dropout <= 0 ? "" : !lm.lora_dropout_fused ? "copies"
                           : lm.lora_dropout_x16 ? "in A's multiply, over x's 16-bit copy" : "in A's multiply";
        }
        m.embd_on_host = t->embd_host;
        m.host_embd = t->embd_host ? ql_nbytes(t->f->model.tok_embd) + t->f->model.tok_embd->aux_size : 0;
        if (!t->on_host) device_plan(t, meas, ps.buffer_size, es.buffer_size);
        m.levels.assign(t->levels.begin(), t->levels.end());
        m.recompute_fraction = t->rs.forward_flops > 0 ? t->rs.recompute_flops / t->rs.forward_flops : 0.0;
        m.micro_batch = (int)t->B;
        t->n_seg = ql_graph_segments(t->tr.g, nullptr, 0);
        std::vector<ql_tensor *> seg_in((size_t)t->n_seg, nullptr);  // which segments start a block (ql_llama_hidden's names)
        ql_graph_segments(t->tr.g, seg_in.data(), t->n_seg);
        t->seg_block.assign((size_t)t->n_seg, -1);
        for (size_t i = 0; i < seg_in.size(); i++) {
            int il = -1;
            if (seg_in[i] && sscanf(seg_in[i]->name, "blk.%d.in", &il) == 1) t->seg_block[i] = il;
        }
    }
    free_io(t->tr);
    free_io(t->ev);
    for (batch_io &b : t->bucket_io) free_io(b);
    t->bucket_io.clear();
    ql_free(meas);
    return ok;
}

// the limit a plan must fit: the process's memory (--mem-limit), or on a device its memory
// (--vram, the device's free memory) and --mem-limit, the smaller
static size_t limit_of(const ql_trainer *t) {
    if (!t->mem.device) return t->o.mem_limit;
    const size_t v = t->mem.vram, l = t->o.mem_limit;
    return v && l ? std::min(v, l) : v ? v : l;
}
static bool fits(const ql_trainer *t) {
    const size_t lim = limit_of(t);
    return lim == 0 || (t->mem.device ? 0 : ql_plan_process(t->mem, t->o.mem_other)) + t->mem.total <= lim;
}

static std::string mib_text(size_t b) {
    char s[32];
    if (b > 0 && b < 104858)  // under 0.1 MiB (a --mem-limit 1K) would read "0.0 MiB"
        snprintf(s, sizeof(s), "%.1f KiB", (double)b / 1024.0);
    else
        snprintf(s, sizeof(s), "%.1f MiB", (double)b / 1048576.0);
    return s;
}

// The policy's levels, and the plan that goes with them. auto: no recompute if that fits, else
// the first of a sequence of ever cheaper-in-memory choices that fits: segments one by one keep
// only matmul/attention results, then one by one only their inputs (= block), then sqrt where
// that is smaller than block (with few layers it is not: a block's insides, all recomputed at
// once, outweigh the checkpoints it saves).
static bool choose_levels_for(ql_trainer *t, std::string *err) {
    const ql_checkpointing p = t->o.checkpointing;
    t->levels.clear();
    if (!measure(t, err)) return false;  // no recompute: also finds the segments
    const int S = t->n_seg;
    // the input of every k-th transformer block kept, everything else recomputed from it: k = 1
    // is "block" (one checkpoint per layer, as transformers' gradient checkpointing; the second
    // half's input comes back with the first half's recompute, which its backward needs anyway),
    // k = ceil(sqrt(L)) "sqrt". Block inputs are the segment inputs ql_llama_hidden named
    // "blk.<il>.in"; segments inside a block are recomputed, those after the last (the chunked
    // loss's head: its logits are recomputed anyway) kept as they are.
    const int L = t->f->model.hp.n_layer, blocks = std::max(1, L);
    const std::vector<int> block_of = t->seg_block;  // the block a segment starts, or -1 (a snapshot: measure() refills it)
    auto every_k_blocks = [&](int k) {
        std::vector<ql_keep> lv((size_t)S, QL_KEEP_NONE);
        bool head = false;
        for (int i = 0; i < S; i++) {
            const int b = block_of[(size_t)i];
            head = head || b >= L;
            lv[(size_t)i] = head ? QL_KEEP_ALL : b >= 0 && b % k == 0 ? QL_KEEP_INPUT : QL_KEEP_NONE;
        }
        return lv;
    };
    auto sqrt_levels = [&]() { return every_k_blocks(std::max(1, (int)std::ceil(std::sqrt((double)blocks)))); };
    auto family = [&](int k) {  // k in [0, 2S]: the first min(k, S) heavy-kept, the first k - S input-only
        std::vector<ql_keep> lv((size_t)S, QL_KEEP_ALL);
        for (int i = 0; i < S; i++) lv[(size_t)i] = i < k - S ? QL_KEEP_INPUT : i < k ? QL_KEEP_HEAVY : QL_KEEP_ALL;
        return lv;
    };
    using C = ql_checkpointing;
    if (p == C::none || S == 0) {
        t->mem.checkpointing = S == 0 && p != C::none ? ql_name(p) + std::string(" (no segments: nothing to recompute)") : "none";
    } else if (p == C::block || p == C::sqrt) {
        t->levels = p == C::block ? every_k_blocks(1) : sqrt_levels();
        if (!measure(t, err)) return false;
        t->mem.checkpointing = ql_name(p);
    } else if (p == C::automatic) {
        if (limit_of(t) == 0) {
            *err = "--checkpointing auto needs a memory limit (--mem-limit, or on a device --vram)";
            return false;
        }
        if (fits(t)) {
            t->mem.checkpointing = "auto: none (everything fits)";
            return true;
        }
        t->levels = family(2 * S);  // every segment keeps only its input
        if (!measure(t, err)) return false;
        if (!fits(t)) {  // then one checkpoint per block, or sqrt's fewer (more recomputed at once): the first that fits
            t->levels = every_k_blocks(1);
            if (!measure(t, err)) return false;
            t->mem.checkpointing = "auto: block";
            if (fits(t)) return true;
            const std::vector<ql_keep> block_levels = t->levels;
            const size_t block_total = t->mem.total;
            t->levels = sqrt_levels();
            if (!measure(t, err)) return false;
            t->mem.checkpointing = "auto: sqrt";
            if (t->mem.total > block_total) {  // few layers: a block's insides outweigh the checkpoints saved
                t->levels = block_levels;
                if (!measure(t, err)) return false;
                t->mem.checkpointing = "auto: block";
            }
            return true;
        }
        int lo = 1, hi = 2 * S;  // family(hi) fits; find the smallest k that does
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            t->levels = family(mid);
            if (!measure(t, err)) return false;
            if (fits(t)) hi = mid;
            else lo = mid + 1;
        }
        t->levels = family(hi);
        if (!measure(t, err)) return false;
        const int heavy = std::min(hi, S) - std::max(0, hi - S), input = std::max(0, hi - S);
        t->mem.checkpointing = "auto: of " + std::to_string(S) + " segments " + std::to_string(input) + " keep only their input, " +
                               std::to_string(heavy) + " keep matmul/attention results, " + std::to_string(S - heavy - input) +
                               " keep everything";
    } else {
        *err = "bad checkpointing policy";
        return false;
    }
    return true;
}

// The policy, and on a device whether the embedding stays on the host: with embd_on_host auto,
// on the host only when the plan does not fit otherwise (it costs an upload of the step's rows).
static void set_embd_host(ql_trainer *t, bool on) {
    if (t->l0 != 0) {  // a later stage of a split: the embedding is the first stage's
        t->embd_host = false;
        return;
    }
    ql_tensor *e = t->f->model.tok_embd;
    t->embd_host = on;
    if (on) e->flags |= QL_FLAG_HOST;
    else e->flags &= ~QL_FLAG_HOST;
}
static bool choose_memory(ql_trainer *t, std::string *err) {
    if (!choose_levels_for(t, err)) return false;
    if (t->o.loss_chunk == 0 && !t->on_host && t->loss_chunk != t->auto_chunk &&
        (!fits(t) || (t->o.checkpointing == ql_checkpointing::automatic && !t->levels.empty()))) {
        // the device's chunks of 512+ rows, unless they do not fit, or make auto recompute, where
        // today's smaller ones fit or recompute less (the big chunk saves ~4% of a step, recompute costs more)
        const bool big_fits = fits(t);
        const double big_recompute = t->rs.recompute_flops;
        const int64_t big = t->loss_chunk;
        t->loss_chunk = t->auto_chunk;
        if (!choose_levels_for(t, err)) return false;
        if (big_fits && !(fits(t) && t->rs.recompute_flops < big_recompute)) {
            t->loss_chunk = big;
            if (!choose_levels_for(t, err)) return false;
        }
    }
    if (t->o.loss_chunk == 0 && t->on_host && t->loss_chunk == 0 && t->auto_chunk > 0 && !fits(t)) {
        t->loss_chunk = t->auto_chunk;  // the CPU's auto: chunks when the plan needs them
        if (!choose_levels_for(t, err)) return false;
    }
    if (t->o.ffn_chunk == 0 && t->ffn_chunk == 0 && t->auto_ffn_chunk > 0 && !t->levels.empty() && !fits(t)) {
        t->ffn_chunk = t->auto_ffn_chunk;  // auto: chunks when recompute's peak needs them
        if (!choose_levels_for(t, err)) return false;
    }
    if (t->o.embd_on_host != -1 || t->on_host || t->embd_host || t->l0 != 0 || fits(t)) return true;
    if (t->f->model.output == t->f->model.tok_embd) return true;  // tied: the output projection reads it on the device
    set_embd_host(t, true);
    weight_pages(t);  // the host now reads the embedding's rows
    if (t->cache) set_cache(t, true);  // (a tied head now stays on the host: no copy of it)
    return choose_levels_for(t, err);
}
// Everything above, and the weights' copies (--cache-weights): on, every choice is made with
// them; auto, they are added last, only when the plan with them still fits - the first thing
// given up when memory is tight, before any recompute, offload or embedding choice.
static bool choose_cache(ql_trainer *t, std::string *err) {
    const int cw = t->on_host ? 0 : t->o.cache_weights;
    set_cache(t, cw == 1);
    if (!choose_memory(t, err)) return false;
    ql_memory_plan &m = t->mem;
    if (t->on_host) m.cache_weights = "off (the CPU converts weights while packing its panels)";
    else if (cw == 1) m.cache_weights = "on";
    else if (cw == 0) m.cache_weights = "off";
    else if (m.cache_candidate == 0) m.cache_weights = "auto: off (no weight to copy: all are of the compute type)";
    else if (limit_of(t) == 0) m.cache_weights = "auto: off (no memory limit known: --vram)";
    else if (!fits(t)) m.cache_weights = "auto: off (the plan does not fit as it is)";
    else {
        set_cache(t, true);
        if (!measure(t, err)) return false;
        if (fits(t)) {
            m.cache_weights = "auto: on";
            return true;
        }
        const size_t over = m.total - limit_of(t);
        set_cache(t, false);
        if (!measure(t, err)) return false;
        m.cache_weights = "auto: off (" + mib_text(over) + " over the limit with them)";
    }
    return true;
}
// And attention's score budget (ql_train_options.attn_score_mib): auto doubles the default where
// that makes the chunks larger and the plan still fits - added after everything else, so the
// first thing given up (it buys 2-3% of a step; the weights' copies buy more)
static bool choose_levels(ql_trainer *t, std::string *err) {
    const size_t base = QL_FLASH_ATTN_SCORE_BYTES, big = 2 * QL_FLASH_ATTN_SCORE_BYTES;
    const int mib = t->on_host ? 0 : t->o.attn_score_mib;
    t->attn_score = mib > 0 ? (size_t)mib << 20 : 0;
    if (!choose_cache(t, err)) return false;
    ql_memory_plan &m = t->mem;
    const int64_t H = t->f->model.hp.n_head;
    auto rows = [&](size_t b) { return ql_flash_attn_chunk_rows(t->T, t->T, H, t->B, b); };
    m.attn_chunk = t->on_host ? 0 : rows(t->attn_score);
    m.attn_scores = t->on_host ? "" : mib > 0 ? std::to_string(mib) + " MiB" : "auto: " + std::to_string(base >> 20) + " MiB";
    if (t->on_host || mib > 0) return true;
    if (rows(big) == rows(base)) {
        m.attn_scores += " (twice as much would not make larger chunks)";
        return true;
    }
    if (!fits(t)) {
        m.attn_scores += " (the plan does not fit as it is)";
        return true;
    }
    t->attn_score = big;
    if (!measure(t, err)) return false;
    if (fits(t)) {
        m.attn_chunk = rows(big);
        m.attn_scores = "auto: " + std::to_string(big >> 20) + " MiB";
        return true;
    }
    const size_t over = m.total - limit_of(t);
    t->attn_score = 0;
    if (!measure(t, err)) return false;
    m.attn_scores += " (" + mib_text(over) + " over the limit with " + std::to_string(big >> 20) + ")";
    return true;
}

// The positions of a sequence the loss depends on: up to its last target (attention is causal,
// so what follows changes nothing) - a shorter graph computes the same loss; and its tokens
// before the padding (what tokens/s counts; ql_sequence.len, or without it the former).
static int64_t needed_len(const ql_sequence &q) {
    int64_t n = (int64_t)q.targets.size();
    while (n > 0 && q.targets[(size_t)n - 1] < 0) n--;
    return std::max<int64_t>(1, n);
}
static int64_t real_len(const ql_sequence &q) { return q.len > 0 ? q.len : needed_len(q); }

// Attention's backward on a device (ql_train_options.attn_backward): given, or auto - the faster
// of the fused kernels and the products on this card, one layer at the run's shape timed both ways
// (ql_cuda_fa_choose) once a process, where nothing set the mode (QLORA_CUDA_FA, a caller's
// ql_cuda_fa_set_mode). Made before anything is planned: the two take different workspaces.
static void choose_attn_backward(ql_trainer *t) {
    static int timed_mode = -1;  // this process's timed choice and its reason (a later trainer, a split's next stage, keeps it)
    static std::string timed_why;
    const ql_llama_hparams &hp = t->f->model.hp;
    const int64_t D = hp.head_dim();
    const bool takes = t->compute == QL_TYPE_BF16 && !t->o.attn_f32 && ql_cuda_fa_fused_takes(D);
    ql_memory_plan &m = t->mem;
    std::string why;
    if (t->o.attn_backward >= 0) {
        ql_cuda_fa_set_mode(t->o.attn_backward ? QL_CUDA_FA_FUSED : QL_CUDA_FA_FORWARD);
        why = t->o.attn_backward ? "--attn-backward fused" : "--attn-backward products";
    } else if (ql_cuda_fa_get_mode() != QL_CUDA_FA_AUTO) {
        why = ql_cuda_fa_get_mode() == timed_mode ? timed_why
                                                    : "auto: the process's mode as set by QLORA_CUDA_FA, ql_cuda_fa_set_mode or an earlier run's flag";
    } else if (!takes) {
        why = "the fused kernels take a bf16 compute type and head dims 64, 80, 96, 128";
    } else if (t->caps.plan_only) {
        why = "auto: on the card the faster of the two, timed at the start; planned here as products";
    } else {
        double tf = 0, tp = 0;
        char e[256] = "";
        const int mode = ql_cuda_fa_choose(t->be, D, hp.n_head, hp.n_head_kv, t->T, &tf, &tp, e, sizeof(e));
        char buf[320];
        for (char *c = e; *c; c++)
            if (*c == '"' || *c == '\\' || (unsigned char)*c < 32) *c = '\'';  // (the plan's JSON carries it)
        if (mode < 0)
            snprintf(buf, sizeof(buf), "auto: the timing failed (%s)", e);
        else
            snprintf(buf, sizeof(buf), "auto: one layer forward and backward at seq %lld, d %lld on this card: fused %.2f ms, products %.2f ms",
                     (long long)std::min<int64_t>(t->T, QL_CUDA_FA_CHOOSE_SEQ), (long long)D, tf, tp);
        timed_mode = mode < 0 ? QL_CUDA_FA_FORWARD : mode;
        timed_why = why = buf;
        ql_cuda_fa_set_mode(timed_mode);
    }
    const int mode = ql_cuda_fa_get_mode();
    m.attn_fused = takes && mode == QL_CUDA_FA_FUSED;
    if (!takes && t->o.attn_backward == 1) why += ": the fused kernels take a bf16 compute type and head dims 64, 80, 96, 128";
    m.attn_backward = std::string(m.attn_fused ? "fused kernels" : "products") + " (" + why + ")";
}

// fields from the options; nothing built
// (a stage of a split: blocks [l0, l1) only, is_stage)
static ql_trainer *setup(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                         const ql_train_options &o, std::string *err, int l0 = 0, int l1 = -1, bool is_stage = false) {
    if (train.empty()) {
        *err = "no training sequences";
        return nullptr;
    }
    if (o.precision == ql_precision::automatic) {
        *err = "precision auto is the caller's to resolve (ql_auto_precision)";
        return nullptr;
    }
    if (!(o.scale_init > 0) || !std::isfinite(o.scale_init) || !(o.scale_growth >= 1) || !(o.scale_backoff > 0) ||
        !(o.scale_backoff < 1) || o.scale_interval < 1) {
        *err = "bad loss-scaling options (initial scale > 0, growth >= 1, 0 < backoff < 1, interval >= 1)";
        return nullptr;
    }
    if (o.micro_batch < 1 || o.grad_accum < 1 || !(o.lr >= 0) || o.epochs < 1) {
        *err = "bad training options (micro-batch and accumulation >= 1, lr >= 0, epochs >= 1)";
        return nullptr;
    }
    if (o.world < 1 || o.rank < 0 || o.rank >= o.world) {
        *err = "bad data-parallel options (rank " + std::to_string(o.rank) + " of " + std::to_string(o.world) + ")";
        return nullptr;
    }
    ql_trainer *t = new ql_trainer();
    t->f = f;
    t->o = o;
    t->l0 = l0;
    t->l1 = l1 < 0 ? f->model.hp.n_layer : l1;
    t->is_stage = is_stage;
    t->train = &train;
    t->eval = &eval;
    t->seq_len = t->T = (int64_t)train[0].tokens.size();
    if (o.dynamic_padding && !(o.offload_activations && o.backend && !ql_backend_is_host(o.backend))) {
        // the graphs' lengths: halves and three-quarters of the sequences' length, multiples of 8,
        // at least 16; the training graph as long as the longest sequence's, shorter graphs down to
        // the shortest training sequence's
        int64_t lmax = 1, lmin = t->T;
        for (const ql_sequence &q : train) lmax = std::max(lmax, needed_len(q)), lmin = std::min(lmin, needed_len(q));
        for (const ql_sequence &q : eval) lmax = std::max(lmax, needed_len(q));
        std::vector<int64_t> ladder = {t->T};
        for (int64_t b = t->T; b / 2 >= 16; b /= 2)
            for (int64_t x : {b * 3 / 4, b / 2}) ladder.push_back(std::min(t->T, (x + 7) / 8 * 8));
        std::sort(ladder.begin(), ladder.end());
        ladder.erase(std::unique(ladder.begin(), ladder.end()), ladder.end());
        const auto fit = [&](int64_t n) { return *std::lower_bound(ladder.begin(), ladder.end(), std::min(n, t->T)); };
        t->T = fit(lmax);
        for (int64_t x : ladder)
            if (x >= fit(lmin) && x <= t->T) t->bucket_len.push_back(x);
    }
    if (t->bucket_len.empty()) t->bucket_len.push_back(t->T);
    t->B = o.micro_batch;
    t->packed = o.packed;
    const int64_t per_step = (int64_t)o.micro_batch * o.grad_accum * o.world;
    t->per_epoch = ((int64_t)train.size() + per_step - 1) / per_step;
    t->total = o.max_steps > 0 ? o.max_steps : t->per_epoch * o.epochs;
    t->warmup = o.scheduler == ql_schedule::constant ? 0  // as transformers: warmup_steps if > 0, else ceil(ratio * total)
                : o.warmup_steps > 0       ? o.warmup_steps
                                           : (int64_t)std::ceil(o.warmup_ratio * (double)t->total);
    t->compute = precision_type(o.precision);
    t->scale = o.precision == ql_precision::fp16 ? std::min(o.scale_init, 0x1p64f) : 1.0f;
    if (o.backend) {
        t->be = o.backend;
    } else if (!(t->be = t->own_be = ql_backend_cpu_init(o.threads))) {
        *err = "cannot start " + std::to_string(o.threads > 0 ? o.threads : ql_cpu_default_threads()) +
               " CPU threads (the system's limit, or memory for their stacks)";
        delete t;
        return nullptr;
    }
    ql_backend_get_caps(t->be, &t->caps);
    t->on_host = t->caps.host;
    if (!t->on_host) {
        t->mem.device_desc = t->caps.plan_only ? std::string("planned for ") + t->caps.name
                                               : std::string(t->caps.name) + " (cc " + std::to_string(t->caps.cc / 10) + "." +
                                                     std::to_string(t->caps.cc % 10) + ")";
        t->mem.vram = t->caps.mem_free;
    }
    if (o.vram) t->mem.vram = o.vram;
    const ql_llama &m = f->model;
    if (o.attn_score_mib > 0 && t->on_host) {
        *err = "--attn-score-mib: the CPU backend's attention runs in tiles of its own, not as products over chunks of "
               "queries (it is for a device: --device cuda)";
        ql_trainer_free(t);
        return nullptr;
    }
    if (o.attn_backward != -1 && (t->on_host || o.attn_backward < -1 || o.attn_backward > 1)) {
        *err = t->on_host ? "--attn-backward: the CPU backend's attention runs in tiles of its own, neither the fused kernels nor "
                            "products (it is for a device: --device cuda)"
                          : "attn_backward " + std::to_string(o.attn_backward) + ": -1 (auto), 0 (products) or 1 (fused)";
        ql_trainer_free(t);
        return nullptr;
    }
    if (!t->on_host) choose_attn_backward(t);
    if (o.cache_weights == 1 && t->on_host) {
        *err = "--cache-weights on: the CPU backend converts the weights while packing its panels, so a copy would save "
               "nothing (it is for a device: --device cuda)";
        ql_trainer_free(t);
        return nullptr;
    }
    if (o.lora_dropout_fused != -1 && o.lora_dropout_fused != 0 && o.lora_dropout_fused != 1 && o.lora_dropout_fused != 16) {
        *err = "lora_dropout_fused " + std::to_string(o.lora_dropout_fused) + ": -1 (auto), 0, 1 or 16";
        ql_trainer_free(t);
        return nullptr;
    }
    if (o.embd_on_host == 1 && !t->on_host && m.output == m.tok_embd) {
        *err = "--embd-on-host: this model's output projection is its embedding (tied): it must be on the device";
        ql_trainer_free(t);
        return nullptr;
    }
    set_embd_host(t, o.embd_on_host == 1 && !t->on_host);
    const int64_t rows = t->T * t->B;
    t->auto_chunk = ql_llama_loss_chunk(m.hp.n_vocab, rows);
    if (t->auto_chunk >= rows) t->auto_chunk = 0;  // one chunk: the plain head
    // auto: chunked on a device (memory is what it lacks); on the CPU only when the plan needs it
    // (unfused, recomputing the head adds ~11% to a 110M step's FLOPs there: an estimate, not
    // timed; fused, chunks cost no FLOPs, but the CPU keeps its rule)
    // (a device with the fused loss: chunks of 512+ rows first, choose_levels falls back to these)
    const int64_t device_chunk = o.loss_fused ? ql_llama_loss_chunk(m.hp.n_vocab, rows, QL_LLAMA_LOSS_CHUNK_ELEMS_DEVICE) : t->auto_chunk;
    t->loss_chunk = o.loss_chunk < 0 ? 0 : o.loss_chunk > 0 ? o.loss_chunk : t->on_host ? 0 : device_chunk;
    if (t->loss_chunk >= rows) t->loss_chunk = 0;
    t->auto_ffn_chunk = ql_llama_ffn_chunk(m.hp.n_ff, rows);
    if (t->auto_ffn_chunk >= rows) t->auto_ffn_chunk = 0;
    // auto: when the plan needs it (choose_levels) - chunks cost time: on an H200 a 1B-shaped
    // block-checkpointed step ran at 8,728 tokens/s in chunks of 1024 against 10,317 whole
    t->ffn_chunk = o.ffn_chunk > 0 ? o.ffn_chunk : 0;
    if (t->ffn_chunk >= rows) t->ffn_chunk = 0;
    weight_pages(t);
    return t;
}

// the host bytes of one of the run's tensors (on a device: its host copy, as of the last get)
static void *host_data(const ql_trainer *t, const ql_tensor *x) {
    if (t->on_host) return x->data;
    void *h = ql_backend_buffer_host_data(t->state_buf, x);
    return h ? h : ql_backend_buffer_host_data(t->paged_buf, x);
}

static std::string biggest_items(const ql_memory_plan &m) {
    std::vector<std::pair<size_t, std::string>> v = {{m.device ? m.dev_weights : m.weights, "base weights"},
                                                     {m.saved, "saved activations"},
                                                     {m.scratch, "temporaries"},
                                                     {m.lora + m.grads + m.optimizer, "adapter + gradients + optimizer"}};
    std::sort(v.rbegin(), v.rend());
    return v[0].second + " " + mib_text(v[0].first) + ", " + v[1].second + " " + mib_text(v[1].first) + ", " + v[2].second +
           " " + mib_text(v[2].first);
}

// the message when the plan does not fit: the total against the limit, the biggest items
static std::string over_limit(const ql_trainer *t) {
    if (t->cache && t->o.cache_weights == 1) {
        const size_t lim = limit_of(t);
        return "--cache-weights on: the plan needs " + std::to_string(t->mem.total) + " bytes of device memory (" +
               mib_text(t->mem.total) + "; the weights' copies " + std::to_string(t->mem.dev_cache) + "), " + std::to_string(lim) +
               " available (" + mib_text(lim) + ") --> hint: --cache-weights auto";
    }
    return "needs " + mib_text((t->mem.device ? 0 : ql_plan_process(t->mem, t->o.mem_other)) + t->mem.total) + " of the " + mib_text(limit_of(t)) +
           (t->mem.device ? " of device memory" : "") + " allowed (" + biggest_items(t->mem) + ")";
}

// ---- a model split over devices: its checks, the stages' plans, the blocks each device takes ----

// stage s's options: one device's run, over its backend and its memory
static ql_train_options stage_options(const ql_train_options &o, size_t s) {
    ql_train_options so = o;
    so.backend = o.split[s];
    so.vram = o.split_vram.empty() ? 0 : o.split_vram.size() == 1 ? o.split_vram[0] : o.split_vram[s];
    so.split.clear();
    so.split_vram.clear();
    so.split_layers.clear();
    return so;
}

static bool split_check(const ql_llama_file *f, const ql_train_options &o, std::string *err) {
    const size_t S = o.split.size();
    const int L = f->model.hp.n_layer;
    if (o.world > 1 || o.dist_always) {
        *err = "a model split over devices with data parallel (several processes): not supported (v1) --> hint: one of the two";
        return false;
    }
    if (f->model.output == f->model.tok_embd) {
        *err = "a model split over devices: this model's output projection is its embedding (tied), which the first and the last "
               "device would both read: not supported (v1)";
        return false;
    }
    if ((int)S > L) {
        *err = "a split over " + std::to_string(S) + " devices of a model of " + std::to_string(L) + " blocks: at most one device per block";
        return false;
    }
    for (size_t i = 0; i < S; i++)
        for (size_t j = 0; j <= i; j++)
            if (!o.split[i] || (j < i && o.split[i] == o.split[j])) {
                *err = "a split's backends: one per device, each once";
                return false;
            }
    if (o.split_vram.size() > 1 && o.split_vram.size() != S) {
        *err = std::to_string(o.split_vram.size()) + " device memory limits for a split over " + std::to_string(S) + " devices (one, or one each)";
        return false;
    }
    if (!o.split_layers.empty()) {
        bool ok = o.split_layers.size() == S && o.split_layers[0] == 0;
        for (size_t s = 1; ok && s < S; s++) ok = o.split_layers[s] > o.split_layers[s - 1] && o.split_layers[s] < L;
        if (!ok) {
            *err = "a split's first blocks: one per device, the first 0, ascending, each device at least one of the " + std::to_string(L);
            return false;
        }
    }
    return true;
}

struct stage_plan {
    ql_memory_plan mem;
    size_t limit = 0;  // its device's (0: none known)
    bool fits = false;
    std::string over;  // why not
};

static bool plan_stage(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                       const ql_train_options &o, size_t s, int l0, int l1, stage_plan *p, std::string *err) {
    ql_trainer *t = setup(f, train, eval, stage_options(o, s), err, l0, l1, true);
    if (!t) return false;
    const bool ok = choose_levels(t, err);
    if (ok) {
        p->mem = t->mem;
        p->limit = limit_of(t);
        p->fits = fits(t);
        p->over = p->fits ? "" : over_limit(t);
    }
    ql_trainer_free(t);
    return ok;
}

// a plan's room: its limit less its total (no limit known: less than nothing, so that the
// balance evens the totals)
static double plan_room(const stage_plan &p) { return p.limit ? (double)p.limit - (double)p.mem.total : -(double)p.mem.total; }

// The first block of each stage and the stages' plans: as given, or balanced by memory - shares of
// the blocks proportional to the devices' memory, then one block at a time moved off the stage
// with the least room to a neighbour while that gives the tightest stage more (each try: the two
// stages' plans, measured, nothing allocated).
static bool split_layers_for(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                             const ql_train_options &o, std::vector<int> *first, std::vector<stage_plan> *plans, std::string *choice,
                             std::string *err) {
    const int S = (int)o.split.size(), L = f->model.hp.n_layer;
    std::map<std::tuple<int, int, int>, stage_plan> cache;
    auto plan_all = [&](const std::vector<int> &fl, std::vector<stage_plan> *v) {
        v->assign((size_t)S, stage_plan());
        for (int s = 0; s < S; s++) {
            const int l0 = fl[(size_t)s], l1 = s + 1 < S ? fl[(size_t)s + 1] : L;
            auto it = cache.find(std::make_tuple(s, l0, l1));
            if (it == cache.end()) {
                stage_plan p;
                if (!plan_stage(f, train, eval, o, (size_t)s, l0, l1, &p, err)) {
                    *err = "device " + std::to_string(s) + " (blocks " + std::to_string(l0) + "-" + std::to_string(l1 - 1) + "): " + *err;
                    return false;
                }
                it = cache.emplace(std::make_tuple(s, l0, l1), p).first;
            }
            (*v)[(size_t)s] = it->second;
        }
        return true;
    };
    auto worst = [](const std::vector<stage_plan> &v, int *at) {
        double w = INFINITY;
        for (size_t s = 0; s < v.size(); s++)
            if (plan_room(v[s]) < w) w = plan_room(v[s]), *at = (int)s;
        return w;
    };
    std::vector<int> fl = o.split_layers;
    if (fl.empty()) {
        std::vector<double> lim((size_t)S, 1.0);  // each device's memory: --vram, else what it has free
        bool known = true;
        for (int s = 0; s < S; s++) {
            const ql_train_options so = stage_options(o, (size_t)s);
            ql_backend_caps c{};
            ql_backend_get_caps(so.backend, &c);
            const size_t v = so.vram ? so.vram : c.host ? 0 : c.mem_free;
            lim[(size_t)s] = (double)v;
            known = known && v > 0;
        }
        double total = 0, cum = 0;
        for (int s = 0; s < S; s++) total += known ? lim[(size_t)s] : 1.0;
        fl.assign((size_t)S, 0);
        for (int s = 1; s < S; s++) {
            cum += known ? lim[(size_t)s - 1] : 1.0;
            const int b = (int)std::lround((double)L * cum / total);
            fl[(size_t)s] = std::min(L - (S - s), std::max(fl[(size_t)s - 1] + 1, b));
        }
        std::vector<stage_plan> v;
        if (!plan_all(fl, &v)) return false;
        int w = 0;
        double room = worst(v, &w);
        for (int moves = 0; moves < L * S; moves++) {  // one block at a time off the tightest stage
            std::vector<int> best;
            double best_room = room;
            for (int dir : {-1, 1}) {
                const int nb = w + dir;  // the neighbour that takes its first (-1) or last (+1) block
                const int l0 = fl[(size_t)w], l1 = w + 1 < S ? fl[(size_t)w + 1] : L;
                if (nb < 0 || nb >= S || l1 - l0 < 2) continue;
                std::vector<int> tf = fl;
                if (dir < 0) tf[(size_t)w]++;
                else tf[(size_t)w + 1]--;
                std::vector<stage_plan> tv;
                if (!plan_all(tf, &tv)) return false;
                int tw = 0;
                const double r = worst(tv, &tw);
                if (r > best_room) best_room = r, best = tf;
            }
            if (best.empty()) break;
            fl = best;
            if (!plan_all(fl, &v)) return false;
            room = worst(v, &w);
        }
        *choice = "balanced by memory";
    } else {
        *choice = "as given";
    }
    if (!plan_all(fl, plans)) return false;
    *first = fl;
    for (int s = 0; s < S; s++) *choice += std::string(s ? " + " : ": ") + std::to_string((s + 1 < S ? fl[(size_t)s + 1] : L) - fl[(size_t)s]);
    *choice += " blocks";
    return true;
}

// the plans of a split as one: the first stage's fields, every stage's plan, the total of all
static void split_memory(ql_memory_plan *mp, const std::vector<stage_plan> &plans, const std::vector<int> &first, const std::string &choice) {
    *mp = plans[0].mem;
    mp->stages.clear();
    mp->total = mp->host = mp->weights = mp->weights_file = 0;
    for (const stage_plan &p : plans) {
        mp->stages.push_back(p.mem);
        mp->total += p.mem.total;
        mp->host += p.mem.host;
        mp->weights += p.mem.weights;
        mp->weights_file += p.mem.weights_file;
    }
    mp->stage_layers = first;
    mp->split_choice = choice;
}

// the first stage whose plan does not fit, named, and why; "" when all fit
static std::string split_over(const std::vector<stage_plan> &plans, const std::vector<int> &first, int L) {
    for (size_t s = 0; s < plans.size(); s++)
        if (!plans[s].fits)
            return "device " + std::to_string(s) + " (" + plans[s].mem.device_desc + ", blocks " + std::to_string(first[s]) + "-" +
                   std::to_string((s + 1 < plans.size() ? first[s + 1] : L) - 1) + ") " + plans[s].over;
    return "";
}

static bool split_plan(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                       const ql_train_options &o, ql_memory_plan *mp, std::string *err) {
    std::vector<int> first;
    std::vector<stage_plan> plans;
    std::string choice;
    if (!split_check(f, o, err) || !split_layers_for(f, train, eval, o, &first, &plans, &choice, err)) return false;
    split_memory(mp, plans, first, choice);
    *err = split_over(plans, first, f->model.hp.n_layer);
    return err->empty();
}

bool ql_train_plan(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                   const ql_train_options &o, ql_memory_plan *mp, std::string *err) {
    if (o.split.size() > 1) return split_plan(f, train, eval, o, mp, err);
    ql_trainer *t = setup(f, train, eval, o, err);
    if (!t) return false;
    bool ok = choose_levels(t, err);
    if (ok) *mp = t->mem;
    if (ok && !fits(t)) {
        *err = over_limit(t);
        ok = false;
    }
    ql_trainer_free(t);
    return ok;
}

// Sizes and the recompute policy (measuring passes), then one arena, the graphs' buffer, the
// placements and the optimizer's list: a trainer set up (the whole model, or a stage of a split)
static bool allocate(ql_trainer *t, std::string *err) {
    // sizes and the recompute policy first (measuring passes), then one arena
    if (!choose_levels(t, err)) {
        return false;
    }
    if (!fits(t)) {
        *err = over_limit(t);
        return false;
    }
    const size_t need = t->mem.lora + t->mem.grads + t->mem.optimizer + t->mem.inputs + t->mem.headers;  // the arena
    ql_init_params ip = {need + (1u << 16), nullptr, false, false};
    t->ctx = ql_init(ip);
    // evaluation runs between steps: its graph lives in the training graph's buffer (whose
    // gradients are zeroed at the start of every step anyway), so the plan printed is the peak
    // one buffer, the bigger graph's, the other graph pointed into it
    ql_plan_stats es{};
    bool ok_alloc = t->ctx && build(t, t->ctx) && ql_graph_plan(t->tr.g, t->be, &t->plan) == QL_OK &&
                    ql_graph_plan(t->ev.g, t->be, &es) == QL_OK;
    if (ok_alloc) {
        const bool train_bigger = es.buffer_size <= t->plan.buffer_size;
        ql_graph *big = train_bigger ? t->tr.g : t->ev.g, *small = train_bigger ? t->ev.g : t->tr.g;
        ok_alloc = ql_graph_alloc(big, t->be) == QL_OK && ql_graph_alloc_shared(small, t->be, big) == QL_OK;
        for (batch_io &b : t->bucket_io) ok_alloc = ok_alloc && ql_graph_alloc_shared(b.g, t->be, big) == QL_OK;
    }
    if (!ok_alloc) {
        *err = t->ctx ? ctx_message(t->ctx) : "out of memory";
        return false;
    }
    const std::vector<ql_tensor *> sw = stage_weights(t);  // (a stage of a split: its part of the model only)
    if (!t->on_host && (!(t->weights_buf = t->is_stage ? ql_backend_place_tensors(t->be, t->f->ctx, sw.data(), (int)sw.size())
                                                       : ql_backend_place_ctx_tensors(t->be, t->f->ctx)) ||
                        !(t->state_buf = ql_backend_place_ctx_tensors(t->be, t->ctx)))) {
        *err = "placing the model on " + std::string(ql_backend_name(t->be)) + ": " + ctx_message(t->weights_buf ? t->ctx : t->f->ctx);
        return false;
    }
    if (t->cache) {  // after the weights and the adapter are on the device: made from them (the adapter's again with each update)
        char e[512] = {0};
        std::vector<ql_tensor *> w = t->cache_w;
        for (ql_tensor *p : param_copies(t)) w.push_back(p);
        if (!(t->cache_buf = ql_backend_cache_weights(t->be, w.data(), (int)w.size(), t->compute, e, sizeof(e)))) {
            *err = "--cache-weights: " + ql_user_message(e);
            return false;
        }
    }
    if (!t->on_host && ql_optim_paged(t->o.optim)) {
        std::vector<ql_tensor *> moments;
        for (const auto &st : t->state) moments.insert(moments.end(), st.begin(), st.end());
        if (!(t->paged_buf = ql_backend_place_tensors_pinned(t->be, moments.data(), (int)moments.size()))) {
            *err = "paged optimizer: " + mib_text(t->mem.optimizer) + " of pinned host memory could not be had";
            return false;
        }
    }
    if (t->tr.embd && !t->on_host) {  // the embedding's rows input: pinned (its copy to the device is async, and captured)
        if (!(t->embd_buf = ql_backend_place_tensors_pinned(t->be, &t->tr.embd, 1))) {
            *err = "the embedding's rows input: " + mib_text(ql_nbytes(t->tr.embd)) + " of pinned host memory could not be had";
            return false;
        }
        for (batch_io &b : t->bucket_io)  // the shorter lengths' inputs: the same bytes (one run at a time)
            if (b.embd && b.embd != t->tr.embd) t->embd_alias.push_back({b.embd, b.embd->data}), b.embd->data = t->tr.embd->data;
    }
    for (const auto &st : t->state)  // zero moments (8-bit: zero absmax makes every code 0)
        for (ql_tensor *x : st)
            if (x->flags & QL_FLAG_HOST) memset(x->data, 0, ql_nbytes(x));
            else ql_backend_tensor_memset(t->be, x, 0, 0, ql_nbytes(x));
    const size_t n_in = (size_t)(t->T * t->B);
    t->in_tokens.assign(n_in, 0), t->in_pos.assign(n_in, 0), t->in_targets.assign(n_in, 0), t->in_seg.assign(n_in, 0);
    t->dist_grads.assign(t->mem.dist / sizeof(float), 0.0f);  // (world 1: none)
    for (const ql_tensor *p : t->params)
        if ((t->o.world > 1 || t->o.dist_always) && !t->on_host) t->dist_dev.push_back((float *)p->grad->data), t->dist_n.push_back((size_t)ql_nelements(p->grad));
    // the optimizer's groups, where they now live: one multi-tensor step over all of them
    std::vector<ql_optim_group> groups;
    for (size_t i = 0; i < t->params.size(); i++) {
        const std::vector<ql_tensor *> &st = t->state[i];
        const bool eight = st.size() == 4;
        groups.push_back({t->params[i], st[0], eight ? st[2] : st[1], eight ? st[1] : nullptr, eight ? st[3] : nullptr});
    }
    if (!(t->olist = ql_optim_list_new(t->be, groups.data(), (int)groups.size(), t->optim_store))) {
        *err = "the optimizer's list could not be written to " + std::string(ql_backend_name(t->be));
        return false;
    }
    return true;
}

// A split: the layers and plans chosen, then an outer trainer (the run: data, schedule, scaler)
// and one stage trainer per device, each allocated on it as a run of one device is
static ql_trainer *split_new(ql_llama_file *f, std::vector<ql_sequence> train, std::vector<ql_sequence> eval, const ql_train_options &o,
                             std::string *err) {
    std::vector<int> first;
    std::vector<stage_plan> plans;
    std::string choice;
    if (!split_check(f, o, err) || !split_layers_for(f, train, eval, o, &first, &plans, &choice, err)) return nullptr;
    if (!(*err = split_over(plans, first, f->model.hp.n_layer)).empty()) return nullptr;
    ql_train_options oo = o;
    oo.backend = o.split[0];  // (the outer trainer allocates nothing: its backend only describes)
    ql_trainer *t = setup(f, train, eval, oo, err);
    if (!t) return nullptr;
    t->own_train = std::move(train);
    t->own_eval = std::move(eval);
    t->train = &t->own_train;
    t->eval = &t->own_eval;
    t->slot.assign((size_t)(o.micro_batch * accum(t)), nullptr);
    t->order.reserve(t->train->size());
    const int S = (int)o.split.size(), L = f->model.hp.n_layer;
    for (int s = 0; s < S; s++) {
        ql_trainer *st = setup(f, *t->train, *t->eval, stage_options(o, (size_t)s), err, first[(size_t)s], s + 1 < S ? first[(size_t)s + 1] : L, true);
        if (st && st->caps.plan_only) *err = "no such device here to train on (" + st->mem.device_desc + "; --dry-run prints its plan)";
        if (!st || st->caps.plan_only || !allocate(st, err)) {
            *err = "device " + std::to_string(s) + ": " + *err;
            ql_trainer_free(st);
            ql_trainer_free(t);
            return nullptr;
        }
        t->stages.push_back(st);
    }
    std::vector<stage_plan> made(plans);  // the plans as the stages made them (the same choices)
    for (int s = 0; s < S; s++) made[(size_t)s].mem = t->stages[(size_t)s]->mem;
    split_memory(&t->mem, made, first, choice);
    t->xfer.assign((size_t)(f->model.hp.n_embd * t->T * t->B), 0.0f);
    give_back_heap();
    return t;
}

ql_trainer *ql_trainer_new(ql_llama_file *f, std::vector<ql_sequence> train, std::vector<ql_sequence> eval,
                           const ql_train_options &o, std::string *err) {
    if (o.split.size() > 1) return split_new(f, std::move(train), std::move(eval), o, err);
    ql_trainer *t = setup(f, train, eval, o, err);
    if (!t) return nullptr;
    if (t->caps.plan_only) {
        *err = "no such device here to train on (" + t->mem.device_desc + "; --dry-run prints its plan)";
        ql_trainer_free(t);
        return nullptr;
    }
    t->own_train = std::move(train);  // the run keeps the sequences (moved: no second copy)
    t->own_eval = std::move(eval);
    t->train = &t->own_train;
    t->eval = &t->own_eval;
    t->slot.assign((size_t)(o.micro_batch * accum(t)), nullptr);
    t->order.reserve(t->train->size());

    if (!allocate(t, err)) {
        ql_trainer_free(t);
        return nullptr;
    }
    give_back_heap();
    return t;
}

const ql_memory_plan &ql_trainer_memory(const ql_trainer *t) { return t->mem; }

bool ql_train_write_snapshot(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                             const ql_train_options &o, const char *path, std::string *err) {
    if (o.split.size() > 1) {
        *err = "the plan's snapshot of a model split over devices: not written (v1)";
        return false;
    }
    ql_trainer *t = setup(f, train, eval, o, err);
    if (!t) return false;
    bool ok = choose_levels(t, err);
    ql_init_params mp = {0, nullptr, false, true};
    ql_context *meas = ok ? ql_init(mp) : nullptr;
    ql_plan_stats ps{};
    ok = ok && build(t, meas) && ql_graph_plan(t->tr.g, t->be, &ps) == QL_OK;
    if (meas && !ok && err->empty()) *err = ctx_message(meas);
    FILE *out = ok ? fopen(path, "w") : nullptr;
    if (ok && !out) {
        *err = std::string(path) + ": cannot write: " + strerror(errno);
        ok = false;
    }
    if (out) {
        const ql_memory_plan &m = t->mem;
        fprintf(out, "{\"checkpointing\": \"%s\", \"micro_batch\": %d, \"total_bytes\": %zu, \"weights\": %zu, "
                     "\"adapter_grads_optimizer\": %zu, \"saved\": %zu, \"temporaries\": %zu, \"workspace\": %zu,\n \"tensors\": [",
                m.checkpointing.c_str(), m.micro_batch, m.total, m.weights, m.lora + m.grads + m.optimizer, m.saved, m.scratch,
                m.work);
        const ql_plan_entry *e = nullptr;
        const int n = ql_graph_plan_entries(t->tr.g, &e), nf = ql_graph_n_forward(t->tr.g);
        for (int i = 0; i < n; i++) {
            const ql_tensor *x = e[i].tensor;
            const char *cat = (x->flags & QL_FLAG_RECOMPUTED) ? "recomputed" : (e[i].first < nf && e[i].last >= nf) ? "saved" : "temporary";
            std::string name;
            for (const char *c = x->name[0] ? x->name : ql_op_name(x->op); *c; c++)
                if (*c == '"' || *c == '\\') name += '_';
                else if ((unsigned char)*c >= 0x20) name += *c;
            fprintf(out, "%s\n  {\"name\": \"%s\", \"op\": \"%s\", \"shape\": [%lld, %lld, %lld, %lld], \"bytes\": %zu, \"offset\": %zu, "
                         "\"first\": %d, \"last\": %d, \"category\": \"%s\"}",
                    i ? "," : "", name.c_str(), ql_op_name(x->op), (long long)x->ne[0], (long long)x->ne[1], (long long)x->ne[2],
                    (long long)x->ne[3], e[i].size, e[i].offset, e[i].first, e[i].last, cat);
        }
        fprintf(out, "\n]}\n");
        if (fclose(out) != 0) {
            *err = std::string(path) + ": cannot write";
            ok = false;
        }
    }
    free_io(t->tr);
    free_io(t->ev);
    for (batch_io &b : t->bucket_io) free_io(b);
    t->bucket_io.clear();
    if (meas) ql_free(meas);
    ql_trainer_free(t);
    return ok;
}

size_t ql_trainer_page_in_weights(const ql_trainer *t) {
    const uintptr_t P = (uintptr_t)sysconf(_SC_PAGESIZE);
    volatile uint8_t sink = 0;
    size_t n = 0;
    for (const auto &x : t->pages)
        for (uintptr_t pg = x.first; pg < x.second; pg++, n += P) sink = sink + *(const volatile uint8_t *)(pg * P);
    (void)sink;
    return n;
}

// the embedding's rows input given back: the shorter lengths' inputs to their own bytes, the pinned buffer freed
static void free_rows(ql_trainer *t) {
    for (auto &a : t->embd_alias) a.first->data = a.second;
    t->embd_alias.clear();
    ql_backend_buffer_free(t->embd_buf);
    t->embd_buf = nullptr;
}

void ql_trainer_free(ql_trainer *t) {
    if (!t) return;
    free_io(t->tr);
    free_io(t->ev);
    for (batch_io &b : t->bucket_io) free_io(b);
    t->bucket_io.clear();
    ql_optim_list_free(t->olist);
    ql_backend_buffer_free(t->paged_buf);
    free_rows(t);
    ql_backend_buffer_free(t->cache_buf);    // the weights' copies (their flags cleared),
    ql_backend_buffer_free(t->state_buf);    // the tensors back on the arena,
    ql_backend_buffer_free(t->weights_buf);  // the weights on the file mapping
    ql_backend_free(t->own_be);
    ql_free(t->ctx);
    for (size_t s = t->stages.size(); s-- > 0;) ql_trainer_free(t->stages[s]);  // (a split: the last placed first back)
    if (t->f && !t->cache_w.empty()) ql_weight_cache_mark(t->cache_w.data(), (int)t->cache_w.size(), false);  // (a plan's flags)
    if (t->f && !t->is_stage) {  // the model's adapters pointed into ctx (a split: the stages' contexts)
        t->f->model.lora.clear();
        t->f->model.compute = QL_TYPE_F32;
    }
    if (t->f && t->l0 == 0 && t->f->model.tok_embd)  // (a split: the first stage's choice)
        t->f->model.tok_embd->flags &= ~QL_FLAG_HOST;  // the next run decides again
    delete t;
}

int64_t ql_trainer_total_steps(const ql_trainer *t) { return t->total; }
int64_t ql_trainer_steps_done(const ql_trainer *t) { return t->step; }
bool    ql_trainer_intact(const ql_trainer *t) { return !t->broken; }
int64_t ql_trainer_updates_done(const ql_trainer *t) { return t->applied; }
double  ql_trainer_loss_scale(const ql_trainer *t) { return t->scale; }
int64_t ql_trainer_steps_per_epoch(const ql_trainer *t) { return t->per_epoch; }
int64_t ql_trainer_warmup_steps(const ql_trainer *t) { return t->warmup; }
const ql_plan_stats &ql_trainer_plan(const ql_trainer *t) { return t->plan; }
ql_llama &ql_trainer_model(ql_trainer *t) { return t->f->model; }
ql_graph *ql_trainer_graph(ql_trainer *t) { return t->tr.g; }

int64_t ql_trainer_n_trainable(const ql_trainer *t) {
    int64_t n = 0;
    for (const ql_trainer *pt : parts(t))
        for (const ql_tensor *p : pt->params) n += ql_nelements(p);
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

size_t ql_trainer_state_bytes(const ql_trainer *t) {  // adapter, gradients, optimizer state
    return t->mem.lora + t->mem.grads + t->mem.optimizer;
}

// sequence index of slot `i` (0 .. micro*accum-1) of step s, or -1 past the epoch's end
static int64_t slot_sequence(ql_trainer *t, int64_t s, int64_t i) {
    const int64_t epoch = s / t->per_epoch, at = (s % t->per_epoch) * t->B * accum(t) + i;
    const int64_t n = (int64_t)t->train->size();
    if (at >= n) return -1;
    if (t->order_epoch != epoch) {  // Fisher-Yates from (seed, epoch)
        t->order.resize((size_t)n);
        for (int64_t k = 0; k < n; k++) t->order[(size_t)k] = k;
        uint64_t state = t->o.seed ^ (0xA0761D6478BD642Full * (uint64_t)(epoch + 1));
        for (int64_t k = n - 1; k > 0; k--) {
            state = mix(state);
            std::swap(t->order[(size_t)k], t->order[(size_t)(state % (uint64_t)(k + 1))]);
        }
        if (t->o.group_by_length) {  // transformers' LengthGroupedSampler: mega-batches, each longest first
            const int64_t step = t->B * accum(t), mega = step * std::max<int64_t>(1, std::min<int64_t>(50, n / (4 * step)));
            const auto longer = [t](int64_t a, int64_t b) { return needed_len((*t->train)[(size_t)a]) > needed_len((*t->train)[(size_t)b]); };
            for (int64_t k = 0; k < n; k += mega)
                std::stable_sort(t->order.begin() + k, t->order.begin() + std::min(n, k + mega), longer);
        }
        t->order_epoch = epoch;
    }
    return t->order[(size_t)at];
}

// the shortest training graph that holds B sequences (NULL: none): the index into bucket_len
static size_t bucket_of(const ql_trainer *t, const ql_sequence *const *seqs) {
    int64_t longest = 1;
    for (int64_t b = 0; b < t->B; b++)
        if (seqs[b]) longest = std::max(longest, needed_len(*seqs[b]));
    size_t k = 0;
    while (k + 1 < t->bucket_len.size() && t->bucket_len[k] < longest) k++;
    return k;
}

void ql_trainer_epoch_tokens(ql_trainer *t, int64_t *real, int64_t *padded) {
    *real = *padded = 0;
    std::vector<const ql_sequence *> mb((size_t)t->B);
    const int64_t A = accum(t);  // (the epoch's, every rank's)
    for (int64_t s = 0; s < t->per_epoch; s++)
        for (int64_t a = 0; a < A; a++) {
            bool any = false;
            for (int64_t b = 0; b < t->B; b++) {
                const int64_t q = slot_sequence(t, s, a * t->B + b);
                mb[(size_t)b] = q >= 0 ? &(*t->train)[(size_t)q] : nullptr;
                if (q >= 0) *real += real_len(*mb[(size_t)b]), any = true;
            }
            if (any) *padded += t->B * t->bucket_len[bucket_of(t, mb.data())];  // (an empty one is not run)
        }
}
const std::vector<int64_t> &ql_trainer_lengths(const ql_trainer *t) { return t->bucket_len; }

// writes B sequences (NULL: empty, all targets -1) into a graph's inputs, through the backend
static bool fill(ql_trainer *t, const batch_io &io, const ql_sequence *const *seqs) {
    const int64_t T = io.pos->ne[0], B = t->B;  // the graph's length: each sequence's first T positions
    int32_t *tk = t->in_tokens.data(), *ps = t->in_pos.data(), *tg = t->in_targets.data();
    int32_t *sg = io.seg ? t->in_seg.data() : nullptr;
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
    const size_t n = (size_t)(T * B) * 4;
    if (io.embd) {  // the embedding on the host: its rows of this batch gathered into the (pinned) input the graph uploads
        const ql_tensor *e = t->f->model.tok_embd;
        const size_t E = (size_t)e->ne[0];
        if (!t->on_host && ql_backend_synchronize(t->be) != QL_OK) return false;  // (no run still reading the last batch's)
        for (size_t k = 0; k < (size_t)(T * B); k++)
            if (ql_tensor_row_to_float(e, tk[k], (float *)io.embd->data + k * E) != QL_OK) return false;
    }
    // (a stage of a split has the inputs its blocks read: the tokens on the first, the targets on the last)
    return (!io.tokens || ql_backend_tensor_set(t->be, io.tokens, tk, 0, n) == QL_OK) && ql_backend_tensor_set(t->be, io.pos, ps, 0, n) == QL_OK &&
           (!io.targets || ql_backend_tensor_set(t->be, io.targets, tg, 0, n) == QL_OK) &&
           (!sg || ql_backend_tensor_set(t->be, io.seg, sg, 0, n) == QL_OK);
}

static bool set_f32(ql_trainer *t, ql_tensor *x, float v) { return ql_backend_tensor_set(t->be, x, &v, 0, 4) == QL_OK; }
static bool get_f32(ql_trainer *t, const ql_tensor *x, float *v) { return ql_backend_tensor_get(t->be, x, v, 0, 4) == QL_OK; }

// Data parallel: every rank's gradients summed - on a device where they are when the build has NCCL
// (one grouped all-reduce), else in one packed host buffer - and the step's loss and token counts
// with them; false on a failed copy or collective.
static bool all_reduce_step(ql_trainer *t, double *loss, int64_t *padded, int64_t *real) {
    double v[3] = {*loss, (double)*padded, (double)*real};  // (counts exact in a double below 2^53)
    if (ql_dist_allreduce_f64(v, 3) != QL_OK) return false;
    *loss = v[0], *padded = (int64_t)v[1], *real = (int64_t)v[2];
    if (!t->dist_dev.empty()) {  // a device: where the gradients are, when the build can (NCCL)
        const ql_status st = ql_dist_allreduce_device_f32(t->be, t->dist_dev.data(), t->dist_n.data(), (int)t->dist_dev.size());
        if (st != QL_ERR_UNSUPPORTED) return st == QL_OK;
    }
    float *buf = t->dist_grads.data();
    size_t at = 0;
    for (const ql_tensor *p : t->params) {  // (on the CPU a copy; on a device through the host)
        if (ql_backend_tensor_get(t->be, p->grad, buf + at, 0, ql_nbytes(p->grad)) != QL_OK) return false;
        at += (size_t)ql_nelements(p->grad);
    }
    if (at != t->dist_grads.size() || ql_dist_allreduce_f32(buf, at) != QL_OK) return false;
    at = 0;
    for (const ql_tensor *p : t->params) {
        if (ql_backend_tensor_set(t->be, p->grad, buf + at, 0, ql_nbytes(p->grad)) != QL_OK) return false;
        at += (size_t)ql_nelements(p->grad);
    }
    return true;
}

// The step after the update (or its skip): the loss scaler, the counters, the metrics. sq, finite:
// the gradients' statistics the update used (every stage's, on a split).
static bool finish_step(ql_trainer *t, ql_step_metrics *m, std::chrono::steady_clock::time_point t0, double loss, int64_t padded,
                        int64_t real, int64_t targets, double scale, double lr, double sq, bool finite, std::string *err) {
    const int64_t s = t->step;
    const bool scaling = t->o.precision == ql_precision::fp16;
    const bool skip = scaling && !finite;  // (the update skipped itself: nothing was touched)
    const double norm = finite ? std::sqrt(sq) / scale : INFINITY;  // unscaled, before clipping
    if (skip) {  // GradScaler: no update, back off, count it; the data moves on, the schedule and Adam's step count do not
        t->scale *= t->o.scale_backoff;
        t->growth_tracker = 0;
        t->skipped++;
        if (++t->skipped_in_row >= 32) {
            t->step++;
            t->broken = true;  // the adapter is intact, but a checkpoint would carry a loss scale 2^-32 of where it was
            *err = "step " + std::to_string(t->step) + ": 32 steps in a row had non-finite gradients (loss scale now " +
                   std::to_string(t->scale) + "); the adapter is left as it was --> hint: --precision bf16, or a lower --lr";
            return false;
        }
    } else {
        if (!finite) {  // the update skipped itself: the adapter is untouched; name the first bad gradient
            std::string which = "?";
            std::vector<float> gh;  // an error path: the device's gradients come over to be named
            for (const ql_trainer *pt : parts(t))
            for (const ql_tensor *p : pt->params) {
                if (which != "?") break;
                gh.resize((size_t)ql_nelements(p));
                if (ql_backend_tensor_get(pt->be, p->grad, gh.data(), 0, gh.size() * 4) != QL_OK) break;
                const float *g = gh.data();
                int64_t i = 0;
                while (i < ql_nelements(p) && std::isfinite(g[i])) i++;
                if (i < ql_nelements(p)) {
                    which = std::string(p->name) + " (element " + std::to_string(i) + ": " + (std::isnan(g[i]) ? "nan" : "inf") + ")";
                    break;
                }
            }
            *err = "step " + std::to_string(s + 1) + ": the gradient of " + which +
                   " is not finite; the adapter is left as it was after step " + std::to_string(s) + " --> hint: a lower --lr";
            return false;
        }
        t->applied++;
        t->skipped_in_row = 0;
        if (scaling && ++t->growth_tracker >= t->o.scale_interval) {
            t->scale = std::min(t->scale * t->o.scale_growth, 0x1p64f);
            t->growth_tracker = 0;
        }
    }
    t->step++;
    m->step = t->step;
    m->loss = loss;
    m->lr = lr;
    m->grad_norm = norm;
    m->tokens = padded;
    m->real_tokens = real;
    m->targets = targets;
    m->loss_scale = scale;
    m->skipped = skip;
    m->skipped_total = t->skipped;
    m->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return true;
}


// ---- a model split over devices: the step and the evaluation over the stages ----

// the graph of a stage for bucket k (the training graph for the longest)
static const batch_io &stage_io(const ql_trainer *st, size_t k) { return k + 1 < st->bucket_len.size() ? st->bucket_io[k] : st->tr; }

// x's bytes from stage `from` (a result of its graph, or a leaf) into y of stage `to`, through
// the outer trainer's host buffer (limitation: v1 - a peer copy between the devices, or pinned
// memory with asynchronous copies, would spare the host's round trip)
static bool stage_copy(ql_trainer *t, ql_trainer *from, const ql_tensor *x, ql_trainer *to, ql_tensor *y) {
    const size_t n = ql_nbytes(x);
    if (n != ql_nbytes(y) || n > t->xfer.size() * sizeof(float)) return false;
    // card to card (a peer copy: direct where the cards have peer access, else staged by the
    // driver); through this process's memory between other backends
    const ql_status st = ql_backend_copy_peer(to->be, y, from->be, x);
    if (st != QL_ERR_UNSUPPORTED) return st == QL_OK;
    return ql_backend_tensor_get(from->be, x, t->xfer.data(), 0, n) == QL_OK && ql_backend_tensor_set(to->be, y, t->xfer.data(), 0, n) == QL_OK;
}

// A stage's error: its context's message, or what failed
static std::string stage_error(const ql_trainer *st, const std::string &what) {
    return ql_ctx_status(st->ctx) != QL_OK ? ctx_message(st->ctx) : what + " (" + std::string(ql_backend_name(st->be)) + ", blocks " +
                                                                      std::to_string(st->l0) + "-" + std::to_string(st->l1 - 1) + ")";
}

// One micro-batch through every stage (training: forward parts in order, the last stage whole,
// backward parts in reverse; evaluation: forward graphs in order); *l: the last stage's loss.
static bool split_micro_batch(ql_trainer *t, size_t k, const ql_sequence *const *seqs, bool train, float count, int32_t seed, float *l,
                              std::string *why) {
    const size_t S = t->stages.size();
    auto io_of = [&](const ql_trainer *st) -> const batch_io & { return train ? stage_io(st, k) : st->ev; };
    for (ql_trainer *st : t->stages) {  // every stage's inputs, the dropout seed; h_in's gradient accumulator zeroed
        const batch_io &io = io_of(st);
        if ((io.count && !set_f32(st, io.count, count)) || !fill(st, io, seqs) ||
            (train && ql_backend_tensor_set(st->be, st->seed, &seed, 0, 4) != QL_OK) ||
            (train && io.h_in && ql_backend_tensor_memset(st->be, io.h_in->grad, 0, 0, ql_nbytes(io.h_in->grad)) != QL_OK)) {
            *why = stage_error(st, "writing the micro-batch's inputs");
            return false;
        }
    }
    for (size_t j = 0; j + 1 < S; j++) {  // the forward parts, each stage's output the next one's input
        ql_trainer *st = t->stages[j], *nx = t->stages[j + 1];
        const batch_io &io = io_of(st);
        if (ql_backend_graph_compute_range(st->be, io.g, 0, ql_graph_n_forward(io.g)) != QL_OK ||
            !stage_copy(t, st, io.h_out, nx, io_of(nx).h_in)) {
            *why = stage_error(st, "its forward part, or its output's copy to the next device");
            return false;
        }
    }
    ql_trainer *last = t->stages[S - 1];
    if (ql_backend_graph_compute(last->be, io_of(last).g) != QL_OK || !get_f32(last, io_of(last).loss, l)) {
        *why = stage_error(last, "its graph, or reading the loss");
        return false;
    }
    for (size_t j = S - 1; train && j-- > 0;) {  // the backward parts in reverse, each from the gradient of its output
        ql_trainer *st = t->stages[j], *nx = t->stages[j + 1];
        const batch_io &io = io_of(st);
        if (!stage_copy(t, nx, io_of(nx).h_in->grad, st, io.g_out) ||
            ql_backend_graph_compute_range(st->be, io.g, ql_graph_n_forward(io.g), -1) != QL_OK) {
            *why = stage_error(st, "the gradient's copy from the next device, or its backward part");
            return false;
        }
    }
    return true;
}

// The step's sequences into t->slot (B x accumulation: every rank's micro-batches, nullptr past
// the data's end); returns their supervised-token count, the loss's denominator (every rank's),
// or 0 with the message when the step has none
static int64_t step_slots(ql_trainer *t, std::string *err) {
    const int64_t s = t->step, n = t->B * accum(t);
    int64_t targets = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t q = slot_sequence(t, s, i);
        t->slot[(size_t)i] = q >= 0 ? &(*t->train)[(size_t)q] : nullptr;
        if (q >= 0) targets += (*t->train)[(size_t)q].n_targets;
    }
    if (targets == 0) *err = "step " + std::to_string(s + 1) + " has no supervised tokens";
    return targets;
}

// The step of a split: ql_trainer_step's, micro-batch by micro-batch through the stages; the
// gradient norm summed over every stage's, so that one clip factor (and fp16's one skip) holds
// for all, each stage's update given that factor as its scale (and no clipping of its own).
static bool split_step(ql_trainer *t, ql_step_metrics *m, std::string *err) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t s = t->step, B = t->B, A = accum(t);  // (no data parallel with a split: world 1)
    const int64_t targets = step_slots(t, err);
    if (targets == 0) return false;
    const double scale = t->scale;
    auto fail = [&](const std::string &what) {
        t->broken = true;  // a backend error: a device may not give the adapter back
        *err = "step " + std::to_string(s + 1) + ": " + what;
        return false;
    };
    for (ql_trainer *st : t->stages) {
        if (!st->olist) return fail("the trainer's tensors left the devices (ql_trainer_to_host): no more steps");
        if (ql_backend_graph_zero_grads(st->be, st->tr.g) != QL_OK) return fail("cannot write to " + std::string(ql_backend_name(st->be)));
    }
    double loss = 0;
    int64_t padded = 0, real = 0;
    for (int64_t a = 0; a < A; a++) {
        const int32_t seed = (int32_t)(uint32_t)mix(t->o.seed * 0x9E3779B97F4A7C15ull + (uint64_t)(s * A + a));
        bool any = false;
        for (int64_t b = 0; b < B; b++)
            if (const ql_sequence *q = t->slot[(size_t)(a * B + b)]) real += real_len(*q), any = true;
        if (!any) continue;
        const size_t k = bucket_of(t, t->slot.data() + a * B);
        padded += B * t->bucket_len[k];
        float l = 0;
        std::string why;
        if (!split_micro_batch(t, k, t->slot.data() + a * B, true, (float)((double)targets / scale), seed, &l, &why)) return fail(why);
        if (!std::isfinite(l)) {  // (limitation: the node that made it first is not searched for over a split)
            *err = "step " + std::to_string(s + 1) + ", micro-batch " + std::to_string(a + 1) + ": the loss is " + (std::isnan(l) ? "nan" : "infinite") +
                   "; the adapter is left as it was after step " + std::to_string(s) + " --> hint: " +
                   (t->o.precision == ql_precision::fp16 ? "--precision bf16 (fp16 overflows past 65504), " : "") +
                   "a lower --lr, or check the data and the model";
            return false;
        }
        loss += l / scale;
    }
    const double lr = ql_trainer_lr_at(t, t->applied);
    const ql_adamw_params hp = {(float)lr, t->o.beta1, t->o.beta2, t->o.eps, t->o.weight_decay};
    double sq = 0;
    bool finite = true;
    for (ql_trainer *st : t->stages) {  // the global norm: every stage's sum of squares
        double q = 0;
        bool f = true;
        if (ql_backend_grad_stats_multi(st->be, st->olist, &q, &f) != QL_OK) return fail(stage_error(st, "the gradients' norm"));
        sq += q;
        finite = finite && f;
    }
    finite = finite && std::isfinite(sq);
    if (finite) {
        // the factor one device's update would apply (unscale and clip: ql_optim_step_factor); each
        // stage's update given it as 1 / its loss scale and no clipping (1 / (1 / f) is f again in
        // f32: a float's reciprocal and back in double rounds to it)
        const float factor = ql_optim_step_factor(sq, scale, t->o.max_grad_norm);
        for (ql_trainer *st : t->stages) {
            double q = 0;
            bool f = true;
            if (ql_backend_adamw_update_multi(st->be, st->olist, t->applied + 1, &hp, 1.0 / (double)factor, 0.0f, &q, &f) != QL_OK || !f)
                return fail(stage_error(st, "the optimizer's update"));
        }
    }
    return finish_step(t, m, t0, loss, padded, real, targets, scale, lr, sq, finite, err);
}

static bool split_eval(ql_trainer *t, double *loss, std::string *err) {
    int64_t targets = 0;
    for (const ql_sequence &s : *t->eval) targets += s.n_targets;
    if (targets == 0) {
        *err = "no evaluation tokens";
        return false;
    }
    double sum = 0;
    for (size_t i = 0; i < t->eval->size(); i += (size_t)t->B) {
        for (size_t b = 0; b < (size_t)t->B; b++) t->slot[b] = i + b < t->eval->size() ? &(*t->eval)[i + b] : nullptr;
        float l = 0;
        std::string why;
        if (!split_micro_batch(t, 0, t->slot.data(), false, (float)targets, 0, &l, &why)) {
            *err = "evaluation: " + why;
            return false;
        }
        sum += l;
    }
    if (!std::isfinite(sum)) {
        *err = std::string("the evaluation loss is ") + (std::isnan(sum) ? "nan" : "infinite");
        return false;
    }
    *loss = sum;
    return true;
}
bool ql_trainer_step(ql_trainer *t, ql_step_metrics *m, std::string *err) {
    if (!t->stages.empty()) return split_step(t, m, err);
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t s = t->step, B = t->B, A = accum(t);
    // this rank's micro-batches of the step: [a0, a1) of the A every rank's make up
    const int64_t a0 = (int64_t)t->o.rank * t->o.grad_accum, a1 = a0 + t->o.grad_accum;
    // the step's sequences, and its supervised-token count (the loss's denominator): every rank's
    const int64_t targets = step_slots(t, err);
    if (targets == 0) return false;
    // loss scaling: the loss's denominator divided by the scale multiplies the loss, so every
    // gradient, by it (exactly when the scale is a power of two, as with the default flags)
    const double scale = t->scale;
    if (ql_backend_graph_zero_grads(t->be, t->tr.g) != QL_OK) {
        t->broken = true;  // a backend error: the device may not give the adapter back
        *err = "step " + std::to_string(s + 1) + ": cannot write to " + std::string(ql_backend_name(t->be));
        return false;
    }
    double loss = 0;
    int64_t padded = 0, real = 0;
    for (int64_t a = a0; a < a1; a++) {
        const int32_t seed = (int32_t)(uint32_t)mix(t->o.seed * 0x9E3779B97F4A7C15ull + (uint64_t)(s * A + a));
        bool any = false;
        for (int64_t b = 0; b < B; b++)
            if (const ql_sequence *q = t->slot[(size_t)(a * B + b)]) real += real_len(*q), any = true;
        // past the epoch's end (its last step, or --grad-accum beyond the data): nothing to add
        // (its gradient is zero), so not run - the other micro-batches' seeds do not move
        if (!any) continue;
        const size_t k = bucket_of(t, t->slot.data() + a * B);  // the shortest graph that holds the micro-batch
        const batch_io &io = k + 1 < t->bucket_len.size() ? t->bucket_io[k] : t->tr;
        padded += B * t->bucket_len[k];
        float l = 0;
        if (!set_f32(t, io.count, (float)((double)targets / scale)) || !fill(t, io, t->slot.data() + a * B) ||
            ql_backend_tensor_set(t->be, t->seed, &seed, 0, 4) != QL_OK || ql_backend_graph_compute(t->be, io.g) != QL_OK ||
            !get_f32(t, io.loss, &l)) {
            t->broken = true;  // a backend error: the device may not give the adapter back
            *err = ql_ctx_status(t->ctx) != QL_OK ? ctx_message(t->ctx) : "step " + std::to_string(s + 1) + ": a device copy failed";
            return false;
        }
        if (!std::isfinite(l)) {  // the forward pass: no loss scale helps; find where it began
            ql_graph_set_check_finite(io.g, true);
            const bool found = ql_backend_graph_compute(t->be, io.g) != QL_OK;
            ql_graph_set_check_finite(io.g, false);
            const std::string where = found ? ql_ctx_error(t->ctx) : "";
            ql_ctx_clear_error(t->ctx);
            *err = "step " + std::to_string(s + 1) + ", micro-batch " + std::to_string(a + 1) + ": the loss is " +
                   (std::isnan(l) ? "nan" : "infinite") + (found ? "; first non-finite result: " + where.substr(std::min(where.size(), where.find("node "))) : "") +
                   "; the adapter is left as it was after step " + std::to_string(s) + " --> hint: " +
                   (t->o.precision == ql_precision::fp16 ? "--precision bf16 (fp16 overflows past 65504), " : "") +
                   (t->o.precision == ql_precision::fp16 && !t->o.ffn_down_f32 && where.find("swiglu") != std::string::npos
                        ? "--ffn-down-f32 (SwiGLU's result and the down projection in f32), "
                        : "") +
                   "a lower --lr, or check the data and the model";
            return false;
        }
        loss += l / scale;
    }
    // data parallel: the gradients complete once every rank's are summed (the one collective of
    // the step, after the last micro-batch and before clipping and the update)
    if ((t->o.world > 1 || t->o.dist_always) && !all_reduce_step(t, &loss, &padded, &real)) {
        t->broken = true;  // (another rank may have stopped: the job ends)
        *err = "step " + std::to_string(s + 1) + ": the all-reduce of the gradients over " + std::to_string(t->o.world) + " processes (" +
               ql_dist_name() + ") failed";
        return false;
    }
    if (!t->olist) {
        *err = "step " + std::to_string(s + 1) + ": the trainer's tensors left " + std::string(ql_backend_name(t->be)) +
               " (ql_trainer_to_host): no more steps";
        return false;
    }
    // the optimizer over every parameter at once: the global gradient norm, the clip factor
    // folded into the update's scale and the non-finite check all where the gradients live; the
    // norm and the finite flag come back once (the log, the loss scaler), after the update
    const double lr = ql_trainer_lr_at(t, t->applied);  // the schedule follows the updates made
    const ql_adamw_params hp = {(float)lr, t->o.beta1, t->o.beta2, t->o.eps, t->o.weight_decay};
    double sq = 0;
    bool finite = true;
    if (ql_backend_adamw_update_multi(t->be, t->olist, t->applied + 1, &hp, scale, t->o.max_grad_norm, &sq, &finite) != QL_OK) {
        t->broken = true;  // a backend error: the device may not give the adapter back
        *err = "step " + std::to_string(s + 1) + ": the optimizer's update failed on " + std::string(ql_backend_name(t->be));
        return false;
    }
    return finish_step(t, m, t0, loss, padded, real, targets, scale, lr, sq, finite, err);
}

bool ql_trainer_eval(ql_trainer *t, double *loss, std::string *err) {
    if (!t->stages.empty()) return split_eval(t, loss, err);
    int64_t targets = 0;
    for (const ql_sequence &s : *t->eval) targets += s.n_targets;
    if (targets == 0) {
        *err = "no evaluation tokens";
        return false;
    }
    double sum = 0;
    if (!set_f32(t, t->ev.count, (float)targets)) {
        *err = "evaluation: a device copy failed";
        return false;
    }
    for (size_t i = 0, k = 0; i < t->eval->size(); i += (size_t)t->B, k++) {
        if ((int64_t)(k % (size_t)t->o.world) != t->o.rank) continue;  // data parallel: the ranks' batches in turn
        for (size_t b = 0; b < (size_t)t->B; b++) t->slot[b] = i + b < t->eval->size() ? &(*t->eval)[i + b] : nullptr;
        float l = 0;
        if (!fill(t, t->ev, t->slot.data()) ||
            ql_backend_graph_compute(t->be, t->ev.g) != QL_OK || !get_f32(t, t->ev.loss, &l)) {
            *err = ql_ctx_status(t->ctx) != QL_OK ? ctx_message(t->ctx) : "evaluation: a device copy failed";
            return false;
        }
        sum += l;
    }
    if (t->o.world > 1 && ql_dist_allreduce_f64(&sum, 1) != QL_OK) {
        *err = std::string("evaluation: the all-reduce of the loss (") + ql_dist_name() + ") failed";
        return false;
    }
    if (!std::isfinite(sum)) {  // (fp16 overflow, or a broken adapter): an error, not a number in metrics
        *err = std::string("the evaluation loss is ") + (std::isnan(sum) ? "nan" : "infinite") +
               (t->o.precision == ql_precision::fp16 ? " --> hint: --precision bf16 (fp16 overflows past 65504)" : "");
        return false;
    }
    *loss = sum;
    return true;
}

// ---- checkpoints ----

// the schedule as asked for (not the warmup steps it came to: those follow the total, which an
// extended run changes)
static std::string scheduler_setting(const ql_train_options &o) {
    const std::string name = ql_name(o.scheduler);
    if (o.scheduler == ql_schedule::constant) return name;
    if (o.warmup_steps > 0) return name + ", warmup " + std::to_string(o.warmup_steps) + " steps";
    char b[32];
    snprintf(b, sizeof(b), "%.9g", o.warmup_ratio);
    return name + ", warmup ratio " + b;
}

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
    for (const ql_sequence &q : *t->train) {
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
            {"training data", std::to_string(t->train->size()) + " sequences of " + std::to_string(t->seq_len) + " tokens, fingerprint " + hex},
            {"seed", std::to_string(o.seed)},
            {"micro-batch", std::to_string(o.micro_batch)},
            {"gradient accumulation", std::to_string(accum(t))},  // the effective: any world that divides it resumes
            {"total steps", std::to_string(t->total)},
            {"lora r", std::to_string(o.lora.r)},
            {"lora alpha", num(o.lora.alpha)},
            {"rslora", o.lora.rslora ? "yes" : "no"},
            {"lora dropout", num(o.lora.dropout)},
            {"lora targets", targets},
            {"lora init seed", std::to_string(o.lora.init_seed)},
            {"learning rate", num(o.lr)},
            {"scheduler", scheduler_setting(o)},
            {"optimizer", std::string(ql_name(o.optim)) + ", betas " + num(o.beta1) + " " + num(o.beta2) + ", eps " + num(o.eps) + ", weight decay " + num(o.weight_decay)},
            {"max grad norm", num(o.max_grad_norm)},
            {"padding", std::string(t->bucket_len.size() > 1 || t->T < t->seq_len ? "to each micro-batch's longest" : "to the sequence length") +
                            (o.group_by_length ? ", grouped by length" : "")},
            {"precision", ql_name(o.precision) + std::string(o.precision == ql_precision::fp16 ? ", loss scale " + num(o.scale_init) + " x" + num(o.scale_growth) + " per " +
                                                                     std::to_string(o.scale_interval) + " clean steps, x" + num(o.scale_backoff) + " on overflow"
                                                               : "")}};
}

// parameter i and its optimizer state: what a checkpoint holds
static std::vector<ql_tensor *> with_state(const ql_trainer *t, size_t i) {
    std::vector<ql_tensor *> v = {t->params[i]};
    v.insert(v.end(), t->state[i].begin(), t->state[i].end());
    return v;
}

// ---- checkpoint integrity: a checksum of the payload, a fingerprint of the base model ----

// 64-bit FNV-1a over 8-byte words (then the tail bytes): ~GB/s, enough to notice any flipped
// byte in a checkpoint (not an adversary's collision)
static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
static const uint64_t k_hash_seed = 0xcbf29ce484222325ull;
static std::string hex64(uint64_t v) {
    char b[17];
    snprintf(b, sizeof(b), "%016llx", (unsigned long long)v);
    return b;
}

// The base model: its tensor table (names, types, shapes, sizes) and three 64-byte samples of
// every tensor's data (start, middle, end). Cost: ~3 cache lines per tensor (~900 for an 8B
// model), so resuming stays instant; it tells apart another model, the same model in another
// type (f32 vs its NF4 copy: other types and sizes) and another random init of one shape (other
// bytes), not a change that spares every sample.
static std::string base_fingerprint(const ql_llama_file *f) {
    const ql_gguf *g = f->gguf;
    uint64_t h = k_hash_seed;
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const char *name = ql_gguf_tensor_name(g, i);
        int64_t ne[4];
        ql_gguf_tensor_ne(g, i, ne);
        const int32_t type = (int32_t)ql_gguf_tensor_type(g, i);
        const size_t size = ql_gguf_tensor_size(g, i);
        h = hash_bytes(h, name, strlen(name));
        h = hash_bytes(h, ne, sizeof(ne));
        h = hash_bytes(h, &type, sizeof(type));
        h = hash_bytes(h, &size, sizeof(size));
        const uint8_t *d = (const uint8_t *)ql_gguf_tensor_data(g, i);
        if (!d) continue;
        for (size_t at : {(size_t)0, size / 2, size > 64 ? size - 64 : 0}) h = hash_bytes(h, d + at, std::min<size_t>(64, size - at));
    }
    return hex64(h);
}

// What a checkpoint's checksum covers: the step and scaler values, then every tensor's name and
// bytes in the order written (so a checkpoint is checked against itself, whatever the run)
static uint64_t checkpoint_hash(uint64_t step, uint64_t updates, float scale, uint64_t growth, uint64_t skipped) {
    uint64_t h = k_hash_seed;
    for (uint64_t v : {step, updates, growth, skipped}) h = hash_bytes(h, &v, sizeof(v));
    return hash_bytes(h, &scale, sizeof(scale));
}

bool ql_trainer_save(const ql_trainer *t, const char *path, std::string *err) {
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", t->f->arch.c_str());
    ql_gguf_set_str(w, "general.type", "qlora-checkpoint");
    ql_gguf_set_u32(w, "qlora.checkpoint.version", 1);
    ql_gguf_set_u64(w, "qlora.checkpoint.step", (uint64_t)t->step);
    ql_gguf_set_u64(w, "qlora.checkpoint.updates", (uint64_t)t->applied);  // steps not skipped
    ql_gguf_set_f32(w, "qlora.scaler.scale", t->scale);                    // GradScaler's state
    ql_gguf_set_u64(w, "qlora.scaler.growth_tracker", (uint64_t)t->growth_tracker);
    ql_gguf_set_u64(w, "qlora.scaler.skipped", (uint64_t)t->skipped);
    for (const auto &kv : run_settings(t)) ql_gguf_set_str(w, ("qlora.run." + kv.first).c_str(), kv.second.c_str());
    ql_gguf_set_str(w, "qlora.checkpoint.base", base_fingerprint(t->f).c_str());
    if (!t->o.command.empty()) {
        std::vector<const char *> cmd;
        for (const std::string &a : t->o.command) cmd.push_back(a.c_str());
        ql_gguf_set_arr_str(w, "qlora.run.command", cmd.data(), cmd.size());
    }
    uint64_t sum = checkpoint_hash((uint64_t)t->step, (uint64_t)t->applied, t->scale, (uint64_t)t->growth_tracker, (uint64_t)t->skipped);
    for (const ql_trainer *pt : parts(t))  // (a split: every stage's, in the order of the blocks - one device's file)
    for (size_t i = 0; i < pt->params.size(); i++)
        for (const ql_tensor *x : with_state(pt, i)) {
            const int64_t ne[4] = {x->ne[0], x->ne[1], 1, 1};
            void *h = host_data(pt, x);  // on a device: its host copy, brought up to date first
            if (!pt->on_host && ql_backend_tensor_get(pt->be, x, h, 0, ql_nbytes(x)) != QL_OK) {
                *err = std::string(path) + ": cannot read " + x->name + " from " + std::string(ql_backend_name(pt->be));
                ql_gguf_writer_free(w);
                return false;
            }
            if (ql_gguf_add_tensor(w, x->name, x->type, 2, ne, h, ql_nbytes(x)) != QL_OK) {
                *err = std::string(path) + ": tensor " + x->name + " could not be added";
                ql_gguf_writer_free(w);
                return false;
            }
            sum = hash_bytes(hash_bytes(sum, x->name, strlen(x->name)), h, ql_nbytes(x));
        }
    ql_gguf_set_str(w, "qlora.checkpoint.checksum", hex64(sum).c_str());
    char e[512];
    const bool ok = ql_gguf_write(w, path, e, sizeof(e)) == QL_OK;
    if (!ok) *err = e;
    ql_gguf_writer_free(w);
    return ok;
}

bool ql_trainer_state_hash(const ql_trainer *t, uint64_t *h) {
    uint64_t sum = k_hash_seed;
    for (const ql_trainer *pt : parts(t))
    for (size_t i = 0; i < pt->params.size(); i++)
        for (const ql_tensor *x : with_state(pt, i)) {
            void *d = host_data(pt, x);  // on a device: its host copy, brought up to date first
            if (!pt->on_host && ql_backend_tensor_get(pt->be, x, d, 0, ql_nbytes(x)) != QL_OK) return false;
            sum = hash_bytes(hash_bytes(sum, x->name, strlen(x->name)), d, ql_nbytes(x));
        }
    *h = sum;
    return true;
}

// A stored setting as a user gives it: the flag (finetune's) that sets it, and its numbers as
// written on a command line (the %.9g of a float - 0.000199999995 - back to 0.0002)
static std::string setting_name(const std::string &key) {
    static const std::pair<const char *, const char *> k_flags[] = {
        {"seed", "--seed"}, {"micro-batch", "-b"}, {"gradient accumulation", "--grad-accum"}, {"lora r", "--lora-r"},
        {"lora alpha", "--lora-alpha"}, {"rslora", "--rslora"}, {"lora dropout", "--lora-dropout"}, {"lora targets", "--lora-targets"},
        {"lora init seed", "--seed"}, {"learning rate", "--lr"}, {"max grad norm", "--max-grad-norm"}, {"precision", "--precision"}};
    // (the settings of several flags - optimizer, scheduler, padding, training data - keep their
    // names: their values read as the flags do)
    for (const auto &f : k_flags)
        if (key == f.first) return f.second;
    return key;
}
static std::string setting_value(const std::string &key, const std::string &v) {
    if (key == "training data" || key == "architecture" || key == "lora targets") return v;
    std::string out, tok;
    auto flush = [&]() {
        char *end = nullptr;
        const double x = tok.empty() ? 0 : strtod(tok.c_str(), &end);
        if (!tok.empty() && end && !*end && std::isfinite(x) && tok.find_first_of(".eE") != std::string::npos) {
            char b[32];
            snprintf(b, sizeof(b), "%g", (double)(float)x);
            out += b;
        } else {
            out += tok;
        }
        tok.clear();
    };
    for (char c : v) {
        if (c == ' ' || c == ',') {
            flush();
            out += c;
        } else {
            tok += c;
        }
    }
    flush();
    return out;
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
        std::string was = str("qlora.run." + kv.first, &found);
        if (!found && kv.first == "precision") was = "fp32", found = true;  // written before precisions existed
        if (!found && kv.first == "padding") was = "to the sequence length", found = true;  // before dynamic padding
        if (found && was == kv.second) continue;
        if (kv.first == "total steps") continue;  // more steps or epochs extend a run (the step is checked below)
        if (found && kv.first == "scheduler" && was == ql_name(t->o.scheduler) + std::string(", warmup ") + std::to_string(t->warmup) + " steps")
            continue;  // written before the schedule was stored as asked for
        why += (why.empty() ? "another run: " : "; ") + setting_name(kv.first) + " was " + (found ? setting_value(kv.first, was) : "(not recorded)") +
               ", now " + setting_value(kv.first, kv.second);
    }
    if (!why.empty() && why.rfind("another run", 0) == 0) why += " --> hint: resume with the same data and flags";
    bool has_base = false;
    const std::string base = str("qlora.checkpoint.base", &has_base), here = base_fingerprint(t->f);
    if (why.empty() && has_base && base != here)  // (checkpoints from before fingerprints: not checked)
        why = "it was trained on another base model (fingerprint " + base + ", this model's " + here +
              ": other tensors, types or weights) --> hint: resume with the model it was trained on";
    if (why.empty() && step > (uint64_t)t->total)
        why = "it is at step " + std::to_string(step) + ", past this run's " + std::to_string(t->total) +
              " steps --> hint: --max-steps or --epochs at least as many as it has done";
    // the scaler and the update count; a checkpoint from before they existed: no step skipped
    auto u64 = [&](const char *key, uint64_t def) {
        const int64_t i = ql_gguf_find_kv(g, key);
        uint64_t v = def;
        return i >= 0 && ql_gguf_get_u64(g, i, &v) ? v : def;
    };
    const uint64_t updates = u64("qlora.checkpoint.updates", step), growth = u64("qlora.scaler.growth_tracker", 0),
                   skipped = u64("qlora.scaler.skipped", 0);
    const int64_t isc = ql_gguf_find_kv(g, "qlora.scaler.scale");
    double sc = 0;
    const bool has_scale = isc >= 0 && ql_gguf_get_f64(g, isc, &sc);
    // values in range, or the run would fail later with a misleading message (or overflow)
    if (why.empty() && (updates > step || skipped > step || updates + skipped != step))
        why = "inconsistent counters (step " + std::to_string(step) + ", updates " + std::to_string(updates) + ", skipped " +
              std::to_string(skipped) + ")";
    if (why.empty() && growth > (uint64_t)std::max(1, t->o.scale_interval))
        why = "a loss-scaler growth count of " + std::to_string(growth) + " beyond the interval " + std::to_string(t->o.scale_interval);
    if (why.empty() && has_scale && !(std::isfinite(sc) && sc >= 0x1p-126 && sc <= 0x1p64))
        why = "a loss scale of " + std::to_string(sc) + " (2^-126 .. 2^64 expected)";
    bool has_sum = false;
    const std::string sum_was = str("qlora.checkpoint.checksum", &has_sum);
    if (why.empty() && has_sum) {  // every byte the run takes from the file, as it was written
        uint64_t sum = checkpoint_hash(step, updates, has_scale ? (float)sc : 1.0f, growth, skipped);
        for (int64_t k = 0; k < ql_gguf_n_tensors(g); k++) {
            const char *name = ql_gguf_tensor_name(g, k);
            sum = hash_bytes(hash_bytes(sum, name, strlen(name)), ql_gguf_tensor_data(g, k), ql_gguf_tensor_size(g, k));
        }
        if (hex64(sum) != sum_was)
            why = "damaged: its checksum does not match its contents (a changed byte since it was written) --> hint: an "
                  "earlier copy, or start again";
    }
    for (int pass = 0; pass < 2 && why.empty(); pass++)  // check every tensor, then copy: all or nothing
        for (const ql_trainer *pt : parts(t))
        for (size_t i = 0; i < pt->params.size() && why.empty(); i++)
            for (ql_tensor *x : with_state(pt, i)) {
                const int64_t k = ql_gguf_find_tensor(g, x->name);
                if (k < 0 || ql_gguf_tensor_type(g, k) != x->type || ql_gguf_tensor_size(g, k) != ql_nbytes(x)) {
                    why = std::string("tensor ") + x->name + " is missing or of another shape";
                    break;
                }
                if (pass == 1 && ql_backend_tensor_set(pt->be, x, ql_gguf_tensor_data(g, k), 0, ql_nbytes(x)) != QL_OK)
                    why = std::string("cannot write ") + x->name + " to " + std::string(ql_backend_name(pt->be));
            }
    if (!why.empty()) {
        ql_gguf_close(g);
        *err = std::string(path) + ": " + why;
        return false;
    }
    t->step = (int64_t)step;
    t->applied = (int64_t)updates;
    t->growth_tracker = (int64_t)growth;
    t->skipped = (int64_t)skipped;
    t->skipped_in_row = 0;
    t->scale = t->o.precision != ql_precision::fp16 ? 1.0f : has_scale && sc > 0 ? (float)sc : t->o.scale_init;
    ql_gguf_close(g);
    return true;
}

bool ql_checkpoint_info(const char *path, std::vector<std::string> *command, int64_t *step, int64_t *total, std::string *err) {
    char e[512];
    ql_gguf *g = ql_gguf_open(path, e, sizeof(e));
    if (!g) {
        *err = e;
        return false;
    }
    size_t len = 0;
    const int64_t it = ql_gguf_find_kv(g, "general.type"), is = ql_gguf_find_kv(g, "qlora.checkpoint.step"),
                  in = ql_gguf_find_kv(g, "qlora.run.total steps"), ic = ql_gguf_find_kv(g, "qlora.run.command");
    const char *type = it >= 0 ? ql_gguf_get_str(g, it, &len) : nullptr;
    const std::string kind = type ? std::string(type, len) : "";
    uint64_t s = 0;
    const char *tot = in >= 0 ? ql_gguf_get_str(g, in, &len) : nullptr;
    bool ok = kind == "qlora-checkpoint" && is >= 0 && ql_gguf_get_u64(g, is, &s);
    if (!ok) *err = std::string(path) + ": not a qlora checkpoint";
    command->clear();
    if (ok && (ic < 0 || ql_gguf_kv_type(g, ic) != QL_GGUF_ARRAY || ql_gguf_arr_type(g, ic) != QL_GGUF_STRING || ql_gguf_arr_n(g, ic) == 0)) {
        *err = std::string(path) + ": the checkpoint does not store its run's command (written by an older finetune): give the "
                                   "run's -m, -d and flags again";
        ok = false;
    }
    for (uint64_t j = 0; ok && j < ql_gguf_arr_n(g, ic); j++) {
        const char *a = ql_gguf_arr_str(g, ic, j, &len);
        command->push_back(a ? std::string(a, len) : "");
    }
    *step = (int64_t)s;
    *total = tot ? strtoll(tot, nullptr, 10) : 0;
    ql_gguf_close(g);
    return ok;
}

bool ql_trainer_to_host(ql_trainer *t, std::string *err) {
    for (ql_trainer *st : t->stages)  // a split: each stage's
        if (!ql_trainer_to_host(st, err)) return false;
    if (t->on_host || !t->stages.empty()) return true;
    for (size_t i = 0; i < t->params.size(); i++)  // the adapter and its moments changed; the weights did not
        for (ql_tensor *x : with_state(t, i))
            if (ql_backend_tensor_get(t->be, x, host_data(t, x), 0, ql_nbytes(x)) != QL_OK) {
                *err = std::string("cannot read ") + x->name + " from " + std::string(ql_backend_name(t->be));
                return false;
            }
    ql_backend_buffer_free(t->cache_buf);  // the weights' copies first (they point at nothing of the host)
    ql_backend_buffer_free(t->state_buf);  // every placed tensor back on its host bytes
    ql_backend_buffer_free(t->weights_buf);
    ql_backend_buffer_free(t->paged_buf);
    free_rows(t);
    ql_optim_list_free(t->olist);  // (its pointers were the device's: no step after this)
    t->olist = nullptr;
    t->state_buf = t->weights_buf = t->paged_buf = t->cache_buf = nullptr;
    for (const auto &st : t->state)
        for (ql_tensor *x : st) x->flags &= ~QL_FLAG_HOST;
    t->on_host = true;
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
