// tests/amx_shim.h - Intel AMX-BF16's tile intrinsics in plain C++, so that qlora.cpp's AMX
// kernel runs, and is tested, on a processor without the tiles (build/test-amx-shim: qlora.cpp
// compiled with -DQL_AMX_SHIM -include tests/amx_shim.h).
//
// What it models (Intel SDM, "Intel AMX" and TDPBF16PS):
//   - eight tiles of at most 16 rows x 64 bytes, per thread (each core has its own);
//   - LDTILECFG with palette 1: rows and bytes per row of each tile; TILERELEASE;
//   - TILELOADD / TILESTORED: `rows` rows of `colsb` bytes at base + r * stride;
//   - TILEZERO;
//   - TDPBF16PS dst += a . b: a is M rows of K bf16 pairs, b is K rows of N pairs, dst M x N f32.
//     The order is the SDM's Operation section: for each row, the even and the odd elements of
//     the pairs are summed separately from zero over k (FMAs: each product exact, each sum rounded
//     to nearest even), then the two lanes are added, then that into dst. Denormal inputs read as
//     zero and denormal results are flushed (the instruction's fixed DAZ/FTZ). (The Intrinsics
//     Guide's pseudo-code adds every product straight into dst instead; the SDM is the
//     architecture's definition. Whether real tiles give these bits is not checked here: no AMX.)
// What the hardware would fault on is a failed check here, naming the intrinsic: an instruction
// before the configuration, a tile index past 7, rows or bytes past the palette's limits, shapes
// that do not chain (a's bytes per row != b's rows x 4, dst's shape != a's rows x b's columns).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // first: with the real intrinsics declared, the macros below replace them
#endif
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace qlamx {

struct tilecfg {  // LDTILECFG's 64-byte memory operand, palette 1
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(tilecfg) == 64, "the configuration is 64 bytes");

inline std::atomic<long long> n_dp{0};  // TDPBF16PS executed, all threads: the tests see the path taken

struct state {
    bool configured = false;
    tilecfg cfg{};
    alignas(64) uint8_t t[8][16][64];
};
inline state &st() {
    static thread_local state s;
    return s;
}

[[noreturn]] inline void fault(const char *what, const char *why) {
    fprintf(stderr, "amx_shim: %s: %s (the processor would raise #UD/#GP)\n", what, why);
    abort();
}
inline void need_tile(const char *what, int t) {
    if (!st().configured) fault(what, "tiles used before _tile_loadconfig");
    if (t < 0 || t > 7) fault(what, "tile index outside 0..7");
    if (st().cfg.rows[t] == 0 || st().cfg.colsb[t] == 0) fault(what, "the tile is not configured");
}

inline void loadconfig(const void *p) {
    tilecfg c;
    memcpy(&c, p, sizeof(c));
    if (c.palette != 1) fault("_tile_loadconfig", "palette other than 1");
    for (int i = 0; i < 8; i++)
        if (c.rows[i] > 16 || c.colsb[i] > 64 || (c.colsb[i] % 4) != 0) fault("_tile_loadconfig", "a tile beyond 16 rows x 64 bytes");
    st().cfg = c;
    st().configured = true;
    memset(st().t, 0, sizeof(st().t));  // LDTILECFG zeroes the tiles
}
inline void release() {
    st().configured = false;
    memset(&st().cfg, 0, sizeof(st().cfg));
}
inline void zero(int t) {
    need_tile("_tile_zero", t);
    memset(st().t[t], 0, sizeof(st().t[t]));
}
inline void loadd(int t, const void *base, long long stride) {
    need_tile("_tile_loadd", t);
    const tilecfg &c = st().cfg;
    memset(st().t[t], 0, sizeof(st().t[t]));
    for (int r = 0; r < c.rows[t]; r++) memcpy(st().t[t][r], (const uint8_t *)base + r * stride, c.colsb[t]);
}
inline void stored(int t, void *base, long long stride) {
    need_tile("_tile_stored", t);
    const tilecfg &c = st().cfg;
    for (int r = 0; r < c.rows[t]; r++) memcpy((uint8_t *)base + r * stride, st().t[t][r], c.colsb[t]);
}

inline float bf16_in(const uint8_t *p) {  // a bf16 operand, denormals as zero
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float ftz(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f; }

inline void dpbf16ps(int d, int a, int b) {
    const char *what = "_tile_dpbf16ps";
    need_tile(what, d), need_tile(what, a), need_tile(what, b);
    if (d == a || d == b || a == b) fault(what, "the three tiles must differ");
    const tilecfg &c = st().cfg;
    const int M = c.rows[d], N = c.colsb[d] / 4, K = c.colsb[a] / 4;
    if (c.rows[a] != M) fault(what, "a's rows differ from dst's");
    if (c.rows[b] != K) fault(what, "b's rows differ from a's pairs per row");
    if (c.colsb[b] != c.colsb[d]) fault(what, "b's bytes per row differ from dst's");
    n_dp++;
    uint8_t(*T)[16][64] = st().t;
    for (int m = 0; m < M; m++) {
        float even[16] = {}, odd[16] = {};  // the two lanes of every pair, each its own sum from zero
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {  // FMAs: one rounding a step
                even[n] = ftz(std::fma(bf16_in(&T[a][m][k * 4]), bf16_in(&T[b][k][n * 4]), even[n]));
                odd[n] = ftz(std::fma(bf16_in(&T[a][m][k * 4 + 2]), bf16_in(&T[b][k][n * 4 + 2]), odd[n]));
            }
        for (int n = 0; n < N; n++) {  // then the lanes' sum, then that into dst (dst's denormals read as zero)
            float acc;
            memcpy(&acc, &T[d][m][n * 4], 4);
            acc = ftz(ftz(acc) + ftz(even[n] + odd[n]));
            memcpy(&T[d][m][n * 4], &acc, 4);
        }
    }
}

}  // namespace qlamx

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) qlamx::loadconfig(p)
#define _tile_release() qlamx::release()
#define _tile_zero(t) qlamx::zero(t)
#define _tile_loadd(t, base, stride) qlamx::loadd((t), (base), (long long)(stride))
#define _tile_stored(t, base, stride) qlamx::stored((t), (base), (long long)(stride))
#define _tile_dpbf16ps(d, a, b) qlamx::dpbf16ps((d), (a), (b))
