// models/trainer.h - LoRA fine-tuning of a GGUF llama: the step loop with the semantics of
// transformers' Trainer (REFERENCE.md section 6).
//
// One optimizer step = grad_accum micro-batches of micro_batch sequences. The loss of every
// micro-batch is summed over its supervised tokens and divided by the supervised tokens of the
// whole step (not by grad_accum), so accumulation equals one big batch. AdamW (decoupled weight
// decay) on fp32 master weights; gradients clipped to max_grad_norm after accumulation; the
// learning rate follows transformers' schedules: constant (no warmup, as transformers'
// "constant"), constant_with_warmup, linear, cosine, the last three with linear warmup from 0. Sequences are visited in an order shuffled per epoch from the
// seed, so the data position, the dropout masks and the schedule are all functions of the step:
// a checkpoint holds the adapter, the optimizer moments and the step, and resuming reproduces
// the uninterrupted run exactly.
#pragma once

#include "data.h"
#include "llama.h"

#include <stdint.h>
#include <string>
#include <vector>

struct ql_train_options {
    ql_lora_spec lora;
    bool  packed = false;  // sequences hold several documents: attention masked by segment
    int   micro_batch = 4;
    int   grad_accum = 1;
    float lr = 2e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
    float max_grad_norm = 1.0f;         // <= 0: no clipping
    std::string scheduler = "linear";   // constant | constant_with_warmup | linear | cosine
    double warmup_ratio = 0.0;          // warmup steps = warmup_steps if > 0, else ceil(ratio * total steps)
    int64_t warmup_steps = 0;
    int     epochs = 1;
    int64_t max_steps = -1;             // > 0: overrides epochs
    uint64_t seed = 42;                 // data order and dropout masks (the adapter's init: lora.init_seed)
    int threads = 0;                    // 0: one per core
};

struct ql_step_metrics {
    int64_t step = 0;          // optimizer steps done, this one included
    double  loss = 0;          // mean over the step's supervised tokens
    double  lr = 0;            // the rate this step used
    double  grad_norm = 0;     // before clipping
    int64_t tokens = 0;        // sequence positions processed (padding included)
    int64_t targets = 0;       // supervised tokens
    double  seconds = 0;
};

struct ql_trainer;

// Builds adapters on f's model, the training and evaluation graphs and all state, sized and
// allocated once. train/eval: sequences of the same length (ql_dataset_sequences).
ql_trainer *ql_trainer_new(ql_llama_file *f, const std::vector<ql_sequence> &train, const std::vector<ql_sequence> &eval,
                           const ql_train_options &o, std::string *err);
void        ql_trainer_free(ql_trainer *t);

int64_t     ql_trainer_total_steps(const ql_trainer *t);
int64_t     ql_trainer_steps_done(const ql_trainer *t);
int64_t     ql_trainer_steps_per_epoch(const ql_trainer *t);
int64_t     ql_trainer_warmup_steps(const ql_trainer *t);
int64_t     ql_trainer_n_trainable(const ql_trainer *t);   // adapter parameters
int64_t     ql_trainer_n_base(const ql_trainer *t);        // base model parameters (any type)
const ql_plan_stats &ql_trainer_plan(const ql_trainer *t); // the training graph's memory plan
size_t      ql_trainer_state_bytes(const ql_trainer *t);   // adapter + gradients + optimizer moments
ql_llama   &ql_trainer_model(ql_trainer *t);
// the training graph (forward + backward), e.g. for ql_graph_set_profile / ql_graph_node_seconds
ql_graph   *ql_trainer_graph(ql_trainer *t);
double      ql_trainer_lr_at(const ql_trainer *t, int64_t step);  // the schedule (step from 0)

// One optimizer step. false with *err on a run-time error (e.g. a non-finite loss).
bool ql_trainer_step(ql_trainer *t, ql_step_metrics *m, std::string *err);
// Mean loss over every supervised token of the evaluation sequences (no dropout).
bool ql_trainer_eval(ql_trainer *t, double *loss, std::string *err);

// The adapter, the optimizer moments, the step and the settings that must match on resume,
// in one GGUF written atomically. Loading checks that the run is the same run.
bool ql_trainer_save(const ql_trainer *t, const char *path, std::string *err);
bool ql_trainer_load(ql_trainer *t, const char *path, std::string *err);

// PEFT's line, exactly: "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622"
std::string ql_trainable_line(int64_t trainable, int64_t base);
