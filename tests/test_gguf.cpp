// GGUF reader and writer: round trips bit for bit, real vocab files, and a corpus of malformed
// files that must each fail with a message naming the problem (never a crash).
#include <doctest/doctest.h>

#include "../qlora.h"
#include "util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

// Little-endian byte builder for hand-made files.
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
    bytes_t &f32(float v) { return raw(&v, 4); }
    bytes_t &f64(double v) { return raw(&v, 8); }
    bytes_t &str(const std::string &s) { return u64(s.size()).raw(s.data(), s.size()); }
    bytes_t &header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
        return raw("GGUF", 4).u32(version).u64(n_tensors).u64(n_kv);
    }
    bytes_t &kv(const std::string &key, uint32_t type) { return str(key).u32(type); }
    bytes_t &arr(const std::string &key, uint32_t elem, uint64_t n) { return kv(key, QL_GGUF_ARRAY).u32(elem).u64(n); }
    bytes_t &tinfo(const std::string &name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
        str(name).u32((uint32_t)ne.size());
        for (uint64_t v : ne) u64(v);
        return u32(type).u64(offset);
    }
    bytes_t &zeros(size_t n) {
        b.resize(b.size() + n, 0);
        return *this;
    }
    bytes_t &pad(size_t a) {
        while (b.size() % a) b.push_back(0);
        return *this;
    }
};

// Touch everything a reader exposes; every tensor's bytes must lie inside [buf, buf + size).
void touch_all(const ql_gguf *g, const uint8_t *buf, size_t size) {
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) {
        const char *key = ql_gguf_kv_key(g, i);
        REQUIRE(key);
        REQUIRE(ql_gguf_find_kv(g, key) == i);
        int64_t iv;
        uint64_t uv;
        double dv;
        bool bv;
        size_t len = 0;
        (void)ql_gguf_get_i64(g, i, &iv);
        (void)ql_gguf_get_u64(g, i, &uv);
        (void)ql_gguf_get_f64(g, i, &dv);
        (void)ql_gguf_get_bool(g, i, &bv);
        if (const char *s = ql_gguf_get_str(g, i, &len)) REQUIRE(s[len] == '\0');
        const uint64_t n = ql_gguf_arr_n(g, i);
        if (ql_gguf_arr_type(g, i) == QL_GGUF_STRING) {
            for (uint64_t j = 0; j < n; j++) {
                const char *s = ql_gguf_arr_str(g, i, j, &len);
                REQUIRE(s);
                REQUIRE(s[len] == '\0');
            }
            REQUIRE(ql_gguf_arr_str(g, i, n, &len) == nullptr);
        } else if (ql_gguf_kv_type(g, i) == QL_GGUF_ARRAY) {
            REQUIRE(ql_gguf_arr_data(g, i) != nullptr);
        }
    }
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        const char *name = ql_gguf_tensor_name(g, i);
        REQUIRE(name);
        REQUIRE(strlen(name) < 64);
        REQUIRE(ql_gguf_find_tensor(g, name) == i);
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        REQUIRE((nd >= 1 && nd <= 4));
        const uint8_t *d = (const uint8_t *)ql_gguf_tensor_data(g, i);
        const size_t sz = ql_gguf_tensor_size(g, i);
        REQUIRE(d >= buf);
        REQUIRE(sz <= size);
        REQUIRE((size_t)(d - buf) <= size - sz);
        REQUIRE(sz == ql_type_data_size(ql_gguf_tensor_type(g, i), ne[1] * ne[2] * ne[3], ne[0]));
    }
}

// "" when the bytes open (everything touched), else the error, which must be one line naming
// the source.
std::string open_error(const std::vector<uint8_t> &b) {
    char err[512] = "unset";
    ql_gguf *g = ql_gguf_open_memory(b.data(), b.size(), err, sizeof(err));
    if (g) {
        touch_all(g, b.data(), b.size());
        ql_gguf_close(g);
        return "";
    }
    std::string e = err;
    CHECK_MESSAGE(e.rfind("<memory>: ", 0) == 0, "error: " << e);
    CHECK(e.size() > strlen("<memory>: "));
    CHECK(e.find('\n') == std::string::npos);
    return e;
}

#define CHECK_FAILS(bytes, needle)                                                                   \
    do {                                                                                             \
        const std::string e_ = open_error((bytes).b);                                                \
        CHECK_MESSAGE(has(e_, needle), "expected an error naming '" << needle << "', got: '" << e_ << "'"); \
    } while (0)

// A valid file with every KV kind, hand-laid exactly as ql_gguf_write lays it out (v3, alignment
// 32, each tensor padded), the last tensor ending the file.
bytes_t all_kinds_file(uint32_t version = 3) {
    bytes_t f;
    f.header(version, 2, 17);
    f.kv("u8", QL_GGUF_U8).u8(200);
    f.kv("i8", QL_GGUF_I8).u8((uint8_t)-100);
    f.kv("u16", QL_GGUF_U16).u16(60000);
    f.kv("i16", QL_GGUF_I16).u16((uint16_t)-30000);
    f.kv("u32", QL_GGUF_U32).u32(4000000000u);
    f.kv("i32", QL_GGUF_I32).u32((uint32_t)-2000000000);
    f.kv("f32", QL_GGUF_F32).f32(1.5f);
    f.kv("bool", QL_GGUF_BOOL).u8(1);
    f.kv("str", QL_GGUF_STRING).str("hello");
    f.arr("arr", QL_GGUF_I16, 3).u16(1).u16((uint16_t)-2).u16(3);
    f.kv("u64", QL_GGUF_U64).u64((1ull << 63) + 5);
    f.kv("i64", QL_GGUF_I64).u64((uint64_t)-(1ll << 62));
    f.kv("f64", QL_GGUF_F64).f64(-2.25);
    f.kv("empty_str", QL_GGUF_STRING).str("");
    f.arr("empty_arr", QL_GGUF_F32, 0);
    f.arr("strs", QL_GGUF_STRING, 3).str("a").str("").str("xyz");
    f.arr("empty_strs", QL_GGUF_STRING, 0);
    f.tinfo("t.f16", {3, 2}, QL_TYPE_F16, 0);  // 12 bytes, padded to 32
    f.tinfo("t.f32", {16}, QL_TYPE_F32, 32);   // 64 bytes: ends the file
    f.pad(32);
    for (int i = 0; i < 6; i++) f.u16(ql_fp32_to_fp16((float)i - 2.5f));
    f.zeros(20);
    for (int i = 0; i < 16; i++) f.f32((float)i * 0.25f - 1.0f);
    return f;
}

const char *const k_strs[] = {"a", "", "xyz"};

// A binary file that is valid UTF-8 throughout went through a text conversion (invalid bytes
// replaced by U+FFFD): its lengths and offsets no longer add up.
bool damaged_by_text_conversion(const std::vector<uint8_t> &b) {
    bool replaced = false;
    for (size_t i = 0; i < b.size();) {
        const uint8_t c = b[i];
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!n || i + n > b.size()) return false;
        for (size_t k = 1; k < n; k++)
            if ((b[i + k] & 0xc0) != 0x80) return false;
        if (n == 3 && b[i] == 0xef && b[i + 1] == 0xbf && b[i + 2] == 0xbd) replaced = true;
        i += n;
    }
    return replaced;
}

}  // namespace

TEST_CASE("gguf: every KV kind reads back with the typed getters") {
    const bytes_t f = all_kinds_file();
    char err[256];
    ql_gguf *g = ql_gguf_open_memory(f.b.data(), f.b.size(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    CHECK(ql_gguf_version(g) == 3);
    CHECK(ql_gguf_alignment(g) == 32);
    CHECK(ql_gguf_data_offset(g) % 32 == 0);
    REQUIRE(ql_gguf_n_kv(g) == 17);
    const char *order[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64",
                           "f64", "empty_str", "empty_arr", "strs", "empty_strs"};
    for (int i = 0; i < 17; i++) CHECK(std::string(ql_gguf_kv_key(g, i)) == order[i]);
    auto K = [&](const char *k) {
        const int64_t i = ql_gguf_find_kv(g, k);
        REQUIRE(i >= 0);
        return i;
    };
    int64_t iv;
    uint64_t uv;
    double dv;
    bool bv;
    size_t len;
    CHECK(ql_gguf_kv_type(g, K("u8")) == QL_GGUF_U8);
    CHECK((ql_gguf_get_i64(g, K("u8"), &iv) && iv == 200));
    CHECK((ql_gguf_get_u64(g, K("u8"), &uv) && uv == 200));
    CHECK((ql_gguf_get_f64(g, K("u8"), &dv) && dv == 200.0));
    CHECK((ql_gguf_get_i64(g, K("i8"), &iv) && iv == -100));
    CHECK_FALSE(ql_gguf_get_u64(g, K("i8"), &uv));  // negative: does not fit
    CHECK((ql_gguf_get_u64(g, K("u16"), &uv) && uv == 60000));
    CHECK((ql_gguf_get_i64(g, K("i16"), &iv) && iv == -30000));
    CHECK((ql_gguf_get_u64(g, K("u32"), &uv) && uv == 4000000000u));
    CHECK((ql_gguf_get_i64(g, K("i32"), &iv) && iv == -2000000000));
    CHECK((ql_gguf_get_f64(g, K("i32"), &dv) && dv == -2000000000.0));
    CHECK((ql_gguf_get_f64(g, K("f32"), &dv) && dv == 1.5));
    CHECK_FALSE(ql_gguf_get_i64(g, K("f32"), &iv));
    CHECK((ql_gguf_get_bool(g, K("bool"), &bv) && bv));
    CHECK_FALSE(ql_gguf_get_i64(g, K("bool"), &iv));  // bool is not an integer
    CHECK_FALSE(ql_gguf_get_bool(g, K("u8"), &bv));
    const char *s = ql_gguf_get_str(g, K("str"), &len);
    REQUIRE(s);
    CHECK((len == 5 && std::string(s) == "hello"));
    CHECK(ql_gguf_get_str(g, K("u8"), &len) == nullptr);
    CHECK_FALSE(ql_gguf_get_i64(g, K("str"), &iv));
    CHECK((ql_gguf_get_u64(g, K("u64"), &uv) && uv == (1ull << 63) + 5));
    CHECK_FALSE(ql_gguf_get_i64(g, K("u64"), &iv));  // over INT64_MAX
    CHECK((ql_gguf_get_i64(g, K("i64"), &iv) && iv == -(1ll << 62)));
    CHECK((ql_gguf_get_f64(g, K("f64"), &dv) && dv == -2.25));
    s = ql_gguf_get_str(g, K("empty_str"), &len);
    CHECK((s && len == 0 && s[0] == '\0'));
    // arrays
    CHECK(ql_gguf_arr_type(g, K("arr")) == QL_GGUF_I16);
    CHECK(ql_gguf_arr_n(g, K("arr")) == 3);
    const int16_t *a = (const int16_t *)ql_gguf_arr_data(g, K("arr"));
    REQUIRE(a);
    CHECK((a[0] == 1 && a[1] == -2 && a[2] == 3));
    CHECK(ql_gguf_arr_str(g, K("arr"), 0, &len) == nullptr);
    CHECK(ql_gguf_arr_type(g, K("empty_arr")) == QL_GGUF_F32);
    CHECK(ql_gguf_arr_n(g, K("empty_arr")) == 0);
    CHECK(ql_gguf_arr_data(g, K("empty_arr")) != nullptr);  // an array, though empty
    CHECK(ql_gguf_arr_type(g, K("strs")) == QL_GGUF_STRING);
    REQUIRE(ql_gguf_arr_n(g, K("strs")) == 3);
    for (uint64_t j = 0; j < 3; j++) {
        s = ql_gguf_arr_str(g, K("strs"), j, &len);
        REQUIRE(s);
        CHECK(std::string(s, len) == k_strs[j]);
        CHECK(s[len] == '\0');
    }
    CHECK(ql_gguf_arr_str(g, K("strs"), 3, &len) == nullptr);
    CHECK(ql_gguf_arr_data(g, K("strs")) == nullptr);
    CHECK(ql_gguf_arr_n(g, K("empty_strs")) == 0);
    CHECK(ql_gguf_arr_str(g, K("empty_strs"), 0, &len) == nullptr);
    // non-arrays and out of range
    CHECK(ql_gguf_arr_type(g, K("u8")) == QL_GGUF_TYPE_COUNT);
    CHECK(ql_gguf_arr_n(g, K("u8")) == 0);
    CHECK(ql_gguf_arr_data(g, K("u8")) == nullptr);
    CHECK(ql_gguf_find_kv(g, "nope") == -1);
    CHECK(ql_gguf_find_kv(g, nullptr) == -1);
    CHECK(ql_gguf_kv_key(g, -1) == nullptr);
    CHECK(ql_gguf_kv_key(g, 17) == nullptr);
    CHECK(ql_gguf_kv_type(g, 17) == QL_GGUF_TYPE_COUNT);
    CHECK_FALSE(ql_gguf_get_i64(g, 17, &iv));
    CHECK_FALSE(ql_gguf_get_u64(g, -5, &uv));
    CHECK_FALSE(ql_gguf_get_f64(g, 99, &dv));
    CHECK_FALSE(ql_gguf_get_bool(g, 99, &bv));
    CHECK_FALSE(ql_gguf_get_i64(g, K("u8"), nullptr));
    CHECK(ql_gguf_get_str(g, 99, &len) == nullptr);
    CHECK(ql_gguf_get_str(g, K("str"), nullptr) != nullptr);
    CHECK(ql_gguf_arr_str(g, 99, 0, &len) == nullptr);
    // tensors
    REQUIRE(ql_gguf_n_tensors(g) == 2);
    int64_t ne[4];
    CHECK(ql_gguf_tensor_ne(g, 0, ne) == 2);
    CHECK((ne[0] == 3 && ne[1] == 2 && ne[2] == 1 && ne[3] == 1));
    CHECK(ql_gguf_tensor_type(g, 0) == QL_TYPE_F16);
    CHECK(ql_gguf_tensor_size(g, 0) == 12);
    CHECK(ql_gguf_find_tensor(g, "t.f32") == 1);
    CHECK(ql_gguf_tensor_size(g, 1) == 64);
    const float *t1 = (const float *)ql_gguf_tensor_data(g, 1);
    CHECK((const uint8_t *)t1 == f.b.data() + f.b.size() - 64);
    CHECK(ql_gguf_tensor_name(g, 2) == nullptr);
    CHECK(ql_gguf_tensor_data(g, -1) == nullptr);
    CHECK(ql_gguf_tensor_size(g, 2) == 0);
    CHECK(ql_gguf_tensor_type(g, 2) == QL_TYPE_COUNT);
    CHECK(ql_gguf_tensor_ne(g, 2, ne) == 0);
    CHECK(ql_gguf_tensor_ne(g, 0, nullptr) == 2);
    CHECK(ql_gguf_find_tensor(g, nullptr) == -1);
    ql_gguf_close(g);

    // v2 has the same layout
    const bytes_t f2 = all_kinds_file(2);
    g = ql_gguf_open_memory(f2.b.data(), f2.b.size(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    CHECK(ql_gguf_version(g) == 2);
    ql_gguf_close(g);
}

TEST_CASE("gguf: NULL-safe API") {
    char err[128];
    CHECK(ql_gguf_open(nullptr, err, sizeof(err)) == nullptr);
    CHECK(has(err, "no path"));
    CHECK(ql_gguf_open("/nonexistent/x.gguf", nullptr, 0) == nullptr);
    CHECK(ql_gguf_open_memory(nullptr, 10, err, sizeof(err)) == nullptr);
    CHECK(ql_gguf_open_memory(nullptr, 0, err, sizeof(err)) == nullptr);
    CHECK(has(err, "too short"));
    ql_gguf_close(nullptr);
    CHECK(ql_gguf_version(nullptr) == 0);
    CHECK(ql_gguf_alignment(nullptr) == 0);
    CHECK(ql_gguf_data_offset(nullptr) == 0);
    CHECK(ql_gguf_n_kv(nullptr) == 0);
    CHECK(ql_gguf_n_tensors(nullptr) == 0);
    CHECK(ql_gguf_find_kv(nullptr, "a") == -1);
    CHECK(ql_gguf_find_tensor(nullptr, "a") == -1);
    CHECK(ql_gguf_kv_key(nullptr, 0) == nullptr);
    CHECK(ql_gguf_kv_type(nullptr, 0) == QL_GGUF_TYPE_COUNT);
    int64_t iv;
    CHECK_FALSE(ql_gguf_get_i64(nullptr, 0, &iv));
    CHECK(ql_gguf_get_str(nullptr, 0, nullptr) == nullptr);
    CHECK(ql_gguf_arr_n(nullptr, 0) == 0);
    CHECK(ql_gguf_arr_data(nullptr, 0) == nullptr);
    CHECK(ql_gguf_arr_str(nullptr, 0, 0, nullptr) == nullptr);
    CHECK(ql_gguf_tensor_name(nullptr, 0) == nullptr);
    CHECK(ql_gguf_tensor_data(nullptr, 0) == nullptr);
    CHECK(ql_gguf_tensor_ne(nullptr, 0, nullptr) == 0);
    ql_gguf_writer_free(nullptr);
    ql_gguf_set_u32(nullptr, "a", 1);
    ql_gguf_set_str(nullptr, "a", "b");
    ql_gguf_set_arr(nullptr, "a", QL_GGUF_U8, nullptr, 0);
    ql_gguf_set_arr_str(nullptr, "a", nullptr, 0);
    ql_gguf_copy_kv(nullptr, nullptr, 0);
    ql_gguf_remove_kv(nullptr, "a");
    const int64_t ne[1] = {4};
    CHECK(ql_gguf_add_tensor(nullptr, "a", QL_TYPE_F32, 1, ne, nullptr, 0) == QL_ERR_INVALID);
    CHECK(ql_gguf_write(nullptr, "/tmp/x", err, sizeof(err)) == QL_ERR_INVALID);
    ql_gguf_writer *w = ql_gguf_writer_new();
    CHECK(ql_gguf_write(w, nullptr, err, sizeof(err)) == QL_ERR_INVALID);
    ql_gguf_writer_free(w);
}

TEST_CASE("gguf: copying every KV and tensor reproduces a file byte for byte") {
    tmpdir dir;
    const bytes_t f = all_kinds_file();
    char err[256];
    ql_gguf *g = ql_gguf_open_memory(f.b.data(), f.b.size(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    ql_gguf_writer *w = ql_gguf_writer_new();
    for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) ql_gguf_copy_kv(w, g, i);
    for (int64_t i = 0; i < ql_gguf_n_tensors(g); i++) {
        int64_t ne[4];
        const int nd = ql_gguf_tensor_ne(g, i, ne);
        REQUIRE(ql_gguf_add_tensor(w, ql_gguf_tensor_name(g, i), ql_gguf_tensor_type(g, i), nd, ne,
                                   ql_gguf_tensor_data(g, i), ql_gguf_tensor_size(g, i)) == QL_OK);
    }
    const std::string path = dir.file("copy.gguf");
    REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
    CHECK(read_file_bytes(path) == f.b);
    CHECK_FALSE(exists(path + ".tmp"));
    ql_gguf_writer_free(w);
    ql_gguf_close(g);
}

// Pages of zeros are skipped, not written (a sparse file), and read back as zeros: the bytes are
// the same as a dense write's. A tensor ending in zeros ends the file: its size comes from the
// final ftruncate (without it the file is short and the reader refuses it).
TEST_CASE("gguf: pages of zeros are left as holes and the file reads back byte for byte") {
    tmpdir dir;
    std::vector<uint8_t> a(5 * 4096 + 100, 0);  // a nonzero head and tail, zero pages between
    for (size_t i = 0; i < 300; i++) a[i] = (uint8_t)(i * 7 + 1);
    a[a.size() - 1] = 9;
    a[3 * 4096 + 17] = 5;  // one byte in a page otherwise zero: written
    const std::string path = dir.file("sparse.gguf");
    char err[256];
    auto write = [&](const std::vector<uint8_t> &b) {
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_u32(w, "x", 1);
        const int64_t na[1] = {(int64_t)a.size()}, nb[1] = {(int64_t)b.size()};
        REQUIRE(ql_gguf_add_tensor(w, "a", QL_TYPE_I8, 1, na, a.data(), a.size()) == QL_OK);
        REQUIRE(ql_gguf_add_tensor(w, "b", QL_TYPE_I8, 1, nb, b.data(), b.size()) == QL_OK);
        REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
        ql_gguf_writer_free(w);
    };
    // b, all zeros, is last and sized so the file ends on a page boundary (the header's size does
    // not depend on it): its last page is skipped, only the final ftruncate makes the file whole
    write(std::vector<uint8_t>(32, 0));
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    const uint64_t b_at = ql_gguf_data_offset(g) + 5 * 4096 + 128;  // a padded to 32
    ql_gguf_close(g);
    const std::vector<uint8_t> b((size_t)(3 * 4096 + (4096 - b_at % 4096) % 4096), 0);
    write(b);
    g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    REQUIRE(ql_gguf_n_tensors(g) == 2);
    CHECK(memcmp(ql_gguf_tensor_data(g, 0), a.data(), a.size()) == 0);
    CHECK(memcmp(ql_gguf_tensor_data(g, 1), b.data(), b.size()) == 0);
    ql_gguf_close(g);
    struct stat st;
    REQUIRE(stat(path.c_str(), &st) == 0);
    CHECK((uint64_t)st.st_size == b_at + b.size());
    CHECK((uint64_t)st.st_size % 4096 == 0);
    CHECK((uint64_t)st.st_blocks * 512 <= (uint64_t)st.st_size - 4 * 4096);  // at least 4 whole pages are holes
}

TEST_CASE("gguf: writer round trip, alignment 32 and 64, every array kind, five tensor types") {
    tmpdir dir;
    std::mt19937 rng(7);
    auto rand_bytes = [&](size_t n) {
        std::vector<uint8_t> v(n);
        for (auto &x : v) x = (uint8_t)rng();
        return v;
    };
    struct tdesc {
        const char *name;
        ql_type type;
        int n_dims;
        int64_t ne[4];
    };
    const tdesc tds[] = {
        {"tok_embd.weight", QL_TYPE_F32, 2, {4, 3, 1, 1}},
        {"blk.0.f16", QL_TYPE_F16, 1, {5, 1, 1, 1}},
        {"blk.0.q8_0", QL_TYPE_Q8_0, 2, {64, 2, 1, 1}},
        {"ids", QL_TYPE_I32, 3, {3, 1, 2, 1}},
        {"blk.0.attn_q.weight", QL_TYPE_NF4, 2, {128, 2, 1, 1}},
        {"four_d", QL_TYPE_F32, 4, {2, 2, 2, 2}},
        {"empty", QL_TYPE_F32, 2, {0, 3, 1, 1}},
    };
    const int nt = (int)(sizeof(tds) / sizeof(tds[0]));
    std::vector<std::vector<uint8_t>> data;
    for (const tdesc &t : tds) data.push_back(rand_bytes(ql_type_data_size(t.type, t.ne[1] * t.ne[2] * t.ne[3], t.ne[0])));
    {  // nf4: real data (the reader checks its side data), rows then side data
        std::vector<float> w(256);
        for (size_t i = 0; i < w.size(); i++) w[i] = (float)std::sin(0.37 * (double)i);
        REQUIRE(ql_quantize(QL_TYPE_NF4, w.data(), 2, 128, data[4].data(), nullptr, 0) == QL_OK);
    }
    CHECK(data[4].size() > 2 * 64);

    const uint8_t  a_u8[] = {0, 1, 255};
    const int8_t   a_i8[] = {-128, 0, 127};
    const uint16_t a_u16[] = {0, 65535};
    const int16_t  a_i16[] = {-32768, 32767, 5};
    const uint32_t a_u32[] = {0, 4294967295u};
    const int32_t  a_i32[] = {-7, 7};
    const float    a_f32[] = {1.0f, -0.0f, 3.4e38f, 1e-45f};
    const bool     a_bool[] = {true, false, true};
    const uint64_t a_u64[] = {~0ull, 1};
    const int64_t  a_i64[] = {INT64_MIN, INT64_MAX};
    const double   a_f64[] = {3.141592653589793, -1e308};
    struct adesc {
        const char *key;
        ql_gguf_type elem;
        const void *data;
        uint64_t n;
        size_t esz;
    };
    const adesc arrs[] = {
        {"a.u8", QL_GGUF_U8, a_u8, 3, 1},      {"a.i8", QL_GGUF_I8, a_i8, 3, 1},
        {"a.u16", QL_GGUF_U16, a_u16, 2, 2},   {"a.i16", QL_GGUF_I16, a_i16, 3, 2},
        {"a.u32", QL_GGUF_U32, a_u32, 2, 4},   {"a.i32", QL_GGUF_I32, a_i32, 2, 4},
        {"a.f32", QL_GGUF_F32, a_f32, 4, 4},   {"a.bool", QL_GGUF_BOOL, a_bool, 3, 1},
        {"a.u64", QL_GGUF_U64, a_u64, 2, 8},   {"a.i64", QL_GGUF_I64, a_i64, 2, 8},
        {"a.f64", QL_GGUF_F64, a_f64, 2, 8},   {"a.empty", QL_GGUF_U32, nullptr, 0, 4},
    };

    for (int align : {32, 64}) {
        CAPTURE(align);
        ql_gguf_writer *w = ql_gguf_writer_new();
        ql_gguf_set_str(w, "general.architecture", "llama");
        if (align != 32) ql_gguf_set_u32(w, "general.alignment", (uint32_t)align);
        ql_gguf_set_u32(w, "k.u32", 123456789u);
        ql_gguf_set_i32(w, "k.i32", -5);
        ql_gguf_set_u64(w, "k.u64", 1ull << 40);
        ql_gguf_set_f32(w, "k.f32", -0.0f);
        ql_gguf_set_bool(w, "k.true", true);
        ql_gguf_set_bool(w, "k.false", false);
        ql_gguf_set_str(w, "k.empty_str", "");
        ql_gguf_set_str(w, "k.utf8", "h\xc3\xa9llo");
        for (const adesc &a : arrs) ql_gguf_set_arr(w, a.key, a.elem, a.data, a.n);
        ql_gguf_set_arr_str(w, "a.strs", k_strs, 3);
        ql_gguf_set_arr_str(w, "a.no_strs", nullptr, 0);
        for (int i = 0; i < nt; i++)
            REQUIRE(ql_gguf_add_tensor(w, tds[i].name, tds[i].type, tds[i].n_dims, tds[i].ne, data[i].data(),
                                       data[i].size()) == QL_OK);
        const std::string path = dir.file(align == 32 ? "a32.gguf" : "a64.gguf");
        char err[256];
        REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
        ql_gguf_writer_free(w);

        ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
        REQUIRE_MESSAGE(g, err);
        CHECK(ql_gguf_version(g) == 3);
        CHECK(ql_gguf_alignment(g) == (size_t)align);
        CHECK(ql_gguf_data_offset(g) % align == 0);
        const int64_t n_kv_expected = 9 + (align != 32) + 12 + 2;
        CHECK(ql_gguf_n_kv(g) == n_kv_expected);
        CHECK(std::string(ql_gguf_kv_key(g, 0)) == "general.architecture");  // insertion order
        size_t len;
        int64_t iv;
        uint64_t uv;
        double dv;
        bool bv;
        CHECK(std::string(ql_gguf_get_str(g, ql_gguf_find_kv(g, "general.architecture"), &len)) == "llama");
        CHECK((ql_gguf_get_u64(g, ql_gguf_find_kv(g, "k.u32"), &uv) && uv == 123456789u));
        CHECK(ql_gguf_kv_type(g, ql_gguf_find_kv(g, "k.u32")) == QL_GGUF_U32);
        CHECK((ql_gguf_get_i64(g, ql_gguf_find_kv(g, "k.i32"), &iv) && iv == -5));
        CHECK(ql_gguf_kv_type(g, ql_gguf_find_kv(g, "k.i32")) == QL_GGUF_I32);
        CHECK((ql_gguf_get_u64(g, ql_gguf_find_kv(g, "k.u64"), &uv) && uv == 1ull << 40));
        CHECK(ql_gguf_kv_type(g, ql_gguf_find_kv(g, "k.u64")) == QL_GGUF_U64);
        CHECK((ql_gguf_get_f64(g, ql_gguf_find_kv(g, "k.f32"), &dv) && dv == 0.0 && std::signbit(dv)));
        CHECK((ql_gguf_get_bool(g, ql_gguf_find_kv(g, "k.true"), &bv) && bv));
        CHECK((ql_gguf_get_bool(g, ql_gguf_find_kv(g, "k.false"), &bv) && !bv));
        const char *s = ql_gguf_get_str(g, ql_gguf_find_kv(g, "k.empty_str"), &len);
        CHECK((s && len == 0));
        s = ql_gguf_get_str(g, ql_gguf_find_kv(g, "k.utf8"), &len);
        CHECK((s && len == 6 && !memcmp(s, "h\xc3\xa9llo", 7)));
        if (align != 32) CHECK(ql_gguf_kv_type(g, ql_gguf_find_kv(g, "general.alignment")) == QL_GGUF_U32);
        for (const adesc &a : arrs) {
            CAPTURE(a.key);
            const int64_t i = ql_gguf_find_kv(g, a.key);
            REQUIRE(i >= 0);
            CHECK(ql_gguf_kv_type(g, i) == QL_GGUF_ARRAY);
            CHECK(ql_gguf_arr_type(g, i) == a.elem);
            REQUIRE(ql_gguf_arr_n(g, i) == a.n);
            const void *d = ql_gguf_arr_data(g, i);
            REQUIRE(d);
            CHECK((uintptr_t)d % 8 == 0);  // numeric arrays are 8-aligned copies
            if (a.n) CHECK(memcmp(d, a.data, a.n * a.esz) == 0);
        }
        const int64_t si = ql_gguf_find_kv(g, "a.strs");
        REQUIRE(ql_gguf_arr_n(g, si) == 3);
        for (uint64_t j = 0; j < 3; j++) CHECK(std::string(ql_gguf_arr_str(g, si, j, &len)) == k_strs[j]);
        CHECK(ql_gguf_arr_type(g, ql_gguf_find_kv(g, "a.no_strs")) == QL_GGUF_STRING);
        CHECK(ql_gguf_arr_n(g, ql_gguf_find_kv(g, "a.no_strs")) == 0);

        REQUIRE(ql_gguf_n_tensors(g) == nt);
        for (int i = 0; i < nt; i++) {
            CAPTURE(tds[i].name);
            CHECK(std::string(ql_gguf_tensor_name(g, i)) == tds[i].name);
            CHECK(ql_gguf_find_tensor(g, tds[i].name) == i);
            CHECK(ql_gguf_tensor_type(g, i) == tds[i].type);
            int64_t ne[4];
            CHECK(ql_gguf_tensor_ne(g, i, ne) == tds[i].n_dims);
            for (int d = 0; d < 4; d++) CHECK(ne[d] == tds[i].ne[d]);
            REQUIRE(ql_gguf_tensor_size(g, i) == data[i].size());
            const void *d = ql_gguf_tensor_data(g, i);
            REQUIRE(d);
            CHECK((uintptr_t)d % (uintptr_t)align == 0);
            if (!data[i].empty()) CHECK(memcmp(d, data[i].data(), data[i].size()) == 0);
        }
        ql_gguf_close(g);
    }
}

TEST_CASE("gguf: the real vocab files open and copy back byte for byte" * needs_fixture("tokenizer-vectors/ggml-vocab-llama-spm.gguf") *
          needs_fixture("tokenizer-vectors/ggml-vocab-gpt-2.gguf")) {
    const std::string fx = fixtures_dir();
    fixture("tokenizer-vectors/ggml-vocab-llama-spm.gguf");
    fixture("tokenizer-vectors/ggml-vocab-gpt-2.gguf");
    tmpdir dir;
    struct {
        const char *file;
        uint64_t n_tokens;
    } cases[] = {{"ggml-vocab-llama-spm.gguf", 32000}, {"ggml-vocab-gpt-2.gguf", 50257}};
    for (const auto &c : cases) {
        const std::string path = fx + "/tokenizer-vectors/" + c.file;
        char err[256];
        ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
        if (!g && damaged_by_text_conversion(read_file_bytes(path))) {
            // the reader must refuse it cleanly, and the damaged fixture is a failure, never a skip
            CHECK(has(err, path.c_str()));
            FAIL_CHECK("fixture " << path << " is DAMAGED (valid UTF-8 throughout, U+FFFD where bytes were: it went "
                       "through a text conversion) and was refused: " << std::string(err) << " -- replace it with "
                       "llama.cpp's models/" << std::string(c.file));
            continue;
        }
        REQUIRE_MESSAGE(g, err);
        INFO(path);
        CHECK(ql_gguf_version(g) == 3);
        const int64_t arch = ql_gguf_find_kv(g, "general.architecture");
        REQUIRE(arch >= 0);
        CHECK(ql_gguf_kv_type(g, arch) == QL_GGUF_STRING);
        CHECK(ql_gguf_get_str(g, arch, nullptr) != nullptr);
        const int64_t tok = ql_gguf_find_kv(g, "tokenizer.ggml.tokens");
        REQUIRE(tok >= 0);
        CHECK(ql_gguf_arr_type(g, tok) == QL_GGUF_STRING);
        CHECK(ql_gguf_arr_n(g, tok) == c.n_tokens);
        size_t len = 0;
        CHECK(ql_gguf_arr_str(g, tok, c.n_tokens - 1, &len) != nullptr);
        CHECK(ql_gguf_n_tensors(g) == 0);

        ql_gguf_writer *w = ql_gguf_writer_new();
        for (int64_t i = 0; i < ql_gguf_n_kv(g); i++) ql_gguf_copy_kv(w, g, i);
        const std::string out = dir.file("copy.gguf");
        REQUIRE_MESSAGE(ql_gguf_write(w, out.c_str(), err, sizeof(err)) == QL_OK, err);
        CHECK(read_file_bytes(out) == read_file_bytes(path));
        ql_gguf_writer_free(w);
        ql_gguf_close(g);
    }
}

TEST_CASE("gguf: a file cut at every byte fails cleanly; only the whole file opens") {
    const bytes_t f = all_kinds_file();
    for (size_t n = 0; n < f.b.size(); n++) {
        const std::vector<uint8_t> cut(f.b.begin(), f.b.begin() + (ptrdiff_t)n);
        const std::string e = open_error(cut);
        if (e.empty()) FAIL("a prefix of " << n << " of " << f.b.size() << " bytes opened");
    }
    CHECK(open_error(f.b).empty());
}

TEST_CASE("gguf: flipping any header byte never crashes") {
    const bytes_t f = all_kinds_file();
    char err[256];
    ql_gguf *g = ql_gguf_open_memory(f.b.data(), f.b.size(), err, sizeof(err));
    REQUIRE(g);
    const size_t header = ql_gguf_data_offset(g);
    ql_gguf_close(g);
    int opened = 0, failed = 0;
    for (size_t i = 0; i < header; i++)
        for (uint8_t x : {0x01, 0x80, 0xff}) {
            std::vector<uint8_t> b = f.b;
            b[i] ^= x;
            (open_error(b).empty() ? opened : failed)++;  // open_error checks the message's form
        }
    CHECK(failed > 0);
    CHECK(opened > 0);  // e.g. a flipped value byte is still a valid file
}

TEST_CASE("gguf: malformed files fail with a message naming the problem") {
    // a minimal valid file to start from
    auto valid = [] {
        bytes_t f;
        f.header(3, 1, 1).kv("general.architecture", QL_GGUF_STRING).str("llama");
        f.tinfo("w", {8}, QL_TYPE_F32, 0).pad(32).zeros(32);
        return f;
    };
    CHECK(open_error(valid().b).empty());
    // one tensor described by the caller, 256 data bytes after the aligned infos
    auto one_tensor = [](std::vector<uint64_t> ne, uint32_t type, uint64_t offset, size_t data_bytes = 256) {
        bytes_t f;
        f.header(3, 1, 0).tinfo("t", ne, type, offset).pad(32).zeros(data_bytes);
        return f;
    };
    auto with_kv = [](const std::function<void(bytes_t &)> &kv) {  // one KV, then one f32 [8] tensor
        bytes_t f;
        f.header(3, 1, 1);
        kv(f);
        f.tinfo("w", {8}, QL_TYPE_F32, 0).pad(64).zeros(64);
        return f;
    };

    SUBCASE("magic and version") {
        bytes_t f = valid();
        f.b[3] = 'X';
        CHECK_FAILS(f, "bad magic");
        CHECK_FAILS(bytes_t().raw("GG", 2), "too short");
        CHECK_FAILS(bytes_t(), "too short");
        f = valid();
        f.b[4] = 1;
        CHECK_FAILS(f, "version 1");
        f.b[4] = 99;
        CHECK_FAILS(f, "version 99");
        f.b[4] = 0, f.b[7] = 3;  // a big-endian v3 file
        CHECK_FAILS(f, "big-endian");
    }
    SUBCASE("absurd counts") {
        CHECK_FAILS(bytes_t().header(3, 0, 1ull << 60).zeros(100), "n_kv");
        CHECK_FAILS(bytes_t().header(3, 1ull << 60, 0).zeros(100), "n_tensors");
        CHECK_FAILS(bytes_t().header(3, ~0ull, ~0ull).zeros(100), "cannot fit");
        CHECK_FAILS(bytes_t().header(3, 2, 5).zeros(90), "cannot fit");  // 2*32 + 5*13 > 90
    }
    SUBCASE("strings") {
        CHECK_FAILS(bytes_t().header(3, 0, 1).u64(1000).raw("abc", 3).zeros(20), "past the end");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("k", QL_GGUF_STRING).u64(1000).zeros(20), "past the end");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("k", QL_GGUF_STRING).u64(~0ull).zeros(20), "past the end");
        bytes_t huge;
        huge.header(3, 0, 1).str(std::string(70000, 'k')).u32(QL_GGUF_U8).u8(1);
        CHECK_FAILS(huge, "over the limit");
        CHECK_FAILS(bytes_t().header(3, 0, 1).u64(1ull << 63).zeros(20), "over the limit");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv(std::string("a\0b", 3), QL_GGUF_U8).u8(1), "NUL");
        CHECK_FAILS(bytes_t().header(3, 0, 2).kv("a", QL_GGUF_U8).u8(1).kv("a", QL_GGUF_U8).u8(2), "duplicate key");
    }
    SUBCASE("values") {
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("k", 13).u64(0), "unknown value type 13");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("k", 0xffffffffu).u64(0), "unknown value type 4294967295");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("b", QL_GGUF_BOOL).u8(2).zeros(8), "bool value is 2");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("b", QL_GGUF_BOOL, 3).u8(1).u8(0).u8(2), "bool element 2");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("n", QL_GGUF_ARRAY, 1).u32(QL_GGUF_U8).u64(1).u8(0), "nested");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("n", 13, 1).u8(0), "unknown array element type 13");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("a", QL_GGUF_U32, 1ull << 62).zeros(16), "past the end");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("a", QL_GGUF_U64, 3).zeros(16), "past the end");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("a", QL_GGUF_STRING, 1ull << 61).zeros(16), "cannot fit");
        CHECK_FAILS(bytes_t().header(3, 0, 1).arr("a", QL_GGUF_STRING, 2).str("x").u64(50).zeros(8), "past the end");
        CHECK_FAILS(bytes_t().header(3, 0, 1).kv("k", QL_GGUF_U64).u32(0), "truncated");
    }
    SUBCASE("alignment") {
        CHECK(open_error(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U32).u32(64); }).b).empty());
        CHECK(open_error(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U64).u64(64); }).b).empty());
        CHECK(open_error(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_I32).u32(64); }).b).empty());
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U32).u32(0); }), "general.alignment is 0");
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U32).u32(3); }), "general.alignment is 3");
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_I32).u32((uint32_t)-64); }),
                    "general.alignment is -64");
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_STRING).str("64"); }),
                    "general.alignment has type string");
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_F32).f32(64); }),
                    "general.alignment has type f32");
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U8).u8(64); }),
                    "general.alignment has type u8");
        // alignment 1 lets a float tensor start anywhere: read in place, it must sit at a float's
        // alignment (of the offsets 0..3 after the infos, 3 are refused; UB before, not a message)
        int refused = 0;
        for (uint64_t off = 0; off < 4; off++) {
            bytes_t f;
            f.header(3, 1, 1).kv("general.alignment", QL_GGUF_U32).u32(1).tinfo("w", {8}, QL_TYPE_F32, off).zeros(64);
            const std::string e = open_error(f.b);
            if (!e.empty()) {
                CHECK_MESSAGE(e.find("its f32 data starts at an address not a multiple of 4 (general.alignment 1)") !=
                                  std::string::npos, e);
                refused++;
            }
        }
        CHECK(refused == 3);
        // a huge alignment: refused by name (its padding would be made in memory by the writer)
        CHECK_FAILS(with_kv([](bytes_t &f) { f.kv("general.alignment", QL_GGUF_U64).u64(1ull << 63); }),
                    "general.alignment is 9223372036854775808, above the 1 MiB this reader and writer take");
    }
    SUBCASE("tensor infos") {
        CHECK(open_error(one_tensor({32, 2}, QL_TYPE_Q8_0, 0).b).empty());
        CHECK(open_error(one_tensor({0, 7}, QL_TYPE_F32, 0).b).empty());  // empty tensors are fine
        bytes_t f;
        f.header(3, 2, 0).tinfo("t", {8}, QL_TYPE_F32, 0).tinfo("t", {8}, QL_TYPE_F32, 32).pad(32).zeros(64);
        CHECK_FAILS(f, "duplicate tensor name");
        CHECK_FAILS(bytes_t().header(3, 1, 0).tinfo(std::string(64, 'n'), {8}, QL_TYPE_F32, 0).pad(32).zeros(32),
                    "name length 64");
        CHECK(open_error(bytes_t().header(3, 1, 0).tinfo(std::string(63, 'n'), {8}, QL_TYPE_F32, 0).pad(32).zeros(32).b)
                  .empty());
        CHECK_FAILS(bytes_t().header(3, 1, 0).tinfo(std::string("a\0b", 3), {8}, QL_TYPE_F32, 0).pad(32).zeros(32), "NUL");
        CHECK_FAILS(one_tensor({}, QL_TYPE_F32, 0), "n_dims 0");
        CHECK_FAILS(one_tensor({1, 1, 1, 1, 1}, QL_TYPE_F32, 0), "n_dims 5");
        CHECK_FAILS(one_tensor({8}, 16, 0), "type iq2_xxs (ggml id 16) is not supported --> hint: requantize");
        CHECK_FAILS(one_tensor({8}, 99, 0), "unknown tensor type id 99");
        CHECK_FAILS(one_tensor({8}, 1000, 0), "unknown tensor type id 1000");
        CHECK_FAILS(one_tensor({8}, QL_TYPE_COUNT, 0), "unknown tensor type id");
        CHECK_FAILS(one_tensor({33}, QL_TYPE_Q8_0, 0), "not a multiple of q8_0's block size 32");
        CHECK_FAILS(one_tensor({1ull << 40, 1ull << 40}, QL_TYPE_F32, 0), "overflows");
        CHECK_FAILS(one_tensor({1ull << 62, 2, 2}, QL_TYPE_F32, 0), "overflows");
        CHECK_FAILS(one_tensor({1ull << 63}, QL_TYPE_F32, 0), "over INT64_MAX");
        CHECK_FAILS(one_tensor({1ull << 30}, QL_TYPE_F32, 0), "need more than");  // 4 GiB in a small file
        CHECK_FAILS(one_tensor({8}, QL_TYPE_F32, 4), "not a multiple of the alignment 32");
        CHECK_FAILS(one_tensor({8}, QL_TYPE_F32, 1024), "past the end");
        CHECK_FAILS(one_tensor({8}, QL_TYPE_F32, 256), "past the end");  // starts at the end, 32 bytes long
        CHECK_FAILS(one_tensor({8}, QL_TYPE_F32, ~0ull - 31), "past the end");
        // nf4: rows + side data must fit; the rows alone are not enough; zeroed side data
        // (a block count of 0 in its header) is corrupt
        const size_t nf4_bytes = ql_type_data_size(QL_TYPE_NF4, 4, 64);
        CHECK_FAILS(one_tensor({64, 4}, QL_TYPE_NF4, 0, nf4_bytes), "side data does not describe");
        CHECK_FAILS(one_tensor({64, 4}, QL_TYPE_NF4, 0, nf4_bytes - 1), "past the end");
        CHECK_FAILS(one_tensor({64, 4}, QL_TYPE_NF4, 0, 4 * 32), "past the end");
        bytes_t ov;
        ov.header(3, 2, 0).tinfo("a", {16}, QL_TYPE_F32, 0).tinfo("b", {8}, QL_TYPE_F32, 32).pad(32).zeros(96);
        CHECK_FAILS(ov, "overlap");
        bytes_t nodata;  // infos fine, but the file ends before the data section
        nodata.header(3, 1, 0).tinfo("t", {8}, QL_TYPE_F32, 0).u8(0);
        CHECK_FAILS(nodata, "data section");
    }
}

TEST_CASE("gguf: writer refusals and KV order") {
    tmpdir dir;
    char err[512];
    ql_gguf_writer *w = ql_gguf_writer_new();
    float buf[64] = {0};
    const int64_t ne8[2] = {8, 2};
    CHECK(ql_gguf_add_tensor(w, std::string(64, 'n').c_str(), QL_TYPE_F32, 1, ne8, buf, 32) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, std::string(63, 'n').c_str(), QL_TYPE_F32, 1, ne8, buf, 32) == QL_OK);
    CHECK(ql_gguf_add_tensor(w, "", QL_TYPE_F32, 1, ne8, buf, 32) == QL_OK);
    CHECK(ql_gguf_add_tensor(w, nullptr, QL_TYPE_F32, 1, ne8, buf, 32) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, ne8, buf, 63) == QL_ERR_INVALID);  // wrong size
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, ne8, buf, 65) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, ne8, nullptr, 64) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 0, ne8, buf, 64) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 5, ne8, buf, 64) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", (ql_type)3, 2, ne8, buf, 64) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_COUNT, 2, ne8, buf, 64) == QL_ERR_INVALID);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, nullptr, buf, 64) == QL_ERR_INVALID);
    const int64_t neg[2] = {-8, -2};
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, neg, buf, 64) == QL_ERR_INVALID);
    const int64_t q33[1] = {33};
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_Q8_0, 1, q33, buf, 34) == QL_ERR_INVALID);
    const int64_t huge[2] = {1ll << 40, 1ll << 40};
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, huge, buf, 64) == QL_ERR_INVALID);
    const int64_t nf4ne[2] = {64, 1};
    CHECK(ql_gguf_add_tensor(w, "nf4", QL_TYPE_NF4, 2, nf4ne, buf, 32) == QL_ERR_INVALID);  // rows only: no side data
    std::vector<uint8_t> nf4(ql_type_data_size(QL_TYPE_NF4, 1, 64));
    std::vector<float> nf4w(64, 0.25f);
    REQUIRE(ql_quantize(QL_TYPE_NF4, nf4w.data(), 1, 64, nf4.data(), nullptr, 0) == QL_OK);
    CHECK(ql_gguf_add_tensor(w, "nf4", QL_TYPE_NF4, 2, nf4ne, nf4.data(), nf4.size()) == QL_OK);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, ne8, buf, 64) == QL_OK);
    CHECK(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 2, ne8, buf, 64) == QL_ERR_INVALID);  // duplicate
    // KVs: insertion order, replaced in place, removable
    ql_gguf_set_u32(w, "a", 1);
    ql_gguf_set_str(w, "b", "x");
    ql_gguf_set_u32(w, "c", 3);
    ql_gguf_set_i32(w, "a", -2);  // replaces, keeps the first position, takes the new type
    ql_gguf_remove_kv(w, "c");
    ql_gguf_remove_kv(w, "never-set");
    const std::string path = dir.file("w.gguf");
    REQUIRE_MESSAGE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK, err);
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    REQUIRE(ql_gguf_n_kv(g) == 2);
    CHECK(std::string(ql_gguf_kv_key(g, 0)) == "a");
    CHECK(ql_gguf_kv_type(g, 0) == QL_GGUF_I32);
    CHECK(std::string(ql_gguf_kv_key(g, 1)) == "b");
    CHECK(ql_gguf_n_tensors(g) == 4);  // only the accepted ones
    CHECK(ql_gguf_find_tensor(g, "") == 1);
    ql_gguf_close(g);

    // the writer's alignment must be valid
    ql_gguf_set_u32(w, "general.alignment", 3);
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "general.alignment is 3"));
    ql_gguf_set_f32(w, "general.alignment", 32.0f);
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "general.alignment has type f32"));
    ql_gguf_set_u32(w, "general.alignment", 4);  // valid, but its floats could land at odd addresses
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "general.alignment 4: tensor data needs 8 or more"));
    ql_gguf_remove_kv(w, "general.alignment");
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK);

    // a refused set_* (no return value) makes the write fail with its reason
    ql_gguf_set_arr(w, "bad", QL_GGUF_STRING, buf, 1);
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "set_arr 'bad'"));
    ql_gguf_writer_free(w);

    w = ql_gguf_writer_new();
    ql_gguf_set_u32(w, nullptr, 1);
    CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(has(err, "NULL key"));
    ql_gguf_writer_free(w);
    const uint8_t two[1] = {2};
    for (int k = 0; k < 4; k++) {
        w = ql_gguf_writer_new();
        ql_gguf *none = nullptr;
        const char *strs[2] = {"a", nullptr};
        if (k == 0) ql_gguf_set_arr(w, "b", QL_GGUF_BOOL, two, 1);
        if (k == 1) ql_gguf_set_arr_str(w, "s", strs, 2);
        if (k == 2) ql_gguf_copy_kv(w, none, 0);
        if (k == 3) ql_gguf_set_str(w, "s", nullptr);
        CHECK(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
        ql_gguf_writer_free(w);
    }
}

TEST_CASE("gguf: the write is atomic: failures leave no temporary file and name the path") {
    tmpdir dir;
    char err[512];
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", "llama");
    float buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const int64_t ne[1] = {8};
    REQUIRE(ql_gguf_add_tensor(w, "t", QL_TYPE_F32, 1, ne, buf, sizeof(buf)) == QL_OK);

    const std::string missing = dir.file("no/such/dir/out.gguf");
    CHECK(ql_gguf_write(w, missing.c_str(), err, sizeof(err)) == QL_ERR_IO);
    CHECK_MESSAGE(has(err, missing.c_str()), err);
    CHECK(has(err, strerror(ENOENT)));
    CHECK_FALSE(exists(missing + ".tmp"));

    // the rename fails (the target is a folder): the temporary file must go
    const std::string folder = dir.file("a_folder");
    REQUIRE(mkdir(folder.c_str(), 0755) == 0);
    CHECK(ql_gguf_write(w, folder.c_str(), err, sizeof(err)) == QL_ERR_IO);
    CHECK_MESSAGE(has(err, folder.c_str()), err);
    CHECK(has(err, "renam"));
    CHECK_FALSE(exists(folder + ".tmp"));

    // an existing file is replaced whole
    const std::string path = dir.file("out.gguf");
    FILE *f = fopen(path.c_str(), "wb");
    REQUIRE(f);
    fputs("old contents, longer than nothing", f);
    fclose(f);
    REQUIRE(ql_gguf_write(w, path.c_str(), err, sizeof(err)) == QL_OK);
    CHECK_FALSE(exists(path + ".tmp"));
    ql_gguf *g = ql_gguf_open(path.c_str(), err, sizeof(err));
    REQUIRE_MESSAGE(g, err);
    CHECK(memcmp(ql_gguf_tensor_data(g, 0), buf, sizeof(buf)) == 0);
    ql_gguf_close(g);
    ql_gguf_writer_free(w);

    // the reader's own errors name the path too
    CHECK(ql_gguf_open(missing.c_str(), err, sizeof(err)) == nullptr);
    CHECK(has(err, missing.c_str()));
    CHECK(ql_gguf_open(folder.c_str(), err, sizeof(err)) == nullptr);
    CHECK(has(err, "not a regular file"));
    // the writer replaces by a rename: never where a FIFO or a link is (nor a device)
    {
        const std::string target = dir.file("target.gguf"), link = dir.file("link.gguf"), wfifo = dir.file("w.fifo");
        ql_gguf_writer *w2 = ql_gguf_writer_new();
        ql_gguf_set_str(w2, "general.architecture", "llama");
        REQUIRE(ql_gguf_write(w2, target.c_str(), err, sizeof(err)) == QL_OK);
        REQUIRE(symlink(target.c_str(), link.c_str()) == 0);
        REQUIRE(mkfifo(wfifo.c_str(), 0600) == 0);
        for (const std::string &p : {link, wfifo}) {
            CAPTURE(p);
            CHECK(ql_gguf_write(w2, p.c_str(), err, sizeof(err)) == QL_ERR_INVALID);
            CHECK_MESSAGE(has(err, p + ": exists and is not a regular file"), err);
        }
        struct stat st;
        CHECK((lstat(link.c_str(), &st) == 0 && S_ISLNK(st.st_mode)));
        CHECK((lstat(wfifo.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)));
        ql_gguf_writer_free(w2);
    }
    // a FIFO is refused at once (opening it for reading would wait for a writer: a hang)
    const std::string fifo = dir.file("fifo.gguf");
    REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
    CHECK(ql_gguf_open(fifo.c_str(), err, sizeof(err)) == nullptr);
    CHECK(has(err, (fifo + ": not a regular file").c_str()));
    const std::string empty = dir.file("empty.gguf");
    fclose(fopen(empty.c_str(), "wb"));
    CHECK(ql_gguf_open(empty.c_str(), err, sizeof(err)) == nullptr);
    CHECK(has(err, (empty + ": too short").c_str()));
}
