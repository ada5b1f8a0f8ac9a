// GGUF reader edges a fuzz campaign found: NF4 side data of a tensor whose element count is not
// a multiple of 8 (the reader and ql_dequantize must find it at the same place), non-finite
// absmax, and element counts that overflow before a zero dimension.
#include <doctest/doctest.h>

#include "../qlora.h"
#include "util.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

// a GGUF of one tensor "w" [n] of `type` made by ql's own quantizer and writer; "" when it
// opens again (and dequantizes to `back`), else the reader's error
std::string nf4_round_trip(ql_type type, const std::vector<float> &x, std::vector<float> *back,
                           void (*damage)(std::vector<uint8_t> &, int64_t n) = nullptr) {
    const int64_t n = (int64_t)x.size();
    std::vector<uint8_t> q(ql_type_data_size(type, 1, n));
    char err[512] = "";
    REQUIRE(ql_quantize(type, x.data(), 1, n, q.data(), err, sizeof(err)) == QL_OK);
    if (damage) damage(q, n);
    tmpdir d;
    ql_gguf_writer *w = ql_gguf_writer_new();
    REQUIRE(ql_gguf_add_tensor(w, "w", type, 1, &n, q.data(), q.size()) == QL_OK);
    REQUIRE(ql_gguf_write(w, d.file("m.gguf").c_str(), err, sizeof(err)) == QL_OK);
    ql_gguf_writer_free(w);
    ql_gguf *g = ql_gguf_open(d.file("m.gguf").c_str(), err, sizeof(err));
    if (!g) return err;
    back->assign((size_t)n, 0.0f);
    CHECK(ql_gguf_tensor_size(g, 0) == q.size());
    CHECK(ql_dequantize(type, ql_gguf_tensor_data(g, 0), 1, n, back->data()) == QL_OK);
    ql_gguf_close(g);
    return "";
}

// byte offset of the side data as qlora.h lays it out: after the rows, at a multiple of 4
size_t aux_at(int64_t n) { return ql_aux_offset((size_t)n / 2); }

}  // namespace

TEST_CASE("gguf edges: NF4 and NF4_NODQ of 2..130 elements, written by ql, read back") {
    // element counts not a multiple of 8 put the side data after 1 to 3 bytes of padding: the
    // reader checked the bytes at the padding's start (a valid NF4 file refused as corrupt)
    for (ql_type type : {QL_TYPE_NF4, QL_TYPE_NF4_NODQ})
        for (int64_t n : {2, 4, 6, 8, 10, 62, 64, 66, 130}) {
            const std::string tname = ql_type_name(type);
            CAPTURE(tname);
            CAPTURE(n);
            std::vector<float> x((size_t)n), back;
            for (int64_t i = 0; i < n; i++) x[(size_t)i] = std::sin(0.7f * (float)i + 0.3f) * (1.0f + (float)(i % 5));
            std::vector<float> ref((size_t)n);
            std::vector<uint8_t> q(ql_type_data_size(type, 1, n));
            char err[256];
            REQUIRE(ql_quantize(type, x.data(), 1, n, q.data(), err, sizeof(err)) == QL_OK);
            REQUIRE(ql_dequantize(type, q.data(), 1, n, ref.data()) == QL_OK);
            const std::string e = nf4_round_trip(type, x, &back);
            CHECK_MESSAGE(e.empty(), e);
            if (e.empty()) CHECK(memcmp(back.data(), ref.data(), ref.size() * 4) == 0);
        }
}

TEST_CASE("gguf edges: a NaN or infinite absmax in NF4_NODQ side data is refused, whatever the padding") {
    for (int64_t n : {6, 8, 70}) {
        for (float bad : {NAN, INFINITY}) {
            CAPTURE(n);
            std::vector<float> x((size_t)n, 0.5f), back;
            static float s_bad;
            s_bad = bad;
            // the last block's absmax (the first for n <= 64)
            const std::string e = nf4_round_trip(QL_TYPE_NF4_NODQ, x, &back, [](std::vector<uint8_t> &q, int64_t m) {
                const int64_t nb = (m + 63) / 64;
                memcpy(q.data() + aux_at(m) + (size_t)(nb - 1) * 4, &s_bad, 4);
            });
            CHECK_MESSAGE(has(e, "its nf4_nodq side data does not describe a tensor of " + std::to_string(n) + " elements"), e);
            // ql_dequantize checks the same bytes
            std::vector<uint8_t> q(ql_type_data_size(QL_TYPE_NF4_NODQ, 1, n));
            char err[256];
            REQUIRE(ql_quantize(QL_TYPE_NF4_NODQ, x.data(), 1, n, q.data(), err, sizeof(err)) == QL_OK);
            memcpy(q.data() + aux_at(n), &bad, 4);
            std::vector<float> out((size_t)n);
            CHECK(ql_dequantize(QL_TYPE_NF4_NODQ, q.data(), 1, n, out.data()) == QL_ERR_INVALID);
        }
    }
}

TEST_CASE("gguf edges: NF4 side data whose absmax is not a number is refused") {
    // header: n_blocks (u32), offset (f32), map[256], group scales, one code per block. Finite
    // statistics whose absmax overflows (map * scale + offset = inf) are refused as well.
    for (int64_t n : {6, 64}) {
        CAPTURE(n);
        std::vector<float> x((size_t)n, 0.25f), back;
        CHECK(nf4_round_trip(QL_TYPE_NF4, x, &back).empty());
        const std::string e1 = nf4_round_trip(QL_TYPE_NF4, x, &back, [](std::vector<uint8_t> &q, int64_t m) {
            const float off = NAN;
            memcpy(q.data() + aux_at(m) + 4, &off, 4);
        });
        CHECK_MESSAGE(has(e1, "its nf4 side data does not describe"), e1);
        const std::string e2 = nf4_round_trip(QL_TYPE_NF4, x, &back, [](std::vector<uint8_t> &q, int64_t m) {
            const float off = 3e38f, scale = 3e38f;
            float map[256];
            for (float &v : map) v = 1.0f;
            memcpy(q.data() + aux_at(m) + 4, &off, 4);
            memcpy(q.data() + aux_at(m) + 8, map, sizeof(map));
            memcpy(q.data() + aux_at(m) + 8 + sizeof(map), &scale, 4);  // group 0's scale
        });
        CHECK_MESSAGE(has(e2, "its nf4 side data does not describe"), e2);
    }
}

TEST_CASE("gguf edges: element counts that overflow int64 are refused even when a dimension is 0") {
    // [2^40, 2^40, 0] holds no elements, but 2^40 * 2^40 is no int64: code that multiplies the
    // first two dimensions (as the reader did) overflowed. Every order of the same dimensions
    // gets the same answer.
    auto file = [](std::vector<uint64_t> ne) {
        std::vector<uint8_t> b;
        auto raw = [&](const void *p, size_t n) { b.insert(b.end(), (const uint8_t *)p, (const uint8_t *)p + n); };
        auto u32 = [&](uint32_t v) { raw(&v, 4); };
        auto u64 = [&](uint64_t v) { raw(&v, 8); };
        raw("GGUF", 4), u32(3), u64(1), u64(0);
        u64(1), raw("w", 1), u32((uint32_t)ne.size());
        for (uint64_t v : ne) u64(v);
        u32(QL_TYPE_F32), u64(0);
        while (b.size() % 32) b.push_back(0);
        return b;
    };
    const uint64_t big = 1ull << 40;
    for (std::vector<uint64_t> ne : std::vector<std::vector<uint64_t>>{
             {big, big, 0}, {0, big, big}, {big, 0, big}, {big, big, 1, 0}, {0, 1ull << 62, 4}}) {
        const std::vector<uint8_t> b = file(ne);
        CAPTURE(b.size());
        char err[512] = "";
        ql_gguf *g = ql_gguf_open_memory(b.data(), b.size(), err, sizeof(err));
        CHECK(g == nullptr);
        ql_gguf_close(g);
        CHECK_MESSAGE(has(err, "overflows int64"), err);
    }
    // zero dimensions whose other dimensions multiply to a number: an empty tensor, 0 bytes
    for (std::vector<uint64_t> ne : std::vector<std::vector<uint64_t>>{{big, 0, 1000}, {0, big}, {0}, {8, 0, 0, 0}}) {
        const std::vector<uint8_t> b = file(ne);
        char err[512] = "";
        ql_gguf *g = ql_gguf_open_memory(b.data(), b.size(), err, sizeof(err));
        CHECK_MESSAGE(g != nullptr, err);
        if (g) CHECK(ql_gguf_tensor_size(g, 0) == 0);
        ql_gguf_close(g);
    }
    // the writer counts the same way
    ql_gguf_writer *w = ql_gguf_writer_new();
    const int64_t ne[3] = {(int64_t)big, (int64_t)big, 0};
    CHECK(ql_gguf_add_tensor(w, "w", QL_TYPE_F32, 3, ne, nullptr, 0) == QL_ERR_INVALID);
    ql_gguf_writer_free(w);
}

TEST_CASE("gguf edges: quantize on a model with no elements prints no nan" * needs_tools("quantize")) {
    // a 0-element model: the bits per parameter (converted tensors and whole model) must not divide
    // 0 by 0. q8_0 is llama.cpp's Q8_0 mix, which needs llama.block_count; the one weight matrix
    // [64, 0] is converted (64 is two q8_0 blocks), so quantize gets to its summary lines
    tmpdir d;
    ql_gguf_writer *w = ql_gguf_writer_new();
    ql_gguf_set_str(w, "general.architecture", "llama");
    ql_gguf_set_u32(w, "llama.block_count", 1);
    const int64_t ne[2] = {64, 0};
    REQUIRE(ql_gguf_add_tensor(w, "blk.0.attn_q.weight", QL_TYPE_F32, 2, ne, nullptr, 0) == QL_OK);
    char err[256];
    REQUIRE(ql_gguf_write(w, d.file("in.gguf").c_str(), err, sizeof(err)) == QL_OK);
    ql_gguf_writer_free(w);
    std::string out;
    const int rc = run("./quantize " + d.file("in.gguf") + " " + d.file("out.gguf") + " q8_0", &out);
    CHECK_MESSAGE(rc == 0, out);
    CHECK_MESSAGE(has(out, "quantize: 1 tensors to Q8_0: 0.000 bits per parameter (0 parameters)"), out);
    CHECK_MESSAGE(has(out, "quantize: whole model 0.000 bits per parameter"), out);
    CHECK_MESSAGE(!has(out, "nan"), out);
}
