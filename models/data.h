// models/data.h - fine-tuning data: a strict JSONL reader, the dataset formats people use,
// chat templates, loss masks, truncation, packing, train/eval splits.
//
// Formats (one JSON object per line, detected per line from its keys):
//   {"text": "..."}                                  loss on every token
//   {"prompt": "...", "completion": "..."}           loss on the completion only (TRL's default)
//   {"messages": [{"role": "...", "content": "..."}, ...]}
//                                                    rendered with the model's chat template,
//                                                    loss on the assistant turns only
//   {"instruction": "...", "input": "...", "output": "..."}   Alpaca; loss on the output only
// A bad line stops loading with "file:line: reason" unless skip_bad_lines (then it is counted).
#pragma once

#include "tokenizer.h"

#include <stdint.h>
#include <string>
#include <vector>

enum ql_chat_template {
    QL_CHAT_NONE = 0,   // no template known (messages lines are then an error)
    QL_CHAT_LLAMA3,     // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
    QL_CHAT_CHATML,     // <|im_start|>role\ncontent<|im_end|>\n   (Qwen, many others)
    QL_CHAT_LLAMA2,     // [INST] ... [/INST] (Llama 2, Mistral)
    QL_CHAT_PHI3,       // <|user|>\ncontent<|end|>\n<|assistant|>\n
    QL_CHAT_GEMMA,      // <start_of_turn>user\ncontent<end_of_turn>\n<start_of_turn>model\n
    QL_CHAT_ZEPHYR,     // <|user|>\ncontent</s>\n<|assistant|>\n
    QL_CHAT_COUNT
};
const char      *ql_chat_template_name(ql_chat_template t);          // "llama3", "chatml", ...
ql_chat_template ql_chat_template_from_name(const char *name);       // QL_CHAT_COUNT if unknown
// recognises the family of a tokenizer.chat_template (Jinja text); QL_CHAT_NONE if none fits
ql_chat_template ql_chat_template_detect(const char *jinja);

struct ql_data_options {
    int  seq_len = 512;          // tokens per training sequence; longer examples are truncated
    bool pack = false;           // several examples per sequence (attention never crosses them)
    bool add_bos = true;         // BOS before each example (if the vocabulary has one)
    bool add_eos = true;         // EOS after each example (supervised where the example's end is)
    bool skip_bad_lines = false;
    ql_chat_template chat = QL_CHAT_NONE;  // for "messages" lines
};

// The loader's options for a model as finetune sets them (tokenize --data shows the same): the
// chat template named by template_name ("chatml", ...; NULL: detected from the GGUF's
// tokenizer.chat_template, QL_CHAT_NONE when it has none or none fits) and BOS before each
// example where the vocabulary has one and asks for it (as generate tokenizes prompts). The
// other fields of *o are left as they are. False, with why in *err, for an unknown name.
bool ql_data_options_for(const ql_gguf *g, const ql_vocab *v, const char *template_name, ql_data_options *o, std::string *err);

// One tokenized example: supervised[i] says whether token i is a prediction target.
struct ql_example {
    std::vector<int32_t> tokens;
    std::vector<uint8_t> supervised;
    int line = 0;            // where it came from (1-based)
    bool truncated = false;  // it was longer than seq_len and was cut to it
};

struct ql_dataset {
    std::vector<ql_example> examples;
    int64_t n_lines = 0, n_bad = 0, n_truncated = 0, n_empty = 0;  // empty: nothing supervised, skipped
    int64_t n_tokens = 0, n_supervised = 0;
    int64_t n_per_format[4] = {0, 0, 0, 0};  // text, prompt/completion, messages, alpaca
};

// Reads a JSONL file. Returns false with one line in *err ("path:line: reason") on a bad line
// (unless skip_bad_lines), an unreadable file, or messages without a usable chat template.
bool ql_dataset_load(const char *path, const ql_vocab *v, const ql_data_options &o, ql_dataset *out, std::string *err);

// Moves a deterministic fraction (by seed) of the examples into `eval` (at least one when
// fraction > 0 and there are two or more examples).
void ql_dataset_split(ql_dataset *train, double fraction, uint64_t seed, ql_dataset *eval);

// Training sequences of exactly seq_len tokens: one example each (padded), or packed
// (examples placed whole, in order, first-fit; a longer-than-seq_len example was truncated
// when loaded). Per position: the token, its position within its document (restarting at 0),
// its document id (for the attention mask; padding gets its own id), and the target: the next
// token of the same document when that token is supervised, else -1.
struct ql_sequence {
    std::vector<int32_t> tokens, pos, seg, targets;  // [seq_len], padded at the end
    int64_t n_targets = 0;
    int64_t len = 0;  // positions before the padding (a micro-batch need not be longer than its longest)
};
void ql_dataset_sequences(const ql_dataset &d, const ql_data_options &o, int32_t pad_token, std::vector<ql_sequence> *out);
