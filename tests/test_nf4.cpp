// NF4 and the 8-bit dynamic map, bit for bit against tests/golden/nf4.bin (made by
// tests/reference/nf4_golden.py with torch from bitsandbytes' published algorithm), crafted
// blocks, and the bitsandbytes serialised form.
#define QL_INTERNALS  // QL_NF4_THRESHOLDS
#include "../qlora.h"
#include "util.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

const float k_nf4[16] = QL_NF4_VALUES;
const float k_thr[15] = QL_NF4_THRESHOLDS;

// the golden file's input generator, reproduced exactly (integer hashing, exact f32 steps)
std::vector<float> gen_input(int64_t n, uint64_t seed) {
    std::vector<float> out((size_t)n);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int k = 0; k < 4; k++) {
            s += 0x9E3779B97F4A7C15ull;
            uint64_t z = s;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            z ^= z >> 31;
            acc = acc + (float)(z >> 40) * 0x1p-24f;
        }
        const float c = acc - 2.0f;
        out[(size_t)i] = c * 0.05f;
    }
    return out;
}

void shape_input(std::vector<float> &w, int cols) {
    for (int c = 0; c < cols; c++) w[(size_t)(3 * cols + c)] *= 40.0f;
    for (int c = 64; c < 128; c++) w[(size_t)(5 * cols + c)] = 0.0f;
    w[(size_t)(7 * cols + 10)] = 3.5f;
    for (int c = 0; c < 64; c++) w[(size_t)(9 * cols + c)] = -0.02f;
}

struct golden {
    int rows = 0, cols = 0;
    std::vector<float> map, absmax, scales, rec, deq_nodq, deq, input;
    std::vector<uint8_t> packed, codes;
    float offset = 0;
    bool ok = false;
};

std::string golden_path() { return tests_dir() + "golden/nf4.bin"; }

golden load_golden() {
    golden g;
    FILE *f = fopen(golden_path().c_str(), "rb");
    if (!f) return g;
    char magic[8];
    int hdr[3];
    bool ok = fread(magic, 1, 8, f) == 8 && memcmp(magic, "QLNF4GLD", 8) == 0 && fread(hdr, 4, 3, f) == 3 && hdr[0] == 1;
    if (ok) {
        g.rows = hdr[1];
        g.cols = hdr[2];
        const size_t n = (size_t)g.rows * g.cols, nb = n / 64, ng = (nb + 255) / 256;
        auto rd = [&](void *p, size_t bytes) { ok = ok && fread(p, 1, bytes, f) == bytes; };
        g.map.resize(256); rd(g.map.data(), 1024);
        g.packed.resize(n / 2); rd(g.packed.data(), n / 2);
        g.absmax.resize(nb); rd(g.absmax.data(), nb * 4);
        rd(&g.offset, 4);
        g.scales.resize(ng); rd(g.scales.data(), ng * 4);
        g.codes.resize(nb); rd(g.codes.data(), nb);
        g.rec.resize(nb); rd(g.rec.data(), nb * 4);
        g.deq_nodq.resize(2048); rd(g.deq_nodq.data(), 2048 * 4);
        g.deq.resize(2048); rd(g.deq.data(), 2048 * 4);
        g.input.resize(1024); rd(g.input.data(), 1024 * 4);
    }
    fclose(f);
    g.ok = ok;
    return g;
}

bool same_bits(const float *a, const float *b, size_t n, size_t *first_bad = nullptr) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) {
            if (first_bad) *first_bad = i;
            return false;
        }
    return true;
}

}  // namespace

TEST_CASE("nf4: bit-exact against the golden bitsandbytes reference") {
    const golden g = load_golden();
    REQUIRE_MESSAGE(g.ok, "cannot read ", golden_path());
    const int64_t n = (int64_t)g.rows * g.cols, nb = n / 64, ng = (nb + 255) / 256;
    std::vector<float> x = gen_input(n, 20261121);
    shape_input(x, g.cols);
    CHECK(same_bits(x.data(), g.input.data(), 1024));  // the generators agree

    size_t bad = 0;
    CHECK_MESSAGE(same_bits(ql_dynamic_map_signed(), g.map.data(), 256, &bad), "dynamic map differs at ", bad);

    // without double quantisation: packed codes and absmax as bitsandbytes
    std::vector<uint8_t> q(ql_type_data_size(QL_TYPE_NF4_NODQ, g.rows, g.cols));
    char err[256] = "";
    REQUIRE(ql_quantize(QL_TYPE_NF4_NODQ, x.data(), g.rows, g.cols, q.data(), err, sizeof(err)) == QL_OK);
    CHECK(memcmp(q.data(), g.packed.data(), (size_t)n / 2) == 0);
    CHECK(same_bits((const float *)(q.data() + n / 2), g.absmax.data(), (size_t)nb));
    std::vector<float> deq((size_t)n);
    REQUIRE(ql_dequantize(QL_TYPE_NF4_NODQ, q.data(), g.rows, g.cols, deq.data()) == QL_OK);
    CHECK(same_bits(deq.data(), g.deq_nodq.data(), 2048));

    // double quantisation: offset, group scales, 8-bit codes, reconstructed absmax
    std::vector<uint8_t> d(ql_type_data_size(QL_TYPE_NF4, g.rows, g.cols));
    REQUIRE(ql_quantize(QL_TYPE_NF4, x.data(), g.rows, g.cols, d.data(), err, sizeof(err)) == QL_OK);
    CHECK(memcmp(d.data(), g.packed.data(), (size_t)n / 2) == 0);
    std::vector<float> scales((size_t)ng), absmax((size_t)nb), map(256);
    std::vector<uint8_t> codes((size_t)nb), packed((size_t)n / 2);
    float quant_map[16];
    ql_bnb_nf4 out{};
    out.packed = packed.data();
    out.absmax_codes = codes.data();
    out.nested_absmax = scales.data();
    out.quant_map = quant_map;
    out.nested_quant_map = map.data();
    REQUIRE(ql_nf4_to_bnb(QL_TYPE_NF4, d.data(), g.rows, g.cols, &out) == QL_OK);
    CHECK(out.nested);
    CHECK(memcmp(&out.nested_offset, &g.offset, 4) == 0);
    CHECK(same_bits(scales.data(), g.scales.data(), (size_t)ng));
    CHECK(memcmp(codes.data(), g.codes.data(), (size_t)nb) == 0);
    CHECK(same_bits(map.data(), g.map.data(), 256));
    CHECK(same_bits(quant_map, k_nf4, 16));
    REQUIRE(ql_dequantize(QL_TYPE_NF4, d.data(), g.rows, g.cols, deq.data()) == QL_OK);
    CHECK(same_bits(deq.data(), g.deq.data(), 2048));
    // every block's reconstructed absmax: an all-64 block of one value dequantises to +-absmax
    for (int64_t b = 0; b < nb; b++) {
        const float am = g.rec[(size_t)b];
        // the largest |element| of a block is coded +-1.0 and comes back as exactly +-absmax
        float mx = 0;
        for (int i = 0; i < 64; i++) mx = std::max(mx, std::fabs(deq[(size_t)(b * 64 + i)]));
        if (g.absmax[(size_t)b] > 0) CHECK(mx == am);
    }
}

TEST_CASE("nf4: crafted blocks - every threshold, +-absmax, zero block, partial block") {
    // absmax 1 so x*s == x: each threshold goes to the lower code, the next float up to the higher
    std::vector<float> x(64, 0.0f);
    x[0] = 1.0f;
    for (int i = 0; i < 15; i++) {
        x[(size_t)(1 + i)] = k_thr[i];
        x[(size_t)(16 + i)] = std::nextafter(k_thr[i], 2.0f);
    }
    x[31] = -1.0f;
    uint8_t packed[32];
    float am;
    ql_nf4_quantize_flat(x.data(), 64, packed, &am);
    CHECK(am == 1.0f);
    auto code = [&](int i) { return i % 2 == 0 ? packed[i / 2] >> 4 : packed[i / 2] & 15; };
    CHECK(code(0) == 15);
    CHECK(code(31) == 0);
    for (int i = 0; i < 15; i++) {
        CHECK(code(1 + i) == i);       // on the threshold: the lower code
        CHECK(code(16 + i) == i + 1);  // just above: the higher one
    }
    for (int i = 32; i < 64; i++) CHECK(code(i) == 7);  // zeros: NF4's exact 0.0

    std::vector<float> z(64, 0.0f);
    ql_nf4_quantize_flat(z.data(), 64, packed, &am);
    CHECK(am == 0.0f);
    for (uint8_t b : packed) CHECK(b == 0x77);  // guarded: 0 * (1/1e-38) = 0 -> code 7

    // a partial last block (n = 64 + 11): its own absmax, odd tail padded with 0.0's code
    std::vector<float> p(75);
    for (int i = 0; i < 75; i++) p[(size_t)i] = (i < 64 ? 0.01f : 0.5f) * (float)((i % 7) - 3);
    uint8_t pk[38];
    float ams[2];
    ql_nf4_quantize_flat(p.data(), 75, pk, ams);
    CHECK(ams[0] == doctest::Approx(0.03f));
    CHECK(ams[1] == 1.5f);
    CHECK((pk[37] & 15) == 7);   // the pad nibble
    CHECK((pk[37] >> 4) == 11);  // element 74 = 0.5 * (74 % 7 - 3) = 0.5, 0.5 / 1.5 = 0.333 -> code 11
}

TEST_CASE("nf4: non-finite input is refused with its position") {
    std::vector<float> w(4 * 128, 0.5f);
    w[2 * 128 + 70] = NAN;
    std::vector<uint8_t> q(ql_type_data_size(QL_TYPE_NF4, 4, 128));
    char err[200] = "";
    CHECK(ql_quantize(QL_TYPE_NF4, w.data(), 4, 128, q.data(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(std::string(err).find("row 2, column 70") != std::string::npos);
    CHECK(std::string(err).find("nan") != std::string::npos);
    w[2 * 128 + 70] = -INFINITY;
    CHECK(ql_quantize(QL_TYPE_NF4_NODQ, w.data(), 4, 128, q.data(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(std::string(err).find("infinite") != std::string::npos);
    CHECK(ql_quantize(QL_TYPE_NF4, w.data(), 4, 99, q.data(), err, sizeof(err)) == QL_ERR_SHAPE);  // two codes a byte
}

TEST_CASE("nf4: rows that are not whole blocks (172 wide) - bitsandbytes' blocks over the flattened tensor") {
    const int64_t R = 5, E = 172, n = R * E, nb = (n + 63) / 64;  // 860 elements: 14 blocks, the last of 28
    std::mt19937 rng(3);
    std::normal_distribution<float> N(0.0f, 0.1f);
    std::vector<float> w((size_t)n);
    for (float &v : w) v = N(rng);
    std::vector<uint8_t> q(ql_type_data_size(QL_TYPE_NF4_NODQ, R, E)), packed((size_t)n / 2);
    REQUIRE(q.size() == ql_aux_offset((size_t)n / 2) + (size_t)nb * 4);  // 430 bytes of codes, 2 of pad: aligned side data
    REQUIRE(ql_quantize(QL_TYPE_NF4_NODQ, w.data(), R, E, q.data(), nullptr, 0) == QL_OK);
    std::vector<float> absmax((size_t)nb);
    ql_nf4_quantize_flat(w.data(), n, packed.data(), absmax.data());  // bitsandbytes' quantize_4bit on the flat tensor
    CHECK(memcmp(q.data(), packed.data(), packed.size()) == 0);
    CHECK(memcmp(q.data() + ql_aux_offset(packed.size()), absmax.data(), absmax.size() * 4) == 0);
    // dequantised: each element by its flat block's absmax, whichever row it is in
    std::vector<float> d((size_t)n);
    REQUIRE(ql_dequantize(QL_TYPE_NF4_NODQ, q.data(), R, E, d.data()) == QL_OK);
    const float values[16] = QL_NF4_VALUES;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t byte = packed[(size_t)i / 2];
        const float want = values[(i & 1) ? (byte & 15) : (byte >> 4)] * absmax[(size_t)i / 64];
        if (d[(size_t)i] != want) {
            CHECK_MESSAGE(d[(size_t)i] == want, "element ", i);
            break;
        }
    }
    // and the double-quantised type holds the same codes (its absmax through the 8-bit map)
    std::vector<uint8_t> q2(ql_type_data_size(QL_TYPE_NF4, R, E));
    REQUIRE(ql_quantize(QL_TYPE_NF4, w.data(), R, E, q2.data(), nullptr, 0) == QL_OK);
    CHECK(memcmp(q2.data(), packed.data(), packed.size()) == 0);
}

TEST_CASE("dynamic map: structure, and values against the formula in double") {
    const float *m = ql_dynamic_map_signed();
    CHECK(m[127] == 0.0f);
    CHECK(m[255] == 1.0f);
    CHECK(m[0] == doctest::Approx(-0.99296875).epsilon(1e-7));
    for (int i = 1; i < 256; i++) CHECK(m[i - 1] < m[i]);
    // the published construction, in double: linspace(0.1, 1, 2^i + 1) midpoints * 10^(i-6)
    std::vector<double> ref = {0.0, 1.0};
    for (int i = 0; i < 7; i++) {
        const int k = (1 << i) + 1;
        for (int j = 0; j + 1 < k; j++) {
            const double a = 0.1 + 0.9 * j / (k - 1), b = 0.1 + 0.9 * (j + 1) / (k - 1);
            ref.push_back(std::pow(10.0, i - 6) * (a + b) / 2);
            ref.push_back(-std::pow(10.0, i - 6) * (a + b) / 2);
        }
    }
    std::sort(ref.begin(), ref.end());
    for (int i = 0; i < 256; i++) CHECK(m[i] == doctest::Approx(ref[(size_t)i]).epsilon(2e-7));
    // the quantiser: nearest value away from midpoints; each map value maps to itself
    for (int i = 0; i < 256; i++) CHECK(ql_dynamic_quantize(m, m[i]) == i);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> U(-1, 1);
    int off_by_tie = 0;
    for (int t = 0; t < 20000; t++) {
        const float x = U(rng) * (t % 2 ? 1.0f : 0.01f);
        const int q = ql_dynamic_quantize(m, x);
        int best = 0;
        for (int i = 1; i < 256; i++)
            if (std::fabs(m[i] - x) < std::fabs(m[best] - x)) best = i;
        if (q != best) off_by_tie += std::fabs(m[q] - x) == std::fabs(m[best] - x) ? 1 : 1000;
    }
    CHECK(off_by_tie < 1000);  // only exact ties may differ
}

TEST_CASE("nf4: round-trip error on Gaussian weights") {
    const int64_t rows = 64, cols = 1024;
    std::mt19937 rng(7);
    std::normal_distribution<float> N(0.0f, 0.02f);
    std::vector<float> w((size_t)(rows * cols)), back(w.size());
    for (float &v : w) v = N(rng);
    for (ql_type t : {QL_TYPE_NF4, QL_TYPE_NF4_NODQ}) {
        std::vector<uint8_t> q(ql_type_data_size(t, rows, cols));
        REQUIRE(ql_quantize(t, w.data(), rows, cols, q.data(), nullptr, 0) == QL_OK);
        REQUIRE(ql_dequantize(t, q.data(), rows, cols, back.data()) == QL_OK);
        double err = 0, am_sum = 0;
        for (int64_t b = 0; b < rows * cols / 64; b++) {
            float am = 0;
            for (int i = 0; i < 64; i++) am = std::max(am, std::fabs(w[(size_t)(b * 64 + i)]));
            am_sum += am;
            for (int i = 0; i < 64; i++) err += std::fabs(w[(size_t)(b * 64 + i)] - back[(size_t)(b * 64 + i)]);
        }
        const double rel = err / (double)(rows * cols) / (am_sum / (double)(rows * cols / 64));
        MESSAGE(std::string(ql_type_name(t)), ": mean |error| / mean block absmax = ", rel, ", bits per weight ",
                8.0 * (double)q.size() / (double)(rows * cols));
        CHECK(rel < 0.05);  // NF4 on Gaussians: about 0.037
    }
}

TEST_CASE("nf4: bitsandbytes serialised form round-trips losslessly, foreign maps kept") {
    const int64_t rows = 8, cols = 128 * 40;  // 640 blocks: 3 double-quant groups
    std::vector<float> w = gen_input(rows * cols, 3);
    std::vector<uint8_t> ours(ql_type_data_size(QL_TYPE_NF4, rows, cols));
    REQUIRE(ql_quantize(QL_TYPE_NF4, w.data(), rows, cols, ours.data(), nullptr, 0) == QL_OK);
    const int64_t n = rows * cols, nb = n / 64, ng = (nb + 255) / 256;
    std::vector<uint8_t> packed((size_t)n / 2), codes((size_t)nb);
    std::vector<float> scales((size_t)ng), map(256), qmap(16);
    ql_bnb_nf4 b{};
    b.packed = packed.data();
    b.absmax_codes = codes.data();
    b.nested_absmax = scales.data();
    b.quant_map = qmap.data();
    b.nested_quant_map = map.data();
    REQUIRE(ql_nf4_to_bnb(QL_TYPE_NF4, ours.data(), rows, cols, &b) == QL_OK);
    std::vector<uint8_t> back(ours.size());
    char err[256] = "";
    REQUIRE(ql_nf4_from_bnb(&b, QL_TYPE_NF4, cols, back.data(), err, sizeof(err)) == QL_OK);
    CHECK(back == ours);

    // a checkpoint whose map differs in the last bit (another machine's torch): kept as is
    map[200] = std::nextafter(map[200], 2.0f);
    codes[5] = 200;
    REQUIRE(ql_nf4_from_bnb(&b, QL_TYPE_NF4, cols, back.data(), err, sizeof(err)) == QL_OK);
    std::vector<float> deq((size_t)n);
    REQUIRE(ql_dequantize(QL_TYPE_NF4, back.data(), rows, cols, deq.data()) == QL_OK);
    volatile float am5 = map[200] * scales[0];  // bitsandbytes' two roundings (no fused multiply-add)
    const float want = am5 + b.nested_offset;
    float mx = 0;
    for (int i = 0; i < 64; i++) mx = std::max(mx, std::fabs(deq[(size_t)(5 * 64 + i)]));
    CHECK(mx == want);

    // and into plain fp32 absmax: the same dequantised values
    std::vector<uint8_t> plain(ql_type_data_size(QL_TYPE_NF4_NODQ, rows, cols));
    REQUIRE(ql_nf4_from_bnb(&b, QL_TYPE_NF4_NODQ, cols, plain.data(), err, sizeof(err)) == QL_OK);
    std::vector<float> deq2((size_t)n);
    REQUIRE(ql_dequantize(QL_TYPE_NF4_NODQ, plain.data(), rows, cols, deq2.data()) == QL_OK);
    CHECK(same_bits(deq.data(), deq2.data(), (size_t)n));

    // refusals: fp4's map, non-nested into NF4, rows that are not whole blocks
    qmap[3] = 0.5f;
    CHECK(ql_nf4_from_bnb(&b, QL_TYPE_NF4, cols, back.data(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(std::string(err).find("quant_map[3]") != std::string::npos);
    qmap[3] = k_nf4[3];
    ql_bnb_nf4 flat = b;
    flat.nested = false;
    std::vector<float> am((size_t)nb, 1.0f);
    flat.absmax = am.data();
    CHECK(ql_nf4_from_bnb(&flat, QL_TYPE_NF4, cols, back.data(), err, sizeof(err)) == QL_ERR_INVALID);
    CHECK(std::string(err).find("nf4_nodq") != std::string::npos);
    CHECK(ql_nf4_from_bnb(&b, QL_TYPE_NF4, 100, back.data(), err, sizeof(err)) == QL_ERR_SHAPE);
}
