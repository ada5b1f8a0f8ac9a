// tools/quantize - requantise a GGUF model, with llama-quantize's type names and meanings.
//
//   ./quantize in.gguf out.gguf Q4_K_M [--allow-requantize]
//   ./quantize in.gguf out.gguf nf4 [--no-double-quant] [--include-output] [--include-embd] [--allow-requantize]
//
// TYPE is read as llama-quantize reads it: any case, a name or llama.cpp's ftype number, and each
// name has llama-quantize's one meaning (its mix, made without an importance matrix): Q4_0 Q4_1
// Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL IQ4_XS F16 BF16
// F32, and the aliases Q3_K Q4_K Q5_K (= Q3_K_M Q4_K_M Q5_K_M). Every weight matrix (2-D, not a
// norm) gets the type llama-quantize gives it - per-tensor rules, fallbacks for rows that are not
// whole blocks, tensor order and keys - so whole files are byte-identical to its output (llama.cpp
// b8266 and later: its fallbacks changed there, see preset_type).
// nf4, which llama.cpp does not have, is QLoRA's: the 2-D weights of the transformer blocks
// (blk.N.*.weight) only, the output and the token embedding when asked (--no-double-quant: fp32
// absmax). NF4 files declare themselves (qlora.* keys; general.file_type 100 or 101, the NF4 type
// ids, outside llama.cpp's numbering) and carry type ids llama.cpp does not know, so llama.cpp
// refuses them with an unknown-type error instead of misreading them.
// Inputs may be f32/f16/bf16, or (with --allow-requantize, as llama-quantize) any quantised type
// qlora reads, dequantised first. A run that would convert no tensor writes nothing and exits 1.
#include "../qlora.h"
#include "cli.h"
#include "own.h"

#include <strings.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

// llama.cpp's ftypes this tool makes: the name, llama_ftype's number, the mix's default type
struct preset {
    const char *name;
    int ftype;
    ql_type def;
};
static const preset k_presets[] = {
    {"Q4_0", 2, QL_TYPE_Q4_0},     {"Q4_1", 3, QL_TYPE_Q4_1},     {"Q5_0", 8, QL_TYPE_Q5_0},     {"Q5_1", 9, QL_TYPE_Q5_1},
    {"Q8_0", 7, QL_TYPE_Q8_0},     {"Q2_K", 10, QL_TYPE_Q2_K},    {"Q3_K_S", 11, QL_TYPE_Q3_K},  {"Q3_K_M", 12, QL_TYPE_Q3_K},
    {"Q3_K_L", 13, QL_TYPE_Q3_K},  {"Q4_K_S", 14, QL_TYPE_Q4_K},  {"Q4_K_M", 15, QL_TYPE_Q4_K},  {"Q5_K_S", 16, QL_TYPE_Q5_K},
    {"Q5_K_M", 17, QL_TYPE_Q5_K},  {"Q6_K", 18, QL_TYPE_Q6_K},    {"IQ4_NL", 25, QL_TYPE_IQ4_NL}, {"IQ4_XS", 30, QL_TYPE_IQ4_XS},
    {"F16", 1, QL_TYPE_F16},       {"BF16", 32, QL_TYPE_BF16},    {"F32", 0, QL_TYPE_F32}};
// llama-quantize's other names for some of them
static const char *const k_aliases[][2] = {{"Q3_K", "Q3_K_M"}, {"Q4_K", "Q4_K_M"}, {"Q5_K", "Q5_K_M"}};
// general.file_type of an NF4 file: the type ids (llama.cpp's llama_ftype stops below 40)
static const int k_ftype_nf4 = QL_TYPE_NF4, k_ftype_nf4_nodq = QL_TYPE_NF4_NODQ;

// llama-quantize's names (and ftype numbers) this tool does not make, and why
#define QZ_IMATRIX "needs an importance matrix (llama-quantize --imatrix FILE), which this quantize does not take"
#define QZ_IQ3 "is made of llama.cpp's iq3 types, which qlora neither writes nor reads (llama-quantize makes it, best with --imatrix)"
#define QZ_TQ "is llama.cpp's ternary type for models trained ternary (BitNet b1.58); qlora neither writes nor reads it"
struct refusal {
    const char *name;
    int ftype;  // -1: none of its own
    const char *why;
};
static const refusal k_refused[] = {
    {"Q2_K_S", 21, QZ_IMATRIX},  {"IQ1_S", 24, QZ_IMATRIX},   {"IQ1_M", 31, QZ_IMATRIX}, {"IQ2_XXS", 19, QZ_IMATRIX},
    {"IQ2_XS", 20, QZ_IMATRIX},  {"IQ2_S", 28, QZ_IMATRIX},   {"IQ2_M", 29, QZ_IMATRIX}, {"IQ3_XXS", 23, QZ_IQ3},
    {"IQ3_XS", 22, QZ_IQ3},      {"IQ3_S", 26, QZ_IQ3},       {"IQ3_M", 27, QZ_IQ3},     {"TQ1_0", 36, QZ_TQ},
    {"TQ2_0", 37, QZ_TQ},
    {"MXFP4_MOE", 38, "is for mixture-of-experts models (mxfp4 experts); qlora neither writes nor reads mxfp4"},
    {"COPY", -1, "(llama-quantize's copy without conversion) is not made here: cp copies a file"}};

// Levenshtein distance, any case (a near miss: "q4_k_n", "Q4KM", "nf5")
static size_t edit_distance(const std::string &a, const std::string &b) {
    std::vector<size_t> d(b.size() + 1);
    for (size_t j = 0; j <= b.size(); j++) d[j] = j;
    for (size_t i = 1; i <= a.size(); i++) {
        size_t diag = d[0];  // d[i-1][j-1]
        d[0] = i;
        for (size_t j = 1; j <= b.size(); j++) {
            const size_t up = d[j];
            const bool same = tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]);
            d[j] = std::min({d[j] + 1, d[j - 1] + 1, diag + (same ? 0 : 1)});
            diag = up;
        }
    }
    return d[b.size()];
}

// every name TYPE may be, those this tool makes first
static std::vector<std::string> known_names() {
    std::vector<std::string> v;
    for (const preset &p : k_presets) v.push_back(p.name);
    for (const auto &a : k_aliases) v.push_back(a[0]);
    v.push_back("NF4");
    for (const refusal &r : k_refused) v.push_back(r.name);
    return v;
}

// what TYPE names: a mix (*mix), NF4 (*nf4), a refused name (*no); false when nothing
static bool type_lookup(const char *arg, const preset **mix, bool *nf4, const refusal **no) {
    *mix = nullptr, *nf4 = false, *no = nullptr;
    std::string s = arg;
    for (const auto &a : k_aliases)
        if (!strcasecmp(arg, a[0])) s = a[1];
    const bool number = !s.empty() && s.size() <= 4 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    const int n = number ? atoi(s.c_str()) : -2;
    for (const preset &p : k_presets)
        if (!*mix && (!strcasecmp(s.c_str(), p.name) || p.ftype == n)) *mix = &p;
    for (const refusal &r : k_refused)
        if (!*mix && !*no && (!strcasecmp(s.c_str(), r.name) || r.ftype == n)) *no = &r;
    *nf4 = !strcasecmp(s.c_str(), "nf4");
    return *mix || *nf4 || *no;
}

static int usage(const char *argv0) {
    std::string mixes, aliases;
    for (const preset &p : k_presets) mixes += std::string(" ") + p.name;
    for (const auto &a : k_aliases) aliases += std::string(" ") + a[0] + " (" + a[1] + ")";
    fprintf(stderr,
            "usage: %s in.gguf out.gguf TYPE [--allow-requantize]\n"
            "       %s in.gguf out.gguf nf4 [--no-double-quant] [--include-output] [--include-embd] [--allow-requantize]\n"
            "  TYPE, any case, or llama.cpp's ftype number (15 = Q4_K_M):%s\n"
            "       and%s: llama-quantize's mix of that name without an importance matrix (every weight\n"
            "       matrix: its per-tensor types and fallbacks, byte-identical files)\n"
            "  nf4: QLoRA's NF4 for the block weights (--no-double-quant: fp32 absmax; --include-output,\n"
            "       --include-embd: those too); a type of qlora's own, which llama.cpp cannot load\n"
            "  --allow-requantize: convert tensors that are already quantised (worse than from f16/f32)\n",
            argv0, argv0, mixes.c_str(), aliases.c_str());
    return 2;
}

static long long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

// llama-quantize's choice for one tensor of a llama-family model (llama_tensor_get_type for the
// mixes above, without an importance matrix; written from its rules): the head (and a tied
// embedding) Q6_K, or Q8_0 where its rows are not whole blocks of the mix's type; attn_v,
// attn_output and ffn_down raised per mix and layer (use_more_bits: the first and last eighth,
// and every third between); a 70B's attn_v at least Q5_K; then the fallback for rows that are
// not whole blocks (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS ->
// IQ4_NL, and f16 where even that does not fit; *chosen: the type before any fallback). These are
// llama.cpp's fallbacks from b8266 (ggml-org/llama.cpp#19770, March 2026) on; builds before it
// gave Q2_K/Q3_K's rows IQ4_NL.
// F16, BF16 and F32 have no rules: every weight matrix is of that type.
struct mix_state {
    int i_wv = 0, n_wv = 0, i_down = 0, n_layer = 0, n_gqa = 1;
    bool tied = true, is_70b = false;
};
static ql_type preset_type(const preset &p, const std::string &name, int64_t ne0, mix_state &s, ql_type *chosen) {
    *chosen = p.def;
    if (ql_type_traits_get(p.def)->blck_size == 1) return p.def;
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
    *chosen = t;
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

// which tensors nf4 converts
static bool wants_nf4(const std::string &name, int n_dims, bool with_output, bool with_embd) {
    if (n_dims != 2) return false;  // norms, biases, rope factors stay as they are
    if (name == "output.weight") return with_output;
    if (name == "token_embd.weight") return with_embd;
    return name.rfind("blk.", 0) == 0 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
}

static bool is_quantized(ql_type t) { return t != QL_TYPE_F32 && t != QL_TYPE_F16 && t != QL_TYPE_BF16; }

// "a, b and c" (or "a or b")
static std::string list_of(const std::vector<std::string> &v, const char *last = " and ") {
    std::string r;
    for (size_t k = 0; k < v.size(); k++) r += (k == 0 ? "" : k + 1 == v.size() ? last : ", ") + v[k];
    return r;
}
static std::string list_of(const std::set<std::string> &s) { return list_of(std::vector<std::string>(s.begin(), s.end())); }
static std::string list_of(const std::set<int64_t> &s) {
    std::vector<std::string> v;
    for (int64_t x : s) v.push_back(std::to_string(x));
    return list_of(v);
}

// the known names nearest to a mistyped one (at most 3): by the distance without underscores
// ("Q4KM" is Q4_K_M), then with them ("q4_k_n": Q4_K_S or Q4_K_M); none when even the nearest
// differs in more than 2 characters or in half of its own
static std::vector<std::string> near_misses(const std::string &arg) {
    auto bare = [](std::string x) {
        x.erase(std::remove(x.begin(), x.end(), '_'), x.end());
        return x;
    };
    std::vector<std::string> best;
    size_t best_bare = SIZE_MAX, best_full = SIZE_MAX;
    for (const std::string &k : known_names()) {
        const size_t db = edit_distance(bare(arg), bare(k)), df = edit_distance(arg, k);
        if (db > 2 || 2 * db > bare(k).size()) continue;
        if (db < best_bare || (db == best_bare && df < best_full)) best.clear(), best_bare = db, best_full = df;
        if (db == best_bare && df == best_full && best.size() < 3) best.push_back(k);
    }
    return best;
}

// what the command line asks for, and the target it names
struct qrun {
    bool dq = true, with_output = false, with_embd = false, allow_requant = false;
    const char *in_path = nullptr, *out_path = nullptr, *type_name = nullptr;
    const preset *mix = nullptr;  // a llama-quantize mix, or NULL for nf4
    bool nf4 = false;
    ql_type target = QL_TYPE_COUNT;  // the mix's default type, or NF4 / NF4_NODQ
    const char *target_name = nullptr;
    bool q_mix = false;  // a quantised mix: per-tensor rules
};

// The flags and positionals into r, TYPE looked up and checked against the flags: -1 to go on,
// else the exit code (0 for --help) after the usage or the message.
static int parse_args(int argc, char **argv, qrun *r) {
    std::vector<const char *> pos;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-double-quant")) r->dq = false;
        else if (!strcmp(argv[i], "--include-output")) r->with_output = true;
        else if (!strcmp(argv[i], "--include-embd")) r->with_embd = true;
        else if (!strcmp(argv[i], "--allow-requantize")) r->allow_requant = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(argv[0]);
            return 0;
        } else if (!strcmp(argv[i], "--imatrix")) {
            fprintf(stderr, "quantize: --imatrix: this quantize takes no importance matrix (llama-quantize does)\n");
            return 2;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "quantize: unknown flag '%s'\n", argv[i]);
            return usage(argv[0]);
        } else pos.push_back(argv[i]);
    }
    if (pos.size() != 3) return usage(argv[0]);
    r->in_path = pos[0], r->out_path = pos[1], r->type_name = pos[2];
    const char *type_name = r->type_name;
    const refusal *no = nullptr;
    if (!type_lookup(type_name, &r->mix, &r->nf4, &no)) {
        std::string names;
        for (const preset &p : k_presets) names += std::string(p.name) + " ";
        for (const auto &a : k_aliases) names += std::string(a[0]) + " ";
        const std::vector<std::string> near = near_misses(type_name);
        fprintf(stderr, "quantize: unknown target type '%s'%s%s%s (llama-quantize's %sor NF4; any case)\n", type_name,
                near.empty() ? "" : ": did you mean ", list_of(near, " or ").c_str(), near.empty() ? "" : "?", names.c_str());
        return 2;
    }
    if (no) {
        const bool number = strcasecmp(type_name, no->name) != 0;
        fprintf(stderr, "quantize: %s%s%s%s %s\n", no->name, number ? " (ftype " : "", number ? type_name : "", number ? ")" : "",
                no->why);
        return 2;
    }
    if (!r->dq && !r->nf4) {
        fprintf(stderr, "quantize: --no-double-quant applies to nf4 only\n");
        return 2;
    }
    if (r->mix && (r->with_output || r->with_embd)) {
        fprintf(stderr, "quantize: %s is llama-quantize's %s: it decides every tensor itself (--include-output and "
                        "--include-embd are nf4's)\n", type_name, r->mix->name);
        return 2;
    }
    r->target = r->mix ? r->mix->def : r->dq ? QL_TYPE_NF4 : QL_TYPE_NF4_NODQ;
    r->target_name = r->mix ? r->mix->name : ql_type_name(r->target);
    r->q_mix = r->mix && ql_type_traits_get(r->target)->blck_size > 1;
    return -1;
}

// a LoRA adapter or a finetune checkpoint has nothing to quantize (an adapter's lora_a / lora_b
// stay f32): say so and write nothing. 0, or 1 after the message.
static int refuse_non_model(ql_gguf *in, const char *in_path) {
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
    return 0;
}

// A quantised mix's counters (llama-quantize's): attn_v count, a tied head, the layer count,
// the heads per kv head, a 70B. 0, or 1 after the message.
static int count_mix(ql_gguf *in, const qrun &r, const std::vector<int64_t> &order, mix_state *ms) {
    for (int64_t i : order) {
        const std::string nm = ql_gguf_tensor_name(in, i);
        ms->n_wv += nm.find("attn_v.weight") != std::string::npos;
        ms->tied = ms->tied && nm != "output.weight";
    }
    size_t len = 0;
    const int64_t ia = ql_gguf_find_kv(in, "general.architecture");
    const char *arch = ia >= 0 ? ql_gguf_get_str(in, ia, &len) : nullptr;
    const int64_t ib = arch ? ql_gguf_find_kv(in, (std::string(arch) + ".block_count").c_str()) : -1;
    uint64_t nl = 0;
    if (ib < 0 || !ql_gguf_get_u64(in, ib, &nl)) {
        fprintf(stderr, "quantize: %s: no {arch}.block_count: %s needs the model's layer count\n", r.in_path, r.target_name);
        return 1;
    }
    ms->n_layer = (int)nl;
    uint64_t nh = 0, nkv = 0;  // n_gqa = heads per kv head; llama.cpp's 70B: 80 layers, GQA (or qwen2)
    const int64_t ih = ql_gguf_find_kv(in, (std::string(arch) + ".attention.head_count").c_str());
    const int64_t ik = ql_gguf_find_kv(in, (std::string(arch) + ".attention.head_count_kv").c_str());
    if (ih >= 0 && ql_gguf_get_u64(in, ih, &nh) && nh > 0) {
        if (ik < 0 || !ql_gguf_get_u64(in, ik, &nkv) || nkv == 0) nkv = nh;
        ms->n_gqa = (int)(nh / nkv);
    }
    ms->is_70b = nl == 80 && (nh != nkv || !strcmp(arch, "qwen2"));
    return 0;
}

// the plan, before any work: each tensor's new type (QL_TYPE_COUNT: kept as it is), and what it counted
struct qplan {
    std::vector<ql_type> want;
    std::vector<bool> unfit;  // a matrix nf4 leaves: its rows are not whole blocks
    int n_weights = 0, n_convert = 0, n_target = 0, n_unfit = 0, n_requant = 0, n_fallback = 0;
    int64_t first_requant = -1;
    std::map<std::pair<std::string, std::string>, int> fallbacks;  // (the mix's type, the one that fits) -> tensors
    std::set<int64_t> unfit_rows, fallback_rows;
    std::set<std::string> chosen_types;
};

// each weight matrix's new type (the mix's rule with its fallback, or nf4), counted; kept where
// it is of that type already, or where its rows are not whole blocks of it
static void make_plan(ql_gguf *in, const qrun &r, const std::vector<int64_t> &order, mix_state &ms, qplan *p) {
    p->want.assign((size_t)ql_gguf_n_tensors(in), QL_TYPE_COUNT);
    p->unfit.assign(p->want.size(), false);
    for (int64_t i : order) {
        const std::string nm = ql_gguf_tensor_name(in, i);
        const ql_type type = ql_gguf_tensor_type(in, i);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(in, i, ne);
        const bool allowed = r.mix ? nd >= 2 && nm.size() >= 6 && nm.compare(nm.size() - 6, 6, "weight") == 0 &&
                                         nm.find("_norm.weight") == std::string::npos
                                   : wants_nf4(nm, nd, r.with_output, r.with_embd);
        if (!allowed) continue;
        p->n_weights++;
        ql_type chosen = r.target;
        const ql_type w = r.mix ? preset_type(*r.mix, nm, ne[0], ms, &chosen) : r.target;
        if (w != chosen) {
            p->n_fallback++;
            p->fallback_rows.insert(ne[0]);
            p->chosen_types.insert(ql_type_name(chosen));
            p->fallbacks[{ql_type_name(chosen), ql_type_name(w)}]++;
        }
        if (type == w) continue;
        if (ne[0] % ql_type_traits_get(w)->blck_size != 0) {
            p->unfit[(size_t)i] = true;
            p->unfit_rows.insert(ne[0]);
            p->n_unfit++;
            continue;
        }
        p->want[(size_t)i] = w;
        p->n_convert++;
        p->n_target += !r.q_mix || is_quantized(w);
        if (is_quantized(type) && p->n_requant++ == 0) p->first_requant = i;
    }
}

// A plan that quantises nothing, or requantises without --allow-requantize, is refused:
// 0, or the exit code after the message.
static int check_plan(ql_gguf *in, const qrun &r, const qplan &p) {
    const char *in_path = r.in_path, *target_name = r.target_name;
    if (p.n_target == 0) {  // a file that is its input under another name, or no quantised tensor in it, is no success
        if (p.n_weights == 0)
            fprintf(stderr, "quantize: %s: no weight matrix to convert to %s: nothing written\n", in_path, target_name);
        else if (p.n_unfit > 0)
            fprintf(stderr, "quantize: %s: no tensor converted to %s: the rows of its %d weight matrices (%s wide) are not "
                    "whole %lld-element blocks: nothing written\n", in_path, target_name, p.n_unfit, list_of(p.unfit_rows).c_str(),
                    (long long)ql_type_traits_get(r.target)->blck_size);
        else if (p.n_convert > 0)
            fprintf(stderr, "quantize: %s: no tensor would be quantised: the rows of its weight matrices (%s wide) are not "
                    "whole blocks of %s's types (%s) nor of their fallbacks, and f16 is not %s: nothing written\n", in_path,
                    list_of(p.fallback_rows).c_str(), target_name, list_of(p.chosen_types).c_str(), target_name);
        else
            fprintf(stderr, "quantize: %s: nothing to convert: its %d weight matrices are of %s's types already: nothing "
                    "written\n", in_path, p.n_weights, target_name);
        return 1;
    }
    if (p.n_requant > 0 && !r.allow_requant) {
        fprintf(stderr, "quantize: %s: %d of the tensors to convert are quantised already (%s is %s): quantising again "
                "loses more than quantising the f16/f32 model; --allow-requantize does it anyway\n", in_path, p.n_requant,
                ql_gguf_tensor_name(in, p.first_requant), ql_type_name(ql_gguf_tensor_type(in, p.first_requant)));
        return 2;
    }
    return 0;
}

// parameters and bytes: of the converted tensors (q_) and of the whole file (all_)
struct qsizes {
    double q_params = 0, q_bytes = 0, all_params = 0, all_bytes = 0;
};

// The output file: the input's keys with the quantisation's, every tensor in order, converted
// where the plan says (one line each); 0, or 1 after the message.
static int write_output(ql_gguf *in, const qrun &r, const std::vector<int64_t> &order, const qplan &p, qsizes *sz) {
    char err[512];
    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    for (int64_t i = 0; i < ql_gguf_n_kv(in); i++) ql_gguf_copy_kv(w, in, i);
    // as llama-quantize: the input's keys, then the quantisation version and llama.cpp's ftype, last
    // (NF4: its type id as the ftype, then qlora's keys)
    ql_gguf_remove_kv(w, "general.quantization_version");
    ql_gguf_remove_kv(w, "general.file_type");
    ql_gguf_set_u32(w, "general.quantization_version", 2);
    ql_gguf_set_u32(w, "general.file_type", (uint32_t)(r.mix ? r.mix->ftype : r.dq ? k_ftype_nf4 : k_ftype_nf4_nodq));
    if (r.nf4) {
        ql_gguf_set_str(w, "qlora.quantize.type", ql_type_name(r.target));
        ql_gguf_set_str(w, "qlora.note",
                        "NF4 tensors (type ids 100/101) are qlora's own: llama.cpp cannot load this file; "
                        "use the unquantised GGUF there, with the adapter");
    }

    std::vector<std::vector<uint8_t>> keep;  // converted tensor bytes, alive until the write
    std::vector<float> rows;
    for (int64_t i : order) {
        const char *name = ql_gguf_tensor_name(in, i);
        const ql_type type = ql_gguf_tensor_type(in, i), to = p.want[(size_t)i];
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(in, i, ne);
        const int64_t n_rows = ne[1] * ne[2] * ne[3], n = n_rows * ne[0];
        const void *data = ql_gguf_tensor_data(in, i);
        size_t size = ql_gguf_tensor_size(in, i);
        if (p.unfit[(size_t)i])
            printf("  %-32s [%lld, %lld] %s: rows of %lld are not whole %s blocks, kept\n", name, (long long)ne[0],
                   (long long)ne[1], ql_type_name(type), (long long)ne[0], ql_type_name(r.target));
        if (to != QL_TYPE_COUNT) {
            rows.resize((size_t)n);
            if (ql_dequantize(type, data, n_rows, ne[0], rows.data()) != QL_OK) {
                fprintf(stderr, "quantize: %s: tensor %s: cannot read type %s\n", r.in_path, name, ql_type_name(type));
                return 1;
            }
            keep.emplace_back(ql_type_data_size(to, n_rows, ne[0]));
            if (ql_quantize(to, rows.data(), n_rows, ne[0], keep.back().data(), err, sizeof(err)) != QL_OK) {
                fprintf(stderr, "quantize: %s: tensor %s: %s\n", r.in_path, name, err);
                return 1;
            }
            printf("  %-32s [%lld, %lld] %s -> %s\n", name, (long long)ne[0], (long long)ne[1], ql_type_name(type), ql_type_name(to));
            data = keep.back().data();
            size = keep.back().size();
            sz->q_params += (double)n;
            sz->q_bytes += (double)size;
        }
        sz->all_params += (double)n;
        sz->all_bytes += (double)size;
        if (ql_gguf_add_tensor(w, name, to != QL_TYPE_COUNT ? to : type, nd, ne, data, size) != QL_OK) {
            fprintf(stderr, "quantize: %s: tensor %s could not be added\n", r.in_path, name);
            return 1;
        }
    }
    if (ql_gguf_write(w, r.out_path, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "quantize: %s\n", err);
        return 1;
    }
    return 0;
}

// the summary lines, and the mix's fallbacks as a warning (llama-quantize warns of these too, or
// stops: its fallbacks are for k-quants and iq4_xs)
static void report(const qrun &r, const qplan &p, const qsizes &sz) {
    const char *in_path = r.in_path, *out_path = r.out_path;
    const long long in_size = file_size(in_path), out_size = file_size(out_path);
    printf("quantize: %d tensors to %s: %.3f bits per parameter (%.0f parameters)\n", p.n_convert, r.target_name,
           sz.q_params > 0 ? 8.0 * sz.q_bytes / sz.q_params : 0.0, sz.q_params);
    printf("quantize: whole model %.3f bits per parameter; file %s: %.2f MiB -> %s: %.2f MiB\n",
           sz.all_params > 0 ? 8.0 * sz.all_bytes / sz.all_params : 0.0, in_path, (double)in_size / 1048576.0, out_path,
           (double)out_size / 1048576.0);
    if (p.fallbacks.empty()) return;
    std::vector<std::string> each;
    std::set<std::string> stops;
    for (const auto &f : p.fallbacks) {
        each.push_back(std::to_string(f.second) + " " + f.first.first + " -> " + f.first.second);
        if (f.first.second == "f16" && f.first.first.find("_K") == std::string::npos && f.first.first != "iq4_xs")
            stops.insert(f.first.first);
    }
    fflush(stdout);
    fprintf(stderr, "quantize: warning: %d of %d weight matrices have rows (%s wide) that are not whole blocks of their "
            "type in %s, so they fell back: %s%s%s%s\n", p.n_fallback, p.n_weights, list_of(p.fallback_rows).c_str(), r.target_name,
            list_of(each).c_str(), stops.empty() ? "" : " (llama-quantize has no fallback for ", list_of(stops).c_str(),
            stops.empty() ? "" : ": it stops there)");
}

int main(int argc, char **argv) {
    qrun r;
    if (const int rc = parse_args(argc, argv, &r); rc >= 0) return rc;
    if (const int rc = output_path_check("quantize", r.out_path, {r.in_path})) return rc;  // before minutes of quantizing, not after

    char err[512];
    ql_gguf *in = ql_gguf_open(r.in_path, err, sizeof(err));
    if (!in) {
        fprintf(stderr, "quantize: %s\n", err);
        return 1;
    }
    owned<ql_gguf> in_(in, ql_gguf_close);
    if (const int rc = refuse_non_model(in, r.in_path)) return rc;
    // the tensors in the order written, and a mix's counters (llama-quantize's)
    std::vector<int64_t> order((size_t)ql_gguf_n_tensors(in));
    for (size_t i = 0; i < order.size(); i++) order[i] = (int64_t)i;
    mix_state ms;
    if (r.mix)
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return weight_order(ql_gguf_tensor_name(in, a), ql_gguf_tensor_name(in, b)); });
    if (r.q_mix)
        if (const int rc = count_mix(in, r, order, &ms)) return rc;
    qplan p;
    make_plan(in, r, order, ms, &p);
    if (const int rc = check_plan(in, r, p)) return rc;
    qsizes sz;
    if (const int rc = write_output(in, r, order, p, &sz)) return rc;
    in_.reset();
    report(r, p, sz);
    return 0;
}
