// tools/convert - other formats to GGUF.
//
//   ./convert llama2c model.bin tokenizer.bin -o model.gguf
//       a llama2.c legacy checkpoint (f32, Meta's rope layout) and its tokenizer.bin
//   ./convert tiktoken tokenizer.model --pre llama3 -o vocab.gguf
//       a vocabulary-only GGUF from a tiktoken file (Meta's Llama 3), merges rebuilt from ranks
#include "../models/tokenizer.h"
#include "../qlora.h"
#include "own.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s llama2c model.bin tokenizer.bin -o model.gguf\n"
            "       %s tiktoken tokenizer.model --pre llama3 -o vocab.gguf\n",
            argv0, argv0);
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

// llama2.c legacy checkpoint: 7 x i32 header, then f32 arrays (REFERENCE.md section 11)
static int convert_llama2c(const char *model, const char *tok, const char *out) {
    std::vector<uint8_t> buf;
    std::string why;
    if (!read_file(model, &buf, &why)) {
        fprintf(stderr, "convert: %s\n", why.c_str());
        return 1;
    }
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
    const float *p = (const float *)(buf.data() + 28);
    auto take = [&](int64_t n) {
        const float *r = p;
        p += n;
        return r;
    };
    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_str(w, "general.name", "llama2.c checkpoint");
    ql_gguf_set_u32(w, "general.file_type", 0);  // all f32
    ql_gguf_set_u32(w, "llama.context_length", (uint32_t)seq);
    ql_gguf_set_u32(w, "llama.embedding_length", (uint32_t)dim);
    ql_gguf_set_u32(w, "llama.block_count", (uint32_t)L);
    ql_gguf_set_u32(w, "llama.feed_forward_length", (uint32_t)hidden);
    ql_gguf_set_u32(w, "llama.attention.head_count", (uint32_t)heads);
    ql_gguf_set_u32(w, "llama.attention.head_count_kv", (uint32_t)kv_heads);
    ql_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    ql_gguf_set_f32(w, "llama.rope.freq_base", 10000.0f);
    ql_gguf_set_u32(w, "llama.rope.dimension_count", (uint32_t)hs);
    char err[512];
    if (ql_vocab_from_llama2c(tok, w, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    // llama2.c matrices are [out, in] row-major = GGUF ne [in, out]; already in Meta's rope layout
    auto add = [&](const std::string &name, const float *data, int64_t ne0, int64_t ne1) {
        const int64_t ne[4] = {ne0, ne1, 1, 1};
        if (ql_gguf_add_tensor(w, name.c_str(), QL_TYPE_F32, ne1 > 1 ? 2 : 1, ne, data, (size_t)(ne0 * ne1) * 4) != QL_OK) {
            fprintf(stderr, "convert: cannot add tensor %s\n", name.c_str());
            exit(1);
        }
    };
    const float *emb = take(vocab * dim);
    add("token_embd.weight", emb, dim, vocab);
    const float *rms_att = take(L * dim), *wq = take(L * dim * dim), *wk = take(L * kv_dim * dim),
                *wv = take(L * kv_dim * dim), *wo = take(L * dim * dim), *rms_ffn = take(L * dim),
                *w1 = take(L * hidden * dim), *w2 = take(L * dim * hidden), *w3 = take(L * hidden * dim);
    for (int64_t l = 0; l < L; l++) {
        const std::string b = "blk." + std::to_string(l) + ".";
        add(b + "attn_norm.weight", rms_att + l * dim, dim, 1);
        add(b + "attn_q.weight", wq + l * dim * dim, dim, dim);
        add(b + "attn_k.weight", wk + l * kv_dim * dim, dim, kv_dim);
        add(b + "attn_v.weight", wv + l * kv_dim * dim, dim, kv_dim);
        add(b + "attn_output.weight", wo + l * dim * dim, dim, dim);
        add(b + "ffn_norm.weight", rms_ffn + l * dim, dim, 1);
        add(b + "ffn_gate.weight", w1 + l * hidden * dim, dim, hidden);
        add(b + "ffn_down.weight", w2 + l * dim * hidden, hidden, dim);
        add(b + "ffn_up.weight", w3 + l * hidden * dim, dim, hidden);
    }
    add("output_norm.weight", take(dim), dim, 1);
    take(seq * hs);  // legacy rope tables: recomputed, not stored
    if (!shared) add("output.weight", take(vocab * dim), dim, vocab);
    if (ql_gguf_write(w, out, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "convert: %s\n", err);
        return 1;
    }
    w_.reset();
    // the vocabulary must cover the model's embedding rows
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
    printf("convert: %s: llama, dim %lld, %lld layers, %lld/%lld heads, ffn %lld, vocab %lld, context %lld%s -> %s\n",
           model, (long long)dim, (long long)L, (long long)heads, (long long)kv_heads, (long long)hidden,
           (long long)vocab, (long long)seq, shared ? ", tied output" : "", out);
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

int main(int argc, char **argv) {
    if (argc < 2) return usage(argv[0]);
    const std::string mode = argv[1];
    if (mode == "-h" || mode == "--help") {  // asked for: stdout, exit 0
        printf("usage: %s llama2c model.bin tokenizer.bin -o model.gguf\n"
               "         a llama2.c checkpoint (and its tokenizer.bin) as a llama GGUF, f32\n"
               "       %s tiktoken tokenizer.model --pre llama3 -o vocab.gguf\n"
               "         a vocabulary-only GGUF from a tiktoken file (Meta's Llama 3), merges rebuilt from ranks\n"
               "         (--pre llama3 | llama-bpe: the pre-tokenizer recorded in the GGUF)\n",
               argv[0], argv[0]);
        return 0;
    }
    std::vector<const char *> pos;
    const char *out = nullptr, *pre = nullptr;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--pre") && i + 1 < argc) pre = argv[++i];
        else if (argv[i][0] == '-') {
            fprintf(stderr, "convert: unknown flag '%s'\n", argv[i]);
            return usage(argv[0]);
        } else pos.push_back(argv[i]);
    }
    if (!out) {
        fprintf(stderr, "convert: missing -o OUTPUT.gguf\n");
        return usage(argv[0]);
    }
    if (mode == "llama2c") {
        if (pos.size() != 2 || pre) return usage(argv[0]);
        return convert_llama2c(pos[0], pos[1], out);
    }
    if (mode == "tiktoken") {
        if (pos.size() != 1) return usage(argv[0]);
        if (!pre) {
            fprintf(stderr, "convert: tiktoken needs --pre (llama3)\n");
            return 2;
        }
        return convert_tiktoken(pos[0], pre, out);
    }
    fprintf(stderr, "convert: unknown source format '%s' (llama2c, tiktoken)\n", mode.c_str());
    return usage(argv[0]);
}
