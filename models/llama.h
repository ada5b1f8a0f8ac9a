// models/llama.h - the llama family as a graph of qlora ops.
//
// Weights carry llama.cpp's GGUF tensor names (token_embd.weight, blk.N.attn_q.weight, ...) and
// layouts (ne = [in, out]; q/k rows in Meta's rope order), so a model read from GGUF and one made
// here are the same object. Every linear weight goes through ql_llama_linear: the one place an
// adapter attaches.
#pragma once

#include "../qlora.h"

#include <stdint.h>
#include <string>
#include <unordered_map>
#include <vector>

struct ql_llama_hparams {
    int   n_ctx_train = 0;    // the context the model was trained with (0: unknown)
    int   n_rot     = 0;      // rope dimensions per head (0: the whole head)
    int   n_vocab   = 0;
    int   n_embd    = 0;
    int   n_layer   = 0;
    int   n_head    = 0;
    int   n_head_kv = 0;      // < n_head: grouped-query attention
    int   n_ff      = 0;
    float norm_eps  = 1e-5f;
    float rope_base = 10000.0f;
    int   rope_mode = QL_ROPE_NORMAL;
    // the size of a head (<arch>.attention.key_length, = value_length); 0: n_embd / n_head.
    // Set, n_head * head_dim may differ from n_embd (Mistral-Nemo: 32 x 128 over 5120).
    int   n_embd_head = 0;
    int   head_dim() const { return n_embd_head > 0 ? n_embd_head : n_embd / n_head; }
};

struct ql_llama_layer {
    ql_tensor *attn_norm;     // [n_embd]
    ql_tensor *wq;            // [n_embd, n_head*d]
    ql_tensor *wk, *wv;       // [n_embd, n_head_kv*d]
    ql_tensor *bq = nullptr;  // optional biases (Qwen2): [n_head*d]
    ql_tensor *bk = nullptr, *bv = nullptr;  // [n_head_kv*d]
    ql_tensor *wo;            // [n_head*d, n_embd]
    ql_tensor *ffn_norm;      // [n_embd]
    ql_tensor *w_gate, *w_up; // [n_embd, n_ff]
    ql_tensor *w_down;        // [n_ff, n_embd]
};

// A low-rank adapter on one linear weight W [in, out]: y = W x + scale * B (A x).
// A [in, r], B [r, out] in GGUF order (PEFT's lora_A [r, in], lora_B [out, r]).
struct ql_lora_pair {
    ql_tensor *a = nullptr, *b = nullptr;
    float scale = 0.0f;  // alpha / r (or alpha / sqrt(r)), times a user scale
    // training: dropout on the adapter's input, mask from (seed[0], stream, index)
    float dropout = 0.0f;
    ql_tensor *seed = nullptr;  // I32 [1]; NULL: no dropout
    uint32_t stream = 0;
};

struct ql_llama {
    ql_llama_hparams hp;
    std::unordered_map<const ql_tensor *, ql_lora_pair> lora;  // keyed by the base weight
    bool lora_dropout = true;  // graphs built while false (evaluation) skip adapter dropout
    // adapter dropout inside A's multiply (ql_mul_mat_dropout: the mask regenerated as x is read,
    // no dropped-out copy of x per adapted linear; the same bits). false, or QLORA_DROPOUT_FUSED=0
    // in the environment: a ql_dropout_rows_to copy, then the multiply (to compare the two). The
    // trainer sets it on the CPU only (on a device with QLORA_DROPOUT_FUSED=1 or 16: slower there)
    bool lora_dropout_fused = true;
    // ... and reading x's cast to the compute type (the one q, k, v or gate, up multiply) instead
    // of f32 x: backward keeps that 16-bit cast, not f32 x (half the bytes a token), but a kept
    // element is rounded twice, round(round(x) / (1 - p)) - within a 16-bit ulp of the copies',
    // not their bits. Off by default; on with QLORA_DROPOUT_FUSED=16 too
    bool lora_dropout_x16 = false;
    // the copies (lora_dropout_fused off) of one normed input made one after another right after
    // the norm (graph order only), which a device's norm kernel then writes as it stores each
    // element (ql_cuda_norm_dropout): one launch, not one a copy re-reading the input. The gradient
    // of the input is then summed in another order (every base product's part first), so not the
    // fused form's bits. The trainer sets it on a device
    bool lora_copies_first = false;
    // mixed precision: the type of every matmul's inputs (activations cast to it, weights rounded
    // to it as they are packed, backward's dy too); f32 sums, norms, softmax, loss. Graphs built
    // after setting it use it.
    ql_type compute = QL_TYPE_F32;
    // with compute bf16, attention's products in bf16 too (ql_flash_attn_set_prec: where the
    // backend takes the request - the CPU with AVX512-BF16; the GPU backend stays f32)
    bool attn_bf16 = true;
    // with a 16-bit compute type, the FFN's gate, up and SwiGLU results and the down projection
    // (its LoRA too) in f32: a guard for fp16, whose range (65504) a SwiGLU result on an outlier
    // token can pass, giving an inf no loss scale can fix. Costs the f32 product and twice the
    // FFN's intermediates; off by default (finetune --ffn-down-f32)
    bool ffn_down_f32 = false;
    // the feed-forward in chunks of this many tokens (T x B counted together; 0: whole): its
    // T x n_ff intermediates then exist a chunk at a time, in forward and in recompute. The
    // same numbers (dropout masks included) as unchunked, but for the sums over tokens.
    int64_t ffn_chunk = 0;
    // attention's score budget (ql_flash_attn_set_score_bytes; 0: the default): the size of a
    // device's chunks of queries where it runs attention as products
    size_t attn_score_bytes = 0;
    // inference: the linears' multiplies by the base weights take their activations in 8 bits
    // (ql_mul_mat_set_prec QL_TYPE_Q8_0: integer dot products where the backend has them for the
    // weight's type, decode's few tokens). Within README's bound, not bit-exact: training never sets it
    bool q8_activations = false;
    ql_tensor *tok_embd = nullptr;  // [n_embd, n_vocab]
    ql_tensor *out_norm = nullptr;  // [n_embd]
    ql_tensor *output   = nullptr;  // [n_embd, n_vocab]; == tok_embd when tied
    ql_tensor *rope_freqs = nullptr;  // optional [n_rot/2] (Llama 3.1)
    std::vector<ql_llama_layer> layers;
};

// Checks the hyper-parameters (error text in ctx) and creates the weight tensors in ctx, in
// `wtype` for the linear weights (norms and embeddings f32). Returns QL_OK or a status.
ql_status ql_llama_create(ql_context *ctx, ql_llama *m, const ql_llama_hparams &hp, ql_type wtype, bool tied_output);

// Fills the weights: N(0, std) for matrices (a fixed-seed generator), 1 for norms.
void ql_llama_randomize(ql_llama *m, uint64_t seed, float std);

// Marks every weight trainable (full fine-tuning; used by tests and the from-scratch demo).
void ql_llama_set_params(ql_llama *m);

// y = W x (+ scale B (A x) when the model has an adapter on W): the one place adapters attach.
// x [in, ...] -> [out, ...]
ql_tensor *ql_llama_linear(ql_context *ctx, const ql_llama *m, ql_tensor *w, ql_tensor *x);

// tokens, pos: I32 [T, B]; seg: NULL or I32 [T, B] document ids (packing).
// Returns logits [n_vocab, T, B].
ql_tensor *ql_llama_forward(ql_context *ctx, const ql_llama *m, ql_tensor *tokens, ql_tensor *pos, ql_tensor *seg);

// The blocks over embedded input x [n_embd, T, B] (ql_get_rows of tok_embd, or rows gathered
// on the host), then the final norm -> h [n_embd, T, B]: what the output projection reads.
ql_tensor *ql_llama_hidden(ql_context *ctx, const ql_llama *m, ql_tensor *x, ql_tensor *pos, ql_tensor *seg);
// Blocks [l0, l1) only, over x [n_embd, T, B] (the residual stream entering block l0), then the
// final norm when l1 is n_layer: a stage of a model split over devices (ql_llama_hidden is [0, n_layer)).
ql_tensor *ql_llama_hidden_range(ql_context *ctx, const ql_llama *m, ql_tensor *x, ql_tensor *pos, ql_tensor *seg, int l0, int l1);

// The loss from h: output projection + ql_cross_entropy over its N = T*B rows (targets I32 [N],
// count f32 [1]), in chunks of `chunk` rows (<= 0: one). Chunked, a chunk's logits [n_vocab,
// chunk] exist only while its cross-entropy reads them, and backward recomputes them (one chunk
// at a time, QL_FLAG_RECOMPUTE: the graph must go through ql_graph_recompute): full logits and
// their gradient never exist at once (Llama 3's 128256 x 2048 would be 1 GiB each in f32).
// Every chunk covers the whole vocabulary, so the loss is the unchunked one (summed in another
// order) and so are the gradients.
// grad (a graph that will get a backward; the head frozen): the head and the loss fused, as
// Liger-Kernel's linear cross-entropy - each chunk's dlogits (dy = 1) are made in forward, over
// its logits, right after its loss, and dh = W^T dlogits written into its rows of one dh [n_embd,
// N] (ql_mul_mat_rows); the loss comes back through ql_with_grad, so backward's gradient of h is that dh (times
// dy): no logits recompute, no third product per chunk. One chunk (chunk <= 0) works alike.
// Evaluation graphs leave it false: they pay for no dh.
ql_tensor *ql_llama_loss(ql_context *ctx, const ql_llama *m, ql_tensor *h, ql_tensor *targets, ql_tensor *count, int64_t chunk,
                         bool grad = false);
// The chunk rows for n_rows rows: equal chunks of at most QL_LLAMA_LOSS_CHUNK_ELEMS logits each
// (n_rows itself when they fit in one)
#define QL_LLAMA_LOSS_CHUNK_ELEMS ((int64_t)1 << 23)  // 32 MiB of f32 logits per chunk
// a device's budget for the fused loss (grad): chunks of 512+ rows where the vocabulary is
// Llama 3's (the head's products then run near a GPU's peak: 64-row chunks ran at 153-164
// TFLOP/s on an H100), the trainer's first try on a device
#define QL_LLAMA_LOSS_CHUNK_ELEMS_DEVICE ((int64_t)1 << 26)  // 256 MiB of f32 logits (+ 128 of 16-bit dlogits)
int64_t ql_llama_loss_chunk(int64_t n_vocab, int64_t n_rows, int64_t elems = QL_LLAMA_LOSS_CHUNK_ELEMS);
// The same for the feed-forward (ql_llama.ffn_chunk): equal chunks of tokens of at most
// QL_LLAMA_FFN_CHUNK_ELEMS elements per [n_ff, chunk] intermediate (n_rows when one will do)
#define QL_LLAMA_FFN_CHUNK_ELEMS ((int64_t)1 << 23)  // 16 MiB in bf16, 32 in f32, per intermediate
int64_t ql_llama_ffn_chunk(int64_t n_ff, int64_t n_rows);

// One transformer block: x [n_embd, T, B] -> [n_embd, T, B] (for benchmarks and tests).
ql_tensor *ql_llama_block(ql_context *ctx, const ql_llama *m, int il, ql_tensor *x, ql_tensor *pos, ql_tensor *seg);

// bytes of weights ql_llama_create would allocate (for sizing a context)
size_t ql_llama_weight_bytes(const ql_llama_hparams &hp, ql_type wtype, bool tied_output);

// ---- a model in a GGUF file (llama, mistral, qwen2 architectures) ----

struct ql_llama_file {
    ql_gguf    *gguf = nullptr;
    ql_context *ctx  = nullptr;  // tensor headers only: the weights stay in the file mapping
    ql_llama    model;
    std::string arch;
    std::vector<float> rope_linear;  // [n_rot/2] rope_freqs times a linear scaling factor, when the file has one
};

// Reads the hyper-parameters from "{arch}.*" keys and binds every weight (any type qlora
// reads: f32, f16, bf16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, NF4) without copying. NULL on error with
// one line naming the file and what is missing or wrong (unknown architecture, a missing key or
// tensor, a tensor of the wrong shape).
ql_llama_file *ql_llama_load(const char *path, char *err, size_t err_size);
void           ql_llama_file_free(ql_llama_file *f);

// A llama.cpp LoRA adapter GGUF (general.type "adapter", adapter.type "lora", adapter.lora.alpha;
// tensors "<weight name>.lora_a" [in, r] and ".lora_b" [r, out]). Attaching binds its pairs
// into m->lora with scale = user_scale * alpha / r; the adapter (its file mapping and tensor
// headers) must outlive every graph built from m. NULL on error, one line in err: not an
// adapter, another architecture, a tensor for a weight the model lacks, mismatched shapes.
struct ql_lora_adapter {
    ql_gguf    *gguf = nullptr;
    ql_context *ctx  = nullptr;
    float       alpha = 0.0f;
    int         n_pairs = 0;
};
ql_lora_adapter *ql_llama_attach_lora(ql_llama *m, const char *arch, const char *path, float user_scale, char *err,
                                      size_t err_size);
void             ql_lora_adapter_free(ql_lora_adapter *a);

// ---- trainable LoRA ----
// Short target names, as the tools take them: q k v o gate up down ("all" = every one).
// Creates, in ctx, f32 trainable A [in, r] ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
// kaiming_uniform(a = sqrt 5)) and B [r, out] = 0 for every targeted weight of every layer, so
// step 0 is the base model; scale = alpha / r (alpha / sqrt(r) with rslora); dropout masks from
// `seed` (an I32 [1] input the trainer sets per micro-step), one stream per adapted weight.
// Errors (unknown target name, ctx too small) go to ctx.
// The one LoRA configuration: what training adds (ql_llama_add_lora) and what the adapter files
// say (adapter.h: PEFT's adapter_config.json, llama.cpp's GGUF).
struct ql_lora_config {
    int   r = 16;
    float alpha = 32.0f;
    float dropout = 0.05f;
    bool  rslora = false;                                  // scale alpha / sqrt(r) instead of alpha / r
    std::vector<std::string> targets{"q", "k", "v", "o"};  // short names (adapter.cpp maps them to PEFT's q_proj ...)
    uint64_t init_seed = 42;                               // A's draw (splitmix64: the same on every platform)
    std::string base_model;                                // PEFT's base_model_name_or_path ("": none known)
    // ql_peft_read_config only: target_modules as the file states them (PEFT's module names, a
    // regular expression or "all-linear"); the files written list the modules that hold tensors
    std::vector<std::string> target_modules;
};
bool       ql_lora_target_valid(const std::string &short_name);
ql_status  ql_llama_add_lora(ql_context *ctx, ql_llama *m, const ql_lora_config &spec, ql_tensor *seed);
// The adapters of blocks [l0, l1) only (m->lora's other entries untouched), each with the initial
// values and the dropout stream it has in the whole (ql_llama_add_lora is [0, n_layer)).
ql_status  ql_llama_add_lora_range(ql_context *ctx, ql_llama *m, const ql_lora_config &spec, ql_tensor *seed, int l0, int l1);
// the trainable tensors of m's adapters, A then B per weight, layers in order
std::vector<ql_tensor *> ql_llama_lora_params(const ql_llama &m);
// those of blocks [l0, l1) only, in the same order (ql_llama_lora_params is [0, n_layer))
std::vector<ql_tensor *> ql_llama_lora_params_range(const ql_llama &m, int l0, int l1);

// ---- generation with a KV cache ----
// One graph per number of new tokens serves every step: positions, where to write in the cache
// and how many cached keys to attend over are inputs set before each run.

struct ql_llama_cache {
    int n_ctx = 0;
    std::vector<ql_tensor *> k, v;      // per layer [head_dim, n_ctx, n_head_kv] f32 (or f16), persistent
    ql_tensor *write_pos = nullptr;     // I32 [1]: cache row of the first new token
    ql_tensor *n_kv      = nullptr;     // I32 [1]: write_pos + new tokens
};

// Inference on the CPU with 8-bit activations (m->q8_activations): the layers' linears and the
// output head of each type this build repacks (ql_cpu_repacks: Q4_0, Q4_K, Q6_K, NF4; rows a
// multiple of 8) copied in groups of 8 rows, one buffer per type (ql_backend_cache_weights), which decode's
// products read and prompts' panels are packed from; the file's pages of them are given back.
// Returns the buffers (free them before the weights' buffer); a type that could not be copied is
// read as rows, with a note naming `tool` on stderr. Nothing on other backends or without q8.
std::vector<ql_backend_buffer *> ql_llama_repack_weights(ql_backend *be, const ql_llama *m, const char *tool);

// creates the cache tensors in ctx (which must allocate: n_layer * 2 * head_dim * n_ctx * n_head_kv
// elements of `type`: F32, or F16 - half the memory and the bytes each decoded token reads; keys and
// values rounded to f16 as they are stored, widened as attention reads them)
ql_status  ql_llama_cache_create(ql_context *ctx, const ql_llama *m, int n_ctx, ql_llama_cache *cache, ql_type type = QL_TYPE_F32);
// tokens, pos: I32 [T, 1]; returns logits [n_vocab, T], or with last_only the last token's alone
// [n_vocab, 1] (a prompt that is only continued: the head, 22% of a 110M model's multiplies, runs
// for one token instead of T)
ql_tensor *ql_llama_forward_cached(ql_context *ctx, const ql_llama *m, const ql_llama_cache *cache, ql_tensor *tokens,
                                   ql_tensor *pos, bool last_only = false);
