// models/adapter.h - trained adapters in the files other tools load as they are.
//
//   llama.cpp:  adapter.gguf  (general.type "adapter", adapter.type "lora", adapter.lora.alpha;
//                              "<weight>.lora_a" [in, r], "<weight>.lora_b" [r, out])
//   PEFT:       dir/adapter_config.json + dir/adapter_model.safetensors
//               (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight [r, in] ...);
//               for the llama architecture the rows of q's and k's lora_B are put back in
//               Hugging Face's order (GGUF files keep q/k rows permuted for rope, as llama.cpp's
//               convert_hf_to_gguf.py writes them: LlamaModel.permute)
//   merged:     a GGUF with W + scale B A in f16 for every adapted weight (and every tensor
//               llama.cpp could not read, e.g. NF4, widened to f16): loadable by llama.cpp
#pragma once

#include "llama.h"

#include <stdint.h>
#include <string>
#include <utility>
#include <vector>

// ---- files ----
// The bytes to path + ".tmp" (a stale one removed, the new one made with O_EXCL | O_NOFOLLOW:
// never written through a link), fsynced, renamed over path, then the folder fsynced (best
// effort): a crash leaves the old file or the new one, never half of one. Refused when path is
// a link, a device, a FIFO or a socket. False with *err naming path and the call that failed.
// Every file the adapter writers and the tools' loss plot write goes through it.
bool ql_write_file_atomic(const char *path, const void *data, size_t n, std::string *err);

// ---- safetensors ----
struct ql_st_tensor {
    std::string name;
    std::string dtype;            // "F32", "F16", "BF16"
    std::vector<int64_t> shape;   // PyTorch order (outermost first)
    const void *data = nullptr;   // little-endian, size = product(shape) * dtype size
};
// The elements of a shape (PyTorch order, any rank): false for a negative dimension or when the
// product of the dimensions that are not 0 overflows int64 - a 0 does not hide an overflow
// ([2^40, 2^40, 0] is refused as [0, 2^40, 2^40] is, the GGUF reader's rule). Readers and
// converters multiply shapes here, nowhere else.
bool ql_st_shape_count(const std::vector<int64_t> &shape, int64_t *n);
// a safetensors dtype's element size: F32 4, F16 and BF16 2, U8 1 (what the reader admits); 0 else
size_t ql_st_dtype_size(const std::string &dtype);
// atomic (temp file, fsync, rename); metadata goes to the "__metadata__" entry
bool ql_safetensors_write(const char *path, const std::vector<ql_st_tensor> &tensors,
                          const std::vector<std::pair<std::string, std::string>> &metadata, std::string *err);
// Reads a whole file and checks it as the reference implementation does (header within the
// file and starting with '{', well-formed UTF-8 JSON, no duplicate names, offsets in bounds,
// covering the data without gaps or overlaps, sizes = product(shape) * dtype size); dtypes other
// than F32/F16/BF16/U8 (U8: bitsandbytes' packed weights) are refused by name. Tensors' data
// point into *storage (no alignment promised: memcpy out of it); metadata (optional) receives
// the "__metadata__" pairs.
bool ql_safetensors_read(const char *path, std::vector<ql_st_tensor> *tensors, std::vector<uint8_t> *storage,
                         std::string *err, std::vector<std::pair<std::string, std::string>> *metadata = nullptr);

// ---- LoRA configuration (ql_lora_config, llama.h) as adapter_config.json says it ----
float ql_lora_scale(const ql_lora_config &c);  // alpha / r, or alpha / sqrt(r)
// dir/adapter_config.json as PEFT wrote it (PEFT's defaults for absent keys: r 8, lora_alpha 8,
// lora_dropout 0); refuses other peft_types, DoRA and per-module rank/alpha patterns. Fills
// target_modules (targets keeps its default: training's request, not the file's).
bool ql_peft_read_config(const char *dir, ql_lora_config *c, std::string *err);

// The weights of m that carry an adapter (m.lora), written out. `arch` is the model file's
// general.architecture (the PEFT q/k row order depends on it: "llama" and "mistral", which run
// with normal rope, get their lora_B rows of q/k un-permuted; "qwen2" is written as it is).
// Every adapter must have rank c.r and scale ql_lora_scale(c) (else an error naming it), as
// the files carry one r and one alpha. The GGUF stores adapter.lora.alpha = alpha, or
// alpha * sqrt(r) with rslora, so that llama.cpp's alpha / r gives the same scale (alpha 0 is
// refused: llama.cpp reads it as "no scaling"). PEFT's adapter_config.json lists as
// target_modules the modules that carry tensors (lm_head when the output is adapted).
bool ql_lora_save_gguf(const char *path, const ql_llama &m, const char *arch, const ql_lora_config &c, std::string *err);
bool ql_peft_save(const char *dir, const ql_llama &m, const char *arch, const ql_lora_config &c, std::string *err);

// A PEFT folder as an adapter on m (rows converted to GGUF order; tensors copied into the
// returned adapter, which must outlive every graph built from m). NULL with *err on failure.
ql_lora_adapter *ql_peft_attach(ql_llama *m, const char *arch, const char *dir, float user_scale, std::string *err);
// A file or a folder: a llama.cpp adapter GGUF or a PEFT directory.
ql_lora_adapter *ql_lora_attach_any(ql_llama *m, const char *arch, const char *path, float user_scale, std::string *err);

// The base model file with every adapter of m merged in, as f16 where merged or unreadable
// by llama.cpp (qlora's NF4), other tensors copied as they are.
bool ql_llama_save_merged(const char *path, const ql_llama_file &base, const ql_llama &m, std::string *err);
