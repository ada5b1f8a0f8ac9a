// tests/amx_selftest.cpp - the AMX shim itself (build/test-amx-shim only): TDPBF16PS against a
// reference worked out here, loads and stores at a stride, and that the library's bf16 multiplies
// really took the emulated tiles (the rest of that binary's suites then test the kernel's values).
#include "amx_shim.h"

#include <doctest/doctest.h>

#include "../qlora.h"

#include <cstring>
#include <vector>

namespace {
uint16_t bf(float f) {  // exact for the values used here
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
}  // namespace

TEST_CASE("amx shim: TDPBF16PS as the SDM defines it (pair lanes summed apart, then into dst; denormals as zero), loads and stores at a stride") {
    qlamx::tilecfg cfg = {};
    cfg.palette = 1;
    cfg.rows[0] = 3, cfg.colsb[0] = 4 * 5;  // dst: 3 x 5 f32
    cfg.rows[1] = 3, cfg.colsb[1] = 4 * 2;  // a: 3 rows of 2 pairs (K = 4)
    cfg.rows[2] = 2, cfg.colsb[2] = 4 * 5;  // b: 2 pair rows of 5 columns
    cfg.rows[3] = 1, cfg.colsb[3] = 4;      // 1 x 1 tiles for the single cases below
    cfg.rows[4] = 1, cfg.colsb[4] = 4;
    cfg.rows[5] = 1, cfg.colsb[5] = 4;
    _tile_loadconfig(&cfg);
    // small integers: every product and sum exact, so the values are the definition's in any order
    // a[m][k] = m + k + 1, b[k][n] = n - k, dst starts at 100 m + n
    uint16_t a[3][6] = {}, b[2][12] = {};  // rows padded: the stride is not the row's size
    float d0[3][8] = {};
    for (int m = 0; m < 3; m++)
        for (int k = 0; k < 4; k++) a[m][k] = bf((float)(m + k + 1));
    for (int k = 0; k < 4; k++)
        for (int n = 0; n < 5; n++) b[k / 2][2 * n + k % 2] = bf((float)(n - k));
    for (int m = 0; m < 3; m++)
        for (int n = 0; n < 5; n++) d0[m][n] = (float)(100 * m + n);
    _tile_loadd(1, a, sizeof(a[0]));
    _tile_loadd(2, b, sizeof(b[0]));
    _tile_loadd(0, d0, sizeof(d0[0]));
    _tile_dpbf16ps(0, 1, 2);
    float out[3][6];
    memset(out, 0xff, sizeof(out));
    _tile_stored(0, out, sizeof(out[0]));
    for (int m = 0; m < 3; m++) {
        for (int n = 0; n < 5; n++) {
            int want = 100 * m + n;
            for (int k = 0; k < 4; k++) want += (m + k + 1) * (n - k);
            CHECK(out[m][n] == (float)want);
        }
        uint32_t untouched;
        memcpy(&untouched, &out[m][5], 4);
        CHECK(untouched == 0xffffffffu);  // 5 columns stored, the sixth left alone
    }
    // one pair: dst 1, both lanes 2^-12 x 2^-12 = 2^-24. The SDM sums the lanes first (2^-23) and
    // then adds: 1 + 2^-23. Adding each product to dst in turn would round 1 + 2^-24 to 1 twice.
    auto one = [&](float dst, float a0, float a1, float b0, float b1) {
        const uint32_t ap = bf(a0) | (uint32_t)bf(a1) << 16, bp = bf(b0) | (uint32_t)bf(b1) << 16;
        _tile_loadd(3, &dst, 4);
        _tile_loadd(4, &ap, 4);
        _tile_loadd(5, &bp, 4);
        _tile_dpbf16ps(3, 4, 5);
        float r;
        _tile_stored(3, &r, 4);
        return r;
    };
    CHECK(one(1.0f, 0x1p-12f, 0x1p-12f, 0x1p-12f, 0x1p-12f) == 1.0f + 0x1p-23f);
    // denormals: a denormal bf16 input reads as zero (x 2^100 would otherwise give 2^-33 ...);
    uint32_t tiny_u = 0x00010000u;  // bf16 0x0001: the smallest denormal
    float tiny;
    memcpy(&tiny, &tiny_u, 4);
    CHECK(one(0.0f, tiny, 0.0f, 0x1p100f, 0.0f) == 0.0f);
    CHECK(one(0.0f, 0x1p-10f, 0.0f, 0x1p100f, 0.0f) == 0x1p90f);  // (a normal one does count)
    // ... a denormal dst reads as zero, and a denormal result is flushed
    CHECK(one(0x1p-130f, 0x1p-63f, 0.0f, 0x1p-63f, 0.0f) == 0x1p-126f);  // (2^-126 + 2^-130 otherwise)
    CHECK(one(0x1p-140f, 0.0f, 0.0f, 0.0f, 0.0f) == 0.0f);
    CHECK(one(0.0f, 0x1p-70f, 0.0f, 0x1p-70f, 0.0f) == 0.0f);  // 2^-140: below f32's normals
    _tile_release();
}

TEST_CASE("amx shim: the library's bf16 multiplies take the tiles (K a multiple of 32, N >= 16)") {
#if defined(__AVX512F__)
    ql_init_params ip = {8u << 20, nullptr, false, false};
    ql_context *ctx = ql_init(ip);
    ql_tensor *w = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 40);  // [K, M]
    ql_tensor *x = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 33);  // [K, N]
    for (int64_t i = 0; i < 64 * 40; i++) ((float *)w->data)[i] = (float)((i * 7) % 13) - 6.0f;
    for (int64_t i = 0; i < 64 * 33; i++) ((float *)x->data)[i] = (float)((i * 5) % 11) * 0.25f;
    ql_tensor *y = ql_mul_mat(ctx, w, ql_cast(ctx, x, QL_TYPE_BF16));
    ql_graph *g = ql_graph_new(ctx);
    REQUIRE(ql_graph_build_forward(g, y) == QL_OK);
    ql_backend *be = ql_backend_cpu_init(2);
    REQUIRE(ql_graph_alloc(g, be) == QL_OK);
    const long long before = qlamx::n_dp.load();
    REQUIRE(ql_backend_graph_compute(be, g) == QL_OK);
    CHECK(qlamx::n_dp.load() - before >= 2 * 2 * 4);  // 33 tokens: two 32-row blocks; 40 columns: two panels; K 64
    // small integers and quarters: every product and sum exact, in any order
    for (int64_t n = 0; n < 33; n++)
        for (int64_t m = 0; m < 40; m++) {
            double want = 0;
            for (int64_t k = 0; k < 64; k++) want += (double)((float *)w->data)[m * 64 + k] * ((float *)x->data)[n * 64 + k];
            CHECK(((float *)y->data)[n * 40 + m] == (float)want);
        }
    ql_backend_free(be);
    ql_graph_free(g);
    ql_free(ctx);
#else
    MESSAGE("not built: the AMX kernel's panels are AVX-512's 32 columns; this build has no AVX-512");
#endif
}
