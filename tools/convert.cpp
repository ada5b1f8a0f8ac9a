// tools/convert - other formats to GGUF.
//
//   ./convert llama2c model.bin tokenizer.bin -o model.gguf
//       a llama2.c legacy checkpoint (f32, Meta's rope layout) and its tokenizer.bin
//   ./convert tiktoken tokenizer.model --pre llama3 -o vocab.gguf
//       a vocabulary-only GGUF from a tiktoken file (Meta's Llama 3), merges rebuilt from ranks
//   ./convert hf DIR -o model.gguf [--outtype f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|nf4]
//       a Hugging Face checkpoint directory (Llama, Mistral, Qwen2; safetensors, sharded or not;
//       tokenizer.json or tokenizer.model), no Python
#include "../models/adapter.h"
#include "../models/json.h"
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "cli.h"
#include "own.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <functional>
#include <tuple>
#include <unordered_set>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s llama2c model.bin tokenizer.bin -o model.gguf\n"
            "       %s tiktoken tokenizer.model --pre llama3 -o vocab.gguf\n"
            "       %s hf DIR -o model.gguf [--outtype f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|nf4]\n",
            argv0, argv0, argv0);
    return 2;
}

static bool read_file(const char *path, std::vector<uint8_t> *out, std::string *why) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        *why = std::string(path) + ": cannot open: " + strerror(errno);
        return false;
    }
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    out->resize(n > 0 ? (size_t)n : 0);
    const bool ok = n >= 0 && fread(out->data(), 1, out->size(), f) == out->size();
    fclose(f);
    if (!ok) *why = std::string(path) + ": read error";
    return ok;
}

// llama2.c legacy checkpoint: 7 x i32 header, then f32 arrays - the layout karpathy/llama2.c's
// export.py writes (legacy_export) and run.c reads (read_checkpoint, memory_map_weights)
struct l2c_header {
    int64_t dim, hidden, L, heads, kv_heads, vocab, seq;
    bool shared;         // the output shares the token embedding (a positive vocabulary size)
    int64_t hs, kv_dim;  // a head's size, the keys' and values' width
};

// The header of the checkpoint in buf, checked for plausible sizes and against the file's size;
// 0, or 1 after the message
static int l2c_read_header(const char *model, const std::vector<uint8_t> &buf, l2c_header *hd) {
    if (buf.size() < 28) {
        fprintf(stderr, "convert: %s: %zu bytes is too short for a llama2.c header\n", model, buf.size());
        return 1;
    }
    int32_t h[7];
    memcpy(h, buf.data(), sizeof(h));
    const int64_t dim = h[0], hidden = h[1], L = h[2], heads = h[3], kv_heads = h[4], seq = h[6];
    const bool shared = h[5] > 0;
    const int64_t vocab = shared ? h[5] : -(int64_t)h[5];
    if (dim <= 0 || hidden <= 0 || L <= 0 || heads <= 0 || kv_heads <= 0 || vocab <= 0 || seq <= 0 || dim % heads ||
        heads % kv_heads || (dim / heads) % 2 || dim > (1 << 16) || hidden > (1 << 18) || L > 1024 || vocab > (1 << 22)) {
        fprintf(stderr,
                "convert: %s: implausible llama2.c header (dim %lld, hidden %lld, layers %lld, heads %lld/%lld, vocab %d, "
                "seq %lld)\n",
                model, (long long)dim, (long long)hidden, (long long)L, (long long)heads, (long long)kv_heads, h[5],
                (long long)seq);
        return 1;
    }
    const int64_t hs = dim / heads, kv_dim = kv_heads * hs;
    // float counts, in file order
    const int64_t n_floats = vocab * dim + L * dim + L * dim * dim + 2 * L * kv_dim * dim + L * dim * dim + L * dim +
                             3 * L * hidden * dim + dim + seq * hs + (shared ? 0 : vocab * dim);
    const size_t expect = 28 + (size_t)n_floats * 4;
    if (buf.size() != expect) {
        fprintf(stderr, "convert: %s: %zu bytes, but the header (dim %lld, %lld layers, vocab %lld) means %zu%s\n", model,
                buf.size(), (long long)dim, (long long)L, (long long)vocab, expect,
                buf.size() < expect ? " (truncated?)" : "");
        return 1;
    }
    *hd = {dim, hidden, L, heads, kv_heads, vocab, seq, shared, hs, kv_dim};
    return 0;
}

// llama's settings as the header gives them (all f32; llama2.c's rms eps and rope base)
static void l2c_write_keys(ql_gguf_writer *w, const l2c_header &h) {
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_str(w, "general.name", "llama2.c checkpoint");
    ql_gguf_set_u32(w, "general.file_type", 0);  // all f32
    ql_gguf_set_u32(w, "llama.context_length", (uint32_t)h.seq);
    ql_gguf_set_u32(w, "llama.embedding_length", (uint32_t)h.dim);
    ql_gguf_set_u32(w, "llama.block_count", (uint32_t)h.L);
    ql_gguf_set_u32(w, "llama.feed_forward_length", (uint32_t)h.hidden);
    ql_gguf_set_u32(w, "llama.attention.head_count", (uint32_t)h.heads);
    ql_gguf_set_u32(w, "llama.attention.head_count_kv", (uint32_t)h.kv_heads);
    ql_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    ql_gguf_set_f32(w, "llama.rope.freq_base", 10000.0f);
    ql_gguf_set_u32(w, "llama.rope.dimension_count", (uint32_t)h.hs);
}

// one f32 tensor, ne [ne0, ne1] (a vector when ne1 is 1); exits after the message when refused
static void l2c_add(ql_gguf_writer *w, const std::string &name, const float *data, int64_t ne0, int64_t ne1) {
    const int64_t ne[4] = {ne0, ne1, 1, 1};
    if (ql_gguf_add_tensor(w, name.c_str(), QL_TYPE_F32, ne1 > 1 ? 2 : 1, ne, data, (size_t)(ne0 * ne1) * 4) != QL_OK) {
        fprintf(stderr, "convert: cannot add tensor %s\n", name.c_str());
        exit(1);
    }
}

// The f32 arrays after the header (p), in file order, as GGUF tensors. llama2.c matrices are
// [out, in] row-major = GGUF ne [in, out]; already in Meta's rope layout.
static void l2c_add_tensors(ql_gguf_writer *w, const l2c_header &h, const float *p) {
    const int64_t dim = h.dim, hidden = h.hidden, L = h.L, vocab = h.vocab, kv_dim = h.kv_dim;
    auto take = [&](int64_t n) {
        const float *r = p;
        p += n;
        return r;
    };
    const float *emb = take(vocab * dim);
    l2c_add(w, "token_embd.weight", emb, dim, vocab);
    const float *rms_att = take(L * dim), *wq = take(L * dim * dim), *wk = take(L * kv_dim * dim),
                *wv = take(L * kv_dim * dim), *wo = take(L * dim * dim), *rms_ffn = take(L * dim),
                *w1 = take(L * hidden * dim), *w2 = take(L * dim * hidden), *w3 = take(L * hidden * dim);
    for (int64_t l = 0; l < L; l++) {
        const std::string b = "blk." + std::to_string(l) + ".";
        l2c_add(w, b + "attn_norm.weight", rms_att + l * dim, dim, 1);
        l2c_add(w, b + "attn_q.weight", wq + l * dim * dim, dim, dim);
        l2c_add(w, b + "attn_k.weight", wk + l * kv_dim * dim, dim, kv_dim);
        l2c_add(w, b + "attn_v.weight", wv + l * kv_dim * dim, dim, kv_dim);
        l2c_add(w, b + "attn_output.weight", wo + l * dim * dim, dim, dim);
        l2c_add(w, b + "ffn_norm.weight", rms_ffn + l * dim, dim, 1);
        l2c_add(w, b + "ffn_gate.weight", w1 + l * hidden * dim, dim, hidden);
        l2c_add(w, b + "ffn_down.weight", w2 + l * dim * hidden, hidden, dim);
        l2c_add(w, b + "ffn_up.weight", w3 + l * hidden * dim, dim, hidden);
    }
    l2c_add(w, "output_norm.weight", take(dim), dim, 1);
    take(h.seq * h.hs);  // legacy rope tables: recomputed, not stored
    if (!h.shared) l2c_add(w, "output.weight", take(vocab * dim), dim, vocab);
}

// The written file's vocabulary covers the model's embedding rows; else 1 after the message, out removed
static int l2c_check_vocab(const char *model, const char *tok, const char *out, int64_t vocab) {
    char err[512];
    ql_gguf *g = ql_gguf_open(out, err, sizeof(err));
    ql_vocab *v = g ? ql_vocab_load(g, err, sizeof(err)) : nullptr;
    const int32_t n_tok = v ? ql_vocab_n_tokens(v) : -1;
    ql_vocab_free(v);
    ql_gguf_close(g);
    if (n_tok != vocab) {
        fprintf(stderr, "convert: %s has %d tokens, but %s has %lld embedding rows\n", tok, n_tok, model, (long long)vocab);
        remove(out);
        return 1;
    }
    return 0;
}

static int convert_llama2c(const char *model, const char *tok, const char *out) {
    std::vector<uint8_t> buf;
    std::string why;
    if (!read_file(model, &buf, &why)) {
        fprintf(stderr, "convert: %s\n", why.c_str());
        return 1;
    }
    l2c_header h;
    if (const int rc = l2c_read_header(model, buf, &h)) return rc;
    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    l2c_write_keys(w, h);
    char err[512];
    if (ql_vocab_from_llama2c(tok, w, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    l2c_add_tensors(w, h, (const float *)(buf.data() + 28));
    if (ql_gguf_write(w, out, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    w_.reset();
    if (const int rc = l2c_check_vocab(model, tok, out, h.vocab)) return rc;
    printf("convert: %s: llama, dim %lld, %lld layers, %lld/%lld heads, ffn %lld, vocab %lld, context %lld%s -> %s\n",
           model, (long long)h.dim, (long long)h.L, (long long)h.heads, (long long)h.kv_heads, (long long)h.hidden,
           (long long)h.vocab, (long long)h.seq, h.shared ? ", tied output" : "", out);
    return 0;
}

static int convert_tiktoken(const char *path, const char *pre, const char *out) {
    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_str(w, "general.name", "vocabulary only");
    char err[512];
    if (ql_vocab_from_tiktoken(path, pre, w, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    if (ql_gguf_write(w, out, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    w_.reset();
    printf("convert: %s (tiktoken, pre %s) -> %s\n", path, pre, out);
    return 0;
}

// ---- Hugging Face checkpoints: config.json + safetensors (+ tokenizer) -> GGUF ----
//
// What llama.cpp's convert_hf_to_gguf.py writes for LlamaForCausalLM / MistralForCausalLM (arch
// "llama": q/k rows permuted from HF's rotate-half order to Meta's interleaved pairs) and
// Qwen2ForCausalLM (arch "qwen2": neox rope, rows as they are, q/k/v biases): the same keys and
// tensor names, written from the formats' description. Tensors stream from one shard at a time.

struct hf_tensor {
    std::string gguf_name;
    size_t shard = 0;
    std::string hf_name;
    int64_t ne[4] = {1, 1, 1, 1};
    int n_dims = 1;
    ql_type type = QL_TYPE_F32;
    int permute_heads = 0;  // > 0: rows permuted for that many heads (llama's q, k)
    bool bnb = false;       // a bitsandbytes 4-bit weight: its codes carried over, not requantised
    float nested_offset = 0;
    bool nested = false;
};

struct hf_source {  // the generator's state: the shard in memory, the tensors in order
    std::vector<std::string> shards;
    std::vector<hf_tensor> tensors;
    size_t loaded = (size_t)-1;
    std::vector<ql_st_tensor> st;
    std::vector<uint8_t> storage;
    std::string err;
    size_t next = 0;
};

// a bitsandbytes NF4 weight into our NF4 (double quantisation kept, bit for bit) or, where
// llama's q/k rows are permuted, NF4_NODQ (each block's absmax as bitsandbytes dequantises it:
// a permutation moves whole blocks out of their double-quantisation groups)
static bool hf_fill_bnb(hf_source &s, const hf_tensor &t, void *dst) {
    auto find = [&](const std::string &n) -> const ql_st_tensor * {
        for (const ql_st_tensor &c : s.st)
            if (c.name == n) return &c;
        s.err = s.shards[t.shard] + ": no tensor " + n + " beside " + t.hf_name;
        return nullptr;
    };
    const int64_t n = t.ne[0] * t.ne[1], nb = (n + 63) / 64, ng = (nb + 255) / 256;
    const ql_st_tensor *w = find(t.hf_name), *am = find(t.hf_name + ".absmax"), *qm = find(t.hf_name + ".quant_map");
    const ql_st_tensor *na = t.nested ? find(t.hf_name + ".nested_absmax") : nullptr,
                       *nq = t.nested ? find(t.hf_name + ".nested_quant_map") : nullptr;
    if (!w || !am || !qm || (t.nested && (!na || !nq))) return false;
    // (their sizes and dtypes were checked against the quant_state with the table: bnb_arrays_why)
    // aligned copies of the arrays (safetensors offsets promise no alignment)
    std::vector<uint8_t> packed((const uint8_t *)w->data, (const uint8_t *)w->data + (n + 1) / 2), codes;
    std::vector<float> absmax, nabs((size_t)ng), nmap(256), qmap(16);
    if (t.nested) {
        codes.assign((const uint8_t *)am->data, (const uint8_t *)am->data + nb);
        memcpy(nabs.data(), na->data, nabs.size() * 4);
        memcpy(nmap.data(), nq->data, 1024);
    } else {
        absmax.resize((size_t)nb);
        memcpy(absmax.data(), am->data, absmax.size() * 4);
    }
    memcpy(qmap.data(), qm->data, 64);
    ql_bnb_nf4 in{};
    in.n = n;
    in.nested = t.nested;
    in.packed = packed.data();
    in.absmax_codes = codes.data();
    in.absmax = absmax.data();
    in.nested_absmax = nabs.data();
    in.nested_offset = t.nested_offset;
    in.quant_map = qmap.data();
    in.nested_quant_map = nmap.data();
    char e[256];
    if (ql_nf4_from_bnb(&in, t.type, t.ne[0], dst, e, sizeof(e)) != QL_OK) {
        s.err = t.hf_name + ": " + e;
        return false;
    }
    if (t.permute_heads > 0) {  // whole rows of whole blocks (checked): codes and absmax move together
        const int64_t rows = t.ne[1], hd = rows / t.permute_heads, rb = t.ne[0] / 2, rblk = t.ne[0] / 64;
        uint8_t *q = (uint8_t *)dst;
        float *a = (float *)(q + ql_aux_offset((size_t)(n / 2)));
        std::vector<uint8_t> q0(q, q + n / 2);
        std::vector<float> a0(a, a + nb);
        for (int64_t h = 0; h < t.permute_heads; h++)
            for (int64_t half = 0; half < 2; half++)
                for (int64_t i = 0; i < hd / 2; i++) {
                    const int64_t to = h * hd + 2 * i + half, from = h * hd + half * (hd / 2) + i;
                    memcpy(q + to * rb, q0.data() + from * rb, (size_t)rb);
                    memcpy(a + to * rblk, a0.data() + from * rblk, (size_t)rblk * 4);
                }
    }
    return true;
}

static bool hf_fill(void *arg, void *dst, size_t size) {
    hf_source &s = *(hf_source *)arg;
    const hf_tensor &t = s.tensors[s.next++];
    if (s.loaded != t.shard) {  // the next shard: the previous one's bytes are written
        s.st.clear();
        s.storage.clear();
        s.storage.shrink_to_fit();
        if (!ql_safetensors_read(s.shards[t.shard].c_str(), &s.st, &s.storage, &s.err)) return false;
        s.loaded = t.shard;
    }
    if (t.bnb) return hf_fill_bnb(s, t, dst);
    const ql_st_tensor *x = nullptr;
    for (const ql_st_tensor &c : s.st)
        if (c.name == t.hf_name) x = &c;
    if (!x) {
        s.err = s.shards[t.shard] + ": no tensor " + t.hf_name + " (the index names it there)";
        return false;
    }
    if (x->dtype == "U8") {
        s.err = t.hf_name + ": dtype U8 without a bitsandbytes quant_state";
        return false;
    }
    const int64_t n = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3];
    std::vector<float> f((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *p = (const uint8_t *)x->data;
        if (x->dtype == "F32") memcpy(&f[(size_t)i], p + 4 * i, 4);
        else {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            f[(size_t)i] = x->dtype == "F16" ? ql_fp16_to_fp32(h) : ql_bf16_to_fp32(h);
        }
    }
    if (t.permute_heads > 0) {  // HF's rotate-half rows -> interleaved pairs, per head
        const int64_t rows = t.ne[1], hd = rows / t.permute_heads, E = t.ne[0];
        std::vector<float> g(f.size());
        for (int64_t h = 0; h < t.permute_heads; h++)
            for (int64_t half = 0; half < 2; half++)
                for (int64_t i = 0; i < hd / 2; i++)
                    memcpy(&g[(size_t)((h * hd + 2 * i + half) * E)], &f[(size_t)((h * hd + half * (hd / 2) + i) * E)], (size_t)E * 4);
        f.swap(g);
    }
    char e[256];
    if (ql_quantize(t.type, f.data(), n / t.ne[0], t.ne[0], dst, e, sizeof(e)) != QL_OK) {
        s.err = t.hf_name + ": " + e;
        return false;
    }
    (void)size;
    return true;
}

static bool read_json_file(const std::string &path, ql_json *j, std::string *why) {
    std::vector<uint8_t> b;
    if (!read_file(path.c_str(), &b, why)) return false;
    const std::string text(b.begin(), b.end());
    if (ql_utf8_invalid_at(text) != std::string::npos) {
        *why = path + ": not UTF-8";
        return false;
    }
    if (!ql_json_parse(text, QL_JSON_DOCUMENT, j, why)) {
        *why = path + ": " + *why;
        return false;
    }
    return true;
}

// the tokenizer: tokenizer.json (byte-level BPE) or tokenizer.model (SentencePiece), with the
// ids, flags and chat template of tokenizer_config.json / config.json
static bool hf_tokenizer(const std::string &dir, const ql_json &cfg, ql_gguf_writer *w, std::string *why);

// config.json's settings, checked: the sizes, the norm and rope values, the rope scaling
struct hf_config {
    std::string arch_hf;  // "LlamaForCausalLM", "MistralForCausalLM" or "Qwen2ForCausalLM"
    bool qwen2 = false;
    int64_t E = 0, L = 0, H = 0, HKV = 0, F = 0, V = 0, hd = 0, ctx = 0;
    double eps = 0, theta = 0;
    bool tied = false;
    std::string rope_type;  // "", "linear" or "llama3"
    double linear_factor = 0;
    double l3_factor = 8.0, l3_lo = 1.0, l3_hi = 4.0, l3_old = 8192.0;  // llama3's, with transformers' defaults
};

// The sizes and values of config.json into c; false with *why (without the path) when one is
// missing, not a number where it must be, or out of range.
static bool hf_config_sizes(const ql_json &cfg, hf_config *c, std::string *why_out) {
    std::string &why = *why_out;
    auto num = [&](const char *key, double def, bool required) -> double {
        const ql_json *v = cfg.get(key);
        if (v && v->kind == ql_json::NUM) return v->num();
        if (why.empty() && v && v->kind != ql_json::NUL)  // present but not a number: not silently the default
            why = std::string("'") + key + "' is not a number";
        else if (why.empty() && required)
            why = std::string("no number '") + key + "'";
        return def;
    };
    // a size: a whole number from 1 to 2^30 (32.5 is not truncated, 1e30 not cast), as written in the message
    auto size = [&](const char *key, int64_t def, bool required) -> int64_t {
        const ql_json *v = cfg.get(key);
        const double x = num(key, (double)def, required);
        if (!why.empty()) return 0;
        const std::string as_written = v && v->kind == ql_json::NUM ? v->str : std::to_string(def);
        if (x != std::floor(x)) why = std::string(key) + " is " + as_written + " (a whole number)";
        else if (!(x >= 1 && x <= (double)((int64_t)1 << 30))) why = std::string(key) + " is " + as_written + " (a size from 1 to 2^30)";
        return why.empty() ? (int64_t)x : 0;
    };
    const int64_t E = size("hidden_size", 0, true), L = size("num_hidden_layers", 0, true), H = size("num_attention_heads", 0, true),
                  F = size("intermediate_size", 0, true), V = size("vocab_size", 0, true);
    const int64_t HKV = size("num_key_value_heads", H, false);
    // an explicit head_dim may make H * head_dim differ from hidden_size (Mistral-Nemo, Qwen3's shapes);
    // without one the heads split hidden_size, which must be a multiple of their number
    const ql_json *hd_json = cfg.get("head_dim");
    const bool hd_given = hd_json && hd_json->kind == ql_json::NUM;
    if (why.empty() && (!hd_json || hd_json->kind == ql_json::NUL) && E % H)
        why = "hidden_size " + std::to_string(E) + (E < H ? " is smaller than" : " is not a multiple of") + " num_attention_heads " +
              std::to_string(H) + " (and no head_dim gives the heads' size)";
    const int64_t hd = size("head_dim", why.empty() ? E / H : 0, false);  // (absent: hidden_size / heads)
    // transformers 5 writes rope_parameters (theta and scaling together); 4.x rope_theta and rope_scaling
    const ql_json *rp = cfg.get("rope_parameters");
    if (rp && rp->kind != ql_json::OBJ) rp = nullptr;
    const ql_json *rp_theta = rp ? rp->get("rope_theta") : nullptr;
    const double eps = num("rms_norm_eps", 1e-6, false),
                 theta = rp_theta && rp_theta->kind == ql_json::NUM ? rp_theta->num() : num("rope_theta", 10000.0, false);
    const int64_t ctx = size("max_position_embeddings", 2048, false);
    const ql_json *tie = cfg.get("tie_word_embeddings");
    c->tied = tie && tie->kind == ql_json::BOOL && tie->b;
    // each size and value by name, so that the message says which (and no GGUF is written that
    // generate would refuse, or that computes NaN)
    const std::pair<const char *, int64_t> sizes[] = {{"hidden_size", E},       {"num_hidden_layers", L},
                                                      {"num_attention_heads", H}, {"num_key_value_heads", HKV},
                                                      {"intermediate_size", F},  {"vocab_size", V},
                                                      {"head_dim", hd},          {"max_position_embeddings", ctx}};
    for (const auto &sz : sizes)
        if (why.empty() && (sz.second <= 0 || sz.second > (int64_t)1 << 30))
            why = std::string(sz.first) + " is " + std::to_string(sz.second) + " (a size from 1 to 2^30)";
    auto gnum = [](double x) { char b[32]; snprintf(b, sizeof b, "%g", x); return std::string(b); };
    if (why.empty() && !(eps > 0 && eps < 1)) why = "rms_norm_eps is " + gnum(eps) + " (above 0, below 1)";
    if (why.empty() && !(theta > 1 && theta <= 1e12)) why = "rope_theta is " + gnum(theta) + " (above 1, at most 1e12)";
    if (why.empty() && hd_given && (hd % 2 || hd > 512)) why = "head_dim is " + std::to_string(hd) + " (an even size up to 512)";
    if (why.empty() && H % HKV)
        why = "inconsistent sizes: " + std::to_string(H) + " heads of " + std::to_string(hd) + " (head_dim) for hidden_size " +
              std::to_string(E) + ", " + std::to_string(HKV) + " key/value heads";
    c->E = E, c->L = L, c->H = H, c->HKV = HKV, c->F = F, c->V = V, c->hd = hd, c->ctx = ctx, c->eps = eps, c->theta = theta;
    return why.empty();
}

// The rope scaling config.json asks for (rope_parameters or rope_scaling: none, linear or
// llama3) into c; 0, or 1 after the message.
static int hf_config_rope(const char *dir_c, const ql_json &cfg, hf_config *c) {
    const ql_json *rp = cfg.get("rope_parameters");
    if (rp && rp->kind != ql_json::OBJ) rp = nullptr;
    const ql_json *rs = rp ? rp : cfg.get("rope_scaling");
    std::string &rope_type = c->rope_type;
    if (rs && rs->kind == ql_json::OBJ) {
        const ql_json *t = rs->get("rope_type") ? rs->get("rope_type") : rs->get("type");
        rope_type = t ? t->str : "?";
        if (rope_type == "default") rope_type.clear();  // (transformers 5's way of saying none)
    }
    if (rope_type.empty()) return 0;
    if (rope_type != "llama3" && rope_type != "linear") {
        fprintf(stderr, "convert: %s/config.json: rope scaling '%s' is not supported (llama3 and linear are)\n", dir_c,
                rope_type.c_str());
        return 1;
    }
    auto rnum = [&](const char *k, double def) { const ql_json *v = rs->get(k); return v && v->kind == ql_json::NUM ? v->num() : def; };
    c->linear_factor = rnum("factor", 0.0);
    if (!(c->linear_factor > 0 && std::isfinite(c->linear_factor)) && (rope_type == "linear" || rs->get("factor"))) {
        fprintf(stderr, "convert: %s/config.json: rope_scaling.factor must be a positive number for %s scaling\n", dir_c,
                rope_type.c_str());
        return 1;
    }
    if (rope_type == "llama3") {  // the per-frequency divisors' inputs: positive, low below high
        c->l3_factor = rnum("factor", c->l3_factor), c->l3_lo = rnum("low_freq_factor", c->l3_lo),
        c->l3_hi = rnum("high_freq_factor", c->l3_hi), c->l3_old = rnum("original_max_position_embeddings", c->l3_old);
        if (!(c->l3_lo > 0 && c->l3_hi > c->l3_lo && std::isfinite(c->l3_hi) && c->l3_old >= 1 && std::isfinite(c->l3_old))) {
            fprintf(stderr, "convert: %s/config.json: rope_scaling: low_freq_factor %g, high_freq_factor %g, "
                    "original_max_position_embeddings %g (positive, low below high)\n", dir_c, c->l3_lo, c->l3_hi, c->l3_old);
            return 1;
        }
    }
    return 0;
}

// DIR/config.json read and checked into *cfg and *c: a supported architecture, silu, the
// sizes, the rope scaling, no bitsandbytes 4-bit code but nf4; 0, or 1 after the message.
static int hf_read_config(const std::string &dir, ql_json *cfg_out, hf_config *c) {
    const char *dir_c = dir.c_str();
    std::string why;
    ql_json &cfg = *cfg_out;
    if (!read_json_file(dir + "/config.json", &cfg, &why)) {
        fprintf(stderr, "convert: %s\n", why.c_str());
        return 1;
    }
    if (cfg.kind != ql_json::OBJ) {
        fprintf(stderr, "convert: %s/config.json: is %s, not a JSON object of the model's settings\n", dir_c, ql_json_kind_name(cfg.kind));
        return 1;
    }
    const ql_json *archs = cfg.get("architectures");
    c->arch_hf = archs && archs->kind == ql_json::ARR && !archs->items.empty() ? archs->items[0].str : "";
    c->qwen2 = c->arch_hf == "Qwen2ForCausalLM";
    if (c->arch_hf != "LlamaForCausalLM" && c->arch_hf != "MistralForCausalLM" && !c->qwen2) {
        fprintf(stderr, "convert: %s/config.json: architecture '%s' is not supported (LlamaForCausalLM, MistralForCausalLM, "
                        "Qwen2ForCausalLM)\n", dir_c, c->arch_hf.c_str());
        return 1;
    }
    const ql_json *act = cfg.get("hidden_act");
    if (act && act->kind == ql_json::STR && act->str != "silu") {
        fprintf(stderr, "convert: %s/config.json: hidden_act '%s' (these architectures use silu)\n", dir_c, act->str.c_str());
        return 1;
    }
    if (!hf_config_sizes(cfg, c, &why)) {
        fprintf(stderr, "convert: %s/config.json: %s\n", dir_c, why.c_str());
        return 1;
    }
    if (const int rc = hf_config_rope(dir_c, cfg, c)) return rc;
    if (const ql_json *qc = cfg.get("quantization_config")) {  // bitsandbytes' other 4-bit code: refused by name, not as a shape
        const ql_json *qt = qc->get("bnb_4bit_quant_type");
        const ql_json *l4 = qc->get("load_in_4bit") ? qc->get("load_in_4bit") : qc->get("_load_in_4bit");
        if (qt && qt->kind == ql_json::STR && qt->str != "nf4" && l4 && l4->kind == ql_json::BOOL && l4->b) {
            fprintf(stderr, "convert: %s/config.json: bitsandbytes 4-bit type '%s' is not supported: only nf4\n", dir_c,
                    ql_printable(qt->str).c_str());
            return 1;
        }
    }
    return 0;
}

// --outtype's name as a type qlora can write (a float type with a quantiser); QL_TYPE_COUNT if none
static ql_type hf_outtype(const char *outtype) {
    ql_type wtype = QL_TYPE_COUNT;
    for (int t = 0; t < QL_TYPE_COUNT; t++) {
        const ql_type_traits *tt = ql_type_traits_get((ql_type)t);
        if (tt && tt->is_float && (tt->from_float || tt->aux_bytes) && !strcmp(tt->name, outtype)) wtype = (ql_type)t;
    }
    return wtype;
}

// The shards into src->shards: model.safetensors, or those model.safetensors.index.json's
// weight_map names (names inside DIR only: no absolute path, no '..'; a symbolic link to a file
// may lead anywhere - the user chose the folder, and Hugging Face's download cache is made of
// links from snapshots/<rev>/ to ../../blobs/<sha>); *where: HF tensor name -> shard, as the
// index says. 0, or 1 after the message.
static int hf_find_shards(const std::string &dir, bool indexed, hf_source *src, std::vector<std::pair<std::string, size_t>> *where) {
    const char *dir_c = dir.c_str();
    const std::string index = dir + "/model.safetensors.index.json";
    if (!indexed) {
        src->shards.push_back(dir + "/model.safetensors");
        return 0;
    }
    std::string why;
    ql_json idx;
    if (!read_json_file(index, &idx, &why)) {
        fprintf(stderr, "convert: %s\n", why.c_str());
        return 1;
    }
    const ql_json *wm = idx.kind == ql_json::OBJ ? idx.get("weight_map") : nullptr;
    if (!wm || wm->kind != ql_json::OBJ) {
        fprintf(stderr, "convert: %s: no weight_map object\n", index.c_str());
        return 1;
    }
    for (size_t k = 0; k < wm->keys.size(); k++) {
        const ql_json &f = wm->items[k];
        const std::string &rel = f.str;
        std::string bad;
        if (f.kind != ql_json::STR || rel.empty()) bad = "is not a file name";
        else if (rel[0] == '/') bad = "is an absolute path";
        else if (rel == ".." || rel.rfind("../", 0) == 0 || rel.find("/../") != std::string::npos ||
                 (rel.size() >= 3 && rel.compare(rel.size() - 3, 3, "/..") == 0))
            bad = "leads out of the folder ('..')";
        struct stat ls, ts;
        if (bad.empty() && lstat((dir + "/" + rel).c_str(), &ls) == 0 && S_ISLNK(ls.st_mode)) {  // a link: to a file
            if (stat((dir + "/" + rel).c_str(), &ts) != 0)
                bad = std::string("is a symbolic link that leads nowhere (") + strerror(errno) + ")";
            else if (!S_ISREG(ts.st_mode)) bad = "is a symbolic link to something that is not a file";
        }
        if (!bad.empty()) {
            fprintf(stderr, "convert: %s: weight_map puts %s in '%s', which %s: shards must be files in %s\n", index.c_str(),
                    ql_printable(wm->keys[k]).c_str(), ql_printable(rel).c_str(), bad.c_str(), dir_c);
            return 1;
        }
        const std::string file = dir + "/" + rel;
        size_t s = std::find(src->shards.begin(), src->shards.end(), file) - src->shards.begin();
        if (s == src->shards.size()) src->shards.push_back(file);
        where->push_back({wm->keys[k], s});
    }
    return 0;
}

// no output over a file this reads (before reading the weights): 0, or the exit code after the message
static int hf_check_output(const std::string &dir, const hf_source &src, const char *out) {
    std::vector<std::string> inputs = src.shards;
    for (const char *f : {"/config.json", "/model.safetensors.index.json", "/tokenizer.json", "/tokenizer.model", "/tokenizer_config.json"})
        inputs.push_back(dir + f);
    for (const std::string &in : inputs) {
        std::string owhy;
        if (const int rc = output_path_why(out, {in.c_str()}, &owhy)) {
            fprintf(stderr, "convert: %s\n", owhy.c_str());
            return rc;
        }
    }
    return 0;
}

// every shard's table (headers only matter here; the bytes are read again when written)
struct hf_entry {
    std::string name, dtype;
    std::vector<int64_t> shape;  // PyTorch order
    size_t shard;
};
struct hf_tables {
    std::string dir;
    std::vector<std::string> shards;
    std::vector<hf_entry> table;
    std::vector<std::pair<std::string, std::string>> bnb_states;  // weight name -> its quant_state JSON
    std::string shard_name(size_t s) const { return shards[s].substr(dir.size() + 1); }
    const hf_entry *entry_of(const std::string &n) const {
        for (const hf_entry &e : table)
            if (e.name == n) return &e;
        return nullptr;
    }
};

// Every shard's tensor names, dtypes and shapes into tb (each tensor in one shard, where the
// index puts it), and the bitsandbytes quant_states by weight; 0, or 1 after the message.
static int hf_read_tables(bool indexed, const std::vector<std::pair<std::string, size_t>> &where, hf_tables *tb) {
    const char *dir_c = tb->dir.c_str();
    const std::string index = tb->dir + "/model.safetensors.index.json";
    std::string why;
    for (size_t s = 0; s < tb->shards.size(); s++) {
        std::vector<ql_st_tensor> st;
        std::vector<uint8_t> storage;
        if (!ql_safetensors_read(tb->shards[s].c_str(), &st, &storage, &why)) {
            fprintf(stderr, "convert: %s\n", why.c_str());
            return 1;
        }
        for (const ql_st_tensor &t : st) {
            for (const hf_entry &e : tb->table)
                if (e.name == t.name) {
                    fprintf(stderr, "convert: %s: tensor %s is in both %s and %s\n", dir_c, ql_printable(t.name).c_str(),
                            tb->shard_name(e.shard).c_str(), tb->shard_name(s).c_str());
                    return 1;
                }
            if (indexed) {  // the index must say where each tensor is: one clause when it does not
                size_t named = (size_t)-1;
                for (const auto &x : where)
                    if (x.first == t.name) named = x.second;
                if (named != s) {
                    fprintf(stderr, "convert: %s: weight_map %s%s, but it is in %s\n", index.c_str(),
                            named == (size_t)-1 ? "does not name " : "puts ", (ql_printable(t.name) + (named == (size_t)-1 ? "" : " in " + tb->shard_name(named))).c_str(),
                            tb->shard_name(s).c_str());
                    return 1;
                }
            }
            tb->table.push_back({t.name, t.dtype, t.shape, s});
            for (const char *kind : {"nf4", "fp4"}) {
                const std::string tag = std::string(".quant_state.bitsandbytes__") + kind;
                if (t.dtype != "U8" || t.name.size() <= tag.size() || t.name.compare(t.name.size() - tag.size(), tag.size(), tag) != 0)
                    continue;
                const std::string weight = t.name.substr(0, t.name.size() - tag.size());
                if (!strcmp(kind, "fp4")) {
                    fprintf(stderr, "convert: %s: %s: bitsandbytes fp4 4-bit weights are not supported: only nf4\n", dir_c, weight.c_str());
                    return 1;
                }
                int64_t n = 0;
                if (!ql_st_shape_count(t.shape, &n) || n > (1 << 20)) n = 1 << 20;  // (a quant_state is a short JSON text)
                tb->bnb_states.push_back({weight, std::string((const char *)t.data, (size_t)n)});
            }
        }
    }
    return 0;
}

// num_hidden_layers against the layers the files hold, before 9 names a layer are made: every
// layer below it holds its input_layernorm.weight (counted, not inferred from the largest
// index: a tensor model.layers.999999999.x alone does not make a billion layers). The first
// layer missing (at most one more than the layers held: the loop ends there), or -1 after the message.
static int64_t hf_check_layers(const hf_tables &tb, int64_t L) {
    std::unordered_set<int64_t> held;
    for (const hf_entry &e : tb.table) {
        const char *p = "model.layers.", *sfx = ".input_layernorm.weight";
        if (e.name.compare(0, strlen(p), p) != 0) continue;
        int64_t l = 0;
        size_t i = strlen(p);
        while (i < e.name.size() && isdigit((unsigned char)e.name[i]) && l < ((int64_t)1 << 31)) l = l * 10 + (e.name[i++] - '0');
        if (i > strlen(p) && e.name.compare(i, std::string::npos, sfx) == 0) held.insert(l);
    }
    int64_t first_missing = 0;
    while (first_missing < L && held.count(first_missing)) first_missing++;
    if (!held.empty() && first_missing < L) {  // (none at all: the tensors' own messages below, the embedding's first)
        fprintf(stderr, "convert: %s/config.json: num_hidden_layers is %lld, but the weights have no layer %lld "
                        "(no model.layers.%lld.input_layernorm.weight)\n", tb.dir.c_str(), (long long)L, (long long)first_missing,
                (long long)first_missing);
        return -1;
    }
    return first_missing;
}

// GGUF names in llama.cpp's order, with the HF tensor each comes from and the heads its rows
// are permuted for (0: as they are)
static std::vector<std::tuple<std::string, std::string, int>> hf_tensor_names(const hf_config &c, int64_t n_layers, bool lm_head) {
    std::vector<std::tuple<std::string, std::string, int>> want = {{"token_embd.weight", "model.embed_tokens.weight", 0}};
    for (int64_t l = 0; l < n_layers; l++) {
        const std::string b = "blk." + std::to_string(l) + ".", h = "model.layers." + std::to_string(l) + ".";
        want.push_back({b + "attn_norm.weight", h + "input_layernorm.weight", 0});
        want.push_back({b + "attn_q.weight", h + "self_attn.q_proj.weight", c.qwen2 ? 0 : (int)c.H});
        want.push_back({b + "attn_k.weight", h + "self_attn.k_proj.weight", c.qwen2 ? 0 : (int)c.HKV});
        want.push_back({b + "attn_v.weight", h + "self_attn.v_proj.weight", 0});
        if (c.qwen2)
            for (const char *x : {"q", "k", "v"})
                want.push_back({b + "attn_" + x + ".bias", h + "self_attn." + x + "_proj.bias", 0});
        want.push_back({b + "attn_output.weight", h + "self_attn.o_proj.weight", 0});
        want.push_back({b + "ffn_norm.weight", h + "post_attention_layernorm.weight", 0});
        want.push_back({b + "ffn_gate.weight", h + "mlp.gate_proj.weight", 0});
        want.push_back({b + "ffn_up.weight", h + "mlp.up_proj.weight", 0});
        want.push_back({b + "ffn_down.weight", h + "mlp.down_proj.weight", 0});
    }
    want.push_back({"output_norm.weight", "model.norm.weight", 0});
    if (!c.tied && lm_head) want.push_back({"output.weight", "lm_head.weight", 0});
    return want;
}

// a bitsandbytes weight's arrays against its quant_state's shape, before anything is sized by it:
// the codes (any dtype: bnb_4bit_quant_storage may be bfloat16), absmax, the maps, all in its
// shard. "" when they fit, else what does not.
static std::string hf_bnb_arrays_why(const hf_tables &tb, const hf_entry &wt, int64_t n, bool nested) {
    const int64_t nb = (n + 63) / 64, ng = (nb + 255) / 256;
    struct part {
        const char *sfx, *dtype;
        int64_t count;
    };
    const part parts[] = {{"", nullptr, (n + 1) / 2}, {".absmax", nested ? "U8" : "F32", nb}, {".quant_map", "F32", 16},
                          {".nested_absmax", "F32", ng}, {".nested_quant_map", "F32", 256}};
    for (const part &p : parts) {
        if (!nested && p.sfx[0] && strstr(p.sfx, "nested")) continue;
        const hf_entry *a = tb.entry_of(wt.name + p.sfx);
        if (!a) return std::string("no tensor ") + wt.name + p.sfx + " beside it";
        if (a->shard != wt.shard) return wt.name + p.sfx + " is in " + tb.shard_name(a->shard) + ", not beside it in " + tb.shard_name(wt.shard);
        int64_t c = 0;
        if (!ql_st_shape_count(a->shape, &c) || (!p.dtype && __builtin_mul_overflow(c, (int64_t)ql_st_dtype_size(a->dtype), &c)))
            return wt.name + p.sfx + ": its shape's element count overflows";  // (the codes: bytes, whatever the dtype)
        if (p.dtype && a->dtype != p.dtype) return wt.name + p.sfx + " is " + a->dtype + ", not " + p.dtype;
        if (c != p.count)
            return wt.name + p.sfx + " holds " + std::to_string(c) + (p.dtype ? " values" : " bytes") + ", the shape needs " +
                   std::to_string(p.count);
    }
    return "";
}

// A bitsandbytes 4-bit weight (a quant_state in quant_json): its shape and NF4 type from the
// state, its arrays checked against it; 0, or 1 after the message.
static int hf_bnb_tensor(const hf_tables &tb, const hf_entry &e, const std::string &quant_json, hf_tensor *tp) {
    const char *dir_c = tb.dir.c_str();
    hf_tensor &t = *tp;
    ql_json qs;
    std::string qwhy;
    const ql_json *qt = nullptr, *bs = nullptr, *shp = nullptr, *no = nullptr;
    if (ql_utf8_invalid_at(quant_json) == std::string::npos && ql_json_parse(quant_json, QL_JSON_DOCUMENT, &qs, &qwhy) &&
        qs.kind == ql_json::OBJ) {
        qt = qs.get("quant_type"), bs = qs.get("blocksize"), shp = qs.get("shape"), no = qs.get("nested_offset");
    }
    if (qt && qt->str == "fp4") {
        fprintf(stderr, "convert: %s: %s: bitsandbytes fp4 4-bit weights are not supported: only nf4\n", dir_c, t.hf_name.c_str());
        return 1;
    }
    if (!qt || qt->str != "nf4" || !bs || bs->num() != 64 || !shp || shp->kind != ql_json::ARR || shp->items.size() != 2) {
        fprintf(stderr, "convert: %s: %s: a bitsandbytes state that is not NF4 with blocks of 64 (%s)\n", dir_c, t.hf_name.c_str(),
                qt ? ql_printable(qt->str).c_str() : "no quant_type");
        return 1;
    }
    int64_t rows = 0, cols = 0;
    if (!shp->items[0].as_int(&rows) || !shp->items[1].as_int(&cols) || rows < 1 || cols < 1 || rows > ((int64_t)1 << 31) ||
        cols > ((int64_t)1 << 31)) {
        fprintf(stderr, "convert: %s: %s: quant_state shape [%s, %s] is not two sizes from 1 to 2^31\n", dir_c, t.hf_name.c_str(),
                ql_printable(shp->items[0].str).c_str(), ql_printable(shp->items[1].str).c_str());
        return 1;
    }
    t.bnb = true;
    t.nested = no && no->kind == ql_json::NUM;
    const std::string bad = hf_bnb_arrays_why(tb, e, rows * cols, t.nested);
    if (!bad.empty()) {
        fprintf(stderr, "convert: %s: %s: its bitsandbytes arrays do not fit its quant_state shape [%lld, %lld]: %s\n", dir_c,
                t.hf_name.c_str(), (long long)rows, (long long)cols, bad.c_str());
        return 1;
    }
    t.nested_offset = t.nested ? (float)no->num() : 0.0f;
    t.n_dims = 2;
    t.ne[0] = cols;
    t.ne[1] = rows;
    t.type = t.nested && !t.permute_heads ? QL_TYPE_NF4 : QL_TYPE_NF4_NODQ;
    if (t.ne[0] % 2 || (t.permute_heads && t.ne[0] % 64)) {
        fprintf(stderr, "convert: %s: %s: rows of %lld do not hold whole NF4 blocks (needed to permute its rows)\n", dir_c,
                t.hf_name.c_str(), (long long)t.ne[0]);
        return 1;
    }
    return 0;
}

// the shape config.json implies for a GGUF tensor (GGUF order: ne[0] the input side)
static void hf_expected_shape(const hf_config &c, const std::string &g, int64_t *w0, int64_t *w1) {
    auto ends = [&g](const char *sfx) { return g.size() >= strlen(sfx) && g.compare(g.size() - strlen(sfx), strlen(sfx), sfx) == 0; };
    *w0 = c.E, *w1 = 1;
    if (g == "token_embd.weight" || g == "output.weight") *w1 = c.V;
    else if (ends("attn_q.weight")) *w1 = c.H * c.hd;
    else if (ends("attn_k.weight") || ends("attn_v.weight")) *w1 = c.HKV * c.hd;
    else if (ends("attn_output.weight")) *w0 = c.H * c.hd, *w1 = c.E;
    else if (ends("ffn_gate.weight") || ends("ffn_up.weight")) *w1 = c.F;
    else if (ends("ffn_down.weight")) *w0 = c.F, *w1 = c.E;
    else if (ends("attn_q.bias")) *w0 = c.H * c.hd;
    else if (ends("attn_k.bias") || ends("attn_v.bias")) *w0 = c.HKV * c.hd;
}

// One GGUF tensor from its HF tensor: shape, type (--outtype's wtype, f32 or the bitsandbytes
// codes' NF4), checked against config.json; 0, or 1 after the message.
static int hf_plan_tensor(const hf_config &c, const hf_tables &tb, const std::tuple<std::string, std::string, int> &x, ql_type wtype,
                          hf_tensor *tp) {
    const char *dir_c = tb.dir.c_str();
    const hf_entry *e = tb.entry_of(std::get<1>(x));
    const std::vector<int64_t> *sh = e ? &e->shape : nullptr;
    if (!sh || sh->empty() || sh->size() > 2) {
        fprintf(stderr, "convert: %s: %s %s\n", dir_c, std::get<1>(x).c_str(), sh ? "is not 1-D or 2-D" : "is missing");
        return 1;
    }
    hf_tensor &t = *tp;
    t.gguf_name = std::get<0>(x);
    t.hf_name = std::get<1>(x);
    t.shard = e->shard;
    t.n_dims = (int)sh->size();
    t.ne[0] = sh->back();
    t.ne[1] = sh->size() == 2 ? (*sh)[0] : 1;
    t.permute_heads = std::get<2>(x);
    for (const auto &b : tb.bnb_states)  // a bitsandbytes 4-bit weight: shape and state from its JSON
        if (b.first == t.hf_name)
            if (const int rc = hf_bnb_tensor(tb, *e, b.second, &t)) return rc;
    if (!t.bnb && e->dtype == "U8") {
        fprintf(stderr, "convert: %s: %s: dtype U8 without a bitsandbytes quant_state\n", dir_c, t.hf_name.c_str());
        return 1;
    }
    // the block weights in --outtype where their rows fit its blocks; norms, biases, the
    // embedding and the head f32 unless --outtype is a plain float type (as llama.cpp's f16)
    const bool block_weight = t.n_dims == 2 && t.gguf_name.rfind("blk.", 0) == 0;
    const ql_type_traits *tt = ql_type_traits_get(wtype);
    const bool plain = tt->blck_size == 1;
    if (!t.bnb) t.type = (t.n_dims == 2 && (block_weight || plain) && t.ne[0] % tt->blck_size == 0) ? wtype : QL_TYPE_F32;
    int64_t w0 = 0, w1 = 0;
    hf_expected_shape(c, t.gguf_name, &w0, &w1);
    if (t.ne[0] != w0 || t.ne[1] != w1) {
        fprintf(stderr, "convert: %s: %s is [%lld, %lld], config.json makes it [%lld, %lld] (PyTorch order)\n", dir_c,
                t.hf_name.c_str(), (long long)t.ne[1], (long long)t.ne[0], (long long)w1, (long long)w0);
        return 1;
    }
    if (t.permute_heads && (t.ne[1] % t.permute_heads || (t.ne[1] / t.permute_heads) % 2)) {
        fprintf(stderr, "convert: %s: %s has %lld rows, not %d heads of an even size\n", dir_c, t.hf_name.c_str(),
                (long long)t.ne[1], t.permute_heads);
        return 1;
    }
    return 0;
}

// The GGUF's keys: general.*, the architecture's sizes, the tokenizer's, the rope scaling (llama3:
// the rope_freqs tensor, its data in *rope_factors, which must live until the file is written);
// 0, or 1 after the message.
static int hf_write_keys(const std::string &dir, const ql_json &cfg, const hf_config &c, const std::string &arch, ql_gguf_writer *w,
                         std::vector<float> *rope_factors) {
    const char *dir_c = dir.c_str();
    ql_gguf_set_str(w, "general.architecture", arch.c_str());
    ql_gguf_set_str(w, "general.name", (std::string("converted from ") + dir_c).c_str());
    {  // the Hub repository, when the directory says it (PEFT's base_model_name_or_path)
        const ql_json *np = cfg.get("_name_or_path");
        if (np && np->kind == ql_json::STR && !np->str.empty() && np->str.find('/') != std::string::npos && np->str[0] != '/' &&
            np->str[0] != '.')
            ql_gguf_set_str(w, "general.source.huggingface.repository", np->str.c_str());
    }
    auto key = [&](const char *k) { return arch + "." + k; };
    ql_gguf_set_u32(w, key("context_length").c_str(), (uint32_t)c.ctx);
    ql_gguf_set_u32(w, key("embedding_length").c_str(), (uint32_t)c.E);
    ql_gguf_set_u32(w, key("block_count").c_str(), (uint32_t)c.L);
    ql_gguf_set_u32(w, key("feed_forward_length").c_str(), (uint32_t)c.F);
    ql_gguf_set_u32(w, key("attention.head_count").c_str(), (uint32_t)c.H);
    ql_gguf_set_u32(w, key("attention.head_count_kv").c_str(), (uint32_t)c.HKV);
    ql_gguf_set_f32(w, key("attention.layer_norm_rms_epsilon").c_str(), (float)c.eps);
    ql_gguf_set_f32(w, key("rope.freq_base").c_str(), (float)c.theta);
    ql_gguf_set_u32(w, key("rope.dimension_count").c_str(), (uint32_t)c.hd);
    if (c.hd * c.H != c.E) {  // llama.cpp's head size keys; absent, readers take hidden_size / heads
        ql_gguf_set_u32(w, key("attention.key_length").c_str(), (uint32_t)c.hd);
        ql_gguf_set_u32(w, key("attention.value_length").c_str(), (uint32_t)c.hd);
    }
    ql_gguf_set_u32(w, key("vocab_size").c_str(), (uint32_t)c.V);
    std::string why;
    if (!hf_tokenizer(dir, cfg, w, &why)) {
        fprintf(stderr, "convert: %s\n", why.c_str());
        return 1;
    }
    if (c.rope_type == "linear") {  // as llama.cpp's converter writes it: positions divided by the factor
        ql_gguf_set_str(w, key("rope.scaling.type").c_str(), "linear");
        ql_gguf_set_f32(w, key("rope.scaling.factor").c_str(), (float)c.linear_factor);
    }
    if (c.rope_type == "llama3") {  // Llama 3.1: per-frequency divisors, as the rope_freqs tensor
        const double factor = c.l3_factor, lo = c.l3_lo, hi = c.l3_hi, old = c.l3_old;  // (read and checked with config.json)
        for (int64_t i = 0; i < c.hd / 2; i++) {
            const double freq = 1.0 / std::pow(c.theta, (double)(2 * i) / (double)c.hd), wavelen = 2 * M_PI / freq;
            if (wavelen < old / hi) rope_factors->push_back(1.0f);
            else if (wavelen > old / lo) rope_factors->push_back((float)factor);
            else {
                const double smooth = (old / wavelen - lo) / (hi - lo);
                rope_factors->push_back((float)(1.0 / ((1 - smooth) / factor + smooth)));
            }
        }
        const int64_t ne[4] = {c.hd / 2, 1, 1, 1};
        ql_gguf_add_tensor(w, "rope_freqs.weight", QL_TYPE_F32, 1, ne, rope_factors->data(), rope_factors->size() * 4);
    }
    return 0;
}

// ./convert hf: config.json checked, the shards found and their tables read, every tensor
// planned and checked, then the GGUF written with the tensors streamed from one shard at a time.
static int convert_hf(const char *dir_c, const char *out, const char *outtype) {
    const std::string dir = dir_c;
    ql_json cfg;
    hf_config c;
    if (const int rc = hf_read_config(dir, &cfg, &c)) return rc;
    const ql_type wtype = hf_outtype(outtype);
    if (wtype == QL_TYPE_COUNT) {
        fprintf(stderr, "convert: --outtype '%s': not a type qlora writes (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, nf4)\n", outtype);
        return 2;
    }
    hf_source src;
    std::vector<std::pair<std::string, size_t>> where;  // HF tensor name -> shard, as the index says
    struct stat sb;
    const bool indexed = stat((dir + "/model.safetensors.index.json").c_str(), &sb) == 0;
    if (const int rc = hf_find_shards(dir, indexed, &src, &where)) return rc;
    if (const int rc = hf_check_output(dir, src, out)) return rc;
    hf_tables tb;
    tb.dir = dir;
    tb.shards = src.shards;
    if (const int rc = hf_read_tables(indexed, where, &tb)) return rc;
    const int64_t first_missing = hf_check_layers(tb, c.L);
    if (first_missing < 0) return 1;
    for (const auto &x : hf_tensor_names(c, std::min(c.L, first_missing + 1), tb.entry_of("lm_head.weight") != nullptr)) {
        hf_tensor t;
        if (const int rc = hf_plan_tensor(c, tb, x, wtype, &t)) return rc;
        src.tensors.push_back(t);
    }
    std::stable_sort(src.tensors.begin(), src.tensors.end(), [](const hf_tensor &a, const hf_tensor &b) { return a.shard < b.shard; });

    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    const std::string arch = c.qwen2 ? "qwen2" : "llama";
    std::vector<float> rope_factors;
    if (const int rc = hf_write_keys(dir, cfg, c, arch, w, &rope_factors)) return rc;
    for (hf_tensor &t : src.tensors)
        if (ql_gguf_add_tensor_gen(w, t.gguf_name.c_str(), t.type, t.n_dims, t.ne, ql_type_data_size(t.type, t.ne[1], t.ne[0]),
                                   hf_fill, &src) != QL_OK) {
            fprintf(stderr, "convert: tensor %s: cannot add\n", t.gguf_name.c_str());
            return 1;
        }
    char err[512];
    if (ql_gguf_write(w, out, err, sizeof(err)) != QL_OK) {  // a tensor's own reason alone, else the writer's
        if (src.err.empty()) fprintf(stderr, "convert: %s\n", err);
        else fprintf(stderr, "convert: %s: %s\n", dir_c, src.err.c_str());
        return 1;
    }
    const bool any_bnb = std::any_of(src.tensors.begin(), src.tensors.end(), [](const hf_tensor &t) { return t.bnb; });
    printf("convert: %s: %s -> %s, dim %lld, %lld layers, %lld/%lld heads, ffn %lld, vocab %lld%s%s, %s weights, %zu shard%s -> %s\n",
           dir_c, c.arch_hf.c_str(), arch.c_str(), (long long)c.E, (long long)c.L, (long long)c.H, (long long)c.HKV, (long long)c.F,
           (long long)c.V, c.tied ? ", tied output" : "", c.rope_type.empty() ? "" : (", " + c.rope_type + " rope scaling").c_str(),
           any_bnb ? "bitsandbytes NF4 (codes carried over)" : outtype, src.shards.size(), src.shards.size() == 1 ? "" : "s", out);
    return 0;
}

// SentencePiece's ModelProto, the fields a vocabulary needs: pieces (1: piece 1, score 2, type
// 3), trainer_spec (2: unk_id 40, bos_id 41, eos_id 42, pad_id 43), normalizer_spec (3:
// add_dummy_prefix 3). A minimal protobuf reader: varints, fixed32, length-delimited.
struct pb {
    const uint8_t *p, *end;
    bool ok = true;
    uint64_t varint() {
        uint64_t v = 0;
        for (int s = 0; s < 64 && p < end; s += 7) {
            const uint8_t b = *p++;
            v |= (uint64_t)(b & 0x7f) << s;
            if (!(b & 0x80)) return v;
        }
        ok = false;
        return 0;
    }
    // the next field: its number and wire type; the payload of a length-delimited one in [*a, *b)
    bool field(uint32_t *num, uint32_t *wt, const uint8_t **a, const uint8_t **b, uint64_t *v) {
        if (p >= end || !ok) return false;
        const uint64_t k = varint();
        *num = (uint32_t)(k >> 3), *wt = (uint32_t)(k & 7);
        if (*wt == 0) *v = varint();
        else if (*wt == 5) {
            if (end - p < 4) return ok = false;
            uint32_t x;
            memcpy(&x, p, 4);
            *v = x, p += 4;
        } else if (*wt == 1) {
            if (end - p < 8) return ok = false;
            memcpy(v, p, 8), p += 8;
        } else if (*wt == 2) {
            const uint64_t n = varint();
            if (!ok || n > (uint64_t)(end - p)) return ok = false;
            *a = p, *b = p + n, p += n;
        } else {
            return ok = false;
        }
        return ok;
    }
};

static bool hf_sentencepiece(const std::string &path, int64_t V, ql_gguf_writer *w, std::string *why) {
    std::vector<uint8_t> buf;
    if (!read_file(path.c_str(), &buf, why)) return false;
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<int32_t> types;
    int64_t unk = 0, bos = 1, eos = 2, pad = -1;
    bool dummy_prefix = true;
    pb r{buf.data(), buf.data() + buf.size()};
    uint32_t num, wt;
    const uint8_t *a = nullptr, *b = nullptr;
    uint64_t v = 0;
    while (r.field(&num, &wt, &a, &b, &v)) {
        if (wt != 2) continue;
        pb s{a, b};
        uint32_t n2, w2;
        const uint8_t *a2 = nullptr, *b2 = nullptr;
        uint64_t v2 = 0;
        if (num == 1) {  // a piece
            std::string piece;
            float score = 0;
            int32_t type = 1;
            while (s.field(&n2, &w2, &a2, &b2, &v2)) {
                if (n2 == 1 && w2 == 2) piece.assign((const char *)a2, (size_t)(b2 - a2));
                else if (n2 == 2 && w2 == 5) { const uint32_t x = (uint32_t)v2; memcpy(&score, &x, 4); }
                else if (n2 == 3 && w2 == 0) type = (int32_t)v2;
            }
            if (!s.ok) break;
            tokens.push_back(piece), scores.push_back(score), types.push_back(type);
        } else if (num == 2) {
            while (s.field(&n2, &w2, &a2, &b2, &v2))
                if (w2 == 0 && n2 >= 40 && n2 <= 43) (n2 == 40 ? unk : n2 == 41 ? bos : n2 == 42 ? eos : pad) = (int64_t)(int32_t)v2;
        } else if (num == 3) {
            while (s.field(&n2, &w2, &a2, &b2, &v2))
                if (n2 == 3 && w2 == 0) dummy_prefix = v2 != 0;
        }
        if (!s.ok) r.ok = false;
    }
    if (!r.ok || tokens.empty()) {
        *why = path + ": not a SentencePiece model (protobuf ModelProto with pieces)";
        return false;
    }
    if ((int64_t)tokens.size() > V) {
        *why = path + ": " + std::to_string(tokens.size()) + " pieces, but config.json's vocab_size is " + std::to_string(V);
        return false;
    }
    for (int64_t i = (int64_t)tokens.size(); i < V; i++)  // the embedding's extra rows: llama.cpp's padding tokens
        tokens.push_back("[PAD" + std::to_string(i) + "]"), scores.push_back(-1000.0f), types.push_back(5);
    std::vector<const char *> tp;
    for (const std::string &t : tokens) tp.push_back(t.c_str());
    ql_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", tp.data(), tp.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.scores", QL_GGUF_F32, scores.data(), scores.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.token_type", QL_GGUF_I32, types.data(), types.size());
    if (unk >= 0) ql_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", (uint32_t)unk);
    if (bos >= 0) ql_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
    if (eos >= 0) ql_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
    if (pad >= 0) ql_gguf_set_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)pad);
    ql_gguf_set_bool(w, "tokenizer.ggml.add_space_prefix", dummy_prefix);
    return true;
}

// The tokens by id, config.json's vocab_size of them: the vocabulary (normal), added tokens
// (control when special, else user-defined), the ids neither names as [PADn] (unused); false
// with why on an id outside the vocabulary size
static bool hf_bpe_tokens(const std::string &path, const ql_json &tj, const ql_json &vocab, int64_t V,
                          std::vector<std::string> *tokens, std::vector<int32_t> *types, std::string *why) {
    tokens->assign((size_t)V, std::string());
    types->assign((size_t)V, 0);
    auto put = [&](const std::string &text, const ql_json &id, int32_t ty) {
        int64_t i = -1;
        if (!id.as_int(&i) || i < 0 || i >= V) {
            *why = path + ": token '" + text + "' has id " + id.str + ", outside config.json's vocab_size " + std::to_string(V);
            return false;
        }
        (*tokens)[(size_t)i] = text, (*types)[(size_t)i] = ty;
        return true;
    };
    for (size_t k = 0; k < vocab.keys.size(); k++)
        if (!put(vocab.keys[k], vocab.items[k], 1)) return false;
    if (const ql_json *added = tj.get("added_tokens"))
        for (const ql_json &t : added->items) {
            const ql_json *c = t.get("content"), *id = t.get("id"), *sp = t.get("special");
            if (c && id && !put(c->str, *id, sp && sp->b ? 3 : 4)) return false;
        }
    for (int64_t i = 0; i < V; i++)
        if (!(*types)[(size_t)i]) (*tokens)[(size_t)i] = "[PAD" + std::to_string(i) + "]", (*types)[(size_t)i] = 5;
    return true;
}

// The merges as "a b": each "a b" (or ["a", "b"]), with a, b and ab all in the vocabulary, as
// tokenizers requires when it loads the file; one that is not is refused here (false with why),
// not when text is tokenized
static bool hf_bpe_merges(const std::string &path, const ql_json &vocab, const ql_json &merges, std::vector<std::string> *ms,
                          std::string *why) {
    std::unordered_set<std::string> known(vocab.keys.begin(), vocab.keys.end());
    for (size_t k = 0; k < merges.items.size(); k++) {
        const ql_json &m = merges.items[k];
        std::string a, b, bad;
        if (m.kind == ql_json::STR) {
            const size_t sp = m.str.find(' ');
            if (sp == std::string::npos || sp == 0 || sp + 1 == m.str.size() || m.str.find(' ', sp + 1) != std::string::npos)
                bad = "is not two tokens separated by one space";
            else a = m.str.substr(0, sp), b = m.str.substr(sp + 1);
        } else if (m.kind == ql_json::ARR && m.items.size() == 2 && m.items[0].kind == ql_json::STR && m.items[1].kind == ql_json::STR &&
                   !m.items[0].str.empty() && !m.items[1].str.empty()) {
            a = m.items[0].str, b = m.items[1].str;
        } else {
            bad = std::string("is ") + (m.kind == ql_json::ARR ? "a list that is not two tokens" : ql_json_kind_name(m.kind)) +
                  ", not \"a b\" or [\"a\", \"b\"]";
        }
        for (const std::string *x : {&a, &b})
            if (bad.empty() && !known.count(*x)) bad = "has '" + ql_printable(*x) + "', which is not in the vocabulary";
        if (bad.empty() && !known.count(a + b)) bad = "makes '" + ql_printable(a + b) + "', which is not in the vocabulary";
        if (!bad.empty()) {
            *why = path + ": merges entry " + std::to_string(k + 1) + (m.kind == ql_json::STR ? " '" + ql_printable(m.str) + "'" : "") + " " + bad;
            return false;
        }
        ms->push_back(a + " " + b);
    }
    return true;
}

// A Unicode normalizer (Qwen2's NFC) is not applied: a warning says so (text already in that
// form tokenizes the same)
static void hf_bpe_warn_normalizer(const std::string &path, const ql_json &tj) {
    std::string form;
    std::function<void(const ql_json &)> find_norm = [&](const ql_json &j) {
        if (j.kind == ql_json::OBJ) {
            const ql_json *t = j.get("type");
            if (t && t->kind == ql_json::STR && (t->str == "NFC" || t->str == "NFD" || t->str == "NFKC" || t->str == "NFKD") && form.empty())
                form = t->str;
            if (const ql_json *list = j.get("normalizers"))
                for (const ql_json &x : list->items) find_norm(x);
        }
    };
    if (const ql_json *nz = tj.get("normalizer")) find_norm(*nz);
    if (!form.empty())
        fprintf(stderr, "convert: warning: %s: its %s normalizer is not applied: text not already in %s may tokenize differently "
                        "from transformers\n", path.c_str(), form.c_str(), form.c_str());
}

// The pre-tokenizer, recognised by its split pattern: llama-bpe, qwen2 or gpt-2; nullptr with why
// for another
static const char *hf_bpe_pre(const std::string &path, const ql_json &tj, std::string *why) {
    std::string pattern;
    std::function<void(const ql_json &)> find = [&](const ql_json &j) {
        if (j.kind == ql_json::OBJ) {
            const ql_json *re = j.get("Regex");
            if (re && re->kind == ql_json::STR && pattern.empty()) pattern = re->str;
            for (const ql_json &x : j.items) find(x);
        } else if (j.kind == ql_json::ARR) {
            for (const ql_json &x : j.items) find(x);
        }
    };
    const ql_json *pre_tok = tj.get("pre_tokenizer");
    if (pre_tok) find(*pre_tok);
    const char *pre = nullptr;
    if (pattern.find("\\p{N}{1,3}") != std::string::npos) pre = "llama-bpe";
    else if (pattern.find("\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*") != std::string::npos) pre = "qwen2";
    else if (pattern.empty() && pre_tok && pre_tok->get("type") && pre_tok->get("type")->str == "ByteLevel") pre = "gpt-2";
    if (!pre)
        *why = path + ": a pre-tokenizer qlora does not know (split pattern '" + pattern.substr(0, 60) +
               "'; known: llama3, qwen2, gpt-2)";
    return pre;
}

// tokenizer.json's byte-level BPE: vocab, merges, added tokens; the pre-tokenizer by its split
static bool hf_bpe(const std::string &path, const ql_json &tj, int64_t V, ql_gguf_writer *w, std::string *why) {
    const ql_json *model = tj.get("model");
    const ql_json *vocab = model ? model->get("vocab") : nullptr, *merges = model ? model->get("merges") : nullptr;
    const ql_json *type = model ? model->get("type") : nullptr;
    if (!model || !type || type->str != "BPE" || !vocab || vocab->kind != ql_json::OBJ || !merges || merges->kind != ql_json::ARR) {
        *why = path + ": not a BPE tokenizer (model.type BPE with vocab and merges)";
        return false;
    }
    std::vector<std::string> tokens, ms;
    std::vector<int32_t> types;
    if (!hf_bpe_tokens(path, tj, *vocab, V, &tokens, &types, why) || !hf_bpe_merges(path, *vocab, *merges, &ms, why)) return false;
    hf_bpe_warn_normalizer(path, tj);
    const char *pre = hf_bpe_pre(path, tj, why);
    if (!pre) return false;
    std::vector<const char *> tp, mp;
    for (const std::string &t : tokens) tp.push_back(t.c_str());
    for (const std::string &m : ms) mp.push_back(m.c_str());
    ql_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    ql_gguf_set_str(w, "tokenizer.ggml.pre", pre);
    ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", tp.data(), tp.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.token_type", QL_GGUF_I32, types.data(), types.size());
    ql_gguf_set_arr_str(w, "tokenizer.ggml.merges", mp.data(), mp.size());
    return true;
}

static bool hf_tokenizer(const std::string &dir, const ql_json &cfg, ql_gguf_writer *w, std::string *why) {
    const int64_t V = (int64_t)cfg.get("vocab_size")->num();
    struct stat sb;
    if (stat((dir + "/tokenizer.json").c_str(), &sb) == 0) {
        ql_json tj;
        if (!read_json_file(dir + "/tokenizer.json", &tj, why)) return false;
        const ql_json *model = tj.get("model");
        const ql_json *type = model ? model->get("type") : nullptr;
        if (type && type->str == "BPE" && model->get("byte_fallback") && model->get("byte_fallback")->b &&
            stat((dir + "/tokenizer.model").c_str(), &sb) == 0) {
            if (!hf_sentencepiece(dir + "/tokenizer.model", V, w, why)) return false;  // SentencePiece as BPE: its model file
        } else if (!hf_bpe(dir + "/tokenizer.json", tj, V, w, why)) {
            return false;
        }
    } else if (stat((dir + "/tokenizer.model").c_str(), &sb) == 0) {
        if (!hf_sentencepiece(dir + "/tokenizer.model", V, w, why)) return false;
    } else {
        *why = dir + ": no tokenizer.json or tokenizer.model";
        return false;
    }
    // ids from config.json (the first of a list), flags and the chat template from tokenizer_config.json
    for (const auto &k : {std::make_pair("bos_token_id", "tokenizer.ggml.bos_token_id"), std::make_pair("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          std::make_pair("pad_token_id", "tokenizer.ggml.padding_token_id")}) {
        const ql_json *v = cfg.get(k.first);
        if (v && v->kind == ql_json::ARR && !v->items.empty()) v = &v->items[0];
        int64_t id = -1;
        if (v && v->kind == ql_json::NUM && v->as_int(&id) && id >= 0 && id < V) {
            ql_gguf_remove_kv(w, k.second);
            ql_gguf_set_u32(w, k.second, (uint32_t)id);
        }
    }
    ql_json tc;
    if (stat((dir + "/tokenizer_config.json").c_str(), &sb) == 0) {
        if (!read_json_file(dir + "/tokenizer_config.json", &tc, why)) return false;
        for (const auto &k : {std::make_pair("add_bos_token", "tokenizer.ggml.add_bos_token"), std::make_pair("add_eos_token", "tokenizer.ggml.add_eos_token")}) {
            const ql_json *v = tc.get(k.first);
            if (v && v->kind == ql_json::BOOL) ql_gguf_set_bool(w, k.second, v->b);
        }
        const ql_json *ct = tc.get("chat_template");
        if (ct && ct->kind == ql_json::STR) ql_gguf_set_str(w, "tokenizer.chat_template", ct->str.c_str());
    }
    return true;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage(argv[0]);
    const std::string mode = argv[1];
    if (mode == "-h" || mode == "--help") {  // asked for: stdout, exit 0
        printf("usage: %s llama2c model.bin tokenizer.bin -o model.gguf\n"
               "         a llama2.c checkpoint (and its tokenizer.bin) as a llama GGUF, f32\n"
               "       %s tiktoken tokenizer.model --pre llama3 -o vocab.gguf\n"
               "         a vocabulary-only GGUF from a tiktoken file (Meta's Llama 3), merges rebuilt from ranks\n"
               "         (--pre llama3 | llama-bpe: the pre-tokenizer recorded in the GGUF)\n"
               "       %s hf DIR -o model.gguf [--outtype f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|nf4]\n"
               "         a Hugging Face checkpoint (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM: config.json,\n"
               "         model.safetensors or its shards, tokenizer.json or tokenizer.model, tokenizer_config.json);\n"
               "         --outtype (default f32) for the block weights (f16/bf16: every matrix)\n",
               argv[0], argv[0], argv[0]);
        return 0;
    }
    std::vector<const char *> pos;
    const char *out = nullptr, *pre = nullptr, *outtype = nullptr;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--outtype") && i + 1 < argc) outtype = argv[++i];
        else if (!strcmp(argv[i], "--pre") && i + 1 < argc) pre = argv[++i];
        else if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--outtype") || !strcmp(argv[i], "--pre")) {
            fprintf(stderr, "convert: %s needs a value\n", argv[i]);
            return usage(argv[0]);
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "convert: unknown flag '%s'\n", argv[i]);
            return usage(argv[0]);
        } else pos.push_back(argv[i]);
    }
    if (!out) {
        fprintf(stderr, "convert: missing -o OUTPUT.gguf\n");
        return usage(argv[0]);
    }
    if (mode == "llama2c") {
        if (pos.size() != 2 || pre) {
            fprintf(stderr, "convert: llama2c takes model.bin and tokenizer.bin%s\n",
                    pre ? ", not --pre" : pos.size() < 2 ? (pos.empty() ? ": both missing" : ": tokenizer.bin missing") : ": one too many");
            return usage(argv[0]);
        }
        if (const int rc = output_path_check("convert", out, {pos[0], pos[1]})) return rc;  // (after the arguments, before any work)
        return convert_llama2c(pos[0], pos[1], out);
    }
    if (mode == "tiktoken") {
        if (pos.size() != 1) return usage(argv[0]);
        if (!pre) {
            fprintf(stderr, "convert: tiktoken needs --pre (llama3)\n");
            return 2;
        }
        if (const int rc = output_path_check("convert", out, {pos[0]})) return rc;
        return convert_tiktoken(pos[0], pre, out);
    }
    if (mode == "hf") {
        if (pos.size() != 1 || pre) {
            fprintf(stderr, "convert: hf takes one checkpoint folder%s\n", pre ? ", not --pre" : pos.empty() ? ": missing" : ": more than one given");
            return usage(argv[0]);
        }
        if (const int rc = output_path_check("convert", out, {pos[0]})) return rc;
        return convert_hf(pos[0], out, outtype ? outtype : "f32");
    }
    fprintf(stderr, "convert: unknown source format '%s' (llama2c, tiktoken, hf)\n", mode.c_str());
    return usage(argv[0]);
}
