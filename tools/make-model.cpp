// tools/make-model - a random-initialised llama in GGUF, for benchmarks, tests and the demo.
//
//   ./make-model -o model.gguf [--dim 288] [--layers 6] [--heads 6] [--kv-heads 6] [--head-dim N] [--ff 768]
//                [--vocab 512] [--ctx 1024] [--type f32|f16|bf16|nf4|q8_0|q4_0|...|q6_K|iq4_xs] [--seed 1] [--std 0.02]
//                [--embd-type f32] [--output-type f32] [--threads 1] [--zero]
//
// The vocabulary is SentencePiece-style ("llama"): <unk> <s> </s>, the 256 byte tokens, the
// printable ASCII characters (" " as "▁"), then "▁"-prefixed characters and filler tokens up to
// --vocab, so any text tokenizes (characters, or bytes as the fallback). Linear weights are
// N(0, std) in --type; norms are 1 and stay f32; the embedding and the output are f32 unless
// --embd-type / --output-type say otherwise (Llama 3 8B's QLoRA shape: --type nf4 --embd-type
// bf16 --output-type bf16, or nf4 as ./quantize --include-output makes it).
//
// Any size: every tensor is drawn, converted and written one at a time at write time
// (ql_gguf_add_tensor_gen), so an 8B model needs memory for its largest tensor, not the model,
// and its bytes reach the disk once. The values are those of ql_llama_randomize on an f32 model
// (one mt19937_64 stream in the same tensor order), then converted. With --threads N > 1 (for the
// 8B shapes: the one stream is most of the time) each tensor's values come from streams of 2^20
// values each, seeded from the one stream: other values (the same for any N > 1), drawn and
// converted in parallel.
//
// --zero: every weight 0 (norms 1), in the types asked for - a file to plan with (`finetune
// --dry-run` reads shapes, not values): the GGUF writer skips pages of zeros, so a 70B-shaped
// file is written in seconds and takes next to no disk, while reading back as a complete file.
#include "../models/llama.h"
#include "../qlora.h"
#include "cli.h"
#include "own.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s -o model.gguf [--dim N] [--layers N] [--heads N] [--kv-heads N] [--head-dim N] [--ff N] [--vocab N] [--ctx N]\n"
            "       [--type f32|f16|bf16|nf4|q8_0|q4_0|...|q6_K|iq4_xs] [--seed S] [--std X] [--embd-type T] [--output-type T]\n"
            "       [--threads N]  (N > 1: faster, other random values - the same for any N > 1)\n"
            "       [--zero]  (every weight 0: a sparse file for planning shapes, e.g. finetune --dry-run)\n",
            argv0);
    return 2;
}

static void write_vocab(ql_gguf_writer *w, int n_vocab) {
    std::vector<std::string> tok;
    std::vector<float> score;
    std::vector<int32_t> type;
    auto add = [&](const std::string &t, float s, int ty) {
        tok.push_back(t);
        score.push_back(s);
        type.push_back(ty);
    };
    add("<unk>", 0, 2);
    add("<s>", 0, 3);
    add("</s>", 0, 3);
    for (int b = 0; b < 256; b++) {
        char piece[8];
        snprintf(piece, sizeof(piece), "<0x%02X>", b);
        add(piece, 0, 6);
    }
    for (int c = 32; c < 127 && (int)tok.size() < n_vocab; c++)  // characters; space as SentencePiece's "▁"
        add(c == ' ' ? std::string("\xe2\x96\x81") : std::string(1, (char)c), -1.0f - (float)c / 1000.0f, 1);
    for (int c = 33; c < 127 && (int)tok.size() < n_vocab; c++)  // a word start: "▁x"
        add(std::string("\xe2\x96\x81") + (char)c, -0.5f - (float)c / 1000.0f, 1);
    for (int i = 0; (int)tok.size() < n_vocab; i++) add("<extra_" + std::to_string(i) + ">", -1e9f, 5);
    std::vector<const char *> ptr;
    for (const std::string &t : tok) ptr.push_back(t.c_str());
    ql_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", ptr.data(), ptr.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.scores", QL_GGUF_F32, score.data(), score.size());
    ql_gguf_set_arr(w, "tokenizer.ggml.token_type", QL_GGUF_I32, type.data(), type.size());
    ql_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    ql_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    ql_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    ql_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
    ql_gguf_set_bool(w, "tokenizer.ggml.add_eos_token", false);
}

// One stream of N(0, std) values over the weights in ql_llama_randomize's order (norms draw
// nothing: they are 1), each tensor converted to its type as the writer asks for it.
struct gen_state {
    std::mt19937_64 rng;
    float std;
    int threads;
    std::vector<float> f32;  // one tensor's values before conversion (the largest, reused)
    bool zero = false;       // --zero: every weight 0 (the norms 1)
    std::map<std::string, std::vector<char>> side;  // --zero: NF4's side data of zeros, by type and shape
};
struct gen_tensor {
    gen_state *g;
    const ql_tensor *t;
    ql_type type;
};

// --zero: zeros in any type; NF4's side data after its rows is what the quantiser makes of zeros
// (the codes of 0 themselves are not 0 bits: the rows are written as code 0 times absmax 0 = -0)
static bool fill_zero(gen_tensor &x, void *dst, size_t size) {
    if (ql_n_dims(x.t) == 1) {
        std::fill((float *)dst, (float *)dst + ql_nelements(x.t), 1.0f);
        return size == (size_t)ql_nelements(x.t) * 4;
    }
    const int64_t rows = x.t->ne[1], ne0 = x.t->ne[0];
    const size_t row_part = ql_row_size(x.type, ne0) * (size_t)rows;
    memset(dst, 0, size);
    if (size == row_part) return true;
    const std::string key = std::string(ql_type_name(x.type)) + " " + std::to_string(ne0) + " " + std::to_string(rows);
    std::vector<char> &side = x.g->side[key];
    if (side.empty()) {
        std::vector<float> z((size_t)(rows * ne0), 0.0f);
        std::vector<char> q(size);
        char err[256];
        if (ql_quantize(x.type, z.data(), rows, ne0, q.data(), err, sizeof(err)) != QL_OK) {
            fprintf(stderr, "make-model: tensor %s: %s\n", x.t->name, err);
            return false;
        }
        side.assign(q.begin() + (ptrdiff_t)row_part, q.end());
    }
    memcpy((char *)dst + row_part, side.data(), side.size());
    return row_part + side.size() == size;
}

static bool fill_tensor(void *arg, void *dst, size_t size) {
    gen_tensor &x = *(gen_tensor *)arg;
    if (x.g->zero) return fill_zero(x, dst, size);
    const int64_t n = ql_nelements(x.t);
    float *v = x.type == QL_TYPE_F32 ? (float *)dst : nullptr;
    if (!v) {
        x.g->f32.resize((size_t)n);
        v = x.g->f32.data();
    }
    if (ql_n_dims(x.t) == 1) {
        std::fill(v, v + n, 1.0f);
    } else if (x.g->threads == 1) {
        std::normal_distribution<float> N(0.0f, x.g->std);  // a fresh one per tensor, as ql_llama_randomize
        for (int64_t i = 0; i < n; i++) v[i] = N(x.g->rng);
    } else {
        const uint64_t seed = x.g->rng();
        const int64_t blk = (int64_t)1 << 20, nblk = (n + blk - 1) / blk;
        std::vector<std::thread> pool;
        for (int t = 0; t < x.g->threads; t++)
            pool.emplace_back([&, t] {
                for (int64_t b = t; b < nblk; b += x.g->threads) {
                    std::mt19937_64 r(seed ^ ((uint64_t)(b + 1) * 0x9E3779B97F4A7C15ull));
                    std::normal_distribution<float> N(0.0f, x.g->std);
                    for (int64_t i = b * blk; i < std::min(n, (b + 1) * blk); i++) v[i] = N(r);
                }
            });
        for (std::thread &th : pool) th.join();
    }
    if (x.type == QL_TYPE_F32) return size == ql_type_data_size(x.type, x.t->ne[1], x.t->ne[0]);
    // whole rows per thread where the type has no side data after the rows (NF4's double quantisation has)
    const ql_type_traits *tt = ql_type_traits_get(x.type);
    const int64_t rows = x.t->ne[1], ne0 = x.t->ne[0];
    const int nt = tt->aux_bytes ? 1 : (int)std::min<int64_t>(x.g->threads, rows);
    std::vector<std::string> errs((size_t)nt);
    std::vector<std::thread> pool;
    for (int t = 0; t < nt; t++) {
        auto work = [&, t] {
            const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
            char err[256];
            char *d = (char *)dst + (r0 ? ql_type_data_size(x.type, r0, ne0) : 0);  // (side data: one range, at 0)
            if (ql_quantize(x.type, v + r0 * ne0, r1 - r0, ne0, d, err, sizeof(err)) != QL_OK)
                errs[(size_t)t] = err;
        };
        if (nt == 1) work();
        else pool.emplace_back(work);
    }
    for (std::thread &th : pool) th.join();
    for (const std::string &e : errs)
        if (!e.empty()) {
            fprintf(stderr, "make-model: tensor %s: %s\n", x.t->name, e.c_str());
            return false;
        }
    return size == ql_type_data_size(x.type, x.t->ne[1], x.t->ne[0]);
}

// what the command line asks for
struct mm_args {
    const char *out = nullptr, *type_name = "f32", *embd_name = "f32", *output_name = "f32";
    long dim = 288, layers = 6, heads = 6, kv_heads = -1, head_dim = 0, ff = 768, vocab = 512, ctx_len = 1024, seed = 1, threads = 1;
    double std_dev = 0.02;
    bool zero = false;
};

// The flags into o (--kv-heads defaults to --heads): -1 to go on, else the exit code (0 for
// --help) after the usage or the message; a bad number exits 2 at once.
static int parse_args(int argc, char **argv, mm_args *o) {
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (a == "--zero") {
            o->zero = true;
            continue;
        }
        if (i + 1 >= argc && a != "-h" && a != "--help") {
            fprintf(stderr, "make-model: '%s' needs a value\n", argv[i]);
            return usage(argv[0]);
        }
        auto num = [&](long *v, long lo, long hi) {
            char *end = nullptr;
            const long x = strtol(argv[++i], &end, 10);
            if (!end || *end || x < lo || x > hi) {
                fprintf(stderr, "make-model: %s: '%s' is not an integer in [%ld, %ld]\n", a.c_str(), argv[i], lo, hi);
                exit(2);
            }
            *v = x;
        };
        if (a == "-o") o->out = argv[++i];
        else if (a == "--dim") num(&o->dim, 2, 1 << 16);
        else if (a == "--layers") num(&o->layers, 1, 1024);
        else if (a == "--heads") num(&o->heads, 1, 1024);
        else if (a == "--kv-heads") num(&o->kv_heads, 1, 1024);
        else if (a == "--head-dim") num(&o->head_dim, 2, 512);
        else if (a == "--ff") num(&o->ff, 1, 1 << 18);
        else if (a == "--vocab") num(&o->vocab, 259 + 95, 1 << 20);
        else if (a == "--ctx") num(&o->ctx_len, 1, 1 << 24);
        else if (a == "--seed") num(&o->seed, 0, 1L << 62);
        else if (a == "--threads") num(&o->threads, 1, 256);
        else if (a == "--type") o->type_name = argv[++i];
        else if (a == "--embd-type") o->embd_name = argv[++i];
        else if (a == "--output-type") o->output_name = argv[++i];
        else if (a == "--std") {
            o->std_dev = strtod(argv[++i], nullptr);
            if (!(o->std_dev > 0 && o->std_dev < 10)) {
                fprintf(stderr, "make-model: --std must be in (0, 10)\n");
                return 2;
            }
        } else if (a == "-h" || a == "--help") {
            usage(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "make-model: unknown flag '%s'\n", argv[i]);
            return usage(argv[0]);
        }
    }
    if (!o->out) {
        fprintf(stderr, "make-model: -o model.gguf is required\n");
        return usage(argv[0]);
    }
    if (const int rc = output_path_check("make-model", o->out, {})) return rc;
    if (o->kv_heads < 0) o->kv_heads = o->heads;
    return -1;
}

// a type flag's value: a float type with a quantiser; otherwise the known names and exit 2
static ql_type type_of(const char *flag, const char *name) {
    for (int t = 0; t < QL_TYPE_COUNT; t++) {
        const ql_type_traits *tt = ql_type_traits_get((ql_type)t);
        if (tt && tt->is_float && (tt->from_float || tt->aux_bytes) && !strcmp(tt->name, name)) return (ql_type)t;
    }
    std::string known;
    for (int t = 0; t < QL_TYPE_COUNT; t++) {
        const ql_type_traits *tt = ql_type_traits_get((ql_type)t);
        if (tt && tt->is_float && (tt->from_float || tt->aux_bytes)) known += std::string(known.empty() ? "" : ", ") + tt->name;
    }
    fprintf(stderr, "make-model: unknown %s '%s' (%s)\n", flag, name, known.c_str());
    exit(2);
}

// the model's keys (llama's sizes, norm epsilon, rope base) and its byte vocabulary
static void write_keys(ql_gguf_writer *w, const mm_args &o) {
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_str(w, "general.name", "random llama (make-model)");
    ql_gguf_set_u32(w, "llama.context_length", (uint32_t)o.ctx_len);
    ql_gguf_set_u32(w, "llama.embedding_length", (uint32_t)o.dim);
    ql_gguf_set_u32(w, "llama.block_count", (uint32_t)o.layers);
    ql_gguf_set_u32(w, "llama.feed_forward_length", (uint32_t)o.ff);
    ql_gguf_set_u32(w, "llama.attention.head_count", (uint32_t)o.heads);
    ql_gguf_set_u32(w, "llama.attention.head_count_kv", (uint32_t)o.kv_heads);
    if (o.head_dim > 0) {  // heads * head_dim need not be dim (Mistral-Nemo's shape)
        ql_gguf_set_u32(w, "llama.attention.key_length", (uint32_t)o.head_dim);
        ql_gguf_set_u32(w, "llama.attention.value_length", (uint32_t)o.head_dim);
    }
    ql_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    ql_gguf_set_f32(w, "llama.rope.freq_base", 10000.0f);
    write_vocab(w, (int)o.vocab);
}

int main(int argc, char **argv) {
    const auto t0 = std::chrono::steady_clock::now();
    mm_args o;
    if (const int rc = parse_args(argc, argv, &o); rc >= 0) return rc;
    const ql_type wtype = type_of("--type", o.type_name), etype = type_of("--embd-type", o.embd_name),
                  otype = type_of("--output-type", o.output_name);
    ql_llama_hparams hp;
    hp.n_vocab = (int)o.vocab;
    hp.n_embd = (int)o.dim;
    hp.n_layer = (int)o.layers;
    hp.n_head = (int)o.heads;
    hp.n_head_kv = (int)o.kv_heads;
    hp.n_ff = (int)o.ff;
    hp.n_embd_head = (int)o.head_dim;
    // the shapes and names only: the values are made as each tensor is written
    ql_init_params ip = {(size_t)(o.layers * 16 + 16) * ql_tensor_overhead(), nullptr, true, false};
    ql_context *ctx = ql_init(ip);
    owned<ql_context> ctx_(ctx, ql_free);
    ql_llama m;
    if (!ctx || ql_llama_create(ctx, &m, hp, QL_TYPE_F32, false) != QL_OK) {
        fprintf(stderr, "make-model: %s\n", ctx ? ql_ctx_error(ctx) : "out of memory");
        return 2;
    }
    gen_state g{std::mt19937_64((uint64_t)o.seed), (float)o.std_dev, (int)o.threads, {}, o.zero, {}};

    ql_gguf_writer *w = ql_gguf_writer_new();
    owned<ql_gguf_writer> w_(w, ql_gguf_writer_free);
    write_keys(w, o);
    std::vector<gen_tensor> gens;
    gens.reserve((size_t)(o.layers * 9 + 3));  // stable addresses: the writer keeps pointers to them
    char err[512];
    auto add = [&](ql_tensor *t, ql_type type) {
        if (t->ne[0] % ql_type_traits_get(type)->blck_size != 0) type = QL_TYPE_F32;  // a row the type cannot hold
        const int64_t ne[4] = {t->ne[0], t->ne[1], 1, 1};
        gens.push_back({&g, t, type});
        if (ql_gguf_add_tensor_gen(w, t->name, type, ql_n_dims(t), ne, ql_type_data_size(type, t->ne[1], t->ne[0]), fill_tensor,
                                   &gens.back()) != QL_OK) {
            fprintf(stderr, "make-model: tensor %s: cannot add\n", t->name);
            exit(1);
        }
    };
    add(m.tok_embd, etype);
    add(m.out_norm, QL_TYPE_F32);
    add(m.output, otype);
    for (ql_llama_layer &L : m.layers) {
        add(L.attn_norm, QL_TYPE_F32);
        add(L.ffn_norm, QL_TYPE_F32);
        for (ql_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) add(t, wtype);
    }
    if (ql_gguf_write(w, o.out, err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "make-model: %s\n", err);
        return 1;
    }
    printf("make-model: %s: dim %ld, %ld layers, %ld/%ld heads of %d, ffn %ld, vocab %ld, %s linear weights, embedding %s, output %s%s "
           "(%.2f s)\n", o.out, o.dim, o.layers, o.heads, o.kv_heads, hp.head_dim(), o.ff, o.vocab, ql_type_name(wtype),
           ql_type_name(etype), ql_type_name(otype), o.zero ? ", all zero" : "", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
}
