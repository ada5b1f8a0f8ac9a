// models/llama.h - the llama family as a graph of qlora ops.
//
// Weights carry llama.cpp's GGUF tensor names (token_embd.weight, blk.N.attn_q.weight, ...) and
// layouts (ne = [in, out]; q/k rows in Meta's rope order), so a model read from GGUF and one made
// here are the same object. Every linear weight goes through ql_llama_linear: the one place an
// adapter attaches.
#pragma once

#include "../qlora.h"

#include <stdint.h>
#include <vector>

struct ql_llama_hparams {
    int   n_vocab   = 0;
    int   n_embd    = 0;
    int   n_layer   = 0;
    int   n_head    = 0;
    int   n_head_kv = 0;      // < n_head: grouped-query attention
    int   n_ff      = 0;
    float norm_eps  = 1e-5f;
    float rope_base = 10000.0f;
    int   rope_mode = QL_ROPE_NORMAL;
    int   head_dim() const { return n_embd / n_head; }
};

struct ql_llama_layer {
    ql_tensor *attn_norm;     // [n_embd]
    ql_tensor *wq;            // [n_embd, n_head*d]
    ql_tensor *wk, *wv;       // [n_embd, n_head_kv*d]
    ql_tensor *wo;            // [n_head*d, n_embd]
    ql_tensor *ffn_norm;      // [n_embd]
    ql_tensor *w_gate, *w_up; // [n_embd, n_ff]
    ql_tensor *w_down;        // [n_ff, n_embd]
};

struct ql_llama {
    ql_llama_hparams hp;
    ql_tensor *tok_embd = nullptr;  // [n_embd, n_vocab]
    ql_tensor *out_norm = nullptr;  // [n_embd]
    ql_tensor *output   = nullptr;  // [n_embd, n_vocab]; == tok_embd when tied
    ql_tensor *rope_freqs = nullptr;  // optional [head_dim/2] (Llama 3.1)
    std::vector<ql_llama_layer> layers;
};

// Checks the hyper-parameters (error text in ctx) and creates the weight tensors in ctx, in
// `wtype` for the linear weights (norms and embeddings f32). Returns QL_OK or a status.
ql_status ql_llama_create(ql_context *ctx, ql_llama *m, const ql_llama_hparams &hp, ql_type wtype, bool tied_output);

// Fills the weights: N(0, std) for matrices (a fixed-seed generator), 1 for norms.
void ql_llama_randomize(ql_llama *m, uint64_t seed, float std);

// Marks every weight trainable (full fine-tuning; used by tests and the from-scratch demo).
void ql_llama_set_params(ql_llama *m);

// y = W x: the attachment point for adapters. x [in, ...] -> [out, ...]
ql_tensor *ql_llama_linear(ql_context *ctx, ql_tensor *w, ql_tensor *x);

// tokens, pos: I32 [T, B]; seg: NULL or I32 [T, B] document ids (packing).
// Returns logits [n_vocab, T, B].
ql_tensor *ql_llama_forward(ql_context *ctx, const ql_llama *m, ql_tensor *tokens, ql_tensor *pos, ql_tensor *seg);

// One transformer block: x [n_embd, T, B] -> [n_embd, T, B] (for benchmarks and tests).
ql_tensor *ql_llama_block(ql_context *ctx, const ql_llama *m, int il, ql_tensor *x, ql_tensor *pos, ql_tensor *seg);

// bytes of weights ql_llama_create would allocate (for sizing a context)
size_t ql_llama_weight_bytes(const ql_llama_hparams &hp, ql_type wtype, bool tied_output);
