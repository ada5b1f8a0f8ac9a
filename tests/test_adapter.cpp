// Adapter files: safetensors (round trips and a corpus of damaged files), llama.cpp adapter
// GGUFs, PEFT folders (the q/k row permutation checked against an independent implementation),
// merged models (logits against the unmerged adapters).
#include "../models/adapter.h"
#include "../models/llama.h"
#include "../qlora.h"
#include "tiny.h"
#include "util.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

// a tiny llama (GQA: 4 query heads, 2 kv heads of 16) with weights N(0, 0.1) in ctx; rows of 64
// so any linear weight can be stored as NF4
struct model : tiny_llama {
    ql_context *lctx = nullptr;  // adapters
    explicit model(int n_layer = 2, uint64_t seed = 1, int rope_mode = QL_ROPE_NORMAL)
        : tiny_llama(tiny_hparams(96, 64, 128, n_layer), seed, 0.1f) {
        m.hp.rope_mode = rope_mode;
        ql_init_params ip = {16u << 20, nullptr, false, false};
        lctx = ql_init(ip);
    }
    ~model() { ql_free(lctx); }
    ql_tensor *weight(const std::string &name) const {
        if (name == m.output->name) return m.output;
        for (const ql_llama_layer &L : m.layers)
            for (ql_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down})
                if (name == t->name) return t;
        return nullptr;
    }
    std::vector<ql_tensor *> linears(bool with_output) const {
        std::vector<ql_tensor *> v;
        for (const ql_llama_layer &L : m.layers)
            for (ql_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down}) v.push_back(t);
        if (with_output) v.push_back(m.output);
        return v;
    }
};

// random A [in, r], B [r, out] (B non-zero, unlike a fresh PEFT init) on each weight, in ctx
void add_pairs(ql_context *ctx, ql_llama &m, const std::vector<ql_tensor *> &ws, int r, float scale, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> N(0.0f, 0.1f);
    for (ql_tensor *w : ws) {
        ql_lora_pair p;
        p.a = ql_format_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, w->ne[0], r), "%s.a", w->name);
        p.b = ql_format_name(ql_new_tensor_2d(ctx, QL_TYPE_F32, r, w->ne[1]), "%s.b", w->name);
        REQUIRE(p.a);
        REQUIRE(p.b);
        for (int64_t i = 0; i < ql_nelements(p.a); i++) ((float *)p.a->data)[i] = N(rng);
        for (int64_t i = 0; i < ql_nelements(p.b); i++) ((float *)p.b->data)[i] = N(rng);
        p.scale = scale;
        m.lora[w] = p;
    }
}

bool same_bytes(const ql_tensor *x, const ql_tensor *y) {
    return x && y && ql_same_shape(x, y) && x->type == y->type && memcmp(x->data, y->data, ql_nbytes(x)) == 0;
}

// the HF -> GGUF row order of convert_hf_to_gguf.py's LlamaModel.permute, written as numpy
// would run it: rows viewed as [n_head][2][hd/2], axes 1 and 2 swapped, flattened. Entry g is
// the HF row that GGUF row g holds.
std::vector<int64_t> hf_row_of_gguf_row(int64_t n_rows, int n_head) {
    const int64_t hd = n_rows / n_head;
    std::vector<int64_t> v;
    for (int64_t h = 0; h < n_head; h++)          // axis 0
        for (int64_t j = 0; j < hd / 2; j++)      // axis 2 (now second)
            for (int64_t s = 0; s < 2; s++)       // axis 1 (now last)
                v.push_back(h * hd + s * (hd / 2) + j);
    return v;
}

// a safetensors file from a header text and a data size (data bytes 0, 1, 2, ...)
std::vector<uint8_t> st_bytes(const std::string &header, size_t data, int64_t len_override = -1) {
    std::vector<uint8_t> b(8 + header.size() + data);
    const uint64_t n = len_override >= 0 ? (uint64_t)len_override : header.size();
    for (int i = 0; i < 8; i++) b[(size_t)i] = (uint8_t)(n >> (8 * i));
    if (!header.empty()) memcpy(&b[8], header.data(), header.size());
    for (size_t i = 0; i < data; i++) b[8 + header.size() + i] = (uint8_t)i;
    return b;
}

const float k_scale = 8.0f / 4.0f;  // alpha 8, r 4

ql_lora_config config(int r = 4, float alpha = 8.0f, bool rslora = false) {
    ql_lora_config c;
    c.r = r;
    c.alpha = alpha;
    c.rslora = rslora;
    c.dropout = 0.05f;
    c.base_model = "org/tiny-llama";
    return c;
}

}  // namespace

// ---- safetensors ----

TEST_CASE("safetensors: F32, F16 and BF16 tensors and metadata round trip bit for bit") {
    tmpdir d;
    const std::string path = d.path + "/t.safetensors";
    std::vector<float> f32(15);
    std::vector<uint16_t> f16(7), bf16(6);
    for (size_t i = 0; i < f32.size(); i++) f32[i] = 0.25f * (float)i - 1.5f;
    for (size_t i = 0; i < f16.size(); i++) f16[i] = ql_fp32_to_fp16((float)i / 3.0f);
    for (size_t i = 0; i < bf16.size(); i++) bf16[i] = ql_fp32_to_bf16(-(float)i * 1.7f);
    std::vector<ql_st_tensor> in(5);
    in[0] = {"half", "F16", {7}, f16.data()};  // 14 bytes: a writer must not misalign the f32 data after it
    in[1] = {"weight", "F32", {3, 5}, f32.data()};
    in[2] = {"brain", "BF16", {2, 3}, bf16.data()};
    in[3] = {"empty", "F32", {0, 4}, nullptr};
    in[4] = {"scalar", "F32", {}, f32.data() + 3};
    const std::vector<std::pair<std::string, std::string>> meta = {{"format", "pt"},
                                                                   {"note", "quote \" back\\slash \n \xc3\xbc\x01"}};
    std::string err;
    REQUIRE_MESSAGE(ql_safetensors_write(path.c_str(), in, meta, &err), err);
    CHECK_FALSE(exists(path + ".tmp"));
    {  // written by a rename: refused where a link or a FIFO is, which stays as it was
        const std::string link = d.path + "/link.safetensors", fifo = d.path + "/w.fifo";
        REQUIRE(symlink(path.c_str(), link.c_str()) == 0);
        REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
        for (const std::string &p : {link, fifo}) {
            std::string e;
            CHECK_FALSE(ql_safetensors_write(p.c_str(), in, meta, &e));
            CHECK_MESSAGE(has(e, p + ": exists and is not a regular file"), e);
        }
        struct stat st;
        CHECK((lstat(link.c_str(), &st) == 0 && S_ISLNK(st.st_mode)));
        CHECK((lstat(fifo.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)));
    }

    const std::vector<uint8_t> raw = read_file_bytes(path);
    REQUIRE(raw.size() > 8);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)raw[(size_t)i] << (8 * i);
    CHECK(n % 8 == 0);
    CHECK(raw[8] == '{');

    std::vector<ql_st_tensor> out;
    std::vector<uint8_t> storage;
    std::vector<std::pair<std::string, std::string>> meta2;
    REQUIRE_MESSAGE(ql_safetensors_read(path.c_str(), &out, &storage, &err, &meta2), err);
    CHECK(meta2 == meta);
    REQUIRE(out.size() == in.size());
    for (const ql_st_tensor &t : in) {
        const ql_st_tensor *u = nullptr;
        for (const ql_st_tensor &x : out)
            if (x.name == t.name) u = &x;
        REQUIRE_MESSAGE(u, t.name);
        CHECK(u->dtype == t.dtype);
        CHECK(u->shape == t.shape);
        size_t bytes = t.dtype == "F32" ? 4 : 2;
        for (int64_t s : t.shape) bytes *= (size_t)s;
        if (bytes) CHECK(memcmp(u->data, t.data, bytes) == 0);
        if (t.dtype == "F32" && bytes) CHECK(((const uint8_t *)u->data - storage.data() - 8 - (int64_t)n) % 4 == 0);
    }
    // without the metadata argument too
    REQUIRE(ql_safetensors_read(path.c_str(), &out, &storage, &err));
    CHECK(out.size() == 5);
}

TEST_CASE("safetensors: damaged files fail with a message naming the file and the fault, never a crash") {
    tmpdir d;
    const std::string t24 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}";
    struct bad_case {
        const char *what;
        std::vector<uint8_t> bytes;
        const char *says;
    };
    std::string deep(5000, '[');
    deep = "{\"a\":" + deep + std::string(5000, ']') + "}";
    std::vector<uint8_t> valid = st_bytes(t24, 24);
    std::vector<uint8_t> truncated(valid.begin(), valid.begin() + 30);
    std::vector<uint8_t> bad_utf8 = st_bytes("{\"\xff\":{}}", 0);
    const bad_case cases[] = {
        {"too short", {1, 2, 3}, "too short"},
        {"truncated header", truncated, "past the end of the file"},
        {"header too long", st_bytes(t24, 24, (int64_t)1 << 40), "over the"},
        {"empty header", st_bytes("", 0), "does not start with '{'"},
        {"not an object", st_bytes("[1, 2]  ", 0), "does not start with '{'"},
        {"bad JSON", st_bytes("{\"a\":{\"dtype\":\"F32\",", 0), "bad JSON"},
        {"bad JSON literal", st_bytes("{\"a\":tru}", 0), "bad JSON"},
        {"trailing garbage", st_bytes("{} x", 0), "unexpected 'x' after the value"},
        {"duplicate key", st_bytes("{\"a\":{},\"a\":{}}", 0), "duplicate key"},
        {"invalid UTF-8", bad_utf8, "UTF-8"},
        {"deep nesting", st_bytes(deep, 0), "nested deeper than 64 levels"},
        {"offsets past the data", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[100],\"data_offsets\":[0,400]}}", 16),
         "run past"},
        {"end before begin", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8), "end before"},
        {"overlapping", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                                 "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24), "overlaps"},
        {"gap", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20), "belong to no tensor"},
        {"bytes after the last tensor", st_bytes(t24, 28), "after the last tensor"},
        {"unknown dtype", st_bytes("{\"big\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]}}", 16),
         "tensor big has dtype I64"},
        {"size mismatch", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,16]}}", 16), "needs 24 bytes"},
        {"shape overflow", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,16]}}", 16),
         "data_offsets give 16"},
        {"negative dimension", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,0]}}", 0), "non-negative"},
        {"fractional offset", st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}}", 4), "non-negative integers"},
        {"missing dtype", st_bytes("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4), "missing dtype"},
        {"metadata not strings", st_bytes("{\"__metadata__\":{\"n\":1}}", 0), "not a string"},
        {"entry not an object", st_bytes("{\"a\":3}", 0), "not an object"},
    };
    {  // a FIFO: refused at once, not waited on for a writer
        const std::string fifo = d.path + "/fifo.safetensors";
        REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
        std::vector<ql_st_tensor> ts;
        std::vector<uint8_t> storage;
        std::string err;
        CHECK_FALSE(ql_safetensors_read(fifo.c_str(), &ts, &storage, &err));
        CHECK_MESSAGE(has(err, fifo + ": not a regular file"), err);
    }
    for (const bad_case &c : cases) {
        CAPTURE(c.what);
        const std::string path = d.path + "/bad.safetensors";
        write_file(path, c.bytes.data(), c.bytes.size());
        std::vector<ql_st_tensor> ts;
        std::vector<uint8_t> storage;
        std::string err;
        CHECK_FALSE(ql_safetensors_read(path.c_str(), &ts, &storage, &err));
        CAPTURE(err);
        CHECK(has(err, "bad.safetensors"));
        CHECK(has(err, c.says));
    }
    std::vector<ql_st_tensor> ts;
    std::vector<uint8_t> storage;
    std::string err;
    CHECK_FALSE(ql_safetensors_read((d.path + "/none.safetensors").c_str(), &ts, &storage, &err));
    CHECK(has(err, "none.safetensors"));
    // the valid file reads; random damage to it either reads or fails cleanly
    const std::string path = d.path + "/fuzz.safetensors";
    write_file(path, valid.data(), valid.size());
    REQUIRE_MESSAGE(ql_safetensors_read(path.c_str(), &ts, &storage, &err), err);
    std::mt19937 rng(7);
    for (int it = 0; it < 300; it++) {
        std::vector<uint8_t> b = valid;
        const int flips = 1 + (int)(rng() % 4);
        for (int k = 0; k < flips; k++) b[rng() % b.size()] = (uint8_t)rng();
        if (rng() % 4 == 0) b.resize(rng() % b.size());
        write_file(path, b.data(), b.size());
        err.clear();
        if (!ql_safetensors_read(path.c_str(), &ts, &storage, &err)) CHECK(has(err, "fuzz.safetensors"));
    }
}

// ---- llama.cpp adapter GGUF ----

TEST_CASE("adapter: a llama.cpp LoRA GGUF round trips through ql_llama_attach_lora") {
    tmpdir d;
    model a;
    add_pairs(a.lctx, a.m, a.linears(true), 4, k_scale, 11);
    const std::string path = d.path + "/lora.gguf";
    std::string err;
    REQUIRE_MESSAGE(ql_lora_save_gguf(path.c_str(), a.m, "llama", config(), &err), err);

    // what llama.cpp reads: the KVs, "<weight>.lora_a" [in, r] and ".lora_b" [r, out], f32
    char e[300];
    ql_gguf *g = ql_gguf_open(path.c_str(), e, sizeof(e));
    REQUIRE_MESSAGE(g, e);
    size_t len;
    CHECK(std::string(ql_gguf_get_str(g, ql_gguf_find_kv(g, "general.architecture"), &len)) == "llama");
    CHECK(std::string(ql_gguf_get_str(g, ql_gguf_find_kv(g, "general.type"), &len)) == "adapter");
    CHECK(std::string(ql_gguf_get_str(g, ql_gguf_find_kv(g, "adapter.type"), &len)) == "lora");
    const int64_t ial = ql_gguf_find_kv(g, "adapter.lora.alpha");
    REQUIRE(ial >= 0);
    CHECK(ql_gguf_kv_type(g, ial) == QL_GGUF_F32);
    double alpha = 0;
    CHECK(ql_gguf_get_f64(g, ial, &alpha));
    CHECK(alpha == 8.0);
    CHECK(ql_gguf_n_tensors(g) == 2 * (int64_t)a.m.lora.size());
    for (ql_tensor *w : a.linears(true)) {
        int64_t ne[4];
        const int64_t ia = ql_gguf_find_tensor(g, (std::string(w->name) + ".lora_a").c_str());
        const int64_t ib = ql_gguf_find_tensor(g, (std::string(w->name) + ".lora_b").c_str());
        REQUIRE(ia >= 0);
        REQUIRE(ib >= 0);
        CHECK(ql_gguf_tensor_type(g, ia) == QL_TYPE_F32);
        CHECK(ql_gguf_tensor_ne(g, ia, ne) == 2);
        CHECK((ne[0] == w->ne[0] && ne[1] == 4));
        CHECK(ql_gguf_tensor_ne(g, ib, ne) == 2);
        CHECK((ne[0] == 4 && ne[1] == w->ne[1]));
    }
    CHECK(std::string(ql_gguf_tensor_name(g, 0)) == "blk.0.attn_q.weight.lora_a");  // model order
    ql_gguf_close(g);

    // attached to a fresh copy of the base: the same numbers and scale
    model b;
    ql_lora_adapter *ad = ql_llama_attach_lora(&b.m, "llama", path.c_str(), 1.0f, e, sizeof(e));
    REQUIRE_MESSAGE(ad, e);
    CHECK(ad->n_pairs == (int)a.m.lora.size());
    CHECK(b.m.lora.size() == a.m.lora.size());
    for (ql_tensor *w : a.linears(true)) {
        const ql_lora_pair &p = a.m.lora.at(w), &q = b.m.lora.at(b.weight(w->name));
        CHECK(same_bytes(p.a, q.a));
        CHECK(same_bytes(p.b, q.b));
        CHECK(q.scale == p.scale);
    }
    ql_lora_adapter_free(ad);

    // an alpha that is not a finite number >= 0 (llama.cpp's key is not checked by anyone else)
    for (const float bad : {INFINITY, NAN, -2.0f}) {
        CAPTURE(bad);
        char e2[300];
        const std::string badp = d.path + "/bad-alpha.gguf";
        rewrite_gguf(path, badp, [&](ql_gguf_writer *w) { ql_gguf_set_f32(w, "adapter.lora.alpha", bad); });
        model x;
        ql_lora_adapter *bad_ad = ql_llama_attach_lora(&x.m, "llama", badp.c_str(), 1.0f, e2, sizeof(e2));
        CHECK(bad_ad == nullptr);
        CHECK_MESSAGE(has(e2, "adapter.lora.alpha is "), e2);
        CHECK_MESSAGE(has(e2, "a finite number >= 0 expected"), e2);
        ql_lora_adapter_free(bad_ad);
    }

    // ql_lora_attach_any takes the file as well
    model c;
    ad = ql_lora_attach_any(&c.m, "llama", path.c_str(), 0.5f, &err);
    REQUIRE_MESSAGE(ad, err);
    CHECK(c.m.lora.at(c.m.layers[1].w_up).scale == 0.5f * k_scale);
    ql_lora_adapter_free(ad);
}

TEST_CASE("adapter: rsLoRA's alpha / sqrt(r) survives llama.cpp's alpha / r; mismatches are refused") {
    tmpdir d;
    const std::string path = d.path + "/rs.gguf";
    std::string err;
    char e[300];
    for (int r : {4, 6}) {
        CAPTURE(r);
        const ql_lora_config c = config(r, 8.0f, true);
        model a;
        add_pairs(a.lctx, a.m, {a.m.layers[0].wq, a.m.layers[1].w_down}, r, ql_lora_scale(c), 3);
        REQUIRE_MESSAGE(ql_lora_save_gguf(path.c_str(), a.m, "llama", c, &err), err);
        model b;
        ql_lora_adapter *ad = ql_llama_attach_lora(&b.m, "llama", path.c_str(), 1.0f, e, sizeof(e));
        REQUIRE_MESSAGE(ad, e);
        const float s = b.m.lora.at(b.m.layers[0].wq).scale;
        CHECK(std::fabs(s - 8.0f / std::sqrt((float)r)) <= 1e-6f * s);
        if (r == 4) CHECK(s == 4.0f);  // alpha' = 8 * 2 = 16, 16 / 4 = 4 exactly
        ql_lora_adapter_free(ad);
    }
    model a;
    add_pairs(a.lctx, a.m, {a.m.layers[0].wq}, 4, 1.5f, 3);
    CHECK_FALSE(ql_lora_save_gguf(path.c_str(), a.m, "llama", config(), &err));
    CHECK(has(err, "blk.0.attn_q.weight has scale 1.5"));
    CHECK(has(err, "rs.gguf"));
    a.m.lora.at(a.m.layers[0].wq).scale = k_scale;
    CHECK_FALSE(ql_lora_save_gguf(path.c_str(), a.m, "llama", config(8, 16.0f), &err));
    CHECK(has(err, "rank 4, the config says r = 8"));
    model none;
    CHECK_FALSE(ql_lora_save_gguf(path.c_str(), none.m, "llama", config(), &err));
    CHECK(has(err, "no adapter"));
}

// ---- PEFT ----

TEST_CASE("peft: a llama adapter round trips, with q/k lora_B rows in Hugging Face's order") {
    tmpdir d;
    const std::string dir = d.path + "/peft";
    model a;
    add_pairs(a.lctx, a.m, a.linears(false), 4, k_scale, 5);
    std::string err;
    ql_lora_config c = config();
    c.targets = {"q"};  // the file lists what it holds, not this
    REQUIRE_MESSAGE(ql_peft_save(dir.c_str(), a.m, "llama", c, &err), err);
    REQUIRE(exists(dir + "/adapter_config.json"));

    // adapter_config.json: the fields PEFT writes and reads back
    std::vector<uint8_t> cj = read_file_bytes(dir + "/adapter_config.json");
    const std::string text(cj.begin(), cj.end());
    for (const char *kv : {"\"peft_type\": \"LORA\"", "\"task_type\": \"CAUSAL_LM\"", "\"bias\": \"none\"",
                           "\"fan_in_fan_out\": false", "\"use_dora\": false", "\"use_rslora\": false",
                           "\"init_lora_weights\": true", "\"inference_mode\": true", "\"r\": 4", "\"lora_alpha\": 8",
                           "\"lora_dropout\": 0.05", "\"base_model_name_or_path\": \"org/tiny-llama\""})
        CHECK_MESSAGE(has(text, kv), kv);
    ql_lora_config back;
    REQUIRE_MESSAGE(ql_peft_read_config(dir.c_str(), &back, &err), err);
    CHECK(back.r == 4);
    CHECK(back.alpha == 8.0f);
    CHECK(back.dropout == 0.05f);
    CHECK_FALSE(back.rslora);
    CHECK(back.base_model == "org/tiny-llama");
    CHECK(back.target_modules == std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});

    // adapter_model.safetensors: PEFT's names, lora_A [r, in] = A as it is, lora_B [out, r]
    std::vector<ql_st_tensor> ts;
    std::vector<uint8_t> storage;
    std::vector<std::pair<std::string, std::string>> meta;
    REQUIRE_MESSAGE(ql_safetensors_read((dir + "/adapter_model.safetensors").c_str(), &ts, &storage, &err, &meta), err);
    CHECK(meta == std::vector<std::pair<std::string, std::string>>{{"format", "pt"}});
    CHECK(ts.size() == 2 * a.m.lora.size());
    auto find = [&](const std::string &n) -> const ql_st_tensor * {
        for (const ql_st_tensor &t : ts)
            if (t.name == n) return &t;
        return nullptr;
    };
    const int hd = a.m.hp.head_dim();
    for (int il = 0; il < 2; il++) {
        const ql_llama_layer &L = a.m.layers[(size_t)il];
        const std::string pre = "base_model.model.model.layers." + std::to_string(il) + ".";
        const struct {
            const char *mod;
            ql_tensor *w;
            int heads;  // rope heads whose rows are permuted
        } mods[] = {{"self_attn.q_proj", L.wq, a.m.hp.n_head}, {"self_attn.k_proj", L.wk, a.m.hp.n_head_kv},
                    {"self_attn.v_proj", L.wv, 0},            {"self_attn.o_proj", L.wo, 0},
                    {"mlp.gate_proj", L.w_gate, 0},            {"mlp.up_proj", L.w_up, 0},
                    {"mlp.down_proj", L.w_down, 0}};
        for (const auto &md : mods) {
            CAPTURE(md.mod);
            const ql_st_tensor *A = find(pre + md.mod + ".lora_A.weight"), *B = find(pre + md.mod + ".lora_B.weight");
            REQUIRE(A);
            REQUIRE(B);
            const ql_lora_pair &p = a.m.lora.at(md.w);
            CHECK(A->dtype == "F32");
            CHECK(A->shape == std::vector<int64_t>{4, md.w->ne[0]});
            CHECK(B->shape == std::vector<int64_t>{md.w->ne[1], 4});
            CHECK(memcmp(A->data, p.a->data, ql_nbytes(p.a)) == 0);
            const float *gb = (const float *)p.b->data;  // GGUF rows of 4
            const uint8_t *hb = (const uint8_t *)B->data;
            if (!md.heads) {
                CHECK(memcmp(hb, gb, ql_nbytes(p.b)) == 0);
                continue;
            }
            CHECK(memcmp(hb, gb, ql_nbytes(p.b)) != 0);
            const std::vector<int64_t> perm = hf_row_of_gguf_row(md.w->ne[1], md.heads);
            for (int64_t g = 0; g < md.w->ne[1]; g++) CHECK(memcmp(hb + perm[(size_t)g] * 16, gb + g * 4, 16) == 0);
            // one row by hand: GGUF row 1 (head 0, pair 0, second element) is HF row hd/2;
            // GGUF row hd + 2 (head 1, pair 1, first element) is HF row hd + 1
            CHECK(memcmp(hb + (hd / 2) * 16, gb + 1 * 4, 16) == 0);
            CHECK(memcmp(hb + (hd + 1) * 16, gb + (hd + 2) * 4, 16) == 0);
        }
    }

    // attached to a fresh copy of the base: bit for bit the same pairs, in GGUF order again
    model b;
    ql_lora_adapter *ad = ql_peft_attach(&b.m, "llama", dir.c_str(), 1.0f, &err);
    REQUIRE_MESSAGE(ad, err);
    CHECK(ad->n_pairs == (int)a.m.lora.size());
    CHECK(ad->alpha == 8.0f);
    for (ql_tensor *w : a.linears(false)) {
        CAPTURE(w->name);
        const ql_lora_pair &p = a.m.lora.at(w), &q = b.m.lora.at(b.weight(w->name));
        CHECK(same_bytes(p.a, q.a));
        CHECK(same_bytes(p.b, q.b));
        CHECK(q.scale == p.scale);
    }
    // and the forward pass agrees exactly
    const std::vector<int32_t> toks = {3, 1, 4, 1, 5, 9, 2, 6};
    CHECK(rel_err(logits_of(a.m, toks), logits_of(b.m, toks)) == 0.0);
    ql_lora_adapter_free(ad);

    // the folder through ql_lora_attach_any, with a user scale
    model c2;
    ad = ql_lora_attach_any(&c2.m, "llama", dir.c_str(), 2.0f, &err);
    REQUIRE_MESSAGE(ad, err);
    CHECK(c2.m.lora.at(c2.m.layers[0].wk).scale == 2.0f * k_scale);
    ql_lora_adapter_free(ad);
}

TEST_CASE("peft: qwen2 keeps its rows, rsLoRA scales by alpha / sqrt(r), lm_head is named as PEFT names it") {
    tmpdir d;
    const std::string dir = d.path + "/qwen";
    const ql_lora_config c = config(4, 8.0f, true);
    model a(2, 1, QL_ROPE_NEOX);
    add_pairs(a.lctx, a.m, {a.m.layers[0].wq, a.m.layers[1].wk, a.m.output}, 4, ql_lora_scale(c), 9);
    CHECK(ql_lora_scale(c) == 4.0f);
    std::string err;
    REQUIRE_MESSAGE(ql_peft_save(dir.c_str(), a.m, "qwen2", c, &err), err);
    std::vector<ql_st_tensor> ts;
    std::vector<uint8_t> storage;
    REQUIRE(ql_safetensors_read((dir + "/adapter_model.safetensors").c_str(), &ts, &storage, &err));
    int checked = 0;
    for (const ql_st_tensor &t : ts) {
        if (t.name == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") {
            CHECK(memcmp(t.data, a.m.lora.at(a.m.layers[0].wq).b->data, ql_nbytes(a.m.lora.at(a.m.layers[0].wq).b)) == 0);
            checked++;
        }
        if (t.name == "base_model.model.lm_head.lora_A.weight") checked++;
    }
    CHECK(checked == 2);
    ql_lora_config back;
    REQUIRE(ql_peft_read_config(dir.c_str(), &back, &err));
    CHECK(back.rslora);
    CHECK(back.target_modules == std::vector<std::string>{"q_proj", "k_proj", "lm_head"});
    model b(2, 1, QL_ROPE_NEOX);
    ql_lora_adapter *ad = ql_peft_attach(&b.m, "qwen2", dir.c_str(), 0.5f, &err);
    REQUIRE_MESSAGE(ad, err);
    CHECK(b.m.lora.size() == 3);
    CHECK(b.m.lora.at(b.m.layers[0].wq).scale == 2.0f);  // 0.5 * 8 / sqrt(4)
    for (ql_tensor *w : {a.m.layers[0].wq, a.m.layers[1].wk, a.m.output}) {
        CHECK(same_bytes(a.m.lora.at(w).a, b.m.lora.at(b.weight(w->name)).a));
        CHECK(same_bytes(a.m.lora.at(w).b, b.m.lora.at(b.weight(w->name)).b));
    }
    ql_lora_adapter_free(ad);
}

TEST_CASE("peft: missing files, a wrong r, a layer the model lacks and foreign tensors are refused by name") {
    tmpdir d;
    std::string err;
    model m;
    auto attach_fails = [&](const std::string &dir, std::initializer_list<const char *> says) {
        err.clear();
        ql_lora_adapter *ad = ql_peft_attach(&m.m, "llama", dir.c_str(), 1.0f, &err);
        CHECK(ad == nullptr);
        ql_lora_adapter_free(ad);
        CAPTURE(err);
        for (const char *s : says) CHECK(has(err, s));
        CHECK(m.m.lora.empty());  // nothing bound on failure
    };
    attach_fails(d.path + "/nowhere", {"nowhere/adapter_config.json", "cannot open"});

    // a good folder to damage
    const std::string dir = d.path + "/p";
    model a;
    add_pairs(a.lctx, a.m, {a.m.layers[0].wq, a.m.layers[1].w_down}, 4, k_scale, 2);
    REQUIRE_MESSAGE(ql_peft_save(dir.c_str(), a.m, "llama", config(), &err), err);
    const std::vector<uint8_t> cfg_bytes = read_file_bytes(dir + "/adapter_config.json");
    const std::string cfg(cfg_bytes.begin(), cfg_bytes.end());
    auto with_config = [&](const std::string &from, const std::string &to) {
        std::string s = cfg;
        REQUIRE(has(s, from));
        s.replace(s.find(from), from.size(), to);
        write_file(dir + "/adapter_config.json", s);
    };
    with_config("\"r\": 4", "\"r\": 8");
    attach_fails(dir, {"adapter_model.safetensors", "layers.0.self_attn.q_proj.lora_A.weight", "r = 8"});
    with_config("\"LORA\"", "\"PREFIX_TUNING\"");
    attach_fails(dir, {"adapter_config.json", "PREFIX_TUNING"});
    with_config("\"use_dora\": false", "\"use_dora\": true");
    attach_fails(dir, {"DoRA"});
    with_config("\"rank_pattern\": {}", "\"rank_pattern\": {\"q_proj\": 8}");
    attach_fails(dir, {"rank_pattern"});
    with_config("\"r\": 4", "\"r\": \"four\"");
    attach_fails(dir, {"r must be a positive integer"});
    with_config("\"lora_alpha\": 8", "\"lora_alpha\": 1e39");  // a finite double, an infinite float
    attach_fails(dir, {"adapter_config.json", "lora_alpha 1e+39 is not a finite 32-bit number"});
    write_file(dir + "/adapter_config.json", "{\"peft_type\": \"LORA\",");
    attach_fails(dir, {"adapter_config.json", "bad JSON"});
    write_file(dir + "/adapter_config.json", cfg);
    ql_lora_adapter *ok = ql_peft_attach(&m.m, "llama", dir.c_str(), 1.0f, &err);  // intact again
    CHECK_MESSAGE(ok, err);
    ql_lora_adapter_free(ok);
    m.m.lora.clear();

    // a tensor for layer 2 of a 2-layer model
    model three(3);
    add_pairs(three.lctx, three.m, {three.m.layers[2].wv}, 4, k_scale, 2);
    const std::string dir3 = d.path + "/three";
    REQUIRE(ql_peft_save(dir3.c_str(), three.m, "llama", config(), &err));
    attach_fails(dir3, {"adapter_model.safetensors", "layers.2.self_attn.v_proj.lora_", "the model has 2 layers"});

    // hand-made tensor files: a foreign name, a missing lora_B, shapes that do not fit
    std::vector<float> buf(64 * 8, 0.5f);
    auto with_tensors = [&](const std::vector<ql_st_tensor> &ts) {
        REQUIRE(ql_safetensors_write((dir + "/adapter_model.safetensors").c_str(), ts, {}, &err));
    };
    with_tensors({{"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", "F32", {4, 64}, buf.data()}});
    attach_fails(dir, {"tensor base_model.model.model.layers.0.self_attn.rotary.lora_A.weight is not"});
    with_tensors({{"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "F32", {4, 64}, buf.data()}});
    attach_fails(dir, {"mlp.q_proj"});
    with_tensors({{"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", "F32", {4, 64}, buf.data()}});
    attach_fails(dir, {"up_proj.lora_A.weight has no lora_B"});
    with_tensors({{"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", "F32", {4, 32}, buf.data()},
                  {"base_model.model.model.layers.1.mlp.up_proj.lora_B.weight", "F32", {128, 4}, buf.data()}});
    attach_fails(dir, {"do not fit blk.1.ffn_up.weight (in 64, out 128)"});
    // F16 and BF16 tensors are read too
    std::vector<uint16_t> h(128 * 4, ql_fp32_to_fp16(0.25f)), bh(64 * 4, ql_fp32_to_bf16(-0.5f));
    with_tensors({{"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", "BF16", {4, 64}, bh.data()},
                  {"base_model.model.model.layers.1.mlp.up_proj.lora_B.weight", "F16", {128, 4}, h.data()}});
    ok = ql_peft_attach(&m.m, "llama", dir.c_str(), 1.0f, &err);
    REQUIRE_MESSAGE(ok, err);
    const ql_lora_pair &p = m.m.lora.at(m.m.layers[1].w_up);
    CHECK(ql_get_f32_1d(p.a, 5) == -0.5f);
    CHECK(ql_get_f32_1d(p.b, 7) == 0.25f);
    ql_lora_adapter_free(ok);
}

// ---- merged model ----

TEST_CASE("merge: the merged GGUF gives the adapted model's logits; NF4 comes out f16, the rest byte for byte") {
    tmpdir d;
    const std::string base = d.path + "/base.gguf", merged = d.path + "/merged.gguf";
    model src;
    llama_gguf_opts opts;  // four weights NF4 (double-quantised)
    opts.name = "tiny test model";
    opts.file_type = true;
    opts.tokens = true;
    opts.nf4 = {"blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "blk.1.ffn_gate.weight"};
    write_llama_gguf(src.m, base, opts);
    char e[300];
    ql_llama_file *f = ql_llama_load(base.c_str(), e, sizeof(e));
    REQUIRE_MESSAGE(f, e);
    CHECK(f->model.layers[0].wq->type == QL_TYPE_NF4);
    // adapters on every weight of layer 0 (two of them NF4), v and down of layer 1, the output
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *lctx = ql_init(ip);
    const ql_llama_layer &L0 = f->model.layers[0], &L1 = f->model.layers[1];
    add_pairs(lctx, f->model, {L0.wq, L0.wk, L0.wv, L0.wo, L0.w_gate, L0.w_up, L0.w_down, L1.wv, L1.w_down, f->model.output},
              8, 0.75f, 21);
    const std::vector<int32_t> toks = {5, 17, 3, 90, 42, 42, 7, 0, 64, 12};
    const std::vector<float> want = logits_of(f->model, toks);

    std::string err;
    REQUIRE_MESSAGE(ql_llama_save_merged(merged.c_str(), *f, f->model, &err), err);
    ql_llama_file *mf = ql_llama_load(merged.c_str(), e, sizeof(e));
    REQUIRE_MESSAGE(mf, e);
    CHECK(mf->model.lora.empty());
    const std::vector<float> got = logits_of(mf->model, toks);
    // Each merged weight is rounded once to f16 (relative error <= 2^-11 ~ 4.9e-4, errors of
    // independent signs), and the f32 reference itself sums in another order; through two
    // blocks and the output that stays well under 1% of the largest logit.
    const double rel = rel_err(got, want);
    MESSAGE("merged vs adapters: max |logit diff| / max |logit| = ", rel);
    CHECK(rel < 5e-3);
    CHECK(rel > 0.0);  // the adapters did change the weights (and the check is not vacuous)
    CHECK(rel_err(logits_of(src.m, toks), want) > 1e-2);

    const ql_gguf *g = f->gguf, *h = mf->gguf;
    CHECK(ql_gguf_n_tensors(h) == ql_gguf_n_tensors(g));
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const std::string name = ql_gguf_tensor_name(g, i);
        CAPTURE(name);
        const int64_t j = ql_gguf_find_tensor(h, name.c_str());
        REQUIRE(j >= 0);
        const ql_type tg = ql_gguf_tensor_type(g, i), th = ql_gguf_tensor_type(h, j);
        bool adapted = false;
        for (const auto &kv : f->model.lora) adapted |= name == kv.first->name;
        if (adapted || tg == QL_TYPE_NF4) {
            CHECK(th == QL_TYPE_F16);
        } else {
            CHECK(th == tg);
            CHECK(ql_gguf_tensor_size(h, j) == ql_gguf_tensor_size(g, i));
            CHECK(memcmp(ql_gguf_tensor_data(h, j), ql_gguf_tensor_data(g, i), ql_gguf_tensor_size(g, i)) == 0);
        }
        CHECK((int)th < (int)QL_TYPE_NF4);  // nothing llama.cpp cannot read
    }
    // an unadapted NF4 weight: its dequantised values, rounded to f16
    {
        const ql_tensor *w = f->model.layers[1].wq;
        std::vector<float> x((size_t)ql_nelements(w));
        REQUIRE(ql_dequantize(w->type, w->data, w->ne[1], w->ne[0], x.data()) == QL_OK);
        const uint16_t *m16 = (const uint16_t *)mf->model.layers[1].wq->data;
        bool all = true;
        for (size_t i = 0; i < x.size(); i++) all &= m16[i] == ql_fp32_to_fp16(x[i]);
        CHECK(all);
    }
    // one merged element by hand: W + scale sum_k B[o][k] A[k][i], in double, to f16
    {
        const ql_tensor *w = f->model.layers[0].wv;  // f32 in the base
        const ql_lora_pair &p = f->model.lora.at(w);
        const int64_t in = w->ne[0], o = 5, i = 17;
        double s = 0;
        for (int k = 0; k < 8; k++) s += (double)((float *)p.b->data)[o * 8 + k] * ((float *)p.a->data)[k * in + i];
        const float v = (float)(((const float *)w->data)[o * in + i] + 0.75 * s);
        const float m = ql_fp16_to_fp32(((const uint16_t *)mf->model.layers[0].wv->data)[o * in + i]);
        CHECK(m == ql_fp16_to_fp32(ql_fp32_to_fp16(v)));
    }
    // the KVs come along; file_type says "mostly f16" now that only f16/f32 matrices remain
    size_t len;
    CHECK(std::string(ql_gguf_get_str(h, ql_gguf_find_kv(h, "general.name"), &len)) == "tiny test model");
    CHECK(ql_gguf_arr_n(h, ql_gguf_find_kv(h, "tokenizer.ggml.tokens")) == 2);
    int64_t ft = -1;
    CHECK(ql_gguf_get_i64(h, ql_gguf_find_kv(h, "general.file_type"), &ft));
    CHECK(ft == 1);
    CHECK(ql_gguf_n_kv(h) == ql_gguf_n_kv(g));
    ql_llama_file_free(mf);

    // an adapter on a weight the base file does not hold
    ql_tensor *stray = ql_set_name(ql_new_tensor_2d(lctx, QL_TYPE_F32, 64, 64), "blk.9.attn_q.weight");
    f->model.lora[stray] = f->model.lora.at(L0.wq);
    CHECK_FALSE(ql_llama_save_merged(merged.c_str(), *f, f->model, &err));
    CHECK(has(err, "blk.9.attn_q.weight"));
    CHECK(has(err, "merged.gguf"));
    f->model.lora.clear();
    ql_free(lctx);
    ql_llama_file_free(f);
}
