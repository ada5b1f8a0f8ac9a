// models/trainer.h - LoRA fine-tuning of a GGUF llama: the step loop with the semantics of
// transformers' Trainer (its Trainer and TrainingArguments documentation).
//
// One optimizer step = grad_accum micro-batches of micro_batch sequences. The loss of every
// micro-batch is summed over its supervised tokens and divided by the supervised tokens of the
// whole step (not by grad_accum), so accumulation equals one big batch. AdamW (decoupled weight
// decay) on fp32 master weights; gradients clipped to max_grad_norm after accumulation; the
// learning rate follows transformers' schedules: constant (no warmup, as transformers'
// "constant"), constant_with_warmup, linear, cosine, the last three with linear warmup from 0.
// Sequences are visited in an order shuffled per epoch from the seed, so the data position,
// the dropout masks and the schedule are all functions of the step: a checkpoint holds the
// adapter, the optimizer moments and the step, and resuming reproduces the uninterrupted run
// exactly.
//
// Memory is planned before anything is allocated (ql_train_plan): base weights (the pages a
// run reads), adapter, gradients, optimizer state, graph inputs, saved activations and
// temporaries; the recompute policy (checkpointing) decides what backward recomputes instead
// of keeping (ql_graph_recompute), "auto" the cheapest choice that fits mem_limit.
#pragma once

#include "data.h"
#include "llama.h"

#include <stdint.h>
#include <string>
#include <vector>

// ---- the run's choices: one enum each, one parser (ql_parse), one name (ql_name) ----
// The names are the flags' values, what checkpoints store and what messages print.
enum class ql_optim { adamw, adamw8bit, paged_adamw, paged_adamw8bit };
enum class ql_precision { fp32, bf16, fp16, automatic };  // automatic: the caller's to resolve (ql_auto_precision)
enum class ql_schedule { constant, constant_with_warmup, linear, cosine };
enum class ql_checkpointing { none, block, sqrt, automatic };  // automatic: the cheapest that fits mem_limit

const char *ql_name(ql_optim x);       // "adamw8bit"
const char *ql_name(ql_precision x);   // "bf16", "auto"
const char *ql_name(ql_schedule x);    // "constant_with_warmup"
const char *ql_name(ql_checkpointing x);
// The name's value; false with *err "unknown optimizer 'sgd' (adamw, adamw8bit, paged_adamw,
// paged_adamw8bit)" for anything else (exact, lower case: the names above).
bool ql_parse(const std::string &s, ql_optim *x, std::string *err);
bool ql_parse(const std::string &s, ql_precision *x, std::string *err);
bool ql_parse(const std::string &s, ql_schedule *x, std::string *err);
bool ql_parse(const std::string &s, ql_checkpointing *x, std::string *err);
inline bool ql_optim_8bit(ql_optim x) { return x == ql_optim::adamw8bit || x == ql_optim::paged_adamw8bit; }
inline bool ql_optim_paged(ql_optim x) { return x == ql_optim::paged_adamw || x == ql_optim::paged_adamw8bit; }

struct ql_train_options {
    ql_lora_config lora;
    bool  packed = false;  // sequences hold several documents: attention masked by segment
    int   micro_batch = 4;
    int   grad_accum = 1;
    float lr = 2e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
    float max_grad_norm = 1.0f;         // <= 0: no clipping
    // adamw (f32 moments) | adamw8bit (bitsandbytes' blockwise 8-bit moments; tensors under 4096
    // elements keep f32) | paged_adamw | paged_adamw8bit (on a device the state lives in pinned
    // host memory, which the device's kernel updates in place; on the CPU it is host memory anyway)
    ql_optim optim = ql_optim::adamw;
    // the compute type of activations and matmul inputs: fp32 | bf16 | fp16 (ql_llama.compute);
    // master weights, gradients, sums, norms, softmax and the loss stay f32. ("auto" is the
    // caller's to resolve: ql_auto_precision.)
    ql_precision precision = ql_precision::fp32;
    // bf16: attention's products stay f32 (ql_llama.attn_bf16 off). The CPU multiplies them in bf16
    // where it has AVX512-BF16 - a run on another backend is then not the CPU's to the rounding.
    bool attn_f32 = false;
    // 16-bit precisions: the FFN past gate and up (SwiGLU's result, the down projection and its
    // LoRA) in f32 (ql_llama.ffn_down_f32) - fp16's guard against a SwiGLU result past 65504
    bool ffn_down_f32 = false;
    // fp16 only: dynamic loss scaling, torch's GradScaler. The loss (so every gradient) is
    // multiplied by the scale; a step with a non-finite gradient is skipped (no update, the
    // schedule and Adam's step count stay) and the scale multiplied by backoff; after `interval`
    // clean steps in a row it is multiplied by growth. Gradients are unscaled before clipping.
    // (the scale stays at most 2^64: beyond, the loss's f32 denominator would underflow)
    float scale_init = 65536.0f, scale_growth = 2.0f, scale_backoff = 0.5f;
    int   scale_interval = 2000;
    ql_schedule scheduler = ql_schedule::linear;
    double warmup_ratio = 0.0;          // warmup steps = warmup_steps if > 0, else ceil(ratio * total steps)
    int64_t warmup_steps = 0;
    int     epochs = 1;
    // each micro-batch padded only to its longest sequence: training graphs for a few lengths
    // (halves and three-quarters down from the longest sequence's, at least 16), planned and
    // allocated once in the buffer of the longest, which the memory plan covers. Off: every
    // micro-batch as long as the sequences (--seq-len). (Not with offload_activations on a device.)
    bool dynamic_padding = true;
    // transformers' group_by_length: each epoch's shuffled order cut into mega-batches of 50
    // steps' sequences, each sorted longest first, so that a micro-batch holds similar lengths
    bool group_by_length = false;
    int64_t max_steps = -1;             // > 0: overrides epochs
    uint64_t seed = 42;                 // data order and dropout masks (the adapter's init: lora.init_seed)
    int threads = 0;                    // 0: ql_cpu_default_threads() (physical cores not busy with other work)
    // the backend that trains, the caller's (created once, e.g. from --device by
    // ql_backend_init_device; it outlives the trainer); NULL: a CPU backend of `threads` the
    // trainer makes. On a GPU the base weights are placed on it once, adapter, gradients,
    // optimizer state and inputs live there, and the host sees them only through the backend's
    // set/get; the memory plan is then the device's (ql_memory_plan.device). A stand-in
    // (ql_backend_init_planned) plans a card this machine lacks: ql_train_plan only.
    ql_backend *backend = nullptr;
    // memory
    ql_checkpointing checkpointing = ql_checkpointing::none;
    size_t mem_limit = 0;                // bytes for the whole process; 0: none (auto needs one)
    size_t mem_other = 0;                // bytes the process holds besides what the trainer plans
    // block checkpoints in pinned host memory, copied on a second stream (ql_graph_offload; on
    // the CPU: accounted only - one memory)
    bool offload_activations = false;
    // with it: checkpoints brought back late, twice a block (QL_OFFLOAD_LATE): none on the device
    // through a block's backward; the compute may wait for the copies
    bool offload_late = false;
    // with it: backward's own large results that wait across a block's attention backward (the
    // residual stream's gradient, the attention norm's 16-bit output) parked in pinned host memory
    // meanwhile (QL_OFFLOAD_GRADS), and each block's checkpoint brought back after the one before
    // is done with: the least device memory a token; the compute waits for more of the copies
    bool offload_grads = false;
    // adapter dropout inside A's multiply (ql_mul_mat_dropout: the mask regenerated as x is read,
    // no dropped-out copy of x per adapted linear). -1 auto: on the CPU over f32 x (the copies'
    // bits, less memory), off on a device (its kernels made an H200's step 14% slower than the
    // copies and cuBLAS); 0 off; 1 on, over f32 x; 16 on, over x's copy in the 16-bit compute type
    // (backward keeps that copy, not f32 x or the dropped-out copies: the least memory, but a kept
    // element is rounded twice - within a 16-bit ulp of the copies', not their bits)
    int lora_dropout_fused = -1;
    // the loss's output projection and cross-entropy in chunks of rows (ql_llama_loss): 0 auto
    // (chunks of at most 2^23 logits when the whole would be more: always on a device, on the CPU
    // when the plan does not fit without; on a device the fused loss's chunks of 512+ rows, 2^26
    // logits, where the plan fits them as well as those), > 0 rows per chunk, < 0 one
    int64_t loss_chunk = 0;
    // the head and the loss fused (ql_llama_loss's grad): dlogits and dh made in forward, chunk by
    // chunk, no logits recompute. false: backward recomputes each chunk's logits (the old path,
    // kept for comparisons)
    bool loss_fused = true;
    // the feed-forward in chunks of tokens (ql_llama.ffn_chunk): 0 auto (chunks of at most 2^23
    // elements per intermediate when the whole would be more and the plan recomputes and does not
    // fit without), > 0 tokens per chunk, < 0 whole
    int64_t ffn_chunk = 0;
    // a device run: the token embedding stays in host memory and only the step's rows are
    // gathered there and uploaded (1: yes, 0: no, -1: auto - when the plan does not fit without)
    int embd_on_host = -1;
    // a device run: each frozen linear weight of the blocks (and the output head) that is not
    // of the compute type gets a copy in it on the device, made once after loading; the products
    // read it instead of dequantising tiles (ql_backend_cache_weights: the same GEMM inputs).
    // 1: on (every other choice made with it; refused when it does not fit), 0: off, -1: auto -
    // on when the plan with it fits the memory limit with the options chosen without it (the
    // first thing given up). The CPU: off (it converts weights while packing; 1 is refused).
    int cache_weights = -1;
    // a device run: attention's backward runs as products over chunks of queries, sized by a budget
    // for one chunk's f32 scores (ql_flash_attn_set_score_bytes), in MiB. 0 auto: twice the default
    // (QL_FLASH_ATTN_SCORE_BYTES) where the plan fits with it and the chunks grow - fewer, larger
    // products (at seq 2048 and 32 heads 256 queries a chunk instead of 128: 2-3% of an H200's 1B
    // and 8B steps, bench/RESULTS.md, session 10), added after the weights' copies, so given up
    // first; > 0 that budget.
    int attn_score_mib = 0;
    // a device run: attention's backward (the forward is the fused kernel either way, where it takes
    // the shape: bf16 compute, head dim 64, 80, 96 or 128). 1: the fused kernels (FlashAttention-2,
    // deterministic); 0: cuBLAS products over chunks of queries; -1 auto: the faster on this card -
    // one layer at the run's shape timed both ways at the start (ql_cuda_fa_choose; once a process,
    // the choice then kept for every later trainer), unless QLORA_CUDA_FA or ql_cuda_fa_set_mode
    // set the mode. A plan for a card this machine lacks plans the products (the larger workspace).
    // Process-wide: it sets ql_cuda_fa_set_mode. The CPU: 1 and 0 are refused (its attention is tiled).
    int attn_backward = -1;
    // a device run: the device memory the plan must fit. 0: the device's free memory at the start
    // (a stand-in has none: no limit); otherwise it caps the plan like mem_limit.
    size_t vram = 0;
    // data parallel (qlora.h's ql_dist_*): this process is rank `rank` of `world`, each with the
    // same model, data and options. grad_accum is per process: a step is world x grad_accum
    // micro-batches, rank r computing those from r x grad_accum on, with the data order, dropout
    // masks, loss normalisation (the step's supervised tokens, all ranks') and schedule of one
    // process with world x grad_accum. The gradients are summed over the ranks (ql_dist_allreduce_f32
    // on one packed host buffer; on a GPU with NCCL built in, ql_dist_allreduce_device_f32 where they
    // are) after the last micro-batch, before clipping and the update, which
    // every rank then makes alike. Checkpoints store the effective accumulation (world x grad_accum):
    // one resumes under any world that divides it. Evaluation splits its batches over the ranks.
    int world = 1, rank = 0;
    bool dist_always = false;  // the step's all-reduce even when world is 1: a check of the collectives on one device
    // a model split over devices (--device cuda:0,cuda:1): one backend per stage, in order (the
    // caller's, as `backend`, which a split leaves unused). Stage s trains consecutive blocks on
    // split[s] - the first also the embedding, the last the final norm, head and loss - with its
    // own plan, graphs, adapter part and optimizer state; a micro-batch runs each stage's forward
    // part in turn, the residual stream copied to the next device, then the backward parts in
    // reverse, the gradient of that stream copied back (through host memory: v1). One gradient
    // norm over all stages clips them all, and fp16's skip is decided for all: the same step as
    // one device. Not with data parallel (world > 1), nor with a tied output projection.
    std::vector<ql_backend *> split;
    std::vector<size_t> split_vram;  // each stage's device memory (one value: every stage's; empty: each device's free memory)
    // the first block of each stage ([0] = 0, ascending; empty: balanced by memory - each stage's
    // share of the blocks proportional to its memory, then one block at a time moved off the
    // stage with the least room while that gives the tightest one more)
    std::vector<int> split_layers;
    // the caller's command line, stored in checkpoints as qlora.run.command (not compared on
    // load: the settings it produced are): what lets a tool resume a run from its directory alone
    std::vector<std::string> command;
};

// Where the memory of a run goes, all known before step one (bytes).
struct ql_memory_plan {
    std::vector<std::pair<std::string, size_t>> weights_by_type;  // type name -> bytes read
    size_t weights = 0;         // pages of the base model a run reads (embedding: rows the data uses)
    size_t weights_resident = 0;  // of them, those in the process's memory when planned (read by loading)
    size_t weights_file = 0;    // the model's tensor bytes in the file
    size_t lora = 0, grads = 0, optimizer = 0;
    bool   optimizer_host = false;  // paged optimizers: the state is host memory
    size_t inputs = 0;          // graph inputs (tokens, positions, targets, ...)
    size_t headers = 0;         // tensor headers and graph bookkeeping in the arena
    size_t graph_heap = 0;      // the graphs' own lists and plans on the heap (ql_graph_heap_bytes)
    size_t saved = 0;           // forward results alive when backward starts (checkpoints included)
    size_t checkpoints = 0;     // of them, the kept segment inputs (host memory with offload)
    bool   offload = false;     // --offload-activations: checkpoints counted as host memory
    size_t recompute = 0;       // most bytes of recomputed results alive at once (in room the saved free)
    size_t scratch = 0;         // the rest of the planned buffer (temporaries, recomputed results)
    size_t work = 0;            // kernel workspace (matmul packing, attention tiles)
    size_t dist = 0;            // data parallel (world > 1): the gradients packed in host memory for the all-reduce
    size_t reserve = 0;         // for what no plan sees (heap bookkeeping, code pages): 0.75 MiB + 0.5%
    size_t total = 0;           // weights + arena + planned buffer + reserve: what the trainer adds to the process
    size_t host = 0;            // of it host memory (the process's RSS grows by this): total, or a device run's host part
    std::string checkpointing;  // the policy; with auto, what it chose ("auto: 6 of 24 segments recomputed")
    std::vector<int> levels;    // ql_keep per segment
    double recompute_fraction = 0;  // recomputed / forward FLOPs
    int micro_batch = 0;
    int64_t loss_chunk = 0;     // rows per cross-entropy chunk (0: unchunked)
    bool loss_fused = false;    // the head and the loss fused (dh made in forward)
    int64_t ffn_chunk = 0;      // tokens per feed-forward chunk (0: unchunked)
    // where adapter dropout runs: "" (none drawn), "copies" (a dropped-out copy of x per adapted
    // linear), "in A's multiply" (over f32 x), "in A's multiply, over x's 16-bit copy"
    std::string lora_dropout;
    // a device run (a GPU, or a stand-in planning for one): total is device memory, made of these
    bool   device = false;
    std::string device_desc;    // the device, or "planned for cc 8.6" without one
    int    cc = 0;
    size_t vram = 0;            // the device memory the plan must fit (0: no limit known)
    size_t dev_weights = 0;     // base weights placed whole, as stored (NF4 stays NF4); not the embedding on the host
    std::vector<std::pair<std::string, size_t>> dev_weights_by_type;
    size_t dev_state = 0;       // adapter, gradients, moments and graph inputs: one placement
    size_t dev_buffer = 0;      // the graphs' planned buffer (saved, temporaries, recompute, workspace)
    size_t dev_context = 0;     // the device's context and library workspace (ql_backend_caps.context_bytes)
    bool   dev_context_estimated = false;  // an estimate for this cc, not measured on such a card
    size_t dev_graph = 0;       // of dev_context: the training graph's CUDA graph executable (census launches x ql_backend_caps.graph_launch_bytes)
    size_t dev_granularity = 0; // which rounds each allocation up to a multiple of this
    size_t dev_rounding = 0;    // the device allocator's granularity over our few allocations (+ one for its scratch)
    size_t host_pinned = 0;     // pinned host memory: offloaded checkpoints (--offload-activations) and host_rows
    size_t host_rows = 0;       // of it the step's embedding rows input (a device run with the embedding on the host)
    size_t host_parked = 0;     // of it backward's results parked across attention's backward (offload_grads)
    bool   embd_on_host = false;
    size_t host_embd = 0;       // the embedding's bytes kept in host memory (read a row at a time)
    size_t dev_cache = 0;       // --cache-weights: the frozen weights' copies in the compute type (0: none)
    size_t cache_candidate = 0; // what those copies take (or would), whether or not they are made
    std::string cache_weights;  // the choice and why ("auto: on", "auto: off (does not fit)", "off", "on")
    int64_t attn_chunk = 0;     // a device run: queries per chunk of attention's products (the longest sequence's)
    std::string attn_scores;    // its score budget and why ("auto: 64 MiB", "auto: 32 MiB (does not fit with 64)", "48 MiB")
    bool attn_fused = false;    // a device run: attention's backward by the fused kernels (else the products, in chunks)
    std::string attn_backward;  // which and why ("fused kernels (auto: timed ...)", "products (--attn-backward products)")
    ql_census census{};         // one micro-batch's training graph on the plan's backend (ql_graph_census)
    // a split (ql_train_options.split): each stage's plan, in order, and the first block of each;
    // the fields above are then the first stage's, but total (every stage's), which fits no one
    // device: each stage fits its own limit (stages[s].vram)
    std::vector<ql_memory_plan> stages;
    std::vector<int> stage_layers;
    std::string split_choice;   // how the layers were chosen ("balanced by memory: 41 + 39", "as given")
};

// The process's bytes besides the plan's, from its RSS before training: the weight pages loading
// read already are in both, and counted once, in the plan (the demo's model: 1.4 of 2.5 MiB)
inline size_t ql_plan_process(const ql_memory_plan &m, size_t rss) { return rss - (rss < m.weights_resident ? rss : m.weights_resident); }

struct ql_step_metrics {
    int64_t step = 0;          // optimizer steps done, this one included
    double  loss = 0;          // mean over the step's supervised tokens
    double  lr = 0;            // the rate this step used
    double  grad_norm = 0;     // before clipping
    int64_t tokens = 0;        // sequence positions processed (padding included)
    int64_t real_tokens = 0;   // positions before the padding (the data's tokens)
    int64_t targets = 0;       // supervised tokens
    double  seconds = 0;
    // loss scaling (fp16): the scale this step used, whether it was skipped, skips so far
    double  loss_scale = 1;
    bool    skipped = false;
    int64_t skipped_total = 0;
};

struct ql_trainer;

// Builds adapters on f's model, the training and evaluation graphs and all state, sized and
// allocated once. train/eval: sequences of the same length (ql_dataset_sequences), kept by the
// trainer (std::move them in to avoid a copy).
ql_trainer *ql_trainer_new(ql_llama_file *f, std::vector<ql_sequence> train, std::vector<ql_sequence> eval,
                           const ql_train_options &o, std::string *err);
// The memory plan of such a trainer, without allocating anything. With mem_limit set, false
// (and the plan of the smallest configuration tried) when it does not fit.
bool        ql_train_plan(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                          const ql_train_options &o, ql_memory_plan *mp, std::string *err);
const ql_memory_plan &ql_trainer_memory(const ql_trainer *t);
// Every tensor the training graph's plan places (the policy applied as ql_train_plan would), as
// JSON: name, op, shape, bytes, offset, the nodes that make it and read it last, category
// (saved, recomputed, temporary). For the post-mortem of a plan that does not fit.
bool        ql_train_write_snapshot(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                                    const ql_train_options &o, const char *path, std::string *err);
// Reads one byte of every page of base weights the run will read (the plan's `weights`), so
// that they are resident now rather than during step one; returns the bytes.
size_t      ql_trainer_page_in_weights(const ql_trainer *t);
void        ql_trainer_free(ql_trainer *t);

int64_t     ql_trainer_total_steps(const ql_trainer *t);
int64_t     ql_trainer_steps_done(const ql_trainer *t);
int64_t     ql_trainer_updates_done(const ql_trainer *t);  // steps not skipped: the schedule's position
double      ql_trainer_loss_scale(const ql_trainer *t);    // 1 without loss scaling
int64_t     ql_trainer_steps_per_epoch(const ql_trainer *t);
int64_t     ql_trainer_warmup_steps(const ql_trainer *t);
int64_t     ql_trainer_n_trainable(const ql_trainer *t);   // adapter parameters
int64_t     ql_trainer_n_base(const ql_trainer *t);        // base model parameters (any type)
const ql_plan_stats &ql_trainer_plan(const ql_trainer *t); // the training graph's memory plan
size_t      ql_trainer_state_bytes(const ql_trainer *t);   // adapter + gradients + optimizer moments
ql_llama   &ql_trainer_model(ql_trainer *t);
// the training graph (forward + backward), e.g. for ql_graph_set_profile / ql_graph_node_seconds
ql_graph   *ql_trainer_graph(ql_trainer *t);
// dynamic padding: the training graphs' lengths (ascending; the last is the longest sequence's)
const std::vector<int64_t> &ql_trainer_lengths(const ql_trainer *t);
// one epoch's positions before the padding, and as computed (each micro-batch padded to its graph)
void        ql_trainer_epoch_tokens(ql_trainer *t, int64_t *real, int64_t *padded);
double      ql_trainer_lr_at(const ql_trainer *t, int64_t step);  // the schedule (step from 0)

// "auto" precision on a backend: bf16 where it multiplies bf16 natively (ql_backend_caps.bf16_gemm:
// a GPU from compute capability 8.0; the CPU with AMX or AVX512-BF16, ql_cpu_bf16_native: 2.26x
// fp32's tokens/s at the 110M shape, the loss within 0.44%); else fp16 with loss scaling on a GPU,
// fp32 on the CPU (there 16-bit inputs are widened to f32: no faster - bench/RESULTS.md).
ql_precision ql_auto_precision(const ql_backend *be);

// One optimizer step. false with *err on a run-time error (e.g. a non-finite loss: the message
// names the first graph node that made a nan or inf). With loss scaling, a step whose gradients
// are not finite is skipped (m->skipped) and true is returned - unless 32 steps in a row were
// (the scale then 2^-32 of where it was: something else is wrong), which stops with advice.
bool ql_trainer_step(ql_trainer *t, ql_step_metrics *m, std::string *err);
// After a failed step: whether the adapter, its optimizer state and the step count are the last
// completed step's, worth saving. True after a non-finite loss or gradient (they stop before the
// update); false after a backend error (the device may not give them back, or an update stopped
// part-way) and after fp16's 32 skipped steps in a row (the loss scale is no longer one to resume with).
bool ql_trainer_intact(const ql_trainer *t);
// Mean loss over every supervised token of the evaluation sequences (no dropout).
bool ql_trainer_eval(ql_trainer *t, double *loss, std::string *err);

// The adapter, the optimizer moments, the step and the settings that must match on resume,
// in one GGUF written atomically. Loading checks that the run is the same run.
bool ql_trainer_save(const ql_trainer *t, const char *path, std::string *err);
// A checksum of the adapter and its optimizer state (the bytes a checkpoint holds), for data-parallel
// ranks to see that they made the same updates; false when the backend cannot give them back.
bool ql_trainer_state_hash(const ql_trainer *t, uint64_t *h);
// After the last step, before exporting adapters (or a merged model) from ql_trainer_model: brings
// the adapter and its optimizer state back to host memory and points the model's tensors at
// their host copies again (a no-op on the CPU). No step may run after it.
bool ql_trainer_to_host(ql_trainer *t, std::string *err);
// The total step count may differ from the checkpoint's (a finished run extended by more steps
// or epochs: the schedule then spans the new total); every other setting must match.
bool ql_trainer_load(ql_trainer *t, const char *path, std::string *err);
// A checkpoint's stored command (ql_train_options.command) and its step and total steps, without
// a model; false with the reason (not a checkpoint, or one that stored no command).
bool ql_checkpoint_info(const char *path, std::vector<std::string> *command, int64_t *step, int64_t *total, std::string *err);

// A library message for a user's line: without the "qlora.cpp:3284: " location the library's
// errors carry (kept when QLORA_DEBUG is set in the environment)
std::string ql_user_message(const std::string &msg);

// PEFT's line, exactly: "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622"
std::string ql_trainable_line(int64_t trainable, int64_t base);
