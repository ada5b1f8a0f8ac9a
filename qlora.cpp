// qlora.cpp - everything backend-independent, and the CPU backend.
//
// Reading order (the banners below, by the names before their colons; each section uses what
// comes before it, and the type table's quantisers are declared ahead of section 3):
//    1. errors and asserts          9. memory planner
//    2. type traits                10. CPU: SIMD layer and thread pool
//    3. quantisers                 11. CPU kernels
//    4. context / arena            12. CPU backend
//    5. tensors and views          13. backend layer
//    6. op constructors            14. CUDA planning rules
//    7. graphs                     15. file formats
//    8. autodiff                   16. optimizer math
#define QL_INTERNALS  // qlora.h's implementer part: block formats, the backend interface
#include "qlora.h"

#include <fcntl.h>  // POSIX: GGUF files are mmap'd
#include <sched.h>  // sched_getaffinity: the cores this process may use
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>  // arch_prctl: the AMX tile state is granted on request (Linux)
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// gcc 12's own AVX-512 headers trip -Wmaybe-uninitialized when inlined (gcc bug 105593)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#endif

// ============================================================================================
// 1. errors and asserts
// ============================================================================================

// Internal invariants only (a bug, not bad input): print where and abort.
#define QL_ASSERT(x)                                                                            \
    do {                                                                                        \
        if (!(x)) ql_abort_at(__FILE__, __LINE__, #x);                                          \
    } while (0)

[[noreturn]] static void ql_abort_at(const char *file, int line, const char *what) {
    fprintf(stderr, "%s:%d: qlora internal error: assertion failed: %s\n", file, line, what);
    fflush(stderr);
    abort();
}

static const char *ql_basename(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

struct ql_context {
    uint8_t *mem       = nullptr;  // the arena (NULL when measuring)
    size_t   mem_size  = 0;
    size_t   used      = 0;        // arena bytes taken (or needed, when measuring)
    size_t   data_size = 0;        // data bytes of leaf tensors, allocated or not
    bool     own_mem   = false;
    bool     no_alloc  = false;
    bool     measure   = false;
    std::vector<ql_tensor *> tensors;                     // every tensor, in creation order
    std::vector<std::unique_ptr<ql_tensor>> measure_hdr;  // headers while measuring
    ql_status status = QL_OK;
    char      err[1024] = {0};
};

// First error wins: later failures are usually consequences of the first.
static void set_error_v(ql_context *ctx, ql_status st, const char *file, int line, const char *fmt, va_list ap) {
    if (!ctx || ctx->status != QL_OK) return;
    ctx->status = st;
    const int n = file ? snprintf(ctx->err, sizeof(ctx->err), "%s:%d: ", ql_basename(file), line) : 0;
    vsnprintf(ctx->err + n, sizeof(ctx->err) - (size_t)n, fmt, ap);
}
static void ql_set_error_at(ql_context *ctx, ql_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void ql_set_error_at(ql_context *ctx, ql_status st, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(ctx, st, file, line, fmt, ap);
    va_end(ap);
}
#define QL_ERR(ctx, st, ...) ql_set_error_at((ctx), (st), __FILE__, __LINE__, __VA_ARGS__)

static const char *k_status_names[] = {"ok", "shape mismatch", "unsupported type", "out of memory",
                                       "unsupported", "invalid argument", "i/o error"};
static_assert(sizeof(k_status_names) / sizeof(k_status_names[0]) == QL_STATUS_COUNT, "status names");

const char *ql_status_name(ql_status s) {
    return (s >= 0 && s < QL_STATUS_COUNT) ? k_status_names[s] : "?";
}

const char *ql_ctx_error(const ql_context *ctx) { return ctx ? ctx->err : ""; }
ql_status   ql_ctx_status(const ql_context *ctx) { return ctx ? ctx->status : QL_ERR_INVALID; }
void ql_ctx_set_error(ql_context *ctx, ql_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(ctx, st, nullptr, 0, fmt, ap);
    va_end(ap);
}
void        ql_ctx_clear_error(ql_context *ctx) {
    if (!ctx) return;
    ctx->status = QL_OK;
    ctx->err[0] = 0;
}

// ============================================================================================
// 2. type traits
// ============================================================================================

// Scalar conversions are portable bit manipulation; the bulk converters below use F16C where
// compiled in, and a test holds the two to the same bits.
uint16_t ql_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t       absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to inf
    if (absx < 0x38800000u) {                                     // subnormal half or zero
        if (absx < 0x33000000u) return (uint16_t)sign;
        const uint32_t e = absx >> 23, m = (absx & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e;  // 14 + (113 - e)
        uint32_t       h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((absx - 0x38000000u) >> 13);
    const uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

float ql_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t       e = (h >> 10) & 0x1f, m = h & 0x3ffu, x;
    if (e == 0) {
        if (m == 0) {
            x = sign;
        } else {  // subnormal: normalise
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            x = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

uint16_t ql_fp32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float ql_bf16_to_fp32(uint16_t h) {
    const uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static void f32_to_float(const void *s, float *d, int64_t n) { memcpy(d, s, (size_t)n * 4); }
static void f32_from_float(const float *s, void *d, int64_t n) { memcpy(d, s, (size_t)n * 4); }

static void f16_to_float(const void *s, float *d, int64_t n) {
    const uint16_t *x = (const uint16_t *)s;
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
#endif
    for (; i < n; i++) d[i] = ql_fp16_to_fp32(x[i]);
}
static void f16_from_float(const float *s, void *d, int64_t n) {
    uint16_t *y = (uint16_t *)d;
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) y[i] = ql_fp32_to_fp16(s[i]);
}
static void bf16_to_float(const void *s, float *d, int64_t n) {
    const uint16_t *x = (const uint16_t *)s;
    for (int64_t i = 0; i < n; i++) d[i] = ql_bf16_to_fp32(x[i]);  // a shift: vectorises
}
static void bf16_from_float(const float *s, void *d, int64_t n) {
    uint16_t *y = (uint16_t *)d;
    int64_t i = 0;
#if defined(__AVX512F__)
    // the scalar rule 16 lanes at a time (the casts of mixed precision run through here)
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(s + i);
        const __m512i x = _mm512_castps_si512(v), hi = _mm512_srli_epi32(x, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(bias, _mm512_and_si512(hi, one))), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(hi, quiet));
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; i++) y[i] = ql_fp32_to_bf16(s[i]);
}

// ggml's names of the types qlora does not read (ids as in ggml.h), for the error that refuses them
static const char *ggml_type_name(uint32_t id) {
    switch (id) {
    case 4: return "q4_2 (removed from ggml)";
    case 5: return "q4_3 (removed from ggml)";
    case 9: return "q8_1";
    case 15: return "q8_K";
    case 16: return "iq2_xxs";
    case 17: return "iq2_xs";
    case 18: return "iq3_xxs";
    case 19: return "iq1_s";
    case 21: return "iq3_s";
    case 22: return "iq2_s";
    case 25: return "i16";
    case 27: return "i64";
    case 28: return "f64";
    case 29: return "iq1_m";
    case 34: return "tq1_0";
    case 35: return "tq2_0";
    case 39: return "mxfp4";
    default: return nullptr;
    }
}

// ---- NF4 (bitsandbytes-exact), blocks of 64, side data after the rows (see qlora.h) ----

static int64_t nf4_n_blocks(int64_t n) { return (n + QL_NF4_BLOCK - 1) / QL_NF4_BLOCK; }
static int64_t nf4_n_groups(int64_t n) { return (nf4_n_blocks(n) + QL_NF4_GROUP - 1) / QL_NF4_GROUP; }
// (after the pad that puts the side data on a 4-byte boundary: rows of n / 2 bytes)
static size_t nf4_pad(int64_t n) { return ql_aux_offset((size_t)(n / 2)) - (size_t)(n / 2); }
static size_t nf4_aux_bytes(int64_t n) {  // n_blocks, offset, map, group scales, one code per block
    return nf4_pad(n) + (size_t)(2 + 256 + nf4_n_groups(n)) * sizeof(float) + (size_t)nf4_n_blocks(n);
}
static size_t nf4_nodq_aux_bytes(int64_t n) { return nf4_pad(n) + (size_t)nf4_n_blocks(n) * sizeof(float); }
static void nf4_to_float_aux(const void *row, const void *aux, int64_t first, float *dst, int64_t n);
static void nf4_nodq_to_float_aux(const void *row, const void *aux, int64_t first, float *dst, int64_t n);
static bool nf4_aux_check(const void *aux, int64_t n);
static bool nf4_nodq_aux_check(const void *aux, int64_t n);

// The block quantisers the table points at (section 3)
static void q4_0_to_float(const void *src, float *dst, int64_t n);
static void q4_0_from_float(const float *src, void *dst, int64_t n);
static void q8_0_to_float(const void *src, float *dst, int64_t n);
static void q8_0_from_float(const float *src, void *dst, int64_t n);
static void q4_1_to_float(const void *src, float *dst, int64_t n);
static void q4_1_from_float(const float *src, void *dst, int64_t n);
static void q5_0_to_float(const void *src, float *dst, int64_t n);
static void q5_0_from_float(const float *src, void *dst, int64_t n);
static void q5_1_to_float(const void *src, float *dst, int64_t n);
static void q5_1_from_float(const float *src, void *dst, int64_t n);
static void q2_K_to_float(const void *src, float *dst, int64_t n);
static void q2_K_from_float(const float *src, void *dst, int64_t n);
static void q3_K_to_float(const void *src, float *dst, int64_t n);
static void q3_K_from_float(const float *src, void *dst, int64_t n);
static void iq4_nl_to_float(const void *src, float *dst, int64_t n);
static void iq4_nl_from_float(const float *src, void *dst, int64_t n);
static void iq4_xs_to_float(const void *src, float *dst, int64_t n);
static void iq4_xs_from_float(const float *src, void *dst, int64_t n);
static void q4_K_to_float(const void *src, float *dst, int64_t n);
static void q4_K_from_float(const float *src, void *dst, int64_t n);
static void q5_K_to_float(const void *src, float *dst, int64_t n);
static void q5_K_from_float(const float *src, void *dst, int64_t n);
static void q6_K_to_float(const void *src, float *dst, int64_t n);
static void q6_K_from_float(const float *src, void *dst, int64_t n);

struct ql_type_table {
    ql_type_traits t[QL_TYPE_COUNT];
    ql_type_table() {
        memset(t, 0, sizeof(t));
        t[QL_TYPE_F32]  = {"f32", 1, 4, true, f32_to_float, f32_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_F16]  = {"f16", 1, 2, true, f16_to_float, f16_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_BF16] = {"bf16", 1, 2, true, bf16_to_float, bf16_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_I32]  = {"i32", 1, 4, false, nullptr, nullptr, nullptr, nullptr, nullptr};
        t[QL_TYPE_I8]   = {"i8", 1, 1, false, nullptr, nullptr, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q4_0] = {"q4_0", QL_QK4_0, sizeof(ql_block_q4_0), true, q4_0_to_float, q4_0_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q8_0] = {"q8_0", QL_QK8_0, sizeof(ql_block_q8_0), true, q8_0_to_float, q8_0_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q4_1] = {"q4_1", QL_QK4_0, sizeof(ql_block_q4_1), true, q4_1_to_float, q4_1_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q5_0] = {"q5_0", QL_QK4_0, sizeof(ql_block_q5_0), true, q5_0_to_float, q5_0_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q5_1] = {"q5_1", QL_QK4_0, sizeof(ql_block_q5_1), true, q5_1_to_float, q5_1_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q2_K] = {"q2_K", QL_QK_K, sizeof(ql_block_q2_K), true, q2_K_to_float, q2_K_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q3_K] = {"q3_K", QL_QK_K, sizeof(ql_block_q3_K), true, q3_K_to_float, q3_K_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_IQ4_NL] = {"iq4_nl", QL_QK4_0, sizeof(ql_block_iq4_nl), true, iq4_nl_to_float, iq4_nl_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_IQ4_XS] = {"iq4_xs", QL_QK_K, sizeof(ql_block_iq4_xs), true, iq4_xs_to_float, iq4_xs_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q4_K] = {"q4_K", QL_QK_K, sizeof(ql_block_q4_K), true, q4_K_to_float, q4_K_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q5_K] = {"q5_K", QL_QK_K, sizeof(ql_block_q5_K), true, q5_K_to_float, q5_K_from_float, nullptr, nullptr, nullptr};
        t[QL_TYPE_Q6_K] = {"q6_K", QL_QK_K, sizeof(ql_block_q6_K), true, q6_K_to_float, q6_K_from_float, nullptr, nullptr, nullptr};
        // NF4's unit is a byte of two codes: its blocks of 64 run over the flattened tensor (as
        // bitsandbytes' do), so a row need only be even, and a block may span two rows
        t[QL_TYPE_NF4]  = {"nf4", 2, 1, true, nullptr, nullptr, nf4_aux_bytes,
                           nf4_to_float_aux, nf4_aux_check};
        t[QL_TYPE_NF4_NODQ] = {"nf4_nodq", 2, 1, true, nullptr, nullptr,
                               nf4_nodq_aux_bytes, nf4_nodq_to_float_aux, nf4_nodq_aux_check};
    }
};
static const ql_type_table k_types;

const ql_type_traits *ql_type_traits_get(ql_type type) {
    if ((int)type < 0 || type >= QL_TYPE_COUNT || !k_types.t[type].name) return nullptr;
    return &k_types.t[type];
}
static const ql_type_traits &traits(ql_type type) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    QL_ASSERT(tt);
    return *tt;
}
const char *ql_type_name(ql_type type) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    return tt ? tt->name : "?";
}
size_t ql_row_size(ql_type type, int64_t ne0) {
    const ql_type_traits &tt = traits(type);
    return tt.type_size * (size_t)(ne0 / tt.blck_size);
}
size_t ql_type_data_size(ql_type type, int64_t n_rows, int64_t ne0) {
    const ql_type_traits &tt = traits(type);
    return ql_row_size(type, ne0) * (size_t)n_rows + (tt.aux_bytes ? tt.aux_bytes(n_rows * ne0) : 0);
}

// ============================================================================================
// 3. quantisers: ggml's block formats, k-quants, IQ4, NF4 and the 8-bit dynamic map
// ============================================================================================

// ---- ggml's block formats, byte for byte the blocks of ggml / GGUF files (structs in qlora.h) ----
//
// Element order inside a block, as ggml's reference (de)quantisers lay it out (checked against
// ggml-org/llama.cpp ggml/src/ggml-quants.c: quantize_row_q4_0_ref, quantize_row_q8_0_ref,
// dequantize_row_q4_0/q8_0/q4_K/q5_K/q6_K, quantize_row_q4_K_ref/q5_K_ref/q6_K_ref,
// get_scale_min_k4; the same functions in ggml-org/ggml src/ggml-quants.c). Written here from
// that description, not copied.
//
//   Q4_0 (32): byte qs[j], j < 16: low nibble = element j, high nibble = element j + 16;
//              x = d * (q - 8).
//   Q8_0 (32): qs[j] = element j (int8); x = d * q.
//   Q4_K (256): 8 sub-blocks of 32 elements, s = i / 32, l = i % 32. The 4-bit code of element
//              i is in byte qs[32 * (s / 2) + l]: low nibble for even s, high nibble for odd s
//              (so every 32 bytes hold two consecutive sub-blocks, the first in the low nibbles).
//              x = (d * sc[s]) * q - dmin * m[s], with the 6-bit sc/m of sub-block s unpacked
//              from the 12 scale bytes b:
//                s < 4:  sc = b[s] & 63,                        m = b[s + 4] & 63
//                s >= 4: sc = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4,
//                        m  = (b[s + 4] >> 4) | (b[s]     >> 6) << 4
//              (the top two bits of bytes 0..3 carry sc[4..7]'s high bits, those of bytes 4..7
//              m[4..7]'s high bits).
//   Q5_K (256): as Q4_K for the low 4 bits and the scales; the 5th bit (value 16) of element i
//              (s = i / 32, l = i % 32) is bit s of qh[l]. x = (d * sc[s]) * q - dmin * m[s].
//   Q6_K (256): two halves of 128 elements, h = i / 128, r = i % 128, k = r / 32 (quarter),
//              l = r % 32. Low 4 bits: byte ql[64 h + 32 (k & 1) + l], low nibble for k < 2,
//              high nibble for k >= 2. High 2 bits: bits 2k, 2k+1 of qh[32 h + l].
//              Scale: int8 scales[i / 16]. x = (d * sc) * (q - 32).
//
// The dequantisers evaluate exactly those f32 expressions in that order (the products d*sc and
// dmin*m once per sub-block), so they give ggml's reference floats. Their element loops are
// plain, branch-free loops of fixed length for the vectoriser.

// A rounding point no compiler may fuse away: gcc contracts a*b + c into an FMA even across
// statements (its C++ default is -ffp-contract=fast); where bitsandbytes/torch or ggml
// (built without FMA) round twice, so must we.
static inline float rounded(float x) {
    volatile float v = x;
    return v;
}

// NaN-safe clamp for codes before the float -> int conversion: finite in-range values are
// untouched (so results equal ggml's), anything else gets a defined code.
static inline float ql_qclamp(float v, float lo, float hi) {
    return v > hi ? hi : (v >= lo ? v : (v < lo ? lo : 0.0f));
}

static void q4_0_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    const ql_block_q4_0 *b = (const ql_block_q4_0 *)src;
    const int64_t nb = n / QL_QK4_0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        uint8_t     qs[QL_QK4_0 / 2];  // local copy: provably no alias with dst (vectorises at -O2)
        memcpy(qs, b[ib].qs, sizeof(qs));
        float *y = dst + ib * QL_QK4_0;
        for (int j = 0; j < QL_QK4_0 / 2; j++) {
            y[j]                = (float)((int)(qs[j] & 0x0F) - 8) * d;
            y[j + QL_QK4_0 / 2] = (float)((int)(qs[j] >> 4) - 8) * d;
        }
    }
}

// ggml's quantize_row_q4_0_ref: `max` = the first element of largest magnitude (sign kept),
// d = max / -8, id = d ? 1/d : 0, q = min(15, trunc(x * id + 8.5)). An all-zero block gets
// d = -0.0 (fp16 0x8000) and codes 8, as in ggml.
static void q4_0_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    ql_block_q4_0 *b = (ql_block_q4_0 *)dst;
    const int64_t nb = n / QL_QK4_0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float *x = src + ib * QL_QK4_0;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QL_QK4_0; j++) {
            const float a = fabsf(x[j]);
            if (amax < a) { amax = a; max = x[j]; }
        }
        const float d  = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[ib].d = ql_fp32_to_fp16(d);
        for (int j = 0; j < QL_QK4_0 / 2; j++) {
            // x*id + 8.5 lies in [0.5, 16.5] for finite input; truncation = ggml's int8 cast
            const int q0 = (int)ql_qclamp(rounded(x[j] * id) + 8.5f, 0.0f, 15.0f);
            const int q1 = (int)ql_qclamp(rounded(x[j + QL_QK4_0 / 2] * id) + 8.5f, 0.0f, 15.0f);
            b[ib].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void q8_0_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK8_0 == 0);
    const ql_block_q8_0 *b = (const ql_block_q8_0 *)src;
    const int64_t nb = n / QL_QK8_0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        int8_t      qs[QL_QK8_0];  // local copy: provably no alias with dst
        memcpy(qs, b[ib].qs, sizeof(qs));
        float *y = dst + ib * QL_QK8_0;
        for (int j = 0; j < QL_QK8_0; j++) y[j] = (float)qs[j] * d;
    }
}

// ggml's quantize_row_q8_0_ref: amax over the block, d = amax / 127, id = d ? 1/d : 0,
// q = roundf(x * id) (halves away from zero); id uses the f32 d, the block stores fp16(d).
static void q8_0_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK8_0 == 0);
    ql_block_q8_0 *b = (ql_block_q8_0 *)dst;
    const int64_t nb = n / QL_QK8_0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float *x = src + ib * QL_QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < QL_QK8_0; j++) {
            const float a = fabsf(x[j]);
            amax = amax > a ? amax : a;
        }
        const float d  = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[ib].d = ql_fp32_to_fp16(d);
        for (int j = 0; j < QL_QK8_0; j++)
            b[ib].qs[j] = (int8_t)ql_qclamp(roundf(x[j] * id), -127.0f, 127.0f);
    }
}

// the 8 (scale, min) pairs of a Q4_K / Q5_K block (layout in the header comment)
static inline void ql_k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j]     = s[j] & 63;
        mn[j]     = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

static void q4_K_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_q4_K *b = (const ql_block_q4_K *)src;
    const int64_t nb = n / QL_QK_K;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d), dmin = ql_fp16_to_fp32(b[ib].dmin);
        uint8_t sc[8], mn[8];
        ql_k4_scales(b[ib].scales, sc, mn);
        uint8_t qs[QL_QK_K / 2];  // local copy: provably no alias with dst
        memcpy(qs, b[ib].qs, sizeof(qs));
        float *y = dst + ib * QL_QK_K;
        for (int g = 0; g < 4; g++) {  // 32 bytes of qs: sub-blocks 2g (low), 2g+1 (high)
            const uint8_t *q  = qs + 32 * g;
            const float    d0 = d * (float)sc[2 * g], m0 = dmin * (float)mn[2 * g];
            const float    d1 = d * (float)sc[2 * g + 1], m1 = dmin * (float)mn[2 * g + 1];
            float         *y0 = y + 64 * g, *y1 = y0 + 32;
            for (int l = 0; l < 32; l++) y0[l] = d0 * (float)(q[l] & 0x0F) - m0;
            for (int l = 0; l < 32; l++) y1[l] = d1 * (float)(q[l] >> 4) - m1;
        }
    }
}

static void q5_K_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_q5_K *b = (const ql_block_q5_K *)src;
    const int64_t nb = n / QL_QK_K;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d), dmin = ql_fp16_to_fp32(b[ib].dmin);
        uint8_t sc[8], mn[8];
        ql_k4_scales(b[ib].scales, sc, mn);
        uint8_t qs[QL_QK_K / 2], qh[QL_QK_K / 8];  // local copies: provably no alias with dst
        memcpy(qs, b[ib].qs, sizeof(qs));
        memcpy(qh, b[ib].qh, sizeof(qh));
        float *y = dst + ib * QL_QK_K;
        for (int g = 0; g < 4; g++) {
            const uint8_t *q  = qs + 32 * g;
            const int      s0 = 2 * g, s1 = 2 * g + 1;  // sub-blocks; also their qh bit
            const float    d0 = d * (float)sc[s0], m0 = dmin * (float)mn[s0];
            const float    d1 = d * (float)sc[s1], m1 = dmin * (float)mn[s1];
            float         *y0 = y + 64 * g, *y1 = y0 + 32;
            for (int l = 0; l < 32; l++)
                y0[l] = d0 * (float)((q[l] & 0x0F) | (((qh[l] >> s0) & 1) << 4)) - m0;
            for (int l = 0; l < 32; l++)
                y1[l] = d1 * (float)((q[l] >> 4) | (((qh[l] >> s1) & 1) << 4)) - m1;
        }
    }
}

static void q6_K_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_q6_K *b = (const ql_block_q6_K *)src;
    const int64_t nb = n / QL_QK_K;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        float ds[QL_QK_K / 16];
        for (int s = 0; s < QL_QK_K / 16; s++) ds[s] = d * (float)b[ib].scales[s];
        uint8_t qlb[QL_QK_K / 2], qhb[QL_QK_K / 4];  // local copies: provably no alias with dst
        memcpy(qlb, b[ib].ql, sizeof(qlb));
        memcpy(qhb, b[ib].qh, sizeof(qhb));
        float *y = dst + ib * QL_QK_K;
        for (int h = 0; h < 2; h++) {  // 128 elements: 64 bytes of ql, 32 of qh, 8 scales
            const uint8_t *ql = qlb + 64 * h, *qh = qhb + 32 * h;
            const float   *dh = ds + 8 * h;
            float         *yh = y + 128 * h;
            for (int half = 0; half < 2; half++) {  // l in [16 half, 16 half + 16): one scale per quarter
                const float s0 = dh[half], s1 = dh[2 + half], s2 = dh[4 + half], s3 = dh[6 + half];
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    const int lo = ql[l], hi = ql[l + 32], top = qh[l];
                    yh[l]      = s0 * (float)(((lo & 0x0F) | ((top & 3) << 4)) - 32);
                    yh[l + 32] = s1 * (float)(((hi & 0x0F) | (((top >> 2) & 3) << 4)) - 32);
                    yh[l + 64] = s2 * (float)(((lo >> 4) | (((top >> 4) & 3) << 4)) - 32);
                    yh[l + 96] = s3 * (float)(((hi >> 4) | (((top >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

// ---- the other ggml block types a GGUF file may hold (layouts in qlora.h) ----
//
// Written from the formats' description (ggml's dequantize_row_* / quantize_row_*_ref, and
// gguf-py's gguf/quants.py, which tests/golden/quants.bin is made with), not copied. Where an
// element is a product plus an offset (d q + m, d q - m), the product is stored first and the
// offset added in a second pass: two roundings, as the references compute, which no compiler
// may fuse into one FMA (gcc would within a loop body).

// the 5-bit codes of a q5_0/q5_1 block: nibble j of qs, fifth bit j of qh (j < 16: low nibbles)
static inline void ql_q5_codes(const uint8_t *qs, const uint8_t *qh4, int q[32]) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    for (int j = 0; j < 16; j++) {
        q[j]      = (qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4;
        q[j + 16] = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
    }
}

static void q4_1_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    const ql_block_q4_1 *b = (const ql_block_q4_1 *)src;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d), m = ql_fp16_to_fp32(b[ib].m);
        uint8_t     qs[QL_QK4_0 / 2];
        memcpy(qs, b[ib].qs, sizeof(qs));
        float *y = dst + ib * QL_QK4_0;
        for (int j = 0; j < 16; j++) {
            y[j]      = d * (float)(qs[j] & 0x0F);
            y[j + 16] = d * (float)(qs[j] >> 4);
        }
        for (int j = 0; j < QL_QK4_0; j++) y[j] += m;
    }
}

// ggml's quantize_row_q4_1_ref / _q5_1_ref: d = (max - min) / nmax, m = min,
// q = min(nmax, trunc((x - min) / d + 0.5)) for the 32 elements of a block
static void ql_min_codes(const float *x, int nmax, uint16_t *d16, uint16_t *m16, int q[32]) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < QL_QK4_0; j++) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
    const float d = (hi - lo) / (float)nmax, id = d != 0.0f ? 1.0f / d : 0.0f;
    *d16 = ql_fp32_to_fp16(d);
    *m16 = ql_fp32_to_fp16(lo);
    for (int j = 0; j < QL_QK4_0; j++) q[j] = (int)ql_qclamp(rounded((x[j] - lo) * id) + 0.5f, 0.0f, (float)nmax);
}

static void q4_1_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    ql_block_q4_1 *b = (ql_block_q4_1 *)dst;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        int q[32];
        ql_min_codes(src + ib * QL_QK4_0, 15, &b[ib].d, &b[ib].m, q);
        for (int j = 0; j < 16; j++) b[ib].qs[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
    }
}

static void q5_0_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    const ql_block_q5_0 *b = (const ql_block_q5_0 *)src;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        int         q[32];
        ql_q5_codes(b[ib].qs, b[ib].qh, q);
        float *y = dst + ib * QL_QK4_0;
        for (int j = 0; j < QL_QK4_0; j++) y[j] = d * (float)(q[j] - 16);
    }
}

// the fifth bits of 32 codes into qh, the low nibbles into qs
static inline void ql_q5_pack(const int q[32], uint8_t *qs, uint8_t *qh4) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
        qh |= (uint32_t)((q[j] >> 4) & 1) << j | (uint32_t)((q[j + 16] >> 4) & 1) << (j + 16);
    }
    memcpy(qh4, &qh, 4);
}

// ggml's quantize_row_q5_0_ref: as q4_0 with d = max / -16, q = min(31, trunc(x / d + 16.5))
static void q5_0_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    ql_block_q5_0 *b = (ql_block_q5_0 *)dst;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float *x = src + ib * QL_QK4_0;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QL_QK4_0; j++)
            if (amax < fabsf(x[j])) amax = fabsf(x[j]), max = x[j];
        const float d = max / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[ib].d = ql_fp32_to_fp16(d);
        int q[32];
        for (int j = 0; j < QL_QK4_0; j++) q[j] = (int)ql_qclamp(rounded(x[j] * id) + 16.5f, 0.0f, 31.0f);
        ql_q5_pack(q, b[ib].qs, b[ib].qh);
    }
}

static void q5_1_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    const ql_block_q5_1 *b = (const ql_block_q5_1 *)src;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d), m = ql_fp16_to_fp32(b[ib].m);
        int         q[32];
        ql_q5_codes(b[ib].qs, b[ib].qh, q);
        float *y = dst + ib * QL_QK4_0;
        for (int j = 0; j < QL_QK4_0; j++) y[j] = d * (float)q[j];
        for (int j = 0; j < QL_QK4_0; j++) y[j] += m;
    }
}

static void q5_1_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    ql_block_q5_1 *b = (ql_block_q5_1 *)dst;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        int q[32];
        ql_min_codes(src + ib * QL_QK4_0, 31, &b[ib].d, &b[ib].m, q);
        ql_q5_pack(q, b[ib].qs, b[ib].qh);
    }
}

static const int8_t k_iq4_values[16] = QL_IQ4_VALUES;

static void iq4_nl_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    const ql_block_iq4_nl *b = (const ql_block_iq4_nl *)src;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        float      *y = dst + ib * QL_QK4_0;
        for (int j = 0; j < 16; j++) {
            y[j]      = d * (float)k_iq4_values[b[ib].qs[j] & 0x0F];
            y[j + 16] = d * (float)k_iq4_values[b[ib].qs[j] >> 4];
        }
    }
}

// IQ4_XS (256): sub-block s of 32 has the 6-bit scale ls = (scales_l[s/2] >> 4 (s%2)) & 15 |
// ((scales_h >> 2s) & 3) << 4 and its nibbles in qs[16 s ..]: x = (d (ls - 32)) kvalue[q]
static void iq4_xs_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_iq4_xs *b = (const ql_block_iq4_xs *)src;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d);
        for (int s = 0; s < QL_QK_K / 32; s++) {
            const int      ls = ((b[ib].scales_l[s / 2] >> 4 * (s % 2)) & 15) | ((b[ib].scales_h >> 2 * s) & 3) << 4;
            const float    dl = d * (float)(ls - 32);
            const uint8_t *qs = b[ib].qs + 16 * s;
            float         *y  = dst + ib * QL_QK_K + 32 * s;
            for (int j = 0; j < 16; j++) {
                y[j]      = dl * (float)k_iq4_values[qs[j] & 0x0F];
                y[j + 16] = dl * (float)k_iq4_values[qs[j] >> 4];
            }
        }
    }
}

// Q2_K (256): two halves of 128; in half h, 2-bit field k (bits 2k, 2k+1) of qs[32 h + l] is
// element 128 h + 32 k + l; sub-block of 16 = element / 16 has scales[sub] (low nibble: scale,
// high: min). x = (d sc) q - (dmin m)
static void q2_K_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_q2_K *b = (const ql_block_q2_K *)src;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float d = ql_fp16_to_fp32(b[ib].d), dmin = ql_fp16_to_fp32(b[ib].dmin);
        float      *y = dst + ib * QL_QK_K;
        float       ml[16];
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int part = 0; part < 2; part++) {  // 16 elements: one scale
                    const int      sub = 8 * h + 2 * k + part;
                    const float    dl = d * (float)(b[ib].scales[sub] & 15);
                    const uint8_t *q  = b[ib].qs + 32 * h + 16 * part;
                    ml[sub]           = dmin * (float)(b[ib].scales[sub] >> 4);
                    for (int l = 0; l < 16; l++) y[16 * sub + l] = dl * (float)((q[l] >> 2 * k) & 3);
                }
        for (int e = 0; e < QL_QK_K; e++) y[e] -= ml[e / 16];
    }
}

// Q3_K (256): as Q2_K for the low 2 bits; the third bit of element e (half h, field k, l) is
// bit 4 h + k of hmask[l % 32 ...] - precisely hmask[16 part + l'] & (1 << (4 h + k)); a clear
// bit subtracts 4. The 16 6-bit scales: low 4 bits from the nibbles of scales[0..7] (sub-block
// s < 8: low nibble of scales[s], else high nibble of scales[s - 8]), high 2 bits from
// scales[8 + s % 4] bits 2 (s / 4), 2 (s / 4) + 1. x = (d (sc - 32)) q
static void q3_K_to_float(const void *src, float *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    const ql_block_q3_K *b = (const ql_block_q3_K *)src;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float    d  = ql_fp16_to_fp32(b[ib].d);
        const uint8_t *sb = b[ib].scales;
        float         *y  = dst + ib * QL_QK_K;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int part = 0; part < 2; part++) {
                    const int   sub = 8 * h + 2 * k + part;
                    const int   lo4 = sub < 8 ? sb[sub] & 15 : sb[sub - 8] >> 4;
                    const int   hi2 = (sb[8 + sub % 4] >> 2 * (sub / 4)) & 3;
                    const float dl  = d * (float)((lo4 | hi2 << 4) - 32);
                    const uint8_t m = (uint8_t)(1u << (4 * h + k));
                    for (int l = 0; l < 16; l++) {
                        const int i = 16 * part + l;
                        const int q = ((b[ib].qs[32 * h + i] >> 2 * k) & 3) - ((b[ib].hmask[i] & m) ? 0 : 4);
                        y[16 * sub + l] = dl * (float)q;
                    }
                }
    }
}

// ---- k-quant quantisers: ggml's reference algorithms (quantize_row_q4_K_ref, _q5_K_ref,
// _q6_K_ref with make_qkx2_quants / make_qx_quants), written from their description, so that
// `./quantize` writes the bytes llama.cpp's reference writes. ggml builds these without FMA
// (ggml-base, baseline flags): every product that feeds a sum goes through rounded(), so a
// -march=native build here does not fuse it and choose differently.

// round half to even, as ggml's nearest_int (|x| <= 2^22)
static inline int ql_nearest_int(float x) { return (int)nearbyintf(x); }

// a scale for 16 elements into signed codes L + nmax in [0, 2 nmax): the least-squares scale of
// the best of 19 trial inverse scales, weights x^2 (ggml's make_qx_quants, rmse_type 1)
static float kq_qx_scale(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-15f) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    float iscale = -(float)nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = std::max(-nmax, std::min(nmax - 1, ql_nearest_int(iscale * x[i])));
        L[i] = (int8_t)(l + nmax);
        const float w = rounded(x[i] * x[i]);
        sumlx += rounded(rounded(w * x[i]) * (float)l);
        suml2 += rounded(rounded(w * (float)l) * (float)l);
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + rounded(0.1f * (float)is)) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = std::max(-nmax, std::min(nmax - 1, ql_nearest_int(iscale * x[i])));
            const float w = rounded(x[i] * x[i]);
            sumlx += rounded(rounded(w * x[i]) * (float)l);
            suml2 += rounded(rounded(w * (float)l) * (float)l);
        }
        if (suml2 > 0 && rounded(sumlx * sumlx) > rounded(best * suml2)) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + std::max(-nmax, std::min(nmax - 1, ql_nearest_int(iscale * x[i]))));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

// a (scale, min) for n <= 32 elements into codes [0, nmax], weighted least squares over nstep + 1
// trial scales, each judged by its squared or (mad) absolute error (ggml's make_qkx2_quants);
// *the_min receives -min (>= 0)
static float kq_qkx2_scale(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min, float rmin, float rdelta,
                           int nstep, bool mad = false) {
    auto err = [mad](float w_, float diff) { return rounded(w_ * (mad ? fabsf(diff) : rounded(diff * diff))); };
    float min = x[0], max = x[0], sum_w = w[0], sum_x = rounded(sum_w * x[0]);
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += rounded(w[i] * x[i]);
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *the_min = -min;
        return 0.0f;
    }
    float iscale = (float)nmax / (max - min), scale = 1 / iscale, best_error = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)std::max(0, std::min(nmax, ql_nearest_int(iscale * (x[i] - min))));
        best_error += err(w[i], rounded(scale * (float)L[i]) + min - x[i]);
    }
    uint8_t Laux[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rounded(rdelta * (float)is) + (float)nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = std::max(0, std::min(nmax, ql_nearest_int(iscale * (x[i] - min))));
            Laux[i] = (uint8_t)l;
            sum_l += rounded(w[i] * (float)l);
            sum_l2 += rounded(rounded(w[i] * (float)l) * (float)l);
            sum_xl += rounded(rounded(w[i] * (float)l) * x[i]);
        }
        const float D = rounded(sum_w * sum_l2) - rounded(sum_l * sum_l);
        if (D > 0) {
            float this_scale = (rounded(sum_w * sum_xl) - rounded(sum_x * sum_l)) / D;
            float this_min = (rounded(sum_l2 * sum_x) - rounded(sum_l * sum_xl)) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) cur_error += err(w[i], rounded(this_scale * (float)Laux[i]) + this_min - x[i]);
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// Q4_K / Q5_K (nmax 15 / 31): per sub-block of 32 a (scale, min) pair, both quantised to 6 bits
// against the block's largest, then every code again against the stored scales
static void k45_from_float(const float *x, int nmax, uint16_t *d_out, uint16_t *dmin_out, uint8_t *scales_out, uint8_t L[QL_QK_K]) {
    float mins[8], scales[8], weights[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += rounded(x[32 * j + l] * x[32 * j + l]);
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = nmax == 15 ? kq_qkx2_scale(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], -1.0f, 0.1f, 20)
                               : kq_qkx2_scale(32, 31, x + 32 * j, weights, L + 32 * j, &mins[j], -0.5f, 0.1f, 15);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    uint8_t s[QL_K_SCALE_SIZE] = {0};
    for (int j = 0; j < 8; j++) {
        const uint8_t ls = (uint8_t)std::min(63, (int)(uint8_t)ql_nearest_int(inv_scale * scales[j]));
        const uint8_t lm = (uint8_t)std::min(63, (int)(uint8_t)ql_nearest_int(inv_min * mins[j]));
        if (j < 4) {
            s[j] = ls;
            s[j + 4] = lm;
        } else {
            s[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            s[j - 4] |= (uint8_t)((ls >> 4) << 6);
            s[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *d_out = ql_fp32_to_fp16(max_scale / 63.0f);
    *dmin_out = ql_fp32_to_fp16(max_min / 63.0f);
    memcpy(scales_out, s, sizeof(s));
    uint8_t sc[8], mn[8];
    ql_k4_scales(s, sc, mn);
    for (int j = 0; j < 8; j++) {
        const float d = ql_fp16_to_fp32(*d_out) * (float)sc[j];
        if (!d) continue;  // the sub-block keeps its first codes
        const float dm = ql_fp16_to_fp32(*dmin_out) * (float)mn[j];
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)std::max(0, std::min(nmax, ql_nearest_int((x[32 * j + i] + dm) / d)));
    }
}

static void q4_K_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_q4_K *b = (ql_block_q4_K *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        uint8_t L[QL_QK_K];
        k45_from_float(src + ib * QL_QK_K, 15, &b[ib].d, &b[ib].dmin, b[ib].scales, L);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) b[ib].qs[32 * g + l] = (uint8_t)(L[64 * g + l] | (L[64 * g + l + 32] << 4));
    }
}

static void q5_K_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_q5_K *b = (ql_block_q5_K *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        uint8_t L[QL_QK_K];
        k45_from_float(src + ib * QL_QK_K, 31, &b[ib].d, &b[ib].dmin, b[ib].scales, L);
        memset(b[ib].qh, 0, sizeof(b[ib].qh));
        for (int g = 0; g < 4; g++)  // sub-blocks 2g, 2g+1: low nibbles in qs, the fifth bits as bits 2g, 2g+1 of qh
            for (int l = 0; l < 32; l++) {
                const int l1 = L[64 * g + l], l2 = L[64 * g + l + 32];
                b[ib].qh[l] |= (uint8_t)(((l1 >> 4) & 1) << (2 * g) | ((l2 >> 4) & 1) << (2 * g + 1));
                b[ib].qs[32 * g + l] = (uint8_t)((l1 & 15) | (l2 & 15) << 4);
            }
    }
}

static void q6_K_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_q6_K *b = (ql_block_q6_K *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float *x = src + ib * QL_QK_K;
        int8_t L[QL_QK_K];
        float scales[QL_QK_K / 16], max_scale = 0, max_abs = 0;
        for (int s = 0; s < QL_QK_K / 16; s++) {
            scales[s] = kq_qx_scale(16, 32, x + 16 * s, L + 16 * s);
            if (fabsf(scales[s]) > max_abs) max_abs = fabsf(scales[s]), max_scale = scales[s];
        }
        if (max_abs < 1e-15f) {
            memset(&b[ib], 0, sizeof(b[ib]));
            continue;
        }
        const float iscale = -128.0f / max_scale;
        b[ib].d = ql_fp32_to_fp16(1 / iscale);
        for (int s = 0; s < QL_QK_K / 16; s++) b[ib].scales[s] = (int8_t)std::min(127, ql_nearest_int(iscale * scales[s]));
        for (int s = 0; s < QL_QK_K / 16; s++) {
            const float d = ql_fp16_to_fp32(b[ib].d) * (float)b[ib].scales[s];
            if (!d) continue;
            for (int i = 0; i < 16; i++) L[16 * s + i] = (int8_t)(std::max(-32, std::min(31, ql_nearest_int(x[16 * s + i] / d))) + 32);
        }
        for (int h = 0; h < 2; h++)  // the layout of q6_K_to_float: 4 quarters of 32 per half
            for (int l = 0; l < 32; l++) {
                const uint8_t q1 = (uint8_t)L[128 * h + l], q2 = (uint8_t)L[128 * h + l + 32], q3 = (uint8_t)L[128 * h + l + 64],
                              q4 = (uint8_t)L[128 * h + l + 96];
                b[ib].ql[64 * h + l] = (uint8_t)((q1 & 15) | (q3 & 15) << 4);
                b[ib].ql[64 * h + l + 32] = (uint8_t)((q2 & 15) | (q4 & 15) << 4);
                b[ib].qh[32 * h + l] = (uint8_t)((q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6);
            }
    }
}

// ---- the 2-, 3- and non-linear 4-bit quantisers: what llama-quantize writes for these types
// without an importance matrix (q2_K, q3_K: ggml's quantize_row_*_ref; iq4_nl, iq4_xs: its
// quantize_iq4_nl / quantize_iq4_xs search with 7 trial scales each side), from their description

// the 2-bit fields of Q2_K / Q3_K: in half h, field k of qs[32 h + l] is element 128 h + 32 k + l
static void kq_pack2(const uint8_t L[QL_QK_K], uint8_t qs[QL_QK_K / 4]) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++)
            qs[32 * h + l] = (uint8_t)(L[128 * h + l] | L[128 * h + l + 32] << 2 | L[128 * h + l + 64] << 4 | L[128 * h + l + 96] << 6);
}

// Q2_K: per sub-block of 16 a (scale, min) fit, both quantised to 4 bits against the largest
// (d = max / 15), then the codes again against the stored scales
static void q2_K_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_q2_K *b = (ql_block_q2_K *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float *x = src + ib * QL_QK_K;
        uint8_t L[QL_QK_K];
        float scales[16], mins[16], max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            float w[16];  // weights |x|, absolute error
            for (int i = 0; i < 16; i++) w[i] = fabsf(x[16 * j + i]);
            scales[j] = kq_qkx2_scale(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, true);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        memset(b[ib].scales, 0, sizeof(b[ib].scales));
        b[ib].d = b[ib].dmin = ql_fp32_to_fp16(0.0f);
        if (max_scale > 0) {
            const float iscale = 15.0f / max_scale;
            for (int j = 0; j < 16; j++) b[ib].scales[j] = (uint8_t)ql_nearest_int(iscale * scales[j]);
            b[ib].d = ql_fp32_to_fp16(max_scale / 15.0f);
        }
        if (max_min > 0) {
            const float iscale = 15.0f / max_min;
            for (int j = 0; j < 16; j++) b[ib].scales[j] |= (uint8_t)(ql_nearest_int(iscale * mins[j]) << 4);
            b[ib].dmin = ql_fp32_to_fp16(max_min / 15.0f);
        }
        for (int j = 0; j < 16; j++) {
            const float d = ql_fp16_to_fp32(b[ib].d) * (float)(b[ib].scales[j] & 15);
            if (!d) continue;  // the sub-block keeps its fitted codes
            const float dm = ql_fp16_to_fp32(b[ib].dmin) * (float)(b[ib].scales[j] >> 4);
            for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)std::max(0, std::min(3, ql_nearest_int((x[16 * j + i] + dm) / d)));
        }
        kq_pack2(L, b[ib].qs);
    }
}

// a symmetric scale for 16 elements into codes [-4, 3]: start from max / -4, then up to 5 sweeps
// moving single codes where that raises the x^2-weighted fit (ggml's make_q3_quants, rmse)
static float kq_q3_scale(const float *x, int8_t *L) {
    const int n = 16, nmax = 4;
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-15f) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    const float iscale = -(float)nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = std::max(-nmax, std::min(nmax - 1, ql_nearest_int(iscale * x[i])));
        L[i] = (int8_t)l;
        const float w = rounded(x[i] * x[i]);
        sumlx += rounded(rounded(w * x[i]) * (float)l);
        suml2 += rounded(rounded(w * (float)l) * (float)l);
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = rounded(x[i] * x[i]);
            float slx = sumlx - rounded(rounded(w * x[i]) * (float)L[i]);
            if (slx > 0) {
                float sl2 = suml2 - rounded(rounded(w * (float)L[i]) * (float)L[i]);
                const int new_l = std::max(-nmax, std::min(nmax - 1, ql_nearest_int(rounded(x[i] * sl2) / slx)));
                if (new_l != L[i]) {
                    slx += rounded(rounded(w * x[i]) * (float)new_l);
                    sl2 += rounded(rounded(w * (float)new_l) * (float)new_l);
                    if (sl2 > 0 && rounded(rounded(slx * slx) * suml2) > rounded(rounded(sumlx * sumlx) * sl2)) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Q3_K: 16 signed scales quantised to 6 bits against the largest in magnitude (d = max / -32),
// codes again against the stored scales; the third bit of each code goes to hmask
static void q3_K_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_q3_K *b = (ql_block_q3_K *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float *x = src + ib * QL_QK_K;
        int8_t L[QL_QK_K];
        float scales[16], max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = kq_q3_scale(x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) amax = fabsf(scales[j]), max_scale = scales[j];
        }
        uint8_t *sb = b[ib].scales;  // the 6-bit layout q3_K_to_float reads
        memset(sb, 0, 12);
        b[ib].d = ql_fp32_to_fp16(0.0f);
        if (max_scale) {
            const float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                const int l = std::max(-32, std::min(31, ql_nearest_int(iscale * scales[j]))) + 32;
                if (j < 8) sb[j] = (uint8_t)(l & 15);
                else sb[j - 8] |= (uint8_t)((l & 15) << 4);
                sb[8 + j % 4] |= (uint8_t)((l >> 4) << 2 * (j / 4));
            }
            b[ib].d = ql_fp32_to_fp16(1 / iscale);
        }
        for (int j = 0; j < 16; j++) {
            const int lo4 = j < 8 ? sb[j] & 15 : sb[j - 8] >> 4, hi2 = (sb[8 + j % 4] >> 2 * (j / 4)) & 3;
            const float d = ql_fp16_to_fp32(b[ib].d) * (float)((lo4 | hi2 << 4) - 32);
            if (!d) continue;
            for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(std::max(-4, std::min(3, ql_nearest_int(x[16 * j + i] / d))) + 4);
        }
        uint8_t U[QL_QK_K];
        memset(b[ib].hmask, 0, sizeof(b[ib].hmask));
        for (int e = 0; e < QL_QK_K; e++) {  // element e: bit e / 32 of hmask[e % 32]
            U[e] = (uint8_t)(L[e] & 3);
            if (L[e] > 3) b[ib].hmask[e % 32] |= (uint8_t)(1u << (e / 32));
        }
        kq_pack2(U, b[ib].qs);
    }
}

// the index of the table value nearest x (ties to the lower; ends clamp): a bisection, as ggml's
static inline int iq4_nearest(float x) {
    const int8_t *v = k_iq4_values;
    if (x <= v[0]) return 0;
    if (x >= v[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < v[mid]) hi = mid;
        else lo = mid;
    }
    return x - (float)v[hi - 1] < (float)v[hi] - x ? hi - 1 : hi;
}

// the best scale of 32 elements on the non-linear table: least squares (weights x^2) at the
// scale that maps the largest element to -127, then at 15 trial scales around it
static float iq4_block_scale(const float *x) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
    if (amax < 1e-15f) return 0.0f;
    auto fit = [x](float id, float *sumqx, float *sumq2) {
        *sumqx = *sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            const float q = (float)k_iq4_values[iq4_nearest(id * x[j])], w = rounded(x[j] * x[j]);
            *sumqx += rounded(rounded(w * q) * x[j]);
            *sumq2 += rounded(rounded(w * q) * q);
        }
    };
    float sumqx, sumq2;
    fit(1 / (-max / (float)k_iq4_values[0]), &sumqx, &sumq2);
    float d = sumq2 > 0 ? sumqx / sumq2 : 0.0f, best = d * sumqx;
    for (int itry = -7; itry <= 7; itry++) {
        fit((float)(itry + k_iq4_values[0]) / max, &sumqx, &sumq2);
        if (sumq2 > 0 && rounded(sumqx * sumqx) > rounded(best * sumq2)) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

static void iq4_pack(const uint8_t L[32], uint8_t qs[16]) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(L[j] | L[16 + j] << 4);
}

static void iq4_nl_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK4_0 == 0);
    ql_block_iq4_nl *b = (ql_block_iq4_nl *)dst;
    for (int64_t ib = 0; ib < n / QL_QK4_0; ib++) {
        const float *x = src + ib * QL_QK4_0, d = iq4_block_scale(x), id = d ? 1 / d : 0.0f;
        uint8_t L[32];
        for (int j = 0; j < 32; j++) L[j] = (uint8_t)iq4_nearest(id * x[j]);
        b[ib].d = ql_fp32_to_fp16(d);
        iq4_pack(L, b[ib].qs);
    }
}

// IQ4_XS: the eight sub-block scales as 6-bit multiples of d = max / -32 (the largest in
// magnitude); codes against the quantised scales (d unrounded, as the reference)
static void iq4_xs_from_float(const float *src, void *dst, int64_t n) {
    QL_ASSERT(n % QL_QK_K == 0);
    ql_block_iq4_xs *b = (ql_block_iq4_xs *)dst;
    for (int64_t ib = 0; ib < n / QL_QK_K; ib++) {
        const float *x = src + ib * QL_QK_K;
        float scales[8], max_scale = 0, amax = 0;
        for (int s = 0; s < 8; s++) {
            scales[s] = iq4_block_scale(x + 32 * s);
            if (fabsf(scales[s]) > amax) amax = fabsf(scales[s]), max_scale = scales[s];
        }
        const float d = -max_scale / 32, id = d ? 1 / d : 0.0f;
        b[ib].d = ql_fp32_to_fp16(d);
        b[ib].scales_h = 0;
        for (int s = 0; s < 8; s++) {
            const int l = std::max(-32, std::min(31, ql_nearest_int(id * scales[s])));
            const float dl = d * (float)l, idl = dl ? 1 / dl : 0.0f;
            uint8_t L[32];
            for (int j = 0; j < 32; j++) L[j] = (uint8_t)iq4_nearest(idl * x[32 * s + j]);
            iq4_pack(L, b[ib].qs + 16 * s);
            const int u = l + 32;
            if (s % 2 == 0) b[ib].scales_l[s / 2] = (uint8_t)(u & 15);
            else b[ib].scales_l[s / 2] |= (uint8_t)((u & 15) << 4);
            b[ib].scales_h |= (uint16_t)((u >> 4) << 2 * s);
        }
    }
}

// ---- quantisation: bitsandbytes' NF4 and 8-bit dynamic map, whole tensors ----


static const float k_nf4_values[16] = QL_NF4_VALUES;
static const float k_nf4_thresholds[15] = QL_NF4_THRESHOLDS;

// the NF4 code of a normalised value: how many thresholds it is strictly above (ties: lower)
static inline uint8_t nf4_code(float x) {
    uint8_t c = 0;
    for (float t : k_nf4_thresholds) c += x > t;
    return c;
}

// torch.linspace(0.1, 1, n) in f32 exactly as torch's CPU kernel (AVX2 build) computes it:
// pairs of 8-wide vectors `base + k*step` (base fused: start + step*idx, or end - step*(n-1-idx)
// past the half), fused scalars for the remainder. bitsandbytes builds its map from this.
static void torch_linspace_01_1(int n, float *out) {
    const float start = 0.1f, end = 1.0f, step = (end - start) / (float)(n - 1);
    const int half = n / 2;
    auto scalar = [&](int i) { return i < half ? std::fma(step, (float)i, start) : std::fma(-step, (float)(n - 1 - i), end); };
    int i = 0;
    for (; i + 16 <= n;)  // whole pairs of vectors only (torch's vectorized loop), then scalars
        for (int u = 0; u < 2; u++, i += 8) {
            const float base = scalar(i);
            for (int k = 0; k < 8; k++) {
                out[i + k] = base + rounded(step * (float)k);  // two roundings, as the vector constructor
            }
        }
    for (; i < n; i++) out[i] = scalar(i);
}

struct dynamic_map_table {
    float v[256];
    // create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): unsigned maps take twice
    // the fractions per exponent and no negatives
    explicit dynamic_map_table(bool is_signed) {
        int n = 0;
        float b[129];
        for (int i = 0; i < 7; i++) {
            const int m = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
            torch_linspace_01_1(m, b);
            const float scale = (float)std::pow(10.0, (double)(i - 6));  // the python scalar, then f32
            for (int j = 0; j + 1 < m; j++) {
                const float mean = (b[j] + b[j + 1]) / 2.0f;
                v[n++] = scale * mean;
                if (is_signed) v[n++] = -(scale * mean);
            }
        }
        v[n++] = 0.0f;
        v[n++] = 1.0f;
        QL_ASSERT(n == 256);
        std::sort(v, v + 256);
    }
};

const float *ql_dynamic_map_signed(void) {
    static const dynamic_map_table t(true);
    return t.v;
}

const float *ql_dynamic_map_unsigned(void) {
    static const dynamic_map_table t(false);
    return t.v;
}

uint8_t ql_dynamic_quantize(const float *map, float x) { return ql_dynamic_quantize_inline(map, x); }

// a double-quantised absmax: two f32 roundings, as bitsandbytes multiplies and then adds
static inline float nf4_absmax(const float *map, uint8_t code, float scale, float offset) {
    return rounded(map[code] * scale) + offset;
}

// NF4 side data, located from its header (see qlora.h)
struct nf4_aux {
    uint32_t n_blocks;
    float offset;
    const float *map, *scale;
    const uint8_t *code;
    explicit nf4_aux(const void *aux) {
        const float *f = (const float *)aux;
        memcpy(&n_blocks, f, 4);
        offset = f[1];
        map = f + 2;
        scale = map + 256;
        code = (const uint8_t *)(scale + (n_blocks + QL_NF4_GROUP - 1) / QL_NF4_GROUP);
    }
    float absmax(int64_t b) const { return nf4_absmax(map, code[b], scale[b / QL_NF4_GROUP], offset); }
};

static bool all_finite(const float *x, int64_t n, int64_t *bad);

// side data read from a file: the block count in its header locates the codes, so it must be
// this tensor's; the statistics must be numbers
static bool nf4_aux_check(const void *aux, int64_t n) {
    const nf4_aux a(aux);
    int64_t bad;
    if (!((int64_t)a.n_blocks == nf4_n_blocks(n) && std::isfinite(a.offset) && all_finite(a.map, 256, &bad) &&
          all_finite(a.scale, nf4_n_groups(n), &bad)))
        return false;
    for (int64_t b = 0; b < (int64_t)a.n_blocks; b++)  // finite statistics can still make an infinite absmax
        if (!std::isfinite(a.absmax(b))) return false;
    return true;
}
static bool nf4_nodq_aux_check(const void *aux, int64_t n) {
    int64_t bad;
    return all_finite((const float *)aux, nf4_n_blocks(n), &bad);
}

static bool all_finite(const float *x, int64_t n, int64_t *bad) {
    for (int64_t i = 0; i < n; i++)
        if (!std::isfinite(x[i])) {
            *bad = i;
            return false;
        }
    return true;
}

static ql_status fail_msg(char *err, size_t err_size, ql_status st, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static ql_status fail_msg(char *err, size_t err_size, ql_status st, const char *fmt, ...) {
    if (err && err_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_size, fmt, ap);
        va_end(ap);
    }
    return st;
}

// x[0..n) in blocks of 64 (the last may be partial) -> packed codes + absmax, as bitsandbytes'
// quantize_4bit: s = 1/max(absmax, 1e-38) (f32), code of x*s; an odd tail pads with 0.0's code
static void nf4_quantize_blocks(const float *x, int64_t n, uint8_t *packed, float *absmax) {
    for (int64_t b = 0; b * QL_NF4_BLOCK < n; b++) {
        const int64_t lo = b * QL_NF4_BLOCK, hi = std::min(n, lo + QL_NF4_BLOCK);
        float am = 0.0f;
        for (int64_t i = lo; i < hi; i++) am = std::max(am, std::fabs(x[i]));
        absmax[b] = am;
        const float s = 1.0f / std::max(am, 1e-38f);  // all-zero blocks: codes of 0.0, absmax 0
        for (int64_t i = lo; i < hi; i += 2) {
            const uint8_t c0 = nf4_code(x[i] * s), c1 = i + 1 < hi ? nf4_code(x[i + 1] * s) : nf4_code(0.0f);
            packed[i / 2] = (uint8_t)(c0 << 4 | c1);
        }
    }
}

void ql_nf4_quantize_flat(const float *x, int64_t n, uint8_t *packed, float *absmax) {
    nf4_quantize_blocks(x, n, packed, absmax);
}

// QLoRA's double quantisation of the absmax: offset = mean (in double, rounded once), the
// centred values in groups of 256, each group scaled by its max |value|, 8-bit dynamic codes
static void nf4_double_quantize(const float *absmax, int64_t n_blocks, const float *map, float *offset, float *scale,
                                uint8_t *code) {
    double sum = 0;
    for (int64_t b = 0; b < n_blocks; b++) sum += absmax[b];
    *offset = n_blocks ? (float)(sum / (double)n_blocks) : 0.0f;
    for (int64_t g = 0; g * QL_NF4_GROUP < n_blocks; g++) {
        const int64_t lo = g * QL_NF4_GROUP, hi = std::min(n_blocks, lo + QL_NF4_GROUP);
        float am = 0.0f;
        for (int64_t b = lo; b < hi; b++) am = std::max(am, std::fabs(absmax[b] - *offset));
        scale[g] = am;
        const float inv = 1.0f / std::max(am, 1e-38f);
        for (int64_t b = lo; b < hi; b++) code[b] = ql_dynamic_quantize(map, (absmax[b] - *offset) * inv);
    }
}

// header + map of the NF4 side data; returns where the group scales go
static float *nf4_aux_init(void *aux, int64_t n_blocks, const float *map, float offset) {
    float *f = (float *)aux;
    const uint32_t nb = (uint32_t)n_blocks;
    memcpy(f, &nb, 4);
    f[1] = offset;
    memcpy(f + 2, map, 256 * sizeof(float));
    return f + 2 + 256;
}

// Where the side data of n_rows rows of ne0 starts: after the rows, padded to 4 bytes (see
// qlora.h). ql_quantize writes it there; ql_dequantize and the GGUF reader check it there.
static size_t type_aux_offset(ql_type type, int64_t n_rows, int64_t ne0) {
    return ql_aux_offset(ql_row_size(type, ne0) * (size_t)n_rows);
}
// side data from outside (a file, a caller's buffer) checked where it lies; true for types
// without side data
static bool type_aux_valid(ql_type type, const void *data, int64_t n_rows, int64_t ne0) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    return !tt->aux_check || tt->aux_check((const uint8_t *)data + type_aux_offset(type, n_rows, ne0), n_rows * ne0);
}

ql_status ql_quantize(ql_type type, const float *src, int64_t n_rows, int64_t ne0, void *dst, char *err, size_t err_size) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    if (!tt || !tt->is_float || (!tt->from_float && !tt->aux_bytes))
        return fail_msg(err, err_size, QL_ERR_TYPE, "quantize: cannot produce type %s", ql_type_name(type));
    if (n_rows < 0 || ne0 <= 0 || ne0 % tt->blck_size != 0)
        return fail_msg(err, err_size, QL_ERR_SHAPE, "quantize: rows of %lld elements are not whole %s blocks of %lld",
                        (long long)ne0, tt->name, (long long)tt->blck_size);
    if (n_rows > INT64_MAX / ne0 / 4)  // (the element count and its bytes must be numbers)
        return fail_msg(err, err_size, QL_ERR_SHAPE, "quantize: %lld rows of %lld elements are too many", (long long)n_rows,
                        (long long)ne0);
    if ((n_rows > 0 && !src) || (!dst && (n_rows > 0 || tt->aux_bytes)))  // (NF4 writes its side data's header even for 0 rows)
        return fail_msg(err, err_size, QL_ERR_INVALID, "quantize: NULL %s", !dst ? "dst" : "src");
    const int64_t n = n_rows * ne0;
    int64_t bad;
    if (!all_finite(src, n, &bad))
        return fail_msg(err, err_size, QL_ERR_INVALID, "quantize: element %lld (row %lld, column %lld) is %s", (long long)bad,
                        (long long)(bad / ne0), (long long)(bad % ne0), std::isnan(src[bad]) ? "nan" : "infinite");
    if (tt->from_float) {
        const size_t rs = ql_row_size(type, ne0);
        for (int64_t r = 0; r < n_rows; r++) tt->from_float(src + r * ne0, (uint8_t *)dst + (size_t)r * rs, ne0);
        return QL_OK;
    }
    const int64_t nb = nf4_n_blocks(n);
    uint8_t *packed = (uint8_t *)dst;
    uint8_t *aux = packed + type_aux_offset(type, n_rows, ne0);
    if (type == QL_TYPE_NF4_NODQ) {
        nf4_quantize_blocks(src, n, packed, (float *)aux);
        return QL_OK;
    }
    std::vector<float> absmax((size_t)nb);  // not the step loop: tools and loaders
    nf4_quantize_blocks(src, n, packed, absmax.data());
    const float *map = ql_dynamic_map_signed();
    float offset = 0;
    std::vector<float> scale((size_t)nf4_n_groups(n));
    std::vector<uint8_t> code((size_t)nb);
    nf4_double_quantize(absmax.data(), nb, map, &offset, scale.data(), code.data());
    float *sc = nf4_aux_init(aux, nb, map, offset);
    if (nb > 0) {  // (no memcpy from an empty vector's NULL)
        memcpy(sc, scale.data(), scale.size() * sizeof(float));
        memcpy(sc + scale.size(), code.data(), code.size());
    }
    return QL_OK;
}

ql_status ql_dequantize(ql_type type, const void *src, int64_t n_rows, int64_t ne0, float *dst) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    if (!tt || !tt->is_float || ne0 <= 0 || ne0 % tt->blck_size != 0) return QL_ERR_TYPE;
    if (n_rows < 0 || n_rows > INT64_MAX / ne0 / 4 || (n_rows > 0 && (!src || !dst))) return QL_ERR_INVALID;
    const size_t rs = ql_row_size(type, ne0);
    const uint8_t *aux = (const uint8_t *)src + type_aux_offset(type, n_rows, ne0);
    // side data's header locates the rest of it: checked as the GGUF reader checks it
    if (n_rows > 0 && !type_aux_valid(type, src, n_rows, ne0)) return QL_ERR_INVALID;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = (const uint8_t *)src + (size_t)r * rs;
        if (tt->to_float_aux)
            tt->to_float_aux(row, aux, r * ne0, dst + r * ne0, ne0);
        else
            tt->to_float(row, dst + r * ne0, ne0);
    }
    return QL_OK;
}

ql_status ql_tensor_row_to_float(const ql_tensor *t, int64_t r, float *dst) {
    const ql_type_traits *tt = t ? ql_type_traits_get(t->type) : nullptr;
    if (!tt || !tt->is_float || !t->data || t->view_src || !ql_rows_contiguous(t) || r < 0 || r >= ql_nrows(t)) return QL_ERR_INVALID;
    const uint8_t *row = (const uint8_t *)t->data + (size_t)r * t->nb[1];
    if (tt->to_float_aux) tt->to_float_aux(row, ql_aux_data(t), r * t->ne[0], dst, t->ne[0]);
    else tt->to_float(row, dst, t->ne[0]);
    return QL_OK;
}

static bool nf4_type(ql_type t) { return t == QL_TYPE_NF4 || t == QL_TYPE_NF4_NODQ; }

ql_status ql_nf4_from_bnb(const ql_bnb_nf4 *in, ql_type type, int64_t ne0, void *dst, char *err, size_t err_size) {
    if (!in || !dst || !nf4_type(type)) return fail_msg(err, err_size, QL_ERR_INVALID, "nf4_from_bnb: bad arguments");
    if (ne0 <= 0 || ne0 % 2 != 0 || in->n <= 0 || in->n % ne0 != 0)
        return fail_msg(err, err_size, QL_ERR_SHAPE,
                        "nf4_from_bnb: %lld elements do not form rows of %lld (an even number: two codes a byte)",
                        (long long)in->n, (long long)ne0);
    if (!in->packed || !in->quant_map || (in->nested ? !in->absmax_codes || !in->nested_absmax || !in->nested_quant_map
                                                     : !in->absmax))
        return fail_msg(err, err_size, QL_ERR_INVALID, "nf4_from_bnb: missing %s arrays",
                        in->nested ? "packed/absmax/nested_absmax/quant_map/nested_quant_map" : "packed/absmax/quant_map");
    for (int i = 0; i < 16; i++)
        if (memcmp(&in->quant_map[i], &k_nf4_values[i], 4) != 0)
            return fail_msg(err, err_size, QL_ERR_INVALID,
                            "nf4_from_bnb: quant_map[%d] = %.9g is not NF4's %.9g (an fp4 or custom checkpoint?)", i,
                            (double)in->quant_map[i], (double)k_nf4_values[i]);
    if (type == QL_TYPE_NF4 && !in->nested)
        return fail_msg(err, err_size, QL_ERR_INVALID,
                        "nf4_from_bnb: the checkpoint has plain fp32 absmax; double quantising it would not be lossless "
                        "--> hint: import as nf4_nodq");
    const int64_t n = in->n, nb = nf4_n_blocks(n), ng = nf4_n_groups(n);
    if (in->nested) {
        int64_t bad;
        if (!all_finite(in->nested_quant_map, 256, &bad) || !all_finite(in->nested_absmax, ng, &bad) ||
            !std::isfinite(in->nested_offset))
            return fail_msg(err, err_size, QL_ERR_INVALID, "nf4_from_bnb: non-finite double-quantisation statistics");
    }
    memcpy(dst, in->packed, (size_t)(n / 2));
    uint8_t *aux = (uint8_t *)dst + type_aux_offset(type, n / ne0, ne0);
    if (type == QL_TYPE_NF4) {
        float *sc = nf4_aux_init(aux, nb, in->nested_quant_map, in->nested_offset);
        memcpy(sc, in->nested_absmax, (size_t)ng * sizeof(float));
        memcpy(sc + ng, in->absmax_codes, (size_t)nb);
    } else if (in->nested) {  // reconstruct the absmax exactly as bitsandbytes dequantises them
        float *am = (float *)aux;
        for (int64_t b = 0; b < nb; b++)
            am[b] = nf4_absmax(in->nested_quant_map, in->absmax_codes[b], in->nested_absmax[b / QL_NF4_GROUP], in->nested_offset);
    } else {
        memcpy(aux, in->absmax, (size_t)nb * sizeof(float));
    }
    return QL_OK;
}

ql_status ql_nf4_to_bnb(ql_type type, const void *src, int64_t n_rows, int64_t ne0, ql_bnb_nf4 *out) {
    if (!src || !out || !nf4_type(type) || ne0 <= 0 || ne0 % 2 != 0 || n_rows < 0) return QL_ERR_INVALID;
    const int64_t n = n_rows * ne0, nb = nf4_n_blocks(n), ng = nf4_n_groups(n);
    out->n = n;
    out->nested = type == QL_TYPE_NF4;
    if (!out->packed || !out->quant_map || (out->nested ? !out->absmax_codes || !out->nested_absmax || !out->nested_quant_map
                                                       : !out->absmax))
        return QL_ERR_INVALID;
    memcpy(out->packed, src, (size_t)(n / 2));
    memcpy(out->quant_map, k_nf4_values, sizeof(k_nf4_values));
    const uint8_t *aux = (const uint8_t *)src + type_aux_offset(type, n_rows, ne0);
    if (out->nested) {
        const nf4_aux a(aux);
        out->nested_offset = a.offset;
        memcpy(out->nested_quant_map, a.map, 256 * sizeof(float));
        memcpy(out->nested_absmax, a.scale, (size_t)ng * sizeof(float));
        memcpy(out->absmax_codes, a.code, (size_t)nb);
    } else {
        memcpy(out->absmax, aux, (size_t)nb * sizeof(float));
    }
    return QL_OK;
}

// ============================================================================================
// 4. context / arena
// ============================================================================================

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t ql_tensor_overhead(void) { return align_up(sizeof(ql_tensor), QL_ALIGN); }

ql_context *ql_init(ql_init_params p) {
    ql_context *ctx = new (std::nothrow) ql_context();
    if (!ctx) return nullptr;
    ctx->no_alloc = p.no_alloc;
    ctx->measure  = p.measure;
    if (p.measure) return ctx;
    ctx->mem_size = p.mem_size;
    if (p.mem_buffer) {
        ctx->mem = (uint8_t *)p.mem_buffer;
        QL_ASSERT(((uintptr_t)ctx->mem % QL_ALIGN) == 0 && "mem_buffer must be QL_ALIGN-aligned");
    } else if (p.mem_size > 0) {
        // (a size within QL_ALIGN of SIZE_MAX would round up to 0: a tiny block for a huge arena)
        ctx->mem = p.mem_size <= SIZE_MAX - QL_ALIGN ? (uint8_t *)aligned_alloc(QL_ALIGN, align_up(p.mem_size, QL_ALIGN)) : nullptr;
        if (!ctx->mem) {
            delete ctx;
            return nullptr;
        }
        ctx->own_mem = true;
    }
    return ctx;
}

void ql_free(ql_context *ctx) {
    if (!ctx) return;
    if (ctx->own_mem) free(ctx->mem);
    delete ctx;
}

size_t ql_used_mem(const ql_context *ctx) { return ctx ? ctx->used : 0; }
size_t ql_ctx_data_size(const ql_context *ctx) { return ctx ? ctx->data_size : 0; }
bool   ql_ctx_is_measure(const ql_context *ctx) { return ctx && ctx->measure; }

// Carves `size` bytes from the arena; NULL (with an error naming `what`) when it is full.
static void *arena_take(ql_context *ctx, size_t size, const char *what, const char *detail = "") {
    const size_t need = align_up(size, QL_ALIGN);
    if (ctx->measure) {
        ctx->used += need;
        return nullptr;
    }
    if (ctx->used + need > ctx->mem_size) {
        QL_ERR(ctx, QL_ERR_NOMEM,
               "%s%s: context arena exhausted: need %zu more bytes, %zu of %zu used"
               " --> hint: raise ql_init_params.mem_size (measure first with .measure = true)",
               what, detail, need, ctx->used, ctx->mem_size);
        return nullptr;
    }
    void *p = ctx->mem + ctx->used;
    ctx->used += need;
    return p;
}

// ============================================================================================
// 5. tensors and views
// ============================================================================================

static std::string shape_str(const ql_tensor *t) {
    if (!t) return "(null)";
    char buf[160];
    int  nd = std::max(1, ql_n_dims(t)), n = 0;
    n += snprintf(buf + n, sizeof(buf) - n, "[");
    for (int i = 0; i < nd; i++) n += snprintf(buf + n, sizeof(buf) - n, "%s%lld", i ? ", " : "", (long long)t->ne[i]);
    n += snprintf(buf + n, sizeof(buf) - n, "] %s", ql_type_name(t->type));
    if (t->name[0]) snprintf(buf + n, sizeof(buf) - n, " '%s'", t->name);
    return buf;
}

int64_t ql_nelements(const ql_tensor *t) { return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]; }
int64_t ql_nrows(const ql_tensor *t) { return t->ne[1] * t->ne[2] * t->ne[3]; }

size_t ql_nbytes(const ql_tensor *t) {
    for (int i = 0; i < QL_MAX_DIMS; i++)
        if (t->ne[i] <= 0) return 0;
    const ql_type_traits &tt = traits(t->type);
    size_t n = (size_t)(t->ne[0] / tt.blck_size) * t->nb[0];
    for (int i = 1; i < QL_MAX_DIMS; i++) n += (size_t)(t->ne[i] - 1) * t->nb[i];
    return n;
}

int ql_n_dims(const ql_tensor *t) {
    for (int i = QL_MAX_DIMS - 1; i >= 1; i--)
        if (t->ne[i] > 1) return i + 1;
    return 1;
}

bool ql_is_contiguous(const ql_tensor *t) {
    size_t expect = traits(t->type).type_size;
    if (t->nb[0] != expect) return false;
    expect = ql_row_size(t->type, t->ne[0]);
    for (int i = 1; i < QL_MAX_DIMS; i++) {
        if (t->ne[i] != 1 && t->nb[i] != expect) return false;
        expect *= (size_t)t->ne[i];
    }
    return true;
}

bool ql_rows_contiguous(const ql_tensor *t) { return t->nb[0] == traits(t->type).type_size; }

bool ql_same_shape(const ql_tensor *a, const ql_tensor *b) {
    for (int i = 0; i < QL_MAX_DIMS; i++)
        if (a->ne[i] != b->ne[i]) return false;
    return true;
}

size_t ql_aux_offset(size_t row_bytes) { return (row_bytes + 3) / 4 * 4; }
void *ql_aux_data(const ql_tensor *t) {
    return (t && t->data && t->aux_size) ? (uint8_t *)t->data + ql_aux_offset(ql_nbytes(t)) : nullptr;
}

static void set_contiguous_strides(ql_tensor *t) {
    t->nb[0] = traits(t->type).type_size;
    t->nb[1] = ql_row_size(t->type, t->ne[0]);
    for (int i = 2; i < QL_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
}

// The one place headers are made. Leafs (op NONE, no view) get data unless no_alloc.
static ql_tensor *new_tensor_impl(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne, const char *what) {
    if (!ctx) return nullptr;
    if (ctx->status != QL_OK) return nullptr;
    const ql_type_traits *tt = ql_type_traits_get(type);
    if (!tt) {
        QL_ERR(ctx, QL_ERR_TYPE, "%s: unknown type id %d", what, (int)type);
        return nullptr;
    }
    if (n_dims < 1 || n_dims > QL_MAX_DIMS) {
        QL_ERR(ctx, QL_ERR_SHAPE, "%s: n_dims %d outside 1..%d", what, n_dims, QL_MAX_DIMS);
        return nullptr;
    }
    int64_t n[QL_MAX_DIMS] = {1, 1, 1, 1};
    for (int i = 0; i < n_dims; i++) {
        if (ne[i] < 0 || ne[i] > ((int64_t)1 << 40)) {
            QL_ERR(ctx, QL_ERR_SHAPE, "%s: ne[%d] = %lld out of range", what, i, (long long)ne[i]);
            return nullptr;
        }
        n[i] = ne[i];
    }
    if (n[0] % tt->blck_size != 0) {
        QL_ERR(ctx, QL_ERR_SHAPE, "%s: ne[0] = %lld is not a multiple of %s's block size %lld", what,
               (long long)n[0], tt->name, (long long)tt->blck_size);
        return nullptr;
    }
    uint64_t bytes = (uint64_t)(n[0] / tt->blck_size) * tt->type_size;
    for (int i = 1; i < QL_MAX_DIMS; i++)
        if (__builtin_mul_overflow(bytes, (uint64_t)n[i], &bytes) || bytes > ((uint64_t)1 << 56)) {
            QL_ERR(ctx, QL_ERR_SHAPE, "%s: [%lld, %lld, %lld, %lld] %s is too large (over 2^56 bytes)", what,
                   (long long)n[0], (long long)n[1], (long long)n[2], (long long)n[3], tt->name);
            return nullptr;
        }
    ql_tensor *t;
    if (ctx->measure) {
        ctx->measure_hdr.emplace_back(new ql_tensor);
        t = ctx->measure_hdr.back().get();
        arena_take(ctx, sizeof(ql_tensor), what);
    } else {
        char detail[128];
        snprintf(detail, sizeof(detail), " [%lld, %lld, %lld, %lld] %s", (long long)n[0], (long long)n[1],
                 (long long)n[2], (long long)n[3], tt->name);
        t = (ql_tensor *)arena_take(ctx, sizeof(ql_tensor), what, detail);
        if (!t) return nullptr;
    }
    memset(t, 0, sizeof(*t));
    t->type = type;
    for (int i = 0; i < QL_MAX_DIMS; i++) t->ne[i] = n[i];
    set_contiguous_strides(t);
    ctx->tensors.push_back(t);
    return t;
}

static ql_tensor *new_leaf(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne) {
    ql_tensor *t = new_tensor_impl(ctx, type, n_dims, ne, "new_tensor");
    if (!t) return nullptr;
    const ql_type_traits &tt = traits(type);
    t->aux_size = tt.aux_bytes ? tt.aux_bytes(ql_nelements(t)) : 0;  // side data right after the rows
    const size_t size = ql_nbytes(t) + t->aux_size;
    ctx->data_size += align_up(size, QL_ALIGN);
    if (!ctx->no_alloc) {
        t->data = arena_take(ctx, size, "new_tensor", (" data of " + shape_str(t)).c_str());
        if (!t->data && !ctx->measure) return nullptr;
    }
    return t;
}

ql_tensor *ql_new_tensor(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne) {
    return new_leaf(ctx, type, n_dims, ne);
}
ql_tensor *ql_new_tensor_1d(ql_context *ctx, ql_type type, int64_t ne0) {
    return new_leaf(ctx, type, 1, &ne0);
}
ql_tensor *ql_new_tensor_2d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1) {
    const int64_t ne[2] = {ne0, ne1};
    return new_leaf(ctx, type, 2, ne);
}
ql_tensor *ql_new_tensor_3d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    const int64_t ne[3] = {ne0, ne1, ne2};
    return new_leaf(ctx, type, 3, ne);
}
ql_tensor *ql_new_tensor_4d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    const int64_t ne[4] = {ne0, ne1, ne2, ne3};
    return new_leaf(ctx, type, 4, ne);
}

ql_tensor *ql_set_name(ql_tensor *t, const char *name) {
    if (t) snprintf(t->name, sizeof(t->name), "%s", name ? name : "");
    return t;
}
ql_tensor *ql_format_name(ql_tensor *t, const char *fmt, ...) {
    if (!t) return t;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    return t;
}
ql_tensor *ql_set_param(ql_tensor *t) {
    if (t) t->flags |= QL_FLAG_PARAM;
    return t;
}
ql_tensor *ql_set_input(ql_tensor *t) {
    if (t) t->flags |= QL_FLAG_INPUT;
    return t;
}
ql_tensor *ql_set_output(ql_tensor *t) {
    if (t) t->flags |= QL_FLAG_OUTPUT;
    return t;
}

// logical flat index -> byte address
static uint8_t *elem_ptr(const ql_tensor *t, int64_t i) {
    const int64_t i0 = i % t->ne[0], i1 = (i / t->ne[0]) % t->ne[1];
    const int64_t i2 = (i / (t->ne[0] * t->ne[1])) % t->ne[2], i3 = i / (t->ne[0] * t->ne[1] * t->ne[2]);
    return (uint8_t *)t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

static ql_tensor *view_root(ql_tensor *t);
// t's byte offset into its view root, through the views between
static size_t view_root_offset(const ql_tensor *t) {
    size_t offs = 0;
    for (const ql_tensor *v = t; v->view_src; v = v->view_src) offs += v->view_offs;
    return offs;
}
static void row_to_float(const ql_tensor *t, const uint8_t *row, int64_t k0, int64_t n, float *dst);

float ql_get_f32_1d(const ql_tensor *t, int64_t i) {
    QL_ASSERT(t && t->data && i >= 0 && i < ql_nelements(t));
    if (t->type == QL_TYPE_I32) return (float)*(const int32_t *)elem_ptr(t, i);
    const ql_type_traits &tt = traits(t->type);
    QL_ASSERT(tt.is_float);
    if (tt.blck_size == 1 && tt.to_float) {
        float v;
        tt.to_float(elem_ptr(t, i), &v, 1);
        return v;
    }
    // a block type: convert the block holding element i (rows must be dense)
    QL_ASSERT(ql_rows_contiguous(t) && tt.blck_size <= 256);
    const int64_t k = i % t->ne[0], k0 = k - k % tt.blck_size;
    float blk[256];
    row_to_float(t, elem_ptr(t, i - k), k0, tt.blck_size, blk);
    return blk[k - k0];
}

void ql_set_f32_1d(ql_tensor *t, int64_t i, float v) {
    QL_ASSERT(t && t->data && i >= 0 && i < ql_nelements(t));
    uint8_t *p = elem_ptr(t, i);
    if (t->type == QL_TYPE_I32) {
        *(int32_t *)p = (int32_t)v;
        return;
    }
    const ql_type_traits &tt = traits(t->type);
    QL_ASSERT(tt.blck_size == 1 && tt.from_float);
    tt.from_float(&v, p, 1);
}

void ql_tensor_fill_f32(ql_tensor *t, float v) {
    const int64_t n = ql_nelements(t);
    for (int64_t i = 0; i < n; i++) ql_set_f32_1d(t, i, v);
}

// ============================================================================================
// 6. op constructors: validate, then record (op, sources, params). Nothing is computed here.
// ============================================================================================

static const char *k_op_names[] = {
    "none",        "fill",          "cont",       "view",          "reshape",         "permute",
    "transpose",   "add",           "mul",        "scale",         "sum",             "reduce_to",
    "mul_mat",     "get_rows",      "get_rows_back", "rms_norm",   "rms_norm_back",   "rope",
    "rope_back",   "silu",          "silu_back",  "swiglu",        "swiglu_back",     "flash_attn",
    "flash_attn_back", "cross_entropy", "cross_entropy_back", "dropout", "view_back",  "acc_grad",
    "cache_store", "to_host",      "to_device",     "add_rows",      "with_grad",
    "mul_mat_rows", "mul_mat_dropout",
};
static_assert(sizeof(k_op_names) / sizeof(k_op_names[0]) == QL_OP_COUNT, "op names out of sync with ql_op");

const char *ql_op_name(ql_op op) { return (op >= 0 && op < QL_OP_COUNT) ? k_op_names[op] : "?"; }

// ops whose result is a view of their source: nothing to run
static bool is_noop(ql_op op) {
    return op == QL_OP_VIEW || op == QL_OP_RESHAPE || op == QL_OP_PERMUTE || op == QL_OP_TRANSPOSE || op == QL_OP_WITH_GRAD;
}
// ops whose result aliases another tensor's memory: the planner places nothing for them
static bool aliases_src(ql_op op) {
    return is_noop(op) || op == QL_OP_ACC_GRAD || op == QL_OP_CACHE_STORE || op == QL_OP_MUL_MAT_ROWS;
}

template <typename T> static void set_param(ql_tensor *t, int slot, T v) {
    static_assert(sizeof(T) % 4 == 0, "params are int32 slots");
    QL_ASSERT(slot * 4 + sizeof(T) <= sizeof(t->op_params));
    memcpy(&t->op_params[slot], &v, sizeof(T));
}
template <typename T> static T get_param(const ql_tensor *t, int slot) {
    T v;
    memcpy(&v, &t->op_params[slot], sizeof(T));
    return v;
}

// A constructor given a NULL source fails quietly: the first failure already left its message.
static bool srcs_ok(ql_context *ctx, const char *op, std::initializer_list<const ql_tensor *> srcs) {
    if (!ctx) return false;
    for (const ql_tensor *s : srcs) {
        if (!s) {
            if (ctx->status == QL_OK) QL_ERR(ctx, QL_ERR_INVALID, "%s: a source tensor is NULL", op);
            return false;
        }
    }
    return ctx->status == QL_OK;
}

static ql_tensor *new_op(ql_context *ctx, ql_op op, ql_type type, const int64_t ne[4],
                         std::initializer_list<ql_tensor *> srcs) {
    ql_tensor *t = new_tensor_impl(ctx, type, 4, ne, ql_op_name(op));
    if (!t) return nullptr;
    t->op = op;
    int i = 0;
    for (ql_tensor *s : srcs) t->src[i++] = s;
    return t;
}

static ql_tensor *new_op_like(ql_context *ctx, ql_op op, ql_type type, const ql_tensor *like,
                              std::initializer_list<ql_tensor *> srcs) {
    return new_op(ctx, op, type, like->ne, srcs);
}

#define QL_CHECK(ctx, cond, st, ...)                                                            \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            QL_ERR(ctx, st, __VA_ARGS__);                                                       \
            return nullptr;                                                                     \
        }                                                                                       \
    } while (0)

static bool is_float_type(ql_type t) {
    const ql_type_traits *tt = ql_type_traits_get(t);
    return tt && tt->is_float;
}

ql_tensor *ql_fill(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne, float value) {
    if (!srcs_ok(ctx, "fill", {})) return nullptr;
    QL_CHECK(ctx, n_dims >= 1 && n_dims <= 4, QL_ERR_SHAPE, "fill: n_dims %d outside 1..4", n_dims);
    int64_t n[4] = {1, 1, 1, 1};
    for (int i = 0; i < n_dims; i++) n[i] = ne[i];
    QL_CHECK(ctx, type == QL_TYPE_F32, QL_ERR_TYPE, "fill: type %s: only f32 results", ql_type_name(type));
    ql_tensor *t = new_op(ctx, QL_OP_FILL, type, n, {});
    if (t) set_param(t, 0, value);
    return t;
}

static ql_tensor *make_view(ql_context *ctx, ql_op op, ql_tensor *a, const int64_t ne[4], const size_t nb[4],
                            size_t offset) {
    ql_tensor *t = new_tensor_impl(ctx, a->type, 4, ne, ql_op_name(op));
    if (!t) return nullptr;
    t->op = op;
    t->src[0] = a;
    for (int i = 0; i < 4; i++) t->nb[i] = nb[i];
    t->view_src  = a;
    t->view_offs = offset;
    if (a->data) t->data = (uint8_t *)a->data + offset;
    return t;
}

ql_tensor *ql_view_4d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                      size_t nb1, size_t nb2, size_t nb3, size_t offset) {
    if (!srcs_ok(ctx, "view", {a})) return nullptr;
    const int64_t ne[4] = {ne0, ne1, ne2, ne3};
    const size_t  nb[4] = {traits(a->type).type_size, nb1, nb2, nb3};
    ql_tensor tmp;
    memset(&tmp, 0, sizeof(tmp));
    tmp.type = a->type;
    for (int i = 0; i < 4; i++) { tmp.ne[i] = ne[i]; tmp.nb[i] = nb[i]; }
    QL_CHECK(ctx, ne0 >= 0 && ne1 >= 0 && ne2 >= 0 && ne3 >= 0 && ne0 % traits(a->type).blck_size == 0,
             QL_ERR_SHAPE, "view: bad shape %s of %s", shape_str(&tmp).c_str(), shape_str(a).c_str());
    const size_t bs = traits(a->type).type_size;  // block types: rows begin on whole blocks
    QL_CHECK(ctx, traits(a->type).blck_size == 1 || (offset % bs == 0 && nb1 % bs == 0 && nb2 % bs == 0 && nb3 % bs == 0),
             QL_ERR_SHAPE, "view: offset %zu and strides [%zu, %zu, %zu] of block-quantized %s must be whole %zu-byte blocks",
             offset, nb1, nb2, nb3, shape_str(a).c_str(), bs);
    QL_CHECK(ctx, offset + ql_nbytes(&tmp) <= ql_nbytes(a), QL_ERR_SHAPE,
             "view: %s at offset %zu with strides [%zu, %zu, %zu] reaches byte %zu, past the %zu bytes of %s",
             shape_str(&tmp).c_str(), offset, nb1, nb2, nb3, offset + ql_nbytes(&tmp), ql_nbytes(a),
             shape_str(a).c_str());
    return make_view(ctx, QL_OP_VIEW, a, ne, nb, offset);
}
ql_tensor *ql_view_1d(ql_context *ctx, ql_tensor *a, int64_t ne0, size_t offset) {
    if (!srcs_ok(ctx, "view", {a})) return nullptr;
    const size_t rs = ql_row_size(a->type, ne0);
    return ql_view_4d(ctx, a, ne0, 1, 1, 1, rs, rs, rs, offset);
}
ql_tensor *ql_view_2d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset) {
    return ql_view_4d(ctx, a, ne0, ne1, 1, 1, nb1, nb1 * (size_t)ne1, nb1 * (size_t)ne1, offset);
}
ql_tensor *ql_view_3d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, size_t nb1, size_t nb2,
                      size_t offset) {
    return ql_view_4d(ctx, a, ne0, ne1, ne2, 1, nb1, nb2, nb2 * (size_t)ne2, offset);
}

static ql_tensor *reshape_impl(ql_context *ctx, ql_tensor *a, const int64_t ne[4]) {
    if (!srcs_ok(ctx, "reshape", {a})) return nullptr;
    QL_CHECK(ctx, ql_is_contiguous(a), QL_ERR_SHAPE,
             "reshape: source %s is not contiguous --> hint: ql_cont it first", shape_str(a).c_str());
    QL_CHECK(ctx, ne[0] * ne[1] * ne[2] * ne[3] == ql_nelements(a) && ne[0] % traits(a->type).blck_size == 0,
             QL_ERR_SHAPE, "reshape: %s to [%lld, %lld, %lld, %lld]: element counts differ", shape_str(a).c_str(),
             (long long)ne[0], (long long)ne[1], (long long)ne[2], (long long)ne[3]);
    ql_tensor tmp;
    memset(&tmp, 0, sizeof(tmp));
    tmp.type = a->type;
    for (int i = 0; i < 4; i++) tmp.ne[i] = ne[i];
    set_contiguous_strides(&tmp);
    return make_view(ctx, QL_OP_RESHAPE, a, ne, tmp.nb, 0);
}
ql_tensor *ql_reshape_1d(ql_context *ctx, ql_tensor *a, int64_t ne0) {
    const int64_t ne[4] = {ne0, 1, 1, 1};
    return reshape_impl(ctx, a, ne);
}
ql_tensor *ql_reshape_2d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1) {
    const int64_t ne[4] = {ne0, ne1, 1, 1};
    return reshape_impl(ctx, a, ne);
}
ql_tensor *ql_reshape_3d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2) {
    const int64_t ne[4] = {ne0, ne1, ne2, 1};
    return reshape_impl(ctx, a, ne);
}
ql_tensor *ql_reshape_4d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    const int64_t ne[4] = {ne0, ne1, ne2, ne3};
    return reshape_impl(ctx, a, ne);
}
ql_tensor *ql_reshape_4d_after(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, ql_tensor *after) {
    if (!srcs_ok(ctx, "reshape_after", {a, after})) return nullptr;
    ql_tensor *t = ql_reshape_4d(ctx, a, ne0, ne1, ne2, ne3);
    if (t) t->src[1] = after;  // graph order only: the walk visits it before t (a view's own src[1] is otherwise unused)
    return t;
}

ql_tensor *ql_permute(ql_context *ctx, ql_tensor *a, int ax0, int ax1, int ax2, int ax3) {
    if (!srcs_ok(ctx, "permute", {a})) return nullptr;
    const int ax[4] = {ax0, ax1, ax2, ax3};
    bool seen[4] = {false, false, false, false};
    for (int i = 0; i < 4; i++) {
        QL_CHECK(ctx, ax[i] >= 0 && ax[i] < 4 && !seen[ax[i]], QL_ERR_INVALID,
                 "permute: axes (%d, %d, %d, %d) of %s are not a permutation of 0..3", ax0, ax1, ax2, ax3,
                 shape_str(a).c_str());
        seen[ax[i]] = true;
    }
    QL_CHECK(ctx, traits(a->type).blck_size == 1 || ax0 == 0, QL_ERR_TYPE,
             "permute: %s is block-quantized: dimension 0 must stay first", shape_str(a).c_str());
    int64_t ne[4];
    size_t  nb[4];
    for (int i = 0; i < 4; i++) {
        ne[ax[i]] = a->ne[i];
        nb[ax[i]] = a->nb[i];
    }
    ql_tensor *t = make_view(ctx, QL_OP_PERMUTE, a, ne, nb, 0);
    if (t)
        for (int i = 0; i < 4; i++) t->op_params[i] = ax[i];
    return t;
}

ql_tensor *ql_transpose(ql_context *ctx, ql_tensor *a) {
    if (!srcs_ok(ctx, "transpose", {a})) return nullptr;
    const int64_t ne[4] = {a->ne[1], a->ne[0], a->ne[2], a->ne[3]};
    const size_t  nb[4] = {a->nb[1], a->nb[0], a->nb[2], a->nb[3]};
    if (traits(a->type).blck_size == 1) return make_view(ctx, QL_OP_TRANSPOSE, a, ne, nb, 0);
    // A block-quantized tensor cannot be transposed by strides; the view records the intent and
    // only ql_mul_mat reads it (the weight of dx = dy W in backward). Other ops refuse it: its
    // rows are not dense.
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_TYPE, "transpose: block-quantized %s without dense rows",
             shape_str(a).c_str());
    ql_tensor *t = make_view(ctx, QL_OP_TRANSPOSE, a, a->ne, nb, 0);  // made with a's shape (whole blocks) ...
    if (t)
        for (int i = 0; i < 4; i++) t->ne[i] = ne[i];                // ... then transposed
    return t;
}

ql_tensor *ql_cast(ql_context *ctx, ql_tensor *a, ql_type type) {
    if (!srcs_ok(ctx, "cont", {a})) return nullptr;
    QL_CHECK(ctx, ql_type_traits_get(type), QL_ERR_TYPE, "cont: unknown target type id %d", (int)type);
    QL_CHECK(ctx, a->type == type || (is_float_type(a->type) && is_float_type(type)), QL_ERR_TYPE,
             "cont: cannot convert %s to %s", shape_str(a).c_str(), ql_type_name(type));
    QL_CHECK(ctx, a->ne[0] % traits(type).blck_size == 0, QL_ERR_SHAPE, "cont: %s rows do not fill %s blocks",
             shape_str(a).c_str(), ql_type_name(type));
    return new_op_like(ctx, QL_OP_CONT, type, a, {a});
}
ql_tensor *ql_cont(ql_context *ctx, ql_tensor *a) { return a ? ql_cast(ctx, a, a->type) : ql_cast(ctx, a, QL_TYPE_F32); }

ql_tensor *ql_to_device(ql_context *ctx, ql_tensor *host) {
    if (!srcs_ok(ctx, "to_device", {host})) return nullptr;
    QL_CHECK(ctx, host->op == QL_OP_NONE && (host->flags & QL_FLAG_HOST) && ql_is_contiguous(host) && !host->aux_size, QL_ERR_INVALID,
             "to_device: %s must be a contiguous leaf in host memory (QL_FLAG_HOST)", shape_str(host).c_str());
    return new_op_like(ctx, QL_OP_TO_DEVICE, host->type, host, {host});
}

static bool can_repeat(const ql_tensor *b, const ql_tensor *a) {  // b broadcasts to a
    for (int i = 0; i < 4; i++)
        if (b->ne[i] == 0 || a->ne[i] % b->ne[i] != 0) return false;
    return true;
}

static ql_tensor *binary_op(ql_context *ctx, ql_op op, ql_tensor *a, ql_tensor *b, bool grouped) {
    const char *name = ql_op_name(op);
    if (!srcs_ok(ctx, name, {a, b})) return nullptr;
    QL_CHECK(ctx, a->type == QL_TYPE_F32 && b->type == QL_TYPE_F32, QL_ERR_TYPE, "%s: a %s, b %s: both must be f32",
             name, shape_str(a).c_str(), shape_str(b).c_str());
    QL_CHECK(ctx, can_repeat(b, a), QL_ERR_SHAPE, "%s: b %s does not broadcast to a %s (a.ne[i] %% b.ne[i] != 0)",
             name, shape_str(b).c_str(), shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a) && ql_rows_contiguous(b), QL_ERR_SHAPE,
             "%s: a %s and b %s need dense rows (nb[0] == element size) --> hint: ql_cont first", name,
             shape_str(a).c_str(), shape_str(b).c_str());
    ql_tensor *t = new_op_like(ctx, op, QL_TYPE_F32, a, {a, b});
    if (t) t->op_params[0] = grouped ? 1 : 0;
    return t;
}
ql_tensor *ql_add(ql_context *ctx, ql_tensor *a, ql_tensor *b) { return binary_op(ctx, QL_OP_ADD, a, b, false); }
ql_tensor *ql_mul(ql_context *ctx, ql_tensor *a, ql_tensor *b) { return binary_op(ctx, QL_OP_MUL, a, b, false); }

static ql_tensor *unary_f32(ql_context *ctx, ql_op op, ql_tensor *a) {
    const char *name = ql_op_name(op);
    if (!srcs_ok(ctx, name, {a})) return nullptr;
    QL_CHECK(ctx, a->type == QL_TYPE_F32, QL_ERR_TYPE, "%s: a %s must be f32", name, shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_SHAPE, "%s: a %s needs dense rows --> hint: ql_cont first", name,
             shape_str(a).c_str());
    return new_op_like(ctx, op, QL_TYPE_F32, a, {a});
}

ql_tensor *ql_scale(ql_context *ctx, ql_tensor *a, float s) { return ql_scale_to(ctx, a, s, QL_TYPE_F32); }

ql_tensor *ql_scale_to(ql_context *ctx, ql_tensor *a, float s, ql_type type) {
    if (!srcs_ok(ctx, "scale", {a})) return nullptr;
    QL_CHECK(ctx, type == QL_TYPE_F32 || type == QL_TYPE_BF16 || type == QL_TYPE_F16, QL_ERR_TYPE,
             "scale: a result in %s: f32, bf16 or f16 only", ql_type_traits_get(type) ? ql_type_name(type) : "?");
    QL_CHECK(ctx, a->type == QL_TYPE_F32, QL_ERR_TYPE, "scale: a %s must be f32", shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_SHAPE, "scale: a %s needs dense rows --> hint: ql_cont first", shape_str(a).c_str());
    ql_tensor *t = new_op_like(ctx, QL_OP_SCALE, type, a, {a});
    if (t) set_param(t, 0, s);
    return t;
}

ql_tensor *ql_sum(ql_context *ctx, ql_tensor *a) {
    if (!srcs_ok(ctx, "sum", {a})) return nullptr;
    QL_CHECK(ctx, a->type == QL_TYPE_F32 && ql_rows_contiguous(a), QL_ERR_TYPE,
             "sum: a %s must be f32 with dense rows", shape_str(a).c_str());
    const int64_t ne[4] = {1, 1, 1, 1};
    return new_op(ctx, QL_OP_SUM, QL_TYPE_F32, ne, {a});
}

ql_tensor *ql_reduce_to(ql_context *ctx, ql_tensor *a, const ql_tensor *like, bool grouped) {
    if (!srcs_ok(ctx, "reduce_to", {a, like})) return nullptr;
    QL_CHECK(ctx, a->type == QL_TYPE_F32 && ql_rows_contiguous(a), QL_ERR_TYPE,
             "reduce_to: a %s must be f32 with dense rows", shape_str(a).c_str());
    QL_CHECK(ctx, can_repeat(like, a), QL_ERR_SHAPE, "reduce_to: %s does not broadcast to a %s",
             shape_str(like).c_str(), shape_str(a).c_str());
    ql_tensor *t = new_op(ctx, QL_OP_REDUCE_TO, QL_TYPE_F32, like->ne, {a});
    if (t) t->op_params[0] = grouped ? 1 : 0;
    return t;
}

// the result in `type`: f32, or b's 16-bit type (ql_mul_mat_to)
static ql_tensor *mul_mat_impl(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_type type) {
    if (!srcs_ok(ctx, "mul_mat", {a, b})) return nullptr;
    QL_CHECK(ctx, a->ne[0] == b->ne[0], QL_ERR_SHAPE,
             "mul_mat: a %s and b %s: contracted dimensions differ (a.ne[0] %lld != b.ne[0] %lld)",
             shape_str(a).c_str(), shape_str(b).c_str(), (long long)a->ne[0], (long long)b->ne[0]);
    QL_CHECK(ctx, a->ne[2] > 0 && a->ne[3] > 0 && b->ne[2] % a->ne[2] == 0 && b->ne[3] % a->ne[3] == 0,
             QL_ERR_SHAPE, "mul_mat: a %s does not broadcast over b %s's batch (b.ne[2..3] %% a.ne[2..3] != 0)",
             shape_str(a).c_str(), shape_str(b).c_str());
    QL_CHECK(ctx, is_float_type(a->type), QL_ERR_TYPE, "mul_mat: a %s is not a numeric type", shape_str(a).c_str());
    QL_CHECK(ctx, b->type == QL_TYPE_F32 || b->type == QL_TYPE_F16 || b->type == QL_TYPE_BF16, QL_ERR_TYPE,
             "mul_mat: b %s must be f32, f16 or bf16", shape_str(b).c_str());
    QL_CHECK(ctx, type == QL_TYPE_F32 || type == b->type, QL_ERR_TYPE,
             "mul_mat: a result in %s needs b %s of that type (a 16-bit multiply) or f32",
             ql_type_traits_get(type) ? ql_type_name(type) : "?", shape_str(b).c_str());
    const int64_t ne[4] = {a->ne[1], b->ne[1], b->ne[2], b->ne[3]};
    return new_op(ctx, QL_OP_MUL_MAT, type, ne, {a, b});
}

ql_tensor *ql_mul_mat(ql_context *ctx, ql_tensor *a, ql_tensor *b) { return mul_mat_impl(ctx, a, b, QL_TYPE_F32); }

ql_tensor *ql_mul_mat_to(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_type type) { return mul_mat_impl(ctx, a, b, type); }

// params: slot 1 the scale (float), slot 2 set when there is one (a zeroed node is unscaled)
ql_tensor *ql_mul_mat_scaled_to(ql_context *ctx, ql_tensor *a, ql_tensor *b, float s, ql_type type) {
    ql_tensor *y = mul_mat_impl(ctx, a, b, type);
    if (y && s != 1.0f) {
        set_param(y, 1, s);
        set_param(y, 2, (int32_t)1);
    }
    return y;
}
float ql_mul_mat_alpha(const ql_tensor *mm) {
    return mm && mm->op == QL_OP_MUL_MAT && mm->op_params[2] ? get_param<float>(mm, 1) : 1.0f;
}
// a product that is a b and nothing more - f32, contiguous, onto nothing, exact (no 8-bit
// activations), unscaled, its a one matrix: what backward may rebuild from its sources alone
static bool plain_product(const ql_tensor *t) {
    return t && t->op == QL_OP_MUL_MAT && t->type == QL_TYPE_F32 && !t->src[2] && !get_param<int32_t>(t, 0) &&
           ql_mul_mat_alpha(t) == 1.0f && ql_is_contiguous(t) && t->src[0]->ne[2] == 1 && t->src[0]->ne[3] == 1;
}

ql_tensor *ql_mul_mat_acc(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c) {
    if (!srcs_ok(ctx, "mul_mat_acc", {a, b, c})) return nullptr;
    QL_CHECK(ctx, c->type == QL_TYPE_F32 || c->type == b->type, QL_ERR_TYPE,
             "mul_mat_acc: c %s must be f32 or of b %s's type", shape_str(c).c_str(), shape_str(b).c_str());
    ql_tensor *y = ql_mul_mat_to(ctx, a, b, c->type);
    if (!y) return nullptr;
    QL_CHECK(ctx, ql_same_shape(c, y) && ql_is_contiguous(c), QL_ERR_SHAPE,
             "mul_mat_acc: c %s must be contiguous, shaped as the product %s", shape_str(c).c_str(), shape_str(y).c_str());
    y->src[2] = c;  // the same node: the kernels start from c instead of zero
    return y;
}

ql_status ql_mul_mat_set_prec(ql_tensor *mm, ql_type prec) {
    if (!mm || mm->op != QL_OP_MUL_MAT) return QL_ERR_INVALID;
    if (prec != QL_TYPE_F32 && prec != QL_TYPE_Q8_0) return QL_ERR_TYPE;
    set_param(mm, 0, (int32_t)prec);
    return QL_OK;
}

ql_tensor *ql_get_rows(ql_context *ctx, ql_tensor *a, ql_tensor *ids) {
    if (!srcs_ok(ctx, "get_rows", {a, ids})) return nullptr;
    QL_CHECK(ctx, ids->type == QL_TYPE_I32, QL_ERR_TYPE, "get_rows: ids %s must be i32", shape_str(ids).c_str());
    QL_CHECK(ctx, is_float_type(a->type) && a->ne[2] == 1 && a->ne[3] == 1, QL_ERR_TYPE,
             "get_rows: a %s must be a 2-D numeric table", shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_SHAPE, "get_rows: table %s needs dense rows --> hint: ql_cont it first",
             shape_str(a).c_str());
    QL_CHECK(ctx, ids->ne[3] == 1 && ql_is_contiguous(ids), QL_ERR_SHAPE,
             "get_rows: ids %s must be contiguous and at most 3-D --> hint: ql_cont it first", shape_str(ids).c_str());
    const int64_t ne[4] = {a->ne[0], ids->ne[0], ids->ne[1], ids->ne[2]};
    return new_op(ctx, QL_OP_GET_ROWS, QL_TYPE_F32, ne, {a, ids});
}

ql_tensor *ql_rms_norm(ql_context *ctx, ql_tensor *a, float eps) {
    ql_tensor *t = unary_f32(ctx, QL_OP_RMS_NORM, a);
    if (t) set_param(t, 0, eps);
    return t;
}

ql_tensor *ql_rms_norm_mul(ql_context *ctx, ql_tensor *a, ql_tensor *w, float eps) {
    return ql_rms_norm_mul_to(ctx, a, w, eps, QL_TYPE_F32);
}

ql_tensor *ql_rms_norm_mul_to(ql_context *ctx, ql_tensor *a, ql_tensor *w, float eps, ql_type type) {
    if (!srcs_ok(ctx, "rms_norm", {a, w})) return nullptr;
    QL_CHECK(ctx, w->type == QL_TYPE_F32 && ql_is_contiguous(w) && ql_nelements(w) == a->ne[0], QL_ERR_SHAPE,
             "rms_norm: weight %s must be contiguous f32 with a %s's row length", shape_str(w).c_str(), shape_str(a).c_str());
    QL_CHECK(ctx, type == QL_TYPE_F32 || type == QL_TYPE_BF16 || type == QL_TYPE_F16, QL_ERR_TYPE,
             "rms_norm: a result in %s: f32, bf16 or f16 only", ql_type_traits_get(type) ? ql_type_name(type) : "?");
    QL_CHECK(ctx, a->type == QL_TYPE_F32, QL_ERR_TYPE, "rms_norm: a %s must be f32", shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_SHAPE, "rms_norm: a %s needs dense rows --> hint: ql_cont first", shape_str(a).c_str());
    ql_tensor *t = new_op_like(ctx, QL_OP_RMS_NORM, type, a, {a, w});  // each row multiplied by w as it is written
    if (t) set_param(t, 0, eps);
    return t;
}

static ql_tensor *rope_impl(ql_context *ctx, ql_op op, ql_tensor *a, ql_tensor *pos, ql_tensor *ff, int n_dims,
                            int mode, float base) {
    const char *name = ql_op_name(op);
    if (!srcs_ok(ctx, name, {a, pos})) return nullptr;
    // rope: f32, or 16-bit in and out (q and k under a 16-bit compute type); its gradient is f32
    const bool a16 = op == QL_OP_ROPE && (a->type == QL_TYPE_BF16 || a->type == QL_TYPE_F16);
    QL_CHECK(ctx, (a->type == QL_TYPE_F32 || a16) && ql_rows_contiguous(a), QL_ERR_TYPE,
             "%s: a %s must be f32 (rope: or f16/bf16) with dense rows", name, shape_str(a).c_str());
    QL_CHECK(ctx, pos->type == QL_TYPE_I32 && ql_is_contiguous(pos), QL_ERR_TYPE,
             "%s: pos %s must be contiguous i32", name, shape_str(pos).c_str());
    QL_CHECK(ctx, pos->ne[0] == a->ne[2] && pos->ne[1] == a->ne[3] && pos->ne[2] == 1 && pos->ne[3] == 1,
             QL_ERR_SHAPE, "%s: pos %s must be [T, B] for a %s = [head_dim, n_head, T, B]", name,
             shape_str(pos).c_str(), shape_str(a).c_str());
    QL_CHECK(ctx, n_dims > 0 && n_dims % 2 == 0 && n_dims <= a->ne[0], QL_ERR_INVALID,
             "%s: n_dims %d must be even and within head_dim %lld", name, n_dims, (long long)a->ne[0]);
    QL_CHECK(ctx, mode == QL_ROPE_NORMAL || mode == QL_ROPE_NEOX, QL_ERR_INVALID, "%s: unknown mode %d", name, mode);
    QL_CHECK(ctx, base > 0, QL_ERR_INVALID, "%s: freq_base %g must be positive", name, (double)base);
    if (ff)
        QL_CHECK(ctx, ff->type == QL_TYPE_F32 && ql_is_contiguous(ff) && ql_nelements(ff) >= n_dims / 2, QL_ERR_SHAPE,
                 "%s: freq_factors %s must be contiguous f32 with n_dims/2 = %d entries", name, shape_str(ff).c_str(),
                 n_dims / 2);
    ql_tensor *t = new_op_like(ctx, op, a->type, a, {a, pos, ff});
    if (!t) return nullptr;
    t->op_params[0] = n_dims;
    t->op_params[1] = mode;
    set_param(t, 2, base);
    return t;
}
// a rope_back (f32) made again with its result in `type`: the rotation in f32, rounded once as
// it is stored - the bits of ql_cast of the f32 node (q's and k's gradients, which their 16-bit
// multiplies read)
static ql_tensor *rope_back_to(ql_context *ctx, const ql_tensor *rb, ql_type type) {
    if (!srcs_ok(ctx, "rope_back", {rb})) return nullptr;
    ql_tensor *t = new_op_like(ctx, QL_OP_ROPE_BACK, type, rb, {rb->src[0], rb->src[1], rb->src[2]});
    if (!t) return nullptr;
    memcpy(t->op_params, rb->op_params, sizeof(t->op_params));
    return t;
}
ql_tensor *ql_rope(ql_context *ctx, ql_tensor *a, ql_tensor *pos, ql_tensor *ff, int n_dims, int mode, float base) {
    return rope_impl(ctx, QL_OP_ROPE, a, pos, ff, n_dims, mode, base);
}

ql_tensor *ql_silu(ql_context *ctx, ql_tensor *a) { return unary_f32(ctx, QL_OP_SILU, a); }

ql_tensor *ql_swiglu(ql_context *ctx, ql_tensor *a, ql_tensor *b) {
    if (!srcs_ok(ctx, "swiglu", {a, b})) return nullptr;
    QL_CHECK(ctx, (a->type == QL_TYPE_F32 || a->type == QL_TYPE_F16 || a->type == QL_TYPE_BF16) && b->type == a->type &&
                      ql_same_shape(a, b), QL_ERR_SHAPE,
             "swiglu: a %s and b %s must be of one shape and one type (f32, f16 or bf16)", shape_str(a).c_str(), shape_str(b).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a) && ql_rows_contiguous(b), QL_ERR_SHAPE, "swiglu: a %s and b %s need dense rows",
             shape_str(a).c_str(), shape_str(b).c_str());
    return new_op_like(ctx, QL_OP_SWIGLU, a->type, a, {a, b});
}

// kv16: f32 q over an f16 cache's k and v (ql_flash_attn_kv; inference: no backward case reads it)
static ql_tensor *flash_attn_new(ql_context *ctx, ql_tensor *q, ql_tensor *k, ql_tensor *v, ql_tensor *seg, float scale, bool kv16) {
    if (!srcs_ok(ctx, "flash_attn", {q, k, v})) return nullptr;
    const std::string qs = shape_str(q), ks = shape_str(k), vs = shape_str(v);
    const ql_type kt = kv16 ? QL_TYPE_F16 : q->type;
    QL_CHECK(ctx, (q->type == QL_TYPE_F32 || q->type == QL_TYPE_BF16 || q->type == QL_TYPE_F16) && k->type == kt &&
                      v->type == kt,
             QL_ERR_TYPE, "flash_attn: q %s, k %s, v %s must be of one type: f32, bf16 or f16", qs.c_str(), ks.c_str(),
             vs.c_str());
    QL_CHECK(ctx, ql_rows_contiguous(q) && ql_rows_contiguous(k) && ql_rows_contiguous(v), QL_ERR_SHAPE,
             "flash_attn: q %s, k %s, v %s need dense rows", qs.c_str(), ks.c_str(), vs.c_str());
    QL_CHECK(ctx, q->ne[0] == k->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2] && q->ne[3] == k->ne[3] &&
                      k->ne[3] == v->ne[3] && k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 && q->ne[1] <= k->ne[1],
             QL_ERR_SHAPE,
             "flash_attn: q %s, k %s, v %s do not fit q [d, Tq, H, B], k [d, Tk, Hkv, B], v [dv, Tk, Hkv, B] "
             "with H %% Hkv == 0 and Tq <= Tk",
             qs.c_str(), ks.c_str(), vs.c_str());
    QL_CHECK(ctx, q->ne[0] <= 512 && v->ne[0] <= 512, QL_ERR_SHAPE, "flash_attn: head dims above 512 (q %s, v %s)",
             qs.c_str(), vs.c_str());
    if (seg)
        QL_CHECK(ctx, seg->type == QL_TYPE_I32 && ql_is_contiguous(seg) && seg->ne[0] == k->ne[1] &&
                          seg->ne[1] == k->ne[3] && seg->ne[2] == 1 && q->ne[1] == k->ne[1],
                 QL_ERR_SHAPE, "flash_attn: seg %s must be contiguous i32 [Tk, B] with Tq == Tk (q %s, k %s)",
                 shape_str(seg).c_str(), qs.c_str(), ks.c_str());
    const int64_t ne[4] = {v->ne[0], q->ne[2], q->ne[1], q->ne[3]};
    ql_tensor *t = new_op(ctx, QL_OP_FLASH_ATTN, q->type, ne, {q, k, v, seg});  // 16-bit inputs: a 16-bit output
    if (!t) return nullptr;
    set_param(t, 0, scale);
    t->aux_size = (size_t)(q->ne[1] * q->ne[2] * q->ne[3]) * sizeof(float);  // logsumexp [Tq, H, B]
    return t;
}
ql_tensor *ql_flash_attn(ql_context *ctx, ql_tensor *q, ql_tensor *k, ql_tensor *v, ql_tensor *seg, float scale) {
    return flash_attn_new(ctx, q, k, v, seg, scale, false);
}

ql_tensor *ql_flash_attn_kv(ql_context *ctx, ql_tensor *q, ql_tensor *k, ql_tensor *v, ql_tensor *n_kv, float scale) {
    if (!srcs_ok(ctx, "flash_attn", {q, k, v, n_kv})) return nullptr;
    QL_CHECK(ctx, n_kv->type == QL_TYPE_I32 && ql_nelements(n_kv) == 1, QL_ERR_TYPE,
             "flash_attn: n_kv %s must be a single i32", shape_str(n_kv).c_str());
    QL_CHECK(ctx, q->type == QL_TYPE_F32 && (k->type == QL_TYPE_F32 || k->type == QL_TYPE_F16) && v->type == k->type, QL_ERR_TYPE,
             "flash_attn: over a KV cache q %s must be f32, k %s and v %s both f32 or both f16", shape_str(q).c_str(),
             shape_str(k).c_str(), shape_str(v).c_str());
    // (an f16 cache: the kernels widen each key and value row as they read it)
    ql_tensor *t = flash_attn_new(ctx, q, k, v, nullptr, scale, k->type == QL_TYPE_F16);
    if (t) t->src[4] = n_kv;
    return t;
}

ql_status ql_flash_attn_set_prec(ql_tensor *attn, ql_type prec) {
    if (!attn || attn->op != QL_OP_FLASH_ATTN) return QL_ERR_INVALID;
    if (prec != QL_TYPE_F32 && prec != QL_TYPE_BF16) return QL_ERR_TYPE;
    set_param(attn, 1, (int32_t)prec);
    return QL_OK;
}

ql_status ql_flash_attn_set_score_bytes(ql_tensor *attn, size_t bytes) {
    if (!attn || attn->op != QL_OP_FLASH_ATTN || bytes % ((size_t)1 << 20) != 0 || (bytes >> 20) > (size_t)INT32_MAX)
        return QL_ERR_INVALID;
    set_param(attn, 2, (int32_t)(bytes >> 20));  // MiB; 0: the default
    return QL_OK;
}

ql_tensor *ql_cache_store(ql_context *ctx, ql_tensor *cache, ql_tensor *src, ql_tensor *pos) {
    if (!srcs_ok(ctx, "cache_store", {cache, src, pos})) return nullptr;
    QL_CHECK(ctx, (cache->type == QL_TYPE_F32 || cache->type == QL_TYPE_F16) && src->type == QL_TYPE_F32 && ql_is_contiguous(cache) &&
                      ql_rows_contiguous(src),
             QL_ERR_TYPE, "cache_store: cache %s (contiguous f32 or f16) and src %s (f32, dense rows)", shape_str(cache).c_str(),
             shape_str(src).c_str());
    QL_CHECK(ctx, src->ne[0] == cache->ne[0] && src->ne[2] == cache->ne[2] && src->ne[3] == cache->ne[3] &&
                      src->ne[1] <= cache->ne[1],
             QL_ERR_SHAPE, "cache_store: src %s does not fit cache %s", shape_str(src).c_str(), shape_str(cache).c_str());
    QL_CHECK(ctx, pos->type == QL_TYPE_I32 && ql_nelements(pos) == 1, QL_ERR_TYPE,
             "cache_store: pos %s must be a single i32", shape_str(pos).c_str());
    ql_tensor *t = make_view(ctx, QL_OP_CACHE_STORE, cache, cache->ne, cache->nb, 0);
    if (!t) return nullptr;
    t->src[1] = src;
    t->src[2] = pos;
    return t;
}

ql_tensor *ql_cross_entropy(ql_context *ctx, ql_tensor *logits, ql_tensor *targets, ql_tensor *count) {
    if (!srcs_ok(ctx, "cross_entropy", {logits, targets, count})) return nullptr;
    QL_CHECK(ctx, logits->type == QL_TYPE_F32 && ql_rows_contiguous(logits), QL_ERR_TYPE,
             "cross_entropy: logits %s must be f32 with dense rows", shape_str(logits).c_str());
    QL_CHECK(ctx, targets->type == QL_TYPE_I32 && ql_is_contiguous(targets), QL_ERR_TYPE,
             "cross_entropy: targets %s must be contiguous i32", shape_str(targets).c_str());
    QL_CHECK(ctx, ql_nelements(targets) == ql_nrows(logits), QL_ERR_SHAPE,
             "cross_entropy: targets %s must have one entry per row of logits %s", shape_str(targets).c_str(),
             shape_str(logits).c_str());
    QL_CHECK(ctx, count->type == QL_TYPE_F32 && ql_nelements(count) == 1, QL_ERR_SHAPE,
             "cross_entropy: count %s must be a single f32", shape_str(count).c_str());
    const int64_t ne[4] = {1, 1, 1, 1};
    ql_tensor *t = new_op(ctx, QL_OP_CROSS_ENTROPY, QL_TYPE_F32, ne, {logits, targets, count});
    if (t) t->aux_size = (size_t)ql_nrows(logits) * 2 * sizeof(float);  // per row: logsumexp, loss
    return t;
}

ql_tensor *ql_cross_entropy_back(ql_context *ctx, ql_tensor *ce, ql_tensor *dy) {
    return ql_cross_entropy_back_to(ctx, ce, dy, QL_TYPE_F32);
}
ql_tensor *ql_cross_entropy_back_to(ql_context *ctx, ql_tensor *ce, ql_tensor *dy, ql_type type) {
    if (!srcs_ok(ctx, "cross_entropy_back", {ce, dy})) return nullptr;
    QL_CHECK(ctx, type == QL_TYPE_F32 || type == QL_TYPE_BF16 || type == QL_TYPE_F16, QL_ERR_TYPE,
             "cross_entropy_back: result type %s (f32, bf16 or f16)", ql_type_traits_get(type) ? ql_type_name(type) : "?");
    QL_CHECK(ctx, ce->op == QL_OP_CROSS_ENTROPY, QL_ERR_INVALID, "cross_entropy_back: %s is not a ql_cross_entropy result",
             shape_str(ce).c_str());
    QL_CHECK(ctx, dy->type == QL_TYPE_F32 && ql_nelements(dy) == 1, QL_ERR_SHAPE, "cross_entropy_back: dy %s must be a single f32",
             shape_str(dy).c_str());
    ql_tensor *lg = ce->src[0];  // reads the logits, the targets, the count and ce's logsumexp rows
    return new_op_like(ctx, QL_OP_CROSS_ENTROPY_BACK, type, lg, {lg, ce->src[1], ce->src[2], ce, dy});
}

ql_tensor *ql_with_grad(ql_context *ctx, ql_tensor *y, ql_tensor *x, ql_tensor *dx) {
    if (!srcs_ok(ctx, "with_grad", {y, x, dx})) return nullptr;
    QL_CHECK(ctx, y->type == QL_TYPE_F32 && ql_nelements(y) == 1 && ql_is_contiguous(y), QL_ERR_SHAPE,
             "with_grad: y %s must be a single f32", shape_str(y).c_str());
    QL_CHECK(ctx, dx->type == QL_TYPE_F32 && ql_same_shape(dx, x) && ql_is_contiguous(dx), QL_ERR_SHAPE,
             "with_grad: dx %s must be contiguous f32 shaped like x %s", shape_str(dx).c_str(), shape_str(x).c_str());
    ql_tensor *t = make_view(ctx, QL_OP_WITH_GRAD, y, y->ne, y->nb, 0);
    if (!t) return nullptr;
    // dx first: the post-order walk then makes what dx needs (the head's chunks, each logits ->
    // loss -> dlogits -> dh in turn) before y's sum, which would otherwise make every chunk's
    // logits, alive at once, before the first dlogits. view_src stays y.
    t->src[0] = dx;
    t->src[1] = x;
    t->src[2] = y;
    return t;
}

ql_tensor *ql_dropout(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream) {
    return ql_dropout_to(ctx, a, p, seed, stream, QL_TYPE_F32);
}
ql_tensor *ql_dropout_to(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream, ql_type type) {
    return ql_dropout_rows_to(ctx, a, p, seed, stream, type, 0);
}

ql_tensor *ql_dropout_rows_to(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream, ql_type type,
                              int64_t first_row) {
    if (!srcs_ok(ctx, "dropout", {a, seed})) return nullptr;
    QL_CHECK(ctx, first_row >= 0, QL_ERR_INVALID, "dropout: first row %lld < 0", (long long)first_row);
    QL_CHECK(ctx, p >= 0.0f && p < 1.0f, QL_ERR_INVALID, "dropout: p = %g outside [0, 1)", (double)p);
    QL_CHECK(ctx, seed->type == QL_TYPE_I32 && ql_nelements(seed) >= 1, QL_ERR_TYPE,
             "dropout: seed %s must be i32 [1]", shape_str(seed).c_str());
    QL_CHECK(ctx, type == QL_TYPE_F32 || type == QL_TYPE_BF16 || type == QL_TYPE_F16, QL_ERR_TYPE,
             "dropout: result type %s (f32, bf16 or f16)", ql_type_traits_get(type) ? ql_type_name(type) : "?");
    QL_CHECK(ctx, a->type == QL_TYPE_F32 || a->type == QL_TYPE_BF16 || a->type == QL_TYPE_F16, QL_ERR_TYPE,
             "dropout: a %s must be f32, bf16 or f16", shape_str(a).c_str());
    QL_CHECK(ctx, ql_rows_contiguous(a), QL_ERR_SHAPE, "dropout: a %s needs dense rows --> hint: ql_cont first",
             shape_str(a).c_str());
    ql_tensor *t = new_op_like(ctx, QL_OP_DROPOUT, type, a, {a});
    if (!t) return nullptr;
    t->src[1] = seed;
    set_param(t, 0, p);
    set_param(t, 1, stream);
    set_param(t, 2, first_row);  // the mask's elements start at first_row * ne0
    return t;
}

ql_tensor *ql_add_rows(ql_context *ctx, ql_tensor *a, ql_tensor *b, int64_t row0) {
    if (!srcs_ok(ctx, "add_rows", {a, b})) return nullptr;
    QL_CHECK(ctx, a->type == QL_TYPE_F32 && ql_is_contiguous(a) && b->type == QL_TYPE_F32 && ql_rows_contiguous(b), QL_ERR_TYPE,
             "add_rows: a %s (contiguous f32) and b %s (f32, dense rows)", shape_str(a).c_str(), shape_str(b).c_str());
    QL_CHECK(ctx, b->ne[0] == a->ne[0] && b->ne[2] == 1 && b->ne[3] == 1 && row0 >= 0 && row0 + b->ne[1] <= ql_nrows(a),
             QL_ERR_SHAPE, "add_rows: b %s at row %lld does not fit a %s", shape_str(b).c_str(), (long long)row0,
             shape_str(a).c_str());
    ql_tensor *t = new_op_like(ctx, QL_OP_ADD_ROWS, QL_TYPE_F32, a, {a, b});
    if (t) set_param(t, 0, row0);
    return t;
}

// add: the product is added onto those rows (param slot 2) instead of written over them
static ql_tensor *mul_mat_rows_impl(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c, int64_t row0, bool add) {
    if (!srcs_ok(ctx, "mul_mat_rows", {a, b, c})) return nullptr;
    QL_CHECK(ctx, c->type == QL_TYPE_F32 && ql_is_contiguous(c) && c->ne[2] == 1 && c->ne[3] == 1, QL_ERR_TYPE,
             "mul_mat_rows: c %s must be 2-D contiguous f32", shape_str(c).c_str());
    QL_CHECK(ctx, a->ne[2] == 1 && a->ne[3] == 1 && b->ne[2] == 1 && b->ne[3] == 1 && a->ne[0] == b->ne[0] && a->ne[1] == c->ne[0] &&
                      row0 >= 0 && row0 + b->ne[1] <= c->ne[1],
             QL_ERR_SHAPE, "mul_mat_rows: a %s times b %s does not fit c %s at row %lld", shape_str(a).c_str(), shape_str(b).c_str(),
             shape_str(c).c_str(), (long long)row0);
    ql_tensor *t = make_view(ctx, QL_OP_MUL_MAT_ROWS, c, c->ne, c->nb, 0);
    if (!t) return nullptr;
    t->src[1] = a;
    t->src[2] = b;
    set_param(t, 0, row0);
    set_param(t, 2, (int32_t)add);
    return t;
}

ql_tensor *ql_mul_mat_rows(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c, int64_t row0) {
    return mul_mat_rows_impl(ctx, a, b, c, row0, false);
}

void ql_mul_mat_rows_product(const ql_tensor *node, ql_tensor *mm) {
    const ql_tensor *a = node->src[1], *b = node->src[2];
    *mm = *node;
    mm->op = QL_OP_MUL_MAT;
    memset(mm->op_params, 0, sizeof(mm->op_params));
    for (ql_tensor *&s : mm->src) s = nullptr;
    mm->src[0] = (ql_tensor *)a;
    mm->src[1] = (ql_tensor *)b;
    mm->ne[0] = a->ne[1], mm->ne[1] = b->ne[1], mm->ne[2] = mm->ne[3] = 1;
    mm->nb[2] = mm->nb[3] = node->nb[1] * (size_t)mm->ne[1];
    const size_t offs = (size_t)get_param<int64_t>(node, 0) * node->nb[1];
    mm->data = node->data ? (uint8_t *)node->data + offs : nullptr;
    mm->view_src = nullptr;
    mm->view_offs = 0;
    mm->aux_size = 0;
    mm->grad = nullptr;
    // adding: ql_mul_mat_acc over its own storage - c is mm itself, each element read by the
    // tile that then writes it (the in-place form every backend's product takes)
    if (get_param<int32_t>(node, 2)) mm->src[2] = mm;
}

// params: p, stream, the mask's first row (int64: slots 2-3), the slot of the dropped operand's
// source x (0: a = transpose(D), x [M, K] in rows; 1: b = D, x [K, N, ...]; 2: none - the result
// dropped, mul_mat_dropped), the multiply's type
static ql_tensor *mul_mat_dropout_impl(ql_context *ctx, ql_tensor *a, ql_tensor *b, int slot, float p, ql_tensor *seed,
                                       uint32_t stream, ql_type type, int64_t first_row) {
    if (!srcs_ok(ctx, "mul_mat_dropout", {a, b, seed})) return nullptr;
    ql_tensor *x = slot ? b : a, *o = slot ? a : b;  // the dropped operand's source, the other operand
    QL_CHECK(ctx, first_row >= 0 && p >= 0.0f && p < 1.0f, QL_ERR_INVALID, "mul_mat_dropout: p = %g, first row %lld",
             (double)p, (long long)first_row);
    QL_CHECK(ctx, seed->type == QL_TYPE_I32 && ql_nelements(seed) >= 1, QL_ERR_TYPE, "mul_mat_dropout: seed %s must be i32 [1]",
             shape_str(seed).c_str());
    const auto plain = [](ql_type t) { return t == QL_TYPE_F32 || t == QL_TYPE_BF16 || t == QL_TYPE_F16; };
    QL_CHECK(ctx, plain(type) && plain(x->type) && plain(o->type), QL_ERR_TYPE,
             "mul_mat_dropout: x %s, the other operand %s and the multiply's type %s must be f32, bf16 or f16",
             shape_str(x).c_str(), shape_str(o).c_str(), ql_type_traits_get(type) ? ql_type_name(type) : "?");
    QL_CHECK(ctx, ql_rows_contiguous(x), QL_ERR_SHAPE, "mul_mat_dropout: x %s needs dense rows --> hint: ql_cont first",
             shape_str(x).c_str());
    // the a side's operand is D transposed: [rows of x, ne0 of x], b 2-D over those rows
    const int64_t K = slot ? x->ne[0] : ql_nrows(x);
    QL_CHECK(ctx, o->ne[2] == 1 && o->ne[3] == 1 && (slot || type == o->type) && o->ne[0] == K, QL_ERR_SHAPE,
             "mul_mat_dropout: %s and x %s (dropped out as the %s operand) do not multiply", shape_str(o).c_str(),
             shape_str(x).c_str(), slot ? "b" : "a");
    const int64_t ne[4] = {slot ? a->ne[1] : x->ne[0], slot ? x->ne[1] : b->ne[1], slot ? x->ne[2] : 1, slot ? x->ne[3] : 1};
    ql_tensor *t = new_op(ctx, QL_OP_MUL_MAT_DROPOUT, QL_TYPE_F32, ne, {a, b, seed});
    if (!t) return nullptr;
    set_param(t, 0, p);
    set_param(t, 1, stream);
    set_param(t, 2, first_row);
    set_param(t, 4, (int32_t)slot);
    set_param(t, 5, (int32_t)type);
    return t;
}

ql_tensor *ql_mul_mat_dropout(ql_context *ctx, ql_tensor *a, ql_tensor *x, float p, ql_tensor *seed, uint32_t stream,
                              ql_type type, int64_t first_row) {
    return mul_mat_dropout_impl(ctx, a, x, 1, p, seed, stream, type, first_row);
}

// Backward's dx of y = a dropout(x): c + dropout(a b) (c: NULL, or f32 shaped as the result: the
// gradient so far, as ql_add(c, dropout(a b)) would add it), the mask's elements those of the
// result's rows from first_row (x's); a 2-D plain, b as ql_mul_mat takes it - the bits of
// ql_dropout_rows_to(ql_mul_mat(a, b)) and the add, in one node
// out: the result's type - f32, or 16 bits where only a 16-bit read follows (attention's dO): the
// sum c + v made in f32 and rounded once as it is stored, the bits of ql_cast of the f32 result
static ql_tensor *mul_mat_dropped(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c, float p, ql_tensor *seed, uint32_t stream,
                                  int64_t first_row, ql_type out = QL_TYPE_F32) {
    if (!srcs_ok(ctx, "mul_mat_dropped", {a, b, seed})) return nullptr;
    QL_CHECK(ctx, a->ne[2] == 1 && a->ne[3] == 1 && a->ne[0] == b->ne[0] && ql_plain_size(b->type) > 1 &&
                      (a->type == QL_TYPE_F32 || a->type == QL_TYPE_BF16 || a->type == QL_TYPE_F16) &&
                      (out == QL_TYPE_F32 || out == QL_TYPE_BF16 || out == QL_TYPE_F16),
             QL_ERR_SHAPE, "mul_mat_dropped: a %s (2-D, plain), b %s, result %s", shape_str(a).c_str(), shape_str(b).c_str(),
             ql_type_traits_get(out) ? ql_type_name(out) : "?");
    const int64_t ne[4] = {a->ne[1], b->ne[1], b->ne[2], b->ne[3]};
    ql_tensor *t = new_op(ctx, QL_OP_MUL_MAT_DROPOUT, out, ne, {a, b, seed});
    if (!t) return nullptr;
    if (c) {
        QL_CHECK(ctx, c->type == QL_TYPE_F32 && ql_is_contiguous(c) && ql_same_shape(c, t), QL_ERR_SHAPE,
                 "mul_mat_dropped: c %s must be f32, contiguous, shaped as %s", shape_str(c).c_str(), shape_str(t).c_str());
        t->src[3] = c;
    }
    set_param(t, 0, p);
    set_param(t, 1, stream);
    set_param(t, 2, first_row);
    set_param(t, 4, (int32_t)2);
    set_param(t, 5, (int32_t)b->type);
    return t;
}

void ql_mul_mat_dropout_product(const ql_tensor *node, ql_tensor *mm, ql_tensor *d, void *d_data) {
    const int slot = get_param<int32_t>(node, 4);
    const ql_type type = (ql_type)get_param<int32_t>(node, 5);
    if (slot == 2) {  // the result dropped: the product itself (f32: the sums before the dropout), at the result's data
        *d = ql_tensor{};
        *mm = *node;
        mm->op = QL_OP_MUL_MAT;
        mm->type = QL_TYPE_F32;
        mm->nb[0] = sizeof(float);
        for (int i = 1; i < 4; i++) mm->nb[i] = mm->nb[i - 1] * (size_t)mm->ne[i - 1];
        memset(mm->op_params, 0, sizeof(mm->op_params));
        for (ql_tensor *&s : mm->src) s = nullptr;
        mm->src[0] = node->src[0];
        mm->src[1] = node->src[1];
        mm->grad = nullptr;
        return;
    }
    const ql_tensor *x = node->src[slot];
    const size_t es = ql_plain_size(type);
    *d = ql_tensor{};
    d->type = type;
    d->op = QL_OP_NONE;
    d->data = d_data;
    snprintf(d->name, sizeof(d->name), "%.50s.dropped", x->name);
    if (slot) {  // x's shape, contiguous
        for (int i = 0; i < 4; i++) d->ne[i] = x->ne[i];
        d->nb[0] = es;
        for (int i = 1; i < 4; i++) d->nb[i] = d->nb[i - 1] * (size_t)d->ne[i - 1];
    } else {  // transpose(D) over x's rows: [rows, ne0], element (k, m) at m + k ne0
        d->ne[0] = ql_nrows(x), d->ne[1] = x->ne[0], d->ne[2] = d->ne[3] = 1;
        d->nb[0] = (size_t)x->ne[0] * es, d->nb[1] = es, d->nb[2] = d->nb[3] = es * (size_t)ql_nelements(x);
    }
    *mm = *node;
    mm->op = QL_OP_MUL_MAT;
    memset(mm->op_params, 0, sizeof(mm->op_params));
    for (ql_tensor *&s : mm->src) s = nullptr;
    mm->src[0] = slot ? node->src[0] : d;
    mm->src[1] = slot ? d : node->src[1];
    mm->grad = nullptr;
}

// ---- backward-only ops: built by autodiff, not part of the public surface ----

static ql_tensor *add_grouped(ql_context *ctx, ql_tensor *a, ql_tensor *b) {
    return binary_op(ctx, QL_OP_ADD, a, b, true);
}

static ql_tensor *get_rows_back(ql_context *ctx, ql_tensor *dy, ql_tensor *ids, const ql_tensor *table) {
    if (!srcs_ok(ctx, "get_rows_back", {dy, ids, table})) return nullptr;
    const int64_t ne[4] = {table->ne[0], table->ne[1], 1, 1};
    return new_op(ctx, QL_OP_GET_ROWS_BACK, QL_TYPE_F32, ne, {dy, ids});
}

// w: NULL, or the forward's weight (ql_rms_norm_mul): dy * w is the norm's dy, made as each row is read.
// acc: NULL, or x's gradient so far (f32, contiguous, x's shape): the result is acc + dx, added as
// it is written (the bits of ql_add(acc, dx)) - the residual stream's gradient summed without a pass
static ql_tensor *rms_norm_back(ql_context *ctx, ql_tensor *x, ql_tensor *dy, float eps, ql_tensor *w = nullptr,
                                ql_tensor *acc = nullptr) {
    if (!srcs_ok(ctx, "rms_norm_back", {x, dy})) return nullptr;
    QL_ASSERT(!acc || (acc->type == QL_TYPE_F32 && ql_is_contiguous(acc) && ql_same_shape(acc, x)));
    ql_tensor *t = new_op_like(ctx, QL_OP_RMS_NORM_BACK, QL_TYPE_F32, x, {x, dy, w, acc});
    if (t) set_param(t, 0, eps);
    return t;
}

static ql_tensor *silu_back(ql_context *ctx, ql_tensor *x, ql_tensor *dy) {
    if (!srcs_ok(ctx, "silu_back", {x, dy})) return nullptr;
    return new_op_like(ctx, QL_OP_SILU_BACK, QL_TYPE_F32, x, {x, dy});
}

// Several gradients from one op come out of one flat buffer; callers view into it.
static ql_tensor *flat_op(ql_context *ctx, ql_op op, int64_t n, std::initializer_list<ql_tensor *> srcs) {
    const int64_t ne[4] = {n, 1, 1, 1};
    return new_op(ctx, op, QL_TYPE_F32, ne, srcs);
}

// swiglu's backward (a flat_op SWIGLU_BACK) made again with its result in `type`: each gradient
// rounded once as it is stored, the bits of ql_cast of the f32 node's views
static ql_tensor *swiglu_back_to(ql_context *ctx, const ql_tensor *flat, ql_type type) {
    if (!srcs_ok(ctx, "swiglu_back", {flat})) return nullptr;
    return new_op_like(ctx, QL_OP_SWIGLU_BACK, type, flat, {flat->src[0], flat->src[1], flat->src[2]});
}

// contiguous f32 view of `like`'s shape at element offset `off` of a flat buffer
static ql_tensor *view_as(ql_context *ctx, ql_tensor *flat, const ql_tensor *like, int64_t off) {
    if (!flat) return nullptr;
    const size_t nb1 = (size_t)like->ne[0] * 4, nb2 = nb1 * (size_t)like->ne[1], nb3 = nb2 * (size_t)like->ne[2];
    return ql_view_4d(ctx, flat, like->ne[0], like->ne[1], like->ne[2], like->ne[3], nb1, nb2, nb3, (size_t)off * 4);
}

// sufficient test: with dimensions sorted by stride, each stride clears everything the lower
// dimensions span
static bool view_is_injective(const int64_t ne[4], int64_t s1, int64_t s2, int64_t s3) {
    std::pair<int64_t, int64_t> d[4] = {{1, ne[0]}, {s1, ne[1]}, {s2, ne[2]}, {s3, ne[3]}};  // (stride, extent)
    std::sort(d, d + 4);
    int64_t span = 1;  // offsets covered so far: [0, span)
    for (const auto &x : d) {
        if (x.second <= 1) continue;
        if (x.first < span) return false;
        span = x.first * (x.second - 1) + span;
    }
    return true;
}

static ql_tensor *view_back(ql_context *ctx, ql_tensor *dy, const ql_tensor *view) {
    if (!srcs_ok(ctx, "view_back", {dy, view})) return nullptr;
    const ql_tensor *a = view->view_src;
    QL_CHECK(ctx, ql_is_contiguous(a) && traits(a->type).blck_size == 1, QL_ERR_UNSUPPORTED,
             "view_back: gradient through a view of %s, which is not contiguous --> hint: ql_cont the source first",
             shape_str(a).c_str());
    ql_tensor *t = new_op(ctx, QL_OP_VIEW_BACK, QL_TYPE_F32, a->ne, {dy});
    if (!t) return nullptr;
    // where the view's elements sit in a, counted in a's elements
    const size_t ts = traits(a->type).type_size;
    set_param(t, 0, (int64_t)(view->view_offs / ts));
    for (int i = 1; i < 4; i++) set_param(t, 2 * i, (int64_t)(view->nb[i] / ts));
    // slot 8: the view overlaps itself (several of its elements land on one of a's), so a
    // backend must add them one after another
    t->op_params[8] = !view_is_injective(view->ne, (int64_t)(view->nb[1] / ts), (int64_t)(view->nb[2] / ts),
                                         (int64_t)(view->nb[3] / ts));
    return t;
}

// a parameter's gradient that is one product runs as mul_mat_rows adding onto the grad, else as
// the product and acc_grad (QLORA_GRAD_MM_ACC=0, to compare)
static const bool g_grad_mm_acc = !(getenv("QLORA_GRAD_MM_ACC") && strcmp(getenv("QLORA_GRAD_MM_ACC"), "0") == 0);

static ql_tensor *acc_grad(ql_context *ctx, ql_tensor *grad, ql_tensor *contrib) {
    if (!srcs_ok(ctx, "acc_grad", {grad, contrib})) return nullptr;
    QL_ASSERT(ql_same_shape(grad, contrib) && ql_is_contiguous(grad) && ql_rows_contiguous(contrib));
    ql_tensor *t = make_view(ctx, QL_OP_ACC_GRAD, grad, grad->ne, grad->nb, 0);
    if (t) t->src[1] = contrib;
    return t;
}

// ============================================================================================
// 7. graphs: nodes in execution order (a post-order walk of the sources)
// ============================================================================================

struct ql_graph {
    ql_context *ctx = nullptr;
    std::vector<ql_tensor *> nodes;    // ops, sources before consumers
    std::vector<ql_tensor *> leafs;    // op NONE tensors the nodes read
    std::vector<ql_tensor *> outputs;  // kept alive to the end of a run
    std::vector<ql_tensor *> params;   // trainable leafs with a gradient (backward graphs)
    std::unordered_set<const ql_tensor *> visited;
    int n_forward = -1;                // -1: no backward part

    // the plan (section 9)
    bool planned = false;
    uint64_t plan_backend = 0;                 // backend id the plan's work sizes are for
    uint64_t plan_id = 0;                      // unique per plan made (ql_graph_plan_id)
    std::vector<ql_plan_entry> entries;
    std::vector<ql_tensor *> entry_tensor;     // entries[i].tensor, writable
    std::vector<std::vector<int>> freed_after; // node i -> entries whose block is free after it
    size_t arena_size = 0, work_size = 0;
    size_t host_size = 0;                      // TO_HOST copies (ql_graph_offload), in host_buf
    ql_backend_buffer *host_buf_owner = nullptr;
    uint8_t *host_buf = nullptr;
    ql_plan_stats stats{};
    bool poison = false, no_reuse = false, profile = false, check_finite = false;
    std::vector<double> node_seconds;          // profile totals, per node
    int run_first = 0, run_last = 0;           // the nodes the run under way queues (ql_backend_graph_compute_range)

    // the allocation
    bool bound = false;  // data pointers match the current plan
    uint8_t *buffer = nullptr;
    size_t buffer_size = 0;
    uint64_t buffer_backend = 0;                // id of the backend that made the buffer
    void (*buffer_free)(void *) = nullptr;
    uint8_t *work = nullptr;
};

ql_graph *ql_graph_new(ql_context *ctx) {
    if (!ctx) return nullptr;
    ql_graph *g = new (std::nothrow) ql_graph();
    if (g) g->ctx = ctx;
    return g;
}

size_t ql_graph_heap_bytes(const ql_graph *g) {
    if (!g) return 0;
    const size_t blk = 16;  // glibc's per-block header, rounded
    auto vec = [&](size_t cap, size_t es) { return cap ? cap * es + blk : 0; };
    size_t n = sizeof(ql_graph) + blk;
    n += vec(g->nodes.capacity(), sizeof(ql_tensor *)) + vec(g->leafs.capacity(), sizeof(ql_tensor *)) +
         vec(g->outputs.capacity(), sizeof(ql_tensor *)) + vec(g->params.capacity(), sizeof(ql_tensor *));
    // the set: one block per element (next pointer + value) and the bucket array
    n += g->visited.size() * (2 * sizeof(void *) + blk) + vec(g->visited.bucket_count(), sizeof(void *));
    n += vec(g->entries.capacity(), sizeof(ql_plan_entry)) + vec(g->entry_tensor.capacity(), sizeof(ql_tensor *));
    n += vec(g->freed_after.capacity(), sizeof(std::vector<int>));
    for (const std::vector<int> &f : g->freed_after) n += vec(f.capacity(), sizeof(int));
    n += vec(g->node_seconds.capacity(), sizeof(double));
    return n;
}

static void graph_release_buffer(ql_graph *g) {
    if (g->buffer && g->buffer_free) g->buffer_free(g->buffer);  // NULL: borrowed (ql_graph_alloc_shared)
    ql_backend_buffer_free(g->host_buf_owner);
    g->host_buf_owner = nullptr;
    g->host_buf = nullptr;
    g->buffer = nullptr;
    g->buffer_size = 0;
    g->work = nullptr;
}

void ql_graph_free(ql_graph *g) {
    if (!g) return;
    graph_release_buffer(g);
    delete g;
}

// (the accessors take NULL as an empty graph: the API edge does not crash)
int         ql_graph_n_nodes(const ql_graph *g) { return g ? (int)g->nodes.size() : 0; }
int         ql_graph_n_forward(const ql_graph *g) { return !g ? 0 : g->n_forward < 0 ? (int)g->nodes.size() : g->n_forward; }
ql_context *ql_graph_ctx(const ql_graph *g) { return g ? g->ctx : nullptr; }
int         ql_graph_n_params(const ql_graph *g) { return g ? (int)g->params.size() : 0; }
ql_tensor  *ql_graph_param(const ql_graph *g, int i) {
    return (g && i >= 0 && i < (int)g->params.size()) ? g->params[(size_t)i] : nullptr;
}
ql_tensor *ql_graph_node(const ql_graph *g, int i) {
    if (!g) return nullptr;
    const int n = (int)g->nodes.size();
    if (i < 0) i += n;
    return (i >= 0 && i < n) ? g->nodes[(size_t)i] : nullptr;
}

// Iterative post-order walk: deep graphs (hundreds of layers, backward included) must not
// exhaust the stack.
static void graph_visit(ql_graph *g, ql_tensor *root) {
    if (g->visited.count(root)) return;
    std::vector<std::pair<ql_tensor *, int>> stack;
    g->visited.insert(root);
    stack.push_back({root, 0});
    while (!stack.empty()) {
        auto &top = stack.back();
        if (top.second < QL_MAX_SRC) {
            ql_tensor *s = top.first->src[top.second++];
            if (s && !g->visited.count(s)) {
                g->visited.insert(s);
                stack.push_back({s, 0});
            }
            continue;
        }
        ql_tensor *t = top.first;
        stack.pop_back();
        (t->op == QL_OP_NONE ? g->leafs : g->nodes).push_back(t);
    }
}

ql_status ql_graph_build_forward(ql_graph *g, ql_tensor *out) {
    if (!g) return QL_ERR_INVALID;
    if (!out) {
        if (g->ctx->status == QL_OK) QL_ERR(g->ctx, QL_ERR_INVALID, "graph_build_forward: output tensor is NULL");
        return g->ctx->status;
    }
    if (g->planned) {
        QL_ERR(g->ctx, QL_ERR_INVALID, "graph_build_forward: the graph is already planned; build a new one");
        return QL_ERR_INVALID;
    }
    graph_visit(g, out);
    if (std::find(g->outputs.begin(), g->outputs.end(), out) == g->outputs.end()) g->outputs.push_back(out);
    return QL_OK;
}

// ============================================================================================
// 8. autodiff: one backward case per forward op, each next to the math it inverts
// ============================================================================================

// autodiff folds a 16-bit cast of a gradient into the node that makes it (a scale, SwiGLU's
// backward, the copy before it, a dropped-out product's dx), and a norm's dx into the sum of its input's gradient: the same
// bits; off, separate casts and adds (tests compare the two)
static bool g_autodiff_fold = true;
void ql_autodiff_fold_for_tests(bool on) { g_autodiff_fold = on; }

// QLORA_MM_SCALE_BACK=0: a scaled product's 16-bit dy as the product and ql_scale_to (A/B runs)
static const bool g_mm_scale_back = !(getenv("QLORA_MM_SCALE_BACK") && strcmp(getenv("QLORA_MM_SCALE_BACK"), "0") == 0);

static bool g_cast_grad_into = !(getenv("QLORA_CAST_GRAD") && strcmp(getenv("QLORA_CAST_GRAD"), "0") == 0);
void ql_autodiff_cast_grad_for_tests(bool on) { g_cast_grad_into = on; }

struct grad_builder {
    ql_context *ctx;
    std::unordered_set<const ql_tensor *> needs;              // leads to a trainable param
    std::unordered_map<const ql_tensor *, ql_tensor *> grad;  // summed contributions so far
    std::map<std::pair<const ql_tensor *, int>, ql_tensor *> casts;  // (gradient, type) -> its one cast
    std::unordered_map<const ql_tensor *, int> uses;          // forward nodes reading each tensor
    std::unordered_set<const ql_tensor *> seeded;             // add_rows links whose dy the chain's root already holds

    bool wants(const ql_tensor *t) const { return t && needs.count(t); }

    ql_tensor *dense(ql_tensor *t) {  // kernels read gradients with dense rows
        return (!t || ql_rows_contiguous(t)) ? t : ql_cont(ctx, t);
    }
    ql_tensor *contiguous(ql_tensor *t) { return (!t || ql_is_contiguous(t)) ? t : ql_cont(ctx, t); }

    // a gradient rounded to a 16-bit type, made once: y = W x + B(s A x) hands the same dy to
    // both multiplies, and each wants it in x's type. A scaled f32 gradient (LoRA's s: the A
    // multiply's dy) is scaled and rounded by one node (ql_scale_to, the same bits); the f32
    // scale stays only where something else reads it
    ql_tensor *cast(ql_tensor *t, ql_type type) {
        if (!t || t->type == type) return t;
        ql_tensor *&c = casts[{t, (int)type}];
        // A scale of a plain product in `type`'s multiply (LoRA's s Bᵀ dy): that product with the
        // scale as its alpha, written in `type` - one node, not two, the same bits
        const ql_tensor *sp = t->op == QL_OP_SCALE ? t->src[0] : nullptr;
        if (!c && g_autodiff_fold && g_mm_scale_back && sp && t->type == QL_TYPE_F32 && plain_product(sp) && sp->src[1]->type == type)
            c = ql_mul_mat_scaled_to(ctx, sp->src[0], sp->src[1], get_param<float>(t, 0), type);
        if (!c && g_autodiff_fold && t->op == QL_OP_SCALE && t->type == QL_TYPE_F32) c = ql_scale_to(ctx, t->src[0], get_param<float>(t, 0), type);
        // SwiGLU's gradients (gate's and up's dy, which their multiplies read in x's type): views
        // of one SWIGLU_BACK made in `type` (once for both), rounded as they are written
        const ql_tensor *f = t->op == QL_OP_VIEW && g_autodiff_fold ? t->view_src : nullptr;
        if (!c && f && f->op == QL_OP_SWIGLU_BACK && f->type == QL_TYPE_F32 && ql_is_contiguous(t)) {
            ql_tensor *&f16 = casts[{f, (int)type}];
            if (!f16) f16 = swiglu_back_to(ctx, f, type);
            const size_t ts = traits(type).type_size, nb1 = (size_t)t->ne[0] * ts, nb2 = nb1 * (size_t)t->ne[1];
            if (f16) c = ql_view_4d(ctx, f16, t->ne[0], t->ne[1], t->ne[2], t->ne[3], nb1, nb2, nb2 * (size_t)t->ne[2], t->view_offs / 4 * ts);
        }
        // a gradient copied to be contiguous (f32, maybe then reshaped: a reshape's backward over
        // a permuted view, attention's dv): the cast reads what was copied (one copy, the same bits)
        ql_tensor *r = g_autodiff_fold && t->op == QL_OP_RESHAPE ? t->src[0] : t;
        // q's and k's gradients (rope's backward, reshaped to the projection's rows): rotated and
        // rounded by one node; the f32 rotation is never stored (at a long sequence's backward
        // peak it was 16 KiB a token beside attention's f32 dq, dk, dv)
        if (!c && g_autodiff_fold && r->op == QL_OP_ROPE_BACK && r->type == QL_TYPE_F32) {
            c = rope_back_to(ctx, r, type);
            if (c && r != t) c = ql_reshape_4d(ctx, c, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
        }
        // a dropped-out product's dx onto the sum so far (LoRA's dx of the o projection's input, read
        // by attention's backward as its 16-bit dO): the sum rounded as it is stored, no f32 copy
        if (!c && g_autodiff_fold && r->op == QL_OP_MUL_MAT_DROPOUT && get_param<int32_t>(r, 4) == 2 &&
            r->type == QL_TYPE_F32 && (type == QL_TYPE_BF16 || type == QL_TYPE_F16)) {
            c = mul_mat_dropped(ctx, r->src[0], r->src[1], r->src[3], get_param<float>(r, 0), r->src[2], get_param<uint32_t>(r, 1),
                                get_param<int64_t>(r, 2), type);
            if (c && r != t) c = ql_reshape_4d(ctx, c, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
        }
        if (!c && g_autodiff_fold && r->op == QL_OP_CONT && r->type == QL_TYPE_F32 && r->src[0]->type == QL_TYPE_F32) {
            c = ql_cast(ctx, r->src[0], type);
            if (c && r != t) c = ql_reshape_4d(ctx, c, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
        }
        if (!c) c = ql_cast(ctx, dense(t), type);
        return c;
    }

    // A 16-bit copy of an f32 tensor (a cast: its gradient passes through in f32) sums its
    // contributions into the f32 tensor's gradient directly: the normed input's copy that q, k and
    // v multiply, beside the f32 input their adapters' dropout reads - one sum, not two and an add.
    // The same math, summed in another order (QLORA_CAST_GRAD=0: apart, to compare)
    // An identity reshape (the normed input placed after its copy, ql_reshape_4d_after: graph order
    // only) has its source's gradient: its readers' contributions are summed there directly too.
    ql_tensor *target(ql_tensor *src) const {
        while (src && src->op == QL_OP_RESHAPE && ql_same_shape(src, src->src[0]) && ql_is_contiguous(src->src[0]) &&
               wants(src->src[0]))
            src = src->src[0];
        if (!g_cast_grad_into || !src || src->op != QL_OP_CONT || src->type == QL_TYPE_F32) return src;
        ql_tensor *x = src->src[0];
        return x->type == QL_TYPE_F32 && !x->view_src && ql_is_contiguous(x) && ql_same_shape(x, src) && wants(x) ? x : src;
    }
    // A tensor used by several consumers gets the sum of their contributions.
    void add(ql_tensor *src, ql_tensor *g) {
        src = target(src);
        if (!wants(src) || !g) return;
        auto it = grad.find(src);
        if (it == grad.end())
            grad[src] = g;
        else
            it->second = ql_add(ctx, dense(it->second), dense(g));
    }
    // dy of a view of src: scattered into zeros shaped like src (view_back), or, for whole rows
    // of src when src has a sum so far, added onto those rows of it (ql_add_rows; in place where
    // the sum dies there) - a tensor read in pieces of rows (the FFN in chunks) gets its gradient
    // a piece at a time, not one src-sized tensor per piece
    void add_view(ql_tensor *src, const ql_tensor *view, ql_tensor *dy) {  // (a view's offsets are src's own: no target here)
        if (!wants(src) || !dy) return;
        auto it = grad.find(src);
        ql_tensor *prev = it == grad.end() ? nullptr : it->second;
        const size_t rb = src->nb[1];
        const bool rows = src->type == QL_TYPE_F32 && ql_is_contiguous(src) && view->ne[0] == src->ne[0] && view->nb[1] == rb &&
                          view->ne[2] == 1 && view->ne[3] == 1 && view->view_offs % rb == 0 && ql_is_contiguous(dy);
        if (rows && prev && prev->type == QL_TYPE_F32 && ql_is_contiguous(prev) && ql_same_shape(prev, src))
            it->second = ql_add_rows(ctx, prev, dy, (int64_t)(view->view_offs / rb));
        else
            add(src, view_back(ctx, dy, view));
    }
    // A product's contribution a^T b: onto the sum so far as the multiply writes it
    // (ql_mul_mat_acc; in place where the sum dies there) instead of a product and an add - an
    // input that feeds several multiplies (q, k, v, the LoRA factors) sums its gradients so
    void add_product(ql_tensor *src, ql_tensor *a, ql_tensor *b) {
        src = target(src);
        if (!wants(src)) return;
        auto it = grad.find(src);
        ql_tensor *prev = it == grad.end() ? nullptr : it->second;
        if (prev && prev->type == QL_TYPE_F32 && ql_is_contiguous(prev) && prev->ne[0] == a->ne[1] && prev->ne[1] == b->ne[1] &&
            prev->ne[2] == b->ne[2] && prev->ne[3] == b->ne[3] && a->ne[2] == 1 && a->ne[3] == 1)
            it->second = ql_mul_mat_acc(ctx, a, b, prev);
        else
            add(src, ql_mul_mat(ctx, a, b));
    }
    // A dropped-out product's contribution dropout(a b) (mul_mat_dropped: one node, the add's
    // bits c + v): onto the sum so far as it is written, where that sum is a plain f32 tensor
    void add_dropped(ql_tensor *src, ql_tensor *a, ql_tensor *b, float p, ql_tensor *seed, uint32_t stream, int64_t row0) {
        src = target(src);
        auto it = grad.find(src);
        ql_tensor *prev = it == grad.end() ? nullptr : it->second;
        const bool onto = prev && prev->type == QL_TYPE_F32 && ql_is_contiguous(prev) && ql_same_shape(prev, src);
        ql_tensor *d = mul_mat_dropped(ctx, a, b, onto ? prev : nullptr, p, seed, stream, row0);
        if (onto) it->second = d;
        else add(src, d);
    }
};

// mul_mat_dropout's dx in one node (mul_mat_dropped) - or the product, the dropout and the add as
// three (QLORA_DROPOUT_FUSED_DX=0, to compare): the same bits either way
static const bool g_mmd_dx_fused = !(getenv("QLORA_DROPOUT_FUSED_DX") && strcmp(getenv("QLORA_DROPOUT_FUSED_DX"), "0") == 0);

static void backward_node(grad_builder &gb, ql_tensor *node, ql_tensor *dy) {
    ql_context *ctx = gb.ctx;
    ql_tensor  *a = node->src[0], *b = node->src[1];
    switch (node->op) {
    case QL_OP_NONE:
    case QL_OP_FILL:
        break;
    case QL_OP_CONT:  // y = copy(a) (maybe cast): the gradient passes through, in f32
        gb.add(a, dy);
        break;
    case QL_OP_VIEW:  // y = a[view]: scatter dy into zeros shaped like a
        gb.add_view(a, node, gb.dense(dy));
        break;
    case QL_OP_RESHAPE:
        gb.add(a, ql_reshape_4d(ctx, gb.contiguous(dy), a->ne[0], a->ne[1], a->ne[2], a->ne[3]));
        break;
    case QL_OP_PERMUTE: {  // result dim ax[i] is source dim i: permute back
        int inv[4];
        for (int i = 0; i < 4; i++) inv[node->op_params[i]] = i;
        gb.add(a, ql_permute(ctx, dy, inv[0], inv[1], inv[2], inv[3]));
        break;
    }
    case QL_OP_TRANSPOSE:
        gb.add(a, ql_transpose(ctx, dy));
        break;
    case QL_OP_ADD: {  // y = a + bcast(b): da = dy, db = sum of dy over b's repetitions
        gb.add(a, dy);
        if (gb.wants(b)) gb.add(b, ql_same_shape(b, node) ? dy : ql_reduce_to(ctx, gb.dense(dy), b, node->op_params[0] != 0));
        break;
    }
    case QL_OP_MUL: {  // y = a * bcast(b): da = dy * b, db = reduce(dy * a)
        if (gb.wants(a)) gb.add(a, ql_mul(ctx, gb.dense(dy), b));
        if (gb.wants(b)) {
            ql_tensor *t = ql_mul(ctx, gb.dense(dy), a);
            gb.add(b, ql_same_shape(b, node) ? t : ql_reduce_to(ctx, t, b, false));
        }
        break;
    }
    case QL_OP_SCALE:  // y = s a
        gb.add(a, ql_scale(ctx, gb.dense(dy), get_param<float>(node, 0)));
        break;
    case QL_OP_SUM: {  // y = sum(a): da = dy broadcast
        ql_tensor *ones = ql_fill(ctx, QL_TYPE_F32, 4, a->ne, 1.0f);
        gb.add(a, ql_mul(ctx, ones, gb.dense(dy)));
        break;
    }
    case QL_OP_REDUCE_TO: {  // the adjoint of broadcasting is broadcasting
        ql_tensor *zeros = ql_fill(ctx, QL_TYPE_F32, 4, a->ne, 0.0f);
        gb.add(a, node->op_params[0] ? add_grouped(ctx, zeros, gb.dense(dy)) : ql_add(ctx, zeros, gb.dense(dy)));
        break;
    }
    case QL_OP_MUL_MAT: {
        // c[m,n] = sum_k a[k,m] b[k,n]  =>  da[k,m] = sum_n b[k,n] dc[m,n],  db[k,n] = sum_m a[k,m] dc[m,n]
        // (a block-quantized frozen `a` is transposed as a view only mul_mat reads: dx = dy W).
        // A 16-bit b made it a 16-bit multiply: so are both of backward's, dc rounded to b's type
        // (where fp16 gradients underflow or overflow: what loss scaling is for); sums stay f32.
        // Scaled (ql_mul_mat_scaled_to): dy s first - QL_OP_SCALE's backward, so the same nodes
        // (a cast of it is one ql_scale_to) as the product and the scale apart
        const float alpha = ql_mul_mat_alpha(node);
        ql_tensor *dys = alpha == 1.0f ? dy : ql_scale(ctx, gb.dense(dy), alpha);
        ql_tensor *dc = b->type == QL_TYPE_F32 ? dys : gb.cast(dys, b->type);
        if (gb.wants(a)) {
            ql_tensor *bb = b, *dd = dc;
            if (a->ne[2] * a->ne[3] == 1 && b->ne[2] * b->ne[3] > 1 && dc && ql_is_contiguous(b) && ql_is_contiguous(dc)) {
                // one matrix for all batches (a LoRA factor): its gradient is one multiply over
                // every token, K = N B2 B3, not a multiply per batch and a reduction after
                bb = ql_reshape_2d(ctx, b, b->ne[0], ql_nelements(b) / b->ne[0]);    // [K, N B2 B3]
                dd = ql_reshape_2d(ctx, dc, dc->ne[0], ql_nelements(dc) / dc->ne[0]);  // [M, N B2 B3]
            }
            ql_tensor *da = ql_mul_mat(ctx, ql_transpose(ctx, bb), ql_transpose(ctx, dd));  // [K, M, B2, B3]
            if (da && !ql_same_shape(da, a)) da = ql_reduce_to(ctx, da, a, true);            // a was broadcast
            gb.add(a, da);
        }
        if (gb.wants(b)) gb.add_product(b, ql_transpose(ctx, a), gb.dense(dc));  // [K, N, B2, B3] (wants: no views made for nothing)
        gb.add(node->src[2], dy);  // ql_mul_mat_acc: c passes dy through, as an add
        break;
    }
    case QL_OP_GET_ROWS:  // y[:, n] = a[:, ids[n]]: scatter-add dy's rows back
        gb.add(a, get_rows_back(ctx, gb.dense(dy), b, a));
        break;
    case QL_OP_RMS_NORM: {  // y = n(a) (* w): da = rms_norm_back(a, dy w), dw = reduce(dy n(a))
        const float eps = get_param<float>(node, 0);
        if (gb.wants(a)) {  // onto a's gradient so far as it is written (the residual stream's: what ql_add would sum)
            auto it = gb.grad.find(a);
            ql_tensor *prev = it == gb.grad.end() ? nullptr : it->second;
            if (g_autodiff_fold && prev && prev->type == QL_TYPE_F32 && ql_is_contiguous(prev) && ql_same_shape(prev, a))
                it->second = rms_norm_back(ctx, a, gb.dense(dy), eps, b, prev);
            else
                gb.add(a, rms_norm_back(ctx, a, gb.dense(dy), eps, b));
        }
        if (b && gb.wants(b)) gb.add(b, ql_reduce_to(ctx, ql_mul(ctx, gb.dense(dy), ql_rms_norm(ctx, a, eps)), b, false));
        break;
    }
    case QL_OP_ROPE:  // a rotation: its gradient is the inverse rotation of dy
        gb.add(a, rope_impl(ctx, QL_OP_ROPE_BACK, gb.dense(dy), b, node->src[2], node->op_params[0],
                            node->op_params[1], get_param<float>(node, 2)));
        break;
    case QL_OP_SILU:
        gb.add(a, silu_back(ctx, a, gb.dense(dy)));
        break;
    case QL_OP_SWIGLU: {  // y = silu(a) b: da = dy b silu'(a), db = dy silu(a); one kernel, two views
        const int64_t n = ql_nelements(a);
        ql_tensor *flat = flat_op(ctx, QL_OP_SWIGLU_BACK, 2 * n, {a, b, gb.dense(dy)});
        gb.add(a, view_as(ctx, flat, a, 0));
        gb.add(b, view_as(ctx, flat, b, n));
        break;
    }
    case QL_OP_FLASH_ATTN: {  // FlashAttention-2 backward: recomputes P from q, k and the saved logsumexp
        if (node->src[4]) {
            QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: attention over a KV cache (ql_flash_attn_kv) is inference only");
            break;
        }
        ql_tensor *q = a, *k = b, *v = node->src[2];
        const int64_t nq = ql_nelements(q), nk = ql_nelements(k), nv = ql_nelements(v);
        // a 16-bit output's dO read in its type (the products round it so; delta = rowsum(dO o O)
        // from the rounded dO): the f32 dO dies before backward's peak, which is at this node
        ql_tensor *dO = node->type == QL_TYPE_F32 ? gb.dense(dy) : gb.cast(dy, node->type);
        ql_tensor *flat = flat_op(ctx, QL_OP_FLASH_ATTN_BACK, nq + nk + nv, {q, k, v, node->src[3], node, dO});
        if (flat) flat->op_params[0] = node->op_params[0], flat->op_params[1] = node->op_params[1];  // scale, prec
        gb.add(q, view_as(ctx, flat, q, 0));
        gb.add(k, view_as(ctx, flat, k, nq));
        gb.add(v, view_as(ctx, flat, v, nq + nk));
        break;
    }
    case QL_OP_CROSS_ENTROPY:  // dlogits = (softmax - onehot) * dy / count, zero on ignored rows
        gb.add(a, ql_cross_entropy_back(ctx, node, dy));
        break;
    case QL_OP_WITH_GRAD: {  // y given with dy/dx = dx (src[0]) made in forward: x gets dx dy; y's sources nothing
        const bool one = dy && dy->op == QL_OP_FILL && get_param<float>(dy, 0) == 1.0f;  // the loss's own seed: dx as it is
        gb.add(node->src[1], one ? a : ql_mul(ctx, a, gb.dense(dy)));
        break;
    }
    case QL_OP_MUL_MAT_DROPOUT: {
        // y = a D, D = dropout(x) rounded to the multiply's type t: QL_OP_MUL_MAT's case with b = D
        // and then QL_OP_DROPOUT's - da = D dcᵀ with D regenerated as x is read again (the same
        // mask: the same seed, stream and indices), dx = dropout(aᵀ dc) (the same mask and scale);
        // dc = dy rounded to t. The same nodes' arithmetic as the unfused pair, so the same bits.
        if (get_param<int32_t>(node, 4) != 1) {
            QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: mul_mat_dropout with the a side or the result dropped is backward's own product");
            break;
        }
        const ql_type t = (ql_type)get_param<int32_t>(node, 5);
        const float p = get_param<float>(node, 0);
        const uint32_t stream = get_param<uint32_t>(node, 1);
        const int64_t row0 = get_param<int64_t>(node, 2);
        ql_tensor *seed = node->src[2];
        ql_tensor *dc = t == QL_TYPE_F32 ? dy : gb.cast(dy, t);
        if (gb.wants(a)) {  // [K, M]: one multiply over every token (x's rows and dc's columns together)
            ql_tensor *dd = gb.contiguous(dc);
            if (dd) dd = ql_reshape_2d(ctx, dd, dd->ne[0], ql_nelements(dd) / dd->ne[0]);  // [M, N B2 B3]
            gb.add(a, mul_mat_dropout_impl(ctx, b, ql_transpose(ctx, dd), 0, p, seed, stream, t, row0));
        }
        if (gb.wants(b)) {  // dx = dropout(aᵀ dc) added onto x's gradient so far as it is made (the add's bits: c + v)
            if (g_mmd_dx_fused) {
                gb.add_dropped(b, ql_transpose(ctx, a), gb.dense(dc), p, seed, stream, row0);
            } else {
                gb.add(b, ql_dropout_rows_to(ctx, ql_mul_mat(ctx, ql_transpose(ctx, a), gb.dense(dc)), p, seed, stream, QL_TYPE_F32, row0));
            }
        }
        break;
    }
    case QL_OP_DROPOUT: {  // same mask (same seed, stream and indices), same scale
        const float p = get_param<float>(node, 0);
        const uint32_t stream = get_param<uint32_t>(node, 1);
        const int64_t row0 = get_param<int64_t>(node, 2);
        // the dropped copy one product read (LoRA's A over dropout(x), unfused): dx = dropout(Aᵀ dc)
        // as mul_mat_dropout's backward makes it - one node, added onto x's gradient so far as it is
        // written, instead of the product, the dropout and the add (the same bits: c + v)
        if (g_mmd_dx_fused && gb.wants(a) && plain_product(dy) && ql_same_shape(dy, a)) {
            gb.add_dropped(a, dy->src[0], dy->src[1], p, b, stream, row0);
            break;
        }
        gb.add(a, ql_dropout_rows_to(ctx, gb.dense(dy), p, b, stream, QL_TYPE_F32, row0));
        break;
    }
    case QL_OP_ADD_ROWS: {  // y = a, b added at rows [row0, ...): da = dy, db = those rows of dy (a view)
        // A chain r_c = add_rows(r_c-1, b_c) from x (the FFN in chunks, each b_c a function of rows
        // of x) hands x all of dy at its last link, the first backward meets, rather than at its
        // first, the last: the chunks' gradients then add onto dy itself, each onto its own rows
        // (add_view: add_rows, in place), and each b_c reads its rows off that running sum - rows no
        // later chunk wrote, so still dy's - which keeps one [E, T] gradient alive, not two.
        const int64_t row0 = get_param<int64_t>(node, 0), nrows = ql_nrows(b);
        const bool seeded = gb.seeded.count(node) > 0;  // x has this dy already
        bool chain = seeded || a->op == QL_OP_ADD_ROWS;
        ql_tensor *root = a;
        for (; root->op == QL_OP_ADD_ROWS; root = root->src[0]) {  // links only the next one reads, down to x
            auto u = gb.uses.find(root);
            chain = chain && (seeded || (u != gb.uses.end() && u->second == 1 && !(root->flags & QL_FLAG_OUTPUT)));
        }
        if (chain && (seeded || gb.wants(root))) {
            if (!seeded) gb.add(root, dy);
            if (a->op == QL_OP_ADD_ROWS) gb.grad[a] = dy, gb.seeded.insert(a);  // (a pass: no node)
        } else {
            gb.add(a, dy);
            root = nullptr;
        }
        if (gb.wants(b)) {
            ql_tensor *d = gb.contiguous(dy);
            if (root && d == dy && gb.grad.count(root)) {  // x's sum so far: dy, then add_rows on rows apart from these
                ql_tensor *s = gb.grad[root];
                while (s != dy && s->op == QL_OP_ADD_ROWS) {
                    const int64_t s0 = get_param<int64_t>(s, 0);
                    if (s0 < row0 + nrows && row0 < s0 + ql_nrows(s->src[1])) break;  // rows shared: not dy's there
                    s = s->src[0];
                }
                if (s == dy) d = gb.grad[root];
            }
            gb.add(b, d ? view_as(ctx, d, b, row0 * b->ne[0]) : nullptr);
        }
        break;
    }
    case QL_OP_GET_ROWS_BACK:
    case QL_OP_RMS_NORM_BACK:
    case QL_OP_ROPE_BACK:
    case QL_OP_SILU_BACK:
    case QL_OP_SWIGLU_BACK:
    case QL_OP_FLASH_ATTN_BACK:
    case QL_OP_CROSS_ENTROPY_BACK:
    case QL_OP_VIEW_BACK:
    case QL_OP_ACC_GRAD:
    case QL_OP_COUNT:
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: op %s is itself a gradient; second-order gradients are not supported",
               ql_op_name(node->op));
        break;
    case QL_OP_CACHE_STORE:
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: cache_store is inference only");
        break;
    case QL_OP_MUL_MAT_ROWS:
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: mul_mat_rows writes a gradient made in forward; it has none itself");
        break;
    case QL_OP_TO_DEVICE:  // a copy (ql_to_device): the gradient passes through
        gb.add(a, dy);
        break;
    case QL_OP_TO_HOST:
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "backward: %s is made by ql_graph_offload on a backward graph", ql_op_name(node->op));
        break;
    }
}

ql_graph *ql_graph_backward(ql_context *ctx, const ql_graph *gf, ql_tensor *loss) {
    if (!ctx || !gf) return nullptr;
    if (ctx->status != QL_OK) return nullptr;
    if (!loss || !gf->visited.count(loss)) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_backward: the loss %s is not in the forward graph",
               loss ? shape_str(loss).c_str() : "(null)");
        return nullptr;
    }
    if (loss->type != QL_TYPE_F32 || ql_nelements(loss) != 1) {
        QL_ERR(ctx, QL_ERR_SHAPE, "graph_backward: the loss %s must be a single f32", shape_str(loss).c_str());
        return nullptr;
    }
    grad_builder gb{ctx, {}, {}, {}, {}, {}};
    for (ql_tensor *n : gf->nodes)
        for (int j = 0; j < QL_MAX_SRC; j++)
            if (n->src[j] && std::find(n->src, n->src + j, n->src[j]) == n->src + j) gb.uses[n->src[j]]++;
    for (ql_tensor *l : gf->leafs) {
        if (!(l->flags & QL_FLAG_PARAM)) continue;
        if (l->type != QL_TYPE_F32) {
            QL_ERR(ctx, QL_ERR_TYPE, "graph_backward: trainable %s must be f32 (master weights are fp32)",
                   shape_str(l).c_str());
            return nullptr;
        }
        gb.needs.insert(l);
    }
    for (ql_tensor *n : gf->nodes)
        for (ql_tensor *s : n->src)
            if (s && gb.needs.count(s)) {
                gb.needs.insert(n);
                break;
            }

    const size_t first_new = ctx->tensors.size();
    const int64_t one[4] = {1, 1, 1, 1};
    if (gb.needs.count(loss)) gb.grad[loss] = ql_fill(ctx, QL_TYPE_F32, 4, one, 1.0f);  // dloss/dloss
    for (auto it = gf->nodes.rbegin(); it != gf->nodes.rend() && ctx->status == QL_OK; ++it) {
        auto g = gb.grad.find(*it);
        if (g != gb.grad.end() && gb.needs.count(*it)) backward_node(gb, *it, g->second);
    }

    ql_graph *gb_graph = ql_graph_new(ctx);
    if (!gb_graph) return nullptr;
    gb_graph->nodes   = gf->nodes;
    gb_graph->leafs   = gf->leafs;
    gb_graph->visited = gf->visited;
    gb_graph->outputs = gf->outputs;
    gb_graph->n_forward = (int)gf->nodes.size();

    std::vector<ql_tensor *> accs;
    const size_t first_acc = ctx->tensors.size();  // what is made from here on (the accumulations) runs early, below
    for (ql_tensor *p : gf->leafs) {
        auto g = gb.grad.find(p);
        if (!(p->flags & QL_FLAG_PARAM) || g == gb.grad.end()) continue;
        if (!p->grad || !ql_same_shape(p->grad, p)) {
            p->grad = new_leaf(ctx, QL_TYPE_F32, 4, p->ne);
            if (!p->grad) break;
            p->grad->flags |= QL_FLAG_GRAD;
            ql_format_name(p->grad, "grad:%s", p->name);
        }
        // a gradient that is one plain product a^T b is added onto the grad as the multiply writes
        // it (mul_mat_rows adding over all rows): no [M, N] product apart, one launch fewer -
        // the LoRA factors' gradients, two per adapted linear
        ql_tensor *d = g->second, *acc = nullptr;
        if (plain_product(d) && d->src[1]->ne[2] == 1 && d->src[1]->ne[3] == 1 && ql_same_shape(p->grad, d) && g_grad_mm_acc)
            acc = mul_mat_rows_impl(ctx, d->src[0], d->src[1], p->grad, 0, true);
        else
            acc = acc_grad(ctx, p->grad, gb.dense(d));
        if (!acc) break;
        accs.push_back(acc);
        gb_graph->params.push_back(p);
    }
    if (ctx->status != QL_OK) {
        ql_graph_free(gb_graph);
        return nullptr;
    }
    // New nodes join in creation order - already a valid execution order, since each was built
    // from earlier ones - keeping only those an accumulation needs.
    std::unordered_set<const ql_tensor *> live;
    std::vector<const ql_tensor *> stack(accs.begin(), accs.end());
    while (!stack.empty()) {
        const ql_tensor *t = stack.back();
        stack.pop_back();
        if (gf->visited.count(t) || !live.insert(t).second) continue;
        for (const ql_tensor *s : t->src)
            if (s) stack.push_back(s);
    }
    // ... except that each parameter's accumulation (and a copy it reads) runs as soon as its
    // gradient is complete, not at the end: a layer's LoRA gradients are then not all alive at once
    // (at the 8B shape 160 MiB, the whole adapter's, under the last layers' backward). And
    // attention backward's dq, dk and dv (one f32 result) are taken out of it at once, into the
    // compute type as their multiplies read them (rope_back, a cast): the f32 result dies there,
    // not after v's and k's products (at the 8B shape it was 24 KiB a token under them)
    auto unpacks_attn_back = [](ql_tensor *t) {
        ql_tensor *a = is_noop(t->op) ? t : (t->op == QL_OP_ROPE_BACK || t->op == QL_OP_CONT) && t->type != QL_TYPE_F32 ? t->src[0] : nullptr;
        return a && view_root(a)->op == QL_OP_FLASH_ATTN_BACK;
    };
    // (position: creation index; an accumulation's is its latest source's, then its own after it)
    std::unordered_map<const ql_tensor *, std::pair<size_t, size_t>> key;
    std::vector<std::pair<std::pair<size_t, size_t>, ql_tensor *>> order;
    for (size_t i = first_new; i < ctx->tensors.size(); i++) {
        ql_tensor *t = ctx->tensors[i];
        if (!live.count(t)) continue;
        gb_graph->visited.insert(t);
        if (t->op == QL_OP_NONE) {
            gb_graph->leafs.push_back(t);
            continue;
        }
        std::pair<size_t, size_t> k = {i, 0};
        if (i >= first_acc || unpacks_attn_back(t)) {  // right after its latest source
            k = {0, i};
            for (const ql_tensor *s : t->src) {
                auto it = s ? key.find(s) : key.end();
                if (it != key.end()) k.first = std::max(k.first, it->second.first);
            }
        }
        key[t] = k;
        order.push_back({k, t});
    }
    std::stable_sort(order.begin(), order.end(), [](const auto &x, const auto &y) { return x.first < y.first; });  // (keys unique)
    for (const auto &o : order) gb_graph->nodes.push_back(o.second);
    for (ql_tensor *acc : accs) {
        gb_graph->outputs.push_back(acc);
        ql_tensor *gl = acc->src[0];  // made by an earlier ql_graph_backward: not new, not in gf
        if (gb_graph->visited.insert(gl).second) gb_graph->leafs.push_back(gl);
    }
    return gb_graph;
}

void ql_graph_zero_grads(ql_graph *g) {
    // limitation: grads live in host memory (the context's arena); a device backend zeroes its own copy
    if (!g) return;
    for (ql_tensor *p : g->params)
        if (p->grad && p->grad->data) memset(p->grad->data, 0, ql_nbytes(p->grad));
}

// ---- recompute: forward results backward would keep alive, computed again instead ----

// Rough cost of a node, for comparing schedules (multiply-adds count 2).
static double node_flops(const ql_tensor *n) {
    switch (n->op) {
    case QL_OP_MUL_MAT:
        return 2.0 * (double)n->src[0]->ne[0] * (double)ql_nelements(n);
    case QL_OP_MUL_MAT_DROPOUT:  // K: the dropped operand's contracted length
        return 2.0 * (double)(n->op_params[4] == 1 ? n->src[1]->ne[0] : n->op_params[4] == 2 ? n->src[0]->ne[0] : ql_nrows(n->src[0])) *
               (double)ql_nelements(n);
    case QL_OP_MUL_MAT_ROWS:  // the rows it writes
        return 2.0 * (double)n->src[1]->ne[0] * (double)n->src[1]->ne[1] * (double)n->src[2]->ne[1];
    case QL_OP_FLASH_ATTN: {  // QK^T and PV over the causal half
        const ql_tensor *q = n->src[0], *k = n->src[1];
        return 2.0 * (double)q->ne[0] * (double)q->ne[1] * (double)k->ne[1] * (double)q->ne[2] * (double)q->ne[3];
    }
    default:
        return is_noop(n->op) ? 0.0 : (double)ql_nelements(n);
    }
}

// The forward part's cuts (see qlora.h) and the segments between them, as node indices:
// segment i runs from its input in[i] (a cut) to the next cut end[i], with nodes in between.
struct fwd_segments {
    std::vector<int> in, end;
    std::unordered_map<const ql_tensor *, int> index;  // forward node -> its index
};

static ql_tensor *view_root(ql_tensor *t);

static void find_segments(const ql_graph *g, fwd_segments *fs) {
    const int nf = g->n_forward;
    for (int i = 0; i < nf; i++) fs->index[g->nodes[(size_t)i]] = i;
    auto root_index = [&](ql_tensor *t) {
        auto it = fs->index.find(view_root(t));
        return it == fs->index.end() ? -1 : it->second;
    };
    std::vector<int> last_read((size_t)nf);  // by root: the last forward node reading it
    for (int i = 0; i < nf; i++) last_read[(size_t)i] = i;
    for (int j = 0; j < nf; j++)
        for (ql_tensor *s : g->nodes[(size_t)j]->src) {
            const int r = s ? root_index(s) : -1;
            if (r >= 0) last_read[(size_t)r] = std::max(last_read[(size_t)r], j);
        }
    std::vector<int> cuts;
    int reach = -1;  // the furthest forward read of anything produced so far
    for (int i = 0; i < nf; i++) {
        const ql_tensor *n = g->nodes[(size_t)i];
        if (aliases_src(n->op)) continue;
        if (reach <= i) cuts.push_back(i);
        reach = std::max(reach, last_read[(size_t)i]);
    }
    // runs with no op inside (one node between two cuts: a block's first norm when its input is a
    // graph input, a product whose one reader is the residual add) join the segment before them,
    // or before the first segment the first one: left out, they would stay alive through the
    // whole step. Those after the last segment (the head) stay as they are.
    int first = -1;  // the first cut, for the first segment to start at
    for (size_t c = 0; c + 1 < cuts.size(); c++) {
        bool inner = false;  // a real op strictly between the two cuts
        for (int i = cuts[c] + 1; i < cuts[c + 1] && !inner; i++) inner = !aliases_src(g->nodes[(size_t)i]->op);
        if (first < 0) first = cuts[c];
        if (!inner) continue;
        if (!fs->end.empty()) fs->end.back() = cuts[c];  // (the runs in between)
        fs->in.push_back(fs->in.empty() ? first : cuts[c]);
        fs->end.push_back(cuts[c + 1]);
    }
}

int ql_graph_segments(const ql_graph *gb, ql_tensor **inputs, int max) {
    if (!gb || gb->n_forward < 0) return 0;
    fwd_segments fs;
    find_segments(gb, &fs);
    for (int i = 0; i < (int)fs.in.size() && i < max && inputs; i++) inputs[i] = gb->nodes[(size_t)fs.in[(size_t)i]];
    return (int)fs.in.size();
}

// A copy of forward node n reading `srcs` (its sources, some replaced by copies).
static ql_tensor *clone_node(ql_context *ctx, const ql_tensor *n, ql_tensor *const *srcs, ql_tensor *view_src) {
    ql_tensor *t = new_tensor_impl(ctx, n->type, 4, n->ne, ql_op_name(n->op));
    if (!t) return nullptr;
    t->op = n->op;
    memcpy(t->op_params, n->op_params, sizeof(t->op_params));
    memcpy(t->nb, n->nb, sizeof(t->nb));
    t->aux_size  = n->aux_size;
    t->flags     = (n->flags & ~(QL_FLAG_OUTPUT | QL_FLAG_RECOMPUTE)) | QL_FLAG_RECOMPUTED;
    t->view_src  = view_src;
    t->view_offs = n->view_offs;
    for (int i = 0; i < QL_MAX_SRC; i++) t->src[i] = srcs[i];
    const std::string name = std::string(n->name[0] ? n->name : ql_op_name(n->op)) + " (recomputed)";
    snprintf(t->name, sizeof(t->name), "%s", name.c_str());
    return t;
}

ql_status ql_graph_recompute(ql_graph *g, const ql_keep *level, int n_levels, ql_recompute_stats *stats) {
    if (!g) return QL_ERR_INVALID;
    ql_context *ctx = g->ctx;
    if (ctx->status != QL_OK) return ctx->status;
    if (g->n_forward < 0) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_recompute: not a backward graph (ql_graph_backward makes one)");
        return ctx->status;
    }
    if (g->planned) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_recompute: the graph is already planned; recompute comes before the plan");
        return ctx->status;
    }
    const int nf = g->n_forward, n = (int)g->nodes.size();
    fwd_segments fs;
    find_segments(g, &fs);
    const int n_seg = (int)fs.in.size();
    for (int k = 0; level && k < n_levels; k++) {
        std::underlying_type<ql_keep>::type v;  // read as its integer: loading an out-of-range enum is itself UB
        memcpy(&v, &level[k], sizeof(v));
        if (v < QL_KEEP_ALL || v > QL_KEEP_NONE) {
            QL_ERR(ctx, QL_ERR_INVALID, "graph_recompute: level %lld of segment %d is not a ql_keep", (long long)v, k);
            return ctx->status;
        }
    }
    if (level && n_levels != n_seg) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_recompute: %d levels for %d segments", n_levels, n_seg);
        return ctx->status;
    }
    // which forward results stay (by node index; views follow their root)
    std::vector<bool> kept((size_t)nf, true);
    for (int k = 0; level && k < n_seg; k++) {
        const ql_keep lv = level[k];
        if (lv == QL_KEEP_ALL) continue;
        for (int i = fs.in[(size_t)k] + 1; i < fs.end[(size_t)k]; i++) {
            const ql_op op = g->nodes[(size_t)i]->op;
            kept[(size_t)i] = lv == QL_KEEP_HEAVY && (op == QL_OP_MUL_MAT || op == QL_OP_MUL_MAT_DROPOUT || op == QL_OP_FLASH_ATTN);
        }
        // an input that is a host leaf's copy (ql_to_device) is copied again, not kept
        const ql_tensor *in = g->nodes[(size_t)fs.in[(size_t)k]];
        if (lv == QL_KEEP_NONE || (in->op == QL_OP_TO_DEVICE && in->src[0]->op == QL_OP_NONE)) kept[(size_t)fs.in[(size_t)k]] = false;
    }
    for (int i = 0; i < nf; i++)  // results their constructor asked to have recomputed
        if (g->nodes[(size_t)i]->flags & QL_FLAG_RECOMPUTE) kept[(size_t)i] = false;
    for (ql_tensor *t : g->nodes)  // what the caller reads after a run stays
        if ((t->flags & QL_FLAG_OUTPUT) && fs.index.count(view_root(t))) kept[(size_t)fs.index[view_root(t)]] = true;
    for (ql_tensor *t : g->outputs)
        if (fs.index.count(view_root(t))) kept[(size_t)fs.index[view_root(t)]] = true;
    auto is_kept = [&](ql_tensor *t) {
        auto it = fs.index.find(view_root(t));
        return it == fs.index.end() || kept[(size_t)it->second];  // leafs and backward nodes: as they are
    };

    // copies, made on demand (each forward node at most once) and emitted in dependency order
    std::unordered_map<const ql_tensor *, ql_tensor *> copy;
    std::vector<ql_tensor *> order(g->nodes.begin(), g->nodes.begin() + nf);
    double recompute_flops = 0;
    std::function<ql_tensor *(ql_tensor *)> get = [&](ql_tensor *t) -> ql_tensor * {
        if (!t || !fs.index.count(t) || is_kept(t)) return t;
        auto it = copy.find(t);
        if (it != copy.end()) return it->second;
        ql_tensor *srcs[QL_MAX_SRC] = {nullptr};
        for (int i = 0; i < QL_MAX_SRC; i++) srcs[i] = get(t->src[i]);
        ql_tensor *c = clone_node(ctx, t, srcs, t->view_src ? get(t->view_src) : nullptr);
        if (!c) return nullptr;
        copy[t] = c;
        order.push_back(c);  // after its sources' copies (made above): a valid execution order
        recompute_flops += node_flops(t);
        return c;
    };
    for (int j = nf; j < n && ctx->status == QL_OK; j++) {
        ql_tensor *node = g->nodes[(size_t)j];
        for (int i = 0; i < QL_MAX_SRC; i++)
            if (node->src[i]) node->src[i] = get(node->src[i]);
        if (node->view_src) node->view_src = get(node->view_src);
        order.push_back(node);
    }
    if (ctx->status != QL_OK) return ctx->status;
    for (auto &kv : copy) g->visited.insert(kv.second);
    g->nodes = order;
    if (stats) {
        stats->n_segments = n_seg;
        stats->n_recomputed = 0;
        for (auto &kv : copy) stats->n_recomputed += !is_noop(kv.second->op);
        stats->forward_flops = 0;
        for (int i = 0; i < nf; i++) stats->forward_flops += node_flops(g->nodes[(size_t)i]);
        stats->recompute_flops = recompute_flops;
    }
    return QL_OK;
}

// QL_OFFLOAD_GRADS: backward's own large results that wait across an attention's backward for
// their next reader go to host memory after their last reader before it, and come back once
// attention's f32 result is read: the residual stream's gradient (made where a block's FFN
// backward ends, read again by its attention norm's backward) and the attention norm's 16-bit
// output (recomputed for q, k and v, read again by their adapters' gradients). At the 8B shape
// that is 24 of the 84 KiB a token on the device at attention backward's peak.
static ql_status offload_across_attention(ql_graph *g) {
    ql_context *ctx = g->ctx;
    const int nf = g->n_forward, n = (int)g->nodes.size();
    std::unordered_map<const ql_tensor *, std::vector<int>> readers;  // root -> backward readers, in order
    std::unordered_map<const ql_tensor *, int> view_read;  // root -> the last backward node reading it through a view
    for (int i = nf; i < n; i++) {
        const ql_tensor *node = g->nodes[(size_t)i];
        std::vector<const ql_tensor *> seen;
        auto note = [&](ql_tensor *s) {
            if (!s) return;
            ql_tensor *r = view_root(s);
            if (r != s) view_read[r] = i;
            if (std::find(seen.begin(), seen.end(), r) == seen.end()) seen.push_back(r), readers[r].push_back(i);
        };
        for (ql_tensor *s : node->src) note(s);
        note(node->view_src);
    }
    struct move { ql_tensor *t; int after, attn; };
    std::vector<move> moves;
    std::unordered_set<const ql_tensor *> moved;  // (each once: at the first attention its wait spans)
    for (int a = nf; a < n; a++) {
        const ql_tensor *fa = g->nodes[(size_t)a];
        if (fa->op != QL_OP_FLASH_ATTN_BACK) continue;
        // large: a quarter of attention's f32 result or more (the residual gradient is 4/6 of it at
        // the 8B shape, the norm's 16-bit copy 1/3)
        const size_t big = ql_nbytes(fa) / 4;
        for (int m = nf; m < a; m++) {  // backward's results made before it, in node order (the same plan every time)
            ql_tensor *t = g->nodes[(size_t)m];
            if (!readers.count(t) || moved.count(t)) continue;
            if (aliases_src(t->op) || t->view_src || !ql_is_contiguous(t) || t->aux_size || (t->flags & QL_FLAG_HOST) ||
                ql_nbytes(t) < big || (view_read.count(t) && view_read[t] > a))
                continue;  // (read through a view after attention: left alone - its readers name t itself)
            const std::vector<int> &r = readers[t];
            auto nx = std::upper_bound(r.begin(), r.end(), a);
            if (nx == r.end() || nx == r.begin() || *(nx - 1) == a) continue;  // nothing after, or attention reads it
            // back once attention's own result is read (its f32 dq, dk, dv die), before t's next reader
            const auto fr = readers.find(fa);
            const int back_at = std::min(fr == readers.end() ? a : std::max(a, fr->second.back()), *nx - 1);
            moves.push_back({t, *(nx - 1), back_at});
            moved.insert(t);
        }
    }
    if (moves.empty()) return QL_OK;
    std::vector<std::vector<ql_tensor *>> after((size_t)n);
    std::unordered_map<const ql_tensor *, std::pair<int, ql_tensor *>> back_of;  // t -> (from node, its copy)
    for (const move &mv : moves) {
        ql_tensor *h = new_tensor_impl(ctx, mv.t->type, 4, mv.t->ne, "to_host");
        ql_tensor *c = h ? new_tensor_impl(ctx, mv.t->type, 4, mv.t->ne, "to_device") : nullptr;
        if (!c) return ctx->status;
        h->op = QL_OP_TO_HOST;
        h->src[0] = mv.t;
        c->op = QL_OP_TO_DEVICE;
        c->src[0] = h;
        ql_format_name(h, "%s (host)", mv.t->name[0] ? mv.t->name : ql_op_name(mv.t->op));
        ql_format_name(c, "%s (back)", mv.t->name[0] ? mv.t->name : ql_op_name(mv.t->op));
        after[(size_t)mv.after].push_back(h);
        after[(size_t)mv.attn].push_back(c);
        back_of[mv.t] = {mv.attn, c};
        g->visited.insert(h);
        g->visited.insert(c);
    }
    std::vector<ql_tensor *> order;
    order.reserve((size_t)n + 2 * moves.size());
    for (int i = 0; i < n; i++) {
        ql_tensor *node = g->nodes[(size_t)i];
        for (int s = 0; s < QL_MAX_SRC && i >= nf; s++) {
            auto it = node->src[s] ? back_of.find(node->src[s]) : back_of.end();
            if (it != back_of.end() && i > it->second.first) node->src[s] = it->second.second;
        }
        order.push_back(node);
        for (ql_tensor *x : after[(size_t)i]) order.push_back(x);
    }
    g->nodes = order;
    return QL_OK;
}

ql_status ql_graph_offload(ql_graph *g, ql_tensor *const *tensors, int n_off) { return ql_graph_offload_ex(g, tensors, n_off, 0); }

ql_status ql_graph_offload_ex(ql_graph *g, ql_tensor *const *tensors, int n_off, int flags) {
    if (!g || (n_off && !tensors)) return QL_ERR_INVALID;
    ql_context *ctx = g->ctx;
    if (ctx->status != QL_OK) return ctx->status;
    if (g->n_forward < 0 || g->planned) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_offload: needs an unplanned backward graph (after ql_graph_recompute, before the plan)");
        return ctx->status;
    }
    const int nf = g->n_forward, n = (int)g->nodes.size();
    std::unordered_map<const ql_tensor *, int> at;  // forward node -> index
    for (int i = 0; i < nf; i++) at[g->nodes[(size_t)i]] = i;
    // late: the backward readers after the widest gap between them (block recompute: the
    // recompute at a block's start, the norm's backward at its end) read a second copy brought
    // back just before them; nothing of the checkpoint is on the device in between
    struct item { ql_tensor *t; int made, first_back, late, last_back; ql_tensor *host, *back, *back2; };
    std::vector<item> items;
    for (int k = 0; k < n_off; k++) {
        ql_tensor *t = tensors[k];
        auto it = t ? at.find(t) : at.end();
        if (it == at.end() || aliases_src(t->op) || !ql_is_contiguous(t) || t->aux_size) {
            QL_ERR(ctx, QL_ERR_INVALID, "graph_offload: %s is not a contiguous forward result of this graph",
                   t ? shape_str(t).c_str() : "(null)");
            return ctx->status;
        }
        std::vector<int> readers;
        for (int j = nf; j < n; j++)
            for (ql_tensor *s : g->nodes[(size_t)j]->src)
                if (s && view_root(s) == t) {
                    readers.push_back(j);
                    break;
                }
        if (readers.empty()) continue;  // backward never reads it: nothing to do
        int late = -1;
        if (flags & QL_OFFLOAD_LATE) {
            size_t q = 0;
            int gap = 0;
            for (size_t r = 1; r < readers.size(); r++)
                if (readers[r] - readers[r - 1] > gap) gap = readers[r] - readers[r - 1], q = r;
            if (gap > 1 && 2 * gap >= readers.back() - readers.front()) late = readers[q];
        }
        items.push_back({t, it->second, readers.front(), late, readers.back(), nullptr, nullptr, nullptr});
    }
    // backward meets them in reverse: each comes back just before the previous one's first use
    // (late: just before the previous one's late readers, with their copy)
    std::sort(items.begin(), items.end(), [](const item &a, const item &b) { return a.first_back < b.first_back; });
    std::vector<std::vector<ql_tensor *>> before((size_t)n + 1), after_fwd((size_t)nf);
    auto copy_back = [&](const item &x, const char *what) {
        ql_tensor *c = new_tensor_impl(ctx, x.t->type, 4, x.t->ne, "to_device");
        if (!c) return c;
        c->op = QL_OP_TO_DEVICE;
        c->src[0] = x.host;
        ql_format_name(c, "%s (%s)", x.t->name[0] ? x.t->name : ql_op_name(x.t->op), what);
        return c;
    };
    for (size_t k = 0; k < items.size(); k++) {
        item &x = items[k];
        x.host = new_tensor_impl(ctx, x.t->type, 4, x.t->ne, "to_host");
        if (!x.host) return ctx->status;
        x.host->op = QL_OP_TO_HOST;
        x.host->src[0] = x.t;
        ql_format_name(x.host, "%s (host)", x.t->name[0] ? x.t->name : ql_op_name(x.t->op));
        if (!(x.back = copy_back(x, "back")) || (x.late >= 0 && !(x.back2 = copy_back(x, "back, late")))) return ctx->status;
        after_fwd[(size_t)x.made].push_back(x.host);
        if (x.back2) before[(size_t)x.late].push_back(x.back2);
        // (QL_OFFLOAD_GRADS: after the previous one's last reader - not beside it, at backward's fullest point)
        const int anchor = k == 0                                              ? x.first_back
                           : (flags & QL_OFFLOAD_GRADS) && items[k - 1].late >= 0 ? std::min(items[k - 1].last_back + 1, x.first_back)
                           : items[k - 1].late >= 0                               ? items[k - 1].late
                                                                                  : items[k - 1].first_back;
        before[(size_t)anchor].push_back(x.back);
    }
    std::unordered_map<const ql_tensor *, ql_tensor *> back_of[2];  // [late]: checkpoint (or a view of it) -> its copy's
    for (const item &x : items) {
        back_of[0][x.t] = x.back;
        back_of[1][x.t] = x.back2 ? x.back2 : x.back;
    }
    std::vector<ql_tensor *> order;
    order.reserve((size_t)n + 3 * items.size());
    // a backward reader of a forward view of a checkpoint (the chunked FFN reads its input by
    // rows) reads the same view of the copy brought back, made again over it once - else the
    // forward view would keep the checkpoint on the device through backward
    std::function<ql_tensor *(ql_tensor *, int)> back = [&](ql_tensor *t, int late) -> ql_tensor * {
        auto it = back_of[late].find(t);
        if (it != back_of[late].end()) return it->second;
        if (!t->view_src || !aliases_src(t->op) || !at.count(t)) return t;
        ql_tensor *vs = back(t->view_src, late);
        if (vs == t->view_src) return t;
        ql_tensor *srcs[QL_MAX_SRC] = {nullptr};
        for (int k = 0; k < QL_MAX_SRC; k++) srcs[k] = t->src[k] ? back(t->src[k], late) : nullptr;
        ql_tensor *c = clone_node(ctx, t, srcs, vs);
        if (!c) return t;
        c->flags &= ~QL_FLAG_RECOMPUTED;
        ql_format_name(c, "%s (back)", t->name[0] ? t->name : ql_op_name(t->op));
        g->visited.insert(c);
        order.push_back(c);  // after the copy it views (placed before the first backward reader)
        return back_of[late][t] = c;
    };
    std::unordered_map<const ql_tensor *, int> late_from;  // checkpoint -> the node its late readers start at
    for (const item &x : items)
        if (x.late >= 0) late_from[x.t] = x.late;
    auto is_late = [&](ql_tensor *s, int i) {
        auto it = late_from.find(view_root(s));
        return it != late_from.end() && i >= it->second ? 1 : 0;
    };
    for (int i = 0; i < n; i++) {
        ql_tensor *node = g->nodes[(size_t)i];
        for (ql_tensor *b : before[(size_t)i]) order.push_back(b);
        if (i >= nf) {  // backward readers (and views of the checkpoint) read the copy brought back
            for (int s = 0; s < QL_MAX_SRC; s++)
                if (node->src[s]) node->src[s] = back(node->src[s], is_late(node->src[s], i));
            if (node->view_src) node->view_src = back(node->view_src, is_late(node->view_src, i));
        }
        order.push_back(node);
        if (i < nf)
            for (ql_tensor *h : after_fwd[(size_t)i]) order.push_back(h);
    }
    for (const item &x : items) {
        g->visited.insert(x.host);
        g->visited.insert(x.back);
        if (x.back2) g->visited.insert(x.back2);
    }
    g->nodes = order;
    g->n_forward = nf + (int)items.size();  // the copies to the host belong to the forward part
    return (flags & QL_OFFLOAD_GRADS) ? offload_across_attention(g) : QL_OK;
}

// ============================================================================================
// 9. memory planner: liveness over the node order, best-fit placement in one buffer
// ============================================================================================

static const char *k_mem_names[] = {"weights", "params", "grads", "inputs", "saved activations", "scratch", "work"};
static_assert(sizeof(k_mem_names) / sizeof(k_mem_names[0]) == QL_MEM_COUNT, "memory category names");
const char *ql_mem_category_name(ql_mem_category c) { return (c >= 0 && c < QL_MEM_COUNT) ? k_mem_names[c] : "?"; }

// Free blocks of the planned buffer, sorted by offset; `top` is the high-water mark.
struct block_allocator {
    std::vector<std::pair<size_t, size_t>> free_;  // (offset, size)
    size_t top = 0;

    size_t alloc(size_t size) {
        int best = -1;
        for (int i = 0; i < (int)free_.size(); i++)
            if (free_[i].second >= size && (best < 0 || free_[i].second < free_[best].second)) best = i;
        if (best >= 0) {
            const size_t off = free_[best].first;
            if (free_[best].second == size)
                free_.erase(free_.begin() + best);
            else
                free_[best] = {off + size, free_[best].second - size};
            return off;
        }
        if (!free_.empty() && free_.back().first + free_.back().second == top) {  // grow the last hole
            const size_t off = free_.back().first;
            free_.pop_back();
            top = off + size;
            return off;
        }
        const size_t off = top;
        top += size;
        return off;
    }

    void release(size_t off, size_t size) {
        auto it = std::lower_bound(free_.begin(), free_.end(), std::make_pair(off, (size_t)0));
        it = free_.insert(it, {off, size});
        if (it + 1 != free_.end() && it->first + it->second == (it + 1)->first) {  // merge right
            it->second += (it + 1)->second;
            free_.erase(it + 1);
        }
        if (it != free_.begin() && (it - 1)->first + (it - 1)->second == it->first) {  // merge left
            (it - 1)->second += it->second;
            free_.erase(it);
        }
    }
};

static ql_tensor *view_root(ql_tensor *t) {
    while (t->view_src) t = t->view_src;
    return t;
}

// n floats from column k0 of a row of t (any numeric type; k0 and n whole blocks). Types with
// side data find it, and the row's place in the tensor, through the view's root.
static void row_to_float(const ql_tensor *t, const uint8_t *row, int64_t k0, int64_t n, float *dst) {
    const ql_type_traits &tt = traits(t->type);
    const uint8_t *p = row + ql_row_size(t->type, k0);
    if (!tt.to_float_aux) {
        tt.to_float(p, dst, n);
        return;
    }
    // the root is a dense leaf of blocks: a block's byte address is its index, whatever the view
    const ql_tensor *root = view_root(const_cast<ql_tensor *>(t));
    const int64_t first = (int64_t)((size_t)(p - (const uint8_t *)root->data) / tt.type_size) * tt.blck_size;
    tt.to_float_aux(p, ql_aux_data(root), first, dst, n);
}

// Ops whose kernel may write its result over source `src` (same layout, read element by
// element or row by row before writing).
static int inplace_src(const ql_tensor *node) {
    switch (node->op) {
    case QL_OP_ADD: case QL_OP_MUL: case QL_OP_SILU:
    case QL_OP_ADD_ROWS:
    case QL_OP_CROSS_ENTROPY_BACK:  // dlogits over the logits, element by element (the fused head + loss's forward; f32 only)
        return node->type == node->src[0]->type ? 0 : -1;
    case QL_OP_DROPOUT: case QL_OP_SCALE: case QL_OP_RMS_NORM:  // not into f32 storage as a 16-bit result: rows would land on rows not read yet
    case QL_OP_ROPE: case QL_OP_ROPE_BACK:                        // (rope_back_to: f32 read, 16-bit written)
        return node->type == node->src[0]->type ? 0 : -1;
    case QL_OP_SILU_BACK: case QL_OP_RMS_NORM_BACK:
        return 1;  // over dy
    case QL_OP_MUL_MAT:  // ql_mul_mat_acc: each element of c is read by the tile that then writes it
        return node->src[2] ? 2 : -1;
    case QL_OP_MUL_MAT_DROPOUT:  // mul_mat_dropped onto c: the same (the CPU's staged sub-tiles, k_mm_thin; else the product apart)
        return get_param<int32_t>(node, 4) == 2 && node->src[3] && node->type == node->src[3]->type ? 3 : -1;
    default:
        return -1;
    }
}

// The blocks placed again knowing every lifetime: largest first, each into the smallest gap
// between the blocks already placed that are alive at the same time (or above them all). Blocks
// placed in execution order (block_allocator) leave holes where small tensors outlive large ones
// - the FFN's chunks among whole-sequence tensors lost up to 15% of the arena so. Entries that
// took over a block in place move with it; a block is alive from its first entry's node to its
// last entry's last read, both inclusive. Returns the new top, or keeps the first placement
// (returning `top`) when it is not larger.
static bool plan_by_size = true;  // off: the first placement kept as it is (tests check it alone)
void ql_plan_by_size_for_tests(bool on) { plan_by_size = on; }
static size_t place_by_size(std::vector<ql_plan_entry> &entries, const std::vector<int> &inplace_of, size_t top) {
    const int ne = (int)entries.size();
    struct blk { size_t size, offset; int first, last; };
    std::vector<int> root((size_t)ne, -1);  // entry -> its block's index
    std::vector<blk> blocks;
    for (int e = 0; e < ne; e++) {
        const ql_plan_entry &x = entries[(size_t)e];
        if (x.host) continue;
        const int p = inplace_of[(size_t)e];
        if (p >= 0 && root[(size_t)p] >= 0) {
            blk &b = blocks[(size_t)root[(size_t)p]];
            root[(size_t)e] = root[(size_t)p];
            b.first = std::min(b.first, x.first), b.last = std::max(b.last, x.last);
        } else {
            root[(size_t)e] = (int)blocks.size();
            blocks.push_back({x.size, 0, x.first, x.last});
        }
    }
    const int nb = (int)blocks.size();
    if (nb == 0) return top;
    {  // nothing to gain: the first placement is within 1% of the bytes alive at once (a bound no placement beats)
        std::vector<std::pair<int, long long>> ev;
        ev.reserve(2 * (size_t)nb);
        for (const blk &b : blocks) ev.push_back({b.first, (long long)b.size}), ev.push_back({b.last + 1, -(long long)b.size});
        std::sort(ev.begin(), ev.end());
        long long cur = 0, peak = 0;
        for (const auto &x : ev) peak = std::max(peak, cur += x.second);
        if ((double)top <= 1.01 * (double)peak) return top;
    }
    // placed blocks by time bucket (a block in every bucket its lifetime touches)
    int t_max = 0;
    for (const blk &b : blocks) t_max = std::max(t_max, b.last);
    const int W = std::max(64, t_max / 2048 + 1), n_buckets = t_max / W + 1;
    size_t work = 0;  // bucket entries: a graph that keeps thousands of blocks alive over long stretches keeps its placement
    for (const blk &b : blocks) work += (size_t)(b.last / W - b.first / W + 1);
    if (work > ((size_t)4 << 20)) return top;
    // four placements, the smallest kept: blocks in order of size, or of size class (a power of
    // two: the [E, T] f32 and the near-equal 16-bit ones apart), then the longest-lived first;
    // each into the smallest gap that holds it (best fit), or the lowest (first fit). Which packs
    // the tighter depends on the graph (at the 8B shape each wins somewhere, by up to 2%)
    std::vector<size_t> best_off;
    size_t best_top = top;
    for (int variant = 0; variant < 4; variant++) {  // bit 0: by size class; bit 1: first fit
        std::vector<int> order((size_t)nb);
        for (int i = 0; i < nb; i++) order[(size_t)i] = i;
        auto cls = [](size_t z) { return 63 - __builtin_clzll((unsigned long long)z | 1); };
        std::sort(order.begin(), order.end(), [&](int a, int b) {
            const blk &x = blocks[(size_t)a], &y = blocks[(size_t)b];
            if ((variant & 1) == 1 && cls(x.size) != cls(y.size)) return cls(x.size) > cls(y.size);
            if ((variant & 1) == 0 && x.size != y.size) return x.size > y.size;
            if (x.last - x.first != y.last - y.first) return x.last - x.first > y.last - y.first;
            if (x.size != y.size) return x.size > y.size;
            return a < b;
        });
        std::vector<std::vector<int>> bucket((size_t)n_buckets);
        std::vector<int> seen((size_t)nb, -1);
        std::vector<std::pair<size_t, size_t>> live;  // (offset, end) of the placed blocks alive with this one
        size_t new_top = 0;
        for (int k = 0; k < nb; k++) {
            const int i = order[(size_t)k];
            blk &b = blocks[(size_t)i];
            live.clear();
            for (int q = b.first / W; q <= b.last / W; q++)
                for (int j : bucket[(size_t)q]) {
                    if (seen[(size_t)j] == i) continue;
                    seen[(size_t)j] = i;
                    const blk &o = blocks[(size_t)j];
                    if (o.first <= b.last && b.first <= o.last) live.push_back({o.offset, o.offset + o.size});
                }
            std::sort(live.begin(), live.end());
            size_t at = 0, best = SIZE_MAX, best_gap = SIZE_MAX;
            for (const auto &l : live) {
                if (l.first > at && l.first - at >= b.size && l.first - at < best_gap && (!(variant & 2) || best == SIZE_MAX)) best = at, best_gap = l.first - at;
                at = std::max(at, l.second);
            }
            b.offset = best != SIZE_MAX ? best : at;
            new_top = std::max(new_top, b.offset + b.size);
            for (int q = b.first / W; q <= b.last / W; q++) bucket[(size_t)q].push_back(i);
        }
        if (new_top < best_top) {
            best_top = new_top;
            best_off.resize((size_t)nb);
            for (int i = 0; i < nb; i++) best_off[(size_t)i] = blocks[(size_t)i].offset;
        }
    }
    if (best_off.empty()) return top;
    for (int i = 0; i < nb; i++) blocks[(size_t)i].offset = best_off[(size_t)i];
    const size_t new_top = best_top;
    for (int e = 0; e < ne; e++)
        if (root[(size_t)e] >= 0) entries[(size_t)e].offset = blocks[(size_t)root[(size_t)e]].offset;
    return new_top;
}

// Debug: QLORA_PLAN_DUMP=N (MiB) prints, for each plan whose buffer is at least N MiB, what is alive
// where the most is (by node: made at or before it, last read at or after it; device entries),
// grouped by op, type and row length, largest first - what makes a plan's bytes per token. With
// QLORA_PLAN_DUMP_ALL=1 also each entry there over 1/64 of it (where made, its last reader), with
// QLORA_PLAN_DUMP_NODES=A:B the nodes A..B-1 and what they read.
static void plan_dump(const ql_graph *g) {
    const char *env = getenv("QLORA_PLAN_DUMP");
    if (!env || !*env || (double)g->arena_size < atof(env) * 1048576.0) return;
    const int n = (int)g->nodes.size();
    std::vector<long long> live((size_t)n + 1, 0);
    for (const ql_plan_entry &e : g->entries)
        if (!e.host) {  // (an in-place result takes over its source's bytes after the node that made it)
            live[(size_t)std::min(std::max(e.first + (e.inplace ? 1 : 0), 0), n)] += (long long)e.size;
            live[(size_t)std::min(std::max(e.last + 1, 0), n)] -= (long long)e.size;  // (outputs live to the end)
        }
    int at = 0;
    long long cur = 0, best = -1;
    for (int i = 0; i < n; i++)
        if ((cur += live[(size_t)i]) > best) best = cur, at = i;
    std::map<std::string, std::pair<int, size_t>> groups;  // "op type [ne0]" -> (count, bytes)
    for (const ql_plan_entry &e : g->entries) {
        if (e.host || e.first + (e.inplace ? 1 : 0) > at || e.last < at) continue;
        char key[160];
        snprintf(key, sizeof(key), "%-16s %-5s [%lld, ...] %s", ql_op_name(e.tensor->op), ql_type_name(e.tensor->type),
                 (long long)e.tensor->ne[0], e.tensor->flags & QL_FLAG_RECOMPUTED ? "recomputed" : "");
        groups[key].first++, groups[key].second += e.size;
    }
    std::vector<std::pair<size_t, std::string>> order;
    for (const auto &kv : groups) order.push_back({kv.second.second, kv.first + " x" + std::to_string(kv.second.first)});
    std::sort(order.rbegin(), order.rend());
    fprintf(stderr, "plan dump: buffer %.1f MiB; most alive at node %d of %d (%s %s): %.1f MiB\n", g->arena_size / 1048576.0, at, n,
            ql_op_name(g->nodes[(size_t)at]->op), g->nodes[(size_t)at]->name, best / 1048576.0);
    for (const auto &o : order) fprintf(stderr, "  %10.1f MiB  %s\n", o.first / 1048576.0, o.second.c_str());
    if (const char *r = getenv("QLORA_PLAN_DUMP_NODES")) {
        int a = 0, b = 0;
        sscanf(r, "%d:%d", &a, &b);
        for (int i = std::max(a, 0); i < std::min(b, n); i++) {
            const ql_tensor *t = g->nodes[(size_t)i];
            if (is_noop(t->op)) continue;
            fprintf(stderr, "  #%d %-14s %-5s [%lld %lld] %s%s <-", i, ql_op_name(t->op), ql_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1],
                    t->name, t->flags & QL_FLAG_RECOMPUTED ? " R" : "");
            for (const ql_tensor *sr : t->src)
                if (sr) fprintf(stderr, " %s(%s)", ql_op_name(view_root(const_cast<ql_tensor *>(sr))->op), view_root(const_cast<ql_tensor *>(sr))->name);
            fprintf(stderr, "\n");
        }
    }
    if (getenv("QLORA_PLAN_DUMP_ALL"))
        for (const ql_plan_entry &e : g->entries) {
            if (e.host || e.first + (e.inplace ? 1 : 0) > at || e.last < at || e.size < (size_t)best / 64) continue;
            const ql_tensor *t = e.tensor;
            fprintf(stderr, "    %8.1f MiB %-12s %-5s made %6d (%s) last %6d by %s%s src0 %s/%s\n", e.size / 1048576.0, ql_op_name(t->op), ql_type_name(t->type), e.first,
                    t->name, e.last, e.last < n ? ql_op_name(g->nodes[(size_t)e.last]->op) : "-", t->flags & QL_FLAG_RECOMPUTED ? " R" : "",
                    t->src[0] ? ql_op_name(t->src[0]->op) : "-", t->src[0] ? t->src[0]->name : "-");
        }
}

ql_status ql_graph_plan(ql_graph *g, ql_backend *be, ql_plan_stats *stats_out) {
    if (!g || !be) return QL_ERR_INVALID;
    ql_context *ctx = g->ctx;
    if (ctx->status != QL_OK) return ctx->status;
    const int n = (int)g->nodes.size();
    for (ql_tensor *node : g->nodes) {
        if (is_noop(node->op) || be->iface.supports_op(be, node)) continue;
        std::string srcs;
        for (ql_tensor *s : node->src)
            if (s) srcs += (srcs.empty() ? "" : ", ") + shape_str(s);
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "plan: backend %s does not support %s -> %s from (%s)", be->iface.name,
               ql_op_name(node->op), shape_str(node).c_str(), srcs.c_str());
        return ctx->status;
    }

    g->bound = false;  // a new plan moves tensors: ql_graph_alloc must bind again
    g->entries.clear();
    g->entry_tensor.clear();
    g->freed_after.assign((size_t)n, {});
    std::unordered_map<const ql_tensor *, int> idx;  // tensor -> entry
    for (int i = 0; i < n; i++) {
        ql_tensor *t = g->nodes[(size_t)i];
        if (aliases_src(t->op)) continue;
        idx[t] = (int)g->entries.size();
        g->entries.push_back({t, 0, align_up(ql_nbytes(t) + t->aux_size, QL_ALIGN), i, i, false, t->op == QL_OP_TO_HOST});
        g->entry_tensor.push_back(t);
    }
    auto entry_of = [&](ql_tensor *t) -> int {
        auto it = idx.find(view_root(t));
        return it == idx.end() ? -1 : it->second;
    };
    for (int i = 0; i < n; i++)
        for (ql_tensor *s : g->nodes[(size_t)i]->src)
            if (s) {
                const int e = entry_of(s);
                if (e >= 0) g->entries[(size_t)e].last = std::max(g->entries[(size_t)e].last, i);
            }
    std::vector<bool> keep(g->entries.size(), false);
    for (ql_tensor *t : g->nodes)
        if (t->flags & QL_FLAG_OUTPUT) {
            const int e = entry_of(t);
            if (e >= 0) keep[(size_t)e] = true;
        }
    for (ql_tensor *t : g->outputs) {
        const int e = entry_of(t);
        if (e >= 0) keep[(size_t)e] = true;
    }
    for (size_t e = 0; e < keep.size(); e++)
        if (keep[e]) g->entries[e].last = n;
    // a device makes neighbours by one launch (ql_cuda_launch_joins) only where a later one's bytes
    // are not an earlier one's sources': those are held until the last is made (not where one took
    // a source over in place: that block is its result, alive past the last)
    std::vector<int> hold(g->entries.size(), -1);
    ql_backend_caps caps;
    if (ql_backend_get_caps(be, &caps) == QL_OK && !caps.host) {
        const ql_tensor *grp[QL_CUDA_LAUNCH_MAX];
        int ng = 0;  // the launch's nodes so far (as the census and the executor group them)
        for (int i = 0; i < n; i++) {
            ql_tensor *node = g->nodes[(size_t)i];
            if (is_noop(node->op)) continue;
            if (!ql_cuda_launch_joins(grp, ng, node)) {
                grp[0] = node, ng = 1;
                continue;
            }
            for (int m = 0; m < ng; m++)
                for (ql_tensor *sr : grp[m]->src)
                    if (sr && entry_of(sr) >= 0) hold[(size_t)entry_of(sr)] = std::max(hold[(size_t)entry_of(sr)], i);
            grp[ng++] = node;
        }
    }
    std::vector<std::vector<int>> held_until((size_t)n);  // blocks released after node i, held there (hold)

    block_allocator alloc, host_back;  // (host_back: backward's host copies, after the forward's)
    size_t host_top = 0;
    const int nf_plan = g->n_forward >= 0 ? g->n_forward : n;
    std::vector<bool> moved(g->entries.size(), false);
    std::vector<int> inplace_of(g->entries.size(), -1);  // an in-place entry: the entry whose block it took
    int n_inplace = 0;
    for (int i = 0; i < n; i++) {
        ql_tensor *node = g->nodes[(size_t)i];
        auto own = idx.find(node);
        if (own != idx.end()) {
            ql_plan_entry &e = g->entries[(size_t)own->second];
            bool placed = false;
            // an add or product of same-shaped tensors may also write over its second source (read
            // element by element before the write) when the first lives on: the recompute's residual
            // add (the checkpoint + the o projection's output) needs no third [E, T]
            const int k0 = g->no_reuse ? -1 : inplace_src(node);
            const bool both = (node->op == QL_OP_ADD || node->op == QL_OP_MUL) && node->src[1] && ql_same_shape(node->src[1], node);
            for (int k = k0; k >= 0 && k <= (both ? 1 : k0) && !placed; k++) {
                ql_tensor *s = node->src[k];
                if (s && s->view_src == nullptr && idx.count(s)) {
                    const int se = idx[s];
                    bool shared = false;  // another source in the same block would be overwritten under it
                    for (int j = 0; j < QL_MAX_SRC; j++)
                        if (j != k && node->src[j] && entry_of(node->src[j]) == se) shared = true;
                    ql_plan_entry &src_e = g->entries[(size_t)se];
                    if (!shared && src_e.last == i && !moved[(size_t)se] && src_e.size == e.size && s->type == node->type &&
                        ql_is_contiguous(s) && node->aux_size == 0) {
                        e.offset  = src_e.offset;
                        e.inplace = true;
                        moved[(size_t)se] = true;
                        inplace_of[(size_t)own->second] = se;
                        placed = true;
                        n_inplace++;
                    }
                }
            }
            if (e.host && i < nf_plan) {  // host memory: alive from the forward to its copy back, all at once anyway
                e.offset = host_top;
                host_top += e.size;
            } else if (e.host) {  // a copy backward makes (QL_OFFLOAD_GRADS): short-lived, its bytes reused
                e.offset = host_back.alloc(e.size);
            } else if (!placed) {
                e.offset = alloc.alloc(e.size);
            }
        }
        if (g->no_reuse) continue;
        // blocks whose last reader was this node (or that nobody reads) are free from here on
        std::vector<int> dying;
        for (ql_tensor *s : node->src)
            if (s) dying.push_back(entry_of(s));
        if (own != idx.end()) dying.push_back(own->second);
        for (int e : held_until[(size_t)i]) dying.push_back(e);
        std::sort(dying.begin(), dying.end());
        dying.erase(std::unique(dying.begin(), dying.end()), dying.end());
        for (int e : dying) {
            if (e < 0 || moved[(size_t)e]) continue;
            // freed at the later of its last read and its hold: a block held past its last read waits
            // in held_until; one read past its hold is freed at that read
            const int last_e = g->entries[(size_t)e].last, end = std::max(last_e, hold[(size_t)e]);
            if (end != i) {
                if (last_e == i) held_until[(size_t)end].push_back(e);
                continue;
            }
            if (g->entries[(size_t)e].host) {
                if (g->entries[(size_t)e].first >= nf_plan) host_back.release(g->entries[(size_t)e].offset, g->entries[(size_t)e].size);
                continue;
            }
            alloc.release(g->entries[(size_t)e].offset, g->entries[(size_t)e].size);
            g->freed_after[(size_t)i].push_back(e);
        }
    }

    for (size_t e = 0; e < g->entries.size(); e++)  // a held block lives to the pair's second node
        if (!moved[e] && hold[e] > g->entries[e].last) g->entries[e].last = hold[e];
    for (ql_plan_entry &e : g->entries)  // backward's host copies after the forward's
        if (e.host && e.first >= nf_plan) e.offset += host_top;
    host_top += host_back.top;
    size_t arena_top = alloc.top;
    if (!g->no_reuse && plan_by_size) arena_top = place_by_size(g->entries, inplace_of, arena_top);

    ql_plan_stats st;
    memset(&st, 0, sizeof(st));
    for (ql_tensor *l : g->leafs) {
        const size_t sz = align_up(ql_nbytes(l) + l->aux_size, QL_ALIGN);
        const ql_mem_category c = (l->flags & QL_FLAG_GRAD)    ? QL_MEM_GRADS
                                  : (l->flags & QL_FLAG_PARAM) ? QL_MEM_PARAMS
                                  : (l->flags & QL_FLAG_INPUT) ? QL_MEM_INPUTS
                                                               : QL_MEM_WEIGHTS;
        st.bytes[c] += sz;
    }
    const int nf = ql_graph_n_forward(g);
    for (const ql_plan_entry &e : g->entries) {
        st.sum_of_sizes += e.size;
        if (g->n_forward >= 0 && e.first < nf && e.last >= nf && !e.host) st.bytes[QL_MEM_SAVED] += e.size;
    }
    st.host_size = host_top;
    st.host_back = host_back.top;
    g->host_size = host_top;
    {  // recomputed tensors alive together, at most
        std::vector<std::pair<int, long long>> ev;  // (node index, +size at birth / -size after the last read)
        for (const ql_plan_entry &e : g->entries)
            if (e.tensor->flags & QL_FLAG_RECOMPUTED) {
                ev.push_back({e.first, (long long)e.size});
                ev.push_back({e.last + 1, -(long long)e.size});
            }
        std::sort(ev.begin(), ev.end());
        long long live = 0;
        for (auto &x : ev) st.recompute_peak = std::max(st.recompute_peak, (size_t)std::max(0LL, live += x.second));
    }
    size_t work = 0;
    for (ql_tensor *node : g->nodes)
        if (!is_noop(node->op) && be->iface.work_size) work = std::max(work, be->iface.work_size(be, node));
    g->arena_size = align_up(arena_top, QL_ALIGN);
    g->work_size  = align_up(work, QL_ALIGN);
    QL_ASSERT(g->arena_size >= st.bytes[QL_MEM_SAVED]);
    st.bytes[QL_MEM_SCRATCH] = g->arena_size - st.bytes[QL_MEM_SAVED];
    st.bytes[QL_MEM_WORK]    = g->work_size;
    st.buffer_size = g->arena_size + g->work_size;
    for (int c = 0; c < QL_MEM_COUNT; c++) st.total += st.bytes[c];
    st.n_planned = (int)g->entries.size();
    st.n_inplace = n_inplace;
    g->stats = st;
    g->planned = true;
    g->plan_backend = be->id;
    static std::atomic<uint64_t> plans{0};
    g->plan_id = ++plans;
    if (stats_out) *stats_out = st;
    plan_dump(g);
    return QL_OK;
}

uint64_t ql_graph_plan_id(const ql_graph *g) { return g && g->planned ? g->plan_id : 0; }

int ql_graph_plan_entries(const ql_graph *g, const ql_plan_entry **entries) {
    if (entries) *entries = !g || g->entries.empty() ? nullptr : g->entries.data();
    return g ? (int)g->entries.size() : 0;
}

ql_status ql_graph_get_stats(const ql_graph *g, ql_plan_stats *stats) {
    if (!g || !stats || !g->planned) return QL_ERR_INVALID;
    *stats = g->stats;
    return QL_OK;
}

ql_status ql_graph_census(const ql_graph *g, ql_backend *be, ql_census *c) {
    if (!g || !be || !c || !g->planned) return QL_ERR_INVALID;
    *c = ql_census{};
    ql_backend_caps caps;
    if (ql_backend_get_caps(be, &caps) != QL_OK) return QL_ERR_INVALID;
    std::unordered_set<const ql_tensor *> inplace;
    for (size_t i = 0; i < g->entries.size(); i++)
        if (g->entries[i].inplace) inplace.insert(g->entry_tensor[i]);
    static const int dump = getenv("QLORA_CENSUS_DUMP") ? atoi(getenv("QLORA_CENSUS_DUMP")) : 0;  // debug: 1 per op, 2 per node, 3 with its sources
    std::map<std::string, std::pair<int64_t, int64_t>> by_op;
    // two nodes by one launch (ql_cuda_launch_pair), unless b's planned bytes lie over a's result or
    // a source of a's
    std::unordered_map<const ql_tensor *, const ql_plan_entry *> entry_of;
    for (size_t i = 0; i < g->entries.size(); i++) entry_of[g->entry_tensor[i]] = &g->entries[i];
    auto over = [&](const ql_tensor *x, const ql_tensor *y) {
        x = view_root(const_cast<ql_tensor *>(x));
        auto ex = entry_of.find(x), ey = entry_of.find(y);
        if (ex == entry_of.end() || ey == entry_of.end() || ex->second->host || ey->second->host) return false;
        return ex->second->offset < ey->second->offset + ey->second->size && ey->second->offset < ex->second->offset + ex->second->size;
    };
    auto over_any = [&](const ql_tensor *a, const ql_tensor *b) {
        if (over(a, b)) return true;
        for (const ql_tensor *sr : a->src)
            if (sr && over(sr, b)) return true;
        return false;
    };
    // decode's 8-bit codes of a product's b, still in the workspace for the next product of that b
    // (q, k and v; gate and up): not made again (the executor's cu_q8_after: forgotten when a node
    // writes over b or uses the workspace otherwise). The key: b's root, offset, row stride, K, N, block
    struct q8_key {
        const ql_tensor *root = nullptr;
        size_t offs = 0, nb1 = 0;
        int64_t K = 0, N = 0;
        int qb = 0;
        bool operator==(const q8_key &o) const {
            return root == o.root && offs == o.offs && nb1 == o.nb1 && K == o.K && N == o.N && qb == o.qb;
        }
    } codes;
    auto key_of = [](const ql_tensor *mmn, int qb) {
        q8_key k;
        const ql_tensor *b = mmn->src[1];
        k.offs = view_root_offset(b);
        k.root = view_root(const_cast<ql_tensor *>(b)), k.nb1 = b->nb[1], k.K = b->ne[0], k.N = b->ne[1], k.qb = qb;
        return k;
    };
    const ql_tensor *grp[QL_CUDA_LAUNCH_MAX];  // the launch the node before started (no-op nodes skipped) and its nodes so far
    int ng = 0;
    for (size_t ni = 0; ni < g->nodes.size(); ni++) {
        const ql_tensor *node = g->nodes[ni];
        if (is_noop(node->op)) continue;
        ql_tensor mm;  // a product into rows: its FLOPs and bytes those of the product
        const ql_tensor *n = node->op == QL_OP_MUL_MAT_ROWS ? (ql_mul_mat_rows_product(node, &mm), &mm) : node;
        c->nodes++;
        bool paired = !caps.host && ql_cuda_launch_joins(grp, ng, node);
        for (int m = 0; paired && m < ng && !ql_cuda_tail_over_ok(grp[0], node); m++) paired = !over_any(grp[m], node);
        // (a cast or an adapter's copy written by the norm's kernel: nothing read again)
        const bool cast_made = paired && (ql_cuda_norm_cast_pair(grp[0], node) || ql_cuda_norm_dropout(grp[0], node) ||
                                          ql_cuda_swiglu_dropout(grp[0], node));
        if (paired) grp[ng++] = node;
        else grp[0] = node, ng = 1;
        int64_t nl = caps.host ? 1 : paired ? 0 : ql_cuda_node_launches(node, caps.cc, inplace.count(node) > 0);
        if (!caps.host) {
            const int qb = ql_cuda_mm_q8(node);
            if (qb && ql_cuda_q8_aligned(node)) {
                const q8_key k = key_of(node, qb);
                if (!paired && codes.root && k == codes) nl--;  // (the quantisation the count above includes)
                codes = k;
            }
            if (codes.root && (over(codes.root, node) || (!qb && ql_cuda_work_size(node, caps.cc) > 0))) codes = q8_key{};
            // a norm or SwiGLU writing the next product's codes (ql_cuda_q8_made_by): alone, or ending a
            // product's launch (ql_cuda_gemv_norm / _swiglu; a paired node is one only there)
            size_t nj = ni + 1;
            while (nj < g->nodes.size() && is_noop(g->nodes[nj]->op)) nj++;
            if (nj < g->nodes.size())
                if (const int nq = ql_cuda_q8_made_by(node, g->nodes[nj])) codes = key_of(g->nodes[nj], nq);
        }
        c->launches += nl;
        if (dump) {  // QLORA_CENSUS_DUMP: launches and nodes per op (and per 16-bit type of the result)
            auto &e = by_op[std::string(ql_op_name(node->op)) + (node->type == QL_TYPE_F32 ? "" : "/16")];
            e.first += nl, e.second++;
            if (dump > 1)
                fprintf(stderr, "node %-18s %-5s %3lld [%lld %lld] %s%s <- %s %s %s\n", ql_op_name(node->op), ql_type_name(node->type), (long long)nl,
                        (long long)node->ne[0], (long long)node->ne[1], node->name, (node->flags & QL_FLAG_RECOMPUTED) ? " (R)" : "",
                        node->src[0] ? node->src[0]->name : "-", node->src[1] ? node->src[1]->name : "-", node->src[2] ? node->src[2]->name : "-");
            for (int k = 0; dump > 2 && k < 4; k++)  // (under its node's line)
                if (const ql_tensor *sr = node->src[k])
                    fprintf(stderr, "   src%d %s %s %s view_of %s ne [%lld %lld %lld %lld] nb [%zu %zu %zu %zu]\n", k, sr->name,
                            ql_op_name(sr->op), ql_type_name(sr->type), sr->view_src ? ql_op_name(view_root(const_cast<ql_tensor *>(sr))->op) : "-",
                            (long long)sr->ne[0], (long long)sr->ne[1], (long long)sr->ne[2], (long long)sr->ne[3], sr->nb[0], sr->nb[1], sr->nb[2],
                            sr->nb[3]);
        }
        const double f = node_flops(n);
        c->flops += f;
        if (n->flags & QL_FLAG_RECOMPUTED) c->recompute_flops += f;
        double b = (double)ql_nbytes(n);
        for (int i = 0; i < QL_MAX_SRC; i++) {
            const ql_tensor *sr = n->src[i];
            if (!sr || cast_made) continue;
            if (i == 0 && n->op == QL_OP_GET_ROWS) b += (double)(ql_nelements(n->src[1]) * (int64_t)sr->nb[1]);  // the rows it reads, not the table
            else b += (double)(ql_nbytes(sr) + (sr->view_src ? 0 : sr->aux_size));
        }
        if (!caps.host && n->op == QL_OP_MUL_MAT && ql_cuda_mm_cached(n->src[0], n->src[1]->type))  // a device reads the weight's copy instead
            b += (double)ql_nelements(n->src[0]) * (double)ql_plain_size(n->src[1]->type) -
                 (double)(ql_nbytes(n->src[0]) + (n->src[0]->view_src ? 0 : n->src[0]->aux_size));
        const int cls = n->op == QL_OP_MUL_MAT || n->op == QL_OP_MUL_MAT_DROPOUT ? QL_CENSUS_MATMUL
                        : n->op == QL_OP_FLASH_ATTN || n->op == QL_OP_FLASH_ATTN_BACK ? QL_CENSUS_ATTENTION
                        : n->op == QL_OP_CROSS_ENTROPY || n->op == QL_OP_CROSS_ENTROPY_BACK ? QL_CENSUS_LOSS
                                                                                              : QL_CENSUS_OTHER;
        c->bytes[cls] += b;
    }
    if (dump) fprintf(stderr, "census: %lld launches, by op:\n", (long long)c->launches);
    for (const auto &e : by_op) fprintf(stderr, "census %-24s %6lld launches %6lld nodes\n", e.first.c_str(), (long long)e.second.first, (long long)e.second.second);
    return QL_OK;
}

void ql_graph_set_poison(ql_graph *g, bool on) {
    if (g) g->poison = on;
}
void ql_graph_set_check_finite(ql_graph *g, bool on) {
    if (g) g->check_finite = on;
}
void ql_graph_set_profile(ql_graph *g, bool on) {
    if (!g) return;
    g->profile = on;
    g->node_seconds.assign(g->nodes.size(), 0.0);  // sized here, not while running
}
double ql_graph_node_seconds(const ql_graph *g, int i) {
    return (g && i >= 0 && i < (int)g->node_seconds.size()) ? g->node_seconds[(size_t)i] : 0.0;
}
void ql_graph_add_node_seconds(ql_graph *g, int i, double seconds) {
    if (i >= 0 && i < (int)g->node_seconds.size()) g->node_seconds[(size_t)i] += seconds;
}
void ql_graph_get_exec(const ql_graph *g, ql_graph_exec *ex) {
    if (!g || !ex) {
        if (ex) *ex = ql_graph_exec{};
        return;
    }
    *ex = ql_graph_exec{g->buffer, g->buffer_size, g->work, g->work_size, g->poison && g->run_first == 0, g->check_finite,
                        g->profile && g->node_seconds.size() == g->nodes.size(), g->run_first, g->run_last};
}

// check_finite's message, the same on every backend: the node, its op and where its sources come
// from (a parameter's name, or the node that made them)
void ql_graph_fail_nonfinite(ql_graph *g, int i, int64_t element, bool is_nan) {
    if (!g || i < 0 || i >= (int)g->nodes.size()) return;
    const ql_tensor *node = g->nodes[(size_t)i];
    auto who = [g](const ql_tensor *t) {
        if (t->name[0]) return std::string(t->name);
        for (size_t j = 0; j < g->nodes.size(); j++)
            if (g->nodes[j] == t) return "node " + std::to_string(j) + " (" + ql_op_name(t->op) + ")";
        return std::string("an input");
    };
    std::string from;
    for (const ql_tensor *s : node->src)
        if (s) from += (from.empty() ? "" : ", ") + who(s);
    QL_ERR(g->ctx, QL_ERR_INVALID, "compute: node %d of %zu (%s %s of %s) holds %s at element %lld", i, g->nodes.size(),
           ql_op_name(node->op), shape_str(node).c_str(), from.c_str(), is_nan ? "nan" : "inf", (long long)element);
}

void ql_graph_set_no_reuse(ql_graph *g, bool on) {
    if (!g) return;
    g->no_reuse = on;
    g->planned  = false;  // the placement changes: plan (and bind) again
    g->bound    = false;
}

// Points every planned tensor and view into this graph's buffer. Runs before every compute
// too: tensors shared with another graph may have been pointed into that one's buffer.
static void graph_bind(ql_graph *g) {
    for (size_t i = 0; i < g->entries.size(); i++)
        g->entry_tensor[i]->data = (g->entries[i].host ? g->host_buf : g->buffer) + g->entries[i].offset;
    for (ql_tensor *node : g->nodes)
        if (aliases_src(node->op)) {
            QL_ASSERT(node->view_src->data);
            node->data = (uint8_t *)node->view_src->data + node->view_offs;
        }
}

static bool graph_leafs_ready(ql_graph *g) {
    for (ql_tensor *l : g->leafs)
        if (!l->data && ql_nbytes(l) > 0) {
            QL_ERR(g->ctx, QL_ERR_INVALID, "graph_alloc: leaf %s has no data (a no_alloc context needs its data set first)",
                   shape_str(l).c_str());
            return false;
        }
    return true;
}

// the graph's own host memory (ql_graph_offload's copies), pinned where the backend has it
static bool graph_alloc_host(ql_graph *g, ql_backend *be) {
    if (!g->host_size || (g->host_buf_owner && ql_backend_buffer_size(g->host_buf_owner) >= g->host_size)) return true;
    ql_backend_buffer_free(g->host_buf_owner);
    g->host_buf_owner = ql_backend_buffer_alloc(be, QL_BUFFER_HOST_PINNED, g->host_size);
    g->host_buf = g->host_buf_owner ? (uint8_t *)ql_backend_buffer_base(g->host_buf_owner) : nullptr;
    if (!g->host_buf)
        QL_ERR(g->ctx, QL_ERR_NOMEM, "could not allocate %zu bytes (%.1f MiB) of pinned host memory for offloaded activations",
               g->host_size, (double)g->host_size / 1048576.0);
    return g->host_buf != nullptr;
}

ql_status ql_graph_alloc(ql_graph *g, ql_backend *be) {
    if (!g || !be) return QL_ERR_INVALID;
    ql_context *ctx = g->ctx;
    if (ctx->status != QL_OK) return ctx->status;
    if (ctx->measure) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_alloc: the graph belongs to a measuring context: plan it for sizes, "
                                    "then build it again in a real context");
        return ctx->status;
    }
    if (!g->planned || g->plan_backend != be->id) {
        const ql_status st = ql_graph_plan(g, be, nullptr);
        if (st != QL_OK) return st;
    }
    if (!graph_leafs_ready(g)) return ctx->status;
    const size_t need = g->arena_size + g->work_size;
    if (!be->iface.buffer_alloc) {
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "graph_alloc: backend %s only plans (it holds no memory)", be->iface.name);
        return ctx->status;
    }
    if (!g->buffer || g->buffer_size < need || g->buffer_backend != be->id) {
        graph_release_buffer(g);
        g->buffer = (uint8_t *)be->iface.buffer_alloc(be, std::max(need, (size_t)QL_ALIGN));
        if (!g->buffer) {
            QL_ERR(ctx, QL_ERR_NOMEM, "backend %s could not allocate %zu bytes for the planned buffer (%.1f MiB: activations "
                                      "and temporaries) --> hint: lower the batch or sequence length", be->iface.name, need,
                   (double)need / 1048576.0);
            return ctx->status;
        }
        g->buffer_size    = need;
        g->buffer_backend = be->id;
        g->buffer_free    = be->iface.buffer_free;
    }
    if (!graph_alloc_host(g, be)) return ctx->status;
    g->work = g->buffer + g->arena_size;
    g->bound = true;
    graph_bind(g);
    return QL_OK;
}

ql_status ql_graph_alloc_shared(ql_graph *g, ql_backend *be, ql_graph *host) {
    if (!g || !be || !host || g == host) return QL_ERR_INVALID;
    ql_context *ctx = g->ctx;
    if (ctx->status != QL_OK) return ctx->status;
    if (!host->buffer || host->buffer_backend != be->id) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_alloc_shared: the host graph has no buffer of backend %s (ql_graph_alloc it first)",
               be->iface.name);
        return ctx->status;
    }
    if (!g->planned || g->plan_backend != be->id) {
        const ql_status st = ql_graph_plan(g, be, nullptr);
        if (st != QL_OK) return st;
    }
    if (!graph_leafs_ready(g)) return ctx->status;
    const size_t need = g->arena_size + g->work_size;
    if (need > host->buffer_size) {
        QL_ERR(ctx, QL_ERR_INVALID, "graph_alloc_shared: the graph needs %zu bytes, the host's buffer has %zu", need,
               host->buffer_size);
        return ctx->status;
    }
    graph_release_buffer(g);
    g->buffer         = host->buffer;
    g->buffer_size    = need;
    g->buffer_backend = be->id;
    g->buffer_free    = nullptr;  // host's to free
    if (!graph_alloc_host(g, be)) return ctx->status;  // its offloaded copies are its own
    g->work           = g->buffer + g->arena_size;
    g->bound          = true;
    graph_bind(g);
    return QL_OK;
}

// ============================================================================================
// 10. CPU: SIMD layer and thread pool
// ============================================================================================

// One vector type per build: the widest the compiler was allowed (-march). The kernels below
// are written once against these few functions.
#if defined(__AVX512F__)
#define QL_SIMD_NAME "AVX512F"
typedef __m512 vf;
static constexpr int VW = 16;
static inline vf   vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf   vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf   vf_zero() { return _mm512_setzero_ps(); }
static inline vf   vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf   vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf   vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf   vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf   vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a*b + c
static inline vf   vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vf_hsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf   vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf   vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vf   vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, 0 on underflow
#elif defined(__AVX2__) && defined(__FMA__)
#define QL_SIMD_NAME "AVX2 FMA"
typedef __m256 vf;
static constexpr int VW = 8;
static inline vf   vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf   vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf   vf_zero() { return _mm256_setzero_ps(); }
static inline vf   vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf   vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf   vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf   vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf   vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf   vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vf_hsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vf_hmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf   vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf   vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf   vf_scale2(vf p, vf n) {  // p * 2^n for integral n <= 127; 0 below 2^-126
    const vf tiny = _mm256_cmp_ps(n, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
#define QL_SIMD_NAME "portable"
struct vf { float v[4]; };
static constexpr int VW = 4;
static inline vf vf_load(const float *p) { vf r; for (int i = 0; i < 4; i++) r.v[i] = p[i]; return r; }
static inline void vf_store(float *p, vf a) { for (int i = 0; i < 4; i++) p[i] = a.v[i]; }
static inline vf vf_set1(float x) { vf r; for (int i = 0; i < 4; i++) r.v[i] = x; return r; }
static inline vf vf_zero() { return vf_set1(0.0f); }
static inline vf vf_add(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] += b.v[i]; return a; }
static inline vf vf_sub(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] -= b.v[i]; return a; }
static inline vf vf_mul(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] *= b.v[i]; return a; }
static inline vf vf_div(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] /= b.v[i]; return a; }
static inline vf vf_fma(vf a, vf b, vf c) { for (int i = 0; i < 4; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline vf vf_max(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
static inline float vf_hsum(vf a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
static inline float vf_hmax(vf a) { return std::max(std::max(a.v[0], a.v[1]), std::max(a.v[2], a.v[3])); }
static inline vf vf_min(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] = std::min(a.v[i], b.v[i]); return a; }
static inline vf vf_round(vf a) { for (int i = 0; i < 4; i++) a.v[i] = std::nearbyint(a.v[i]); return a; }
// (a NaN exponent - exp(NaN) - stays NaN: converting it to int would be undefined behaviour)
static inline vf vf_scale2(vf p, vf n) {
    for (int i = 0; i < 4; i++) p.v[i] = std::isnan(n.v[i]) ? n.v[i] : std::ldexp(p.v[i], (int)n.v[i]);
    return p;
}
#endif

// VW f16 values widened (an f16 KV cache's rows)
static inline vf vf_load_h(const uint16_t *p) {
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[VW];
    for (int i = 0; i < VW; i++) t[i] = ql_fp16_to_fp32(p[i]);
    return vf_load(t);
#endif
}

// exp(x) = 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p a degree-6
// Taylor polynomial: |rel err| ~ 2 ulp. Inputs are clamped to [-120, 88]; 2^-173 p rounds
// to exactly 0, so exp(-inf) = 0 (masked scores contribute nothing).
static inline vf vf_exp(vf x) {
    x = vf_max(vf_min(x, vf_set1(88.0f)), vf_set1(-120.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504f)));
    vf r = vf_fma(n, vf_set1(-0.693145752f), x);
    r = vf_fma(n, vf_set1(-1.42860677e-06f), r);
    vf p = vf_set1(1.0f / 720);
    for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = vf_fma(p, r, vf_set1(c));
    return vf_scale2(p, n);
}

const char *ql_cpu_features(void) {
    return QL_SIMD_NAME
#if defined(__F16C__)
        " F16C"
#endif
        ;
}

// scalar exp with the vector one's rounding, so a vector body and its scalar tail agree
static inline float exp1(float x) {
    float buf[VW];
    vf_store(buf, vf_exp(vf_set1(x)));
    return buf[0];
}

// ---- small vector helpers over rows (n arbitrary; scalar tails) ----

static inline float row_dot(int64_t n, const float *x, const float *y) {
    vf s0 = vf_zero(), s1 = vf_zero();
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        s0 = vf_fma(vf_load(x + i), vf_load(y + i), s0);
        s1 = vf_fma(vf_load(x + i + VW), vf_load(y + i + VW), s1);
    }
    for (; i + VW <= n; i += VW) s0 = vf_fma(vf_load(x + i), vf_load(y + i), s0);
    float s = vf_hsum(vf_add(s0, s1));
    for (; i < n; i++) s += x[i] * y[i];
    return s;
}
static inline void row_axpy(int64_t n, float a, const float *x, float *y) {  // y += a x
    const vf va = vf_set1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(y + i, vf_fma(va, vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
static inline void row_scale(int64_t n, float a, const float *x, float *y) {  // y = a x
    const vf va = vf_set1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(y + i, vf_mul(va, vf_load(x + i)));
    for (; i < n; i++) y[i] = a * x[i];
}
static inline void row_add(int64_t n, const float *x, const float *y, float *d) {  // d = x + y, element by element (d may be x or y)
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(d + i, vf_add(vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) d[i] = x[i] + y[i];
}
static inline void row_mul(int64_t n, const float *x, const float *y, float *d) {  // d = x * y, element by element (d may be x)
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(d + i, vf_mul(vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) d[i] = x[i] * y[i];
}
static inline float row_max(int64_t n, const float *x) {
    float m = -INFINITY;
    int64_t i = 0;
    if (n >= VW) {
        vf vm = vf_load(x);
        for (i = VW; i + VW <= n; i += VW) vm = vf_max(vm, vf_load(x + i));
        m = vf_hmax(vm);
    }
    for (; i < n; i++) m = std::max(m, x[i]);
    return m;
}
// y = exp(x - m), returns the sum
static inline float row_exp_sum(int64_t n, const float *x, float m, float *y) {
    const vf vm = vf_set1(m);
    vf s = vf_zero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf e = vf_exp(vf_sub(vf_load(x + i), vm));
        vf_store(y + i, e);
        s = vf_add(s, e);
    }
    float r = vf_hsum(s);
    for (; i < n; i++) r += (y[i] = exp1(x[i] - m));
    return r;
}

// x[i] = x[i] a - c[i cs] (cs 0: one c): a product then a difference, rounded alike in the
// vector body and the tail (a padded copy), so attention's two backward ways agree to the bit
static inline void row_mul_sub(int64_t n, float *x, float a, const float *c, int cs) {
    const vf va = vf_set1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_store(x + i, vf_sub(vf_mul(vf_load(x + i), va), cs ? vf_load(c + i) : vf_set1(c[0])));
    if (i == n) return;
    float t[VW] = {}, u[VW] = {};
    std::copy(x + i, x + n, t);
    if (cs) std::copy(c + i, c + n, u);
    vf_store(t, vf_sub(vf_mul(vf_load(t), va), cs ? vf_load(u) : vf_set1(c[0])));
    std::copy(t, t + (n - i), x + i);
}
// out[i] = (a s[i]) (d[i] - c[i cs]): attention's dS from P and dP (out may be s or d)
static inline void row_dsoft(int64_t n, const float *s, const float *d, float *out, float a, const float *c, int cs) {
    const vf va = vf_set1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW)
        vf_store(out + i, vf_mul(vf_mul(va, vf_load(s + i)), vf_sub(vf_load(d + i), cs ? vf_load(c + i) : vf_set1(c[0]))));
    if (i == n) return;
    float ts[VW] = {}, td[VW] = {}, tc[VW] = {};
    std::copy(s + i, s + n, ts);
    std::copy(d + i, d + n, td);
    if (cs) std::copy(c + i, c + n, tc);
    vf_store(ts, vf_mul(vf_mul(va, vf_load(ts)), vf_sub(vf_load(td), cs ? vf_load(tc) : vf_set1(c[0]))));
    std::copy(ts, ts + (n - i), out + i);
}

// dst[i*ld_dst + j] = src[j*ld_src + i] for an 8 x 8 block
static inline void transpose8(const float *src, int64_t ld_src, float *dst, int64_t ld_dst) {
#if defined(__AVX__)
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld_src);
    for (int i = 0; i < 8; i += 2) {
        t[i]     = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i]     = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
#else
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) dst[i * ld_dst + j] = src[j * ld_src + i];
#endif
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Persistent workers; the caller is thread 0. A job is a plain function pointer and argument
// (no std::function: running a graph must not allocate).
struct cpu_pool {
    typedef void (*job_fn)(void *arg, int ith, int nth);
    int n = 1;
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable cv, done_cv;
    uint64_t gen = 0;
    bool quit = false;
    job_fn fn = nullptr;
    void *arg = nullptr;
    int running = 0;
    alignas(64) std::atomic<int> bar_count{0};
    alignas(64) std::atomic<int> bar_phase{0};

    // false when the system will not start that many threads (its limit, or memory for their
    // stacks): those that started are stopped again, and the caller says so
    bool start(int n_threads) {
        n = std::max(1, n_threads);
        try {
            threads.reserve((size_t)n - 1);
            for (int i = 1; i < n; i++) threads.emplace_back([this, i] { worker(i); });
        } catch (const std::exception &) {
            stop();
            return false;
        }
        return true;
    }
    void stop() {
        {
            std::lock_guard<std::mutex> lk(mu);
            quit = true;
        }
        cv.notify_all();
        for (std::thread &t : threads) t.join();
        threads.clear();
    }
    void worker(int ith) {
        uint64_t seen = 0;
        for (;;) {
            job_fn f;
            void *a;
            {
                std::unique_lock<std::mutex> lk(mu);
                cv.wait(lk, [&] { return quit || gen != seen; });
                if (quit) return;
                seen = gen;
                f = fn;
                a = arg;
            }
            f(a, ith, n);
            std::lock_guard<std::mutex> lk(mu);
            if (--running == 0) done_cv.notify_one();
        }
    }
    void run(job_fn f, void *a) {
        if (n == 1) {
            f(a, 0, 1);
            return;
        }
        {
            std::lock_guard<std::mutex> lk(mu);
            fn = f;
            arg = a;
            running = n - 1;
            gen++;
        }
        cv.notify_all();
        f(a, 0, n);
        std::unique_lock<std::mutex> lk(mu);
        done_cv.wait(lk, [&] { return running == 0; });
    }
    // All threads of a job meet here. The last to arrive runs `last(arg)` before releasing the
    // others, so a decision made there is seen identically by every thread after the barrier.
    void barrier(void (*last)(void *) = nullptr, void *last_arg = nullptr) {
        if (n == 1) {
            if (last) last(last_arg);
            return;
        }
        const int phase = bar_phase.load(std::memory_order_acquire);
        if (bar_count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            if (last) last(last_arg);
            bar_count.store(0, std::memory_order_relaxed);
            bar_phase.fetch_add(1, std::memory_order_acq_rel);
            return;
        }
        for (int spins = 0; bar_phase.load(std::memory_order_acquire) == phase; spins++) {
            if (spins < 2000)
                cpu_relax();
            else
                std::this_thread::yield();  // oversubscribed (sanitizers, valgrind, busy machine)
        }
    }
};

// ============================================================================================
// 11. CPU kernels
// ============================================================================================

struct cpu_job;  // below: the graph being run, the first kernel error

struct cpu_params {
    int      ith, nth, pass;
    uint8_t *wdata;   // this thread's workspace (work_size / nth bytes)
    cpu_job *job;
};

static void cpu_fail(const cpu_params &p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline void split_range(int64_t n, int ith, int nth, int64_t &b, int64_t &e) {
    b = n * ith / nth;
    e = n * (ith + 1) / nth;
}

// row r of a tensor with shape ne[1..3] and strides nb[1..3]
static inline uint8_t *row_ptr(const ql_tensor *t, int64_t r) {
    const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
    return (uint8_t *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}
static inline float *f32_row(const ql_tensor *t, int64_t r) { return (float *)row_ptr(t, r); }
// row r as f32: itself, or a 16-bit row converted into tmp [ne0]
static inline const float *f32_row_of(const ql_tensor *t, int64_t r, float *tmp) {
    if (t->type == QL_TYPE_F32) return f32_row(t, r);
    traits(t->type).to_float(row_ptr(t, r), tmp, t->ne[0]);
    return tmp;
}

// ---- quantized rows: NF4 dequantisation (runs inside every matmul with an NF4 weight) ----

// 32 packed bytes -> 64 floats, value * absmax in f32 (the same products on every path)
static inline void nf4_block_to_float(const uint8_t *q, float am, float *dst) {
#if defined(__AVX512F__)
    const __m512  lut = _mm512_loadu_ps(k_nf4_values), vam = _mm512_set1_ps(am);
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd  = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int h = 0; h < 2; h++) {
        const __m512i b  = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
        const __m512  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);                        // elements 2j
        const __m512  lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut);    // elements 2j+1
        _mm512_storeu_ps(dst + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(hi, even, lo), vam));
        _mm512_storeu_ps(dst + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(hi, odd, lo), vam));
    }
#else
    for (int j = 0; j < QL_NF4_BLOCK / 2; j++) {
        dst[2 * j]     = k_nf4_values[q[j] >> 4] * am;
        dst[2 * j + 1] = k_nf4_values[q[j] & 15] * am;
    }
#endif
}

// Elements [first, first + n) of the flattened tensor, q at element `first` (both even): whole
// blocks of 64 on the vector path, and the pieces of blocks a row cuts (rows that are not whole
// blocks: the block, by flat index, continues in the next row) element pair by pair.
template <class Absmax> static void nf4_span_to_float(const uint8_t *q, const Absmax &absmax, int64_t first, float *dst, int64_t n) {
    QL_ASSERT(first % 2 == 0 && n % 2 == 0);
    for (int64_t i = 0; i < n;) {
        const int64_t e = first + i, b = e / QL_NF4_BLOCK, off = e % QL_NF4_BLOCK;
        if (off == 0 && n - i >= QL_NF4_BLOCK) {
            nf4_block_to_float(q + i / 2, absmax(b), dst + i);
            i += QL_NF4_BLOCK;
            continue;
        }
        const int64_t m = std::min<int64_t>(QL_NF4_BLOCK - off, n - i);
        const float am = absmax(b);
        for (int64_t k = i; k < i + m; k += 2) {
            dst[k]     = k_nf4_values[q[k / 2] >> 4] * am;
            dst[k + 1] = k_nf4_values[q[k / 2] & 15] * am;
        }
        i += m;
    }
}

static void nf4_to_float_aux(const void *row, const void *aux, int64_t first, float *dst, int64_t n) {
    const nf4_aux a(aux);
    nf4_span_to_float((const uint8_t *)row, [&a](int64_t b) { return a.absmax(b); }, first, dst, n);
}

static void nf4_nodq_to_float_aux(const void *row, const void *aux, int64_t first, float *dst, int64_t n) {
    const float *am = (const float *)aux;
    nf4_span_to_float((const uint8_t *)row, [am](int64_t b) { return am[b]; }, first, dst, n);
}

// ---- fill, copies, elementwise ----

static void k_fill(const cpu_params &p, ql_tensor *dst) {
    const float v = get_param<float>(dst, 0);
    int64_t b, e;
    split_range(ql_nelements(dst), p.ith, p.nth, b, e);
    std::fill((float *)dst->data + b, (float *)dst->data + e, v);
}

static void k_cont(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *src = dst->src[0];
    const ql_type_traits &ts = traits(src->type), &td = traits(dst->type);
    const int64_t ne0 = src->ne[0];
    float *tmp = (float *)p.wdata;  // [ne0]
    int64_t b, e;
    split_range(ql_nrows(src), p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        const uint8_t *s = row_ptr(src, r);
        uint8_t *d = (uint8_t *)dst->data + r * dst->nb[1];
        if (ql_rows_contiguous(src)) {
            if (src->type == dst->type && !ts.aux_bytes) {
                memcpy(d, s, ql_row_size(src->type, ne0));
            } else if (dst->type == QL_TYPE_F32) {
                row_to_float(src, s, 0, ne0, (float *)d);
            } else if (src->type == QL_TYPE_F32) {
                td.from_float((const float *)s, d, ne0);
            } else {
                row_to_float(src, s, 0, ne0, tmp);
                td.from_float(tmp, d, ne0);
            }
        } else if (src->type == QL_TYPE_F32 && dst->type == QL_TYPE_F32) {  // transposed f32: gather
            for (int64_t i = 0; i < ne0; i++) ((float *)d)[i] = *(const float *)(s + i * src->nb[0]);
        } else if (src->type == dst->type) {  // any plain type (i32 too): element by element
            for (int64_t i = 0; i < ne0; i++) memcpy(d + i * ts.type_size, s + i * src->nb[0], ts.type_size);
        } else {
            for (int64_t i = 0; i < ne0; i++) ts.to_float(s + i * src->nb[0], tmp + i, 1);
            td.from_float(tmp, d, ne0);
        }
    }
}

// b's row and column for a's index i in one dimension: repetition by modulo, or by blocks
static inline int64_t bcast_index(int64_t i, int64_t na, int64_t nb, bool grouped) {
    return grouped ? i / (na / nb) : i % nb;
}

template <bool MUL> static void k_binary(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *bt = dst->src[1];
    const bool grouped = dst->op_params[0] != 0;
    const int64_t ne0 = a->ne[0], nb0 = bt->ne[0];
    int64_t rb, re;
    split_range(ql_nrows(a), p.ith, p.nth, rb, re);
    for (int64_t r = rb; r < re; r++) {
        const int64_t i1 = r % a->ne[1], i2 = (r / a->ne[1]) % a->ne[2], i3 = r / (a->ne[1] * a->ne[2]);
        const float *x = f32_row(a, r);
        const float *y = (const float *)((const uint8_t *)bt->data + bcast_index(i1, a->ne[1], bt->ne[1], grouped) * bt->nb[1] +
                                          bcast_index(i2, a->ne[2], bt->ne[2], grouped) * bt->nb[2] +
                                          bcast_index(i3, a->ne[3], bt->ne[3], grouped) * bt->nb[3]);
        float *d = (float *)dst->data + r * ne0;
        if (nb0 == ne0) {
            int64_t i = 0;
            for (; i + VW <= ne0; i += VW)
                vf_store(d + i, MUL ? vf_mul(vf_load(x + i), vf_load(y + i)) : vf_add(vf_load(x + i), vf_load(y + i)));
            for (; i < ne0; i++) d[i] = MUL ? x[i] * y[i] : x[i] + y[i];
        } else if (nb0 == 1) {
            const float s = y[0];
            for (int64_t i = 0; i < ne0; i++) d[i] = MUL ? x[i] * s : x[i] + s;
        } else {
            for (int64_t i = 0; i < ne0; i++) {
                const float s = y[bcast_index(i, ne0, nb0, grouped)];
                d[i] = MUL ? x[i] * s : x[i] + s;
            }
        }
    }
}

static void k_scale(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0];
    const float s = get_param<float>(dst, 0);
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    if (dst->type == QL_TYPE_F32) {
        for (int64_t r = b; r < e; r++) row_scale(ne0, s, f32_row(a, r), (float *)dst->data + r * ne0);
        return;
    }
    // a 16-bit result (ql_scale_to): the f32 products of a piece of the row, then rounded as ql_cast rounds
    const ql_type_traits &td = traits(dst->type);
    float tmp[256];
    for (int64_t r = b; r < e; r++)
        for (int64_t i = 0; i < ne0; i += 256) {
            const int64_t n = std::min<int64_t>(256, ne0 - i);
            row_scale(n, s, f32_row(a, r) + i, tmp);
            td.from_float(tmp, (uint8_t *)dst->data + (size_t)(r * ne0 + i) * td.type_size, n);
        }
}

static void k_sum(const cpu_params &p, ql_tensor *dst) {
    if (p.ith != 0) return;  // small, and one fixed order keeps it deterministic
    const ql_tensor *a = dst->src[0];
    double s = 0;
    for (int64_t r = 0; r < ql_nrows(a); r++) {
        const float *x = f32_row(a, r);
        for (int64_t i = 0; i < a->ne[0]; i++) s += x[i];
    }
    *(float *)dst->data = (float)s;
}

static void k_reduce_to(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0];
    const bool grouped = dst->op_params[0] != 0;
    int64_t rep[4];
    for (int i = 0; i < 4; i++) rep[i] = a->ne[i] / dst->ne[i];
    float *acc = (float *)p.wdata;  // [a.ne0]
    int64_t rb, re;
    split_range(ql_nrows(dst), p.ith, p.nth, rb, re);
    for (int64_t r = rb; r < re; r++) {
        const int64_t j1 = r % dst->ne[1], j2 = (r / dst->ne[1]) % dst->ne[2], j3 = r / (dst->ne[1] * dst->ne[2]);
        std::fill(acc, acc + a->ne[0], 0.0f);
        for (int64_t t3 = 0; t3 < rep[3]; t3++)
            for (int64_t t2 = 0; t2 < rep[2]; t2++)
                for (int64_t t1 = 0; t1 < rep[1]; t1++) {
                    const int64_t i1 = grouped ? j1 * rep[1] + t1 : j1 + t1 * dst->ne[1];
                    const int64_t i2 = grouped ? j2 * rep[2] + t2 : j2 + t2 * dst->ne[2];
                    const int64_t i3 = grouped ? j3 * rep[3] + t3 : j3 + t3 * dst->ne[3];
                    const float *x = (const float *)((const uint8_t *)a->data + i1 * a->nb[1] + i2 * a->nb[2] + i3 * a->nb[3]);
                    row_axpy(a->ne[0], 1.0f, x, acc);
                }
        float *d = (float *)dst->data + r * dst->ne[0];
        for (int64_t j0 = 0; j0 < dst->ne[0]; j0++) {
            float s = 0;
            for (int64_t t0 = 0; t0 < rep[0]; t0++) s += acc[grouped ? j0 * rep[0] + t0 : j0 + t0 * dst->ne[0]];
            d[j0] = s;
        }
    }
}

static void k_acc_grad(const cpu_params &p, ql_tensor *dst) {  // dst aliases the grad: grad += src1
    const ql_tensor *c = dst->src[1];
    int64_t b, e;
    split_range(ql_nrows(c), p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) row_axpy(c->ne[0], 1.0f, f32_row(c, r), (float *)dst->data + r * c->ne[0]);
}

static void k_cache_store(const cpu_params &p, ql_tensor *dst) {  // dst aliases the cache
    const ql_tensor *src = dst->src[1];
    const int32_t at = *(const int32_t *)dst->src[2]->data;
    if (at < 0 || at + src->ne[1] > dst->ne[1]) {
        if (p.ith == 0)
            cpu_fail(p, "cache_store: rows [%d, %lld) outside the cache's %lld --> hint: a longer context (-c)", at,
                     (long long)(at + src->ne[1]), (long long)dst->ne[1]);
        return;
    }
    const size_t row = ql_row_size(src->type, src->ne[0]);
    int64_t b, e;
    split_range(ql_nrows(src), p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        const int64_t i1 = r % src->ne[1], i2 = (r / src->ne[1]) % src->ne[2], i3 = r / (src->ne[1] * src->ne[2]);
        uint8_t *to = (uint8_t *)dst->data + (at + i1) * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3];
        if (dst->type == src->type) memcpy(to, row_ptr(src, r), row);
        else traits(dst->type).from_float((const float *)row_ptr(src, r), to, src->ne[0]);  // an f16 cache
    }
}

// a with b added to rows [row0, row0 + n): each row written by one thread, once (in place over
// a: only the rows added)
static void k_add_rows(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *b = dst->src[1];
    const int64_t row0 = get_param<int64_t>(dst, 0), n = ql_nrows(b), ne0 = dst->ne[0];
    const bool inplace = dst->data == a->data;
    const float *x = (const float *)a->data;
    float *y = (float *)dst->data;
    int64_t lo, hi;
    split_range(inplace ? n : ql_nrows(dst), p.ith, p.nth, lo, hi);
    for (int64_t i = lo; i < hi; i++) {
        const int64_t r = inplace ? row0 + i : i;
        const float *xr = x + r * ne0;
        float *yr = y + r * ne0;
        if (r >= row0 && r < row0 + n) {
            const float *br = f32_row(b, r - row0);
            for (int64_t j = 0; j < ne0; j++) yr[j] = xr[j] + br[j];
        } else {
            memcpy(yr, xr, (size_t)ne0 * sizeof(float));
        }
    }
}

static void k_view_back(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *dy = dst->src[0];
    const int64_t off = get_param<int64_t>(dst, 0), s1 = get_param<int64_t>(dst, 2), s2 = get_param<int64_t>(dst, 4),
                  s3 = get_param<int64_t>(dst, 6);
    float *d = (float *)dst->data;
    int64_t b, e;
    if (p.pass == 0) {
        split_range(ql_nelements(dst), p.ith, p.nth, b, e);
        std::fill(d + b, d + e, 0.0f);
        return;
    }
    // Rows go to different threads only when the view is one-to-one (then rows land on
    // disjoint places); a view overlapping itself is scattered by one thread, in order.
    const bool overlap = dst->op_params[8] != 0;
    if (overlap && p.ith != 0) return;
    split_range(ql_nrows(dy), overlap ? 0 : p.ith, overlap ? 1 : p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        const int64_t i1 = r % dy->ne[1], i2 = (r / dy->ne[1]) % dy->ne[2], i3 = r / (dy->ne[1] * dy->ne[2]);
        row_axpy(dy->ne[0], 1.0f, f32_row(dy, r), d + off + i1 * s1 + i2 * s2 + i3 * s3);
    }
}

// ---- embedding rows ----

static void k_get_rows(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *ids = dst->src[1];
    const int64_t n = ql_nelements(ids);
    int64_t b, e;
    split_range(n, p.ith, p.nth, b, e);
    for (int64_t i = b; i < e; i++) {
        const int32_t id = ((const int32_t *)ids->data)[i];
        if (id < 0 || id >= a->ne[1]) {
            cpu_fail(p, "get_rows: id %d at position %lld is outside the table's %lld rows (%s)", id, (long long)i,
                     (long long)a->ne[1], shape_str(a).c_str());
            return;
        }
        row_to_float(a, (const uint8_t *)a->data + id * a->nb[1], 0, a->ne[0], (float *)dst->data + i * a->ne[0]);
    }
}

static void k_get_rows_back(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *dy = dst->src[0], *ids = dst->src[1];
    const int64_t ne0 = dst->ne[0], n = ql_nelements(ids);
    int64_t b, e;
    if (p.pass == 0) {
        split_range(ql_nelements(dst), p.ith, p.nth, b, e);
        std::fill((float *)dst->data + b, (float *)dst->data + e, 0.0f);
        return;
    }
    // each thread owns a slice of columns: scatter-add with no races, in a fixed order
    split_range(ne0, p.ith, p.nth, b, e);
    if (b == e) return;
    for (int64_t i = 0; i < n; i++) {
        const int32_t id = ((const int32_t *)ids->data)[i];
        if (id < 0 || id >= dst->ne[1]) {
            cpu_fail(p, "get_rows_back: id %d at position %lld is outside %lld rows", id, (long long)i, (long long)dst->ne[1]);
            return;
        }
        row_axpy(e - b, 1.0f, f32_row(dy, i) + b, (float *)dst->data + id * ne0 + b);
    }
}

// ---- row ops: rms_norm, silu, swiglu, dropout ----

static void k_rms_norm(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0];
    const float eps = get_param<float>(dst, 0);
    const float *w = dst->src[1] ? (const float *)dst->src[1]->data : nullptr;  // ql_rms_norm_mul: [ne0]
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row(a, r);
        float *d = dst->type == QL_TYPE_F32 ? (float *)dst->data + r * ne0 : (float *)p.wdata;  // (16-bit: the f32 row first)
        const float ms = row_dot(ne0, x, x) / (float)ne0;
        row_scale(ne0, 1.0f / std::sqrt(ms + eps), x, d);
        if (w) row_mul(ne0, d, w, d);  // the normed row rounded to f32, then times w: ql_mul's product
        if (dst->type != QL_TYPE_F32) traits(dst->type).from_float(d, (uint8_t *)dst->data + (size_t)(r * ne0) * traits(dst->type).type_size, ne0);
    }
}

static void k_rms_norm_back(const cpu_params &p, ql_tensor *dst) {
    // y = x r, r = (mean(x^2) + eps)^-1/2  =>  dx = r dy - r^3/n (dy . x) x
    const ql_tensor *a = dst->src[0], *dy = dst->src[1];
    const float *w = dst->src[2] ? (const float *)dst->src[2]->data : nullptr;  // the norm's dy is dy * w (ql_rms_norm_mul)
    const ql_tensor *acc = dst->src[3];  // the gradient so far: the result is acc + dx (ql_add's sum)
    const float eps = get_param<float>(dst, 0);
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    float *ws = (float *)p.wdata;  // [ne0] dy * w, then [ne0] dx before the sum
    float *wx = ws + (w ? ne0 : 0);
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row(a, r), *g = f32_row(dy, r);
        if (w) {  // dy * w in the workspace: ql_mul's product, then the same sums as over a dy made by it
            row_mul(ne0, g, w, ws);
            g = ws;
        }
        float *d = (float *)dst->data + r * ne0, *dx = acc ? wx : d;
        const float ms = row_dot(ne0, x, x) / (float)ne0, rs = 1.0f / std::sqrt(ms + eps);
        const float c = -rs * rs * rs * row_dot(ne0, g, x) / (float)ne0;
        for (int64_t i = 0; i < ne0; i++) dx[i] = rs * g[i] + c * x[i];
        if (acc) row_add(ne0, (const float *)acc->data + r * ne0, dx, d);
    }
}

static inline vf vf_sigmoid(vf x) { return vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), x)))); }
static inline float sigmoid1(float x) { return 1.0f / (1.0f + exp1(-x)); }

static void k_silu(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0];
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row(a, r);
        float *y = (float *)dst->data + r * ne0;
        int64_t i = 0;
        for (; i + VW <= ne0; i += VW) {
            const vf v = vf_load(x + i);
            vf_store(y + i, vf_mul(v, vf_sigmoid(v)));
        }
        for (; i < ne0; i++) y[i] = x[i] * sigmoid1(x[i]);
    }
}

static void k_silu_back(const cpu_params &p, ql_tensor *dst) {
    // d/dx x s(x) = s (1 + x (1 - s))
    const ql_tensor *a = dst->src[0], *dy = dst->src[1];
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    const vf one = vf_set1(1.0f);
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row(a, r), *g = f32_row(dy, r);
        float *d = (float *)dst->data + r * ne0;
        int64_t i = 0;
        for (; i + VW <= ne0; i += VW) {
            const vf v = vf_load(x + i), s = vf_sigmoid(v);
            vf_store(d + i, vf_mul(vf_load(g + i), vf_mul(s, vf_fma(v, vf_sub(one, s), one))));
        }
        for (; i < ne0; i++) {
            const float s = sigmoid1(x[i]);
            d[i] = g[i] * s * (1.0f + x[i] * (1.0f - s));
        }
    }
}

static void k_swiglu(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *bt = dst->src[1];
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    const bool f32 = dst->type == QL_TYPE_F32;  // else 16-bit a, b and result: rows through the workspace [3, ne0]
    float *ws = (float *)p.wdata;
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row_of(a, r, ws), *u = f32_row_of(bt, r, ws + ne0);
        float *y = f32 ? (float *)dst->data + r * ne0 : ws + 2 * ne0;
        int64_t i = 0;
        for (; i + VW <= ne0; i += VW) {
            const vf v = vf_load(x + i);
            vf_store(y + i, vf_mul(vf_mul(v, vf_sigmoid(v)), vf_load(u + i)));
        }
        for (; i < ne0; i++) y[i] = x[i] * sigmoid1(x[i]) * u[i];
        if (!f32) traits(dst->type).from_float(y, (uint8_t *)dst->data + (size_t)(r * ne0) * traits(dst->type).type_size, ne0);
    }
}

static void k_swiglu_back(const cpu_params &p, ql_tensor *dst) {
    // y = silu(a) b: da = dy b silu'(a) at [0, n), db = dy silu(a) at [n, 2n)
    const ql_tensor *a = dst->src[0], *bt = dst->src[1], *dy = dst->src[2];
    const int64_t ne0 = a->ne[0], n = ql_nelements(a);
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    const vf one = vf_set1(1.0f);
    float *ws = (float *)p.wdata;  // 16-bit a and b: their rows as f32 [2, ne0]
    const bool f32 = dst->type == QL_TYPE_F32;  // else (autodiff's cast of these gradients, folded in) da's and db's rows
    float *wd = ws + (a->type == QL_TYPE_F32 ? 0 : 2 * ne0);  // in the workspace [2, ne0], rounded once as ql_cast rounds
    for (int64_t r = b; r < e; r++) {
        const float *x = f32_row_of(a, r, ws), *u = f32_row_of(bt, r, ws + ne0), *g = f32_row(dy, r);
        float *da = f32 ? (float *)dst->data + r * ne0 : wd, *db = f32 ? da + n : wd + ne0;
        int64_t i = 0;
        for (; i + VW <= ne0; i += VW) {
            const vf v = vf_load(x + i), s = vf_sigmoid(v), gv = vf_load(g + i);
            vf_store(db + i, vf_mul(gv, vf_mul(v, s)));
            vf_store(da + i, vf_mul(vf_mul(gv, vf_load(u + i)), vf_mul(s, vf_fma(v, vf_sub(one, s), one))));
        }
        for (; i < ne0; i++) {
            const float s = sigmoid1(x[i]);
            db[i] = g[i] * x[i] * s;
            da[i] = g[i] * u[i] * s * (1.0f + x[i] * (1.0f - s));
        }
        if (!f32) {
            const ql_type_traits &td = traits(dst->type);
            td.from_float(da, (uint8_t *)dst->data + (size_t)(r * ne0) * td.type_size, ne0);
            td.from_float(db, (uint8_t *)dst->data + (size_t)(n + r * ne0) * td.type_size, ne0);
        }
    }
}

// Counter-based (qlora.h's ql_dropout_hash, every backend's): the mask of element i depends only
// on (seed, stream, i), so backward and a recomputed forward regenerate it exactly.
// y[i] = x[i] / (1 - p) where element e = e0 + i survives (its hash's high half >= threshold), else 0
static void dropout_row(int64_t n, const float *x, float *y, uint64_t key, uint64_t e0, uint32_t threshold, float keep_scale) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    constexpr uint64_t G = QL_DROPOUT_STEP;
    // 16 elements a step, the hash in two vectors of 8 64-bit lanes: the scalar loop's bits
    const __m512i c1 = _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ull), c2 = _mm512_set1_epi64((long long)0x94D049BB133111EBull);
    const __m512i step = _mm512_set1_epi64((long long)(16 * G));
    const __m512i lane = _mm512_mullo_epi64(_mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1), _mm512_set1_epi64((long long)G));
    __m512i z0 = _mm512_add_epi64(_mm512_set1_epi64((long long)(key + G * e0)), lane);  // key + G (e0 + i + 1 + lane)
    __m512i z1 = _mm512_add_epi64(z0, _mm512_set1_epi64((long long)(8 * G)));
    const __m512i thr = _mm512_set1_epi32((int)threshold);
    const __m512 ks = _mm512_set1_ps(keep_scale);
    auto hi32 = [&](__m512i z) {
        z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), c1);
        z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), c2);
        return _mm512_cvtepi64_epi32(_mm512_srli_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 32));
    };
    for (; i + 16 <= n; i += 16) {
        const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(hi32(z0)), hi32(z1), 1);
        _mm512_storeu_ps(y + i, _mm512_maskz_mul_ps(_mm512_cmpge_epu32_mask(h, thr), _mm512_loadu_ps(x + i), ks));
        z0 = _mm512_add_epi64(z0, step);
        z1 = _mm512_add_epi64(z1, step);
    }
#endif
    for (; i < n; i++) {
        y[i] = ql_dropout_hash(key, e0 + (uint64_t)i) >= threshold ? x[i] * keep_scale : 0.0f;
    }
}

static void k_dropout(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *seed = dst->src[1];
    const float pr = get_param<float>(dst, 0), keep_scale = 1.0f / (1.0f - pr);
    const uint32_t stream = get_param<uint32_t>(dst, 1);
    const int64_t row0 = get_param<int64_t>(dst, 2);  // a piece of a bigger tensor: its rows' mask
    const uint32_t threshold = ql_dropout_threshold(pr);
    const uint64_t key = ql_dropout_key(((const int32_t *)seed->data)[0], stream);
    const int64_t ne0 = a->ne[0];
    int64_t b, e;
    split_range(ql_nrows(a), p.ith, p.nth, b, e);
    const size_t ts = traits(dst->type).type_size;
    // the workspace: a 16-bit result's f32 row [ne0], then a 16-bit a's row as f32 [ne0]
    float *ws = (float *)p.wdata, *arow = ws + (dst->type == QL_TYPE_F32 ? 0 : ne0);
    for (int64_t r = b; r < e; r++) {  // a 16-bit result: the f32 row in the workspace, then converted
        float *y = dst->type == QL_TYPE_F32 ? (float *)dst->data + r * ne0 : ws;
        dropout_row(ne0, f32_row_of(a, r, arow), y, key, (uint64_t)((r + row0) * ne0), threshold, keep_scale);
        if (dst->type != QL_TYPE_F32) traits(dst->type).from_float(y, (uint8_t *)dst->data + (size_t)(r * ne0) * ts, ne0);
    }
}

// ---- rope ----

static size_t rope_work(const ql_tensor *node) {  // inv, cos, sin; 16-bit a or result: a row in and out as f32 [2, D]
    const size_t row16 = node->type == QL_TYPE_F32 && node->src[0]->type == QL_TYPE_F32 ? 0 : 2 * (size_t)node->ne[0];
    return (size_t)node->op_params[0] / 2 * sizeof(double) + ((size_t)node->op_params[0] + row16) * sizeof(float);
}

template <bool BACK> static void k_rope(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *pos = dst->src[1], *ff = dst->src[2];
    const int n_dims = dst->op_params[0], mode = dst->op_params[1], half = n_dims / 2;
    const double base = get_param<float>(dst, 2);
    const int64_t D = a->ne[0], H = a->ne[1], T = a->ne[2];
    double *inv = (double *)p.wdata;  // [half]
    float *cs = (float *)(inv + half), *sn = cs + half;
    float *xw = sn + half, *yw = xw + D;  // 16-bit: a's row widened (rope), the result before its one rounding
    const bool a32 = a->type == QL_TYPE_F32, f32 = dst->type == QL_TYPE_F32;
    for (int i = 0; i < half; i++)
        inv[i] = ql_rope_inv_freq(i, n_dims, base, ff ? (double)((const float *)ff->data)[i] : 1.0);
    int64_t b, e;
    split_range(T * a->ne[3], p.ith, p.nth, b, e);
    for (int64_t tok = b; tok < e; tok++) {  // cos/sin once per token, shared by its heads
        const int64_t t = tok % T, bb = tok / T;
        const double ps = ((const int32_t *)pos->data)[tok];
        for (int i = 0; i < half; i++) {
            const double th = ps * inv[i];
            cs[i] = (float)std::cos(th);
            sn[i] = (float)(BACK ? -std::sin(th) : std::sin(th));  // backward rotates by -theta
        }
        for (int64_t h = 0; h < H; h++) {
            const uint8_t *xr = (const uint8_t *)a->data + h * a->nb[1] + t * a->nb[2] + bb * a->nb[3];
            const float *x = (const float *)xr;
            float *y = f32 ? (float *)dst->data + (tok * H + h) * D : yw;
            if (!a32) traits(a->type).to_float(xr, xw, D), x = xw;
            const int64_t stride = mode == QL_ROPE_NEOX ? 1 : 2, other = mode == QL_ROPE_NEOX ? half : 1;
            for (int i = 0; i < half; i++) {
                const int64_t i0 = i * stride;
                const float x0 = x[i0], x1 = x[i0 + other];
                y[i0]         = x0 * cs[i] - x1 * sn[i];
                y[i0 + other] = x0 * sn[i] + x1 * cs[i];
            }
            for (int64_t i = n_dims; i < D; i++) y[i] = x[i];
            if (!f32) traits(dst->type).from_float(y, (uint8_t *)dst->data + (size_t)((tok * H + h) * D) * 2, D);
        }
    }
}

// ---- fused causal attention (FlashAttention-2 on the CPU) ----
// Forward per (batch, head, block of FA_BQ queries): keys in tiles of FA_BK, scores vectorised
// over the tile against a transposed copy of K, online softmax, O rescaled as the max grows.
// Backward: scores recomputed from q, k and the saved logsumexp, and no two threads write one
// element. Fused (FlashAttention-2): a thread owns a kv head with its query group, so one tile's
// S and dP feed dQ, dK and dV. Or, where that leaves threads idle, two independent halves: dq by
// query blocks, dk/dv by key blocks (recomputing S and dP: 7 products instead of 5).

static constexpr int FA_BQ = 64, FA_BK = 64;
static constexpr int FA_G = VW >= 16 ? 4 : 2;  // rows handled together so each K/V load feeds G FMAs

static inline const float *fa_row(const ql_tensor *t, int64_t i, int64_t h, int64_t b) {
    return (const float *)((const uint8_t *)t->data + i * t->nb[1] + h * t->nb[2] + b * t->nb[3]);
}
// q, k, v (and the forward's output) may be 16-bit (a 16-bit compute type): their rows are widened
// to f32 as they are read - exactly, so every sum and rounding is the f32 kernel's
static inline float fa_at(const ql_tensor *t, const uint8_t *row, int64_t c) {
    const uint16_t x = ((const uint16_t *)row)[c];
    return t->type == QL_TYPE_BF16 ? ql_bf16_to_fp32(x) : ql_fp16_to_fp32(x);
}
// rows [i0, i0 + n) of t (head h, batch b) as f32: t's own rows, or (16-bit) widened into buf [n][ne0]
static void fa_rows(const ql_tensor *t, int64_t i0, int64_t n, int64_t h, int64_t b, float *buf, const float **rows) {
    for (int64_t j = 0; j < n; j++) {
        rows[j] = fa_row(t, i0 + j, h, b);
        if (t->type == QL_TYPE_F32) continue;
        traits(t->type).to_float((const uint8_t *)rows[j], buf + j * t->ne[0], t->ne[0]);
        rows[j] = buf + j * t->ne[0];
    }
}

// xt[c*W + j] = row j of t (j < n), zero for n <= j < W
static void fa_pack_t(const ql_tensor *t, int64_t j0, int64_t n, int64_t h, int64_t b, int W, float *xt) {
    const int64_t D = t->ne[0], ld = (int64_t)(t->nb[1] / sizeof(float));  // rows j are ld floats apart
    int64_t j = 0;
    if (t->type != QL_TYPE_F32)  // 16-bit: element by element
        for (; j < n; j++) {
            const uint8_t *r = (const uint8_t *)fa_row(t, j0 + j, h, b);
            for (int64_t c = 0; c < D; c++) xt[c * W + j] = fa_at(t, r, c);
        }
    for (; j + 8 <= n; j += 8) {
        const float *r = fa_row(t, j0 + j, h, b);
        int64_t c = 0;
        for (; c + 8 <= D; c += 8) transpose8(r + c, ld, xt + c * W + j, W);
        for (; c < D; c++)
            for (int q = 0; q < 8; q++) xt[c * W + j + q] = r[q * ld + c];
    }
    for (; j < n; j++) {
        const float *r = fa_row(t, j0 + j, h, b);
        for (int64_t c = 0; c < D; c++) xt[c * W + j] = r[c];
    }
    for (; j < W; j++)
        for (int64_t c = 0; c < D; c++) xt[c * W + j] = 0.0f;
}

// S[g*W + j] = sum_c x[g][c] * xt[c*W + j] for g < G, j < W: G rows against a transposed tile
template <int G, int W> static inline void fa_scores(int64_t D, const float *const *x, const float *xt, float *S) {
    constexpr int NV = W / VW;
    vf acc[G][NV];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = vf_zero();
    for (int64_t c = 0; c < D; c++) {
        vf t[NV];
        for (int v = 0; v < NV; v++) t[v] = vf_load(xt + c * W + v * VW);
        for (int g = 0; g < G; g++) {
            const vf xc = vf_set1(x[g][c]);
            for (int v = 0; v < NV; v++) acc[g][v] = vf_fma(xc, t[v], acc[g][v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) vf_store(S + g * W + v * VW, acc[g][v]);
}

// Y[g][0..n) += sum_{r < nr} C[g*cs + r*rs] * x[r][0..n) for g < G: each x load feeds G rows
// (rs = 1: C holds a row per output; cs = 1: C is read transposed, a column per output)
template <int G>
static void rows_axpy_g(int64_t n, int64_t nr, const float *C, int64_t cs, int64_t rs, const float *const *x,
                        float *const *Y) {
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        vf a[G][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) a[g][u] = vf_load(Y[g] + i + u * VW);
        for (int64_t r = 0; r < nr; r++) {
            vf xr[4];
            for (int u = 0; u < 4; u++) xr[u] = vf_load(x[r] + i + u * VW);
            for (int g = 0; g < G; g++) {
                const vf c = vf_set1(C[g * cs + r * rs]);
                for (int u = 0; u < 4; u++) a[g][u] = vf_fma(c, xr[u], a[g][u]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) vf_store(Y[g] + i + u * VW, a[g][u]);
    }
    for (; i + VW <= n; i += VW) {
        vf a[G];
        for (int g = 0; g < G; g++) a[g] = vf_load(Y[g] + i);
        for (int64_t r = 0; r < nr; r++) {
            const vf xr = vf_load(x[r] + i);
            for (int g = 0; g < G; g++) a[g] = vf_fma(vf_set1(C[g * cs + r * rs]), xr, a[g]);
        }
        for (int g = 0; g < G; g++) vf_store(Y[g] + i, a[g]);
    }
    for (; i < n; i++)
        for (int g = 0; g < G; g++) {
            float a = Y[g][i];
            for (int64_t r = 0; r < nr; r++) a = std::fma(C[g * cs + r * rs], x[r][i], a);  // as the vector body: the same bits wherever inlined
            Y[g][i] = a;
        }
}

// Rows g < gn of a group are real; the rest point at a dummy (their coefficients are zero),
// so the grouped kernels need no edge cases.
struct fa_group {
    int gn;
    const float *in[FA_G];
    float *out[FA_G];
};

// Whether packed documents keep every query of [i0, i0+nq) from every key of [j0, j0+nk): the
// ranges of their segment ids do not meet (segments are runs, so for neighbouring documents they
// do not; where ids interleave the ranges meet and nothing is skipped). Skipping such a block
// changes no result: each of its scores would be masked.
static bool fa_blocks_apart(const int32_t *sg, int64_t Tk, int64_t b, int64_t off, int64_t i0, int64_t nq, int64_t j0,
                            int64_t nk) {
    if (!sg) return false;
    const int32_t *q = sg + b * Tk + i0 + off, *k = sg + b * Tk + j0;
    int32_t qlo = q[0], qhi = q[0], klo = k[0], khi = k[0];
    for (int64_t i = 1; i < nq; i++) qlo = std::min(qlo, q[i]), qhi = std::max(qhi, q[i]);
    for (int64_t j = 1; j < nk; j++) klo = std::min(klo, k[j]), khi = std::max(khi, k[j]);
    return qhi < klo || khi < qlo;
}

// ---- attention in bf16 (ql_flash_attn_set_prec): AVX512-BF16's pair dots ----
// Each product's inputs rounded to bf16 (q, k, v and P; in backward also dO and dS), products exact
// and summed in f32 (vdpbf16ps: a dword's odd element first, subnormals read as zero), softmax
// and every accumulator f32. Operands are dwords of two bf16 along the summed dimension: a row
// converted as it is where the sum runs along rows (q . k over d), two rows zipped where it runs
// across them (P V over keys). The same tiles and orders as the f32 kernels.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
static constexpr bool k_fa_bf16 = true;

static inline __mmask16 fa_mask(int64_t left) {  // the first `left` lanes (none for left <= 0)
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

// w[0 .. (n+1)/2) = pairs of x[0 .. n): x[2p] low, x[2p+1] high (0 past n)
static void fa_bf_row(int64_t n, const float *x, uint32_t *w) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 lo = _mm512_maskz_loadu_ps(fa_mask(n - i), x + i);
        const __m512 hi = _mm512_maskz_loadu_ps(fa_mask(n - i - 16), x + i + 16);  // a negative count: no lanes
        _mm512_mask_storeu_epi32(w + i / 2, fa_mask((n - i + 1) / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// w[c] = pair (a[c], b[c]) for c < n: two rows zipped (b null: zeros)
static void fa_bf_zip(int64_t n, const float *a, const float *b, uint32_t *w) {
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = fa_mask(n - c);
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + c)));
        const __m512i hi = b ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, b + c)))
                             : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(w + c, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// S[g*64 + j] = sum_p xw[g][p] . tp[p*64 + j]: G rows of pairs against a 64-wide tile of pairs
template <int G> static inline void fa_bf_scores(int64_t np, const uint32_t *const *xw, const uint32_t *tp, float *S) {
    __m512 acc[G][4];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < 4; v++) acc[g][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512bh t[4];
        for (int v = 0; v < 4; v++) t[v] = (__m512bh)_mm512_loadu_si512(tp + p * 64 + 16 * v);
        for (int g = 0; g < G; g++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xw[g][p]);
            for (int v = 0; v < 4; v++) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], x, t[v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(S + g * 64 + 16 * v, acc[g][v]);
}

// Y[g][0..n) += sum_{p < np} C[g*cs + p*rs] . X[p*ldx + 0..n): G rows, pairs of coefficients against
// zipped rows (rs = 1: C holds a row per output; cs = 1: C is read by column)
template <int G>
static void fa_bf_axpy(int64_t n, int64_t np, const uint32_t *C, int64_t cs, int64_t rs, const uint32_t *X, int64_t ldx,
                       float *const *Y) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a[G][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) a[g][u] = _mm512_loadu_ps(Y[g] + i + 16 * u);
        for (int64_t p = 0; p < np; p++) {
            __m512bh x[4];
            for (int u = 0; u < 4; u++) x[u] = (__m512bh)_mm512_loadu_si512(X + p * ldx + i + 16 * u);
            for (int g = 0; g < G; g++) {
                const __m512bh c = (__m512bh)_mm512_set1_epi32((int)C[g * cs + p * rs]);
                for (int u = 0; u < 4; u++) a[g][u] = _mm512_dpbf16_ps(a[g][u], c, x[u]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(Y[g] + i + 16 * u, a[g][u]);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = fa_mask(n - i);
        __m512 a[G];
        for (int g = 0; g < G; g++) a[g] = _mm512_maskz_loadu_ps(m, Y[g] + i);
        for (int64_t p = 0; p < np; p++) {
            const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi32(m, X + p * ldx + i);
            for (int g = 0; g < G; g++) a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_set1_epi32((int)C[g * cs + p * rs]), x);
        }
        for (int g = 0; g < G; g++) _mm512_mask_storeu_ps(Y[g] + i, m, a[g]);
    }
}
#else
static constexpr bool k_fa_bf16 = false;
static void fa_bf_row(int64_t, const float *, uint32_t *) {}
static void fa_bf_zip(int64_t, const float *, const float *, uint32_t *) {}
template <int G> static void fa_bf_scores(int64_t, const uint32_t *const *, const uint32_t *, float *) {}
template <int G>
static void fa_bf_axpy(int64_t, int64_t, const uint32_t *, int64_t, int64_t, const uint32_t *, int64_t, float *const *) {}
#endif

// a tile's K (or V) as pairs along d for scores: tp[p*64 + j] = (t[j][2p], t[j][2p+1]); tmp: d x 64 floats
static void fa_bf_pack_t(const ql_tensor *t, int64_t j0, int64_t n, int64_t h, int64_t b, float *tmp, uint32_t *tp) {
    const int64_t D = t->ne[0];
    fa_pack_t(t, j0, n, h, b, 64, tmp);
    for (int64_t p = 0; 2 * p < D; p++) fa_bf_zip(64, tmp + 2 * p * 64, 2 * p + 1 < D ? tmp + (2 * p + 1) * 64 : nullptr, tp + p * 64);
}

// rows r0 .. r0+n zipped in pairs: z[p*ld + c] = (row 2p, row 2p+1)[c] for c < len (odd n: a zero partner)
static void fa_bf_zip_rows(int64_t len, int64_t n, const float *const *rows, uint32_t *z, int64_t ld) {
    for (int64_t p = 0; 2 * p < n; p++) fa_bf_zip(len, rows[2 * p], 2 * p + 1 < n ? rows[2 * p + 1] : nullptr, z + p * ld);
}

// Y[g] += sum_{j < nj} C[g*FA_BK + j] x[j] for a group's G rows: O += P V and dQ += dS K over a
// key tile. f32: the tile's rows x; bf16: C's rows as pairs (Cw) against the tile's zipped rows XI.
static void fa_rows_by_keys(bool bf, int64_t n, int64_t nj, const float *C, uint32_t *Cw, const uint32_t *XI,
                            const float *const *x, float *const *Y) {
    if (!bf) return rows_axpy_g<FA_G>(n, nj, C, FA_BK, 1, x, Y);
    for (int g = 0; g < FA_G; g++) fa_bf_row(FA_BK, C + g * FA_BK, Cw + g * (FA_BK / 2));
    fa_bf_axpy<FA_G>(n, (nj + 1) / 2, Cw, FA_BK / 2, 1, XI, n, Y);
}

// Y[g] += sum_{i < ni} C[i*FA_BK + g] x[i] for G keys: dV += P^T dO and dK += dS^T Q, the tile read by
// column. f32: the query rows x; bf16: C zipped by query pairs (CI) against the zipped rows XI.
static void fa_keys_by_rows(bool bf, int64_t n, int64_t ni, const float *C, const uint32_t *CI, const uint32_t *XI,
                            const float *const *x, float *const *Y) {
    if (bf) fa_bf_axpy<FA_G>(n, (ni + 1) / 2, CI, 1, FA_BK, XI, n, Y);
    else rows_axpy_g<FA_G>(n, ni, C, 1, FA_BK, x, Y);
}

static bool fa_bf16(const ql_tensor *node) { return k_fa_bf16 && get_param<int32_t>(node, 1) == QL_TYPE_BF16; }

static constexpr int FA_DEC_MAXQ = 4;
static bool fa_decode(const ql_tensor *node) {
    const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
    return node->op == QL_OP_FLASH_ATTN && node->src[4] && !node->src[3] && q->ne[1] <= FA_DEC_MAXQ && q->type == QL_TYPE_F32 &&
           (k->type == QL_TYPE_F32 || k->type == QL_TYPE_F16) && v->type == k->type && !fa_bf16(node);
}
static size_t fa_decode_work(const ql_tensor *node) {  // scores over the whole cache, one output row, an f16 cache's rows widened
    return (size_t)(node->src[1]->ne[1] + 2 * node->src[2]->ne[0] + node->src[0]->ne[0] + 2 * 16) * sizeof(float);
}
static size_t fa_work_f32(const ql_tensor *node) {  // f32 q, k, v: the kernels' layouts
    const ql_tensor *q = node->src[0], *v = node->src[2];
    const size_t D = (size_t)q->ne[0], DV = (size_t)v->ne[0], G = FA_G, MX = std::max(D, DV);
    const size_t D2 = (D + 1) / 2, DV2 = (DV + 1) / 2;  // bf16 pairs (4 bytes) after the f32 layouts
    const bool bf = fa_bf16(node);
    if (node->op == QL_OP_FLASH_ATTN)  // KT, S, O, m, l, a dummy row; bf16: KTP, VI, Qw, Pw
        return (D * FA_BK + G * FA_BK + FA_BQ * DV + 2 * FA_BQ + MX +
                (bf ? D2 * FA_BK + FA_BK / 2 * DV + FA_BQ * D2 + G * FA_BK / 2 : 0)) * sizeof(float);
    const size_t a = D * FA_BK + DV * FA_BK + 2 * G * FA_BK + FA_BQ * D + 2 * FA_BQ + MX;
    const size_t b = D * FA_BQ + DV * FA_BQ + 2 * FA_BQ + 2 * G * FA_BQ + FA_BK * (D + DV) + MX;
    const size_t c = (size_t)(q->ne[1] * (q->ne[2] / node->src[1]->ne[2])) + (D + DV) * FA_BK + 2 * FA_BQ * FA_BK +
                     MX;  // the fused pass: rowsum(dO o O) of a head group first
    if (!bf) return std::max({a, b, c}) * sizeof(float);
    return (c + (D2 + DV2) * FA_BK + FA_BK / 2 * D + FA_BQ * (D2 + DV2) + FA_BQ / 2 * (D + DV) + G * FA_BK / 2 +
            FA_BQ * FA_BK) * sizeof(float);
}
// 16-bit q, k, v: after that layout, f32 copies of a block of queries, a tile of keys and of
// values, and one output row [FA_BQ D + FA_BK (D + DV) + DV] (fa_x16); backward's 16-bit dO: a
// block of its rows [FA_BQ DV]
static size_t fa_work(const ql_tensor *node) {
    if (fa_decode(node)) return std::max(fa_work_f32(node), fa_decode_work(node));
    const ql_tensor *q = node->src[0], *v = node->src[2];
    const size_t D = (size_t)q->ne[0], DV = (size_t)v->ne[0];
    const bool do16 = node->op == QL_OP_FLASH_ATTN_BACK && node->src[5]->type != QL_TYPE_F32;
    const bool x16 = do16 || q->type != QL_TYPE_F32 || node->src[1]->type != QL_TYPE_F32 || v->type != QL_TYPE_F32;  // (an f16 cache)
    return fa_work_f32(node) + (x16 ? (FA_BQ * D + FA_BK * (D + DV) + DV + (do16 ? FA_BQ * DV : 0)) * sizeof(float) : 0);
}
struct fa_x16 {  // fa_work's 16-bit part
    float *q, *k, *v, *o, *dO;
    fa_x16(const cpu_params &p, const ql_tensor *node) {
        q = (float *)((uint8_t *)p.wdata + fa_work_f32(node));
        k = q + FA_BQ * node->src[0]->ne[0];
        v = k + FA_BK * node->src[0]->ne[0];
        o = v + FA_BK * node->src[2]->ne[0];
        dO = o + node->src[2]->ne[0];
    }
};

// Decode over a KV cache (a few f32 queries): per query row its scores against the cache's key rows
// as they lie, one softmax, then the value rows summed. The tiled path below computes FA_G score
// rows a tile (FA_G - 1 of them copies for one query) and transposes every key tile for every head:
// with 534 cached keys a 110M model's decoded token spent 14 of its 26 ms in it. Not the tiled
// path's bits (its softmax runs tile by tile): equal to rounding.
// a cached row's vector c: f32, or (an f16 cache) widened as loaded
template <bool H> static inline vf fa_dec_ld(const float *r, int c) {
    return H ? vf_load_h((const uint16_t *)r + c * VW) : vf_load(r + c * VW);
}
// a row of ND vectors dotted with a cached one, one chain (keys in flight overlap); 0 < ND
template <int ND, bool H> static inline float fa_dec_dot(const float *q, const float *k) {
    vf a = vf_mul(vf_load(q), fa_dec_ld<H>(k, 0));
    for (int c = 1; c < ND; c++) a = vf_fma(vf_load(q + c * VW), fa_dec_ld<H>(k, c), a);
    return vf_hsum(a);
}
// o = sum_j p[j] v_j over the cached value rows, the NV vectors of o held in registers
// a cached row as f32: itself, or (an f16 cache) widened into buf
static inline const float *fa_dec_row(const ql_tensor *t, int64_t j, int64_t hk, int64_t b, float *buf) {
    const float *r = fa_row(t, j, hk, b);
    if (t->type == QL_TYPE_F32) return r;
    traits(t->type).to_float((const uint8_t *)r, buf, t->ne[0]);
    return buf;
}
template <int NV, bool H> static inline void fa_dec_pv(int64_t jl, const float *p, const ql_tensor *v, int64_t hk, int64_t b, float *o) {
    vf acc[NV];
    for (int c = 0; c < NV; c++) acc[c] = vf_zero();
    for (int64_t j = 0; j < jl; j++) {
        const vf pj = vf_set1(p[j]);
        const float *vr = fa_row(v, j, hk, b);
        for (int c = 0; c < NV; c++) acc[c] = vf_fma(pj, fa_dec_ld<H>(vr, c), acc[c]);
    }
    for (int c = 0; c < NV; c++) vf_store(o + c * VW, acc[c]);
}
static void fa_decode_run(const cpu_params &p, ql_tensor *dst, int64_t Tk) {
    const ql_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const float scale = get_param<float>(dst, 0);
    const int64_t D = q->ne[0], Tq = q->ne[1], H = q->ne[2], B = q->ne[3], DV = v->ne[0], off = Tk - Tq, rep = H / k->ne[2];
    float *s = (float *)p.wdata, *o = s + k->ne[1], *lse = (float *)ql_aux_data(dst);
    float *kb = (float *)(((uintptr_t)(o + DV) + 63) / 64 * 64), *vb = kb + D;  // (an f16 cache: a row widened)
    const int64_t nd = D % VW ? 0 : D / VW, nv = DV % VW ? 0 : DV / VW, h16 = k->type == QL_TYPE_F16;
    for (int64_t it = p.ith; it < B * H * Tq; it += p.nth) {
        const int64_t i = it % Tq, h = (it / Tq) % H, b = it / (Tq * H), hk = h / rep, jl = std::min(Tk, i + off + 1);
        const float *qr = fa_row(q, i, h, b);
        switch (nd * 2 + h16) {  // causal: j <= i + off
#define QL_FA_DOTS(N, H) case N * 2 + H: for (int64_t j = 0; j < jl; j++) s[j] = fa_dec_dot<N, H>(qr, fa_row(k, j, hk, b)) * scale; break;
        QL_FA_DOTS(1, 0) QL_FA_DOTS(2, 0) QL_FA_DOTS(4, 0) QL_FA_DOTS(8, 0) QL_FA_DOTS(16, 0)
        QL_FA_DOTS(1, 1) QL_FA_DOTS(2, 1) QL_FA_DOTS(4, 1) QL_FA_DOTS(8, 1) QL_FA_DOTS(16, 1)
#undef QL_FA_DOTS
        default:
            for (int64_t j = 0; j < jl; j++) s[j] = row_dot(D, qr, fa_dec_row(k, j, hk, b, kb)) * scale;
        }
        const float mx = row_max(jl, s), l = row_exp_sum(jl, s, mx, s);
        switch (nv * 2 + h16) {
#define QL_FA_PV(N, H) case N * 2 + H: fa_dec_pv<N, H>(jl, s, v, hk, b, o); break;
        QL_FA_PV(1, 0) QL_FA_PV(2, 0) QL_FA_PV(4, 0) QL_FA_PV(8, 0) QL_FA_PV(1, 1) QL_FA_PV(2, 1) QL_FA_PV(4, 1) QL_FA_PV(8, 1)
#undef QL_FA_PV
        default:
            std::fill(o, o + DV, 0.0f);
            for (int64_t j = 0; j < jl; j++) row_axpy(DV, s[j], fa_dec_row(v, j, hk, b, vb), o);
        }
        const int64_t at = ((b * Tq + i) * H + h) * DV;
        if (dst->type == QL_TYPE_F32) {
            row_scale(DV, 1.0f / l, o, (float *)dst->data + at);
        } else {
            row_scale(DV, 1.0f / l, o, o);
            traits(dst->type).from_float(o, (uint8_t *)dst->data + at * 2, DV);
        }
        lse[(b * H + h) * Tq + i] = mx + std::log(l);
    }
}

static void k_flash_attn(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *seg = dst->src[3], *nkv = dst->src[4];
    const float scale = get_param<float>(dst, 0);
    const int64_t D = q->ne[0], Tq = q->ne[1], H = q->ne[2], B = q->ne[3], DV = v->ne[0];
    int64_t Tk = k->ne[1];
    if (nkv) {  // a KV cache: only its first n_kv keys are written
        const int64_t n = *(const int32_t *)nkv->data;
        if (n < Tq || n > Tk) {
            if (p.ith == 0)
                cpu_fail(p, "flash_attn: n_kv %lld outside [%lld, %lld] (queries, cache length)", (long long)n, (long long)Tq,
                         (long long)Tk);
            return;
        }
        Tk = n;
        if (fa_decode(dst)) return fa_decode_run(p, dst, Tk);
    }
    const int64_t off = Tk - Tq, rep = H / k->ne[2], nqb = (Tq + FA_BQ - 1) / FA_BQ;
    const int32_t *sg = seg ? (const int32_t *)seg->data : nullptr;
    float *lse = (float *)ql_aux_data(dst);
    float *KT = (float *)p.wdata, *S = KT + D * FA_BK, *O = S + FA_G * FA_BK, *m = O + FA_BQ * DV, *l = m + FA_BQ;
    float *dummy = l + FA_BQ;
    const bool bf = fa_bf16(dst);
    const int64_t D2 = (D + 1) / 2;  // bf16: pairs (fa_work's layout)
    uint32_t *KTP = (uint32_t *)(dummy + std::max(D, DV)), *VI = KTP + D2 * FA_BK, *Qw = VI + FA_BK / 2 * DV, *Pw = Qw + FA_BQ * D2;
    const fa_x16 x16(p, dst);  // (16-bit q, k, v)
    for (int64_t it = p.ith; it < B * H * nqb; it += p.nth) {
        const int64_t qb = it % nqb, h = (it / nqb) % H, b = it / (nqb * H), hk = h / rep;
        const int64_t i0 = qb * FA_BQ, nq = std::min<int64_t>(FA_BQ, Tq - i0);
        std::fill(O, O + nq * DV, 0.0f);
        std::fill(m, m + nq, -INFINITY);
        std::fill(l, l + nq, 0.0f);
        const float *qrows[FA_BQ];
        fa_rows(q, i0, nq, h, b, x16.q, qrows);
        if (bf)
            for (int64_t ii = 0; ii < nq; ii++) fa_bf_row(D, qrows[ii], Qw + ii * D2);
        const int64_t jend = std::min(Tk, i0 + nq + off);  // keys any query of the block may see
        for (int64_t j0 = 0; j0 < jend; j0 += FA_BK) {
            const int64_t bk = std::min<int64_t>(FA_BK, jend - j0);
            if (fa_blocks_apart(sg, Tk, b, off, i0, nq, j0, bk)) continue;  // another document's keys
            const float *vrows[FA_BK];
            fa_rows(v, j0, bk, hk, b, x16.v, vrows);
            if (bf) {
                fa_bf_pack_t(k, j0, bk, hk, b, KT, KTP);
                fa_bf_zip_rows(DV, bk, vrows, VI, DV);
            } else {
                fa_pack_t(k, j0, bk, hk, b, FA_BK, KT);
            }
            for (int64_t g0 = 0; g0 < nq; g0 += FA_G) {
                fa_group grp;
                grp.gn = (int)std::min<int64_t>(FA_G, nq - g0);
                for (int g = 0; g < FA_G; g++) {
                    grp.in[g]  = qrows[g0 + std::min(g, grp.gn - 1)];
                    grp.out[g] = g < grp.gn ? O + (g0 + g) * DV : dummy;
                }
                if (bf) {
                    const uint32_t *qw[FA_G];
                    for (int g = 0; g < FA_G; g++) qw[g] = Qw + (g0 + std::min(g, grp.gn - 1)) * D2;
                    fa_bf_scores<FA_G>(D2, qw, KTP, S);
                } else {
                    fa_scores<FA_G, FA_BK>(D, grp.in, KT, S);
                }
                int64_t jmax = 0;
                for (int g = 0; g < FA_G; g++) {
                    float *s = S + g * FA_BK;
                    const int64_t ii = g0 + g, i = i0 + ii, jl = g < grp.gn ? std::min(bk, i + off + 1 - j0) : 0;
                    row_scale(std::max<int64_t>(jl, 0), scale, s, s);  // causal: j <= i + off
                    for (int64_t j = 0; sg && j < jl; j++)  // documents: the same segment
                        if (sg[b * Tk + j0 + j] != sg[b * Tk + i + off]) s[j] = -INFINITY;
                    const float mx = jl > 0 ? row_max(jl, s) : -INFINITY;
                    if (mx == -INFINITY) {
                        std::fill(s, s + FA_BK, 0.0f);
                        continue;
                    }
                    const float mnew = std::max(m[ii], mx), alpha = exp1(m[ii] - mnew);
                    l[ii] = l[ii] * alpha + row_exp_sum(jl, s, mnew, s);  // s = P
                    std::fill(s + jl, s + FA_BK, 0.0f);
                    if (alpha != 1.0f) row_scale(DV, alpha, grp.out[g], grp.out[g]);
                    m[ii] = mnew;
                    jmax = std::max(jmax, jl);
                }
                fa_rows_by_keys(bf, DV, jmax, S, Pw, VI, vrows, grp.out);  // O += P V
            }
        }
        for (int64_t ii = 0; ii < nq; ii++) {
            const int64_t i = i0 + ii, at = ((b * Tq + i) * H + h) * DV;
            if (dst->type == QL_TYPE_F32) {
                row_scale(DV, 1.0f / l[ii], O + ii * DV, (float *)dst->data + at);
            } else {  // a 16-bit output: the f32 row rounded once
                row_scale(DV, 1.0f / l[ii], O + ii * DV, O + ii * DV);
                traits(dst->type).from_float(O + ii * DV, (uint8_t *)dst->data + at * 2, DV);
            }
            lse[(b * H + h) * Tq + i] = m[ii] + std::log(l[ii]);
        }
    }
}

// The backward's two ways give the same bits: the fused pass (an item per kv head: S and dP once
// a tile, 5 products) and the two passes (dq by query blocks, dk/dv by key blocks: 7 products,
// finer items). Fused unless its coarser items would leave threads idle for longer than the two
// products it saves (B * Hkv items, each 5/7 of the two passes' work for that head group).
static bool fa_back_fused(int64_t items, int nth) { return (items + nth - 1) / nth * 5 * nth <= 7 * items; }

static void k_flash_attn_back(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *seg = dst->src[3];
    const ql_tensor *fwd = dst->src[4], *dO = dst->src[5];
    const float scale = get_param<float>(dst, 0);
    const int64_t D = q->ne[0], Tq = q->ne[1], H = q->ne[2], B = q->ne[3], Tk = k->ne[1], Hkv = k->ne[2], DV = v->ne[0];
    const int64_t off = Tk - Tq, rep = H / Hkv, nqb = (Tq + FA_BQ - 1) / FA_BQ, nkb = (Tk + FA_BK - 1) / FA_BK;
    const int32_t *sg = seg ? (const int32_t *)seg->data : nullptr;
    const float *lse = (const float *)ql_aux_data(fwd);
    float *dq = (float *)dst->data, *dk = dq + ql_nelements(q), *dv = dk + ql_nelements(k);
    const fa_x16 x16(p, dst);  // (16-bit q, k, v and output)
    auto o_row = [&](int64_t i, int64_t h, int64_t b) {  // the forward's output row, f32 (16-bit: widened into x16.o)
        const int64_t at = ((b * Tq + i) * H + h) * DV;
        if (fwd->type == QL_TYPE_F32) return (const float *)fwd->data + at;
        traits(fwd->type).to_float((const uint8_t *)fwd->data + at * 2, x16.o, DV);
        return (const float *)x16.o;
    };
    // dO [DV, H, Tq, B]: rows [i0, i0 + n) of head h, f32 (16-bit: widened into x16.dO [n][DV])
    auto do_rows = [&](int64_t i0, int64_t n, int64_t h, int64_t b, const float **rows) {
        for (int64_t j = 0; j < n; j++) {
            rows[j] = fa_row(dO, h, i0 + j, b);
            if (dO->type == QL_TYPE_F32) continue;
            traits(dO->type).to_float((const uint8_t *)rows[j], x16.dO + j * DV, DV);
            rows[j] = x16.dO + j * DV;
        }
    };
    auto masked = [&](int64_t i, int64_t j, int64_t b) {
        return j > i + off || (sg && sg[b * Tk + j] != sg[b * Tk + i + off]);
    };
    const bool bf = fa_bf16(dst);
    if (bf || fa_back_fused(B * Hkv, p.nth)) {  // FlashAttention-2's single pass: 5 products a tile (bf16: always)
        float *DdAll = (float *)p.wdata;  // [Tq, rep] rowsum(dO o O) of the item's query heads
        float *KT = DdAll + rep * Tq, *VT = KT + D * FA_BK, *P = VT + DV * FA_BK, *DS = P + FA_BQ * FA_BK;  // P, dS [FA_BQ][FA_BK]
        float *dummy = DS + FA_BQ * FA_BK;
        const int64_t D2 = (D + 1) / 2, DV2 = (DV + 1) / 2;  // bf16: pairs along d for scores, zipped rows for sums
        uint32_t *KTP = (uint32_t *)(dummy + std::max(D, DV)), *VTP = KTP + D2 * FA_BK, *KI = VTP + DV2 * FA_BK;
        uint32_t *Qw = KI + FA_BK / 2 * D, *dOw = Qw + FA_BQ * D2, *QI = dOw + FA_BQ * DV2, *dOI = QI + FA_BQ / 2 * D;
        uint32_t *dSw = dOI + FA_BQ / 2 * DV, *PI = dSw + FA_G * FA_BK / 2, *DSI = PI + FA_BQ / 2 * FA_BK;
        for (int64_t it = p.ith; it < B * Hkv; it += p.nth) {  // a kv head, its query heads, every key and query
            const int64_t hk = it % Hkv, b = it / Hkv;
            float *dkb = dk + (b * Hkv + hk) * Tk * D, *dvb = dv + (b * Hkv + hk) * Tk * DV;
            float *dqb = dq + (b * H + hk * rep) * Tq * D;  // [D, Tq, rep]: this item's query heads
            std::fill(dkb, dkb + Tk * D, 0.0f);
            std::fill(dvb, dvb + Tk * DV, 0.0f);
            std::fill(dqb, dqb + rep * Tq * D, 0.0f);
            for (int64_t h = hk * rep; h < (hk + 1) * rep; h++)
                for (int64_t i = 0; i < Tq; i++) {
                    const float *r;
                    do_rows(i, 1, h, b, &r);
                    DdAll[(h - hk * rep) * Tq + i] = row_dot(DV, r, o_row(i, h, b));
                }
            for (int64_t j0 = 0; j0 < Tk; j0 += FA_BK) {  // keys outermost: dq sums over them in the order of the dq pass
                const int64_t nk = std::min<int64_t>(FA_BK, Tk - j0);
                const float *krows[FA_BK];
                fa_rows(k, j0, nk, hk, b, x16.k, krows);
                if (bf) {
                    fa_bf_pack_t(k, j0, nk, hk, b, KT, KTP);
                    fa_bf_pack_t(v, j0, nk, hk, b, VT, VTP);
                    fa_bf_zip_rows(D, nk, krows, KI, D);
                } else {
                    fa_pack_t(k, j0, nk, hk, b, FA_BK, KT);
                    fa_pack_t(v, j0, nk, hk, b, FA_BK, VT);
                }
                for (int64_t h = hk * rep; h < (hk + 1) * rep; h++) {
                    for (int64_t i0 = std::max<int64_t>(0, j0 - off) / FA_BQ * FA_BQ; i0 < Tq; i0 += FA_BQ) {
                        const int64_t nq = std::min<int64_t>(FA_BQ, Tq - i0);
                        if (fa_blocks_apart(sg, Tk, b, off, i0, nq, j0, nk)) continue;
                        const float *qrows[FA_BQ], *orows[FA_BQ];
                        const float *L = lse + (b * H + h) * Tq + i0, *Dd = DdAll + (h - hk * rep) * Tq + i0;
                        fa_rows(q, i0, nq, h, b, x16.q, qrows);
                        do_rows(i0, nq, h, b, orows);
                        for (int64_t ii = 0; ii < nq; ii++) {
                            if (bf) {
                                fa_bf_row(D, qrows[ii], Qw + ii * D2);
                                fa_bf_row(DV, orows[ii], dOw + ii * DV2);
                            }
                        }
                        if (bf) {
                            fa_bf_zip_rows(D, nq, qrows, QI, D);
                            fa_bf_zip_rows(DV, nq, orows, dOI, DV);
                        }
                        for (int64_t g0 = 0; g0 < nq; g0 += FA_G) {  // S = Q K^T, dP = dO V^T -> P, dS; dQ += dS K
                            fa_group gq, gdo;
                            gq.gn = gdo.gn = (int)std::min<int64_t>(FA_G, nq - g0);
                            for (int g = 0; g < FA_G; g++) {
                                const int64_t ii = g0 + std::min(g, gq.gn - 1);
                                gq.in[g]  = qrows[ii];
                                gdo.in[g] = orows[ii];
                                gq.out[g] = g < gq.gn ? dqb + ((h - hk * rep) * Tq + i0 + g0 + g) * D : dummy;
                            }
                            float *S = P + g0 * FA_BK, *DP = DS + g0 * FA_BK;
                            if (bf) {
                                const uint32_t *qw[FA_G], *ow[FA_G];
                                for (int g = 0; g < FA_G; g++) {
                                    const int64_t ii = g0 + std::min(g, gq.gn - 1);
                                    qw[g] = Qw + ii * D2;
                                    ow[g] = dOw + ii * DV2;
                                }
                                fa_bf_scores<FA_G>(D2, qw, KTP, S);
                                fa_bf_scores<FA_G>(DV2, ow, VTP, DP);
                            } else {
                                fa_scores<FA_G, FA_BK>(D, gq.in, KT, S);
                                fa_scores<FA_G, FA_BK>(DV, gdo.in, VT, DP);
                            }
                            int64_t jmax = 0;
                            for (int g = 0; g < FA_G; g++) {
                                float *s = S + g * FA_BK, *dp = DP + g * FA_BK;
                                const int64_t ii = g0 + g, i = i0 + ii;
                                const int64_t jl = g < gq.gn ? std::max<int64_t>(0, std::min(nk, i + off + 1 - j0)) : 0;
                                row_mul_sub(jl, s, scale, L + ii, 0);
                                if (jl > 0) row_exp_sum(jl, s, 0.0f, s);  // P, from the saved logsumexp
                                row_dsoft(jl, s, dp, dp, scale, Dd + ii, 0);  // scale dS, dS = P (dP - rowsum(dO o O))
                                for (int64_t j = 0; sg && j < jl; j++)
                                    if (masked(i, j0 + j, b)) s[j] = dp[j] = 0.0f;
                                std::fill(s + jl, s + FA_BK, 0.0f);
                                std::fill(dp + jl, dp + FA_BK, 0.0f);
                                jmax = std::max(jmax, jl);
                            }
                            fa_rows_by_keys(bf, D, jmax, DP, dSw, KI, krows, gq.out);  // dQ += dS K
                        }
                        if (bf) {  // P and dS zipped by query pairs, for the sums over queries
                            const float *pr[FA_BQ], *sr[FA_BQ];
                            for (int64_t ii = 0; ii < nq; ii++) pr[ii] = P + ii * FA_BK, sr[ii] = DS + ii * FA_BK;
                            fa_bf_zip_rows(FA_BK, nq, pr, PI, FA_BK);
                            fa_bf_zip_rows(FA_BK, nq, sr, DSI, FA_BK);
                        }
                        for (int64_t g0 = 0; g0 < nk; g0 += FA_G) {  // dV += P^T dO, dK += dS^T Q: P, dS read by column
                            float *ok[FA_G], *ov[FA_G];
                            for (int g = 0; g < FA_G; g++) {
                                ok[g] = g0 + g < nk ? dkb + (j0 + g0 + g) * D : dummy;
                                ov[g] = g0 + g < nk ? dvb + (j0 + g0 + g) * DV : dummy;
                            }
                            fa_keys_by_rows(bf, DV, nq, P + g0, PI + g0, dOI, orows, ov);
                            fa_keys_by_rows(bf, D, nq, DS + g0, DSI + g0, QI, qrows, ok);
                        }
                    }
                }
            }
        }
        return;
    }
    const int64_t itemsA = B * H * nqb, itemsB = B * Hkv * nkb;
    for (int64_t it = p.ith; it < itemsA + itemsB; it += p.nth) {
        float *w = (float *)p.wdata;
        if (it < itemsA) {  // dq for a block of queries of one head: dQ = scale dS K
            const int64_t qb = it % nqb, h = (it / nqb) % H, b = it / (nqb * H), hk = h / rep;
            const int64_t i0 = qb * FA_BQ, nq = std::min<int64_t>(FA_BQ, Tq - i0);
            float *KT = w, *VT = KT + D * FA_BK, *S = VT + DV * FA_BK, *DP = S + FA_G * FA_BK;
            float *acc = DP + FA_G * FA_BK, *Dd = acc + FA_BQ * D, *L = Dd + FA_BQ, *dummy = L + FA_BQ;
            std::fill(acc, acc + nq * D, 0.0f);
            const float *dorows[FA_BQ];
            do_rows(i0, nq, h, b, dorows);
            for (int64_t ii = 0; ii < nq; ii++) {
                Dd[ii] = row_dot(DV, dorows[ii], o_row(i0 + ii, h, b));  // rowsum(dO o O)
                L[ii] = lse[(b * H + h) * Tq + i0 + ii];
            }
            const float *qblk[FA_BQ];
            fa_rows(q, i0, nq, h, b, x16.q, qblk);
            const int64_t jend = std::min(Tk, i0 + nq + off);
            for (int64_t j0 = 0; j0 < jend; j0 += FA_BK) {
                const int64_t bk = std::min<int64_t>(FA_BK, jend - j0);
                if (fa_blocks_apart(sg, Tk, b, off, i0, nq, j0, bk)) continue;
                fa_pack_t(k, j0, bk, hk, b, FA_BK, KT);
                fa_pack_t(v, j0, bk, hk, b, FA_BK, VT);
                const float *krows[FA_BK];
                fa_rows(k, j0, bk, hk, b, x16.k, krows);
                for (int64_t g0 = 0; g0 < nq; g0 += FA_G) {
                    fa_group gq, gdo;  // queries and their dO rows
                    gq.gn = gdo.gn = (int)std::min<int64_t>(FA_G, nq - g0);
                    for (int g = 0; g < FA_G; g++) {
                        const int64_t ii = g0 + std::min(g, gq.gn - 1);
                        gq.in[g]  = qblk[ii];
                        gdo.in[g] = dorows[ii];
                        gq.out[g] = g < gq.gn ? acc + (g0 + g) * D : dummy;
                    }
                    fa_scores<FA_G, FA_BK>(D, gq.in, KT, S);
                    fa_scores<FA_G, FA_BK>(DV, gdo.in, VT, DP);
                    int64_t jmax = 0;
                    for (int g = 0; g < FA_G; g++) {
                        float *s = S + g * FA_BK;
                        const int64_t ii = g0 + g, i = i0 + ii, jl = g < gq.gn ? std::min(bk, i + off + 1 - j0) : 0;
                        row_mul_sub(std::max<int64_t>(jl, 0), s, scale, L + ii, 0);
                        if (jl > 0) row_exp_sum(jl, s, 0.0f, s);
                        row_dsoft(std::max<int64_t>(jl, 0), s, DP + g * FA_BK, s, scale, Dd + ii, 0);
                        for (int64_t j = 0; sg && j < jl; j++)
                            if (masked(i, j0 + j, b)) s[j] = 0.0f;
                        std::fill(s + std::max<int64_t>(jl, 0), s + FA_BK, 0.0f);
                        jmax = std::max(jmax, jl);
                    }
                    rows_axpy_g<FA_G>(D, jmax, S, FA_BK, 1, krows, gq.out);
                }
            }
            for (int64_t ii = 0; ii < nq; ii++) memcpy(dq + ((b * H + h) * Tq + i0 + ii) * D, acc + ii * D, (size_t)D * 4);
        } else {  // dk, dv for a block of keys of one kv head, over all its query heads
            const int64_t jt = it - itemsA, kb = jt % nkb, hk = (jt / nkb) % Hkv, b = jt / (nkb * Hkv);
            const int64_t j0 = kb * FA_BK, nk = std::min<int64_t>(FA_BK, Tk - j0);
            float *QT = w, *OT = QT + D * FA_BQ, *L = OT + DV * FA_BQ, *Dd = L + FA_BQ, *S = Dd + FA_BQ;
            float *DS = S + FA_G * FA_BQ, *ak = DS + FA_G * FA_BQ, *av = ak + FA_BK * D, *dummy = av + FA_BK * DV;
            std::fill(ak, ak + nk * D, 0.0f);
            std::fill(av, av + nk * DV, 0.0f);
            const float *kblk[FA_BK], *vblk[FA_BK];
            fa_rows(k, j0, nk, hk, b, x16.k, kblk);
            fa_rows(v, j0, nk, hk, b, x16.v, vblk);
            for (int64_t h = hk * rep; h < (hk + 1) * rep; h++) {
                for (int64_t i0 = std::max<int64_t>(0, j0 - off) / FA_BQ * FA_BQ; i0 < Tq; i0 += FA_BQ) {
                    const int64_t nq = std::min<int64_t>(FA_BQ, Tq - i0);
                    if (fa_blocks_apart(sg, Tk, b, off, i0, nq, j0, nk)) continue;
                    fa_pack_t(q, i0, nq, h, b, FA_BQ, QT);
                    const float *qrows[FA_BQ], *orows[FA_BQ];
                    fa_rows(q, i0, nq, h, b, x16.q, qrows);
                    do_rows(i0, nq, h, b, orows);
                    for (int64_t ii = 0; ii < nq; ii++) {  // dO^T, and per query L and D
                        for (int64_t c = 0; c < DV; c++) OT[c * FA_BQ + ii] = orows[ii][c];
                        L[ii] = lse[(b * H + h) * Tq + i0 + ii];
                        Dd[ii] = row_dot(DV, orows[ii], o_row(i0 + ii, h, b));
                    }
                    for (int64_t ii = nq; ii < FA_BQ; ii++)
                        for (int64_t c = 0; c < DV; c++) OT[c * FA_BQ + ii] = 0.0f;
                    for (int64_t g0 = 0; g0 < nk; g0 += FA_G) {
                        fa_group gk, gv;  // keys (-> dk rows) and their values (-> dv rows)
                        gk.gn = gv.gn = (int)std::min<int64_t>(FA_G, nk - g0);
                        for (int g = 0; g < FA_G; g++) {
                            const int64_t jj = g0 + std::min(g, gk.gn - 1);
                            gk.in[g]  = kblk[jj];
                            gv.in[g]  = vblk[jj];
                            gk.out[g] = g < gk.gn ? ak + (g0 + g) * D : dummy;
                            gv.out[g] = g < gv.gn ? av + (g0 + g) * DV : dummy;
                        }
                        fa_scores<FA_G, FA_BQ>(D, gk.in, QT, S);
                        fa_scores<FA_G, FA_BQ>(DV, gv.in, OT, DS);
                        for (int g = 0; g < FA_G; g++) {
                            float *s = S + g * FA_BQ, *ds = DS + g * FA_BQ;
                            if (g >= gk.gn) {
                                std::fill(s, s + FA_BQ, 0.0f);
                                std::fill(ds, ds + FA_BQ, 0.0f);
                                continue;
                            }
                            const int64_t j = j0 + g0 + g;
                            row_mul_sub(nq, s, scale, L, 1);
                            row_exp_sum(nq, s, 0.0f, s);
                            for (int64_t ii = 0; ii < nq; ii++)
                                if (masked(i0 + ii, j, b)) s[ii] = 0.0f;
                            row_dsoft(nq, s, ds, ds, scale, Dd, 1);
                            std::fill(s + nq, s + FA_BQ, 0.0f);
                            std::fill(ds + nq, ds + FA_BQ, 0.0f);
                        }
                        rows_axpy_g<FA_G>(DV, nq, S, FA_BQ, 1, orows, gv.out);  // dV += P^T dO
                        rows_axpy_g<FA_G>(D, nq, DS, FA_BQ, 1, qrows, gk.out);  // dK += dS^T Q
                    }
                }
            }
            for (int64_t jj = 0; jj < nk; jj++) {
                memcpy(dk + ((b * Hkv + hk) * Tk + j0 + jj) * D, ak + jj * D, (size_t)D * 4);
                memcpy(dv + ((b * Hkv + hk) * Tk + j0 + jj) * DV, av + jj * DV, (size_t)DV * 4);
            }
        }
    }
}

// ---- cross entropy ----

static void k_cross_entropy(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *lg = dst->src[0], *tg = dst->src[1], *cnt = dst->src[2];
    const int64_t V = lg->ne[0], N = ql_nrows(lg);
    float *lse = (float *)ql_aux_data(dst), *loss = lse + N;
    const int32_t *t = (const int32_t *)tg->data;
    if (p.pass == 0) {
        int64_t b, e;
        split_range(N, p.ith, p.nth, b, e);
        for (int64_t r = b; r < e; r++) {
            lse[r] = loss[r] = 0.0f;
            if (t[r] < 0) continue;
            if (t[r] >= V) {
                cpu_fail(p, "cross_entropy: target %d at row %lld is outside the vocabulary of %lld", t[r], (long long)r,
                         (long long)V);
                return;
            }
            const float *x = f32_row(lg, r);
            const float m = row_max(V, x);
            const vf vm = vf_set1(m);
            vf acc = vf_zero();
            int64_t i = 0;
            for (; i + VW <= V; i += VW) acc = vf_add(acc, vf_exp(vf_sub(vf_load(x + i), vm)));
            float sum = vf_hsum(acc);
            for (; i < V; i++) sum += exp1(x[i] - m);
            lse[r]  = m + std::log(sum);
            loss[r] = lse[r] - x[t[r]];
        }
        return;
    }
    if (p.ith != 0) return;
    const float c = *(const float *)cnt->data;
    if (!(c > 0.0f)) {
        cpu_fail(p, "cross_entropy: token count %g must be positive", (double)c);
        return;
    }
    double s = 0;  // one thread, row order: the same loss for any thread count
    for (int64_t r = 0; r < N; r++) s += loss[r];
    *(float *)dst->data = (float)(s / c);
}

static void k_cross_entropy_back(const cpu_params &p, ql_tensor *dst) {
    const ql_tensor *lg = dst->src[0], *tg = dst->src[1], *cnt = dst->src[2], *fwd = dst->src[3], *dy = dst->src[4];
    const int64_t V = lg->ne[0], N = ql_nrows(lg);
    const float *lse = (const float *)ql_aux_data(fwd);
    const int32_t *t = (const int32_t *)tg->data;
    const float scale = *(const float *)dy->data / *(const float *)cnt->data;
    const ql_type_traits &tt = traits(dst->type);  // a 16-bit result: the f32 row in the workspace, rounded once as stored
    int64_t b, e;
    split_range(N, p.ith, p.nth, b, e);
    for (int64_t r = b; r < e; r++) {
        float *d = dst->type == QL_TYPE_F32 ? (float *)dst->data + r * V : (float *)p.wdata;
        if (t[r] < 0 || t[r] >= V) {
            std::fill(d, d + V, 0.0f);
        } else {
            const float *x = f32_row(lg, r);
            row_exp_sum(V, x, lse[r], d);  // softmax
            row_scale(V, scale, d, d);
            d[t[r]] -= scale;
        }
        if (dst->type != QL_TYPE_F32) tt.from_float(d, (uint8_t *)dst->data + (size_t)(r * V) * tt.type_size, V);
    }
}

// ---- matrix multiply ----
// C(i, j) = sum_k X(i, k) W(k, j): i runs over b's columns (tokens), j over a's (outputs).
// Large N: BLIS-style. W is packed in [KC x NR] panels (dequantised/converted while packing,
// so a low-precision weight is never materialised in f32 beyond one panel), X in [KC x mr]
// panels, and an MR x NR register-tile kernel accumulates over KC. Small N (a few tokens):
// packing W would cost more than the multiply, so each W row is dotted with the few X rows
// directly. Every C element is summed in the same k order whatever the thread split, so the
// result does not depend on the number of threads.

#if defined(__AVX512F__)
static constexpr int MM_MR = 12, MM_NV = 2;  // 24 accumulators of the 32 zmm
#elif defined(__AVX2__) && defined(__FMA__)
static constexpr int MM_MR = 6, MM_NV = 2;   // 12 accumulators of the 16 ymm
#else
static constexpr int MM_MR = 4, MM_NV = 2;
#endif
static constexpr int MM_NR = MM_NV * VW;
static constexpr int MM_KC = 256;            // a multiple of every block size (k-quants: 256)
static constexpr int MM_MC = 96;             // rows of X per packed block (a multiple of MR)
static constexpr int MM_NC = 1024;           // columns of W per packed block (a multiple of NR)
static constexpr int MM_DOT_MAX_N = 64;      // N at or below: dot path (measured crossover, 2 threads AVX-512)
static_assert(MM_MC % MM_MR == 0 && MM_NC % MM_NR == 0, "blocking");

struct mm_operand {
    const uint8_t *p;  // element (k, mn) at p + k*sk + mn*smn, for plain types
    int64_t sk, smn;
    ql_type type;
    // block types: rows of blocks along k (sk == block bytes, rows smn apart) or, for a
    // transposed block weight (trows), rows along mn that are sk apart
    bool trows;
    const void *aux;             // side data of the root tensor (NF4), else NULL
    const uint8_t *root_data;    // where the root's blocks start: a block's index from its address
    ql_type round = QL_TYPE_F32; // a 16-bit multiply (b in f16/bf16): packed values rounded to it
    const uint8_t *r8 = nullptr; // Q4_0 / Q4_K / Q6_K / NF4 repacked in groups of 8 rows (mm_r8_*, mm_k8_*, mm_q6r8_*, mm_n8_*), read by the 8-bit paths; NULL: none
};

static inline bool mm_k_contig(const mm_operand &o) { return !o.trows && o.sk == (int64_t)traits(o.type).type_size; }

// a run of one root row as floats: a pointer into the data (f32) or into tmp (converted)
static inline const float *mm_root_run(const mm_operand &o, int64_t c0, int64_t n, const uint8_t *rp, float *tmp) {
    const uint8_t *p = rp + ql_row_size(o.type, c0);
    if (o.type == QL_TYPE_F32) return (const float *)p;
    const ql_type_traits &tt = traits(o.type);
    if (tt.to_float_aux)
        tt.to_float_aux(p, o.aux, (int64_t)((size_t)(p - o.root_data) / tt.type_size) * tt.blck_size, tmp, n);
    else
        tt.to_float(p, tmp, n);
    return tmp;
}

// k-run [k0, k0+n) of row mn (k-contiguous operands)
static inline const float *mm_run(const mm_operand &o, int64_t mn, int64_t k0, int64_t n, float *tmp) {
    return mm_root_run(o, k0, n, o.p + mn * o.smn, tmp);
}

static inline float mm_elem(const mm_operand &o, int64_t k, int64_t mn) {
    const uint8_t *e = o.p + k * o.sk + mn * o.smn;
    if (o.type == QL_TYPE_F32) return *(const float *)e;
    float v;
    traits(o.type).to_float(e, &v, 1);
    return v;
}

// Rounds packed values to a 16-bit type (round to nearest even, as the conversions): the
// weight side of a multiply whose activations are f16/bf16 - what a GPU's 16-bit multiply sees.
static void mm_round(float *d, size_t n, ql_type t) {
    const ql_type_traits &tt = traits(t);  // the type's own (vectorised) conversions, there and back
    uint16_t h[256];
    for (size_t i = 0; i < n; i += 256) {
        const int64_t m = (int64_t)std::min<size_t>(256, n - i);
        tt.from_float(d + i, h, m);
        tt.to_float(h, d + i, m);
    }
}

// d[kk*W + j] = element (k0+kk, mn0+j) for j < n; zero for n <= j < W
static void mm_pack(const mm_operand &o, int64_t k0, int64_t kc, int64_t mn0, int n, int W, float *d, float *tmp) {
    const ql_type_traits &tt = traits(o.type);
    if (tt.blck_size == 1 && o.smn == (int64_t)tt.type_size) {  // mn-contiguous (a transposed view): rows of the panel
        for (int64_t kk = 0; kk < kc; kk++) {
            float *dk = d + kk * W;
            tt.to_float(o.p + (k0 + kk) * o.sk + mn0 * o.smn, dk, n);
            for (int j = n; j < W; j++) dk[j] = 0.0f;
        }
    } else if (mm_k_contig(o)) {  // k-contiguous (weights, activations): transpose, 8 x 8 at a time
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            const float *rows[8];
            for (int q = 0; q < 8; q++) rows[q] = mm_run(o, mn0 + j + q, k0, kc, tmp + (size_t)q * MM_KC);
            // rows are evenly spaced in the source (f32) or in tmp (converted)
            const int64_t ld = o.type == QL_TYPE_F32 ? o.smn / 4 : MM_KC;
            int64_t kk = 0;
            for (; kk + 8 <= kc; kk += 8) transpose8(rows[0] + kk, ld, d + kk * W + j, W);
            for (; kk < kc; kk++)
                for (int q = 0; q < 8; q++) d[kk * W + j + q] = rows[q][kk];
        }
        for (; j < n; j++) {
            const float *s = mm_run(o, mn0 + j, k0, kc, tmp);
            for (int64_t kk = 0; kk < kc; kk++) d[kk * W + j] = s[kk];
        }
        for (j = n; j < W; j++)
            for (int64_t kk = 0; kk < kc; kk++) d[kk * W + j] = 0.0f;
    } else {
        for (int64_t kk = 0; kk < kc; kk++) {
            for (int j = 0; j < n; j++) d[kk * W + j] = mm_elem(o, k0 + kk, mn0 + j);
            for (int j = n; j < W; j++) d[kk * W + j] = 0.0f;
        }
    }
}

// Transposed block weight: for each k, convert the root row's columns [mn0, mn0 + nc) once
// (block-aligned), then deal them out to the NR-wide panels.
static void mm_pack_trows(const mm_operand &o, int64_t k0, int64_t kc, int64_t mn0, int64_t nc, float *d, float *tmp) {
    for (int64_t kk = 0; kk < kc; kk++) {
        const float *s = mm_root_run(o, mn0, nc, o.p + (k0 + kk) * o.sk, tmp);
        for (int64_t jp = 0; jp < nc; jp += MM_NR) {
            const int64_t nr = std::min<int64_t>(MM_NR, nc - jp);
            float *dk = d + jp * kc + kk * MM_NR;
            for (int64_t j = 0; j < nr; j++) dk[j] = s[jp + j];
            for (int64_t j = nr; j < MM_NR; j++) dk[j] = 0.0f;
        }
    }
}

// the W block [k0, k0+kc) x [mn0, mn0+nc) as NR-wide panels [kc x NR], one after another
static void mm_pack_w(const mm_operand &w, int64_t k0, int64_t kc, int64_t mn0, int64_t nc, float *d, float *tmp) {
    if (w.trows) {
        mm_pack_trows(w, k0, kc, mn0, nc, d, tmp);
        return;
    }
    for (int64_t jp = 0; jp < nc; jp += MM_NR)
        mm_pack(w, k0, kc, mn0 + jp, (int)std::min<int64_t>(MM_NR, nc - jp), MM_NR, d + jp * kc, tmp);
}

// C[R x NR] (+)= Xp[kc x R] . Wp[kc x NR]; only the first nr columns of C are real. acc: C holds
// the sum of earlier K blocks; else ci (ql_mul_mat_acc's c, laid out as C; may be C) is added.
template <int R>
static void mm_kernel(int64_t kc, const float *xp, const float *wp, float *c, const float *ci, int64_t ldc, int nr, bool acc) {
    vf s[R][MM_NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < MM_NV; v++) s[r][v] = vf_zero();
    const float *add = acc ? c : ci;  // what the sums are added to: earlier K blocks, c, or nothing
    if (add)  // the tile is added to at the end: ask for it now, it comes while the loop runs
        for (int r = 0; r < R; r++)
            for (int v = 0; v < MM_NR; v += 16) __builtin_prefetch(add + r * ldc + v, 0, 3);
    for (int64_t k = 0; k < kc; k++) {
        vf w[MM_NV];
        for (int v = 0; v < MM_NV; v++) w[v] = vf_load(wp + k * MM_NR + v * VW);
        for (int r = 0; r < R; r++) {
            const vf x = vf_set1(xp[k * R + r]);
            for (int v = 0; v < MM_NV; v++) s[r][v] = vf_fma(x, w[v], s[r][v]);
        }
    }
    if (nr == MM_NR) {
        for (int r = 0; r < R; r++)
            for (int v = 0; v < MM_NV; v++) {
                const int64_t o = r * ldc + v * VW;
                vf_store(c + o, add ? vf_add(vf_load(add + o), s[r][v]) : s[r][v]);
            }
        return;
    }
    float t[MM_NR];
    for (int r = 0; r < R; r++) {
        for (int v = 0; v < MM_NV; v++) vf_store(t + v * VW, s[r][v]);
        for (int j = 0; j < nr; j++) c[r * ldc + j] = add ? add[r * ldc + j] + t[j] : t[j];
    }
}

typedef void (*mm_kernel_fn)(int64_t, const float *, const float *, float *, const float *, int64_t, int, bool);
template <int... I> static constexpr std::array<mm_kernel_fn, sizeof...(I) + 1> mm_kernel_table(std::integer_sequence<int, I...>) {
    return {{nullptr, mm_kernel<I + 1>...}};
}
static constexpr auto k_mm_kernels = mm_kernel_table(std::make_integer_sequence<int, MM_MR>{});

// workspace of one thread, in floats: [W panel block | X panel block | conversion run]
struct mm_layout {
    size_t xbuf, tmp, total;
};
static mm_layout mm_layout_of(int64_t M, int64_t N, int64_t K) {
    auto round_up = [](int64_t x, int64_t m) { return (x + m - 1) / m * m; };
    const size_t kc = (size_t)std::min<int64_t>(MM_KC, std::max<int64_t>(K, 1));
    const size_t nc = (size_t)std::min<int64_t>(MM_NC, round_up(M, MM_NR));
    const size_t mc = (size_t)std::min<int64_t>(MM_MC, round_up(N, MM_MR));
    mm_layout L;
    L.xbuf  = nc * kc;
    L.tmp   = L.xbuf + mc * std::max<size_t>(kc, MM_KC / 2);  // the f32 X block, or mm_dp's rows of KC/2 dwords
    L.total = L.tmp + (size_t)std::max<int64_t>(8 * MM_KC, 4 * K) + 64;  // 8 converted runs, or 4 whole rows
    return L;
}

// rows [ib, ie) x columns [jb, je) of C, packed path
static void mm_packed(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K,
                      int64_t ib, int64_t ie, int64_t jb, int64_t je, float *work, const mm_layout &L) {
    float *wbuf = work, *xbuf = work + L.xbuf, *tmp = work + L.tmp;
    if (K == 0) {
        for (int64_t i = ib; i < ie; i++)
            for (int64_t j = jb; j < je; j++) c[i * ldc + j] = ci ? ci[i * ldc + j] : 0.0f;
        return;
    }
    for (int64_t jc = jb; jc < je; jc += MM_NC) {
        const int64_t nc = std::min<int64_t>(MM_NC, je - jc);
        for (int64_t pc = 0; pc < K; pc += MM_KC) {
            const int64_t kc = std::min<int64_t>(MM_KC, K - pc);
            mm_pack_w(w, pc, kc, jc, nc, wbuf, tmp);
            if (w.round != QL_TYPE_F32) mm_round(wbuf, (size_t)((nc + MM_NR - 1) / MM_NR * MM_NR * kc), w.round);
            for (int64_t ic = ib; ic < ie; ic += MM_MC) {
                const int64_t mc = std::min<int64_t>(MM_MC, ie - ic);
                for (int64_t ip = 0; ip < mc; ip += MM_MR) {
                    const int mr = (int)std::min<int64_t>(MM_MR, mc - ip);
                    mm_pack(x, pc, kc, ic + ip, mr, mr, xbuf + ip * kc, tmp);
                }
                for (int64_t jr = 0; jr < nc; jr += MM_NR) {
                    const int nr = (int)std::min<int64_t>(MM_NR, nc - jr);
                    for (int64_t ir = 0; ir < mc; ir += MM_MR) {
                        const int mr = (int)std::min<int64_t>(MM_MR, mc - ir);
                        const int64_t o = (ic + ir) * ldc + jc + jr;
                        k_mm_kernels[(size_t)mr](kc, xbuf + ir * kc, wbuf + jr * kc, c + o, ci ? ci + o : nullptr, ldc,
                                                 nr, pc > 0);
                    }
                }
            }
        }
    }
}

// columns [jb, je) for all N rows: W rows dotted with X rows (both k-contiguous). A tile of
// 4 W rows x 4 X rows shares every load between four dot products.
template <int NJ, int NI>
static inline void mm_dot_tile(int64_t K, const float *const *wr, const float *const *xr, float *c, const float *ci, int64_t ldc) {
    vf s[NI][NJ];
    for (int i = 0; i < NI; i++)
        for (int j = 0; j < NJ; j++) s[i][j] = vf_zero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf w[NJ];
        for (int j = 0; j < NJ; j++) w[j] = vf_load(wr[j] + k);
        for (int i = 0; i < NI; i++) {
            const vf x = vf_load(xr[i] + k);
            for (int j = 0; j < NJ; j++) s[i][j] = vf_fma(x, w[j], s[i][j]);
        }
    }
    for (int i = 0; i < NI; i++)
        for (int j = 0; j < NJ; j++) {
            float r = vf_hsum(s[i][j]);
            for (int64_t kk = k; kk < K; kk++) r += xr[i][kk] * wr[j][kk];
            c[i * ldc + j] = ci ? ci[i * ldc + j] + r : r;
        }
}

static void mm_dot(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K, int64_t N,
                   int64_t jb, int64_t je, float *work, const mm_layout &L) {
    float *tmp = work + L.tmp;  // [4, K]
    constexpr int T = 4;
    for (int64_t j = jb; j < je; j += T) {
        const int nj = (int)std::min<int64_t>(T, je - j);
        const float *wr[T];
        for (int q = 0; q < nj; q++) wr[q] = mm_run(w, j + q, 0, K, tmp + q * K);
        for (int64_t i = 0; i < N; i += T) {
            const int ni = (int)std::min<int64_t>(T, N - i);
            const float *xr[T];
            for (int q = 0; q < ni; q++) xr[q] = (const float *)(x.p + (i + q) * x.smn);
            float *cp = c + i * ldc + j;
            const float *cip = ci ? ci + i * ldc + j : nullptr;
            if (nj == T && ni == T) {
                mm_dot_tile<T, T>(K, wr, xr, cp, cip, ldc);
            } else {
                for (int a = 0; a < ni; a++)
                    for (int b = 0; b < nj; b++)
                        mm_dot_tile<1, 1>(K, wr + b, xr + a, cp + a * ldc + b, cip ? cip + a * ldc + b : nullptr, ldc);
            }
        }
    }
}

// The transposed gather of a 16-bit X block: rows [0, mc) of an operand stored mn-contiguous
// (element (k, r) at p + k sk + 2r: dy^T in a weight's gradient) as k-pair dwords, dst[r ld + q] =
// x(2q, r) | x(2q + 1, r) << 16 for q < np - the layout both bf16 kernels read. 16 x 16 dword
// blocks are made from 32 source rows and transposed in registers; the edges element by element.
// Only the AMX and AVX512-BF16 kernels call it (unused in other builds).
[[maybe_unused]] static void mm_gather_pairs(const uint8_t *p, int64_t sk, int64_t mc, int64_t np, uint32_t *dst, int64_t ld) {
    auto pair = [&](int64_t q, int64_t r) {
        uint16_t lo, hi;
        memcpy(&lo, p + 2 * q * sk + 2 * r, 2);
        memcpy(&hi, p + (2 * q + 1) * sk + 2 * r, 2);
        return lo | (uint32_t)hi << 16;
    };
    int64_t r0 = 0;
#if defined(__AVX512F__)
    // transpose by swapping off-diagonal b x b blocks, b = 8, 4, 2, 1: for rows i (bit b clear) and
    // i + b, row i takes row i+b's low half of each 2b block into its high half, and back
    __m512i lo_idx[4], hi_idx[4];
    for (int s = 0; s < 4; s++) {
        const int b = 8 >> s;
        alignas(64) int32_t l[16], h[16];
        for (int j = 0; j < 16; j++) {
            l[j] = (j & b) ? 16 + j - b : j;
            h[j] = (j & b) ? 16 + j : j + b;
        }
        lo_idx[s] = _mm512_load_si512(l);
        hi_idx[s] = _mm512_load_si512(h);
    }
    for (; r0 + 16 <= mc; r0 += 16) {
        int64_t q0 = 0;
        for (; q0 + 16 <= np; q0 += 16) {
            __m512i v[16];  // v[q] = the pairs of rows r0 .. r0+15 at pair q0 + q
            for (int q = 0; q < 16; q++) {
                const uint8_t *a = p + 2 * (q0 + q) * sk + 2 * r0;
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + sk)));
                v[q] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            }
            for (int s = 0; s < 4; s++) {
                const int b = 8 >> s;
                for (int i = 0; i < 16; i++) {
                    if (i & b) continue;
                    const __m512i x = v[i], y = v[i + b];
                    v[i]     = _mm512_permutex2var_epi32(x, lo_idx[s], y);
                    v[i + b] = _mm512_permutex2var_epi32(x, hi_idx[s], y);
                }
            }
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + (r0 + r) * ld + q0, v[r]);
        }
        for (int64_t r = r0; r < r0 + 16; r++)
            for (int64_t q = q0; q < np; q++) dst[r * ld + q] = pair(q, r);
    }
#endif
    for (int64_t r = r0; r < mc; r++)
        for (int64_t q = 0; q < np; q++) dst[r * ld + q] = pair(q, r);
}

// bf16 x bf16 on AMX tiles (Intel AMX-BF16): where b is bf16 and K a multiple of 32. The W
// block is packed as for the f32 path, then rounded into k-pair dwords in place (bf16(W[k][j])
// low, bf16(W[k+1][j]) high: the B-tile layout, 16 pairs x 16 columns a tile); X rows are
// copied token-major in bf16 (the A tiles). A 32 x 32 block of C is four tiles: from zero in
// the first K block (stored straight into C), from C itself in the next ones (loaded, summed
// over the K block, stored back: no pass over C outside the tiles); edge blocks and c + a b's
// first block go through a [32 x 32] buffer. Products are exact and sums f32, as the f32 path's
// (the order differs: each instruction's 16 pairs join C's running sum; subnormals flush to
// zero). Every C element's order depends on K only, not on the thread split. QL_AMX_SHIM: the tiles
// emulated (tests/amx_shim.h), so that the kernel is tested on processors without them (with
// AVX-512's 32-column panels, as on AMX).
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)) || (defined(QL_AMX_SHIM) && defined(__AVX512F__))
static bool mm_amx_ready() {  // the kernel grants the tile data state to the process (Linux >= 5.16)
#if defined(QL_AMX_SHIM)
    return true;
#else
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
#endif
}

// a packed f32 panel [kc x W] becomes, in place, [kc/2 x W] k-pair dwords (kc even)
static void mm_pairs(float *d, int64_t kc, int W) {
    uint32_t row[MM_NR];
    for (int64_t pp = 0; 2 * pp < kc; pp++) {
        const float *a = d + 2 * pp * W, *b = a + W;
        for (int j = 0; j < W; j++) row[j] = ql_fp32_to_bf16(a[j]) | (uint32_t)ql_fp32_to_bf16(b[j]) << 16;
        memcpy(d + pp * W, row, sizeof(uint32_t) * (size_t)W);  // f32 rows <= 2pp + 1 are read already
    }
}

struct mm_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void mm_amx(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K, int64_t ib,
                   int64_t ie, int64_t jb, int64_t je, float *work, const mm_layout &L) {
    float *wbuf = work, *tmp = work + L.tmp;
    uint16_t *xb = (uint16_t *)(work + L.xbuf);  // [round_up(mc, 32), kc] bf16: fits the f32 X block's room
    mm_tilecfg cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // C 0-3, A 4-5, B 6-7: 16 rows of 64 bytes
    _tile_loadconfig(&cfg);
    // C's 32 x 32 block (rows ld floats apart) as tiles 0-3: [0 1] over [2 3]
    auto c_tiles_load = [](const float *p, int64_t ld) {
        _tile_loadd(0, p, ld * 4);
        _tile_loadd(1, p + 16, ld * 4);
        _tile_loadd(2, p + 16 * ld, ld * 4);
        _tile_loadd(3, p + 16 * ld + 16, ld * 4);
    };
    auto c_tiles_store = [](float *p, int64_t ld) {
        _tile_stored(0, p, ld * 4);
        _tile_stored(1, p + 16, ld * 4);
        _tile_stored(2, p + 16 * ld, ld * 4);
        _tile_stored(3, p + 16 * ld + 16, ld * 4);
    };
    for (int64_t jc = jb; jc < je; jc += MM_NC) {
        const int64_t nc = std::min<int64_t>(MM_NC, je - jc);
        for (int64_t pc = 0; pc < K; pc += MM_KC) {
            const int64_t kc = std::min<int64_t>(MM_KC, K - pc);  // a multiple of 32
            mm_pack_w(w, pc, kc, jc, nc, wbuf, tmp);
            for (int64_t jp = 0; jp < nc; jp += MM_NR) mm_pairs(wbuf + jp * kc, kc, MM_NR);
            for (int64_t ic = ib; ic < ie; ic += MM_MC) {
                const int64_t mc = std::min<int64_t>(MM_MC, ie - ic), mp = (mc + 31) / 32 * 32;
                if (x.sk == 2) {  // k-contiguous rows: copies
                    for (int64_t r = 0; r < mc; r++) memcpy(xb + r * kc, x.p + (ic + r) * x.smn + pc * 2, (size_t)kc * 2);
                } else if (x.smn == 2) {  // mn-contiguous: the transposed gather
                    mm_gather_pairs(x.p + pc * x.sk + ic * 2, x.sk, mc, kc / 2, (uint32_t *)xb, kc / 2);
                } else {
                    for (int64_t k = 0; k < kc; k++)
                        for (int64_t r = 0; r < mc; r++) memcpy(xb + r * kc + k, x.p + (pc + k) * x.sk + (ic + r) * x.smn, 2);
                }
                memset(xb + mc * kc, 0, (size_t)((mp - mc) * kc) * 2);
                for (int64_t ir = 0; ir < mc; ir += 32)
                    for (int64_t jr = 0; jr < nc; jr += MM_NR) {
                        const uint8_t *a0 = (const uint8_t *)(xb + ir * kc), *a1 = a0 + 16 * kc * 2;
                        const uint8_t *b = (const uint8_t *)(wbuf + jr * kc);
                        const int64_t rows = std::min<int64_t>(32, mc - ir), cols = std::min<int64_t>(MM_NR, nc - jr);
                        float *cb = c + (ic + ir) * ldc + jc + jr;  // C's 32 x 32 block
                        // after the first K block the tiles go on from C's running sum: a whole
                        // block straight from C, an edge block through the buffer, zero-padded -
                        // the same arithmetic either way, so the thread split (which decides what
                        // is an edge) changes no bit
                        const bool whole = rows == 32 && cols == MM_NR;
                        if (pc > 0 && whole) {
                            c_tiles_load(cb, ldc);
                        } else if (pc > 0) {
                            for (int64_t r = 0; r < 32; r++)
                                for (int64_t j = 0; j < 32; j++) tmp[r * 32 + j] = r < rows && j < cols ? cb[r * ldc + j] : 0.0f;
                            c_tiles_load(tmp, 32);
                        } else {
                            _tile_zero(0);
                            _tile_zero(1);
                            _tile_zero(2);
                            _tile_zero(3);
                        }
                        for (int64_t kk = 0; kk < kc; kk += 32) {
                            _tile_loadd(4, a0 + kk * 2, kc * 2);
                            _tile_loadd(5, a1 + kk * 2, kc * 2);
                            _tile_loadd(6, b + kk / 2 * 128, 128);
                            _tile_loadd(7, b + kk / 2 * 128 + 64, 128);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                        const bool add_ci = pc == 0 && ci;  // c + a b: c joins the first K block's sum as
                                                            // ql_add would (the same bits for K <= MM_KC)
                        if (whole && !add_ci) {
                            c_tiles_store(cb, ldc);
                            continue;
                        }
                        c_tiles_store(tmp, 32);  // tmp: [32 rows x 32 columns]
                        for (int64_t r = 0; r < rows; r++) {
                            const int64_t o = (ic + ir + r) * ldc + jc + jr;
                            const float *t = tmp + r * 32;
                            for (int64_t j = 0; j < cols; j++) c[o + j] = add_ci ? ci[o + j] + t[j] : t[j];
                        }
                    }
            }
        }
    }
    _tile_release();
}
static_assert(MM_NR == 32 && MM_KC % 32 == 0, "AMX: a 32-column panel is two B tiles");
#else
static bool mm_amx_ready() { return false; }
static void mm_amx(const mm_operand &, const mm_operand &, float *, const float *, int64_t, int64_t, int64_t, int64_t,
                   int64_t, int64_t, float *, const mm_layout &) {}
#endif

// bf16 x bf16 with AVX512-BF16's pair dot products (vdpbf16ps: AMD Zen 4 and later, Intel Cooper
// Lake, Sapphire Rapids without the tiles): where b is bf16 and K even. The W block is packed and
// paired as for AMX ([kc/2 x 32] k-pair dwords a panel); X rows are copied as they are, each at a
// fixed stride of KC/2 dwords (so the kernel's R row addresses are one pointer plus constant
// offsets), and their pair dwords broadcast one at a time against two W vectors. The register tile is the f32
// kernel's (MR x 32), at twice its products per instruction. As on AMX, products are exact,
// sums f32, each dword's odd element first (the instruction's order), subnormals flush to zero;
// every C element's order depends on K only, not on the thread split.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
static constexpr bool k_mm_dp = true;
template <int R>
static void mm_dp_kernel(int64_t np, const uint32_t *xp, const uint32_t *wp, float *c, const float *ci, int64_t ldc, int nr,
                         bool acc) {
    __m512 s[R][2];
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const float *add = acc ? c : ci;  // as mm_kernel
    if (add)  // the tile is added to at the end: ask for it now, it comes while the loop runs
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(add + r * ldc), _MM_HINT_T0);
            _mm_prefetch((const char *)(add + r * ldc + 16), _MM_HINT_T0);
        }
    for (int64_t p = 0; p < np; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * MM_NR), w1 = (__m512bh)_mm512_loadu_si512(wp + p * MM_NR + 16);
        for (int r = 0; r < R; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xp[r * (MM_KC / 2) + p]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], x, w0);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], x, w1);
        }
    }
    if (nr == MM_NR) {
        for (int r = 0; r < R; r++) {
            float *cp = c + r * ldc;
            const float *ap = add + r * ldc;
            _mm512_storeu_ps(cp, add ? _mm512_add_ps(_mm512_loadu_ps(ap), s[r][0]) : s[r][0]);
            _mm512_storeu_ps(cp + 16, add ? _mm512_add_ps(_mm512_loadu_ps(ap + 16), s[r][1]) : s[r][1]);
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        float *cp = c + r * ldc, t[MM_NR];
        _mm512_storeu_ps(t, s[r][0]);
        _mm512_storeu_ps(t + 16, s[r][1]);
        for (int j = 0; j < nr; j++) cp[j] = add ? add[r * ldc + j] + t[j] : t[j];
    }
}
typedef void (*mm_dp_kernel_fn)(int64_t, const uint32_t *, const uint32_t *, float *, const float *, int64_t, int, bool);
template <int... I> static constexpr std::array<mm_dp_kernel_fn, sizeof...(I) + 1> mm_dp_table(std::integer_sequence<int, I...>) {
    return {{nullptr, mm_dp_kernel<I + 1>...}};
}
static constexpr auto k_mm_dp_kernels = mm_dp_table(std::make_integer_sequence<int, MM_MR>{});

// a panel of W (f32 [kc x NR]) into [kc/2 x NR] k-pair dwords in place: bf16(W[k][j]) low, W[k+1][j]
// high (the instruction's rounding: to nearest even; a subnormal becomes zero, as the dot would read it)
static void mm_pair_panel(float *d, int64_t kc) {
    for (int64_t pp = 0; 2 * pp < kc; pp++) {
        const float *a = d + 2 * pp * MM_NR, *b = a + MM_NR;
        __m512i q[2];
        for (int v = 0; v < 2; v++) {
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + 16 * v)));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + 16 * v)));
            q[v] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        _mm512_storeu_si512(d + pp * MM_NR, q[0]);  // f32 rows <= 2pp + 1 are read already
        _mm512_storeu_si512(d + pp * MM_NR + 16, q[1]);
    }
}

// a bf16 W block stored mn-contiguous (u^T, x^T in a LoRA factor's gradient) straight into the
// [kc/2 x NR] k-pair panels: the pairs are two rows' values side by side, no f32 round trip
static void mm_pack_pairs_t(const mm_operand &w, int64_t k0, int64_t kc, int64_t mn0, int64_t nc, uint32_t *d) {
    for (int64_t jp = 0; jp < nc; jp += MM_NR) {
        const int64_t nr = std::min<int64_t>(MM_NR, nc - jp);
        uint32_t *panel = d + jp * kc;  // kc/2 rows of NR dwords
        for (int64_t q = 0; 2 * q < kc; q++) {
            const uint8_t *a = w.p + (k0 + 2 * q) * w.sk + (mn0 + jp) * 2, *b = a + w.sk;
            uint32_t *o = panel + q * MM_NR;
            if (nr == MM_NR) {
                for (int v = 0; v < MM_NR; v += 16) {
                    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + 2 * v)));
                    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 2 * v)));
                    _mm512_storeu_si512(o + v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
                continue;
            }
            for (int64_t j = 0; j < MM_NR; j++) {
                uint16_t l = 0, h = 0;
                if (j < nr) memcpy(&l, a + 2 * j, 2), memcpy(&h, b + 2 * j, 2);
                o[j] = l | (uint32_t)h << 16;
            }
        }
    }
}

static void mm_dp(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K, int64_t ib,
                  int64_t ie, int64_t jb, int64_t je, float *work, const mm_layout &L) {
    float *wbuf = work, *tmp = work + L.tmp;
    uint32_t *xb = (uint32_t *)(work + L.xbuf);  // [mc rows][KC/2] pair dwords: at most half the f32 X block
    for (int64_t jc = jb; jc < je; jc += MM_NC) {
        const int64_t nc = std::min<int64_t>(MM_NC, je - jc);
        for (int64_t pc = 0; pc < K; pc += MM_KC) {
            const int64_t kc = std::min<int64_t>(MM_KC, K - pc), np = kc / 2;  // K even: kc even
            if (w.type == QL_TYPE_BF16 && !w.trows && w.smn == 2) {
                mm_pack_pairs_t(w, pc, kc, jc, nc, (uint32_t *)wbuf);
            } else {
                mm_pack_w(w, pc, kc, jc, nc, wbuf, tmp);
                for (int64_t jp = 0; jp < nc; jp += MM_NR) mm_pair_panel(wbuf + jp * kc, kc);
            }
            for (int64_t ic = ib; ic < ie; ic += MM_MC) {
                const int64_t mc = std::min<int64_t>(MM_MC, ie - ic);
                if (x.sk != 2 && x.smn == 2) {  // mn-contiguous (dy^T): the transposed gather
                    mm_gather_pairs(x.p + pc * x.sk + ic * 2, x.sk, mc, np, xb, MM_KC / 2);
                } else {
                    for (int64_t r = 0; r < mc; r++) {
                        uint32_t *xp = xb + r * (MM_KC / 2);
                        const uint8_t *row = x.p + (ic + r) * x.smn + pc * x.sk;
                        if (x.sk == 2) {  // k-contiguous: the pairs are the row's dwords
                            memcpy(xp, row, (size_t)kc * 2);
                        } else {
                            for (int64_t p = 0; p < np; p++) {
                                uint16_t lo, hi;
                                memcpy(&lo, row + 2 * p * x.sk, 2);
                                memcpy(&hi, row + (2 * p + 1) * x.sk, 2);
                                xp[p] = lo | (uint32_t)hi << 16;
                            }
                        }
                    }
                }
                for (int64_t jr = 0; jr < nc; jr += MM_NR) {
                    const int nr = (int)std::min<int64_t>(MM_NR, nc - jr);
                    for (int64_t ir = 0; ir < mc; ir += MM_MR) {
                        const int mr = (int)std::min<int64_t>(MM_MR, mc - ir);
                        const int64_t o = (ic + ir) * ldc + jc + jr;
                        k_mm_dp_kernels[(size_t)mr](np, xb + ir * (MM_KC / 2), (const uint32_t *)(wbuf + jr * kc), c + o,
                                                    ci ? ci + o : nullptr, ldc, nr, pc > 0);
                    }
                }
            }
        }
    }
}
static_assert(MM_NR == 32 && MM_KC % 2 == 0, "bf16 pairs: a 32-column panel is two vectors of 16 dwords");
#else
static constexpr bool k_mm_dp = false;
static void mm_dp(const mm_operand &, const mm_operand &, float *, const float *, int64_t, int64_t, int64_t, int64_t,
                  int64_t, int64_t, float *, const mm_layout &) {}
#endif

// ---- matrix multiply with 8-bit activations (inference: ql_mul_mat_set_prec) ----
// Decode multiplies a quantised weight by one token (or a few): the exact paths above turn every
// weight into a float first, and that conversion, not memory, bounds them. Here the activation
// rows are quantised instead - int8 per element, an f32 scale d = amax/127 per block of 32 (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, NF4) or of 256 (Q2_K .. Q6_K, IQ4_XS), with the sums of each
// 16 codes where an offset or a min needs them (Q4_1/Q5_1's and the k-quants' mins, Q5_0's -16,
// Q3_K's -4, Q6_K's -32) - once per thread into the workspace, and each weight
// row is dotted with them in integers, its codes unpacked in registers: four byte products per
// 32-bit lane (AVX-512 VNNI's vpdpbusd, AVX2's maddubs + madd, or a scalar loop), each block's
// integer sum scaled in f32. Each output has one thread and one summation order, so the result
// does not depend on the thread count. The only error against the exact path is the activations'
// rounding, |x - d q| <= d/2, and for NF4 its table in int8 (k_nf4_i8): README's generate section
// states the bound and tests/test_qmatmul.cpp checks it. Every type we read has a decode kernel; a
// prompt of Q2_K takes the exact path (its scale and min per 16 fit no panel kind: limitation).

static constexpr int MM_Q8_MAX_N = 8;  // b rows at or below: this path (decode, short prompts' tails)

// NF4's 16 values as int8, round(127 v): the weight is nf4_i8[q] * absmax / 127 here. The largest
// rounding, |127 v - round(127 v)| / 127 over the table, is 0.00367 absmax (v = -0.2844: 36.12)
static const int8_t k_nf4_i8[16] = QL_NF4_I8_VALUES;  // (qlora.h: the CUDA backend's decode reads the same)
static const std::array<uint8_t, 16> k_nf4_u8 = [] {   // the same + 128, as unsigned bytes (mm_n8_group)
    std::array<uint8_t, 16> u{};
    for (int i = 0; i < 16; i++) u[(size_t)i] = (uint8_t)(k_nf4_i8[i] + 128);
    return u;
}();

static int mm_q8_block(ql_type t) {  // the activations' block for a weight type; 0: no integer kernel
    switch (t) {
    case QL_TYPE_Q4_0: case QL_TYPE_Q8_0: case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: return 32;
    case QL_TYPE_Q4_1: case QL_TYPE_Q5_0: case QL_TYPE_Q5_1: case QL_TYPE_IQ4_NL: return 32;
    case QL_TYPE_Q4_K: case QL_TYPE_Q5_K: case QL_TYPE_Q6_K: case QL_TYPE_IQ4_XS: return QL_QK_K;
    case QL_TYPE_Q2_K: case QL_TYPE_Q3_K: return QL_QK_K;
    default: return 0;
    }
}
// whether decode's kernel of a type reads the activation's 16-sums: an offset or a min per block
static bool mm_q8_bsum(ql_type t) {
    return mm_q8_block(t) == QL_QK_K || t == QL_TYPE_Q4_1 || t == QL_TYPE_Q5_0 || t == QL_TYPE_Q5_1;
}

// activation rows in 8 bits, in a thread's workspace: x(i, k) ~ d[i K/qb + k/qb] q[i K + k]
struct mm_xq {
    int8_t  *q;     // [N, K]
    float   *d;     // [N, K/qb]
    int16_t *bsum;  // [N, K/16]: the sums of each 16 codes (qb 256)
    float   *wsc;   // [K/64]: NF4: a weight row's absmax / 127 per block
};
static size_t mm_q8_round(size_t n) { return (n + 63) / 64 * 64; }
static size_t mm_q8_work(int64_t N, int64_t K, int qb) {
    return mm_q8_round((size_t)(N * K)) + mm_q8_round((size_t)(N * (K / qb)) * 4) + mm_q8_round((size_t)(N * (K / 16)) * 2) +
           mm_q8_round((size_t)(K / 64) * 4) + 64;
}
static mm_xq mm_q8_carve(uint8_t *work, int64_t N, int64_t K, int qb) {
    uint8_t *p = (uint8_t *)(((uintptr_t)work + 63) / 64 * 64);
    mm_xq x;
    x.q    = (int8_t *)p;   p += mm_q8_round((size_t)(N * K));
    x.d    = (float *)p;    p += mm_q8_round((size_t)(N * (K / qb)) * 4);
    x.bsum = (int16_t *)p;  p += mm_q8_round((size_t)(N * (K / 16)) * 2);
    x.wsc  = (float *)p;
    return x;
}

static inline float mm_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return ql_fp16_to_fp32(h);
#endif
}

// one row of K floats into codes and block scales (a non-finite element makes its block's d NaN,
// so the result is NaN as the exact path's would be)
static void mm_q8_quantize_row(const float *x, int64_t K, int qb, int8_t *q, float *d, int16_t *bsum) {
    for (int64_t b = 0; b < K / qb; b++) {
        const float *xb = x + b * qb;
        int8_t *qq = q + b * qb;
        float amax = 0.0f, bad = 0.0f;
#if defined(__AVX512F__)
        __m512 m = _mm512_setzero_ps(), z = _mm512_setzero_ps();
        for (int k = 0; k < qb; k += 16) {
            const __m512 v = _mm512_loadu_ps(xb + k);
            m = _mm512_max_ps(m, _mm512_abs_ps(v));
            z = _mm512_add_ps(z, _mm512_mul_ps(v, _mm512_setzero_ps()));  // NaN if an element is inf or NaN
        }
        amax = _mm512_reduce_max_ps(m);
        bad = _mm512_reduce_add_ps(z);
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int k = 0; k < qb; k += 16)  // to nearest (even), |x id| <= 127
            _mm_storeu_si128((__m128i *)(qq + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k), id))));
#else
        for (int k = 0; k < qb; k++) {
            amax = std::max(amax, std::fabs(xb[k]));
            bad += xb[k] * 0.0f;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < qb; k++) qq[k] = (int8_t)std::max(-127.0f, std::min(127.0f, std::nearbyint(xb[k] * id)));
#endif
        d[b] = amax / 127.0f + bad;
        if (bsum)
            for (int s = 0; s < qb / 16; s++) {
                int t = 0;
                for (int k = 0; k < 16; k++) t += qq[16 * s + k];
                bsum[b * (qb / 16) + s] = (int16_t)t;
            }
    }
}

// the 8 (scale, min) pairs of a Q4_K block as ql_k4_scales, four bytes at a time: sc[0..3] are
// s[0..3]'s low 6 bits, sc[4..7] s[8..11]'s low nibbles with s[0..3]'s top 2 bits above; the
// mins likewise from s[4..7] and s[8..11]'s high nibbles
static inline void mm_k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t w[3], o[4];
    memcpy(w, s, 12);
    o[0] = w[0] & 0x3f3f3f3fu;
    o[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    o[2] = w[1] & 0x3f3f3f3fu;
    o[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, o, 8);
    memcpy(mn, o + 2, 8);
}
// Q3_K's 16 6-bit scales less 32 (q3_K_to_float's layout): sub-block s's low 4 bits are scales[s]'s
// low nibble (s < 8) or scales[s - 8]'s high, its top 2 bits scales[8 + s % 4]'s bits 2 (s / 4) ..
static inline void mm_k3_scales(const uint8_t *sb, int8_t sc[16]) {
    uint32_t a[3], o[4];  // four scales a word: the low nibbles (words 0, 1), the high (2, 3); top bits from a[2]
    memcpy(a, sb, 12);
    o[0] = (a[0] & 0x0f0f0f0fu) | (a[2] & 0x03030303u) << 4;
    o[1] = (a[1] & 0x0f0f0f0fu) | (a[2] >> 2 & 0x03030303u) << 4;
    o[2] = (a[0] >> 4 & 0x0f0f0f0fu) | (a[2] >> 4 & 0x03030303u) << 4;
    o[3] = (a[1] >> 4 & 0x0f0f0f0fu) | (a[2] >> 6 & 0x03030303u) << 4;
    for (int w = 0; w < 4; w++) o[w] = ((o[w] | 0x80808080u) - 0x20202020u) ^ 0x80808080u;  // each byte - 32 as int8, no borrows
    memcpy(sc, o, 16);
}

// Row dot products: K elements of a weight row (blocks) against one quantised activation row.
// xd: the row's block scales, bsum: its 16-sums (k-quants), wsc: NF4's absmax / 127 per block.
typedef float (*mm_q8_dot_fn)(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum,
                              const float *wsc);

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes += the sums of 4 byte products, a unsigned and b signed (AVX2: the pair sums must not
// saturate int16 - every a here is <= 128 and |b| <= 127: 2 * 128 * 127 < 32768)
static inline __m256i mm_dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}
// signed x signed: a's sign moved onto b (|a| as unsigned: -128 reads 128)
static inline __m256i mm_dpbssd(__m256i acc, __m256i a, __m256i b) {
    return mm_dpbusd(acc, _mm256_abs_epi8(a), _mm256_sign_epi8(b, a));
}
static inline float mm_hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
static inline __m256i mm_ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
// sum over blocks 0..nb-1 of step(i, acc): even and odd blocks into two accumulators (two
// multiply-add chains in flight), added at the end
template <class Step> static inline float mm_q8_sum2(int64_t nb, const Step &step) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        a0 = step(i, a0);
        a1 = step(i + 1, a1);
    }
    if (i < nb) a0 = step(i, a0);
    return mm_hsum8(_mm256_add_ps(a0, a1));
}

// 16 bytes of nibbles as 32 codes: elements 0-15 the low nibbles, 16-31 the high (Q4_0's order)
static inline __m256i mm_nibbles32(const uint8_t *qs) {
    const __m128i c = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), _mm256_set1_epi8(15));
}
static float mm_q8dot_q4_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q4_0 *b = (const ql_block_q4_0 *)w;
    const __m256i eight = _mm256_set1_epi8(8);
    auto step = [&](int64_t i, __m256 acc) {
        const __m256i q = mm_nibbles32(b[i].qs);
        const __m256i x = mm_ld(xq + 32 * i);
        const __m256i s = _mm256_sub_epi32(mm_dpbusd(_mm256_setzero_si256(), q, x), mm_dpbusd(_mm256_setzero_si256(), eight, x));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    };
    return mm_q8_sum2(K / 32, step);
}

static float mm_q8dot_q8_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q8_0 *b = (const ql_block_q8_0 *)w;
    auto step = [&](int64_t i, __m256 acc) {
        const __m256i s = mm_dpbssd(_mm256_setzero_si256(), mm_ld(b[i].qs), mm_ld(xq + 32 * i));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    };
    return mm_q8_sum2(K / 32, step);
}

// NF4: 32 bytes of codes are a block of 64 (element 2j in byte j's high nibble, 2j+1 in the low)
static float mm_q8dot_nf4(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *wsc) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_nf4_i8));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < K / 64; i++) {
        const __m256i c = mm_ld(w + 32 * i);
        const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4));  // elements 2j
        const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(c, m4));                        // elements 2j+1
        const __m256i a = _mm256_unpacklo_epi8(hi, lo), e = _mm256_unpackhi_epi8(hi, lo);  // [0-15 | 32-47], [16-31 | 48-63]
        const __m256i v0 = _mm256_permute2x128_si256(a, e, 0x20), v1 = _mm256_permute2x128_si256(a, e, 0x31);
        const __m256i s0 = mm_dpbssd(_mm256_setzero_si256(), v0, mm_ld(xq + 64 * i));
        const __m256i s1 = mm_dpbssd(_mm256_setzero_si256(), v1, mm_ld(xq + 64 * i + 32));
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(wsc[i] * xd[2 * i]), acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(wsc[i] * xd[2 * i + 1]), acc[1]);
    }
    return mm_hsum8(_mm256_add_ps(acc[0], acc[1]));
}

// Q4_K: d sc q - dmin m per sub-block of 32; the mins' part is dmin d_x sum_s m_s (bsum of its two 16s).
// Q5_K (Block ql_block_q5_K): the same with each code's fifth bit from qh (bit 2g of qh[l] for
// sub-block 2g's element l, bit 2g + 1 for 2g + 1's): codes 0..31
template <class Block, bool Q5> static float mm_q8dot_k45(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const Block *b = (const Block *)w;
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        uint8_t sc[8], mn[8];
        mm_k4_scales(b[i].scales, sc, mn);
        alignas(32) int32_t sc32[8];  // each broadcast below is then one load
        _mm256_store_si256((__m256i *)sc32, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
        const int8_t *x = xq + QL_QK_K * i;
        __m256i isum = _mm256_setzero_si256(), h = _mm256_setzero_si256();
        if constexpr (Q5) h = mm_ld(b[i].qh);
        for (int g = 0; g < 4; g++) {  // 32 bytes: sub-block 2g in the low nibbles, 2g+1 in the high
            const __m256i q = mm_ld(b[i].qs + 32 * g);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if constexpr (Q5) {  // h's bit 0 of each byte is then bit 2g (a 16-bit shift: masked to bit 0, the byte's own)
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                h = _mm256_srli_epi16(h, 2);
            }
            const __m256i s0 = mm_dpbusd(_mm256_setzero_si256(), lo, mm_ld(x + 64 * g));
            const __m256i s1 = mm_dpbusd(_mm256_setzero_si256(), hi, mm_ld(x + 64 * g + 32));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(s0, _mm256_set1_epi32(sc32[2 * g])));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(s1, _mm256_set1_epi32(sc32[2 * g + 1])));
        }
        // the mins: lane s of madd = m_s (bsum_2s + bsum_2s+1), m_s repeated in both int16 halves
        uint64_t m8;
        memcpy(&m8, mn, 8);
        const __m128i mb = _mm_cvtsi64_si128((long long)m8);
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));
        const __m256i ms = _mm256_madd_epi16(m16, mm_ld(bsum + 16 * i));
        const float dx = xd[i];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(mm_h2f(b[i].d) * dx), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(mm_h2f(b[i].dmin) * dx), accm);
    }
    return mm_hsum8(acc) - mm_hsum8(accm);
}

// Q6_K: d sc (q - 32) per sub-block of 16, q = 4 bits of ql + 2 of qh; the -32 through the 16-sums
static float mm_q8dot_q6_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    const ql_block_q6_K *b = (const ql_block_q6_K *)w;
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);
    __m256i pick[4];  // lanes 0-3: sub-block 2m of the 8 scales at hand, lanes 4-7: 2m + 1
    for (int m = 0; m < 4; m++) pick[m] = _mm256_setr_epi32(2 * m, 2 * m, 2 * m, 2 * m, 2 * m + 1, 2 * m + 1, 2 * m + 1, 2 * m + 1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        const int8_t *x = xq + QL_QK_K * i;
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {  // 128 elements: 64 bytes of ql, 32 of qh, 8 scales
            const __m256i l0 = mm_ld(b[i].ql + 64 * h), l1 = mm_ld(b[i].ql + 64 * h + 32), qh = mm_ld(b[i].qh + 32 * h);
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].scales + 8 * h)));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0c)), 2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            for (int m = 0; m < 4; m++) {
                const __m256i s = mm_dpbusd(_mm256_setzero_si256(), q[m], mm_ld(x + 128 * h + 32 * m));
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(s, _mm256_permutevar8x32_epi32(sc, pick[m])));
            }
        }
        // the -32: 32 sum_s sc_s bsum_s, pairs of sub-blocks per lane
        const __m256i os = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales)), mm_ld(bsum + 16 * i));
        const __m256 dd = _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, _mm256_slli_epi32(os, 5))), dd, acc);
    }
    return mm_hsum8(acc);
}
// IQ4_NL / IQ4_XS: the codes through their int8 table; IQ4_XS's 6-bit scales (ls - 32) per 32 in
// integers, d per 256
static float mm_q8dot_iq4_nl(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_iq4_nl *b = (const ql_block_iq4_nl *)w;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_iq4_values));
    auto step = [&](int64_t i, __m256 acc) {
        const __m256i s = mm_dpbssd(_mm256_setzero_si256(), _mm256_shuffle_epi8(lut, mm_nibbles32(b[i].qs)), mm_ld(xq + 32 * i));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    };
    return mm_q8_sum2(K / 32, step);
}
static float mm_q8dot_iq4_xs(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_iq4_xs *b = (const ql_block_iq4_xs *)w;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_iq4_values));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        const int8_t *x = xq + QL_QK_K * i;
        __m256i isum = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const int ls = ((b[i].scales_l[s / 2] >> 4 * (s % 2)) & 15) | ((b[i].scales_h >> 2 * s) & 3) << 4;
            const __m256i t = mm_dpbssd(_mm256_setzero_si256(), _mm256_shuffle_epi8(lut, mm_nibbles32(b[i].qs + 16 * s)), mm_ld(x + 32 * s));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(t, _mm256_set1_epi32(ls - 32)));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    }
    return mm_hsum8(acc);
}

// Q4_1, Q5_0, Q5_1 (blocks of 32): unsigned codes (Q5's fifth bits: bit j of qh for element j);
// the offset (Q5_0's -16) or the min (m, times the activation's block sum) from the 16-sums
static inline __m256i mm_bits32(const uint8_t *qh4) {  // byte j: 0xFF where bit j of the u32 is set
    uint32_t v;
    memcpy(&v, qh4, 4);
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)v), pick), bit), bit);
}
static inline __m256i mm_q5_codes32(const uint8_t *qs, const uint8_t *qh4) {
    return _mm256_or_si256(mm_nibbles32(qs), _mm256_and_si256(mm_bits32(qh4), _mm256_set1_epi8(16)));
}
static float mm_q8dot_q5_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    const ql_block_q5_0 *b = (const ql_block_q5_0 *)w;
    auto step = [&](int64_t i, __m256 acc) {
        __m256i s = mm_dpbusd(_mm256_setzero_si256(), mm_q5_codes32(b[i].qs, b[i].qh), mm_ld(xq + 32 * i));
        s = _mm256_sub_epi32(s, _mm256_setr_epi32(16 * (bsum[2 * i] + bsum[2 * i + 1]), 0, 0, 0, 0, 0, 0, 0));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    };
    return mm_q8_sum2(K / 32, step);
}
template <class Block, bool Q5> static float mm_q8dot_min32(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const Block *b = (const Block *)w;
    __m256 acc = _mm256_setzero_ps();
    float m = 0.0f;
    for (int64_t i = 0; i < K / 32; i++) {
        __m256i c;
        if constexpr (Q5) c = mm_q5_codes32(b[i].qs, b[i].qh);
        else c = mm_nibbles32(b[i].qs);
        const __m256i s = mm_dpbusd(_mm256_setzero_si256(), c, mm_ld(xq + 32 * i));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
        m += (float)(bsum[2 * i] + bsum[2 * i + 1]) * (mm_h2f(b[i].m) * xd[i]);
    }
    return mm_hsum8(acc) + m;
}
static float mm_q8dot_q4_1(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_min32<ql_block_q4_1, false>(K, w, xq, xd, bsum);
}
static float mm_q8dot_q5_1(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_min32<ql_block_q5_1, true>(K, w, xq, xd, bsum);
}
// Q3_K and Q2_K (256): per half h and 2-bit field k, the 32 elements 128 h + 32 k + l read bits 2k of
// qs[32 h + l]; a scale per 16. The codes are small (Q3_K: 0..7, the 2 bits + 4 times bit 4h + k of
// hmask[l], less 4 through the 16-sums; Q2_K: 0..3, x = d (sc & 15) q - dmin (sc >> 4), the mins
// through the 16-sums), so maddubs' int16 pair sums cannot saturate and one madd applies the
// scales: int16 lanes 0-7 hold the first 16 elements, 8-15 the second
static inline __m256i mm_k_dup16(__m256i s32) {  // 8 int32 scales -> each dword the scale twice as int16
    return _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s32, 16));
}
static inline __m256i mm_k_pick(int k) {  // dwords 0-3: scale 2k of 8 (the first 16 elements), 4-7: 2k + 1
    return _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1);
}
static float mm_q8dot_q3_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    const ql_block_q3_K *b = (const ql_block_q3_K *)w;
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        alignas(16) int8_t sc[16];
        mm_k3_scales(b[i].scales, sc);
        const int8_t *x = xq + QL_QK_K * i;
        const __m256i hm = mm_ld(b[i].hmask);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = mm_ld(b[i].qs + 32 * h), s16 = mm_k_dup16(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * h))));
            for (int k = 0; k < 4; k++) {
                // bit 4h + k of each hmask byte to bit 2: a 16-bit shift, masked to the byte's own bit
                const int up = 2 - (4 * h + k);
                const __m256i hb = _mm256_and_si256(up > 0 ? _mm256_slli_epi16(hm, up) : _mm256_srli_epi16(hm, -up), four);
                const __m256i c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3), hb);
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(c, mm_ld(x + 128 * h + 32 * k)),
                                                                _mm256_permutevar8x32_epi32(s16, mm_k_pick(k))));
            }
        }
        const __m256i os = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)sc)), mm_ld(bsum + 16 * i));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, _mm256_slli_epi32(os, 2))), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
    }
    return mm_hsum8(acc);
}
static float mm_q8dot_q2_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    const ql_block_q2_K *b = (const ql_block_q2_K *)w;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        const int8_t *x = xq + QL_QK_K * i;
        const __m128i sm = _mm_loadu_si128((const __m128i *)b[i].scales);  // 16 x (scale | min << 4)
        const __m128i scl = _mm_and_si128(sm, m4), mnl = _mm_and_si128(_mm_srli_epi16(sm, 4), m4);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = mm_ld(b[i].qs + 32 * h), s16 = mm_k_dup16(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(scl, 8) : scl));
            for (int k = 0; k < 4; k++)
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3), mm_ld(x + 128 * h + 32 * k)),
                                                                _mm256_permutevar8x32_epi32(s16, mm_k_pick(k))));
        }
        const __m256i ms = _mm256_madd_epi16(_mm256_cvtepu8_epi16(mnl), mm_ld(bsum + 16 * i));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(mm_h2f(b[i].d) * xd[i]), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(mm_h2f(b[i].dmin) * xd[i]), accm);
    }
    return mm_hsum8(acc) - mm_hsum8(accm);
}
#else
// the portable kernels: the same integer sums, block by block
static float mm_q8dot_q4_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q4_0 *b = (const ql_block_q4_0 *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / 32; i++) {
        const int8_t *x = xq + 32 * i;
        int s = 0;
        for (int j = 0; j < 16; j++) s += ((b[i].qs[j] & 15) - 8) * x[j] + ((b[i].qs[j] >> 4) - 8) * x[j + 16];
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}
static float mm_q8dot_q8_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q8_0 *b = (const ql_block_q8_0 *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / 32; i++) {
        int s = 0;
        for (int j = 0; j < 32; j++) s += b[i].qs[j] * xq[32 * i + j];
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}
static float mm_q8dot_nf4(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *wsc) {
    float r = 0.0f;
    for (int64_t i = 0; i < K / 64; i++)
        for (int h = 0; h < 2; h++) {
            const uint8_t *c = w + 32 * i + 16 * h;
            const int8_t *x = xq + 64 * i + 32 * h;
            int s = 0;
            for (int j = 0; j < 16; j++) s += k_nf4_i8[c[j] >> 4] * x[2 * j] + k_nf4_i8[c[j] & 15] * x[2 * j + 1];
            r += (float)s * (wsc[i] * xd[2 * i + h]);
        }
    return r;
}
template <class Block, bool Q5> static float mm_q8dot_k45(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const Block *b = (const Block *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        uint8_t sc[8], mn[8];
        mm_k4_scales(b[i].scales, sc, mn);
        const int8_t *x = xq + QL_QK_K * i;
        int s = 0, m = 0;
        for (int g = 0; g < 4; g++) {
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                int c0 = b[i].qs[32 * g + l] & 15, c1 = b[i].qs[32 * g + l] >> 4;
                if constexpr (Q5) c0 |= ((b[i].qh[l] >> (2 * g)) & 1) << 4, c1 |= ((b[i].qh[l] >> (2 * g + 1)) & 1) << 4;
                s0 += c0 * x[64 * g + l];
                s1 += c1 * x[64 * g + 32 + l];
            }
            s += sc[2 * g] * s0 + sc[2 * g + 1] * s1;
        }
        for (int t = 0; t < 8; t++) m += mn[t] * (bsum[16 * i + 2 * t] + bsum[16 * i + 2 * t + 1]);
        r += (float)s * (mm_h2f(b[i].d) * xd[i]) - (float)m * (mm_h2f(b[i].dmin) * xd[i]);
    }
    return r;
}
static float mm_q8dot_q6_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q6_K *b = (const ql_block_q6_K *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        const int8_t *x = xq + QL_QK_K * i;
        int s = 0;
        for (int h = 0; h < 2; h++)
            for (int m = 0; m < 4; m++)
                for (int l = 0; l < 32; l++) {
                    const int lo = b[i].ql[64 * h + 32 * (m & 1) + l], top = b[i].qh[32 * h + l];
                    const int q = (((m < 2 ? lo : lo >> 4) & 15) | (((top >> (2 * m)) & 3) << 4)) - 32;
                    s += b[i].scales[8 * h + 2 * m + l / 16] * q * x[128 * h + 32 * m + l];
                }
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}

static float mm_q8dot_iq4_nl(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_iq4_nl *b = (const ql_block_iq4_nl *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / 32; i++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += k_iq4_values[b[i].qs[j] & 15] * xq[32 * i + j] + k_iq4_values[b[i].qs[j] >> 4] * xq[32 * i + j + 16];
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}
static float mm_q8dot_iq4_xs(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_iq4_xs *b = (const ql_block_iq4_xs *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        int s = 0;
        for (int t = 0; t < 8; t++) {
            const int ls = ((b[i].scales_l[t / 2] >> 4 * (t % 2)) & 15) | ((b[i].scales_h >> 2 * t) & 3) << 4;
            const uint8_t *qs = b[i].qs + 16 * t;
            const int8_t *x = xq + QL_QK_K * i + 32 * t;
            int u = 0;
            for (int j = 0; j < 16; j++) u += k_iq4_values[qs[j] & 15] * x[j] + k_iq4_values[qs[j] >> 4] * x[j + 16];
            s += (ls - 32) * u;
        }
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}
// Q4_1, Q5_0, Q5_1: codes c (0..15 or 0..31); Q5_0's x = d (c - 16), the others' d c + m
template <ql_type T> static float mm_q8dot_32(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum) {
    float r = 0.0f;
    const size_t bs = T == QL_TYPE_Q4_1 ? sizeof(ql_block_q4_1) : T == QL_TYPE_Q5_0 ? sizeof(ql_block_q5_0) : sizeof(ql_block_q5_1);
    for (int64_t i = 0; i < K / 32; i++) {
        const uint8_t *blk = w + (size_t)i * bs;
        int c[32];
        uint16_t d, m = 0;
        memcpy(&d, blk, 2);
        if (T == QL_TYPE_Q4_1) {
            const ql_block_q4_1 *q = (const ql_block_q4_1 *)blk;
            for (int j = 0; j < 16; j++) c[j] = q->qs[j] & 15, c[j + 16] = q->qs[j] >> 4;
            m = q->m;
        } else if (T == QL_TYPE_Q5_0) {
            ql_q5_codes(((const ql_block_q5_0 *)blk)->qs, ((const ql_block_q5_0 *)blk)->qh, c);
        } else {
            ql_q5_codes(((const ql_block_q5_1 *)blk)->qs, ((const ql_block_q5_1 *)blk)->qh, c);
            m = ((const ql_block_q5_1 *)blk)->m;
        }
        int s = 0;
        for (int j = 0; j < 32; j++) s += c[j] * xq[32 * i + j];
        const int xs = bsum[2 * i] + bsum[2 * i + 1];
        if (T == QL_TYPE_Q5_0) r += (float)(s - 16 * xs) * (mm_h2f(d) * xd[i]);
        else r += (float)s * (mm_h2f(d) * xd[i]) + (float)xs * (mm_h2f(m) * xd[i]);
    }
    return r;
}
static float mm_q8dot_q4_1(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_32<QL_TYPE_Q4_1>(K, w, xq, xd, bsum);
}
static float mm_q8dot_q5_0(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_32<QL_TYPE_Q5_0>(K, w, xq, xd, bsum);
}
static float mm_q8dot_q5_1(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_32<QL_TYPE_Q5_1>(K, w, xq, xd, bsum);
}

static float mm_q8dot_q3_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *, const float *) {
    const ql_block_q3_K *b = (const ql_block_q3_K *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        int8_t sc[16];
        mm_k3_scales(b[i].scales, sc);
        int s = 0;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    const int q = ((b[i].qs[32 * h + l] >> 2 * k) & 3) - ((b[i].hmask[l] >> (4 * h + k)) & 1 ? 0 : 4);
                    s += sc[8 * h + 2 * k + l / 16] * q * xq[QL_QK_K * i + 128 * h + 32 * k + l];
                }
        r += (float)s * (mm_h2f(b[i].d) * xd[i]);
    }
    return r;
}
static float mm_q8dot_q2_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    const ql_block_q2_K *b = (const ql_block_q2_K *)w;
    float r = 0.0f;
    for (int64_t i = 0; i < K / QL_QK_K; i++) {
        int s = 0, m = 0;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++)
                    s += (b[i].scales[8 * h + 2 * k + l / 16] & 15) * ((b[i].qs[32 * h + l] >> 2 * k) & 3) * xq[QL_QK_K * i + 128 * h + 32 * k + l];
        for (int t = 0; t < 16; t++) m += (b[i].scales[t] >> 4) * bsum[16 * i + t];
        r += (float)s * (mm_h2f(b[i].d) * xd[i]) - (float)m * (mm_h2f(b[i].dmin) * xd[i]);
    }
    return r;
}
#endif
static float mm_q8dot_q4_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_k45<ql_block_q4_K, false>(K, w, xq, xd, bsum);
}
static float mm_q8dot_q5_K(int64_t K, const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *bsum, const float *) {
    return mm_q8dot_k45<ql_block_q5_K, true>(K, w, xq, xd, bsum);
}

// ---- Q4_0 repacked in groups of 8 rows (ql_backend_cache_weights on the CPU) ----
// Per group of 8 rows and block of 32, 144 bytes: the 8 rows' d, then for q = 0..3 the 8 rows'
// code bytes 4q..4q+3. One 4-byte product sum (vpdpbusd, or maddubs + madd) then adds to each
// row's own 32-bit lane: no horizontal sums, one scale conversion for 8 rows, one stream of
// weights. On a 1B shape's weights decode's products read it 1.15-2x faster than rows
// (bench/RESULTS.md, session 21; llama.cpp's REPACK keeps Q4_0 so too). The integer block sums
// are mm_q8dot_q4_0's; a row sums its blocks in f32 one after another (the rows' kernel: 8 lanes
// in two chains), so the two differ in the last bits, within the same bound. The prompt GEMM
// packs its panels from it with the same bytes (mm_q8g_pack): the rows' results bit for bit.
static constexpr int64_t MM_R8_BLOCK = 144;
// Made only where prompts have the int8 GEMM too (AVX-512 VNNI): elsewhere a prompt's exact path
// reads the rows, which would then be resident beside the copy (the weights' memory twice). VL:
// vpdpbusd on 256 bits, whose sums NF4's unsigned table bytes need (maddubs' int16 pairs saturate).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
static constexpr bool k_mm_r8 = true;
#else
static constexpr bool k_mm_r8 = false;
#endif
// Q4_K likewise (mm_k8_*), per group of 8 rows and super-block of 256, 1184 bytes: the 8 rows' d,
// then their dmin (f16); the 8 sub-blocks' scales unpacked to bytes [sub-block][row]; the mins as
// bytes [sub-block pair][row][2] (one madd takes a pair); then for g = 0..3 and q = 0..7 the 8
// rows' code bytes 32g + 4q .. + 3 (low nibbles sub-block 2g, high 2g + 1). 2.8% more bytes than
// the rows, whose 6-bit scales each row's kernel unpacked again for every token.
static constexpr int64_t MM_K8_BLOCK = 1184;
static constexpr int MM_K8_SC = 32, MM_K8_MN = 96, MM_K8_QS = 160;  // offsets in a block
// Q6_K likewise (mm_q6r8_*), 1680 bytes (the rows' own size): the 8 rows' d (f16); the 16
// sub-blocks' scales [sub-block][row] (int8); then for h = 0..1 and q = 0..7 three runs of the 8
// rows' 4 bytes: ql 64h + 4q .., ql 64h + 32 + 4q .., qh 32h + 4q .. - together the 6-bit codes of
// elements 128h + 32m + 4q .. + 3 for m = 0..3.
static constexpr int64_t MM_Q6R8_BLOCK = 1680;
static constexpr int MM_Q6R8_SC = 16, MM_Q6R8_QS = 144;
// NF4 (and NF4_NODQ) likewise (mm_n8_*), per group of 8 rows and block of 64, 288 bytes: the 8
// rows' absmax / 127 (f32: the rows' kernel's scale, the double quantisation undone once here
// instead of per row and token), then for q = 0..7 the 8 rows' 4 bytes whose low nibbles are codes
// 4q .. 4q + 3 and high nibbles codes 32 + 4q .. (a block's halves: the activations' two blocks of
// 32). 9% more bytes than the rows with double quantisation (4.5 bits a weight against 4.13).
static constexpr int64_t MM_N8_BLOCK = 288;
static constexpr int MM_N8_QS = 32;
static bool mm_nf4_type(ql_type t) { return t == QL_TYPE_NF4 || t == QL_TYPE_NF4_NODQ; }
static bool mm_r8_type(ql_type t) { return t == QL_TYPE_Q4_0 || t == QL_TYPE_Q4_K || t == QL_TYPE_Q6_K || mm_nf4_type(t); }
static bool mm_r8_ok(const ql_tensor *w) {  // a weight these layouts take (NF4: rows of whole blocks of 64)
    return k_mm_r8 && mm_r8_type(w->type) && w->ne[1] % 8 == 0 && w->ne[2] == 1 && w->ne[3] == 1 &&
           (!mm_nf4_type(w->type) || w->ne[0] % QL_NF4_BLOCK == 0);
}
static int64_t mm_r8_elems(ql_type t) {  // elements of a row in one of the layout's blocks
    return mm_nf4_type(t) ? QL_NF4_BLOCK : mm_q8_block(t);
}
static int64_t mm_r8_block(ql_type t) {  // bytes a group of 8 rows takes per block of mm_r8_elems(t) elements
    return t == QL_TYPE_Q6_K ? MM_Q6R8_BLOCK : t == QL_TYPE_Q4_K ? MM_K8_BLOCK : mm_nf4_type(t) ? MM_N8_BLOCK : MM_R8_BLOCK;
}
static size_t mm_r8_group_bytes(ql_type t, int64_t K) {  // a group of 8 rows, whole
    return (size_t)(K / mm_r8_elems(t)) * (size_t)mm_r8_block(t);
}
static size_t mm_r8_bytes(const ql_tensor *w) { return (size_t)(w->ne[1] / 8) * mm_r8_group_bytes(w->type, w->ne[0]); }
// groups [g0, g1) of a weight's rows (row_stride apart) into its layout: each of a group's 8
// rows' block b put into the group's block by put(p, r, block)
template <class Block, class Put>
static void mm_r8_groups(const uint8_t *src, int64_t nb, int64_t g0, int64_t g1, size_t row_stride, int64_t bytes, uint8_t *dst, Put put) {
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++) put(dst + (size_t)(g * nb + b) * bytes, r, ((const Block *)(src + (size_t)(8 * g + r) * row_stride))[b]);
}
// aux: NF4's side data (the absmax of block i of the weight is that of elements [64 i, 64 i + 64):
// rows contiguous, whole blocks)
static void mm_r8_pack(ql_type t, const uint8_t *src, const void *aux, int64_t K, int64_t g0, int64_t g1, size_t row_stride,
                       uint8_t *dst) {
    const int64_t nb = K / mm_r8_elems(t), bytes = mm_r8_block(t);
    if (mm_nf4_type(t)) {  // a row's block: 32 bytes, element 2j in byte j's high nibble, 2j + 1 in its low
        for (int64_t g = g0; g < g1; g++)
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *p = dst + (size_t)(g * nb + b) * bytes;
                for (int r = 0; r < 8; r++) {
                    const int64_t blk = (8 * g + r) * nb + b;
                    const uint8_t *c = src + (size_t)(8 * g + r) * row_stride + 32 * b;
                    uint8_t e[64];
                    for (int j = 0; j < 32; j++) e[2 * j] = c[j] >> 4, e[2 * j + 1] = c[j] & 15;
                    const float sc = (t == QL_TYPE_NF4 ? nf4_aux(aux).absmax(blk) : ((const float *)aux)[blk]) / 127.0f;
                    memcpy(p + 4 * r, &sc, 4);
                    for (int q = 0; q < 8; q++)
                        for (int i = 0; i < 4; i++) p[MM_N8_QS + 32 * q + 4 * r + i] = (uint8_t)(e[4 * q + i] | e[32 + 4 * q + i] << 4);
                }
            }
        return;
    }
    if (t == QL_TYPE_Q4_0)
        mm_r8_groups<ql_block_q4_0>(src, nb, g0, g1, row_stride, bytes, dst, [](uint8_t *p, int r, const ql_block_q4_0 &s) {
            memcpy(p + 2 * r, &s.d, 2);
            for (int q = 0; q < 4; q++) memcpy(p + 16 + 32 * q + 4 * r, s.qs + 4 * q, 4);
        });
    else if (t == QL_TYPE_Q4_K)
        mm_r8_groups<ql_block_q4_K>(src, nb, g0, g1, row_stride, bytes, dst, [](uint8_t *p, int r, const ql_block_q4_K &s) {
            memcpy(p + 2 * r, &s.d, 2);
            memcpy(p + 16 + 2 * r, &s.dmin, 2);
            uint8_t sc[8], mn[8];
            mm_k4_scales(s.scales, sc, mn);
            for (int u = 0; u < 8; u++) {
                p[MM_K8_SC + 8 * u + r] = sc[u];
                p[MM_K8_MN + 16 * (u / 2) + 2 * r + u % 2] = mn[u];
            }
            for (int q = 0; q < 32; q++) memcpy(p + MM_K8_QS + 32 * q + 4 * r, s.qs + 4 * q, 4);  // q = 8 g + q'
        });
    else
        mm_r8_groups<ql_block_q6_K>(src, nb, g0, g1, row_stride, bytes, dst, [](uint8_t *p, int r, const ql_block_q6_K &s) {
            memcpy(p + 2 * r, &s.d, 2);
            for (int u = 0; u < 16; u++) p[MM_Q6R8_SC + 8 * u + r] = (uint8_t)s.scales[u];
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 8; q++) {
                    uint8_t *o = p + MM_Q6R8_QS + 96 * (8 * h + q) + 4 * r;
                    memcpy(o, s.ql + 64 * h + 4 * q, 4);
                    memcpy(o + 32, s.ql + 64 * h + 32 + 4 * q, 4);
                    memcpy(o + 64, s.qh + 32 * h + 4 * q, 4);
                }
        });
}
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// a group of 8 rows (p: its first block) against one activation row: codes xq, scales xd, 16-sums bsum
static inline __m256 mm_r8_group(const uint8_t *p, int64_t nb, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += MM_R8_BLOCK) {
        const int8_t *x = xq + 32 * b;
        __m256i s = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {  // low nibbles: elements 4q..4q+3, high: 16 + 4q..
            const __m256i c = mm_ld(p + 16 + 32 * q);
            int32_t lo, hi;
            memcpy(&lo, x + 4 * q, 4);
            memcpy(&hi, x + 16 + 4 * q, 4);
            s = mm_dpbusd(s, _mm256_and_si256(c, m4), _mm256_set1_epi32(lo));
            s = mm_dpbusd(s, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_set1_epi32(hi));
        }
        s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * (bsum[2 * b] + bsum[2 * b + 1])));  // the codes are q - 8
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd[b])), acc);
    }
    return acc;
}
// NF4's group (mm_n8_*): the codes through the table as unsigned bytes, int8 value + 128 (vpdpbusd
// multiplies unsigned by signed; its 32-bit sums do not saturate), less 128 times the activation's
// block sum (its two 16-sums); each half of 32 times its row's absmax / 127 and its own d_x. The
// integer sums are the rows' kernel's (mm_q8dot_nf4), so are the f32 products; only the order in
// which a row's blocks are added differs.
static inline __m256 mm_n8_group(const uint8_t *p, int64_t nb, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const __m256i m4 = _mm256_set1_epi8(15), lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_nf4_u8.data()));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb / 2; b++, p += MM_N8_BLOCK) {  // nb: blocks of 32, two a block of 64
        const int8_t *x = xq + 64 * b;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int q = 0; q < 8; q++) {  // low nibbles: elements 4q..4q+3, high: 32 + 4q..
            const __m256i c = mm_ld(p + MM_N8_QS + 32 * q);
            int32_t lo, hi;
            memcpy(&lo, x + 4 * q, 4);
            memcpy(&hi, x + 32 + 4 * q, 4);
            s0 = mm_dpbusd(s0, _mm256_shuffle_epi8(lut, _mm256_and_si256(c, m4)), _mm256_set1_epi32(lo));
            s1 = mm_dpbusd(s1, _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4)), _mm256_set1_epi32(hi));
        }
        const int16_t *bs = bsum + 4 * b;
        s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(128 * (bs[0] + bs[1])));
        s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(128 * (bs[2] + bs[3])));
        const __m256 w = _mm256_loadu_ps((const float *)p);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(w, _mm256_set1_ps(xd[2 * b])), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(w, _mm256_set1_ps(xd[2 * b + 1])), acc);
    }
    return acc;
}
// Q4_K's group (mm_k8_*): per sub-block an integer sum for each of the 8 rows, times the rows'
// scales; the mins' part per row sum_s m_s bsum_s (the activation's sub-block sums, two per madd)
static inline __m256 mm_k8_group(const uint8_t *p, int64_t nb, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += MM_K8_BLOCK) {
        const int8_t *x = xq + QL_QK_K * b;
        __m256i isum = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int q = 0; q < 8; q++) {  // low nibbles: elements 64g + 4q .., high: 64g + 32 + 4q .. (two chains each)
                const __m256i c = mm_ld(p + MM_K8_QS + 32 * (8 * g + q));
                int32_t lo, hi;
                memcpy(&lo, x + 64 * g + 4 * q, 4);
                memcpy(&hi, x + 64 * g + 32 + 4 * q, 4);
                s[q & 1] = mm_dpbusd(s[q & 1], _mm256_and_si256(c, m4), _mm256_set1_epi32(lo));
                s[2 + (q & 1)] = mm_dpbusd(s[2 + (q & 1)], _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_set1_epi32(hi));
            }
            const __m256i s0 = _mm256_add_epi32(s[0], s[1]), s1 = _mm256_add_epi32(s[2], s[3]);
            const __m256i sc0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + MM_K8_SC + 16 * g)));
            const __m256i sc1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + MM_K8_SC + 16 * g + 8)));
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1)));
        }
        const int16_t *bs = bsum + 16 * b;
        __m256i ms = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {  // sub-blocks 2t, 2t + 1
            const uint32_t pair = (uint16_t)(bs[4 * t] + bs[4 * t + 1]) | (uint32_t)(uint16_t)(bs[4 * t + 2] + bs[4 * t + 3]) << 16;
            const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + MM_K8_MN + 16 * t)));
            ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn, _mm256_set1_epi32((int32_t)pair)));
        }
        const __m256 dx = _mm256_set1_ps(xd[b]);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dm, dx), accm);
    }
    return _mm256_sub_ps(acc, accm);
}
// Q6_K's group (mm_q6r8_*): per sub-block of 16 an integer sum for each row, less 32 times the
// activation's 16-sum (the codes are q - 32), times the rows' scales
static inline __m256 mm_q6r8_group(const uint8_t *p, int64_t nb, const int8_t *xq, const float *xd, const int16_t *bsum) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += MM_Q6R8_BLOCK) {
        const int8_t *x = xq + QL_QK_K * b;
        const int16_t *bs = bsum + 16 * b;
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i a[8];  // [m][s]: sub-block 8h + 2m + s
            for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_si256();
            for (int q = 0; q < 8; q++) {
                const uint8_t *u = p + MM_Q6R8_QS + 96 * (8 * h + q);
                const __m256i A = mm_ld(u), B = mm_ld(u + 32), H = mm_ld(u + 64);
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
                c[1] = _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
                c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
                c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
                for (int m = 0; m < 4; m++) {
                    int32_t xv;
                    memcpy(&xv, x + 128 * h + 32 * m + 4 * q, 4);
                    a[2 * m + q / 4] = mm_dpbusd(a[2 * m + q / 4], c[m], _mm256_set1_epi32(xv));
                }
            }
            for (int k = 0; k < 8; k++) {
                const int sub = 8 * h + k;
                const __m256i t = _mm256_sub_epi32(a[k], _mm256_set1_epi32(32 * bs[sub]));
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(t, _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + MM_Q6R8_SC + 8 * sub)))));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xd[b])), acc);
    }
    return acc;
}
#endif

static mm_q8_dot_fn mm_q8_dot_of(ql_type t) {
    switch (t) {
    case QL_TYPE_Q4_0: return mm_q8dot_q4_0;
    case QL_TYPE_Q8_0: return mm_q8dot_q8_0;
    case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: return mm_q8dot_nf4;
    case QL_TYPE_Q4_K: return mm_q8dot_q4_K;
    case QL_TYPE_Q6_K: return mm_q8dot_q6_K;
    case QL_TYPE_Q5_K: return mm_q8dot_q5_K;
    case QL_TYPE_IQ4_XS: return mm_q8dot_iq4_xs;
    case QL_TYPE_IQ4_NL: return mm_q8dot_iq4_nl;
    case QL_TYPE_Q4_1: return mm_q8dot_q4_1;
    case QL_TYPE_Q5_0: return mm_q8dot_q5_0;
    case QL_TYPE_Q5_1: return mm_q8dot_q5_1;
    case QL_TYPE_Q3_K: return mm_q8dot_q3_K;
    case QL_TYPE_Q2_K: return mm_q8dot_q2_K;
    default: return nullptr;
    }
}

// columns [jb, je) for all N rows: the N activation rows quantised (by every thread, each into
// its own workspace: a few thousand elements against the weight's megabytes), then weight rows
// dotted with them
static void mm_q8(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K, int64_t N,
                  int64_t jb, int64_t je, uint8_t *work) {
    const int qb = mm_q8_block(w.type);
    const mm_xq xq = mm_q8_carve(work, N, K, qb);
    for (int64_t i = 0; i < N; i++)
        mm_q8_quantize_row((const float *)(x.p + i * x.smn), K, qb, xq.q + i * K, xq.d + i * (K / qb),
                           mm_q8_bsum(w.type) || w.r8 ? xq.bsum + i * (K / 16) : nullptr);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (w.r8) {  // groups of 8 rows (jb, je: multiples of 8), each against every activation row
        // (a group's whole row at once: tiles of groups a chunk of K at a time, to keep the chunk's
        // activations in L1, broke the weights' streams up - 10 against 25 GB/s at K = 8192)
        const int64_t nb = K / qb;
        auto group = w.type == QL_TYPE_Q4_K ? mm_k8_group : w.type == QL_TYPE_Q6_K ? mm_q6r8_group : mm_nf4_type(w.type) ? mm_n8_group : mm_r8_group;
        const size_t gb = mm_r8_group_bytes(w.type, K);
        alignas(32) float y[8];
        for (int64_t g = jb / 8; g < je / 8; g++)
            for (int64_t i = 0; i < N; i++) {
                _mm256_store_ps(y, group(w.r8 + (size_t)g * gb, nb, xq.q + i * K, xq.d + i * nb, xq.bsum + i * (K / 16)));
                for (int r = 0; r < 8; r++) {
                    const int64_t o = i * ldc + 8 * g + r;
                    c[o] = ci ? ci[o] + y[r] : y[r];
                }
            }
        return;
    }
#endif
    const mm_q8_dot_fn dot = mm_q8_dot_of(w.type);
    const bool nf4 = w.type == QL_TYPE_NF4 || w.type == QL_TYPE_NF4_NODQ;
    for (int64_t j = jb; j < je; j++) {
        const uint8_t *row = w.p + j * w.smn;
        if (nf4) {  // the row's absmax per block of 64 (K % 64 == 0: blocks start at the row)
            const int64_t b0 = (int64_t)(row - w.root_data) * 2 / QL_NF4_BLOCK;
            if (w.type == QL_TYPE_NF4) {
                const nf4_aux a(w.aux);
                for (int64_t b = 0; b < K / 64; b++) xq.wsc[b] = a.absmax(b0 + b) / 127.0f;
            } else {
                for (int64_t b = 0; b < K / 64; b++) xq.wsc[b] = ((const float *)w.aux)[b0 + b] / 127.0f;
            }
        }
        for (int64_t i = 0; i < N; i++) {
            const float r = dot(K, row, xq.q + i * K, xq.d + i * (K / qb), xq.bsum + i * (K / 16), xq.wsc);
            c[i * ldc + j] = ci ? ci[i * ldc + j] + r : r;
        }
    }
}

// ---- prompts: the 8-bit activations over many rows of b (an int8 GEMM) ----
// Decode's kernel dots one weight row with one activation row: a prompt's N rows would unpack each
// weight row N times, and its 8-lane sums reach a third of what the bf16 GEMM does. Here a panel
// of 16 weight rows is unpacked once into int8 codes: per block of 32, eight groups of 4 elements,
// each group the 16 rows' 4 bytes (one zmm), then per row its scales and 128 times its code sums.
// The activations are quantised per block of 32 for every type (decode's k-quant kernels use 256)
// and kept as unsigned bytes, code + 128. vpdpbusd of a group with one activation row's 4 bytes
// broadcast adds 4 products to each of 16 rows, so a block is 8 instructions for 16 rows (512
// multiply-adds); started from -128 sum w it is the integer block sum of the codes, then scaled in
// f32 and added, block after block. Each output has one thread: no dependence on the thread count.
// AVX-512 VNNI only (elsewhere a prompt keeps the exact packed GEMM). Per kind:
//   plain (Q4_0 q - 8, Q8_0, NF4 through k_nf4_i8): d_w d_x sum;
//   mins (Q4_K: q, scale d sc_s, min dmin m_s): d sc d_x sum - dmin m d_x sum(x codes);
//   halves (Q6_K: q - 32, a scale per 16): the block's two halves summed apart, d sc each.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr bool k_mm_q8g = true;
#else
static constexpr bool k_mm_q8g = false;
#endif
static constexpr int MM_Q8G_ROWS = 16;  // weight rows a panel (zmm lanes)
static constexpr int MM_Q8G_TOK = 8;    // activation rows a kernel call
enum mm_q8g_kind { MM_Q8G_PLAIN, MM_Q8G_MINS, MM_Q8G_HALVES };
static int mm_q8g_kind_of(ql_type t) {
    switch (t) {
    case QL_TYPE_Q4_0: case QL_TYPE_Q8_0: case QL_TYPE_NF4: case QL_TYPE_NF4_NODQ: return MM_Q8G_PLAIN;
    case QL_TYPE_Q5_0: case QL_TYPE_IQ4_NL: case QL_TYPE_IQ4_XS: return MM_Q8G_PLAIN;
    case QL_TYPE_Q4_K: case QL_TYPE_Q5_K: case QL_TYPE_Q4_1: case QL_TYPE_Q5_1: return MM_Q8G_MINS;
    case QL_TYPE_Q6_K: case QL_TYPE_Q3_K: return MM_Q8G_HALVES;
    default: return -1;  // (Q2_K: a scale and a min per 16, no panel kind for both: its prompts take the exact path)
    }
}
static bool mm_q8g_type(ql_type t) { return k_mm_q8g && mm_q8g_kind_of(t) >= 0; }
// a panel's block: 512 bytes of codes, then 16-lane rows of f32 / int32: plain and mins [scale,
// -128 sum], mins [min], halves [scale lo, scale hi, -128 sum lo, -128 sum hi]
static size_t mm_q8g_block_bytes(int kind) { return 512 + 64 * (kind == MM_Q8G_PLAIN ? 2 : kind == MM_Q8G_MINS ? 3 : 4); }
static size_t mm_q8g_work(int64_t N, int64_t K, ql_type t) {  // [N, K] bytes, [N, K/32] scales and code sums, one panel
    return mm_q8_round((size_t)(N * K)) + 2 * mm_q8_round((size_t)(N * (K / 32)) * 4) + (size_t)(K / 32) * mm_q8g_block_bytes(mm_q8g_kind_of(t)) +
           64;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// weight rows [j0, j0 + nr) as a panel (rows past nr: zeros)
static void mm_q8g_pack(const mm_operand &w, int64_t K, int64_t j0, int64_t nr, uint8_t *pan) {
    const int kind = mm_q8g_kind_of(w.type);
    const bool nf4 = w.type == QL_TYPE_NF4 || w.type == QL_TYPE_NF4_NODQ;
    const int64_t nb = K / 32;
    const size_t bb = mm_q8g_block_bytes(kind);
    memset(pan, 0, (size_t)nb * bb);
    int8_t v[32];
    auto put = [](uint8_t *p, int r, float f) { memcpy(p + 4 * r, &f, 4); };
    auto put_i = [](uint8_t *p, int r, int32_t i) { memcpy(p + 4 * r, &i, 4); };
    if (w.r8 && w.type == QL_TYPE_Q4_0) {  // Q4_0 repacked (mm_r8_*): a row's 4 code bytes of a group are 4 low and 4 high codes
        auto less8 = [](uint32_t c) { return ((c | 0x80808080u) - 0x08080808u) ^ 0x80808080u; };  // 4 codes (0..15) - 8 as int8
        auto sum4 = [](uint32_t c) { return (int32_t)((c * 0x01010101u) >> 24); };                 // 4 codes' sum (<= 60)
        for (int64_t b = 0; b < nb; b++) {  // a block's 8-row groups whole, one after the other
            uint8_t *pb = pan + (size_t)b * bb;
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *p = w.r8 + (size_t)(((j0 + r) / 8) * nb + b) * MM_R8_BLOCK;
                const int l = (int)((j0 + r) % 8);
                int32_t s = -256;  // 32 codes' - 8
                for (int q = 0; q < 4; q++) {
                    uint32_t c;
                    memcpy(&c, p + 16 + 32 * q + 4 * l, 4);
                    const uint32_t lo = c & 0x0f0f0f0fu, hi = (c >> 4) & 0x0f0f0f0fu, vl = less8(lo), vh = less8(hi);
                    memcpy(pb + q * 64 + r * 4, &vl, 4);
                    memcpy(pb + (q + 4) * 64 + r * 4, &vh, 4);
                    s += sum4(lo) + sum4(hi);
                }
                uint16_t dh;
                memcpy(&dh, p + 2 * l, 2);
                put(pb + 512, (int)r, mm_h2f(dh));
                put_i(pb + 576, (int)r, -128 * s);
            }
        }
        return;
    }
    if (w.r8 && nf4) {  // repacked (mm_n8_*): block b is half b % 2 of the 64-block b / 2 (low nibbles, or high)
        const size_t gb = mm_r8_group_bytes(w.type, K);
        const __m256i m4 = _mm256_set1_epi8(15), lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_nf4_u8.data()));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = pan + (size_t)b * bb;
            const int sh = 4 * (int)(b % 2);
            for (int64_t r = 0; r < nr; r++) {
                const int l = (int)((j0 + r) % 8);
                const uint8_t *p = w.r8 + (size_t)((j0 + r) / 8) * gb + (size_t)(b / 2) * MM_N8_BLOCK;
                alignas(32) int32_t w4[8];  // the row's 4 code bytes 32 apart, 8 times
                for (int q = 0; q < 8; q++) memcpy(&w4[q], p + MM_N8_QS + 32 * q + 4 * l, 4);
                __m256i cv = _mm256_load_si256((const __m256i *)w4);
                cv = _mm256_and_si256(sh ? _mm256_srli_epi16(cv, 4) : cv, m4);
                const __m256i u = _mm256_shuffle_epi8(lut, cv);  // value + 128
                const __m256i s16 = _mm256_sad_epu8(u, _mm256_setzero_si256());
                const int32_t s = _mm256_extract_epi32(s16, 0) + _mm256_extract_epi32(s16, 2) + _mm256_extract_epi32(s16, 4) +
                                  _mm256_extract_epi32(s16, 6) - 32 * 128;
                _mm256_store_si256((__m256i *)w4, _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)));  // the int8 values
                for (int q = 0; q < 8; q++) memcpy(pb + q * 64 + r * 4, &w4[q], 4);
                float d;
                memcpy(&d, p + 4 * l, 4);
                put(pb + 512, (int)r, d);
                put_i(pb + 576, (int)r, -128 * s);
            }
        }
        return;
    }
    if (w.r8 && w.type == QL_TYPE_Q4_K) {  // repacked (mm_k8_*): the rows' codes, scales and mins, a block's rows in turn
        const __m256i m4 = _mm256_set1_epi8(15);
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = pan + (size_t)b * bb;
            const int sb = (int)(b % 8), g = sb / 2;
            for (int64_t r = 0; r < nr; r++) {
                const int64_t l8 = (j0 + r) % 8;
                const uint8_t *p = w.r8 + (size_t)(((j0 + r) / 8) * (K / QL_QK_K) + b / 8) * MM_K8_BLOCK;
                const uint8_t *cq = p + MM_K8_QS + 256 * g + 4 * l8;  // the row's 4 code bytes 32 apart, 8 times
                alignas(32) int32_t w4[8];
                for (int q = 0; q < 8; q++) memcpy(&w4[q], cq + 32 * q, 4);
                __m256i cv = _mm256_load_si256((const __m256i *)w4);
                if (sb % 2) cv = _mm256_srli_epi16(cv, 4);
                cv = _mm256_and_si256(cv, m4);
                _mm256_store_si256((__m256i *)w4, cv);
                for (int q = 0; q < 8; q++) memcpy(pb + q * 64 + r * 4, &w4[q], 4);
                const __m256i s16 = _mm256_sad_epu8(cv, _mm256_setzero_si256());  // the 32 codes' sum (>= 0), 8 at a time
                const int32_t sum = _mm256_extract_epi32(s16, 0) + _mm256_extract_epi32(s16, 2) + _mm256_extract_epi32(s16, 4) +
                                    _mm256_extract_epi32(s16, 6);
                uint16_t dh, mh;
                memcpy(&dh, p + 2 * l8, 2);
                memcpy(&mh, p + 16 + 2 * l8, 2);
                put(pb + 512, (int)r, mm_h2f(dh) * p[MM_K8_SC + 8 * sb + l8]);
                put_i(pb + 576, (int)r, -128 * sum);
                put(pb + 640, (int)r, mm_h2f(mh) * p[MM_K8_MN + 16 * (sb / 2) + 2 * l8 + sb % 2]);
            }
        }
        return;
    }
    if (w.r8 && w.type == QL_TYPE_Q6_K) {  // repacked (mm_q6r8_*): the rows' codes and scales, a block's rows in turn
        const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
        for (int64_t b = 0; b < nb; b++) {  // elements 128h + 32m + l
            uint8_t *pb = pan + (size_t)b * bb;
            const int h = (int)(b % 8) / 4, m = (int)(b % 4);
            for (int64_t r = 0; r < nr; r++) {
                const int64_t l8 = (j0 + r) % 8;
                const uint8_t *p = w.r8 + (size_t)(((j0 + r) / 8) * (K / QL_QK_K) + b / 8) * MM_Q6R8_BLOCK;
                const uint8_t *u = p + MM_Q6R8_QS + 96 * 8 * h + 4 * l8;
                alignas(32) int32_t lw[8], hw[8];
                for (int q = 0; q < 8; q++) {
                    memcpy(&lw[q], u + 96 * q + 32 * (m & 1), 4);
                    memcpy(&hw[q], u + 96 * q + 64, 4);
                }
                __m256i lo = _mm256_load_si256((const __m256i *)lw), top = _mm256_load_si256((const __m256i *)hw);
                if (m >= 2) lo = _mm256_srli_epi16(lo, 4);
                top = _mm256_srli_epi16(top, 2 * m);
                const __m256i code = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(_mm256_and_si256(top, m3), 4));  // 0..63
                const __m256i s16 = _mm256_sad_epu8(code, _mm256_setzero_si256());
                const int32_t slo = _mm256_extract_epi32(s16, 0) + _mm256_extract_epi32(s16, 2) - 16 * 32;
                const int32_t shi = _mm256_extract_epi32(s16, 4) + _mm256_extract_epi32(s16, 6) - 16 * 32;
                _mm256_store_si256((__m256i *)lw, _mm256_sub_epi8(code, _mm256_set1_epi8(32)));
                for (int q = 0; q < 8; q++) memcpy(pb + q * 64 + r * 4, &lw[q], 4);
                uint16_t dh;
                memcpy(&dh, p + 2 * l8, 2);
                const float dd = mm_h2f(dh);
                put(pb + 512, (int)r, dd * (int8_t)p[MM_Q6R8_SC + 8 * (8 * h + 2 * m) + l8]);
                put(pb + 576, (int)r, dd * (int8_t)p[MM_Q6R8_SC + 8 * (8 * h + 2 * m + 1) + l8]);
                put_i(pb + 640, (int)r, -128 * slo);
                put_i(pb + 704, (int)r, -128 * shi);
            }
        }
        return;
    }
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = w.p + (j0 + r) * w.smn;
        const int64_t b0 = nf4 ? (int64_t)(row - w.root_data) * 2 / QL_NF4_BLOCK : 0;  // the row's first block of 64
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = pan + (size_t)b * bb;
            float d = 0, d2 = 0, mn = 0;  // the block's scale (halves: lo, hi), Q4_K's min
            if (w.type == QL_TYPE_Q4_0) {
                const ql_block_q4_0 &q = ((const ql_block_q4_0 *)row)[b];
#if defined(__SSE2__)
                const __m128i c = _mm_loadu_si128((const __m128i *)q.qs), m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
                _mm_storeu_si128((__m128i *)v, _mm_sub_epi8(_mm_and_si128(c, m4), e8));
                _mm_storeu_si128((__m128i *)(v + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(c, 4), m4), e8));
#else
                for (int k = 0; k < 16; k++) v[k] = (int8_t)((q.qs[k] & 15) - 8), v[k + 16] = (int8_t)((q.qs[k] >> 4) - 8);
#endif
                d = mm_h2f(q.d);
            } else if (w.type == QL_TYPE_Q8_0) {
                const ql_block_q8_0 &q = ((const ql_block_q8_0 *)row)[b];
                memcpy(v, q.qs, 32);
                d = mm_h2f(q.d);
            } else if (nf4) {  // block b is half of the 64-block b/2, whose element 2j sits in byte j's high nibble
                const uint8_t *c = row + 32 * (b / 2) + 16 * (b % 2);
#if defined(__SSSE3__)
                const __m128i lut = _mm_loadu_si128((const __m128i *)k_nf4_i8), m4 = _mm_set1_epi8(15), cc = _mm_loadu_si128((const __m128i *)c);
                const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(cc, 4), m4)), lo = _mm_shuffle_epi8(lut, _mm_and_si128(cc, m4));
                _mm_storeu_si128((__m128i *)v, _mm_unpacklo_epi8(hi, lo));
                _mm_storeu_si128((__m128i *)(v + 16), _mm_unpackhi_epi8(hi, lo));
#else
                for (int k = 0; k < 16; k++) v[2 * k] = k_nf4_i8[c[k] >> 4], v[2 * k + 1] = k_nf4_i8[c[k] & 15];
#endif
                d = (w.type == QL_TYPE_NF4 ? nf4_aux(w.aux).absmax(b0 + b / 2) : ((const float *)w.aux)[b0 + b / 2]) / 127.0f;
            } else if (w.type == QL_TYPE_Q4_1 || w.type == QL_TYPE_Q5_0 || w.type == QL_TYPE_Q5_1 || w.type == QL_TYPE_IQ4_NL) {
                int c[32];  // codes in Q4_0's order; Q4_1 / Q5_1: x = d c + m (a min of -m)
                if (w.type == QL_TYPE_Q4_1 || w.type == QL_TYPE_IQ4_NL) {
                    const uint8_t *qs = w.type == QL_TYPE_Q4_1 ? ((const ql_block_q4_1 *)row)[b].qs : ((const ql_block_iq4_nl *)row)[b].qs;
                    for (int k = 0; k < 16; k++) c[k] = qs[k] & 15, c[k + 16] = qs[k] >> 4;
                } else if (w.type == QL_TYPE_Q5_0) {
                    ql_q5_codes(((const ql_block_q5_0 *)row)[b].qs, ((const ql_block_q5_0 *)row)[b].qh, c);
                } else {
                    ql_q5_codes(((const ql_block_q5_1 *)row)[b].qs, ((const ql_block_q5_1 *)row)[b].qh, c);
                }
                for (int k = 0; k < 32; k++)
                    v[k] = (int8_t)(w.type == QL_TYPE_IQ4_NL ? k_iq4_values[c[k]] : w.type == QL_TYPE_Q5_0 ? c[k] - 16 : c[k]);
                d = mm_h2f(w.type == QL_TYPE_Q4_1 ? ((const ql_block_q4_1 *)row)[b].d : w.type == QL_TYPE_Q5_0 ? ((const ql_block_q5_0 *)row)[b].d
                           : w.type == QL_TYPE_Q5_1 ? ((const ql_block_q5_1 *)row)[b].d : ((const ql_block_iq4_nl *)row)[b].d);
                if (w.type == QL_TYPE_Q4_1) mn = -mm_h2f(((const ql_block_q4_1 *)row)[b].m);
                if (w.type == QL_TYPE_Q5_1) mn = -mm_h2f(((const ql_block_q5_1 *)row)[b].m);
            } else if (w.type == QL_TYPE_IQ4_XS) {  // sub-block s = b % 8: nibbles qs[16 s ..], scale d (ls - 32)
                const ql_block_iq4_xs &q = ((const ql_block_iq4_xs *)row)[b / 8];
                const int s = (int)(b % 8), ls = ((q.scales_l[s / 2] >> 4 * (s % 2)) & 15) | ((q.scales_h >> 2 * s) & 3) << 4;
                for (int k = 0; k < 16; k++) v[k] = k_iq4_values[q.qs[16 * s + k] & 15], v[k + 16] = k_iq4_values[q.qs[16 * s + k] >> 4];
                d = mm_h2f(q.d) * (float)(ls - 32);
            } else if (w.type == QL_TYPE_Q3_K) {  // block b % 8 = 4 h + k: bits 2k of qs[32 h + l], bit 4h + k of hmask[l]
                const ql_block_q3_K &q = ((const ql_block_q3_K *)row)[b / 8];
                const int h = (int)(b % 8) / 4, k = (int)(b % 4);
                int8_t sc[16];
                mm_k3_scales(q.scales, sc);
                for (int l = 0; l < 32; l++) v[l] = (int8_t)(((q.qs[32 * h + l] >> 2 * k) & 3) - ((q.hmask[l] >> (4 * h + k)) & 1 ? 0 : 4));
                d = mm_h2f(q.d) * sc[8 * h + 2 * k];
                d2 = mm_h2f(q.d) * sc[8 * h + 2 * k + 1];
            } else if (w.type == QL_TYPE_Q4_K || w.type == QL_TYPE_Q5_K) {  // sub-block s = b % 8: 2g in qs[32 g ..]'s low
                // nibbles, 2g + 1 the high; Q5_K's fifth bit: bit sb of qh[l]
                const ql_block_q4_K *k4 = w.type == QL_TYPE_Q4_K ? (const ql_block_q4_K *)row + b / 8 : nullptr;
                const ql_block_q5_K *k5 = k4 ? nullptr : (const ql_block_q5_K *)row + b / 8;
                const uint8_t *qs = k4 ? k4->qs : k5->qs;
                const int sb = (int)(b % 8), g = sb / 2;
                uint8_t sc[8], m8[8];
                mm_k4_scales(k4 ? k4->scales : k5->scales, sc, m8);
                for (int l = 0; l < 32; l++)
                    v[l] = (int8_t)((sb % 2 ? qs[32 * g + l] >> 4 : qs[32 * g + l] & 15) | (k5 ? ((k5->qh[l] >> sb) & 1) << 4 : 0));
                d = mm_h2f(k4 ? k4->d : k5->d) * sc[sb];
                mn = mm_h2f(k4 ? k4->dmin : k5->dmin) * m8[sb];
            } else {  // Q6_K: elements 128 h + 32 m + l, a scale per 16
                const ql_block_q6_K &q = ((const ql_block_q6_K *)row)[b / 8];
                const int h = (int)(b % 8) / 4, m = (int)(b % 4);
                for (int l = 0; l < 32; l++) {
                    const int lo = q.ql[64 * h + 32 * (m & 1) + l], top = q.qh[32 * h + l];
                    v[l] = (int8_t)((((m < 2 ? lo : lo >> 4) & 15) | (((top >> (2 * m)) & 3) << 4)) - 32);
                }
                d = mm_h2f(q.d) * q.scales[8 * h + 2 * m];
                d2 = mm_h2f(q.d) * q.scales[8 * h + 2 * m + 1];
            }
            for (int g = 0; g < 8; g++) memcpy(pb + g * 64 + r * 4, v + 4 * g, 4);
            int32_t lo = 0, hi = 0;
            for (int k = 0; k < 16; k++) lo += v[k], hi += v[k + 16];
            put(pb + 512, (int)r, d);
            if (kind == MM_Q8G_HALVES) {
                put(pb + 576, (int)r, d2);
                put_i(pb + 640, (int)r, -128 * lo);
                put_i(pb + 704, (int)r, -128 * hi);
            } else {
                put_i(pb + 576, (int)r, -128 * (lo + hi));
                if (kind == MM_Q8G_MINS) put(pb + 640, (int)r, mn);
            }
        }
    }
}

// NT activation rows (u8 codes xu, K apart; per block of 32 their scales xd and d_x sum(codes) xm,
// K/32 apart) times a panel: out[t][r]
template <int NT, int KIND>
static void mm_q8g_kernel(const uint8_t *pan, int64_t K, const uint8_t *xu, const float *xd, const float *xm, float out[][MM_Q8G_ROWS]) {
    const int64_t nb = K / 32;
    const size_t bb = mm_q8g_block_bytes(KIND);
    __m512 acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = pan + (size_t)b * bb;
        __m512i wg[8];
        for (int g = 0; g < 8; g++) wg[g] = _mm512_load_si512((const void *)(pb + 64 * g));
        const __m512 ws = _mm512_load_ps((const float *)(pb + 512));
        if (KIND == MM_Q8G_HALVES) {
            const __m512 ws2 = _mm512_load_ps((const float *)(pb + 576));
            const __m512i o1 = _mm512_load_si512((const void *)(pb + 640)), o2 = _mm512_load_si512((const void *)(pb + 704));
            for (int t = 0; t < NT; t++) {
                const uint8_t *x = xu + t * K + 32 * b;
                __m512i s1 = o1, s2 = o2;
                for (int g = 0; g < 4; g++) {
                    int32_t x1, x2;
                    memcpy(&x1, x + 4 * g, 4);
                    memcpy(&x2, x + 16 + 4 * g, 4);
                    s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x1), wg[g]);
                    s2 = _mm512_dpbusd_epi32(s2, _mm512_set1_epi32(x2), wg[g + 4]);
                }
                const __m512 dx = _mm512_set1_ps(xd[t * nb + b]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(ws, dx), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(ws2, dx), acc[t]);
            }
            continue;
        }
        const __m512i noff = _mm512_load_si512((const void *)(pb + 576));
        for (int t = 0; t < NT; t++) {
            const uint8_t *x = xu + t * K + 32 * b;
            __m512i s = noff;  // -128 sum w: the activations' offset taken out up front
            for (int g = 0; g < 8; g++) {
                int32_t x4;
                memcpy(&x4, x + 4 * g, 4);
                s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(x4), wg[g]);
            }
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(xd[t * nb + b])), acc[t]);
            if (KIND == MM_Q8G_MINS)
                acc[t] = _mm512_fnmadd_ps(_mm512_load_ps((const float *)(pb + 640)), _mm512_set1_ps(xm[t * nb + b]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(out[t], acc[t]);
}

template <int KIND>
static void mm_q8g_rows(const uint8_t *pan, int64_t K, int64_t nt, const uint8_t *xu, const float *xd, const float *xm,
                        float out[][MM_Q8G_ROWS]) {
    const int64_t nb = K / 32;
    if (nt == MM_Q8G_TOK) return mm_q8g_kernel<MM_Q8G_TOK, KIND>(pan, K, xu, xd, xm, out);
    for (int64_t t = 0; t < nt; t++) mm_q8g_kernel<1, KIND>(pan, K, xu + t * K, xd + t * nb, xm + t * nb, out + t);
}
#endif

// columns [jb, je) of c for all N rows of x (jb a multiple of 16)
static void mm_q8g(const mm_operand &w, const mm_operand &x, float *c, const float *ci, int64_t ldc, int64_t K, int64_t N,
                   int64_t jb, int64_t je, uint8_t *work) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    const int64_t nb = K / 32;
    const int kind = mm_q8g_kind_of(w.type);
    uint8_t *p = (uint8_t *)(((uintptr_t)work + 63) / 64 * 64);
    uint8_t *xu = p;
    float *xd = (float *)(p + mm_q8_round((size_t)(N * K)));
    float *xm = (float *)((uint8_t *)xd + mm_q8_round((size_t)(N * nb) * 4));
    uint8_t *pan = (uint8_t *)xm + mm_q8_round((size_t)(N * nb) * 4);
    for (int64_t i = 0; i < N; i++) {  // decode's codes, stored + 128 (the sign bit flipped)
        int8_t *q = (int8_t *)xu + i * K;
        mm_q8_quantize_row((const float *)(x.p + i * x.smn), K, 32, q, xd + i * nb, nullptr);
        for (int64_t b = 0; b < nb; b++) {
            int32_t sum = 0;
            for (int k = 0; k < 32; k++) sum += q[32 * b + k];
            xm[i * nb + b] = (float)sum * xd[i * nb + b];
        }
        for (int64_t k = 0; k < K; k += 64)
            _mm512_storeu_si512((void *)(q + k), _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + k)), _mm512_set1_epi8((char)0x80)));
    }
    alignas(64) float out[MM_Q8G_TOK][MM_Q8G_ROWS];
    for (int64_t j0 = jb; j0 < je; j0 += MM_Q8G_ROWS) {
        const int64_t nr = std::min<int64_t>(MM_Q8G_ROWS, je - j0);
        mm_q8g_pack(w, K, j0, nr, pan);
        for (int64_t i0 = 0; i0 < N; i0 += MM_Q8G_TOK) {
            const int64_t nt = std::min<int64_t>(MM_Q8G_TOK, N - i0);
            if (kind == MM_Q8G_PLAIN) mm_q8g_rows<MM_Q8G_PLAIN>(pan, K, nt, xu + i0 * K, xd + i0 * nb, xm + i0 * nb, out);
            else if (kind == MM_Q8G_MINS) mm_q8g_rows<MM_Q8G_MINS>(pan, K, nt, xu + i0 * K, xd + i0 * nb, xm + i0 * nb, out);
            else mm_q8g_rows<MM_Q8G_HALVES>(pan, K, nt, xu + i0 * K, xd + i0 * nb, xm + i0 * nb, out);
            for (int64_t t = 0; t < nt; t++)
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t o = (i0 + t) * ldc + j0 + r;
                    c[o] = ci ? ci[o] + out[t][r] : out[t][r];
                }
        }
    }
#else
    (void)w, (void)x, (void)c, (void)ci, (void)ldc, (void)K, (void)N, (void)jb, (void)je, (void)work;
    QL_ASSERT(!"mm_q8g without AVX-512 VNNI");
#endif
}

// One multiply, split into tasks over (batch, column chunk, row chunk); thread ith takes
// tasks ith, ith + nth, ...
struct mm_problem {
    mm_operand w, x;        // batch 0
    float *c;
    const float *ci;        // ql_mul_mat_acc's c (laid out as c), else NULL
    int64_t M, N, K, ldc;
    int64_t n_batch, B2;    // batches of b (and c); a is broadcast over them
    int64_t r2, r3;         // b batches per a batch
    size_t wb2, wb3, xb2, xb3, cb2, cb3;  // batch strides in bytes
    bool q8;                // the 8-bit activations' path (mm_q8) takes it
    ql_type ct = QL_TYPE_F32;         // the result's type; a 16-bit one is made through mm_stage (c: its bytes)
    float alpha = 1.0f;               // ql_mul_mat_scaled_to's s: each sum times it in the staging block, then stored
    const uint8_t *ci16 = nullptr;    // ql_mul_mat_acc's 16-bit c, else NULL
    // mul_mat_dropped's epilogue (an f32 result made through mm_stage): each sum dropped out by
    // its index ((row0 + i) ldc + j: the whole result's mask) before ci is added - so c may be ci
    // itself (in place): a sub-tile's elements of ci are read just before the same ones are stored
    bool drop = false;
    uint64_t drop_key = 0;
    uint32_t drop_thr = 0;
    float drop_scale = 1.0f;
    int64_t drop_row0 = 0;
};

// A 16-bit result is made a sub-tile at a time in f32 in the thread's staging block (after the
// kernels' workspace): at most MM_STAGE_ROWS x MM_NC, then c (16-bit) added and the sum rounded
// once as it is stored. The kernels see the staging block as their C, so every element's sum is
// the f32 result's: the bits of ql_cast(ql_add(c, ql_mul_mat(a, b))).
static constexpr int MM_STAGE_ROWS = 4 * MM_MC;

// How nth threads share a multiply: tasks of [ib, ie) rows x [jb, je) columns, nj x ni of them per
// batch (split inside the matrix when there are fewer batches than threads)
struct mm_split {
    bool dot;
    int64_t align, nj, ni;
};
static bool mm_uses_dot(const mm_problem &P);
static mm_split mm_split_of(const mm_problem &P, int nth) {
    mm_split s;
    s.dot = mm_uses_dot(P);
    // column chunks: whole register panels, and whole blocks where the weight's rows run along them
    s.align = s.dot ? 4 : P.w.trows ? std::max<int64_t>(MM_NR, traits(P.w.type).blck_size) : MM_NR;
    s.nj = 1, s.ni = 1;
    if (P.n_batch < nth) {
        const int64_t want = (nth + P.n_batch - 1) / P.n_batch;
        s.nj = std::min<int64_t>(want, std::max<int64_t>(1, (P.M + s.align - 1) / s.align));
        if (!s.dot) s.ni = std::min<int64_t>((want + s.nj - 1) / s.nj, std::max<int64_t>(1, P.N));
    }
    return s;
}
// a thread's packing workspace: sized by its largest task's columns (a split over the threads'
// columns packs only its share of W: the plan then counts the pages a thread touches), all of b's
// rows (the AMX path's bf16 X block, rows rounded up to 32, needs the f32 block's room)
static mm_layout mm_task_layout(const mm_problem &P, int nth) {
    const mm_split s = mm_split_of(P, nth);
    const int64_t col_units = (P.M + s.align - 1) / s.align;
    return mm_layout_of(std::min<int64_t>(P.M, (col_units + s.nj - 1) / s.nj * s.align), P.N, P.K);
}
// a thread's staging block for a 16-bit result: its largest task's rows (at most MM_STAGE_ROWS,
// all of them on the dot path) x columns (at most MM_NC), + one row of c - sized to what a task
// touches, so that the plan is what becomes resident
static size_t mm_stage_floats(const mm_problem &P, int nth) {
    const mm_split s = mm_split_of(P, nth);
    const int64_t col_units = (P.M + s.align - 1) / s.align;
    const int64_t cols = std::min<int64_t>(P.M, (col_units + s.nj - 1) / s.nj * s.align), rows = (P.N + s.ni - 1) / s.ni;
    const int64_t n = std::min<int64_t>(cols, MM_NC);
    return (size_t)((s.dot ? rows : std::min<int64_t>(rows, MM_STAGE_ROWS)) * n + n);
}

static bool mm_uses_dot(const mm_problem &P) {
    return P.N <= MM_DOT_MAX_N && mm_k_contig(P.w) && P.x.type == QL_TYPE_F32 && mm_k_contig(P.x);
}

static void mm_run_tasks(const mm_problem &P, int ith, int nth, float *work) {
    if (P.q8) {  // one batch, columns in chunks of 16 (whole cache lines of C for one row)
        const int64_t units = (P.M + 15) / 16;
        const int64_t jb = std::min(P.M, units * ith / nth * 16), je = std::min(P.M, units * (ith + 1) / nth * 16);
        if (jb < je && P.N > MM_Q8_MAX_N) mm_q8g(P.w, P.x, P.c, P.ci, P.ldc, P.K, P.N, jb, je, (uint8_t *)work);
        else if (jb < je) mm_q8(P.w, P.x, P.c, P.ci, P.ldc, P.K, P.N, jb, je, (uint8_t *)work);
        return;
    }
    const mm_split sp = mm_split_of(P, nth);
    const bool dot = sp.dot;
    // (N >= 16: the bf16 X block, rows rounded up to 32, then fits the f32 X block's room)
    const bool amx = P.x.type == QL_TYPE_BF16 && P.K % 32 == 0 && P.K > 0 && P.N >= 16 && mm_amx_ready();
    const bool dp = !amx && !dot && k_mm_dp && P.x.type == QL_TYPE_BF16 && P.K % 2 == 0 && P.K > 0;
    const int64_t align = sp.align, nj = sp.nj, ni = sp.ni;
    const int64_t n_tasks = P.n_batch * nj * ni;
    const mm_layout L = mm_task_layout(P, nth);
    const int64_t col_units = (P.M + align - 1) / align;
    for (int64_t t = ith; t < n_tasks; t += nth) {
        const int64_t bt = t / (nj * ni), cj = (t / ni) % nj, ci = t % ni;
        const int64_t i2 = bt % P.B2, i3 = bt / P.B2;
        const int64_t jb = std::min(P.M, col_units * cj / nj * align), je = std::min(P.M, col_units * (cj + 1) / nj * align);
        const int64_t ib = P.N * ci / ni, ie = P.N * (ci + 1) / ni;
        if (jb >= je || ib >= ie) continue;
        mm_operand w = P.w, x = P.x;
        w.p += (i2 / P.r2) * P.wb2 + (i3 / P.r3) * P.wb3;
        x.p += i2 * P.xb2 + i3 * P.xb3;
        // C's rows [i0, i1) x columns [j0, j1), row stride ldc
        auto run = [&](float *c, const float *cin, int64_t ldc, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
            if (dot)
                mm_dot(w, x, c, cin, ldc, P.K, P.N, j0, j1, work, L);
            else if (amx)
                mm_amx(w, x, c, cin, ldc, P.K, i0, i1, j0, j1, work, L);
            else if (dp)
                mm_dp(w, x, c, cin, ldc, P.K, i0, i1, j0, j1, work, L);
            else
                mm_packed(w, x, c, cin, ldc, P.K, i0, i1, j0, j1, work, L);
        };
        if (P.ct == QL_TYPE_F32 && !P.drop && P.alpha == 1.0f) {
            float *c = (float *)((uint8_t *)P.c + i2 * P.cb2 + i3 * P.cb3);
            run(c, P.ci ? (const float *)((const uint8_t *)P.ci + i2 * P.cb2 + i3 * P.cb3) : nullptr, P.ldc, ib, ie, jb, je);
            continue;
        }
        const ql_type_traits &tt = traits(P.ct);
        uint8_t *c16 = (uint8_t *)P.c + i2 * P.cb2 + i3 * P.cb3;
        const uint8_t *ci16 = P.ci16 ? P.ci16 + i2 * P.cb2 + i3 * P.cb3 : nullptr;
        float *st = work + L.total;
        const int64_t rs = dot ? P.N : MM_STAGE_ROWS;  // the dot path takes every row at once (N <= MM_DOT_MAX_N)
        for (int64_t i0 = ib; i0 < ie; i0 += rs)
            for (int64_t j0 = jb; j0 < je; j0 += MM_NC) {
                const int64_t i1 = std::min(ie, i0 + rs), j1 = std::min(je, j0 + MM_NC), n = j1 - j0;
                float *crow = st + (i1 - i0) * n;
                run(st - (i0 * n + j0), nullptr, n, i0, i1, j0, j1);  // C's (i, j) at st[(i - i0) n + j - j0]
                if (P.drop) {  // the result's row bt N + i (contiguous: batches follow each other)
                    // c (f32, the result's shape) at the result's element offset; a 16-bit result
                    // the f32 sum rounded once as it is stored
                    const float *cib = P.ci ? P.ci + (i2 * P.cb2 + i3 * P.cb3) / tt.type_size : nullptr;
                    for (int64_t i = i0; i < i1; i++) {
                        float *s = st + (i - i0) * n;
                        const int64_t row = P.drop_row0 + bt * P.N + i;
                        dropout_row(n, s, s, P.drop_key, (uint64_t)(row * P.ldc + j0), P.drop_thr, P.drop_scale);
                        if (cib)
                            for (int64_t j = 0; j < n; j++) s[j] = cib[i * P.ldc + j0 + j] + s[j];  // ql_add's order: the sum so far + this
                        if (P.ct == QL_TYPE_F32) memcpy((float *)c16 + i * P.ldc + j0, s, (size_t)n * sizeof(float));
                        else tt.from_float(s, c16 + (size_t)(i * P.ldc + j0) * tt.type_size, n);
                    }
                    continue;
                }
                for (int64_t i = i0; i < i1; i++) {
                    float *s = st + (i - i0) * n;
                    const size_t o = (size_t)(i * P.ldc + j0) * tt.type_size;
                    if (P.alpha != 1.0f) row_scale(n, P.alpha, s, s);  // (ql_scale_to's product: the same bits)
                    if (ci16) {
                        tt.to_float(ci16 + o, crow, n);
                        for (int64_t j = 0; j < n; j++) s[j] = crow[j] + s[j];
                    }
                    tt.from_float(s, c16 + o, n);
                }
            }
    }
}

// A block-quantized weight transposed for dx = dy W: a transpose view over dense block rows.
static bool mm_is_trows(const ql_tensor *a) {
    return traits(a->type).blck_size > 1 && a->op == QL_OP_TRANSPOSE && ql_rows_contiguous(a->view_src);
}

static mm_problem mm_problem_of(const ql_tensor *dst) {
    const ql_tensor *a = dst->src[0], *b = dst->src[1];
    mm_problem P;
    const bool trows = mm_is_trows(a);
    const ql_tensor *rows = trows ? a->view_src : a;  // the tensor whose rows hold the blocks
    const ql_tensor *root = view_root(const_cast<ql_tensor *>(rows));
    const bool side = traits(a->type).aux_bytes != nullptr;
    P.w = {(const uint8_t *)a->data, (int64_t)(trows ? rows->nb[1] : a->nb[0]), (int64_t)(trows ? 0 : a->nb[1]),
           a->type, trows, side ? ql_aux_data(root) : nullptr, (const uint8_t *)root->data};
    P.x = {(const uint8_t *)b->data, (int64_t)b->nb[0], (int64_t)b->nb[1], b->type, false, nullptr, nullptr};
    if (b->type != QL_TYPE_F32 && a->type != b->type) P.w.round = b->type;
    const ql_weight_copy *cp = (a->flags & QL_FLAG_CACHED) ? (const ql_weight_copy *)a->extra : nullptr;
    if (cp && !trows && cp->type == a->type && mm_r8_type(a->type))
        P.w.r8 = (const uint8_t *)cp->data;  // (the CPU's copies)
    P.c = (float *)dst->data;
    P.ct = dst->type;
    P.alpha = ql_mul_mat_alpha(dst);
    const bool c16 = dst->type != QL_TYPE_F32;  // ql_mul_mat_acc's c has the result's type
    P.ci = dst->src[2] && !c16 ? (const float *)dst->src[2]->data : nullptr;  // contiguous, dst's shape: dst's strides
    P.ci16 = dst->src[2] && c16 ? (const uint8_t *)dst->src[2]->data : nullptr;
    P.M = a->ne[1];
    P.N = b->ne[1];
    P.K = a->ne[0];
    P.ldc = dst->ne[0];
    P.B2 = b->ne[2];
    P.n_batch = b->ne[2] * b->ne[3];
    P.r2 = b->ne[2] / a->ne[2];
    P.r3 = b->ne[3] / a->ne[3];
    P.wb2 = a->nb[2]; P.wb3 = a->nb[3];
    P.xb2 = b->nb[2]; P.xb3 = b->nb[3];
    P.cb2 = dst->nb[2]; P.cb3 = dst->nb[3];
    // one weight for all batches and evenly spaced X rows: one tall multiply instead of many
    const bool even = b->nb[2] == b->nb[1] * (size_t)b->ne[1] && b->nb[3] == b->nb[2] * (size_t)b->ne[2];
    if (a->ne[2] == 1 && a->ne[3] == 1 && P.n_batch > 1 && even) {
        P.N *= P.n_batch;
        P.n_batch = 1;
        P.B2 = 1;
        P.r2 = P.r3 = 1;
    }
    // 8-bit activations: asked for (ql_mul_mat_set_prec), a weight type with an integer kernel read
    // in rows of blocks, few f32 rows of b with dense rows, one batch; NF4: rows of whole blocks of 64
    const int qb = mm_q8_block(a->type);
    const int64_t first = (int64_t)(P.w.p - P.w.root_data);  // NF4: bytes = element pairs
    const bool nf4_whole = (a->type != QL_TYPE_NF4 && a->type != QL_TYPE_NF4_NODQ) ||
                           (P.K % QL_NF4_BLOCK == 0 && first * 2 % QL_NF4_BLOCK == 0 && P.w.smn * 2 % QL_NF4_BLOCK == 0);
    P.q8 = get_param<int32_t>(dst, 0) == QL_TYPE_Q8_0 && qb > 0 && !trows && mm_k_contig(P.w) && b->type == QL_TYPE_F32 &&
           mm_k_contig(P.x) && P.n_batch == 1 && (P.N <= MM_Q8_MAX_N || mm_q8g_type(a->type)) && P.K > 0 && P.K % qb == 0 && nf4_whole && !c16 && P.alpha == 1.0f;
    return P;
}

static void k_mul_mat(const cpu_params &p, ql_tensor *dst) {
    mm_run_tasks(mm_problem_of(dst), p.ith, p.nth, (float *)p.wdata);
}

// ============================================================================================
// 12. CPU backend: a graph run on the thread pool, the interface table, threads, direct sgemm
// ============================================================================================

struct cpu_backend {
    cpu_pool pool;
    std::vector<uint8_t> scratch;  // workspace of direct ql_cpu_sgemm calls (outside graphs)
};

struct cpu_job {
    ql_graph *g = nullptr;
    cpu_pool *pool = nullptr;
    size_t work_per_thread = 0;
    std::atomic<bool> failed{false};  // set by a kernel, any time
    std::atomic<bool> stop{false};    // `failed` as of the last barrier: what every thread acts on
    std::mutex mu;
    char err[512] = {0};
    int nonfinite_node = -1;  // check_finite's find
    int64_t nonfinite_elem = 0;
    bool nonfinite_nan = false;
};

// ---- the product with a dropped-out operand (QL_OP_MUL_MAT_DROPOUT), in the oracle's form ----
// Pass 0 writes D = dropout(x) in the product's type by k_dropout's rows (the bits of
// ql_dropout_rows_to's result) at the start of the graph's workspace, shared: each thread's
// workspace holds a share of it. Pass 1 is ql_mul_mat over D: the same bits as the unfused pair.
// Each thread's own workspace (the product's, or k_dropout's rows) follows D.
static size_t mmd_d_bytes(const ql_tensor *node, const ql_tensor &d) {  // (the result dropped: none)
    const int slot = get_param<int32_t>(node, 4);
    return slot == 2 ? 0 : align_up((size_t)ql_nelements(node->src[slot]) * ql_plain_size(d.type), QL_ALIGN);
}
static size_t cpu_work_per_thread(const ql_tensor *node, int nth);
// mul_mat_dropped's (slot 2) multiply: mm's, with the dropout and c in its epilogue
static mm_problem mmd_problem(const ql_tensor *node, const ql_tensor &mm) {
    mm_problem P = mm_problem_of(&mm);
    const float pr = get_param<float>(node, 0);
    P.drop = true;
    P.drop_key = ql_dropout_key(((const int32_t *)node->src[2]->data)[0], get_param<uint32_t>(node, 1));
    P.drop_thr = ql_dropout_threshold(pr);
    P.drop_scale = 1.0f / (1.0f - pr);
    P.drop_row0 = get_param<int64_t>(node, 2);
    P.ci = node->src[3] ? (const float *)node->src[3]->data : nullptr;
    P.ct = node->type;  // (mm's is f32: a 16-bit result's strides are the node's)
    P.cb2 = node->nb[2], P.cb3 = node->nb[3];
    return P;
}
static size_t mmd_thread_work(const ql_tensor *node, const ql_tensor &mm, int nth) {
    const int slot = get_param<int32_t>(node, 4);
    if (slot == 2) {  // the product's workspace, then its staging block (mm_run_tasks)
        const mm_problem P = mm_problem_of(&mm);
        return align_up((mm_task_layout(P, nth).total + mm_stage_floats(P, nth)) * sizeof(float), QL_ALIGN);
    }
    const size_t rows = 2 * (size_t)node->src[slot]->ne[0] * sizeof(float);  // k_dropout's
    return align_up(std::max(cpu_work_per_thread(&mm, nth), rows), QL_ALIGN);
}
static void k_mul_mat_dropout(const cpu_params &p, ql_tensor *dst) {
    if (get_param<int32_t>(dst, 4) == 2) {  // the product a sub-tile at a time, each sum dropped and c added as it is stored
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(dst, &mm, &d, nullptr);
        return mm_run_tasks(mmd_problem(dst, mm), p.ith, p.nth, (float *)p.wdata);
    }
    const ql_tensor *x = dst->src[get_param<int32_t>(dst, 4)];
    uint8_t *base = p.job->g->work;
    ql_tensor mm, d;
    ql_mul_mat_dropout_product(dst, &mm, &d, base);
    cpu_params q = p;
    q.wdata = base + mmd_d_bytes(dst, d) + (size_t)p.ith * mmd_thread_work(dst, mm, p.nth);
    if (p.pass == 1) return k_mul_mat(q, &mm);
    ql_tensor dn = *dst;  // a QL_OP_DROPOUT node writing D: x's rows, contiguous
    dn.op = QL_OP_DROPOUT;
    dn.type = d.type;
    for (int i = 0; i < 4; i++) dn.ne[i] = x->ne[i];
    dn.nb[0] = ql_plain_size(d.type);
    for (int i = 1; i < 4; i++) dn.nb[i] = dn.nb[i - 1] * (size_t)dn.ne[i - 1];
    dn.data = base;
    for (ql_tensor *&s : dn.src) s = nullptr;
    dn.src[0] = (ql_tensor *)x;
    dn.src[1] = dst->src[2];
    k_dropout(q, &dn);
}

static void cpu_fail(const cpu_params &p, const char *fmt, ...) {
    std::lock_guard<std::mutex> lk(p.job->mu);
    if (p.job->failed.load()) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p.job->err, sizeof(p.job->err), fmt, ap);
    va_end(ap);
    p.job->failed.store(true);
}

static int cpu_n_passes(const ql_tensor *node) {
    switch (node->op) {
    case QL_OP_GET_ROWS_BACK: case QL_OP_VIEW_BACK: case QL_OP_CROSS_ENTROPY:
        return 2;  // zero (or per-row) first, then combine
    case QL_OP_MUL_MAT_DROPOUT:  // the dropped operand, then the product (the result dropped: the product alone)
        return get_param<int32_t>(node, 4) == 2 ? 1 : 2;
    default:
        return 1;
    }
}

static void k_copy_bytes(const cpu_params &p, ql_tensor *dst) {  // contiguous, same shape and type
    int64_t b, e;
    split_range((int64_t)ql_nbytes(dst), p.ith, p.nth, b, e);
    memcpy((uint8_t *)dst->data + b, (const uint8_t *)dst->src[0]->data + b, (size_t)(e - b));
}

static size_t cpu_work_per_thread(const ql_tensor *node, int nth) {
    switch (node->op) {
    case QL_OP_CONT:      return (size_t)node->src[0]->ne[0] * sizeof(float);
    case QL_OP_DROPOUT:   return ((node->type != QL_TYPE_F32) + (node->src[0]->type != QL_TYPE_F32)) * (size_t)node->ne[0] * sizeof(float);
    case QL_OP_SWIGLU:    return node->type == QL_TYPE_F32 ? 0 : 3 * (size_t)node->ne[0] * sizeof(float);
    case QL_OP_SWIGLU_BACK:  // 16-bit a and b: their rows as f32; a 16-bit result: da's and db's rows before rounding
        return ((node->src[0]->type != QL_TYPE_F32) + (node->type != QL_TYPE_F32)) * 2 * (size_t)node->src[0]->ne[0] * sizeof(float);
    case QL_OP_REDUCE_TO: return (size_t)node->src[0]->ne[0] * sizeof(float);
    case QL_OP_CROSS_ENTROPY_BACK: return node->type == QL_TYPE_F32 ? 0 : (size_t)node->ne[0] * sizeof(float);  // a 16-bit result's f32 row
    case QL_OP_RMS_NORM: return node->type == QL_TYPE_F32 ? 0 : (size_t)node->ne[0] * sizeof(float);  // a 16-bit result's f32 row
    case QL_OP_RMS_NORM_BACK: return ((node->src[2] != nullptr) + (node->src[3] != nullptr)) * (size_t)node->ne[0] * sizeof(float);  // dy * w, dx: rows
    case QL_OP_ROPE: case QL_OP_ROPE_BACK: return rope_work(node);
    case QL_OP_FLASH_ATTN: case QL_OP_FLASH_ATTN_BACK: return fa_work(node);
    case QL_OP_MUL_MAT: {
        const mm_problem P = mm_problem_of(node);
        if (P.q8) return P.N > MM_Q8_MAX_N ? mm_q8g_work(P.N, P.K, P.w.type) : mm_q8_work(P.N, P.K, mm_q8_block(P.w.type));
        return (mm_task_layout(P, nth).total + (P.ct == QL_TYPE_F32 && P.alpha == 1.0f ? 0 : mm_stage_floats(P, nth))) * sizeof(float);
    }
    case QL_OP_MUL_MAT_ROWS: {
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        return cpu_work_per_thread(&mm, nth);
    }
    case QL_OP_MUL_MAT_DROPOUT: {  // D shared by the threads (a share each), then each thread's own (k_mul_mat_dropout)
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(node, &mm, &d, nullptr);
        return mmd_thread_work(node, mm, nth) + align_up((mmd_d_bytes(node, d) + (size_t)nth - 1) / (size_t)nth, QL_ALIGN);
    }
    default:              return 0;
    }
}

static void cpu_compute_node(const cpu_params &p, ql_tensor *node) {
    switch (node->op) {
    case QL_OP_FILL:               k_fill(p, node); break;
    case QL_OP_CONT:               k_cont(p, node); break;
    case QL_OP_ADD:                k_binary<false>(p, node); break;
    case QL_OP_MUL:                k_binary<true>(p, node); break;
    case QL_OP_SCALE:              k_scale(p, node); break;
    case QL_OP_SUM:                k_sum(p, node); break;
    case QL_OP_REDUCE_TO:          k_reduce_to(p, node); break;
    case QL_OP_MUL_MAT:            k_mul_mat(p, node); break;
    case QL_OP_MUL_MAT_ROWS: {     // the product, written at its rows of the result (c's storage)
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        k_mul_mat(p, &mm);
        break;
    }
    case QL_OP_GET_ROWS:           k_get_rows(p, node); break;
    case QL_OP_GET_ROWS_BACK:      k_get_rows_back(p, node); break;
    case QL_OP_RMS_NORM:           k_rms_norm(p, node); break;
    case QL_OP_RMS_NORM_BACK:      k_rms_norm_back(p, node); break;
    case QL_OP_ROPE:               k_rope<false>(p, node); break;
    case QL_OP_ROPE_BACK:          k_rope<true>(p, node); break;
    case QL_OP_SILU:               k_silu(p, node); break;
    case QL_OP_SILU_BACK:          k_silu_back(p, node); break;
    case QL_OP_SWIGLU:             k_swiglu(p, node); break;
    case QL_OP_SWIGLU_BACK:        k_swiglu_back(p, node); break;
    case QL_OP_FLASH_ATTN:         k_flash_attn(p, node); break;
    case QL_OP_FLASH_ATTN_BACK:    k_flash_attn_back(p, node); break;
    case QL_OP_CROSS_ENTROPY:      k_cross_entropy(p, node); break;
    case QL_OP_CROSS_ENTROPY_BACK: k_cross_entropy_back(p, node); break;
    case QL_OP_DROPOUT:            k_dropout(p, node); break;
    case QL_OP_MUL_MAT_DROPOUT:    k_mul_mat_dropout(p, node); break;
    case QL_OP_VIEW_BACK:          k_view_back(p, node); break;
    case QL_OP_ADD_ROWS:           k_add_rows(p, node); break;
    case QL_OP_ACC_GRAD:           k_acc_grad(p, node); break;
    case QL_OP_CACHE_STORE:        k_cache_store(p, node); break;
    case QL_OP_TO_HOST:
    case QL_OP_TO_DEVICE:          k_copy_bytes(p, node); break;  // one memory: a copy (the plan is what offload is for here)
    case QL_OP_NONE: case QL_OP_VIEW: case QL_OP_RESHAPE: case QL_OP_PERMUTE: case QL_OP_TRANSPOSE: case QL_OP_WITH_GRAD:
        break;
    case QL_OP_COUNT:
        QL_ASSERT(!"cpu: op out of range");
    }
}

// check_finite: the first non-finite value of a node's result fails the run (the message is
// ql_graph_fail_nonfinite's; the worker reports it once every thread has stopped)
static void cpu_check_finite(const cpu_params &p, const ql_graph *g, size_t i) {
    const ql_tensor *node = g->nodes[i];
    if (!is_float_type(node->type) || traits(node->type).blck_size != 1 || !ql_is_contiguous(node)) return;
    const int64_t n = ql_nelements(node);
    int64_t k = 0;
    float v = 0;
    for (; k < n; k++) {
        traits(node->type).to_float((const uint8_t *)node->data + (size_t)k * traits(node->type).type_size, &v, 1);
        if (!std::isfinite(v)) break;
    }
    if (k == n) return;
    p.job->nonfinite_node = (int)i;
    p.job->nonfinite_elem = k;
    p.job->nonfinite_nan  = std::isnan(v);
    cpu_fail(p, "non-finite");
}

static void cpu_latch_stop(void *arg) {
    cpu_job *job = (cpu_job *)arg;
    job->stop.store(job->failed.load());
}

static void cpu_graph_worker(void *arg, int ith, int nth) {
    cpu_job *job = (cpu_job *)arg;
    ql_graph *g = job->g;
    cpu_params p{ith, nth, 0, g->work + (size_t)ith * job->work_per_thread, job};
    if (g->poison && g->run_first == 0) {
        if (ith == 0) memset(g->buffer, 0xff, g->arena_size);  // NaN everywhere nothing wrote yet
        job->pool->barrier();
    }
    const bool profile = g->profile && g->node_seconds.size() == g->nodes.size();
    for (size_t i = (size_t)g->run_first; i < (size_t)g->run_last; i++) {
        ql_tensor *node = g->nodes[i];
        if (is_noop(node->op)) continue;
        const auto t0 = profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
        for (int pass = 0, np = cpu_n_passes(node); pass < np; pass++) {
            p.pass = pass;
            cpu_compute_node(p, node);
            job->pool->barrier(cpu_latch_stop, job);
        }
        if (profile && ith == 0)
            g->node_seconds[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (g->check_finite && !job->stop.load()) {
            if (ith == 0) cpu_check_finite(p, g, i);
            job->pool->barrier(cpu_latch_stop, job);
        }
        // `stop` changes only inside a barrier, so every thread takes the same branch here
        // (reading `failed` directly let a fast thread fail in the next node first: a hang)
        if (job->stop.load()) break;
        if (g->poison && !g->freed_after[i].empty()) {
            if (ith == 0)
                for (int e : g->freed_after[i]) memset(g->buffer + g->entries[(size_t)e].offset, 0xff, g->entries[(size_t)e].size);
            job->pool->barrier();
        }
    }
}

static bool cpu_supports_op(ql_backend *be, const ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    switch (node->op) {
    case QL_OP_MUL_MAT_ROWS: {
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        return cpu_supports_op(be, &mm);
    }
    case QL_OP_MUL_MAT:
    case QL_OP_GET_ROWS: {
        const ql_type_traits *t = ql_type_traits_get(a->type);
        if (!t || !(t->to_float || t->to_float_aux)) return false;
        if (t->blck_size == 1) return true;
        // blocks: whole blocks per packing step, and rows of blocks (or their transpose for mul_mat)
        return MM_KC % t->blck_size == 0 && (ql_rows_contiguous(a) || (node->op == QL_OP_MUL_MAT && mm_is_trows(a)));
    }
    case QL_OP_CONT: {
        const ql_type_traits *ts = ql_type_traits_get(a->type), *td = ql_type_traits_get(node->type);
        if (!ts || !td || (ts->blck_size > 1 && !ql_rows_contiguous(a))) return false;
        if (a->type == node->type) return !ts->aux_bytes;  // a copy of side data would need its own
        return (ts->to_float || ts->to_float_aux) && td->from_float;
    }
    case QL_OP_COUNT:
        return false;
    default:
        return true;  // every other op is f32 by construction
    }
}

static size_t cpu_work_size(ql_backend *be, const ql_tensor *node) {
    const int nth = ((cpu_backend *)be->impl)->pool.n;
    return align_up(cpu_work_per_thread(node, nth), QL_ALIGN) * (size_t)nth;
}

static void *cpu_buffer_alloc(ql_backend *, size_t size) { return aligned_alloc(QL_ALIGN, align_up(size, QL_ALIGN)); }
static void  cpu_buffer_free(void *ptr) { free(ptr); }

static ql_status cpu_graph_compute(ql_backend *be, ql_graph *g) {
    cpu_backend *cb = (cpu_backend *)be->impl;
    cpu_job job;
    job.g = g;
    job.pool = &cb->pool;
    job.work_per_thread = g->work_size / (size_t)cb->pool.n;
    cb->pool.run(cpu_graph_worker, &job);
    if (job.nonfinite_node >= 0) {
        ql_graph_fail_nonfinite(g, job.nonfinite_node, job.nonfinite_elem, job.nonfinite_nan);
        return g->ctx->status;
    }
    if (job.failed.load()) {
        QL_ERR(g->ctx, QL_ERR_INVALID, "compute: %s", job.err);
        return g->ctx->status;
    }
    return QL_OK;
}

static void cpu_free(ql_backend *be) {
    cpu_backend *cb = (cpu_backend *)be->impl;
    cb->pool.stop();
    delete cb;
    delete be;
}

int ql_cpu_threads_for(int cores, int others_running) { return std::max(1, cores - std::max(0, others_running)); }

int ql_cpu_physical_cores(void) {
    // the cores (not hyper-threads) of the CPUs this process may run on: distinct (package, core)
    // pairs in /sys for the CPUs of its affinity mask (a container's limit included)
    cpu_set_t set;
    CPU_ZERO(&set);
    const bool have_mask = sched_getaffinity(0, sizeof(set), &set) == 0;
    std::set<std::pair<int, int>> cores;
    int cpus = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (have_mask ? !CPU_ISSET(c, &set) : c >= (int)std::thread::hardware_concurrency()) continue;
        cpus++;
        int pkg = -1, core = -1;
        char path[128];
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        if (FILE *f = fopen(path, "r")) {
            if (fscanf(f, "%d", &pkg) != 1) pkg = -1;
            fclose(f);
        }
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        if (FILE *f = fopen(path, "r")) {
            if (fscanf(f, "%d", &core) != 1) core = -1;
            fclose(f);
        }
        cores.insert(core >= 0 ? std::make_pair(pkg, core) : std::make_pair(-1, c));  // no topology: count the CPU
    }
    return std::max(1, cores.empty() ? std::max(1, cpus) : (int)cores.size());
}

int ql_cpu_default_threads(void) {
    // physical cores less the tasks already running on the machine (/proc/loadavg's "running",
    // this process included; the least of 8 samples 1 ms apart: one sample catches passing
    // kernel threads): the pool splits work evenly and meets at barriers, so a thread that shares
    // its core with a busy process makes every other wait - on a 2-core machine with one busy
    // loop, 2 threads generate at 0.4-0.6x the speed of 1 (bench/RESULTS.md). Sampled once, when
    // the backend starts.
    int others = 1 << 20;
    for (int k = 0; k < 8; k++) {
        int running = 0, total = 0;
        double l1, l5, l15;
        FILE *f = fopen("/proc/loadavg", "r");
        const bool ok = f && fscanf(f, "%lf %lf %lf %d/%d", &l1, &l5, &l15, &running, &total) == 5;
        if (f) fclose(f);
        if (!ok) {
            others = 0;  // no /proc: the cores
            break;
        }
        others = std::min(others, running - 1);
        if (others <= 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ql_cpu_threads_for(ql_cpu_physical_cores(), others);
}

void ql_cpu_warn_threads(const char *tool, int n) {
    const int cores = ql_cpu_physical_cores();
    if (n > cores)
        fprintf(stderr, "%s: warning: -t %d is more than the %d physical core%s here: threads sharing a core make the "
                        "others wait at every step (0 or no -t: the cores not busy with other work)\n",
                tool, n, cores, cores == 1 ? "" : "s");
}

// the CPU's weight copies: Q4_0, Q4_K, Q6_K and NF4 repacked in groups of 8 rows (mm_r8_pack), for the
// 8-bit paths
struct cpu_r8_job {
    const ql_tensor *w;
    uint8_t *dst;
};
static void cpu_r8_worker(void *arg, int ith, int nth) {  // a share of the groups each
    const cpu_r8_job *j = (const cpu_r8_job *)arg;
    const int64_t G = j->w->ne[1] / 8;
    mm_r8_pack(j->w->type, (const uint8_t *)j->w->data, ql_aux_data(j->w), j->w->ne[0], G * ith / nth, G * (ith + 1) / nth, j->w->nb[1],
               j->dst);
}
static bool cpu_weight_copy(ql_backend *be, const ql_tensor *w, void *dst, ql_type type, char *err, size_t n) {
    if (type != w->type || !mm_r8_ok(w)) {
        snprintf(err, n, "the CPU keeps only Q4_0, Q4_K, Q6_K and NF4 weights of rows a multiple of 8 (NF4: of whole blocks of 64), repacked, in "
                         "their own type");
        return false;
    }
    cpu_r8_job j = {w, (uint8_t *)dst};
    ql_backend_cpu_parallel(be, cpu_r8_worker, &j);  // (the file's pages faulted in and the copy's first touched: both threads)
    return true;
}

ql_backend *ql_backend_cpu_init(int n_threads) {
    mm_amx_ready();  // asked once, before any worker thread exists
    if (n_threads <= 0) n_threads = ql_cpu_default_threads();
    cpu_backend *cb = new (std::nothrow) cpu_backend();
    ql_backend *be = new (std::nothrow) ql_backend();
    if (!cb || !be) {
        delete cb;
        delete be;
        return nullptr;
    }
    be->iface = {"cpu", cpu_supports_op, cpu_work_size, cpu_buffer_alloc, cpu_buffer_free, cpu_graph_compute, cpu_free,
                 nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, cpu_weight_copy};  // host memory: memcpy, host math
    be->impl = cb;
    be->id = ql_backend_new_id();
    if (!cb->pool.start(n_threads)) {
        delete cb;
        delete be;
        return nullptr;
    }
    return be;
}

bool ql_cpu_bf16_native(void) { return mm_amx_ready() || k_mm_dp; }
bool ql_cpu_repacks(ql_type type) { return k_mm_r8 && mm_r8_type(type); }
const char *ql_cpu_bf16_kind(void) {
    return mm_amx_ready() ? "AMX tiles" : k_mm_dp ? "AVX512-BF16 pair dot products" : nullptr;
}

void ql_backend_cpu_parallel(ql_backend *be, void (*fn)(void *, int, int), void *arg) {
    QL_ASSERT(ql_backend_cpu_n_threads(be) > 0 && fn);
    ((cpu_backend *)be->impl)->pool.run(fn, arg);
}

int ql_backend_cpu_n_threads(const ql_backend *be) {
    return (be && be->iface.graph_compute == cpu_graph_compute) ? ((const cpu_backend *)be->impl)->pool.n : 0;
}

struct sgemm_job {
    mm_problem P;
    uint8_t *work;
    size_t per_thread;
};

static void sgemm_worker(void *arg, int ith, int nth) {
    sgemm_job *j = (sgemm_job *)arg;
    mm_run_tasks(j->P, ith, nth, (float *)(j->work + (size_t)ith * j->per_thread));
}

void ql_cpu_sgemm(ql_backend *be, int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *b,
                  int64_t ldb, float *c, int64_t ldc) {
    QL_ASSERT(ql_backend_cpu_n_threads(be) > 0);
    cpu_backend *cb = (cpu_backend *)be->impl;
    sgemm_job j;
    j.P = mm_problem{};
    j.P.w = {(const uint8_t *)a, 4, lda * 4, QL_TYPE_F32, false, nullptr, nullptr};
    j.P.x = {(const uint8_t *)b, 4, ldb * 4, QL_TYPE_F32, false, nullptr, nullptr};
    j.P.c = c;
    j.P.M = M;
    j.P.N = N;
    j.P.K = K;
    j.P.ldc = ldc;
    j.P.n_batch = j.P.B2 = j.P.r2 = j.P.r3 = 1;
    j.per_thread = align_up(mm_layout_of(M, N, K).total * sizeof(float), QL_ALIGN);
    const size_t need = j.per_thread * (size_t)cb->pool.n + QL_ALIGN;
    if (cb->scratch.size() < need) cb->scratch.resize(need);
    j.work = (uint8_t *)align_up((uintptr_t)cb->scratch.data(), QL_ALIGN);
    cb->pool.run(sgemm_worker, &j);
}

// ============================================================================================
// 13. backend layer: what every backend answers, its buffers, tensor copies, init by name
// ============================================================================================

// Plans and buffers remember the backend by id: a new backend at a freed one's address must
// not inherit its plan (work sizes depend on the thread count).
uint64_t ql_backend_new_id(void) {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
}

void        ql_backend_free(ql_backend *be) { if (be) be->iface.free(be); }
const char *ql_backend_name(const ql_backend *be) { return be ? be->iface.name : "(null)"; }
bool        ql_backend_supports_op(ql_backend *be, const ql_tensor *node) {
    return be && node && (is_noop(node->op) || be->iface.supports_op(be, node));
}

// nodes [first, last) of g on be, once g's buffer and plan are be's (the checks both entry points
// make); the run's range is the whole graph again afterwards
static ql_status graph_compute_nodes(ql_backend *be, ql_graph *g, int first, int last) {
    if (g->ctx->status != QL_OK) return g->ctx->status;
    if (!g->bound || g->buffer_backend != be->id || g->plan_backend != be->id) {
        QL_ERR(g->ctx, QL_ERR_INVALID, "compute: the graph has no buffer on backend %s --> hint: ql_graph_plan and "
                                       "ql_graph_alloc it first", be->iface.name);
        return g->ctx->status;
    }
    graph_bind(g);
    g->run_first = first, g->run_last = last;
    const ql_status st = be->iface.graph_compute(be, g);
    g->run_first = 0, g->run_last = (int)g->nodes.size();
    return st;
}

ql_status ql_backend_graph_compute(ql_backend *be, ql_graph *g) {
    if (!be || !g) return QL_ERR_INVALID;
    return graph_compute_nodes(be, g, 0, (int)g->nodes.size());
}

ql_status ql_backend_graph_compute_range(ql_backend *be, ql_graph *g, int first, int last) {
    if (!be || !g) return QL_ERR_INVALID;
    const int n = (int)g->nodes.size();
    if (last < 0) last = n;
    if (first < 0 || first > last || last > n) {
        QL_ERR(g->ctx, QL_ERR_INVALID, "compute_range: nodes [%d, %d) of a graph of %d", first, last, n);
        return g->ctx->status;
    }
    return graph_compute_nodes(be, g, first, last);
}

// ---- memory a backend owns: buffers and tensor copies (host memory + memcpy for the CPU) ----

const char *ql_buffer_kind_name(ql_buffer_kind k) {
    static const char *names[] = {"device", "host_pinned"};
    static_assert(sizeof(names) / sizeof(names[0]) == QL_BUFFER_KIND_COUNT, "one name per buffer kind");
    return (unsigned)k < QL_BUFFER_KIND_COUNT ? names[k] : "?";
}

struct ql_backend_buffer {
    ql_buffer_kind kind;
    void *base;                // NULL for an empty buffer
    size_t size;
    void (*free_fn)(void *);   // NULL: nothing to free
    std::vector<std::pair<ql_tensor *, void *>> placed;  // ql_backend_place_ctx_tensors: tensor -> its host data
    ql_context *placed_ctx;                               // whose views follow them back
    std::vector<ql_tensor *> cached;                      // ql_backend_cache_weights: the weights whose copies it holds,
    std::vector<ql_weight_copy> copies;                   // and the copies (their `extra`; sized once, never grown)
};

bool ql_backend_is_host(const ql_backend *be) { return be && !be->iface.copy && be->iface.graph_compute; }
// a backend with memory of its own or the host's (not a plan-only one: no copies, no buffers)
static bool holds_memory(const ql_backend *be) { return ql_backend_is_host(be) || (be->iface.copy && be->iface.buffer_alloc); }

ql_backend_buffer *ql_backend_buffer_alloc(ql_backend *be, ql_buffer_kind kind, size_t size) {
    if (!be || (unsigned)kind >= QL_BUFFER_KIND_COUNT) return nullptr;
    if (size > SIZE_MAX - QL_ALIGN) return nullptr;  // (it would round up to 0 bytes)
    if (kind != QL_BUFFER_HOST_PINNED && !be->iface.buffer_alloc) return nullptr;  // a plan-only backend holds no memory
    ql_backend_buffer *b = new (std::nothrow) ql_backend_buffer{kind, nullptr, size, nullptr, {}, nullptr, {}, {}};
    if (!b || size == 0) return b;
    const size_t n = align_up(size, QL_ALIGN);
    if (kind == QL_BUFFER_HOST_PINNED && be->iface.host_alloc) {
        b->base = be->iface.host_alloc(be, n);
        b->free_fn = be->iface.host_free;
    } else if (kind == QL_BUFFER_HOST_PINNED) {
        b->base = cpu_buffer_alloc(be, n);
        b->free_fn = cpu_buffer_free;
    } else {
        b->base = be->iface.buffer_alloc(be, n);
        b->free_fn = be->iface.buffer_free;
    }
    if (!b->base) {
        delete b;
        return nullptr;
    }
    return b;
}

// After leafs moved: every view in ctx whose root moved follows it (views of views in order).
static void ctx_rebind_views(ql_context *ctx) {
    for (ql_tensor *t : ctx->tensors)
        if (t->view_src && t->view_src->data) t->data = (uint8_t *)t->view_src->data + t->view_offs;
}

void ql_backend_buffer_free(ql_backend_buffer *b) {
    if (!b) return;
    for (const auto &p : b->placed) p.first->data = p.second;  // placed tensors: back on their host data
    for (ql_tensor *w : b->cached) {  // cached weights: their products dequantise tiles again
        w->extra = nullptr;
        w->flags &= ~QL_FLAG_CACHED;
    }
    if (b->placed_ctx) ctx_rebind_views(b->placed_ctx);
    if (b->base && b->free_fn) b->free_fn(b->base);
    delete b;
}
void *ql_backend_buffer_host_data(const ql_backend_buffer *b, const ql_tensor *t) {
    if (!b) return nullptr;
    for (const auto &p : b->placed)
        if (p.first == t) return p.second;
    return nullptr;
}
void          *ql_backend_buffer_base(const ql_backend_buffer *b) { return b ? b->base : nullptr; }
size_t         ql_backend_buffer_size(const ql_backend_buffer *b) { return b ? b->size : 0; }
ql_buffer_kind ql_backend_buffer_kind(const ql_backend_buffer *b) { return b ? b->kind : QL_BUFFER_DEVICE; }

static bool is_plain_leaf(const ql_tensor *t) { return t->op == QL_OP_NONE && !t->view_src; }
static size_t leaf_bytes(const ql_tensor *t) { return align_up(ql_nbytes(t) + t->aux_size, QL_ALIGN); }

size_t ql_ctx_placed_bytes(const ql_context *ctx) {
    size_t total = 0;
    if (ctx)
        for (const ql_tensor *t : ctx->tensors)
            if (is_plain_leaf(t) && (t->data || ctx->measure) && !(t->flags & QL_FLAG_HOST)) total += leaf_bytes(t);
    return total;
}

ql_backend_buffer *ql_backend_alloc_ctx_tensors(ql_backend *be, ql_context *ctx, ql_buffer_kind kind) {
    if (!be || !ctx || ctx->measure) return nullptr;
    if (!holds_memory(be)) {
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "alloc_ctx_tensors: backend %s only plans (it holds no memory)", be->iface.name);
        return nullptr;
    }
    size_t total = 0;
    for (const ql_tensor *t : ctx->tensors)
        if (is_plain_leaf(t) && !t->data) total += leaf_bytes(t);
    ql_backend_buffer *b = ql_backend_buffer_alloc(be, kind, total);
    if (!b) {
        QL_ERR(ctx, QL_ERR_NOMEM, "alloc_ctx_tensors: backend %s could not allocate %zu bytes of %s memory", be->iface.name,
               total, ql_buffer_kind_name(kind));
        return nullptr;
    }
    size_t off = 0;
    for (ql_tensor *t : ctx->tensors)
        if (is_plain_leaf(t) && !t->data) {
            t->data = (uint8_t *)b->base + off;
            off += leaf_bytes(t);
        }
    ctx_rebind_views(ctx);
    return b;
}

// The pages of a copied QL_FLAG_MAPPED tensor out of the resident set. Rounded outwards: a
// neighbour's page dropped too is read again from the file on its next use (the mapping is
// PROT_READ and private, so no page of it can hold anything the file does not).
static void release_mapped_pages(const void *data, size_t n) {
    const uintptr_t P = (uintptr_t)sysconf(_SC_PAGESIZE), b = (uintptr_t)data / P * P, e = ((uintptr_t)data + n + P - 1) / P * P;
    if (n) madvise((void *)b, e - b, MADV_DONTNEED);  // advice: a failure only leaves the pages resident
}

// the leaves of ctx placed (only: NULL, every one; else those in it)
static ql_backend_buffer *place_leaves(ql_backend *be, ql_context *ctx, const std::unordered_set<const ql_tensor *> *only) {
    if (!be || !ctx || ctx->measure) return nullptr;
    if (!holds_memory(be)) {
        QL_ERR(ctx, QL_ERR_UNSUPPORTED, "place_ctx_tensors: backend %s only plans (it holds no memory)", be->iface.name);
        return nullptr;
    }
    if (ql_backend_is_host(be)) return new (std::nothrow) ql_backend_buffer{QL_BUFFER_DEVICE, nullptr, 0, nullptr, {}, nullptr, {}, {}};
    size_t total = 0;
    for (const ql_tensor *t : ctx->tensors)
        if (is_plain_leaf(t) && t->data && !(t->flags & QL_FLAG_HOST) && (!only || only->count(t))) total += leaf_bytes(t);
    ql_backend_buffer *b = ql_backend_buffer_alloc(be, QL_BUFFER_DEVICE, total);
    if (!b) {
        QL_ERR(ctx, QL_ERR_NOMEM, "place_ctx_tensors: %s could not allocate %.1f MiB for the weights --> hint: a smaller "
               "weight type (nf4) or a smaller model", be->iface.name, total / 1048576.0);
        return nullptr;
    }
    b->placed_ctx = ctx;
    char err[256] = {0};
    size_t off = 0;
    for (ql_tensor *t : ctx->tensors)
        if (is_plain_leaf(t) && t->data && !(t->flags & QL_FLAG_HOST) && (!only || only->count(t))) {
            void *dst = (uint8_t *)b->base + off;
            if (!be->iface.copy(be, dst, t->data, ql_nbytes(t) + t->aux_size, QL_COPY_TO_DEVICE, false, err, sizeof(err))) {
                QL_ERR(ctx, QL_ERR_IO, "place_ctx_tensors: copying %s to %s: %s", shape_str(t).c_str(), be->iface.name, err);
                ql_backend_buffer_free(b);  // and the tensors placed so far back on their host data
                return nullptr;
            }
            if (t->flags & QL_FLAG_MAPPED) release_mapped_pages(t->data, ql_nbytes(t) + t->aux_size);  // (the transient peak)
            b->placed.push_back({t, t->data});
            t->data = dst;
            off += leaf_bytes(t);
        }
    // again, all of them: reading the next tensor maps the cached pages around it (fault-around,
    // large folios), the tail of the one before included
    for (const auto &p : b->placed)
        if (p.first->flags & QL_FLAG_MAPPED) release_mapped_pages(p.second, ql_nbytes(p.first) + p.first->aux_size);
    ctx_rebind_views(ctx);
    return b;
}

ql_backend_buffer *ql_backend_place_ctx_tensors(ql_backend *be, ql_context *ctx) { return place_leaves(be, ctx, nullptr); }

ql_backend_buffer *ql_backend_place_tensors(ql_backend *be, ql_context *ctx, ql_tensor *const *tensors, int n) {
    if (n < 0 || (n && !tensors)) return nullptr;
    const std::unordered_set<const ql_tensor *> only(tensors, tensors + n);
    return place_leaves(be, ctx, &only);
}

size_t ql_tensors_placed_bytes(const ql_tensor *const *tensors, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (tensors[i] && is_plain_leaf(tensors[i]) && !(tensors[i]->flags & QL_FLAG_HOST)) total += leaf_bytes(tensors[i]);
    return total;
}

// ---- frozen weights in the compute type (--cache-weights) ----

static size_t weight_copy_bytes(const ql_tensor *w, ql_type type) {
    if (mm_r8_type(type)) return align_up(mm_r8_bytes(w), QL_ALIGN);  // (the CPU's: repacked)
    return align_up((size_t)ql_nelements(w) * ql_plain_size(type), QL_ALIGN);
}
size_t ql_weight_cache_bytes(ql_tensor *const *w, int n, ql_type type) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (w[i]) total += weight_copy_bytes(w[i], type);
    return total;
}
void ql_weight_cache_mark(ql_tensor *const *w, int n, bool on) {
    for (int i = 0; i < n; i++)
        if (w[i] && on) w[i]->flags |= QL_FLAG_CACHED;
        else if (w[i]) w[i]->flags &= ~QL_FLAG_CACHED;
}

ql_backend_buffer *ql_backend_cache_weights(ql_backend *be, ql_tensor *const *w, int n, ql_type type, char *err, size_t err_size) {
    auto fail = [&](const char *fmt, const char *a, const char *b) {
        if (err && err_size) snprintf(err, err_size, fmt, a, b);
        return nullptr;
    };
    const bool repack = mm_r8_type(type);
    if (!be || n < 0 || (n && !w)) return fail("cache_weights: bad arguments%s%s", "", "");
    if (type != QL_TYPE_F32 && type != QL_TYPE_F16 && type != QL_TYPE_BF16 && !repack)
        return fail("cache_weights: backend %s keeps no weight copies in this type (%s)", be->iface.name, ql_type_name(type));
    const bool host = ql_backend_is_host(be);
    if (host && repack && !k_mm_r8)
        return fail("cache_weights: this build keeps no repacked %s (it lacks AVX-512 VNNI: its prompts would read the rows, and "
                    "the copy would double the memory)%s", ql_type_name(type), "");
    if (host != repack)  // the CPU keeps only repacked Q4_0 / Q4_K / Q6_K / NF4 (8-bit-activation inference), a device only 16/32-bit
        return fail("cache_weights: backend %s keeps no weight copies in this type%s", be->iface.name,
                    host ? " (it converts the weights while packing its panels: a copy saves nothing; it keeps Q4_0, Q4_K, Q6_K and NF4 "
                           "weights repacked for 8-bit-activation inference: their own type)"
                         : "");
    if (!be->iface.weight_copy || !holds_memory(be)) return fail("cache_weights: backend %s keeps no weight copies%s", be->iface.name, "");
    for (int i = 0; i < n; i++) {
        const ql_tensor *x = w[i];
        if (host && (!x || x->type != type || !is_plain_leaf(x) || !x->data || !mm_r8_ok(x) || !ql_rows_contiguous(x)))
            return fail(mm_nf4_type(type) ? "cache_weights: %s is not a 2-D %s weight whose rows are a multiple of 8, of whole blocks of 64"
                                          : "cache_weights: %s is not a 2-D %s weight whose rows are a multiple of 8",
                        x ? x->name : "(null)", ql_type_name(type));
        if (host) continue;
        if (!x || !is_plain_leaf(x) || !x->data || (x->flags & QL_FLAG_HOST) || x->ne[2] != 1 || x->ne[3] != 1 || x->type == type ||
            !ql_rows_contiguous(x) || !ql_type_traits_get(x->type) || ((x->flags & QL_FLAG_PARAM) && x->type != QL_TYPE_F32))
            return fail("cache_weights: %s is not a placed 2-D weight (or f32 parameter) of another type than %s", x ? x->name : "(null)",
                        ql_type_name(type));
    }
    ql_backend_buffer *b = ql_backend_buffer_alloc(be, QL_BUFFER_DEVICE, ql_weight_cache_bytes(w, n, type));
    if (!b) {
        char need[64];
        snprintf(need, sizeof(need), "%.1f MiB", ql_weight_cache_bytes(w, n, type) / 1048576.0);
        return fail("cache_weights: %s could not allocate %s for the weights' copies", be->iface.name, need);
    }
    b->copies.reserve((size_t)n);  // (the weights' extra point into it: never grown past n)
    char e[256] = {0};
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        void *dst = (uint8_t *)b->base + off;
        if (!be->iface.weight_copy(be, w[i], dst, type, e, sizeof(e))) {
            ql_backend_buffer_free(b);  // (and the weights flagged so far unflagged)
            return fail("cache_weights: %s: %s", w[i]->name, e);
        }
        b->copies.push_back({dst, type});
        b->cached.push_back(w[i]);
        w[i]->extra = &b->copies.back();
        w[i]->flags |= QL_FLAG_CACHED;
        if (host && (w[i]->flags & QL_FLAG_MAPPED)) release_mapped_pages(w[i]->data, ql_nbytes(w[i]));  // read only by other paths now
        off += weight_copy_bytes(w[i], type);
    }
    return b;
}

ql_backend_buffer *ql_backend_place_tensors_pinned(ql_backend *be, ql_tensor *const *ts, int n) {
    if (!be || (n && !ts)) return nullptr;
    if (ql_backend_is_host(be)) return new (std::nothrow) ql_backend_buffer{QL_BUFFER_HOST_PINNED, nullptr, 0, nullptr, {}, nullptr, {}, {}};
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (!ts[i] || !is_plain_leaf(ts[i]) || !ts[i]->data || !(ts[i]->flags & QL_FLAG_HOST)) return nullptr;
        total += leaf_bytes(ts[i]);
    }
    ql_backend_buffer *b = ql_backend_buffer_alloc(be, QL_BUFFER_HOST_PINNED, total);
    if (!b) return nullptr;
    size_t off = 0;
    for (int i = 0; i < n; i++) {  // host memory both: a plain copy
        uint8_t *dst = (uint8_t *)b->base + off;
        memcpy(dst, ts[i]->data, ql_nbytes(ts[i]) + ts[i]->aux_size);
        b->placed.push_back({ts[i], ts[i]->data});
        ts[i]->data = dst;
        off += leaf_bytes(ts[i]);
    }
    return b;
}

static bool tensor_range_ok(const ql_tensor *t, size_t offset, size_t size) {
    const size_t n = ql_nbytes(t) + t->aux_size;
    return t && t->data && offset <= n && size <= n - offset && (size == 0 || ql_is_contiguous(t) || offset + size <= ql_nbytes(t));
}

static ql_status tensor_copy(ql_backend *be, void *dst, const void *src, size_t size, int dir, bool async) {
    if (size == 0) return QL_OK;
    if (ql_backend_is_host(be)) {
        memcpy(dst, src, size);
        return QL_OK;
    }
    char err[256];
    if (be->iface.copy(be, dst, src, size, dir, async, err, sizeof(err))) return QL_OK;
    fprintf(stderr, "qlora: %s: %s\n", be->iface.name, err);
    return QL_ERR_IO;
}

// host bytes in (QL_COPY_TO_DEVICE) or out of bytes [offset, offset + size) of t, checked
static ql_status tensor_io(ql_backend *be, const ql_tensor *t, void *host, size_t offset, size_t size, int dir, bool async) {
    if (!be || !t || (!host && size) || !tensor_range_ok(t, offset, size)) return QL_ERR_INVALID;
    if (!holds_memory(be)) return QL_ERR_UNSUPPORTED;
    uint8_t *dev = (uint8_t *)t->data + offset;
    if (t->flags & QL_FLAG_HOST) {  // host memory on any backend (pinned state, the embedding kept on the host)
        if (size && host != dev) memmove(dir == QL_COPY_TO_DEVICE ? dev : host, dir == QL_COPY_TO_DEVICE ? host : dev, size);
        return QL_OK;
    }
    return dir == QL_COPY_TO_DEVICE ? tensor_copy(be, dev, host, size, dir, async) : tensor_copy(be, host, dev, size, dir, async);
}
// A cached parameter's copy made again from its values after a write (ql_backend_cache_weights):
// the copy's kernels run on the stream the write was queued on, so they see it
static ql_status copy_refresh(ql_backend *be, ql_tensor *t, ql_status st) {
    const ql_weight_copy *cp = (t->flags & QL_FLAG_CACHED) ? (const ql_weight_copy *)t->extra : nullptr;
    if (st != QL_OK || !cp || !be->iface.weight_copy) return st;
    char err[256] = {0};
    if (be->iface.weight_copy(be, t, cp->data, cp->type, err, sizeof(err))) return QL_OK;
    fprintf(stderr, "qlora: %s: the copy of %s: %s\n", be->iface.name, t->name, err);
    return QL_ERR_IO;
}
ql_status ql_backend_tensor_set(ql_backend *be, ql_tensor *t, const void *data, size_t offset, size_t size) {
    return copy_refresh(be, t, tensor_io(be, t, (void *)data, offset, size, QL_COPY_TO_DEVICE, false));
}
ql_status ql_backend_tensor_get(ql_backend *be, const ql_tensor *t, void *data, size_t offset, size_t size) {
    return tensor_io(be, t, data, offset, size, QL_COPY_TO_HOST, false);
}
ql_status ql_backend_tensor_set_async(ql_backend *be, ql_tensor *t, const void *data, size_t offset, size_t size) {
    return copy_refresh(be, t, tensor_io(be, t, (void *)data, offset, size, QL_COPY_TO_DEVICE, true));
}
ql_status ql_backend_tensor_get_async(ql_backend *be, const ql_tensor *t, void *data, size_t offset, size_t size) {
    return tensor_io(be, t, data, offset, size, QL_COPY_TO_HOST, true);
}
ql_status ql_backend_tensor_memset(ql_backend *be, ql_tensor *t, int value, size_t offset, size_t size) {
    if (!be || !t || !tensor_range_ok(t, offset, size)) return QL_ERR_INVALID;
    if (!holds_memory(be)) return QL_ERR_UNSUPPORTED;
    if (size == 0) return QL_OK;
    if (ql_backend_is_host(be)) {
        memset((uint8_t *)t->data + offset, value, size);
        return QL_OK;
    }
    char err[256];
    if (be->iface.memset(be, (uint8_t *)t->data + offset, value, size, err, sizeof(err))) return copy_refresh(be, t, QL_OK);
    fprintf(stderr, "qlora: %s: %s\n", be->iface.name, err);
    return QL_ERR_IO;
}
ql_status ql_backend_synchronize(ql_backend *be) {
    if (!be) return QL_ERR_INVALID;
    if (ql_backend_is_host(be)) return QL_OK;
    if (!be->iface.synchronize) return QL_ERR_UNSUPPORTED;  // (a plan-only backend runs nothing)
    char err[256];
    if (be->iface.synchronize(be, err, sizeof(err))) return QL_OK;
    fprintf(stderr, "qlora: %s: %s\n", be->iface.name, err);
    return QL_ERR_IO;
}
ql_status ql_backend_graph_zero_grads(ql_backend *be, ql_graph *g) {
    if (!be || !g) return QL_ERR_INVALID;
    for (ql_tensor *p : g->params)
        if (p->grad && p->grad->data) {
            const ql_status st = ql_backend_tensor_memset(be, p->grad, 0, 0, ql_nbytes(p->grad));
            if (st != QL_OK) return st;
        }
    return QL_OK;
}

// f32 moments of the parameter's size, contiguous
static bool adamw_f32_ok(const ql_tensor *param, const ql_tensor *m, const ql_tensor *v) {
    return param->type == QL_TYPE_F32 && m->type == QL_TYPE_F32 && v->type == QL_TYPE_F32 && ql_nelements(m) == ql_nelements(param) &&
           ql_nelements(v) == ql_nelements(param) && ql_nelements(param->grad) == ql_nelements(param) && ql_is_contiguous(param) &&
           ql_is_contiguous(m) && ql_is_contiguous(v);
}

ql_status ql_backend_adamw_update(ql_backend *be, ql_tensor *param, ql_tensor *m, ql_tensor *v, ql_tensor *m_absmax,
                                  ql_tensor *v_absmax, int64_t step, const ql_adamw_params *p, float grad_scale) {
    if (!be || !param || !param->grad || !m || !v || !p || (!m_absmax) != (!v_absmax) || step < 1) return QL_ERR_INVALID;
    // tensors without memory (a no_alloc context, an unplaced result), or f32 state of another size
    if (!param->data || !param->grad->data || !m->data || !v->data || (m_absmax && (!m_absmax->data || !v_absmax->data)))
        return QL_ERR_INVALID;
    if (!m_absmax && !adamw_f32_ok(param, m, v)) return QL_ERR_INVALID;
    if (be->iface.adamw_update) return copy_refresh(be, param, be->iface.adamw_update(be, param, m, v, m_absmax, v_absmax, step, p, grad_scale));
    if (m_absmax) ql_adamw8bit_update(param, m, m_absmax, v, v_absmax, step, p, grad_scale);
    else ql_adamw_update(param, m, v, step, p, grad_scale);
    return QL_OK;
}

ql_status ql_backend_grad_stats(ql_backend *be, const ql_tensor *t, double *sumsq, bool *finite) {
    if (!be || !t || !t->data || t->type != QL_TYPE_F32 || !ql_is_contiguous(t) || !sumsq || !finite) return QL_ERR_INVALID;
    if (be->iface.grad_stats) return be->iface.grad_stats(be, t, sumsq, finite);
    double s = 0;
    bool ok = true;
    const float *x = (const float *)t->data;
    for (int64_t i = 0, n = ql_nelements(t); i < n; i++) {
        if (std::isfinite(x[i])) s += (double)x[i] * x[i];
        else ok = false;
    }
    *sumsq = s;
    *finite = ok;
    return QL_OK;
}

// ---- the multi-tensor optimizer ----

// what ql_adamw_update / ql_adamw8bit_update accept, with memory, gradients f32 and contiguous
static bool optim_group_ok(const ql_optim_group &g) {
    const ql_tensor *p = g.param;
    if (!p || !p->grad || !g.m || !g.v || (!g.m_absmax) != (!g.v_absmax)) return false;
    if (!p->data || !p->grad->data || !g.m->data || !g.v->data || (g.m_absmax && (!g.m_absmax->data || !g.v_absmax->data)))
        return false;
    if (p->grad->type != QL_TYPE_F32 || !ql_is_contiguous(p->grad) || ql_nelements(p->grad) != ql_nelements(p)) return false;
    if (!g.m_absmax) return adamw_f32_ok(p, g.m, g.v);
    const int64_t n = ql_nelements(p), nb = (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
    return p->type == QL_TYPE_F32 && ql_is_contiguous(p) && g.m->type == QL_TYPE_I8 && g.v->type == QL_TYPE_I8 &&
           ql_nelements(g.m) == n && ql_nelements(g.v) == n && ql_is_contiguous(g.m) && ql_is_contiguous(g.v) &&
           g.m_absmax->type == QL_TYPE_F32 && g.v_absmax->type == QL_TYPE_F32 && ql_nelements(g.m_absmax) == nb &&
           ql_nelements(g.v_absmax) == nb && ql_is_contiguous(g.m_absmax) && ql_is_contiguous(g.v_absmax);
}

size_t ql_optim_list_bytes(int n_groups) { return n_groups < 0 ? 0 : ql_optim_store_counter(n_groups) + 16; }

void ql_optim_list_free(ql_optim_list *l) {
    if (!l) return;
    delete[] l->groups;
    delete[] l->owner;
    delete[] l->w16;
    delete[] l->w16_type;
    delete l;
}

ql_optim_list *ql_optim_list_new(ql_backend *be, const ql_optim_group *groups, int n_groups, ql_tensor *store) {
    if (!be || n_groups < 0 || (n_groups > 0 && !groups)) {
        fprintf(stderr, "qlora: ql_optim_list_new: no backend or no groups\n");
        return nullptr;
    }
    for (int i = 0; i < n_groups; i++)
        if (!optim_group_ok(groups[i])) {
            fprintf(stderr, "qlora: ql_optim_list_new: group %d (%s): not an f32 parameter with its f32 gradient and moments "
                            "(f32, or I8 codes with f32 absmax) of its size, contiguous, with memory\n",
                    i, groups[i].param ? groups[i].param->name : "no parameter");
            return nullptr;
        }
    const bool host = ql_backend_is_host(be);
    const size_t bytes = ql_optim_list_bytes(n_groups);
    if (!host && (!holds_memory(be) || !store || !store->data || !ql_is_contiguous(store) || ql_nbytes(store) < bytes)) {
        fprintf(stderr, "qlora: ql_optim_list_new: a device backend needs a store of %zu bytes with memory (ql_optim_list_bytes)\n",
                bytes);
        return nullptr;
    }
    ql_optim_list *l = new ql_optim_list();
    l->backend = be->id;
    l->n = n_groups;
    l->groups = new ql_optim_group[(size_t)n_groups + 1];
    l->owner = new int[(size_t)n_groups + 1];
    l->w16 = new void *[(size_t)n_groups + 1];
    l->w16_type = new int[(size_t)n_groups + 1];
    std::copy(groups, groups + n_groups, l->groups);
    std::vector<ql_optim_desc> desc((size_t)n_groups);
    for (int i = 0; i < n_groups; i++) {
        const ql_optim_group &g = groups[i];
        const int64_t n = ql_nelements(g.param);
        const ql_weight_copy *cp = (g.param->flags & QL_FLAG_CACHED) ? (const ql_weight_copy *)g.param->extra : nullptr;
        desc[(size_t)i] = {(float *)g.param->data, (const float *)g.param->grad->data, g.m->data, g.v->data,
                           g.m_absmax ? (float *)g.m_absmax->data : nullptr, g.v_absmax ? (float *)g.v_absmax->data : nullptr,
                           n, l->n_chunks, cp ? cp->data : nullptr, cp ? (int64_t)cp->type : 0};
        l->w16[i] = cp ? cp->data : nullptr;
        l->w16_type[i] = cp ? (int)cp->type : -1;
        l->n_chunks += (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
    }
    // the CPU's threads: the largest group next to the least-loaded thread (groups are independent:
    // the results do not depend on who updates them)
    l->n_threads = std::max(1, ql_backend_cpu_n_threads(be));
    std::vector<int> by_size((size_t)n_groups);
    std::vector<int64_t> load((size_t)l->n_threads, 0);
    for (int i = 0; i < n_groups; i++) by_size[(size_t)i] = i;
    std::stable_sort(by_size.begin(), by_size.end(),
                     [groups](int a, int b) { return ql_nelements(groups[a].param) > ql_nelements(groups[b].param); });
    for (int i : by_size) {
        const int k = (int)(std::min_element(load.begin(), load.end()) - load.begin());
        l->owner[i] = k;
        load[(size_t)k] += ql_nelements(groups[i].param);
    }
    if (!host) {  // the descriptors, the partial sums and the count of blocks done (0), written once
        std::vector<uint8_t> img(bytes, 0);
        if (n_groups) memcpy(img.data(), desc.data(), desc.size() * sizeof(ql_optim_desc));
        if (ql_backend_tensor_set(be, store, img.data(), 0, bytes) != QL_OK) {
            ql_optim_list_free(l);
            return nullptr;
        }
        l->store = (uint8_t *)store->data;
    }
    return l;
}

// the host's statistics: one running sum in group order, element order
static void optim_stats_host(const ql_optim_list *l, double *sumsq, bool *finite) {
    double s = 0;
    bool ok = true;
    for (int k = 0; k < l->n; k++) {
        const float *x = (const float *)l->groups[k].param->grad->data;
        for (int64_t i = 0, n = ql_nelements(l->groups[k].param); i < n; i++) {
            if (std::isfinite(x[i])) s += (double)x[i] * x[i];
            else ok = false;
        }
    }
    *sumsq = s;
    *finite = ok && std::isfinite(s);
}

struct optim_job {
    const ql_optim_list *l;
    int64_t step;
    const ql_adamw_params *p;
    float factor;
};
static void optim_worker(void *arg, int ith, int nth) {
    const optim_job *j = (const optim_job *)arg;
    for (int k = 0; k < j->l->n; k++) {
        if (j->l->owner[k] % nth != ith) continue;
        const ql_optim_group &g = j->l->groups[k];
        if (g.m_absmax) ql_adamw8bit_update(g.param, g.m, g.m_absmax, g.v, g.v_absmax, j->step, j->p, j->factor);
        else ql_adamw_update(g.param, g.m, g.v, j->step, j->p, j->factor);
    }
}

float ql_optim_step_factor(double sumsq, double loss_scale, float max_norm) { return ql_optim_grad_factor(sumsq, loss_scale, max_norm); }

ql_status ql_backend_grad_stats_multi(ql_backend *be, ql_optim_list *l, double *sumsq, bool *finite) {
    if (!be || !l || l->backend != be->id || !sumsq || !finite) return QL_ERR_INVALID;
    if (be->iface.grad_stats_multi) return be->iface.grad_stats_multi(be, l, sumsq, finite);
    if (ql_backend_is_host(be)) {
        optim_stats_host(l, sumsq, finite);
        return QL_OK;
    }
    double s = 0;  // a device without the multi-tensor form: one tensor at a time
    bool ok = true;
    for (int k = 0; k < l->n; k++) {
        double ps = 0;
        bool f = true;
        const ql_status st = ql_backend_grad_stats(be, l->groups[k].param->grad, &ps, &f);
        if (st != QL_OK) return st;
        s += ps;
        ok = ok && f;
    }
    *sumsq = s;
    *finite = ok && std::isfinite(s);
    return QL_OK;
}

ql_status ql_backend_adamw_update_multi(ql_backend *be, ql_optim_list *l, int64_t step, const ql_adamw_params *p,
                                        double loss_scale, float max_norm, double *sumsq, bool *finite) {
    if (!be || !l || l->backend != be->id || !p || step < 1 || !(loss_scale > 0) || !sumsq || !finite) return QL_ERR_INVALID;
    // The device's descriptors name each copy as it was: one made since would go stale (products
    // would read the old values), one freed since would be written after its free.
    for (int k = 0; k < l->n; k++) {
        const ql_tensor *w = l->groups[k].param;
        const ql_weight_copy *cp = (w->flags & QL_FLAG_CACHED) ? (const ql_weight_copy *)w->extra : nullptr;
        if ((cp ? cp->data : nullptr) != l->w16[k] || (cp ? (int)cp->type : -1) != l->w16_type[k]) {
            fprintf(stderr, "qlora: ql_backend_adamw_update_multi: %s's weight copy was %s after ql_optim_list_new: make the list "
                            "again after ql_backend_cache_weights or ql_backend_buffer_free\n",
                    w->name, l->w16[k] ? (cp ? "replaced" : "freed") : "made");
            return QL_ERR_INVALID;
        }
    }
    if (be->iface.adamw_update_multi) return be->iface.adamw_update_multi(be, l, step, p, loss_scale, max_norm, sumsq, finite);
    const ql_status st = ql_backend_grad_stats_multi(be, l, sumsq, finite);
    if (st != QL_OK || !*finite) return st;  // a non-finite element: the step is skipped
    const optim_job job = {l, step, p, ql_optim_grad_factor(*sumsq, loss_scale, max_norm)};
    if (ql_backend_cpu_n_threads(be) > 0) {
        ql_backend_cpu_parallel(be, optim_worker, (void *)&job);
        return QL_OK;
    }
    for (int k = 0; k < l->n; k++) {  // a device without the multi-tensor form: one tensor at a time
        const ql_optim_group &g = l->groups[k];
        const ql_status s2 = ql_backend_adamw_update(be, g.param, g.m, g.v, g.m_absmax, g.v_absmax, step, p, job.factor);
        if (s2 != QL_OK) return s2;
    }
    return QL_OK;
}

ql_status ql_device_parse(const char *s, ql_device *d, char *err, size_t err_size) {
    const std::string x = s ? s : "";
    ql_device r = {QL_DEVICE_CPU, 0};
    bool ok = true;
    if (x == "cpu") r.kind = QL_DEVICE_CPU;
    else if (x == "auto") r.kind = QL_DEVICE_AUTO;
    else if (x == "cuda") r.kind = QL_DEVICE_GPU;
    else if (x.rfind("cuda:", 0) == 0 && x.size() > 5) {
        char *end = nullptr;
        const long v = strtol(x.c_str() + 5, &end, 10);
        ok = end && !*end && isdigit((unsigned char)x[5]) && v >= 0 && v <= 1024;
        r = {QL_DEVICE_GPU, (int)v};
    } else ok = false;
    if (!ok) {
        if (err && err_size) snprintf(err, err_size, "'%s' is not a device (cpu, cuda, cuda:N, auto)", x.c_str());
        return QL_ERR_INVALID;
    }
    if (d) *d = r;
    return QL_OK;
}

ql_backend *ql_backend_init_device(ql_device d, int n_threads, char *err, size_t err_size) {
    char tmp[256];
    if (!err || !err_size) err = tmp, err_size = sizeof(tmp);
    if (d.kind == QL_DEVICE_GPU || (d.kind == QL_DEVICE_AUTO && ql_cuda_device_count() > 0))
        return ql_backend_cuda_init(d.kind == QL_DEVICE_GPU ? d.index : 0, err, err_size);
    ql_backend *be = ql_backend_cpu_init(n_threads);
    if (!be)
        snprintf(err, err_size, "cannot start %d CPU threads (the system's limit, or memory for their stacks)",
                 n_threads > 0 ? n_threads : ql_cpu_default_threads());
    return be;
}

ql_backend *ql_backend_init_by_name(const char *device, int n_threads, char *err, size_t err_size) {
    ql_device d;
    if (ql_device_parse(device ? device : "auto", &d, err, err_size) != QL_OK) return nullptr;
    return ql_backend_init_device(d, n_threads, err, err_size);
}

void ql_backend_describe(const ql_backend *be, char *buf, size_t size) {
    if (!be) {
        snprintf(buf, size, "(none)");
    } else if (ql_backend_is_host(be)) {
        snprintf(buf, size, "cpu (%d threads, %s)", ql_backend_cpu_n_threads(be), ql_cpu_features());
    } else {
        ql_cuda_device_info info;
        if (ql_backend_cuda_info(be, &info) == QL_OK)
            snprintf(buf, size, "cuda: %s (cc %d.%d, %d SMs, %.1f GiB free of %.1f GiB)", info.name, info.major, info.minor,
                     info.n_sm, info.free_mem / 1073741824.0, info.total_mem / 1073741824.0);
        else
            snprintf(buf, size, "%s", be->iface.name);
    }
}

// ============================================================================================
// 14. CUDA planning rules: a device plan without the device, and the no-CUDA stand-ins
// ============================================================================================

// ---- the CUDA backend's memory rules: pure arithmetic on shapes, here rather than in
// qlora-cuda.cu so that a device plan (--dry-run --device cuda --vram 8G) needs neither a GPU
// nor a CUDA build; the CUDA kernels size and carve their workspace by these same functions ----


bool ql_cuda_operand_ok(size_t es, int64_t nb0, int64_t nb1, int64_t K, int64_t X) {
    if (nb0 == (int64_t)es && (X == 1 || nb1 % (int64_t)es == 0)) return (X == 1 ? std::max<int64_t>(K, 1) : nb1 / (int64_t)es) >= K;
    if (nb1 == (int64_t)es && nb0 % (int64_t)es == 0) return (K == 1 ? std::max<int64_t>(X, 1) : nb0 / (int64_t)es) >= X;
    return false;
}
bool ql_cuda_mm_trows(const ql_tensor *a) {
    const ql_type_traits *t = ql_type_traits_get(a->type);
    return t && t->blck_size > 1 && a->op == QL_OP_TRANSPOSE && a->view_src && ql_rows_contiguous(a->view_src);
}
bool ql_cuda_mm_a_direct(const ql_tensor *a, ql_type ct) {
    return a->type == ct && ql_cuda_operand_ok(ql_plain_size(ct), (int64_t)a->nb[0], (int64_t)a->nb[1], a->ne[0], a->ne[1]);
}
const ql_tensor *ql_cuda_mm_cached(const ql_tensor *a, ql_type compute) {
    const bool tr = a->op == QL_OP_TRANSPOSE && a->view_src && a->view_offs == 0;
    const ql_tensor *w = tr ? a->view_src : a;
    if (!(w->flags & QL_FLAG_CACHED) || w->type == compute || w->op != QL_OP_NONE || w->view_src || w->ne[2] != 1 || w->ne[3] != 1)
        return nullptr;  // (a product in W's own type: W in place)
    return !tr || (a->ne[0] == w->ne[1] && a->ne[1] == w->ne[0] && a->ne[2] == 1 && a->ne[3] == 1) ? w : nullptr;
}
bool ql_cuda_mm_b_direct(const ql_tensor *b) {
    return ql_cuda_operand_ok(ql_plain_size(b->type), (int64_t)b->nb[0], (int64_t)b->nb[1], b->ne[0], b->ne[1]);
}
size_t ql_cuda_mm_b_bytes(const ql_tensor *b) {
    return ql_cuda_mm_b_direct(b) ? 0 : align_up((size_t)ql_nelements(b) * ql_plain_size(b->type), QL_ALIGN);
}
// the tile budget in elements: QL_CUDA_MM_TILE_ELEMS, or a test's (several tiles of small weights)
static int64_t cuda_mm_tile_elems = QL_CUDA_MM_TILE_ELEMS;
void ql_cuda_mm_tile_elems_for_tests(int64_t n) { cuda_mm_tile_elems = n > 0 ? n : QL_CUDA_MM_TILE_ELEMS; }
int64_t ql_cuda_mm_tile_rows(int64_t row_len, int64_t n_rows) {
    const int64_t fit = cuda_mm_tile_elems / std::max<int64_t>(row_len, 1);
    if (n_rows <= fit) return std::max<int64_t>(n_rows, 1);
    return std::min<int64_t>(n_rows, std::max<int64_t>(QL_CUDA_MM_TILE_ALIGN, fit / QL_CUDA_MM_TILE_ALIGN * QL_CUDA_MM_TILE_ALIGN));
}
size_t ql_cuda_mm_tile_bytes(int64_t row_len, int64_t n_rows, ql_type compute) {
    return align_up((size_t)(row_len * ql_cuda_mm_tile_rows(row_len, n_rows)) * ql_plain_size(compute), QL_ALIGN);
}
// two buffers (the next tile filled during the current one's GEMMs) when there is more than one
// tile and a tile is within the budget; one where the 128-row minimum is over it (the head's Wᵀ
// dy: 128 columns of 128256 rows are 31 MiB in bf16), filled and used in turn
int ql_cuda_mm_tile_bufs(int64_t row_len, int64_t n_rows, int64_t batches) {
    const int64_t tr = ql_cuda_mm_tile_rows(row_len, n_rows);
    return batches * ((n_rows + tr - 1) / tr) > 1 && tr * row_len <= cuda_mm_tile_elems ? 2 : 1;
}
// A product of a few tokens (decode) read straight from the packed weight, one warp per row:
// no dequantised tile, no workspace. a: a whole 2-D weight (block-quantized or 16/32-bit) with
// rows of a multiple of 32; b: at most QL_CUDA_GEMV_MAX_N columns of K contiguous elements; an
// f32 result, unscaled (a scaled product: the GEMM's alpha). ql_mul_mat_acc's c (the residual the
// o and down projections add onto) is read by the kernels as they write: f32, the result's shape.
bool ql_cuda_mm_gemv(const ql_tensor *node) {
    if (node->op != QL_OP_MUL_MAT || node->type != QL_TYPE_F32 || ql_mul_mat_alpha(node) != 1.0f) return false;
    const ql_tensor *c = node->src[2];
    if (c && (c->type != QL_TYPE_F32 || !ql_is_contiguous(c) || !ql_same_shape(c, node) || !ql_is_contiguous(node))) return false;
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const ql_type_traits *t = ql_type_traits_get(a->type);
    if (!t || (!t->to_float && !t->to_float_aux) || a->type == QL_TYPE_I32 || a->type == QL_TYPE_I8) return false;
    if (a->view_src || a->ne[2] != 1 || a->ne[3] != 1 || !ql_is_contiguous(a) || a->ne[0] % 32 != 0) return false;
    return b->ne[1] <= QL_CUDA_GEMV_MAX_N && b->ne[2] == 1 && b->ne[3] == 1 && b->nb[0] == ql_plain_size(b->type) &&
           (b->ne[1] == 1 || b->nb[1] % b->nb[0] == 0);
}
// Decode's products with 8-bit activations on the device (ql_mul_mat_set_prec Q8_0): the CPU's
// path (mm_q8: the same blocks, codes and scales) where it has an integer kernel for the weight's
// type, read straight from the packed weight (a gemv); QLORA_CUDA_DECODE_DP4A=0 (read once) keeps
// the f32 decode products instead, to measure one against the other
static const bool g_cuda_decode_dp4a = !(getenv("QLORA_CUDA_DECODE_DP4A") && strcmp(getenv("QLORA_CUDA_DECODE_DP4A"), "0") == 0);
int ql_cuda_mm_q8(const ql_tensor *node) {
    if (!g_cuda_decode_dp4a || !ql_cuda_mm_gemv(node) || node->op_params[0] != QL_TYPE_Q8_0) return 0;
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const bool nf4 = a->type == QL_TYPE_NF4 || a->type == QL_TYPE_NF4_NODQ;
    const ql_type t = a->type;
    const bool q32 = t == QL_TYPE_Q4_0 || t == QL_TYPE_Q4_1 || t == QL_TYPE_Q5_0 || t == QL_TYPE_Q5_1 || t == QL_TYPE_Q8_0 || t == QL_TYPE_IQ4_NL;
    const int qb = q32 || nf4                                                                                        ? 32
                   : t == QL_TYPE_Q4_K || t == QL_TYPE_Q5_K || t == QL_TYPE_Q6_K || t == QL_TYPE_IQ4_XS ? QL_QK_K
                                                                                                         : 0;
    return qb && b->type == QL_TYPE_F32 && a->ne[0] % qb == 0 && (!nf4 || a->ne[0] % QL_NF4_BLOCK == 0) ? qb : 0;
}
bool ql_cuda_q8_aligned(const ql_tensor *node) {
    const ql_tensor *a = node->src[0];
    const bool wide = a->type == QL_TYPE_Q4_K || a->type == QL_TYPE_Q5_K || a->type == QL_TYPE_NF4 || a->type == QL_TYPE_NF4_NODQ;
    return !wide || ((uintptr_t)a->data | (uintptr_t)a->nb[1]) % 16 == 0;
}
size_t ql_cuda_mm_q8_layout(int64_t N, int64_t K, int qb, size_t off[2]) {
    const size_t d = align_up((size_t)(N * K), 16), s = d + align_up((size_t)(N * (K / qb)) * sizeof(float), 16);
    if (off) off[0] = d, off[1] = s;
    return s + (size_t)(N * (K / (qb == 32 ? 32 : 8))) * sizeof(int32_t);
}
// A product over a short K (LoRA's rank side: B u onto a 16-bit W x, K = r): one kernel reading a
// (a plain 2-D float tensor, any strides; rounded to b's type as the tiles would be) and b (2-D,
// any strides), writing each output once with ql_mul_mat_acc's 16-bit c added as it writes, where
// the general path wrote an f32 product and added c in a second pass. No workspace. Only onto a
// 16-bit c: on an H200 it ran 8192 x 2048 x 16 onto bf16 at 7.7 TFLOP/s against 5.2, but with an
// f32 result (c or not) cuBLAS was as fast or faster (2048 x 2048 x 16: 7.3 against 5.6).
// QLORA_CUDA_THIN=all (read once): also the products onto an f32 c (measuring: in session 9 those ran
// slower than cuBLAS, 5.6 against 7.3 TFLOP/s; with c's elements read at once the step was the same
// on an H200 in session 10, 1B 25,098 against 25,206 tokens/s, 8B 7,270 against 7,304)
static const bool g_cuda_thin_f32 = getenv("QLORA_CUDA_THIN") && strcmp(getenv("QLORA_CUDA_THIN"), "all") == 0;
bool ql_cuda_mm_thin(const ql_tensor *node) {
    if (node->op != QL_OP_MUL_MAT || ql_cuda_mm_gemv(node) || !node->src[2] || (node->type == QL_TYPE_F32 && !g_cuda_thin_f32) ||
        ql_mul_mat_alpha(node) != 1.0f)
        return false;
    const ql_tensor *a = node->src[0], *b = node->src[1];
    const bool plain = a->type == QL_TYPE_F32 || a->type == QL_TYPE_F16 || a->type == QL_TYPE_BF16;
    return plain && !ql_cuda_mm_trows(a) && a->ne[0] <= QL_CUDA_THIN_K && a->ne[2] == 1 && a->ne[3] == 1 && b->ne[2] == 1 &&
           b->ne[3] == 1 && a->ne[1] <= INT32_MAX && b->ne[1] <= (int64_t)65535 * 32 && (!node->src[2] || ql_is_contiguous(node->src[2]));
}
static bool g_cuda_drop_fused = true;
void ql_cuda_mm_drop_fused_for_tests(bool on) { g_cuda_drop_fused = on; }
bool ql_cuda_mm_drop_fused(const ql_tensor *node) {
    if (node->op != QL_OP_MUL_MAT_DROPOUT || !g_cuda_drop_fused || node->op_params[4] == 0) return false;
    if (node->op_params[4] == 2) {  // dx = c + dropout(Aᵀ dc): k_mm_thin's shapes (K = r), its epilogue dropping each sum
        const ql_tensor *a = node->src[0], *b = node->src[1];
        const bool plain = a->type == QL_TYPE_F32 || a->type == QL_TYPE_F16 || a->type == QL_TYPE_BF16;
        return plain && !ql_cuda_mm_trows(a) && a->ne[0] <= QL_CUDA_THIN_K && b->ne[2] == 1 && b->ne[3] == 1 && a->ne[1] <= INT32_MAX &&
               b->ne[1] <= (int64_t)65535 * 32;
    }
    const ql_tensor *a = node->src[0], *x = node->src[1];
    const bool plain = a->type == QL_TYPE_F32 || a->type == QL_TYPE_F16 || a->type == QL_TYPE_BF16;
    // x's rows evenly spaced (row r at r nb[1]: the FFN's chunks are such views of h), a's columns dense
    return plain && a->ne[1] <= QL_CUDA_DROP_M && a->nb[0] == ql_plain_size(a->type) && x->nb[2] == x->nb[1] * (size_t)x->ne[1] &&
           x->nb[3] == x->nb[2] * (size_t)x->ne[2] && ql_nrows(x) <= INT32_MAX;
}
int64_t ql_cuda_mm_drop_splits(const ql_tensor *node, int64_t *k_per_split) {
    const int64_t K = node->src[1]->ne[0], N = ql_nrows(node->src[1]);
    const int64_t steps = (K + QL_CUDA_DROP_KSTEP - 1) / QL_CUDA_DROP_KSTEP, blocks = (N + QL_CUDA_DROP_TOKENS - 1) / QL_CUDA_DROP_TOKENS;
    const int64_t want = std::max<int64_t>(1, std::min<int64_t>(steps, QL_CUDA_DROP_BLOCKS / std::max<int64_t>(blocks, 1)));
    const int64_t per = (steps + want - 1) / want;  // k steps a split; no split left empty
    if (k_per_split) *k_per_split = per * QL_CUDA_DROP_KSTEP;
    return (steps + per - 1) / per;
}
static int32_t cuda_fa_prec(const ql_tensor *node) {
    const ql_tensor *fwd = node->op == QL_OP_FLASH_ATTN_BACK ? node->src[4] : node;
    int32_t prec;
    memcpy(&prec, &fwd->op_params[1], sizeof(prec));
    return prec;
}
// Which attention runs on tensor cores (read once from QLORA_CUDA_FA=chunked|forward|fused|auto, or
// ql_cuda_fa_set_mode). The default, QL_CUDA_FA_AUTO: the fused forward, and the backward the
// trainer times on the card (ql_cuda_fa_choose) - until then, and wherever nothing times it (a plan
// for a card this machine lacks), the chunked cuBLAS backward, as QL_CUDA_FA_FORWARD. On an H200 at
// seq 2048 the fused forward's register path ran at 50 / 42 TFLOP/s (d 128 / 64) against the
// products' 40 / 23, its backward at 16 / 17 against 22 / 20 (bench/RESULTS.md, GPU speed, session
// 10); its grids changed since (session 33), unmeasured. The two paths store the forward's lse
// alike, so they mix.
static int cuda_fa_mode_from_env() {
    const char *e = getenv("QLORA_CUDA_FA");
    if (!e) return QL_CUDA_FA_AUTO;
    return strcmp(e, "fused") == 0     ? QL_CUDA_FA_FUSED
           : strcmp(e, "chunked") == 0 ? QL_CUDA_FA_CHUNKED
           : strcmp(e, "forward") == 0 ? QL_CUDA_FA_FORWARD
                                       : QL_CUDA_FA_AUTO;
}
static int g_cuda_fa_mode = -1;  // (-1: the environment not read yet - constant-initialised, so a static initialiser elsewhere may set it)
void ql_cuda_fa_set_mode(int mode) { g_cuda_fa_mode = mode; }
int ql_cuda_fa_get_mode(void) {
    if (g_cuda_fa_mode < 0) g_cuda_fa_mode = cuda_fa_mode_from_env();
    return g_cuda_fa_mode;
}
bool ql_cuda_fa_fused(const ql_tensor *node) {
    const int mode = ql_cuda_fa_get_mode();
    if (mode == QL_CUDA_FA_CHUNKED) return false;
    if (!((node->op == QL_OP_FLASH_ATTN && !node->src[4]) || (node->op == QL_OP_FLASH_ATTN_BACK && mode == QL_CUDA_FA_FUSED)))
        return false;
    const int64_t D = node->src[0]->ne[0];
    return cuda_fa_prec(node) == QL_TYPE_BF16 && node->src[2]->ne[0] == D && ql_cuda_fa_fused_takes(D);
}
bool ql_cuda_fa_fused_takes(int64_t head_dim) { return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128; }

// One layer's bf16 attention as the trainer makes it (q, k, v cast from f32 leafs; batch 1),
// forward only or forward and backward, as a graph planned and run under one attention mode (the
// backend reads the mode as it runs a node, so it is set around each run); runs timed to the
// synchronize. ql_cuda_fa_time (tools/bench attn) and ql_cuda_fa_choose.
struct cuda_fa_timing {
    ql_context *ctx = nullptr;
    ql_graph *gf = nullptr, *g = nullptr;
    ql_backend_buffer *buf = nullptr;
    int mode = QL_CUDA_FA_AUTO;
    std::vector<double> ts;
    ~cuda_fa_timing() {
        if (g && g != gf) ql_graph_free(g);
        if (gf) ql_graph_free(gf);
        if (buf) ql_backend_buffer_free(buf);
        if (ctx) ql_free(ctx);
    }
    // score_bytes: the products' chunks (0: QL_FLASH_ATTN_SCORE_BYTES)
    bool make(ql_backend *be, int m, int64_t D, int64_t H, int64_t Hkv, int64_t T, bool backward, size_t score_bytes) {
        mode = m;
        const int was = ql_cuda_fa_get_mode();
        g_cuda_fa_mode = mode;
        const bool ok = build(be, D, H, Hkv, T, backward, score_bytes);
        g_cuda_fa_mode = was;
        return ok;
    }
    bool build(ql_backend *be, int64_t D, int64_t H, int64_t Hkv, int64_t T, bool backward, size_t score_bytes) {
        ql_init_params ip = {16u << 20, nullptr, true, false};
        if (!(ctx = ql_init(ip))) return false;
        ql_tensor *q = ql_new_tensor_4d(ctx, QL_TYPE_F32, D, T, H, 1), *k = ql_new_tensor_4d(ctx, QL_TYPE_F32, D, T, Hkv, 1);
        ql_tensor *v = ql_new_tensor_4d(ctx, QL_TYPE_F32, D, T, Hkv, 1);
        for (ql_tensor *t : {q, k, v}) ql_set_param(t);
        ql_tensor *a = ql_flash_attn(ctx, ql_cast(ctx, q, QL_TYPE_BF16), ql_cast(ctx, k, QL_TYPE_BF16), ql_cast(ctx, v, QL_TYPE_BF16),
                                     nullptr, 1.0f / std::sqrt((float)D));
        if (!a) return false;
        ql_flash_attn_set_prec(a, QL_TYPE_BF16);
        if (score_bytes) ql_flash_attn_set_score_bytes(a, score_bytes);
        ql_tensor *loss = ql_sum(ctx, ql_cast(ctx, a, QL_TYPE_F32));
        gf = ql_graph_new(ctx);
        ql_graph_build_forward(gf, backward ? loss : a);
        if (!(g = backward ? ql_graph_backward(ctx, gf, loss) : gf) || !(buf = ql_backend_alloc_ctx_tensors(be, ctx, QL_BUFFER_DEVICE)) ||
            ql_graph_plan(g, be, nullptr) != QL_OK || ql_graph_alloc(g, be) != QL_OK)
            return false;
        for (ql_tensor *x : {q, k, v}) {  // values of attention's scale (a hash: the same for every path)
            std::vector<float> d((size_t)ql_nelements(x));
            for (size_t i = 0; i < d.size(); i++) d[i] = (float)((ql_dropout_hash((uint64_t)x->ne[2], i) >> 8) * 0x1p-23 - 1.0);
            if (ql_backend_tensor_set(be, x, d.data(), 0, d.size() * sizeof(float)) != QL_OK) return false;
        }
        return true;
    }
    bool run(ql_backend *be, bool keep) {
        const int was = ql_cuda_fa_get_mode();
        g_cuda_fa_mode = mode;
        const auto t0 = std::chrono::steady_clock::now();
        const bool ok = (g == gf || ql_backend_graph_zero_grads(be, g) == QL_OK) && ql_backend_graph_compute(be, g) == QL_OK &&
                        ql_backend_synchronize(be) == QL_OK;
        if (ok && keep) ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        g_cuda_fa_mode = was;
        return ok;
    }
    double median() {
        std::sort(ts.begin(), ts.end());
        return ts[ts.size() / 2];
    }
    std::string error() const { return ctx && ql_ctx_error(ctx)[0] ? ql_ctx_error(ctx) : "the timing graph could not be made or run"; }
};
// Two runs to warm up (the second captures a CUDA graph), then the median of reps
double ql_cuda_fa_time(ql_backend *be, int mode, int64_t D, int64_t H, int64_t Hkv, int64_t T, bool backward, int reps) {
    cuda_fa_timing tm;
    bool ok = ql_backend_is_cuda(be) && reps > 0 && tm.make(be, mode, D, H, Hkv, T, backward, 0);
    for (int r = 0; ok && r < 2 + reps; r++) ok = tm.run(be, r >= 2);
    return ok ? tm.median() : -1.0;
}
// Each path at the run's shape (T capped: O(T^2) either way, so a longer run's ratio is taken
// there): the fused backward, and the products in auto's larger chunks, as a card with room runs
// them. The two run in turn, so clocks and the other work on the card weigh on both alike; the
// medians are compared. The forward is the same kernel in both: the difference is the backward's.
int ql_cuda_fa_choose(ql_backend *be, int64_t D, int64_t H, int64_t Hkv, int64_t T, double *ms_fused, double *ms_products,
                      char *err, size_t err_size) {
    auto fail = [&](const std::string &m) {
        if (err && err_size) snprintf(err, err_size, "%s", m.c_str());
        return -1;
    };
    if (!ql_backend_is_cuda(be)) return fail("not a CUDA device");
    if (D <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || T <= 0) return fail("bad attention shape");
    if (!ql_cuda_fa_fused_takes(D)) return fail("the fused backward does not take head dim " + std::to_string(D));
    T = std::min<int64_t>(T, QL_CUDA_FA_CHOOSE_SEQ);
    size_t peak = 0, dev_peak = 0;  // the timing's allocations are not the run's: the peaks are put back after
    ql_cuda_memory_used(nullptr, &peak);
    ql_cuda_device_memory_used(be, nullptr, &dev_peak);
    std::string e;
    double tf = 0, tp = 0;
    {
        cuda_fa_timing tm[2];
        int bad = !tm[0].make(be, QL_CUDA_FA_FUSED, D, H, Hkv, T, true, 0)                                ? 0
                  : !tm[1].make(be, QL_CUDA_FA_FORWARD, D, H, Hkv, T, true, 2 * QL_FLASH_ATTN_SCORE_BYTES) ? 1
                                                                                                            : -1;
        for (int r = 0; bad < 0 && r < 2 + QL_CUDA_FA_CHOOSE_REPS; r++)  // (two warm-ups, as ql_cuda_fa_time)
            for (int p = 0; p < 2 && bad < 0; p++)
                if (!tm[p].run(be, r >= 2)) bad = p;
        if (bad < 0) tf = tm[0].median(), tp = tm[1].median();
        else e = tm[bad].error();
    }
    ql_cuda_memory_set_peaks(be, peak, dev_peak);
    if (!e.empty()) return fail(e);
    if (ms_fused) *ms_fused = tf * 1e3;
    if (ms_products) *ms_products = tp * 1e3;
    return tf <= tp ? QL_CUDA_FA_FUSED : QL_CUDA_FA_FORWARD;
}
// As qlora-cuda.cu issues them (cu_run_node and the cu_op_* it calls); a test runs graphs through
// the shim and compares the count of what it issued with this.
int64_t ql_cuda_node_launches(const ql_tensor *node, int cc, bool inplace) {
    (void)inplace;  // (a product's c, in place or where it lives on, costs no copy: cuBLASLt reads it)
    auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    switch (node->op) {
    case QL_OP_NONE: case QL_OP_VIEW: case QL_OP_RESHAPE: case QL_OP_PERMUTE: case QL_OP_TRANSPOSE: case QL_OP_WITH_GRAD:
    case QL_OP_COUNT:
        return 0;
    case QL_OP_MUL_MAT_ROWS: {  // its product's (the result is c's storage: no copy of c)
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        return ql_cuda_node_launches(&mm, cc, mm.src[2] != nullptr);  // adding: c is mm, in place
    }
    case QL_OP_MUL_MAT_DROPOUT: {  // one kernel, or the dropout kernel and the product's launches
        if (ql_cuda_mm_drop_fused(node)) return node->op_params[4] == 1 && ql_cuda_mm_drop_splits(node, nullptr) > 1 ? 2 : 1;  // (the splits' sum)
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(node, &mm, &d, nullptr);
        return 1 + ql_cuda_node_launches(&mm, cc, false);  // the dropout before (D), or after (k_drop_acc)
    }
    case QL_OP_MUL_MAT: {
        if (ql_cuda_mm_gemv(node)) return ql_cuda_mm_q8(node) && ql_cuda_q8_aligned(node) ? 2 : 1;  // (b's columns quantised first)
        if (ql_cuda_mm_thin(node)) return 1;
        const ql_tensor *a = node->src[0], *b = node->src[1], *acc = node->src[2];
        const int64_t K = a->ne[0], M = a->ne[1];
        const int64_t A2 = a->ne[2], A3 = a->ne[3], B2 = b->ne[2], B3 = b->ne[3], r3 = B3 / A3;
        const bool acc16 = acc && node->type != QL_TYPE_F32;
        // k_acc_round; b's copies (c where it lives on: read by cuBLASLt's C != D, no copy)
        const int64_t n = acc16 + (ql_cuda_mm_b_direct(b) ? 0 : B2 * B3);
        // a in place (a cached weight: its copy), or in tiles of its rows (of Wᵀ: bands of W's
        // columns), each dequantised or converted by one kernel; per tile the GEMMs of the b batches it serves
        const bool direct = ql_cuda_mm_cached(a, b->type) || (!ql_cuda_mm_trows(a) && ql_cuda_mm_a_direct(a, b->type));
        const int64_t tiles = direct ? 1 : cdiv(M, ql_cuda_mm_tile_rows(K, M));
        return n + A2 * A3 * tiles * ((direct ? 0 : 1) + r3);
    }
    case QL_OP_FLASH_ATTN: case QL_OP_FLASH_ATTN_BACK: {
        const bool back = node->op == QL_OP_FLASH_ATTN_BACK;
        if (!ql_cuda_fa_gemm(node)) return back ? 3 : 1;  // fused: delta, dK/dV, dQ; the forward (or the KV cache's kernel)
        int64_t chunk = 1;
        ql_type ct = QL_TYPE_F32;
        ql_cuda_fa_layout(node, cc, nullptr, &chunk, &ct);
        const int64_t chunks = cdiv(node->src[0]->ne[1], chunk);
        // (delta and dK/dV zeroed,) K and V packed (unless read in place); per chunk: Q (and dO)
        // packed, products, softmax / dS, the unpack (backward's by the next chunk's pack, the last one alone)
        return (ql_cuda_fa_kv_direct(node, ct) ? 0 : 1) + (back ? 2 + 7 * chunks : 5 * chunks);
    }
    case QL_OP_CROSS_ENTROPY:
        return 2;  // rows, total
    case QL_OP_ROPE: case QL_OP_ROPE_BACK:
        return 1 + (node->op_params[0] < node->src[0]->ne[0]);  // the dimensions past n_dims copied by a second kernel
    case QL_OP_VIEW_BACK: case QL_OP_GET_ROWS_BACK:
        return 2;  // a memset, then the kernel
    case QL_OP_RMS_NORM: case QL_OP_RMS_NORM_BACK:
        return 1;  // with a weight too (ql_rms_norm_mul): multiplied in the same kernel
    default:
        return 1;
    }
}
bool ql_cuda_rope_pair(const ql_tensor *a, const ql_tensor *b) {
    if (!a || !b || a->op != b->op || (a->op != QL_OP_ROPE && a->op != QL_OP_ROPE_BACK)) return false;
    const ql_tensor *x = a->src[0], *y = b->src[0], *yr = view_root(b->src[0]);
    return a->src[1] == b->src[1] && a->src[2] == b->src[2] && !memcmp(a->op_params, b->op_params, 3 * sizeof(int32_t)) &&
           a->op_params[0] == x->ne[0] && b->op_params[0] == y->ne[0] && x->ne[2] == y->ne[2] && x->ne[3] == y->ne[3] && yr != a &&
           ql_is_contiguous(a) && ql_is_contiguous(b);
}
// decode: the new keys' and values' rows into their caches (the same position, cache type)
bool ql_cuda_cache_store_pair(const ql_tensor *a, const ql_tensor *b) {
    return a && b && a->op == QL_OP_CACHE_STORE && b->op == QL_OP_CACHE_STORE && a->type == b->type && a->src[2] == b->src[2] &&
           a->view_src != b->view_src && view_root(b->src[1]) != a->view_src;  // (a store's result is a view of its cache)
}
// b casts the whole of a, a norm or its backward in f32, to the 16 bits the products read: the
// norm's kernel writes both as it stores each element. (Backward: the residual's gradient goes on in
// f32. Forward: adapter dropout is drawn over the f32 normed input, the products read its copy)
bool ql_cuda_norm_cast_pair(const ql_tensor *a, const ql_tensor *b) {
    if (!a || !b || (a->op != QL_OP_RMS_NORM_BACK && a->op != QL_OP_RMS_NORM) || b->op != QL_OP_CONT || a->type != QL_TYPE_F32 ||
        (b->type != QL_TYPE_BF16 && b->type != QL_TYPE_F16))
        return false;
    const ql_tensor *x = b->src[0];
    const size_t offs = view_root_offset(x);  // x's byte offset into a
    return view_root(b->src[0]) == a && offs == 0 && ql_nelements(x) == ql_nelements(a) && ql_is_contiguous(x) && ql_is_contiguous(a) &&
           ql_is_contiguous(b);
}
// d, a dropped-out copy (contiguous, a float type) of the whole of a, contiguous, read as it is
// (maybe through identity views): a's kernel can write d as it stores each element
static bool cuda_whole_dropout(const ql_tensor *a, const ql_tensor *d) {
    if (!a || !d || d->op != QL_OP_DROPOUT || !ql_is_contiguous(a) || !ql_is_contiguous(d) ||
        (d->type != QL_TYPE_F32 && d->type != QL_TYPE_BF16 && d->type != QL_TYPE_F16))
        return false;
    const ql_tensor *x = d->src[0], *seed = d->src[1];
    return view_root(const_cast<ql_tensor *>(x)) == a && view_root_offset(x) == 0 && x->type == a->type &&
           ql_nelements(x) == ql_nelements(a) && ql_is_contiguous(x) && seed && seed->type == QL_TYPE_I32;
}
// d, an adapter's dropped-out copy of the whole of a, a norm's forward result in f32: the norm's
// kernel writes d too, with k_dropout's mask and bits (the mask at the copy's own rows: d's first
// row), after the norm's 16-bit copy if it has one, at most QL_CUDA_NORM_DROPS of them (q, k and v;
// gate and up)
bool ql_cuda_norm_dropout(const ql_tensor *a, const ql_tensor *d) {
    return a && a->op == QL_OP_RMS_NORM && a->type == QL_TYPE_F32 && cuda_whole_dropout(a, d);
}
// d, an adapter's dropped-out copy of the whole of a, SwiGLU's result (the down projection's
// input): SwiGLU's kernel writes d too, from each element as stored (k_dropout's bits)
bool ql_cuda_swiglu_dropout(const ql_tensor *a, const ql_tensor *d) {
    return a && a->op == QL_OP_SWIGLU && cuda_whole_dropout(a, d);
}
// a, a cast of an f32 view to 16 bits (contiguous), and b, a rotation of every dimension (no tail
// launch) of a view of the same result: attention's backward, the values' gradient cast for their
// products, then q's and k's rotations back (a rope pair after it). The rotation's launch writes
// the cast too (k_cont's bits)
bool ql_cuda_cast_rope(const ql_tensor *a, const ql_tensor *b) {
    if (!a || !b || a->op != QL_OP_CONT || (a->type != QL_TYPE_BF16 && a->type != QL_TYPE_F16) || !ql_is_contiguous(a) ||
        a->src[0]->type != QL_TYPE_F32 || (b->op != QL_OP_ROPE && b->op != QL_OP_ROPE_BACK) || !ql_is_contiguous(b) ||
        b->op_params[0] != b->src[0]->ne[0])
        return false;
    const ql_tensor *ra = view_root(const_cast<ql_tensor *>(a->src[0]));
    return ra == view_root(const_cast<ql_tensor *>(b->src[0])) && ra != a && ra != b;
}
// decode: a norm (whole rows of a multiple of 256) or SwiGLU (contiguous f32 operands), f32, at
// most QL_CUDA_GEMV_MAX_N columns, whose next node is a product with 8-bit activations reading it:
// its kernel writes the product's codes too (the product's quantisation is then not launched). qb, or 0
static std::atomic<bool> cuda_pairs_on{!(getenv("QLORA_CUDA_PAIRS") && strcmp(getenv("QLORA_CUDA_PAIRS"), "0") == 0)};
int ql_cuda_q8_made_by(const ql_tensor *a, const ql_tensor *mm) {
    if (!cuda_pairs_on || !a || !mm || a->type != QL_TYPE_F32 || !ql_is_contiguous(a) || a->ne[2] != 1 || a->ne[3] != 1 ||
        mm->op != QL_OP_MUL_MAT)
        return 0;
    const int qb = ql_cuda_mm_q8(mm);
    if (!qb || !ql_cuda_q8_aligned(mm)) return 0;
    if (a->op == QL_OP_FLASH_ATTN) {
        // decode's attention over a cache (k_fa_decode: one query, D and DV <= 256), read by the o
        // projection as [DV H, 1]: the head completing a block of qb writes its codes (a block spans
        // qb / DV heads, or a head DV / qb blocks)
        const ql_tensor *b = mm->src[1], *q = a->src[0];
        const size_t offs = view_root_offset(b);
        const int64_t DV = a->ne[0];
        return a->src[4] && q->type == QL_TYPE_F32 && q->ne[1] == 1 && q->ne[0] <= 256 && DV <= 256 &&
                       view_root(const_cast<ql_tensor *>(b)) == a && offs == 0 && ql_is_contiguous(b) && b->ne[1] == 1 &&
                       ql_nelements(b) == ql_nelements(a) && (qb % DV == 0 || DV % qb == 0)
                   ? qb
                   : 0;
    }
    if (mm->src[1] != a) return 0;
    if (a->op == QL_OP_RMS_NORM) {
        if (a->ne[0] % 256 != 0) return 0;
    } else if (a->op == QL_OP_SWIGLU) {
        for (const ql_tensor *x : {a->src[0], a->src[1]})
            if (x->type != QL_TYPE_F32 || !ql_is_contiguous(x)) return 0;
    } else {
        return 0;
    }
    return qb;
}
// Q6_K rows of whole 2048-element chunks, 16-byte aligned: the staged decode kernel (k_gemv_q8_q6s)
bool ql_cuda_gemv_q6s(const ql_tensor *w) {
    return w->type == QL_TYPE_Q6_K && w->ne[0] % 2048 == 0 && ((uintptr_t)w->data | (uintptr_t)w->nb[1]) % 16 == 0;
}
// decode: two products with 8-bit activations of one b (q, k and v; gate and up): one launch of
// k_gemv_q8 over both weights' rows (the same weight type: one kernel), b's codes made once
bool ql_cuda_gemv_group(const ql_tensor *a, const ql_tensor *b) {
    if (!a || !b || a->op != QL_OP_MUL_MAT || b->op != QL_OP_MUL_MAT || a->src[1] != b->src[1]) return false;
    const int qb = ql_cuda_mm_q8(a);
    if (!qb || ql_cuda_mm_q8(b) != qb || !ql_cuda_q8_aligned(a) || !ql_cuda_q8_aligned(b)) return false;
    if (a->src[0]->type != b->src[0]->type || ql_cuda_gemv_q6s(a->src[0]) || ql_cuda_gemv_q6s(b->src[0])) return false;
    for (const ql_tensor *s : b->src)  // b reads nothing of a's result (its addend, say)
        if (s && view_root(const_cast<ql_tensor *>(s)) == a) return false;
    return true;
}
// decode: b norms the whole of a, a product with 8-bit activations [M, N] (f32, M a multiple of
// 256): the last of the product's blocks to finish norms its result (k_gemv_q8's tail, the bits of
// k_rms_norm) and writes the next product's codes where the norm's own launch would
bool ql_cuda_gemv_norm(const ql_tensor *a, const ql_tensor *b) {
    if (!a || !b || a->op != QL_OP_MUL_MAT || b->op != QL_OP_RMS_NORM || !ql_cuda_mm_q8(a) || !ql_cuda_q8_aligned(a)) return false;
    const ql_tensor *x = b->src[0];
    return view_root(const_cast<ql_tensor *>(x)) == a && view_root_offset(x) == 0 && ql_nelements(x) == ql_nelements(a) &&
           x->ne[0] == a->ne[0] && a->type == QL_TYPE_F32 && b->type == QL_TYPE_F32 && a->ne[0] % 256 == 0 && ql_is_contiguous(a) &&
           ql_is_contiguous(x) && ql_is_contiguous(b) && (!b->src[1] || (b->src[1]->type == QL_TYPE_F32 && ql_is_contiguous(b->src[1])));
}
// decode: s = SwiGLU(a's result, b's), a and b a group of products (gate and up: ql_cuda_gemv_group)
// of M rows, a multiple of 256: the last block to finish each 256 rows of both makes s's rows and
// their codes for the next product (in the workspace past the group's own codes: ql_cuda_q8_codes_at)
bool ql_cuda_gemv_swiglu(const ql_tensor *a, const ql_tensor *b, const ql_tensor *s) {
    if (!s || s->op != QL_OP_SWIGLU || !ql_cuda_gemv_group(a, b) || s->type != QL_TYPE_F32 || !ql_is_contiguous(s)) return false;
    if (ql_cuda_q8_codes_at(a) != 0) return false;  // (the group's codes at the workspace's start)
    const int64_t M = a->ne[0];
    if (M % 256 != 0 || M / 256 > QL_CUDA_Q8_COUNTERS || b->ne[0] != M || s->ne[0] != M || s->ne[1] != a->ne[1] || b->ne[1] != a->ne[1])
        return false;
    for (const ql_tensor *t : {a, b})
        if (t->type != QL_TYPE_F32 || !ql_is_contiguous(t)) return false;
    return ((s->src[0] == a && s->src[1] == b) || (s->src[0] == b && s->src[1] == a)) && s->src[0] != s->src[1];
}
// decode: after a group of q, k and v products (ql_cuda_gemv_group, three), q's rotation, k's
// (a rope pair after it), k's cache store of it (ql_cuda_rope_store) and v's (a store pair after
// it): each rotation of every dimension (f32) reading its product's whole result [D H, T] as
// [D, H, T], the values v's whole result [DV Hkv, T] as [DV, T, Hkv]. Node joins grp[0..n) as the
// next of those (n 3 to 6): the launch's tail rotates each head once its rows are made (the last
// block of them; the keys into their cache too), and v's blocks store their rows in the cache
bool ql_cuda_gemv_rope(const ql_tensor *const *grp, int n, const ql_tensor *node) {
    if (n < 3 || n > 6 || !node) return false;
    for (int i = 0; i < 3; i++)
        if (grp[i]->op != QL_OP_MUL_MAT || grp[i]->type != QL_TYPE_F32 || !ql_is_contiguous(grp[i])) return false;
    auto whole = [](const ql_tensor *x, const ql_tensor *mm) {
        return view_root(const_cast<ql_tensor *>(x)) == mm && view_root_offset(x) == 0 && ql_nelements(x) == ql_nelements(mm) &&
               x->type == QL_TYPE_F32;
    };
    auto rotation = [&](const ql_tensor *r, const ql_tensor *mm) {  // r rotates mm's [D H, T] as [D, H, T], every dimension
        const ql_tensor *x = r->src[0];
        const int64_t D = x->ne[0];
        return r->op == QL_OP_ROPE && r->type == QL_TYPE_F32 && ql_is_contiguous(r) && whole(x, mm) && r->op_params[0] == D &&
               D % 4 == 0 && x->ne[3] == 1 && x->nb[0] == 4 && x->nb[1] == (size_t)D * 4 && x->nb[2] == (size_t)(D * x->ne[1]) * 4 &&
               mm->ne[0] == D * x->ne[1];
    };
    switch (n) {
    case 3:
        return rotation(node, grp[0]) && ql_cuda_gemv_group(grp[0], grp[1]) && ql_cuda_gemv_group(grp[0], grp[2]) &&
               grp[0]->ne[0] / node->src[0]->ne[0] + grp[1]->ne[0] / node->src[0]->ne[0] <= QL_CUDA_Q8_COUNTERS;
    case 4:
        return rotation(node, grp[1]) && ql_cuda_rope_pair(grp[3], node) && node->src[0]->ne[0] == grp[3]->src[0]->ne[0];
    case 5:
        return ql_cuda_rope_store(grp[4], node);
    default: {
        const ql_tensor *vs = node->src[1], *v = grp[2];
        return ql_cuda_cache_store_pair(grp[5], node) && whole(vs, v) && vs->ne[3] == 1 && vs->nb[0] == 4 &&
               vs->nb[1] == (size_t)v->ne[0] * 4 && vs->nb[2] == (size_t)vs->ne[0] * 4 && vs->ne[0] * vs->ne[2] == v->ne[0];
    }
    }
}
// where product mm finds its b's codes: past its b's producers' codes where b is SwiGLU of a
// product group (ql_cuda_gemv_swiglu writes them while the group reads its own at 0); else at 0
size_t ql_cuda_q8_codes_at(const ql_tensor *mm) {
    const ql_tensor *s = mm && mm->op == QL_OP_MUL_MAT ? mm->src[1] : nullptr;
    if (!s || s->op != QL_OP_SWIGLU || !s->src[0] || s->src[0]->op != QL_OP_MUL_MAT) return 0;
    const ql_tensor *g = s->src[0];
    const int qb = ql_cuda_mm_q8(g);
    return qb ? align_up(ql_cuda_mm_q8_layout(g->src[1]->ne[1], g->src[0]->ne[0], qb, nullptr), QL_ALIGN) : 0;
}
// a product launch's tail (ql_cuda_gemv_norm, _swiglu, _rope) may lie over the products' bytes,
// result or addend (in place): the tail's rows are made after every block that reads them has
// counted itself (a rotation's, after its head's), the products read b's codes in the workspace,
// not b, and the cache stores write the caches
bool ql_cuda_tail_over_ok(const ql_tensor *first, const ql_tensor *node) {
    return first && node && first->op == QL_OP_MUL_MAT &&
           (node->op == QL_OP_RMS_NORM || node->op == QL_OP_SWIGLU || node->op == QL_OP_ROPE || node->op == QL_OP_CACHE_STORE);
}
// off (QLORA_CUDA_PAIRS=0, an A/B; or a test: the same bits either way): every node its own launch
void ql_cuda_launch_pair_for_tests(bool on) { cuda_pairs_on = on; }
bool ql_cuda_launch_pair(const ql_tensor *a, const ql_tensor *b) {
    return cuda_pairs_on && (ql_cuda_rope_pair(a, b) || ql_cuda_norm_cast_pair(a, b) || ql_cuda_norm_dropout(a, b) || ql_cuda_swiglu_dropout(a, b) || ql_cuda_cast_rope(a, b) ||
                             ql_cuda_cache_store_pair(a, b) || ql_cuda_gemv_group(a, b) || ql_cuda_gemv_norm(a, b));
}
bool ql_cuda_rope_store(const ql_tensor *rk, const ql_tensor *st) {
    if (!rk || !st || rk->op != QL_OP_ROPE || st->op != QL_OP_CACHE_STORE || rk->type != QL_TYPE_F32 || !ql_is_contiguous(rk))
        return false;
    const ql_tensor *s = st->src[1];
    const size_t offs = view_root_offset(s);  // s's byte offset into rk
    return view_root(const_cast<ql_tensor *>(s)) == rk && offs == 0 && s->type == QL_TYPE_F32 && s->ne[0] == rk->ne[0] &&
           s->ne[1] == rk->ne[2] && s->ne[2] == rk->ne[1] && s->ne[3] == rk->ne[3] && s->nb[0] == rk->nb[0] && s->nb[1] == rk->nb[2] &&
           s->nb[2] == rk->nb[1] && s->nb[3] == rk->nb[3];
}
bool ql_cuda_launch_joins(const ql_tensor *const *grp, int n, const ql_tensor *node) {
    if (n <= 0 || !node) return false;
    if (n == 1) return ql_cuda_launch_pair(grp[0], node);
    if (!cuda_pairs_on) return false;
    if (grp[0]->op == QL_OP_CONT)  // a cast and a rotation, then the rotation's pair
        return n == 2 && ql_cuda_rope_pair(grp[1], node);
    if (grp[0]->op == QL_OP_RMS_NORM)  // a norm, its cast or an adapter's copy, then more copies
        return n - 1 - (grp[1]->op == QL_OP_CONT) < QL_CUDA_NORM_DROPS && ql_cuda_norm_dropout(grp[0], node);
    if (grp[0]->op == QL_OP_ROPE)  // a rope pair, then k's store, then v's
        return n == 2 ? ql_cuda_rope_store(grp[1], node) : n == 3 && ql_cuda_cache_store_pair(grp[2], node);
    if (grp[0]->op == QL_OP_MUL_MAT && n >= 3 && ql_cuda_gemv_rope(grp, n, node)) return true;
    if (grp[n - 1]->op != QL_OP_MUL_MAT) return false;  // (a product's norm or SwiGLU ends its launch)
    if (n == 2 && ql_cuda_gemv_swiglu(grp[0], grp[1], node)) return true;
    if (n >= QL_CUDA_GEMV_GROUP) return false;
    for (int i = 0; i < n; i++)
        if (!ql_cuda_gemv_group(grp[i], node)) return false;
    return true;
}
bool ql_cuda_fa_gemm(const ql_tensor *node) {
    return ((node->op == QL_OP_FLASH_ATTN && !node->src[4]) || node->op == QL_OP_FLASH_ATTN_BACK) && !ql_cuda_fa_fused(node);
}
// the chunk: a power of two in [16, 256] whose scores fit the budget (QLORA_CUDA_FA_SCORE_MB: another
// budget for every node, for measuring), or all of Tq
int64_t ql_flash_attn_chunk_rows(int64_t Tq, int64_t Tk, int64_t H, int64_t B, size_t score_bytes) {
    static const size_t env_bytes = getenv("QLORA_CUDA_FA_SCORE_MB") && atoi(getenv("QLORA_CUDA_FA_SCORE_MB")) > 0
                                        ? (size_t)atoi(getenv("QLORA_CUDA_FA_SCORE_MB")) << 20
                                        : 0;
    const size_t budget = env_bytes ? env_bytes : score_bytes ? score_bytes : QL_FLASH_ATTN_SCORE_BYTES;
    int64_t c = 16;
    while (c < 256 && (size_t)(2 * c * Tk * H * B) * sizeof(float) <= budget) c *= 2;
    return std::min(c, Tq);
}
// k and v read in place by the products (no packed copies, 4 KiB a token at the 8B shape): one
// sequence, already in the compute type, each a permuted view of a contiguous [D, Hkv, Tk] (what
// the llama block's rope and v projection make) - a kv head's rows [D, Tk] then lie Hkv D apart
// and the heads D apart, one stride each as the batched products need
bool ql_cuda_fa_kv_direct(const ql_tensor *node, ql_type ct) {
    for (const ql_tensor *t : {node->src[1], node->src[2]}) {
        const size_t es = ql_plain_size(t->type);
        if (t->type != ct || t->ne[3] != 1 || t->nb[0] != es || t->nb[2] != (size_t)t->ne[0] * es ||
            t->nb[1] != (size_t)(t->ne[0] * t->ne[2]) * es)
            return false;
    }
    return true;
}
// The fused backward's dK/dV blocks, one per (keys, kv head, slice of the group's query heads):
// with GQA a block over every query head of its group runs rep times the query tiles of one over
// a single head, and at seq 2048 (1B and 8B shapes: 32 key blocks x 8 kv heads = 256 blocks, one
// wave on an H100) the first key block's rep x 32 tiles set the kernel's time while most SMs idle.
// Split into slices until the grid has QL_CUDA_FA2_SPLIT_BLOCKS blocks (nominal 64 keys a block,
// whatever the device's kernel: the plan's workspace must not depend on it); the slices' partial
// dK, dV are summed by the dQ kernel's extra blocks in slice order (deterministic). 1: no split
// (MHA, enough blocks, or QLORA_CUDA_FA2_SPLIT=0 / ql_cuda_fa2_set_split(0)).
static int g_fa2_split = !(getenv("QLORA_CUDA_FA2_SPLIT") && strcmp(getenv("QLORA_CUDA_FA2_SPLIT"), "0") == 0);
int ql_cuda_fa2_set_split(int on) {
    const int was = g_fa2_split;
    g_fa2_split = on != 0;
    return was;
}
int ql_cuda_fa2_kv_split(const ql_tensor *node) {
    if (!g_fa2_split || node->op != QL_OP_FLASH_ATTN_BACK || !ql_cuda_fa_fused(node)) return 1;
    const ql_tensor *q = node->src[0], *k = node->src[1];
    const int64_t rep = q->ne[2] / k->ne[2], blocks = (k->ne[1] + 63) / 64 * k->ne[2] * k->ne[3];
    int s = 1;
    while (s < rep && blocks * s < QL_CUDA_FA2_SPLIT_BLOCKS) {
        s++;
        while (rep % s) s++;  // a divisor of rep: every slice as many heads
    }
    return s;
}
// q [D, Tq, H, B], k [D, Tk, Hkv, B], v [DV, Tk, Hkv, B]; the forward needs K, V, Q, S (+ P in
// bf16) and the output's chunk [DV, chunk, H, B]; backward also delta [Tq, H, B], dO, dP (+ dS)
// and dq's chunk in the output's place
size_t ql_cuda_fa_layout(const ql_tensor *node, int cc, size_t off[QL_CUDA_FA_NBUF], int64_t *chunk, ql_type *compute) {
    const ql_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2];
    const bool fused = ql_cuda_fa_fused(node), bf16 = cuda_fa_prec(node) == QL_TYPE_BF16;
    const ql_type ct = bf16 && ql_cuda_bf16_gemm(cc) ? QL_TYPE_BF16 : fused ? QL_TYPE_F16 : QL_TYPE_F32;
    const size_t es = ql_plain_size(ct);
    const int64_t D = q->ne[0], Tq = q->ne[1], H = q->ne[2], B = q->ne[3], Tk = k->ne[1], Hkv = k->ne[2], DV = v->ne[0];
    const bool back = node->op == QL_OP_FLASH_ATTN_BACK;
    if (fused) {  // the fused kernels read q, k, v in place; the backward's delta [Tq, H, B] and dO in the compute type
                  // [DV, H, Tq, B] (none where dO is in it already: read in place)
        for (int i = 0; off && i < QL_CUDA_FA_NBUF; i++) off[i] = 0;
        const size_t nd = align_up((size_t)(Tq * H * B) * sizeof(float), QL_ALIGN);
        if (off) off[QL_CUDA_FA_DO] = nd;
        if (chunk) *chunk = 0;
        if (compute) *compute = ct;
        const bool copy = back && node->src[5]->type != ct;
        if (!back) return 0;
        const size_t nc = copy ? align_up((size_t)(DV * Tq * H * B) * es, QL_ALIGN) : 0;
        const int split = ql_cuda_fa2_kv_split(node);  // dK, dV by slices of the group's query heads: [split][dk | dv] f32
        if (off) off[QL_CUDA_FA_S] = nd + nc;
        return nd + nc + (split > 1 ? (size_t)split * (size_t)(ql_nelements(k) + ql_nelements(v)) * sizeof(float) : 0);
    }
    const ql_tensor *fwd = back ? node->src[4] : node;  // (the forward's budget: ql_flash_attn_set_score_bytes)
    const int64_t c = ql_flash_attn_chunk_rows(Tq, Tk, H, B, (size_t)get_param<int32_t>(fwd, 2) << 20);
    const size_t sc = (size_t)(Tk * c * H * B);  // scores of one chunk
    size_t n[QL_CUDA_FA_NBUF] = {0};
    n[QL_CUDA_FA_DELTA] = back ? (size_t)(Tq * H * B) * sizeof(float) : 0;
    const bool direct = ql_cuda_fa_kv_direct(node, ct);
    n[QL_CUDA_FA_K] = direct ? 0 : (size_t)(D * Tk * Hkv * B) * es;
    n[QL_CUDA_FA_V] = direct ? 0 : (size_t)(DV * Tk * Hkv * B) * es;
    n[QL_CUDA_FA_Q] = (size_t)(D * c * H * B) * es;
    n[QL_CUDA_FA_DO] = back ? (size_t)(DV * c * H * B) * es : 0;
    n[QL_CUDA_FA_S] = sc * sizeof(float);
    n[QL_CUDA_FA_DP] = back ? sc * sizeof(float) : 0;
    n[QL_CUDA_FA_P] = es == 2 ? sc * es : 0;  // f32: over S
    n[QL_CUDA_FA_DS] = back && es == 2 ? sc * es : 0;  // f32: over dP
    n[QL_CUDA_FA_OUT] = (size_t)((back ? D : DV) * c * H * B) * sizeof(float);
    size_t total = 0;
    for (int i = 0; i < QL_CUDA_FA_NBUF; i++) {
        if (off) off[i] = total;
        total += align_up(n[i], QL_ALIGN);
    }
    if (chunk) *chunk = c;
    if (compute) *compute = ct;
    return total;
}
size_t ql_cuda_work_size(const ql_tensor *node, int cc) {
    if (ql_cuda_fa_gemm(node) || ql_cuda_fa_fused(node)) return ql_cuda_fa_layout(node, cc, nullptr, nullptr, nullptr);
    switch (node->op) {
    case QL_OP_MUL_MAT_ROWS: {  // its product's
        ql_tensor mm;
        ql_mul_mat_rows_product(node, &mm);
        return ql_cuda_work_size(&mm, cc);
    }
    case QL_OP_MUL_MAT_DROPOUT: {  // k_mm_drop: its splits' sums (none unsplit); or the dropped operand D (x's elements in the product's type), then the product's
        const int slot = node->op_params[4];
        if (ql_cuda_mm_drop_fused(node)) {
            const int64_t s = slot == 1 ? ql_cuda_mm_drop_splits(node, nullptr) : 1;
            return s > 1 ? (size_t)(s * ql_nelements(node)) * sizeof(float) : 0;
        }
        ql_tensor mm, d;
        ql_mul_mat_dropout_product(node, &mm, &d, nullptr);
        if (slot == 2)  // the product, then its own workspace: k_drop_acc reads it and c (c may be the result's storage)
            return align_up((size_t)ql_nelements(node) * sizeof(float), QL_ALIGN) + ql_cuda_work_size(&mm, cc);
        return align_up((size_t)ql_nelements(node->src[slot]) * ql_plain_size(d.type), QL_ALIGN) + ql_cuda_work_size(&mm, cc);
    }
    case QL_OP_MUL_MAT: {  // b's contiguous copy (when cuBLAS cannot read it), then a's tile buffers: tiles of
        // a's rows (K each; of a transposed W, bands of W's columns), two when there is more than
        // one tile (the next is dequantised while the current one's GEMMs run)
        if (ql_cuda_mm_gemv(node)) {  // none, or b's columns in 8 bits (where they are found: ql_cuda_q8_codes_at)
            const int qb = ql_cuda_mm_q8(node);
            return qb ? ql_cuda_q8_codes_at(node) + ql_cuda_mm_q8_layout(node->src[1]->ne[1], node->src[0]->ne[0], qb, nullptr) : 0;
        }
        if (ql_cuda_mm_thin(node)) return 0;
        const ql_tensor *a = node->src[0], *b = node->src[1];
        size_t w = ql_cuda_mm_b_bytes(b);
        if (!ql_cuda_mm_cached(a, b->type) && (ql_cuda_mm_trows(a) || !ql_cuda_mm_a_direct(a, b->type)))  // (a cached weight: its copy)
            w += (size_t)ql_cuda_mm_tile_bufs(a->ne[0], a->ne[1], a->ne[2] * a->ne[3]) *
                 ql_cuda_mm_tile_bytes(a->ne[0], a->ne[1], b->type);
        if (node->src[2] && node->type != QL_TYPE_F32)  // a 16-bit c: the product in f32 before c is added (qlora-cuda.cu)
            w = align_up(w, QL_ALIGN) + (size_t)ql_nelements(node) * sizeof(float);
        return w;
    }
    default:
        return 0;
    }
}

// A backend that only plans: what the CUDA backend would place and need for a graph, on a
// machine without the device. It computes nothing and allocates nothing.
static bool cuda_plan_supports(ql_backend *be, const ql_tensor *node) {
    const int cc = (int)(intptr_t)be->impl;
    const ql_tensor *b = node->op == QL_OP_MUL_MAT ? node->src[1] : node->op == QL_OP_MUL_MAT_ROWS ? node->src[2] : nullptr;
    if (node->op == QL_OP_MUL_MAT_DROPOUT && (node->op_params[4] == 2 ? node->src[1]->type : node->op_params[5]) == QL_TYPE_BF16 &&
        !ql_cuda_mm_drop_fused(node))
        return ql_cuda_bf16_gemm(cc);
    return !(b && b->type == QL_TYPE_BF16 && !ql_cuda_bf16_gemm(cc));  // as the device
}
static size_t cuda_plan_work(ql_backend *be, const ql_tensor *node) { return ql_cuda_work_size(node, (int)(intptr_t)be->impl); }
static void cuda_plan_free(ql_backend *be) { delete be; }

ql_backend *ql_backend_init_planned(ql_device d, int cc, char *err, size_t err_size) {
    if (d.kind == QL_DEVICE_CPU || cc < 10) {
        if (err && err_size)
            snprintf(err, err_size, d.kind == QL_DEVICE_CPU ? "the CPU needs no stand-in (it is here)" : "%d is not a compute capability", cc);
        return nullptr;
    }
    ql_backend *be = new ql_backend();
    be->iface = {"cuda (plan only)", cuda_plan_supports, cuda_plan_work, nullptr, nullptr, nullptr, cuda_plan_free,
                 nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    be->impl = (void *)(intptr_t)cc;
    be->id = ql_backend_new_id();
    return be;
}
static bool plan_only(const ql_backend *be) { return be && be->iface.graph_compute == nullptr; }

ql_status ql_backend_get_caps(const ql_backend *be, ql_backend_caps *c) {
    if (!c) return QL_ERR_INVALID;
    memset(c, 0, sizeof(*c));
    if (!be) return QL_ERR_INVALID;
    c->alloc_granularity = 1;
    if (ql_backend_is_host(be)) {
        snprintf(c->name, sizeof(c->name), "cpu");
        c->host = true;
        c->bf16_gemm = ql_cpu_bf16_native();
        return QL_OK;
    }
    if (plan_only(be)) {
        c->plan_only = true;
        c->cc = (int)(intptr_t)be->impl;
        snprintf(c->name, sizeof(c->name), "a CUDA device of compute capability %d.%d (none here)", c->cc / 10, c->cc % 10);
    } else {
        ql_cuda_device_info info;
        if (ql_backend_cuda_info(be, &info) != QL_OK) return QL_ERR_INVALID;
        snprintf(c->name, sizeof(c->name), "%s", info.name);
        c->cc = info.major * 10 + info.minor;
        c->mem_total = info.total_mem;
        c->mem_free = info.free_mem;
    }
    c->bf16_gemm = ql_cuda_bf16_gemm(c->cc);
    c->alloc_granularity = (size_t)2 << 20;  // cudaMalloc hands out whole 2 MiB pages for big blocks
    c->context_bytes = ql_cuda_context_bytes(c->cc);
    c->context_estimated = c->cc != 90;  // see ql_cuda_context_bytes: only 9.0 measured
    c->graph_launch_bytes = ql_cuda_graph_launch_bytes();
    return QL_OK;
}

bool ql_backend_memory_used(const ql_backend *be, size_t *in_use, size_t *peak) {
    if (ql_backend_is_cuda(be)) return ql_cuda_memory_used(in_use, peak);
    if (in_use) *in_use = 0;
    if (peak) *peak = 0;
    return false;
}

size_t ql_cuda_context_bytes(int cc) {
    // The CUDA context (driver state, the runtime, our kernels and cuBLAS's loaded lazily - the
    // default since CUDA 12.2) and cuBLAS's workspace (NVIDIA's recommendation: 4 MiB, 32 MiB on
    // Hopper). cc 9.0 is MEASURED: on an H200 (driver 580.159, CUDA 13; session 35) the card's use
    // minus ours was 635.1-635.8 MiB after step 1 at the 1B and 8B shapes and 8B under --vram 8G,
    // 6.3-7.0 of it our allocator's rounding (planned on its own line): 629 = 597 + the workspace.
    // (An H100 in session 8 gave 595: the context grows with the kernels the binary loads.) The
    // others are not measured: public reports of context sizes with lazy loading say 200-500 MiB.
    // Until they are, they get the same 597 MiB, above every report - the uncertainty left as
    // margin, so that a plan for such a card does not promise what it may not hold
    // (ql_backend_caps.context_estimated says so; finetune prints the card's use beside the plan
    // after step 1 to check).
    const size_t MiB = 1u << 20;
    return 597 * MiB + ql_cuda_cublas_workspace_bytes(cc);
}

size_t ql_cuda_graph_launch_bytes(void) {
    // A captured CUDA graph's executable lives in device memory, beside the context: on an H200
    // (session 35) a 777,151-launch step (8B at 32k tokens) held 63.7 MiB more of the card than the
    // 2048-token steps (1,241-4,217 launches) - about 86 bytes a launch, measured once
    return 86;
}

size_t ql_cuda_cublas_workspace_bytes(int cc) { return (size_t)(cc >= 90 ? 32 : 4) << 20; }

// A build without qlora-cuda.cu: weak definitions the CUDA object replaces when it is linked in
// (make CUDA=1), so the library and the drop-in build need no #ifdef and no CUDA.
__attribute__((weak)) int ql_cuda_device_count(void) { return 0; }
__attribute__((weak)) ql_status ql_cuda_device_get_info(int, ql_cuda_device_info *info, char *err, size_t err_size) {
    if (info) memset(info, 0, sizeof(*info));
    if (err && err_size) snprintf(err, err_size, "this build has no CUDA backend --> hint: rebuild with make CUDA=1");
    return QL_ERR_UNSUPPORTED;
}
__attribute__((weak)) ql_backend *ql_backend_cuda_init(int, char *err, size_t err_size) {
    if (err && err_size) snprintf(err, err_size, "this build has no CUDA backend --> hint: rebuild with make CUDA=1");
    return nullptr;
}
__attribute__((weak)) bool ql_backend_is_cuda(const ql_backend *) { return false; }
__attribute__((weak)) bool ql_cuda_fa2_register_path(const ql_backend *) { return false; }
__attribute__((weak)) int ql_cuda_fa2_set_pipe(int) { return 0; }
__attribute__((weak)) void ql_cuda_set_graphs(ql_backend *, bool) {}
__attribute__((weak)) bool ql_cuda_get_graph_counts(const ql_backend *, ql_cuda_graph_counts *counts) {
    if (counts) *counts = ql_cuda_graph_counts{};
    return false;
}
__attribute__((weak)) ql_status ql_backend_cuda_info(const ql_backend *, ql_cuda_device_info *info) {
    if (info) memset(info, 0, sizeof(*info));
    return QL_ERR_INVALID;
}
__attribute__((weak)) bool ql_cuda_memory_used(size_t *in_use, size_t *peak) {
    if (in_use) *in_use = 0;
    if (peak) *peak = 0;
    return false;
}
__attribute__((weak)) ql_status ql_cuda_copy_peer(ql_backend *, void *, ql_backend *, const void *, size_t) { return QL_ERR_UNSUPPORTED; }
ql_status ql_backend_copy_peer(ql_backend *to, ql_tensor *dst, ql_backend *from, const ql_tensor *src) {
    if (!to || !dst || !from || !src || !dst->data || !src->data || ql_nbytes(dst) != ql_nbytes(src) || !ql_is_contiguous(dst) ||
        !ql_is_contiguous(src))
        return QL_ERR_INVALID;
    return copy_refresh(to, dst, ql_cuda_copy_peer(to, dst->data, from, src->data, ql_nbytes(src)));
}
__attribute__((weak)) bool ql_cuda_device_memory_used(const ql_backend *, size_t *in_use, size_t *peak) {
    if (in_use) *in_use = 0;
    if (peak) *peak = 0;
    return false;
}
__attribute__((weak)) void ql_cuda_memory_set_peaks(const ql_backend *, size_t, size_t) {}

// A build without qlora-mpi.cpp: one process. Its definitions replace these when it is linked in
// (make MPI=1): the library and the drop-in build need no MPI.
__attribute__((weak)) ql_status ql_dist_init(int *, char ***, char *err, size_t err_size) {
    if (err && err_size) err[0] = 0;
    return QL_OK;
}
__attribute__((weak)) void ql_dist_free(void) {}
__attribute__((weak)) int ql_dist_rank(void) { return 0; }
__attribute__((weak)) int ql_dist_size(void) { return 1; }
__attribute__((weak)) int ql_dist_local_rank(void) { return 0; }
__attribute__((weak)) const char *ql_dist_name(void) { return "one process"; }
__attribute__((weak)) ql_status ql_dist_allreduce_f32(float *, size_t) { return QL_OK; }
__attribute__((weak)) ql_status ql_dist_allreduce_f64(double *, size_t) { return QL_OK; }
__attribute__((weak)) ql_status ql_dist_allreduce_i64(int64_t *, size_t) { return QL_OK; }
__attribute__((weak)) ql_status ql_dist_allreduce_device_f32(ql_backend *, float *const *, const size_t *, int) {
    return QL_ERR_UNSUPPORTED;
}
__attribute__((weak)) ql_status ql_dist_broadcast(void *, size_t, int root) { return root == 0 ? QL_OK : QL_ERR_INVALID; }
__attribute__((weak)) ql_status ql_dist_barrier(void) { return QL_OK; }
__attribute__((weak)) void ql_dist_abort(int code, const char *msg) {
    fprintf(stderr, "%s\n", msg ? msg : "");
    fflush(stderr);
    exit(code);  // (a program's request to end: the one exit() in the library, as MPI_Abort is MPI's)
}

// ============================================================================================
// 15. file formats: GGUF
// ============================================================================================

//
// Layout (little-endian; the GGUF spec, ggml's docs/gguf.md):
//   "GGUF", u32 version, u64 n_tensors, u64 n_kv
//   n_kv      x { string key, u32 value type, value }
//   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }
//   zero padding to the alignment, then the data section: tensor i at data_offset + offset_i
// string = u64 length + bytes (no NUL); array = u32 element type, u64 count, elements.
//
// The reader trusts nothing: every length, count and offset is checked against the bytes that
// are really there, with overflow-checked arithmetic, before anything is sized or read. KV values
// are copied out at open time (strings get their NUL; numeric arrays land in 8-aligned storage),
// tensor data stays in the caller's buffer or the mapping.



#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF code reads little-endian fields with memcpy: big-endian hosts are not supported"
#endif

static const uint64_t k_gguf_max_key = 65536;   // bytes; real keys are short, this stops absurd ones
static const size_t   k_gguf_default_align = 32;
// smallest possible entries, used to bound the counts in the header by the bytes that follow:
// a KV is key length (8) + type (4) + a 1-byte value; a tensor info is name length (8) +
// n_dims (4) + one ne (8) + type (4) + offset (8)
static const uint64_t k_gguf_min_kv = 8 + 4 + 1;
static const uint64_t k_gguf_min_tensor = 8 + 4 + 8 + 4 + 8;

static size_t gguf_scalar_size(uint32_t t) {  // 0: string, array or unknown
    switch (t) {
    case QL_GGUF_U8: case QL_GGUF_I8: case QL_GGUF_BOOL: return 1;
    case QL_GGUF_U16: case QL_GGUF_I16: return 2;
    case QL_GGUF_U32: case QL_GGUF_I32: case QL_GGUF_F32: return 4;
    case QL_GGUF_U64: case QL_GGUF_I64: case QL_GGUF_F64: return 8;
    default: return 0;
    }
}

static const char *gguf_type_name(uint32_t t) {
    static const char *names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                  "bool", "string", "array", "u64", "i64", "f64"};
    static_assert(sizeof(names) / sizeof(names[0]) == QL_GGUF_TYPE_COUNT, "gguf type names");
    return t < QL_GGUF_TYPE_COUNT ? names[t] : "?";
}

// Keys and names in messages: capped, anything but printable ASCII shown as '?', so an error
// stays one line whatever bytes the file holds.
static std::string gguf_printable(const char *s, size_t n) {
    std::string r;
    for (size_t i = 0; i < n && i < 64; i++) r += (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (n > 64) r += "...";
    return r;
}
static std::string gguf_printable(const std::string &s) { return gguf_printable(s.data(), s.size()); }

static void gguf_set_err(char *err, size_t err_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void gguf_set_err(char *err, size_t err_size, const char *fmt, ...) {
    if (!err || !err_size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
}

// One key-value pair, as read or as to be written.
struct gguf_kv {
    std::string  key;
    ql_gguf_type type = QL_GGUF_TYPE_COUNT;
    ql_gguf_type elem = QL_GGUF_TYPE_COUNT;  // arrays: element type
    uint64_t     n    = 0;                   // arrays: element count
    uint8_t      val[8] = {0};               // numeric and bool scalars: the value's bytes
    std::string  str;                        // strings
    std::vector<uint64_t> num;               // numeric arrays: packed elements (u64 words: 8-aligned)
    std::string  blob;                       // string arrays: each element followed by a NUL
    std::vector<uint64_t> start;             // string arrays: n + 1 offsets into blob
};

// Integer values widened; false for non-integer types.
static bool gguf_kv_int(const gguf_kv &kv, bool *neg, int64_t *s, uint64_t *u) {
    *neg = false;
    *s = 0;
    *u = 0;
    switch (kv.type) {
    case QL_GGUF_U8:  { uint8_t v;  memcpy(&v, kv.val, 1); *u = v; return true; }
    case QL_GGUF_U16: { uint16_t v; memcpy(&v, kv.val, 2); *u = v; return true; }
    case QL_GGUF_U32: { uint32_t v; memcpy(&v, kv.val, 4); *u = v; return true; }
    case QL_GGUF_U64: { memcpy(u, kv.val, 8); return true; }
    case QL_GGUF_I8:  { int8_t v;  memcpy(&v, kv.val, 1); *s = v; break; }
    case QL_GGUF_I16: { int16_t v; memcpy(&v, kv.val, 2); *s = v; break; }
    case QL_GGUF_I32: { int32_t v; memcpy(&v, kv.val, 4); *s = v; break; }
    case QL_GGUF_I64: { memcpy(s, kv.val, 8); break; }
    default: return false;
    }
    *neg = *s < 0;
    if (!*neg) *u = (uint64_t)*s;
    return true;
}

// general.alignment: u32 per the spec; u64 and i32 are taken too when the value fits.
static bool gguf_alignment_of(const gguf_kv &kv, uint64_t *align, std::string *why) {
    bool neg;
    int64_t s;
    uint64_t u;
    if ((kv.type != QL_GGUF_U32 && kv.type != QL_GGUF_U64 && kv.type != QL_GGUF_I32) || !gguf_kv_int(kv, &neg, &s, &u)) {
        *why = std::string("general.alignment has type ") + gguf_type_name(kv.type) + ", expected u32";
        return false;
    }
    if (neg || u == 0 || (u & (u - 1)) != 0) {
        char b[128];
        if (neg) snprintf(b, sizeof(b), "general.alignment is %lld, not a non-zero power of two", (long long)s);
        else snprintf(b, sizeof(b), "general.alignment is %llu, not a non-zero power of two", (unsigned long long)u);
        *why = b;
        return false;
    }
    if (u > (1u << 20)) {  // (the padding is made in memory: 2^36 would zero-fill 64 GiB; real files use 32)
        char b[128];
        snprintf(b, sizeof(b), "general.alignment is %llu, above the 1 MiB this reader and writer take", (unsigned long long)u);
        *why = b;
        return false;
    }
    *align = u;
    return true;
}

// Checked x rounded up to a multiple of a (a power of two).
static bool gguf_align_up(uint64_t x, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (__builtin_add_overflow(x, a - 1, &t)) return false;
    *out = t & ~(a - 1);
    return true;
}

// Bytes of a tensor (rows + side data). ne[] must be >= 0, ne[0] a multiple of the block size.
// Fails when a product overflows or the rows alone exceed `limit`; the limit (file size, or the
// caller's buffer size) also keeps the element count small enough for the side-data formula.
// Elements and rows (ne[1] * ne[2] * ne[3]) of a shape with ne[] >= 0: the one place a shape's
// dimensions are multiplied, in a fixed order, each product checked. A 0 dimension makes the
// count 0, but the product of the others must still be an int64 (false if not): then every
// partial product, in whatever order other code forms it, is a number too ([2^40, 2^40, 0] is
// refused, as [0, 2^40, 2^40] is).
static bool gguf_shape_count(const int64_t ne[4], int64_t *nel, int64_t *rows) {
    int64_t p = 1;
    bool empty = false;
    for (int d = 0; d < 4; d++) {
        if (ne[d] == 0) empty = true;
        else if (__builtin_mul_overflow(p, ne[d], &p)) return false;
    }
    *nel = empty ? 0 : p;
    *rows = ne[1] * ne[2] * ne[3];  // (each partial product is 0 or a part of p)
    return true;
}

static bool gguf_tensor_bytes(ql_type type, const int64_t ne[4], uint64_t limit, uint64_t *out, std::string *why) {
    const ql_type_traits *tt = ql_type_traits_get(type);
    QL_ASSERT(tt && ne[0] % tt->blck_size == 0);
    int64_t rows = 1, nel = 0;
    if (!gguf_shape_count(ne, &nel, &rows)) {
        char b[192];
        snprintf(b, sizeof(b), "element count of [%lld, %lld, %lld, %lld] overflows int64", (long long)ne[0],
                 (long long)ne[1], (long long)ne[2], (long long)ne[3]);
        *why = b;
        return false;
    }
    uint64_t row_bytes, bytes;
    bool ovf = __builtin_mul_overflow((uint64_t)(ne[0] / tt->blck_size), (uint64_t)tt->type_size, &row_bytes) ||
          __builtin_mul_overflow(row_bytes, (uint64_t)rows, &bytes);
    if (ovf || bytes > limit) {
        char b[192];
        snprintf(b, sizeof(b), "%lld elements of %s need more than %llu bytes", (long long)nel, tt->name,
                 (unsigned long long)limit);
        *why = b;
        return false;
    }
    if (tt->aux_bytes && __builtin_add_overflow(bytes, (uint64_t)tt->aux_bytes(nel), &bytes)) {
        *why = "side data size overflows";
        return false;
    }
    QL_ASSERT(bytes == ql_type_data_size(type, rows, ne[0]));
    *out = bytes;
    return true;
}

struct gguf_tensor {
    std::string    name;
    ql_type        type   = QL_TYPE_F32;
    int            n_dims = 0;
    int64_t        ne[4]  = {1, 1, 1, 1};
    uint64_t       offset = 0;  // in the data section
    uint64_t       size   = 0;  // rows + side data
    const uint8_t *data   = nullptr;
};

struct ql_gguf {
    void    *map      = nullptr;  // ours to munmap (ql_gguf_open); NULL for caller memory
    size_t   map_size = 0;
    uint32_t version  = 0;
    size_t   alignment   = k_gguf_default_align;
    size_t   data_offset = 0;
    std::vector<gguf_kv> kvs;
    std::unordered_map<std::string, int64_t> kv_index;
    std::vector<gguf_tensor> tensors;
    std::unordered_map<std::string, int64_t> tensor_index;
};

// ============================================================================================
// reader
// ============================================================================================

// A cursor over the bytes; every read is bounds-checked and the first failure is kept.
struct gguf_parser {
    const uint8_t *buf;
    size_t         size;
    size_t         pos = 0;
    std::string    msg;

    gguf_parser(const uint8_t *b, size_t n) : buf(b), size(n) {}
    size_t left() const { return size - pos; }

    bool fail(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
        if (msg.empty()) {
            char b[512];
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(b, sizeof(b), fmt, ap);
            va_end(ap);
            msg = b;
        }
        return false;
    }
    bool take(void *dst, size_t n, const char *what) {
        if (n > left())
            return fail("%s at offset %zu: needs %zu bytes, the file ends %zu bytes later (truncated?)", what, pos, n,
                        left());
        memcpy(dst, buf + pos, n);
        pos += n;
        return true;
    }
    bool u32(uint32_t *v, const char *what) { return take(v, 4, what); }
    bool u64(uint64_t *v, const char *what) { return take(v, 8, what); }
    // a string's length: at most `cap` and within the bytes left
    bool str_len(uint64_t *len, uint64_t cap, const char *what) {
        if (!u64(len, what)) return false;
        if (*len > cap)
            return fail("%s: length %llu is over the limit of %llu", what, (unsigned long long)*len,
                        (unsigned long long)cap);
        if (*len > left())
            return fail("%s at offset %zu: length %llu runs past the end of the file (%zu bytes left)", what, pos - 8,
                        (unsigned long long)*len, left());
        return true;
    }
};

static bool gguf_read_value(gguf_parser &P, gguf_kv &kv, const char *ctx) {
    char what[256];
    if (kv.type == QL_GGUF_STRING) {
        uint64_t len = 0;
        snprintf(what, sizeof(what), "%s: string value", ctx);
        if (!P.str_len(&len, UINT64_MAX, what)) return false;
        kv.str.assign((const char *)P.buf + P.pos, (size_t)len);
        P.pos += (size_t)len;
        return true;
    }
    if (kv.type != QL_GGUF_ARRAY) {
        const size_t sz = gguf_scalar_size(kv.type);
        QL_ASSERT(sz > 0);
        snprintf(what, sizeof(what), "%s: %s value", ctx, gguf_type_name(kv.type));
        if (!P.take(kv.val, sz, what)) return false;
        if (kv.type == QL_GGUF_BOOL && kv.val[0] > 1) return P.fail("%s: bool value is %u, not 0 or 1", ctx, kv.val[0]);
        return true;
    }
    uint32_t elem = 0;
    snprintf(what, sizeof(what), "%s: array element type", ctx);
    if (!P.u32(&elem, what)) return false;
    if (elem == QL_GGUF_ARRAY) return P.fail("%s: arrays of arrays (nested arrays) are not supported", ctx);
    if (elem >= QL_GGUF_TYPE_COUNT) return P.fail("%s: unknown array element type %u", ctx, elem);
    kv.elem = (ql_gguf_type)elem;
    snprintf(what, sizeof(what), "%s: array count", ctx);
    if (!P.u64(&kv.n, what)) return false;
    if (elem == QL_GGUF_STRING) {
        if (kv.n > P.left() / 8)  // each element has at least its 8-byte length
            return P.fail("%s: %llu strings cannot fit in the %zu bytes left", ctx, (unsigned long long)kv.n, P.left());
        kv.start.reserve((size_t)kv.n + 1);
        kv.start.push_back(0);
        for (uint64_t j = 0; j < kv.n; j++) {
            uint64_t len = 0;
            if (P.left() >= 8) memcpy(&len, P.buf + P.pos, 8);
            if (P.left() < 8 || len > P.left() - 8) {  // format the context only when it is needed
                snprintf(what, sizeof(what), "%s: string %llu", ctx, (unsigned long long)j);
                return P.str_len(&len, UINT64_MAX, what);  // fails, with the message
            }
            P.pos += 8;
            kv.blob.append((const char *)P.buf + P.pos, (size_t)len);
            kv.blob.push_back('\0');
            kv.start.push_back(kv.blob.size());
            P.pos += (size_t)len;
        }
        return true;
    }
    const size_t esz = gguf_scalar_size(elem);
    if (kv.n > P.left() / esz)
        return P.fail("%s: %llu elements of %s (%zu bytes each) run past the end of the file (%zu bytes left)", ctx,
                      (unsigned long long)kv.n, gguf_type_name(elem), esz, P.left());
    const size_t bytes = (size_t)kv.n * esz;
    kv.num.resize((bytes + 7) / 8);
    if (bytes) memcpy(kv.num.data(), P.buf + P.pos, bytes);
    if (elem == QL_GGUF_BOOL)
        for (size_t j = 0; j < bytes; j++)
            if (P.buf[P.pos + j] > 1)
                return P.fail("%s: bool element %zu is %u, not 0 or 1", ctx, j, P.buf[P.pos + j]);
    P.pos += bytes;
    return true;
}

static bool gguf_parse(ql_gguf &g, gguf_parser &P) {
    // ---- header
    if (P.size < 4) return P.fail("too short for a GGUF file (%zu bytes)", P.size);
    if (memcmp(P.buf, "GGUF", 4) != 0)
        return P.fail("bad magic '%s' (expected 'GGUF'): not a GGUF file", gguf_printable((const char *)P.buf, 4).c_str());
    P.pos = 4;
    if (!P.u32(&g.version, "version")) return false;
    if (g.version == 1) return P.fail("GGUF version 1 is not supported (it has 32-bit counts): convert the file again");
    if ((g.version & 0xffffu) == 0 && (g.version >> 24) >= 1 && (g.version >> 24) <= 3)
        return P.fail("big-endian GGUF (version field %08x) is not supported", g.version);
    if (g.version != 2 && g.version != 3) return P.fail("unsupported GGUF version %u (2 and 3 are read)", g.version);
    uint64_t n_tensors = 0, n_kv = 0;
    if (!P.u64(&n_tensors, "n_tensors") || !P.u64(&n_kv, "n_kv")) return false;
    // counts bounded by the bytes that follow: nothing below is sized from an unchecked count
    if (n_kv > P.left() / k_gguf_min_kv)
        return P.fail("n_kv %llu cannot fit in the %zu bytes after the header", (unsigned long long)n_kv, P.left());
    if (n_tensors > P.left() / k_gguf_min_tensor)
        return P.fail("n_tensors %llu cannot fit in the %zu bytes after the header", (unsigned long long)n_tensors,
                      P.left());
    if (n_kv * k_gguf_min_kv + n_tensors * k_gguf_min_tensor > P.left())  // each term <= left: no overflow
        return P.fail("n_kv %llu and n_tensors %llu cannot fit in the %zu bytes after the header",
                      (unsigned long long)n_kv, (unsigned long long)n_tensors, P.left());

    // ---- key-value pairs
    char ctx[192], what[256];
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv kv;
        uint64_t len = 0;
        snprintf(ctx, sizeof(ctx), "kv %llu", (unsigned long long)i);
        snprintf(what, sizeof(what), "%s: key", ctx);
        if (!P.str_len(&len, k_gguf_max_key, what)) return false;
        const char *k = (const char *)P.buf + P.pos;
        if (memchr(k, 0, (size_t)len)) return P.fail("%s: key '%s' contains a NUL byte", ctx, gguf_printable(k, len).c_str());
        kv.key.assign(k, (size_t)len);
        P.pos += (size_t)len;
        snprintf(ctx, sizeof(ctx), "kv %llu '%s'", (unsigned long long)i, gguf_printable(kv.key).c_str());
        auto ins = g.kv_index.emplace(kv.key, (int64_t)i);
        if (!ins.second) return P.fail("%s: duplicate key (first at kv %lld)", ctx, (long long)ins.first->second);
        uint32_t type = 0;
        snprintf(what, sizeof(what), "%s: value type", ctx);
        if (!P.u32(&type, what)) return false;
        if (type >= QL_GGUF_TYPE_COUNT) return P.fail("%s: unknown value type %u", ctx, type);
        kv.type = (ql_gguf_type)type;
        if (!gguf_read_value(P, kv, ctx)) return false;
        g.kvs.push_back(std::move(kv));
    }

    uint64_t align = k_gguf_default_align;
    auto al = g.kv_index.find("general.alignment");
    if (al != g.kv_index.end()) {
        std::string why;
        if (!gguf_alignment_of(g.kvs[(size_t)al->second], &align, &why)) return P.fail("%s", why.c_str());
    }
    g.alignment = (size_t)align;

    // ---- tensor infos
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tensor t;
        uint64_t len = 0;
        snprintf(ctx, sizeof(ctx), "tensor %llu", (unsigned long long)i);
        snprintf(what, sizeof(what), "%s: name", ctx);
        if (!P.u64(&len, what)) return false;
        if (len >= QL_MAX_NAME)  // ggml's GGML_MAX_NAME, counting the NUL
            return P.fail("%s: name length %llu, must be below %d bytes", ctx, (unsigned long long)len, QL_MAX_NAME);
        if (len > P.left())
            return P.fail("%s: name of %llu bytes runs past the end of the file (%zu bytes left)", ctx,
                          (unsigned long long)len, P.left());
        const char *nm = (const char *)P.buf + P.pos;
        if (memchr(nm, 0, (size_t)len)) return P.fail("%s: name '%s' contains a NUL byte", ctx, gguf_printable(nm, len).c_str());
        t.name.assign(nm, (size_t)len);
        P.pos += (size_t)len;
        snprintf(ctx, sizeof(ctx), "tensor %llu '%s'", (unsigned long long)i, gguf_printable(t.name).c_str());
        auto ins = g.tensor_index.emplace(t.name, (int64_t)i);
        if (!ins.second) return P.fail("%s: duplicate tensor name (first at tensor %lld)", ctx, (long long)ins.first->second);
        uint32_t n_dims = 0, type = 0;
        snprintf(what, sizeof(what), "%s: n_dims", ctx);
        if (!P.u32(&n_dims, what)) return false;
        if (n_dims < 1 || n_dims > QL_MAX_DIMS) return P.fail("%s: n_dims %u, must be 1..%d", ctx, n_dims, QL_MAX_DIMS);
        t.n_dims = (int)n_dims;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t v = 0;
            snprintf(what, sizeof(what), "%s: ne[%u]", ctx, d);
            if (!P.u64(&v, what)) return false;
            if (v > (uint64_t)INT64_MAX) return P.fail("%s: ne[%u] = %llu is over INT64_MAX", ctx, d, (unsigned long long)v);
            t.ne[d] = (int64_t)v;
        }
        snprintf(what, sizeof(what), "%s: type", ctx);
        if (!P.u32(&type, what)) return false;
        const ql_type_traits *tt = type < QL_TYPE_COUNT ? ql_type_traits_get((ql_type)type) : nullptr;
        if (!tt) {  // a ggml type this build does not read: named, with the way out
            const char *known = ggml_type_name(type);
            if (known)
                return P.fail("%s: type %s (ggml id %u) is not supported --> hint: requantize the model to a type qlora "
                              "reads (f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_K..q6_K iq4_nl iq4_xs), e.g. llama-quantize "
                              "... Q4_K_M", ctx, known, type);
            return P.fail("%s: unknown tensor type id %u", ctx, type);
        }
        t.type = (ql_type)type;
        if (t.ne[0] % tt->blck_size != 0)
            return P.fail("%s: ne[0] = %lld is not a multiple of %s's block size %lld", ctx, (long long)t.ne[0],
                          tt->name, (long long)tt->blck_size);
        std::string why;
        if (!gguf_tensor_bytes(t.type, t.ne, P.size, &t.size, &why))
            return P.fail("%s: %s (the file has %zu bytes)", ctx, why.c_str(), P.size);
        snprintf(what, sizeof(what), "%s: offset", ctx);
        if (!P.u64(&t.offset, what)) return false;
        g.tensors.push_back(std::move(t));
    }

    // ---- data section: starts at the aligned end of the infos; a file without tensors may
    // end before it (writers add no padding then)
    uint64_t data_offset;
    if (!gguf_align_up(P.pos, align, &data_offset)) return P.fail("data offset overflows (alignment %llu)", (unsigned long long)align);
    g.data_offset = (size_t)data_offset;
    if (n_tensors == 0) return true;
    if (data_offset > P.size)
        return P.fail("the data section would start at %llu, past the end of the file (%zu bytes)",
                      (unsigned long long)data_offset, P.size);
    const uint64_t avail = P.size - data_offset;
    for (size_t i = 0; i < g.tensors.size(); i++) {
        gguf_tensor &t = g.tensors[i];
        snprintf(ctx, sizeof(ctx), "tensor %zu '%s'", i, gguf_printable(t.name).c_str());
        if (t.offset % align != 0)
            return P.fail("%s: offset %llu is not a multiple of the alignment %llu", ctx, (unsigned long long)t.offset,
                          (unsigned long long)align);
        if (t.offset > avail || t.size > avail - t.offset)
            return P.fail("%s: data [%llu, +%llu) runs past the end of the file (the data section holds %llu bytes)",
                          ctx, (unsigned long long)t.offset, (unsigned long long)t.size, (unsigned long long)avail);
        t.data = P.buf + data_offset + t.offset;
        const ql_type_traits *tt = ql_type_traits_get(t.type);
        int64_t n_el = 0, n_rows = 0;
        QL_ASSERT(gguf_shape_count(t.ne, &n_el, &n_rows));  // (gguf_tensor_bytes refused what overflows)
        // tensors are read in place: a float's bytes must sit at a float's alignment (a file with
        // general.alignment 1 or 2 can put them anywhere); NF4's side data needs 4
        const size_t natural = tt->aux_check ? 4 : tt->blck_size == 1 ? std::min<size_t>(tt->type_size, 8) : 1;
        if (t.size > 0 && (uintptr_t)t.data % natural != 0)
            return P.fail("%s: its %s data starts at an address not a multiple of %zu (general.alignment %llu): qlora reads "
                          "tensors in place --> hint: rewrite the file with the default alignment (32)", ctx, tt->name, natural,
                          (unsigned long long)align);
        if (t.size > 0 && !type_aux_valid(t.type, t.data, n_rows, t.ne[0]))
            return P.fail("%s: its %s side data does not describe a tensor of %lld elements (corrupt?)", ctx, tt->name,
                          (long long)n_el);
    }
    // no two tensors share bytes (empty ones occupy nothing)
    std::vector<size_t> order;
    for (size_t i = 0; i < g.tensors.size(); i++)
        if (g.tensors[i].size) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return g.tensors[a].offset < g.tensors[b].offset; });
    for (size_t k = 1; k < order.size(); k++) {
        const gguf_tensor &a = g.tensors[order[k - 1]], &b = g.tensors[order[k]];
        if (a.offset + a.size > b.offset)  // both within the file: no overflow
            return P.fail("tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", gguf_printable(a.name).c_str(),
                          (unsigned long long)a.offset, (unsigned long long)(a.offset + a.size),
                          gguf_printable(b.name).c_str(), (unsigned long long)b.offset,
                          (unsigned long long)(b.offset + b.size));
    }
    return true;
}

static ql_gguf *gguf_open_buffer(const uint8_t *buf, size_t size, const char *path, char *err, size_t err_size) {
    try {
        std::unique_ptr<ql_gguf> g(new ql_gguf);
        gguf_parser P(buf, size);
        if (!gguf_parse(*g, P)) {
            gguf_set_err(err, err_size, "%s: %s", path, P.msg.c_str());
            return nullptr;
        }
        return g.release();
    } catch (const std::exception &e) {  // bad_alloc: the file is fine, memory is not
        gguf_set_err(err, err_size, "%s: out of memory while reading (%s)", path, e.what());
        return nullptr;
    }
}

ql_gguf *ql_gguf_open_memory(const void *data, size_t size, char *err, size_t err_size) {
    gguf_set_err(err, err_size, "%s", "");
    if (!data && size) {
        gguf_set_err(err, err_size, "<memory>: NULL buffer of %zu bytes", size);
        return nullptr;
    }
    static const uint8_t empty[1] = {0};
    return gguf_open_buffer(data ? (const uint8_t *)data : empty, size, "<memory>", err, err_size);
}

ql_gguf *ql_gguf_open(const char *path, char *err, size_t err_size) {
    gguf_set_err(err, err_size, "%s", "");
    if (!path) {
        gguf_set_err(err, err_size, "(null): no path given");
        return nullptr;
    }
    // O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        gguf_set_err(err, err_size, "%s: cannot open: %s", path, strerror(errno));
        return nullptr;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        gguf_set_err(err, err_size, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return nullptr;
    }
    if (!S_ISREG(st.st_mode)) {
        gguf_set_err(err, err_size, "%s: not a regular file", path);
        close(fd);
        return nullptr;
    }
    const size_t size = (size_t)st.st_size;
    void *map = nullptr;
    if (size) {  // mmap refuses length 0; an empty file gets the parser's "too short"
        map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            gguf_set_err(err, err_size, "%s: cannot map %zu bytes: %s", path, size, strerror(errno));
            close(fd);
            return nullptr;
        }
    }
    close(fd);  // the mapping keeps the file
    static const uint8_t empty[1] = {0};
    ql_gguf *g = gguf_open_buffer(map ? (const uint8_t *)map : empty, size, path, err, err_size);
    if (!g) {
        if (map) munmap(map, size);
        return nullptr;
    }
    g->map = map;
    g->map_size = size;
    return g;
}

void ql_gguf_close(ql_gguf *g) {
    if (!g) return;
    if (g->map) munmap(g->map, g->map_size);
    delete g;
}

uint32_t ql_gguf_version(const ql_gguf *g) { return g ? g->version : 0; }
size_t   ql_gguf_alignment(const ql_gguf *g) { return g ? g->alignment : 0; }
size_t   ql_gguf_data_offset(const ql_gguf *g) { return g ? g->data_offset : 0; }
bool     ql_gguf_is_mapped(const ql_gguf *g) { return g && g->map; }

static const gguf_kv *gguf_kv_at(const ql_gguf *g, int64_t i) {
    return (g && i >= 0 && (uint64_t)i < g->kvs.size()) ? &g->kvs[(size_t)i] : nullptr;
}
static const gguf_tensor *gguf_tensor_at(const ql_gguf *g, int64_t i) {
    return (g && i >= 0 && (uint64_t)i < g->tensors.size()) ? &g->tensors[(size_t)i] : nullptr;
}

int64_t ql_gguf_n_kv(const ql_gguf *g) { return g ? (int64_t)g->kvs.size() : 0; }

int64_t ql_gguf_find_kv(const ql_gguf *g, const char *key) {
    if (!g || !key) return -1;
    auto it = g->kv_index.find(key);
    return it == g->kv_index.end() ? -1 : it->second;
}

const char *ql_gguf_kv_key(const ql_gguf *g, int64_t i) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    return kv ? kv->key.c_str() : nullptr;
}

ql_gguf_type ql_gguf_kv_type(const ql_gguf *g, int64_t i) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    return kv ? kv->type : QL_GGUF_TYPE_COUNT;
}

bool ql_gguf_get_i64(const ql_gguf *g, int64_t i, int64_t *v) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    bool neg;
    int64_t s;
    uint64_t u;
    if (!kv || !v || !gguf_kv_int(*kv, &neg, &s, &u)) return false;
    if (!neg && u > (uint64_t)INT64_MAX) return false;
    *v = neg ? s : (int64_t)u;
    return true;
}

bool ql_gguf_get_u64(const ql_gguf *g, int64_t i, uint64_t *v) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    bool neg;
    int64_t s;
    uint64_t u;
    if (!kv || !v || !gguf_kv_int(*kv, &neg, &s, &u) || neg) return false;
    *v = u;
    return true;
}

bool ql_gguf_get_f64(const ql_gguf *g, int64_t i, double *v) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    if (!kv || !v) return false;
    if (kv->type == QL_GGUF_F32) {
        float f;
        memcpy(&f, kv->val, 4);
        *v = f;
        return true;
    }
    if (kv->type == QL_GGUF_F64) {
        memcpy(v, kv->val, 8);
        return true;
    }
    bool neg;
    int64_t s;
    uint64_t u;
    if (!gguf_kv_int(*kv, &neg, &s, &u)) return false;
    *v = neg ? (double)s : (double)u;
    return true;
}

bool ql_gguf_get_bool(const ql_gguf *g, int64_t i, bool *v) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    if (!kv || !v || kv->type != QL_GGUF_BOOL) return false;
    *v = kv->val[0] != 0;
    return true;
}

const char *ql_gguf_get_str(const ql_gguf *g, int64_t i, size_t *len) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    if (!kv || kv->type != QL_GGUF_STRING) return nullptr;
    if (len) *len = kv->str.size();
    return kv->str.c_str();
}

ql_gguf_type ql_gguf_arr_type(const ql_gguf *g, int64_t i) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    return (kv && kv->type == QL_GGUF_ARRAY) ? kv->elem : QL_GGUF_TYPE_COUNT;
}

uint64_t ql_gguf_arr_n(const ql_gguf *g, int64_t i) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    return (kv && kv->type == QL_GGUF_ARRAY) ? kv->n : 0;
}

const void *ql_gguf_arr_data(const ql_gguf *g, int64_t i) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    if (!kv || kv->type != QL_GGUF_ARRAY || kv->elem == QL_GGUF_STRING) return nullptr;
    static const uint64_t none = 0;  // an empty array is still an array: not NULL
    return kv->num.empty() ? (const void *)&none : (const void *)kv->num.data();
}

const char *ql_gguf_arr_str(const ql_gguf *g, int64_t i, uint64_t j, size_t *len) {
    const gguf_kv *kv = gguf_kv_at(g, i);
    if (!kv || kv->type != QL_GGUF_ARRAY || kv->elem != QL_GGUF_STRING || j >= kv->n) return nullptr;
    if (len) *len = (size_t)(kv->start[(size_t)j + 1] - kv->start[(size_t)j] - 1);
    return kv->blob.c_str() + kv->start[(size_t)j];
}

int64_t ql_gguf_n_tensors(const ql_gguf *g) { return g ? (int64_t)g->tensors.size() : 0; }

int64_t ql_gguf_find_tensor(const ql_gguf *g, const char *name) {
    if (!g || !name) return -1;
    auto it = g->tensor_index.find(name);
    return it == g->tensor_index.end() ? -1 : it->second;
}

const char *ql_gguf_tensor_name(const ql_gguf *g, int64_t i) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    return t ? t->name.c_str() : nullptr;
}

ql_type ql_gguf_tensor_type(const ql_gguf *g, int64_t i) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    return t ? t->type : QL_TYPE_COUNT;
}

int ql_gguf_tensor_ne(const ql_gguf *g, int64_t i, int64_t ne[4]) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    if (ne)
        for (int d = 0; d < 4; d++) ne[d] = t ? t->ne[d] : 1;
    return t ? t->n_dims : 0;
}

const void *ql_gguf_tensor_data(const ql_gguf *g, int64_t i) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    return t ? t->data : nullptr;
}

size_t ql_gguf_tensor_size(const ql_gguf *g, int64_t i) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    return t ? (size_t)t->size : 0;
}

// ============================================================================================
// writer
// ============================================================================================

struct gguf_wtensor {
    std::string name;
    ql_type     type;
    int         n_dims;
    int64_t     ne[4];
    const void *data;
    size_t      size;
    ql_gguf_fill_fn fill = nullptr;  // data made at write time (ql_gguf_add_tensor_gen)
    void       *fill_arg = nullptr;
};

struct ql_gguf_writer {
    std::vector<gguf_kv>      kvs;  // insertion order; few enough for linear lookups
    std::vector<gguf_wtensor> tensors;
    std::unordered_set<std::string> tensor_names;
    // The set_* functions return nothing, so the first one refused (NULL key, bad array) is
    // remembered and makes ql_gguf_write fail with its message instead of writing a file
    // without the value.
    std::string refused;
};

static void gguf_refuse(ql_gguf_writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void gguf_refuse(ql_gguf_writer *w, const char *fmt, ...) {
    if (!w || !w->refused.empty()) return;
    char b[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof(b), fmt, ap);
    va_end(ap);
    w->refused = b;
}

static gguf_kv *gguf_writer_find(ql_gguf_writer *w, const char *key) {
    for (gguf_kv &kv : w->kvs)
        if (kv.key == key) return &kv;
    return nullptr;
}

// Stores kv under key: replaces an existing key's value in place, else appends.
static void gguf_put(ql_gguf_writer *w, const char *key, gguf_kv &&kv, const char *fn) {
    if (!w) return;
    if (!key) return gguf_refuse(w, "%s: NULL key", fn);
    if (strlen(key) > k_gguf_max_key)
        return gguf_refuse(w, "%s: key '%s' is longer than %llu bytes", fn, gguf_printable(key, strlen(key)).c_str(),
                           (unsigned long long)k_gguf_max_key);
    try {
        kv.key = key;
        gguf_kv *old = gguf_writer_find(w, key);
        if (old) *old = std::move(kv);
        else w->kvs.push_back(std::move(kv));
    } catch (const std::exception &) {
        gguf_refuse(w, "%s: out of memory storing '%s'", fn, gguf_printable(key, strlen(key)).c_str());
    }
}

static void gguf_put_scalar(ql_gguf_writer *w, const char *key, ql_gguf_type type, const void *v, const char *fn) {
    gguf_kv kv;
    kv.type = type;
    memcpy(kv.val, v, gguf_scalar_size(type));
    gguf_put(w, key, std::move(kv), fn);
}

ql_gguf_writer *ql_gguf_writer_new(void) {
    try {
        return new ql_gguf_writer;
    } catch (const std::exception &) {
        return nullptr;
    }
}
void ql_gguf_writer_free(ql_gguf_writer *w) { delete w; }

void ql_gguf_set_u32(ql_gguf_writer *w, const char *key, uint32_t v) { gguf_put_scalar(w, key, QL_GGUF_U32, &v, "set_u32"); }
void ql_gguf_set_i32(ql_gguf_writer *w, const char *key, int32_t v) { gguf_put_scalar(w, key, QL_GGUF_I32, &v, "set_i32"); }
void ql_gguf_set_u64(ql_gguf_writer *w, const char *key, uint64_t v) { gguf_put_scalar(w, key, QL_GGUF_U64, &v, "set_u64"); }
void ql_gguf_set_f32(ql_gguf_writer *w, const char *key, float v) { gguf_put_scalar(w, key, QL_GGUF_F32, &v, "set_f32"); }
void ql_gguf_set_bool(ql_gguf_writer *w, const char *key, bool v) {
    const uint8_t b = v ? 1 : 0;
    gguf_put_scalar(w, key, QL_GGUF_BOOL, &b, "set_bool");
}

void ql_gguf_set_str(ql_gguf_writer *w, const char *key, const char *v) {
    if (!w) return;
    if (!v) return gguf_refuse(w, "set_str '%s': NULL value", key ? gguf_printable(key, strlen(key)).c_str() : "(null)");
    try {
        gguf_kv kv;
        kv.type = QL_GGUF_STRING;
        kv.str = v;
        gguf_put(w, key, std::move(kv), "set_str");
    } catch (const std::exception &) {
        gguf_refuse(w, "set_str: out of memory");
    }
}

void ql_gguf_set_arr(ql_gguf_writer *w, const char *key, ql_gguf_type elem, const void *data, uint64_t n) {
    if (!w) return;
    const std::string k = key ? gguf_printable(key, strlen(key)) : "(null)";
    const size_t esz = gguf_scalar_size(elem);
    if (!esz) return gguf_refuse(w, "set_arr '%s': element type %d is not numeric or bool", k.c_str(), (int)elem);
    if (!data && n) return gguf_refuse(w, "set_arr '%s': NULL data for %llu elements", k.c_str(), (unsigned long long)n);
    uint64_t bytes;
    if (__builtin_mul_overflow(n, (uint64_t)esz, &bytes) || bytes > SIZE_MAX - 8)
        return gguf_refuse(w, "set_arr '%s': %llu elements overflow", k.c_str(), (unsigned long long)n);
    if (elem == QL_GGUF_BOOL)
        for (uint64_t j = 0; j < n; j++)
            if (((const uint8_t *)data)[j] > 1)
                return gguf_refuse(w, "set_arr '%s': bool element %llu is not 0 or 1", k.c_str(), (unsigned long long)j);
    try {
        gguf_kv kv;
        kv.type = QL_GGUF_ARRAY;
        kv.elem = elem;
        kv.n = n;
        kv.num.resize(((size_t)bytes + 7) / 8);
        if (bytes) memcpy(kv.num.data(), data, (size_t)bytes);
        gguf_put(w, key, std::move(kv), "set_arr");
    } catch (const std::exception &) {
        gguf_refuse(w, "set_arr '%s': out of memory for %llu elements", k.c_str(), (unsigned long long)n);
    }
}

void ql_gguf_set_arr_str(ql_gguf_writer *w, const char *key, const char *const *v, uint64_t n) {
    if (!w) return;
    const std::string k = key ? gguf_printable(key, strlen(key)) : "(null)";
    if (!v && n) return gguf_refuse(w, "set_arr_str '%s': NULL array of %llu strings", k.c_str(), (unsigned long long)n);
    try {
        gguf_kv kv;
        kv.type = QL_GGUF_ARRAY;
        kv.elem = QL_GGUF_STRING;
        kv.n = n;
        kv.start.reserve((size_t)n + 1);
        kv.start.push_back(0);
        for (uint64_t j = 0; j < n; j++) {
            if (!v[j]) return gguf_refuse(w, "set_arr_str '%s': string %llu is NULL", k.c_str(), (unsigned long long)j);
            kv.blob.append(v[j]);
            kv.blob.push_back('\0');
            kv.start.push_back(kv.blob.size());
        }
        gguf_put(w, key, std::move(kv), "set_arr_str");
    } catch (const std::exception &) {
        gguf_refuse(w, "set_arr_str '%s': out of memory for %llu strings", k.c_str(), (unsigned long long)n);
    }
}

void ql_gguf_copy_kv(ql_gguf_writer *w, const ql_gguf *src, int64_t i) {
    if (!w) return;
    const gguf_kv *kv = gguf_kv_at(src, i);
    if (!kv) return gguf_refuse(w, "copy_kv: no kv %lld in %s", (long long)i, src ? "the source" : "a NULL source");
    try {
        gguf_kv copy = *kv;
        gguf_put(w, kv->key.c_str(), std::move(copy), "copy_kv");
    } catch (const std::exception &) {
        gguf_refuse(w, "copy_kv '%s': out of memory", gguf_printable(kv->key).c_str());
    }
}

void ql_gguf_remove_kv(ql_gguf_writer *w, const char *key) {
    if (!w || !key) return;
    for (size_t i = 0; i < w->kvs.size(); i++)
        if (w->kvs[i].key == key) {
            w->kvs.erase(w->kvs.begin() + (ptrdiff_t)i);
            return;
        }
}

static ql_status gguf_add_tensor(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne,
                                 const void *data, size_t size, ql_gguf_fill_fn fill, void *fill_arg) {
    if (!w || !name || !ne || n_dims < 1 || n_dims > QL_MAX_DIMS) return QL_ERR_INVALID;
    if (strlen(name) >= QL_MAX_NAME) return QL_ERR_INVALID;
    const ql_type_traits *tt = ((int)type >= 0 && type < QL_TYPE_COUNT) ? ql_type_traits_get(type) : nullptr;
    if (!tt) return QL_ERR_INVALID;
    gguf_wtensor t;
    t.type = type;
    t.n_dims = n_dims;
    for (int d = 0; d < 4; d++) {
        t.ne[d] = d < n_dims ? ne[d] : 1;
        if (t.ne[d] < 0) return QL_ERR_INVALID;
    }
    if (t.ne[0] % tt->blck_size != 0) return QL_ERR_INVALID;
    uint64_t bytes;
    std::string why;
    if (!gguf_tensor_bytes(type, t.ne, size, &bytes, &why) || bytes != size) return QL_ERR_INVALID;
    if (!data && size && !fill) return QL_ERR_INVALID;
    t.data = data;
    t.size = size;
    t.fill = fill;
    t.fill_arg = fill_arg;
    try {
        t.name = name;
        if (!w->tensor_names.insert(t.name).second) return QL_ERR_INVALID;
        w->tensors.push_back(std::move(t));
    } catch (const std::exception &) {
        w->tensor_names.erase(name);
        return QL_ERR_NOMEM;
    }
    return QL_OK;
}

ql_status ql_gguf_add_tensor(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne,
                             const void *data, size_t size) {
    return gguf_add_tensor(w, name, type, n_dims, ne, data, size, nullptr, nullptr);
}
ql_status ql_gguf_add_tensor_gen(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne, size_t size,
                                 ql_gguf_fill_fn fill, void *arg) {
    return fill ? gguf_add_tensor(w, name, type, n_dims, ne, nullptr, size, fill, arg) : QL_ERR_INVALID;
}

static void gguf_put_bytes(std::vector<uint8_t> &out, const void *p, size_t n) {
    out.insert(out.end(), (const uint8_t *)p, (const uint8_t *)p + n);
}
static void gguf_put_u32(std::vector<uint8_t> &out, uint32_t v) { gguf_put_bytes(out, &v, 4); }
static void gguf_put_u64(std::vector<uint8_t> &out, uint64_t v) { gguf_put_bytes(out, &v, 8); }
static void gguf_put_str(std::vector<uint8_t> &out, const char *s, size_t n) {
    gguf_put_u64(out, n);
    gguf_put_bytes(out, s, n);
}

static void gguf_put_kv(std::vector<uint8_t> &out, const gguf_kv &kv) {
    gguf_put_str(out, kv.key.data(), kv.key.size());
    gguf_put_u32(out, (uint32_t)kv.type);
    if (kv.type == QL_GGUF_STRING) return gguf_put_str(out, kv.str.data(), kv.str.size());
    if (kv.type != QL_GGUF_ARRAY) return gguf_put_bytes(out, kv.val, gguf_scalar_size(kv.type));
    gguf_put_u32(out, (uint32_t)kv.elem);
    gguf_put_u64(out, kv.n);
    if (kv.elem != QL_GGUF_STRING) return gguf_put_bytes(out, kv.num.data(), (size_t)kv.n * gguf_scalar_size(kv.elem));
    for (uint64_t j = 0; j < kv.n; j++)
        gguf_put_str(out, kv.blob.data() + kv.start[(size_t)j], (size_t)(kv.start[(size_t)j + 1] - kv.start[(size_t)j] - 1));
}

// Everything before the data section (padding included when there is data), and the offsets.
static bool gguf_build_header(const ql_gguf_writer *w, uint64_t align, std::vector<uint8_t> &out, std::string *why) {
    gguf_put_bytes(out, "GGUF", 4);
    gguf_put_u32(out, 3);
    gguf_put_u64(out, w->tensors.size());
    gguf_put_u64(out, w->kvs.size());
    for (const gguf_kv &kv : w->kvs) gguf_put_kv(out, kv);
    uint64_t off = 0;
    for (const gguf_wtensor &t : w->tensors) {
        gguf_put_str(out, t.name.data(), t.name.size());
        gguf_put_u32(out, (uint32_t)t.n_dims);
        for (int d = 0; d < t.n_dims; d++) gguf_put_u64(out, (uint64_t)t.ne[d]);
        gguf_put_u32(out, (uint32_t)t.type);
        gguf_put_u64(out, off);
        uint64_t padded;
        if (!gguf_align_up(t.size, align, &padded) || __builtin_add_overflow(off, padded, &off)) {
            *why = "tensor data size overflows";
            return false;
        }
    }
    uint64_t end;
    if (!w->tensors.empty()) {
        if (!gguf_align_up(out.size(), align, &end) || end - out.size() > SIZE_MAX / 2) {
            *why = "alignment padding too large";
            return false;
        }
        out.resize((size_t)end, 0);
    }
    return true;
}

// n bytes of p (zeros where p is NULL) at file offset *pos: a whole 4 KiB page of zeros is skipped,
// not written, so files of zeros (make-model --zero's plans for shapes of tens of GB) stay sparse;
// the caller ends the file with ftruncate at its size. The bytes read back are the same.
static bool gguf_write_data(FILE *f, uint64_t *pos, const uint8_t *p, uint64_t n) {
    static const uint8_t zeros[4096] = {0};
    while (n) {
        const size_t k = (size_t)std::min<uint64_t>(n, sizeof(zeros) - *pos % sizeof(zeros));
        const uint8_t *src = p ? p : zeros;
        if (k == sizeof(zeros) && (!p || memcmp(p, zeros, k) == 0)) {
            if (fseeko(f, (off_t)k, SEEK_CUR) != 0) return false;
        } else if (fwrite(src, 1, k, f) != k) {
            return false;
        }
        *pos += k, n -= k;
        if (p) p += k;
    }
    return true;
}

ql_status ql_gguf_write(const ql_gguf_writer *w, const char *path, char *err, size_t err_size) {
    gguf_set_err(err, err_size, "%s", "");
    if (!path) {
        gguf_set_err(err, err_size, "(null): no path given");
        return QL_ERR_INVALID;
    }
    if (!w) {
        gguf_set_err(err, err_size, "%s: NULL writer", path);
        return QL_ERR_INVALID;
    }
    if (!w->refused.empty()) {
        gguf_set_err(err, err_size, "%s: not written, an earlier call was refused: %s", path, w->refused.c_str());
        return QL_ERR_INVALID;
    }
    // the file is replaced by a rename: that would put a file where a device, a FIFO or a link was
    // (over a folder the rename fails: below)
    struct stat old_st;
    if (lstat(path, &old_st) == 0 && !S_ISREG(old_st.st_mode) && !S_ISDIR(old_st.st_mode)) {
        gguf_set_err(err, err_size, "%s: exists and is not a regular file (a %s): not replaced", path,
                     S_ISLNK(old_st.st_mode) ? "symbolic link" : "device, FIFO or socket");
        return QL_ERR_INVALID;
    }
    uint64_t align = k_gguf_default_align;
    for (const gguf_kv &kv : w->kvs) {
        std::string why;
        if (kv.key == "general.alignment" && !gguf_alignment_of(kv, &align, &why)) {
            gguf_set_err(err, err_size, "%s: %s", path, why.c_str());
            return QL_ERR_INVALID;
        }
    }
    if (align < 8 && !w->tensors.empty()) {  // (the reader would refuse the floats it put at odd addresses)
        gguf_set_err(err, err_size, "%s: general.alignment %llu: tensor data needs 8 or more (the default is 32)", path,
                     (unsigned long long)align);
        return QL_ERR_INVALID;
    }
    std::vector<uint8_t> header;
    std::string tmp;
    try {
        std::string why;
        if (!gguf_build_header(w, align, header, &why)) {
            gguf_set_err(err, err_size, "%s: %s", path, why.c_str());
            return QL_ERR_INVALID;
        }
        tmp = std::string(path) + ".tmp";
    } catch (const std::exception &) {
        gguf_set_err(err, err_size, "%s: out of memory building the header", path);
        return QL_ERR_NOMEM;
    }

    // Everything goes to path.tmp, which replaces path only once it is complete and on disk. A
    // stale path.tmp is removed and a new file made (never opened through a link: one planted at
    // path.tmp would truncate the file it points to, maybe the input being read).
    unlink(tmp.c_str());
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);  // (fopen's mode)
    FILE *f = fd < 0 ? nullptr : fdopen(fd, "wb");
    if (!f) {
        const int e = errno;
        if (fd >= 0) close(fd);
        gguf_set_err(err, err_size, "%s: cannot create %s: %s", path, tmp.c_str(), strerror(e));
        return QL_ERR_IO;
    }
    const char *what = nullptr;
    errno = 0;
    uint64_t pos = 0;  // the file offset written up to
    if (!gguf_write_data(f, &pos, header.data(), header.size())) what = "writing the header";
    std::vector<uint8_t> made;  // generated tensors' bytes, one at a time
    size_t made_size = 0;
    for (const gguf_wtensor &t : w->tensors)
        if (t.fill) made_size = std::max(made_size, t.size);
    try {
        made.resize(made_size);
    } catch (const std::exception &) {
        what = "allocating the buffer of generated tensors";
    }
    for (size_t i = 0; !what && i < w->tensors.size(); i++) {
        const gguf_wtensor &t = w->tensors[i];
        uint64_t padded = t.size;
        gguf_align_up(t.size, align, &padded);  // cannot overflow: checked building the header
        if (t.fill && !t.fill(t.fill_arg, made.data(), t.size)) {
            what = "making tensor data (the generator failed)";
            break;
        }
        const void *src = t.fill ? (const void *)made.data() : t.data;
        if (!gguf_write_data(f, &pos, (const uint8_t *)src, t.size) || !gguf_write_data(f, &pos, nullptr, padded - t.size))
            what = "writing tensor data";
    }
    if (!what && fflush(f) != 0) what = "flushing";
    if (!what && ftruncate(fileno(f), (off_t)pos) != 0) what = "setting the size";  // (a skipped page at the end)
    if (!what && fsync(fileno(f)) != 0) what = "fsync";
    int e = errno;
    if (fclose(f) != 0 && !what) {
        what = "closing";
        e = errno;
    }
    if (!what && rename(tmp.c_str(), path) != 0) {
        what = "renaming the temporary file over it";
        e = errno;
    }
    if (what) {
        remove(tmp.c_str());
        uint64_t need = header.size();  // what the whole file takes, for the user who must free it
        for (const gguf_wtensor &t : w->tensors) {
            uint64_t padded = t.size;
            gguf_align_up(t.size, align, &padded);
            need += padded;
        }
        struct stat st;
        gguf_set_err(err, err_size, "%s: %s: %s (the file needs %.1f MiB; %s)", path, what, e ? strerror(e) : "unknown error",
                     (double)need / 1048576.0, stat(path, &st) == 0 ? "the previous file is kept as it was" : "nothing was written");
        return QL_ERR_IO;
    }
    // make the rename itself durable (best effort: some file systems refuse directory fsync)
    try {
        std::string dir(path);
        const size_t slash = dir.rfind('/');
        dir = slash == std::string::npos ? "." : slash == 0 ? "/" : dir.substr(0, slash);
        const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
    } catch (const std::exception &) {
    }
    return QL_OK;
}

// ============================================================================================
// 16. optimizer math
// ============================================================================================

void ql_adamw_update(ql_tensor *param, ql_tensor *m, ql_tensor *v, int64_t step, const ql_adamw_params *p,
                     float grad_scale) {
    QL_ASSERT(param && param->grad && m && v && p && step >= 1);
    QL_ASSERT(param->type == QL_TYPE_F32 && ql_is_contiguous(param) && ql_is_contiguous(m) && ql_is_contiguous(v));
    const int64_t n = ql_nelements(param);
    QL_ASSERT(ql_nelements(m) == n && ql_nelements(v) == n && ql_nelements(param->grad) == n);
    float *w = (float *)param->data, *mm = (float *)m->data, *vv = (float *)v->data;
    const float *g = (const float *)param->grad->data;
    // bias corrections folded into the step size (Adam paper, sec. 2)
    const double bc1 = 1.0 - std::pow((double)p->beta1, (double)step), bc2 = 1.0 - std::pow((double)p->beta2, (double)step);
    const float step_size = (float)(p->lr * std::sqrt(bc2) / bc1), eps = (float)(p->eps * std::sqrt(bc2));
    const float decay = 1.0f - p->lr * p->weight_decay;
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] * grad_scale;
        mm[i] = p->beta1 * mm[i] + (1.0f - p->beta1) * gi;
        vv[i] = p->beta2 * vv[i] + (1.0f - p->beta2) * gi * gi;
        w[i] = w[i] * decay - step_size * mm[i] / (std::sqrt(vv[i]) + eps);
    }
}

void ql_adamw8bit_update(ql_tensor *param, ql_tensor *m, ql_tensor *m_absmax, ql_tensor *v, ql_tensor *v_absmax,
                         int64_t step, const ql_adamw_params *p, float grad_scale) {
    QL_ASSERT(param && param->grad && m && v && m_absmax && v_absmax && p && step >= 1);
    QL_ASSERT(param->type == QL_TYPE_F32 && m->type == QL_TYPE_I8 && v->type == QL_TYPE_I8 && m_absmax->type == QL_TYPE_F32 &&
              v_absmax->type == QL_TYPE_F32);
    const int64_t n = ql_nelements(param), nb = (n + QL_OPT8_BLOCK - 1) / QL_OPT8_BLOCK;
    QL_ASSERT(ql_nelements(m) == n && ql_nelements(v) == n && ql_nelements(m_absmax) == nb && ql_nelements(v_absmax) == nb);
    const float *map_m = ql_dynamic_map_signed(), *map_v = ql_dynamic_map_unsigned();
    float *w = (float *)param->data, *am = (float *)m_absmax->data, *av = (float *)v_absmax->data;
    uint8_t *qm = (uint8_t *)m->data, *qv = (uint8_t *)v->data;
    const float *g = (const float *)param->grad->data;
    const double bc1 = 1.0 - std::pow((double)p->beta1, (double)step), bc2 = 1.0 - std::pow((double)p->beta2, (double)step);
    const float step_size = (float)(p->lr * std::sqrt(bc2) / bc1), eps = (float)(p->eps * std::sqrt(bc2));
    const float decay = 1.0f - p->lr * p->weight_decay;
    float sm[QL_OPT8_BLOCK], sv[QL_OPT8_BLOCK];  // one block's state, in f32
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i0 = b * QL_OPT8_BLOCK, len = std::min<int64_t>(QL_OPT8_BLOCK, n - i0);
        float mx_m = 0, mx_v = 0;
        for (int64_t k = 0; k < len; k++) {
            const int64_t i = i0 + k;
            const float gi = g[i] * grad_scale;
            float mi = map_m[qm[i]] * am[b], vi = map_v[qv[i]] * av[b];
            if (std::isfinite(gi)) {
                mi = p->beta1 * mi + (1.0f - p->beta1) * gi;
                vi = p->beta2 * vi + (1.0f - p->beta2) * gi * gi;
                w[i] = w[i] - step_size * mi / (std::sqrt(vi) + eps);
                w[i] = w[i] * decay;  // decoupled decay after the update, as bitsandbytes
            } else {
                mi = vi = 0.0f;
            }
            sm[k] = mi;
            sv[k] = vi;
            mx_m = std::max(mx_m, std::fabs(mi));
            mx_v = std::max(mx_v, vi);
        }
        am[b] = mx_m;  // the absmax of the updated state
        av[b] = mx_v;
        const float im = mx_m > 0 ? 1.0f / mx_m : 0.0f, iv = mx_v > 0 ? 1.0f / mx_v : 0.0f;
        for (int64_t k = 0; k < len; k++) {
            qm[i0 + k] = ql_dynamic_quantize(map_m, sm[k] * im);
            qv[i0 + k] = ql_dynamic_quantize(map_v, sv[k] * iv);
        }
    }
}
