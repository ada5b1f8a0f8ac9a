// models/tokenizer.h - llama.cpp-exact tokenizers from a GGUF file's tokenizer.ggml.* keys.
//
//   "llama" (SentencePiece BPE): scores, byte fallback (<0xXX> tokens), space prefix "▁"
//   "gpt2"  (byte-level BPE): merges by rank after a pre-tokenizer chosen by
//           tokenizer.ggml.pre: "gpt-2" (GPT-2's split), "default" (llama.cpp's default chain
//           of splits, also used when the key is missing), "llama3"/"llama-bpe" (Llama 3's),
//           "qwen2" (Qwen2's). The split rules are written by hand over a compact Unicode
//           category table (models/unicode-data.inc, generated dev-side from Unicode 14.0).
// Special tokens (control / user-defined) are recognised in text when parse_special is set.
#pragma once

#include "../qlora.h"

#include <stdint.h>
#include <string>
#include <vector>

enum ql_token_type {  // tokenizer.ggml.token_type values
    QL_TOKEN_UNDEFINED    = 0,
    QL_TOKEN_NORMAL       = 1,
    QL_TOKEN_UNKNOWN      = 2,
    QL_TOKEN_CONTROL      = 3,
    QL_TOKEN_USER_DEFINED = 4,
    QL_TOKEN_UNUSED       = 5,
    QL_TOKEN_BYTE         = 6,
};

struct ql_vocab;

// NULL on error, with one line in err naming what is missing or wrong.
ql_vocab   *ql_vocab_load(const ql_gguf *g, char *err, size_t err_size);
void        ql_vocab_free(ql_vocab *v);

int32_t     ql_vocab_n_tokens(const ql_vocab *v);
const char *ql_vocab_model(const ql_vocab *v);      // "llama" or "gpt2"
const char *ql_vocab_pre(const ql_vocab *v);        // the pre-tokenizer in use ("default", "llama3", "qwen2")
int32_t     ql_vocab_bos(const ql_vocab *v);        // -1 when the vocabulary has none
int32_t     ql_vocab_eos(const ql_vocab *v);
int32_t     ql_vocab_eot(const ql_vocab *v);        // end of turn (<|eot_id|>, <|im_end|>, ...), or -1
int32_t     ql_vocab_pad(const ql_vocab *v);        // or -1
bool        ql_vocab_add_bos(const ql_vocab *v);    // tokenizer.ggml.add_bos_token (default per model)
bool        ql_vocab_add_eos(const ql_vocab *v);
bool        ql_vocab_is_eog(const ql_vocab *v, int32_t id);  // eos, eot: generation stops
int         ql_vocab_token_type(const ql_vocab *v, int32_t id);
const char *ql_vocab_token_text(const ql_vocab *v, int32_t id);  // as stored in the file
int32_t     ql_vocab_find(const ql_vocab *v, const char *text);  // exact token text -> id, or -1

// text -> ids. add_special: BOS (and EOS) as the vocabulary's add_* flags say;
// parse_special: control/user-defined token texts in `text` become those tokens.
std::vector<int32_t> ql_tokenize(const ql_vocab *v, const std::string &text, bool add_special, bool parse_special);
// one token's bytes (SPM: "▁" -> " ", <0xXX> -> the byte; BPE: byte-level unmapping).
// Control tokens give "" unless render_special.
std::string ql_token_to_piece(const ql_vocab *v, int32_t id, bool render_special);
// concatenated pieces (no leading-space trimming: " Once" stays " Once")
std::string ql_detokenize(const ql_vocab *v, const std::vector<int32_t> &ids, bool render_special);

// Converters: write the tokenizer.ggml.* keys (model, pre, tokens, scores, token_type,
// merges, bos/eos/unk ids, add_bos/eos, add_space_prefix) into a GGUF writer.
// llama2.c tokenizer.bin (karpathy/llama2.c: tokenizer.py's Tokenizer.export writes it, run.c's
// build_tokenizer reads it): a "llama" vocabulary; ids 0, 1, 2 are <unk>, <s>, </s>; 3..258 the
// byte tokens <0x00>..<0xFF>.
ql_status ql_vocab_from_llama2c(const char *tokenizer_bin, ql_gguf_writer *w, char *err, size_t err_size);
// tiktoken file (base64 token bytes, rank per line; Meta's Llama 3): a "gpt2" vocabulary with
// the merges rebuilt from the ranks and Llama 3's special tokens (128000 ...) appended.
// pre: "llama3" (the only one supported).
ql_status ql_vocab_from_tiktoken(const char *path, const char *pre, ql_gguf_writer *w, char *err, size_t err_size);
