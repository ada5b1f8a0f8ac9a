// tests/test_quants.cpp - ggml block formats (q4_0, q8_0, q4_K, q5_K, q6_K) through the public
// trait table only.
//
// Dequantisation: blocks are built byte by byte in this file from chosen integer codes and
// scales, packed by the layout described in the format comments below (ggml's element order),
// and the expected floats come from the per-element formula applied to those codes. All
// chosen values make every product exact in f32 (d, dmin are powers of two, codes small), so
// the comparison is exact and does not depend on evaluation order or FMA contraction.
//
// Quantisation (q4_0, q8_0 only): exact codes for crafted blocks (ties, zeros, a single
// non-zero, equal magnitudes of both signs) and round-trip error on random data, reported as
// max |x - deq(q(x))| / amax of the block.
#include <doctest/doctest.h>

#define QL_INTERNALS  // the block structs the blocks below are built in (decoded through the public traits)
#include "../qlora.h"
#include "util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

const uint16_t H_0_25 = 0x3400, H_0_5 = 0x3800, H_1 = 0x3C00, H_2 = 0x4000;  // fp16 bits

std::vector<float> deq(ql_type t, const void *blocks, int64_t n) {
    const ql_type_traits *tt = ql_type_traits_get(t);
    REQUIRE(tt);
    REQUIRE((tt->to_float != nullptr));
    std::vector<float> out((size_t)n, NAN);
    tt->to_float(blocks, out.data(), n);
    return out;
}

void check_exact(const std::vector<float> &got, const std::vector<float> &want) {
    REQUIRE(got.size() == want.size());
    int bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (got[i] != want[i] && bad++ < 8) {
            INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
            CHECK(got[i] == want[i]);
        }
    }
    CHECK(bad == 0);
}

// 6-bit scales and mins of the 8 sub-blocks of a q4_K / q5_K block, packed into 12 bytes:
// sub-blocks 0..3: scale in the low 6 bits of byte j, min in the low 6 bits of byte j+4;
// sub-blocks 4..7: low 4 bits of scale / min in the low / high nibble of byte j+4, the scale's
// top 2 bits in the top 2 bits of byte j-4, the min's top 2 bits in the top 2 bits of byte j.
void pack_k4_scales(const int sc[8], const int m[8], uint8_t out[12]) {
    memset(out, 0, 12);
    for (int j = 0; j < 8; j++) {
        REQUIRE(sc[j] >= 0);
        REQUIRE(sc[j] < 64);
        REQUIRE(m[j] >= 0);
        REQUIRE(m[j] < 64);
    }
    for (int j = 0; j < 4; j++) {
        out[j] |= (uint8_t)sc[j];
        out[j + 4] |= (uint8_t)m[j];
    }
    for (int j = 4; j < 8; j++) {
        out[j + 4] = (uint8_t)((sc[j] & 15) | ((m[j] & 15) << 4));
        out[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        out[j] |= (uint8_t)((m[j] >> 4) << 6);
    }
}

}  // namespace

TEST_CASE("quants: trait table rows of the ggml block types") {
    struct Row { ql_type t; const char *name; int64_t blck; size_t size; };
    const Row rows[] = {
        {QL_TYPE_Q4_0, "q4_0", 32, 18},   {QL_TYPE_Q8_0, "q8_0", 32, 34},
        {QL_TYPE_Q4_K, "q4_K", 256, 144}, {QL_TYPE_Q5_K, "q5_K", 256, 176},
        {QL_TYPE_Q6_K, "q6_K", 256, 210},
    };
    for (const Row &r : rows) {
        const ql_type_traits *tt = ql_type_traits_get(r.t);
        REQUIRE(tt);
        INFO(r.name);
        CHECK(std::string(tt->name) == r.name);
        CHECK(tt->blck_size == r.blck);
        CHECK(tt->type_size == r.size);
        CHECK(tt->is_float);
        CHECK((tt->to_float != nullptr));
        CHECK(ql_row_size(r.t, 2 * r.blck) == 2 * r.size);
    }
    CHECK((ql_type_traits_get(QL_TYPE_Q4_0)->from_float != nullptr));
    CHECK((ql_type_traits_get(QL_TYPE_Q8_0)->from_float != nullptr));
    // the fp16 constants used below
    CHECK(ql_fp16_to_fp32(H_0_25) == 0.25f);
    CHECK(ql_fp16_to_fp32(H_0_5) == 0.5f);
    CHECK(ql_fp16_to_fp32(H_1) == 1.0f);
    CHECK(ql_fp16_to_fp32(H_2) == 2.0f);
}

// ---- q4_0: 16 bytes, element j in the low nibble of byte j, element j+16 in its high nibble ----
TEST_CASE("quants: q4_0 dequantisation of hand-built blocks") {
    ql_block_q4_0 b[2];
    std::vector<float> want(64);
    const uint16_t dh[2] = {H_0_5, H_2};
    const float    dv[2] = {0.5f, 2.0f};
    for (int ib = 0; ib < 2; ib++) {
        b[ib].d = dh[ib];
        int code[32];
        for (int i = 0; i < 32; i++) code[i] = (i * 7 + 3 * ib) % 16;
        for (int j = 0; j < 16; j++) b[ib].qs[j] = (uint8_t)(code[j] | (code[j + 16] << 4));
        for (int i = 0; i < 32; i++) want[(size_t)(32 * ib + i)] = dv[ib] * (float)(code[i] - 8);
    }
    check_exact(deq(QL_TYPE_Q4_0, b, 64), want);

    // one literal byte: 0x3A -> element 0 = 0xA, element 16 = 0x3
    ql_block_q4_0 one;
    one.d = H_1;
    memset(one.qs, 0x88, sizeof(one.qs));
    one.qs[0] = 0x3A;
    const std::vector<float> y = deq(QL_TYPE_Q4_0, &one, 32);
    CHECK(y[0] == 2.0f);
    CHECK(y[16] == -5.0f);
    CHECK(y[1] == 0.0f);
}

TEST_CASE("quants: q8_0 dequantisation of hand-built blocks") {
    ql_block_q8_0 b[2];
    std::vector<float> want(64);
    const uint16_t dh[2] = {H_0_25, H_2};
    const float    dv[2] = {0.25f, 2.0f};
    for (int ib = 0; ib < 2; ib++) {
        b[ib].d = dh[ib];
        for (int i = 0; i < 32; i++) {
            const int q = (i * 37 + 11 * ib) % 255 - 127;  // -127..127
            b[ib].qs[i] = (int8_t)q;
            want[(size_t)(32 * ib + i)] = dv[ib] * (float)q;
        }
    }
    b[1].qs[31] = -128;  // representable, even if ggml never writes it
    want[63] = -256.0f;
    check_exact(deq(QL_TYPE_Q8_0, b, 64), want);
}

// ---- q4_K: 8 sub-blocks of 32; qs[32g + l]: low nibble = element 64g + l (sub-block 2g),
//      high nibble = element 64g + 32 + l (sub-block 2g + 1); x = d sc q - dmin m ----
static void build_q4_K(ql_block_q4_K &blk, uint16_t d, uint16_t dmin, const int sc[8], const int m[8],
                       const int code[256]) {
    blk.d = d;
    blk.dmin = dmin;
    pack_k4_scales(sc, m, blk.scales);
    for (int i = 0; i < 256; i++) REQUIRE(code[i] >= 0);
    for (int i = 0; i < 256; i++) REQUIRE(code[i] < 16);
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++)
            blk.qs[32 * g + l] = (uint8_t)(code[64 * g + l] | (code[64 * g + 32 + l] << 4));
}

TEST_CASE("quants: q4_K dequantisation of hand-built blocks") {
    std::mt19937 rng(1234);
    ql_block_q4_K b[2];
    std::vector<float> want(512);
    const uint16_t dh[2] = {H_0_5, H_2}, mh[2] = {H_0_25, H_1};
    const float    dv[2] = {0.5f, 2.0f}, mv[2] = {0.25f, 1.0f};
    for (int ib = 0; ib < 2; ib++) {
        // distinct scales/mins, those of sub-blocks 4..7 >= 16 so their packed top bits matter
        int sc[8], m[8], code[256];
        for (int s = 0; s < 8; s++) {
            sc[s] = ib == 0 ? (s < 4 ? 1 + s : 17 + 13 * (s - 4)) : 63 - 5 * s;
            m[s]  = ib == 0 ? (s < 4 ? 40 + s : 20 + 14 * (s - 4)) : 3 + 7 * s;
        }
        for (int i = 0; i < 256; i++) code[i] = (int)(rng() % 16);
        build_q4_K(b[ib], dh[ib], mh[ib], sc, m, code);
        for (int i = 0; i < 256; i++)
            want[(size_t)(256 * ib + i)] = dv[ib] * (float)sc[i / 32] * (float)code[i] - mv[ib] * (float)m[i / 32];
    }
    check_exact(deq(QL_TYPE_Q4_K, b, 512), want);
}

TEST_CASE("quants: q4_K literal scale bytes") {
    // Scale bytes written out by hand; expected (sc, m) per sub-block worked out on paper:
    //   s0: 0xC1&63 = 1, m 0x85&63 = 5      s4: (0x9A&15)|(0xC1>>6)<<4 = 10|48 = 58, m 9|(0x85>>6=2)<<4 = 41
    //   s1: 0x02 = 2,    m 0x46&63 = 6      s5: (0xBC&15)|(0x02>>6)<<4 = 12,          m 11|(0x46>>6=1)<<4 = 27
    //   s2: 0x43&63 = 3, m 0x07 = 7         s6: (0xDE&15)|(0x43>>6=1)<<4 = 30,        m 13|0 = 13
    //   s3: 0x84&63 = 4, m 0xC8&63 = 8      s7: (0xF0&15)|(0x84>>6=2)<<4 = 32,        m 15|(0xC8>>6=3)<<4 = 63
    const uint8_t sbytes[12] = {0xC1, 0x02, 0x43, 0x84, 0x85, 0x46, 0x07, 0xC8, 0x9A, 0xBC, 0xDE, 0xF0};
    const int sc[8] = {1, 2, 3, 4, 58, 12, 30, 32}, m[8] = {5, 6, 7, 8, 41, 27, 13, 63};
    uint8_t packed[12];
    pack_k4_scales(sc, m, packed);
    CHECK(memcmp(packed, sbytes, 12) == 0);

    ql_block_q4_K b;
    b.d = H_1;
    b.dmin = H_0_25;
    memcpy(b.scales, sbytes, 12);
    memset(b.qs, 0x21, sizeof(b.qs));  // even sub-blocks code 1, odd sub-blocks code 2
    const std::vector<float> y = deq(QL_TYPE_Q4_K, &b, 256);
    for (int s = 0; s < 8; s++) {
        const float want = (float)(sc[s] * (s % 2 ? 2 : 1)) - 0.25f * (float)m[s];
        INFO("sub-block " << s);
        CHECK(y[(size_t)(32 * s)] == want);
        CHECK(y[(size_t)(32 * s + 31)] == want);
    }
}

// ---- q5_K: as q4_K plus the 5th bit of element 32s + l in bit s of qh[l] ----
TEST_CASE("quants: q5_K dequantisation of hand-built blocks") {
    std::mt19937 rng(99);
    ql_block_q5_K b[2];
    std::vector<float> want(512);
    const uint16_t dh[2] = {H_0_5, H_1}, mh[2] = {H_0_25, H_0_5};
    const float    dv[2] = {0.5f, 1.0f}, mv[2] = {0.25f, 0.5f};
    for (int ib = 0; ib < 2; ib++) {
        int sc[8], m[8], code[256];
        for (int s = 0; s < 8; s++) {
            sc[s] = ib == 0 ? 2 + 8 * s : 60 - 3 * s;
            m[s]  = ib == 0 ? 63 - 8 * s : 2 + 8 * s + (s & 1);
        }
        // block 0: a recognisable high-bit pattern (5th bit set where (l + s) % 3 == 0),
        // block 1: random 5-bit codes
        for (int i = 0; i < 256; i++) {
            const int s = i / 32, l = i % 32;
            code[i] = ib == 0 ? (i * 5) % 16 + (((l + s) % 3 == 0) ? 16 : 0) : (int)(rng() % 32);
        }
        b[ib].d = dh[ib];
        b[ib].dmin = mh[ib];
        pack_k4_scales(sc, m, b[ib].scales);
        memset(b[ib].qh, 0, sizeof(b[ib].qh));
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++)
                b[ib].qs[32 * g + l] = (uint8_t)((code[64 * g + l] & 15) | ((code[64 * g + 32 + l] & 15) << 4));
        for (int i = 0; i < 256; i++)
            if (code[i] & 16) b[ib].qh[i % 32] |= (uint8_t)(1u << (i / 32));
        for (int i = 0; i < 256; i++)
            want[(size_t)(256 * ib + i)] = dv[ib] * (float)sc[i / 32] * (float)code[i] - mv[ib] * (float)m[i / 32];
    }
    check_exact(deq(QL_TYPE_Q5_K, b, 512), want);

    // literal: only qh[3] = 0x82 -> elements 32*1 + 3 = 35 and 32*7 + 3 = 227 get +16
    ql_block_q5_K c;
    c.d = H_1;
    c.dmin = 0;
    const int sc1[8] = {1, 1, 1, 1, 1, 1, 1, 1}, m0[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    pack_k4_scales(sc1, m0, c.scales);
    memset(c.qs, 0, sizeof(c.qs));
    memset(c.qh, 0, sizeof(c.qh));
    c.qh[3] = 0x82;
    const std::vector<float> y = deq(QL_TYPE_Q5_K, &c, 256);
    for (int i = 0; i < 256; i++) {
        INFO("element " << i);
        CHECK(y[(size_t)i] == ((i == 35 || i == 227) ? 16.0f : 0.0f));
    }
}

// ---- q6_K: halves of 128 (h); quarter k = (i%128)/32, l = i%32: low 4 bits in
//      ql[64h + 32(k&1) + l] (low nibble for k < 2, high for k >= 2), high 2 bits = bits
//      2k..2k+1 of qh[32h + l]; int8 scale[i/16]; x = d sc (q - 32) ----
TEST_CASE("quants: q6_K dequantisation of hand-built blocks") {
    std::mt19937 rng(7);
    ql_block_q6_K b[2];
    std::vector<float> want(512);
    const uint16_t dh[2] = {H_0_5, H_0_25};
    const float    dv[2] = {0.5f, 0.25f};
    for (int ib = 0; ib < 2; ib++) {
        int sc[16], code[256];
        for (int s = 0; s < 16; s++) sc[s] = ib == 0 ? (s % 2 ? -1 : 1) * (3 + 7 * s) : (int)(rng() % 256) - 128;
        if (ib == 1) { sc[0] = -128; sc[15] = 127; }
        for (int i = 0; i < 256; i++) code[i] = ib == 0 ? (i * 13 + i / 64) % 64 : (int)(rng() % 64);
        b[ib].d = dh[ib];
        for (int s = 0; s < 16; s++) b[ib].scales[s] = (int8_t)sc[s];
        memset(b[ib].ql, 0, sizeof(b[ib].ql));
        memset(b[ib].qh, 0, sizeof(b[ib].qh));
        for (int i = 0; i < 256; i++) {
            const int h = i / 128, k = (i % 128) / 32, l = i % 32;
            b[ib].ql[64 * h + 32 * (k & 1) + l] |= (uint8_t)((code[i] & 15) << (k >= 2 ? 4 : 0));
            b[ib].qh[32 * h + l] |= (uint8_t)((code[i] >> 4) << (2 * k));
        }
        for (int i = 0; i < 256; i++)
            want[(size_t)(256 * ib + i)] = dv[ib] * (float)sc[i / 16] * (float)(code[i] - 32);
    }
    check_exact(deq(QL_TYPE_Q6_K, b, 512), want);

    // literal: ql[32] = 0x5F, qh[0] = 0x0C, scales all 1, d = 1: element 32 (h 0, k 1, l 0)
    // = (0xF | 3 << 4) - 32 = 31; element 96 (k 3, l 0) = (0x5 | 0 << 4) - 32 = -27;
    // element 0 (k 0) = 0 - 32, element 64 (k 2) = 0 - 32
    ql_block_q6_K c;
    memset(&c, 0, sizeof(c));
    c.d = H_1;
    for (int s = 0; s < 16; s++) c.scales[s] = 1;
    c.ql[32] = 0x5F;
    c.qh[0] = 0x0C;
    const std::vector<float> y = deq(QL_TYPE_Q6_K, &c, 256);
    CHECK(y[32] == 31.0f);
    CHECK(y[96] == -27.0f);
    CHECK(y[0] == -32.0f);
    CHECK(y[64] == -32.0f);
    CHECK(y[160] == -32.0f);
}

// ---- quantisation (ggml's reference quantisers) ----

TEST_CASE("quants: q8_0 quantisation, exact codes") {
    const ql_type_traits *tt = ql_type_traits_get(QL_TYPE_Q8_0);
    REQUIRE((tt->from_float != nullptr));
    std::vector<float> x(96, 0.0f);
    // block 0: amax 127 -> d = 1, id = 1: codes = roundf(x), halves away from zero
    const float vals[] = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.5f, -1.5f, 0.49f, -126.5f, 3.25f};
    const int   codes[] = {127, 3, -3, 1, -1, 2, -2, 0, -127, 3};
    for (int j = 0; j < 10; j++) x[(size_t)j] = vals[j];
    // block 1: all zeros. block 2: a single non-zero (3.0 at position 5)
    x[64 + 5] = 3.0f;
    ql_block_q8_0 b[3];
    memset(b, 0x5A, sizeof(b));
    tt->from_float(x.data(), b, 96);
    CHECK(b[0].d == H_1);
    for (int j = 0; j < 32; j++) {
        INFO("element " << j);
        CHECK((int)b[0].qs[j] == (j < 10 ? codes[j] : 0));
    }
    CHECK(b[1].d == 0x0000);
    for (int j = 0; j < 32; j++) CHECK(b[1].qs[j] == 0);
    CHECK(b[2].d == ql_fp32_to_fp16(3.0f / 127.0f));  // fp16 of the f32 d
    for (int j = 0; j < 32; j++) CHECK((int)b[2].qs[j] == (j == 5 ? 127 : 0));
}

TEST_CASE("quants: q4_0 quantisation, exact codes") {
    const ql_type_traits *tt = ql_type_traits_get(QL_TYPE_Q4_0);
    REQUIRE((tt->from_float != nullptr));
    auto code = [](const ql_block_q4_0 &blk, int i) { return i < 16 ? blk.qs[i] & 15 : blk.qs[i - 16] >> 4; };
    std::vector<float> x(160, 0.0f);
    // block 0: max = -8 (first element of largest magnitude) -> d = 1, id = 1, q = min(15, trunc(x + 8.5))
    {
        const float vals[] = {-8.0f, 0.5f, -0.5f, 1.5f, -1.5f, 7.0f, 7.6f, 0.49f, -7.5f, 3.0f};
        for (int j = 0; j < 10; j++) x[(size_t)j] = vals[j];
        x[20] = 8.0f;  // same magnitude as -8 but later: max stays -8; 16.5 -> 16 -> 15
    }
    const int codes0[] = {0, 9, 8, 10, 7, 15, 15, 8, 1, 11};
    // block 1: all zeros -> d = 0 / -8 = -0.0 (fp16 0x8000), id = 0, every code 8
    // block 2: a single non-zero, -2 at element 20 -> d = 0.25, id = 4, code 0, others 8
    x[64 + 20] = -2.0f;
    // block 3: +4 (element 3) before -4 (element 10): max = +4 -> d = -0.5
    x[96 + 3]  = 4.0f;
    x[96 + 10] = -4.0f;
    // block 4: -4 (element 3) before +4 (element 10): max = -4 -> d = 0.5
    x[128 + 3]  = -4.0f;
    x[128 + 10] = 4.0f;
    ql_block_q4_0 b[5];
    memset(b, 0x5A, sizeof(b));
    tt->from_float(x.data(), b, 160);

    CHECK(b[0].d == H_1);
    for (int i = 0; i < 32; i++) {
        INFO("block 0 element " << i);
        CHECK(code(b[0], i) == (i < 10 ? codes0[i] : i == 20 ? 15 : 8));
    }
    CHECK(b[1].d == 0x8000);
    for (int j = 0; j < 16; j++) CHECK(b[1].qs[j] == 0x88);
    CHECK(b[2].d == H_0_25);
    for (int i = 0; i < 32; i++) CHECK(code(b[2], i) == (i == 20 ? 0 : 8));
    CHECK(b[2].qs[4] == 0x08);
    CHECK(b[3].d == (uint16_t)(0x8000 | H_0_5));
    CHECK(code(b[3], 3) == 0);   //  4 * -2 + 8.5 = 0.5 -> 0
    CHECK(code(b[3], 10) == 15); // -4 * -2 + 8.5 = 16.5 -> 16 -> 15
    CHECK(b[4].d == H_0_5);
    CHECK(code(b[4], 3) == 0);
    CHECK(code(b[4], 10) == 15);
    for (int i = 0; i < 32; i++)
        if (i != 3 && i != 10) CHECK(code(b[3], i) == 8);

    // and back: block 3 dequantises to +4 and -3.5 (clamped), zeros elsewhere
    std::vector<float> y(160);
    tt->to_float(b, y.data(), 160);
    CHECK(y[96 + 3] == 4.0f);
    CHECK(y[96 + 10] == -3.5f);
    CHECK(y[96 + 0] == 0.0f);
    for (int i = 0; i < 32; i++) CHECK(y[(size_t)(32 + i)] == 0.0f);
}

TEST_CASE("quants: q8_0 and q4_0 round trip on random data") {
    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t nb = 256, n = nb * 32;
    std::vector<float> x((size_t)n);
    for (int64_t b = 0; b < nb; b++) {
        const float scale = std::ldexp(1.0f, (int)(b % 13) - 6);  // magnitudes 2^-6 .. 2^6
        for (int j = 0; j < 32; j++) x[(size_t)(b * 32 + j)] = scale * nd(rng);
    }
    struct Case { ql_type t; size_t bsz; double bound; };
    // q8_0: |err| <= d/2 + 127 |d - fp16(d)| ~ amax (1/254 + 2^-11);
    // q4_0: the clamp 16 -> 15 costs up to one step d = amax/8, plus the fp16 error of d
    const Case cases[] = {{QL_TYPE_Q8_0, 34, 1.0 / 254 + 1.0 / 2048 + 1e-6}, {QL_TYPE_Q4_0, 18, 1.0 / 8 + 1.0 / 256}};
    for (const Case &c : cases) {
        const ql_type_traits *tt = ql_type_traits_get(c.t);
        std::vector<uint8_t> q((size_t)nb * c.bsz);
        std::vector<float> y((size_t)n);
        tt->from_float(x.data(), q.data(), n);
        tt->to_float(q.data(), y.data(), n);
        double worst = 0, sum = 0;
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(x[(size_t)(b * 32 + j)]));
            for (int j = 0; j < 32; j++) {
                const double e = std::fabs((double)x[(size_t)(b * 32 + j)] - y[(size_t)(b * 32 + j)]) / amax;
                worst = std::max(worst, e);
                sum += e;
            }
        }
        MESSAGE(std::string(tt->name) << " round trip: max |err|/amax = " << worst << ", mean = " << sum / (double)n);
        CHECK(worst <= c.bound);
        // re-quantising the dequantised values gives the same bytes (the block's extreme
        // element reproduces d exactly; every other value sits on its code)
        std::vector<uint8_t> q2(q.size());
        tt->from_float(y.data(), q2.data(), n);
        CHECK(q2 == q);
    }
}

// Every ggml block type against llama.cpp's own Python implementation of the formats (gguf-py's
// gguf.quants, tests/reference/quants_golden.py -> tests/golden/quants.bin): random block bytes
// (fp16 scales made finite; one block of zero scales) dequantised bit for bit, and ggml's
// reference quantisers (q4_0, q4_1, q5_0, q5_1, q8_0) on crafted rows byte for byte.
static void check_golden_blocks(const std::string &file, int *n_deq_out, int *n_q_out) {
    FILE *f = fopen((tests_dir() + "golden/" + file).c_str(), "rb");
    REQUIRE(f);
    std::vector<uint8_t> all;
    uint8_t buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) all.insert(all.end(), buf, buf + n);
    fclose(f);
    size_t at = 0;
    int n_deq = 0, n_q = 0;
    std::vector<std::string> seen;
    while (at + 20 <= all.size()) {
        uint32_t h[5];
        memcpy(h, all.data() + at, sizeof(h));
        at += sizeof(h);
        const uint32_t kind = h[0], blocks = h[2], size = h[3], blck = h[4];
        const ql_type type = (ql_type)h[1];
        const size_t nb = (size_t)blocks * size, ne = (size_t)blocks * blck;
        REQUIRE(at + nb + ne * 4 <= all.size());
        const ql_type_traits *tt = ql_type_traits_get(type);
        REQUIRE_MESSAGE(tt, "type id ", h[1]);
        CAPTURE(tt->name);
        CHECK(tt->blck_size == (int64_t)blck);
        CHECK(tt->type_size == (size_t)size);
        std::vector<float> floats(ne);
        if (kind == 0) {
            const uint8_t *bytes = all.data() + at;
            memcpy(floats.data(), bytes + nb, ne * 4);
            REQUIRE((tt->to_float != nullptr));
            std::vector<float> got(ne, NAN);
            tt->to_float(bytes, got.data(), (int64_t)ne);
            size_t bad = 0, first = ne;
            for (size_t i = 0; i < ne; i++)
                if (memcmp(&got[i], &floats[i], 4) != 0 && bad++ == 0) first = i;
            CHECK_MESSAGE(bad == 0, bad, " of ", ne, " differ; first at ", first, ": ", (first < ne ? got[first] : 0.0f), " vs ",
                          (first < ne ? floats[first] : 0.0f));
            n_deq++;
            seen.push_back(tt->name);
        } else {
            memcpy(floats.data(), all.data() + at, ne * 4);
            const uint8_t *want = all.data() + at + ne * 4;
            REQUIRE((tt->from_float != nullptr));
            std::vector<uint8_t> got(nb, 0xAA);
            tt->from_float(floats.data(), got.data(), (int64_t)ne);
            size_t first = nb;
            for (size_t i = 0; i < nb && first == nb; i++)
                if (got[i] != want[i]) first = i;
            CHECK_MESSAGE(first == nb, "first differing byte ", first, " (block ", first / size, ")");
            n_q++;
        }
        at += nb + ne * 4;
    }
    CHECK(at == all.size());
    *n_deq_out = n_deq;
    *n_q_out = n_q;
}

TEST_CASE("ggml types: every block type bit for bit against gguf-py (llama.cpp's reference in Python)") {
    int n_deq = 0, n_q = 0;
    check_golden_blocks("quants.bin", &n_deq, &n_q);
    CHECK(n_deq == 12);  // q4_0 q4_1 q5_0 q5_1 q8_0 q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs
    CHECK(n_q == 5);
}

// blocks the real llama-quantize wrote (tests/reference/llama_quantize_golden.py), dequantised as gguf-py does
TEST_CASE("ggml types: blocks llama-quantize wrote (q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs q4_1 q5_0 q5_1), bit for bit") {
    int n_deq = 0, n_q = 0;
    check_golden_blocks("quants_llama.bin", &n_deq, &n_q);
    CHECK(n_deq == 10);
}

// ./quantize's k-quants and iq4 against llama.cpp's own (quantize_row_q{4,5,6,2,3}_K_ref, and the
// iq4 searches quantize_iq4_nl/_xs, compiled from ggml-quants.c by tests/reference/kquants_golden.c): 32
// blocks of varied distributions, a zero block, an outlier, a constant block, a zero sub-block.
TEST_CASE("k-quants and iq4: q4_K, q5_K, q6_K, q2_K, q3_K, iq4_nl, iq4_xs byte for byte as llama-quantize's quantisers") {
    FILE *f = fopen((tests_dir() + "golden/kquants.bin").c_str(), "rb");
    REQUIRE(f);
    const int64_t NB = 32, N = 256 * NB;
    std::vector<float> x((size_t)N);
    REQUIRE(fread(x.data(), 4, x.size(), f) == x.size());
    for (ql_type t : {QL_TYPE_Q4_K, QL_TYPE_Q5_K, QL_TYPE_Q6_K, QL_TYPE_Q2_K, QL_TYPE_Q3_K, QL_TYPE_IQ4_NL, QL_TYPE_IQ4_XS}) {
        const ql_type_traits *tt = ql_type_traits_get(t);
        CAPTURE(tt->name);
        REQUIRE((tt->from_float != nullptr));
        std::vector<uint8_t> want((size_t)(N / tt->blck_size) * tt->type_size), got(want.size(), 0xAA);
        REQUIRE(fread(want.data(), 1, want.size(), f) == want.size());
        tt->from_float(x.data(), got.data(), N);
        size_t first = want.size();
        for (size_t i = 0; i < want.size() && first == want.size(); i++)
            if (got[i] != want[i]) first = i;
        CHECK_MESSAGE(first == want.size(), "first differing byte ", first, " (block ", first / tt->type_size, ")");
        // and it is a quantisation: the round trip stays within the type's resolution
        std::vector<float> back((size_t)N);
        tt->to_float(got.data(), back.data(), N);
        double worst = 0;
        for (int64_t b = 0; b < NB; b++) {
            double amax = 0, err = 0;
            for (int64_t i = 256 * b; i < 256 * (b + 1); i++) {
                amax = std::max(amax, (double)std::fabs(x[(size_t)i]));
                err = std::max(err, (double)std::fabs(x[(size_t)i] - back[(size_t)i]));
            }
            if (amax > 0) worst = std::max(worst, err / amax);
        }
        MESSAGE(std::string(tt->name), " worst block error / amax ", worst);
        CHECK(worst < (t == QL_TYPE_Q4_K ? 0.2 : t == QL_TYPE_Q5_K ? 0.1 : t == QL_TYPE_Q6_K ? 0.05 : 0.6));
    }
    uint8_t extra;
    CHECK(fread(&extra, 1, 1, f) == 0);  // every byte of the golden file compared
    fclose(f);
}

// ggml builds its reference quantisers without FMA: q = trunc(x*id + 16.5) rounds x*id first.
// A -march=native build fuses it unless told not to, and then, rarely, a code differs by one
// (llama-quantize's Q5_0 file and ours differed in 1 byte of 180224 before the fix). Found here:
// blocks where the fused and the unfused sums truncate differently; ours must be the unfused.
TEST_CASE("q5_0: the reference's two roundings (x*id, then + 16.5), not a fused multiply-add") {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (ql_type t : {QL_TYPE_Q5_0}) {  // (in q4_0 such blocks are rarer still: none in these tries)
        const float div = t == QL_TYPE_Q5_0 ? -16.0f : -8.0f, add = t == QL_TYPE_Q5_0 ? 16.5f : 8.5f;
        const int top = t == QL_TYPE_Q5_0 ? 31 : 15;
        const ql_type_traits *tt = ql_type_traits_get(t);
        int found = 0;
        for (int tries = 0; tries < 400000 && found < 2; tries++) {
            float x[32];
            for (float &v : x) v = nd(rng);
            float amax = 0, max = 0;
            for (float v : x)
                if (std::fabs(v) > amax) amax = std::fabs(v), max = v;
            const float d = max / div, id = 1.0f / d;
            int j_diff = -1;
            for (int j = 0; j < 32 && j_diff < 0; j++) {
                volatile float p = x[j] * id;
                const float unfused = p + add, fused = std::fma(x[j], id, add);
                if ((int)unfused != (int)fused) j_diff = j;
            }
            if (j_diff < 0) continue;
            found++;
            uint8_t blk[32];
            tt->from_float(x, blk, 32);
            std::vector<float> back(32);
            tt->to_float(blk, back.data(), 32);
            volatile float p = x[j_diff] * id;
            const int want = std::min(top, (int)(p + add));
            const float dq = ql_fp16_to_fp32(ql_fp32_to_fp16(d));
            CHECK_MESSAGE(back[(size_t)j_diff] == (float)(want - (top + 1) / 2) * dq, "element ", j_diff, " of a block where fusing changes its code");
        }
        CHECK(found == 2);  // the case is exercised
    }
}

// Which products a CUDA device runs as the decode kernel that reads the packed weight (no
// dequantised tile, no workspace): the planner's rule, which the device follows (through the shim,
// test_backend_ops' "decode product" cases run it against the CPU).
TEST_CASE("cuda rules: decode products read the packed weight, others take tiles") {
    ql_init_params ip = {16u << 20, nullptr, true, false};
    ql_context *ctx = ql_init(ip);
    REQUIRE(ctx);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_Q4_K, 512, 64), *x1 = ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 1);
    ql_tensor *x8 = ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, QL_CUDA_GEMV_MAX_N), *x9 = ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 9);
    ql_tensor *y1 = ql_mul_mat(ctx, w, x1), *y8 = ql_mul_mat(ctx, w, x8), *y9 = ql_mul_mat(ctx, w, x9);
    CHECK(ql_cuda_mm_gemv(y1));
    CHECK(ql_cuda_mm_gemv(y8));
    CHECK_FALSE(ql_cuda_mm_gemv(y9));  // a GEMM's worth of columns: tiles and cuBLAS
    CHECK(ql_cuda_work_size(y1, 90) == 0);
    CHECK(ql_cuda_work_size(y9, 90) > 0);
    CHECK(ql_cuda_mm_gemv(ql_mul_mat(ctx, w, ql_cast(ctx, x1, QL_TYPE_BF16))));  // 16-bit b: its bits read as they are
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat_to(ctx, ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 64), ql_cast(ctx, x1, QL_TYPE_BF16),
                                              QL_TYPE_BF16)));  // a 16-bit result
    // onto an f32 c (decode's residual, added by the o and down projections): the kernel adds it as it writes
    CHECK(ql_cuda_mm_gemv(ql_mul_mat_acc(ctx, w, x1, ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 1))));
    CHECK(ql_cuda_mm_gemv(ql_mul_mat_acc(ctx, ql_new_tensor_2d(ctx, QL_TYPE_F32, 512, 64), x1, ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 1))));
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat_acc(ctx, w, ql_cast(ctx, x1, QL_TYPE_BF16),
                                               ql_new_tensor_2d(ctx, QL_TYPE_BF16, 64, 1))));  // onto a 16-bit c: a 16-bit result
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat(ctx, ql_transpose(ctx, w), ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 1))));  // W^T: by rows of W
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat(ctx, ql_new_tensor_2d(ctx, QL_TYPE_NF4, 172, 5), ql_new_tensor_2d(ctx, QL_TYPE_F32, 172, 1))));
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat(ctx, w, ql_new_tensor_3d(ctx, QL_TYPE_F32, 512, 1, 2))));  // batched b
    CHECK_FALSE(ql_cuda_mm_gemv(ql_mul_mat(ctx, w, ql_transpose(ctx, ql_new_tensor_2d(ctx, QL_TYPE_F32, 3, 512)))));  // strided b
    ql_free(ctx);
}
