// tests/fuzz_gguf_seeds.cpp - writes small valid GGUF files as a seed corpus for fuzz_gguf.
//
//   g++ -std=c++17 -O1 -I. tests/fuzz_gguf_seeds.cpp qlora.cpp models/llama.cpp -o /tmp/fuzz_gguf_seeds -pthread
//   /tmp/fuzz_gguf_seeds DIR
#include "../qlora.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

// Hand-laid bytes for what the writer cannot make: the scalar kinds it has no setter for, and a
// few files one step from valid (a duplicate key, a duplicate tensor name).
struct bytes_t {
    std::vector<uint8_t> b;
    bytes_t &raw(const void *p, size_t n) {
        b.insert(b.end(), (const uint8_t *)p, (const uint8_t *)p + n);
        return *this;
    }
    bytes_t &u8(uint8_t v) { return raw(&v, 1); }
    bytes_t &u16(uint16_t v) { return raw(&v, 2); }
    bytes_t &u32(uint32_t v) { return raw(&v, 4); }
    bytes_t &u64(uint64_t v) { return raw(&v, 8); }
    bytes_t &str(const char *s) { return u64(strlen(s)).raw(s, strlen(s)); }
    bytes_t &kv(const char *key, uint32_t type) { return str(key).u32(type); }
    bytes_t &tinfo(const char *name, uint64_t ne0, uint32_t type, uint64_t offset) {
        return str(name).u32(1).u64(ne0).u32(type).u64(offset);
    }
    bytes_t &pad(size_t a) {
        while (b.size() % a) b.push_back(0);
        return *this;
    }
    bool save(const std::string &path) const {
        FILE *f = fopen(path.c_str(), "wb");
        const bool ok = f && fwrite(b.data(), 1, b.size(), f) == b.size();
        if (f) fclose(f);
        if (!ok) fprintf(stderr, "%s: cannot write\n", path.c_str());
        return ok;
    }
};

static bool write(ql_gguf_writer *w, const std::string &path) {
    char err[512];
    if (ql_gguf_write(w, path.c_str(), err, sizeof(err)) != QL_OK) {
        fprintf(stderr, "%s\n", err);
        return false;
    }
    ql_gguf_writer_free(w);
    return true;
}

static void add(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne,
                std::vector<std::vector<uint8_t>> &keep) {
    int64_t rows = 1;
    for (int d = 1; d < n_dims; d++) rows *= ne[d];
    std::vector<uint8_t> b(ql_type_data_size(type, rows, ne[0]));
    for (size_t i = 0; i < b.size(); i++) b[i] = (uint8_t)(i * 37 + 11);
    keep.push_back(b);
    if (ql_gguf_add_tensor(w, name, type, n_dims, ne, keep.back().data(), keep.back().size()) != QL_OK)
        fprintf(stderr, "add_tensor %s refused\n", name);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    std::vector<std::vector<uint8_t>> keep;
    keep.reserve(64);  // add() points the writer at these: no reallocation
    bool ok = true;

    {  // every setter, every array kind, several tensor types
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "llama");
        ql_gguf_set_u32(w, "llama.block_count", 2);
        ql_gguf_set_i32(w, "i32", -3);
        ql_gguf_set_u64(w, "u64", 1ull << 40);
        ql_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
        ql_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
        ql_gguf_set_str(w, "empty", "");
        const uint8_t u8s[] = {1, 2, 3};
        const int16_t i16s[] = {-1, 2};
        const float f32s[] = {0.5f, -1.0f};
        const bool bools[] = {true, false};
        const int64_t i64s[] = {-5, 5};
        const double f64s[] = {1.25};
        ql_gguf_set_arr(w, "a.u8", QL_GGUF_U8, u8s, 3);
        ql_gguf_set_arr(w, "a.i16", QL_GGUF_I16, i16s, 2);
        ql_gguf_set_arr(w, "tokenizer.ggml.scores", QL_GGUF_F32, f32s, 2);
        ql_gguf_set_arr(w, "a.bool", QL_GGUF_BOOL, bools, 2);
        ql_gguf_set_arr(w, "a.i64", QL_GGUF_I64, i64s, 2);
        ql_gguf_set_arr(w, "a.f64", QL_GGUF_F64, f64s, 1);
        ql_gguf_set_arr(w, "a.empty", QL_GGUF_U32, nullptr, 0);
        const char *toks[] = {"<unk>", "", "hello"};
        ql_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
        const int64_t a[2] = {4, 2}, b[1] = {6}, q[2] = {32, 2}, i[3] = {2, 1, 2}, n[2] = {64, 1}, k[1] = {256};
        add(w, "f32", QL_TYPE_F32, 2, a, keep);
        add(w, "f16", QL_TYPE_F16, 1, b, keep);
        add(w, "q8_0", QL_TYPE_Q8_0, 2, q, keep);
        add(w, "i32", QL_TYPE_I32, 3, i, keep);
        add(w, "q4_K", QL_TYPE_Q4_K, 1, k, keep);
        add(w, "nf4", QL_TYPE_NF4, 2, n, keep);
        ok &= write(w, dir + "/all.gguf");
    }
    {  // alignment 64, a 4-D tensor and an empty one
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_u32(w, "general.alignment", 64);
        ql_gguf_set_str(w, "general.architecture", "llama");
        const int64_t a[4] = {2, 2, 2, 2}, e[2] = {0, 3}, b[1] = {3};
        add(w, "four_d", QL_TYPE_F32, 4, a, keep);
        add(w, "empty", QL_TYPE_F32, 2, e, keep);
        add(w, "bf16", QL_TYPE_BF16, 1, b, keep);
        ok &= write(w, dir + "/align64.gguf");
    }
    {  // KVs only
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "gpt2");
        ql_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 50256);
        const char *merges[] = {"a b", "c d"};
        ql_gguf_set_arr_str(w, "tokenizer.ggml.merges", merges, 2);
        ok &= write(w, dir + "/kv_only.gguf");
    }
    {  // nothing at all
        ok &= write(ql_gguf_writer_new(), dir + "/empty.gguf");
    }
    {  // one small tensor, NF4 without double quantisation
        ql_gguf_writer *w = ql_gguf_writer_new();
        const int64_t n[2] = {64, 2};
        add(w, "nf4_nodq", QL_TYPE_NF4_NODQ, 2, n, keep);
        ok &= write(w, dir + "/nodq.gguf");
    }
    {  // every scalar kind, v2
        bytes_t f;
        f.raw("GGUF", 4).u32(2).u64(1).u64(13);
        f.kv("u8", QL_GGUF_U8).u8(200).kv("i8", QL_GGUF_I8).u8(0x9c).kv("u16", QL_GGUF_U16).u16(60000);
        f.kv("i16", QL_GGUF_I16).u16(0x8ad0).kv("u32", QL_GGUF_U32).u32(7).kv("i32", QL_GGUF_I32).u32(0xfffffff9u);
        f.kv("f32", QL_GGUF_F32).u32(0x3fc00000u).kv("bool", QL_GGUF_BOOL).u8(1).kv("str", QL_GGUF_STRING).str("s");
        f.kv("arr", QL_GGUF_ARRAY).u32(QL_GGUF_I16).u64(2).u16(1).u16(2);
        f.kv("u64", QL_GGUF_U64).u64(~0ull).kv("i64", QL_GGUF_I64).u64(0x8000000000000000ull);
        f.kv("f64", QL_GGUF_F64).u64(0xc002000000000000ull);
        f.tinfo("t", 8, QL_TYPE_F32, 0).pad(32).raw("0123456789abcdef0123456789abcdef", 32);
        ok &= f.save(dir + "/scalars_v2.gguf");
    }
    {  // a key twice
        bytes_t f;
        f.raw("GGUF", 4).u32(3).u64(0).u64(2).kv("general.name", QL_GGUF_U8).u8(1).kv("general.name", QL_GGUF_U8).u8(2);
        ok &= f.save(dir + "/dup_key.gguf");
    }
    {  // a tensor name twice
        bytes_t f;
        f.raw("GGUF", 4).u32(3).u64(2).u64(0).tinfo("w", 8, QL_TYPE_F32, 0).tinfo("w", 8, QL_TYPE_F32, 32).pad(32);
        for (int i = 0; i < 64; i++) f.u8((uint8_t)i);
        ok &= f.save(dir + "/dup_tensor.gguf");
    }
    return ok ? 0 : 1;
}
