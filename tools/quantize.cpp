// tools/quantize - requantise the linear weights of a GGUF model.
//
//   ./quantize in.gguf out.gguf nf4 [--no-double-quant] [--include-output] [--include-embd]
//   ./quantize in.gguf out.gguf Q4_K_M      (llama.cpp's mixes: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S
//                                            Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL
//                                            IQ4_XS, as llama-quantize makes them)
//
// The 2-D weights of the transformer blocks (blk.N.*.weight) are converted to the target type;
// norms and other 1-D tensors stay as they are; the output and the token embedding only when
// asked. Inputs may be f32/f16/bf16 or any quantised type qlora reads (dequantised first).
// Targets: nf4 (double-quantised, QLoRA's default; --no-double-quant for fp32 absmax) and the
// types qlora can produce block by block (every ggml type it reads, as llama-quantize writes them). NF4 files declare
// themselves (qlora.* keys) and carry type ids llama.cpp does not know, so llama.cpp refuses
// them with an unknown-type error instead of misreading them.
#include "../qlora.h"
#include "cli.h"
#include "own.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s in.gguf out.gguf TYPE [--no-double-quant] [--include-output] [--include-embd]\n"
            "  TYPE: nf4 | q4_0 | q4_1 | q5_0 | q5_1 | q8_0 | q2_K | q3_K | q4_K | q5_K | q6_K | iq4_nl | iq4_xs\n"
            "        | f16 | bf16 | f32 (the block weights)\n"
            "        or one of llama.cpp's mixes: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M\n"
            "        Q5_K_S Q5_K_M Q6_K IQ4_NL IQ4_XS (every\n"
            "        2-D weight, llama-quantize's per-tensor rules and fallbacks, no importance matrix)\n",
            argv0);
    return 2;
}

static long long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

// llama.cpp's mixes (llama_ftype and its default type) this tool makes: those whose types it writes
struct preset {
    const char *name;
    int ftype;
    ql_type def;
};
static const preset k_presets[] = {
    {"Q4_0", 2, QL_TYPE_Q4_0},     {"Q4_1", 3, QL_TYPE_Q4_1},     {"Q5_0", 8, QL_TYPE_Q5_0},     {"Q5_1", 9, QL_TYPE_Q5_1},
    {"Q8_0", 7, QL_TYPE_Q8_0},     {"Q2_K", 10, QL_TYPE_Q2_K},    {"Q3_K_S", 11, QL_TYPE_Q3_K},  {"Q3_K_M", 12, QL_TYPE_Q3_K},
    {"Q3_K_L", 13, QL_TYPE_Q3_K},  {"Q4_K_S", 14, QL_TYPE_Q4_K},  {"Q4_K_M", 15, QL_TYPE_Q4_K},  {"Q5_K_S", 16, QL_TYPE_Q5_K},
    {"Q5_K_M", 17, QL_TYPE_Q5_K},  {"Q6_K", 18, QL_TYPE_Q6_K},    {"IQ4_NL", 25, QL_TYPE_IQ4_NL}, {"IQ4_XS", 30, QL_TYPE_IQ4_XS}};

// llama-quantize's choice for one tensor of a llama-family model (llama_tensor_get_type for the
// mixes above, without an importance matrix; written from its rules): the head (and a tied
// embedding) Q6_K, or Q8_0 where its rows are not whole blocks of the mix's type; attn_v,
// attn_output and ffn_down raised per mix and layer (use_more_bits: the first and last eighth,
// and every third between); a 70B's attn_v at least Q5_K; then the fallback for rows that are
// not whole blocks (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS ->
// IQ4_NL, and f16 where even that does not fit).
struct mix_state {
    int i_wv = 0, n_wv = 0, i_down = 0, n_layer = 0, n_gqa = 1;
    bool tied = true, is_70b = false;
};
static ql_type preset_type(const preset &p, const std::string &name, int64_t ne0, mix_state &s) {
    auto more_bits = [](int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; };
    auto fits = [ne0](ql_type t) { return ne0 % ql_type_traits_get(t)->blck_size == 0; };
    const std::string f = p.name;
    const bool km = f == "Q4_K_M" || f == "Q5_K_M", iq4 = f == "IQ4_NL" || f == "IQ4_XS";
    ql_type t = p.def;
    if (name == "output.weight" || (s.tied && name == "token_embd.weight")) {
        t = !fits(t) ? QL_TYPE_Q8_0 : t != QL_TYPE_Q8_0 ? QL_TYPE_Q6_K : t;
    } else if (name == "token_embd.weight") {
    } else if (name.find("attn_v.weight") != std::string::npos) {
        if (f == "Q2_K") t = s.n_gqa >= 4 ? QL_TYPE_Q4_K : QL_TYPE_Q3_K;
        else if (f == "Q3_K_M") t = s.i_wv < 2 ? QL_TYPE_Q5_K : QL_TYPE_Q4_K;
        else if (f == "Q3_K_L") t = QL_TYPE_Q5_K;
        else if (iq4 && s.n_gqa >= 4) t = QL_TYPE_Q5_K;
        else if (km && more_bits(s.i_wv, s.n_wv)) t = QL_TYPE_Q6_K;
        else if (f == "Q4_K_S" && s.i_wv < 4) t = QL_TYPE_Q5_K;
        if (s.is_70b && (t == QL_TYPE_Q3_K || t == QL_TYPE_Q4_K)) t = QL_TYPE_Q5_K;
        s.i_wv++;
    } else if (name.find("ffn_down") != std::string::npos) {
        const int i = s.i_down, n = s.n_layer;
        if (f == "Q2_K") t = QL_TYPE_Q3_K;
        else if (f == "Q3_K_M") t = i < n / 16 ? QL_TYPE_Q5_K : QL_TYPE_Q4_K;
        else if (f == "Q3_K_L") t = QL_TYPE_Q5_K;
        else if (f == "Q4_K_M") t = more_bits(i, n) ? QL_TYPE_Q6_K : t;
        else if (iq4 && i < n / 8) t = QL_TYPE_Q5_K;
        else if (f == "Q5_K_M" && more_bits(i, n)) t = QL_TYPE_Q6_K;
        else if (f == "Q4_K_S" && i < n / 8) t = QL_TYPE_Q5_K;
        s.i_down++;
    } else if (name.find("attn_output.weight") != std::string::npos) {
        if (f == "Q2_K") t = QL_TYPE_Q3_K;
        else if (f == "Q3_K_M") t = QL_TYPE_Q4_K;
        else if (f == "Q3_K_L") t = QL_TYPE_Q5_K;
    }
    if (!fits(t)) {  // llama.cpp's tensor_type_fallback
        t = t == QL_TYPE_Q2_K || t == QL_TYPE_Q3_K ? QL_TYPE_Q4_0 : t == QL_TYPE_Q4_K ? QL_TYPE_Q5_0 : t == QL_TYPE_Q5_K ? QL_TYPE_Q5_1
          : t == QL_TYPE_Q6_K ? QL_TYPE_Q8_0 : t == QL_TYPE_IQ4_XS ? QL_TYPE_IQ4_NL : t;
        if (!fits(t)) t = QL_TYPE_F16;
    }
    return t;
}

// llama-quantize's tensor order: by layer (tensors outside the blocks first), then by name
static bool weight_order(const std::string &a, const std::string &b) {
    int la = -1, lb = -1;
    sscanf(a.c_str(), "blk.%d.", &la);
    sscanf(b.c_str(), "blk.%d.", &lb);
    return la != lb ? la < lb : a < b;
}

// which tensors get the target type
static bool wants_quant(const std::string &name, int n_dims, bool with_output, bool with_embd) {
    if (n_dims != 2) return false;  // norms, biases, rope factors stay as they are
    if (name == "output.weight") return with_output;
    if (name == "token_embd.weight") return with_embd;
    return name.rfind("blk.", 0) == 0 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
}

int main(int argc, char **argv) {
    std::vector<const char *> pos;
    bool dq = true, with_output = false, with_embd = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-double-quant")) dq = false;
        else if (!strcmp(argv[i], "--include-output")) with_output = true;
        else if (!strcmp(argv[i], "--include-embd")) with_embd = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(argv[0]);
            return 0;
        }
        else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "quantize: unknown flag '%s'\n", argv[i]);
            return usage(argv[0]);
        } else pos.push_back(argv[i]);
    }
    if (pos.size() != 3) return usage(argv[0]);
    const char *in_path = pos[0], *out_path = pos[1], *type_name = pos[2];
    ql_type target = QL_TYPE_COUNT;
    const preset *mix = nullptr;
    for (const preset &p : k_presets)
        if (!strcmp(type_name, p.name)) mix = &p;
    if (mix && (!dq || with_output || with_embd)) {
        fprintf(stderr, "quantize: %s is one of llama.cpp's mixes: it decides every tensor itself (no --no-double-quant, "
                        "--include-output, --include-embd)\n", type_name);
        return 2;
    }
    if (mix) target = mix->def;
    else if (!strcmp(type_name, "nf4")) target = dq ? QL_TYPE_NF4 : QL_TYPE_NF4_NODQ;
    else
        for (int t = 0; t < QL_TYPE_COUNT; t++) {
            const ql_type_traits *tt = ql_type_traits_get((ql_type)t);
            if (tt && tt->from_float && tt->is_float && !strcmp(tt->name, type_name)) target = (ql_type)t;
        }
    if (target == QL_TYPE_COUNT) {
        std::string known = "nf4";
        for (int t = 0; t < QL_TYPE_COUNT; t++) {
            const ql_type_traits *tt = ql_type_traits_get((ql_type)t);
            if (tt && tt->from_float && tt->is_float) known += std::string(", ") + tt->name;
        }
        fprintf(stderr, "quantize: unknown target type '%s' (%s)\n", type_name, known.c_str());
        return 2;
    }
    if (!dq && target != QL_TYPE_NF4_NODQ) {
        fprintf(stderr, "quantize: --no-double-quant applies to nf4 only\n");
        return 2;
    }
    if (const int rc = output_path_check("quantize", out_path, {in_path})) return rc;  // before minutes of quantizing, not after

    char err[512];
    ql_gguf *in = ql_gguf_open(in_path, err, sizeof(err));
    if (!in) {
        fprintf(stderr, "quantize: %s\n", err);
        return 1;
    }
    owned<ql_gguf> in_(in, ql_gguf_close);
    {  // a LoRA adapter has nothing to quantize (its lora_a / lora_b stay f32): say so, write nothing
        size_t len = 0;
        const int64_t it = ql_gguf_find_kv(in, "general.type");
        const char *type = it >= 0 ? ql_gguf_get_str(in, it, &len) : nullptr;
        if (type && !strcmp(type, "adapter")) {
            fprintf(stderr, "quantize: %s: a LoRA adapter, not a model: nothing to quantize (quantize the base model)\n", in_path);
            return 1;
        }
        if (type && !strcmp(type, "qlora-checkpoint")) {
            fprintf(stderr, "quantize: %s: a finetune checkpoint, not a model: nothing to quantize (finetune --merge writes "
                    "the merged model)\n", in_path);
            return 1;
        }
    }
    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    for (int64_t i = 0; i < ql_gguf_n_kv(in); i++) ql_gguf_copy_kv(w, in, i);
    // the tensors in the order written, and a mix's counters (llama-quantize's)
    std::vector<int64_t> order((size_t)ql_gguf_n_tensors(in));
    for (size_t i = 0; i < order.size(); i++) order[i] = (int64_t)i;
    mix_state ms;
    if (mix) {
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return weight_order(ql_gguf_tensor_name(in, a), ql_gguf_tensor_name(in, b)); });
        for (int64_t i : order) {
            const std::string nm = ql_gguf_tensor_name(in, i);
            ms.n_wv += nm.find("attn_v.weight") != std::string::npos;
            ms.tied = ms.tied && nm != "output.weight";
        }
        size_t len = 0;
        const int64_t ia = ql_gguf_find_kv(in, "general.architecture");
        const char *arch = ia >= 0 ? ql_gguf_get_str(in, ia, &len) : nullptr;
        const int64_t ib = arch ? ql_gguf_find_kv(in, (std::string(arch) + ".block_count").c_str()) : -1;
        uint64_t nl = 0;
        if (ib < 0 || !ql_gguf_get_u64(in, ib, &nl)) {
            fprintf(stderr, "quantize: %s: no {arch}.block_count: %s needs the model's layer count\n", in_path, type_name);
            return 1;
        }
        ms.n_layer = (int)nl;
        uint64_t nh = 0, nkv = 0;  // n_gqa = heads per kv head; llama.cpp's 70B: 80 layers, GQA (or qwen2)
        const int64_t ih = ql_gguf_find_kv(in, (std::string(arch) + ".attention.head_count").c_str());
        const int64_t ik = ql_gguf_find_kv(in, (std::string(arch) + ".attention.head_count_kv").c_str());
        if (ih >= 0 && ql_gguf_get_u64(in, ih, &nh) && nh > 0) {
            if (ik < 0 || !ql_gguf_get_u64(in, ik, &nkv) || nkv == 0) nkv = nh;
            ms.n_gqa = (int)(nh / nkv);
        }
        ms.is_70b = nl == 80 && (nh != nkv || !strcmp(arch, "qwen2"));
        // as llama-quantize: the input's keys, then the quantisation version and the mix, last
        ql_gguf_remove_kv(w, "general.quantization_version");
        ql_gguf_remove_kv(w, "general.file_type");
        ql_gguf_set_u32(w, "general.quantization_version", 2);
        ql_gguf_set_u32(w, "general.file_type", (uint32_t)mix->ftype);
    }
    // llama.cpp's llama_ftype for a model mostly of one type (its enum has no value for NF4)
    if (!mix) ql_gguf_remove_kv(w, "general.file_type");
    const int ftype = target == QL_TYPE_F32 ? 0 : target == QL_TYPE_F16 ? 1 : target == QL_TYPE_Q4_0 ? 2 : target == QL_TYPE_Q4_1 ? 3
                    : target == QL_TYPE_Q8_0 ? 7 : target == QL_TYPE_Q5_0 ? 8 : target == QL_TYPE_Q5_1 ? 9 : target == QL_TYPE_Q6_K ? 18
                    : target == QL_TYPE_BF16 ? 32 : target == QL_TYPE_IQ4_NL ? 25 : target == QL_TYPE_IQ4_XS ? 30
                    : -1;  // (q2_K..q5_K alone are none of llama.cpp's K_S/K_M mixes)
    if (!mix && ftype >= 0) ql_gguf_set_u32(w, "general.file_type", (uint32_t)ftype);
    if (!mix) ql_gguf_set_u32(w, "general.quantization_version", 2);
    if (!mix) ql_gguf_set_str(w, "qlora.quantize.type", ql_type_name(target));
    if (target == QL_TYPE_NF4 || target == QL_TYPE_NF4_NODQ)
        ql_gguf_set_str(w, "qlora.note",
                        "NF4 tensors (type ids 100/101) are qlora's own: llama.cpp cannot load this file; "
                        "use the unquantised GGUF there, with the adapter");

    std::vector<std::vector<uint8_t>> keep;  // converted tensor bytes, alive until the write
    std::vector<float> rows;
    double q_params = 0, q_bytes = 0, all_params = 0, all_bytes = 0;
    int n_quant = 0;
    for (int64_t i : order) {
        const char *name = ql_gguf_tensor_name(in, i);
        const ql_type type = ql_gguf_tensor_type(in, i);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(in, i, ne);
        const int64_t n_rows = ne[1] * ne[2] * ne[3], n = n_rows * ne[0];
        const void *data = ql_gguf_tensor_data(in, i);
        size_t size = ql_gguf_tensor_size(in, i);
        ql_type out_type = type;
        const std::string nm = name;
        const bool allowed = mix ? nd >= 2 && nm.size() >= 6 && nm.compare(nm.size() - 6, 6, "weight") == 0 &&
                                       nm.find("_norm.weight") == std::string::npos
                                 : wants_quant(name, nd, with_output, with_embd);
        const ql_type want = mix && allowed ? preset_type(*mix, nm, ne[0], ms) : target;
        const ql_type_traits *tt = ql_type_traits_get(want);
        if (allowed && type != want) {
            if (ne[0] % tt->blck_size != 0) {
                printf("  %-32s [%lld, %lld] %s: rows of %lld are not whole %s blocks, kept\n", name, (long long)ne[0],
                       (long long)ne[1], ql_type_name(type), (long long)ne[0], tt->name);
            } else {
                rows.resize((size_t)n);
                if (ql_dequantize(type, data, n_rows, ne[0], rows.data()) != QL_OK) {
                    fprintf(stderr, "quantize: %s: tensor %s: cannot read type %s\n", in_path, name, ql_type_name(type));
                    return 1;
                }
                keep.emplace_back(ql_type_data_size(want, n_rows, ne[0]));
                if (ql_quantize(want, rows.data(), n_rows, ne[0], keep.back().data(), err, sizeof(err)) != QL_OK) {
                    fprintf(stderr, "quantize: %s: tensor %s: %s\n", in_path, name, err);
                    return 1;
                }
                printf("  %-32s [%lld, %lld] %s -> %s\n", name, (long long)ne[0], (long long)ne[1], ql_type_name(type),
                       ql_type_name(want));
                data = keep.back().data();
                size = keep.back().size();
                out_type = want;
                q_params += (double)n;
                q_bytes += (double)size;
                n_quant++;
            }
        }
        all_params += (double)n;
        all_bytes += (double)size;
        if (ql_gguf_add_tensor(w, name, out_type, nd, ne, data, size) != QL_OK) {
            fprintf(stderr, "quantize: %s: tensor %s could not be added\n", in_path, name);
            return 1;
        }
    }
    if (ql_gguf_write(w, out_path, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "quantize: %s\n", err);
        return 1;
    }
    w_.reset();
    in_.reset();
    const long long in_size = file_size(in_path), out_size = file_size(out_path);
    printf("quantize: %d tensors to %s: %.3f bits per parameter (%.0f parameters)\n", n_quant, mix ? mix->name : ql_type_name(target),
           q_params > 0 ? 8.0 * q_bytes / q_params : 0.0, q_params);
    printf("quantize: whole model %.3f bits per parameter; file %s: %.2f MiB -> %s: %.2f MiB\n",
           all_params > 0 ? 8.0 * all_bytes / all_params : 0.0, in_path, (double)in_size / 1048576.0, out_path, (double)out_size / 1048576.0);
    return 0;
}
